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
 * it runs once per matrix input and was 4 % of a decode step in scalar code. */
__attribute__((target("avx512f"))) void lk_act_q8_0_avx512(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32, b += 34) {
        __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.f, id = amax != 0 ? 127.f / amax : 0.0f;
        uint16_t h = lk_fp32_to_fp16(d);
        memcpy(b, &h, 2);
        const __m512 vid = _mm512_set1_ps(id);
        __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(b + 2), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(b + 18), _mm512_cvtepi32_epi8(q1));
    }
}
