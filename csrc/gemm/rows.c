/*
 * rows.c -- the CPU matrix kernel for a few rows (rows.h says why and what it computes).
 *
 * Work split: the output columns' panels are cut into one contiguous range per thread; each thread walks its
 * range in groups of 8 panels (the widest tile), and within a group runs every chunk of rows (12 with AVX-512,
 * 6 with AVX2; with coded weights and more rows than a chunk, the group is decoded once into float32 first) as
 * tiles of NB panels x MB rows whose sums stay in registers for the whole of K.  The group's
 * weights (8 x K x 64 bytes) are read from memory once and from the cache for the later chunks.
 *
 * Every variant computes each output as the same chain of fused multiply-adds over k in order, so the bits are
 * those of the portable loop (the tests hold them to it).  -std=c11 keeps the compiler from contracting or
 * reordering anything else.
 */
#include "rows.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define HSG_GROUP 8 /* panels per group: a multiple of every tile's width */

static int64_t block_bytes(int codec) { /* bytes of one panel's block of HSG_BLOCK k (0: no blocks) */
    return codec == HSG_Q8    ? 64 + HSG_BLOCK * HSG_PANEL
           : codec == HSG_Q4  ? 128 + HSG_BLOCK * HSG_PANEL / 2
           : codec == HSG_Q8X ? 256 + HSG_BLOCK * HSG_PANEL
           : codec == HSG_Q5  ? 128 + HSG_BLOCK * HSG_PANEL / 2 + 2 * HSG_BLOCK
           : codec == HSG_Q8H ? 128 + HSG_BLOCK * HSG_PANEL
                              : 0;
}

/* The block codecs' shapes (rows.h): codes as Q4's pairs of 4-bit halves (HSG_Q4, HSG_Q5; one byte per code
 * otherwise), k per scale, whether an offset is added, and the range of the codes. */
static int paired(int codec) { return codec == HSG_Q4 || codec == HSG_Q5; }
static int group_of(int codec) { return codec == HSG_Q8X || codec == HSG_Q8H ? HSG_HALF : HSG_BLOCK; }
static int has_offset(int codec) { return codec == HSG_Q4 || codec == HSG_Q8X || codec == HSG_Q5; }
static int lo_code(int codec) { return codec == HSG_Q4 || codec == HSG_Q5 ? 0 : -128; }
static int hi_code(int codec) { return codec == HSG_Q4 ? 15 : codec == HSG_Q5 ? 31 : 127; }
/* where a block's codes start: after its scales' (and offsets') floats, 64 bytes per group of 16 columns */
static int codes_at(int codec) { return 64 * (HSG_BLOCK / group_of(codec)) * (1 + has_offset(codec)); }

int hsg_code_form(int codec, int *group, int *lo, int *hi, int *offset) {
    if (block_bytes(codec) == 0) return -1;
    *group = group_of(codec), *lo = lo_code(codec), *hi = hi_code(codec), *offset = has_offset(codec);
    return 0;
}

static int half_codec(int codec) { return codec == HSG_F16 || codec == HSG_BF16; }

static int64_t panel_bytes(int codec, int64_t k) {
    return codec == HSG_F32 ? k * HSG_PANEL * 4 : half_codec(codec) ? k * HSG_PANEL * 2 : k / HSG_BLOCK * block_bytes(codec);
}

int64_t hsg_packed_bytes(int codec, int64_t n, int64_t k) {
    if (n < 0 || k < 0 || (codec != HSG_F32 && !half_codec(codec) && (block_bytes(codec) == 0 || k % HSG_BLOCK)))
        return -1;
    return HSG_HEADER + (n + HSG_PANEL - 1) / HSG_PANEL * panel_bytes(codec, k);
}

int64_t hsg_packed_floats(int64_t n, int64_t k) { return hsg_packed_bytes(HSG_F32, n, k) / 4; }

static void header(void *wp, int codec, int64_t n, int64_t k) {
    hsg_header hd = {HSG_MAGIC, (uint32_t)codec, n, k};
    memset(wp, 0, HSG_HEADER);
    memcpy(wp, &hd, sizeof hd);
}

int hsg_check(const void *wp, int64_t n, int64_t k) {
    hsg_header hd;
    memcpy(&hd, wp, sizeof hd);
    return hd.magic == HSG_MAGIC && hd.n == n && hd.k == k && hsg_packed_bytes((int)hd.codec, n, k) >= 0 ? 0 : -1;
}

void hsg_pack(const float *w, int64_t ldw, float *wp, int64_t n, int64_t k) {
    header(wp, HSG_F32, n, k);
    wp += HSG_HEADER / 4;
    int64_t panels = (n + HSG_PANEL - 1) / HSG_PANEL;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * HSG_PANEL * k;
        for (int64_t j = 0; j < HSG_PANEL; j++) {
            int64_t col = p * HSG_PANEL + j;
            for (int64_t kk = 0; kk < k; kk++) dst[kk * HSG_PANEL + j] = col < n ? w[col * ldw + kk] : 0.0f;
        }
    }
}

