/*
 * decoder.c -- the Llama-family decoder forward in float32 on the CPU (decoder.h says what and why).
 *
 * The matrix products are rows.h's kernel; the rest are short loops.  Only the dot product (a reduction) is
 * written with intrinsics, so that its order is the one decoder.h fixes on every instruction set; every other
 * loop is elementwise plain C, compiled once per instruction set (target attributes) and vectorised by the
 * compiler, which cannot change an elementwise result (-std=c11: no contraction, no reassociation).
 */
#include "decoder.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- the dot product: 16 lanes of in-order fused multiply-adds, then a fixed tree --------------------------- */

static float reduce16(const float *acc) {
    float t[8];
    for (int l = 0; l < 8; l++) t[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) t[l] = t[l] + t[l + 4];
    for (int l = 0; l < 2; l++) t[l] = t[l] + t[l + 2];
    return t[0] + t[1];
}

static float dot_portable(const float *a, const float *b, int64_t d) {
    float acc[16] = {0};
    int64_t c = 0;
    for (; c + 16 <= d; c += 16)
        for (int l = 0; l < 16; l++) acc[l] = fmaf(a[c + l], b[c + l], acc[l]);
    for (int l = 0; c + l < d; l++) acc[l] = fmaf(a[c + l], b[c + l], acc[l]);
    return reduce16(acc);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HSD_X86 1
#define T512 __attribute__((target("avx512f")))
#define T256 __attribute__((target("avx2,fma")))

static T512 float dot512(const float *a, const float *b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
    if (c < d) { /* the lanes past d keep their sums (mask3: c where the mask is off) */
        __mmask16 m = (__mmask16)((1u << (d - c)) - 1u);
        acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, a + c), _mm512_maskz_loadu_ps(m, b + c), acc, m);
    }
    __m256 lo = _mm512_castps512_ps256(acc), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    __m256 t8 = _mm256_add_ps(lo, hi);                                              /* l + (l+8) */
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1)); /* + (l+4) */
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));                               /* + (l+2) */
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));                 /* + (l+1) */
}

static T256 __m256 lanes_below(int64_t rem) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(rem < 8 ? (rem < 0 ? 0 : rem) : 8)), idx));
}

static T256 float dot256(const float *a, const float *b, int64_t d) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();   /* lanes 0-7 and 8-15 */
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), hi);
    }
    if (c < d) {
        int64_t rem = d - c;
        __m256 m0 = lanes_below(rem), m1 = lanes_below(rem - 8);
        __m256i i0 = _mm256_castps_si256(m0), i1 = _mm256_castps_si256(m1);
        __m256 f0 = _mm256_fmadd_ps(_mm256_maskload_ps(a + c, i0), _mm256_maskload_ps(b + c, i0), lo);
        lo = _mm256_blendv_ps(lo, f0, m0);
        if (rem > 8) {
            __m256 f1 = _mm256_fmadd_ps(_mm256_maskload_ps(a + c + 8, i1), _mm256_maskload_ps(b + c + 8, i1), hi);
            hi = _mm256_blendv_ps(hi, f1, m1);
        }
    }
    __m256 t8 = _mm256_add_ps(lo, hi);
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

/* Attention's two loops for AVX2, which AVX-512 machines run too (the arithmetic is fixed, not the width):
 * - scores256: s[c] = dot(q, k + cols[c] * stride) * scale, each dot exactly dot256's (and so dot512's and dot16's)
 *   lanes and tree.  Four keys at a time share q's loads, and their trees run side by side in registers (the same
 *   pairs added, each key in lanes of its own).  Returns max_c s[c] (NaNs passed over, -inf if none), taken
 *   lane-wise, not in order of c: a maximum is the same value in any order, and the one thing order could choose,
 *   +0 or -0, makes no difference (s - mx is then +-0, and exp gives 1 for both).
 * - pv256: out[e] = sum_c fma(p[c], v[cols[c]][e], .) in order of c, as the portable loop computes it, with out held
 *   in 8 registers (64 floats) at a time instead of loaded and stored per key; and l = sum_c p[c] in order.
 * (Attention of one query row over W keys, head dim 64, 2-core Zen 3: about half the time of the loop of dots
 * and axpys it replaced; a prompt's prefill, where attention over L2-resident keys is compute-bound, gains most.)
 *
 * dots256x4: dot256's lanes before its tree for four keys (8 chains of multiply-adds); t[i] lane l holds lanes
 * l + (l+8) of key i. */
static inline __attribute__((always_inline)) T256 void dots256x4(const float *q, const float *const *kk, int64_t d,
                                                                  __m256 *t) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        __m256 qa = _mm256_loadu_ps(q + c), qb = _mm256_loadu_ps(q + c + 8);
        for (int i = 0; i < 4; i++) {
            lo[i] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(kk[i] + c), lo[i]);
            hi[i] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(kk[i] + c + 8), hi[i]);
        }
    }
    if (c < d) { /* dot256's tail, key by key */
        int64_t rem = d - c;
        __m256 m0 = lanes_below(rem), m1 = lanes_below(rem - 8);
        __m256i i0 = _mm256_castps_si256(m0), i1 = _mm256_castps_si256(m1);
        __m256 qa = _mm256_maskload_ps(q + c, i0), qb = _mm256_maskload_ps(q + c + 8, i1);
        for (int i = 0; i < 4; i++) {
            lo[i] = _mm256_blendv_ps(lo[i], _mm256_fmadd_ps(qa, _mm256_maskload_ps(kk[i] + c, i0), lo[i]), m0);
            if (rem > 8)
                hi[i] = _mm256_blendv_ps(hi[i], _mm256_fmadd_ps(qb, _mm256_maskload_ps(kk[i] + c + 8, i1), hi[i]), m1);
        }
    }
    for (int i = 0; i < 4; i++) t[i] = _mm256_add_ps(lo[i], hi[i]);
}

