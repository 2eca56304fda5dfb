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
 * Packed layout: panel p holds columns 16p..16p+15 as wp[p*16*K + k*16 + j] = W[16p+j][k]; the last panel is
 * padded with zeros (hsg_packed_floats gives the size).
 */
#ifndef HS_GEMM_ROWS_H
#define HS_GEMM_ROWS_H

#include <stdint.h>

#define HSG_PANEL 16

enum { HSG_ISA_PORTABLE = 0, HSG_ISA_AVX2 = 1, HSG_ISA_AVX512 = 2 };

/* Floats of the packed copy of an N x K weight. */
int64_t hsg_packed_floats(int64_t n, int64_t k);

/* Pack w (N x K, row stride ldw) into wp (hsg_packed_floats(N, K) floats). */
void hsg_pack(const float *w, int64_t ldw, float *wp, int64_t n, int64_t k);

/* The widest instruction set this CPU runs (HSG_ISA_*). */
int hsg_isa_best(void);

/* y[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n]) for m < M, n < N; x: M x K (row stride ldx), y: M x N (row
 * stride ldy), bias: N floats or NULL.  isa: an HSG_ISA_* not above hsg_isa_best(); threads: OpenMP threads
 * (<= 0: the runtime's current setting). */
void hsg_linear(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy, int64_t m,
                int64_t n, int64_t k, int isa, int threads);

/* Threads hsg_linear uses for threads <= 0 (1 in a build without OpenMP). */
int hsg_threads(void);

#endif
