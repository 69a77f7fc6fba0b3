/* The head side of a cluster session (rank 0): connects to or starts the
 * workers, agrees with each, distributes the plan, builds the mesh, and per
 * step tells the workers what to run. A monitor thread owns every read of
 * the control connections after setup: it takes the workers' heartbeats,
 * sends the head's, and declares a worker dead after dead_after_ms of
 * silence (or at once on a closed connection / ERROR). Declaring shuts that
 * worker's sockets, so a collective blocked on it fails immediately and the
 * engine reports the monitor's reason, not a generic reset. */
#include "cluster/proto.h"
#include "model/model.h"
#include "sampler/sampler.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct {
    char      addr[LK_ADDR_LEN];
    lk_link  *link;
    lk_chan   ch;
    pthread_mutex_t mu;          /* sends: the main thread's BYE, the monitor's PINGs */
    _Atomic uint64_t last_seen;  /* lk_time_ns of the last frame from it */
    bool      idle;              /* set-up: answered, sends only heartbeats until MESH */
    atomic_int dead;
    uint32_t  ping_us[2];        /* the last PING's step totals (compute, comm), us modulo 2^32 */
    _Atomic uint64_t step_us[2]; /* their sums: the worker's compute and network seconds (x 1e6) */
} wconn;

struct lk_cluster {
    int       n, tp, pp;
    wconn     w[LK_MAX_RANKS];   /* by rank; [0] is us */
    pid_t     kids[LK_MAX_RANKS];
    lk_mesh  *mesh;
    lk_comm  *comm;
    lk_slice  slices[LK_MAX_RANKS]; /* the plan, by rank */
    pthread_t mon;
    bool      mon_started;
    atomic_int stop;
    int64_t   dead_after_ms;
    bool      seal;              /* seal every TCP link (--seal) */
    pthread_mutex_t err_mu;
    char      reason[LK_ERRLEN]; /* the monitor's own finding */
    char      hearsay[LK_ERRLEN];/* a worker's report of a failure */
    char      detail[LK_ERRLEN]; /* the failed operation's own message */
    char      err[2 * LK_ERRLEN + 8];
    uint8_t   key[LK_KEY_BYTES];
    lk_emu   *emu;               /* --emulate-link: relays on mesh links (NULL: none) */
};

/* A worker's PING (n bytes at p) carries, after its nonce, its steps'
 * compute and network time so far in us modulo 2^32 (cluster.h): add what
 * passed since the last one. A PING without them adds nothing. */
static void note_step_times(wconn *w, const uint8_t *p, uint32_t n) {
    lk_rbuf rb = {p, n, 0, true};
    (void)lk_rb_u64(&rb); /* the nonce */
    uint32_t v[2];
    v[0] = lk_rb_u32(&rb);
    v[1] = lk_rb_u32(&rb);
    if (!rb.ok) return;
    /* network time first: a reader that sees the new compute time
     * (lk_cluster_rank_times reads it first) sees this PING's network time
     * too, as the worker orders its own totals */
    for (int k = 1; k >= 0; k--) {
        atomic_fetch_add(&w->step_us[k], (uint32_t)(v[k] - w->ping_us[k]));
        w->ping_us[k] = v[k];
    }
}

/* ---- failure bookkeeping ---------------------------------------------------------- */

/* Composes the error the engine reports: what the monitor found (a closed
 * connection or silence: direct evidence, preferred over a worker's report
 * that *another* peer failed), then the failing operation's own message. A
 * collective often fails a few milliseconds before the monitor reads the
 * dead worker's EOF, so on this (failure-only) path wait briefly for it. */
static void set_err(lk_cluster *c, const char *detail) {
    for (int i = 0; i < 30 && c->mon_started; i++) {
        pthread_mutex_lock(&c->err_mu);
        bool have = c->reason[0] != 0;
        pthread_mutex_unlock(&c->err_mu);
        if (have) break;
        usleep(5000);
    }
    pthread_mutex_lock(&c->err_mu);
    if (detail && *detail) snprintf(c->detail, sizeof c->detail, "%s", detail); /* else keep the last one */
    const char *primary = c->reason[0] ? c->reason : c->hearsay;
    if (primary[0] && c->detail[0] && !strstr(c->detail, primary))
        snprintf(c->err, sizeof c->err, "%s; %s", primary, c->detail);
    else
        snprintf(c->err, sizeof c->err, "%s", c->detail[0] ? c->detail : primary);
    pthread_mutex_unlock(&c->err_mu);
}

