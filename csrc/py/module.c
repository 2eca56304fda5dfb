/*
 * module.c -- heterospec._C, the CPython binding of the C core.
 *
 * Each function here: parses scalars (TypeError naming the argument), imports every array argument
 * zero-copy (view.c), checks dtype, ndim, every shape relation and the device, asks the Python wrapper's
 * allocator for the outputs (so NumPy inputs give NumPy outputs and torch tensors give torch tensors:
 * the core never allocates framework memory), runs the core op with the GIL released, and maps a
 * failing status to TypeError/ValueError carrying the core's message.  Value-level checks (ranges,
 * orders, non-finite logits, tree shape) live in the core so that C callers get them too.
 */
#define PY_ARRAY_UNIQUE_SYMBOL HS_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "view.h"

#include <numpy/arrayobject.h>

#ifdef HS_WITH_CUDA
#include "hs/heterospec_cuda.h"
#endif

#define HS_MAX_VIEWS 16

static PyObject *hs_cuda_error_type; /* heterospec._C.CudaError (a RuntimeError) */

/* All views of one call, released together; `stream` is the consumer stream handed to DLPack producers. */
typedef struct {
    hs_view v[HS_MAX_VIEWS];
    const char *arg[HS_MAX_VIEWS];
    int n;
    PyObject *stream;
} hs_views;

static void hs_views_release(hs_views *vs) {
    for (int i = 0; i < vs->n; i++) hs_view_release(&vs->v[i]);
    vs->n = 0;
}

/* Import obj as the next view; the first view fixes the device every later one must share. */
static hs_view *hs_views_add(hs_views *vs, PyObject *obj, const char *op, const char *arg, int writable) {
    if (vs->n >= HS_MAX_VIEWS) {
        PyErr_Format(PyExc_SystemError, "%s: too many array arguments", op);
        return NULL;
    }
    hs_view *v = &vs->v[vs->n];
    if (hs_view_import(obj, op, arg, writable, vs->stream, v) < 0) return NULL;
    vs->arg[vs->n] = arg;
    vs->n++;
    if (hs_check_same_device(v, &vs->v[0], op, arg, vs->arg[0]) < 0) return NULL;
    return v;
}

/* Ask the wrapper's allocator for an output, then import it (writable) and check what came back. */
static PyObject *hs_views_alloc(hs_views *vs, PyObject *alloc, const char *op, const char *arg, int ndim,
                                const int64_t *shape, hs_dtype dtype, hs_view **out) {
    PyObject *shp = PyTuple_New(ndim);
    if (shp == NULL) return NULL;
    for (int i = 0; i < ndim; i++) PyTuple_SET_ITEM(shp, i, PyLong_FromLongLong((long long)shape[i]));
    PyObject *arr = PyObject_CallFunction(alloc, "Os", shp, hs_dtype_name(dtype));
    Py_DECREF(shp);
    if (arr == NULL) return NULL;
    hs_view *v = hs_views_add(vs, arr, op, arg, 1);
    if (v == NULL || hs_check_ndim(v, op, arg, ndim, "(allocator output)") < 0 ||
        hs_check_dtype(v, op, arg, HS_MASK(dtype), hs_dtype_name(dtype)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    for (int i = 0; i < ndim; i++) {
        if (hs_check_dim(v, op, arg, i, shape[i], "allocator output") < 0) {
            Py_DECREF(arr);
            return NULL;
        }
    }
    *out = v;
    return arr;
}

static int hs_parse_i64(PyObject *obj, const char *op, const char *arg, int64_t *out) {
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected an int, got %s", op, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (overflow) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an int64 value, got one out of range", op, arg);
        return -1;
    }
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)x;
    return 0;
}

static int hs_parse_u64(PyObject *obj, const char *op, const char *arg, uint64_t *out) {
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected an int, got %s", op, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(idx);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyObject *r = PyObject_Repr(idx);
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an int in [0, 2**64), got %s", op, arg,
                     r ? PyUnicode_AsUTF8(r) : "?");
        Py_XDECREF(r);
        Py_DECREF(idx);
        return -1;
    }
    Py_DECREF(idx);
    *out = (uint64_t)x;
    return 0;
}

static int hs_parse_f64(PyObject *obj, const char *op, const char *arg, double *out) {
    if (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj) || PyNumber_Check(obj))) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected a float, got %s", op, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    double x = PyFloat_AsDouble(obj);
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected a float, got %s", op, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = x;
    return 0;
}

/* Map a failing core status to a Python exception. */
static void hs_raise(hs_status st, const hs_error *err) {
    PyObject *type = st == HS_ERR_DTYPE       ? PyExc_TypeError
                     : st == HS_ERR_WORKSPACE ? PyExc_SystemError
                     : st == HS_ERR_CUDA      ? hs_cuda_error_type
                                              : PyExc_ValueError;
    PyErr_SetString(type, err->msg);
}

static void *hs_workspace(size_t bytes) {
    void *p = PyMem_RawMalloc(bytes ? bytes : 1);
    if (p == NULL) PyErr_NoMemory();
    return p;
}

/* Run a core call with the GIL released; on failure raise its message and jump to the caller's `fail`.
 * The call sees `err`, declared here. */
#define HS_CALL(call)                                                                                          \
    do {                                                                                                       \
        hs_error err;                                                                                          \
        hs_status st;                                                                                          \
        Py_BEGIN_ALLOW_THREADS st = (call);                                                                    \
        Py_END_ALLOW_THREADS                                                                                   \
        if (st != HS_OK) {                                                                                     \
            hs_raise(st, &err);                                                                                \
            goto fail;                                                                                         \
        }                                                                                                      \
    } while (0)

/* ---- the CUDA side of a call ---------------------------------------------------------------------------
 * A call whose first array lives on a CUDA device runs the kernels of csrc/cuda/ on that device, on
 * `stream` (a Python int cudaStream_t; None means the legacy default stream).  Device-side value errors land
 * in the device's error record; `check` synchronises the stream after the launch and raises them.  Ops
 * whose results must reach the host synchronise anyway.  Neither is allowed while the stream is capturing
 * a CUDA graph: there, pass check=False (and device_outputs=True) and call cuda_check() after replay. */
typedef struct {
    int on, dev, prev;
    void *stream;
    hs_view *ref;
#ifdef HS_WITH_CUDA
    hs_cuda_error *err, *err_host;
#endif
} hs_gpu;

static int hs_gpu_begin(hs_gpu *g, hs_view *ref, PyObject *o_stream, const char *op) {
    memset(g, 0, sizeof *g);
    g->ref = ref;
    g->on = ref->device_type == 2; /* DLPack kDLCUDA */
    if (!g->on) return 0;
#ifdef HS_WITH_CUDA
    if (o_stream != Py_None) {
        if (!PyLong_Check(o_stream)) {
            PyErr_Format(PyExc_TypeError, "%s: argument 'stream' expected an int (a cudaStream_t) or None, got %s", op,
                         Py_TYPE(o_stream)->tp_name);
            return -1;
        }
        g->stream = PyLong_AsVoidPtr(o_stream);
        if (g->stream == NULL && PyErr_Occurred()) return -1;
    }
    hs_error err;
    char why[160] = "";
    if (hs_cuda_device_count(why, sizeof why) <= ref->device_id) {
        PyErr_Format(hs_cuda_error_type, "%s: argument '%s' is on cuda:%d, but CUDA is not usable here: %s", op, "logits",
                     ref->device_id, why[0] ? why : "no such device");
        return -1;
    }
    g->dev = ref->device_id;
    if ((g->prev = hs_cuda_set_device(g->dev, &err)) < 0 || !(g->err = hs_cuda_error_record(g->dev, &g->err_host, &err))) {
        hs_raise(HS_ERR_CUDA, &err);
        return -1;
    }
    return 0;
#else
    (void)o_stream;
    PyErr_Format(PyExc_ValueError, "%s: this build of heterospec has no CUDA ops", op);
    return -1;
#endif
}

#ifdef HS_WITH_CUDA
/* Raise (and clear) a recorded device error; 0 if there was none. */
static int hs_gpu_raise_recorded(hs_gpu *g, const char *op) {
    if (g->err_host->code == 0) return 0;
    char msg[384];
    hs_cuda_error_message(g->err_host, op, msg, sizeof msg);
    hs_error err;
    hs_status st;
    Py_BEGIN_ALLOW_THREADS st = hs_cuda_error_clear(g->dev, g->stream, &err);
    Py_END_ALLOW_THREADS
    if (st != HS_OK) {
        hs_raise(st, &err);
        return -1;
    }
    PyErr_SetString(PyExc_ValueError, msg);
    return -1;
}

/* Synchronise the call's stream (refused during graph capture) and raise any recorded device error. */
static int hs_gpu_sync(hs_gpu *g, const char *op, const char *why) {
    hs_error err;
    int cap = hs_cuda_stream_capturing(g->stream, &err);
    if (cap < 0) {
        hs_raise(HS_ERR_CUDA, &err);
        return -1;
    }
    if (cap) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected False while the stream is capturing a CUDA graph "
                     "(it needs a host synchronisation), got True", op, why);
        return -1;
    }
    hs_status st;
    Py_BEGIN_ALLOW_THREADS st = hs_cuda_error_fetch(g->dev, g->stream, &err); /* copies the record, syncs */
    Py_END_ALLOW_THREADS
    if (st != HS_OK) {
        hs_raise(st, &err);
        return -1;
    }
    return hs_gpu_raise_recorded(g, op);
}
#endif

/* End of a call: restore the caller's device; with `check`, synchronise and raise device errors. */
static int hs_gpu_end(hs_gpu *g, const char *op, int check) {
    if (!g->on) return 0;
    int rc = 0;
#ifdef HS_WITH_CUDA
    if (check) rc = hs_gpu_sync(g, op, "check");
    hs_error err;
    if (g->prev >= 0 && g->prev != g->dev) hs_cuda_set_device(g->prev, &err);
#else
    (void)op;
    (void)check;
#endif
    g->on = 0;
    return rc;
}

#ifdef HS_WITH_CUDA
#define HS_WS_COUNTERS 65536 /* the start of the module workspace holds expand's per-request counters */
static void *hs_gpu_workspace(hs_gpu *g, size_t bytes) {
    hs_error err;
    void *ws = hs_cuda_workspace(g->dev, HS_WS_COUNTERS + bytes, g->stream, &err);
    if (ws == NULL) hs_raise(HS_ERR_VALUE, &err);
    return ws;
}
/* Read n int64 results from the device (synchronises the stream first). */
static int hs_gpu_read(hs_gpu *g, const char *op, const char *why, const int64_t *dev, int64_t *host, int n) {
    if (hs_gpu_sync(g, op, why) < 0) return -1;
    hs_error err;
    if (hs_cuda_memcpy_d2h(host, dev, (size_t)n * sizeof(int64_t), g->stream, &err) != HS_OK) {
        hs_raise(HS_ERR_CUDA, &err);
        return -1;
    }
    return 0;
}
#endif

