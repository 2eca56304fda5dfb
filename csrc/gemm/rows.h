/*
 * rows.h -- the CPU matrix kernel for a few rows (heterospec._gemm): y = x W^T (+ bias) over float32, with W
 * packed once into panels of 16 output columns.
 *
 * Why: a speculative cycle's forwards run 1-16 rows per linear layer.  MKL and oneDNN take another kernel, and
 * repack or re-block, as the row count changes: on a 2-core Xeon a 6-row forward of SmolLM2-135M cost 1.9x a
 * one-row one, while both stream the same weights from memory.  Here every call streams each weight once and
 * keeps up to 12 rows' sums in registers, so a few rows cost about what one does.
 *
 * The order of a sum is fixed: y[m][n] is the fused multiply-adds x[m][0]*W[n][0], x[m][1]*W[n][1], ... in
 * order of k from 0, each rounded once (fmaf), then + bias[n].  So a row's bits depend on neither the call's
 * row count, nor its place in the call, nor the instruction set (AVX-512, AVX2 or the portable loop), nor the
 * thread count: the kernel is row-invariant by construction, on every x86 machine.
 *
 * Packed layout: a 64-byte header (hsg_header: a magic, the codec, n and k), then panels of 16 output columns,
 * the last padded with zeros (hsg_packed_bytes gives the size):
 *   HSG_F32: panel p holds columns 16p..16p+15 as floats wp[p*16*K + k*16 + j] = W[16p+j][k].
 *   HSG_Q8, HSG_Q4 (K a multiple of 32): a weight whose every block of 32 along k is, bit for bit, a float32
 *   decoding of small integer codes: W[n][k] = q * d[n][k/32] (Q8, q an int8, one rounding) or
 *   fmaf(q, d, m) = d * q + m (Q4, q in 0..15, d * q exact: d has at most 20 significant bits).  These are the
 *   values transformers' GGUF loader makes from Q8_0 and Q4_1 tensors (a quantized checkpoint loaded in float32),
 *   and Q4_K's (d the product of a float16 and a 6-bit scale, m minus another such product).
 *   HSG_Q8X (K a multiple of 32): every half-block of 16 along k is fmaf(q, d, m) = d * q + m with q an int8 and
 *   d * q exact (checked when packed), d and m per 16 weights: the decodings of Q6_K (m = -0, so that a code 0
 *   times a negative scale stays -0 as in the product alone) and Q3_K where Q8H does not take them, Q2_K tensors,
 *   and a matrix fused from rows of two formats (Q4_K and Q6_K; Q5_1 and Q8_0).
 *   HSG_Q5 (K a multiple of 32): every block of 32 along k is fmaf(q, d, m) with q in 0..31 and d * q exact
 *   (checked when packed): Q5_K's and Q5_1's decodings, 0.875 bytes a weight instead of Q8X's 1.5.
 *   HSG_Q8H (K a multiple of 32): every half-block of 16 along k is q * d (one rounding, as Q8) with q an int8: Q6_K's
 *   and Q3_K's decodings (a scale per 16, no offset), 1.25 bytes a weight instead of Q8X's 1.5.
 *   HSG_F16, HSG_BF16: a weight whose every value is a float16 (bfloat16) value, as a float16 EAGLE-3 head or a
 *   bfloat16 checkpoint loaded in float32 is: panel p holds uint16 wp[p*16*K + k*16 + j], the 16-bit pattern.
 *   The kernel decodes each weight back to the same float32 before the same fused multiply-add, so the bits are
 *   those of HSG_F32, from 0.75 (Q4), 0.875 (Q5), 1.125 (Q8), 1.25 (Q8H), 1.5 (Q8X) or 2 bytes a weight instead
 *   of 4.
 *   A Q panel is K/32 blocks: Q8 d[16] floats then int8 codes [32][16]; Q4 d[16], m[16] floats then bytes
 *   [16][16], byte [t][j] = q(2t, j) | q(2t+1, j) << 4; Q8X d[2][16], m[2][16] floats (rows 0-15 of the block take
 *   [0], rows 16-31 [1]) then int8 codes [32][16]; Q5 d[16], m[16] floats, the low 4 bits of each code as Q4's
 *   bytes [16][16], then uint16 [32] whose bit j of [r] is bit 4 of q(r, j); Q8H d[2][16] floats then int8 codes
 *   [32][16].
 */
#ifndef HS_GEMM_ROWS_H
#define HS_GEMM_ROWS_H

#include <stdint.h>

#define HSG_PANEL 16
#define HSG_BLOCK 32   /* k per block of codes (HSG_Q8, HSG_Q4, HSG_Q8X, HSG_Q5) */
#define HSG_HALF 16    /* k per scale (and offset) of HSG_Q8X and HSG_Q8H */
#define HSG_HEADER 64  /* bytes before the panels */
#define HSG_MAGIC 0x50475348u

