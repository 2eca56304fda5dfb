/*
 * ops.cu -- the heterospec ops as CUDA kernels (semantics: docs/ops.md; CPU twins: csrc/core/).
 *
 * Layout of the work:
 *   split rows     the vocabulary-wide kernels cut every row into chunks (hs_chunk_len: enough blocks to
 *                  fill the device, at most 32 per row), one block per (row, chunk), and merge per row from
 *                  the chunks' partials and best-K candidates; see "split rows" below for why and how.
 *   topk_entropy   one block per row: row max + checks, a radix select of the k-th largest logit, then
 *                  the entropy over the taken set (ties at the k-th value counted `need` times).
 *   expand         k <= 256: chunks (max, sum of exponentials, k best by a threshold from the threads'
 *                  maxima), then one block per beam row merging them into the outputs and the entropy; the
 *                  last block of a request to finish (a counter in the workspace, reset by that block) picks
 *                  the next beams from all B*k scores, so two launches do a whole level.  Larger k: one
 *                  block per beam row doing all of it (the unsplit kernel).
 *   select         one block per request: radix select over float64 keys, ordered compaction.
 *   build_tree     one block per request: closure checks by binary search in the (ascending) selection,
 *                  depths, ancestor mask, leaves and retrieve rows, all in parallel over nodes.
 *   verify_greedy  argmax of every (node row, chunk) in parallel, a fold of each row's chunks, then one block
 *                  per request follows the accepted children.
 *   verify_sample  chunks of every node row (max, kept mass, the best K for the top-k / top-p cuts), one
 *                  block per node row deciding its statistics from those candidates (or, when they cannot
 *                  decide, from the whole row as the unsplit kernel does), one block per request walking the
 *                  tree with the CPU's Philox uniforms, then the residual draw split the same way (chunk
 *                  masses, then one block per request finds the chunk and the token by inverse CDF).
 *   kv_compact     one launch for up to 64 tensors (descriptors passed by value, so a captured graph keeps
 *                  them), one block per (tensor, leading index); every block checks the prefix (a device
 *                  value read when the kernel runs, or a host int) and the -1-padded slots first, in
 *                  parallel over the entries, so a bad call moves nothing.
 *   bucketize      one thread per value, binary search.
 * Sums that the CPU does in a fixed sequential order are parallel here: floats agree to ~1e-7 relative,
 * and a sampled path can only differ when a uniform lands within ~1e-15 of a boundary.  The top-p cut is
 * the exception that needs care: at a run of equal logits it can fall exactly on top_p, so its crossing is
 * taken in the CPU's token-by-token order (hs_k_sample_merge, hs_warp_stats_row).
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

/* A row's failure as the CPU reports it (thread 0): a NaN/+inf entry, else all -inf; returns 1 if the row is
 * fine.  Block-uniform. */
__device__ __forceinline__ int hs_row_ok(long long bad, float m, int64_t r, hs_cuda_error *err) {
    if (bad < 0 && m != -HS_INF) return 1;
    if (threadIdx.x == 0) {
        if (bad >= 0) hs_report(err, HS_CE_LOGIT_NONFINITE, r, bad >> 1, bad & 1);
        else hs_report(err, HS_CE_LOGIT_ALLNEG, r);
    }
    return 0;
}

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
    if (!hs_row_ok(bad, m, r, err)) return;
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

/* ---- split rows ----------------------------------------------------------------------------------------
 * One block per row leaves most of a GPU idle when a call has few rows (a level expand: 10 rows; a verify: 60
 * rows on 132 SMs) and makes each block walk a whole 128k-entry row several times.  The row kernels below
 * cut every row into chunks (hs_chunk_len: enough blocks to fill the device, at most HS_MAX_CHUNKS per row),
 * one block per (row, chunk), each writing a partial (its max, first bad entry, a sum of exponentials
 * relative to its own max) and its K best entries; a merge kernel per row then works on C partials and C*K
 * candidates instead of V entries.  The row's top-K is exactly the top-K of the union of the chunks' top-K
 * (an entry beaten by fewer than K entries of the row is beaten by fewer than K of its chunk).
 *
 * A chunk's top-K avoids the radix histogram, whose first passes send most entries to a few bins (the
 * exponent byte of the logits) and so serialise on shared-memory atomics: the K-th largest of the threads'
 * own maxima is a lower bound for the chunk's K-th largest entry (they are K distinct entries), so only the
 * entries at or above it (a few times K for real logits) are appended to a shared list and ranked there.  A
 * list that overflows (many equal values) falls back to the radix select.                                */
#ifdef HS_CUDA_EMU
#define HS_CHUNK_MIN 256     /* small chunks, so that the tests' rows of a few thousand entries are split */
#else
#define HS_CHUNK_MIN 1024
#endif
/* four blocks per SM of an H100 (132 SMs); the emulation uses the same target, so that its rows are split as
 * a GPU's are (with a target of 1 block, rows * V / 1 >= V kept every row in one chunk and the merge paths
 * were never run off a GPU: tests/test_cuda.py checks hs_cuda_chunks) */
#define HS_TARGET_BLOCKS 528
#define HS_MAX_CHUNKS 32
#define HS_CAND_MAX 256   /* the largest K the split path takes (expand k, verify_sample top_k) */
#define HS_TOPP_CAND 128  /* candidates per chunk for a top-p cut without top-k */
#define HS_FILTER_CAP 2048
#define HS_SORT_MAX 1536  /* sorted candidates a verify_sample merge keeps (its shared memory stays under 48 KB) */
#define HS_CHUNK_THREADS HS_TREE_THREADS

/* Entries per chunk for `rows` rows of V: spread over about HS_TARGET_BLOCKS blocks, at least HS_CHUNK_MIN
 * entries, at most HS_MAX_CHUNKS chunks per row. */
static int64_t hs_chunk_len(int64_t rows, int64_t V) {
    if (V < 1) return 1;
    int64_t c = rows > 0 && rows <= INT64_MAX / V ? (rows * V + HS_TARGET_BLOCKS - 1) / HS_TARGET_BLOCKS : V;
    int64_t lo = (V + HS_MAX_CHUNKS - 1) / HS_MAX_CHUNKS;
    c = c < lo ? lo : c;
    c = c < HS_CHUNK_MIN ? HS_CHUNK_MIN : c;
    return c > V ? V : c;
}
static int64_t hs_nchunks(int64_t V, int64_t len) { return V < 1 ? 1 : (V + len - 1) / len; }
extern "C" int64_t hs_cuda_chunks(int64_t rows, int64_t V) { return hs_nchunks(V, hs_chunk_len(rows, V)); }
__host__ __device__ static inline size_t hs_al16(size_t n) { return (n + 15) & ~(size_t)15; }

/* What one (row, chunk) block leaves for the merge. */
struct hs_part {
    double s;      /* sum of exponentials relative to m (the op's form), when asked for */
    float m;       /* max over the entries that are neither NaN nor +inf (-inf if none) */
    int count;     /* candidates written: min(K, entries of the chunk), 0 for a bad chunk */
    long long bad; /* the chunk's lowest NaN/+inf entry of the row as col*2 + is_inf, or -1 */
};

/* The K best of n keys (key desc, index asc) into out_key / out_idx (index + idx0), best first.  tmax: this
 * thread's largest key over the entries it read with the same stride (0 if none).  Shared: red, scratch
 * (HS_RADIX_SMEM), tk (blockDim), fk/fi (HS_FILTER_CAP), cand/cval/rank (K) and two ints.  Every thread calls it. */
