/*
 * verify.cu -- verify_greedy and verify_sample as CUDA kernels (semantics: docs/ops.md; CPU twins:
 * csrc/core/verify.c; Philox4x32-10, shared with the CPU core, is in csrc/core/hd_math.h).
 *
 *   verify_greedy  argmax of every (node row, chunk) in parallel, a fold of each row's chunks, then one block
 *                  per request follows the accepted children.
 *   verify_sample  chunks of every node row (max, kept mass, the best K for the top-k / top-p cuts; rows.cu),
 *                  one block per node row deciding its statistics from those candidates (or, when they cannot
 *                  decide, radix descents over the row's chunks: hs_k_wide_level), with min-p one block per node
 *                  row summing its kept mass again after that cut (hs_k_min_p), one block per request walking the
 *                  tree with the CPU's Philox uniforms, then the residual draw split the same way (chunk
 *                  masses, then one block per request finds the chunk and the token by inverse CDF).
 * Sums that the CPU does in a fixed sequential order are parallel here: floats agree to ~1e-7 relative,
 * and a sampled path can only differ when a uniform lands within ~1e-15 of a boundary.  The top-p cut is
 * the exception that needs care: at a run of equal logits it can fall exactly on top_p, so its crossing is
 * taken in the CPU's token-by-token order (hs_k_sample_merge, hs_k_wide_level).
 */
#include "rows.cuh"

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
__global__ void HS_CHUNK_BOUNDS hs_k_argmax_chunks(const void *logits, int64_t T, int64_t V, int64_t len, int64_t C,
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
    int rc = 0;
    HS_LOGIT_SWITCH(logit_dtype, op, "target_logits", herr,
                    rc = HS_LAUNCH(hs_k_argmax_chunks<DT>, rows * C, tc, tc * sizeof(long long), stream, logits, T, V,
                                   len, C, n_dev, pbest, pbad))
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
 * top-k (key >= kpfx at kshift), top-p (key > pkey, or key == pkey and v <= ptie) and min-p (w_v >= min_p), else 0.
 * min_p stays 0 until hs_k_min_p, which runs after every top-k / top-p cut is decided (min-p comes last). */
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
    double min_p;     /* 0: no min-p cut (the merge and the wide kernels leave it so) */
};

__device__ __forceinline__ double hs_warp_w(const hs_warp_stats &s, float x, int64_t v, double temperature,
                                            double zmax) {
    uint32_t key = hs_key32(x);
    if (s.kshift < 32 && (key >> s.kshift) < s.kpfx) return 0.0;
    if (s.pmode && (key < s.pkey || (key == s.pkey && v > s.ptie))) return 0.0;
    const double w = hs_exp_nonpos_f64((double)x / temperature - zmax);
    return w < s.min_p ? 0.0 : w;
}

/* A row's statistics before any cut, from its max m and first bad entry (col*2 + is_inf, or -1): 1 if the row
 * can be sampled; else the row's failure (status -1: a NaN/+inf entry, -2: all -inf) is stored in *out (thread 0)
 * and 0 returned. */
__device__ __forceinline__ int hs_warp_begin(hs_warp_stats *s, float m, long long bad, hs_warp_stats *out) {
    memset(s, 0, sizeof *s);
    s->kshift = 32;
    s->m = m;
    if (bad < 0 && m != -HS_INF) return 1;
    s->status = bad >= 0 ? -1 : -2;
    s->bad = bad;
    if (threadIdx.x == 0) *out = *s;
    return 0;
}

