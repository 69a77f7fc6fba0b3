/* Elementwise kernels and the matmul driver. */
#include "kernels/kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

void lk_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    /* sum of squares in double like ggml (ggml_float), then scale in float.
     * Element i goes into partial sum i % 8, the eight added pairwise at the
     * end (lk_vec_sumsq: the same bits at every SIMD level and batch size;
     * serial in every decode step's matmuls: a 2048-element row took 3 us
     * as one chain, 1.37 us as eight in plain C, 0.2 us in a zmm) */
    const double ss = lk_vec_sumsq(x, n);
    const float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    lk_vec_scale_mul(out, x, scale, w, n);
}

/* Whether any of x[0..n) is NaN or infinite: an all-ones exponent, tested
 * on the bits eight at a time (an integer test that -O2 vectorises, unlike a
 * float reduction without -ffast-math). */
bool lk_any_nonfinite(const float *x, int64_t n) {
    uint32_t bad = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint32_t u[8], b = 0;
        memcpy(u, x + i, sizeof u);
        for (int j = 0; j < 8; j++) b |= (~u[j] & 0x7f800000u) == 0;
        bad |= b;
    }
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        bad |= (~u & 0x7f800000u) == 0;
    }
    return bad != 0;
}

void lk_softmax(float *x, int64_t n) {
    const double sum = lk_vec_exp_sum(x, n, lk_vec_max(x, n));
    lk_vec_scale(x, n, (float)(1.0 / sum));
}

void lk_swiglu(float *gate, const float *up, int64_t n) { lk_vec_swiglu(gate, up, n); }

/* ggml's GELU (GGML_GELU_FP16, what its CPU backend computes): a table of
 * the F16-rounded tanh-GELU of every F16 value, read at the F16-rounded
 * input. The output is thus a step function of x, and the synth README
 * measured exact tanh-GELU 0.03 away in the logits of a 6-layer model. The
 * table (128 KiB) is built once per process. */
static uint16_t gelu_tab[1 << 16];
static pthread_once_t gelu_once = PTHREAD_ONCE_INIT;

static void gelu_tab_build(void) {
    for (uint32_t i = 0; i < (1u << 16); i++) {
        const float x = lk_fp16_to_fp32((uint16_t)i);
        const float y = 0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x * (1.0f + 0.044715f * x * x)));
        gelu_tab[i] = lk_fp32_to_fp16(y);
    }
}

void lk_geglu(float *gate, const float *up, int64_t n) {
    pthread_once(&gelu_once, gelu_tab_build);
    for (int64_t i = 0; i < n; i++) {
        const float x = gate[i];
        if (x <= -10.0f) gate[i] = 0.0f;
        else if (x >= 10.0f) gate[i] = x * up[i];
        else gate[i] = lk_fp16_to_fp32(gelu_tab[lk_fp32_to_fp16(x)]) * up[i];
    }
}

/* ---- matmul ---- */

/* The activations' terms go after the quantised rows, 64-byte aligned. */
static size_t terms_offset(size_t rows_bytes) { return (rows_bytes + 63) & ~(size_t)63; }

size_t lk_matmul_scratch_bytes(int64_t cols, int64_t ntok) {
    /* F32 activations are the widest (4 bytes per element); every quantised
     * activation format is smaller per element, Q8_0 with its terms
     * (lk_act_terms) too except for rows of a few blocks */
    const size_t f32 = (size_t)cols * 4 * (size_t)ntok;
    const size_t q8 = terms_offset((size_t)(cols / 32 + 1) * 34 * (size_t)ntok) + lk_act_terms_bytes(8, cols + 32, ntok);
    /* F16 rows and their widened twins, BF16 rows and their tiles */
    const size_t f16 = terms_offset((size_t)cols * 2 * (size_t)ntok) +
                       LK_MAX(lk_act_terms_bytes(LK_TERMS_WIDE, cols, ntok), lk_act_terms_bytes(LK_TERMS_TILES, cols, ntok));
    return LK_MAX(LK_MAX(f32, q8), f16) + 64;
}

