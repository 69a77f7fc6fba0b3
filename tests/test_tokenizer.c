/* Tokenizer tests: token ids must equal llama.cpp's, from its own test
 * vectors (../shared/testdata/vocab/NAME.gguf.inp/.out), the stories260K reference
 * (made with llama_tokenize) and the synth models' JSONs; decoding must give
 * the text back and must stream whole UTF-8 characters only. */
#include "lk_test.h"

#include "gguf/gguf.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"

#include <jansson.h>

static lk_tokenizer *load_tok(const char *path) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(path, &g, err, sizeof err) != LK_OK) {
        printf("  open %s: %s\n", path, err);
        return NULL;
    }
    lk_tokenizer *t = NULL;
    if (lk_tokenizer_load(g, &t, err, sizeof err) != LK_OK) printf("  load %s: %s\n", path, err);
    lk_gguf_close(g); /* the tokenizer must outlive the file */
    return t;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    size_t r = fread(b, 1, (size_t)n, f);
    fclose(f);
    b[r] = 0;
    *len = r;
    return b;
}

static void print_ids(const char *label, const int32_t *v, int32_t n) {
    printf("    %s:", label);
    for (int32_t i = 0; i < n && i < 40; i++) printf(" %d", v[i]);
    printf("%s\n", n > 40 ? " ..." : "");
}

/* encode and compare; prints a diff on mismatch. Returns true if equal. */
static bool check_ids(const lk_tokenizer *t, const char *what, const char *text, size_t len, bool add_special,
                      const int32_t *want, int32_t n_want) {
    int32_t *ids, n;
    char err[LK_ERRLEN];
    if (lk_tokenizer_encode(t, text, len, add_special, false, &ids, &n, err, sizeof err) != LK_OK) {
        printf("  %s: encode failed: %s\n", what, err);
        return false;
    }
    bool ok = n == n_want && (n == 0 || !memcmp(ids, want, (size_t)n * sizeof *ids));
    if (!ok) {
        printf("  %s: mismatch for \"%.*s\"\n", what, (int)LK_MIN(len, 80), text);
        print_ids("want", want, n_want);
        print_ids("got ", ids, n);
    }
    free(ids);
    return ok;
}