/* ---- the wide rows: statistics split across blocks when the candidates cannot decide a row -------------------
 * A row the merge cannot decide from its chunks' candidates (a nucleus wider than them, a top-k above
 * HS_CAND_MAX, ties at the k-th value across chunks) is finished by radix descents over its chunks: 8 bits of
 * the key per launch, most significant first, every (row, chunk) block adding its chunk's histogram (token
 * counts and, for top-p, kept masses) into the row's, and the last of the row's blocks to finish (a counter
 * per row, reset by that block) choosing the bin and the next prefix.  Phase 1 finds the top-k cut (the k-th
 * largest key, as hs_block_radix_select); phase 2 the top-p crossing over the survivors of top-k, the same
 * descent the CPU's best-first order defines, with the crossing key's tokens (equal weights) then taken one by
 * one in id order as the CPU adds them (how many here; which token, when only some are kept, in hs_k_wide_tie).
 * Four launches per phase and one of hs_k_wide_tie after the top-p phase, whatever the rows need (a row that is
 * not in a launch's phase returns at once), so the sequence is the same every call and a CUDA graph replays it.
 * The merge sets a wide row up: its counter and histograms zeroed (the workspace is shared with other ops),
 * its statistics begun (max, status), the phase to start from. */
struct hs_wide {
    int phase;        /* 0 decided, 1 top-k descent, 2 top-p descent, 3 the crossing key's tie_q-th token to find
                       * (need: tie_q; stats hold the row's cut but ptie; hs_k_wide_tie) */
    int level;        /* 0..3: bits 31..24, .., 7..0 */
    uint32_t pfx;     /* the key bits chosen so far */
    long long need;   /* phase 1: how many keys still to take from the bins at and below the current range */
    double above;     /* mass of the keys above the current range (phase 1: before cuts; phase 2: kept) */
    double W;         /* phase 2: the kept mass after top-k */
};
#define HS_WIDE_BINS 256
/* Copies of a block's histogram: thread t adds into copy t % HS_WIDE_COPIES, so the threads of a warp add into
 * 15 different copies (at most three threads each) instead of one.  A flat row falls into few of the 256 bins
 * at level 0 (randn * 3: about 20, a quarter of the row in one), and the float64 atomicAdd of shared memory is a
 * compare-and-swap loop: with one copy every thread of a warp that lands in the same bin retries in turn.  A
 * copy is HS_WIDE_STRIDE = 257 entries long, so one bin's copies sit in different shared-memory banks; 15 copies
 * keep the kernel under the 48 KB of shared memory a launch gets without opting in.  The fourth window (H100)
 * timed the four launches at 944 us for 60 x 128,256 at top-p 0.9 with one copy. */
#define HS_WIDE_COPIES 15
#define HS_WIDE_STRIDE (HS_WIDE_BINS + 1)

__device__ __forceinline__ void hs_wide_begin(int64_t row, int64_t top_k, hs_wide *wide, unsigned long long *hcnt,
                                              double *hmass, unsigned *ctr) {
    for (int j = threadIdx.x; j < HS_WIDE_BINS; j += blockDim.x) {
        hcnt[row * HS_WIDE_BINS + j] = 0;
        hmass[row * HS_WIDE_BINS + j] = 0.0;
    }
    if (threadIdx.x == 0) {
        hs_wide w;
        memset(&w, 0, sizeof w);
        w.phase = top_k > 0 ? 1 : 2;
        w.need = top_k;
        ctr[row] = 0;
        wide[row] = w;
    }
}

/* The row's statistics done (thread 0 of its last block). */
__device__ __forceinline__ void hs_wide_done(int64_t row, hs_warp_stats s, double R, hs_wide *wide,
                                             hs_warp_stats *stats) {
    s.R = R;
    s.status = 0;
    stats[row] = s;
    wide[row].phase = 0;
}

/* The low key bits every value of a logits dtype has in common, given its sign: a bfloat16 widened to float32 has
 * 16 zero mantissa bits, a float16 13 (its subnormals too, once normalised), so a descent that has fixed the bits
 * above them has fixed the key: a bfloat16 row is decided at level 1, a float16 one at level 2, and the levels
 * left return at once.  hs_key_fill gives the whole key from such a prefix (hs_key32: a positive value's low bits
 * stay 0, a negative value's are inverted to 1). */
template <int DT> __device__ __forceinline__ int hs_key_const_bits() {
    return DT == HS_BFLOAT16 ? 16 : DT == HS_FLOAT16 ? 13 : 0;
}
__device__ __forceinline__ uint32_t hs_key_fill(uint32_t pfx, int shift) {
    const uint32_t hi = pfx << shift;
    return (hi & 0x80000000u) ? hi : hi | ((1u << shift) - 1u);
}

