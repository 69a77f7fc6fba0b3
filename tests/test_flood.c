/* Availability before authentication (issue 14): nobody without the key
 * keeps a head out. Real processes on loopback: a worker daemon (forked,
 * lk_worker_serve), an attacker process holding 200 silent connections and
 * a slow-loris client (one byte a second), and a head that is the real
 * program ($LOCKSTEP run --workers) generating with stories260K; then the
 * same against the listeners of a mesh being built (lk_mesh_create in
 * three processes with the cluster handshake). The attackers come from
 * 127.0.0.2 (another address) unless a test says otherwise. */
#include "lk_test.h"
#include "cluster/cluster.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROMPT "Once upon a time"

static char key_file[128], tmp[64];
static uint8_t key[LK_KEY_BYTES];

static double secs_since(uint64_t t0) { return (double)(lk_time_ns() - t0) / 1e9; }

/* ---- the attacker ------------------------------------------------------------- */

typedef struct {
    const char *src;   /* source address of every connection */
    int ports[2], n_ports;
    int silent;        /* connections that never send a byte, per port */
    bool loris;        /* and one per port that sends a byte a second */
    int every_ms;      /* > 0: instead, one new connection a byte long every every_ms (a busy-maker) */
    int for_ms;        /* ... for this long, then nothing */
} attack;

static int open_from(const char *src, int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, src, &a.sin_addr);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0) { close(fd); return -1; }
    struct sockaddr_in d = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &d.sin_addr);
    if (connect(fd, (struct sockaddr *)&d, sizeof d) != 0 && errno != EINPROGRESS) { close(fd); return -1; }
    return fd;
}

/* Runs in its own process until killed: keeps every connection open,
 * reopening those the target closes (one every 5 ms, so a refused flood is
 * a steady pressure, not a busy loop on a machine of two cores). Writes
 * one byte to ready once the first round is open. */
static void attacker_main(const attack *a, int ready) {
    enum { MAXC = 512 };
    static int fd[MAXC], port[MAXC];
    static bool is_loris[MAXC];
    static uint64_t next_byte[MAXC];
    static size_t sent[MAXC];
    static const uint8_t hello_start[] = {'L', 'K', 'W', '1', 3, 0, 1, 0, 0, 0, 0, 0, 32, 0, 0, 0};
    int n = 0;
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (a->every_ms > 0) {
        uint64_t end = lk_time_ns() + (uint64_t)a->for_ms * 1000000ull;
        int k = 0;
        if (write(ready, "x", 1) != 1) _exit(1);
        while (lk_time_ns() < end) {
            if (fd[k % 64] > 0) close(fd[k % 64]);
            fd[k % 64] = open_from(a->src, a->ports[0]);
            usleep(2000);
            if (fd[k % 64] >= 0) send(fd[k % 64], "L", 1, MSG_NOSIGNAL);
            k++;
            usleep((useconds_t)a->every_ms * 1000);
        }
        pause();
        _exit(0);
    }
    for (int p = 0; p < a->n_ports; p++)
        for (int i = 0; i < a->silent + (a->loris ? 1 : 0) && n < MAXC; i++, n++) {
            port[n] = a->ports[p];
            is_loris[n] = i == a->silent;
            fd[n] = open_from(a->src, port[n]);
            next_byte[n] = lk_time_ns();
            sent[n] = 0;
        }
    if (write(ready, "x", 1) != 1) _exit(1);
    static struct pollfd pf[MAXC];
    uint64_t next_open = 0;
    for (;;) {
        uint64_t now = lk_time_ns();
        for (int i = 0; i < n; i++) {
            if (fd[i] < 0 && now >= next_open) {
                next_open = now + 5000000ull;
                fd[i] = open_from(a->src, port[i]);
                next_byte[i] = now;
                sent[i] = 0;
            }
            if (fd[i] >= 0 && is_loris[i] && now >= next_byte[i]) {
                send(fd[i], hello_start + sent[i] % sizeof hello_start, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
                sent[i]++;
                next_byte[i] = now + 1000000000ull;
            }
            pf[i] = (struct pollfd){.fd = fd[i], .events = POLLIN};
        }
        poll(pf, (nfds_t)n, 10);
        for (int i = 0; i < n; i++) {
            if (fd[i] < 0 || !(pf[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            char buf[2048];
            ssize_t k = recv(fd[i], buf, sizeof buf, MSG_DONTWAIT);
            if (k == 0 || (k < 0 && errno != EAGAIN)) {
                close(fd[i]);
                fd[i] = -1;
            }
        }
    }
}

static pid_t start_attack(const attack *a) {
    int pp[2];
    LK_ASSERT(pipe(pp) == 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(pp[0]);
        attacker_main(a, pp[1]);
        _exit(0);
    }
    close(pp[1]);
    char c;
    LK_ASSERT(read(pp[0], &c, 1) == 1);
    close(pp[0]);
    usleep(300000); /* the connections are in before anyone legitimate comes */
    return pid;
}

static void stop(pid_t pid) {
    int ws;
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, &ws, 0);
}

/* ---- a worker daemon and the real program as its head -------------------------- */

static pid_t start_worker(int *port, const char *log) {
    int lfd;
    char err[LK_ERRLEN];
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd, port, err, sizeof err));
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        lk_log_set_level(LK_LOG_INFO);
        lk_worker_opts wo = {.listen_fd = lfd, .key = key, .n_threads = 1};
        lk_worker_serve(&wo, err, sizeof err);
        _exit(1);
    }
    close(lfd);
    return pid;
}

