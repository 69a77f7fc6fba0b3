/* Collectives over a transport mesh: all-reduce (four algorithms), broadcast,
 * gather, barrier, argmax.
 *
 * Latency is the whole game for decode: a 4096-float hidden vector is 16 KiB,
 * which a link moves in a few microseconds, while every *round* costs a full
 * link latency (27 us blocked, ~5 us spinning on TCP loopback). So small
 * vectors use the fewest rounds: one full exchange (everyone sends its
 * partial to everyone; 1 round, N-1 messages out per rank) while N is small,
 * recursive doubling (log2 N rounds) for more ranks, and the ring (2(N-1)
 * rounds, but only 2(N-1)/N of the vector per rank on the wire) only for
 * large prefill vectors where bytes dominate. Ranks of one host talk over
 * shm, where the rings' copies (in, out, per direction) cost more than the
 * rounds: there an exchange skips them through the links' windows
 * (ar_exchange).
 *
 * Nothing here allocates after lk_comm_reserve(): scratch and transfer
 * tables are sized once. */
#include "parallel/parallel.h"
#include "parallel/trace.h"
#include "transport/transport.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct lk_comm {
    lk_mesh  *mesh;
    int       me, n;        /* position in the group, group size */
    int      *ranks;        /* [n] mesh rank of each group member */
    lk_link **links;        /* [n] link to each member (NULL for me) */
    lk_xfer  *xf;           /* [2n] transfer table */
    float    *scratch;      /* [scratch_n] */
    int64_t   scratch_n;
    int64_t   timeout_ms;
    lk_ar_algo force;
    lk_wire_fmt wire;
    uint8_t  *wbuf;         /* [wbuf_n] encoded payloads (compact wire formats only) */
    size_t    wbuf_n;
    int64_t   reserved;     /* largest n reserved so far */
    lk_comm_run_fn run;     /* threads for the shm windows' copies (NULL: none) */
    void     *run_ctx;
    int       run_n;
    char      err[LK_ERRLEN];
};

const char *lk_ar_algo_name(lk_ar_algo a) {
    switch (a) {
    case LK_AR_AUTO: return "auto";
    case LK_AR_EXCHANGE: return "exchange";
    case LK_AR_DOUBLING: return "doubling";
    case LK_AR_RING: return "ring";
    case LK_AR_SCATTER: return "scatter";
    }
    return "?";
}

/* Batch invariance decides first: a token's sum must not depend on how
 * many tokens share the payload, so automatic picks are only the two
 * algorithms that add every element in rank order 0..N-1 from the same
 * (wire-rounded) partials: exchange below 64 KiB (1 round: the round count
 * dominates small vectors) and scatter from there (each rank sums and moves
 * only 1/N of the vector, like the ring: netbench, 2 ranks, shm / tcp
 * loopback, the ring at 64 KiB 28 / 36 us against 37 / 42 us for exchange,
 * 1 MiB 480 / 1108 us against 724 / 1268 us). They give the same bits, so
 * the step size may cross the threshold freely. The ring (chunk k summed
 * from rank k on) and doubling (halves added pairwise) order their sums
 * otherwise; they remain for netbench and forced use. */
lk_ar_algo lk_comm_pick(int n_ranks, size_t bytes) {
    (void)n_ranks;
    return bytes < 64 * 1024 ? LK_AR_EXCHANGE : LK_AR_SCATTER;
}

lk_status lk_comm_create(lk_mesh *mesh, const int *ranks, int n, lk_comm **out, char *err, size_t errlen) {
    *out = NULL;
    int mn = lk_mesh_size(mesh), mr = lk_mesh_rank(mesh);
    if (!ranks) n = mn;
    /* 64: the small fixed tables of exchange/argmax; far above any TP group. */
    if (n < 1 || n > mn || n > 64)
        return lk_fail(err, errlen, LK_ERR_ARG, "comm: group of %d ranks in a mesh of %d (at most 64)", n, mn);
    lk_comm *c = lk_xcalloc(1, sizeof *c);
    c->mesh = mesh;
    c->n = n;
    c->me = -1;
    c->ranks = lk_xcalloc((size_t)n, sizeof *c->ranks);
    c->links = lk_xcalloc((size_t)n, sizeof *c->links);
    c->xf = lk_xcalloc((size_t)(2 * n), sizeof *c->xf);
    c->timeout_ms = 30000;
    for (int i = 0; i < n; i++) {
        int r = ranks ? ranks[i] : i;
        bool dup = false;
        for (int j = 0; j < i; j++) dup |= c->ranks[j] == r;
        if (r < 0 || r >= mn || dup) {
            lk_comm_free(c);
            return lk_fail(err, errlen, LK_ERR_ARG, "comm: bad or repeated mesh rank %d in group", r);
        }
        c->ranks[i] = r;
        if (r == mr) c->me = i;
        else c->links[i] = lk_mesh_link(mesh, r);
    }
    if (c->me < 0) {
        lk_comm_free(c);
        return lk_fail(err, errlen, LK_ERR_ARG, "comm: mesh rank %d is not in the group", mr);
    }
    *out = c;
    return LK_OK;
}

void lk_comm_free(lk_comm *c) {
    if (!c) return;
    free(c->ranks);
    free(c->links);
    free(c->xf);
    free(c->scratch);
    free(c->wbuf);
    free(c);
}

