/* The link emulator: a TCP relay that holds every byte for a set one-way
 * delay and lets it out no faster than a set rate, in both directions, so a
 * cluster on one machine can rehearse a 10 GbE or an RDMA-class network
 * (this kernel has no netem).
 *
 * Per relayed connection one thread owns both sockets and both directions.
 * A direction is a byte ring (4 MiB) and a queue of chunks, each with the
 * time it may leave: a chunk of n bytes read at time t starts on the
 * emulated wire at max(t, when the previous chunk finished), takes n x 8 /
 * rate there, and leaves delay (+- jitter) after its last bit, never before
 * the chunk ahead of it (TCP is in order).
 *
 * Why it is honest at tens of microseconds:
 *   - the arrival time is the kernel's receive timestamp (SO_TIMESTAMPNS),
 *     not the moment this thread woke up, so a sleeping relay adds no delay
 *     of its own to the delay it was asked for;
 *   - the release is timed by spinning on the clock: the thread sleeps only
 *     when nothing is due within 300 us (then in ppoll, waking 200 us early)
 *     or after `spin` of idleness, so a message is sent within a few
 *     microseconds of its time. The cost is one busy core per active
 *     connection while traffic flows.
 * What it does not emulate: loss, reordering, the peer's TCP window (the
 * relay's buffers are large), and the relay's own hop (a recv and a send,
 * measured in --help) comes on top of the delay. */
#include "diag/diag.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#define RING_BYTES (4u << 20)
#define MAX_CHUNKS 8192
#define MAX_READ   (64u << 10)
#define SPIN_AHEAD_NS 300000ull  /* spin when the next release is this close */
#define WAKE_EARLY_NS 200000ull  /* sleep until this long before it */
#define IDLE_SPIN_NS  1000000ull /* keep spinning this long after the last byte moved */
#define MAX_CONNS  256

typedef struct {
    uint32_t n;
    uint64_t due;   /* lk_time_ns clock */
} chunk;

typedef struct {
    int      from, to;       /* sockets */
    uint8_t *ring;           /* RING_BYTES */
    uint64_t head, tail;     /* bytes in: tail - head; sent so far from the head chunk: off */
    uint32_t off;
    chunk   *q;              /* MAX_CHUNKS */
    uint32_t qh, qn;
    uint64_t wire_free;      /* when the emulated wire is free again */
    uint64_t last_due;
    bool     eof, done;      /* from closed; everything sent and to shut */
    _Atomic uint64_t *bytes;
} dir_t;

struct lk_diag_relay {
    lk_diag_relay_cfg cfg;
    char     listen_s[128], to_s[128];
    int      lfd;
    pthread_t acceptor;
    atomic_bool stop;
    atomic_int conns;
    _Atomic uint64_t bytes_fwd, bytes_back;
    pthread_mutex_t mu;
    pthread_t threads[MAX_CONNS];
    int       n_threads;
    int64_t   mono_minus_real; /* lk_time_ns - CLOCK_REALTIME, for kernel timestamps */
};

typedef struct {
    lk_diag_relay *r;
    int a, b;
    uint64_t rng;
} conn_t;

static uint64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void set_sock(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/* "host:port" (host may be empty: 127.0.0.1) -> connected blocking socket, or -1 */
static int connect_to(const char *addr, char *err, size_t errlen) {
    char host[128];
    const char *colon = strrchr(addr, ':');
    if (!colon || colon - addr >= (long)sizeof host) {
        lk_fail(err, errlen, LK_ERR_ARG, "bad address '%s' (want HOST:PORT)", addr);
        return -1;
    }
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = 0;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int gr = getaddrinfo(host[0] ? host : "127.0.0.1", colon + 1, &hints, &res);
    if (gr) {
        lk_fail(err, errlen, LK_ERR_NET, "%s: %s", addr, gai_strerror(gr));
        return -1;
    }
    int fd = -1, e = 0;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen)) { e = errno; close(fd); fd = -1; }
    }
    freeaddrinfo(res);
    if (fd < 0) lk_fail(err, errlen, LK_ERR_NET, "connect %s: %s", addr, strerror(e));
    return fd;
}

static uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return *s = x;
}

/* Reads what `from` has into the ring (up to the ring's contiguous space and
 * MAX_READ) and queues it with its release time. */
static void dir_read(conn_t *c, dir_t *d, uint64_t now) {
    const lk_diag_relay_cfg *cfg = &c->r->cfg;
    while (!d->eof && d->qn < MAX_CHUNKS && d->tail - d->head < RING_BYTES) {
        uint64_t pos = d->tail % RING_BYTES;
        size_t room = RING_BYTES - (size_t)(d->tail - d->head);
        size_t contig = RING_BYTES - (size_t)pos;
        size_t want = room < contig ? room : contig;
        if (want > MAX_READ) want = MAX_READ;
        struct iovec iov = {d->ring + pos, want};
        char cbuf[CMSG_SPACE(sizeof(struct timespec))];
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        ssize_t n = recvmsg(d->from, &mh, MSG_DONTWAIT);
        if (n == 0) { d->eof = true; return; }
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) d->eof = true;
            return;
        }
        uint64_t t = now;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_TIMESTAMPNS) {
                struct timespec ts;
                memcpy(&ts, CMSG_DATA(cm), sizeof ts);
                uint64_t k = (uint64_t)((int64_t)((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) +
                                        c->r->mono_minus_real);
                if (k < t && t - k < 1000000000ull) t = k; /* the kernel saw it first; ignore a wild clock */
            }
        double ser = cfg->rate_gbps > 0 ? (double)n * 8.0 / cfg->rate_gbps : 0; /* ns */
        uint64_t start = t > d->wire_free ? t : d->wire_free;
        d->wire_free = start + (uint64_t)ser;
        double dl = cfg->delay_us * 1e3;
        if (cfg->jitter_us > 0) dl += ((double)(xorshift(&c->rng) >> 11) / 9007199254740992.0 * 2 - 1) * cfg->jitter_us * 1e3;
        uint64_t due = d->wire_free + (uint64_t)(dl > 0 ? dl : 0);
        if (due < d->last_due) due = d->last_due;
        d->last_due = due;
        d->q[(d->qh + d->qn) % MAX_CHUNKS] = (chunk){(uint32_t)n, due};
        d->qn++;
        d->tail += (uint64_t)n;
    }
}

/* Sends every chunk whose time has come; false when `to` failed. */
static bool dir_write(dir_t *d, uint64_t now) {
    while (d->qn) {
        chunk *ch = &d->q[d->qh];
        if (ch->due > now) break;
        uint64_t pos = d->head % RING_BYTES;
        size_t left = ch->n - d->off;
        size_t contig = RING_BYTES - (size_t)pos;
        ssize_t n = send(d->to, d->ring + pos, left < contig ? left : contig, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN || errno == EWOULDBLOCK;
        }
        d->head += (uint64_t)n;
        d->off += (uint32_t)n;
        atomic_fetch_add(d->bytes, (uint64_t)n);
        if (d->off == ch->n) {
            d->off = 0;
            d->qh = (d->qh + 1) % MAX_CHUNKS;
            d->qn--;
        }
    }
    if (d->eof && !d->qn && !d->done) {
        shutdown(d->to, SHUT_WR);
        d->done = true;
    }
    return true;
}

