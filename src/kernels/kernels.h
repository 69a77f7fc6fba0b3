/* kernels — the compute building blocks of a forward pass: a persistent
 * thread pool, matmul over quantised weights (lk_mat), rmsnorm, rope,
 * softmax, silu, attention.
 *
 * Threading: lk_pool runs a job of tasks on its threads (the caller is
 * one of them) and returns when all tasks are done; a thread that finishes
 * its share takes unclaimed tasks of one that is behind (descheduled on a
 * busy machine). Workers spin briefly, then sleep on a futex, so a pool
 * never burns a core while its rank waits on the network. No allocation
 * after creation. Speed settings chosen per machine: kernels/tune.h. */
#ifndef LK_KERNELS_H
#define LK_KERNELS_H

#include "common/lk_common.h"
#include "quant/quant.h"

#include <math.h>
#include <string.h>

/* ---- thread pool ---- */
typedef struct lk_pool lk_pool;
/* One task of a job: task ith of nth. Tasks of a job run concurrently, each
 * exactly once, on whichever pool thread claims it (a finished thread takes
 * a descheduled one's tasks), so ith is a task, not a thread: scratch
 * indexed by it is private to the call, and a task must not wait for
 * another task of the same job. */
typedef void (*lk_pool_fn)(void *arg, int ith, int nth);
lk_pool *lk_pool_create(int n_threads); /* n_threads <= 0: number of online cores */
void     lk_pool_free(lk_pool *p);
int      lk_pool_size(const lk_pool *p);
/* Runs fn(arg, i, n) for i < n = the pool's size (one task per thread when
 * every thread runs) and returns when all are done. */
void     lk_pool_run(lk_pool *p, lk_pool_fn fn, void *arg);
/* The same with n_tasks tasks (>= 1): each thread starts on its own
 * contiguous share of them, then takes what is left of the others'. */
void     lk_pool_run_n(lk_pool *p, lk_pool_fn fn, void *arg, int n_tasks);
/* The memory the next weight-streaming job will read: up to
 * LK_POOL_PREFETCH_MAX regions, each cut evenly among the threads in the
 * order a matrix's rows are (thread i's share: bytes [len i/n, len (i+1)/n)).
 * A thread left without work (a job's tail, the serial gaps between jobs)
 * prefetches its share into its cache, from the first byte on, up to
 * LK_POOL_PREFETCH_BYTES. A hint: it changes when memory is read, never
 * what is computed. n = 0 clears it. Call between jobs, from the caller. */
enum { LK_POOL_PREFETCH_MAX = 24, LK_POOL_PREFETCH_BYTES = 256 << 10 };
void     lk_pool_prefetch(lk_pool *p, const void *const *base, const size_t *len, int n);
/* Whether lk_pool_prefetch's hints are followed (default on); a tuning
 * choice (tune.h: hint), process-wide. */
void     lk_pool_set_hints(bool on);
bool     lk_pool_hints(void);
/* ---- where a forward's time goes (bench --profile) ----
 * Off by default (a test of one flag per call when off). When on, every
 * pool run adds its wall time (the caller's view: dispatch, the tasks, the
 * wait for the slowest) and its tasks' summed run time ("busy") under the
 * kind its caller gave; serial sections add their wall time. Process-wide
 * counters: one model per process is what bench profiles (the head's). */
typedef enum {
    LK_PROF_MATMUL,  /* lk_matmul*: activation quantisation + the rows, whole call */
    LK_PROF_QUANT,   /* ... of which quantising the activations */
    LK_PROF_ATTN,    /* attention over the KV cache (and MLA's per-head products) */
    LK_PROF_MOE,     /* a mixture's routed experts */
    LK_PROF_PAR,     /* every other pool run (delta net, GELU, copies) */
    LK_PROF_COMM,    /* the all-reduces between ranks */
    LK_PROF_LAYERS,  /* the whole of lk_model_layers */
    LK_PROF_LOGITS,  /* the whole of lk_model_logits (its matmul included) */
    LK_PROF_LOGITS_MATMUL, /* lk_model_logits' matmul (not in LK_PROF_MATMUL) */
    LK_PROF_N
} lk_prof_kind;
/* Of a pool run's idle thread time (threads x its wall, less busy): before
 * (each thread's wait from the job's publication to its first task; the
 * whole job for a thread that got none) and after (from a thread's last
 * task to the job's end, which the slowest thread decides). The rest of the
 * idle time is between a thread's tasks: claims, the tasks' own calls. */
