/* model_impl — the model's private types, shared by the files of src/model/
 * (model.c: loading, the paged KV cache, attention and FFNs; an
 * architecture's own mixer may live in a file of its own). Nothing outside
 * src/model/ includes this: the interface is model.h. */
#ifndef LK_MODEL_IMPL_H
#define LK_MODEL_IMPL_H

#include "model/model.h"

/* Prefill attention takes queries in blocks of ATT_QB (attn_block_fn). */
/* ROW_ALIGN: rows handed to a thread in multiples of 16 (64-byte lines of y), as kernels/ops.c does. */
enum { ATT_QB = 16, ROW_ALIGN = 16 };
/* Attention's softmax runs over key blocks of ATT_KB pages (attn_rows). */
enum { ATT_KB = 4 };

/* One FFN's slice: gate and up rows [f0, f1) of this rank, down's matching
 * columns. An expert is one slab of the 3-D tensors. */
typedef struct { lk_mat w1, w3, w2; } ffn_w;

typedef struct {
    const float *attn_norm, *ffn_norm;     /* (d) */
    const float *q_norm, *k_norm;          /* (hd) qwen3 */
    const float *post_attn_norm, *post_ffn_norm; /* (d) Gemma's post-norms, or NULL */
    bool swa;                              /* a sliding-window layer (lk_model_layer_swa) */
    const float *bq, *bk, *bv;             /* (H*hd), (KV*hd) qwen2, already offset to the slice */
    lk_mat wq, wk, wv, wo, w1, w2, w3;
    /* MLA (deepseek2; model.h): the two LoRA-down projections are whole on
     * every rank that holds heads (the latent is shared by all heads), the
     * per-head ones hold this rank's heads. hd = v_head, kl = kv_lora. */
    lk_mat wqa;                            /* attn_q_a [q_lora, d] */
    lk_mat wkva;                           /* attn_kv_a_mqa [kl + rope, d] */
    lk_mat wqb;                            /* attn_q_b [H * k_head, q_lora] */
    lk_mat wkb;                            /* attn_k_b [H * kl, qk_nope]: head h = rows [h kl, (h+1) kl) */
    lk_mat wvb;                            /* attn_v_b [H * hd, kl] */
    const float *q_a_norm, *kv_a_norm;     /* (q_lora), (kl) */
    /* mixture-of-experts layer (moe): the router and exp_probs_b are whole
     * on every rank (every rank routes every token, the same way); each
     * expert and the shared expert are sliced like a dense FFN, or with
     * expert parallelism the rank holds experts [ex0, ex1) whole and the
     * others' views are empty */
    bool moe;
    lk_mat wr;                             /* ffn_gate_inp [E, d] */
    const float *exp_b;                    /* (E) selection bias, or NULL */
    ffn_w *ex;                             /* (E) */
    ffn_w sh;                              /* shared expert (rows 0: none) */
    const float *sh_gate;                  /* (d) ffn_gate_inp_shexp: sigmoid(. h) scales the shared expert, or NULL */
    /* gated attention (qwen35moe full-attention layers): wq's rows are per
     * head [q | gate], 2 hd each */
    bool gated;
    /* gated delta net (qwen35moe recurrent layers; deltanet.c). Local heads:
     * nkl key heads, nvl value heads; local value head i reads local key
     * head i mod nkl. Channels C = 2 nkl dk + nvl dv, in the order
     * [q | k | v]. */
    bool rec;
    int ri;                                /* index among this rank's recurrent layers (state) */
    lk_mat wqkv;                           /* attn_qkv [C, d] */
    lk_mat wz;                             /* attn_gate [nvl dv, d] */
    lk_mat wbeta, walpha;                  /* ssm_beta, ssm_alpha [nvl, d] */
    lk_mat wso;                            /* ssm_out [d, nvl dv] (a column slice) */
    const float *conv;                     /* (C, ssm_conv) taps per channel */
    const float *dt, *ssm_a;               /* (nvl) */
    const float *ssm_norm;                 /* (dv) shared by the heads */
    void *own;                             /* weights gathered for a split (deltanet.c), or NULL */
} layer_w;

