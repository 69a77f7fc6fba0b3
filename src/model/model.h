/* model — architectures (llama, qwen2, qwen3; mistral and TinyLlama are
 * llama; the mixtures of experts qwen3moe, glm4moe and deepseek2 (MLA); the
 * hybrid recurrent qwen35moe and its dense qwen35, gated delta net + gated attention) as one forward pass over *this rank's slice* of every weight, and
 * the KV cache for the slice's KV heads (and the recurrent state of its linear-attention heads).
 *
 * The same code runs one node (slice = everything, no hooks) and every rank
 * of a tensor/pipeline-parallel cluster: the slice (parallel/parallel.h) says
 * which layers, query heads, KV heads, FFN rows and vocabulary rows this rank
 * owns, and the TP hook all-reduces the hidden vector after the attention
 * output projection and after the FFN down projection (2 per layer).
 *
 * Weights: the matrices this rank multiplies are copied at load, compacted
 * to its slice, into a huge-page arena (their file pages are dropped, so
 * memory is not doubled; LK_WEIGHTS=mmap keeps views into the mapping); norms,
 * biases and the embedding table are read from the GGUF mapping. A worker
 * that received its slices over the network maps a sparse copy of the file
 * holding only the bytes lk_model_slice_bytes lists.
 * All scratch is sized at load (for n_batch tokens); the forward pass
 * allocates nothing.
 *
 * Threading: one thread drives an lk_model (calls forward); it fans work out
 * to its own thread pool. */
#ifndef LK_MODEL_H
#define LK_MODEL_H

#include "common/lk_common.h"
#include "gguf/gguf.h"
#include "parallel/parallel.h"
#include "kernels/kernels.h"

typedef enum { LK_ARCH_LLAMA, LK_ARCH_QWEN2, LK_ARCH_QWEN3, LK_ARCH_QWEN3MOE, LK_ARCH_GLM4MOE, LK_ARCH_DEEPSEEK2,
               LK_ARCH_QWEN35MOE, LK_ARCH_QWEN35, LK_ARCH_GEMMA3 } lk_arch;

enum { LK_MAX_LAYERS = 4096 };

/* How a mixture-of-experts layer turns router logits into expert weights
 * (llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid). */
typedef enum { LK_GATE_SOFTMAX = 1, LK_GATE_SIGMOID = 2 } lk_gating;

