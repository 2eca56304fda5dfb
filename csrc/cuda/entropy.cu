/*
 * entropy.cu -- topk_entropy and bucketize as CUDA kernels (semantics: docs/ops.md; CPU twins: csrc/core/entropy.c;
 * the split-row machinery they share with expand and verify_sample: rows.cuh / rows.cu).
 *
 *   topk_entropy   k <= 256: the row's chunks (hs_k_chunks: max, k best by a threshold from the threads' maxima),
 *                  then one block per row takes the entropy over the k best of the chunks' candidates
 *                  (hs_k_entropy_merge: sorted in shared memory, rows.cuh's hs_merge_sort).  Larger k: one block per row (the unsplit kernel): row max + checks, a
 *                  radix select of the k-th largest logit, then the entropy over the taken set (ties at the
 *                  k-th value counted `need` times).
 *   bucketize      one thread per value, binary search.
 */
#include "rows.cuh"

/* ---- topk_entropy ------------------------------------------------------------------------------------- */

template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_topk_entropy(const void *logits, int64_t V, int64_t k, double temperature, float *out,
                                  hs_cuda_error *err) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    char *scratch = sm + blockDim.x * sizeof(long long);
    int64_t r = blockIdx.x, base = r * V;
    float m;
    long long bad;
    hs_row_max_check<DT>(logits, base, V, red, &m, &bad);
    if (!hs_row_ok(bad, m, r, err)) {
        if (threadIdx.x == 0) out[r] = 0.f; /* refused (reported): a defined value, never the allocator's */
        return;
    }
    hs_logit_key<DT> key{logits, base};
    hs_radix<uint32_t> sel;
    hs_block_radix_select(key, V, k, scratch, red, &sel);
    const double zmax = (double)m / temperature;
    double Z = 0.0, S = 0.0;
    hs_strided(0, V, hs_logit_val<DT>{logits, base}, [&](int64_t i, float x) {
        if (x == -HS_INF || !sel.taken(hs_key32(x), i)) return;
        double d = (double)x / temperature - zmax, e = exp(d);
        Z += e;
        S += e * d;
    });
    hs_block_entropy(Z, S, red, out + r);
}

/* The split topk_entropy's merge, one block per row: the entropy over the row's k best candidates. */
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_entropy_merge(int64_t C, int64_t k, double temperature, const hs_part *parts,
                                                               const uint32_t *ckey, const int64_t *cidx, float *out,
                                                               hs_cuda_error *err) {
    long long *red = (long long *)hs_smem();
    char *stage = (char *)(red + blockDim.x);
    const int64_t r = blockIdx.x;
    const hs_part *P = parts + r * C;
    float m;
    long long bad;
    hs_merge_max(P, C, red, &m, &bad);
    if (!hs_row_ok(bad, m, r, err)) {
        if (threadIdx.x == 0) out[r] = 0.f;
        return;
    }
    const double zmax = (double)m / temperature;
    double Z = 0.0, S = 0.0;
    /* one of the row's k best candidates (key) into the entropy's sums */
    auto add = [&](uint32_t key) {
        const float x = hs_unkey32(key);
        if (x == -HS_INF) return;
        double d = (double)x / temperature - zmax, ex = exp(d);
        Z += ex;
        S += ex * d;
    };
    if (hs_merge_sorts(C, k)) { /* the candidates sorted in shared memory: the first k are the row's k best */
        const hs_sorted srt = hs_merge_sort(ckey + r * C * k, cidx + r * C * k, P, C, k, stage, red);
        for (int64_t q = threadIdx.x; q < k && q < srt.n; q += blockDim.x) add(srt.key[q]);
    } else { /* each candidate's rank by binary searches in the other chunks' lists (global memory) */
        const hs_cands v = hs_merge_stage(ckey + r * C * k, cidx + r * C * k, P, C, k, 0, stage);
        for (int64_t e = threadIdx.x; e < C * k; e += blockDim.x)
            if (e % k < v.count[e / k] && hs_merge_rank(v, C, (int)k, e / k, e % k) < k) add(v.key[e]);
    }
    hs_block_entropy(Z, S, red, out + r);
}

/* Workspace (k <= 256, the split path): partials [rows * C] and candidates [rows * C * k]. */
extern "C" size_t hs_cuda_topk_entropy_workspace_bytes(int64_t rows, int64_t k, int64_t V) {
    if (rows < 1 || k < 1 || k > HS_CAND_MAX || V < 1) return 0;
    return hs_chunk_out_bytes(rows, V, k);
}

