/* quant.c — type traits, the scalar reference kernels, and run-time dispatch.
 *
 * The scalar code is the definition every SIMD variant is tested against: it
 * is written for clarity, block by block, doing what ggml's reference code
 * does (integer dot product per block, then one float scale per block). */
#include <cpuid.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "quant/quant_impl.h"

/* ===================================================================== */
/* Type traits                                                             */
/* ===================================================================== */

typedef struct {
    const char *name;
    int64_t     block_size; /* elements per block; 0 = unknown id */
    size_t      block_bytes;
} lk_type_traits;

/* Sizes are facts of the GGUF format (ggml's block structs). Ids 4, 5, 31-33
 * and 36-38 were removed from ggml and stay unknown. */
static const lk_type_traits k_traits[LK_TYPE_ALL] = {
    [LK_TYPE_F32]     = {"f32", 1, 4},
    [LK_TYPE_F16]     = {"f16", 1, 2},
    [LK_TYPE_Q4_0]    = {"q4_0", 32, 18},
    [LK_TYPE_Q4_1]    = {"q4_1", 32, 20},
    [LK_TYPE_Q5_0]    = {"q5_0", 32, 22},
    [LK_TYPE_Q5_1]    = {"q5_1", 32, 24},
    [LK_TYPE_Q8_0]    = {"q8_0", 32, 34},
    [LK_TYPE_Q8_1]    = {"q8_1", 32, 36},
    [LK_TYPE_Q2_K]    = {"q2_k", 256, 84},
    [LK_TYPE_Q3_K]    = {"q3_k", 256, 110},
    [LK_TYPE_Q4_K]    = {"q4_k", 256, 144},
    [LK_TYPE_Q5_K]    = {"q5_k", 256, 176},
    [LK_TYPE_Q6_K]    = {"q6_k", 256, 210},
    [LK_TYPE_Q8_K]    = {"q8_k", 256, 292},
    [LK_TYPE_IQ2_XXS] = {"iq2_xxs", 256, 66},
    [LK_TYPE_IQ2_XS]  = {"iq2_xs", 256, 74},
    [LK_TYPE_IQ3_XXS] = {"iq3_xxs", 256, 98},
    [LK_TYPE_IQ1_S]   = {"iq1_s", 256, 50},
    [LK_TYPE_IQ4_NL]  = {"iq4_nl", 32, 18},
    [LK_TYPE_IQ3_S]   = {"iq3_s", 256, 110},
    [LK_TYPE_IQ2_S]   = {"iq2_s", 256, 82},
    [LK_TYPE_IQ4_XS]  = {"iq4_xs", 256, 136},
    [LK_TYPE_I8]      = {"i8", 1, 1},
    [LK_TYPE_I16]     = {"i16", 1, 2},
    [LK_TYPE_I32]     = {"i32", 1, 4},
    [LK_TYPE_I64]     = {"i64", 1, 8},
    [LK_TYPE_F64]     = {"f64", 1, 8},
    [LK_TYPE_IQ1_M]   = {"iq1_m", 256, 56},
    [LK_TYPE_BF16]    = {"bf16", 1, 2},
    [LK_TYPE_TQ1_0]   = {"tq1_0", 256, 54},
    [LK_TYPE_TQ2_0]   = {"tq2_0", 256, 66},
    [LK_TYPE_MXFP4]   = {"mxfp4", 32, 17},
    [LK_TYPE_Q4_0_R16] = {"q4_0_r16", 32, 18}, /* ours: the file type's bytes, rows interleaved */
    [LK_TYPE_Q8_0_R16] = {"q8_0_r16", 32, 34},
    [LK_TYPE_Q4_K_R16] = {"q4_k_r16", 256, 144},
    [LK_TYPE_Q5_K_R16] = {"q5_k_r16", 256, 176},
    [LK_TYPE_Q6_K_R16] = {"q6_k_r16", 256, 210},
    [LK_TYPE_F16_R16] = {"f16_r16", 1, 2},
    [LK_TYPE_BF16_R16] = {"bf16_r16", 1, 2},
};

const char *lk_type_name(uint32_t t) {
    if (t < LK_TYPE_ALL && k_traits[t].block_size) return k_traits[t].name;
    /* Unknown ids get a name too (for messages); a small ring of buffers keeps
     * this thread-safe enough for diagnostics without allocation. */
    static _Thread_local char buf[4][24];
    static _Thread_local int k;
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "type#%u", (unsigned)t);
    return b;
}

int64_t lk_type_block_size(uint32_t t) {
    return t < LK_TYPE_ALL ? k_traits[t].block_size : 0;
}

size_t lk_type_block_bytes(uint32_t t) {
    return t < LK_TYPE_ALL ? k_traits[t].block_bytes : 0;
}

bool lk_type_row_bytes(uint32_t t, int64_t n, size_t *out) {
    int64_t bs = lk_type_block_size(t);
    if (bs <= 0 || n < 0 || n % bs) return false;
    uint64_t b;
    if (!lk_mul_ok((uint64_t)(n / bs), lk_type_block_bytes(t), &b) || b > SIZE_MAX) return false;
    *out = (size_t)b;
    return true;
}

bool lk_type_supported(uint32_t t) {
    switch (t) {
    case LK_TYPE_F32: case LK_TYPE_F16: case LK_TYPE_BF16: case LK_TYPE_Q8_0:
    case LK_TYPE_Q4_0: case LK_TYPE_Q4_K: case LK_TYPE_Q5_K: case LK_TYPE_Q6_K:
    case LK_TYPE_Q5_0: case LK_TYPE_Q5_1: case LK_TYPE_Q2_K: case LK_TYPE_Q3_K: case LK_TYPE_IQ4_XS:
        return true;
    default:
        return false;
    }
}

bool lk_type_from_name(const char *name, lk_type *out) {
    if (!name) return false;
    for (int t = 0; t < LK_TYPE_COUNT; t++) {
        if (!k_traits[t].block_size) continue;
        const char *a = k_traits[t].name, *b = name;
        while (*a && *b && *a == (*b >= 'A' && *b <= 'Z' ? *b - 'A' + 'a' : *b)) a++, b++;
        if (!*a && !*b) { *out = (lk_type)t; return true; }
    }
    return false;
}

lk_type lk_type_vec_dot(lk_type t) {
    switch (t) {
    case LK_TYPE_Q4_0: case LK_TYPE_Q8_0: case LK_TYPE_Q5_0: case LK_TYPE_Q4_0_R16: case LK_TYPE_Q8_0_R16:
        return LK_TYPE_Q8_0;
    case LK_TYPE_Q5_1: return LK_TYPE_Q8_1; /* its min needs the activation sum */
    case LK_TYPE_Q4_K: case LK_TYPE_Q5_K: case LK_TYPE_Q6_K: case LK_TYPE_Q4_K_R16: case LK_TYPE_Q5_K_R16:
    case LK_TYPE_Q6_K_R16: case LK_TYPE_Q2_K: case LK_TYPE_Q3_K: case LK_TYPE_IQ4_XS: return LK_TYPE_Q8_K;
    case LK_TYPE_F16: case LK_TYPE_F16_R16: return LK_TYPE_F16;
    case LK_TYPE_BF16: case LK_TYPE_BF16_R16: return LK_TYPE_BF16;
    case LK_TYPE_F32: return LK_TYPE_F32;
    default: LK_ASSERT(!"lk_type_vec_dot: unsupported weight type"); return LK_TYPE_F32;
    }
}

