/* Collectives with 2, 3 and 4 ranks (one thread each, real sockets on
 * 127.0.0.1 or real shm rings), checked against sums computed here
 * independently: in double (accuracy), and in the exact float order each
 * algorithm promises (determinism). */
#include "lk_test.h"
#include "kernels/kernels.h"
#include "parallel/parallel.h"
#include "transport/transport.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#define MAXR 4

/* ---- a mesh per thread ---------------------------------------------------- */

typedef struct rank_ctx rank_ctx;
typedef void (*rank_fn)(rank_ctx *);
struct rank_ctx {
    int rank, n, lfd;
    const char *const *addrs;
    lk_mesh_shm shm;
    lk_mesh *mesh;
    lk_comm *comm;
    rank_fn fn;
    void *arg;
    char err[LK_ERRLEN];
    bool setup_ok;
};

static void *rank_main(void *p) {
    rank_ctx *c = p;
    lk_mesh_params mp = {.rank = c->rank, .n = c->n, .addrs = c->addrs, .listen_fd = c->lfd,
                         .shm = c->shm, .spin_ns = -1, .timeout_ms = 5000};
    if (lk_mesh_create(&mp, &c->mesh, c->err, sizeof c->err)) return NULL;
    if (lk_comm_create(c->mesh, NULL, c->n, &c->comm, c->err, sizeof c->err)) return NULL;
    c->setup_ok = true;
    c->fn(c);
    return NULL;
}

/* Runs fn on n ranks; each gets its own mesh and comm. */
static void run_ranks(int n, lk_mesh_shm shm, rank_fn fn, void *arg) {
    char addr_buf[MAXR][32], err[LK_ERRLEN];
    const char *addrs[MAXR];
    rank_ctx c[MAXR];
    pthread_t th[MAXR];
    memset(c, 0, sizeof c);
    for (int r = 0; r < n; r++) {
        int port;
        LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &c[r].lfd, &port, err, sizeof err));
        snprintf(addr_buf[r], 32, "127.0.0.1:%d", port);
        addrs[r] = addr_buf[r];
    }
    for (int r = 0; r < n; r++) {
        c[r].rank = r; c[r].n = n; c[r].addrs = addrs; c[r].shm = shm; c[r].fn = fn; c[r].arg = arg;
        pthread_create(&th[r], NULL, rank_main, &c[r]);
    }
    for (int r = 0; r < n; r++) {
        pthread_join(th[r], NULL);
        close(c[r].lfd);
        CHECKF(c[r].setup_ok, "rank %d: %s", r, c[r].err);
        lk_comm_free(c[r].comm);
        lk_mesh_free(c[r].mesh);
    }
}

/* ---- all-reduce ------------------------------------------------------------ */

static float val(int rank, int64_t i) {
    /* Values of mixed magnitude and sign so summation order shows in the bits. */
    uint32_t h = (uint32_t)(i * 2654435761u) ^ (uint32_t)(rank * 40503u + 17u);
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    return ((float)(h & 0xffff) - 32768.0f) / 1024.0f * (float)(1 + (h >> 28));
}

/* over shm, 48 KiB goes through the windows for any N (exchange), and for
 * 2 ranks (whose windows are 512 KiB) every size from 32 KiB: 1.2 MB in
 * three pieces, 1 MiB + 4000 B in two and a last one of 4000 B through the
 * ring; the rest through the rings */
#define NSIZES 7
static const int64_t sizes[NSIZES] = {1, 7, 1000, 12000, 40000, 300000, 2 * 131072 + 1000};

typedef struct {
    lk_ar_algo algo;
    lk_wire_fmt wire;
    int threads;           /* a pool of this many for the windows' copies (0: none) */
    lk_ar_algo auto_algo;  /* what the automatic pick of 256 KiB was (rank 0) */
    lk_ar_algo auto_big;   /* and of 8 MiB */
    float *res[MAXR][NSIZES];
    lk_status st[MAXR];
    long allocs_during[MAXR];
} ar_arg;

