/*
 * verify.c -- the binding of verify_greedy, verify_sample and the Philox helpers (CPU core: csrc/core/verify.c;
 * kernels: csrc/cuda/verify.cu; NumPy twins: heterospec/reference/verify.py; machinery: call.h).
 *
 * Both verify ops take tree_tokens, tree_parents [batch, T], target_logits [batch, T, V] and n (None: every row has
 * T nodes, or an int64 [batch] array on the inputs' device: nodes per row), and give path [batch, T] (-1 past each
 * row's length) and length, next_token (and draws) [batch].  An unbatched call gives them without the batch
 * dimension (device_outputs=True: path, then 0-d arrays), or, by default, the host form (path[:length] and Python
 * ints).
 */
#include "call.h"

/* ---- what the two verify ops share ------------------------------------------------------------------------ */

/* A verify call's trees, logits and per-row node counts, and its outputs: path, then `nres` per-row results
 * (length, next_token[, draws]).  In the host form on the CPU the results go to `local` instead of arrays. */
typedef struct {
    hs_view *tk, *pa, *lg, *nv;
    int64_t B, T, V;
    int nres, host_form;
    PyObject *outs[4];
    int64_t *path, *res[3], local[3];
} hs_verify_io;

static const char *const hs_verify_names[3] = {"length", "next_token", "draws"};

/* Import and check the trees, the logits and n. */
static int hs_verify_args(hs_views *vs, const char *op, PyObject *const *args, PyObject *o_batched, hs_verify_io *io) {
    memset(io, 0, sizeof *io);
    if (!(io->tk = hs_views_first(vs, args[0], op, "tree_tokens", o_batched, 2)) ||
        hs_check_array(io->tk, op, "tree_tokens", 2, "[batch, T]|[n]", HS_ID_DTYPES, "int32 or int64") < 0)
        return -1;
    const int64_t B = io->tk->shape[0], T = io->tk->shape[1];
    if (!(io->pa = hs_views_req(vs, args[1], op, "tree_parents", 0)) ||
        hs_check_array(io->pa, op, "tree_parents", 2, "[batch, T]|[n]", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dims(io->pa, op, "tree_parents", B, "one tree per batch row", T, "one parent per tree node") < 0)
        return -1;
    if (!(io->lg = hs_views_req(vs, args[2], op, "target_logits", 0)) ||
        hs_check_array(io->lg, op, "target_logits", 3, "[batch, T, V]|[n, V]", HS_LOGIT_DTYPES,
                       "float16, bfloat16 or float32") < 0 ||
        hs_check_dims(io->lg, op, "target_logits", B, "one tree per batch row", T, "one logits row per tree node") < 0)
        return -1;
    if (T < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'tree_tokens' expected at least the root node, got %s", op,
                     vs->lead ? "0 nodes" : "T = 0");
        return -1;
    }
    if (io->lg->shape[2] < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'target_logits' expected V >= 1, got 0", op);
        return -1;
    }
    if (args[3] != Py_None) {
        if (vs->lead) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected None for an unbatched tree (a [T] tree_tokens), "
                         "got an array; pass a leading batch dimension to give per-row sizes", op);
            return -1;
        }
        if (!(io->nv = hs_views_rows(vs, args[3], op, "n", B, "[batch]", "int64", "one node count per batch row")))
            return -1;
    }
    io->B = B;
    io->T = T;
    io->V = io->lg->shape[2];
    return 0;
}

/* Allocate the outputs (see hs_verify_io). */
static int hs_verify_outputs(hs_views *vs, PyObject *alloc, const char *op, int devout, int nres, hs_verify_io *io) {
    const int64_t shape[2] = {io->B, io->T};
    io->nres = nres;
    io->host_form = vs->lead && !devout;
    hs_view *v;
    if (!(io->outs[0] = hs_views_alloc(vs, alloc, op, "path", 2, shape, HS_INT64, &v))) return -1;
    io->path = (int64_t *)v->data;
    for (int i = 0; i < nres; i++) {
        if (io->host_form && io->tk->device_type != 2) { /* the CPU's host form: no arrays */
            io->res[i] = &io->local[i];
            continue;
        }
        if (!(io->outs[i + 1] = hs_views_alloc(vs, alloc, op, hs_verify_names[i], 1, shape, HS_INT64, &v))) return -1;
        io->res[i] = (int64_t *)v->data;
    }
    return 0;
}