static int32_t *json_ids(json_t *arr, int32_t *n) {
    size_t k = json_array_size(arr);
    int32_t *v = malloc((k + 1) * sizeof *v);
    for (size_t i = 0; i < k; i++) v[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    *n = (int32_t)k;
    return v;
}

/* decode(ids) must be text */
static bool check_roundtrip(const lk_tokenizer *t, const char *what, const char *text, size_t len) {
    int32_t *ids, n;
    char err[LK_ERRLEN];
    if (lk_tokenizer_encode(t, text, len, false, false, &ids, &n, err, sizeof err) != LK_OK) return false;
    int32_t need = lk_tokenizer_decode(t, ids, n, false, NULL, 0);
    int32_t cap = need < 0 ? -need : need;
    char *buf = malloc((size_t)cap + 1);
    int32_t got = lk_tokenizer_decode(t, ids, n, false, buf, cap);
    bool ok = got == (int32_t)len && !memcmp(buf, text, len);
    if (!ok) printf("  %s: round trip of \"%.*s\" gave \"%.*s\"\n", what, (int)LK_MIN(len, 60), text,
                    (int)LK_MIN(got, 60), buf);
    free(buf);
    free(ids);
    return ok;
}

/* ---- stories260K: llama.cpp's llama_tokenize on the real model ---- */
TEST(stories260k_reference) {
    lk_tokenizer *t = load_tok(lk_td("models/stories260K.gguf"));
    CHECK(t != NULL);
    if (!t) return;
    json_error_t je;
    json_t *root = json_load_file(lk_td("reference/stories260K.json"), JSON_ALLOW_NUL, &je);
    CHECK(root != NULL);
    if (!root) { lk_tokenizer_free(t); return; }
    CHECK(lk_tokenizer_n_vocab(t) == 512);
    CHECK(lk_tokenizer_bos(t) == 1 && lk_tokenizer_eos(t) == 2 && lk_tokenizer_add_bos(t));
    CHECK(lk_tokenizer_is_eog(t, 2) && !lk_tokenizer_is_eog(t, 1));

    size_t i;
    json_t *c;
    int n_cases = 0;
    json_array_foreach(json_object_get(root, "tokenizer_cases"), i, c) {
        const char *text = json_string_value(json_object_get(c, "text"));
        int32_t n;
        int32_t *want = json_ids(json_object_get(c, "ids_no_bos"), &n);
        CHECK(check_ids(t, "stories260K tokenizer_cases", text, strlen(text), false, want, n));
        CHECK(check_roundtrip(t, "stories260K", text, strlen(text)));
        free(want);
        n_cases++;
    }
    CHECK(n_cases == 8);
    json_array_foreach(json_object_get(root, "cases"), i, c) {
        const char *prompt = json_string_value(json_object_get(c, "prompt"));
        int32_t n;
        int32_t *want = json_ids(json_object_get(c, "prompt_token_ids"), &n);
        CHECK(check_ids(t, "stories260K prompt", prompt, strlen(prompt), true, want, n));
        /* pieces: "<s>" for BOS, a leading space for "▁" */
        json_t *pieces = json_object_get(c, "prompt_token_pieces");
        for (int32_t k = 0; k < n; k++) {
            char buf[64];
            int32_t m = lk_tokenizer_piece(t, want[k], true, buf, sizeof buf);
            const char *p = json_string_value(json_array_get(pieces, (size_t)k));
            CHECKF(m >= 0 && p && (size_t)m == strlen(p) && !memcmp(buf, p, (size_t)m), "piece %d of '%s'", want[k], p);
        }
        /* streaming the prompt from BOS prints the prompt itself */
        lk_detok d;
        lk_detok_init(&d, t);
        char out[1024];
        int32_t len = 0;
        for (int32_t k = 0; k < n; k++) len += lk_detok_push(&d, want[k], out + len, (int32_t)sizeof out - len);
        len += lk_detok_flush(&d, out + len, (int32_t)sizeof out - len);
        CHECKF((size_t)len == strlen(prompt) && !memcmp(out, prompt, (size_t)len), "detok prompt '%.*s'", len, out);
        free(want);
        /* streaming the generated tokens gives llama.cpp's generated_text */
        int32_t ng;
        int32_t *gen = json_ids(json_object_get(c, "generated_token_ids"), &ng);
        const char *gtext = json_string_value(json_object_get(c, "generated_text"));
        lk_detok_init(&d, t);
        len = 0;
        for (int32_t k = 0; k < ng; k++) len += lk_detok_push(&d, gen[k], out + len, (int32_t)sizeof out - len);
        len += lk_detok_flush(&d, out + len, (int32_t)sizeof out - len);
        CHECKF(gtext && (size_t)len == strlen(gtext) && !memcmp(out, gtext, (size_t)len), "generated '%.*s' vs '%s'",
               len, out, gtext);
        free(gen);
    }
    json_decref(root);
    lk_tokenizer_free(t);
}

/* ---- llama.cpp's test-tokenizer-0 vectors, every vocabulary that has them ---- */
static void run_vocab(const char *name, bool roundtrip) {
    char path[256], inp[256], outp[256];
    snprintf(path, sizeof path, "vocab/ggml-vocab-%s.gguf", name);
    snprintf(inp, sizeof inp, "vocab/ggml-vocab-%s.gguf.inp", name);
    snprintf(outp, sizeof outp, "vocab/ggml-vocab-%s.gguf.out", name);
    lk_tokenizer *t = load_tok(lk_td(path));
    CHECKF(t != NULL, "%s", name);
    if (!t) return;
    size_t li, lo;
    char *in = read_file(lk_td(inp), &li), *out = read_file(lk_td(outp), &lo);
    CHECK(in && out);
    if (!in || !out) { free(in); free(out); lk_tokenizer_free(t); return; }
    static const char sep[] = "\n__ggml_vocab_test__\n";
    char *p = in, *o = out;
    int n_tests = 0, n_bad = 0;
    while (*o) {
        char *eol = strchr(o, '\n');
        if (!eol) eol = o + strlen(o);
        char *end = strstr(p, sep);
        size_t tlen = end ? (size_t)(end - p) : strlen(p);
        int32_t want[512], n = 0;
        for (char *q = o; q < eol;) {
            char *e;
            long v = strtol(q, &e, 10);
            if (e == q) break;
            if (n < 512) want[n++] = (int32_t)v;
            q = e;
        }
        char what[96];
        snprintf(what, sizeof what, "%s #%d", name, n_tests);
        if (!check_ids(t, what, p, tlen, false, want, n)) n_bad++;
        if (roundtrip && !check_roundtrip(t, what, p, tlen)) n_bad++;
        n_tests++;
        o = *eol ? eol + 1 : eol;
        if (!end) break;
        p = end + strlen(sep);
    }
    CHECKF(n_tests == 46 && n_bad == 0, "%s: %d tests, %d failed", name, n_tests, n_bad);
    free(in);
    free(out);
    lk_tokenizer_free(t);
}

TEST(vocab_llama_spm) { run_vocab("llama-spm", true); }
TEST(vocab_phi_3) { run_vocab("phi-3", true); }
TEST(vocab_gpt_2) { run_vocab("gpt-2", true); }
TEST(vocab_mpt) { run_vocab("mpt", true); }
TEST(vocab_falcon) { run_vocab("falcon", true); }
TEST(vocab_starcoder) { run_vocab("starcoder", true); }
TEST(vocab_refact) { run_vocab("refact", true); }
TEST(vocab_deepseek_llm) { run_vocab("deepseek-llm", true); }
TEST(vocab_deepseek_coder) { run_vocab("deepseek-coder", true); }
TEST(vocab_bert_bge) { run_vocab("bert-bge", false); }

/* ---- synth models: truncated vocabularies ---- */
/* roundtrip: only where the truncated vocabulary can say it (spm-600 has no
 * lone "▁", so a space before a digit comes out as the bytes of "▁") */
static void run_synth(const char *name, bool has_tokenizer_cases, bool roundtrip) {
    char gpath[256], jpath[256];
    snprintf(gpath, sizeof gpath, "synth/%s.gguf", name);
    snprintf(jpath, sizeof jpath, "synth/%s.json", name);
    lk_tokenizer *t = load_tok(lk_td(gpath));
    CHECKF(t != NULL, "%s", name);
    if (!t) return;
    json_error_t je;
    json_t *root = json_load_file(lk_td(jpath), JSON_ALLOW_NUL, &je);
    CHECKF(root != NULL, "%s", jpath);
    if (!root) { lk_tokenizer_free(t); return; }
    size_t i;
    json_t *c;
    int n_tc = 0;
    json_array_foreach(json_object_get(root, "tokenizer_cases"), i, c) {
        json_t *jt = json_object_get(c, "text");
        int32_t n;
        int32_t *want = json_ids(json_object_get(c, "ids"), &n);
        CHECK(check_ids(t, name, json_string_value(jt), json_string_length(jt), false, want, n));
        if (roundtrip) CHECK(check_roundtrip(t, name, json_string_value(jt), json_string_length(jt)));
        free(want);
        n_tc++;
    }
    CHECKF(!has_tokenizer_cases || n_tc == 46, "%s: %d tokenizer_cases", name, n_tc);
    int n_cases = 0;
    json_array_foreach(json_object_get(root, "cases"), i, c) {
        const char *prompt = json_string_value(json_object_get(c, "prompt"));
        int32_t n;
        int32_t *want = json_ids(json_object_get(c, "prompt_token_ids"), &n);
        CHECK(check_ids(t, name, prompt, strlen(prompt), true, want, n));
        free(want);
        n_cases++;
    }
    CHECKF(n_cases > 0, "%s: no cases", name);
    json_decref(root);
    lk_tokenizer_free(t);
}

TEST(synth_tokenizer_cases) {
    run_synth("synth-llama-f32", true, false);
    run_synth("synth-qwen2-f32", true, true);
    run_synth("synth-qwen3-f32", true, true);
    run_synth("synth-llama3rope-f32", true, true);
}

TEST(synth_prompts_all_models) {
    static const char *names[] = {"synth-llama-bf16", "synth-llama-f16", "synth-llama-q4_0", "synth-llama-q4_k_m",
        "synth-llama-q5_k_m", "synth-llama-q6_k", "synth-llama-q8_0", "synth-llama-tied-f16", "synth-qwen2-q4_k_m",
        "synth-qwen3-q8_0", "synth-qwen3moe-f16", "synth-qwen3moe-q4_k_m"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) run_synth(names[i], false, false);
}

TEST(synth_eog) {
    lk_tokenizer *q = load_tok(lk_td("synth/synth-qwen2-f32.gguf"));
    lk_tokenizer *l = load_tok(lk_td("synth/synth-llama3rope-f32.gguf"));
    CHECK(q && l);
    if (q) {
        CHECK(lk_tokenizer_is_eog(q, 598) && lk_tokenizer_is_eog(q, 600) && !lk_tokenizer_is_eog(q, 599));
        CHECK(!lk_tokenizer_add_bos(q) && lk_tokenizer_eos(q) == 600);
    }
    if (l) {
        CHECK(lk_tokenizer_is_eog(l, 599) && lk_tokenizer_is_eog(l, 600) && !lk_tokenizer_is_eog(l, 598));
        CHECK(lk_tokenizer_add_bos(l) && lk_tokenizer_bos(l) == 598);
    }
    lk_tokenizer_free(q);
    lk_tokenizer_free(l);
}

/* ---- control tokens only from text when asked ---- */
TEST(parse_special_only_when_asked) {
    lk_tokenizer *t = load_tok(lk_td("vocab/ggml-vocab-llama-spm.gguf"));
    lk_tokenizer *q = load_tok(lk_td("synth/synth-qwen2-f32.gguf"));
    CHECK(t && q);
    if (!t || !q) { lk_tokenizer_free(t); lk_tokenizer_free(q); return; }
    const char *s = "<s>hi</s>";
    int32_t *ids, n;
    char err[LK_ERRLEN];
    CHECK(lk_tokenizer_encode(t, s, strlen(s), false, false, &ids, &n, err, sizeof err) == LK_OK);
    bool has = false;
    for (int32_t i = 0; i < n; i++) has |= ids[i] == 1 || ids[i] == 2;
    CHECK(!has);
    free(ids);
    CHECK(lk_tokenizer_encode(t, s, strlen(s), false, true, &ids, &n, err, sizeof err) == LK_OK);
    CHECKF(n >= 3 && ids[0] == 1 && ids[n - 1] == 2, "n=%d", n);
    free(ids);
    const char *im = "<|im_start|>user";
    CHECK(lk_tokenizer_encode(q, im, strlen(im), false, false, &ids, &n, err, sizeof err) == LK_OK);
    has = false;
    for (int32_t i = 0; i < n; i++) has |= ids[i] == 599;
    CHECK(!has);
    free(ids);
    CHECK(lk_tokenizer_encode(q, im, strlen(im), false, true, &ids, &n, err, sizeof err) == LK_OK);
    CHECK(n >= 2 && ids[0] == 599);
    free(ids);
    lk_tokenizer_free(t);
    lk_tokenizer_free(q);
}

/* ---- random UTF-8: round trip and streaming ---- */
static uint64_t rng_state = 0x12345678ABCDEFull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static size_t put_utf8(char *o, uint32_t c) {
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xC0 | (c >> 6)); o[1] = (char)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | (c >> 12)); o[1] = (char)(0x80 | ((c >> 6) & 0x3F)); o[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (c >> 18)); o[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3F)); o[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

static size_t random_utf8(char *buf, size_t max_chars) {
    size_t n = 0, k = 1 + rnd() % max_chars;
    for (size_t i = 0; i < k; i++) {
        uint32_t c, r = rnd() % 10;
        if (r < 4) c = 0x20 + rnd() % 0x5F;                     /* ASCII */
        else if (r < 5) c = " \t\n\r"[rnd() % 4];
        else if (r < 7) c = 0x80 + rnd() % 0x780;               /* 2 bytes */
        else if (r < 9) c = 0x800 + rnd() % 0xF800;             /* 3 bytes */
        else c = 0x10000 + rnd() % 0x100000;                    /* 4 bytes */
        if (c >= 0xD800 && c <= 0xDFFF) c = 'x';
        if (c == '<') c = 'y'; /* keep user-defined / special token names out */
        n += put_utf8(buf + n, c);
    }
    return n;
}

static bool valid_utf8(const char *s, int32_t n) {
    for (int32_t i = 0; i < n;) {
        unsigned c = (unsigned char)s[i];
        int len = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        if (!len || i + len > n) return false;
        for (int k = 1; k < len; k++)
            if (((unsigned char)s[i + k] & 0xC0) != 0x80) return false;
        i += len;
    }
    return true;
}

TEST(random_utf8_roundtrip_and_stream) {
    static const char *files[] = {"vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-gpt-2.gguf",
        "vocab/ggml-vocab-deepseek-llm.gguf", "synth/synth-qwen2-f32.gguf", "synth/synth-llama3rope-f32.gguf",
        "models/stories260K.gguf"};
    char text[1024], out[8192];
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        lk_tokenizer *t = load_tok(lk_td(files[f]));
        CHECK(t != NULL);
        if (!t) continue;
        int bad = 0;
        for (int it = 0; it < 60; it++) {
            size_t len = random_utf8(text, 120);
            if (!check_roundtrip(t, files[f], text, len)) bad++;
            /* streaming the prompt as a model sees it (BOS first where the
             * model adds one): every chunk is whole UTF-8, the concatenation
             * is the text */
            int32_t *ids, n;
            char err[LK_ERRLEN];
            lk_tokenizer_encode(t, text, len, true, false, &ids, &n, err, sizeof err);
            lk_detok d;
            lk_detok_init(&d, t);
            int32_t total = 0;
            for (int32_t k = 0; k < n; k++) {
                int32_t m = lk_detok_push(&d, ids[k], out + total, (int32_t)sizeof out - total);
                if (m < 0 || !valid_utf8(out + total, m)) bad++;
                if (m > 0) total += m;
            }
            total += lk_detok_flush(&d, out + total, (int32_t)sizeof out - total);
            if ((size_t)total != len || memcmp(out, text, len)) bad++;
            free(ids);
        }
        CHECKF(bad == 0, "%s: %d failures", files[f], bad);
        lk_tokenizer_free(t);
    }
}

