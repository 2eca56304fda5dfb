/* The float16 / bfloat16 twin of ab_rows.c (same builds, same rounds): ./ab16 N K CODEC THREADS ./lib0.so ./lib1.so
 * (CODEC 3: float16, 4: bfloat16; kernel16.txt: 1536 576 3 1 and 8192 576 3 2). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <dlfcn.h>
#include "rows.h"
typedef void (*lin_t)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int, int);
static double now(){ struct timespec a; clock_gettime(CLOCK_MONOTONIC,&a); return a.tv_sec+a.tv_nsec*1e-9; }
int main(int argc, char **argv){
  int64_t n = atol(argv[1]), k = atol(argv[2]); int codec = atoi(argv[3]); int th = atoi(argv[4]); int nv = argc - 5;
  lin_t lin[4]; void *wp[4];
  uint16_t *w = malloc(n*k*2); for (int64_t i=0;i<n*k;i++) w[i]= codec==3 ? 0x3c00 + rand()%512 : 0x3f80 + rand()%64;
  for (int v=0; v<nv; v++){ void *h = dlopen(argv[5+v], RTLD_NOW|RTLD_LOCAL); lin[v] = dlsym(h,"hsg_linear");
    int64_t (*pb)(int,int64_t,int64_t) = dlsym(h,"hsg_packed_bytes"); int (*ph)(int,const uint16_t*,void*,int64_t,int64_t) = dlsym(h,"hsg_pack_half");
    wp[v] = aligned_alloc(64, pb(codec,n,k)); if (ph(codec,w,wp[v],n,k)) {puts("pack");return 1;} }
  float *x = malloc(12*k*4), *y = malloc(12*n*4), *y0 = malloc(12*n*4);
  for (int64_t i=0;i<12*k;i++) x[i]=(rand()%100)/100.0f-0.3f;
  printf("%s n=%ld k=%ld threads=%d (cycles/32w x threads, min of 40 interleaved)\n", codec==3?"F16":"BF16", (long)n, (long)k, th);
  for (int mm=1; mm<=12; mm++){ int reps = 100000000LL/(n*k)/4+1; double best[4]={1e9,1e9,1e9,1e9};
    for (int r=0;r<40;r++) for (int v=0; v<nv; v++){ double t=now(); for(int i=0;i<reps;i++) lin[v](x,k,wp[v],NULL,y,n,mm,n,k,1,th); t=(now()-t)/reps; if(t<best[v])best[v]=t;
      if (v==0) for(int64_t i=0;i<mm*n;i++) y0[i]=y[i]; else for(int64_t i=0;i<mm*n;i++) if (y0[i]!=y[i]) {printf("MISMATCH v%d m%d\n",v,mm); return 1;} }
    printf("m=%d", mm); for(int v=0;v<nv;v++) printf("  %.2f", best[v]*3.07e9/(n*k/32.0)*th); printf("\n"); }
}
