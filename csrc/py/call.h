/*
 * call.h -- what every binding function of heterospec._C shares (call.c): the arrays of one call, their form,
 * the outputs, scalar parsing, errors, and the CUDA side of a call.
 *
 * The binding is split per op family, as the CPU core (csrc/core/) and the kernels (csrc/cuda/) are:
 * entropy.c (topk_entropy, bucketize), tree.c (expand, select, build_tree), verify.c (verify_greedy,
 * verify_sample, the Philox helpers), kv.c (kv_compact, KVTensors), info.c (build_info and the CUDA
 * utilities); module.c holds the method table and the module's init.
 *
 * Each op function: parses scalars (TypeError naming the argument), imports every array argument zero-copy
 * (view.c), checks dtype, ndim, every shape relation and the device, asks the Python wrapper's allocator for
 * the outputs (so NumPy inputs give NumPy outputs and torch tensors give torch tensors: the core never
 * allocates framework memory), runs the core op with the GIL released, and maps a failing status to
 * TypeError/ValueError carrying the core's message.  Value-level checks (ranges, orders, non-finite logits,
 * tree shape) live in the core so that C callers get them too.
 *
 * Batch-first.  The ops are bound in the C ABI's batch-first form only ([batch, ...] arrays, per-row sizes).
 * heterospec.ops says whether a call is batched (its last argument); an unbatched call is the batch-first call
 * with batch 1: each per-request array gets a leading dimension of 1 as it is imported (hs_views_req), and each
 * output is allocated without it (hs_views_alloc) -- both are shape bookkeeping on the views, nothing is
 * copied and no Python object is made, and error messages still show the caller's own shapes (view.h).
 */
#ifndef HS_PY_CALL_H
#define HS_PY_CALL_H

#ifndef HS_NUMPY_API_HOME /* module.c imports the NumPy C API; the other files use its table */
#define NO_IMPORT_ARRAY
#endif
#define PY_ARRAY_UNIQUE_SYMBOL HS_ARRAY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "view.h"

#include <numpy/arrayobject.h>

#ifdef HS_WITH_CUDA
#include "hs/heterospec_cuda.h"
#endif

#define HS_MAX_VIEWS 16

extern PyObject *hs_cuda_error_type; /* heterospec._C.CudaError (a RuntimeError), made by module.c */

/* ---- the arrays of one call ------------------------------------------------------------------------------- */

/* All views of one call, released together; `stream` is the consumer stream handed to DLPack producers. */
typedef struct {
    hs_view v[HS_MAX_VIEWS];
    const char *arg[HS_MAX_VIEWS];
    int n;
    PyObject *stream;
    int lead; /* an unbatched call: per-request arrays gain a leading batch dimension of 1, outputs drop it */
} hs_views;

void hs_views_release(hs_views *vs);
/* Import obj as the next view, as it is (a shared argument such as d2t); the first view fixes the device every
 * later one must share. */
hs_view *hs_views_add(hs_views *vs, PyObject *obj, const char *op, const char *arg, int writable);
/* The first array of a batch-first op, whose form (ndim dimensions with the batch) decides the call's:
 * `batched` is True or False as heterospec.ops says, or None to decide by the array's ndim. */
hs_view *hs_views_first(hs_views *vs, PyObject *obj, const char *op, const char *arg, PyObject *batched, int ndim);
/* Another per-request array: in an unbatched call it gains the leading batch dimension of 1. */
hs_view *hs_views_req(hs_views *vs, PyObject *obj, const char *op, const char *arg, int writable);
/* An int64 array [B] of per-row values (n, m, root_token...) on the call's device; the messages name the
 * layout, the dtype expected and why the length is B. */
hs_view *hs_views_rows(hs_views *vs, PyObject *obj, const char *op, const char *arg, int64_t B, const char *layout,
                       const char *dtype, const char *why);
/* Ask the wrapper's allocator for an output of the batch-first shape [ndim] (an unbatched call: without its
 * leading 1), import it (writable) and check what came back.  A new reference, or NULL with an exception. */
PyObject *hs_views_alloc(hs_views *vs, PyObject *alloc, const char *op, const char *arg, int ndim, const int64_t *shape,
                         hs_dtype dtype, hs_view **out);
/* Whether an argument that may be an int or an array (n, root_token, seed...) is an array. */
int hs_is_array(PyObject *obj);

