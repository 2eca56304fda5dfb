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

#define HS_MAX_VIEWS 16

/* All views of one call, released together. */
typedef struct {
    hs_view v[HS_MAX_VIEWS];
    const char *arg[HS_MAX_VIEWS];
    int n;
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
    if (hs_view_import(obj, op, arg, writable, v) < 0) return NULL;
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
    PyObject *type = st == HS_ERR_DTYPE ? PyExc_TypeError : st == HS_ERR_WORKSPACE ? PyExc_SystemError : PyExc_ValueError;
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

/* ---- topk_entropy(logits, k, temperature, alloc) -> out ------------------------------------------- */

static PyObject *py_topk_entropy(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "topk_entropy";
    PyObject *o_logits, *o_k, *o_temp, *alloc, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOOO", &o_logits, &o_k, &o_temp, &alloc)) return NULL;
    int64_t k;
    double temp;
    if (hs_parse_i64(o_k, op, "k", &k) < 0 || hs_parse_f64(o_temp, op, "temperature", &temp) < 0) return NULL;
    hs_views vs = {.n = 0};
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
    size_t wsb = hs_topk_entropy_workspace_bytes(k, V);
    if (!(ws = hs_workspace(wsb))) goto fail;
    HS_CALL(hs_topk_entropy(lg->data, (hs_dtype)lg->dtype, N, V, k, temp, (float *)ov->data, ws, wsb, &err));
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    return out;
fail:
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    Py_XDECREF(out);
    return NULL;
}

/* ---- expand(logits, beam_scores, beam_nodes, k, d2t, node_offset, alloc) -------------------------- */

static PyObject *py_expand(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "expand";
    PyObject *o_logits, *o_scores, *o_nodes, *o_k, *o_d2t, *o_off, *alloc;
    PyObject *outs[5] = {NULL, NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOOOO", &o_logits, &o_scores, &o_nodes, &o_k, &o_d2t, &o_off, &alloc))
        return NULL;
    int64_t k, off;
    if (hs_parse_i64(o_k, op, "k", &k) < 0 || hs_parse_i64(o_off, op, "node_offset", &off) < 0) return NULL;
    hs_views vs = {.n = 0};
    void *ws = NULL;
    hs_view *lg, *sc, *nd, *d2t = NULL, *ot, *os, *op_, *oe, *ob;
    if (!(lg = hs_views_add(&vs, o_logits, op, "logits", 0)) || hs_check_ndim(lg, op, "logits", 2, "[B, Vd]") < 0 ||
        hs_check_dtype(lg, op, "logits", HS_LOGIT_DTYPES, "float16, bfloat16 or float32") < 0)
        goto fail;
    int64_t B = lg->shape[0], Vd = lg->shape[1];
    if (!(sc = hs_views_add(&vs, o_scores, op, "beam_scores", 0)) ||
        hs_check_ndim(sc, op, "beam_scores", 1, "[B]") < 0 ||
        hs_check_dtype(sc, op, "beam_scores", HS_REAL_DTYPES, "float32 or float64") < 0 ||
        hs_check_dim(sc, op, "beam_scores", 0, B, "one score per logits row") < 0)
        goto fail;
    if (!(nd = hs_views_add(&vs, o_nodes, op, "beam_nodes", 0)) || hs_check_ndim(nd, op, "beam_nodes", 1, "[B]") < 0 ||
        hs_check_dtype(nd, op, "beam_nodes", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dim(nd, op, "beam_nodes", 0, B, "one node per logits row") < 0)
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
    int64_t Bk = B * k;
    if (!(outs[0] = hs_views_alloc(&vs, alloc, op, "tokens", 1, &Bk, HS_INT64, &ot)) ||
        !(outs[1] = hs_views_alloc(&vs, alloc, op, "scores", 1, &Bk, HS_FLOAT32, &os)) ||
        !(outs[2] = hs_views_alloc(&vs, alloc, op, "parents", 1, &Bk, HS_INT64, &op_)) ||
        !(outs[3] = hs_views_alloc(&vs, alloc, op, "entropy", 1, &B, HS_FLOAT32, &oe)) ||
        !(outs[4] = hs_views_alloc(&vs, alloc, op, "next_beams", 1, &k, HS_INT64, &ob)))
        goto fail;
    size_t wsb = hs_expand_workspace_bytes(B, k, Vd);
    if (!(ws = hs_workspace(wsb))) goto fail;
    HS_CALL(hs_expand(lg->data, (hs_dtype)lg->dtype, 1, B, Vd, sc->data, (hs_dtype)sc->dtype, nd->data,
                     (hs_dtype)nd->dtype, k, d2t ? d2t->data : NULL, d2t ? (hs_dtype)d2t->dtype : HS_INT64, off,
                     (int64_t *)ot->data, (float *)os->data, (int64_t *)op_->data, (float *)oe->data,
                     (int64_t *)ob->data, ws, wsb, &err));
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    return Py_BuildValue("(NNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4]);
fail:
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    for (int i = 0; i < 5; i++) Py_XDECREF(outs[i]);
    return NULL;
}

/* ---- select(scores, n, alloc) -> out --------------------------------------------------------------- */

static PyObject *py_select(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "select";
    PyObject *o_scores, *o_n, *alloc, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOO", &o_scores, &o_n, &alloc)) return NULL;
    int64_t n;
    if (hs_parse_i64(o_n, op, "n", &n) < 0) return NULL;
    hs_views vs = {.n = 0};
    void *ws = NULL;
    hs_view *sc, *ov;
    if (!(sc = hs_views_add(&vs, o_scores, op, "scores", 0)) || hs_check_ndim(sc, op, "scores", 1, "[M]") < 0 ||
        hs_check_dtype(sc, op, "scores", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    int64_t M = sc->shape[0];
    if (n < 0 || n > M) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected 0 <= n <= M = %lld, got %lld", op, (long long)M,
                     (long long)n);
        goto fail;
    }
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 1, &n, HS_INT64, &ov))) goto fail;
    size_t wsb = hs_select_workspace_bytes(M);
    if (!(ws = hs_workspace(wsb))) goto fail;
    HS_CALL(hs_select(sc->data, (hs_dtype)sc->dtype, 1, M, NULL, &n, n, (int64_t *)ov->data, ws, wsb, &err));
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    return out;
fail:
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    Py_XDECREF(out);
    return NULL;
}

/* ---- build_tree(tokens, parents, selected, root_token, alloc) -> 5 arrays -------------------------- */

static PyObject *py_build_tree(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "build_tree";
    PyObject *o_tok, *o_par, *o_sel, *o_root, *alloc;
    PyObject *outs[5] = {NULL, NULL, NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OOOOO", &o_tok, &o_par, &o_sel, &o_root, &alloc)) return NULL;
    int64_t root;
    if (hs_parse_i64(o_root, op, "root_token", &root) < 0) return NULL;
    hs_views vs = {.n = 0};
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
    size_t wsb = hs_build_tree_workspace_bytes(M), wsr = hs_tree_retrieve_workspace_bytes(T);
    if (!(ws = hs_workspace(wsb > wsr ? wsb : wsr))) goto fail;
    int64_t leaves = 0, depth = 0;
    HS_CALL(hs_build_tree(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, M, se->data, (hs_dtype)se->dtype, n, &n, &root,
                         (int64_t *)ot->data, (int64_t *)opa->data, (int64_t *)od->data, (uint8_t *)om->data,
                         &leaves, &depth, ws, wsb, &err));
    int64_t LD[2] = {leaves, depth + 1};
    if (!(outs[4] = hs_views_alloc(&vs, alloc, op, "retrieve", 2, LD, HS_INT64, &orr))) goto fail;
    HS_CALL(hs_tree_retrieve((int64_t *)opa->data, (int64_t *)od->data, 1, T, &T, LD[0], LD[1], (int64_t *)orr->data,
                            ws, wsr, &err));
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    return Py_BuildValue("(NNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4]);
fail:
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    for (int i = 0; i < 5; i++) Py_XDECREF(outs[i]);
    return NULL;
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

/* path[:len] as a view of the allocated path (works for NumPy and torch alike) */
static PyObject *hs_path_slice(PyObject *path, int64_t len) {
    return PySequence_GetSlice(path, 0, (Py_ssize_t)len);
}

static PyObject *py_verify_greedy(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "verify_greedy";
    PyObject *o_tok, *o_par, *o_lg, *alloc, *path = NULL;
    if (!PyArg_ParseTuple(args, "OOOO", &o_tok, &o_par, &o_lg, &alloc)) return NULL;
    hs_views vs = {.n = 0};
    hs_view *tk, *pa, *lg, *opath;
    if (hs_verify_args(&vs, op, o_tok, o_par, o_lg, &tk, &pa, &lg) < 0) goto fail;
    int64_t n = tk->shape[0], V = lg->shape[1], len = 0, next = 0;
    if (!(path = hs_views_alloc(&vs, alloc, op, "path", 1, &n, HS_INT64, &opath))) goto fail;
    HS_CALL(hs_verify_greedy(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, n, &n, lg->data, (hs_dtype)lg->dtype, V,
                            (int64_t *)opath->data, &len, &next, &err));
    hs_views_release(&vs);
    PyObject *sl = hs_path_slice(path, len);
    Py_DECREF(path);
    return sl ? Py_BuildValue("(NL)", sl, (long long)next) : NULL;
fail:
    hs_views_release(&vs);
    Py_XDECREF(path);
    return NULL;
}

static PyObject *py_verify_sample(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "verify_sample";
    PyObject *o_tok, *o_par, *o_lg, *o_temp, *o_topk, *o_topp, *o_seed, *o_off, *alloc, *path = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &o_tok, &o_par, &o_lg, &o_temp, &o_topk, &o_topp, &o_seed, &o_off,
                          &alloc))
        return NULL;
    hs_sampling sp;
    uint64_t seed, offset;
    if (hs_parse_f64(o_temp, op, "temperature", &sp.temperature) < 0 || hs_parse_i64(o_topk, op, "top_k", &sp.top_k) < 0 ||
        hs_parse_f64(o_topp, op, "top_p", &sp.top_p) < 0 || hs_parse_u64(o_seed, op, "seed", &seed) < 0 ||
        hs_parse_u64(o_off, op, "offset", &offset) < 0)
        return NULL;
    hs_views vs = {.n = 0};
    void *ws = NULL;
    hs_view *tk, *pa, *lg, *opath;
    if (hs_verify_args(&vs, op, o_tok, o_par, o_lg, &tk, &pa, &lg) < 0) goto fail;
    int64_t n = tk->shape[0], V = lg->shape[1], len = 0, next = 0, draws = 0;
    if (!(path = hs_views_alloc(&vs, alloc, op, "path", 1, &n, HS_INT64, &opath))) goto fail;
    size_t wsb = hs_verify_sample_workspace_bytes(n, V);
    if (!(ws = hs_workspace(wsb))) goto fail;
    HS_CALL(hs_verify_sample(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, 1, n, &n, lg->data, (hs_dtype)lg->dtype, V, sp,
                            &seed, &offset, (int64_t *)opath->data, &len, &next, &draws, ws, wsb, &err));
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    PyObject *sl = hs_path_slice(path, len);
    Py_DECREF(path);
    return sl ? Py_BuildValue("(NLL)", sl, (long long)next, (long long)draws) : NULL;
fail:
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    Py_XDECREF(path);
    return NULL;
}

/* ---- kv_compact(tensors, prefix_len, slots) -------------------------------------------------------- */

static PyObject *py_kv_compact(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "kv_compact";
    PyObject *o_tensors, *o_prefix, *o_slots;
    if (!PyArg_ParseTuple(args, "OOO", &o_tensors, &o_prefix, &o_slots)) return NULL;
    int64_t prefix;
    if (hs_parse_i64(o_prefix, op, "prefix_len", &prefix) < 0) return NULL;
    if (PyUnicode_Check(o_tensors) || !PySequence_Check(o_tensors) || PyObject_HasAttrString(o_tensors, "__dlpack__") ||
        PyArray_Check(o_tensors)) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'tensors' expected a list or tuple of arrays, got %s", op,
                     Py_TYPE(o_tensors)->tp_name);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(o_tensors, "kv_compact: argument 'tensors' expected a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    hs_view *views = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(hs_view));
    Py_ssize_t imported = 0;
    hs_views vs = {.n = 0};
    hs_view *sl;
    PyObject *result = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (!(sl = hs_views_add(&vs, o_slots, op, "slots", 0)) || hs_check_ndim(sl, op, "slots", 1, "[m]") < 0 ||
        hs_check_dtype(sl, op, "slots", HS_ID_DTYPES, "int32 or int64") < 0)
        goto fail;
    int64_t m = sl->shape[0];
    char name[48];
    for (Py_ssize_t i = 0; i < count; i++) {
        snprintf(name, sizeof name, "tensors[%zd]", i);
        hs_view *v = &views[i];
        if (hs_view_import(PySequence_Fast_GET_ITEM(seq, i), op, name, 1, v) < 0) goto fail;
        imported = i + 1;
        if (hs_check_same_device(v, sl, op, name, "slots") < 0) goto fail;
        if (v->ndim < 2) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an array [..., S, D] with ndim >= 2, got ndim %d",
                         op, name, v->ndim);
            goto fail;
        }
        /* a tensor listed twice, or overlapping another, would be compacted twice: silent garbage */
        const char *lo = (const char *)v->data, *hi = lo + hs_view_nbytes(v);
        for (Py_ssize_t j = 0; j < i; j++) {
            const char *lo2 = (const char *)views[j].data, *hi2 = lo2 + hs_view_nbytes(&views[j]);
            if (lo < hi2 && lo2 < hi) {
                PyErr_Format(PyExc_ValueError,
                             "%s: argument '%s' expected tensors that do not overlap in memory, got memory shared "
                             "with tensors[%zd]",
                             op, name, j);
                goto fail;
            }
        }
        /* validate against this tensor's S before any tensor is modified */
        hs_error err;
        hs_status st = hs_kv_compact_check(1, v->shape[v->ndim - 2], &prefix, sl->data, (hs_dtype)sl->dtype, m, &m, &err);
        if (st != HS_OK) {
            hs_raise(st, &err);
            goto fail;
        }
    }
    /* every tensor validated: now move the rows */
    for (Py_ssize_t i = 0; i < count; i++) {
        hs_view *v = &views[i];
        int64_t inner = 1;
        for (int d = 0; d < v->ndim - 2; d++) inner *= v->shape[d];
        int64_t S = v->shape[v->ndim - 2], row = v->shape[v->ndim - 1] * v->itemsize;
        HS_CALL(hs_kv_compact(v->data, 1, inner, S, row, &prefix, sl->data, (hs_dtype)sl->dtype, m, &m, &err));
    }
    result = Py_NewRef(Py_None);
fail:
    for (Py_ssize_t i = 0; i < imported && views; i++) hs_view_release(&views[i]);
    PyMem_Free(views);
    hs_views_release(&vs);
    Py_DECREF(seq);
    return result;
}

