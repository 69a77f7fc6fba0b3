/* Tuning changes speed, never numbers: every setting the tuner may choose
 * (decode prefetch distance, thread split of a matrix, the AVX2 prefill
 * GEMM and its chunk, where the AVX-512 quantised GEMM takes over) gives the bits of the defaults, for the matrix kernel
 * on real weight formats at every SIMD level this CPU runs, and for a
 * model's logits (synth GGUF files, prefill and decode). Also: the pool runs
 * every task exactly once while threads steal, the cache file survives a
 * corrupt or foreign file, and LK_TUNE forces or skips.
 *
 * Includes tune.c to reach its statics (the process's tuned key). */
#include "lk_test.h"
#include "../src/kernels/tune.c"
#include "gguf/gguf.h"
#include "model/model.h"

#include <unistd.h>

/* the candidates: each value of each knob the tuner tries or a user may force */
static int settings(lk_tune_set *out, int cap) {
    int n = 0;
    lk_tune_set d;
    lk_tune_defaults(&d);
    static const int pfs[] = { 0, 2, 3, 4, 8 }, sps[] = { 1, 2, 3, 8, 16 }, grs[] = { 1, 2, 3, 4 },
                     chs[] = { 0, 1, 7, 64 };
    for (size_t i = 0; i < sizeof pfs / sizeof *pfs && n < cap; i++) out[n] = d, out[n++].pf = pfs[i];
    for (size_t i = 0; i < sizeof sps / sizeof *sps && n < cap; i++) out[n] = d, out[n++].split = sps[i];
    for (size_t i = 0; i < sizeof grs / sizeof *grs; i++)
        for (size_t j = 0; j < sizeof chs / sizeof *chs && n < cap; j++)
            out[n] = d, out[n].gemm_rows = grs[i], out[n++].gemm_chunk = chs[j];
    static const int gts[] = { 5, 7, 9, 16, 32 };
    for (size_t i = 0; i < sizeof gts / sizeof *gts && n < cap; i++) out[n] = d, out[n++].gemm_tok = gts[i];
    if (n < cap) out[n] = d, out[n++].drows = 1;
    if (n < cap) out[n] = d, out[n].pf = 0, out[n].split = 16, out[n++].drows = 1;
    /* the F16/BF16 decode tile's rows loop, both ways (F16 model below) */
    if (n < cap) out[n] = d, out[n++].droll = 0;
    if (n < cap) out[n] = d, out[n++].droll = 1;
    if (n < cap) out[n] = d, out[n].pf = 0, out[n++].droll = 1;
    /* AMX: off, from every token, from 16 (the tiles' tails) */
    static const int amxs[] = { 0, 1, 16 };
    for (size_t i = 0; i < sizeof amxs / sizeof *amxs && n < cap; i++) out[n] = d, out[n++].amx = amxs[i];
    /* the repacked types' few-token AMX kernel: off, from every token, from 16, beside the panel one off */
    static const int amxfs[] = { 0, 1, 16 };
    for (size_t i = 0; i < sizeof amxfs / sizeof *amxfs && n < cap; i++) out[n] = d, out[n++].amxf = amxfs[i];
    if (n < cap) out[n] = d, out[n].amx = 0, out[n++].amxf = 1;
    /* the repacked Q4_0/Q8_0 decode's far prefetch: off, the nearest, the farthest, without the near one */
    static const int fars[] = { 0, 1, LK_QUANT_FAR_MAX };
    for (size_t i = 0; i < sizeof fars / sizeof *fars && n < cap; i++) out[n] = d, out[n++].far = fars[i];
    if (n < cap) out[n] = d, out[n].pf = 0, out[n++].far = 32;
    /* waiting pool threads prefetching the next product's rows, or not */
    if (n < cap) out[n] = d, out[n++].hint = 0;
    if (n < cap) out[n] = d, out[n].split = 16, out[n++].hint = 0;
    out[n] = d, out[n].pf = 4, out[n].split = 8, out[n].gemm_rows = 4, out[n++].gemm_chunk = 0;
    return n;
}

