/* Transport: real sockets on 127.0.0.1 (random free ports), real shm
 * segments, threads and a forked process for the "peer died" case. */
#include "lk_test.h"
#include "transport/transport.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------ */

typedef struct {
    int rank, n;
    int lfd;
    const char *const *addrs;
    lk_mesh_shm shm;
    lk_mesh *mesh;
    lk_status st;
    char err[LK_ERRLEN];
} mesh_arg;

static void *mesh_thread(void *p) {
    mesh_arg *a = p;
    lk_mesh_params mp = {.rank = a->rank, .n = a->n, .addrs = a->addrs, .listen_fd = a->lfd,
                         .shm = a->shm, .spin_ns = -1, .timeout_ms = 5000};
    a->st = lk_mesh_create(&mp, &a->mesh, a->err, sizeof a->err);
    return NULL;
}

/* Builds an n-rank mesh inside this process, one thread per rank. */
static bool build_meshes(int n, lk_mesh_shm shm, lk_mesh **out) {
    static char addr_buf[8][32];
    const char *addrs[8];
    mesh_arg a[8];
    pthread_t th[8];
    char err[LK_ERRLEN];
    for (int r = 0; r < n; r++) {
        int port = 0;
        a[r].lfd = -1;
        if (lk_tcp_listen("127.0.0.1:0", &a[r].lfd, &port, err, sizeof err)) return false;
        snprintf(addr_buf[r], sizeof addr_buf[r], "127.0.0.1:%d", port);
        addrs[r] = addr_buf[r];
    }
    for (int r = 0; r < n; r++) {
        a[r].rank = r; a[r].n = n; a[r].addrs = addrs; a[r].shm = shm; a[r].mesh = NULL;
        pthread_create(&th[r], NULL, mesh_thread, &a[r]);
    }
    bool ok = true;
    for (int r = 0; r < n; r++) {
        pthread_join(th[r], NULL);
        close(a[r].lfd);
        if (a[r].st) { printf("  rank %d: %s\n", r, a[r].err); ok = false; }
        out[r] = a[r].mesh;
    }
    return ok;
}

static void connected_pair(lk_link **a, lk_link **b) {
    char err[LK_ERRLEN];
    int lfd, port;
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd, &port, err, sizeof err));
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    LK_ASSERT(!lk_tcp_connect(addr, lk_deadline_ms(2000), a, err, sizeof err));
    LK_ASSERT(!lk_tcp_accept(lfd, lk_deadline_ms(2000), b, err, sizeof err));
    close(lfd);
}

/* ---- tests -------------------------------------------------------------- */

TEST(addr_split) {
    char h[64];
    int p;
    CHECK(lk_addr_split("10.0.0.1:7070", h, sizeof h, &p) && !strcmp(h, "10.0.0.1") && p == 7070);
    CHECK(lk_addr_split("[::1]:80", h, sizeof h, &p) && !strcmp(h, "::1") && p == 80);
    CHECK(lk_addr_split(":0", h, sizeof h, &p) && !h[0] && p == 0);
    CHECK(!lk_addr_split("nohost", h, sizeof h, &p));
    CHECK(!lk_addr_split("h:99999", h, sizeof h, &p));
    CHECK(!lk_addr_split("h:12x", h, sizeof h, &p));
    char err[LK_ERRLEN];
    lk_link *l;
    CHECK(lk_tcp_connect("bogus", lk_deadline_ms(100), &l, err, sizeof err) == LK_ERR_ARG && strstr(err, "bogus"));
}

/* A port nobody listens on: retried until the deadline (a worker may still
 * be starting), then reported as refused with the address and the time
 * spent, not as "Connection timed out" (which the last attempt, cut short
 * by the deadline, would otherwise say). */
TEST(tcp_connect_refused) {
    char err[LK_ERRLEN], addr[32];
    int lfd, port;
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd, &port, err, sizeof err));
    close(lfd); /* the port is now closed: connects are refused */
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    lk_link *l = NULL;
    uint64_t t0 = lk_time_ns();
    lk_status st = lk_tcp_connect(addr, lk_deadline_ms(300), &l, err, sizeof err);
    double ms = (double)(lk_time_ns() - t0) / 1e6;
    CHECK(st == LK_ERR_NET && !l);
    CHECKF(ms >= 290 && ms < 2000, "gave up after %.0f ms", ms);
    char want[96];
    snprintf(want, sizeof want, "is a worker listening on %s?", addr);
    CHECKF(strstr(err, "connection refused") && strstr(err, want) && strstr(err, " s)"), "%s", err);
    CHECKF(!strstr(err, "timed out"), "%s", err);
}

typedef struct {
    lk_link *l;
    size_t n, piece;
    int delay_us;
} sender_arg;

/* Sends a counting pattern in small pieces with pauses: the receiver must
 * reassemble exact byte counts from partial reads. */
