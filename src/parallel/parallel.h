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
} lk_slice;

/* The model dimensions a plan needs (filled by the model part). */
typedef struct {
    int     n_layer, n_head, n_head_kv;
    int64_t n_ff, n_vocab;
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

/* Hooks the forward pass calls. allreduce_sum sums x[0..n) over the TP group
 * in rank order (so results never depend on timing) and leaves the sum in x
 * on every rank. A non-OK status aborts the forward pass; the hook's owner
 * keeps the message. */
typedef struct {
    void *ctx;
    lk_status (*allreduce_sum)(void *ctx, float *x, int64_t n, int layer, const char *what);
} lk_tp_hooks;

#endif