int lk_comm_rank(const lk_comm *c) { return c->me; }
int lk_comm_size(const lk_comm *c) { return c->n; }
void lk_comm_set_timeout_ms(lk_comm *c, int64_t ms) { c->timeout_ms = ms > 0 ? ms : 1; }
void lk_comm_set_algo(lk_comm *c, lk_ar_algo a) { c->force = a; }
void lk_comm_set_runner(lk_comm *c, lk_comm_run_fn run, void *ctx, int n) {
    c->run = n > 1 ? run : NULL;
    c->run_ctx = ctx;
    c->run_n = n;
}
const char *lk_comm_last_error(const lk_comm *c) { return c->err; }

/* ---- compact wire formats ------------------------------------------------------- */

const char *lk_wire_fmt_name(lk_wire_fmt f) {
    switch (f) {
    case LK_WIRE_F32: return "f32";
    case LK_WIRE_F16: return "f16";
    case LK_WIRE_BF16: return "bf16";
    case LK_WIRE_Q8: return "q8";
    }
    return "?";
}

bool lk_wire_fmt_parse(const char *s, lk_wire_fmt *f) {
    for (int i = LK_WIRE_F32; i <= LK_WIRE_Q8; i++)
        if (s && !strcmp(s, lk_wire_fmt_name((lk_wire_fmt)i))) { *f = (lk_wire_fmt)i; return true; }
    return false;
}

#define Q8_BLOCK 32

size_t lk_wire_bytes(lk_wire_fmt f, int64_t n) {
    switch (f) {
    case LK_WIRE_F32: return (size_t)n * 4;
    case LK_WIRE_F16: case LK_WIRE_BF16: return (size_t)n * 2;
    case LK_WIRE_Q8: return (size_t)(n / Q8_BLOCK) * (2 + Q8_BLOCK) + (n % Q8_BLOCK ? 2 + (size_t)(n % Q8_BLOCK) : 0);
    }
    return 0;
}

/* Conversions run on every hop of every all-reduce, so they must cost far
 * less than the bytes they save: F16 uses the F16C instructions when the CPU
 * has them (same round-to-nearest-even as lk_fp32_to_fp16), BF16 and Q8 are
 * written so the compiler vectorises them. */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx,f16c"))) static void f16_encode_f16c(const float *x, int64_t n, uint8_t *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) {
        uint16_t h = lk_fp32_to_fp16(x[i]);
        memcpy(out + 2 * i, &h, 2);
    }
}
__attribute__((target("avx,f16c"))) static void f16_decode_f16c(const uint8_t *in, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i))));
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, in + 2 * i, 2);
        y[i] = lk_fp16_to_fp32(h);
    }
}
/* The codecs' SIMD paths, chosen from the program's CPU probe (lk_cpu, so
 * LK_SIMD=scalar turns them off with every other kernel). F16C counts as
 * part of the avx2 level though it came earlier (Ivy Bridge): it still
 * runs where the CPU has it without AVX2, unless LK_SIMD caps it. Every
 * path gives the scalar code's bytes, so peers at different levels agree. */
static bool have_f16c(void) { return lk_cpu_can(LK_SIMD_AVX2, LK_CPU_AVX | LK_CPU_F16C); }
static bool have_avx2(void) { return lk_cpu_can(LK_SIMD_AVX2, LK_CPU_AVX2); }

/* 16 floats -> 16 BF16, same rounding as bf16_round below. Returns how many
 * were done (a multiple of 16); the caller finishes the tail. */
__attribute__((target("avx2"))) static int64_t bf16_encode_avx2(const float *x, int64_t n, uint16_t *o) {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), qbit = _mm256_set1_epi32(64);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i r[2];
        for (int h = 0; h < 2; h++) {
            __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i + 8 * h));
            __m256i rounded = _mm256_srli_epi32(
                _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
            __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), qbit);
            r[h] = _mm256_blendv_epi8(rounded, quiet, nan);
        }
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(void *)(o + i), p);
    }
    return i;
}

__attribute__((target("avx2"))) static int64_t bf16_decode_avx2(const uint16_t *h, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(h + i)));
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
    }
    return i;
}

/* One full Q8 block (32 floats): the scalar code's arithmetic, 8 lanes at a
 * time (same float operations in the same order, so the same bytes). */
__attribute__((target("avx2"))) static void q8_block_encode_avx2(const float *x, uint8_t *out) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        m = _mm256_max_ps(m, _mm256_and_ps(v[k], absm));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    uint16_t dh = lk_fp32_to_fp16(amax / 127.0f);
    float d = lk_fp16_to_fp32(dh), id = d > 0 ? 1.0f / d : 0.0f;
    memcpy(out, &dh, 2);
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256 half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps();
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        __m256 t = _mm256_mul_ps(v[k], vid);
        t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
        __m256 sgn = _mm256_blendv_ps(half, _mm256_sub_ps(zero, half), _mm256_cmp_ps(t, zero, _CMP_LT_OQ));
        q[k] = _mm256_cvttps_epi32(_mm256_add_ps(t, sgn));
    }
    __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(void *)(out + 2), w);
}

