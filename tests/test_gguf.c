/* gguf part: the reader against every real file in the test data (shapes,
 * types and metadata checked against llama.cpp's view of them in the synth
 * JSON files), crafted malformed files, the writer (reproducing llama.cpp's
 * files byte for byte, and a round trip of every value type), and the
 * commands built on them: quantize (byte-identical to llama-quantize where
 * it can be, errors within independently checked per-block bounds) and
 * gen-model (shapes, types, value statistics, vocabulary, reproducibility). */
#include "gguf/gguf.h"
#include "quant/quant.h"
#include "lk_test.h"

/* The commands are part of the program, not the library: include them (and
 * the flag parser) to run them in-process, under the sanitizers too. */
#include "../src/cli/args.c"
#include "../src/cli/cmd_gen_model.c"
#include "../src/cli/cmd_quantize.c"

#include <dirent.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <unistd.h>

/* Type names as llama.cpp prints them in the JSON "tensors" lists, mapped to
 * GGML ids from the GGUF spec (not from quant.h, to stay independent). */
static int type_id_of(const char *name) {
    static const struct { const char *n; int id; } tab[] = {
        {"F32", 0}, {"F16", 1}, {"Q4_0", 2}, {"Q4_1", 3}, {"Q5_0", 6}, {"Q5_1", 7}, {"Q8_0", 8},
        {"Q2_K", 10}, {"Q3_K", 11}, {"Q4_K", 12}, {"Q5_K", 13}, {"Q6_K", 14}, {"BF16", 30},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (!strcmp(tab[i].n, name)) return tab[i].id;
    return -1;
}

static lk_gguf *open_ok(const char *path) {
    char err[LK_ERRLEN] = "";
    lk_gguf *g = NULL;
    lk_status st = lk_gguf_open(path, &g, err, sizeof err);
    CHECKF(st == LK_OK && g, "%s: %s", path, err);
    return st == LK_OK ? g : NULL;
}

/* Compares a file with its synth JSON: every tensor (name, type, shape), the
 * tensor count, every scalar metadata value and the omitted arrays' lengths. */
static void check_against_json(const char *gguf_path, const char *json_path) {
    json_error_t je;
    json_t *root = json_load_file(json_path, JSON_ALLOW_NUL, &je);
    CHECKF(root, "%s: %s", json_path, je.text);
    if (!root) return;
    lk_gguf *g = open_ok(gguf_path);
    if (!g) { json_decref(root); return; }
    json_t *model = json_object_get(root, "model");
    json_t *tensors = json_object_get(model, "tensors");
    CHECK(json_is_array(tensors));
    CHECKF((int64_t)json_array_size(tensors) == lk_gguf_n_tensors(g), "%s: %zu vs %" PRId64, gguf_path,
           json_array_size(tensors), lk_gguf_n_tensors(g));
    size_t i;
    json_t *tj;
    json_array_foreach(tensors, i, tj) {
        const char *name = json_string_value(json_array_get(tj, 0));
        const char *type = json_string_value(json_array_get(tj, 1));
        json_t *shape = json_array_get(tj, 2);
        const lk_gguf_tensor *t = lk_gguf_find_tensor(g, name);
        CHECKF(t, "%s: tensor %s missing", gguf_path, name);
        if (!t) continue;
        CHECKF((int)t->type == type_id_of(type), "%s: %s type %u vs %s", gguf_path, name, t->type, type);
        CHECKF(t->n_dims == (int)json_array_size(shape), "%s: %s n_dims", gguf_path, name);
        uint64_t nel = 1;
        for (size_t d = 0; d < json_array_size(shape); d++) {
            uint64_t v = (uint64_t)json_integer_value(json_array_get(shape, d));
            CHECKF(t->ne[d] == v, "%s: %s ne[%zu] %" PRIu64 " vs %" PRIu64, gguf_path, name, d, t->ne[d], v);
            nel *= v;
        }
        CHECK(t->n_elements == nel);
        /* data lies inside the file, aligned */
        uint64_t off = (uint64_t)((const char *)t->data - (const char *)lk_gguf_file_bytes(g));
        CHECK(off == lk_gguf_data_offset(g) + t->offset);
        CHECK(off % lk_gguf_alignment(g) == 0);
        CHECK(off + t->nbytes <= lk_gguf_file_size(g));
    }
    json_t *md = json_object_get(model, "gguf_metadata");
    const char *key;
    json_t *v;
    json_object_foreach(md, key, v) {
        CHECKF(lk_gguf_find_kv(g, key) >= 0, "%s: key %s missing", gguf_path, key);
        if (json_is_string(v)) {
            const char *s = NULL;
            size_t n = 0;
            CHECKF(lk_gguf_get_str(g, key, &s, &n) && n == strlen(json_string_value(v)) &&
                   !memcmp(s, json_string_value(v), n), "%s: %s", gguf_path, key);
        } else if (json_is_boolean(v)) {
            bool b;
            CHECKF(lk_gguf_get_bool(g, key, &b) && b == json_is_true(v), "%s: %s", gguf_path, key);
        } else if (json_is_integer(v)) {
            int64_t x;
            CHECKF(lk_gguf_get_i64(g, key, &x) && x == json_integer_value(v), "%s: %s", gguf_path, key);
        } else if (json_is_real(v)) {
            double x;
            CHECKF(lk_gguf_get_f64(g, key, &x) && fabs(x - json_real_value(v)) <= 1e-6 * fabs(x),
                   "%s: %s", gguf_path, key);
        }
    }
    json_t *arrs = json_object_get(model, "gguf_arrays_omitted_here");
    json_object_foreach(arrs, key, v) {
        uint64_t n = 0;
        CHECKF(lk_gguf_get_arr(g, key, NULL, &n) && n == (uint64_t)json_integer_value(v), "%s: %s", gguf_path, key);
    }
    lk_gguf_close(g);
    json_decref(root);
}

/* The NAMEs of every NAME.gguf in the test data folder rel, at most max
 * (a failed check if the folder cannot be read); returns how many. */
static int gguf_names(const char *rel, char (*names)[256], int max) {
    DIR *d = opendir(lk_td(rel));
    CHECKF(d, "cannot read %s", lk_td(rel));
    int n = 0;
    struct dirent *e;
    while (d && n < max && (e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l < 6 || l - 5 >= sizeof names[0] || strcmp(e->d_name + l - 5, ".gguf")) continue;
        snprintf(names[n++], sizeof names[0], "%.*s", (int)(l - 5), e->d_name);
    }
    if (d) closedir(d);
    return n;
}

TEST(synth_models_match_llama_cpp) {
    static char names[128][256];
    int n = gguf_names("synth", names, 128);
    for (int i = 0; i < n; i++) {
        char gp[1280], jp[1280];
        snprintf(gp, sizeof gp, "%.1000s/%.255s.gguf", lk_td("synth"), names[i]);
        snprintf(jp, sizeof jp, "%.1000s/%.255s.json", lk_td("synth"), names[i]);
        check_against_json(gp, jp);
    }
    CHECKF(n >= 16, "only %d synth models found", n);
}

/* stories260K and llama.cpp's quantisations of it (models/README.md). */
TEST(stories_models) {
    static const struct { const char *f; int qtype; } files[] = {
        {"models/stories260K.gguf", 0}, {"models/stories260K-q8_0.gguf", 8}, {"models/stories260K-q4_0.gguf", 2}};
    for (size_t k = 0; k < 3; k++) {
        lk_gguf *g = open_ok(lk_td(files[k].f));
        if (!g) continue;
        CHECK(lk_gguf_n_tensors(g) == 48);
        int64_t v;
        CHECK(lk_gguf_get_i64(g, "llama.embedding_length", &v) && v == 64);
        CHECK(lk_gguf_get_i64(g, "llama.block_count", &v) && v == 5);
        CHECK(lk_gguf_get_i64(g, "llama.attention.head_count", &v) && v == 8);
        CHECK(lk_gguf_get_i64(g, "llama.attention.head_count_kv", &v) && v == 4);
        CHECK(lk_gguf_get_i64(g, "llama.feed_forward_length", &v) && v == 172);
        uint64_t n;
        lk_gguf_vtype et;
        CHECK(lk_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n) && et == LK_GGUF_STRING && n == 512);
        const lk_gguf_tensor *t = lk_gguf_find_tensor(g, "token_embd.weight");
        CHECK(t && t->n_dims == 2 && t->ne[0] == 64 && t->ne[1] == 512);
        t = lk_gguf_find_tensor(g, "blk.4.ffn_down.weight");
        CHECK(t && t->n_dims == 2 && t->ne[0] == 172 && t->ne[1] == 64);
        /* 172 is not a multiple of 32: llama-quantize keeps such rows F16 */
        CHECK(t && (int)t->type == (files[k].qtype ? 1 : 0));
        t = lk_gguf_find_tensor(g, "blk.0.attn_q.weight");
        CHECK(t && t->ne[0] == 64 && t->ne[1] == 64 && (int)t->type == files[k].qtype);
        t = lk_gguf_find_tensor(g, "output_norm.weight");
        CHECK(t && t->n_dims == 1 && t->ne[0] == 64 && t->type == 0);
        /* first tokens of the llama2.c vocabulary */
        size_t len;
        const char *s = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", 0, &len);
        CHECK(s && len == 5 && !memcmp(s, "<unk>", 5));
        s = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", 3, &len);
        CHECK(s && len == 6 && !memcmp(s, "<0x00>", 6));
        CHECK(lk_gguf_arr_str(g, "tokenizer.ggml.tokens", 512, &len) == NULL);
        lk_gguf_close(g);
    }
}

/* Every vocabulary opens; token/score/type arrays agree in length; and the
 * synth llama vocabulary is (README) the first 600 entries of llama-spm's. */
