"""bf16 SDPA on the CPU: is a query's output the same in a 1-query step (keys = prefix + itself, contiguous) and
as row 0 / row j of an n-query verify (keys = prefix + n tree slots, masked)?"""
import torch
F = torch.nn.functional
torch.manual_seed(0)
H, D, L = 9, 64, 200
for dtype in (torch.bfloat16, torch.float32):
    K = torch.randn(1, H, L + 64, D).to(dtype); V = torch.randn(1, H, L + 64, D).to(dtype)
    q = torch.randn(1, H, 64, D).to(dtype)
    # decode step of query 0: keys 0..L (its own key at L)
    ref = F.scaled_dot_product_attention(q[:, :, :1], K[:, :, :L + 1], V[:, :, :L + 1])
    res = []
    for n in (2, 4, 8, 16, 60):
        mask = torch.zeros(n, L + n, dtype=torch.bool)
        mask[:, :L] = True
        for i in range(n):
            mask[i, L:L + i + 1] = True         # a chain: row i sees nodes 0..i
        out = F.scaled_dot_product_attention(q[:, :, :n], K[:, :, :L + n], V[:, :, :L + n], attn_mask=mask)
        res.append(f"{n}:{(out[:, :, 0] != ref[:, :, 0]).float().mean().item():.3f}")
    # the same query with 1 query but keys padded with masked slots after it (a verify of one row, capacity 16)
    mask1 = torch.zeros(1, L + 16, dtype=torch.bool); mask1[0, :L + 1] = True
    pad = F.scaled_dot_product_attention(q[:, :, :1], K[:, :, :L + 16], V[:, :, :L + 16], attn_mask=mask1)
    # the explicit all-true mask on the contiguous keys
    m_all = torch.ones(1, L + 1, dtype=torch.bool)
    withmask = F.scaled_dot_product_attention(q[:, :, :1], K[:, :, :L + 1], V[:, :, :L + 1], attn_mask=m_all)
    print(dtype, "row 0 of an n-row chain verify vs the 1-row step:", " ".join(res),
          "| 1 row, masked tail:", f"{(pad != ref).float().mean().item():.3f}",
          "| 1 row, all-true mask:", f"{(withmask != ref).float().mean().item():.3f}")
