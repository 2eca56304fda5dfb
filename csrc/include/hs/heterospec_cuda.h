/*
 * heterospec_cuda.h -- the CUDA twins of the core ops (kernels in csrc/cuda/, one file per op family as in
 * csrc/core/: entropy.cu, tree.cu, verify.cu, kv.cu; the split-row machinery they share in rows.cuh / rows.cu).
 *
 * Same names with an hs_cuda_ prefix, same semantics and the same batch-first buffers as heterospec.h,
 * with these differences, all of them for speed on a GPU and for CUDA-graph capture:
 *   - every pointer is a device pointer; per-row sizes
 *     (n, m) are device arrays or NULL for "the full size";
 *   - `stream` is a cudaStream_t passed as void* (this header needs no CUDA include); every function only
 *     enqueues work on it: no synchronisation, no allocation, so calls can be captured in a CUDA graph;
 *   - scratch memory comes from the caller: hs_cuda_*_workspace_bytes say how much (0 for most ops);
 *   - value checks (NaN logits, a non-closed selection, unordered slots...) run on the device: the first
 *     failing thread records a code and its numbers in *err, an hs_cuda_error in device memory; the host
 *     copies it back after the work and turns it into a message with hs_cuda_error_message.  Outputs of a call
 *     that recorded an error are unspecified (never out-of-bounds writes).
 *   - the return value is HS_OK, a host-side argument error (message in *herr), or HS_ERR_CUDA with the
 *     CUDA error string in *herr when a launch failed.
 * Size limits of the CUDA path (host-checked): expand k <= 1024 and B * k <= 65536; trees of at most
 * HS_CUDA_MAX_NODES nodes (build_tree n + 1, verify_* T).
 */
#ifndef HS_HETEROSPEC_CUDA_H
#define HS_HETEROSPEC_CUDA_H

#include "hs/heterospec.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HS_CUDA_MAX_NODES 4096

typedef struct hs_cuda_error {
    unsigned long long code; /* 0 = no error; see hs_cuda_error_message */
    long long a, b, c, d;
} hs_cuda_error;

/* "argument 'x' expected ..., got ..." for a recorded device error, for op `op`. */
void hs_cuda_error_message(const hs_cuda_error *e, const char *op, char *buf, size_t n);

/* Largest block any kernel uses (the emulated build uses fewer threads). */
int hs_cuda_max_threads(void);
/* The chunks each of `rows` rows of V entries is cut into by the split-row kernels (a diagnostic for tests). */
int64_t hs_cuda_chunks(int64_t rows, int64_t V);
/* The fewest entries a chunk holds (rows shorter than that are one chunk): 1024 on a GPU build, 256 in the
 * emulation.  Setting it (n >= 1; 0 restores the default) changes the launches made from then on, in every thread
 * (a CUDA graph keeps the geometry it captured); returns the value it replaces.  A tuning knob for probes. */
int64_t hs_cuda_set_chunk_min(int64_t n);

/* Workspace: the split path's partials and candidates (k <= 256; 0 otherwise). */
size_t hs_cuda_topk_entropy_workspace_bytes(int64_t rows, int64_t k, int64_t V);
hs_status hs_cuda_topk_entropy(const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
                               double temperature, float *out, void *ws, size_t ws_bytes, hs_cuda_error *err,
                               void *stream, hs_error *herr);

/* Workspace: one counter per batch row in the first 64 KB per 16384 rows (zero once; the kernel leaves it
 * zero), then the split path's partials and candidates (see hs_cuda_expand_workspace_bytes). */
size_t hs_cuda_expand_workspace_bytes(int64_t batch, int64_t B, int64_t k, int64_t Vd);
hs_status hs_cuda_expand(const void *logits, hs_dtype logit_dtype, int64_t batch, int64_t B, int64_t Vd,
                         const void *beam_scores, hs_dtype score_dtype, const void *beam_nodes,
                         hs_dtype node_dtype, int64_t k, const void *d2t, hs_dtype d2t_dtype,
                         int64_t node_offset, int64_t *out_tokens, float *out_scores, int64_t *out_parents,
                         float *out_entropy, int64_t *out_next_beams, void *ws, size_t ws_bytes,
                         hs_cuda_error *err, void *stream, hs_error *herr);

/* n_dev[b] (NULL: N for every row) <= m_dev[b] (NULL: M); out [batch, N]. */
hs_status hs_cuda_select(const void *scores, hs_dtype score_dtype, int64_t batch, int64_t M,
                         const int64_t *m_dev, const int64_t *n_dev, int64_t N, int64_t *out,
                         hs_cuda_error *err, void *stream, hs_error *herr);

/* As hs_build_tree (n_dev NULL: N for every row; root_dev [batch] on the device, or NULL for root_token in every row), plus
 * out_retrieve [batch, N+1, N+1]: one row per leaf in ascending node order, root -> leaf, padded with -1
 * (rows past the leaves all -1), i.e. hs_tree_retrieve's output at L = D1 = N+1. */
hs_status hs_cuda_build_tree(const void *tokens, hs_dtype token_dtype, const void *parents,
                             hs_dtype parent_dtype, int64_t batch, int64_t M, const void *selected,
                             hs_dtype sel_dtype, int64_t N, const int64_t *n_dev, const int64_t *root_dev,
                             int64_t root_token, int64_t *out_tokens, int64_t *out_parents, int64_t *out_depths, uint8_t *out_mask,
                             int64_t *out_num_leaves, int64_t *out_max_depth, int64_t *out_retrieve,
                             hs_cuda_error *err, void *stream, hs_error *herr);