template <int DT>
__global__ void HS_CHUNK_BOUNDS hs_k_wide_level(const void *logits, int64_t T, int64_t V, const int64_t *n_dev,
                                                            double temperature, double top_p, int64_t len,
                                                            int64_t C, int phase, int level, hs_warp_stats *stats,
                                                            hs_wide *wide, unsigned long long *hcnt, double *hmass,
                                                            unsigned *ctr) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    double *bmass = (double *)(red + blockDim.x);                         /* [HS_WIDE_COPIES][HS_WIDE_STRIDE] */
    unsigned *bcnt = (unsigned *)(bmass + HS_WIDE_COPIES * HS_WIDE_STRIDE); /* [HS_WIDE_COPIES][HS_WIDE_STRIDE] */
    int *flag = (int *)(bcnt + HS_WIDE_COPIES * HS_WIDE_STRIDE);
    const int64_t row = blockIdx.x / C, c = blockIdx.x % C;
    if (n_dev && row % T >= n_dev[row / T]) return;
    const hs_wide w0 = wide[row];
    if (w0.phase != phase || w0.level != level) return; /* block-uniform */
    hs_warp_stats s = stats[row];
    const double zmax = (double)s.m / temperature;
    const int shift = 24 - 8 * level;
    for (int j = threadIdx.x; j < HS_WIDE_COPIES * HS_WIDE_STRIDE; j += blockDim.x) {
        bmass[j] = 0.0;
        bcnt[j] = 0;
    }
    __syncthreads();
    double *mine_m = bmass + (threadIdx.x % HS_WIDE_COPIES) * HS_WIDE_STRIDE;
    unsigned *mine_c = bcnt + (threadIdx.x % HS_WIDE_COPIES) * HS_WIDE_STRIDE;
    const int64_t c0 = c * len, c1 = V - c0 < len ? V : c0 + len;
    hs_strided(c0, c1, hs_logit_val<DT>{logits, row * V}, [&](int64_t v, float x) {
        const uint32_t key = hs_key32(x);
        if (level > 0 && (key >> (shift + 8)) != w0.pfx) return;
        const unsigned bin = (key >> shift) & 255u;
        if (phase == 1) { /* every key counts toward the k-th largest; the mass is the uncut weight */
            atomicAdd(&mine_c[bin], 1u);
            const double e = hs_exp_nonpos_f64((double)x / temperature - zmax);
            if (e > 0.0) atomicAdd(&mine_m[bin], e);
        } else {
            const double e = hs_warp_w(s, x, v, temperature, zmax);
            if (e > 0.0) {
                atomicAdd(&mine_c[bin], 1u);
                atomicAdd(&mine_m[bin], e);
            }
        }
    });
    __syncthreads();
    /* the copies folded (in copy order), the block's histogram added into the row's */
    for (int j = threadIdx.x; j < HS_WIDE_BINS; j += blockDim.x) {
        unsigned long long n = 0;
        double m = 0.0;
        for (int q = 0; q < HS_WIDE_COPIES; q++) {
            n += bcnt[q * HS_WIDE_STRIDE + j];
            m += bmass[q * HS_WIDE_STRIDE + j];
        }
        if (n) atomicAdd(&hcnt[row * HS_WIDE_BINS + j], n);
        if (m > 0.0) atomicAdd(&hmass[row * HS_WIDE_BINS + j], m);
    }
    if (!hs_last_block(&ctr[row], C, flag)) return;
    /* the last block of the row: the row's histogram, then the bin */
    const volatile unsigned long long *gc = hcnt + row * HS_WIDE_BINS;
    const volatile double *gm = hmass + row * HS_WIDE_BINS;
    for (int j = threadIdx.x; j < HS_WIDE_BINS; j += blockDim.x) {
        bcnt[j] = (unsigned)gc[j];
        bmass[j] = gm[j];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < HS_WIDE_BINS; j += blockDim.x) { /* zero for the next level */
        hcnt[row * HS_WIDE_BINS + j] = 0;
        hmass[row * HS_WIDE_BINS + j] = 0.0;
    }
    if (threadIdx.x == 0) ctr[row] = 0;
    hs_wide w = w0;
    long long tie_q = -1; /* phase 2 at the last level: the count of crossing-key tokens kept (all: -1) */
    double R = 0.0;
    int finish = 0;
    if (threadIdx.x == 0) {
        if (phase == 1) {
            /* the bin holding the need-th largest key, from the top */
            long long a = 0;
            double am = 0.0;
            int pick = 0;
            for (int j = 255; j >= 0; j--) {
                if (a + (long long)bcnt[j] >= w.need) {
                    pick = j;
                    break;
                }
                a += bcnt[j];
                am += bmass[j];
            }
            w.need -= a;
            w.above += am;
            w.pfx = (w.pfx << 8) | (uint32_t)pick;
            /* the bin taken whole, or one key (ties at the k-th value are kept): the cut is found */
            if (bcnt[pick] == (unsigned)w.need || shift <= hs_key_const_bits<DT>()) {
                s.kshift = shift;
                s.kpfx = w.pfx;
                stats[row] = s;
                R = w.above + bmass[pick];
                if (top_p < 1.0) {
                    w.phase = 2;
                    w.level = 0;
                    w.pfx = 0;
                    w.above = 0.0;
                } else {
                    finish = 1;
                }
            } else {
                w.level++;
            }
        } else {
            if (level == 0) {
                double W = 0.0;
                for (int j = 0; j < HS_WIDE_BINS; j++) W += bmass[j];
                w.W = W;
            }
            const double W = w.W;
            /* bins from the top; the first whose inclusion reaches top_p holds the crossing token */
            double a = w.above;
            int pick = -1, lowest = -1;
            for (int j = 255; j >= 0; j--) {
                if (bmass[j] > 0.0 && (a + bmass[j]) / W >= top_p) {
                    pick = j;
                    break;
                }
                if (bmass[j] > 0.0) {
                    lowest = j;
                    a += bmass[j];
                }
            }
            if (pick < 0 && level > 0 && lowest >= 0) { /* this level's sums fell short by rounding: the last key */
                pick = lowest;
                a -= bmass[lowest];
            }
            if (pick < 0) { /* rounding left the total short of top_p: every survivor is kept */
                R = W;
                finish = 1;
            } else {
                w.above = a;
                w.pfx = (w.pfx << 8) | (uint32_t)pick;
                if (shift <= hs_key_const_bits<DT>()) {
                    /* pfx is one key: its tokens have equal weight; keep them in id order while the cumulative
                     * probability before each is < top_p, as the CPU adds w / W token by token */
                    w.pfx = hs_key_fill(w.pfx, shift);
                    const double wv = hs_warp_w(s, hs_unkey32(w.pfx), -1, temperature, zmax);
                    const long long cnt = (long long)bcnt[pick];
                    long long q = 0;
                    double cum = a / W, r = a;
                    while (q < cnt && cum < top_p) {
                        cum += wv / W;
                        r += wv;
                        q++;
                    }
                    R = r;
                    tie_q = q < cnt ? q : -1;
                    finish = 2;
                } else {
                    w.level++;
                }
            }
        }
        wide[row] = w;
        red[0] = finish;
        red[1] = tie_q;
        ((double *)red)[2] = R;
    }
    __syncthreads();
    finish = (int)red[0];
    tie_q = red[1];
    R = ((double *)red)[2];
    __syncthreads();
    if (!finish) return;
    if (finish == 2) {
        s.pmode = 1;
        s.pkey = wide[row].pfx;
        s.ptie = tie_q < 0 ? V - 1 : -1; /* all of the key's tokens, or the first tie_q of them (none: -1) */
        if (tie_q > 0) {
            /* the tie_q-th token with the crossing key, in id order, is found by hs_k_wide_tie over the row's
             * chunks (a bf16 row of 128,256 has ties at almost every key): the row waits there in phase 3 */
            if (threadIdx.x == 0) {
                s.R = R;
                stats[row] = s;
                wide[row].phase = 3;
                wide[row].need = tie_q;
            }
            return;
        }
    }
    if (threadIdx.x == 0) hs_wide_done(row, s, R, wide, stats);
}