int hsg_pack_codes(int codec, const int8_t *q, const float *d, const float *m, void *wp, int64_t n, int64_t k) {
    if (block_bytes(codec) == 0 || hsg_packed_bytes(codec, n, k) < 0 || (has_offset(codec) && !m)) return -1;
    const int gs = group_of(codec), ng = HSG_BLOCK / gs, at = codes_at(codec), shift = gs == HSG_HALF ? 4 : 5;
    const int lo = lo_code(codec), hi = hi_code(codec), pairs = paired(codec);
    const int exact = has_offset(codec) && codec != HSG_Q4; /* (Q4: its scales' 20 bits, below) */
    const int64_t nk = k / gs, nb = k / HSG_BLOCK, bb = block_bytes(codec);
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < k; c++) {
            const int v = q[r * k + c];
            if (v < lo || v > hi) return -1;
            const float s = d[r * nk + (c >> shift)], p = (float)v * s;
            if (exact && (double)p != (double)v * (double)s) return -1; /* d * q exact */
        }
    for (int64_t i = 0; codec == HSG_Q4 && i < n * nb; i++) { /* rows.h: at most 20 significant bits */
        uint32_t bits;
        memcpy(&bits, d + i, 4);
        if (bits & 0xF) return -1;
    }
    header(wp, codec, n, k);
    uint8_t *body = (uint8_t *)wp + HSG_HEADER;
    int64_t panels = (n + HSG_PANEL - 1) / HSG_PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = body + (p * nb + b) * bb;
            float dm[2][2][HSG_PANEL] = {{{0}}}; /* [d or m][group][column] */
            uint16_t hi[HSG_BLOCK] = {0};         /* HSG_Q5: bit 4 of the codes, a bit a column */
            memset(blk, 0, (size_t)bb);
            for (int j = 0; j < HSG_PANEL; j++) {
                int64_t col = p * HSG_PANEL + j;
                if (col >= n) continue;
                for (int g = 0; g < ng; g++) {
                    dm[0][g][j] = d[col * nk + b * ng + g];
                    dm[1][g][j] = has_offset(codec) ? m[col * nk + b * ng + g] : 0.0f;
                }
                for (int r = 0; r < HSG_BLOCK; r++) {
                    int c = q[col * k + b * HSG_BLOCK + r];
                    if (!pairs) {
                        blk[at + r * HSG_PANEL + j] = (uint8_t)c;
                        continue;
                    }
                    unsigned u = (unsigned)c;
                    blk[at + (r / 2) * HSG_PANEL + j] |= (uint8_t)((u & 15u) << (4 * (r % 2)));
                    if (codec == HSG_Q5) hi[r] |= (uint16_t)((u >> 4 & 1u) << j);
                }
            }
            memcpy(blk, dm[0], (size_t)(64 * ng));
            if (has_offset(codec)) memcpy(blk + 64 * ng, dm[1], (size_t)(64 * ng));
            if (codec == HSG_Q5) memcpy(blk + at + 256, hi, sizeof hi);
        }
    return 0;
}

