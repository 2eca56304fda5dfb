/*
 * view.c -- tensor import for the binding.
 *
 * Order of attempts (cheapest first, all zero-copy):
 *   1. a NumPy ndarray, read through the NumPy C API;
 *   2. any object with __dlpack__ (torch, JAX, CuPy, NumPy): a versioned capsule is requested with
 *      max_version=(1, 0); producers that predate it raise TypeError and are asked again without
 *      arguments for a legacy capsule.  We take ownership the way the DLPack spec says: rename the
 *      capsule to used_dltensor[_versioned] and call the managed tensor's deleter when done;
 *   3. the buffer protocol (memoryview, array.array, old NumPy).
 * Nothing is ever copied: a non-contiguous input is refused, because a silent copy would also make an
 * in-place op (kv_compact) write into the copy.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL HS_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "view.h"

#include <numpy/arrayobject.h>
#include <stdint.h>
#include <string.h>

#include "dlpack.h"

static void hs_set_dtype(hs_view *v, int dtype, const char *name) {
    v->dtype = dtype;
    snprintf(v->dtype_name, sizeof v->dtype_name, "%s", name);
}

static const char *hs_device_name(int type) {
    switch (type) {
    case HS_DL_CPU: return "cpu";
    case HS_DL_CUDA: return "cuda";
    case HS_DL_CUDA_HOST: return "cuda_host";
    case HS_DL_ROCM: return "rocm";
    case HS_DL_CUDA_MANAGED: return "cuda_managed";
    default: return "device";
    }
}

/* The caller's shape, as Python writes a tuple (without the batch dimension the binding added). */
static void hs_shape_str(const hs_view *v, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "(");
    for (int i = v->lead; i < v->ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, i > v->lead ? ", %lld" : "%lld", (long long)v->shape[i]);
    if (used < n) snprintf(buf + used, n - used, v->ndim - v->lead == 1 ? ",)" : ")");
}

/* ---- NumPy ----------------------------------------------------------------------------------------- */

static int hs_import_numpy(PyArrayObject *a, const char *op, const char *arg, int writable, hs_view *v) {
    int nd = PyArray_NDIM(a);
    if (nd > HS_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected at most %d dimensions, got %d", op, arg,
                     HS_MAX_NDIM, nd);
        return -1;
    }
    PyArray_Descr *d = PyArray_DESCR(a);
    int kind = d->kind;
    int64_t size = (int64_t)PyDataType_ELSIZE(d);
    if (!PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected native byte order, got a byte-swapped array",
                     op, arg);
        return -1;
    }
    if (kind == 'f' && size == 4) hs_set_dtype(v, HS_FLOAT32, "float32");
    else if (kind == 'f' && size == 2) hs_set_dtype(v, HS_FLOAT16, "float16");
    else if (kind == 'f' && size == 8) hs_set_dtype(v, HS_FLOAT64, "float64");
    else if (kind == 'i' && size == 4) hs_set_dtype(v, HS_INT32, "int32");
    else if (kind == 'i' && size == 8) hs_set_dtype(v, HS_INT64, "int64");
    else if (kind == 'b' && size == 1) hs_set_dtype(v, HS_BOOL, "bool");
    else {
        PyObject *s = PyObject_Str((PyObject *)d);
        hs_set_dtype(v, HS_DTYPE_OTHER, s ? PyUnicode_AsUTF8(s) : "unknown");
        Py_XDECREF(s);
        PyErr_Clear();
    }
    v->itemsize = size;
    v->ndim = nd;
    for (int i = 0; i < nd; i++) v->shape[i] = (int64_t)PyArray_DIM(a, i);
    if (!PyArray_IS_C_CONTIGUOUS(a)) {
        char shp[160];
        hs_shape_str(v, shp, sizeof shp);
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' expected a C-contiguous array, got a strided view of shape %s "
                     "(call np.ascontiguousarray / .contiguous() first)",
                     op, arg, shp);
        return -1;
    }
    if (writable && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_BufferError, "%s: argument '%s' expected a writeable array, got a read-only one", op, arg);
        return -1;
    }
    v->data = PyArray_DATA(a);
    v->device_type = HS_DL_CPU;
    v->device_id = 0;
    v->readonly = !PyArray_ISWRITEABLE(a);
    v->source = HS_SRC_NUMPY;
    Py_INCREF(a);
    v->owner = (PyObject *)a;
    return 0;
}

