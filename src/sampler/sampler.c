#include "sampler/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Candidates considered when top_k is off: beyond a few hundred, tokens carry
 * negligible probability mass for any top_p/min_p people use, and a bounded
 * list keeps the per-token work (and the TP candidate exchange) small. */
#define LK_SAMPLER_MAX_CAND 256

struct lk_sampler {
    lk_sampler_params p;
    uint64_t rng[4];
    int32_t *hist;          /* ring of the last penalty_last_n tokens */
    int      n_hist, hist_at;
    int32_t  cand_ids[LK_SAMPLER_MAX_CAND];
    float    cand_vals[LK_SAMPLER_MAX_CAND];
};

void lk_sampler_params_default(lk_sampler_params *p) {
    *p = (lk_sampler_params){ .temp = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                              .repeat_penalty = 1.0f, .freq_penalty = 0, .presence_penalty = 0,
                              .penalty_last_n = 64, .seed = 42 };
}

/* xoshiro256** seeded by splitmix64: fast, and identical on every platform. */
static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
static uint64_t next_u64(uint64_t s[4]) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t; s[3] = rotl(s[3], 45);
    return r;
}
static double next_unit(uint64_t s[4]) { return (double)(next_u64(s) >> 11) * 0x1.0p-53; }

lk_sampler *lk_sampler_create(const lk_sampler_params *p) {
    lk_sampler *s = lk_xcalloc(1, sizeof *s);
    s->p = *p;
    if (s->p.penalty_last_n < 0) s->p.penalty_last_n = 0;
    s->hist = lk_xcalloc((size_t)s->p.penalty_last_n + 1, sizeof(int32_t));
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix(&x);
    return s;
}

void lk_sampler_free(lk_sampler *s) {
    if (!s) return;
    free(s->hist);
    free(s);
}

const lk_sampler_params *lk_sampler_get_params(const lk_sampler *s) { return &s->p; }

bool lk_sampler_greedy(const lk_sampler *s) { return s->p.temp <= 0 || s->p.top_k == 1; }

int lk_sampler_n_candidates(const lk_sampler *s) {
    if (lk_sampler_greedy(s)) return 1;
    return s->p.top_k > 0 && s->p.top_k < LK_SAMPLER_MAX_CAND ? s->p.top_k : LK_SAMPLER_MAX_CAND;
}

void lk_sampler_accept(lk_sampler *s, int32_t token) {
    if (s->p.penalty_last_n == 0) return;
    s->hist[s->hist_at] = token;
    s->hist_at = (s->hist_at + 1) % s->p.penalty_last_n;
    if (s->n_hist < s->p.penalty_last_n) s->n_hist++;
}

void lk_sampler_penalties(const lk_sampler *s, float *repeat, float *freq, float *presence,
                          const int32_t **hist, int *n_hist) {
    *repeat = s->p.repeat_penalty;
    *freq = s->p.freq_penalty;
    *presence = s->p.presence_penalty;
    *hist = s->hist;
    *n_hist = s->n_hist;
}

void lk_sampler_reset(lk_sampler *s) { s->n_hist = s->hist_at = 0; }

void lk_sampler_penalize(const lk_sampler *s, float *logits, int64_t vocab0, int64_t n) {
    const lk_sampler_params *p = &s->p;
    if (!s->n_hist || (p->repeat_penalty == 1.0f && p->freq_penalty == 0 && p->presence_penalty == 0)) return;
    /* count occurrences per distinct token in the window: the window is small
     * (penalty_last_n), so a quadratic scan beats a vocabulary-sized table */
    for (int i = 0; i < s->n_hist; i++) {
        int32_t t = s->hist[i];
        if (t < vocab0 || t >= vocab0 + n) continue;
        bool seen = false;
        int count = 0;
        for (int j = 0; j < s->n_hist; j++) {
            if (s->hist[j] == t) {
                if (j < i) { seen = true; break; }
                count++;
            }
        }
        if (seen) continue;
        float *l = &logits[t - vocab0];
        /* as llama.cpp: divide positive logits, multiply negative ones */
        if (*l > 0) *l /= p->repeat_penalty;
        else *l *= p->repeat_penalty;
        *l -= (float)count * p->freq_penalty + (count > 0 ? p->presence_penalty : 0);
    }
}

static bool better(float va, int32_t ia, float vb, int32_t ib) { return va > vb || (va == vb && ia < ib); }

/* A slice's best k (better(): the higher logit, the lower id on a tie: a
 * total order, so the k and their order are unique). The list is a heap
 * with its worst at the root while the slice is read (an insertion costs
 * log k moves, not up to k: with a sorted list the sampling default of 256
 * candidates took 112 us a row of 32000 random logits on a Zen 5 core, now
 * 52), then sorted best first in place. NaN never enters. Once the heap is
 * full, a logit below its worst value cannot enter: those are skipped 16 at
 * a time, in a loop the compiler makes vector compares of (greedy: 18 -> 4
 * us a row). On the step's head every sampled row of every sequence goes
 * through here, one after another. */
