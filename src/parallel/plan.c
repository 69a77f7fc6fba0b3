/* The plan: which rank holds which layers, heads, FFN rows and vocab rows.
 *
 * Every split is "cut a range of U units into tp contiguous parts in
 * proportion to the weights, each part at least one unit when there are
 * enough": units are
 * alignment groups (heads in groups that keep Wo's quantisation blocks
 * whole, FFN rows in multiples of W2's block), so no quantised block is ever
 * cut. Cuts are rounded cumulative shares (not per-part roundings), so the
 * rounding error never accumulates towards the last rank. */
#include "parallel/parallel.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void lk_slice_full(const lk_plan_dims *d, lk_slice *s) {
    memset(s, 0, sizeof *s);
    s->tp_size = 1;
    s->pp_size = 1;
    s->layer1 = d->n_layer;
    s->head1 = d->n_head;
    s->kv_head1 = d->n_head_kv;
    s->ff1 = d->n_ff;
    s->vocab1 = d->n_vocab;
    s->expert1 = d->n_expert;
}

/* Cuts [0, U) into k parts: cut[0] = 0 <= cut[1] <= ... <= cut[k] = U, sized
 * by w (NULL = even); each part >= 1 unit when U >= k. With fewer units than
 * parts some parts are empty: a rank may hold no attention heads (or no FFN
 * rows) and still share the rest of the layer, which is how a small or
 * coarsely quantised model (one Q4_K block per Wo row) still splits. */
static void cut_units(int64_t U, int k, const double *w, int64_t *cut) {
    if (U < k) {
        /* one unit each for the first U ranks, none for the rest (which the
         * caller then gives the other kind of work first) */
        for (int i = 0; i <= k; i++) cut[i] = LK_MIN((int64_t)i, U);
        return;
    }
    double total = 0;
    for (int i = 0; i < k; i++) total += w ? w[i] : 1.0;
    double acc = 0;
    cut[0] = 0;
    for (int i = 1; i < k; i++) {
        acc += w ? w[i - 1] : 1.0;
        cut[i] = (int64_t)floor((double)U * acc / total + 0.5);
    }
    cut[k] = U;
    /* Every part at least one unit: push cuts up from the left, then down
     * from the right. */
    for (int i = 1; i < k; i++)
        if (cut[i] < cut[i - 1] + 1) cut[i] = cut[i - 1] + 1;
    for (int i = k - 1; i >= 1; i--)
        if (cut[i] > cut[i + 1] - 1) cut[i] = cut[i + 1] - 1;
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) { int64_t t = a % b; a = b; b = t; }
    return a;
}

