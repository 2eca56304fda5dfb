/*
 * call.c -- the machinery every binding function shares (declared and explained in call.h).
 */
#include "call.h"

PyObject *hs_cuda_error_type;

/* ---- the arrays of one call ------------------------------------------------------------------------------- */

void hs_views_release(hs_views *vs) {
    for (int i = 0; i < vs->n; i++) hs_view_release(&vs->v[i]);
    vs->n = 0;
}

hs_view *hs_views_add(hs_views *vs, PyObject *obj, const char *op, const char *arg, int writable) {
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

hs_view *hs_views_first(hs_views *vs, PyObject *obj, const char *op, const char *arg, PyObject *batched, int ndim) {
    hs_view *v = hs_views_add(vs, obj, op, arg, 0);
    if (v == NULL) return NULL;
    vs->lead = batched == Py_None ? v->ndim != ndim : batched != Py_True;
    if (vs->lead) hs_view_lead(v);
    return v;
}

hs_view *hs_views_req(hs_views *vs, PyObject *obj, const char *op, const char *arg, int writable) {
    hs_view *v = hs_views_add(vs, obj, op, arg, writable);
    if (v != NULL && vs->lead) hs_view_lead(v);
    return v;
}

hs_view *hs_views_rows(hs_views *vs, PyObject *obj, const char *op, const char *arg, int64_t B, const char *layout,
                       const char *dtype, const char *why) {
    hs_view *v = hs_views_add(vs, obj, op, arg, 0);
    if (v == NULL || hs_check_array(v, op, arg, 1, layout, HS_MASK(HS_INT64), dtype) < 0 ||
        hs_check_dim(v, op, arg, 0, B, why) < 0)
        return NULL;
    return v;
}

PyObject *hs_views_alloc(hs_views *vs, PyObject *alloc, const char *op, const char *arg, int ndim, const int64_t *shape,
                         hs_dtype dtype, hs_view **out) {
    const int lead = vs->lead; /* allocate without the batch dimension of 1, then view the output with it */
    PyObject *shp = PyTuple_New(ndim - lead);
    if (shp == NULL) return NULL;
    for (int i = lead; i < ndim; i++) PyTuple_SET_ITEM(shp, i - lead, PyLong_FromLongLong((long long)shape[i]));
    PyObject *arr = PyObject_CallFunction(alloc, "Os", shp, hs_dtype_name(dtype));
    Py_DECREF(shp);
    if (arr == NULL) return NULL;
    hs_view *v = hs_views_add(vs, arr, op, arg, 1);
    if (v != NULL && lead) hs_view_lead(v);
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

int hs_is_array(PyObject *obj) {
    return !PyLong_Check(obj) && !PyArray_IsScalar(obj, Generic) &&
           (PyArray_Check(obj) || PyObject_HasAttrString(obj, "__dlpack__"));
}

int64_t *hs_i64buf_get(hs_i64buf *b, int64_t n) {
    b->p = n <= (int64_t)(sizeof b->local / sizeof b->local[0]) ? b->local : PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (b->p == NULL) PyErr_NoMemory();
    return b->p;
}

void hs_i64buf_free(hs_i64buf *b) {
    if (b->p != b->local) PyMem_Free(b->p);
    b->p = NULL;
}

/* ---- scalars ---------------------------------------------------------------------------------------------- */

int hs_nargs(const char *op, Py_ssize_t nargs, Py_ssize_t expected) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", op, expected, nargs);
    return -1;
}

/* obj as a Python int (a new reference), or NULL with a TypeError naming the argument (bools are refused). */
static PyObject *hs_index(PyObject *obj, const char *op, const char *arg) {
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected an int, got %s", op, arg, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return PyNumber_Index(obj);
}

int hs_parse_i64(PyObject *obj, const char *op, const char *arg, int64_t *out) {
    PyObject *idx = hs_index(obj, op, arg);
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

int hs_parse_u64(PyObject *obj, const char *op, const char *arg, uint64_t *out) {
    PyObject *idx = hs_index(obj, op, arg);
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

int hs_parse_f64(PyObject *obj, const char *op, const char *arg, double *out) {
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

int hs_parse_flag(PyObject *obj, const char *op, const char *arg, int *out) {
    if (!PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected a bool, got %s", op, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = obj == Py_True;
    return 0;
}

/* ---- errors and the core call ----------------------------------------------------------------------------- */

void hs_raise(hs_status st, const hs_error *err) {
    PyObject *type = st == HS_ERR_DTYPE       ? PyExc_TypeError
                     : st == HS_ERR_WORKSPACE ? PyExc_SystemError
                     : st == HS_ERR_CUDA      ? hs_cuda_error_type
                                              : PyExc_ValueError;
    PyErr_SetString(type, err->msg);
}

int hs_release_gil = 1;

PyObject *py_set_release_gil(PyObject *self, PyObject *arg) {
    (void)self;
    int flag = PyObject_IsTrue(arg);
    if (flag < 0) return NULL;
    int before = hs_release_gil;
    hs_release_gil = flag;
    return PyBool_FromLong(before);
}

void *hs_workspace(size_t bytes) {
    void *p = PyMem_RawMalloc(bytes ? bytes : 1);
    if (p == NULL) PyErr_NoMemory();
    return p;
}

/* ---- the CUDA side of a call ------------------------------------------------------------------------------- */

int hs_gpu_begin(hs_gpu *g, hs_view *ref, PyObject *o_stream, const char *op) {
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

int hs_gpu_end(hs_gpu *g, const char *op, int check) {
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
void *hs_gpu_workspace(hs_gpu *g, size_t bytes) {
    hs_error err;
    void *ws = hs_cuda_workspace(g->dev, HS_WS_COUNTERS + bytes, g->stream, &err);
    if (ws == NULL) hs_raise(HS_ERR_VALUE, &err);
    return ws;
}

int hs_gpu_read(hs_gpu *g, const char *op, const char *why, const int64_t *dev, int64_t *host, int n) {
    if (hs_gpu_sync(g, op, why) < 0) return -1;
    hs_error err;
    if (hs_cuda_memcpy_d2h(host, dev, (size_t)n * sizeof(int64_t), g->stream, &err) != HS_OK) {
        hs_raise(HS_ERR_CUDA, &err);
        return -1;
    }
    return 0;
}
#endif

