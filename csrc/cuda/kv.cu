/*
 * kv.cu -- kv_compact as a CUDA kernel (semantics: docs/ops.md; CPU twin: csrc/core/kv.c).
 *
 * One launch for up to 64 tensors (descriptors passed by value, so a captured graph keeps them), one block
 * per (tensor, leading index) of the tensors that hold bytes; every block checks the prefix (a device value read
 * when the kernel runs, or a host int) and the -1-padded slots first, in parallel over the entries, so a bad call
 * moves nothing.
 */
#include "common.cuh"

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
            else if (i < mv && (s < i || (i > 0 && s <= hs_ld_id(slots, sdt, base + i - 1)) ||
                                (min_S != HS_KV_NONE && s >= lim))) /* no tensors: no bound */
                key = m + i;
            bad = key < bad ? key : bad;
        }
    }
    *mv_out = mv;
    return hs_block_reduce(bad, red, hs_op_min());
}

/* Blocks [0, first_block[count]) move the rows of one (tensor, leading index) each, tensors without bytes having
 * none (first_block[i] == first_block[i + 1]); a launch for no rows has one block that only checks.  Every block
 * first checks the prefixes and slots of every request (in order, in parallel over the entries), so a bad call
 * moves nothing anywhere; block 0 records the error the CPU core would raise (the first failing request; in it
 * the first -1 entry ends the list; a non-(-1) entry after it first, then the valid entries in order).  Each
 * tensor is [batch * inner', S, row]: leading index h belongs to request h / inner'. */
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
            /* a tensor without bytes (S or the row size 0) has nothing to move: no blocks, so its leading rows cost no
             * launch (its S still bounds the slots, through min_S) */
            if (kb.t[i].S > 0 && kb.t[i].row_bytes > 0) blocks += kb.t[i].inner;
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
