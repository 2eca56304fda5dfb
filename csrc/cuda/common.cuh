/*
 * common.cuh -- what every heterospec kernel shares: dtype loads, order-preserving integer keys, block
 * reductions and scans over shared memory, the device error record, and a block-wide radix select.
 *
 * The same source also compiles as plain C++20 with HS_CUDA_EMU defined: then a "kernel launch" runs
 * every block in turn on the host, each CUDA thread a fiber (ucontext) on the calling thread, __syncthreads a
 * switch to the next fiber, and the dynamic shared memory one buffer per block.  That build (HETEROSPEC_CUDA=emu) lets the CPU-only CI
 * run the kernels' logic through the real binding against the CPU core; it says nothing about speed and
 * cannot see GPU-only faults (memory model subtleties, launch limits), which the GPU parity run covers.
 * Because of it the kernels use no CUB and only dynamic shared memory, and exchange values between a warp's lanes
 * only through hs_warp_reduce / hs_warp_scan (warp shuffles on a GPU; in the emulation a slot a thread between
 * two barriers), called by every thread of the block alike.
 *
 * The kernels live per op family, as the CPU core does (csrc/core/): entropy.cu (topk_entropy, bucketize),
 * tree.cu (expand, select, build_tree), verify.cu (verify_greedy, verify_sample), kv.cu (kv_compact); the
 * row kernels' shared scan and split-row machinery in rows.cuh / rows.cu; runtime.cu the binding's glue.  The
 * files are compiled separately without relocatable device code, so device code used by several of them is
 * defined in a header (inline functions and templates), never in one .cu for another to call.
 */
#ifndef HS_CUDA_COMMON_CUH
#define HS_CUDA_COMMON_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hs/heterospec.h"
#include "hs/heterospec_cuda.h"