static uint32_t rng = 7;
static float frand(void) {
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
}

/* y for every token count of `ntoks`, all in one buffer */
enum { ROWS = 200, COLS = 512, NTOKS = 4 };
static const int ntoks[NTOKS] = { 1, 2, 6, 67 };
static void run_all(lk_pool *p, const lk_mat *m, const float *x, float *y, void *scratch) {
    size_t off = 0;
    for (int k = 0; k < NTOKS; k++) {
        lk_matmul(p, m, x, COLS, ntoks[k], y + off, ROWS, scratch);
        off += (size_t)ROWS * ntoks[k];
    }
}

/* ROWS random rows of COLS in type t (rb bytes a row; f: COLS floats of
 * scratch), rows of five magnitudes */
static uint8_t *random_rows(lk_type t, size_t rb, float *f) {
    uint8_t *w = malloc(rb * ROWS);
    for (int r = 0; r < ROWS; r++) {
        for (int i = 0; i < COLS; i++) f[i] = frand() * (1 + r % 5);
        lk_quantize_row(t, f, w + (size_t)r * rb, COLS);
    }
    return w;
}

/* m's outputs under each of cand[0..nc), against ref (the defaults' on the
 * file type ft's rows); the cases compared */
static int all_settings_give(lk_pool *p, const lk_mat *m, const lk_tune_set *cand, int nc, const float *x,
                             const float *ref, float *y, size_t ny, void *scratch, const char *level, lk_type ft) {
    for (int c = 0; c < nc; c++) {
        lk_tune_apply(&cand[c]);
        memset(y, 0xff, sizeof(float) * ny);
        run_all(p, m, x, y, scratch);
        char s[64];
        lk_tune_format(&cand[c], s, sizeof s);
        CHECKF(!memcmp(y, ref, sizeof(float) * ny), "%s %s: %s differs from %s's defaults", level,
               lk_type_name(m->type), s, lk_type_name(ft));
    }
    return nc;
}

/* ref (lk_matmul over the pool: rows split into tasks, 67 tokens into
 * token blocks where the terms allow, the terms made once and handed to
 * every call) against one lk_quant_matmul call per token count on the whole
 * matrix, which derives everything itself */
static void one_call_gives(const lk_mat *m, const float *x, const float *ref, float *y, const char *level) {
    const lk_type at = lk_type_vec_dot(m->type);
    size_t arb = 0;
    CHECK(lk_type_row_bytes(at, COLS, &arb));
    uint8_t *a = malloc(arb * 67);
    size_t off = 0;
    int bad = 0;
    for (int k = 0; k < NTOKS; k++) {
        for (int i = 0; i < ntoks[k]; i++)
            if (at != LK_TYPE_F32) lk_quantize_row_act(at, x + (size_t)i * COLS, a + (size_t)i * arb, COLS);
        memset(y, 0xff, sizeof(float) * (size_t)ROWS * ntoks[k]);
        lk_quant_matmul(m->type, COLS, ROWS, m->data, m->row_stride, ntoks[k], at == LK_TYPE_F32 ? (const void *)x : a,
                        at == LK_TYPE_F32 ? sizeof(float) * COLS : arb, y, ROWS);
        bad += memcmp(y, ref + off, sizeof(float) * (size_t)ROWS * ntoks[k]) != 0;
        off += (size_t)ROWS * ntoks[k];
    }
    CHECKF(!bad, "%s %s: lk_matmul over the pool differs from one lk_quant_matmul call at %d of %d token counts",
           level, lk_type_name(m->type), bad, NTOKS);
    free(a);
}

