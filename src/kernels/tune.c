/* The kernels' speed settings per machine: defaults, LK_TUNE, the cache file
 * and the calibration (see tune.h). */
#include "kernels/tune.h"
#include "kernels/membw.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ======================================================================
 * settings
 * ==================================================================== */

/* split 4: on an idle machine the same walk as one share per thread (each
 * thread's tasks are contiguous rows; a claim per task costs nanoseconds
 * against a matrix's tens of microseconds at least), and when a thread is
 * descheduled the others take up to three quarters of its share (2-thread
 * decode next to another 2-thread decode on 2 cores: BENCHMARKS.md) */
void lk_tune_defaults(lk_tune_set *s) {
    *s = (lk_tune_set){ .pf = 1, .split = 4, .gemm_rows = 0, .gemm_chunk = 0, .gemm_tok = 0, .drows = 4, .droll = -1, .amx = -1,
                       .amxf = -1, .far = -1, .hint = 1 };
}

void lk_tune_apply(const lk_tune_set *s) {
    lk_quant_set_prefetch(s->pf);
    lk_matmul_set_split(s->split);
    lk_quant_gemm_avx2_force(s->gemm_rows, s->gemm_chunk);
    lk_quant_set_gemm_tok(s->gemm_tok);
    lk_quant_set_dec_rows(s->drows);
    lk_quant_set_dec_roll(s->droll);
    lk_quant_set_amx(s->amx);
    lk_quant_set_amx_few(s->amxf);
    lk_quant_set_far(s->far);
    lk_pool_set_hints(s->hint != 0);
}

void lk_tune_get(lk_tune_set *s) {
    s->pf = lk_quant_prefetch();
    s->split = lk_matmul_split();
    lk_quant_gemm_avx2_get(&s->gemm_rows, &s->gemm_chunk);
    if (s->gemm_rows < 0) s->gemm_rows = 0;
    s->gemm_tok = lk_quant_gemm_tok();
    s->drows = lk_quant_dec_rows();
    s->droll = lk_quant_dec_roll_setting();
    s->amx = lk_quant_amx();
    s->amxf = lk_quant_amx_few();
    s->far = lk_quant_far();
    s->hint = lk_pool_hints();
}

void lk_tune_format(const lk_tune_set *s, char *buf, size_t n) {
    int k;
    if (s->gemm_rows <= 0) k = snprintf(buf, n, "pf=%d,split=%d,gemm=off", s->pf, s->split);
    else if (s->gemm_chunk == 0) k = snprintf(buf, n, "pf=%d,split=%d,gemm=%d", s->pf, s->split, s->gemm_rows);
    else k = snprintf(buf, n, "pf=%d,split=%d,gemm=%dx%d", s->pf, s->split, s->gemm_rows, s->gemm_chunk);
    if (s->gemm_tok && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",gtok=%d", s->gemm_tok);
    if (s->drows != 4 && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",drows=%d", s->drows);
    if (s->droll >= 0 && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",droll=%d", s->droll);
    if (s->amx == 0 && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",amx=off");
    else if (s->amx > 0 && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",amx=%d", s->amx);
    if (s->amxf == 0 && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",amxf=off");
    else if (s->amxf > 0 && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",amxf=%d", s->amxf);
    if (s->far >= 0 && k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, ",far=%d", s->far);
    if (!s->hint && k > 0 && (size_t)k < n) snprintf(buf + k, n - (size_t)k, ",hint=0");
}