static void *slow_sender(void *p) {
    sender_arg *a = p;
    unsigned char *buf = malloc(a->n);
    for (size_t i = 0; i < a->n; i++) buf[i] = (unsigned char)(i * 7 + 3);
    char err[LK_ERRLEN];
    for (size_t off = 0; off < a->n; off += a->piece) {
        size_t k = LK_MIN(a->piece, a->n - off);
        LK_ASSERT(!lk_link_send(a->l, buf + off, k, lk_deadline_ms(2000), err, sizeof err));
        if (a->delay_us) usleep((useconds_t)a->delay_us);
    }
    free(buf);
    return NULL;
}

TEST(tcp_partial_reads) {
    lk_link *a, *b;
    connected_pair(&a, &b);
    sender_arg sa = {.l = a, .n = 10000, .piece = 333, .delay_us = 200};
    pthread_t th;
    pthread_create(&th, NULL, slow_sender, &sa);
    unsigned char got[10000];
    char err[LK_ERRLEN];
    lk_status st = lk_link_recv(b, got, sizeof got, lk_deadline_ms(3000), err, sizeof err);
    pthread_join(th, NULL);
    CHECKF(st == LK_OK, "%s", err);
    int bad = 0;
    for (size_t i = 0; i < sizeof got; i++) bad += got[i] != (unsigned char)(i * 7 + 3);
    CHECK(bad == 0);
    CHECK(b->bytes_recv == sizeof got && a->bytes_sent == sizeof got);
    lk_link_close(a);
    lk_link_close(b);
}

TEST(tcp_deadline_and_close) {
    lk_link *a, *b;
    connected_pair(&a, &b);
    char buf[100], err[LK_ERRLEN];
    /* Nothing sent: the wait must end at its deadline, not hang. */
    uint64_t t0 = lk_time_ns();
    lk_status st = lk_link_recv(b, buf, sizeof buf, lk_deadline_ms(150), err, sizeof err);
    double ms = (double)(lk_time_ns() - t0) / 1e6;
    CHECK(st == LK_ERR_TIMEOUT);
    CHECKF(ms >= 140 && ms < 1000, "waited %.0f ms", ms);
    CHECKF(strstr(err, "timeout") && strstr(err, "receiving 100 bytes (got 0)"), "%s", err);
    /* Half the bytes, then the peer closes: an error naming the shortfall. */
    CHECK(!lk_link_send(a, buf, 40, lk_deadline_ms(1000), err, sizeof err));
    lk_link_close(a);
    st = lk_link_recv(b, buf, sizeof buf, lk_deadline_ms(1000), err, sizeof err);
    CHECK(st == LK_ERR_NET);
    CHECKF(strstr(err, "closed") && strstr(err, "got 40"), "%s", err);
    lk_link_close(b);
}

typedef struct {
    lk_link *l;
    size_t n;
    unsigned seed;
    lk_status st;
    int bad;
} swap_arg;

/* Both sides send n bytes and receive n bytes at once: with n far above
 * socket buffers or ring capacity, doing it one direction at a time would
 * deadlock; lk_xfer_run must interleave. */
static void *swap_thread(void *p) {
    swap_arg *a = p;
    unsigned char *out = malloc(a->n), *in = malloc(a->n);
    for (size_t i = 0; i < a->n; i++) out[i] = (unsigned char)(i * 13 + a->seed);
    lk_xfer x[2] = {{.link = a->l, .is_send = true, .buf = out, .n = a->n},
                    {.link = a->l, .is_send = false, .buf = in, .n = a->n}};
    char err[LK_ERRLEN];
    a->st = lk_xfer_run(x, 2, lk_deadline_ms(5000), err, sizeof err);
    if (a->st) printf("  %s\n", err);
    unsigned other = a->seed == 1 ? 2 : 1;
    for (size_t i = 0; i < a->n; i++) a->bad += in[i] != (unsigned char)(i * 13 + other);
    free(out);
    free(in);
    return NULL;
}

static void check_swap(lk_link *l0, lk_link *l1, size_t n) {
    swap_arg s0 = {.l = l0, .n = n, .seed = 1}, s1 = {.l = l1, .n = n, .seed = 2};
    pthread_t t0, t1;
    pthread_create(&t0, NULL, swap_thread, &s0);
    pthread_create(&t1, NULL, swap_thread, &s1);
    pthread_join(t0, NULL);
    pthread_join(t1, NULL);
    CHECK(s0.st == LK_OK && s1.st == LK_OK);
    CHECK(s0.bad == 0 && s1.bad == 0);
}

TEST(tcp_full_duplex_large) {
    lk_link *a, *b;
    connected_pair(&a, &b);
    check_swap(a, b, 8u << 20);
    lk_link_close(a);
    lk_link_close(b);
}

