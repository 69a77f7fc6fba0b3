/* tokenizer — vocabularies from GGUF metadata; encoding exactly as llama.cpp
 * (llama-vocab.cpp) does it, decoding, streaming detokenisation.
 *
 * Layout of this file:
 *   1. hashing: token text -> id, BPE merge (left, right) -> rank
 *   2. loading: token list, attributes, special ids, EOG set, piece cache
 *   3. special-token partition of the input text
 *   4. SentencePiece (SPM) encoder: bigram merges by score, byte fallback
 *   5. byte-level BPE encoder: pre-tokeniser words, merges by rank
 *   6. WordPiece (WPM) encoder: greedy longest match per word
 *   7. pieces and the streaming detokeniser */
#include "tokenizer/tokenizer.h"

#include "tokenizer/pretokenize.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Token attributes (llama.cpp's llama_token_attr bits). */
enum {
    ATTR_UNKNOWN = 1 << 1,
    ATTR_UNUSED = 1 << 2,
    ATTR_NORMAL = 1 << 3,
    ATTR_CONTROL = 1 << 4,
    ATTR_USER_DEFINED = 1 << 5,
    ATTR_BYTE = 1 << 6,
    ATTR_LSTRIP = 1 << 8,
    ATTR_RSTRIP = 1 << 9,
};

typedef enum { KIND_SPM, KIND_BPE, KIND_WPM } tok_kind;

typedef struct {
    uint32_t off;   /* into merge_text: left bytes then right bytes */
    uint32_t llen, rlen;
    int32_t  rank;
} merge_t;

struct lk_tokenizer {
    tok_kind    kind;
    lk_pre_kind pre;
    int32_t     n_vocab;

    char     *text;      /* every token text, NUL-terminated, back to back */
    uint32_t *text_off;  /* (n_vocab) */
    uint32_t *text_len;  /* (n_vocab) */
    float    *score;     /* (n_vocab) SPM merge priority */
    uint32_t *attr;      /* (n_vocab) ATTR_* */
    uint8_t  *eog;       /* (n_vocab) 1 = ends generation */
    int32_t   max_token_len;

    int32_t  *tab;       /* open-addressing hash of token texts -> id, -1 = empty */
    uint32_t  tab_mask;

    char     *merge_text;
    merge_t  *merges;    /* (n_merges) */
    int32_t   n_merges;
    int32_t  *mtab;      /* hash of merges -> index into merges, -1 = empty */
    uint32_t  mtab_mask;

    char     *piece;     /* detokenised bytes of every token (as if special) */
    uint32_t *piece_off; /* (n_vocab) */
    uint32_t *piece_len; /* (n_vocab) */
    int32_t   max_piece_len;

    int32_t  *special;   /* CONTROL/USER_DEFINED/UNKNOWN ids, longest text first */
    /* SPM entries with a "▁" after their first byte, and its offset: only
     * these can span a word start (see spm_safe_space_cut). -1: too many. */
    struct { int32_t id; uint32_t off; } inner[256];
    int32_t   n_inner;
    int32_t   n_special;

    int32_t  byte_tok[256]; /* SPM byte fallback: <0xXX> (or the byte itself) */
    uint32_t byte_cpt[256]; /* byte-level BPE: byte -> code point of its symbol */

    int32_t bos, eos, eot, eom, unk, sep, pad, mask;
    int32_t fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep;
    bool add_bos, add_eos, add_sep, add_space_prefix, ignore_merges;
    bool wpm_lowercase, wpm_strip_accents;
};

/* ======================================================================
 * 1. hashing
 * ==================================================================== */

static uint64_t hash_bytes(const void *p, size_t n, uint64_t seed) {
    const uint8_t *s = p;
    uint64_t h = seed ^ (0x9E3779B97F4A7C15ull * (n + 1));
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        h = (h ^ v) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, s, n);
    h = (h ^ v) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    h *= 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 32);
}

static uint32_t pow2_at_least(uint64_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* Token id for text[0..n), or -1. */
static int32_t lookup(const lk_tokenizer *t, const char *s, size_t n) {
    uint32_t i = (uint32_t)hash_bytes(s, n, 0) & t->tab_mask;
    for (;;) {
        int32_t id = t->tab[i];
        if (id < 0) return -1;
        if (t->text_len[id] == n && !memcmp(t->text + t->text_off[id], s, n)) return id;
        i = (i + 1) & t->tab_mask;
    }
}

static uint64_t merge_hash(const char *s, size_t llen, size_t total) {
    return hash_bytes(s, total, 0x5BD1E995u + llen);
}

/* Rank of merging the adjacent symbols s[0..llen) and s[llen..total), or -1. */
static int32_t merge_rank(const lk_tokenizer *t, const char *s, size_t llen, size_t total) {
    if (!t->n_merges) return -1;
    uint32_t i = (uint32_t)merge_hash(s, llen, total) & t->mtab_mask;
    for (;;) {
        int32_t k = t->mtab[i];
        if (k < 0) return -1;
        const merge_t *m = &t->merges[k];
        if (m->llen == llen && m->llen + m->rlen == total && !memcmp(t->merge_text + m->off, s, total))
            return m->rank;
        i = (i + 1) & t->mtab_mask;
    }
}

/* ======================================================================
 * 2. loading
 * ==================================================================== */

void lk_tokenizer_free(lk_tokenizer *t) {
    if (!t) return;
    free(t->text); free(t->text_off); free(t->text_len); free(t->score); free(t->attr); free(t->eog);
    free(t->tab); free(t->merge_text); free(t->merges); free(t->mtab);
    free(t->piece); free(t->piece_off); free(t->piece_len); free(t->special);
    free(t);
}

static bool str_is(const char *s, size_t n, const char *lit) {
    return n == strlen(lit) && !memcmp(s, lit, n);
}

static bool pre_from_name(const char *s, size_t n, lk_pre_kind *k, bool *ignore_merges, bool *add_bos) {
    static const struct { const char *name; lk_pre_kind kind; bool ignore_merges, add_bos; } names[] = {
        {"default", LK_PRE_DEFAULT, false, false},
        {"llama3", LK_PRE_LLAMA3, true, true}, {"llama-v3", LK_PRE_LLAMA3, true, true},
        {"llama-bpe", LK_PRE_LLAMA3, true, true}, {"falcon3", LK_PRE_LLAMA3, true, true},
        {"falcon-h1", LK_PRE_LLAMA3, true, true}, {"pixtral", LK_PRE_LLAMA3, true, true},
        {"midm-2.0", LK_PRE_LLAMA3, true, true}, {"lfm2", LK_PRE_LLAMA3, true, true},
        {"dbrx", LK_PRE_LLAMA3, false, false}, {"smaug-bpe", LK_PRE_LLAMA3, false, false},
        {"deepseek-llm", LK_PRE_DEEPSEEK_LLM, false, false},
        {"deepseek-coder", LK_PRE_DEEPSEEK_CODER, false, false},
        {"falcon", LK_PRE_FALCON, false, false},
        {"mpt", LK_PRE_GPT2, false, false}, {"gpt-2", LK_PRE_GPT2, false, false},
        {"phi-2", LK_PRE_GPT2, false, false}, {"olmo", LK_PRE_GPT2, false, false},
        {"jina-es", LK_PRE_GPT2, false, false}, {"jina-de", LK_PRE_GPT2, false, false},
        {"jina-v2-es", LK_PRE_GPT2, false, false}, {"jina-v2-de", LK_PRE_GPT2, false, false},
        {"jina-v1-en", LK_PRE_GPT2, false, false}, {"jina-v2-code", LK_PRE_GPT2, false, false},
        {"roberta-bpe", LK_PRE_GPT2, false, false}, {"gigachat", LK_PRE_GPT2, false, false},
        {"exaone4", LK_PRE_GPT2, false, false}, {"jais", LK_PRE_GPT2, false, false},
        {"starcoder", LK_PRE_STARCODER, false, false}, {"refact", LK_PRE_STARCODER, false, false},
        {"command-r", LK_PRE_STARCODER, false, false}, {"smollm", LK_PRE_STARCODER, false, false},
        {"codeshell", LK_PRE_STARCODER, false, false}, {"exaone", LK_PRE_STARCODER, false, false},
        {"minerva-7b", LK_PRE_STARCODER, false, false},
        {"qwen2", LK_PRE_QWEN2, false, false}, {"deepseek-r1-qwen", LK_PRE_QWEN2, false, false},
        {"stablelm2", LK_PRE_QWEN2, false, false}, {"megrez", LK_PRE_QWEN2, false, false},
        {"hunyuan", LK_PRE_QWEN2, false, false}, {"kormo", LK_PRE_QWEN2, false, false},
        {"qwen35", LK_PRE_QWEN35, false, false},
        {"chatglm-bpe", LK_PRE_LLAMA3, false, false}, {"glm4", LK_PRE_LLAMA3, false, false},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (str_is(s, n, names[i].name)) {
            *k = names[i].kind;
            *ignore_merges = names[i].ignore_merges;
            *add_bos = names[i].add_bos;
            return true;
        }
    return false;
}

/* GPT-2's byte <-> printable code point table: printable Latin-1 bytes stand
 * for themselves, the rest get U+0100.. in byte order. */
static void init_byte_cpts(uint32_t *map) {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; b++) {
        bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        map[b] = self ? b : next++;
    }
}

static void build_piece(lk_tokenizer *t, int32_t id, lk_buf *out) {
    const char *s = t->text + t->text_off[id];
    size_t n = t->text_len[id];
    uint32_t a = t->attr[id];
    if (a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED)) { lk_buf_put(out, s, n); return; }
    if (a & ATTR_BYTE) {
        /* "<0xXX>": llama.cpp reads the two hex digits at offset 3 */
        char hex[3] = {n > 3 ? s[3] : 0, n > 4 ? s[4] : 0, 0};
        char b = (char)strtol(hex, NULL, 16);
        lk_buf_put(out, &b, 1);
        return;
    }
    if (!(a & ATTR_NORMAL)) return; /* unused / undefined: nothing */
    if (t->kind == KIND_BPE) {
        /* each code point of the token is one byte of the text */
        uint32_t *cp = lk_xmalloc((n + 1) * sizeof *cp);
        size_t nc = lk_utf8_decode(s, n, cp);
        for (size_t i = 0; i < nc; i++) {
            int byte = -1;
            for (int b = 0; b < 256 && byte < 0; b++)
                if (t->byte_cpt[b] == cp[i]) byte = b;
            if (byte >= 0) {
                char c = (char)byte;
                lk_buf_put(out, &c, 1);
            } else { /* llama.cpp writes a marker for code points outside the table */
                char u8[4], buf[64];
                int k = lk_utf8_encode(cp[i], u8);
                lk_buf_put(out, "[UNK_BYTE_0x", 12);
                for (int j = 0; j < k; j++) {
                    snprintf(buf, sizeof buf, "%02x", (unsigned char)u8[j]);
                    lk_buf_put(out, buf, 2);
                }
                lk_buf_put(out, s, n);
                lk_buf_put(out, "]", 1);
            }
        }
        free(cp);
        return;
    }
    /* SPM / WPM: U+2581 stands for a space */
    for (size_t i = 0; i < n;) {
        if (i + 3 <= n && !memcmp(s + i, "\xE2\x96\x81", 3)) { lk_buf_put(out, " ", 1); i += 3; }
        else { lk_buf_put(out, s + i, 1); i++; }
    }
}