/* ---- DLPack ---------------------------------------------------------------------------------------- */

static int hs_import_dltensor(const HSDLTensor *t, const char *op, const char *arg, hs_view *v) {
    if (t->ndim < 0 || t->ndim > HS_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected at most %d dimensions, got %d", op, arg,
                     HS_MAX_NDIM, (int)t->ndim);
        return -1;
    }
    if (t->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected a scalar dtype (lanes == 1), got %d lanes", op,
                     arg, (int)t->dtype.lanes);
        return -1;
    }
    int code = t->dtype.code, bits = t->dtype.bits;
    if (code == HS_DL_FLOAT && bits == 32) hs_set_dtype(v, HS_FLOAT32, "float32");
    else if (code == HS_DL_FLOAT && bits == 16) hs_set_dtype(v, HS_FLOAT16, "float16");
    else if (code == HS_DL_FLOAT && bits == 64) hs_set_dtype(v, HS_FLOAT64, "float64");
    else if (code == HS_DL_BFLOAT && bits == 16) hs_set_dtype(v, HS_BFLOAT16, "bfloat16");
    else if (code == HS_DL_INT && bits == 32) hs_set_dtype(v, HS_INT32, "int32");
    else if (code == HS_DL_INT && bits == 64) hs_set_dtype(v, HS_INT64, "int64");
    else if (code == HS_DL_BOOL && bits == 8) hs_set_dtype(v, HS_BOOL, "bool");
    else {
        static const char *names[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
        char nm[24];
        snprintf(nm, sizeof nm, "%s%d", code >= 0 && code <= 6 ? names[code] : "code?", bits);
        hs_set_dtype(v, HS_DTYPE_OTHER, nm);
    }
    v->itemsize = (bits + 7) / 8;
    v->ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++) v->shape[i] = t->shape[i];
    if (t->strides != NULL) {
        /* compact row-major, ignoring the stride of size-1 dimensions and anything of a zero-size tensor */
        int64_t expected = 1, numel = 1;
        for (int i = 0; i < t->ndim; i++) numel *= t->shape[i];
        for (int i = t->ndim - 1; i >= 0 && numel > 0; i--) {
            if (t->shape[i] != 1 && t->strides[i] != expected) {
                char shp[160];
                hs_shape_str(v, shp, sizeof shp);
                PyErr_Format(PyExc_ValueError,
                             "%s: argument '%s' expected a C-contiguous tensor, got a strided view of shape %s "
                             "(call .contiguous() first)",
                             op, arg, shp);
                return -1;
            }
            expected *= t->shape[i];
        }
    }
    v->data = (char *)t->data + t->byte_offset;
    v->device_type = t->device.device_type;
    v->device_id = t->device.device_id;
    return 0;
}

static void hs_call_deleter(hs_view *v) {
    if (v->managed == NULL) return;
    /* A deleter may run Python code (a ctypes/cffi producer, a refcount drop with a finaliser); it must
     * not see, or clobber, the exception we may be about to raise. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (v->source == HS_SRC_DLPACK_V1) {
        HSDLManagedTensorVersioned *m = (HSDLManagedTensorVersioned *)v->managed;
        if (m->deleter) m->deleter(m);
    } else {
        HSDLManagedTensor *m = (HSDLManagedTensor *)v->managed;
        if (m->deleter) m->deleter(m);
    }
    v->managed = NULL;
    if (PyErr_Occurred()) PyErr_WriteUnraisable(NULL); /* a failing deleter must not mask our result */
    PyErr_Restore(type, value, tb);
}

