/* MPI transport (--transport mpi): a link whose bytes travel as MPI
 * point-to-point messages, so that whatever the MPI library drives (Open
 * MPI: shared memory "vader", TCP, or UCX over InfiniBand/RoCE when its
 * pml ucx is selected) carries the collectives. Only inside a job started by
 * mpirun/srun with --transport mpi: launch.c then keeps MPI up past its
 * bootstrap (lk_mpi_adopt) and ends it at exit (lk_mpi_end).
 *
 * Shape: one communicator for all of lockstep's traffic (a duplicate of
 * MPI_COMM_WORLD, errors returned instead of aborting the job), one tag
 * per link, agreed over the TCP control link (already authenticated: a
 * link only ever talks to the world rank a key holder named). The control
 * link also says which world rank the peer is, so mesh ranks and MPI ranks
 * need not agree.
 *
 * A link is a byte stream, MPI moves messages: the sender cuts what it is
 * given into messages of at most CHUNK bytes; the receiver keeps RSLOTS
 * receives of CHUNK bytes posted in advance (MPI matches messages of one
 * sender and tag to receives in the order they were posted, so slot i holds
 * message i) and copies out of the oldest completed one. Sends copy into
 * one of SSLOTS staging buffers first, so the caller's buffer is free when
 * send_some returns even if lk_xfer_run gives up on the transfer at its
 * deadline: MPI never reads or writes a buffer of the caller.
 *
 * Threads: MPI runs at MPI_THREAD_SERIALIZED; every MPI call of this file
 * holds one process-wide mutex (uncontended: one thread drives the mesh;
 * the server's scheduler thread is not the one that called MPI_Init).
 * Any MPI_Test drives the progress of every link.
 *
 * Waiting: MPI has no file descriptor to sleep on. After lk_xfer_run's spin
 * (each try is an MPI_Test, which drives MPI's progress), wait() keeps
 * polling for the first millisecond of an idle stretch (while the ranks
 * fit the cores; else it yields for 100 us), then naps 20 us at a time,
 * then 500 us once idle for 10 ms (a worker waiting for the next request
 * of a server).
 *
 * Dead peers: Open MPI does not notice a dead process on shared memory at
 * all (the receive never completes), and on TCP may fail the job itself.
 * So liveness stays with the control links: every 5 ms a waiter peeks at
 * the control link of every MPI link of the process; a closed one (the
 * peer died, or the head's monitor cut the link of a rank it declared dead)
 * fails that link, once what the peer sent before is taken; a failure seen
 * by a caller marks the job broken. mpirun then ends the job (a rank that exits without
 * MPI_Finalize ends it); lk_mpi_end finalizes only after a clean run, and
 * never waits more than FINALIZE_S seconds. */
#include "transport/transport.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef LK_HAVE_MPI

bool lk_mpi_built(void) { return false; }
bool lk_mpi_active(void) { return false; }
lk_status lk_mpi_adopt(char *err, size_t errlen) {
    return lk_fail(err, errlen, LK_ERR_ARG, "lockstep was built without MPI (install libopenmpi-dev and rebuild)");
}
void lk_mpi_end(int rc) { (void)rc; }
lk_status lk_mpi_pair(lk_link *ctl, bool lower, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen) {
    *out = NULL;
    return lk_fail(err, errlen, LK_ERR_ARG, "lockstep was built without MPI (install libopenmpi-dev and rebuild)");
}
const char *lk_mpi_report(const lk_link *l) { return NULL; }
lk_status lk_mpi_allreduce_f32(float *x, int64_t n, uint64_t deadline_ns, char *err, size_t errlen) {
    return lk_fail(err, errlen, LK_ERR_ARG, "lockstep was built without MPI (install libopenmpi-dev and rebuild)");
}

#else

#include <mpi.h>

#define CHUNK      (64u << 10) /* bytes per message at most */
#define SSLOTS     4
#define RSLOTS     4
#define FINALIZE_S 10
#define PAIR_MAGIC 0x4c4b4d5049503031ull /* "LKMPIP01" */