/* Scratch of the mixture-of-experts FFN, sized at load for n_batch tokens.
 * A "slot" is one (token, expert) pair whose expert this rank holds: slots
 * are grouped by expert in expert order (within an expert, tokens in batch
 * order), n_routed of them, then one slot per token for the shared expert,
 * so every expert's tokens are consecutive rows for the matrix kernel.
 * Pairs whose expert another rank holds (expert parallelism) get no slot:
 * row_slot -1. */
typedef struct {
    float   *logits;     /* (B, E) router logits */
    float   *probs;      /* (E) one row's scores */
    float   *bsel;       /* (E) one row's selection scores (+ bias, groups masked) */
    float   *gsc;        /* (groups) one row's group scores */
    int32_t *sel;        /* (B, k) chosen experts, best first */
    float   *wgt;        /* (B, k) their weights */
    int32_t *row_slot;   /* (B, k) slot of (token, j), -1: the expert is on another rank */
    int32_t *slot_row;   /* (B*k + B) token of each slot */
    int32_t *cnt, *off;  /* (E + 1) tokens per expert, first slot of each */
    int32_t *act;        /* (E + 1) experts with tokens in this batch (then the shared one, index E) */
    int      n_act;
    int      n_routed;   /* slots of routed experts (before the shared expert's) */
    void    *ain;        /* (slots, ain_stride) quantised FFN input per slot */
    void    *adn;        /* (slots, adn_stride) quantised SwiGLU output per slot */
    size_t   ain_stride, adn_stride;
    float   *hg, *hu;    /* (slots, fmax) gate/up outputs */
    float   *eo;         /* (slots, d) each slot's expert output */
    float   *shg;        /* (B) the shared expert's gate per token */
    int64_t  fmax;
} moe_scratch;