static void shut(int fd) {
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

/* Marks rank r dead (once), records why, and shuts its sockets so nothing
 * waits on it any longer. direct: we saw it ourselves (EOF, silence);
 * otherwise the worker itself reported a failure (often another peer's). */
static void declare_dead(lk_cluster *c, int r, const char *why, bool direct) {
    if (atomic_exchange(&c->w[r].dead, 1)) return;
    pthread_mutex_lock(&c->err_mu);
    char *slot = direct ? c->reason : c->hearsay;
    if (!slot[0]) snprintf(slot, LK_ERRLEN, "%s", why);
    pthread_mutex_unlock(&c->err_mu);
    lk_log(LK_LOG_ERROR, "%s", why);
    shut(lk_tcp_fd(c->w[r].link));
    if (c->mesh) shut(lk_tcp_fd(lk_mesh_ctl(c->mesh, r)));
}

const char *lk_cluster_error(const lk_cluster *c) {
    return c->err[0] ? c->err : c->reason[0] ? c->reason : c->hearsay;
}

/* ---- the monitor -------------------------------------------------------------------- */

static lk_status send_to(lk_cluster *c, int r, uint16_t type, const void *p, uint32_t len, int64_t ms,
                         char *err, size_t errlen) {
    pthread_mutex_lock(&c->w[r].mu);
    lk_status st = lk_chan_send(&c->w[r].ch, type, p, len, lk_deadline_ms(ms), err, errlen);
    pthread_mutex_unlock(&c->w[r].mu);
    return st;
}

static void *monitor_main(void *p) {
    lk_cluster *c = p;
    uint64_t next_ping = 0, k = 0;
    char err[LK_ERRLEN], why[2 * LK_ERRLEN];
    while (!atomic_load(&c->stop)) {
        struct pollfd pf[LK_MAX_RANKS];
        int who[LK_MAX_RANKS], np = 0;
        for (int r = 1; r < c->n; r++)
            if (!atomic_load(&c->w[r].dead)) {
                pf[np] = (struct pollfd){.fd = lk_tcp_fd(c->w[r].link), .events = POLLIN};
                who[np++] = r;
            }
        if (!np) break;
        poll(pf, (nfds_t)np, 50);
        uint64_t now = lk_time_ns();
        for (int i = 0; i < np; i++) {
            int r = who[i];
            if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            uint8_t buf[64];
            lk_frame_hdr h;
            lk_status st = lk_chan_recv(&c->w[r].ch, &h, buf, sizeof buf, lk_deadline_ms(1000), err, sizeof err);
            if (st == LK_ERR_PEER) {
                snprintf(why, sizeof why, "worker rank %d (%s) failed: %s", r, c->w[r].addr, err);
                declare_dead(c, r, why, false);
            } else if (st) {
                /* err starts with the link's name; we name the worker ourselves */
                char name[128];
                lk_link_name(c->w[r].link, name, sizeof name);
                char *e = err;
                size_t nl = strlen(name);
                if (!strncmp(e, name, nl) && e[nl] == ':') e += nl + 2;
                /* how many bytes of which frame is noise to a user here */
                char *w = strstr(e, " while receiving");
                if (w) *w = 0;
                snprintf(why, sizeof why, "lost worker rank %d (%s): %s", r, c->w[r].addr, e);
                declare_dead(c, r, why, true);
            } else if (h.type == LK_MSG_PING) {
                atomic_store(&c->w[r].last_seen, now);
                note_step_times(&c->w[r], buf, h.len);
            } else {
                snprintf(why, sizeof why, "worker rank %d (%s) sent an unexpected %s", r, c->w[r].addr,
                         lk_msg_name(h.type));
                declare_dead(c, r, why, true);
            }
        }
        for (int r = 1; r < c->n; r++) {
            if (atomic_load(&c->w[r].dead)) continue;
            uint64_t seen = atomic_load(&c->w[r].last_seen);
            if (now > seen && (int64_t)(now - seen) > c->dead_after_ms * 1000000) {
                snprintf(why, sizeof why, "worker rank %d (%s) stopped answering heartbeats (last heard %.1f s ago)",
                         r, c->w[r].addr, (double)(now - seen) / 1e9);
                declare_dead(c, r, why, true);
            }
        }
        if (now >= next_ping) {
            next_ping = now + 500000000ull;
            uint8_t b[8];
            for (int i = 0; i < 8; i++) b[i] = (uint8_t)(k >> (8 * i));
            k++;
            for (int r = 1; r < c->n; r++)
                if (!atomic_load(&c->w[r].dead) && send_to(c, r, LK_MSG_PING, b, 8, 500, err, sizeof err)) {
                    snprintf(why, sizeof why, "lost worker rank %d (%s): %s", r, c->w[r].addr, err);
                    declare_dead(c, r, why, true);
                }
        }
    }
    return NULL;
}

/* ---- setup ---------------------------------------------------------------------------- */

/* While the head spends long on one worker (its slices, its load), the
 * others wait for their next message: ping them so they do not give up on
 * us, and read what the idle ones send meanwhile (only PINGs), so their
 * heartbeats never fill our socket buffer and stall. Every 250 ms. */
static lk_status tend_others(lk_cluster *c, int busy, uint64_t *next, char *err, size_t errlen) {
    uint64_t now = lk_time_ns();
    if (now < *next) return LK_OK;
    *next = now + 250000000ull;
    uint8_t b[1024] = {0};
    char why[LK_ERRLEN];
    for (int r = 1; r < c->n; r++) {
        if (r == busy || !c->w[r].link) continue;
        lk_status st = send_to(c, r, LK_MSG_PING, b, 8, 1000, why, sizeof why);
        while (!st && c->w[r].idle) {
            struct pollfd pf = {.fd = lk_tcp_fd(c->w[r].link), .events = POLLIN};
            if (poll(&pf, 1, 0) <= 0) break;
            lk_frame_hdr h;
            if ((st = lk_chan_recv(&c->w[r].ch, &h, b, sizeof b, lk_deadline_ms(1000), why, sizeof why))) break;
            if (h.type != LK_MSG_PING) {
                snprintf(why, sizeof why, "unexpected %s", lk_msg_name(h.type));
                st = LK_ERR_FORMAT;
            }
            atomic_store(&c->w[r].last_seen, now);
        }
        if (st) return lk_fail(err, errlen, st, "worker rank %d (%s): %s", r, c->w[r].addr, why);
    }
    return LK_OK;
}

/* Receives the next non-PING frame from rank r. PINGs during a long model
 * load keep the deadline rolling: only 5 s of silence is fatal. */
static lk_status recv_reply(lk_cluster *c, int r, lk_frame_hdr *h, uint8_t *buf, uint32_t cap, char *err,
                            size_t errlen) {
    uint64_t next = 0, last = lk_time_ns();
    for (;;) {
        char why[LK_ERRLEN];
        lk_status st;
        if ((st = tend_others(c, r, &next, err, errlen))) return st;
        struct pollfd pf = {.fd = lk_tcp_fd(c->w[r].link), .events = POLLIN};
        if (poll(&pf, 1, 250) == 0) {
            if (lk_time_ns() - last < 5000000000ull) continue;
            return lk_fail(err, errlen, LK_ERR_TIMEOUT, "worker rank %d (%s): no answer for 5 s", r, c->w[r].addr);
        }
        st = lk_chan_recv(&c->w[r].ch, h, buf, cap, lk_deadline_ms(5000), why, sizeof why);
        if (st) return lk_fail(err, errlen, st, "worker rank %d (%s): %s", r, c->w[r].addr, why);
        last = lk_time_ns();
        atomic_store(&c->w[r].last_seen, last);
        if (h->type != LK_MSG_PING) return LK_OK;
    }
}

static void local_host(lk_link *l, char *host, size_t len) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    snprintf(host, len, "127.0.0.1");
    if (l && getsockname(lk_tcp_fd(l), (struct sockaddr *)&ss, &sl) == 0)
        getnameinfo((struct sockaddr *)&ss, sl, host, (socklen_t)len, NULL, 0, NI_NUMERICHOST);
}

