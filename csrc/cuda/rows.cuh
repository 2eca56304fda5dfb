/*
 * rows.cuh -- what the vocabulary-wide row kernels share (topk_entropy and bucketize in entropy.cu, expand in
 * tree.cu, verify_greedy and verify_sample in verify.cu): the scan of a logits row (max and first bad entry),
 * and the split-row machinery.
 *
 * Split rows.  One block per row leaves most of a GPU idle when a call has few rows (a level expand: 10 rows;
 * a verify: 60 rows on 132 SMs) and makes each block walk a whole 128k-entry row several times.  The row
 * kernels cut every row into chunks (hs_chunk_len: enough blocks to fill the device, at most HS_MAX_CHUNKS per
 * row), one block per (row, chunk), each writing a partial (its max, first bad entry, a sum of exponentials
 * relative to its own max) and its K best entries; a merge kernel per row then works on C partials and C*K
 * candidates instead of V entries.  The row's top-K is exactly the top-K of the union of the chunks' top-K
 * (an entry beaten by fewer than K entries of the row is beaten by fewer than K of its chunk).
 *
 * A chunk's top-K avoids the radix histogram, whose first passes send most entries to a few bins (the
 * exponent byte of the logits) and so serialise on shared-memory atomics: the K-th largest of the threads'
 * own maxima is a lower bound for the chunk's K-th largest entry (they are K distinct entries), so only the
 * entries at or above it (a few times K for real logits) are appended to a shared list and ranked there.  A
 * list that overflows (many equal values) falls back to the radix select.
 *
 * The chunk kernel (hs_k_chunks) and its launchers are in rows.cu; the merges are the ops' own kernels,
 * built from hs_merge_max and hs_merge_rank below.  Device functions are defined here (inline or templates):
 * without relocatable device code a kernel can only call device code of its own translation unit.
 */
#ifndef HS_CUDA_ROWS_CUH
#define HS_CUDA_ROWS_CUH

#include "common.cuh"

#ifdef HS_CUDA_EMU
#define HS_CHUNK_MIN 256     /* small chunks, so that the tests' rows of a few thousand entries are split */
#else
#define HS_CHUNK_MIN 1024
#endif
/* four blocks per SM of an H100 (132 SMs); the emulation uses the same target, so that its rows are split as
 * a GPU's are (with a target of 1 block, rows * V / 1 >= V kept every row in one chunk and the merge paths
 * were never run off a GPU: tests/ops/test_device.py checks hs_cuda_chunks) */
#define HS_TARGET_BLOCKS 528
/* ... which the kernels launched on rows * chunks blocks are compiled to allow: at most 64 registers a thread.
 * Without the bound, the block reductions' warp exchanges took hs_k_chunks<bf16, 1> to 72 registers: 3 blocks an
 * SM, and 480 blocks in two waves. */
#define HS_CHUNK_BOUNDS HS_BOUNDS_MIN(HS_CHUNK_THREADS, 4)
#define HS_MAX_CHUNKS 32
#define HS_CAND_MAX 256   /* the largest K the split path takes (expand k, verify_sample top_k) */
#define HS_TOPP_CAND 128  /* candidates per chunk for a top-p cut without top-k */
#define HS_FILTER_CAP 2048
#define HS_SORT_MAX 1536  /* sorted candidates a verify_sample merge keeps (its shared memory stays under 48 KB) */
#define HS_CHUNK_THREADS HS_TREE_THREADS

/* Entries per chunk for `rows` rows of V: HS_TARGET_BLOCKS / rows chunks a row, rounded down (at least 1, at
 * most HS_MAX_CHUNKS), so that rows * chunks never passes HS_TARGET_BLOCKS when rows <= HS_TARGET_BLOCKS; at
 * least hs_chunk_min() entries (HS_CHUNK_MIN).  Rounding up instead (chunks of ceil(rows * V /
 * HS_TARGET_BLOCKS) entries) gave the 60 rows of 128,256 nine chunks each: 540 blocks where an H200 holds 528 of
 * the 64-register kernels (hs_k_chunks<bf16, 1>, hs_k_wide_level: 4 blocks an SM), and the eighth window's Nsight
 * Compute counters show the second wave's 12 blocks: the SMs active 65 % of those launches' 86-95 us. */
