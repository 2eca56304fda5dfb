/*
 * ops.cu -- the heterospec ops as CUDA kernels (semantics: docs/ops.md; CPU twins: csrc/core/).
 *
 * Layout of the work:
 *   topk_entropy   one block per row: row max + checks, a radix select of the k-th largest logit, then
 *                  the entropy over the taken set (ties at the k-th value counted `need` times).
 *   expand         one block per beam row, fusing max, log-sum-exp, the row's top-k (radix select, then a
 *                  rank sort of the k), the entropy and the outputs; the last block of a request to finish
 *                  (a counter in the workspace, reset by that block) picks the next beams from all B*k
 *                  scores the same way, so one launch does a whole level.
 *   select         one block per request: radix select over float64 keys, ordered compaction.
 *   build_tree     one block per request: closure checks by binary search in the (ascending) selection,
 *                  depths, ancestor mask, leaves and retrieve rows, all in parallel over nodes.
 *   verify_greedy  all node rows' argmax in parallel (one block per row), then one block per request
 *                  follows the accepted children.
 *   verify_sample  every node row's warp statistics in parallel (max, top-k cut, top-p cut by a
 *                  mass-weighted radix descent, the kept mass R), then one block per request walks the
 *                  tree drawing the same Philox uniforms as the CPU; only the final residual draw reads a
 *                  whole row again.
 *   kv_compact     one launch for up to 64 tensors (descriptors passed by value, so a captured graph keeps
 *                  them), one block per (tensor, leading index); every block checks the prefix (a device
 *                  value read when the kernel runs, or a host int) and the -1-padded slots first, in
 *                  parallel over the entries, so a bad call moves nothing.
 *   bucketize      one thread per value, binary search.
 * Sums that the CPU does in a fixed sequential order are parallel here: floats agree to ~1e-7 relative,
 * and a sampled path or a top-p cut can only differ when a uniform lands within ~1e-15 of a boundary.
 */
#include "common.cuh"

#include <math.h>

extern "C" hs_status hs_fail(hs_error *err, hs_status status, const char *op, const char *arg, const char *fmt, ...);

#define HS_INF __int_as_float_inf()
__device__ __forceinline__ float __int_as_float_inf() { return __uint_as_float(0x7f800000u); }

static hs_status hs_launched(int rc, const char *op, hs_error *herr) {
    if (rc == 0) return HS_OK;
#ifdef HS_CUDA_EMU
    return hs_fail(herr, (hs_status)HS_ERR_CUDA, op, "launch",
                   "expected a successful kernel launch, got one over the emulated sm_80 limits (block or shared memory)");
#else
    return hs_fail(herr, (hs_status)HS_ERR_CUDA, op, "launch", "expected a successful kernel launch, got %s",
                   cudaGetErrorString((cudaError_t)rc));
#endif
}

extern "C" int hs_cuda_max_threads(void) { return HS_ROW_THREADS; }

/* ---- row scan: max and the first bad entry ------------------------------------------------------------ */

/* Block-wide max of a logits row and the lowest column holding NaN/+Inf (as col*2 + is_inf, or -1). */
template <int DT>
__device__ void hs_row_max_check(const void *p, int64_t base, int64_t V, long long *red, float *m_out,
                                 long long *bad_out) {
    float m = -HS_INF;
    long long bad = 0x7fffffffffffffffll;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        float x = hs_ld<DT>(p, base + i);
        if (x != x || x == HS_INF) {
            long long c = (long long)i * 2 + (x == HS_INF);
            bad = c < bad ? c : bad;
        } else if (x > m) {
            m = x;
        }
    }
    bad = hs_block_reduce(bad, red, hs_op_min());
    *m_out = hs_block_reduce(m, (float *)red, hs_op_max());
    *bad_out = bad == 0x7fffffffffffffffll ? -1 : bad;
}

/* Entropy log Z - S/Z from the threads' partial sums Z = sum e^d and S = sum e^d * d (d <= 0 relative to the
 * max), clamped at 0 against rounding; thread 0 writes it to *out. */
__device__ __forceinline__ void hs_block_entropy(double Z, double S, long long *red, float *out) {
    Z = hs_block_reduce(Z, (double *)red, hs_op_sum());
    S = hs_block_reduce(S, (double *)red, hs_op_sum());
    if (threadIdx.x == 0) {
        double h = log(Z) - S / Z;
        *out = (float)(h > 0.0 ? h : 0.0);
    }
}

template <int DT> struct hs_logit_key {
    const void *p;
    int64_t base;
    __device__ __forceinline__ uint32_t operator()(int64_t i) const { return hs_key32(hs_ld<DT>(p, base + i)); }
};

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
    if (bad >= 0 || m == -HS_INF) {
        if (threadIdx.x == 0) {
            if (bad >= 0) hs_report(err, HS_CE_LOGIT_NONFINITE, r, bad >> 1, bad & 1);
            else hs_report(err, HS_CE_LOGIT_ALLNEG, r);
        }
        return;
    }
    hs_logit_key<DT> key{logits, base};
    hs_radix<uint32_t> sel;
    hs_block_radix_select(key, V, k, scratch, red, &sel);
    const double zmax = (double)m / temperature;
    double Z = 0.0, S = 0.0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        float x = hs_ld<DT>(logits, base + i);
        if (x == -HS_INF || !sel.taken(hs_key32(x), i)) continue;
        double d = (double)x / temperature - zmax, e = exp(d);
        Z += e;
        S += e * d;
    }
    hs_block_entropy(Z, S, red, out + r);
}

extern "C" size_t hs_cuda_topk_entropy_workspace_bytes(int64_t rows, int64_t k, int64_t V) {
    (void)rows;
    (void)k;
    (void)V;
    return 0;
}

static size_t hs_row_smem(unsigned threads) { return threads * sizeof(long long) + HS_RADIX_SMEM; }