__attribute__((target("avx2"))) static void q8_block_decode_avx2(const uint8_t *in, float *y) {
    uint16_t dh;
    memcpy(&dh, in, 2);
    __m256 d = _mm256_set1_ps(lk_fp16_to_fp32(dh));
    for (int k = 0; k < 4; k++) {
        __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(in + 2 + 8 * k)));
        _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    }
}
#else
static bool have_avx2(void) { return false; }
static int64_t bf16_encode_avx2(const float *x, int64_t n, uint16_t *o) { (void)x; (void)n; (void)o; return 0; }
static int64_t bf16_decode_avx2(const uint16_t *h, int64_t n, float *y) { (void)h; (void)n; (void)y; return 0; }
static void q8_block_encode_avx2(const float *x, uint8_t *out) { (void)x; (void)out; }
static void q8_block_decode_avx2(const uint8_t *in, float *y) { (void)in; (void)y; }
static bool have_f16c(void) { return false; }
static void f16_encode_f16c(const float *x, int64_t n, uint8_t *out) { (void)x; (void)n; (void)out; }
static void f16_decode_f16c(const uint8_t *in, int64_t n, float *y) { (void)in; (void)n; (void)y; }
#endif

/* Which SIMD the codecs use: "avx2" (F16 by F16C, BF16 and Q8 by AVX2),
 * "f16c" (F16 only) or "scalar", so tests can check that LK_SIMD reaches
 * them. Declared by its users until parallel.h carries it. */
const char *lk_wire_simd_name(void) { return have_avx2() && have_f16c() ? "avx2" : have_f16c() ? "f16c" : "scalar"; }

/* Little-endian hosts only (as the GGUF reader): 16-bit values are stored
 * in host order. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static void wire_encode(lk_wire_fmt f, const float *x, int64_t n, uint8_t *out) {
    if (f == LK_WIRE_F16) {
        if (have_f16c()) { f16_encode_f16c(x, n, out); return; }
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = lk_fp32_to_fp16(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
        return;
    }
    if (f == LK_WIRE_BF16) {
        uint16_t *o = (uint16_t *)(void *)out; /* wbuf offsets are even */
        int64_t i = have_avx2() ? bf16_encode_avx2(x, n, o) : 0;
        for (; i < n; i++) o[i] = bf16_round(x[i]);
        return;
    }
    LK_ASSERT(f == LK_WIRE_Q8);
    /* Q8_0-like: per block of 32, d = max|x| / 127 stored as F16, q = round(x / d). */
    bool simd = have_avx2();
    for (int64_t b = 0; b < n; b += Q8_BLOCK) {
        int64_t m = LK_MIN(Q8_BLOCK, n - b);
        const float *xb = x + b;
        if (simd && m == Q8_BLOCK) {
            q8_block_encode_avx2(xb, out);
            out += 2 + Q8_BLOCK;
            continue;
        }
        float amax = 0;
        for (int64_t i = 0; i < m; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        uint16_t dh = lk_fp32_to_fp16(amax / 127.0f);
        float d = lk_fp16_to_fp32(dh), id = d > 0 ? 1.0f / d : 0.0f;
        memcpy(out, &dh, 2);
        int8_t *q = (int8_t *)(out + 2);
        for (int64_t i = 0; i < m; i++) {
            float v = xb[i] * id;
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            q[i] = (int8_t)(int)(v + (v >= 0 ? 0.5f : -0.5f)); /* round half away from zero */
        }
        out += 2 + m;
    }
}

static void wire_decode(lk_wire_fmt f, const uint8_t *in, int64_t n, float *y) {
    if (f == LK_WIRE_F16) {
        if (have_f16c()) { f16_decode_f16c(in, n, y); return; }
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, in + 2 * i, 2);
            y[i] = lk_fp16_to_fp32(h);
        }
        return;
    }
    if (f == LK_WIRE_BF16) {
        const uint16_t *h = (const uint16_t *)(const void *)in;
        for (int64_t i = have_avx2() ? bf16_decode_avx2(h, n, y) : 0; i < n; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&y[i], &u, 4);
        }
        return;
    }
    LK_ASSERT(f == LK_WIRE_Q8);
    bool simd = have_avx2();
    for (int64_t b = 0; b < n; b += Q8_BLOCK) {
        int64_t m = LK_MIN(Q8_BLOCK, n - b);
        if (simd && m == Q8_BLOCK) {
            q8_block_decode_avx2(in, y + b);
            in += 2 + Q8_BLOCK;
            continue;
        }
        uint16_t dh;
        memcpy(&dh, in, 2);
        float d = lk_fp16_to_fp32(dh);
        const int8_t *q = (const int8_t *)(in + 2);
        for (int64_t i = 0; i < m; i++) y[b + i] = d * (float)q[i];
        in += 2 + m;
    }
}

static int64_t scratch_need(int n_ranks, int64_t n) {
    /* exchange: one slot per peer; doubling: one vector; ring: one chunk. */
    return (int64_t)(n_ranks > 1 ? n_ranks - 1 : 1) * n;
}

/* Encoded bytes: exchange keeps every rank's payload, doubling two, the ring
 * every chunk (at a fixed stride of the largest chunk's encoding). */
static size_t wbuf_need(const lk_comm *c, int64_t n) {
    return (size_t)(c->n + 1) * (lk_wire_bytes(c->wire, n / c->n + 1) + lk_wire_bytes(c->wire, n));
}

