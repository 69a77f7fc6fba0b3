/* quant — block formats of weights and activations, and the dot products
 * between them.
 *
 * Owns: the GGML type ids and their block layouts (facts of the GGUF format),
 * dequantisation, quantisation (activations, and `lockstep quantize`), and the
 * row-block matrix kernels that every matmul in lockstep ends in. SIMD variants
 * (AVX-512 VNNI/BF16, AVX2+FMA, scalar) are chosen once at run time: the
 * level of the program's CPU probe (lk_cpu in lk_common.h, which honours
 * LK_SIMD=scalar|avx2|avx512 for tests and benchmarks; lk_quant_init, called
 * implicitly).
 *
 * Activations: a weight of type T is multiplied with activations quantised to
 * lk_type_vec_dot(T) exactly as ggml does (Q8_0 for Q4_0/Q8_0/Q5_0, Q8_1 for
 * Q5_1, Q8_K for the K-quants and IQ4_XS, F16 for F16, BF16 for BF16, F32 for
 * F32), so results track llama.cpp's to rounding noise.
 *
 * Callers: kernels (matmul splits rows across threads and calls
 * lk_quant_matmul on row ranges), model (embedding lookup via dequantize),
 * cli quantize. Pure functions, no state beyond the dispatch table: thread-safe. */
#ifndef LK_QUANT_H
#define LK_QUANT_H

#include "common/lk_common.h"

/* GGML type ids as stored in GGUF tensor infos. */
typedef enum {
    LK_TYPE_F32 = 0, LK_TYPE_F16 = 1, LK_TYPE_Q4_0 = 2, LK_TYPE_Q4_1 = 3,
    LK_TYPE_Q5_0 = 6, LK_TYPE_Q5_1 = 7, LK_TYPE_Q8_0 = 8, LK_TYPE_Q8_1 = 9,
    LK_TYPE_Q2_K = 10, LK_TYPE_Q3_K = 11, LK_TYPE_Q4_K = 12, LK_TYPE_Q5_K = 13,
    LK_TYPE_Q6_K = 14, LK_TYPE_Q8_K = 15,
    LK_TYPE_IQ2_XXS = 16, LK_TYPE_IQ2_XS = 17, LK_TYPE_IQ3_XXS = 18,
    LK_TYPE_IQ1_S = 19, LK_TYPE_IQ4_NL = 20, LK_TYPE_IQ3_S = 21, LK_TYPE_IQ2_S = 22,
    LK_TYPE_IQ4_XS = 23, LK_TYPE_I8 = 24, LK_TYPE_I16 = 25, LK_TYPE_I32 = 26,
    LK_TYPE_I64 = 27, LK_TYPE_F64 = 28, LK_TYPE_IQ1_M = 29, LK_TYPE_BF16 = 30,
    LK_TYPE_TQ1_0 = 34, LK_TYPE_TQ2_0 = 35, LK_TYPE_MXFP4 = 39,
    LK_TYPE_COUNT = 40,   /* the ids a GGUF file may hold are below this */
    /* lockstep's own layouts, made at load (lk_quant_repack), never in a
     * file: the GGUF reader rejects their ids, lk_type_supported is false */
    LK_TYPE_Q4_0_R16 = 40, /* Q4_0, 16 rows interleaved (quant_impl.h) */
    LK_TYPE_Q8_0_R16 = 41, /* Q8_0, 16 rows interleaved, quants + 128 */
    LK_TYPE_Q4_K_R16 = 42, /* Q4_K, Q5_K, Q6_K: 16 rows interleaved 4 bytes */
    LK_TYPE_Q5_K_R16 = 43, /* at a time (quant_impl.h) */
    LK_TYPE_Q6_K_R16 = 44,
    LK_TYPE_F16_R16 = 45,  /* F16, 16 rows interleaved element by element */
    LK_TYPE_BF16_R16 = 46, /* BF16, 16 rows interleaved by pairs of elements */
    LK_TYPE_ALL = 47       /* table size: the file's types and ours */
} lk_type;