int64_t hs_chunk_min(void); /* HS_CHUNK_MIN unless hs_cuda_set_chunk_min changed it (rows.cu) */
static inline int64_t hs_chunk_len(int64_t rows, int64_t V) {
    if (V < 1) return 1;
    int64_t C = rows > 0 ? HS_TARGET_BLOCKS / rows : 1;
    C = C < 1 ? 1 : C > HS_MAX_CHUNKS ? HS_MAX_CHUNKS : C;
    int64_t c = (V + C - 1) / C;
    const int64_t lo = hs_chunk_min();
    c = c < lo ? lo : c;
    return c > V ? V : c;
}
static inline int64_t hs_nchunks(int64_t V, int64_t len) { return V < 1 ? 1 : (V + len - 1) / len; }


/* What one (row, chunk) block leaves for the merge. */
struct hs_part {
    double s;      /* sum of exponentials relative to m (the op's form), when asked for */
    float m;       /* max over the entries that are neither NaN nor +inf (-inf if none) */
    int count;     /* candidates written: min(K, entries of the chunk), 0 for a bad chunk */
    long long bad; /* the chunk's lowest NaN/+inf entry of the row as col*2 + is_inf, or -1 */
};

/* A logits row's entries from `base` on, as float32 values or as keys: the loads of hs_strided / hs_batched. */
template <int DT> struct hs_logit_val {
    const void *p;
    int64_t base;
    __device__ __forceinline__ float operator()(int64_t i) const { return hs_ld<DT>(p, base + i); }
};
template <int DT> struct hs_logit_key {
    const void *p;
    int64_t base;
    __device__ __forceinline__ uint32_t operator()(int64_t i) const { return hs_key32(hs_ld<DT>(p, base + i)); }
};

/* ---- row scan: max and the first bad entry ------------------------------------------------------------ */

/* Block-wide max of a logits row and the lowest column holding NaN/+Inf (as col*2 + is_inf, or -1). */
template <int DT>
__device__ void hs_row_max_check(const void *p, int64_t base, int64_t V, long long *red, float *m_out,
                                 long long *bad_out) {
    float m = -HS_INF;
    long long bad = 0x7fffffffffffffffll;
    hs_strided(0, V, hs_logit_val<DT>{p, base}, [&](int64_t i, float x) {
        if (x != x || x == HS_INF) {
            long long c = (long long)i * 2 + (x == HS_INF);
            bad = c < bad ? c : bad;
        } else if (x > m) {
            m = x;
        }
    });
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

/* ---- merging a row's chunks ------------------------------------------------------------------------------ */

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

/* A merge's view of its row's candidates: every chunk's count, and the keys and ids of its sorted lists (K slots
 * a chunk).  hs_merge_stage copies the counts into shared memory, and the keys and ids too when there are at
 * most `limit` slots, else the keys alone when there are at most `key_limit` (the ids, read only where two keys
 * are equal, stay in global memory); the binary searches of hs_merge_rank (C - 1 of them per candidate, each a
 * chain of dependent loads) then read shared memory instead of global memory.  `at`: 16-byte aligned shared
 * memory of hs_merge_stage_smem(C, K, limit, key_limit) bytes. */
struct hs_cands {
    const uint32_t *key;
    const int64_t *id;
    const int *count;
};
__host__ __device__ static inline size_t hs_merge_stage_smem(int64_t C, int64_t K, int64_t limit, int64_t key_limit = 0) {
    return hs_al16((size_t)C * sizeof(int)) + (C * K <= limit       ? hs_al16((size_t)(C * K) * 4) + (size_t)(C * K) * 8
                                               : C * K <= key_limit ? hs_al16((size_t)(C * K) * 4)
                                                                    : 0);
}
__device__ __forceinline__ hs_cands hs_merge_stage(const uint32_t *CK, const int64_t *CI, const hs_part *P, int64_t C,
                                                   int64_t K, int64_t limit, char *at, int64_t key_limit = 0) {
    int *cnt = (int *)at;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) cnt[c] = P[c].count;
    hs_cands v = {CK, CI, cnt};
    if (C * K <= limit) {
        uint32_t *key = (uint32_t *)(at + hs_al16((size_t)C * sizeof(int)));
        int64_t *id = (int64_t *)((char *)key + hs_al16((size_t)(C * K) * 4));
        for (int64_t e = threadIdx.x; e < C * K; e += blockDim.x)
            if (e % K < P[e / K].count) { /* the slots past a chunk's count are never read */
                key[e] = CK[e];
                id[e] = CI[e];
            }
        v.key = key;
        v.id = id;
    } else if (C * K <= key_limit) {
        uint32_t *key = (uint32_t *)(at + hs_al16((size_t)C * sizeof(int)));
        for (int64_t e = threadIdx.x; e < C * K; e += blockDim.x)
            if (e % K < P[e / K].count) key[e] = CK[e];
        v.key = key;
    }
    __syncthreads();
    return v;
}
/* Candidates the entropy and expand merges stage (12 bytes each: 24 KB); the sample merge stages its counts only
 * (its sorted copy already fills its shared memory). */