TEST(mesh_tcp_and_shm) {
    for (int mode = 0; mode < 2; mode++) {
        lk_mesh *m[3] = {0};
        bool ok = build_meshes(3, mode ? LK_MESH_SHM_AUTO : LK_MESH_SHM_OFF, m);
        CHECK(ok);
        if (!ok) continue;
        for (int r = 0; r < 3; r++) {
            CHECK(lk_mesh_rank(m[r]) == r && lk_mesh_size(m[r]) == 3);
            CHECK(lk_mesh_link(m[r], r) == NULL);
            for (int s = 0; s < 3; s++) {
                if (s == r) continue;
                lk_link *l = lk_mesh_link(m[r], s);
                CHECK(l->peer_rank == s);
                CHECKF(!strcmp(l->ops->name, mode ? "shm" : "tcp"), "mode %d got %s", mode, l->ops->name);
                CHECK(!strcmp(lk_mesh_ctl(m[r], s)->ops->name, "tcp"));
            }
        }
        /* 3 MiB each way through a 1 MiB ring (or socket buffers). */
        check_swap(lk_mesh_link(m[0], 2), lk_mesh_link(m[2], 0), 3u << 20);
        check_swap(lk_mesh_link(m[1], 2), lk_mesh_link(m[2], 1), 1000);
        for (int r = 0; r < 3; r++) lk_mesh_free(m[r]);
    }
}

/* A stray connection sending garbage to a rank's listener while the mesh
 * forms is refused, and the mesh still forms. */
TEST(mesh_ignores_stray_connection) {
    char err[LK_ERRLEN], abuf[2][32];
    const char *addrs[2];
    int lfd[2], port[2];
    for (int r = 0; r < 2; r++) {
        LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd[r], &port[r], err, sizeof err));
        snprintf(abuf[r], 32, "127.0.0.1:%d", port[r]);
        addrs[r] = abuf[r];
    }
    lk_link *stray;
    LK_ASSERT(!lk_tcp_connect(addrs[0], lk_deadline_ms(1000), &stray, err, sizeof err));
    char junk[sizeof(int) * 64];
    memset(junk, 0x5a, sizeof junk);
    lk_link_send(stray, junk, sizeof junk, lk_deadline_ms(1000), err, sizeof err);
    mesh_arg a[2];
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
        a[r] = (mesh_arg){.rank = r, .n = 2, .lfd = lfd[r], .addrs = addrs, .shm = LK_MESH_SHM_OFF};
        pthread_create(&th[r], NULL, mesh_thread, &a[r]);
    }
    for (int r = 0; r < 2; r++) {
        pthread_join(th[r], NULL);
        CHECKF(a[r].st == LK_OK, "rank %d: %s", r, a[r].err);
        close(lfd[r]);
    }
    if (!a[0].st && !a[1].st) check_swap(lk_mesh_link(a[0].mesh, 1), lk_mesh_link(a[1].mesh, 0), 1000);
    for (int r = 0; r < 2; r++) lk_mesh_free(a[r].mesh);
    lk_link_close(stray);
}

/* A peer process that dies while we wait on the shm ring: noticed through
 * the control connection, quickly, with an error naming it. */
TEST(shm_peer_death) {
    int lfd[2], port[2];
    char err[LK_ERRLEN], addrs_buf[2][32];
    const char *addrs[2];
    for (int r = 0; r < 2; r++) {
        LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd[r], &port[r], err, sizeof err));
        snprintf(addrs_buf[r], 32, "127.0.0.1:%d", port[r]);
        addrs[r] = addrs_buf[r];
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        lk_mesh *m;
        lk_mesh_params mp = {.rank = 1, .n = 2, .addrs = addrs, .listen_fd = lfd[1],
                             .shm = LK_MESH_SHM_FORCE, .spin_ns = 0, .timeout_ms = 5000};
        if (lk_mesh_create(&mp, &m, err, sizeof err)) _exit(3);
        char c = 1;
        lk_link_send(lk_mesh_link(m, 0), &c, 1, lk_deadline_ms(1000), err, sizeof err);
        usleep(100000);
        _exit(0); /* dies without a word */
    }
    close(lfd[1]);
    lk_mesh *m = NULL;
    lk_mesh_params mp = {.rank = 0, .n = 2, .addrs = addrs, .listen_fd = lfd[0],
                         .shm = LK_MESH_SHM_FORCE, .spin_ns = 0, .timeout_ms = 5000};
    lk_status st = lk_mesh_create(&mp, &m, err, sizeof err);
    close(lfd[0]);
    CHECKF(st == LK_OK, "%s", err);
    if (!st) {
        char c = 0, more[16];
        CHECK(!lk_link_recv(lk_mesh_link(m, 0 + 1), &c, 1, lk_deadline_ms(2000), err, sizeof err) && c == 1);
        uint64_t t0 = lk_time_ns();
        st = lk_link_recv(lk_mesh_link(m, 1), more, sizeof more, lk_deadline_ms(10000), err, sizeof err);
        double ms = (double)(lk_time_ns() - t0) / 1e6;
        CHECK(st == LK_ERR_NET);
        CHECKF(ms < 1000, "noticed after %.0f ms", ms);
        CHECKF(strstr(err, "rank 1") && strstr(err, "gone"), "%s", err);
        lk_mesh_free(m);
    }
    int ws;
    waitpid(pid, &ws, 0);
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    lk_log_set_level(LK_LOG_WARN);
    RUN(addr_split);
    RUN(tcp_connect_refused);
    RUN(tcp_partial_reads);
    RUN(tcp_deadline_and_close);
    RUN(tcp_full_duplex_large);
    RUN(mesh_tcp_and_shm);
    RUN(mesh_ignores_stray_connection);
    RUN(shm_peer_death);
    return lk_test_end();
}
