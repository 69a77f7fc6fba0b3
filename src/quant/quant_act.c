/* Activation quantisation matching llama.cpp's x86 kernels (see quant.h). */
#include "quant/quant.h"

#include <math.h>
#include <string.h>

static void act_q8_0(const float *x, uint8_t *b, int64_t n) {
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

void lk_quantize_row_act(lk_type t, const float *src, void *dst, int64_t n) {
    if (t == LK_TYPE_Q8_0) act_q8_0(src, dst, n);
    else lk_quantize_row(t, src, dst, n);
}