extern "C" hs_status hs_cuda_topk_entropy(const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
                                          double temperature, float *out, hs_cuda_error *err, void *stream,
                                          hs_error *herr) {
    static const char op[] = "topk_entropy";
    if (k < 1 || k > V)
        return hs_fail(herr, HS_ERR_VALUE, op, "k", "expected 1 <= k <= V = %lld, got %lld", (long long)V, (long long)k);
    if (!(temperature > 0.0) || !isfinite(temperature))
        return hs_fail(herr, HS_ERR_VALUE, op, "temperature", "expected a finite value > 0, got %g", temperature);
    if (rows == 0) return HS_OK;
    unsigned th = HS_ROW_THREADS;
    size_t sm = hs_row_smem(th);
    int rc;
    switch (dtype) {
    case HS_FLOAT32: rc = HS_LAUNCH(hs_k_topk_entropy<HS_FLOAT32>, rows, th, sm, stream, logits, V, k, temperature, out, err); break;
    case HS_FLOAT16: rc = HS_LAUNCH(hs_k_topk_entropy<HS_FLOAT16>, rows, th, sm, stream, logits, V, k, temperature, out, err); break;
    case HS_BFLOAT16: rc = HS_LAUNCH(hs_k_topk_entropy<HS_BFLOAT16>, rows, th, sm, stream, logits, V, k, temperature, out, err); break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(dtype));
    }
    return hs_launched(rc, op, herr);
}

/* ---- expand ---------------------------------------------------------------------------------------------- */

/* Take the k entries chosen by `sel` into cand (ids) / cval (keys), then sort them best first by rank
 * counting (key desc, id asc); rank[c] is where cand[c] goes. */
template <class KeyFn>
__device__ void hs_collect_sorted(const KeyFn &key, int64_t n, int64_t k, const hs_radix<uint32_t> &sel,
                                  int64_t *cand, uint32_t *cval, int *rank, int *count) {
    if (threadIdx.x == 0) *count = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        uint32_t kk = key(i);
        if (sel.taken(kk, i)) {
            int pos = atomicAdd(count, 1);
            if (pos < k) {
                cand[pos] = i;
                cval[pos] = kk;
            }
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < k; c += blockDim.x) {
        int r = 0;
        for (int j = 0; j < k; j++)
            r += cval[j] > cval[c] || (cval[j] == cval[c] && cand[j] < cand[c]);
        rank[c] = r;
    }
    __syncthreads();
}

/* The last block of a request reads the scores other blocks wrote in this launch: volatile loads, so they
 * come from L2 after the fence, never from a stale L1 line or a register. */
struct hs_score_key {
    const volatile float *p;
    __device__ __forceinline__ uint32_t operator()(int64_t i) const { return hs_key32(p[i]); }
};

template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_expand(const void *logits, int64_t B, int64_t Vd, const void *beam_scores, int score_dt,
                            const void *beam_nodes, int node_dt, int64_t k, const void *d2t, int d2t_dt,
                            int64_t node_offset, int64_t *out_tokens, float *out_scores, int64_t *out_parents,
                            float *out_entropy, int64_t *out_next_beams, unsigned *counters, hs_cuda_error *err) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    char *scratch = sm + blockDim.x * sizeof(long long);
    int64_t *cand = (int64_t *)(scratch + HS_RADIX_SMEM);
    uint32_t *cval = (uint32_t *)(cand + k);
    int *rank = (int *)(cval + k);
    int *shared_int = rank + k; /* [0] count, [1] last-block flag */
    const int64_t r = blockIdx.x, bi = r / B, b = r % B, Bk = B * k;
    double base = hs_ld_real(beam_scores, score_dt, r);
    int64_t node = hs_ld_id(beam_nodes, node_dt, r);
    int ok = 1;
    if (base != base || base == (double)HS_INF) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_BEAM_SCORE, r);
        ok = 0;
    }
    if (node < -1) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_BEAM_NODE, node, r);
        ok = 0;
    }
    float m;
    long long bad;
    hs_row_max_check<DT>(logits, r * Vd, Vd, red, &m, &bad);
    if (bad >= 0 || m == -HS_INF) {
        if (threadIdx.x == 0) {
            if (bad >= 0) hs_report(err, HS_CE_LOGIT_NONFINITE, r, bad >> 1, bad & 1);
            else hs_report(err, HS_CE_LOGIT_ALLNEG, r);
        }
        ok = 0;
    }
    if (ok) {
        double s = 0.0;
        for (int64_t i = threadIdx.x; i < Vd; i += blockDim.x) s += (double)expf(hs_ld<DT>(logits, r * Vd + i) - m);
        s = hs_block_reduce(s, (double *)red, hs_op_sum());
        const double lse = log(s);
        hs_logit_key<DT> key{logits, r * Vd};
        hs_radix<uint32_t> sel;
        hs_block_radix_select(key, Vd, k, scratch, red, &sel);
        hs_collect_sorted(key, Vd, k, sel, cand, cval, rank, shared_int);
        double Z = 0.0, S = 0.0;
        const double top = (double)m; /* the best candidate is the row max */
        for (int c = threadIdx.x; c < k; c += blockDim.x) {
            int64_t id = cand[c], o = bi * Bk + b * k + rank[c], t = id;
            float x = hs_unkey32(cval[c]);
            if (d2t != nullptr) {
                int64_t off = hs_ld_id(d2t, d2t_dt, id);
                t = id + off;
                if (t < 0) hs_report(err, HS_CE_D2T, id, off);
            }
            out_tokens[o] = t;
            out_scores[o] = (float)(base + (((double)x - (double)m) - lse));
            out_parents[o] = node;
            if (x != -HS_INF) {
                double d = (double)x - top, e = exp(d);
                Z += e;
                S += e * d;
            }
        }
        hs_block_entropy(Z, S, red, out_entropy + r);
    }
    /* the last block of request bi to get here picks the next beams from all B*k scores */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) shared_int[1] = atomicAdd(&counters[bi], 1u) == (unsigned)(B - 1);
    __syncthreads();
    if (!shared_int[1]) return;
    __threadfence();
    if (threadIdx.x == 0) counters[bi] = 0; /* ready for the next launch (and graph replay) */
    hs_score_key skey{out_scores + bi * Bk};
    hs_radix<uint32_t> sel;
    hs_block_radix_select(skey, Bk, k, scratch, red, &sel);
    hs_collect_sorted(skey, Bk, k, sel, cand, cval, rank, shared_int);
    for (int c = threadIdx.x; c < k; c += blockDim.x) out_next_beams[bi * k + rank[c]] = node_offset + cand[c];
}

