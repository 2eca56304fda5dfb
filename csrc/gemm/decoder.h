/*
 * decoder.h -- a decoder-only transformer's forward on the CPU in float32 (the Llama family; GPT-NeoX and GPT-2
 * through hsd_model's arch, act and rot) (heterospec._gemm; cpu_decoder in
 * heterospec/models/cpu_decoder.py): every layer of the target in one call, over the rows of a verification
 * tree, a one-token step or a prompt, reading and writing the engine's own key/value cache.
 *
 * Why: on a 2-core Xeon a one-token forward of SmolLM2-135M through transformers took 52 ms, of which the linear
 * layers (the few-rows kernel, rows.h) were 24.5 ms; the rest was some 1,400 small torch operations and their
 * Python calls.  Here a layer is a handful of loops between the matrix products.
 *
 * What a layer computes, row by row (r: a row of the call; the model's own weights and epsilon):
 *   x = rmsnorm(h, ln1);  qkv = x [Wq; Wk; Wv]^T (+ bias);  q, k per head: rmsnorm(., q_norm / k_norm) where the
 *   model has them (Qwen3), then rotated (q * cos + rotate_half(q) * sin, the cos/sin rows given);  k and v
 *   written to the cache at (request req[r], column slot[r]);  then per head: softmax(q . k_j * scale) over the
 *   columns j that allowed[r] marks, in column order, times v_j;  h += o (+ bias);  x = rmsnorm(h, ln2);
 *   h += down(silu(gate(x)) * up(x)).  At the end the last `keep` rows: rmsnorm(h, final) then the output layer.
 * The other layouts (hsd_model's arch, act, rot): LayerNorm with its bias in place of every rmsnorm
 * (HSD_LAYERNORM: y = w * ((x - mean) * (1 / sqrt(var + eps))) + b, mean a 16-lane sum / d, var dot(x - mean) / d);
 * an MLP of one matrix before the activation, gelu (erf), gelu's tanh form or relu, instead of silu(gate) * up
 * (act); the rotation over the first rot dimensions of each head only (0: none, positions learned outside), of
 * pairs of neighbours with HSD_ROT_PAIRS (GPT-J: x * cos + rotate_every_two(x) * sin, rotate_every_two(x) = (-x1,
 * x0, -x3, x2, ...), cos and sin repeated per pair); and GPT-NeoX's parallel residual (HSD_PARALLEL: h = (mlp(norm2(h))
 * + attn(norm1(h))) + h, both from the layer's input; with HSD_SHARED_NORM the MLP reads norm1's rows too, Phi and
 * GPT-J have one norm a layer).  Gemma's: gelu's tanh form of the gate times up (HSD_GELU_TANH_GLU), norms of the
 * attention's and the MLP's outputs before each residual add (HSD_POST_ATTN, HSD_POST_MLP), sliding layers among
 * full ones reading their own columns and rotation (HSD_LOCAL, hsd_local), soft-capped scores and logits
 * (attn_cap, final_cap); its norms' 1 + w and its embeddings' factor are the caller's.  OLMo 2's and 3's: no
 * norm before attention or MLP (HSD_POST_ONLY: they read h itself; the post norms do the norming), and q_norm and
 * k_norm over all heads of q and of k at once (HSD_QK_NORM_ALL: widths heads * head_dim and kv_heads * head_dim),
 * before the rotation.  Granite's: each residual add scaled (h + o * res_mult) and the logits divided (logit_div); its
 * embeddings' multiplier and attention_multiplier (the scale) are the caller's.  Cohere's: the parallel residual summed
 * from h (HSD_H_FIRST with HSD_PARALLEL: h = (h + attn) + mlp, its order), LayerNorms without bias, the logits
 * multiplied (logit_mult).  HunYuan's: q_norm and k_norm after the rotation (HSD_QK_NORM_AFTER).
 * Mixture-of-experts layers (HSD_ROUTER: Mixtral, Qwen2/3-MoE, OLMoE, Granite MoE): the
 * MLP's rows go to the top_k experts of a router (x R^T, E logits; ties to the lower index), weighted by the softmax
 * of all E logits at those experts (divided by their sum with HSD_MOE_NORM), or by the softmax of the top_k logits
 * alone (HSD_MOE_TOPK_SOFTMAX, Granite's); each expert a SiLU-gated MLP of moe_inter; out = 0, then out + (y_e * w_e)
 * for each chosen expert e in ascending order (transformers' index_add_ in its loop over experts), then, where the
 * layer has a dense MLP too (Qwen2-MoE's shared expert), out + (sigmoid(x . g) * mlp(x)) (g: HSD_SHARED_GATE).
 *
 * Every reduction has one fixed order, the same on AVX-512, AVX2 and the portable loop, and no row's result
 * depends on another row: a dot product of length d is 16 lanes (lane l sums elements l, l+16, ... by fused
 * multiply-adds in order) added as a fixed tree (l + l+8, then + l+4, + l+2, + l+1); exp is one polynomial
 * (hsd_exp); the softmax's sum and each output element are chains over the allowed columns in order.  So a
 * tree node's logits are bit for bit what a one-row step over the same keys gives (the cache holds the same
 * keys in the same order once the node's ancestors are committed), on every instruction set and thread count.
 */