float hsg_half_float(uint16_t h, int codec) { /* a float16 / bfloat16 pattern's value, exactly (rows.h) */
    uint32_t bits;
    if (codec == HSG_BF16) {
        bits = (uint32_t)h << 16;
    } else {
        uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
        if (e == 0) return (s ? -1.0f : 1.0f) * ldexpf((float)m, -24); /* zero and subnormals */
        bits = s | (e == 31 ? 0x7F800000u | m << 13 : (e + 112) << 23 | m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int hsg_pack_half(int codec, const uint16_t *h, void *wp, int64_t n, int64_t k) {
    if (!half_codec(codec) || n < 0 || k < 0) return -1;
    for (int64_t i = 0; i < n * k; i++)
        if (!isfinite(hsg_half_float(h[i], codec))) return -1;
    header(wp, codec, n, k);
    uint16_t *body = (uint16_t *)((uint8_t *)wp + HSG_HEADER);
    int64_t panels = (n + HSG_PANEL - 1) / HSG_PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < HSG_PANEL; j++) {
                int64_t col = p * HSG_PANEL + j;
                body[(p * k + kk) * HSG_PANEL + j] = col < n ? h[col * k + kk] : 0;
            }
    return 0;
}

/* The weight W[16p + j][kk] of a coded panel (`panel`: its first byte), decoded as rows.h says. */
static inline float coded(const uint8_t *panel, int codec, int64_t kk, int j) {
    if (half_codec(codec)) {
        uint16_t h;
        memcpy(&h, panel + 2 * (kk * HSG_PANEL + j), 2);
        return hsg_half_float(h, codec);
    }
    const uint8_t *blk = panel + kk / HSG_BLOCK * block_bytes(codec);
    const int r = (int)(kk % HSG_BLOCK), g = r / group_of(codec), at = codes_at(codec);
    float d, m;
    memcpy(&d, blk + 64 * g + 4 * j, 4);
    int c;
    if (paired(codec)) {
        c = blk[at + (r / 2) * HSG_PANEL + j] >> (4 * (r % 2)) & 15;
        if (codec == HSG_Q5) {
            uint16_t hi;
            memcpy(&hi, blk + at + 256 + 2 * r, 2);
            c |= (hi >> j & 1) << 4;
        }
    } else {
        c = (int8_t)blk[at + r * HSG_PANEL + j];
    }
    if (!has_offset(codec)) return (float)c * d;
    memcpy(&m, blk + 64 * (HSG_BLOCK / group_of(codec)) + 64 * g + 4 * j, 4);
    return fmaf((float)c, d, m);
}

int hsg_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* One tile: rows x[0..mb) against panels wp[0..nb) (wp: the first panel's first byte), writing `cols` valid
 * columns (<= nb*16) of y. */
typedef void (*hsg_tile)(const float *x, int64_t ldx, const uint8_t *wp, int64_t k, const float *bias, float *y,
                         int64_t ldy, int64_t cols);

/* ---- portable ------------------------------------------------------------------------------------------- */

static void tile_portable(const float *x, int64_t ldx, const uint8_t *wp, int64_t k, const float *bias, float *y,
                          int64_t ldy, int64_t cols, int nb, int mb, int codec) {
    for (int a = 0; a < nb; a++) {
        const uint8_t *panel = wp + (int64_t)a * panel_bytes(codec, k);
        const float *w = (const float *)panel;
        for (int b = 0; b < mb; b++) {
            float acc[HSG_PANEL] = {0};
            const float *xr = x + b * ldx;
            for (int64_t kk = 0; kk < k; kk++)
                for (int j = 0; j < HSG_PANEL; j++)
                    acc[j] = fmaf(codec == HSG_F32 ? w[kk * HSG_PANEL + j] : coded(panel, codec, kk, j), xr[kk],
                                  acc[j]);
            for (int j = 0; j < HSG_PANEL; j++) {
                int64_t c = (int64_t)a * HSG_PANEL + j;
                if (c < cols) y[b * ldy + c] = bias ? acc[j] + bias[c] : acc[j];
            }
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HSG_X86 1

/* Each tile asks for the weights HSG_AHEAD steps of k ahead of the ones it multiplies (a panel's row of k is one
 * 64-byte line), and near the end of its panels for the first rows of the next tile's.  On a 2-core Xeon VM
 * (AVX-512) the hardware prefetch alone let the products of 4-12 rows add to the weights' stream instead of hiding
 * under it: SmolLM2-135M's whole forward went from 26 / 36 / 44 ms to 22 / 28 / 32 ms for 1 / 7 / 12 rows
 * (distances 16, 32 and 64 measured alike).  A prefetch never faults, so the ones past the last panel are
 * harmless; none changes a result. */
/* Each tile's loops over its panels, rows and halves run a constant number of times: unrolled before GCC lays out
 * the accumulators, so that they stay in registers.  Without it GCC kept the array in memory and stored every
 * accumulator after every multiply-add (12-24 stores a step of k), which bound the tiles: on a 2-core AMD EPYC
 * (Zen 3) a 6-row float32 tile ran at a third of its speed. */
#define UNROLL _Pragma("GCC unroll 16")

#ifndef HSG_AHEAD
#define HSG_AHEAD 16
#endif

/* The prefetch of a coded tile at block kb of `blocks`: the blocks `lookahead` ahead of its panels [0, nb) (2 x 384
 * or 576 bytes a panel), and near the end the next tile's first ones. */
static inline __attribute__((always_inline)) void prefetch_blocks(const uint8_t *blk, int64_t kb, int64_t blocks,
                                                                  int nb, int64_t ps, int64_t bb) {
    const int lookahead = 2;
    int64_t ahead = lookahead * bb + (kb + lookahead >= blocks ? (int64_t)(nb - 1) * ps : 0);
    UNROLL
    for (int a = 0; a < nb; a++)
        for (int64_t l = 0; l < bb; l += 64) _mm_prefetch((const char *)(blk + a * ps + ahead + l), _MM_HINT_T0);
}

/* ---- AVX-512: a panel is one register; NB x MB <= 24 accumulators ------------------------------------------ */

#define T512 __attribute__((target("avx512f")))

/* The decodings of rows.h, one register of 16 weights each: the one place for each formula (the tiles and
 * decode512 read them). */
static inline __attribute__((always_inline)) T512 __m512 half512(const uint8_t *w, int codec) { /* 16 x 16 bits */
    __m256i h = _mm256_loadu_si256((const __m256i *)w);
    return codec == HSG_F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row r of a Q8 or Q8H block: q * d, d per 32 (Q8) or 16 (Q8H) rows. */
static inline __attribute__((always_inline)) T512 __m512 q8_512(const uint8_t *blk, int r, int codec) {
    const int at = codes_at(codec), ds = 64 * (r / group_of(codec));
    __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + at + r * HSG_PANEL)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_loadu_ps((const float *)(blk + ds)));
}

static inline __attribute__((always_inline)) T512 __m512 q8x_512(const uint8_t *blk, int r) { /* row r */
    const int h = r / HSG_HALF;
    __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 256 + r * HSG_PANEL)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_loadu_ps((const float *)(blk + 64 * h)),
                           _mm512_loadu_ps((const float *)(blk + 128 + 64 * h)));
}

/* Row r of a one-k-a-step block (HSG_Q8, HSG_Q8H, HSG_Q8X). */
static inline __attribute__((always_inline)) T512 __m512 row512(const uint8_t *blk, int r, int codec) {
    return codec == HSG_Q8X ? q8x_512(blk, r) : q8_512(blk, r, codec);
}

/* Rows 2t and 2t + 1 of a block of paired codes (HSG_Q4, HSG_Q5): the low 4 bits from a byte a column, Q5's bit 4
 * from a uint16 a row, which is a mask of 16 lanes as it is (one masked add). */
static inline __attribute__((always_inline)) T512 void pair512(const uint8_t *blk, int t, int codec, __m512 *w0,
                                                               __m512 *w1) {
    const __m512 d = _mm512_loadu_ps((const float *)blk), m = _mm512_loadu_ps((const float *)(blk + 64));
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 128 + t * HSG_PANEL)));
    __m512i c0 = _mm512_and_si512(c, _mm512_set1_epi32(15)), c1 = _mm512_srli_epi32(c, 4);
    if (codec == HSG_Q5) {
        uint32_t h; /* rows 2t (low half) and 2t + 1 */
        memcpy(&h, blk + 384 + 4 * t, 4);
        c0 = _mm512_mask_add_epi32(c0, (__mmask16)(h & 0xFFFFu), c0, _mm512_set1_epi32(16));
        c1 = _mm512_mask_add_epi32(c1, (__mmask16)(h >> 16), c1, _mm512_set1_epi32(16));
    }
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0), d, m);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), d, m);
}

/* Coded panels: each block of 32 k decodes every panel's weights once per k (or pair of k: the paired codecs) into
 * registers, then runs the same fused multiply-adds as HSG_F32 over the tile's rows. */
