/* quant_q5.c — Q5_0 and Q5_1 weights (and Q8_1, Q5_1's activations): block
 * layouts in quant_impl.h; dequantisation, ggml's reference quantisers
 * (llama-quantize without an importance matrix: Q5_0 is the fallback of
 * Q4_K for rows that are not whole 256-blocks, Q5_1 that of Q5_K), the
 * activation quantiser of llama.cpp's x86 build for Q8_1, and the matrix
 * kernels: scalar (the definition), AVX2, AVX-512.
 *
 * Activations are what llama.cpp's x86 build gives these types: Q8_0 for
 * Q5_0 and Q8_1 for Q5_1 (Q8_0 plus s = d*sum(q), the term Q5_1's min m
 * multiplies: sum_i (d*q_i + m)*a_i = d*da*sum q_i*qa_i + m*s).
 *
 * SIMD kernels keep the 5-bit quants unsigned (0..31) and remove Q5_0's
 * offset 16 with a correction from the activations only (-16*sum of each
 * lane's 4 quants), so the 8 i32 lanes of a block's sum are exactly those
 * of ggml's signed arithmetic. Batch invariance: every output takes, per
 * block, one int->float conversion of those lanes and one FMA with the
 * product of the two scales into 8 float lanes (AVX2; AVX-512: 4 lanes of
 * a 16-lane vector per block, 4 blocks per step), in block order, then one
 * horizontal sum (Q5_1 adds its sum of m*s at the end); the decode and
 * prefill tiles differ only in how many rows and tokens share a step, never
 * in that arithmetic. The AVX2 arithmetic is llama.cpp's and the scalar
 * reference's (dot_q5), bit for bit; AVX-512's 4 lanes per block differ
 * from it in the last bits. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "quant/simd_x86.h"

/* ===================================================================== */
/* Scalar: dequantisation, quantisers, dot products                       */
/* ===================================================================== */

/* The 32 unsigned 5-bit quants of a Q5_0/Q5_1 block (qh at p, qs at p + 4),
 * in element order. */
static inline void q5_quants(const uint8_t *p, uint8_t q[32]) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)((p[4 + j] & 0xF) | ((qh >> j) & 1) << 4);
        q[j + 16] = (uint8_t)((p[4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
}

bool lk_q5_dequantize(lk_type t, const uint8_t *b, float *y, int64_t nb) {
    uint8_t q[32];
    switch (t) {
    case LK_TYPE_Q5_0:
        for (int64_t i = 0; i < nb; i++, b += LK_Q50_BYTES, y += 32) {
            float d = lk_ld_h(b);
            q5_quants(b + 2, q);
            for (int j = 0; j < 32; j++) y[j] = d * (float)(q[j] - 16);
        }
        return true;
    case LK_TYPE_Q5_1:
        for (int64_t i = 0; i < nb; i++, b += LK_Q51_BYTES, y += 32) {
            float d = lk_ld_h(b), m = lk_ld_h(b + 2);
            q5_quants(b + 4, q);
            for (int j = 0; j < 32; j++) y[j] = d * (float)q[j] + m;
        }
        return true;
    case LK_TYPE_Q8_1:
        for (int64_t i = 0; i < nb; i++, b += LK_Q81_BYTES, y += 32) {
            float d = lk_ld_h(b);
            for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[4 + j];
        }
        return true;
    default:
        return false;
    }
}

static void put_q5(uint8_t *p, const uint8_t q[32]) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        p[4 + j] = (uint8_t)((q[j] & 0xF) | (q[j + 16] & 0xF) << 4);
        qh |= (uint32_t)(q[j] >> 4) << j | (uint32_t)(q[j + 16] >> 4) << (j + 16);
    }
    memcpy(p, &qh, 4);
}

/* Q5_0 (ggml's reference): the element of largest magnitude (signed) maps to
 * -16, d = max/-16, q = min(31, trunc(x/d + 16.5)). */