#ifdef HS_CUDA_EMU
/* ---- host emulation of the CUDA execution model ------------------------------------------------------ */
#include <atomic>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
namespace hs_emu {
extern thread_local dim3 thread_idx, block_idx;
extern thread_local dim3 block_dim, grid_dim;
extern thread_local char *smem;
extern std::atomic<long long> blocks_run; /* blocks every launch ran so far (hs_cuda_emu_blocks; for tests) */
/* Run call(arg) -- one block's kernel body -- for every block of `grid` in turn, each of block.x CUDA threads a
 * fiber (runtime.cu); sync() is __syncthreads: the calling fiber yields, and resumes once every fiber of its block
 * has reached its next sync() or returned. */
void run_blocks(dim3 grid, dim3 block, size_t smem, void (*call)(void *), void *arg);
void sync();
/* the warp primitives' slots (hs_emu_warp_values): one a thread, shared by the fibers of the launching thread's
 * block */
extern thread_local unsigned long long lanes[1024];
}
#define threadIdx (hs_emu::thread_idx)
#define blockIdx (hs_emu::block_idx)
#define blockDim (hs_emu::block_dim)
#define gridDim (hs_emu::grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
inline void __syncthreads() { hs_emu::sync(); }
/* __syncwarp as a whole-block barrier: valid wherever every thread of the block calls it alike, as the kernels do */
inline void __syncwarp(unsigned = 0xffffffffu) { hs_emu::sync(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> inline T atomicAdd(T *p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(p, &old, (T)(old + v), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
inline double atomicAdd(double *p, double v) {
    uint64_t *q = (uint64_t *)p, old = __atomic_load_n(q, __ATOMIC_SEQ_CST), nw;
    for (;;) {
        double d;
        memcpy(&d, &old, 8);
        d += v;
        memcpy(&nw, &d, 8);
        if (__atomic_compare_exchange_n(q, &old, nw, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) break;
    }
    memcpy(&v, &old, 8);
    return v;
}
inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long cmp, unsigned long long v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}
template <class T> inline T atomicMin(T *p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <class T> inline T atomicMax(T *p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline unsigned long long __double_as_longlong(double d) { unsigned long long u; memcpy(&u, &d, 8); return u; }
inline double __longlong_as_double(unsigned long long u) { double d; memcpy(&d, &u, 8); return d; }
typedef void *hs_stream_t;

/* Run kernel(args...) on grid x block threads: blocks in order, the threads of a block as fibers taking turns at
 * every __syncthreads (runtime.cu, hs_emu::run_blocks). */
/* Launch limits a real GPU enforces, so the emulation refuses what sm_80 would: at most 1024 threads per
 * block and 163 KB of dynamic shared memory (sm_90 allows 227 KB). */
#define HS_EMU_SMEM_LIMIT (163 * 1024)
template <class F> inline void hs_emu_call(void *f) { (*(F *)f)(); }
template <class... P, class... A>
inline int hs_emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    if (block.x > 1024 || smem > HS_EMU_SMEM_LIMIT) return 1;
    hs_emu::blocks_run += grid.x;
    if (grid.x == 0) return 0;
    auto call = [&]() { kernel(args...); };
    hs_emu::run_blocks(grid, block, smem, hs_emu_call<decltype(call)>, &call);
    return 0;
}
#define HS_LAUNCH(kernel, grid, block, smem, stream, ...) ((void)(stream), hs_emu_launch(kernel, dim3(grid), dim3(block), smem, __VA_ARGS__))
__device__ __forceinline__ char *hs_smem() { return hs_emu::smem; }
#define HS_BOUNDS(n)
#define HS_BOUNDS_MIN(n, blocks)
#else
/* ---- CUDA -------------------------------------------------------------------------------------------- */
#include <cuda_runtime.h>
typedef cudaStream_t hs_stream_t;
/* Kernels asking for more than the default 48 KB of dynamic shared memory (large trees) must opt in first;
 * cudaGetLastError (not Peek) so that a failed launch does not stay pending and fail every later one. */
static inline int hs_prepare_smem(const void *kernel, size_t smem) {
    if (smem <= 48 * 1024) return 0;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return (int)e;
}
#define HS_LAUNCH(kernel, grid, block, smem, stream, ...)                                                  \
    __extension__({                                                                                        \
        int hs_rc_ = hs_prepare_smem((const void *)(kernel), (smem));                                      \
        if (hs_rc_ == 0) {                                                                                 \
            kernel<<<(grid), (block), (smem), (cudaStream_t)(stream)>>>(__VA_ARGS__);                      \
            hs_rc_ = (int)cudaGetLastError();                                                              \
        }                                                                                                  \
        hs_rc_;                                                                                            \
    })
#define HS_BOUNDS(n) __launch_bounds__(n)
/* ... and at least `blocks` of them resident on an SM (registers capped to fit: 64 for 4 blocks of 256) */
#define HS_BOUNDS_MIN(n, blocks) __launch_bounds__(n, blocks)
__device__ __forceinline__ char *hs_smem() {
    extern __shared__ __align__(16) char hs_dynamic_smem[];
    return hs_dynamic_smem;
}
#endif

#include "../core/hd_math.h"

/* ---- host side of a launch ----------------------------------------------------------------------------- */

extern "C" hs_status hs_fail(hs_error *err, hs_status status, const char *op, const char *arg, const char *fmt, ...);
extern "C" hs_status hs_check_sampling(const char *op, hs_sampling sp, hs_error *err);   /* core/verify.c */

/* A launch's return code (HS_LAUNCH) as a status: HS_OK, or HS_ERR_CUDA saying why. */
static inline hs_status hs_launched(int rc, const char *op, hs_error *herr) {
    if (rc == 0) return HS_OK;
#ifdef HS_CUDA_EMU
    return hs_fail(herr, (hs_status)HS_ERR_CUDA, op, "launch",
                   "expected a successful kernel launch, got one over the emulated sm_80 limits (block or shared memory)");
#else
    return hs_fail(herr, (hs_status)HS_ERR_CUDA, op, "launch", "expected a successful kernel launch, got %s",
                   cudaGetErrorString((cudaError_t)rc));
#endif
}

/* Run the statements with DT, a constant usable as a template argument, set to the logits dtype; another dtype
 * returns HS_ERR_DTYPE naming argument `arg` of `op`.  For the host launchers of kernels templated on it. */
#define HS_LOGIT_SWITCH(dtype, op, arg, herr, ...)                                                                \
    switch (dtype) {                                                                                             \
    case HS_FLOAT32: { constexpr int DT = HS_FLOAT32; __VA_ARGS__; } break;                                      \
    case HS_FLOAT16: { constexpr int DT = HS_FLOAT16; __VA_ARGS__; } break;                                      \
    case HS_BFLOAT16: { constexpr int DT = HS_BFLOAT16; __VA_ARGS__; } break;                                    \
    default:                                                                                                     \
        return hs_fail(herr, HS_ERR_DTYPE, op, arg, "expected float16, bfloat16 or float32, got %s",             \
                       hs_dtype_name((hs_dtype)(dtype)));                                                        \
    }

/* Sizes of shared and global scratch carved into 16-byte aligned pieces. */
__host__ __device__ static inline size_t hs_al16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Threads per block for vocabulary-wide row kernels and for small per-tree kernels. */
#ifdef HS_CUDA_EMU
/* 64 threads per block by default: every code path, fast enough for CI; HETEROSPEC_EMU_BLOCKS=gpu builds the
 * emulation with the GPU's block sizes (1024/256) to exercise their paths too (slower: a fiber each). */
#ifndef HS_EMU_ROW_THREADS
#define HS_EMU_ROW_THREADS 64
#endif
#ifndef HS_EMU_TREE_THREADS
#define HS_EMU_TREE_THREADS 64
#endif
#define HS_ROW_THREADS HS_EMU_ROW_THREADS
#define HS_TREE_THREADS HS_EMU_TREE_THREADS
#else
#define HS_ROW_THREADS 1024
#define HS_TREE_THREADS 256
#endif

#define HS_INF __int_as_float_inf()
__device__ __forceinline__ float __int_as_float_inf() { return __uint_as_float(0x7f800000u); }

/* ---- device error codes (hs_cuda_error.code) ----------------------------------------------------------- */
enum {
    HS_CE_LOGIT_NONFINITE = 1, /* a = row, b = col, c = 1 for +inf, 0 for nan */
    HS_CE_LOGIT_ALLNEG,        /* a = row */
    HS_CE_BEAM_SCORE,          /* a = index (nan or +inf) */
    HS_CE_BEAM_NODE,           /* a = value, b = index */
    HS_CE_D2T,                 /* a = id, b = offset */
    HS_CE_SCORE_NAN,           /* a = index */
    HS_CE_SEL_RANGE,           /* a = candidate, b = position, c = M */
    HS_CE_SEL_ORDER,           /* a = candidate, b = position, c = previous */
    HS_CE_PARENT_RANGE,        /* a = parent, b = candidate, c = M */
    HS_CE_PARENT_ORDER,        /* a = candidate, b = parent */
    HS_CE_TOKEN_NEG,           /* a = token, b = candidate */
    HS_CE_NOT_CLOSED,          /* a = candidate, b = parent candidate */
    HS_CE_TREE_ROOT,           /* a = parent of node 0 */
    HS_CE_TREE_PARENT,         /* a = parent, b = node */
    HS_CE_TREE_TOKEN,          /* a = token, b = node, c = V */
    HS_CE_SLOT_LT_I,           /* a = i, b = slot */
    HS_CE_SLOT_ORDER,          /* a = slot, b = i, c = previous */
    HS_CE_SLOT_RANGE,          /* a = prefix, b = slot, c = i, d = S */
    HS_CE_VALUE_NAN,           /* a = index */
    HS_CE_THRESH_NAN,          /* a = index */
    HS_CE_THRESH_ORDER,        /* a = index */
    HS_CE_NO_MASS,             /* a = row */
    HS_CE_SIZE,                /* a = value, b = limit: a per-row size out of range */
    HS_CE_SLOT_PAD,            /* a = slot, b = i, c = index of the first -1 */
    HS_CE_PREFIX_NEG,          /* a = prefix_len */
    HS_CE_ROOT_NEG,            /* a = root token, b = row */
};

/* First failure wins: claim the record with a CAS on code, then fill the numbers (read only after the
 * stream is synchronised, so the two-step write is safe). */
__device__ __forceinline__ void hs_report(hs_cuda_error *e, unsigned long long code, long long a, long long b = 0,
                                          long long c = 0, long long d = 0) {
    if (e == nullptr) return;
    if (atomicCAS(&e->code, 0ull, code) == 0ull) {
        e->a = a;
        e->b = b;
        e->c = c;
        e->d = d;
    }
}

/* ---- loads --------------------------------------------------------------------------------------------- */
template <int DT> __device__ __forceinline__ float hs_ld(const void *p, int64_t i);
template <> __device__ __forceinline__ float hs_ld<HS_FLOAT32>(const void *p, int64_t i) { return ((const float *)p)[i]; }
template <> __device__ __forceinline__ float hs_ld<HS_FLOAT16>(const void *p, int64_t i) {
    return hs_half_to_float(((const uint16_t *)p)[i]);
}
template <> __device__ __forceinline__ float hs_ld<HS_BFLOAT16>(const void *p, int64_t i) {
    return hs_bf16_to_float(((const uint16_t *)p)[i]);
}
/* hs_batched: f(i, load(i)) for i, i + step, .. < hi; hs_strided: a block's strided loop over [lo, hi), from
 * i = lo + threadIdx.x by blockDim.x.  Each thread goes in ascending i as a plain loop would (so sums and atomics
 * keep their per-thread order), but with the loads of HS_LD_BATCH iterations issued before any of them is used.  A plain loop whose body branches or adds
 * atomically is compiled with one load in flight per thread (nvcc -O3 -ptx: one ld.global per iteration), so
 * it waits a memory latency per element: the sixth GPU window timed such a pass over 60 rows of 128,256 at
 * about 40 us where the unrolled argmax pass over the same bytes took 18.5 us. */
#define HS_LD_BATCH 8
#ifdef HS_CUDA_EMU
#define HS_UNROLL _Pragma("GCC unroll 8")
#else
#define HS_UNROLL _Pragma("unroll")
#endif
template <class Load, class F>
__device__ __forceinline__ void hs_batched(int64_t i, int64_t hi, int64_t step, const Load &load, const F &f) {
    for (; i + (HS_LD_BATCH - 1) * step < hi; i += HS_LD_BATCH * step) {
        decltype(load(i)) x[HS_LD_BATCH];
        HS_UNROLL
        for (int u = 0; u < HS_LD_BATCH; u++) x[u] = load(i + u * step);
        HS_UNROLL
        for (int u = 0; u < HS_LD_BATCH; u++) f(i + u * step, x[u]);
    }
    for (; i < hi; i += step) f(i, load(i));
}
template <class Load, class F>
__device__ __forceinline__ void hs_strided(int64_t lo, int64_t hi, const Load &load, const F &f) {
    hs_batched(lo + threadIdx.x, hi, blockDim.x, load, f);
}
__device__ __forceinline__ int64_t hs_ld_id(const void *p, int dt, int64_t i) {
    return dt == HS_INT32 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}
__device__ __forceinline__ double hs_ld_real(const void *p, int dt, int64_t i) {
    return dt == HS_FLOAT64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

/* Order-preserving unsigned keys: a > b as numbers iff key(a) > key(b); -0 and +0 share a key (they
 * compare equal, so their order is decided by index, as on the CPU). */
__device__ __forceinline__ uint32_t hs_key32(float f) {
    uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float hs_unkey32(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ uint64_t hs_key64(double f) {
    uint64_t u = (uint64_t)__double_as_longlong(f == 0.0 ? 0.0 : f);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}

/* Whether this block is the last of the `of` blocks that count on *ctr to get here (block-uniform; every thread
 * of the block must call it, and `flag` is shared).  The last block sees what the others wrote before they
 * arrived; it resets *ctr when it is done with it, so the next launch and a graph replay start from zero. */
__device__ __forceinline__ int hs_last_block(unsigned *ctr, int64_t of, int *flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicAdd(ctr, 1u) == (unsigned)(of - 1);
    __syncthreads();
    const int last = *flag;
    __syncthreads();
    if (last) __threadfence();
    return last;
}

/* ---- warps: the block's threads in groups of hs_warp_width() = min(32, blockDim) consecutive threads ------
 * hs_warp_reduce gives every lane op over its warp's values, combined by a butterfly: at step m (W/2 .. 1) lane i
 * pairs with lane i ^ m and both compute op(lower lane's value, higher lane's value), so every lane gets the same
 * bits (max/min with a NaN included).  hs_warp_scan gives each lane the sum over lanes 0..lane (Hillis-Steele:
 * at step d = 1, 2, .. lane i >= d adds lane i - d's value before its own) and lane - 1's.  On a GPU by
 * __shfl_xor_sync / __shfl_up_sync; the emulation publishes the warp's values in one slot a thread between two
 * barriers and replays the same steps in the same order on them, so it computes the same bits.  Every thread of
 * the block must call them alike. */
__device__ __forceinline__ unsigned hs_warp_width() { return blockDim.x < 32 ? blockDim.x : 32u; }
__device__ __forceinline__ unsigned hs_warp_mask() { return blockDim.x < 32 ? (1u << blockDim.x) - 1u : 0xffffffffu; }
#ifdef HS_CUDA_EMU
/* the values of this thread's warp, x[0 .. W) */
template <class T> inline void hs_emu_warp_values(T v, T *x) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "a slot holds 8 bytes");
    const unsigned W = hs_warp_width(), w0 = threadIdx.x - threadIdx.x % W;
    memcpy(&hs_emu::lanes[threadIdx.x], &v, sizeof v);
    __syncthreads();
    for (unsigned i = 0; i < W; i++) memcpy(&x[i], &hs_emu::lanes[w0 + i], sizeof(T));
    __syncthreads();
}
template <class T, class Op> inline T hs_warp_reduce(T v, Op op) {
    const unsigned W = hs_warp_width();
    T x[32], y[32];
    hs_emu_warp_values(v, x);
    for (unsigned m = W / 2; m > 0; m >>= 1) {
        for (unsigned i = 0; i < W; i++) y[i] = (i & m) ? op(x[i ^ m], x[i]) : op(x[i], x[i ^ m]);
        memcpy(x, y, sizeof(T) * W);
    }
    return x[threadIdx.x % W];
}
template <class T> inline void hs_warp_scan(T v, T *incl, T *prev) {
    const unsigned W = hs_warp_width(), lane = threadIdx.x % W;
    T x[32];
    hs_emu_warp_values(v, x);
    for (unsigned d = 1; d < W; d <<= 1)
        for (unsigned i = W; i-- > d;) x[i] = x[i - d] + x[i]; /* descending: x[i - d] is still the step's input */
    *incl = x[lane];
    *prev = lane > 0 ? x[lane - 1] : x[lane];
}
#else
template <class T, class Op> __device__ __forceinline__ T hs_warp_reduce(T v, Op op) {
    for (unsigned m = hs_warp_width() / 2; m > 0; m >>= 1) {
        const T o = __shfl_xor_sync(hs_warp_mask(), v, m);
        v = (threadIdx.x & m) ? op(o, v) : op(v, o);
    }
    return v;
}
template <class T> __device__ __forceinline__ void hs_warp_scan(T v, T *incl, T *prev) {
    const unsigned lane = threadIdx.x % hs_warp_width();
    for (unsigned d = 1; d < hs_warp_width(); d <<= 1) {
        const T y = __shfl_up_sync(hs_warp_mask(), v, d);
        if (lane >= d) v = y + v;
    }
    *incl = v;
    *prev = __shfl_up_sync(hs_warp_mask(), v, 1); /* lane 0: its own */
}
#endif

/* ---- block reductions and scans over shared scratch `red` (8 bytes for each warp: blockDim entries suffice);
 * blockDim a power of 2.  Every thread of the block must call them; they end with the result visible to all,
 * and with a barrier (what the block wrote to shared memory before the call is visible after it).  Each warp
 * combines its lanes (hs_warp_reduce / hs_warp_scan), then every thread combines the warps' results from `red` in
 * warp order: two barriers a call, where a tree over shared memory took log2(blockDim) + 2 (10 for 256 threads,
 * 12 for 1,024; the eighth GPU window's one-block merges spend 13-31 us mostly on such barrier chains). */
template <class T, class Op> __device__ __forceinline__ T hs_block_reduce(T v, T *red, Op op) {
    const unsigned t = threadIdx.x, W = hs_warp_width();
    v = hs_warp_reduce(v, op);
    if (t % W == 0) red[t / W] = v;
    __syncthreads();
    T r = red[0];
    for (unsigned w = 1; w < blockDim.x / W; w++) r = op(r, red[w]);
    __syncthreads();
    return r;
}
struct hs_op_sum {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct hs_op_max {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct hs_op_min {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};

/* Exclusive prefix sum of v over the block in thread order; *total gets the sum.  Within a warp by hs_warp_scan,
 * then each thread adds the totals of the warps before its own. */
template <class T> __device__ __forceinline__ T hs_block_exscan(T v, T *red, T *total) {
    const unsigned t = threadIdx.x, W = hs_warp_width(), lane = t % W;
    T x, ex;
    hs_warp_scan(v, &x, &ex); /* x: the warp's sum up to this lane; ex: up to the lane before (lane 0: unused) */
    if (lane == W - 1) red[t / W] = x;
    __syncthreads();
    T before = (T)0, all = (T)0;
    for (unsigned w = 0; w < blockDim.x / W; w++) {
        if (w == t / W) before = all;
        all += red[w];
    }
    *total = all;
    __syncthreads();
    return lane == 0 ? before : before + ex;
}

/* Sort n2 slots of shared memory (n2 a power of two, at most 2^30) by a bitonic network over the block:
 * before(a, b) says slot a's entry goes before slot b's, swap(a, b) exchanges them; afterwards slot 0 holds the
 * first.  log2(n2) * (log2(n2) + 1) / 2 passes of n2 / 2 compare-exchanges, pair i taken by thread i mod blockDim.
 * A pass of stride <= 16 has pair i in slots [64 * (i / 32), + 64): with blockDim a multiple of 32, one warp owns
 * those slots in every such pass, so between two of them the warp waits only for itself (__syncwarp); the other
 * passes end with a block barrier, and so does the sort.  Every thread of the block must call it. */
template <class Before, class Swap> __device__ __forceinline__ void hs_block_bitonic(int n2, const Before &before,
                                                                                    const Swap &swap) {
    const int half = n2 / 2;
    for (int size = 2; size <= n2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = (int)threadIdx.x; i < half; i += (int)blockDim.x) {
                const int lo = ((i & ~(stride - 1)) << 1) | (i & (stride - 1)), hi = lo + stride;
                /* in "before" order where bit `size` of lo is clear, reversed where it is set; the last passes
                 * (size == n2) are all in order */
                if ((lo & size) == 0 ? before(hi, lo) : before(lo, hi)) swap(lo, hi);
            }
            const int next = stride > 1 ? stride >> 1 : (size < n2 ? size : 0);
            if (stride <= 16 && next > 0 && next <= 16 && blockDim.x % 32 == 0) __syncwarp();
            else __syncthreads();
        }
    }
    if (n2 < 2) __syncthreads();
}

/* ---- block radix select ----------------------------------------------------------------------------------
 * Among n keys key(i), find what "the k largest, ties to the lower index" takes: a result (pfx, shift) such
 * that every key with (key >> shift) > pfx is taken, none with (key >> shift) < pfx is, and of those with
 * (key >> shift) == pfx either all are taken (all_eq) or the `need` lowest-indexed ones (then shift == 0:
 * they are equal keys).  8 bits per pass, most significant first, stopping early once the bin holding the
 * k-th key is taken whole.  Shared scratch: 256 counters + a few words (hs_radix_smem_bytes). */
template <class K> struct hs_radix {
    K pfx;
    int shift;
    int64_t count_gt; /* keys strictly above the bin */
    int64_t need;     /* how many of the bin are taken */
    int all_eq;
    int64_t tie_cut; /* with !all_eq: the index of the need-th key of the bin (ties at or below it are taken) */
    __device__ __forceinline__ int taken(K key, int64_t i) const {
        K h = (K)(key >> shift);
        return h > pfx || (h == pfx && (all_eq || i <= tie_cut));
    }
    __device__ __forceinline__ int survives(K key) const { /* key >= the k-th largest key */
        return (K)(key >> shift) >= pfx;
    }
};
#define HS_RADIX_SMEM (256 * 4 + 64)
/* Shared memory of a block that reduces (8 bytes a thread) and runs a radix select. */
static inline size_t hs_row_smem(unsigned threads) { return threads * sizeof(long long) + HS_RADIX_SMEM; }

template <class K, class KeyFn>
__device__ void hs_block_radix_select(const KeyFn &key, int64_t n, int64_t k, char *scratch, long long *red,
                                      hs_radix<K> *res) {
    unsigned *hist = (unsigned *)scratch;
    long long *sh = (long long *)(scratch + 256 * 4); /* [0] bin, [1] above-bin count, [2] bin count */
    const int bits = 8 * (int)sizeof(K);
    K pfx = 0;
    int64_t need = k, count_gt = 0;
    int shift = bits, all_eq = 0;
    while (shift > 0) {
        shift -= 8;
        for (unsigned b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        hs_strided(0, n, key, [&](int64_t, K kk) {
            int in = shift + 8 >= bits || (K)(kk >> (shift + 8)) == pfx;
            if (in) atomicAdd(&hist[(unsigned)(kk >> shift) & 255u], 1u);
        });
        __syncthreads();
        /* which bin holds the need-th largest: counts above each bin by a scan over chunks of bins */
        {
            unsigned c = blockDim.x >= 256 ? 1u : 256u / blockDim.x, lo = threadIdx.x * c;
            long long local = 0;
            for (unsigned j = lo; j < lo + c && j < 256; j++) local += hist[j];
            long long total;
            long long ex = hs_block_exscan(local, red, &total);
            long long above = total - ex - local; /* keys in the bins after this thread's chunk */
            for (unsigned j = lo + c; j-- > lo;) {
                if (j < 256 && above < need && above + hist[j] >= need) {
                    sh[0] = j;
                    sh[1] = above;
                    sh[2] = hist[j];
                }
                if (j < 256) above += hist[j];
            }
        }
        __syncthreads();
        long long bin = sh[0], above = sh[1], cnt = sh[2];
        __syncthreads();
        count_gt += above;
        need -= above;
        pfx = (K)((pfx << 8) | (K)bin);
        if (cnt == need) {
            all_eq = 1;
            break;
        }
    }
    res->pfx = pfx;
    res->shift = shift;
    res->count_gt = count_gt;
    res->need = need;
    res->all_eq = all_eq;
    res->tie_cut = -1;
    if (!all_eq) {
        /* ties at the k-th key: the need lowest indices among the equal keys, by an ordered scan */
        int64_t base = 0, cut = -1;
        for (int64_t t0 = 0; t0 < n && base < need; t0 += blockDim.x) {
            int64_t i = t0 + threadIdx.x;
            long long f = i < n && key(i) == pfx;
            long long total;
            long long ex = hs_block_exscan(f, red, &total);
            if (f && base + ex == need - 1) sh[3] = i;
            __syncthreads();
            if (base + total >= need) cut = sh[3];
            base += total;
        }
        res->tie_cut = cut;
        __syncthreads();
    }
}

/* Take the k entries chosen by `sel` into cand (ids) / cval (keys), then sort them best first by rank
 * counting (key desc, id asc); rank[c] is where cand[c] goes. */
template <class KeyFn>
__device__ void hs_collect_sorted(const KeyFn &key, int64_t n, int64_t k, const hs_radix<uint32_t> &sel,
                                  int64_t *cand, uint32_t *cval, int *rank, int *count) {
    if (threadIdx.x == 0) *count = 0;
    __syncthreads();
    hs_strided(0, n, key, [&](int64_t i, uint32_t kk) {
        if (sel.taken(kk, i)) {
            int pos = atomicAdd(count, 1);
            if (pos < k) {
                cand[pos] = i;
                cval[pos] = kk;
            }
        }
    });
    __syncthreads();
    for (int c = threadIdx.x; c < k; c += blockDim.x) {
        int r = 0;
        for (int j = 0; j < k; j++)
            r += cval[j] > cval[c] || (cval[j] == cval[c] && cand[j] < cand[c]);
        rank[c] = r;
    }
    __syncthreads();
}

#endif /* HS_CUDA_COMMON_CUH */