static void *conn_main(void *arg) {
    conn_t *c = arg;
    lk_diag_relay *r = c->r;
    dir_t d[2] = {{.from = c->a, .to = c->b, .bytes = &r->bytes_fwd}, {.from = c->b, .to = c->a, .bytes = &r->bytes_back}};
    for (int i = 0; i < 2; i++) {
        d[i].ring = lk_xmalloc(RING_BYTES);
        d[i].q = lk_xmalloc(sizeof(chunk) * MAX_CHUNKS);
    }
    uint64_t last_move = lk_time_ns();
    while (!atomic_load(&r->stop) && !(d[0].done && d[1].done)) {
        uint64_t now = lk_time_ns();
        uint64_t before = d[0].tail + d[1].tail + d[0].head + d[1].head;
        dir_read(c, &d[0], now);
        dir_read(c, &d[1], now);
        now = lk_time_ns();
        if (!dir_write(&d[0], now) || !dir_write(&d[1], now)) break;
        if (d[0].tail + d[1].tail + d[0].head + d[1].head != before) last_move = now;
        /* a side that closed its reading end while data waits: give up */
        uint64_t next = UINT64_MAX;
        for (int i = 0; i < 2; i++)
            if (d[i].qn && d[i].q[d[i].qh].due < next) next = d[i].q[d[i].qh].due;
        now = lk_time_ns();
        if (next != UINT64_MAX && next <= now + SPIN_AHEAD_NS) continue; /* spin to the release */
        if (now - last_move < IDLE_SPIN_NS && next == UINT64_MAX) continue; /* traffic is flowing: stay awake */
        /* sleep until data arrives, a blocked send can go on, or shortly before the next release */
        struct pollfd pf[2] = {{.fd = c->a}, {.fd = c->b}};
        int np = 2;
        /* events per socket: a is d[0].from and d[1].to; b the reverse */
        if (!d[0].eof && d[0].qn < MAX_CHUNKS) pf[0].events |= POLLIN;
        if (!d[1].eof && d[1].qn < MAX_CHUNKS) pf[1].events |= POLLIN;
        if (d[1].qn && d[1].q[d[1].qh].due <= now) pf[0].events |= POLLOUT;
        if (d[0].qn && d[0].q[d[0].qh].due <= now) pf[1].events |= POLLOUT;
        uint64_t wait = 100000000ull; /* 100 ms: look at the stop flag */
        if (next != UINT64_MAX) wait = next - now > WAKE_EARLY_NS ? next - now - WAKE_EARLY_NS : 0;
        if (wait > 100000000ull) wait = 100000000ull;
        struct timespec ts = {(time_t)(wait / 1000000000ull), (long)(wait % 1000000000ull)};
        ppoll(pf, (nfds_t)np, &ts, NULL);
    }
    close(c->a);
    close(c->b);
    for (int i = 0; i < 2; i++) free(d[i].ring), free(d[i].q);
    free(c);
    return NULL;
}

static void *accept_main(void *arg) {
    lk_diag_relay *r = arg;
    while (!atomic_load(&r->stop)) {
        struct pollfd pf = {r->lfd, POLLIN, 0};
        if (poll(&pf, 1, 100) <= 0) continue;
        int a = accept4(r->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (a < 0) continue;
        char err[LK_ERRLEN];
        int b = connect_to(r->to_s, err, sizeof err);
        if (b < 0) {
            fprintf(stderr, "linkemu: %s; dropping the connection\n", err);
            close(a);
            continue;
        }
        set_sock(a);
        set_sock(b);
        pthread_mutex_lock(&r->mu);
        if (r->n_threads == MAX_CONNS) {
            pthread_mutex_unlock(&r->mu);
            fprintf(stderr, "linkemu: more than %d connections; dropping one\n", MAX_CONNS);
            close(a), close(b);
            continue;
        }
        conn_t *c = lk_xmalloc(sizeof *c);
        *c = (conn_t){.r = r, .a = a, .b = b, .rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)(r->n_threads + 1) * 0xd1b54a32d192ed03ull};
        pthread_create(&r->threads[r->n_threads++], NULL, conn_main, c);
        pthread_mutex_unlock(&r->mu);
        int n = atomic_fetch_add(&r->conns, 1) + 1;
        if (r->cfg.max_conns > 0 && n >= r->cfg.max_conns) break;
    }
    return NULL;
}