/* Runs the program with args (NULL-terminated), stdout and stderr to
 * files; killed after limit_s. Returns the exit status (-1: killed). */
static int run_prog(const char *const *args, const char *out, const char *errf, double limit_s, double *took) {
    uint64_t t0 = lk_time_ns();
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600), e = open(errf, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(o, 1);
        dup2(e, 2);
        execv(args[0], (char *const *)args);
        _exit(127);
    }
    int ws = 0;
    while (waitpid(pid, &ws, WNOHANG) == 0) {
        if (secs_since(t0) > limit_s) {
            kill(pid, SIGKILL);
            waitpid(pid, &ws, 0);
            *took = secs_since(t0);
            return -1;
        }
        usleep(20000);
    }
    *took = secs_since(t0);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static char *slurp(const char *path) {
    static char buf[4][8192];
    static int k;
    char *b = buf[k++ & 3];
    b[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return b;
    size_t n = fread(b, 1, sizeof buf[0] - 1, f);
    b[n] = 0;
    fclose(f);
    return b;
}

static char reference[8192];

/* The worker wrote no sanitizer report (it is killed, not ended: a leak
 * report would never come, but a memory error is written when it happens). */
static void clean_log(const char *log) {
    const char *l = slurp(log);
    CHECKF(!strstr(l, "Sanitizer") && !strstr(l, "runtime error"), "worker log: %s", l);
}

/* The head generates through the worker at port and writes what one node
 * writes, within the 10 s it gives a worker to answer. */
static void head_generates(int port, const char *what, const char *want_err) {
    char addr[32], out[96], errf[96];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    snprintf(out, sizeof out, "%s.out", tmp);
    snprintf(errf, sizeof errf, "%s.err", tmp);
    const char *args[] = {lk_test_bin(), "run", "-m", lk_td("models/stories260K.gguf"), "-p", PROMPT, "-n", "16", "--temp", "0",
                          "-t", "1", "--workers", addr, "--key-file", key_file, NULL};
    double took;
    int rc = run_prog(args, out, errf, 40, &took);
    const char *e = slurp(errf);
    CHECKF(rc == 0, "%s: head exit %d after %.1f s: %s", what, rc, took, e);
    CHECKF(rc != 0 || !strcmp(slurp(out), reference), "%s: head wrote '%s', one node '%s'", what, slurp(out), reference);
    CHECKF(took < 10.0, "%s: the head took %.1f s", what, took);
    if (want_err) CHECKF(strstr(e, want_err), "%s: no '%s' in: %s", what, want_err, e);
    printf("  %s: head done in %.2f s\n", what, took);
}

static void make_reference(void) {
    char out[96], errf[96];
    snprintf(out, sizeof out, "%s.ref", tmp);
    snprintf(errf, sizeof errf, "%s.referr", tmp);
    const char *args[] = {lk_test_bin(), "run", "-m", lk_td("models/stories260K.gguf"), "-p", PROMPT, "-n", "16", "--temp", "0",
                          "-t", "1", NULL};
    double took;
    int rc = run_prog(args, out, errf, 30, &took);
    LK_ASSERT(rc == 0);
    snprintf(reference, sizeof reference, "%s", slurp(out));
}

/* 200 silent connections and a slow loris from another address: the head
 * is served as if they were not there. */
TEST(worker_flood_other_address) {
    int port;
    char log[96];
    snprintf(log, sizeof log, "%s.w1", tmp);
    pid_t w = start_worker(&port, log);
    attack a = {.src = "127.0.0.2", .ports = {port}, .n_ports = 1, .silent = 200, .loris = true};
    pid_t att = start_attack(&a);
    head_generates(port, "flood from 127.0.0.2", NULL);
    /* and again once the slow loris has been dropped at least once */
    usleep(1500000);
    head_generates(port, "flood from 127.0.0.2, later", NULL);
    stop(att);
    stop(w);
    clean_log(log);
    const char *l = slurp(log);
    CHECKF(strstr(l, "refused 127.0.0.2:"), "worker log: %s", l);
}

/* The same flood from the head's own address: silent connections give way
 * to the head's, which speaks at once. */
TEST(worker_flood_same_address) {
    int port;
    char log[96];
    snprintf(log, sizeof log, "%s.w2", tmp);
    pid_t w = start_worker(&port, log);
    attack a = {.src = "127.0.0.1", .ports = {port}, .n_ports = 1, .silent = 200, .loris = true};
    pid_t att = start_attack(&a);
    head_generates(port, "flood from 127.0.0.1", NULL);
    stop(att);
    stop(w);
    clean_log(log);
}

/* Fresh connections that each send a byte, faster than the gate lets them
 * age, fill the places of the head's address: the head is told "busy" (an
 * ERROR frame, not a reset), tries again, and gets in once they stop. */
TEST(head_retries_busy_worker) {
    int port;
    char log[96];
    snprintf(log, sizeof log, "%s.w3", tmp);
    pid_t w = start_worker(&port, log);
    attack a = {.src = "127.0.0.1", .ports = {port}, .n_ports = 1, .every_ms = 10, .for_ms = 1500};
    pid_t att = start_attack(&a);
    head_generates(port, "busy worker", "was busy; in after");
    stop(att);
    stop(w);
    clean_log(log);
    CHECKF(strstr(slurp(log), LK_GATE_BUSY), "worker log: %s", slurp(log));
}

/* A worker that is busy every time (a stand-in answering LK_GATE_BUSY to
 * every connection): the head tries for its 10 s, then says what it was
 * told and how often. */
TEST(head_gives_up_on_busy_worker) {
    int lfd, port;
    char err[LK_ERRLEN];
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd, &port, err, sizeof err));
    fflush(NULL);
    pid_t busy = fork();
    if (busy == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (;;) {
            lk_link *l;
            if (lk_tcp_accept(lfd, lk_deadline_ms(1000), &l, err, sizeof err)) continue;
            lk_chan c;
            lk_chan_init(&c, l);
            lk_chan_send_error(&c, LK_GATE_BUSY);
            usleep(20000);
            lk_link_close(l);
        }
    }
    close(lfd);
    char addr[32], out[96], errf[96];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    snprintf(out, sizeof out, "%s.out", tmp);
    snprintf(errf, sizeof errf, "%s.err", tmp);
    const char *args[] = {lk_test_bin(), "run", "-m", lk_td("models/stories260K.gguf"), "-p", PROMPT, "-n", "4", "-t", "1",
                          "--workers", addr, "--key-file", key_file, NULL};
    double took;
    int rc = run_prog(args, out, errf, 30, &took);
    const char *e = slurp(errf);
    CHECKF(rc == 1, "head exit %d", rc);
    CHECKF(took > 8.0 && took < 12.0, "gave up after %.1f s", took);
    CHECKF(strstr(e, "worker rank 1: ") && strstr(e, "refused: " LK_GATE_BUSY) && strstr(e, " attempts in "), "%s", e);
    printf("  %s", e);
    stop(busy);
}