TEST(matmul_bits_across_settings) {
    static const lk_type types[] = { LK_TYPE_Q4_0, LK_TYPE_Q8_0, LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K,
                                     LK_TYPE_Q5_0, LK_TYPE_Q5_1, LK_TYPE_Q2_K, LK_TYPE_Q3_K, LK_TYPE_F16,
                                     LK_TYPE_BF16, LK_TYPE_F32 };
    lk_tune_set cand[64];
    const int nc = settings(cand, 64);
    size_t ny = 0;
    for (int k = 0; k < NTOKS; k++) ny += (size_t)ROWS * ntoks[k];
    float *x = malloc(sizeof(float) * COLS * 67), *f = malloc(sizeof(float) * COLS);
    float *ref = malloc(sizeof(float) * ny), *y = malloc(sizeof(float) * ny);
    void *scratch = malloc(lk_matmul_scratch_bytes(COLS, 67));
    for (int i = 0; i < COLS * 67; i++) x[i] = frand();
    /* 3 threads on 2 cores: tasks get stolen */
    lk_pool *p = lk_pool_create(3);
    const char *levels[] = { "avx2", "avx512" };
    int compared = 0;
    for (int li = 0; li < 2; li++) {
        if (!lk_quant_set_simd(levels[li])) continue;
        for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
            const lk_type t = types[ti];
            if (!lk_quantize_supported(t)) continue;
            size_t rb = 0;
            CHECK(lk_type_row_bytes(t, COLS, &rb));
            uint8_t *w = random_rows(t, rb, f);
            const lk_mat m = { .type = t, .cols = COLS, .rows = ROWS, .data = w, .row_stride = rb };
            lk_tune_set d;
            lk_tune_defaults(&d);
            lk_tune_apply(&d);
            run_all(p, &m, x, ref, scratch);
            /* the defaults against one call of the kernel on the whole matrix */
            one_call_gives(&m, x, ref, y, levels[li]);
            compared += all_settings_give(p, &m, cand, nc, x, ref, y, ny, scratch, levels[li], t);
            /* the layout made at load (Q4_0 / Q8_0 / F16 at AVX-512, BF16
             * with AVX512_BF16 but not AMX-BF16; the K-quants on AMD CPUs):
             * the file rows' bits under every setting, F16_R16 and BF16_R16
             * (arithmetics of their own: quant_impl.h) their defaults' */
            const lk_type rt = lk_type_repacked(t, ROWS);
            if (rt != t) {
                uint8_t *w2 = malloc(rb * ROWS);
                lk_quant_repack(rt, t, COLS, ROWS, w, rb, w2);
                const lk_mat m2 = { .type = rt, .cols = COLS, .rows = ROWS, .data = w2, .row_stride = rb };
                const bool own = rt == LK_TYPE_F16_R16 || rt == LK_TYPE_BF16_R16;
                float *ref2 = own ? malloc(sizeof(float) * ny) : ref;
                if (own) {
                    lk_tune_apply(&d);
                    run_all(p, &m2, x, ref2, scratch);
                    one_call_gives(&m2, x, ref2, y, levels[li]);
                }
                compared += all_settings_give(p, &m2, cand, nc, x, ref2, y, ny, scratch, levels[li], own ? rt : t);
                if (own) free(ref2);
                free(w2);
            }
            free(w);
        }
    }
    printf("  %d (level, type, setting) cases, %d settings, token counts 1/2/6/67\n", compared, nc);
    CHECK(compared > 0);
    lk_quant_set_simd(lk_simd_level_name(lk_cpu()->level));
    lk_tune_set d;
    lk_tune_defaults(&d);
    lk_tune_apply(&d);
    lk_pool_free(p);
    free(x); free(f); free(ref); free(y); free(scratch);
}

/* prefill of 9 tokens, then 3 decode steps: every position's logits */
static float *model_logits(const char *rel, int *nout) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(lk_td(rel), &g, err, sizeof err) != LK_OK) return NULL;
    lk_model_params mp = { .n_ctx = 64, .n_threads = 3 };
    lk_model *m = NULL;
    if (lk_model_load(g, NULL, &mp, &m, err, sizeof err) != LK_OK) {
        printf("  %s: %s\n", rel, err);
        lk_gguf_close(g);
        return NULL;
    }
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    float *out = malloc(sizeof(float) * (size_t)nv * 12);
    int32_t toks[9];
    for (int i = 0; i < 9; i++) toks[i] = (int32_t)((i * 7919 + 13) % nv);
    bool ok = lk_model_forward(m, toks, 9, 0, 9, out) == LK_OK;
    for (int i = 0; i < 3 && ok; i++) {
        int32_t t = (int32_t)((i * 31 + 5) % nv);
        ok = lk_model_forward(m, &t, 1, 9 + i, 1, out + (size_t)nv * (9 + i)) == LK_OK;
    }
    lk_model_free(m);
    lk_gguf_close(g);
    if (!ok) { free(out); return NULL; }
    *nout = (int)nv * 12;
    return out;
}