/* The crossing key's tie_q-th token of the rows left in phase 3 (hs_k_wide_level): every (row, chunk) block counts
 * the key's tokens in its chunk, and the row's last block finds the chunk that holds the wanted one (the counts'
 * prefix in chunk order is the prefix in id order) and walks that chunk alone: each thread counts the key's tokens
 * in its own contiguous slice of the chunk, one scan over the threads (their slices are in id order) finds the
 * slice, and that thread walks it.  One launch every call, so a recorded graph holds it whatever its rows need.
 * The seventh window (H200) timed the one-block scan of a whole bf16 row this replaces inside level 1 at about
 * 100 us for 59 rows of 128,256. */
template <int DT>
__global__ void HS_CHUNK_BOUNDS hs_k_wide_tie(const void *logits, int64_t T, int64_t V, const int64_t *n_dev,
                                                          int64_t len, int64_t C, hs_warp_stats *stats, hs_wide *wide,
                                                          long long *tcnt, unsigned *ctr) {
    char *sm = hs_smem();
    long long *red = (long long *)sm;
    int *flag = (int *)(red + blockDim.x);
    const int64_t row = blockIdx.x / C, c = blockIdx.x % C;
    if (n_dev && row % T >= n_dev[row / T]) return;
    if (wide[row].phase != 3) return; /* block-uniform */
    hs_warp_stats s = stats[row];
    const hs_logit_key<DT> key{logits, row * V};
    const int64_t c0 = c * len, c1 = V - c0 < len ? V : c0 + len;
    long long cnt = 0;
    hs_strided(c0, c1, key, [&](int64_t, uint32_t k) { cnt += k == s.pkey; });
    cnt = hs_block_reduce(cnt, red, hs_op_sum());
    if (threadIdx.x == 0) tcnt[row * C + c] = cnt;
    if (!hs_last_block(&ctr[row], C, flag)) return;
    if (threadIdx.x == 0) {
        const volatile long long *g = tcnt + row * C;
        long long need = wide[row].need, cc = C - 1;
        for (int64_t j = 0; j < C; j++) { /* the chunk holding the need-th; the counts say one does */
            const long long n = g[j];
            if (need <= n) {
                cc = j;
                break;
            }
            need -= n;
        }
        red[0] = cc;
        red[1] = need;
        ctr[row] = 0;
        *flag = -1;
    }
    __syncthreads();
    const int64_t cc = red[0];
    const long long want = red[1];
    __syncthreads();
    const int64_t b0 = cc * len, b1 = V - b0 < len ? V : b0 + len;
    const int64_t seg = (b1 - b0 + blockDim.x - 1) / blockDim.x;
    const int64_t lo = b0 + (int64_t)threadIdx.x * seg < b1 ? b0 + (int64_t)threadIdx.x * seg : b1;
    const int64_t hi = lo + seg < b1 ? lo + seg : b1;
    long long mine = 0;
    hs_batched(lo, hi, 1, key, [&](int64_t, uint32_t k) { mine += k == s.pkey; });
    long long total;
    const long long ex = hs_block_exscan(mine, red, &total);
    if (ex < want && ex + mine >= want) {
        long long left = want - ex;
        hs_batched(lo, hi, 1, key, [&](int64_t v, uint32_t k) {
            if (k == s.pkey && left > 0 && --left == 0) *flag = (int)v;
        });
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        s.ptie = *flag;
        hs_wide_done(row, s, s.R, wide, stats);
    }
}

