/* Every SIMD level gives the same bits: the F32 vector kernels (attention
 * dots and weighted sums, F32 and F16 cache; the exponentials of softmax and
 * SwiGLU), the delta net's state passes, and whole forward passes of the
 * synthetic model of each architecture, single tokens and batched, at the
 * scalar level against every level this CPU runs. The reference is the
 * other level's output: the property is agreement (a cluster whose nodes run
 * different levels, a Mac beside a PC), which no tolerance can stand for.
 *
 * The whole-program comparison (matrix kernels switched too, as LK_SIMD
 * does) needs the quantised matrix kernels of src/quant to agree across
 * levels for the types a model's matrices use; a direct check of those
 * kernels finds the types that do not, and the models that use one are left
 * out of it (named; all of them left out is reported as SKIP, not as a
 * failure of the kernels this test owns). */
#include "lk_test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "model/model.h"
#include "quant/quant.h"
/* the delta net's state passes are static: this program holds the file's
 * code in place of the library's copy */
#include "../src/model/deltanet.c"

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(float lo, float hi) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return lo + (hi - lo) * (float)((double)(rng >> 40) / 16777216.0);
}

/* The levels above scalar that this CPU runs, for the vector kernels. */
static int other_levels(const char **out) {
    static const char *const all[] = {"avx2", "avx512"};
    const char *was = lk_vec_simd_name();
    int n = 0;
    for (int i = 0; i < 2; i++)
        if (lk_vec_set_simd(all[i])) out[n++] = all[i];
    CHECK(lk_vec_set_simd(was));
    return n;
}

static bool same(const void *a, const void *b, size_t n) { return memcmp(a, b, n) == 0; }

/* ---- lk_fmaf: the scalar code's fused multiply-add ---- */

static float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Against libm's fmaf (correctly rounded): random operands of every
 * magnitude (denormals, overflow, zeros, infinities), and sums that round to
 * exactly halfway between two floats in double, where a plain double sum
 * rounded again to float is wrong. */
TEST(fmaf_matches_libm) {
    long n = 0, bad = 0;
    const float c1 = 1 + 0x1p-23f, a1 = (1 + 0x1p-18f) * 0x1p-12f, b1 = (1 - 0x1p-18f) * 0x1p-12f;
    /* c1 + a1 b1 = 1 + 2^-23 + 2^-24 - 2^-60: a double rounds it to the
     * float midpoint, which ties to even (1 + 2^-22); fmaf gives 1 + 2^-23 */
    const float trio[][3] = {{a1, b1, c1}, {-a1, b1, -c1}, {a1, -b1, c1 + 0x1p-22f}, {0x1p-75f, 0x1p-75f, 0x1p-126f},
                             {0x1p-70f, -0x1p-70f, 0x1p-140f}, {0x1p127f, 4.0f, -0x1p127f}, {0.0f, -0.0f, -0.0f},
                             {-0.0f, 0.0f, 0.0f}, {INFINITY, 0.0f, 1.0f}, {3.0f, 0x1p127f, 0x1p127f}};
    for (size_t i = 0; i < sizeof trio / sizeof trio[0]; i++) {
        const float got = lk_fmaf(trio[i][0], trio[i][1], trio[i][2]), want = fmaf(trio[i][0], trio[i][1], trio[i][2]);
        n++;
        if (!same(&got, &want, 4) && !(isnan(got) && isnan(want)) && bad++ < 4)
            CHECKF(0, "lk_fmaf(%a, %a, %a) = %a, fmaf %a", trio[i][0], trio[i][1], trio[i][2], got, want);
    }
    for (int i = 0; i < 400000; i++) {
        /* random bits, exponents drawn near each other so the sum cancels
         * or rounds (and sometimes far apart, denormal or huge) */
        uint32_t u[3];
        const int e0 = (int)frand(1, 254);
        for (int k = 0; k < 3; k++) {
            const int e = i % 7 == 0 ? (int)frand(0, 255) : LK_MAX(0, LK_MIN(254, e0 + (int)frand(-30, 30) + (k == 2 ? e0 - 127 : 0)));
            u[k] = ((uint32_t)(frand(0, 2) >= 1) << 31) | (uint32_t)e << 23 | ((uint32_t)(frand(0, 1) * 8388608.0f) & 0x7fffff);
        }
        const float a = from_bits(u[0]), b = from_bits(u[1]), c = from_bits(u[2]);
        const float got = lk_fmaf(a, b, c), want = fmaf(a, b, c);
        n++;
        if (!same(&got, &want, 4) && !(isnan(got) && isnan(want)) && bad++ < 4)
            CHECKF(0, "lk_fmaf(%a, %a, %a) = %a, fmaf %a", a, b, c, got, want);
    }
    CHECKF(bad == 0, "%ld of %ld differ", bad, n);
    printf("  %ld operand triples: lk_fmaf = fmaf\n", n);
}