TEST(model_logits_across_settings) {
    static const char *files[] = { "synth/synth-llama-q4_0.gguf", "synth/synth-llama-q4_k_m.gguf",
                                   "synth/synth-llama-f16.gguf" };
    lk_tune_set cand[64];
    const int nc = settings(cand, 64);
    for (size_t fi = 0; fi < sizeof files / sizeof *files; fi++) {
        if (!lk_td_have(files[fi])) { lk_td(files[fi]); continue; }
        /* the model load applies the tuner's choice (LK_TUNE): force each */
        setenv("LK_TUNE", "off", 1);
        int n = 0, n2 = 0;
        float *ref = model_logits(files[fi], &n);
        CHECKF(ref, "%s does not run", files[fi]);
        if (!ref) continue;
        int same = 0;
        for (int c = 0; c < nc; c++) {
            char s[128];
            lk_tune_format(&cand[c], s, sizeof s);
            setenv("LK_TUNE", s, 1);
            float *l = model_logits(files[fi], &n2);
            lk_tune_set now;
            lk_tune_get(&now);
            CHECKF(now.pf == cand[c].pf && now.split == cand[c].split && now.gemm_rows == cand[c].gemm_rows &&
                       now.gemm_tok == cand[c].gemm_tok && now.drows == cand[c].drows && now.droll == cand[c].droll && now.amx == cand[c].amx &&
                       now.amxf == cand[c].amxf && now.far == cand[c].far && now.hint == cand[c].hint,
                   "LK_TUNE=%s was not applied", s);
            CHECKF(l && n2 == n && !memcmp(l, ref, sizeof(float) * (size_t)n), "%s: %s gives other logits",
                   files[fi], s);
            same += l && n2 == n && !memcmp(l, ref, sizeof(float) * (size_t)n);
            free(l);
        }
        printf("  %s: %d of %d settings give the defaults' logits bit for bit\n", files[fi], same, nc);
        free(ref);
    }
    unsetenv("LK_TUNE");
    lk_tune_set d;
    lk_tune_defaults(&d);
    lk_tune_apply(&d);
}

/* The output product with the residual add in its tasks: r + W x in the
 * bits of lk_matmul then lk_vec_axpy_f32 (the serial add it replaces), for
 * every token count (67: token blocks) and thread split, and a non-finite
 * sum reported wherever it lands, never one that is not there. */
