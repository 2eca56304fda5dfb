/*
 * runtime.cu -- the CUDA runtime glue the binding needs (devices, streams, the device error
 * record, the module-owned workspace) and the messages of device-side errors.  Kept out of the binding so
 * that csrc/py/ compiles without CUDA headers.  In the emulated build (HS_CUDA_EMU) "device memory" is host
 * memory and there is one emulated device.
 */
#include "common.cuh"

#include <stdio.h>
#include <stdlib.h>


#define HS_MAX_DEVICES 64

static struct {
    hs_cuda_error *host, *dev;
    void *ws;
    size_t ws_bytes;
    /* earlier workspaces, never freed: a recorded CUDA graph keeps the address of the workspace it was captured
     * with, so a buffer replaced by a larger one must stay valid for as long as such graphs may be replayed
     * (growth doubles, so all of them together are smaller than the current one) */
    void *retired[64];
    int nretired;
} hs_dev_state[HS_MAX_DEVICES];

#ifndef HS_CUDA_EMU
static hs_status hs_cuda_fail(hs_error *herr, const char *what, cudaError_t e) {
    return hs_fail(herr, HS_ERR_CUDA, "cuda", what, "failed: %s", cudaGetErrorString(e));
}
#endif

extern "C" int hs_cuda_emulated(void) {
#ifdef HS_CUDA_EMU
    return 1;
#else
    return 0;
#endif
}

extern "C" long long hs_cuda_emu_blocks(void) {
#ifdef HS_CUDA_EMU
    return hs_emu::blocks_run.load();
#else
    return -1;
#endif
}

extern "C" const char *hs_cuda_archs(void) {
#ifdef HS_CUDA_ARCHS
    return HS_CUDA_ARCHS;
#else
    return "emulated";
#endif
}

extern "C" int hs_cuda_runtime_version(void) {
#ifdef HS_CUDA_EMU
    return 0;
#else
    int v = 0;
    cudaRuntimeGetVersion(&v);
    return v;
#endif
}

extern "C" int hs_cuda_device_count(char *why, size_t n) {
#ifdef HS_CUDA_EMU
    (void)why;
    (void)n;
    return 1;
#else
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        snprintf(why, n, "%s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return 0;
    }
    if (count == 0) snprintf(why, n, "no CUDA device");
    return count;
#endif
}

extern "C" int hs_cuda_set_device(int dev, hs_error *herr) {
#ifdef HS_CUDA_EMU
    (void)dev;
    (void)herr;
    return 0;
#else
    int prev = 0;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != dev) e = cudaSetDevice(dev);
    if (e != cudaSuccess) {
        hs_cuda_fail(herr, "cudaSetDevice", e);
        return -1;
    }
    return prev;
#endif
}

extern "C" int hs_cuda_stream_capturing(void *stream, hs_error *herr) {
#ifdef HS_CUDA_EMU
    (void)stream;
    (void)herr;
    return 0;
#else
    cudaStreamCaptureStatus st;
    cudaError_t e = cudaStreamIsCapturing((cudaStream_t)stream, &st);
    if (e != cudaSuccess) {
        hs_cuda_fail(herr, "cudaStreamIsCapturing", e);
        return -1;
    }
    return st != cudaStreamCaptureStatusNone;
#endif
}

extern "C" void *hs_cuda_stream_new(hs_error *herr) {
#ifdef HS_CUDA_EMU
    (void)herr;
    static uintptr_t made = 0; /* distinct, never dereferenced: the emulation runs every launch in order */
    return (void *)(uintptr_t)(0x1000 + 0x10 * ++made);
#else
    cudaStream_t s = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        hs_cuda_fail(herr, "cudaStreamCreateWithFlags", e);
        return NULL;
    }
    return (void *)s;
#endif
}

