/* test_quant — block formats, quantisers and the matrix kernel.
 *
 * References: (1) facts of the GGML format (block sizes); (2) llama-quantize's
 * output in ../shared/testdata/synth (the q8_0/q4_0 files were made from the
 * f32 master with ggml's reference quantisers, so requantising the master
 * must reproduce them byte for byte, and every quantised file must
 * dequantise to the master within its type's error bound); (3) independent
 * double-precision computations for the dot products; (4) the kernel itself
 * at other batch sizes (batch invariance), and child processes started with
 * LK_SIMD for the program's one SIMD level. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lk_test.h"
#include "parallel/parallel.h"
#include "kernels/kernels.h"
#include "gguf/gguf.h"
#include "kernels/membw.h"
#include "quant/quant.h"
#include "quant/quant_impl.h"

/* ---- deterministic random numbers (xorshift64*) ---- */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd_u64(void) {
    g_rng ^= g_rng >> 12; g_rng ^= g_rng << 25; g_rng ^= g_rng >> 27;
    return g_rng * 0x2545F4914F6CDD1Dull;
}
static float rnd_unif(void) { return (float)((rnd_u64() >> 40) * (1.0 / 16777216.0)) * 2 - 1; }
static float rnd_gauss(void) {
    float s = 0;
    for (int i = 0; i < 4; i++) s += rnd_unif();
    return s * 0.866f;
}

static void put_h(uint8_t *p, float f) { uint16_t h = lk_fp32_to_fp16(f); memcpy(p, &h, 2); }
static float get_h(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return lk_fp16_to_fp32(h); }

/* ===================================================================== */
TEST(traits) {
    /* Block facts from ggml's block structs. */
    static const struct { uint32_t t; int64_t bs; size_t bytes; const char *name; } k[] = {
        {LK_TYPE_F32, 1, 4, "f32"},        {LK_TYPE_F16, 1, 2, "f16"},
        {LK_TYPE_BF16, 1, 2, "bf16"},      {LK_TYPE_Q4_0, 32, 18, "q4_0"},
        {LK_TYPE_Q4_1, 32, 20, "q4_1"},    {LK_TYPE_Q5_0, 32, 22, "q5_0"},
        {LK_TYPE_Q5_1, 32, 24, "q5_1"},    {LK_TYPE_Q8_0, 32, 34, "q8_0"},
        {LK_TYPE_Q8_1, 32, 36, "q8_1"},    {LK_TYPE_Q2_K, 256, 84, "q2_k"},
        {LK_TYPE_Q3_K, 256, 110, "q3_k"},  {LK_TYPE_Q4_K, 256, 144, "q4_k"},
        {LK_TYPE_Q5_K, 256, 176, "q5_k"},  {LK_TYPE_Q6_K, 256, 210, "q6_k"},
        {LK_TYPE_Q8_K, 256, 292, "q8_k"},  {LK_TYPE_IQ2_XXS, 256, 66, "iq2_xxs"},
        {LK_TYPE_IQ2_XS, 256, 74, "iq2_xs"}, {LK_TYPE_IQ3_XXS, 256, 98, "iq3_xxs"},
        {LK_TYPE_IQ1_S, 256, 50, "iq1_s"}, {LK_TYPE_IQ4_NL, 32, 18, "iq4_nl"},
        {LK_TYPE_IQ3_S, 256, 110, "iq3_s"}, {LK_TYPE_IQ2_S, 256, 82, "iq2_s"},
        {LK_TYPE_IQ4_XS, 256, 136, "iq4_xs"}, {LK_TYPE_I8, 1, 1, "i8"},
        {LK_TYPE_I16, 1, 2, "i16"},        {LK_TYPE_I32, 1, 4, "i32"},
        {LK_TYPE_I64, 1, 8, "i64"},        {LK_TYPE_F64, 1, 8, "f64"},
        {LK_TYPE_IQ1_M, 256, 56, "iq1_m"}, {LK_TYPE_TQ1_0, 256, 54, "tq1_0"},
        {LK_TYPE_TQ2_0, 256, 66, "tq2_0"}, {LK_TYPE_MXFP4, 32, 17, "mxfp4"},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        CHECKF(lk_type_block_size(k[i].t) == k[i].bs, "%s", k[i].name);
        CHECKF(lk_type_block_bytes(k[i].t) == k[i].bytes, "%s", k[i].name);
        CHECKF(!strcmp(lk_type_name(k[i].t), k[i].name), "%s", k[i].name);
        lk_type t;
        CHECKF(lk_type_from_name(k[i].name, &t) && t == k[i].t, "%s", k[i].name);
    }
    /* lockstep's own layouts: sized, but never a file's and never parsed */
    CHECK(LK_TYPE_Q4_0_R16 >= LK_TYPE_COUNT && !lk_type_supported(LK_TYPE_Q4_0_R16));
    CHECK(lk_type_block_size(LK_TYPE_Q4_0_R16) == 32 && lk_type_block_bytes(LK_TYPE_Q4_0_R16) == 18);
    CHECK(!lk_type_from_name("q4_0_r16", &(lk_type){0}) && !lk_type_from_name("q8_0_r16", &(lk_type){0}));
    CHECK(lk_type_block_bytes(LK_TYPE_Q8_0_R16) == 34 && lk_type_file(LK_TYPE_Q8_0_R16) == LK_TYPE_Q8_0);
    CHECK(lk_type_block_bytes(LK_TYPE_Q6_K_R16) == 210 && lk_type_file(LK_TYPE_Q6_K_R16) == LK_TYPE_Q6_K);
    CHECK(lk_type_file(LK_TYPE_Q4_K_R16) == LK_TYPE_Q4_K && lk_type_file(LK_TYPE_Q5_K_R16) == LK_TYPE_Q5_K);
    CHECK(!lk_type_from_name("q4_k_r16", &(lk_type){0}) && !lk_type_supported(LK_TYPE_Q6_K_R16));
    uint32_t unknown[] = {4, 5, 31, 32, 33, 36, 37, 38, LK_TYPE_ALL, 1000};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        CHECK(lk_type_block_size(unknown[i]) == 0);
        CHECK(lk_type_block_bytes(unknown[i]) == 0);
        CHECK(!lk_type_supported(unknown[i]));
    }
    CHECK(!strcmp(lk_type_name(4), "type#4"));
    lk_type t;
    CHECK(lk_type_from_name("Q4_K", &t) && t == LK_TYPE_Q4_K);
    CHECK(!lk_type_from_name("q4_k_m", &t));
    size_t rb = 0;
    CHECK(lk_type_row_bytes(LK_TYPE_Q4_0, 4096, &rb) && rb == 128 * 18);
    CHECK(!lk_type_row_bytes(LK_TYPE_Q4_K, 4096 + 32, &rb));
    CHECK(!lk_type_row_bytes(4, 32, &rb));
    CHECK(!lk_type_row_bytes(LK_TYPE_F64, INT64_MAX, &rb)); /* 8 * n overflows */
    uint32_t sup[] = {LK_TYPE_F32, LK_TYPE_F16, LK_TYPE_BF16, LK_TYPE_Q8_0,
                      LK_TYPE_Q4_0, LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K};
    for (size_t i = 0; i < 8; i++) CHECK(lk_type_supported(sup[i]));
    CHECK(!lk_type_supported(LK_TYPE_Q4_1) && !lk_type_supported(LK_TYPE_Q8_K));
    CHECK(lk_type_vec_dot(LK_TYPE_Q4_0) == LK_TYPE_Q8_0);
    CHECK(lk_type_vec_dot(LK_TYPE_Q8_0) == LK_TYPE_Q8_0);
    CHECK(lk_type_vec_dot(LK_TYPE_Q4_K) == LK_TYPE_Q8_K);
    CHECK(lk_type_vec_dot(LK_TYPE_Q5_K) == LK_TYPE_Q8_K);
    CHECK(lk_type_vec_dot(LK_TYPE_Q6_K) == LK_TYPE_Q8_K);
    CHECK(lk_type_vec_dot(LK_TYPE_F16) == LK_TYPE_F16);
    CHECK(lk_type_vec_dot(LK_TYPE_BF16) == LK_TYPE_BF16);
    CHECK(lk_type_vec_dot(LK_TYPE_F32) == LK_TYPE_F32);
    CHECK(lk_quantize_supported(LK_TYPE_Q8_K) && lk_quantize_supported(LK_TYPE_Q4_0));
    CHECK(!lk_quantize_supported(LK_TYPE_Q4_1)); /* no quantiser for it */
}

/* ===================================================================== */
/* Quantisers: hand-computed vectors and round-trip bounds                */

TEST(quantize_known_vectors) {
    float x[32];
    /* Q8_0 of 0..31 - 16: amax 16, d = 16/127; x/d = x*127/16. */
    for (int i = 0; i < 32; i++) x[i] = (float)(i - 16);
    uint8_t b[34];
    lk_quantize_row(LK_TYPE_Q8_0, x, b, 32);
    CHECK(get_h(b) == lk_fp16_to_fp32(lk_fp32_to_fp16(16.f / 127.f)));
    CHECK((int8_t)b[2] == -127 && (int8_t)b[2 + 16] == 0 && (int8_t)b[2 + 31] == 119);
    /* x = 1 -> 127/16 = 7.9375 -> 8; x = 2 -> 15.875 -> 16; x = -4 -> -31.75 -> -32 */
    CHECK((int8_t)b[2 + 17] == 8 && (int8_t)b[2 + 18] == 16 && (int8_t)b[2 + 12] == -32);

    /* Q4_0: the signed max (-16) maps to -8: d = -16/-8 = 2, q = min(15, trunc(x/2 + 8.5)). */
    uint8_t c[18];
    lk_quantize_row(LK_TYPE_Q4_0, x, c, 32);
    CHECK(get_h(c) == 2.0f);
    CHECK((c[2] & 0xF) == 0);          /* x=-16 -> 0 */
    CHECK((c[2 + 15] & 0xF) == 8);     /* x=-1 -> trunc(8.0) = 8 */
    CHECK((c[2 + 0] >> 4) == 8);       /* x=0 -> 8 */
    CHECK((c[2 + 15] >> 4) == 15);     /* x=15 -> trunc(16) = 16 -> clamped to 15 */

    /* Q8_K: iscale = -127/max with max the signed largest (here +255 at the end). */
    float z[256];
    for (int i = 0; i < 256; i++) z[i] = (float)i;
    uint8_t k8[292];
    lk_quantize_row(LK_TYPE_Q8_K, z, k8, 256);
    float d;
    memcpy(&d, k8, 4);
    CHECK(fabsf(d - (-255.f / 127.f)) < 1e-6f);
    CHECK((int8_t)k8[4 + 255] == -127 && (int8_t)k8[4] == 0);
    /* 0.5*127/255*... element 1: -127/255 = -0.498 -> 0 (round to nearest) */
    CHECK((int8_t)k8[4 + 1] == 0 && (int8_t)k8[4 + 2] == -1);
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += (int8_t)k8[4 + 16 * g + j];
        int16_t bs;
        memcpy(&bs, k8 + 260 + 2 * g, 2);
        CHECKF(bs == s, "bsum %d: %d vs %d", g, bs, s);
    }
    /* Ties go to even (ggml's nearest_int): max = -127 -> iscale = 1, x = 2.5 -> 2, 3.5 -> 4. */
    for (int i = 0; i < 256; i++) z[i] = 0;
    z[0] = -127; z[1] = 2.5f; z[2] = 3.5f; z[3] = -0.5f;
    lk_quantize_row(LK_TYPE_Q8_K, z, k8, 256);
    CHECK((int8_t)k8[4] == -127 && (int8_t)k8[5] == 2 && (int8_t)k8[6] == 4 && (int8_t)k8[7] == 0);
    /* An all-zero block quantises to zeros (and zero bsums). */
    for (int i = 0; i < 256; i++) z[i] = 0;
    memset(k8, 0xAB, sizeof k8);
    lk_quantize_row(LK_TYPE_Q8_K, z, k8, 256);
    int nz = 0;
    for (int i = 0; i < 292; i++) nz += k8[i] != 0;
    CHECK(nz == 0);
}

/* x[0..n) quantised to t and back: every element within num * amax / den,
 * amax the largest |x| of its block of bs. */
static void check_block_roundtrip(lk_type t, int bs, float num, float den, const float *x, float *y, uint8_t *q,
                                  int n) {
    lk_quantize_row(t, x, q, n);
    lk_dequantize_row(t, q, y, n);
    for (int b = 0; b < n / bs; b++) {
        float amax = 0;
        for (int j = 0; j < bs; j++) amax = fmaxf(amax, fabsf(x[bs * b + j]));
        for (int j = 0; j < bs; j++)
            CHECKF(fabsf(x[bs * b + j] - y[bs * b + j]) <= num * amax / den, "%s %d", lk_type_name(t), bs * b + j);
    }
}