void lk_comm_reserve(lk_comm *c, int64_t n) {
    if (n > c->reserved) c->reserved = n;
    int64_t need = scratch_need(c->n, n);
    if (need > c->scratch_n) {
        free(c->scratch);
        c->scratch = lk_xmalloc_aligned((size_t)need * sizeof(float));
        c->scratch_n = need;
    }
    if (c->wire != LK_WIRE_F32 && wbuf_need(c, n) > c->wbuf_n) {
        free(c->wbuf);
        c->wbuf_n = wbuf_need(c, n);
        c->wbuf = lk_xmalloc_aligned(c->wbuf_n);
    }
}

void lk_comm_set_wire(lk_comm *c, lk_wire_fmt f) {
    c->wire = f;
    if (c->reserved) lk_comm_reserve(c, c->reserved);
}

static uint64_t deadline(const lk_comm *c) { return lk_deadline_ms(c->timeout_ms); }

/* Records "op context: transport message" as the comm's last error. */
static lk_status failed(lk_comm *c, lk_status st, const char *why, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static lk_status failed(lk_comm *c, lk_status st, const char *why, const char *fmt, ...) {
    char ctx[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx, sizeof ctx, fmt, ap);
    va_end(ap);
    snprintf(c->err, sizeof c->err, "%s: %s", ctx, why);
    return st;
}

static inline lk_xfer xsend(lk_link *l, const void *p, size_t n) {
    return (lk_xfer){.link = l, .is_send = true, .buf = (void *)p, .n = n};
}
static inline lk_xfer xrecv(lk_link *l, void *p, size_t n) {
    return (lk_xfer){.link = l, .is_send = false, .buf = p, .n = n};
}

/* ---- all-reduce ---------------------------------------------------------- */

/* With a compact wire format every payload is encoded once; a rank replaces
 * its own contribution by the decoded encoding ("rounds" it) wherever peers
 * will use the encoded version, so all ranks add identical numbers. */
static inline bool compact(const lk_comm *c) { return c->wire != LK_WIRE_F32; }

/* out = ((p0 + p1) + p2) + ... element by element (part[r]: rank r's
 * partial; out is the caller's own one, part[me]). When out is p0 or p1 the
 * first pass writes it in place (out[i] is read before it is written, and
 * nothing later needs it): one pass over the vector fewer than summing into
 * a buffer and copying that out, which the 2-rank case always paid on rank
 * 1. Otherwise out may be overwritten only once every part has been read at
 * that element: the sum goes through a stack buffer in blocks, writing none
 * of the parts (peers' shm windows among them). */
static void sum_rank_order(float *out, const float *const *part, int N, int64_t n) {
    if (out == part[0] || out == part[1]) {
        const float *a = part[0], *b = part[1];
        for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
        for (int r = 2; r < N; r++)
            for (int64_t i = 0; i < n; i++) out[i] += part[r][i];
        return;
    }
    enum { B = 512 };
    float acc[B];
    for (int64_t o = 0; o < n; o += B) {
        const int64_t m = LK_MIN((int64_t)B, n - o);
        for (int64_t i = 0; i < m; i++) acc[i] = part[0][o + i] + part[1][o + i];
        for (int r = 2; r < N; r++)
            for (int64_t i = 0; i < m; i++) acc[i] += part[r][o + i];
        memcpy(out + o, acc, (size_t)m * sizeof(float));
    }
}

/* The shm windows' part of an exchange, split into whole cache lines over
 * the runner's threads from WIN_PAR_MIN floats: the copies of our partial
 * into the windows, or the sum in rank order. */
enum { WIN_PAR_MIN = 8192 };
typedef struct {
    int N;
    float *x;
    int64_t n;
    void *win[64];          /* copy: the windows to fill (NULL: none) */
    const float *part[64];  /* sum: the partials in rank order */
    bool sum;
} win_job;

static void win_task(void *arg, int i, int nt) {
    const win_job *j = arg;
    const int64_t a = j->n * i / nt / 16 * 16, b = i + 1 == nt ? j->n : j->n * (i + 1) / nt / 16 * 16;
    if (b <= a) return;
    if (!j->sum) {
        for (int r = 0; r < j->N; r++)
            if (j->win[r]) memcpy((float *)j->win[r] + a, j->x + a, (size_t)(b - a) * sizeof(float));
        return;
    }
    const float *part[64];
    for (int r = 0; r < j->N; r++) part[r] = j->part[r] + a;
    sum_rank_order(j->x + a, part, j->N, b - a);
}

static void win_run(lk_comm *c, win_job *j) {
    const int nt = c->run && j->n >= WIN_PAR_MIN ? c->run_n : 1;
    if (nt > 1) c->run(c->run_ctx, win_task, j, nt);
    else win_task(j, 0, 1);
}

/* Whether the exchange with peer r goes through the shm window: an f32
 * payload from WIN_MIN_BYTES that fits it (the same answer on both sides
 * of the link). Below that the ring was as fast or faster: on the Xeon 8
 * KiB took 2.4-4.3 us through the ring against 4.1-4.9 through the window
 * (64 KiB: 25-27 against 13-17 us). */
enum { WIN_MIN_BYTES = 32 << 10 };
static bool use_window(const lk_comm *c, int r, int64_t n) {
    const uint64_t b = (uint64_t)n * sizeof(float);
    return !compact(c) && b >= WIN_MIN_BYTES && b <= lk_shm_win_bytes(c->links[r]);
}

/* Everyone's partial to everyone, then the sum in rank order. Over shm
 * links (f32) the partial goes through the link's window: written once
 * where the peer reads it in place, instead of copied into a ring and out
 * again on the other side under the ring's flow control. */
static lk_status ar_exchange(lk_comm *c, float *x, int64_t n, uint64_t dl, char *why, size_t wl) {
    size_t eb = lk_wire_bytes(c->wire, n);
    const void *out = x;
    if (compact(c)) {
        uint8_t *mine = c->wbuf + (size_t)c->me * eb;
        wire_encode(c->wire, x, n, mine);
        wire_decode(c->wire, mine, n, x);
        out = mine;
    }
    LK_ASSERT(c->n >= 2 && c->n <= 64);
    win_job j = {.N = c->n, .x = x, .n = n};
    bool any_win = false;
    for (int r = 0; r < c->n; r++)
        if (r != c->me && use_window(c, r, n)) {
            j.win[r] = lk_shm_win_slot(c->links[r]);
            any_win = true;
        }
    if (any_win) {
        win_run(c, &j);
        for (int r = 0; r < c->n; r++)
            if (j.win[r]) lk_shm_win_post(c->links[r]);
    }
    int nx = 0;
    for (int r = 0; r < c->n; r++) {
        if (r == c->me || j.win[r]) continue;
        float *slot = c->scratch + (int64_t)(r < c->me ? r : r - 1) * n;
        c->xf[nx++] = xsend(c->links[r], out, eb);
        c->xf[nx++] = xrecv(c->links[r], compact(c) ? (void *)(c->wbuf + (size_t)r * eb) : (void *)slot, eb);
    }
    lk_status st = nx ? lk_xfer_run(c->xf, nx, dl, why, wl) : LK_OK;
    for (int r = 0; r < c->n && !st; r++) {
        if (r == c->me) { j.part[r] = x; continue; }
        if (j.win[r]) {
            const void *p;
            st = lk_shm_win_wait(c->links[r], &p, dl, why, wl);
            j.part[r] = p;
            continue;
        }
        float *slot = c->scratch + (int64_t)(r < c->me ? r : r - 1) * n;
        if (compact(c)) wire_decode(c->wire, c->wbuf + (size_t)r * eb, n, slot);
        j.part[r] = slot;
    }
    if (st) return st;
    /* Sum in rank order 0..N-1 (x is rank me's partial): ((p0 + p1) + p2)...
     * whole vectors (or blocks) at a time, so the loops vectorise */
    j.sum = true;
    win_run(c, &j);
    return LK_OK;
}

/* Adds in a fixed order: lo + hi, whichever of (x, y) holds the lower
 * ranks' sum, so both partners compute the same bits. */
static void add_ordered(float *x, const float *y, int64_t n, bool x_is_lower) {
    if (x_is_lower) for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i];
    else            for (int64_t i = 0; i < n; i++) x[i] = y[i] + x[i];
}