extern "C" size_t hs_cuda_expand_workspace_bytes(int64_t batch, int64_t B, int64_t k, int64_t Vd) {
    (void)B;
    (void)k;
    (void)Vd;
    return (size_t)(batch > 0 ? batch : 1) * sizeof(unsigned);
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
    unsigned th = HS_ROW_THREADS;
    size_t sm = hs_row_smem(th) + (size_t)k * (8 + 4 + 4) + 16;
    int64_t rows = batch * B;
    unsigned *ctr = (unsigned *)ws;
    int rc;
#define HS_EXPAND_ARGS logits, B, Vd, beam_scores, (int)score_dtype, beam_nodes, (int)node_dtype, k, d2t, (int)d2t_dtype, \
        node_offset, out_tokens, out_scores, out_parents, out_entropy, out_next_beams, ctr, err
    switch (logit_dtype) {
    case HS_FLOAT32: rc = HS_LAUNCH(hs_k_expand<HS_FLOAT32>, rows, th, sm, stream, HS_EXPAND_ARGS); break;
    case HS_FLOAT16: rc = HS_LAUNCH(hs_k_expand<HS_FLOAT16>, rows, th, sm, stream, HS_EXPAND_ARGS); break;
    case HS_BFLOAT16: rc = HS_LAUNCH(hs_k_expand<HS_BFLOAT16>, rows, th, sm, stream, HS_EXPAND_ARGS); break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(logit_dtype));
    }
#undef HS_EXPAND_ARGS
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
        return;
    }
    long long nan_at = 0x7fffffffffffffffll;
    for (int64_t i = threadIdx.x; i < mb; i += blockDim.x) {
        double s = hs_ld_real(scores, dt, b * M + i);
        if (s != s && i < nan_at) nan_at = i;
    }
    nan_at = hs_block_reduce(nan_at, red, hs_op_min());
    if (nan_at != 0x7fffffffffffffffll) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_SCORE_NAN, nan_at);
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
    const int64_t nb = n_dev ? n_dev[b] : N;
    if (nb < 0 || nb > N || nb > M) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_SIZE, nb, N < M ? N : M);
        return;
    }
    const int64_t Tb = nb + 1, R = root_dev ? root_dev[b] : root_token;
    if (threadIdx.x == 0) *flag = 0;
    const char *se = (const char *)selected;
    const int64_t sbase = b * N, cbase = b * M;
    int64_t *ot = out_tokens + b * T, *op_ = out_parents + b * T, *od = out_depths + b * T;
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
    if (*flag) return;
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
    uint8_t *mk = out_mask + b * T * T;
    for (int64_t e = threadIdx.x; e < Tb * T; e += blockDim.x) {
        int64_t i = e / T, j = e % T;
        int a = (int)i;
        while (a > j) a = par[a];
        mk[e] = a == j;
    }
    int64_t *rt = out_retrieve + b * T * T;
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

/* ---- verification: shared tree checks ------------------------------------------------------------------ */

/* Copy row b's tree into shared memory (par/tok), checking it; returns 0 (block-uniform) if it is bad. */
__device__ int hs_load_tree(const void *tt, int tdt, const void *tp, int pdt, int64_t b, int64_t T, int64_t nb,
                            int64_t V, int *par, int64_t *tok, int *flag, hs_cuda_error *err) {
    if (threadIdx.x == 0) *flag = 0;
    __syncthreads();
    if (nb < 1 || nb > T) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_SIZE, nb, T);
        return 0;
    }
    for (int64_t i = threadIdx.x; i < nb; i += blockDim.x) {
        int64_t p = hs_ld_id(tp, pdt, b * T + i), t = hs_ld_id(tt, tdt, b * T + i);
        if (i == 0 ? p != -1 : (p < 0 || p >= i)) {
            hs_report(err, i == 0 ? HS_CE_TREE_ROOT : HS_CE_TREE_PARENT, p, i);
            atomicAdd(flag, 1);
        }
        if (t < 0 || t >= V) {
            hs_report(err, HS_CE_TREE_TOKEN, t, i, V);
            atomicAdd(flag, 1);
        }
        par[i] = (int)p;
        tok[i] = t;
    }
    __syncthreads();
    int ok = *flag == 0;
    __syncthreads();
    return ok;
}

