/* The K-quant weight quantisers against llama-quantize and across levels:
 * re-quantising the F32 master of the synth models reproduces, byte for
 * byte, every Q4_K, Q5_K and Q6_K tensor that llama-quantize wrote into
 * synth-llama-q4_k_m / q5_k_m / q6_k.gguf (same master, no importance
 * matrix), at every SIMD level the CPU has (the AVX2 level searches the
 * scales of Q2_K, Q4_K, Q5_K and Q6_K 8 candidates at a time); and the
 * levels agree byte for byte with the scalar quantisers on many more
 * blocks of other distributions, adversarial ones included. */
#include "lk_test.h"

#include <math.h>

#include "gguf/gguf.h"
#include "quant/quant_impl.h"

static const char *k_levels[] = {"scalar", "avx2", "avx512"};

/* Every row of every tensor of type t in file, re-quantised from the F32
 * master at the active level, against the file's bytes. */
static void check_file(const char *level, const char *file, lk_type t, int want) {
    char err[LK_ERRLEN];
    lk_gguf *f = NULL, *q = NULL;
    CHECKF(lk_gguf_open(lk_td("synth/synth-llama-f32.gguf"), &f, err, sizeof err) == LK_OK, "%s", err);
    CHECKF(lk_gguf_open(lk_td(file), &q, err, sizeof err) == LK_OK, "%s", err);
    if (!f || !q) { lk_gguf_close(f); lk_gguf_close(q); return; }
    int tensors = 0;
    long same = 0, rows = 0;
    for (int64_t i = 0; i < lk_gguf_n_tensors(q); i++) {
        const lk_gguf_tensor *tq = lk_gguf_tensor_at(q, i);
        if (tq->type != (uint32_t)t) continue;
        const lk_gguf_tensor *m = lk_gguf_find_tensor(f, tq->name);
        CHECKF(m && m->type == LK_TYPE_F32 && m->ne[0] == tq->ne[0], "%s", tq->name);
        if (!m) continue;
        tensors++;
        size_t rb = 0;
        CHECK(lk_type_row_bytes(t, (int64_t)tq->ne[0], &rb));
        uint8_t *buf = malloc(rb);
        for (uint64_t r = 0; r < tq->n_elements / tq->ne[0]; r++, rows++) {
            lk_quantize_row(t, (const float *)m->data + r * tq->ne[0], buf, (int64_t)tq->ne[0]);
            same += !memcmp(buf, (const uint8_t *)tq->data + r * rb, rb);
        }
        free(buf);
    }
    printf("  %s: %s: %d %s tensors, %ld/%ld rows byte-identical to llama-quantize\n", level, file, tensors,
           lk_type_name(t), same, rows);
    CHECKF(tensors == want, "%s: %d %s tensors, expected %d", file, tensors, lk_type_name(t), want);
    CHECK(rows > 0 && same == rows);
    lk_gguf_close(f);
    lk_gguf_close(q);
}

TEST(kquant_rows_identical_to_llama_quantize) {
    for (int l = 0; l < 3; l++) {
        if (!lk_quant_set_simd(k_levels[l])) continue;
        check_file(k_levels[l], "synth/synth-llama-q4_k_m.gguf", LK_TYPE_Q4_K, 13);
        check_file(k_levels[l], "synth/synth-llama-q4_k_m.gguf", LK_TYPE_Q6_K, 3);
        check_file(k_levels[l], "synth/synth-llama-q5_k_m.gguf", LK_TYPE_Q5_K, 13);
        check_file(k_levels[l], "synth/synth-llama-q6_k.gguf", LK_TYPE_Q6_K, 16);
    }
    lk_quant_set_simd("scalar");
}

/* NB super-blocks of 15 kinds: gaussian, uniform, all positive, all
 * negative, heavy tails, sparse (mostly zeros), two constants, tiny and
 * huge magnitudes, values on a quantisation grid (ties), all zeros, one
 * constant, one outlier among small values, magnitudes near FLT_MAX (sums
 * of squares overflow to inf) and subnormals (candidate scales overflow to
 * inf), and blocks with an inf or a NaN. */
enum { KINDS = 15 };
static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static float rnd_unif(void) {
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) * (1.0 / 16777216.0)) * 2 - 1;
}