/* The DLPack stream argument for obj: its device is asked first, and only CUDA/ROCm producers get one. */
static PyObject *hs_dlpack_stream_for(PyObject *obj, PyObject *stream) {
    if (stream == NULL || stream == Py_None) return NULL;
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (dev == NULL) {
        PyErr_Clear();
        return NULL;
    }
    long type = 0;
    if (PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) >= 1) type = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
    Py_DECREF(dev);
    PyErr_Clear();
    if (type != HS_DL_CUDA && type != HS_DL_ROCM && type != HS_DL_CUDA_MANAGED) return NULL;
    long long s = PyLong_AsLongLong(stream);
    if (s == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    return PyLong_FromLongLong(s == 0 ? 1 : s);
}

/* torch tensors: torch._C._to_dlpack costs ~0.35 us where Tensor.__dlpack__ (a Python method that checks
 * its arguments and orders the consumer's stream after the current one) costs ~3.5 us, and an eager op
 * imports 3-5 tensors.  The direct call is taken only where __dlpack__ would add nothing: an exact
 * torch.Tensor that does not require grad (__dlpack__ refuses those), on the CPU, or on CUDA when the call
 * runs on torch's current stream of the tensor's device (every op's default), so no ordering is needed.
 * Anything else, or any error on the way, takes the protocol below. */
static PyObject *hs_torch_tensor, *hs_torch_to_dlpack, *hs_torch_raw_stream;
static int hs_torch_resolved;

static void hs_torch_resolve(void) {
    if (hs_torch_resolved) return;
    PyObject *name = PyUnicode_FromString("torch");
    PyObject *torch = name ? PyImport_GetModule(name) : NULL; /* only once torch is imported */
    Py_XDECREF(name);
    if (torch == NULL) {
        PyErr_Clear();
        return;
    }
    hs_torch_resolved = 1;
    PyObject *C = PyObject_GetAttrString(torch, "_C");
    hs_torch_tensor = PyObject_GetAttrString(torch, "Tensor");
    hs_torch_to_dlpack = C ? PyObject_GetAttrString(C, "_to_dlpack") : NULL;
    hs_torch_raw_stream = C ? PyObject_GetAttrString(C, "_cuda_getCurrentRawStream") : NULL; /* CUDA builds */
    PyErr_Clear();
    Py_XDECREF(C);
    Py_DECREF(torch);
    if (hs_torch_tensor && !PyType_Check(hs_torch_tensor)) Py_CLEAR(hs_torch_tensor);
}