extern "C" hs_cuda_error *hs_cuda_error_record(int dev, hs_cuda_error **host_view, hs_error *herr) {
    if (dev < 0 || dev >= HS_MAX_DEVICES) {
        hs_fail(herr, HS_ERR_VALUE, "cuda", "device", "expected a device index < %d, got %d", HS_MAX_DEVICES, dev);
        return NULL;
    }
    if (hs_dev_state[dev].host == NULL) {
#ifdef HS_CUDA_EMU
        hs_dev_state[dev].host = hs_dev_state[dev].dev = (hs_cuda_error *)calloc(1, sizeof(hs_cuda_error));
        if (hs_dev_state[dev].host == NULL) {
            hs_fail(herr, HS_ERR_CUDA, "cuda", "error record", "failed: out of memory");
            return NULL;
        }
#else
        /* The record lives in device memory (kernels claim it with a device-scope atomicCAS, which needs no
         * platform support for atomics on host memory); a pinned host mirror receives it when the binding
         * checks (hs_cuda_error_fetch). */
        void *h = NULL, *d = NULL;
        cudaError_t e = cudaMallocHost(&h, sizeof(hs_cuda_error));
        if (e == cudaSuccess) e = cudaMalloc(&d, sizeof(hs_cuda_error));
        if (e == cudaSuccess) e = cudaMemset(d, 0, sizeof(hs_cuda_error));
        if (e == cudaSuccess) e = cudaDeviceSynchronize(); /* once per device */
        if (e != cudaSuccess) {
            if (h) cudaFreeHost(h);
            if (d) cudaFree(d);
            hs_cuda_fail(herr, "error record allocation", e);
            return NULL;
        }
        memset(h, 0, sizeof(hs_cuda_error));
        hs_dev_state[dev].host = (hs_cuda_error *)h;
        hs_dev_state[dev].dev = (hs_cuda_error *)d;
#endif
    }
    *host_view = hs_dev_state[dev].host;
    return hs_dev_state[dev].dev;
}

extern "C" hs_status hs_cuda_error_fetch(int dev, void *stream, hs_error *herr) {
    if (hs_dev_state[dev].host == hs_dev_state[dev].dev) return HS_OK; /* the emulation: one buffer */
    return hs_cuda_memcpy_d2h(hs_dev_state[dev].host, hs_dev_state[dev].dev, sizeof(hs_cuda_error), stream, herr);
}

extern "C" hs_status hs_cuda_error_clear(int dev, void *stream, hs_error *herr) {
    memset(hs_dev_state[dev].host, 0, sizeof(hs_cuda_error));
#ifdef HS_CUDA_EMU
    (void)stream;
    (void)herr;
    return HS_OK;
#else
    cudaError_t e = cudaMemsetAsync(hs_dev_state[dev].dev, 0, sizeof(hs_cuda_error), (cudaStream_t)stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)stream);
    return e == cudaSuccess ? HS_OK : hs_cuda_fail(herr, "cudaMemsetAsync(error record)", e);
#endif
}

extern "C" void *hs_cuda_workspace(int dev, size_t bytes, void *stream, hs_error *herr) {
    if (dev < 0 || dev >= HS_MAX_DEVICES) {
        hs_fail(herr, HS_ERR_VALUE, "cuda", "device", "expected a device index < %d, got %d", HS_MAX_DEVICES, dev);
        return NULL;
    }
    if (bytes == 0) bytes = 1;
    if (hs_dev_state[dev].ws_bytes >= bytes) return hs_dev_state[dev].ws;
    int cap = hs_cuda_stream_capturing(stream, herr);
    if (cap < 0) return NULL;
    if (cap) {
        hs_fail(herr, HS_ERR_VALUE, "cuda", "workspace",
                "expected >= %zu bytes to be allocated before graph capture, got %zu: run the op once outside the "
                "capture (warm-up) or call heterospec.ops.cuda_reserve(device, bytes)",
                bytes, hs_dev_state[dev].ws_bytes);
        return NULL;
    }
    size_t grow = bytes < ((size_t)1 << 20) ? ((size_t)1 << 20) : bytes; /* at least 1 MiB: fewer regrowths */
    if (grow < 2 * hs_dev_state[dev].ws_bytes) grow = 2 * hs_dev_state[dev].ws_bytes;
    if (hs_dev_state[dev].ws != NULL && hs_dev_state[dev].nretired >= 64) {
        hs_fail(herr, HS_ERR_VALUE, "cuda", "workspace", "expected fewer than 64 regrowths, got a request for %zu bytes "
                "(call heterospec.ops.cuda_reserve(device, bytes) once with the largest size)", bytes);
        return NULL;
    }
#ifdef HS_CUDA_EMU
    (void)stream;
    void *p = calloc(1, grow);
    if (p == NULL) {
        hs_fail(herr, HS_ERR_CUDA, "cuda", "workspace", "failed: out of memory");
        return NULL;
    }
#else
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, grow);
    if (e == cudaSuccess) e = cudaMemset(p, 0, grow);
    if (e == cudaSuccess) e = cudaDeviceSynchronize(); /* not the hot path: once per growth */
    if (e != cudaSuccess) {
        hs_cuda_fail(herr, "cudaMalloc(workspace)", e);
        return NULL;
    }
