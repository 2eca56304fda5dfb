/*
 * tree.cu -- expand, select and build_tree as CUDA kernels (semantics: docs/ops.md; CPU twins: csrc/core/tree.c).
 *
 *   expand         k <= 256: chunks (max, sum of exponentials, k best by a threshold from the threads'
 *                  maxima; rows.cu), then one block per beam row merging them into the outputs and the entropy;
 *                  the last block of a request to finish (a counter in the workspace, reset by that block) picks
 *                  the next beams from all B*k scores, so two launches do a whole level.  Larger k: one
 *                  block per beam row doing all of it (the unsplit kernel).
 *   select         one block per request: radix select over float64 keys, ordered compaction.
 *   build_tree     one block per request: closure checks by binary search in the (ascending) selection,
 *                  depths, ancestor mask, leaves and retrieve rows, all in parallel over nodes.
 */
#include "rows.cuh"

/* The last block of a request reads the scores other blocks wrote in this launch: volatile loads, so they
 * come from L2 after the fence, never from a stale L1 line or a register. */
struct hs_score_key {
    const volatile float *p;
    __device__ __forceinline__ uint32_t operator()(int64_t i) const { return hs_key32(p[i]); }
};

/* Write one expand candidate (the id-th draft token, logit x, at output o) and add its entropy terms. */
__device__ __forceinline__ void hs_expand_out(int64_t id, float x, int64_t o, float m, double lse, double base, int64_t node,
                                              const void *d2t, int d2t_dt, int64_t *out_tokens, float *out_scores,
                                              int64_t *out_parents, double *Z, double *S, hs_cuda_error *err) {
    int64_t t = id;
    if (d2t != nullptr) {
        int64_t off = hs_ld_id(d2t, d2t_dt, id);
        t = id + off;
        if (t < 0) hs_report(err, HS_CE_D2T, id, off);
    }
    out_tokens[o] = t;
    out_scores[o] = (float)(base + (((double)x - (double)m) - lse));
    out_parents[o] = node;
    if (x != -HS_INF) { /* relative to the row max, which is the best candidate */
        double d = (double)x - (double)m, e = exp(d);
        *Z += e;
        *S += e * d;
    }
}

/* A refused beam row (its error already reported) still writes outputs that later ops and the engine's gathers
 * can index, never the allocator's garbage: candidate j is draft id j (a token of both vocabularies), score
 * -inf (never preferred to a real candidate), parent the row's node (-1 when that was the bad input), entropy
 * 0.  The caller raises the recorded error before any of it is used as a token. */
__device__ __forceinline__ void hs_expand_refused(int64_t r, int64_t k, int64_t node, int64_t *out_tokens,
                                                  float *out_scores, int64_t *out_parents, float *out_entropy) {
    for (int64_t c = threadIdx.x; c < k; c += blockDim.x) {
        out_tokens[r * k + c] = c;
        out_scores[r * k + c] = -HS_INF;
        out_parents[r * k + c] = node < -1 ? -1 : node;
    }
    if (threadIdx.x == 0) out_entropy[r] = 0.f;
}

/* What both expand kernels start from: their shared memory (the block reduction, the radix scratch, then k
 * candidates: ids, keys, ranks, and two ints: [0] count, [1] last-block flag) and this block's beam row r (request
 * bi, beam b) with its score and node, checked (thread 0 reports; ok is 0 if either is bad). */
struct hs_expand_row {
    long long *red;
    char *scratch;
    int64_t *cand;
    uint32_t *cval;
    int *rank, *ints;
    int64_t r, bi, b;
    double base;
    int64_t node;
    int ok;
};

__device__ __forceinline__ hs_expand_row hs_expand_begin(int64_t B, int64_t k, const void *beam_scores, int score_dt,
                                                         const void *beam_nodes, int node_dt, hs_cuda_error *err) {
    hs_expand_row w;
    char *sm = hs_smem();
    w.red = (long long *)sm;
    w.scratch = sm + blockDim.x * sizeof(long long);
    w.cand = (int64_t *)(w.scratch + HS_RADIX_SMEM);
    w.cval = (uint32_t *)(w.cand + k);
    w.rank = (int *)(w.cval + k);
    w.ints = w.rank + k;
    w.r = blockIdx.x;
    w.bi = w.r / B;
    w.b = w.r % B;
    w.base = hs_ld_real(beam_scores, score_dt, w.r);
    w.node = hs_ld_id(beam_nodes, node_dt, w.r);
    w.ok = 1;
    if (w.base != w.base || w.base == (double)HS_INF) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_BEAM_SCORE, w.r);
        w.ok = 0;
    }
    if (w.node < -1) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_BEAM_NODE, w.node, w.r);
        w.ok = 0;
    }
    return w;
}