typedef struct {
    lk_arch arch;
    char    arch_name[32];
    int     n_embd, n_layer, n_head, n_head_kv, head_dim; /* head_dim = key/value length */
    int64_t n_ff, n_vocab;
    int     n_ctx_train;
    float   rms_eps;
    float   rope_base;
    int     rope_dim;         /* dimensions rotated per head */
    bool    rope_neox;        /* NeoX halves (qwen2/3) vs adjacent pairs (llama) */
    bool    has_rope_freqs;   /* llama3 rope_freqs.weight factors */
    bool    tied_output;      /* output = token_embd */
    bool    has_qkv_bias;     /* qwen2 */
    bool    has_qk_norm;      /* qwen3, qwen3moe, glm4moe (optional there) */
    /* Mixture of experts (n_expert = 0: dense). Layers [0, n_dense_lead)
     * have a dense SwiGLU FFN of n_ff rows; the others route each token to
     * n_expert_used of n_expert experts of n_ff_exp rows (3-D tensors
     * ffn_{gate,up,down}_exps, expert e = slab e) and add a shared expert of
     * n_ff_shexp rows when n_expert_shared > 0. Routing: logits =
     * ffn_gate_inp . h; p = softmax or sigmoid of them; the top n_expert_used
     * of p (+ exp_probs_b when present: the bias only chooses); weights = the
     * chosen p, divided by their sum when weights_norm, times weights_scale
     * when it is neither 0 nor 1. */
    int     n_expert, n_expert_used, n_expert_shared, n_dense_lead;
    int64_t n_ff_exp, n_ff_shexp;
    lk_gating gating;
    bool    weights_norm;
    float   weights_scale;
    bool    has_exp_probs_b;
    int     n_layer_file;     /* block_count: n_layer + NextN (MTP) blocks, never run */
    /* Group-limited routing (deepseek2): experts in n_expert_group groups of
     * consecutive ids; a group scores the sum of its best two selection
     * scores, only the best n_group_used groups compete (1: no groups). */
    int     n_expert_group, n_group_used;
    /* Multi-head latent attention (deepseek2, mla): per token
     *   q  = attn_q_b . rmsnorm(attn_q_a . h)            n_head x (qk_nope + rope_dim)
     *   kv = attn_kv_a_mqa . h = [c (kv_lora) | k_pe (rope_dim)], c = rmsnorm(c)
     * and, per head, the absorbed form: q_abs = attn_k_b[h] . q_nope
     * (kv_lora long), score = (q_abs . c + rope(q_pe) . rope(k_pe)) * kq_scale,
     * o_h = attn_v_b[h] . sum p c. The cache holds [c | rope(k_pe)] per
     * position and layer (kv_lora + rope_dim floats, one "KV head"), the
     * values being its first kv_lora. head_dim is the value head (v_head),
     * the width each head adds to attn_output's input. */
    bool    mla;
    int     q_lora, kv_lora, qk_nope, k_head;  /* k_head = qk_nope + rope_dim */
    /* YaRN RoPE (rope.scaling.type yarn): theta mixes interpolated
     * (theta / factor) and extrapolated angles by a ramp over the pairs
     * between the correction dims of beta_fast and beta_slow. */
    bool    rope_yarn;
    float   yarn_factor, yarn_beta_fast, yarn_beta_slow, yarn_log_mul;
    int     yarn_orig_ctx;
    float   kq_scale;         /* attention score scale: 1/sqrt(key length), x mscale^2 for DeepSeek's YaRN */
    int64_t kv_elems;         /* KV cache floats per position and layer, whole model: 2 x KV heads x head_dim, MLA kv_lora + rope_dim */
    /* The FFN rows a plan cuts (lk_slice ff0/ff1): n_ff for dense models,
     * n_ff_exp for mixtures; every other FFN width of the model follows in
     * proportion (lk_model_ffn_ranges). */
    int64_t n_ff_split;
    /* Hybrid recurrent models (qwen35moe): layer l is a gated delta net
     * (linear attention with a fixed-size per-sequence state, deltanet.c)
     * when bit l of recurrent[] is set, else gated full attention: attn_q
     * gives per head [q (head_dim) | gate (head_dim)], and sigmoid(gate)
     * multiplies the attention output before attn_output (attn_gate).
     * The delta net has ssm_nk key/query heads of ssm_dk and ssm_nv value
     * heads of ssm_dv (ssm_nv a multiple of ssm_nk; value head h reads
     * key head h mod ssm_nk: the converter's tiled order), a causal
     * depthwise convolution of ssm_conv taps over the 2 nk dk + nv dv
     * projected channels, and per value head a dk x dv state.
     * shexp_gate: the shared expert's output is scaled per token by
     * sigmoid(ffn_gate_inp_shexp . h). */
    int     n_recurrent;       /* layers that are recurrent */
    int     ssm_conv, ssm_nk, ssm_nv, ssm_dk, ssm_dv;
    uint64_t recurrent[64];    /* bit l: layer l is a gated delta net (n_layer <= 4096) */
    bool    attn_gate, shexp_gate;
    /* Gemma 3: sliding-window ("local") layers, where the query at position
     * p sees the keys p - swa_window + 1 .. p, marked in swa_bits (layer l
     * local iff bit l; from attention.sliding_window_pattern, an int N: l
     * local iff l % N < N - 1, or a bool per layer; llama.cpp's gemma3
     * default when the key is absent is N = 6). Local layers rotate with
     * rope_base_swa and no scaling; global layers with rope_base and the
     * linear rope_freq_scale (1 / rope.scaling.factor). swa_window 0: none. */
    int     swa_window;
    uint64_t swa_bits[LK_MAX_LAYERS / 64];
    float   rope_base_swa;
    float   rope_freq_scale;  /* linear scaling (1: none); every layer without SWA */
    float   emb_scale;        /* x = token_embd[t] * emb_scale (1: none; Gemma: sqrt(n_embd)) */
    bool    post_norms;       /* Gemma: o = rmsnorm(o) * post_{attention,ffw}_norm before the residual add */
    bool    ffn_gelu;         /* GELU-tanh gated FFN (ggml's F16 table) instead of SwiGLU */
    float   attn_softcap;     /* scores = cap * tanh(scores / cap) (0: none) */
    float   logit_softcap;    /* logits = cap * tanh(logits / cap) (0: none) */
} lk_model_config;