struct lk_model {
    lk_model_config cfg;
    lk_slice sl;
    int n_ctx, n_batch;
    int nh, nkv;            /* local heads, local kv heads */
    int64_t nff, nvoc;      /* local dense FFN rows, local vocab rows */
    lk_ffn_ranges fr;       /* FFN rows of each kind here (dense, expert, shared) */
    int64_t nfe, nfs;       /* local rows of each expert held, local shared-expert rows */
    int ex0, ex1;           /* routed experts held here (lk_ffn_ranges e0, e1): all, a range (expert
                               parallelism), or none */
    moe_scratch ms;
    lk_route_trace trace;
    const lk_gguf *g;
    const lk_gguf_tensor *tok_embd;
    const float *out_norm;
    lk_mat wout;
    layer_w *layers;        /* (layer1 - layer0) */
    float *rope_cos, *rope_sin; /* (n_ctx, rope_dim/2) */
    float *rope_cos_swa, *rope_sin_swa; /* (n_ctx, rope_dim/2) the sliding-window layers' (Gemma 3), or NULL */
    /* KV cache: n_pages pages of LK_KV_PAGE positions' keys and as many
     * values, F32 or F16, laid out (layers here, KV heads here, n_pages,
     * LK_KV_PAGE, ahd): a (layer, KV head)'s pages are one array, so a
     * sequence whose pages were taken in a row has each head's keys in one
     * run of memory (before, a page held every layer and head, and a head's
     * successive pages lay page_elems apart: decode attention at 2048
     * positions on a Zen 5 took 35 % longer). A (layer, KV head)'s page of keys
     * is stored transposed, (ahd, LK_KV_PAGE), for the attention kernels'
     * keys in lanes (kv_keys). ahd is head_dim, or for MLA the latent row
     * [c | rope(k_pe)] (kv_lora + rope_dim): then there is no vcache, the
     * values being the first kv_lora of each key row, and the rows are not
     * transposed (kv_keys turns a page when it reads it). */
    int ahd;
    bool kv_f16;
    void *kcache, *vcache;  /* on 2 MiB pages (kv_alloc), mapped at kv_map[0], [1] */
    void *kv_map[2];
    size_t kv_map_len;
    size_t page_elems;      /* elements of one page (keys or values) over the global layers here */
    /* Sliding-window layers (model.h, "sequences and the paged KV cache")
     * keep their keys and values in a ring of swa_ring pages per slot,
     * after the pages in kcache/vcache: page j of slot s at ring entry
     * j % swa_ring, (max_seqs, swa_ring, local layers here, KV heads here,
     * LK_KV_PAGE, ahd). A slot's ring holds its pages
     * [max(swa_lo, swa_hi - swa_ring + 1), swa_hi]. swa_ring 0: no ring
     * (no window, or a ring that would not be smaller than the context:
     * local layers then live in the pages like the others). */
    int swa_ring;
    size_t swa_page_elems;  /* elements of one ring entry (keys or values): the local layers here */
    int n_swa;              /* this rank's layers in the rings (0 without a ring) */
    int32_t *swa_lo, *swa_hi; /* (max_seqs) first page held since the slot was emptied or forked, last page written */
    int64_t n_pages, n_free;
    int32_t *page_ref;      /* (n_pages) slots pointing at each page */
    int32_t *free_pages;    /* (n_pages) stack of free pages, n_free of them */
    int max_seqs, max_pps;  /* slots; pages per slot at most (n_ctx / LK_KV_PAGE rounded up) */
    int32_t *ptab;          /* (max_seqs, max_pps) page of each slot's positions, -1: none */
    int32_t *seq_len;       /* (max_seqs) */
    /* the current batch (lk_model_batch) */
    lk_batch_item *items;   /* (n_batch) */
    int32_t *item_row0;     /* (n_batch + 1) first row of each item */
    int32_t *row_item, *row_pos; /* (n_batch) item and position of each row */
    int64_t *task0;         /* (n_batch + 1) first attention task of each item */
    int32_t *hgrp0;         /* (nh + 1) decode attention's head groups: first local head of each (head_groups) */
    int n_hgrp, hgrp_size;  /* groups, and the most heads in one (0: not chosen yet) */
    int32_t *out_rows;      /* (n_batch) lk_model_forward's logits rows */
    int n_items, n_rows;
    int bad_layer;          /* the last lk_model_layers: first layer whose output was non-finite (see model.h) */
    bool bad_ffn;           /* ... in its FFN part (else attention) */
    bool resid_done;        /* the last output product also added m->o into x (out_product) */
    bool resid_bad;         /* ... and a sum went non-finite */
    /* scratch, sized at load */
    float *x, *xb, *q, *k, *v, *att, *o, *hg, *hu;
    /* MLA scratch: (B, q_lora) (B, kv_lora + rope) (B, H k_head) (B, H hd);
     * q and att are (B, H, ahd): [q_abs | rope(q_pe)] and the latent sums */
    float *mqa, *mkva, *mqb, *mvo;
    void *hact;             /* (threads, B, hact_stride) per-head activations (heads_fn) */
    size_t hact_stride;
    float *scores;          /* per thread attn_buf_floats: a key block's scores, a row per query, and the queries */
    float *kvw;             /* MLA: (threads, ATT_KB + 1, LK_KV_PAGE, ahd) a block's keys turned and a page's values widened (kv_keys, kv_rows) */
    void *act;              /* activation quantisation */
    lk_pool *pool;
    bool own_pool;
    lk_tp_hooks hooks;
    uint64_t weight_bytes;
    void *arena;            /* huge-page copy of the matrices (NULL: views on the file) */
    size_t arena_len;
    /* recurrent layers (deltanet.c): nkl/nvl local key/value heads */
    int nkl, nvl, kh0;       /* kh0: first local key head */
    int n_rec;               /* recurrent layers here */
    int32_t *kv_li;          /* (layers here) the layer's index in the KV pages, -1: none (recurrent) */
    int n_kv_layers;         /* layers here with a KV cache */
    size_t rs_elems;         /* floats of one slot's state for one layer: (conv - 1) C + nvl dk dv */
    float *rstate;           /* (max_seqs, n_rec, rs_elems): [conv window | S] */
    float *dn_qkv, *dn_z, *dn_ab, *dn_o; /* (B, C) (B, nvl dv) (B, 2 nvl) (B, nvl dv) */
    float *gate;             /* (B, nh hd) gated attention's gates */
    bool dn_grouped;         /* tests only: value head h reads key head h div (nv/nk), HF's grouped order (a mistake) */
};

/* deltanet.c */
void lk_deltanet_load(lk_model *m, int l, layer_w *w);
void lk_deltanet_alloc(lk_model *m);
void lk_deltanet_free(lk_model *m);
void lk_deltanet(lk_model *m, int li, const float *x);
/* The state of slot seq: zeroed, or copied from slot src. */
void lk_deltanet_reset(lk_model *m, int seq);
void lk_deltanet_copy(lk_model *m, int dst, int src);

#endif