static int cmp_special(const void *a, const void *b, void *ctx) {
    const lk_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (t->text_len[x] != t->text_len[y]) return t->text_len[x] > t->text_len[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

static int32_t find_text(const lk_tokenizer *t, const char *lit) { return lookup(t, lit, strlen(lit)); }

static void mark_control(lk_tokenizer *t, int32_t id) {
    if (id >= 0) t->attr[id] |= ATTR_CONTROL;
}

/* Special ids llama.cpp finds by their text when the GGUF does not name them
 * (first match in id order); such tokens become CONTROL. */
static void autodetect_specials(lk_tokenizer *t) {
    static const char *eot_names[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>", NULL};
    static const char *eom_names[] = {"<|eom_id|>", NULL};
    static const char *pre_names[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>",
        "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>", NULL};
    static const char *suf_names[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
        "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", NULL};
    static const char *mid_names[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>",
        "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>", NULL};
    static const char *pad_names[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL};
    static const char *rep_names[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", NULL};
    static const char *sep_names[] = {"<|file_sep|>", NULL};
    struct { int32_t *id; const char **names; } groups[] = {
        {&t->eot, eot_names}, {&t->eom, eom_names}, {&t->fim_pre, pre_names}, {&t->fim_suf, suf_names},
        {&t->fim_mid, mid_names}, {&t->fim_pad, pad_names}, {&t->fim_rep, rep_names}, {&t->fim_sep, sep_names},
    };
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        if (*groups[g].id >= 0) continue;
        int32_t best = -1;
        for (const char **nm = groups[g].names; *nm; nm++) {
            int32_t id = find_text(t, *nm);
            if (id >= 0 && (best < 0 || id < best)) best = id;
        }
        if (best >= 0) {
            *groups[g].id = best;
            mark_control(t, best);
        }
    }
    /* control tokens named "unused" are unused */
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & ATTR_CONTROL) && strstr(t->text + t->text_off[id], "unused"))
            t->attr[id] |= ATTR_UNUSED;
}

static void build_eog(lk_tokenizer *t) {
    static const char *eog_names[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
        "<|flush|>", "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[", NULL};
    int32_t fixed[] = {t->fim_pad, t->fim_rep, t->fim_sep, t->eos, t->eot, t->eom};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        if (fixed[i] >= 0) t->eog[fixed[i]] = 1;
    for (const char **nm = eog_names; *nm; nm++) {
        int32_t id = find_text(t, *nm);
        if (id >= 0) {
            t->eog[id] = 1;
            mark_control(t, id);
        }
    }
    /* llama.cpp's two workarounds: with <|return|>/<|call|> (or <|calls|>/<|flush|>)
     * present, <|end|> is not EOG but user-defined; with <|tool_response>, </s> is
     * not EOG but normal. */
    int32_t ret = find_text(t, "<|return|>"), call = find_text(t, "<|call|>"), calls = find_text(t, "<|calls|>");
    int32_t flush = find_text(t, "<|flush|>"), end = find_text(t, "<|end|>");
    bool has_call = (call >= 0 && t->eog[call]) || (calls >= 0 && t->eog[calls]);
    if (end >= 0 && t->eog[end] && has_call && ((ret >= 0 && t->eog[ret]) || (flush >= 0 && t->eog[flush]))) {
        t->eog[end] = 0;
        t->attr[end] = ATTR_USER_DEFINED;
    }
    int32_t tr = find_text(t, "<|tool_response>"), s = find_text(t, "</s>");
    if (tr >= 0 && s >= 0 && t->eog[tr] && t->eog[s]) {
        t->eog[s] = 0;
        t->attr[s] = ATTR_NORMAL;
    }
}

/* A string of the model file quoted in an error: its escapes and control
 * bytes written as \xNN (lk_str_sanitize), so a hostile GGUF cannot drive
 * the terminal of whoever reads the message; at most about 64 bytes. */
static const char *quote(char *buf, size_t len, const char *s, size_t n) {
    lk_str_sanitize(buf, len, s, n);
    return buf;
}

lk_status lk_tokenizer_load(const lk_gguf *g, lk_tokenizer **out, char *err, size_t errlen) {
    *out = NULL;
    char q[80];
    const char *model;
    size_t model_len;
    if (!lk_gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: no tokenizer.ggml.model", lk_gguf_path(g));

    lk_tokenizer *t = lk_xcalloc(1, sizeof *t);
    t->bos = t->eos = t->eot = t->eom = t->unk = t->sep = t->pad = t->mask = -1;
    t->fim_pre = t->fim_suf = t->fim_mid = t->fim_pad = t->fim_rep = t->fim_sep = -1;
    lk_status st = LK_OK;

    /* vocabulary type and its defaults (llama.cpp's) */
    if (str_is(model, model_len, "llama")) {
        t->kind = KIND_SPM;
        t->bos = 1; t->eos = 2; t->unk = 0;
        t->add_space_prefix = true;
        t->add_bos = true;
    } else if (str_is(model, model_len, "gpt2")) {
        t->kind = KIND_BPE;
        t->bos = 11; t->eos = 11;
        const char *pre = "default";
        size_t pre_len = 7;
        lk_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len);
        if (!pre_from_name(pre, pre_len, &t->pre, &t->ignore_merges, &t->add_bos)) {
            st = lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: unknown pre-tokenizer tokenizer.ggml.pre='%s'",
                         lk_gguf_path(g), quote(q, sizeof q, pre, pre_len));
            goto fail;
        }
    } else if (str_is(model, model_len, "bert")) {
        t->kind = KIND_WPM;
        t->bos = 101; t->unk = 100; t->sep = 102; t->pad = 0; t->mask = 103;
        t->add_bos = true;
        t->add_sep = true;
    } else {
        st = lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: unsupported tokenizer.ggml.model '%s'",
                     lk_gguf_path(g), quote(q, sizeof q, model, model_len));
        goto fail;
    }
    {
        bool b;
        if (lk_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b)) t->add_space_prefix = b;
    }

    /* tokens, scores, types */
    lk_gguf_vtype et;
    uint64_t n;
    if (!lk_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n) || et != LK_GGUF_STRING) {
        st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tokenizer.ggml.tokens missing or not an array of strings",
                     lk_gguf_path(g));
        goto fail;
    }
    if (n == 0 || n > (1u << 24)) {
        st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tokenizer.ggml.tokens has %llu entries",
                     lk_gguf_path(g), (unsigned long long)n);
        goto fail;
    }
    t->n_vocab = (int32_t)n;
    const void *scores = NULL;
    bool scores_int = false;
    uint64_t na;
    if (lk_gguf_get_arr(g, "tokenizer.ggml.scores", &et, &na)) {
        if ((et != LK_GGUF_FLOAT32 && et != LK_GGUF_INT32) || na < n) {
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tokenizer.ggml.scores: %llu entries of type %s for %llu tokens",
                         lk_gguf_path(g), (unsigned long long)na, lk_gguf_vtype_name(et), (unsigned long long)n);
            goto fail;
        }
        scores = lk_gguf_arr_data(g, "tokenizer.ggml.scores");
        scores_int = et == LK_GGUF_INT32;
    }
    const void *types = NULL;
    if (lk_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &na)) {
        if (et != LK_GGUF_INT32 || na < n) {
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tokenizer.ggml.token_type: %llu entries of type %s for %llu tokens",
                         lk_gguf_path(g), (unsigned long long)na, lk_gguf_vtype_name(et), (unsigned long long)n);
            goto fail;
        }
        types = lk_gguf_arr_data(g, "tokenizer.ggml.token_type");
    }

    t->text_off = lk_xmalloc(n * sizeof *t->text_off);
    t->text_len = lk_xmalloc(n * sizeof *t->text_len);
    t->score = lk_xmalloc(n * sizeof *t->score);
    t->attr = lk_xmalloc(n * sizeof *t->attr);
    t->eog = lk_xcalloc(n, 1);
    t->tab_mask = pow2_at_least(2 * n) - 1;
    t->tab = lk_xmalloc(((size_t)t->tab_mask + 1) * sizeof *t->tab);
    memset(t->tab, 0xFF, ((size_t)t->tab_mask + 1) * sizeof *t->tab);
    lk_buf arena = {0};
    for (uint64_t i = 0; i < n; i++) {
        size_t len;
        const char *s = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &len);
        char empty[32];
        if (len == 0) { /* llama.cpp renames empty tokens so they stay unique */
            len = (size_t)snprintf(empty, sizeof empty, "[EMPTY_%llu]", (unsigned long long)i);
            s = empty;
        }
        if (len > (1u << 20) || arena.n + len + 1 > UINT32_MAX) {
            free(arena.p);
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: token %llu is %zu bytes long", lk_gguf_path(g),
                         (unsigned long long)i, len);
            goto fail;
        }
        t->text_off[i] = (uint32_t)arena.n;
        t->text_len[i] = (uint32_t)len;
        lk_buf_put(&arena, s, len);
        lk_buf_put(&arena, "", 1);
        t->max_token_len = LK_MAX(t->max_token_len, (int32_t)len);
        if (scores) {
            if (scores_int) { int32_t v; memcpy(&v, (const char *)scores + 4 * i, 4); t->score[i] = (float)v; }
            else memcpy(&t->score[i], (const char *)scores + 4 * i, 4);
        } else {
            t->score[i] = 0.0f;
        }
        int32_t ty = 1;
        if (types) memcpy(&ty, (const char *)types + 4 * i, 4);
        switch (ty) {
        case 1: t->attr[i] = ATTR_NORMAL; break;
        case 2: t->attr[i] = ATTR_UNKNOWN; break;
        case 3: t->attr[i] = ATTR_CONTROL; break;
        case 4: t->attr[i] = ATTR_USER_DEFINED; break;
        case 5: t->attr[i] = ATTR_UNUSED; break;
        case 6: t->attr[i] = ATTR_BYTE; break;
        default: t->attr[i] = 0; break;
        }
    }
    t->text = arena.p;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        const char *s = t->text + t->text_off[id];
        uint32_t h = (uint32_t)hash_bytes(s, t->text_len[id], 0) & t->tab_mask;
        while (t->tab[h] >= 0) {
            int32_t o = t->tab[h];
            if (t->text_len[o] == t->text_len[id] && !memcmp(t->text + t->text_off[o], s, t->text_len[id])) {
                st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: duplicate token '%s' (ids %d and %d)", lk_gguf_path(g),
                             quote(q, sizeof q, s, t->text_len[id]), o, id);
                goto fail;
            }
            h = (h + 1) & t->tab_mask;
        }
        t->tab[h] = id;
    }

    /* BPE merges: "left right", split at the first space after the first byte */
    if (t->kind == KIND_BPE) {
        uint64_t nm;
        if (!lk_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &nm) || et != LK_GGUF_STRING) {
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tokenizer.ggml.merges missing or not an array of strings",
                         lk_gguf_path(g));
            goto fail;
        }
        if (nm > (1u << 24)) {
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %llu merges", lk_gguf_path(g), (unsigned long long)nm);
            goto fail;
        }
        t->merges = lk_xmalloc((nm + 1) * sizeof *t->merges);
        t->mtab_mask = pow2_at_least(2 * nm + 2) - 1;
        t->mtab = lk_xmalloc(((size_t)t->mtab_mask + 1) * sizeof *t->mtab);
        memset(t->mtab, 0xFF, ((size_t)t->mtab_mask + 1) * sizeof *t->mtab);
        lk_buf mt = {0};
        for (uint64_t i = 0; i < nm; i++) {
            size_t len;
            const char *s = lk_gguf_arr_str(g, "tokenizer.ggml.merges", i, &len);
            const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
            if (!sp || mt.n + len > UINT32_MAX) continue; /* llama.cpp: pair ("", ""), never looked up */
            size_t llen = (size_t)(sp - s), rlen = len - llen - 1;
            merge_t m = {(uint32_t)mt.n, (uint32_t)llen, (uint32_t)rlen, (int32_t)i};
            lk_buf_put(&mt, s, llen);
            lk_buf_put(&mt, sp + 1, rlen);
            /* first occurrence of a pair keeps its rank (map emplace) */
            const char *key = mt.p + m.off;
            uint32_t h = (uint32_t)merge_hash(key, llen, llen + rlen) & t->mtab_mask;
            bool dup = false;
            while (t->mtab[h] >= 0) {
                const merge_t *o = &t->merges[t->mtab[h]];
                if (o->llen == llen && o->rlen == rlen && !memcmp(mt.p + o->off, key, llen + rlen)) { dup = true; break; }
                h = (h + 1) & t->mtab_mask;
            }
            if (dup) { mt.n = m.off; continue; }
            t->merges[t->n_merges] = m;
            t->mtab[h] = t->n_merges++;
        }
        t->merge_text = mt.p ? mt.p : lk_xcalloc(1, 1);
    }

    if (t->kind == KIND_SPM) {
        for (int32_t id = 0; id < t->n_vocab && t->n_inner >= 0; id++) {
            const char *x = t->text + t->text_off[id];
            uint32_t xl = t->text_len[id];
            for (uint32_t o = 1; o + 3 <= xl; o++) {
                if (memcmp(x + o, "\xE2\x96\x81", 3)) continue;
                if (t->n_inner == (int32_t)(sizeof t->inner / sizeof t->inner[0])) { t->n_inner = -1; break; }
                t->inner[t->n_inner].id = id;
                t->inner[t->n_inner++].off = o;
            }
        }
    }

    /* SPM byte fallback tokens */
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        int32_t id = lookup(t, name, 6);
        if (id < 0) {
            char c = (char)b;
            id = lookup(t, &c, 1);
        }
        t->byte_tok[b] = id;
    }
    init_byte_cpts(t->byte_cpt);

    /* special ids: defaults out of range are dropped, GGUF keys override */
    {
        static const struct { const char *key; size_t field; } keys[] = {
            {"tokenizer.ggml.bos_token_id", offsetof(lk_tokenizer, bos)},
            {"tokenizer.ggml.eos_token_id", offsetof(lk_tokenizer, eos)},
            {"tokenizer.ggml.eot_token_id", offsetof(lk_tokenizer, eot)},
            {"tokenizer.ggml.eom_token_id", offsetof(lk_tokenizer, eom)},
            {"tokenizer.ggml.unknown_token_id", offsetof(lk_tokenizer, unk)},
            {"tokenizer.ggml.seperator_token_id", offsetof(lk_tokenizer, sep)},
            {"tokenizer.ggml.padding_token_id", offsetof(lk_tokenizer, pad)},
            {"tokenizer.ggml.mask_token_id", offsetof(lk_tokenizer, mask)},
            {"tokenizer.ggml.fim_pre_token_id", offsetof(lk_tokenizer, fim_pre)},
            {"tokenizer.ggml.fim_suf_token_id", offsetof(lk_tokenizer, fim_suf)},
            {"tokenizer.ggml.fim_mid_token_id", offsetof(lk_tokenizer, fim_mid)},
            {"tokenizer.ggml.fim_pad_token_id", offsetof(lk_tokenizer, fim_pad)},
            {"tokenizer.ggml.fim_rep_token_id", offsetof(lk_tokenizer, fim_rep)},
            {"tokenizer.ggml.fim_sep_token_id", offsetof(lk_tokenizer, fim_sep)},
            {"tokenizer.ggml.prefix_token_id", offsetof(lk_tokenizer, fim_pre)},
            {"tokenizer.ggml.suffix_token_id", offsetof(lk_tokenizer, fim_suf)},
            {"tokenizer.ggml.middle_token_id", offsetof(lk_tokenizer, fim_mid)},
        };
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
            int32_t *id = (int32_t *)((char *)t + keys[i].field);
            if (*id >= t->n_vocab) *id = -1;
            uint64_t v;
            if (lk_gguf_get_u64(g, keys[i].key, &v) && v < (uint64_t)t->n_vocab) *id = (int32_t)v;
        }
        bool b;
        if (lk_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b)) t->add_bos = b;
        if (lk_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &b)) t->add_eos = b;
        if (lk_gguf_get_bool(g, "tokenizer.ggml.add_sep_token", &b)) t->add_sep = b;
        if ((t->add_bos && t->bos < 0) || (t->add_eos && t->eos < 0) || (t->add_sep && t->sep < 0)) {
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: add_bos/add_eos/add_sep is set but its token id is not",
                         lk_gguf_path(g));
            goto fail;
        }
        if (t->kind == KIND_WPM) {
            t->wpm_lowercase = true; /* BERT's normaliser default */
            lk_gguf_get_bool(g, "tokenizer.ggml.normalizer.lowercase", &t->wpm_lowercase);
            t->wpm_strip_accents = t->wpm_lowercase;
            lk_gguf_get_bool(g, "tokenizer.ggml.normalizer.strip_accents", &t->wpm_strip_accents);
        }
    }
    autodetect_specials(t);
    build_eog(t);

    /* special tokens cache: every CONTROL / USER_DEFINED / UNKNOWN token,
     * longest text first, so that the partition prefers the longest match */
    t->special = lk_xmalloc(n * sizeof *t->special);
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (t->attr[id] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)) t->special[t->n_special++] = id;
    qsort_r(t->special, (size_t)t->n_special, sizeof *t->special, cmp_special, t);

    /* Phi-3 (recognised by general.name, as llama.cpp does): special tokens eat
     * the white space that follows them, except <unk>, <s>, <|endoftext|>. */
    {
        const char *name;
        size_t nl;
        if (lk_gguf_get_str(g, "general.name", &name, &nl)) {
            char low[256];
            size_t k = LK_MIN(nl, sizeof low - 1);
            for (size_t i = 0; i < k; i++) low[i] = (char)tolower((unsigned char)name[i]);
            low[k] = 0;
            if (strstr(low, "phi-3") || strstr(low, "phi3")) {
                for (int32_t i = 0; i < t->n_special; i++) t->attr[t->special[i]] |= ATTR_RSTRIP;
                int32_t id = find_text(t, "</s>");
                if (id >= 0) t->attr[id] |= ATTR_RSTRIP;
                const char *keep[] = {"<unk>", "<s>", "<|endoftext|>"};
                for (int i = 0; i < 3; i++) {
                    id = find_text(t, keep[i]);
                    if (id >= 0) t->attr[id] &= ~(uint32_t)ATTR_RSTRIP;
                }
            }
        }
    }

    /* piece cache */
    {
        lk_buf pc = {0};
        t->piece_off = lk_xmalloc(n * sizeof *t->piece_off);
        t->piece_len = lk_xmalloc(n * sizeof *t->piece_len);
        for (int32_t id = 0; id < t->n_vocab; id++) {
            size_t before = pc.n;
            build_piece(t, id, &pc);
            t->piece_off[id] = (uint32_t)before;
            t->piece_len[id] = (uint32_t)(pc.n - before);
            t->max_piece_len = LK_MAX(t->max_piece_len, (int32_t)t->piece_len[id]);
        }
        t->piece = pc.p ? pc.p : lk_xcalloc(1, 1);
    }

    *out = t;
    return LK_OK;