static int hs_parse_flag(PyObject *obj, const char *op, const char *arg, int *out) {
    if (!PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected a bool, got %s", op, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = obj == Py_True;
    return 0;
}

/* ---- topk_entropy(logits, k, temperature, alloc) -> out ------------------------------------------- */

static PyObject *py_topk_entropy(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "topk_entropy";
    PyObject *o_logits, *o_k, *o_temp, *alloc, *o_stream, *o_check, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOO", &o_logits, &o_k, &o_temp, &alloc, &o_stream, &o_check)) return NULL;
    int64_t k;
    double temp;
    int check;
    if (hs_parse_i64(o_k, op, "k", &k) < 0 || hs_parse_f64(o_temp, op, "temperature", &temp) < 0 ||
        hs_parse_flag(o_check, op, "check", &check) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    hs_view *lg, *ov;
    if (!(lg = hs_views_add(&vs, o_logits, op, "logits", 0)) || hs_check_ndim(lg, op, "logits", 2, "[N, V]") < 0 ||
        hs_check_dtype(lg, op, "logits", HS_LOGIT_DTYPES, "float16, bfloat16 or float32") < 0)
        goto fail;
    int64_t N = lg->shape[0], V = lg->shape[1];
    if (k < 1 || k > V) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'k' expected 1 <= k <= V = %lld, got %lld", op, (long long)V,
                     (long long)k);
        goto fail;
    }
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 1, &N, HS_FLOAT32, &ov))) goto fail;
    if (hs_gpu_begin(&g, lg, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        size_t wsb = hs_cuda_topk_entropy_workspace_bytes(N, k, V);
        void *gws = hs_gpu_workspace(&g, wsb);
        if (gws == NULL) goto fail;
        HS_CALL(hs_cuda_topk_entropy(lg->data, (hs_dtype)lg->dtype, N, V, k, temp, (float *)ov->data,
                                     (char *)gws + HS_WS_COUNTERS, wsb, g.err, g.stream, &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
    } else {
        size_t wsb = hs_topk_entropy_workspace_bytes(k, V);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_topk_entropy(lg->data, (hs_dtype)lg->dtype, N, V, k, temp, (float *)ov->data, ws, wsb, &err));
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

/* ---- expand(logits, beam_scores, beam_nodes, k, d2t, node_offset, alloc) -------------------------- */

static PyObject *py_expand(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "expand";
    PyObject *o_logits, *o_scores, *o_nodes, *o_k, *o_d2t, *o_off, *alloc, *o_stream, *o_check;
    PyObject *outs[5] = {NULL, NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &o_logits, &o_scores, &o_nodes, &o_k, &o_d2t, &o_off, &alloc, &o_stream,
                          &o_check))
        return NULL;
    int64_t k, off;
    int check;
    if (hs_parse_i64(o_k, op, "k", &k) < 0 || hs_parse_i64(o_off, op, "node_offset", &off) < 0 ||
        hs_parse_flag(o_check, op, "check", &check) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    hs_view *lg, *sc, *nd, *d2t = NULL, *ot, *os, *op_, *oe, *ob;
    if (!(lg = hs_views_add(&vs, o_logits, op, "logits", 0))) goto fail;
    /* batched (the C ABI's batch-first form): logits [batch, B, Vd], beams [batch, B], outputs [batch, ...] */
    const int bt = lg->ndim == 3;
    if (hs_check_ndim(lg, op, "logits", bt ? 3 : 2, bt ? "[batch, B, Vd]" : "[B, Vd]") < 0 ||
        hs_check_dtype(lg, op, "logits", HS_LOGIT_DTYPES, "float16, bfloat16 or float32") < 0)
        goto fail;
    int64_t nb = bt ? lg->shape[0] : 1, B = lg->shape[bt], Vd = lg->shape[bt + 1];
    if (!(sc = hs_views_add(&vs, o_scores, op, "beam_scores", 0)) ||
        hs_check_ndim(sc, op, "beam_scores", 1 + bt, bt ? "[batch, B]" : "[B]") < 0 ||
        hs_check_dtype(sc, op, "beam_scores", HS_REAL_DTYPES, "float32 or float64") < 0 ||
        (bt && hs_check_dim(sc, op, "beam_scores", 0, nb, "one row of beams per batch row") < 0) ||
        hs_check_dim(sc, op, "beam_scores", bt, B, "one score per logits row") < 0)
        goto fail;
    if (!(nd = hs_views_add(&vs, o_nodes, op, "beam_nodes", 0)) ||
        hs_check_ndim(nd, op, "beam_nodes", 1 + bt, bt ? "[batch, B]" : "[B]") < 0 ||
        hs_check_dtype(nd, op, "beam_nodes", HS_ID_DTYPES, "int32 or int64") < 0 ||
        (bt && hs_check_dim(nd, op, "beam_nodes", 0, nb, "one row of beams per batch row") < 0) ||
        hs_check_dim(nd, op, "beam_nodes", bt, B, "one node per logits row") < 0)
        goto fail;
    if (o_d2t != Py_None) {
        if (!(d2t = hs_views_add(&vs, o_d2t, op, "d2t", 0)) || hs_check_ndim(d2t, op, "d2t", 1, "[Vd]") < 0 ||
            hs_check_dtype(d2t, op, "d2t", HS_ID_DTYPES, "int32 or int64") < 0 ||
            hs_check_dim(d2t, op, "d2t", 0, Vd, "one offset per draft-vocabulary id") < 0)
            goto fail;
    }
    if (B < 1 || Vd < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'logits' expected B >= 1 and Vd >= 1, got shape (%lld, %lld)", op,
                     (long long)B, (long long)Vd);
        goto fail;
    }
    if (k < 1 || k > Vd) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'k' expected 1 <= k <= Vd = %lld, got %lld", op, (long long)Vd,
                     (long long)k);
        goto fail;
    }
    int64_t sBk[2] = {nb, B * k}, sB[2] = {nb, B}, sk[2] = {nb, k};
    const int od = 1 + bt, o0 = bt ? 0 : 1; /* unbatched outputs drop the batch dimension */
    if (!(outs[0] = hs_views_alloc(&vs, alloc, op, "tokens", od, sBk + o0, HS_INT64, &ot)) ||
        !(outs[1] = hs_views_alloc(&vs, alloc, op, "scores", od, sBk + o0, HS_FLOAT32, &os)) ||
        !(outs[2] = hs_views_alloc(&vs, alloc, op, "parents", od, sBk + o0, HS_INT64, &op_)) ||
        !(outs[3] = hs_views_alloc(&vs, alloc, op, "entropy", od, sB + o0, HS_FLOAT32, &oe)) ||
        !(outs[4] = hs_views_alloc(&vs, alloc, op, "next_beams", od, sk + o0, HS_INT64, &ob)))
        goto fail;
    if (hs_gpu_begin(&g, lg, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        /* expand's counters live in the workspace's first HS_WS_COUNTERS bytes (zero between calls), its split
         * path's partials after them; more than HS_WS_COUNTERS / 4 requests is refused by the op (workspace) */
        size_t need = hs_cuda_expand_workspace_bytes(nb, B, k, Vd), extra = need > HS_WS_COUNTERS ? need - HS_WS_COUNTERS : 0;
        size_t wsb = (size_t)nb * sizeof(unsigned) <= HS_WS_COUNTERS ? HS_WS_COUNTERS + extra : HS_WS_COUNTERS;
        void *gws = hs_gpu_workspace(&g, extra);
        if (gws == NULL) goto fail;
        if (nb > 0)
        HS_CALL(hs_cuda_expand(lg->data, (hs_dtype)lg->dtype, nb, B, Vd, sc->data, (hs_dtype)sc->dtype, nd->data,
                               (hs_dtype)nd->dtype, k, d2t ? d2t->data : NULL, d2t ? (hs_dtype)d2t->dtype : HS_INT64, off,
                               (int64_t *)ot->data, (float *)os->data, (int64_t *)op_->data, (float *)oe->data,
                               (int64_t *)ob->data, gws, wsb, g.err, g.stream, &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
        hs_views_release(&vs);
        return Py_BuildValue("(NNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4]);
    }
    size_t wsb = hs_expand_workspace_bytes(B, k, Vd);
    if (!(ws = hs_workspace(wsb))) goto fail;
    HS_CALL(hs_expand(lg->data, (hs_dtype)lg->dtype, nb, B, Vd, sc->data, (hs_dtype)sc->dtype, nd->data,
                     (hs_dtype)nd->dtype, k, d2t ? d2t->data : NULL, d2t ? (hs_dtype)d2t->dtype : HS_INT64, off,
                     (int64_t *)ot->data, (float *)os->data, (int64_t *)op_->data, (float *)oe->data,
                     (int64_t *)ob->data, ws, wsb, &err));
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    return Py_BuildValue("(NNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4]);
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    for (int i = 0; i < 5; i++) Py_XDECREF(outs[i]);
    return NULL;
}

/* ---- select(scores, n, alloc) -> out --------------------------------------------------------------- */

static PyObject *py_select(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "select";
    PyObject *o_scores, *o_n, *alloc, *o_stream, *o_check, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOOOO", &o_scores, &o_n, &alloc, &o_stream, &o_check)) return NULL;
    int64_t n;
    int check;
    if (hs_parse_i64(o_n, op, "n", &n) < 0 || hs_parse_flag(o_check, op, "check", &check) < 0) return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    int64_t *nh = NULL;
    hs_view *sc, *ov;
    if (!(sc = hs_views_add(&vs, o_scores, op, "scores", 0))) goto fail;
    /* batched: scores [batch, M], the same n for every row, out [batch, n] */
    const int bt = sc->ndim == 2;
    if (hs_check_ndim(sc, op, "scores", 1 + bt, bt ? "[batch, M]" : "[M]") < 0 ||
        hs_check_dtype(sc, op, "scores", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    int64_t nb = bt ? sc->shape[0] : 1, M = sc->shape[bt];
    if (n < 0 || n > M) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected 0 <= n <= M = %lld, got %lld", op, (long long)M,
                     (long long)n);
        goto fail;
    }
    int64_t shp[2] = {nb, n};
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 1 + bt, shp + (bt ? 0 : 1), HS_INT64, &ov))) goto fail;
    if (hs_gpu_begin(&g, sc, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        if (nb > 0)
            HS_CALL(hs_cuda_select(sc->data, (hs_dtype)sc->dtype, nb, M, NULL, NULL, n, (int64_t *)ov->data, g.err,
                                   g.stream, &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
        hs_views_release(&vs);
        return out;
    }
    size_t wsb = hs_select_workspace_bytes(M);
    if (!(ws = hs_workspace(wsb))) goto fail;
    if (!(nh = PyMem_Malloc((size_t)(nb > 0 ? nb : 1) * sizeof(int64_t)))) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int64_t b = 0; b < nb; b++) nh[b] = n;
    HS_CALL(hs_select(sc->data, (hs_dtype)sc->dtype, nb, M, NULL, nh, n, (int64_t *)ov->data, ws, wsb, &err));
    PyMem_RawFree(ws);
    PyMem_Free(nh);
    hs_views_release(&vs);
    return out;
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    PyMem_Free(nh);
    hs_views_release(&vs);
    Py_XDECREF(out);
    return NULL;
}

/* select with per-row sizes: scores [batch, M]; n an int or int64 [batch], m None (M) or int64 [batch] (row b
 * looks at its first m[b] scores), both on the scores' device; out [batch, width], row b's first n[b] entries
 * the ascending indices, the rest -1. */
static PyObject *py_select_batch(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "select";
    PyObject *o_scores, *o_n, *o_m, *o_width, *alloc, *o_stream, *o_check, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &o_scores, &o_n, &o_m, &o_width, &alloc, &o_stream, &o_check)) return NULL;
    int check;
    int64_t width, nval = 0;
    if (hs_parse_i64(o_width, op, "width", &width) < 0 || hs_parse_flag(o_check, op, "check", &check) < 0) return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    int64_t *host = NULL;
    hs_view *sc, *nv = NULL, *mv = NULL, *ov;
    if (!(sc = hs_views_add(&vs, o_scores, op, "scores", 0)) || hs_check_ndim(sc, op, "scores", 2, "[batch, M]") < 0 ||
        hs_check_dtype(sc, op, "scores", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    const int64_t B = sc->shape[0], M = sc->shape[1];
    if (width < 0 || width > M) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'width' expected 0 <= width <= M = %lld, got %lld", op, (long long)M,
                     (long long)width);
        goto fail;
    }
    if (PyLong_Check(o_n) || PyArray_IsScalar(o_n, Integer)) {
        if (hs_parse_i64(o_n, op, "n", &nval) < 0) goto fail;
        if (nval < 0 || nval > M) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected 0 <= n <= M = %lld, got %lld", op, (long long)M,
                         (long long)nval);
            goto fail;
        }
    } else if (!(nv = hs_views_add(&vs, o_n, op, "n", 0)) || hs_check_ndim(nv, op, "n", 1, "[batch] (or an int)") < 0 ||
               hs_check_dtype(nv, op, "n", HS_MASK(HS_INT64), "int64") < 0 ||
               hs_check_dim(nv, op, "n", 0, B, "one count per batch row") < 0) {
        goto fail;
    }
    if (o_m != Py_None && (!(mv = hs_views_add(&vs, o_m, op, "m", 0)) || hs_check_ndim(mv, op, "m", 1, "[batch]") < 0 ||
                           hs_check_dtype(mv, op, "m", HS_MASK(HS_INT64), "int64") < 0 ||
                           hs_check_dim(mv, op, "m", 0, B, "one candidate count per batch row") < 0))
        goto fail;
    if (nv == NULL && nval != width) { /* the kernel reads "no per-row n" as n = width */
        PyErr_Format(PyExc_ValueError, "%s: argument 'width' expected n = %lld for an int n (per-row counts as an int64 "
                     "[batch] array allow a wider output), got %lld", op, (long long)nval, (long long)width);
        goto fail;
    }
    int64_t shp[2] = {B, width};
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 2, shp, HS_INT64, &ov))) goto fail;
    if (hs_gpu_begin(&g, sc, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        if (B > 0)
            HS_CALL(hs_cuda_select(sc->data, (hs_dtype)sc->dtype, B, M, mv ? (const int64_t *)mv->data : NULL,
                                   nv ? (const int64_t *)nv->data : NULL, width, (int64_t *)ov->data, g.err, g.stream,
                                   &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
        hs_views_release(&vs);
        return out;
    }
    if (B > 0) {
        if (!(host = PyMem_Malloc((size_t)B * 2 * sizeof(int64_t)))) {
            PyErr_NoMemory();
            goto fail;
        }
        int64_t *nh = host, *mh = host + B;
        for (int64_t b = 0; b < B; b++) {
            nh[b] = nv ? ((const int64_t *)nv->data)[b] : nval;
            mh[b] = mv ? ((const int64_t *)mv->data)[b] : M;
            if (mh[b] < 0 || mh[b] > M) {
                PyErr_Format(PyExc_ValueError, "%s: argument 'm' expected candidate counts in [0, %lld], got %lld", op,
                             (long long)M, (long long)mh[b]);
                goto fail;
            }
            if (nh[b] < 0 || nh[b] > mh[b] || nh[b] > width) {
                PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected 0 <= n[b] <= min(m[b], width) = %lld, got %lld at row %lld",
                             op, (long long)(mh[b] < width ? mh[b] : width), (long long)nh[b], (long long)b);
                goto fail;
            }
        }
        size_t wsb = hs_select_workspace_bytes(M);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_select(sc->data, (hs_dtype)sc->dtype, B, M, mh, nh, width, (int64_t *)ov->data, ws, wsb, &err));
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = nh[b]; i < width; i++) ((int64_t *)ov->data)[b * width + i] = -1;
    }
    PyMem_RawFree(ws);
    PyMem_Free(host);
    hs_views_release(&vs);
    return out;
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    PyMem_Free(host);
    hs_views_release(&vs);
    Py_XDECREF(out);
    return NULL;
}

