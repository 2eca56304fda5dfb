/*
 * tree.c -- the binding of expand, select and build_tree (CPU core: csrc/core/tree.c; kernels:
 * csrc/cuda/tree.cu; NumPy twins: heterospec/reference/tree.py; machinery: call.h).
 */
#include "call.h"

/* ---- expand(logits [batch, B, Vd], beam_scores, beam_nodes [batch, B], k, d2t [Vd] or None, node_offset, alloc,
 *             stream, check, batched) -> tokens, scores, parents [batch, B*k], entropy [batch, B], next_beams [batch, k] */

HS_FASTCALL(py_expand) {
    (void)self;
    static const char op[] = "expand";
    if (hs_nargs(op, nargs, 10) < 0) return NULL;
    PyObject *o_logits = args[0], *o_scores = args[1], *o_nodes = args[2], *o_d2t = args[4], *alloc = args[6],
             *o_stream = args[7];
    PyObject *outs[5] = {NULL, NULL, NULL, NULL, NULL};
    int64_t k, off;
    int check;
    if (hs_parse_i64(args[3], op, "k", &k) < 0 || hs_parse_i64(args[5], op, "node_offset", &off) < 0 ||
        hs_parse_flag(args[8], op, "check", &check) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    void *ws = NULL;
    hs_view *lg, *sc, *nd, *d2t = NULL, *ot, *os, *op_, *oe, *ob;
    if (!(lg = hs_views_first(&vs, o_logits, op, "logits", args[9], 3)) ||
        hs_check_array(lg, op, "logits", 3, "[batch, B, Vd]", HS_LOGIT_DTYPES, "float16, bfloat16 or float32") < 0)
        goto fail;
    const int64_t nb = lg->shape[0], B = lg->shape[1], Vd = lg->shape[2];
    if (!(sc = hs_views_req(&vs, o_scores, op, "beam_scores", 0)) ||
        hs_check_array(sc, op, "beam_scores", 2, "[batch, B]", HS_REAL_DTYPES, "float32 or float64") < 0 ||
        hs_check_dims(sc, op, "beam_scores", nb, "one row of beams per batch row", B, "one score per logits row") < 0)
        goto fail;
    if (!(nd = hs_views_req(&vs, o_nodes, op, "beam_nodes", 0)) ||
        hs_check_array(nd, op, "beam_nodes", 2, "[batch, B]", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dims(nd, op, "beam_nodes", nb, "one row of beams per batch row", B, "one node per logits row") < 0)
        goto fail;
    if (o_d2t != Py_None) {
        if (!(d2t = hs_views_add(&vs, o_d2t, op, "d2t", 0)) ||
            hs_check_array(d2t, op, "d2t", 1, "[Vd]", HS_ID_DTYPES, "int32 or int64") < 0 ||
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
    const int64_t sBk[2] = {nb, B * k}, sB[2] = {nb, B}, sk[2] = {nb, k};
    if (!(outs[0] = hs_views_alloc(&vs, alloc, op, "tokens", 2, sBk, HS_INT64, &ot)) ||
        !(outs[1] = hs_views_alloc(&vs, alloc, op, "scores", 2, sBk, HS_FLOAT32, &os)) ||
        !(outs[2] = hs_views_alloc(&vs, alloc, op, "parents", 2, sBk, HS_INT64, &op_)) ||
        !(outs[3] = hs_views_alloc(&vs, alloc, op, "entropy", 2, sB, HS_FLOAT32, &oe)) ||
        !(outs[4] = hs_views_alloc(&vs, alloc, op, "next_beams", 2, sk, HS_INT64, &ob)))
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
                                   (hs_dtype)nd->dtype, k, d2t ? d2t->data : NULL, d2t ? (hs_dtype)d2t->dtype : HS_INT64,
                                   off, (int64_t *)ot->data, (float *)os->data, (int64_t *)op_->data, (float *)oe->data,
                                   (int64_t *)ob->data, gws, wsb, g.err, g.stream, &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
    } else {
        size_t wsb = hs_expand_workspace_bytes(B, k, Vd);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_expand(lg->data, (hs_dtype)lg->dtype, nb, B, Vd, sc->data, (hs_dtype)sc->dtype, nd->data,
                         (hs_dtype)nd->dtype, k, d2t ? d2t->data : NULL, d2t ? (hs_dtype)d2t->dtype : HS_INT64, off,
                         (int64_t *)ot->data, (float *)os->data, (int64_t *)op_->data, (float *)oe->data,
                         (int64_t *)ob->data, ws, wsb, &err));
        PyMem_RawFree(ws);
    }
    hs_views_release(&vs);
    return Py_BuildValue("(NNNNN)", outs[0], outs[1], outs[2], outs[3], outs[4]);
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_views_release(&vs);
    for (int i = 0; i < 5; i++) Py_XDECREF(outs[i]);
    return NULL;
}

/* ---- select(scores [batch, M], n, m, width, alloc, stream, check, batched) -> int64 [batch, width] ----------
 * n: an int (every row) or an int64 [batch] array; m: None (M) or an int64 [batch] array (row b looks at its first
 * m[b] scores); width: None (M for an array n, n for an int) or an int.  Row b's first n[b] entries are the
 * ascending indices, the rest -1.  Per-row sizes (an array n, m, width) need the batched form. */

HS_FASTCALL(py_select) {
    (void)self;
    static const char op[] = "select";
    if (hs_nargs(op, nargs, 8) < 0) return NULL;
    PyObject *o_scores = args[0], *o_n = args[1], *o_m = args[2], *o_width = args[3], *alloc = args[4],
             *o_stream = args[5], *out = NULL;
    int check;
    int64_t width, nval = 0;
    if (hs_parse_flag(args[6], op, "check", &check) < 0) return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_i64buf host = {.p = NULL};
    void *ws = NULL;
    hs_view *sc, *nv = NULL, *mv = NULL, *ov;
    if (!(sc = hs_views_first(&vs, o_scores, op, "scores", args[7], 2)) ||
        hs_check_array(sc, op, "scores", 2, "[batch, M]", HS_REAL_DTYPES, "float32 or float64") < 0)
        goto fail;
    const int64_t B = sc->shape[0], M = sc->shape[1];
    const int per_row = hs_is_array(o_n);
    if (vs.lead && (per_row || o_m != Py_None || o_width != Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected an int for unbatched scores ([M]); per-row sizes (an "
                     "array n, m or width) need [batch, M] scores", op);
        goto fail;
    }
    if (per_row) {
        if (!(nv = hs_views_rows(&vs, o_n, op, "n", B, "[batch] (or an int)", "int64", "one count per batch row")))
            goto fail;
    } else {
        if (hs_parse_i64(o_n, op, "n", &nval) < 0) goto fail;
        if (nval < 0 || nval > M) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected 0 <= n <= M = %lld, got %lld", op, (long long)M,
                         (long long)nval);
            goto fail;
        }
    }
    if (o_width == Py_None) {
        width = nv ? M : nval;
    } else {
        if (hs_parse_i64(o_width, op, "width", &width) < 0) goto fail;
        if (width < 0 || width > M) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'width' expected 0 <= width <= M = %lld, got %lld", op,
                         (long long)M, (long long)width);
            goto fail;
        }
    }
    if (o_m != Py_None &&
        !(mv = hs_views_rows(&vs, o_m, op, "m", B, "[batch]", "int64", "one candidate count per batch row")))
        goto fail;
    if (nv == NULL && nval != width) { /* the kernel reads "no per-row n" as n = width */
        PyErr_Format(PyExc_ValueError, "%s: argument 'width' expected n = %lld for an int n (per-row counts as an int64 "
                     "[batch] array allow a wider output), got %lld", op, (long long)nval, (long long)width);
        goto fail;
    }
    const int64_t shape[2] = {B, width};
    if (!(out = hs_views_alloc(&vs, alloc, op, "out", 2, shape, HS_INT64, &ov))) goto fail;
    if (hs_gpu_begin(&g, sc, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        if (B > 0)
            HS_CALL(hs_cuda_select(sc->data, (hs_dtype)sc->dtype, B, M, mv ? (const int64_t *)mv->data : NULL,
                                   nv ? (const int64_t *)nv->data : NULL, width, (int64_t *)ov->data, g.err, g.stream,
                                   &err));
#endif
        if (hs_gpu_end(&g, op, check) < 0) goto fail;
    } else if (B > 0) {
        int64_t *nh = hs_i64buf_get(&host, 2 * B), *mh = nh + B;
        if (nh == NULL) goto fail;
        for (int64_t b = 0; b < B; b++) {
            nh[b] = nv ? ((const int64_t *)nv->data)[b] : nval;
            mh[b] = mv ? ((const int64_t *)mv->data)[b] : M;
            if (mh[b] < 0 || mh[b] > M) {
                PyErr_Format(PyExc_ValueError, "%s: argument 'm' expected candidate counts in [0, %lld], got %lld", op,
                             (long long)M, (long long)mh[b]);
                goto fail;
            }
            if (nh[b] < 0 || nh[b] > mh[b] || nh[b] > width) {
                PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected 0 <= n[b] <= min(m[b], width) = %lld, got %lld "
                             "at row %lld", op, (long long)(mh[b] < width ? mh[b] : width), (long long)nh[b], (long long)b);
                goto fail;
            }
        }
        size_t wsb = hs_select_workspace_bytes(M);
        if (!(ws = hs_workspace(wsb))) goto fail;
        HS_CALL(hs_select(sc->data, (hs_dtype)sc->dtype, B, M, mv ? mh : NULL, nh, width, (int64_t *)ov->data, ws, wsb,
                          &err));
        for (int64_t b = 0; b < B; b++) /* past each row's count, as the kernel pads */
            for (int64_t i = nh[b]; i < width; i++) ((int64_t *)ov->data)[b * width + i] = -1;
    }
    PyMem_RawFree(ws);
    hs_i64buf_free(&host);
    hs_views_release(&vs);
    return out;
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_i64buf_free(&host);
    hs_views_release(&vs);
    Py_XDECREF(out);
    return NULL;
}