TEST(quantize_roundtrip_bounds) {
    enum { N = 4096 };
    float *x = malloc(N * 4), *y = malloc(N * 4);
    uint8_t *q = malloc(N * 4 + 64);
    for (int i = 0; i < N; i++) x[i] = rnd_gauss() * (i % 97 == 0 ? 8 : 1);
    /* Q8_0: q = round(x/d), then dequantised with fp16(d): error <= d/2 plus
     * 127 * |d - fp16(d)| <= 127 * d * 2^-11; 0.57 d covers both. */
    check_block_roundtrip(LK_TYPE_Q8_0, 32, 0.57f, 127, x, y, q, N);
    /* Q4_0: step |d| = amax/8; rounding error <= |d|/2, but the side opposite
     * the max is clamped at +7 steps, so up to |d| (+ fp16 rounding of d). */
    check_block_roundtrip(LK_TYPE_Q4_0, 32, 1.01f, 8, x, y, q, N);
    /* Q8_K: d = max/127 exactly as float, error <= |d|/2 (+ float rounding). */
    check_block_roundtrip(LK_TYPE_Q8_K, 256, 0.5001f, 127, x, y, q, N);
    /* F16 / BF16: round to nearest, relative error <= 2^-11 / 2^-8 (normal range). */
    lk_quantize_row(LK_TYPE_F16, x, q, N);
    lk_dequantize_row(LK_TYPE_F16, q, y, N);
    for (int i = 0; i < N; i++) CHECK(fabsf(x[i] - y[i]) <= fabsf(x[i]) * 0x1p-11f + 0x1p-25f);
    lk_quantize_row(LK_TYPE_BF16, x, q, N);
    lk_dequantize_row(LK_TYPE_BF16, q, y, N);
    for (int i = 0; i < N; i++) CHECK(fabsf(x[i] - y[i]) <= fabsf(x[i]) * 0x1p-8f);
    lk_quantize_row(LK_TYPE_F32, x, q, N);
    lk_dequantize_row(LK_TYPE_F32, q, y, N);
    CHECK(!memcmp(x, y, N * 4));
    free(x); free(y); free(q);
}

/* Activation quantisers (and Q4_K's, whose AVX2 scale search must give the
 * reference's bytes: test_quant_kq checks those on many more blocks) of every SIMD level against the scalar reference
 * (itself checked above and against llama-quantize below): bit-identical,
 * on data with the edge cases of the reference's rules: all-zero blocks,
 * ties at .5, the largest magnitude present with both signs (the first one
 * decides the sign of Q8_K's scale), one huge element. */
TEST(quantize_levels_bit_exact) {
    enum { N = 256 * 12 };
    float *x = malloc(N * 4);
    uint8_t *ref = malloc(N * 2), *got = malloc(N * 2);
    for (int i = 0; i < N; i++) x[i] = rnd_gauss();
    for (int i = 0; i < 256; i++) x[256 + i] = 0;                 /* zero block */
    for (int i = 0; i < 256; i++) x[512 + i] = (float)(i % 11) - 5.5f; /* ties */
    x[768 + 7] = -9; x[768 + 100] = 9;                            /* +-max, first negative */
    x[1024 + 3] = 7; x[1024 + 200] = -7;                          /* +-max, first positive */
    x[1280 + 77] = 1e6f;
    for (int i = 0; i < 32; i++) x[1536 + i] = (float)i / 4 * 127.f / 7.75f; /* exact .5 after scaling */
    const lk_type ts[] = {LK_TYPE_Q8_0, LK_TYPE_Q8_K, LK_TYPE_Q4_0, LK_TYPE_F16, LK_TYPE_BF16, LK_TYPE_Q4_K};
    const char *levels[] = {"avx2", "avx512"};
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) {
        size_t rb;
        LK_ASSERT(lk_type_row_bytes(ts[k], N, &rb));
        lk_quant_set_simd("scalar");
        lk_quantize_row(ts[k], x, ref, N);
        for (int l = 0; l < 2; l++) {
            if (!lk_quant_set_simd(levels[l])) continue;
            memset(got, 0xCD, rb);
            lk_quantize_row(ts[k], x, got, N);
            CHECKF(!memcmp(ref, got, rb), "%s %s", levels[l], lk_type_name(ts[k]));
        }
    }
    lk_quant_set_simd("scalar");
    free(x); free(ref); free(got);
}

/* The activation quantiser of the matrix path (lk_quantize_row_act: Q8_0 as
 * llama.cpp's x86 code, round half to even) is bit-identical at every level
 * on the same edge cases, and distinct from the weight quantiser's rounding
 * (half away from zero) on the ties. */
TEST(act_quantize_levels_bit_exact) {
    enum { N = 32 * 70 };
    float x[N];
    uint8_t ref[N / 32 * 34], got[N / 32 * 34];
    for (int i = 0; i < N; i++) x[i] = rnd_gauss();
    for (int i = 0; i < 32; i++) x[32 + i] = 0;
    x[64] = 127; x[65] = 0.5f; x[66] = 1.5f; x[67] = -2.5f; /* scale 1: exact ties */
    x[96 + 5] = -3e5f; x[128 + 31] = 1e-30f;
    /* scales that are fp16 subnormals (block 5) or past its range (block
     * 6: inf), both in the AVX-512 code's 16-block batches and its tail */
    for (int i = 0; i < 32; i++) x[160 + i] *= 1e-4f, x[192 + i] *= 1e7f, x[N - 64 + i] *= 1e-4f, x[N - 32 + i] *= 1e7f;
    lk_quant_set_simd("scalar");
    lk_quantize_row_act(LK_TYPE_Q8_0, x, ref, N);
    uint16_t d5, d6;
    memcpy(&d5, ref + 5 * 34, 2), memcpy(&d6, ref + 6 * 34, 2);
    CHECKF(d5 > 0 && d5 < 0x400 && d6 == 0x7c00, "scales %04x %04x", d5, d6);
    const int8_t *q2 = (const int8_t *)ref + 2 * 34 + 2; /* block 2's quants */
    CHECK(q2[0] == 127 && q2[1] == 0 && q2[2] == 2 && q2[3] == -2);
    const char *levels[] = {"avx2", "avx512"};
    for (int l = 0; l < 2; l++) {
        if (!lk_quant_set_simd(levels[l])) continue;
        memset(got, 0xCD, sizeof got);
        lk_quantize_row_act(LK_TYPE_Q8_0, x, got, N);
        CHECKF(!memcmp(ref, got, sizeof got), "%s", levels[l]);
    }
    lk_quant_set_simd("scalar");
}

/* ===================================================================== */
/* Matrix kernel vs double precision                                       */

/* Random weight rows of type t: quantised types get random bytes with sane
 * fp16 scales (random bits could be NaN or huge); float types get values.
 * Also returns per-element magnitude bounds `mag` used for the tolerance:
 * an upper bound of every term that enters the float computation. */
static void random_weights(lk_type t, int64_t n, uint8_t *w, float *mag) {
    size_t rb;
    LK_ASSERT(lk_type_row_bytes(t, n, &rb));
    for (size_t i = 0; i < rb; i++) w[i] = (uint8_t)rnd_u64();
    int64_t nb = n / lk_type_block_size(t);
    size_t bb = lk_type_block_bytes(t);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *p = w + b * bb;
        float d = 0.01f * (0.5f + fabsf(rnd_unif())), dm = 0.02f * fabsf(rnd_unif());
        float m = 0;
        switch (t) {
        case LK_TYPE_Q4_0: put_h(p, rnd_unif() < 0 ? -d : d); m = d * 8; break;
        case LK_TYPE_Q8_0: put_h(p, d); m = d * 128; break;
        case LK_TYPE_Q5_0: put_h(p, rnd_unif() < 0 ? -d : d); m = d * 16; break;
        case LK_TYPE_Q5_1: put_h(p, d); put_h(p + 2, dm); m = d * 31 + dm; break;
        case LK_TYPE_Q4_K: put_h(p, d); put_h(p + 2, dm); m = d * 63 * 15 + dm * 63; break;
        case LK_TYPE_Q5_K: put_h(p, d); put_h(p + 2, dm); m = d * 63 * 31 + dm * 63; break;
        case LK_TYPE_Q6_K: put_h(p + 208, d); m = d * 128 * 32; break;
        case LK_TYPE_F32: { float v = rnd_gauss(); memcpy(p, &v, 4); m = fabsf(v); break; }
        case LK_TYPE_F16: { float v = rnd_gauss(); put_h(p, v); m = fabsf(v); break; }
        case LK_TYPE_BF16: { uint16_t h = lk_fp32_to_bf16(rnd_gauss()); memcpy(p, &h, 2);
                             m = fabsf(lk_bf16_to_fp32(h)); break; }
        default: LK_ASSERT(0);
        }
        int64_t bs = lk_type_block_size(t);
        for (int64_t j = 0; j < bs; j++) mag[b * bs + j] = m;
    }
}

static const lk_type k_wtypes[] = {LK_TYPE_F32, LK_TYPE_F16, LK_TYPE_BF16, LK_TYPE_Q8_0,
                                   LK_TYPE_Q4_0, LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K, LK_TYPE_Q5_0, LK_TYPE_Q5_1};

/* Checks lk_quant_matmul(t) on an odd-shaped problem with padded strides and
 * unaligned rows against sum_i deq(w)_i * deq(a)_i in double.
 * Tolerance: the kernel computes in float; with m float additions per output
 * (m = n for float types, 2 per block otherwise, ~4 roundings per block for
 * the scales) the worst-case error is (m + 8) * 2^-24 * S, S = sum |a_i| *
 * mag_i with mag an upper bound of every term's magnitude (including the
 * dmin*min terms that cancel in K-quants); the dequantised reference itself
 * carries 2 roundings per element. We allow 2x that bound (SIMD orders and
 * FMA differ from scalar but obey the same bound). A wrong element, scale or
 * bsum gives errors of order S / sqrt(n), far above it. */