/* ===================================================================== */
/* Dequantisation                                                          */
/* ===================================================================== */

static void deq_q4_0(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += LK_Q40_BYTES, y += LK_QK) {
        float d = lk_ld_h(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j]      = d * (float)((qs[j] & 0xF) - 8);
            y[j + 16] = d * (float)((qs[j] >> 4) - 8);
        }
    }
}

static void deq_q8_0(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += LK_Q80_BYTES, y += LK_QK) {
        float d = lk_ld_h(b);
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = d * (float)qs[j];
    }
}

static void deq_q4_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += LK_Q4K_BYTES) {
        float d = lk_ld_h(b), dmin = lk_ld_h(b + 2);
        const uint8_t *sc = b + LK_Q4K_SC, *q = b + LK_Q4K_QS;
        /* 4 chunks of 64 elements: low nibbles of 32 bytes, then high nibbles. */
        for (int c = 0; c < 4; c++, q += 32) {
            uint8_t s0, m0, s1, m1;
            lk_k_scale_min(2 * c, sc, &s0, &m0);
            lk_k_scale_min(2 * c + 1, sc, &s1, &m1);
            float d0 = d * s0, mm0 = dmin * m0, d1 = d * s1, mm1 = dmin * m1;
            for (int l = 0; l < 32; l++) *y++ = d0 * (float)(q[l] & 0xF) - mm0;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] >> 4) - mm1;
        }
    }
}

static void deq_q5_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += LK_Q5K_BYTES) {
        float d = lk_ld_h(b), dmin = lk_ld_h(b + 2);
        const uint8_t *sc = b + LK_Q5K_SC, *qh = b + LK_Q5K_QH, *q = b + LK_Q5K_QS;
        /* Like Q4_K; the fifth bit of element l of sub-block j is bit j of qh[l]. */
        for (int c = 0; c < 4; c++, q += 32) {
            uint8_t s0, m0, s1, m1;
            lk_k_scale_min(2 * c, sc, &s0, &m0);
            lk_k_scale_min(2 * c + 1, sc, &s1, &m1);
            float d0 = d * s0, mm0 = dmin * m0, d1 = d * s1, mm1 = dmin * m1;
            uint8_t u0 = (uint8_t)(1u << (2 * c)), u1 = (uint8_t)(2u << (2 * c));
            for (int l = 0; l < 32; l++)
                *y++ = d0 * (float)((q[l] & 0xF) + (qh[l] & u0 ? 16 : 0)) - mm0;
            for (int l = 0; l < 32; l++)
                *y++ = d1 * (float)((q[l] >> 4) + (qh[l] & u1 ? 16 : 0)) - mm1;
        }
    }
}

/* Q6_K element e (0..255) of a super-block as a signed 6-bit value; its
 * scale is scales[e/16]. Within each half of 128 elements (h), element
 * 32*k + l (k = 0..3, l < 32) takes its low 4 bits from ql[64h + l + 32*(k&1)]
 * (low nibble for k < 2, high nibble otherwise) and its top 2 bits from bits
 * 2k..2k+1 of qh[32h + l]. */
static inline int q6k_val(const uint8_t *ql, const uint8_t *qh, int e) {
    int h = e >> 7, k = (e >> 5) & 3, l = e & 31;
    int lo = ql[64 * h + l + 32 * (k & 1)];
    lo = k < 2 ? lo & 0xF : lo >> 4;
    int hi = (qh[32 * h + l] >> (2 * k)) & 3;
    return (lo | hi << 4) - 32;
}

static void deq_q6_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += LK_Q6K_BYTES, y += LK_QK_K) {
        float d = lk_ld_h(b + LK_Q6K_D);
        const int8_t *sc = (const int8_t *)(b + LK_Q6K_SC);
        for (int e = 0; e < LK_QK_K; e++)
            y[e] = d * (float)sc[e / 16] * (float)q6k_val(b + LK_Q6K_QL, b + LK_Q6K_QH, e);
    }
}

static void deq_q8_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += LK_Q8K_BYTES, y += LK_QK_K) {
        float d = lk_ld_f32(b);
        const int8_t *qs = (const int8_t *)(b + LK_Q8K_QS);
        for (int j = 0; j < LK_QK_K; j++) y[j] = d * (float)qs[j];
    }
}

void lk_dequantize_row(lk_type t, const void *src, float *dst, int64_t n) {
    int64_t bs = lk_type_block_size(t);
    LK_ASSERT(bs > 0 && n >= 0 && n % bs == 0);
    const uint8_t *s = src;
    int64_t nb = n / bs;
    switch (t) {
    case LK_TYPE_F32: memcpy(dst, src, (size_t)n * 4); break;
    case LK_TYPE_F16: for (int64_t i = 0; i < n; i++) dst[i] = lk_ld_h(s + 2 * i); break;
    case LK_TYPE_BF16: for (int64_t i = 0; i < n; i++) dst[i] = lk_bf16_to_fp32(lk_ld_u16(s + 2 * i)); break;
    case LK_TYPE_Q4_0: deq_q4_0(s, dst, nb); break;
    case LK_TYPE_Q8_0: deq_q8_0(s, dst, nb); break;
    case LK_TYPE_Q4_K: deq_q4_k(s, dst, nb); break;
    case LK_TYPE_Q5_K: deq_q5_k(s, dst, nb); break;
    case LK_TYPE_Q6_K: deq_q6_k(s, dst, nb); break;
    case LK_TYPE_Q8_K: deq_q8_k(s, dst, nb); break;
    default:
        if (lk_q5_dequantize(t, s, dst, nb) || lk_k23_dequantize(t, s, dst, nb)) break;
        LK_ASSERT(!"lk_dequantize_row: unsupported type");
    }
}

/* ===================================================================== */
/* Quantisation (scalar references, bit-exact with ggml's *_ref)           */
/* ===================================================================== */

static void quant_f32(const float *x, void *dst, int64_t n) { memcpy(dst, x, (size_t)n * 4); }

void lk_quant_f16_rows(const float *x, void *dst, int64_t n) {
    uint8_t *d = dst;
    for (int64_t i = 0; i < n; i++) { uint16_t h = lk_fp32_to_fp16(x[i]); memcpy(d + 2 * i, &h, 2); }
}