/* ---- the vector kernels, one by one ---- */

enum { NMAX = 300 };
static const int k_lens[] = {1, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 63, 64, 65, 100, 128, 130, 256, 257, 300};

/* Runs every vector kernel at `level` on the same inputs; outputs appended
 * to *o (floats; doubles as two floats). */
typedef struct { float v[200000]; size_t n; } outs;
static void put(outs *o, const float *x, size_t n) {
    LK_ASSERT(o->n + n <= sizeof o->v / sizeof o->v[0]);
    memcpy(o->v + o->n, x, n * sizeof(float));
    o->n += n;
}

static void run_vec(const char *level, outs *o) {
    CHECK(lk_vec_set_simd(level));
    o->n = 0;
    rng = 0x2545F4914F6CDD1Dull; /* the same inputs at every level */
    static float a[NMAX], b[NMAX], y[NMAX], S[4 * 9], V[9 * NMAX], av[4 * NMAX];
    static uint16_t h[NMAX];
    for (size_t k = 0; k < sizeof k_lens / sizeof k_lens[0]; k++) {
        const int n = k_lens[k];
        for (int i = 0; i < n; i++) a[i] = frand(-2, 2), b[i] = frand(-2, 2), h[i] = lk_fp32_to_fp16(frand(-2, 2));
        float d = lk_vec_dot_f32(a, b, n);
        put(o, &d, 1);
        for (int i = 0; i < n; i++) y[i] = frand(-1, 1);
        lk_vec_axpy_f32(y, frand(-1, 1), a, n);
        put(o, y, (size_t)n);
        static const uint16_t edge[4] = {0x0001, 0x83ff, 0x7bff, 0x0400}; /* subnormals, the largest, the least normal */
        for (int i = 0; i < n && i < 4; i++) h[i] = edge[i];
        lk_vec_f16_to_f32(y, h, n);
        put(o, y, (size_t)n);
        /* attention's weighted sum: 1-4 queries over up to 9 positions */
        for (int nq = 1; nq <= 4; nq++) {
            const int npos = 1 + (n + nq) % 9;
            for (int i = 0; i < nq * 9; i++) S[i] = frand(0, 1);
            for (int i = 0; i < npos * n; i++) V[i] = frand(-2, 2);
            for (int i = 0; i < nq * n; i++) av[i] = frand(-1, 1);
            lk_vec_attn_av_f32(av, (size_t)n, S, 9, 1, V, npos, nq, n);
            put(o, av, (size_t)(nq * n));
        }
        /* attention with the keys in lanes: scores (head size n, the 4-,
         * 2- and 1-query tiles, keys over two pages), two blocks of the
         * running softmax (mixed windows, one query seeing nothing of a
         * block; soft-capped too), then the weighted sums from the rows */
        {
            enum { SS = 2 * LK_ATT_KW };
            static float Q[16 * NMAX], ST[16 * SS], KP[2][NMAX * LK_ATT_KW], KV[SS * NMAX];
            const int nq = 1 + (n * 5) % 16, np = 1 + n % SS;
            const float *pages[2] = {KP[1], KP[0]};
            for (int i = 0; i < nq * n; i++) Q[i] = frand(-1, 1);
            for (int i = 0; i < n * LK_ATT_KW; i++) KP[0][i] = frand(-2, 2), KP[1][i] = frand(-2, 2);
            for (int i = 0; i < np * n; i++) KV[i] = frand(-2, 2);
            lk_vec_attn_qk(ST, SS, Q, (size_t)n, nq, pages, np, n);
            for (int g = 0; g < nq; g++) put(o, ST + g * SS, (size_t)np); /* past np: unspecified */
            float mx[16], al[16];
            double sum[16];
            int32_t lo[16], hi[16];
            for (int g = 0; g < nq; g++) mx[g] = -INFINITY, sum[g] = 0;
            for (int blk = 0; blk < 2; blk++) {
                for (int i = 0; i < 16 * SS; i++) ST[i] = frand(-300, 100);
                for (int g = 0; g < nq; g++) {
                    lo[g] = (g * 3) % np;
                    hi[g] = lo[g] + 1 + (g * 7 + n) % (np - lo[g]);
                    if (blk == 1 && g == 2) lo[g] = hi[g] = 0;
                }
                lk_vec_attn_softmax(ST, SS, np, lo, hi, nq, 0.125f, (n & 1) ? 20.f : 0.f, mx, sum, al);
                for (int g = 0; g < nq; g++) put(o, ST + g * SS, (size_t)np);
                put(o, mx, (size_t)nq);
                put(o, al, (size_t)nq);
                put(o, (const float *)sum, (size_t)(2 * nq));
            }
            for (int i = 0; i < 4 * n; i++) av[i] = frand(-1, 1);
            lk_vec_attn_av_f32(av, (size_t)n, ST + (nq > 4) * SS, SS, 1, KV, np, LK_MIN(4, nq), n); /* rows < nq */
            put(o, av, (size_t)(4 * n));
            /* an F16 cache's pages, read as they are */
            static uint16_t KH[2][NMAX * LK_ATT_KW], VH[SS * NMAX];
            const uint16_t *hpages[2] = {KH[0], KH[1]};
            for (int i = 0; i < n * LK_ATT_KW; i++) KH[0][i] = lk_fp32_to_fp16(frand(-2, 2)), KH[1][i] = lk_fp32_to_fp16(frand(-2, 2));
            for (int i = 0; i < np * n; i++) VH[i] = lk_fp32_to_fp16(frand(-2, 2));
            lk_vec_attn_qk_f16(ST, SS, Q, (size_t)n, nq, hpages, np, n);
            for (int g = 0; g < nq; g++) put(o, ST + g * SS, (size_t)np);
            for (int i = 0; i < 4 * n; i++) av[i] = frand(-1, 1);
            lk_vec_attn_av_f16(av, (size_t)n, ST, SS, 1, VH, np, LK_MIN(4, nq), n);
            put(o, av, (size_t)(4 * n));
        }
        /* exponentials: softmax (through lk_vec_exp_sum) over scores far
         * below the max too, SwiGLU over gates that saturate exp */
        for (int i = 0; i < n; i++) y[i] = frand(-100, 20);
        lk_softmax(y, n);
        put(o, y, (size_t)n);
        /* softmax's other passes: the max skips NaNs wherever they stand
         * (lanes and tail), the scale */
        for (int i = 0; i < n; i++) y[i] = frand(-100, 20);
        for (int i = (int)(n % 7); i < n; i += 7) y[i] = NAN;
        const float mx = lk_vec_max(y, n);
        put(o, &mx, 1);
        lk_vec_scale(y, n, frand(0.01f, 2));
        put(o, y, (size_t)n);
        for (int i = 0; i < n; i++) y[i] = frand(-30, 5);
        const double es = lk_vec_exp_sum(y, n, frand(-5, 5));
        put(o, (const float *)&es, 2);
        put(o, y, (size_t)n);
        for (int i = 0; i < n; i++) y[i] = frand(-95, 95), b[i] = frand(-2, 2);
        lk_swiglu(y, b, n);
        put(o, y, (size_t)n);
        /* RMSNorm's sum of squares (8 double partials; the tail's elements
         * onto partials 0, 1, ...) */
        for (int i = 0; i < n; i++) y[i] = ldexpf(frand(-2, 2), (int)frand(-30, 30)); /* so the sums round */
        const double ss = lk_vec_sumsq(y, n);
        put(o, (const float *)&ss, 2);
        /* the whole RMSNorm: its scale then the weights, two roundings */
        for (int i = 0; i < n; i++) y[i] = frand(-3, 3), b[i] = frand(-2, 2);
        lk_rmsnorm(V, y, b, n, 1e-5f);
        put(o, V, (size_t)n);
    }
    /* the exponential's edges: where it turns 0, denormal results, where it
     * saturates, infinities */
    float e[] = {-87.3f, nextafterf(-87.3f, 0), nextafterf(-87.3f, -100), -87.31f, -87.2f, -86.99f, -87.0f, 88.7f,
                 88.69f, 88.71f, 88.38f, 100, INFINITY, -INFINITY, 0.0f, -0.0f, 0.34657359f, -0.34657359f, 1e-8f,
                 -1e-8f, 44.36142f, -44.36142f, 20, -20};
    const int ne = (int)(sizeof e / sizeof e[0]);
    memcpy(y, e, sizeof e);
    const double es = lk_vec_exp_sum(y, ne, 0);
    put(o, (const float *)&es, 2);
    put(o, y, (size_t)ne);
    memcpy(y, e, sizeof e);
    for (int i = 0; i < ne; i++) b[i] = 1.5f;
    lk_swiglu(y, b, ne - 2); /* not the infinities: -inf / inf is NaN */
    put(o, y, (size_t)ne);
}

