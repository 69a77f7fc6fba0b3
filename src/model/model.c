/* The forward pass over one rank's slice.
 *
 * Shapes (per rank; H = heads here, KV = KV heads here, hd = head_dim,
 * F = FFN rows here, B = n_batch, d = n_embd):
 *   Wq [H*hd, d]  Wk, Wv [KV*hd, d]  Wo [d, H*hd] (a column slice)
 *   W1, W3 [F, d] W2 [d, F] (a column slice)   Wout [vocab1-vocab0, d]
 * A slice of output rows is a pointer offset; a slice of input columns keeps
 * the full row stride and starts at a block boundary (the plan guarantees
 * block alignment), so single node and every rank use the same views.
 *
 * Weight memory: the matrices a rank multiplies are copied at load, each
 * compacted to its slice, into one anonymous arena backed by 2 MiB pages
 * (madvise MADV_HUGEPAGE), and the file pages they came from are dropped
 * from this process (MADV_DONTNEED), so memory is not doubled. Decode streams
 * every weight once per token; through 4 KiB file pages that cost a TLB miss
 * per 4 KiB and held TinyLlama Q4_0 decode at 81 % of the read bandwidth,
 * 95 % with huge pages (file mappings get none: FilePmdMapped stays 0).
 * Without transparent huge pages, or with LK_WEIGHTS=mmap, the views stay on
 * the file mapping. Norms, biases and the embedding table stay mapped. */
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Prefill attention takes queries in blocks of ATT_QB (attn_block_fn). */
enum { ATT_QB = 16 };

typedef struct {
    const float *attn_norm, *ffn_norm;     /* (d) */
    const float *q_norm, *k_norm;          /* (hd) qwen3 */
    const float *bq, *bk, *bv;             /* (H*hd), (KV*hd) qwen2, already offset to the slice */
    lk_mat wq, wk, wv, wo, w1, w2, w3;
} layer_w;

struct lk_model {
    lk_model_config cfg;
    lk_slice sl;
    int n_ctx, n_batch;
    int nh, nkv;            /* local heads, local kv heads */
    int64_t nff, nvoc;      /* local FFN rows, local vocab rows */
    const lk_gguf *g;
    const lk_gguf_tensor *tok_embd;
    const float *out_norm;
    lk_mat wout;
    layer_w *layers;        /* (layer1 - layer0) */
    float *rope_cos, *rope_sin; /* (n_ctx, rope_dim/2) */
    /* KV cache: n_pages pages of (layers here, KV heads here, LK_KV_PAGE, hd)
     * keys and as many values, F32 or F16 */
    bool kv_f16;
    void *kcache, *vcache;
    size_t page_elems;      /* elements of one page (keys or values) */
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
    int32_t *out_rows;      /* (n_batch) lk_model_forward's logits rows */
    int n_items, n_rows;
    /* scratch, sized at load */
    float *x, *xb, *q, *k, *v, *att, *o, *hg, *hu;
    float *scores;          /* (threads, ATT_QB, n_ctx) */
    void *act;              /* activation quantisation */
    lk_pool *pool;
    bool own_pool;
    lk_tp_hooks hooks;
    uint64_t weight_bytes;
    void *arena;            /* huge-page copy of the matrices (NULL: views on the file) */
    size_t arena_len;
};

/* ---------------------------------------------------------------- config */

static bool meta_i64(const lk_gguf *g, const char *arch, const char *suffix, int64_t *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return lk_gguf_get_i64(g, key, out);
}
static bool meta_f64(const lk_gguf *g, const char *arch, const char *suffix, double *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return lk_gguf_get_f64(g, key, out);
}

static lk_status need_i64(const lk_gguf *g, const char *arch, const char *suffix, int64_t lo, int64_t hi,
                          int64_t *out, char *err, size_t errlen) {
    if (!meta_i64(g, arch, suffix, out))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing metadata key %s.%s", lk_gguf_path(g), arch, suffix);
    if (*out < lo || *out > hi)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: metadata %s.%s = %lld is out of range [%lld, %lld]",
                       lk_gguf_path(g), arch, suffix, (long long)*out, (long long)lo, (long long)hi);
    return LK_OK;
}

/* Checks a tensor exists with shape [ne0, ne1] (ne1 = 0 for 1-D) and a type we compute with. */
static lk_status check_tensor(const lk_gguf *g, const char *name, int64_t ne0, int64_t ne1, bool f32_only,
                              const lk_gguf_tensor **out, char *err, size_t errlen) {
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, name);
    if (out) *out = t;
    if (!t) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing tensor '%s'", lk_gguf_path(g), name);
    int want_dims = ne1 ? 2 : 1;
    bool ok = (int64_t)t->ne[0] == ne0 && (ne1 ? (int64_t)t->ne[1] == ne1 && t->n_dims <= 2 : t->n_dims == 1);
    if (!ok)
        return lk_fail(err, errlen, LK_ERR_FORMAT,
                       "%s: tensor '%s' has shape [%llu, %llu] (%d dims), expected [%lld%s%lld] (%d dims)",
                       lk_gguf_path(g), name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], t->n_dims,
                       (long long)ne0, ne1 ? ", " : "", ne1 ? (long long)ne1 : 0LL, want_dims);
    if (f32_only && t->type != LK_TYPE_F32)
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s; lockstep expects f32 here",
                       lk_gguf_path(g), name, lk_type_name(t->type));
    if (!lk_type_supported(t->type))
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s, which lockstep cannot compute with yet",
                       lk_gguf_path(g), name, lk_type_name(t->type));
    return LK_OK;
}