void lk_quant_bf16_rows(const float *x, void *dst, int64_t n) {
    uint8_t *d = dst;
    for (int64_t i = 0; i < n; i++) { uint16_t h = lk_fp32_to_bf16(x[i]); memcpy(d + 2 * i, &h, 2); }
}

/* Q8_0: d = max|x|/127, q = round-half-away(x/d) (roundf, as ggml). */
static void quant_q8_0(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / LK_QK; i++, x += LK_QK, b += LK_Q80_BYTES) {
        float amax = 0;
        for (int j = 0; j < LK_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.f, id = d != 0 ? 1.0f / d : 0.0f;
        uint16_t h = lk_fp32_to_fp16(d);
        memcpy(b, &h, 2);
        for (int j = 0; j < LK_QK; j++) b[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
    }
}

/* Q4_0: the element of largest magnitude (signed) maps to -8, so
 * d = max/-8; q = min(15, trunc(x/d + 8.5)). */
static void quant_q4_0(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / LK_QK; i++, x += LK_QK, b += LK_Q40_BYTES) {
        float amax = 0, max = 0;
        for (int j = 0; j < LK_QK; j++)
            if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
        float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
        uint16_t h = lk_fp32_to_fp16(d);
        memcpy(b, &h, 2);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(int8_t)(x[j] * id + 8.5f), q1 = (int)(int8_t)(x[j + 16] * id + 8.5f);
            q0 = q0 < 15 ? q0 : 15;
            q1 = q1 < 15 ? q1 : 15;
            b[2 + j] = (uint8_t)(q0 | q1 << 4);
        }
    }
}

/* Q8_K: iscale = -127/max (max = the signed element of largest magnitude),
 * q = min(127, round-half-even(iscale*x)), d = 1/iscale, bsums over 16. */
static void quant_q8_k(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / LK_QK_K; i++, x += LK_QK_K, b += LK_Q8K_BYTES) {
        float amax = 0, max = 0;
        for (int j = 0; j < LK_QK_K; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
        int8_t *qs = (int8_t *)(b + LK_Q8K_QS);
        if (amax == 0) {
            /* ggml leaves bsums unset here; zero is what they must sum to. */
            memset(b, 0, LK_Q8K_BYTES);
            continue;
        }
        float iscale = -127.f / max;
        for (int j = 0; j < LK_QK_K; j++) {
            int v = (int)nearbyintf(iscale * x[j]);
            qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += qs[16 * g + j];
            int16_t s16 = (int16_t)s;
            memcpy(b + LK_Q8K_BS + 2 * g, &s16, 2);
        }
        float d = 1 / iscale;
        memcpy(b, &d, 4);
    }
}

/* ===================================================================== */
/* Scalar dot products: one weight row . one activation row               */
/* ===================================================================== */

static float dot_f32(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += lk_ld_f32(w + 4 * i) * lk_ld_f32(a + 4 * i);
    return s;
}

static float dot_f16(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += lk_ld_h(w + 2 * i) * lk_ld_h(a + 2 * i);
    return s;
}

static float dot_bf16(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n; i++)
        s += lk_bf16_to_fp32(lk_ld_u16(w + 2 * i)) * lk_bf16_to_fp32(lk_ld_u16(a + 2 * i));
    return s;
}

static float dot_q4_0(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n / LK_QK; i++, w += LK_Q40_BYTES, a += LK_Q80_BYTES) {
        const int8_t *q8 = (const int8_t *)(a + 2);
        int sumi = 0;
        for (int j = 0; j < 16; j++)
            sumi += ((w[2 + j] & 0xF) - 8) * q8[j] + ((w[2 + j] >> 4) - 8) * q8[j + 16];
        s += (float)sumi * (lk_ld_h(w) * lk_ld_h(a));
    }
    return s;
}

int32_t lk_q8_dot32(const int8_t *w, const int8_t *a) {
    int32_t s = 0;
    for (int j = 0; j < 32; j++) s += w[j] * a[j];
    return s;
}

static float dot_q8_0(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n / LK_QK; i++, w += LK_Q80_BYTES, a += LK_Q80_BYTES) {
        const int8_t *qw = (const int8_t *)(w + 2), *q8 = (const int8_t *)(a + 2);
        int sumi = 0;
        for (int j = 0; j < 32; j++) sumi += qw[j] * q8[j];
        s += (float)sumi * (lk_ld_h(w) * lk_ld_h(a));
    }
    return s;
}

/* Sum over the 16-element group g of a Q8_K block (its precomputed bsum). */
static inline int q8k_bsum(const uint8_t *a, int g) { return lk_ld_i16(a + LK_Q8K_BS + 2 * g); }

/* Q4_K/Q5_K: x = d*sc_j*q - dmin*m_j per sub-block j of 32, so
 *   dot = d*da * sum_j sc_j * (q . q8)_j  -  dmin*da * sum_j m_j * sum(q8)_j
 * where sum(q8)_j is two bsums: the min term costs no per-element work.
 * Q5_K's quants have a 5th bit (bit j of qh[l] for sub-block j). */
static inline float dot_k45(const bool q5, int64_t n, const uint8_t *w, const uint8_t *a) {
    const size_t bb = q5 ? LK_Q5K_BYTES : LK_Q4K_BYTES;
    float s = 0;
    for (int64_t i = 0; i < n / LK_QK_K; i++, w += bb, a += LK_Q8K_BYTES) {
        const uint8_t *q = w + (q5 ? LK_Q5K_QS : LK_Q4K_QS), *qh = w + LK_Q5K_QH;
        const int8_t *q8 = (const int8_t *)(a + LK_Q8K_QS);
        int sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            lk_k_scale_min(j, w + (q5 ? LK_Q5K_SC : LK_Q4K_SC), &sc, &m);
            const uint8_t *qq = q + 32 * (j / 2);
            int shift = 4 * (j & 1), si = 0;
            for (int l = 0; l < 32; l++)
                si += (((qq[l] >> shift) & 0xF) | (q5 ? ((qh[l] >> j) & 1) << 4 : 0)) * q8[32 * j + l];
            sumi += sc * si;
            summ += m * (q8k_bsum(a, 2 * j) + q8k_bsum(a, 2 * j + 1));
        }
        float da = lk_ld_f32(a);
        s += lk_ld_h(w) * da * (float)sumi - lk_ld_h(w + 2) * da * (float)summ;
    }
    return s;
}

static float dot_q4_k(int64_t n, const uint8_t *w, const uint8_t *a) { return dot_k45(false, n, w, a); }
static float dot_q5_k(int64_t n, const uint8_t *w, const uint8_t *a) { return dot_k45(true, n, w, a); }

