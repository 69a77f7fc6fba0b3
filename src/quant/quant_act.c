/* Activation quantisation matching llama.cpp's x86 kernels (see quant.h). */
#include "quant/quant_impl.h"

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
__attribute__((target("avx512f"))) static inline __m512 act_absmax(const float *x) {
    return _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)), _mm512_abs_ps(_mm512_loadu_ps(x + 16)));
}

__attribute__((target("avx512f"))) static inline void act_block(const float *x, uint8_t *b, float id) {
    const __m512 vid = _mm512_set1_ps(id);
    __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(b + 2), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(b + 18), _mm512_cvtepi32_epi8(q1));
}

static const int32_t act_fold_order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

__attribute__((target("avx512f"))) void lk_act_q8_0_avx512(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    const int64_t nb = n / 32;
    int64_t i = 0;
    for (; i + 16 <= nb; i += 16, x += 16 * 32, b += 16 * 34) {
        /* m[k]'s lanes are block k's |x| folded to 16; four rounds of
         * halving pair the vectors until lane k holds block k's maximum
         * (max is exact, so the folding order changes nothing) */
        __m512 m[16];
        for (int k = 0; k < 16; k++) m[k] = act_absmax(x + 32 * k);
        /* halves: lanes 0-7 block 2j's, 8-15 block 2j+1's */
        for (int j = 0; j < 8; j++)
            m[j] = _mm512_max_ps(_mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0x44),
                                 _mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0xEE));
        /* quarters: quarter q block 4j+q's */
        for (int j = 0; j < 4; j++)
            m[j] = _mm512_max_ps(_mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0x88),
                                 _mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0xDD));
        /* pairs: quarter q elements 0-1 block 8j+q's, 2-3 block 8j+4+q's */
        for (int j = 0; j < 2; j++)
            m[j] = _mm512_max_ps(_mm512_shuffle_ps(m[2 * j], m[2 * j + 1], 0x44),
                                 _mm512_shuffle_ps(m[2 * j], m[2 * j + 1], 0xEE));
        /* lane 4q+e block 4e+q's maximum; the permutation puts block k's
         * in lane k */
        __m512 amax = _mm512_max_ps(_mm512_shuffle_ps(m[0], m[1], 0x88), _mm512_shuffle_ps(m[0], m[1], 0xDD));
        amax = _mm512_permutexvar_ps(_mm512_loadu_si512(act_fold_order), amax);
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
