/* Our Q4_K weight quantiser against llama-quantize: re-quantising the F32
 * master of the synth models reproduces, byte for byte, every Q4_K tensor
 * that llama-quantize wrote into synth-llama-q4_k_m.gguf (same master, no
 * importance matrix), at every SIMD level the CPU has (the AVX2 level
 * searches scales 8 at a time); and the levels agree byte for byte on many
 * more blocks of other distributions. */
#include "lk_test.h"

#include "gguf/gguf.h"
#include "quant/quant.h"

static void check_level(const char *level);

TEST(q4_k_rows_identical_to_llama_quantize) {
    const char *levels[] = {"scalar", "avx2", "avx512"};
    for (int l = 0; l < 3; l++)
        if (lk_quant_set_simd(levels[l])) check_level(levels[l]);
    lk_quant_set_simd("scalar");
}

static void check_level(const char *level) {
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
    printf("  %s: %d Q4_K tensors, %ld/%ld rows byte-identical to llama-quantize\n", level, tensors, same, rows);
    CHECK(tensors == 13);
    CHECK(rows > 0 && same == rows);
    lk_gguf_close(f);
    lk_gguf_close(q);
}

/* 4096 super-blocks: gaussian, uniform, all positive, all negative, heavy
 * tails, sparse (mostly zeros), constant, tiny and huge magnitudes, values
 * on the quantisation grid (ties) */
static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static float rnd_unif(void) {
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) * (1.0 / 16777216.0)) * 2 - 1;
}

TEST(q4_k_levels_identical) {
    enum { NB = 4096, N = NB * 256 };
    float *x = malloc((size_t)N * 4);
    uint8_t *ref = malloc((size_t)NB * 144), *got = malloc((size_t)NB * 144);
    for (int b = 0; b < NB; b++) {
        float *p = x + (size_t)b * 256;
        const int kind = b % 9;
        const float mag = kind == 7 ? (b & 1 ? 1e-6f : 3e4f) : 1.f;
        for (int i = 0; i < 256; i++) {
            float u = rnd_unif(), v = rnd_unif();
            switch (kind) {
            case 0: p[i] = u + v + rnd_unif(); break;
            case 1: p[i] = u; break;
            case 2: p[i] = 1.5f + u; break;
            case 3: p[i] = -2.f + 0.5f * u; break;
            case 4: p[i] = u * u * u * 10.f; break;
            case 5: p[i] = (i * 7 + b) % 13 ? 0.f : u; break;
            case 6: p[i] = i < 128 ? 0.25f : -0.5f; break;
            case 7: p[i] = mag * u; break;
            default: p[i] = (float)((int)(u * 8)) * 0.125f; break;
            }
        }
    }
    lk_quant_set_simd("scalar");
    lk_quantize_row(LK_TYPE_Q4_K, x, ref, N);
    const char *levels[] = {"avx2", "avx512"};
    int tested = 0;
    for (int l = 0; l < 2; l++) {
        if (!lk_quant_set_simd(levels[l])) continue;
        tested++;
        memset(got, 0xCD, (size_t)NB * 144);
        lk_quantize_row(LK_TYPE_Q4_K, x, got, N);
        int bad = 0, first = -1;
        for (int b = 0; b < NB; b++)
            if (memcmp(ref + (size_t)b * 144, got + (size_t)b * 144, 144)) bad++, first = first < 0 ? b : first;
        CHECKF(bad == 0, "%s: %d of %d super-blocks differ from the scalar quantiser's (first: %d, kind %d)", levels[l],
               bad, NB, first, first % 9);
    }
    if (!tested) printf("  (only the scalar level on this CPU)\n");
    lk_quant_set_simd("scalar");
    free(x); free(ref); free(got);
}

int main(void) {
    RUN(q4_k_rows_identical_to_llama_quantize);
    RUN(q4_k_levels_identical);
    return lk_test_end();
}