/* Exchanges x with one partner (both directions at once); y gets theirs.
 * send_x/recv_y select one-way transfers. */
static lk_status swap(lk_comm *c, lk_link *l, float *x, float *y, int64_t n, bool send_x, bool recv_y,
                      uint64_t dl, char *why, size_t wl) {
    size_t eb = lk_wire_bytes(c->wire, n);
    uint8_t *sb = c->wbuf, *rb = c->wbuf ? c->wbuf + eb : NULL;
    int nx = 0;
    if (send_x) {
        if (compact(c)) {
            wire_encode(c->wire, x, n, sb);
            wire_decode(c->wire, sb, n, x);
        }
        c->xf[nx++] = xsend(l, compact(c) ? (void *)sb : (void *)x, eb);
    }
    if (recv_y) c->xf[nx++] = xrecv(l, compact(c) ? (void *)rb : (void *)y, eb);
    lk_status st = lk_xfer_run(c->xf, nx, dl, why, wl);
    if (!st && recv_y && compact(c)) wire_decode(c->wire, rb, n, y);
    return st;
}

static lk_status ar_doubling(lk_comm *c, float *x, int64_t n, uint64_t dl, char *why, size_t wl) {
    int p = 1;
    while (p * 2 <= c->n) p *= 2;
    int me = c->me, extra = c->n - p;
    float *y = c->scratch;
    lk_status st;
    /* Ranks p.. fold into rank (r - p) first, and get the result back last. */
    if (me >= p) {
        if ((st = swap(c, c->links[me - p], x, NULL, n, true, false, dl, why, wl))) return st;
        return swap(c, c->links[me - p], NULL, x, n, false, true, dl, why, wl);
    }
    if (me < extra) {
        if ((st = swap(c, c->links[me + p], NULL, y, n, false, true, dl, why, wl))) return st;
        add_ordered(x, y, n, true);
    }
    for (int k = 1; k < p; k <<= 1) {
        int partner = me ^ k;
        if ((st = swap(c, c->links[partner], x, y, n, true, true, dl, why, wl))) return st;
        add_ordered(x, y, n, me < partner);
    }
    if (me < extra) return swap(c, c->links[me + p], x, NULL, n, true, false, dl, why, wl);
    /* The extras get the result through the wire format, and their partners
     * round their own copy on sending it: everyone else rounds the same way. */
    if (extra && compact(c)) {
        wire_encode(c->wire, x, n, c->wbuf);
        wire_decode(c->wire, c->wbuf, n, x);
    }
    return LK_OK;
}