/* The host-side size checks both verify ops make: a tree within the CUDA path's node limit, enough workspace. */
static hs_status hs_verify_sizes(const char *op, int64_t T, size_t ws_bytes, size_t need, hs_error *herr) {
    if (T > HS_CUDA_MAX_NODES)
        return hs_fail(herr, HS_ERR_VALUE, op, "tree_tokens", "expected at most %d nodes on CUDA, got %lld",
                       HS_CUDA_MAX_NODES, (long long)T);
    if (ws_bytes < need)
        return hs_fail(herr, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu", need, ws_bytes);
    return HS_OK;
}

/* ---- verify_greedy ----------------------------------------------------------------------------------- */

/* Per node row: ws[2*row] = argmax (ties to the lower id), ws[2*row+1] = -1, or the error (argmax -1 and
 * col*2+is_inf, or argmax -2 for an all -inf row). */
template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_row_argmax(const void *logits, int64_t T, int64_t V, const int64_t *n_dev, long long *ws) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    const int64_t row = blockIdx.x, b = row / T, i = row % T;
    if (n_dev && i >= n_dev[b]) return;
    unsigned long long best = 0;
    long long bad = 0x7fffffffffffffffll;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
        float x = hs_ld<DT>(logits, row * V + v);
        if (x != x || x == HS_INF) {
            long long c = (long long)v * 2 + (x == HS_INF);
            bad = c < bad ? c : bad;
        } else {
            unsigned long long pk = ((unsigned long long)hs_key32(x) << 32) | (0xffffffffull - (unsigned long long)v);
            best = pk > best ? pk : best;
        }
    }
    bad = hs_block_reduce(bad, red, hs_op_min());
    best = hs_block_reduce(best, (unsigned long long *)red, hs_op_max());
    if (threadIdx.x == 0) {
        if (bad != 0x7fffffffffffffffll) {
            ws[2 * row] = -1;
            ws[2 * row + 1] = bad;
        } else if ((uint32_t)(best >> 32) == hs_key32(-HS_INF)) {
            ws[2 * row] = -2;
            ws[2 * row + 1] = 0;
        } else {
            ws[2 * row] = (long long)(0xffffffffull - (best & 0xffffffffull));
            ws[2 * row + 1] = -1;
        }
    }
}

/* A visited row's recorded failure, reported as the CPU would; returns 1 if there was one. */
__device__ __forceinline__ int hs_row_failed(const long long *st, int64_t row_in_tree, hs_cuda_error *err) {
    if (st[0] >= 0) return 0;
    if (st[0] == -1) hs_report(err, HS_CE_LOGIT_NONFINITE, row_in_tree, st[1] >> 1, st[1] & 1);
    else hs_report(err, HS_CE_LOGIT_ALLNEG, row_in_tree);
    return 1;
}

