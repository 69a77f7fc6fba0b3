/* Persistent thread pool with task claiming.
 *
 * A job is n_tasks calls fn(arg, task, n_tasks), each task exactly once, on
 * whichever thread claims it. The tasks are split into one contiguous home
 * range per thread (a 64-bit word per range: next task in the low half, end
 * in the high half, on its own cache line); a thread first claims from its
 * own range, in order, then from the others' (work stealing). So when every
 * thread runs, each does its static share, as a plain split would; when one
 * is descheduled (more busy threads than cores: other ranks, other
 * programs), the others take its tasks instead of waiting a scheduler
 * quantum for it at the barrier. The job is over when n_tasks tasks are
 * done, not when every thread has checked in: a worker that wakes late finds
 * nothing left to claim and goes back to waiting.
 *
 * Why a claim needs no generation check: a successful fetch_add that sees
 * next < end claims a task of the job whose counters it read, and that job
 * cannot finish (and its fn/arg cannot be replaced) before the task is done;
 * fn/arg are read after the claim, and the counters are published with
 * release after them. A stale worker's fetch_add on an exhausted counter
 * claims nothing (next only grows within a job; the publisher resets it).
 *
 * Between jobs a worker spins for a bounded time (decode issues a matmul
 * every few microseconds, and a wake-up from sleep costs 20-25 us on these
 * VMs), yielding the CPU every 16 pauses, then sleeps on a futex so an idle
 * pool (a rank waiting on the network) does not steal a core. LK_SPIN_US
 * overrides the spin budget (0 = never spin). */
#include "kernels/kernels.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    _Alignas(64) _Atomic uint64_t w;   /* next task (low 32 bits) | end (high 32 bits) */
    /* the profile (when on): this thread's first task's start and last
     * task's end in the current job, lk_time_ns; first 0: none yet */
    _Atomic uint64_t first_ns, last_ns;
} home_range;

/* A prefetch hint (lk_pool_prefetch). Its fields are read relaxed: a
 * read that mixes two hints costs useless prefetches, no more (a prefetch
 * never faults). */
typedef struct {
    _Alignas(64) _Atomic uintptr_t base[LK_POOL_PREFETCH_MAX];
    _Atomic size_t len[LK_POOL_PREFETCH_MAX];
    atomic_int n;
} pf_hint;

/* A thread's progress through the current hint: its share of each region
 * (from lo, w bytes), steps done and to do. Its own thread's only. */
typedef struct {
    _Alignas(64) unsigned gen;      /* the hint's generation these are for */
    uint32_t k, lim;
    uint64_t K;                     /* steps over the whole share */
    uintptr_t lo[LK_POOL_PREFETCH_MAX];
    size_t w[LK_POOL_PREFETCH_MAX];
    int n;
} pf_state;

struct lk_pool {
    int n;                          /* threads including the caller */
    pthread_t *threads;
    home_range *home;               /* (n) one task range per thread */
    _Atomic(lk_pool_fn) fn;
    _Atomic(void *) arg;
    atomic_int n_tasks;
    _Alignas(64) atomic_uint gen;   /* bumped per job; futex word */
    _Alignas(64) atomic_uint done;  /* tasks finished in the current job; futex word */
    atomic_int main_waiting;        /* the caller sleeps on `done` (0 or 1) */
    atomic_int kind;                /* lk_prof_kind of the current job */
    atomic_bool prof;               /* the current job is profiled (home[].first_ns/last_ns) */
    _Alignas(64) atomic_int sleepers;
    atomic_bool stop;
    uint64_t spin_ns;
    /* lk_pool_prefetch: hint g in pf_hint[g % 2], so that writing the next
     * one touches no line the threads are reading, only pf_gen */
    pf_hint pf_hint[2];
    _Alignas(64) atomic_uint pf_gen;
    pf_state *pf_st;                /* (n) */
};

typedef struct { lk_pool *p; int ith; } worker_arg;

/* ---- the profile (kernels.h): relaxed counters, read between steps ---- */
static atomic_bool g_prof_on;
static _Atomic uint64_t g_prof_wall[LK_PROF_N], g_prof_busy[LK_PROF_N], g_prof_calls[LK_PROF_N];
static _Atomic uint64_t g_prof_before[LK_PROF_N], g_prof_after[LK_PROF_N];
static _Thread_local int t_matmul_kind = LK_PROF_MATMUL;