static inline bool lk_model_layer_moe(const lk_model_config *c, int l) { return c->n_expert > 0 && l >= c->n_dense_lead; }
static inline bool lk_model_layer_recurrent(const lk_model_config *c, int l) {
    return c->n_recurrent > 0 && l >= 0 && l < 4096 && (c->recurrent[l / 64] >> (l % 64) & 1);
}
/* Channels of the delta net's convolution (q, k, v): the whole model's. */
static inline int64_t lk_model_ssm_channels(const lk_model_config *c) {
    return 2LL * c->ssm_nk * c->ssm_dk + (int64_t)c->ssm_nv * c->ssm_dv;
}
static inline bool lk_model_layer_swa(const lk_model_config *c, int l) {
    return c->swa_window > 0 && l >= 0 && l < LK_MAX_LAYERS && (c->swa_bits[l / 64] >> (l % 64) & 1);
}

/* Reads the configuration from metadata and checks every tensor exists with
 * the expected shape and a supported type (clear error naming the tensor). */
lk_status lk_model_config_read(const lk_gguf *g, lk_model_config *cfg, char *err, size_t errlen);
/* Plan dimensions (with block alignments from the weight types). */
void lk_model_plan_dims(const lk_gguf *g, const lk_model_config *cfg, lk_plan_dims *d);

/* The rows of each kind of FFN a slice holds. A plan cuts [0, n_ff_split)
 * (ff0, ff1); each kind of width W whose down projection has blocks of a
 * elements maps a cut c to a * round(c * ceil(W / a) / n_ff_split), capped
 * at W. The map is monotone and takes 0 to 0 and n_ff_split to W, so the
 * ranks' ranges of every kind are contiguous, disjoint and cover it, cut on
 * block boundaries. Used by the loader and by lk_model_slice_bytes alike.
 * With expert parallelism (lk_slice.ep) the routed experts are not cut:
 * the slice holds experts [e0, e1) with all their rows, exp0 = 0 and
 * exp1 = n_ff_exp; otherwise [e0, e1) is every expert (none when the
 * slice holds no expert rows). */
typedef struct { int64_t dense0, dense1, exp0, exp1, sh0, sh1; int e0, e1; } lk_ffn_ranges;
void lk_model_ffn_ranges(const lk_gguf *g, const lk_model_config *c, const lk_slice *s, lk_ffn_ranges *r);

/* Parameters: all, and those one token reads (attention, dense FFNs, the
 * router, n_expert_used experts and the shared expert, embedding row and
 * output): what `info` prints. */
void lk_model_param_counts(const lk_gguf *g, const lk_model_config *c, uint64_t *total, uint64_t *active);

typedef struct {
    int     n_ctx;        /* positions per sequence (0: model's, capped at 4096) */
    int     n_batch;      /* most tokens per forward call, all sequences together (0: 512) */
    int     max_seqs;     /* sequence slots (0: 1) */
    int64_t kv_tokens;    /* KV positions in the page pool, shared by all slots (0: max_seqs * n_ctx) */
    bool    kv_f16;       /* F16 KV cache (default F32) */
    int     n_threads;    /* 0: all cores */
    lk_pool *pool;        /* optional shared pool (then n_threads is ignored) */
} lk_model_params;

typedef struct lk_model lk_model;

/* Builds the model for one slice (NULL = everything) over weights in the
 * GGUF `g`, which must outlive the model. */
lk_status lk_model_load(const lk_gguf *g, const lk_slice *slice, const lk_model_params *p,
                        lk_model **out, char *err, size_t errlen);
void lk_model_free(lk_model *m);

const lk_model_config *lk_model_cfg(const lk_model *m);
const lk_slice        *lk_model_slice(const lk_model *m);
int  lk_model_n_ctx(const lk_model *m);
int  lk_model_n_batch(const lk_model *m);
int  lk_model_threads(const lk_model *m);
lk_pool *lk_model_pool(const lk_model *m); /* the pool its passes run on */
void lk_model_set_hooks(lk_model *m, const lk_tp_hooks *h);
/* Bytes of weights this rank reads per decoded token (for a mixture:
 * n_expert_used experts' slices, not all of them). */
