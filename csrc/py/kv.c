/*
 * kv.c -- the binding of kv_compact and KVTensors (CPU core: csrc/core/kv.c; kernel: csrc/cuda/kv.cu; NumPy twin:
 * heterospec/reference/kv.py; machinery: call.h).
 *
 * The tensors of a call are an hs_kv_set: imported and validated either per call (a list or tuple) or once,
 * by a KVTensors object that keeps the imports (and the tensors) alive, so that a static cache's per-cycle
 * commit costs no per-tensor import.
 */
#include "call.h"

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
    if (!hs_is_array(o)) {
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

/* kv_compact(tensors or KVTensors, prefix_len, slots [batch, m], stream, check, batched) -> None */
HS_FASTCALL(py_kv_compact) {
    (void)self;
    static const char op[] = "kv_compact";
    if (hs_nargs(op, nargs, 6) < 0) return NULL;
    PyObject *o_tensors = args[0], *o_prefix = args[1], *o_slots = args[2], *o_stream = args[3];
    int check;
    if (hs_parse_flag(args[4], op, "check", &check) < 0) return NULL;
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
    hs_i64buf hbuf = {.p = NULL}; /* prefix lengths [B], then the slot counts [B] */
    int64_t *host;
    PyObject *result = NULL;
    if (!(sl = hs_views_first(&vs, o_slots, op, "slots", args[5], 2))) goto fail;
    if (prepared && ks->device_type != 0) {
        /* slots must live where the prepared tensors do */
        hs_view where;
        memset(&where, 0, sizeof where);
        where.device_type = ks->device_type;
        where.device_id = ks->device_id;
        if (hs_check_same_device(sl, &where, op, "slots", "tensors") < 0) goto fail;
    }
    /* batched: slots [batch, m], every tensor [batch, ..., S, D], prefix_len an int or int64 [batch]; unbatched:
     * slots [m] (a batch of 1), tensors [..., S, D], prefix_len an int or a one-element int64 array */
    const int bt = !vs.lead;
    if (hs_check_array(sl, op, "slots", 2, "[batch, m]", HS_ID_DTYPES, "int32 or int64") < 0)
        goto fail;
    const int64_t B = sl->shape[0], m = sl->shape[1];
    if (!(host = hs_i64buf_get(&hbuf, 2 * (B > 0 ? B : 1)))) goto fail;
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
    hs_i64buf_free(&hbuf);
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

int hs_kv_add_type(PyObject *module) {
    if (PyType_Ready(&hs_kvt_type) < 0) return -1;
    Py_INCREF(&hs_kvt_type);
    if (PyModule_AddObject(module, "KVTensors", (PyObject *)&hs_kvt_type) < 0) {
        Py_DECREF(&hs_kvt_type);
        return -1;
    }
    return 0;
}