static lk_status parse_weights(const char *s, int n, double *w, char *err, size_t errlen) {
    int k = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        double v = strtod(p, &end);
        if (end == p || errno || k == n)
            return lk_fail(err, errlen, LK_ERR_ARG, "--tp-weights '%s': expected %d positive numbers", s, n);
        w[k++] = v;
        p = end;
        if (*p == ',') p++;
        else if (*p) return lk_fail(err, errlen, LK_ERR_ARG, "--tp-weights '%s': expected %d positive numbers", s, n);
    }
    if (k != n) return lk_fail(err, errlen, LK_ERR_ARG, "--tp-weights '%s' has %d entries for %d ranks", s, k, n);
    return LK_OK;
}

/* Forks a worker serving one session on a fresh loopback port. The child
 * dies with us (PR_SET_PDEATHSIG), so a crashed head leaves no orphans. */
static lk_status spawn_local(lk_cluster *c, int r, int threads, char *err, size_t errlen) {
    int lfd, port;
    lk_status st = lk_tcp_listen("127.0.0.1:0", &lfd, &port, err, errlen);
    if (st) return st;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(lfd);
        return lk_fail(err, errlen, LK_ERR_IO, "fork: %s", strerror(errno));
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        /* Ctrl-C, or a SIGTERM to the whole group (kill %1, systemd), is
         * the head's to act on: it ends the session cleanly and we follow;
         * dying first would make it report a lost worker on the way out */
        signal(SIGINT, SIG_IGN);
        signal(SIGTERM, SIG_IGN);
        /* the head already reports the session; a local worker speaks up
         * only for warnings and errors (unless -v asked for debug) */
        if (lk_log_level() == LK_LOG_INFO) lk_log_set_level(LK_LOG_WARN);
        lk_worker_opts wo = {.listen_fd = lfd, .key = c->key, .n_threads = threads, .once = true};
        char e[LK_ERRLEN];
        lk_status ws = lk_worker_serve(&wo, e, sizeof e);
        if (ws) fprintf(stderr, "lockstep worker (local rank %d): %s\n", r, e);
        _exit(ws ? 1 : 0);
    }
    close(lfd);
    c->kids[r] = pid;
    snprintf(c->w[r].addr, sizeof c->w[r].addr, "127.0.0.1:%d", port);
    return LK_OK;
}

/* Connects to worker r and runs the handshake as the head. A worker whose
 * gate is full of strays answers LK_GATE_BUSY: try again, backing off, for
 * as long as a connection may take (10 s), then say what it answered. When
 * the last attempt after busy answers fails on the network (the deadline
 * cut its connect or handshake short on a loaded machine, or the refusing
 * worker's close reset it), the busy answers are still the reason: the
 * error names them first, and that last attempt after. */