uint64_t lk_model_weight_bytes(const lk_model *m);

/* Routing trace (tests): when set, every MoE layer of every forward pass
 * writes, for each batch row r and layer l (absolute),
 * logits[(l * n_batch + r) * n_expert + e] (router logits),
 * experts[(l * n_batch + r) * n_expert_used + j] (chosen, best first) and
 * weights[...] (their final weights), and when shared_gate is set and the
 * model gates its shared expert, shared_gate[l * n_batch + r] (the
 * sigmoid factor). NULL clears it. */
typedef struct { float *logits; int32_t *experts; float *weights; float *shared_gate; } lk_route_trace;
void lk_model_trace_routing(lk_model *m, const lk_route_trace *t);

/* ---- sequences and the paged KV cache ----------------------------------------
 * The cache is a pool of pages of LK_KV_PAGE positions, each holding the
 * keys and values of those positions for every layer and KV head of this
 * rank (PagedAttention's idea). A sequence slot holds a list of pages and a
 * length; slots come and go without moving anything, and a prefix is shared
 * by pointing two slots at the same pages (reference counted; a shared page
 * is copied when a slot first writes into it). Every rank of a cluster
 * applies the same operations in the same order, so their pools agree page
 * for page and the head's counts speak for all.
 * Per-sequence state beside the pages: a recurrent model's (qwen35moe)
 * linear-attention layers keep, per slot, the last ssm_conv - 1 inputs of
 * every convolution channel and every value head's dk x dv state, F32,
 * zero when the slot is empty and advanced exactly once per position fed.
 * It cannot be cut back or shared by pages: keep(seq, n) of such a model
 * takes n = 0 (reset) or n = the slot's length (nothing to do) and refuses
 * anything between; fork(dst, src, n) copies src's state and so takes n =
 * 0 or n = src's length (a snapshot where src stands) and refuses a prefix
 * in between (the caller recomputes it). lk_model_recurrent says which
 * rule applies. */
#define LK_KV_PAGE 32
/* Sliding-window layers (Gemma 3) do not take pages: each slot holds their
 * keys and values in a ring of its own, allocated at load, of
 * ceil((window - 1 + n_batch) / 32) + 1 pages (what one step's queries may
 * see: the window before the step's first position and the step itself),
 * page j at ring entry j % ring. So a sequence's memory for those layers is
 * bounded by the window, not the context, and pages (counted below) hold
 * only the global layers. Positions that fell out of the ring are gone: a
 * slot can be kept or forked only at a length n whose window (positions
 * n - window + 1 .. n - 1) it still holds (lk_model_seq_can_keep); else
 * the prefix must be recomputed. lk_model_swa_ring gives the ring's pages
 * per slot for a configuration (0: no ring: no window, or a ring not
 * smaller than the context, when local layers take pages like the others);
 * lk_model_paged_layers the layers of [l0, l1) that take pages (not the
 * recurrent ones, nor those in rings: *ring_layers of them). */
int lk_model_swa_ring(const lk_model_config *c, int n_ctx, int n_batch);
int lk_model_paged_layers(const lk_model_config *c, int l0, int l1, int ring, int *ring_layers);
int     lk_model_max_seqs(const lk_model *m);
int     lk_model_seq_len(const lk_model *m, int seq);
int64_t lk_model_pages_total(const lk_model *m);
int64_t lk_model_pages_free(const lk_model *m);
/* Pages that appending n positions to seq would take (new and copied). */
int64_t lk_model_pages_needed(const lk_model *m, int seq, int n);
/* Whether the model keeps recurrent per-sequence state (see above). */
bool    lk_model_recurrent(const lk_model *m);
/* Keeps the first n positions of seq (n <= its length; 0 frees every page). */
lk_status lk_model_seq_keep(lk_model *m, int seq, int n, char *err, size_t errlen);
/* dst (emptied first) shares the first n positions of src (a sliding-
 * window ring's entries are copied, not shared). */
lk_status lk_model_seq_fork(lk_model *m, int dst, int src, int n, char *err, size_t errlen);
/* Whether keep or fork may cut seq at n (always for n = 0 and for models
 * without a ring; see LK_KV_PAGE). Every rank gives the same answer. */