__global__ void HS_BOUNDS(HS_TREE_THREADS) hs_k_greedy_walk(const void *tt, int tdt, const void *tp, int pdt, int64_t T, const int64_t *n_dev,
                                 int64_t V, const long long *ws, int64_t *out_path, int64_t *out_len,
                                 int64_t *out_next, hs_cuda_error *err) {
    char *sm = hs_smem();
    int *par = (int *)sm;
    int *child = par + T; /* the accepted child of each node: lowest index whose token is the parent's argmax */
    int *flag = child + T;
    int64_t *tok = (int64_t *)(((uintptr_t)(flag + 1) + 7) & ~(uintptr_t)7);
    const int64_t b = blockIdx.x, nb = n_dev ? n_dev[b] : T;
    for (int64_t i = threadIdx.x; i < T; i += blockDim.x) out_path[b * T + i] = -1;
    if (!hs_load_tree(tt, tdt, tp, pdt, b, T, nb, V, par, tok, flag, err)) return;
    for (int64_t i = threadIdx.x; i < nb; i += blockDim.x) child[i] = 0x7fffffff;
    __syncthreads();
    for (int64_t j = 1 + threadIdx.x; j < nb; j += blockDim.x) {
        long long am = ws[2 * (b * T + par[j])];
        if (am >= 0 && tok[j] == am) atomicMin(&child[par[j]], (int)j);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int64_t cur = 0, len = 0;
    out_path[b * T + len++] = 0;
    for (;;) {
        const long long *st = ws + 2 * (b * T + cur);
        if (hs_row_failed(st, cur, err)) return;
        if (child[cur] == 0x7fffffff) break;
        cur = child[cur];
        out_path[b * T + len++] = cur;
    }
    out_len[b] = len;
    out_next[b] = ws[2 * (b * T + cur)];
}

extern "C" size_t hs_cuda_verify_greedy_workspace_bytes(int64_t batch, int64_t T) {
    return (size_t)(batch * T > 0 ? batch * T : 1) * 2 * sizeof(long long);
}

static size_t hs_walk_smem(int64_t T) { return (size_t)(2 * T + 1) * sizeof(int) + 8 + (size_t)T * 8; }

extern "C" hs_status hs_cuda_verify_greedy(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                                           hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n_dev,
                                           const void *logits, hs_dtype logit_dtype, int64_t V, int64_t *out_path,
                                           int64_t *out_len, int64_t *out_next, void *ws, size_t ws_bytes,
                                           hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "verify_greedy";
    hs_status chk = hs_verify_sizes(op, T, ws_bytes, hs_cuda_verify_greedy_workspace_bytes(batch, T), herr);
    if (chk != HS_OK) return chk;
    if (batch == 0 || T == 0) return HS_OK;
    unsigned th = HS_ROW_THREADS;
    size_t sm = th * sizeof(long long);
    long long *st = (long long *)ws;
    int rc;
    switch (logit_dtype) {
    case HS_FLOAT32: rc = HS_LAUNCH(hs_k_row_argmax<HS_FLOAT32>, batch * T, th, sm, stream, logits, T, V, n_dev, st); break;
    case HS_FLOAT16: rc = HS_LAUNCH(hs_k_row_argmax<HS_FLOAT16>, batch * T, th, sm, stream, logits, T, V, n_dev, st); break;
    case HS_BFLOAT16: rc = HS_LAUNCH(hs_k_row_argmax<HS_BFLOAT16>, batch * T, th, sm, stream, logits, T, V, n_dev, st); break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "target_logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(logit_dtype));
    }
    hs_status s = hs_launched(rc, op, herr);
    if (s != HS_OK) return s;
    rc = HS_LAUNCH(hs_k_greedy_walk, batch, HS_TREE_THREADS, hs_walk_smem(T), stream, tree_tokens, (int)token_dtype,
                   tree_parents, (int)parent_dtype, T, n_dev, V, (const long long *)st, out_path, out_len, out_next, err);
    return hs_launched(rc, op, herr);
}

/* ---- verify_sample ------------------------------------------------------------------------------------ */

/* Warp statistics of one node row (docs/ops.md "Warp"): w_v = exp(x_v / T - zmax) for tokens that survive
 * top-k (key >= kpfx at kshift) and top-p (key > pkey, or key == pkey and v <= ptie), else 0. */
struct hs_warp_stats {
    double R;       /* kept mass */
    float m;        /* row max */
    int kshift;     /* top-k cut: (key >> kshift) >= kpfx; kshift = 32 disables it */
    uint32_t kpfx;
    uint32_t pkey;  /* top-p cut */
    int pmode;      /* 0: no top-p cut (all survivors kept), 1: cut at (pkey, ptie) */
    long long ptie;
    long long status; /* as hs_k_row_argmax: >= 0 fine, -1 bad entry (col*2+inf in bad), -2 all -inf */
    long long bad;
};

__device__ __forceinline__ double hs_warp_w(const hs_warp_stats &s, float x, int64_t v, double temperature,
                                            double zmax) {
    uint32_t key = hs_key32(x);
    if (s.kshift < 32 && (key >> s.kshift) < s.kpfx) return 0.0;
    if (s.pmode && (key < s.pkey || (key == s.pkey && v > s.ptie))) return 0.0;
    return hs_exp_nonpos_f64((double)x / temperature - zmax);
}

template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_warp_stats(const void *logits, int64_t T, int64_t V, const int64_t *n_dev, double temperature,
                                int64_t top_k, double top_p, hs_warp_stats *stats) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    char *scratch = sm + blockDim.x * sizeof(long long);
    double *hm = (double *)(scratch + HS_RADIX_SMEM); /* 256 bin masses + [256] pick */
    const int64_t row = blockIdx.x, b = row / T, i = row % T, base = row * V;
    if (n_dev && i >= n_dev[b]) return;
    hs_warp_stats s;
    memset(&s, 0, sizeof s);
    s.kshift = 32;
    float m;
    long long bad;
    hs_row_max_check<DT>(logits, base, V, red, &m, &bad);
    s.m = m;
    if (bad >= 0 || m == -HS_INF) {
        s.status = bad >= 0 ? -1 : -2;
        s.bad = bad;
        if (threadIdx.x == 0) stats[row] = s;
        return;
    }
    const double zmax = (double)m / temperature;
    hs_logit_key<DT> key{logits, base};
    if (top_k > 0 && top_k < V) {
        hs_radix<uint32_t> sel;
        hs_block_radix_select(key, V, top_k, scratch, red, &sel);
        s.kshift = sel.shift;
        s.kpfx = sel.pfx;
    }
    double W = 0.0;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) W += hs_warp_w(s, hs_ld<DT>(logits, base + v), v, temperature, zmax);
    W = hs_block_reduce(W, (double *)red, hs_op_sum());
    if (top_p < 1.0) {
        /* Mass-weighted radix descent: find the token where the best-first cumulative probability first
         * reaches top_p; everything before it and it are kept. */
        uint32_t pfx = 0;
        double above_all = 0.0; /* mass of keys above the current bin range */
        int found = 1;
        for (int shift = 24; shift >= 0 && found; shift -= 8) {
            for (unsigned j = threadIdx.x; j < 256; j += blockDim.x) hm[j] = 0.0;
            __syncthreads();
            for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
                float x = hs_ld<DT>(logits, base + v);
                uint32_t kk = hs_key32(x);
                if (shift == 24 || (kk >> (shift + 8)) == pfx) {
                    double w = hs_warp_w(s, x, v, temperature, zmax);
                    if (w > 0.0) atomicAdd(&hm[(kk >> shift) & 255u], w);
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                /* bins from the top; the first whose inclusion reaches top_p holds the crossing token */
                double a = above_all;
                long long pick = -1, lowest = -1;
                for (int j = 255; j >= 0; j--) {
                    if (hm[j] > 0.0 && (a + hm[j]) / W >= top_p) {
                        pick = j;
                        break;
                    }
                    if (hm[j] > 0.0) lowest = j;
                    a += hm[j];
                }
                if (pick < 0 && shift < 24) { /* this level's sums fell short by rounding: the bin's last key */
                    pick = lowest;
                    a -= hm[lowest];
                }
                hm[256] = (double)pick;
                hm[257] = a;
            }
            __syncthreads();
            long long pick = (long long)hm[256];
            above_all = hm[257];
            __syncthreads();
            if (pick < 0) found = 0; /* rounding left the total short of top_p: keep every survivor */
            else pfx = (pfx << 8) | (uint32_t)pick;
        }
        if (found) {
            /* pfx is now one key (one value): its tokens have equal weight; keep them in id order while the
             * cumulative probability before each is < top_p */
            float xv = hs_unkey32(pfx);
            double wv = hs_warp_w(s, xv, -1, temperature, zmax);
            long long cnt = 0;
            for (int64_t v = threadIdx.x; v < V; v += blockDim.x) cnt += hs_key32(hs_ld<DT>(logits, base + v)) == pfx;
            cnt = hs_block_reduce(cnt, red, hs_op_sum());
            long long q = 0;
            double c = above_all / W;
            while (q < cnt && c < top_p) {
                c += wv / W;
                q++;
            }
            /* the q-th token with this key, in id order */
            long long cut = -1, seen = 0;
            for (int64_t t0 = 0; t0 < V && seen < q; t0 += blockDim.x) {
                int64_t v = t0 + threadIdx.x;
                long long f = v < V && hs_key32(hs_ld<DT>(logits, base + v)) == pfx;
                long long total;
                long long ex = hs_block_exscan(f, red, &total);
                if (f && seen + ex == q - 1) hm[258] = (double)v;
                __syncthreads();
                if (seen + total >= q) cut = (long long)hm[258];
                seen += total;
                __syncthreads();
            }
            s.pmode = 1;
            s.pkey = pfx;
            s.ptie = cut;
            double R = 0.0;
            for (int64_t v = threadIdx.x; v < V; v += blockDim.x) R += hs_warp_w(s, hs_ld<DT>(logits, base + v), v, temperature, zmax);
            W = hs_block_reduce(R, (double *)red, hs_op_sum());
        }
    }
    s.R = W;
    s.status = 0;
    if (threadIdx.x == 0) stats[row] = s;
}