#endif
    if (hs_dev_state[dev].ws != NULL) hs_dev_state[dev].retired[hs_dev_state[dev].nretired++] = hs_dev_state[dev].ws;
    hs_dev_state[dev].ws = p;
    hs_dev_state[dev].ws_bytes = grow;
    return p;
}

extern "C" void hs_cuda_workspace_info(int dev, size_t *bytes, int *retired) {
    int ok = dev >= 0 && dev < HS_MAX_DEVICES;
    *bytes = ok ? hs_dev_state[dev].ws_bytes : 0;
    *retired = ok ? hs_dev_state[dev].nretired : 0;
}

extern "C" hs_status hs_cuda_memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream, hs_error *herr) {
#ifdef HS_CUDA_EMU
    (void)stream;
    (void)herr;
    memcpy(dst, src, bytes);
    return HS_OK;
#else
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)stream);
    return e == cudaSuccess ? HS_OK : hs_cuda_fail(herr, "cudaMemcpyAsync", e);
#endif
}

extern "C" void hs_cuda_error_message(const hs_cuda_error *e, const char *op, char *buf, size_t n) {
    const char *lg = (op[0] == 'v') ? "target_logits" : "logits"; /* verify_* name their logits so */
    long long a = e->a, b = e->b, c = e->c, d = e->d;
    switch (e->code) {
    case HS_CE_LOGIT_NONFINITE:
        snprintf(buf, n, "%s: argument '%s' expected finite values or -inf (masked tokens), got %s at [%lld, %lld]", op,
                 lg, c ? "+inf" : "nan", a, b);
        break;
    case HS_CE_LOGIT_ALLNEG:
        snprintf(buf, n, "%s: argument '%s' expected at least one value > -inf per row, got an all -inf row %lld", op, lg, a);
        break;
    case HS_CE_BEAM_SCORE:
        snprintf(buf, n, "%s: argument 'beam_scores' expected finite values or -inf, got nan or +inf at [%lld]", op, a);
        break;
    case HS_CE_BEAM_NODE:
        snprintf(buf, n, "%s: argument 'beam_nodes' expected values >= -1, got %lld at [%lld]", op, a, b);
        break;
    case HS_CE_D2T:
        snprintf(buf, n, "%s: argument 'd2t' expected draft id + d2t[id] >= 0, got %lld + %lld = %lld", op, a, b, a + b);
        break;
    case HS_CE_SCORE_NAN: snprintf(buf, n, "%s: argument 'scores' expected no NaN, got nan at [%lld]", op, a); break;
    case HS_CE_SEL_RANGE:
        snprintf(buf, n, "%s: argument 'selected' expected candidate indices in [0, %lld), got %lld at [%lld]", op, c, a, b);
        break;
    case HS_CE_SEL_ORDER:
        snprintf(buf, n, "%s: argument 'selected' expected strictly ascending candidate indices, got %lld at [%lld] after %lld",
                 op, a, b, c);
        break;
    case HS_CE_PARENT_RANGE:
        snprintf(buf, n, "%s: argument 'parents' expected values in [-1, %lld), got %lld at [%lld]", op, c, a, b);
        break;
    case HS_CE_PARENT_ORDER:
        snprintf(buf, n, "%s: argument 'parents' expected parents to precede children (parents[c] < c), got parents[%lld] = %lld",
                 op, a, b);
        break;
    case HS_CE_TOKEN_NEG: snprintf(buf, n, "%s: argument 'tokens' expected token ids >= 0, got %lld at [%lld]", op, a, b); break;
    case HS_CE_NOT_CLOSED:
        snprintf(buf, n, "%s: argument 'selected' expected a parent-closed selection, got candidate %lld selected without "
                 "its parent candidate %lld", op, a, b);
        break;
    case HS_CE_TREE_ROOT:
        snprintf(buf, n, "%s: argument 'tree_parents' expected -1 for the root (node 0), got %lld at [0]", op, a);
        break;
    case HS_CE_TREE_PARENT:
        snprintf(buf, n, "%s: argument 'tree_parents' expected 0 <= tree_parents[i] < i, got %lld at [%lld]", op, a, b);
        break;
    case HS_CE_TREE_TOKEN:
        snprintf(buf, n, "%s: argument 'tree_tokens' expected ids in [0, V = %lld), got %lld at [%lld]", op, c, a, b);
        break;
    case HS_CE_SLOT_LT_I:
        snprintf(buf, n, "%s: argument 'slots' expected slots[i] >= i, got slots[%lld] = %lld", op, a, b);
        break;
    case HS_CE_SLOT_ORDER:
        snprintf(buf, n, "%s: argument 'slots' expected strictly ascending slots, got %lld at [%lld] after %lld", op, a, b, c);
        break;
    case HS_CE_SLOT_RANGE:
        snprintf(buf, n, "%s: argument 'slots' expected prefix_len + slot < S = %lld, got %lld + %lld at [%lld]", op, d, a, b, c);
        break;
    case HS_CE_VALUE_NAN: snprintf(buf, n, "%s: argument 'values' expected no NaN, got nan at [%lld]", op, a); break;
    case HS_CE_THRESH_NAN: snprintf(buf, n, "%s: argument 'thresholds' expected no NaN, got nan at [%lld]", op, a); break;
    case HS_CE_THRESH_ORDER:
        snprintf(buf, n, "%s: argument 'thresholds' expected strictly ascending values, got a value at [%lld] not above the one before",
                 op, a);
        break;
    case HS_CE_NO_MASS:
        snprintf(buf, n, "%s: argument '%s' expected a row with probability mass, got none at row %lld", op, lg, a);
        break;
    case HS_CE_ROOT_NEG:
        snprintf(buf, n, "%s: argument 'root_token' expected a token id >= 0, got %lld (row %lld)", op, a, b);
        break;
    case HS_CE_SIZE:
        snprintf(buf, n, "%s: argument 'n' expected a per-row size within the buffers (limit %lld), got %lld", op, b, a);
        break;
    case HS_CE_SLOT_PAD:
        snprintf(buf, n, "%s: argument 'slots' expected only -1 (padding) after the first -1, got %lld at [%lld] after -1 at [%lld]",
                 op, a, b, c);
        break;
    case HS_CE_PREFIX_NEG: snprintf(buf, n, "%s: argument 'prefix_len' expected >= 0, got %lld", op, a); break;
    default: snprintf(buf, n, "%s: device error code %llu (a=%lld b=%lld)", op, e->code, a, b); break;
    }
}