static void pool_runner(void *ctx, lk_comm_task_fn fn, void *arg, int n) { lk_pool_run_n(ctx, fn, arg, n); }

static void ar_rank(rank_ctx *c) {
    ar_arg *a = c->arg;
    lk_pool *pool = a->threads ? lk_pool_create(a->threads) : NULL;
    if (pool) lk_comm_set_runner(c->comm, pool_runner, pool, a->threads);
    if (c->rank == 0) a->auto_algo = lk_comm_algo(c->comm, 256 << 10), a->auto_big = lk_comm_algo(c->comm, 8 << 20);
    lk_comm_set_algo(c->comm, a->algo);
    lk_comm_set_wire(c->comm, a->wire);
    int64_t most = 0;
    for (int k = 0; k < NSIZES; k++) most = LK_MAX(most, sizes[k]);
    lk_comm_reserve(c->comm, most);
    for (int k = 0; k < NSIZES; k++) {
        float *x = malloc(sizeof(float) * (size_t)sizes[k]);
        for (int64_t i = 0; i < sizes[k]; i++) x[i] = val(c->rank, i);
        a->res[c->rank][k] = x;
    }
    lk_status st = lk_comm_barrier(c->comm);
    long before = lk_test_allocs();
    for (int k = 0; k < NSIZES && !st; k++) {
        st = lk_comm_allreduce_sum(c->comm, a->res[c->rank][k], sizes[k], k, "test");
        if (st) printf("  rank %d: %s\n", c->rank, lk_comm_last_error(c->comm));
    }
    a->allocs_during[c->rank] = lk_test_allocs() - before;
    if (!st) st = lk_comm_barrier(c->comm);
    a->st[c->rank] = st;
    lk_comm_set_runner(c->comm, NULL, NULL, 0);
    lk_pool_free(pool);
}

/* The exact float result each algorithm promises, computed independently. */
static float expect_exact(lk_ar_algo algo, int N, int64_t n, int64_t i) {
    if (algo == LK_AR_EXCHANGE || algo == LK_AR_SCATTER || (algo == LK_AR_RING && n < N)) {
        float s = val(0, i);
        for (int r = 1; r < N; r++) s += val(r, i);
        return s;
    }
    if (algo == LK_AR_RING) {
        int k = 0; /* chunk holding i: [n*k/N, n*(k+1)/N) */
        while (n * (k + 1) / N <= i) k++;
        float s = val(k, i);
        for (int j = 1; j < N; j++) s = s + val((k + j) % N, i);
        return s;
    }
    /* doubling: extras folded into the low ranks, then a pairwise tree */
    int p = 1;
    while (p * 2 <= N) p *= 2;
    float v[MAXR];
    for (int r = 0; r < p; r++) v[r] = val(r, i);
    for (int r = p; r < N; r++) v[r - p] = v[r - p] + val(r, i);
    for (int w = 1; w < p; w *= 2)
        for (int r = 0; r < p; r += 2 * w) v[r] = v[r] + v[r + w];
    return v[0];
}

