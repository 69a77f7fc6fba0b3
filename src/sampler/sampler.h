/* sampler — picks the next token from logits: greedy, temperature, top-k,
 * top-p, min-p, repetition/frequency/presence penalties; seeded and
 * reproducible (same seed, same logits -> same tokens on every machine).
 *
 * Works on *candidates* (id, logit) so the same code serves one node (all
 * vocabulary rows) and tensor parallelism (each rank contributes its best
 * candidates from its vocabulary slice; nobody gathers full logits):
 *   1. lk_sampler_penalize(s, logits, vocab0, n): penalties on a slice, in place;
 *   2. lk_sampler_top(s, logits, vocab0, n, ids, vals, k): a slice's best k;
 *   3. lk_sampler_pick(s, ids, vals, n): the choice among the candidates.
 * lk_sampler_sample does all three for a full vocabulary.
 * One sampler per sequence; not thread-safe. */
#ifndef LK_SAMPLER_H
#define LK_SAMPLER_H

#include "common/lk_common.h"

typedef struct {
    float    temp;              /* <= 0: greedy (argmax, first index wins ties) */
    int      top_k;             /* <= 0: off */
    float    top_p;             /* >= 1: off */
    float    min_p;             /* <= 0: off */
    float    repeat_penalty;    /* 1: off */
    float    freq_penalty;      /* 0: off */
    float    presence_penalty;  /* 0: off */
    int      penalty_last_n;    /* how many recent tokens the penalties see */
    uint64_t seed;
} lk_sampler_params;

void lk_sampler_params_default(lk_sampler_params *p);

typedef struct lk_sampler lk_sampler;
lk_sampler *lk_sampler_create(const lk_sampler_params *p);
void        lk_sampler_free(lk_sampler *s);
const lk_sampler_params *lk_sampler_get_params(const lk_sampler *s);
/* Most candidates a pick needs from each slice (top_k, or a cap when top_k is off). */
int         lk_sampler_n_candidates(const lk_sampler *s);
bool        lk_sampler_greedy(const lk_sampler *s);

void    lk_sampler_accept(lk_sampler *s, int32_t token);   /* record a token (prompt or generated) */
void    lk_sampler_reset(lk_sampler *s);
void    lk_sampler_penalize(const lk_sampler *s, float *logits, int64_t vocab0, int64_t n);
/* Writes the k best (highest logit, lowest id first on ties) into ids/vals,
 * sorted best first; returns how many (min(k, n)). */
int     lk_sampler_top(const float *logits, int64_t vocab0, int64_t n, int32_t *ids, float *vals, int k);
int32_t lk_sampler_pick(lk_sampler *s, int32_t *ids, float *vals, int n);
/* The penalty settings and the window of recent tokens (in no particular
 * order), for ranks that apply the penalties to their own vocabulary slice. */
void    lk_sampler_penalties(const lk_sampler *s, float *repeat, float *freq, float *presence,
                             const int32_t **hist, int *n_hist);
/* Full-vocabulary convenience (modifies logits by the penalties). */
int32_t lk_sampler_sample(lk_sampler *s, float *logits, int64_t n_vocab);

#endif