static bool all_below(const float *x, float t) {
    int hit = 0;
    for (int j = 0; j < 16; j++) hit |= x[j] >= t;
    return !hit;
}

/* the worst of heap[0..m) to the root again after heap[at] changed for the better */
static void sift_down(int32_t *ids, float *vals, int m, int at) {
    for (;;) {
        int w = at, c = 2 * at + 1;
        if (c < m && better(vals[w], ids[w], vals[c], ids[c])) w = c;
        if (c + 1 < m && better(vals[w], ids[w], vals[c + 1], ids[c + 1])) w = c + 1;
        if (w == at) return;
        float v = vals[at]; vals[at] = vals[w]; vals[w] = v;
        int32_t d = ids[at]; ids[at] = ids[w]; ids[w] = d;
        at = w;
    }
}

int lk_sampler_top(const float *logits, int64_t vocab0, int64_t n, int32_t *ids, float *vals, int k) {
    if (k <= 0) return 0;
    int m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (m == k) {
            while (i + 16 <= n && all_below(logits + i, vals[0])) i += 16;
            if (i == n) break;
        }
        const float v = logits[i];
        const int32_t id = (int32_t)(vocab0 + i);
        if (m < k) {
            if (v != v) continue; /* NaN: never better than anything */
            int at = m++;
            /* up while its parent is better (the root is the worst) */
            while (at > 0 && better(vals[(at - 1) / 2], ids[(at - 1) / 2], v, id)) {
                vals[at] = vals[(at - 1) / 2];
                ids[at] = ids[(at - 1) / 2];
                at = (at - 1) / 2;
            }
            vals[at] = v;
            ids[at] = id;
        } else if (better(v, id, vals[0], ids[0])) {
            vals[0] = v;
            ids[0] = id;
            sift_down(ids, vals, m, 0);
        }
    }
    /* heap sort: the worst of what is left to the end, until best first */
    for (int e = m - 1; e > 0; e--) {
        float v = vals[0]; vals[0] = vals[e]; vals[e] = v;
        int32_t d = ids[0]; ids[0] = ids[e]; ids[e] = d;
        sift_down(ids, vals, e, 0);
    }
    return m;
}

static void sort_cands(int32_t *ids, float *vals, int n) {
    for (int i = 1; i < n; i++) {
        float v = vals[i];
        int32_t id = ids[i];
        int j = i;
        while (j > 0 && better(v, id, vals[j - 1], ids[j - 1])) { vals[j] = vals[j - 1]; ids[j] = ids[j - 1]; j--; }
        vals[j] = v;
        ids[j] = id;
    }
}

int32_t lk_sampler_pick(lk_sampler *s, int32_t *ids, float *vals, int n) {
    LK_ASSERT(n > 0);
    sort_cands(ids, vals, n);
    if (lk_sampler_greedy(s)) return ids[0];
    const lk_sampler_params *p = &s->p;
    if (p->top_k > 0 && n > p->top_k) n = p->top_k;
    /* probabilities without temperature for top-p / min-p, as llama.cpp's
     * default chain (top_k -> top_p -> min_p -> temperature -> sample) */
    double probs[LK_SAMPLER_MAX_CAND];
    if (n > LK_SAMPLER_MAX_CAND) n = LK_SAMPLER_MAX_CAND;
    double sum = 0;
    for (int i = 0; i < n; i++) { probs[i] = exp((double)vals[i] - vals[0]); sum += probs[i]; }
    if (p->top_p < 1.0f) {
        double cum = 0;
        for (int i = 0; i < n; i++) {
            cum += probs[i] / sum;
            if (cum >= p->top_p) { n = i + 1; break; }
        }
    }
    if (p->min_p > 0) {
        int keep = 1;
        while (keep < n && probs[keep] >= p->min_p * probs[0]) keep++;
        n = keep;
    }
    sum = 0;
    for (int i = 0; i < n; i++) { probs[i] = exp(((double)vals[i] - vals[0]) / p->temp); sum += probs[i]; }
    double r = next_unit(s->rng) * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += probs[i];
        if (r < acc) return ids[i];
    }
    return ids[n - 1];
}

int32_t lk_sampler_sample(lk_sampler *s, float *logits, int64_t n_vocab) {
    lk_sampler_penalize(s, logits, 0, n_vocab);
    int k = lk_sampler_n_candidates(s);
    int m = lk_sampler_top(logits, 0, n_vocab, s->cand_ids, s->cand_vals, k);
    return lk_sampler_pick(s, s->cand_ids, s->cand_vals, m);
}
