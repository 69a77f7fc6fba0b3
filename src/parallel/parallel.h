/* parallel — the plan (which rank holds which heads, FFN rows, layers and
 * vocabulary rows) and the collectives the forward pass calls.
 *
 * The forward pass (model part) runs one rank's *slice* described by an
 * lk_slice, and calls an all-reduce hook after the attention output and FFN
 * down projections. With one rank the slice is "everything" and the hook is
 * NULL. The forward pass never knows which transport carries the collective.
 *
 * Threading: an lk_comm is used by one thread at a time (the rank's main
 * thread); collectives are blocking with deadlines. */
#ifndef LK_PARALLEL_H
#define LK_PARALLEL_H

#include "common/lk_common.h"

/* One rank's share of the model. Ranges are half-open [a, b). */
typedef struct {
    int tp_rank, tp_size;     /* position in its tensor-parallel group */
    int pp_rank, pp_size;     /* pipeline stage */
    int layer0, layer1;       /* layers this stage runs */
    int head0, head1;         /* query heads */
    int kv_head0, kv_head1;   /* KV heads stored here (covers head0..head1-1) */
    int64_t ff0, ff1;         /* FFN hidden rows (gate/up rows, down columns) */
    int64_t vocab0, vocab1;   /* output-projection rows */
    /* Routed experts of a mixture. Without expert parallelism (ep false)
     * every rank holds rows [ff0, ff1) of every expert (as a dense FFN) and
     * the range is [0, n_expert). With it (--expert-parallel) this rank
     * holds experts [expert0, expert1) whole, every row, and none of the
     * others; the shared expert and dense layers stay cut by [ff0, ff1). */
    bool ep;
    int expert0, expert1;
} lk_slice;

/* The model dimensions a plan needs (filled by the model part). */
typedef struct {
    int     n_layer, n_head, n_head_kv;
    int64_t n_ff, n_vocab;
    int     n_expert;         /* routed experts (0: dense) */
    /* Alignment units so that quantised blocks are never cut: a head range
     * boundary must fall on a multiple of head_align heads, an FFN boundary
     * on a multiple of ff_align rows (from the block size of Wo / W2). */
    int     head_align;
    int64_t ff_align, vocab_align;
} lk_plan_dims;

/* The whole model on one rank. */
void lk_slice_full(const lk_plan_dims *d, lk_slice *s);

/* Splits the model over tp x pp ranks. weights (tp entries, may be NULL for
 * even) gives each TP rank's relative share. Rank r = pp_rank * tp + tp_rank.
 * out must hold tp*pp slices. Fails with a clear message when impossible
 * (e.g. more TP ranks than alignable head groups). */
lk_status lk_plan_make(const lk_plan_dims *d, int tp, int pp, const double *weights,
                       lk_slice *out, char *err, size_t errlen);

/* Expert parallelism: places whole experts on the TP ranks of every stage
 * of a plan lk_plan_make made (out, tp x pp slices): contiguous ranges in
 * proportion to weights (NULL: even), so expert e of E is on rank
 * e * tp / E when even. Fails on a dense model and on more TP ranks than
 * experts. Attention, the shared expert and dense layers keep their cuts. */
lk_status lk_plan_experts(const lk_plan_dims *d, int tp, int pp, const double *weights, lk_slice *out,
                          char *err, size_t errlen);

/* Hooks the forward pass calls. allreduce_sum sums x[0..n) over the TP group
 * in rank order (so results never depend on timing) and leaves the sum in x
 * on every rank. A non-OK status aborts the forward pass; the hook's owner
 * keeps the message. */
typedef struct {
    void *ctx;
    lk_status (*allreduce_sum)(void *ctx, float *x, int64_t n, int layer, const char *what);
} lk_tp_hooks;

/* --- plan with explicit layer counts (--layers-split) ---------------------
 * layers (pp entries, may be NULL for an even split) gives each pipeline
 * stage's number of layers; they must sum to n_layer. lk_plan_make is this
 * with layers = NULL. */
lk_status lk_plan_make_split(const lk_plan_dims *d, int tp, int pp, const double *weights,
                             const int *layers, lk_slice *out, char *err, size_t errlen);

/* --- collectives ------------------------------------------------------------
 * An lk_comm is a group of ranks of a transport mesh (a TP group) and the
 * scratch its collectives need. Every call blocks until done or until the
 * comm's deadline (default 30 s per call) passes; a failure returns a status,
 * and lk_comm_last_error() says which operation, layer, size and peer
 * ("all-reduce layer 3 ffn_out (16384 B, exchange): rank 2 (10.0.0.3:7070):
 * connection closed by peer while receiving 16384 bytes (got 0)").
 *
 * Determinism: all-reduce results are bitwise identical on every rank and do
 * not depend on timing. The exchange and scatter algorithms sum partials in
 * rank order 0..N-1 (the same bits, whatever the payload size: what batch
 * invariance needs, so lk_comm_pick chooses only between them); recursive
 * doubling adds (lower half + upper half) at each level; the ring
 * accumulates chunk c in the fixed order c, c+1, ..., c-1. The algorithm
 * depends only on (N, bytes), and for 2 ranks on their one link's kind, so
 * every rank picks the same one. */
