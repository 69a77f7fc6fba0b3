/* UCX transport (--transport ucx): a link over UCP's stream API, so that
 * whatever UCX drives — InfiniBand and RoCE verbs, shared memory, TCP — carries
 * the collectives, chosen by UCX at run time (UCX_TLS, UCX_NET_DEVICES).
 *
 * Shape: every link owns its UCP context, worker and endpoint. That keeps
 * lk_link's contract (a link is used by one thread at a time) without locks,
 * and costs a few milliseconds and some memory per peer at setup, nothing
 * per message. The workers' addresses are exchanged over the TCP control
 * link, which the cluster handshake has already authenticated: a UCX
 * endpoint only ever connects to an address that a key holder gave us.
 *
 * Sending: send_some copies into one of SEND_SLOTS staging buffers and posts
 * a stream send from there, so the caller's buffer is free as soon as the
 * call returns (lk_xfer_run may give up on a transfer at its deadline; UCX
 * must never read or write a buffer after that). Receiving takes whatever
 * UCX has already assembled (ucp_stream_recv_data_nb: no receive is ever
 * left posted into a caller's buffer) and releases it once copied out.
 *
 * Waiting: like the own transports, lk_xfer_run spins first (each
 * send_some/recv_some call drives ucp_worker_progress). Blocking arms the
 * worker and poll()s its event fd together with the control socket, at
 * most 5 ms at a time; a peer that dies is noticed by UCX's error handler
 * (peer failure mode) or by EOF on the control link, whichever comes first.
 *
 * No silent fallback: once the endpoint is wired up (one round trip over
 * it), the lanes UCX selected are read back from ucp_ep_print_info (UCX
 * 1.13 has no query for them), boiled down to "tcp/lo" or "posix/memory
 * sysv/memory", printed on stderr on both sides, exchanged over the control
 * link and compared: peers that disagree, or a host with an RDMA device
 * whose link does not use it, get a warning. */
#include "transport/transport.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <pthread.h>
#include <time.h>

bool lk_rdma_device_present(void) {
    DIR *d = opendir("/sys/class/infiniband");
    if (!d) return false;
    bool any = false;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') { any = true; break; }
    closedir(d);
    return any;
}

lk_status lk_transport_parse(const char *name, lk_mesh_shm *out, char *err, size_t errlen) {
    if (!name || !strcmp(name, "auto")) *out = LK_MESH_SHM_AUTO;
    else if (!strcmp(name, "tcp")) *out = LK_MESH_SHM_OFF;
    else if (!strcmp(name, "shm")) *out = LK_MESH_SHM_FORCE;
    else if (!strcmp(name, "ucx")) {
        if (!lk_ucx_built()) return lk_fail(err, errlen, LK_ERR_ARG, "lockstep was built without UCX (install libucx-dev and rebuild)");
        *out = LK_MESH_UCX;
    } else if (!strcmp(name, "mpi")) {
        if (!lk_mpi_built()) return lk_fail(err, errlen, LK_ERR_ARG, "lockstep was built without MPI (install libopenmpi-dev and rebuild)");
        if (!lk_mpi_active())
            return lk_fail(err, errlen, LK_ERR_ARG, "--transport mpi needs a job started by mpirun or srun "
                                                   "(mpirun -np N lockstep ... --transport mpi)");
        *out = LK_MESH_MPI;
    } else
        return lk_fail(err, errlen, LK_ERR_ARG, "--transport must be auto, tcp, shm, ucx or mpi (got '%s')", name);
    return LK_OK;
}

#ifndef LK_HAVE_UCX

bool lk_ucx_built(void) { return false; }
lk_status lk_ucx_pair(lk_link *ctl, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen) {
    *out = NULL;
    return lk_fail(err, errlen, LK_ERR_ARG, "lockstep was built without UCX (install libucx-dev and rebuild)");
}
const char *lk_ucx_report(const lk_link *l) { return NULL; }

#else

#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>

#define SEND_SLOTS 4
#define SEND_CHUNK (64u << 10)
#define MAX_ADDR   (64u << 10)
#define PING_MAGIC 0x4c4b5558504e4731ull /* "LKUXPNG1" */