/* Host copies of the per-row node counts (T for every row without n), checked. */
static int64_t *hs_verify_counts(const char *op, const hs_verify_io *io, hs_i64buf *buf) {
    int64_t *nh = hs_i64buf_get(buf, io->B > 0 ? io->B : 1);
    for (int64_t b = 0; nh != NULL && b < io->B; b++) {
        nh[b] = io->nv ? ((const int64_t *)io->nv->data)[b] : io->T;
        if (nh[b] < 1 || nh[b] > io->T) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected node counts in [1, %lld], got %lld", op,
                         (long long)io->T, (long long)nh[b]);
            return NULL;
        }
    }
    return nh;
}

/* After the CPU core: -1 past each row's length, as the kernels leave the paths. */
static void hs_verify_pad(hs_verify_io *io) {
    for (int64_t b = 0; b < io->B; b++)
        for (int64_t i = io->res[0][b] > 0 ? io->res[0][b] : 0; i < io->T; i++) io->path[b * io->T + i] = -1;
}

/* The result: (path, length, next_token[, draws]) as arrays, or the host form (path[:length], next_token[, draws]
 * as Python ints), whose numbers a CUDA call reads back first (a synchronisation that raises recorded errors). */
static PyObject *hs_verify_result(hs_gpu *g, const char *op, int check, hs_verify_io *io) {
    if (!io->host_form) {
        if (hs_gpu_end(g, op, check) < 0) return NULL;
        PyObject *res = PyTuple_New(1 + io->nres);
        for (int i = 0; res != NULL && i <= io->nres; i++) {
            Py_INCREF(io->outs[i]);
            PyTuple_SET_ITEM(res, i, io->outs[i]);
        }
        return res;
    }
#ifdef HS_WITH_CUDA
    for (int i = 0; g->on && i < io->nres; i++)
        if (hs_gpu_read(g, op, "device_outputs", io->res[i], &io->local[i], 1) < 0) return NULL;
#endif
    hs_gpu_end(g, op, 0);
    PyObject *sl = PySequence_GetSlice(io->outs[0], 0, (Py_ssize_t)io->local[0]);
    if (sl == NULL) return NULL;
    return io->nres == 3 ? Py_BuildValue("(NLL)", sl, (long long)io->local[1], (long long)io->local[2])
                         : Py_BuildValue("(NL)", sl, (long long)io->local[1]);
}

static void hs_verify_release(hs_verify_io *io) {
    for (int i = 0; i < 4; i++) Py_CLEAR(io->outs[i]);
}

/* ---- verify_greedy(tree_tokens, tree_parents, target_logits, n, alloc, stream, check, device_outputs, batched) */