static float dot_q6_k(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n / LK_QK_K; i++, w += LK_Q6K_BYTES, a += LK_Q8K_BYTES) {
        const int8_t *sc = (const int8_t *)(w + LK_Q6K_SC);
        const int8_t *q8 = (const int8_t *)(a + LK_Q8K_QS);
        int sumi = 0;
        for (int g = 0; g < 16; g++) {
            int si = 0;
            for (int l = 0; l < 16; l++) si += q6k_val(w + LK_Q6K_QL, w + LK_Q6K_QH, 16 * g + l) * q8[16 * g + l];
            sumi += sc[g] * si;
        }
        s += lk_ld_h(w + LK_Q6K_D) * lk_ld_f32(a) * (float)sumi;
    }
    return s;
}

typedef float (*lk_dot_fn)(int64_t n, const uint8_t *w, const uint8_t *a);

float lk_quant_dot_scalar(lk_type t, int64_t n, const void *w, const void *a) {
    switch (t) {
    case LK_TYPE_F32: return dot_f32(n, w, a);
    case LK_TYPE_F16: return dot_f16(n, w, a);
    case LK_TYPE_BF16: return dot_bf16(n, w, a);
    case LK_TYPE_Q4_0: return dot_q4_0(n, w, a);
    case LK_TYPE_Q8_0: return dot_q8_0(n, w, a);
    case LK_TYPE_Q4_K: return dot_q4_k(n, w, a);
    case LK_TYPE_Q5_K: return dot_q5_k(n, w, a);
    case LK_TYPE_Q6_K: return dot_q6_k(n, w, a);
    default: {
        float r;
        if (lk_q5_dot_scalar(t, n, w, a, &r) || lk_k23_dot_scalar(t, n, w, a, &r)) return r;
        LK_ASSERT(!"lk_quant_dot_scalar: unsupported type");
        return 0;
    }
    }
}

static void mm_generic(lk_dot_fn dot, int64_t n, int64_t nrows, const void *w, size_t w_stride,
                       int64_t ntok, const void *a, size_t a_stride, float *y, size_t y_stride) {
    for (int64_t t = 0; t < ntok; t++) {
        const uint8_t *at = (const uint8_t *)a + (size_t)t * a_stride;
        for (int64_t r = 0; r < nrows; r++)
            y[(size_t)t * y_stride + (size_t)r] = dot(n, (const uint8_t *)w + (size_t)r * w_stride, at);
    }
}