static lk_ar_algo check_allreduce_t(int N, lk_ar_algo algo, lk_mesh_shm shm, int threads, lk_ar_algo *auto_big) {
    ar_arg a;
    memset(&a, 0, sizeof a);
    a.algo = algo;
    a.threads = threads;
    run_ranks(N, shm, ar_rank, &a);
    for (int r = 0; r < N; r++) {
        CHECK(a.st[r] == LK_OK);
        CHECKF(a.allocs_during[r] == 0, "rank %d allocated %ld times", r, a.allocs_during[r]);
    }
    for (int k = 0; k < NSIZES; k++) {
        int bad_bits = 0, bad_exact = 0, bad_acc = 0;
        for (int64_t i = 0; i < sizes[k]; i++) {
            double d = 0, mag = 0;
            for (int r = 0; r < N; r++) d += val(r, i), mag += fabs(val(r, i));
            float e = expect_exact(algo, N, sizes[k], i);
            for (int r = 0; r < N; r++) {
                float got = a.res[r][k][i];
                bad_bits += memcmp(&got, &a.res[0][k][i], 4) != 0;
                bad_exact += memcmp(&got, &e, 4) != 0;
                bad_acc += fabs(got - d) > 1e-6 * mag + 1e-30;
            }
        }
        CHECKF(bad_bits == 0 && bad_exact == 0 && bad_acc == 0, "N=%d %s n=%lld: %d differ across ranks, %d differ "
               "from the promised order, %d inaccurate", N, lk_ar_algo_name(algo), (long long)sizes[k],
               bad_bits, bad_exact, bad_acc);
        for (int r = 0; r < N; r++) free(a.res[r][k]);
    }
    if (auto_big) *auto_big = a.auto_big;
    return a.auto_algo;
}
static void check_allreduce(int N, lk_ar_algo algo, lk_mesh_shm shm) { check_allreduce_t(N, algo, shm, 0, NULL); }

TEST(allreduce_exchange) { for (int N = 2; N <= 4; N++) check_allreduce(N, LK_AR_EXCHANGE, LK_MESH_SHM_OFF); }
TEST(allreduce_doubling) { for (int N = 2; N <= 4; N++) check_allreduce(N, LK_AR_DOUBLING, LK_MESH_SHM_OFF); }
TEST(allreduce_ring)     { for (int N = 2; N <= 4; N++) check_allreduce(N, LK_AR_RING, LK_MESH_SHM_OFF); }
TEST(allreduce_scatter)  { for (int N = 2; N <= MAXR; N++) check_allreduce(N, LK_AR_SCATTER, LK_MESH_SHM_OFF); }
TEST(allreduce_shm)      {
    check_allreduce(3, LK_AR_EXCHANGE, LK_MESH_SHM_FORCE);
    check_allreduce(4, LK_AR_RING, LK_MESH_SHM_FORCE);
    check_allreduce(3, LK_AR_DOUBLING, LK_MESH_SHM_FORCE);
    check_allreduce(3, LK_AR_SCATTER, LK_MESH_SHM_FORCE);
}
/* Exchange over shm goes through the links' windows (sizes above): the
 * promised bits with the caller alone or a pool of 3 doing the copies,
 * and the pick for 2 ranks over shm is exchange at every size past 32 KiB
 * (longer than the window: in pieces). */
TEST(allreduce_shm_windows) {
    for (int N = 2; N <= MAXR; N++) {
        check_allreduce_t(N, LK_AR_EXCHANGE, LK_MESH_SHM_FORCE, 0, NULL);
        check_allreduce_t(N, LK_AR_EXCHANGE, LK_MESH_SHM_FORCE, 3, NULL);
    }
    lk_ar_algo big = LK_AR_AUTO;
    CHECK(check_allreduce_t(2, LK_AR_AUTO, LK_MESH_SHM_FORCE, 2, &big) == LK_AR_EXCHANGE);
    CHECK(big == LK_AR_EXCHANGE);
    CHECK(check_allreduce_t(2, LK_AR_AUTO, LK_MESH_SHM_OFF, 0, &big) == LK_AR_SCATTER);
    CHECK(big == LK_AR_SCATTER);
    CHECK(check_allreduce_t(3, LK_AR_AUTO, LK_MESH_SHM_FORCE, 2, &big) == LK_AR_SCATTER);
    CHECK(big == LK_AR_SCATTER);
}

/* Compact wire formats: still bitwise identical on every rank; the error
 * against the exact sum is measured and printed (the accuracy effect), and
 * must stay within what the format's rounding allows. */
