/* membw.c — streaming-read bandwidth probe (see membw.h). */
#include "kernels/membw.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/lk_common.h"

/* ---- the read loops: 4 independent accumulators so loads, not the add
 * chain, set the pace; the result is returned so nothing is optimised out. */
__attribute__((target("avx512f")))
static uint64_t read_avx512(const uint8_t *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 256 <= n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)(p + i)));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(p + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(p + i + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(p + i + 192)));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    return (uint64_t)_mm512_reduce_or_epi64(a0);
}

__attribute__((target("avx2")))
static uint64_t read_avx2(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const void *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const void *)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const void *)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const void *)(p + i + 96)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t r[4];
    memcpy(r, &a0, 32);
    return r[0] | r[1] | r[2] | r[3];
}

static uint64_t read_scalar(const uint8_t *p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, v[4];
    for (size_t i = 0; i + 32 <= n; i += 32) {
        memcpy(v, p + i, 32);
        a0 ^= v[0]; a1 ^= v[1]; a2 ^= v[2]; a3 ^= v[3];
    }
    return a0 ^ a1 ^ a2 ^ a3;
}

typedef uint64_t (*read_fn)(const uint8_t *, size_t);

/* From the program's CPU probe, so LK_SIMD caps the probe as it caps the
 * kernels whose speed it bounds. */
static read_fn pick_reader(void) {
    if (lk_cpu_can(LK_SIMD_AVX512, LK_CPU_AVX512F)) return read_avx512;
    if (lk_cpu_can(LK_SIMD_AVX2, LK_CPU_AVX2)) return read_avx2;
    return read_scalar;
}

/* The level of the read loop lk_membw_read_gbs uses, so tests can check
 * that LK_SIMD reaches it. Declared by its users until membw.h carries it. */
const char *lk_membw_simd_name(void) {
    read_fn rd = pick_reader();
    return rd == read_avx512 ? "avx512" : rd == read_avx2 ? "avx2" : "scalar";
}

/* what lk_membw_read_once's reads add up to, so that they stay */
static _Atomic uint64_t once_sink;

double lk_membw_read_once(const void *p, size_t bytes) {
    const size_t n = bytes / 256 * 256; /* whole iterations of the loop */
    if (!p || ((uintptr_t)p & 63) || n == 0) return -1; /* the loop's loads are aligned ones */
    const double t0 = lk_time_s();
    const uint64_t r = pick_reader()(p, n);
    const double el = lk_time_s() - t0;
    atomic_fetch_xor_explicit(&once_sink, r, memory_order_relaxed);
    return el > 0 ? (double)n / el / 1e9 : -1;
}

/* ---- threads: every pass starts at a barrier so all threads stream at once;
 * the time of a pass is from the first barrier to the last thread's end. */
typedef struct {
    const uint8_t     *buf;
    size_t             chunk;
    int                nth, passes;
    read_fn            rd;
    pthread_barrier_t  start, end;
    /* gate: helpers wait here until every thread exists (go = 1) or a
     * pthread_create failed (go = -1), so nobody blocks on a barrier sized
     * for threads that were never born */
    pthread_mutex_t    mu;
    pthread_cond_t     cv;
    int                go;
    volatile uint64_t  sink;
} probe;

typedef struct { probe *p; int ith; } probe_arg;

static void *probe_thread(void *arg) {
    probe_arg *a = arg;
    probe *p = a->p;
    uint64_t s = 0;
    pthread_mutex_lock(&p->mu);
    while (p->go == 0) pthread_cond_wait(&p->cv, &p->mu);
    int go = p->go;
    pthread_mutex_unlock(&p->mu);
    if (go < 0) return NULL;
    for (int k = 0; k < p->passes; k++) {
        pthread_barrier_wait(&p->start);
        s ^= p->rd(p->buf + (size_t)a->ith * p->chunk, p->chunk);
        pthread_barrier_wait(&p->end);
    }
    p->sink ^= s;
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double lk_membw_read_gbs(int n_threads, size_t bytes, int passes) {
    if (n_threads < 1) n_threads = 1;
    if (passes <= 0) passes = 7;
    if (passes > 64) passes = 64;
    /* chunks are whole multiples of 256 bytes (one unrolled iteration) */
    size_t chunk = bytes / (size_t)n_threads / 256 * 256;
    if (chunk == 0 || n_threads > 256) return -1;
    /* on huge pages where the kernel gives them, as the model's weights
     * are (model.c: weights_to_arena), so that the bound is measured on
     * the memory it bounds */
    const size_t huge = (size_t)2 << 20, len = (chunk * (size_t)n_threads + huge - 1) / huge * huge;
    uint8_t *buf = aligned_alloc(huge, len);
    if (!buf) return -1;
    madvise(buf, len, MADV_HUGEPAGE);
    /* Touch every page (and make the data non-zero) so the passes measure
     * reads of resident memory, not page faults. */
    for (size_t i = 0; i < chunk * (size_t)n_threads; i += 64) buf[i] = (uint8_t)i;

    probe p = {.buf = buf, .chunk = chunk, .nth = n_threads, .passes = passes + 1, .rd = pick_reader()};
    pthread_barrier_init(&p.start, NULL, (unsigned)n_threads);
    pthread_barrier_init(&p.end, NULL, (unsigned)n_threads);
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    pthread_t th[256];
    probe_arg args[256];
    int started = 1;
    for (int i = 1; i < n_threads; i++) {
        args[i] = (probe_arg){&p, i};
        if (pthread_create(&th[i], NULL, probe_thread, &args[i]) != 0) break;
        started++;
    }
    double t[65];
    pthread_mutex_lock(&p.mu);
    p.go = started == n_threads ? 1 : -1;
    pthread_cond_broadcast(&p.cv);
    pthread_mutex_unlock(&p.mu);
    if (started != n_threads) lk_log(LK_LOG_WARN, "membw: could only start %d of %d threads", started, n_threads);
    uint64_t s = 0;
    /* pass 0 warms up (TLB, prefetchers) and is not counted */
    for (int k = 0; k < p.passes && started == n_threads; k++) {
        pthread_barrier_wait(&p.start);
        double t0 = lk_time_s();
        s ^= p.rd(buf, chunk);
        pthread_barrier_wait(&p.end);
        if (k > 0) t[k - 1] = lk_time_s() - t0;
    }
    for (int i = 1; i < started; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&p.start);
    pthread_barrier_destroy(&p.end);
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    p.sink ^= s;
    free(buf);
    if (started != n_threads) return -1;
    qsort(t, (size_t)passes, sizeof t[0], cmp_double);
    double med = t[passes / 2];
    return med > 0 ? (double)(chunk * (size_t)n_threads) / med / 1e9 : -1;
}

size_t lk_membw_llc_bytes(void) {
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], line[64];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        if (fgets(line, sizeof line, f)) {
            char *end;
            unsigned long long v = strtoull(line, &end, 10);
            if (*end == 'K') v <<= 10;
            else if (*end == 'M') v <<= 20;
            if (v > best) best = (size_t)v;
        }
        fclose(f);
    }
    return best;
}