static PyObject *hs_torch_capsule(PyObject *obj, PyObject *stream) {
    hs_torch_resolve();
    if (hs_torch_tensor == NULL || hs_torch_to_dlpack == NULL || (PyObject *)Py_TYPE(obj) != hs_torch_tensor) return NULL;
    PyObject *grad = PyObject_GetAttrString(obj, "requires_grad");
    int needs_grad = grad ? PyObject_IsTrue(grad) : -1;
    Py_XDECREF(grad);
    PyObject *dev = needs_grad == 0 ? PyObject_CallMethod(obj, "get_device", NULL) : NULL;
    long d = dev ? PyLong_AsLong(dev) : -2;
    Py_XDECREF(dev);
    if (d == -2 || PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    if (d >= 0) { /* CUDA: only on torch's current stream of that device */
        if (hs_torch_raw_stream == NULL || stream == NULL || stream == Py_None) return NULL;
        PyObject *cur = PyObject_CallFunction(hs_torch_raw_stream, "l", d);
        int same = cur ? PyObject_RichCompareBool(cur, stream, Py_EQ) : -1;
        Py_XDECREF(cur);
        if (same != 1) {
            PyErr_Clear();
            return NULL;
        }
    }
    PyObject *capsule = PyObject_CallOneArg(hs_torch_to_dlpack, obj);
    if (capsule == NULL) PyErr_Clear();
    return capsule;
}

static int hs_import_dlpack(PyObject *obj, PyObject *method, const char *op, const char *arg, int writable,
                            PyObject *stream, hs_view *v) {
    /* ask for a versioned capsule (with our stream for device producers); legacy producers raise
     * TypeError on the keywords and are asked again with fewer */
    PyObject *capsule = hs_torch_capsule(obj, stream);
    if (capsule != NULL) goto imported;
    PyObject *dl_stream = hs_dlpack_stream_for(obj, stream);
    PyObject *empty = PyTuple_New(0);
    PyObject *kwargs = dl_stream ? Py_BuildValue("{s:(ii),s:O}", "max_version", 1, 0, "stream", dl_stream)
                                 : Py_BuildValue("{s:(ii)}", "max_version", 1, 0);
    capsule = (kwargs && empty) ? PyObject_Call(method, empty, kwargs) : NULL;
    Py_XDECREF(kwargs);
    if (capsule == NULL && dl_stream && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        kwargs = Py_BuildValue("{s:O}", "stream", dl_stream);
        capsule = (kwargs && empty) ? PyObject_Call(method, empty, kwargs) : NULL;
        Py_XDECREF(kwargs);
    }
    Py_XDECREF(empty);
    Py_XDECREF(dl_stream);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        capsule = PyObject_CallNoArgs(method);
    }
    if (capsule == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *msg = value ? PyObject_Str(value) : NULL;
        PyErr_Format(PyExc_BufferError, "%s: argument '%s' could not be exported through DLPack by %s: %s", op,
                     arg, Py_TYPE(obj)->tp_name, msg ? PyUnicode_AsUTF8(msg) : "unknown error");
        Py_XDECREF(msg);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
imported:;
    int rc = -1;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        HSDLManagedTensorVersioned *m =
            (HSDLManagedTensorVersioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (m->version.major != 1) {
            PyErr_Format(PyExc_BufferError, "%s: argument '%s' expected DLPack major version 1, got %u.%u", op, arg,
                         m->version.major, m->version.minor);
            goto done; /* the capsule keeps its name, so its destructor calls the deleter */
        }
        if (PyCapsule_SetName(capsule, "used_dltensor_versioned") < 0) goto done;
        v->managed = m;
        v->source = HS_SRC_DLPACK_V1;
        v->readonly = (m->flags & HS_DL_FLAG_READ_ONLY) != 0;
        if (hs_import_dltensor(&m->dl_tensor, op, arg, v) < 0) goto done;
    } else if (PyCapsule_IsValid(capsule, "dltensor")) {
        HSDLManagedTensor *m = (HSDLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
        if (PyCapsule_SetName(capsule, "used_dltensor") < 0) goto done;
        v->managed = m;
        v->source = HS_SRC_DLPACK;
        v->readonly = 0; /* the legacy protocol has no read-only flag */
        if (hs_import_dltensor(&m->dl_tensor, op, arg, v) < 0) goto done;
    } else {
        PyErr_Format(PyExc_BufferError,
                     "%s: argument '%s' expected __dlpack__ to return a 'dltensor' capsule, got %s", op, arg,
                     Py_TYPE(capsule)->tp_name);
        goto done;
    }
    if (writable && v->readonly) {
        PyErr_Format(PyExc_BufferError, "%s: argument '%s' expected a writable tensor, got a read-only DLPack export",
                     op, arg);
        goto done;
    }
    rc = 0;
done:
    if (rc < 0) hs_call_deleter(v);
    Py_DECREF(capsule);
    return rc;
}

/* ---- buffer protocol ------------------------------------------------------------------------------- */

static int hs_import_buffer(PyObject *obj, const char *op, const char *arg, int writable, hs_view *v) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &v->buffer, flags) < 0) {
        if (writable && PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_BufferError, "%s: argument '%s' expected a writable buffer, got a read-only %s", op,
                         arg, Py_TYPE(obj)->tp_name);
            return -1;
        }
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' expected an array or tensor (NumPy array, torch tensor, or an object with "
                     "__dlpack__ or the buffer protocol), got %s",
                     op, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    v->source = HS_SRC_BUFFER;
    Py_buffer *b = &v->buffer;
    if (b->ndim > HS_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected at most %d dimensions, got %d", op, arg,
                     HS_MAX_NDIM, b->ndim);
        return -1;
    }
    v->itemsize = b->itemsize;
    v->ndim = b->ndim;
    for (int i = 0; i < b->ndim; i++) v->shape[i] = b->shape ? (int64_t)b->shape[i] : (int64_t)(b->len / b->itemsize);
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    char c = *f;
    int64_t sz = b->itemsize;
    if (f[0] && f[1]) c = 0; /* structured formats are not arrays of numbers */
    if (c == 'f' && sz == 4) hs_set_dtype(v, HS_FLOAT32, "float32");
    else if (c == 'e' && sz == 2) hs_set_dtype(v, HS_FLOAT16, "float16");
    else if (c == 'd' && sz == 8) hs_set_dtype(v, HS_FLOAT64, "float64");
    else if ((c == 'i' || c == 'l') && sz == 4) hs_set_dtype(v, HS_INT32, "int32");
    else if ((c == 'l' || c == 'q') && sz == 8) hs_set_dtype(v, HS_INT64, "int64");
    else if (c == '?' && sz == 1) hs_set_dtype(v, HS_BOOL, "bool");
    else {
        char nm[24];
        snprintf(nm, sizeof nm, "format '%.8s'", b->format ? b->format : "B");
        hs_set_dtype(v, HS_DTYPE_OTHER, nm);
    }
    if (!PyBuffer_IsContiguous(b, 'C')) {
        char shp[160];
        hs_shape_str(v, shp, sizeof shp);
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected a C-contiguous buffer, got a strided one of shape %s",
                     op, arg, shp);
        return -1;
    }
    v->data = b->buf;
    v->device_type = HS_DL_CPU;
    v->readonly = b->readonly;
    return 0;
}

