/* quant_impl — private to src/quant/: block layouts as byte offsets, the
 * dispatch table that the scalar, AVX2 and AVX-512 files fill, and small
 * helpers. Nobody outside src/quant/ includes this.
 *
 * Blocks are addressed as bytes, never through structs: rows of a GGUF tensor
 * start wherever the file puts them and callers may hand us odd addresses, so
 * every multi-byte field is read with memcpy (one plain load after -O2). */
#ifndef LK_QUANT_IMPL_H
#define LK_QUANT_IMPL_H

#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "quant/quant.h"

#define LK_QK   32   /* elements per Q4_0 / Q8_0 block */
#define LK_QK_K 256  /* elements per K-quant super-block */

/* Byte layouts (GGML):
 *   Q4_0 (18 B):  fp16 d | u8 qs[16]          x[j] = d*((qs[j]&15)-8), x[j+16] = d*((qs[j]>>4)-8)
 *   Q8_0 (34 B):  fp16 d | i8 qs[32]          x[j] = d*qs[j]
 *   Q4_K (144 B): fp16 d | fp16 dmin | u8 scales[12] | u8 qs[128]
 *   Q5_K (176 B): fp16 d | fp16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
 *   Q6_K (210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | fp16 d
 *   Q8_K (292 B): f32 d | i8 qs[256] | i16 bsums[16]   (bsums: sums of 16 qs) */
enum {
    LK_Q40_BYTES = 18, LK_Q80_BYTES = 34,
    LK_Q4K_BYTES = 144, LK_Q5K_BYTES = 176, LK_Q6K_BYTES = 210, LK_Q8K_BYTES = 292,
    LK_Q4K_SC = 4, LK_Q4K_QS = 16,
    LK_Q5K_SC = 4, LK_Q5K_QH = 16, LK_Q5K_QS = 48,
    LK_Q6K_QL = 0, LK_Q6K_QH = 128, LK_Q6K_SC = 192, LK_Q6K_D = 208,
    LK_Q8K_QS = 4, LK_Q8K_BS = 260,
};

/* Q4_0_R16 and Q8_0_R16 (lockstep's, made at load): a group of 16 rows of
 * nb blocks takes the bytes of its 16 file rows, by pairs of blocks so that
 * every vector is 64-byte aligned when the group is. A block's quants are
 * QB = 256 (Q4_0) or 512 (Q8_0) bytes, vectors of 64: bytes 4r..4r+3 of
 * vector k are row r's qs[4k..4k+3] (Q4_0: low nibbles quants 4k.., high
 * nibbles 16+4k..; Q8_0: quants 4k.., each + 128 so that they are the
 * unsigned operand of vpdpbusd as they are). Pair j (blocks 2j, 2j+1) at
 * byte j (2 QB + 64) holds the quants of block 2j, those of block 2j+1, the
 * 16 fp16 scales of 2j (32 B), those of 2j+1 (32 B); a last block without a
 * pair follows: its quants, then its scales. lk_r16_at: where block b's
 * quants (*q) and scales (*d) start. */
enum { LK_R16_ROWS = 16 };
static inline size_t lk_r16_qbytes(bool q8) { return q8 ? 512 : 256; }
static inline void lk_r16_at(bool q8, int64_t b, int64_t nb, size_t *q, size_t *d) {
    const size_t qb = lk_r16_qbytes(q8), j = (size_t)b >> 1, e = (size_t)b & 1;
    const bool paired = (b | 1) < nb;
    *q = (2 * qb + 64) * j + (paired ? qb * e : 0);
    *d = (2 * qb + 64) * j + (paired ? 2 * qb + 32 * e : qb);
}

/* F16_R16 (lockstep's, made at load where a kernel reads it: AVX-512): a
 * group of 16 rows of n elements takes the bytes of its 16 file rows,
 * element k of row i at byte 2 (16 k + i): each 32 bytes are one element
 * of the 16 rows. Its arithmetic is its own, not F16 rows': each row's
 * products fused into one fp32 sum from element 0 on, for any token count
 * (lk_quant_f16r16_seq, the scalar code every level without a kernel of its
 * own runs; the AVX-512 tiles do the same operations 16 rows at a time).
 * Rows past the last whole group are F16 rows. */
void lk_quant_f16r16_seq(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                         float *y, size_t ys);

