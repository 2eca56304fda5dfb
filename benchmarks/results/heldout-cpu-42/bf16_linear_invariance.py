import torch
torch.manual_seed(0)
F = torch.nn.functional
for (k, n_out) in ((576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)):
    w = (torch.randn(n_out, k) / k ** 0.5).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    paths = {"default": lambda x: F.linear(x, w), "packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
    x0 = torch.randn(1, k).to(torch.bfloat16)
    for name, f in paths.items():
        ref = f(torch.cat([x0, torch.randn(1, k).to(torch.bfloat16)]))[0]
        diffs = []
        for n in (3, 5, 8, 16, 17, 33, 48, 60, 64, 100):
            x = torch.cat([x0, torch.randn(n - 1, k).to(torch.bfloat16)])
            # also x0 at another row position
            y = f(x)[0]; x2 = torch.cat([torch.randn(n // 2, k).to(torch.bfloat16), x0, torch.randn(n - 1 - n // 2, k).to(torch.bfloat16)])
            y2 = f(x2)[n // 2]
            diffs.append(f"{n}:{(y != ref).float().mean().item():.3f}/{(y2 != ref).float().mean().item():.3f}")
        print(f"{k}x{n_out} {name:8s} vs M=2 (row 0 / row n//2): {' '.join(diffs)}")
