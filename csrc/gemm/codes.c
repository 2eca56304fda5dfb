/*
 * codes.c -- finding a float32 weight's block codes (rows.h's hsg_find_codes): whether every block along k is, bit
 * for bit, what one of rows.h's codecs decodes from small integer codes, and those codes.
 *
 * Why: transformers' GGUF loader hands us float32 weights, the dequantized blocks of Q4_1, Q4_K, Q8_0, Q6_K, ...
 * (gguf-py's formulas).  Read as their codes they cost 0.69-1.5 bytes a weight in a step instead of 4, but the
 * codes are not kept: they must be found again from the floats.  A scale d and an offset m found for a block
 * count when every weight of it is d * q + m for an integer q in the codec's range, to the bit; the codes need not
 * be the file's, only decode to the same floats.
 *
 * The scales tried for a block, in this order (each where the codec takes it):
 *   0-2   Q4 and Q5: the float16 values nearest (max - min) / 15 (31), and their two neighbours (Q4_1's and
 *         Q5_1's d, which rounds);
 *   3     the greatest common divisor of the least and the greatest distance of a value from the block's base (0
 *         for signed codes, else its least value): both are multiples of d, mostly one and a few tens of it;
 *   4     signed codes (Q8, Q8H, Q8X): the same with the base 0 (the least and the greatest magnitude);
 *   5-8   signed codes: the greatest magnitude over 127, 8, 16 or 32 (Q8_0's, Q4_0's, Q5_0's and Q6_K's largest
 *         codes);
 *   9-16  the least distance from the base over 1 to 8 (the code nearest the base's is a few steps of d from it);
 *   17-24 the least gap between two of its values over 1 to 8 (d times small integers is exact, so any two values
 *         differ by a multiple of d; a sort);
 *   25    the greatest common divisor of the values (signed codes) or of their distances from the least;
 *   26    signed codes: the greatest common divisor of the values again (Q8X: a block of Q8_0 codes among Q5_1's).
 * Codes are signed around zero (Q8, Q8H; Q8X where the block holds a -0, a code 0 under a negative scale, which no
 * offset gives: m = -0 and d negative) or counted from the block's least value (Q4, Q5; other Q8X blocks: m the
 * least value).  A block of zeros of both signs takes the scale +0, the codes -1 (at each -0) and 0, and the offset -0.
 * The cheap scale (0-16) that fitted the row's previous block is tried first: a row's blocks mostly share their
 * format.
 *
 * The result depends on the weight alone (not on the threads).  The pure NumPy twin is heterospec/reference/gemm.py's
 * find_codes: the same blocks have codes in both, and both decode to the weight.
 */
#include "rows.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CANDIDATES 27
#define COSTLY 17 /* the first candidate that sorts or divides many times: never the hint */

static uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* The float16 pattern nearest f (finite), ties to even; beyond float16's range its infinity. */
static uint16_t to_half(float f) {
    uint32_t b = bits_of(f), sign = (b >> 16) & 0x8000u;
    float a = fabsf(f);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7C00u);
    if (a < 6.103515625e-05f) { /* float16's subnormals (and zero): steps of 2^-24, rounded to even by rintf */
        return (uint16_t)(sign | (uint32_t)rintf(a * 16777216.0f));
    }
    uint32_t m = b & 0x7FFFFFu, e = ((b >> 23) & 0xFFu) - 112u, h = e << 10 | m >> 13, rest = m & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* (a carry into the exponent is right) */
    return (uint16_t)(sign | h);
}

/* The bits from the highest set to the lowest set of |d|'s significand (0 for 0; an upper bound for a subnormal):
 * d times an integer of L bits is exact in float32 when they add up to at most 24. */
static int significant_bits(float d) {
    if (d == 0.0f) return 0;
    uint32_t mant = (bits_of(d) & 0x7FFFFFu) | 0x800000u;
    int low = 0;
    while (!(mant & 1u)) mant >>= 1, low++;
    return 24 - low;
}

static int bit_length(int v) {
    int n = 0;
    while (v) v >>= 1, n++;
    return n;
}