fail:
    lk_tokenizer_free(t);
    return st;
}

int32_t lk_tokenizer_n_vocab(const lk_tokenizer *t) { return t->n_vocab; }
int32_t lk_tokenizer_bos(const lk_tokenizer *t) { return t->bos; }
int32_t lk_tokenizer_eos(const lk_tokenizer *t) { return t->eos; }
bool lk_tokenizer_add_bos(const lk_tokenizer *t) { return t->add_bos; }
bool lk_tokenizer_is_eog(const lk_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && t->eog[id];
}

int32_t lk_tokenizer_find(const lk_tokenizer *t, const char *text, size_t len) {
    return text ? lookup(t, text, len) : -1;
}

const char *lk_tokenizer_token_text(const lk_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) {
        if (len) *len = 0;
        return "";
    }
    if (len) *len = t->text_len[id];
    return t->text + t->text_off[id];
}

/* ======================================================================
 * Encoding scaffolding: output vector, scratch
 * ==================================================================== */

typedef struct { int32_t *v; size_t n, cap; } ids_t;
static void ids_push(ids_t *o, int32_t id) {
    if (o->n == o->cap) {
        o->cap = o->cap ? o->cap * 2 : 64;
        o->v = lk_xrealloc(o->v, o->cap * sizeof *o->v);
    }
    o->v[o->n++] = id;
}