typedef struct mpi_link_s {
    lk_link      base;
    int          peer;            /* the peer's rank in g_comm */
    int          tag;
    lk_link     *ctl;             /* not owned: watched for the peer's death */
    bool         failed;
    char         why[200];
    MPI_Request  sreq[SSLOTS];    /* in flight, oldest at shead */
    unsigned     shead, sn;
    unsigned char *sbuf;          /* [SSLOTS][CHUNK] */
    MPI_Request  rreq[RSLOTS];    /* posted receives, oldest at rhead */
    unsigned     rhead;
    unsigned char *rbuf;          /* [RSLOTS][CHUNK] */
    size_t       rlen, roff;      /* the oldest slot, completed: its length and what was copied out */
    bool         rdone;
    uint64_t     idle_since;      /* first wait() of this idle stretch; 0: busy */
    char         report[160];
    struct mpi_link_s *next;      /* every MPI link of the process (g_mu) */
} mpi_link;

/* One lock for every MPI call, the link list and the process state. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static MPI_Comm g_comm = MPI_COMM_NULL;
static int g_rank = -1, g_size = 0, g_epoch;
static mpi_link *g_links;
static bool g_broken;               /* a transfer failed: no MPI_Finalize at the end */
static uint64_t g_next_check;

bool lk_mpi_built(void) { return true; }
bool lk_mpi_active(void) { return g_comm != MPI_COMM_NULL; }

static const char *mpi_err(int code, char *buf) {
    int len = 0;
    if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) snprintf(buf, MPI_MAX_ERROR_STRING, "MPI error %d", code);
    return buf;
}

lk_status lk_mpi_adopt(char *err, size_t errlen) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin) return lk_fail(err, errlen, LK_ERR_ARG, "MPI is not initialised in this process");
    pthread_mutex_lock(&g_mu);
    /* Errors come back as codes: a peer's failure must never abort this
     * process from inside MPI (the caller names the peer and ends). */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &g_comm);
    if (rc == MPI_SUCCESS) {
        MPI_Comm_set_errhandler(g_comm, MPI_ERRORS_RETURN);
        MPI_Comm_rank(g_comm, &g_rank);
        MPI_Comm_size(g_comm, &g_size);
    } else
        g_comm = MPI_COMM_NULL;
    pthread_mutex_unlock(&g_mu);
    if (rc != MPI_SUCCESS) {
        char e[MPI_MAX_ERROR_STRING];
        return lk_fail(err, errlen, LK_ERR_NET, "MPI_Comm_dup: %s", mpi_err(rc, e));
    }
    return LK_OK;
}

static atomic_bool g_finalized; /* MPI_Finalize returned: the watchdog has nothing to do */

static void *finalize_watch(void *arg) {
    int rc = (int)(intptr_t)arg;
    sleep(FINALIZE_S);
    if (atomic_load(&g_finalized)) return NULL; /* the process is in exit(): LSan may take its time */
    fprintf(stderr, "lockstep: MPI_Finalize did not return within %d s (another rank gone?): leaving without it\n",
            FINALIZE_S);
    _exit(rc ? rc : 1);
    return NULL;
}

void lk_mpi_end(int rc) {
    pthread_mutex_lock(&g_mu);
    bool active = g_comm != MPI_COMM_NULL, broken = g_broken;
    pthread_mutex_unlock(&g_mu);
    if (!active) return;
    /* MPI_Finalize waits for every rank. After a failure some rank may be
     * dead or frozen: leave without it, and mpirun ends the job (a rank
     * that exits without finalizing ends it). After a clean run every rank
     * gets here, but a watchdog bounds the wait anyway. */
    if (rc || broken) return;
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    bool watched = pthread_create(&t, &at, finalize_watch, (void *)(intptr_t)rc) == 0;
    pthread_attr_destroy(&at);
    (void)watched;
    pthread_mutex_lock(&g_mu);
    MPI_Comm_free(&g_comm);
    g_comm = MPI_COMM_NULL;
    MPI_Finalize();
    atomic_store(&g_finalized, true);
    pthread_mutex_unlock(&g_mu);
}

