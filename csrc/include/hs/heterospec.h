/*
 * heterospec.h -- the public C API of the heterospec core.
 *
 * The core implements the tree operations of EAGLE-2/3 style speculative decoding and of HeteroSpec
 * (arXiv 2505.13254): top-k entropy (paper Eq. 1), one level of dynamic-tree expansion, Top-N reranking,
 * verification-tree construction, lossless greedy and sampled acceptance, KV-cache compaction and
 * entropy bucketing.  Exact semantics of every op: docs/ops.md (the NumPy twin heterospec/reference/
 * is the executable specification).
 *
 * Rules of this layer (see docs/design.md, "Layers"):
 *   - no Python.h, nothing from PyTorch: plain C11 over raw pointers with explicit sizes;
 *   - every function returns an hs_status and never exits, prints or allocates: scratch memory comes
 *     from a caller-provided workspace whose size a *_workspace_bytes function tells;
 *   - on failure, a human-readable message naming the offending argument is written to *err (if err is
 *     not NULL); the binding turns it into a Python exception;
 *   - batch-first: ops that walk one tree per request take a leading batch dimension with per-row sizes.
 *     Row b of a [batch, X, ...] buffer starts at b * X * ...; per-row sizes are <= X.
 *   - arrays are C-contiguous; "ids" may be int32 or int64 (hs_dtype), logits float16/bfloat16/float32,
 *     score-like inputs float32/float64.
 */
#ifndef HS_HETEROSPEC_H
#define HS_HETEROSPEC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HS_VERSION_MAJOR 0
#define HS_VERSION_MINOR 1
#define HS_VERSION_PATCH 0

typedef enum hs_status {
    HS_OK = 0,
    HS_ERR_VALUE = 1,     /* an argument's value is out of range / not ordered / not a tree */
    HS_ERR_NONFINITE = 2, /* NaN or +Inf (or an all -Inf row) where finite values are required */
    HS_ERR_DTYPE = 3,     /* a dtype this op does not take */
    HS_ERR_WORKSPACE = 4, /* the workspace is smaller than *_workspace_bytes asked for */
    HS_ERR_CUDA = 5,      /* a CUDA launch or runtime call failed (CUDA path only) */
} hs_status;

typedef enum hs_dtype {
    HS_FLOAT32 = 0,
    HS_FLOAT16 = 1,
    HS_BFLOAT16 = 2,
    HS_FLOAT64 = 3,
    HS_INT32 = 4,
    HS_INT64 = 5,
    HS_BOOL = 6,
} hs_dtype;

typedef struct hs_error {
    char msg[384];
} hs_error;

/* Size in bytes of one element of dtype (0 for an unknown dtype). */
size_t hs_dtype_size(hs_dtype dtype);
const char *hs_dtype_name(hs_dtype dtype);
const char *hs_version_string(void);

/* ---- entropy (paper Eq. 1, per-step term) ------------------------------------------------------ */

size_t hs_topk_entropy_workspace_bytes(int64_t k, int64_t V);

/* out[r] = -sum p ln p over softmax(top-k(logits[r]) / temperature), r < rows; logits [rows, V]. */
hs_status hs_topk_entropy(const void *logits, hs_dtype dtype, int64_t rows, int64_t V, int64_t k,
                          double temperature, float *out, void *ws, size_t ws_bytes, hs_error *err);

/* ---- dynamic tree ------------------------------------------------------------------------------- */

/* One level of EAGLE-2/3 expansion for `batch` requests of B beams each.
 *   logits [batch, B, Vd]; beam_scores [batch, B] (float32/64); beam_nodes [batch, B] (int32/64);
 *   d2t [Vd] (int32/64) or NULL.
 *   out_tokens, out_parents [batch, B*k] int64; out_scores [batch, B*k] float32;
 *   out_entropy [batch, B] float32; out_next_beams [batch, k] int64 (node numbers).
 * Workspace: hs_expand_workspace_bytes(B, k, Vd). */
size_t hs_expand_workspace_bytes(int64_t B, int64_t k, int64_t Vd);
hs_status hs_expand(const void *logits, hs_dtype logit_dtype, int64_t batch, int64_t B, int64_t Vd,
                    const void *beam_scores, hs_dtype score_dtype, const void *beam_nodes,
                    hs_dtype node_dtype, int64_t k, const void *d2t, hs_dtype d2t_dtype,
                    int64_t node_offset, int64_t *out_tokens, float *out_scores, int64_t *out_parents,
                    float *out_entropy, int64_t *out_next_beams, void *ws, size_t ws_bytes,
                    hs_error *err);

/* Top-n selection: per row b, the indices of the n[b] highest of scores[b, :m[b]] (ties to the lower
 * index), ascending.  scores [batch, M]; m, n [batch] (m == NULL: every row has M entries);
 * out [batch, N] int64 with N >= max n. Workspace: hs_select_workspace_bytes(M). */
size_t hs_select_workspace_bytes(int64_t M);
hs_status hs_select(const void *scores, hs_dtype score_dtype, int64_t batch, int64_t M,
                    const int64_t *m, const int64_t *n, int64_t N, int64_t *out, void *ws,
                    size_t ws_bytes, hs_error *err);

/* Verification tree from a selection of candidates.
 *   tokens, parents [batch, M] (int32/64); selected [batch, N] (int32/64) with n[b] <= N valid entries;
 *   root_tokens [batch] int64.
 *   out_tokens, out_parents, out_depths [batch, N+1] int64; out_mask [batch, N+1, N+1] bool (uint8);
 *   out_num_leaves, out_max_depth [batch] int64.
 * Rows of the outputs past n[b]+1 are left untouched.  Workspace: hs_build_tree_workspace_bytes(M). */