/* ======================================================================
 * 3. special-token partition
 *
 * The text is cut into fragments: raw text, or one special token. Tokens are
 * tried longest first; each one splits every raw fragment at all its
 * occurrences. USER_DEFINED tokens are always recognised (like a tokenizer's
 * "added tokens"); CONTROL and UNKNOWN ones only with parse_special, so user
 * text can never smuggle in a control token by writing its name.
 * ==================================================================== */

typedef struct { int32_t tok; uint32_t off, len; } frag_t; /* tok >= 0: a token, else text[off..off+len) */
typedef struct { frag_t *v; size_t n, cap; } frags_t;
static void frag_push(frags_t *f, int32_t tok, size_t off, size_t len) {
    if (f->n == f->cap) {
        f->cap = f->cap ? f->cap * 2 : 16;
        f->v = lk_xrealloc(f->v, f->cap * sizeof *f->v);
    }
    f->v[f->n++] = (frag_t){tok, (uint32_t)off, (uint32_t)len};
}

static void partition(const lk_tokenizer *t, const char *text, size_t len, bool parse_special, frags_t *out) {
    frags_t a = {0}, b = {0};
    if (len) frag_push(&a, -1, 0, len);
    /* Which bytes and byte pairs occur at all: a special token whose first
     * two bytes never occur cannot match, which skips almost every one of the
     * thousands some vocabularies declare (deepseek: 2398) without a scan. */
    uint64_t pairs[65536 / 64] = {0}, singles[4] = {0};
    for (size_t i = 0; i < len; i++) {
        unsigned c = (unsigned char)text[i];
        singles[c >> 6] |= 1ull << (c & 63);
        if (i + 1 < len) {
            unsigned pr = c << 8 | (unsigned char)text[i + 1];
            pairs[pr >> 6] |= 1ull << (pr & 63);
        }
    }
    for (int32_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        uint32_t at = t->attr[id];
        if (!parse_special && (at & (ATTR_CONTROL | ATTR_UNKNOWN))) continue;
        const char *tt = t->text + t->text_off[id];
        size_t tl = t->text_len[id];
        if (tl == 0 || tl > len) continue;
        unsigned c0 = (unsigned char)tt[0];
        if (!(singles[c0 >> 6] >> (c0 & 63) & 1)) continue;
        if (tl >= 2) {
            unsigned pr = c0 << 8 | (unsigned char)tt[1];
            if (!(pairs[pr >> 6] >> (pr & 63) & 1)) continue;
        }
        b.n = 0;
        for (size_t i = 0; i < a.n; i++) {
            frag_t f = a.v[i];
            if (f.tok >= 0) { frag_push(&b, f.tok, 0, 0); continue; }
            size_t pos = f.off, end = (size_t)f.off + f.len;
            for (;;) {
                const char *m = pos < end ? memmem(text + pos, end - pos, tt, tl) : NULL;
                if (!m) break;
                size_t mp = (size_t)(m - text);
                size_t ll = mp - pos;
                if (at & ATTR_LSTRIP)
                    while (ll > 0 && isspace((unsigned char)text[pos + ll - 1])) ll--;
                if (ll) frag_push(&b, -1, pos, ll);
                frag_push(&b, id, 0, 0);
                pos = mp + tl;
                if (at & ATTR_RSTRIP)
                    while (pos < end && isspace((unsigned char)text[pos])) pos++;
            }
            if (pos < end) frag_push(&b, -1, pos, end - pos);
        }
        frags_t sw = a; a = b; b = sw;
    }
    free(b.v);
    *out = a;
}