lk_status lk_model_config_read(const lk_gguf *g, lk_model_config *c, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    const char *arch;
    size_t alen;
    if (!lk_gguf_get_str(g, "general.architecture", &arch, &alen))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing metadata key general.architecture", lk_gguf_path(g));
    if (alen >= sizeof c->arch_name) alen = sizeof c->arch_name - 1;
    memcpy(c->arch_name, arch, alen);
    c->arch_name[alen] = 0;
    if (!strcmp(c->arch_name, "llama") || !strcmp(c->arch_name, "mistral")) c->arch = LK_ARCH_LLAMA;
    else if (!strcmp(c->arch_name, "qwen2")) c->arch = LK_ARCH_QWEN2;
    else if (!strcmp(c->arch_name, "qwen3")) c->arch = LK_ARCH_QWEN3;
    else {
        char sa[101]; /* the file's bytes, escapes shown escaped */
        lk_str_sanitize(sa, sizeof sa, arch, alen);
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED,
                       "%s: architecture '%s' is not supported (supported: llama, mistral, qwen2, qwen3)",
                       lk_gguf_path(g), sa);
    }
    const char *a = c->arch_name;
    int64_t v;
    lk_status st;
    if ((st = need_i64(g, a, "embedding_length", 1, 1 << 20, &v, err, errlen))) return st;
    c->n_embd = (int)v;
    if ((st = need_i64(g, a, "block_count", 1, 4096, &v, err, errlen))) return st;
    c->n_layer = (int)v;
    if ((st = need_i64(g, a, "attention.head_count", 1, 4096, &v, err, errlen))) return st;
    c->n_head = (int)v;
    if (meta_i64(g, a, "attention.head_count_kv", &v)) {
        if (v < 1 || v > c->n_head || c->n_head % v)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.attention.head_count_kv = %lld does not divide head_count %d",
                           lk_gguf_path(g), a, (long long)v, c->n_head);
        c->n_head_kv = (int)v;
    } else c->n_head_kv = c->n_head;
    if ((st = need_i64(g, a, "feed_forward_length", 1, 1 << 24, &v, err, errlen))) return st;
    c->n_ff = v;
    c->head_dim = c->n_embd / c->n_head;
    if (meta_i64(g, a, "attention.key_length", &v)) {
        int64_t vl = v;
        if (v < 1 || v > 4096) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.attention.key_length = %lld out of range", lk_gguf_path(g), a, (long long)v);
        if (meta_i64(g, a, "attention.value_length", &vl) && vl != v)
            return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: key_length %lld != value_length %lld is not supported", lk_gguf_path(g), (long long)v, (long long)vl);
        c->head_dim = (int)v;
    }
    if (c->head_dim < 2 || c->head_dim % 2)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: head dimension %d must be even", lk_gguf_path(g), c->head_dim);
    c->n_ctx_train = meta_i64(g, a, "context_length", &v) && v > 0 && v < (1 << 24) ? (int)v : 2048;
    double f;
    c->rms_eps = meta_f64(g, a, "attention.layer_norm_rms_epsilon", &f) ? (float)f : 1e-5f;
    if (!(c->rms_eps > 0 && c->rms_eps < 1))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rms epsilon %g out of range", lk_gguf_path(g), (double)c->rms_eps);
    c->rope_base = meta_f64(g, a, "rope.freq_base", &f) ? (float)f : 10000.0f;
    if (!(c->rope_base > 1)) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rope.freq_base %g out of range", lk_gguf_path(g), (double)c->rope_base);
    c->rope_dim = meta_i64(g, a, "rope.dimension_count", &v) ? (int)v : c->head_dim;
    if (c->rope_dim < 2 || c->rope_dim > c->head_dim || c->rope_dim % 2)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rope.dimension_count %d must be even and <= head dim %d", lk_gguf_path(g), c->rope_dim, c->head_dim);
    const char *rs;
    size_t rslen;
    char key[160];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (lk_gguf_get_str(g, key, &rs, &rslen) && !(rslen == 4 && !memcmp(rs, "none", 4)) &&
        !(rslen == 6 && !memcmp(rs, "linear", 6))) {
        char ss[101];
        lk_str_sanitize(ss, sizeof ss, rs, rslen);
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: rope scaling type '%s' is not supported (none, linear)",
                       lk_gguf_path(g), ss);
    }
    snprintf(key, sizeof key, "%s.rope.scaling.factor", a);
    if (lk_gguf_get_f64(g, key, &f) && f != 1.0 && f != 0.0)
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: rope scaling factor %g is not supported yet", lk_gguf_path(g), f);
    c->rope_neox = c->arch != LK_ARCH_LLAMA;
    c->has_qkv_bias = c->arch == LK_ARCH_QWEN2;
    c->has_qk_norm = c->arch == LK_ARCH_QWEN3;

    /* tensors */
    const lk_gguf_tensor *emb = lk_gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing tensor 'token_embd.weight'", lk_gguf_path(g));
    c->n_vocab = (int64_t)emb->ne[1];
    if ((st = check_tensor(g, "token_embd.weight", c->n_embd, c->n_vocab, false, NULL, err, errlen))) return st;
    if ((st = check_tensor(g, "output_norm.weight", c->n_embd, 0, true, NULL, err, errlen))) return st;
    c->tied_output = lk_gguf_find_tensor(g, "output.weight") == NULL;
    if (!c->tied_output && (st = check_tensor(g, "output.weight", c->n_embd, c->n_vocab, false, NULL, err, errlen))) return st;
    c->has_rope_freqs = lk_gguf_find_tensor(g, "rope_freqs.weight") != NULL;
    if (c->has_rope_freqs && (st = check_tensor(g, "rope_freqs.weight", c->rope_dim / 2, 0, true, NULL, err, errlen))) return st;
    const int64_t d = c->n_embd, hd = c->head_dim, qd = (int64_t)c->n_head * hd, kvd = (int64_t)c->n_head_kv * hd;
    for (int l = 0; l < c->n_layer; l++) {
        char n[96];
#define T(name, ne0, ne1, f32) \
        do { snprintf(n, sizeof n, "blk.%d.%s", l, name); \
             if ((st = check_tensor(g, n, ne0, ne1, f32, NULL, err, errlen))) return st; } while (0)
        T("attn_norm.weight", d, 0, true);
        T("attn_q.weight", d, qd, false);
        T("attn_k.weight", d, kvd, false);
        T("attn_v.weight", d, kvd, false);
        T("attn_output.weight", qd, d, false);
        T("ffn_norm.weight", d, 0, true);
        T("ffn_gate.weight", d, c->n_ff, false);
        T("ffn_up.weight", d, c->n_ff, false);
        T("ffn_down.weight", c->n_ff, d, false);
        if (c->has_qkv_bias) {
            T("attn_q.bias", qd, 0, true);
            T("attn_k.bias", kvd, 0, true);
            T("attn_v.bias", kvd, 0, true);
        }
        if (c->has_qk_norm) {
            T("attn_q_norm.weight", hd, 0, true);
            T("attn_k_norm.weight", hd, 0, true);
        }
#undef T
    }
    return LK_OK;
}

static int64_t block_of(const lk_gguf *g, const char *name) {
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, name);
    return t ? lk_type_block_size(t->type) : 1;
}

static int64_t lcm64(int64_t a, int64_t b) {
    int64_t x = a, y = b;
    while (y) { int64_t t = x % y; x = y; y = t; }
    return a / x * b;
}

void lk_model_plan_dims(const lk_gguf *g, const lk_model_config *c, lk_plan_dims *d) {
    memset(d, 0, sizeof *d);
    d->n_layer = c->n_layer;
    d->n_head = c->n_head;
    d->n_head_kv = c->n_head_kv;
    d->n_ff = c->n_ff;
    d->n_vocab = c->n_vocab;
    /* Wo and W2 are cut along their input columns: a cut must fall on a
     * quantisation block, so heads go in groups of block/head_dim and FFN
     * rows in multiples of the block. Output rows need no alignment. */
    int64_t wo_blk = 1, w2_blk = 1;
    for (int l = 0; l < c->n_layer; l++) {
        char n[96];
        snprintf(n, sizeof n, "blk.%d.attn_output.weight", l);
        wo_blk = lcm64(wo_blk, block_of(g, n));
        snprintf(n, sizeof n, "blk.%d.ffn_down.weight", l);
        w2_blk = lcm64(w2_blk, block_of(g, n));
    }
    int64_t ha = 1;
    while ((ha * c->head_dim) % wo_blk) ha++;
    d->head_align = (int)ha;
    d->ff_align = w2_blk;
    d->vocab_align = 1;
}

