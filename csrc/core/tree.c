/*
 * tree.c -- the EAGLE-2/3 dynamic draft tree: expansion, Top-N reranking and the verification tree.
 *
 * Expansion (EAGLE-2 "topK_genrate"): each level turns the draft logits of the B current beams into
 * their top-k children, with cumulative log-probability scores (the log of the path value
 * V_i = prod c_j of the HeteroSpec paper, Sec. 2.2) and the per-row top-k entropy that HeteroSpec sums
 * along the most confident path (Eq. 1); the k best children over all beams become the next beams.
 * Reranking keeps the Top-N candidates by score; because a child's score never exceeds its parent's,
 * that set is a subtree.  hs_build_tree turns it into what the target's verification forward needs:
 * tokens, parent and depth per node (depth + prefix length = position id), the ancestor-or-self mask
 * (the 4D tree attention mask) and one root->leaf row per leaf (retrieve paths).
 */
#include "common.h"

#include <stdlib.h>

size_t hs_expand_workspace_bytes(int64_t B, int64_t k, int64_t Vd) {
    /* top-k heap of a row (k), top-k over all children (k), a float32 copy of a converted row (Vd) */
    (void)B; /* the per-level top-k runs over B*k float32 scores in place: no per-beam scratch */
    return (size_t)(2 * (k > 0 ? k : 1)) * sizeof(hs_kv) + (size_t)(Vd > 0 ? Vd : 0) * sizeof(float);
}