/* Up to this many scores (B * k) the next beams are picked by rank counting over a shared copy of the scores (a
 * few barriers); above it by the radix select (about 20 barriers per 8-bit pass). */
#define HS_PICK_RANK_MAX 1024

/* Shared memory of an expand kernel of `threads` threads (hs_expand_row), and the pick's copy of the scores. */
static inline size_t hs_expand_smem(unsigned threads, int64_t k) {
    return hs_row_smem(threads) + (size_t)k * (8 + 4 + 4) + 16 + HS_PICK_RANK_MAX * sizeof(uint32_t);
}

/* The last block of request w.bi to get here (a counter per request, reset by that block, so the next launch
 * and a graph replay start from zero) picks the next beams from all B*k scores of the request. */
__device__ void hs_pick_next_beams(const hs_expand_row &w, int64_t B, int64_t k, int64_t node_offset, float *out_scores,
                                   int64_t *out_next_beams, unsigned *counters) {
    const int64_t Bk = B * k;
    if (!hs_last_block(&counters[w.bi], B, &w.ints[1])) return;
    if (threadIdx.x == 0) counters[w.bi] = 0; /* ready for the next launch (and graph replay) */
    hs_score_key skey{out_scores + w.bi * Bk};
    if (Bk <= HS_PICK_RANK_MAX) {
        /* the k best of Bk scores, best first, ties to the lower index: each score's rank among all of them */
        uint32_t *keys = (uint32_t *)(w.ints + 4);
        for (int64_t i = threadIdx.x; i < Bk; i += blockDim.x) keys[i] = skey(i);
        __syncthreads();
        for (int64_t i = threadIdx.x; i < Bk; i += blockDim.x) {
            const uint32_t ki = keys[i];
            int64_t r = 0;
            for (int64_t j = 0; j < Bk && r < k; j++) r += keys[j] > ki || (keys[j] == ki && j < i);
            if (r < k) out_next_beams[w.bi * k + r] = node_offset + i;
        }
        return;
    }
    hs_radix<uint32_t> sel;
    hs_block_radix_select(skey, Bk, k, w.scratch, w.red, &sel);
    hs_collect_sorted(skey, Bk, k, sel, w.cand, w.cval, w.rank, w.ints);
    for (int c = threadIdx.x; c < k; c += blockDim.x) out_next_beams[w.bi * k + w.rank[c]] = node_offset + w.cand[c];
}

template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_expand(const void *logits, int64_t B, int64_t Vd, const void *beam_scores, int score_dt,
                            const void *beam_nodes, int node_dt, int64_t k, const void *d2t, int d2t_dt,
                            int64_t node_offset, int64_t *out_tokens, float *out_scores, int64_t *out_parents,
                            float *out_entropy, int64_t *out_next_beams, unsigned *counters, hs_cuda_error *err) {
    const hs_expand_row w = hs_expand_begin(B, k, beam_scores, score_dt, beam_nodes, node_dt, err);
    const int64_t r = w.r;
    float m;
    long long bad;
    hs_row_max_check<DT>(logits, r * Vd, Vd, w.red, &m, &bad);
    if (hs_row_ok(bad, m, r, err) && w.ok) {
        double s = 0.0;
        hs_strided(0, Vd, hs_logit_val<DT>{logits, r * Vd}, [&](int64_t, float x) { s += (double)expf(x - m); });
        s = hs_block_reduce(s, (double *)w.red, hs_op_sum());
        const double lse = log(s);
        hs_logit_key<DT> key{logits, r * Vd};
        hs_radix<uint32_t> sel;
        hs_block_radix_select(key, Vd, k, w.scratch, w.red, &sel);
        hs_collect_sorted(key, Vd, k, sel, w.cand, w.cval, w.rank, w.ints);
        double Z = 0.0, S = 0.0;
        for (int c = threadIdx.x; c < k; c += blockDim.x)
            hs_expand_out(w.cand[c], hs_unkey32(w.cval[c]), (w.bi * B + w.b) * k + w.rank[c], m, lse, w.base, w.node,
                          d2t, d2t_dt, out_tokens, out_scores, out_parents, &Z, &S, err);
        hs_block_entropy(Z, S, w.red, out_entropy + r);
    } else {
        hs_expand_refused(r, k, w.node, out_tokens, out_scores, out_parents, out_entropy);
    }
    /* the last block of request bi to get here picks the next beams from all B*k scores */
    hs_pick_next_beams(w, B, k, node_offset, out_scores, out_next_beams, counters);
}