#ifndef HS_GEMM_DECODER_H
#define HS_GEMM_DECODER_H

#include <stdint.h>

/* One layer's weights: packed (rows.h, any codec) [q; k; v], o, [gate; up], down, with their biases or NULL; the norms;
 * HSD_NO_ROT, a flag, not an address: nonzero where the layer does not rotate q and k (SmolLM3's NoPE layers);
 * HSD_POST_ATTN and HSD_POST_MLP: norms (the layer's kind, no bias) of the attention's and the MLP's outputs before
 * each is added to the residual stream, or 0 (Gemma 2 and 3's sandwich: h += norm(o); h += norm(mlp(norm2(h))));
 * HSD_LOCAL, a flag: nonzero where the layer reads the call's local rows (hsd_local: a sliding window's columns and
 * its own rotation tables; Gemma 2 and 3's sliding layers).  A mixture-of-experts layer: HSD_ROUTER the packed
 * router [experts x hidden] (0: a dense layer), HSD_EXPERTS the address of int64 [experts][2]: each expert's packed
 * [gate; up] [2 * moe_inter x hidden] and down [hidden x moe_inter]; GU and DOWN then 0, or a shared expert (of
 * inter) with HSD_SHARED_GATE its packed gate [1 x hidden]. */
enum {
    HSD_LN1, HSD_LN2, HSD_QKV, HSD_QKV_B, HSD_Q_NORM, HSD_K_NORM, HSD_O, HSD_O_B, HSD_GU, HSD_GU_B, HSD_DOWN,
    HSD_DOWN_B, HSD_LN1_B, HSD_LN2_B, HSD_NO_ROT, HSD_POST_ATTN, HSD_POST_MLP, HSD_LOCAL, HSD_ROUTER, HSD_EXPERTS,
    HSD_SHARED_GATE, HSD_FIELDS
};

/* hsd_model.arch bits and hsd_model.act values (a decoder's layout; the draft's layout is 0 and HSD_SILU_GLU):
 * GU holds [gate; up] (2 * inter rows) for HSD_SILU_GLU and HSD_GELU_TANH_GLU (gelu's tanh form of the gate times up:
 * Gemma's GeGLU), the one matrix before the activation (inter rows) else. */
enum { HSD_LAYERNORM = 1, HSD_PARALLEL = 2, HSD_SHARED_NORM = 4, HSD_ROT_PAIRS = 8, HSD_POST_ONLY = 16,
       HSD_QK_NORM_ALL = 32, HSD_H_FIRST = 64, HSD_QK_NORM_AFTER = 128 };
/* hsd_model.moe bits: the routing weights renormalised over the chosen experts; the softmax of the chosen logits */
enum { HSD_MOE_NORM = 1, HSD_MOE_TOPK_SOFTMAX = 2 };
enum { HSD_SILU_GLU = 0, HSD_GELU = 1, HSD_GELU_TANH = 2, HSD_RELU = 3, HSD_GELU_TANH_GLU = 4 };
#define HSD_GATED(act) ((act) == HSD_SILU_GLU || (act) == HSD_GELU_TANH_GLU)

/* The EAGLE-3 draft's layout (hsd_model.hidden_norm set): its one layer's attention input is 2*hidden wide,
 * [rmsnorm(e, ln1); rmsnorm(h, hidden_norm)] (e: the tokens' embeddings, h: the fed-in states), and its residual
 * stream starts at h, or at rmsnorm(h, hidden_norm) with HSD_RESIDUAL_NORMED.  The output layer reads the final
 * norm's rows, or the raw rows with HSD_HEAD_RAW; the state returned per kept row (hout) is the raw row, or the
 * final norm's with HSD_OUT_NORMED. */
enum { HSD_RESIDUAL_NORMED = 1, HSD_HEAD_RAW = 2, HSD_OUT_NORMED = 4 };

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    float eps, scale;
    const int64_t *table;       /* [layers][HSD_FIELDS] addresses (0: absent) */
    const float *final_norm;    /* [hidden] */
    const float *head, *head_b; /* packed output layer [vocab x hidden], its bias or NULL */
    const float *hidden_norm;   /* NULL: a decoder; else the EAGLE-3 draft's layout (one layer; q/k/v 2*hidden in) */
    int flags;                  /* HSD_RESIDUAL_NORMED | HSD_HEAD_RAW | HSD_OUT_NORMED (0 for a decoder) */
    /* the draft's fusion of the target's taps (NULL / 0 without): packed fc [hidden x fc_in] and its bias; the
     * norms before it: in_norm [fc_in] over the whole row, then fc_norms [fc_in] over each third of it */
    const float *fc, *fc_b, *in_norm, *fc_norms;
    int64_t fc_in;
    const float *final_norm_b;  /* the final LayerNorm's bias or NULL */
    int arch, act;              /* HSD_LAYERNORM | HSD_PARALLEL | HSD_SHARED_NORM | HSD_ROT_PAIRS | HSD_POST_ONLY |
                                 * HSD_QK_NORM_ALL | HSD_H_FIRST | HSD_QK_NORM_AFTER; HSD_SILU_GLU,
                                 * HSD_GELU, HSD_GELU_TANH or HSD_RELU */
    int64_t rot;                /* the rotated dimensions of each head (even, <= head_dim; 0: none) */
    /* soft-capping (Gemma 2), 0: none: each attention score s (after the scale) and each logit of the output layer
     * becomes cap * tanh(s / cap), tanh(y) = 2 / (1 + exp(-2 y)) - 1 (hsd_softcap) */
    float attn_cap, final_cap;
    /* Granite's multipliers (1: none): each residual add is h + (out * res_mult), the product rounded first (sequential
     * layers only), and each logit of the output layer is divided by logit_div before any soft-capping; Cohere's:
     * each logit multiplied by logit_mult (before the division) */
    float res_mult, logit_div, logit_mult;
    /* mixture of experts (0 experts: none; the layers with HSD_ROUTER): experts, chosen per row, their MLPs' width,
     * HSD_MOE_NORM | HSD_MOE_TOPK_SOFTMAX; the experts' MLPs are SiLU-gated (act HSD_SILU_GLU) */
    int64_t experts, top_k, moe_inter;
    int moe;
} hsd_model;