/* v > 0 finite as odd * 2^(returned exponent), the odd integer into *odd. */
static int odd_part(double v, uint64_t *odd) {
    uint64_t b;
    memcpy(&b, &v, 8);
    int e = (int)(b >> 52 & 0x7FF);
    uint64_t mant = b & 0xFFFFFFFFFFFFFull;
    if (e) mant |= 1ull << 52;
    else e = 1; /* (a subnormal) */
    int tz = __builtin_ctzll(mant); /* (mant != 0 for v > 0) */
    *odd = mant >> tz;
    return e - 1075 + tz;
}

/* The greatest d with every v[i] (>= 0, finite) an integer multiple of it, exactly: the greatest common divisor of
 * their odd parts times the least of their powers of two; 0 for zeros. */
static double gcd_of(const double *v, int size) {
    uint64_t g = 0;
    int e = 0;
    for (int i = 0; i < size; i++) {
        if (v[i] == 0.0) continue;
        uint64_t a;
        int ea = odd_part(v[i], &a);
        if (g == 0) {
            g = a, e = ea;
            continue;
        }
        e = ea < e ? ea : e;
        while (a != g) { /* odd numbers: binary Euclid (their difference is even) */
            if (a < g) {
                uint64_t t = a;
                a = g, g = t;
            }
            a -= g;
            a >>= __builtin_ctzll(a); /* (a != 0: a > g) */
        }
    }
    return g ? ldexp((double)g, e) : 0.0;
}

typedef struct {
    int codec, size, lo_code, hi_code, offset, sign; /* sign: codes may be signed (around a base 0) */
} form;

static int form_of(int codec, form *f) { /* rows.h's shape of the codec's codes */
    f->codec = codec;
    if (hsg_code_form(codec, &f->size, &f->lo_code, &f->hi_code, &f->offset) < 0) return -1;
    f->sign = f->lo_code < 0;
    return 0;
}

static int applies(const form *f, int c) {
    if (c <= 2) return !f->sign;                                 /* Q4_1's and Q5_1's float16 scales */
    if (c == 4 || (c >= 5 && c <= 8) || c == 26) return f->sign; /* signed codes' */
    return 1;
}

/* The block x as codes q under the scale d64 (negated for a block of signed codes holding a -0): 1 and *d, *m when
 * every weight is d * q + m (Q8: d * q) to the bit with q in range (and d * q exact where an offset is added). */
static int fits(const form *f, const float *x, double d64, int sg, int negz, float lo, int8_t *q, float *d_out,
                float *m_out) {
    float d = (float)(sg && negz ? -d64 : d64);
    if (!isfinite(d)) return 0;
    if (f->codec == HSG_Q4 && (bits_of(d) & 0xFu)) return 0; /* rows.h: at most 20 significant bits */
    float m = sg ? (negz ? -0.0f : 0.0f) : lo, base = sg ? 0.0f : lo;
    int most = 0;
    /* (a code is the nearest integer to (x - base) / d; times the reciprocal it is the same wherever the block has
     * codes under d, since the quotient is then within a rounding of an integer, and the check below decides; a
     * reciprocal beyond float32's range divides instead) */
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const int divide = !isfinite(inv);
    for (int i = 0; i < f->size; i++) {
        float c = 0.0f;
        if (d != 0.0f) {
            c = rintf(divide ? (x[i] - base) / d : (x[i] - base) * inv);
            c = c >= (float)f->hi_code ? (float)f->hi_code : c;
            c = c >= (float)f->lo_code ? c : (float)f->lo_code; /* (a NaN, 0 times an infinite reciprocal, too) */
        }
        int qi = (int)c;
        float p = d * (float)qi, v = f->offset ? p + m : p; /* (-std=c11: two roundings, never contracted) */
        if (bits_of(v) != bits_of(x[i])) return 0;
        q[i] = (int8_t)qi;
        if (abs(qi) > most) most = abs(qi);
    }
    if (f->offset && f->codec != HSG_Q4 && significant_bits(d) + bit_length(most) > 24) return 0;
    *d_out = d, *m_out = m;
    return 1;
}

/* One block: its codes into q, scale and offset into *d, *m; 1 when found (*hint: the candidate that fitted the
 * row's previous block, updated), else 0. */