/* Layout facts, known for every id above (so the gguf part can size tensors
 * of types we cannot compute with). block_size 0 = unknown id. */
const char *lk_type_name(uint32_t t);          /* "q4_0", or "type#N" for unknown ids */
int64_t     lk_type_block_size(uint32_t t);    /* elements per block; 0 if unknown */
size_t      lk_type_block_bytes(uint32_t t);   /* bytes per block; 0 if unknown */
/* bytes of a row of n elements; false if n is not a whole number of blocks
 * or the type is unknown. */
bool        lk_type_row_bytes(uint32_t t, int64_t n, size_t *out);
/* Can lockstep compute with it (dequantize + matmul)? */
bool        lk_type_supported(uint32_t t);
/* Parse "q8_0", "Q4_K", "f16"... -> id; false if unknown. */
bool        lk_type_from_name(const char *name, lk_type *out);

/* The activation type that matmul with weights of type t expects. */
lk_type lk_type_vec_dot(lk_type t);

/* Row conversions. n must be a whole number of blocks of the type. */
void lk_dequantize_row(lk_type t, const void *src, float *dst, int64_t n);
/* Supported targets: F32, F16, BF16, Q8_0, Q4_0, Q8_K, Q8_1 (activations)
 * and the weight types of `lockstep quantize` (Q4_K, Q5_0, Q5_1, Q2_K, Q3_K,
 * Q5_K, Q6_K); others LK_ASSERT. The algorithms of ggml's reference
 * quantisers (what llama-quantize runs without an importance matrix). */
void lk_quantize_row(lk_type t, const float *src, void *dst, int64_t n);
bool lk_quantize_supported(lk_type t);
/* Activation quantisation, as llama.cpp's x86 build quantises activations
 * before a matmul. Differs from lk_quantize_row (ggml's *reference*
 * quantiser, which llama-quantize uses for weights) only for Q8_0: the SIMD
 * path computes the inverse scale as 127/max|x| (not 1/d) and rounds half to
 * even; matching it keeps Q8_0/Q4_0 logits within 2e-6 of llama.cpp instead of
 * int8 rounding flips of 0.07. Q8_1 (Q5_1's activations) likewise, with
 * s = d*sum(q). Other types delegate to lk_quantize_row. */
void lk_quantize_row_act(lk_type t, const float *src, void *dst, int64_t n);

/* The matrix kernel. W has `nrows` rows of `n` elements of type wt, row r at
 * (char*)w + r*w_stride. A holds `ntok` activation rows of n elements of type
 * lk_type_vec_dot(wt), row t at (char*)a + t*a_stride. Writes
 *   y[t*y_stride + r] = dot(W row r, A row t)   for r < nrows, t < ntok.
 * ntok == 1 is the decode (matrix-vector) case. Single-threaded: the kernels
 * part splits rows across threads. */
void lk_quant_matmul(lk_type wt, int64_t n, int64_t nrows, const void *w, size_t w_stride,
                     int64_t ntok, const void *a, size_t a_stride,
                     float *y, size_t y_stride);

