/*
 * info.c -- what heterospec._C says about itself and the CUDA utilities that are no op: build_info, cuda_check,
 * cuda_reserve, cuda_chunks, cuda_set_chunk_min (machinery: call.h).
 */
#include "call.h"

PyObject *py_build_info(PyObject *self, PyObject *args) {
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

/* _emu_blocks() -> the kernel blocks the emulated build has run since it loaded (None in other builds): a launch's
 * grid, seen by tests without a GPU. */
PyObject *py_emu_blocks(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#ifdef HS_WITH_CUDA
    if (hs_cuda_emulated()) return PyLong_FromLongLong(hs_cuda_emu_blocks());
#endif
    Py_RETURN_NONE;
}

#ifndef HS_WITH_CUDA
/* What the CUDA utilities raise in a build without CUDA. */
static PyObject *hs_no_cuda(const char *fn) {
    PyErr_Format(PyExc_ValueError, "%s: this build of heterospec has no CUDA ops", fn);
    return NULL;
}
#endif

/* cuda_check(device, stream): synchronise `stream` on `device` and raise the error a check=False call
 * recorded there, if any. */
PyObject *py_cuda_check(PyObject *self, PyObject *args) {
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
    return hs_no_cuda("cuda_check");
#endif
}

/* cuda_reserve(device, bytes): grow the module workspace now (outside any graph capture); returns (its bytes, the
 * earlier workspaces kept alive for recorded graphs). */
PyObject *py_cuda_reserve(PyObject *self, PyObject *args) {
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
    return hs_no_cuda("cuda_reserve");
#endif
}

/* cuda_new_stream(device): a new non-blocking CUDA stream (cudaStream_t as an int) that heterospec owns and
 * never destroys. */
PyObject *py_cuda_new_stream(PyObject *self, PyObject *args) {
    (void)self;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev)) return NULL;
#ifdef HS_WITH_CUDA
    hs_error err;
    void *s = NULL;
    int prev = hs_cuda_set_device(dev, &err);
    if (prev >= 0) {
        s = hs_cuda_stream_new(&err);
        if (prev != dev) hs_cuda_set_device(prev, &err);
    }
    if (s == NULL) {
        hs_raise(HS_ERR_CUDA, &err);
        return NULL;
    }
    return PyLong_FromVoidPtr(s);
#else
    (void)dev;
    return hs_no_cuda("cuda_new_stream");
#endif
}

/* cuda_set_chunk_min(n): the fewest entries of a split-row chunk from now on (0: the default); returns the old value.
 * For probes that time the ops at several chunk lengths. */
PyObject *py_cuda_set_chunk_min(PyObject *self, PyObject *args) {
    (void)self;
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "cuda_set_chunk_min: argument 'n' expected >= 0 (0: the default), got %lld", n);
        return NULL;
    }
#ifdef HS_WITH_CUDA
    return PyLong_FromLongLong((long long)hs_cuda_set_chunk_min(n));
#else
    return hs_no_cuda("cuda_set_chunk_min");
#endif
}

/* cuda_chunks(rows, V): the chunks the split-row kernels cut each row into (tests: the emulation splits too). */
PyObject *py_cuda_chunks(PyObject *self, PyObject *args) {
    (void)self;
    long long rows, V;
    if (!PyArg_ParseTuple(args, "LL", &rows, &V)) return NULL;
#ifdef HS_WITH_CUDA
    return PyLong_FromLongLong((long long)hs_cuda_chunks(rows, V));
#else
    (void)rows;
    (void)V;
    return hs_no_cuda("cuda_chunks");
#endif
}