/* invalid UTF-8 never crashes; streaming stays valid UTF-8 (U+FFFD) */
TEST(invalid_bytes) {
    lk_tokenizer *t = load_tok(lk_td("vocab/ggml-vocab-llama-spm.gguf"));
    lk_tokenizer *b = load_tok(lk_td("vocab/ggml-vocab-gpt-2.gguf"));
    CHECK(t && b);
    if (!t || !b) { lk_tokenizer_free(t); lk_tokenizer_free(b); return; }
    char text[256], out[4096];
    for (int it = 0; it < 50; it++) {
        size_t len = 1 + rnd() % 64;
        for (size_t i = 0; i < len; i++) text[i] = (char)(rnd() & 0xFF);
        lk_tokenizer *tk[2] = {t, b};
        for (int k = 0; k < 2; k++) {
            int32_t *ids, n;
            char err[LK_ERRLEN];
            CHECK(lk_tokenizer_encode(tk[k], text, len, true, false, &ids, &n, err, sizeof err) == LK_OK);
            lk_detok d;
            lk_detok_init(&d, tk[k]);
            int32_t total = 0;
            for (int32_t j = 0; j < n; j++) {
                int32_t m = lk_detok_push(&d, ids[j], out + total, (int32_t)sizeof out - total);
                CHECK(m >= 0);
                if (m > 0) total += m;
            }
            total += lk_detok_flush(&d, out + total, (int32_t)sizeof out - total);
            CHECK(valid_utf8(out, total));
            free(ids);
        }
    }
    /* SPM keeps the raw bytes through byte fallback */
    const char raw[] = "a\xff\xfe" "b\xe2\x82";
    CHECK(check_roundtrip(t, "spm raw bytes", raw, sizeof raw - 1));
    lk_tokenizer_free(t);
    lk_tokenizer_free(b);
}

