"""The one-to-48-row float32 matrix products of the default target's shapes: torch's `linear`, the packed oneDNN
path (cpu_gemm) and a probe kernel (gemv_probe.c: AVX2/FMA, the calling thread plus one spinning worker thread),
each in a process of its own (the probe's worker would otherwise spin beside torch's threads), in GB/s of weights
streamed; and torch's own sum over 256 MB for the machine's bandwidth.  Build and run from this folder:
    gcc -O3 -shared -fPIC -o libgemv_probe.so gemv_probe.c -lpthread
    for m in sum torch packed probe; do python gemv_probe.py $m; done"""
import ctypes
import os
import sys
import time

import torch

torch.set_num_threads(2)
mode = sys.argv[1]
if mode == "sum":
    a = torch.randn(64 * 2**20)
    a.sum()
    t = time.perf_counter()
    for _ in range(10):
        a.sum()
    print("sum GB/s", f"{a.numel() * 4 / ((time.perf_counter() - t) / 10) / 1e9:.1f}")
    sys.exit()
lib = ctypes.CDLL(os.path.abspath("libgemv_probe.so")) if mode == "probe" else None
pw = torch.ops.mkldnn._linear_pointwise


def bench(f, ws, nbytes):
    for w in ws[:3]:
        f(w)
    best = 0
    for _ in range(2):
        t = time.perf_counter()
        for w in ws:
            f(w)
        best = max(best, nbytes * len(ws) / (time.perf_counter() - t) / 1e9)
    return best


for o, i in [(1536, 576), (576, 1536), (576, 576), (49152, 576)]:
    ws = [torch.randn(o, i) for _ in range(max(8, int(600e6 / (o * i * 4))))]   # 600 MB: streamed from memory
    line = f"{mode} {o}x{i}:"
    for m in (1, 2, 6, 8, 16, 48):
        x, y = torch.randn(m, i), torch.empty(m, o)
        if mode == "packed":
            ps = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]
            r = bench(lambda p: pw(x, p, None, "none", [], ""), ps, o * i * 4)
            del ps
        elif mode == "torch":
            r = bench(lambda w: torch.nn.functional.linear(x, w), ws, o * i * 4)
        else:
            r = bench(lambda w: lib.gemm2(ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                                          ctypes.c_void_p(y.data_ptr()), None, m, i, o), ws, o * i * 4)
        line += f"  M{m} {r:5.1f}"
    print(line, flush=True)
    del ws