static T256 float scores256(const float *q, const float *k, int64_t stride, const int64_t *cols, int64_t cnt,
                            int64_t d, float scale, float *s) {
    int64_t c = 0;
    float mx = -INFINITY;
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* keys 0, 1, 2, 3 first */
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; c + 4 <= cnt; c += 4) {
        const float *kk[4] = {k + cols[c] * stride, k + cols[c + 1] * stride, k + cols[c + 2] * stride,
                              k + cols[c + 3] * stride};
        __m256 t[4];
        dots256x4(q, kk, d, t);
        /* + (l+4): [t0 lanes 0-3 | t1 lanes 0-3] + [t0 lanes 4-7 | t1 lanes 4-7] */
        __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
        __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(t[2], t[3], 0x20), _mm256_permute2f128_ps(t[2], t[3], 0x31));
        /* + (l+2): [key0 0,1 | key2 0,1 | key1 0,1 | key3 0,1] */
        __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
        /* + (l+1): lanes [key0, key2, key0, key2 | key1, key3, key1, key3] */
        __m256 f = _mm256_add_ps(_mm256_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
        f = _mm256_mul_ps(f, sc);
        vm = _mm256_max_ps(f, vm); /* f > vm ? f : vm, lane by lane (a NaN score is passed over, as below) */
        _mm_storeu_ps(s + c, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(f, order)));
    }
    {
        float o[8];
        _mm256_storeu_ps(o, vm);
        for (int i = 0; i < 8; i++) mx = o[i] > mx ? o[i] : mx;
    }
    for (; c < cnt; c++) {
        s[c] = dot256(q, k + cols[c] * stride, d) * scale;
        mx = s[c] > mx ? s[c] : mx;
    }
    return mx;
}

static T256 float pv256(const float *p, const float *v, int64_t stride, const int64_t *cols, int64_t cnt, int64_t d,
                        float *out) {
    float l = 0.0f; /* in the first block's loop, beside its multiply-adds */
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
        int64_t w = d - e0 < 64 ? d - e0 : 64, full = w / 8, rem = w % 8;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        const __m256i tail = _mm256_castps_si256(lanes_below(rem));
        const int first = e0 == 0; /* (loop-invariant: the compiler unswitches it) */
        if (full == 8) {
            for (int64_t c = 0; c < cnt; c++) {
                const float *vr = v + cols[c] * stride + e0;
                __m256 pc = _mm256_set1_ps(p[c]);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vr + 8 * i), acc[i]);
                if (first) l += p[c];
            }
        } else {
            for (int64_t c = 0; c < cnt; c++) {
                const float *vr = v + cols[c] * stride + e0;
                __m256 pc = _mm256_set1_ps(p[c]);
                for (int i = 0; i < full; i++) acc[i] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vr + 8 * i), acc[i]);
                if (rem) acc[full] = _mm256_fmadd_ps(pc, _mm256_maskload_ps(vr + 8 * full, tail), acc[full]);
                if (first) l += p[c];
            }
        }
        for (int i = 0; i < full; i++) _mm256_storeu_ps(out + e0 + 8 * i, acc[i]);
        if (rem) _mm256_maskstore_ps(out + e0 + 8 * full, tail, acc[full]);
    }
    return l;
}
#endif

float hsd_dot(const float *a, const float *b, int64_t d, int isa) {
#ifdef HSD_X86
    if (isa == HSG_ISA_AVX512) return dot512(a, b, d);
    if (isa == HSG_ISA_AVX2) return dot256(a, b, d);
#endif
    (void)isa;
    return dot_portable(a, b, d);
}

/* ---- elementwise loops, one copy per instruction set ------------------------------------------------------ */

/* exp(x) for float32: x clamped to [-87, 88] (below -87: 0; NaN stays NaN), k = round(x / ln 2), r = x - k ln 2
 * in two steps, Cephes' degree-6 polynomial, times 2^k built in the exponent bits.  About 1 ulp from exp. */
#define HSD_EXP_BODY(v, n)                                                                                        \
    for (int64_t i = 0; i < (n); i++) {                                                                          \
        float x = (v)[i];                                                                                        \
        float xc = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;                                                 \
        xc = xc == xc ? xc : 0.0f;                                                                               \
        float t = xc * 1.44269504088896341f;                                                                     \
        float k = (t + 12582912.0f) - 12582912.0f; /* round to nearest, |t| < 2^22 */                           \
        float r = fmaf(k, -0.693359375f, xc);                                                                    \
        r = fmaf(k, 2.12194440e-4f, r);                                                                          \
        float p = 1.9875691500e-4f;                                                                              \
        p = fmaf(p, r, 1.3981999507e-3f);                                                                        \
        p = fmaf(p, r, 8.3334519073e-3f);                                                                        \
        p = fmaf(p, r, 4.1665795894e-2f);                                                                        \
        p = fmaf(p, r, 1.6666665459e-1f);                                                                        \
        p = fmaf(p, r, 5.0000001201e-1f);                                                                        \
        float y = fmaf(p, r * r, r) + 1.0f;                                                                      \
        int32_t e = ((int32_t)k + 127) * 8388608; /* << 23 */                                                    \
        float s;                                                                                                 \
        memcpy(&s, &e, sizeof s);                                                                                \
        y = y * s;                                                                                               \
        (v)[i] = x < -87.0f ? 0.0f : x == x ? y : x;                                                            \
    }

