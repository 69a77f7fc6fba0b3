/* The mesh: N ranks, a persistent TCP connection between every pair (full
 * mesh, because one-shot all-reduce sends to every peer at once), upgraded
 * to shared memory for pairs on the same host.
 *
 * Building it without deadlock: every rank listens first, then connects to
 * each lower rank in turn, then accepts the higher ones. By induction on the
 * rank, every rank reaches its accept phase. The shm upgrades then run pair
 * by pair in one global order (lexicographic (low, high)), which cannot
 * deadlock because the smallest unfinished pair always has both ends ready. */
#include "transport/transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct lk_mesh {
    int rank, n;
    lk_link **ctl;  /* [n] TCP links (NULL at rank) */
    lk_link **data; /* [n] the link collectives use: shm or the TCP one */
};

#define HELLO_MAGIC 0x4c4b4d48u /* "LKMH" */
#define HELLO_VERSION 1

/* Fixed-size, so a short or oversized hello is impossible; every field is
 * checked on receipt. */
typedef struct {
    uint32_t magic, version;
    int32_t  n, from, to;
    char     host[100]; /* hostname + boot id: equal means same kernel, so shm works */
} hello;

static void host_identity(char *buf, size_t len) {
    char hn[64] = "?", boot[40] = "?";
    gethostname(hn, sizeof hn - 1);
    hn[sizeof hn - 1] = 0;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = 0;
        fclose(f);
        boot[strcspn(boot, "\n")] = 0;
    }
    snprintf(buf, len, "%s/%s", hn, boot);
}

/* The initiator (higher rank) speaks first and names the rank it called; the
 * acceptor learns from it who is calling, checks, and answers. */
static lk_status exchange_hello(lk_link *l, const lk_mesh_params *p, int peer, const char *me_host,
                                char *peer_host, uint64_t deadline, char *err, size_t errlen) {
    bool initiator = peer >= 0;
    hello h = {.magic = HELLO_MAGIC, .version = HELLO_VERSION, .n = p->n, .from = p->rank, .to = peer};
    snprintf(h.host, sizeof h.host, "%s", me_host);
    hello r;
    lk_status st = initiator ? lk_link_send(l, &h, sizeof h, deadline, err, errlen) : LK_OK;
    if (!st) st = lk_link_recv(l, &r, sizeof r, deadline, err, errlen);
    if (st) return st;
    if (r.magic != HELLO_MAGIC || r.version != HELLO_VERSION)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: not a lockstep mesh peer (bad hello)", l->peer_addr);
    if (r.n != p->n || r.to != p->rank || r.from < 0 || r.from >= p->n || r.from == p->rank ||
        (initiator && r.from != peer))
        return lk_fail(err, errlen, LK_ERR_MISMATCH,
                       "%s: mesh disagreement: it is rank %d of %d calling rank %d, we are rank %d of %d",
                       l->peer_addr, r.from, r.n, r.to, p->rank, p->n);
    if (!initiator) {
        h.to = r.from;
        st = lk_link_send(l, &h, sizeof h, deadline, err, errlen);
        if (st) return st;
    }
    r.host[sizeof r.host - 1] = 0;
    memcpy(peer_host, r.host, sizeof r.host);
    l->peer_rank = r.from;
    return LK_OK;
}

/* Without authentication (tests, netbench on loopback) the gate waits for
 * the initiator's hello, which it sends first. */
static int hello_ready(void *ctx, const uint8_t *p, size_t n, char *err, size_t errlen) {
    (void)ctx, (void)p, (void)err, (void)errlen;
    return n >= sizeof(hello);
}
static const lk_link_auth hello_only = {.ready = hello_ready, .ready_max = sizeof(hello)};

/* Connections refused while the mesh is built: the first few logged in
 * full, the rest counted (a flood must not fill the log), the latest kept
 * for the message of a setup that times out. */
#define REFUSALS_LOGGED 3
typedef struct {
    int rank, count;
    char last[LK_ERRLEN];
} refusals;

static void mesh_refused(void *ctx, const char *peer, const char *why) {
    refusals *rf = ctx;
    if (peer) snprintf(rf->last, sizeof rf->last, "%s: %s", peer, why);
    else snprintf(rf->last, sizeof rf->last, "%s", why);
    if (rf->count++ < REFUSALS_LOGGED) lk_log(LK_LOG_WARN, "mesh rank %d: refused %s", rf->rank, rf->last);
}