TEST(vec_kernels_same_bits_at_every_level) {
    const char *lv[2];
    const int nl = other_levels(lv);
    const char *was = lk_vec_simd_name();
    static outs ref, got;
    run_vec("scalar", &ref);
    for (int l = 0; l < nl; l++) {
        run_vec(lv[l], &got);
        size_t diff = 0, first = 0;
        for (size_t i = 0; i < ref.n; i++)
            if (!same(&ref.v[i], &got.v[i], 4) && diff++ == 0) first = i;
        CHECKF(got.n == ref.n && diff == 0, "%s: %zu of %zu outputs differ from scalar's, the first at %zu (%.9g, %.9g)",
               lv[l], diff, ref.n, first, ref.v[first], got.v[first]);
        printf("  scalar vs %s: %zu outputs of dot, axpy (F32, F16), attention scores, running softmax and sums, softmax, exp-sum, SwiGLU, RMSNorm\n", lv[l],
               ref.n);
    }
    if (nl == 0) printf("  only the scalar level runs here: nothing to compare\n");
    CHECK(lk_vec_set_simd(was));
}

/* The delta net's two passes over a value head's state, scalar and AVX2 (the
 * level lk_deltanet picks for dv a multiple of 16): a whole forward pass
 * hides some of their differences, since the Q8_K quantisation of the
 * next matmul's input absorbs most last-bit changes. */