/* BF16_R16 (lockstep's, made at load where a kernel reads it: AVX-512 with
 * AVX512_BF16, not AMX-BF16): a group of 16 rows of n elements takes the
 * bytes of its 16 file rows, elements 2j and 2j + 1 of row i at byte
 * 4 (16 j + i): each 64 bytes are one pair of the 16 rows, what vdpbf16ps
 * takes with row i in lane i. An odd last element of row i sits at byte
 * 64 (n / 2) + 2 i. Its arithmetic is vdpbf16ps's in that lane: each
 * row's sum from zero, pair by pair, for any token count
 * (lk_quant_bf16r16_seq, the scalar code of every level without the
 * kernel). Rows past the last whole group are BF16 rows. */
void lk_quant_bf16r16_seq(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                          float *y, size_t ys);

/* Q4_K_R16, Q5_K_R16, Q6_K_R16 (lockstep's, made at load): a group of 16
 * rows of nb super-blocks takes the bytes of its 16 file rows, each
 * super-block's bytes 4 at a time, the 16 rows side by side: vector k (64 B)
 * of a super-block holds bytes 4k..4k+3 of rows 0..15 (row r at 4r), for all
 * of Q4_K's 144 and Q5_K's 176 bytes (36 and 44 vectors: d and dmin in
 * vector 0, the 12 bytes of scales and mins in 1-3, then Q5_K's qh, then the
 * quants), so super-block s starts at 16 * bb * s. Q6_K's 210 bytes end in a
 * 2-byte d: its first 208 bytes so (52 vectors: ql, qh, scales), the 16 d
 * (32 B) apart, by pairs of super-blocks as lk_r16_at places Q4_0's blocks,
 * so that every vector stays 64-byte aligned. lk_kr16_at (bb: the file's
 * bytes per super-block): where super-block b's vectors (*q) and, for
 * Q6_K, its 16 d (*d) start. */
static inline void lk_kr16_at(size_t bb, int64_t b, int64_t nb, size_t *q, size_t *d) {
    if (bb % 4 == 0) {
        *q = 16 * bb * (size_t)b, *d = 0;
        return;
    }
    const size_t qb = 16 * (bb - 2), j = (size_t)b >> 1, e = (size_t)b & 1;
    const bool paired = (b | 1) < nb;
    *q = (2 * qb + 64) * j + (paired ? qb * e : 0);
    *d = (2 * qb + 64) * j + (paired ? 2 * qb + 32 * e : qb);
}

/* The types of quant_q5.c and quant_k23.c (what big MoE files use):
 *   Q5_0 (22 B):   fp16 d | u8 qh[4] | u8 qs[16]     q_j = (qs[j]&15) | bit j of qh << 4,
 *                  q_{j+16} = (qs[j]>>4) | bit j+16 of qh << 4 (qh little-endian u32); x = d*(q-16)
 *   Q5_1 (24 B):   fp16 d | fp16 m | u8 qh[4] | u8 qs[16]   q as Q5_0, x = d*q + m
 *   Q8_1 (36 B):   fp16 d | fp16 s | i8 qs[32]      x = d*q; s = d*sum(q) (Q5_1's activations)
 *   Q2_K (84 B):   u8 scales[16] | u8 qs[64] | fp16 d | fp16 dmin   16 sub-blocks of 16: scale
 *                  low nibble, min high nibble; element 128n+32j+l = (qs[32n+l] >> 2j) & 3;
 *                  x = d*sc*q - dmin*m
 *   Q3_K (110 B):  u8 hmask[32] | u8 qs[64] | u8 scales[12] | fp16 d   low 2 bits as Q2_K, bit
 *                  e/32 of hmask[e%32] set: +0, clear: -4; 16 signed 6-bit scales (-32)
 *   IQ4_XS (136 B): fp16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]   8 sub-blocks of 32,
 *                  6-bit scales (-32), 4-bit indices into the IQ4_NL table (lk_iq4nl_values) */
enum {
    LK_Q50_BYTES = 22, LK_Q51_BYTES = 24, LK_Q81_BYTES = 36,
    LK_Q2K_BYTES = 84, LK_Q2K_QS = 16, LK_Q2K_D = 80,
    LK_Q3K_BYTES = 110, LK_Q3K_QS = 32, LK_Q3K_SC = 96, LK_Q3K_D = 108,
    LK_IQ4XS_BYTES = 136, LK_IQ4XS_SH = 2, LK_IQ4XS_SL = 4, LK_IQ4XS_QS = 8,
};