extern "C" hs_status hs_cuda_topk_entropy(const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
                                          double temperature, float *out, void *ws, size_t ws_bytes,
                                          hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "topk_entropy";
    if (k < 1 || k > V)
        return hs_fail(herr, HS_ERR_VALUE, op, "k", "expected 1 <= k <= V = %lld, got %lld", (long long)V, (long long)k);
    if (!(temperature >= HS_MIN_TEMPERATURE) || !isfinite(temperature))
        return hs_fail(herr, HS_ERR_VALUE, op, "temperature", "expected a finite value >= 1e-30, got %g", temperature);
    if (ws_bytes < hs_cuda_topk_entropy_workspace_bytes(rows, k, V))
        return hs_fail(herr, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu",
                       hs_cuda_topk_entropy_workspace_bytes(rows, k, V), ws_bytes);
    if (rows == 0) return HS_OK;
    int rc;
    if (k <= HS_CAND_MAX) {
        hs_chunk_out o;
        hs_status st = hs_launch_chunks(op, logits, dtype, rows, V, k, 0, ws, &o, stream, herr);
        if (st != HS_OK) return st;
        rc = HS_LAUNCH(hs_k_entropy_merge, rows, HS_CHUNK_THREADS, HS_CHUNK_THREADS * sizeof(long long) + hs_merge_smem(o.C, k),
                       stream, o.C, k,
                       temperature, (const hs_part *)o.parts, (const uint32_t *)o.ck, (const int64_t *)o.ci, out, err);
        return hs_launched(rc, op, herr);
    }
    unsigned th = HS_ROW_THREADS;
    size_t sm = hs_row_smem(th);
    HS_LOGIT_SWITCH(dtype, op, "logits", herr,
                    rc = HS_LAUNCH(hs_k_topk_entropy<DT>, rows, th, sm, stream, logits, V, k, temperature, out, err))
    return hs_launched(rc, op, herr);
}

/* ---- bucketize ------------------------------------------------------------------------------------------- */

__global__ void HS_BOUNDS(HS_TREE_THREADS) hs_k_bucketize(const void *values, int vdt, int64_t N, const void *thr, int tdt, int64_t T,
                               int32_t *out, hs_cuda_error *err) {
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t t = g; t < T; t += (int64_t)gridDim.x * blockDim.x) {
        double s = hs_ld_real(thr, tdt, t);
        if (s != s) hs_report(err, HS_CE_THRESH_NAN, t);
        else if (t > 0 && !(hs_ld_real(thr, tdt, t - 1) < s)) hs_report(err, HS_CE_THRESH_ORDER, t);
    }
    if (g >= N) return;
    double x = hs_ld_real(values, vdt, g);
    if (x != x) {
        hs_report(err, HS_CE_VALUE_NAN, g);
        return;
    }
    out[g] = (int32_t)hs_count_below(x, thr, tdt == HS_FLOAT64, T);
}

extern "C" hs_status hs_cuda_bucketize(const void *values, hs_dtype value_dtype, int64_t N, const void *thresholds,
                                       hs_dtype threshold_dtype, int64_t T, int32_t *out, hs_cuda_error *err,
                                       void *stream, hs_error *herr) {
    static const char op[] = "bucketize";
    if (value_dtype != HS_FLOAT32 && value_dtype != HS_FLOAT64)
        return hs_fail(herr, HS_ERR_DTYPE, op, "values", "expected float32 or float64, got %s", hs_dtype_name(value_dtype));
    if (threshold_dtype != HS_FLOAT32 && threshold_dtype != HS_FLOAT64)
        return hs_fail(herr, HS_ERR_DTYPE, op, "thresholds", "expected float32 or float64, got %s", hs_dtype_name(threshold_dtype));
    int64_t work = N > T ? N : T;
    if (work == 0) return HS_OK;
    unsigned th = HS_TREE_THREADS;
    int64_t blocks = (N + th - 1) / th;
    if (blocks < 1) blocks = 1;
    int rc = HS_LAUNCH(hs_k_bucketize, blocks, th, 0, stream, values, (int)value_dtype, N, thresholds,
                       (int)threshold_dtype, T, out, err);
    return hs_launched(rc, op, herr);
}