typedef struct ucx_link_s {
    lk_link       base;
    ucp_context_h ctx;
    ucp_worker_h  worker;
    ucp_ep_h      ep;
    int           efd;            /* worker event fd, -1 without wake-up support */
    lk_link      *ctl;            /* not owned: watched for the peer's death */
    uint64_t      next_ctl_check;
    bool          failed;
    char          why[160];
    void         *sreq[SEND_SLOTS]; /* in flight, oldest at shead */
    unsigned      shead, sn;
    unsigned char *sbuf;          /* [SEND_SLOTS][SEND_CHUNK] */
    unsigned char *rdata;         /* from ucp_stream_recv_data_nb, not yet all copied out */
    size_t        rlen, roff;
    char          report[128];    /* "tcp/lo" */
    pthread_mutex_t mu;           /* held by whoever drives this link's worker */
    struct ucx_link_s *next;      /* all UCX links of the process (links_mu) */
} ucx_link;

/* A send that send_some reported done may still sit in UCX's queue (a TCP
 * socket that was full, a FIFO without room) and only moves when its worker
 * is progressed — which nobody does once the transfer is done, so the peer
 * would wait for it. Every UCX link of the process is therefore on a list,
 * and a waiter drives the workers that still have sends in flight (each
 * under its own lock, taken with trylock so a waiter never blocks on a link
 * another thread uses) and does not sleep long while any remain. */
static pthread_mutex_t links_mu = PTHREAD_MUTEX_INITIALIZER;
static ucx_link *links;

bool lk_ucx_built(void) { return true; }

static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t status) {
    ucx_link *u = arg;
    if (!u->failed) snprintf(u->why, sizeof u->why, "UCX endpoint failed: %s", ucs_status_string(status));
    u->failed = true;
}

static ssize_t dead(ucx_link *u, char *err, size_t errlen) {
    lk_fail(err, errlen, LK_ERR_NET, "%s", u->why);
    return -1;
}

static void note_fail(ucx_link *u, const char *what, ucs_status_t s) {
    if (!u->failed) snprintf(u->why, sizeof u->why, "UCX %s: %s", what, ucs_status_string(s));
    u->failed = true;
}

/* Completed sends leave the queue in order; a failed one fails the link. */
static void reap_sends(ucx_link *u) {
    while (u->sn) {
        void *r = u->sreq[u->shead];
        ucs_status_t s = ucp_request_check_status(r);
        if (s == UCS_INPROGRESS) break;
        ucp_request_free(r);
        if (s != UCS_OK) note_fail(u, "send", s);
        u->sreq[u->shead] = NULL;
        u->shead = (u->shead + 1) % SEND_SLOTS;
        u->sn--;
    }
}

/* Drives the other links' unfinished sends; true if any remain. */
static bool progress_others(ucx_link *self) {
    bool left = false;
    pthread_mutex_lock(&links_mu);
    for (ucx_link *o = links; o; o = o->next) {
        if (o == self || !o->sn) continue;
        if (pthread_mutex_trylock(&o->mu)) { left = true; continue; }
        while (ucp_worker_progress(o->worker)) {}
        reap_sends(o);
        left |= o->sn > 0;
        pthread_mutex_unlock(&o->mu);
    }
    pthread_mutex_unlock(&links_mu);
    return left;
}

static ssize_t send_some_locked(ucx_link *u, const void *buf, size_t n, char *err, size_t errlen);
static ssize_t recv_some_locked(ucx_link *u, void *buf, size_t n, char *err, size_t errlen);
static int wait_locked(ucx_link *u, bool for_send, uint64_t timeout_ns, char *err, size_t errlen);

