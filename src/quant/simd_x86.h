/* What the x86 kernels share: their target sets, the horizontal sums and
 * the prefetch of the tile ahead (quant_*avx2.c, quant_*avx512.c,
 * quant_k23.c, quant_q5.c, quant_act.c). The target sets are those the
 * dispatch's levels require (common/cpu.c): code under LK_T512 runs only
 * where every feature it names is present. */
#ifndef LK_SIMD_X86_H
#define LK_SIMD_X86_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/quant_impl.h"

#define LK_INL inline __attribute__((always_inline))
#define LK_T2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define LK_T512                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma," \
                          "f16c,bmi,bmi2,gfni")))

LK_T2 static LK_INL float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Decode tiles prefetch into L1 the rows of the tile lk_quant_pf_tiles()
 * ahead (tile: R rows' stride; 1 by default, the next one; 0 none): see
 * pf_range in quant_avx512.c for why, and for the L2 prefetch its own
 * tiles add. */
static LK_INL void pf_range_l1(const uint8_t *p, size_t tile, size_t len) {
    const int d = lk_quant_pf_tiles();
    if (d == 0) return;
    p += (size_t)d * tile;
    for (size_t o = 0; o < len; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

/* One reduction of sixteen AVX-512 vectors: the score rows' sums
 * (quant_avx512.c) and the activation quantisers' blocks' maxima and
 * super-blocks' sums (quant_act.c). The lane operation: float addition,
 * float maximum, 32-bit integer addition (the lanes then hold integers'
 * bits). */
typedef enum { LK_FOLD_ADD, LK_FOLD_MAX, LK_FOLD_ADD_I32 } lk_fold_op;

#define LK_TFOLD __attribute__((target("avx512f"), always_inline))

LK_TFOLD static inline __m512 lk_fold_apply(__m512 a, __m512 b, lk_fold_op op) {
    switch (op) {
    case LK_FOLD_MAX: return _mm512_max_ps(a, b);
    case LK_FOLD_ADD_I32: return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    default: return _mm512_add_ps(a, b);
    }
}

/* lk_fold16_order[k] is the lane of lk_fold16's last step that holds
 * vector k's result; the Q8_K quantiser's packs interleave 128-bit lanes
 * the same way and reuse it. */
static const int32_t lk_fold16_order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* Lane k of the result = op over m[k]'s sixteen lanes. Four rounds of
 * halving pair the vectors: after the first, vector i holds the halves of
 * m[2i] (lanes 0-7) and m[2i+1] (8-15); after the second, vector j holds
 * m[4j..4j+3], one 128-bit lane each; after the third, vector k holds
 * m[8k+g] and m[8k+4+g] in 128-bit lane g, two elements each; after the
 * fourth, lane 4g+e holds vector 4e+g's result, and one permutation puts
 * vector k's in lane k. For addition, each lane sees the additions of
 * lane i + 8 onto lane i, then i + 4, i + 2, i + 1: the order of a single
 * vector's hsum, so the bits are those of sixteen separate reductions. */
LK_TFOLD static inline __m512 lk_fold16(const __m512 m[16], lk_fold_op op) {
    __m512 x[8], y[4], z[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        x[i] = lk_fold_apply(_mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], 0xEE), op);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        y[j] = lk_fold_apply(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0xDD), op);
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
        z[k] = lk_fold_apply(_mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0xEE), op);
    const __m512 r = lk_fold_apply(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD), op);
    return _mm512_permutexvar_ps(_mm512_loadu_si512(lk_fold16_order), r);
}

#endif
