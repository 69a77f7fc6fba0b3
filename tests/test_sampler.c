/* The sampler against independent computations: greedy ties, top-k/top-p/
 * min-p candidate sets, penalties as llama.cpp defines them, reproducibility
 * by seed, and sampling frequencies against the softmax they should follow. */
#include "lk_test.h"

#include <math.h>

#include "sampler/sampler.h"

static lk_sampler *mk(float temp, int top_k, float top_p, float min_p, uint64_t seed) {
    lk_sampler_params p;
    lk_sampler_params_default(&p);
    p.temp = temp; p.top_k = top_k; p.top_p = top_p; p.min_p = min_p; p.seed = seed;
    return lk_sampler_create(&p);
}

TEST(greedy_first_index_wins_ties) {
    lk_sampler *s = mk(0, 40, 1, 0, 1);
    float l[6] = { 1, 3, 2, 3, -1, 0 };
    CHECK(lk_sampler_sample(s, l, 6) == 1);
    lk_sampler_free(s);
}

TEST(top_keeps_best_sorted_lowest_id_on_ties) {
    float l[8] = { 0.5f, 2, 2, -1, 7, 2, 0, 1 };
    int32_t ids[4];
    float v[4];
    int n = lk_sampler_top(l, 100, 8, ids, v, 4);
    CHECK(n == 4);
    CHECK(ids[0] == 104 && ids[1] == 101 && ids[2] == 102 && ids[3] == 105);
    CHECK(v[0] == 7 && v[3] == 2);
}

/* lk_sampler_top against a sort of the whole slice: random slices of many
 * lengths (not multiples of its 16-logit skips), values from a few levels
 * (many ties) or spread out, -inf and NaN among them, k from 1 past the
 * slice's length. The reference: every non-NaN logit, ordered by value
 * down and id up, its first k. */
static int ref_cmp(const void *a, const void *b) {
    const float *x = a, *y = b; /* (value, id as float) pairs */
    if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

TEST(top_matches_a_full_sort) {
    static const int ks[] = {1, 2, 3, 16, 40, 256, 1000};
    static const int64_t lens[] = {1, 15, 16, 17, 100, 1000, 4099, 32000};
    uint64_t rng = 12345;
    int cases = 0;
    float *l = malloc(32000 * sizeof(float)), *pairs = malloc(32000 * 2 * sizeof(float)), *v = malloc(1000 * sizeof(float));
    int32_t *ids = malloc(1000 * sizeof(int32_t));
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
    for (int kind = 0; kind < 3; kind++)
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
        const int64_t n = lens[li];
        const int k = ks[ki];
        int np = 0;
        for (int64_t i = 0; i < n; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            const uint32_t r = (uint32_t)(rng >> 33);
            l[i] = kind == 0 ? (float)(r % 7) - 3 : kind == 1 ? (float)(r % 100000) / 997.0f - 50 : (float)i * 0.001f;
            if (kind < 2 && r % 53 == 0) l[i] = -INFINITY;
            if (kind < 2 && r % 61 == 1) l[i] = NAN;
            if (l[i] == l[i]) { pairs[2 * np] = l[i]; pairs[2 * np + 1] = (float)(7 + i); np++; }
        }
        qsort(pairs, (size_t)np, 2 * sizeof(float), ref_cmp);
        const int got = lk_sampler_top(l, 7, n, ids, v, k);
        int bad = got != (np < k ? np : k);
        for (int c = 0; c < got && !bad; c++) bad = ids[c] != (int32_t)pairs[2 * c + 1] || v[c] != pairs[2 * c];
        CHECKF(!bad, "slice of %lld (kind %d), k %d: %d candidates, %s", (long long)n, kind, k, got,
               got ? "not the sort's first k" : "none");
        cases++;
    }
    printf("  %d slices\n", cases);
    free(l); free(pairs); free(v); free(ids);
}

/* Frequencies of 20000 draws follow softmax(l/T) over the survivors. */
TEST(sampling_follows_softmax_with_temperature) {
    float base[4] = { 2.0f, 1.0f, 0.5f, -3.0f };
    const float T = 0.7f;
    lk_sampler *s = mk(T, 0, 1.0f, 0.0f, 1234);
    int counts[4] = { 0 };
    for (int i = 0; i < 20000; i++) {
        float l[4];
        memcpy(l, base, sizeof l);
        counts[lk_sampler_sample(s, l, 4)]++;
    }
    double z = 0, p[4];
    for (int i = 0; i < 4; i++) z += exp(base[i] / T);
    for (int i = 0; i < 4; i++) {
        p[i] = exp(base[i] / T) / z;
        double f = counts[i] / 20000.0, sd = sqrt(p[i] * (1 - p[i]) / 20000.0);
        CHECKF(fabs(f - p[i]) < 5 * sd + 1e-3, "token %d: %.4f vs %.4f", i, f, p[i]);
    }
    lk_sampler_free(s);
}