/* ---------------------------------------------------------------- load */

static lk_mat mat_rows(const lk_gguf_tensor *t, int64_t r0, int64_t r1) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    return (lk_mat){ .type = (lk_type)t->type, .cols = (int64_t)t->ne[0], .rows = r1 - r0,
                     .data = (const char *)t->data + (size_t)r0 * rb, .row_stride = rb };
}

static lk_mat mat_cols(const lk_gguf_tensor *t, int64_t c0, int64_t c1) {
    size_t rb = 0, off = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    LK_ASSERT(c0 % lk_type_block_size(t->type) == 0);
    LK_ASSERT(c0 == 0 || lk_type_row_bytes(t->type, c0, &off));
    return (lk_mat){ .type = (lk_type)t->type, .cols = c1 - c0, .rows = (int64_t)t->ne[1],
                     .data = (const char *)t->data + off, .row_stride = rb };
}

static uint64_t mat_bytes(const lk_mat *m) {
    size_t rb = 0;
    lk_type_row_bytes(m->type, m->cols, &rb);
    return (uint64_t)rb * (uint64_t)m->rows;
}

static const lk_gguf_tensor *tensor(const lk_gguf *g, int l, const char *name) {
    char n[96];
    if (l >= 0) snprintf(n, sizeof n, "blk.%d.%s", l, name);
    else snprintf(n, sizeof n, "%s", name);
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, n);
    LK_ASSERT(t); /* checked by lk_model_config_read */
    return t;
}

void lk_model_free(lk_model *m) {
    if (!m) return;
    if (m->arena) munmap(m->arena, m->arena_len);
    if (m->own_pool) lk_pool_free(m->pool);
    free(m->layers);
    free(m->rope_cos); free(m->rope_sin);
    free(m->kcache); free(m->vcache);
    free(m->page_ref); free(m->free_pages); free(m->ptab); free(m->seq_len);
    free(m->items); free(m->item_row0); free(m->row_item); free(m->row_pos); free(m->task0); free(m->out_rows);
    free(m->x); free(m->xb); free(m->q); free(m->k); free(m->v); free(m->att); free(m->o);
    free(m->hg); free(m->hu); free(m->scores); free(m->act);
    free(m);
}

/* A slice may hold no attention heads or no FFN rows (small or coarsely
 * quantised models split over many ranks: see parallel/plan.c); it then adds
 * zeros for that part to the all-reduce. */
static lk_status check_slice(const lk_model_config *c, const lk_slice *s, char *err, size_t errlen) {
    int group = c->n_head / c->n_head_kv;
    bool heads_ok = s->head0 == s->head1 ? s->kv_head0 == s->kv_head1 && s->head0 >= 0 && s->head0 <= c->n_head
                  : s->head0 >= 0 && s->head0 < s->head1 && s->head1 <= c->n_head &&
                    s->kv_head0 >= 0 && s->kv_head0 < s->kv_head1 && s->kv_head1 <= c->n_head_kv &&
                    s->kv_head0 <= s->head0 / group && s->kv_head1 > (s->head1 - 1) / group;
    bool ok = heads_ok && s->layer0 >= 0 && s->layer0 < s->layer1 && s->layer1 <= c->n_layer &&
              s->ff0 >= 0 && s->ff0 <= s->ff1 && s->ff1 <= c->n_ff && (s->ff1 > s->ff0 || s->head1 > s->head0) &&
              s->vocab0 >= 0 && s->vocab0 < s->vocab1 && s->vocab1 <= c->n_vocab;
    if (!ok)
        return lk_fail(err, errlen, LK_ERR_ARG,
                       "slice does not fit the model: layers [%d,%d) heads [%d,%d) kv [%d,%d) ff [%lld,%lld) vocab [%lld,%lld)",
                       s->layer0, s->layer1, s->head0, s->head1, s->kv_head0, s->kv_head1,
                       (long long)s->ff0, (long long)s->ff1, (long long)s->vocab0, (long long)s->vocab1);
    return LK_OK;
}

/* ---- the huge-page weight arena (see the file comment) ---- */

static bool thp_available(void) {
    const char *env = getenv("LK_WEIGHTS");
    if (env && !strcmp(env, "mmap")) return false;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false;
    char buf[128] = {0};
    bool ok = fgets(buf, sizeof buf, f) && !strstr(buf, "[never]");
    fclose(f);
    return ok;
}

typedef struct {
    lk_mat **mats;
    int n;
    uint8_t *dst0;
    const size_t *off;
} copy_job;

static size_t compact_bytes(const lk_mat *w) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(w->type, w->cols, &rb));
    return rb * (size_t)w->rows;
}

/* Drops this process's pages of [p, p+len) of the read-only file mapping
 * (whole pages inside the range only; they are refetched if read again). */
static void drop_file_pages(const void *p, size_t len) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)p + pg - 1) & ~(pg - 1), b = ((uintptr_t)p + len) & ~(pg - 1);
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
}

/* Copies matrices i = ith, ith+nth, ... into the arena, rows packed. */
static void copy_fn(void *arg, int ith, int nth) {
    copy_job *j = arg;
    for (int i = ith; i < j->n; i += nth) {
        lk_mat *w = j->mats[i];
        size_t rb = 0;
        LK_ASSERT(lk_type_row_bytes(w->type, w->cols, &rb));
        uint8_t *dst = j->dst0 + j->off[i];
        const uint8_t *src = w->data;
        if (w->row_stride == rb) memcpy(dst, src, rb * (size_t)w->rows);
        else
            for (int64_t r = 0; r < w->rows; r++) memcpy(dst + (size_t)r * rb, src + (size_t)r * w->row_stride, rb);
        /* at once, so the process never holds both copies of much more than one matrix */
        drop_file_pages(src, (size_t)(w->rows - 1) * w->row_stride + rb);
    }
}