lk_status lk_diag_relay_start(const lk_diag_relay_cfg *cfg, lk_diag_relay **out, int *port_out, char *err,
                              size_t errlen) {
    *out = NULL;
    if (!cfg->listen || !cfg->to) return lk_fail(err, errlen, LK_ERR_ARG, "linkemu: --listen and --to are required");
    if (!(cfg->delay_us >= 0) || cfg->delay_us > 10e6 || !(cfg->jitter_us >= 0) || cfg->jitter_us > cfg->delay_us + 1e-9 ||
        !(cfg->rate_gbps >= 0) || cfg->rate_gbps > 10000)
        return lk_fail(err, errlen, LK_ERR_ARG,
                       "linkemu: delay 0..10 s, jitter 0..delay, rate 0 (unlimited) .. 10000 Gbit/s");
    lk_diag_relay *r = lk_xcalloc(1, sizeof *r);
    r->cfg = *cfg;
    snprintf(r->listen_s, sizeof r->listen_s, "%s", cfg->listen);
    snprintf(r->to_s, sizeof r->to_s, "%s", cfg->to);
    r->cfg.listen = r->listen_s, r->cfg.to = r->to_s;
    pthread_mutex_init(&r->mu, NULL);
    /* listen: HOST:PORT, port 0 = any */
    char host[128];
    const char *colon = strrchr(cfg->listen, ':');
    if (!colon || colon - cfg->listen >= (long)sizeof host) {
        free(r);
        return lk_fail(err, errlen, LK_ERR_ARG, "linkemu: bad --listen '%s' (want HOST:PORT)", cfg->listen);
    }
    memcpy(host, cfg->listen, (size_t)(colon - cfg->listen));
    host[colon - cfg->listen] = 0;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    int gr = getaddrinfo(host[0] ? host : "127.0.0.1", colon + 1, &hints, &res);
    if (gr) {
        free(r);
        return lk_fail(err, errlen, LK_ERR_ARG, "linkemu: --listen %s: %s", cfg->listen, gai_strerror(gr));
    }
    r->lfd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (r->lfd >= 0) setsockopt(r->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (r->lfd < 0 || bind(r->lfd, res->ai_addr, res->ai_addrlen) || listen(r->lfd, 64)) {
        int e = errno;
        freeaddrinfo(res);
        if (r->lfd >= 0) close(r->lfd);
        free(r);
        return lk_fail(err, errlen, LK_ERR_NET, "linkemu: listen on %s: %s", cfg->listen, strerror(e));
    }
    freeaddrinfo(res);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(r->lfd, (struct sockaddr *)&ss, &sl);
    int port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                        : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    if (port_out) *port_out = port;
    r->mono_minus_real = (int64_t)lk_time_ns() - (int64_t)realtime_ns();
    pthread_create(&r->acceptor, NULL, accept_main, r);
    *out = r;
    return LK_OK;
}

void lk_diag_relay_stats(lk_diag_relay *r, int *conns, uint64_t *fwd, uint64_t *back) {
    if (conns) *conns = atomic_load(&r->conns);
    if (fwd) *fwd = atomic_load(&r->bytes_fwd);
    if (back) *back = atomic_load(&r->bytes_back);
}

void lk_diag_relay_stop(lk_diag_relay *r) {
    if (!r) return;
    atomic_store(&r->stop, true);
    pthread_join(r->acceptor, NULL);
    for (int i = 0; i < r->n_threads; i++) pthread_join(r->threads[i], NULL);
    close(r->lfd);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* ---- --emulate-link: which links of a local cluster, and how --------------------- */

static bool num(const char *s, size_t n, double *v) {
    char buf[32], *end;
    if (n == 0 || n >= sizeof buf) return false;
    memcpy(buf, s, n);
    buf[n] = 0;
    *v = strtod(buf, &end);
    return *end == 0 && *v == *v;
}

lk_status lk_diag_linkemu_parse(const char *spec, int n_ranks, lk_diag_linkemu *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    const char *want = "want [A-B:]DELAY_US[:RATE_GBPS[:JITTER_US]], comma-separated";
    if (!spec || !*spec) return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link: empty (%s)", want);
    for (const char *p = spec; *p;) {
        size_t len = strcspn(p, ",");
        char rule[96];
        if (len == 0 || len >= sizeof rule)
            return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link '%s': an empty or overlong rule (%s)", spec, want);
        memcpy(rule, p, len);
        rule[len] = 0;
        p += len + (p[len] == ',');
        if (out->n == LK_LINKEMU_MAX_RULES)
            return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link: at most %d rules", LK_LINKEMU_MAX_RULES);
        lk_diag_link_rule r = {.a = -1, .b = -1};
        const char *f = rule, *colon = strchr(rule, ':'), *dash = strchr(rule, '-');
        if (dash && (!colon || dash < colon)) { /* A-B: */
            char *end;
            long a = strtol(f, &end, 10), b;
            if (end != dash || !colon) goto bad;
            b = strtol(dash + 1, &end, 10);
            if (end != colon || a < 0 || b < 0 || a == b || a > 4096 || b > 4096) goto bad;
            if (n_ranks > 0 && (a >= n_ranks || b >= n_ranks))
                return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link '%s': ranks %ld and %ld, but the cluster has "
                               "ranks 0..%d", rule, a, b, n_ranks - 1);
            r.a = (int)LK_MIN(a, b), r.b = (int)LK_MAX(a, b);
            f = colon + 1;
        }
        double v[3] = {0, 0, 0};
        int k = 0;
        for (const char *q = f;; k++) {
            size_t n = strcspn(q, ":");
            if (k == 3 || !num(q, n, &v[k])) goto bad;
            if (!q[n]) { k++; break; }
            q += n + 1;
        }
        r.delay_us = v[0], r.rate_gbps = v[1], r.jitter_us = v[2];
        if (!(r.delay_us >= 0 && r.delay_us <= 10e6 && r.rate_gbps >= 0 && r.rate_gbps <= 10000 && r.jitter_us >= 0 &&
              r.jitter_us <= r.delay_us))
            return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link '%s': delay 0..10000000 us, rate 0 (unlimited)..10000 "
                           "Gbit/s, jitter 0..the delay", rule);
        for (int i = 0; i < out->n; i++)
            if (out->rule[i].a == r.a && out->rule[i].b == r.b)
                return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link '%s': that link has two rules", rule);
        out->rule[out->n++] = r;
        continue;
    bad:
        return lk_fail(err, errlen, LK_ERR_ARG, "--emulate-link: bad rule '%s' (%s)", rule, want);
    }
    return LK_OK;
}