/* Activation terms: what the AVX-512 Q4_0 / Q8_0 kernels (file rows and
 * repacked) derive from Q8_0 activations before multiplying, per token and
 * block: the block's scale as a float, and the weights' offset correction
 * -k * (sum of its 32 quants) (their weights are made unsigned: k = 8 for
 * Q4_0's nibbles, 128 for Q8_0). Exact values: whoever computes them, the
 * products are the same bits. Each call derives them for its tokens; a
 * matrix split over many threads is many calls on the same activations
 * (16 threads x 4 tasks: 64 calls, a fused Q/K/V 3 per task), so the
 * kernels part computes them once per matrix, in the pass that quantises
 * the activations, and hands them to every call (lk_quant_matmul_terms).
 * Layout: K blocks of LK_TERMS_KB blocks, block b of token t at index
 * ((b / LK_TERMS_KB) * ntok + t) * LK_TERMS_KB + b % LK_TERMS_KB of d and
 * corr (the kernels' own K blocking, so they read them in place).
 * k = LK_TERMS_WIDE: the AVX-512 F16_R16 kernel's terms, its F16
 * activations widened to fp32 (`wide`, in the kernel's own token panels:
 * hr_run in quant_avx512.c): widening its tokens itself, a call of 32 rows (16
 * threads x 4 tasks of 2048) ran 64 tokens 17 % slower than one of 2048.
 * k = LK_TERMS_TILES: the AMX-BF16 kernel's terms, its BF16 activations in
 * the tiles its products read (`tiles`: token tile j = tokens 16j..16j+15,
 * K step s = elements 32s..32s+31, at byte 1024 (j * steps + s); row kk
 * holds the pairs 2kk, 2kk+1 of each token, token t at bytes 4 (t % 16);
 * past n and past the last token, zeros): packing them itself, a call of 32
 * rows ran 64 tokens at a third of the rate of one of 2048 (BENCHMARKS.md,
 * thirty-third session). */
enum { LK_TERMS_KB = 256, LK_TERMS_WIDE = 16, LK_TERMS_TILES = 32 };
enum { LK_TERMS_WIDE_T = 12 /* tokens per panel of LK_TERMS_WIDE */ };
typedef struct {
    float   *d;
    int32_t *corr;
    float   *wide;     /* k == LK_TERMS_WIDE */
    uint8_t *tiles;    /* k == LK_TERMS_TILES */
    int64_t  ntok; /* tokens the arrays hold */
    int32_t  k;    /* the offset they were computed for (lk_quant_terms_k), LK_TERMS_WIDE or LK_TERMS_TILES */
} lk_act_terms;
/* The offset k whose terms the active kernel of weight type wt reads (8 or
 * 128), LK_TERMS_WIDE, LK_TERMS_TILES, or 0 if it reads none (other types,
 * levels below AVX-512, CPUs without AMX-BF16 for BF16). */
int32_t lk_quant_terms_k(lk_type wt);
/* Bytes of the terms of kind k for ntok tokens of rows of n elements. */
size_t lk_act_terms_bytes(int32_t k, int64_t n, int64_t ntok);
/* Terms of kind k for ntok tokens of rows of n elements in mem
 * (lk_act_terms_bytes of it, 64-byte aligned), rows not computed yet. */
void lk_act_terms_init(lk_act_terms *T, int32_t k, int64_t n, int64_t ntok, void *mem);
/* Tokens t0..t1-1's terms (t1 <= T->ntok) from their activation rows of n
 * elements, token t0's at a, the next ones as bytes apart: Q8_0 for k = 8
 * and 128, F16 for LK_TERMS_WIDE, BF16 for LK_TERMS_TILES. Ranges of one
 * matrix's tokens may be given by different threads at once. */
void lk_act_terms_rows(const lk_act_terms *T, int64_t t0, int64_t t1, const void *a, size_t as, int64_t n);
/* Whether a token range's terms of kind k lie in lines of their own, so
 * that each thread makes its tokens' terms with their rows
 * (lk_act_terms_rows); false for LK_TERMS_TILES, whose every line holds 16
 * tokens: there, once all the rows are made, nparts threads each make one
 * part of all the tokens' terms (lk_act_terms_part, a: token 0's row),
 * parts that share no line. */
bool lk_act_terms_by_token(int32_t k);
/* A block of a matrix's tokens as terms of their own, for calls on those
 * tokens alone (the kernels part's token blocks: kernels/ops.c). Views are
 * taken where the kind's layout lets a block start, at multiples of
 * lk_act_terms_view_align(k) tokens: LK_TERMS_WIDE_T for LK_TERMS_WIDE (a
 * panel), 0 (no views) for the Q8_0 kinds, whose arrays are strided by the
 * token count, and for LK_TERMS_TILES, whose token blocks were not measured
 * (the AMX-BF16 kernel works pairs of 16-token tiles). lk_act_terms_view:
 * tokens t0..t1-1 of T (rows of n elements; t0 a multiple of the
 * alignment), read in place. */