static lk_status connect_one(lk_cluster *c, int r, const lk_hs_params *hp, char *err, size_t errlen) {
    char why[LK_ERRLEN], busy_why[LK_ERRLEN] = "";
    lk_status st, busy_st = LK_OK;
    uint64_t t0 = lk_time_ns(), deadline = lk_deadline_ms(10000);
    for (int tries = 1;; tries++) {
        st = lk_tcp_connect(c->w[r].addr, deadline, &c->w[r].link, why, sizeof why);
        if (!st) {
            c->w[r].link->peer_rank = r;
            lk_chan_init(&c->w[r].ch, c->w[r].link);
            lk_hs_peer peer;
            st = lk_handshake(&c->w[r].ch, true, hp, &peer, why, sizeof why);
            c->w[r].link = c->w[r].ch.link; /* the sealed link, when sealed */
            if (!st) {
                if (tries > 1)
                    lk_log(LK_LOG_INFO, "cluster: worker rank %d (%s) was busy; in after %d attempts (%.1f s)", r,
                           c->w[r].addr, tries, (double)(lk_time_ns() - t0) / 1e9);
                if (peer.sealed)
                    lk_log(LK_LOG_INFO, "cluster: worker rank %d (%s): control link sealed (%s)", r,
                           c->w[r].addr, lk_seal_cipher_name(peer.cipher));
                return LK_OK;
            }
        }
        bool busy = lk_hs_busy(st, why);
        if (busy) {
            snprintf(busy_why, sizeof busy_why, "%s", why);
            busy_st = st;
        }
        /* 50 ms, doubling to 800 ms, with jitter so that heads do not retry in step */
        uint64_t pause_ms = (50u << LK_MIN(tries - 1, 4)) + (uint64_t)(lk_time_ns() % 50);
        double took = (double)(lk_time_ns() - t0) / 1e9;
        if (!busy && busy_st && (st == LK_ERR_TIMEOUT || st == LK_ERR_NET))
            return lk_fail(err, errlen, busy_st, "worker rank %d: %s (%d attempts in %.1f s; the last: %s)", r,
                           busy_why, tries, took, why);
        if (!busy || lk_time_ns() + pause_ms * 1000000ull >= deadline) {
            if (tries > 1)
                return lk_fail(err, errlen, st, "worker rank %d: %s (%d attempts in %.1f s)", r, why, tries, took);
            return lk_fail(err, errlen, st, "worker rank %d: %s", r, why);
        }
        lk_link_close(c->w[r].link); /* NULL when the connect failed */
        c->w[r].link = NULL;
        usleep((useconds_t)pause_ms * 1000);
    }
}

/* Connects to every worker address and runs the handshake as the head. */
static lk_status connect_all(lk_cluster *c, const lk_hs_params *hp, char *err, size_t errlen) {
    lk_status st;
    for (int r = 1; r < c->n; r++)
        if ((st = connect_one(c, r, hp, err, errlen))) return st;
    return LK_OK;
}

/* ---- sending a worker its slices ----------------------------------------------------- */

typedef struct {
    int rank;
    const char *addr;
    uint64_t total, t0, last;
    bool tty;
    bool drawn;
} progress;

static void progress_show(progress *p, uint64_t sent, bool end) {
    uint64_t now = lk_time_ns();
    double secs = (double)(now - p->t0) / 1e9, mbs = (double)sent / 1e6 / (secs > 1e-6 ? secs : 1e-6);
    double pct = p->total ? 100.0 * (double)sent / (double)p->total : 100.0;
    if (p->tty) {
        if (!end && now - p->last < 250000000ull) return;
        fprintf(stderr, "\rcluster: slices to worker rank %d: %8.1f / %.1f MB %5.1f%% %7.1f MB/s %s", p->rank,
                (double)sent / 1e6, (double)p->total / 1e6, pct, mbs, end ? "\n" : "");
        p->drawn = !end;
    } else if (!end && now - p->last >= 5000000000ull) {
        lk_log(LK_LOG_INFO, "cluster: worker rank %d: %.0f%% of its slices sent (%.1f / %.1f MB, %.1f MB/s)", p->rank, pct,
               (double)sent / 1e6, (double)p->total / 1e6, mbs);
    } else if (!end) {
        return;
    }
    p->last = now;
}

/* A frame from the worker we are sending to, if one is waiting: PINGs are
 * heartbeats; a LOADED is its refusal midway (cache limit, disk full),
 * which ends the transfer (*stop). */
static lk_status poll_worker(lk_cluster *c, int r, lk_loaded_msg *rep, bool *stop, char *err, size_t errlen) {
    for (;;) {
        struct pollfd pf = {.fd = lk_tcp_fd(c->w[r].link), .events = POLLIN};
        if (poll(&pf, 1, 0) <= 0) return LK_OK;
        uint8_t b[1024];
        lk_frame_hdr h;
        char why[LK_ERRLEN];
        lk_status st = lk_chan_recv(&c->w[r].ch, &h, b, sizeof b, lk_deadline_ms(2000), why, sizeof why);
        if (st) return lk_fail(err, errlen, st, "worker rank %d (%s): %s", r, c->w[r].addr, why);
        atomic_store(&c->w[r].last_seen, lk_time_ns());
        if (h.type == LK_MSG_PING) continue;
        if (h.type != LK_MSG_LOADED || !lk_proto_loaded_decode(b, h.len, rep))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "worker rank %d (%s): unexpected %s while receiving its slices", r,
                           c->w[r].addr, lk_msg_name(h.type));
        *stop = true;
        return LK_OK;
    }
}

/* Worker r has no copy of the model: sends it the bytes its slice reads
 * (and the identity's samples), in file order, in DATA frames of up to
 * 1 MiB, then their digest; *rep gets its answer (loaded, or why not). */