#define HS_MERGE_STAGE_MAX 2048

/* Rank of candidate (key, id) among all chunks' sorted lists: entries before it in its own list (j) plus, in
 * every other list, the prefix that beats it (key desc, id asc), found by binary search. */
__device__ __forceinline__ int64_t hs_merge_rank(const hs_cands &v, int64_t C, int K, int64_t c, int64_t j) {
    const uint32_t *CK = v.key;
    const int64_t *CI = v.id;
    const uint32_t key = CK[c * K + j];
    const int64_t id = CI[c * K + j];
    int64_t r = j;
    for (int64_t o = 0; o < C; o++) {
        if (o == c) continue;
        const uint32_t *ok = CK + o * K;
        const int64_t *oi = CI + o * K;
        int lo = 0, hi = v.count[o];
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (ok[mid] > key || (ok[mid] == key && oi[mid] < id)) lo = mid + 1;
            else hi = mid;
        }
        r += lo;
    }
    return r;
}

/* A row's candidates sorted best first (key desc, id asc) in shared memory, for the entropy and expand merges when
 * C * K <= HS_MERGE_STAGE_MAX: chunk c's list goes to slots [c*K, c*K + count), the other slots of the next power
 * of two n2 >= C * K get key 0 (below every logit's key: -inf's is 0x007fffff) and the largest id, and a bitonic
 * sort over the block orders them.  Sorted position r is then the candidate's rank in the row.  It replaces
 * hs_merge_rank there, whose C - 1 binary searches per candidate made a merge quadratic in the chunks: the fifth
 * GPU window timed hs_k_expand_merge for 10 rows at 11.2 us with 1 chunk a row, 18.1 with 16 and 39.0 with 32
 * (C * k * (C - 1) searches: 2,400 and 9,920).  The sort is common.cuh's hs_block_bitonic: 45 passes for
 * C * K = 320, 30 of them ending with a warp's wait instead of the block's.  `at`: 16-byte aligned shared memory
 * of hs_merge_sort_smem(C, K) bytes.  Every thread calls it; the result is visible to all. */
__host__ __device__ static inline int64_t hs_pow2_at_least(int64_t n) {
    int64_t p = 1;
    while (p < n) p <<= 1;
    return p;
}
__host__ __device__ static inline size_t hs_merge_sort_smem(int64_t C, int64_t K) {
    const int64_t n2 = hs_pow2_at_least(C * K);
    return hs_al16((size_t)n2 * 4) + (size_t)n2 * 8;
}
/* Whether the entropy and expand merges sort a row's C * K candidates (else they rank them), and their shared
 * memory for it: one rule for the kernels and their launchers. */