/* ======================================================================
 * bigram work queue (binary heap) shared by SPM and BPE
 * ==================================================================== */

typedef struct {
    int32_t  left, right;
    float    score;  /* SPM: higher first */
    int32_t  rank;   /* BPE: lower first */
    uint32_t size;   /* bytes of left + right when queued (staleness check) */
} bigram_t;

typedef struct {
    bigram_t *v;
    size_t    n, cap;
    bool      by_rank;
} heap_t;

/* true if a should come out before b: best score (or lowest rank), then leftmost */
static inline bool before(const heap_t *h, const bigram_t *a, const bigram_t *b) {
    if (h->by_rank) {
        if (a->rank != b->rank) return a->rank < b->rank;
    } else {
        if (a->score != b->score) return a->score > b->score;
    }
    return a->left < b->left;
}

static void heap_push(heap_t *h, bigram_t x) {
    if (h->n == h->cap) {
        h->cap = h->cap ? h->cap * 2 : 64;
        h->v = lk_xrealloc(h->v, h->cap * sizeof *h->v);
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!before(h, &x, &h->v[p])) break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = x;
}

static bigram_t heap_pop(heap_t *h) {
    bigram_t top = h->v[0];
    bigram_t x = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && before(h, &h->v[c + 1], &h->v[c])) c++;
        if (!before(h, &h->v[c], &x)) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n) h->v[i] = x;
    return top;
}

typedef struct {
    int32_t  prev, next;
    uint32_t off, n;   /* bytes text[off..off+n); n == 0 once merged away */
} sym_t;

typedef struct { sym_t *v; size_t cap; } syms_t;
static sym_t *syms_reserve(syms_t *s, size_t n) {
    if (n > s->cap) {
        s->cap = n;
        s->v = lk_xrealloc(s->v, n * sizeof *s->v);
    }
    return s->v;
}

/* Splits s[0..n) into UTF-8 "characters" by their lead byte (a stray byte is
 * one character), linked in order. Returns the count. */
static size_t split_chars(const char *s, size_t n, sym_t *sym) {
    size_t k = 0;
    for (size_t off = 0; off < n;) {
        size_t len = LK_MIN((size_t)lk_utf8_len((unsigned char)s[off]), n - off);
        sym[k] = (sym_t){(int32_t)k - 1, off + len == n ? -1 : (int32_t)k + 1, (uint32_t)off, (uint32_t)len};
        off += len;
        k++;
    }
    return k;
}

/* ======================================================================
 * 4. SentencePiece (llama.cpp llm_tokenizer_spm): repeatedly merge the
 * adjacent pair whose concatenation is the highest-scoring vocabulary entry;
 * pieces left without a token become byte tokens.
 * ==================================================================== */

/* Per-call memo. A stretch of text whose tokens cannot depend on its
 * neighbours (a BPE word; a SentencePiece stretch between safe cuts) always
 * gives the same tokens, and natural text repeats its words constantly, so
 * each distinct stretch is tokenised once per call. Bounded, so hostile text
 * of all-distinct words only costs the table. */
typedef struct { uint64_t h; uint32_t koff, klen, voff, vlen; } memo_e;
typedef struct {
    lk_buf  keys;   /* key bytes back to back */
    ids_t    vals;   /* token ids back to back */
    memo_e  *e;      /* open addressing, klen == UINT32_MAX: empty */
    uint32_t mask, used;
} memo_t;

enum { MEMO_MAX_KEY = 96, MEMO_MAX_ENTRIES = 1 << 16 };

static void memo_free(memo_t *m) { free(m->keys.p); free(m->vals.v); free(m->e); }

/* Appends the memoised tokens of k[0..n) to out; false if not there. */
static bool memo_get(const memo_t *m, const char *k, size_t n, uint64_t h, ids_t *out) {
    if (!m->e) return false;
    for (uint32_t i = (uint32_t)h & m->mask;; i = (i + 1) & m->mask) {
        const memo_e *e = &m->e[i];
        if (e->klen == UINT32_MAX) return false;
        if (e->h == h && e->klen == n && !memcmp(m->keys.p + e->koff, k, n)) {
            for (uint32_t j = 0; j < e->vlen; j++) ids_push(out, m->vals.v[e->voff + j]);
            return true;
        }
    }
}

/* Memoises src->v[first..src->n) (possibly none: src->v may still be NULL)
 * as the tokens of k[0..n). */