static lk_status send_slices(lk_cluster *c, int r, const lk_gguf *g, lk_loaded_msg *rep, char *err, size_t errlen) {
    char why[LK_ERRLEN];
    lk_ranges l = {0};
    lk_status st = lk_proto_slice_ranges(g, &c->slices[r], &l, why, sizeof why);
    if (st) return lk_fail(err, errlen, st, "worker rank %d (%s): its slice: %s", r, c->w[r].addr, why);
    lk_file_msg fm = {.size = lk_gguf_file_size(g), .header_len = lk_gguf_data_offset(g), .n_bytes = lk_ranges_total(&l),
                      .disk = lk_ranges_disk(&l, LK_DISK_BLOCK), .n_ranges = (uint64_t)l.n};
    lk_proto_ranges_hash(&l, fm.size, fm.ranges_hash);
    lk_log(LK_LOG_INFO, "cluster: worker rank %d (%s) has no copy of the model: sending its slices, %.1f of the %.1f MB",
           r, c->w[r].addr, (double)fm.n_bytes / 1e6, (double)fm.size / 1e6);
    uint8_t msg[256];
    uint32_t len = lk_proto_file_encode(&fm, msg, sizeof msg);
    if ((st = send_to(c, r, LK_MSG_FILE, msg, len, 10000, why, sizeof why))) {
        lk_ranges_free(&l);
        return lk_fail(err, errlen, st, "sending worker rank %d (%s) its slices: %s", r, c->w[r].addr, why);
    }
    const uint32_t CH = 1u << 20;
    uint8_t *chunk = lk_xmalloc(CH);
    const uint8_t *file = lk_gguf_file_bytes(g);
    crypto_generichash_state hs;
    lk_proto_digest_init(&hs, fm.size);
    uint64_t t0 = lk_time_ns();
    progress pg = {.rank = r, .addr = c->w[r].addr, .total = fm.n_bytes, .t0 = t0, .last = t0,
                   .tty = isatty(2) && lk_log_level() >= LK_LOG_INFO};
    uint64_t sent = 0, next = 0, roff = 0;
    uint32_t fill = 0;
    bool stop = false;
    why[0] = 0;
    for (int64_t i = 0; !st && !stop && (i < l.n || fill);) {
        while (i < l.n && fill < CH) { /* pack the next bytes of the ranges */
            uint32_t k = (uint32_t)LK_MIN((uint64_t)(CH - fill), l.r[i].len - roff);
            memcpy(chunk + fill, file + l.r[i].off + roff, k);
            fill += k, roff += k;
            if (roff == l.r[i].len) i++, roff = 0;
        }
        crypto_generichash_update(&hs, chunk, fill);
        if ((st = poll_worker(c, r, rep, &stop, err, errlen)) || stop) break;
        if ((st = send_to(c, r, LK_MSG_DATA, chunk, fill, 60000, why, sizeof why))) break;
        sent += fill;
        fill = 0;
        progress_show(&pg, sent, false);
        st = tend_others(c, r, &next, err, errlen);
    }
    if (pg.drawn && (st || stop)) fputc('\n', stderr); /* close the line: the error follows */
    if (!st && !stop) {
        uint8_t dg[32];
        crypto_generichash_final(&hs, dg, 32);
        st = send_to(c, r, LK_MSG_FILE_END, dg, 32, 10000, why, sizeof why);
        if (!st) {
            double secs = (double)(lk_time_ns() - pg.t0) / 1e9;
            if (pg.tty) progress_show(&pg, sent, true);
            lk_log(LK_LOG_INFO, "cluster: sent worker rank %d (%s) its slices: %llu of %llu bytes in %.2f s (%.1f MB/s)",
                   r, c->w[r].addr, (unsigned long long)sent, (unsigned long long)fm.size, secs,
                   (double)sent / 1e6 / (secs > 1e-6 ? secs : 1e-6));
        }
    }
    free(chunk);
    lk_ranges_free(&l);
    if (st && why[0]) return lk_fail(err, errlen, st, "sending worker rank %d (%s) its slices: %s", r, c->w[r].addr, why);
    if (st || stop) return st;
    /* its answer once it has checked and loaded them */
    lk_frame_hdr h;
    uint8_t b[1024];
    if ((st = recv_reply(c, r, &h, b, sizeof b, err, errlen))) return st;
    if (h.type != LK_MSG_LOADED || !lk_proto_loaded_decode(b, h.len, rep) || rep->want_file)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "worker rank %d (%s): bad reply %s to its slices", r, c->w[r].addr,
                       lk_msg_name(h.type));
    return LK_OK;
}

/* After LOAD or BENCH went out: collects every worker's LOADED (its mesh
 * address), sends the workers that asked for them their slices, sends
 * everyone's addresses, builds our end of the mesh and waits for every
 * READY. */