/* The message of an accept phase that timed out: which ranks never came,
 * and what came instead. */
static void missing(const lk_mesh *m, const lk_mesh_params *p, const refusals *rf, char *err, size_t errlen) {
    char list[256] = "";
    int k = 0;
    for (int r = p->rank + 1; r < p->n; r++)
        if (!m->ctl[r]) {
            size_t used = strlen(list);
            if (used < sizeof list - 8) snprintf(list + used, sizeof list - used, "%s%d", k ? ", " : "", r);
            k++;
        }
    char seen[LK_ERRLEN + 80] = "nothing else connected meanwhile";
    if (rf->count)
        snprintf(seen, sizeof seen, "refused %d other connection%s meanwhile, the latest %s", rf->count,
                 rf->count > 1 ? "s" : "", rf->last);
    lk_fail(err, errlen, LK_ERR_TIMEOUT, "mesh rank %d: rank%s %s never connected within %.1f s (%s)", p->rank,
            k > 1 ? "s" : "", list, (double)(p->timeout_ms ? p->timeout_ms : 10000) / 1e3, seen);
}

static lk_mesh *mesh_new(int rank, int n) {
    lk_mesh *m = lk_xcalloc(1, sizeof *m);
    m->rank = rank;
    m->n = n;
    m->ctl = lk_xcalloc((size_t)n, sizeof *m->ctl);
    m->data = lk_xcalloc((size_t)n, sizeof *m->data);
    return m;
}

