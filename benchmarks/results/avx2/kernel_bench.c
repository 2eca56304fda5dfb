/* The few-rows kernel alone, one thread, a Q4 (or, with a 4th argument, float32) N x K weight, rows 1-12:
 * microseconds a call and cycles per 32 weights at 3.07 GHz (the Zen 3 VM's clock, measured with a chain of adds).
 *   gcc -std=c11 -O3 -fno-trapping-math -fno-math-errno -fopenmp -Icsrc/gemm -o kb \
 *       benchmarks/results/avx2/kernel_bench.c csrc/gemm/rows.c -lm && ./kb 1536 576 1     (ISA 1: AVX2) */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "rows.h"
static double now(){ struct timespec a; clock_gettime(CLOCK_MONOTONIC,&a); return a.tv_sec+a.tv_nsec*1e-9; }
int main(int argc, char **argv){
  int64_t n = atol(argv[1]), k = atol(argv[2]); int isa = atoi(argv[3]);
  int8_t *q = malloc(n*k); float *d = malloc(n*k/32*4), *m = malloc(n*k/32*4);
  for (int64_t i=0;i<n*k;i++) q[i]=rand()%16;
  for (int64_t i=0;i<n*k/32;i++){ d[i]=0.015625f; m[i]=-0.125f; }
  void *wp = aligned_alloc(64, hsg_packed_bytes(HSG_Q4,n,k));
  if (hsg_pack_codes(HSG_Q4,q,d,m,wp,n,k)) { puts("pack"); return 1; }
  if (argc > 4) { float *w = malloc(n*k*4); for (int64_t i=0;i<n*k;i++) w[i] = q[i]*d[0]+m[0];
    void *wf = aligned_alloc(64, hsg_packed_floats(n,k)*4); hsg_pack(w,k,wf,n,k); wp = wf; }
  float *x = malloc(12*k*4), *y = malloc(12*n*4);
  for (int64_t i=0;i<12*k;i++) x[i]=(rand()%100)/100.0f;
  int ms[] = {1,2,3,4,6,8,12};
  for (int mi=0; mi<7; mi++){ int mm = ms[mi];
    int reps = 2000000000LL / (n*k) / 4 + 1; double best=1e9;
    for (int r=0;r<5;r++){ double t=now(); for(int i=0;i<reps;i++) hsg_linear(x,k,wp,NULL,y,n,mm,n,k,isa,1); t=(now()-t)/reps; if(t<best)best=t; }
    printf("m=%2d %8.2f us  %.2f cycles/32w (at 3.07GHz)\n", mm, best*1e6, best*3.07e9/(n*k/32.0));
  }
}
