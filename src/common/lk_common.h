/* lk_common — what every part shares: status codes, error messages, logging,
 * clocks and checked arithmetic.
 *
 * Two kinds of failure (STYLE.md):
 *   - a bug (broken invariant) -> LK_ASSERT, which aborts with file and line;
 *   - anything from outside (file, peer, client, flag) -> a status returned to
 *     the caller plus a one-line message written into the caller's
 *     `char *err, size_t errlen` buffer naming what was wrong.
 * Process-wide singletons only: the log level and the CPU probe. Everything
 * is thread-safe. */
#ifndef LK_COMMON_H
#define LK_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

typedef enum {
    LK_OK = 0,
    LK_ERR_ARG,         /* bad flag or argument */
    LK_ERR_IO,          /* open/read/write/mmap failed */
    LK_ERR_FORMAT,      /* malformed input (file, frame, body) */
    LK_ERR_UNSUPPORTED, /* well-formed but not implemented (arch, type) */
    LK_ERR_NOMEM,
    LK_ERR_NET,         /* connect/send/recv failed, peer closed */
    LK_ERR_AUTH,        /* handshake refused */
    LK_ERR_MISMATCH,    /* version / model / config disagreement */
    LK_ERR_TIMEOUT,     /* a deadline passed */
    LK_ERR_PEER,        /* the peer reported an error */
} lk_status;

const char *lk_status_to_string(lk_status s);

#define LK_ERRLEN 512

/* Writes a formatted message into err (if non-NULL) and returns `st`, so a
 * caller can write `return lk_fail(err, errlen, LK_ERR_IO, "open %s: %s", ...)`. */