HS_FASTCALL(py_verify_greedy) {
    (void)self;
    static const char op[] = "verify_greedy";
    if (hs_nargs(op, nargs, 9) < 0) return NULL;
    PyObject *alloc = args[4], *o_stream = args[5], *res = NULL;
    int check, devout;
    if (hs_parse_flag(args[6], op, "check", &check) < 0 || hs_parse_flag(args[7], op, "device_outputs", &devout) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_i64buf counts = {.p = NULL};
    hs_verify_io io;
    if (hs_verify_args(&vs, op, args, args[8], &io) < 0 || hs_verify_outputs(&vs, alloc, op, devout, 2, &io) < 0)
        goto fail;
    const hs_view *tk = io.tk, *pa = io.pa, *lg = io.lg;
    if (hs_gpu_begin(&g, io.tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        size_t wsb = hs_cuda_verify_greedy_workspace_bytes(io.B, io.T, io.V);
        void *gws = hs_gpu_workspace(&g, wsb);
        if (gws == NULL) goto fail;
        if (io.B > 0)
            HS_CALL(hs_cuda_verify_greedy(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, io.B, io.T,
                                          io.nv ? (const int64_t *)io.nv->data : NULL, lg->data, (hs_dtype)lg->dtype,
                                          io.V, io.path, io.res[0], io.res[1], (char *)gws + HS_WS_COUNTERS, wsb, g.err,
                                          g.stream, &err));
#endif
    } else {
        const int64_t *nh = hs_verify_counts(op, &io, &counts);
        if (nh == NULL) goto fail;
        HS_CALL(hs_verify_greedy(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, io.B, io.T, nh, lg->data,
                                (hs_dtype)lg->dtype, io.V, io.path, io.res[0], io.res[1], &err));
        hs_verify_pad(&io);
    }
    res = hs_verify_result(&g, op, check, &io);
fail:
    hs_gpu_end(&g, op, 0);
    hs_i64buf_free(&counts);
    hs_views_release(&vs);
    hs_verify_release(&io);
    return res;
}

/* ---- verify_sample(tree_tokens, tree_parents, target_logits, n, temperature, top_k, top_p, seed, offset, alloc,
 *                    stream, check, device_outputs, advance_offset, batched) ------------------------------------ */

/* seed / offset: a Python int (every row), or an int64 array on the device of the trees: [batch], or in an
 * unbatched call one element (shape [] or [1]; its int64 bits are the uint64 value).  On the CPU the values go to
 * host[0..B); on CUDA an array is handed to the kernel (*dev: read when it runs, so a captured graph sees new
 * values) and an int as *val.  *view: the array, for advance_offset's write-back. */
static int hs_parse_seeds(hs_views *vs, PyObject *o, const char *op, const char *arg, int64_t B, uint64_t *host,
                          uint64_t *val, void **dev, hs_view **view) {
    *dev = NULL;
    *view = NULL;
    *val = 0;
    if (!hs_is_array(o)) { /* (never through __index__, which would synchronise a device tensor) */
        if (hs_parse_u64(o, op, arg, val) < 0) return -1;
        for (int64_t b = 0; b < B; b++) host[b] = *val;
        return 0;
    }
    const int gpu = vs->v[0].device_type == 2, lead = vs->lead;
    /* imported read-only everywhere: only an offset with advance_offset=True is written, and the caller refuses a
     * read-only one then (the same ValueError on the CPU and on a device) */
    hs_view *v = hs_views_add(vs, o, op, arg, 0);
    if (v == NULL || hs_check_dtype(v, op, arg, HS_MASK(HS_INT64), lead && gpu ? "int64" : "int64 (or a Python int)") < 0)
        return -1;
    if (lead && hs_view_nbytes(v) != 8) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' expected an int or a 1-element int64 tensor, got %lld elements",
                     op, arg, (long long)(hs_view_nbytes(v) / 8));
        return -1;
    }
    if (!lead && (hs_check_ndim(v, op, arg, 1, "[batch]") < 0 || hs_check_dim(v, op, arg, 0, B, "one value per batch row") < 0))
        return -1;
    *view = v;
    if (gpu) *dev = v->data;
    else memcpy(host, v->data, (size_t)B * sizeof(uint64_t));
    return 0;
}

