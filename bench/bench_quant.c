/* bench_quant — memory bandwidth probe and lk_quant_matmul decode/prefill
 * throughput per weight type and SIMD level, one thread.
 *
 *   make B=build build/bench/bench_quant
 *   build/bench/bench_quant [rows cols] [ntok]    (defaults 2048 5632, no prefill)
 *   env: BENCH_LEVEL=scalar|avx2|avx512, BENCH_TYPE=q4_0..., BENCH_BYTES=probe size,
 *        BENCH_GEMM=R,C (the AVX2 GEMM's rows per pass and token chunk; 0 = default; R -1: off)
 *        BENCH_PF=N, BENCH_DROWS=4|1 (decode prefetch distance and rows per tile, as --tune sets them)
 *        BENCH_FAR=KB (the repacked Q4_0/Q8_0 decode's far prefetch, as --tune's far; -1: the type's default)
 *        BENCH_AB=G1,G2 (prefill from memory under gtok=G1 and G2, alternating; 0 = the default)
 *        BENCH_AMXAB=1 (the same with AMX's tiles off and on, where the CPU has AMX)
 *        BENCH_AMX=N (AMX from N tokens on; 0 = off; lk_quant_set_amx)
 *        BENCH_PAIRED=N (decode: N passes over the copies, each after a probe
 *        pass over the same bytes; prints the median of the N ratios, which
 *        the machine's bandwidth of the moment moves far less than the
 *        figure against a probe made seconds before)
 *
 * Decode: a 2048 x 5632 matrix (rows x cols) times one activation row. The
 * L3 of a server may hold that matrix, so the benchmark cycles through
 * enough copies to exceed the probe's buffer and reports weight bytes / time
 * next to the probe's GB/s (the memory-bandwidth bound). */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "kernels/membw.h"
#include "quant/quant.h"

