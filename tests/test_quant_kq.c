/* Our Q4_K weight quantiser against llama-quantize: re-quantising the F32
 * master of the synth models reproduces, byte for byte, every Q4_K tensor
 * that llama-quantize wrote into synth-llama-q4_k_m.gguf (same master, no
 * importance matrix). */
#include "lk_test.h"

#include "gguf/gguf.h"
#include "quant/quant.h"

TEST(q4_k_rows_identical_to_llama_quantize) {
    char err[LK_ERRLEN];
    lk_gguf *f = NULL, *q = NULL;
    CHECKF(lk_gguf_open(lk_td("synth/synth-llama-f32.gguf"), &f, err, sizeof err) == LK_OK, "%s", err);
    CHECKF(lk_gguf_open(lk_td("synth/synth-llama-q4_k_m.gguf"), &q, err, sizeof err) == LK_OK, "%s", err);
    if (!f || !q) { lk_gguf_close(f); lk_gguf_close(q); return; }
    int tensors = 0;
    long same = 0, rows = 0;
    for (int64_t i = 0; i < lk_gguf_n_tensors(q); i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(q, i);
        if (t->type != LK_TYPE_Q4_K) continue;
        const lk_gguf_tensor *m = lk_gguf_find_tensor(f, t->name);
        CHECKF(m && m->type == LK_TYPE_F32 && m->ne[0] == t->ne[0], "%s", t->name);
        if (!m) continue;
        tensors++;
        size_t rb = 0;
        CHECK(lk_type_row_bytes(LK_TYPE_Q4_K, (int64_t)t->ne[0], &rb));
        uint8_t *buf = malloc(rb);
        for (uint64_t r = 0; r < t->ne[1]; r++, rows++) {
            lk_quantize_row(LK_TYPE_Q4_K, (const float *)m->data + r * t->ne[0], buf, (int64_t)t->ne[0]);
            same += !memcmp(buf, (const uint8_t *)t->data + r * rb, rb);
        }
        free(buf);
    }
    printf("  %d Q4_K tensors, %ld/%ld rows byte-identical to llama-quantize\n", tensors, same, rows);
    CHECK(tensors == 13);
    CHECK(rows > 0 && same == rows);
    lk_gguf_close(f);
    lk_gguf_close(q);
}

int main(void) {
    RUN(q4_k_rows_identical_to_llama_quantize);
    return lk_test_end();
}