static bool parse_int(const char *s, const char *end, int lo, int hi, int *out) {
    if (s == end || end - s > 4) return false;
    int v = 0;
    for (const char *c = s; c < end; c++) {
        if (*c < '0' || *c > '9') return false;
        v = v * 10 + (*c - '0');
    }
    if (v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool lk_tune_parse(const char *spec, lk_tune_set *s, char *err, size_t errlen) {
    lk_tune_set t = *s;
    const char *p = spec;
    for (;;) {
        const char *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        const char *eq = memchr(p, '=', (size_t)(end - p));
        bool ok = eq != NULL;
        if (ok && eq - p == 2 && !strncmp(p, "pf", 2)) ok = parse_int(eq + 1, end, 0, LK_QUANT_PF_MAX, &t.pf);
        else if (ok && eq - p == 5 && !strncmp(p, "split", 5)) ok = parse_int(eq + 1, end, 1, LK_MATMUL_SPLIT_MAX, &t.split);
        else if (ok && eq - p == 4 && !strncmp(p, "gemm", 4)) {
            const char *v = eq + 1, *x = memchr(v, 'x', (size_t)(end - v));
            if (end - v == 3 && !strncmp(v, "off", 3)) t.gemm_rows = 0, t.gemm_chunk = 0;
            else if (x) ok = parse_int(v, x, 0, 4, &t.gemm_rows) && parse_int(x + 1, end, 1, 64, &t.gemm_chunk);
            else {
                ok = parse_int(v, end, 0, 4, &t.gemm_rows);
                t.gemm_chunk = 0;
            }
        } else if (ok && eq - p == 4 && !strncmp(p, "gtok", 4)) {
            ok = parse_int(eq + 1, end, 0, LK_QUANT_GEMM_TOK_MAX, &t.gemm_tok) &&
                 (t.gemm_tok == 0 || t.gemm_tok >= LK_QUANT_GEMM_TOK_MIN);
        } else if (ok && eq - p == 5 && !strncmp(p, "drows", 5)) {
            ok = parse_int(eq + 1, end, 1, 4, &t.drows) && (t.drows == 1 || t.drows == 4);
        } else if (ok && eq - p == 5 && !strncmp(p, "droll", 5)) {
            ok = parse_int(eq + 1, end, 0, 1, &t.droll);
        } else if (ok && eq - p == 3 && !strncmp(p, "amx", 3)) {
            if (end - eq - 1 == 3 && !strncmp(eq + 1, "off", 3)) t.amx = 0;
            else ok = parse_int(eq + 1, end, 0, 1024, &t.amx);
        } else if (ok && eq - p == 4 && !strncmp(p, "amxf", 4)) {
            if (end - eq - 1 == 3 && !strncmp(eq + 1, "off", 3)) t.amxf = 0;
            else ok = parse_int(eq + 1, end, 0, 1024, &t.amxf);
        } else if (ok && eq - p == 3 && !strncmp(p, "far", 3)) {
            ok = parse_int(eq + 1, end, 0, LK_QUANT_FAR_MAX, &t.far);
        } else if (ok && eq - p == 4 && !strncmp(p, "hint", 4)) {
            ok = parse_int(eq + 1, end, 0, 1, &t.hint);
        } else ok = false;
        if (!ok) {
            snprintf(err, errlen,
                     "bad tuning setting '%.*s' (expected pf=0..%d, split=1..%d, gemm=off|1..4[x1..64], gtok=0|%d..%d, drows=1|4, droll=0|1, amx=off|0..1024, amxf=off|0..1024, far=0..%d, hint=0|1)",
                     (int)(end - p), p, LK_QUANT_PF_MAX, LK_MATMUL_SPLIT_MAX, LK_QUANT_GEMM_TOK_MIN,
                     LK_QUANT_GEMM_TOK_MAX, LK_QUANT_FAR_MAX);
            return false;
        }
        if (!*end) break;
        p = end + 1;
    }
    *s = t;
    return true;
}

/* ======================================================================
 * calibration
 * ==================================================================== */

static double median(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double x = v[j];
            v[j] = v[j - 1];
            v[j - 1] = x;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* A region of `len` bytes as rows of `cols` elements of type t (rb bytes
 * each): weights like a model's, 16 rows of random values quantised to the
 * file's type ft (repacked when t is lockstep's own), repeated (quantising
 * it all would take seconds); types without a quantiser get 0x11 in every
 * byte, a small normal scale in every format, so no NaN or denormal slows a
 * candidate. */
static void fill_weights(uint8_t *dst, size_t len, lk_type t, lk_type ft, int64_t cols, size_t rb, uint32_t *s) {
    const size_t pat = rb * 16;
    LK_ASSERT(len >= pat);
    float *f = lk_xmalloc(sizeof(float) * (size_t)cols);
    for (int64_t r = 0; r < 16; r++) {
        for (int64_t i = 0; i < cols; i++) {
            *s = *s * 1664525u + 1013904223u;
            f[i] = (float)(*s >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
        }
        if (lk_quantize_supported(ft)) lk_quantize_row(ft, f, dst + (size_t)r * rb, cols);
        else memset(dst + (size_t)r * rb, 0x11, rb);
    }
    free(f);
    if (ft != t) {
        uint8_t *q = lk_xmalloc(pat);
        memcpy(q, dst, pat);
        lk_quant_repack(t, ft, cols, 16, q, rb, dst);
        free(q);
    }
    for (size_t o = pat; o < len; o += pat) memcpy(dst + o, dst, LK_MIN(pat, len - o));
}

/* Wall time of one pass over the matrices (ms), each product naming the
 * next one's weights as the model's do (lk_matmul_prefetch_next; followed
 * where the setting in force says so). */
static double pass_ms(lk_pool *p, const lk_mat *mats, int nm, const float *x, int64_t ntok, float *y, void *scratch) {
    uint64_t t0 = lk_time_ns();
    for (int i = 0; i < nm; i++) {
        const lk_mat *next = &mats[(i + 1) % nm];
        lk_matmul_prefetch_next(p, &next, 1);
        lk_matmul(p, &mats[i], x, mats[i].cols, ntok, y, mats[i].rows, scratch);
    }
    lk_matmul_prefetch_next(p, NULL, 0);
    return (double)(lk_time_ns() - t0) / 1e6;
}

/* Times every candidate over rounds, interleaved within each round so
 * that a burst of other load hits neighbours alike, and scores each by the
 * median over rounds of its time / the reference candidate's time in the
 * same round (paired: on a shared machine the absolute times of one
 * candidate spread 2-5x between rounds, their ratios much less). At least
 * 2 rounds, more (up to 9) while the stage is within its budget (an idle
 * machine does 5-9; one loaded 10x over, whose passes are slow, 2). med[k]:
 * the median time (reported), ratio[k]: the score. */
static void stage(lk_pool *p, const lk_tune_set *cand, int nc, int ref, double *med, double *ratio,
                  const lk_mat *mats, int nm, const float *x, int64_t ntok, float *y, void *scratch,
                  double budget_ms) {
    enum { RMAX = 9, CMAX = 8 };
    LK_ASSERT(nc <= CMAX);
    double t[RMAX][CMAX];
    int nr = 0;
    uint64_t t0 = lk_time_ns();
    while (nr < RMAX) {
        for (int k = 0; k < nc; k++) {
            lk_tune_apply(&cand[(k + nr) % nc]); /* rotate the order: none is always first after the last */
            t[nr][(k + nr) % nc] = pass_ms(p, mats, nm, x, ntok, y, scratch);
        }
        nr++;
        if (nr >= 2 && (double)(lk_time_ns() - t0) / 1e6 > budget_ms) break;
    }
    for (int k = 0; k < nc; k++) {
        double a[RMAX], r[RMAX];
        for (int i = 0; i < nr; i++) a[i] = t[i][k], r[i] = t[i][k] / t[i][ref];
        med[k] = median(a, nr);
        ratio[k] = median(r, nr);
    }
}

/* The best score, unless it is within 3 % of the reference's (1.0): closer
 * than that is noise on a shared machine, and a flip costs nothing but
 * makes runs differ. */
static int pick(const double *ratio, int nc, int ref) {
    int w = ref;
    for (int k = 0; k < nc; k++)
        if (ratio[k] < ratio[w]) w = k;
    return ratio[w] < 0.97 ? w : ref;
}

static int append(char *buf, size_t n, int at, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int append(char *buf, size_t n, int at, const char *fmt, ...) {
    if (at < 0 || (size_t)at >= n) return at;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + at, n - (size_t)at, fmt, ap);
    va_end(ap);
    return k < 0 ? at : LK_MIN(at + k, (int)n - 1);
}

/* the types the AVX2 prefill GEMM choice reaches (Q4_0 and Q8_0 have their
 * own GEMM, quant_q4q8_avx2.c, with no such choice) */
static bool gemm_type(lk_type t) { return t == LK_TYPE_Q4_K || t == LK_TYPE_Q5_K || t == LK_TYPE_Q6_K; }

static void calibrate_on(lk_pool *p, lk_type t, const lk_mat *mats, int nm, lk_tune_set *out, char *report,
                         size_t n, int at, uint64_t t_start);

void lk_tune_calibrate(lk_pool *p, lk_type t, int64_t cols, int64_t rows, size_t bytes, lk_tune_set *out,
                       char *report, size_t n) {
    const uint64_t t_start = lk_time_ns();
    lk_tune_set cur;
    lk_tune_defaults(&cur);
    size_t rb = 0;
    /* lockstep's own layouts are made from a file type's rows */
    const lk_type ft = lk_type_file(t);
    const bool r16 = ft != t;
    if (!lk_type_supported(ft) || cols <= 0 || rows <= 0 || !lk_type_row_bytes(t, cols, &rb)) {
        lk_tune_apply(&cur);
        *out = cur;
        snprintf(report, n, "defaults (no calibration for %s %lld x %lld)", lk_type_name(t), (long long)rows,
                 (long long)cols);
        return;
    }
    /* memory-bound: the matrices together well past the last-level cache,
     * each of the model's shape (so the pool's dispatch per matrix counts as
     * in decode); rows cut to fit when one matrix alone is larger. Every
     * other matrix takes the transposed shape where the type allows it
     * (an FFN's down matrix beside its gate and up: on a Zen 5 the rows
     * per decode tile that suit 2048-wide rows did not suit 5632-wide ones,
     * and one shape alone chose against the whole model's decode). */
    rows = LK_MAX((int64_t)16, LK_MIN(rows, (int64_t)(bytes / rb) / 16 * 16));
    if (r16) rows = rows / 16 * 16; /* whole groups: the 16 rows below repeat as groups */
    const size_t mb = rb * (size_t)rows;
    size_t rb2 = 0;
    const bool two = cols != rows && cols % 16 == 0 && lk_type_row_bytes(t, rows, &rb2) && rb2 * (size_t)cols == mb;
    const int nm = (int)LK_MAX((size_t)1, LK_MIN(bytes / mb, (size_t)4096));
    const size_t len = mb * (size_t)nm;
    uint8_t *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
        lk_tune_apply(&cur);
        *out = cur;
        snprintf(report, n, "defaults (no memory for a %zu MiB calibration)", len >> 20);
        return;
    }
    madvise(buf, len, MADV_HUGEPAGE);
    uint32_t s = 12345;
    fill_weights(buf, mb, t, ft, cols, rb, &s);
    if (two && nm > 1) fill_weights(buf + mb, mb, t, ft, rows, rb2, &s);
    for (int i = 2; i < nm; i++) memcpy(buf + (size_t)i * mb, buf + (size_t)(two ? i % 2 : 0) * mb, mb);
    lk_mat *mats = lk_xmalloc(sizeof(lk_mat) * (size_t)nm);
    for (int i = 0; i < nm; i++)
        mats[i] = two && i % 2 ? (lk_mat){ .type = t, .cols = rows, .rows = cols, .data = buf + (size_t)i * mb, .row_stride = rb2 }
                               : (lk_mat){ .type = t, .cols = cols, .rows = rows, .data = buf + (size_t)i * mb, .row_stride = rb };
    int at = snprintf(report, n, "%s %lld x %lld%s x %d matrices (%zu MiB), %d threads, median of >= 2 rounds in ms (x its median ratio to the default's):",
                      lk_type_name(t), (long long)rows, (long long)cols, two && nm > 1 ? " and transposed" : "", nm,
                      len >> 20, lk_pool_size(p));
    calibrate_on(p, t, mats, nm, out, report, n, at, t_start);
    free(mats);
    munmap(buf, len);
}

/* The stages, on matrices of type t (a synthetic buffer's or the model's):
 * applies the choice, writes it to *out and appends the timings to report
 * (at: its length so far). */
static void calibrate_on(lk_pool *p, lk_type t, const lk_mat *mats, int nm, lk_tune_set *out, char *report,
                         size_t n, int at, uint64_t t_start) {
    const lk_type ft = lk_type_file(t);
    const bool r16 = ft != t;
    lk_tune_set cur;
    lk_tune_defaults(&cur);
    enum { NTOK = 64 };
    int64_t wide = 0;
    for (int i = 0; i < nm; i++) wide = LK_MAX(wide, LK_MAX(mats[i].cols, mats[i].rows));
    float *x = lk_xmalloc(sizeof(float) * (size_t)wide * NTOK);
    uint32_t s = 777;
    for (int64_t i = 0; i < wide * NTOK; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)(s >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
    }
    float *y = lk_xmalloc(sizeof(float) * (size_t)wide * NTOK);
    void *scratch = lk_xmalloc(lk_matmul_scratch_bytes(wide, NTOK));

    lk_tune_apply(&cur);
    pass_ms(p, mats, nm, x, 1, y, scratch); /* warm-up: TLB, page tables, the pool */

    /* 1. prefetch distance, decode */
    {
        static const int pfs[] = { 0, 1, 2, 4 };
        lk_tune_set c[4];
        double med[4], ratio[4];
        for (int k = 0; k < 4; k++) c[k] = cur, c[k].pf = pfs[k];
        stage(p, c, 4, 1, med, ratio, mats, nm, x, 1, y, scratch, 120);
        cur.pf = pfs[pick(ratio, 4, 1)];
        at = append(report, n, at, " pf 0/1/2/4 %.2f/%.2f/%.2f/%.2f (x%.2f/1/x%.2f/x%.2f);", med[0], med[1], med[2],
                    med[3], ratio[0], ratio[2], ratio[3]);
    }
    /* 1a. the repacked Q4_0/Q8_0 decode's far prefetch (quant.h): one
     * stream a 16-row group, which the near prefetch alone left at 72 % of
     * the bound for Q4_0 on the Sapphire Rapids guest (Q8_0: 90 %, and
     * slower with it). The type's default is the reference. */
    if (!strcmp(lk_quant_simd_name(), "avx512") && r16 && (ft == LK_TYPE_Q4_0 || ft == LK_TYPE_Q8_0)) {
        static const int fars[] = { 0, LK_QUANT_FAR_Q4, 2 * LK_QUANT_FAR_Q4 };
        const int ref = ft == LK_TYPE_Q4_0 ? 1 : 0;
        lk_tune_set c[3];
        double med[3], ratio[3];
        for (int k = 0; k < 3; k++) c[k] = cur, c[k].far = fars[k];
        stage(p, c, 3, ref, med, ratio, mats, nm, x, 1, y, scratch, 120);
        const int w = pick(ratio, 3, ref);
        cur.far = w == ref ? -1 : fars[w];
        at = append(report, n, at, " far 0/%d/%d KB %.2f/%.2f/%.2f (x%.2f/x%.2f/x%.2f);", fars[1], fars[2], med[0],
                    med[1], med[2], ratio[0], ratio[1], ratio[2]);
    }
    /* 1b. rows per decode tile, for the types whose decode is tiled (not
     * the repacked ones: 16 rows in the lanes); F16 and BF16 at AVX-512
     * also the 4-row tile's rows loop unrolled or rolled */
    if (strcmp(lk_quant_simd_name(), "scalar") && !r16 && ft != LK_TYPE_Q4_0 && ft != LK_TYPE_Q8_0) {
        const bool rl = !strcmp(lk_quant_simd_name(), "avx512") && (ft == LK_TYPE_F16 || ft == LK_TYPE_BF16);
        lk_tune_set c[3];
        double med[3], ratio[3];
        c[0] = cur, c[1] = cur, c[2] = cur;
        c[0].drows = 4, c[1].drows = 1, c[2].drows = 4;
        const int droll_now = lk_quant_dec_roll(); /* cur's, applied: the reference, c[2] */
        if (rl) c[0].droll = !droll_now;
        const int nc = rl ? 3 : 2, ref = rl ? 2 : 0;
        stage(p, c, nc, ref, med, ratio, mats, nm, x, 1, y, scratch, rl ? 120 : 80);
        const int w = pick(ratio, nc, ref);
        cur.drows = c[w].drows;
        if (rl) {
            cur.droll = c[w].droll; /* the 1-row tile has no loop to roll: the default's setting */
            at = append(report, n, at, " drows 4/1 (roll %d) %.2f/%.2f, roll %d %.2f (x%.2f/x%.2f/1);", c[0].droll,
                        med[0], med[1], droll_now, med[2], ratio[0], ratio[1]);
        } else {
            at = append(report, n, at, " drows 4/1 %.2f/%.2f (1/x%.2f);", med[0], med[1], ratio[1]);
        }
    }
    /* 2. thread split, decode */
    if (lk_pool_size(p) > 1) {
        static const int sps[] = { 1, 2, 4, 8 };
        lk_tune_set c[4];
        double med[4], ratio[4];
        for (int k = 0; k < 4; k++) c[k] = cur, c[k].split = sps[k];
        stage(p, c, 4, 2, med, ratio, mats, nm, x, 1, y, scratch, 120);
        cur.split = sps[pick(ratio, 4, 2)];
        at = append(report, n, at, " split 1/2/4/8 %.2f/%.2f/%.2f/%.2f (x%.2f/x%.2f/1/x%.2f);", med[0], med[1],
                    med[2], med[3], ratio[0], ratio[1], ratio[3]);
    }
    /* 2a. waiting threads prefetch the next product's rows, or not: on
     * unless off is 3 % faster (the hints led by 2-4 % in bench_matmul's
     * passes on a Sapphire Rapids guest and a 16-core Xeon; a machine where
     * they cost turns them off here) */
    if (lk_pool_size(p) > 1) {
        lk_tune_set c[2] = { cur, cur };
        c[0].hint = 1, c[1].hint = 0;
        double med[2], ratio[2];
        stage(p, c, 2, 0, med, ratio, mats, nm, x, 1, y, scratch, 80);
        cur.hint = c[pick(ratio, 2, 0)].hint;
        at = append(report, n, at, " hint 1/0 %.2f/%.2f (1/x%.2f);", med[0], med[1], ratio[1]);
    }
    /* 3. the AVX2 prefill GEMM against the register tiles: 64 tokens over
     * at most 512 rows of one matrix, hot in cache (prefill is compute-bound) */
    if (!strcmp(lk_quant_simd_name(), "avx2") && gemm_type(t)) {
        lk_mat hot = mats[0];
        hot.rows = LK_MIN(hot.rows, (int64_t)512);
        static const int grs[] = { 0, 2, 4 };
        lk_tune_set c[3];
        double med[3], ratio[3];
        for (int k = 0; k < 3; k++) c[k] = cur, c[k].gemm_rows = grs[k];
        stage(p, c, 3, 0, med, ratio, &hot, 1, x, NTOK, y, scratch, 60);
        cur.gemm_rows = grs[pick(ratio, 3, 0)];
        at = append(report, n, at, " gemm off/2/4 (%d tokens x %lld rows) %.2f/%.2f/%.2f (1/x%.2f/x%.2f);", NTOK,
                    (long long)hot.rows, med[0], med[1], med[2], ratio[1], ratio[2]);
    }
    /* 4. where the AVX-512 quantised GEMM takes over: an 8-token step (a
     * server's 8 sequences) over the memory-bound matrices, through the GEMM
     * (from 5 tokens, the default) or the few-token kernels (from 9). Not
     * for the repacked types: stage 5 is theirs. */
    if (!strcmp(lk_quant_simd_name(), "avx512") && (t == LK_TYPE_Q4_0 || t == LK_TYPE_Q8_0 || t == LK_TYPE_Q4_K ||
                                                    t == LK_TYPE_Q5_K)) {
        enum { GT = 8 };
        static const int gts[] = { 0, 9 };
        lk_tune_set c[2];
        double med[2], ratio[2];
        for (int k = 0; k < 2; k++) c[k] = cur, c[k].gemm_tok = gts[k];
        stage(p, c, 2, 0, med, ratio, mats, nm, x, GT, y, scratch, 120);
        cur.gemm_tok = gts[pick(ratio, 2, 0)];
        at = append(report, n, at, " gtok 5/9 (%d tokens) %.2f/%.2f (1/x%.2f);", GT, med[0], med[1], ratio[1]);
    }
    /* 5a. the repacked Q4_0/Q8_0's few-token AMX kernel (where the CPU has
     * AMX) against the vector kernels, a 16-token step over the
     * memory-bound matrices; where it stays on, it takes the tokens whose
     * kernel stage 5 would choose, and stage 5 is skipped. */
    const bool few = !strcmp(lk_quant_simd_name(), "avx512") && lk_quant_amx_have() && r16 &&
                     (ft == LK_TYPE_Q4_0 || ft == LK_TYPE_Q8_0);
    if (few) {
        enum { GT = 16 };
        lk_tune_set c[2] = { cur, cur };
        c[0].amxf = -1, c[1].amxf = 0;
        double med[2], ratio[2];
        stage(p, c, 2, 0, med, ratio, mats, nm, x, GT, y, scratch, 120);
        cur.amxf = c[pick(ratio, 2, 0)].amxf;
        at = append(report, n, at, " amxf %d/off (%d tokens) %.2f/%.2f (1/x%.2f);", LK_AMX_FEW_MIN_TOK, GT, med[0],
                    med[1], ratio[1]);
    }
    /* 5. the repacked types' few-token kernel against the GEMM, a 16-token
     * (Q4_0/Q8_0) or 12-token (K-quants) step over the memory-bound
     * matrices. Q4_0/Q8_0: the default (the GEMM from 16 tokens, on AMD
     * CPUs from 32: lk_gemm_min_tok_r16) against the other maker's. On a
     * Zen 5 core the rows kernel led 1.22x at 16 tokens (Q4_0_R16); on the
     * 16-core Xeon the GEMM led 1.13x (BENCHMARKS.md, eleventh session).
     * K-quants: the default (the rows kernel up to 17 tokens for Q4_K, 27
     * for Q6_K; quant_impl.h) against the GEMM from 8. Not F16_R16 nor
     * BF16_R16: they have no GEMM, one kernel for every token count. */
    if (!strcmp(lk_quant_simd_name(), "avx512") && r16 && ft != LK_TYPE_Q5_K && ft != LK_TYPE_F16 &&
        ft != LK_TYPE_BF16 &&
        !(few && cur.amxf != 0)) {
        const bool kq = ft != LK_TYPE_Q4_0 && ft != LK_TYPE_Q8_0;
        const int alt = kq ? 8 : lk_gemm_min_tok_r16() == LK_GEMM_MIN_TOK_R16_AMD ? LK_GEMM_MIN_TOK_R16_OTHER
                                                                                 : LK_GEMM_MIN_TOK_R16_AMD;
        const int GT = kq ? 12 : 16, gts[] = { 0, alt };
        lk_tune_set c[2];
        double med[2], ratio[2];
        for (int k = 0; k < 2; k++) c[k] = cur, c[k].gemm_tok = gts[k];
        stage(p, c, 2, 0, med, ratio, mats, nm, x, GT, y, scratch, 120);
        cur.gemm_tok = gts[pick(ratio, 2, 0)];
        at = append(report, n, at, " gtok default/%d (%d tokens) %.2f/%.2f (1/x%.2f);", gts[1], GT, med[0], med[1],
                    ratio[1]);
    }
    /* 6. AMX's tiles for a prefill (Q4_0 / Q8_0 where the CPU has them):
     * a 64-token step over up to 4 of the matrices (compute-bound: a few
     * MB do), the default (from LK_AMX_MIN_TOK tokens) against off. */
    if (!strcmp(lk_quant_simd_name(), "avx512") && lk_quant_amx_have() && (ft == LK_TYPE_Q4_0 || ft == LK_TYPE_Q8_0)) {
        lk_tune_set c[2] = { cur, cur };
        c[0].amx = -1, c[1].amx = 0;
        double med[2], ratio[2];
        stage(p, c, 2, 0, med, ratio, mats, LK_MIN(nm, 4), x, NTOK, y, scratch, 120);
        cur.amx = c[pick(ratio, 2, 0)].amx;
        at = append(report, n, at, " amx %d/off (%d tokens) %.2f/%.2f (1/x%.2f);", LK_AMX_MIN_TOK, NTOK, med[0],
                    med[1], ratio[1]);
    }
    lk_tune_apply(&cur);
    *out = cur;
    char set[128];
    lk_tune_format(&cur, set, sizeof set);
    append(report, n, at, " -> %s in %.0f ms", set, (double)(lk_time_ns() - t_start) / 1e6);
    free(scratch);
    free(y);
    free(x);
}

void lk_tune_calibrate_mats(lk_pool *p, const lk_mat *mats, int nm, lk_tune_set *out, char *report, size_t n) {
    const uint64_t t_start = lk_time_ns();
    size_t len = 0;
    for (int i = 0; i < nm; i++) {
        size_t rb = 0;
        LK_ASSERT(lk_type_row_bytes(mats[i].type, mats[i].cols, &rb));
        len += rb * (size_t)mats[i].rows;
    }
    const int at = snprintf(report, n, "the model's first %d %s matrices (%zu MiB), %d threads, median of >= 2 rounds "
                            "in ms (x its median ratio to the default's):", nm, lk_type_name(mats[0].type), len >> 20,
                            lk_pool_size(p));
    calibrate_on(p, mats[0].type, mats, nm, out, report, n, at, t_start);
}

/* ======================================================================
 * the cache file
 * ==================================================================== */

#define CACHE_HEADER "lockstep-tune 1"
enum { CACHE_LINES = 64, LINE_MAX_ = 768 };

static bool cache_dir(char *buf, size_t n) {
    const char *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    int k;
    if (x && *x == '/') k = snprintf(buf, n, "%s/lockstep", x);
    else if (h && *h) k = snprintf(buf, n, "%s/.cache/lockstep", h);
    else return false;
    return k > 0 && (size_t)k < n;
}

static void mkdirs(const char *dir) {
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s", dir);
    for (char *c = tmp + 1; *c; c++)
        if (*c == '/') {
            *c = 0;
            mkdir(tmp, 0755);
            *c = '/';
        }
    mkdir(tmp, 0755);
}

/* The CPU's model name (/proc/cpuinfo) and its family / model / stepping
 * numbers (a hypervisor may show every AMD server CPU as "AMD EPYC": Zen 3
 * and Zen 5 then differ only there), with anything but printable non-tab
 * characters replaced: it becomes part of a cache key. */
static void cpu_model(char *buf, size_t n) {
    snprintf(buf, n, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512], name[256] = "unknown", fam[32] = "?", mod[32] = "?", step[32] = "?";
    int seen = 0;
    while (seen != 15 && fgets(line, sizeof line, f)) {
        const char *c = strchr(line, ':');
        if (!c) {
            if (seen) break; /* the first processor's block ended */
            continue;
        }
        size_t k = (size_t)(c - line);
        while (k && (line[k - 1] == ' ' || line[k - 1] == '\t')) k--;
        c++;
        while (*c == ' ') c++;
        char *dst = NULL;
        size_t dn = 0;
        int bit = 0;
        if (k == 10 && !strncmp(line, "model name", 10)) dst = name, dn = sizeof name, bit = 1;
        else if (k == 10 && !strncmp(line, "cpu family", 10)) dst = fam, dn = sizeof fam, bit = 2;
        else if (k == 5 && !strncmp(line, "model", 5)) dst = mod, dn = sizeof mod, bit = 4;
        else if (k == 8 && !strncmp(line, "stepping", 8)) dst = step, dn = sizeof step, bit = 8;
        if (!dst) continue;
        snprintf(dst, dn, "%s", c);
        dst[strcspn(dst, "\n")] = 0;
        seen |= bit;
    }
    fclose(f);
    snprintf(buf, n, "%s (family %s model %s stepping %s)", name, fam, mod, step);
    for (char *c = buf; *c; c++)
        if (*c < 32 || *c > 126 || *c == '|') *c = '_';
}

/* This build: the executable's size and modification time (a rebuild
 * changes them, so its kernels are tuned afresh). */
static void build_id(char *buf, size_t n) {
    struct stat st;
    if (stat("/proc/self/exe", &st) == 0)
        snprintf(buf, n, "%lld-%lld", (long long)st.st_size, (long long)st.st_mtime);
    else snprintf(buf, n, "unknown");
}

typedef struct { char key[LINE_MAX_]; char set[128]; } cache_line;

/* Reads the valid lines of the cache file (a note for each bad one). */
static int cache_read(const char *path, cache_line *lines, int cap) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char buf[LINE_MAX_ + 80];
    int nl = 0, ln = 0;
    bool header = false;
    while (fgets(buf, sizeof buf, f)) {
        ln++;
        size_t len = strlen(buf);
        if (len && buf[len - 1] == '\n') buf[--len] = 0;
        if (ln == 1) {
            if (strcmp(buf, CACHE_HEADER)) {
                lk_log(LK_LOG_WARN, "tune: %s is not a lockstep tuning cache (first line '%.40s'): ignored, it will "
                                    "be rewritten", path, buf);
                break;
            }
            header = true;
            continue;
        }
        char *tab = strchr(buf, '\t');
        lk_tune_set s;
        lk_tune_defaults(&s);
        char err[160];
        if (!tab || tab == buf || (size_t)(tab - buf) >= LINE_MAX_ || !lk_tune_parse(tab + 1, &s, err, sizeof err)) {
            lk_log(LK_LOG_WARN, "tune: ignoring line %d of %s (expected KEY<tab>pf=..,split=..,gemm=..)", ln, path);
            continue;
        }
        if (nl == cap) continue;
        *tab = 0;
        snprintf(lines[nl].key, sizeof lines[nl].key, "%s", buf);
        lk_tune_format(&s, lines[nl].set, sizeof lines[nl].set);
        nl++;
    }
    fclose(f);
    return header ? nl : 0;
}

static void cache_write(const char *dir, const char *path, cache_line *lines, int nl) {
    mkdirs(dir);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) {
        lk_log(LK_LOG_WARN, "tune: cannot write %s: %s (the choice is not cached)", tmp, strerror(errno));
        return;
    }
    fprintf(f, "%s\n", CACHE_HEADER);
    for (int i = 0; i < nl; i++) fprintf(f, "%s\t%s\n", lines[i].key, lines[i].set);
    /* rename: a concurrent reader sees the old file or the new one, never half */
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        lk_log(LK_LOG_WARN, "tune: cannot write %s: %s (the choice is not cached)", path, strerror(errno));
        unlink(tmp);
    }
}