#ifdef HS_CUDA_EMU
/* ---- the emulation's launches: a block's CUDA threads as fibers ---------------------------------------------
 * One launch runs on the thread that makes it: block.x fibers (ucontext, each on a stack of its own) take turns,
 * each running until its next __syncthreads or until it has run every block's kernel body; a round robin over
 * the fibers is then exactly a barrier.  Before, every CUDA thread was a std::thread and __syncthreads a
 * std::barrier: each barrier woke 64-1024 OS threads on CI's 2 cores, and the sanitized op tests spent most of
 * their time in the kernel's futexes (benchmarks/RESULTS.md has the numbers).  Fibers run the
 * threads of a block in a fixed order between barriers, so the emulation no longer interleaves them at random;
 * a data race inside a block is compute-sanitizer's racecheck to find on a GPU (.ci/gpu's sanitizer phase). */
#include <sys/mman.h>
#include <ucontext.h>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define HS_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HS_EMU_ASAN 1
#endif
#endif
#ifdef HS_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace hs_emu {
thread_local dim3 thread_idx, block_idx;
thread_local dim3 block_dim, grid_dim;
thread_local char *smem;
thread_local unsigned long long lanes[1024];
std::atomic<long long> blocks_run{0};

/* 128 KB a fiber (the kernels keep small locals, and AddressSanitizer's redzones fit), above a guard page */
static const size_t FIBER_STACK = 128 * 1024, GUARD = 4096;

