/*
 * entropy.c -- HeteroSpec's difficulty signal and its bins.
 *
 * hs_topk_entropy is the per-step term of the paper's Eq. 1: the entropy of the draft distribution
 * renormalised over its k most likely tokens.  Summed along the most confident draft path it gives the
 * cumulative meta-path top-K entropy that hs_bucketize maps onto the 8 bins of the offline CART
 * (thresholds s_1 < ... < s_7; bin = number of thresholds the value exceeds, so B_0 is the easiest).
 */
#include "common.h"

size_t hs_topk_entropy_workspace_bytes(int64_t k, int64_t V) {
    /* k heap entries, then V floats for converting a float16/bfloat16 row to float32 */
    return (size_t)(k > 0 ? k : 1) * sizeof(hs_kv) + (size_t)(V > 0 ? V : 0) * sizeof(float);
}

hs_status hs_topk_entropy(const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
                          double temperature, float *out, void *ws, size_t ws_bytes, hs_error *err) {
    static const char op[] = "topk_entropy";
    if (!hs_is_logit_dtype(dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "logits", "expected float16, bfloat16 or float32, got %s",
                       hs_dtype_name(dtype));
    if (rows < 0 || V < 1)
        return hs_fail(err, HS_ERR_VALUE, op, "logits", "expected shape [N, V] with V >= 1, got [%lld, %lld]",
                       (long long)rows, (long long)V);
    if (k < 1 || k > V)
        return hs_fail(err, HS_ERR_VALUE, op, "k", "expected 1 <= k <= V = %lld, got %lld", (long long)V,
                       (long long)k);
    if (!(temperature >= HS_MIN_TEMPERATURE) || !isfinite(temperature))
        return hs_fail(err, HS_ERR_VALUE, op, "temperature", "expected a finite value >= 1e-30, got %g",
                       temperature);
    size_t need = hs_topk_entropy_workspace_bytes(k, V);
    if (ws_bytes < need)
        return hs_fail(err, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu", need,
                       ws_bytes);
    hs_kv *top = (hs_kv *)ws;
    float *conv = (float *)(top + k);
    for (int64_t r = 0; r < rows; r++) {
        const float *x = hs_row_f32(logits, dtype, r, V, conv);
        float m;
        hs_status st = hs_row_check_max(x, V, op, "logits", r, &m, err);
        if (st != HS_OK) return st;
        hs_topk_f32(x, V, k, top);
        out[r] = (float)hs_entropy_sorted(top, k, temperature);
    }
    return HS_OK;
}

hs_status hs_bucketize(const void *values, hs_dtype value_dtype, int64_t N, const void *thresholds,
                       hs_dtype threshold_dtype, int64_t T, int32_t *out, hs_error *err) {
    static const char op[] = "bucketize";
    if (!hs_is_real_dtype(value_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "values", "expected float32 or float64, got %s",
                       hs_dtype_name(value_dtype));
    if (!hs_is_real_dtype(threshold_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "thresholds", "expected float32 or float64, got %s",
                       hs_dtype_name(threshold_dtype));
    for (int64_t t = 0; t < T; t++) {
        double s = hs_load_real(thresholds, threshold_dtype, t);
        if (s != s)
            return hs_fail(err, HS_ERR_NONFINITE, op, "thresholds", "expected no NaN, got nan at [%lld]",
                           (long long)t);
        if (t > 0 && !(hs_load_real(thresholds, threshold_dtype, t - 1) < s))
            return hs_fail(err, HS_ERR_VALUE, op, "thresholds",
                           "expected strictly ascending values, got %g at [%lld] after %g at [%lld]", s,
                           (long long)t, hs_load_real(thresholds, threshold_dtype, t - 1),
                           (long long)(t - 1));
    }
    for (int64_t i = 0; i < N; i++) {
        double x = hs_load_real(values, value_dtype, i);
        if (x != x)
            return hs_fail(err, HS_ERR_NONFINITE, op, "values", "expected no NaN, got nan at [%lld]",
                           (long long)i);
        out[i] = (int32_t)hs_count_below(x, thresholds, threshold_dtype == HS_FLOAT64, T);
    }
    return HS_OK;
}
