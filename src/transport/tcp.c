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
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 64) == 0) break;
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
        char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
        getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
        char name[96];
        snprintf(name, sizeof name, strchr(host, ':') ? "[%s]:%s" : "%s:%s", host, serv);
        *out = lk_tcp_wrap(fd, name);
        return LK_OK;
    }
}