int64_t lk_act_terms_view_align(int32_t k);
void lk_act_terms_view(const lk_act_terms *T, int64_t t0, int64_t t1, int64_t n, lk_act_terms *out);
void lk_act_terms_part(const lk_act_terms *T, int part, int nparts, const void *a, size_t as, int64_t n);
/* lk_quant_matmul with the terms of all of A's tokens (terms->ntok ==
 * ntok, computed for lk_quant_terms_k(wt)); terms NULL, or a kernel that
 * reads none: lk_quant_matmul. */
void lk_quant_matmul_terms(lk_type wt, int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok,
                           const void *a, size_t a_stride, const lk_act_terms *terms, float *y, size_t y_stride);

/* Repacking at load. A matrix's weights are laid out for the kernels once,
 * when the model is loaded, instead of at every call: Q4_0 becomes
 * Q4_0_R16, Q8_0 Q8_0_R16, Q4_K Q4_K_R16 and so on for Q5_K and Q6_K, each
 * group of 16 rows interleaved block by block (the 16 rows' quants in the
 * lanes, their scales side by side), which is the layout the AVX-512 GEMM
 * packed its panels into on every call and which its decode and few-token
 * kernels read without transposes; the same results bit for bit at every
 * level (levels without a kernel of their own read it back into the file's
 * rows, slowly). F16 becomes F16_R16, interleaved element by element, with
 * an arithmetic of its own that every level computes alike (quant_impl.h);
 * BF16 becomes BF16_R16, interleaved by pairs of elements, on CPUs with
 * AVX512_BF16 and without AMX-BF16, its arithmetic vdpbf16ps's in each
 * row's lane (quant_impl.h).
 * As many bytes as the file's rows (rows past the last whole group stay
 * rows of the file's type). A matrix of R16 must be called on row ranges
 * that start at multiples of 16 from its first row (the kernels part's row
 * splits do).
 *
 * lk_type_repacked: the type a matrix of type t with `rows` rows is best
 * kept in at the active SIMD level (t itself if no repacking pays there:
 * the K-quants by default only on AMD CPUs, nothing with LK_REPACK=0 in the
 * environment, the K-quants on any CPU with LK_REPACK=all); lk_type_file: the file's type of a
 * repacked one (t itself for the file's types). lk_quant_repack: writes
 * `rows` rows of type t (row r at src + r*src_stride) as type rt into dst,
 * rows packed (lk_type_row_bytes apart); rt == t copies.
 * lk_quant_unrepack_row: row r of a repacked matrix (w: its first row, ws:
 * its row bytes) as a row of the file's type into dst. */
lk_type lk_type_repacked(lk_type t, int64_t rows);
lk_type lk_type_file(lk_type t);
void    lk_quant_repack(lk_type rt, lk_type t, int64_t n, int64_t rows, const void *src, size_t src_stride, void *dst);
void    lk_quant_unrepack_row(lk_type rt, int64_t n, const void *w, size_t ws, int64_t r, void *dst);

/* The AVX2 prefill GEMM's tuning choices (quant_gemm_avx2.c): rows per pass
 * (1..4: GEMM on; 0 or -1: off, the register tiles take 2+ tokens, the
 * default: it measured no faster on Zen 3) and tokens per chunk (1..64; 0 =
 * its default). They change speed,
 * never results: tests force each one and compare bits; benchmarks try
 * them. Process-wide. */
void lk_quant_gemm_avx2_force(int rows, int chunk);
void lk_quant_gemm_avx2_get(int *rows, int *chunk);  /* what is forced now */

/* The decode tiles' software prefetch distance, in tiles ahead (0 = none,
 * 1 = the next tile, the default; at most LK_QUANT_PF_MAX; F16_R16 counts
 * 2 KB of each group's stream as a tile). A tuning
 * choice: it changes speed, never results. Process-wide. */
enum { LK_QUANT_PF_MAX = 8 };
void lk_quant_set_prefetch(int tiles);
int  lk_quant_prefetch(void);

