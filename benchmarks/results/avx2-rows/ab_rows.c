/* Two builds of csrc/gemm/rows.c side by side in one process (dlopen), interleaved: for each row count 1-12, 40
 * rounds that time each build in turn on the same weights and rows, keeping each build's fastest; the outputs must
 * be equal bit for bit (else MISMATCH).  Prints cycles per 32 weights x threads at 3.07 GHz (the Zen 3 VM's clock).
 *   gcc -std=c11 -O3 -fPIC -shared -fno-trapping-math -fno-math-errno -fopenmp -Icsrc/gemm -o lib0.so rows_before.c -lm
 *   gcc -std=c11 -O3 -fPIC -shared -fno-trapping-math -fno-math-errno -fopenmp -Icsrc/gemm -o lib1.so csrc/gemm/rows.c -lm
 *   gcc -O2 -Icsrc/gemm -o ab benchmarks/results/avx2-rows/ab_rows.c -ldl
 *   ./ab N K CODEC THREADS ./lib0.so ./lib1.so      (CODEC 2: Q4, 1: Q8; kernel.txt: 1536 576 2 1, 1536 576 1 1,
 *                                                     49152 576 1 2) */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <dlfcn.h>
#include "rows.h"
typedef void (*lin_t)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int, int);
typedef int (*packc_t)(int, const int8_t*, const float*, const float*, void*, int64_t, int64_t);
static double now(){ struct timespec a; clock_gettime(CLOCK_MONOTONIC,&a); return a.tv_sec+a.tv_nsec*1e-9; }
int main(int argc, char **argv){
  int64_t n = atol(argv[1]), k = atol(argv[2]); int codec = atoi(argv[3]); int th = atoi(argv[4]); int nv = argc - 5;
  lin_t lin[8]; void *wp[8];
  int8_t *q = malloc(n*k); float *d = malloc(n*k/32*4), *m = malloc(n*k/32*4);
  for (int64_t i=0;i<n*k;i++) q[i]= codec==HSG_Q4 ? rand()%16 : (rand()%255)-127;
  for (int64_t i=0;i<n*k/32;i++){ d[i]=0.015625f*(1+i%3); m[i]=-0.125f; }
  for (int v=0; v<nv; v++){ void *h = dlopen(argv[5+v], RTLD_NOW|RTLD_LOCAL); if(!h){puts(dlerror());return 1;}
    lin[v] = (lin_t)dlsym(h,"hsg_linear"); packc_t pc = (packc_t)dlsym(h,"hsg_pack_codes");
    int64_t (*pb)(int,int64_t,int64_t) = (int64_t(*)(int,int64_t,int64_t))dlsym(h,"hsg_packed_bytes"); wp[v] = aligned_alloc(64, pb(codec,n,k)); if (pc(codec,q,d,m,wp[v],n,k)) return 1; }
  float *x = malloc(12*k*4), *y = malloc(12*n*4), *y0 = malloc(12*n*4);
  for (int64_t i=0;i<12*k;i++) x[i]=(rand()%100)/100.0f-0.3f;
  printf("%s n=%ld k=%ld threads=%d (cycles/32w x threads, min of 40 interleaved)\n", codec==HSG_Q4?"Q4":"Q8", (long)n, (long)k, th);
  for (int mm=1; mm<=12; mm++){
    int reps = 100000000LL / (n*k) / 4 + 1; double best[8]; for(int v=0;v<nv;v++) best[v]=1e9;
    for (int r=0;r<40;r++) for (int v=0; v<nv; v++){ double t=now(); for(int i=0;i<reps;i++) lin[v](x,k,wp[v],NULL,y,n,mm,n,k,1,th); t=(now()-t)/reps; if(t<best[v])best[v]=t;
      if (v==0) for(int64_t i=0;i<mm*n;i++) y0[i]=y[i]; else for(int64_t i=0;i<mm*n;i++) if (y0[i]!=y[i]) {printf("MISMATCH v%d m%d\n",v,mm); return 1;} }
    printf("m=%d", mm); for(int v=0;v<nv;v++) printf("  %s %.2f", argv[5+v], best[v]*3.07e9/(n*k/32.0)*th); printf("\n");
  }
}