template <class KeyFn>
__device__ int hs_chunk_topk(const KeyFn &key, int64_t n, int K, uint32_t tmax, int64_t idx0, long long *red, char *scratch,
                             uint32_t *tk, uint32_t *fk, int *fi, int64_t *cand, uint32_t *cval, int *rank, int *ints,
                             uint32_t *out_key, int64_t *out_idx) {
    const int want = n < K ? (int)n : K;
    if (want <= 0) return 0;
    uint32_t thr = 0; /* every entry passes when no bound is known */
    if (n > K && K <= (int)blockDim.x) {
        tk[threadIdx.x] = tmax;
        __syncthreads();
        int r = 0; /* rank of this thread's maximum among all threads' (ties by thread): one thread has K - 1 */
        for (unsigned j = 0; j < blockDim.x; j++) r += tk[j] > tmax || (tk[j] == tmax && j < threadIdx.x);
        if (r == K - 1) ints[1] = (int)tmax;
        __syncthreads();
        thr = (uint32_t)ints[1];
    }
    if (threadIdx.x == 0) ints[0] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        uint32_t kk = key(i);
        if (kk >= thr) {
            int p = atomicAdd(&ints[0], 1);
            if (p < HS_FILTER_CAP) {
                fk[p] = kk;
                fi[p] = (int)i;
            }
        }
    }
    __syncthreads();
    const int nf = ints[0];
    __syncthreads();
    if (nf <= HS_FILTER_CAP) {
        for (int e = threadIdx.x; e < nf; e += blockDim.x) {
            const uint32_t a = fk[e];
            const int ai = fi[e];
            int r = 0;
            for (int j = 0; j < nf; j++) r += fk[j] > a || (fk[j] == a && fi[j] < ai);
            if (r < want) {
                out_key[r] = a;
                out_idx[r] = idx0 + ai;
            }
        }
    } else {
        hs_radix<uint32_t> sel;
        hs_block_radix_select(key, n, want, scratch, red, &sel);
        hs_collect_sorted(key, n, want, sel, cand, cval, rank, ints);
        for (int c = threadIdx.x; c < want; c += blockDim.x) {
            out_key[rank[c]] = cval[c];
            out_idx[rank[c]] = idx0 + cand[c];
        }
    }
    __syncthreads();
    return want;
}

static size_t hs_chunk_smem(unsigned th, int K) {
    return hs_al16(th * sizeof(long long) + HS_RADIX_SMEM) + hs_al16(th * 4) + (size_t)HS_FILTER_CAP * 8 +
           (size_t)(K > 0 ? K : 1) * 16 + 16;
}

/* With `sum`: s = sum of expf(x - m) (MODE 0: expand) or of exp(x/t - m/t) in float64 (MODE 1: verify_sample).  Rows i >= n_dev[i / T] of a verify call are skipped.  Grid: rows * C blocks. */
template <int DT, int MODE>
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_chunks(const void *logits, int64_t V, int64_t len, int64_t C, int64_t T,
                                                        const int64_t *n_dev, int K, int sum, double temperature,
                                                        hs_part *parts, uint32_t *ckey, int64_t *cidx) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    char *scratch = sm + blockDim.x * sizeof(long long);
    uint32_t *tk = (uint32_t *)(sm + hs_al16(blockDim.x * sizeof(long long) + HS_RADIX_SMEM));
    uint32_t *fk = tk + ((blockDim.x + 3) & ~3u);
    int *fi = (int *)(fk + HS_FILTER_CAP);
    int64_t *cand = (int64_t *)(fi + HS_FILTER_CAP);
    uint32_t *cval = (uint32_t *)(cand + (K > 0 ? K : 1));
    int *rank = (int *)(cval + (K > 0 ? K : 1));
    int *ints = rank + (K > 0 ? K : 1);
    const int64_t rc = blockIdx.x, row = rc / C, c = rc % C;
    if (n_dev && row % T >= n_dev[row / T]) return;
    const int64_t c0 = c * len, n = V - c0 < len ? V - c0 : len, base = row * V + c0;
    float m = -HS_INF;
    long long bad = 0x7fffffffffffffffll;
    uint32_t tmax = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float x = hs_ld<DT>(logits, base + i);
        if (x != x || x == HS_INF) {
            long long code = (long long)(c0 + i) * 2 + (x == HS_INF);
            bad = code < bad ? code : bad;
        } else {
            m = x > m ? x : m;
            uint32_t kk = hs_key32(x);
            tmax = kk > tmax ? kk : tmax;
        }
    }
    bad = hs_block_reduce(bad, red, hs_op_min());
    m = hs_block_reduce(m, (float *)red, hs_op_max());
    double s = 0.0;
    int count = 0;
    if (bad == 0x7fffffffffffffffll) {
        if (m != -HS_INF && sum) {
            const double zm = (double)m / temperature;
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
                float x = hs_ld<DT>(logits, base + i);
                s += MODE == 0 ? (double)expf(x - m) : hs_exp_nonpos_f64((double)x / temperature - zm);
            }
            s = hs_block_reduce(s, (double *)red, hs_op_sum());
        }
        hs_logit_key<DT> key{logits, base};
        count = hs_chunk_topk(key, n, K, tmax, c0, red, scratch, tk, fk, fi, cand, cval, rank, ints,
                              ckey + rc * (int64_t)K, cidx + rc * (int64_t)K);
    }
    if (threadIdx.x == 0) {
        hs_part p;
        p.s = s;
        p.m = m;
        p.count = count;
        p.bad = bad == 0x7fffffffffffffffll ? -1 : bad;
        parts[rc] = p;
    }
}

/* A row's merged max and first bad entry, from its C partials (every thread gets them). */
__device__ __forceinline__ void hs_merge_max(const hs_part *P, int64_t C, long long *red, float *m_out, long long *bad_out) {
    float m = -HS_INF;
    long long bad = 0x7fffffffffffffffll;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        m = P[c].m > m ? P[c].m : m;
        if (P[c].bad >= 0 && P[c].bad < bad) bad = P[c].bad;
    }
    bad = hs_block_reduce(bad, red, hs_op_min());
    *m_out = hs_block_reduce(m, (float *)red, hs_op_max());
    *bad_out = bad == 0x7fffffffffffffffll ? -1 : bad;
}

/* Rank of candidate (key, id) among all chunks' sorted lists: entries before it in its own list (j) plus, in
 * every other list, the prefix that beats it (key desc, id asc), found by binary search. */
__device__ __forceinline__ int64_t hs_merge_rank(const uint32_t *CK, const int64_t *CI, const hs_part *P, int64_t C, int K,
                                                 int64_t c, int64_t j) {
    const uint32_t key = CK[c * K + j];
    const int64_t id = CI[c * K + j];
    int64_t r = j;
    for (int64_t o = 0; o < C; o++) {
        if (o == c) continue;
        const uint32_t *ok = CK + o * K;
        const int64_t *oi = CI + o * K;
        int lo = 0, hi = P[o].count;
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (ok[mid] > key || (ok[mid] == key && oi[mid] < id)) lo = mid + 1;
            else hi = mid;
        }
        r += lo;
    }
    return r;
}

/* The first half of a split topk_entropy / expand: carve partials and k-best lists for rows x C chunks out of
 * ws and launch the chunk kernel (MODE 0, the sum of expf(x - m) when `sum`). */
