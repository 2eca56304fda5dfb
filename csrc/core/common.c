/*
 * common.c -- shared CPU helpers: error messages, row checks, a vectorisable exp-sum and top-k.
 *
 * The exp-sum is the hot loop of log-softmax over a vocabulary (V up to 152k), so it is written to be
 * auto-vectorised by the compiler: a branch-free float32 exp (Cephes polynomial, about 1 ulp) whose
 * results are summed in 8 float lanes over blocks of 64 and then in float64, which keeps the relative
 * error of the total near 1e-7 for any V.  Top-k keeps a min-heap of the current best k and skips whole
 * 32-element blocks whose maximum cannot enter it, so a pass over the vocabulary is one vectorised max
 * per block in the common case.
 */
#include "common.h"

#include <stdlib.h>

hs_status hs_fail(hs_error *err, hs_status status, const char *op, const char *arg, const char *fmt,
                  ...) {
    if (err != NULL) {
        int used = snprintf(err->msg, sizeof err->msg, "%s: argument '%s' ", op, arg);
        if (used < 0 || (size_t)used >= sizeof err->msg) return status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg + used, sizeof err->msg - (size_t)used, fmt, ap);
        va_end(ap);
    }
    return status;
}

size_t hs_dtype_size(hs_dtype dtype) {
    switch (dtype) {
    case HS_FLOAT32: case HS_INT32: return 4;
    case HS_FLOAT16: case HS_BFLOAT16: return 2;
    case HS_FLOAT64: case HS_INT64: return 8;
    case HS_BOOL: return 1;
    }
    return 0;
}

const char *hs_dtype_name(hs_dtype dtype) {
    switch (dtype) {
    case HS_FLOAT32: return "float32";
    case HS_FLOAT16: return "float16";
    case HS_BFLOAT16: return "bfloat16";
    case HS_FLOAT64: return "float64";
    case HS_INT32: return "int32";
    case HS_INT64: return "int64";
    case HS_BOOL: return "bool";
    }
    return "unknown";
}

#define HS_STR2(x) #x
#define HS_STR(x) HS_STR2(x)
const char *hs_version_string(void) {
    return HS_STR(HS_VERSION_MAJOR) "." HS_STR(HS_VERSION_MINOR) "." HS_STR(HS_VERSION_PATCH);
}

const float *hs_row_f32(const void *logits, hs_dtype t, int64_t row, int64_t V, float *dst) {
    if (t == HS_FLOAT32) return (const float *)logits + row * V;
    const uint16_t *src = (const uint16_t *)logits + row * V;
    if (t == HS_BFLOAT16) {
        for (int64_t v = 0; v < V; v++) dst[v] = hs_bf16_to_float(src[v]);
    } else {
        for (int64_t v = 0; v < V; v++) dst[v] = hs_half_to_float(src[v]);
    }
    return dst;
}