static int check_matmul(lk_type t, int64_t n, int64_t nrows, int64_t ntok, int misalign) {
    int bad = 0;
    lk_type at = lk_type_vec_dot(t);
    size_t wrb, arb;
    LK_ASSERT(lk_type_row_bytes(t, n, &wrb) && lk_type_row_bytes(at, n, &arb));
    size_t w_stride = wrb + 3, a_stride = arb + 5, y_stride = (size_t)nrows + 3;
    uint8_t *wbuf = malloc(w_stride * (size_t)nrows + 64), *abuf = malloc(a_stride * (size_t)ntok + 64);
    uint8_t *w = wbuf + misalign, *a = abuf + misalign;
    float *mag = malloc((size_t)(n * nrows) * 4), *x = malloc((size_t)n * 4);
    float *wd = malloc((size_t)n * 4), *ad = malloc((size_t)(n * ntok) * 4);
    float *y = malloc(y_stride * (size_t)ntok * 4);
    for (int64_t r = 0; r < nrows; r++) random_weights(t, n, w + r * w_stride, mag + r * n);
    for (int64_t k = 0; k < ntok; k++) {
        for (int64_t i = 0; i < n; i++) x[i] = rnd_gauss();
        lk_quantize_row(at, x, a + k * a_stride, n);
        lk_dequantize_row(at, a + k * a_stride, ad + k * n, n);
    }
    for (size_t i = 0; i < y_stride * (size_t)ntok; i++) y[i] = -12345.f;
    lk_quant_matmul(t, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
    int64_t m = lk_type_block_size(t) == 1 ? n : 2 * n / lk_type_block_size(t);
    for (int64_t r = 0; r < nrows; r++) {
        lk_dequantize_row(t, w + r * w_stride, wd, n);
        for (int64_t k = 0; k < ntok; k++) {
            double ref = 0, S = 0;
            for (int64_t i = 0; i < n; i++) {
                ref += (double)wd[i] * ad[k * n + i];
                S += fabs((double)ad[k * n + i]) * mag[r * n + i];
            }
            double tol = 2.0 * (double)(m + 8) * 0x1p-24 * S;
            if (t == LK_TYPE_Q5_1) /* Q8_1 stores s = d*sum(q) in fp16: the min term's m*s is off by up to
                                    * |m| * |s| * 2^-11 per block, which the reference does not see */
                for (int64_t b = 0; b < n / 32; b++) {
                    double sb = 0;
                    for (int j = 0; j < 32; j++) sb += ad[k * n + b * 32 + j];
                    uint16_t hm;
                    memcpy(&hm, w + r * w_stride + (size_t)b * lk_type_block_bytes(LK_TYPE_Q5_1) + 2, 2); /* d, then m */
                    tol += 2.0 * fabs((double)lk_fp16_to_fp32(hm) * sb) * 0x1p-11;
                }
            float got = y[(size_t)k * y_stride + (size_t)r];
            if (!(fabs(got - ref) <= tol)) {
                if (bad++ < 3)
                    printf("  %s n=%lld rows=%lld ntok=%lld [%lld,%lld]: got %.8g ref %.8g tol %.3g\n",
                           lk_type_name(t), (long long)n, (long long)nrows, (long long)ntok,
                           (long long)k, (long long)r, got, ref, tol);
            }
        }
    }
    /* padding between rows of y untouched */
    for (int64_t k = 0; k < ntok; k++)
        for (size_t j = (size_t)nrows; j < y_stride; j++) bad += y[(size_t)k * y_stride + j] != -12345.f;
    free(wbuf); free(abuf); free(mag); free(x); free(wd); free(ad); free(y);
    return bad;
}

TEST(matmul_vs_double_scalar) {
    CHECK(lk_quant_set_simd("scalar"));
    for (size_t i = 0; i < sizeof k_wtypes / sizeof k_wtypes[0]; i++) {
        lk_type t = k_wtypes[i];
        CHECKF(check_matmul(t, 512, 7, 3, 1) == 0, "%s", lk_type_name(t));
        CHECKF(check_matmul(t, 256, 1, 1, 0) == 0, "%s", lk_type_name(t));
    }
}

/* Every SIMD level the CPU has, every type, shapes that exercise the
 * kernels' edges: rows not a multiple of the 4-row tiles, blocks not a
 * multiple of the 4-block groups (scalar tails), token counts 1..7 and past
 * the 64-token prefill chunk, odd strides and unaligned pointers. */
TEST(matmul_vs_double_all_levels) {
    const char *levels[] = {"scalar", "avx2", "avx512"};
    int tested = 0;
    for (int l = 0; l < 3; l++) {
        if (!lk_quant_set_simd(levels[l])) { printf("  (no %s on this CPU)\n", levels[l]); continue; }
        tested++;
        for (size_t i = 0; i < sizeof k_wtypes / sizeof k_wtypes[0]; i++) {
            lk_type t = k_wtypes[i];
            int64_t bs = lk_type_block_size(t) == 1 ? 1 : lk_type_block_size(t);
            int64_t kq = bs == 256 ? 256 : 32; /* smallest row of whole blocks */
            int64_t ns[] = {kq, kq * 7, bs == 1 ? 1024 + 7 : kq * 16, bs == 1 ? 13 : kq * 9};
            for (int k = 0; k < 4; k++)
                for (int64_t ntok = 1; ntok <= 7; ntok += (ntok < 4 ? 1 : 3)) {
                    int64_t nrows = 1 + (k * 3 + ntok) % 9;
                    CHECKF(check_matmul(t, ns[k], nrows, ntok, (int)(ntok & 3)) == 0, "%s %s n=%lld",
                           levels[l], lk_type_name(t), (long long)ns[k]);
                }
            CHECKF(check_matmul(t, kq * 2, 6, 67, 1) == 0, "%s %s ntok 67", levels[l], lk_type_name(t));
            /* long rows: decode kernels take columns in chunks (12288
             * elements for Q4_0/Q8_0) and add partial sums */
            if (kq == 32)
                CHECKF(check_matmul(t, 32 * 775, 5, 1, 2) == 0, "%s %s n=24800", levels[l], lk_type_name(t));
            /* long rows in prefill (many groups per tile, tails after them) */
            CHECKF(check_matmul(t, kq == 256 ? 256 * 41 : 32 * 331, 6, 5, 3) == 0, "%s %s long prefill",
                   levels[l], lk_type_name(t));
        }
    }
    CHECK(tested >= 1);
    lk_quant_set_simd("scalar");
}

/* The prefill GEMMs on AVX-512 (Q4_0, Q8_0, Q4_K, Q5_K from 5 tokens, Q6_K
 * from 10, F32/F16/BF16 rows of 256+ elements from 16): rows are packed 16
 * to a group and 3 (K-quants: 2, floats: 4) groups to a panel, blocks 16
 * (K-quants: super-blocks 2, floats: 128 elements) to a K block and 128
 * (16, 128) to an activation prep, tokens 4 (floats: 6) to a tile and 128 to
 * a token block. Shapes on both sides
 * of every one of those edges: partial groups and panels (1, 15, 17, 31, 33,
 * 47, 49, 172 rows), K tails (y accumulated over K blocks and preps), token
 * tails and token blocks (5..260; 17 tokens where every type takes it), on
 * every level the CPU has (the others take their own paths: still a check). */
TEST(matmul_prefill_gemm_edges) {
    const char *levels[] = {"avx512", "avx2", "scalar"};
    static const int64_t rows[] = {1, 15, 16, 17, 31, 33, 47, 49, 172};
    static const int64_t toks[] = {5, 9, 13, 17, 67, 130}; /* GEMM from 5, 10 (Q6_K), 16 (floats) */
    static const int64_t blocks[] = {1, 2, 3, 17, 130};
    static const lk_type types[] = {LK_TYPE_Q4_0, LK_TYPE_Q8_0, LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K,
                                    LK_TYPE_F16, LK_TYPE_BF16, LK_TYPE_F32};
    for (int l = 0; l < 3; l++) {
        if (!lk_quant_set_simd(levels[l])) continue;
        for (int q = 0; q < 8; q++) {
            lk_type t = types[q];
            const int64_t bs = lk_type_block_size(t);
            int i = 0;
            for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++)
                for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++, i++) {
                    int64_t nb = bs == 256 && blocks[b] == 130 ? 33 : blocks[b]; /* past 2 preps of 16 */
                    /* floats (GEMM from 256 elements): K blocks and conversions of
                     * 128 elements, tails of 16 */
                    int64_t n = bs == 1 ? 32 * nb + 263 : bs * nb, nr = rows[i % 9];
                    if (n * nr * toks[k] > 32 * 130 * 20 * 67) nr = 3; /* keep the test fast */
                    CHECKF(check_matmul(t, n, nr, toks[k], i & 3) == 0, "%s %s n=%lld rows=%lld ntok=%lld",
                           levels[l], lk_type_name(t), (long long)n, (long long)nr, (long long)toks[k]);
                }
            /* every row count around the group and panel edges, one shape */
            for (int64_t nr = 1; nr <= 50; nr += nr < 14 || nr > 40 ? 1 : 3)
                CHECKF(check_matmul(t, bs == 1 ? 263 : bs * 3, nr, 17, (int)(nr & 3)) == 0, "%s %s rows=%lld", levels[l],
                       lk_type_name(t), (long long)nr);
            /* a full token block and a tail past it, K tail past a prep */
            CHECKF(check_matmul(t, bs == 256 ? 256 * 17 : 32 * 131, 20, 260, 1) == 0, "%s %s 260 tokens",
                   levels[l], lk_type_name(t));
            if (l > 0) break; /* other levels: the Q4_0 shapes are enough */
        }
    }
    lk_quant_set_simd("scalar");
}

/* The AVX-512 level's F32 product in scalar code: per (row, token) 16
 * lanes, lane j taking elements j, j + 16, ... by fused multiply-adds from
 * zero (a short last chunk multiplies zeros in its missing lanes, which
 * turns a lane's -0 into +0 as the masked vector load does), then lane i +
 * 8 added onto lane i, then i + 4, i + 2, i + 1. */
static float f32_lanes_ref(const float *w, const float *a, int64_t n) {
    float p[16] = {0};
    for (int64_t c = 0; c < n; c += 16)
        for (int j = 0; j < 16; j++) p[j] = c + j < n ? lk_fmaf(w[c + j], a[c + j], p[j]) : lk_fmaf(0, 0, p[j]);
    for (int h = 8; h >= 1; h /= 2)
        for (int j = 0; j < h; j++) p[j] = p[j] + p[j + h];
    return p[0];
}

/* The F32 products at AVX-512, short rows (attention's scores: 16 rows'
 * sums at once) and long ones (the register tiles), every token count
 * path, against that order bit for bit: prefill's score blocks and
 * decode's head groups must agree. Signed zeros and exact cancellations
 * included. */
TEST(f32_avx512_lane_order) {
    if (!lk_quant_set_simd("avx512")) { printf("  (no avx512 on this CPU)\n"); return; }
    static const int64_t ns[] = {1, 15, 16, 17, 33, 64, 100, 128, 256, 257, 300};
    static const int64_t rows[] = {1, 7, 8, 15, 16, 17, 32, 40};
    static const int64_t toks[] = {1, 2, 3, 4, 7, 16};
    int checked = 0;
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++)
            for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++) {
                const int64_t n = ns[ni], nr = rows[ri], nt = toks[ti];
                const size_t ws = (size_t)n + 3, as = (size_t)n + 5, ys = (size_t)nr + 2; /* strides in floats */
                float *w = malloc(sizeof(float) * ws * (size_t)nr), *a = malloc(sizeof(float) * as * (size_t)nt);
                float *y = malloc(sizeof(float) * ys * (size_t)nt);
                for (size_t i = 0; i < ws * (size_t)nr; i++) w[i] = rnd_unif();
                for (size_t i = 0; i < as * (size_t)nt; i++) a[i] = rnd_unif();
                /* a row of zeros with a -0 (sums of signed zeros) and a row
                 * whose products cancel exactly */
                for (int64_t i = 0; i < n; i++) w[i] = i % 3 ? 0.0f : -0.0f;
                if (nr > 1)
                    for (int64_t i = 0; i < n; i++) w[ws + i] = i % 2 ? -w[ws + i - 1] : w[ws + i], a[i] = i % 2 ? a[i - 1] : a[i];
                lk_quant_matmul(LK_TYPE_F32, n, nr, w, ws * 4, nt, a, as * 4, y, ys);
                int bad = 0;
                for (int64_t t = 0; t < nt; t++)
                    for (int64_t r = 0; r < nr; r++) {
                        const float ref = f32_lanes_ref(w + (size_t)r * ws, a + (size_t)t * as, n);
                        bad += memcmp(&ref, &y[(size_t)t * ys + (size_t)r], 4) != 0;
                    }
                CHECKF(bad == 0, "F32 %lld x %lld, %lld tokens: %d outputs differ from the lane order", (long long)nr,
                       (long long)n, (long long)nt, bad);
                checked++;
                free(w); free(a); free(y);
            }
    printf("  %d shapes\n", checked);
    lk_quant_set_simd("scalar");
}

/* A compact problem for the bit-for-bit checks below: nrows rows of random
 * weights of type t (random_weights) and ntok activation rows quantised as
 * lk_matmul makes them, with room for two [ntok][nrows] outputs. */
typedef struct { lk_type t; int64_t n, nrows; int ntok; size_t wrb, arb; uint8_t *w, *a; float *ref, *got; } mm_case;

static mm_case mm_case_new(lk_type t, int64_t n, int64_t nrows, int ntok) {
    mm_case c = { .t = t, .n = n, .nrows = nrows, .ntok = ntok };
    const lk_type at = lk_type_vec_dot(t);
    LK_ASSERT(lk_type_row_bytes(t, n, &c.wrb) && lk_type_row_bytes(at, n, &c.arb));
    c.w = malloc(c.wrb * (size_t)nrows);
    c.a = malloc(c.arb * (size_t)ntok);
    c.ref = malloc(sizeof(float) * (size_t)nrows * (size_t)ntok);
    c.got = malloc(sizeof(float) * (size_t)nrows * (size_t)ntok);
    float *mag = malloc((size_t)n * 4), *x = malloc((size_t)n * 4);
    for (int64_t r = 0; r < nrows; r++) random_weights(t, n, c.w + (size_t)r * c.wrb, mag);
    for (int k = 0; k < ntok; k++) {
        for (int64_t i = 0; i < n; i++) x[i] = rnd_gauss();
        lk_quantize_row_act(at, x, c.a + (size_t)k * c.arb, n);
    }
    free(mag); free(x);
    return c;
}

static void mm_case_free(mm_case *c) { free(c->w); free(c->a); free(c->ref); free(c->got); }

/* The case's weights in layout rt (its file type's rows, or a new repacked
 * copy: free it when it is not c->w) */
static uint8_t *mm_case_weights(const mm_case *c, lk_type rt, int64_t n, int64_t nrows) {
    const lk_type ft = lk_type_file(rt);
    if (rt == ft) return c->w;
    uint8_t *w = malloc(c->wrb * (size_t)nrows);
    lk_quant_repack(rt, ft, n, nrows, c->w, c->wrb, w);
    return w;
}

/* y[ntok][nrows] = the case's product, in calls of `chunk` tokens (the last
 * one shorter) */
static void mm_case_run(const mm_case *c, int64_t chunk, float *y) {
    for (int64_t t0 = 0; t0 < c->ntok; t0 += chunk)
        lk_quant_matmul(c->t, c->n, c->nrows, c->w, c->wrb, LK_MIN(chunk, c->ntok - t0), c->a + (size_t)t0 * c->arb,
                        c->arb, y + (size_t)t0 * (size_t)c->nrows, (size_t)c->nrows);
}

/* Batch invariance: the engine multiplies many sequences' tokens in one call,
 * and a sequence's logits must not depend on what else is in the batch. So a
 * token's row must come out with the same bits whatever the call's token
 * count: decode (1), the small-batch tiles (2-4), the AVX-512 GEMMs (from 5,
 * 10 or 16 tokens) and their tails. Each ntok below walks the 40 tokens in
 * chunks of ntok (and a shorter last chunk), against one 40-token call.
 * Shapes: 37 rows (4-row tiles and a leftover row), Q4_0/Q8_0 rows with 3
 * blocks past the last group of 4 and rows past the AVX-512 decode's column
 * chunk (12288 elements); float rows with an odd tail and rows long enough
 * for the AVX-512 float GEMM, and for its K slabs. */
static int check_batch_invariance(lk_type t, int64_t n, int64_t nrows) {
    enum { NT = 40 };
    static const int64_t chunks[] = {1, 2, 3, 4, 5, 7, 16, 17, 33};
    mm_case c = mm_case_new(t, n, nrows, NT);
    mm_case_run(&c, NT, c.ref);
    int bad = 0;
    for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
        mm_case_run(&c, chunks[k], c.got);
        for (int64_t i = 0; i < nrows * NT; i++)
            if (memcmp(&c.got[i], &c.ref[i], sizeof(float)) && bad++ < 3)
                printf("  %s %s n=%lld ntok=%lld: token %lld row %lld is %.9g, %.9g in the 40-token call\n",
                       lk_quant_simd_name(), lk_type_name(t), (long long)n, (long long)chunks[k],
                       (long long)(i / nrows), (long long)(i % nrows), c.got[i], c.ref[i]);
    }
    mm_case_free(&c);
    return bad;
}

