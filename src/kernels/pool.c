/* Persistent thread pool.
 *
 * One "generation" counter drives the workers: the caller publishes (fn, arg),
 * bumps the generation, and runs its own share as thread 0; workers notice the
 * new generation, run their share and count themselves done. Between jobs a
 * worker spins for a bounded time (decode issues a matmul every few
 * microseconds, and a wake-up from sleep costs 20-25 us on these VMs), then
 * sleeps on a futex so an idle pool — e.g. a rank waiting on the network —
 * does not steal a core. LK_SPIN_US overrides the spin budget (0 = never
 * spin: right when ranks outnumber cores). */
#include "kernels/kernels.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

struct lk_pool {
    int n;                          /* threads including the caller */
    pthread_t *threads;
    lk_pool_fn fn;
    void *arg;
    _Alignas(64) atomic_uint gen;   /* bumped per job; futex word */
    _Alignas(64) atomic_uint done;  /* workers finished with the current job; futex word */
    atomic_int main_waiting;        /* the caller sleeps on `done` (0 or 1) */
    _Alignas(64) atomic_int sleepers;
    atomic_bool stop;
    uint64_t spin_ns;
};

typedef struct { lk_pool *p; int ith; } worker_arg;

static long futex(atomic_uint *addr, int op, unsigned val) {
    return syscall(SYS_futex, (unsigned *)addr, op, val, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* One step of a spin-wait. Every few pauses it yields the CPU: when the
 * machine has more busy threads than cores (other ranks, other programs), a
 * pure spin steals the time slice from the very thread it waits for and a
 * 1 ms job turns into a scheduler quantum; sched_yield returns at once when
 * nothing else wants the core, so the idle case keeps its microseconds. */
static inline void spin_step(unsigned i) {
    if ((i & 15) == 15) sched_yield();
    else cpu_relax();
}

/* Waits until *w equals val (until_equal) or differs from it: spins within
 * the pool's budget, then sleeps on the futex word, announcing itself in
 * *waiters so the other side knows to wake it. Returns the value seen. */
static unsigned wait_word(const lk_pool *p, atomic_uint *w, atomic_int *waiters, unsigned val, bool until_equal) {
    uint64_t t0 = 0;
    for (unsigned i = 0;; i++) {
        unsigned v = atomic_load_explicit(w, memory_order_acquire);
        if ((v == val) == until_equal) return v;
        if ((i & 63) == 63) {
            uint64_t now = lk_time_ns();
            if (!t0) t0 = now;
            else if (now - t0 > p->spin_ns) {
                atomic_fetch_add(waiters, 1);
                v = atomic_load(w);
                if ((v == val) != until_equal) futex(w, FUTEX_WAIT_PRIVATE, v);
                atomic_fetch_sub(waiters, 1);
                t0 = 0;
                continue;
            }
        }
        spin_step(i);
    }
}

/* A worker finished the current job; the last one wakes the caller if it
 * went to sleep. */
static void job_done(lk_pool *p) {
    if (atomic_fetch_add(&p->done, 1) + 1 == (unsigned)p->n - 1 && atomic_load(&p->main_waiting) > 0)
        futex(&p->done, FUTEX_WAKE_PRIVATE, 1);
}

static void *worker_main(void *a) {
    worker_arg wa = *(worker_arg *)a;
    free(a);
    lk_pool *p = wa.p;
    /* 0, not the current value: a job may be published before this thread
     * first runs, and it must not be missed */
    unsigned seen = 0;
    for (;;) {
        seen = wait_word(p, &p->gen, &p->sleepers, seen, false);
        if (atomic_load(&p->stop)) {
            job_done(p);
            return NULL;
        }
        p->fn(p->arg, wa.ith, p->n);
        job_done(p);
    }
}

lk_pool *lk_pool_create(int n_threads) {
    if (n_threads <= 0) n_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n_threads <= 0) n_threads = 1;
    lk_pool *p = lk_xmalloc_aligned(sizeof *p);
    *p = (lk_pool){ .n = n_threads };
    atomic_init(&p->gen, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->main_waiting, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, false);
    const char *s = getenv("LK_SPIN_US");
    p->spin_ns = (s && *s ? (uint64_t)atoll(s) : 200) * 1000;
    p->threads = lk_xcalloc((size_t)n_threads, sizeof(pthread_t));
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = lk_xmalloc(sizeof *wa);
        *wa = (worker_arg){ p, i };
        if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) LK_ASSERT(!"pthread_create failed");
    }
    return p;
}

int lk_pool_size(const lk_pool *p) { return p->n; }

static void nop(void *arg, int ith, int nth) { (void)arg; (void)ith; (void)nth; }

void lk_pool_run(lk_pool *p, lk_pool_fn fn, void *arg) {
    if (p->n == 1) { fn(arg, 0, 1); return; }
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    if (atomic_load(&p->sleepers) > 0) futex(&p->gen, FUTEX_WAKE_PRIVATE, (unsigned)p->n);
    fn(arg, 0, p->n);
    /* Stragglers usually finish within microseconds: spin. If they take
     * longer than the spin budget (a worker was descheduled because the
     * machine has more busy threads than cores), sleep until the last one
     * wakes us instead of burning the core it needs. */
    wait_word(p, &p->done, &p->main_waiting, (unsigned)p->n - 1, true);
}

void lk_pool_free(lk_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, true);
    lk_pool_run(p, nop, NULL);  /* wakes everyone; they see stop and exit */
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p);
}

void lk_split_range(int64_t n, int64_t align, int ith, int nth, int64_t *a, int64_t *b) {
    if (align < 1) align = 1;
    int64_t units = (n + align - 1) / align;
    int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    *a = LK_MIN(u0 * align, n);
    *b = LK_MIN(u1 * align, n);
}