static inline __attribute__((always_inline)) T512 void tile512(const float *x, int64_t ldx, const uint8_t *wp,
                                                               int64_t k, const float *bias, float *y, int64_t ldy,
                                                               int64_t cols, int nb, int mb, int codec) {
    __m512 acc[8][12];
    UNROLL
    for (int a = 0; a < nb; a++)
        UNROLL
        for (int b = 0; b < mb; b++) acc[a][b] = _mm512_setzero_ps();
    const int64_t ps = panel_bytes(codec, k);
    if (codec == HSG_F32 || half_codec(codec)) {
        const int es = codec == HSG_F32 ? 4 : 2; /* bytes a weight */
        for (int64_t kk = 0; kk < k; kk++) {
            __m512 wv[8];
            int64_t ahead = (HSG_AHEAD * HSG_PANEL + (kk + HSG_AHEAD >= k ? (int64_t)(nb - 1) * HSG_PANEL * k : 0)) * es;
            UNROLL
            for (int a = 0; a < nb; a++) {
                const uint8_t *w = wp + ((int64_t)a * HSG_PANEL * k + kk * HSG_PANEL) * es;
                wv[a] = codec == HSG_F32 ? _mm512_loadu_ps((const float *)w) : half512(w, codec);
                if (codec == HSG_F32 || (kk & 1) == 0) _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);
            }
            UNROLL
            for (int b = 0; b < mb; b++) {
                __m512 xb = _mm512_set1_ps(x[b * ldx + kk]);
                UNROLL
                for (int a = 0; a < nb; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xb, acc[a][b]);
            }
        }
    } else {
        const int64_t bb = block_bytes(codec), blocks = k / HSG_BLOCK;
        for (int64_t kb = 0; kb < blocks; kb++) {
            const uint8_t *blk = wp + kb * bb;
            prefetch_blocks(blk, kb, blocks, nb, ps, bb);
            const float *xk = x + kb * HSG_BLOCK;
            if (!paired(codec)) {
                for (int r = 0; r < HSG_BLOCK; r++) {
                    __m512 wv[8];
                    UNROLL
                    for (int a = 0; a < nb; a++) wv[a] = row512(blk + a * ps, r, codec);
                    UNROLL
                    for (int b = 0; b < mb; b++) {
                        __m512 xb = _mm512_set1_ps(xk[b * ldx + r]);
                        UNROLL
                        for (int a = 0; a < nb; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xb, acc[a][b]);
                    }
                }
            } else {
                for (int t = 0; t < HSG_BLOCK / 2; t++) {
                    __m512 w0[8], w1[8];
                    UNROLL
                    for (int a = 0; a < nb; a++) pair512(blk + a * ps, t, codec, &w0[a], &w1[a]);
                    UNROLL
                    for (int b = 0; b < mb; b++) {
                        __m512 x0 = _mm512_set1_ps(xk[b * ldx + 2 * t]), x1 = _mm512_set1_ps(xk[b * ldx + 2 * t + 1]);
                        UNROLL
                        for (int a = 0; a < nb; a++) {
                            acc[a][b] = _mm512_fmadd_ps(w0[a], x0, acc[a][b]);
                            acc[a][b] = _mm512_fmadd_ps(w1[a], x1, acc[a][b]);
                        }
                    }
                }
            }
        }
    }
    UNROLL
    for (int a = 0; a < nb; a++) {
        int64_t rem = cols - (int64_t)a * HSG_PANEL;
        if (rem <= 0) break;
        __mmask16 mask = rem >= HSG_PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1u);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + a * HSG_PANEL) : _mm512_setzero_ps();
        UNROLL
        for (int b = 0; b < mb; b++) {
            __m512 v = bias ? _mm512_add_ps(acc[a][b], bv) : acc[a][b];
            _mm512_mask_storeu_ps(y + b * ldy + a * HSG_PANEL, mask, v);
        }
    }
}

/* The tiles of instruction set W (512 or 256) as functions of one signature, NB panels x MB rows, one per codec
 * (a table may leave a codec's shape out: unused, then). */
#define TILEC(W, NB, MB, C, CODEC)                                                                                 \
    static T##W __attribute__((unused)) void t##W##C##_##NB##_##MB(const float *x, int64_t ldx, const uint8_t *wp, \
                                                                   int64_t k, const float *bias, float *y,          \
                                                                   int64_t ldy, int64_t cols) {                     \
        tile##W(x, ldx, wp, k, bias, y, ldy, cols, NB, MB, CODEC);                                                \
    }
#define TILES(W, NB, MB)                                                                                           \
    TILEC(W, NB, MB, f, HSG_F32) TILEC(W, NB, MB, q8, HSG_Q8) TILEC(W, NB, MB, q4, HSG_Q4)                         \
    TILEC(W, NB, MB, h, HSG_F16) TILEC(W, NB, MB, bh, HSG_BF16) TILEC(W, NB, MB, q8x, HSG_Q8X)                     \
    TILEC(W, NB, MB, q5, HSG_Q5) TILEC(W, NB, MB, q8h, HSG_Q8H)