static void check_wire(int N, lk_ar_algo algo, lk_wire_fmt wire, double tol) {
    ar_arg a;
    memset(&a, 0, sizeof a);
    a.algo = algo;
    a.wire = wire;
    run_ranks(N, LK_MESH_SHM_OFF, ar_rank, &a);
    for (int r = 0; r < N; r++) CHECK(a.st[r] == LK_OK);
    for (int k = 1; k < NSIZES; k++) {
        int bad_bits = 0;
        double e2 = 0, x2 = 0, emax = 0;
        for (int64_t i = 0; i < sizes[k]; i++) {
            double d = 0;
            for (int r = 0; r < N; r++) d += val(r, i);
            for (int r = 0; r < N; r++) bad_bits += memcmp(&a.res[r][k][i], &a.res[0][k][i], 4) != 0;
            double e = fabs(a.res[0][k][i] - d);
            e2 += e * e, x2 += d * d;
            if (e > emax) emax = e;
        }
        double rel = sqrt(e2 / (x2 > 0 ? x2 : 1));
        if (k == NSIZES - 1)
            printf("  wire %-4s %-8s N=%d n=%-6lld relative L2 error %.2e (max abs %.3g)\n", lk_wire_fmt_name(wire),
                   lk_ar_algo_name(algo), N, (long long)sizes[k], rel, emax);
        CHECKF(bad_bits == 0 && rel <= tol, "wire %s %s N=%d n=%lld: %d differ across ranks, relative error %.3g",
               lk_wire_fmt_name(wire), lk_ar_algo_name(algo), N, (long long)sizes[k], bad_bits, rel);
        for (int r = 0; r < N; r++) free(a.res[r][k]);
    }
    for (int r = 0; r < N; r++) free(a.res[r][0]);
}

/* Batch invariance across the automatic choice: exchange (small payloads)
 * and scatter (large ones) give the same bits in every wire format, so a
 * token's sum does not depend on how many tokens share the payload. */
TEST(exchange_and_scatter_agree) {
    for (int w = LK_WIRE_F32; w <= LK_WIRE_Q8; w++)
        for (int N = 2; N <= 4; N++) {
            ar_arg a, b;
            memset(&a, 0, sizeof a);
            memset(&b, 0, sizeof b);
            a.algo = LK_AR_EXCHANGE;
            b.algo = LK_AR_SCATTER;
            a.wire = b.wire = (lk_wire_fmt)w;
            run_ranks(N, LK_MESH_SHM_OFF, ar_rank, &a);
            run_ranks(N, LK_MESH_SHM_OFF, ar_rank, &b);
            int diff = 0;
            for (int k = 0; k < NSIZES; k++)
                for (int r = 0; r < N; r++) {
                    diff += memcmp(a.res[r][k], b.res[r][k], sizeof(float) * (size_t)sizes[k]) != 0;
                    free(a.res[r][k]);
                    free(b.res[r][k]);
                }
            CHECKF(diff == 0, "wire %s N=%d: %d results differ between exchange and scatter", lk_wire_fmt_name((lk_wire_fmt)w),
                   N, diff);
        }
}

TEST(compact_wire_formats) {
    /* Rounding bounds: f16 has 11 significant bits, bf16 8, q8 ~7 relative
     * to each block's largest value; partial sums are rounded once per hop. */
    const double tol[4] = {0, 2e-3, 1.5e-2, 3e-2};
    for (int w = LK_WIRE_F16; w <= LK_WIRE_Q8; w++)
        for (int algo = LK_AR_EXCHANGE; algo <= LK_AR_SCATTER; algo++)
            for (int N = 3; N <= 4; N++) check_wire(N, (lk_ar_algo)algo, (lk_wire_fmt)w, tol[w]);
    CHECK(lk_wire_bytes(LK_WIRE_Q8, 64) == 68 && lk_wire_bytes(LK_WIRE_Q8, 33) == 34 + 3 &&
          lk_wire_bytes(LK_WIRE_F16, 10) == 20);
}

