/* A model's shape for the performance model: from a GGUF header (streamed
 * with stdio, so only the header, metadata and tensor index need to exist on
 * disk) or from the built-in table.
 *
 * The header is read by a reader of its own rather than gguf/: lk_gguf_open
 * maps the file and validates every tensor's data range against its size,
 * which a partial download cannot pass. Here every count and length is
 * bounded before it is used, and nothing from the file sizes an allocation
 * beyond a 64 KiB name buffer. */
#include "diag/diag.h"
#include "quant/quant.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a bounded reader over a FILE ------------------------------------------ */

typedef struct {
    FILE       *f;
    const char *path;
    uint64_t    pos;
    bool        ok;
    char       *err;
    size_t      errlen;
} rd;

static bool rd_fail(rd *r, const char *what) {
    if (r->ok) {
        if (feof(r->f))
            lk_fail(r->err, r->errlen, LK_ERR_FORMAT,
                    "%s: the file ends at byte %" PRIu64 " inside the GGUF header (%s); the header, metadata and "
                    "tensor index must be present (tensor data need not)", r->path, r->pos, what);
        else
            lk_fail(r->err, r->errlen, LK_ERR_FORMAT, "%s: %s at byte %" PRIu64, r->path, what, r->pos);
    }
    r->ok = false;
    return false;
}

static bool rd_bytes(rd *r, void *dst, size_t n, const char *what) {
    if (!r->ok) return false;
    if (n && fread(dst, 1, n, r->f) != n) return rd_fail(r, what);
    r->pos += n;
    return true;
}

static bool rd_skip(rd *r, uint64_t n, const char *what) {
    char buf[4096];
    while (r->ok && n) {
        size_t k = n > sizeof buf ? sizeof buf : (size_t)n;
        if (!rd_bytes(r, buf, k, what)) return false;
        n -= k;
    }
    return r->ok;
}

static uint32_t rd_u32(rd *r, const char *what) {
    uint8_t b[4] = {0};
    rd_bytes(r, b, 4, what);
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}
static uint64_t rd_u64(rd *r, const char *what) {
    uint64_t lo = rd_u32(r, what), hi = rd_u32(r, what);
    return lo | hi << 32;
}

/* A string into buf (NUL-terminated, truncated to cap-1); the rest skipped. */
static bool rd_str(rd *r, char *buf, size_t cap, const char *what) {
    uint64_t n = rd_u64(r, what);
    if (!r->ok) return false;
    if (n > (1u << 24)) {
        char m[96];
        snprintf(m, sizeof m, "%s: string length %" PRIu64 " is implausible", what, n);
        return rd_fail(r, m);
    }
    size_t k = n < cap - 1 ? (size_t)n : cap - 1;
    if (!rd_bytes(r, buf, k, what)) return false;
    buf[k] = 0;
    return rd_skip(r, n - k, what);
}

static size_t scalar_size(uint32_t t) {
    switch (t) {
    case 0: case 1: case 7: return 1;  /* u8, i8, bool */
    case 2: case 3: return 2;
    case 4: case 5: case 6: return 4;
    case 10: case 11: case 12: return 8;
    default: return 0;                 /* string, array, unknown */
    }
}

/* Reads one value of type t; integers (and floats, truncated) into *iv when
 * iv is given, a string into sbuf when given. depth bounds nested arrays. */
static bool rd_value(rd *r, uint32_t t, int64_t *iv, char *sbuf, size_t scap, uint64_t *arr_n, int depth) {
    if (t == 8) { /* string */
        char tmp[8];
        return sbuf ? rd_str(r, sbuf, scap, "string value") : rd_str(r, tmp, sizeof tmp, "string value");
    }
    if (t == 9) { /* array: element type, count, elements */
        if (depth > 2) return rd_fail(r, "arrays nested too deeply");
        uint32_t et = rd_u32(r, "array type");
        uint64_t n = rd_u64(r, "array length");
        if (!r->ok) return false;
        if (n > ((uint64_t)1 << 32)) return rd_fail(r, "implausible array length");
        if (arr_n) *arr_n = n;
        size_t es = scalar_size(et);
        if (es) return rd_skip(r, n * es, "array data");
        if (et != 8 && et != 9) return rd_fail(r, "unknown array element type");
        for (uint64_t i = 0; i < n && r->ok; i++) rd_value(r, et, NULL, NULL, 0, NULL, depth + 1);
        return r->ok;
    }
    size_t sz = scalar_size(t);
    if (!sz) return rd_fail(r, "unknown metadata value type");
    uint8_t b[8] = {0};
    if (!rd_bytes(r, b, sz, "metadata value")) return false;
    if (iv) {
        uint64_t u = 0;
        for (size_t i = 0; i < sz; i++) u |= (uint64_t)b[i] << (8 * i);
        if (t == 6) { float f; memcpy(&f, b, 4); *iv = (int64_t)f; }
        else if (t == 12) { double d; memcpy(&d, b, 8); *iv = (int64_t)d; }
        else if (t == 1) *iv = (int8_t)u;
        else if (t == 3) *iv = (int16_t)u;
        else if (t == 5) *iv = (int32_t)u;
        else *iv = (int64_t)u;
    }
    return true;
}

