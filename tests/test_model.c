/* The forward pass against llama.cpp's reference outputs
 * (../shared/testdata/reference and ../shared/testdata/synth): logits at every
 * prompt position from one batched prompt pass, then greedy decoding one token
 * at a time. Tolerances follow the READMEs next to the references. */
#include "lk_test.h"

#include "lk_ref.h"

typedef struct {
    const char *gguf, *json;
    double max_tol;     /* max |dlogit| */
    double median_tol;  /* median |dlogit| (0: not checked) */
    int min_gen;        /* at least this many greedy tokens must be compared */
    double gen_tol;     /* logit error assumed when comparing greedy tokens */
} ref_case;

/* Runs one reference file: logits at every prompt position within the
 * tolerances, then greedy generation one token at a time, compared up to
 * the first reference step whose top-1 margin is within 2x gen_tol (after
 * a near-tie a correct engine may take the other branch). */
static void check_reference(const ref_case *rc, int n_threads, bool kv_f16) {
    json_t *ref = lk_ref_load(rc->json);
    if (!ref) return;
    lk_model_params mp = { .n_ctx = 512, .n_threads = n_threads, .kv_f16 = kv_f16 };
    lk_gguf *g;
    lk_model *m = lk_ref_open_model(lk_td(rc->gguf), &mp, &g);
    if (!m) { json_decref(ref); return; }
    float *step = malloc(sizeof(float) * (size_t)lk_model_cfg(m)->n_vocab);
    size_t ci;
    json_t *c;
    double worst = 0, worst_median = 0;
    int matched_total = 0, compared_total = 0;
    json_array_foreach(json_object_get(ref, "cases"), ci, c) {
        lk_ref_case_result r;
        lk_ref_case(m, c, rc->gen_tol, step, &r);
        worst = fmax(worst, r.max), worst_median = fmax(worst_median, r.median);
        CHECKF(r.max <= rc->max_tol, "%s case %zu: max |dlogit| %.3g > %.3g", rc->json, ci, r.max, rc->max_tol);
        if (rc->median_tol > 0)
            CHECKF(r.median <= rc->median_tol, "%s case %zu: median |dlogit| %.3g > %.3g", rc->json, ci, r.median,
                   rc->median_tol);
        CHECKF(r.got < 0 || (r.matched == r.comparable - 1 && r.comparable < r.ngen),
               "%s case %zu: generated token %d is %d, want %d", rc->json, ci, r.matched, r.got, r.want);
        CHECKF(r.matched >= LK_MIN(rc->min_gen, r.comparable), "%s case %zu: only %d greedy tokens matched", rc->json, ci,
               r.matched);
        matched_total += r.matched;
        compared_total += r.ngen;
    }
    printf("  %-34s threads=%d kv=%s max|d|=%.2e median|d|=%.2e greedy %d/%d\n", rc->gguf, n_threads,
           kv_f16 ? "f16" : "f32", worst, worst_median, matched_total, compared_total);
    free(step);
    lk_model_free(m);
    json_decref(ref);
    lk_gguf_close(g);
}

static const ref_case stories[] = {
    { "models/stories260K.gguf", "reference/stories260K.json", 1e-3, 0, 64, 1e-3 },
    /* Q8_0 with ggml-exact activation quantisation lands within 2e-6 where
     * the prompt's float sums run in the reference's order (AVX-512); on an
     * AVX2-only CPU (Zen 3 EPYC, 2026-12-01, at HEAD d47f1c1 already) prompt
     * 1 takes one int8 rounding flip of an activation that moves some logits
     * by 0.066 while the median stays at 5e-9: the bound is 0.1 on the
     * maximum, the median and all 64 greedy tokens stay strict. */
    { "models/stories260K-q8_0.gguf", "reference/stories260K-q8_0.json", 0.1, 1e-5, 64, 1e-3 },
    /* Q4_0: prompt 4 takes one int8 rounding flip at position 1 that moves
     * every later logit by up to 0.18 (median 0.024); llama.cpp's own
     * repacked and plain kernels differ by as much (synth README: up to 0.17),
     * so the bound is the synth README's 0.4 max and a 0.05 median. */
    { "models/stories260K-q4_0.gguf", "reference/stories260K-q4_0.json", 0.4, 0.05, 16, 0.2 },
};
/* synth tolerances: synth/README.md "Suggested tolerances" (F32 1e-4; F16 with
 * F16 activations 1e-2; BF16 5e-2; quantised with ggml-exact activation
 * quantisation median 5e-3, max 0.4). Greedy tokens are compared up to the
 * first reference step whose top-1 margin is below 2 x gen_tol: the error
 * actually seen (near 1e-5 where no int8 rounding flips, else the bound). */