static void memo_put(memo_t *m, const char *k, size_t n, uint64_t h, const ids_t *src, size_t first) {
    size_t nids = src->n - first;
    if (m->used >= MEMO_MAX_ENTRIES) return;
    if (!m->e || 2 * (m->used + 1) > m->mask + 1) { /* grow (and rehash) */
        uint32_t cap = m->e ? 2 * (m->mask + 1) : 1024;
        memo_e *ne = lk_xmalloc(cap * sizeof *ne);
        for (uint32_t i = 0; i < cap; i++) ne[i].klen = UINT32_MAX;
        for (uint32_t i = 0; m->e && i <= m->mask; i++) {
            if (m->e[i].klen == UINT32_MAX) continue;
            uint32_t j = (uint32_t)m->e[i].h & (cap - 1);
            while (ne[j].klen != UINT32_MAX) j = (j + 1) & (cap - 1);
            ne[j] = m->e[i];
        }
        free(m->e);
        m->e = ne;
        m->mask = cap - 1;
    }
    uint32_t i = (uint32_t)h & m->mask;
    while (m->e[i].klen != UINT32_MAX) i = (i + 1) & m->mask;
    m->e[i] = (memo_e){h, (uint32_t)m->keys.n, (uint32_t)n, (uint32_t)m->vals.n, (uint32_t)nids};
    lk_buf_put(&m->keys, k, n);
    for (size_t j = first; j < src->n; j++) ids_push(&m->vals, src->v[j]);
    m->used++;
}

typedef struct {
    syms_t syms;
    heap_t heap;
    lk_buf buf;
    memo_t memo;
    ids_t  *out;
} spm_ctx;

static void spm_try_add(const lk_tokenizer *t, spm_ctx *c, const char *s, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const sym_t *L = &c->syms.v[l], *R = &c->syms.v[r];
    int32_t id = lookup(t, s + L->off, L->n + R->n);
    if (id < 0) return;
    heap_push(&c->heap, (bigram_t){l, r, t->score[id], 0, L->n + R->n});
}

static void spm_tokenize(const lk_tokenizer *t, spm_ctx *c, const char *s, size_t n) {
    if (!n) return;
    sym_t *sym = syms_reserve(&c->syms, n);
    size_t ns = split_chars(s, n, sym);
    c->heap.n = 0;
    c->heap.by_rank = false;
    for (size_t i = 1; i < ns; i++) spm_try_add(t, c, s, (int32_t)i - 1, (int32_t)i);
    while (c->heap.n) {
        bigram_t bg = heap_pop(&c->heap);
        sym_t *L = &c->syms.v[bg.left], *R = &c->syms.v[bg.right];
        if (L->n == 0 || R->n == 0 || L->n + R->n != bg.size) continue; /* stale */
        L->n += R->n;
        R->n = 0;
        L->next = R->next;
        if (R->next >= 0) c->syms.v[R->next].prev = bg.left;
        spm_try_add(t, c, s, L->prev, bg.left);
        spm_try_add(t, c, s, bg.left, L->next);
    }
    for (int32_t i = 0; i != -1; i = c->syms.v[i].next) {
        const sym_t *y = &c->syms.v[i];
        int32_t id = lookup(t, s + y->off, y->n);
        if (id >= 0) { ids_push(c->out, id); continue; }
        for (uint32_t j = 0; j < y->n; j++) {
            int32_t b = t->byte_tok[(unsigned char)s[y->off + j]];
            if (b < 0) b = t->unk;
            if (b >= 0) ids_push(c->out, b);
        }
    }
}

/* True if no vocabulary entry occurs in s spanning byte b (covering both
 * s[b-1] and s[b]). Merges only ever build vocabulary entries, so no symbol
 * can then grow across b, and the two sides merge independently: the heap
 * interleaves their merges but never lets one side change the other. */
static bool spm_safe_cut(const lk_tokenizer *t, const char *s, size_t n, size_t lo, size_t b) {
    size_t L = (size_t)t->max_token_len;
    size_t s0 = b - lo > L ? b - L : lo;
    for (size_t i = s0; i < b; i++)
        for (size_t e = b + 1; e <= n && e - i <= L; e++)
            if (lookup(t, s + i, e - i) >= 0) return false;
    return true;
}

/* Bytes of the symbol starting at b, as split_chars cuts it. */
static inline size_t sym_len(const char *s, size_t b, size_t n) {
    return LK_MIN((size_t)lk_utf8_len((unsigned char)s[b]), n - b);
}

/* A long text is one SentencePiece sequence, and its merge queue would hold a
 * bigram per character: one heap of millions of entries, which is slow for
 * being cache-hostile. Cutting it at safe points (spm_safe_cut) gives
 * exactly the same tokens from small heaps. */
static void spm_chunked(const lk_tokenizer *t, spm_ctx *c, const char *s, size_t n) {
    enum { CHUNK = 2048, TRIES = 16 };
    size_t start = 0, win = CHUNK;
    /* a vocabulary with very long entries would make each check too costly */
    while (t->max_token_len <= 64 && n - start > win + CHUNK) {
        /* look for a cut at a symbol start in [start+win, start+win+CHUNK):
         * first before a "▁" (a word start, nearly always safe), then at any */
        size_t cut = 0, lo = start + win, hi = LK_MIN(n - CHUNK, lo + CHUNK), b0 = start;
        while (b0 < lo) b0 += sym_len(s, b0, n);
        int tries = 0;
        for (size_t b = b0; b + 3 <= hi && tries < TRIES && !cut; b += sym_len(s, b, n))
            if (!memcmp(s + b, "\xE2\x96\x81", 3) && (tries++, spm_safe_cut(t, s, n, start, b))) cut = b;
        for (size_t b = b0; b < hi && tries < 2 * TRIES && !cut; b += sym_len(s, b, n))
            if ((tries++, spm_safe_cut(t, s, n, start, b))) cut = b;
        if (!cut) { win *= 2; continue; } /* this chunk grows; look less often */
        spm_tokenize(t, c, s + start, cut - start);
        start = cut;
        win = CHUNK;
    }
    spm_tokenize(t, c, s + start, n - start);
}

/* One stretch between safe cuts: from the memo when short. */
static void spm_stretch(const lk_tokenizer *t, spm_ctx *c, const char *s, size_t n) {
    if (n > MEMO_MAX_KEY) { spm_chunked(t, c, s, n); return; }
    uint64_t h = hash_bytes(s, n, 7);
    if (memo_get(&c->memo, s, n, h, c->out)) return;
    size_t first = c->out->n;
    spm_tokenize(t, c, s, n);
    memo_put(&c->memo, s, n, h, c->out, first);
}

/* Is a cut before the "▁" symbol at b safe? A symbol spanning b would be a
 * vocabulary entry with that "▁" inside it, after its first byte: only the
 * entries in t->inner (few: "▁▁", "▁▁▁", ... in Llama) can be. */
static bool spm_safe_space_cut(const lk_tokenizer *t, const char *s, size_t n, size_t b) {
    for (int32_t i = 0; i < t->n_inner; i++) {
        int32_t id = t->inner[i].id;
        size_t o = t->inner[i].off, kl = t->text_len[id];
        const char *kt = t->text + t->text_off[id];
        if (b >= o && b - o + kl <= n && s[b - 1] == kt[o - 1] && !memcmp(s + b - o, kt, kl)) return false;
    }
    return true;
}

/* text with the optional prefix space, every ' ' written as U+2581; cut
 * before every "▁" where that is safe, each stretch tokenised on its own */
static void spm_fragment(const lk_tokenizer *t, spm_ctx *c, const char *s, size_t n, bool prefix) {
    c->buf.n = 0;
    if (prefix) lk_buf_put(&c->buf, "\xE2\x96\x81", 3);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            lk_buf_put(&c->buf, s + run, i - run);
            lk_buf_put(&c->buf, "\xE2\x96\x81", 3);
            run = i + 1;
        }
    }
    lk_buf_put(&c->buf, s + run, n - run);
    const char *b = c->buf.p;
    size_t bn = c->buf.n;
    if (t->n_inner < 0) { spm_chunked(t, c, b, bn); return; }
    size_t start = 0;
    for (size_t p = 0; p < bn; p += sym_len(b, p, bn)) {
        if (p > start && p + 3 <= bn && !memcmp(b + p, "\xE2\x96\x81", 3) && spm_safe_space_cut(t, b, bn, p)) {
            spm_stretch(t, c, b + start, p - start);
            start = p;
        }
    }
    spm_stretch(t, c, b + start, bn - start);
}