/* Which per-layer matrix a tensor name is: 0 none, 1 Wq/Wo, 2 Wk/Wv, 3 FFN, 4 fused qkv. */
static int layer_kind(const char *name) {
    if (strncmp(name, "blk.", 4)) return 0;
    const char *d = strchr(name + 4, '.');
    if (!d) return 0;
    d++;
    if (!strcmp(d, "attn_q.weight") || !strcmp(d, "attn_output.weight")) return 1;
    /* the gated delta net's per-head matrices (qwen35moe) split with the heads like Wq/Wo */
    if (!strcmp(d, "attn_gate.weight") || !strcmp(d, "ssm_out.weight") || !strcmp(d, "ssm_alpha.weight") ||
        !strcmp(d, "ssm_beta.weight"))
        return 1;
    if (!strcmp(d, "attn_k.weight") || !strcmp(d, "attn_v.weight")) return 2;
    if (!strcmp(d, "attn_qkv.weight")) return 4;
    if (!strncmp(d, "ffn_gate", 8) || !strncmp(d, "ffn_up", 6) || !strncmp(d, "ffn_down", 8)) return strstr(d, "norm") ? 0 : 3;
    return 0;
}

lk_status lk_diag_shape_gguf(const char *path, lk_diag_shape *s, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    FILE *f = fopen(path, "rb");
    if (!f) return lk_fail(err, errlen, LK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    rd r = {.f = f, .path = path, .ok = true, .err = err, .errlen = errlen};
    char magic[4] = {0};
    rd_bytes(&r, magic, 4, "magic");
    if (r.ok && memcmp(magic, "GGUF", 4)) {
        fclose(f);
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: not a GGUF file (magic is not 'GGUF')", path);
    }
    uint32_t ver = rd_u32(&r, "version");
    if (r.ok && (ver < 2 || ver > 3)) {
        fclose(f);
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: GGUF version %u (2 and 3 are read)", path, ver);
    }
    uint64_t n_t = rd_u64(&r, "tensor count"), n_kv = rd_u64(&r, "metadata count");
    if (r.ok && (n_t > 1000000 || n_kv > 1000000)) {
        fclose(f);
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: implausible counts (%" PRIu64 " tensors, %" PRIu64 " keys)",
                       path, n_t, n_kv);
    }
    /* metadata: keys are matched by their suffix after "<arch>.", since
     * general.architecture need not come first */
    int64_t ctx_len = 0, embd = 0, blocks = 0, ff = 0, ff_exp = 0, heads = 0, heads_kv = 0, key_len = 0, vocab = 0, n_exp = 0,
            n_exp_used = 0, kv_lora = 0, n_rot = 0;
    char key[256], arch[32] = "", name[64] = "";
    for (uint64_t i = 0; i < n_kv && r.ok; i++) {
        rd_str(&r, key, sizeof key, "metadata key");
        uint32_t t = rd_u32(&r, "metadata type");
        if (!r.ok) break;
        int64_t iv = 0;
        uint64_t an = 0;
        if (!strcmp(key, "general.architecture") && t == 8) { rd_value(&r, t, NULL, arch, sizeof arch, NULL, 0); continue; }
        if (!strcmp(key, "general.name") && t == 8) { rd_value(&r, t, NULL, name, sizeof name, NULL, 0); continue; }
        rd_value(&r, t, &iv, NULL, 0, &an, 0);
        if (!r.ok) break;
        if (!strcmp(key, "tokenizer.ggml.tokens") && t == 9) { vocab = (int64_t)an; continue; }
        const char *dot = strchr(key, '.');
        if (!dot || !strncmp(key, "general.", 8) || !strncmp(key, "tokenizer.", 10)) continue;
        const char *k = dot + 1;
        if (t == 9) continue;
        if (!strcmp(k, "context_length")) ctx_len = iv;
        else if (!strcmp(k, "embedding_length")) embd = iv;
        else if (!strcmp(k, "block_count")) blocks = iv;
        else if (!strcmp(k, "feed_forward_length")) ff = iv;
        else if (!strcmp(k, "attention.head_count")) heads = iv;
        else if (!strcmp(k, "attention.head_count_kv")) heads_kv = iv;
        else if (!strcmp(k, "attention.key_length")) key_len = iv;
        else if (!strcmp(k, "vocab_size")) vocab = iv;
        else if (!strcmp(k, "expert_count")) n_exp = iv;
        else if (!strcmp(k, "expert_feed_forward_length")) ff_exp = iv;
        else if (!strcmp(k, "expert_used_count")) n_exp_used = iv;
        else if (!strcmp(k, "attention.kv_lora_rank")) kv_lora = iv;
        else if (!strcmp(k, "rope.dimension_count")) n_rot = iv;
    }
    /* tensor index */
    bool has_out = false;
    double embd_elems = 0;
    for (uint64_t i = 0; i < n_t && r.ok; i++) {
        char tn[128];
        rd_str(&r, tn, sizeof tn, "tensor name");
        uint32_t nd = rd_u32(&r, "tensor dimensions");
        if (!r.ok) break;
        if (nd < 1 || nd > 4) { rd_fail(&r, "tensor with 0 or more than 4 dimensions"); break; }
        uint64_t ne[4] = {1, 1, 1, 1};
        for (uint32_t d = 0; d < nd; d++) ne[d] = rd_u64(&r, "tensor shape");
        uint32_t type = rd_u32(&r, "tensor type");
        rd_u64(&r, "tensor offset");
        if (!r.ok) break;
        size_t row = 0;
        if (ne[0] == 0 || ne[0] > ((uint64_t)1 << 40) || !lk_type_row_bytes(type, (int64_t)ne[0], &row)) {
            char m[200];
            snprintf(m, sizeof m, "tensor '%s': type %s cannot hold rows of %" PRIu64 " elements", tn,
                     lk_type_name(type), ne[0]);
            rd_fail(&r, m);
            break;
        }
        double rows = (double)ne[1] * (double)ne[2] * (double)ne[3];
        double bytes = (double)row * rows, elems = (double)ne[0] * rows;
        if (!strcmp(tn, "token_embd.weight")) {
            s->embd_bytes = bytes;
            embd_elems = elems;
            if (!vocab) vocab = (int64_t)ne[1];
        } else if (!strcmp(tn, "output.weight")) {
            s->out_bytes = bytes, s->out_elems = elems, has_out = true;
        } else if (nd >= 2) {
            switch (layer_kind(tn)) {
            case 1: s->qo_bytes += bytes, s->qo_elems += elems; break;
            case 2: s->kv_bytes += bytes, s->kv_elems += elems; break;
            case 3: s->ffn_bytes += bytes, s->ffn_elems += elems; break;
            case 4: { /* fused QKV: split by the head counts */
                double q = (double)heads, kv = 2.0 * (double)heads_kv;
                double fq = heads ? q / (q + kv) : 1;
                s->qo_bytes += bytes * fq, s->qo_elems += elems * fq;
                s->kv_bytes += bytes * (1 - fq), s->kv_elems += elems * (1 - fq);
                break;
            }
            default: break;
            }
        }
    }
    s->header_bytes = r.pos;
    fclose(f);
    if (!r.ok) return LK_ERR_FORMAT;
    if (!has_out) s->out_bytes = s->embd_bytes, s->out_elems = embd_elems; /* tied */
    if (ff < 1) ff = ff_exp; /* qwen35moe has no dense feed_forward_length */
    if (embd < 1 || blocks < 1 || heads < 1 || ff < 1)
        return lk_fail(err, errlen, LK_ERR_FORMAT,
                       "%s: the metadata lacks the model's dimensions (embedding %lld, blocks %lld, heads %lld, FFN %lld)",
                       path, (long long)embd, (long long)blocks, (long long)heads, (long long)ff);
    /* the file's text, printed by plan: its escapes written as \xNN */
    const char *shown = name[0] ? name : arch;
    lk_str_sanitize(s->arch, sizeof s->arch, arch[0] ? arch : "?", arch[0] ? strlen(arch) : 1);
    lk_str_sanitize(s->name, sizeof s->name, shown, strlen(shown));
    s->n_embd = embd, s->n_layer = blocks, s->n_head = heads, s->n_head_kv = heads_kv > 0 ? heads_kv : heads;
    s->head_dim = key_len > 0 ? key_len : embd / heads;
    s->n_ff = ff, s->n_vocab = vocab, s->n_ctx_train = ctx_len, s->n_expert = n_exp, s->n_expert_used = n_exp_used;
    /* MLA: key_length (576 for DeepSeek-V3) is the absorbed key, kv_lora +
     * rope; the cache holds that one row per position, not keys and values
     * per head */
    if (kv_lora > 0 && n_rot > 0) s->n_head_kv = 1, s->kv_row = (double)(kv_lora + n_rot);
    else s->kv_row = 2.0 * (double)s->n_head_kv * (double)s->head_dim;
    double L = (double)blocks;
    s->qo_bytes /= L, s->qo_elems /= L, s->kv_bytes /= L, s->kv_elems /= L, s->ffn_bytes /= L, s->ffn_elems /= L;
    if (s->qo_bytes <= 0 || s->ffn_bytes <= 0)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: no attention or FFN matrices in the tensor index", path);
    return LK_OK;
}

