/* TCP transport: one non-blocking socket per peer, TCP_NODELAY (a 4-byte
 * all-reduce must not wait 40 ms for Nagle), MSG_NOSIGNAL (a dead peer is an
 * error, not a SIGPIPE that kills the head). */
#include "transport/transport.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    lk_link base; /* first: an lk_link * is a tcp_link * */
    int fd;
} tcp_link;

static ssize_t tcp_send_some(lk_link *l, const void *buf, size_t n, char *err, size_t errlen) {
    tcp_link *t = (tcp_link *)l;
    for (;;) {
        ssize_t k = send(t->fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k >= 0) return k;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        lk_fail(err, errlen, LK_ERR_NET, "send: %s", strerror(errno));
        return -1;
    }
}

static ssize_t tcp_recv_some(lk_link *l, void *buf, size_t n, char *err, size_t errlen) {
    tcp_link *t = (tcp_link *)l;
    for (;;) {
        ssize_t k = recv(t->fd, buf, n, MSG_DONTWAIT);
        if (k > 0) return k;
        if (k == 0) {
            lk_fail(err, errlen, LK_ERR_NET, "connection closed by peer");
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        lk_fail(err, errlen, LK_ERR_NET, "recv: %s", strerror(errno));
        return -1;
    }
}

static int tcp_poll_fd(lk_link *l) { return ((tcp_link *)l)->fd; }

static void tcp_close(lk_link *l) {
    tcp_link *t = (tcp_link *)l;
    if (t->fd >= 0) close(t->fd);
    free(t);
}

static const lk_link_ops tcp_ops = {
    .name = "tcp",
    .send_some = tcp_send_some,
    .recv_some = tcp_recv_some,
    .poll_fd = tcp_poll_fd,
    .wait = NULL,
    .close = tcp_close,
};

int lk_tcp_fd(const lk_link *l) {
    while (l && l->ops != &tcp_ops && l->ops->inner) l = l->ops->inner(l); /* under a seal */
    return l && l->ops == &tcp_ops ? ((const tcp_link *)l)->fd : -1;
}

bool lk_tcp_peer_gone(const lk_link *l, char *why, size_t n) {
    int fd = lk_tcp_fd(l);
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 0) <= 0) return false;
    char c;
    ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        snprintf(why, n, "peer process gone (control connection %s)", k == 0 ? "closed" : strerror(errno));
        return true;
    }
    return false;
}

static void set_socket_options(int fd) {
    int one = 1;
    /* Failure here only costs speed, never correctness: ignore. */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) (void)fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
}

lk_link *lk_tcp_wrap(int fd, const char *peer_addr) {
    tcp_link *t = lk_xcalloc(1, sizeof *t);
    t->base.ops = &tcp_ops;
    t->base.peer_rank = -1;
    t->base.spin_ns = 0;
    snprintf(t->base.peer_addr, sizeof t->base.peer_addr, "%s", peer_addr ? peer_addr : "?");
    t->fd = fd;
    set_socket_options(fd);
    return &t->base;
}

bool lk_addr_split(const char *addr, char *host, size_t hostlen, int *port) {
    if (!addr) return false;
    const char *colon;
    const char *h0 = addr, *h1;
    if (addr[0] == '[') {
        const char *rb = strchr(addr, ']');
        if (!rb || rb[1] != ':') return false;
        h0 = addr + 1;
        h1 = rb;
        colon = rb + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon) return false;
        h1 = colon;
    }
    size_t hl = (size_t)(h1 - h0);
    if (hl >= hostlen) return false;
    memcpy(host, h0, hl);
    host[hl] = 0;
    char *end = NULL;
    errno = 0;
    long p = strtol(colon + 1, &end, 10);
    if (errno || end == colon + 1 || *end || p < 0 || p > 65535) return false;
    *port = (int)p;
    return true;
}