static lk_status mesh_phase(lk_cluster *c, const lk_gguf *g, const char *refusal, lk_mesh_shm shm, int64_t spin_ns,
                            char *err, size_t errlen) {
    lk_status st;
    char why[LK_ERRLEN];
    uint8_t buf[8192];
    lk_mesh_msg mm = {.n = c->n};
    bool wants[LK_MAX_RANKS] = {0};
    for (int pass = 0; pass < 2; pass++)
        for (int r = 1; r < c->n; r++) {
            lk_frame_hdr h;
            lk_loaded_msg rep;
            if (pass == 0) {
                if ((st = recv_reply(c, r, &h, buf, sizeof buf, err, errlen))) return st;
                if (h.type != LK_MSG_LOADED || !lk_proto_loaded_decode(buf, h.len, &rep))
                    return lk_fail(err, errlen, LK_ERR_FORMAT, "worker rank %d (%s): bad reply %s", r, c->w[r].addr,
                                   lk_msg_name(h.type));
                c->w[r].idle = true; /* until MESH: nothing but heartbeats from it */
                if (rep.want_file) {
                    if (!g) return lk_fail(err, errlen, LK_ERR_FORMAT, "worker rank %d (%s) asks for a file", r, c->w[r].addr);
                    wants[r] = true;
                    continue;
                }
            } else {
                if (!wants[r]) continue;
                c->w[r].idle = false;
                if ((st = send_slices(c, r, g, &rep, err, errlen))) return st;
                c->w[r].idle = true;
            }
            if (!rep.ok)
                return lk_fail(err, errlen, LK_ERR_PEER, "worker rank %d (%s) %s: %s", r, c->w[r].addr, refusal, rep.reason);
            snprintf(mm.addrs[r], LK_ADDR_LEN, "%s", rep.mesh_addr);
        }
    for (int r = 1; r < c->n; r++) c->w[r].idle = false;
    /* our listener on the address the first worker sees us by */
    char host[96];
    local_host(c->w[1].link, host, sizeof host);
    char laddr[LK_ADDR_LEN];
    int lfd, port;
    snprintf(laddr, sizeof laddr, strchr(host, ':') ? "[%s]:0" : "%s:0", host);
    if ((st = lk_tcp_listen(laddr, &lfd, &port, err, errlen))) return st;
    snprintf(mm.addrs[0], LK_ADDR_LEN, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    for (int r = 1; r < c->n; r++) {
        lk_mesh_msg mr; /* with --emulate-link, this worker's own view: relays for some lower ranks */
        if ((st = lk_emu_route(c->emu, &mm, r, &mr, err, errlen))) {
            close(lfd);
            return st;
        }
        uint32_t len = lk_proto_mesh_encode(&mr, buf, sizeof buf);
        if ((st = send_to(c, r, LK_MSG_MESH, buf, len, 5000, why, sizeof why))) {
            close(lfd);
            return lk_fail(err, errlen, st, "worker rank %d (%s): %s", r, c->w[r].addr, why);
        }
    }
    const char *addrs[LK_MAX_RANKS];
    for (int r = 0; r < c->n; r++) addrs[r] = mm.addrs[r];
    lk_hs_params mhp;
    lk_hs_defaults(&mhp, c->key, "rank 0");
    mhp.seal = c->seal ? LK_SEAL_ON : LK_SEAL_OFF; /* the workers follow their control link */
    lk_mesh_params mp = {.rank = 0, .n = c->n, .addrs = addrs, .listen_fd = lfd, .shm = shm, .spin_ns = spin_ns,
                         .timeout_ms = 20000, .auth = &lk_hs_mesh_auth, .auth_ctx = &mhp};
    st = lk_mesh_create(&mp, &c->mesh, why, sizeof why);
    close(lfd);
    if (st) return lk_fail(err, errlen, st, "building the mesh: %s", why);
    for (int r = 1; r < c->n; r++) {
        lk_frame_hdr h;
        if ((st = recv_reply(c, r, &h, buf, sizeof buf, err, errlen))) return st;
        lk_rbuf rb = {buf, h.len, 0, true};
        uint8_t ok = lk_rb_u8(&rb);
        char reason[512];
        lk_rb_str(&rb, reason, sizeof reason);
        if (h.type != LK_MSG_READY || !rb.ok || !ok)
            return lk_fail(err, errlen, LK_ERR_PEER, "worker rank %d (%s): mesh failed: %s", r, c->w[r].addr,
                           rb.ok ? reason : "bad reply");
    }
    return LK_OK;
}

static lk_status open_fail(lk_cluster *c, lk_status st) {
    lk_cluster_close(c);
    return st;
}

lk_status lk_cluster_open(const lk_cluster_opts *o, const lk_gguf *g, const lk_plan_dims *dims,
                          lk_cluster **out, lk_slice *head_slice, char *err, size_t errlen) {
    *out = NULL;
    lk_cluster *c = lk_xcalloc(1, sizeof *c);
    pthread_mutex_init(&c->err_mu, NULL);
    for (int r = 0; r < LK_MAX_RANKS; r++) pthread_mutex_init(&c->w[r].mu, NULL);
    /* 1.5 s: six missed heartbeats, and named well inside 2 s. */
    c->dead_after_ms = o->dead_after_ms > 0 ? o->dead_after_ms : 1500;
    c->seal = o->seal;
    c->n = 1;
    lk_status st;

    /* who */
    if (o->workers && o->local > 1)
        return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "give --workers or --local, not both"));
    if (o->key_file) {
        if ((st = lk_key_load(o->key_file, c->key, err, errlen))) return open_fail(c, st);
    } else if (o->workers) {
        return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--workers needs --key-file (make one with 'lockstep keygen')"));
    } else {
        /* A one-off key: the local children inherit it in memory. */
        char hex[2 * LK_KEY_BYTES + 1];
        lk_key_generate(hex);
        for (int i = 0; i < LK_KEY_BYTES; i++) sscanf(hex + 2 * i, "%2hhx", &c->key[i]);
    }
    if (o->workers) {
        char *list = lk_xstrdup(o->workers), *save = NULL;
        for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            if (c->n == LK_MAX_RANKS || strlen(t) >= LK_ADDR_LEN) {
                free(list);
                return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--workers: at most %d entries of HOST:PORT",
                                            LK_MAX_RANKS - 1));
            }
            snprintf(c->w[c->n].addr, LK_ADDR_LEN, "%s", t);
            c->n++;
        }
        free(list);
    } else if (o->local > 1) {
        if (o->local > LK_MAX_RANKS)
            return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--local %d: at most %d", o->local, LK_MAX_RANKS));
        c->n = o->local; /* started once the layout is known to be valid */
    }
    if (c->n < 2) return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "a cluster needs at least one worker"));
    int tp = o->tp, pp = o->pp;
    if (!tp && !pp) tp = c->n, pp = 1;
    else if (!tp) tp = pp > 0 && c->n % pp == 0 ? c->n / pp : 0;
    else if (!pp) pp = tp > 0 && c->n % tp == 0 ? c->n / tp : 0;
    if (tp < 1 || pp < 1 || tp * pp != c->n)
        return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--tp %d x --pp %d does not match the %d ranks (head included)",
                                    o->tp, o->pp, c->n));
    c->tp = tp;
    c->pp = pp;
    lk_mesh_shm shm;
    if ((st = lk_transport_parse(o->transport, &shm, err, errlen))) return open_fail(c, st);
    if ((st = lk_emu_open(o->emulate_link, c->n, o->local > 1 && !o->workers, &shm, &c->emu, err, errlen)))
        return open_fail(c, st);

    lk_wire_fmt wire = LK_WIRE_F32;
    if (o->wire && !lk_wire_fmt_parse(o->wire, &wire))
        return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--wire must be f32, f16, bf16 or q8 (got '%s')", o->wire));

    /* plan */
    lk_slice slices[LK_MAX_RANKS];
    double w[LK_MAX_RANKS];
    int layers[LK_MAX_RANKS];
    if (o->tp_weights && (st = parse_weights(o->tp_weights, tp, w, err, errlen))) return open_fail(c, st);
    if (o->layers_split) {
        double lw[LK_MAX_RANKS];
        if ((st = parse_weights(o->layers_split, pp, lw, err, errlen)))
            return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--layers-split '%s': expected %d layer counts",
                                        o->layers_split, pp));
        for (int i = 0; i < pp; i++) {
            layers[i] = (int)lw[i];
            if ((double)layers[i] != lw[i])
                return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--layers-split '%s': whole layer counts",
                                            o->layers_split));
        }
    }
    if ((st = lk_plan_make_split(dims, tp, pp, o->tp_weights ? w : NULL, o->layers_split ? layers : NULL, slices,
                                 err, errlen)))
        return open_fail(c, st);
    const bool ep = o->expert_parallel > 0 || (o->expert_parallel == 0 && tp > 1 && dims->n_expert >= tp);
    if (ep && (st = lk_plan_experts(dims, tp, pp, o->tp_weights ? w : NULL, slices, err, errlen)))
        return open_fail(c, st);
    memcpy(c->slices, slices, sizeof(lk_slice) * (size_t)c->n);

    if (o->local > 1 && !o->workers) {
        int threads = o->n_threads ? o->n_threads : LK_MAX(1, lk_threads_default() / o->local);
        for (int r = 1; r < o->local; r++)
            if ((st = spawn_local(c, r, threads, err, errlen))) return open_fail(c, st);
    }

    /* agree */
    uint8_t id[LK_MODEL_ID_BYTES];
    lk_cluster_model_id(g, id);
    lk_hs_params hp;
    lk_hs_defaults(&hp, c->key, "head");
    hp.seal = c->seal ? LK_SEAL_ON : LK_SEAL_OFF;
    hp.has_model = true;
    memcpy(hp.model_id, id, sizeof id);
    char why[LK_ERRLEN];
    if ((st = connect_all(c, &hp, err, errlen))) return open_fail(c, st);

    /* load */
    const char *path = lk_gguf_path(g), *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    uint8_t buf[8192];
    for (int r = 1; r < c->n; r++) {
        lk_load_msg L = {.rank = r, .n_ranks = c->n, .tp = tp, .slice = slices[r], .n_ctx = o->n_ctx,
                         .n_batch = o->n_batch, .n_threads = o->n_threads, .kv_f16 = o->kv_f16, .shm = (uint8_t)shm,
                         .max_seqs = o->max_seqs, .kv_tokens = o->kv_tokens,
                         .wire = (uint8_t)wire};
        snprintf(L.model_name, sizeof L.model_name, "%s", base);
        if (!realpath(path, L.model_path)) snprintf(L.model_path, sizeof L.model_path, "%s", path);
        memcpy(L.model_id, id, sizeof id);
        uint32_t len = lk_proto_load_encode(&L, buf, sizeof buf);
        if ((st = send_to(c, r, LK_MSG_LOAD, buf, len, 5000, why, sizeof why)))
            return open_fail(c, lk_fail(err, errlen, st, "worker rank %d (%s): %s", r, c->w[r].addr, why));
    }
    if ((st = mesh_phase(c, g, "cannot load the model", shm, -1, err, errlen))) return open_fail(c, st);
    int group[LK_MAX_RANKS];
    for (int t = 0; t < tp; t++) group[t] = t; /* the head's TP group: stage 0 */
    if ((st = lk_comm_create(c->mesh, group, tp, &c->comm, err, errlen))) return open_fail(c, st);
    /* Slow ranks are not dead ones: the monitor finds the dead within
     * dead_after_ms and cuts their sockets, so this deadline only guards
     * against a bug. */
    lk_comm_set_timeout_ms(c->comm, 600000);
    lk_comm_set_wire(c->comm, wire);
    uint64_t now = lk_time_ns();
    for (int r = 1; r < c->n; r++) atomic_store(&c->w[r].last_seen, now);
    pthread_create(&c->mon, NULL, monitor_main, c);
    c->mon_started = true;
    *head_slice = slices[0];
    char ex[48] = "";
    if (slices[0].ep) snprintf(ex, sizeof ex, ", experts %d-%d whole", slices[0].expert0, slices[0].expert1 - 1);
    lk_log(LK_LOG_INFO, "cluster: %d ranks (tp %d x pp %d); head holds layers %d-%d, heads %d-%d, ffn rows %lld-%lld%s",
           c->n, tp, pp, slices[0].layer0, slices[0].layer1 - 1, slices[0].head0, slices[0].head1 - 1,
           (long long)slices[0].ff0, (long long)slices[0].ff1 - 1, ex);
    *out = c;
    return LK_OK;
}