static void weights_to_arena(lk_model *m, lk_mat **mats, int n) {
    if (n == 0 || !thp_available()) return;
    const size_t huge = (size_t)2 << 20;
    size_t *off = lk_xmalloc(sizeof(size_t) * (size_t)n), total = 0;
    for (int i = 0; i < n; i++) {
        off[i] = total;
        total += (compact_bytes(mats[i]) + 63) & ~(size_t)63;
    }
    /* A model larger than free memory still runs from the file mapping
     * (paged in and out by the kernel); an anonymous copy would not fit. */
    uint64_t avail = lk_mem_available();
    if (avail && total > avail / 10 * 9) {
        lk_log(LK_LOG_WARN, "model: %zu MiB of weights but %llu MiB of memory available: keeping them on the file "
                            "mapping (slower decode)", total >> 20, (unsigned long long)(avail >> 20));
        free(off);
        return;
    }
    size_t len = (total + huge - 1) / huge * huge + huge; /* room to align the start */
    void *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        lk_log(LK_LOG_WARN, "model: no memory for a %zu MiB huge-page copy of the weights; using the file mapping "
                            "(slower decode)", len >> 20);
        free(off);
        return;
    }
    uint8_t *dst = (uint8_t *)(((uintptr_t)map + huge - 1) & ~(uintptr_t)(huge - 1));
    madvise(dst, len - (size_t)(dst - (uint8_t *)map), MADV_HUGEPAGE);
    copy_job j = {mats, n, dst, off};
    lk_pool_run(m->pool, copy_fn, &j);
    for (int i = 0; i < n; i++) {
        lk_mat *w = mats[i];
        size_t rb = 0;
        LK_ASSERT(lk_type_row_bytes(w->type, w->cols, &rb));
        w->data = dst + off[i];
        w->row_stride = rb;
    }
    m->arena = map;
    m->arena_len = len;
    free(off);
}

lk_status lk_model_load(const lk_gguf *g, const lk_slice *slice, const lk_model_params *p,
                        lk_model **out, char *err, size_t errlen) {
    *out = NULL;
    lk_model_config cfg;
    lk_status st = lk_model_config_read(g, &cfg, err, errlen);
    if (st) return st;
    lk_plan_dims dims;
    lk_model_plan_dims(g, &cfg, &dims);
    lk_slice sl;
    if (slice) sl = *slice;
    else lk_slice_full(&dims, &sl);
    if ((st = check_slice(&cfg, &sl, err, errlen))) return st;
    /* column cuts must be on block boundaries */
    for (int l = sl.layer0; l < sl.layer1; l++) {
        int64_t bo = lk_type_block_size(tensor(g, l, "attn_output.weight")->type);
        int64_t bd = lk_type_block_size(tensor(g, l, "ffn_down.weight")->type);
        if (((int64_t)sl.head0 * cfg.head_dim) % bo || (((int64_t)sl.head1 * cfg.head_dim) % bo && sl.head1 != cfg.n_head))
            return lk_fail(err, errlen, LK_ERR_ARG, "heads [%d,%d) cut blk.%d.attn_output.weight inside a %lld-element block",
                           sl.head0, sl.head1, l, (long long)bo);
        if (sl.ff0 % bd || (sl.ff1 % bd && sl.ff1 != cfg.n_ff))
            return lk_fail(err, errlen, LK_ERR_ARG, "FFN rows [%lld,%lld) cut blk.%d.ffn_down.weight inside a %lld-element block",
                           (long long)sl.ff0, (long long)sl.ff1, l, (long long)bd);
    }

    lk_model *m = lk_xcalloc(1, sizeof *m);
    m->cfg = cfg;
    m->sl = sl;
    m->g = g;
    m->nh = sl.head1 - sl.head0;
    m->nkv = sl.kv_head1 - sl.kv_head0;
    m->nff = sl.ff1 - sl.ff0;
    m->nvoc = sl.vocab1 - sl.vocab0;
    m->n_ctx = p && p->n_ctx > 0 ? p->n_ctx : LK_MIN(cfg.n_ctx_train, 4096);
    m->n_batch = p && p->n_batch > 0 ? p->n_batch : 512;
    if (m->n_batch > m->n_ctx) m->n_batch = m->n_ctx;
    m->kv_f16 = p && p->kv_f16;
    if (p && p->pool) m->pool = p->pool;
    else { m->pool = lk_pool_create(p ? p->n_threads : 0); m->own_pool = true; }

    const int64_t d = cfg.n_embd, hd = cfg.head_dim;
    m->tok_embd = tensor(g, -1, "token_embd.weight");
    m->out_norm = tensor(g, -1, "output_norm.weight")->data;
    const lk_gguf_tensor *wout = cfg.tied_output ? m->tok_embd : tensor(g, -1, "output.weight");
    m->wout = mat_rows(wout, sl.vocab0, sl.vocab1);
    m->weight_bytes = sl.pp_rank == sl.pp_size - 1 ? mat_bytes(&m->wout) : 0;
    int nl = sl.layer1 - sl.layer0;
    m->layers = lk_xcalloc((size_t)nl, sizeof(layer_w));
    for (int i = 0; i < nl; i++) {
        int l = sl.layer0 + i;
        layer_w *w = &m->layers[i];
        w->attn_norm = tensor(g, l, "attn_norm.weight")->data;
        w->ffn_norm = tensor(g, l, "ffn_norm.weight")->data;
        w->wq = mat_rows(tensor(g, l, "attn_q.weight"), sl.head0 * hd, sl.head1 * hd);
        w->wk = mat_rows(tensor(g, l, "attn_k.weight"), sl.kv_head0 * hd, sl.kv_head1 * hd);
        w->wv = mat_rows(tensor(g, l, "attn_v.weight"), sl.kv_head0 * hd, sl.kv_head1 * hd);
        w->wo = mat_cols(tensor(g, l, "attn_output.weight"), sl.head0 * hd, sl.head1 * hd);
        w->w1 = mat_rows(tensor(g, l, "ffn_gate.weight"), sl.ff0, sl.ff1);
        w->w3 = mat_rows(tensor(g, l, "ffn_up.weight"), sl.ff0, sl.ff1);
        w->w2 = mat_cols(tensor(g, l, "ffn_down.weight"), sl.ff0, sl.ff1);
        if (cfg.has_qkv_bias) {
            w->bq = (const float *)tensor(g, l, "attn_q.bias")->data + sl.head0 * hd;
            w->bk = (const float *)tensor(g, l, "attn_k.bias")->data + sl.kv_head0 * hd;
            w->bv = (const float *)tensor(g, l, "attn_v.bias")->data + sl.kv_head0 * hd;
        }
        if (cfg.has_qk_norm) {
            w->q_norm = tensor(g, l, "attn_q_norm.weight")->data;
            w->k_norm = tensor(g, l, "attn_k_norm.weight")->data;
        }
        m->weight_bytes += mat_bytes(&w->wq) + mat_bytes(&w->wk) + mat_bytes(&w->wv) + mat_bytes(&w->wo) +
                           mat_bytes(&w->w1) + mat_bytes(&w->w2) + mat_bytes(&w->w3);
    }
    {
        lk_mat **mats = lk_xmalloc(sizeof(lk_mat *) * (size_t)(7 * nl + 1));
        int nm = 0;
        if (sl.pp_rank == sl.pp_size - 1) mats[nm++] = &m->wout;
        for (int i = 0; i < nl; i++) {
            layer_w *w = &m->layers[i];
            lk_mat *all[7] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w1, &w->w3, &w->w2};
            for (int k = 0; k < 7; k++)
                if (all[k]->rows > 0 && all[k]->cols > 0) mats[nm++] = all[k];
        }
        weights_to_arena(m, mats, nm);
        free(mats);
    }

    /* RoPE table, computed like ggml: theta_i = pos * base^(-2i/rope_dim)
     * by repeated multiplication in float, divided by the llama3 factor. */
    const int half = cfg.rope_dim / 2;
    m->rope_cos = lk_xmalloc(sizeof(float) * (size_t)m->n_ctx * half);
    m->rope_sin = lk_xmalloc(sizeof(float) * (size_t)m->n_ctx * half);
    const float *ff = cfg.has_rope_freqs ? tensor(g, -1, "rope_freqs.weight")->data : NULL;
    const float theta_scale = powf(cfg.rope_base, -2.0f / (float)cfg.rope_dim);
    for (int pos = 0; pos < m->n_ctx; pos++) {
        float theta = (float)pos;
        for (int i = 0; i < half; i++) {
            float t = ff ? theta / ff[i] : theta;
            m->rope_cos[(size_t)pos * half + i] = cosf(t);
            m->rope_sin[(size_t)pos * half + i] = sinf(t);
            theta *= theta_scale;
        }
    }

    m->max_seqs = p && p->max_seqs > 0 ? p->max_seqs : 1;
    m->max_pps = (m->n_ctx + LK_KV_PAGE - 1) / LK_KV_PAGE;
    int64_t kv_tokens = p && p->kv_tokens > 0 ? p->kv_tokens : (int64_t)m->max_seqs * m->n_ctx;
    m->n_pages = LK_MAX((kv_tokens + LK_KV_PAGE - 1) / LK_KV_PAGE, 1);
    m->page_elems = (size_t)nl * m->nkv * LK_KV_PAGE * hd;
    size_t esz = m->kv_f16 ? 2 : 4;
    /* calloc: pages never written are zeros (a copy of a page copies its
     * unwritten tail too; nothing ever reads it) */
    m->kcache = m->page_elems ? lk_xcalloc((size_t)m->n_pages * m->page_elems, esz) : NULL;
    m->vcache = m->page_elems ? lk_xcalloc((size_t)m->n_pages * m->page_elems, esz) : NULL;
    m->page_ref = lk_xcalloc((size_t)m->n_pages, sizeof(int32_t));
    m->free_pages = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_pages);
    /* popped from the end: page 0 first */
    for (int64_t i = 0; i < m->n_pages; i++) m->free_pages[i] = (int32_t)(m->n_pages - 1 - i);
    m->n_free = m->n_pages;
    m->ptab = lk_xmalloc(sizeof(int32_t) * (size_t)m->max_seqs * m->max_pps);
    for (size_t i = 0; i < (size_t)m->max_seqs * m->max_pps; i++) m->ptab[i] = -1;
    m->seq_len = lk_xcalloc((size_t)m->max_seqs, sizeof(int32_t));
    m->items = lk_xmalloc(sizeof(lk_batch_item) * (size_t)m->n_batch);
    m->item_row0 = lk_xmalloc(sizeof(int32_t) * (size_t)(m->n_batch + 1));
    m->row_item = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_batch);
    m->row_pos = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_batch);
    m->task0 = lk_xmalloc(sizeof(int64_t) * (size_t)(m->n_batch + 1));
    m->out_rows = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_batch);

    const size_t B = (size_t)m->n_batch;
    m->x = lk_xmalloc_aligned(sizeof(float) * B * d);
    m->xb = lk_xmalloc_aligned(sizeof(float) * B * LK_MAX(d, m->nh * hd));
    m->q = lk_xmalloc_aligned(sizeof(float) * B * m->nh * hd);
    m->k = lk_xmalloc_aligned(sizeof(float) * B * m->nkv * hd);
    m->v = lk_xmalloc_aligned(sizeof(float) * B * m->nkv * hd);
    m->att = lk_xmalloc_aligned(sizeof(float) * B * m->nh * hd);
    m->o = lk_xmalloc_aligned(sizeof(float) * B * d);
    m->hg = lk_xmalloc_aligned(sizeof(float) * B * m->nff);
    m->hu = lk_xmalloc_aligned(sizeof(float) * B * m->nff);
    m->scores = lk_xmalloc_aligned(sizeof(float) * (size_t)lk_pool_size(m->pool) * ATT_QB * m->n_ctx);
    int64_t maxcols = LK_MAX(LK_MAX(d, m->nff), (int64_t)m->nh * hd);
    m->act = lk_xmalloc_aligned(lk_matmul_scratch_bytes(maxcols, (int64_t)B));
    *out = m;
    return LK_OK;
}

