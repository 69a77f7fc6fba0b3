/* bench_quant — memory bandwidth probe and lk_quant_matmul decode/prefill
 * throughput per weight type and SIMD level, one thread.
 *
 *   make B=build build/bench/bench_quant
 *   build/bench/bench_quant [rows cols] [ntok]    (defaults 2048 5632, no prefill)
 *   env: BENCH_LEVEL=scalar|avx2|avx512, BENCH_TYPE=q4_0..., BENCH_BYTES=probe size,
 *        BENCH_GEMM=R,C (the AVX2 GEMM's rows per pass and token chunk; 0 = default; R -1: off)
 *
 * Decode: a 2048 x 5632 matrix (rows x cols) times one activation row. The
 * L3 of a server may hold that matrix, so the benchmark cycles through
 * enough copies to exceed the probe's buffer and reports weight bytes / time
 * next to the probe's GB/s (the memory-bandwidth bound). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/membw.h"
#include "quant/quant.h"

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
    lk_type types[] = {LK_TYPE_Q4_0, LK_TYPE_Q8_0, LK_TYPE_Q4_K, LK_TYPE_Q5_K, LK_TYPE_Q6_K,
                       LK_TYPE_F16, LK_TYPE_BF16, LK_TYPE_F32, LK_TYPE_Q5_0, LK_TYPE_Q5_1,
                       LK_TYPE_Q2_K, LK_TYPE_Q3_K, LK_TYPE_IQ4_XS};
    const char *levels[] = {"scalar", "avx2", "avx512"};
    const char *only = getenv("BENCH_LEVEL");
    const char *only_t = getenv("BENCH_TYPE");
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
        uint8_t *w = malloc(mat * (size_t)copies);
        /* one copy of real-looking data (quantised random values, or random
         * quants with sane fp16 scales for the K-quants), then replicated */
        float *tmp = malloc((size_t)cols * 4);
        for (size_t i = 0; i < mat; i++) w[i] = (uint8_t)rnd();
        if (lk_quantize_supported(t))
            for (int64_t r = 0; r < rows; r++) {
                for (int64_t i = 0; i < cols; i++) tmp[i] = (float)((int64_t)(rnd() % 2001) - 1000) / 1000.f;
                lk_quantize_row(t, tmp, w + (size_t)r * rb, cols);
            }
        else {
            size_t bb = lk_type_block_bytes(t);
            size_t doff = t == LK_TYPE_Q6_K ? 208 : 0; /* the fp16 scale (IQ4_XS: at 0) */
            for (size_t b = 0; b < mat / bb; b++) {
                uint16_t h = 0x2000 | (uint16_t)(rnd() & 0x3ff);
                memcpy(w + b * bb + doff, &h, 2);
                if (t != LK_TYPE_Q6_K) memcpy(w + b * bb + 2, &h, 2);
            }
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
                printf("prefill %-5s %-6s ntok %lld: %.2f GFLOP/s  %.2f ms\n", lk_type_name(t), levels[l],
                       (long long)ntok_pf, 2.0 * rows * cols * ntok_pf * calls3 / el3 / 1e9, el3 / calls3 * 1e3);
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
            }
        }
        free(w); free(a); free(tmp);
    }
    free(x); free(y);
    return 0;
}