/* A failure the caller will see: the job is broken from here on. */
static ssize_t dead(mpi_link *u, char *err, size_t errlen) {
    g_broken = true;
    lk_fail(err, errlen, LK_ERR_NET, "%s", u->why);
    return -1;
}

static void note_fail(mpi_link *u, const char *what, int code) {
    char e[MPI_MAX_ERROR_STRING];
    if (!u->failed) snprintf(u->why, sizeof u->why, "MPI %s: %.160s", what, mpi_err(code, e));
    u->failed = true;
}

/* Is the peer of u still there? Peeks at its TCP control link (g_mu held). */
static bool ctl_dead(mpi_link *u) {
    char why[sizeof u->why];
    if (!lk_tcp_peer_gone(u->ctl, why, sizeof why)) return false;
    if (!u->failed) memcpy(u->why, why, sizeof why);
    u->failed = true;
    return true;
}

/* Every 5 ms at most: the control links of all MPI links (g_mu held), so
 * that lk_xfer_run's next pass fails the transfer of whichever link's peer
 * is gone, not only the one it waits on. */
static void check_peers(void) {
    uint64_t now = lk_time_ns();
    if (now < g_next_check) return;
    g_next_check = now + 5000000;
    for (mpi_link *o = g_links; o; o = o->next) ctl_dead(o);
}

/* Completed sends leave the queue in order; a failed one fails the link. */
static void reap_sends(mpi_link *u) {
    while (u->sn) {
        int done = 0;
        MPI_Status s;
        int rc = MPI_Test(&u->sreq[u->shead], &done, &s);
        if (rc != MPI_SUCCESS) { note_fail(u, "send", rc); return; }
        if (!done) break;
        u->shead = (u->shead + 1) % SSLOTS;
        u->sn--;
    }
}

static int post_recv(mpi_link *u, unsigned slot) {
    return MPI_Irecv(u->rbuf + (size_t)slot * CHUNK, (int)CHUNK, MPI_BYTE, u->peer, u->tag, g_comm, &u->rreq[slot]);
}