static void quant_q5_0(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst, q[32];
    for (int64_t i = 0; i < n / 32; i++, x += 32, b += LK_Q50_BYTES) {
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
        float d = max / -16, id = d != 0 ? 1.0f / d : 0.0f;
        uint16_t h = lk_fp32_to_fp16(d);
        memcpy(b, &h, 2);
        for (int j = 0; j < 32; j++) {
            int v = (int)(int8_t)(x[j] * id + 16.5f);
            q[j] = (uint8_t)(v < 31 ? v : 31);
        }
        put_q5(b + 2, q);
    }
}

/* Q5_1: d = (max - min)/31, m = min, q = trunc((x - min)/d + 0.5). */
static void quant_q5_1(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst, q[32];
    for (int64_t i = 0; i < n / 32; i++, x += 32, b += LK_Q51_BYTES) {
        float min = x[0], max = x[0];
        for (int j = 1; j < 32; j++) {
            if (x[j] < min) min = x[j];
            if (x[j] > max) max = x[j];
        }
        float d = (max - min) / 31, id = d != 0 ? 1.0f / d : 0.0f;
        uint16_t hd = lk_fp32_to_fp16(d), hm = lk_fp32_to_fp16(min);
        memcpy(b, &hd, 2);
        memcpy(b + 2, &hm, 2);
        for (int j = 0; j < 32; j++) q[j] = (uint8_t)((x[j] - min) * id + 0.5f);
        put_q5(b + 4, q);
    }
}

/* Q8_1, reference (weights would use it; nothing stores Q8_1 weights): as
 * Q8_0 (round half away), s = d*sum(q) with the float d. */
static void quant_q8_1(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32, b += LK_Q81_BYTES) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.f, id = d != 0 ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int v = (int)roundf(x[j] * id);
            b[4 + j] = (uint8_t)(int8_t)v;
            sum += v;
        }
        uint16_t hd = lk_fp32_to_fp16(d), hs = lk_fp32_to_fp16((float)sum * d);
        memcpy(b, &hd, 2);
        memcpy(b + 2, &hs, 2);
    }
}

/* Q8_1 activations as llama.cpp's x86 quantize_row_q8_1 makes them: the
 * inverse scale 127/max|x| and round half to even (as its Q8_0 ones, see
 * lk_act_q8_0_scalar), s = d*sum(q) in float with the unrounded d. The same
 * code serves every level: a row is a few thousand elements. */
static void act_q8_1(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32, b += LK_Q81_BYTES) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = amax != 0 ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int v = (int)nearbyintf(x[j] * id);
            b[4 + j] = (uint8_t)(int8_t)v;
            sum += v;
        }
        uint16_t hd = lk_fp32_to_fp16(d), hs = lk_fp32_to_fp16((float)sum * d);
        memcpy(b, &hd, 2);
        memcpy(b + 2, &hs, 2);
    }
}

/* The scalar reference keeps the arithmetic of llama.cpp's x86 (AVX2) dot
 * for these types, which the AVX2 tiles below share: lane j (0..7) of a
 * block is the exact integer sum of its elements 4j..4j+3; each lane adds
 * acc_j = fma(isum_j, d_w * d_a, acc_j) block after block; the lanes are
 * added at the end as ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), and Q5_1 adds
 * its sum of m_w * s_a (block order) last. (A sum in block order,
 * s + isum * (d_w * d_a) as Q4_0's, is as accurate; but the synthetic
 * Qwen3.5 model of test_qwen35, whose delta net amplifies a rounding of
 * 1e-7 into logit errors of 1e-2, then misses llama.cpp's reference by more
 * than its tolerance.) */
static float dot_q5(int kind, int64_t n, const uint8_t *w, const uint8_t *a) {
    const size_t wbb = kind == 0 ? LK_Q50_BYTES : LK_Q51_BYTES, abb = kind == 0 ? LK_Q80_BYTES : LK_Q81_BYTES;
    const int off = kind == 0 ? 16 : 0, qo = kind == 0 ? 2 : 4;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sm = 0;
    uint8_t q[32];
    for (int64_t i = 0; i < n / 32; i++, w += wbb, a += abb) {
        const int8_t *q8 = (const int8_t *)(a + qo);
        q5_quants(w + qo, q);
        const float d = lk_ld_h(w) * lk_ld_h(a);
        for (int j = 0; j < 8; j++) {
            int sumi = 0;
            for (int e = 4 * j; e < 4 * j + 4; e++) sumi += (q[e] - off) * q8[e];
            acc[j] = lk_fmaf((float)sumi, d, acc[j]);
        }
        if (kind == 1) sm += lk_ld_h(w + 2) * lk_ld_h(a + 2);
    }
    const float x0 = acc[0] + acc[4], x1 = acc[1] + acc[5], x2 = acc[2] + acc[6], x3 = acc[3] + acc[7];
    return ((x0 + x2) + (x1 + x3)) + sm;
}