TEST(vocab_files) {
    static char names[128][256];
    const int nf = gguf_names("vocab", names, 128);
    int n = 0;
    for (int f = 0; f < nf; f++) {
        char p[1280];
        snprintf(p, sizeof p, "%.1000s/%.255s.gguf", lk_td("vocab"), names[f]);
        lk_gguf *g = open_ok(p);
        if (!g) continue;
        n++;
        uint64_t nt = 0, ns = 0;
        lk_gguf_vtype et;
        CHECKF(lk_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &nt) && et == LK_GGUF_STRING && nt > 100, "%s", p);
        if (lk_gguf_get_arr(g, "tokenizer.ggml.token_type", NULL, &ns)) CHECKF(ns == nt, "%s", p);
        for (uint64_t i = 0; i < nt; i += 97) {
            size_t len;
            CHECKF(lk_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &len) != NULL, "%s %" PRIu64, p, i);
        }
        CHECK(lk_gguf_n_tensors(g) == 0);
        lk_gguf_close(g);
    }
    CHECKF(n >= 12, "only %d vocab files", n);

    lk_gguf *a = open_ok(lk_td("vocab/ggml-vocab-llama-spm.gguf"));
    lk_gguf *b = open_ok(lk_td("synth/synth-llama-f32.gguf"));
    if (a && b) {
        uint64_t na = 0;
        CHECK(lk_gguf_get_arr(a, "tokenizer.ggml.tokens", NULL, &na) && na == 32000);
        for (uint64_t i = 0; i < 600; i++) {
            size_t la, lb;
            const char *sa = lk_gguf_arr_str(a, "tokenizer.ggml.tokens", i, &la);
            const char *sb = lk_gguf_arr_str(b, "tokenizer.ggml.tokens", i, &lb);
            CHECKF(sa && sb && la == lb && !memcmp(sa, sb, la), "token %" PRIu64, i);
            CHECK(lk_gguf_arr_f64(a, "tokenizer.ggml.scores", i) == lk_gguf_arr_f64(b, "tokenizer.ggml.scores", i));
            CHECK(lk_gguf_arr_i64(a, "tokenizer.ggml.token_type", i) == lk_gguf_arr_i64(b, "tokenizer.ggml.token_type", i));
        }
        CHECK(lk_gguf_arr_i64(a, "tokenizer.ggml.token_type", 0) == 2); /* <unk>: UNKNOWN */
        CHECK(lk_gguf_arr_i64(a, "tokenizer.ggml.token_type", 1) == 3); /* <s>: CONTROL */
        CHECK(lk_gguf_arr_i64(a, "tokenizer.ggml.token_type", 3) == 6); /* <0x00>: BYTE */
    }
    lk_gguf_close(a);
    lk_gguf_close(b);
}


/* ---- crafted files ----------------------------------------------------------
 * Built byte by byte here (not with the writer), so the reader is checked
 * against the format as the spec states it. */

typedef struct { uint8_t *b; size_t n, cap; } bb;
static void put(bb *x, const void *p, size_t n) {
    if (x->n + n > x->cap) { x->cap = (x->n + n) * 2 + 64; x->b = realloc(x->b, x->cap); }
    memcpy(x->b + x->n, p, n);
    x->n += n;
}
static void p_u32(bb *x, uint32_t v) { put(x, &v, 4); }
static void p_u64(bb *x, uint64_t v) { put(x, &v, 8); }
static void p_str(bb *x, const char *s) { p_u64(x, strlen(s)); put(x, s, strlen(s)); }
static void p_pad(bb *x, size_t a) { while (x->n % a) put(x, "", 1); }
static void patch32(bb *x, size_t off, uint32_t v) { memcpy(x->b + off, &v, 4); }
static void patch64(bb *x, size_t off, uint64_t v) { memcpy(x->b + off, &v, 8); }

/* byte offsets of the fields the malformation tests patch */
typedef struct {
    size_t version, n_tensors, n_kv, key_u32, vtype_u32, align_type, align_val, str_len,
        arr_len, arr_elem, nested_len, name_b, ndims_a, ne0_a, ne1_a, ne0_b, type_b, off_a, off_b;
} fields;

/* A small valid v3 file: 7 key/values (incl. a string array and an array of
 * arrays), tensor "a" F32 [4, 2] and tensor "b" Q8_0 [32], data ending
 * exactly at the end of the file (so any truncation cuts real bytes). */
static bb base_file(fields *f) {
    bb x = {0};
    put(&x, "GGUF", 4);
    f->version = x.n; p_u32(&x, 3);
    f->n_tensors = x.n; p_u64(&x, 2);
    f->n_kv = x.n; p_u64(&x, 7);
    p_str(&x, "general.architecture"); p_u32(&x, LK_GGUF_STRING); p_str(&x, "llama");
    f->key_u32 = x.n; p_str(&x, "test.u32"); f->vtype_u32 = x.n; p_u32(&x, LK_GGUF_UINT32); p_u32(&x, 7);
    p_str(&x, "test.f32"); p_u32(&x, LK_GGUF_FLOAT32); float h = 0.5f; put(&x, &h, 4);
    p_str(&x, "general.alignment"); f->align_type = x.n; p_u32(&x, LK_GGUF_UINT32); f->align_val = x.n; p_u32(&x, 32);
    p_str(&x, "test.str"); p_u32(&x, LK_GGUF_STRING); f->str_len = x.n; p_str(&x, "hello");
    p_str(&x, "test.strs"); p_u32(&x, LK_GGUF_ARRAY); f->arr_elem = x.n; p_u32(&x, LK_GGUF_STRING);
    f->arr_len = x.n; p_u64(&x, 3); p_str(&x, "a"); p_str(&x, "bc"); p_str(&x, "");
    /* [[1, 2], ["x"]] : an array of two arrays of different element types */
    p_str(&x, "test.nested"); p_u32(&x, LK_GGUF_ARRAY); p_u32(&x, LK_GGUF_ARRAY); f->nested_len = x.n; p_u64(&x, 2);
    p_u32(&x, LK_GGUF_INT16); p_u64(&x, 2); int16_t s2[2] = {1, -2}; put(&x, s2, 4);
    p_u32(&x, LK_GGUF_STRING); p_u64(&x, 1); p_str(&x, "x");
    p_str(&x, "a"); f->ndims_a = x.n; p_u32(&x, 2); f->ne0_a = x.n; p_u64(&x, 4); f->ne1_a = x.n; p_u64(&x, 2);
    p_u32(&x, 0); f->off_a = x.n; p_u64(&x, 0);
    f->name_b = x.n + 8; p_str(&x, "b"); p_u32(&x, 1); f->ne0_b = x.n; p_u64(&x, 32);
    f->type_b = x.n; p_u32(&x, 8); f->off_b = x.n; p_u64(&x, 32);
    p_pad(&x, 32);
    for (int i = 0; i < 8; i++) { float v = (float)i; put(&x, &v, 4); }
    uint16_t d = 0x3c00; put(&x, &d, 2); /* Q8_0 block: fp16 scale 1.0, 32 int8 */
    for (int i = 0; i < 32; i++) { int8_t q = (int8_t)(i - 16); put(&x, &q, 1); }
    return x;
}

static const void *pat_zero(void) { static const uint8_t z[4096]; return z; }
static char tmpdir[256];
/* Removes the temp folder and everything the tests wrote into it. */
static void cleanup_tmp(void) {
    if (!tmpdir[0]) return;
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    char p[600];
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name);
            unlink(p);
        }
    if (d) closedir(d);
    rmdir(tmpdir);
}
/* A path in the test's temp folder, in a rotating static buffer (8 live). */
static const char *tmp_path(const char *name) {
    static char bufs[8][512];
    static int k;
    char *p = bufs[k++ & 7];
    if (!tmpdir[0]) {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/lk_gguf_XXXXXX");
        if (!mkdtemp(tmpdir)) { perror("mkdtemp"); exit(1); }
    }
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}
static void write_file(const char *path, const void *b, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp) { perror(path); exit(1); }
    if (n) fwrite(b, 1, n, fp);
    fclose(fp);
}

/* Opens bytes as a file; returns the status and leaves the message in err. */
static lk_status try_open(const void *b, size_t n, char *err, size_t errlen) {
    const char *p = tmp_path("t.gguf");
    write_file(p, b, n);
    lk_gguf *g = NULL;
    err[0] = 0;
    lk_status st = lk_gguf_open(p, &g, err, errlen);
    if (st == LK_OK) CHECK(g != NULL);
    else CHECK(g == NULL);
    lk_gguf_close(g);
    return st;
}

TEST(crafted_valid_file) {
    fields f;
    bb x = base_file(&f);
    const char *p = tmp_path("valid.gguf");
    write_file(p, x.b, x.n);
    char err[LK_ERRLEN] = "";
    lk_gguf *g = NULL;
    CHECKF(lk_gguf_open(p, &g, err, sizeof err) == LK_OK, "%s", err);
    if (g) {
        CHECK(lk_gguf_version(g) == 3 && lk_gguf_n_kv(g) == 7 && lk_gguf_n_tensors(g) == 2);
        CHECK(lk_gguf_file_size(g) == x.n);
        int64_t i;
        uint64_t u;
        double d;
        CHECK(lk_gguf_get_i64(g, "test.u32", &i) && i == 7);
        CHECK(lk_gguf_get_u64(g, "test.u32", &u) && u == 7);
        CHECK(lk_gguf_get_f64(g, "test.u32", &d) && d == 7.0);
        CHECK(lk_gguf_get_f64(g, "test.f32", &d) && d == 0.5);
        CHECK(!lk_gguf_get_i64(g, "test.f32", &i));
        CHECK(!lk_gguf_get_i64(g, "absent", &i));
        const char *s;
        size_t len;
        CHECK(lk_gguf_get_str(g, "test.str", &s, &len) && len == 5 && !memcmp(s, "hello", 5));
        CHECK(!lk_gguf_get_str(g, "test.u32", &s, &len));
        lk_gguf_vtype et;
        uint64_t n;
        CHECK(lk_gguf_get_arr(g, "test.strs", &et, &n) && et == LK_GGUF_STRING && n == 3);
        s = lk_gguf_arr_str(g, "test.strs", 1, &len);
        CHECK(s && len == 2 && !memcmp(s, "bc", 2));
        s = lk_gguf_arr_str(g, "test.strs", 2, &len);
        CHECK(s && len == 0);
        CHECK(lk_gguf_arr_str(g, "test.strs", 3, &len) == NULL);
        CHECK(lk_gguf_get_arr(g, "test.nested", &et, &n) && et == LK_GGUF_ARRAY && n == 2);
        CHECK(lk_gguf_kv_type(g, lk_gguf_find_kv(g, "test.nested")) == LK_GGUF_ARRAY);
        const lk_gguf_tensor *a = lk_gguf_find_tensor(g, "a"), *b = lk_gguf_find_tensor(g, "b");
        CHECK(a && a->n_dims == 2 && a->ne[0] == 4 && a->ne[1] == 2 && a->ne[2] == 1 && a->nbytes == 32);
        CHECK(b && b->n_dims == 1 && b->ne[0] == 32 && b->type == 8 && b->nbytes == 34);
        CHECK(lk_gguf_find_tensor(g, "c") == NULL);
        if (a && b) {
            float v;
            memcpy(&v, (const char *)a->data + 12, 4);
            CHECK(v == 3.0f);
            CHECK(((const int8_t *)b->data)[2] == -16);
            CHECK((const uint8_t *)b->data + 34 == (const uint8_t *)lk_gguf_file_bytes(g) + x.n);
        }
        char buf[256];
        lk_gguf_kv_format(g, lk_gguf_find_kv(g, "test.strs"), buf, sizeof buf);
        CHECKF(strstr(buf, "\"bc\"") && strstr(buf, "3"), "%s", buf);
        lk_gguf_kv_format(g, lk_gguf_find_kv(g, "test.f32"), buf, sizeof buf);
        CHECKF(!strcmp(buf, "0.5"), "%s", buf);
        lk_gguf_kv_format(g, lk_gguf_find_kv(g, "test.str"), buf, 4); /* truncates safely */
        CHECK(strlen(buf) == 3);
        lk_gguf_close(g);
    }
    /* the same file as v2 is equally valid */
    patch32(&x, f.version, 2);
    CHECKF(try_open(x.b, x.n, err, sizeof err) == LK_OK, "%s", err);
    free(x.b);
}