/* the streaming decoder holds back a character split across tokens */
TEST(detok_split_character) {
    lk_tokenizer *t = load_tok(lk_td("models/stories260K.gguf"));
    CHECK(t != NULL);
    if (!t) return;
    /* "🍰" = F0 9F 8D B0 as four byte tokens (<0xF0> is id 3 + 0xF0) */
    int32_t ids[4] = {3 + 0xF0, 3 + 0x9F, 3 + 0x8D, 3 + 0xB0};
    lk_detok d;
    lk_detok_init(&d, t);
    char out[64];
    CHECK(lk_detok_push(&d, ids[0], out, sizeof out) == 0);
    CHECK(lk_detok_push(&d, ids[1], out, sizeof out) == 0);
    CHECK(lk_detok_push(&d, ids[2], out, sizeof out) == 0);
    CHECK(lk_detok_push(&d, ids[3], out, sizeof out) == 4 && !memcmp(out, "\xF0\x9F\x8D\xB0", 4));
    /* a cut-off character is flushed as U+FFFD */
    CHECK(lk_detok_push(&d, ids[0], out, sizeof out) == 0);
    CHECK(lk_detok_flush(&d, out, sizeof out) == 3 && !memcmp(out, "\xEF\xBF\xBD", 3));
    /* too small a buffer: -needed, nothing consumed */
    int32_t hello = 0;
    for (int32_t id = 0; id < lk_tokenizer_n_vocab(t); id++) {
        char p[32];
        if (lk_tokenizer_piece(t, id, false, p, sizeof p) >= 4) { hello = id; break; }
    }
    CHECK(hello > 0 && lk_detok_push(&d, hello, out, 2) < -2);
    lk_tokenizer_free(t);
}