/* The kernels that promise the scalar reference's arithmetic for every
 * token count: Q4_0, Q8_0 and the K-quants (a block's exact integer sum,
 * then s = s + sum * (d_w * d_a) block after block) at AVX2 and AVX-512;
 * Q5_0 and Q5_1 (llama.cpp's 8-lane arithmetic, quant_q5.c) at AVX2. */
static bool scalar_order(const char *level, lk_type t) {
    const bool k = t == LK_TYPE_Q4_0 || t == LK_TYPE_Q8_0 || t == LK_TYPE_Q4_K || t == LK_TYPE_Q5_K || t == LK_TYPE_Q6_K;
    if (!strcmp(level, "avx2")) return k || t == LK_TYPE_Q5_0 || t == LK_TYPE_Q5_1;
    if (!strcmp(level, "avx512")) return k;
    return false;
}

/* Those kernels against the scalar code, bit for bit: one 40-token call of
 * the scalar level against the level's calls of 1, 3, 4, 5 and 40 tokens
 * (decode, register tiles, GEMMs and their tails); 37 rows (a partial row
 * group), rows long enough to cross the GEMMs' K blocks and panels. Rows of
 * 32-element blocks twice: 389 blocks (two of the AVX2 tiles' K blocks of
 * 256, taken in turn for each row group) and 1100 (five: past the terms
 * they hold at once, K block by K block over all groups). */
TEST(matmul_levels_scalar_order_bit_exact) {
    static const char *levels[] = {"avx2", "avx512"};
    static const int64_t chunks[] = {1, 3, 4, 5, 40};
    enum { NT = 40, NR = 37 };
    for (int l = 0; l < 2; l++) {
        if (!lk_quant_set_simd(levels[l])) { printf("  (no %s on this CPU)\n", levels[l]); continue; }
        for (size_t i = 0; i < 2 * sizeof k_wtypes / sizeof k_wtypes[0]; i++) {
            const lk_type t = k_wtypes[i / 2];
            const bool kq = lk_type_block_size(t) == 256;
            if (!scalar_order(levels[l], t) || (kq && i % 2)) continue;
            mm_case mc = mm_case_new(t, kq ? 256 * 13 : 32 * (i % 2 ? 1100 : 389), NR, NT);
            CHECK(lk_quant_set_simd("scalar"));
            mm_case_run(&mc, NT, mc.ref);
            CHECK(lk_quant_set_simd(levels[l]));
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                memset(mc.got, 0xff, sizeof(float) * NR * NT);
                mm_case_run(&mc, chunks[c], mc.got);
                int bad = 0;
                for (int e = 0; e < NR * NT; e++) bad += memcmp(&mc.got[e], &mc.ref[e], sizeof(float)) != 0;
                CHECKF(bad == 0, "%s %s x %lld, calls of %lld tokens: %d of %d outputs differ from scalar's",
                       levels[l], lk_type_name(t), (long long)mc.n, (long long)chunks[c], bad, NR * NT);
            }
            mm_case_free(&mc);
        }
    }
    lk_quant_set_simd("scalar");
}

/* Q4_0_R16, Q8_0_R16, Q4_K_R16, Q5_K_R16 and Q6_K_R16, the layouts made at load: lk_quant_repack then
 * lk_quant_unrepack_row give each file row back byte for byte, and at
 * every level a call on the repacked matrix gives the scalar call's bits on
 * the file's rows, for 1-40 tokens (the rows kernel, past its 16 tokens at
 * once too, its tiles inside the row groups and outside, the GEMM and
 * its tails), on row ranges that start at multiples of 16 (as the kernels part
 * splits them) with file rows past the last whole group, on rows of an odd
 * block count (a block without a pair; groups not 64-byte aligned), rows
 * past the GEMM's K blocks and the rows kernel's column chunk (256 blocks;
 * K-quants: 16 super-blocks), two and three of them (the last partial:
 * with the tiles inside the groups, each group's chunks in turn).
 * The choice to repack: Q4_0, Q8_0, Q4_K, Q5_K and Q6_K with 16+ rows where
 * a kernel reads the layout (the K-quants by default on AMD CPUs only;
 * LK_REPACK=all everywhere), never other types or with LK_REPACK=0. */
TEST(repacked_same_bits_as_file_rows) {
    static const char *levels[] = {"scalar", "avx2", "avx512"};
    static const int64_t chunks[] = {1, 2, 3, 4, 5, 9, 16, 20, 31, 40};
    static const struct { int64_t nb, nrows; } shapes[] = {{7, 53}, {64, 48}, {389, 37}, {1, 16}, {600, 35}},
                                               kshapes[] = {{7, 53}, {16, 48}, {33, 37}, {1, 16}, {40, 35}};
    static const lk_type rts[] = {LK_TYPE_Q4_0_R16, LK_TYPE_Q8_0_R16, LK_TYPE_Q4_K_R16, LK_TYPE_Q5_K_R16,
                                  LK_TYPE_Q6_K_R16};
    enum { NT = 40 };
    for (size_t ri = 0; ri < sizeof rts / sizeof rts[0]; ri++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const lk_type rt = rts[ri], ft = lk_type_file(rt);
        const bool kq = lk_type_block_size(rt) == 256;
        const int64_t n = lk_type_block_size(rt) * (kq ? kshapes : shapes)[si].nb, nrows = (kq ? kshapes : shapes)[si].nrows;
        CHECK(ft != rt && lk_type_vec_dot(rt) == lk_type_vec_dot(ft));
        CHECK(lk_quant_set_simd("scalar"));
        mm_case mc = mm_case_new(ft, n, nrows, NT);
        mm_case_run(&mc, NT, mc.ref);
        uint8_t *rp = malloc(mc.wrb * (size_t)nrows), *row = malloc(mc.wrb);
        lk_quant_repack(rt, ft, n, nrows, mc.w, mc.wrb, rp);
        int back = 0;
        for (int64_t r = 0; r < nrows / 16 * 16; r++) {
            lk_quant_unrepack_row(rt, n, rp, mc.wrb, r, row);
            back += memcmp(row, mc.w + (size_t)r * mc.wrb, mc.wrb) != 0;
        }
        CHECKF(back == 0, "%s %lld x %lld: %d rows not given back by unrepack", lk_type_name(rt), (long long)nrows,
               (long long)n, back);
        CHECKF(!memcmp(rp + (size_t)(nrows / 16 * 16) * mc.wrb, mc.w + (size_t)(nrows / 16 * 16) * mc.wrb,
                       (size_t)(nrows % 16) * mc.wrb), "%s: the rows past the last whole group are not the file's",
               lk_type_name(rt));
        /* the rows kernels' two orders (lk_quant_set_rows_inner): tiles
         * inside each group, and one pass per tile */
        for (int l = 0; l < 3 * 2; l++) {
            if (!lk_quant_set_simd(levels[l / 2])) continue;
            lk_quant_set_rows_inner(l % 2 ? 0 : INT64_MAX);
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                memset(mc.got, 0xff, sizeof(float) * (size_t)nrows * NT);
                for (int64_t t0 = 0; t0 < NT; t0 += chunks[c]) {
                    const int64_t tn = LK_MIN(chunks[c], NT - t0);
                    /* two row ranges, the second from row 16 (when there is one) */
                    const int64_t cut = nrows > 16 ? 16 : nrows;
                    float *y = mc.got + (size_t)t0 * (size_t)nrows;
                    const uint8_t *a = mc.a + (size_t)t0 * mc.arb;
                    lk_quant_matmul(rt, n, cut, rp, mc.wrb, tn, a, mc.arb, y, (size_t)nrows);
                    if (cut < nrows)
                        lk_quant_matmul(rt, n, nrows - cut, rp + (size_t)cut * mc.wrb, mc.wrb, tn, a, mc.arb, y + cut,
                                        (size_t)nrows);
                }
                int bad = 0;
                for (int64_t e = 0; e < nrows * NT; e++) bad += memcmp(&mc.got[e], &mc.ref[e], sizeof(float)) != 0;
                CHECKF(bad == 0, "%s %s %lld x %lld (tiles %s the groups), calls of %lld tokens: %d of %lld outputs "
                       "differ from scalar %s's", levels[l / 2], lk_type_name(rt), (long long)nrows, (long long)n,
                       l % 2 ? "inside" : "outside", (long long)chunks[c], bad, (long long)(nrows * NT),
                       lk_type_name(ft));
            }
        }
        lk_quant_set_rows_inner(-1);
        free(rp); free(row);
        mm_case_free(&mc);
    }
    /* the choice */
    CHECK(lk_quant_set_simd("scalar"));
    CHECK(lk_type_repacked(LK_TYPE_Q4_0, 4096) == LK_TYPE_Q4_0);
    CHECK(lk_type_repacked(LK_TYPE_Q8_0, 4096) == LK_TYPE_Q8_0);
    if (lk_quant_set_simd("avx512")) {
        setenv("LK_REPACK", "all", 1); /* the K-quants by default only on AMD CPUs (quant.c) */
        CHECK(lk_type_repacked(LK_TYPE_Q4_0, 4096) == LK_TYPE_Q4_0_R16);
        CHECK(lk_type_repacked(LK_TYPE_Q8_0, 4096) == LK_TYPE_Q8_0_R16);
        CHECK(lk_type_repacked(LK_TYPE_Q4_0, 15) == LK_TYPE_Q4_0);
        CHECK(lk_type_repacked(LK_TYPE_Q4_K, 4096) == LK_TYPE_Q4_K_R16);
        CHECK(lk_type_repacked(LK_TYPE_Q5_K, 4096) == LK_TYPE_Q5_K_R16);
        CHECK(lk_type_repacked(LK_TYPE_Q6_K, 4096) == LK_TYPE_Q6_K_R16);
        CHECK(lk_type_repacked(LK_TYPE_Q6_K, 8) == LK_TYPE_Q6_K);
        CHECK(lk_type_repacked(LK_TYPE_Q3_K, 4096) == LK_TYPE_Q3_K);
        unsetenv("LK_REPACK");
        CHECK(lk_type_repacked(LK_TYPE_Q4_0, 4096) == LK_TYPE_Q4_0_R16);
        setenv("LK_REPACK", "0", 1);
        CHECK(lk_type_repacked(LK_TYPE_Q4_0, 4096) == LK_TYPE_Q4_0);
        CHECK(lk_type_repacked(LK_TYPE_Q4_K, 4096) == LK_TYPE_Q4_K);
        unsetenv("LK_REPACK");
    }
    lk_quant_set_simd("scalar");
}

/* The case's tokens through rp, its weights repacked as rt, in calls of
 * `chunk` tokens, each call on the first 16 rows and on the rest apart (row
 * ranges that start at multiples of 16), into c->got: how many outputs
 * differ from c->ref, bit for bit */
static int r16_calls_differ(const mm_case *c, lk_type rt, const uint8_t *rp, int64_t chunk) {
    const int64_t n = c->n, nrows = c->nrows, nt = c->ntok, cut = nrows > 16 ? 16 : nrows;
    memset(c->got, 0xff, sizeof(float) * (size_t)nrows * (size_t)nt);
    for (int64_t t0 = 0; t0 < nt; t0 += chunk) {
        const int64_t tn = LK_MIN(chunk, nt - t0);
        float *y = c->got + (size_t)t0 * (size_t)nrows;
        const uint8_t *a = c->a + (size_t)t0 * c->arb;
        lk_quant_matmul(rt, n, cut, rp, c->wrb, tn, a, c->arb, y, (size_t)nrows);
        if (cut < nrows)
            lk_quant_matmul(rt, n, nrows - cut, rp + (size_t)cut * c->wrb, c->wrb, tn, a, c->arb, y + cut, (size_t)nrows);
    }
    int bad = 0;
    for (int64_t e = 0; e < nrows * nt; e++) bad += memcmp(&c->got[e], &c->ref[e], sizeof(float)) != 0;
    return bad;
}

/* F16_R16, made at load from F16 rows, has an arithmetic of its own: each
 * row's products fused into one fp32 sum from element 0 on. At every level
 * and for every token count (1-40 tokens in calls of 1..40: the decode
 * tiles of 4 groups, the 2 x 12 tiles and their tails; 100 rows: 4, 2 and
 * 1 groups a step), on row ranges that start at multiples of 16, a call on
 * the repacked matrix gives bit for bit the fmaf loop below on its whole
 * groups, and the level's own F16
 * rows' bits on the rows past them, with the activations widened per call
 * and (AVX-512) once as terms; unrepack gives the rows back; the choice:
 * F16 with 16+ rows on AVX-512 only. */