bool lk_q5_dot_scalar(lk_type t, int64_t n, const uint8_t *w, const uint8_t *a, float *out) {
    switch (t) {
    case LK_TYPE_Q5_0: *out = dot_q5(0, n, w, a); return true;
    case LK_TYPE_Q5_1: *out = dot_q5(1, n, w, a); return true;
    default: return false;
    }
}

static void mm_scalar(lk_type t, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                      const void *a, size_t as, float *y, size_t ys) {
    for (int64_t k = 0; k < ntok; k++)
        for (int64_t r = 0; r < nrows; r++)
            lk_q5_dot_scalar(t, n, (const uint8_t *)w + (size_t)r * ws, (const uint8_t *)a + (size_t)k * as,
                             &y[(size_t)k * ys + (size_t)r]);
}
static void mm_q5_0(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                    float *y, size_t ys) {
    mm_scalar(LK_TYPE_Q5_0, n, nrows, w, ws, ntok, a, as, y, ys);
}
static void mm_q5_1(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                    float *y, size_t ys) {
    mm_scalar(LK_TYPE_Q5_1, n, nrows, w, ws, ntok, a, as, y, ys);
}

void lk_q5_fill_scalar(lk_quant_ops *ops) {
    ops->mm[LK_TYPE_Q5_0] = mm_q5_0;
    ops->mm[LK_TYPE_Q5_1] = mm_q5_1;
    ops->quant[LK_TYPE_Q5_0] = quant_q5_0;
    ops->quant[LK_TYPE_Q5_1] = quant_q5_1;
    ops->quant[LK_TYPE_Q8_1] = quant_q8_1;
    ops->act[LK_TYPE_Q8_1] = act_q8_1;
}

/* ===================================================================== */
/* AVX2                                                                    */
/* ===================================================================== */

/* 32 unsigned 5-bit quants in element order from qh (p) and qs (p + 4):
 * the nibbles as Q4_0 (low nibbles elements 0..15), bit e of qh to bit 4 of
 * byte e (byte e takes qh's byte e/8, then a per-byte bit test). */
LK_T2 static LK_INL __m256i q5_unpack2(const uint8_t *p) {
    __m128i qs = _mm_loadu_si128((const __m128i *)(p + 4));
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1);
    v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    uint32_t qh;
    memcpy(&qh, p, 4);
    __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                    _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll,
                                                       0x0303030303030303ll));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(v, h);
}

/* One activation block: quants, scale, and (Q5_0) the offset correction
 * -16 * (sum of each lane's 4 quants), or (Q5_1) the block's s. */
typedef struct { __m256i q, neg; float d, s; } a5;

LK_T2 static LK_INL a5 a5_load(const int kind, const uint8_t *p) {
    a5 a;
    if (kind == 0) {
        a.q = _mm256_loadu_si256((const __m256i *)(p + 2));
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(16), a.q), _mm256_set1_epi16(1));
        a.neg = _mm256_sub_epi32(_mm256_setzero_si256(), s);
        a.s = 0;
    } else {
        a.q = _mm256_loadu_si256((const __m256i *)(p + 4));
        a.neg = _mm256_setzero_si256();
        a.s = _cvtsh_ss(lk_ld_u16(p + 2));
    }
    a.d = _cvtsh_ss(lk_ld_u16(p));
    return a;
}