/* ---- build_tree(tokens, parents, selected, root_token, alloc) -> 5 arrays -------------------------- */

static PyObject *py_build_tree(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "build_tree";
    PyObject *o_tok, *o_par, *o_sel, *o_root, *alloc, *o_stream, *o_check, *o_devout;
    PyObject *outs[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &o_tok, &o_par, &o_sel, &o_root, &alloc, &o_stream, &o_check, &o_devout))
        return NULL;
    int64_t root;
    int check, devout;
    if (hs_parse_i64(o_root, op, "root_token", &root) < 0 || hs_parse_flag(o_check, op, "check", &check) < 0 ||
        hs_parse_flag(o_devout, op, "device_outputs", &devout) < 0)
        return NULL;
    if (root < 0) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'root_token' expected a token id >= 0, got %lld", op, (long long)root);
        return NULL;
    }
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_view *onl, *omd;
    void *ws = NULL;
    hs_view *tk, *pa, *se, *ot, *opa, *od, *om, *orr;
    if (!(tk = hs_views_add(&vs, o_tok, op, "tokens", 0)) || hs_check_ndim(tk, op, "tokens", 1, "[M]") < 0 ||
        hs_check_dtype(tk, op, "tokens", HS_ID_DTYPES, "int32 or int64") < 0)
        goto fail;
    int64_t M = tk->shape[0];
    if (!(pa = hs_views_add(&vs, o_par, op, "parents", 0)) || hs_check_ndim(pa, op, "parents", 1, "[M]") < 0 ||
        hs_check_dtype(pa, op, "parents", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dim(pa, op, "parents", 0, M, "one parent per candidate token") < 0)
        goto fail;
    if (!(se = hs_views_add(&vs, o_sel, op, "selected", 0)) || hs_check_ndim(se, op, "selected", 1, "[n]") < 0 ||
        hs_check_dtype(se, op, "selected", HS_ID_DTYPES, "int32 or int64") < 0)
        goto fail;
    int64_t n = se->shape[0], T = n + 1, TT[2] = {n + 1, n + 1};
    if (n > M) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'selected' expected at most M = %lld entries, got %lld", op,
                     (long long)M, (long long)n);
        goto fail;
    }
    if (!(outs[0] = hs_views_alloc(&vs, alloc, op, "tokens", 1, &T, HS_INT64, &ot)) ||
        !(outs[1] = hs_views_alloc(&vs, alloc, op, "parents", 1, &T, HS_INT64, &opa)) ||
        !(outs[2] = hs_views_alloc(&vs, alloc, op, "depths", 1, &T, HS_INT64, &od)) ||
        !(outs[3] = hs_views_alloc(&vs, alloc, op, "mask", 2, TT, HS_BOOL, &om)))
        goto fail;
    if (hs_gpu_begin(&g, tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        /* the retrieve rows at full size [n+1, n+1], and leaves / depth on the device */
        int64_t one = 1;
        if (!(outs[4] = hs_views_alloc(&vs, alloc, op, "retrieve", 2, TT, HS_INT64, &orr)) ||
            !(outs[5] = hs_views_alloc(&vs, alloc, op, "num_leaves", 0, &one, HS_INT64, &onl)) ||
            !(outs[6] = hs_views_alloc(&vs, alloc, op, "max_depth", 0, &one, HS_INT64, &omd)))
            goto fail;
        HS_CALL(hs_cuda_build_tree(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, M, se->data,
                                   (hs_dtype)se->dtype, n, NULL, NULL, root, (int64_t *)ot->data, (int64_t *)opa->data,
                                   (int64_t *)od->data, (uint8_t *)om->data, (int64_t *)onl->data, (int64_t *)omd->data,
                                   (int64_t *)orr->data, g.err, g.stream, &err));
        if (devout) {
            if (hs_gpu_end(&g, op, check) < 0) goto fail;
            hs_views_release(&vs);
            return Py_BuildValue("(NNNNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], outs[6]);
        }
        int64_t ld[2];
        if (hs_gpu_read(&g, op, "device_outputs", (int64_t *)onl->data, &ld[0], 1) < 0 ||
            hs_gpu_read(&g, op, "device_outputs", (int64_t *)omd->data, &ld[1], 1) < 0)
            goto fail;
        hs_gpu_end(&g, op, 0);
        hs_views_release(&vs);
        /* retrieve[:leaves, :depth + 1]: a view of the padded rows */
        PyObject *sl = Py_BuildValue("(NN)", PySlice_New(NULL, PyLong_FromLongLong(ld[0]), NULL),
                                     PySlice_New(NULL, PyLong_FromLongLong(ld[1] + 1), NULL));
        PyObject *ret = sl ? PyObject_GetItem(outs[4], sl) : NULL;
        Py_XDECREF(sl);
        Py_DECREF(outs[4]);
        Py_DECREF(outs[5]);
        Py_DECREF(outs[6]);
        if (ret == NULL) {
            for (int i = 0; i < 4; i++) Py_DECREF(outs[i]);
            return NULL;
        }
        return Py_BuildValue("(NNNNN)", outs[0], outs[1], outs[2], outs[3], ret);
#endif
    }
    size_t wsb = hs_build_tree_workspace_bytes(M), wsr = hs_tree_retrieve_workspace_bytes(T);
    if (!(ws = hs_workspace(wsb > wsr ? wsb : wsr))) goto fail;
    int64_t leaves = 0, depth = 0;
    HS_CALL(hs_build_tree(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, M, se->data, (hs_dtype)se->dtype, n, &n, &root,
                         (int64_t *)ot->data, (int64_t *)opa->data, (int64_t *)od->data, (uint8_t *)om->data,
                         &leaves, &depth, ws, wsb, &err));
    int64_t LD[2] = {devout ? T : leaves, devout ? T : depth + 1};
    if (!(outs[4] = hs_views_alloc(&vs, alloc, op, "retrieve", 2, LD, HS_INT64, &orr))) goto fail;
    HS_CALL(hs_tree_retrieve((int64_t *)opa->data, (int64_t *)od->data, 1, T, &T, LD[0], LD[1], (int64_t *)orr->data,
                            ws, wsr, &err));
    PyMem_RawFree(ws);
    ws = NULL;
    if (devout) {
        int64_t one = 1;
        if (!(outs[5] = hs_views_alloc(&vs, alloc, op, "num_leaves", 0, &one, HS_INT64, &onl)) ||
            !(outs[6] = hs_views_alloc(&vs, alloc, op, "max_depth", 0, &one, HS_INT64, &omd)))
            goto fail;
        *(int64_t *)onl->data = leaves;
        *(int64_t *)omd->data = depth;
        hs_views_release(&vs);
        return Py_BuildValue("(NNNNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], outs[6]);
    }
    hs_views_release(&vs);
    return Py_BuildValue("(NNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4]);
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    for (int i = 0; i < 7; i++) Py_XDECREF(outs[i]);
    return NULL;
}

/* build_tree over a batch: tokens, parents [batch, M]; selected [batch, N] with n[b] <= N valid entries (n: None
 * for N in every row, or int64 [batch] on the inputs' device); root_token an int or an int64 [batch] array there.
 * -> (tokens, parents, depths [batch, N+1], mask [batch, N+1, N+1], retrieve [batch, N+1, N+1], num_leaves,
 * max_depth [batch]); row b's first n[b]+1 nodes are the unbatched call's, the rest -1 (mask False), and its
 * retrieve rows are padded with -1 as with device_outputs. */
static PyObject *hs_batch_result(PyObject **outs, int k);

static PyObject *py_build_tree_batch(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "build_tree";
    PyObject *o_tok, *o_par, *o_sel, *o_root, *o_n, *alloc, *o_stream, *o_check, *res = NULL;
    PyObject *outs[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &o_tok, &o_par, &o_sel, &o_root, &o_n, &alloc, &o_stream, &o_check))
        return NULL;
    int check;
    if (hs_parse_flag(o_check, op, "check", &check) < 0) return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    int64_t *host = NULL, root = 0;
    hs_view *tk, *pa, *se, *rv = NULL, *nv = NULL, *ov[7];
    if (!(tk = hs_views_add(&vs, o_tok, op, "tokens", 0)) || hs_check_ndim(tk, op, "tokens", 2, "[batch, M]") < 0 ||
        hs_check_dtype(tk, op, "tokens", HS_ID_DTYPES, "int32 or int64") < 0)
        goto fail;
    const int64_t B = tk->shape[0], M = tk->shape[1];
    if (!(pa = hs_views_add(&vs, o_par, op, "parents", 0)) || hs_check_ndim(pa, op, "parents", 2, "[batch, M]") < 0 ||
        hs_check_dtype(pa, op, "parents", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dim(pa, op, "parents", 0, B, "one row per batch row") < 0 ||
        hs_check_dim(pa, op, "parents", 1, M, "one parent per candidate token") < 0)
        goto fail;
    if (!(se = hs_views_add(&vs, o_sel, op, "selected", 0)) || hs_check_ndim(se, op, "selected", 2, "[batch, N]") < 0 ||
        hs_check_dtype(se, op, "selected", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dim(se, op, "selected", 0, B, "one row per batch row") < 0)
        goto fail;
    const int64_t N = se->shape[1], T = N + 1;
    if (N > M) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'selected' expected at most M = %lld entries per row, got %lld", op,
                     (long long)M, (long long)N);
        goto fail;
    }
    if (PyLong_Check(o_root) || PyArray_IsScalar(o_root, Integer)) {
        if (hs_parse_i64(o_root, op, "root_token", &root) < 0) goto fail;
        if (root < 0) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'root_token' expected a token id >= 0, got %lld", op, (long long)root);
            goto fail;
        }
    } else if (!(rv = hs_views_add(&vs, o_root, op, "root_token", 0)) ||
               hs_check_ndim(rv, op, "root_token", 1, "[batch] (or an int)") < 0 ||
               hs_check_dtype(rv, op, "root_token", HS_MASK(HS_INT64), "int64") < 0 ||
               hs_check_dim(rv, op, "root_token", 0, B, "one root token per batch row") < 0) {
        goto fail;
    }
    if (o_n != Py_None && (!(nv = hs_views_add(&vs, o_n, op, "n", 0)) || hs_check_ndim(nv, op, "n", 1, "[batch]") < 0 ||
                           hs_check_dtype(nv, op, "n", HS_MASK(HS_INT64), "int64") < 0 ||
                           hs_check_dim(nv, op, "n", 0, B, "one selection size per batch row") < 0))
        goto fail;
    {
        static const char *names[7] = {"tokens", "parents", "depths", "mask", "retrieve", "num_leaves", "max_depth"};
        int64_t shp[3] = {B, T, T};
        for (int i = 0; i < 7; i++) {
            const int nd = i < 3 ? 2 : i < 5 ? 3 : 1;
            if (!(outs[i] = hs_views_alloc(&vs, alloc, op, names[i], nd, shp, i == 3 ? HS_BOOL : HS_INT64, &ov[i])))
                goto fail;
        }
    }
    if (hs_gpu_begin(&g, tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        if (B > 0)
            HS_CALL(hs_cuda_build_tree(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, M, se->data,
                                       (hs_dtype)se->dtype, N, nv ? (const int64_t *)nv->data : NULL,
                                       rv ? (const int64_t *)rv->data : NULL, root, (int64_t *)ov[0]->data,
                                       (int64_t *)ov[1]->data, (int64_t *)ov[2]->data, (uint8_t *)ov[3]->data,
                                       (int64_t *)ov[5]->data, (int64_t *)ov[6]->data, (int64_t *)ov[4]->data, g.err,
                                       g.stream, &err));
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
#endif
    } else if (B > 0) {
        /* host copies: selection sizes, node counts (n + 1) and roots */
        if (!(host = PyMem_Malloc((size_t)B * 3 * sizeof(int64_t)))) {
            PyErr_NoMemory();
            goto fail;
        }
        int64_t *nh = host, *th = host + B, *rh = host + 2 * B;
        for (int64_t b = 0; b < B; b++) {
            nh[b] = nv ? ((const int64_t *)nv->data)[b] : N;
            if (nh[b] < 0 || nh[b] > N) {
                PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected selection sizes in [0, %lld], got %lld", op,
                             (long long)N, (long long)nh[b]);
                goto fail;
            }
            th[b] = nh[b] + 1;
            rh[b] = rv ? ((const int64_t *)rv->data)[b] : root;
        }
        size_t wsb = hs_build_tree_workspace_bytes(M), wsr = hs_tree_retrieve_workspace_bytes(T);
        if (!(ws = hs_workspace(wsb > wsr ? wsb : wsr))) goto fail;
        HS_CALL(hs_build_tree(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, M, se->data,
                             (hs_dtype)se->dtype, N, nh, rh, (int64_t *)ov[0]->data, (int64_t *)ov[1]->data,
                             (int64_t *)ov[2]->data, (uint8_t *)ov[3]->data, (int64_t *)ov[5]->data,
                             (int64_t *)ov[6]->data, ws, wsb, &err));
        for (int64_t b = 0; b < B; b++) { /* rows past each tree, as the kernel pads them */
            for (int64_t i = th[b]; i < T; i++)
                for (int k = 0; k < 3; k++) ((int64_t *)ov[k]->data)[b * T + i] = -1;
            memset((uint8_t *)ov[3]->data + (b * T + th[b]) * T, 0, (size_t)((T - th[b]) * T));
        }
        HS_CALL(hs_tree_retrieve((int64_t *)ov[1]->data, (int64_t *)ov[2]->data, B, T, th, T, T, (int64_t *)ov[4]->data,
                                ws, wsr, &err));
    }
    res = hs_batch_result(outs, 7);
fail:
    hs_gpu_end(&g, op, 0);
    hs_views_release(&vs);
    PyMem_Free(host);
    PyMem_RawFree(ws);
    for (int i = 0; i < 7; i++) Py_XDECREF(outs[i]);
    return res;
}

/* ---- verification ---------------------------------------------------------------------------------- */

/* Shared argument handling of verify_greedy / verify_sample: imports and checks the tree and logits. */
static int hs_verify_args(hs_views *vs, const char *op, PyObject *o_tok, PyObject *o_par, PyObject *o_lg,
                          hs_view **tk, hs_view **pa, hs_view **lg) {
    if (!(*tk = hs_views_add(vs, o_tok, op, "tree_tokens", 0)) || hs_check_ndim(*tk, op, "tree_tokens", 1, "[n]") < 0 ||
        hs_check_dtype(*tk, op, "tree_tokens", HS_ID_DTYPES, "int32 or int64") < 0)
        return -1;
    int64_t n = (*tk)->shape[0];
    if (!(*pa = hs_views_add(vs, o_par, op, "tree_parents", 0)) ||
        hs_check_ndim(*pa, op, "tree_parents", 1, "[n]") < 0 ||
        hs_check_dtype(*pa, op, "tree_parents", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dim(*pa, op, "tree_parents", 0, n, "one parent per tree node") < 0)
        return -1;
    if (!(*lg = hs_views_add(vs, o_lg, op, "target_logits", 0)) ||
        hs_check_ndim(*lg, op, "target_logits", 2, "[n, V]") < 0 ||
        hs_check_dtype(*lg, op, "target_logits", HS_LOGIT_DTYPES, "float16, bfloat16 or float32") < 0 ||
        hs_check_dim(*lg, op, "target_logits", 0, n, "one logits row per tree node") < 0)
        return -1;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'tree_tokens' expected at least the root node, got 0 nodes", op);
        return -1;
    }
    if ((*lg)->shape[1] < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'target_logits' expected V >= 1, got 0", op);
        return -1;
    }
    return 0;
}


/* The results of a verify call.  Host form: (path[:len], next[, draws]) as Python ints.  Device form
 * (device_outputs=True): (path[n] padded with -1, len, next[, draws]) as 0-d arrays of the input's library,
 * so a CUDA caller can keep a whole cycle on the device. */
static PyObject *hs_verify_result(hs_views *vs, PyObject *alloc, const char *op, int devout, PyObject *path, int64_t n,
                                  int64_t len, int64_t next, int64_t draws, int with_draws) {
    if (devout) {
        int64_t one = 1, vals[3] = {len, next, draws};
        const char *names[3] = {"length", "next_token", "draws"};
        PyObject *res = PyTuple_New(with_draws ? 4 : 3);
        if (res == NULL) return NULL;
        hs_view *pv = &vs->v[0];
        for (int i = 0; i < vs->n; i++) if (vs->arg[i] && strcmp(vs->arg[i], "path") == 0) pv = &vs->v[i];
        for (int64_t i = len; i < n; i++) ((int64_t *)pv->data)[i] = -1;
        Py_INCREF(path);
        PyTuple_SET_ITEM(res, 0, path);
        for (int i = 0; i < (with_draws ? 3 : 2); i++) {
            hs_view *ov;
            PyObject *o = hs_views_alloc(vs, alloc, op, names[i], 0, &one, HS_INT64, &ov);
            if (o == NULL) {
                Py_DECREF(res);
                return NULL;
            }
            *(int64_t *)ov->data = vals[i];
            PyTuple_SET_ITEM(res, i + 1, o);
        }
        return res;
    }
    PyObject *sl = PySequence_GetSlice(path, 0, (Py_ssize_t)len);
    if (sl == NULL) return NULL;
    return with_draws ? Py_BuildValue("(NLL)", sl, (long long)next, (long long)draws) : Py_BuildValue("(NL)", sl, (long long)next);
}

#ifdef HS_WITH_CUDA
/* The CUDA tail of a verify call: device form as is, host form after reading len/next/draws back. */
static PyObject *hs_verify_gpu_result(hs_gpu *g, hs_views *vs, const char *op, int devout, int check, PyObject *path,
                                      PyObject **outs, hs_view **ov, int with_draws) {
    int nres = with_draws ? 3 : 2;
    if (devout) {
        if (hs_gpu_end(g, op, check) < 0) return NULL;
        PyObject *res = PyTuple_New(nres + 1);
        if (res == NULL) return NULL;
        Py_INCREF(path);
        PyTuple_SET_ITEM(res, 0, path);
        for (int i = 0; i < nres; i++) {
            Py_INCREF(outs[i]);
            PyTuple_SET_ITEM(res, i + 1, outs[i]);
        }
        return res;
    }
    int64_t vals[3] = {0, 0, 0};
    for (int i = 0; i < nres; i++)
        if (hs_gpu_read(g, op, "device_outputs", (int64_t *)ov[i]->data, &vals[i], 1) < 0) {
            hs_gpu_end(g, op, 0);
            return NULL;
        }
    hs_gpu_end(g, op, 0);
    (void)vs;
    PyObject *sl = PySequence_GetSlice(path, 0, (Py_ssize_t)vals[0]);
    if (sl == NULL) return NULL;
    return with_draws ? Py_BuildValue("(NLL)", sl, (long long)vals[1], (long long)vals[2])
                      : Py_BuildValue("(NL)", sl, (long long)vals[1]);
}
#endif

static PyObject *py_verify_greedy(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "verify_greedy";
    PyObject *o_tok, *o_par, *o_lg, *alloc, *o_stream, *o_check, *o_devout, *path = NULL, *res = NULL;
    PyObject *outs[2] = {NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOO", &o_tok, &o_par, &o_lg, &alloc, &o_stream, &o_check, &o_devout)) return NULL;
    int check, devout;
    if (hs_parse_flag(o_check, op, "check", &check) < 0 || hs_parse_flag(o_devout, op, "device_outputs", &devout) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_view *tk, *pa, *lg, *opath;
    if (hs_verify_args(&vs, op, o_tok, o_par, o_lg, &tk, &pa, &lg) < 0) goto fail;
    int64_t n = tk->shape[0], V = lg->shape[1], len = 0, next = 0;
    if (!(path = hs_views_alloc(&vs, alloc, op, "path", 1, &n, HS_INT64, &opath))) goto fail;
    if (hs_gpu_begin(&g, tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        int64_t one = 1;
        hs_view *ov[2];
        if (!(outs[0] = hs_views_alloc(&vs, alloc, op, "length", 0, &one, HS_INT64, &ov[0])) ||
            !(outs[1] = hs_views_alloc(&vs, alloc, op, "next_token", 0, &one, HS_INT64, &ov[1])))
            goto fail;
        void *gws = hs_gpu_workspace(&g, hs_cuda_verify_greedy_workspace_bytes(1, n, V));
        if (gws == NULL) goto fail;
        HS_CALL(hs_cuda_verify_greedy(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, n, NULL, lg->data,
                                      (hs_dtype)lg->dtype, V, (int64_t *)opath->data, (int64_t *)ov[0]->data,
                                      (int64_t *)ov[1]->data, (char *)gws + HS_WS_COUNTERS,
                                      hs_cuda_verify_greedy_workspace_bytes(1, n, V), g.err, g.stream, &err));
        res = hs_verify_gpu_result(&g, &vs, op, devout, check, path, outs, ov, 0);
#endif
    } else {
        HS_CALL(hs_verify_greedy(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, n, &n, lg->data,
                                (hs_dtype)lg->dtype, V, (int64_t *)opath->data, &len, &next, &err));
        res = hs_verify_result(&vs, alloc, op, devout, path, n, len, next, 0, 0);
    }
fail:
    hs_gpu_end(&g, op, 0);
    hs_views_release(&vs);
    Py_XDECREF(path);
    Py_XDECREF(outs[0]);
    Py_XDECREF(outs[1]);
    return res;
}

/* seed / offset: a Python int (or NumPy integer scalar), or a 1-element int64 tensor on the device of the tree
 * and logits, its int64 bits taken as the uint64 value.  On CUDA (for CUDA graphs) the kernel reads it (*dev);
 * on the CPU it is read here, into *val, and *view is kept for advance_offset's write-back. */
static int hs_parse_seed(hs_views *vs, PyObject *o, const char *op, const char *arg, uint64_t *val, void **dev,
                         hs_view **view) {
    *dev = NULL;
    *view = NULL;
    /* a device tensor only: torch tensors also implement __index__, which would synchronise */
    int on_device = 0;
    PyObject *d = PyObject_HasAttrString(o, "__dlpack_device__") ? PyObject_CallMethod(o, "__dlpack_device__", NULL) : NULL;
    if (d != NULL && PyTuple_Check(d) && PyTuple_GET_SIZE(d) >= 1) on_device = PyLong_AsLong(PyTuple_GET_ITEM(d, 0)) == 2;
    Py_XDECREF(d);
    PyErr_Clear();
    if (!on_device) {
        /* a CPU tensor (NumPy array, torch tensor, any DLPack producer): read now, never through __index__ */
        int is_array = !PyLong_Check(o) && !PyArray_IsScalar(o, Generic) &&
                       (PyArray_Check(o) || PyObject_HasAttrString(o, "__dlpack__"));
        if (!is_array) return hs_parse_u64(o, op, arg, val);
        hs_view *v = hs_views_add(vs, o, op, arg, 0); /* also: on the device of the tree and logits */
        if (v == NULL) return -1;
        if (hs_check_dtype(v, op, arg, HS_MASK(HS_INT64), "int64 (or a Python int)") < 0) return -1;
        if (hs_view_nbytes(v) != 8) {
            PyErr_Format(PyExc_ValueError,
                         "%s: argument '%s' expected an int or a 1-element int64 tensor, got %lld elements", op, arg,
                         (long long)(hs_view_nbytes(v) / 8));
            return -1;
        }
        memcpy(val, v->data, sizeof *val);
        *view = v;
        return 0;
    }
    hs_view *v = hs_views_add(vs, o, op, arg, 1);
    if (v == NULL) return -1;
    if (hs_check_dtype(v, op, arg, HS_MASK(HS_INT64), "int64") < 0) return -1;
    if (hs_view_nbytes(v) != 8) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an int or a 1-element int64 tensor, got %lld elements",
                     op, arg, (long long)(hs_view_nbytes(v) / 8));
        return -1;
    }
    *dev = v->data;
    *val = 0;
    return 0;
}

static PyObject *py_verify_sample(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "verify_sample";
    PyObject *o_tok, *o_par, *o_lg, *o_temp, *o_topk, *o_topp, *o_seed, *o_off, *alloc, *o_stream, *o_check, *o_devout,
        *o_adv, *path = NULL, *res = NULL;
    PyObject *outs[3] = {NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOO", &o_tok, &o_par, &o_lg, &o_temp, &o_topk, &o_topp, &o_seed, &o_off,
                          &alloc, &o_stream, &o_check, &o_devout, &o_adv))
        return NULL;
    hs_sampling sp;
    uint64_t seed, offset;
    void *seed_dev = NULL, *off_dev = NULL;
    hs_view *seed_v = NULL, *off_v = NULL; /* CPU tensors */
    int check, devout, adv;
    if (hs_parse_f64(o_temp, op, "temperature", &sp.temperature) < 0 || hs_parse_i64(o_topk, op, "top_k", &sp.top_k) < 0 ||
        hs_parse_f64(o_topp, op, "top_p", &sp.top_p) < 0 || hs_parse_flag(o_check, op, "check", &check) < 0 ||
        hs_parse_flag(o_devout, op, "device_outputs", &devout) < 0 || hs_parse_flag(o_adv, op, "advance_offset", &adv) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    hs_view *tk, *pa, *lg, *opath;
    if (hs_verify_args(&vs, op, o_tok, o_par, o_lg, &tk, &pa, &lg) < 0) goto fail;
    /* a tensor must share the device of tree_tokens (hence of target_logits): hs_views_add checks it */
    if (hs_parse_seed(&vs, o_seed, op, "seed", &seed, &seed_dev, &seed_v) < 0 ||
        hs_parse_seed(&vs, o_off, op, "offset", &offset, &off_dev, &off_v) < 0)
        goto fail;
    if (adv && !off_dev && !off_v) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'advance_offset' expected False unless 'offset' is a 1-element "
                     "int64 tensor, got True (with an int offset)", op);
        goto fail;
    }
    if (adv && off_v && off_v->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'offset' expected a writable tensor (advance_offset=True writes "
                     "offset + draws into it), got a read-only one", op);
        goto fail;
    }
    int64_t n = tk->shape[0], V = lg->shape[1], len = 0, next = 0, draws = 0;
    if (!(path = hs_views_alloc(&vs, alloc, op, "path", 1, &n, HS_INT64, &opath))) goto fail;
    if (hs_gpu_begin(&g, tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        int64_t one = 1;
        hs_view *ov[3];
        if (!(outs[0] = hs_views_alloc(&vs, alloc, op, "length", 0, &one, HS_INT64, &ov[0])) ||
            !(outs[1] = hs_views_alloc(&vs, alloc, op, "next_token", 0, &one, HS_INT64, &ov[1])) ||
            !(outs[2] = hs_views_alloc(&vs, alloc, op, "draws", 0, &one, HS_INT64, &ov[2])))
            goto fail;
        size_t wsb = hs_cuda_verify_sample_workspace_bytes(1, n, V);
        void *gws = hs_gpu_workspace(&g, wsb);
        if (gws == NULL) goto fail;
        HS_CALL(hs_cuda_verify_sample(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, n, NULL, lg->data,
                                      (hs_dtype)lg->dtype, V, sp, (const uint64_t *)seed_dev, seed, (uint64_t *)off_dev,
                                      offset, adv, (int64_t *)opath->data, (int64_t *)ov[0]->data, (int64_t *)ov[1]->data,
                                      (int64_t *)ov[2]->data, (char *)gws + HS_WS_COUNTERS, wsb, g.err, g.stream, &err));
        res = hs_verify_gpu_result(&g, &vs, op, devout, check, path, outs, ov, 1);
#endif
    } else {
        size_t wsb = hs_verify_sample_workspace_bytes(n, V);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_verify_sample(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, n, &n, lg->data,
                                (hs_dtype)lg->dtype, V, sp, &seed, &offset, (int64_t *)opath->data, &len, &next, &draws,
                                ws, wsb, &err));
        res = hs_verify_result(&vs, alloc, op, devout, path, n, len, next, draws, 1);
        if (res != NULL && adv && off_v != NULL) { /* as the kernel does: offset += draws, mod 2^64 */
            uint64_t advanced = offset + (uint64_t)draws;
            memcpy(off_v->data, &advanced, sizeof advanced);
        }
    }
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    Py_XDECREF(path);
    for (int i = 0; i < 3; i++) Py_XDECREF(outs[i]);
    return res;
}