struct hs_chunk_out {
    hs_part *parts;
    uint32_t *ck;
    int64_t *ci;
    int64_t C;
};
static size_t hs_chunk_out_bytes(int64_t rows, int64_t V, int64_t k) {
    const int64_t C = hs_nchunks(V, hs_chunk_len(rows, V));
    return hs_al16((size_t)(rows * C) * sizeof(hs_part)) + hs_al16((size_t)(rows * C * k) * 4) +
           hs_al16((size_t)(rows * C * k) * 8);
}
static hs_status hs_launch_chunks(const char *op, const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
                                  int sum, void *ws, hs_chunk_out *o, void *stream, hs_error *herr) {
    const int64_t len = hs_chunk_len(rows, V), C = hs_nchunks(V, len);
    if (rows * C > 0x7fffffffll)
        return hs_fail(herr, HS_ERR_VALUE, op, "logits", "expected at most 2^31 - 1 (row, chunk) blocks, got %lld",
                       (long long)(rows * C));
    char *p = (char *)ws;
    o->C = C;
    o->parts = (hs_part *)p;
    o->ck = (uint32_t *)(p += hs_al16((size_t)(rows * C) * sizeof(hs_part)));
    o->ci = (int64_t *)(p + hs_al16((size_t)(rows * C * k) * 4));
    const unsigned tc = HS_CHUNK_THREADS;
    const size_t smc = hs_chunk_smem(tc, (int)k);
    int rc;
#define HS_CHUNK_ARGS logits, V, len, C, (int64_t)1, (const int64_t *)nullptr, (int)k, sum, 1.0, o->parts, o->ck, o->ci
    switch (dtype) {
    case HS_FLOAT32: rc = HS_LAUNCH((hs_k_chunks<HS_FLOAT32, 0>), rows * C, tc, smc, stream, HS_CHUNK_ARGS); break;
    case HS_FLOAT16: rc = HS_LAUNCH((hs_k_chunks<HS_FLOAT16, 0>), rows * C, tc, smc, stream, HS_CHUNK_ARGS); break;
    case HS_BFLOAT16: rc = HS_LAUNCH((hs_k_chunks<HS_BFLOAT16, 0>), rows * C, tc, smc, stream, HS_CHUNK_ARGS); break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(dtype));
    }
#undef HS_CHUNK_ARGS
    return hs_launched(rc, op, herr);
}

/* The split topk_entropy's merge, one block per row: the entropy over the row's k best candidates. */
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_entropy_merge(int64_t C, int64_t k, double temperature, const hs_part *parts,
                                                               const uint32_t *ckey, const int64_t *cidx, float *out,
                                                               hs_cuda_error *err) {
    long long *red = (long long *)hs_smem();
    const int64_t r = blockIdx.x;
    const hs_part *P = parts + r * C;
    float m;
    long long bad;
    hs_merge_max(P, C, red, &m, &bad);
    if (!hs_row_ok(bad, m, r, err)) return;
    const uint32_t *CK = ckey + r * C * k;
    const int64_t *CI = cidx + r * C * k;
    const double zmax = (double)m / temperature;
    double Z = 0.0, S = 0.0;
    for (int64_t e = threadIdx.x; e < C * k; e += blockDim.x) {
        const int64_t c = e / k, j = e % k;
        if (j >= P[c].count || hs_merge_rank(CK, CI, P, C, (int)k, c, j) >= k) continue;
        const float x = hs_unkey32(CK[e]);
        if (x == -HS_INF) continue;
        double d = (double)x / temperature - zmax, ex = exp(d);
        Z += ex;
        S += ex * d;
    }
    hs_block_entropy(Z, S, red, out + r);
}

static size_t hs_row_smem(unsigned threads) { return threads * sizeof(long long) + HS_RADIX_SMEM; }

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
    if (!(temperature > 0.0) || !isfinite(temperature))
        return hs_fail(herr, HS_ERR_VALUE, op, "temperature", "expected a finite value > 0, got %g", temperature);
    if (ws_bytes < hs_cuda_topk_entropy_workspace_bytes(rows, k, V))
        return hs_fail(herr, HS_ERR_WORKSPACE, op, "workspace", "expected >= %zu bytes, got %zu",
                       hs_cuda_topk_entropy_workspace_bytes(rows, k, V), ws_bytes);
    if (rows == 0) return HS_OK;
    int rc;
    if (k <= HS_CAND_MAX) {
        hs_chunk_out o;
        hs_status st = hs_launch_chunks(op, logits, dtype, rows, V, k, 0, ws, &o, stream, herr);
        if (st != HS_OK) return st;
        rc = HS_LAUNCH(hs_k_entropy_merge, rows, HS_CHUNK_THREADS, HS_CHUNK_THREADS * sizeof(long long), stream, o.C, k,
                       temperature, (const hs_part *)o.parts, (const uint32_t *)o.ck, (const int64_t *)o.ci, out, err);
        return hs_launched(rc, op, herr);
    }
    unsigned th = HS_ROW_THREADS;
    size_t sm = hs_row_smem(th);
    switch (dtype) {
    case HS_FLOAT32: rc = HS_LAUNCH(hs_k_topk_entropy<HS_FLOAT32>, rows, th, sm, stream, logits, V, k, temperature, out, err); break;
    case HS_FLOAT16: rc = HS_LAUNCH(hs_k_topk_entropy<HS_FLOAT16>, rows, th, sm, stream, logits, V, k, temperature, out, err); break;
    case HS_BFLOAT16: rc = HS_LAUNCH(hs_k_topk_entropy<HS_BFLOAT16>, rows, th, sm, stream, logits, V, k, temperature, out, err); break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(dtype));
    }
    return hs_launched(rc, op, herr);
}

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

/* expand's checks of a beam row's score and node (thread 0 reports); 1 if both are fine. */
__device__ __forceinline__ int hs_beam_ok(double base, int64_t node, int64_t r, hs_cuda_error *err) {
    int ok = 1;
    if (base != base || base == (double)HS_INF) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_BEAM_SCORE, r);
        ok = 0;
    }
    if (node < -1) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_BEAM_NODE, node, r);
        ok = 0;
    }
    return ok;
}

/* The last block of request bi to get here (a counter per request, reset by that block, so the next launch
 * and a graph replay start from zero) picks the next beams from all B*k scores of the request. */
__device__ void hs_pick_next_beams(int64_t B, int64_t k, int64_t bi, int64_t node_offset, float *out_scores,
                                   int64_t *out_next_beams, unsigned *counters, char *scratch, long long *red,
                                   int64_t *cand, uint32_t *cval, int *rank, int *shared_int) {
    const int64_t Bk = B * k;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) shared_int[1] = atomicAdd(&counters[bi], 1u) == (unsigned)(B - 1);
    __syncthreads();
    if (!shared_int[1]) return;
    __threadfence();
    if (threadIdx.x == 0) counters[bi] = 0; /* ready for the next launch (and graph replay) */ /* ready for the next launch (and graph replay) */
    hs_score_key skey{out_scores + bi * Bk};
    hs_radix<uint32_t> sel;
    hs_block_radix_select(skey, Bk, k, scratch, red, &sel);
    hs_collect_sorted(skey, Bk, k, sel, cand, cval, rank, shared_int);
    for (int c = threadIdx.x; c < k; c += blockDim.x) out_next_beams[bi * k + rank[c]] = node_offset + cand[c];
}


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
    const double base = hs_ld_real(beam_scores, score_dt, r);
    const int64_t node = hs_ld_id(beam_nodes, node_dt, r);
    int ok = hs_beam_ok(base, node, r, err);
    float m;
    long long bad;
    hs_row_max_check<DT>(logits, r * Vd, Vd, red, &m, &bad);
    if (!hs_row_ok(bad, m, r, err)) ok = 0;
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
        for (int c = threadIdx.x; c < k; c += blockDim.x)
            hs_expand_out(cand[c], hs_unkey32(cval[c]), bi * Bk + b * k + rank[c], m, lse, base, node, d2t, d2t_dt,
                          out_tokens, out_scores, out_parents, &Z, &S, err);
        hs_block_entropy(Z, S, red, out_entropy + r);
    }
    /* the last block of request bi to get here picks the next beams from all B*k scores */
    hs_pick_next_beams(B, k, bi, node_offset, out_scores, out_next_beams, counters, scratch, red, cand, cval, rank,
                       shared_int);
}