/* R rows x T tokens of Q5_0 (kind 0) or Q5_1 (kind 1), block by block. */
LK_T2 static LK_INL void q5_tile2(const int R, const int T, const int kind, int64_t n, const uint8_t *w,
                                  size_t ws, const uint8_t *a, size_t as, float *y, size_t ys) {
    const int64_t nb = n / 32;
    const size_t wbb = kind == 0 ? LK_Q50_BYTES : LK_Q51_BYTES, abb = kind == 0 ? LK_Q80_BYTES : LK_Q81_BYTES;
    const int qo = kind == 0 ? 2 : 4; /* qh after d (and m) */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4][4];
    float sm[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps(), sm[r][t] = 0;
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv[4];
        float wd[4], wm[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + r * ws + (size_t)b * wbb;
            if ((b & 1) == 0) pf_range_l1(p, R * ws, 64);
            wv[r] = q5_unpack2(p + qo);
            wd[r] = _cvtsh_ss(lk_ld_u16(p));
            wm[r] = kind == 1 ? _cvtsh_ss(lk_ld_u16(p + 2)) : 0;
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            a5 A = a5_load(kind, a + t * as + (size_t)b * abb);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m256i s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], A.q), ones), A.neg);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(wd[r] * A.d), acc[r][t]);
                if (kind == 1) sm[r][t] += wm[r] * A.s;
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) y[t * ys + r] = hsum8(acc[r][t]) + sm[r][t];
}

#define LK_TILE_FN(attr, name, R, T, call)                                                 \
    attr static void name##_##R##x##T(int64_t n, const uint8_t *w, size_t ws,              \
                                      const uint8_t *a, size_t as, float *y, size_t ys) {  \
        call;                                                                              \
    }
