/* transport — moving bytes between ranks. Knows nothing of layers, models or
 * messages: a *link* carries exact byte counts to and from one peer, a *mesh*
 * is N ranks where every rank holds a link to every other.
 *
 * A link is a table of functions (lk_link_ops, one file per transport, chosen
 * at run time like Redis' connection types):
 *   - tcp.c: non-blocking socket with TCP_NODELAY. Built in, always there; it
 *     also carries the handshake and stays open for control when a faster
 *     transport takes over the data.
 *   - shm.c: two single-producer/single-consumer rings in a shm_open'd segment
 *     per pair of processes on one host (set up over the TCP link, unlinked as
 *     soon as both sides mapped it, so nothing is left behind on a crash).
 *   - ucx.c: UCP stream endpoints (--transport ucx, when built with UCX):
 *     InfiniBand/RoCE, shared memory or TCP, as UCX selects; set up over
 *     the TCP link like shm, and says per peer what UCX chose.
 *   - mpi.c: MPI point-to-point messages (--transport mpi, only in a job
 *     started by mpirun/srun; when built with MPI): whatever the MPI
 *     library drives; set up over the TCP link like shm, which stays the
 *     liveness check (MPI itself may never notice a dead peer).
 *   - seal.c: wraps a TCP link after the cluster handshake (opt-in --seal):
 *     AEAD records (AES-256-GCM or ChaCha20-Poly1305), so an on-path
 *     attacker can neither read nor alter, inject, replay or cut the stream
 *     unnoticed.
 *
 * Waiting: every wait has an absolute deadline (lk_time_ns() clock). A waiter
 * first *spins* (retrying the non-blocking call) for the link's spin budget,
 * because on these machines a wake-up from sleep costs 20-25 us — more than a
 * whole small message. After that it blocks (poll() for TCP, a futex for
 * shm). Spinning is turned off (spin_ns = 0) when ranks outnumber cores:
 * spinners then steal the core the peer needs and latency collapses to
 * scheduler ticks. The same happens when *other* processes keep the cores
 * busy, which no rank count reveals, so spinning also backs off on its own:
 * after a few waits in a row where the whole budget was spun in vain, a link
 * does not spin for its next 256 waits, then tries again.
 *
 * Progress: collectives send to several peers while receiving from several
 * others; doing that one blocking call at a time deadlocks once messages
 * outgrow socket buffers or rings. lk_xfer_run() drives a set of transfers
 * together and returns when all completed, one failed, or the deadline
 * passed; its error names the peer (rank, address), the direction and how
 * many bytes of how many moved.
 *
 * Threading: a link is used by one thread at a time. Nothing here allocates
 * after setup. */
#ifndef LK_TRANSPORT_H
#define LK_TRANSPORT_H

#include "common/lk_common.h"

#include <sys/types.h>

typedef struct lk_link lk_link;

typedef struct {
    const char *name; /* "tcp", "shm" */
    /* Non-blocking: move as many of the n bytes as possible now. Returns the
     * bytes moved (0 if none could be), or -1 with a message in err when the
     * link failed (peer closed, reset). */
    ssize_t (*send_some)(lk_link *l, const void *buf, size_t n, char *err, size_t errlen);
    ssize_t (*recv_some)(lk_link *l, void *buf, size_t n, char *err, size_t errlen);
    /* The fd a blocked sender/receiver can poll(), or -1 if the transport has
     * none (then wait() is used). */
    int (*poll_fd)(lk_link *l);
    /* Blocks until the link may have become ready for sending (for_send) or
     * receiving, or timeout_ns passed. Spurious returns are fine. Returns -1
     * with a message when the link is known to be dead. NULL for transports
     * with a poll_fd. */
    int (*wait)(lk_link *l, bool for_send, uint64_t timeout_ns, char *err, size_t errlen);
    void (*close)(lk_link *l);
    /* A wrapping transport (seal) returns the link it wraps; NULL for the
     * others. Lets lk_tcp_fd find the socket under a sealed link. */
    lk_link *(*inner)(const lk_link *l);
} lk_link_ops;

struct lk_link {
    const lk_link_ops *ops;
    int     peer_rank;       /* -1 if not part of a mesh (yet) */
    char    peer_addr[64];   /* "host:port" of the peer, for messages */
    int64_t spin_ns;         /* spin budget before blocking; 0 = never spin */
    uint32_t spin_misses;    /* waits in a row where spinning did not pay off */
    uint32_t spin_skip;      /* waits left to do without spinning */
    uint64_t bytes_sent, bytes_recv;
};

