/* Activation quantisation matching llama.cpp's x86 kernels (see quant.h). */
#include "quant/simd_x86.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

void lk_act_q8_0_scalar(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32, b += 34) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = amax != 0 ? 127.f / amax : 0.0f;
        uint16_t h = lk_fp32_to_fp16(d);
        memcpy(b, &h, 2);
        /* nearbyintf: round half to even under the default rounding mode,
         * as _mm256_round_ps(_MM_ROUND_NEAREST) */
        for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)nearbyintf(x[j] * id);
    }
}

/* The same arithmetic 16 lanes at a time (the same max, the same single
 * product per element, round half to even), so the bytes are identical;
 * it runs once per matrix input and was 4 % of a decode step in scalar code.
 * Sixteen blocks at a time: their maxima are folded into one vector (lane k
 * = block k's), so the division, the reciprocal and the fp16 conversion of
 * the scale are one instruction for all sixteen (vcvtps2ph rounds to
 * nearest even, as lk_fp32_to_fp16, for every finite value). */
#define LK_TACT __attribute__((target("avx512f,avx512bw")))

LK_TACT static inline __m512 act_absmax(const float *x) {
    return _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)), _mm512_abs_ps(_mm512_loadu_ps(x + 16)));
}

LK_TACT static inline void act_block(const float *x, uint8_t *b, float id) {
    const __m512 vid = _mm512_set1_ps(id);
    __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(b + 2), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(b + 18), _mm512_cvtepi32_epi8(q1));
}

LK_TACT void lk_act_q8_0_avx512(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    const int64_t nb = n / 32;
    int64_t i = 0;
    for (; i + 16 <= nb; i += 16, x += 16 * 32, b += 16 * 34) {
        __m512 m[16];
        for (int k = 0; k < 16; k++) m[k] = act_absmax(x + 32 * k);
        const __m512 amax = lk_fold16(m, LK_FOLD_MAX);
        const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
        const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                              _mm512_set1_ps(127.f), amax);
        uint16_t dh[16];
        float idf[16];
        _mm256_storeu_si256((__m256i *)dh, _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm512_storeu_ps(idf, id);
        for (int k = 0; k < 16; k++) {
            memcpy(b + 34 * k, &dh[k], 2);
            act_block(x + 32 * k, b + 34 * k, idf[k]);
        }
    }
    for (; i < nb; i++, x += 32, b += 34) {
        const float amax = _mm512_reduce_max_ps(act_absmax(x));
        const float d = amax / 127.f, id = amax != 0 ? 127.f / amax : 0.0f;
        uint16_t h = lk_fp32_to_fp16(d);
        memcpy(b, &h, 2);
        act_block(x, b, id);
    }
}

/* Q8_K (the K-quants' activations), bit-exact with the scalar quant_q8_k:
 * max = the first element of largest magnitude (signed), iscale = -127/max,
 * q = min(127, round half to even). A super-block is 16 vectors, one per
 * 16-element sum: the quants are packed 4 vectors at a time (the packs
 * interleave 128-bit lanes, which lk_fold16_order undoes) and the 16 sums are
 * one fold. */
LK_TACT void lk_act_q8_k_avx512(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    const __m512i order = _mm512_loadu_si512(lk_fold16_order), c127 = _mm512_set1_epi32(127);
    for (int64_t i = 0; i < n / LK_QK_K; i++, x += LK_QK_K, b += LK_Q8K_BYTES) {
        __m512 m4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < 16; k++) m4[k & 3] = _mm512_max_ps(m4[k & 3], _mm512_abs_ps(_mm512_loadu_ps(x + 16 * k)));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3])));
        if (amax == 0) {
            memset(b, 0, LK_Q8K_BYTES);
            continue;
        }
        float max = 0;
        const __m512 va = _mm512_set1_ps(amax);
        for (int k = 0; k < 16; k++) {
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * k)), va, _CMP_EQ_OQ);
            if (hit) {
                max = x[16 * k + __builtin_ctz((unsigned)hit)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m512 vs = _mm512_set1_ps(iscale);
        __m512 q[16];
        for (int k = 0; k < 16; k++)
            q[k] = _mm512_castsi512_ps(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), vs)), c127));
        for (int g = 0; g < 4; g++) { /* |q| <= 127: the packs never saturate */
            const __m512i p01 = _mm512_packs_epi32(_mm512_castps_si512(q[4 * g]), _mm512_castps_si512(q[4 * g + 1]));
            const __m512i p23 = _mm512_packs_epi32(_mm512_castps_si512(q[4 * g + 2]), _mm512_castps_si512(q[4 * g + 3]));
            _mm512_storeu_si512(b + LK_Q8K_QS + 64 * g, _mm512_permutexvar_epi32(order, _mm512_packs_epi16(p01, p23)));
        }
        const __m512i sums = _mm512_castps_si512(lk_fold16(q, LK_FOLD_ADD_I32));
        _mm256_storeu_si256((__m256i *)(b + LK_Q8K_BS), _mm512_cvtepi32_epi16(sums));
        const float d = 1 / iscale;
        memcpy(b, &d, 4);
    }
}