TEST(matmul_residual_bits) {
    static const lk_type types[] = { LK_TYPE_Q4_0, LK_TYPE_Q6_K, LK_TYPE_F16, LK_TYPE_F32 };
    static const int sps[] = { 1, 4, 16 };
    float *x = malloc(sizeof(float) * COLS * 67), *f = malloc(sizeof(float) * COLS);
    float *r0 = malloc(sizeof(float) * ROWS * 67), *ref = malloc(sizeof(float) * ROWS * 67);
    float *y = malloc(sizeof(float) * ROWS * 67), *r = malloc(sizeof(float) * ROWS * 67);
    void *scratch = malloc(lk_matmul_scratch_bytes(COLS, 67));
    for (int i = 0; i < COLS * 67; i++) x[i] = frand();
    for (int i = 0; i < ROWS * 67; i++) r0[i] = 4 * frand();
    lk_pool *p = lk_pool_create(3);
    lk_tune_set d;
    lk_tune_defaults(&d);
    int cases = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        const lk_type t = types[ti];
        if (!lk_quantize_supported(t)) continue;
        size_t rb = 0;
        CHECK(lk_type_row_bytes(t, COLS, &rb));
        uint8_t *w = random_rows(t, rb, f);
        const lk_mat m = { .type = t, .cols = COLS, .rows = ROWS, .data = w, .row_stride = rb };
        for (int k = 0; k < NTOKS; k++) {
            const int n = ntoks[k];
            lk_tune_apply(&d);
            lk_matmul(p, &m, x, COLS, n, y, ROWS, scratch);
            memcpy(ref, r0, sizeof(float) * ROWS * n);
            lk_vec_axpy_f32(ref, 1.0f, y, (int64_t)ROWS * n);
            for (size_t si = 0; si < sizeof sps / sizeof *sps; si++) {
                lk_tune_set s = d;
                s.split = sps[si];
                lk_tune_apply(&s);
                memcpy(r, r0, sizeof(float) * ROWS * n);
                const bool bad = lk_matmul_residual(p, &m, x, COLS, n, y, ROWS, r, scratch);
                CHECKF(!bad, "%s, %d tokens, split %d: a finite sum reported non-finite", lk_type_name(t), n, sps[si]);
                CHECKF(!memcmp(r, ref, sizeof(float) * ROWS * n), "%s, %d tokens, split %d: r + W x differs from "
                       "lk_matmul then lk_vec_axpy_f32", lk_type_name(t), n, sps[si]);
                /* an infinity in the last token's last row, then in the first's first */
                for (int e = 0; e < 2; e++) {
                    memcpy(r, r0, sizeof(float) * ROWS * n);
                    r[e ? 0 : ROWS * n - 1] = INFINITY;
                    CHECKF(lk_matmul_residual(p, &m, x, COLS, n, y, ROWS, r, scratch),
                           "%s, %d tokens, split %d: an infinite sum not reported", lk_type_name(t), n, sps[si]);
                }
                cases++;
            }
        }
        free(w);
    }
    printf("  %d (type, token count, split) cases\n", cases);
    CHECK(cases >= 3 * NTOKS * 3);
    lk_tune_apply(&d);
    lk_pool_free(p);
    free(x); free(f); free(r0); free(ref); free(y); free(r); free(scratch);
}

/* every task of every job exactly once, whatever thread runs it; jobs of
 * 1 to 64 tasks on a pool of 4 threads (2 cores: some are descheduled),
 * with and without a prefetch hint (lk_pool_prefetch: idle threads step
 * through it between their checks of the job's words) */
typedef struct { atomic_int *count; int n; } count_job;
static void count_fn(void *arg, int ith, int nth) {
    count_job *j = arg;
    if (nth != j->n || ith < 0 || ith >= nth) { atomic_fetch_add(&j->count[0], 1000); return; }
    atomic_fetch_add(&j->count[ith], 1);
}

TEST(pool_runs_each_task_once) {
    lk_pool *p = lk_pool_create(4);
    atomic_int count[64];
    int bad = 0;
    enum { HINT = 3 << 20 };
    char *hint = lk_xmalloc(HINT);
    memset(hint, 1, HINT);
    for (int it = 0; it < 20000; it++) {
        const int n = 1 + (it * 37) % 64;
        if (it % 500 == 0) { /* 1 to 3 regions, 4 KiB to 1 MiB, or none */
            const int nr = (it / 500) % 4;
            const void *base[3] = { hint, hint + (1 << 20), hint + (2 << 20) };
            const size_t len[3] = { (size_t)4096 << (it / 500 % 9), 777, 1 << 20 };
            lk_pool_prefetch(p, base, len, nr);
        }
        for (int i = 0; i < 64; i++) atomic_init(&count[i], 0);
        count_job j = { count, n };
        if (it % 3 == 0) {
            j.n = 4;
            lk_pool_run(p, count_fn, &j);
        } else lk_pool_run_n(p, count_fn, &j, n);
        for (int i = 0; i < j.n; i++) bad += atomic_load(&count[i]) != 1;
    }
    CHECKF(bad == 0, "%d tasks ran other than once", bad);
    lk_pool_prefetch(p, NULL, NULL, 0);
    lk_pool_free(p);
    free(hint);
}