static ssize_t ucx_send_some(lk_link *l, const void *buf, size_t n, char *err, size_t errlen) {
    ucx_link *u = (ucx_link *)l;
    pthread_mutex_lock(&u->mu);
    ssize_t k = send_some_locked(u, buf, n, err, errlen);
    pthread_mutex_unlock(&u->mu);
    return k;
}
static ssize_t ucx_recv_some(lk_link *l, void *buf, size_t n, char *err, size_t errlen) {
    ucx_link *u = (ucx_link *)l;
    pthread_mutex_lock(&u->mu);
    ssize_t k = recv_some_locked(u, buf, n, err, errlen);
    pthread_mutex_unlock(&u->mu);
    return k;
}
static int ucx_wait(lk_link *l, bool for_send, uint64_t timeout_ns, char *err, size_t errlen) {
    ucx_link *u = (ucx_link *)l;
    bool others = progress_others(u);
    pthread_mutex_lock(&u->mu);
    /* while another link's sends are unfinished, come back soon to drive them */
    int r = wait_locked(u, for_send, others ? LK_MIN(timeout_ns, 20000ull) : timeout_ns, err, errlen);
    pthread_mutex_unlock(&u->mu);
    return r;
}

static ssize_t send_some_locked(ucx_link *u, const void *buf, size_t n, char *err, size_t errlen) {
    ucp_worker_progress(u->worker);
    reap_sends(u);
    if (u->failed) return dead(u, err, errlen);
    size_t moved = 0;
    while (moved < n && u->sn < SEND_SLOTS) {
        unsigned slot = (u->shead + u->sn) % SEND_SLOTS;
        size_t k = LK_MIN(n - moved, (size_t)SEND_CHUNK);
        unsigned char *b = u->sbuf + (size_t)slot * SEND_CHUNK;
        memcpy(b, (const char *)buf + moved, k);
        ucp_request_param_t p = {.op_attr_mask = 0};
        ucs_status_ptr_t r = ucp_stream_send_nbx(u->ep, b, k, &p);
        if (UCS_PTR_IS_ERR(r)) {
            note_fail(u, "send", UCS_PTR_STATUS(r));
            return dead(u, err, errlen);
        }
        moved += k;
        if (r == NULL) continue; /* done at once: the slot is free again */
        u->sreq[slot] = r;
        u->sn++;
    }
    return (ssize_t)moved;
}

static ssize_t recv_some_locked(ucx_link *u, void *buf, size_t n, char *err, size_t errlen) {
    size_t moved = 0;
    for (int round = 0; moved < n && round < 2; round++) {
        if (!u->rdata) {
            ucp_worker_progress(u->worker);
            size_t len = 0;
            ucs_status_ptr_t d = ucp_stream_recv_data_nb(u->ep, &len);
            if (UCS_PTR_IS_ERR(d)) {
                note_fail(u, "receive", UCS_PTR_STATUS(d));
                break;
            }
            if (!d) break;
            u->rdata = d;
            u->rlen = len;
            u->roff = 0;
        }
        size_t k = LK_MIN(n - moved, u->rlen - u->roff);
        memcpy((char *)buf + moved, u->rdata + u->roff, k);
        moved += k;
        u->roff += k;
        if (u->roff == u->rlen) {
            ucp_stream_data_release(u->ep, u->rdata);
            u->rdata = NULL;
        }
    }
    if (!moved && u->failed) return dead(u, err, errlen);
    return (ssize_t)moved;
}

static int ucx_poll_fd(lk_link *l) { return -1; }

/* Is the peer still there? Looks at the TCP control link without consuming. */
static bool ctl_dead(ucx_link *u) {
    char why[sizeof u->why];
    if (!lk_tcp_peer_gone(u->ctl, why, sizeof why)) return false;
    if (!u->failed) memcpy(u->why, why, sizeof why);
    u->failed = true;
    return true;
}