static size_t hs_wide_smem(unsigned threads) {
    return threads * sizeof(long long) + HS_WIDE_COPIES * HS_WIDE_STRIDE * (sizeof(double) + sizeof(unsigned)) + 16;
}

/* The split statistics' second half, one block per node row: the row's max and first bad entry from its
 * chunks; the top-k cut, the kept mass and the top-p cut from the chunks' candidates sorted by rank.  The
 * candidates decide the row exactly when every token the cuts depend on is among them:
 *   - top-k (k <= HS_CAND_MAX, each chunk's k best kept): the survivors are the keys >= the k-th largest;
 *     they all are candidates unless a chunk that was cut short ends on the k-th value itself (more equal
 *     values may follow there);
 *   - top-p without top-k: the chunks kept their HS_TOPP_CAND best; every key above theta (the largest
 *     last key of a chunk that was cut short) is a candidate, so a crossing above theta is exact.
 * Otherwise (a flat row whose nucleus is wider than the candidates, many equal values, a top-k above
 * HS_CAND_MAX) the row is set up for the wide kernels (hs_k_wide_level), which finish it across blocks. */
__global__ void HS_BOUNDS(HS_ROW_THREADS) hs_k_sample_merge(int64_t T, int64_t V, const int64_t *n_dev,
                                                            double temperature, int64_t top_k, double top_p, int64_t len,
                                                            int64_t C, int K, const hs_part *parts, const uint32_t *ckey,
                                                            const int64_t *cidx, hs_warp_stats *stats, hs_wide *wide,
                                                            unsigned long long *hcnt, double *hmass, unsigned *ctr,
                                                            size_t stage_off, int64_t key_limit) {
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
    if (threadIdx.x == 0) wide[row].phase = 0;
    if (!hs_warp_begin(&s, m, bad, stats + row)) return;
    const double zmax = (double)m / temperature;
    const int topk = top_k > 0 && top_k < V;
    if (topk && top_k > HS_CAND_MAX) { /* no candidates can decide it: the wide kernels take the row */
        if (threadIdx.x == 0) stats[row] = s;
        hs_wide_begin(row, top_k, wide, hcnt, hmass, ctr);
        return;
    }
    const uint32_t *CK = ckey + row * C * K;
    const int64_t *CI = cidx + row * C * K;
    /* the counts, and the keys where they fit the 48 KB a launch gets without opting in: the fifth window timed
     * this merge at 33 us for 60 rows of 128,256 in 9 chunks, its ranks' binary searches all in global memory */
    const hs_cands v = hs_merge_stage(CK, CI, P, C, K, 0, sm + stage_off, key_limit);
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
        const int64_t rk = hs_merge_rank(v, C, K, c, j);
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
    if (!ok) { /* the wide kernels finish the row from its uncut statistics */
        __syncthreads();
        hs_warp_begin(&s, m, bad, stats + row);
        if (threadIdx.x == 0) stats[row] = s;
        hs_wide_begin(row, topk ? top_k : 0, wide, hcnt, hmass, ctr);
        return;
    }
    s.R = R;
    s.status = 0;
    if (threadIdx.x == 0) stats[row] = s;
}