/* A client that sends half a header and closes its side can send no more:
 * it is answered (HELLO, then an ERROR saying why) and closed at once, not
 * watched until the 2 s limit (the socket would stay readable all along). */
TEST(half_closed_dropped_at_once) {
    int port;
    char log[96], err[LK_ERRLEN];
    snprintf(log, sizeof log, "%s.w4", tmp);
    pid_t w = start_worker(&port, log);
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    lk_link *l;
    LK_ASSERT(!lk_tcp_connect(addr, lk_deadline_ms(2000), &l, err, sizeof err));
    uint64_t t0 = lk_time_ns();
    LK_ASSERT(!lk_link_send(l, "LKW1\x03\x00", 6, lk_deadline_ms(500), err, sizeof err));
    shutdown(lk_tcp_fd(l), SHUT_WR);
    char got[2048];
    size_t n = 0;
    while (n < sizeof got - 1 && secs_since(t0) < 3.0) {
        struct pollfd pf = {.fd = lk_tcp_fd(l), .events = POLLIN};
        poll(&pf, 1, 100);
        ssize_t k = recv(lk_tcp_fd(l), got + n, sizeof got - 1 - n, MSG_DONTWAIT);
        if (k == 0) break;
        if (k > 0) n += (size_t)k;
    }
    double took = secs_since(t0);
    got[n] = 0;
    CHECKF(took < 1.0, "closed after %.2f s", took);
    CHECKF(n > 56 && memmem(got, n, "closed the connection after 6 bytes", 35), "got %zu bytes", n);
    lk_link_close(l);
    stop(w);
    clean_log(log);
}