TEST(deltanet_passes_same_bits) {
    if (!lk_cpu_runs_level(LK_SIMD_AVX2)) { printf("  no AVX2 here: nothing to compare\n"); return; }
    enum { DK = 128, DV = 128 };
    static float S0[DK * DV], S1[DK * DV], k[DK], q[DK], delta[DV], sk[2][DV], sq[2][DV];
    static const int dims[][2] = {{32, 32}, {64, 16}, {128, 128}, {16, 48}};
    int nd = 0, total = 0;
    for (size_t c = 0; c < sizeof dims / sizeof dims[0]; c++) {
        const int dk = dims[c][0], dv = dims[c][1];
        for (int i = 0; i < dk * dv; i++) S0[i] = S1[i] = frand(-1, 1);
        for (int step = 0; step < 4; step++) { /* a few tokens: the state carries what each pass rounded */
            for (int i = 0; i < dk; i++) k[i] = frand(-0.3f, 0.3f), q[i] = frand(-0.3f, 0.3f);
            for (int e = 0; e < dv; e++) delta[e] = frand(-1, 1);
            const float decay = frand(0.5f, 1);
            pass_read_scalar(S0, k, q, sk[0], sq[0], dk, dv);
            pass_read_avx2(S1, k, q, sk[1], sq[1], dk, dv);
            pass_write_scalar(S0, decay, k, delta, dk, dv);
            pass_write_avx2(S1, decay, k, delta, dk, dv);
            nd += !same(sk[0], sk[1], sizeof(float) * (size_t)dv) + !same(sq[0], sq[1], sizeof(float) * (size_t)dv);
            total += 2;
        }
        CHECKF(same(S0, S1, sizeof(float) * (size_t)(dk * dv)), "dk %d dv %d: the states differ", dk, dv);
        total++;
    }
    CHECKF(nd == 0, "%d of %d S^T k / S^T q products differ", nd, total);
    printf("  %d state updates and their S^T k, S^T q: scalar = avx2\n", total);
}

/* ---- whole forward passes ---- */

typedef struct { const char *file; bool kv_f16; } model_case;
static const model_case k_models[] = {
    {"synth/synth-llama-f32.gguf", false},      /* F32 throughout: no quantisation hides a difference */
    {"synth/synth-qwen3-f32.gguf", false},
    {"synth/synth-llama-f16.gguf", true},       /* F16 KV cache: its rows widened, the F32 dot and axpy */
    {"synth/synth-llama-q4_0.gguf", false},
    {"synth/synth-qwen3-q8_0.gguf", false},
    {"synth/synth-gemma3-q4_k_m.gguf", true},
    {"synth/synth-qwen3moe-q4_k_m.gguf", false},
    {"synth/synth-qwen35moe-q4_k_m.gguf", false}, /* the delta net */
    {"synth/synth-qwen35moe-f16.gguf", true},
    {"synth/synth-glm4moe-q4_k_m.gguf", false},
    {"synth/synth-deepseek2-q4_k_m.gguf", false},
};
enum { NPROMPT = 8, NDEC = 3 };