/* The repacked Q4_0 / Q8_0 kernels' second prefetch (AVX-512, up to
 * lk_gemm_min_tok_r16() tokens: decode): a 16-row group is one run of bytes,
 * so the hardware sees one stream, and the near prefetch above (a few rows
 * ahead, into L1) may not keep enough lines in flight. This one asks for
 * the bytes `kb` KB ahead into L2 (0 = off; at most LK_QUANT_FAR_MAX; -1,
 * the default: LK_QUANT_FAR_Q4 KB for Q4_0_R16, off for Q8_0_R16). On the
 * 2-core Sapphire Rapids guest 16 KB took TinyLlama Q4_0 decode from 18 to
 * 23 tok/s at one thread (33 to 40-44 at two) and Q8_0's from 11.8-12.1 to
 * 10.7-10.8. A tuning choice: it changes speed, never results.
 * Process-wide. */
enum { LK_QUANT_FAR_Q4 = 16, LK_QUANT_FAR_MAX = 256 };
void lk_quant_set_far(int kb);
int  lk_quant_far(void);

/* From how many tokens the AVX-512 level's Q4_0, Q8_0, Q4_K and Q5_K calls
 * take the packed GEMM instead of the few-token kernels (0 = the default:
 * LK_GEMM_MIN_TOK = 5; repacked at load, 32 for Q4_0 / Q8_0 on AMD CPUs
 * and 16 on others (lk_gemm_min_tok_r16), and lk_gemm_min_tok_kr16 for the K-quants; else
 * LK_QUANT_GEMM_TOK_MIN..MAX, every type). Both give the scalar
 * reference's bits, so it is a tuning choice: speed, never results.
 * Process-wide. */
enum { LK_QUANT_GEMM_TOK_MIN = 5, LK_QUANT_GEMM_TOK_MAX = 32 };
void lk_quant_set_gemm_tok(int ntok);
/* The repacked Q4_0 / Q8_0's default: the GEMM from 32 tokens on AMD CPUs,
 * from 16 on others (quant_impl.h gives the measurements) */
enum { LK_GEMM_MIN_TOK_R16_AMD = 32, LK_GEMM_MIN_TOK_R16_OTHER = 16 };
int lk_gemm_min_tok_r16(void);
int  lk_quant_gemm_tok(void);

/* AMX (Intel Xeons from Sapphire Rapids on): Q4_0 and Q8_0 weights (file
 * rows or repacked) from `ntok` tokens on through AMX-INT8 tile products
 * (quant_gemm_avx512.c): each block's integer sums come out of the tiles
 * exact, and the scalar reference's float work follows in its order, so
 * the results are every other path's bits. lk_quant_set_amx: 0 = never,
 * -1 = the default (LK_AMX_MIN_TOK; the tuner's amx=N, kernels/tune.h),
 * else from ntok tokens (1..1024); lk_quant_amx: that setting.
 * lk_quant_amx_min_tok: the threshold in force, 0 where the CPU or the OS
 * gives no AMX (lk_quant_amx_have); only the AVX-512 level's kernels
 * take it. The default is a prefill's: on the 16-core Xeon (BENCHMARKS.md,
 * fifteenth session) the tiles gained 1.23x on a 512-token prefill at 16
 * threads but lost to the vector kernels on 8 to 32 tokens (decode
 * batches), where the float work per block, not the products, sets the
 * pace.
 * lk_quant_amx_emulate(true): the same kernel with its tile instructions
 * done in C, on any AVX-512 CPU, so that tests check the kernel's data
 * flow where there is no AMX (slow: tests only). Speed, never results.
 * Process-wide. */