TEST(crafted_truncated_everywhere) {
    fields f;
    bb x = base_file(&f);
    char err[LK_ERRLEN];
    int bad = 0;
    for (size_t n = 0; n < x.n; n++) {
        lk_status st = try_open(x.b, n, err, sizeof err);
        if (st != LK_ERR_FORMAT || !err[0]) {
            if (bad++ < 4) CHECKF(0, "prefix %zu: status %d '%s'", n, st, err);
        }
    }
    CHECK(bad == 0);
    /* a message names the field and the byte where it failed */
    try_open(x.b, f.arr_len + 4, err, sizeof err);
    CHECKF(strstr(err, "array length") && strstr(err, "test.strs") && strstr(err, "byte"), "%s", err);
    free(x.b);
}

typedef struct {
    const char *what;
    size_t (*off)(const fields *);
    int width;           /* 4 or 8 */
    uint64_t value;
    lk_status want;
    const char *words[3]; /* each must appear in the message */
} mutation;

#define OFF(fld) static size_t off_##fld(const fields *f) { return f->fld; }
OFF(version) OFF(n_tensors) OFF(n_kv) OFF(key_u32) OFF(vtype_u32) OFF(align_type) OFF(align_val)
OFF(str_len) OFF(arr_len) OFF(arr_elem) OFF(nested_len) OFF(ndims_a) OFF(ne0_a) OFF(ne1_a) OFF(ne0_b)
OFF(type_b) OFF(off_a) OFF(off_b)
static size_t off_magic(const fields *f) { (void)f; return 0; }

TEST(crafted_malformed) {
    const uint64_t huge = 1ull << 60;
    static const mutation m[] = {
        {"bad magic", off_magic, 4, 0x4c4d4747 /* "GGML" */, LK_ERR_FORMAT, {"magic", "byte 0"}},
        {"version 1", off_version, 4, 1, LK_ERR_UNSUPPORTED, {"version 1"}},
        {"version 99", off_version, 4, 99, LK_ERR_UNSUPPORTED, {"version 99"}},
        {"big-endian", off_version, 4, 0x03000000, LK_ERR_UNSUPPORTED, {"big-endian"}},
        {"n_kv 2^60", off_n_kv, 8, 1ull << 60, LK_ERR_FORMAT, {"n_kv", "byte 16"}},
        {"n_tensors 2^60", off_n_tensors, 8, 1ull << 60, LK_ERR_FORMAT, {"n_tensors", "byte 8"}},
        {"n_kv -1", off_n_kv, 8, UINT64_MAX, LK_ERR_FORMAT, {"n_kv"}},
        {"array length 2^60", off_arr_len, 8, huge, LK_ERR_FORMAT, {"array length", "test.strs"}},
        {"array length just too big", off_arr_len, 8, 60, LK_ERR_FORMAT, {"test.strs"}},
        {"nested array length", off_nested_len, 8, huge, LK_ERR_FORMAT, {"array length", "test.nested"}},
        {"string length 2^60", off_str_len, 8, huge, LK_ERR_FORMAT, {"string value", "past end of file", "test.str"}},
        {"string length -1", off_str_len, 8, UINT64_MAX, LK_ERR_FORMAT, {"past end of file"}},
        {"key length huge", off_key_u32, 8, huge, LK_ERR_FORMAT, {"key", "key/value 1"}},
        {"empty key", off_key_u32, 8, 0, LK_ERR_FORMAT, {"empty key", "key/value 1"}},
        {"value type 13", off_vtype_u32, 4, 13, LK_ERR_FORMAT, {"value type 13", "test.u32"}},
        {"value type 2^31", off_vtype_u32, 4, 0x80000000u, LK_ERR_FORMAT, {"value type"}},
        {"array elem type 77", off_arr_elem, 4, 77, LK_ERR_FORMAT, {"element type 77"}},
        {"alignment type", off_align_type, 4, LK_GGUF_INT32, LK_ERR_FORMAT, {"general.alignment", "u32"}},
        {"alignment 48", off_align_val, 4, 48, LK_ERR_FORMAT, {"general.alignment", "48", "power of two"}},
        {"alignment 0", off_align_val, 4, 0, LK_ERR_FORMAT, {"general.alignment"}},
        {"n_dims 5", off_ndims_a, 4, 5, LK_ERR_FORMAT, {"n_dims 5", "'a'"}},
        {"n_dims 0", off_ndims_a, 4, 0, LK_ERR_FORMAT, {"n_dims 0"}},
        {"zero dim", off_ne1_a, 8, 0, LK_ERR_FORMAT, {"ne[1]", "'a'"}},
        {"dim > int64", off_ne0_a, 8, 1ull << 63, LK_ERR_FORMAT, {"ne[0]"}},
        {"dims overflow", off_ne0_a, 8, 1ull << 62, LK_ERR_FORMAT, {"overflow"}}, /* 2^62 * 2 */
        {"unknown type", off_type_b, 4, 99, LK_ERR_UNSUPPORTED, {"type id 99", "'b'"}},
        {"removed type 4", off_type_b, 4, 4, LK_ERR_UNSUPPORTED, {"type id 4"}},
        {"lockstep's own type 40", off_type_b, 4, 40, LK_ERR_UNSUPPORTED, {"type id 40"}},
        {"row not whole blocks", off_ne0_b, 8, 33, LK_ERR_FORMAT, {"block size", "'b'"}},
        {"misaligned offset", off_off_b, 8, 36, LK_ERR_FORMAT, {"alignment", "'b'", "36"}},
        {"out of file", off_off_b, 8, 64, LK_ERR_FORMAT, {"past end of file", "'b'"}},
        {"offset overflow", off_off_b, 8, UINT64_MAX - 31, LK_ERR_FORMAT, {"past end of file"}},
        {"overlap", off_off_b, 8, 0, LK_ERR_FORMAT, {"overlap", "'a'", "'b'"}},
        {"overlap reversed", off_off_a, 8, 32, LK_ERR_FORMAT, {"overlap"}},
    };
    for (size_t k = 0; k < sizeof m / sizeof m[0]; k++) {
        fields f;
        bb x = base_file(&f);
        size_t o = m[k].off(&f);
        if (m[k].width == 4) patch32(&x, o, (uint32_t)m[k].value);
        else patch64(&x, o, m[k].value);
        char err[LK_ERRLEN];
        long a0 = lk_test_allocs();
        lk_status st = try_open(x.b, x.n, err, sizeof err);
        long na = lk_test_allocs() - a0;
        if (getenv("VERBOSE")) printf("  %-26s -> %s\n", m[k].what, err);
        CHECKF(st == m[k].want, "%s: status %d, want %d: %s", m[k].what, st, m[k].want, err);
        for (int w = 0; w < 3 && m[k].words[w]; w++)
            CHECKF(strstr(err, m[k].words[w]), "%s: '%s' lacks '%s'", m[k].what, err, m[k].words[w]);
        CHECKF(na < 64, "%s: %ld allocations", m[k].what, na);
        free(x.b);
    }
}

/* Random corruption of the valid file (bytes, 64-bit fields, cuts): every
 * result is either a clean error with a message, or a file whose every
 * key/value and tensor can be queried without reading outside it (ASan). */
TEST(crafted_random_corruption) {
    fields f;
    bb base = base_file(&f);
    uint64_t rs = 0x1234567;
    int opened = 0, failed = 0;
    for (int it = 0; it < 1500; it++) {
        bb x = {0};
        put(&x, base.b, base.n);
        int nmut = 1 + (int)(splitmix64(&rs) % 3);
        for (int m = 0; m < nmut; m++) {
            uint64_t r = splitmix64(&rs);
            size_t at = (size_t)(r % x.n);
            switch ((r >> 32) % 4) {
            case 0: x.b[at] = (uint8_t)(r >> 40); break;
            case 1: x.b[at] ^= (uint8_t)(1u << ((r >> 40) % 8)); break;
            case 2: if (at + 8 <= x.n) patch64(&x, at, splitmix64(&rs) >> ((r >> 40) % 64)); break;
            case 3: x.n = at + 1; break;
            }
        }
        const char *p = tmp_path("fuzz.gguf");
        write_file(p, x.b, x.n);
        char err[LK_ERRLEN] = "";
        lk_gguf *g = NULL;
        lk_status st = lk_gguf_open(p, &g, err, sizeof err);
        if (st != LK_OK) {
            failed++;
            CHECKF((st == LK_ERR_FORMAT || st == LK_ERR_UNSUPPORTED) && err[0], "it %d: %d '%s'", it, st, err);
        } else {
            opened++;
            const uint8_t *lo = lk_gguf_file_bytes(g), *hi = lo + lk_gguf_file_size(g);
            for (int64_t i = 0; i < lk_gguf_n_kv(g); i++) {
                char buf[512];
                lk_gguf_kv_format(g, i, buf, sizeof buf);
                const char *k = lk_gguf_kv_key(g, i);
                lk_gguf_vtype et;
                uint64_t n;
                if (lk_gguf_get_arr(g, k, &et, &n) && et == LK_GGUF_STRING)
                    for (uint64_t j = 0; j < n; j++) {
                        size_t len;
                        const char *sp = lk_gguf_arr_str(g, k, j, &len);
                        CHECK(sp && (const uint8_t *)sp >= lo && (const uint8_t *)sp + len <= hi);
                    }
            }
            for (int64_t i = 0; i < lk_gguf_n_tensors(g); i++) {
                const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
                CHECK((const uint8_t *)t->data >= lo && (const uint8_t *)t->data + t->nbytes <= hi);
                CHECK(lk_gguf_find_tensor(g, t->name) == t);
            }
            lk_gguf_close(g);
        }
        free(x.b);
    }
    free(base.b);
    CHECK(opened > 0 && failed > 0);
    if (getenv("VERBOSE")) printf("  corruption: %d opened, %d refused\n", opened, failed);
}