const lk_model_config *lk_model_cfg(const lk_model *m) { return &m->cfg; }
const lk_slice *lk_model_slice(const lk_model *m) { return &m->sl; }
int lk_model_n_ctx(const lk_model *m) { return m->n_ctx; }
int lk_model_n_batch(const lk_model *m) { return m->n_batch; }
int lk_model_threads(const lk_model *m) { return lk_pool_size(m->pool); }
void lk_model_set_hooks(lk_model *m, const lk_tp_hooks *h) { if (h) m->hooks = *h; else memset(&m->hooks, 0, sizeof m->hooks); }
uint64_t lk_model_weight_bytes(const lk_model *m) { return m->weight_bytes; }
float *lk_model_hidden(lk_model *m) { return m->x; }

/* ---- sequences and pages ---- */

int lk_model_max_seqs(const lk_model *m) { return m->max_seqs; }
int lk_model_seq_len(const lk_model *m, int seq) { return seq >= 0 && seq < m->max_seqs ? m->seq_len[seq] : 0; }
int64_t lk_model_pages_total(const lk_model *m) { return m->n_pages; }
int64_t lk_model_pages_free(const lk_model *m) { return m->n_free; }

static int32_t *ptab_of(const lk_model *m, int seq) { return m->ptab + (size_t)seq * m->max_pps; }

static void page_release(lk_model *m, int32_t pg) {
    LK_ASSERT(pg >= 0 && pg < m->n_pages && m->page_ref[pg] > 0);
    if (--m->page_ref[pg] == 0) m->free_pages[m->n_free++] = pg;
}

int64_t lk_model_pages_needed(const lk_model *m, int seq, int n) {
    if (seq < 0 || seq >= m->max_seqs || n <= 0) return 0;
    const int32_t *pt = ptab_of(m, seq);
    int pos0 = m->seq_len[seq];
    int64_t need = 0;
    for (int j = pos0 / LK_KV_PAGE; j <= (pos0 + n - 1) / LK_KV_PAGE && j < m->max_pps; j++)
        if (pt[j] < 0 || m->page_ref[pt[j]] > 1) need++;
    return need;
}