typedef struct {
    uint64_t wall_ns[LK_PROF_N], busy_ns[LK_PROF_N], calls[LK_PROF_N];
    uint64_t before_ns[LK_PROF_N], after_ns[LK_PROF_N];
} lk_prof;
void lk_prof_enable(bool on);
void lk_prof_reset(void);
void lk_prof_get(lk_prof *out);
/* A serial section: t0 = lk_prof_t0() (0 when off), then lk_prof_add(kind, t0). */
uint64_t lk_prof_t0(void);
void     lk_prof_add(lk_prof_kind k, uint64_t t0);
/* The kind this thread's lk_matmul calls count under (LK_PROF_MATMUL unless
 * set); returns the previous one. */
lk_prof_kind lk_prof_matmul_kind(lk_prof_kind k);
lk_prof_kind lk_prof_matmul_kind_now(void);
/* lk_pool_run_n whose time counts under kind k (lk_pool_run_n: LK_PROF_PAR). */
void lk_pool_run_k(lk_pool *p, lk_prof_kind k, lk_pool_fn fn, void *arg, int n_tasks);

/* Splits [0, n) into nth contiguous chunks whose boundaries are multiples of
 * `align`; returns this thread's [*a, *b). */
void lk_split_range(int64_t n, int64_t align, int ith, int nth, int64_t *a, int64_t *b);

/* ---- weight matrices ---- */
/* A view of `rows` rows of `cols` elements of a (maybe quantised) matrix,
 * row r at (char*)data + r*row_stride. Column slices (tensor parallelism)
 * start on a block boundary. */
typedef struct {
    lk_type     type;
    int64_t     cols;       /* input length */
    int64_t     rows;       /* output length */
    const void *data;
    size_t      row_stride; /* bytes */
} lk_mat;

/* Scratch for matmul's activation quantisation: enough bytes for ntok rows
 * of `cols` in any activation type (F32 is the largest). */
size_t lk_matmul_scratch_bytes(int64_t cols, int64_t ntok);

/* y[t][r] = W row r . x[t] for t < ntok, r < W.rows; x is [ntok][W.cols]
 * (rows x_stride floats apart), y is [ntok][y_stride]. Quantises x to the
 * weight's activation type into `scratch`, then splits rows over the pool. */
/* The thread split of a matrix: tasks per pool thread (1 = one contiguous
 * share each; up to LK_MATMUL_SPLIT_MAX; default 4). A tuning choice: every row's
 * arithmetic is the same whichever thread and task computes it, so it
 * changes speed, never results. Process-wide. */
enum { LK_MATMUL_SPLIT_MAX = 16 };
void lk_matmul_set_split(int tasks_per_thread);
int  lk_matmul_split(void);

void lk_matmul(lk_pool *p, const lk_mat *W, const float *x, int64_t x_stride, int64_t ntok,
               float *y, int64_t y_stride, void *scratch);
/* lk_matmul, then the residual add r += y (r [ntok][y_stride] like y), each
 * task adding the rows it made while they are in its cache: no serial pass
 * over lines the other cores wrote. The same bits as lk_matmul then
 * lk_vec_axpy_f32(r, 1, y); returns whether any sum in r is non-finite. */
bool lk_matmul_residual(lk_pool *p, const lk_mat *W, const float *x, int64_t x_stride, int64_t ntok,
                        float *y, int64_t y_stride, float *r, void *scratch);