#define LK_SCALAR_MM(T)                                                                        \
    static void mm_##T(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, \
                       const void *a, size_t a_stride, float *y, size_t y_stride) {            \
        mm_generic(dot_##T, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);           \
    }
LK_SCALAR_MM(f32)
LK_SCALAR_MM(f16)
LK_SCALAR_MM(bf16)
LK_SCALAR_MM(q4_0)
LK_SCALAR_MM(q8_0)
LK_SCALAR_MM(q4_k)
LK_SCALAR_MM(q5_k)
LK_SCALAR_MM(q6_k)

static void fill_repacked_via_file(lk_quant_ops *ops);

void lk_quant_fill_scalar(lk_quant_ops *ops) {
    memset(ops, 0, sizeof *ops);
    ops->name = "scalar";
    ops->mm[LK_TYPE_F32] = mm_f32;
    ops->mm[LK_TYPE_F16] = mm_f16;
    ops->mm[LK_TYPE_BF16] = mm_bf16;
    ops->mm[LK_TYPE_Q4_0] = mm_q4_0;
    ops->mm[LK_TYPE_Q8_0] = mm_q8_0;
    ops->mm[LK_TYPE_Q4_K] = mm_q4_k;
    ops->mm[LK_TYPE_Q5_K] = mm_q5_k;
    ops->mm[LK_TYPE_Q6_K] = mm_q6_k;
    fill_repacked_via_file(ops);
    ops->quant[LK_TYPE_F32] = quant_f32;
    ops->quant[LK_TYPE_F16] = lk_quant_f16_rows;
    ops->quant[LK_TYPE_BF16] = lk_quant_bf16_rows;
    ops->quant[LK_TYPE_Q8_0] = quant_q8_0;
    ops->quant[LK_TYPE_Q4_0] = quant_q4_0;
    ops->quant[LK_TYPE_Q8_K] = quant_q8_k;
    ops->quant[LK_TYPE_Q4_K] = lk_quantize_row_q4_k;
    ops->quant[LK_TYPE_Q5_K] = lk_quantize_row_q5_k;
    ops->act[LK_TYPE_Q8_0] = lk_act_q8_0_scalar;
    lk_q5_fill_scalar(ops);
    lk_k23_fill_scalar(ops);
}

static _Atomic int g_dec_rows = 4; /* lk_quant_set_dec_rows */

void lk_quant_run_tiles(const lk_tileset *ts, int64_t n, int64_t nrows, const void *w, size_t ws,
                        int64_t ntok, const void *a, size_t as, float *y, size_t ys) {
    const uint8_t *W = w, *A = a;
    if (ntok == 1) {
        int64_t r = 0;
        if (atomic_load_explicit(&g_dec_rows, memory_order_relaxed) == 4)
            for (; r + 4 <= nrows; r += 4) ts->dec4(n, W + (size_t)r * ws, ws, A, as, y + r, ys);
        for (; r < nrows; r++) ts->dec1(n, W + (size_t)r * ws, ws, A, as, y + r, ys);
        return;
    }
    enum { TCHUNK = 64 };
    for (int64_t t0 = 0; t0 < ntok; t0 += TCHUNK) {
        int64_t t1 = LK_MIN(ntok, t0 + TCHUNK), step;
        for (int64_t r = 0; r < nrows; r += step) {
            int rr = nrows - r >= ts->r_pf;
            step = rr ? ts->r_pf : 1;
            for (int64_t t = t0; t < t1; t += ts->t_pf) {
                int tt = (int)LK_MIN((int64_t)ts->t_pf, t1 - t);
                ts->pf[rr][tt](n, W + (size_t)r * ws, ws, A + (size_t)t * as, as,
                               y + (size_t)t * ys + (size_t)r, ys);
            }
        }
    }
}

/* ===================================================================== */
/* Dispatch                                                                */
/* ===================================================================== */

/* One table per level, built once; `g_active` points at one of them: the
 * level of the program's CPU probe (lk_cpu, which also honours LK_SIMD).
 * Switching levels (lk_quant_set_simd, tests and benchmarks) swaps a pointer
 * to a table that never changes, so a concurrent caller sees either the old
 * or the new one. */
static lk_quant_ops g_levels[LK_SIMD_LEVELS];
static const lk_quant_ops *_Atomic g_active;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init_once(void) {
    lk_quant_fill_scalar(&g_levels[LK_SIMD_SCALAR]);
    g_levels[LK_SIMD_AVX2] = g_levels[LK_SIMD_SCALAR];
    lk_quant_fill_avx2(&g_levels[LK_SIMD_AVX2]);
    lk_q5_fill_avx2(&g_levels[LK_SIMD_AVX2]);
    lk_k23_fill_avx2(&g_levels[LK_SIMD_AVX2]);
    g_levels[LK_SIMD_AVX512] = g_levels[LK_SIMD_AVX2];
    lk_quant_fill_avx512(&g_levels[LK_SIMD_AVX512]);
    lk_q5_fill_avx512(&g_levels[LK_SIMD_AVX512]);
    lk_k23_fill_avx512(&g_levels[LK_SIMD_AVX512]);
    g_active = &g_levels[lk_cpu()->level];
}

_Atomic int lk_quant_pf_g = 1;

void lk_quant_set_prefetch(int tiles) {
    LK_ASSERT(tiles >= 0 && tiles <= LK_QUANT_PF_MAX);
    atomic_store(&lk_quant_pf_g, tiles);
}

int lk_quant_prefetch(void) { return lk_quant_pf_tiles(); }

_Atomic int lk_quant_far_g = -1;

void lk_quant_set_far(int kb) {
    LK_ASSERT(kb >= -1 && kb <= LK_QUANT_FAR_MAX);
    atomic_store(&lk_quant_far_g, kb);
}

int lk_quant_far(void) { return atomic_load_explicit(&lk_quant_far_g, memory_order_relaxed); }

static _Atomic int g_gemm_tok;

void lk_quant_set_dec_rows(int rows) {
    LK_ASSERT(rows == 1 || rows == 4);
    atomic_store_explicit(&g_dec_rows, rows, memory_order_relaxed);
}

int lk_quant_dec_rows(void) { return atomic_load_explicit(&g_dec_rows, memory_order_relaxed); }

static bool cpu_is_amd(void);
static _Atomic int g_dec_roll = -1; /* lk_quant_set_dec_roll */

void lk_quant_set_dec_roll(int roll) {
    LK_ASSERT(roll >= -1 && roll <= 1);
    atomic_store_explicit(&g_dec_roll, roll, memory_order_relaxed);
}

int lk_quant_dec_roll_setting(void) { return atomic_load_explicit(&g_dec_roll, memory_order_relaxed); }

bool lk_quant_dec_roll(void) {
    const int v = atomic_load_explicit(&g_dec_roll, memory_order_relaxed);
    return v < 0 ? cpu_is_amd() : v > 0;
}

void lk_quant_set_gemm_tok(int ntok) {
    LK_ASSERT(ntok == 0 || (ntok >= LK_QUANT_GEMM_TOK_MIN && ntok <= LK_QUANT_GEMM_TOK_MAX));
    atomic_store_explicit(&g_gemm_tok, ntok, memory_order_relaxed);
}

int lk_quant_gemm_tok(void) { return atomic_load_explicit(&g_gemm_tok, memory_order_relaxed); }

static _Atomic int g_amx_tok = -1, g_amx_emu;

void lk_quant_set_amx(int ntok) {
    LK_ASSERT(ntok >= -1 && ntok <= 1024);
    atomic_store_explicit(&g_amx_tok, ntok, memory_order_relaxed);
}

bool lk_quant_amx_have(void) { return lk_cpu_can(LK_SIMD_AVX512, LK_CPU_AMX); }

void lk_quant_amx_emulate(bool on) { atomic_store_explicit(&g_amx_emu, on, memory_order_relaxed); }

bool lk_quant_amx_emulating(void) { return atomic_load_explicit(&g_amx_emu, memory_order_relaxed); }

int lk_quant_amx(void) { return atomic_load_explicit(&g_amx_tok, memory_order_relaxed); }

/* an AMX kernel's threshold in force: setting v (-1: the default def), 0
 * where there are no tiles to run on (nor their emulation) */
static int amx_threshold(int v, int def) {
    if (!(lk_quant_amx_emulating() || lk_quant_amx_have())) return 0;
    return v < 0 ? def : v;
}

int lk_quant_amx_min_tok(void) { return amx_threshold(lk_quant_amx(), LK_AMX_MIN_TOK); }

static _Atomic int g_amxf_tok = -1;

void lk_quant_set_amx_few(int ntok) {
    LK_ASSERT(ntok >= -1 && ntok <= 1024);
    atomic_store_explicit(&g_amxf_tok, ntok, memory_order_relaxed);
}

int lk_quant_amx_few(void) { return atomic_load_explicit(&g_amxf_tok, memory_order_relaxed); }

int lk_quant_amx_few_min_tok(void) { return amx_threshold(lk_quant_amx_few(), LK_AMX_FEW_MIN_TOK); }

static _Atomic int64_t g_rows_inner = -1; /* -1: not resolved yet */
static int64_t rows_inner_default(void) {
    const char *e = getenv("LK_ROWS_INNER_KB");
    if (e && *e) return (int64_t)atoll(e) * 1024;
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? l2 / 2 : 512 * 1024;
}
void lk_quant_set_rows_inner(int64_t bytes) {
    atomic_store_explicit(&g_rows_inner, bytes < 0 ? rows_inner_default() : bytes, memory_order_relaxed);
}
int64_t lk_quant_rows_inner(void) {
    int64_t v = atomic_load_explicit(&g_rows_inner, memory_order_relaxed);
    if (v < 0) atomic_store_explicit(&g_rows_inner, v = rows_inner_default(), memory_order_relaxed);
    return v;
}

void lk_quant_init(void) { pthread_once(&g_once, init_once); }

static inline const lk_quant_ops *ops_get(void) {
    const lk_quant_ops *o = g_active;
    if (__builtin_expect(o == NULL, 0)) { lk_quant_init(); o = g_active; }
    return o;
}

const char *lk_quant_simd_name(void) { return ops_get()->name; }

bool lk_quant_set_simd(const char *level) {
    lk_quant_init();
    lk_simd_level l;
    if (!lk_simd_level_parse(level, &l) || !lk_cpu_runs_level(l)) return false;
    g_active = &g_levels[l];
    return true;
}

bool lk_quantize_supported(lk_type t) {
    lk_quant_init();
    return t < LK_TYPE_ALL && g_levels[0].quant[t] != NULL;
}

void lk_quantize_row(lk_type t, const float *src, void *dst, int64_t n) {
    const lk_quant_ops *o = ops_get();
    LK_ASSERT(t < LK_TYPE_ALL && o->quant[t] != NULL);
    int64_t bs = lk_type_block_size(t);
    LK_ASSERT(n >= 0 && n % bs == 0);
    o->quant[t](src, dst, n);
}

void lk_quantize_row_act(lk_type t, const float *src, void *dst, int64_t n) {
    const lk_quant_ops *o = ops_get();
    if (t < LK_TYPE_ALL && o->act[t]) o->act[t](src, dst, n);
    else lk_quantize_row(t, src, dst, n);
}

void lk_quant_matmul(lk_type wt, int64_t n, int64_t nrows, const void *w, size_t w_stride,
                     int64_t ntok, const void *a, size_t a_stride, float *y, size_t y_stride) {
    const lk_quant_ops *o = ops_get();
    LK_ASSERT(wt < LK_TYPE_ALL && o->mm[wt] != NULL);
    LK_ASSERT(n >= 0 && n % lk_type_block_size(wt) == 0 && nrows >= 0 && ntok >= 0);
    if (n == 0) {
        for (int64_t t = 0; t < ntok; t++)
            for (int64_t r = 0; r < nrows; r++) y[(size_t)t * y_stride + (size_t)r] = 0;
        return;
    }
    o->mm[wt](n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
}

int32_t lk_quant_terms_k(lk_type wt) {
    if (wt >= LK_TYPE_ALL || !ops_get()->mm_terms[wt]) return 0;
    return wt == LK_TYPE_F16_R16                       ? LK_TERMS_WIDE
           : wt == LK_TYPE_BF16                        ? LK_TERMS_TILES
           : wt == LK_TYPE_Q8_0 || wt == LK_TYPE_Q8_0_R16 ? 128
                                                       : 8;
}

/* terms of the Q8_0 kinds are per block: whole blocks only */
static bool terms_any_n(int32_t k) { return k == LK_TERMS_WIDE || k == LK_TERMS_TILES; }

size_t lk_act_terms_bytes(int32_t k, int64_t n, int64_t ntok) {
    if (k == LK_TERMS_WIDE) return (size_t)((n + 15) / 16 * 16) * (size_t)ntok * sizeof(float);
    if (k == LK_TERMS_TILES) return (size_t)((n + 31) / 32) * (size_t)((ntok + 15) / 16) * 1024;
    const int64_t nkb = (n / LK_QK + LK_TERMS_KB - 1) / LK_TERMS_KB;
    return (size_t)nkb * (size_t)ntok * LK_TERMS_KB * (sizeof(float) + sizeof(int32_t));
}

void lk_act_terms_init(lk_act_terms *T, int32_t k, int64_t n, int64_t ntok, void *mem) {
    LK_ASSERT(k == 8 || k == 128 || k == LK_TERMS_WIDE || k == LK_TERMS_TILES);
    *T = (lk_act_terms){ .ntok = ntok, .k = k };
    if (k == LK_TERMS_WIDE) T->wide = mem;
    else if (k == LK_TERMS_TILES) T->tiles = mem;
    else T->d = mem, T->corr = (int32_t *)((char *)mem + lk_act_terms_bytes(k, n, ntok) / 2);
}

void lk_act_terms_rows(const lk_act_terms *T, int64_t t0, int64_t t1, const void *a, size_t as, int64_t n) {
    LK_ASSERT(0 <= t0 && t0 <= t1 && t1 <= T->ntok && (terms_any_n(T->k) || n % LK_QK == 0) && ops_get()->terms_rows);
    if (t0 < t1) ops_get()->terms_rows(T, t0, t1, a, as, n);
}

bool lk_act_terms_by_token(int32_t k) { return k != LK_TERMS_TILES; }

int64_t lk_act_terms_view_align(int32_t k) { return k == LK_TERMS_WIDE ? LK_TERMS_WIDE_T : 0; }

void lk_act_terms_view(const lk_act_terms *T, int64_t t0, int64_t t1, int64_t n, lk_act_terms *out) {
    const int64_t al = lk_act_terms_view_align(T->k);
    LK_ASSERT(al > 0 && t0 % al == 0 && 0 <= t0 && t0 <= t1 && t1 <= T->ntok);
    *out = *T;
    out->ntok = t1 - t0;
    /* whole panels before t0: the terms of t0 tokens, one after another */
    out->wide = (float *)(void *)((char *)T->wide + lk_act_terms_bytes(T->k, n, t0));
}

void lk_act_terms_part(const lk_act_terms *T, int part, int nparts, const void *a, size_t as, int64_t n) {
    LK_ASSERT(0 <= part && part < nparts && !lk_act_terms_by_token(T->k) && ops_get()->terms_part);
    ops_get()->terms_part(T, part, nparts, a, as, n);
}

void lk_quant_matmul_terms(lk_type wt, int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok,
                           const void *a, size_t a_stride, const lk_act_terms *terms, float *y, size_t y_stride) {
    const lk_quant_ops *o = ops_get();
    if (!terms || n == 0 || wt >= LK_TYPE_ALL || !o->mm_terms[wt]) {
        lk_quant_matmul(wt, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
        return;
    }
    /* each kernel reads terms of its own kind only (T->k), others as none */
    LK_ASSERT((terms_any_n(lk_quant_terms_k(wt)) || n % LK_QK == 0) && nrows >= 0 && ntok >= 0 &&
              terms->ntok == ntok);
    o->mm_terms[wt](n, nrows, w, w_stride, ntok, a, a_stride, terms, y, y_stride);
}

/* ===================================================================== */
/* Repacking at load (quant.h; the layout: quant_impl.h)                   */
/* ===================================================================== */

/* The K-quants' repacked decode is measured per CPU maker: on Zen 5 it
 * decoded TinyLlama-shape Q4_K_M 20-25 % faster at one thread (93-103 % of
 * the probe), on the Sapphire Rapids device host 20-35 % slower at 1-8
 * threads (BENCHMARKS.md, ninth session), so by default only AMD CPUs take
 * it; LK_REPACK=all takes it everywhere, LK_REPACK=0 nowhere. */
static bool cpu_is_amd(void) {
    static _Atomic int amd = -1; /* every F16/BF16 product asks (lk_quant_dec_roll), from any thread */
    int v = atomic_load_explicit(&amd, memory_order_relaxed);
    if (v < 0) {
        unsigned a = 0, b = 0, c = 0, d = 0;
        v = __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* AuthenticAMD */
        atomic_store_explicit(&amd, v, memory_order_relaxed);
    }
    return v;
}

int lk_gemm_min_tok_r16(void) { return cpu_is_amd() ? LK_GEMM_MIN_TOK_R16_AMD : LK_GEMM_MIN_TOK_R16_OTHER; }

/* Where a row's block b goes in its group: byte at + 4k (k < nq) of row i
 * to q + 64k + 4i (xor flip: Q8_0's + 128); the 2-byte scale at byte so of
 * the block (none: SIZE_MAX) to d + 2i (quant_impl.h) */
typedef struct { size_t q, d, at, so; int nq; uint32_t flip; } r16_pos;

static r16_pos r16_place(lk_type rt, int64_t b, int64_t nb) {
    r16_pos p = {0};
    const size_t bb = lk_type_block_bytes(rt);
    if (rt == LK_TYPE_Q4_0_R16 || rt == LK_TYPE_Q8_0_R16) {
        const bool q8 = rt == LK_TYPE_Q8_0_R16;
        lk_r16_at(q8, b, nb, &p.q, &p.d);
        p.nq = q8 ? 8 : 4, p.at = 2, p.so = 0, p.flip = q8 ? 0x80808080u : 0;
    } else { /* the K-quants: all of it 4 bytes at a time, Q6_K's d at the end apart */
        lk_kr16_at(bb, b, nb, &p.q, &p.d);
        p.nq = (int)(bb / 4), p.at = 0, p.so = bb % 4 ? bb - 2 : SIZE_MAX;
    }
    return p;
}

/* Row i's block to its place in group g, or back (from it) */
static inline void r16_move(const r16_pos *p, bool back, uint8_t *blk, uint8_t *g, int i) {
    if (p->so != SIZE_MAX) {
        if (back) memcpy(blk + p->so, g + p->d + 2 * i, 2);
        else memcpy(g + p->d + 2 * i, blk + p->so, 2);
    }
    for (int k = 0; k < p->nq; k++) { /* 4 bytes at a time (a load takes seconds byte by byte) */
        uint32_t v;
        if (back) {
            memcpy(&v, g + p->q + 64 * k + 4 * i, 4);
            v ^= p->flip;
            memcpy(blk + p->at + 4 * k, &v, 4);
        } else {
            memcpy(&v, blk + p->at + 4 * k, 4);
            v ^= p->flip;
            memcpy(g + p->q + 64 * k + 4 * i, &v, 4);
        }
    }
}

void lk_quant_repack(lk_type rt, lk_type t, int64_t n, int64_t rows, const void *src, size_t src_stride, void *dst) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t, n, &rb));
    const uint8_t *S = src;
    uint8_t *D = dst;
    int64_t r = 0;
    if (rt == LK_TYPE_F16_R16) { /* element k of row i of a group at 2 (16 k + i) */
        LK_ASSERT(t == LK_TYPE_F16);
        enum { KB = 64 }; /* elements at a time: the 16 rows' 2 KB in a buffer, written out at once */
        for (; r + LK_R16_ROWS <= rows; r += LK_R16_ROWS)
            for (int64_t k0 = 0; k0 < n; k0 += KB) {
                const int64_t kn = LK_MIN((int64_t)KB, n - k0);
                uint16_t blk[KB][LK_R16_ROWS];
                for (int i = 0; i < LK_R16_ROWS; i++) {
                    uint16_t v[KB];
                    memcpy(v, S + (size_t)(r + i) * src_stride + 2 * (size_t)k0, 2 * (size_t)kn);
                    for (int64_t k = 0; k < kn; k++) blk[k][i] = v[k];
                }
                memcpy(D + (size_t)r * rb + 32 * (size_t)k0, blk, 32 * (size_t)kn);
            }
    } else if (rt == LK_TYPE_BF16_R16) { /* elements 2j, 2j + 1 of row i of a group at 4 (16 j + i); an odd last
                                         * one at 64 (n / 2) + 2 i */
        LK_ASSERT(t == LK_TYPE_BF16);
        for (; r + LK_R16_ROWS <= rows; r += LK_R16_ROWS) {
            uint8_t *g = D + (size_t)r * rb;
            for (int i = 0; i < LK_R16_ROWS; i++) {
                const uint8_t *s = S + (size_t)(r + i) * src_stride;
                for (int64_t j = 0; j < n / 2; j++) memcpy(g + 4 * (16 * (size_t)j + (size_t)i), s + 4 * (size_t)j, 4);
                if (n & 1) memcpy(g + 64 * (size_t)(n / 2) + 2 * (size_t)i, s + 2 * (size_t)(n - 1), 2);
            }
        }
    } else if (rt != t) {
        LK_ASSERT(lk_type_file(rt) == t);
        const size_t bb = lk_type_block_bytes(t);
        const int64_t nb = n / lk_type_block_size(t);
        for (; r + LK_R16_ROWS <= rows; r += LK_R16_ROWS)
            for (int64_t b = 0; b < nb; b++) {
                const r16_pos p = r16_place(rt, b, nb);
                for (int i = 0; i < LK_R16_ROWS; i++)
                    r16_move(&p, false, (uint8_t *)(S + (size_t)(r + i) * src_stride + (size_t)b * bb),
                             D + (size_t)r * rb, i);
            }
    }
    /* the rest as rows of the file's type */
    for (; r < rows; r++) memcpy(D + (size_t)r * rb, S + (size_t)r * src_stride, rb);
}