/* --- blocking helpers over any link ------------------------------------- */

/* One pending transfer. done counts bytes moved so far. */
typedef struct {
    lk_link *link;
    bool     is_send;
    void    *buf;
    size_t   n, done;
} lk_xfer;

/* Drives all transfers until every one completed. On failure or timeout
 * returns LK_ERR_NET / LK_ERR_TIMEOUT with a message like
 * "rank 2 (10.0.0.3:7070): timeout after 2000 ms receiving 4096 bytes (got 0)". */
lk_status lk_xfer_run(lk_xfer *x, int nx, uint64_t deadline_ns, char *err, size_t errlen);

lk_status lk_link_send(lk_link *l, const void *buf, size_t n, uint64_t deadline_ns, char *err, size_t errlen);
lk_status lk_link_recv(lk_link *l, void *buf, size_t n, uint64_t deadline_ns, char *err, size_t errlen);
void      lk_link_close(lk_link *l);  /* NULL ok */
/* "rank 2 (10.0.0.3:7070)" or "10.0.0.3:7070" — for messages. */
const char *lk_link_name(const lk_link *l, char *buf, size_t len);

/* Deadline helper: now + ms. */
static inline uint64_t lk_deadline_ms(int64_t ms) { return lk_time_ns() + (uint64_t)ms * 1000000ull; }

/* --- TCP ---------------------------------------------------------------- */

/* "host:port" -> connected, non-blocking, TCP_NODELAY link. Retries refused
 * connections until the deadline (the peer may still be starting). */
lk_status lk_tcp_connect(const char *addr, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen);
/* Listening socket on "host:port" (port 0: any free port; host "" or "*"
 * = all interfaces). Returns the fd; *port_out gets the bound port. */
lk_status lk_tcp_listen(const char *addr, int *fd_out, int *port_out, char *err, size_t errlen);
/* Accepts one connection, waiting until the deadline. */
lk_status lk_tcp_accept(int listen_fd, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen);
/* Wraps a connected socket (made non-blocking, TCP_NODELAY). Takes the fd. */
lk_link *lk_tcp_wrap(int fd, const char *peer_addr);
/* The socket of a TCP link (-1 if l is not TCP). */
int lk_tcp_fd(const lk_link *l);
/* Has the peer of TCP link l closed it or failed? Peeks without consuming
 * or blocking; if so, says "peer process gone (control connection closed
 * | <errno text>)" in why. For links whose data travel elsewhere (shm, ucx,
 * mpi) and whose TCP control connection is the liveness check. */
bool lk_tcp_peer_gone(const lk_link *l, char *why, size_t n);
/* Splits "host:port" (host may be "[v6]"); false if malformed. */
bool lk_addr_split(const char *addr, char *host, size_t hostlen, int *port);

/* --- shared memory ------------------------------------------------------ */

/* Replaces nothing: builds an shm link *next to* the TCP link `ctl` to a
 * peer on the same host. Both sides call it at the same point; the side with
 * creator=true makes the segment and sends its name over ctl, the other maps
 * it and confirms; then the name is unlinked. ctl stays open and is watched
 * so a dead peer is noticed while waiting on the ring. ring_bytes: capacity
 * per direction (power of two; 0 = 1 MiB); win_bytes: each window slot
 * (power of two; 0 = 512 KiB); the creator's values are the pair's. The
 * creator reserves the segment's memory at once: a /dev/shm without room
 * for it fails here ("/dev/shm has no room for its N KiB"), not later. */
lk_status lk_shm_pair(lk_link *ctl, bool creator, size_t ring_bytes, size_t win_bytes, uint64_t deadline_ns,
                      lk_link **out, char *err, size_t errlen);
/* The window of a shm link, for collectives that would otherwise copy
 * every byte into a ring and out again: each side owns two slots of
 * lk_shm_win_bytes() that the other side reads in place. A rank writes
 * its payload into lk_shm_win_slot(), lk_shm_win_post()s it, and
 * lk_shm_win_wait() hands out the peer's slot of the same post once the
 * peer posted it (or fails with a message naming the peer, on its death or
 * at the deadline). Both sides must post and wait in the same sequence,
 * every post followed by its wait: the slots alternate by post, and a
 * slot is written again only after the peer posted the next one, which
 * it does only once it has read this one. Not for other links:
 * lk_shm_win_bytes() says 0 for them. */