#define TILE512(NB, MB) TILES(512, NB, MB)
TILE512(8, 1) TILE512(8, 2) TILE512(4, 3) TILE512(4, 4) TILE512(4, 5) TILE512(4, 6)
TILE512(2, 7) TILE512(2, 8) TILE512(2, 9) TILE512(2, 10) TILE512(2, 11) TILE512(2, 12)
TILE512(1, 1) TILE512(1, 2) TILE512(1, 3) TILE512(1, 4) TILE512(1, 5) TILE512(1, 6)
TILE512(1, 7) TILE512(1, 8) TILE512(1, 9) TILE512(1, 10) TILE512(1, 11) TILE512(1, 12)
#define TABLES512(C)                                                                                               \
    {0, t512##C##_8_1, t512##C##_8_2, t512##C##_4_3, t512##C##_4_4, t512##C##_4_5, t512##C##_4_6, t512##C##_2_7,  \
     t512##C##_2_8, t512##C##_2_9, t512##C##_2_10, t512##C##_2_11, t512##C##_2_12},                               \
    {0, t512##C##_1_1, t512##C##_1_2, t512##C##_1_3, t512##C##_1_4, t512##C##_1_5, t512##C##_1_6, t512##C##_1_7,  \
     t512##C##_1_8, t512##C##_1_9, t512##C##_1_10, t512##C##_1_11, t512##C##_1_12}
/* [codec][wide?][mb] */
static const hsg_tile TILES512[8][2][13] = {{TABLES512(f)},  {TABLES512(q8)},  {TABLES512(q4)}, {TABLES512(h)},
                                            {TABLES512(bh)}, {TABLES512(q8x)}, {TABLES512(q5)}, {TABLES512(q8h)}};
static const int NB512[13] = {0, 8, 8, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2};

/* One coded panel decoded into float32 panel layout (out[kk * 16 + j]): what a call of many rows reads instead of
 * decoding it again for every chunk of 12 rows. */
static T512 void decode512(const uint8_t *panel, int codec, int64_t k, float *out) {
    if (half_codec(codec)) {
        for (int64_t kk = 0; kk < k; kk++) _mm512_storeu_ps(out + kk * HSG_PANEL, half512(panel + 32 * kk, codec));
        return;
    }
    const int64_t bb = block_bytes(codec);
    for (int64_t kb = 0; kb < k / HSG_BLOCK; kb++) {
        const uint8_t *blk = panel + kb * bb;
        float *o = out + kb * HSG_BLOCK * HSG_PANEL;
        for (int t = 0; t < HSG_BLOCK / 2; t++) {
            __m512 w0, w1;
            if (!paired(codec)) {
                w0 = row512(blk, 2 * t, codec);
                w1 = row512(blk, 2 * t + 1, codec);
            } else {
                pair512(blk, t, codec, &w0, &w1);
            }
            _mm512_storeu_ps(o + 2 * t * HSG_PANEL, w0);
            _mm512_storeu_ps(o + (2 * t + 1) * HSG_PANEL, w1);
        }
    }
}

/* A thread's buffer of `floats` floats for decoded panels, kept for the thread's later calls (NULL: no memory). */
static float *group_buffer(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (floats > cap) {
        float *b = realloc(buf, (size_t)floats * sizeof(float));
        if (!b) return NULL;
        buf = b;
        cap = floats;
    }
    return buf;
}


/* ---- AVX2: a panel is two registers; 2 x NB x MB <= 12 accumulators ----------------------------------------- */

#define T256 __attribute__((target("avx2,fma,f16c")))

static inline __attribute__((always_inline)) T256 __m256i mask256(int64_t rem) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(rem < 8 ? rem : 8)), lanes);
}

/* The decodings of rows.h as two registers of 8 weights (columns 0-7 and 8-15), the same values as half512,
 * q8_512, q8x_512 and pair512: float16 through F16C (exact), bfloat16 by a shift, Q8 by one rounded product, Q4,
 * Q5 and Q8X by one fused multiply-add. */
static inline __attribute__((always_inline)) T256 void half256(const uint8_t *w, int codec, __m256 *v) {
    __m128i h0 = _mm_loadu_si128((const __m128i *)w), h1 = _mm_loadu_si128((const __m128i *)(w + 16));
    if (codec == HSG_F16) {
        v[0] = _mm256_cvtph_ps(h0);
        v[1] = _mm256_cvtph_ps(h1);
    } else {
        v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
        v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
    }
}

/* Half h (columns 8h..8h+7) of row r of a Q8 or Q8H block. */
static inline __attribute__((always_inline)) T256 __m256 q8_256(const uint8_t *blk, int r, int h, int codec) {
    const int at = codes_at(codec), ds = 64 * (r / group_of(codec));
    __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + at + r * HSG_PANEL + 8 * h)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_loadu_ps((const float *)(blk + ds + 32 * h)));
}

static inline __attribute__((always_inline)) T256 __m256 q8x_256(const uint8_t *blk, int r, int h) {
    const int s = r / HSG_HALF;
    __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 256 + r * HSG_PANEL + 8 * h)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_loadu_ps((const float *)(blk + 64 * s + 32 * h)),
                           _mm256_loadu_ps((const float *)(blk + 128 + 64 * s + 32 * h)));
}

/* Half h of row r of a one-k-a-step block (HSG_Q8, HSG_Q8H, HSG_Q8X). */
static inline __attribute__((always_inline)) T256 __m256 row256(const uint8_t *blk, int r, int h, int codec) {
    return codec == HSG_Q8X ? q8x_256(blk, r, h) : q8_256(blk, r, h, codec);
}

/* 16 times each bit of a byte, as 8 int32 lanes (AVX2's Q5: a row's bit 4 of 8 columns, one load). */
#define BIT4_(n, b) (((n) >> (b) & 1) * 16)
#define BIT4_ROW(n)                                                                                               \
    {BIT4_(n, 0), BIT4_(n, 1), BIT4_(n, 2), BIT4_(n, 3), BIT4_(n, 4), BIT4_(n, 5), BIT4_(n, 6), BIT4_(n, 7)}