TEST(pick_by_size_and_ranks) {
    CHECK(lk_comm_pick(2, 16384) == LK_AR_EXCHANGE);
    CHECK(lk_comm_pick(4, 16384) == LK_AR_EXCHANGE);
    CHECK(lk_comm_pick(8, 16384) == LK_AR_EXCHANGE); /* rank order: batch invariance */
    CHECK(lk_comm_pick(4, 8 << 20) == LK_AR_SCATTER);
    CHECK(lk_comm_pick(2, 8 << 20) == LK_AR_SCATTER);
    CHECK(lk_comm_pick(3, 64 * 1024 - 4) == LK_AR_EXCHANGE);
}

/* ---- broadcast, gather, barrier, argmax, hook ------------------------------- */

typedef struct {
    int ok[MAXR];
} misc_arg;

static void misc_rank(rank_ctx *c) {
    misc_arg *a = c->arg;
    int N = c->n, me = lk_comm_rank(c->comm), ok = 1;
    char buf[3000];
    for (int root = 0; root < N; root++) {
        for (size_t i = 0; i < sizeof buf; i++) buf[i] = (char)(me == root ? i * 3 + (size_t)root : 0);
        ok &= !lk_comm_broadcast(c->comm, buf, sizeof buf, root, "bcast");
        for (size_t i = 0; i < sizeof buf; i++) ok &= buf[i] == (char)(i * 3 + (size_t)root);
    }
    int32_t mine[5], all[MAXR * 5];
    for (int i = 0; i < 5; i++) mine[i] = me * 100 + i;
    memset(all, 0xff, sizeof all);
    ok &= !lk_comm_gather(c->comm, mine, sizeof mine, all, N - 1, "gather");
    if (me == N - 1)
        for (int r = 0; r < N; r++)
            for (int i = 0; i < 5; i++) ok &= all[r * 5 + i] == r * 100 + i;
    ok &= !lk_comm_barrier(c->comm);
    /* argmax: the top value 7 appears on the last two ranks; the lower global
     * index must win everywhere. Rank 0 offers a NaN, which never wins. */
    float v = me == 0 ? NAN : me >= N - 2 ? 7.0f : (float)me;
    int64_t idx = me == N - 1 ? 10 : me == N - 2 ? 500 + me : me;
    if (N == 2) idx = me == 1 ? 10 : 3; /* rank 0 NaN, rank 1 has 7 at 10 */
    ok &= !lk_comm_argmax(c->comm, &v, &idx);
    ok &= v == 7.0f && idx == 10;
    /* The forward pass's hook reaches the same all-reduce. */
    lk_tp_hooks h;
    lk_comm_tp_hooks(c->comm, &h);
    float x[3] = {1.0f * (float)me, 2.0f, 0.5f};
    ok &= !h.allreduce_sum(h.ctx, x, 3, 0, "hook");
    ok &= x[0] == (float)(N * (N - 1) / 2) && x[1] == 2.0f * (float)N && x[2] == 0.5f * (float)N;
    a->ok[c->rank] = ok;
}

TEST(broadcast_gather_barrier_argmax) {
    for (int N = 2; N <= 4; N++) {
        misc_arg a = {{0}};
        run_ranks(N, N == 3 ? LK_MESH_SHM_FORCE : LK_MESH_SHM_OFF, misc_rank, &a);
        for (int r = 0; r < N; r++) CHECKF(a.ok[r], "N=%d rank %d", N, r);
    }
}

/* ---- failures: a peer that leaves, a peer that never comes ------------------- */

typedef struct {
    lk_status st[MAXR];
    char err[MAXR][LK_ERRLEN];
    double ms[MAXR];
    int64_t n; /* floats of the all-reduce (0: 4096) */
} fail_arg;