struct fiber {
    ucontext_t ctx;
    char *stack;
    unsigned block; /* the block it runs */
    int done;
};
struct launch {
    ucontext_t host; /* the launching thread's context, resumed between fibers */
    std::vector<fiber> f;
    unsigned cur, nblocks;
    size_t smem_bytes;
    void (*call)(void *);
    void *arg;
    const void *host_bottom; /* the launching thread's stack, for AddressSanitizer's fiber switches */
    size_t host_size;
};
static thread_local launch *now;
/* each launching thread keeps its fibers' stacks (mapped on first use, never unmapped: a few MB of address space
 * for 64 threads, 256 MB for the GPU's 1,024 of HETEROSPEC_EMU_BLOCKS=gpu, touched only as deep as used) */
static thread_local std::vector<char *> stacks;

__attribute__((noinline)) static void to_host(launch *L, int dying) {
#ifdef HS_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(dying ? nullptr : &fake, L->host_bottom, L->host_size);
#else
    (void)dying;
#endif
    swapcontext(&L->f[L->cur].ctx, &L->host);
#ifdef HS_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

/* Resume fiber t until its next sync() or its end (a function of its own: swapcontext returns twice, and the
 * scheduler's loop variables must not live in its frame) */
__attribute__((noinline)) static void to_fiber(launch *L, unsigned t) {
    L->cur = t;
    thread_idx = dim3(t);
    block_idx = dim3(L->f[t].block);
#ifdef HS_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, L->f[t].stack, FIBER_STACK);
#endif
    swapcontext(&L->host, &L->f[t].ctx);
#ifdef HS_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

static void fiber_main() {
    launch *L = now;
#ifdef HS_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &L->host_bottom, &L->host_size);
#endif
    const unsigned t = L->cur;
    for (unsigned b = 0; b < L->nblocks; b++) {
        L->f[t].block = b;
        block_idx = dim3(b);
        L->call(L->arg);
        sync(); /* every thread of block b is done */
        if (t == 0) memset(smem, 0xA5, L->smem_bytes + 16);
        sync(); /* the next block's shared memory is garbage again, as on a GPU */
    }
    L->f[t].done = 1;
    to_host(L, 1); /* never resumed */
    abort();
}

void sync() { to_host(now, 0); }

/* A fiber that starts in fiber_main on `stack` (getcontext returns twice: kept out of the caller's frame) */
__attribute__((noinline)) static void make_fiber(fiber *f, char *stack) {
    f->stack = stack;
    f->block = 0;
    f->done = 0;
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = stack;
    f->ctx.uc_stack.ss_size = FIBER_STACK;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, fiber_main, 0);
}

void run_blocks(dim3 grid, dim3 block, size_t smem_bytes, void (*call)(void *), void *arg) {
    std::vector<char> buf(smem_bytes + 16);
    launch L;
    memset(&L.host, 0, sizeof L.host); /* no stack of its own for AddressSanitizer's swapcontext to clear */
    L.f.resize(block.x);
    L.cur = 0;
    L.nblocks = grid.x;
    L.smem_bytes = smem_bytes;
    L.call = call;
    L.arg = arg;
    L.host_bottom = nullptr;
    L.host_size = 0;
    while (stacks.size() < block.x) {
        void *p = mmap(nullptr, GUARD + FIBER_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED || mprotect(p, GUARD, PROT_NONE) != 0) {
            fprintf(stderr, "heterospec: the CUDA emulation could not map a fiber stack\n");
            abort();
        }
        stacks.push_back((char *)p + GUARD);
    }
    launch *outer = now;
    now = &L;
    block_dim = block;
    grid_dim = grid;
    smem = buf.data();
    memset(buf.data(), 0xA5, buf.size());
    for (unsigned t = 0; t < block.x; t++) make_fiber(&L.f[t], stacks[t]);
    for (unsigned live = block.x; live > 0;) {
        for (unsigned t = 0; t < block.x; t++) {
            if (L.f[t].done) continue;
            to_fiber(&L, t);
            live -= L.f[t].done;
        }
    }
    now = outer;
}
}
#endif