/* Several matrices that read the same input (Q, K, V; or FFN gate and up)
 * in one pass over the pool: x is quantised once and each thread takes its
 * share of every matrix, so a layer pays one dispatch instead of one per
 * matrix. With `swiglu` (exactly 2 matrices, gate then up, same rows), each
 * thread then applies y[0] = silu(y[0]) * y[1] to its own rows, with no
 * serial pass afterwards. Matrices must share cols and activation type
 * (lk_matmul_can_fuse); y[i] is [ntok][y_stride[i]]. */
enum { LK_MATMUL_MAX_FUSE = 3 };
bool lk_matmul_can_fuse(const lk_mat *const *W, int nw);
void lk_matmul_fused(lk_pool *p, const lk_mat *const *W, int nw, const float *x, int64_t x_stride, int64_t ntok,
                     float *const *y, const int64_t *y_stride, bool swiglu, void *scratch);
/* The same on RMSNorm'd input: xn[t] = lk_rmsnorm(x[t]) * norm_w (x and xn
 * [ntok][W.cols], contiguous) in the pass that quantises the activations,
 * one dispatch instead of two; the same bits as lk_rmsnorm then
 * lk_matmul_fused (xn holds the normed rows afterwards). */
void lk_matmul_fused_norm(lk_pool *p, const lk_mat *const *W, int nw, const float *x, const float *norm_w, float eps,
                          float *xn, int64_t ntok, float *const *y, const int64_t *y_stride, bool swiglu,
                          void *scratch);
/* lk_pool_prefetch of the matrices the next product will read (NULL
 * entries skipped; none: the hint cleared); the model names each product's
 * successor. A column slice still on the file mapping (row_stride longer
 * than its row; the weight arena's copies are compact) is left out: its
 * rows' other columns are another rank's. */
void lk_matmul_prefetch_next(lk_pool *p, const lk_mat *const *W, int nw);

/* ---- vectors (attention) ---- */
float lk_vec_dot_f32(const float *a, const float *b, int64_t n);
void  lk_vec_axpy_f32(float *y, float a, const float *x, int64_t n);   /* y += a*x */
/* y[i] = x[i], fp16 -> fp32 (exact): the F16 KV cache's rows widened for
 * the F32 dot products and weighted sums above */
void  lk_vec_f16_to_f32(float *y, const uint16_t *x, int64_t n);
/* The sum of x[i]^2 in double (RMSNorm's; vec.c says in which order). */
double lk_vec_sumsq(const float *x, int64_t n);
/* The largest x[i] (-inf for n = 0; NaNs skipped), and x[i] *= s: exact,
 * the same at every level (softmax's passes beside the exponentials). */
float  lk_vec_max(const float *x, int64_t n);
void   lk_vec_scale(float *x, int64_t n, float s);
/* out[i] = (x[i] * s) * w[i], RMSNorm's last pass: exact, the same at every level */
void   lk_vec_scale_mul(float *out, const float *x, float s, const float *w, int64_t n);
/* x[i] = e^(x[i] - sub); returns the sum (in double). Within 2 ulp of expf. */
double lk_vec_exp_sum(float *x, int64_t n, float sub);
/* Attention, FlashAttention's order, with the keys in the lanes of the
 * vectors. A page of LK_ATT_KW keys is stored transposed: element d of key
 * p at K[d * LK_ATT_KW + p]. A block of scores is a row per query (query
 * g's at S + g * ss). The same bits at every SIMD level (vec.c says in
 * which order each kernel works).
 *
 * lk_vec_attn_qk: the scores of nq queries of hd elements (rows q_stride
 * apart) against nk keys in pages K[0], K[1], ... (key p in page p /
 * LK_ATT_KW): S[g * ss + p], one fused multiply-add per element, in order,
 * from 0. Keys from nk to nk rounded up to 16 may be written too, from
 * what the pages hold there. */
