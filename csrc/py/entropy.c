/*
 * entropy.c -- the binding of topk_entropy and bucketize (CPU core: csrc/core/entropy.c; kernels:
 * csrc/cuda/entropy.cu; NumPy twins: heterospec/reference/entropy.py; machinery: call.h).
 */
#include "call.h"

/* topk_entropy(logits [batch, N, V], k, temperature, alloc, stream, check, batched) -> float32 [batch, N] */
HS_FASTCALL(py_topk_entropy) {
    (void)self;
    static const char op[] = "topk_entropy";
    if (hs_nargs(op, nargs, 7) < 0) return NULL;
    PyObject *o_logits = args[0], *alloc = args[3], *o_stream = args[4], *out = NULL;
    int64_t k;
    double temp;
    int check;
    if (hs_parse_i64(args[1], op, "k", &k) < 0 || hs_parse_f64(args[2], op, "temperature", &temp) < 0 ||
        hs_parse_flag(args[5], op, "check", &check) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    hs_view *lg, *ov;
    if (!(lg = hs_views_first(&vs, o_logits, op, "logits", args[6], 3)) ||
        hs_check_array(lg, op, "logits", 3, "[batch, N, V]", HS_LOGIT_DTYPES, "float16, bfloat16 or float32") < 0)
        goto fail;
    const int64_t B = lg->shape[0], N = lg->shape[1], V = lg->shape[2], rows = B * N, shape[2] = {B, N};
    if (k < 1 || k > V) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'k' expected 1 <= k <= V = %lld, got %lld", op, (long long)V,
                     (long long)k);
        goto fail;
    }
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 2, shape, HS_FLOAT32, &ov))) goto fail;
    if (hs_gpu_begin(&g, lg, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        size_t wsb = hs_cuda_topk_entropy_workspace_bytes(rows, k, V);
        void *gws = hs_gpu_workspace(&g, wsb);
        if (gws == NULL) goto fail;
        HS_CALL(hs_cuda_topk_entropy(lg->data, (hs_dtype)lg->dtype, rows, V, k, temp, (float *)ov->data,
                                     (char *)gws + HS_WS_COUNTERS, wsb, g.err, g.stream, &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
    } else {
        size_t wsb = hs_topk_entropy_workspace_bytes(k, V);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_topk_entropy(lg->data, (hs_dtype)lg->dtype, rows, V, k, temp, (float *)ov->data, ws, wsb, &err));
    }
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    return out;
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    Py_XDECREF(out);
    return NULL;
}

/* bucketize(values [N], thresholds [T], alloc, stream, check) -> int32 [N] (element-wise: no batch dimension) */
HS_FASTCALL(py_bucketize) {
    (void)self;
    static const char op[] = "bucketize";
    if (hs_nargs(op, nargs, 5) < 0) return NULL;
    PyObject *o_vals = args[0], *o_thr = args[1], *alloc = args[2], *o_stream = args[3], *out = NULL;
    int check;
    if (hs_parse_flag(args[4], op, "check", &check) < 0) return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_view *va, *th, *ov;
    if (!(va = hs_views_add(&vs, o_vals, op, "values", 0)) ||
        hs_check_array(va, op, "values", 1, "[N]", HS_REAL_DTYPES, "float32 or float64") < 0 ||
        !(th = hs_views_add(&vs, o_thr, op, "thresholds", 0)) ||
        hs_check_array(th, op, "thresholds", 1, "[T]", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    int64_t N = va->shape[0];
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 1, &N, HS_INT32, &ov))) goto fail;
    if (hs_gpu_begin(&g, va, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        HS_CALL(hs_cuda_bucketize(va->data, (hs_dtype)va->dtype, N, th->data, (hs_dtype)th->dtype, th->shape[0],
                                  (int32_t *)ov->data, g.err, g.stream, &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
        hs_views_release(&vs);
        return out;
    }
    HS_CALL(hs_bucketize(va->data, (hs_dtype)va->dtype, N, th->data, (hs_dtype)th->dtype, th->shape[0],
                        (int32_t *)ov->data, &err));
    hs_views_release(&vs);
    return out;
fail:
    hs_gpu_end(&g, op, 0);
    hs_views_release(&vs);
    Py_XDECREF(out);
    return NULL;
}
