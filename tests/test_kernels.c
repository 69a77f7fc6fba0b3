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
 * head sizes around the 16- and 64-element steps and 1..4 queries, with
 * the weights in rows per query (attention's key blocks) or in lanes
 * (key p, query g at S[p * 16 + g]). */
TEST(attn_av_equals_axpy) {
    enum { P = 77, HD = 136, LANES = 16 };
    static float V[P * HD], S[LANES * P], out[4 * HD], ref[HD];
    for (int i = 0; i < P * HD; i++) V[i] = (float)(urand() * 2 - 1);
    for (int i = 0; i < LANES * P; i++) S[i] = (float)urand();
    const int hds[] = {8, 16, 24, 64, 72, 80, 128, 136};
    for (int lanes = 0; lanes < 2; lanes++) {
        const size_t qs = lanes ? 1 : P, ps = lanes ? LANES : 1;
        for (size_t k = 0; k < sizeof hds / sizeof hds[0]; k++)
            for (int nq = 1; nq <= 4; nq++)
                for (int npos = 1; npos <= P; npos += 19) {
                    int hd = hds[k];
                    /* in two calls, as over two KV pages: out accumulates */
                    int cut = npos / 3;
                    memset(out, 0, sizeof out);
                    if (cut) lk_vec_attn_av_f32(out, HD, S, qs, ps, V, cut, nq, hd);
                    lk_vec_attn_av_f32(out, HD, S + cut * ps, qs, ps, V + (size_t)cut * hd, npos - cut, nq, hd);
                    for (int q = 0; q < nq; q++) {
                        for (int i = 0; i < hd; i++) ref[i] = 0;
                        for (int p = 0; p < npos; p++) lk_vec_axpy_f32(ref, S[q * qs + p * ps], V + p * hd, hd);
                        bool same = true;
                        for (int i = 0; i < hd; i++) same = same && ref[i] == out[q * HD + i];
                        CHECKF(same, "lanes=%d hd=%d nq=%d npos=%d q=%d", lanes, hd, nq, npos, q);
                    }
                }
    }
}

/* The scores with the keys in lanes: each one fused multiply-add per
 * element of the head, in order, from 0 (fmaf, libm's or the instruction:
 * exact either way), at every SIMD level this CPU runs: head sizes on and
 * off the vector steps (MLA's 576 included), 1-16 queries (the 4-, 2- and
 * 1-query tiles), key counts across pages and the 8/4/2/1-vector tiles.
 * Nothing past the keys rounded up to 16 is written. */
TEST(attn_qk_equals_fma_chain) {
    enum { NPG = 4, NK = NPG * LK_ATT_KW, HD = 576, NQ = 16, SS = NK + 16, QS = HD + 3 };
    static float K[NPG][HD * LK_ATT_KW], Q[NQ * QS], S[NQ * SS];
    for (int j = 0; j < NPG; j++)
        for (int i = 0; i < HD * LK_ATT_KW; i++) K[j][i] = (float)(urand() * 2 - 1);
    for (int i = 0; i < NQ * QS; i++) Q[i] = (float)(urand() * 2 - 1);
    const float *pages[NPG] = {K[2], K[0], K[3], K[1]}; /* apart, in any order, as the pool's */
    const char *levels[] = {"scalar", "avx2", "avx512"}, *was = lk_vec_simd_name();
    const int hds[] = {8, 32, 40, 64, 96, 128, 576};
    int runs = 0;
    for (int l = 0; l < 3; l++) {
        if (!lk_vec_set_simd(levels[l])) continue;
        runs++;
        for (size_t k = 0; k < sizeof hds / sizeof hds[0]; k++)
            for (int nq = 1; nq <= NQ; nq += (nq < 9 ? 1 : 7))
                for (int nk = 1; nk <= NK; nk += (nk < 20 ? 1 : 13)) {
                    const int hd = hds[k];
                    for (int i = 0; i < NQ * SS; i++) S[i] = -7.f;
                    lk_vec_attn_qk(S, SS, Q, QS, nq, pages, nk, hd);
                    bool same = true, kept = true;
                    for (int g = 0; g < NQ; g++)
                        for (int p = 0; p < SS; p++) {
                            const float got = S[g * SS + p];
                            if (g >= nq || p >= (nk + 15) / 16 * 16) { kept = kept && got == -7.f; continue; }
                            if (p >= nk) continue;
                            float want = 0;
                            for (int d = 0; d < hd; d++)
                                want = fmaf(Q[g * QS + d], pages[p / LK_ATT_KW][d * LK_ATT_KW + p % LK_ATT_KW], want);
                            same = same && memcmp(&want, &got, 4) == 0;
                        }
                    CHECKF(same, "%s hd=%d nq=%d nk=%d: a score differs from the chain", levels[l], hd, nq, nk);
                    CHECKF(kept, "%s hd=%d nq=%d nk=%d: wrote past the keys", levels[l], hd, nq, nk);
                }
    }
    CHECK(lk_vec_set_simd(was));
    CHECK(runs >= 1);
    printf("  scores = fma chain at %d level%s\n", runs, runs > 1 ? "s" : "");
}

/* An F16 cache's pages go to the kernels as they are: the scores and the
 * weighted sums over F16 keys and values are those over the same pages
 * widened to F32 (exact), bit for bit, at every level this CPU runs, for
 * head sizes on and off the vector steps and 1-16 queries; and a call over
 * more than 64 pages (the kernels take pages 64 at a time) gives the fused
 * multiply-add chain for every key, F32 and F16. */
TEST(attn_f16_equals_widened) {
    enum { NPG = 70, NK = NPG * LK_ATT_KW, HD = 136, NQ = 16, SS = NK + 16 };
    static uint16_t Kh[NPG][HD * LK_ATT_KW], Vh[LK_ATT_KW * HD];
    static float Kf[NPG][HD * LK_ATT_KW], Vf[LK_ATT_KW * HD], Q[NQ * HD], S[NQ * SS], S2[NQ * SS], W[4 * LK_ATT_KW],
        out[4 * HD], out2[4 * HD];
    for (int j = 0; j < NPG; j++)
        for (int i = 0; i < HD * LK_ATT_KW; i++) {
            Kh[j][i] = lk_fp32_to_fp16((float)(urand() * 2 - 1));
            Kf[j][i] = lk_fp16_to_fp32(Kh[j][i]);
        }
    for (int i = 0; i < LK_ATT_KW * HD; i++) Vh[i] = lk_fp32_to_fp16((float)(urand() * 4 - 2)), Vf[i] = lk_fp16_to_fp32(Vh[i]);
    for (int i = 0; i < NQ * HD; i++) Q[i] = (float)(urand() * 2 - 1);
    for (int i = 0; i < 4 * LK_ATT_KW; i++) W[i] = (float)urand();
    const uint16_t *ph[NPG];
    const float *pf[NPG];
    for (int j = 0; j < NPG; j++) ph[j] = Kh[(j * 7) % NPG], pf[j] = Kf[(j * 7) % NPG]; /* apart, in any order */
    const char *levels[] = {"scalar", "avx2", "avx512"}, *was = lk_vec_simd_name();
    const int hds[] = {8, 24, 40, 64, 72, 128, 136};
    int runs = 0;
    for (int l = 0; l < 3; l++) {
        if (!lk_vec_set_simd(levels[l])) continue;
        runs++;
        for (size_t k = 0; k < sizeof hds / sizeof hds[0]; k++) {
            const int hd = hds[k];
            for (int nq = 1; nq <= NQ; nq += (nq < 9 ? 1 : 7)) {
                const int nk = 4 * LK_ATT_KW - (nq * 5) % 17; /* a block of 4 pages, its last part filled */
                lk_vec_attn_qk_f16(S, SS, Q, HD, nq, ph, nk, hd);
                lk_vec_attn_qk(S2, SS, Q, HD, nq, pf, nk, hd);
                bool same = true;
                for (int g = 0; g < nq; g++) same = same && !memcmp(S + g * SS, S2 + g * SS, sizeof(float) * (size_t)nk);
                CHECKF(same, "%s hd=%d nq=%d: F16 scores differ from the widened pages'", levels[l], hd, nq);
            }
            for (int nq = 1; nq <= 4; nq++)
                for (int np = 1; np <= LK_ATT_KW; np += 5) {
                    for (int i = 0; i < 4 * HD; i++) out[i] = out2[i] = (float)(urand() - 0.5);
                    lk_vec_attn_av_f16(out, HD, W, LK_ATT_KW, 1, Vh, np, nq, hd);
                    lk_vec_attn_av_f32(out2, HD, W, LK_ATT_KW, 1, Vf, np, nq, hd);
                    CHECKF(!memcmp(out, out2, sizeof out), "%s hd=%d nq=%d np=%d: F16 sums differ from the widened rows'",
                           levels[l], hd, nq, np);
                }
        }
        /* past 64 pages, against the chain */
        for (int h = 0; h < 2; h++) {
            const int hd = 24, nq = 3;
            if (h) lk_vec_attn_qk_f16(S, SS, Q, HD, nq, ph, NK - 5, hd);
            else lk_vec_attn_qk(S, SS, Q, HD, nq, pf, NK - 5, hd);
            bool same = true;
            for (int g = 0; g < nq; g++)
                for (int p = 0; p < NK - 5; p++) {
                    float want = 0;
                    for (int d = 0; d < hd; d++) want = fmaf(Q[g * HD + d], pf[p / LK_ATT_KW][d * LK_ATT_KW + p % LK_ATT_KW], want);
                    same = same && !memcmp(&want, &S[g * SS + p], 4);
                }
            CHECKF(same, "%s %s: %d keys over %d pages differ from the chain", levels[l], h ? "F16" : "F32", NK - 5, NPG);
        }
    }
    CHECK(lk_vec_set_simd(was));
    CHECK(runs >= 1);
    printf("  F16 pages = widened pages at %d level%s\n", runs, runs > 1 ? "s" : "");
}

/* The running softmax over several key blocks against a double-precision
 * softmax of each query's live keys (scaled; soft-capped too): the weights
 * of block j are e^(s - max_j), so their probability is weight x the later
 * blocks' factors / the final sum. Keys a query does not see weigh exactly
 * 0; queries see different windows (one sees nothing of a block). */
TEST(attn_softmax_matches_double) {
    enum { NB = 128, NBLK = 3, NQ = 16 };
    static float ST[NBLK][NQ * NB];
    static double x[NBLK][NB][NQ];
    double worst = 0;
    for (int capped = 0; capped < 2; capped++) {
        const float scale = 0.125f, cap = capped ? 30.f : 0.f;
        for (int nq = 1; nq <= NQ; nq += 5) {
            int32_t a[NBLK][NQ], b[NBLK][NQ];
            float mx[NQ], al[NBLK][NQ];
            double sum[NQ];
            for (int g = 0; g < nq; g++) { mx[g] = -INFINITY; sum[g] = 0; }
            for (int j = 0; j < NBLK; j++) {
                for (int g = 0; g < nq; g++) {
                    a[j][g] = j == 0 ? g % 7 : 0;                          /* a window's start */
                    b[j][g] = j == NBLK - 1 ? NB - 3 * g : NB;             /* a causal limit */
                    if (j == 1 && g == 1) a[j][g] = b[j][g] = 0;           /* nothing of this block */
                }
                for (int p = 0; p < NB; p++)
                    for (int g = 0; g < NQ; g++) {
                        const float v = (float)(urand() * 400 - 300) + (j == 1 ? 150.f : 0.f); /* a later larger max */
                        ST[j][g * NB + p] = v;
                        if (g < nq) x[j][p][g] = capped ? cap * tanh((double)(v * scale) / cap) : (double)(v * scale);
                    }
                lk_vec_attn_softmax(ST[j], NB, NB, a[j], b[j], nq, scale, cap, mx, sum, al[j]);
            }
            for (int g = 0; g < nq; g++) {
                double dm = -INFINITY, ds = 0;
                for (int j = 0; j < NBLK; j++)
                    for (int p = a[j][g]; p < b[j][g]; p++) dm = fmax(dm, x[j][p][g]);
                for (int j = 0; j < NBLK; j++)
                    for (int p = a[j][g]; p < b[j][g]; p++) ds += exp(x[j][p][g] - dm);
                CHECKF(fabs(mx[g] - dm) <= 1e-5 * fmax(1, fabs(dm)), "nq=%d g=%d: max %g, want %g", nq, g, mx[g], dm);
                for (int j = 0; j < NBLK; j++) {
                    double later = 1;
                    for (int k = j + 1; k < NBLK; k++) later *= al[k][g];
                    for (int p = 0; p < NB; p++) {
                        const float w = ST[j][g * NB + p];
                        if (p < a[j][g] || p >= b[j][g]) {
                            CHECKF(w == 0.f && !signbit(w), "nq=%d g=%d block %d key %d: unseen key weighs %g", nq, g, j, p, w);
                            continue;
                        }
                        const double want = exp(x[j][p][g] - dm) / ds, got = w * later / sum[g];
                        worst = fmax(worst, rel(got, want, 1e-30));
                    }
                }
            }
        }
    }
    /* 2 ulp of exp, the float differences s - max, and the factors' roundings */
    CHECKF(worst < 2e-5, "worst relative error %.3g", worst);
    printf("  running softmax worst relative error %.3g\n", worst);
}

int main(void) {
    RUN(attn_av_equals_axpy);
    RUN(attn_qk_equals_fma_chain);
    RUN(attn_f16_equals_widened);
    RUN(attn_softmax_matches_double);
    RUN(softmax_matches_double);
    RUN(swiglu_matches_double);
    return lk_test_end();
}