int hs_view_import(PyObject *obj, const char *op, const char *arg, int writable, PyObject *stream, hs_view *v) {
    memset(v, 0, sizeof *v);
    int rc;
    if (PyArray_Check(obj)) {
        rc = hs_import_numpy((PyArrayObject *)obj, op, arg, writable, v);
    } else {
        PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
        if (method == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
            PyErr_Clear();
        }
        if (method != NULL) {
            rc = hs_import_dlpack(obj, method, op, arg, writable, stream, v);
            Py_DECREF(method);
        } else {
            rc = hs_import_buffer(obj, op, arg, writable, v);
        }
    }
    if (rc < 0) {
        hs_view_release(v);
        return -1;
    }
    /* Elements are read as their C type: an address off its item alignment (a NumPy view at an odd byte offset,
     * say) would be undefined behaviour here and a fault on a GPU -- refused, never copied (see above). */
    int64_t numel = 1;
    for (int i = 0; i < v->ndim; i++) numel *= v->shape[i];
    int64_t align = v->itemsize < 8 ? v->itemsize : 8;
    if (numel > 0 && align > 1 && (uintptr_t)v->data % (uintptr_t)align != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' expected an array aligned to its %lld-byte items, got one at an address %lld "
                     "bytes off (a view at an odd byte offset: np.array(x) / x.clone() copies it to aligned memory)",
                     op, arg, (long long)align, (long long)((uintptr_t)v->data % (uintptr_t)align));
        hs_view_release(v);
        return -1;
    }
    return 0;
}

void hs_view_release(hs_view *v) {
    switch (v->source) {
    case HS_SRC_NUMPY: Py_CLEAR(v->owner); break;
    case HS_SRC_DLPACK:
    case HS_SRC_DLPACK_V1: hs_call_deleter(v); break;
    case HS_SRC_BUFFER: PyBuffer_Release(&v->buffer); break;
    case HS_SRC_NONE: break;
    }
    v->source = HS_SRC_NONE;
}

/* ---- checks ---------------------------------------------------------------------------------------- */

/* The layout a message names (see view.h): batch-first, or the unbatched spelling for a view with a lead. */
static void hs_layout_str(const char *layout, int lead, char *buf, size_t n) {
    const char *bar = strchr(layout, '|');
    if (!lead) snprintf(buf, n, "%.*s", bar ? (int)(bar - layout) : (int)strlen(layout), layout);
    else if (bar) snprintf(buf, n, "%s", bar + 1);
    else if (strncmp(layout, "[batch, ", 8) == 0) snprintf(buf, n, "[%s", layout + 8);
    else snprintf(buf, n, "%s", layout);
}