/* ---- the mesh listener during setup ----------------------------------------------- */

static lk_status mesh_rank(int rank, int n, const char *const *addrs, int lfd, uint64_t timeout_ms, char *err) {
    char role[24];
    snprintf(role, sizeof role, "rank %d", rank);
    lk_hs_params hp;
    lk_hs_defaults(&hp, key, role);
    lk_mesh_params mp = {.rank = rank, .n = n, .addrs = addrs, .listen_fd = lfd, .shm = LK_MESH_SHM_OFF,
                         .spin_ns = 0, .timeout_ms = timeout_ms, .auth = &lk_hs_mesh_auth, .auth_ctx = &hp};
    lk_mesh *m = NULL;
    lk_status st = lk_mesh_create(&mp, &m, err, LK_ERRLEN);
    if (!st) {
        /* the mesh carries bytes: one to every peer and back */
        uint8_t b = (uint8_t)rank, got;
        for (int r = 0; r < n && !st; r++)
            if (r != rank) st = lk_link_send(lk_mesh_link(m, r), &b, 1, lk_deadline_ms(5000), err, LK_ERRLEN);
        for (int r = 0; r < n && !st; r++)
            if (r != rank) {
                st = lk_link_recv(lk_mesh_link(m, r), &got, 1, lk_deadline_ms(5000), err, LK_ERRLEN);
                if (!st && got != r) st = lk_fail(err, LK_ERRLEN, LK_ERR_FORMAT, "got %d from rank %d", got, r);
            }
    }
    lk_mesh_free(m);
    return st;
}

/* Three ranks build a mesh with the cluster handshake and the session's
 * 20 s deadline while the listeners of ranks 0 and 1 each hold 200 silent
 * connections and a slow loris: built within a few seconds. */