/* ---- build_tree(tokens, parents [batch, M], selected [batch, N], root_token, n, alloc, stream, check,
 *                 device_outputs, batched) ------------------------------------------------------------------------
 * root_token: an int or an int64 [batch] array; n: None (N) or an int64 [batch] array of selection sizes.
 * -> (tokens, parents, depths [batch, N+1], mask [batch, N+1, N+1], retrieve [batch, N+1, N+1], num_leaves,
 * max_depth [batch]): row b's first n[b]+1 nodes the tree, the rest -1 (mask False), retrieve padded with -1.
 * An unbatched call without device_outputs returns the first five, retrieve cut to [leaves, max_depth + 1]. */

/* The tree's arrays, in the order of the result (num_leaves and max_depth last). */
static const char *const hs_tree_names[7] = {"tokens", "parents", "depths", "mask", "retrieve", "num_leaves", "max_depth"};

static PyObject *hs_tree_result(PyObject **outs, int n) {
    PyObject *res = PyTuple_New(n);
    for (int i = 0; res != NULL && i < n; i++) {
        Py_INCREF(outs[i]);
        PyTuple_SET_ITEM(res, i, outs[i]);
    }
    return res;
}

HS_FASTCALL(py_build_tree) {
    (void)self;
    static const char op[] = "build_tree";
    if (hs_nargs(op, nargs, 10) < 0) return NULL;
    PyObject *o_tok = args[0], *o_par = args[1], *o_sel = args[2], *o_root = args[3], *o_n = args[4], *alloc = args[5],
             *o_stream = args[6], *res = NULL;
    PyObject *outs[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    int check, devout;
    if (hs_parse_flag(args[7], op, "check", &check) < 0 || hs_parse_flag(args[8], op, "device_outputs", &devout) < 0)
        return NULL;
    hs_views vs = {.n = 0, .stream = o_stream};
    hs_gpu g = {0};
    hs_i64buf host = {.p = NULL};
    void *ws = NULL;
    int64_t root = 0, counts[2] = {0, 0}; /* num_leaves, max_depth of an unbatched call's host form */
    hs_view *tk, *pa, *se, *rv = NULL, *nv = NULL, *ov[7];
    if (!(tk = hs_views_first(&vs, o_tok, op, "tokens", args[9], 2)) ||
        hs_check_array(tk, op, "tokens", 2, "[batch, M]", HS_ID_DTYPES, "int32 or int64") < 0)
        goto fail;
    const int64_t B = tk->shape[0], M = tk->shape[1];
    if (!(pa = hs_views_req(&vs, o_par, op, "parents", 0)) ||
        hs_check_array(pa, op, "parents", 2, "[batch, M]", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dims(pa, op, "parents", B, "one row per batch row", M, "one parent per candidate token") < 0)
        goto fail;
    if (!(se = hs_views_req(&vs, o_sel, op, "selected", 0)) ||
        hs_check_array(se, op, "selected", 2, "[batch, N]|[n]", HS_ID_DTYPES, "int32 or int64") < 0 ||
        hs_check_dim(se, op, "selected", 0, B, "one row per batch row") < 0)
        goto fail;
    const int64_t N = se->shape[1], T = N + 1;
    if (N > M) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'selected' expected at most M = %lld entries%s, got %lld", op,
                     (long long)M, vs.lead ? "" : " per row", (long long)N);
        goto fail;
    }
    if (!vs.lead && hs_is_array(o_root)) {
        if (!(rv = hs_views_rows(&vs, o_root, op, "root_token", B, "[batch] (or an int)", "int64",
                                 "one root token per batch row")))
            goto fail;
    } else {
        if (hs_parse_i64(o_root, op, "root_token", &root) < 0) goto fail;
        if (root < 0) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'root_token' expected a token id >= 0, got %lld", op, (long long)root);
            goto fail;
        }
    }
    if (o_n != Py_None) {
        if (vs.lead) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'n' expected None for an unbatched tree ([M] tokens), got an "
                         "array; pass a leading batch dimension to give per-row sizes", op);
            goto fail;
        }
        if (!(nv = hs_views_rows(&vs, o_n, op, "n", B, "[batch]", "int64", "one selection size per batch row")))
            goto fail;
    }
    /* the whole result (padded retrieve, leaves and depth as arrays) unless an unbatched call wants the host form */
    const int whole = !vs.lead || devout;
    const int64_t shape[3] = {B, T, T};
    for (int i = 0; i < 4; i++)
        if (!(outs[i] = hs_views_alloc(&vs, alloc, op, hs_tree_names[i], i < 3 ? 2 : 3, shape, i == 3 ? HS_BOOL : HS_INT64,
                                       &ov[i])))
            goto fail;
    if (hs_gpu_begin(&g, tk, o_stream, op) < 0) goto fail;
    if (g.on) {
#ifdef HS_WITH_CUDA
        /* the retrieve rows at full size [N+1, N+1], and leaves / depth on the device */
        for (int i = 4; i < 7; i++)
            if (!(outs[i] = hs_views_alloc(&vs, alloc, op, hs_tree_names[i], i == 4 ? 3 : 1, shape, HS_INT64, &ov[i])))
                goto fail;
        if (B > 0)
            HS_CALL(hs_cuda_build_tree(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, M, se->data,
                                       (hs_dtype)se->dtype, N, nv ? (const int64_t *)nv->data : NULL,
                                       rv ? (const int64_t *)rv->data : NULL, root, (int64_t *)ov[0]->data,
                                       (int64_t *)ov[1]->data, (int64_t *)ov[2]->data, (uint8_t *)ov[3]->data,
                                       (int64_t *)ov[5]->data, (int64_t *)ov[6]->data, (int64_t *)ov[4]->data, g.err,
                                       g.stream, &err));
        if (whole) {
            if (hs_gpu_end(&g, op, check) == 0) res = hs_tree_result(outs, 7);
        } else if (hs_gpu_read(&g, op, "device_outputs", (int64_t *)ov[5]->data, &counts[0], 1) == 0 &&
                   hs_gpu_read(&g, op, "device_outputs", (int64_t *)ov[6]->data, &counts[1], 1) == 0) {
            hs_gpu_end(&g, op, 0);
            /* retrieve[:leaves, :depth + 1]: a view of the padded rows */
            PyObject *sl = Py_BuildValue("(NN)", PySlice_New(NULL, PyLong_FromLongLong(counts[0]), NULL),
                                         PySlice_New(NULL, PyLong_FromLongLong(counts[1] + 1), NULL));
            PyObject *cut = sl ? PyObject_GetItem(outs[4], sl) : NULL;
            Py_XDECREF(sl);
            if (cut != NULL) {
                Py_DECREF(outs[4]);
                outs[4] = cut;
                res = hs_tree_result(outs, 5);
            }
        }
#endif
    } else {
        /* CPU: host copies of the selection sizes, the node counts (n + 1) and the roots */
        int64_t *nh = hs_i64buf_get(&host, 3 * (B > 0 ? B : 1)), *th = nh + B, *rh = nh + 2 * B;
        if (nh == NULL) goto fail;
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
        int64_t *leaves = counts, *depth = counts + 1;
        if (whole) {
            for (int i = 5; i < 7; i++)
                if (!(outs[i] = hs_views_alloc(&vs, alloc, op, hs_tree_names[i], 1, shape, HS_INT64, &ov[i]))) goto fail;
            leaves = (int64_t *)ov[5]->data;
            depth = (int64_t *)ov[6]->data;
        }
        size_t wsb = hs_build_tree_workspace_bytes(M), wsr = hs_tree_retrieve_workspace_bytes(T);
        if (!(ws = hs_workspace(wsb > wsr ? wsb : wsr))) goto fail;
        if (B > 0)
            HS_CALL(hs_build_tree(tk->data, (hs_dtype)tk->dtype, pa->data, (hs_dtype)pa->dtype, B, M, se->data,
                                 (hs_dtype)se->dtype, N, nh, rh, (int64_t *)ov[0]->data, (int64_t *)ov[1]->data,
                                 (int64_t *)ov[2]->data, (uint8_t *)ov[3]->data, leaves, depth, ws, wsb, &err));
        for (int64_t b = 0; b < B; b++) { /* rows past each tree, as the kernel pads them */
            for (int64_t i = th[b]; i < T; i++)
                for (int k = 0; k < 3; k++) ((int64_t *)ov[k]->data)[b * T + i] = -1;
            memset((uint8_t *)ov[3]->data + (b * T + th[b]) * T, 0, (size_t)((T - th[b]) * T));
        }
        /* retrieve: padded [batch, N+1, N+1], or the host form's [leaves, depth + 1] */
        const int64_t rshape[3] = {B, whole ? T : counts[0], whole ? T : counts[1] + 1};
        if (!(outs[4] = hs_views_alloc(&vs, alloc, op, "retrieve", 3, rshape, HS_INT64, &ov[4]))) goto fail;
        if (B > 0)
            HS_CALL(hs_tree_retrieve((int64_t *)ov[1]->data, (int64_t *)ov[2]->data, B, T, th, rshape[1], rshape[2],
                                    (int64_t *)ov[4]->data, ws, wsr, &err));
        res = hs_tree_result(outs, whole ? 7 : 5);
    }
fail:
    hs_gpu_end(&g, op, 0);
    PyMem_RawFree(ws);
    hs_i64buf_free(&host);
    hs_views_release(&vs);
    for (int i = 0; i < 7; i++) Py_XDECREF(outs[i]);
    return res;
}