/* Round half to even, as ggml's nearest_int (the 1.5*2^23 trick) on every
 * value its quantisers give it. NaN and values outside int's range give
 * INT_MIN, as x86's cvttss2si (what a plain cast compiles to) and vcvtps2dq
 * do: defined in C, and the same in the AVX2 twins of the quantisers'
 * searches, which convert 8 lanes with vcvtps2dq. */
static inline int lk_nearest(float f) {
    /* |f| < 2^22 (all the quantisers' levels): adding 1.5 * 2^23 rounds f to
     * an integer in the current rounding mode, as nearbyintf does, and
     * taking it away again is exact (a libm call saved per element) */
    if (fabsf(f) < 4194304.f) return (int)((f + 12582912.f) - 12582912.f);
    f = nearbyintf(f);
    return f >= -2147483648.f && f < 2147483648.f ? (int)f : INT_MIN;
}

static inline uint16_t lk_ld_u16(const void *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline int16_t  lk_ld_i16(const void *p) { int16_t v; memcpy(&v, p, 2); return v; }
static inline int32_t  lk_ld_i32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline float    lk_ld_f32(const void *p) { float v; memcpy(&v, p, 4); return v; }
static inline float    lk_ld_h(const void *p) { return lk_fp16_to_fp32(lk_ld_u16(p)); }

#if defined(__SSE2__)
#include <emmintrin.h>
/* The K-quants' float work of one super-block for 4 (row, token) pairs in
 * the lanes, in the scalar reference's order (dot_k45 / dot_q6_k in
 * quant.c): s + ((d*da)*(float)sumi - (dmin*da)*(float)summ); Q6_K (q6):
 * s + (d*da)*(float)sumi. The AVX2 and AVX-512 K-quant kernels all finish
 * a super-block with it, so they give the scalar code's bits (inlined into
 * their target-specific code, so the instructions are theirs). */
static inline __attribute__((always_inline)) __m128 lk_kq_fin4(bool q6, __m128i sumi, __m128i summ, __m128 d,
                                                                __m128 dmin, __m128 da, __m128 s) {
    __m128 x = _mm_mul_ps(_mm_mul_ps(d, da), _mm_cvtepi32_ps(sumi));
    if (!q6) x = _mm_sub_ps(x, _mm_mul_ps(_mm_mul_ps(dmin, da), _mm_cvtepi32_ps(summ)));
    return _mm_add_ps(s, x);
}
#endif

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block,
 * packed in 12 bytes: j < 4 in the low 6 bits of bytes j (scale) and j+4
 * (min); j >= 4 in the nibbles of bytes j+4 plus the top 2 bits of bytes j-4
 * (scale) and j (min). */
static inline void lk_k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m  = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m  = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* The decode tiles' software prefetch distance in tiles (0: none; see
 * lk_quant_set_prefetch): a relaxed load per prefetch call, which the
 * kernels' pf_range make once per block. */
extern _Atomic int lk_quant_pf_g;
static inline int lk_quant_pf_tiles(void) { return atomic_load_explicit(&lk_quant_pf_g, memory_order_relaxed); }
/* lk_quant_set_far's distance for Q4_0_R16 or Q8_0_R16, in bytes */
extern _Atomic int lk_quant_far_g;
static inline size_t lk_quant_far_bytes(bool q8) {
    const int kb = atomic_load_explicit(&lk_quant_far_g, memory_order_relaxed);
    return (size_t)(kb >= 0 ? kb : q8 ? 0 : LK_QUANT_FAR_Q4) << 10;
}
/* The row-group kernels' prefetch (quant_q4q8_avx2.c, the AVX-512 rows
 * kernel): each time a group of nr rows has read another 64 bytes of its
 * rows (pos: bytes read so far in each; *next: the next 64-byte mark), the
 * same line of each row `pf` bytes below (the group d ahead) into L1; pf 0:
 * none. */
static inline void lk_quant_pf_group(const uint8_t *w, size_t ws, int nr, size_t pf, size_t pos, size_t *next) {
    if (!pf || pos < *next) return;
    for (int r = 0; r < nr; r++) __builtin_prefetch(w + (size_t)r * ws + pf + *next, 0, 3);
    *next += 64;
}