void lk_cluster_close(lk_cluster *c) {
    if (!c) return;
    if (c->mon_started) {
        atomic_store(&c->stop, 1);
        pthread_join(c->mon, NULL);
    }
    char err[LK_ERRLEN];
    for (int r = 1; r < c->n; r++)
        if (c->w[r].link && !atomic_load(&c->w[r].dead)) send_to(c, r, LK_MSG_BYE, "", 0, 500, err, sizeof err);
    lk_comm_free(c->comm);
    lk_mesh_free(c->mesh);
    for (int r = 1; r < c->n; r++) lk_link_close(c->w[r].link);
    uint64_t until = lk_time_ns() + 2000000000ull; /* for all of them together */
    for (int r = 1; r < c->n; r++) {
        if (c->kids[r] <= 0) continue;
        /* The child ends its session on BYE or on the closed connection; one
         * declared dead (frozen, say), or never connected, is not waited for. */
        if (atomic_load(&c->w[r].dead) || !c->w[r].link) kill(c->kids[r], SIGKILL);
        int ws;
        while (waitpid(c->kids[r], &ws, WNOHANG) == 0) {
            if (lk_time_ns() > until) {
                kill(c->kids[r], SIGKILL);
                waitpid(c->kids[r], &ws, 0);
                break;
            }
            usleep(5000);
        }
    }
    lk_emu_close(c->emu); /* after the mesh: its relays carried it */
    for (int r = 0; r < LK_MAX_RANKS; r++) pthread_mutex_destroy(&c->w[r].mu);
    pthread_mutex_destroy(&c->err_mu);
    free(c);
}

