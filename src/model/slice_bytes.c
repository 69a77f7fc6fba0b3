/* The bytes of a GGUF file that one rank's slice reads (model.h), so a worker
 * can be sent only those. This must agree with every access model.c makes:
 * a byte the forward pass reads but this list misses would be a hole in the
 * worker's sparse copy and read as zeros. tests/test_slice_bytes.c poisons
 * everything outside the list and checks the logits do not change.
 *
 * What model.c reads, per slice:
 *   first pipeline stage  token_embd: every row (lk_model_embed looks up
 *                         whatever token comes);
 *   last stage            output_norm; output (or the tied token_embd) rows
 *                         [vocab0, vocab1) (lk_model_logits);
 *   every rank            rope_freqs (the RoPE table, at load);
 *   each layer it runs    attn_norm, ffn_norm, q/k norms, whole;
 *                         Wq rows of its heads, Wk/Wv rows of its KV heads,
 *                         the q/k/v biases of those rows;
 *                         Wo: its heads' columns of every row;
 *                         W1/W3 rows [ff0, ff1); W2: those columns of every row;
 *   each MoE layer        the router (ffn_gate_inp) and exp_probs_b, whole
 *                         (every rank routes every token); of every expert
 *                         slab its rows of gate/up and its columns of down,
 *                         or with expert parallelism (lk_slice.ep) the
 *                         whole slabs of its experts and nothing of the
 *                         others; the shared expert cut like a dense FFN.
 *                         Which rows of each kind of FFN and which experts
 *                         a slice holds: lk_model_ffn_ranges.
 * Norms are listed even where a slice without heads (or FFN rows) skips them:
 * a few KiB, and one rule less to get wrong. */
#include "model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void lk_ranges_add(lk_ranges *l, uint64_t off, uint64_t len) {
    if (!len) return;
    if (l->n && l->r[l->n - 1].off + l->r[l->n - 1].len == off) { /* the common case: extends the last one */
        l->r[l->n - 1].len += len;
        return;
    }
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 256;
        l->r = lk_xrealloc(l->r, (size_t)l->cap * sizeof *l->r);
    }
    l->r[l->n++] = (lk_byte_range){off, len};
}

static int cmp_range(const void *a, const void *b) {
    const lk_byte_range *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off;
}

void lk_ranges_normalize(lk_ranges *l) {
    if (l->n < 2) return;
    qsort(l->r, (size_t)l->n, sizeof *l->r, cmp_range);
    int64_t k = 0;
    for (int64_t i = 1; i < l->n; i++) {
        lk_byte_range *p = &l->r[k], *q = &l->r[i];
        if (q->off <= p->off + p->len) {
            uint64_t end = LK_MAX(p->off + p->len, q->off + q->len);
            p->len = end - p->off;
        } else {
            l->r[++k] = *q;
        }
    }
    l->n = k + 1;
}

uint64_t lk_ranges_total(const lk_ranges *l) {
    uint64_t t = 0;
    for (int64_t i = 0; i < l->n; i++) t += l->r[i].len;
    return t;
}

uint64_t lk_ranges_disk(const lk_ranges *l, uint64_t block) {
    uint64_t blocks = 0, next = 0; /* first block not yet counted */
    for (int64_t i = 0; i < l->n; i++) {
        uint64_t b0 = LK_MAX(l->r[i].off / block, next), b1 = (l->r[i].off + l->r[i].len + block - 1) / block;
        if (b1 > b0) blocks += b1 - b0;
        next = LK_MAX(next, b1);
    }
    return blocks * block;
}

void lk_ranges_free(lk_ranges *l) {
    free(l->r);
    memset(l, 0, sizeof *l);
}

/* ---- the slice's bytes ------------------------------------------------------------ */

typedef struct {
    const lk_gguf *g;
    lk_ranges *out;
    char *err;
    size_t errlen;
} walk;

static const lk_gguf_tensor *find(walk *w, int l, const char *name) {
    char n[96];
    if (l >= 0) snprintf(n, sizeof n, "blk.%d.%s", l, name);
    else snprintf(n, sizeof n, "%s", name);
    return lk_gguf_find_tensor(w->g, n);
}