/* ======================================================================
 * 5. byte-level BPE (llama.cpp llm_tokenizer_bpe): pre-tokenise into words,
 * write each word's bytes as GPT-2 byte symbols, then repeatedly merge the
 * adjacent pair with the lowest merge rank.
 * ==================================================================== */

typedef struct {
    uint32_t *cpts;
    uint16_t *flags;
    uint32_t *lens, *tmp;
    size_t    cap;      /* code points the four arrays hold */
    lk_buf   word;
    syms_t    syms;
    heap_t    heap;
    memo_t    memo;
    ids_t    *out;
} bpe_ctx;

static void bpe_word(const lk_tokenizer *t, bpe_ctx *c, const char *w, size_t n) {
    if (t->ignore_merges) {
        int32_t id = lookup(t, w, n);
        if (id >= 0) { ids_push(c->out, id); return; }
    }
    sym_t *sym = syms_reserve(&c->syms, n);
    size_t ns = split_chars(w, n, sym);
    c->heap.n = 0;
    c->heap.by_rank = true;
    for (size_t i = 1; i < ns; i++) {
        int32_t r = merge_rank(t, w + sym[i - 1].off, sym[i - 1].n, sym[i - 1].n + sym[i].n);
        if (r >= 0) heap_push(&c->heap, (bigram_t){(int32_t)i - 1, (int32_t)i, 0, r, sym[i - 1].n + sym[i].n});
    }
    while (c->heap.n) {
        bigram_t bg = heap_pop(&c->heap);
        sym_t *L = &sym[bg.left], *R = &sym[bg.right];
        if (L->n == 0 || R->n == 0 || L->n + R->n != bg.size) continue; /* stale */
        L->n += R->n;
        R->n = 0;
        L->next = R->next;
        if (R->next >= 0) sym[R->next].prev = bg.left;
        if (L->prev >= 0) {
            sym_t *P = &sym[L->prev];
            int32_t r = merge_rank(t, w + P->off, P->n, P->n + L->n);
            if (r >= 0) heap_push(&c->heap, (bigram_t){L->prev, bg.left, 0, r, P->n + L->n});
        }
        if (L->next >= 0) {
            sym_t *N = &sym[L->next];
            int32_t r = merge_rank(t, w + L->off, L->n, L->n + N->n);
            if (r >= 0) heap_push(&c->heap, (bigram_t){bg.left, L->next, 0, r, L->n + N->n});
        }
    }
    for (int32_t i = 0; ns && i != -1; i = sym[i].next) {
        if (!sym[i].n) continue;
        int32_t id = lookup(t, w + sym[i].off, sym[i].n);
        if (id >= 0) { ids_push(c->out, id); continue; }
        /* no token for the merged piece: each of its bytes, where that byte
         * alone is a token (llama.cpp drops the others) */
        for (uint32_t j = 0; j < sym[i].n; j++) {
            int32_t b = lookup(t, w + sym[i].off + j, 1);
            if (b >= 0) ids_push(c->out, b);
        }
    }
}

static void bpe_fragment(const lk_tokenizer *t, bpe_ctx *c, const char *s, size_t n) {
    if (n > c->cap) {
        c->cap = n;
        c->cpts = lk_xrealloc(c->cpts, n * sizeof *c->cpts);
        c->flags = lk_xrealloc(c->flags, n * sizeof *c->flags);
        c->lens = lk_xrealloc(c->lens, n * sizeof *c->lens);
        c->tmp = lk_xrealloc(c->tmp, n * sizeof *c->tmp);
    }
    size_t nc = lk_utf8_decode(s, n, c->cpts);
    for (size_t i = 0; i < nc; i++) c->flags[i] = lk_unicode_flags(c->cpts[i]);
    size_t nw = lk_pretok_split(t->pre, c->cpts, c->flags, nc, c->lens, c->tmp);
    size_t at = 0;
    for (size_t k = 0; k < nw; k++) {
        /* the word's UTF-8 (re-encoded from code points, so invalid input bytes
         * are U+FFFD), each byte written as its GPT-2 symbol */
        c->word.n = 0;
        for (size_t i = at; i < at + c->lens[k]; i++) {
            char u8[4];
            int m = lk_utf8_encode(c->cpts[i], u8);
            for (int j = 0; j < m; j++) {
                char sy[4];
                int q = lk_utf8_encode(t->byte_cpt[(unsigned char)u8[j]], sy);
                lk_buf_put(&c->word, sy, (size_t)q);
            }
        }
        at += c->lens[k];
        if (c->word.n > MEMO_MAX_KEY) { bpe_word(t, c, c->word.p, c->word.n); continue; }
        uint64_t h = hash_bytes(c->word.p, c->word.n, 7);
        if (memo_get(&c->memo, c->word.p, c->word.n, h, c->out)) continue;
        size_t first = c->out->n;
        bpe_word(t, c, c->word.p, c->word.n);
        memo_put(&c->memo, c->word.p, c->word.n, h, c->out, first);
    }
}

/* ======================================================================
 * 6. WordPiece (llama.cpp llm_tokenizer_wpm): BERT normalisation (lower case,
 * accents stripped), split on white space and around punctuation, then the
 * longest vocabulary match from each position of "▁word"; a word with no
 * full cover becomes [UNK].
 * ==================================================================== */