TEST(f16_r16_sums_in_order) {
    static const char *levels[] = {"scalar", "avx2", "avx512"};
    static const int64_t chunks[] = {1, 2, 3, 4, 5, 12, 13, 25, 40};
    static const struct { int64_t n, nrows; } shapes[] = {{7, 53}, {64, 48}, {389, 37}, {1, 16}, {2048, 32}, {389, 100}};
    enum { NT = 40 };
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t n = shapes[si].n, nrows = shapes[si].nrows, full = nrows / 16 * 16;
        CHECK(lk_quant_set_simd("scalar"));
        mm_case mc = mm_case_new(LK_TYPE_F16, n, nrows, NT);
        uint8_t *rp = malloc(mc.wrb * (size_t)nrows), *row = malloc(mc.wrb);
        lk_quant_repack(LK_TYPE_F16_R16, LK_TYPE_F16, n, nrows, mc.w, mc.wrb, rp);
        int back = 0;
        for (int64_t r = 0; r < full; r++) {
            lk_quant_unrepack_row(LK_TYPE_F16_R16, n, rp, mc.wrb, r, row);
            back += memcmp(row, mc.w + (size_t)r * mc.wrb, mc.wrb) != 0;
        }
        CHECKF(back == 0, "f16_r16 %lld x %lld: %d rows not given back by unrepack", (long long)nrows, (long long)n, back);
        /* the whole groups' sums, from the file's rows */
        for (int64_t t = 0; t < NT; t++)
            for (int64_t r = 0; r < full; r++) {
                float acc = 0;
                for (int64_t k = 0; k < n; k++)
                    acc = fmaf(lk_fp16_to_fp32(lk_ld_u16(mc.w + (size_t)r * mc.wrb + 2 * (size_t)k)),
                               lk_fp16_to_fp32(lk_ld_u16(mc.a + (size_t)t * mc.arb + 2 * (size_t)k)), acc);
                mc.ref[t * nrows + r] = acc;
            }
        for (int l = 0; l < 3; l++) {
            if (!lk_quant_set_simd(levels[l])) continue;
            /* the rows past the groups: the level's F16 rows */
            for (int64_t t = 0; t < NT && full < nrows; t++)
                lk_quant_matmul(LK_TYPE_F16, n, nrows - full, mc.w + (size_t)full * mc.wrb, mc.wrb, 1,
                                mc.a + (size_t)t * mc.arb, mc.arb, mc.ref + t * nrows + full, 1);
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                const int bad = r16_calls_differ(&mc, LK_TYPE_F16_R16, rp, chunks[c]);
                CHECKF(bad == 0, "%s f16_r16 %lld x %lld, calls of %lld tokens: %d of %lld outputs differ from the "
                       "in-order fused sums", levels[l], (long long)nrows, (long long)n, (long long)chunks[c], bad,
                       (long long)(nrows * NT));
            }
            /* the widened activations as terms (lk_act_terms, LK_TERMS_WIDE), made
             * once per call group: the same bits; a changed value changes them */
            const int32_t k = lk_quant_terms_k(LK_TYPE_F16_R16);
            CHECK(k == (l == 2 ? LK_TERMS_WIDE : 0));
            if (!k) continue;
            float *mem = malloc(lk_act_terms_bytes(k, n, NT) + sizeof(float));
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++)
            for (int variant = 0; variant < 2; variant++) {
                memset(mc.got, 0xff, sizeof(float) * (size_t)nrows * NT);
                for (int64_t t0 = 0; t0 < NT; t0 += chunks[c]) {
                    const int64_t tn = LK_MIN(chunks[c], NT - t0), cut = nrows > 16 ? 16 : nrows;
                    lk_act_terms T;
                    lk_act_terms_init(&T, k, n, tn, mem + 1); /* not 64-byte aligned */
                    const uint8_t *a = mc.a + (size_t)t0 * mc.arb;
                    for (int64_t t = 0; t < tn; t++) lk_act_terms_rows(&T, t, t + 1, a + (size_t)t * mc.arb, 0, n);
                    if (variant) T.wide[0] += 1;
                    float *y = mc.got + (size_t)t0 * (size_t)nrows;
                    lk_quant_matmul_terms(LK_TYPE_F16_R16, n, cut, rp, mc.wrb, tn, a, mc.arb, &T, y, (size_t)nrows);
                    if (cut < nrows)
                        lk_quant_matmul_terms(LK_TYPE_F16_R16, n, nrows - cut, rp + (size_t)cut * mc.wrb, mc.wrb, tn, a,
                                              mc.arb, &T, y + cut, (size_t)nrows);
                }
                int bad = 0;
                for (int64_t e = 0; e < nrows * NT; e++) bad += memcmp(&mc.got[e], &mc.ref[e], sizeof(float)) != 0;
                CHECKF(variant ? bad > 0 : bad == 0, "f16_r16 %lld x %lld, calls of %lld tokens with %s widened "
                       "terms: %d of %lld outputs differ from the in-order fused sums", (long long)nrows, (long long)n,
                       (long long)chunks[c], variant ? "changed" : "the", bad, (long long)(nrows * NT));
            }
            free(mem);
        }
        free(rp); free(row);
        mm_case_free(&mc);
    }
    CHECK(lk_quant_set_simd("scalar"));
    CHECK(lk_type_repacked(LK_TYPE_F16, 4096) == LK_TYPE_F16);
    CHECK(lk_type_file(LK_TYPE_F16_R16) == LK_TYPE_F16 && lk_type_vec_dot(LK_TYPE_F16_R16) == LK_TYPE_F16);
    CHECK(!lk_type_supported(LK_TYPE_F16_R16) && lk_type_block_bytes(LK_TYPE_F16_R16) == 2);
    if (lk_quant_set_simd("avx512")) {
        CHECK(lk_type_repacked(LK_TYPE_F16, 4096) == LK_TYPE_F16_R16);
        CHECK(lk_type_repacked(LK_TYPE_F16, 15) == LK_TYPE_F16);
        setenv("LK_REPACK", "0", 1);
        CHECK(lk_type_repacked(LK_TYPE_F16, 4096) == LK_TYPE_F16);
        unsetenv("LK_REPACK");
    }
    lk_quant_set_simd("scalar");
}

/* One step of vdpbf16ps's lane as Intel's SDM and AMD's manual write it:
 * c + x y in one rounding (nearest even), subnormal inputs read as zeros, a
 * subnormal result written as a zero of its sign */
static float vdp_lane(uint16_t xb, uint16_t yb, float c) {
    float x = lk_bf16_to_fp32(xb), y = lk_bf16_to_fp32(yb);
    if (fpclassify(x) == FP_SUBNORMAL) x = copysignf(0.0f, x);
    if (fpclassify(y) == FP_SUBNORMAL) y = copysignf(0.0f, y);
    if (fpclassify(c) == FP_SUBNORMAL) c = copysignf(0.0f, c);
    const float s = fmaf(x, y, c);
    return fpclassify(s) == FP_SUBNORMAL ? copysignf(0.0f, s) : s;
}

/* BF16_R16, made at load from BF16 rows on CPUs with AVX512_BF16 and
 * without AMX-BF16, has vdpbf16ps's arithmetic in each row's lane: the sum
 * from zero, pair (2j, 2j + 1) by pair, element 2j + 1 first, an odd last
 * element as a pair with a zero. At every level and for every token count
 * (1-40 tokens in calls of 1..40: the decode tiles of 4 groups, the 2 x 12
 * tiles and their tails; 100 rows: 4, 2 and 1 groups a step), on row ranges
 * that start at multiples of 16, a call on the repacked matrix gives that
 * lane's bits on its whole groups,
 * computed here from the file's rows, and the level's own BF16 rows' bits
 * on the rows past them; unrepack gives the rows back. One shape holds
 * products below fp32's normal range and subnormal weights, where a lane
 * that did not flush them would differ. The choice: BF16 with 16+ rows
 * where the kernel is, never at the other levels. */
TEST(bf16_r16_sums_by_pairs) {
    static const char *levels[] = {"scalar", "avx2", "avx512"};
    static const int64_t chunks[] = {1, 2, 3, 4, 5, 12, 13, 25, 40};
    static const struct { int64_t n, nrows; bool tiny; } shapes[] = {
        {7, 53, false}, {64, 48, false}, {389, 37, false}, {1, 16, false}, {2048, 32, false}, {389, 100, false},
        {130, 32, true}};
    enum { NT = 40 };
    int kernels = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t n = shapes[si].n, nrows = shapes[si].nrows, full = nrows / 16 * 16;
        CHECK(lk_quant_set_simd("scalar"));
        mm_case mc = mm_case_new(LK_TYPE_BF16, n, nrows, NT);
        if (shapes[si].tiny) {
            /* token 0: every element 2^-64; row 0: 2^-64 times random
             * signs (products 2^-128, subnormal); row 1: subnormal bf16
             * weights; row 2's odd elements 2^-100 */
            for (int64_t k = 0; k < n; k++) {
                const uint16_t v = 0x1F80;
                memcpy(mc.a + 2 * (size_t)k, &v, 2);
                const uint16_t w0 = (uint16_t)(0x1F80 | (rand() & 1 ? 0x8000 : 0)), w1 = (uint16_t)(1 + rand() % 127);
                memcpy(mc.w + 2 * (size_t)k, &w0, 2);
                memcpy(mc.w + mc.wrb + 2 * (size_t)k, &w1, 2);
                if (k & 1) {
                    const uint16_t w2 = 0x0D80;
                    memcpy(mc.w + 2 * mc.wrb + 2 * (size_t)k, &w2, 2);
                }
            }
        }
        uint8_t *rp = malloc(mc.wrb * (size_t)nrows), *row = malloc(mc.wrb);
        lk_quant_repack(LK_TYPE_BF16_R16, LK_TYPE_BF16, n, nrows, mc.w, mc.wrb, rp);
        int back = 0;
        for (int64_t r = 0; r < nrows; r++) {
            if (r < full) lk_quant_unrepack_row(LK_TYPE_BF16_R16, n, rp, mc.wrb, r, row);
            else memcpy(row, rp + (size_t)r * mc.wrb, mc.wrb);
            back += memcmp(row, mc.w + (size_t)r * mc.wrb, mc.wrb) != 0;
        }
        CHECKF(back == 0, "bf16_r16 %lld x %lld: %d rows not given back", (long long)nrows, (long long)n, back);
        /* the whole groups' sums, from the file's rows */
        for (int64_t t = 0; t < NT; t++)
            for (int64_t r = 0; r < full; r++) {
                const uint8_t *wr = mc.w + (size_t)r * mc.wrb, *at = mc.a + (size_t)t * mc.arb;
                float acc = 0;
                for (int64_t j = 0; 2 * j < n; j++) {
                    const bool pair = 2 * j + 1 < n;
                    acc = vdp_lane(pair ? lk_ld_u16(wr + 4 * (size_t)j + 2) : 0, pair ? lk_ld_u16(at + 4 * (size_t)j + 2) : 0,
                                   acc);
                    acc = vdp_lane(lk_ld_u16(wr + 4 * (size_t)j), lk_ld_u16(at + 4 * (size_t)j), acc);
                }
                mc.ref[t * nrows + r] = acc;
            }
        if (shapes[si].tiny) /* the flushed rows of token 0 */
            CHECK(mc.ref[0] == 0 && mc.ref[1] == 0 && mc.ref[2] != 0);
        for (int l = 0; l < 3; l++) {
            if (!lk_quant_set_simd(levels[l])) continue;
            kernels += lk_type_repacked(LK_TYPE_BF16, 4096) == LK_TYPE_BF16_R16;
            /* the rows past the groups: the level's BF16 rows */
            for (int64_t t = 0; t < NT && full < nrows; t++)
                lk_quant_matmul(LK_TYPE_BF16, n, nrows - full, mc.w + (size_t)full * mc.wrb, mc.wrb, 1,
                                mc.a + (size_t)t * mc.arb, mc.arb, mc.ref + t * nrows + full, 1);
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                const int bad = r16_calls_differ(&mc, LK_TYPE_BF16_R16, rp, chunks[c]);
                CHECKF(bad == 0, "%s bf16_r16 %lld x %lld%s, calls of %lld tokens: %d of %lld outputs differ from "
                       "vdpbf16ps's lane", levels[l], (long long)nrows, (long long)n, shapes[si].tiny ? " (tiny)" : "",
                       (long long)chunks[c], bad, (long long)(nrows * NT));
            }
            CHECK(lk_quant_terms_k(LK_TYPE_BF16_R16) == 0);
        }
        free(rp); free(row);
        mm_case_free(&mc);
    }
    const uint32_t feat = lk_cpu()->feat;
    const bool want = (feat & LK_CPU_AVX512BF16) && !(feat & LK_CPU_AMXBF16) && lk_quant_set_simd("avx512");
    printf("  the AVX512_BF16 kernel %s\n", want ? "tested" : "not on this CPU (the scalar code at every level)");
    CHECK(kernels == (want ? (int)(sizeof shapes / sizeof shapes[0]) : 0));
    CHECK(lk_quant_set_simd("scalar"));
    CHECK(lk_type_repacked(LK_TYPE_BF16, 4096) == LK_TYPE_BF16);
    CHECK(lk_type_file(LK_TYPE_BF16_R16) == LK_TYPE_BF16 && lk_type_vec_dot(LK_TYPE_BF16_R16) == LK_TYPE_BF16);
    CHECK(!lk_type_supported(LK_TYPE_BF16_R16) && lk_type_block_bytes(LK_TYPE_BF16_R16) == 2);
    if (want) {
        CHECK(lk_quant_set_simd("avx512"));
        CHECK(lk_type_repacked(LK_TYPE_BF16, 15) == LK_TYPE_BF16);
        setenv("LK_REPACK", "0", 1);
        CHECK(lk_type_repacked(LK_TYPE_BF16, 4096) == LK_TYPE_BF16);
        unsetenv("LK_REPACK");
    }
    lk_quant_set_simd("scalar");
}