lk_status lk_plan_make_split(const lk_plan_dims *d, int tp, int pp, const double *weights,
                             const int *layers, lk_slice *out, char *err, size_t errlen) {
    if (tp < 1 || pp < 1 || tp > 256 || pp > 256)
        return lk_fail(err, errlen, LK_ERR_ARG, "plan: --tp %d --pp %d: each must be 1..256", tp, pp);
    if (d->n_layer < 1 || d->n_head < 1 || d->n_head_kv < 1 || d->n_ff < 1 || d->n_vocab < 1)
        return lk_fail(err, errlen, LK_ERR_ARG, "plan: model dimensions must be positive");
    if (d->n_head % d->n_head_kv)
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "plan: %d query heads do not share %d KV heads evenly",
                       d->n_head, d->n_head_kv);
    if (weights)
        for (int i = 0; i < tp; i++)
            if (!(weights[i] > 0) || !isfinite(weights[i]))
                return lk_fail(err, errlen, LK_ERR_ARG, "plan: TP weight %d is %g; weights must be positive", i + 1,
                               weights[i]);
    int64_t ha = d->head_align > 0 ? d->head_align : 1;
    int64_t fa = d->ff_align > 0 ? d->ff_align : 1;
    int64_t va = d->vocab_align > 0 ? d->vocab_align : 1;
    int group = d->n_head / d->n_head_kv; /* query heads per KV head */

    /* Heads: prefer units that are whole KV groups too, so no KV head is
     * stored (and computed) on two ranks; fall back to the Wo alignment when
     * there are fewer KV groups than ranks, and then KV heads are replicated. */
    int64_t hu = ha / gcd64(ha, group) * group;
    if (d->n_head % hu || d->n_head / hu < tp) hu = ha;
    int64_t hU = (d->n_head + hu - 1) / hu;
    int64_t fU = (d->n_ff + fa - 1) / fa;
    /* Fewer head groups (or FFN blocks) than ranks: some ranks hold none of
     * them, but every rank must hold some work, and the attention and FFN
     * shares then fall on different ranks (see cut_units). */
    if (hU + fU < tp)
        return lk_fail(err, errlen, LK_ERR_ARG,
                       "plan: --tp %d is more ranks than the model has work units: %d heads in groups of %lld (to keep "
                       "quantised blocks of attn_output whole) make %lld, %lld FFN rows in blocks of %lld make %lld",
                       tp, d->n_head, (long long)hu, (long long)hU, (long long)d->n_ff, (long long)fa, (long long)fU);
    if (hU < tp || fU < tp)
        lk_log(LK_LOG_INFO, "plan: %lld head group%s and %lld FFN block%s for %d TP ranks: some ranks hold no %s",
               (long long)hU, hU == 1 ? "" : "s", (long long)fU, fU == 1 ? "" : "s", tp,
               hU < tp && fU < tp ? "heads or no FFN rows" : hU < tp ? "attention heads" : "FFN rows");
    int64_t vU = (d->n_vocab + va - 1) / va;
    if (vU < tp)
        return lk_fail(err, errlen, LK_ERR_ARG, "plan: --tp %d exceeds the %lld vocabulary row groups", tp,
                       (long long)vU);
    if (d->n_layer < pp)
        return lk_fail(err, errlen, LK_ERR_ARG, "plan: --pp %d exceeds the model's %d layers", pp, d->n_layer);

    int64_t lcut[257];
    if (layers) {
        int64_t sum = 0;
        lcut[0] = 0;
        for (int i = 0; i < pp; i++) {
            if (layers[i] < 1)
                return lk_fail(err, errlen, LK_ERR_ARG, "plan: --layers-split: stage %d gets %d layers (at least 1)", i,
                               layers[i]);
            sum += layers[i];
            lcut[i + 1] = sum;
        }
        if (sum != d->n_layer)
            return lk_fail(err, errlen, LK_ERR_ARG, "plan: --layers-split adds up to %lld layers, the model has %d",
                           (long long)sum, d->n_layer);
    } else {
        cut_units(d->n_layer, pp, NULL, lcut);
    }
    int64_t hcut[257], fcut[257], vcut[257];
    cut_units(hU, tp, weights, hcut);
    cut_units(fU, tp, weights, fcut);
    if (hU < tp) {
        /* the ranks without heads are the last ones; give them FFN first by
         * cutting the FFN from the other end */
        int64_t rev[257];
        cut_units(fU, tp, weights, rev);
        for (int i = 0; i <= tp; i++) fcut[i] = fU - rev[tp - i];
    }
    cut_units(vU, tp, weights, vcut);

    for (int p = 0; p < pp; p++)
        for (int t = 0; t < tp; t++) {
            lk_slice *s = &out[p * tp + t];
            memset(s, 0, sizeof *s);
            s->tp_rank = t;
            s->tp_size = tp;
            s->pp_rank = p;
            s->pp_size = pp;
            s->layer0 = (int)lcut[p];
            s->layer1 = (int)lcut[p + 1];
            s->head0 = (int)LK_MIN(hcut[t] * hu, (int64_t)d->n_head);
            s->head1 = (int)LK_MIN(hcut[t + 1] * hu, (int64_t)d->n_head);
            /* The KV heads its query heads read: head h uses KV head h / group. */
            s->kv_head0 = s->head0 / group;
            s->kv_head1 = s->head1 > s->head0 ? (s->head1 + group - 1) / group : s->kv_head0;
            s->ff0 = LK_MIN(fcut[t] * fa, d->n_ff);
            s->ff1 = LK_MIN(fcut[t + 1] * fa, d->n_ff);
            s->vocab0 = LK_MIN(vcut[t] * va, d->n_vocab);
            s->vocab1 = LK_MIN(vcut[t + 1] * va, d->n_vocab);
            s->expert1 = d->n_expert;
        }
    return LK_OK;
}

lk_status lk_plan_make(const lk_plan_dims *d, int tp, int pp, const double *weights,
                       lk_slice *out, char *err, size_t errlen) {
    return lk_plan_make_split(d, tp, pp, weights, NULL, out, err, errlen);
}

lk_status lk_plan_experts(const lk_plan_dims *d, int tp, int pp, const double *weights, lk_slice *out,
                          char *err, size_t errlen) {
    if (tp < 1 || pp < 1 || tp > 256 || pp > 256)
        return lk_fail(err, errlen, LK_ERR_ARG, "plan: --tp %d --pp %d: each must be 1..256", tp, pp);
    if (d->n_expert < 1)
        return lk_fail(err, errlen, LK_ERR_ARG, "--expert-parallel needs a mixture-of-experts model; this one is dense");
    if (tp > d->n_expert)
        return lk_fail(err, errlen, LK_ERR_ARG, "--expert-parallel: %d tensor-parallel ranks but the model has only %d "
                       "experts (at least one each)", tp, d->n_expert);
    int64_t ecut[257];
    cut_units(d->n_expert, tp, weights, ecut);
    for (int p = 0; p < pp; p++)
        for (int t = 0; t < tp; t++) {
            lk_slice *s = &out[p * tp + t];
            s->ep = true;
            s->expert0 = (int)ecut[t];
            s->expert1 = (int)ecut[t + 1];
        }
    return LK_OK;
}