static lk_status check_seq(const lk_model *m, int seq, const char *what, char *err, size_t errlen) {
    if (seq < 0 || seq >= m->max_seqs)
        return lk_fail(err, errlen, LK_ERR_ARG, "%s: sequence slot %d out of range (%d slots)", what, seq, m->max_seqs);
    return LK_OK;
}

lk_status lk_model_seq_keep(lk_model *m, int seq, int n, char *err, size_t errlen) {
    lk_status st = check_seq(m, seq, "keep", err, errlen);
    if (st) return st;
    if (n < 0 || n > m->seq_len[seq])
        return lk_fail(err, errlen, LK_ERR_ARG, "keep: slot %d holds %d positions, cannot keep %d", seq, m->seq_len[seq], n);
    int32_t *pt = ptab_of(m, seq);
    for (int j = (n + LK_KV_PAGE - 1) / LK_KV_PAGE; j < m->max_pps && pt[j] >= 0; j++) {
        page_release(m, pt[j]);
        pt[j] = -1;
    }
    m->seq_len[seq] = n;
    return LK_OK;
}

lk_status lk_model_seq_fork(lk_model *m, int dst, int src, int n, char *err, size_t errlen) {
    lk_status st;
    if ((st = check_seq(m, dst, "fork", err, errlen)) || (st = check_seq(m, src, "fork", err, errlen))) return st;
    if (dst == src || n < 0 || n > m->seq_len[src])
        return lk_fail(err, errlen, LK_ERR_ARG, "fork: slot %d from slot %d (%d positions) with %d positions", dst, src,
                       m->seq_len[src], n);
    if ((st = lk_model_seq_keep(m, dst, 0, err, errlen))) return st;
    const int32_t *ps = ptab_of(m, src);
    int32_t *pd = ptab_of(m, dst);
    for (int j = 0; j < (n + LK_KV_PAGE - 1) / LK_KV_PAGE; j++) {
        pd[j] = ps[j];
        m->page_ref[ps[j]]++;
    }
    m->seq_len[dst] = n;
    return LK_OK;
}

/* Makes positions [pos0, pos0+n) of seq writable: new pages, and private
 * copies of shared ones. The caller checked the free count. */
static void pages_take(lk_model *m, int seq, int pos0, int n) {
    int32_t *pt = ptab_of(m, seq);
    const size_t bytes = m->page_elems * (m->kv_f16 ? 2 : 4);
    for (int j = pos0 / LK_KV_PAGE; j <= (pos0 + n - 1) / LK_KV_PAGE; j++) {
        if (pt[j] >= 0 && m->page_ref[pt[j]] == 1) continue;
        LK_ASSERT(m->n_free > 0);
        int32_t pg = m->free_pages[--m->n_free];
        m->page_ref[pg] = 1;
        if (pt[j] >= 0) { /* copy on write */
            if (bytes) {
                memcpy((char *)m->kcache + (size_t)pg * bytes, (char *)m->kcache + (size_t)pt[j] * bytes, bytes);
                memcpy((char *)m->vcache + (size_t)pg * bytes, (char *)m->vcache + (size_t)pt[j] * bytes, bytes);
            }
            page_release(m, pt[j]);
        }
        pt[j] = pg;
    }
}

lk_status lk_model_batch(lk_model *m, const lk_batch_item *items, int n_items, char *err, size_t errlen) {
    m->n_items = m->n_rows = 0;
    if (n_items < 1 || n_items > m->n_batch)
        return lk_fail(err, errlen, LK_ERR_ARG, "batch of %d items (1..%d)", n_items, m->n_batch);
    int rows = 0;
    int64_t need = 0;
    for (int i = 0; i < n_items; i++) {
        const lk_batch_item *it = &items[i];
        lk_status st = check_seq(m, it->seq, "batch", err, errlen);
        if (st) return st;
        for (int k = 0; k < i; k++)
            if (items[k].seq == it->seq)
                return lk_fail(err, errlen, LK_ERR_ARG, "batch: slot %d appears twice", it->seq);
        if (it->n < 1 || it->n > m->n_batch - rows)
            return lk_fail(err, errlen, LK_ERR_ARG, "batch: item %d has %d tokens; the batch holds %d", i, it->n, m->n_batch);
        if (it->pos0 != m->seq_len[it->seq])
            return lk_fail(err, errlen, LK_ERR_ARG, "batch: slot %d holds %d positions but item %d starts at %d", it->seq,
                           m->seq_len[it->seq], i, it->pos0);
        if ((int64_t)it->pos0 + it->n > m->n_ctx)
            return lk_fail(err, errlen, LK_ERR_ARG, "context full: positions %d..%d of slot %d do not fit in --ctx %d",
                           it->pos0, it->pos0 + it->n - 1, it->seq, m->n_ctx);
        rows += it->n;
        need += lk_model_pages_needed(m, it->seq, it->n);
    }
    if (need > m->n_free)
        return lk_fail(err, errlen, LK_ERR_NOMEM, "KV cache full: the batch needs %lld pages, %lld of %lld are free (--kv-budget)",
                       (long long)need, (long long)m->n_free, (long long)m->n_pages);
    int64_t tasks = 0;
    rows = 0;
    for (int i = 0; i < n_items; i++) {
        const lk_batch_item *it = &items[i];
        pages_take(m, it->seq, it->pos0, it->n);
        m->seq_len[it->seq] = it->pos0 + it->n;
        m->items[i] = *it;
        m->item_row0[i] = rows;
        m->task0[i] = tasks;
        for (int t = 0; t < it->n; t++) {
            m->row_item[rows + t] = i;
            m->row_pos[rows + t] = it->pos0 + t;
        }
        rows += it->n;
        tasks += (int64_t)((it->n + ATT_QB - 1) / ATT_QB) * m->nh;
    }
    m->item_row0[n_items] = rows;
    m->task0[n_items] = tasks;
    m->n_items = n_items;
    m->n_rows = rows;
    return LK_OK;
}

int lk_model_batch_rows(const lk_model *m) { return m->n_rows; }

/* ---------------------------------------------------------------- forward */

lk_status lk_model_embed(lk_model *m, const int32_t *tokens, int n, float *x) {
    LK_ASSERT(n >= 0 && n <= m->n_batch);
    const lk_gguf_tensor *e = m->tok_embd;
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(e->type, (int64_t)e->ne[0], &rb));
    for (int t = 0; t < n; t++) {
        LK_ASSERT(tokens[t] >= 0 && tokens[t] < m->cfg.n_vocab); /* callers validate ids */
        lk_dequantize_row((lk_type)e->type, (const char *)e->data + (size_t)tokens[t] * rb, x + (size_t)t * m->cfg.n_embd, m->cfg.n_embd);
    }
    return LK_OK;
}