TEST(crafted_duplicates_and_nesting) {
    fields f;
    char err[LK_ERRLEN];
    bb x = base_file(&f);
    x.b[f.name_b] = 'a';
    CHECK(try_open(x.b, x.n, err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "duplicate tensor name 'a'"), "%s", err);
    free(x.b);

    x = base_file(&f);
    x.b[f.key_u32 + 8 + 5] = 'f'; /* test.u32 -> test.f32 */
    CHECK(try_open(x.b, x.n, err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "duplicate key 'test.f32'"), "%s", err);
    free(x.b);

    /* arrays nested 1..12 deep: up to the limit they parse, beyond it a clear error */
    for (int depth = 1; depth <= 12; depth++) {
        bb y = {0};
        put(&y, "GGUF", 4); p_u32(&y, 3); p_u64(&y, 0); p_u64(&y, 1);
        p_str(&y, "deep"); p_u32(&y, LK_GGUF_ARRAY);
        for (int d = 1; d < depth; d++) { p_u32(&y, LK_GGUF_ARRAY); p_u64(&y, 1); }
        p_u32(&y, LK_GGUF_UINT8); p_u64(&y, 3); put(&y, "\1\2\3", 3);
        lk_status st = try_open(y.b, y.n, err, sizeof err);
        if (depth <= 8) CHECKF(st == LK_OK, "depth %d: %s", depth, err);
        else CHECKF(st == LK_ERR_FORMAT && strstr(err, "nested"), "depth %d: %d %s", depth, st, err);
        free(y.b);
    }
    /* a string array claiming the most strings the rest of the file could
     * hold: the index it allocates is bounded by the file's size */
    bb z = {0};
    put(&z, "GGUF", 4); p_u32(&z, 3); p_u64(&z, 0); p_u64(&z, 1);
    p_str(&z, "v"); p_u32(&z, LK_GGUF_ARRAY); p_u32(&z, LK_GGUF_STRING); p_u64(&z, 1000);
    for (int i = 0; i < 999; i++) p_u64(&z, 0);
    p_u64(&z, 1ull << 40); /* element 999: length past the end */
    CHECK(try_open(z.b, z.n, err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "string element 999"), "%s", err);
    free(z.b);
    /* not a file / missing file */
    lk_gguf *g = NULL;
    CHECK(lk_gguf_open(tmp_path("missing.gguf"), &g, err, sizeof err) == LK_ERR_IO && strstr(err, "missing.gguf"));
    CHECK(lk_gguf_open(tmpdir, &g, err, sizeof err) == LK_ERR_IO);
}

/* A file with general.alignment 1 and one tensor of `type` and `ne0`
 * elements whose data lies at file byte data_off + `off`, where `off` is
 * chosen so that the data starts `mis` bytes past a multiple of 8 (0:
 * aligned). Two padding bytes stand before it inside the data section. */
static bb align1_file(uint32_t type, uint64_t ne0, size_t nbytes, unsigned mis) {
    bb x = {0};
    put(&x, "GGUF", 4); p_u32(&x, 3); p_u64(&x, 1); p_u64(&x, 2);
    p_str(&x, "general.architecture"); p_u32(&x, LK_GGUF_STRING); p_str(&x, "llama");
    p_str(&x, "general.alignment"); p_u32(&x, LK_GGUF_UINT32); p_u32(&x, 1);
    p_str(&x, "blk.0.attn_norm.weight"); p_u32(&x, 1); p_u64(&x, ne0); p_u32(&x, type);
    size_t off_at = x.n;
    p_u64(&x, 0);
    size_t data_off = x.n; /* alignment 1: no padding after the tensor infos */
    uint64_t off = 8 + ((mis + 8 - data_off % 8) % 8); /* (data_off + off) % 8 == mis */
    patch64(&x, off_at, off);
    while (x.n < data_off + off) put(&x, "", 1);
    for (size_t i = 0; i < nbytes; i++) put(&x, "\x3f", 1);
    return x;
}

/* general.alignment = 1 is valid GGUF, but an f32 tensor must still start on
 * a 4-byte boundary (norm weights are read as float *; UBSan reported a
 * misaligned load in lk_rmsnorm), f16/bf16 on 2 bytes; block types are read
 * byte-wise and may start anywhere. */
TEST(crafted_misaligned_tensor_data) {
    char err[LK_ERRLEN];
    bb x = align1_file(LK_TYPE_F32, 4, 16, 1);
    CHECK(try_open(x.b, x.n, err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "'blk.0.attn_norm.weight'") && strstr(err, "(f32)") && strstr(err, "not aligned to 4 bytes") &&
           strstr(err, "general.alignment 1") && strstr(err, "data at byte"), "%s", err);
    free(x.b);
    for (unsigned mis = 1; mis < 8; mis++) {
        x = align1_file(LK_TYPE_F32, 4, 16, mis);
        lk_status st = try_open(x.b, x.n, err, sizeof err);
        CHECKF(mis % 4 ? st == LK_ERR_FORMAT : st == LK_OK, "f32 %u past 8: %d %s", mis, st, err);
        free(x.b);
        x = align1_file(LK_TYPE_F16, 4, 8, mis);
        st = try_open(x.b, x.n, err, sizeof err);
        CHECKF(mis % 2 ? st == LK_ERR_FORMAT && strstr(err, "not aligned to 2 bytes") : st == LK_OK,
               "f16 %u past 8: %d %s", mis, st, err);
        free(x.b);
        x = align1_file(LK_TYPE_BF16, 4, 8, mis);
        st = try_open(x.b, x.n, err, sizeof err);
        CHECKF(mis % 2 ? st == LK_ERR_FORMAT : st == LK_OK, "bf16 %u past 8: %d %s", mis, st, err);
        free(x.b);
        x = align1_file(LK_TYPE_Q8_0, 32, 34, mis); /* blocks: any address */
        st = try_open(x.b, x.n, err, sizeof err);
        CHECKF(st == LK_OK, "q8_0 %u past 8: %d %s", mis, st, err);
        free(x.b);
    }
    /* aligned f32 in an alignment-1 file opens, and its data is aligned */
    x = align1_file(LK_TYPE_F32, 4, 16, 4);
    const char *p = tmp_path("align1.gguf");
    write_file(p, x.b, x.n);
    lk_gguf *g = open_ok(p);
    if (g) {
        const lk_gguf_tensor *t = lk_gguf_find_tensor(g, "blk.0.attn_norm.weight");
        CHECK(t && lk_gguf_alignment(g) == 1 && (uintptr_t)t->data % 4 == 0);
        lk_gguf_close(g);
    }
    free(x.b);
}

/* True if s holds a terminal control byte: C0 other than \t and \n, DEL, or
 * a C1 character (U+0080..U+009F in UTF-8). */
static bool has_control(const char *s) {
    for (const uint8_t *p = (const uint8_t *)s; *p; p++)
        if ((*p < 0x20 && *p != '\t' && *p != '\n') || *p == 0x7f || (p[0] == 0xc2 && p[1] >= 0x80 && p[1] < 0xa0))
            return true;
    return false;
}