size_t      lk_shm_win_bytes(const lk_link *l);
void       *lk_shm_win_slot(lk_link *l);
void        lk_shm_win_post(lk_link *l);
lk_status   lk_shm_win_wait(lk_link *l, const void **peer_slot, uint64_t deadline_ns, char *err, size_t errlen);
/* Unlinks /dev/shm segments of this user left by lockstep processes that no
 * longer exist (a creator killed while its peer was mapping); lk_shm_pair
 * does it once per process. Returns how many it removed. */
int lk_shm_sweep_stale(void);

/* --- UCX (ucx.c) --------------------------------------------------------- */

/* Whether this build has UCX (the Makefile found libucx-dev). */
bool lk_ucx_built(void);
/* Like lk_shm_pair: both sides call it at the same point with their TCP
 * link to the peer; the UCX worker addresses travel over ctl (already
 * authenticated), then one round trip wires the endpoint up. The lanes UCX
 * chose ("tcp/lo", "posix/memory", "rc_mlx5/mlx5_0:1") are printed on
 * stderr ("lockstep: ucx link to rank 1 (...): tcp/lo"), and a warning
 * follows when the two sides disagree or an RDMA device on this host goes
 * unused. ctl stays open and is watched for the peer's death. Without
 * UCX: LK_ERR_ARG, "lockstep was built without UCX ...". */
lk_status lk_ucx_pair(lk_link *ctl, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen);
/* The lanes of a UCX link ("tcp/lo"); NULL for any other link. */
const char *lk_ucx_report(const lk_link *l);
/* A device under /sys/class/infiniband (InfiniBand or RoCE NIC). */
bool lk_rdma_device_present(void);

/* --- MPI (mpi.c) ------------------------------------------------------- */

/* Whether this build has MPI (the Makefile found libopenmpi-dev). */
bool lk_mpi_built(void);
/* Whether MPI stays up in this process for --transport mpi (lk_mpi_adopt
 * ran, lk_mpi_end not yet). */
bool lk_mpi_active(void);
/* launch.c, right after MPI_Init_thread (MPI_THREAD_SERIALIZED at least) on
 * every rank of the job: MPI is kept for the data links. Errors are
 * returned, never abort the job (MPI_ERRORS_RETURN). */
lk_status lk_mpi_adopt(char *err, size_t errlen);
/* At exit (rc: the process's exit status): MPI_Finalize after a clean run
 * (bounded: a rank that never gets there cannot hold this one more than
 * 10 s); after a failure nothing, so mpirun ends the job. No-op unless
 * adopted. */
void lk_mpi_end(int rc);
/* Like lk_shm_pair: both sides call it at the same point with their TCP link
 * to the peer; lower is true on the lower mesh rank. MPI ranks and the
 * link's tag travel over ctl, then one round trip over MPI checks them.
 * Prints "lockstep: mpi link to rank 1 (...): MPI rank 0 -> 1, Open MPI
 * v4.1.4". ctl stays open and is watched for the peer's death. Outside an
 * MPI job: LK_ERR_ARG with a message saying so. */
lk_status lk_mpi_pair(lk_link *ctl, bool lower, uint64_t deadline_ns, lk_link **out, char *err, size_t errlen);
/* What an MPI link reports ("MPI rank 0 -> 1, Open MPI v4.1.4"); NULL for
 * any other link. */
const char *lk_mpi_report(const lk_link *l);
/* MPI's own MPI_Allreduce (sum) of n floats over every rank of the job,
 * for netbench to compare with lockstep's algorithms over MPI links; the
 * collectives never use it (its summation order is MPI's, not the
 * rank-ordered one batch invariance needs). */
lk_status lk_mpi_allreduce_f32(float *x, int64_t n, uint64_t deadline_ns, char *err, size_t errlen);

/* --- sealed links (seal.c) ---------------------------------------------- */

/* A sealed link carries the bytes of a TCP link as AEAD records (see seal.c
 * for the format): confidential, and any alteration,
 * injection, replay, reordering, drop or truncation fails the link with
 * "authentication of received data failed (tampered or corrupted link)" or
 * a message naming the bad record. Opt-in (lockstep --seal); the keys come
 * from the cluster handshake. Shared-memory links are never sealed. */