static void rope(const lk_model *m, float *v, int pos) {
    const int half = m->cfg.rope_dim / 2;
    const float *c = m->rope_cos + (size_t)pos * half, *s = m->rope_sin + (size_t)pos * half;
    if (m->cfg.rope_neox) {
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * c[i] - b * s[i];
            v[i + half] = a * s[i] + b * c[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * c[i] - b * s[i];
            v[2 * i + 1] = a * s[i] + b * c[i];
        }
    }
}

typedef struct {
    lk_model *m;
    int li;
} attn_job;

/* Offset (in elements, into kcache/vcache) of the LK_KV_PAGE keys/values
 * of page j of slot seq for KV head kvh of layer li (both local). */
static size_t kv_page_kv(const lk_model *m, int seq, int j, int li, int kvh) {
    const int32_t pg = ptab_of(m, seq)[j];
    return (size_t)pg * m->page_elems + ((size_t)li * m->nkv + (size_t)kvh) * LK_KV_PAGE * m->cfg.head_dim;
}
/* ... for the KV head that query head h (local) attends to. */
static size_t kv_page(const lk_model *m, int seq, int j, int li, int h) {
    const int group = m->cfg.n_head / m->cfg.n_head_kv;
    return kv_page_kv(m, seq, j, li, (m->sl.head0 + h) / group - m->sl.kv_head0);
}

/* F16 cache: one task per (row, head), pages walked in order (the same
 * arithmetic as one contiguous cache). Tasks are dealt round-robin: a row
 * attends to pos+1 positions, so contiguous ranges gave the last thread
 * ~3x the work of the first in a 512-token prefill. */
static void attn_f16_fn(void *arg, int ith, int nth) {
    attn_job *j = arg;
    lk_model *m = j->m;
    const int hd = m->cfg.head_dim;
    const float scale = 1.0f / sqrtf((float)hd);
    float *sc = m->scores + (size_t)ith * ATT_QB * m->n_ctx;
    for (int64_t task = ith; task < (int64_t)m->n_rows * m->nh; task += nth) {
        int t = (int)(task / m->nh), h = (int)(task % m->nh);
        int seq = m->items[m->row_item[t]].seq, npos = m->row_pos[t] + 1;
        const float *q = m->q + ((size_t)t * m->nh + h) * hd;
        for (int pg = 0; pg * LK_KV_PAGE < npos; pg++) {
            const uint16_t *k = (const uint16_t *)m->kcache + kv_page(m, seq, pg, j->li, h);
            int np = LK_MIN(LK_KV_PAGE, npos - pg * LK_KV_PAGE);
            for (int p = 0; p < np; p++) sc[pg * LK_KV_PAGE + p] = lk_vec_dot_f16(q, k + (size_t)p * hd, hd) * scale;
        }
        lk_softmax(sc, npos);
        float *out = m->att + ((size_t)t * m->nh + h) * hd;
        memset(out, 0, sizeof(float) * hd);
        for (int pg = 0; pg * LK_KV_PAGE < npos; pg++) {
            const uint16_t *v = (const uint16_t *)m->vcache + kv_page(m, seq, pg, j->li, h);
            int np = LK_MIN(LK_KV_PAGE, npos - pg * LK_KV_PAGE);
            for (int p = 0; p < np; p++) lk_vec_axpy_f16(out, sc[pg * LK_KV_PAGE + p], v + (size_t)p * hd, hd);
        }
    }
}

/* F32 cache (prefill and decode): one task per (item, head, block of ATT_QB
 * of the item's queries). The block's scores against every key it may see
 * are F32 matrix products, one per page (keys as weight rows, queries as
 * tokens), instead of one short dot-product call per (query, key):
 * attention was a third of a 512-token prefill. Scores past a query's
 * causal limit are computed and ignored. Blocks never mix sequences, so a
 * row's arithmetic depends on its own sequence only. */
static void attn_block_fn(void *arg, int ith, int nth) {
    attn_job *j = arg;
    lk_model *m = j->m;
    const int hd = m->cfg.head_dim;
    const float scale = 1.0f / sqrtf((float)hd);
    float *S = m->scores + (size_t)ith * ATT_QB * m->n_ctx;
    const int64_t ntask = m->task0[m->n_items];
    int it = 0;
    for (int64_t task = ith; task < ntask; task += nth) {
        while (task >= m->task0[it + 1]) it++;
        const lk_batch_item *item = &m->items[it];
        const int64_t local = task - m->task0[it];
        const int qb = (int)(local / m->nh), h = (int)(local % m->nh);
        const int t0 = qb * ATT_QB, t1 = LK_MIN(item->n, t0 + ATT_QB), r0 = m->item_row0[it];
        const int nmax = item->pos0 + t1;
        for (int pg = 0; pg * LK_KV_PAGE < nmax; pg++)
            lk_quant_matmul(LK_TYPE_F32, hd, LK_MIN(LK_KV_PAGE, nmax - pg * LK_KV_PAGE),
                            (const float *)m->kcache + kv_page(m, item->seq, pg, j->li, h), sizeof(float) * (size_t)hd,
                            t1 - t0, m->q + ((size_t)(r0 + t0) * m->nh + h) * hd, sizeof(float) * (size_t)m->nh * hd,
                            S + (size_t)pg * LK_KV_PAGE, (size_t)m->n_ctx);
        for (int t = t0; t < t1; t++) {
            float *sc = S + (size_t)(t - t0) * m->n_ctx;
            int npos = item->pos0 + t + 1;
            for (int p = 0; p < npos; p++) sc[p] *= scale;
            lk_softmax(sc, npos);
            for (int p = npos; p < nmax; p++) sc[p] = 0; /* beyond its causal limit */
        }
        /* weighted sums of values, 4 queries per pass over each page's value rows */
        for (int t = t0; t < t1; t += 4) {
            int nq = LK_MIN(4, t1 - t), npos = item->pos0 + t + nq;
            float *out = m->att + ((size_t)(r0 + t) * m->nh + h) * hd;
            for (int q = 0; q < nq; q++) memset(out + (size_t)q * m->nh * hd, 0, sizeof(float) * hd);
            for (int pg = 0; pg * LK_KV_PAGE < npos; pg++)
                lk_vec_attn_av_f32(out, (size_t)m->nh * hd, S + (size_t)(t - t0) * m->n_ctx + (size_t)pg * LK_KV_PAGE,
                                   (size_t)m->n_ctx, (const float *)m->vcache + kv_page(m, item->seq, pg, j->li, h),
                                   LK_MIN(LK_KV_PAGE, npos - pg * LK_KV_PAGE), nq, hd);
        }
    }
}

static lk_status allreduce(lk_model *m, float *x, int64_t n, int layer, const char *what) {
    if (!m->hooks.allreduce_sum) return LK_OK;
    return m->hooks.allreduce_sum(m->hooks.ctx, x, n, layer, what);
}

/* This rank's share of attention for layer li over the current batch:
 * o = Wo_slice . attn(x). A rank without heads contributes zeros. */
