/*
 * verify.c -- lossless acceptance of a draft tree against the target's logits.
 *
 * Greedy: walk from the root, at each node moving to the child whose token is the target's argmax
 * there; the accepted path plus the argmax after it is exactly the target's own greedy continuation.
 *
 * Sampling: recursive rejection sampling with point-mass proposals (the draft proposes each sibling
 * deterministically, q = 1), as in EAGLE's evaluate_posterior and SGLang's target-only tree sampling.
 * At a node with target distribution p, siblings are tried in index order; sibling x is accepted with
 * probability p(x); on rejection p(x) is set to 0 and p renormalised.  If no sibling is accepted the
 * next token is drawn from what is left of p.  Then P(emit x) = p(x) for every x: for the first sibling
 * P = p(x1); for the second (1 - p(x1)) * p(x2) / (1 - p(x1)) = p(x2); and the residual draw covers every
 * token never proposed, so the output has exactly the target's (warped) distribution.
 *
 * Randomness is Philox4x32-10 keyed by the seed with counter offset + draw index, so that the CPU and
 * CUDA implementations consume identical uniforms and can be compared draw for draw.
 */
#include "common.h"

#include <stdlib.h>

/* ---- Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) --------- */

void hs_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    hs_philox_rounds(c, key[0], key[1]);
    memcpy(out, c, sizeof c);
}

double hs_philox_uniform(uint64_t seed, uint64_t offset, uint64_t j) { return hs_philox_u(seed, offset, j); }

/* ---- shared tree checks --------------------------------------------------------------------------- */

static hs_status hs_check_tree(const char *op, const void *tokens, hs_dtype tdt, const void *parents,
                               hs_dtype pdt, int64_t n, int64_t V, hs_error *err) {
    if (n < 1)
        return hs_fail(err, HS_ERR_VALUE, op, "tree_tokens", "expected at least the root node, got %lld nodes",
                       (long long)n);
    for (int64_t i = 0; i < n; i++) {
        int64_t p = hs_load_id(parents, pdt, i), t = hs_load_id(tokens, tdt, i);
        if (i == 0 ? p != -1 : (p < 0 || p >= i))
            return hs_fail(err, HS_ERR_VALUE, op, "tree_parents",
                           i == 0 ? "expected -1 for the root (node 0), got %lld at [%lld]"
                                  : "expected 0 <= tree_parents[i] < i, got %lld at [%lld]",
                           (long long)p, (long long)i);
        if (t < 0 || t >= V)
            return hs_fail(err, HS_ERR_VALUE, op, "tree_tokens", "expected ids in [0, V = %lld), got %lld at [%lld]",
                           (long long)V, (long long)t, (long long)i);
    }
    return HS_OK;
}

/* The per-request slices of a batch of trees, after checking that row b is a valid tree. */
typedef struct {
    const char *tokens, *parents, *logits;
    int64_t n;
} hs_tree_row;

static hs_status hs_tree_row_at(const char *op, const void *tree_tokens, hs_dtype token_dtype,
                                const void *tree_parents, hs_dtype parent_dtype, const void *logits,
                                hs_dtype logit_dtype, int64_t b, int64_t T, const int64_t *n, int64_t V,
                                hs_tree_row *row, hs_error *err) {
    if (b == 0) { /* dtypes are the same for every row: check them once */
        if (!hs_is_id_dtype(token_dtype))
            return hs_fail(err, HS_ERR_DTYPE, op, "tree_tokens", "expected int32 or int64, got %s",
                           hs_dtype_name(token_dtype));
        if (!hs_is_id_dtype(parent_dtype))
            return hs_fail(err, HS_ERR_DTYPE, op, "tree_parents", "expected int32 or int64, got %s",
                           hs_dtype_name(parent_dtype));
        if (!hs_is_logit_dtype(logit_dtype))
            return hs_fail(err, HS_ERR_DTYPE, op, "target_logits", "expected float16, bfloat16 or float32, got %s",
                           hs_dtype_name(logit_dtype));
    }
    row->tokens = (const char *)tree_tokens + (size_t)(b * T) * hs_dtype_size(token_dtype);
    row->parents = (const char *)tree_parents + (size_t)(b * T) * hs_dtype_size(parent_dtype);
    row->logits = (const char *)logits + (size_t)(b * T * V) * hs_dtype_size(logit_dtype);
    row->n = n[b];
    if (row->n > T)
        return hs_fail(err, HS_ERR_VALUE, op, "tree_tokens", "expected at most %lld nodes, got %lld", (long long)T,
                       (long long)row->n);
    return hs_check_tree(op, row->tokens, token_dtype, row->parents, parent_dtype, row->n, V, err);
}