/* ---- batched acceptance: verify_greedy / verify_sample over [batch, T] trees ----------------------------
 * The batch-first C ABI reached from Python: tree_tokens, tree_parents [batch, T], target_logits [batch, T, V],
 * n (None: every row has T nodes, or an int64 [batch] array on the inputs' device: nodes per row).  Results
 * are always arrays on the inputs' device: path [batch, T] (-1 past each row's length), length, next_token
 * (and draws) [batch]. */

static int hs_verify_batch_args(hs_views *vs, const char *op, PyObject *o_tok, PyObject *o_par, PyObject *o_lg,
                                PyObject *o_n, hs_view **tk, hs_view **pa, hs_view **lg, hs_view **nv) {
    if (!(*tk = hs_views_add(vs, o_tok, op, "tree_tokens", 0)) ||
        hs_check_ndim(*tk, op, "tree_tokens", 2, "[batch, T]") < 0 ||
        hs_check_dtype(*tk, op, "tree_tokens", HS_ID_DTYPES, "int32 or int64") < 0)
        return -1;
    int64_t B = (*tk)->shape[0], T = (*tk)->shape[1];
    if (!(*pa = hs_views_add(vs, o_par, op, "tree_parents", 0)) ||
        hs_check_ndim(*pa, op, "tree_parents", 2, "[batch, T]") < 0 ||
        hs_check_dtype(*pa, op, "tree_parents", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dim(*pa, op, "tree_parents", 0, B, "one tree per batch row") < 0 ||
        hs_check_dim(*pa, op, "tree_parents", 1, T, "one parent per tree node") < 0)
        return -1;
    if (!(*lg = hs_views_add(vs, o_lg, op, "target_logits", 0)) ||
        hs_check_ndim(*lg, op, "target_logits", 3, "[batch, T, V]") < 0 ||
        hs_check_dtype(*lg, op, "target_logits", HS_LOGIT_DTYPES, "float16, bfloat16 or float32") < 0 ||
        hs_check_dim(*lg, op, "target_logits", 0, B, "one tree per batch row") < 0 ||
        hs_check_dim(*lg, op, "target_logits", 1, T, "one logits row per tree node") < 0)
        return -1;
    if (T < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'tree_tokens' expected at least the root node, got T = 0", op);
        return -1;
    }
    if ((*lg)->shape[2] < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'target_logits' expected V >= 1, got 0", op);
        return -1;
    }
    *nv = NULL;
    if (o_n != Py_None) {
        if (!(*nv = hs_views_add(vs, o_n, op, "n", 0)) || hs_check_ndim(*nv, op, "n", 1, "[batch]") < 0 ||
            hs_check_dtype(*nv, op, "n", HS_MASK(HS_INT64), "int64") < 0 ||
            hs_check_dim(*nv, op, "n", 0, B, "one node count per batch row") < 0)
            return -1;
    }
    return 0;
}

/* Host copies of the per-row node counts (T for every row without n); NULL with an exception on failure. */
static int64_t *hs_batch_counts(const char *op, const hs_view *nv, int64_t B, int64_t T) {
    int64_t *nh = PyMem_Malloc((size_t)(B > 0 ? B : 1) * sizeof(int64_t));
    if (nh == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (int64_t b = 0; b < B; b++) {
        nh[b] = nv ? ((const int64_t *)nv->data)[b] : T;
        if (nh[b] < 1 || nh[b] > T) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected node counts in [1, %lld], got %lld", op,
                         (long long)T, (long long)nh[b]);
            PyMem_Free(nh);
            return NULL;
        }
    }
    return nh;
}