/* One matrix kernel: the contract of lk_quant_matmul for one weight type. */
typedef void (*lk_qmm_fn)(int64_t n, int64_t nrows, const void *w, size_t w_stride,
                          int64_t ntok, const void *a, size_t a_stride,
                          float *y, size_t y_stride);
/* One row quantiser (activations): n is a whole number of blocks. */
typedef void (*lk_qrow_fn)(const float *src, void *dst, int64_t n);

/* The same with the activations' terms (lk_act_terms, quant.h; never NULL):
 * the kernels that read them. */
typedef void (*lk_qmm_terms_fn)(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok,
                                const void *a, size_t a_stride, const lk_act_terms *terms, float *y,
                                size_t y_stride);

typedef struct {
    const char *name;
    lk_qmm_fn   mm[LK_TYPE_ALL];      /* by weight type; NULL = not provided */
    lk_qmm_terms_fn mm_terms[LK_TYPE_ALL]; /* by weight type: mm[]'s twin that reads terms; NULL: none */
    lk_qrow_fn  quant[LK_TYPE_ALL];   /* by target type; NULL = not provided */
    lk_qrow_fn  act[LK_TYPE_ALL];   /* activation quantisers where they differ from quant[] (NULL: quant[]) */
    /* lk_act_terms_rows at this level: set wherever mm_terms has an entry */
    void (*terms_rows)(const lk_act_terms *T, int64_t t0, int64_t t1, const void *a, size_t as, int64_t n);
    /* lk_act_terms_part for the kinds made by parts (lk_act_terms_by_token false) */
    void (*terms_part)(const lk_act_terms *T, int part, int nparts, const void *a, size_t as, int64_t n);
} lk_quant_ops;

/* The scalar dot product of one weight row with one activation row (n
 * elements): SIMD kernels use it for the blocks left over after their
 * unrolled groups. */
float lk_quant_dot_scalar(lk_type t, int64_t n, const void *w, const void *a);
/* sum_j w[j] * a[j] over 32 signed bytes (a Q8_0 block's integer dot), for
 * the SIMD files' scalar tails. It lives in quant.c, compiled without
 * AVX512-VNNI, because GCC 12 vectorises this very loop in a function
 * targeted at AVX512-VNNI into vpdpbusd, which multiplies *unsigned* by
 * signed bytes: wrong for any negative weight. */
int32_t lk_q8_dot32(const int8_t *w, const int8_t *a);

/* Register-tile kernels and the driver that walks a matrix with them.
 * A tile computes y[t*ys + r] for r < R rows and t < T tokens over the whole
 * row length n (w: first row, ws: row stride; a: first token, as: stride). */
typedef void (*lk_tile_fn)(int64_t n, const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                           float *y, size_t ys);
typedef struct {
    lk_tile_fn dec4, dec1;   /* decode: 4 rows x 1 token, 1 row x 1 token */
    int        r_pf, t_pf;   /* prefill tile shape: r_pf rows (1..4) x t_pf tokens (1..6) */
    lk_tile_fn pf[2][7];     /* [r_pf rows or 1 row][1..t_pf tokens] */
} lk_tileset;
/* lk_quant_matmul over tiles: decode walks 4 rows at a time; prefill takes
 * tokens in chunks that stay in L2 (64) and covers each chunk with
 * r_pf x t_pf tiles (so each weight group is decoded once per t_pf tokens
 * and read from memory once per chunk). */
void lk_quant_run_tiles(const lk_tileset *ts, int64_t n, int64_t nrows, const void *w, size_t ws,
                        int64_t ntok, const void *a, size_t as, float *y, size_t ys);

/* Each SIMD file fills the entries it accelerates over a copy of the scalar
 * table, so a level with a missing kernel falls back to the scalar one. */
void lk_quant_fill_scalar(lk_quant_ops *ops);
/* The scalar F16 / BF16 row converters (lk_fp32_to_fp16 / lk_fp32_to_bf16
 * value by value): the scalar level's, and the SIMD converters' tails and
 * groups with a NaN. */
void lk_quant_f16_rows(const float *x, void *dst, int64_t n);
void lk_quant_bf16_rows(const float *x, void *dst, int64_t n);
void lk_quant_fill_avx2(lk_quant_ops *ops);
void lk_quant_fill_avx512(lk_quant_ops *ops);