/* argmax of a checked logits row (ties to the lower id) */
static hs_status hs_row_argmax(const void *logits, hs_dtype dt, int64_t row, int64_t V, const char *op,
                               int64_t *out, hs_error *err) {
    if (dt == HS_FLOAT32) {
        /* float32 rows: the vectorised checked max (the same errors, at the same first column), then the first
         * column holding it -- the scalar loop below took 0.1 ms a row at V = 49,152 on a 2-core EPYC */
        const float *x = (const float *)logits + row * V;
        float m;
        hs_status st = hs_row_check_max(x, V, op, "target_logits", row, &m, err);
        if (st != HS_OK) return st;
        int64_t v = 0;
        while (x[v] != m) v++;
        *out = v;
        return HS_OK;
    }
    float best = -INFINITY;
    int64_t arg = -1;
    for (int64_t v = 0; v < V; v++) {
        float a = hs_load_logit(logits, dt, row * V + v);
        if (a != a || a == INFINITY)
            return hs_fail(err, HS_ERR_NONFINITE, op, "target_logits",
                           "expected finite values or -inf (masked tokens), got %s at [%lld, %lld]",
                           a != a ? "nan" : "+inf", (long long)row, (long long)v);
        if (a > best) {
            best = a;
            arg = v;
        }
    }
    if (arg < 0)
        return hs_fail(err, HS_ERR_NONFINITE, op, "target_logits",
                       "expected at least one value > -inf per row, got an all -inf row %lld", (long long)row);
    *out = arg;
    return HS_OK;
}

/* ---- greedy -------------------------------------------------------------------------------------- */

hs_status hs_verify_greedy(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                           hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n, const void *logits,
                           hs_dtype logit_dtype, int64_t V, int64_t *out_path, int64_t *out_len,
                           int64_t *out_next, hs_error *err) {
    static const char op[] = "verify_greedy";
    for (int64_t b = 0; b < batch; b++) {
        hs_tree_row row;
        hs_status st = hs_tree_row_at(op, tree_tokens, token_dtype, tree_parents, parent_dtype, logits, logit_dtype,
                                      b, T, n, V, &row, err);
        if (st != HS_OK) return st;
        const char *tk = row.tokens, *pa = row.parents, *lg = row.logits;
        int64_t nb = row.n;
        int64_t *path = out_path + b * T, len = 0, cur = 0, am = 0;
        path[len++] = 0;
        for (;;) {
            st = hs_row_argmax(lg, logit_dtype, cur, V, op, &am, err);
            if (st != HS_OK) return st;
            int64_t next = -1;
            for (int64_t j = cur + 1; j < nb; j++) {
                if (hs_load_id(pa, parent_dtype, j) == cur && hs_load_id(tk, token_dtype, j) == am) {
                    next = j;
                    break;
                }
            }
            if (next < 0) break;
            path[len++] = next;
            cur = next;
        }
        out_len[b] = len;
        out_next[b] = am;
    }
    return HS_OK;
}

/* ---- sampling ------------------------------------------------------------------------------------ */

size_t hs_verify_sample_workspace_bytes(int64_t T, int64_t V) {
    /* w (V doubles), a float32 copy of a converted row (V floats), a sorted candidate list for top-k /
     * top-p (V entries), the tokens rejected at the current node (T int64) */
    size_t v = (size_t)(V > 0 ? V : 1), t = (size_t)(T > 0 ? T : 1);
    return v * sizeof(double) + v * sizeof(float) + 16 + v * sizeof(hs_kv) + t * sizeof(int64_t);
}

/* w[v] = exp(x[v] / T - zmax) for the whole row */
HS_HOT static void hs_exp_row(const float *x, int64_t V, double T, double zmax, double *w) {
    for (int64_t v = 0; v < V; v++) w[v] = hs_exp_nonpos_f64((double)x[v] / T - zmax);
}

/* The "lane sum" of docs/ops.md: 8 lanes, lane l summing w[v] for v = l (mod 8) in ascending v, then
 * ((lane0 + lane1) + lane2) + ... + lane7.  A fixed order (so the NumPy twin reproduces it bit for bit)
 * that still runs as vector adds. */
HS_HOT static double hs_lane_sum(const double *w, int64_t V) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t v8 = V - V % 8;
    for (int64_t v = 0; v < v8; v += 8)
        for (int l = 0; l < 8; l++) lane[l] += w[v + l];
    for (int64_t v = v8; v < V; v++) lane[v - v8] += w[v];
    double s = lane[0];
    for (int l = 1; l < 8; l++) s += lane[l];
    return s;
}