void lk_prof_enable(bool on) { atomic_store(&g_prof_on, on); }

void lk_prof_reset(void) {
    for (int k = 0; k < LK_PROF_N; k++) {
        atomic_store_explicit(&g_prof_wall[k], 0, memory_order_relaxed);
        atomic_store_explicit(&g_prof_busy[k], 0, memory_order_relaxed);
        atomic_store_explicit(&g_prof_calls[k], 0, memory_order_relaxed);
        atomic_store_explicit(&g_prof_before[k], 0, memory_order_relaxed);
        atomic_store_explicit(&g_prof_after[k], 0, memory_order_relaxed);
    }
}

void lk_prof_get(lk_prof *out) {
    for (int k = 0; k < LK_PROF_N; k++) {
        out->wall_ns[k] = atomic_load_explicit(&g_prof_wall[k], memory_order_relaxed);
        out->busy_ns[k] = atomic_load_explicit(&g_prof_busy[k], memory_order_relaxed);
        out->calls[k] = atomic_load_explicit(&g_prof_calls[k], memory_order_relaxed);
        out->before_ns[k] = atomic_load_explicit(&g_prof_before[k], memory_order_relaxed);
        out->after_ns[k] = atomic_load_explicit(&g_prof_after[k], memory_order_relaxed);
    }
}

uint64_t lk_prof_t0(void) { return atomic_load_explicit(&g_prof_on, memory_order_relaxed) ? lk_time_ns() : 0; }

void lk_prof_add(lk_prof_kind k, uint64_t t0) {
    if (!t0) return;
    atomic_fetch_add_explicit(&g_prof_wall[k], lk_time_ns() - t0, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_prof_calls[k], 1, memory_order_relaxed);
}

lk_prof_kind lk_prof_matmul_kind(lk_prof_kind k) {
    lk_prof_kind old = (lk_prof_kind)t_matmul_kind;
    t_matmul_kind = (int)k;
    return old;
}

lk_prof_kind lk_prof_matmul_kind_now(void) { return (lk_prof_kind)t_matmul_kind; }

static void prof_busy(int k, uint64_t t0) {
    atomic_fetch_add_explicit(&g_prof_busy[k], lk_time_ns() - t0, memory_order_relaxed);
}

/* A profiled job's task on thread h ran from t0 to t1: busy time, and the
 * thread's first start and last end (read by pool_run once the job is done:
 * these stores come before the thread counts the task done) */
static void prof_task(const lk_pool *p, home_range *h, uint64_t t0) {
    const uint64_t t1 = lk_time_ns();
    atomic_fetch_add_explicit(&g_prof_busy[atomic_load_explicit(&p->kind, memory_order_relaxed)], t1 - t0,
                              memory_order_relaxed);
    if (!atomic_load_explicit(&h->first_ns, memory_order_relaxed)) atomic_store_explicit(&h->first_ns, t0, memory_order_relaxed);
    atomic_store_explicit(&h->last_ns, t1, memory_order_relaxed);
}

/* One step of thread ith's prefetch of its share of the hint: about
 * PF_STEP bytes, over the regions at the same fraction of each share, as a
 * fused product's tasks read them (rows of every matrix in turn). Small
 * steps: a thread checks the word it waits on between them, and on a
 * 16-core Xeon 2 KiB steps delayed the threads' start on the next job
 * (BENCHMARKS.md, thirty-eighth session). Returns false when there is
 * nothing (more) to prefetch. */
