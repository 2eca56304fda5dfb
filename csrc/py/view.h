/*
 * view.h -- importing Python arrays/tensors as plain C views, with argument checks whose messages name
 * the op, the argument, what was expected and what was given.
 */
#ifndef HS_PY_VIEW_H
#define HS_PY_VIEW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "hs/heterospec.h"

#define HS_MAX_NDIM 8
#define HS_DTYPE_OTHER (-1) /* a dtype the core never takes; name kept for messages */

typedef enum { HS_SRC_NONE, HS_SRC_NUMPY, HS_SRC_DLPACK, HS_SRC_DLPACK_V1, HS_SRC_BUFFER } hs_source;

typedef struct hs_view {
    void *data;
    int dtype; /* hs_dtype or HS_DTYPE_OTHER */
    char dtype_name[24];
    int64_t itemsize; /* bytes per element, for ops that move elements of any dtype */
    int ndim;
    int64_t shape[HS_MAX_NDIM + 1]; /* + 1: room for the batch dimension hs_view_lead adds */
    int lead; /* shape[0] is a batch dimension of 1 that the binding added (an unbatched call, see hs_view_lead) */
    int device_type; /* DLPack device code: 1 = CPU */
    int device_id;
    int readonly;
    hs_source source;
    PyObject *owner; /* numpy array (a new reference) */
    void *managed;   /* DLManagedTensor[Versioned] we took ownership of */
    Py_buffer buffer;
} hs_view;

/* Import obj (NumPy array, DLPack producer, or buffer-protocol object) into *v.  On failure sets a
 * Python exception naming `op` and `arg` and returns -1; *v then needs no release.  `stream` (NULL or None
 * for none) is the consumer's CUDA stream as a Python int: a producer on a CUDA device gets it as
 * __dlpack__(stream=...), so its pending work is ordered before ours (DLPack: 0 is sent as 1, the legacy
 * default stream). */
int hs_view_import(PyObject *obj, const char *op, const char *arg, int writable, PyObject *stream, hs_view *v);
void hs_view_release(hs_view *v);

/* Bytes spanned by a (C-contiguous) view. */
static inline int64_t hs_view_nbytes(const hs_view *v) {
    int64_t n = v->itemsize;
    for (int i = 0; i < v->ndim; i++) n *= v->shape[i];
    return n;
}

/* View an array of an unbatched call as the batch-first form the ops take: a leading batch dimension of 1 is
 * added to its shape (the data is the same).  The checks below then speak of the caller's shape. */
static inline void hs_view_lead(hs_view *v) {
    for (int i = v->ndim; i > 0; i--) v->shape[i] = v->shape[i - 1];
    v->shape[0] = 1;
    v->ndim++;
    v->lead = 1;
}

/* Checks; each returns 0, or -1 with an exception set.  Layouts are written batch-first ("[batch, M]"); for a view
 * with a lead dimension the message shows the layout without "batch, " ("[M]"), or the spelling after a '|' where
 * the unbatched form names its sizes otherwise ("[batch, T]|[n]"), and the caller's ndim, dimension and shape. */
int hs_check_ndim(const hs_view *v, const char *op, const char *arg, int ndim, const char *layout);
int hs_check_dtype(const hs_view *v, const char *op, const char *arg, unsigned mask, const char *expected);
/* hs_check_ndim, then hs_check_dtype. */
int hs_check_array(const hs_view *v, const char *op, const char *arg, int ndim, const char *layout, unsigned mask,
                   const char *expected);
int hs_check_dim(const hs_view *v, const char *op, const char *arg, int dim, int64_t expected,
                 const char *why);
/* shape[0] == d0 and shape[1] == d1 (the leading two dimensions: batch rows and per-row size), each with its why. */
int hs_check_dims(const hs_view *v, const char *op, const char *arg, int64_t d0, const char *why0, int64_t d1,
                  const char *why1);
int hs_check_same_device(const hs_view *v, const hs_view *ref, const char *op, const char *arg,
                         const char *ref_arg);

#define HS_MASK(t) (1u << (t))
#define HS_LOGIT_DTYPES (HS_MASK(HS_FLOAT32) | HS_MASK(HS_FLOAT16) | HS_MASK(HS_BFLOAT16))
#define HS_REAL_DTYPES (HS_MASK(HS_FLOAT32) | HS_MASK(HS_FLOAT64))
#define HS_ID_DTYPES (HS_MASK(HS_INT32) | HS_MASK(HS_INT64))

#endif /* HS_PY_VIEW_H */