__host__ __device__ static inline int hs_merge_sorts(int64_t C, int64_t K) { return C * K <= HS_MERGE_STAGE_MAX; }
__host__ __device__ static inline size_t hs_merge_smem(int64_t C, int64_t K) {
    return hs_merge_sorts(C, K) ? hs_merge_sort_smem(C, K) : hs_merge_stage_smem(C, K, 0);
}
struct hs_sorted {
    const uint32_t *key;
    const int64_t *id;
    int64_t n; /* real candidates: the sum of the chunks' counts */
};
__device__ __forceinline__ int hs_cand_before(uint32_t ka, int64_t ia, uint32_t kb, int64_t ib) {
    return ka > kb || (ka == kb && ia < ib);
}
__device__ __forceinline__ hs_sorted hs_merge_sort(const uint32_t *CK, const int64_t *CI, const hs_part *P, int64_t C,
                                                   int64_t K, char *at, long long *red) {
    const int64_t n2 = hs_pow2_at_least(C * K);
    uint32_t *key = (uint32_t *)at;
    int64_t *id = (int64_t *)(at + hs_al16((size_t)n2 * 4));
    long long n = 0;
    for (int64_t e = threadIdx.x; e < n2; e += blockDim.x) {
        const int real = e < C * K && e % K < P[e / K].count;
        key[e] = real ? CK[e] : 0u;
        id[e] = real ? CI[e] : (int64_t)0x7fffffffffffffffll;
        n += real;
    }
    n = hs_block_reduce(n, red, hs_op_sum()); /* ends with a barrier: the slots are written */
    /* slot a before slot b: key desc, id asc */
    hs_block_bitonic((int)n2, [&](int a, int b) { return hs_cand_before(key[a], id[a], key[b], id[b]); },
                     [&](int a, int b) {
                         const uint32_t k = key[a];
                         key[a] = key[b];
                         key[b] = k;
                         const int64_t t = id[a];
                         id[a] = id[b];
                         id[b] = t;
                     });
    hs_sorted s = {key, id, n};
    return s;
}

/* ---- launching the chunk kernel (rows.cu) ------------------------------------------------------------------ */

/* One launch of hs_k_chunks over rows * C blocks (chunks of `len` entries of rows of V): every chunk's partial
 * (with `sum`, the sum of exponentials: MODE 0, expand, exp(x - m) in float32; MODE 1, verify_sample,
 * exp(x/t - m/t) in float64) and its K best entries (keys ckey, ids cidx; K slots per chunk).  Rows i with
 * i % T >= n_dev[i / T] are skipped (a verify call's padding nodes; n_dev NULL: none). */
struct hs_chunk_job {
    const void *logits;
    hs_dtype dtype;
    int64_t rows, V, len, C, T;
    const int64_t *n_dev;
    int K, sum, mode;
    double temperature;
    hs_part *parts;
    uint32_t *ckey;
    int64_t *cidx;
};
/* HS_OK, a dtype error naming argument `arg` of `op`, or the failed launch. */
hs_status hs_launch_chunk_job(const hs_chunk_job &job, const char *op, const char *arg, void *stream, hs_error *herr);

/* The first half of a split topk_entropy / expand: partials and k-best lists for rows x C chunks carved out of
 * ws (hs_chunk_out_bytes of it), filled by one MODE 0 launch (the sums only with `sum`). */
struct hs_chunk_out {
    hs_part *parts;
    uint32_t *ck;
    int64_t *ci;
    int64_t C;
};
size_t hs_chunk_out_bytes(int64_t rows, int64_t V, int64_t k);
hs_status hs_launch_chunks(const char *op, const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
                           int sum, void *ws, hs_chunk_out *o, void *stream, hs_error *herr);

#endif /* HS_CUDA_ROWS_CUH */
