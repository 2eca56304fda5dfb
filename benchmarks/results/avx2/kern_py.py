import time, torch, numpy as np, sys
sys.path.insert(0, "/work/main/tests")
from _gguf import q4_1
from heterospec.models import cpu_gemm
G = cpu_gemm._rows_module()
torch.manual_seed(0)
def q4w(n, k):  # a Q4_1-exact weight
    q = torch.randint(0, 16, (n, k)).float()
    d = (torch.rand(n, k // 32) * 0.01).float(); d = (d.view(torch.int32) & ~0xFFFF).view(torch.float32)
    m = -8 * d
    return (q.view(n, k // 32, 32) * d[..., None] + m[..., None]).reshape(n, k)  # fmaf? use exact products
n, k = int(sys.argv[1]), int(sys.argv[2]); threads = int(sys.argv[3])
w = torch.from_numpy(q4_1(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05))
res = {}
for coded in (False, True):
    wp = cpu_gemm.pack_rows(w, coded=coded); codec = cpu_gemm.packed_codec(wp)
    row = []
    for m in (1, 2, 3, 4, 6, 8, 12):
        x = torch.randn(m, k); y = torch.empty(m, n)
        f = lambda: G.linear(x.data_ptr(), k, wp.data_ptr(), 0, y.data_ptr(), n, m, n, k, 1, threads)
        for _ in range(5): f()
        ts = []
        for _ in range(40):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        row.append(min(ts) * 1e6)
    print(f"{n}x{k} {codec:4s} t{threads}", " ".join(f"{v:8.1f}" for v in row), "us (m=1,2,3,4,6,8,12)")