typedef struct {
    const lk_mat *const *W;
    int nw;
    const float *x;
    int64_t x_stride, ntok;
    const void *a;      /* quantised activations */
    size_t a_stride;
    float *const *y;
    const int64_t *y_stride;
    bool swiglu;
    lk_type at;
    void *scratch;
    const float *norm_w; /* lk_matmul_fused_norm: RMSNorm x into xn first */
    float eps;
    float *xn;
    lk_act_terms terms;  /* the activations' terms, when every matrix's kernel reads them (k != 0) */
    bool terms_apart;    /* made by terms_job after quantize_job, not with each thread's rows */
    int tb;              /* token blocks per row task (matmul_run) */
    float *res;          /* lk_matmul_residual: res += y[0], by task */
    atomic_bool res_bad; /* ... and a sum went non-finite */
} matmul_job;

/* Rows are handed out in multiples of 16 so SIMD kernels that work on row
 * tiles never see a ragged split except at the matrix end, and threads never
 * write the same cache line of y (16 floats = 64 bytes). */
#define ROW_ALIGN 16

/* Tasks per thread of a matrix (lk_matmul_set_split): 1 splits the rows in
 * one contiguous share per thread; more, in smaller tasks that a thread
 * which finishes early takes from one that was descheduled (the pool's
 * work stealing), at the price of a claim per task. */
static _Atomic int g_split = 4; /* lk_tune_defaults' */

void lk_matmul_set_split(int tasks_per_thread) {
    LK_ASSERT(tasks_per_thread >= 1 && tasks_per_thread <= LK_MATMUL_SPLIT_MAX);
    atomic_store(&g_split, tasks_per_thread);
}

int lk_matmul_split(void) { return atomic_load(&g_split); }

static void quantize_job(void *arg, int ith, int nth) {
    matmul_job *j = arg;
    int64_t t0, t1;
    lk_split_range(j->ntok, 1, ith, nth, &t0, &t1);
    const int64_t n = j->W[0]->cols;
    for (int64_t t = t0; t < t1; t++) {
        const float *x = j->x + t * j->x_stride;
        if (j->norm_w) {
            lk_rmsnorm(j->xn + t * n, x, j->norm_w, n, j->eps);
            x = j->xn + t * n;
        }
        if (j->at != LK_TYPE_F32) lk_quantize_row_act(j->at, x, (char *)j->scratch + t * j->a_stride, n);
    }
    if (j->terms.k && !j->terms_apart)
        lk_act_terms_rows(&j->terms, t0, t1, (char *)j->scratch + t0 * j->a_stride, j->a_stride, n);
}

/* terms whose lines hold several tokens: a pass of their own, by parts */
static void terms_job(void *arg, int ith, int nth) {
    matmul_job *j = arg;
    lk_act_terms_part(&j->terms, ith, nth, j->scratch, j->a_stride, j->W[0]->cols);
}

/* Task ith of nth: row task ith / tb of nth / tb, token block ith % tb (the
 * tb blocks of a row task are consecutive tasks, so a thread's home range
 * runs them one after another on the same weights, warm in its L2) */
static void matmul_job_fn(void *arg, int ith, int nth) {
    matmul_job *j = arg;
    int64_t r0 = 0, r1 = 0, t0 = 0, t1 = j->ntok;
    const int64_t n = j->W[0]->cols;
    const lk_act_terms *T = j->terms.k ? &j->terms : NULL;
    lk_act_terms view;
    if (j->tb > 1) {
        const int64_t al = lk_act_terms_view_align(j->terms.k);
        lk_split_range(j->ntok, al, ith % j->tb, j->tb, &t0, &t1);
        lk_act_terms_view(&j->terms, t0, t1, n, &view);
        T = &view;
        ith /= j->tb;
        nth /= j->tb;
    }
    for (int i = 0; i < j->nw; i++) {
        const lk_mat *W = j->W[i];
        lk_split_range(W->rows, ROW_ALIGN, ith, nth, &r0, &r1);
        if (r1 <= r0 || t1 <= t0) continue;
        lk_quant_matmul_terms(W->type, n, r1 - r0, (const char *)W->data + (size_t)r0 * W->row_stride,
                              W->row_stride, t1 - t0, (const char *)j->a + (size_t)t0 * j->a_stride, j->a_stride, T,
                              j->y[i] + t0 * j->y_stride[i] + r0, (size_t)j->y_stride[i]);
    }
    if (j->swiglu && r1 > r0)
        for (int64_t t = t0; t < t1; t++)
            lk_swiglu(j->y[0] + t * j->y_stride[0] + r0, j->y[1] + t * j->y_stride[1] + r0, r1 - r0);
    if (j->res && r1 > r0)
        for (int64_t t = t0; t < t1; t++) {
            float *r = j->res + t * j->y_stride[0] + r0;
            lk_vec_axpy_f32(r, 1.0f, j->y[0] + t * j->y_stride[0] + r0, r1 - r0);
            if (lk_any_nonfinite(r, r1 - r0)) atomic_store_explicit(&j->res_bad, true, memory_order_relaxed);
        }
}