/* F16 and BF16 rows (weights, and the activations of F16/BF16 weights) at
 * every level against the scalar converters, value by value: rounding ties,
 * subnormal halves, the largest finite values and the first that overflow,
 * infinities, zeros of both signs, fp32 denormals, and NaNs with payloads
 * (the SIMD code must give the scalar code's quiet NaN), at positions inside
 * and past the 8- and 16-value groups. */
/* The activations' terms (lk_act_terms): the AVX-512 Q4_0 / Q8_0 kernels
 * read them, computed once per matrix, instead of deriving them per call;
 * the products must be the same bits as without them (the scalar level's),
 * for every token count (rows kernel and GEMM), K blocks of the terms'
 * layout (389 blocks: two, the last partial; 600: three), row ranges that
 * start past row 0, file rows and repacked, with the rows kernel's token
 * tiles outside the row groups and inside (lk_quant_set_rows_inner: each
 * group's K blocks in turn, the terms of all of them at once). Terms for
 * the other offset are ignored (same bits), and wrong terms for the right
 * offset change the result: the kernels do read them. */
TEST(matmul_terms_same_bits) {
    static const int64_t chunks[] = {1, 2, 5, 6, 16, 20, 31, 32, 40};
    static const struct { int64_t nb, nrows; } shapes[] = {{7, 53}, {64, 48}, {389, 37}, {600, 35}};
    static const lk_type types[] = {LK_TYPE_Q4_0, LK_TYPE_Q8_0, LK_TYPE_Q4_0_R16, LK_TYPE_Q8_0_R16};
    enum { NT = 40 };
    int read = 0;
    for (int inner = 0; inner < 2; inner++)
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        lk_quant_set_rows_inner(inner ? 0 : -1);
        const lk_type rt = types[ti], ft = lk_type_file(rt);
        const int64_t n = 32 * shapes[si].nb, nrows = shapes[si].nrows;
        CHECK(lk_quant_set_simd("scalar"));
        CHECK(lk_quant_terms_k(rt) == 0);
        mm_case mc = mm_case_new(ft, n, nrows, NT);
        mm_case_run(&mc, NT, mc.ref);
        uint8_t *w = mm_case_weights(&mc, rt, n, nrows);
        if (!lk_quant_set_simd("avx512")) { mm_case_free(&mc); if (w != mc.w) free(w); continue; }
        const int32_t k = lk_quant_terms_k(rt);
        CHECKF(k == (lk_type_file(rt) == LK_TYPE_Q8_0 ? 128 : 8), "%s: terms for offset %d", lk_type_name(rt), k);
        uint8_t *mem = malloc(lk_act_terms_bytes(8, n, NT));
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++)
        for (int variant = 0; variant < 3; variant++) { /* right terms, the other offset's, wrong ones */
            memset(mc.got, 0xff, sizeof(float) * (size_t)nrows * NT);
            for (int64_t t0 = 0; t0 < NT; t0 += chunks[c]) {
                const int64_t tn = LK_MIN(chunks[c], NT - t0);
                lk_act_terms T = { .d = (float *)mem, .corr = (int32_t *)(mem + lk_act_terms_bytes(8, n, tn) / 2),
                                   .ntok = tn, .k = variant == 1 ? 136 - k : k };
                const uint8_t *a = mc.a + (size_t)t0 * mc.arb;
                for (int64_t t = 0; t < tn; t++) lk_act_terms_rows(&T, t, t + 1, a + (size_t)t * mc.arb, 0, n);
                if (variant == 2) T.corr[0] += 1, T.d[0] *= 2; /* AMX reads only the scales */
                /* two row ranges, the second from row 16 */
                float *y = mc.got + (size_t)t0 * (size_t)nrows;
                lk_quant_matmul_terms(rt, n, 16, w, mc.wrb, tn, a, mc.arb, &T, y, (size_t)nrows);
                lk_quant_matmul_terms(rt, n, nrows - 16, w + 16 * mc.wrb, mc.wrb, tn, a, mc.arb, &T, y + 16,
                                      (size_t)nrows);
            }
            int bad = 0;
            for (int64_t e = 0; e < nrows * NT; e++) bad += memcmp(&mc.got[e], &mc.ref[e], sizeof(float)) != 0;
            if (variant == 2) {
                /* token 0's first block is every call's at ntok 40, only the first call's otherwise;
                 * decode of file rows (1 token) reads no terms */
                const bool reads = !(chunks[c] == 1 && rt == ft);
                CHECKF(reads ? bad > 0 : bad == 0, "%s %lld x %lld, calls of %lld tokens: wrong terms changed %d outputs",
                       lk_type_name(rt), (long long)nrows, (long long)n, (long long)chunks[c], bad);
                read += bad > 0;
            } else
                CHECKF(bad == 0, "%s %lld x %lld, calls of %lld tokens, tiles %s the groups, terms for offset %s: %d of "
                       "%lld outputs differ from the scalar level's", lk_type_name(rt), (long long)nrows, (long long)n,
                       (long long)chunks[c], inner ? "inside" : "outside", variant ? "other" : "right", bad,
                       (long long)(nrows * NT));
        }
        free(mem);
        if (w != mc.w) free(w);
        mm_case_free(&mc);
    }
    printf("  wrong terms read in %d cases\n", read);
    lk_quant_set_rows_inner(-1);
    lk_quant_set_simd("scalar");
}

/* BF16 through AMX-BF16 tiles (lk_quant_bf16_amx): the emulated tile
 * instructions against a scalar sum in their documented order, bit for
 * bit, and the real ones (where the CPU has them) against themselves: every
 * way of cutting the same product (one token a call as decode, 17 tokens,
 * all at once; rows from 0 and from 16) gives the same bits, which are
 * within fp32 summation error of a double reference. Shapes past every
 * blocking of the kernel: K chunks of 2048 (4133 elements: 3 chunks, the
 * last step 5 elements), row blocks of 256 in pairs of 16-row groups (300
 * rows: a block of 44, a pair of 16 + 12), token blocks of 64 in tiles of
 * 16 (70 tokens; emulated: 2100 x 270 x 20), and small ones. */
static float bx_ftz_ref(float x) { return fabsf(x) < 0x1p-126f ? 0.0f * x : x; }
TEST(bf16_amx) {
    static const struct { int64_t n, nrows, nt; } shapes[] = {
        {4133, 300, 70}, {2100, 270, 20}, {64, 16, 3}, {33, 5, 17}, {2048, 37, 40}};
    const bool hw = (lk_cpu()->feat & LK_CPU_AMXBF16) != 0;
    if (!lk_quant_set_simd("avx512")) { printf("  (no avx512 on this CPU)\n"); return; }
    if (!hw) printf("  (no AMX-BF16 on this CPU: the emulated tiles only)\n");
    for (int mode = 0; mode < (hw ? 2 : 1); mode++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t n = shapes[si].n, nrows = shapes[si].nrows, nt = shapes[si].nt;
        if (mode == 0 && n * nrows * nt > 20000000) continue; /* emulated: the second case covers the same blocks */
        const bool emu = mode == 0;
        uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(n * nrows)), *a = malloc(sizeof(uint16_t) * (size_t)(n * nt));
        for (int64_t i = 0; i < n * nrows; i++) w[i] = lk_fp32_to_bf16(rnd_gauss());
        for (int64_t i = 0; i < n * nt; i++) a[i] = lk_fp32_to_bf16(rnd_gauss());
        float *want = malloc(sizeof(float) * (size_t)(nrows * nt)), *got = malloc(sizeof(float) * (size_t)(nrows * nt));
        double worst = 0;
        for (int64_t t = 0; t < nt; t++)
            for (int64_t r = 0; r < nrows; r++) {
                float s = 0;
                for (int64_t k = 0; k < (n + 31) / 32 * 32; k++) {
                    const float x = k < n ? lk_bf16_to_fp32(w[r * n + k]) : 0, z = k < n ? lk_bf16_to_fp32(a[t * n + k]) : 0;
                    s = bx_ftz_ref(s + bx_ftz_ref(x) * bx_ftz_ref(z));
                }
                want[t * nrows + r] = s;
            }
        /* calls of 1 and 17 tokens, all at once, and all at once reading
         * the activations' tiles made once for the matrix (LK_TERMS_TILES,
         * their memory poisoned first: a step past n not zeroed is NaN) */
        static const int64_t chunks[] = {1, 17, 0, -1};
        lk_act_terms T;
        uint8_t *tmem = malloc(lk_act_terms_bytes(LK_TERMS_TILES, n, nt));
        memset(tmem, 0xff, lk_act_terms_bytes(LK_TERMS_TILES, n, nt));
        lk_act_terms_init(&T, LK_TERMS_TILES, n, nt, tmem);
        const int64_t mid = nt / 3; /* two ranges, the first ending inside a tile */
        lk_act_terms_rows(&T, 0, mid, a, (size_t)n * 2, n);
        lk_act_terms_rows(&T, mid, nt, a + mid * n, (size_t)n * 2, n);
        int dirty = 0; /* the tokens the last tile lacks: zeros */
        for (int64_t s = 0; nt % 16 && s < (n + 31) / 32; s++)
            for (int kk = 0; kk < 16; kk++)
                for (int c = (int)(4 * (nt % 16)); c < 64; c++)
                    dirty += tmem[((size_t)(nt / 16) * (size_t)((n + 31) / 32) + (size_t)s) * 1024 + 64 * kk + c] != 0;
        CHECKF(dirty == 0, "%lld x %lld tokens' tiles: %d bytes of absent tokens not zero", (long long)n, (long long)nt,
               dirty);
        { /* the same tiles made by parts (lk_act_terms_part, as threads do), into poisoned memory */
            const size_t tb = lk_act_terms_bytes(LK_TERMS_TILES, n, nt);
            uint8_t *pmem = malloc(tb);
            memset(pmem, 0xff, tb);
            lk_act_terms P;
            lk_act_terms_init(&P, LK_TERMS_TILES, n, nt, pmem);
            CHECK(!lk_act_terms_by_token(LK_TERMS_TILES));
            for (int part = 0; part < 3; part++) lk_act_terms_part(&P, part, 3, a, (size_t)n * 2, n);
            CHECKF(memcmp(pmem, tmem, tb) == 0, "%lld x %lld tokens' tiles by parts differ from by token ranges",
                   (long long)n, (long long)nt);
            free(pmem);
        }
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            const int64_t chunk = chunks[c] > 0 ? chunks[c] : nt;
            const lk_act_terms *tp = chunks[c] < 0 ? &T : NULL;
            memset(got, 0xff, sizeof(float) * (size_t)(nrows * nt));
            for (int64_t t0 = 0; t0 < nt; t0 += chunk) {
                const int64_t tn = LK_MIN(chunk, nt - t0), cut = nrows > 16 ? 16 : nrows;
                lk_quant_bf16_amx(emu, n, cut, w, (size_t)n * 2, tn, a + t0 * n, (size_t)n * 2, tp, got + t0 * nrows,
                                  (size_t)nrows);
                if (cut < nrows)
                    lk_quant_bf16_amx(emu, n, nrows - cut, w + cut * n, (size_t)n * 2, tn, a + t0 * n, (size_t)n * 2,
                                      tp, got + t0 * nrows + cut, (size_t)nrows);
            }
            if (!emu && c == 0) { /* the real tiles' own bits: decode's are the reference for the rest */
                for (int64_t t = 0; t < nt; t++)
                    for (int64_t r = 0; r < nrows; r++) {
                        double d = 0, mag = 0;
                        for (int64_t k = 0; k < n; k++) {
                            const double p = (double)lk_bf16_to_fp32(w[r * n + k]) * lk_bf16_to_fp32(a[t * n + k]);
                            d += p, mag += fabs(p);
                        }
                        const double e = fabs(got[t * nrows + r] - d) / mag;
                        worst = e > worst ? e : worst;
                    }
                memcpy(want, got, sizeof(float) * (size_t)(nrows * nt));
            }
            int bad = 0;
            for (int64_t e = 0; e < nrows * nt; e++) bad += memcmp(&got[e], &want[e], sizeof(float)) != 0;
            CHECKF(bad == 0, "%s tiles, %lld x %lld, %lld tokens in calls of %lld%s: %d of %lld outputs differ from %s",
                   emu ? "emulated" : "AMX", (long long)nrows, (long long)n, (long long)nt, (long long)chunk,
                   tp ? " (the activations' tiles made once)" : "", bad, (long long)(nrows * nt),
                   emu ? "the scalar sum in the tiles' order" : "decode's (calls of 1 token)");
        }
        if (!emu) {
            /* fp32 summation of n terms: well under n * 2^-24 of the sum of |terms| */
            CHECKF(worst < 1e-5, "AMX tiles %lld x %lld: error %.3g of the sum of |products| against a double sum",
                   (long long)nrows, (long long)n, worst);
            printf("  AMX %lld x %lld x %lld: worst error %.2g of sum |w a|\n", (long long)nrows, (long long)n,
                   (long long)nt, worst);
        }
        free(w), free(a), free(want), free(got), free(tmem);
    }
    lk_quant_set_simd("scalar");
}