static int wait_locked(ucx_link *u, bool for_send, uint64_t timeout_ns, char *err, size_t errlen) {
    uint64_t now = lk_time_ns();
    if (now >= u->next_ctl_check) {
        if (ctl_dead(u)) return (int)dead(u, err, errlen);
        u->next_ctl_check = now + 5000000; /* every 5 ms at most */
    }
    if (u->failed) return (int)dead(u, err, errlen);
    if (timeout_ns > 5000000) timeout_ns = 5000000;
    if (u->efd < 0) {
        /* no wake-up: a short nap, then the caller polls again */
        struct timespec ts = {0, (long)LK_MIN(timeout_ns, 50000ull)};
        nanosleep(&ts, NULL);
        return 0;
    }
    /* Arm only when nothing is pending: BUSY means events arrived meanwhile.
     * Progress may have queued data on the endpoint or completed a send
     * without any event left to come: look before sleeping. */
    while (ucp_worker_progress(u->worker)) {}
    if (for_send) {
        /* A send that completes (the socket drained, the peer's FIFO
         * emptied) raises no event on the worker's fd: nap briefly instead
         * of arming. */
        reap_sends(u);
        if (u->sn < SEND_SLOTS || u->failed) return u->failed ? (int)dead(u, err, errlen) : 0;
        struct timespec ts = {0, (long)LK_MIN(timeout_ns, 20000ull)};
        nanosleep(&ts, NULL);
        return 0;
    }
    if (!u->rdata) {
        size_t len = 0;
        ucs_status_ptr_t d = ucp_stream_recv_data_nb(u->ep, &len);
        if (UCS_PTR_IS_ERR(d)) note_fail(u, "receive", UCS_PTR_STATUS(d));
        else if (d) u->rdata = d, u->rlen = len, u->roff = 0;
    }
    if (u->failed) return (int)dead(u, err, errlen);
    if (u->rdata) return 0;
    if (u->sn) { /* our own sends need driving too (above) */
        reap_sends(u);
        if (u->sn) {
            struct timespec ts = {0, (long)LK_MIN(timeout_ns, 20000ull)};
            nanosleep(&ts, NULL);
            return 0;
        }
    }
    if (ucp_worker_arm(u->worker) == UCS_ERR_BUSY) return 0;
    struct pollfd p[2] = {{.fd = u->efd, .events = POLLIN}, {.fd = lk_tcp_fd(u->ctl), .events = POLLIN}};
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    ppoll(p, p[1].fd >= 0 ? 2 : 1, &ts, NULL);
    return 0;
}

static void ucx_close(lk_link *l) {
    ucx_link *u = (ucx_link *)l;
    pthread_mutex_lock(&links_mu);
    for (ucx_link **p = &links; *p; p = &(*p)->next)
        if (*p == u) { *p = u->next; break; }
    pthread_mutex_unlock(&links_mu);
    if (u->rdata) ucp_stream_data_release(u->ep, u->rdata);
    /* What we sent gets a short while to leave (the peer may be reading its
     * last bytes), then everything still pending is cancelled. */
    uint64_t until = lk_time_ns() + 200000000ull;
    while (u->sn && !u->failed && lk_time_ns() < until) {
        ucp_worker_progress(u->worker);
        reap_sends(u);
    }
    for (unsigned i = 0; i < SEND_SLOTS; i++)
        if (u->sreq[i]) {
            ucp_request_cancel(u->worker, u->sreq[i]);
            ucp_request_free(u->sreq[i]);
        }
    if (u->ep) {
        ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
        ucs_status_ptr_t r = ucp_ep_close_nbx(u->ep, &p);
        if (r && !UCS_PTR_IS_ERR(r)) {
            until = lk_time_ns() + 200000000ull;
            while (ucp_request_check_status(r) == UCS_INPROGRESS && lk_time_ns() < until) ucp_worker_progress(u->worker);
            ucp_request_free(r);
        }
    }
    if (u->worker) ucp_worker_destroy(u->worker);
    if (u->ctx) ucp_cleanup(u->ctx);
    free(u->sbuf);
    pthread_mutex_destroy(&u->mu);
    free(u);
}

static const lk_link_ops ucx_ops = {
    .name = "ucx",
    .send_some = ucx_send_some,
    .recv_some = ucx_recv_some,
    .poll_fd = ucx_poll_fd,
    .wait = ucx_wait,
    .close = ucx_close,
};

const char *lk_ucx_report(const lk_link *l) {
    return l && l->ops == &ucx_ops ? ((const ucx_link *)l)->report : NULL;
}