TEST(mesh_flood) {
    enum { N = 3 };
    int lfd[N], port[N];
    char buf[N][32], err[LK_ERRLEN];
    const char *addrs[N];
    for (int r = 0; r < N; r++) {
        LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd[r], &port[r], err, sizeof err));
        snprintf(buf[r], sizeof buf[r], "127.0.0.1:%d", port[r]);
        addrs[r] = buf[r];
    }
    attack a = {.src = "127.0.0.2", .ports = {port[0], port[1]}, .n_ports = 2, .silent = 200, .loris = true};
    pid_t att = start_attack(&a);
    uint64_t t0 = lk_time_ns();
    pid_t kid[N] = {0};
    for (int r = 1; r < N; r++) {
        fflush(NULL);
        if ((kid[r] = fork()) == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            lk_log_set_level(LK_LOG_ERROR);
            lk_status st = mesh_rank(r, N, addrs, lfd[r], 20000, err);
            if (st) printf("  rank %d: %s\n", r, err);
            fflush(stdout);
            _exit(st ? 3 : 0);
        }
    }
    lk_status st = mesh_rank(0, N, addrs, lfd[0], 20000, err);
    double took = secs_since(t0);
    CHECKF(st == LK_OK, "rank 0 after %.1f s: %s", took, err);
    CHECKF(took < 5.0, "the mesh took %.1f s", took);
    for (int r = 1; r < N; r++) {
        int ws;
        waitpid(kid[r], &ws, 0);
        CHECKF(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "rank %d ended with %d", r, ws);
    }
    for (int r = 0; r < N; r++) close(lfd[r]);
    stop(att);
    printf("  mesh of %d built in %.2f s under the flood\n", N, took);
}

/* A rank that never comes, while strays knock: the setup ends at its
 * deadline and says which rank is missing and what came instead (ten idle
 * connections used to cost 3 s each and hide the cause). */
TEST(mesh_failure_names_cause) {
    int lfd, port, unused_lfd, unused_port;
    char buf[2][32], err[LK_ERRLEN];
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd, &port, err, sizeof err));
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &unused_lfd, &unused_port, err, sizeof err));
    snprintf(buf[0], sizeof buf[0], "127.0.0.1:%d", port);
    snprintf(buf[1], sizeof buf[1], "127.0.0.1:%d", unused_port);
    const char *addrs[2] = {buf[0], buf[1]};
    attack a = {.src = "127.0.0.2", .ports = {port}, .n_ports = 1, .silent = 10};
    pid_t att = start_attack(&a);
    uint64_t t0 = lk_time_ns();
    lk_status st = mesh_rank(0, 2, addrs, lfd, 2500, err);
    double took = secs_since(t0);
    CHECK(st == LK_ERR_TIMEOUT);
    CHECKF(took < 4.0, "gave up after %.1f s", took);
    CHECKF(strstr(err, "rank 1 never connected within 2.5 s") && strstr(err, "refused") &&
               strstr(err, "127.0.0.2:"),
           "%s", err);
    printf("  %s\n", err);
    stop(att);
    close(lfd);
    close(unused_lfd);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    lk_log_set_level(LK_LOG_ERROR);
    snprintf(tmp, sizeof tmp, "/tmp/lk-flood-%d", (int)getpid());
    snprintf(key_file, sizeof key_file, "%s.key", tmp);
    char hex[2 * LK_KEY_BYTES + 1], err[LK_ERRLEN];
    lk_key_generate(hex);
    FILE *f = fopen(key_file, "w");
    fprintf(f, "%s\n", hex);
    fclose(f);
    LK_ASSERT(!lk_key_load(key_file, key, err, sizeof err));
    make_reference();
    RUN(worker_flood_other_address);
    RUN(worker_flood_same_address);
    RUN(head_retries_busy_worker);
    RUN(head_gives_up_on_busy_worker);
    RUN(half_closed_dropped_at_once);
    RUN(mesh_flood);
    RUN(mesh_failure_names_cause);
    const char *sfx[] = {".key", ".out", ".err", ".ref", ".referr", ".w1", ".w2", ".w3", ".w4"};
    for (size_t i = 0; i < sizeof sfx / sizeof sfx[0]; i++) {
        char p[96];
        snprintf(p, sizeof p, "%s%s", tmp, sfx[i]);
        unlink(p);
    }
    return lk_test_end();
}