typedef struct lk_mesh lk_mesh;
typedef struct lk_comm lk_comm;

typedef enum {
    LK_AR_AUTO = 0,   /* by size and N (lk_comm_pick) */
    LK_AR_EXCHANGE,   /* one round: everyone sends its partial to everyone (over shm: through
                         the link's window, read in place) */
    LK_AR_DOUBLING,   /* log2(N) rounds of pairwise exchange */
    LK_AR_RING,       /* 2(N-1) rounds of 1/N chunks: bandwidth-optimal */
    LK_AR_SCATTER,    /* 2 rounds: chunk k of every partial to rank k, which adds them in rank
                         order and sends the sum back: exchange's bits at the ring's bytes */
} lk_ar_algo;
const char *lk_ar_algo_name(lk_ar_algo a);
/* The pick by group size and bytes alone (exchange or scatter) */
lk_ar_algo  lk_comm_pick(int n_ranks, size_t bytes);

/* ranks: the group's members as mesh ranks, in group order (NULL: the whole
 * mesh); must contain this process's mesh rank. The mesh must outlive it. */
lk_status lk_comm_create(lk_mesh *mesh, const int *ranks, int n, lk_comm **out, char *err, size_t errlen);
void lk_comm_free(lk_comm *c);
int  lk_comm_rank(const lk_comm *c);  /* position in the group */
int  lk_comm_size(const lk_comm *c);
void lk_comm_set_timeout_ms(lk_comm *c, int64_t ms);
void lk_comm_set_algo(lk_comm *c, lk_ar_algo a);  /* force one (tests, netbench) */
/* Threads for the copies through shm windows (exchange): run(ctx, fn, arg, n) calls
 * fn(arg, i, n) once for every i < n, on any threads, and returns when all
 * did (the engine hands its pool, idle while it waits on the collective).
 * A core reads another core's cache lines at a bounded rate (about 10 GB/s
 * on a Xeon), so n readers move the peer's partial n times as fast. NULL:
 * the calling thread alone. */
typedef void (*lk_comm_task_fn)(void *arg, int i, int n);
typedef void (*lk_comm_run_fn)(void *ctx, lk_comm_task_fn fn, void *arg, int n);
void lk_comm_set_runner(lk_comm *c, lk_comm_run_fn run, void *ctx, int n);
/* What an automatic all-reduce of `bytes` runs on this group: 2 ranks over
 * shm exchange up to 512 KiB in f32 (through the window: netbench, below);
 * otherwise lk_comm_pick's answer. */
lk_ar_algo lk_comm_algo(const lk_comm *c, size_t bytes);
/* Sizes the scratch for all-reduces of up to n floats now, so the per-token
 * path never allocates (it grows on demand otherwise, once). */
void lk_comm_reserve(lk_comm *c, int64_t n);
const char *lk_comm_last_error(const lk_comm *c);

/* what: a short operation name for messages ("attn_out"); layer < 0: none. */
lk_status lk_comm_allreduce_sum(lk_comm *c, float *x, int64_t n, int layer, const char *what);
lk_status lk_comm_broadcast(lk_comm *c, void *buf, size_t bytes, int root, const char *what);
/* Every rank contributes `bytes`; root receives them in group order into
 * out[size * bytes] (out is ignored elsewhere). */
lk_status lk_comm_gather(lk_comm *c, const void *in, size_t bytes, void *out, int root, const char *what);
lk_status lk_comm_barrier(lk_comm *c);
/* Greedy sampling without gathering logits: every rank passes its best
 * (value, global index); all get the overall best, ties to the lowest index,
 * NaN never wins. */
lk_status lk_comm_argmax(lk_comm *c, float *value, int64_t *index);
/* Compact wire formats for all-reduce payloads (off by default): halve
 * (F16, BF16) or nearly quarter (Q8: blocks of 32 int8 with an F16 scale,
 * 34 bytes per 32 floats) the bytes on the wire, at a rounding of every
 * partial sum sent. Results stay bitwise identical on all ranks: a rank
 * rounds its own contribution exactly as the wire rounds it. Every rank of
 * a group must use the same format. */
typedef enum { LK_WIRE_F32 = 0, LK_WIRE_F16, LK_WIRE_BF16, LK_WIRE_Q8 } lk_wire_fmt;
const char *lk_wire_fmt_name(lk_wire_fmt f);
bool        lk_wire_fmt_parse(const char *s, lk_wire_fmt *f); /* "f32", "f16", "bf16", "q8" */
size_t      lk_wire_bytes(lk_wire_fmt f, int64_t n);          /* encoded size of n floats */
void        lk_comm_set_wire(lk_comm *c, lk_wire_fmt f);
/* The SIMD the wire codecs use ("scalar", "f16c", "avx2"). */
const char *lk_wire_simd_name(void);
/* Points the forward pass's hook at this comm. */
void lk_comm_tp_hooks(lk_comm *c, lk_tp_hooks *h);

#endif