static const ref_case synth[] = {
    { "synth/synth-llama-f32.gguf", "synth/synth-llama-f32.json", 1e-4, 0, 16, 1e-3 },
    { "synth/synth-llama3rope-f32.gguf", "synth/synth-llama3rope-f32.json", 1e-4, 0, 16, 1e-3 },
    { "synth/synth-qwen2-f32.gguf", "synth/synth-qwen2-f32.json", 1e-4, 0, 16, 1e-3 },
    { "synth/synth-qwen3-f32.gguf", "synth/synth-qwen3-f32.json", 1e-4, 0, 16, 1e-3 },
    { "synth/synth-llama-f16.gguf", "synth/synth-llama-f16.json", 1e-2, 0, 16, 1e-2 },
    { "synth/synth-llama-tied-f16.gguf", "synth/synth-llama-tied-f16.json", 1e-2, 0, 16, 1e-2 },
    { "synth/synth-llama-bf16.gguf", "synth/synth-llama-bf16.json", 5e-2, 0, 16, 5e-2 },
    { "synth/synth-llama-q8_0.gguf", "synth/synth-llama-q8_0.json", 0.4, 5e-3, 16, 1e-2 },
    { "synth/synth-llama-q4_0.gguf", "synth/synth-llama-q4_0.json", 0.4, 5e-3, 16, 1e-2 },
    { "synth/synth-qwen3-q8_0.gguf", "synth/synth-qwen3-q8_0.json", 0.4, 5e-3, 16, 1e-2 },
    /* Q4_K_M: prompt 2's 19th generated token (position 37) follows an
     * int8 rounding flip of an activation at position 21 that moves every
     * later logit by up to 0.25 (positions 0-20 agree within 4e-6; the F32
     * models agree within 4e-5 at 700 positions): the reference's margin of
     * 0.033 there is within it, so greedy tokens are compared up to the
     * first margin under 0.1. */
    { "synth/synth-llama-q4_k_m.gguf", "synth/synth-llama-q4_k_m.json", 0.4, 5e-3, 8, 0.05 },
    /* Q5_K_M: prompt 2 takes one int8 rounding flip early (median 0.011 for
     * that prompt; the other prompts agree to 1e-6): bound 0.02. */
    { "synth/synth-llama-q5_k_m.gguf", "synth/synth-llama-q5_k_m.json", 0.4, 2e-2, 4, 0.2 },
    { "synth/synth-llama-q6_k.gguf", "synth/synth-llama-q6_k.json", 0.4, 5e-3, 8, 0.2 },
    { "synth/synth-qwen2-q4_k_m.gguf", "synth/synth-qwen2-q4_k_m.json", 0.4, 5e-3, 8, 0.05 },
};

TEST(stories260k_f32_reference) { check_reference(&stories[0], 1, false); }
TEST(stories260k_f32_two_threads) { check_reference(&stories[0], 2, false); }
TEST(stories260k_q8_0_reference) { check_reference(&stories[1], 1, false); }
TEST(stories260k_q4_0_reference) { check_reference(&stories[2], 1, false); }
TEST(synth_dense_references) {
    for (size_t i = 0; i < sizeof synth / sizeof synth[0]; i++) check_reference(&synth[i], 2, false);
}
TEST(stories260k_f16_kv_cache) {
    /* F16 KV cache: llama.cpp's own f16-KV run moved logits by up to 0.011 */
    ref_case rc = stories[0];
    rc.max_tol = 2e-2;
    check_reference(&rc, 1, true);
}

/* No allocation in the per-token path: after loading, decoding tokens must
 * not call malloc/calloc/realloc at all (counted through the linker's --wrap). */
TEST(no_allocation_per_token) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    CHECKF(lk_gguf_open(lk_td("models/stories260K.gguf"), &g, err, sizeof err) == LK_OK, "%s", err);
    if (!g) return;
    lk_model_params mp = { .n_ctx = 128, .n_threads = 2 };
    lk_model *m = NULL;
    CHECKF(lk_model_load(g, NULL, &mp, &m, err, sizeof err) == LK_OK, "%s", err);
    if (!m) { lk_gguf_close(g); return; }
    static float logits[512 * 8];
    int32_t prompt[8] = { 1, 403, 407, 261, 378, 1, 2, 3 };
    long before = lk_test_allocs();
    CHECK(lk_model_forward(m, prompt, 8, 0, 8, logits) == LK_OK);
    for (int pos = 8; pos < 100; pos++) {
        int32_t t = pos % 500;
        CHECK(lk_model_forward(m, &t, 1, pos, 1, logits) == LK_OK);
    }
    long after = lk_test_allocs();
    CHECKF(after == before, "%ld allocations during prefill and 92 decode steps", after - before);
    lk_model_free(m);
    lk_gguf_close(g);
}