bool lk_matmul_can_fuse(const lk_mat *const *W, int nw) {
    if (nw < 1 || nw > LK_MATMUL_MAX_FUSE) return false;
    for (int i = 1; i < nw; i++)
        if (W[i]->cols != W[0]->cols || lk_type_vec_dot(W[i]->type) != lk_type_vec_dot(W[0]->type)) return false;
    return true;
}

static void matmul_run(lk_pool *p, matmul_job *j) {
    const lk_mat *const *W = j->W;
    const int nw = j->nw;
    const int64_t ntok = j->ntok;
    LK_ASSERT(lk_matmul_can_fuse(W, nw) && (!j->swiglu || (nw == 2 && W[0]->rows == W[1]->rows)));
    const uint64_t t0 = lk_prof_t0();
    j->at = lk_type_vec_dot(W[0]->type);
    /* the activations' pass: RMSNorm (lk_matmul_fused_norm) and quantising
     * to the weights' activation type, per token, over the pool from 4
     * tokens on */
    if (j->norm_w || j->at != LK_TYPE_F32) {
        const bool par = ntok >= 4 && lk_pool_size(p) > 1;
        if (j->at != LK_TYPE_F32) {
            size_t rb = 0;
            LK_ASSERT(lk_type_row_bytes(j->at, W[0]->cols, &rb));
            j->a = j->scratch;
            j->a_stride = rb;
            /* the terms that every call on these activations would derive
             * again (lk_act_terms): once here, if every matrix reads them
             * for the same offset, and if this pass runs over the pool or
             * there is no pool to speak of (a few tokens are quantised
             * inline, on the caller alone: there the tasks deriving them
             * for themselves, in parallel, cost less than the caller doing
             * it first; one thread's tasks derive them one after another) */
            int32_t k = par || (ntok >= 4 && lk_pool_size(p) == 1) ? lk_quant_terms_k(W[0]->type) : 0;
            for (int i = 1; i < nw; i++)
                if (lk_quant_terms_k(W[i]->type) != k) k = 0;
            if (k) lk_act_terms_init(&j->terms, k, W[0]->cols, ntok, (char *)j->scratch + terms_offset(rb * (size_t)ntok));
            j->terms_apart = k && par && !lk_act_terms_by_token(k);
        }
        const uint64_t q0 = lk_prof_t0();
        if (par) {
            const int nq = (int)LK_MIN(ntok, (int64_t)lk_pool_size(p));
            lk_pool_run_k(p, LK_PROF_QUANT, quantize_job, j, nq);
            if (j->terms_apart) lk_pool_run_k(p, LK_PROF_QUANT, terms_job, j, lk_pool_size(p));
        } else {
            quantize_job(j, 0, 1);
        }
        lk_prof_add(LK_PROF_QUANT, q0);
    }
    if (j->at == LK_TYPE_F32) {
        /* F32 weights take the activations as they are (normed: from xn): no copy */
        j->a = j->norm_w ? j->xn : j->x;
        j->a_stride = (size_t)(j->norm_w ? W[0]->cols : j->x_stride) * sizeof(float);
    }
    /* no more tasks than row units of the widest matrix: a task without
     * rows is a claim for nothing */
    int64_t units = 1;
    for (int i = 0; i < nw; i++) units = LK_MAX(units, (W[i]->rows + ROW_ALIGN - 1) / ROW_ALIGN);
    const int nt = (int)LK_MIN((int64_t)lk_pool_size(p) * atomic_load_explicit(&g_split, memory_order_relaxed), units);
    /* Prefill's tasks are long (64 tokens of F16 on 16 threads x 4 tasks:
     * 32 rows each), and a job ends with its slowest thread: on a 16-core
     * Xeon the threads were busy 81-86 % of an F16 pp64's products at 8
     * and 16 threads. Where the terms can be read by token blocks
     * (lk_act_terms_view), each row task is cut into blocks of at least
     * two of their alignments (F16: 24 tokens, two panels; up to 4
     * blocks), which the pool's stealing spreads: busy 93-95 %, pp64 at 16
     * threads 578-585 -> 626-702 tok/s, at 8 335 -> 409 (BENCHMARKS.md,
     * thirty-fourth session). Row tiles keep their height, so the kernels
     * run as fast per product, and the results are the same bits (the
     * kernels' batch invariance: test_tune matmul_bits_across_settings). */
    j->tb = 1;
    const int64_t al = j->terms.k ? lk_act_terms_view_align(j->terms.k) : 0;
    if (al && lk_pool_size(p) > 1) j->tb = (int)LK_MIN(4, (ntok + 2 * al - 1) / (2 * al));
    const lk_prof_kind kind = lk_prof_matmul_kind_now();
    lk_pool_run_k(p, kind, matmul_job_fn, j, LK_MAX(nt, 1) * j->tb);
    lk_prof_add(kind, t0);
}