/* an empty text and a missing tokenizer */
TEST(edges) {
    lk_tokenizer *t = load_tok(lk_td("models/stories260K.gguf"));
    CHECK(t != NULL);
    if (!t) return;
    int32_t *ids, n;
    char err[LK_ERRLEN];
    CHECK(lk_tokenizer_encode(t, "", 0, false, false, &ids, &n, err, sizeof err) == LK_OK && n == 0);
    free(ids);
    CHECK(lk_tokenizer_encode(t, "", 0, true, false, &ids, &n, err, sizeof err) == LK_OK && n == 1 && ids[0] == 1);
    free(ids);
    char p[8];
    CHECK(lk_tokenizer_piece(t, 1, false, p, sizeof p) == 0);
    CHECK(lk_tokenizer_piece(t, 1, true, p, sizeof p) == 3 && !memcmp(p, "<s>", 3));
    CHECK(lk_tokenizer_piece(t, 1, true, p, 2) == -3);
    lk_tokenizer_free(t);
}


/* ---- Unicode facts (ICU) as the pre-tokenisers need them ---- */
TEST(unicode_categories) {
    CHECK(lk_unicode_flags('a') == LK_CPT_LETTER);
    CHECK(lk_unicode_flags('7') == LK_CPT_NUMBER);
    CHECK(lk_unicode_flags(' ') == (LK_CPT_SEPARATOR | LK_CPT_WHITESPACE));
    CHECK(lk_unicode_flags('\n') == (LK_CPT_CONTROL | LK_CPT_WHITESPACE));
    CHECK(lk_unicode_flags('$') == LK_CPT_SYMBOL && lk_unicode_flags('!') == LK_CPT_PUNCT);
    CHECK(lk_unicode_flags(0xE9) == LK_CPT_LETTER);        /* é */
    CHECK(lk_unicode_flags(0x0663) == LK_CPT_NUMBER);      /* Arabic-Indic three */
    CHECK(lk_unicode_flags(0x2167) == LK_CPT_NUMBER);      /* Roman numeral eight (Nl) */
    CHECK(lk_unicode_flags(0x0301) == LK_CPT_MARK);        /* combining acute */
    CHECK(lk_unicode_flags(0x0E01) == LK_CPT_LETTER);      /* Thai ko kai */
    CHECK(lk_unicode_flags(0x3000) == (LK_CPT_SEPARATOR | LK_CPT_WHITESPACE));
    CHECK(lk_unicode_flags(0x0085) & LK_CPT_WHITESPACE);
    CHECK(!(lk_unicode_flags(0x200B) & LK_CPT_WHITESPACE)); /* zero width space is Cf */
    CHECK(lk_unicode_flags(0x1F999) == LK_CPT_SYMBOL);     /* 🦙 */
    CHECK(lk_unicode_flags(0xE000) == LK_CPT_CONTROL);     /* private use */
    CHECK(lk_unicode_flags(0x110000) == LK_CPT_UNDEFINED);
    CHECK(lk_unicode_flags(0x0378) == LK_CPT_UNDEFINED);   /* unassigned */
    CHECK(lk_unicode_tolower('A') == 'a' && lk_unicode_tolower(0xC9) == 0xE9 && lk_unicode_tolower(0x130) == 'i');
    CHECK(lk_unicode_nfd_first(0xE9) == 'e' && lk_unicode_nfd_first(0x1EA5) == 'a' && lk_unicode_nfd_first('x') == 'x');
    CHECK(lk_unicode_nfd_first(0xAC00) == 0x1100); /* Hangul syllable -> leading jamo */
}