/* Warp one row the HuggingFace way (temperature, top-k, top-p, min-p) into unnormalised weights w[V]. */
static hs_status hs_warp_row(const void *logits, hs_dtype dt, int64_t row, int64_t V, hs_sampling sp,
                             double *w, float *conv, hs_kv *sorted, const char *op, hs_error *err) {
    const float *x = hs_row_f32(logits, dt, row, V, conv);
    float m;
    hs_status st = hs_row_check_max(x, V, op, "target_logits", row, &m, err);
    if (st != HS_OK) return st;
    const double T = sp.temperature, zmax = (double)m / T;
    /* z = x / T is monotonic in x, so top-k/top-p orders can be taken on x directly. */
    int64_t nsorted = 0; /* > 0: sorted[0..nsorted) are all the tokens with mass, best first */
    int sparse = 0;      /* w is zero outside sorted[0..nsorted) */
    if (sp.top_k > 0 && sp.top_k < V) {
        hs_topk_f32(x, V, sp.top_k, sorted);
        const float thr = (float)sorted[sp.top_k - 1].v; /* ties at the threshold survive, as in HF */
        const int64_t last = sorted[sp.top_k - 1].i;
        int ties_beyond = 0;
        for (int64_t v = last + 1; v < V; v++) ties_beyond |= x[v] == thr;
        if (!ties_beyond) {
            /* the top_k tokens are exactly the survivors: exponentiate just those (the same function
             * as the full-row loop, so the same values) */
            memset(w, 0, (size_t)V * sizeof *w);
            for (int64_t i = 0; i < sp.top_k; i++)
                w[sorted[i].i] = hs_exp_nonpos_f64((double)x[sorted[i].i] / T - zmax);
            nsorted = sp.top_k;
            sparse = 1;
        } else { /* rare: more than top_k survivors; list them all */
            hs_exp_row(x, V, T, zmax, w);
            for (int64_t v = 0; v < V; v++)
                if (x[v] < thr) w[v] = 0.0;
                else sorted[nsorted++] = (hs_kv){x[v], v};
            hs_sort_best_first(sorted, nsorted);
        }
    } else {
        hs_exp_row(x, V, T, zmax, w);
    }
    if (sp.top_p < 1.0) {
        double W = hs_lane_sum(w, V);
        if (nsorted == 0) {
            /* No top-k list: find the smallest best-first prefix holding mass >= top_p by growing a
             * top-k (64, 256, ...) instead of sorting the whole vocabulary. */
            int64_t kk = 64 < V ? 64 : V;
            for (;;) {
                hs_topk_f32(x, V, kk, sorted);
                double c = 0.0;
                for (int64_t i = 0; i < kk; i++) c += w[sorted[i].i] / W;
                if (c >= sp.top_p || kk == V) break;
                kk = kk * 4 < V ? kk * 4 : V;
            }
            nsorted = kk;
        }
        double c = 0.0;
        int64_t keep = 0;
        while (keep < nsorted && c < sp.top_p) {
            c += w[sorted[keep].i] / W;
            keep++;
        }
        if (sparse) { /* only the listed tokens have mass: zero the ones cut */
            for (int64_t i = keep; i < nsorted; i++) w[sorted[i].i] = 0.0;
        } else { /* zero everything, then put back the kept prefix */
            for (int64_t i = 0; i < keep; i++) sorted[i].v = w[sorted[i].i];
            memset(w, 0, (size_t)V * sizeof *w);
            for (int64_t i = 0; i < keep; i++) w[sorted[i].i] = sorted[i].v;
        }
        nsorted = keep;
        sparse = 1;
    }
    if (sp.min_p > 0.0) {
        /* min-p last (HuggingFace's MinPLogitsWarper after top-p): p_v < min_p * max p, and p_v / max p = w_v (the
         * largest w is exp(0) = 1), renormalised or not; the listed survivors only, when there is a list */
        if (sparse) {
            for (int64_t i = 0; i < nsorted; i++)
                if (w[sorted[i].i] < sp.min_p) w[sorted[i].i] = 0.0;
        } else {
            for (int64_t v = 0; v < V; v++)
                if (w[v] < sp.min_p) w[v] = 0.0;
        }
    }
    return HS_OK;
}

