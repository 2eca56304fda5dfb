/*
 * rows.cu -- the chunk kernel of the split row kernels (see rows.cuh) and its launchers, shared by
 * topk_entropy (entropy.cu), expand (tree.cu) and verify_sample (verify.cu); and the launch-geometry
 * diagnostics of heterospec_cuda.h.
 */
#include <atomic>

#include "rows.cuh"

extern "C" int hs_cuda_max_threads(void) { return HS_ROW_THREADS; }

extern "C" int64_t hs_cuda_chunks(int64_t rows, int64_t V) { return hs_nchunks(V, hs_chunk_len(rows, V)); }

static std::atomic<int64_t> hs_chunk_min_len{HS_CHUNK_MIN};
int64_t hs_chunk_min(void) { return hs_chunk_min_len.load(std::memory_order_relaxed); }
extern "C" int64_t hs_cuda_set_chunk_min(int64_t n) { return hs_chunk_min_len.exchange(n >= 1 ? n : HS_CHUNK_MIN); }

/* The K best of n keys (key desc, index asc) into out_key / out_idx (index + idx0), best first.  tmax: this
 * thread's largest key over the entries it read with the same stride (0 if none).  Shared: red, scratch
 * (HS_RADIX_SMEM), tk (blockDim), fk/fi (HS_FILTER_CAP), cand/cval/rank (K) and an int (the filter's count).
 * Every thread calls it. */
template <class KeyFn>
__device__ int hs_chunk_topk(const KeyFn &key, int64_t n, int K, uint32_t tmax, int64_t idx0, long long *red, char *scratch,
                             uint32_t *tk, uint32_t *fk, int *fi, int64_t *cand, uint32_t *cval, int *rank, int *ints,
                             uint32_t *out_key, int64_t *out_idx) {
    const int want = n < K ? (int)n : K;
    if (want <= 0) return 0;
    uint32_t thr = 0; /* every entry passes when no bound is known */
    if (n > K && K <= (int)blockDim.x) {
        /* the K-th largest of the threads' maxima: at least K entries reach it.  The maxima sorted (largest
         * first) by the block's bitonic network: 36 passes of 128 compare-exchanges for 256 threads, where ranking
         * each maximum against all the others took 256 iterations a thread */
        tk[threadIdx.x] = tmax;
        __syncthreads();
        hs_block_bitonic((int)blockDim.x, [&](int a, int b) { return tk[a] > tk[b]; },
                         [&](int a, int b) {
                             const uint32_t t = tk[a];
                             tk[a] = tk[b];
                             tk[b] = t;
                         });
        thr = tk[K - 1];
    }
    if (threadIdx.x == 0) ints[0] = 0;
    __syncthreads();
    hs_strided(0, n, key, [&](int64_t i, uint32_t kk) {
        if (kk >= thr) {
            int p = atomicAdd(&ints[0], 1);
            if (p < HS_FILTER_CAP) {
                fk[p] = kk;
                fi[p] = (int)i;
            }
        }
    });
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
__global__ void HS_CHUNK_BOUNDS hs_k_chunks(const void *logits, int64_t V, int64_t len, int64_t C, int64_t T,
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
    const hs_logit_val<DT> ld{logits, base};
    hs_strided(0, n, ld, [&](int64_t i, float x) {
        if (x != x || x == HS_INF) {
            long long code = (long long)(c0 + i) * 2 + (x == HS_INF);
            bad = code < bad ? code : bad;
        } else {
            m = x > m ? x : m;
            uint32_t kk = hs_key32(x);
            tmax = kk > tmax ? kk : tmax;
        }
    });
    bad = hs_block_reduce(bad, red, hs_op_min());
    m = hs_block_reduce(m, (float *)red, hs_op_max());
    double s = 0.0;
    int count = 0;
    if (bad == 0x7fffffffffffffffll) {
        if (m != -HS_INF && sum) {
            const double zm = (double)m / temperature;
            hs_strided(0, n, ld, [&](int64_t, float x) {
                s += MODE == 0 ? (double)expf(x - m) : hs_exp_nonpos_f64((double)x / temperature - zm);
            });
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

hs_status hs_launch_chunk_job(const hs_chunk_job &j, const char *op, const char *arg, void *stream, hs_error *herr) {
    const unsigned tc = HS_CHUNK_THREADS;
    const size_t smc = hs_chunk_smem(tc, j.K);
    const int64_t blocks = j.rows * j.C;
    int rc = 0;
#define HS_CHUNK_ARGS j.logits, j.V, j.len, j.C, j.T, j.n_dev, j.K, j.sum, j.temperature, j.parts, j.ckey, j.cidx
    HS_LOGIT_SWITCH(j.dtype, op, arg, herr,
                    rc = j.mode == 0 ? HS_LAUNCH((hs_k_chunks<DT, 0>), blocks, tc, smc, stream, HS_CHUNK_ARGS)
                                     : HS_LAUNCH((hs_k_chunks<DT, 1>), blocks, tc, smc, stream, HS_CHUNK_ARGS))
#undef HS_CHUNK_ARGS
    return hs_launched(rc, op, herr);
}

size_t hs_chunk_out_bytes(int64_t rows, int64_t V, int64_t k) {
    const int64_t C = hs_nchunks(V, hs_chunk_len(rows, V));
    return hs_al16((size_t)(rows * C) * sizeof(hs_part)) + hs_al16((size_t)(rows * C * k) * 4) +
           hs_al16((size_t)(rows * C * k) * 8);
}

hs_status hs_launch_chunks(const char *op, const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
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
    hs_chunk_job job = {logits, dtype, rows, V, len, C, 1, nullptr, (int)k, sum, 0, 1.0, o->parts, o->ck, o->ci};
    return hs_launch_chunk_job(job, op, "logits", stream, herr);
}