/* Chunk k of n elements split into N near-equal parts. */
static inline int64_t chunk_at(int64_t n, int N, int k) { return n * k / N; }

static lk_status ar_ring(lk_comm *c, float *x, int64_t n, uint64_t dl, char *why, size_t wl) {
    int N = c->n, me = c->me;
    lk_link *next = c->links[(me + 1) % N], *prev = c->links[(me + N - 1) % N];
    float *y = c->scratch;
    bool cw = compact(c);
    size_t stride = lk_wire_bytes(c->wire, n / N + 1); /* encoded chunk k lives at wbuf + k * stride */
    uint8_t *tmp = cw ? c->wbuf + (size_t)N * stride : NULL;
    lk_status st;
    /* Reduce-scatter: at step s we pass on chunk (me - s) and fold the
     * incoming chunk (me - s - 1) into ours as (incoming + mine): chunk k's
     * sum is built in the order k, k+1, ..., k-1 on every run. */
    for (int s = 0; s < N - 1; s++) {
        int cs = ((me - s) % N + N) % N, cr = ((me - s - 1) % N + N) % N;
        int64_t s0 = chunk_at(n, N, cs), s1 = chunk_at(n, N, cs + 1);
        int64_t r0 = chunk_at(n, N, cr), r1 = chunk_at(n, N, cr + 1);
        size_t sb = lk_wire_bytes(c->wire, s1 - s0), rbn = lk_wire_bytes(c->wire, r1 - r0);
        if (cw) wire_encode(c->wire, x + s0, s1 - s0, c->wbuf + (size_t)cs * stride);
        c->xf[0] = xsend(next, cw ? (void *)(c->wbuf + (size_t)cs * stride) : (void *)(x + s0), sb);
        c->xf[1] = xrecv(prev, cw ? (void *)tmp : (void *)y, rbn);
        if ((st = lk_xfer_run(c->xf, 2, dl, why, wl))) return st;
        if (cw) wire_decode(c->wire, tmp, r1 - r0, y);
        for (int64_t i = 0; i < r1 - r0; i++) x[r0 + i] = y[i] + x[r0 + i];
    }
    /* All-gather: rank me now owns the full sum of chunk (me + 1). Encoded
     * chunks are forwarded as received, never re-encoded, so every rank
     * decodes the very same bytes; the owner rounds its own copy. */
    if (cw) {
        int own = (me + 1) % N;
        int64_t o0 = chunk_at(n, N, own), o1 = chunk_at(n, N, own + 1);
        wire_encode(c->wire, x + o0, o1 - o0, c->wbuf + (size_t)own * stride);
        wire_decode(c->wire, c->wbuf + (size_t)own * stride, o1 - o0, x + o0);
    }
    for (int s = 0; s < N - 1; s++) {
        int cs = ((me + 1 - s) % N + N) % N, cr = ((me - s) % N + N) % N;
        int64_t s0 = chunk_at(n, N, cs), s1 = chunk_at(n, N, cs + 1);
        int64_t r0 = chunk_at(n, N, cr), r1 = chunk_at(n, N, cr + 1);
        size_t sb = lk_wire_bytes(c->wire, s1 - s0), rbn = lk_wire_bytes(c->wire, r1 - r0);
        c->xf[0] = xsend(next, cw ? (void *)(c->wbuf + (size_t)cs * stride) : (void *)(x + s0), sb);
        c->xf[1] = xrecv(prev, cw ? (void *)(c->wbuf + (size_t)cr * stride) : (void *)(x + r0), rbn);
        if ((st = lk_xfer_run(c->xf, 2, dl, why, wl))) return st;
        if (cw) wire_decode(c->wire, c->wbuf + (size_t)cr * stride, r1 - r0, x + r0);
    }
    return LK_OK;
}

/* Scatter chunks start on 32-element boundaries, so the Q8 wire format's
 * blocks fall as they do over the whole vector and every element is
 * rounded exactly as exchange rounds it. */
static inline int64_t chunk32(int64_t n, int N, int k) { return k >= N ? n : (n * k / N) / 32 * 32; }

/* Reduce-scatter by direct exchange, then all-gather: rank k receives
 * chunk k of every partial (wire format), adds the N of them in rank order
 * like exchange does, and sends the sum to everyone in f32 (not re-encoded,
 * so every rank ends with exchange's bits). */