hs_status hs_check_sampling(const char *op, hs_sampling sp, hs_error *err) {
    if (!(sp.temperature >= HS_MIN_TEMPERATURE) || !isfinite(sp.temperature))
        return hs_fail(err, HS_ERR_VALUE, op, "temperature",
                       "expected a finite value >= 1e-30 (use verify_greedy for greedy decoding), got %g",
                       sp.temperature);
    if (sp.top_k < 0)
        return hs_fail(err, HS_ERR_VALUE, op, "top_k", "expected >= 0 (0 disables it), got %lld",
                       (long long)sp.top_k);
    if (!(sp.top_p > 0.0 && sp.top_p <= 1.0))
        return hs_fail(err, HS_ERR_VALUE, op, "top_p", "expected a value in (0, 1], got %g", sp.top_p);
    if (!(sp.min_p >= 0.0 && sp.min_p <= 1.0))
        return hs_fail(err, HS_ERR_VALUE, op, "min_p", "expected a value in [0, 1] (0 disables it), got %g", sp.min_p);
    return HS_OK;
}

hs_status hs_verify_sample(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                           hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n, const void *logits,
                           hs_dtype logit_dtype, int64_t V, hs_sampling sp, const uint64_t *seeds,
                           const uint64_t *offsets, int64_t *out_path, int64_t *out_len,
                           int64_t *out_next, int64_t *out_draws, void *ws, size_t ws_bytes,
                           hs_error *err) {
    static const char op[] = "verify_sample";
    hs_status chk = hs_check_sampling(op, sp, err);
    if (chk != HS_OK) return chk;
    size_t need = hs_verify_sample_workspace_bytes(T, V);
    if (ws_bytes < need)
        return hs_fail(err, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu", need, ws_bytes);
    double *w = (double *)ws;
    float *conv = (float *)(w + V);
    hs_kv *sorted = (hs_kv *)(((uintptr_t)(conv + V) + 15u) & ~(uintptr_t)15u); /* padding counted */
    int64_t *rejected = (int64_t *)(sorted + V);

    for (int64_t b = 0; b < batch; b++) {
        hs_tree_row row;
        hs_status st = hs_tree_row_at(op, tree_tokens, token_dtype, tree_parents, parent_dtype, logits, logit_dtype,
                                      b, T, n, V, &row, err);
        if (st != HS_OK) return st;
        const char *tk = row.tokens, *pa = row.parents, *lg = row.logits;
        int64_t nb = row.n;
        int64_t *path = out_path + b * T, len = 0, cur = 0;
        uint64_t draw = 0;
        path[len++] = 0;
        for (;;) {
            st = hs_warp_row(lg, logit_dtype, cur, V, sp, w, conv, sorted, op, err);
            if (st != HS_OK) return st;
            double R = hs_lane_sum(w, V);
            int64_t nrej = 0, accepted = -1;
            for (int64_t j = cur + 1; j < nb && accepted < 0; j++) {
                if (hs_load_id(pa, parent_dtype, j) != cur) continue;
                int64_t t = hs_load_id(tk, token_dtype, j);
                int seen = 0;
                for (int64_t r = 0; r < nrej; r++) seen |= rejected[r] == t;
                if (seen) continue; /* a duplicate sibling token was already rejected: no draw */
                double u = hs_philox_uniform(seeds[b], offsets[b], draw++);
                if (w[t] > 0.0 && u * R < w[t]) {
                    accepted = j;
                } else {
                    rejected[nrej++] = t;
                    R -= w[t];
                    w[t] = 0.0;
                }
            }
            if (accepted >= 0) {
                path[len++] = accepted;
                cur = accepted;
                continue;
            }
            /* residual draw by inverse CDF over ascending ids */
            double u = hs_philox_uniform(seeds[b], offsets[b], draw++);
            double S = hs_lane_sum(w, V);
            int64_t next = -1;
            if (S > 0.0) {
                double target = u * S, c = 0.0;
                int64_t last_pos = -1;
                for (int64_t v = 0; v < V; v++) {
                    if (w[v] <= 0.0) continue;
                    c += w[v];
                    last_pos = v;
                    if (c > target) {
                        next = v;
                        break;
                    }
                }
                /* the running sum is sequential, S a lane sum: if rounding leaves c short of u * S, the
                 * largest id with mass is the one the exact arithmetic would pick */
                if (next < 0) next = last_pos;
            } else if (nrej > 0) {
                next = rejected[nrej - 1]; /* every token with mass was rejected (rounding only) */
            } else {
                return hs_fail(err, HS_ERR_NONFINITE, op, "target_logits",
                               "expected a row with probability mass, got none at row %lld", (long long)cur);
            }
            out_next[b] = next;
            break;
        }
        out_len[b] = len;
        out_draws[b] = (int64_t)draw;
    }
    return HS_OK;
}