/* The split expand's second half: one block per beam row merges its chunks' partials and k-best lists into
 * the row's outputs; the last block of a request picks the next beams, as hs_k_expand does. */
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_expand_merge(int64_t B, int64_t C, const hs_part *parts, const uint32_t *ckey,
                                                              const int64_t *cidx, const void *beam_scores, int score_dt,
                                                              const void *beam_nodes, int node_dt, int64_t k, const void *d2t,
                                                              int d2t_dt, int64_t node_offset, int64_t *out_tokens,
                                                              float *out_scores, int64_t *out_parents, float *out_entropy,
                                                              int64_t *out_next_beams, unsigned *counters, hs_cuda_error *err) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    char *scratch = sm + blockDim.x * sizeof(long long);
    int64_t *cand = (int64_t *)(scratch + HS_RADIX_SMEM);
    uint32_t *cval = (uint32_t *)(cand + k);
    int *rank = (int *)(cval + k);
    int *shared_int = rank + k; /* [0] count, [1] last-block flag */
    const int64_t r = blockIdx.x, bi = r / B, b = r % B, Bk = B * k;
    const hs_part *P = parts + r * C;
    const double base = hs_ld_real(beam_scores, score_dt, r);
    const int64_t node = hs_ld_id(beam_nodes, node_dt, r);
    int ok = hs_beam_ok(base, node, r, err);
    float m;
    long long bad;
    hs_merge_max(P, C, red, &m, &bad);
    if (!hs_row_ok(bad, m, r, err)) ok = 0;
    if (ok) {
        double s = 0.0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            if (P[c].m != -HS_INF) s += P[c].s * exp((double)P[c].m - (double)m);
        s = hs_block_reduce(s, (double *)red, hs_op_sum());
        const double lse = log(s);
        const uint32_t *CK = ckey + r * C * k;
        const int64_t *CI = cidx + r * C * k;
        double Z = 0.0, S = 0.0;
        for (int64_t e = threadIdx.x; e < C * k; e += blockDim.x) {
            const int64_t c = e / k, j = e % k;
            if (j >= P[c].count) continue;
            const int64_t rk = hs_merge_rank(CK, CI, P, C, (int)k, c, j);
            if (rk >= k) continue;
            hs_expand_out(CI[e], hs_unkey32(CK[e]), bi * Bk + b * k + rk, m, lse, base, node, d2t, d2t_dt, out_tokens,
                          out_scores, out_parents, &Z, &S, err);
        }
        hs_block_entropy(Z, S, red, out_entropy + r);
    }
    hs_pick_next_beams(B, k, bi, node_offset, out_scores, out_next_beams, counters, scratch, red, cand, cval, rank,
                       shared_int);
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
        rc = HS_LAUNCH(hs_k_expand_merge, rows, tc, hs_row_smem(tc) + (size_t)k * (8 + 4 + 4) + 16, stream, B, o.C,
                       (const hs_part *)o.parts, (const uint32_t *)o.ck, (const int64_t *)o.ci, beam_scores, (int)score_dtype,
                       beam_nodes, (int)node_dtype, k, d2t, (int)d2t_dtype, node_offset, out_tokens, out_scores,
                       out_parents, out_entropy, out_next_beams, ctr, err);
        return hs_launched(rc, op, herr);
    }
    unsigned th = HS_ROW_THREADS;
    size_t sm = hs_row_smem(th) + (size_t)k * (8 + 4 + 4) + 16;
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
    for (int64_t i = nb + threadIdx.x; i < N; i += blockDim.x) out[b * N + i] = -1; /* past the row's count */
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
    /* rows past the tree: -1 and no mask bits (a batch's shorter rows) */
    for (int64_t i = Tb + threadIdx.x; i < T; i += blockDim.x) ot[i] = op_[i] = od[i] = -1;
    for (int64_t e = Tb * T + threadIdx.x; e < T * T; e += blockDim.x) out_mask[b * T * T + e] = 0;
    if (R < 0) {
        if (threadIdx.x == 0) hs_report(err, HS_CE_ROOT_NEG, R, b);
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

/* Row argmax, split: one block per (node row, chunk) leaves the chunk's best entry packed as key << 32 |
 * ~col (ties to the lower id) and its first bad entry; hs_k_argmax_merge folds a row's chunks into
 * ws[2*row] = argmax, ws[2*row+1] = -1, or the error (argmax -1 and col*2+is_inf, or -2 for an all -inf row). */
template <int DT>
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_argmax_chunks(const void *logits, int64_t T, int64_t V, int64_t len, int64_t C,
                                                               const int64_t *n_dev, unsigned long long *pbest, long long *pbad) {
    long long *red = (long long *)hs_smem();
    const int64_t rc = blockIdx.x, row = rc / C, c = rc % C;
    if (n_dev && row % T >= n_dev[row / T]) return;
    const int64_t c0 = c * len, c1 = V - c0 < len ? V : c0 + len;
    unsigned long long best = 0;
    long long bad = 0x7fffffffffffffffll;
    for (int64_t v = c0 + threadIdx.x; v < c1; v += blockDim.x) {
        float x = hs_ld<DT>(logits, row * V + v);
        if (x != x || x == HS_INF) {
            long long code = (long long)v * 2 + (x == HS_INF);
            bad = code < bad ? code : bad;
        } else {
            unsigned long long pk = ((unsigned long long)hs_key32(x) << 32) | (0xffffffffull - (unsigned long long)v);
            best = pk > best ? pk : best;
        }
    }
    bad = hs_block_reduce(bad, red, hs_op_min());
    best = hs_block_reduce(best, (unsigned long long *)red, hs_op_max());
    if (threadIdx.x == 0) {
        pbest[rc] = best;
        pbad[rc] = bad;
    }
}

__global__ void HS_BOUNDS(HS_TREE_THREADS) hs_k_argmax_merge(int64_t rows, int64_t T, int64_t C, const int64_t *n_dev,
                                                             const unsigned long long *pbest, const long long *pbad,
                                                             long long *ws) {
    const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows || (n_dev && row % T >= n_dev[row / T])) return;
    unsigned long long best = 0;
    long long bad = 0x7fffffffffffffffll;
    for (int64_t c = 0; c < C; c++) {
        best = pbest[row * C + c] > best ? pbest[row * C + c] : best;
        bad = pbad[row * C + c] < bad ? pbad[row * C + c] : bad;
    }
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
    if (threadIdx.x == 0) {
        /* what a failed row leaves (its error is in *err): the root alone and token 0, values every later
         * device op can index with, so the recorded error is what the host reports, not a device assert of
         * torch's (an uninitialised length indexing a scatter) that poisons the context */
        out_path[b * T] = 0;
        out_len[b] = 1;
        out_next[b] = 0;
    }
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

/* Workspace: the merged per-row results [rows][2], then the chunks' best [rows * C] and bad [rows * C]. */
extern "C" size_t hs_cuda_verify_greedy_workspace_bytes(int64_t batch, int64_t T, int64_t V) {
    const int64_t rows = batch * T > 0 ? batch * T : 1, C = hs_nchunks(V, hs_chunk_len(rows, V));
    return hs_al16((size_t)rows * 2 * sizeof(long long)) + 2 * hs_al16((size_t)(rows * C) * 8);
}

static size_t hs_walk_smem(int64_t T) { return (size_t)(2 * T + 1) * sizeof(int) + 8 + (size_t)T * 8; }

extern "C" hs_status hs_cuda_verify_greedy(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                                           hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n_dev,
                                           const void *logits, hs_dtype logit_dtype, int64_t V, int64_t *out_path,
                                           int64_t *out_len, int64_t *out_next, void *ws, size_t ws_bytes,
                                           hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "verify_greedy";
    hs_status chk = hs_verify_sizes(op, T, ws_bytes, hs_cuda_verify_greedy_workspace_bytes(batch, T, V), herr);
    if (chk != HS_OK) return chk;
    if (batch == 0 || T == 0) return HS_OK;
    const int64_t rows = batch * T, len = hs_chunk_len(rows, V), C = hs_nchunks(V, len);
    if (rows * C > 0x7fffffffll)
        return hs_fail(herr, HS_ERR_VALUE, op, "tree_tokens", "expected at most 2^31 - 1 (node, chunk) blocks, got %lld",
                       (long long)(rows * C));
    const unsigned tc = HS_CHUNK_THREADS;
    long long *st = (long long *)ws;
    unsigned long long *pbest = (unsigned long long *)((char *)ws + hs_al16((size_t)rows * 2 * sizeof(long long)));
    long long *pbad = (long long *)((char *)pbest + hs_al16((size_t)(rows * C) * 8));
    int rc;
#define HS_ARGMAX_ARGS logits, T, V, len, C, n_dev, pbest, pbad
    switch (logit_dtype) {
    case HS_FLOAT32: rc = HS_LAUNCH(hs_k_argmax_chunks<HS_FLOAT32>, rows * C, tc, tc * sizeof(long long), stream, HS_ARGMAX_ARGS); break;
    case HS_FLOAT16: rc = HS_LAUNCH(hs_k_argmax_chunks<HS_FLOAT16>, rows * C, tc, tc * sizeof(long long), stream, HS_ARGMAX_ARGS); break;
    case HS_BFLOAT16: rc = HS_LAUNCH(hs_k_argmax_chunks<HS_BFLOAT16>, rows * C, tc, tc * sizeof(long long), stream, HS_ARGMAX_ARGS); break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "target_logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(logit_dtype));
    }
#undef HS_ARGMAX_ARGS
    hs_status s = hs_launched(rc, op, herr);
    if (s != HS_OK) return s;
    rc = HS_LAUNCH(hs_k_argmax_merge, (rows + tc - 1) / tc, tc, 0, stream, rows, T, C, n_dev,
                   (const unsigned long long *)pbest, (const long long *)pbad, st);
    s = hs_launched(rc, op, herr);
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

/* One row's statistics by one block over the whole row (shared: red, radix scratch, 260 doubles from sm).
 * The split path (hs_k_chunks + hs_k_sample_merge) falls back to it for rows its candidates cannot decide. */
template <int DT>
__device__ void hs_warp_stats_row(const void *logits, int64_t row, int64_t V, double temperature, int64_t top_k,
                                  double top_p, char *sm, hs_warp_stats *stats) {
    long long *red = (long long *)sm;
    char *scratch = sm + blockDim.x * sizeof(long long);
    double *hm = (double *)(scratch + HS_RADIX_SMEM); /* 256 bin masses + [256] pick */
    const int64_t base = row * V;
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
            /* the q-th token with this key, in id order (all of them: no ordered scan needed) */
            long long cut = q < cnt ? -1 : V - 1, seen = 0;
            for (int64_t t0 = 0; q < cnt && t0 < V && seen < q; t0 += blockDim.x) {
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

/* The unsplit statistics: one block per node row (top_k > HS_CAND_MAX). */
template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_warp_stats(const void *logits, int64_t T, int64_t V, const int64_t *n_dev,
                                                          double temperature, int64_t top_k, double top_p,
                                                          hs_warp_stats *stats) {
    const int64_t row = blockIdx.x, b = row / T, i = row % T;
    if (n_dev && i >= n_dev[b]) return;
    hs_warp_stats_row<DT>(logits, row, V, temperature, top_k, top_p, hs_smem(), stats);
}

/* The split statistics' second half, one block per node row: the row's max and first bad entry from its
 * chunks; the top-k cut, the kept mass and the top-p cut from the chunks' candidates sorted by rank.  The
 * candidates decide the row exactly when every token the cuts depend on is among them:
 *   - top-k (k <= HS_CAND_MAX, each chunk's k best kept): the survivors are the keys >= the k-th largest;
 *     they all are candidates unless a chunk that was cut short ends on the k-th value itself (more equal
 *     values may follow there);
 *   - top-p without top-k: the chunks kept their HS_TOPP_CAND best; every key above theta (the largest
 *     last key of a chunk that was cut short) is a candidate, so a crossing above theta is exact.
 * Otherwise (a flat row whose nucleus is wider than the candidates, many equal values) the block computes
 * the row as the unsplit kernel does (hs_warp_stats_row): same semantics, slower. */
template <int DT>
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_sample_merge(const void *logits, int64_t T, int64_t V, const int64_t *n_dev,
                                                            double temperature, int64_t top_k, double top_p, int64_t len,
                                                            int64_t C, int K, const hs_part *parts, const uint32_t *ckey,
                                                            const int64_t *cidx, hs_warp_stats *stats) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    double *sw = (double *)(sm + hs_al16(blockDim.x * sizeof(long long) + HS_RADIX_SMEM + 260 * sizeof(double)));
    int64_t *sid = (int64_t *)(sw + HS_SORT_MAX);
    uint32_t *sk = (uint32_t *)(sid + HS_SORT_MAX);
    double *shd = (double *)(sk + HS_SORT_MAX); /* [0] the inclusive mass at the crossing */
    const int64_t row = blockIdx.x, b = row / T, i = row % T;
    if (n_dev && i >= n_dev[b]) return;
    const hs_part *P = parts + row * C;
    float m;
    long long bad;
    hs_merge_max(P, C, red, &m, &bad);
    hs_warp_stats s;
    memset(&s, 0, sizeof s);
    s.kshift = 32;
    s.m = m;
    if (bad >= 0 || m == -HS_INF) {
        s.status = bad >= 0 ? -1 : -2;
        s.bad = bad;
        if (threadIdx.x == 0) stats[row] = s;
        return;
    }
    const double zmax = (double)m / temperature;
    const int topk = top_k > 0 && top_k < V;
    const uint32_t *CK = ckey + row * C * K;
    const int64_t *CI = cidx + row * C * K;
    long long nc = 0, theta = -1;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const int64_t nch = V - c * len < len ? V - c * len : len;
        nc += P[c].count;
        if (P[c].count > 0 && nch > P[c].count) {
            long long last = (long long)CK[c * K + P[c].count - 1];
            theta = last > theta ? last : theta;
        }
    }
    nc = hs_block_reduce(nc, red, hs_op_sum());
    theta = hs_block_reduce(theta, red, hs_op_max());
    for (int64_t e = threadIdx.x; e < C * K; e += blockDim.x) {
        const int64_t c = e / K, j = e % K;
        if (j >= P[c].count) continue;
        const int64_t rk = hs_merge_rank(CK, CI, P, C, K, c, j);
        if (rk < HS_SORT_MAX) {
            sk[rk] = CK[e];
            sid[rk] = CI[e];
            sw[rk] = hs_exp_nonpos_f64((double)hs_unkey32(CK[e]) / temperature - zmax);
        }
    }
    __syncthreads();
    const long long placed = nc < HS_SORT_MAX ? nc : HS_SORT_MAX;
    int ok = 1, complete;
    long long L; /* positions [0, L): survivors, best first */
    double W = 0.0;
    if (topk) { /* the host made K = top_k */
        const uint32_t kth = sk[top_k - 1];
        long long ns = 0;
        for (long long p = threadIdx.x; p < placed; p += blockDim.x) ns += sk[p] >= kth;
        ns = hs_block_reduce(ns, red, hs_op_sum());
        if (theta >= (long long)kth || (ns == placed && nc > placed)) ok = 0;
        L = ns;
        complete = 1;
        for (long long p = threadIdx.x; p < L; p += blockDim.x) W += sw[p];
        s.kshift = 0;
        s.kpfx = kth;
    } else {
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            if (P[c].m != -HS_INF) W += P[c].s * exp((double)P[c].m / temperature - zmax);
        L = placed;
        complete = theta < 0 && nc <= HS_SORT_MAX;
    }
    W = hs_block_reduce(W, (double *)red, hs_op_sum());
    double R = W;
    if (ok && top_p < 1.0) {
        long long pos = 0x7fffffffffffffffll;
        double before = 0.0;
        for (long long t0 = 0; t0 < L; t0 += blockDim.x) {
            const long long p = t0 + threadIdx.x;
            const double v = p < L ? sw[p] : 0.0;
            double tot;
            const double ex = hs_block_exscan(v, (double *)red, &tot);
            const double incl = before + ex + v;
            long long hit = p < L && incl / W >= top_p ? p : 0x7fffffffffffffffll;
            hit = hs_block_reduce(hit, red, hs_op_min());
            if (hit != 0x7fffffffffffffffll) {
                if (p == hit) shd[0] = incl;
                __syncthreads();
                pos = hit;
                break;
            }
            before += tot;
        }
        if (pos != 0x7fffffffffffffffll) {
            /* The scan summed weights and divided once; the CPU (docs/ops.md "Warp") adds w / W token by token,
             * best first.  The two differ in the last bits, and where the crossing's key is shared by many
             * tokens (equal weights: integer or flat rows, bf16 ties) the cut can fall exactly on top_p in real
             * arithmetic, so those bits move it by a token.  Redo the crossing in the CPU's order from the start
             * of the crossing key's run (a run earlier if the mass before it already reaches top_p). */
            long long g0 = pos;
            while (g0 > 0 && sk[g0 - 1] == sk[pos]) g0--;
            double A;
            for (;;) {
                double a = 0.0;
                for (long long p = threadIdx.x; p < g0; p += blockDim.x) a += sw[p];
                A = hs_block_reduce(a, (double *)red, hs_op_sum());
                if (g0 == 0 || A / W < top_p) break;
                const uint32_t run = sk[g0 - 1];
                while (g0 > 0 && sk[g0 - 1] == run) g0--;
            }
            if (threadIdx.x == 0) {
                double c = A / W, r = A;
                long long q = g0;
                while (q < L && c < top_p) {
                    c += sw[q] / W;
                    r += sw[q];
                    q++;
                }
                shd[0] = r;
                shd[1] = c >= top_p ? (double)(q - 1) : -1.0; /* -1: the sums fell short of top_p */
            }
            __syncthreads();
            pos = (long long)shd[1];
            if (pos < 0) {
                if (!complete) ok = 0; /* else rounding left the total short of top_p: every survivor is kept */
            } else if (!topk && theta >= 0 && (long long)sk[pos] <= theta) ok = 0;
            else {
                s.pmode = 1;
                s.pkey = sk[pos];
                s.ptie = sid[pos];
                R = shd[0];
            }
        } else if (!complete) {
            ok = 0;
        } /* else rounding left the total short of top_p: every survivor is kept */
    }
    if (!ok) {
        __syncthreads();
        hs_warp_stats_row<DT>(logits, row, V, temperature, top_k, top_p, sm, stats);
        return;
    }
    s.R = R;
    s.status = 0;
    if (threadIdx.x == 0) stats[row] = s;
}

/* Where a request's walk ended, for the residual draw. */
struct hs_walk_rec {
    long long ok, cur, nrej, draw, len;
};

/* The residual draw's first half: the residual mass of each chunk of the row the walk ended at (rejected
 * tokens removed) and its last token with mass.  Grid: batch * C blocks. */
template <int DT>
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_resid_chunks(const void *logits, int64_t T, int64_t V, int64_t len, int64_t C,
                                                              double temperature, const hs_warp_stats *stats,
                                                              const hs_walk_rec *rec, const int64_t *rejg, double *rmass,
                                                              long long *rlast) {
    long long *red = (long long *)hs_smem();
    int64_t *rej = (int64_t *)(red + blockDim.x);
    const int64_t rc = blockIdx.x, b = rc / C, c = rc % C;
    const hs_walk_rec r = rec[b];
    if (!r.ok) return;
    for (int64_t q = threadIdx.x; q < r.nrej; q += blockDim.x) rej[q] = rejg[b * T + q];
    __syncthreads();
    const int64_t row = b * T + r.cur, c0 = c * len, c1 = V - c0 < len ? V : c0 + len;
    const hs_warp_stats s = stats[row];
    const double zmax = (double)s.m / temperature;
    double local = 0.0;
    long long last = -1;
    for (int64_t v = c0 + threadIdx.x; v < c1; v += blockDim.x) {
        double w = hs_warp_w(s, hs_ld<DT>(logits, row * V + v), v, temperature, zmax);
        for (int64_t q = 0; q < r.nrej && w > 0.0; q++) w = rej[q] == v ? 0.0 : w;
        if (w > 0.0) last = v;
        local += w;
    }
    local = hs_block_reduce(local, (double *)red, hs_op_sum());
    last = hs_block_reduce(last, red, hs_op_max());
    if (threadIdx.x == 0) {
        rmass[rc] = local;
        rlast[rc] = last;
    }
}

/* The residual draw's second half, one block per request: u * S (S the chunks' masses in chunk order) falls in
 * one chunk; the inverse CDF in id order inside it gives the token.  Writes the request's outputs and
 * advances its offset. */
template <int DT>
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_resid_pick(const void *logits, int64_t T, int64_t V, int64_t len, int64_t C,
                                                            double temperature, const hs_warp_stats *stats,
                                                            const hs_walk_rec *rec, const int64_t *rejg, const double *rmass,
                                                            const long long *rlast, const uint64_t *seeds_dev, uint64_t seed0,
                                                            uint64_t *offsets_dev, uint64_t offset0, int advance,
                                                            int64_t *out_len, int64_t *out_next, int64_t *out_draws,
                                                            hs_cuda_error *err) {
    long long *red = (long long *)hs_smem();
    int64_t *rej = (int64_t *)(red + blockDim.x);
    const long long NONE = 0x7fffffffffffffffll;
    const int64_t b = blockIdx.x;
    const hs_walk_rec r = rec[b];
    if (!r.ok) { /* a failed walk (its error is in *err): safe values, as hs_k_greedy_walk leaves them */
        if (threadIdx.x == 0) {
            out_len[b] = 1;
            out_next[b] = 0;
            out_draws[b] = 0;
        }
        return;
    }
    const uint64_t seed = seeds_dev ? seeds_dev[b] : seed0, offset = offsets_dev ? offsets_dev[b] : offset0;
    for (int64_t q = threadIdx.x; q < r.nrej; q += blockDim.x) rej[q] = rejg[b * T + q];
    const double *M = rmass + b * C;
    /* S, and the first chunk whose cumulative mass passes u * S */
    double S = 0.0;
    long long lastall = -1;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        S += M[c];
        lastall = rlast[b * C + c] > lastall ? rlast[b * C + c] : lastall;
    }
    S = hs_block_reduce(S, (double *)red, hs_op_sum());
    lastall = hs_block_reduce(lastall, red, hs_op_max());
    const double u = hs_philox_u(seed, offset, (uint64_t)r.draw), target = u * S;
    long long pick = NONE;
    if (S > 0.0) {
        long long cstar = NONE;
        double before = 0.0, at = 0.0;
        for (int64_t t0 = 0; t0 < C; t0 += blockDim.x) {
            const int64_t c = t0 + threadIdx.x;
            const double v = c < C ? M[c] : 0.0;
            double tot;
            const double ex = hs_block_exscan(v, (double *)red, &tot);
            long long hit = c < C && v > 0.0 && before + ex + v > target ? c : NONE;
            hit = hs_block_reduce(hit, red, hs_op_min());
            if (hit != NONE) {
                if (c == hit) ((double *)(rej + T))[0] = before + ex;
                __syncthreads();
                cstar = hit;
                at = ((double *)(rej + T))[0];
                break;
            }
            before += tot;
        }
        if (cstar == NONE) pick = lastall; /* rounding: the sums fell short of u * S */
        else {
            const int64_t row = b * T + r.cur, c0 = cstar * len, c1 = V - c0 < len ? V : c0 + len;
            const hs_warp_stats s = stats[row];
            const double zmax = (double)s.m / temperature;
            for (int64_t t0 = c0; t0 < c1 && pick == NONE; t0 += blockDim.x) {
                const int64_t v = t0 + threadIdx.x;
                double w = 0.0;
                if (v < c1) {
                    w = hs_warp_w(s, hs_ld<DT>(logits, row * V + v), v, temperature, zmax);
                    for (int64_t q = 0; q < r.nrej && w > 0.0; q++) w = rej[q] == v ? 0.0 : w;
                }
                double tot;
                const double ex = hs_block_exscan(w, (double *)red, &tot);
                long long hit = v < c1 && w > 0.0 && at + ex + w > target ? v : NONE;
                pick = hs_block_reduce(hit, red, hs_op_min());
                at += tot;
            }
            if (pick == NONE) pick = rlast[b * C + cstar];
        }
    }
    if (threadIdx.x != 0) return;
    long long next;
    if (S > 0.0) next = pick;
    else if (r.nrej > 0) next = rej[r.nrej - 1];
    else {
        hs_report(err, HS_CE_NO_MASS, r.cur);
        return;
    }
    out_next[b] = next;
    out_len[b] = r.len;
    out_draws[b] = r.draw + 1;
    if (advance && offsets_dev) offsets_dev[b] = offset + (uint64_t)r.draw + 1;
}


/* One block per request walks its tree drawing the CPU's Philox uniforms (thread 0: the children of the
 * current node in index order, one uniform each) and records where it ended for the residual draw. */
template <int DT>
__global__ void HS_BOUNDS(HS_TREE_THREADS) hs_k_sample_walk(const void *tt, int tdt, const void *tp, int pdt, int64_t T,
                                                           const int64_t *n_dev, const void *logits, int64_t V,
                                                           double temperature, const hs_warp_stats *stats,
                                                           const uint64_t *seeds_dev, uint64_t seed0,
                                                           const uint64_t *offsets_dev, uint64_t offset0,
                                                           int64_t *out_path, hs_walk_rec *rec, int64_t *rejg,
                                                           hs_cuda_error *err) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    long long *sh = red + blockDim.x; /* [0] state, [1] cur, [2] draws, [3] nrej, [4] len */
    int64_t *tok = (int64_t *)(sh + 8);
    int64_t *rej = tok + T;
    int *par = (int *)(rej + T);
    int *flag = par + T;
    const int64_t b = blockIdx.x, nb = n_dev ? n_dev[b] : T;
    const uint64_t seed = seeds_dev ? seeds_dev[b] : seed0, offset = offsets_dev ? offsets_dev[b] : offset0;
    if (threadIdx.x == 0) rec[b].ok = 0; /* until the walk ends well */
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
    const long long nrej = sh[3];
    for (int64_t q = threadIdx.x; q < nrej; q += blockDim.x) rejg[b * T + q] = rej[q];
    if (threadIdx.x == 0) {
        hs_walk_rec r;
        r.ok = 1;
        r.cur = sh[1];
        r.nrej = nrej;
        r.draw = sh[2];
        r.len = sh[4];
        rec[b] = r;
    }
}