/* Repacking at load (Q4_0, Q8_0 and the K-quants into 16-row groups on
 * AVX-512) changes no bit: the same logits, prefill and decode, with
 * LK_REPACK=0 (the file's layout) and LK_REPACK=all (the kernels' own), on the
 * dense synthetic models of those types (Q4_K_M and Q5_K_M mix Q4_K or
 * Q5_K with Q6_K), one and two threads (row splits across threads). On a CPU
 * without AVX-512 nothing is repacked and both runs take the same path. */
static int logits_of(const char *file, bool repack, int threads, float *out, int n_out) {
    char err[LK_ERRLEN];
    setenv("LK_REPACK", repack ? "all" : "0", 1); /* all: the K-quants on any CPU maker too */
    lk_gguf *g = NULL;
    CHECKF(lk_gguf_open(lk_td(file), &g, err, sizeof err) == LK_OK, "%s", err);
    lk_model_params mp = { .n_ctx = 64, .n_threads = threads };
    lk_model *m = NULL;
    if (g) CHECKF(lk_model_load(g, NULL, &mp, &m, err, sizeof err) == LK_OK, "%s", err);
    unsetenv("LK_REPACK");
    if (!m) { lk_gguf_close(g); return 0; }
    const int V = (int)lk_model_cfg(m)->n_vocab;
    LK_ASSERT(V * 13 <= n_out);
    int32_t prompt[12] = { 1, 40, 41, 42, 300, 7, 9, 11, 100, 200, 250, 3 };
    CHECK(lk_model_forward(m, prompt, 12, 0, 12, out) == LK_OK);
    int32_t t = 77;
    CHECK(lk_model_forward(m, &t, 1, 12, 1, out + (size_t)12 * V) == LK_OK);
    lk_model_free(m);
    lk_gguf_close(g);
    return 13 * V;
}

TEST(repacked_weights_same_logits) {
    static const char *files[] = {"synth/synth-llama-q4_0.gguf", "synth/synth-llama-q8_0.gguf",
                                  "synth/synth-llama-q4_k_m.gguf", "synth/synth-llama-q5_k_m.gguf",
                                  "synth/synth-llama-q6_k.gguf"};
    enum { N = 13 * 4096 };
    static float a[N], b[N];
    for (int f = 0; f < (int)(sizeof files / sizeof files[0]); f++)
        for (int th = 1; th <= 2; th++) {
            memset(a, 0, sizeof a);
            memset(b, 0xff, sizeof b);
            const int na = logits_of(files[f], false, th, a, N), nb = logits_of(files[f], true, th, b, N);
            CHECK(na > 0 && na == nb);
            int bad = 0;
            for (int i = 0; i < na; i++) bad += memcmp(&a[i], &b[i], sizeof(float)) != 0;
            CHECKF(bad == 0, "%s, %d threads: %d logits differ between the file's layout and the repacked one",
                   files[f], th, bad);
        }
}

TEST(bad_models_rejected) {
    char err[LK_ERRLEN];
    /* a tokenizer-only GGUF has no tensors: a clear error naming what is missing */
    lk_gguf *g = NULL;
    CHECKF(lk_gguf_open(lk_td("vocab/ggml-vocab-llama-spm.gguf"), &g, err, sizeof err) == LK_OK, "%s", err);
    if (!g) return;
    lk_model *m = NULL;
    lk_status st = lk_model_load(g, NULL, NULL, &m, err, sizeof err);
    CHECK(st != LK_OK && m == NULL);
    CHECKF(strstr(err, "tensor") || strstr(err, "metadata"), "message: %s", err);
    lk_gguf_close(g);
    /* an architecture we do not support is named */
    CHECKF(lk_gguf_open(lk_td("vocab/ggml-vocab-bert-bge.gguf"), &g, err, sizeof err) == LK_OK, "%s", err);
    if (!g) return;
    st = lk_model_load(g, NULL, NULL, &m, err, sizeof err);
    CHECKF(st == LK_ERR_UNSUPPORTED && strstr(err, "bert"), "status %d message: %s", st, err);
    lk_gguf_close(g);
}

int main(void) {
    RUN(stories260k_f32_reference);
    RUN(stories260k_f32_two_threads);
    RUN(stories260k_q8_0_reference);
    RUN(stories260k_q4_0_reference);
    RUN(stories260k_f16_kv_cache);
    RUN(synth_dense_references);
    RUN(no_allocation_per_token);
    RUN(repacked_weights_same_logits);
    RUN(bad_models_rejected);
    return lk_test_end();
}