static lk_status ar_scatter(lk_comm *c, float *x, int64_t n, uint64_t dl, char *why, size_t wl) {
    const int N = c->n, me = c->me;
    const bool cw = compact(c);
    size_t eb = lk_wire_bytes(c->wire, n);
    uint8_t *mine = cw ? c->wbuf + (size_t)me * eb : NULL;
    if (cw) { /* encode once, round our own partial as the wire does */
        wire_encode(c->wire, x, n, mine);
        wire_decode(c->wire, mine, n, x);
    }
    const int64_t m0 = chunk32(n, N, me), m1 = chunk32(n, N, me + 1), mn = m1 - m0;
    /* peer r's chunk `me` lands in scratch slot (r < me ? r : r - 1), encoded in wbuf slot r */
    int nx = 0;
    for (int r = 0; r < N; r++) {
        if (r == me) continue;
        int64_t r0 = chunk32(n, N, r), r1 = chunk32(n, N, r + 1);
        if (r1 > r0) {
            size_t off = 0;
            if (cw) off = lk_wire_bytes(c->wire, r0);
            c->xf[nx++] = xsend(c->links[r], cw ? (void *)(mine + off) : (void *)(x + r0),
                                lk_wire_bytes(c->wire, r1 - r0));
        }
        if (mn > 0) {
            float *slot = c->scratch + (int64_t)(r < me ? r : r - 1) * n;
            c->xf[nx++] = xrecv(c->links[r], cw ? (void *)(c->wbuf + (size_t)r * eb) : (void *)slot,
                                lk_wire_bytes(c->wire, mn));
        }
    }
    lk_status st = lk_xfer_run(c->xf, nx, dl, why, wl);
    if (st) return st;
    if (mn > 0) {
        const float *part[64] = {0};
        LK_ASSERT(N >= 2 && N <= 64);
        for (int r = 0; r < N; r++) {
            if (r == me) { part[r] = x + m0; continue; }
            float *slot = c->scratch + (int64_t)(r < me ? r : r - 1) * n;
            if (cw) wire_decode(c->wire, c->wbuf + (size_t)r * eb, mn, slot);
            part[r] = slot;
        }
        /* ((p0 + p1) + p2)... as exchange */
        sum_rank_order(x + m0, part, N, mn);
    }
    nx = 0;
    for (int r = 0; r < N; r++) {
        if (r == me) continue;
        int64_t r0 = chunk32(n, N, r), r1 = chunk32(n, N, r + 1);
        if (mn > 0) c->xf[nx++] = xsend(c->links[r], x + m0, (size_t)mn * sizeof(float));
        if (r1 > r0) c->xf[nx++] = xrecv(c->links[r], x + r0, (size_t)(r1 - r0) * sizeof(float));
    }
    return lk_xfer_run(c->xf, nx, dl, why, wl);
}

/* Floats of one window exchange between 2 ranks over shm (0: no window):
 * a longer vector goes through it in pieces of this size (ar_windowed) */
static int64_t win_floats(const lk_comm *c) {
    return c->n == 2 && !compact(c) ? (int64_t)(lk_shm_win_bytes(c->links[1 - c->me]) / sizeof(float)) : 0;
}

lk_ar_algo lk_comm_algo(const lk_comm *c, size_t bytes) {
    /* 2 ranks share their one link, so both see whether it is shm */
    const int64_t n = (int64_t)(bytes / sizeof(float)), w = win_floats(c);
    if (w && use_window(c, 1 - c->me, LK_MIN(n, w))) return LK_AR_EXCHANGE;
    return lk_comm_pick(c->n, bytes);
}

/* The exchange of 2 ranks over shm for a vector longer than the window:
 * one window exchange per window's worth, the same sums (each element p0 +
 * p1) as one exchange or the scatter would give. The rings moved such
 * vectors one memcpy at a time on the calling thread (4 MiB: 1.0-1.3 ms
 * on the 16-core Xeon whatever -t); through the window the copies and sums
 * run on the pool's threads. The window's two slots alternate, and a side
 * writes a slot again only after the peer's next post, which it makes once
 * it has read the slot: so piece after piece is safe as exchange after
 * exchange is. */
static lk_status ar_windowed(lk_comm *c, float *x, int64_t n, int64_t w, uint64_t dl, char *why, size_t wl) {
    lk_status st = LK_OK;
    for (int64_t o = 0; o < n && !st; o += w) st = ar_exchange(c, x + o, LK_MIN(w, n - o), dl, why, wl);
    return st;
}

lk_status lk_comm_allreduce_sum(lk_comm *c, float *x, int64_t n, int layer, const char *what) {
    if (c->n == 1 || n <= 0) return LK_OK;
    size_t bytes = (size_t)n * sizeof(float);
    char why[LK_ERRLEN];
    lk_ar_algo a = c->force ? c->force : lk_comm_algo(c, bytes);
    if (a == LK_AR_RING && n < c->n) a = LK_AR_EXCHANGE; /* chunks would be empty */
    if (scratch_need(c->n, n) > c->scratch_n || (compact(c) && wbuf_need(c, n) > c->wbuf_n)) {
        lk_log(LK_LOG_DEBUG, "comm: growing all-reduce scratch to %lld floats", (long long)n);
        lk_comm_reserve(c, n);
    }
    uint64_t dl = deadline(c), t0 = lk_trace_on ? lk_time_ns() : 0;
    const int64_t w = a == LK_AR_EXCHANGE ? win_floats(c) : 0;
    lk_status st = w && n > w           ? ar_windowed(c, x, n, w, dl, why, sizeof why)
                 : a == LK_AR_EXCHANGE ? ar_exchange(c, x, n, dl, why, sizeof why)
                 : a == LK_AR_DOUBLING ? ar_doubling(c, x, n, dl, why, sizeof why)
                 : a == LK_AR_SCATTER  ? ar_scatter(c, x, n, dl, why, sizeof why)
                                       : ar_ring(c, x, n, dl, why, sizeof why);
    if (lk_trace_on) lk_trace_comm(c->ranks[c->me], "all-reduce", what, layer, bytes, t0, lk_time_ns());
    if (st) {
        char lay[32] = "";
        if (layer >= 0) snprintf(lay, sizeof lay, " layer %d", layer);
        return failed(c, st, why, "all-reduce%s %s (%zu B, %s%s%s)", lay, what ? what : "", bytes, lk_ar_algo_name(a),
                      compact(c) ? ", wire " : "", compact(c) ? lk_wire_fmt_name(c->wire) : "");
    }
    return LK_OK;
}