static lk_status resolve(const char *addr, bool passive, struct addrinfo **res, char *err, size_t errlen) {
    char host[256];
    int port;
    if (!lk_addr_split(addr, host, sizeof host, &port))
        return lk_fail(err, errlen, LK_ERR_ARG, "bad address '%s' (expected HOST:PORT)", addr);
    char ports[16];
    snprintf(ports, sizeof ports, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    const char *h = host;
    if (passive && (!host[0] || !strcmp(host, "*"))) h = NULL;
    int rc = getaddrinfo(h, ports, &hints, res);
    if (rc != 0) return lk_fail(err, errlen, LK_ERR_NET, "resolve '%s': %s", addr, gai_strerror(rc));
    return LK_OK;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* One non-blocking connect attempt, waiting until the deadline. Returns the
 * fd or -1 with errno-ish reason in *why. */
static int try_connect(const struct addrinfo *ai, uint64_t deadline_ns, int *why) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) { *why = errno; return -1; }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
    if (errno != EINPROGRESS) { *why = errno; close(fd); return -1; }
    for (;;) {
        uint64_t now = lk_time_ns();
        if (now >= deadline_ns) { *why = ETIMEDOUT; close(fd); return -1; }
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int ms = (int)((deadline_ns - now + 999999) / 1000000);
        int r = poll(&p, 1, ms);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { *why = errno; close(fd); return -1; }
        if (r == 0) continue;
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        if (soerr) { *why = soerr; close(fd); return -1; }
        return fd;
    }
}

lk_status lk_tcp_connect(const char *addr, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen) {
    *out = NULL;
    struct addrinfo *res = NULL;
    lk_status st = resolve(addr, false, &res, err, errlen);
    if (st) return st;
    int why = 0, fd = -1;
    /* What the peer answered last: the attempt cut short by the deadline
     * ends in ETIMEDOUT, but a port that refused every attempt before it
     * must be reported as refused, not as a silent host. */
    int seen = 0, tries = 0;
    uint64_t t0 = lk_time_ns();
    /* A peer that is still starting refuses: retry until the deadline. */
    for (;;) {
        for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
            fd = try_connect(ai, deadline_ns, &why);
            tries++;
            if (fd < 0 && why != ETIMEDOUT) seen = why;
        }
        if (fd >= 0 || lk_time_ns() >= deadline_ns) break;
        if (why != ECONNREFUSED && why != EAGAIN && why != ENETUNREACH && why != EHOSTUNREACH) break;
        sleep_ms(20);
    }
    freeaddrinfo(res);
    if (fd < 0) {
        double s = (double)(lk_time_ns() - t0) / 1e9;
        if (why == ETIMEDOUT && seen) why = seen;
        if (why == ECONNREFUSED)
            return lk_fail(err, errlen, LK_ERR_NET,
                           "connect to %s: connection refused (%d attempts in %.1f s): is a worker listening on %s?",
                           addr, tries, s, addr);
        if (why == ETIMEDOUT)
            return lk_fail(err, errlen, LK_ERR_TIMEOUT, "connect to %s: timed out after %.1f s without an answer (host down, or packets dropped?)",
                           addr, s);
        return lk_fail(err, errlen, LK_ERR_NET, "connect to %s: %s (%d attempts in %.1f s)", addr, strerror(why), tries, s);
    }
    *out = lk_tcp_wrap(fd, addr);
    return LK_OK;
}

lk_status lk_tcp_listen(const char *addr, int *fd_out, int *port_out, char *err, size_t errlen) {
    *fd_out = -1;
    struct addrinfo *res = NULL;
    lk_status st = resolve(addr, true, &res, err, errlen);
    if (st) return st;
    int fd = -1, why = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) { why = errno; continue; }
        int one = 1;
        /* A restarted worker must be able to bind while old connections sit in TIME_WAIT. */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        /* A long backlog: a flood of connections made while nobody accepts
         * (a mesh listener before its accept phase) must not crowd out the
         * peers' SYNs, which would then wait out their retransmit timer. */
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 1024) == 0) break;
        why = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) return lk_fail(err, errlen, LK_ERR_NET, "listen on %s: %s", addr, strerror(why));
    if (port_out) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        getsockname(fd, (struct sockaddr *)&ss, &sl);
        *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                             : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    }
    *fd_out = fd;
    return LK_OK;
}

/* "host:port" of an accepted peer, for messages. */
static void peer_name(const struct sockaddr_storage *ss, socklen_t sl, char *name, size_t len) {
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    getnameinfo((const struct sockaddr *)ss, sl, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(name, len, strchr(host, ':') ? "[%s]:%s" : "%s:%s", host, serv);
}

lk_status lk_tcp_accept(int listen_fd, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen) {
    *out = NULL;
    for (;;) {
        uint64_t now = lk_time_ns();
        if (now >= deadline_ns) return lk_fail(err, errlen, LK_ERR_TIMEOUT, "accept: no connection before the deadline");
        struct pollfd p = {.fd = listen_fd, .events = POLLIN};
        int ms = (int)LK_MIN((deadline_ns - now + 999999) / 1000000, 1000000000ull);
        int r = poll(&p, 1, ms);
        if (r < 0 && errno != EINTR) return lk_fail(err, errlen, LK_ERR_NET, "accept: poll: %s", strerror(errno));
        if (r <= 0) continue;
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(listen_fd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC);
        if (fd < 0) {
            /* The connection may have been reset before we took it: keep listening. */
            if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED || errno == EPROTO) continue;
            return lk_fail(err, errlen, LK_ERR_NET, "accept: %s", strerror(errno));
        }
        char name[96];
        peer_name(&ss, sl, name, sizeof name);
        *out = lk_tcp_wrap(fd, name);
        return LK_OK;
    }
}