static int read_file(const char *path, char *buf, size_t n) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t k = fread(buf, 1, n - 1, f);
    buf[k] = 0;
    fclose(f);
    return (int)k;
}

TEST(cache_file_and_env) {
    char dir[] = "/tmp/lk-test-tune-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    setenv("XDG_CACHE_HOME", dir, 1);
    unsetenv("LK_TUNE");
    char path[256], buf[4096];
    snprintf(path, sizeof path, "%s/lockstep/tune.txt", dir);
    lk_pool *p = lk_pool_create(2);
    /* a foreign file where the cache goes: a note, then rewritten */
    char sub[300];
    snprintf(sub, sizeof sub, "%s/lockstep", dir);
    mkdir(sub, 0755);
    FILE *f = fopen(path, "w");
    fputs("\x7f" "ELF not a cache\n\tpf=1\n", f);
    fclose(f);
    const uint64_t big = (uint64_t)8 << 30; /* past any cache */
    /* calibrate whatever the machine's load (a busy machine is not
     * calibrated unless asked) */
    setenv("LK_TUNE", "calibrate", 1);
    g_key[0] = 0;
    lk_tune_init(p, LK_TYPE_Q4_0, 1024, 1024, big, NULL, 0);
    unsetenv("LK_TUNE");
    CHECKF(strstr(lk_tune_report(), "calibrated"), "report: %s", lk_tune_report());
    CHECK(read_file(path, buf, sizeof buf) > 0);
    CHECKF(!strncmp(buf, CACHE_HEADER "\n", strlen(CACHE_HEADER) + 1) && strstr(buf, "q4_0 1024x1024\tpf="),
           "cache file: %s", buf);
    lk_tune_set chosen;
    lk_tune_get(&chosen);
    /* the next process (the key forgotten) reads it */
    g_key[0] = 0;
    lk_tune_set d;
    lk_tune_defaults(&d);
    lk_tune_apply(&d);
    lk_tune_init(p, LK_TYPE_Q4_0, 1024, 1024, big, NULL, 0);
    lk_tune_set now;
    lk_tune_get(&now);
    CHECKF(strstr(lk_tune_report(), "cached in"), "report: %s", lk_tune_report());
    CHECK(now.pf == chosen.pf && now.split == chosen.split && now.gemm_rows == chosen.gemm_rows);
    /* a corrupt line among good ones: noted, dropped, the good ones kept */
    f = fopen(path, "a");
    fputs("garbage without a tab\nkey\tpf=99\n", f);
    fclose(f);
    g_key[0] = 0;
    lk_tune_init(p, LK_TYPE_Q4_0, 1024, 1024, big, NULL, 0);
    CHECKF(strstr(lk_tune_report(), "cached in"), "report: %s", lk_tune_report());
    /* forced and skipped */
    setenv("LK_TUNE", "pf=3,split=5,gemm=2x16", 1);
    lk_tune_init(p, LK_TYPE_Q4_0, 1024, 1024, big, NULL, 0);
    lk_tune_get(&now);
    CHECK(now.pf == 3 && now.split == 5 && now.gemm_rows == 2 && now.gemm_chunk == 16);
    CHECKF(strstr(lk_tune_report(), "forced"), "report: %s", lk_tune_report());
    setenv("LK_TUNE", "pf=3,bogus=1", 1);
    lk_tune_init(p, LK_TYPE_Q4_0, 1024, 1024, big, NULL, 0);
    lk_tune_get(&now);
    CHECK(now.pf == d.pf && now.split == d.split && now.gemm_rows == 0);
    setenv("LK_TUNE", "off", 1);
    lk_tune_init(p, LK_TYPE_Q4_0, 1024, 1024, big, NULL, 0);
    CHECKF(strstr(lk_tune_report(), "--no-tune"), "report: %s", lk_tune_report());
    unsetenv("LK_TUNE");
    /* a small model is not calibrated */
    g_key[0] = 0;
    lk_tune_init(p, LK_TYPE_Q4_0, 1024, 1024, 1 << 20, NULL, 0);
    CHECKF(strstr(lk_tune_report(), "no calibration"), "report: %s", lk_tune_report());
    lk_tune_apply(&d);
    lk_pool_free(p);
    unlink(path);
    rmdir(sub);
    rmdir(dir);
    unsetenv("XDG_CACHE_HOME");
}