/* ---- bucketize(values, thresholds, alloc) -> out --------------------------------------------------- */

static PyObject *py_bucketize(PyObject *self, PyObject *args) {
    (void)self;
    static const char op[] = "bucketize";
    PyObject *o_vals, *o_thr, *alloc, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOO", &o_vals, &o_thr, &alloc)) return NULL;
    hs_views vs = {.n = 0};
    hs_view *va, *th, *ov;
    if (!(va = hs_views_add(&vs, o_vals, op, "values", 0)) || hs_check_ndim(va, op, "values", 1, "[N]") < 0 ||
        hs_check_dtype(va, op, "values", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    if (!(th = hs_views_add(&vs, o_thr, op, "thresholds", 0)) || hs_check_ndim(th, op, "thresholds", 1, "[T]") < 0 ||
        hs_check_dtype(th, op, "thresholds", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    int64_t N = va->shape[0];
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 1, &N, HS_INT32, &ov))) goto fail;
    HS_CALL(hs_bucketize(va->data, (hs_dtype)va->dtype, N, th->data, (hs_dtype)th->dtype, th->shape[0],
                        (int32_t *)ov->data, &err));
    hs_views_release(&vs);
    return out;
fail:
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
    hs_views vs = {.n = 0};
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
    return Py_BuildValue("{s:O,s:s,s:s,s:s,s:O,s:O}", "cuda", Py_False, "version", hs_version_string(), "compiler",
#if defined(__clang__)
                         "clang " __clang_version__,
#elif defined(__GNUC__)
                         "gcc " __VERSION__,
#else
                         "unknown",
#endif
                         "numpy_min_runtime", NPY_FEATURE_VERSION_STRING, "sanitizers",
#if defined(HS_SANITIZE)
                         Py_True,
#else
                         Py_False,
#endif
                         "cuda_archs", Py_None);
}

static PyMethodDef hs_methods[] = {
    {"topk_entropy", py_topk_entropy, METH_VARARGS, "topk_entropy(logits, k, temperature, alloc) -> out"},
    {"expand", py_expand, METH_VARARGS, "expand(logits, beam_scores, beam_nodes, k, d2t, node_offset, alloc)"},
    {"select", py_select, METH_VARARGS, "select(scores, n, alloc) -> out"},
    {"build_tree", py_build_tree, METH_VARARGS, "build_tree(tokens, parents, selected, root_token, alloc)"},
    {"verify_greedy", py_verify_greedy, METH_VARARGS, "verify_greedy(tree_tokens, tree_parents, target_logits, alloc)"},
    {"verify_sample", py_verify_sample, METH_VARARGS,
     "verify_sample(tree_tokens, tree_parents, target_logits, temperature, top_k, top_p, seed, offset, alloc)"},
    {"kv_compact", py_kv_compact, METH_VARARGS, "kv_compact(tensors, prefix_len, slots)"},
    {"bucketize", py_bucketize, METH_VARARGS, "bucketize(values, thresholds, alloc) -> out"},
    {"philox4x32", py_philox4x32, METH_VARARGS, "philox4x32(c0, c1, c2, c3, k0, k1) -> 4 words"},
    {"philox_uniform", py_philox_uniform, METH_VARARGS, "philox_uniform(n, seed, offset, alloc) -> out"},
    {"build_info", py_build_info, METH_NOARGS, "what this extension was compiled with"},
    {NULL, NULL, 0, NULL},
};

static int hs_exec(PyObject *module) {
    (void)module;
    if (PyArray_ImportNumPyAPI() < 0) return -1;
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