/* A call's rows for the layers marked HSD_LOCAL: allowed [n][W] (the columns each row sees there: a sliding
 * window's) and the rotation tables cos, sin [n][rot] (NULL: the call's own). */
typedef struct {
    const uint8_t *allowed;
    const float *cos, *sin;
} hsd_local;

typedef struct {
    float *kv;                       /* the cache: [B][2][layers][kv_heads][capacity][head_dim] */
    int64_t batch, capacity;         /* its rows and columns */
    int64_t s_batch, s_kv, s_layer, s_head; /* strides in floats (a column is head_dim floats) */
} hsd_cache;

/* One forward over n rows (local: the rows of the HSD_LOCAL layers, NULL where no layer is one).  h: [n][hidden],
 * the embeddings in (the draft: the fed-in states; emb its tokens' embeddings [n][hidden], else NULL), the residual
 * stream out; fuse (the draft with fc only; NULL: h is given):
 * [n][fc_in] the target's taps, h written from them first (the norms in_norm then fc_norms where set, each rows'
 * rmsnorm, then fc, rows.h's kernel); cos/sin: [n][rot] (not read with rot 0);
 * req, slot: [n] (the cache row and column each row's keys and values go to); allowed: [n][W] (1: row r attends
 * to column j of its request's cache; W <= capacity); taps: three [n][hidden] buffers or NULLs, filled with h
 * entering layers tap_layers[0..2]; logits: [keep][vocab] for rows out_rows[0..keep) (NULL: the last keep rows;
 * keep <= n; 0: none), and hout: [keep][hidden] those rows' states (see HSD_OUT_NORMED) or NULL.  bad (NULL: none):
 * bad[req[r]] is set to 1 where a kept row r's logits are not finite (a NaN, a +inf, or every value -inf:
 * hsd_nonfinite), counting only the rows with r % per < nreal[req[r]] when nreal is given (the rows of each
 * request one after another, per of them: each request's first nreal rows are real, the rest padding).  Returns 0, or
 * -1 for a req, slot, out_rows entry or W out of range, the draft's layout without emb or with layers != 1, or
 * fuse without fc, a mixture-of-experts layout it cannot take (nothing written then), -2 for an allocation failure, -3
 * for a weight whose packed copy (rows.h) is not of its shape (nothing written either). */
int hsd_forward(const hsd_model *m, const hsd_cache *c, float *h, const float *emb, const float *fuse, int64_t n,
                const float *cos, const float *sin, const int64_t *req, const int64_t *slot, const uint8_t *allowed,
                int64_t W, const hsd_local *local, const int64_t *tap_layers, float *const *taps,
                const int64_t *out_rows, int64_t keep, float *logits, float *hout, int64_t *bad, const int64_t *nreal,
                int64_t per, int isa, int threads);

/* The pieces, exposed for the tests (heterospec.reference.decoder holds each to a NumPy twin). */
int hsd_nonfinite(const float *x, int64_t V); /* 1: x[0..V) holds a NaN or a +inf, or is all -inf */
float hsd_dot(const float *a, const float *b, int64_t d, int isa);
void hsd_exp(float *x, int64_t n, int isa);
void hsd_rmsnorm(const float *x, const float *w, float *y, int64_t d, float eps, int isa);
void hsd_layernorm(const float *x, const float *w, const float *b, float *y, int64_t d, float eps, int isa);
void hsd_act(int act, const float *g, float *y, int64_t n, int isa); /* y = gelu(g), its tanh form, relu (y not g) */
void hsd_softcap(float *x, int64_t n, float cap, int isa);          /* x = cap * tanh(x / cap) in place */
void hsd_attend(const float *q, const float *k, const float *v, int64_t stride, const uint8_t *allowed, int64_t W,
                float scale, float cap, float *out, int64_t d, float *scores, int64_t *cols, int isa);

#endif