/* lk_tune_init times the model's own matrices of its type and shape or the
 * transpose (others skipped), from the first, as many as make the
 * calibration's size; with too few of them, a synthetic buffer */
TEST(calibrate_on_own_matrices) {
    char dir[] = "/tmp/lk-test-tune-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    setenv("XDG_CACHE_HOME", dir, 1);
    lk_pool *p = lk_pool_create(2);
    enum { ROWS_ = 1024, COLS_ = 4096, NM = 202 };
    size_t rb = 0, rb8 = 0;
    CHECK(lk_type_row_bytes(LK_TYPE_Q4_0, COLS_, &rb) && lk_type_row_bytes(LK_TYPE_Q8_0, COLS_, &rb8));
    uint8_t *w = malloc(rb * ROWS_), *w8 = malloc(rb8 * 16);
    float *f = malloc(sizeof(float) * COLS_);
    for (int r = 0; r < ROWS_; r++) {
        for (int i = 0; i < COLS_; i++) f[i] = frand();
        lk_quantize_row(LK_TYPE_Q4_0, f, w + (size_t)r * rb, COLS_);
        if (r < 16) lk_quantize_row(LK_TYPE_Q8_0, f, w8 + (size_t)r * rb8, COLS_);
    }
    /* every Q4_0 matrix reads the same bytes: the choice's speed is not the
     * point here, which matrices are timed is */
    lk_mat mats[NM], *own[NM];
    /* skipped: another type, then another shape */
    mats[0] = (lk_mat){ .type = LK_TYPE_Q8_0, .cols = COLS_, .rows = 16, .data = w8, .row_stride = rb8 };
    mats[1] = (lk_mat){ .type = LK_TYPE_Q4_0, .cols = COLS_, .rows = 16, .data = w, .row_stride = rb };
    for (int i = 2; i < NM; i++)
        mats[i] = (lk_mat){ .type = LK_TYPE_Q4_0, .cols = COLS_, .rows = ROWS_, .data = w, .row_stride = rb };
    for (int i = 0; i < NM; i++) own[i] = &mats[i];
    const size_t llc = lk_membw_llc_bytes();
    const size_t bytes = LK_MIN(LK_MAX(4 * llc, (size_t)128 << 20), (size_t)256 << 20);
    const int want = (int)((bytes + rb * ROWS_ - 1) / (rb * ROWS_));
    CHECK(want < NM);
    setenv("LK_TUNE", "calibrate", 1);
    g_key[0] = 0;
    lk_tune_init(p, LK_TYPE_Q4_0, COLS_, ROWS_, (uint64_t)8 << 30, own, NM);
    char expect[96];
    snprintf(expect, sizeof expect, "calibrated (the model's first %d q4_0 matrices", want);
    CHECKF(strstr(lk_tune_report(), expect), "report: %s (expected '%s')", lk_tune_report(), expect);
    CHECKF(strstr(lk_tune_report(), " -> pf="), "report: %s", lk_tune_report());
    /* too few of the type: the synthetic buffer of the shape */
    g_key[0] = 0;
    lk_tune_init(p, LK_TYPE_Q4_0, COLS_, ROWS_, (uint64_t)8 << 30, own, want + 1);
    CHECKF(strstr(lk_tune_report(), "calibrated (q4_0 1024 x 4096"), "report: %s", lk_tune_report());
    unsetenv("LK_TUNE");
    lk_tune_set d;
    lk_tune_defaults(&d);
    lk_tune_apply(&d);
    g_key[0] = 0;
    lk_pool_free(p);
    free(w);
    free(w8);
    free(f);
    char path[300];
    snprintf(path, sizeof path, "%s/lockstep/tune.txt", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/lockstep", dir);
    rmdir(path);
    rmdir(dir);
    unsetenv("XDG_CACHE_HOME");
}

TEST(parse_rejects_bad_specs) {
    static const char *bad[] = { "pf=9", "split=0", "split=17", "gemm=5", "gemm=2x65", "gemm=2x", "pf", "pf=1,", "x=1",
                                 "pf=-1", "pf=1;split=2", "gtok=4", "gtok=33", "gtok=",
                                 "drows=2", "drows=0", "drows=", "droll=2", "droll=-1", "droll=", "amx=", "amx=1025", "amx=-1", "amx=on",
                                 "amxf=", "amxf=1025", "amxf=-1", "amxf=on",
                                 "far=", "far=-1", "far=257", "far=16k", "hint=", "hint=2", "hint=-1", "hint=on" };
    char err[200];
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        lk_tune_set s;
        lk_tune_defaults(&s);
        CHECKF(!lk_tune_parse(bad[i], &s, err, sizeof err), "'%s' accepted", bad[i]);
    }
    lk_tune_set s;
    lk_tune_defaults(&s);
    CHECK(lk_tune_parse("gemm=off,split=16,pf=0", &s, err, sizeof err) && s.split == 16 && s.pf == 0);
    CHECK(lk_tune_parse("gtok=9", &s, err, sizeof err) && s.gemm_tok == 9);
    char buf[64];
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,gtok=9"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("gtok=0", &s, err, sizeof err) && s.gemm_tok == 0);
    CHECK(lk_tune_parse("drows=1", &s, err, sizeof err) && s.drows == 1);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,drows=1"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("drows=4", &s, err, sizeof err) && s.drows == 4);
    CHECK(lk_tune_parse("droll=1", &s, err, sizeof err) && s.droll == 1);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,droll=1"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("droll=0", &s, err, sizeof err) && s.droll == 0);
    s.droll = -1;
    CHECK(lk_tune_parse("amx=off", &s, err, sizeof err) && s.amx == 0);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,amx=off"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("amx=1024", &s, err, sizeof err) && s.amx == 1024);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,amx=1024"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("amx=0", &s, err, sizeof err) && s.amx == 0);
    s.amx = -1;
    CHECK(lk_tune_parse("amxf=off", &s, err, sizeof err) && s.amxf == 0);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,amxf=off"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("amxf=16", &s, err, sizeof err) && s.amxf == 16);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,amxf=16"), "formatted as '%s'", buf);
    s.amxf = -1;
    CHECK(lk_tune_parse("far=0", &s, err, sizeof err) && s.far == 0);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,far=0"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("far=256", &s, err, sizeof err) && s.far == 256);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,far=256"), "formatted as '%s'", buf);
    s.far = -1;
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off"), "formatted as '%s' (far -1 is the default)", buf);
    CHECK(lk_tune_parse("hint=0", &s, err, sizeof err) && s.hint == 0);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off,hint=0"), "formatted as '%s'", buf);
    CHECK(lk_tune_parse("hint=1", &s, err, sizeof err) && s.hint == 1);
    lk_tune_format(&s, buf, sizeof buf);
    CHECKF(!strcmp(buf, "pf=0,split=16,gemm=off"), "formatted as '%s' (hint 1 is the default)", buf);
}

int main(void) {
    /* where the CPU has AVX-512 but no AMX, the AMX settings run its kernel
     * with emulated tiles (quant.h), so that they are compared here too */
    if (!lk_quant_amx_have()) {
        lk_quant_amx_emulate(true);
        printf("  (no AMX on this CPU: its settings run the emulated tiles at the AVX-512 level)\n");
    }
    RUN(parse_rejects_bad_specs);
    RUN(pool_runs_each_task_once);
    RUN(matmul_bits_across_settings);
    RUN(matmul_residual_bits);
    RUN(model_logits_across_settings);
    RUN(cache_file_and_env);
    RUN(calibrate_on_own_matrices);
    return lk_test_end();
}