bool lk_diag_linkemu_pair(const lk_diag_linkemu *e, int a, int b, lk_diag_link_rule *out) {
    const lk_diag_link_rule *def = NULL;
    int lo = LK_MIN(a, b), hi = LK_MAX(a, b);
    for (int i = 0; i < e->n; i++) {
        if (e->rule[i].a == lo && e->rule[i].b == hi) {
            *out = e->rule[i];
            return true;
        }
        if (e->rule[i].a < 0) def = &e->rule[i];
    }
    if (def) *out = *def;
    return def != NULL;
}

void lk_diag_linkemu_pair_spec(const lk_diag_linkemu *e, int a, int b, char *buf, size_t len) {
    lk_diag_link_rule r;
    if (!lk_diag_linkemu_pair(e, a, b, &r)) snprintf(buf, len, "%s", "");
    else snprintf(buf, len, "%.17g:%.17g:%.17g", r.delay_us, r.rate_gbps, r.jitter_us);
}

void lk_diag_link_rule_describe(const lk_diag_link_rule *r, char *buf, size_t len) {
    int k = snprintf(buf, len, "%g us one-way", r->delay_us);
    if (k < 0 || (size_t)k >= len) return;
    if (r->jitter_us > 0) k += snprintf(buf + k, len - (size_t)k, " +- %g us", r->jitter_us);
    if (k < 0 || (size_t)k >= len) return;
    if (r->rate_gbps > 0) snprintf(buf + k, len - (size_t)k, ", %g Gbit/s", r->rate_gbps);
    else snprintf(buf + k, len - (size_t)k, ", rate unlimited");
}
