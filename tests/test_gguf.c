/* gguf part: the reader against every real file in the test data (shapes,
 * types and metadata checked against llama.cpp's view of them in the synth
 * JSON files), crafted malformed files, and the writer's round trip. */
#include "gguf/gguf.h"
#include "quant/quant.h"
#include "lk_test.h"

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

TEST(synth_models_match_llama_cpp) {
    DIR *d = opendir(lk_td("synth"));
    CHECK(d);
    if (!d) return;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l < 6 || strcmp(e->d_name + l - 5, ".gguf")) continue;
        char base[512], gp[1024], jp[1024];
        snprintf(base, sizeof base, "%.*s", (int)(l - 5), e->d_name);
        snprintf(gp, sizeof gp, "%s", lk_td("synth"));
        snprintf(gp + strlen(gp), sizeof gp - strlen(gp), "/%s.gguf", base);
        snprintf(jp, sizeof jp, "%s/%s.json", lk_td("synth"), base);
        check_against_json(gp, jp);
        n++;
    }
    closedir(d);
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
    DIR *d = opendir(lk_td("vocab"));
    CHECK(d);
    if (!d) return;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l < 6 || strcmp(e->d_name + l - 5, ".gguf")) continue;
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", lk_td("vocab"), e->d_name);
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
    closedir(d);
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

int main(void) {
    RUN(synth_models_match_llama_cpp);
    RUN(stories_models);
    RUN(vocab_files);
    return lk_test_end();
}