/* min-p, last (docs/ops.md "Warp" step 4), one block per node row once its top-k / top-p cuts are decided (by the
 * merge or the wide kernels): the cut is w_v < min_p (the largest w is 1), and the kept mass R is summed again over
 * the whole row with it.  Launched only when min_p > 0. */
template <int DT>
__global__ void HS_BOUNDS(HS_CHUNK_THREADS) hs_k_min_p(const void *logits, int64_t T, int64_t V, const int64_t *n_dev,
                                                       double temperature, double min_p, hs_warp_stats *stats) {
    double *red = (double *)hs_smem();
    const int64_t row = blockIdx.x;
    if (n_dev && row % T >= n_dev[row / T]) return;
    hs_warp_stats s = stats[row];
    if (s.status < 0) return; /* block-uniform: the walk reports the row's failure */
    s.min_p = min_p;
    const double zmax = (double)s.m / temperature;
    double R = 0.0;
    hs_strided(0, V, hs_logit_val<DT>{logits, row * V}, [&](int64_t v, float x) {
        R += hs_warp_w(s, x, v, temperature, zmax);
    });
    R = hs_block_reduce(R, red, hs_op_sum());
    if (threadIdx.x == 0) {
        s.R = R;
        stats[row] = s;
    }
}

/* Where a request's walk ended, for the residual draw. */
struct hs_walk_rec {
    long long ok, cur, nrej, draw, len;
};