/* Workspace of the split verify_sample, in order: stats [rows], partials [rows * C], candidate keys and ids
 * [rows * C * HS_CAND_MAX], walk records [batch], rejected tokens [batch * T], residual masses and last
 * tokens [batch * C2] (rows = batch * T). */
struct hs_sample_ws {
    hs_warp_stats *stats;
    hs_part *parts;
    uint32_t *ckey;
    int64_t *cidx;
    hs_walk_rec *rec;
    int64_t *rejg;
    double *rmass;
    long long *rlast;
    int64_t len, C, len2, C2;
    size_t bytes;
};

static hs_sample_ws hs_sample_layout(void *ws, int64_t batch, int64_t T, int64_t V) {
    hs_sample_ws w;
    const int64_t rows = batch * T > 0 ? batch * T : 1, nb = batch > 0 ? batch : 1;
    w.len = hs_chunk_len(rows, V);
    w.C = hs_nchunks(V, w.len);
    w.len2 = hs_chunk_len(nb, V);
    w.C2 = hs_nchunks(V, w.len2);
    char *p = (char *)ws;
    size_t off = 0;
#define HS_TAKE(field, type, count)                                                                                  \
    w.field = (type *)(p ? p + off : nullptr);                                                                        \
    off += hs_al16((size_t)(count) * sizeof(type));
    HS_TAKE(stats, hs_warp_stats, rows)
    HS_TAKE(parts, hs_part, rows * w.C)
    HS_TAKE(ckey, uint32_t, rows * w.C * HS_CAND_MAX)
    HS_TAKE(cidx, int64_t, rows * w.C * HS_CAND_MAX)
    HS_TAKE(rec, hs_walk_rec, nb)
    HS_TAKE(rejg, int64_t, nb * (T > 0 ? T : 1))
    HS_TAKE(rmass, double, nb * w.C2)
    HS_TAKE(rlast, long long, nb * w.C2)
#undef HS_TAKE
    w.bytes = off;
    return w;
}