int hs_check_ndim(const hs_view *v, const char *op, const char *arg, int ndim, const char *layout) {
    if (v->ndim == ndim) return 0;
    char shp[160], lay[64];
    hs_shape_str(v, shp, sizeof shp);
    hs_layout_str(layout, v->lead, lay, sizeof lay);
    PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected a %d-D array %s, got %d-D with shape %s", op, arg,
                 ndim - v->lead, lay, v->ndim - v->lead, shp);
    return -1;
}

int hs_check_dtype(const hs_view *v, const char *op, const char *arg, unsigned mask, const char *expected) {
    if (v->dtype >= 0 && (mask & HS_MASK(v->dtype))) return 0;
    PyErr_Format(PyExc_TypeError, "%s: argument '%s' expected dtype %s, got %s", op, arg, expected, v->dtype_name);
    return -1;
}

int hs_check_array(const hs_view *v, const char *op, const char *arg, int ndim, const char *layout, unsigned mask,
                   const char *expected) {
    return hs_check_ndim(v, op, arg, ndim, layout) < 0 ? -1 : hs_check_dtype(v, op, arg, mask, expected);
}

int hs_check_dim(const hs_view *v, const char *op, const char *arg, int dim, int64_t expected, const char *why) {
    if (v->shape[dim] == expected) return 0;
    char shp[160];
    hs_shape_str(v, shp, sizeof shp);
    PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected shape[%d] == %lld (%s), got shape %s", op, arg,
                 dim - v->lead, (long long)expected, why, shp);
    return -1;
}

int hs_check_dims(const hs_view *v, const char *op, const char *arg, int64_t d0, const char *why0, int64_t d1,
                  const char *why1) {
    return hs_check_dim(v, op, arg, 0, d0, why0) < 0 ? -1 : hs_check_dim(v, op, arg, 1, d1, why1);
}

#ifdef HS_WITH_CUDA
#include "hs/heterospec_cuda.h"

/* Is cuda:dev usable in this process?  (The count is asked once: it does not change while we run.) */
static int hs_cuda_usable(int dev, const char *op, const char *arg) {
    static int count = -1;
    static char why[160];
    if (count < 0) count = hs_cuda_device_count(why, sizeof why);
    if (dev >= 0 && dev < count) return 0;
    PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected a tensor on a usable device, got cuda:%d (%s)", op, arg,
                 dev, count > 0 ? "no such CUDA device" : why);
    return -1;
}
#endif

int hs_check_same_device(const hs_view *v, const hs_view *ref, const char *op, const char *arg,
                         const char *ref_arg) {
#ifdef HS_WITH_CUDA
    if (v == ref && v->device_type == HS_DL_CUDA && hs_cuda_usable(v->device_id, op, arg) < 0) return -1;
#endif
    int a = v->device_type == HS_DL_CUDA_HOST ? HS_DL_CPU : v->device_type;
    int b = ref->device_type == HS_DL_CUDA_HOST ? HS_DL_CPU : ref->device_type;
    if (a == b && (a == HS_DL_CPU || v->device_id == ref->device_id)) {
        if (a == HS_DL_CPU) return 0;
#ifdef HS_WITH_CUDA
        if (a == HS_DL_CUDA) return 0;
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected a CPU or CUDA tensor, got %s:%d", op, arg,
                     hs_device_name(v->device_type), v->device_id);
#else
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' expected a CPU tensor (this build of heterospec has no CUDA ops), got %s:%d",
                     op, arg, hs_device_name(v->device_type), v->device_id);
#endif
        return -1;
    }
    PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected the device of '%s' (%s:%d), got %s:%d", op, arg,
                 ref_arg, hs_device_name(ref->device_type), ref->device_id, hs_device_name(v->device_type),
                 v->device_id);
    return -1;
}