size_t hs_build_tree_workspace_bytes(int64_t M);
hs_status hs_build_tree(const void *tokens, hs_dtype token_dtype, const void *parents, hs_dtype parent_dtype,
                        int64_t batch,
                        int64_t M, const void *selected, hs_dtype sel_dtype, int64_t N,
                        const int64_t *n, const int64_t *root_tokens, int64_t *out_tokens,
                        int64_t *out_parents, int64_t *out_depths, uint8_t *out_mask,
                        int64_t *out_num_leaves, int64_t *out_max_depth, void *ws, size_t ws_bytes,
                        hs_error *err);

/* Retrieve paths of trees made by hs_build_tree: parents, depths [batch, T] with t[b] <= T nodes;
 * out [batch, L, D1] int64 (L >= leaves, D1 >= max depth + 1); rows past the leaves of a tree and
 * columns past its max depth + 1 are filled with -1.  Workspace: hs_tree_retrieve_workspace_bytes(T). */
size_t hs_tree_retrieve_workspace_bytes(int64_t T);
hs_status hs_tree_retrieve(const int64_t *parents, const int64_t *depths, int64_t batch, int64_t T,
                           const int64_t *t, int64_t L, int64_t D1, int64_t *out, void *ws,
                           size_t ws_bytes, hs_error *err);

/* ---- acceptance ---------------------------------------------------------------------------------- */

/* Greedy acceptance. tree_tokens, tree_parents [batch, T] (int32/64), n [batch] nodes per row,
 * logits [batch, T, V]. out_path [batch, T] int64 (first out_len[b] entries valid), out_len [batch],
 * out_next [batch]. */
hs_status hs_verify_greedy(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                           hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n, const void *logits,
                           hs_dtype logit_dtype, int64_t V, int64_t *out_path, int64_t *out_len,
                           int64_t *out_next, hs_error *err);

/* The smallest temperature the ops take (topk_entropy, verify_sample): every finite logit of the supported dtypes
 * (|x| <= 3.4e38, float32's largest) divided by it stays finite in float64 (3.4e68), so z - max z is never
 * inf - inf.  Below it, use greedy decoding (docs/ops.md). */
#define HS_MIN_TEMPERATURE 1e-30

typedef struct hs_sampling {
    double temperature; /* >= HS_MIN_TEMPERATURE */
    int64_t top_k;      /* 0 = off */
    double top_p;       /* (0, 1]; 1 = off */
    double min_p;       /* [0, 1]; 0 = off: after top-k and top-p, tokens below min_p times the largest probability go */
} hs_sampling;

/* Lossless recursive rejection sampling over the tree (point-mass sibling proposals), uniforms from
 * Philox4x32-10 keyed by seeds[b], counter offsets[b] + draw index.  Same buffers as hs_verify_greedy
 * plus out_draws [batch].  Workspace: hs_verify_sample_workspace_bytes(T, V). */
size_t hs_verify_sample_workspace_bytes(int64_t T, int64_t V);
hs_status hs_verify_sample(const void *tree_tokens, hs_dtype token_dtype, const void *tree_parents,
                           hs_dtype parent_dtype, int64_t batch, int64_t T, const int64_t *n, const void *logits,
                           hs_dtype logit_dtype, int64_t V, hs_sampling params,
                           const uint64_t *seeds, const uint64_t *offsets, int64_t *out_path,
                           int64_t *out_len, int64_t *out_next, int64_t *out_draws, void *ws,
                           size_t ws_bytes, hs_error *err);

/* Philox4x32-10 (Random123): out = bijection(ctr, key). */
void hs_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
/* u_j = x0 * 2^-32 of Philox4x32-10(counter=(offset+j) as (lo, hi, 0, 0), key=(seed lo, seed hi)). */
double hs_philox_uniform(uint64_t seed, uint64_t offset, uint64_t j);

/* ---- KV cache ------------------------------------------------------------------------------------ */

/* In place, for `batch` requests: data is [batch, inner, S, row_bytes] (bytes); for request b and every
 * inner index, row prefix_len[b] + i <- row prefix_len[b] + slots[b, i] for i < m[b] in order.
 * slots [batch, SM] (int32/64) strictly ascending with slots[b, i] >= i and prefix_len[b] + last < S.
 * Padding: of the first m[b] entries of a row, those from the first -1 on are ignored (they must all be
 * -1), so a -1-padded accepted path can be passed as is.  slots must not overlap data. */
hs_status hs_kv_compact(void *data, int64_t batch, int64_t inner, int64_t S, int64_t row_bytes,
                        const int64_t *prefix_len, const void *slots, hs_dtype slot_dtype, int64_t SM,
                        const int64_t *m, hs_error *err);

/* Checks the slots of hs_kv_compact against S without touching data (so a caller compacting many
 * tensors can validate once and fail before modifying any of them).  S = INT64_MAX: no bound (no tensors). */
hs_status hs_kv_compact_check(int64_t batch, int64_t S, const int64_t *prefix_len, const void *slots,
                              hs_dtype slot_dtype, int64_t SM, const int64_t *m, hs_error *err);

/* ---- bucketing ----------------------------------------------------------------------------------- */

/* out[i] = number of thresholds s with values[i] > s; thresholds strictly ascending. */
hs_status hs_bucketize(const void *values, hs_dtype value_dtype, int64_t N, const void *thresholds,
                       hs_dtype threshold_dtype, int64_t T, int32_t *out, hs_error *err);

#ifdef __cplusplus
}
#endif
#endif /* HS_HETEROSPEC_H */
