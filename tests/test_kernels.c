/* Elementwise kernels (softmax, SwiGLU) at the SIMD level this CPU picks,
 * against double-precision references: within a few float ulps. */
#include "lk_test.h"
#include <string.h>

#include <math.h>
#include <stdlib.h>

#include "kernels/kernels.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

/* relative error, with an absolute floor for values near zero */
static double rel(double got, double want, double floor) { return fabs(got - want) / fmax(fabs(want), floor); }

TEST(softmax_matches_double) {
    static float x[4133];
    const int ns[] = {1, 2, 15, 16, 17, 63, 64, 65, 513, 4133};
    double worst = 0;
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        int n = ns[k];
        double ref[4133], mx = -INFINITY, sum = 0;
        for (int i = 0; i < n; i++) x[i] = (float)(urand() * 60 - 40); /* scores incl. far below the max */
        if (n > 3) x[n / 2] = 100.f;                                     /* one dominant score */
        for (int i = 0; i < n; i++) mx = fmax(mx, x[i]);
        for (int i = 0; i < n; i++) sum += (ref[i] = exp((double)x[i] - mx));
        lk_softmax(x, n);
        double tot = 0;
        for (int i = 0; i < n; i++) {
            worst = fmax(worst, rel(x[i], ref[i] / sum, 1e-30));
            CHECKF(x[i] >= 0 && isfinite(x[i]), "n=%d i=%d: %g", n, i, x[i]);
            tot += x[i];
        }
        CHECKF(fabs(tot - 1) < 1e-5, "n=%d: sum %.9f", n, tot);
    }
    /* 2 ulp of exp, the float division by the sum, and x - max rounded in float */
    CHECKF(worst < 6e-6, "worst relative error %.3g", worst);
    printf("  softmax worst relative error %.3g\n", worst);
}

TEST(swiglu_matches_double) {
    static float g[1037], u[1037];
    double worst = 0;
    for (int i = 0; i < 1037; i++) {
        g[i] = (float)(urand() * 40 - 20);
        u[i] = (float)(urand() * 4 - 2);
    }
    g[0] = -100.f; g[1] = 100.f; g[2] = 0.f; g[3] = -88.f; g[4] = 89.f;
    float g0[1037];
    for (int i = 0; i < 1037; i++) g0[i] = g[i];
    lk_swiglu(g, u, 1037);
    for (int i = 0; i < 1037; i++) {
        double want = (double)g0[i] / (1 + exp(-(double)g0[i])) * u[i];
        CHECKF(isfinite(g[i]), "i=%d g=%g: %g", i, g0[i], g[i]);
        worst = fmax(worst, fabs(g[i] - want) / fmax(fabs(want), 1e-6));
    }
    CHECKF(worst < 2e-6, "worst relative error %.3g", worst);
    printf("  swiglu worst relative error %.3g\n", worst);
}

/* The grouped weighted sum equals one axpy per position, bit for bit, for
 * head sizes around the 16- and 64-element steps and 1..4 queries. */
TEST(attn_av_equals_axpy) {
    enum { P = 77, HD = 136 };
    static float V[P * HD], S[4 * P], out[4 * HD], ref[HD];
    for (int i = 0; i < P * HD; i++) V[i] = (float)(urand() * 2 - 1);
    for (int i = 0; i < 4 * P; i++) S[i] = (float)urand();
    const int hds[] = {8, 16, 24, 64, 72, 80, 128, 136};
    for (size_t k = 0; k < sizeof hds / sizeof hds[0]; k++)
        for (int nq = 1; nq <= 4; nq++)
            for (int npos = 1; npos <= P; npos += 19) {
                int hd = hds[k];
                /* in two calls, as over two KV pages: out accumulates */
                int cut = npos / 3;
                memset(out, 0, sizeof out);
                if (cut) lk_vec_attn_av_f32(out, HD, S, P, V, cut, nq, hd);
                lk_vec_attn_av_f32(out, HD, S + cut, P, V + (size_t)cut * hd, npos - cut, nq, hd);
                for (int q = 0; q < nq; q++) {
                    for (int i = 0; i < hd; i++) ref[i] = 0;
                    for (int p = 0; p < npos; p++) lk_vec_axpy_f32(ref, S[q * P + p], V + p * hd, hd);
                    bool same = true;
                    for (int i = 0; i < hd; i++) same = same && ref[i] == out[q * HD + i];
                    CHECKF(same, "hd=%d nq=%d npos=%d q=%d", hd, nq, npos, q);
                }
            }
}

/* The scores kernel equals one lk_vec_dot_f32 per (query, key), bit for
 * bit, at every SIMD level this CPU runs: head sizes on and off its
 * 32-element steps (MLA's 576 included), key counts across its 8-key
 * tiles, odd and even query counts, strided query and score rows. */
TEST(attn_scores_equal_dot) {
    enum { NP = 37, NQ = 5, HD = 576, QS = HD + 8, SS = NP + 3 };
    static float K[NP * HD], Q[NQ * QS], S[NQ * SS];
    for (int i = 0; i < NP * HD; i++) K[i] = (float)(urand() * 2 - 1);
    for (int i = 0; i < NQ * QS; i++) Q[i] = (float)(urand() * 2 - 1);
    const char *levels[] = {"scalar", "avx2", "avx512"}, *was = lk_vec_simd_name();
    const int hds[] = {8, 32, 40, 64, 96, 128, 256, 576};
    int runs = 0;
    for (int l = 0; l < 3; l++) {
        if (!lk_vec_set_simd(levels[l])) continue;
        runs++;
        for (size_t k = 0; k < sizeof hds / sizeof hds[0]; k++)
            for (int nq = 1; nq <= NQ; nq++)
                for (int np = 1; np <= NP; np += (np < 17 ? 1 : 5)) {
                    const int hd = hds[k];
                    for (int i = 0; i < NQ * SS; i++) S[i] = -7.f;
                    lk_vec_attn_scores_f32(S, SS, Q, QS, nq, K, np, hd);
                    bool same = true, kept = true;
                    for (int g = 0; g < nq; g++) {
                        for (int p = 0; p < np; p++) {
                            const float want = lk_vec_dot_f32(Q + g * QS, K + p * hd, hd);
                            same = same && memcmp(&want, &S[g * SS + p], 4) == 0;
                        }
                        for (int p = np; p < SS; p++) kept = kept && S[g * SS + p] == -7.f;
                    }
                    for (int g = nq; g < NQ; g++)
                        for (int p = 0; p < SS; p++) kept = kept && S[g * SS + p] == -7.f;
                    CHECKF(same, "%s hd=%d nq=%d np=%d: a score differs from the dot", levels[l], hd, nq, np);
                    CHECKF(kept, "%s hd=%d nq=%d np=%d: wrote outside the scores", levels[l], hd, nq, np);
                }
    }
    CHECK(lk_vec_set_simd(was));
    CHECK(runs >= 1);
    printf("  scores = dot at %d level%s\n", runs, runs > 1 ? "s" : "");
}

int main(void) {
    RUN(attn_av_equals_axpy);
    RUN(attn_scores_equal_dot);
    RUN(softmax_matches_double);
    RUN(swiglu_matches_double);
    return lk_test_end();
}
