/* bench_act — the activations' pass of one decode token: what the calling
 * thread does alone before every matrix product while the pool waits
 * (RMSNorm, then quantising the row to the weights' activation type).
 *
 *   make B=build build/bench/bench_act
 *   build/bench/bench_act [width,..]   (default 2048,5632: TinyLlama's model
 *                                       width and FFN width)
 *
 * Hot in cache (the same row again and again), so it times the arithmetic,
 * not the row's trip from the cores that wrote it. Prints per width the
 * median and best of 2000 calls of RMSNorm and of each quantiser (Q8_K: the
 * K-quants' activations, Q8_0: Q4_0/Q8_0's, F16: F16's), at the SIMD level
 * the CPU runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "quant/quant.h"

enum { REPS = 2000 };

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* median and best, ns */
static void report(const char *what, int64_t n, uint64_t *t) {
    qsort(t, REPS, sizeof *t, cmp_u64);
    printf("%-10s n=%-6lld median %6.0f ns  best %6.0f ns\n", what, (long long)n, (double)t[REPS / 2], (double)t[0]);
}

int main(int argc, char **argv) {
    const char *widths = argc > 1 ? argv[1] : "2048,5632";
    if (argc > 1 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        printf("usage: bench_act [width,..]   widths: multiples of 256 (default 2048,5632)\n");
        return 0;
    }
    printf("vector level %s, quant level %s\n", lk_vec_simd_name(), lk_quant_simd_name());
    static uint64_t t[REPS];
    for (const char *s = widths; *s;) {
        char *end;
        const long long n = strtoll(s, &end, 10);
        if (end == s || n <= 0 || n % 256 || n > (1 << 20)) {
            fprintf(stderr, "bench_act: bad width '%s' (a multiple of 256, at most 1048576)\n", s);
            return 2;
        }
        s = *end == ',' ? end + 1 : end;
        float *x = lk_xmalloc_aligned(sizeof(float) * (size_t)n), *w = lk_xmalloc_aligned(sizeof(float) * (size_t)n),
              *xn = lk_xmalloc_aligned(sizeof(float) * (size_t)n);
        void *q = lk_xmalloc_aligned(2 * (size_t)n + 64);
        srand(1);
        for (long long i = 0; i < n; i++) {
            x[i] = (float)((double)rand() / RAND_MAX) - 0.5f;
            w[i] = 1.0f + (float)((double)rand() / RAND_MAX);
        }
        for (int r = 0; r < REPS; r++) {
            const uint64_t t0 = lk_time_ns();
            lk_rmsnorm(xn, x, w, n, 1e-5f);
            t[r] = lk_time_ns() - t0;
        }
        report("rmsnorm", n, t);
        const lk_type ts[] = {LK_TYPE_Q8_K, LK_TYPE_Q8_0, LK_TYPE_F16};
        for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) {
            for (int r = 0; r < REPS; r++) {
                const uint64_t t0 = lk_time_ns();
                lk_quantize_row_act(ts[k], xn, q, n);
                t[r] = lk_time_ns() - t0;
            }
            report(lk_type_name(ts[k]), n, t);
        }
        free(x); free(w); free(xn); free(q);
    }
    return 0;
}