lk_status lk_mesh_create(const lk_mesh_params *p, lk_mesh **out, char *err, size_t errlen) {
    *out = NULL;
    if (p->n < 1 || p->rank < 0 || p->rank >= p->n)
        return lk_fail(err, errlen, LK_ERR_ARG, "mesh: rank %d of %d is out of range", p->rank, p->n);
    uint64_t deadline = lk_deadline_ms(p->timeout_ms ? (int64_t)p->timeout_ms : 10000);
    lk_mesh *m = mesh_new(p->rank, p->n);
    char (*hosts)[100] = lk_xcalloc((size_t)p->n, sizeof *hosts);
    host_identity(hosts[p->rank], sizeof hosts[p->rank]);
    lk_status st = LK_OK;
    char why[LK_ERRLEN];
    int lfd = p->listen_fd;
    bool own_lfd = false;
    if (p->rank < p->n - 1 && lfd < 0) {
        st = lk_tcp_listen(p->addrs[p->rank], &lfd, NULL, err, errlen);
        if (st) goto fail;
        own_lfd = true;
    }
    for (int s = 0; s < p->rank && !st; s++) {
        lk_link *l = NULL;
        for (int tries = 1;; tries++) {
            st = lk_tcp_connect(p->addrs[s], deadline, &l, err, errlen);
            if (st) break;
            l->peer_rank = s;
            if (p->auth) st = p->auth->connect(p->auth_ctx, &l, deadline, err, errlen);
            /* a peer whose gate is full of strays says so: try again */
            if (!st || !p->auth || !p->auth->retry || !p->auth->retry(p->auth_ctx, st, err) ||
                lk_time_ns() + 100000000ull > deadline)
                break;
            lk_link_close(l);
            l = NULL;
            struct timespec ts = {0, (long)LK_MIN(tries, 5) * 20000000L};
            nanosleep(&ts, NULL);
        }
        if (!st) st = exchange_hello(l, p, s, hosts[p->rank], hosts[s], deadline, err, errlen);
        if (st) { lk_link_close(l); break; }
        m->ctl[s] = l;
    }
    /* Higher ranks through a gate: strays (scanners, half-open or hostile
     * connections) wait in one poll loop, cost no turn of this loop, and
     * are dropped within a second or two; only a connection whose peer has
     * sent all its first messages is taken, and one without the key then
     * fails at once. Every legitimate peer may share one address. */
    refusals rf = {.rank = p->rank};
    lk_gate_params gp = {.auth = p->auth ? p->auth : &hello_only, .auth_ctx = p->auth_ctx,
                         .max_per_host = LK_MAX(8, p->n), .on_refuse = mesh_refused, .refuse_ctx = &rf};
    lk_gate *gate = p->rank < p->n - 1 ? lk_gate_new(lfd, &gp) : NULL;
    for (int got = 0; got < p->n - 1 - p->rank && !st;) {
        lk_link *l = NULL;
        uint8_t state[LK_AUTH_STATE];
        st = lk_gate_next(gate, deadline, &l, state, why, sizeof why);
        if (st) {
            if (st == LK_ERR_TIMEOUT) missing(m, p, &rf, err, errlen);
            else lk_fail(err, errlen, st, "mesh rank %d: accepting: %s", p->rank, why);
            break;
        }
        /* The peer has sent its first messages: only a key holder gets
         * further than checking them, and it answers at once. */
        uint64_t cdl = LK_MIN(deadline, lk_deadline_ms(3000));
        lk_status a = p->auth && p->auth->accept ? p->auth->accept(p->auth_ctx, &l, state, cdl, why, sizeof why) : LK_OK;
        char host[100];
        if (!a) a = exchange_hello(l, p, -1, hosts[p->rank], host, cdl, why, sizeof why);
        if (!a && (l->peer_rank <= p->rank || m->ctl[l->peer_rank]))
            a = lk_fail(why, sizeof why, LK_ERR_MISMATCH, "%s claims rank %d, which is not expected here",
                        l->peer_addr, l->peer_rank);
        if (a) {
            /* A stray or hostile connection must not break the mesh; why
             * names the peer already (every message here starts with it). */
            mesh_refused(&rf, NULL, why);
            lk_link_close(l);
            continue;
        }
        memcpy(hosts[l->peer_rank], host, sizeof host);
        m->ctl[l->peer_rank] = l;
        got++;
    }
    lk_gate_free(gate);
    if (rf.count > REFUSALS_LOGGED)
        lk_log(LK_LOG_WARN, "mesh rank %d: refused %d connections in all (latest: %s)", p->rank, rf.count, rf.last);
    if (st) goto fail;

    int here = 1;
    for (int s = 0; s < p->n; s++)
        if (s != p->rank && !strcmp(hosts[s], hosts[p->rank])) here++;
    int64_t spin = p->spin_ns >= 0 ? p->spin_ns : lk_spin_default(here);
    for (int s = 0; s < p->n; s++) {
        if (s == p->rank) continue;
        m->ctl[s]->spin_ns = spin;
        m->data[s] = m->ctl[s];
        bool same = !strcmp(hosts[s], hosts[p->rank]);
        /* UCX when asked, and by default to another host when this one has
         * an RDMA device and the build has UCX (ucx.c reports its lanes) */
        /* a sealed cluster keeps its data on sealed TCP: UCX's lanes are not sealed */
        if ((p->shm == LK_MESH_UCX || p->shm == LK_MESH_MPI) && lk_seal_is(m->ctl[s])) {
            st = lk_fail(err, errlen, LK_ERR_ARG, "--seal and --transport %s do not go together: %s links are not sealed",
                         p->shm == LK_MESH_MPI ? "mpi" : "ucx", p->shm == LK_MESH_MPI ? "MPI" : "UCX");
            goto fail;
        }
        /* MPI when asked: the pairs in the same global order as shm's */
        if (p->shm == LK_MESH_MPI) {
            lk_link *ml = NULL;
            if ((st = lk_mpi_pair(m->ctl[s], p->rank < s, deadline, &ml, why, sizeof why))) {
                st = lk_fail(err, errlen, st, "mpi setup with rank %d: %s", s, why);
                goto fail;
            }
            m->data[s] = ml;
            continue;
        }
        if (p->shm == LK_MESH_UCX || (p->shm == LK_MESH_SHM_AUTO && !same && !lk_seal_is(m->ctl[s]) && lk_ucx_built() &&
                                      lk_rdma_device_present())) {
            lk_link *ul = NULL;
            lk_status us = lk_ucx_pair(m->ctl[s], deadline, &ul, why, sizeof why);
            if (us && (p->shm == LK_MESH_UCX || us == LK_ERR_NET || us == LK_ERR_TIMEOUT)) {
                st = lk_fail(err, errlen, us, "ucx setup with rank %d: %s", s, why);
                goto fail;
            }
            if (!us) {
                m->data[s] = ul;
                continue;
            }
            lk_log(LK_LOG_WARN, "mesh rank %d: rank %d (%s) over tcp: ucx failed: %s", p->rank, s, m->ctl[s]->peer_addr, why);
        }
        if (p->shm == LK_MESH_SHM_OFF || (!same && p->shm == LK_MESH_SHM_AUTO)) {
            bool sealed = lk_seal_is(m->ctl[s]);
            if (!same && !lk_ucx_built() && lk_rdma_device_present())
                lk_log(LK_LOG_WARN, "mesh rank %d: this host has an RDMA device, but lockstep was built without UCX "
                                    "(install libucx-dev and rebuild): rank %d gets tcp", p->rank, s);
            lk_log(LK_LOG_INFO, "mesh rank %d: rank %d (%s) over tcp%s%s%s%s", p->rank, s, m->ctl[s]->peer_addr,
                   sealed ? " (sealed, " : "", sealed ? lk_seal_cipher_name(lk_seal_cipher_of(m->ctl[s])) : "",
                   sealed ? ")" : "", same ? " (shm off)" : "");
            continue;
        }
        if (!same) {
            st = lk_fail(err, errlen, LK_ERR_ARG, "shm requested but rank %d (%s) is on another host (%s)", s,
                         m->ctl[s]->peer_addr, hosts[s]);
            goto fail;
        }
        lk_link *sl = NULL;
        /* the window as large as the all-reduces that use it: 2 ranks
         * exchange up to 512 KiB through it, more ranks below 64 KiB
         * (comm.c); the whole segment is reserved in /dev/shm */
        lk_status ss = lk_shm_pair(m->ctl[s], p->rank < s, 0, p->n == 2 ? 512u << 10 : 64u << 10, deadline, &sl, why,
                                   sizeof why);
        if (ss == LK_ERR_NET || ss == LK_ERR_TIMEOUT || (ss && p->shm == LK_MESH_SHM_FORCE)) {
            st = lk_fail(err, errlen, ss, "shm setup with rank %d: %s", s, why);
            goto fail;
        }
        if (ss) {
            lk_log(LK_LOG_WARN, "mesh rank %d: rank %d (%s) over tcp: shm failed: %s", p->rank, s,
                   m->ctl[s]->peer_addr, why);
            continue;
        }
        m->data[s] = sl;
        /* Only the TCP control link is sealed: the rings live in memory of
         * this host, where a network attacker has no reach. */
        lk_log(LK_LOG_INFO, "mesh rank %d: rank %d (%s) over shm (same host%s)", p->rank, s, m->ctl[s]->peer_addr,
               lk_seal_is(m->ctl[s]) ? "; shm is not sealed, only the tcp control link" : "");
    }
    if (own_lfd) close(lfd);
    free(hosts);
    *out = m;
    return LK_OK;
fail:
    if (own_lfd && lfd >= 0) close(lfd);
    free(hosts);
    lk_mesh_free(m);
    return st;
}