bool lk_cluster_rank_times(lk_cluster *c, int rank, double *compute_s, double *comm_s) {
    if (rank < 1 || rank >= c->n) return false;
    *compute_s = (double)atomic_load(&c->w[rank].step_us[0]) / 1e6;
    *comm_s = (double)atomic_load(&c->w[rank].step_us[1]) / 1e6;
    return true;
}

int lk_cluster_n_ranks(const lk_cluster *c) { return c->n; }
int lk_cluster_local_pid(const lk_cluster *c, int rank) {
    return rank > 0 && rank < c->n ? (int)c->kids[rank] : 0;
}

lk_mesh *lk_cluster_mesh(lk_cluster *c) { return c->mesh; }
const lk_slice *lk_cluster_plan(const lk_cluster *c) { return c->slices; }
lk_comm *lk_cluster_comm(lk_cluster *c) { return c->comm; }

const char *lk_cluster_explain(lk_cluster *c, const char *detail) {
    set_err(c, detail);
    return lk_cluster_error(c);
}

lk_status lk_cluster_bench(const char *workers, const uint8_t *key, const lk_bench_cfg *cfg, lk_mesh_shm shm,
                           int64_t spin_ns, FILE *out, char *err, size_t errlen) {
    lk_cluster *c = lk_xcalloc(1, sizeof *c);
    pthread_mutex_init(&c->err_mu, NULL);
    for (int r = 0; r < LK_MAX_RANKS; r++) pthread_mutex_init(&c->w[r].mu, NULL);
    memcpy(c->key, key, LK_KEY_BYTES);
    c->n = 1;
    char *list = lk_xstrdup(workers), *save = NULL;
    for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (c->n == LK_MAX_RANKS || strlen(t) >= LK_ADDR_LEN) {
            free(list);
            return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--workers: at most %d entries of HOST:PORT",
                                        LK_MAX_RANKS - 1));
        }
        snprintf(c->w[c->n++].addr, LK_ADDR_LEN, "%s", t);
    }
    free(list);
    if (c->n < 2) return open_fail(c, lk_fail(err, errlen, LK_ERR_ARG, "--workers: no address given"));
    lk_hs_params hp;
    lk_hs_defaults(&hp, c->key, "head");
    c->seal = cfg->seal;
    hp.seal = c->seal ? LK_SEAL_ON : LK_SEAL_OFF;
    /* --emulate-link: the workers are local daemons (doctor --local) */
    lk_status st = lk_emu_open(cfg->emulate_link, c->n, true, &shm, &c->emu, err, errlen);
    if (!st) st = connect_all(c, &hp, err, errlen);
    if (st) return open_fail(c, st);
    uint8_t buf[1024];
    char why[LK_ERRLEN];
    for (int r = 1; r < c->n; r++) {
        lk_bench_msg b = {.rank = r, .n_ranks = c->n, .shm = (uint8_t)shm, .spin_ns = spin_ns, .cfg = *cfg};
        uint32_t len = lk_proto_bench_encode(&b, buf, sizeof buf);
        if ((st = send_to(c, r, LK_MSG_BENCH, buf, len, 5000, why, sizeof why)))
            return open_fail(c, lk_fail(err, errlen, st, "worker rank %d (%s): %s", r, c->w[r].addr, why));
    }
    if ((st = mesh_phase(c, NULL, "refused the benchmark", shm, spin_ns, err, errlen))) return open_fail(c, st);
    st = lk_bench_run(c->mesh, cfg, out, err, errlen);
    lk_cluster_close(c); /* BYE: the workers wait for the next head */
    return st;
}