static void hs_batch_pad_paths(int64_t *path, const int64_t *len, int64_t B, int64_t T) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = len[b] > 0 ? len[b] : 0; i < T; i++) path[b * T + i] = -1;
}

/* The outputs of a batched verify: path [batch, T], then `k` int64 [batch] arrays (length, next_token, draws). */
static int hs_batch_outputs(hs_views *vs, PyObject *alloc, const char *op, int64_t B, int64_t T, int k,
                            PyObject **outs, hs_view **ov) {
    static const char *names[3] = {"length", "next_token", "draws"};
    int64_t shp[2] = {B, T};
    if (!(outs[0] = hs_views_alloc(vs, alloc, op, "path", 2, shp, HS_INT64, &ov[0]))) return -1;
    for (int i = 0; i < k; i++)
        if (!(outs[i + 1] = hs_views_alloc(vs, alloc, op, names[i], 1, &B, HS_INT64, &ov[i + 1]))) return -1;
    return 0;
}

static PyObject *hs_batch_result(PyObject **outs, int k) {
    PyObject *res = PyTuple_New(k);
    if (res == NULL) return NULL;
    for (int i = 0; i < k; i++) {
        Py_INCREF(outs[i]);
        PyTuple_SET_ITEM(res, i, outs[i]);
    }
    return res;
}