#define LK_SEAL_KEY_BYTES  32
#define LK_SEAL_MAX_RECORD (64u << 10) /* plaintext bytes per record */

/* Wraps `inner` (a TCP link: it must have a poll_fd), taking ownership; the
 * new link copies its rank and address. tx_key seals what we send, rx_key
 * opens what we receive (the peer holds them the other way round). Buffers
 * (about 192 KiB) are allocated here, never per message. */
typedef enum {
    LK_SEAL_CHACHA20_POLY1305 = 0, /* everywhere; constant time in software */
    LK_SEAL_AES256_GCM = 1,        /* where AES-NI and PCLMUL exist: about 1.5x faster */
} lk_seal_cipher;
bool        lk_seal_cipher_available(lk_seal_cipher c);
const char *lk_seal_cipher_name(lk_seal_cipher c); /* "AES-256-GCM" */
lk_link *lk_seal_wrap(lk_link *inner, lk_seal_cipher cipher, const uint8_t tx_key[LK_SEAL_KEY_BYTES],
                      const uint8_t rx_key[LK_SEAL_KEY_BYTES]);
lk_seal_cipher lk_seal_cipher_of(const lk_link *l); /* l sealed */
/* Frees the wrapper only and hands back the inner link (a handshake that
 * fails after wrapping gives its caller the link it came with). */
lk_link *lk_seal_unwrap(lk_link *l);
bool     lk_seal_is(const lk_link *l);

/* --- authenticating connections ---------------------------------------- */

/* How TCP connections are authenticated before anything else: the cluster
 * part's handshake (lk_hs_mesh_auth). The accepting side comes in steps so
 * that one poll loop (lk_gate) can wait for the first bytes of many
 * connections at once and spend time on a connection only once its peer
 * has sent all it needs to prove itself: a peer without the key can then
 * hold a listener up for no longer than one poll turn. */
#define LK_AUTH_STATE 64 /* bytes an authenticator keeps per accepted connection between steps */
typedef struct {
    /* Initiator: the whole exchange on a connection we made. It may replace
     * *l by a link wrapping it (a sealed link, which then owns the
     * original); on failure *l is still a link the caller closes. */
    lk_status (*connect)(void *ctx, lk_link **l, uint64_t deadline_ns, char *err, size_t errlen);
    /* Whether a failed connect may be tried again on a new connection (the
     * peer answered LK_GATE_BUSY). NULL: never. */
    bool (*retry)(void *ctx, lk_status st, const char *err);
    /* Acceptor, at accept: sends what must go first (never blocks: the
     * socket is fresh) and fills state. NULL: nothing to send. */
    lk_status (*open)(void *ctx, lk_link *l, uint8_t state[LK_AUTH_STATE], char *err, size_t errlen);
    /* Acceptor: p[0..n) is what the peer sent so far (peeked, not
     * consumed). 1: accept can run now without waiting on the peer before
     * it knows whether the peer holds the key; 0: wait for more; -1:
     * refuse (err says why). Decides by ready_max bytes at most. */
    int (*ready)(void *ctx, const uint8_t *p, size_t n, char *err, size_t errlen);
    size_t ready_max;
    /* Acceptor, once ready said 1: the rest of the exchange (like connect,
     * it may replace *l). NULL: nothing more (the mesh's own hello). */
    lk_status (*accept)(void *ctx, lk_link **l, const uint8_t state[LK_AUTH_STATE], uint64_t deadline_ns, char *err,
                        size_t errlen);
    /* Acceptor, best effort and never blocking: tells a connection why we
     * drop it (opened: open ran on it). NULL: nothing is said. */
    void (*refuse)(void *ctx, lk_link *l, bool opened, const char *why);
} lk_link_auth;

/* --- the gate: accepting connections open to the network ----------------- */

/* A listener's waiting room. It accepts every connection at once and holds
 * it in one poll loop (no thread, no blocking read) until auth->ready says
 * the peer has sent enough to be checked, then hands it out. A connection
 * silent for first_byte_ms, or not ready after ready_ms, is dropped. At
 * most max_per_host connections of one source address (IPv6: one /64) and
 * max_pending in all wait; a newcomer beyond that takes the place of the
 * oldest one of the same address (of any, when all are full) that is silent
 * and 10 ms old, or sent too little in 500 ms; with none, it is told
 * LK_GATE_BUSY (an ERROR frame through auth->refuse, then an orderly close,
 * not a reset) and the peer may try again. */