hs_status hs_expand(const void *logits, hs_dtype logit_dtype, int64_t batch, int64_t B, int64_t Vd,
                    const void *beam_scores, hs_dtype score_dtype, const void *beam_nodes,
                    hs_dtype node_dtype, int64_t k, const void *d2t, hs_dtype d2t_dtype,
                    int64_t node_offset, int64_t *out_tokens, float *out_scores, int64_t *out_parents,
                    float *out_entropy, int64_t *out_next_beams, void *ws, size_t ws_bytes,
                    hs_error *err) {
    static const char op[] = "expand";
    if (!hs_is_logit_dtype(logit_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "logits", "expected float16, bfloat16 or float32, got %s",
                       hs_dtype_name(logit_dtype));
    if (!hs_is_real_dtype(score_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "beam_scores", "expected float32 or float64, got %s",
                       hs_dtype_name(score_dtype));
    if (!hs_is_id_dtype(node_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "beam_nodes", "expected int32 or int64, got %s",
                       hs_dtype_name(node_dtype));
    if (d2t != NULL && !hs_is_id_dtype(d2t_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "d2t", "expected int32 or int64, got %s",
                       hs_dtype_name(d2t_dtype));
    if (batch < 0 || B < 1 || Vd < 1)
        return hs_fail(err, HS_ERR_VALUE, op, "logits", "expected shape [B, Vd] with B, Vd >= 1, got [%lld, %lld]",
                       (long long)B, (long long)Vd);
    if (k < 1 || k > Vd)
        return hs_fail(err, HS_ERR_VALUE, op, "k", "expected 1 <= k <= Vd = %lld, got %lld", (long long)Vd,
                       (long long)k);
    if (node_offset < 0)
        return hs_fail(err, HS_ERR_VALUE, op, "node_offset", "expected >= 0, got %lld", (long long)node_offset);
    size_t need = hs_expand_workspace_bytes(B, k, Vd);
    if (ws_bytes < need)
        return hs_fail(err, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu", need, ws_bytes);
    hs_kv *top = (hs_kv *)ws;
    hs_kv *best = top + k;
    float *conv = (float *)(best + k);

    for (int64_t bi = 0; bi < batch; bi++) {
        int64_t Bk = B * k;
        int64_t *tok = out_tokens + bi * Bk, *par = out_parents + bi * Bk;
        float *sc = out_scores + bi * Bk;
        for (int64_t b = 0; b < B; b++) {
            int64_t r = bi * B + b;
            double base = hs_load_real(beam_scores, score_dtype, r);
            if (base != base || base == INFINITY)
                return hs_fail(err, HS_ERR_NONFINITE, op, "beam_scores",
                               "expected finite values or -inf, got %g at [%lld]", base, (long long)b);
            int64_t node = hs_load_id(beam_nodes, node_dtype, r);
            if (node < -1)
                return hs_fail(err, HS_ERR_VALUE, op, "beam_nodes", "expected values >= -1, got %lld at [%lld]",
                               (long long)node, (long long)b);
            const float *x = hs_row_f32(logits, logit_dtype, r, Vd, conv);
            float m;
            hs_status st = hs_row_check_max(x, Vd, op, "logits", b, &m, err);
            if (st != HS_OK) return st;
            /* log_softmax(x)[id] = (x[id] - m) - ln(sum_v exp(x_v - m)); the subtraction is exact in
             * float64 */
            double lse = log(hs_sum_exp_shifted(x, Vd, m));
            hs_topk_f32(x, Vd, k, top);
            for (int64_t j = 0; j < k; j++) {
                int64_t id = top[j].i, o = b * k + j;
                int64_t t = id;
                if (d2t != NULL) {
                    t = id + hs_load_id(d2t, d2t_dtype, id);
                    if (t < 0)
                        return hs_fail(err, HS_ERR_VALUE, op, "d2t",
                                       "expected draft id + d2t[id] >= 0, got %lld + %lld = %lld",
                                       (long long)id, (long long)(t - id), (long long)t);
                }
                tok[o] = t;
                sc[o] = (float)(base + ((top[j].v - (double)m) - lse));
                par[o] = node;
            }
            out_entropy[r] = (float)hs_entropy_sorted(top, k, 1.0);
        }
        /* next beams: the k best children over all B*k by float32 score, ties to the lower number */
        hs_topk_f32(sc, Bk, k, best);
        for (int64_t j = 0; j < k; j++) out_next_beams[bi * k + j] = node_offset + best[j].i;
    }
    return HS_OK;
}

size_t hs_select_workspace_bytes(int64_t M) { return (size_t)(M > 0 ? M : 1) * sizeof(hs_kv); }

static int hs_cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

hs_status hs_select(const void *scores, hs_dtype score_dtype, int64_t batch, int64_t M,
                    const int64_t *m, const int64_t *n, int64_t N, int64_t *out, void *ws,
                    size_t ws_bytes, hs_error *err) {
    static const char op[] = "select";
    if (!hs_is_real_dtype(score_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "scores", "expected float32 or float64, got %s",
                       hs_dtype_name(score_dtype));
    size_t need = hs_select_workspace_bytes(M);
    if (ws_bytes < need)
        return hs_fail(err, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu", need, ws_bytes);
    hs_kv *heap = (hs_kv *)ws;
    for (int64_t b = 0; b < batch; b++) {
        int64_t mb = m != NULL ? m[b] : M, nb = n[b];
        const char *row = (const char *)scores + (size_t)(b * M) * hs_dtype_size(score_dtype);
        if (mb < 0 || mb > M)
            return hs_fail(err, HS_ERR_VALUE, op, "scores", "expected a row length in [0, %lld], got %lld",
                           (long long)M, (long long)mb);
        if (nb < 0 || nb > mb || nb > N)
            return hs_fail(err, HS_ERR_VALUE, op, "n", "expected 0 <= n <= M = %lld, got %lld", (long long)mb,
                           (long long)nb);
        for (int64_t i = 0; i < mb; i++) {
            double s = hs_load_real(row, score_dtype, i);
            if (s != s)
                return hs_fail(err, HS_ERR_NONFINITE, op, "scores", "expected no NaN, got nan at [%lld]",
                               (long long)i);
        }
        int64_t *o = out + b * N;
        if (nb == 0) continue;
        hs_topk_real(row, score_dtype, mb, nb, heap);
        for (int64_t j = 0; j < nb; j++) o[j] = heap[j].i;
        qsort(o, (size_t)nb, sizeof *o, hs_cmp_i64);
    }
    return HS_OK;
}

size_t hs_build_tree_workspace_bytes(int64_t M) {
    /* candidate -> tree index map (M int64), then a has-child flag per tree node (M + 1 bytes) */
    return (size_t)(M > 0 ? M : 0) * sizeof(int64_t) + (size_t)(M > 0 ? M : 0) + 1;
}

hs_status hs_build_tree(const void *tokens, hs_dtype token_dtype, const void *parents, hs_dtype parent_dtype,
                        int64_t batch,
                        int64_t M, const void *selected, hs_dtype sel_dtype, int64_t N,
                        const int64_t *n, const int64_t *root_tokens, int64_t *out_tokens,
                        int64_t *out_parents, int64_t *out_depths, uint8_t *out_mask,
                        int64_t *out_num_leaves, int64_t *out_max_depth, void *ws, size_t ws_bytes,
                        hs_error *err) {
    static const char op[] = "build_tree";
    if (!hs_is_id_dtype(token_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "tokens", "expected int32 or int64, got %s", hs_dtype_name(token_dtype));
    if (!hs_is_id_dtype(parent_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "parents", "expected int32 or int64, got %s", hs_dtype_name(parent_dtype));
    if (!hs_is_id_dtype(sel_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "selected", "expected int32 or int64, got %s",
                       hs_dtype_name(sel_dtype));
    size_t need = hs_build_tree_workspace_bytes(M);
    if (ws_bytes < need)
        return hs_fail(err, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu", need, ws_bytes);
    int64_t *tree_index = (int64_t *)ws; /* candidate -> tree node, -1 when not selected */
    uint8_t *has_child = (uint8_t *)(tree_index + M);
    for (int64_t c = 0; c < M; c++) tree_index[c] = -1;
    const int64_t T = N + 1;
    hs_status st = HS_OK;

    for (int64_t b = 0; b < batch && st == HS_OK; b++) {
        int64_t nb = n[b], R = root_tokens[b];
        const char *tk = (const char *)tokens + (size_t)(b * M) * hs_dtype_size(token_dtype);
        const char *pa = (const char *)parents + (size_t)(b * M) * hs_dtype_size(parent_dtype);
        const char *se = (const char *)selected + (size_t)(b * N) * hs_dtype_size(sel_dtype);
        int64_t *ot = out_tokens + b * T, *op_ = out_parents + b * T, *od = out_depths + b * T;
        uint8_t *mk = out_mask + (size_t)(b * T * T);
        if (nb < 0 || nb > N || nb > M) {
            st = hs_fail(err, HS_ERR_VALUE, op, "selected", "expected 0 <= n <= M = %lld candidates, got %lld",
                         (long long)M, (long long)nb);
            break;
        }
        if (R < 0) {
            st = hs_fail(err, HS_ERR_VALUE, op, "root_token", "expected a token id >= 0, got %lld", (long long)R);
            break;
        }
        int64_t T_b = nb + 1;
        ot[0] = R;
        op_[0] = -1;
        od[0] = 0;
        memset(mk, 0, (size_t)T);
        mk[0] = 1;
        int64_t max_depth = 0;
        for (int64_t i = 1; i < T_b; i++) {
            int64_t c = hs_load_id(se, sel_dtype, i - 1);
            if (c < 0 || c >= M) {
                st = hs_fail(err, HS_ERR_VALUE, op, "selected", "expected candidate indices in [0, %lld), got %lld at [%lld]",
                             (long long)M, (long long)c, (long long)(i - 1));
                break;
            }
            if (i > 1 && c <= hs_load_id(se, sel_dtype, i - 2)) {
                st = hs_fail(err, HS_ERR_VALUE, op, "selected",
                             "expected strictly ascending candidate indices, got %lld at [%lld] after %lld",
                             (long long)c, (long long)(i - 1), (long long)hs_load_id(se, sel_dtype, i - 2));
                break;
            }
            int64_t p = hs_load_id(pa, parent_dtype, c), t = hs_load_id(tk, token_dtype, c);
            if (p < -1 || p >= M) {
                st = hs_fail(err, HS_ERR_VALUE, op, "parents", "expected values in [-1, %lld), got %lld at [%lld]",
                             (long long)M, (long long)p, (long long)c);
                break;
            }
            if (p >= c) {
                st = hs_fail(err, HS_ERR_VALUE, op, "parents",
                             "expected parents to precede children (parents[c] < c), got parents[%lld] = %lld",
                             (long long)c, (long long)p);
                break;
            }
            if (t < 0) {
                st = hs_fail(err, HS_ERR_VALUE, op, "tokens", "expected token ids >= 0, got %lld at [%lld]",
                             (long long)t, (long long)c);
                break;
            }
            int64_t tp = p < 0 ? 0 : tree_index[p];
            if (tp < 0) {
                st = hs_fail(err, HS_ERR_VALUE, op, "selected",
                             "expected a parent-closed selection, got candidate %lld selected without its "
                             "parent candidate %lld",
                             (long long)c, (long long)p);
                break;
            }
            tree_index[c] = i;
            ot[i] = t;
            op_[i] = tp;
            od[i] = od[tp] + 1;
            if (od[i] > max_depth) max_depth = od[i];
            /* ancestor-or-self row: the parent's row plus the node itself */
            memcpy(mk + i * T, mk + tp * T, (size_t)T);
            mk[i * T + i] = 1;
        }
        /* reset the candidate map before the next row (or before returning an error) */
        for (int64_t i = 1; i < T_b; i++) {
            int64_t c = hs_load_id(se, sel_dtype, i - 1);
            if (c >= 0 && c < M) tree_index[c] = -1;
        }
        if (st != HS_OK) break;
        /* leaves: nodes that are nobody's parent */
        memset(has_child, 0, (size_t)T_b);
        for (int64_t i = 1; i < T_b; i++) has_child[op_[i]] = 1;
        int64_t leaves = 0;
        for (int64_t i = 0; i < T_b; i++) leaves += !has_child[i];
        out_num_leaves[b] = leaves;
        out_max_depth[b] = max_depth;
    }
    return st;
}

size_t hs_tree_retrieve_workspace_bytes(int64_t T) { return (size_t)(T > 0 ? T : 1); }

hs_status hs_tree_retrieve(const int64_t *parents, const int64_t *depths, int64_t batch, int64_t T,
                           const int64_t *t, int64_t L, int64_t D1, int64_t *out, void *ws,
                           size_t ws_bytes, hs_error *err) {
    static const char op[] = "tree_retrieve";
    if (ws_bytes < hs_tree_retrieve_workspace_bytes(T))
        return hs_fail(err, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu",
                       hs_tree_retrieve_workspace_bytes(T), ws_bytes);
    uint8_t *has_child = (uint8_t *)ws;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *pa = parents + b * T, *de = depths + b * T;
        int64_t tb = t[b];
        int64_t *o = out + b * L * D1;
        for (int64_t i = 0; i < L * D1; i++) o[i] = -1;
        if (tb < 1 || tb > T)
            return hs_fail(err, HS_ERR_VALUE, op, "parents", "expected 1 <= nodes <= %lld, got %lld", (long long)T,
                           (long long)tb);
        memset(has_child, 0, (size_t)tb);
        for (int64_t i = 1; i < tb; i++) {
            if (pa[i] < 0 || pa[i] >= i)
                return hs_fail(err, HS_ERR_VALUE, op, "parents", "expected 0 <= parents[i] < i, got %lld at [%lld]",
                               (long long)pa[i], (long long)i);
            has_child[pa[i]] = 1;
        }
        int64_t row = 0;
        for (int64_t i = 0; i < tb; i++) {
            if (has_child[i]) continue;
            if (row >= L)
                return hs_fail(err, HS_ERR_VALUE, op, "out", "expected room for every leaf, got %lld rows",
                               (long long)L);
            if (de[i] + 1 > D1)
                return hs_fail(err, HS_ERR_VALUE, op, "out", "expected %lld >= depth + 1 = %lld columns",
                               (long long)D1, (long long)(de[i] + 1));
            /* walk up from the leaf, writing the path right to left */
            for (int64_t node = i, d = de[i]; d >= 0; d--, node = pa[node]) o[row * D1 + d] = node;
            row++;
        }
    }
    return HS_OK;
}
