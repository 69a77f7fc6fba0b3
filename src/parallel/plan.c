/* The plan: which rank holds which layers, heads, FFN rows and vocab rows. */
#include "parallel/parallel.h"

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
}