extern "C" size_t hs_cuda_verify_sample_workspace_bytes(int64_t batch, int64_t T, int64_t V) {
    return hs_sample_layout(nullptr, batch, T, V).bytes;
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
    hs_status chk = hs_verify_sizes(op, T, ws_bytes, hs_cuda_verify_sample_workspace_bytes(batch, T, V), herr);
    if (chk != HS_OK) return chk;
    if (batch == 0 || T == 0) return HS_OK;
    const hs_sample_ws w = hs_sample_layout(ws, batch, T, V);
    const int64_t rows = batch * T;
    if (rows * w.C > 0x7fffffffll || batch * w.C2 > 0x7fffffffll)
        return hs_fail(herr, HS_ERR_VALUE, op, "tree_tokens", "expected at most 2^31 - 1 (node, chunk) blocks, got %lld",
                       (long long)(rows * w.C));
    const int topk = sp.top_k > 0 && sp.top_k < V;
    const int split = !topk || sp.top_k <= HS_CAND_MAX;
    const int K = topk ? (int)sp.top_k : (sp.top_p < 1.0 ? HS_TOPP_CAND : 0);
    const unsigned th = HS_ROW_THREADS, tc = HS_CHUNK_THREADS;
    const size_t sm_stats = hs_row_smem(th) + 260 * sizeof(double);
    const size_t sm_merge = hs_al16(th * sizeof(long long) + HS_RADIX_SMEM + 260 * sizeof(double)) +
                            (size_t)HS_SORT_MAX * (8 + 8 + 4) + 16;
    const size_t sm_walk = HS_TREE_THREADS * sizeof(long long) + 8 * 8 + (size_t)T * 16 + (size_t)(T + 1) * sizeof(int);
    const size_t sm_resid = tc * sizeof(long long) + (size_t)T * 8 + 16;
    int rc = 0;
#define HS_SAMPLE_LAUNCH(DT)                                                                                          \
    if (split) {                                                                                                      \
        rc = HS_LAUNCH((hs_k_chunks<DT, 1>), rows * w.C, tc, hs_chunk_smem(tc, K), stream, logits, V, w.len, w.C, T,  \
                       n_dev, K, !topk, sp.temperature, w.parts, w.ckey, w.cidx);                                     \
        if (!rc)                                                                                                      \
            rc = HS_LAUNCH(hs_k_sample_merge<DT>, rows, th, sm_merge, stream, logits, T, V, n_dev, sp.temperature,    \
                           sp.top_k, sp.top_p, w.len, w.C, K, (const hs_part *)w.parts, (const uint32_t *)w.ckey,     \
                           (const int64_t *)w.cidx, w.stats);                                                          \
    } else {                                                                                                          \
        rc = HS_LAUNCH(hs_k_warp_stats<DT>, rows, th, sm_stats, stream, logits, T, V, n_dev, sp.temperature,          \
                       sp.top_k, sp.top_p, w.stats);                                                                  \
    }                                                                                                                 \
    if (!rc)                                                                                                          \
        rc = HS_LAUNCH(hs_k_sample_walk<DT>, batch, HS_TREE_THREADS, sm_walk, stream, tree_tokens, (int)token_dtype,  \
                       tree_parents, (int)parent_dtype, T, n_dev, logits, V, sp.temperature,                          \
                       (const hs_warp_stats *)w.stats, seeds_dev, seed, (const uint64_t *)offsets_dev, offset,        \
                       out_path, w.rec, w.rejg, err);                                                                 \
    if (!rc)                                                                                                          \
        rc = HS_LAUNCH(hs_k_resid_chunks<DT>, batch * w.C2, tc, sm_resid, stream, logits, T, V, w.len2, w.C2,         \
                       sp.temperature, (const hs_warp_stats *)w.stats, (const hs_walk_rec *)w.rec,                    \
                       (const int64_t *)w.rejg, w.rmass, w.rlast);                                                    \
    if (!rc)                                                                                                          \
        rc = HS_LAUNCH(hs_k_resid_pick<DT>, batch, tc, sm_resid, stream, logits, T, V, w.len2, w.C2, sp.temperature,  \
                       (const hs_warp_stats *)w.stats, (const hs_walk_rec *)w.rec, (const int64_t *)w.rejg,           \
                       (const double *)w.rmass, (const long long *)w.rlast, seeds_dev, seed, offsets_dev, offset,     \
                       advance_offsets, out_len, out_next, out_draws, err);
    switch (logit_dtype) {
    case HS_FLOAT32: HS_SAMPLE_LAUNCH(HS_FLOAT32) break;
    case HS_FLOAT16: HS_SAMPLE_LAUNCH(HS_FLOAT16) break;
    case HS_BFLOAT16: HS_SAMPLE_LAUNCH(HS_BFLOAT16) break;
    default: return hs_fail(herr, HS_ERR_DTYPE, op, "target_logits", "expected float16, bfloat16 or float32, got %s", hs_dtype_name(logit_dtype));
    }
#undef HS_SAMPLE_LAUNCH
    return hs_launched(rc, op, herr);
}