enum { LK_AMX_MIN_TOK = 64 };
void lk_quant_set_amx(int ntok);
int  lk_quant_amx(void);
int  lk_quant_amx_min_tok(void);
/* Below that threshold, the repacked Q4_0 / Q8_0 (Q4_0_R16, Q8_0_R16)
 * from `ntok` tokens on through a second AMX kernel made for a few tokens
 * (a server's decode steps): a 16-row group streamed block by block, no
 * panel to pack (quant_gemm_avx512.c, lk_quant_gemm_q4q8_amx_few). On the 2-core
 * Sapphire Rapids guest, one thread, 2048 x 5632 from memory, it ran 16
 * tokens 1.40-1.48x faster than the vector kernels, 24-48 tokens
 * 1.02-1.28x (BENCHMARKS.md, thirty-second session). lk_quant_set_amx_few:
 * 0 = never, -1 = the default (LK_AMX_FEW_MIN_TOK; the tuner's amxf=N),
 * else from ntok tokens (1..1024); lk_quant_amx_few_min_tok: the threshold
 * in force, 0 where there is no AMX (nor emulation). The same
 * bits as every other path. Process-wide. */
enum { LK_AMX_FEW_MIN_TOK = 12 };
void lk_quant_set_amx_few(int ntok);
int  lk_quant_amx_few(void);
int  lk_quant_amx_few_min_tok(void);
bool lk_quant_amx_have(void);
void lk_quant_amx_emulate(bool on);
bool lk_quant_amx_emulating(void);

/* The repacked types' few-token kernels take their token tiles inside
 * each 16-row group (a group's weights from memory once) for calls whose
 * weights pass `bytes`, and one pass over the rows per tile otherwise (the
 * passes after the first read a thread's share from its L2). -1: the
 * default, half the core's L2 (512 KiB where the C library does not say),
 * or LK_ROWS_INNER_KB KiB from the environment. On the 16-core Xeon, 16
 * threads, 8 sequences, the tiles inside the groups for every call ran
 * 0.7x (BENCHMARKS.md, eleventh session). Speed only, never results
 * (tests force both). Process-wide. */
void    lk_quant_set_rows_inner(int64_t bytes);
int64_t lk_quant_rows_inner(void);

/* Rows per decode tile (one token) of the types whose decode goes through
 * the register tiles (F32, F16, BF16, the K-quants; not Q4_0/Q8_0): 4 (the
 * default: the rows share the activation's loads) or 1 (each row streamed
 * alone: on a Zen 5 BF16 decode read 30.7-36.3 GB/s against 20.0-23.4).
 * Every (row, token) takes the same chain in both, so a tuning choice:
 * speed, never results. Process-wide. */
void lk_quant_set_dec_rows(int rows);
int  lk_quant_dec_rows(void);

/* The F16 / BF16 4-row decode tile at the AVX-512 level: its rows loop
 * rolled (1: each row's step loaded, converted and added before the next
 * row's, one prefetch a row) or unrolled (0: the four rows' loads and
 * conversions scheduled together, two prefetches a row). They stream at
 * different speeds per CPU: TinyLlama F16/BF16 one thread, rolled 10-25 %
 * faster on a Zen 5, 10-12 % slower on the Xeon device host (BENCHMARKS.md,
 * sixteenth session). -1 = the default: rolled on AMD CPUs, unrolled
 * elsewhere; lk_quant_dec_roll_setting: that setting, lk_quant_dec_roll:
 * whether rolled is in force. The same chain per (row, token) in both:
 * speed, never results. Process-wide. */
void lk_quant_set_dec_roll(int roll);
int  lk_quant_dec_roll_setting(void);
bool lk_quant_dec_roll(void);

/* Which SIMD level is active: "avx512" (needs AVX-512 F/BW/VL/DQ/VNNI/VBMI
 * and GFNI: Ice Lake, Sapphire Rapids, Zen 4 and later; BF16 used where
 * present), "avx2" (AVX2 + FMA + F16C + BMI1/2) or "scalar". */
const char *lk_quant_simd_name(void);
void        lk_quant_init(void);
/* Switches the active level ("scalar", "avx2", "avx512") for the whole process
 * (tests and benchmarks compare levels); false if unknown or not on this CPU. */
bool        lk_quant_set_simd(const char *level);

#endif
