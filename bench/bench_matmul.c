/* bench_matmul — the matrices of a whole model's layers through lk_matmul
 * on the pool, at several thread counts, token counts and thread splits,
 * beside what the same cores do without synchronising (each thread walks
 * its own rows of every matrix, one call each, no job per matrix).
 *
 *   make B=build build/bench/bench_matmul
 *   build/bench/bench_matmul [threads,..] [ntok,..] [split,..] [layers]
 *   (defaults 1,16  1,16  4  22; env BENCH_TYPE=q4_0, BENCH_SHAPE=d,ff,kv
 *   with defaults 2048,5632,256: TinyLlama-1.1B)
 *
 * Per layer: Q/K/V fused (d -> d + 2 kv), O (d -> d), gate/up fused with
 * SwiGLU (d -> 2 ff), down (ff -> d), as the model calls them. All layers'
 * weights together exceed the L3 of most machines, as a model's do.
 * Prints GFLOP/s in all and per thread, and for the same work:
 *   pool:    lk_matmul per matrix (activation pass + rows over the pool);
 *   hinted:  the same, each product first naming the next one's weights
 *            (lk_matmul_prefetch_next, as the model does), so the threads
 *            left without work prefetch their share of them; timed in
 *            alternation with `pool`, and the median of the rounds' ratios;
 *   private: one task per thread, each doing its rows of every matrix of
 *            every layer in one go (the cores' own rate under full load:
 *            no dispatch, no waiting on the slowest), its share of each
 *            matrix in `split` calls as the pool's tasks would be. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "quant/quant.h"

static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

typedef struct { lk_mat q, k, v, o, g, u, d; } layer;

static void fill_mat(lk_mat *m, lk_type t, int64_t rows, int64_t cols) {
    size_t rb = 0;
    if (!lk_type_row_bytes(t, cols, &rb)) {
        fprintf(stderr, "bench_matmul: a row of %lld columns is no whole number of %s blocks (BENCH_SHAPE)\n",
                (long long)cols, lk_type_name(t));
        exit(2);
    }
    uint8_t *w = aligned_alloc(64, (rb * (size_t)rows + 63) & ~(size_t)63);
    float *tmp = malloc((size_t)cols * 4);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < cols; i++) tmp[i] = (float)((int64_t)(rnd() % 2001) - 1000) / 1000.f;
        if (r < 64) lk_quantize_row(t, tmp, w + (size_t)r * rb, cols);
        else memcpy(w + (size_t)r * rb, w + (size_t)(r % 64) * rb, rb); /* fast to build, still distinct pages */
    }
    free(tmp);
    *m = (lk_mat){ .type = t, .cols = cols, .rows = rows, .data = w, .row_stride = rb };
}

typedef struct {
    layer *L;
    int nl;
    int64_t ntok, d, ff, kv;
    const float *x, *xf;
    float *yq, *yk, *yv, *yo, *yg, *yu, *yd;
    const void *a_d, *a_f; /* quantised activations for private mode */
    size_t as_d, as_f;
    int reps;
} work;

static int g_chunks = 1; /* calls per thread per matrix in private mode (the split) */

static void mm_rows(const lk_mat *W, int64_t ntok, const void *a, size_t as, float *y, int64_t ys, int ith,
                    int nth) {
    for (int c = 0; c < g_chunks; c++) {
        int64_t r0, r1;
        lk_split_range(W->rows, 16, ith * g_chunks + c, nth * g_chunks, &r0, &r1);
        if (r1 > r0)
            lk_quant_matmul(W->type, W->cols, r1 - r0, (const char *)W->data + (size_t)r0 * W->row_stride,
                            W->row_stride, ntok, a, as, y + r0, (size_t)ys);
    }
}

static void private_fn(void *arg, int ith, int nth) {
    work *w = arg;
    for (int rep = 0; rep < w->reps; rep++)
        for (int l = 0; l < w->nl; l++) {
            layer *L = &w->L[l];
            mm_rows(&L->q, w->ntok, w->a_d, w->as_d, w->yq, w->d, ith, nth);
            mm_rows(&L->k, w->ntok, w->a_d, w->as_d, w->yk, w->kv, ith, nth);
            mm_rows(&L->v, w->ntok, w->a_d, w->as_d, w->yv, w->kv, ith, nth);
            mm_rows(&L->o, w->ntok, w->a_d, w->as_d, w->yo, w->d, ith, nth);
            mm_rows(&L->g, w->ntok, w->a_d, w->as_d, w->yg, w->ff, ith, nth);
            mm_rows(&L->u, w->ntok, w->a_d, w->as_d, w->yu, w->ff, ith, nth);
            mm_rows(&L->d, w->ntok, w->a_f, w->as_f, w->yd, w->d, ith, nth);
        }
}