template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_sample_walk(const void *tt, int tdt, const void *tp, int pdt, int64_t T, const int64_t *n_dev,
                                 const void *logits, int64_t V, double temperature, const hs_warp_stats *stats,
                                 const uint64_t *seeds_dev, uint64_t seed0, uint64_t *offsets_dev, uint64_t offset0,
                                 int advance, int64_t *out_path, int64_t *out_len, int64_t *out_next,
                                 int64_t *out_draws, hs_cuda_error *err) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    long long *sh = red + blockDim.x; /* [0] state, [1] cur, [2] draws, [3] nrej, [4] len, [5] found */
    int64_t *tok = (int64_t *)(sh + 8);
    int64_t *rej = tok + T;
    int *par = (int *)(rej + T);
    int *flag = par + T;
    const int64_t b = blockIdx.x, nb = n_dev ? n_dev[b] : T;
    const uint64_t seed = seeds_dev ? seeds_dev[b] : seed0, offset = offsets_dev ? offsets_dev[b] : offset0;
    for (int64_t i = threadIdx.x; i < T; i += blockDim.x) out_path[b * T + i] = -1;
    if (!hs_load_tree(tt, tdt, tp, pdt, b, T, nb, V, par, tok, flag, err)) return;
    if (threadIdx.x == 0) {
        sh[1] = 0;
        sh[2] = 0;
        sh[4] = 1;
        out_path[b * T] = 0;
    }
    __syncthreads();
    for (;;) {
        /* thread 0: the children of cur in index order, each tested with one uniform */
        if (threadIdx.x == 0) {
            int64_t cur = sh[1], nrej = 0;
            uint64_t draw = (uint64_t)sh[2];
            const hs_warp_stats &s = stats[b * T + cur];
            long long state = -1; /* -2 error, -1 no child accepted, else the accepted node */
            if (s.status < 0) {
                if (s.status == -1) hs_report(err, HS_CE_LOGIT_NONFINITE, cur, s.bad >> 1, s.bad & 1);
                else hs_report(err, HS_CE_LOGIT_ALLNEG, cur);
                state = -2;
            } else {
                const double zmax = (double)s.m / temperature;
                double R = s.R;
                for (int64_t j = cur + 1; j < nb && state == -1; j++) {
                    if (par[j] != cur) continue;
                    int64_t t = tok[j];
                    int seen = 0;
                    for (int64_t q = 0; q < nrej; q++) seen |= rej[q] == t;
                    if (seen) continue; /* a duplicate sibling token was already rejected: no draw */
                    double u = hs_philox_u(seed, offset, draw++);
                    double w = hs_warp_w(s, hs_ld<DT>(logits, (b * T + cur) * V + t), t, temperature, zmax);
                    if (w > 0.0 && u * R < w) state = j;
                    else {
                        rej[nrej++] = t;
                        R -= w;
                    }
                }
            }
            sh[0] = state;
            sh[2] = (long long)draw;
            sh[3] = nrej;
            if (state >= 0) {
                sh[1] = state;
                out_path[b * T + sh[4]++] = state;
            }
        }
        __syncthreads();
        long long state = sh[0];
        __syncthreads();
        if (state == -2) return;
        if (state >= 0) continue;
        break;
    }
    /* residual draw at cur over the row with the rejected tokens removed: inverse CDF in id order */
    const int64_t cur = sh[1], nrej = sh[3], row = b * T + cur;
    const uint64_t draw = (uint64_t)sh[2];
    const hs_warp_stats &s = stats[row];
    const double zmax = (double)s.m / temperature;
    const double u = hs_philox_u(seed, offset, draw);
    const int64_t C = (V + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * C, hi = lo + C < V ? lo + C : V;
    double local = 0.0;
    long long last = -1;
    for (int64_t v = lo; v < hi; v++) {
        double w = hs_warp_w(s, hs_ld<DT>(logits, row * V + v), v, temperature, zmax);
        for (int64_t q = 0; q < nrej && w > 0.0; q++) w = rej[q] == v ? 0.0 : w;
        if (w > 0.0) last = v;
        local += w;
    }
    double S;
    double ex = hs_block_exscan(local, (double *)red, &S);
    last = hs_block_reduce(last, red, hs_op_max());
    long long pick = 0x7fffffffffffffffll;
    if (S > 0.0) {
        const double target = u * S;
        if (ex + local > target && lo < hi) {
            double c = ex;
            for (int64_t v = lo; v < hi; v++) {
                double w = hs_warp_w(s, hs_ld<DT>(logits, row * V + v), v, temperature, zmax);
                for (int64_t q = 0; q < nrej && w > 0.0; q++) w = rej[q] == v ? 0.0 : w;
                if (w <= 0.0) continue;
                c += w;
                if (c > target) {
                    pick = v;
                    break;
                }
            }
        }
    }
    pick = hs_block_reduce(pick, red, hs_op_min());
    if (threadIdx.x != 0) return;
    long long next;
    if (S > 0.0) next = pick != 0x7fffffffffffffffll ? pick : last;
    else if (nrej > 0) next = rej[nrej - 1];
    else {
        hs_report(err, HS_CE_NO_MASS, cur);
        return;
    }
    out_next[b] = next;
    out_len[b] = sh[4];
    out_draws[b] = (int64_t)(draw + 1);
    if (advance && offsets_dev) offsets_dev[b] = offset + draw + 1;
}