static PyObject *py_verify_greedy_batch(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "verify_greedy";
    PyObject *o_tok, *o_par, *o_lg, *o_n, *alloc, *o_stream, *o_check, *res = NULL;
    PyObject *outs[3] = {NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOO", &o_tok, &o_par, &o_lg, &o_n, &alloc, &o_stream, &o_check)) return NULL;
    int check;
    if (hs_parse_flag(o_check, op, "check", &check) < 0) return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    int64_t *nh = NULL;
    hs_view *tk, *pa, *lg, *nv, *ov[3];
    if (hs_verify_batch_args(&vs, op, o_tok, o_par, o_lg, o_n, &tk, &pa, &lg, &nv) < 0) goto fail;
    int64_t B = tk->shape[0], T = tk->shape[1], V = lg->shape[2];
    if (hs_batch_outputs(&vs, alloc, op, B, T, 2, outs, ov) < 0) goto fail;
    if (hs_gpu_begin(&g, tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        size_t wsb = hs_cuda_verify_greedy_workspace_bytes(B, T, V);
        void *gws = hs_gpu_workspace(&g, wsb);
        if (gws == NULL) goto fail;
        if (B > 0)
            HS_CALL(hs_cuda_verify_greedy(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, T,
                                          nv ? (const int64_t *)nv->data : NULL, lg->data, (hs_dtype)lg->dtype, V,
                                          (int64_t *)ov[0]->data, (int64_t *)ov[1]->data, (int64_t *)ov[2]->data,
                                          (char *)gws + HS_WS_COUNTERS, wsb, g.err, g.stream, &err));
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
#endif
    } else {
        if (!(nh = hs_batch_counts(op, nv, B, T))) goto fail;
        HS_CALL(hs_verify_greedy(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, T, nh, lg->data,
                                (hs_dtype)lg->dtype, V, (int64_t *)ov[0]->data, (int64_t *)ov[1]->data,
                                (int64_t *)ov[2]->data, &err));
        hs_batch_pad_paths((int64_t *)ov[0]->data, (const int64_t *)ov[1]->data, B, T);
    }
    res = hs_batch_result(outs, 3);
fail:
    hs_gpu_end(&g, op, 0);
    hs_views_release(&vs);
    PyMem_Free(nh);
    for (int i = 0; i < 3; i++) Py_XDECREF(outs[i]);
    return res;
}

/* seeds / offsets of a batched verify_sample: a Python int (every row) or an int64 [batch] array on the
 * inputs' device.  On the CPU the values are copied to *host (B entries); on CUDA a device array is passed to
 * the kernel as *dev and an int as *val. */
static int hs_parse_batch_seeds(hs_views *vs, PyObject *o, const char *op, const char *arg, int64_t B, int on_gpu,
                                uint64_t *host, uint64_t *val, void **dev, hs_view **view) {
    *dev = NULL;
    *view = NULL;
    *val = 0;
    int is_array = !PyLong_Check(o) && !PyArray_IsScalar(o, Generic) &&
                   (PyArray_Check(o) || PyObject_HasAttrString(o, "__dlpack__"));
    if (!is_array) {
        if (hs_parse_u64(o, op, arg, val) < 0) return -1;
        for (int64_t b = 0; b < B; b++) host[b] = *val;
        return 0;
    }
    hs_view *v = hs_views_add(vs, o, op, arg, 0);
    if (v == NULL || hs_check_ndim(v, op, arg, 1, "[batch]") < 0 ||
        hs_check_dtype(v, op, arg, HS_MASK(HS_INT64), "int64 (or a Python int)") < 0 ||
        hs_check_dim(v, op, arg, 0, B, "one value per batch row") < 0)
        return -1;
    *view = v;
    if (on_gpu) *dev = v->data;
    else memcpy(host, v->data, (size_t)B * sizeof(uint64_t));
    return 0;
}

static PyObject *py_verify_sample_batch(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "verify_sample";
    PyObject *o_tok, *o_par, *o_lg, *o_n, *o_temp, *o_topk, *o_topp, *o_seed, *o_off, *alloc, *o_stream, *o_check,
        *o_adv, *res = NULL;
    PyObject *outs[4] = {NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOO", &o_tok, &o_par, &o_lg, &o_n, &o_temp, &o_topk, &o_topp, &o_seed, &o_off,
                          &alloc, &o_stream, &o_check, &o_adv))
        return NULL;
    hs_sampling sp;
    int check, adv;
    if (hs_parse_f64(o_temp, op, "temperature", &sp.temperature) < 0 || hs_parse_i64(o_topk, op, "top_k", &sp.top_k) < 0 ||
        hs_parse_f64(o_topp, op, "top_p", &sp.top_p) < 0 || hs_parse_flag(o_check, op, "check", &check) < 0 ||
        hs_parse_flag(o_adv, op, "advance_offset", &adv) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    int64_t *nh = NULL;
    uint64_t *seeds = NULL, *offs = NULL, seed0 = 0, off0 = 0;
    void *seed_dev = NULL, *off_dev = NULL, *ws = NULL;
    hs_view *tk, *pa, *lg, *nv, *ov[4], *sview, *oview;
    if (hs_verify_batch_args(&vs, op, o_tok, o_par, o_lg, o_n, &tk, &pa, &lg, &nv) < 0) goto fail;
    int64_t B = tk->shape[0], T = tk->shape[1], V = lg->shape[2];
    int on_gpu = tk->device_type == 2;
    seeds = PyMem_Malloc((size_t)(B > 0 ? B : 1) * sizeof(uint64_t));
    offs = PyMem_Malloc((size_t)(B > 0 ? B : 1) * sizeof(uint64_t));
    if (seeds == NULL || offs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (hs_parse_batch_seeds(&vs, o_seed, op, "seed", B, on_gpu, seeds, &seed0, &seed_dev, &sview) < 0 ||
        hs_parse_batch_seeds(&vs, o_off, op, "offset", B, on_gpu, offs, &off0, &off_dev, &oview) < 0)
        goto fail;
    if (adv && oview == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'advance_offset' expected False unless 'offset' is an int64 "
                     "[batch] array, got True", op);
        goto fail;
    }
    if (adv && oview->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'offset' expected a writable array with advance_offset=True, "
                     "got a read-only one", op);
        goto fail;
    }
    if (hs_batch_outputs(&vs, alloc, op, B, T, 3, outs, ov) < 0) goto fail;
    if (hs_gpu_begin(&g, tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        size_t wsb = hs_cuda_verify_sample_workspace_bytes(B, T, V);
        void *gws = hs_gpu_workspace(&g, wsb);
        if (gws == NULL) goto fail;
        if (B > 0)
            HS_CALL(hs_cuda_verify_sample(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, T,
                                          nv ? (const int64_t *)nv->data : NULL, lg->data, (hs_dtype)lg->dtype, V, sp,
                                          (const uint64_t *)seed_dev, seed0, (uint64_t *)off_dev, off0, adv,
                                          (int64_t *)ov[0]->data, (int64_t *)ov[1]->data, (int64_t *)ov[2]->data,
                                          (int64_t *)ov[3]->data, (char *)gws + HS_WS_COUNTERS, wsb, g.err, g.stream,
                                          &err));
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
#endif
    } else {
        if (!(nh = hs_batch_counts(op, nv, B, T))) goto fail;
        size_t wsb = hs_verify_sample_workspace_bytes(T, V);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_verify_sample(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, T, nh, lg->data,
                                (hs_dtype)lg->dtype, V, sp, seeds, offs, (int64_t *)ov[0]->data, (int64_t *)ov[1]->data,
                                (int64_t *)ov[2]->data, (int64_t *)ov[3]->data, ws, wsb, &err));
        hs_batch_pad_paths((int64_t *)ov[0]->data, (const int64_t *)ov[1]->data, B, T);
        if (adv)
            for (int64_t b = 0; b < B; b++)
                ((uint64_t *)oview->data)[b] = offs[b] + (uint64_t)((const int64_t *)ov[3]->data)[b];
    }
    res = hs_batch_result(outs, 4);
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    PyMem_Free(nh);
    PyMem_Free(seeds);
    PyMem_Free(offs);
    for (int i = 0; i < 4; i++) Py_XDECREF(outs[i]);
    return res;
}

/* ---- kv_compact(tensors, prefix_len, slots) and KVTensors ---------------------------------------------
 * The tensors of a call are an hs_kv_set: imported and validated either per call (a list or tuple) or once,
 * by a KVTensors object that keeps the imports (and the tensors) alive, so that a static cache's per-cycle
 * commit costs no per-tensor import. */

#ifdef HS_WITH_CUDA
typedef hs_kv_tensor hs_kv_desc;
#else
typedef struct {
    void *data;
    int64_t inner, S, row_bytes;
} hs_kv_desc;
#endif

typedef struct {
    hs_view *views;  /* count imported views */
    hs_kv_desc *desc; /* [inner, S, row_bytes] of each */
    Py_ssize_t count;
    int64_t min_S; /* INT64_MAX without tensors */
    int device_type, device_id; /* of the tensors (device_type 0: none) */
} hs_kv_set;

static void hs_kv_set_release(hs_kv_set *ks) {
    for (Py_ssize_t i = 0; i < ks->count && ks->views; i++) hs_view_release(&ks->views[i]);
    PyMem_Free(ks->views);
    PyMem_Free(ks->desc);
    memset(ks, 0, sizeof *ks);
}

/* Import and validate a list/tuple of [..., S, D] tensors (writable, C-contiguous, not overlapping) into *ks,
 * all on the device of `ref` (named ref_arg), or of the first tensor when ref is NULL.  -1 with an exception
 * (and nothing held) on failure. */
static int hs_kv_set_import(hs_kv_set *ks, PyObject *o_tensors, const char *op, PyObject *stream, const hs_view *ref,
                            const char *ref_arg) {
    memset(ks, 0, sizeof *ks);
    ks->min_S = INT64_MAX;
    if (PyUnicode_Check(o_tensors) || !PySequence_Check(o_tensors) || PyObject_HasAttrString(o_tensors, "__dlpack__") ||
        PyArray_Check(o_tensors)) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'tensors' expected a list or tuple of arrays, got %s", op,
                     Py_TYPE(o_tensors)->tp_name);
        return -1;
    }
    PyObject *seq = PySequence_Fast(o_tensors, "kv_compact: argument 'tensors' expected a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    ks->views = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(hs_view));
    ks->desc = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(hs_kv_desc));
    if (ks->views == NULL || ks->desc == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    char name[48];
    for (Py_ssize_t i = 0; i < count; i++) {
        snprintf(name, sizeof name, "tensors[%zd]", i);
        hs_view *v = &ks->views[i];
        if (hs_view_import(PySequence_Fast_GET_ITEM(seq, i), op, name, 1, stream, v) < 0) goto fail;
        ks->count = i + 1;
        if (ref != NULL ? hs_check_same_device(v, ref, op, name, ref_arg) < 0
                        : hs_check_same_device(v, &ks->views[0], op, name, "tensors[0]") < 0)
            goto fail;
        if (v->ndim < 2) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an array [..., S, D] with ndim >= 2, got ndim %d",
                         op, name, v->ndim);
            goto fail;
        }
        /* a tensor listed twice, or overlapping another, would be compacted twice: silent garbage */
        const char *lo = (const char *)v->data, *hi = lo + hs_view_nbytes(v);
        for (Py_ssize_t j = 0; j < i; j++) {
            const char *lo2 = (const char *)ks->views[j].data, *hi2 = lo2 + hs_view_nbytes(&ks->views[j]);
            if (lo < hi2 && lo2 < hi) {
                PyErr_Format(PyExc_ValueError,
                             "%s: argument '%s' expected tensors that do not overlap in memory, got memory shared "
                             "with tensors[%zd]",
                             op, name, j);
                goto fail;
            }
        }
        int64_t inner = 1;
        for (int d = 0; d < v->ndim - 2; d++) inner *= v->shape[d];
        int64_t S = v->shape[v->ndim - 2];
        ks->desc[i] = (hs_kv_desc){v->data, inner, S, v->shape[v->ndim - 1] * v->itemsize};
        if (S < ks->min_S) ks->min_S = S;
    }
    if (count > 0) {
        ks->device_type = ks->views[0].device_type;
        ks->device_id = ks->views[0].device_id;
    }
    Py_DECREF(seq);
    return 0;