HS_FASTCALL(py_verify_sample) {
    (void)self;
    static const char op[] = "verify_sample";
    if (hs_nargs(op, nargs, 16) < 0) return NULL;
    PyObject *o_seed = args[7], *o_off = args[8], *alloc = args[9], *o_stream = args[10], *res = NULL;
    hs_sampling sp;
    int check, devout, adv;
    if (hs_parse_f64(args[4], op, "temperature", &sp.temperature) < 0 || hs_parse_i64(args[5], op, "top_k", &sp.top_k) < 0 ||
        hs_parse_f64(args[6], op, "top_p", &sp.top_p) < 0 || hs_parse_f64(args[15], op, "min_p", &sp.min_p) < 0 ||
        hs_parse_flag(args[11], op, "check", &check) < 0 ||
        hs_parse_flag(args[12], op, "device_outputs", &devout) < 0 ||
        hs_parse_flag(args[13], op, "advance_offset", &adv) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_i64buf counts = {.p = NULL}, seeds = {.p = NULL};
    uint64_t seed0, off0;
    void *seed_dev, *off_dev, *ws = NULL;
    hs_view *sview, *oview;
    hs_verify_io io;
    if (hs_verify_args(&vs, op, args, args[14], &io) < 0) goto fail;
    const int64_t B = io.B;
    uint64_t *sh = (uint64_t *)hs_i64buf_get(&seeds, 2 * (B > 0 ? B : 1)), *oh = sh + B;
    if (sh == NULL) goto fail;
    /* a tensor must share the device of tree_tokens (hence of target_logits): hs_views_add checks it */
    if (hs_parse_seeds(&vs, o_seed, op, "seed", B, sh, &seed0, &seed_dev, &sview) < 0 ||
        hs_parse_seeds(&vs, o_off, op, "offset", B, oh, &off0, &off_dev, &oview) < 0)
        goto fail;
    if (adv && oview == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'advance_offset' expected False unless 'offset' is %s, got True%s", op,
                     vs.lead ? "a 1-element int64 tensor" : "an int64 [batch] array", vs.lead ? " (with an int offset)" : "");
        goto fail;
    }
    if (adv && oview->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'offset' expected %s, got a read-only one", op,
                     vs.lead ? "a writable tensor (advance_offset=True writes offset + draws into it)"
                             : "a writable array with advance_offset=True");
        goto fail;
    }
    if (hs_verify_outputs(&vs, alloc, op, devout, 3, &io) < 0) goto fail;
    const hs_view *tk = io.tk, *pa = io.pa, *lg = io.lg;
    if (hs_gpu_begin(&g, io.tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        size_t wsb = hs_cuda_verify_sample_workspace_bytes(B, io.T, io.V);
        void *gws = hs_gpu_workspace(&g, wsb);
        if (gws == NULL) goto fail;
        if (B > 0)
            HS_CALL(hs_cuda_verify_sample(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, io.T,
                                          io.nv ? (const int64_t *)io.nv->data : NULL, lg->data, (hs_dtype)lg->dtype,
                                          io.V, sp, (const uint64_t *)seed_dev, seed0, (uint64_t *)off_dev, off0, adv,
                                          io.path, io.res[0], io.res[1], io.res[2], (char *)gws + HS_WS_COUNTERS, wsb,
                                          g.err, g.stream, &err));
#endif
    } else {
        const int64_t *nh = hs_verify_counts(op, &io, &counts);
        if (nh == NULL) goto fail;
        size_t wsb = hs_verify_sample_workspace_bytes(io.T, io.V);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_verify_sample(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, io.T, nh, lg->data,
                                (hs_dtype)lg->dtype, io.V, sp, sh, oh, io.path, io.res[0], io.res[1], io.res[2], ws, wsb,
                                &err));
        hs_verify_pad(&io);
        if (adv) /* as the kernel does: offset += draws, mod 2^64 */
            for (int64_t b = 0; b < B; b++) ((uint64_t *)oview->data)[b] = oh[b] + (uint64_t)io.res[2][b];
    }
    res = hs_verify_result(&g, op, check, &io);
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_i64buf_free(&counts);
    hs_i64buf_free(&seeds);
    hs_views_release(&vs);
    hs_verify_release(&io);
    return res;
}

/* ---- Philox ------------------------------------------------------------------------------------------------ */

PyObject *py_philox4x32(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int c0, c1, c2, c3, k0, k1;
    if (!PyArg_ParseTuple(args, "IIIIII", &c0, &c1, &c2, &c3, &k0, &k1)) return NULL;
    uint32_t ctr[4] = {c0, c1, c2, c3}, key[2] = {k0, k1}, out[4];
    hs_philox4x32_10(ctr, key, out);
    return Py_BuildValue("(kkkk)", (unsigned long)out[0], (unsigned long)out[1], (unsigned long)out[2],
                         (unsigned long)out[3]);
}

PyObject *py_philox_uniform(PyObject *self, PyObject *args) {
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