TEST(sanitize_text_from_files) {
    char out[64];
    static const struct { const char *in, *want; } cases[] = {
        {"plain text", "plain text"},
        {"\x1b[2Jclear", "\\x1b[2Jclear"},
        {"bell\a del\x7f", "bell\\x07 del\\x7f"},
        {"h\xc3\xa9llo \xe2\x96\x81 \xf0\x9f\x98\x80", "h\xc3\xa9llo \xe2\x96\x81 \xf0\x9f\x98\x80"}, /* UTF-8 kept */
        {"csi\xc2\x9b" "2J", "csi\\xc2\\x9b2J"},      /* C1 CSI: escaped */
        {"\xff\xfe bad", "\\xff\\xfe bad"},           /* not UTF-8 */
        {"\xc0\xaf over", "\\xc0\\xaf over"},         /* overlong '/' */
        {"\xed\xa0\x80 sur", "\\xed\\xa0\\x80 sur"},  /* surrogate */
        {"cut \xe2\x96", "cut \\xe2\\x96"},           /* truncated character */
        {"a\\b\nc\td", "a\\\\b\\nc\\td"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n = strlen(cases[i].in);
        CHECK(lk_str_sanitize(out, sizeof out, cases[i].in, n) == n);
        CHECKF(!strcmp(out, cases[i].want), "case %zu: '%s'", i, out);
        CHECK(!has_control(out));
    }
    /* a NUL inside the bytes is escaped, not an end */
    CHECK(lk_str_sanitize(out, sizeof out, "a\0b", 3) == 3 && !strcmp(out, "a\\x00b"));
    /* a small buffer: never half an escape or half a character */
    CHECK(lk_str_sanitize(out, 6, "ab\x1b" "cd", 5) == 2 && !strcmp(out, "ab"));
    CHECK(lk_str_sanitize(out, 7, "ab\x1b" "cd", 5) == 3 && !strcmp(out, "ab\\x1b"));
    CHECK(lk_str_sanitize(out, 4, "a\xe2\x96\x81", 4) == 1 && !strcmp(out, "a"));
    CHECK(lk_str_sanitize(out, 1, "abc", 3) == 0 && !out[0]);

    /* through the reader: a key, a string value, string-array elements and a
     * tensor name with escapes are shown escaped by kv_format and in errors */
    bb x = {0};
    put(&x, "GGUF", 4); p_u32(&x, 3); p_u64(&x, 2); p_u64(&x, 3);
    p_str(&x, "general.name"); p_u32(&x, LK_GGUF_STRING); p_str(&x, "\x1b]0;title\a\x1b[2J\"q\" \xc2\x9b" "31m");
    p_str(&x, "k\x1b[31m"); p_u32(&x, LK_GGUF_UINT32); p_u32(&x, 1);
    p_str(&x, "tokenizer.ggml.tokens"); p_u32(&x, LK_GGUF_ARRAY); p_u32(&x, LK_GGUF_STRING); p_u64(&x, 2);
    p_str(&x, "\x1b[2J"); p_str(&x, "\xe2\x96\x81ok");
    p_str(&x, "t\x1b[2J"); p_u32(&x, 1); p_u64(&x, 4); p_u32(&x, 0); p_u64(&x, 0);
    p_str(&x, "t\x1b[2J"); p_u32(&x, 1); p_u64(&x, 4); p_u32(&x, 0); p_u64(&x, 32);
    p_pad(&x, 32);
    for (int i = 0; i < 16; i++) p_u32(&x, 0);
    char err[LK_ERRLEN];
    CHECK(try_open(x.b, x.n, err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "duplicate tensor name 't\\x1b[2J'") && !has_control(err), "%s", err);
    free(x.b);
    x = (bb){0};
    put(&x, "GGUF", 4); p_u32(&x, 3); p_u64(&x, 0); p_u64(&x, 3);
    p_str(&x, "general.name"); p_u32(&x, LK_GGUF_STRING); p_str(&x, "\x1b]0;title\a\x1b[2J\"q\" \xc2\x9b" "31m");
    p_str(&x, "k\x1b[31m"); p_u32(&x, LK_GGUF_UINT32); p_u32(&x, 1);
    p_str(&x, "tokenizer.ggml.tokens"); p_u32(&x, LK_GGUF_ARRAY); p_u32(&x, LK_GGUF_STRING); p_u64(&x, 2);
    p_str(&x, "\x1b[2J"); p_str(&x, "\xe2\x96\x81ok");
    const char *p = tmp_path("esc.gguf");
    write_file(p, x.b, x.n);
    lk_gguf *g = open_ok(p);
    if (g) {
        char buf[400];
        lk_gguf_kv_format(g, 0, buf, sizeof buf);
        CHECKF(!strcmp(buf, "\"\\x1b]0;title\\x07\\x1b[2J\\\"q\\\" \\xc2\\x9b31m\""), "%s", buf);
        lk_gguf_kv_format(g, 2, buf, sizeof buf);
        CHECKF(!strcmp(buf, "[string x 2] \"\\x1b[2J\", \"\xe2\x96\x81ok\""), "%s", buf);
        for (size_t len = 1; len < 40; len++) { /* cut anywhere: still no control byte, still terminated */
            lk_gguf_kv_format(g, 0, buf, len);
            CHECKF(strlen(buf) < len && !has_control(buf), "%zu: %s", len, buf);
        }
        lk_gguf_close(g);
    }
    /* a duplicate key with escapes is named escaped */
    patch64(&x, 16, 4);
    p_str(&x, "k\x1b[31m"); p_u32(&x, LK_GGUF_UINT32); p_u32(&x, 2);
    CHECK(try_open(x.b, x.n, err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "duplicate key 'k\\x1b[31m'") && !has_control(err), "%s", err);
    free(x.b);
}

/* ---- writer ------------------------------------------------------------------ */

/* Copying every key/value and tensor of a file written by llama.cpp's tools
 * (gguf-py, llama-quantize) reproduces it byte for byte: same header, same
 * offsets, same padding. */
TEST(writer_reproduces_llama_cpp_files) {
    static const char *files[] = {"models/stories260K.gguf", "models/stories260K-q8_0.gguf",
                                  "models/stories260K-q4_0.gguf", "synth/synth-qwen3-q8_0.gguf",
                                  "vocab/ggml-vocab-llama-spm.gguf"};
    for (size_t k = 0; k < sizeof files / sizeof files[0]; k++) {
        lk_gguf *g = open_ok(lk_td(files[k]));
        if (!g) continue;
        char err[LK_ERRLEN] = "";
        const char *out = tmp_path("copy.gguf");
        lk_gguf_writer *w = NULL;
        CHECKF(lk_gguf_writer_open(out, &w, err, sizeof err) == LK_OK, "%s", err);
        if (!w) { lk_gguf_close(g); continue; }
        for (int64_t i = 0; i < lk_gguf_n_kv(g); i++) lk_gguf_writer_copy_kv(w, g, i);
        for (int64_t i = 0; i < lk_gguf_n_tensors(g); i++) {
            const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
            lk_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne);
        }
        lk_status st = LK_OK;
        if (lk_gguf_n_tensors(g)) st = lk_gguf_writer_begin_data(w, err, sizeof err);
        for (int64_t i = 0; i < lk_gguf_n_tensors(g) && !st; i++) {
            const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
            /* in uneven pieces, to exercise partial writes */
            for (uint64_t o = 0; o < t->nbytes && !st; o += 1000)
                st = lk_gguf_writer_write(w, (const char *)t->data + o, (size_t)LK_MIN(1000, t->nbytes - o), err, sizeof err);
        }
        CHECKF(st == LK_OK, "%s", err);
        CHECKF(lk_gguf_writer_close(w, err, sizeof err) == LK_OK, "%s", err);
        FILE *fp = fopen(out, "rb");
        CHECK(fp);
        uint64_t size = lk_gguf_file_size(g), same = 0;
        if (fp) {
            uint8_t *b = malloc(size + 1);
            size_t n = fread(b, 1, size + 1, fp);
            fclose(fp);
            /* llama.cpp pads after the last tensor; vocab files (no tensors) end unpadded */
            CHECKF(n == size, "%s: %zu bytes vs %" PRIu64, files[k], n, size);
            const uint8_t *a = lk_gguf_file_bytes(g);
            while (same < LK_MIN(n, size) && a[same] == b[same]) same++;
            CHECKF(same == size, "%s: first difference at byte %" PRIu64, files[k], same);
            free(b);
        }
        lk_gguf_close(g);
    }
}