fail:
    hs_kv_set_release(ks);
    Py_DECREF(seq);
    return -1;
}

/* Refuse an argument (slots, prefix_len) sharing memory with a tensor: moving rows would change it mid-call. */
static int hs_kv_check_disjoint(const hs_kv_set *ks, const hs_view *v, const char *op, const char *arg) {
    const char *lo = (const char *)v->data, *hi = lo + hs_view_nbytes(v);
    for (Py_ssize_t j = 0; j < ks->count; j++) {
        const char *lo2 = (const char *)ks->views[j].data, *hi2 = lo2 + hs_view_nbytes(&ks->views[j]);
        if (lo < hi2 && lo2 < hi) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected memory not shared with the tensors, got memory "
                         "shared with tensors[%zd]", op, arg, j);
            return -1;
        }
    }
    return 0;
}

/* prefix_len: a Python int (or NumPy integer scalar), or an int64 array on the device of 'slots': exactly one
 * element (shape [] or [1]) for unbatched slots, [batch] for batched ones (B > 0).  A CPU array is copied to
 * host[0..B) (host[0] for unbatched); a CUDA one is left to the kernel (*dev).  An int goes to host[0..B). */
static int hs_parse_prefix(hs_views *vs, PyObject *o, const char *op, int64_t B, int64_t *host, const int64_t **dev,
                           hs_view **view) {
    static const char arg[] = "prefix_len";
    const int64_t rows = B > 0 ? B : 1;
    *dev = NULL;
    *view = NULL;
    int is_array = !PyLong_Check(o) && !PyArray_IsScalar(o, Generic) &&
                   (PyArray_Check(o) || PyObject_HasAttrString(o, "__dlpack__"));
    if (!is_array) {
        int64_t val;
        if (hs_parse_i64(o, op, arg, &val) < 0) return -1;
        for (int64_t b = 0; b < rows; b++) host[b] = val;
    } else {
        hs_view *v = hs_views_add(vs, o, op, arg, 0);
        if (v == NULL) return -1;
        if (hs_check_dtype(v, op, arg, HS_MASK(HS_INT64), "int64 (or a Python int)") < 0) return -1;
        if (B > 0 ? (v->ndim != 1 || v->shape[0] != B) : (v->ndim > 1 || hs_view_nbytes(v) != 8)) {
            if (B > 0)
                PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an int or an int64 array [batch] = [%lld] "
                             "(one prefix length per request), got %d-D with %lld elements", op, arg, (long long)B,
                             v->ndim, (long long)(hs_view_nbytes(v) / 8));
            else
                PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an int or an int64 array with exactly one "
                             "element (shape [] or [1]), got %d-D with %lld elements", op, arg, v->ndim,
                             (long long)(hs_view_nbytes(v) / 8));
            return -1;
        }
        *view = v;
        if (v->device_type == 2) { /* DLPack kDLCUDA: the kernel reads it when it runs */
            *dev = (const int64_t *)v->data;
            return 0;
        }
        memcpy(host, v->data, (size_t)rows * sizeof(int64_t));
    }
    for (int64_t b = 0; b < rows; b++)
        if (host[b] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected >= 0, got %lld", op, arg, (long long)host[b]);
            return -1;
        }
    return 0;
}

typedef struct {
    PyObject_HEAD
    hs_kv_set set;
    PyObject *tensors; /* the tuple of the tensors: their storage stays alive */
} hs_kvt_object;

static PyTypeObject hs_kvt_type;