/* ======================================================================
 * lk_tune_init
 * ==================================================================== */

static char g_report[1152] = "defaults (no model loaded)";
static char g_key[LINE_MAX_];

const char *lk_tune_report(void) { return g_report; }

void lk_tune_init(lk_pool *p, lk_type t, int64_t cols, int64_t rows, uint64_t model_bytes, lk_mat *const *own,
                  int nown) {
    lk_tune_set s;
    lk_tune_defaults(&s);
    const char *env = getenv("LK_TUNE");
    char set[128];
    if (env && (!strcmp(env, "off") || !strcmp(env, "0"))) {
        lk_tune_apply(&s);
        lk_tune_format(&s, set, sizeof set);
        snprintf(g_report, sizeof g_report, "%s: defaults (--no-tune)", set);
        return;
    }
    const bool force = env && !strcmp(env, "calibrate");
    if (env && *env && !force) {
        char err[200];
        if (!lk_tune_parse(env, &s, err, sizeof err)) {
            lk_log(LK_LOG_WARN, "tune: LK_TUNE: %s; using the defaults", err);
            lk_tune_defaults(&s);
        }
        lk_tune_apply(&s);
        lk_tune_format(&s, set, sizeof set);
        snprintf(g_report, sizeof g_report, "%s: forced (LK_TUNE=%s)", set, env);
        return;
    }
    const size_t llc = lk_membw_llc_bytes();
    const uint64_t small = LK_MAX((uint64_t)llc, (uint64_t)64 << 20);
    if (model_bytes <= small && !force) {
        lk_tune_apply(&s);
        lk_tune_format(&s, set, sizeof set);
        snprintf(g_report, sizeof g_report, "%s: defaults (the weights, %llu MiB, are within %llu MiB: decode is "
                 "not memory-bound, no calibration)", set, (unsigned long long)(model_bytes >> 20),
                 (unsigned long long)(small >> 20));
        return;
    }
    char cpu[256], build[64], key[LINE_MAX_];
    cpu_model(cpu, sizeof cpu);
    build_id(build, sizeof build);
    snprintf(key, sizeof key, "%s|%s|build %s|%d threads|%s %lldx%lld", cpu, lk_quant_simd_name(), build,
             lk_pool_size(p), lk_type_name(t), (long long)rows, (long long)cols);
    if (!strcmp(key, g_key)) return; /* this process tuned for it already: keep the choice and its report */
    double load = 0;
    const long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    char dir[512], path[560];
    bool have_dir = cache_dir(dir, sizeof dir);
    if (have_dir) snprintf(path, sizeof path, "%s/tune.txt", dir);
    cache_line *lines = lk_xcalloc(CACHE_LINES, sizeof(cache_line));
    int nl = have_dir ? cache_read(path, lines, CACHE_LINES) : 0;
    for (int i = 0; i < nl && !force; i++)
        if (!strcmp(lines[i].key, key)) {
            char err[160];
            lk_tune_parse(lines[i].set, &s, err, sizeof err); /* valid: cache_read checked it */
            lk_tune_apply(&s);
            snprintf(g_report, sizeof g_report, "%s: cached in %s", lines[i].set, path);
            snprintf(g_key, sizeof g_key, "%s", key);
            free(lines);
            return;
        }
    /* A machine with more runnable threads than CPUs would time the other
     * programs, and the choice would be cached for good: defaults now, a
     * calibration at a later load when it is quieter (or LK_TUNE=calibrate). */
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf", &load) != 1) load = 0;
        fclose(lf);
    }
    if (!force && ncpu > 0 && load > (double)ncpu) {
        lk_tune_defaults(&s);
        lk_tune_apply(&s);
        lk_tune_format(&s, set, sizeof set);
        snprintf(g_report, sizeof g_report, "%s: defaults (the machine is busy: load average %.1f on %ld CPUs; "
                 "calibrating then would time the other programs; --tune calibrate forces it)", set, load, ncpu);
        free(lines);
        return;
    }
    /* 4 x the last-level cache: at 2 x (64 MiB on a 32 MiB Zen 5 L3) two F16 matrices of the
     * model's shape were partly cache-resident and chose the rows per tile that suit
     * the cache, against the model's decode from memory */
    const size_t bytes = LK_MIN(LK_MAX(4 * llc, (size_t)128 << 20), (size_t)256 << 20);
    char rep[900];
    /* the model's own matrices of the type and shape (or its transpose)
     * where it has enough of them: the synthetic buffer's matrices, but
     * already in place, nothing to allocate (a fresh huge-page buffer of
     * 256 MiB took 0.7 s of the kernel's compaction on a 2-core guest, half
     * the calibration) */
    lk_mat *mine = NULL;
    int nmine = 0;
    size_t have = 0;
    for (int i = 0; own && i < nown && have < bytes; i++) {
        size_t rb = 0;
        const bool shape = (own[i]->rows == rows && own[i]->cols == cols) || (own[i]->rows == cols && own[i]->cols == rows);
        if (own[i]->type != t || !shape || !lk_type_row_bytes(t, own[i]->cols, &rb)) continue;
        if (!mine) mine = lk_xmalloc(sizeof(lk_mat) * (size_t)nown);
        mine[nmine++] = *own[i];
        have += rb * (size_t)own[i]->rows;
    }
    if (nmine && have >= bytes) lk_tune_calibrate_mats(p, mine, nmine, &s, rep, sizeof rep);
    else lk_tune_calibrate(p, t, cols, rows, bytes, &s, rep, sizeof rep);
    free(mine);
    lk_tune_format(&s, set, sizeof set);
    snprintf(g_report, sizeof g_report, "%s: calibrated (%s)", set, rep);
    snprintf(g_key, sizeof g_key, "%s", key);
    if (have_dir) {
        /* newest first (a recalibration replaces its key's line); the
         * oldest lines drop off past CACHE_LINES */
        for (int i = 0; i < nl; i++)
            if (!strcmp(lines[i].key, key)) {
                memmove(lines + i, lines + i + 1, sizeof(cache_line) * (size_t)(nl - i - 1));
                nl--;
                break;
            }
        memmove(lines + 1, lines, sizeof(cache_line) * (size_t)LK_MIN(nl, CACHE_LINES - 1));
        snprintf(lines[0].key, sizeof lines[0].key, "%s", key);
        snprintf(lines[0].set, sizeof lines[0].set, "%s", set);
        cache_write(dir, path, lines, LK_MIN(nl + 1, CACHE_LINES));
    }
    free(lines);
}
