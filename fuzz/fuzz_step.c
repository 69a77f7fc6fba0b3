/* fuzz_step — the step message as a worker receives it from rank 0.
 *
 * Includes step.c to reach its decoder (tests reach static functions the
 * same way), then runs what it accepts on a real model, so the checks
 * behind the decoder (slot operations, items, positions, tokens, the KV
 * pages, the samplers and candidates) see the message too, as they do on a
 * worker. Input: up to 8 step bodies, each u16 length (little-endian) then
 * the body (header fields of step.h after the 16-byte frame header); every
 * body the decoder accepts is run and its candidates collected, so later
 * steps meet the state earlier ones left. The model is stories260K (tiny:
 * a step costs microseconds), 4 slots of 64 positions, batches of 16;
 * LK_FUZZ_MODEL names another file. Every input starts from empty slots. */
#include "../src/step/step.c"

#include <assert.h>

static lk_gguf *g_gguf;
static lk_model *g_model;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    lk_log_set_level(LK_LOG_ERROR);
    const char *path = getenv("LK_FUZZ_MODEL");
    if (!path || !*path) path = "testdata/models/stories260K.gguf";
    char err[LK_ERRLEN];
    lk_model_params mp = {.n_ctx = 64, .n_batch = 16, .max_seqs = 4, .n_threads = 1};
    if (lk_gguf_open(path, &g_gguf, err, sizeof err) || lk_model_load(g_gguf, NULL, &mp, &g_model, err, sizeof err)) {
        fprintf(stderr, "fuzz_step: %s (run from the repository root, or set LK_FUZZ_MODEL)\n", err);
        exit(1);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[LK_ERRLEN];
    lk_step_params sp = {.m = g_model};
    lk_step *s;
    if (lk_step_create(&sp, &s, err, sizeof err)) { fprintf(stderr, "%s\n", err); abort(); }
    lk_step_msg msg;
    lk_step_msg_init(&msg, lk_model_max_seqs(g_model), lk_model_n_batch(g_model));
    size_t off = 0;
    for (int k = 0; k < 8 && off + 2 <= size; k++) {
        size_t n = (size_t)data[off] | (size_t)data[off + 1] << 8;
        off += 2;
        if (n > size - off) n = size - off;
        /* the body goes where lk_step_recv puts it: after the header, in the message's own buffer */
        if (n > body_cap(&msg)) break;
        memcpy(msg.wire + LK_STEP_HDR, data + off, n);
        off += n;
        msg.no = (uint64_t)k;
        if (decode(&msg, msg.wire + LK_STEP_HDR, n, err, sizeof err)) continue;
        if (lk_step_run(s, &msg, false, err, sizeof err)) continue;
        if (lk_step_collect(s, err, sizeof err)) continue;
        for (int i = 0; i < lk_step_n_results(s); i++) {
            int seq;
            const int32_t *ids;
            const float *vals;
            int c = lk_step_result(s, i, &seq, &ids, &vals);
            assert(seq >= 0 && seq < lk_model_max_seqs(g_model));
            for (int j = 0; j < c; j++) assert(ids[j] >= -1 && ids[j] < lk_model_cfg(g_model)->n_vocab);
        }
    }
    lk_step_msg_free(&msg);
    lk_step_free(s);
    for (int q = 0; q < lk_model_max_seqs(g_model); q++) lk_model_seq_keep(g_model, q, 0, err, sizeof err);
    return 0;
}