/* Logits of an 8-token prompt (every position, one batched call) and of 3
 * single-token steps after it, fresh model, into out [NPROMPT + NDEC][vocab]. */
static bool forward(const model_case *mc, float *out, int64_t *nv) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(lk_td(mc->file), &g, err, sizeof err)) { CHECKF(0, "%s", err); return false; }
    lk_model_params mp = { .n_ctx = 64, .n_batch = NPROMPT, .max_seqs = 1, .kv_f16 = mc->kv_f16, .n_threads = 1 };
    lk_model *m = NULL;
    if (lk_model_load(g, NULL, &mp, &m, err, sizeof err) != LK_OK) {
        CHECKF(0, "%s: %s", mc->file, err);
        lk_gguf_close(g);
        return false;
    }
    *nv = lk_model_cfg(m)->n_vocab;
    int32_t tok[NPROMPT + NDEC];
    for (int i = 0; i < NPROMPT + NDEC; i++) tok[i] = (int32_t)((46 + 131 * i) % *nv);
    bool ok = lk_model_forward(m, tok, NPROMPT, 0, NPROMPT, out) == LK_OK;
    for (int i = 0; ok && i < NDEC; i++)
        ok = lk_model_forward(m, tok + NPROMPT + i, 1, NPROMPT + i, 1, out + (size_t)(NPROMPT + i) * *nv) == LK_OK;
    CHECKF(ok, "%s: forward failed", mc->file);
    lk_model_free(m);
    lk_gguf_close(g);
    return ok;
}

/* Types whose matrix kernels differ from scalar's at some level this CPU
 * runs (bit t for lk_type t; quant_levels_agree fills it). */
static uint64_t g_bad_types;

/* The types of a model file's matrices (tensors of 2+ dimensions). */
static uint64_t model_types(const char *file) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(lk_td(file), &g, err, sizeof err)) return ~0ull;
    uint64_t m = 0;
    for (int64_t i = 0; i < lk_gguf_n_tensors(g); i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
        if (t->n_dims >= 2 && t->type < 64) m |= 1ull << t->type;
    }
    lk_gguf_close(g);
    return m;
}

/* Scalar vs each other level, with the matrix kernels switched too
 * (`whole`: only the models whose matrix types agree) or held at the CPU's
 * level. Returns the number of models compared. */
static int compare_forwards(bool whole) {
    const char *lv[2];
    const int nl = other_levels(lv);
    const char *vwas = lk_vec_simd_name(), *qwas = lk_quant_simd_name();
    enum { VMAX = 1024 };
    static float ref[(NPROMPT + NDEC) * VMAX], got[(NPROMPT + NDEC) * VMAX];
    int compared = 0;
    for (size_t k = 0; k < sizeof k_models / sizeof k_models[0]; k++) {
        const model_case *mc = &k_models[k];
        if (!lk_td_have(mc->file)) return compared;
        if (whole && (model_types(mc->file) & g_bad_types)) {
            printf("  %-36s left out: a matrix type of it differs between levels\n", mc->file);
            continue;
        }
        compared++;
        int64_t nv = 0;
        CHECK(lk_vec_set_simd("scalar") && (!whole || lk_quant_set_simd("scalar")));
        if (!forward(mc, ref, &nv)) continue;
        LK_ASSERT(nv <= VMAX);
        for (int l = 0; l < nl; l++) {
            CHECK(lk_vec_set_simd(lv[l]) && (!whole || lk_quant_set_simd(lv[l])));
            if (!forward(mc, got, &nv)) continue;
            int bad = -1;
            for (int r = 0; r < NPROMPT + NDEC && bad < 0; r++)
                if (!same(ref + (size_t)r * nv, got + (size_t)r * nv, sizeof(float) * (size_t)nv)) bad = r;
            CHECKF(bad < 0, "%s%s: scalar and %s logits differ, first at %s %d", mc->file, mc->kv_f16 ? " (F16 KV)" : "",
                   lv[l], bad < NPROMPT ? "prompt position" : "decode step", bad < NPROMPT ? bad : bad - NPROMPT);
        }
        printf("  %-36s%s %d prompt positions + %d decode steps: scalar = %s%s\n", mc->file,
               mc->kv_f16 ? " kv=f16" : "       ", NPROMPT, NDEC, nl ? lv[0] : "(no other level)",
               nl > 1 ? " = avx512" : "");
        CHECK(lk_vec_set_simd(vwas) && lk_quant_set_simd(qwas));
    }
    CHECK(lk_vec_set_simd(vwas) && lk_quant_set_simd(qwas));
    return compared;
}