static void fill_block(float *p, int b) {
    const int kind = b % KINDS;
    const float mag = kind == 7 ? (b & 1 ? 1e-6f : 3e4f) : kind == 12 ? (b & 1 ? 3e38f : 1e30f) : kind == 13 ? 1e-39f : 1.f;
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
        case 7: case 12: case 13: p[i] = mag * u; break;
        case 8: p[i] = (float)((int)(u * 8)) * 0.125f; break;
        case 9: p[i] = 0.f; break;
        case 10: p[i] = (b / KINDS) & 1 ? -0.75f : 3.f; break;
        case 11: p[i] = 1e-3f * u; break;
        default: p[i] = u + v; break;
        }
    }
    if (kind == 11) p[(b * 37) % 256] = (b / KINDS) & 1 ? -40.f : 40.f; /* the outlier */
    if (kind == 14 && (b / KINDS) % 3 != 0) p[(b * 11) % 256] = (b / KINDS) & 2 ? INFINITY : NAN;
}

TEST(kquant_levels_identical_to_scalar) {
    enum { NB = 4096, N = NB * 256 };
    static const lk_type types[] = {LK_TYPE_Q2_K, LK_TYPE_Q3_K, LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K};
    float *x = malloc((size_t)N * 4);
    for (int b = 0; b < NB; b++) fill_block(x + (size_t)b * 256, b);
    uint8_t *ref = malloc((size_t)NB * 256), *got = malloc((size_t)NB * 256);
    int tested = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const lk_type t = types[ti];
        const size_t bb = lk_type_block_bytes(t);
        lk_quant_set_simd("scalar");
        lk_quantize_row(t, x, ref, N);
        for (int l = 1; l < 3; l++) {
            if (!lk_quant_set_simd(k_levels[l])) continue;
            tested++;
            memset(got, 0xCD, (size_t)NB * bb);
            lk_quantize_row(t, x, got, N);
            int bad = 0, first = -1;
            for (int b = 0; b < NB; b++)
                if (memcmp(ref + (size_t)b * bb, got + (size_t)b * bb, bb)) bad++, first = first < 0 ? b : first;
            CHECKF(bad == 0, "%s %s: %d of %d super-blocks differ from the scalar quantiser's (first: %d, kind %d)",
                   lk_type_name(t), k_levels[l], bad, NB, first, first % KINDS);
        }
    }
    if (!tested) printf("  (only the scalar level on this CPU)\n");
    lk_quant_set_simd("scalar");
    free(x); free(ref); free(got);
}

/* lk_nearest (the quantisers' rounding) is nearbyintf and a cast, with NaN
 * and values past int's range giving INT_MIN as the AVX2 twins' vcvtps2dq:
 * every float of magnitude below 2^24 whose bit pattern is a multiple of 61
 * (both signs; the fast path ends at 2^22), ties, and the edges. */
TEST(nearest_is_nearbyintf) {
    long bad = 0, n = 0;
    for (uint32_t u = 0; u < 0x4B800000u; u += 61)
        for (int sgn = 0; sgn < 2; sgn++, n++) {
            float f;
            uint32_t v = u | (uint32_t)sgn << 31;
            memcpy(&f, &v, 4);
            if (lk_nearest(f) != (int)nearbyintf(f) && bad++ < 4) printf("  %a: %d, nearbyintf %g\n", f, lk_nearest(f), nearbyintf(f));
        }
    static const float ties[] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 4194303.5f, -4194303.5f, 4194304.f, 4194305.f,
                                 8388607.5f, 2147483520.f, -2147483648.f};
    for (size_t i = 0; i < sizeof ties / sizeof ties[0]; i++)
        CHECKF(lk_nearest(ties[i]) == (int)nearbyintf(ties[i]), "%a: %d", ties[i], lk_nearest(ties[i]));
    CHECKF(bad == 0, "%ld of %ld floats round differently", bad, n);
    static const float out[] = {2147483648.f, -2147483904.f, 3e38f, -3e38f, INFINITY, -INFINITY, NAN};
    for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) CHECKF(lk_nearest(out[i]) == INT_MIN, "%g: %d", out[i], lk_nearest(out[i]));
}

int main(void) {
    RUN(nearest_is_nearbyintf);
    RUN(kquant_rows_identical_to_llama_quantize);
    RUN(kquant_levels_identical_to_scalar);
    return lk_test_end();
}