static int cmp_dbl(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

/* ---- the compute peak of one core, the bound of a prefill (as the probe's
 * GB/s is the bound of a decode): 12 independent accumulator chains, so
 * the pipes' throughput, not an instruction's latency, sets the pace;
 * best of 5 passes of 20M instructions each. Products per instruction:
 * fp32 FMA 16 (zmm) or 8 (ymm), vdpbf16ps 32, vpdpbusd 64. */
#include <immintrin.h>
#define PEAK_ITERS 1666667L /* x 12 instructions per pass */
/* the chains start from 12 different values: from equal ones the compiler
 * folds them into one chain and the probe times an instruction's latency */
#define PEAK_LOOP(T, init, op)                                                               \
    T c0 = init(0), c1 = init(1), c2 = init(2), c3 = init(3), c4 = init(4), c5 = init(5),    \
      c6 = init(6), c7 = init(7), c8 = init(8), c9 = init(9), c10 = init(10), c11 = init(11); \
    for (long i = 0; i < PEAK_ITERS; i++) {                                                  \
        c0 = op(c0); c1 = op(c1); c2 = op(c2); c3 = op(c3); c4 = op(c4); c5 = op(c5);        \
        c6 = op(c6); c7 = op(c7); c8 = op(c8); c9 = op(c9); c10 = op(c10); c11 = op(c11);    \
    }
__attribute__((target("avx512f"))) static float peak_fma512(float s) {
    const __m512 x = _mm512_set1_ps(s), m = _mm512_set1_ps(0.999f);
#define OP(c) _mm512_fmadd_ps(c, m, x)
#define INIT(k) _mm512_set1_ps(s + (float)(k))
    PEAK_LOOP(__m512, INIT, OP)
#undef INIT
#undef OP
    return _mm512_reduce_add_ps(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11);
}
__attribute__((target("avx2,fma"))) static float peak_fma256(float s) {
    const __m256 x = _mm256_set1_ps(s), m = _mm256_set1_ps(0.999f);
#define OP(c) _mm256_fmadd_ps(c, m, x)
#define INIT(k) _mm256_set1_ps(s + (float)(k))
    PEAK_LOOP(__m256, INIT, OP)
#undef INIT
#undef OP
    float r[8];
    _mm256_storeu_ps(r, c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11);
    return r[0] + r[7];
}
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static float peak_bf16(float s) {
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80 + (short)s);
#define OP(c) _mm512_dpbf16_ps(c, x, x)
#define INIT(k) _mm512_set1_ps(s + (float)(k))
    PEAK_LOOP(__m512, INIT, OP)
#undef INIT
#undef OP
    return _mm512_reduce_add_ps(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11);
}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static float peak_vnni(float s) {
    const __m512i x = _mm512_set1_epi8((char)(1 + (int)s));
#define OP(c) _mm512_dpbusd_epi32(c, x, x)
#define INIT(k) _mm512_set1_epi32((int)s + (k))
    PEAK_LOOP(__m512i, INIT, OP)
#undef INIT
#undef OP
    __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    t = _mm512_add_epi32(t, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
    return (float)_mm512_reduce_add_epi32(t);
}
#undef PEAK_LOOP
/* GFLOP/s (2 per product) of fn, best of 5 passes */
static double peak_rate(float (*fn)(float), int products) {
    static volatile float sink;
    double best = 1e30;
    for (int k = 0; k < 5; k++) {
        double t0 = lk_time_s();
        sink += fn((float)k);
        best = LK_MIN(best, lk_time_s() - t0);
    }
    return 2.0 * products * 12.0 * PEAK_ITERS / best / 1e9;
}

static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

int main(int argc, char **argv) {
    int64_t rows = argc > 2 ? atoll(argv[1]) : 2048, cols = argc > 2 ? atoll(argv[2]) : 5632;
    int64_t ntok_pf = argc > 3 ? atoll(argv[3]) : 0;
    size_t llc = lk_membw_llc_bytes();
    size_t probe_bytes = llc ? 4 * llc : (size_t)1 << 30;
    if (probe_bytes < ((size_t)1 << 30)) probe_bytes = (size_t)1 << 30;
    const char *genv = getenv("BENCH_GEMM");
    if (genv) {
        int gr = 0, gc = 0;
        if (sscanf(genv, "%d,%d", &gr, &gc) != 2 || gr < -1 || gr > 4 || gc < 0 || gc > 64) {
            fprintf(stderr, "bench_quant: BENCH_GEMM must be R,C with R -1..4 and C 0..64 (got '%s')\n", genv);
            return 2;
        }
        lk_quant_gemm_avx2_force(gr, gc);
    }
    const char *env = getenv("BENCH_BYTES");
    if (env) probe_bytes = (size_t)atoll(env);
    double bw1 = lk_membw_read_gbs(1, probe_bytes, 7);
    double bw2 = lk_membw_read_gbs(2, probe_bytes, 7);
    printf("membw: LLC %zu MiB, probe %zu MiB: 1 thread %.2f GB/s, 2 threads %.2f GB/s\n",
           llc >> 20, probe_bytes >> 20, bw1, bw2);
    /* the compute peaks (one thread) of the arithmetic the prefill kernels use */
    const lk_cpu_info *ci = lk_cpu();
    double pk_f32 = (ci->feat & LK_CPU_AVX512F) ? peak_rate(peak_fma512, 16)
                    : (ci->feat & LK_CPU_AVX2) ? peak_rate(peak_fma256, 8) : 0;
    double pk_bf = (ci->feat & LK_CPU_AVX512BF16) ? peak_rate(peak_bf16, 32) : 0;
    double pk_i8 = (ci->feat & LK_CPU_AVX512VNNI) ? peak_rate(peak_vnni, 64) : 0;
    printf("peak, one thread: fp32 FMA %.1f GFLOP/s, bf16 dot (vdpbf16ps) %.1f, int8 dot (vpdpbusd) %.1f GOP/s (0: absent)\n",
           pk_f32, pk_bf, pk_i8);
    lk_type types[] = {LK_TYPE_Q4_0, LK_TYPE_Q4_0_R16, LK_TYPE_Q8_0, LK_TYPE_Q8_0_R16, LK_TYPE_Q4_K, LK_TYPE_Q4_K_R16, LK_TYPE_Q5_K,
                       LK_TYPE_Q5_K_R16, LK_TYPE_Q6_K, LK_TYPE_Q6_K_R16, LK_TYPE_F16, LK_TYPE_F16_R16, LK_TYPE_BF16, LK_TYPE_BF16_R16, LK_TYPE_F32, LK_TYPE_Q5_0, LK_TYPE_Q5_1,
                       LK_TYPE_Q2_K, LK_TYPE_Q3_K, LK_TYPE_IQ4_XS};
    const char *levels[] = {"scalar", "avx2", "avx512"};
    const char *only = getenv("BENCH_LEVEL");
    const char *only_t = getenv("BENCH_TYPE");
    /* decode tuning settings, as --tune pf=N / drows=N would set them */
    if (getenv("BENCH_PF")) lk_quant_set_prefetch(atoi(getenv("BENCH_PF")));
    if (getenv("BENCH_FAR")) lk_quant_set_far(atoi(getenv("BENCH_FAR")));
    if (getenv("BENCH_AMX")) lk_quant_set_amx(atoi(getenv("BENCH_AMX")));
    if (getenv("BENCH_DROWS")) lk_quant_set_dec_rows(atoi(getenv("BENCH_DROWS")));
    float *x = malloc((size_t)cols * 4 * (ntok_pf ? ntok_pf : 1));
    for (int64_t i = 0; i < cols * (ntok_pf ? ntok_pf : 1); i++) x[i] = (float)((int64_t)(rnd() % 2001) - 1000) / 1000.f;
    float *y = malloc((size_t)rows * 4 * (ntok_pf ? ntok_pf : 1));
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        lk_type t = types[ti];
        if (only_t && strcmp(only_t, lk_type_name(t))) continue;
        size_t rb, arb;
        lk_type_row_bytes(t, cols, &rb);
        lk_type_row_bytes(lk_type_vec_dot(t), cols, &arb);
        size_t mat = rb * (size_t)rows;
        int copies = (int)((probe_bytes + mat - 1) / mat);
        /* on huge pages where the kernel gives them, as the model's weights
         * (model.c: weights_to_arena) */
        const size_t wlen = (mat * (size_t)copies + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
        uint8_t *w = aligned_alloc(2u << 20, wlen);
        madvise(w, wlen, MADV_HUGEPAGE);
        /* one copy of real-looking data (quantised random values, or random
         * quants with sane fp16 scales for the K-quants), then replicated */
        float *tmp = malloc((size_t)cols * 4);
        for (size_t i = 0; i < mat; i++) w[i] = (uint8_t)rnd();
        /* lockstep's own layouts: the file type's rows, repacked */
        const lk_type ft = lk_type_file(t);
        if (lk_quantize_supported(ft)) {
            for (int64_t r = 0; r < rows; r++) {
                for (int64_t i = 0; i < cols; i++) tmp[i] = (float)((int64_t)(rnd() % 2001) - 1000) / 1000.f;
                lk_quantize_row(ft, tmp, w + (size_t)r * rb, cols);
            }
        } else {
            size_t bb = lk_type_block_bytes(t);
            size_t doff = ft == LK_TYPE_Q6_K ? 208 : 0; /* the fp16 scale (IQ4_XS: at 0) */
            for (size_t b = 0; b < mat / bb; b++) {
                uint16_t h = 0x2000 | (uint16_t)(rnd() & 0x3ff);
                memcpy(w + b * bb + doff, &h, 2);
                if (ft != LK_TYPE_Q6_K) memcpy(w + b * bb + 2, &h, 2);
            }
        }
        if (ft != t) {
            uint8_t *q = malloc(mat);
            memcpy(q, w, mat);
            lk_quant_repack(t, ft, cols, rows, q, rb, w);
            free(q);
        }
        for (int c = 1; c < copies; c++) memcpy(w + (size_t)c * mat, w, mat);
        uint8_t *a = malloc(arb * (size_t)(ntok_pf ? ntok_pf : 1));
        lk_quantize_row(lk_type_vec_dot(t), x, a, cols);
        for (int l = 0; l < 3; l++) {
            if (only && strcmp(only, levels[l])) continue;
            if (!lk_quant_set_simd(levels[l])) continue;
            /* warm-up pass over all copies, then time passes until 0.5 s */
            for (int c = 0; c < copies; c++)
                lk_quant_matmul(t, cols, rows, w + (size_t)c * mat, rb, 1, a, arb, y, (size_t)rows);
            double t0 = lk_time_s(), el;
            long calls = 0;
            do {
                for (int c = 0; c < copies; c++, calls++)
                    lk_quant_matmul(t, cols, rows, w + (size_t)c * mat, rb, 1, a, arb, y, (size_t)rows);
                el = lk_time_s() - t0;
            } while (el < (l == 0 ? 0.3 : 1.0));
            double gbs = (double)mat * (double)calls / el / 1e9;
            /* hot: the same matrix again and again (from cache if it fits) */
            double t1 = lk_time_s(), el2;
            long calls2 = 0;
            do {
                lk_quant_matmul(t, cols, rows, w, rb, 1, a, arb, y, (size_t)rows);
                calls2++;
                el2 = lk_time_s() - t1;
            } while (el2 < 0.3);
            printf("decode %-5s %-6s %6.2f MB  %7.2f GB/s streamed (%3.0f%% of probe)  %7.2f GB/s hot  %.3f ms/matvec\n",
                   lk_type_name(t), levels[l], mat / 1e6, gbs, 100 * gbs / bw1,
                   (double)mat * calls2 / el2 / 1e9, el / calls * 1e3);
            const int npair = getenv("BENCH_PAIRED") ? atoi(getenv("BENCH_PAIRED")) : 0;
            if (npair > 0) {
                double *pr = malloc(sizeof(double) * 3 * (size_t)npair), *kr = pr + npair, *rr = kr + npair;
                for (int ps = 0; ps < npair; ps++) {
                    pr[ps] = lk_membw_read_once(w, mat * (size_t)copies);
                    const double ts = lk_time_s();
                    for (int c = 0; c < copies; c++)
                        lk_quant_matmul(t, cols, rows, w + (size_t)c * mat, rb, 1, a, arb, y, (size_t)rows);
                    kr[ps] = (double)mat * copies / (lk_time_s() - ts) / 1e9;
                    rr[ps] = kr[ps] / pr[ps];
                }
                qsort(pr, (size_t)npair, sizeof(double), cmp_dbl);
                qsort(kr, (size_t)npair, sizeof(double), cmp_dbl);
                qsort(rr, (size_t)npair, sizeof(double), cmp_dbl);
                printf("paired %-5s %-6s %d passes: kernel / probe of the same bytes median %.1f %% (%.1f-%.1f), "
                       "kernel %.2f GB/s, probe %.2f GB/s (medians)\n",
                       lk_type_name(t), levels[l], npair, 100 * rr[npair / 2], 100 * rr[0], 100 * rr[npair - 1],
                       kr[npair / 2], pr[npair / 2]);
                free(pr);
            }
            if (ntok_pf > 1) {
                for (int64_t k = 0; k < ntok_pf; k++)
                    lk_quantize_row(lk_type_vec_dot(t), x + k * cols, a + (size_t)k * arb, cols);
                double t2 = lk_time_s(), el3;
                long calls3 = 0;
                do {
                    lk_quant_matmul(t, cols, rows, w, rb, ntok_pf, a, arb, y, (size_t)rows);
                    calls3++;
                    el3 = lk_time_s() - t2;
                } while (el3 < 0.5);
                const double gf = 2.0 * rows * cols * ntok_pf * calls3 / el3 / 1e9;
                printf("prefill %-5s %-6s ntok %lld: %.2f GFLOP/s  %.2f ms  (%.0f %% of the fp32 FMA peak)\n",
                       lk_type_name(t), levels[l], (long long)ntok_pf, gf, el3 / calls3 * 1e3,
                       pk_f32 > 0 ? 100 * gf / pk_f32 : 0);
                /* cold: each call on the next copy, so weights come from
                 * memory as in a model (every matrix read once per chunk) */
                t2 = lk_time_s();
                calls3 = 0;
                do {
                    for (int c = 0; c < copies; c++, calls3++)
                        lk_quant_matmul(t, cols, rows, w + (size_t)c * mat, rb, ntok_pf, a, arb, y, (size_t)rows);
                    el3 = lk_time_s() - t2;
                } while (el3 < 0.5);
                printf("prefill %-5s %-6s ntok %lld: %.2f GFLOP/s  %.2f ms (weights from memory, %d copies)\n",
                       lk_type_name(t), levels[l], (long long)ntok_pf, 2.0 * rows * cols * ntok_pf * calls3 / el3 / 1e9,
                       el3 / calls3 * 1e3, copies);
                /* BENCH_AB=G1,G2: the same from memory under two GEMM
                 * thresholds (as --tune gtok=G sets them), alternating pass
                 * by pass, so that both see the machine in the same moments;
                 * BENCH_AMXAB=1: the same with AMX's tiles off and on */
                int g[2];
                const bool amx_ab = getenv("BENCH_AMXAB") && lk_quant_amx_have();
                if (amx_ab) g[0] = 0, g[1] = 1;
                if (amx_ab || (getenv("BENCH_AB") && sscanf(getenv("BENCH_AB"), "%d,%d", &g[0], &g[1]) == 2)) {
                    enum { PASSES = 41 };
                    double ms[2][PASSES];
                    for (int ps = 0; ps < PASSES; ps++)
                        for (int v = 0; v < 2; v++) {
                            if (amx_ab) lk_quant_set_amx(g[v]);
                            else lk_quant_set_gemm_tok(g[v]);
                            const double ts = lk_time_s();
                            for (int c = 0; c < copies; c++)
                                lk_quant_matmul(t, cols, rows, w + (size_t)c * mat, rb, ntok_pf, a, arb, y, (size_t)rows);
                            ms[v][ps] = (lk_time_s() - ts) / copies * 1e3;
                        }
                    lk_quant_set_gemm_tok(0);
                    lk_quant_set_amx(-1);
                    double med[2];
                    for (int v = 0; v < 2; v++) {
                        qsort(ms[v], PASSES, sizeof(double), cmp_dbl);
                        med[v] = ms[v][PASSES / 2];
                    }
                    printf("prefill %-5s %-6s ntok %lld from memory, %s %d / %d alternating: %.3f / %.3f ms "
                           "(median of %d), %.2f / %.2f GFLOP/s, ratio %.3f\n", lk_type_name(t), levels[l],
                           (long long)ntok_pf, amx_ab ? "amx" : "gtok", g[0], g[1], med[0], med[1], PASSES,
                           2.0 * rows * cols * ntok_pf / med[0] / 1e6, 2.0 * rows * cols * ntok_pf / med[1] / 1e6,
                           med[0] / med[1]);
                }
            }
        }
        free(w); free(a); free(tmp);
    }
    free(x); free(y);
    return 0;
}