/* The split expand's second half: one block per beam row merges its chunks' partials and k-best lists into
 * the row's outputs; the last block of a request picks the next beams, as hs_k_expand does. */
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_expand_merge(int64_t B, int64_t C, const hs_part *parts, const uint32_t *ckey,
                                                              const int64_t *cidx, const void *beam_scores, int score_dt,
                                                              const void *beam_nodes, int node_dt, int64_t k, const void *d2t,
                                                              int d2t_dt, int64_t node_offset, int64_t *out_tokens,
                                                              float *out_scores, int64_t *out_parents, float *out_entropy,
                                                              int64_t *out_next_beams, unsigned *counters, hs_cuda_error *err,
                                                              size_t stage_off) {
    const hs_expand_row w = hs_expand_begin(B, k, beam_scores, score_dt, beam_nodes, node_dt, err);
    const int64_t r = w.r;
    const hs_part *P = parts + r * C;
    float m;
    long long bad;
    hs_merge_max(P, C, w.red, &m, &bad);
    /* the merge works past the expand kernels' own shared memory (hs_expand_smem, 16-byte aligned) */
    if (hs_row_ok(bad, m, r, err) && w.ok) {
        double s = 0.0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            if (P[c].m != -HS_INF) s += P[c].s * exp((double)P[c].m - (double)m);
        s = hs_block_reduce(s, (double *)w.red, hs_op_sum());
        const double lse = log(s);
        double Z = 0.0, S = 0.0;
        if (hs_merge_sorts(C, k)) { /* the candidates sorted in shared memory: position q is the q-th best of the row */
            const hs_sorted srt = hs_merge_sort(ckey + r * C * k, cidx + r * C * k, P, C, k, hs_smem() + stage_off, w.red);
            for (int64_t q = threadIdx.x; q < k && q < srt.n; q += blockDim.x)
                hs_expand_out(srt.id[q], hs_unkey32(srt.key[q]), (w.bi * B + w.b) * k + q, m, lse, w.base, w.node, d2t,
                              d2t_dt, out_tokens, out_scores, out_parents, &Z, &S, err);
        } else { /* each candidate's rank by binary searches in the other chunks' lists (global memory) */
            const hs_cands v = hs_merge_stage(ckey + r * C * k, cidx + r * C * k, P, C, k, 0, hs_smem() + stage_off);
            for (int64_t e = threadIdx.x; e < C * k; e += blockDim.x) {
                const int64_t c = e / k, j = e % k;
                if (j >= v.count[c]) continue;
                const int64_t rk = hs_merge_rank(v, C, (int)k, c, j);
                if (rk >= k) continue;
                hs_expand_out(v.id[e], hs_unkey32(v.key[e]), (w.bi * B + w.b) * k + rk, m, lse, w.base, w.node, d2t,
                              d2t_dt, out_tokens, out_scores, out_parents, &Z, &S, err);
            }
        }
        hs_block_entropy(Z, S, w.red, out_entropy + r);
    } else {
        hs_expand_refused(r, k, w.node, out_tokens, out_scores, out_parents, out_entropy);
    }
    hs_pick_next_beams(w, B, k, node_offset, out_scores, out_next_beams, counters);
}

/* Workspace: the per-request counters (zero; the kernel leaves them zero) in the first 64 KB per 16384
 * requests, then the split path's partials [rows * C] and candidates [rows * C * k] (rows = batch * B). */