void lk_quant_unrepack_row(lk_type rt, int64_t n, const void *w, size_t ws, int64_t r, void *dst) {
    LK_ASSERT(lk_type_file(rt) != rt);
    if (rt == LK_TYPE_F16_R16) {
        const uint8_t *g = (const uint8_t *)w + (size_t)(r / LK_R16_ROWS * LK_R16_ROWS) * ws + 2 * (size_t)(r % LK_R16_ROWS);
        for (int64_t k = 0; k < n; k++) memcpy((uint8_t *)dst + 2 * (size_t)k, g + 32 * (size_t)k, 2);
        return;
    }
    if (rt == LK_TYPE_BF16_R16) {
        const size_t i = (size_t)(r % LK_R16_ROWS);
        const uint8_t *g = (const uint8_t *)w + (size_t)(r / LK_R16_ROWS * LK_R16_ROWS) * ws;
        for (int64_t j = 0; j < n / 2; j++) memcpy((uint8_t *)dst + 4 * (size_t)j, g + 4 * (16 * (size_t)j + i), 4);
        if (n & 1) memcpy((uint8_t *)dst + 2 * (size_t)(n - 1), g + 64 * (size_t)(n / 2) + 2 * i, 2);
        return;
    }
    const size_t bb = lk_type_block_bytes(rt);
    const int64_t nb = n / lk_type_block_size(rt);
    uint8_t *g = (uint8_t *)w + (size_t)(r / LK_R16_ROWS * LK_R16_ROWS) * ws;
    for (int64_t b = 0; b < nb; b++) {
        const r16_pos p = r16_place(rt, b, nb);
        r16_move(&p, true, (uint8_t *)dst + (size_t)b * bb, g, (int)(r % LK_R16_ROWS));
    }
}