/* Every value type and tensor type written, read back and compared. */
TEST(writer_round_trip) {
    fields f;
    bb x = base_file(&f); /* source of u16/i16/nested values for copy_kv */
    const char *src = tmp_path("src.gguf");
    write_file(src, x.b, x.n);
    free(x.b);
    lk_gguf *s = open_ok(src);
    if (!s) return;
    char err[LK_ERRLEN] = "";
    const char *out = tmp_path("rt.gguf");
    lk_gguf_writer *w = NULL;
    CHECK(lk_gguf_writer_open(out, &w, err, sizeof err) == LK_OK);
    if (!w) { lk_gguf_close(s); return; }
    lk_gguf_writer_set_u32(w, "k.u32", 4000000000u);
    lk_gguf_writer_set_i32(w, "k.i32", -7);
    lk_gguf_writer_set_u64(w, "k.u64", 1ull << 63);
    lk_gguf_writer_set_f32(w, "k.f32", 1e-6f);
    lk_gguf_writer_set_bool(w, "k.bool", true);
    lk_gguf_writer_set_str(w, "k.str", "h\xc3\xa9llo");
    lk_gguf_writer_set_str(w, "k.empty", "");
    const char *strs[] = {"<unk>", "", "\xe2\x96\x81the"};
    lk_gguf_writer_set_arr_str(w, "k.strs", strs, 3);
    float fv[3] = {0.5f, -2.0f, 1e30f};
    lk_gguf_writer_set_arr_f32(w, "k.f32s", fv, 3);
    int32_t iv[4] = {1, -1, INT32_MAX, INT32_MIN};
    lk_gguf_writer_set_arr_i32(w, "k.i32s", iv, 4);
    lk_gguf_writer_set_arr_i32(w, "k.none", NULL, 0);
    lk_gguf_writer_copy_kv(w, s, lk_gguf_find_kv(s, "test.nested"));
    lk_gguf_writer_copy_kv(w, s, lk_gguf_find_kv(s, "test.strs"));
    lk_gguf_writer_set_u32(w, "k.i32", 9); /* a key set again moves to the end with its new value */
    lk_gguf_writer_set_u32(w, "general.alignment", 64);
    static const struct { const char *n; uint32_t type; int nd; uint64_t ne[4]; } ts[] = {
        {"t.f32", 0, 1, {5}}, {"t.f16", 1, 2, {3, 7}}, {"t.q8", 8, 3, {64, 2, 3}}, {"t.q4", 2, 4, {32, 1, 2, 2}}, {"t.bf16", 30, 1, {1}}};
    enum { NT = sizeof ts / sizeof ts[0] };
    uint64_t sizes[NT] = {5 * 4, 21 * 2, 12 * 34 /* 2 blocks x 6 rows */, 4 * 18, 2};
    for (int i = 0; i < NT; i++) lk_gguf_writer_add_tensor(w, ts[i].n, ts[i].type, ts[i].nd, ts[i].ne);
    CHECK(lk_gguf_writer_begin_data(w, err, sizeof err) == LK_OK);
    /* all tensor bytes as one pattern, written in pieces that straddle tensors */
    uint64_t total = 0;
    for (int i = 0; i < NT; i++) total += sizes[i];
    uint8_t *pat = malloc(total);
    for (uint64_t i = 0; i < total; i++) pat[i] = (uint8_t)(i * 131 + 7);
    for (uint64_t o = 0; o < total; o += 77)
        CHECK(lk_gguf_writer_write(w, pat + o, (size_t)LK_MIN(77, total - o), err, sizeof err) == LK_OK);
    CHECKF(lk_gguf_writer_close(w, err, sizeof err) == LK_OK, "%s", err);

    lk_gguf *g = open_ok(out);
    if (g) {
        CHECK(lk_gguf_version(g) == 3 && lk_gguf_alignment(g) == 64);
        CHECK(lk_gguf_n_kv(g) == 14);
        CHECK(!strcmp(lk_gguf_kv_key(g, 1), "k.u64"));
        CHECK(!strcmp(lk_gguf_kv_key(g, 12), "k.i32") && lk_gguf_kv_type(g, 12) == LK_GGUF_UINT32);
        int64_t i64;
        uint64_t u64;
        double d;
        bool b;
        const char *str;
        size_t len;
        CHECK(lk_gguf_get_u64(g, "k.u32", &u64) && u64 == 4000000000u);
        CHECK(lk_gguf_get_i64(g, "k.i32", &i64) && i64 == 9);
        CHECK(lk_gguf_get_u64(g, "k.u64", &u64) && u64 == 1ull << 63);
        CHECK(!lk_gguf_get_i64(g, "k.u64", &i64)); /* does not fit */
        CHECK(lk_gguf_get_f64(g, "k.f32", &d) && (float)d == 1e-6f);
        CHECK(lk_gguf_get_bool(g, "k.bool", &b) && b);
        CHECK(lk_gguf_get_str(g, "k.str", &str, &len) && len == 6 && !memcmp(str, "h\xc3\xa9llo", 6));
        CHECK(lk_gguf_get_str(g, "k.empty", &str, &len) && len == 0);
        lk_gguf_vtype et;
        uint64_t n;
        CHECK(lk_gguf_get_arr(g, "k.strs", &et, &n) && et == LK_GGUF_STRING && n == 3);
        for (int i = 0; i < 3; i++) {
            str = lk_gguf_arr_str(g, "k.strs", (uint64_t)i, &len);
            CHECK(str && len == strlen(strs[i]) && !memcmp(str, strs[i], len));
        }
        CHECK(lk_gguf_get_arr(g, "k.f32s", &et, &n) && et == LK_GGUF_FLOAT32 && n == 3);
        for (int i = 0; i < 3; i++) CHECK((float)lk_gguf_arr_f64(g, "k.f32s", (uint64_t)i) == fv[i]);
        CHECK(lk_gguf_get_arr(g, "k.i32s", &et, &n) && et == LK_GGUF_INT32 && n == 4);
        for (int i = 0; i < 4; i++) CHECK(lk_gguf_arr_i64(g, "k.i32s", (uint64_t)i) == iv[i]);
        CHECK(lk_gguf_get_arr(g, "k.none", &et, &n) && n == 0);
        CHECK(lk_gguf_get_arr(g, "test.nested", &et, &n) && et == LK_GGUF_ARRAY && n == 2);
        str = lk_gguf_arr_str(g, "test.strs", 1, &len);
        CHECK(str && len == 2 && !memcmp(str, "bc", 2));
        CHECK(lk_gguf_n_tensors(g) == NT);
        uint64_t o = 0;
        for (int i = 0; i < NT; i++) {
            const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
            CHECK(!strcmp(t->name, ts[i].n) && t->type == ts[i].type && t->n_dims == ts[i].nd);
            for (int dd = 0; dd < ts[i].nd; dd++) CHECK(t->ne[dd] == ts[i].ne[dd]);
            CHECKF(t->nbytes == sizes[i], "%s %" PRIu64, t->name, t->nbytes);
            CHECK(t->offset % 64 == 0);
            CHECK(!memcmp(t->data, pat + o, sizes[i]));
            o += sizes[i];
        }
        /* padded after the last tensor too, as ggml does */
        const lk_gguf_tensor *last = lk_gguf_tensor_at(g, NT - 1);
        CHECK(lk_gguf_file_size(g) == lk_gguf_data_offset(g) + last->offset + 64);
        lk_gguf_close(g);
    }
    free(pat);
    lk_gguf_close(s);

    /* too few bytes: close fails and leaves no file behind */
    CHECK(lk_gguf_writer_open(out, &w, err, sizeof err) == LK_OK);
    uint64_t ne[1] = {32};
    lk_gguf_writer_add_tensor(w, "x", 0, 1, ne);
    CHECK(lk_gguf_writer_begin_data(w, err, sizeof err) == LK_OK);
    CHECK(lk_gguf_writer_write(w, pat_zero(), 100, err, sizeof err) == LK_OK);
    CHECK(lk_gguf_writer_close(w, err, sizeof err) == LK_ERR_ARG);
    CHECKF(strstr(err, "'x'") && strstr(err, "100 of its 128"), "%s", err);
    CHECK(access(out, F_OK) != 0);
    /* unwritable path */
    CHECK(lk_gguf_writer_open("/nonexistent-dir/x.gguf", &w, err, sizeof err) == LK_ERR_IO);
}

/* ---- commands: quantize, gen-model --------------------------------------------- */

static int run_cmd(int (*fn)(int, char **), const char *args) {
    char buf[2048], *argv[32];
    int argc = 0;
    snprintf(buf, sizeof buf, "%s", args);
    for (char *t = strtok(buf, " "); t && argc < 32; t = strtok(NULL, " ")) argv[argc++] = t;
    return fn(argc, argv);
}

static bool same_file_bytes(const char *a, const char *b, uint64_t *first_diff) {
    FILE *x = fopen(a, "rb"), *y = fopen(b, "rb");
    bool same = x && y;
    uint64_t off = 0;
    while (same) {
        int c = fgetc(x), d = fgetc(y);
        if (c != d) same = false;
        else if (c == EOF) break;
        else off++;
    }
    if (x) fclose(x);
    if (y) fclose(y);
    if (first_diff) *first_diff = off;
    return same;
}

/* Dequantises one row independently of quant/ (the block layouts of the GGUF
 * spec) and checks every element against the F32 source:
 *   q8_0: d = amax/127 (stored fp16), |x - q d| <= d/2 plus the fp16 rounding of d
 *         acting on |q| <= 127;
 *   q4_0: d = -max/8 (max the signed element of largest magnitude), elements
 *         within |d|/2 except the top end, which clamps to 7d (error <= |d|);
 *   f16:  relative 2^-11.
 * Returns the number of elements out of bounds. */
static int64_t check_row(uint32_t type, const void *q, const float *x, int64_t n, double *max_rel_err) {
    const uint8_t *b = q;
    int64_t bad = 0;
    if (type == 1) {
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, b + 2 * i, 2);
            float v = lk_fp16_to_fp32(h);
            if (fabsf(v - x[i]) > fabsf(x[i]) * (1.0f / 2048) + 6e-8f) bad++;
        }
        return bad;
    }
    int bytes = type == 8 ? 34 : 18;
    for (int64_t blk = 0; blk < n / 32; blk++, b += bytes, x += 32) {
        uint16_t h;
        memcpy(&h, b, 2);
        float d = lk_fp16_to_fp32(h), amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
        float expect_d = type == 8 ? amax / 127 : max / -8;
        if (fabsf(d - expect_d) > fabsf(expect_d) * (1.0f / 1024) + 1e-12f) bad++;
        for (int j = 0; j < 32; j++) {
            float v, tol;
            if (type == 8) {
                v = d * (float)(int8_t)b[2 + j];
                tol = fabsf(d) * (0.5f + 127.0f / 1024);
            } else {
                int qv = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
                v = d * (float)(qv - 8);
                tol = fabsf(d) * (qv == 15 ? 1.0f + 8.0f / 1024 : 0.5f + 8.0f / 1024);
            }
            float e = fabsf(v - x[j]);
            if (e > tol + 1e-9f) bad++;
            if (amax > 0 && e / amax > *max_rel_err) *max_rel_err = e / amax;
        }
    }
    return bad;
}

/* Every tensor of `out` against the F32 tensor of the same name in `src`. */
static void check_quantized_against(const char *out, const char *src, const char *what) {
    lk_gguf *q = open_ok(out), *f = open_ok(src);
    if (!q || !f) { lk_gguf_close(q); lk_gguf_close(f); return; }
    CHECK(lk_gguf_n_tensors(q) == lk_gguf_n_tensors(f));
    double rel8 = 0, rel4 = 0;
    for (int64_t i = 0; i < lk_gguf_n_tensors(q); i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(q, i), *s = lk_gguf_find_tensor(f, t->name);
        CHECK(s && s->type == 0 && s->n_elements == t->n_elements);
        if (!s || s->type != 0) continue;
        if (t->type == 0) { CHECK(!memcmp(t->data, s->data, s->nbytes)); continue; }
        CHECKF(t->type == 1 || t->type == 2 || t->type == 8, "%s: %s type %u", what, t->name, t->type);
        size_t rb;
        lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb);
        int64_t bad = 0;
        for (uint64_t r = 0; r < t->n_elements / t->ne[0]; r++)
            bad += check_row(t->type, (const uint8_t *)t->data + r * rb, (const float *)s->data + r * t->ne[0],
                             (int64_t)t->ne[0], t->type == 8 ? &rel8 : &rel4);
        CHECKF(bad == 0, "%s: %s: %" PRId64 " elements beyond the quantisation error", what, t->name, bad);
    }
    /* and the errors are of the expected size, not trivially small */
    if (getenv("VERBOSE")) printf("  %s: max error / block amax: q8_0 %.4f q4_0 %.4f\n", what, rel8, rel4);
    lk_gguf_close(q);
    lk_gguf_close(f);
}