/* Workspace: per-row (and per-chunk) argmax results for every node of every tree. out_path [batch, T] is filled with -1
 * past out_len[b]. n_dev NULL: T nodes in every row. */
size_t hs_cuda_verify_greedy_workspace_bytes(int64_t batch, int64_t T, int64_t V);
hs_status hs_cuda_verify_greedy(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                                hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n_dev,
                                const void *logits, hs_dtype logit_dtype, int64_t V, int64_t *out_path,
                                int64_t *out_len, int64_t *out_next, void *ws, size_t ws_bytes,
                                hs_cuda_error *err, void *stream, hs_error *herr);

/* Seeds and offsets: device arrays [batch] (seeds_dev / offsets_dev), or NULL to use the host values
 * seed / offset for every row.  With advance_offsets, offsets_dev[b] += draws after the walk, so a
 * replayed CUDA graph draws fresh uniforms each time. */
size_t hs_cuda_verify_sample_workspace_bytes(int64_t batch, int64_t T, int64_t V);
hs_status hs_cuda_verify_sample(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                                hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n_dev,
                                const void *logits, hs_dtype logit_dtype, int64_t V, hs_sampling params,
                                const uint64_t *seeds_dev, uint64_t seed, uint64_t *offsets_dev,
                                uint64_t offset, int advance_offsets, int64_t *out_path, int64_t *out_len,
                                int64_t *out_next, int64_t *out_draws, void *ws, size_t ws_bytes,
                                hs_cuda_error *err, void *stream, hs_error *herr);

/* One tensor of a kv_compact call: [inner, S, row_bytes] bytes at data. */
typedef struct hs_kv_tensor {
    void *data;
    int64_t inner, S, row_bytes;
} hs_kv_tensor;
#define HS_CUDA_KV_MAX_TENSORS 64 /* per launch; hs_cuda_kv_compact launches once per 64 tensors */

/* Every tensor in one launch, for `batch` requests: slots [batch, m] on the device, each row -1-padded as in
 * hs_kv_compact, checked on the device against every tensor's S before any row moves (a bad slot list moves
 * nothing); each tensor is [batch * inner', S, row_bytes] (its leading rows in request order, inner a multiple
 * of batch).  prefix_dev: device int64 [batch] read by the kernel when it runs (so a captured graph sees the
 * current values; a negative one is a recorded error), or NULL for the host value prefix_len in every row.
 * slots and *prefix_dev must not overlap a tensor (the binding refuses it); even then every row index is
 * bounds-checked before it is written. */
hs_status hs_cuda_kv_compact(const hs_kv_tensor *tensors, int64_t count, int64_t batch, const int64_t *prefix_dev,
                             int64_t prefix_len, const void *slots, hs_dtype slot_dtype, int64_t m, hs_cuda_error *err,
                             void *stream, hs_error *herr);

hs_status hs_cuda_bucketize(const void *values, hs_dtype value_dtype, int64_t N, const void *thresholds,
                            hs_dtype threshold_dtype, int64_t T, int32_t *out, hs_cuda_error *err, void *stream,
                            hs_error *herr);

/* ---- runtime glue for the binding (csrc/cuda/runtime.cu) ------------------------------------------- */

/* Number of CUDA devices usable now (0 without a driver or a GPU); *why says why when 0. */
int hs_cuda_device_count(char *why, size_t n);
/* Run with device `dev` current; returns the previous device or -1 with *herr set. */
int hs_cuda_set_device(int dev, hs_error *herr);
/* Is `stream` capturing a graph now? (1/0, -1 on error) */
int hs_cuda_stream_capturing(void *stream, hs_error *herr);
/* A new non-blocking stream on the current device, never destroyed by the module (the engine hands it from one
 * recorded set of graphs to the next); NULL with *herr set on failure.  The emulation gives distinct tokens. */
void *hs_cuda_stream_new(hs_error *herr);
/* Error record of device `dev` in device memory, created on first use; *host_view is its pinned host
 * mirror, valid after hs_cuda_error_fetch. */
hs_cuda_error *hs_cuda_error_record(int dev, hs_cuda_error **host_view, hs_error *herr);
/* Copy the record to its host mirror on `stream` and synchronise the stream. */
hs_status hs_cuda_error_fetch(int dev, void *stream, hs_error *herr);
/* Zero the record and its mirror (after a recorded error was raised); synchronises `stream`. */
hs_status hs_cuda_error_clear(int dev, void *stream, hs_error *herr);
/* A device buffer of >= bytes, owned by the module, per device and grown on demand (zeroed when grown).
 * Growing is refused while `stream` is capturing a graph. */
void *hs_cuda_workspace(int dev, size_t bytes, void *stream, hs_error *herr);
/* The workspace's size and how many earlier (smaller) workspaces are kept alive for recorded graphs. */
void hs_cuda_workspace_info(int dev, size_t *bytes, int *retired);
/* Copy bytes device -> host on stream and wait for it. */
hs_status hs_cuda_memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream, hs_error *herr);
/* "sm_80,sm_90,compute_90" etc.: what the fat binary holds; the CUDA runtime version. */
const char *hs_cuda_archs(void);
int hs_cuda_runtime_version(void);
int hs_cuda_emulated(void);
/* The emulated build: kernel blocks run since the library loaded (-1 in a real CUDA build). */
long long hs_cuda_emu_blocks(void);

#ifdef __cplusplus
}
#endif
#endif /* HS_HETEROSPEC_CUDA_H */