#define HSD_ELEMENTWISE(ATTR, SFX)                                                                               \
    ATTR static void exp_##SFX(float *v, int64_t n) { HSD_EXP_BODY(v, n) }                                       \
    /* act = silu(g) * u = g / (1 + exp(-g)) * u */                                                              \
    ATTR static void silu_mul_##SFX(const float *g, const float *u, float *act, int64_t n) {                     \
        for (int64_t i = 0; i < n; i++) act[i] = -g[i];                                                          \
        HSD_EXP_BODY(act, n)                                                                                     \
        for (int64_t i = 0; i < n; i++) act[i] = g[i] / (1.0f + act[i]) * u[i];                                  \
    }                                                                                                            \
    ATTR static void scale_rows_##SFX(const float *x, const float *w, float r, float *y, int64_t d) {            \
        for (int64_t i = 0; i < d; i++) y[i] = w[i] * (x[i] * r);                                                \
    }                                                                                                            \
    ATTR static void add_##SFX(float *y, const float *b, int64_t d) {                                            \
        for (int64_t i = 0; i < d; i++) y[i] = y[i] + b[i];                                                      \
    }                                                                                                            \
    ATTR static void mul_##SFX(float *y, const float *b, int64_t d) {                                            \
        for (int64_t i = 0; i < d; i++) y[i] = y[i] * b[i];                                                      \
    }                                                                                                            \
    /* x = cap * tanh(x / cap), tanh(y) = 2 / (1 + exp(-2 y)) - 1 (exp's clamp gives +-1 far out) */             \
    ATTR static void softcap_##SFX(float *z, int64_t n, float cap) {                                             \
        for (int64_t i = 0; i < n; i++) z[i] = -2.0f * (z[i] / cap);                                             \
        HSD_EXP_BODY(z, n)                                                                                       \
        for (int64_t i = 0; i < n; i++) z[i] = (2.0f / (1.0f + z[i]) - 1.0f) * cap;                              \
    }                                                                                                            \
    ATTR static void center_##SFX(const float *x, float mean, float *y, int64_t d) {                             \
        for (int64_t i = 0; i < d; i++) y[i] = x[i] - mean;                                                      \
    }                                                                                                            \
    /* 16 lanes, lane l adding elements l, l+16, ... in order from +0; then reduce16's tree */                   \
    ATTR static float sum16_##SFX(const float *x, int64_t d) {                                                   \
        float acc[16] = {0};                                                                                     \
        int64_t c = 0;                                                                                           \
        for (; c + 16 <= d; c += 16)                                                                             \
            for (int l = 0; l < 16; l++) acc[l] = acc[l] + x[c + l];                                             \
        for (int l = 0; c + l < d; l++) acc[l] = acc[l] + x[c + l];                                              \
        return reduce16(acc);                                                                                    \
    }                                                                                                            \
    /* gelu's tanh form: x * 0.5 * (1 + tanh(u)) = x / (1 + exp(-2u)), u = 0.7978845608 * (x + 0.044715 x^3) */  \
    ATTR static void gelu_tanh_##SFX(const float *g, float *dst, int64_t n) {                                    \
        for (int64_t i = 0; i < n; i++) {                                                                        \
            float x = g[i];                                                                                      \
            dst[i] = -2.0f * (0.7978845608f * (x + 0.044715f * (x * x * x)));                                    \
        }                                                                                                        \
        HSD_EXP_BODY(dst, n)                                                                                     \
        for (int64_t i = 0; i < n; i++) dst[i] = g[i] / (1.0f + dst[i]);                                         \
    }                                                                                                            \
    /* relu: 0 below 0, else x (a NaN stays) */                                                                  \
    ATTR static void relu_##SFX(const float *g, float *dst, int64_t n) {                                         \
        for (int64_t i = 0; i < n; i++) dst[i] = g[i] < 0.0f ? 0.0f : g[i];                                      \
    }                                                                                                            \
    /* gelu: x * 0.5 * (1 + erf(x / sqrt 2)), with q = erfc(z), z = |x| / sqrt 2, by the Chebyshev fit of Numerical  \
     * Recipes' erfcc (fractional error < 1.2e-7): t = 1 / (1 + z / 2), q = t exp(-z^2 - 1.26551223 + t (1.00002368  \
     * + t (... + t 0.17087277))); then x * 0.5 * q for x < 0 and x * 0.5 * (2 - q) otherwise (no cancellation) */   \
    ATTR static void gelu_##SFX(const float *g, float *dst, int64_t n) {                                         \
        for (int64_t i = 0; i < n; i++) {                                                                        \
            float z = fabsf(g[i]) * 0.70710678118654752f;                                                        \
            float t = 1.0f / (1.0f + 0.5f * z);                                                                  \
            float p = 0.17087277f;                                                                               \
            p = -0.82215223f + t * p;                                                                            \
            p = 1.48851587f + t * p;                                                                             \
            p = -1.13520398f + t * p;                                                                            \
            p = 0.27886807f + t * p;                                                                             \
            p = -0.18628806f + t * p;                                                                            \
            p = 0.09678418f + t * p;                                                                             \
            p = 0.37409196f + t * p;                                                                             \
            p = 1.00002368f + t * p;                                                                             \
            dst[i] = (-(z * z) - 1.26551223f) + t * p;                                                           \
        }                                                                                                        \
        HSD_EXP_BODY(dst, n)                                                                                     \
        for (int64_t i = 0; i < n; i++) {                                                                        \
            float x = g[i], z = fabsf(x) * 0.70710678118654752f;                                                 \
            float q = 1.0f / (1.0f + 0.5f * z) * dst[i];                                                         \
            dst[i] = x < 0.0f ? x * 0.5f * q : x * 0.5f * (2.0f - q);                                            \
        }                                                                                                        \
    }