/* The residual draw's first half: the residual mass of each chunk of the row the walk ended at (rejected
 * tokens removed) and its last token with mass.  Grid: batch * C blocks. */
template <int DT>
__global__ void HS_CHUNK_BOUNDS hs_k_resid_chunks(const void *logits, int64_t T, int64_t V, int64_t len, int64_t C,
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
    hs_strided(c0, c1, hs_logit_val<DT>{logits, row * V}, [&](int64_t v, float x) {
        double w = hs_warp_w(s, x, v, temperature, zmax);
        for (int64_t q = 0; q < r.nrej && w > 0.0; q++) w = rej[q] == v ? 0.0 : w;
        if (w > 0.0) last = v;
        local += w;
    });
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
            /* the inverse CDF inside chunk cstar: each thread sums its own contiguous slice of it (ascending ids),
             * one scan over the threads gives the mass before each slice, and each thread walks its slice from
             * there; the first id whose running sum passes u * S is the token.  One block scan, where a scan per
             * blockDim ids took 16 for a chunk of 4,008 (the sixth window: 17-23 us for this kernel). */
            const int64_t row = b * T + r.cur, c0 = cstar * len, c1 = V - c0 < len ? V : c0 + len;
            const hs_warp_stats s = stats[row];
            const double zmax = (double)s.m / temperature;
            const int64_t seg = (c1 - c0 + blockDim.x - 1) / blockDim.x;
            const int64_t lo = c0 + (int64_t)threadIdx.x * seg, hi = lo + seg < c1 ? lo + seg : c1;
            const int64_t rb = row * V;
            const auto wt = [&](int64_t v) {  /* the residual weight of id v */
                double w = hs_warp_w(s, hs_ld<DT>(logits, rb + v), v, temperature, zmax);
                for (int64_t q = 0; q < r.nrej && w > 0.0; q++) w = rej[q] == v ? 0.0 : w;
                return w;
            };
            double mine = 0.0;
            hs_batched(lo, hi, 1, wt, [&](int64_t, double w) { mine += w; });
            double tot;
            double run = at + hs_block_exscan(mine, (double *)red, &tot);
            long long hit = NONE;
            hs_batched(lo, hi, 1, wt, [&](int64_t v, double w) {
                run += w;
                if (hit == NONE && w > 0.0 && run > target) hit = v;
            });
            pick = hs_block_reduce(hit, red, hs_op_min());
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
 * tokens [batch * C2], the wide rows' state [rows], histograms [rows * 256] (counts, masses), counters [rows]
 * and the crossing key's count per chunk [rows * C] (rows = batch * T). */
struct hs_sample_ws {
    hs_warp_stats *stats;
    hs_wide *wide;
    unsigned long long *hcnt;
    double *hmass;
    unsigned *ctr;
    long long *tcnt;
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
    HS_TAKE(wide, hs_wide, rows)
    HS_TAKE(hcnt, unsigned long long, rows * HS_WIDE_BINS)
    HS_TAKE(hmass, double, rows * HS_WIDE_BINS)
    HS_TAKE(ctr, unsigned, rows)
    HS_TAKE(tcnt, long long, rows * w.C)
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
    hs_status chk = hs_check_sampling(op, sp, herr);
    if (chk != HS_OK) return chk;
    chk = hs_verify_sizes(op, T, ws_bytes, hs_cuda_verify_sample_workspace_bytes(batch, T, V), herr);
    if (chk != HS_OK) return chk;
    if (batch == 0 || T == 0) return HS_OK;
    const hs_sample_ws w = hs_sample_layout(ws, batch, T, V);
    const int64_t rows = batch * T;
    if (rows * w.C > 0x7fffffffll || batch * w.C2 > 0x7fffffffll)
        return hs_fail(herr, HS_ERR_VALUE, op, "tree_tokens", "expected at most 2^31 - 1 (node, chunk) blocks, got %lld",
                       (long long)(rows * w.C));
    const int topk = sp.top_k > 0 && sp.top_k < V;
    /* the candidates each chunk keeps: the top-k's (none above HS_CAND_MAX: those rows go wide at once), or the
     * top-p's */
    const int K = topk ? (sp.top_k <= HS_CAND_MAX ? (int)sp.top_k : 0) : (sp.top_p < 1.0 ? HS_TOPP_CAND : 0);
    const unsigned th = HS_ROW_THREADS, tc = HS_CHUNK_THREADS;
    const size_t stage_off = hs_al16(hs_al16(th * sizeof(long long) + HS_RADIX_SMEM + 260 * sizeof(double)) +
                                     (size_t)HS_SORT_MAX * (8 + 8 + 4) + 16);
    /* the candidates' keys staged for the ranks when they fit under 48 KB with the rest */
    const size_t base_merge = stage_off + hs_merge_stage_smem(w.C, K, 0);
    const int64_t key_limit = base_merge + 16 < 48 * 1024 ? (int64_t)((48 * 1024 - base_merge - 16) / 4) : 0;
    const size_t sm_merge = stage_off + hs_merge_stage_smem(w.C, K, 0, key_limit);
    const size_t sm_walk = HS_TREE_THREADS * sizeof(long long) + 8 * 8 + (size_t)T * 16 + (size_t)(T + 1) * sizeof(int);
    const size_t sm_resid = tc * sizeof(long long) + (size_t)T * 8 + 16;
    { /* the chunks of every node row (rows.cu); hs_k_sample_merge decides each row from them */
        const hs_chunk_job job = {logits, logit_dtype, rows, V, w.len, w.C, T, n_dev, K, !topk, 1, sp.temperature,
                                  w.parts, w.ckey, w.cidx};
        const hs_status st = hs_launch_chunk_job(job, op, "target_logits", stream, herr);
        if (st != HS_OK) return st;
    }
    int rc = 0;
    /* the wide rows' descents: four levels of the top-k phase when there is a top-k, four of the top-p phase and
     * the crossing key's tie when there is a top-p (every call, so that a recorded graph holds them whatever its
     * rows need) */
    const int phases[2] = {topk ? 1 : 0, sp.top_p < 1.0 ? 2 : 0};
    const size_t sm_wide = hs_wide_smem(tc);
#define HS_SAMPLE_LAUNCH(DT)                                                                                          \
    rc = HS_LAUNCH(hs_k_sample_merge, rows, th, sm_merge, stream, T, V, n_dev, sp.temperature, sp.top_k,              \
                   sp.top_p, w.len, w.C, K, (const hs_part *)w.parts, (const uint32_t *)w.ckey,                       \
                   (const int64_t *)w.cidx, w.stats, w.wide, w.hcnt, w.hmass, w.ctr, stage_off, key_limit);           \
    for (int ph = 0; ph < 2 && !rc; ph++)                                                                             \
        for (int lv = 0; lv < 4 && !rc && phases[ph]; lv++)                                                           \
            rc = HS_LAUNCH(hs_k_wide_level<DT>, rows * w.C, tc, sm_wide, stream, logits, T, V, n_dev, sp.temperature, \
                           sp.top_p, w.len, w.C, phases[ph], lv, w.stats, w.wide, w.hcnt, w.hmass, w.ctr);            \
    if (!rc && phases[1])                                                                                             \
        rc = HS_LAUNCH(hs_k_wide_tie<DT>, rows * w.C, tc, tc * sizeof(long long) + 16, stream, logits, T, V, n_dev,  \
                       w.len, w.C, w.stats, w.wide, w.tcnt, w.ctr);                                                   \
    if (!rc && sp.min_p > 0.0)                                                                                        \
        rc = HS_LAUNCH(hs_k_min_p<DT>, rows, tc, tc * sizeof(double) + 16, stream, logits, T, V, n_dev,              \
                       sp.temperature, sp.min_p, w.stats);                                                            \
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
    HS_LOGIT_SWITCH(logit_dtype, op, "target_logits", herr, HS_SAMPLE_LAUNCH(DT))
#undef HS_SAMPLE_LAUNCH
    return hs_launched(rc, op, herr);
}