static size_t hs_expand_ctr_bytes(int64_t batch) {
    return ((size_t)(batch > 0 ? batch : 1) * sizeof(unsigned) + 65535) & ~(size_t)65535;
}
static int hs_expand_split(int64_t k) { return k <= HS_CAND_MAX; }

extern "C" size_t hs_cuda_expand_workspace_bytes(int64_t batch, int64_t B, int64_t k, int64_t Vd) {
    size_t need = hs_expand_ctr_bytes(batch);
    if (hs_expand_split(k) && batch > 0 && B > 0 && k > 0 && Vd > 0) need += hs_chunk_out_bytes(batch * B, Vd, k);
    return need;
}

extern "C" hs_status hs_cuda_expand(const void *logits, hs_dtype logit_dtype, int64_t batch, int64_t B, int64_t Vd,
                                    const void *beam_scores, hs_dtype score_dtype, const void *beam_nodes,
                                    hs_dtype node_dtype, int64_t k, const void *d2t, hs_dtype d2t_dtype,
                                    int64_t node_offset, int64_t *out_tokens, float *out_scores,
                                    int64_t *out_parents, float *out_entropy, int64_t *out_next_beams, void *ws,
                                    size_t ws_bytes, hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "expand";
    if (k < 1 || k > Vd)
        return hs_fail(herr, HS_ERR_VALUE, op, "k", "expected 1 <= k <= Vd = %lld, got %lld", (long long)Vd, (long long)k);
    if (k > 1024 || B * k > 65536)
        return hs_fail(herr, HS_ERR_VALUE, op, "k",
                       "expected k <= 1024 and B * k <= 65536 on CUDA, got k = %lld with B = %lld", (long long)k,
                       (long long)B);
    if (node_offset < 0)
        return hs_fail(herr, HS_ERR_VALUE, op, "node_offset", "expected >= 0, got %lld", (long long)node_offset);
    if (ws_bytes < hs_cuda_expand_workspace_bytes(batch, B, k, Vd))
        return hs_fail(herr, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu",
                       hs_cuda_expand_workspace_bytes(batch, B, k, Vd), ws_bytes);
    if (batch == 0) return HS_OK;
    int64_t rows = batch * B;
    unsigned *ctr = (unsigned *)ws;
    int rc;
    if (hs_expand_split(k)) {
        /* one block per (beam row, chunk), then one per beam row (the last of a request picks the next beams) */
        hs_chunk_out o;
        hs_status st = hs_launch_chunks(op, logits, logit_dtype, rows, Vd, k, 1, (char *)ws + hs_expand_ctr_bytes(batch), &o,
                                        stream, herr);
        if (st != HS_OK) return st;
        const unsigned tc = HS_CHUNK_THREADS;
        const size_t stage_off = hs_al16(hs_expand_smem(tc, k));
        rc = HS_LAUNCH(hs_k_expand_merge, rows, tc, stage_off + hs_merge_smem(o.C, k), stream,
                       B, o.C, (const hs_part *)o.parts, (const uint32_t *)o.ck, (const int64_t *)o.ci, beam_scores,
                       (int)score_dtype, beam_nodes, (int)node_dtype, k, d2t, (int)d2t_dtype, node_offset, out_tokens,
                       out_scores, out_parents, out_entropy, out_next_beams, ctr, err, stage_off);
        return hs_launched(rc, op, herr);
    }
    const unsigned th = HS_ROW_THREADS;
    const size_t sm = hs_expand_smem(th, k);
    HS_LOGIT_SWITCH(logit_dtype, op, "logits", herr,
                    rc = HS_LAUNCH(hs_k_expand<DT>, rows, th, sm, stream, logits, B, Vd, beam_scores, (int)score_dtype,
                                   beam_nodes, (int)node_dtype, k, d2t, (int)d2t_dtype, node_offset, out_tokens,
                                   out_scores, out_parents, out_entropy, out_next_beams, ctr, err))
    return hs_launched(rc, op, herr);
}

/* ---- select ---------------------------------------------------------------------------------------------- */

