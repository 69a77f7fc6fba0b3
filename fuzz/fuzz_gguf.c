/* fuzz_gguf — a GGUF file from anyone: the reader, then what lockstep reads
 * from it before any weight: the model configuration, the tokenizer, the
 * chat template, the model identity.
 *
 * The input is written to a memfd and opened by its /proc path, so the real
 * lk_gguf_open (open, fstat, mmap, parse) runs, not a test-only entry. On a
 * file the reader accepts, every key/value is formatted and read through the
 * typed getters, every tensor looked up by name; the configuration is read;
 * a tokenizer that loads encodes and decodes a few texts, every piece is
 * rendered, and a detokeniser streams the ids back. */
#include <assert.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cluster/cluster.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

static int g_fd = -1;
static char g_path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    lk_log_set_level(LK_LOG_ERROR);
    g_fd = memfd_create("fuzz.gguf", MFD_CLOEXEC);
    if (g_fd < 0) { perror("memfd_create"); abort(); }
    snprintf(g_path, sizeof g_path, "/proc/self/fd/%d", g_fd);
    return 0;
}

static void walk_metadata(const lk_gguf *g) {
    char buf[512];
    for (int64_t i = 0; i < lk_gguf_n_kv(g); i++) {
        const char *key = lk_gguf_kv_key(g, i);
        assert(lk_gguf_find_kv(g, key) >= 0);
        lk_gguf_kv_format(g, i, buf, sizeof buf);
        size_t raw_n;
        (void)lk_gguf_kv_raw(g, i, &raw_n);
        int64_t iv; uint64_t uv; double dv; bool bv; const char *s; size_t sl;
        lk_gguf_get_i64(g, key, &iv); lk_gguf_get_u64(g, key, &uv); lk_gguf_get_f64(g, key, &dv);
        lk_gguf_get_bool(g, key, &bv);
        if (lk_gguf_get_str(g, key, &s, &sl)) lk_str_sanitize(buf, sizeof buf, s, sl);
        lk_gguf_vtype et;
        uint64_t n;
        if (lk_gguf_get_arr(g, key, &et, &n) && n) {
            /* first, last and a middle element: enough to reach every offset computation */
            uint64_t idx[3] = {0, n / 2, n - 1};
            for (int k = 0; k < 3; k++) {
                (void)lk_gguf_arr_i64(g, key, idx[k]);
                (void)lk_gguf_arr_f64(g, key, idx[k]);
                if (lk_gguf_arr_str(g, key, idx[k], &sl) == NULL) assert(et != LK_GGUF_STRING);
            }
            (void)lk_gguf_arr_data(g, key);
        }
    }
    for (int64_t i = 0; i < lk_gguf_n_tensors(g); i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
        assert(lk_gguf_find_tensor(g, t->name) != NULL);
        /* the reader promised the data lies inside the file */
        const uint8_t *base = lk_gguf_file_bytes(g);
        assert((const uint8_t *)t->data >= base && (const uint8_t *)t->data + t->nbytes <= base + lk_gguf_file_size(g));
    }
}

static void use_tokenizer(const lk_tokenizer *t) {
    static const char *texts[] = {"Once upon a time", " Hello  world!\n\tok", "<s>caf\xc3\xa9 \xf0\x9f\x98\x80 \xff",
                                  "<|im_start|>user 123 4567"};
    char buf[1024];
    int32_t nv = lk_tokenizer_n_vocab(t);
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++)
        for (int sp = 0; sp < 2; sp++) {
            int32_t *ids = NULL, n = 0;
            char err[LK_ERRLEN];
            if (lk_tokenizer_encode(t, texts[k], strlen(texts[k]), true, sp, &ids, &n, err, sizeof err) == LK_OK) {
                for (int32_t i = 0; i < n; i++) assert(ids[i] >= 0 && ids[i] < nv);
                lk_tokenizer_decode(t, ids, n, sp, buf, sizeof buf);
                lk_detok d;
                lk_detok_init(&d, t);
                for (int32_t i = 0; i < n; i++) lk_detok_push(&d, ids[i], buf, sizeof buf);
                lk_detok_flush(&d, buf, sizeof buf);
            }
            free(ids);
        }
    int32_t lim = nv < 4096 ? nv : 4096;
    for (int32_t id = 0; id < lim; id++) {
        lk_tokenizer_piece(t, id, true, buf, sizeof buf);
        size_t l;
        const char *s = lk_tokenizer_token_text(t, id, &l);
        if (s) lk_tokenizer_find(t, s, l);
        lk_tokenizer_is_eog(t, id);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (ftruncate(g_fd, 0) || pwrite(g_fd, data, size, 0) != (ssize_t)size) abort();
    lk_gguf *g;
    char err[LK_ERRLEN];
    if (lk_gguf_open(g_path, &g, err, sizeof err) != LK_OK) return 0;
    walk_metadata(g);

    lk_model_config cfg;
    if (lk_model_config_read(g, &cfg, err, sizeof err) == LK_OK) {
        lk_plan_dims d;
        lk_model_plan_dims(g, &cfg, &d);
    }
    lk_tokenizer *t;
    if (lk_tokenizer_load(g, &t, err, sizeof err) == LK_OK) {
        use_tokenizer(t);
        lk_tokenizer_free(t);
    }
    const char *tmpl;
    size_t tl;
    if (lk_gguf_get_str(g, "tokenizer.chat_template", &tmpl, &tl) && tl < 65536) {
        char *s = malloc(tl + 1);
        memcpy(s, tmpl, tl);
        s[tl] = 0;
        lk_chat_template_check(s, err, sizeof err);
        free(s);
    }
    uint8_t id[LK_MODEL_ID_BYTES];
    lk_cluster_model_id(g, id);
    lk_gguf_close(g);
    return 0;
}