static void leaver_rank(rank_ctx *c) {
    fail_arg *a = c->arg;
    lk_comm_set_timeout_ms(c->comm, 3000);
    static float xs[MAXR][16384];
    float *x = xs[c->rank];
    const int64_t n = a->n ? a->n : 4096;
    LK_ASSERT(n <= 16384);
    if (c->rank == 2) {
        /* Rank 2 quits: its sockets close under the others. */
        lk_comm_free(c->comm);
        lk_mesh_free(c->mesh);
        c->comm = NULL;
        c->mesh = NULL;
        return;
    }
    uint64_t t0 = lk_time_ns();
    a->st[c->rank] = lk_comm_allreduce_sum(c->comm, x, n, 5, "ffn_out");
    a->ms[c->rank] = (double)(lk_time_ns() - t0) / 1e6;
    snprintf(a->err[c->rank], LK_ERRLEN, "%s", lk_comm_last_error(c->comm));
}

TEST(peer_leaves_named) {
    fail_arg a;
    memset(&a, 0, sizeof a);
    run_ranks(3, LK_MESH_SHM_OFF, leaver_rank, &a);
    for (int r = 0; r < 2; r++) {
        CHECK(a.st[r] == LK_ERR_NET);
        CHECKF(a.ms[r] < 1000, "rank %d noticed after %.0f ms", r, a.ms[r]);
        CHECKF(strstr(a.err[r], "all-reduce layer 5 ffn_out (16384 B, exchange): rank 2 (127.0.0.1:"), "%s", a.err[r]);
    }
}

/* The same over shm with 48 KiB, which the exchange sends through the
 * links' windows: the waiter on a dead peer's post finds the peer gone
 * through the control link. */
TEST(peer_leaves_named_window) {
    fail_arg a;
    memset(&a, 0, sizeof a);
    a.n = 12288;
    run_ranks(3, LK_MESH_SHM_FORCE, leaver_rank, &a);
    for (int r = 0; r < 2; r++) {
        CHECK(a.st[r] == LK_ERR_NET);
        CHECKF(a.ms[r] < 1000, "rank %d noticed after %.0f ms", r, a.ms[r]);
        CHECKF(strstr(a.err[r], "all-reduce layer 5 ffn_out (49152 B, exchange): rank 2 (127.0.0.1:") &&
                   strstr(a.err[r], "while waiting for its shared-memory post 1"),
               "%s", a.err[r]);
    }
}

static void absent_rank(rank_ctx *c) {
    fail_arg *a = c->arg;
    lk_comm_set_timeout_ms(c->comm, 200);
    float v = 1;
    int64_t i = (int64_t)c->rank;
    if (c->rank == 1) { usleep(600000); return; } /* present, but never joins */
    uint64_t t0 = lk_time_ns();
    a->st[c->rank] = lk_comm_argmax(c->comm, &v, &i);
    a->ms[c->rank] = (double)(lk_time_ns() - t0) / 1e6;
    snprintf(a->err[c->rank], LK_ERRLEN, "%s", lk_comm_last_error(c->comm));
}

TEST(deadline_names_peer) {
    fail_arg a;
    memset(&a, 0, sizeof a);
    run_ranks(2, LK_MESH_SHM_FORCE, absent_rank, &a);
    CHECK(a.st[0] == LK_ERR_TIMEOUT);
    CHECKF(a.ms[0] >= 190 && a.ms[0] < 600, "%.0f ms", a.ms[0]);
    CHECKF(strstr(a.err[0], "argmax: rank 1 (") && strstr(a.err[0], "timeout after"), "%s", a.err[0]);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    lk_log_set_level(LK_LOG_WARN);
    RUN(pick_by_size_and_ranks);
    RUN(allreduce_exchange);
    RUN(allreduce_doubling);
    RUN(allreduce_ring);
    RUN(allreduce_scatter);
    RUN(allreduce_shm);
    RUN(allreduce_shm_windows);
    RUN(exchange_and_scatter_agree);
    RUN(compact_wire_formats);
    RUN(broadcast_gather_barrier_argmax);
    RUN(peer_leaves_named);
    RUN(peer_leaves_named_window);
    RUN(deadline_names_peer);
    return lk_test_end();
}