/* quant_q4q8_avx2.c: the AVX2 level's Q4_0 and Q8_0 kernels, rows in
 * lanes, in the scalar reference's arithmetic; from LK_Q40_GEMM_TOK tokens on
 * a GEMM over panels packed once per 64 tokens (below, register tiles). */
enum { LK_Q40_GEMM_TOK = 5 };
void lk_quant_mm_q40_avx2(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a,
                          size_t as, float *y, size_t ys);
void lk_quant_mm_q80_avx2(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a,
                          size_t as, float *y, size_t ys);

/* The layouts that the AVX-512 Q4_0 / Q8_0 kernels below read (`fmt`):
 * Q4_0 rows, Q8_0 rows, Q4_0_R16 or Q8_0_R16 (their whole groups; rows
 * past them are rows of the file's type). */
enum { LK_FMT_Q40 = 0, LK_FMT_Q80 = 1, LK_FMT_R16 = 2, LK_FMT_Q8R16 = 3 };
static inline bool lk_fmt_q8(int fmt) { return fmt == LK_FMT_Q80 || fmt == LK_FMT_Q8R16; }
static inline bool lk_fmt_r16(int fmt) { return fmt >= LK_FMT_R16; }

/* quant_gemm_avx512.c: lk_quant_matmul for Q4_0, Q8_0 or Q4_0_R16 (fmt)
 * weights over many tokens (prefill) as a packed-panel GEMM; the AVX-512
 * table uses it from LK_GEMM_MIN_TOK tokens on (below that the register
 * tiles win: packing is paid per call). Crossovers measured with bench_quant
 * (weights from memory): Q4_0 4 tokens tiles 82 / GEMM 67 GFLOP/s, 5 tokens
 * 73 / 79; Q8_0, Q4_K, Q5_K already win at 5; Q6_K 5 tokens 76 / 58, 8
 * tokens 82 / 83, 12 tokens 95 / 117. (Float weights take the register
 * tiles for every token count: quant_avx512.c says why.) */
enum { LK_GEMM_MIN_TOK = 5, LK_GEMM_MIN_TOK_Q6K = 10 };
/* The repacked Q4_0 / Q8_0 (q4_0_r16, q8_0_r16) read 16 rows in the lanes
 * without transposes, so their few-token kernel stays ahead of the GEMM for
 * longer: a Zen 5, 2 threads, TinyLlama shape, `bench --seqs 8` 212-217 ->
 * 244-245 tok/s (Q4_0) and 119-123 -> 168-211 (Q8_0) with the GEMM from 16
 * tokens instead of 5; 12 sequences 2-7 % ahead. (A tuned gtok applies to
 * them too.) Since that kernel takes up to 16 tokens per row group (the
 * group's weights from memory once), it leads to about 24 tokens: 16
 * sequences of that bench (BENCHMARKS.md, eleventh session). On the Xeons
 * the GEMM leads sooner: 1.13x at 16 tokens on the 16-core host (eleventh
 * session); on the 2-core Sapphire Rapids guest, one thread, 2048 x 5632
 * from memory, Q4_0_R16 level at 16 and the GEMM 1.16x at 24, Q8_0_R16 the
 * GEMM 1.06x at 16 and 1.46x at 24, and the 2-rank cluster's 16-sequence
 * steps 2-7 % faster (thirty-second session). So the default goes by the
 * CPU's maker, as the K-quants' repacking does: AMD from 32 tokens, others
 * from 16 (lk_gemm_min_tok_r16, quant.h). */
/* The repacked K-quants' few-token kernel, per type (4: Q4_K, 5: Q5_K, 6:
 * Q6_K). It took its token tiles (4 tokens) outside the row groups, so
 * every 4 tokens read the whole matrix from memory again, and the GEMM led
 * from 8 tokens. With the tiles inside each group (the group's weights
 * from memory once), bench_quant's alternating passes (2048 x 5632 from
 * memory, one Zen 5 thread, BENCHMARKS.md eleventh session) put the
 * crossings at about 18 tokens for Q4_K (rows kernel 1.06x at 16, GEMM
 * 1.02x at 20) and 28 for Q6_K (1.03x at 24, GEMM 1.06x at 32); Q5_K's
 * GEMM leads from 8 (1.10x). */