enum { PF_STEP = 512 };
static bool prefetch_step(lk_pool *p, int ith) {
    pf_state *st = &p->pf_st[ith];
    const unsigned gen = atomic_load_explicit(&p->pf_gen, memory_order_acquire);
    if (gen != st->gen) {
        const pf_hint *h = &p->pf_hint[gen % 2];
        st->gen = gen;
        st->k = 0;
        st->n = LK_MIN(atomic_load_explicit(&h->n, memory_order_relaxed), (int)LK_POOL_PREFETCH_MAX);
        uint64_t share = 0;
        for (int r = 0; r < st->n; r++) {
            const uint64_t len = atomic_load_explicit(&h->len[r], memory_order_relaxed);
            const uint64_t a = len * (uint64_t)ith / (uint64_t)p->n, b = len * (uint64_t)(ith + 1) / (uint64_t)p->n;
            st->lo[r] = atomic_load_explicit(&h->base[r], memory_order_relaxed) + (uintptr_t)a;
            st->w[r] = (size_t)(b - a);
            share += b - a;
        }
        st->K = LK_MAX((uint64_t)1, share / PF_STEP);
        st->lim = st->n > 0 ? (uint32_t)LK_MIN(st->K, (uint64_t)(LK_POOL_PREFETCH_BYTES / PF_STEP)) : 0;
    }
    if (st->k >= st->lim) return false;
    const uint64_t k = st->k++;
    for (int r = 0; r < st->n; r++) {
        const uintptr_t lo = st->lo[r] + (uintptr_t)(st->w[r] * k / st->K);
        const uintptr_t hi = st->lo[r] + (uintptr_t)(st->w[r] * (k + 1) / st->K);
        for (uintptr_t x = lo & ~(uintptr_t)63; x < hi; x += 64) __builtin_prefetch((const void *)x, 0, 2);
    }
    return true;
}

static atomic_bool g_hints = true; /* lk_pool_set_hints (tune.c: hint=0|1) */

void lk_pool_set_hints(bool on) { atomic_store(&g_hints, on); }
bool lk_pool_hints(void) { return atomic_load(&g_hints); }

void lk_pool_prefetch(lk_pool *p, const void *const *base, const size_t *len, int n) {
    if (p->n == 1) return;
    n = LK_MAX(0, LK_MIN(n, (int)LK_POOL_PREFETCH_MAX));
    const unsigned g0 = atomic_load_explicit(&p->pf_gen, memory_order_relaxed), g = g0 + 1;
    if (!atomic_load_explicit(&g_hints, memory_order_relaxed)) {
        /* off: the hint in force cleared, once */
        if (!atomic_load_explicit(&p->pf_hint[g0 % 2].n, memory_order_relaxed)) return;
        n = 0;
    }
    pf_hint *h = &p->pf_hint[g % 2];
    for (int r = 0; r < n; r++) {
        atomic_store_explicit(&h->base[r], (uintptr_t)base[r], memory_order_relaxed);
        atomic_store_explicit(&h->len[r], len[r], memory_order_relaxed);
    }
    atomic_store_explicit(&h->n, n, memory_order_relaxed);
    atomic_store_explicit(&p->pf_gen, g, memory_order_release);
}

static long futex(atomic_uint *addr, int op, unsigned val) {
    return syscall(SYS_futex, (unsigned *)addr, op, val, NULL, NULL, 0);
}

/* One step of a spin-wait. Every few pauses it yields the CPU: when the
 * machine has more busy threads than cores, a pure spin steals the time
 * slice from the very thread it waits for and a 1 ms job turns into a
 * scheduler quantum; sched_yield returns at once when nothing else wants the
 * core, so the idle case keeps its microseconds. */
static inline void spin_step(unsigned i) {
    if ((i & 15) == 15) sched_yield();
    else lk_cpu_relax();
}

/* Waits until *w equals val (until_equal) or differs from it: spins within
 * the pool's budget, then sleeps on the futex word, announcing itself in
 * *waiters so the other side knows to wake it. While it spins, thread ith
 * prefetches its share of the hint (lk_pool_prefetch). Returns the value
 * seen. */
static unsigned wait_word(lk_pool *p, int ith, atomic_uint *w, atomic_int *waiters, unsigned val, bool until_equal) {
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
        if (prefetch_step(p, ith)) continue;
        spin_step(i);
    }
}

/* Adds n finished tasks to the job's count; the thread that completes the
 * job wakes the caller if it went to sleep. seq_cst, as the caller's
 * announcement in main_waiting: one of the two sees the other. */
static void tasks_done(lk_pool *p, unsigned n, int nt) {
    if (n && atomic_fetch_add(&p->done, n) + n == (unsigned)nt && atomic_load(&p->main_waiting) > 0)
        futex(&p->done, FUTEX_WAKE_PRIVATE, 1);
}