/* words as the regexes define them (expected splits worked out by hand) */
static bool split_is(lk_pre_kind k, const char *text, const char *const *want) {
    uint32_t cp[256], lens[256], tmp[256];
    uint16_t fl[256];
    size_t n = lk_utf8_decode(text, strlen(text), cp);
    for (size_t i = 0; i < n; i++) fl[i] = lk_unicode_flags(cp[i]);
    size_t nw = lk_pretok_split(k, cp, fl, n, lens, tmp);
    size_t at = 0, w = 0;
    bool ok = true;
    for (; w < nw; w++) {
        char buf[256];
        size_t bl = 0;
        for (size_t i = at; i < at + lens[w]; i++) bl += (size_t)lk_utf8_encode(cp[i], buf + bl);
        at += lens[w];
        if (!want[w] || strlen(want[w]) != bl || memcmp(want[w], buf, bl)) {
            printf("  split %d of \"%s\": word %zu is \"%.*s\", want \"%s\"\n", (int)k, text, w, (int)bl, buf,
                   want[w] ? want[w] : "(end)");
            ok = false;
            break;
        }
    }
    if (ok && want[w]) { printf("  split of \"%s\": missing \"%s\"\n", text, want[w]); ok = false; }
    return ok;
}

TEST(pretokenizer_splits) {
    const char *g1[] = {"Hello", " world", "'s", " ", " 42", "!!", "\t", "x", NULL};
    CHECK(split_is(LK_PRE_GPT2, "Hello world's  42!!\tx", g1));
    const char *g2[] = {"a", "  ", NULL}; /* trailing white space stays one word */
    CHECK(split_is(LK_PRE_GPT2, "a  ", g2));
    const char *l1[] = {"I", "'M", " fine", ",", "123", "456", "7", "\n\n", "ok", NULL};
    CHECK(split_is(LK_PRE_LLAMA3, "I'M fine,1234567\n\nok", l1));
    const char *q1[] = {"x", "1", "2", "3", "  \n", "ç", NULL}; /* \s*[\r\n]+ takes the spaces too */
    CHECK(split_is(LK_PRE_QWEN2, "x123  \nç", q1));
    const char *d2[] = {"ab", "\n", "漢字", "12", NULL};
    CHECK(split_is(LK_PRE_DEEPSEEK_LLM, "ab\n漢字12", d2));
    const char *s1[] = {"a", "1", "2", " b", NULL}; /* starcoder: every digit alone first */
    CHECK(split_is(LK_PRE_STARCODER, "a12 b", s1));
    const char *f1[] = {"x", "<=>", " y", "123", "4", NULL};
    CHECK(split_is(LK_PRE_FALCON, "x<=> y1234", f1));
}