/* ---- the others ---------------------------------------------------------- */

lk_status lk_comm_broadcast(lk_comm *c, void *buf, size_t bytes, int root, const char *what) {
    LK_ASSERT(root >= 0 && root < c->n);
    if (c->n == 1 || !bytes) return LK_OK;
    int nx = 0;
    if (c->me == root) {
        for (int r = 0; r < c->n; r++)
            if (r != root) c->xf[nx++] = xsend(c->links[r], buf, bytes);
    } else {
        c->xf[nx++] = xrecv(c->links[root], buf, bytes);
    }
    char why[LK_ERRLEN];
    uint64_t t0 = lk_trace_on ? lk_time_ns() : 0;
    lk_status st = lk_xfer_run(c->xf, nx, deadline(c), why, sizeof why);
    if (lk_trace_on) lk_trace_comm(c->ranks[c->me], "broadcast", what, -1, bytes, t0, lk_time_ns());
    if (st) return failed(c, st, why, "broadcast %s (%zu B from rank %d)", what ? what : "", bytes, root);
    return LK_OK;
}

lk_status lk_comm_gather(lk_comm *c, const void *in, size_t bytes, void *out, int root, const char *what) {
    LK_ASSERT(root >= 0 && root < c->n);
    int nx = 0;
    if (c->me == root) {
        memcpy((char *)out + (size_t)root * bytes, in, bytes);
        for (int r = 0; r < c->n; r++)
            if (r != root) c->xf[nx++] = xrecv(c->links[r], (char *)out + (size_t)r * bytes, bytes);
    } else {
        c->xf[nx++] = xsend(c->links[root], in, bytes);
    }
    if (!nx || !bytes) return LK_OK;
    char why[LK_ERRLEN];
    uint64_t t0 = lk_trace_on ? lk_time_ns() : 0;
    lk_status st = lk_xfer_run(c->xf, nx, deadline(c), why, sizeof why);
    if (lk_trace_on) lk_trace_comm(c->ranks[c->me], "gather", what, -1, bytes, t0, lk_time_ns());
    if (st) return failed(c, st, why, "gather %s (%zu B to rank %d)", what ? what : "", bytes, root);
    return LK_OK;
}

/* Everyone sends `bytes` from `mine` to everyone; slot r of `all` gets rank
 * r's (slot me is left to the caller). */
static lk_status exchange_all(lk_comm *c, const void *mine, void *all, size_t bytes, char *why, size_t wl) {
    int nx = 0;
    for (int r = 0; r < c->n; r++) {
        if (r == c->me) continue;
        c->xf[nx++] = xsend(c->links[r], mine, bytes);
        c->xf[nx++] = xrecv(c->links[r], (char *)all + (size_t)r * bytes, bytes);
    }
    return lk_xfer_run(c->xf, nx, deadline(c), why, wl);
}

lk_status lk_comm_barrier(lk_comm *c) {
    if (c->n == 1) return LK_OK;
    uint8_t mine = 1, all[64];
    LK_ASSERT(c->n <= 64);
    char why[LK_ERRLEN];
    lk_status st = exchange_all(c, &mine, all, 1, why, sizeof why);
    if (st) return failed(c, st, why, "barrier");
    return LK_OK;
}

typedef struct {
    float   v;
    int32_t pad;
    int64_t i;
} vi_pair;

lk_status lk_comm_argmax(lk_comm *c, float *value, int64_t *index) {
    if (c->n == 1) return LK_OK;
    vi_pair mine = {*value, 0, *index}, all[64];
    LK_ASSERT(c->n <= 64);
    char why[LK_ERRLEN];
    lk_status st = exchange_all(c, &mine, all, sizeof mine, why, sizeof why);
    if (st) return failed(c, st, why, "argmax");
    all[c->me] = mine;
    vi_pair best = {-INFINITY, 0, -1};
    bool have = false;
    for (int r = 0; r < c->n; r++) {
        vi_pair p = all[r];
        if (isnan(p.v)) continue;
        if (!have || p.v > best.v || (p.v == best.v && p.i < best.i)) best = p, have = true;
    }
    if (!have) best = all[0]; /* all NaN: still the same answer everywhere */
    *value = best.v;
    *index = best.i;
    return LK_OK;
}

static lk_status tp_hook(void *ctx, float *x, int64_t n, int layer, const char *what) {
    return lk_comm_allreduce_sum(ctx, x, n, layer, what);
}

void lk_comm_tp_hooks(lk_comm *c, lk_tp_hooks *h) {
    h->ctx = c;
    h->allreduce_sum = tp_hook;
}