HSD_ELEMENTWISE(, portable)
#ifdef HSD_X86
HSD_ELEMENTWISE(T256, avx2)
HSD_ELEMENTWISE(T512, avx512)
#define DISPATCH(name, isa, ...)                                                                                 \
    ((isa) == HSG_ISA_AVX512 ? name##_avx512(__VA_ARGS__)                                                        \
                             : (isa) == HSG_ISA_AVX2 ? name##_avx2(__VA_ARGS__) : name##_portable(__VA_ARGS__))
#else
#define DISPATCH(name, isa, ...) ((void)(isa), name##_portable(__VA_ARGS__))
#endif

void hsd_exp(float *x, int64_t n, int isa) { DISPATCH(exp, isa, x, n); }

void hsd_rmsnorm(const float *x, const float *w, float *y, int64_t d, float eps, int isa) {
    float var = hsd_dot(x, x, d, isa) / (float)d;
    float r = 1.0f / sqrtf(var + eps);
    DISPATCH(scale_rows, isa, x, w, r, y, d);
}

void hsd_layernorm(const float *x, const float *w, const float *b, float *y, int64_t d, float eps, int isa) {
    float mean = DISPATCH(sum16, isa, x, d) / (float)d;
    DISPATCH(center, isa, x, mean, y, d);
    float var = hsd_dot(y, y, d, isa) / (float)d;
    float r = 1.0f / sqrtf(var + eps);
    DISPATCH(scale_rows, isa, y, w, r, y, d);
    if (b) DISPATCH(add, isa, y, b, d);
}

void hsd_act(int act, const float *g, float *y, int64_t n, int isa) {
    if (act == HSD_GELU) DISPATCH(gelu, isa, g, y, n);
    else if (act == HSD_RELU) DISPATCH(relu, isa, g, y, n);
    else DISPATCH(gelu_tanh, isa, g, y, n);
}

void hsd_softcap(float *x, int64_t n, float cap, int isa) { DISPATCH(softcap, isa, x, n, cap); }

void hsd_attend(const float *q, const float *k, const float *v, int64_t stride, const uint8_t *allowed, int64_t W,
                float scale, float cap, float *out, int64_t d, float *scores, int64_t *cols, int isa) {
    int64_t cnt = 0;
    for (int64_t j = 0; j < W; j++) { /* (no branch: a causal row's columns would mispredict once per row) */
        cols[cnt] = j;
        cnt += allowed[j] != 0;
    }
    if (cnt == 0) {
        for (int64_t e = 0; e < d; e++) out[e] = 0.0f;
        return;
    }
    float mx = -INFINITY, l = 0.0f;
#ifdef HSD_X86
    const int wide = isa != HSG_ISA_PORTABLE;
    if (wide)
        mx = scores256(q, k, stride, cols, cnt, d, scale, scores);
    else
#endif
        for (int64_t c = 0; c < cnt; c++) {
            scores[c] = hsd_dot(q, k + cols[c] * stride, d, isa) * scale;
            mx = scores[c] > mx ? scores[c] : mx;
        }
    if (cap != 0.0f) { /* soft-capped scores, their maximum taken again (NaNs passed over) */
        hsd_softcap(scores, cnt, cap, isa);
        mx = -INFINITY;
        for (int64_t c = 0; c < cnt; c++) mx = scores[c] > mx ? scores[c] : mx;
    }
    for (int64_t c = 0; c < cnt; c++) scores[c] = scores[c] - mx;
    hsd_exp(scores, cnt, isa);
#ifdef HSD_X86
    if (wide)
        l = pv256(scores, v, stride, cols, cnt, d, out);
    else
#endif
    {
        for (int64_t c = 0; c < cnt; c++) l += scores[c];
        for (int64_t e = 0; e < d; e++) out[e] = 0.0f;
        for (int64_t c = 0; c < cnt; c++) {
            const float *vr = v + cols[c] * stride;
            for (int64_t e = 0; e < d; e++) out[e] = fmaf(scores[c], vr[e], out[e]);
        }
    }
    for (int64_t e = 0; e < d; e++) out[e] = out[e] / l;
}

/* ---- the forward -------------------------------------------------------------------------------------------- */

/* x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[d/2:], x[:d/2]): each product rounded, then the sum (as
 * transformers' apply_rotary_pos_emb computes it). */
static void rotate(float *x, const float *cos, const float *sin, int64_t d, int pairs, float *tmp) {
    int64_t h = d / 2; /* (the first d of x; pairs: rotate_every_two's neighbours in place of rotate_half's halves) */
    for (int64_t i = 0; i < d; i++) {
        float rh = pairs ? (i % 2 ? x[i - 1] : -x[i + 1]) : i < h ? -x[i + h] : x[i - h];
        float a = x[i] * cos[i], b = rh * sin[i];
        tmp[i] = a + b;
    }
    memcpy(x, tmp, (size_t)d * sizeof *x);
}

#define W_(layer, f) ((const float *)(uintptr_t)m->table[(layer) * HSD_FIELDS + (f)])

/* a layer's norm of one row (HSD_LAYERNORM: LayerNorm with its bias, else rmsnorm) */
static void norm_row(const hsd_model *m, const float *x, const float *w, const float *b, float *y, int isa) {
    if (m->arch & HSD_LAYERNORM) hsd_layernorm(x, w, b, y, m->hidden, m->eps, isa);
    else hsd_rmsnorm(x, w, y, m->hidden, m->eps, isa);
}

/* the MLP over n rows of x [n][H] into out [n][H]: down(silu(gate(x)) * up(x)), down(gelu_tanh(gate(x)) * up(x)),
 * or down(act(up(x))) */
static void mlp(const hsd_model *m, int64_t L, const float *x, int64_t n, float *gu, float *act, float *out, int isa,
                int threads) {
    const int64_t H = m->hidden, I = m->inter, G = HSD_GATED(m->act) ? 2 * I : I;
    hsg_linear(x, H, W_(L, HSD_GU), W_(L, HSD_GU_B), gu, G, n, G, H, isa, threads);
    if (m->act == HSD_SILU_GLU)
        for (int64_t r = 0; r < n; r++) DISPATCH(silu_mul, isa, gu + r * 2 * I, gu + r * 2 * I + I, act + r * I, I);
    else if (m->act == HSD_GELU_TANH_GLU)
        for (int64_t r = 0; r < n; r++) {
            DISPATCH(gelu_tanh, isa, gu + r * 2 * I, act + r * I, I);
            DISPATCH(mul, isa, act + r * I, gu + r * 2 * I + I, I);
        }
    else
        hsd_act(m->act, gu, act, n * I, isa);
    hsg_linear(act, I, W_(L, HSD_DOWN), W_(L, HSD_DOWN_B), out, H, n, H, I, isa, threads);
}

/* A mixture-of-experts layer's scratch (hsd_forward allocates it once for the call's n rows): the router's logits
 * [n][E], the chosen experts and their weights [n][K], an expert's rows (their indices and weights) [n], its inputs,
 * [gate; up], activations and outputs [n][H | 2MI | MI | H], and a taken flag per expert [E]. */
typedef struct {
    float *logits, *w, *rw, *xs, *gu, *act, *y;
    int64_t *sel, *rows;
    uint8_t *taken;
} moe_scratch;

/* One row's routing (decoder.h): the top_k of the E logits lg (descending, ties to the lower index; a NaN is never
 * chosen over a number) into sel, their weights into w; lg is overwritten. */
static void route(const hsd_model *m, float *lg, int64_t *sel, float *w, uint8_t *taken, int isa) {
    const int64_t E = m->experts, K = m->top_k;
    memset(taken, 0, (size_t)E);
    for (int64_t i = 0; i < K; i++) {
        int64_t best = -1;
        for (int64_t j = 0; j < E; j++)
            if (!taken[j] && (best < 0 || lg[j] > lg[best] || (isnan(lg[best]) && !isnan(lg[j])))) best = j;
        sel[i] = best;
        taken[best] = 1;
    }
    float t = 0.0f;
    if (m->moe & HSD_MOE_TOPK_SOFTMAX) { /* softmax over the chosen logits (the first is their maximum) */
        const float mx = lg[sel[0]];
        for (int64_t i = 0; i < K; i++) w[i] = lg[sel[i]] - mx;
        hsd_exp(w, K, isa);
        for (int64_t i = 0; i < K; i++) t += w[i];
        for (int64_t i = 0; i < K; i++) w[i] = w[i] / t;
        return;
    }
    float mx = -INFINITY; /* softmax over all E (NaNs passed over in the maximum), read at the chosen */
    for (int64_t j = 0; j < E; j++) mx = lg[j] > mx ? lg[j] : mx;
    for (int64_t j = 0; j < E; j++) lg[j] = lg[j] - mx;
    hsd_exp(lg, E, isa);
    for (int64_t j = 0; j < E; j++) t += lg[j];
    for (int64_t i = 0; i < K; i++) w[i] = lg[sel[i]] / t;
    if (!(m->moe & HSD_MOE_NORM)) return;
    float s = 0.0f;
    for (int64_t i = 0; i < K; i++) s += w[i];
    for (int64_t i = 0; i < K; i++) w[i] = w[i] / s;
}

/* out [n][H] = the mixture of experts of layer L over the rows x [n][H] (decoder.h), its shared expert added where
 * the layer has one (the dense MLP's buffers gu, act) */
static void moe(const hsd_model *m, int64_t L, const float *x, int64_t n, float *gu, float *act, float *out,
                const moe_scratch *s, int isa, int threads) {
    const int64_t H = m->hidden, E = m->experts, K = m->top_k, MI = m->moe_inter;
    const int64_t *ex = (const int64_t *)(uintptr_t)m->table[L * HSD_FIELDS + HSD_EXPERTS];
    hsg_linear(x, H, W_(L, HSD_ROUTER), NULL, s->logits, E, n, E, H, isa, threads);
    for (int64_t r = 0; r < n; r++) route(m, s->logits + r * E, s->sel + r * K, s->w + r * K, s->taken, isa);
    memset(out, 0, (size_t)(n * H) * sizeof *out);
    for (int64_t e = 0; e < E; e++) {
        int64_t cnt = 0;
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < K; i++)
                if (s->sel[r * K + i] == e) {
                    s->rows[cnt] = r;
                    s->rw[cnt++] = s->w[r * K + i];
                }
        if (!cnt) continue;
        for (int64_t c = 0; c < cnt; c++) memcpy(s->xs + c * H, x + s->rows[c] * H, (size_t)H * sizeof *x);
        hsg_linear(s->xs, H, (const float *)(uintptr_t)ex[2 * e], NULL, s->gu, 2 * MI, cnt, 2 * MI, H, isa, threads);
        for (int64_t c = 0; c < cnt; c++)
            DISPATCH(silu_mul, isa, s->gu + c * 2 * MI, s->gu + c * 2 * MI + MI, s->act + c * MI, MI);
        hsg_linear(s->act, MI, (const float *)(uintptr_t)ex[2 * e + 1], NULL, s->y, H, cnt, H, MI, isa, threads);
        for (int64_t c = 0; c < cnt; c++) {
            float *o = out + s->rows[c] * H;
            const float *y = s->y + c * H, wt = s->rw[c];
            for (int64_t i = 0; i < H; i++) {
                const float p = y[i] * wt;
                o[i] = o[i] + p;
            }
        }
    }
    if (!W_(L, HSD_GU)) return;
    mlp(m, L, x, n, gu, act, s->y, isa, threads); /* the shared expert, gated by sigmoid(x . g) */
    hsg_linear(x, H, W_(L, HSD_SHARED_GATE), NULL, s->logits, 1, n, 1, H, isa, threads);
    for (int64_t r = 0; r < n; r++) {
        float t = -s->logits[r];
        hsd_exp(&t, 1, isa);
        const float g = 1.0f / (1.0f + t), *y = s->y + r * H;
        float *o = out + r * H;
        for (int64_t i = 0; i < H; i++) {
            const float p = g * y[i];
            o[i] = o[i] + p;
        }
    }
}