lk_mesh *lk_mesh_from_links(int rank, int n, lk_link **links) {
    LK_ASSERT(n >= 1 && rank >= 0 && rank < n);
    lk_mesh *m = mesh_new(rank, n);
    for (int s = 0; s < n; s++) {
        LK_ASSERT((s == rank) == (links[s] == NULL));
        m->ctl[s] = m->data[s] = links[s];
        if (links[s]) links[s]->peer_rank = s;
    }
    return m;
}

void lk_mesh_free(lk_mesh *m) {
    if (!m) return;
    for (int s = 0; s < m->n; s++) {
        if (m->data[s] && m->data[s] != m->ctl[s]) lk_link_close(m->data[s]);
        lk_link_close(m->ctl[s]);
    }
    free(m->ctl);
    free(m->data);
    free(m);
}

int lk_mesh_rank(const lk_mesh *m) { return m->rank; }
int lk_mesh_size(const lk_mesh *m) { return m->n; }
lk_link *lk_mesh_link(lk_mesh *m, int peer) {
    LK_ASSERT(peer >= 0 && peer < m->n);
    return m->data[peer];
}
lk_link *lk_mesh_ctl(lk_mesh *m, int peer) {
    LK_ASSERT(peer >= 0 && peer < m->n);
    return m->ctl[peer];
}
void lk_mesh_set_spin(lk_mesh *m, int64_t spin_ns) {
    for (int s = 0; s < m->n; s++) {
        if (m->ctl[s]) m->ctl[s]->spin_ns = spin_ns;
        if (m->data[s]) m->data[s]->spin_ns = spin_ns;
    }
}