void lk_matmul_fused(lk_pool *p, const lk_mat *const *W, int nw, const float *x, int64_t x_stride, int64_t ntok,
                     float *const *y, const int64_t *y_stride, bool swiglu, void *scratch) {
    matmul_job j = { .W = W, .nw = nw, .x = x, .x_stride = x_stride, .ntok = ntok, .y = y, .y_stride = y_stride,
                     .swiglu = swiglu, .scratch = scratch };
    matmul_run(p, &j);
}

void lk_matmul_fused_norm(lk_pool *p, const lk_mat *const *W, int nw, const float *x, const float *norm_w, float eps,
                          float *xn, int64_t ntok, float *const *y, const int64_t *y_stride, bool swiglu,
                          void *scratch) {
    LK_ASSERT(norm_w && xn && nw >= 1);
    matmul_job j = { .W = W, .nw = nw, .x = x, .x_stride = W[0]->cols, .ntok = ntok, .y = y, .y_stride = y_stride,
                     .swiglu = swiglu, .scratch = scratch, .norm_w = norm_w, .eps = eps, .xn = xn };
    matmul_run(p, &j);
}

void lk_matmul(lk_pool *p, const lk_mat *W, const float *x, int64_t x_stride, int64_t ntok,
               float *y, int64_t y_stride, void *scratch) {
    lk_matmul_fused(p, &W, 1, x, x_stride, ntok, &y, &y_stride, false, scratch);
}

void lk_matmul_prefetch_next(lk_pool *p, const lk_mat *const *W, int nw) {
    const void *base[LK_POOL_PREFETCH_MAX];
    size_t len[LK_POOL_PREFETCH_MAX];
    int n = 0;
    for (int i = 0; W && i < nw && n < LK_POOL_PREFETCH_MAX; i++) {
        size_t rb = 0;
        /* not a column slice (tensor parallelism): its rows' other columns
         * are another rank's */
        if (W[i] && W[i]->data && W[i]->rows > 0 && lk_type_row_bytes(W[i]->type, W[i]->cols, &rb) &&
            rb == W[i]->row_stride) {
            base[n] = W[i]->data;
            len[n++] = (size_t)W[i]->rows * W[i]->row_stride;
        }
    }
    lk_pool_prefetch(p, base, len, n);
}

bool lk_matmul_residual(lk_pool *p, const lk_mat *W, const float *x, int64_t x_stride, int64_t ntok,
                        float *y, int64_t y_stride, float *r, void *scratch) {
    LK_ASSERT(r && y_stride >= W->rows);
    matmul_job j = { .W = &W, .nw = 1, .x = x, .x_stride = x_stride, .ntok = ntok, .y = &y, .y_stride = &y_stride,
                     .scratch = scratch, .res = r };
    atomic_init(&j.res_bad, false);
    matmul_run(p, &j);
    return atomic_load(&j.res_bad);
}