static inline int lk_gemm_min_tok_kr16(int kind) { return kind == 4 ? 18 : kind == 6 ? 28 : 8; }
void lk_quant_gemm_q4q8_avx512(int fmt, int64_t n, int64_t nrows, const void *w, size_t ws,
                               int64_t ntok, const void *a, size_t as, const lk_act_terms *terms, float *y,
                               size_t ys);
/* The same product through AMX-INT8 tiles (lk_quant_set_amx), any token
 * count, the same bits; emu: the tile instructions emulated in C
 * (lk_quant_amx_emulate). Reads the scales of `terms` (any offset). */
void lk_quant_gemm_q4q8_amx(bool emu, int fmt, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                            const void *a, size_t as, const lk_act_terms *terms, float *y, size_t ys);
/* The repacked Q4_0 / Q8_0 (fmt LK_FMT_R16 / LK_FMT_Q8R16) through AMX-INT8
 * tiles a 16-row group at a time, for a few tokens: the same bits. Takes
 * calls whose rows are whole groups and whose ntok x blocks scales fit
 * LK_AMX_FEW_SCALES (lk_quant_amx_few_fits). */
enum { LK_AMX_FEW_SCALES = 16384 };
bool lk_quant_amx_few_fits(int64_t n, int64_t nrows, int64_t ntok);
void lk_quant_gemm_q4q8_amx_few(bool emu, int fmt, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                      const void *a, size_t as, const lk_act_terms *terms, float *y, size_t ys);
/* BF16 weights and activations through AMX-BF16 tiles, any token count:
 * this path's own bits, the same for every token count (decode and
 * prefill agree); emu: the tile instructions emulated in C, their own
 * bits again (tests only). terms: the activations already in their tiles
 * (k == LK_TERMS_TILES, for all ntok tokens; NULL or another kind: packed
 * by the call). */
void lk_quant_bf16_amx(bool emu, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a,
                       size_t as, const lk_act_terms *terms, float *y, size_t ys);
/* lk_act_terms_rows and lk_act_terms_part for LK_TERMS_TILES: BF16 rows
 * into their tiles */
void lk_act_terms_rows_bf16_tiles(const lk_act_terms *T, int64_t t0, int64_t t1, const void *a, size_t as,
                                  int64_t n);
void lk_act_terms_part_bf16_tiles(const lk_act_terms *T, int part, int nparts, const void *a, size_t as, int64_t n);
/* token t's terms (lk_act_terms_rows) with the GEMM's own derivation */
void lk_act_terms_row_avx512(const lk_act_terms *T, int64_t t, const void *a, int64_t n);
/* The same layouts below LK_GEMM_MIN_TOK tokens (tiles of up to
 * 6 tokens, any ntok), rows in lanes: the GEMM's bits, which are the scalar
 * reference's. Both read `terms` (NULL: derived per call) when they were
 * computed for their offset (8: Q4_0, 128: Q8_0), else derive them. */
void lk_quant_q4q8_rows_avx512(int fmt, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                               const void *a, size_t as, const lk_act_terms *terms, float *y,
                               size_t ys);
/* The repacked K-quants (kind 4, 5, 6: Q4_K_R16, Q5_K_R16, Q6_K_R16): the
 * GEMM below with its packing from the stored groups (rows past the last
 * whole group are the file type's rows), and the few-token kernel, 16 rows
 * in the lanes as stored (whole groups only: nrows a multiple of 16). Both
 * give the file type's GEMM's bits. */
void lk_quant_gemm_kr16_avx512(int kind, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                               const void *a, size_t as, float *y, size_t ys);
void lk_quant_kr16_rows_avx512(int kind, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                               const void *a, size_t as, float *y, size_t ys);
/* The same for Q4_K, Q5_K and Q6_K weights (Q8_K activations). */
void lk_quant_gemm_q4k_avx512(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                              const void *a, size_t as, float *y, size_t ys);
void lk_quant_gemm_q5k_avx512(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                              const void *a, size_t as, float *y, size_t ys);
void lk_quant_gemm_q6k_avx512(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                              const void *a, size_t as, float *y, size_t ys);
/* quant_gemm_avx2.c: lk_quant_matmul for Q4_K / Q5_K / Q6_K (kind 4, 5, 6)
 * weights over 2+ tokens on AVX2, with the decode kernels' bits for every
 * (row, token) (the AVX2 level is batch invariant). Its tuning choices:
 * lk_quant_gemm_avx2_force (quant.h); lk_quant_gemm_avx2_on: false unless
 * forced on (the register tiles take 2+ tokens by default). */