static PyObject *py_kv_compact(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "kv_compact";
    PyObject *o_tensors, *o_prefix, *o_slots, *o_stream, *o_check;
    if (!PyArg_ParseTuple(args, "OOOOO", &o_tensors, &o_prefix, &o_slots, &o_stream, &o_check)) return NULL;
    int check;
    if (hs_parse_flag(o_check, op, "check", &check) < 0) return NULL;
    const int prepared = PyObject_TypeCheck(o_tensors, &hs_kvt_type);
    if (!prepared && (PyUnicode_Check(o_tensors) || !PySequence_Check(o_tensors) ||
                      PyObject_HasAttrString(o_tensors, "__dlpack__") || PyArray_Check(o_tensors))) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'tensors' expected a list or tuple of arrays or a KVTensors, got %s",
                     op, Py_TYPE(o_tensors)->tp_name);
        return NULL;
    }
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_kv_set own;
    memset(&own, 0, sizeof own);
    const hs_kv_set *ks = prepared ? &((hs_kvt_object *)o_tensors)->set : &own;
    hs_view *sl, *pv = NULL;
    const int64_t *prefix_dev = NULL;
    int64_t local[16], *host = NULL; /* prefix lengths [B], then the slot counts [B]: on the stack for B <= 8
                                         (the decoding loop's per-cycle commit), else allocated */
    PyObject *result = NULL;
    if (prepared && ks->device_type != 0) {
        /* slots must live where the prepared tensors do */
        hs_view where;
        memset(&where, 0, sizeof where);
        where.device_type = ks->device_type;
        where.device_id = ks->device_id;
        if (!(sl = hs_views_add(&vs, o_slots, op, "slots", 0)) || hs_check_same_device(sl, &where, op, "slots", "tensors") < 0)
            goto fail;
    } else if (!(sl = hs_views_add(&vs, o_slots, op, "slots", 0))) {
        goto fail;
    }
    /* batched: slots [batch, m], every tensor [batch, ..., S, D], prefix_len an int or int64 [batch] */
    const int bt = sl->ndim == 2;
    if (hs_check_ndim(sl, op, "slots", bt ? 2 : 1, bt ? "[batch, m]" : "[m]") < 0 ||
        hs_check_dtype(sl, op, "slots", HS_ID_DTYPES, "int32 or int64") < 0)
        goto fail;
    const int64_t B = bt ? sl->shape[0] : 1, m = sl->shape[bt];
    if (B <= 8) {
        host = local;
    } else if (!(host = PyMem_Malloc((size_t)B * 2 * sizeof(int64_t)))) {
        PyErr_NoMemory();
        goto fail;
    }
    if (hs_parse_prefix(&vs, o_prefix, op, bt ? B : 0, host, &prefix_dev, &pv) < 0) goto fail;
    if (!prepared && hs_kv_set_import(&own, o_tensors, op, o_stream, sl, "slots") < 0) goto fail;
    if (hs_kv_check_disjoint(ks, sl, op, "slots") < 0 || (pv && hs_kv_check_disjoint(ks, pv, op, "prefix_len") < 0))
        goto fail;
    for (Py_ssize_t i = 0; bt && i < ks->count; i++)
        if (ks->views[i].ndim < 3 || ks->views[i].shape[0] != B) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'tensors[%zd]' expected an array [batch = %lld, ..., S, D] for "
                         "batched slots, got ndim %d with leading size %lld", op, i, (long long)B, ks->views[i].ndim,
                         (long long)ks->views[i].shape[0]);
            goto fail;
        }
    if (B == 0) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    if (hs_gpu_begin(&g, sl, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        /* the kernel checks prefixes and slots against every S before it moves anything */
        HS_CALL(hs_cuda_kv_compact(ks->desc, ks->count, B, prefix_dev, host[0], sl->data, (hs_dtype)sl->dtype, m, g.err,
                                   g.stream, &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
        result = Py_NewRef(Py_None);
        goto fail;
    }
    int64_t *counts = host + B;
    for (int64_t b = 0; b < B; b++) counts[b] = m;
    {
        /* validate against the shortest S before any tensor is modified (also without tensors) */
        hs_error err;
        hs_status st = hs_kv_compact_check(B, ks->min_S, host, sl->data, (hs_dtype)sl->dtype, m, counts, &err);
        if (st != HS_OK) {
            hs_raise(st, &err);
            goto fail;
        }
    }
    /* every tensor validated: now move the rows */
    for (Py_ssize_t i = 0; i < ks->count; i++) {
        const hs_kv_desc *d = &ks->desc[i];
        HS_CALL(hs_kv_compact(d->data, B, d->inner / B, d->S, d->row_bytes, host, sl->data, (hs_dtype)sl->dtype, m,
                              counts, &err));
    }
    result = Py_NewRef(Py_None);
fail:
    hs_gpu_end(&g, op, 0);
    hs_kv_set_release(&own);
    hs_views_release(&vs);
    if (host != local) PyMem_Free(host);
    return result;
}

/* KVTensors(tensors, stream): the tensors of kv_compact imported and validated once. */
static PyObject *hs_kvt_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static const char op[] = "KVTensors";
    static char *kwlist[] = {"tensors", "stream", NULL};
    PyObject *o_tensors, *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:KVTensors", kwlist, &o_tensors, &o_stream)) return NULL;
    hs_kvt_object *self = (hs_kvt_object *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if (hs_kv_set_import(&self->set, o_tensors, op, o_stream, NULL, NULL) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->tensors = PySequence_Tuple(o_tensors);
    if (self->tensors == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void hs_kvt_dealloc(hs_kvt_object *self) {
    hs_kv_set_release(&self->set);
    Py_CLEAR(self->tensors);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t hs_kvt_len(hs_kvt_object *self) { return self->set.count; }

static PyObject *hs_kvt_get_tensors(hs_kvt_object *self, void *closure) {
    (void)closure;
    return Py_NewRef(self->tensors ? self->tensors : Py_None);
}

static PyObject *hs_kvt_get_device(hs_kvt_object *self, void *closure) {
    (void)closure;
    if (self->set.count == 0) Py_RETURN_NONE;
    return Py_BuildValue("(ii)", self->set.device_type, self->set.device_id);
}

static PyGetSetDef hs_kvt_getset[] = {
    {"tensors", (getter)hs_kvt_get_tensors, NULL, "the tensors, as a tuple", NULL},
    {"dlpack_device", (getter)hs_kvt_get_device, NULL, "(DLPack device type, id) of the tensors, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods hs_kvt_as_sequence = {.sq_length = (lenfunc)hs_kvt_len};

static PyTypeObject hs_kvt_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "heterospec._C.KVTensors",
    .tp_basicsize = sizeof(hs_kvt_object),
    .tp_dealloc = (destructor)hs_kvt_dealloc,
    .tp_as_sequence = &hs_kvt_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KVTensors(tensors, stream=None): the tensors of kv_compact, imported and validated once.",
    .tp_getset = hs_kvt_getset,
    .tp_new = hs_kvt_new,
};

/* ---- bucketize(values, thresholds, alloc) -> out --------------------------------------------------- */

static PyObject *py_bucketize(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "bucketize";
    PyObject *o_vals, *o_thr, *alloc, *o_stream, *o_check, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOOOO", &o_vals, &o_thr, &alloc, &o_stream, &o_check)) return NULL;
    int check;
    if (hs_parse_flag(o_check, op, "check", &check) < 0) return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_view *va, *th, *ov;
    if (!(va = hs_views_add(&vs, o_vals, op, "values", 0)) || hs_check_ndim(va, op, "values", 1, "[N]") < 0 ||
        hs_check_dtype(va, op, "values", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    if (!(th = hs_views_add(&vs, o_thr, op, "thresholds", 0)) || hs_check_ndim(th, op, "thresholds", 1, "[T]") < 0 ||
        hs_check_dtype(th, op, "thresholds", HS_REAL_DTYPES, "float32 or float64") < 0)
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

/* ---- Philox ------------------------------------------------------------------------------------------ */

static PyObject *py_philox4x32(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int c0, c1, c2, c3, k0, k1;
    if (!PyArg_ParseTuple(args, "IIIIII", &c0, &c1, &c2, &c3, &k0, &k1)) return NULL;
    uint32_t ctr[4] = {c0, c1, c2, c3}, key[2] = {k0, k1}, out[4];
    hs_philox4x32_10(ctr, key, out);
    return Py_BuildValue("(kkkk)", (unsigned long)out[0], (unsigned long)out[1], (unsigned long)out[2],
                         (unsigned long)out[3]);
}

static PyObject *py_philox_uniform(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "philox_uniform";
    PyObject *o_n, *o_seed, *o_off, *alloc, *out;
    if (!PyArg_ParseTuple(args, "OOOO", &o_n, &o_seed, &o_off, &alloc)) return NULL;
    int64_t n;
    uint64_t seed, off;
    if (hs_parse_i64(o_n, op, "n", &n) < 0 || hs_parse_u64(o_seed, op, "seed", &seed) < 0 ||
        hs_parse_u64(o_off, op, "offset", &off) < 0)
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected >= 0, got %lld", op, (long long)n);
        return NULL;
    }
    hs_views vs = {.n = 0, .stream = NULL};
    hs_view *ov;
    out = hs_views_alloc(&vs, alloc, op, "out", 1, &n, HS_FLOAT64, &ov);
    if (out != NULL) {
        double *u = (double *)ov->data;
        for (int64_t j = 0; j < n; j++) u[j] = hs_philox_uniform(seed, off, (uint64_t)j);
    }
    hs_views_release(&vs);
    return out;
}

/* ---- module ------------------------------------------------------------------------------------------ */

static PyObject *py_build_info(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *d = Py_BuildValue("{s:s,s:s,s:s,s:O}", "version", hs_version_string(), "compiler",
#if defined(__clang__)
                                "clang " __clang_version__,
#elif defined(__GNUC__)
                                "gcc " __VERSION__,
#else
                                "unknown",
#endif
                                "numpy_min_runtime", NPY_FEATURE_VERSION_STRING, "sanitizers",
#if defined(HS_SANITIZE)
                                Py_True
#else
                                Py_False
#endif
    );
    if (d == NULL) return NULL;
#ifdef HS_WITH_CUDA
    char why[160] = "";
    int count = hs_cuda_device_count(why, sizeof why);
    PyObject *extra = Py_BuildValue("{s:O,s:O,s:s,s:i,s:i,s:s}", "cuda", Py_True, "cuda_emulated",
                                    hs_cuda_emulated() ? Py_True : Py_False, "cuda_archs", hs_cuda_archs(),
                                    "cuda_runtime", hs_cuda_runtime_version(), "cuda_devices", count,
                                    "cuda_unavailable_reason", count > 0 ? "" : why);
#else
    PyObject *extra = Py_BuildValue("{s:O,s:O,s:O}", "cuda", Py_False, "cuda_emulated", Py_False, "cuda_archs", Py_None);
#endif
    if (extra == NULL || PyDict_Update(d, extra) < 0) {
        Py_XDECREF(extra);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(extra);
    return d;
}

/* cuda_check(device, stream): synchronise `stream` on `device` and raise the error a check=False call
 * recorded there, if any. */
static PyObject *py_cuda_check(PyObject *self, PyObject *args) {
    (void)self;
    int dev;
    PyObject *o_stream;
    if (!PyArg_ParseTuple(args, "iO", &dev, &o_stream)) return NULL;
#ifdef HS_WITH_CUDA
    hs_view ref;
    memset(&ref, 0, sizeof ref);
    ref.device_type = 2;
    ref.device_id = dev;
    hs_gpu g;
    if (hs_gpu_begin(&g, &ref, o_stream, "cuda_check") < 0) return NULL;
    if (hs_gpu_end(&g, "cuda_check", 1) < 0) return NULL;
    Py_RETURN_NONE;
#else
    (void)dev;
    (void)o_stream;
    PyErr_SetString(PyExc_ValueError, "cuda_check: this build of heterospec has no CUDA ops");
    return NULL;
#endif
}

/* cuda_reserve(device, bytes): grow the module workspace now (outside any graph capture); returns (its bytes, the
 * earlier workspaces kept alive for recorded graphs). */
static PyObject *py_cuda_reserve(PyObject *self, PyObject *args) {
    (void)self;
    int dev;
    long long bytes;
    if (!PyArg_ParseTuple(args, "iL", &dev, &bytes)) return NULL;
#ifdef HS_WITH_CUDA
    if (bytes < 0) {
        PyErr_Format(PyExc_ValueError, "cuda_reserve: argument 'bytes' expected >= 0, got %lld", bytes);
        return NULL;
    }
    hs_error err;
    if (hs_cuda_set_device(dev, &err) < 0 || hs_cuda_workspace(dev, HS_WS_COUNTERS + (size_t)bytes, NULL, &err) == NULL) {
        hs_raise(HS_ERR_CUDA, &err);
        return NULL;
    }
    size_t have;
    int retired;
    hs_cuda_workspace_info(dev, &have, &retired);
    return Py_BuildValue("(Ki)", (unsigned long long)have, retired);
#else
    (void)dev;
    (void)bytes;
    PyErr_SetString(PyExc_ValueError, "cuda_reserve: this build of heterospec has no CUDA ops");
    return NULL;
#endif
}

/* cuda_chunks(rows, V): the chunks the split-row kernels cut each row into (tests: the emulation splits too). */
static PyObject *py_cuda_chunks(PyObject *self, PyObject *args) {
    (void)self;
    long long rows, V;
    if (!PyArg_ParseTuple(args, "LL", &rows, &V)) return NULL;
#ifdef HS_WITH_CUDA
    return PyLong_FromLongLong((long long)hs_cuda_chunks(rows, V));
#else
    (void)rows;
    (void)V;
    PyErr_SetString(PyExc_ValueError, "cuda_chunks: this build of heterospec has no CUDA ops");
    return NULL;
#endif
}

static PyMethodDef hs_methods[] = {
    {"topk_entropy", py_topk_entropy, METH_VARARGS, "topk_entropy(logits, k, temperature, alloc) -> out"},
    {"expand", py_expand, METH_VARARGS, "expand(logits, beam_scores, beam_nodes, k, d2t, node_offset, alloc)"},
    {"select", py_select, METH_VARARGS, "select(scores, n, alloc) -> out"},
    {"build_tree", py_build_tree, METH_VARARGS, "build_tree(tokens, parents, selected, root_token, alloc)"},
    {"verify_greedy", py_verify_greedy, METH_VARARGS, "verify_greedy(tree_tokens, tree_parents, target_logits, alloc)"},
    {"select_batch", py_select_batch, METH_VARARGS, "select with per-row sizes over [batch, M] scores"},
    {"build_tree_batch", py_build_tree_batch, METH_VARARGS, "build_tree over [batch, M] candidates"},
    {"verify_greedy_batch", py_verify_greedy_batch, METH_VARARGS,
     "verify_greedy_batch(tree_tokens, tree_parents, target_logits, n, alloc, stream, check)"},
    {"verify_sample_batch", py_verify_sample_batch, METH_VARARGS,
     "verify_sample_batch(tree_tokens, tree_parents, target_logits, n, temperature, top_k, top_p, seed, offset, alloc, "
     "stream, check, advance_offset)"},
    {"verify_sample", py_verify_sample, METH_VARARGS,
     "verify_sample(tree_tokens, tree_parents, target_logits, temperature, top_k, top_p, seed, offset, alloc)"},
    {"kv_compact", py_kv_compact, METH_VARARGS, "kv_compact(tensors or KVTensors, prefix_len, slots, stream, check)"},
    {"bucketize", py_bucketize, METH_VARARGS, "bucketize(values, thresholds, alloc) -> out"},
    {"philox4x32", py_philox4x32, METH_VARARGS, "philox4x32(c0, c1, c2, c3, k0, k1) -> 4 words"},
    {"philox_uniform", py_philox_uniform, METH_VARARGS, "philox_uniform(n, seed, offset, alloc) -> out"},
    {"build_info", py_build_info, METH_NOARGS, "what this extension was compiled with"},
    {"cuda_check", py_cuda_check, METH_VARARGS, "cuda_check(device, stream): sync and raise recorded device errors"},
    {"cuda_reserve", py_cuda_reserve, METH_VARARGS, "cuda_reserve(device, bytes): grow the CUDA workspace now"},
    {"cuda_chunks", py_cuda_chunks, METH_VARARGS, "cuda_chunks(rows, V): chunks per row of the split-row kernels"},
    {NULL, NULL, 0, NULL},
};

static int hs_exec(PyObject *module) {
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    if (hs_cuda_error_type == NULL) {
        hs_cuda_error_type = PyErr_NewExceptionWithDoc("heterospec._C.CudaError",
                                                       "A CUDA runtime call or kernel launch failed.", PyExc_RuntimeError, NULL);
        if (hs_cuda_error_type == NULL) return -1;
    }
    Py_INCREF(hs_cuda_error_type);
    if (PyModule_AddObject(module, "CudaError", hs_cuda_error_type) < 0) {
        Py_DECREF(hs_cuda_error_type);
        return -1;
    }
    if (PyType_Ready(&hs_kvt_type) < 0) return -1;
    Py_INCREF(&hs_kvt_type);
    if (PyModule_AddObject(module, "KVTensors", (PyObject *)&hs_kvt_type) < 0) {
        Py_DECREF(&hs_kvt_type);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot hs_slots[] = {
    {Py_mod_exec, hs_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef hs_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "heterospec._C",
    .m_doc = "C core of heterospec (see heterospec.ops for the documented API).",
    .m_size = 0,
    .m_methods = hs_methods,
    .m_slots = hs_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&hs_module); }
