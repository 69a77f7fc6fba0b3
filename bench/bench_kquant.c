/* bench_kquant — the weight quantisers of `quantize` and `gen-model`
 * (Q2_K..Q6_K, Q4_0, Q8_0) per SIMD level: elements per second of this
 * thread's CPU time (so a loaded machine's other processes count less),
 * best of 3 runs over 256 Ki elements of a sum of 4 uniforms.
 *
 *   make B=build build/bench/bench_kquant
 *   build/bench/bench_kquant [type...]        (default: every type above) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant/quant.h"

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    enum { N = 256 * 1024 };
    static const char *all[] = {"q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "q8_0"};
    static const char *levels[] = {"scalar", "avx2", "avx512"};
    float *x = malloc((size_t)N * sizeof *x);
    uint8_t *out = malloc((size_t)N * 2);
    uint64_t s = 88172645463325252ull;
    for (int i = 0; i < N; i++) {
        double a = 0;
        for (int k = 0; k < 4; k++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            a += (double)(s >> 11) / 9007199254740992.0 - 0.5;
        }
        x[i] = (float)(a * 0.05);
    }
    const int ntypes = argc > 1 ? argc - 1 : (int)(sizeof all / sizeof all[0]);
    for (int ti = 0; ti < ntypes; ti++) {
        const char *name = argc > 1 ? argv[ti + 1] : all[ti];
        lk_type t;
        if (!lk_type_from_name(name, &t) || !lk_quantize_supported(t)) {
            fprintf(stderr, "bench_kquant: %s is not a type lockstep quantises to\n", name);
            return 2;
        }
        for (int l = 0; l < 3; l++) {
            if (!lk_quant_set_simd(levels[l])) continue;
            double best = 1e30;
            for (int r = 0; r < 3; r++) {
                double t0 = cpu_s();
                lk_quantize_row(t, x, out, N);
                double d = cpu_s() - t0;
                if (d < best) best = d;
            }
            printf("%-5s %-6s %7.2f M elements/s\n", name, levels[l], N / best / 1e6);
        }
    }
    free(x);
    free(out);
    return 0;
}