/* int64 scratch of a call on the host, on the stack for small batches. */
typedef struct {
    int64_t local[32];
    int64_t *p;
} hs_i64buf;
int64_t *hs_i64buf_get(hs_i64buf *b, int64_t n); /* NULL with MemoryError */
void hs_i64buf_free(hs_i64buf *b);

/* ---- scalars ---------------------------------------------------------------------------------------------- */

/* Each returns 0, or -1 with a TypeError/ValueError naming the argument. */
int hs_nargs(const char *op, Py_ssize_t nargs, Py_ssize_t expected);
int hs_parse_i64(PyObject *obj, const char *op, const char *arg, int64_t *out);
int hs_parse_u64(PyObject *obj, const char *op, const char *arg, uint64_t *out);
int hs_parse_f64(PyObject *obj, const char *op, const char *arg, double *out);
int hs_parse_flag(PyObject *obj, const char *op, const char *arg, int *out);

/* ---- errors and the core call ----------------------------------------------------------------------------- */

/* Map a failing core status to a Python exception. */
void hs_raise(hs_status st, const hs_error *err);
/* Host workspace of a core call (PyMem_RawFree it); NULL with MemoryError. */
void *hs_workspace(size_t bytes);

/* Whether HS_CALL releases the GIL (1, the default).  The core reads only the call's own arrays and writes only
 * its outputs and its own workspace, so other Python threads run meanwhile; _C._set_release_gil(False) holds it
 * instead (tests/test_concurrency.py runs the ops from threads both ways). */
extern int hs_release_gil;

/* Run a core call with the GIL released (see hs_release_gil); on failure raise its message and jump to the
 * caller's `fail`.  The call sees `err`, declared here. */
#define HS_CALL(call)                                                                                          \
    do {                                                                                                       \
        hs_error err;                                                                                          \
        hs_status st;                                                                                          \
        if (hs_release_gil) {                                                                                  \
            Py_BEGIN_ALLOW_THREADS st = (call);                                                                \
            Py_END_ALLOW_THREADS                                                                               \
        } else {                                                                                               \
            st = (call);                                                                                       \
        }                                                                                                      \
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

int hs_gpu_begin(hs_gpu *g, hs_view *ref, PyObject *o_stream, const char *op);
/* End of a call: restore the caller's device; with `check`, synchronise and raise device errors. */
int hs_gpu_end(hs_gpu *g, const char *op, int check);

#ifdef HS_WITH_CUDA
#define HS_WS_COUNTERS 65536 /* the start of the module workspace holds expand's per-request counters */
/* The module's device workspace with >= bytes after the counters; NULL with an exception. */
void *hs_gpu_workspace(hs_gpu *g, size_t bytes);
/* Read n int64 results from the device (synchronises the stream first, raising recorded errors). */
int hs_gpu_read(hs_gpu *g, const char *op, const char *why, const int64_t *dev, int64_t *host, int n);
#endif

/* ---- the functions of heterospec._C, by op family (module.c's method table) --------------------------------- */

#define HS_FASTCALL(name) PyObject *name(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
HS_FASTCALL(py_topk_entropy);
HS_FASTCALL(py_bucketize);
HS_FASTCALL(py_expand);
HS_FASTCALL(py_select);
HS_FASTCALL(py_build_tree);
HS_FASTCALL(py_verify_greedy);
HS_FASTCALL(py_verify_sample);
HS_FASTCALL(py_kv_compact);
PyObject *py_philox4x32(PyObject *self, PyObject *args);
PyObject *py_philox_uniform(PyObject *self, PyObject *args);
PyObject *py_build_info(PyObject *self, PyObject *args);
PyObject *py_emu_blocks(PyObject *self, PyObject *args);
PyObject *py_cuda_check(PyObject *self, PyObject *args);
PyObject *py_cuda_reserve(PyObject *self, PyObject *args);
PyObject *py_cuda_new_stream(PyObject *self, PyObject *args);
PyObject *py_cuda_chunks(PyObject *self, PyObject *args);
PyObject *py_cuda_set_chunk_min(PyObject *self, PyObject *args);
PyObject *py_set_release_gil(PyObject *self, PyObject *arg);
/* Adds the KVTensors type to the module (kv.c). */
int hs_kv_add_type(PyObject *module);

#endif /* HS_PY_CALL_H */