/* Claims and runs tasks, own range first, then the others' in turn, until
 * none is left. The own range's tasks are counted done at once when it runs
 * out (one write to the shared counter per thread, not per task: with 16
 * threads x 4 tasks the counter's line was bouncing between cores), a
 * stolen task as soon as it ends (the job's tail waits on it). */
static void run_tasks(lk_pool *p, int ith) {
    unsigned own = 0;
    int nt = 0;
    for (int k = 0; k < p->n; k++) {
        home_range *h = &p->home[(ith + k) % p->n];
        if (k == 1) {
            tasks_done(p, own, nt);
            own = 0;
        }
        for (;;) {
            if ((uint32_t)atomic_load_explicit(&h->w, memory_order_relaxed) >=
                (uint32_t)(atomic_load_explicit(&h->w, memory_order_relaxed) >> 32))
                break;
            uint64_t c = atomic_fetch_add_explicit(&h->w, 1, memory_order_acquire);
            if ((uint32_t)c >= (uint32_t)(c >> 32)) break;
            lk_pool_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
            void *arg = atomic_load_explicit(&p->arg, memory_order_relaxed);
            nt = atomic_load_explicit(&p->n_tasks, memory_order_relaxed);
            const uint64_t t0 = atomic_load_explicit(&p->prof, memory_order_relaxed) ? lk_time_ns() : 0;
            fn(arg, (int)(uint32_t)c, nt);
            if (t0) prof_task(p, &p->home[ith], t0);
            if (k == 0) own++;
            else tasks_done(p, 1, nt);
        }
    }
    tasks_done(p, own, nt); /* a pool of one thread */
}

static void *worker_main(void *a) {
    worker_arg wa = *(worker_arg *)a;
    free(a);
    lk_pool *p = wa.p;
    /* 0, not the current value: a job may be published before this thread
     * first runs, and it must not be missed */
    unsigned seen = 0;
    for (;;) {
        seen = wait_word(p, wa.ith, &p->gen, &p->sleepers, seen, false);
        if (atomic_load(&p->stop)) return NULL;
        run_tasks(p, wa.ith);
    }
}

lk_pool *lk_pool_create(int n_threads) {
    if (n_threads <= 0) n_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n_threads <= 0) n_threads = 1;
    lk_pool *p = lk_xmalloc_aligned(sizeof *p);
    *p = (lk_pool){ .n = n_threads };
    p->home = lk_xmalloc_aligned(sizeof(home_range) * (size_t)n_threads);
    for (int i = 0; i < n_threads; i++) {
        atomic_init(&p->home[i].w, 0);
        atomic_init(&p->home[i].first_ns, 0);
        atomic_init(&p->home[i].last_ns, 0);
    }
    atomic_init(&p->fn, NULL);
    atomic_init(&p->arg, NULL);
    atomic_init(&p->n_tasks, 0);
    atomic_init(&p->gen, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->main_waiting, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->kind, LK_PROF_PAR);
    atomic_init(&p->prof, false);
    atomic_init(&p->stop, false);
    const char *s = getenv("LK_SPIN_US");
    p->spin_ns = (s && *s ? (uint64_t)atoll(s) : 200) * 1000;
    for (int g = 0; g < 2; g++) {
        for (int r = 0; r < LK_POOL_PREFETCH_MAX; r++) {
            atomic_init(&p->pf_hint[g].base[r], 0);
            atomic_init(&p->pf_hint[g].len[r], 0);
        }
        atomic_init(&p->pf_hint[g].n, 0);
    }
    atomic_init(&p->pf_gen, 0);
    p->pf_st = lk_xmalloc_aligned(sizeof(pf_state) * (size_t)n_threads);
    for (int i = 0; i < n_threads; i++) p->pf_st[i] = (pf_state){ .gen = 0 };
    p->threads = lk_xcalloc((size_t)n_threads, sizeof(pthread_t));
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = lk_xmalloc(sizeof *wa);
        *wa = (worker_arg){ p, i };
        if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) LK_ASSERT(!"pthread_create failed");
    }
    return p;
}

int lk_pool_size(const lk_pool *p) { return p->n; }