TEST(quantize_matches_llama_quantize) {
    static const char *types[] = {"q8_0", "q4_0"};
    for (int k = 0; k < 2; k++) {
        char args[1024], ref[600];
        const char *out = tmp_path(k ? "s-q4.gguf" : "s-q8.gguf");
        snprintf(args, sizeof args, "%s %s --type %s -q -t 3", lk_td("models/stories260K.gguf"), out, types[k]);
        CHECK(run_cmd(lk_cmd_quantize, args) == 0);
        snprintf(ref, sizeof ref, "models/stories260K-%s.gguf", types[k]);
        uint64_t off = 0;
        CHECKF(same_file_bytes(out, lk_td(ref), &off), "%s differs from llama-quantize's at byte %" PRIu64, types[k], off);
        check_quantized_against(out, lk_td("models/stories260K.gguf"), types[k]);
    }
    /* synth-llama: q8_0 identical; q4_0 identical except output.weight, which
     * llama.cpp makes Q6_K and lockstep Q8_0 (checked within bounds above) */
    const char *out = tmp_path("l-q8.gguf");
    char args[1024];
    snprintf(args, sizeof args, "%s %s --type q8_0 -q", lk_td("synth/synth-llama-f32.gguf"), out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 0);
    CHECK(same_file_bytes(out, lk_td("synth/synth-llama-q8_0.gguf"), NULL));
    snprintf(args, sizeof args, "%s %s --type q8_0 -q", lk_td("synth/synth-qwen3-f32.gguf"), out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 0);
    CHECK(same_file_bytes(out, lk_td("synth/synth-qwen3-q8_0.gguf"), NULL));
    snprintf(args, sizeof args, "%s %s --type q4_0 -q", lk_td("synth/synth-llama-f32.gguf"), out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 0);
    lk_gguf *a = open_ok(out), *b = open_ok(lk_td("synth/synth-llama-q4_0.gguf"));
    if (a && b) {
        CHECK(lk_gguf_n_tensors(a) == lk_gguf_n_tensors(b) && lk_gguf_n_kv(a) == lk_gguf_n_kv(b));
        for (int64_t i = 0; i < lk_gguf_n_tensors(a); i++) {
            const lk_gguf_tensor *x = lk_gguf_tensor_at(a, i), *y = lk_gguf_tensor_at(b, i);
            CHECK(!strcmp(x->name, y->name));
            if (!strcmp(x->name, "output.weight")) { CHECK(x->type == 8 && y->type == 14); continue; }
            CHECKF(x->type == y->type && x->nbytes == y->nbytes && !memcmp(x->data, y->data, x->nbytes), "%s", x->name);
        }
        for (int64_t i = 0; i < lk_gguf_n_kv(a); i++) CHECK(!strcmp(lk_gguf_kv_key(a, i), lk_gguf_kv_key(b, i)));
    }
    lk_gguf_close(a);
    lk_gguf_close(b);
    check_quantized_against(out, lk_td("synth/synth-llama-f32.gguf"), "synth q4_0");
    /* quantising an already quantised file: converted from its dequantised values */
    const char *out2 = tmp_path("l-q4-from-q8.gguf");
    snprintf(args, sizeof args, "%s %s --type q4_0 -q", lk_td("synth/synth-llama-q8_0.gguf"), out2);
    CHECK(run_cmd(lk_cmd_quantize, args) == 0);
    lk_gguf *c = open_ok(out2);
    if (c) {
        const lk_gguf_tensor *t = lk_gguf_find_tensor(c, "blk.0.ffn_up.weight");
        CHECK(t && t->type == 2);
        int64_t ft;
        CHECK(lk_gguf_get_i64(c, "general.file_type", &ft) && ft == 2);
    }
    lk_gguf_close(c);
}

TEST(quantize_errors) {
    char args[1024];
    const char *out = tmp_path("bad.gguf");
    snprintf(args, sizeof args, "%s %s --type q4_1", lk_td("models/stories260K.gguf"), out); /* a type quantize does not write */
    CHECK(run_cmd(lk_cmd_quantize, args) == 2);
    snprintf(args, sizeof args, "%s %s", lk_td("models/stories260K.gguf"), out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 2); /* no --type */
    snprintf(args, sizeof args, "%s --type q8_0", lk_td("models/stories260K.gguf"));
    CHECK(run_cmd(lk_cmd_quantize, args) == 2); /* no output */
    snprintf(args, sizeof args, "%s %s --type q8_0 --bogus", lk_td("models/stories260K.gguf"), out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 2);
    snprintf(args, sizeof args, "%s %s --type q8_0 -t x", lk_td("models/stories260K.gguf"), out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 2);
    /* in place is refused */
    const char *copy = tmp_path("inplace.gguf");
    CHECK(run_cmd(lk_cmd_quantize, "-q") == 2);
    snprintf(args, sizeof args, "%s %s --type q8_0 -q", lk_td("models/stories260K.gguf"), copy);
    CHECK(run_cmd(lk_cmd_quantize, args) == 0);
    snprintf(args, sizeof args, "%s %s --type q4_0 -q", copy, copy);
    CHECK(run_cmd(lk_cmd_quantize, args) == 2);
    /* a malformed input: runtime failure, no output left behind */
    fields f;
    bb x = base_file(&f);
    patch32(&x, f.type_b, 99);
    const char *bad = tmp_path("badin.gguf");
    write_file(bad, x.b, x.n);
    free(x.b);
    unlink(out);
    snprintf(args, sizeof args, "%s %s --type q8_0 -q", bad, out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 1);
    CHECK(access(out, F_OK) != 0);
    snprintf(args, sizeof args, "/nonexistent.gguf %s --type q8_0 -q", out);
    CHECK(run_cmd(lk_cmd_quantize, args) == 1);
}

/* Mean and standard deviation of a tensor's values, dequantised independently. */
static void tensor_stats(const lk_gguf_tensor *t, double *mean, double *sd) {
    double s = 0, s2 = 0;
    uint64_t n = t->n_elements;
    size_t rb;
    lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb);
    for (uint64_t r = 0; r < n / t->ne[0]; r++) {
        const uint8_t *b = (const uint8_t *)t->data + r * rb;
        for (uint64_t i = 0; i < t->ne[0]; i++) {
            float v;
            if (t->type == 0) memcpy(&v, b + 4 * i, 4);
            else if (t->type == 1) { uint16_t h; memcpy(&h, b + 2 * i, 2); v = lk_fp16_to_fp32(h); }
            else if (t->type == 30) { uint16_t h; memcpy(&h, b + 2 * i, 2); v = lk_bf16_to_fp32(h); }
            else {
                const uint8_t *blk = b + (i / 32) * (t->type == 8 ? 34 : 18);
                uint16_t h;
                memcpy(&h, blk, 2);
                float d = lk_fp16_to_fp32(h);
                int j = (int)(i % 32);
                if (t->type == 8) v = d * (float)(int8_t)blk[2 + j];
                else v = d * (float)((j < 16 ? (blk[2 + j] & 15) : (blk[2 + j - 16] >> 4)) - 8);
            }
            s += v;
            s2 += (double)v * v;
        }
    }
    *mean = s / (double)n;
    *sd = sqrt(s2 / (double)n - *mean * *mean);
}

/* BF16 (the type Zen 5's AVX512_BF16 multiplies natively): every 2-D
 * weight is the F32 file's value of the same seed rounded to BF16, as
 * ggml's fp32 -> bf16 conversion does (nearest, ties to even). */
TEST(gen_model_bf16_is_f32_rounded) {
    char args[1024];
    const char *f32p = tmp_path("tiny-f32.gguf");
    snprintf(args, sizeof args, "--shape tiny --type f32 -o %s --seed 9 -q", f32p);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
    const char *bfp = tmp_path("tiny-bf16.gguf");
    snprintf(args, sizeof args, "--shape tiny --type bf16 -o %s --seed 9 -q", bfp);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
    lk_gguf *gf = open_ok(f32p), *gb = open_ok(bfp);
    if (!gf || !gb) { if (gf) lk_gguf_close(gf); if (gb) lk_gguf_close(gb); return; }
    int n2d = 0, bad = 0;
    for (int64_t i = 0; i < lk_gguf_n_tensors(gb); i++) {
        const lk_gguf_tensor *tb = lk_gguf_tensor_at(gb, i), *tf = lk_gguf_find_tensor(gf, tb->name);
        CHECKF(tf && tf->n_elements == tb->n_elements, "%s", tb->name);
        if (!tf || tb->n_dims != 2) continue;
        CHECKF(tb->type == LK_TYPE_BF16, "%s is type %u", tb->name, (unsigned)tb->type);
        n2d++;
        for (uint64_t e = 0; e < tb->n_elements; e++) {
            float v;
            uint16_t h;
            memcpy(&v, (const uint8_t *)tf->data + 4 * e, 4);
            memcpy(&h, (const uint8_t *)tb->data + 2 * e, 2);
            bad += h != lk_fp32_to_bf16(v);
        }
    }
    CHECKF(n2d == 2 * 7 + 2 && bad == 0, "%d 2-D tensors, %d values not the f32 ones rounded", n2d, bad);
    lk_gguf_close(gf);
    lk_gguf_close(gb);
}

