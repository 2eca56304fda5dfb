"""Is a bf16 linear's row the same whatever the row count? torch's default, oneDNN packed, and oneDNN packed
called on fixed 16-row tiles (zero-padded). Fraction of output elements of row 0 that differ between a
1-row call and an n-row call (other rows random), and the time per call."""
import time, torch
torch.manual_seed(0)
F = torch.nn.functional
for (k, n_out) in ((576, 1536), (1536, 576), (576, 49152)):
    w = (torch.randn(n_out, k) / k ** 0.5).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    pw = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    def tiled(x, T=16):
        m = x.shape[0]; pad = (-m) % T
        xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
        return torch.cat([pw(xp[i:i + T]) for i in range(0, xp.shape[0], T)])[:m]
    paths = {"default": lambda x: F.linear(x, w), "packed": pw, "packed-16-tiles": tiled}
    x0 = torch.randn(1, k).to(torch.bfloat16)
    for name, f in paths.items():
        ref = f(x0)[0]
        diffs = []
        for n in (2, 5, 8, 16, 17, 33, 60):
            x = torch.cat([x0, torch.randn(n - 1, k).to(torch.bfloat16)])
            diffs.append(f"{n}:{(f(x)[0] != ref).float().mean().item():.3f}")
        def t(n):
            x = torch.randn(n, k).to(torch.bfloat16); f(x)
            ts = []
            for _ in range(7):
                s = time.perf_counter(); f(x); ts.append(time.perf_counter() - s)
            return sorted(ts)[3] * 1e3
        print(f"{k}x{n_out} {name:16s} differ {' '.join(diffs)} | ms 1:{t(1):.3f} 8:{t(8):.3f} 16:{t(16):.3f} 60:{t(60):.3f}")