extern "C" size_t hs_cuda_verify_sample_workspace_bytes(int64_t batch, int64_t T) {
    return (size_t)(batch * T > 0 ? batch * T : 1) * sizeof(hs_warp_stats);
}

extern "C" hs_status hs_cuda_verify_sample(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                                           hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n_dev,
                                           const void *logits, hs_dtype logit_dtype, int64_t V, hs_sampling sp,
                                           const uint64_t *seeds_dev, uint64_t seed, uint64_t *offsets_dev,
                                           uint64_t offset, int advance_offsets, int64_t *out_path, int64_t *out_len,
                                           int64_t *out_next, int64_t *out_draws, void *ws, size_t ws_bytes,
                                           hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "verify_sample";
    if (!(sp.temperature > 0.0) || !isfinite(sp.temperature))
        return hs_fail(herr, HS_ERR_VALUE, op, "temperature",
                       "expected a finite value > 0 (use verify_greedy for greedy decoding), got %g", sp.temperature);
    if (sp.top_k < 0)
        return hs_fail(herr, HS_ERR_VALUE, op, "top_k", "expected >= 0 (0 disables it), got %lld", (long long)sp.top_k);
    if (!(sp.top_p > 0.0 && sp.top_p <= 1.0))
        return hs_fail(herr, HS_ERR_VALUE, op, "top_p", "expected a value in (0, 1], got %g", sp.top_p);
    hs_status chk = hs_verify_sizes(op, T, ws_bytes, hs_cuda_verify_sample_workspace_bytes(batch, T), herr);
    if (chk != HS_OK) return chk;
    if (batch == 0 || T == 0) return HS_OK;
    unsigned th = HS_ROW_THREADS;
    size_t sm_stats = hs_row_smem(th) + 260 * sizeof(double);
    size_t sm_walk = th * sizeof(long long) + 8 * 8 + (size_t)T * 16 + (size_t)(T + 1) * sizeof(int);
    hs_warp_stats *st = (hs_warp_stats *)ws;
    int rc, rc2;
#define HS_SAMPLE_LAUNCH(DT)                                                                                         \
    rc = HS_LAUNCH(hs_k_warp_stats<DT>, batch * T, th, sm_stats, stream, logits, T, V, n_dev, sp.temperature,     \
                   sp.top_k, sp.top_p, st);                                                                          \
    rc2 = rc ? rc : HS_LAUNCH(hs_k_sample_walk<DT>, batch, th, sm_walk, stream, tree_tokens, (int)token_dtype,     \
                              tree_parents, (int)parent_dtype, T, n_dev, logits, V, sp.temperature,                \
                              (const hs_warp_stats *)st, seeds_dev, seed, offsets_dev, offset, advance_offsets,     \
                              out_path, out_len, out_next, out_draws, err);
    switch (logit_dtype) {
    case HS_FLOAT32: HS_SAMPLE_LAUNCH(HS_FLOAT32) break;
    case HS_FLOAT16: HS_SAMPLE_LAUNCH(HS_FLOAT16) break;
    case HS_BFLOAT16: HS_SAMPLE_LAUNCH(HS_BFLOAT16) break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "target_logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(logit_dtype));
    }
#undef HS_SAMPLE_LAUNCH
    return hs_launched(rc2, op, herr);
}

/* ---- kv_compact ------------------------------------------------------------------------------------------ */

#define HS_KV_THREADS 128
#define HS_KV_NONE 0x7fffffffffffffffll

struct hs_kv_batch {
    hs_kv_tensor t[HS_CUDA_KV_MAX_TENSORS];
    int64_t first_block[HS_CUDA_KV_MAX_TENSORS + 1];
    int count;
};

/* Blocks [0, first_block[count]) move the rows of one (tensor, leading index) each; a launch for no rows has one
 * block that only checks.  Every block first checks prefix and slots (in parallel over the entries, two block
 * reductions), so a bad call moves nothing anywhere; block 0 records the error the CPU core would raise (the
 * first -1 entry ends the list; a non-(-1) entry after it first, then the valid entries in order). */