/* the layer's MLP: a mixture of experts where it has a router, else the dense MLP */
static void ffn(const hsd_model *m, int64_t L, const float *x, int64_t n, float *gu, float *act, float *out,
                const moe_scratch *s, int isa, int threads) {
    if (W_(L, HSD_ROUTER)) moe(m, L, x, n, gu, act, out, s, isa, threads);
    else mlp(m, L, x, n, gu, act, out, isa, threads);
}

/* h += t over n floats, or h + (t * mult), the product rounded before the add (Granite's residual_multiplier: its
 * `residual + hidden_states * multiplier`; a separate statement, so no compiler contracts it into one fma) */
static void residual(float *h, const float *t, int64_t n, float mult) {
    if (mult == 1.0f) {
        for (int64_t i = 0; i < n; i++) h[i] = h[i] + t[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float p = t[i] * mult;
        h[i] = h[i] + p;
    }
}

static int nthreads(int threads) { /* the threads of a parallel region here (rows.h's count by default) */
#ifdef _OPENMP
    return threads > 0 ? threads : hsg_threads();
#else
    (void)threads;
    return 1;
#endif
}

int hsd_nonfinite(const float *x, int64_t V) {
    /* on the bits, in two OR reductions gcc vectorises: a NaN or +inf is |bits| > 0x7f800000 or bits ==
     * 0x7f800000; a value other than -inf (0xff800000) clears "all -inf" */
    uint32_t nan_inf = 0, other = 0;
    for (int64_t v = 0; v < V; v++) {
        uint32_t b;
        memcpy(&b, &x[v], sizeof b);
        nan_inf |= (uint32_t)((b & 0x7fffffffu) > 0x7f800000u) | (uint32_t)(b == 0x7f800000u);
        other |= (uint32_t)(b != 0xff800000u);
    }
    return nan_inf || !other;
}

int hsd_forward(const hsd_model *m, const hsd_cache *c, float *h, const float *emb, const float *fuse, int64_t n,
                const float *cos, const float *sin, const int64_t *req, const int64_t *slot, const uint8_t *allowed,
                int64_t W, const hsd_local *local, const int64_t *tap_layers, float *const *taps,
                const int64_t *out_rows, int64_t keep, float *logits, float *hout, int64_t *bad, const int64_t *nreal,
                int64_t per, int isa, int threads) {
    const int64_t H = m->hidden, D = m->head_dim, NQ = m->heads * D, NK = m->kv_heads * D, I = m->inter;
    const int64_t QKV = NQ + 2 * NK, group = m->heads / m->kv_heads, R = m->rot;
    const int64_t G = HSD_GATED(m->act) ? 2 * I : I; /* the rows of GU */
    const int64_t XW = m->hidden_norm ? 2 * H : H; /* the attention input's width */
    if (W < 0 || W > c->capacity || keep < 0 || keep > n) return -1;
    if (m->hidden_norm && (!emb || m->layers != 1 || m->arch || m->act != HSD_SILU_GLU)) return -1;
    if (R < 0 || R > D || R % 2 || m->act < HSD_SILU_GLU || m->act > HSD_GELU_TANH_GLU
        || (m->arch & ~(HSD_LAYERNORM | HSD_PARALLEL | HSD_SHARED_NORM | HSD_ROT_PAIRS | HSD_POST_ONLY
                        | HSD_QK_NORM_ALL | HSD_H_FIRST | HSD_QK_NORM_AFTER))
        || ((m->arch & HSD_H_FIRST) && !(m->arch & HSD_PARALLEL)) || !isfinite(m->logit_mult)
        || ((m->arch & HSD_SHARED_NORM) && !(m->arch & HSD_PARALLEL))
        || ((m->arch & HSD_POST_ONLY) && (m->arch & HSD_PARALLEL)) || !isfinite(m->res_mult)
        || !isfinite(m->logit_div) || m->logit_div == 0.0f || (m->res_mult != 1.0f && (m->arch & HSD_PARALLEL)))
        return -1;
    if (fuse && (!m->fc || m->fc_in <= 0 || m->fc_in % 3)) return -1;
    for (int64_t r = 0; r < n; r++)
        if (req[r] < 0 || req[r] >= c->batch || slot[r] < 0 || slot[r] >= c->capacity) return -1;
    for (int64_t i = 0; out_rows && i < keep; i++)
        if (out_rows[i] < 0 || out_rows[i] >= n) return -1;
    for (int64_t L = 0; L < m->layers; L++) /* a local layer needs the local rows; post norms a sequential layer */
        if ((m->table[L * HSD_FIELDS + HSD_LOCAL] && (!local || !local->allowed))
            || ((W_(L, HSD_POST_ATTN) || W_(L, HSD_POST_MLP)) && (m->arch & HSD_PARALLEL)))
            return -1;
    int experts = 0; /* a layer with a router: the model's mixture-of-experts sizes, SiLU-gated experts, their table; a
                      * shared expert with its gate */
    for (int64_t L = 0; L < m->layers; L++) {
        if (!W_(L, HSD_ROUTER)) {
            if (W_(L, HSD_EXPERTS) || W_(L, HSD_SHARED_GATE)) return -1;
            continue;
        }
        experts = 1;
        if (m->experts <= 0 || m->top_k < 1 || m->top_k > m->experts || m->moe_inter <= 0
            || (m->moe & ~(HSD_MOE_NORM | HSD_MOE_TOPK_SOFTMAX)) || m->act != HSD_SILU_GLU || !W_(L, HSD_EXPERTS)
            || (W_(L, HSD_GU) != 0) != (W_(L, HSD_SHARED_GATE) != 0) || (W_(L, HSD_GU) != 0) != (W_(L, HSD_DOWN) != 0))
            return -1;
    }
    for (int64_t L = 0; L < m->layers; L++) {
        const int dense = !W_(L, HSD_ROUTER) || W_(L, HSD_GU);
        if (hsg_check(W_(L, HSD_QKV), QKV, XW) || hsg_check(W_(L, HSD_O), H, NQ)
            || (dense && (hsg_check(W_(L, HSD_GU), G, H) || hsg_check(W_(L, HSD_DOWN), H, I))))
            return -3;
        if (!W_(L, HSD_ROUTER)) continue;
        const int64_t *ex = (const int64_t *)(uintptr_t)m->table[L * HSD_FIELDS + HSD_EXPERTS];
        if (hsg_check(W_(L, HSD_ROUTER), m->experts, H) || (W_(L, HSD_GU) && hsg_check(W_(L, HSD_SHARED_GATE), 1, H)))
            return -3;
        for (int64_t e = 0; e < m->experts; e++)
            if (hsg_check((const void *)(uintptr_t)ex[2 * e], 2 * m->moe_inter, H)
                || hsg_check((const void *)(uintptr_t)ex[2 * e + 1], H, m->moe_inter))
                return -3;
    }
    if (keep > 0 && hsg_check(m->head, m->vocab, H)) return -3;
    if (fuse && hsg_check(m->fc, H, m->fc_in)) return -3;
    int T = nthreads(threads);
    const int64_t F = fuse && (m->in_norm || m->fc_norms) ? m->fc_in : 0; /* the normed taps' width (0: none) */
    size_t floats = (size_t)(n * XW + 2 * n * H + n * QKV + n * NQ + n * 2 * I + n * I + D + (int64_t)T * W + n * F);
    float *buf = malloc(floats * sizeof(float));
    int64_t *cols = malloc((size_t)(T * (W > 0 ? W : 1)) * sizeof(int64_t));
    if (!buf || !cols) {
        free(buf);
        free(cols);
        return -2;
    }
    moe_scratch ms = {0};
    float *mbuf = NULL;
    int64_t *mint = NULL;
    if (experts) {
        const int64_t E = m->experts, K = m->top_k, MI = m->moe_inter;
        mbuf = malloc((size_t)(n * E + n * K + n + 2 * n * H + 3 * n * MI) * sizeof(float) + (size_t)E);
        mint = malloc((size_t)(n * K + n) * sizeof(int64_t));
        if (!mbuf || !mint) {
            free(buf);
            free(cols);
            free(mbuf);
            free(mint);
            return -2;
        }
        ms.logits = mbuf, ms.w = ms.logits + n * E, ms.rw = ms.w + n * K, ms.xs = ms.rw + n, ms.gu = ms.xs + n * H;
        ms.act = ms.gu + 2 * n * MI, ms.y = ms.act + n * MI, ms.taken = (uint8_t *)(ms.y + n * H);
        ms.sel = mint, ms.rows = mint + n * K;
    }
    float *x = buf, *tmp = x + n * XW, *tmp2 = tmp + n * H, *qkv = tmp2 + n * H, *att = qkv + n * QKV,
          *gu = att + n * NQ,
          *act = gu + n * 2 * I, *rot = act + n * I, *scores = rot + D, *normed = scores + (int64_t)T * W;
    if (fuse) { /* the draft's fusion: h = fc(the taps, normed where the draft norms them) */
        const int64_t third = m->fc_in / 3;
        for (int64_t r = 0; F && r < n; r++) {
            float *row = normed + r * F;
            if (m->in_norm) hsd_rmsnorm(fuse + r * F, m->in_norm, row, F, m->eps, isa);
            else memcpy(row, fuse + r * F, (size_t)F * sizeof *row);
            for (int t = 0; m->fc_norms && t < 3; t++)
                hsd_rmsnorm(row + t * third, m->fc_norms + t * third, row + t * third, third, m->eps, isa);
        }
        hsg_linear(F ? normed : fuse, m->fc_in, m->fc, m->fc_b, h, H, n, H, m->fc_in, isa, threads);
    }
    for (int64_t L = 0; L < m->layers; L++) {
        for (int t = 0; t < 3; t++)
            if (taps && taps[t] && tap_layers[t] == L) memcpy(taps[t], h, (size_t)(n * H) * sizeof *h);
        for (int64_t r = 0; r < n; r++) {
            if (!m->hidden_norm) {
                if (m->arch & HSD_POST_ONLY) memcpy(x + r * XW, h + r * H, (size_t)H * sizeof *h);
                else norm_row(m, h + r * H, W_(L, HSD_LN1), W_(L, HSD_LN1_B), x + r * XW, isa);
                continue;
            }
            hsd_rmsnorm(emb + r * H, W_(L, HSD_LN1), x + r * XW, H, m->eps, isa);
            hsd_rmsnorm(h + r * H, m->hidden_norm, x + r * XW + H, H, m->eps, isa);
            if (m->flags & HSD_RESIDUAL_NORMED) memcpy(h + r * H, x + r * XW + H, (size_t)H * sizeof *h);
        }
        hsg_linear(x, XW, W_(L, HSD_QKV), W_(L, HSD_QKV_B), qkv, QKV, n, QKV, XW, isa, threads);
        const float *qn = W_(L, HSD_Q_NORM), *kn = W_(L, HSD_K_NORM);
        const int64_t RL = m->table[L * HSD_FIELDS + HSD_NO_ROT] ? 0 : R; /* this layer's rotated dimensions */
        const int near = m->table[L * HSD_FIELDS + HSD_LOCAL] != 0;     /* this layer reads the local rows */
        const uint8_t *sees = near ? local->allowed : allowed;
        const float *lc = near && local->cos ? local->cos : cos, *ls = near && local->sin ? local->sin : sin;
        const int wide = (m->arch & HSD_QK_NORM_ALL) != 0; /* q and k normed whole, not head by head */
        const int after = (m->arch & HSD_QK_NORM_AFTER) != 0; /* ... after the rotation (HunYuan), not before */
        for (int64_t r = 0; r < n; r++) {
            float *row = qkv + r * QKV;
            if (wide && qn && !after) hsd_rmsnorm(row, qn, row, NQ, m->eps, isa);
            if (wide && kn && !after) hsd_rmsnorm(row + NQ, kn, row + NQ, NK, m->eps, isa);
            for (int64_t a = 0; a < m->heads + m->kv_heads; a++) {
                float *v = row + a * D;
                const float *nw = wide ? NULL : a < m->heads ? qn : kn;
                if (nw && !after) hsd_rmsnorm(v, nw, v, D, m->eps, isa);
                if (RL) rotate(v, lc + r * R, ls + r * R, R, (m->arch & HSD_ROT_PAIRS) != 0, rot);
                if (nw && after) hsd_rmsnorm(v, nw, v, D, m->eps, isa);
            }
            if (wide && qn && after) hsd_rmsnorm(row, qn, row, NQ, m->eps, isa);
            if (wide && kn && after) hsd_rmsnorm(row + NQ, kn, row + NQ, NK, m->eps, isa);
            float *base = c->kv + req[r] * c->s_batch + L * c->s_layer + slot[r] * D;
            for (int64_t a = 0; a < m->kv_heads; a++) {
                memcpy(base + a * c->s_head, row + NQ + a * D, (size_t)D * sizeof(float));
                memcpy(base + c->s_kv + a * c->s_head, row + NQ + NK + a * D, (size_t)D * sizeof(float));
            }
        }
        /* the (head, row) pairs, head outermost so a thread's pairs share a group's keys.  A few rows (a step, a
         * tree) cost about the same each: contiguous shares keep each group's keys in one core's cache (a one-token
         * step after 1,000 tokens about 9 % faster than alternate pairs on a 2-core Zen 3).  A prompt's causal rows
         * grow in cost down the prompt: alternate pairs balance the threads (an 800-token prefill about 5 %). */
        const int64_t pairs = n * m->heads, alternate = n > 16;
#ifdef _OPENMP
#pragma omp parallel num_threads(T) if (T > 1 && pairs > 1)
#endif
        {
#ifdef _OPENMP
            const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
            const int64_t id = 0, nt = 1;
#endif
            const int64_t p0 = alternate ? id : pairs * id / nt, p1 = alternate ? pairs : pairs * (id + 1) / nt;
            for (int64_t p = p0; p < p1; p += alternate ? nt : 1) {
                const int64_t a = p / n, r = p % n;
                const float *kb = c->kv + req[r] * c->s_batch + L * c->s_layer + (a / group) * c->s_head;
                hsd_attend(qkv + r * QKV + a * D, kb, kb + c->s_kv, D, sees + r * W, W, m->scale, m->attn_cap,
                           att + r * NQ + a * D, D, scores + id * W, cols + id * W, isa);
            }
        }
        hsg_linear(att, NQ, W_(L, HSD_O), W_(L, HSD_O_B), tmp, H, n, H, NQ, isa, threads);
        if (m->arch & HSD_PARALLEL) { /* both from the layer's input: h = (mlp + attention) + h (x: norm1's rows) */
            for (int64_t r = 0; !(m->arch & HSD_SHARED_NORM) && r < n; r++)
                norm_row(m, h + r * H, W_(L, HSD_LN2), W_(L, HSD_LN2_B), x + r * H, isa);
            ffn(m, L, x, n, gu, act, tmp2, &ms, isa, threads);
            if (m->arch & HSD_H_FIRST)
                for (int64_t i = 0; i < n * H; i++) h[i] = (h[i] + tmp[i]) + tmp2[i];
            else
                for (int64_t i = 0; i < n * H; i++) h[i] = (tmp2[i] + tmp[i]) + h[i];
            continue;
        }
        const float *pa = W_(L, HSD_POST_ATTN), *pm = W_(L, HSD_POST_MLP);
        for (int64_t r = 0; pa && r < n; r++) norm_row(m, tmp + r * H, pa, NULL, tmp + r * H, isa);
        residual(h, tmp, n * H, m->res_mult);
        for (int64_t r = 0; r < n; r++)
            if (m->arch & HSD_POST_ONLY) memcpy(x + r * H, h + r * H, (size_t)H * sizeof *h);
            else norm_row(m, h + r * H, W_(L, HSD_LN2), W_(L, HSD_LN2_B), x + r * H, isa);
        ffn(m, L, x, n, gu, act, tmp, &ms, isa, threads);
        for (int64_t r = 0; pm && r < n; r++) norm_row(m, tmp + r * H, pm, NULL, tmp + r * H, isa);
        residual(h, tmp, n * H, m->res_mult);
    }
    if (keep > 0) {
        for (int64_t i = 0; i < keep; i++) { /* (x holds n rows; keep <= n) */
            const float *row = h + (out_rows ? out_rows[i] : n - keep + i) * H;
            norm_row(m, row, m->final_norm, m->final_norm_b, x + i * H, isa);
            if (hout) memcpy(hout + i * H, m->flags & HSD_OUT_NORMED ? x + i * H : row, (size_t)H * sizeof *h);
            if (m->flags & HSD_HEAD_RAW) memcpy(x + i * H, row, (size_t)H * sizeof *h);
        }
        hsg_linear(x, H, m->head, m->head_b, logits, m->vocab, keep, m->vocab, H, isa, threads);
        if (m->logit_mult != 1.0f)
            for (int64_t i = 0; i < keep * m->vocab; i++) logits[i] = logits[i] * m->logit_mult;
        if (m->logit_div != 1.0f)
            for (int64_t i = 0; i < keep * m->vocab; i++) logits[i] = logits[i] / m->logit_div;
        if (m->final_cap != 0.0f) hsd_softcap(logits, keep * m->vocab, m->final_cap, isa);
        /* the engine's non-finite flags while the rows are in cache (torch's amax over them after the call cost
         * 5 % of a one-token step on a 2-core CPU) */
        for (int64_t i = 0; bad && i < keep; i++) {
            int64_t r = out_rows ? out_rows[i] : n - keep + i;
            if ((!nreal || r % per < nreal[req[r]]) && hsd_nonfinite(logits + i * m->vocab, m->vocab)) bad[req[r]] = 1;
        }
    }
    free(buf);
    free(cols);
    free(mbuf);
    free(mint);
    return 0;
}
