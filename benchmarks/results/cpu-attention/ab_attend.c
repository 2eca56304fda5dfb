/* Two builds of csrc/gemm/decoder.c (+ rows.c) side by side in one process (dlopen), interleaved: hsd_attend for
 * one query row of one head over W keys (all allowed), head dim d, 30 rounds each keeping each build's fastest;
 * outputs equal bit for bit or MISMATCH.  Prints ns per call and cycles per key at 3.07 GHz.
 *   gcc -std=c11 -O3 -fPIC -shared -fno-trapping-math -fno-math-errno -fopenmp -Icsrc/gemm -o lib0.so OLD/decoder.c OLD/rows.c -lm
 *   gcc -std=c11 -O3 -fPIC -shared -fno-trapping-math -fno-math-errno -fopenmp -Icsrc/gemm -o lib1.so csrc/gemm/decoder.c csrc/gemm/rows.c -lm
 *   gcc -O2 -Icsrc/gemm -o ab_attend ab_attend.c -ldl && ./ab_attend ./lib0.so ./lib1.so */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <dlfcn.h>
typedef void (*att_t)(const float *, const float *, const float *, int64_t, const uint8_t *, int64_t, float, float *,
                      int64_t, float *, int64_t *, int);
static double now(){ struct timespec a; clock_gettime(CLOCK_MONOTONIC,&a); return a.tv_sec+a.tv_nsec*1e-9; }
int main(int argc, char **argv){
  int nv = argc - 1; att_t att[8];
  for (int v = 0; v < nv; v++) { void *h = dlopen(argv[1+v], RTLD_NOW|RTLD_LOCAL); if (!h) { puts(dlerror()); return 1; }
    att[v] = (att_t)dlsym(h, "hsd_attend"); if (!att[v]) { puts("no hsd_attend"); return 1; } }
  int isa = 1; /* AVX2 */
  int64_t Ws[] = {16, 64, 200, 800, 2000}, ds[] = {64, 128, 80};
  for (int di = 0; di < 3; di++) for (int wi = 0; wi < 5; wi++) {
    int64_t W = Ws[wi], d = ds[di];
    float *q = malloc(d*4), *k = malloc(W*d*4), *v = malloc(W*d*4), *out = malloc(d*4), *out0 = malloc(d*4), *sc = malloc(W*4);
    int64_t *cols = malloc(W*8); uint8_t *al = malloc(W);
    for (int64_t i = 0; i < d; i++) q[i] = (rand()%200)/100.0f - 1;
    for (int64_t i = 0; i < W*d; i++) { k[i] = (rand()%200)/100.0f - 1; v[i] = (rand()%200)/100.0f - 1; }
    for (int64_t j = 0; j < W; j++) al[j] = (j % 7) != 3;
    int reps = 2000000 / (W*d) + 1; double best[8];
    for (int x = 0; x < nv; x++) best[x] = 1e9;
    for (int r = 0; r < 30; r++) for (int x = 0; x < nv; x++) {
      double t = now(); for (int i = 0; i < reps; i++) att[x](q, k, v, d, al, W, 0.125f, out, d, sc, cols, isa); t = (now()-t)/reps;
      if (t < best[x]) best[x] = t;
      if (x == 0) memcpy(out0, out, d*4); else if (memcmp(out0, out, d*4)) { printf("MISMATCH W=%ld d=%ld\n", (long)W, (long)d); return 1; }
    }
    printf("d=%3ld W=%5ld", (long)d, (long)W);
    for (int x = 0; x < nv; x++) printf("  %s %8.0f ns (%5.1f cyc/key)", argv[1+x], best[x]*1e9, best[x]*3.07e9/W);
    printf("  new/old %.2f\n", best[nv-1]/best[0]);
  }
}