__global__ void HS_BOUNDS(HS_KV_THREADS) hs_k_kv_compact(hs_kv_batch kb, const int64_t *prefix_dev, int64_t prefix_host,
                                                         const void *slots, int sdt, int64_t m, int64_t min_S,
                                                         hs_cuda_error *err) {
    long long *red = (long long *)hs_smem();
    const int64_t prefix = prefix_dev ? *prefix_dev : prefix_host; /* read when the kernel runs (graph replays) */
    const int64_t t0 = threadIdx.x, step = blockDim.x;
    long long first = HS_KV_NONE; /* the first -1: this thread's first hit is its lowest */
    for (int64_t i = t0; i < m; i += step)
        if (hs_ld_id(slots, sdt, i) == -1) {
            first = i;
            break;
        }
    first = hs_block_reduce(first, red, hs_op_min());
    const int64_t mv = first == HS_KV_NONE ? m : first;
    /* the first violation as a key: -1 a negative prefix, i a non-(-1) entry after the padding began, m + i an
     * invalid entry i < mv */
    long long bad = prefix < 0 ? -1 : HS_KV_NONE;
    if (prefix >= 0) {
        const int64_t lim = min_S - prefix; /* prefix + s < min_S <=> s < lim, without overflow */
        for (int64_t i = t0; i < m; i += step) {
            const int64_t s = hs_ld_id(slots, sdt, i);
            long long key = HS_KV_NONE;
            if (i > mv) key = s != -1 ? i : HS_KV_NONE;
            else if (i < mv && (s < i || (i > 0 && s <= hs_ld_id(slots, sdt, i - 1)) || s >= lim)) key = m + i;
            bad = key < bad ? key : bad;
        }
    }
    bad = hs_block_reduce(bad, red, hs_op_min());
    if (bad != HS_KV_NONE) {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            if (bad < 0) {
                hs_report(err, HS_CE_PREFIX_NEG, prefix);
            } else if (bad < m) {
                hs_report(err, HS_CE_SLOT_PAD, hs_ld_id(slots, sdt, bad), bad, mv);
            } else {
                const int64_t i = bad - m, s = hs_ld_id(slots, sdt, i);
                if (s < i) hs_report(err, HS_CE_SLOT_LT_I, i, s);
                else if (i > 0 && s <= hs_ld_id(slots, sdt, i - 1)) hs_report(err, HS_CE_SLOT_ORDER, s, i, hs_ld_id(slots, sdt, i - 1));
                else hs_report(err, HS_CE_SLOT_RANGE, prefix, s, i, min_S);
            }
        }
        return;
    }
    if ((int64_t)blockIdx.x >= kb.first_block[kb.count]) return; /* a check-only block */
    int ti = 0;
    while (ti + 1 < kb.count && (int64_t)blockIdx.x >= kb.first_block[ti + 1]) ti++;
    const hs_kv_tensor t = kb.t[ti];
    const int64_t h = blockIdx.x - kb.first_block[ti];
    char *seq = (char *)t.data + (size_t)h * (size_t)t.S * (size_t)t.row_bytes;
    /* each thread moves the same byte range of every row, in row order: the in-place order of the CPU */
    const int wide = ((uintptr_t)t.data % 16 == 0) && (t.row_bytes % 16 == 0);
    for (int64_t i = 0; i < mv; i++) {
        int64_t s = hs_ld_id(slots, sdt, i);
        /* cannot fail after the checks above; re-tested on the value used, so that no write can ever leave the
         * tensor (even if the slot memory changed under us) */
        if (s < i || s >= t.S - prefix) break;
        if (s == i) continue;
        char *dst = seq + (size_t)(prefix + i) * (size_t)t.row_bytes;
        const char *src = seq + (size_t)(prefix + s) * (size_t)t.row_bytes;
        if (wide) {
            for (int64_t c = threadIdx.x; c < t.row_bytes / 16; c += blockDim.x) {
                /* 16-byte words through two 8-byte loads keep the emulated build free of vector types */
                const unsigned long long *sp_ = (const unsigned long long *)(src + c * 16);
                unsigned long long *dp = (unsigned long long *)(dst + c * 16);
                unsigned long long a = sp_[0], bb = sp_[1];
                dp[0] = a;
                dp[1] = bb;
            }
        } else {
            for (int64_t c = threadIdx.x; c < t.row_bytes; c += blockDim.x) dst[c] = src[c];
        }
    }
}

extern "C" hs_status hs_cuda_kv_compact(const hs_kv_tensor *tensors, int64_t count, const int64_t *prefix_dev,
                                        int64_t prefix_len, const void *slots, hs_dtype slot_dtype, int64_t m,
                                        hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "kv_compact";
    if (slot_dtype != HS_INT32 && slot_dtype != HS_INT64)
        return hs_fail(herr, HS_ERR_DTYPE, op, "slots", "expected int32 or int64, got %s", hs_dtype_name(slot_dtype));
    if (prefix_dev == NULL && prefix_len < 0)
        return hs_fail(herr, HS_ERR_VALUE, op, "prefix_len", "expected >= 0, got %lld", (long long)prefix_len);
    if (m < 0 || count < 0)
        return hs_fail(herr, HS_ERR_VALUE, op, "slots", "expected non-negative counts, got %lld slots, %lld tensors",
                       (long long)m, (long long)count);
    int64_t min_S = HS_KV_NONE; /* no tensor: nothing bounds the slots */
    for (int64_t i = 0; i < count; i++) {
        if (tensors[i].S < 0 || tensors[i].inner < 0 || tensors[i].row_bytes < 0)
            return hs_fail(herr, HS_ERR_VALUE, op, "tensors", "expected non-negative sizes, got S %lld, inner %lld, row %lld bytes",
                           (long long)tensors[i].S, (long long)tensors[i].inner, (long long)tensors[i].row_bytes);
        min_S = tensors[i].S < min_S ? tensors[i].S : min_S;
    }
    if (m == 0 && prefix_dev == NULL) return HS_OK; /* nothing to check, nothing to move */
    int64_t first = 0;
    do {
        hs_kv_batch kb;
        memset(&kb, 0, sizeof kb);
        kb.count = (int)(count - first < HS_CUDA_KV_MAX_TENSORS ? count - first : HS_CUDA_KV_MAX_TENSORS);
        int64_t blocks = 0;
        for (int i = 0; i < kb.count; i++) {
            kb.t[i] = tensors[first + i];
            kb.first_block[i] = blocks;
            blocks += kb.t[i].inner;
        }
        kb.first_block[kb.count] = blocks;
        if (blocks > 0x7fffffffll)
            return hs_fail(herr, HS_ERR_VALUE, op, "tensors", "expected at most 2^31 - 1 leading rows per launch, got %lld",
                           (long long)blocks);
        /* at least one block: the checks run (and a bad device prefix is recorded) even with nothing to move */
        int rc = HS_LAUNCH(hs_k_kv_compact, blocks > 0 ? blocks : 1, HS_KV_THREADS, HS_KV_THREADS * sizeof(long long),
                           stream, kb, prefix_dev, prefix_len, slots, (int)slot_dtype, m, min_S, err);
        hs_status s = hs_launched(rc, op, herr);
        if (s != HS_OK) return s;
        first += kb.count;
    } while (first < count);
    return HS_OK;
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
