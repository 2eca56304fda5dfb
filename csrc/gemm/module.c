/*
 * module.c -- heterospec._gemm, the CPython binding of the few-rows matrix kernel (rows.h).
 *
 * A separate extension from heterospec._C because it is built with OpenMP: it is imported only by
 * heterospec/models/cpu_gemm.py, after torch, so that the kernel's parallel regions run on the OpenMP runtime
 * torch already loaded (one libgomp.so.1 in the process, one pool of threads, torch's thread count) instead of
 * a second pool competing for the same cores.
 *
 * Private: the functions take addresses as integers, for the ~200 calls of one forward; the checks of shape,
 * dtype, contiguity and device are the Python wrappers' (heterospec.models.cpu_gemm, .cpu_decoder).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "decoder.h"
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

static int isa_ok(long long isa, const char *fn) {
    if (isa < HSG_ISA_PORTABLE || isa > hsg_isa_best()) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'isa' expected 0 to %d on this CPU, got %lld", fn, hsg_isa_best(),
                     isa);
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

/* pack_codes(codec, q, d, m or 0, wp, n, k): rows.h's hsg_pack_codes (int8 codes, float32 scales and offsets). */
static PyObject *py_pack_codes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[7];
    if (ints(args, nargs, 7, "pack_codes", a) < 0) return NULL;
    static const char *const names[7] = {NULL, "q", "d", NULL, "wp", NULL, NULL};
    if (addresses(a, names, 7, "pack_codes") < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = hsg_pack_codes((int)a[0], (const int8_t *)(uintptr_t)a[1], (const float *)(uintptr_t)a[2],
                                               (const float *)(uintptr_t)a[3], (void *)(uintptr_t)a[4], a[5], a[6]);
    Py_END_ALLOW_THREADS if (rc) {
        PyErr_Format(PyExc_ValueError, "pack_codes: arguments 'codec', 'q', 'd' and 'm' expected codec 1 (Q8), 2 "
                     "(Q4, with m, codes 0..15 and scales of at most 20 significant bits), 5 (Q8X, with m, scales "
                     "and offsets per 16), 6 (Q5, with m, codes 0..31) or 7 (Q8H, scales per 16), every product of "
                     "a code and its scale exact where m is added, and k a multiple of %d, "
                     "got codec %lld, k %lld, codes out of range or an inexact product", HSG_BLOCK, a[0], a[6]);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* find_codes(codec, w, q, d, m or 0, n, k) -> True when every block of the n x k float32 weight at w has codes of
 * `codec` (written to q, d, m), else False: rows.h's hsg_find_codes. */
static PyObject *py_find_codes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[7];
    if (ints(args, nargs, 7, "find_codes", a) < 0) return NULL;
    static const char *const names[7] = {NULL, "w", "q", "d", NULL, NULL, NULL};
    if (addresses(a, names, 7, "find_codes") < 0) return NULL;
    int group, lo, hi, offset;
    if (hsg_code_form((int)a[0], &group, &lo, &hi, &offset) == 0 && offset && !a[4]) {
        PyErr_Format(PyExc_ValueError, "find_codes: argument 'm' expected an address for codec %lld, got 0", a[0]);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = hsg_find_codes((int)a[0], (const float *)(uintptr_t)a[1], a[5], a[6],
                                               (int8_t *)(uintptr_t)a[2], (float *)(uintptr_t)a[3],
                                               (float *)(uintptr_t)a[4], 0);
    Py_END_ALLOW_THREADS if (rc == -2) {
        PyErr_Format(PyExc_ValueError, "find_codes: arguments 'codec' and 'k' expected codec 1 (Q8), 2 (Q4), 5 "
                     "(Q8X), 6 (Q5) or 7 (Q8H) and k a multiple of %d, got codec %lld, k %lld", HSG_BLOCK, a[0], a[6]);
        return NULL;
    }
    return PyBool_FromLong(rc == 0);
}

/* pack_half(codec, h, wp, n, k): rows.h's hsg_pack_half (float16 / bfloat16 patterns). */
static PyObject *py_pack_half(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[5];
    if (ints(args, nargs, 5, "pack_half", a) < 0) return NULL;
    static const char *const names[5] = {NULL, "h", "wp", NULL, NULL};
    if (addresses(a, names, 5, "pack_half") < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = hsg_pack_half((int)a[0], (const uint16_t *)(uintptr_t)a[1], (void *)(uintptr_t)a[2],
                                              a[3], a[4]);
    Py_END_ALLOW_THREADS if (rc) {
        PyErr_Format(PyExc_ValueError, "pack_half: arguments 'codec' and 'h' expected codec 3 (float16) or 4 "
                     "(bfloat16) and finite values, got codec %lld or a value that is not finite", a[0]);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* linear(x, ldx, wp, bias or 0, y, ldy, m, n, k, isa, threads) */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[11];
    if (ints(args, nargs, 11, "linear", a) < 0) return NULL;
    /* what a call reads: y for any output; x and wp only with a sum to take */
    static const char *const all[11] = {"x", NULL, "wp", NULL, "y"}, *const out_only[11] = {NULL, NULL, NULL, NULL, "y"};
    if (a[6] > 0 && a[7] > 0 && addresses(a, a[8] > 0 ? all : out_only, 11, "linear") < 0) return NULL;
    if (isa_ok(a[9], "linear") < 0) return NULL;
    if (a[6] > 0 && a[7] > 0 && a[8] > 0 && hsg_check((const void *)(uintptr_t)a[2], a[7], a[8])) {
        PyErr_Format(PyExc_ValueError, "linear: argument 'wp' expected a packed copy of a %lld x %lld weight "
                     "(heterospec._gemm.pack), got memory without one", a[7], a[8]);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS hsg_linear((const float *)(uintptr_t)a[0], a[1], (const float *)(uintptr_t)a[2],
                                      (const float *)(uintptr_t)a[3], (float *)(uintptr_t)a[4], a[5], a[6], a[7],
                                      a[8], (int)a[9], (int)a[10]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* decoder_forward(model, eps, scale, cache, h, emb, fuse, n, cos, sin, req, slot, allowed, W, local, tap_layers,
 * taps, out_rows, keep, logits, hout, bad, nreal, per, isa, threads): decoder.h's hsd_forward.  model: (layers,
 * hidden, heads, kv_heads, head_dim, inter, vocab, table, final_norm, head, head_b, hidden_norm, flags, fc, fc_b,
 * fc_in, in_norm, fc_norms, final_norm_b, arch, act, rot, attn_cap, final_cap, res_mult, logit_div,
 * logit_mult, experts, top_k, moe_inter, moe); local:
 * (allowed, cos, sin) of the
 * HSD_LOCAL layers (allowed 0: none; cos, sin 0: the call's own); cache: (kv, batch, capacity, s_batch, s_kv, s_layer,
 * s_head); tap_layers, taps: 3 each (a tap address 0: not captured); cos, sin: not read with rot 0; out_rows 0:
 * the last keep rows; emb, fuse, hidden_norm, fc, fc_b, in_norm, fc_norms, final_norm_b, hout, bad, nreal 0: absent
 * (bad int64 [requests], nreal int64 [requests], per > 0 with nreal). */
static PyObject *py_decoder_forward(PyObject *self, PyObject *args) {
    (void)self;
    long long md[12], fc[5], cc[7], fnb, rot, moe_sizes[3];
    long long h, emb, fuse, n, cs, sn, req, slot, allowed, W, lo[3], tl[3], tp[3],
        out_rows, keep, logits, hout, bad, nreal, per;
    float eps, scale, attn_cap, final_cap, res_mult, logit_div, logit_mult;
    int flags, arch, act, isa, threads, moe;
    if (!PyArg_ParseTuple(args, "(LLLLLLLLLLLLiLLLLLLiiLfffffLLLi)ff(LLLLLLL)LLLLLLLLLL(LLL)(LLL)(LLL)LLLLLLLii",
                          &md[0],
                          &md[1], &md[2], &md[3], &md[4], &md[5], &md[6], &md[7], &md[8], &md[9], &md[10], &md[11],
                          &flags, &fc[0], &fc[1], &fc[2], &fc[3], &fc[4], &fnb, &arch, &act, &rot, &attn_cap,
                          &final_cap, &res_mult, &logit_div, &logit_mult, &moe_sizes[0], &moe_sizes[1],
                          &moe_sizes[2], &moe, &eps, &scale, &cc[0], &cc[1], &cc[2],
                          &cc[3], &cc[4], &cc[5], &cc[6], &h, &emb,
                          &fuse, &n, &cs, &sn, &req, &slot, &allowed, &W, &lo[0], &lo[1], &lo[2], &tl[0], &tl[1],
                          &tl[2], &tp[0], &tp[1], &tp[2], &out_rows, &keep, &logits, &hout, &bad, &nreal, &per, &isa,
                          &threads))
        return NULL;
    if (fuse && (!fc[0] || fc[2] <= 0 || fc[2] % 3)) {
        PyErr_Format(PyExc_ValueError, "decoder_forward: argument 'fuse' expected a model with fc and fc_in a positive "
                     "multiple of 3, got fc %s and fc_in %lld", fc[0] ? "given" : "absent", fc[2]);
        return NULL;
    }
    if (nreal && (!bad || per <= 0)) {
        PyErr_Format(PyExc_ValueError, "decoder_forward: argument 'per' expected > 0 with 'nreal' and 'bad', got %lld "
                     "(bad %s)", per, bad ? "given" : "absent");
        return NULL;
    }
    if (isa_ok(isa, "decoder_forward") < 0) return NULL;
    if (md[0] < 0 || md[1] <= 0 || md[2] <= 0 || md[3] <= 0 || md[2] % md[3] || md[4] <= 0 || md[4] % 2 || md[5] <= 0
        || md[6] <= 0 || (flags & ~(HSD_RESIDUAL_NORMED | HSD_HEAD_RAW | HSD_OUT_NORMED))) {
        PyErr_SetString(PyExc_ValueError, "decoder_forward: argument 'model' expected positive sizes (heads a multiple "
                                          "of kv_heads, an even head_dim) and known flags");
        return NULL;
    }
    if (rot < 0 || rot > md[4] || rot % 2 || act < HSD_SILU_GLU || act > HSD_GELU_TANH_GLU
        || (arch & ~(HSD_LAYERNORM | HSD_PARALLEL | HSD_SHARED_NORM | HSD_ROT_PAIRS | HSD_POST_ONLY | HSD_QK_NORM_ALL
                     | HSD_H_FIRST | HSD_QK_NORM_AFTER)) || ((arch & HSD_H_FIRST) && !(arch & HSD_PARALLEL))
        || ((arch & HSD_SHARED_NORM) && !(arch & HSD_PARALLEL)) || ((arch & HSD_POST_ONLY) && (arch & HSD_PARALLEL))
        || !(attn_cap >= 0.0f) || !(final_cap >= 0.0f)
        || isinf(attn_cap) || isinf(final_cap) || !isfinite(res_mult) || !isfinite(logit_div) || logit_div == 0.0f
        || (res_mult != 1.0f && (arch & HSD_PARALLEL)) || !isfinite(logit_mult)) {
        char msg[512]; /* (PyErr_Format has no %g) */
        snprintf(msg, sizeof msg, "decoder_forward: argument 'model' expected rot even in [0, head_dim %lld], act "
                 "0-4, arch bits 1|2|4|8|16|32|64|128 (4 and 64 with 2, 16 without 2), finite caps >= 0, a finite "
                 "res_mult (1 with 2), a finite nonzero logit_div and a finite logit_mult, got rot %lld, act %d, "
                 "arch %d, caps %g and %g, res_mult %g, logit_div %g, logit_mult %g", md[4], rot, act, arch,
                 (double)attn_cap, (double)final_cap, (double)res_mult, (double)logit_div, (double)logit_mult);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    if (md[11] && (arch || act != HSD_SILU_GLU)) {
        PyErr_SetString(PyExc_ValueError, "decoder_forward: argument 'model' with a hidden_norm (the EAGLE-3 draft's "
                                          "layout) expected rmsnorm and a SiLU-gated MLP (arch 0, act 0)");
        return NULL;
    }
    if (md[11] && (md[0] != 1 || !emb)) {
        PyErr_SetString(PyExc_ValueError, "decoder_forward: argument 'model' with a hidden_norm (the EAGLE-3 draft's "
                                          "layout) expected one layer and the tokens' embeddings (emb)");
        return NULL;
    }
    if (moe_sizes[0] < 0 || (moe_sizes[0] > 0 && (moe_sizes[1] < 1 || moe_sizes[1] > moe_sizes[0] || moe_sizes[2] <= 0
                                                   || (moe & ~(HSD_MOE_NORM | HSD_MOE_TOPK_SOFTMAX))
                                                   || act != HSD_SILU_GLU))) {
        PyErr_Format(PyExc_ValueError, "decoder_forward: argument 'model' expected experts >= 0 and, with experts, "
                     "top_k in [1, experts], moe_inter > 0, moe bits 1|2 and act 0 (SiLU-gated), got experts %lld, "
                     "top_k %lld, moe_inter %lld, moe %d, act %d", moe_sizes[0], moe_sizes[1], moe_sizes[2], moe, act);
        return NULL;
    }
    if (n <= 0) Py_RETURN_NONE;
    const long long ptrs[] = {md[7], md[8], md[9], cc[0], h, rot ? cs : 1, rot ? sn : 1, req, slot, allowed,
                              keep > 0 ? logits : 1};
    static const char *const names[] = {"table", "final_norm", "head", "kv", "h", "cos", "sin", "req", "slot",
                                        "allowed", "logits"};
    if (addresses(ptrs, names, 11, "decoder_forward") < 0) return NULL;
    const int64_t *table = (const int64_t *)(uintptr_t)md[7];
    for (long long L = 0; L < md[0]; L++)
        if (table[L * HSD_FIELDS + HSD_LOCAL] && !lo[0]) {
            PyErr_Format(PyExc_ValueError, "decoder_forward: argument 'local' expected the local rows' columns "
                         "(allowed) for layer %lld, a local layer, got 0", L);
            return NULL;
        }
    /* (LN2 not with one norm; neither LN1 nor LN2 without norms before the blocks) */
    static const int need[] = {HSD_QKV, HSD_O, HSD_GU, HSD_DOWN, HSD_LN1, HSD_LN2};
    const size_t needed = sizeof need / sizeof *need - ((arch & HSD_POST_ONLY) ? 2 : (arch & HSD_SHARED_NORM) ? 1 : 0);
    for (long long L = 0; L < md[0]; L++) { /* a mixture-of-experts layer: its experts; GU, DOWN and the shared gate
                                             * together or not at all */
        const int64_t *row = table + L * HSD_FIELDS;
        if (!row[HSD_ROUTER] && !row[HSD_EXPERTS] && !row[HSD_SHARED_GATE]) continue;
        if (!row[HSD_ROUTER] || !row[HSD_EXPERTS] || !moe_sizes[0] || (row[HSD_GU] != 0) != (row[HSD_DOWN] != 0)
            || (row[HSD_GU] != 0) != (row[HSD_SHARED_GATE] != 0)) {
            PyErr_Format(PyExc_ValueError, "decoder_forward: argument 'model' expected layer %lld, a mixture of "
                         "experts, to have its router and experts (and the model experts > 0), and a shared expert's "
                         "gate/up, down and gate all or none, got router %s, experts %s (model %lld), gate/up %s, down "
                         "%s, gate %s", L, row[HSD_ROUTER] ? "given" : "0", row[HSD_EXPERTS] ? "given" : "0",
                         moe_sizes[0], row[HSD_GU] ? "given" : "0", row[HSD_DOWN] ? "given" : "0",
                         row[HSD_SHARED_GATE] ? "given" : "0");
            return NULL;
        }
    }
    for (long long L = 0; L < md[0]; L++)
        for (size_t i = 0; i < needed; i++)
            if (table[L * HSD_FIELDS + need[i]] == 0
                && !(table[L * HSD_FIELDS + HSD_ROUTER] && (need[i] == HSD_GU || need[i] == HSD_DOWN))) {
                PyErr_Format(PyExc_ValueError, "decoder_forward: argument 'model' expected the address of every "
                             "layer's weights, got 0 for layer %lld field %d", L, need[i]);
                return NULL;
            }
    hsd_model m = {md[0], md[1], md[2], md[3], md[4], md[5], md[6], eps, scale, table,
                   (const float *)(uintptr_t)md[8], (const float *)(uintptr_t)md[9], (const float *)(uintptr_t)md[10],
                   (const float *)(uintptr_t)md[11], flags, (const float *)(uintptr_t)fc[0],
                   (const float *)(uintptr_t)fc[1], (const float *)(uintptr_t)fc[3], (const float *)(uintptr_t)fc[4],
                   fc[2], (const float *)(uintptr_t)fnb, arch, act, rot, attn_cap, final_cap, res_mult, logit_div,
                   logit_mult, moe_sizes[0], moe_sizes[1], moe_sizes[2], moe};
    const hsd_local local = {(const uint8_t *)(uintptr_t)lo[0], (const float *)(uintptr_t)lo[1],
                             (const float *)(uintptr_t)lo[2]};
    hsd_cache c = {(float *)(uintptr_t)cc[0], cc[1], cc[2], cc[3], cc[4], cc[5], cc[6]};
    int64_t taps_at[3] = {tl[0], tl[1], tl[2]};
    float *taps[3] = {(float *)(uintptr_t)tp[0], (float *)(uintptr_t)tp[1], (float *)(uintptr_t)tp[2]};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = hsd_forward(&m, &c, (float *)(uintptr_t)h, (const float *)(uintptr_t)emb,
                                            (const float *)(uintptr_t)fuse, n,
                                            (const float *)(uintptr_t)cs, (const float *)(uintptr_t)sn,
                                            (const int64_t *)(uintptr_t)req, (const int64_t *)(uintptr_t)slot,
                                            (const uint8_t *)(uintptr_t)allowed, W, lo[0] ? &local : NULL, taps_at,
                                            taps,
                                            (const int64_t *)(uintptr_t)out_rows, keep, (float *)(uintptr_t)logits,
                                            (float *)(uintptr_t)hout, (int64_t *)(uintptr_t)bad,
                                            (const int64_t *)(uintptr_t)nreal, per, isa, threads);
    Py_END_ALLOW_THREADS if (rc == -1) {
        PyErr_Format(PyExc_ValueError, "decoder_forward: arguments 'req', 'slot', 'out_rows', 'W' and 'keep' expected "
                     "cache rows in [0, %lld), columns in [0, %lld), rows in [0, %lld), W <= %lld and keep <= %lld; "
                     "got one out of range", cc[1], cc[2], n, cc[2], n);
        return NULL;
    }
    if (rc == -2) return PyErr_NoMemory();
    if (rc == -3) {
        PyErr_SetString(PyExc_ValueError, "decoder_forward: argument 'model' expected each weight's packed copy "
                                          "(heterospec._gemm.pack) at its layer's shapes, got one that is not");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* dot(a, b, d, isa) -> float; exp(x, n, isa) in place; rmsnorm(x, w, y, d, eps, isa); attend(q, k, v, stride,
 * allowed, W, scale, out, d, isa): decoder.h's pieces, for the tests. */
static PyObject *py_dot(PyObject *self, PyObject *args) {
    (void)self;
    long long a, b, d;
    int isa;
    if (!PyArg_ParseTuple(args, "LLLi", &a, &b, &d, &isa) || isa_ok(isa, "dot") < 0) return NULL;
    const long long p[] = {a, b};
    static const char *const names[] = {"a", "b"};
    if (d > 0 && addresses(p, names, 2, "dot") < 0) return NULL;
    return PyFloat_FromDouble(hsd_dot((const float *)(uintptr_t)a, (const float *)(uintptr_t)b, d, isa));
}

static PyObject *py_exp(PyObject *self, PyObject *args) {
    (void)self;
    long long x, n;
    int isa;
    if (!PyArg_ParseTuple(args, "LLi", &x, &n, &isa) || isa_ok(isa, "exp") < 0) return NULL;
    static const char *const names[] = {"x"};
    if (n > 0 && addresses(&x, names, 1, "exp") < 0) return NULL;
    hsd_exp((float *)(uintptr_t)x, n, isa);
    Py_RETURN_NONE;
}

static PyObject *py_nonfinite(PyObject *self, PyObject *args) {
    (void)self;
    long long x, n;
    if (!PyArg_ParseTuple(args, "LL", &x, &n)) return NULL;
    static const char *const names[] = {"x"};
    if (n > 0 && addresses(&x, names, 1, "nonfinite") < 0) return NULL;
    return PyBool_FromLong(hsd_nonfinite((const float *)(uintptr_t)x, n < 0 ? 0 : n));
}

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    (void)self;
    long long x, w, y, d;
    float eps;
    int isa;
    if (!PyArg_ParseTuple(args, "LLLLfi", &x, &w, &y, &d, &eps, &isa) || isa_ok(isa, "rmsnorm") < 0) return NULL;
    const long long p[] = {x, w, y};
    static const char *const names[] = {"x", "w", "y"};
    if (d > 0 && addresses(p, names, 3, "rmsnorm") < 0) return NULL;
    hsd_rmsnorm((const float *)(uintptr_t)x, (const float *)(uintptr_t)w, (float *)(uintptr_t)y, d, eps, isa);
    Py_RETURN_NONE;
}

/* layernorm(x, w, b, y, d, eps, isa) (b 0: none); act(kind, g, y, n, isa): decoder.h's hsd_layernorm, hsd_act */
static PyObject *py_layernorm(PyObject *self, PyObject *args) {
    (void)self;
    long long x, w, b, y, d;
    float eps;
    int isa;
    if (!PyArg_ParseTuple(args, "LLLLLfi", &x, &w, &b, &y, &d, &eps, &isa) || isa_ok(isa, "layernorm") < 0)
        return NULL;
    const long long p[] = {x, w, y};
    static const char *const names[] = {"x", "w", "y"};
    if (d > 0 && addresses(p, names, 3, "layernorm") < 0) return NULL;
    if (d > 0)
        hsd_layernorm((const float *)(uintptr_t)x, (const float *)(uintptr_t)w, (const float *)(uintptr_t)b,
                      (float *)(uintptr_t)y, d, eps, isa);
    Py_RETURN_NONE;
}

static PyObject *py_act(PyObject *self, PyObject *args) {
    (void)self;
    long long g, y, n;
    int kind, isa;
    if (!PyArg_ParseTuple(args, "iLLLi", &kind, &g, &y, &n, &isa) || isa_ok(isa, "act") < 0) return NULL;
    if (kind != HSD_GELU && kind != HSD_GELU_TANH && kind != HSD_RELU) {
        PyErr_Format(PyExc_ValueError,
                     "act: argument 'kind' expected %d (gelu), %d (its tanh form) or %d (relu), got %d", HSD_GELU,
                     HSD_GELU_TANH, HSD_RELU, kind);
        return NULL;
    }
    const long long p[] = {g, y};
    static const char *const names[] = {"g", "y"};
    if (n > 0 && addresses(p, names, 2, "act") < 0) return NULL;
    if (g == y && n > 0) {
        PyErr_SetString(PyExc_ValueError, "act: argument 'y' expected a buffer other than 'g', got the same address");
        return NULL;
    }
    if (n > 0) hsd_act(kind, (const float *)(uintptr_t)g, (float *)(uintptr_t)y, n, isa);
    Py_RETURN_NONE;
}

/* softcap(x, n, cap, isa): decoder.h's hsd_softcap in place (cap > 0 and finite) */
static PyObject *py_softcap(PyObject *self, PyObject *args) {
    (void)self;
    long long x, n;
    float cap;
    int isa;
    if (!PyArg_ParseTuple(args, "LLfi", &x, &n, &cap, &isa) || isa_ok(isa, "softcap") < 0) return NULL;
    if (!(cap > 0.0f) || isinf(cap)) {
        char msg[96]; /* (PyErr_Format has no %g) */
        snprintf(msg, sizeof msg, "softcap: argument 'cap' expected a finite value > 0, got %g", (double)cap);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    static const char *const names[] = {"x"};
    if (n > 0 && addresses(&x, names, 1, "softcap") < 0) return NULL;
    if (n > 0) hsd_softcap((float *)(uintptr_t)x, n, cap, isa);
    Py_RETURN_NONE;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    long long q, k, v, stride, allowed, W, out, d;
    float scale, cap = 0.0f;
    int isa;
    if (!PyArg_ParseTuple(args, "LLLLLLfLLi|f", &q, &k, &v, &stride, &allowed, &W, &scale, &out, &d, &isa, &cap)
        || isa_ok(isa, "attend") < 0)
        return NULL;
    const long long p[] = {q, k, v, allowed, out};
    static const char *const names[] = {"q", "k", "v", "allowed", "out"};
    if (W > 0 && d > 0 && addresses(p, names, 5, "attend") < 0) return NULL;
    float *scores = malloc((size_t)(W > 0 ? W : 1) * sizeof(float));
    int64_t *cols = malloc((size_t)(W > 0 ? W : 1) * sizeof(int64_t));
    if (!scores || !cols) {
        free(scores);
        free(cols);
        return PyErr_NoMemory();
    }
    hsd_attend((const float *)(uintptr_t)q, (const float *)(uintptr_t)k, (const float *)(uintptr_t)v, stride,
               (const uint8_t *)(uintptr_t)allowed, W, scale, cap, (float *)(uintptr_t)out, d, scores, cols, isa);
    free(scores);
    free(cols);
    Py_RETURN_NONE;
}

static PyObject *py_packed_floats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[2];
    if (ints(args, nargs, 2, "packed_floats", a) < 0) return NULL;
    return PyLong_FromLongLong(hsg_packed_floats(a[0], a[1]));
}

static PyObject *py_packed_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[3];
    if (ints(args, nargs, 3, "packed_bytes", a) < 0) return NULL;
    return PyLong_FromLongLong(hsg_packed_bytes((int)a[0], a[1], a[2]));
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
    {"decoder_forward", py_decoder_forward, METH_VARARGS, "decoder_forward(model, eps, scale, cache, h, emb, fuse, n, "
     "cos, sin, req, slot, allowed, W, local, tap_layers, taps, out_rows, keep, logits, hout, bad, nreal, per, isa, "
     "threads)"},
    {"nonfinite", py_nonfinite, METH_VARARGS, "nonfinite(x, n) -> whether x[0..n) holds a NaN or +inf or is all -inf"},
    {"dot", py_dot, METH_VARARGS, "dot(a, b, d, isa) -> the 16-lane dot product of decoder.h"},
    {"exp", py_exp, METH_VARARGS, "exp(x, n, isa): decoder.h's exp, in place"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "rmsnorm(x, w, y, d, eps, isa)"},
    {"attend", py_attend, METH_VARARGS, "attend(q, k, v, stride, allowed, W, scale, out, d, isa[, cap])"},
    {"softcap", py_softcap, METH_VARARGS, "softcap(x, n, cap, isa): x = cap * tanh(x / cap) in place"},
    {"layernorm", py_layernorm, METH_VARARGS, "layernorm(x, w, b, y, d, eps, isa)"},
    {"act", py_act, METH_VARARGS, "act(kind, g, y, n, isa)"},
    {"packed_floats", FAST(py_packed_floats), "packed_floats(n, k) -> floats of the packed copy"},
    {"packed_bytes", FAST(py_packed_bytes), "packed_bytes(codec, n, k) -> bytes of the packed copy (-1: cannot)"},
    {"find_codes", FAST(py_find_codes), "find_codes(codec, w, q, d, m, n, k): a weight's block codes, if it has them"},
    {"pack_codes", FAST(py_pack_codes), "pack_codes(codec, q, d, m, wp, n, k): a coded weight's packed copy"},
    {"pack_half", FAST(py_pack_half), "pack_half(codec, h, wp, n, k): a float16 / bfloat16 weight's packed copy"},
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