HS_HOT hs_status hs_row_check_max(const float *x, int64_t V, const char *op, const char *arg, int64_t row,
                           float *max_out, hs_error *err) {
    /* Fast path: a vectorisable max plus a "bad" flag computed on the bits (NaN or +Inf means
     * |bits| >= 0x7f800000 with the sign clear, or a NaN with the sign set); the slow scan below only runs
     * to name the offending column. */
    /* max in 8 independent lanes: a plain running max is a loop-carried dependency gcc will not vectorise
     * without -ffinite-math-only; the lanes are an elementwise max it does vectorise */
    float lane[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t v8 = V - V % 8;
    for (int64_t v = 0; v < v8; v += 8)
        for (int l = 0; l < 8; l++) lane[l] = x[v + l] > lane[l] ? x[v + l] : lane[l];
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = lane[l] > m ? lane[l] : m;
    for (int64_t v = v8; v < V; v++) m = x[v] > m ? x[v] : m;
    uint32_t bad = 0; /* two loops: fused, gcc 12 vectorises neither */
    for (int64_t v = 0; v < V; v++) {
        uint32_t b;
        memcpy(&b, &x[v], sizeof b);
        bad |= (uint32_t)((b & 0x7fffffffu) > 0x7f800000u) | (uint32_t)(b == 0x7f800000u);
    }
    if (bad) {
        for (int64_t v = 0; v < V; v++) {
            if (x[v] != x[v] || x[v] == INFINITY)
                return hs_fail(err, HS_ERR_NONFINITE, op, arg,
                               "expected finite values or -inf (masked tokens), got %s at [%lld, %lld]",
                               x[v] != x[v] ? "nan" : "+inf", (long long)row, (long long)v);
        }
    }
    if (m == -INFINITY)
        return hs_fail(err, HS_ERR_NONFINITE, op, arg,
                       "expected at least one value > -inf per row, got an all -inf row %lld",
                       (long long)row);
    *max_out = m;
    return HS_OK;
}

static inline float hs_exp_nonpos(float x) {
    /* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n by building
     * the exponent bits.  Below -87 (and for -inf) the result is 0: those terms are < 2e-38 of a sum
     * whose largest term is 1. */
    const float shifter = 12582912.0f; /* 1.5 * 2^23: x + shifter rounds x to an integer */
    float xc = x < -87.0f ? -87.0f : x;
    float n = (xc * 1.44269504088896341f + shifter) - shifter;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

HS_HOT double hs_sum_exp_shifted(const float *x, int64_t V, float m) {
    /* 32 float lanes (several vectors in flight: the exp polynomial is a long dependency chain), each
     * summing 8 terms per 256-element block; block sums are added in float64. */
    double total = 0.0;
    int64_t v = 0;
    for (; v + 256 <= V; v += 256) {
        float lane[32];
        for (int l = 0; l < 32; l++) lane[l] = 0.0f;
        for (int j = 0; j < 256; j += 32)
            for (int l = 0; l < 32; l++) lane[l] += hs_exp_nonpos(x[v + j + l] - m);
        for (int l = 0; l < 32; l++) total += (double)lane[l];
    }
    for (; v < V; v++) total += (double)hs_exp_nonpos(x[v] - m);
    return total;
}

/* ---- top-k ---------------------------------------------------------------------------------------- */

/* a is worse than b: lower value, or equal value and higher id. */
static inline int hs_worse(hs_kv a, hs_kv b) { return a.v < b.v || (a.v == b.v && a.i > b.i); }

static void hs_sift_down(hs_kv *h, int64_t k, int64_t pos) {
    for (;;) {
        int64_t l = 2 * pos + 1, r = l + 1, w = pos;
        if (l < k && hs_worse(h[l], h[w])) w = l;
        if (r < k && hs_worse(h[r], h[w])) w = r;
        if (w == pos) return;
        hs_kv tmp = h[pos];
        h[pos] = h[w];
        h[w] = tmp;
        pos = w;
    }
}

static int hs_cmp_best_first(const void *pa, const void *pb) {
    hs_kv a = *(const hs_kv *)pa, b = *(const hs_kv *)pb;
    if (a.v != b.v) return a.v > b.v ? -1 : 1;
    return (a.i > b.i) - (a.i < b.i);
}

void hs_sort_best_first(hs_kv *a, int64_t n) { qsort(a, (size_t)n, sizeof *a, hs_cmp_best_first); }

static inline float hs_block_max32(const float *x) {
    /* elementwise max of four 8-wide rows, then across the 8 lanes: gcc emits vector maxes for the first
     * part, where a plain running max over 32 elements becomes a long scalar chain */
    float lane[8];
    for (int l = 0; l < 8; l++) lane[l] = x[l];
    for (int j = 8; j < 32; j += 8)
        for (int l = 0; l < 8; l++) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
    for (int l = 0; l < 4; l++) lane[l] = lane[l + 4] > lane[l] ? lane[l + 4] : lane[l];
    for (int l = 0; l < 2; l++) lane[l] = lane[l + 2] > lane[l] ? lane[l + 2] : lane[l];
    return lane[1] > lane[0] ? lane[1] : lane[0];
}

HS_HOT void hs_topk_f32(const float *x, int64_t V, int64_t k, hs_kv *out) {
    /* Min-heap of the best k seen so far (root = worst); a 32-element block is scanned only when its
     * (vectorised) maximum beats the root, which after the first few blocks is rare.  Ids arrive
     * ascending, so a later element with a value equal to the root's is worse than it (ties go to the
     * lower id) and never enters. */
    for (int64_t v = 0; v < k; v++) out[v] = (hs_kv){x[v], v};
    for (int64_t p = k / 2 - 1; p >= 0; p--) hs_sift_down(out, k, p);
    int64_t v = k;
    /* Align to a block boundary, then skip blocks whose max cannot beat the root. */
    for (; v < V && (v & 31); v++) {
        if (x[v] > out[0].v) {
            out[0] = (hs_kv){x[v], v};
            hs_sift_down(out, k, 0);
        }
    }
    for (; v + 32 <= V; v += 32) {
        float bm = hs_block_max32(x + v);
        if (!(bm > out[0].v)) continue;
        for (int j = 0; j < 32; j++) {
            if (x[v + j] > out[0].v) {
                out[0] = (hs_kv){x[v + j], v + j};
                hs_sift_down(out, k, 0);
            }
        }
    }
    for (; v < V; v++) {
        if (x[v] > out[0].v) {
            out[0] = (hs_kv){x[v], v};
            hs_sift_down(out, k, 0);
        }
    }
    qsort(out, (size_t)k, sizeof *out, hs_cmp_best_first);
}

void hs_topk_real(const void *x, hs_dtype t, int64_t V, int64_t k, hs_kv *out) {
    for (int64_t v = 0; v < k; v++) out[v] = (hs_kv){hs_load_real(x, t, v), v};
    for (int64_t p = k / 2 - 1; p >= 0; p--) hs_sift_down(out, k, p);
    for (int64_t v = k; v < V; v++) {
        double a = hs_load_real(x, t, v);
        if (a > out[0].v) {
            out[0] = (hs_kv){a, v};
            hs_sift_down(out, k, 0);
        }
    }
    qsort(out, (size_t)k, sizeof *out, hs_cmp_best_first);
}

double hs_entropy_sorted(const hs_kv *v, int64_t k, double temperature) {
    /* H = -sum p ln p with p = e^{z_i - z_max} / Z: written as ln Z - sum e_i (z_i - z_max) / Z so that
     * it needs one log; entries at -inf have e_i = 0 and contribute nothing (0 ln 0 = 0). */
    double zmax = (double)v[0].v / temperature;
    double Z = 0.0, S = 0.0;
    for (int64_t i = 0; i < k; i++) {
        if (v[i].v == -INFINITY) continue;
        double d = (double)v[i].v / temperature - zmax;
        double e = exp(d);
        Z += e;
        S += e * d;
    }
    double h = log(Z) - S / Z;
    return h > 0.0 ? h : 0.0; /* rounding can leave -1e-17 for a one-hot row */
}