static void attention(lk_model *m, int li, const float *x) {
    const lk_model_config *c = &m->cfg;
    const layer_w *w = &m->layers[li];
    const int n = m->n_rows;
    const int64_t d = c->n_embd, hd = c->head_dim;
    const int64_t qd = (int64_t)m->nh * hd, kvd = (int64_t)m->nkv * hd;
    if (m->nh == 0) {
        memset(m->o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    for (int t = 0; t < n; t++) lk_rmsnorm(m->xb + t * d, x + t * d, w->attn_norm, d, c->rms_eps);
    const lk_mat *qkv[3] = {&w->wq, &w->wk, &w->wv};
    if (lk_matmul_can_fuse(qkv, 3)) {
        float *const ys[3] = {m->q, m->k, m->v};
        const int64_t ss[3] = {qd, kvd, kvd};
        lk_matmul_fused(m->pool, qkv, 3, m->xb, d, n, ys, ss, false, m->act);
    } else {
        lk_matmul(m->pool, &w->wq, m->xb, d, n, m->q, qd, m->act);
        lk_matmul(m->pool, &w->wk, m->xb, d, n, m->k, kvd, m->act);
        lk_matmul(m->pool, &w->wv, m->xb, d, n, m->v, kvd, m->act);
    }
    for (int t = 0; t < n; t++) {
        float *q = m->q + t * qd, *k = m->k + t * kvd, *v = m->v + t * kvd;
        const int pos = m->row_pos[t], seq = m->items[m->row_item[t]].seq;
        if (w->bq) {
            for (int64_t i = 0; i < qd; i++) q[i] += w->bq[i];
            for (int64_t i = 0; i < kvd; i++) { k[i] += w->bk[i]; v[i] += w->bv[i]; }
        }
        for (int h = 0; h < m->nh; h++) {
            if (w->q_norm) lk_rmsnorm(q + h * hd, q + h * hd, w->q_norm, hd, c->rms_eps);
            rope(m, q + h * hd, pos);
        }
        for (int h = 0; h < m->nkv; h++) {
            if (w->k_norm) lk_rmsnorm(k + h * hd, k + h * hd, w->k_norm, hd, c->rms_eps);
            rope(m, k + h * hd, pos);
            size_t at = kv_page_kv(m, seq, pos / LK_KV_PAGE, li, h) + (size_t)(pos % LK_KV_PAGE) * hd;
            if (m->kv_f16) {
                uint16_t *kc = (uint16_t *)m->kcache + at, *vc = (uint16_t *)m->vcache + at;
                for (int i = 0; i < hd; i++) { kc[i] = lk_fp32_to_fp16(k[h * hd + i]); vc[i] = lk_fp32_to_fp16(v[h * hd + i]); }
            } else {
                memcpy((float *)m->kcache + at, k + h * hd, sizeof(float) * hd);
                memcpy((float *)m->vcache + at, v + h * hd, sizeof(float) * hd);
            }
        }
    }
    attn_job aj = { m, li };
    lk_pool_run(m->pool, m->kv_f16 ? attn_f16_fn : attn_block_fn, &aj);
    lk_matmul(m->pool, &w->wo, m->att, qd, n, m->o, d, m->act);
}

/* This rank's share of the FFN: o = W2_slice . (silu(W1_slice x) * W3_slice x). */
static void ffn(lk_model *m, int li, const float *x, int n) {
    const layer_w *w = &m->layers[li];
    const int64_t d = m->cfg.n_embd;
    if (m->nff == 0) {
        memset(m->o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    for (int t = 0; t < n; t++) lk_rmsnorm(m->xb + t * d, x + t * d, w->ffn_norm, d, m->cfg.rms_eps);
    const lk_mat *gu[2] = {&w->w1, &w->w3};
    if (lk_matmul_can_fuse(gu, 2)) {
        float *const ys[2] = {m->hg, m->hu};
        const int64_t ss[2] = {m->nff, m->nff};
        lk_matmul_fused(m->pool, gu, 2, m->xb, d, n, ys, ss, true, m->act);
    } else {
        lk_matmul(m->pool, &w->w1, m->xb, d, n, m->hg, m->nff, m->act);
        lk_matmul(m->pool, &w->w3, m->xb, d, n, m->hu, m->nff, m->act);
        lk_swiglu(m->hg, m->hu, (int64_t)n * m->nff);
    }
    lk_matmul(m->pool, &w->w2, m->hg, m->nff, n, m->o, d, m->act);
}

lk_status lk_model_layers(lk_model *m, float *x) {
    LK_ASSERT(m->n_rows > 0); /* lk_model_batch first */
    const int n = m->n_rows;
    const int64_t nd = (int64_t)n * m->cfg.n_embd;
    lk_status st;
    for (int li = 0; li < m->sl.layer1 - m->sl.layer0; li++) {
        const int layer = m->sl.layer0 + li;
        attention(m, li, x);
        if ((st = allreduce(m, m->o, nd, layer, "attention output all-reduce"))) return st;
        for (int64_t i = 0; i < nd; i++) x[i] += m->o[i];
        ffn(m, li, x, n);
        if ((st = allreduce(m, m->o, nd, layer, "FFN output all-reduce"))) return st;
        for (int64_t i = 0; i < nd; i++) x[i] += m->o[i];
    }
    return LK_OK;
}

lk_status lk_model_logits(lk_model *m, const float *x, const int32_t *rows, int n_rows, float *logits) {
    LK_ASSERT(n_rows >= 0 && n_rows <= m->n_batch);
    const int64_t d = m->cfg.n_embd;
    for (int t = 0; t < n_rows; t++) {
        LK_ASSERT(rows[t] >= 0 && rows[t] < m->n_batch);
        lk_rmsnorm(m->xb + t * d, x + (size_t)rows[t] * d, m->out_norm, d, m->cfg.rms_eps);
    }
    lk_matmul(m->pool, &m->wout, m->xb, d, n_rows, logits, m->nvoc, m->act);
    return LK_OK;
}

lk_status lk_model_forward(lk_model *m, const int32_t *tokens, int n, int pos0, int n_out, float *logits) {
    LK_ASSERT(n_out >= 0 && n_out <= n);
    char err[LK_ERRLEN];
    lk_status st;
    if (pos0 < m->seq_len[0] && (st = lk_model_seq_keep(m, 0, pos0, err, sizeof err))) return st;
    lk_batch_item it = {0, pos0, n};
    if ((st = lk_model_batch(m, &it, 1, err, sizeof err))) {
        lk_log(LK_LOG_ERROR, "%s", err);
        return st;
    }
    if ((st = lk_model_embed(m, tokens, n, m->x))) return st;
    if ((st = lk_model_layers(m, m->x))) return st;
    for (int r = 0; r < n_out; r++) m->out_rows[r] = n - n_out + r;
    return lk_model_logits(m, m->x, m->out_rows, n_out, logits);
}