/* The vector kernels and the delta net at scalar vs the other levels, the
 * matrix kernels at the CPU's level in both runs. */
TEST(forward_vector_kernels_same_bits) { compare_forwards(false); }

/* Everything switched, as LK_SIMD=scalar does, for the models whose matrix
 * types agree (at least one must; main reports SKIP when none can). */
TEST(forward_whole_program_same_bits) { CHECK(compare_forwards(true) > 0); }

/* Whether the quantised matrix kernels (and activation quantisers) of every
 * type the synthetic models use give scalar's bits at every other level;
 * if not, `why` names what differs. */
static bool quant_levels_agree(char *why, size_t len) {
    static const lk_type types[] = {LK_TYPE_F32, LK_TYPE_F16, LK_TYPE_BF16, LK_TYPE_Q4_0, LK_TYPE_Q8_0,
                                    LK_TYPE_Q5_0, LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K};
    enum { N = 512, R = 16, T = 5 };
    static float w[R * N], x[T * N], y[2][T * R];
    static uint8_t W[R * N * 4], A[2][T * N * 4];
    const char *lv[2];
    const int nl = other_levels(lv);
    const char *was = lk_quant_simd_name();
    why[0] = 0;
    for (int i = 0; i < R * N; i++) w[i] = frand(-1, 1);
    for (int i = 0; i < T * N; i++) x[i] = frand(-3, 3);
    for (int l = 0; l < nl; l++)
        for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
            const lk_type t = types[k], at = lk_type_vec_dot(t);
            size_t wb = 0, ab = 0;
            LK_ASSERT(lk_type_row_bytes(t, N, &wb) && lk_type_row_bytes(at, N, &ab));
            CHECK(lk_quant_set_simd("scalar"));
            for (int r = 0; r < R; r++) lk_quantize_row(t, w + r * N, W + r * wb, N);
            int nd = 0, na = 0;
            for (int s = 0; s < 2; s++) {
                CHECK(lk_quant_set_simd(s ? lv[l] : "scalar"));
                for (int i = 0; i < T; i++) lk_quantize_row_act(at, x + i * N, A[s] + i * ab, N);
                /* decode (one token) and a small batch, on the same activation bytes */
                lk_quant_matmul(t, N, R, W, wb, 1, A[0], ab, y[s], R);
                lk_quant_matmul(t, N, R, W, wb, T - 1, A[0] + ab, ab, y[s] + R, R);
            }
            na = !same(A[0], A[1], ab * T);
            for (int i = 0; i < T * R; i++) nd += !same(&y[0][i], &y[1][i], 4);
            if (nd || na) g_bad_types |= 1ull << t;
            if ((nd || na) && strlen(why) + 80 < len)
                snprintf(why + strlen(why), len - strlen(why), "%s%s %s: %d of %d outputs%s", why[0] ? "; " : "",
                         lv[l], lk_type_name(t), nd, T * R, na ? ", activation bytes" : "");
        }
    CHECK(lk_quant_set_simd(was));
    return why[0] == 0;
}

int main(void) {
    RUN(fmaf_matches_libm);
    RUN(vec_kernels_same_bits_at_every_level);
    RUN(deltanet_passes_same_bits);
    RUN(forward_vector_kernels_same_bits);
    char why[2048];
    bool any = quant_levels_agree(why, sizeof why);
    for (size_t k = 0; !any && k < sizeof k_models / sizeof k_models[0]; k++)
        any = lk_td_have(k_models[k].file) && !(model_types(k_models[k].file) & g_bad_types);
    if (why[0]) printf("  the quantised matrix kernels that differ from scalar's (src/quant): %s\n", why);
    if (any) {
        RUN(forward_whole_program_same_bits);
    } else {
        lk_t_skip++;
        printf("SKIP forward_whole_program_same_bits: every model uses a matrix type whose kernels differ between "
               "levels (above)\n");
    }
    return lk_test_end();
}