enum { LK_ATT_KW = 32 };
void   lk_vec_attn_qk(float *S, size_t ss, const float *q, size_t q_stride, int nq, const float *const *K, int64_t nk,
                      int64_t hd);
/* ... with pages of F16 keys, widened as they are loaded (exact: the bits
 * of lk_vec_attn_qk on the widened pages) */
void   lk_vec_attn_qk_f16(float *S, size_t ss, const float *q, size_t q_stride, int nq, const uint16_t *const *K,
                          int64_t nk, int64_t hd);
/* The running softmax over a block of nb keys: query g (< nq) sees keys
 * [a[g], b[g]) of its row (empty allowed), which are scaled (then
 * soft-capped, cap > 0: cap tanh(s / cap)) and become e^(s - mx') with mx'
 * the larger of mx[g] and their maximum; its other keys, up to nb rounded
 * up to 16, become 0. sum[g] (in double) becomes sum[g] al[g] plus the
 * block's sum, mx[g] becomes mx', and al[g] = e^(mx[g] - mx') is the
 * factor the query's output so far must be scaled by before the block's
 * values are added (1 when the maximum did not grow, or before any: mx[g]
 * = -inf, sum[g] = 0). */
void   lk_vec_attn_softmax(float *S, size_t ss, int64_t nb, const int32_t *a, const int32_t *b, int nq, float scale,
                           float cap, float *mx, double *sum, float *al);
/* Attention's weighted sum for nq <= 4 queries: out[q][i] += sum over p <
 * npos of S[q * q_stride + p * p_stride] * V[p][i] (V rows hd floats
 * apart, out rows out_stride). Equal to an lk_vec_axpy_f32 per position,
 * in order, onto what out holds: the KV cache's pages are summed one call
 * after another (out zeroed before the first) with the bits of one long
 * call. A query that sees fewer positions passes S = 0 for the rest. */
void   lk_vec_attn_av_f32(float *out, size_t out_stride, const float *S, size_t q_stride, size_t p_stride,
                          const float *V, int64_t npos, int nq, int64_t hd);
/* ... with rows of F16 values, widened as they are loaded (the bits of
 * lk_vec_attn_av_f32 on the widened rows) */
void   lk_vec_attn_av_f16(float *out, size_t out_stride, const float *S, size_t q_stride, size_t p_stride,
                          const uint16_t *V, int64_t npos, int nq, int64_t hd);
/* gate[i] = silu(gate[i]) * up[i] (lk_swiglu) */
void   lk_vec_swiglu(float *gate, const float *up, int64_t n);
/* The SIMD level the vector kernels above (and the delta net's state
 * passes, which ask lk_vec_simd_level) run at ("scalar", "avx2", "avx512").
 * The scalar and AVX2 levels give the same bits (vec.c's file comment). */
const char   *lk_vec_simd_name(void);
lk_simd_level lk_vec_simd_level(void);
/* Switches them to `level` for the whole process, as lk_quant_set_simd does
 * the matrix kernels (tests; not while a forward runs); false for an unknown
 * name or a level the CPU cannot run. LK_SIMD does not limit it. */
bool          lk_vec_set_simd(const char *level);

/* lk_fmaf, the scalar kernels' fused multiply-add: common/lk_common.h */

/* ---- elementwise ---- */
void lk_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
void lk_softmax(float *x, int64_t n);
/* Whether any of x[0..n) is NaN or infinite (the logits' and the residual
 * stream's check: an integer test of the exponent bits, vectorised). */
bool lk_any_nonfinite(const float *x, int64_t n);
/* In place out[i] = silu(gate[i]) * up[i]. */
void lk_swiglu(float *gate, const float *up, int64_t n);
/* In place out[i] = gelu_tanh(gate[i]) * up[i] as ggml's CPU backend computes
 * it: the F16-rounded GELU of the F16-rounded input (0 below -10, x above 10). */
void lk_geglu(float *gate, const float *up, int64_t n);

#endif