/* decode 4 rows x 1 token; prefill 4 rows x up to 3 tokens */
#define LK_TILES_4x3(attr, name, CALL)                                                     \
    LK_TILE_FN(attr, name, 4, 1, CALL(4, 1)) LK_TILE_FN(attr, name, 4, 2, CALL(4, 2))      \
    LK_TILE_FN(attr, name, 4, 3, CALL(4, 3)) LK_TILE_FN(attr, name, 1, 1, CALL(1, 1))      \
    LK_TILE_FN(attr, name, 1, 2, CALL(1, 2)) LK_TILE_FN(attr, name, 1, 3, CALL(1, 3))      \
    static const lk_tileset name##_set = {name##_4x1, name##_1x1, 4, 3,                    \
                                          {{NULL, name##_1x1, name##_1x2, name##_1x3, NULL}, \
                                           {NULL, name##_4x1, name##_4x2, name##_4x3, NULL}}};

#define Q50_2(R, T) q5_tile2(R, T, 0, n, w, ws, a, as, y, ys)
#define Q51_2(R, T) q5_tile2(R, T, 1, n, w, ws, a, as, y, ys)
LK_TILES_4x3(LK_T2, q50a2, Q50_2)
LK_TILES_4x3(LK_T2, q51a2, Q51_2)

#define LK_MM_FN(name)                                                                          \
    static void mm_##name(int64_t n, int64_t nrows, const void *w, size_t w_stride,             \
                          int64_t ntok, const void *a, size_t a_stride, float *y,               \
                          size_t y_stride) {                                                    \
        lk_quant_run_tiles(&name##_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride); \
    }
LK_MM_FN(q50a2)
LK_MM_FN(q51a2)

void lk_q5_fill_avx2(lk_quant_ops *ops) {
    ops->mm[LK_TYPE_Q5_0] = mm_q50a2;
    ops->mm[LK_TYPE_Q5_1] = mm_q51a2;
}

/* ===================================================================== */
/* AVX-512 (F, BW, VL, DQ, VNNI, VBMI, GFNI)                               */
/* ===================================================================== */

/* Groups of 4 blocks per 512-bit vector, as quant_avx512.c's Q4_0: 128-bit
 * lane k holds block k, `lo` its elements 0..15 and `hi` 16..31 (weights
 * and activations alike), so vpdpbusd gives 4 i32 lanes per block and one
 * vector of 16 scales (d_w * d_a, each 4 times) scales them. One two-table
 * byte permute (vpermt2b) gathers the 4 blocks' nibbles out of their packed
 * 22/24-byte records, another their 4 qh words, whose bits become two byte
 * masks (elements 0..15 and 16..31 of the 4 blocks) that add the fifth bit
 * (16) under mask. Blocks past the last group of 4 go through the scalar
 * code (per row and token, added at the end: the same in every tile).
 * Q5_1's min term m*s (4 lanes per block, so 4 times each) is summed in a
 * vector of its own and scaled by 1/4 at the end (exact). */

/* permute tables, by kind (0: Q5_0 / Q8_0, 1: Q5_1 / Q8_1); built at fill */
static uint8_t k5_qs[2][64], k5_qh[2][64], k5_d[2][64], k5_m[64];
static uint8_t k8_lo[2][64], k8_hi[2][64], k8_d[2][64], k8_s[64];

/* Index of byte x of a 4-block record group in the two-table [p | p + off]. */
static uint8_t t2(int x, int off) { return (uint8_t)(x < 64 ? x : x - off + 64); }

static void build_tables5(void) {
    for (int kind = 0; kind < 2; kind++) {
        const int wbb = kind ? LK_Q51_BYTES : LK_Q50_BYTES, ho = kind ? 4 : 2, qo = ho + 4;
        const int woff = 4 * wbb - 64; /* second load of a weight group */
        const int abb = kind ? LK_Q81_BYTES : LK_Q80_BYTES, aq = kind ? 4 : 2;
        for (int i = 0; i < 64; i++) {
            int k = i / 16, j = i % 16;
            k5_qs[kind][i] = t2(wbb * k + qo + j, woff);
            /* bytes 2k, 2k+1: qh_k bits 0..15; bytes 8+2k, 9+2k: bits 16..31 */
            k5_qh[kind][i] = i < 16 ? t2(wbb * ((i % 8) / 2) + ho + (i / 8) * 2 + (i & 1), woff) : 0;
            /* 16 words: lanes 4k..4k+3 <- block k's fp16 scale (min for k5_m) */
            k5_d[kind][i] = i < 32 ? t2(wbb * (i / 8) + (i & 1), woff) : 0;
            if (kind) k5_m[i] = i < 32 ? t2(wbb * (i / 8) + 2 + (i & 1), woff) : 0;
            /* activations from [p | p+64] (lo, d, s) and [p+h | p+64+h] (hi),
             * h = 8 (Q8_0) or 16 (Q8_1) */
            int h = kind ? 16 : 8;
            k8_lo[kind][i] = (uint8_t)(abb * k + aq + j);
            k8_hi[kind][i] = (uint8_t)(abb * k + aq + 16 + j - h);
            k8_d[kind][i] = (uint8_t)(i < 32 ? abb * (i / 8) + (i & 1) : 0);
            if (kind) k8_s[i] = (uint8_t)(i < 32 ? abb * (i / 8) + 2 + (i & 1) : 0);
        }
    }
}

LK_T512 static LK_INL __m512i hi_nib(__m512i x) {
    return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(0x1020408000000000ll), 0);
}

typedef struct { __m512i lo, hi; __m512 d, m; } g5; /* m: Q5_1 mins / Q8_1 sums */

LK_T512 static LK_INL g5 w5_load(const int kind, const uint8_t *p) {
    const int woff = 4 * (kind ? LK_Q51_BYTES : LK_Q50_BYTES) - 64;
    __m512i l0 = _mm512_loadu_si512(p), l1 = _mm512_loadu_si512(p + woff);
    __m512i q = _mm512_permutex2var_epi8(l0, _mm512_loadu_si512(k5_qs[kind]), l1);
    __m128i qh = _mm512_castsi512_si128(_mm512_permutex2var_epi8(l0, _mm512_loadu_si512(k5_qh[kind]), l1));
    __mmask64 klo = _cvtu64_mask64((unsigned long long)_mm_cvtsi128_si64(qh));
    __mmask64 khi = _cvtu64_mask64((unsigned long long)_mm_extract_epi64(qh, 1));
    const __m512i m0f = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16);
    g5 w;
    w.lo = _mm512_and_si512(q, m0f);
    w.hi = hi_nib(q);
    w.lo = _mm512_mask_add_epi8(w.lo, klo, w.lo, b16);
    w.hi = _mm512_mask_add_epi8(w.hi, khi, w.hi, b16);
    w.d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(l0, _mm512_loadu_si512(k5_d[kind]), l1)));
    w.m = kind ? _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(l0, _mm512_loadu_si512(k5_m), l1)))
               : _mm512_setzero_ps();
    return w;
}