/* ucp_ep_print_info writes the endpoint's configuration, one line per lane:
 *   "#                 lane[0]:  8:tcp/lo.0 md[4]           -> md[4]/tcp/sysdev[255] rma_bw#0 am am_bw#0"
 * We keep the distinct "tl/device" names of the lanes, in lane order. */
static void lanes_of(ucp_ep_h ep, char *out, size_t len) {
    out[0] = 0;
    char *text = NULL;
    size_t tlen = 0;
    FILE *f = open_memstream(&text, &tlen);
    if (!f) return;
    ucp_ep_print_info(ep, f);
    fclose(f);
    size_t used = 0;
    for (char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *lane = strstr(line, "lane[");
        if (!lane) continue;
        char *c = strchr(lane, ':');
        if (!c) continue;
        c++;
        while (*c == ' ') c++;
        char *colon = strchr(c, ':'), *sp = strchr(c, ' ');
        if (colon && (!sp || colon < sp)) c = colon + 1; /* skip the resource index "8:" */
        char name[64];
        size_t k = strcspn(c, " \t");
        if (!k || k >= sizeof name) continue;
        memcpy(name, c, k);
        name[k] = 0;
        char *dot = strrchr(name, '.'); /* "lo.0": drop the interface's address index */
        if (dot && dot[1] >= '0' && dot[1] <= '9' && strchr(name, '/') < dot) *dot = 0;
        /* each name once */
        bool seen = false;
        for (const char *p = out; (p = strstr(p, name)); p += k)
            if ((p == out || p[-1] == ' ') && (p[strlen(name)] == 0 || p[strlen(name)] == ' ')) { seen = true; break; }
        if (seen || used + strlen(name) + 2 >= len) continue;
        used += (size_t)snprintf(out + used, len - used, "%s%s", used ? " " : "", name);
    }
    free(text);
    if (!out[0]) snprintf(out, len, "unknown");
}

static bool is_rdma_tl(const char *report) {
    static const char *const rdma[] = {"rc", "ud", "dc", "rc_mlx5", "ud_mlx5", "dc_mlx5", "rc_verbs", "ud_verbs", NULL};
    for (int i = 0; rdma[i]; i++) {
        size_t k = strlen(rdma[i]);
        for (const char *p = report; (p = strstr(p, rdma[i])); p += k)
            if ((p == report || p[-1] == ' ') && p[k] == '/') return true;
    }
    return false;
}