struct hs_real_key {
    const void *p;
    int dt;
    int64_t base;
    __device__ __forceinline__ uint64_t operator()(int64_t i) const { return hs_key64(hs_ld_real(p, dt, base + i)); }
};

__global__ void HS_BOUNDS(HS_TREE_THREADS) hs_k_select(const void *scores, int dt, int64_t M, const int64_t *m_dev, const int64_t *n_dev,
                            int64_t N, int64_t *out, hs_cuda_error *err) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    char *scratch = sm + blockDim.x * sizeof(long long);
    const int64_t b = blockIdx.x, mb = m_dev ? m_dev[b] : M, nb = n_dev ? n_dev[b] : N;
    if (mb < 0 || mb > M || nb < 0 || nb > mb || nb > N) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_SIZE, nb, mb);
        for (int64_t i = threadIdx.x; i < N; i += blockDim.x) out[b * N + i] = -1; /* refused: nothing selected */
        return;
    }
    for (int64_t i = nb + threadIdx.x; i < N; i += blockDim.x) out[b * N + i] = -1; /* past the row's count */
    long long nan_at = 0x7fffffffffffffffll;
    for (int64_t i = threadIdx.x; i < mb; i += blockDim.x) {
        double s = hs_ld_real(scores, dt, b * M + i);
        if (s != s && i < nan_at) nan_at = i;
    }
    nan_at = hs_block_reduce(nan_at, red, hs_op_min());
    if (nan_at != 0x7fffffffffffffffll) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_SCORE_NAN, nan_at);
        /* refused (reported): the first nb candidates, ascending and in range, never the allocator's garbage */
        for (int64_t i = threadIdx.x; i < nb; i += blockDim.x) out[b * N + i] = i;
        return;
    }
    if (nb == 0) return;
    hs_real_key key{scores, dt, b * M};
    hs_radix<uint64_t> sel;
    hs_block_radix_select(key, mb, nb, scratch, red, &sel);
    long long base = 0;
    for (int64_t t0 = 0; t0 < mb; t0 += blockDim.x) {
        int64_t i = t0 + threadIdx.x;
        long long f = i < mb && sel.taken(key(i), i);
        long long total;
        long long ex = hs_block_exscan(f, red, &total);
        if (f) out[b * N + base + ex] = i;
        base += total;
    }
}

extern "C" hs_status hs_cuda_select(const void *scores, hs_dtype score_dtype, int64_t batch, int64_t M,
                                    const int64_t *m_dev, const int64_t *n_dev, int64_t N, int64_t *out,
                                    hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "select";
    if (score_dtype != HS_FLOAT32 && score_dtype != HS_FLOAT64)
        return hs_fail(herr, HS_ERR_DTYPE, op, "scores", "expected float32 or float64, got %s", hs_dtype_name(score_dtype));
    if (batch == 0) return HS_OK;
    unsigned th = HS_TREE_THREADS;
    int rc = HS_LAUNCH(hs_k_select, batch, th, hs_row_smem(th), stream, scores, (int)score_dtype, M, m_dev, n_dev, N,
                       out, err);
    return hs_launched(rc, op, herr);
}

/* ---- build_tree ------------------------------------------------------------------------------------------ */

/* A refused request (its error already reported) still gets a tree that later ops and the engine's gathers can
 * index, never the allocator's garbage: its Tb nodes all children of the root, every token the root's (0 when
 * the root was the bad input), one retrieve row per leaf.  The caller raises the recorded error before the
 * tree is verified against anything. */
__device__ void hs_tree_refused(int64_t T, int64_t Tb, int64_t R, int64_t *ot, int64_t *op_, int64_t *od,
                                uint8_t *mk, int64_t *rt, int64_t *num_leaves, int64_t *max_depth) {
    __syncthreads(); /* after every thread's writes of the checked path */
    for (int64_t i = threadIdx.x; i < Tb; i += blockDim.x) {
        ot[i] = R < 0 ? 0 : R;
        op_[i] = i == 0 ? -1 : 0;
        od[i] = i == 0 ? 0 : 1;
    }
    for (int64_t e = threadIdx.x; e < Tb * T; e += blockDim.x) mk[e] = e % T == 0 || e % T == e / T;
    for (int64_t e = threadIdx.x; e < T * T; e += blockDim.x) {
        const int64_t row = e / T, col = e % T;
        rt[e] = Tb == 1 ? (row == 0 && col == 0 ? 0 : -1) : row + 1 < Tb && col < 2 ? (col == 0 ? 0 : row + 1) : -1;
    }
    if (threadIdx.x == 0) {
        *num_leaves = Tb == 1 ? 1 : Tb - 1;
        *max_depth = Tb == 1 ? 0 : 1;
    }
}