/* ---- built-in shapes ----------------------------------------------------------
 * The published hyper-parameters that gen-model writes (k_shapes in
 * src/cli/cmd_gen_model.c, duplicated here rather than exported: that file
 * belongs to the model work; keep the two tables in step). */
typedef struct {
    const char *name, *arch;
    int64_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx;
    bool tied;
} bshape;

static const bshape k_builtin[] = {
    {"tiny", "llama", 256, 2, 8, 2, 32, 768, 512, 2048, false},
    {"tinyllama-1.1b", "llama", 2048, 22, 32, 4, 64, 5632, 32000, 2048, false},
    {"llama3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 128256, 131072, true},
    {"llama3-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, 8192, false},
    {"llama3-70b", "llama", 8192, 80, 64, 8, 128, 28672, 128256, 8192, false},
    {"qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 40960, true},
    {"qwen3-8b", "qwen3", 4096, 36, 32, 8, 128, 12288, 151936, 40960, false},
};

const char *lk_diag_shape_name(int i) {
    return i >= 0 && i < (int)(sizeof k_builtin / sizeof k_builtin[0]) ? k_builtin[i].name : NULL;
}

/* Bytes of an [in x out] matrix of `type`, F16 when a row is not whole blocks (as gen-model writes). */
static double mat_bytes(uint32_t type, int64_t in, int64_t out) {
    size_t row = 0;
    if (!lk_type_row_bytes(type, in, &row)) lk_type_row_bytes(LK_TYPE_F16, in, &row);
    return (double)row * (double)out;
}

bool lk_diag_shape_builtin(const char *name, uint32_t type, lk_diag_shape *s) {
    const bshape *b = NULL;
    for (size_t i = 0; i < sizeof k_builtin / sizeof k_builtin[0]; i++)
        if (!strcmp(k_builtin[i].name, name)) b = &k_builtin[i];
    if (!b || !lk_type_block_size(type)) return false;
    memset(s, 0, sizeof *s);
    snprintf(s->arch, sizeof s->arch, "%s", b->arch);
    snprintf(s->name, sizeof s->name, "%s %s", b->name, lk_type_name(type));
    s->n_embd = b->n_embd, s->n_layer = b->n_layer, s->n_head = b->n_head, s->n_head_kv = b->n_head_kv;
    s->head_dim = b->head_dim, s->n_ff = b->n_ff, s->n_vocab = b->n_vocab, s->n_ctx_train = b->n_ctx;
    int64_t q = b->n_head * b->head_dim, kv = b->n_head_kv * b->head_dim;
    s->qo_bytes = mat_bytes(type, b->n_embd, q) + mat_bytes(type, q, b->n_embd);
    s->qo_elems = 2.0 * (double)b->n_embd * (double)q;
    s->kv_bytes = 2 * mat_bytes(type, b->n_embd, kv);
    s->kv_elems = 2.0 * (double)b->n_embd * (double)kv;
    s->kv_row = 2.0 * (double)kv;
    s->ffn_bytes = 2 * mat_bytes(type, b->n_embd, b->n_ff) + mat_bytes(type, b->n_ff, b->n_embd);
    s->ffn_elems = 3.0 * (double)b->n_embd * (double)b->n_ff;
    s->embd_bytes = mat_bytes(type, b->n_embd, b->n_vocab);
    s->out_bytes = s->embd_bytes; /* tied or not, the output has the embedding's shape and type */
    s->out_elems = (double)b->n_embd * (double)b->n_vocab;
    return true;
}