#define BIT4_4(n) BIT4_ROW(n), BIT4_ROW(n + 1), BIT4_ROW(n + 2), BIT4_ROW(n + 3)
#define BIT4_16(n) BIT4_4(n), BIT4_4(n + 4), BIT4_4(n + 8), BIT4_4(n + 12)
#define BIT4_64(n) BIT4_16(n), BIT4_16(n + 16), BIT4_16(n + 32), BIT4_16(n + 48)
static const int32_t BIT4[256][8] __attribute__((aligned(32))) = {BIT4_64(0), BIT4_64(64), BIT4_64(128),
                                                                  BIT4_64(192)};

/* Half h of rows 2t (w0) and 2t + 1 (w1) of a block of paired codes, as pair512: a row's bit 4 of columns
 * 8h..8h+7 is a byte of its uint16, looked up as 8 lanes. */
static inline __attribute__((always_inline)) T256 void pair256(const uint8_t *blk, int t, int h, int codec,
                                                                __m256 *w0, __m256 *w1) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 128 + t * HSG_PANEL + 8 * h)));
    __m256i c0 = _mm256_and_si256(c, _mm256_set1_epi32(15)), c1 = _mm256_srli_epi32(c, 4);
    if (codec == HSG_Q5) { /* rows 2t and 2t + 1: bytes h and 2 + h of their two uint16 */
        c0 = _mm256_add_epi32(c0, _mm256_load_si256((const __m256i *)BIT4[blk[384 + 4 * t + h]]));
        c1 = _mm256_add_epi32(c1, _mm256_load_si256((const __m256i *)BIT4[blk[384 + 4 * t + 2 + h]]));
    }
    const __m256 d = _mm256_loadu_ps((const float *)(blk + 32 * h));
    const __m256 m = _mm256_loadu_ps((const float *)(blk + 64 + 32 * h));
    *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), d, m);
    *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), d, m);
}

/* An empty asm that the compiler must assume changes p: the scales read through p stay loads inside the loop
 * (operands of the multiply-adds) instead of 4 registers a panel hoisted out of it, which with 16 ymm registers
 * pushed the accumulators of a 4-panel tile onto the stack (measured: 2x slower). */
#define OPAQUE(p) __asm__("" : "+r"(p))

/* One tile over any codec, as tile512: coded weights are decoded once per k (or pair of k) and panel, then the
 * same fused multiply-adds as HSG_F32 run over the tile's rows, in order of k for every sum. */
static inline __attribute__((always_inline)) T256 void tile256(const float *x, int64_t ldx, const uint8_t *wp,
                                                               int64_t k, const float *bias, float *y, int64_t ldy,
                                                               int64_t cols, int nb, int mb, int codec) {
    __m256 acc[4][6][2];
    UNROLL
    for (int a = 0; a < nb; a++)
        UNROLL
        for (int b = 0; b < mb; b++) acc[a][b][0] = acc[a][b][1] = _mm256_setzero_ps();
    const int64_t ps = panel_bytes(codec, k);
    if (codec == HSG_F32 || half_codec(codec)) {
        const int es = codec == HSG_F32 ? 4 : 2; /* bytes a weight */
        for (int64_t kk = 0; kk < k; kk++) {
            __m256 wv[4][2];
            int64_t ahead = HSG_AHEAD * HSG_PANEL + (kk + HSG_AHEAD >= k ? (int64_t)(nb - 1) * HSG_PANEL * k : 0);
            ahead *= es;
            UNROLL
            for (int a = 0; a < nb; a++) {
                const uint8_t *w = wp + ((int64_t)a * HSG_PANEL * k + kk * HSG_PANEL) * es;
                if (codec == HSG_F32) {
                    wv[a][0] = _mm256_loadu_ps((const float *)w);
                    wv[a][1] = _mm256_loadu_ps((const float *)w + 8);
                } else {
                    half256(w, codec, wv[a]);
                }
                if (codec == HSG_F32 || (kk & 1) == 0) _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);
            }
            UNROLL
            for (int b = 0; b < mb; b++) {
                __m256 xb = _mm256_broadcast_ss(x + b * ldx + kk);
                UNROLL
                for (int a = 0; a < nb; a++) {
                    acc[a][b][0] = _mm256_fmadd_ps(wv[a][0], xb, acc[a][b][0]);
                    acc[a][b][1] = _mm256_fmadd_ps(wv[a][1], xb, acc[a][b][1]);
                }
            }
        }
    } else {
        /* Up to 10 accumulators (one panel of up to 5 rows, 2 x 2, 4 x 1): both halves of every panel at each step
         * of k.  More: the panels' first halves (columns 0-7) over the whole of K, then their second halves, so that
         * only NB x MB accumulators are live at a time and none is spilled: a half's codes are bytes of their own,
         * so nothing is decoded twice, and the second pass finds the tile's blocks in the cache.  Each sum is the
         * same chain either way.
         * Each accumulator is one chain of multiply-adds (two a Q4 step): a pass with 4 accumulators waits on
         * their latency (4 cycles on Zen 3) instead of filling the two FMA pipes, so one panel of 3-5 rows runs in
         * one pass (6-10 chains).  There the rows come outermost (both halves decoded first, each row's x broadcast
         * once for both), which keeps the registers at 16.  Zen 3 VM, one thread, cycles per 32 weights (Q4 / Q8),
         * 4 rows 15.9 / 15.9 -> 11.8 / 10.7, 5 rows 16.6 / 16.1 -> 13.3 / 12.7, 1-3 and 6 rows unchanged. */
        const int64_t bb = block_bytes(codec), blocks = k / HSG_BLOCK;
        const int passes = 2 * nb * mb <= 10 ? 1 : 2;
        UNROLL
        for (int pass = 0; pass < passes; pass++) {
            const int h0 = passes == 1 ? 0 : pass, h1 = passes == 1 ? 2 : pass + 1;
            for (int64_t kb = 0; kb < blocks; kb++) {
                const uint8_t *blk = wp + kb * bb;
                if (pass == 0) prefetch_blocks(blk, kb, blocks, nb, ps, bb);
                const float *xk = x + kb * HSG_BLOCK;
                /* panel by panel, so that only two decoded registers are live; a step is one k, or two (paired) */
                const int kstep = paired(codec) ? 2 : 1;
                for (int st = 0; st < HSG_BLOCK / kstep; st++)
                    UNROLL
                    for (int a = 0; a < nb; a++) {
                        const uint8_t *pb = blk + a * ps;
                        OPAQUE(pb);
                        if (passes == 1 && mb >= 3) { /* rows outermost (see above); nb is 1 here */
                            __m256 w0[2], w1[2];
                            UNROLL
                            for (int h = 0; h < 2; h++) {
                                w1[h] = _mm256_setzero_ps();
                                if (paired(codec))
                                    pair256(pb, st, h, codec, &w0[h], &w1[h]);
                                else
                                    w0[h] = row256(pb, st, h, codec);
                            }
                            UNROLL
                            for (int b = 0; b < mb; b++) {
                                const float *xb = xk + b * ldx + kstep * st;
                                __m256 x0 = _mm256_broadcast_ss(xb);
                                __m256 x1 = paired(codec) ? _mm256_broadcast_ss(xb + 1) : _mm256_setzero_ps();
                                UNROLL
                                for (int h = 0; h < 2; h++) {
                                    acc[a][b][h] = _mm256_fmadd_ps(w0[h], x0, acc[a][b][h]);
                                    if (paired(codec)) acc[a][b][h] = _mm256_fmadd_ps(w1[h], x1, acc[a][b][h]);
                                }
                            }
                            continue;
                        }
                        UNROLL
                        for (int h = h0; h < h1; h++) {
                            __m256 w0, w1 = _mm256_setzero_ps();
                            if (paired(codec))
                                pair256(pb, st, h, codec, &w0, &w1);
                            else
                                w0 = row256(pb, st, h, codec);
                            UNROLL
                            for (int b = 0; b < mb; b++) {
                                const float *xb = xk + b * ldx + kstep * st;
                                acc[a][b][h] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xb), acc[a][b][h]);
                                if (paired(codec))
                                    acc[a][b][h] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xb + 1), acc[a][b][h]);
                            }
                        }
                    }
            }
        }
    }
    UNROLL
    for (int a = 0; a < nb; a++)
        UNROLL
        for (int h = 0; h < 2; h++) {
            int64_t rem = cols - (int64_t)a * HSG_PANEL - 8 * h;
            if (rem <= 0) break;
            __m256i mask = mask256(rem);
            const float *bp = bias ? bias + a * HSG_PANEL + 8 * h : NULL;
            __m256 bv = bp ? _mm256_maskload_ps(bp, mask) : _mm256_setzero_ps();
            UNROLL
            for (int b = 0; b < mb; b++) {
                __m256 v = bp ? _mm256_add_ps(acc[a][b][h], bv) : acc[a][b][h];
                _mm256_maskstore_ps(y + b * ldy + a * HSG_PANEL + 8 * h, mask, v);
            }
        }
}