#define LK_GATE_BUSY "busy: too many connections waiting to authenticate, try again"
typedef struct lk_gate lk_gate;
typedef struct {
    const lk_link_auth *auth; /* open, ready, refuse */
    void *auth_ctx;
    int first_byte_ms;        /* 0: 1000 */
    int ready_ms;             /* 0: 2000 */
    int max_pending;          /* 0: 128 */
    int max_per_host;         /* 0: 8 */
    /* Every connection dropped or refused ("host:port", why); NULL: none. */
    void (*on_refuse)(void *ctx, const char *peer, const char *why);
    void *refuse_ctx;
} lk_gate_params;

/* listen_fd stays the caller's (it is made non-blocking). */
lk_gate *lk_gate_new(int listen_fd, const lk_gate_params *p);
/* The next connection whose peer sent enough, with the state auth->open
 * left for it; LK_ERR_TIMEOUT at the deadline. */
lk_status lk_gate_next(lk_gate *g, uint64_t deadline_ns, lk_link **out, uint8_t state[LK_AUTH_STATE], char *err,
                       size_t errlen);
/* Refuses (auth->refuse, on_refuse) and closes a connection lk_gate_next
 * handed out, which the caller cannot take (busy elsewhere). */
void lk_gate_refuse(lk_gate *g, lk_link *l, const char *why);
/* Connections dropped or refused so far; the latest "host:port: why" in last. */
int  lk_gate_refused(const lk_gate *g, char *last, size_t len);
void lk_gate_free(lk_gate *g); /* closes the connections still waiting; NULL ok */

/* --- mesh --------------------------------------------------------------- */

typedef struct lk_mesh lk_mesh;

/* The data transport of a mesh (named for its first use: shm or not).
 * LK_MESH_UCX: every peer link over UCX (lk_ucx_pair); LK_MESH_MPI: over
 * MPI (lk_mpi_pair). */
typedef enum { LK_MESH_SHM_AUTO = 0, LK_MESH_SHM_OFF, LK_MESH_SHM_FORCE, LK_MESH_UCX, LK_MESH_MPI } lk_mesh_shm;
/* --transport NAME -> the mode: auto, tcp, shm, ucx, mpi; a name not built in
 * ("lockstep was built without UCX ..."), mpi outside an MPI job, or an
 * unknown name is LK_ERR_ARG. */
lk_status lk_transport_parse(const char *name, lk_mesh_shm *out, char *err, size_t errlen);

typedef struct {
    int rank, n;
    const char *const *addrs; /* n "host:port": where each rank listens */
    int listen_fd;            /* already listening socket for addrs[rank], or -1 to bind it */
    lk_mesh_shm shm;          /* AUTO: shm to peers on the same host (boot id + hostname) */
    int64_t spin_ns;          /* <0: automatic (see lk_spin_default) */
    uint64_t timeout_ms;      /* to build the mesh (0: 10 s) */
    const lk_link_auth *auth; /* NULL: no authentication (tests, netbench on loopback) */
    void *auth_ctx;
} lk_mesh_params;

/* Rank r connects to every lower rank and accepts every higher one; each
 * connection starts with auth, then a hello (mesh size, both ranks, host
 * identity) that is checked. Accepting goes through a gate (above), so
 * stray connections cost the setup nothing; a setup that times out says
 * which ranks never came and what was refused meanwhile. */
lk_status lk_mesh_create(const lk_mesh_params *p, lk_mesh **out, char *err, size_t errlen);
/* A mesh from links the caller already holds (links[rank] is NULL); takes
 * ownership of the links. */
lk_mesh *lk_mesh_from_links(int rank, int n, lk_link **links);
void     lk_mesh_free(lk_mesh *m);
int      lk_mesh_rank(const lk_mesh *m);
int      lk_mesh_size(const lk_mesh *m);
lk_link *lk_mesh_link(lk_mesh *m, int peer); /* data link (shm if upgraded); NULL for self */
lk_link *lk_mesh_ctl(lk_mesh *m, int peer);  /* the TCP link, even when data goes by shm */
void     lk_mesh_set_spin(lk_mesh *m, int64_t spin_ns);

/* Spin budget for `ranks_here` busy ranks on this host: 50 us while they fit
 * the cores, 0 once they outnumber them. */
int64_t lk_spin_default(int ranks_here);

#endif
