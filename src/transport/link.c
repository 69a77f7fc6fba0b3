/* What every transport shares: driving several transfers at once under one
 * deadline (spin, then block), and the blocking send/recv built on it. */
#include "transport/transport.h"

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char *lk_link_name(const lk_link *l, char *buf, size_t len) {
    if (!l) snprintf(buf, len, "?");
    else if (l->peer_rank >= 0) snprintf(buf, len, "rank %d (%s)", l->peer_rank, l->peer_addr);
    else snprintf(buf, len, "%s", l->peer_addr);
    return buf;
}

void lk_link_close(lk_link *l) {
    if (l) l->ops->close(l);
}

int64_t lk_spin_default(int ranks_here) {
    /* LK_LINK_SPIN_US in the environment (0-1000000) sets the budget for
     * every link of the process, --local ranks included (they inherit it) */
    const char *env = getenv("LK_LINK_SPIN_US");
    if (env && *env) {
        char *end;
        long long us = strtoll(env, &end, 10);
        if (!*end && us >= 0 && us <= 1000000) return (int64_t)us * 1000;
        static _Atomic int warned;
        if (!atomic_exchange(&warned, 1))
            lk_log(LK_LOG_WARN, "LK_LINK_SPIN_US=%s is not a whole number of microseconds in 0..1000000: ignored", env);
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
    /* 50 us covers a small-message round trip on loopback or shm several
     * times over, yet is short enough that a long compute phase of the peer
     * costs us only one wake-up. */
    return ranks_here <= cores ? 50000 : 0;
}

static lk_status xfer_fail(const lk_xfer *x, lk_status st, const char *what, char *err, size_t errlen) {
    char name[128];
    lk_link_name(x->link, name, sizeof name);
    return lk_fail(err, errlen, st, "%s: %s while %s %zu bytes (%s %zu)", name, what,
                   x->is_send ? "sending" : "receiving", x->n, x->is_send ? "sent" : "got", x->done);
}

enum { MAX_POLL = 64 };

/* Spinning pays when the peer answers within the budget. When it keeps not
 * doing so (the peer computes longer than the budget, or the cores are
 * oversubscribed and the spinner only delays the process it waits for), stop
 * spinning on these links for a while. */
static void spin_feedback(lk_xfer *x, int nx, int64_t spin, bool in_vain, bool paid) {
    if (!spin) return;
    for (int i = 0; i < nx; i++) {
        lk_link *l = x[i].link;
        if (paid && !in_vain) l->spin_misses = 0;
        else if (in_vain && ++l->spin_misses >= 4) {
            l->spin_misses = 0;
            l->spin_skip = 256;
        }
    }
}

lk_status lk_xfer_run(lk_xfer *x, int nx, uint64_t deadline_ns, char *err, size_t errlen) {
    uint64_t t0 = lk_time_ns(), last = t0;
    int64_t spin = -1;
    for (int i = 0; i < nx; i++) {
        lk_link *l = x[i].link;
        int64_t s = l->spin_skip ? 0 : l->spin_ns;
        if (l->spin_skip) l->spin_skip--;
        if (spin < 0 || s < spin) spin = s;
    }
    if (spin < 0) spin = 0;
    bool spun_in_vain = false, spin_paid = false;
    char why[LK_ERRLEN];
    for (;;) {
        bool progress = false;
        int pending = 0;
        for (int i = 0; i < nx; i++) {
            lk_xfer *t = &x[i];
            if (t->done == t->n) continue;
            lk_link *l = t->link;
            ssize_t k = t->is_send ? l->ops->send_some(l, (const char *)t->buf + t->done, t->n - t->done, why, sizeof why)
                                   : l->ops->recv_some(l, (char *)t->buf + t->done, t->n - t->done, why, sizeof why);
            if (k < 0) return xfer_fail(t, LK_ERR_NET, why, err, errlen);
            if (k > 0) {
                progress = true;
                t->done += (size_t)k;
                if (t->is_send) l->bytes_sent += (uint64_t)k;
                else l->bytes_recv += (uint64_t)k;
            }
            if (t->done < t->n) pending++;
        }
        if (!pending) {
            spin_feedback(x, nx, spin, spun_in_vain, spin_paid);
            return LK_OK;
        }
        uint64_t now = lk_time_ns();
        if (progress) {
            if (now - last > 2000) spin_paid = true; /* it arrived while we spun */
            last = now;
            continue;
        }
        if (now >= deadline_ns) {
            for (int i = 0; i < nx; i++)
                if (x[i].done < x[i].n) {
                    char what[64];
                    snprintf(what, sizeof what, "timeout after %.0f ms", (double)(now - t0) / 1e6);
                    return xfer_fail(&x[i], LK_ERR_TIMEOUT, what, err, errlen);
                }
        }
        if ((int64_t)(now - last) < spin) { lk_cpu_relax(); continue; }

        /* Block. All pending on sockets: one poll over all of them. */
        if (spin) spun_in_vain = true;
        struct pollfd pf[MAX_POLL];
        int np = 0, nofd = -1;
        for (int i = 0; i < nx; i++) {
            if (x[i].done == x[i].n) continue;
            int fd = x[i].link->ops->poll_fd(x[i].link);
            if (fd < 0) { if (nofd < 0) nofd = i; continue; }
            if (np < MAX_POLL) pf[np++] = (struct pollfd){.fd = fd, .events = x[i].is_send ? POLLOUT : POLLIN};
        }
        uint64_t rem = deadline_ns - now;
        if (nofd < 0) {
            struct timespec ts = {(time_t)(rem / 1000000000ull), (long)(rem % 1000000000ull)};
            int r = ppoll(pf, (nfds_t)np, &ts, NULL);
            if (r < 0 && errno != EINTR) return lk_fail(err, errlen, LK_ERR_NET, "poll: %s", strerror(errno));
        } else {
            /* A ring has no fd: wait on the first one, briefly when other
             * transfers are pending too (their readiness does not wake us). */
            if (pending > 1 && rem > 200000) rem = 200000;
            lk_link *l = x[nofd].link;
            if (l->ops->wait(l, x[nofd].is_send, rem, why, sizeof why) < 0)
                return xfer_fail(&x[nofd], LK_ERR_NET, why, err, errlen);
        }
        /* Woken: data is likely arriving in pieces, so spin again. */
        last = lk_time_ns();
    }
}

lk_status lk_link_send(lk_link *l, const void *buf, size_t n, uint64_t deadline_ns, char *err, size_t errlen) {
    lk_xfer x = {.link = l, .is_send = true, .buf = (void *)buf, .n = n};
    return lk_xfer_run(&x, 1, deadline_ns, err, errlen);
}

lk_status lk_link_recv(lk_link *l, void *buf, size_t n, uint64_t deadline_ns, char *err, size_t errlen) {
    lk_xfer x = {.link = l, .is_send = false, .buf = buf, .n = n};
    return lk_xfer_run(&x, 1, deadline_ns, err, errlen);
}