static uint64_t base(walk *w, const lk_gguf_tensor *t) { return lk_gguf_data_offset(w->g) + t->offset; }

static void whole(walk *w, const lk_gguf_tensor *t) {
    if (t) lk_ranges_add(w->out, base(w, t), t->nbytes);
}

/* Rows [r0, r1) of a 2-D tensor (or elements [r0, r1) of an F32 vector, with
 * ne0 = 1 per "row"). The caller checked r1 <= rows. */
static void rows(walk *w, const lk_gguf_tensor *t, int64_t r0, int64_t r1) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb)); /* the config check passed */
    lk_ranges_add(w->out, base(w, t) + (uint64_t)r0 * rb, (uint64_t)(r1 - r0) * rb);
}

static void elems_f32(walk *w, const lk_gguf_tensor *t, int64_t a, int64_t b) {
    lk_ranges_add(w->out, base(w, t) + 4 * (uint64_t)a, 4 * (uint64_t)(b - a));
}

/* Columns [c0, c1) of every row: c0 on a block boundary, c1 too or the row's
 * end (model.c's mat_cols and its load-time check). */
static lk_status cols(walk *w, const lk_gguf_tensor *t, int64_t c0, int64_t c1) {
    if (c0 == c1) return LK_OK;
    size_t rb = 0, a = 0, b = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    if (!lk_type_row_bytes(t->type, c0, &a) || !lk_type_row_bytes(t->type, c1, &b))
        return lk_fail(w->err, w->errlen, LK_ERR_ARG, "columns [%lld,%lld) cut tensor '%s' inside a %lld-element block",
                       (long long)c0, (long long)c1, t->name, (long long)lk_type_block_size(t->type));
    uint64_t at = base(w, t);
    for (uint64_t r = 0; r < t->ne[1]; r++) lk_ranges_add(w->out, at + r * rb + a, b - a);
    return LK_OK;
}

/* Rows [r0, r1) of slab e of a 3-D tensor, and columns [c0, c1) of every
 * row of slab e. */
static void slab_rows(walk *w, const lk_gguf_tensor *t, int e, int64_t r0, int64_t r1) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    lk_ranges_add(w->out, base(w, t) + ((uint64_t)e * t->ne[1] + (uint64_t)r0) * rb, (uint64_t)(r1 - r0) * rb);
}

static lk_status slab_cols(walk *w, const lk_gguf_tensor *t, int e, int64_t c0, int64_t c1) {
    if (c0 == c1) return LK_OK;
    size_t rb = 0, a = 0, b = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    if (!lk_type_row_bytes(t->type, c0, &a) || !lk_type_row_bytes(t->type, c1, &b))
        return lk_fail(w->err, w->errlen, LK_ERR_ARG, "columns [%lld,%lld) cut tensor '%s' inside a %lld-element block",
                       (long long)c0, (long long)c1, t->name, (long long)lk_type_block_size(t->type));
    uint64_t at = base(w, t) + (uint64_t)e * t->ne[1] * rb;
    for (uint64_t r = 0; r < t->ne[1]; r++) lk_ranges_add(w->out, at + r * rb + a, b - a);
    return LK_OK;
}