#define TILE256(NB, MB) TILES(256, NB, MB)
TILE256(4, 1) TILE256(2, 2) TILE256(2, 3) TILE256(1, 1) TILE256(1, 2) TILE256(1, 3) TILE256(1, 4) TILE256(1, 5)
TILE256(1, 6)
/* [codec][wide?][mb]: a tile of 3 rows of codes or 16-bit weights is one panel (6 chains; see tile256 for codes),
 * a float32 one two (12 accumulators: the 16-bit decodings' registers spilled them, 13.6 cycles per 32 float16
 * weights against 8.3 for one panel). */
#define TABLES256(C, NB3)                                                                                          \
    {0, t256##C##_4_1, t256##C##_2_2, t256##C##_##NB3##_3, t256##C##_1_4, t256##C##_1_5, t256##C##_1_6},          \
    {0, t256##C##_1_1, t256##C##_1_2, t256##C##_1_3, t256##C##_1_4, t256##C##_1_5, t256##C##_1_6}
static const hsg_tile TILES256[8][2][7] = {{TABLES256(f, 2)}, {TABLES256(q8, 1)},  {TABLES256(q4, 1)},
                                           {TABLES256(h, 1)}, {TABLES256(bh, 1)}, {TABLES256(q8x, 1)},
                                           {TABLES256(q5, 1)}, {TABLES256(q8h, 1)}};
static const int NB256[2][7] = {{0, 4, 2, 2, 1, 1, 1}, {0, 4, 2, 1, 1, 1, 1}}; /* [not float32?][mb] */

/* decode512's AVX2 twin. */
static T256 void decode256(const uint8_t *panel, int codec, int64_t k, float *out) {
    if (half_codec(codec)) {
        __m256 v[2];
        for (int64_t kk = 0; kk < k; kk++) {
            half256(panel + 32 * kk, codec, v);
            _mm256_storeu_ps(out + kk * HSG_PANEL, v[0]);
            _mm256_storeu_ps(out + kk * HSG_PANEL + 8, v[1]);
        }
        return;
    }
    const int64_t bb = block_bytes(codec);
    for (int64_t kb = 0; kb < k / HSG_BLOCK; kb++) {
        const uint8_t *blk = panel + kb * bb;
        float *o = out + kb * HSG_BLOCK * HSG_PANEL;
        for (int t = 0; t < HSG_BLOCK / 2; t++)
            for (int h = 0; h < 2; h++) {
                __m256 w0, w1;
                if (!paired(codec)) {
                    w0 = row256(blk, 2 * t, h, codec);
                    w1 = row256(blk, 2 * t + 1, h, codec);
                } else {
                    pair256(blk, t, h, codec, &w0, &w1);
                }
                _mm256_storeu_ps(o + 2 * t * HSG_PANEL + 8 * h, w0);
                _mm256_storeu_ps(o + (2 * t + 1) * HSG_PANEL + 8 * h, w1);
            }
    }
}
#endif

#ifdef HSG_X86
#include <cpuid.h>
static int f16c(void) { /* CPUID leaf 1, ECX bit 29: the float16 conversions AVX2's half256 uses */
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
}
#endif

int hsg_isa_best(void) {
#ifdef HSG_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return HSG_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c()) return HSG_ISA_AVX2;
#endif
    return HSG_ISA_PORTABLE;
}

/* Panels [p0, p1) of every row: see the file's comment. */
static void run_range(const float *x, int64_t ldx, const uint8_t *wp, int codec, const float *bias, float *y,
                      int64_t ldy, int64_t m, int64_t n, int64_t k, int isa, int64_t p0, int64_t p1) {
    int chunk = isa == HSG_ISA_AVX512 ? 12 : isa == HSG_ISA_AVX2 ? 6 : 4;
    const int64_t ps = panel_bytes(codec, k);
    /* AVX2 with codes or 16-bit weights, 7-10 rows: two tiles of at most 5 rows each (the first takes the odd row)
     * read them as they are, which beats decoding them once for 6 + the rest (Zen 3 VM, one thread, cycles per 32 weights,
     * Q4 / Q8 / float16: 7 rows 28.0 / 25.6 / 24.6 -> 24.0 / 20.6 / 16.3, 8 rows 30.6 / 29.2 / 27.7 -> 25.0 / 22.8 /
     * 16.6, 10 rows 30.4 / 29.7 / 29.8 -> 29.0 / 25.9 / 21.5) */
    const int split = isa == HSG_ISA_AVX2 && codec != HSG_F32 && m > chunk && m <= 10;
    /* codes and more rows than one chunk: each group's panels decoded once, then read as float32 by every chunk */
    float *dec = NULL;
#ifdef HSG_X86
    if (!split && isa != HSG_ISA_PORTABLE && codec != HSG_F32 && m > chunk)
        dec = group_buffer(HSG_GROUP * HSG_PANEL * k);
#endif
    for (int64_t g = p0; g < p1; g += HSG_GROUP) {
        int64_t g1 = g + HSG_GROUP < p1 ? g + HSG_GROUP : p1;
#ifdef HSG_X86
        for (int64_t p = g; dec && p < g1; p++) {
            float *o = dec + (p - g) * HSG_PANEL * k;
            if (isa == HSG_ISA_AVX512)
                decode512(wp + p * ps, codec, k, o);
            else
                decode256(wp + p * ps, codec, k, o);
        }
#endif
        const int cc = dec ? HSG_F32 : codec; /* the codec the tiles read */
        int r;
        for (int64_t m0 = 0; m0 < m; m0 += r) {
            r = (int)(split ? (m0 == 0 ? (m + 1) / 2 : m - m0) : m - m0 < chunk ? m - m0 : chunk);
            const float *xr = x + m0 * ldx;
            float *yr = y + m0 * ldy;
            int64_t p = g;
            while (p < g1) {
                int nb = 1;
                hsg_tile fn = NULL;
#ifdef HSG_X86
                if (isa == HSG_ISA_AVX512) {
                    nb = p + NB512[r] <= g1 ? NB512[r] : 1;
                    fn = TILES512[cc][nb > 1 ? 0 : 1][r];
                } else if (isa == HSG_ISA_AVX2) {
                    const int *nbs = NB256[cc != HSG_F32];
                    nb = p + nbs[r] <= g1 ? nbs[r] : 1;
                    fn = TILES256[cc][nb > 1 ? 0 : 1][r];
                }
#endif
                int64_t col = p * HSG_PANEL;
                int64_t cols = n - col < (int64_t)nb * HSG_PANEL ? n - col : (int64_t)nb * HSG_PANEL;
                const uint8_t *w = dec ? (const uint8_t *)(dec + (p - g) * HSG_PANEL * k) : wp + p * ps;
                const float *bp = bias ? bias + col : NULL;
                if (fn)
                    fn(xr, ldx, w, k, bp, yr + col, ldy, cols);
                else
                    tile_portable(xr, ldx, w, k, bp, yr + col, ldy, cols, nb, r, cc);
                p += nb;
            }
        }
    }
}

void hsg_linear(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy, int64_t m,
                int64_t n, int64_t k, int isa, int threads) {
    int64_t panels = (n + HSG_PANEL - 1) / HSG_PANEL;
    if (m <= 0 || n <= 0) return;
    if (k <= 0) { /* an empty sum: the bias alone */
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) y[i * ldy + j] = bias ? 0.0f + bias[j] : 0.0f;
        return;
    }
    hsg_header hd;
    memcpy(&hd, wp, sizeof hd);
    const int codec = (int)hd.codec;
    const uint8_t *body = (const uint8_t *)wp + HSG_HEADER;
    int t = threads > 0 ? threads : hsg_threads();
    if (t > panels) t = (int)panels;
#ifdef _OPENMP
    if (t > 1) {
#pragma omp parallel num_threads(t)
        {
            int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
            run_range(x, ldx, body, codec, bias, y, ldy, m, n, k, isa, panels * id / nt, panels * (id + 1) / nt);
        }
        return;
    }
#endif
    run_range(x, ldx, body, codec, bias, y, ldy, m, n, k, isa, 0, panels);
}