lk_status lk_fail(char *err, size_t errlen, lk_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Bugs only. Never for input validation. */
#define LK_ASSERT(c) \
    do { if (!(c)) lk_assert_fail(#c, __FILE__, __LINE__); } while (0)
_Noreturn void lk_assert_fail(const char *expr, const char *file, int line);

/* Logging to stderr. Level: 0 error, 1 warn, 2 info (default), 3 debug. */
enum { LK_LOG_ERROR = 0, LK_LOG_WARN = 1, LK_LOG_INFO = 2, LK_LOG_DEBUG = 3 };
void lk_log_set_level(int level);
int  lk_log_level(void);
void lk_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Text from outside (a GGUF string, a tensor name) made safe to print on a
 * terminal, by the rule peer text already follows (printable, no escapes):
 * valid UTF-8 is kept; control characters (C0, DEL and the C1 range
 * U+0080..U+009F, which some terminals obey as escapes too) and bytes that
 * are not valid UTF-8 are written as \xNN, so ESC [2J prints as the 7
 * characters \x1b[2J (newline and tab as \n and \t, the backslash itself as
 * \\, so the text reads back unambiguously). Writes a
 * NUL-terminated string of at most outlen-1 bytes (outlen > 0), never
 * cutting an escape or a character, and returns the number of input bytes
 * it covers (n when everything fit). */
size_t lk_str_sanitize(char *out, size_t outlen, const void *s, size_t n);

/* ---- what this process may use (limits.c) ----------------------------------
 * Memory it can still get, in bytes (0 if unknown): MemAvailable from
 * /proc/meminfo, capped by the room under a cgroup memory limit (limit less
 * usage, inactive file cache counted free; v1 or v2, any ancestor) and by
 * RLIMIT_AS less the address space in use. Inside a container MemAvailable
 * is the host's: the cap is what keeps a KV cache from the OOM killer.
 * LK_MEM_AVAILABLE=N[K|M|G] caps it further: a node rehearsing a smaller
 * one (and doctor's test of a node short of memory). */
uint64_t lk_mem_available(void);

/* CPUs: cpus = those of the affinity mask (sched_getaffinity: taskset, a
 * cpuset), cores = distinct physical cores among them (SMT siblings count
 * once), quota = a cgroup CPU quota in CPUs (0: none), threads = the
 * default thread count: cores, at most the whole CPUs of the quota, >= 1.
 * Physical cores because decoding is memory-bound and an SMT sibling adds
 * little but a second thread to wait for at every barrier; a busy machine
 * then slows a step by one core's share, not by a descheduled thread. */
typedef struct { int cpus, cores, threads; double quota; } lk_cpu_budget;
void lk_cpu_budget_get(lk_cpu_budget *b);
int  lk_threads_default(void);   /* lk_cpu_budget's threads */
int  lk_cpus_usable(void);       /* cpus, at most the quota rounded up */
/* "2 threads (default: 2 physical cores of the 2 CPUs this process may run
 * on)", "1 thread per rank x 2 local ranks (...)" or "... (-t 4)": the line
 * every command prints at start. */
void lk_threads_describe(int threads, int ranks, bool given, char *buf, size_t len);

/* Monotonic clock. */
double   lk_time_s(void);
uint64_t lk_time_ns(void);

/* malloc that aborts on failure — only for sizes the program itself decided
 * (never a size read from input: validate first, then allocate). */
void *lk_xmalloc(size_t n);
void *lk_xcalloc(size_t n, size_t sz);
void *lk_xrealloc(void *p, size_t n);
char *lk_xstrdup(const char *s);
/* A growable byte buffer, always NUL-terminated after its n bytes once
 * anything was put (p is NULL until then); free(b.p) frees it. */
typedef struct { char *p; size_t n, cap; } lk_buf;
void lk_buf_put(lk_buf *b, const void *x, size_t n);
void lk_buf_printf(lk_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* 64-byte aligned allocation (SIMD rows, no false sharing); free with free(). */
void *lk_xmalloc_aligned(size_t n);

/* One step of a spin-wait: tells the core it spins (x86 pause), so the
 * sibling hyperthread and the memory system are spared. */
static inline void lk_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Overflow-checked arithmetic for sizes read from outside. */
static inline bool lk_mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool lk_add_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

/* a * b + c rounded once, as fmaf and the SIMD levels' FMA instructions,
 * for the scalar kernels that must give their bits (kernels/vec.c,
 * model/deltanet.c, quant/quant_q5.c).
 * Where the compiler targets an FMA unit (__FP_FAST_FMAF: Arm, -mfma) it is
 * that instruction. Else in double: the product is exact (24 + 24 bits) and
 * the sum s rounds once; rounding s to float then gives fmaf's result,
 * since no point halfway between two floats can lie between s and the exact
 * sum, unless s is such a point itself and the sum was not exact (its error,
 * by Knuth's two-sum, decides the side), or s is among the float denormals
 * (different halfway points): there libm's fmaf (tens of ns without the
 * instruction) decides. A sum of 0 is exact: two doubles cancel only
 * exactly. */
static inline float lk_fmaf(float a, float b, float c) {
#ifdef __FP_FAST_FMAF
    return fmaf(a, b, c);
#else
    const double p = (double)a * b, s = p + c;
    uint64_t u;
    memcpy(&u, &s, sizeof u);
    if ((u & 0x1fffffffu) == 0x10000000u) {
        const double t = s - p;
        if ((p - (s - t)) + (c - t) != 0) return fmaf(a, b, c);
    }
    if (s != 0 && fabs(s) < 0x1p-126) return fmaf(a, b, c);
    return (float)s;
#endif
}

/* fp16 / bf16 <-> fp32 (IEEE, round-to-nearest-even like ggml). */
float    lk_fp16_to_fp32(uint16_t h);
uint16_t lk_fp32_to_fp16(float f);
static inline float lk_bf16_to_fp32(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}
uint16_t lk_fp32_to_bf16(float f);

/* ---- CPU features and the SIMD level (cpu.c) -------------------------------
 * The one CPU probe of the program, made on first use (any thread). Every
 * SIMD dispatch chooses its variant from it: the quant kernels take `level`,
 * other kernel families (kernels/vec.c, kernels/membw.c, the wire codecs of
 * parallel/comm.c) ask lk_cpu_can() for the features their code needs, and
 * the handshake names `feat` to peers.
 *
 * LK_SIMD=scalar|avx2|avx512 in the environment picks the level for the
 * whole process and caps every family at it. An unknown name, or a level
 * the CPU lacks, is one warning on stderr naming it (and the missing
 * features) and the level used instead. */
enum {
    LK_CPU_AVX = 1u << 0,   LK_CPU_AVX2 = 1u << 1,   LK_CPU_FMA = 1u << 2,    LK_CPU_F16C = 1u << 3,
    LK_CPU_BMI1 = 1u << 4,  LK_CPU_BMI2 = 1u << 5,   LK_CPU_AVX512F = 1u << 6, LK_CPU_AVX512BW = 1u << 7,
    LK_CPU_AVX512VL = 1u << 8, LK_CPU_AVX512DQ = 1u << 9, LK_CPU_AVX512VNNI = 1u << 10,
    LK_CPU_AVX512VBMI = 1u << 11, LK_CPU_GFNI = 1u << 12, LK_CPU_AVX512BF16 = 1u << 13,
    /* AMX-TILE + AMX-INT8 with the tile state enabled by the OS for this
     * process (Linux grants it on request: the probe asks) */
    LK_CPU_AMX = 1u << 14,
    /* AMX-BF16 beside them (BF16 products through tiles) */
    LK_CPU_AMXBF16 = 1u << 15,
};
/* Whole levels, in order: avx2 = AVX2+FMA+F16C+BMI1/2 (Haswell, Zen 1 on);
 * avx512 adds AVX-512 F/BW/VL/DQ/VNNI/VBMI and GFNI (Ice Lake, Sapphire
 * Rapids, Zen 4 on). */
typedef enum { LK_SIMD_SCALAR = 0, LK_SIMD_AVX2 = 1, LK_SIMD_AVX512 = 2, LK_SIMD_LEVELS = 3 } lk_simd_level;
typedef struct {
    uint32_t      feat;  /* LK_CPU_* bits the CPU has and the OS enables */
    lk_simd_level best;  /* the highest whole level the CPU runs */
    lk_simd_level level; /* the level in force: LK_SIMD's when the CPU runs it, else best */
    lk_simd_level cap;   /* no kernel above this: `level` when LK_SIMD is set, else avx512
                            (a family whose code needs fewer features than a whole level,
                            such as vec.c's AVX-512 F+VL code, may then go above `level`) */
} lk_cpu_info;
const lk_cpu_info *lk_cpu(void);
/* May a kernel of nominal level l that needs features `need` run? */
bool        lk_cpu_can(lk_simd_level l, uint32_t need);
/* Does the CPU run every kernel of level l (whatever LK_SIMD says)? */
bool        lk_cpu_runs_level(lk_simd_level l);
const char *lk_simd_level_name(lk_simd_level l);            /* "scalar", "avx2", "avx512" */
bool        lk_simd_level_parse(const char *s, lk_simd_level *out);
const char *lk_cpu_feature_name(uint32_t bit);              /* LK_CPU_AVX2 -> "avx2" */

#define LK_MIN(a, b) ((a) < (b) ? (a) : (b))
#define LK_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
