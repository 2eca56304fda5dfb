/*
 * common.h -- helpers shared by the CPU core: dtype loads, error messages, a vectorisable exp, and the
 * top-k selection every op uses.  Internal: not part of the public API.
 */
#ifndef HS_CORE_COMMON_H
#define HS_CORE_COMMON_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "hs/heterospec.h"
#include "hd_math.h"

/* Hot vocabulary-wide loops get an AVX2 clone picked at load time (ifunc); the baseline stays SSE2 so one
 * wheel runs everywhere.  -std=c11 keeps -ffp-contract=off, so both clones round identically.  gcc only: clang 14
 * names a cloned function's symbols differently across files and then fails to link the resolvers (-fPIC), so a
 * clang build (the fuzzing build, setup.py's HETEROSPEC_SANITIZE=fuzz) runs the baseline loops. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(HS_NO_CLONES)
#define HS_HOT __attribute__((target_clones("avx2", "default")))
#else
#define HS_HOT
#endif

#if defined(__GNUC__)
#define HS_UNUSED __attribute__((unused))
#define HS_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define HS_UNUSED
#define HS_PRINTF(f, a)
#endif

/* Write "op: argument 'arg' <message>" into err (if any) and return status. */
hs_status hs_fail(hs_error *err, hs_status status, const char *op, const char *arg, const char *fmt,
                  ...) HS_PRINTF(5, 6);

/* verify_sample's sampling settings checked (verify.c): HS_OK, or the first bad one named in err.  The CPU core
 * and the CUDA path both call it, so their errors are the same. */
hs_status hs_check_sampling(const char *op, hs_sampling sp, hs_error *err);

/* ---- element loads ------------------------------------------------------------------------------- */

/* Element i of a logits buffer as float32. */
static inline float hs_load_logit(const void *p, hs_dtype t, int64_t i) {
    switch (t) {
    case HS_FLOAT16: return hs_half_to_float(((const uint16_t *)p)[i]);
    case HS_BFLOAT16: return hs_bf16_to_float(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline int64_t hs_load_id(const void *p, hs_dtype t, int64_t i) {
    return t == HS_INT32 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

static inline double hs_load_real(const void *p, hs_dtype t, int64_t i) {
    return t == HS_FLOAT64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

static inline int hs_is_logit_dtype(hs_dtype t) {
    return t == HS_FLOAT32 || t == HS_FLOAT16 || t == HS_BFLOAT16;
}
static inline int hs_is_id_dtype(hs_dtype t) { return t == HS_INT32 || t == HS_INT64; }
static inline int hs_is_real_dtype(hs_dtype t) { return t == HS_FLOAT32 || t == HS_FLOAT64; }

/* Convert a logits row to float32 in `dst` (a no-op copy for float32 rows). Returns dst or, for a
 * float32 row, the row itself. */
const float *hs_row_f32(const void *logits, hs_dtype t, int64_t row, int64_t V, float *dst);

/* Check a float32 row: no NaN, no +Inf, at least one value > -Inf.  On success *max_out is the row max
 * and HS_OK is returned; otherwise an error naming `arg` and the offending [row, col]. */
hs_status hs_row_check_max(const float *x, int64_t V, const char *op, const char *arg, int64_t row,
                           float *max_out, hs_error *err);

/* sum_v exp(x_v - m) in float64 with a vectorisable float32 exp (~1 ulp); x_v = -Inf contributes 0. */
double hs_sum_exp_shifted(const float *x, int64_t V, float m);

/* ---- top-k ---------------------------------------------------------------------------------------- */

typedef struct hs_kv {
    double v; /* float32 inputs are widened exactly, so the order is the same as in float32 */
    int64_t i;
} hs_kv;

/* The k largest (value desc, id asc) of x[0..V), written to out[0..k) in that order.  out must hold k
 * entries (the workspace of hs_topk_workspace_bytes). */
void hs_topk_f32(const float *x, int64_t V, int64_t k, hs_kv *out);
/* The same over float32/float64 values read with hs_load_real (no block skipping: for short arrays). */
void hs_topk_real(const void *x, hs_dtype t, int64_t V, int64_t k, hs_kv *out);

/* Sort by (value desc, id asc). */
void hs_sort_best_first(hs_kv *a, int64_t n);

/* Entropy in nats of softmax(v / temperature) over k sorted-descending values (v[0] is the max). */
double hs_entropy_sorted(const hs_kv *v, int64_t k, double temperature);

#endif /* HS_CORE_COMMON_H */