__global__ void HS_BOUNDS(HS_TREE_THREADS) hs_k_build_tree(const void *tokens, int tdt, const void *parents, int pdt, int64_t M,
                                const void *selected, int sdt, int64_t N, const int64_t *n_dev,
                                const int64_t *root_dev, int64_t root_token, int64_t *out_tokens,
                                int64_t *out_parents, int64_t *out_depths, uint8_t *out_mask,
                                int64_t *out_num_leaves, int64_t *out_max_depth, int64_t *out_retrieve,
                                hs_cuda_error *err) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    const int64_t T = N + 1, b = blockIdx.x;
    int *par = (int *)(red + blockDim.x); /* tree parent of each node */
    int *dep = par + T;
    int *has_child = dep + T;
    int *flag = has_child + T;
    const int64_t nb_in = n_dev ? n_dev[b] : N;
    const int size_ok = nb_in >= 0 && nb_in <= N && nb_in <= M;
    if (!size_ok && threadIdx.x == 0) hs_report(err, HS_CE_SIZE, nb_in, N < M ? N : M);
    const int64_t nb = size_ok ? nb_in : 0; /* refused: the root alone (hs_tree_refused) */
    const int64_t Tb = nb + 1, R = root_dev ? root_dev[b] : root_token;
    if (threadIdx.x == 0) *flag = 0;
    const char *se = (const char *)selected;
    const int64_t sbase = b * N, cbase = b * M;
    int64_t *ot = out_tokens + b * T, *op_ = out_parents + b * T, *od = out_depths + b * T;
    /* rows past the tree: -1 and no mask bits (a batch's shorter rows) */
    for (int64_t i = Tb + threadIdx.x; i < T; i += blockDim.x) ot[i] = op_[i] = od[i] = -1;
    for (int64_t e = Tb * T + threadIdx.x; e < T * T; e += blockDim.x) out_mask[b * T * T + e] = 0;
    int64_t *rt = out_retrieve + b * T * T;
    uint8_t *mk = out_mask + b * T * T;
    if (R < 0 || !size_ok) { /* block-uniform */
        if (R < 0 && threadIdx.x == 0) hs_report(err, HS_CE_ROOT_NEG, R, b);
        hs_tree_refused(T, Tb, R, ot, op_, od, mk, rt, out_num_leaves + b, out_max_depth + b);
        return;
    }
    __syncthreads();
    for (int64_t i = 1 + threadIdx.x; i < Tb; i += blockDim.x) {
        int64_t c = hs_ld_id(se, sdt, sbase + i - 1);
        int bad = 0;
        if (c < 0 || c >= M) {
            hs_report(err, HS_CE_SEL_RANGE, c, i - 1, M);
            bad = 1;
        } else if (i > 1 && c <= hs_ld_id(se, sdt, sbase + i - 2)) {
            hs_report(err, HS_CE_SEL_ORDER, c, i - 1, hs_ld_id(se, sdt, sbase + i - 2));
            bad = 1;
        }
        int64_t tp = 0;
        if (!bad) {
            int64_t p = hs_ld_id(parents, pdt, cbase + c), t = hs_ld_id(tokens, tdt, cbase + c);
            if (p < -1 || p >= M) {
                hs_report(err, HS_CE_PARENT_RANGE, p, c, M);
                bad = 1;
            } else if (p >= c) {
                hs_report(err, HS_CE_PARENT_ORDER, c, p);
                bad = 1;
            } else if (t < 0) {
                hs_report(err, HS_CE_TOKEN_NEG, t, c);
                bad = 1;
            } else if (p >= 0) {
                /* the selection is ascending: find p among the entries before c by binary search */
                int64_t lo = 0, hi = i - 1;
                while (lo < hi) {
                    int64_t mid = lo + (hi - lo) / 2;
                    if (hs_ld_id(se, sdt, sbase + mid) < p) lo = mid + 1;
                    else hi = mid;
                }
                if (lo < i - 1 && hs_ld_id(se, sdt, sbase + lo) == p) tp = lo + 1;
                else {
                    hs_report(err, HS_CE_NOT_CLOSED, c, p);
                    bad = 1;
                }
            }
            ot[i] = t;
        }
        if (bad) atomicAdd(flag, 1);
        par[i] = (int)tp;
        op_[i] = tp;
    }
    if (threadIdx.x == 0) {
        par[0] = -1;
        ot[0] = R;
        op_[0] = -1;
    }
    __syncthreads();
    if (*flag) {
        hs_tree_refused(T, Tb, R, ot, op_, od, mk, rt, out_num_leaves + b, out_max_depth + b);
        return;
    }
    long long maxd = 0;
    for (int64_t i = threadIdx.x; i < Tb; i += blockDim.x) {
        int d = 0;
        for (int a = (int)i; a > 0; a = par[a]) d++;
        dep[i] = d;
        od[i] = d;
        has_child[i] = 0;
        maxd = d > maxd ? d : maxd;
    }
    maxd = hs_block_reduce(maxd, red, hs_op_max());
    for (int64_t i = 1 + threadIdx.x; i < Tb; i += blockDim.x) has_child[par[i]] = 1;
    /* ancestor-or-self mask, rows 0..nb: parents precede children, so walk up from i while above j */
    for (int64_t e = threadIdx.x; e < Tb * T; e += blockDim.x) {
        int64_t i = e / T, j = e % T;
        int a = (int)i;
        while (a > j) a = par[a];
        mk[e] = a == j;
    }
    for (int64_t e = threadIdx.x; e < T * T; e += blockDim.x) rt[e] = -1;
    __syncthreads();
    long long leaves = 0;
    for (int64_t t0 = 0; t0 < Tb; t0 += blockDim.x) {
        int64_t i = t0 + threadIdx.x;
        long long f = i < Tb && !has_child[i];
        long long total;
        long long ex = hs_block_exscan(f, red, &total);
        if (f) {
            int64_t row = leaves + ex;
            for (int a = (int)i, d = dep[i]; d >= 0; d--, a = par[a]) rt[row * T + d] = a;
        }
        leaves += total;
    }
    if (threadIdx.x == 0) {
        out_num_leaves[b] = leaves;
        out_max_depth[b] = maxd;
    }
}