static ssize_t mpi_send_some(lk_link *l, const void *buf, size_t n, char *err, size_t errlen) {
    mpi_link *u = (mpi_link *)l;
    pthread_mutex_lock(&g_mu);
    reap_sends(u);
    size_t moved = 0;
    while (!u->failed && moved < n && u->sn < SSLOTS) {
        unsigned slot = (u->shead + u->sn) % SSLOTS;
        size_t k = LK_MIN(n - moved, (size_t)CHUNK);
        unsigned char *b = u->sbuf + (size_t)slot * CHUNK;
        memcpy(b, (const char *)buf + moved, k);
        int rc = MPI_Isend(b, (int)k, MPI_BYTE, u->peer, u->tag, g_comm, &u->sreq[slot]);
        if (rc != MPI_SUCCESS) { note_fail(u, "send", rc); break; }
        u->sn++;
        moved += k;
        reap_sends(u);
    }
    if (moved) u->idle_since = 0;
    ssize_t r = !moved && u->failed ? dead(u, err, errlen) : (ssize_t)moved;
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* Whether the oldest posted receive holds a message (g_mu held). What the
 * peer sent before it died or closed is still delivered, as TCP delivers
 * the bytes before an EOF: a link whose peer is gone keeps testing. */
static bool recv_ready(mpi_link *u) {
    if (u->rdone) return true;
    if (u->rreq[u->rhead] == MPI_REQUEST_NULL) return false;
    int done = 0;
    MPI_Status s;
    int rc = MPI_Test(&u->rreq[u->rhead], &done, &s);
    if (rc != MPI_SUCCESS) {
        u->rreq[u->rhead] = MPI_REQUEST_NULL;
        note_fail(u, "receive", rc);
        return false;
    }
    if (!done) return false;
    int cnt = 0;
    MPI_Get_count(&s, MPI_BYTE, &cnt);
    u->rlen = (size_t)(cnt > 0 ? cnt : 0);
    u->roff = 0;
    u->rdone = true;
    return true;
}

static ssize_t mpi_recv_some(lk_link *l, void *buf, size_t n, char *err, size_t errlen) {
    mpi_link *u = (mpi_link *)l;
    pthread_mutex_lock(&g_mu);
    size_t moved = 0;
    while (moved < n && recv_ready(u)) {
        size_t k = LK_MIN(n - moved, u->rlen - u->roff);
        memcpy((char *)buf + moved, u->rbuf + (size_t)u->rhead * CHUNK + u->roff, k);
        moved += k;
        u->roff += k;
        if (u->roff == u->rlen) { /* slot drained: post it again, behind the others */
            u->rdone = false;
            int rc = u->failed ? MPI_SUCCESS : post_recv(u, u->rhead);
            if (u->failed) u->rreq[u->rhead] = MPI_REQUEST_NULL;
            if (rc != MPI_SUCCESS) { u->rreq[u->rhead] = MPI_REQUEST_NULL; note_fail(u, "receive", rc); }
            u->rhead = (u->rhead + 1) % RSLOTS;
        }
    }
    if (moved) u->idle_since = 0;
    ssize_t r = !moved && u->failed ? dead(u, err, errlen) : (ssize_t)moved;
    pthread_mutex_unlock(&g_mu);
    return r;
}

static int mpi_poll_fd(lk_link *l) { return -1; }

static int mpi_wait(lk_link *l, bool for_send, uint64_t timeout_ns, char *err, size_t errlen) {
    mpi_link *u = (mpi_link *)l;
    pthread_mutex_lock(&g_mu);
    check_peers();
    if (u->failed) {
        /* a receiver first takes what arrived before the peer went */
        int r = !for_send && recv_ready(u) ? 0 : (int)dead(u, err, errlen);
        pthread_mutex_unlock(&g_mu);
        return r;
    }
    if (for_send) reap_sends(u); /* drives progress too */
    pthread_mutex_unlock(&g_mu);
    uint64_t now = lk_time_ns();
    if (!u->idle_since) u->idle_since = now;
    uint64_t idle = now - u->idle_since;
    /* A nap costs 50 us or more (the timer slack) where the own shm link
     * is woken by its peer within a few, and a nap on one side makes the
     * other's spin fail, until lk_xfer_run stops spinning on both (after
     * four misses) and every message costs a nap. So with a spin budget
     * (the ranks fit the cores) keep polling for the first millisecond of
     * an idle stretch whatever lk_xfer_run decided; without one (ranks
     * outnumber cores: the rank we wait for may need ours) yield for the
     * first 100 us. sched_yield is no spin: on a loaded core it hands the
     * core away for a whole time slice. */
    if (l->spin_ns && idle < 1000000) {
#if defined(__x86_64__) || defined(__i386__)
        for (int i = 0; i < 64; i++) __builtin_ia32_pause();
#endif
        return 0;
    }
    if (!l->spin_ns && idle < 100000) {
        sched_yield();
        return 0;
    }
    uint64_t nap = idle < 10000000 ? 20000 : 500000;
    if (nap > timeout_ns) nap = timeout_ns;
    struct timespec ts = {0, (long)nap};
    nanosleep(&ts, NULL);
    return 0;
}

/* Leaves nothing of MPI pointing into the buffers: sends get a short while
 * to complete (the peer may be reading our last bytes), posted receives are
 * cancelled. A request that will not finish (a dead peer) is let go and its
 * buffer kept: MPI may still touch it. */
static void mpi_close(lk_link *l) {
    mpi_link *u = (mpi_link *)l;
    pthread_mutex_lock(&g_mu);
    for (mpi_link **p = &g_links; *p; p = &(*p)->next)
        if (*p == u) { *p = u->next; break; }
    bool leak = false;
    uint64_t until = lk_time_ns() + (u->failed ? 0 : 200000000ull);
    while (u->sn && !u->failed && lk_time_ns() < until) reap_sends(u);
    for (unsigned i = 0; i < SSLOTS; i++)
        if (u->sreq[i] != MPI_REQUEST_NULL) {
            int done = 0;
            MPI_Test(&u->sreq[i], &done, MPI_STATUS_IGNORE);
            if (!done) { MPI_Request_free(&u->sreq[i]); leak = true; }
        }
    for (unsigned i = 0; i < RSLOTS; i++) {
        if (u->rreq[i] == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&u->rreq[i]);
        int done = 0;
        for (uint64_t t = lk_time_ns() + 100000000ull; !done && lk_time_ns() < t;)
            if (MPI_Test(&u->rreq[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
        if (!done) { MPI_Request_free(&u->rreq[i]); leak = true; }
    }
    pthread_mutex_unlock(&g_mu);
    if (!leak) {
        free(u->sbuf);
        free(u->rbuf);
    }
    free(u);
}

static const lk_link_ops mpi_ops = {
    .name = "mpi",
    .send_some = mpi_send_some,
    .recv_some = mpi_recv_some,
    .poll_fd = mpi_poll_fd,
    .wait = mpi_wait,
    .close = mpi_close,
};

const char *lk_mpi_report(const lk_link *l) {
    return l && l->ops == &mpi_ops ? ((const mpi_link *)l)->report : NULL;
}

/* MPI's own all-reduce, for netbench's comparison: non-blocking, tested
 * under the lock like the links, so a dead peer (its control link closed)
 * or the deadline ends the wait. */
lk_status lk_mpi_allreduce_f32(float *x, int64_t n, uint64_t deadline_ns, char *err, size_t errlen) {
    if (!lk_mpi_active()) return lk_fail(err, errlen, LK_ERR_ARG, "MPI is not in use in this process");
    if (n < 0 || n > INT32_MAX) return lk_fail(err, errlen, LK_ERR_ARG, "MPI_Allreduce of %lld floats", (long long)n);
    MPI_Request r;
    pthread_mutex_lock(&g_mu);
    int rc = MPI_Iallreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, g_comm, &r);
    pthread_mutex_unlock(&g_mu);
    char e[MPI_MAX_ERROR_STRING];
    if (rc != MPI_SUCCESS) return lk_fail(err, errlen, LK_ERR_NET, "MPI_Iallreduce: %s", mpi_err(rc, e));
    for (;;) {
        int done = 0;
        pthread_mutex_lock(&g_mu);
        rc = MPI_Test(&r, &done, MPI_STATUS_IGNORE);
        check_peers();
        mpi_link *gone = NULL;
        for (mpi_link *o = g_links; o && !gone; o = o->next)
            if (o->failed) gone = o;
        char name[128];
        if (gone && !done) {
            g_broken = true;
            lk_fail(err, errlen, LK_ERR_NET, "MPI_Iallreduce: %s: %s", lk_link_name(&gone->base, name, sizeof name),
                    gone->why);
        }
        pthread_mutex_unlock(&g_mu);
        if (rc != MPI_SUCCESS) return lk_fail(err, errlen, LK_ERR_NET, "MPI_Iallreduce: %s", mpi_err(rc, e));
        if (done) return LK_OK;
        /* the request stays MPI's: x must outlive the job then, which a
         * failing netbench does (it ends) */
        if (gone) return LK_ERR_NET;
        if (lk_time_ns() > deadline_ns) return lk_fail(err, errlen, LK_ERR_TIMEOUT, "MPI_Iallreduce: timeout");
    }
}

/* What carries this job's messages, as far as the library says: Open MPI
 * names its point-to-point layer in the MCA variable "pml" when the user
 * picked one; otherwise its own choice (ob1 over shared memory/TCP, or ucx
 * when an RDMA device is there) is not queryable in 4.1. */
static void describe(char *out, size_t len) {
    char ver[MPI_MAX_LIBRARY_VERSION_STRING] = "";
    int vlen = 0;
    MPI_Get_library_version(ver, &vlen);
    ver[strcspn(ver, ",\n")] = 0;
    const char *pml = getenv("OMPI_MCA_pml");
    snprintf(out, len, "%s%s%s", ver[0] ? ver : "MPI", pml && *pml ? ", pml " : "", pml && *pml ? pml : "");
}

lk_status lk_mpi_pair(lk_link *ctl, bool lower, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen) {
    *out = NULL;
    char name[128];
    lk_link_name(ctl, name, sizeof name);
    if (!lk_mpi_active())
        return lk_fail(err, errlen, LK_ERR_ARG,
                       "--transport mpi works only in a job started by mpirun or srun with --transport mpi on every rank");
    /* Our world rank and, from the lower mesh rank, the link's tag; both
     * sides send first (a few bytes fit any socket buffer). */
    pthread_mutex_lock(&g_mu);
    int32_t mine[3] = {g_rank, g_size, lower ? (int32_t)(++g_epoch % 32000) + 1 : 0}, theirs[3] = {0};
    pthread_mutex_unlock(&g_mu);
    lk_status st;
    if ((st = lk_link_send(ctl, mine, sizeof mine, deadline_ns, err, errlen)) ||
        (st = lk_link_recv(ctl, theirs, sizeof theirs, deadline_ns, err, errlen)))
        return st;
    int tag = lower ? mine[2] : theirs[2];
    if (theirs[1] != g_size || theirs[0] < 0 || theirs[0] >= g_size || theirs[0] == g_rank || tag < 1 || tag > 32000)
        return lk_fail(err, errlen, LK_ERR_MISMATCH,
                       "%s is not in this MPI job (it says MPI rank %d of %d, tag %d; we are rank %d of %d)", name,
                       theirs[0], theirs[1], tag, g_rank, g_size);
    mpi_link *u = lk_xcalloc(1, sizeof *u);
    u->base.ops = &mpi_ops;
    u->base.peer_rank = ctl->peer_rank;
    u->base.spin_ns = ctl->spin_ns;
    memcpy(u->base.peer_addr, ctl->peer_addr, sizeof u->base.peer_addr);
    u->ctl = ctl;
    u->peer = theirs[0];
    u->tag = tag;
    for (unsigned i = 0; i < SSLOTS; i++) u->sreq[i] = MPI_REQUEST_NULL;
    for (unsigned i = 0; i < RSLOTS; i++) u->rreq[i] = MPI_REQUEST_NULL;
    u->sbuf = lk_xmalloc((size_t)SSLOTS * CHUNK);
    u->rbuf = lk_xmalloc((size_t)RSLOTS * CHUNK);
    pthread_mutex_lock(&g_mu);
    int rc = MPI_SUCCESS;
    for (unsigned i = 0; i < RSLOTS && rc == MPI_SUCCESS; i++) rc = post_recv(u, i);
    if (rc != MPI_SUCCESS) {
        char e[MPI_MAX_ERROR_STRING];
        pthread_mutex_unlock(&g_mu);
        lk_fail(err, errlen, LK_ERR_NET, "MPI receive from %s: %s", name, mpi_err(rc, e));
        mpi_close(&u->base);
        return LK_ERR_NET;
    }
    u->next = g_links;
    g_links = u;
    pthread_mutex_unlock(&g_mu);
    /* One round trip over MPI proves the mapping of ranks before any data. */
    uint64_t ping = PAIR_MAGIC, pong = 0;
    if ((st = lk_link_send(&u->base, &ping, sizeof ping, deadline_ns, err, errlen)) ||
        (st = lk_link_recv(&u->base, &pong, sizeof pong, deadline_ns, err, errlen))) {
        mpi_close(&u->base);
        return st;
    }
    if (pong != PAIR_MAGIC) {
        mpi_close(&u->base);
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: first bytes over MPI are wrong", name);
    }
    char lib[120];
    describe(lib, sizeof lib);
    snprintf(u->report, sizeof u->report, "MPI rank %d -> %d, %s", g_rank, u->peer, lib);
    fprintf(stderr, "lockstep: mpi link to %s: %s\n", name, u->report);
    if (lk_rdma_device_present() && !(getenv("OMPI_MCA_pml") && strstr(getenv("OMPI_MCA_pml"), "ucx")))
        lk_log(LK_LOG_WARN, "mpi link to %s: this host has an RDMA device (/sys/class/infiniband); make sure MPI uses it "
                            "(Open MPI: --mca pml ucx, or --transport ucx)", name);
    *out = &u->base;
    return LK_OK;
}

#endif