/* ---- vocabularies without test vectors still load and round-trip ---- */
TEST(other_vocabs_roundtrip) {
    static const char *names[] = {"vocab/ggml-vocab-gpt-neox.gguf", "vocab/ggml-vocab-baichuan.gguf"};
    static const char *texts[] = {"Hello, world! It's 2024.", "  two  spaces\tand\nnewlines\n", "Émilie 🍰 漢字"};
    for (size_t f = 0; f < 2; f++) {
        lk_tokenizer *t = load_tok(lk_td(names[f]));
        CHECKF(t != NULL, "%s", names[f]);
        if (!t) continue;
        for (size_t i = 0; i < 3; i++) CHECK(check_roundtrip(t, names[f], texts[i], strlen(texts[i])));
        lk_tokenizer_free(t);
    }
}

/* ---- the CLI: lockstep tokenize ---- */
TEST(cli_tokenize) {
    const char *exe = getenv("LOCKSTEP");
    if (!exe || !*exe) { printf("  (LOCKSTEP not set: skipped; tests/run.sh sets it)\n"); return; }
    char cmd[1024], out[512] = {0};
    snprintf(cmd, sizeof cmd, "%s tokenize -m %s --ids 'Once upon a time'", exe, lk_td("models/stories260K.gguf"));
    FILE *p = popen(cmd, "r");
    CHECK(p != NULL);
    if (!p) return;
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    CHECK(pclose(p) == 0);
    CHECKF(!strcmp(out, "[1, 403, 407, 261, 378]\n"), "got '%s'", out);
    snprintf(cmd, sizeof cmd, "%s tokenize -m %s --no-bos 'Once'", exe, lk_td("models/stories260K.gguf"));
    p = popen(cmd, "r");
    n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    CHECK(pclose(p) == 0);
    CHECKF(!strcmp(out, "   403 -> ' Once'\n"), "got '%s'", out);
    snprintf(cmd, sizeof cmd, "%s tokenize -m /nonexistent.gguf x 2>/dev/null", exe);
    p = popen(cmd, "r");
    n = fread(out, 1, sizeof out - 1, p);
    CHECK(pclose(p) != 0);
}

int main(void) {
    RUN(stories260k_reference);
    RUN(vocab_llama_spm);
    RUN(vocab_phi_3);
    RUN(vocab_gpt_2);
    RUN(vocab_mpt);
    RUN(vocab_falcon);
    RUN(vocab_starcoder);
    RUN(vocab_refact);
    RUN(vocab_deepseek_llm);
    RUN(vocab_deepseek_coder);
    RUN(vocab_bert_bge);
    RUN(synth_tokenizer_cases);
    RUN(synth_prompts_all_models);
    RUN(synth_eog);
    RUN(parse_special_only_when_asked);
    RUN(random_utf8_roundtrip_and_stream);
    RUN(invalid_bytes);
    RUN(detok_split_character);
    RUN(edges);
    RUN(unicode_categories);
    RUN(pretokenizer_splits);
    RUN(other_vocabs_roundtrip);
    RUN(cli_tokenize);
    return lk_test_end();
}
