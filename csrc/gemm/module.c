/*
 * module.c -- heterospec._gemm, the CPython binding of the few-rows matrix kernel (rows.h).
 *
 * A separate extension from heterospec._C because it is built with OpenMP: it is imported only by
 * heterospec/models/cpu_gemm.py, after torch, so that the kernel's parallel regions run on the OpenMP runtime
 * torch already loaded (one libgomp.so.1 in the process, one pool of threads, torch's thread count) instead of
 * a second pool competing for the same cores.
 *
 * Private: the functions take addresses as integers, for the ~200 calls of one forward; the checks of shape,
 * dtype, contiguity and device are the Python wrapper's (heterospec.models.cpu_gemm.RowsWeight).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "rows.h"

static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *fn, long long *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s: expected %zd integer arguments, got %zd", fn, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* A null address (a tensor with no storage, e.g. on the meta device) is refused, never read: -1 with ValueError
 * naming the first such argument of `names` (one per integer argument, NULL for those that are no address). */
static int addresses(const long long *a, const char *const *names, Py_ssize_t n, const char *fn) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (names[i] && a[i] == 0) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected the address of CPU memory, got 0", fn, names[i]);
            return -1;
        }
    return 0;
}

/* pack(w, ldw, wp, n, k): the packed copy of an n x k float32 weight at address w into wp. */
static PyObject *py_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[5];
    if (ints(args, nargs, 5, "pack", a) < 0) return NULL;
    static const char *const names[5] = {"w", NULL, "wp", NULL, NULL};
    if (a[3] > 0 && a[4] > 0 && addresses(a, names, 5, "pack") < 0) return NULL;   /* (an empty weight reads none) */
    Py_BEGIN_ALLOW_THREADS hsg_pack((const float *)(uintptr_t)a[0], a[1], (float *)(uintptr_t)a[2], a[3], a[4]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* linear(x, ldx, wp, bias or 0, y, ldy, m, n, k, isa, threads) */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[11];
    if (ints(args, nargs, 11, "linear", a) < 0) return NULL;
    /* what a call reads: y for any output; x and wp only with a sum to take */
    static const char *const all[11] = {"x", NULL, "wp", NULL, "y"}, *const out_only[11] = {NULL, NULL, NULL, NULL, "y"};
    if (a[6] > 0 && a[7] > 0 && addresses(a, a[8] > 0 ? all : out_only, 11, "linear") < 0) return NULL;
    if (a[9] < HSG_ISA_PORTABLE || a[9] > hsg_isa_best()) {
        PyErr_Format(PyExc_ValueError, "linear: argument 'isa' expected 0 to %d on this CPU, got %lld", hsg_isa_best(),
                     a[9]);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS hsg_linear((const float *)(uintptr_t)a[0], a[1], (const float *)(uintptr_t)a[2],
                                      (const float *)(uintptr_t)a[3], (float *)(uintptr_t)a[4], a[5], a[6], a[7],
                                      a[8], (int)a[9], (int)a[10]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_packed_floats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[2];
    if (ints(args, nargs, 2, "packed_floats", a) < 0) return NULL;
    return PyLong_FromLongLong(hsg_packed_floats(a[0], a[1]));
}

static PyObject *py_isa_best(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(hsg_isa_best());
}

static PyObject *py_threads(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(hsg_threads());
}

static PyObject *py_openmp(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

#define FAST(f) ((PyCFunction)(void (*)(void))(f)), METH_FASTCALL

static PyMethodDef methods[] = {
    {"pack", FAST(py_pack), "pack(w, ldw, wp, n, k)"},
    {"linear", FAST(py_linear), "linear(x, ldx, wp, bias, y, ldy, m, n, k, isa, threads)"},
    {"packed_floats", FAST(py_packed_floats), "packed_floats(n, k) -> floats of the packed copy"},
    {"isa_best", py_isa_best, METH_NOARGS, "isa_best() -> 0 portable, 1 AVX2, 2 AVX-512"},
    {"threads", py_threads, METH_NOARGS, "threads() -> the OpenMP threads a call uses by default"},
    {"openmp", py_openmp, METH_NOARGS, "openmp() -> whether this build runs the kernel on OpenMP threads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "heterospec._gemm",
    .m_doc = "The few-rows float32 matrix kernel of heterospec.models.cpu_gemm (private).", .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__gemm(void) { return PyModule_Create(&module); }