extern "C" hs_status hs_cuda_build_tree(const void *tokens, hs_dtype token_dtype, const void *parents,
                                        hs_dtype parent_dtype, int64_t batch, int64_t M, const void *selected,
                                        hs_dtype sel_dtype, int64_t N, const int64_t *n_dev,
                                        const int64_t *root_dev, int64_t root_token, int64_t *out_tokens,
                                        int64_t *out_parents, int64_t *out_depths, uint8_t *out_mask,
                                        int64_t *out_num_leaves, int64_t *out_max_depth, int64_t *out_retrieve,
                                        hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "build_tree";
    if (N + 1 > HS_CUDA_MAX_NODES)
        return hs_fail(herr, HS_ERR_VALUE, op, "selected", "expected at most %d nodes on CUDA, got %lld",
                       HS_CUDA_MAX_NODES - 1, (long long)N);
    if (root_dev == nullptr && root_token < 0)
        return hs_fail(herr, HS_ERR_VALUE, op, "root_token", "expected a token id >= 0, got %lld", (long long)root_token);
    if (batch == 0) return HS_OK;
    unsigned th = HS_TREE_THREADS;
    size_t sm = th * sizeof(long long) + (size_t)(3 * (N + 1) + 1) * sizeof(int);
    int rc = HS_LAUNCH(hs_k_build_tree, batch, th, sm, stream, tokens, (int)token_dtype, parents, (int)parent_dtype, M,
                       selected, (int)sel_dtype, N, n_dev, root_dev, root_token, out_tokens, out_parents, out_depths,
                       out_mask, out_num_leaves, out_max_depth, out_retrieve, err);
    return hs_launched(rc, op, herr);
}