TEST(gen_model_tiny_every_type) {
    static const struct { const char *name; uint32_t type, ftype; } types[] = {
        {"f32", 0, 0}, {"f16", 1, 1}, {"q8_0", 8, 7}, {"q4_0", 2, 2}, {"bf16", 30, 32}};
    for (int k = 0; k < 5; k++) {
        char args[1024];
        const char *out = tmp_path("tiny.gguf");
        snprintf(args, sizeof args, "--shape tiny --type %s -o %s --seed 7 -q", types[k].name, out);
        CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
        lk_gguf *g = open_ok(out);
        if (!g) continue;
        /* tiny: llama, 256 embd, 2 layers, 8 heads (32 wide), 2 kv heads, ff 768, vocab 512, untied */
        CHECK(lk_gguf_n_tensors(g) == 1 + 2 * 9 + 2);
        static const struct { const char *n; uint64_t ne0, ne1; } want[] = {
            {"token_embd.weight", 256, 512}, {"blk.0.attn_q.weight", 256, 256}, {"blk.0.attn_k.weight", 256, 64},
            {"blk.1.attn_v.weight", 256, 64}, {"blk.1.attn_output.weight", 256, 256}, {"blk.0.ffn_gate.weight", 256, 768},
            {"blk.0.ffn_up.weight", 256, 768}, {"blk.1.ffn_down.weight", 768, 256}, {"output.weight", 256, 512},
            {"blk.1.attn_norm.weight", 256, 1}, {"blk.0.ffn_norm.weight", 256, 1}, {"output_norm.weight", 256, 1}};
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            const lk_gguf_tensor *t = lk_gguf_find_tensor(g, want[i].n);
            CHECKF(t && t->ne[0] == want[i].ne0 && t->ne[1] == want[i].ne1, "%s %s", types[k].name, want[i].n);
            if (!t) continue;
            CHECK(t->n_dims == (want[i].ne1 > 1 ? 2 : 1));
            CHECK(t->type == (t->n_dims == 2 ? types[k].type : 0));
            double mean, sd;
            tensor_stats(t, &mean, &sd);
            if (t->n_dims == 2) CHECKF(fabs(mean) < 0.002 && sd > 0.017 && sd < 0.023, "%s %s mean %g sd %g", types[k].name, t->name, mean, sd);
            else CHECKF(fabs(mean - 1) < 0.01 && sd < 0.05, "%s mean %g sd %g", t->name, mean, sd);
        }
        CHECK(!lk_gguf_find_tensor(g, "blk.2.attn_q.weight"));
        int64_t v;
        double d;
        bool b;
        const char *str;
        size_t len;
        CHECK(lk_gguf_get_str(g, "general.architecture", &str, &len) && len == 5 && !memcmp(str, "llama", 5));
        CHECK(lk_gguf_get_i64(g, "llama.embedding_length", &v) && v == 256);
        CHECK(lk_gguf_get_i64(g, "llama.block_count", &v) && v == 2);
        CHECK(lk_gguf_get_i64(g, "llama.feed_forward_length", &v) && v == 768);
        CHECK(lk_gguf_get_i64(g, "llama.attention.head_count", &v) && v == 8);
        CHECK(lk_gguf_get_i64(g, "llama.attention.head_count_kv", &v) && v == 2);
        CHECK(lk_gguf_get_i64(g, "llama.rope.dimension_count", &v) && v == 32);
        CHECK(lk_gguf_get_i64(g, "llama.context_length", &v) && v == 2048);
        CHECK(lk_gguf_get_f64(g, "llama.rope.freq_base", &d) && d == 10000);
        CHECK(lk_gguf_get_f64(g, "llama.attention.layer_norm_rms_epsilon", &d) && (float)d == 1e-5f);
        CHECK(lk_gguf_get_i64(g, "general.file_type", &v) && v == types[k].ftype);
        CHECK(lk_gguf_get_i64(g, "general.quantization_version", &v) && v == 2);
        CHECK(lk_gguf_get_str(g, "tokenizer.ggml.model", &str, &len) && len == 5 && !memcmp(str, "llama", 5));
        CHECK(lk_gguf_get_i64(g, "tokenizer.ggml.bos_token_id", &v) && v == 1);
        CHECK(lk_gguf_get_i64(g, "tokenizer.ggml.eos_token_id", &v) && v == 2);
        CHECK(lk_gguf_get_i64(g, "tokenizer.ggml.unknown_token_id", &v) && v == 0);
        CHECK(lk_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b) && b);
        /* the synthetic vocabulary: specials, 256 bytes, then distinct pieces, scores descending */
        uint64_t n = 0;
        CHECK(lk_gguf_get_arr(g, "tokenizer.ggml.tokens", NULL, &n) && n == 512);
        CHECK(lk_gguf_get_arr(g, "tokenizer.ggml.scores", NULL, &n) && n == 512);
        CHECK(lk_gguf_get_arr(g, "tokenizer.ggml.token_type", NULL, &n) && n == 512);
        str = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", 1, &len);
        CHECK(str && len == 3 && !memcmp(str, "<s>", 3));
        str = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", 3 + 0x41, &len);
        CHECK(str && len == 6 && !memcmp(str, "<0x41>", 6));
        CHECK(lk_gguf_arr_i64(g, "tokenizer.ggml.token_type", 2) == 3);
        CHECK(lk_gguf_arr_i64(g, "tokenizer.ggml.token_type", 258) == 6);
        CHECK(lk_gguf_arr_i64(g, "tokenizer.ggml.token_type", 259) == 1);
        str = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", 259, &len);
        CHECK(str && len > 3 && !memcmp(str, "\xe2\x96\x81", 3));
        for (uint64_t i = 260; i < 512; i++)
            CHECK(lk_gguf_arr_f64(g, "tokenizer.ggml.scores", i) < lk_gguf_arr_f64(g, "tokenizer.ggml.scores", i - 1));
        for (uint64_t i = 0; i < 512; i++)
            for (uint64_t j = i + 1; j < 512; j++) {
                size_t li, lj;
                const char *a = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &li);
                const char *c = lk_gguf_arr_str(g, "tokenizer.ggml.tokens", j, &lj);
                if (li == lj && !memcmp(a, c, li)) { CHECKF(0, "tokens %" PRIu64 " and %" PRIu64 " equal", i, j); i = j = 512; }
            }
        lk_gguf_close(g);
    }
}

TEST(gen_model_reproducible_and_options) {
    char args[1024];
    const char *a = tmp_path("ga.gguf"), *b = tmp_path("gb.gguf"), *c = tmp_path("gc.gguf");
    snprintf(args, sizeof args, "--shape tiny --type q8_0 -o %s --seed 3 -q -t 1", a);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
    snprintf(args, sizeof args, "--shape tiny --type q8_0 -o %s --seed 3 -q -t 4", b); /* threads do not matter */
    CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
    CHECK(same_file_bytes(a, b, NULL));
    snprintf(args, sizeof args, "--shape tiny --type q8_0 -o %s --seed 4 -q", c);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
    CHECK(!same_file_bytes(a, c, NULL));
    /* big shapes cut to one layer, with a real vocabulary copied in */
    snprintf(args, sizeof args, "--shape qwen3-0.6b --layers 1 --type q4_0 -o %s --vocab %s -q", c,
             lk_td("vocab/ggml-vocab-gpt-2.gguf"));
    CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
    lk_gguf *g = open_ok(c), *v = open_ok(lk_td("vocab/ggml-vocab-gpt-2.gguf"));
    if (g && v) {
        int64_t x;
        CHECK(lk_gguf_get_i64(g, "qwen3.block_count", &x) && x == 1);
        CHECK(lk_gguf_get_i64(g, "qwen3.attention.key_length", &x) && x == 128);
        CHECK(lk_gguf_get_i64(g, "qwen3.embedding_length", &x) && x == 1024);
        const lk_gguf_tensor *t = lk_gguf_find_tensor(g, "blk.0.attn_q.weight");
        CHECK(t && t->ne[0] == 1024 && t->ne[1] == 16 * 128 && t->type == 2);
        t = lk_gguf_find_tensor(g, "blk.0.attn_output.weight");
        CHECK(t && t->ne[0] == 2048 && t->ne[1] == 1024);
        t = lk_gguf_find_tensor(g, "blk.0.attn_k_norm.weight");
        CHECK(t && t->n_dims == 1 && t->ne[0] == 128 && t->type == 0);
        CHECK(!lk_gguf_find_tensor(g, "output.weight")); /* tied */
        t = lk_gguf_find_tensor(g, "token_embd.weight");
        CHECK(t && t->ne[0] == 1024 && t->ne[1] == 50257);
        /* every tokenizer.* key copied verbatim */
        for (int64_t i = 0; i < lk_gguf_n_kv(v); i++) {
            const char *k = lk_gguf_kv_key(v, i);
            if (strncmp(k, "tokenizer.", 10)) continue;
            int64_t j = lk_gguf_find_kv(g, k);
            CHECKF(j >= 0, "%s", k);
            if (j < 0) continue;
            size_t n1, n2;
            const void *r1 = lk_gguf_kv_raw(v, i, &n1), *r2 = lk_gguf_kv_raw(g, j, &n2);
            CHECKF(n1 == n2 && !memcmp(r1, r2, n1) && lk_gguf_kv_type(v, i) == lk_gguf_kv_type(g, j), "%s", k);
        }
    }
    lk_gguf_close(g);
    lk_gguf_close(v);
    /* the same layer of a shape is the same whatever --layers says */
    snprintf(args, sizeof args, "--shape tiny --layers 1 --type q8_0 -o %s --seed 3 -q", c);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 0);
    lk_gguf *g1 = open_ok(a), *g2 = open_ok(c);
    if (g1 && g2) {
        const lk_gguf_tensor *x = lk_gguf_find_tensor(g1, "blk.0.ffn_down.weight"), *y = lk_gguf_find_tensor(g2, "blk.0.ffn_down.weight");
        CHECK(x && y && x->nbytes == y->nbytes && !memcmp(x->data, y->data, x->nbytes));
        CHECK(lk_gguf_n_tensors(g2) == 1 + 9 + 2 && !lk_gguf_find_tensor(g2, "blk.1.attn_q.weight"));
    }
    lk_gguf_close(g1);
    lk_gguf_close(g2);
}

TEST(gen_model_errors) {
    char args[1024];
    const char *out = tmp_path("gerr.gguf");
    unlink(out);
    snprintf(args, sizeof args, "--shape nope -o %s", out);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 2);
    snprintf(args, sizeof args, "--shape tiny --type q5_k -o %s", out);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 2);
    CHECK(run_cmd(lk_cmd_gen_model, "--shape tiny") == 2); /* no -o */
    snprintf(args, sizeof args, "--shape tiny -o %s --layers -1", out);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 2);
    snprintf(args, sizeof args, "--shape tiny -o %s --layers two", out);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 2);
    snprintf(args, sizeof args, "--shape tiny -o %s extra", out);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 2);
    snprintf(args, sizeof args, "--shape tiny -o %s --vocab /nonexistent.gguf", out);
    CHECK(run_cmd(lk_cmd_gen_model, args) == 1);
    snprintf(args, sizeof args, "--shape tiny -o %s --vocab %s", out, lk_td("synth/synth-llama-f32.json"));
    CHECK(run_cmd(lk_cmd_gen_model, args) == 1);
    CHECK(run_cmd(lk_cmd_gen_model, "--shape tiny -q -o /nonexistent-dir/x.gguf") == 1);
    CHECK(access(out, F_OK) != 0);
}

int main(void) {
    RUN(synth_models_match_llama_cpp);
    RUN(stories_models);
    RUN(vocab_files);
    RUN(crafted_valid_file);
    RUN(crafted_truncated_everywhere);
    RUN(crafted_malformed);
    RUN(crafted_duplicates_and_nesting);
    RUN(crafted_random_corruption);
    RUN(crafted_misaligned_tensor_data);
    RUN(sanitize_text_from_files);
    RUN(writer_reproduces_llama_cpp_files);
    RUN(writer_round_trip);
    RUN(quantize_matches_llama_quantize);
    RUN(quantize_errors);
    RUN(gen_model_tiny_every_type);
    RUN(gen_model_bf16_is_f32_rounded);
    RUN(gen_model_reproducible_and_options);
    RUN(gen_model_errors);
    cleanup_tmp();
    return lk_test_end();
}
