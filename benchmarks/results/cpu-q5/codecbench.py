"""One linear call of Q5_K-valued weights (8192 x 1536, 12 copies so that they stream from memory, not the
caches) packed as Q5 and as Q8X, and of Q6_K-valued ones as Q8H and as Q8X, on AVX2 and AVX-512, 2 threads: the best
of 8 passes, ms per matrix."""
import sys, time, numpy as np, torch
sys.path.insert(0, "/work/main")
from heterospec import _gemm as G
from tests._gguf import q5_k, q6_k

rng = np.random.default_rng(0)


def packed(codec, w):
    wt = torch.from_numpy(np.ascontiguousarray(w, np.float32)); n, k = wt.shape
    size = 16 if codec in (5, 7) else 32
    q, d = torch.empty((n, k), dtype=torch.int8), torch.empty((n, k // size))
    m = torch.empty_like(d) if codec != 7 else None
    assert G.find_codes(codec, wt.data_ptr(), q.data_ptr(), d.data_ptr(), 0 if m is None else m.data_ptr(), n, k)
    wp = torch.empty(G.packed_bytes(codec, n, k), dtype=torch.uint8)
    G.pack_codes(codec, q.data_ptr(), d.data_ptr(), 0 if m is None else m.data_ptr(), wp.data_ptr(), n, k)
    return wp


n, k = 8192, 1536
names = {5: "Q8X", 6: "Q5", 7: "Q8H"}
for label, make, codecs in (("Q5_K", q5_k, (6, 5)), ("Q6_K", q6_k, (7, 5))):
    w = make(rng.standard_normal((n, k)) * 0.05)
    wps = {c: [packed(c, w) for _ in range(12)] for c in codecs}
    for isa in [i for i in (1, 2) if i <= G.isa_best()]:
        for m in (1, 5, 64):
            x = torch.randn(m, k); y = torch.empty(m, n)
            res = []
            for c in codecs:
                best = 1e9
                for rep in range(8):
                    t = time.perf_counter()
                    for wp in wps[c]:
                        G.linear(x.data_ptr(), k, wp.data_ptr(), 0, y.data_ptr(), n, m, n, k, isa, 2)
                    best = min(best, (time.perf_counter() - t) / len(wps[c]))
                res.append(f"{names[c]} {best * 1e3:.2f} ms ({wps[c][0].numel() / n / k:.3f} B/w)")
            print(label, "isa", isa, "rows", m, " | ".join(res), flush=True)
    del wps