static int find_block(const form *f, const float *x, int8_t *q, float *d, float *m, int *hint) {
    const int size = f->size;
    float lo = x[0], hi = x[0], amax = 0.0f;
    int negz = 0, zeros = 1;
    for (int i = 0; i < size; i++) {
        if (!isfinite(x[i])) return 0;
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        negz |= bits_of(x[i]) == 0x80000000u;
        zeros &= x[i] == 0.0f;
    }
    if (zeros && negz && f->sign) { /* zeros of both signs: 0 * -1 is -0 */
        for (int i = 0; i < size; i++) q[i] = bits_of(x[i]) == 0x80000000u ? -1 : 0;
        *d = 0.0f, *m = -0.0f;
        return 1;
    }
    const int block_sg = f->sign && (!f->offset || negz);
    double dists[2][2] = {{-1.0, 0.0}, {-1.0, 0.0}}, least = -1.0; /* ([offset or signed form][least, greatest]) */
    for (int t = -1; t < CANDIDATES; t++) {
        int c = t < 0 ? *hint : t;
        if (c < 0 || (t >= 0 && c == *hint) || !applies(f, c)) continue;
        int sg = c == 4 || (c >= 5 && c <= 8) || c == 26 ? 1 : block_sg;
        double d64;
        if (c <= 2) {
            int h = (int)to_half((hi - lo) / (float)f->hi_code) + (c == 1 ? 1 : c == 2 ? -1 : 0);
            d64 = h < 0 ? 0.0 : hsg_half_float((uint16_t)h, HSG_F16);
            if (!isfinite(d64)) d64 = 0.0;
        } else if (c <= 4 || (c >= 9 && c <= 16)) {
            double *dist = dists[sg];   /* (the least and the greatest distance from the base, when first needed) */
            if (dist[0] < 0.0) {
                double least_v = INFINITY, most_v = 0.0; /* (branch-free: min and max of the positive distances) */
                for (int i = 0; i < size; i++) {
                    double v = sg ? fabs((double)x[i]) : (double)x[i] - (double)lo;
                    double pos = v > 0.0 ? v : INFINITY;
                    least_v = pos < least_v ? pos : least_v;
                    most_v = v > most_v ? v : most_v;
                }
                dist[0] = least_v == INFINITY ? 0.0 : least_v, dist[1] = most_v;
            }
            if (c <= 4) {
                d64 = gcd_of(dist, 2);
            } else {
                d64 = dist[0] / (c - 8);
            }
        } else if (c <= 8) {
            static const double over[4] = {127.0, 8.0, 16.0, 32.0};
            d64 = (double)amax / over[c - 5];
        } else if (c <= 24) {
            if (least < 0.0) {
                float s[HSG_BLOCK];
                for (int i = 0; i < size; i++) { /* insertion sort: 16 or 32 values */
                    int j = i;
                    for (; j > 0 && s[j - 1] > x[i]; j--) s[j] = s[j - 1];
                    s[j] = x[i];
                }
                least = 0.0;
                for (int i = 1; i < size; i++) {
                    double g = (double)s[i] - (double)s[i - 1];
                    if (g > 0.0 && (least == 0.0 || g < least)) least = g;
                }
            }
            d64 = least / (c - 16);
        } else {
            double v[HSG_BLOCK];
            for (int i = 0; i < size; i++) v[i] = sg ? fabs((double)x[i]) : (double)(x[i] - lo);
            d64 = gcd_of(v, size);
        }
        if (fits(f, x, d64, sg, negz, lo, q, d, m)) {
            if (c < COSTLY) *hint = c;
            return 1;
        }
    }
    return 0;
}

int hsg_find_codes(int codec, const float *w, int64_t n, int64_t k, int8_t *q, float *d, float *m, int threads) {
    form f;
    if (form_of(codec, &f) < 0 || n < 0 || k < 0 || k % HSG_BLOCK) return -2;
    const int64_t nb = k / f.size;
    int failed = 0;
    int t = threads > 0 ? threads : hsg_threads();
    (void)t;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 8) num_threads(t)
#endif
    for (int64_t r = 0; r < n; r++) {
        int stop;
#ifdef _OPENMP
#pragma omp atomic read
#endif
        stop = failed;
        if (stop) continue;
        int hint = -1;
        for (int64_t b = 0; b < nb; b++) {
            float scratch;
            if (!find_block(&f, w + r * k + b * f.size, q + r * k + b * f.size, d + r * nb + b,
                            f.offset ? m + r * nb + b : &scratch, &hint)) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
                failed = 1;
                break;
            }
        }
    }
    return failed ? -1 : 0;
}
