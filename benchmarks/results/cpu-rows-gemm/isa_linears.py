"""The default target's linear layers alone (30 layers of 7 shapes + the output layer, random float32 weights), one pass
at 1, 6 and 12 rows, median ms of 7: torch's default against the rows kernel forced to AVX-512 and to AVX2 on the same
machine (a proxy for an AVX2-only CPU, not a measurement of one), and the portable loop once.
python benchmarks/results/cpu-rows-gemm/isa_linears.py"""
import torch, time
from heterospec.models import cpu_gemm
G=cpu_gemm._rows_module()
torch.manual_seed(0)
shapes=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
Ws=[[torch.randn(n,k) for n,k in shapes] for _ in range(30)]+[[torch.randn(49152,576)]]
P=[[cpu_gemm.pack_rows(W) for W in L] for L in Ws]
def step(M,isa):
    xs={576:torch.randn(M,576),1536:torch.randn(M,1536)}
    for L,PL in zip(Ws,P):
        for W,wp in zip(L,PL):
            n,k=W.shape; x=xs[k]; y=torch.empty(M,n)
            G.linear(x.data_ptr(),k,wp.data_ptr(),0,y.data_ptr(),n,M,n,k,isa,0)
def base(M):
    xs={576:torch.randn(M,576),1536:torch.randn(M,1536)}
    for L in Ws:
        for W in L: torch.nn.functional.linear(xs[W.shape[1]],W)
def med(f):
    f(); ts=[]
    for _ in range(7):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return sorted(ts)[3]*1e3
print("rows  torch  avx512  avx2  portable(1 rep)")
for M in (1,6,12):
    print(M, "%.1f %.1f %.1f"%(med(lambda: base(M)), med(lambda: step(M,2)), med(lambda: step(M,1))))
t=time.perf_counter(); step(1,0); print("portable 1 row %.0f ms"%((time.perf_counter()-t)*1e3))