lk_status lk_model_slice_bytes(const lk_gguf *g, const lk_slice *s, lk_ranges *out, char *err, size_t errlen) {
    lk_model_config c;
    lk_status st = lk_model_config_read(g, &c, err, errlen);
    if (st) return st;
    bool fits = s->pp_size >= 1 && s->pp_rank >= 0 && s->pp_rank < s->pp_size && s->layer0 >= 0 &&
                s->layer0 < s->layer1 && s->layer1 <= c.n_layer && s->head0 >= 0 && s->head0 <= s->head1 &&
                s->head1 <= c.n_head && s->kv_head0 >= 0 && s->kv_head0 <= s->kv_head1 && s->kv_head1 <= c.n_head_kv &&
                s->ff0 >= 0 && s->ff0 <= s->ff1 && s->ff1 <= c.n_ff_split && s->vocab0 >= 0 && s->vocab0 <= s->vocab1 &&
                s->vocab1 <= c.n_vocab &&
                (!s->ep || (c.n_expert > 0 && s->expert0 >= 0 && s->expert0 < s->expert1 && s->expert1 <= c.n_expert));
    if (!fits)
        return lk_fail(err, errlen, LK_ERR_ARG,
                       "slice does not fit the model: stage %d of %d, layers [%d,%d) heads [%d,%d) kv [%d,%d) "
                       "ff [%lld,%lld) vocab [%lld,%lld)%s", s->pp_rank, s->pp_size, s->layer0, s->layer1, s->head0,
                       s->head1, s->kv_head0, s->kv_head1, (long long)s->ff0, (long long)s->ff1,
                       (long long)s->vocab0, (long long)s->vocab1, s->ep ? " (expert-parallel experts out of range)" : "");
    walk w = {g, out, err, errlen};
    const int64_t hd = c.head_dim;
    lk_ffn_ranges fr;
    lk_model_ffn_ranges(g, &c, s, &fr);
    lk_ranges_add(out, 0, LK_MIN(lk_gguf_data_offset(g), lk_gguf_file_size(g)));
    const lk_gguf_tensor *emb = find(&w, -1, "token_embd.weight");
    if (s->pp_rank == 0) whole(&w, emb);
    if (s->pp_rank == s->pp_size - 1) {
        whole(&w, find(&w, -1, "output_norm.weight"));
        rows(&w, c.tied_output ? emb : find(&w, -1, "output.weight"), s->vocab0, s->vocab1);
    }
    whole(&w, find(&w, -1, "rope_freqs.weight"));
    for (int l = s->layer0; l < s->layer1; l++) {
        whole(&w, find(&w, l, "attn_norm.weight"));
        whole(&w, find(&w, l, "ffn_norm.weight"));
        whole(&w, find(&w, l, "post_attention_norm.weight")); /* glm4moe's pre-FFN norm, Gemma's post-norm */
        whole(&w, find(&w, l, "post_ffw_norm.weight"));       /* Gemma */
        if (c.mla && s->head1 > s->head0) {
            /* the latent projections are whole on every rank with heads, the per-head ones cut by head */
            const int64_t kl = c.kv_lora;
            whole(&w, find(&w, l, "attn_q_a.weight"));
            whole(&w, find(&w, l, "attn_q_a_norm.weight"));
            whole(&w, find(&w, l, "attn_kv_a_mqa.weight"));
            whole(&w, find(&w, l, "attn_kv_a_norm.weight"));
            rows(&w, find(&w, l, "attn_q_b.weight"), s->head0 * (int64_t)c.k_head, s->head1 * (int64_t)c.k_head);
            rows(&w, find(&w, l, "attn_k_b.weight"), s->head0 * kl, s->head1 * kl);
            rows(&w, find(&w, l, "attn_v_b.weight"), s->head0 * hd, s->head1 * hd);
        } else if (lk_model_layer_recurrent(&c, l)) {
            /* the delta net: key heads [k0, k1) follow the query heads;
             * their value heads j nk + k0 .. j nk + k1 - 1 (deltanet.c) */
            const int64_t nk = c.ssm_nk, dk = c.ssm_dk, dv = c.ssm_dv;
            const int64_t k0 = (int64_t)s->head0 * nk / c.n_head, k1 = (int64_t)s->head1 * nk / c.n_head;
            const lk_gguf_tensor *qkv = find(&w, l, "attn_qkv.weight"), *cv = find(&w, l, "ssm_conv1d.weight");
            whole(&w, find(&w, l, "ssm_norm.weight"));
            for (int part = 0; part < 2 && k1 > k0; part++) {
                rows(&w, qkv, (part * nk + k0) * dk, (part * nk + k1) * dk);
                rows(&w, cv, (part * nk + k0) * dk, (part * nk + k1) * dk);
            }
            for (int64_t j = 0; j < c.ssm_nv / nk && k1 > k0 && !st; j++) {
                const int64_t v0 = j * nk + k0, v1 = j * nk + k1;
                rows(&w, qkv, 2 * nk * dk + v0 * dv, 2 * nk * dk + v1 * dv);
                rows(&w, cv, 2 * nk * dk + v0 * dv, 2 * nk * dk + v1 * dv);
                rows(&w, find(&w, l, "attn_gate.weight"), v0 * dv, v1 * dv);
                rows(&w, find(&w, l, "ssm_beta.weight"), v0, v1);
                rows(&w, find(&w, l, "ssm_alpha.weight"), v0, v1);
                elems_f32(&w, find(&w, l, "ssm_dt.bias"), v0, v1);
                elems_f32(&w, find(&w, l, "ssm_a"), v0, v1);
                st = cols(&w, find(&w, l, "ssm_out.weight"), v0 * dv, v1 * dv);
            }
            if (st) break;
        } else if (!c.mla) {
            const int64_t qw = c.attn_gate ? 2 * hd : hd; /* gated: per head [q | gate] */
            rows(&w, find(&w, l, "attn_q.weight"), s->head0 * qw, s->head1 * qw);
            rows(&w, find(&w, l, "attn_k.weight"), s->kv_head0 * hd, s->kv_head1 * hd);
            rows(&w, find(&w, l, "attn_v.weight"), s->kv_head0 * hd, s->kv_head1 * hd);
        }
        if (!lk_model_layer_recurrent(&c, l) &&
            (st = cols(&w, find(&w, l, "attn_output.weight"), s->head0 * hd, s->head1 * hd)))
            break;
        if (lk_model_layer_moe(&c, l)) {
            whole(&w, find(&w, l, "ffn_gate_inp.weight"));
            whole(&w, find(&w, l, "exp_probs_b.bias"));
            whole(&w, find(&w, l, "ffn_gate_inp_shexp.weight"));
            const lk_gguf_tensor *tg = find(&w, l, "ffn_gate_exps.weight"), *tu = find(&w, l, "ffn_up_exps.weight"),
                                 *td = find(&w, l, "ffn_down_exps.weight");
            for (int e = fr.e0; e < fr.e1 && !st; e++) {
                slab_rows(&w, tg, e, fr.exp0, fr.exp1);
                slab_rows(&w, tu, e, fr.exp0, fr.exp1);
                st = slab_cols(&w, td, e, fr.exp0, fr.exp1);
            }
            if (st) break;
            if (c.n_expert_shared) {
                rows(&w, find(&w, l, "ffn_gate_shexp.weight"), fr.sh0, fr.sh1);
                rows(&w, find(&w, l, "ffn_up_shexp.weight"), fr.sh0, fr.sh1);
                if ((st = cols(&w, find(&w, l, "ffn_down_shexp.weight"), fr.sh0, fr.sh1))) break;
            }
        } else {
            rows(&w, find(&w, l, "ffn_gate.weight"), fr.dense0, fr.dense1);
            rows(&w, find(&w, l, "ffn_up.weight"), fr.dense0, fr.dense1);
            if ((st = cols(&w, find(&w, l, "ffn_down.weight"), fr.dense0, fr.dense1))) break;
        }
        if (c.has_qkv_bias) {
            elems_f32(&w, find(&w, l, "attn_q.bias"), s->head0 * hd, s->head1 * hd);
            elems_f32(&w, find(&w, l, "attn_k.bias"), s->kv_head0 * hd, s->kv_head1 * hd);
            elems_f32(&w, find(&w, l, "attn_v.bias"), s->kv_head0 * hd, s->kv_head1 * hd);
        }
        if (c.has_qk_norm && !lk_model_layer_recurrent(&c, l)) {
            whole(&w, find(&w, l, "attn_q_norm.weight"));
            whole(&w, find(&w, l, "attn_k_norm.weight"));
        }
    }
    lk_ranges_normalize(out);
    return st;
}