bool lk_model_seq_can_keep(const lk_model *m, int seq, int n);
/* Bytes of this rank's KV cache: pages and rings, keys and values. */
uint64_t lk_model_kv_bytes(const lk_model *m);

/* One forward pass is a batch of items: item i appends rows
 * [row0_i, row0_i + n) of x (items in order, rows consecutive) to slot seq
 * at positions pos0 .. pos0+n-1, where pos0 must be the slot's length. */
typedef struct { int32_t seq, pos0, n; } lk_batch_item;

/* Validates the batch (slots distinct and in range, positions, n_batch,
 * pages: errors name the item) and takes the pages it writes (copying
 * shared ones). The slots' lengths grow at once. The forward pass below then
 * runs on this batch. */
lk_status lk_model_batch(lk_model *m, const lk_batch_item *items, int n_items, char *err, size_t errlen);
int  lk_model_batch_rows(const lk_model *m);   /* rows of the current batch */

/* The forward pass, in three steps so pipeline stages can run parts of it.
 * x is a [rows][n_embd] F32 buffer (lk_model_hidden gives one sized n_batch).
 *  - embed: token ids -> x (first stage);
 *  - layers: runs this slice's layers [layer0, layer1) on x for the current
 *    batch (lk_model_batch), writing the KV cache;
 *  - logits: final norm + this rank's vocabulary rows for the rows listed
 *    (rows[i] < batch rows); logits is [n_rows][vocab1 - vocab0].
 * Every row's result depends on its own sequence only (batch invariance).
 * A failing hook (peer died) returns its status; the message is the hook's. */
lk_status lk_model_embed(lk_model *m, const int32_t *tokens, int n, float *x);
lk_status lk_model_layers(lk_model *m, float *x);
/* After lk_model_layers: the first of this rank's layers whose output (a
 * row of the residual stream) held a NaN or infinity, *ffn telling whether
 * its FFN part or its attention made it; layer0 - 1 when the rows arrived
 * that way (an earlier pipeline stage); -1 when every layer's was finite. */
int lk_model_first_nonfinite(const lk_model *m, bool *ffn);
lk_status lk_model_logits(lk_model *m, const float *x, const int32_t *rows, int n_rows, float *logits);
float *lk_model_hidden(lk_model *m);  /* scratch [n_batch][n_embd] owned by the model */

/* One sequence in slot 0 (tests, tools): drops positions from pos0 on, then
 * embed + layers + logits for the last n_out of tokens[0..n), n <= n_batch. */
lk_status lk_model_forward(lk_model *m, const int32_t *tokens, int n, int pos0,
                           int n_out, float *logits);

/* ---- which bytes of the file a slice reads ----------------------------------
 * A worker that receives only its own slices over the network stores them in
 * a sparse copy of the file: the header and tensor index, and for every
 * tensor the bytes this slice's forward pass reads (rows of row-split
 * weights, a segment of every row of column-split ones, whole norms, the
 * whole embedding table on the first pipeline stage since any token may
 * come, the slice's vocabulary rows of the output on the last). The rest
 * stays a hole, never read, so the loader above works on that copy
 * unchanged. */
typedef struct { uint64_t off, len; } lk_byte_range;   /* [off, off + len) of the file */
typedef struct {
    lk_byte_range *r;      /* (n), sorted and disjoint after lk_ranges_normalize */
    int64_t n, cap;
} lk_ranges;

void     lk_ranges_add(lk_ranges *l, uint64_t off, uint64_t len);  /* len 0: nothing */
/* Sorts and merges overlapping or touching ranges. */
void     lk_ranges_normalize(lk_ranges *l);
uint64_t lk_ranges_total(const lk_ranges *l);                      /* bytes covered */
/* Bytes of the blocks (of `block` bytes) the ranges touch: the disk a sparse
 * file holding them takes. Normalised lists only. */
uint64_t lk_ranges_disk(const lk_ranges *l, uint64_t block);
void     lk_ranges_free(lk_ranges *l);

/* Appends to out (then normalises it) the byte ranges of g that a model
 * loaded with this slice reads: [0, data offset) and the tensor bytes above.
 * The slice comes from a peer: anything that does not fit the model (range,
 * block alignment) is an error, never an assertion. */
lk_status lk_model_slice_bytes(const lk_gguf *g, const lk_slice *s, lk_ranges *out, char *err, size_t errlen);

#endif