lk_status lk_ucx_pair(lk_link *ctl, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen) {
    *out = NULL;
    char name[128];
    lk_link_name(ctl, name, sizeof name);
    ucx_link *u = lk_xcalloc(1, sizeof *u);
    u->base.ops = &ucx_ops;
    u->base.peer_rank = ctl->peer_rank;
    u->base.spin_ns = ctl->spin_ns;
    memcpy(u->base.peer_addr, ctl->peer_addr, sizeof u->base.peer_addr);
    u->ctl = ctl;
    u->efd = -1;
    u->sbuf = lk_xmalloc((size_t)SEND_SLOTS * SEND_CHUNK);
    pthread_mutex_init(&u->mu, NULL);
    lk_status st = LK_OK;
    ucp_address_t *addr = NULL;
    size_t alen = 0;
    unsigned char *peer = NULL;

    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP};
    ucs_status_t s = ucp_init(&cp, NULL, &u->ctx);
    if (s != UCS_OK) {
        u->ctx = NULL;
        st = lk_fail(err, errlen, LK_ERR_IO, "UCX initialisation: %s", ucs_status_string(s));
        goto fail;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((s = ucp_worker_create(u->ctx, &wp, &u->worker)) != UCS_OK) {
        u->worker = NULL;
        st = lk_fail(err, errlen, LK_ERR_IO, "UCX worker: %s", ucs_status_string(s));
        goto fail;
    }
    if (ucp_worker_get_efd(u->worker, &u->efd) != UCS_OK) u->efd = -1;
    if ((s = ucp_worker_get_address(u->worker, &addr, &alen)) != UCS_OK || alen > MAX_ADDR) {
        addr = s == UCS_OK ? addr : NULL;
        st = lk_fail(err, errlen, LK_ERR_IO, "UCX worker address: %s", s == UCS_OK ? "too long" : ucs_status_string(s));
        goto fail;
    }
    /* Both sides send first: a few hundred bytes fit any socket buffer. */
    uint32_t len32 = (uint32_t)alen, plen = 0;
    if ((st = lk_link_send(ctl, &len32, 4, deadline_ns, err, errlen)) ||
        (st = lk_link_send(ctl, addr, alen, deadline_ns, err, errlen)) ||
        (st = lk_link_recv(ctl, &plen, 4, deadline_ns, err, errlen)))
        goto fail;
    if (!plen || plen > MAX_ADDR) {
        st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s sent a malformed UCX worker address (%u bytes)", name, plen);
        goto fail;
    }
    peer = lk_xmalloc(plen);
    if ((st = lk_link_recv(ctl, peer, plen, deadline_ns, err, errlen))) goto fail;
    /* Peer failure mode lets a dead peer fail the link instead of the
     * process; a UCX whose transports cannot detect that gets the default. */
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = (const ucp_address_t *)peer,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_failed, .arg = u}};
    /* UCX logs the refusal as an error; here it is expected (shared
     * memory cannot detect a dead peer: the control link does that), so it
     * is hushed unless UCX_LOG_LEVEL asks for UCX's own messages. */
    ucs_log_level_t keep = ucs_global_opts.log_component.log_level;
    if (!getenv("UCX_LOG_LEVEL")) ucs_global_opts.log_component.log_level = UCS_LOG_LEVEL_FATAL;
    s = ucp_ep_create(u->worker, &ep, &u->ep);
    ucs_global_opts.log_component.log_level = keep;
    if (s != UCS_OK) {
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        if ((s = ucp_ep_create(u->worker, &ep, &u->ep)) != UCS_OK) {
            u->ep = NULL;
            st = lk_fail(err, errlen, LK_ERR_IO, "UCX endpoint to %s: %s", name, ucs_status_string(s));
            goto fail;
        }
    }
    /* One round trip over the endpoint wires it up completely, so what it
     * reports next is what the data will use. */
    uint64_t ping = PING_MAGIC, pong = 0;
    if ((st = lk_link_send(&u->base, &ping, sizeof ping, deadline_ns, err, errlen)) ||
        (st = lk_link_recv(&u->base, &pong, sizeof pong, deadline_ns, err, errlen)))
        goto fail;
    if (pong != PING_MAGIC) {
        st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: first bytes over UCX are wrong", name);
        goto fail;
    }
    lanes_of(u->ep, u->report, sizeof u->report);
    char theirs[sizeof u->report] = "";
    if ((st = lk_link_send(ctl, u->report, sizeof u->report, deadline_ns, err, errlen)) ||
        (st = lk_link_recv(ctl, theirs, sizeof theirs, deadline_ns, err, errlen)))
        goto fail;
    theirs[sizeof theirs - 1] = 0;
    fprintf(stderr, "lockstep: ucx link to %s: %s\n", name, u->report);
    if (strcmp(theirs, u->report))
        lk_log(LK_LOG_WARN, "ucx link to %s: the peers disagree on the transport: here %s, there %s", name, u->report,
               theirs);
    if (lk_rdma_device_present() && !is_rdma_tl(u->report))
        lk_log(LK_LOG_WARN, "ucx link to %s uses %s although this host has an RDMA device (/sys/class/infiniband); "
                            "check UCX_TLS, UCX_NET_DEVICES and the peer's NIC", name, u->report);
    ucp_worker_release_address(u->worker, addr);
    free(peer);
    pthread_mutex_lock(&links_mu);
    u->next = links;
    links = u;
    pthread_mutex_unlock(&links_mu);
    *out = &u->base;
    return LK_OK;
fail:
    if (addr) ucp_worker_release_address(u->worker, addr);
    free(peer);
    ucx_close(&u->base);
    return st;
}

#endif