TEST(top_k_top_p_min_p_cut_the_tail) {
    float base[5] = { 3, 2.9f, 1, 0, -5 };
    /* top_k 2: only ids 0 and 1 */
    lk_sampler *s = mk(1.0f, 2, 1.0f, 0, 7);
    for (int i = 0; i < 2000; i++) { float l[5]; memcpy(l, base, sizeof l); CHECK(lk_sampler_sample(s, l, 5) <= 1); }
    lk_sampler_free(s);
    /* top_p 0.5: p0 = 0.45.. < 0.5, so ids 0 and 1 (cumulative 0.87) */
    s = mk(1.0f, 0, 0.5f, 0, 7);
    for (int i = 0; i < 2000; i++) { float l[5]; memcpy(l, base, sizeof l); CHECK(lk_sampler_sample(s, l, 5) <= 1); }
    lk_sampler_free(s);
    /* min_p 0.5: keeps tokens with p >= 0.5 p_max: ids 0, 1 (exp(-0.1)=0.9) but not 2 (exp(-2)=0.14) */
    s = mk(1.0f, 0, 1.0f, 0.5f, 7);
    for (int i = 0; i < 2000; i++) { float l[5]; memcpy(l, base, sizeof l); CHECK(lk_sampler_sample(s, l, 5) <= 1); }
    lk_sampler_free(s);
}

TEST(same_seed_same_tokens) {
    lk_sampler *a = mk(1.0f, 0, 1.0f, 0, 99), *b = mk(1.0f, 0, 1.0f, 0, 99), *c = mk(1.0f, 0, 1.0f, 0, 100);
    int same_ab = 0, same_ac = 0;
    for (int i = 0; i < 200; i++) {
        float l1[16], l2[16], l3[16];
        for (int j = 0; j < 16; j++) l1[j] = l2[j] = l3[j] = (float)((j * 7) % 5);
        int x = lk_sampler_sample(a, l1, 16), y = lk_sampler_sample(b, l2, 16), z = lk_sampler_sample(c, l3, 16);
        same_ab += x == y;
        same_ac += x == z;
    }
    CHECK(same_ab == 200);
    CHECK(same_ac < 200);
    lk_sampler_free(a); lk_sampler_free(b); lk_sampler_free(c);
}

TEST(penalties_as_llama_cpp) {
    lk_sampler_params p;
    lk_sampler_params_default(&p);
    p.temp = 0; p.repeat_penalty = 2.0f; p.freq_penalty = 0.5f; p.presence_penalty = 0.25f; p.penalty_last_n = 4;
    lk_sampler *s = lk_sampler_create(&p);
    lk_sampler_accept(s, 9);      /* falls out of the window of 4 */
    lk_sampler_accept(s, 1);
    lk_sampler_accept(s, 2);
    lk_sampler_accept(s, 1);
    lk_sampler_accept(s, 3);
    float l[10] = { 0, 4, -2, 1, 0, 0, 0, 0, 0, 5 };
    lk_sampler_penalize(s, l, 0, 10);
    /* id 1: 4/2 - 2*0.5 - 0.25 = 0.75; id 2: -2*2 - 0.5 - 0.25 = -4.75;
     * id 3: 1/2 - 0.5 - 0.25 = -0.25; id 9 untouched (outside the window) */
    CHECKF(fabsf(l[1] - 0.75f) < 1e-6f, "%g", l[1]);
    CHECKF(fabsf(l[2] + 4.75f) < 1e-6f, "%g", l[2]);
    CHECKF(fabsf(l[3] + 0.25f) < 1e-6f, "%g", l[3]);
    CHECK(l[9] == 5 && l[0] == 0);
    /* a slice [2, 6) sees only its own ids, at local offsets */
    float sl[4] = { -2, 1, 0, 0 };
    lk_sampler_penalize(s, sl, 2, 4);
    CHECKF(fabsf(sl[0] + 4.75f) < 1e-6f && fabsf(sl[1] + 0.25f) < 1e-6f && sl[2] == 0, "%g %g", sl[0], sl[1]);
    lk_sampler_free(s);
}

int main(void) {
    RUN(greedy_first_index_wins_ties);
    RUN(top_keeps_best_sorted_lowest_id_on_ties);
    RUN(top_matches_a_full_sort);
    RUN(sampling_follows_softmax_with_temperature);
    RUN(top_k_top_p_min_p_cut_the_tail);
    RUN(same_seed_same_tokens);
    RUN(penalties_as_llama_cpp);
    return lk_test_end();
}