/* A repacked type without a kernel of the level's own: whole groups row by
 * row through a row of the file's type on the stack, the rest (the file's
 * rows already) at once */
static void mm_r16_via_file(lk_type rt, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                            const void *a, size_t as, float *y, size_t ys) {
    enum { ROW_MAX = 64 * 1024 }; /* Q8_0 rows of 61,000: more than any model's width */
    _Alignas(64) uint8_t row[ROW_MAX];
    LK_ASSERT(ws <= ROW_MAX);
    const lk_type ft = lk_type_file(rt);
    const int64_t full = nrows / LK_R16_ROWS * LK_R16_ROWS;
    for (int64_t r = 0; r < full; r++) {
        lk_quant_unrepack_row(rt, n, w, ws, r, row);
        lk_quant_matmul(ft, n, 1, row, ws, ntok, a, as, y + r, ys);
    }
    if (full < nrows)
        lk_quant_matmul(ft, n, nrows - full, (const uint8_t *)w + (size_t)full * ws, ws, ntok, a, as, y + full, ys);
}

#define MM_VIA_FILE(name, RT)                                                                              \
    static void name(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as, \
                     float *y, size_t ys) {                                                                    \
        mm_r16_via_file(RT, n, nrows, w, ws, ntok, a, as, y, ys);                                              \
    }