/* ---- kv_compact ------------------------------------------------------------------------------------------ */

#define HS_KV_THREADS 128
#define HS_KV_NONE 0x7fffffffffffffffll

struct hs_kv_batch {
    hs_kv_tensor t[HS_CUDA_KV_MAX_TENSORS];
    int64_t first_block[HS_CUDA_KV_MAX_TENSORS + 1];
    int count;
};

/* One request's slot list: its first -1 (*mv: the valid count) and the first violation as a key (HS_KV_NONE if
 * none): -1 a negative prefix, i a non-(-1) entry after the padding began, m + i an invalid entry i < mv.  In
 * parallel over the entries (two block reductions); every thread gets the results. */
__device__ long long hs_kv_row_check(const void *slots, int sdt, int64_t base, int64_t m, int64_t prefix, int64_t min_S,
                                     long long *red, int64_t *mv_out) {
    const int64_t t0 = threadIdx.x, step = blockDim.x;
    long long first = HS_KV_NONE; /* the first -1: this thread's first hit is its lowest */
    for (int64_t i = t0; i < m; i += step)
        if (hs_ld_id(slots, sdt, base + i) == -1) {
            first = i;
            break;
        }
    first = hs_block_reduce(first, red, hs_op_min());
    const int64_t mv = first == HS_KV_NONE ? m : first;
    long long bad = prefix < 0 ? -1 : HS_KV_NONE;
    if (prefix >= 0) {
        const int64_t lim = min_S - prefix; /* prefix + s < min_S <=> s < lim, without overflow */
        for (int64_t i = t0; i < m; i += step) {
            const int64_t s = hs_ld_id(slots, sdt, base + i);
            long long key = HS_KV_NONE;
            if (i > mv) key = s != -1 ? i : HS_KV_NONE;
            else if (i < mv && (s < i || (i > 0 && s <= hs_ld_id(slots, sdt, base + i - 1)) || s >= lim)) key = m + i;
            bad = key < bad ? key : bad;
        }
    }
    *mv_out = mv;
    return hs_block_reduce(bad, red, hs_op_min());
}

