/* K-quant weight quantisers (for `gen-model --type q4_k` and `quantize`),
 * following the algorithm of ggml's reference quantiser for Q4_K (no
 * importance matrix): per 32-element sub-block a weighted least-squares fit
 * of scale and min over a small grid of candidate scales, then 6-bit packing
 * of the sub-block scales and mins against the super-block's d and dmin. The
 * weights favour large-magnitude elements (sqrt(mean x^2) + |x|). Matching
 * the reference makes our files byte-identical to llama-quantize's
 * (tests/test_quant.c checks against synth-llama-q4_k_m). */
#include "quant/quant_impl.h"

#include <math.h>
#include <string.h>

/* Round half to even, as ggml's nearest_int (the 1.5*2^23 trick). */
static inline int nearest(float f) { return (int)nearbyintf(f); }

/* Fits x ~ scale * L + min (min <= 0) with L in [0, nmax], minimising the
 * weighted squared error; tries nstep scales around nmax/(max-min). Returns
 * the scale and stores -min in *neg_min. */
static float fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min,
                           uint8_t *Laux, float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *neg_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest(iscale * (x[i] - min));
        L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        float diff = scale * L[i] + min - x[i];
        best += w[i] * diff * diff;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest(iscale * (x[i] - min));
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                err += w[i] * diff * diff;
            }
            if (err < best) {
                memcpy(L, Laux, (size_t)n);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *neg_min = -min;
    return scale;
}

void lk_quantize_row_q4_k(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t ib = 0; ib < n / LK_QK_K; ib++, x += LK_QK_K, b += LK_Q4K_BYTES) {
        uint8_t L[LK_QK_K], Laux[32];
        float w[32], mins[8], scales[8], max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + 32 * j;
            float sum_x2 = 0;
            for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
            float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
            scales[j] = fit_scale_min(32, 15, xs, w, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        uint8_t *sc = b + LK_Q4K_SC;
        memset(sc, 0, 12);
        for (int j = 0; j < 8; j++) {
            int ls = nearest(inv_scale * scales[j]), lm = nearest(inv_min * mins[j]);
            ls = ls > 63 ? 63 : ls;
            lm = lm > 63 ? 63 : lm;
            /* 6-bit packing: sub-blocks 0-3 in the low 6 bits of bytes 0-3
             * (scales) and 4-7 (mins); sub-blocks 4-7 as nibbles in bytes
             * 8-11 with their top 2 bits in the top bits of bytes 0-7 */
            if (j < 4) {
                sc[j] = (uint8_t)ls;
                sc[j + 4] = (uint8_t)lm;
            } else {
                sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
                sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
                sc[j] |= (uint8_t)((lm >> 4) << 6);
            }
        }
        uint16_t hd = lk_fp32_to_fp16(max_scale / 63.f), hm = lk_fp32_to_fp16(max_min / 63.f);
        memcpy(b, &hd, 2);
        memcpy(b + 2, &hm, 2);
        const float d_all = lk_fp16_to_fp32(hd), dmin_all = lk_fp16_to_fp32(hm);
        for (int j = 0; j < 8; j++) {
            uint8_t s, m;
            lk_k_scale_min(j, sc, &s, &m);
            const float d = d_all * s;
            if (d == 0) continue;
            const float dm = dmin_all * m;
            for (int l = 0; l < 32; l++) {
                int v = nearest((x[32 * j + l] + dm) / d);
                L[32 * j + l] = (uint8_t)(v < 0 ? 0 : v > 15 ? 15 : v);
            }
        }
        uint8_t *q = b + LK_Q4K_QS;
        for (int j = 0; j < LK_QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
    }
}