static void pool_pass(lk_pool *p, work *w, void *scratch, bool hint) {
    for (int l = 0; l < w->nl; l++) {
        layer *L = &w->L[l], *N = &w->L[(l + 1) % w->nl];
        const lk_mat *qkv[3] = { &L->q, &L->k, &L->v }, *gu[2] = { &L->g, &L->u };
        const lk_mat *o[1] = { &L->o }, *dn[1] = { &L->d }, *nqkv[3] = { &N->q, &N->k, &N->v };
        float *yqkv[3] = { w->yq, w->yk, w->yv }, *ygu[2] = { w->yg, w->yu };
        int64_t sqkv[3] = { w->d, w->kv, w->kv }, sgu[2] = { w->ff, w->ff };
        if (hint) lk_matmul_prefetch_next(p, o, 1);
        lk_matmul_fused(p, qkv, 3, w->x, w->d, w->ntok, yqkv, sqkv, false, scratch);
        if (hint) lk_matmul_prefetch_next(p, gu, 2);
        lk_matmul(p, &L->o, w->x, w->d, w->ntok, w->yo, w->d, scratch);
        if (hint) lk_matmul_prefetch_next(p, dn, 1);
        lk_matmul_fused(p, gu, 2, w->x, w->d, w->ntok, ygu, sgu, true, scratch);
        if (hint) lk_matmul_prefetch_next(p, nqkv, 3);
        lk_matmul(p, &L->d, w->xf, w->ff, w->ntok, w->yd, w->d, scratch);
    }
    lk_matmul_prefetch_next(p, NULL, 0);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A comma-separated list of positive integers; -1 when an item is not one
 * (a typo must not turn into a thread count of 0). */
static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    char *c = strdup(s), *save = NULL;
    for (char *t = strtok_r(c, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char *end = NULL;
        long v = strtol(t, &end, 10);
        if (n == max || end == t || *end || v < 1 || v > 4096) { n = -1; break; }
        out[n++] = (int)v;
    }
    free(c);
    return n;
}

static int usage(FILE *f) {
    fprintf(f, "usage: bench_matmul [THREADS,..] [TOKENS,..] [SPLIT,..] [LAYERS]\n"
               "  defaults 1,16  1,16  4  22; at most 16 values a list, each >= 1\n"
               "  env BENCH_TYPE (default q4_0), BENCH_SHAPE=d,ff,kv (default 2048,5632,256: TinyLlama-1.1B)\n");
    return f == stdout ? 0 : 2;
}

int main(int argc, char **argv) {
    if (argc > 1 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) return usage(stdout);
    if (argc > 5) return usage(stderr);
    int th[16], nt[16], sp[16];
    const int n_th = parse_list(argc > 1 ? argv[1] : "1,16", th, 16);
    const int n_nt = parse_list(argc > 2 ? argv[2] : "1,16", nt, 16);
    const int n_sp = parse_list(argc > 3 ? argv[3] : "4", sp, 16);
    int nl = 22;
    if (argc > 4 && parse_list(argv[4], &nl, 1) != 1) nl = 0;
    lk_type t = LK_TYPE_Q4_0;
    if (getenv("BENCH_TYPE") && !lk_type_from_name(getenv("BENCH_TYPE"), &t)) {
        fprintf(stderr, "bench_matmul: unknown BENCH_TYPE\n");
        return 2;
    }
    long d = 2048, ff = 5632, kv = 256;
    if (getenv("BENCH_SHAPE") && (sscanf(getenv("BENCH_SHAPE"), "%ld,%ld,%ld", &d, &ff, &kv) != 3 ||
                                  d < 1 || ff < 1 || kv < 1 || d > 65536 || ff > 262144 || kv > d)) {
        fprintf(stderr, "bench_matmul: BENCH_SHAPE is d,ff,kv (positive, kv <= d)\n");
        return 2;
    }
    if (nl < 1 || n_th < 1 || n_nt < 1 || n_sp < 1) {
        fprintf(stderr, "bench_matmul: each argument is a comma-separated list of whole numbers from 1 to 4096\n");
        return usage(stderr);
    }
    layer *L = calloc((size_t)nl, sizeof *L);
    for (int l = 0; l < nl; l++) {
        fill_mat(&L[l].q, t, d, d); fill_mat(&L[l].k, t, kv, d); fill_mat(&L[l].v, t, kv, d);
        fill_mat(&L[l].o, t, d, d); fill_mat(&L[l].g, t, ff, d); fill_mat(&L[l].u, t, ff, d);
        fill_mat(&L[l].d, t, d, ff);
    }
    const double flop_tok = 2.0 * nl * ((double)d * (d + 2 * kv) + (double)d * d + 2.0 * d * ff + (double)ff * d);
    int maxtok = 1;
    for (int i = 0; i < n_nt; i++) maxtok = LK_MAX(maxtok, nt[i]);
    float *x = malloc((size_t)maxtok * ff * 4), *xf = malloc((size_t)maxtok * ff * 4);
    for (long i = 0; i < maxtok * ff; i++) x[i] = xf[i] = (float)((int64_t)(rnd() % 2001) - 1000) / 1000.f;
    float *ys[7];
    for (int i = 0; i < 7; i++) ys[i] = calloc((size_t)maxtok * ff, 4);
    void *scratch = malloc(lk_matmul_scratch_bytes(ff, maxtok));
    const lk_type at = lk_type_vec_dot(t);
    size_t as_d = 0, as_f = 0;
    lk_type_row_bytes(at, d, &as_d);
    lk_type_row_bytes(at, ff, &as_f);
    uint8_t *a_d = malloc(as_d * (size_t)maxtok), *a_f = malloc(as_f * (size_t)maxtok);
    for (int i = 0; i < maxtok; i++) {
        lk_quantize_row_act(at, x + (size_t)i * d, a_d + (size_t)i * as_d, d);
        lk_quantize_row_act(at, xf + (size_t)i * ff, a_f + (size_t)i * as_f, ff);
    }
    printf("bench_matmul: %s, %d layers of d %ld ff %ld kv %ld (%.0f MB of weights), SIMD %s\n", lk_type_name(t), nl,
           d, ff, kv, flop_tok / 2 * (double)lk_type_block_bytes(t) / (double)lk_type_block_size(t) / 1e6,
           lk_quant_simd_name());
    printf("| threads | tokens | split | pool GFLOP/s | per thread | hinted GFLOP/s | hinted/pool | private GFLOP/s | "
           "per thread | pool/private |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < n_th; i++) {
        lk_pool *p = lk_pool_create(th[i]);
        for (int k = 0; k < n_nt; k++) {
            work w = { .L = L, .nl = nl, .ntok = nt[k], .d = d, .ff = ff, .kv = kv, .x = x, .xf = xf,
                       .yq = ys[0], .yk = ys[1], .yv = ys[2], .yo = ys[3], .yg = ys[4], .yu = ys[5], .yd = ys[6],
                       .a_d = a_d, .a_f = a_f, .as_d = as_d, .as_f = as_f, .reps = 1 };
            for (int s = 0; s < n_sp; s++) {
                /* private: one task per thread (its share in sp[s] calls per
                 * matrix), 5 passes, median */
                g_chunks = sp[s];
                double tp[5];
                lk_pool_run_n(p, private_fn, &w, th[i]);
                for (int r = 0; r < 5; r++) {
                    const uint64_t t0 = lk_time_ns();
                    lk_pool_run_n(p, private_fn, &w, th[i]);
                    tp[r] = (double)(lk_time_ns() - t0) / 1e9;
                }
                qsort(tp, 5, sizeof tp[0], cmp_d);
                const double priv = flop_tok * nt[k] / tp[2] / 1e9;
                lk_matmul_set_split(sp[s]);
                enum { R = 15 };
                double tq[R], th_[R], rat[R];
                pool_pass(p, &w, scratch, false);
                for (int r = 0; r < R; r++) { /* alternated, either first in turn */
                    for (int h = 0; h < 2; h++) {
                        const bool hint = (h + r) % 2;
                        const uint64_t t0 = lk_time_ns();
                        pool_pass(p, &w, scratch, hint);
                        *(hint ? &th_[r] : &tq[r]) = (double)(lk_time_ns() - t0) / 1e9;
                    }
                    rat[r] = tq[r] / th_[r];
                }
                qsort(tq, R, sizeof tq[0], cmp_d);
                qsort(th_, R, sizeof th_[0], cmp_d);
                qsort(rat, R, sizeof rat[0], cmp_d);
                const double pool = flop_tok * nt[k] / tq[R / 2] / 1e9, hinted = flop_tok * nt[k] / th_[R / 2] / 1e9;
                printf("| %d | %d | %d | %.1f | %.1f | %.1f | %.3f | %.1f | %.1f | %.2f |\n", th[i], nt[k], sp[s], pool,
                       pool / th[i], hinted, rat[R / 2], priv, priv / th[i], pool / priv);
                fflush(stdout);
            }
        }
        lk_pool_free(p);
    }
    return 0;
}