/* Blocks [0, first_block[count]) move the rows of one (tensor, leading index) each; a launch for no rows has one
 * block that only checks.  Every block first checks the prefixes and slots of every request (in order, in
 * parallel over the entries), so a bad call moves nothing anywhere; block 0 records the error the CPU core
 * would raise (the first failing request; in it the first -1 entry ends the list; a non-(-1) entry after it
 * first, then the valid entries in order).  Each tensor is [batch * inner', S, row]: leading index h belongs
 * to request h / inner'. */
__global__ void HS_BOUNDS(HS_KV_THREADS) hs_k_kv_compact(hs_kv_batch kb, int64_t batch, const int64_t *prefix_dev,
                                                         int64_t prefix_host, const void *slots, int sdt, int64_t m,
                                                         int64_t min_S, hs_cuda_error *err) {
    long long *red = (long long *)hs_smem();
    for (int64_t rb = 0; rb < batch; rb++) {
        const int64_t prefix = prefix_dev ? prefix_dev[rb] : prefix_host; /* read when the kernel runs (graph replays) */
        int64_t mv;
        const long long bad = hs_kv_row_check(slots, sdt, rb * m, m, prefix, min_S, red, &mv);
        if (bad == HS_KV_NONE) continue;
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            const int64_t base = rb * m;
            if (bad < 0) {
                hs_report(err, HS_CE_PREFIX_NEG, prefix);
            } else if (bad < m) {
                hs_report(err, HS_CE_SLOT_PAD, hs_ld_id(slots, sdt, base + bad), bad, mv);
            } else {
                const int64_t i = bad - m, s = hs_ld_id(slots, sdt, base + i);
                if (s < i) hs_report(err, HS_CE_SLOT_LT_I, i, s);
                else if (i > 0 && s <= hs_ld_id(slots, sdt, base + i - 1)) hs_report(err, HS_CE_SLOT_ORDER, s, i, hs_ld_id(slots, sdt, base + i - 1));
                else hs_report(err, HS_CE_SLOT_RANGE, prefix, s, i, min_S);
            }
        }
        return;
    }
    if ((int64_t)blockIdx.x >= kb.first_block[kb.count]) return; /* a check-only block */
    int ti = 0;
    while (ti + 1 < kb.count && (int64_t)blockIdx.x >= kb.first_block[ti + 1]) ti++;
    const hs_kv_tensor t = kb.t[ti];
    const int64_t h = blockIdx.x - kb.first_block[ti], rb = h / (t.inner / batch), base = rb * m;
    const int64_t prefix = prefix_dev ? prefix_dev[rb] : prefix_host;
    int64_t mv;
    (void)hs_kv_row_check(slots, sdt, base, m, prefix, min_S, red, &mv); /* this block's request's count */
    char *seq = (char *)t.data + (size_t)h * (size_t)t.S * (size_t)t.row_bytes;
    /* each thread moves the same byte range of every row, in row order: the in-place order of the CPU */
    const int wide = ((uintptr_t)t.data % 16 == 0) && (t.row_bytes % 16 == 0);
    for (int64_t i = 0; i < mv; i++) {
        int64_t s = hs_ld_id(slots, sdt, base + i);
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

extern "C" hs_status hs_cuda_kv_compact(const hs_kv_tensor *tensors, int64_t count, int64_t batch,
                                        const int64_t *prefix_dev, int64_t prefix_len, const void *slots,
                                        hs_dtype slot_dtype, int64_t m, hs_cuda_error *err, void *stream, hs_error *herr) {
    static const char op[] = "kv_compact";
    if (batch < 1)
        return hs_fail(herr, HS_ERR_VALUE, op, "slots", "expected at least one request, got batch %lld", (long long)batch);
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
        if (tensors[i].inner % batch != 0)
            return hs_fail(herr, HS_ERR_VALUE, op, "tensors", "expected leading rows in whole requests (a multiple of "
                           "batch = %lld), got %lld", (long long)batch, (long long)tensors[i].inner);
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
                           stream, kb, batch, prefix_dev, prefix_len, slots, (int)slot_dtype, m, min_S, err);
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
