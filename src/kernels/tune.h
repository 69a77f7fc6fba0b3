/* tune — the kernels' speed settings, chosen per machine.
 *
 * Owns: the process-wide tuning choices that change speed and never
 * results: the decode tiles' prefetch distance (quant), the thread split of
 * a matrix (tasks per pool thread, kernels/ops.c), the rows per decode
 * tile (quant.c), the repacked Q4_0/Q8_0 decode's far prefetch (quant.h) and whether the F16/BF16 one runs its rows loop rolled (quant_avx512.c), the AVX2 prefill GEMM switch (quant_gemm_avx2.c), the token count from which the AVX-512
 * quantised GEMM takes over from the few-token kernels (quant_avx512.c), the one from which Q4_0 / Q8_0
 * go to AMX's tiles (quant_gemm_avx512.c) and whether waiting pool threads prefetch the next product's
 * rows (kernels/pool.c). Every row's arithmetic is the same under each
 * of them (tests/test_tune.c forces each choice and compares bits).
 *
 * How they are chosen (lk_tune_init, once per process, when a model is
 * loaded, before any token): LK_TUNE=off (`--no-tune`) keeps the defaults;
 * LK_TUNE=pf=N,split=N,gemm=R[xC],gtok=N,drows=1|4,droll=0|1,amx=N|off,amxf=N|off,far=KB,hint=0|1 forces settings (the rest default);
 * LK_TUNE=calibrate calibrates whatever the model and the load, and stores
 * the result; otherwise a model whose weights do not exceed the last-level
 * cache keeps the defaults (decode is not memory-bound there, and tests
 * load small models); else the choice cached for this CPU model, build,
 * thread count and matrix type/shape in $XDG_CACHE_HOME/lockstep/tune.txt
 * (or ~/.cache/lockstep/) is applied; else, unless the machine is busy
 * (load average above its CPUs: defaults, nothing cached), a calibration of
 * about 0.1-0.8 s picks one on the model's own matrices of its dominant
 * weight type and its largest layer matrix's shape or the transpose (the
 * first 128-256 MiB of them, past the last-level cache; a synthetic buffer
 * of that type and shape when the model has fewer) and stores it. A cache file that is not ours, or a line that
 * does not parse, is ignored with a note and rewritten.
 *
 * Threading: call from the thread that loads a model; the settings are
 * atomics that kernels read at each call. */
#ifndef LK_TUNE_H
#define LK_TUNE_H

#include "kernels/kernels.h"

typedef struct {
    int pf;          /* decode prefetch distance in tiles, 0..LK_QUANT_PF_MAX (default 1) */
    int split;       /* matmul tasks per pool thread, 1..LK_MATMUL_SPLIT_MAX (default 4) */
    int gemm_rows;   /* AVX2 prefill GEMM rows per pass 1..4, 0 = off (the register tiles) */
    int gemm_chunk;  /* its tokens per chunk 1..64, 0 = its default */
    int gemm_tok;    /* AVX-512 Q4_0/Q8_0/Q4_K/Q5_K GEMM from this many tokens, 5..32; 0 = the default (5) */
    int drows;       /* rows per decode tile of the tiled types (lk_quant_set_dec_rows): 4 (default) or 1 */
    int droll;       /* F16/BF16 4-row decode tile rolled (1) or unrolled (0); -1 = the default, by CPU maker
                        (lk_quant_set_dec_roll) */
    int amx;         /* Q4_0/Q8_0 through AMX's tiles from this many tokens, 1..1024; 0 = off; -1 = the default
                        (LK_AMX_MIN_TOK; lk_quant_set_amx). No effect where the CPU has no AMX. */
    int amxf;        /* the repacked Q4_0/Q8_0 through AMX's few-token kernel from this many tokens (below amx's),
                        1..1024; 0 = off; -1 = the default (LK_AMX_FEW_MIN_TOK; lk_quant_set_amx_few) */
    int far;         /* the repacked Q4_0/Q8_0 decode's second prefetch, KB ahead into L2, 0..LK_QUANT_FAR_MAX;
                        0 = off; -1 = the default, by type (lk_quant_set_far) */
    int hint;        /* pool threads that wait prefetch the next product's rows (1, default) or not (0):
                        lk_pool_set_hints */
} lk_tune_set;

void lk_tune_defaults(lk_tune_set *s);
void lk_tune_apply(const lk_tune_set *s);   /* process-wide */
void lk_tune_get(lk_tune_set *s);           /* what is in force */
/* "pf=2,split=4,gemm=2x32" (any subset; others keep s's values); false and
 * a message naming the bad part otherwise. */
bool lk_tune_parse(const char *spec, lk_tune_set *s, char *err, size_t errlen);
void lk_tune_format(const lk_tune_set *s, char *buf, size_t n);

/* Chooses the settings for a model whose weights are mostly of type t, its
 * typical matrix `rows` x `cols` and `model_bytes` of weights in all, with
 * the threads of pool p (see the header comment). own[0..nown): the model's
 * matrices in decode order (NULL: none); a calibration times those of type
 * t and of that shape or its transpose, from the first, where they add up
 * to its size, else a synthetic buffer of them. Never fails: a problem is a
 * warning and the defaults. */
void lk_tune_init(lk_pool *p, lk_type t, int64_t cols, int64_t rows, uint64_t model_bytes, lk_mat *const *own,
                  int nown);

/* One line: what is in force and why ("calibrated in 212 ms: ...",
 * "cached in FILE", "forced by LK_TUNE", "defaults: ..."). */
const char *lk_tune_report(void);

/* The calibration itself, on a synthetic matrix of `bytes` bytes (tests call
 * it with a small one), or on the matrices mats[0..nm) (all of one type):
 * applies and returns the choice, fills `report`. */
void lk_tune_calibrate(lk_pool *p, lk_type t, int64_t cols, int64_t rows, size_t bytes, lk_tune_set *out,
                       char *report, size_t n);
void lk_tune_calibrate_mats(lk_pool *p, const lk_mat *mats, int nm, lk_tune_set *out, char *report, size_t n);

#endif