/* ---- the gate ------------------------------------------------------------------ */

/* A newcomer may take a waiting connection's place when that one has said
 * nothing for EVICT_SILENT_NS or has not got ready in EVICT_SLOW_NS. An
 * honest initiator speaks first and at once: its first bytes leave right
 * behind the ACK that made the connection acceptable, whatever the round
 * trip, so 10 ms of silence is a stray. Getting ready takes it one round
 * trip. The one evicted is told LK_GATE_BUSY all the same (it may be an
 * honest peer on a machine too loaded to write in time). */
#define EVICT_SILENT_NS 10000000ull
#define EVICT_SLOW_NS 500000000ull

typedef struct {
    lk_link *l;
    uint64_t t0;   /* accepted */
    size_t seen;   /* bytes received so far (peeked; 0: silent) */
    uint8_t host[17]; /* address length + bytes: v4, or an IPv6 /64 */
    bool opened;   /* auth->open ran */
    uint8_t state[LK_AUTH_STATE];
} gate_conn;

struct lk_gate {
    int lfd;
    lk_gate_params p;
    gate_conn *c; /* [p.max_pending] */
    int n;
    uint8_t *peek; /* [p.auth->ready_max] */
    struct pollfd *pf; /* [1 + p.max_pending]: the listener, then c */
    lk_link **rd;      /* [p.max_pending]: readable this turn */
    bool *rd_ended;    /* [p.max_pending]: ... and the peer closed its side */
    int refused;
    char last[LK_ERRLEN + 100]; /* "host:port: why" */
};

lk_gate *lk_gate_new(int listen_fd, const lk_gate_params *p) {
    LK_ASSERT(p->auth && p->auth->ready && p->auth->ready_max > 0);
    lk_gate *g = lk_xcalloc(1, sizeof *g);
    g->lfd = listen_fd;
    g->p = *p;
    if (g->p.first_byte_ms <= 0) g->p.first_byte_ms = 1000;
    if (g->p.ready_ms <= 0) g->p.ready_ms = 2000;
    if (g->p.max_pending <= 0) g->p.max_pending = 128;
    if (g->p.max_per_host <= 0) g->p.max_per_host = 8;
    g->c = lk_xcalloc((size_t)g->p.max_pending, sizeof *g->c);
    g->peek = lk_xmalloc(g->p.auth->ready_max);
    g->pf = lk_xcalloc((size_t)g->p.max_pending + 1, sizeof *g->pf);
    g->rd = lk_xcalloc((size_t)g->p.max_pending, sizeof *g->rd);
    g->rd_ended = lk_xcalloc((size_t)g->p.max_pending, sizeof *g->rd_ended);
    /* accept until EAGAIN in one turn: a burst is taken whole */
    int fl = fcntl(listen_fd, F_GETFL);
    if (fl >= 0) (void)fcntl(listen_fd, F_SETFL, fl | O_NONBLOCK);
    return g;
}

/* Closes without a reset: what the peer sent is read first (closing with
 * unread bytes makes the kernel answer RST, which may destroy the ERROR
 * frame we just sent before the peer reads it), then FIN. */
static void close_gently(lk_link *l) {
    int fd = lk_tcp_fd(l);
    char buf[4096];
    for (int i = 0; i < 16 && recv(fd, buf, sizeof buf, MSG_DONTWAIT) > 0; i++) {}
    shutdown(fd, SHUT_WR);
    lk_link_close(l);
}

static void note_refusal(lk_gate *g, const char *peer, const char *why) {
    g->refused++;
    snprintf(g->last, sizeof g->last, "%s: %s", peer, why);
    if (g->p.on_refuse) g->p.on_refuse(g->p.refuse_ctx, peer, why);
}

static void refuse_link(lk_gate *g, lk_link *l, bool opened, const char *why) {
    if (g->p.auth->refuse) g->p.auth->refuse(g->p.auth_ctx, l, opened, why);
    note_refusal(g, l->peer_addr, why);
    close_gently(l);
}