enum { HSG_ISA_PORTABLE = 0, HSG_ISA_AVX2 = 1, HSG_ISA_AVX512 = 2 };
enum { HSG_F32 = 0, HSG_Q8 = 1, HSG_Q4 = 2, HSG_F16 = 3, HSG_BF16 = 4, HSG_Q8X = 5, HSG_Q5 = 6, HSG_Q8H = 7 };

typedef struct {
    uint32_t magic, codec;
    int64_t n, k;
} hsg_header;

/* Bytes of the packed copy of an N x K weight in `codec` (a multiple of 64), or -1 for an unknown codec or a
 * K the codec cannot take; hsg_packed_floats: the same for HSG_F32, in floats. */
int64_t hsg_packed_bytes(int codec, int64_t n, int64_t k);
int64_t hsg_packed_floats(int64_t n, int64_t k);

/* Pack w (N x K, row stride ldw) into wp (hsg_packed_floats(N, K) floats), HSG_F32. */
void hsg_pack(const float *w, int64_t ldw, float *wp, int64_t n, int64_t k);

/* Pack the codes q (N x K int8; HSG_Q4: 0..15, HSG_Q5: 0..31), scales d (N x K/32; HSG_Q8X, HSG_Q8H: N x K/16)
 * and, for HSG_Q4, HSG_Q8X and HSG_Q5, offsets m (the same shape as d) into wp (hsg_packed_bytes(codec, N, K)
 * bytes).  Returns 0, or -1 for a codec or K it cannot take, a code out of range or a product d * q that is not
 * exact where m is added (nothing meaningful written then). */
int hsg_pack_codes(int codec, const int8_t *q, const float *d, const float *m, void *wp, int64_t n, int64_t k);

/* The shape of a block codec's codes (above): k per scale (*group: 32, or 16 for HSG_Q8X and HSG_Q8H), the least
 * and the greatest code, and whether an offset is added (*offset: HSG_Q4, HSG_Q5, HSG_Q8X).  Returns 0, or -1 for a
 * codec without block codes (nothing written then). */
int hsg_code_form(int codec, int *group, int *lo, int *hi, int *offset);

/* Find the codes of `codec` (HSG_Q4, HSG_Q8, HSG_Q8X, HSG_Q5 or HSG_Q8H) that decode to w (N x K float32, K a
 * multiple of 32), bit for bit (codes.c says how): q (N x K int8), d and, but for HSG_Q8 and HSG_Q8H, m (N x K/32;
 * HSG_Q8X, HSG_Q8H: N x K/16) as hsg_pack_codes takes them.  Returns 0 when every block has codes, -1 when some
 * block has none (the search stops there; the outputs hold nothing meaningful), -2 for a codec or K it cannot take.
 * threads: OpenMP threads (<= 0: the runtime's current setting). */
int hsg_find_codes(int codec, const float *w, int64_t n, int64_t k, int8_t *q, float *d, float *m, int threads);

/* Pack the 16-bit patterns h (N x K: float16 for HSG_F16, bfloat16 for HSG_BF16) into wp (hsg_packed_bytes(codec,
 * N, K) bytes).  Returns 0, or -1 for another codec or a pattern that is not finite (nothing meaningful written). */
int hsg_pack_half(int codec, const uint16_t *h, void *wp, int64_t n, int64_t k);

/* The value of a float16 (HSG_F16) or bfloat16 (HSG_BF16) pattern, exactly; infinities and NaNs as themselves. */
float hsg_half_float(uint16_t h, int codec);

/* 0 when wp holds a packed copy of an N x K weight (its header says so), else -1. */
int hsg_check(const void *wp, int64_t n, int64_t k);

/* The widest instruction set this CPU runs (HSG_ISA_*; HSG_ISA_AVX2 means AVX2 with FMA and F16C). */
int hsg_isa_best(void);

/* y[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n]) for m < M, n < N; wp: W's packed copy (hsg_check(wp, N, K) == 0:
 * the callers check); x: M x K (row stride ldx), y: M x N (row stride ldy), bias: N floats or NULL.  isa: an
 * HSG_ISA_* not above hsg_isa_best() (every codec has AVX-512, AVX2 and portable tiles); threads: OpenMP threads
 * (<= 0: the runtime's current setting). */
void hsg_linear(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy, int64_t m,
                int64_t n, int64_t k, int isa, int threads);

/* Threads hsg_linear uses for threads <= 0 (1 in a build without OpenMP). */
int hsg_threads(void);

#endif