MM_VIA_FILE(mm_q40r16_via_file, LK_TYPE_Q4_0_R16)
MM_VIA_FILE(mm_q80r16_via_file, LK_TYPE_Q8_0_R16)
MM_VIA_FILE(mm_q4kr16_via_file, LK_TYPE_Q4_K_R16)
MM_VIA_FILE(mm_q5kr16_via_file, LK_TYPE_Q5_K_R16)
MM_VIA_FILE(mm_q6kr16_via_file, LK_TYPE_Q6_K_R16)

/* F16_R16's arithmetic, every level's (quant_impl.h): each row's products
 * fused into one fp32 sum in element order. The rows past the last whole
 * group are F16 rows, through the level's F16 kernel. */
void lk_quant_f16r16_seq(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                         float *y, size_t ys) {
    const uint8_t *W = w, *A = a;
    const int64_t full = nrows / LK_R16_ROWS * LK_R16_ROWS;
    for (int64_t r = 0; r < full; r++) {
        const uint8_t *g = W + (size_t)(r / LK_R16_ROWS * LK_R16_ROWS) * ws + 2 * (size_t)(r % LK_R16_ROWS);
        for (int64_t t = 0; t < ntok; t++) {
            const uint8_t *at = A + (size_t)t * as;
            float acc = 0;
            for (int64_t k = 0; k < n; k++) acc = fmaf(lk_ld_h(g + 32 * (size_t)k), lk_ld_h(at + 2 * (size_t)k), acc);
            y[(size_t)t * ys + (size_t)r] = acc;
        }
    }
    if (full < nrows) lk_quant_matmul(LK_TYPE_F16, n, nrows - full, W + (size_t)full * ws, ws, ntok, a, as, y + full, ys);
}

/* One step of vdpbf16ps's lane (Intel's SDM and AMD's manual): c + x y as
 * one fused multiply-add in fp32, subnormal inputs read as zeros and a
 * subnormal result written as a zero of its sign, rounded to nearest even.
 * x, y are bf16 values (exact in fp32). */
static float bf_dp(float x, float y, float c) {
    x = fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x;
    y = fpclassify(y) == FP_SUBNORMAL ? copysignf(0.0f, y) : y;
    c = fpclassify(c) == FP_SUBNORMAL ? copysignf(0.0f, c) : c;
    const float s = fmaf(x, y, c);
    return fpclassify(s) == FP_SUBNORMAL ? copysignf(0.0f, s) : s;
}

/* BF16_R16's arithmetic, every level's (quant_impl.h): each row's sum from
 * zero, pair by pair of elements (2j, 2j + 1) as vdpbf16ps takes them,
 * element 2j + 1 first; an odd last element as a pair with a zero. The
 * rows past the last whole group are BF16 rows, through the level's BF16
 * kernel. */
void lk_quant_bf16r16_seq(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                          float *y, size_t ys) {
    const uint8_t *W = w, *A = a;
    const int64_t full = nrows / LK_R16_ROWS * LK_R16_ROWS;
    for (int64_t r = 0; r < full; r++) {
        const size_t i = (size_t)(r % LK_R16_ROWS);
        const uint8_t *g = W + (size_t)(r / LK_R16_ROWS * LK_R16_ROWS) * ws;
        for (int64_t t = 0; t < ntok; t++) {
            const uint8_t *at = A + (size_t)t * as;
            float acc = 0;
            for (int64_t j = 0; j < n / 2; j++) {
                const uint8_t *wp = g + 4 * (16 * (size_t)j + i), *ap = at + 4 * (size_t)j;
                acc = bf_dp(lk_bf16_to_fp32(lk_ld_u16(wp + 2)), lk_bf16_to_fp32(lk_ld_u16(ap + 2)), acc);
                acc = bf_dp(lk_bf16_to_fp32(lk_ld_u16(wp)), lk_bf16_to_fp32(lk_ld_u16(ap)), acc);
            }
            if (n & 1) {
                acc = bf_dp(0.0f, 0.0f, acc);
                acc = bf_dp(lk_bf16_to_fp32(lk_ld_u16(g + 64 * (size_t)(n / 2) + 2 * i)),
                            lk_bf16_to_fp32(lk_ld_u16(at + 2 * (size_t)(n - 1))), acc);
            }
            y[(size_t)t * ys + (size_t)r] = acc;
        }
    }
    if (full < nrows) lk_quant_matmul(LK_TYPE_BF16, n, nrows - full, W + (size_t)full * ws, ws, ntok, a, as, y + full, ys);
}

/* file type, repacked type, and the repacked type's kernel at the levels
 * without one of their own (F16_R16, BF16_R16: their arithmetic in scalar
 * code) */
static const struct { lk_type file, rep; lk_qmm_fn via_file; } k_repacks[] = {
    {LK_TYPE_Q4_0, LK_TYPE_Q4_0_R16, mm_q40r16_via_file}, {LK_TYPE_Q8_0, LK_TYPE_Q8_0_R16, mm_q80r16_via_file},
    {LK_TYPE_Q4_K, LK_TYPE_Q4_K_R16, mm_q4kr16_via_file}, {LK_TYPE_Q5_K, LK_TYPE_Q5_K_R16, mm_q5kr16_via_file},
    {LK_TYPE_Q6_K, LK_TYPE_Q6_K_R16, mm_q6kr16_via_file}, {LK_TYPE_F16, LK_TYPE_F16_R16, lk_quant_f16r16_seq},
    {LK_TYPE_BF16, LK_TYPE_BF16_R16, lk_quant_bf16r16_seq},
};
enum { N_REPACKS = sizeof k_repacks / sizeof k_repacks[0] };

static void fill_repacked_via_file(lk_quant_ops *ops) {
    for (int i = 0; i < N_REPACKS; i++) ops->mm[k_repacks[i].rep] = k_repacks[i].via_file;
}

lk_type lk_type_file(lk_type t) {
    for (int i = 0; i < N_REPACKS; i++)
        if (k_repacks[i].rep == t) return k_repacks[i].file;
    return t;
}

lk_type lk_type_repacked(lk_type t, int64_t rows) {
    int k = 0;
    while (k < N_REPACKS && k_repacks[k].file != t) k++;
    if (k == N_REPACKS || rows < LK_R16_ROWS) return t;
    const char *env = getenv("LK_REPACK");
    if (env && !strcmp(env, "0")) return t;
    const bool kq = lk_type_block_size(t) == LK_QK_K;
    if (kq && !(env && !strcmp(env, "all")) && !cpu_is_amd()) return t;
    /* only where a kernel reads it as it is: elsewhere it would be read
     * back into the file's rows at every call */
    return ops_get()->mm[k_repacks[k].rep] == k_repacks[k].via_file ? t : k_repacks[k].rep;
}