/* The AMX kernel (lk_quant_set_amx) against the scalar reference, bit for
 * bit: Q4_0, Q8_0 and their repacked layouts, every call taking the tiles
 * (threshold 1), calls of 1 to 40 tokens (tiles of 16; the last tokens
 * copied into a zeroed tile) and one of 140 (past the 128-token block),
 * with the terms' scales and without, on row ranges from 0 and from 16,
 * partial row groups (53, 37 rows), K blocks (389 blocks: 13 of 32, the
 * last partial). The tile instructions emulated in C on any AVX-512 CPU
 * (the kernel's data flow), and the real ones where the CPU has AMX. Both
 * kernels: the panel one (lk_quant_set_amx) and the few-token one of the
 * repacked types (lk_quant_set_amx_few: a 16-row group at a time, a last
 * token tile that overlaps the one before, calls of fewer than 16 tokens
 * in one short tile; the file rows' calls and the repacked ones whose rows
 * are not whole groups go to the vector kernels then). */
TEST(amx_same_bits) {
    static const int64_t chunks[] = {1, 3, 16, 17, 40};
    static const struct { int64_t nb, nrows; int nt; } shapes[] = {{7, 53, 140}, {64, 48, 40}, {389, 37, 40}, {1, 16, 40}};
    static const lk_type types[] = {LK_TYPE_Q4_0, LK_TYPE_Q8_0, LK_TYPE_Q4_0_R16, LK_TYPE_Q8_0_R16};
    if (!lk_quant_set_simd("avx512")) { printf("  (no avx512 on this CPU)\n"); return; }
    const int modes = lk_quant_amx_have() ? 2 : 1;
    if (modes == 1) printf("  (no AMX on this CPU: the emulated tiles only)\n");
    for (int mode = 0; mode < modes; mode++)
    for (int kern = 0; kern < 2; kern++)
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const lk_type rt = types[ti], ft = lk_type_file(rt);
        const int64_t n = 32 * shapes[si].nb, nrows = shapes[si].nrows;
        const int nt = shapes[si].nt;
        CHECK(lk_quant_set_simd("scalar"));
        mm_case mc = mm_case_new(ft, n, nrows, nt);
        mm_case_run(&mc, nt, mc.ref);
        uint8_t *w = mm_case_weights(&mc, rt, n, nrows);
        CHECK(lk_quant_set_simd("avx512"));
        lk_quant_amx_emulate(mode == 0);
        lk_quant_set_amx(kern == 0 ? 1 : 0);
        lk_quant_set_amx_few(kern == 0 ? 0 : 1);
        CHECK(lk_quant_amx_min_tok() == (kern == 0 ? 1 : 0) && lk_quant_amx_few_min_tok() == kern);
        uint8_t *mem = malloc(lk_act_terms_bytes(8, n, nt));
        for (size_t c = 0; c <= sizeof chunks / sizeof chunks[0]; c++)
        for (int with_terms = 0; with_terms < 2; with_terms++) {
            const int64_t chunk = c < sizeof chunks / sizeof chunks[0] ? chunks[c] : nt;
            if (chunk > nt) continue;
            memset(mc.got, 0xff, sizeof(float) * (size_t)nrows * (size_t)nt);
            for (int64_t t0 = 0; t0 < nt; t0 += chunk) {
                const int64_t tn = LK_MIN(chunk, nt - t0);
                lk_act_terms T = { .d = (float *)mem, .corr = (int32_t *)(mem + lk_act_terms_bytes(8, n, tn) / 2),
                                   .ntok = tn, .k = lk_quant_terms_k(rt) };
                const uint8_t *a = mc.a + (size_t)t0 * mc.arb;
                for (int64_t t = 0; t < tn; t++) lk_act_terms_rows(&T, t, t + 1, a + (size_t)t * mc.arb, 0, n);
                float *y = mc.got + (size_t)t0 * (size_t)nrows;
                const int64_t cut = nrows > 16 ? 16 : nrows;
                lk_quant_matmul_terms(rt, n, cut, w, mc.wrb, tn, a, mc.arb, with_terms ? &T : NULL, y, (size_t)nrows);
                if (cut < nrows)
                    lk_quant_matmul_terms(rt, n, nrows - cut, w + (size_t)cut * mc.wrb, mc.wrb, tn, a, mc.arb,
                                          with_terms ? &T : NULL, y + cut, (size_t)nrows);
            }
            int bad = 0;
            for (int64_t e = 0; e < nrows * nt; e++) bad += memcmp(&mc.got[e], &mc.ref[e], sizeof(float)) != 0;
            CHECKF(bad == 0, "%s tiles (%s kernel), %s %lld x %lld, calls of %lld tokens%s: %d of %lld outputs differ "
                   "from scalar's", mode ? "AMX" : "emulated", kern ? "few-token" : "panel", lk_type_name(rt), (long long)nrows, (long long)n,
                   (long long)chunk, with_terms ? " with terms" : "", bad, (long long)(nrows * nt));
        }
        free(mem);
        lk_quant_set_amx(-1);
        lk_quant_set_amx_few(-1);
        lk_quant_amx_emulate(false);
        if (w != mc.w) free(w);
        mm_case_free(&mc);
    }
    /* the threshold: off, or no AMX and no emulation, takes no tiles */
    lk_quant_set_amx(0);
    CHECK(lk_quant_amx_min_tok() == 0);
    lk_quant_set_amx(-1);
    CHECK(lk_quant_amx_min_tok() == (lk_quant_amx_have() ? LK_AMX_MIN_TOK : 0));
    lk_quant_set_simd("scalar");
}

TEST(float_rows_same_bits_every_level) {
    enum { N = 1003 };
    static float x[N];
    static uint16_t want[N];
    static uint8_t got[2 * N];
    const uint32_t specials[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu,
        0x477fe000u /* 65504 */, 0x477fefffu, 0x477ff000u /* 65520: ties to inf */, 0x47800000u, 0x7f7fffffu,
        0x33000000u /* half of the smallest half subnormal */, 0x33000001u, 0x33800000u, 0x387fc000u, 0x38800000u,
        0x00000001u, 0x807fffffu, 0x3f801000u /* 1 + 2^-11: an F16 tie */, 0x3f803000u, 0x3f808000u /* BF16 tie */,
        0x3f818000u, 0x7f7f8000u /* BF16 rounds to inf */, 0xbf808001u};
    const size_t ns = sizeof specials / sizeof specials[0];
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < N; i++) {
            float v = rnd_gauss() * powf(2.0f, (float)(int)(rnd_unif() * 40.0f - 20.0f));
            if (i % 7 == 3 || i >= N - 3) {
                uint32_t u = specials[(size_t)(i / 7 + pass) % ns];
                if (pass == 0 && (u & 0x7fffffffu) > 0x7f800000u) u = 0x3f801000u; /* pass 0: no NaN */
                memcpy(&v, &u, 4);
            }
            x[i] = v;
        }
        for (int ti = 0; ti < 2; ti++) {
            const lk_type t = ti ? LK_TYPE_BF16 : LK_TYPE_F16;
            for (int i = 0; i < N; i++) want[i] = ti ? lk_fp32_to_bf16(x[i]) : lk_fp32_to_fp16(x[i]);
            const char *levels[] = {"scalar", "avx2", "avx512"};
            for (int l = 0; l < 3; l++) {
                if (!lk_quant_set_simd(levels[l])) continue;
                for (int act = 0; act < 2; act++) {
                    memset(got, 0xa5, sizeof got);
                    if (act) lk_quantize_row_act(t, x, got, N);
                    else lk_quantize_row(t, x, got, N);
                    int bad = 0, first = -1;
                    for (int i = 0; i < N; i++)
                        if (memcmp(got + 2 * i, &want[i], 2)) bad++, first = first < 0 ? i : first;
                    CHECKF(bad == 0, "%s %s (%s, pass %d): %d of %d values differ from the scalar converter, first %d "
                           "(0x%08x)", levels[l], lk_type_name(t), act ? "activations" : "weights", pass, bad, N, first,
                           first < 0 ? 0u : ((const uint32_t *)(const void *)x)[first]);
                }
            }
        }
    }
    lk_quant_set_simd("scalar");
}

TEST(matmul_batch_invariant) {
    const char *levels[] = {"scalar", "avx2", "avx512"};
    for (int l = 0; l < 3; l++) {
        if (!lk_quant_set_simd(levels[l])) { printf("  (no %s on this CPU)\n", levels[l]); continue; }
        /* the F16/BF16 4-row decode tile both ways (lk_quant_set_dec_roll) */
        for (int roll = 0; roll < 2; roll++) {
            lk_quant_set_dec_roll(roll);
            for (size_t i = 0; i < sizeof k_wtypes / sizeof k_wtypes[0]; i++) {
                lk_type t = k_wtypes[i];
                if (roll && t != LK_TYPE_F16 && t != LK_TYPE_BF16) continue;
                int64_t bs = lk_type_block_size(t);
                /* floats also rows too long for a 6-token tile's BF16
                 * activations in L1: the prefill's K slabs (3 of them, the
                 * last with the odd tail; 37 rows: blocks of 20) */
                int64_t ns[3] = {bs == 1 ? 357 : bs == 32 ? 32 * 11 : 256 * 3,
                                 bs == 1 ? 2048 + 7 : bs == 32 ? 32 * 389 : 256 * 13, 5632 + 7};
                for (int k = 0; k < (bs == 1 ? 3 : 2); k++) {
                    int bad = check_batch_invariance(t, ns[k], 37);
                    CHECKF(bad == 0, "%s %s n=%lld roll %d", levels[l], lk_type_name(t), (long long)ns[k], roll);
                }
            }
        }
        lk_quant_set_dec_roll(-1);
    }
    lk_quant_set_simd("scalar");
}

/* The AVX2 prefill GEMM (quant_gemm_avx2.c, from 2 tokens) against the
 * AVX2 decode kernels (one token per call, quant_avx2.c's register tiles):
 * the same bits for every (row, token), under every tuning choice it may
 * take (rows per pass 1..4, token chunks 1..64: passes of fewer rows at the
 * end, chunks cut short). Shapes: 9 rows (passes of 4 and 2 leave a tail),
 * K-quant rows of 3 super-blocks, 37 tokens (past a chunk of 32, short of
 * 64). */
TEST(matmul_avx2_gemm_choices_bit_exact) {
    if (!lk_quant_set_simd("avx2")) { printf("  (no avx2 on this CPU)\n"); return; }
    /* (Q4_0 and Q8_0 have their own GEMM, quant_q4q8_avx2.c, which these
     * choices do not reach; matmul_levels_scalar_order_bit_exact covers it) */
    static const lk_type types[] = {LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K};
    static const int chunks[] = {0, 1, 2, 3, 7, 32, 64};
    enum { NT = 37, NR = 9 };
    for (size_t q = 0; q < sizeof types / sizeof types[0]; q++) {
        const lk_type t = types[q];
        mm_case mc = mm_case_new(t, 256 * 3, NR, NT);
        mm_case_run(&mc, 1, mc.ref); /* decode: one token a call */
        for (int rows = -1; rows <= 4; rows++) /* -1, 0: GEMM off, the register tiles */
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                lk_quant_gemm_avx2_force(rows, chunks[c]);
                memset(mc.got, 0xff, sizeof(float) * NR * NT);
                mm_case_run(&mc, NT, mc.got);
                int bad = 0;
                for (int i = 0; i < NR * NT; i++) bad += memcmp(&mc.got[i], &mc.ref[i], sizeof(float)) != 0;
                CHECKF(bad == 0, "%s rows %d chunk %d: %d of %d outputs differ from decode's", lk_type_name(t), rows,
                       chunks[c], bad, NR * NT);
            }
        lk_quant_gemm_avx2_force(0, 0);
        mm_case_free(&mc);
    }
    lk_quant_set_simd("scalar");
}

/* ===================================================================== */
/* One SIMD level for the whole program                                   */


/* What a child started with LK_SIMD prints (main's --simd-child). */
static int simd_child(void) {
    printf("cpu=%s quant=%s vec=%s wire=%s membw=%s\n", lk_simd_level_name(lk_cpu()->level),
           lk_quant_simd_name(), lk_vec_simd_name(), lk_wire_simd_name(), lk_membw_simd_name());
    return 0;
}

/* Runs this program with LK_SIMD=value and --simd-child (a fresh process:
 * the probe is made once per process); its stdout and stderr into out. */