void lk_gate_refuse(lk_gate *g, lk_link *l, const char *why) { refuse_link(g, l, true, why); }

int lk_gate_refused(const lk_gate *g, char *last, size_t len) {
    if (last && len) snprintf(last, len, "%s", g->last);
    return g->refused;
}

/* Removes connection i (order does not matter). */
static void gate_drop(lk_gate *g, int i, const char *why) {
    refuse_link(g, g->c[i].l, g->c[i].opened, why);
    g->c[i] = g->c[--g->n];
}

static void host_key(const struct sockaddr_storage *ss, uint8_t key[17]) {
    memset(key, 0, 17);
    if (ss->ss_family == AF_INET) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)ss)->sin6_addr.s6_addr;
        static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(a, v4mapped, 12)) {
            key[0] = 4;
            memcpy(key + 1, a + 12, 4);
        } else {
            key[0] = 8; /* one /64: what one subscriber gets */
            memcpy(key + 1, a, 8);
        }
    }
}

/* What the peer has sent so far, without consuming it: -1 when the
 * connection ended (why filled), else the byte count. */
static ssize_t gate_peek(lk_gate *g, gate_conn *c, char *why, size_t whylen) {
    ssize_t k = recv(lk_tcp_fd(c->l), g->peek, g->p.auth->ready_max, MSG_PEEK | MSG_DONTWAIT);
    if (k > 0) {
        c->seen = (size_t)k;
        return k;
    }
    if (k == 0) {
        snprintf(why, whylen, "closed the connection after %zu bytes, before authenticating", c->seen);
        return -1;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return (ssize_t)c->seen;
    snprintf(why, whylen, "%s before authenticating", strerror(errno));
    return -1;
}

/* The connection a newcomer may replace (see EVICT_*), among those of its
 * host (or all, host NULL); -1: none. */
static int gate_victim(lk_gate *g, const uint8_t *host, uint64_t now) {
    int silent = -1, slow = -1;
    char why[128];
    for (int i = 0; i < g->n; i++) {
        gate_conn *c = &g->c[i];
        if (host && memcmp(c->host, host, 17)) continue;
        if (!c->seen) gate_peek(g, c, why, sizeof why); /* bytes may have come since the last poll */
        uint64_t age = now - c->t0;
        if (!c->seen && age >= EVICT_SILENT_NS && (silent < 0 || c->t0 < g->c[silent].t0)) silent = i;
        if (c->seen && age >= EVICT_SLOW_NS && (slow < 0 || c->t0 < g->c[slow].t0)) slow = i;
    }
    return silent >= 0 ? silent : slow;
}

/* A connection just accepted: admitted (perhaps in another's place) or
 * told we are busy. */
static void gate_admit(lk_gate *g, int fd, const struct sockaddr_storage *ss, socklen_t sl) {
    char name[96];
    peer_name(ss, sl, name, sizeof name);
    lk_link *l = lk_tcp_wrap(fd, name);
    uint8_t host[17];
    host_key(ss, host);
    uint64_t now = lk_time_ns();
    int same = 0;
    for (int i = 0; i < g->n; i++) same += !memcmp(g->c[i].host, host, 17);
    if (same >= g->p.max_per_host || g->n >= g->p.max_pending) {
        int v = gate_victim(g, same >= g->p.max_per_host ? host : NULL, now);
        if (v < 0) {
            refuse_link(g, l, false, LK_GATE_BUSY);
            return;
        }
        char why[160];
        double age = (double)(now - g->c[v].t0) / 1e9;
        if (g->c[v].seen)
            snprintf(why, sizeof why, LK_GATE_BUSY " (dropped for a newcomer: %zu bytes in %.3f s)", g->c[v].seen, age);
        else
            snprintf(why, sizeof why, LK_GATE_BUSY " (dropped for a newcomer: silent for %.3f s)", age);
        gate_drop(g, v, why);
    }
    gate_conn *c = &g->c[g->n];
    memset(c, 0, sizeof *c);
    c->l = l;
    c->t0 = now;
    memcpy(c->host, host, 17);
    char why[LK_ERRLEN];
    if (g->p.auth->open && g->p.auth->open(g->p.auth_ctx, l, c->state, why, sizeof why)) {
        note_refusal(g, name, why);
        lk_link_close(l);
        return;
    }
    c->opened = g->p.auth->open != NULL;
    g->n++;
}

/* Wait for more than `have` bytes before poll calls the socket readable
 * again: peeking leaves the bytes queued, so plain POLLIN would spin. An
 * ended connection is reported whatever the mark. */
static void set_lowat(gate_conn *c, size_t have) {
    int v = (int)have + 1;
    (void)setsockopt(lk_tcp_fd(c->l), SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
}

lk_status lk_gate_next(lk_gate *g, uint64_t deadline_ns, lk_link **out, uint8_t state[LK_AUTH_STATE], char *err,
                       size_t errlen) {
    *out = NULL;
    struct pollfd *pf = g->pf;
    lk_status st = LK_OK;
    char why[LK_ERRLEN];
    for (;;) {
        uint64_t now = lk_time_ns();
        uint64_t first = (uint64_t)g->p.first_byte_ms * 1000000ull, ready = (uint64_t)g->p.ready_ms * 1000000ull;
        uint64_t wake = deadline_ns;
        for (int i = 0; i < g->n;) {
            gate_conn *c = &g->c[i];
            uint64_t age = now - c->t0;
            if (!c->seen && age >= first) {
                snprintf(why, sizeof why, "timeout: sent nothing for %.1f s", (double)age / 1e9);
                gate_drop(g, i, why);
                continue;
            }
            if (age >= ready) {
                snprintf(why, sizeof why, "timeout: sent %zu bytes in %.1f s, not enough to authenticate", c->seen,
                         (double)age / 1e9);
                gate_drop(g, i, why);
                continue;
            }
            wake = LK_MIN(wake, c->t0 + (c->seen ? ready : first));
            i++;
        }
        if (now >= deadline_ns) {
            st = lk_fail(err, errlen, LK_ERR_TIMEOUT, "no connection authenticated before the deadline");
            break;
        }
        int np = 0;
        pf[np++] = (struct pollfd){.fd = g->lfd, .events = POLLIN};
        for (int i = 0; i < g->n; i++)
            pf[np++] = (struct pollfd){.fd = lk_tcp_fd(g->c[i].l), .events = POLLIN | POLLRDHUP};
        int ms = (int)LK_MIN((wake - now + 999999) / 1000000, 1000000ull);
        int r = poll(pf, (nfds_t)np, ms);
        if (r < 0 && errno != EINTR) {
            st = lk_fail(err, errlen, LK_ERR_NET, "poll: %s", strerror(errno));
            break;
        }
        if (r <= 0) continue;
        /* Readable ones first, by link (dropping one reorders the
         * table). The first that is ready is handed out; the others stay
         * readable for the next call. */
        int nready = 0;
        for (int k = 1; k < np; k++)
            if (pf[k].revents) {
                g->rd[nready] = g->c[k - 1].l;
                g->rd_ended[nready++] = pf[k].revents & (POLLRDHUP | POLLHUP | POLLERR);
            }
        for (int k = 0; k < nready && !*out; k++) {
            int i = 0;
            while (i < g->n && g->c[i].l != g->rd[k]) i++;
            gate_conn *c = &g->c[i];
            ssize_t n = gate_peek(g, c, why, sizeof why);
            int rd = n < 0 ? -1 : g->p.auth->ready(g->p.auth_ctx, g->peek, (size_t)n, why, sizeof why);
            if (rd == 0 && (size_t)n >= g->p.auth->ready_max) {
                snprintf(why, sizeof why, "sent %zd bytes that do not start a handshake", n);
                rd = -1;
            }
            if (rd == 0 && g->rd_ended[k]) { /* no more can come: poll would report it again and again */
                snprintf(why, sizeof why, "closed the connection after %zd bytes, before authenticating", n);
                rd = -1;
            }
            if (rd < 0) {
                gate_drop(g, i, why);
            } else if (rd == 0) {
                set_lowat(c, (size_t)n);
            } else {
                int one = 1;
                (void)setsockopt(lk_tcp_fd(c->l), SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
                *out = c->l;
                memcpy(state, c->state, LK_AUTH_STATE);
                g->c[i] = g->c[--g->n];
            }
        }
        if (*out) break;
        if (pf[0].revents) {
            for (int k = 0; k < 256; k++) {
                struct sockaddr_storage ss;
                socklen_t sl = sizeof ss;
                int fd = accept4(g->lfd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC);
                if (fd < 0) break; /* EAGAIN, or a connection reset before we took it */
                gate_admit(g, fd, &ss, sl);
            }
        }
    }
    return st;
}

void lk_gate_free(lk_gate *g) {
    if (!g) return;
    for (int i = 0; i < g->n; i++) close_gently(g->c[i].l);
    free(g->c);
    free(g->peek);
    free(g->pf);
    free(g->rd);
    free(g->rd_ended);
    free(g);
}