static void pool_run(lk_pool *p, lk_prof_kind kind, lk_pool_fn fn, void *arg, int n_tasks) {
    LK_ASSERT(n_tasks >= 1);
    if (p->n == 1 || n_tasks == 1) {
        const uint64_t j0 = lk_prof_t0();
        for (int i = 0; i < n_tasks; i++) {
            const uint64_t t0 = lk_prof_t0();
            fn(arg, i, n_tasks);
            if (t0) prof_busy(kind, t0);
        }
        /* one task: the other threads had none */
        if (j0) atomic_fetch_add_explicit(&g_prof_before[kind], (uint64_t)(p->n - 1) * (lk_time_ns() - j0), memory_order_relaxed);
        return;
    }
    const bool prof = atomic_load_explicit(&g_prof_on, memory_order_relaxed);
    if (prof)
        for (int i = 0; i < p->n; i++) atomic_store_explicit(&p->home[i].first_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&p->prof, prof, memory_order_relaxed);
    atomic_store_explicit(&p->kind, (int)kind, memory_order_relaxed);
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->arg, arg, memory_order_relaxed);
    atomic_store_explicit(&p->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    for (int i = 0; i < p->n; i++) {
        uint64_t a = (uint64_t)n_tasks * (uint64_t)i / (uint64_t)p->n;
        uint64_t b = (uint64_t)n_tasks * (uint64_t)(i + 1) / (uint64_t)p->n;
        atomic_store_explicit(&p->home[i].w, a | b << 32, memory_order_release);
    }
    const uint64_t pub = prof ? lk_time_ns() : 0;
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    if (atomic_load(&p->sleepers) > 0) futex(&p->gen, FUTEX_WAKE_PRIVATE, (unsigned)p->n);
    run_tasks(p, 0);
    /* What is left are tasks other threads claimed and are running. They
     * usually finish within microseconds: spin. If one takes longer than the
     * spin budget (its thread was descheduled mid-task), sleep until the
     * last one wakes us instead of burning the core it needs. */
    wait_word(p, 0, &p->done, &p->main_waiting, (unsigned)n_tasks, true);
    if (prof) {
        /* every task's thread stored its times before counting it done */
        atomic_thread_fence(memory_order_acquire);
        const uint64_t end = lk_time_ns();
        uint64_t before = 0, after = 0;
        for (int i = 0; i < p->n; i++) {
            const uint64_t f = atomic_load_explicit(&p->home[i].first_ns, memory_order_relaxed);
            if (!f) {
                before += end - pub;
                continue;
            }
            before += f > pub ? f - pub : 0;
            const uint64_t l = atomic_load_explicit(&p->home[i].last_ns, memory_order_relaxed);
            after += end > l ? end - l : 0;
        }
        atomic_fetch_add_explicit(&g_prof_before[kind], before, memory_order_relaxed);
        atomic_fetch_add_explicit(&g_prof_after[kind], after, memory_order_relaxed);
    }
}

void lk_pool_run_k(lk_pool *p, lk_prof_kind kind, lk_pool_fn fn, void *arg, int n_tasks) {
    const uint64_t t0 = lk_prof_t0();
    pool_run(p, kind, fn, arg, n_tasks);
    /* a matmul's runs count in the matmul call's wall (lk_matmul_fused), an
     * all-reduce's copies in the all-reduce's (the model's allreduce) */
    if (t0 && kind != LK_PROF_MATMUL && kind != LK_PROF_LOGITS_MATMUL && kind != LK_PROF_QUANT && kind != LK_PROF_COMM)
        lk_prof_add(kind, t0);
}

void lk_pool_run_n(lk_pool *p, lk_pool_fn fn, void *arg, int n_tasks) { lk_pool_run_k(p, LK_PROF_PAR, fn, arg, n_tasks); }

void lk_pool_run(lk_pool *p, lk_pool_fn fn, void *arg) { lk_pool_run_n(p, fn, arg, p->n); }

void lk_pool_free(lk_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, true);
    atomic_fetch_add(&p->gen, 1);  /* wakes everyone; they see stop and exit */
    futex(&p->gen, FUTEX_WAKE_PRIVATE, (unsigned)p->n);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p->home);
    free(p->pf_st);
    free(p);
}

void lk_split_range(int64_t n, int64_t align, int ith, int nth, int64_t *a, int64_t *b) {
    if (align < 1) align = 1;
    int64_t units = (n + align - 1) / align;
    int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    *a = LK_MIN(u0 * align, n);
    *b = LK_MIN(u1 * align, n);
}