static bool wpm_chinese(uint32_t c) {
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
           (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

static void wpm_word(const lk_tokenizer *t, const char *w, size_t n, ids_t *out) {
    size_t start = out->n;
    for (size_t i = 0; i < n; i++) {
        bool match = false;
        for (size_t j = LK_MIN(n, i + (size_t)t->max_token_len + 1); j > i; j--) {
            int32_t id = lookup(t, w + i, j - i);
            if (id >= 0) {
                ids_push(out, id);
                match = true;
                i = j - 1;
                break;
            }
        }
        if (!match) { out->n = start; break; }
    }
    if (out->n == start && t->unk >= 0) ids_push(out, t->unk);
}

static void wpm_fragment(const lk_tokenizer *t, const char *s, size_t n, ids_t *out) {
    uint32_t *cp = lk_xmalloc((n + 1) * sizeof *cp);
    size_t nc = lk_utf8_decode(s, n, cp);
    lk_buf w = {0};
    lk_buf_put(&w, "\xE2\x96\x81", 3);   /* every word starts with the phantom space */
    for (size_t i = 0; i < nc; i++) {
        uint32_t c = cp[i];
        if (t->wpm_strip_accents) c = lk_unicode_nfd_first(c);
        uint16_t f = lk_unicode_flags(c);
        if (f & LK_CPT_WHITESPACE) {
            if (w.n > 3) wpm_word(t, w.p, w.n, out);
            w.n = 3;
            continue;
        }
        if (c == 0 || c == 0xFFFD || (f & LK_CPT_CONTROL)) continue;
        if (t->wpm_strip_accents && (f & LK_CPT_MARK)) continue;
        char u8[4];
        int k = lk_utf8_encode(t->wpm_lowercase ? lk_unicode_tolower(c) : c, u8);
        if ((f & LK_CPT_PUNCT) || (c < 0x7F && (f & LK_CPT_SYMBOL)) || wpm_chinese(c)) {
            if (w.n > 3) wpm_word(t, w.p, w.n, out);
            w.n = 3;
            lk_buf_put(&w, u8, (size_t)k);
            wpm_word(t, w.p, w.n, out);
            w.n = 3;
        } else {
            lk_buf_put(&w, u8, (size_t)k);
        }
    }
    if (w.n > 3) wpm_word(t, w.p, w.n, out);
    free(w.p);
    free(cp);
}

/* ======================================================================
 * encode
 * ==================================================================== */

lk_status lk_tokenizer_encode(const lk_tokenizer *t, const char *text, size_t len, bool add_special,
                              bool parse_special, int32_t **ids, int32_t *n_ids, char *err, size_t errlen) {
    *ids = NULL;
    *n_ids = 0;
    if (!text && len) return lk_fail(err, errlen, LK_ERR_ARG, "tokenize: NULL text of length %zu", len);
    if (len > (size_t)INT32_MAX / 8)
        return lk_fail(err, errlen, LK_ERR_ARG, "tokenize: text of %zu bytes is too long", len);
    ids_t out = {0};
    frags_t fr;
    partition(t, text, len, parse_special, &fr);
    switch (t->kind) {
    case KIND_SPM: {
        spm_ctx c = {.out = &out};
        if (add_special && t->add_bos) ids_push(&out, t->bos);
        bool prev_special = true; /* the first fragment gets the prefix space too */
        for (size_t i = 0; i < fr.n; i++) {
            if (fr.v[i].tok >= 0) {
                ids_push(&out, fr.v[i].tok);
                prev_special = true;
            } else {
                spm_fragment(t, &c, text + fr.v[i].off, fr.v[i].len, t->add_space_prefix && prev_special);
                prev_special = false;
            }
        }
        if (add_special && t->add_eos) ids_push(&out, t->eos);
        free(c.syms.v); free(c.heap.v); free(c.buf.p); memo_free(&c.memo);
        break;
    }
    case KIND_BPE: {
        bpe_ctx c = {.out = &out};
        if (add_special && t->add_bos) ids_push(&out, t->bos);
        for (size_t i = 0; i < fr.n; i++) {
            if (fr.v[i].tok >= 0) ids_push(&out, fr.v[i].tok);
            else bpe_fragment(t, &c, text + fr.v[i].off, fr.v[i].len);
        }
        if (add_special && t->add_eos) ids_push(&out, t->eos);
        free(c.cpts); free(c.flags); free(c.lens); free(c.tmp); free(c.word.p); free(c.syms.v); free(c.heap.v);
        memo_free(&c.memo);
        break;
    }
    case KIND_WPM: {
        if (add_special && t->bos >= 0) ids_push(&out, t->bos);
        for (size_t i = 0; i < fr.n; i++) {
            if (fr.v[i].tok >= 0) ids_push(&out, fr.v[i].tok);
            else wpm_fragment(t, text + fr.v[i].off, fr.v[i].len, &out);
        }
        if (add_special && t->sep >= 0) ids_push(&out, t->sep);
        break;
    }
    }
    free(fr.v);
    if (!out.v) out.v = lk_xmalloc(sizeof(int32_t));
    *ids = out.v;
    *n_ids = (int32_t)out.n;
    return LK_OK;
}

/* ======================================================================
 * 7. pieces and streaming detokenisation
 * ==================================================================== */

int32_t lk_tokenizer_piece(const lk_tokenizer *t, int32_t id, bool special, char *buf, int32_t cap) {
    if (id < 0 || id >= t->n_vocab) return 0;
    if (!special && (t->attr[id] & (ATTR_UNKNOWN | ATTR_CONTROL))) return 0;
    int32_t n = (int32_t)t->piece_len[id];
    if (n > cap) return -n;
    memcpy(buf, t->piece + t->piece_off[id], (size_t)n);
    return n;
}

int32_t lk_tokenizer_max_piece(const lk_tokenizer *t) { return t->max_piece_len; }

int32_t lk_tokenizer_decode(const lk_tokenizer *t, const int32_t *ids, int32_t n, bool special, char *buf,
                            int32_t cap) {
    int64_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab) continue;
        if (!special && (t->attr[id] & (ATTR_UNKNOWN | ATTR_CONTROL))) continue;
        const char *p = t->piece + t->piece_off[id];
        uint32_t len = t->piece_len[id];
        /* SentencePiece: the first token's leading space is the prefix space
         * the encoder added (llama.cpp's detokenize lstrip) */
        if (i == 0 && t->add_space_prefix && len && p[0] == ' ') { p++; len--; }
        if (len && total + len <= cap) memcpy(buf + total, p, len);
        total += len;
    }
    if (total > INT32_MAX) total = INT32_MAX;
    return total <= cap ? (int32_t)total : -(int32_t)total;
}

void lk_detok_init(lk_detok *d, const lk_tokenizer *t) {
    memset(d, 0, sizeof *d);
    d->tok = t;
}

/* Appends one byte to the output (dry run when out is NULL). */
static inline void put(char *out, int32_t *n, int32_t cap, const char *s, int32_t k) {
    if (out && *n + k <= cap) memcpy(out + *n, s, (size_t)k);
    *n += k;
}

/* Length of the longest prefix of s[0..n) that is a possibly incomplete but
 * so-far valid UTF-8 sequence (0 if s[0] cannot start one), and whether it is
 * complete. Strict: no overlongs, no surrogates, nothing above U+10FFFF. */
static int utf8_prefix(const unsigned char *s, int n, bool *complete) {
    unsigned c = s[0];
    int len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c < 0x80) { *complete = true; return 1; }
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else { *complete = false; return 0; }
    int k = 1;
    for (; k < len && k < n; k++) {
        unsigned b = s[k];
        if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) { *complete = false; return 0; }
    }
    *complete = k == len;
    return k;
}

/* Emits the whole characters of pending+piece; keeps an unfinished tail.
 * Invalid bytes become U+FFFD. out == NULL: count only, state untouched. */
static int32_t detok_feed(lk_detok *d, const char *piece, int32_t plen, char *out, int32_t cap) {
    unsigned char buf[16];
    int32_t n = 0;
    int np = d->n_pending;
    memcpy(buf, d->pending, (size_t)np);
    int32_t i = 0; /* position in the virtual stream pending ++ piece */
    int32_t total = np + plen;
#define AT(k) ((k) < np ? buf[k] : (unsigned char)piece[(k) - np])
    while (i < total) {
        unsigned char tmp[4];
        int avail = (int)LK_MIN(4, total - i);
        for (int k = 0; k < avail; k++) tmp[k] = AT(i + k);
        bool complete;
        int k = utf8_prefix(tmp, avail, &complete);
        if (k == 0) { put(out, &n, cap, "\xEF\xBF\xBD", 3); i++; continue; }
        if (complete) { put(out, &n, cap, (const char *)tmp, k); i += k; continue; }
        if (i + k == total) break;        /* unfinished at the end: wait */
        put(out, &n, cap, "\xEF\xBF\xBD", 3);  /* cut short by a bad byte */
        i++;
    }
    if (out) {
        int keep = (int)(total - i);
        LK_ASSERT(keep >= 0 && keep < 4);
        char nb[4];
        for (int k = 0; k < keep; k++) nb[k] = (char)AT(i + k);
        memcpy(d->pending, nb, (size_t)keep);
        d->n_pending = keep;
    }
#undef AT
    return n;
}

int32_t lk_detok_push(lk_detok *d, int32_t id, char *out, int32_t cap) {
    const lk_tokenizer *t = d->tok;
    bool first = !d->started;
    d->started = true;
    if (id < 0 || id >= t->n_vocab) return 0;
    if (first && id == t->bos && !d->special) {
        d->at_start = true; /* the next text token starts the text */
        return 0;
    }
    if (!d->special && (t->attr[id] & (ATTR_UNKNOWN | ATTR_CONTROL))) return 0;
    const char *p = t->piece + t->piece_off[id];
    int32_t len = (int32_t)t->piece_len[id];
    if (d->at_start && len) {
        if (t->add_space_prefix && p[0] == ' ') { p++; len--; }
        d->at_start = false;
    }
    int32_t need = detok_feed(d, p, len, NULL, 0);
    if (need > cap) return -need;
    return detok_feed(d, p, len, out, cap);
}

int32_t lk_detok_flush(lk_detok *d, char *out, int32_t cap) {
    int32_t need = 3 * d->n_pending;
    if (need > cap) return -need;
    for (int i = 0; i < d->n_pending; i++) memcpy(out + 3 * i, "\xEF\xBF\xBD", 3);
    d->n_pending = 0;
    return need;
}