static bool run_simd_child(const char *value, char *out, size_t len) {
    int fd[2];
    if (pipe(fd)) return false;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[0]);
        close(fd[1]);
        setenv("LK_SIMD", value, 1);
        execl("/proc/self/exe", "test_quant", "--simd-child", (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    size_t got = 0;
    ssize_t r;
    while (got + 1 < len && (r = read(fd[0], out + got, len - 1 - got)) > 0) got += (size_t)r;
    out[got] = 0;
    close(fd[0]);
    int status;
    return waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST(simd_env_reaches_every_dispatch) {
    char out[2048], want[256];
    const char *best = lk_simd_level_name(lk_cpu()->best);
    /* scalar: every dispatcher, and no warning */
    CHECK(run_simd_child("scalar", out, sizeof out));
    CHECKF(!strcmp(out, "cpu=scalar quant=scalar vec=scalar wire=scalar membw=scalar\n"), "LK_SIMD=scalar: %s", out);
    /* every level the CPU runs: each dispatcher at it (the codecs have no
     * AVX-512 code) */
    for (int l = LK_SIMD_AVX2; l < LK_SIMD_LEVELS; l++) {
        if (!lk_cpu_runs_level((lk_simd_level)l)) continue;
        const char *name = lk_simd_level_name((lk_simd_level)l);
        CHECK(run_simd_child(name, out, sizeof out));
        snprintf(want, sizeof want, "cpu=%s quant=%s vec=%s wire=avx2 membw=%s\n", name, name, name, name);
        CHECKF(!strcmp(out, want), "LK_SIMD=%s: %s", name, out);
    }
    /* an unknown name: one warning naming it and the level used instead */
    CHECK(run_simd_child("avx9000", out, sizeof out));
    snprintf(want, sizeof want, "LK_SIMD=avx9000: unknown level (scalar|avx2|avx512); using %s\n", best);
    CHECKF(strstr(out, want) != NULL, "%s", out);
    snprintf(want, sizeof want, "cpu=%s quant=%s ", best, best);
    CHECKF(strstr(out, want) != NULL, "%s", out);
    /* a level this CPU lacks: the warning names the missing features, and no
     * dispatcher goes above the level it names */
    if (!lk_cpu_runs_level(LK_SIMD_AVX512)) {
        CHECK(run_simd_child("avx512", out, sizeof out));
        CHECKF(strstr(out, "LK_SIMD=avx512: this CPU lacks it (no ") != NULL, "%s", out);
        snprintf(want, sizeof want, "); using %s\n", best);
        CHECKF(strstr(out, want) != NULL, "%s", out);
        snprintf(want, sizeof want, "cpu=%s quant=%s ", best, best);
        CHECKF(strstr(out, want) != NULL, "%s", out);
        const char *line = strstr(out, "cpu=");
        CHECKF(line && !strstr(line, "avx512"), "%s", out);
    }
}

/* ===================================================================== */
/* Real files: llama-quantize's output vs the F32 master                  */

/* Requantising the master with our Q8_0 / Q4_0 quantisers must reproduce
 * llama-quantize's bytes exactly (it uses ggml's *_ref quantisers when no
 * importance matrix is given). */
static void check_requant_file(const char *file, lk_type t, int *n_checked) {
    char err[LK_ERRLEN];
    lk_gguf *m = NULL, *q = NULL;
    CHECKF(lk_gguf_open(lk_td("synth/synth-llama-f32.gguf"), &m, err, sizeof err) == LK_OK, "%s", err);
    CHECKF(lk_gguf_open(lk_td(file), &q, err, sizeof err) == LK_OK, "%s", err);
    if (!m || !q) { lk_gguf_close(m); lk_gguf_close(q); return; }
    for (int64_t i = 0; i < lk_gguf_n_tensors(q); i++) {
        const lk_gguf_tensor *tq = lk_gguf_tensor_at(q, i);
        if (tq->type != (uint32_t)t) continue;
        const lk_gguf_tensor *tm = lk_gguf_find_tensor(m, tq->name);
        CHECKF(tm && tm->type == LK_TYPE_F32 && tm->n_elements == tq->n_elements, "%s", tq->name);
        if (!tm) continue;
        uint8_t *buf = malloc(tq->nbytes);
        int64_t row = (int64_t)tq->ne[0], nrows = (int64_t)(tq->n_elements / tq->ne[0]);
        size_t rb;
        LK_ASSERT(lk_type_row_bytes(t, row, &rb));
        for (int64_t r = 0; r < nrows; r++)
            lk_quantize_row(t, (const float *)tm->data + r * row, buf + r * rb, row);
        CHECKF(!memcmp(buf, tq->data, tq->nbytes), "%s %s differs from llama-quantize", file, tq->name);
        free(buf);
        (*n_checked)++;
    }
    lk_gguf_close(m);
    lk_gguf_close(q);
}

TEST(requantize_matches_llama_quantize) {
    const char *levels[] = {"scalar", "avx2", "avx512"};
    for (int l = 0; l < 3; l++) {
        if (!lk_quant_set_simd(levels[l])) continue;
        int n8 = 0, n4 = 0;
        check_requant_file("synth/synth-llama-q8_0.gguf", LK_TYPE_Q8_0, &n8);
        check_requant_file("synth/synth-llama-q4_0.gguf", LK_TYPE_Q4_0, &n4);
        CHECKF(n8 == 16 && n4 == 15, "%s: %d q8_0 and %d q4_0 tensors", levels[l], n8, n4);
    }
    lk_quant_set_simd("scalar");
}

/* Dequantising each file must give the master back within the type's
 * quantisation error. Bounds, per block of the master (amax = max |x| over
 * the block, 32 or 256 elements), from how ggml quantises:
 *   F16: relative 2^-11; BF16: relative 2^-8;
 *   Q8_0: step amax/127, error <= step/2 (+ fp16 scale rounding);
 *   Q4_0: step amax/8, error <= one step (clamping at +7);
 *   Q6_K: 16-element sub-blocks with int8-quantised 6-bit steps <= amax/32,
 *         error <= about one step -> amax/24;
 *   Q5_K: 32-element sub-blocks with min, step <= 2 amax/31 -> amax/10;
 *   Q4_K: step <= 2 amax/15 -> amax/5.
 * and the relative RMS error per tensor must be in the range such a
 * quantiser reaches on Gaussian data (measured: q8_0 0.0053, q6_k 0.0177,
 * q5_k 0.036, q4_k 0.071, q4_0 0.086; bounds +-25%; a layout error gives
 * ~100% or more). */
static void check_dequant_file(const char *file, int *n_checked) {
    char err[LK_ERRLEN];
    lk_gguf *m = NULL, *q = NULL;
    CHECKF(lk_gguf_open(lk_td("synth/synth-llama-f32.gguf"), &m, err, sizeof err) == LK_OK, "%s", err);
    CHECKF(lk_gguf_open(lk_td(file), &q, err, sizeof err) == LK_OK, "%s", err);
    if (!m || !q) { lk_gguf_close(m); lk_gguf_close(q); return; }
    for (int64_t i = 0; i < lk_gguf_n_tensors(q); i++) {
        const lk_gguf_tensor *tq = lk_gguf_tensor_at(q, i);
        const lk_gguf_tensor *tm = lk_gguf_find_tensor(m, tq->name);
        CHECKF(tm && tm->n_elements == tq->n_elements, "%s", tq->name);
        if (!tm || tq->type == LK_TYPE_F32) continue;
        CHECKF(lk_type_supported(tq->type), "%s: %s", tq->name, lk_type_name(tq->type));
        int64_t n = (int64_t)tq->n_elements, row = (int64_t)tq->ne[0];
        float *y = malloc((size_t)n * 4);
        size_t rb;
        LK_ASSERT(lk_type_row_bytes(tq->type, row, &rb));
        for (int64_t r = 0; r < n / row; r++)
            lk_dequantize_row(tq->type, (const uint8_t *)tq->data + r * rb, y + r * row, row);
        const float *x = tm->data;
        int64_t bs = tq->type == LK_TYPE_F16 || tq->type == LK_TYPE_BF16 ? 32 : lk_type_block_size(tq->type);
        double step;
        double rms_lo, rms_hi; /* relative RMS error expected */
        switch (tq->type) {
        case LK_TYPE_F16: step = 0; rms_lo = 0; rms_hi = 0x1p-11; break;
        case LK_TYPE_BF16: step = 0; rms_lo = 0; rms_hi = 0x1p-8; break;
        case LK_TYPE_Q8_0: step = 0.57 / 127; rms_lo = 0.004; rms_hi = 0.007; break;
        case LK_TYPE_Q4_0: step = 1.01 / 8; rms_lo = 0.07; rms_hi = 0.10; break;
        case LK_TYPE_Q6_K: step = 1.0 / 24; rms_lo = 0.014; rms_hi = 0.022; break;
        case LK_TYPE_Q5_K: step = 1.0 / 10; rms_lo = 0.028; rms_hi = 0.045; break;
        case LK_TYPE_Q4_K: step = 1.0 / 5; rms_lo = 0.055; rms_hi = 0.09; break;
        default: step = 0; rms_lo = 0; rms_hi = 0; break;
        }
        double se = 0, sx = 0, worst = 0;
        for (int64_t b = 0; b < n / bs; b++) {
            double amax = 0;
            for (int64_t j = 0; j < bs; j++) amax = fmax(amax, fabs(x[b * bs + j]));
            for (int64_t j = 0; j < bs; j++) {
                double e = fabs((double)y[b * bs + j] - x[b * bs + j]);
                se += e * e;
                sx += (double)x[b * bs + j] * x[b * bs + j];
                /* float types: relative bound, plus half the smallest f16 subnormal */
                double lim = step ? step * amax : fabs(x[b * bs + j]) * rms_hi + 0x1p-25;
                if (e > lim && worst < e / (lim + 1e-30)) worst = e / (lim + 1e-30);
            }
        }
        double rel = sqrt(se / sx);
        CHECKF(worst == 0, "%s %s: error %.3gx over its bound", file, tq->name, worst);
        CHECKF(rel >= rms_lo && rel <= rms_hi, "%s %s (%s): relative RMS error %.4g not in [%g, %g]",
               file, tq->name, lk_type_name(tq->type), rel, rms_lo, rms_hi);
        if (getenv("LK_QUANT_VERBOSE"))
            printf("  %s %-28s %-5s rel rms %.5f\n", file, tq->name, lk_type_name(tq->type), rel);
        free(y);
        (*n_checked)++;
    }
    lk_gguf_close(m);
    lk_gguf_close(q);
}

TEST(dequantize_real_files_vs_master) {
    const char *files[] = {"synth/synth-llama-f16.gguf", "synth/synth-llama-bf16.gguf",
                           "synth/synth-llama-q8_0.gguf", "synth/synth-llama-q4_0.gguf",
                           "synth/synth-llama-q4_k_m.gguf", "synth/synth-llama-q5_k_m.gguf",
                           "synth/synth-llama-q6_k.gguf"};
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        int n = 0;
        check_dequant_file(files[f], &n);
        CHECKF(n == 16, "%s: %d tensors checked", files[f], n);
    }
}

/* The bandwidth probe: a plausible figure for 1 and 2 threads on a small
 * buffer (a cache-resident measure; real use sizes it above the LLC), and
 * refusal of a buffer too small to split. Only sanity: the value itself is
 * the machine's. */
TEST(membw_probe) {
    double one = lk_membw_read_gbs(1, (size_t)16 << 20, 3);
    double two = lk_membw_read_gbs(2, (size_t)16 << 20, 3);
    CHECKF(one > 0.05 && one < 1e5, "1 thread: %g GB/s", one);
    CHECKF(two > 0.05 && two < 1e5, "2 threads: %g GB/s", two);
    CHECK(lk_membw_read_gbs(4, 100, 1) < 0);
    /* one pass over the caller's bytes */
    const size_t nb = (size_t)16 << 20;
    uint8_t *buf = aligned_alloc(64, nb);
    CHECK(buf != NULL);
    for (size_t i = 0; i < nb; i += 64) buf[i] = (uint8_t)i;
    const double once = lk_membw_read_once(buf, nb);
    CHECKF(once > 0.05 && once < 1e5, "one pass: %g GB/s", once);
    CHECK(lk_membw_read_once(buf, 255) < 0);
    CHECK(lk_membw_read_once(NULL, nb) < 0);
    CHECK(lk_membw_read_once(buf + 8, nb - 64) < 0);
    free(buf);
    size_t llc = lk_membw_llc_bytes();
    CHECKF(llc == 0 || (llc >= ((size_t)64 << 10) && llc < ((size_t)64 << 30)), "llc %zu", llc);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--simd-child")) return simd_child();
    RUN(traits);
    RUN(quantize_known_vectors);
    RUN(quantize_roundtrip_bounds);
    RUN(quantize_levels_bit_exact);
    RUN(act_quantize_levels_bit_exact);
    RUN(matmul_vs_double_scalar);
    RUN(matmul_vs_double_all_levels);
    RUN(matmul_prefill_gemm_edges);
    RUN(matmul_batch_invariant);
    RUN(matmul_levels_scalar_order_bit_exact);
    RUN(repacked_same_bits_as_file_rows);
    RUN(f16_r16_sums_in_order);
    RUN(bf16_r16_sums_by_pairs);
    RUN(matmul_terms_same_bits);
    RUN(amx_same_bits);
    RUN(bf16_amx);
    RUN(f32_avx512_lane_order);
    RUN(float_rows_same_bits_every_level);
    RUN(matmul_avx2_gemm_choices_bit_exact);
    RUN(simd_env_reaches_every_dispatch);
    RUN(requantize_matches_llama_quantize);
    RUN(dequantize_real_files_vs_master);
    RUN(membw_probe);
    return lk_test_end();
}