/* An activation group; for Q8_0 (Q5_0) m holds nothing and the offset
 * correction -16 * (sum of each lane's 4 quants) goes in `neg`. */
LK_T512 static LK_INL g5 a5_load512(const int kind, const uint8_t *p, __m512i *neg) {
    const int h = kind ? 16 : 8;
    __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64);
    __m512i a2 = _mm512_loadu_si512(p + h), a3 = _mm512_loadu_si512(p + 64 + h);
    g5 a;
    a.lo = _mm512_permutex2var_epi8(a0, _mm512_loadu_si512(k8_lo[kind]), a1);
    a.hi = _mm512_permutex2var_epi8(a2, _mm512_loadu_si512(k8_hi[kind]), a3);
    a.d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(a0, _mm512_loadu_si512(k8_d[kind]), a1)));
    a.m = kind ? _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(a0, _mm512_loadu_si512(k8_s), a1)))
               : _mm512_setzero_ps();
    if (kind == 0) {
        const __m512i k16 = _mm512_set1_epi8(16);
        __m512i c = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), k16, a.lo), k16, a.hi);
        *neg = _mm512_sub_epi32(_mm512_setzero_si512(), c);
    } else {
        *neg = _mm512_setzero_si512();
    }
    return a;
}

LK_T512 static LK_INL void q5_tile512(const int R, const int T, const int kind, int64_t n, const uint8_t *w,
                                      size_t ws, const uint8_t *a, size_t as, float *y, size_t ys) {
    const int64_t nb = n / 32, ng = nb / 4;
    const size_t wbb = kind == 0 ? LK_Q50_BYTES : LK_Q51_BYTES, abb = kind == 0 ? LK_Q80_BYTES : LK_Q81_BYTES;
    __m512 acc[4][4], accm[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps(), accm[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        g5 W[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + r * ws + (size_t)g * 4 * wbb;
            pf_range_l1(p, R * ws, 4 * wbb);
            W[r] = w5_load(kind, p);
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            __m512i neg;
            g5 A = a5_load512(kind, a + t * as + (size_t)g * 4 * abb, &neg);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(neg, W[r].lo, A.lo), W[r].hi, A.hi);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(W[r].d, A.d), acc[r][t]);
                if (kind == 1) accm[r][t] = _mm512_fmadd_ps(W[r].m, A.m, accm[r][t]);
            }
        }
    }
    const int64_t tail = (nb - ng * 4) * 32;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            float v = _mm512_reduce_add_ps(acc[r][t]);
            if (kind == 1) v += 0.25f * _mm512_reduce_add_ps(accm[r][t]);
            if (tail) {
                float s;
                lk_q5_dot_scalar(kind ? LK_TYPE_Q5_1 : LK_TYPE_Q5_0, tail, w + r * ws + (size_t)ng * 4 * wbb,
                                 a + t * as + (size_t)ng * 4 * abb, &s);
                v += s;
            }
            y[t * ys + r] = v;
        }
}

#define Q50_5(R, T) q5_tile512(R, T, 0, n, w, ws, a, as, y, ys)
#define Q51_5(R, T) q5_tile512(R, T, 1, n, w, ws, a, as, y, ys)
LK_TILES_4x3(LK_T512, q50a5, Q50_5)
LK_TILES_4x3(LK_T512, q51a5, Q51_5)
LK_MM_FN(q50a5)
LK_MM_FN(q51a5)

void lk_q5_fill_avx512(lk_quant_ops *ops) {
    build_tables5();
    ops->mm[LK_TYPE_Q5_0] = mm_q50a5;
    ops->mm[LK_TYPE_Q5_1] = mm_q51a5;
    ops->act[LK_TYPE_Q8_1] = act_q8_1;
}