bool lk_quant_gemm_avx2_on(void);
void lk_quant_gemm_kq_avx2(int kind, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                           const void *a, size_t as, float *y, size_t ys);

/* quant_act.c: Q8_0 activations as llama.cpp's x86 kernels make them (round
 * half to even; quant[Q8_0] rounds half away from zero, as llama-quantize). */
void lk_act_q8_0_scalar(const float *x, void *dst, int64_t n);
void lk_act_q8_0_avx512(const float *x, void *dst, int64_t n);
void lk_act_q8_k_avx512(const float *x, void *dst, int64_t n);

/* quant_kq.c: the scale search of the K-quants with a min (ggml's
 * make_qkx2_quants): x ~ scale * L + min (min <= 0), L in [0, nmax], the
 * weighted squared error (absolute with use_mad: Q2_K) minimised over the
 * grid of nstep + 1 candidate inverse scales (nmax + rmin + rdelta * i) /
 * (max - min). n <= 32, nstep <= 24. Returns the scale, -min in *neg_min.
 * The AVX2 twin tries 8 candidates at a time and returns the same bits. */
typedef struct {
    int   nmax, nstep;
    float rmin, rdelta;
    bool  use_mad;
} lk_kfit;
typedef float (*lk_kfit_fn)(const lk_kfit *p, int n, const float *x, const float *w, uint8_t *L, float *neg_min);
float lk_kfit_scale_min(const lk_kfit *p, int n, const float *x, const float *w, uint8_t *L, float *neg_min);
float lk_kfit_scale_min_avx2(const lk_kfit *p, int n, const float *x, const float *w, uint8_t *L, float *neg_min);
/* L[i] = clamp(lk_nearest((x[i] + dm) / d), 0, nmax) for i < n (a multiple
 * of 8): a sub-block's levels against its final scale d and min -dm. */
typedef void (*lk_klevels_fn)(const float *x, int n, float dm, float d, int nmax, uint8_t *L);
void lk_klevels(const float *x, int n, float dm, float d, int nmax, uint8_t *L);
void lk_klevels_avx2(const float *x, int n, float dm, float d, int nmax, uint8_t *L);
/* A level's search and levels: scalar, or the AVX2 twins (the same bytes). */
typedef struct {
    lk_kfit_fn    fit;
    lk_klevels_fn levels;
} lk_kq_impl;
extern const lk_kq_impl lk_kq_scalar, lk_kq_avx2;
/* ggml's reference Q4_K and Q5_K quantisers (weights); the _avx2 ones give
 * the same bytes through the _avx2 search and levels (AVX2 level and up). */
void lk_quantize_row_q4_k(const float *x, void *dst, int64_t n);
void lk_quantize_row_q4_k_avx2(const float *x, void *dst, int64_t n);
void lk_quantize_row_q5_k(const float *x, void *dst, int64_t n);
void lk_quantize_row_q5_k_avx2(const float *x, void *dst, int64_t n);

/* quant_q5.c (Q5_0, Q5_1, Q8_1) and quant_k23.c (Q2_K, Q3_K, IQ4_XS; the
 * Q6_K weight quantiser the Q2_K/Q3_K mixes need): their
 * dequantisers and scalar dots (false: not one of the file's types), and
 * the entries they add to each level's table. */
bool lk_q5_dequantize(lk_type t, const uint8_t *src, float *dst, int64_t nb);
bool lk_q5_dot_scalar(lk_type t, int64_t n, const uint8_t *w, const uint8_t *a, float *out);
void lk_q5_fill_scalar(lk_quant_ops *ops);
void lk_q5_fill_avx2(lk_quant_ops *ops);
void lk_q5_fill_avx512(lk_quant_ops *ops);
bool lk_k23_dequantize(lk_type t, const uint8_t *src, float *dst, int64_t nb);
bool lk_k23_dot_scalar(lk_type t, int64_t n, const uint8_t *w, const uint8_t *a, float *out);
void lk_k23_fill_scalar(lk_quant_ops *ops);
void lk_k23_fill_avx2(lk_quant_ops *ops);
void lk_k23_fill_avx512(lk_quant_ops *ops);

#endif
