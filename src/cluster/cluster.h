/* cluster — how a head and its workers talk: the wire protocol (frames),
 * the authenticated handshake, model identity, the cluster key; later the
 * worker daemon and the head side of `run --workers/--local`.
 *
 * Frames: a fixed 24-byte little-endian header
 *     magic u32 "LKW1" | version u16 | type u16 | flags u32 | length u32 | seq u64
 * then `length` payload bytes. The header layout is frozen across protocol
 * versions (only the payload meaning changes), so a peer of another version
 * can always read our ERROR frame saying why we refuse it. Every field is
 * checked on receipt, and the length against the type's maximum and the
 * caller's buffer *before* a byte of payload is read: nothing from the peer
 * sizes an allocation. Sequence numbers count frames per direction from 0;
 * a gap or repeat is a protocol error.
 *
 * Handshake (before any other message, on every connection; both roles run
 * the same code with initiator = who connected):
 *   1. HELLO both ways: a fresh 32-byte random challenge each.
 *   2. AUTH: the initiator proves it holds the cluster key first,
 *      HMAC-SHA256(key, "lockstep-auth-v1 initiator" | Ci | Cr); the
 *      responder checks it (constant time) and only then proves itself with
 *      the "responder" label. Labels stop reflection (echoing our own proof
 *      back), fresh challenges stop replay. A wrong proof is answered with an
 *      ERROR frame and the connection is closed.
 *   3. INFO both ways: protocol version, build id, CPU features, model
 *      identity (optional: a worker may not have loaded a model yet), seal
 *      mode, then the host's facts for doctor (an optional tail: shown,
 *      never compared; lk_hs_peer.has_facts).
 *   4. VERDICT both ways: each side compares and says "ok" or why not, so a
 *      refusal is printed on both sides with both values, e.g.
 *      "model mismatch: head has 3f2a91c0..., worker has 9bc1d2e4...".
 *      It ends with HMAC-SHA256(key, "lockstep-info-v1 <role>" | Ci | Cr |
 *      lengths | INFO_i | INFO_r) over both INFO frames as the sender saw
 *      them: INFO travels in clear, so a peer whose MAC differs means the
 *      facts (the seal modes above all) were altered on the way: refused
 *      ("altered in transit"), as is a VERDICT without it.
 *   5. With sealing agreed (below), the sealed check records.
 *
 * Threading: a channel is used by one thread at a time. */
#ifndef LK_CLUSTER_H
#define LK_CLUSTER_H

#include <stdio.h>

#include "common/lk_common.h"
#include "gguf/gguf.h"
#include "parallel/parallel.h"
#include "transport/transport.h"

/* ---- frames ---------------------------------------------------------------- */

#define LK_WIRE_MAGIC   0x31574b4cu /* "LKW1" little-endian */
/* 2: INFO ends with the seal mode and cipher offer, VERDICT with a MAC over
 * both INFO frames (required), and sealed links may follow the handshake.
 * 3: LOAD carries the sequence slots and KV budget; steps (many sequences
 * each) go over the data mesh instead of STEP frames on the control link.
 * 4: LOAD's slice says which experts the rank holds (expert parallelism).
 * A peer of another version is refused with both numbers. */
#define LK_WIRE_VERSION 4
#define LK_WIRE_HDR     24
#define LK_WIRE_MAX     (64u << 20) /* largest payload of any frame */

/* Message types. Numbers are part of the protocol: never renumber, only add
 * (pinned by static_assert in wire.c). */
typedef enum {
    LK_MSG_HELLO   = 1,  /* challenge[32] */
    LK_MSG_AUTH    = 2,  /* hmac[32] */
    LK_MSG_INFO    = 3,  /* versions, build, cpu, model id */
    LK_MSG_VERDICT = 4,  /* u8 ok, reason string */
    LK_MSG_ERROR   = 5,  /* reason string; readable across versions */
    /* control, after the handshake (head <-> worker) */
    LK_MSG_PING    = 16, /* u64 nonce: heartbeat; a worker's adds u32 compute us, u32 network us (its
                          * steps' totals modulo 2^32) */
    LK_MSG_PONG    = 17, /* u64 nonce */
    LK_MSG_LOAD    = 18, /* model path + identity + slice + mesh layout */
    LK_MSG_LOADED  = 19, /* u8 ok, reason */
    LK_MSG_STEP    = 20, /* retired in version 3: steps travel over the data mesh (step/step.h) */
    LK_MSG_RESULT  = 21, /* retired */
    LK_MSG_BYE     = 22, /* orderly end of a session */
    LK_MSG_MESH    = 23, /* every rank's data address: build the mesh */
    LK_MSG_READY   = 24, /* u8 ok, reason: mesh built */
    LK_MSG_BENCH   = 25, /* rank, ranks, transport, benchmark settings (instead of LOAD) */
    LK_MSG_FILE    = 26, /* the worker's slices of the model file follow (it asked): sizes, range-list hash */
    LK_MSG_DATA    = 27, /* the next bytes of those slices (at most 1 MiB) */
    LK_MSG_FILE_END = 28,/* digest of all the bytes sent */
} lk_msg_type;

typedef struct {
    uint32_t magic;
    uint16_t version, type;
    uint32_t flags, len;
    uint64_t seq;
} lk_frame_hdr;

/* The largest payload each type may carry (0: unknown type). */
uint32_t lk_wire_max_payload(uint16_t type);
const char *lk_msg_name(uint16_t type);

void lk_wire_encode_hdr(const lk_frame_hdr *h, uint8_t out[LK_WIRE_HDR]);
/* Decodes and validates magic, version (== expect_version, except ERROR
 * frames, which are read at any version), type, flags (none defined: must be
 * 0) and length (<= the type's maximum). */
lk_status lk_wire_decode_hdr(const uint8_t in[LK_WIRE_HDR], uint16_t expect_version, lk_frame_hdr *h,
                             char *err, size_t errlen);

/* A framed channel over a link: version and per-direction sequence numbers. */
typedef struct {
    lk_link *link;
    uint16_t version;         /* sent in headers, expected in received ones */
    uint64_t seq_out, seq_in; /* next to send / expect */
} lk_chan;

void lk_chan_init(lk_chan *c, lk_link *link);
lk_status lk_chan_send(lk_chan *c, uint16_t type, const void *payload, uint32_t len, uint64_t deadline_ns,
                       char *err, size_t errlen);
/* Receives one frame, its payload into buf (cap bytes). A frame longer than
 * cap, of a wrong sequence number, or malformed: LK_ERR_FORMAT (the channel
 * is then unusable: close it). An ERROR frame from the peer: LK_ERR_PEER,
 * with the peer's reason (sanitised to printable ASCII) in err. */
lk_status lk_chan_recv(lk_chan *c, lk_frame_hdr *h, void *buf, uint32_t cap, uint64_t deadline_ns,
                       char *err, size_t errlen);
/* Best effort: tells the peer why we give up (short deadline, errors ignored). */
void lk_chan_send_error(lk_chan *c, const char *reason);

/* Payload building and parsing, bounds-checked: a reader that runs past the
 * end sets ok = false and yields zeros, so parsers check once at the end. */
typedef struct { uint8_t *p; uint32_t cap, len; bool ok; } lk_wbuf;
typedef struct { const uint8_t *p; uint32_t len, pos; bool ok; } lk_rbuf;
void lk_wb_u8(lk_wbuf *b, uint8_t v);
void lk_wb_u32(lk_wbuf *b, uint32_t v);
void lk_wb_u64(lk_wbuf *b, uint64_t v);
void lk_wb_bytes(lk_wbuf *b, const void *p, uint32_t n);
void lk_wb_str(lk_wbuf *b, const char *s); /* u16 length + bytes */
uint8_t  lk_rb_u8(lk_rbuf *b);
uint32_t lk_rb_u32(lk_rbuf *b);
uint64_t lk_rb_u64(lk_rbuf *b);
void     lk_rb_bytes(lk_rbuf *b, void *out, uint32_t n);
/* Copies a string into out (NUL-terminated); longer than outlen-1, or
 * containing bytes outside printable ASCII: ok = false. */
void     lk_rb_str(lk_rbuf *b, char *out, size_t outlen);

/* ---- key, identity ----------------------------------------------------------- */

#define LK_KEY_BYTES 32
/* Reads a key file: 64 hex digits (surrounding whitespace allowed). A
 * missing, short, long or non-hex file is an error naming the file. */
lk_status lk_key_load(const char *path, uint8_t key[LK_KEY_BYTES], char *err, size_t errlen);
/* 64 hex digits of fresh randomness + NUL. */
void lk_key_generate(char hex[2 * LK_KEY_BYTES + 1]);

#define LK_MODEL_ID_BYTES 32
/* BLAKE2b-256 over the file's header, metadata and tensor index (every byte
 * before the data section), its size, and a sample of every tensor's data
 * (the first and last 4 KiB): two files agree if they are the same model,
 * without reading gigabytes. */
void lk_cluster_model_id(const lk_gguf *g, uint8_t id[LK_MODEL_ID_BYTES]);
/* "3f2a91c0d4e5b6a7" (first 8 bytes) into buf. */
const char *lk_cluster_model_id_short(const uint8_t id[LK_MODEL_ID_BYTES], char *buf, size_t len);
/* Two ids of a mismatch, written so that they visibly differ: the first 8
 * bytes of each where those differ, else all 32 bytes (LK_MODEL_ID_HEX - 1
 * hex digits), never two equal strings for two different ids. */
#define LK_MODEL_ID_HEX (2 * LK_MODEL_ID_BYTES + 1)
void lk_cluster_model_id_pair(const uint8_t a[LK_MODEL_ID_BYTES], const uint8_t b[LK_MODEL_ID_BYTES],
                              char ahex[LK_MODEL_ID_HEX], char bhex[LK_MODEL_ID_HEX]);

/* ---- handshake ----------------------------------------------------------------- */

/* Sealing (lockstep --seal): after the handshake, the connection carries
 * AEAD records (transport.h, lk_seal_wrap) instead of plain frames: AES-256-
 * GCM when both sides offer it (AES-NI), else ChaCha20-Poly1305. Each side
 * states its mode and the ciphers it offers in INFO; a side that requires sealing
 * and one that refuses it are a mismatch, refused with both settings; the
 * link is sealed if either side requires it. Keys, one per direction:
 *     BLAKE2b-256 keyed with the cluster key over
 *     "lockstep-seal-v1 initiator->responder" (or "responder->initiator")
 *     | Ci | Cr | BLAKE2b-256(INFO_i | INFO_r | VERDICT_i | VERDICT_r)
 * (the frames' payloads as sent), so both ends get the same keys only if
 * nobody altered the plain part of the handshake: the modes cannot be
 * stripped unseen. Both sides then send a first sealed record and check the
 * other's ("sealed link check failed" otherwise), before the handshake
 * returns. Nothing secret is sent in clear. */
typedef enum {
    LK_SEAL_OFF = 0, /* do not seal; refuse a peer that requires it (a head without --seal) */
    LK_SEAL_EITHER,  /* seal when the peer asks (a worker without --seal) */
    LK_SEAL_ON,      /* seal; refuse a peer that will not (--seal) */
} lk_seal_mode;

typedef struct {
    const uint8_t *key;        /* LK_KEY_BYTES */
    const char *role;          /* "head", "worker", "rank 2": names sides in messages */
    uint16_t    version;       /* LK_WIRE_VERSION (tests may lie) */
    const char *build_id;      /* lk_build_id() */
    const char *cpu;           /* lk_cpu_features() */
    bool        has_model;
    uint8_t     model_id[LK_MODEL_ID_BYTES];
    int64_t     timeout_ms;    /* whole handshake (0: 5000) */
    lk_seal_mode seal;         /* LK_SEAL_OFF by default */
    uint8_t     seal_ciphers;  /* bit per lk_seal_cipher offered (0: all this CPU has; tests narrow it) */
    /* Responder only: our HELLO already went out with this challenge
     * (lk_hs_mesh_auth.open, at accept) and c->seq_out counts it. */
    const uint8_t *hello_sent;
} lk_hs_params;

typedef struct {
    char     role[32], build_id[64], cpu[160];
    uint32_t version;
    bool     has_model;
    uint8_t  model_id[LK_MODEL_ID_BYTES];
    lk_seal_mode seal;         /* the peer's mode (OFF from a peer that does not say) */
    uint8_t  seal_ciphers;     /* the peer's offer (bit per lk_seal_cipher) */
    bool     sealed;           /* the link is sealed: c->link was replaced */
    lk_seal_cipher cipher;     /* ... with this cipher */
    /* The peer's host, for doctor (shown, never compared; an optional tail
     * of INFO, so has_facts is false from a peer that does not send it): */
    bool     has_facts;
    char     cpu_model[96];    /* /proc/cpuinfo's "model name" */
    char     clocksource[32];  /* the kernel's current clock source ("tsc") */
    int32_t  cpus;             /* CPUs it may run on (lk_cpus_usable) */
    int32_t  threads_default;  /* threads a rank takes there by default (lk_threads_default) */
    uint64_t mem_avail;        /* bytes it may still get (lk_mem_available) */
} lk_hs_peer;

/* This host's CPU model name and clock source, as INFO sends them
 * ("?" when unknown; printable ASCII). */
void lk_host_facts(char *cpu_model, size_t mlen, char *clocksource, size_t clen);

void lk_hs_defaults(lk_hs_params *p, const uint8_t *key, const char *role);
/* Runs the whole handshake over a fresh link. On success the channel c is
 * ready for control messages (its sequence numbers continue). When the link
 * ends up sealed (peer->sealed), c->link is a new sealed link that owns the
 * one c came with: the caller must keep c->link as its link from then on.
 * On failure c->link is the link c came with. Failures:
 * LK_ERR_AUTH (key), LK_ERR_MISMATCH (version/build/cpu/model, message with
 * both values), LK_ERR_PEER (peer refused us: its reason), LK_ERR_FORMAT
 * (garbage), LK_ERR_TIMEOUT / LK_ERR_NET. */
lk_status lk_handshake(lk_chan *c, bool initiator, const lk_hs_params *p, lk_hs_peer *peer,
                       char *err, size_t errlen);

/* The handshake as an lk_link_auth (transport.h; ctx: an lk_hs_params) for
 * meshes and gates: connect runs it as the initiator; the responder's
 * HELLO goes out at accept (open), the gate waits until the initiator's
 * HELLO and AUTH are in (ready: lk_hs_ready), and accept runs the rest, so
 * a peer without the key is refused without a wait. With sealing agreed
 * connect and accept replace *l by the sealed link. refuse sends an ERROR
 * frame; retry says yes to a peer that answered LK_GATE_BUSY. */
extern const lk_link_auth lk_hs_mesh_auth;
/* For a responder whose HELLO is out: 1 when p[0..n) holds all lk_handshake
 * reads before checking the initiator's proof (or a frame it refuses at
 * once), 0 when more must come, -1 when it cannot start a handshake (err:
 * "not a lockstep frame ...", "protocol version mismatch ...", ...). */
int lk_hs_ready(uint16_t version, const uint8_t *p, size_t n, char *err, size_t errlen);
/* The peer refused us as LK_GATE_BUSY (a full gate): worth another try. */
bool lk_hs_busy(lk_status st, const char *err);
/* "requires sealed links (--seal)" etc., for messages. */
const char *lk_seal_mode_desc(lk_seal_mode m);

const char *lk_build_id(void);

/* ---- network benchmark ---------------------------------------------------------------- */

typedef struct {
    size_t      sizes[32];
    int         nsizes;
    int64_t     iters;        /* timed repetitions per size (fewer for big sizes) */
    lk_wire_fmt wire;
    bool        allreduce_only;
    bool        seal;         /* lk_cluster_bench: seal the control and mesh links */
    const char *emulate_link; /* lk_cluster_bench with workers on loopback: --emulate-link's
                                 spec (NULL: none); the head's, never sent */
    int         threads;      /* threads per rank for the copies through shm windows (as the
                                 engine's pool; <= 1: the caller alone); never sent */
} lk_bench_cfg;

/* Runs the benchmark as this rank of mesh (every rank calls it with the same
 * cfg); rank 0 prints the table to out. The mesh stays the caller's. */
lk_status lk_bench_run(lk_mesh *mesh, const lk_bench_cfg *cfg, FILE *out, char *err, size_t errlen);
/* The same against running worker daemons: connects, authenticates, has
 * each build the mesh with us (rank 0) and run its part. */
lk_status lk_cluster_bench(const char *workers, const uint8_t *key, const lk_bench_cfg *cfg, lk_mesh_shm shm,
                           int64_t spin_ns, FILE *out, char *err, size_t errlen);

/* ---- worker and head --------------------------------------------------------------
 *
 * A session, as the head drives it (one TCP control connection per worker,
 * after the handshake; rank 0 is the head, which computes its share too):
 *   head -> worker  LOAD   rank, ranks, tp, slice, model name + path + identity,
 *                          n_ctx, n_batch, threads, kv_f16, transport
 *   worker -> head  LOADED ok / reason, the address its mesh listener got;
 *                          or "send me my slices" when it has no copy and a
 *                          --cache-dir (and no verified cache entry):
 *   head -> worker  FILE   file size, header length, bytes, disk need, hash
 *                          of the range list; then DATA frames carrying the
 *                          bytes of those ranges in file order, header first;
 *                          then FILE_END with their digest. The ranges: what
 *                          the worker's slice reads (lk_model_slice_bytes)
 *                          plus what the model identity samples, so the
 *                          worker recomputes the identity exactly. The
 *                          worker computes the same list from the header it
 *                          received, writes a sparse file of the full size
 *                          (holes elsewhere), checks digest and identity,
 *                          keeps it as <cache-dir>/<identity>-<layout>.gguf
 *                          with a .meta record (reused by later sessions,
 *                          and by slices it covers), and answers LOADED again.
 *                          It may answer LOADED (refusal) before the end
 *                          (cache limit, disk full): the head stops sending.
 *   head -> worker  MESH   every rank's data address; all ranks build the
 *                          authenticated mesh (shm between local ranks)
 *   worker -> head  READY  ok / reason
 *   then the steps, over the data mesh (step/step.h: rank 0 sends each step
 *                          to every rank; all run their part of it; the
 *                          last stage's candidates go to rank 0), until a
 *                          step marked "end";
 *   head -> worker  BYE    end of session (the worker waits for the next head)
 *   both ways       PING   every 250 ms (worker) / 500 ms (head): liveness.
 * While a worker runs steps, a second thread of its session owns the control
 * connection: it sends its PINGs and reads the head's, so neither a long
 * prefill nor a long wait for the next request looks like death, however
 * long a generation runs. The head declares a worker dead after
 * dead_after_ms (1.5 s) without a PING, or at once when its connection
 * closes, names it, and shuts its sockets so no wait outlives that. A worker
 * that hears nothing from its head for head_silence_ms (10 s) cuts its
 * sockets the same way (the step it waits in fails) and waits for the next
 * head.
 *
 * Layout: rank r = stage * tp + tp_rank; the head is rank 0 (stage 0). With
 * pp > 1 each stage's TP group all-reduces inside itself, every rank passes
 * its hidden rows to the same TP rank of the next stage, and the last
 * stage's ranks send their candidates straight to the head. */

typedef struct {
    const char *listen;     /* "host:port" (ignored when listen_fd >= 0) */
    int         listen_fd;  /* an already listening socket, or -1 */
    const uint8_t *key;
    const char *model_dir;  /* where models are looked up by file name (NULL: the head's path) */
    const char *cache_dir;  /* slices received from heads, by identity and layout (NULL: never ask for them) */
    uint64_t    cache_max;  /* bytes the cache may take on disk (0: 64 GiB); older entries are evicted */
    int         n_threads;  /* 0: all cores */
    bool        once;       /* serve one session, then return (--local children) */
    int64_t     head_silence_ms; /* end a session after this long without a frame (0: 10 s) */
    bool        seal;       /* require sealed links (--seal); otherwise seal when the head asks */
} lk_worker_opts;

/* Serves heads forever (or one session with once). Bad connections are
 * refused and logged; a session that fails ends and the worker goes on.
 * Returns only on a setup error (cannot listen) or after `once`. */
lk_status lk_worker_serve(const lk_worker_opts *o, char *err, size_t errlen);

typedef struct lk_cluster lk_cluster;
typedef struct lk_model lk_model;

typedef struct {
    const char *workers;       /* "host:port,..." or NULL */
    int         local;         /* total ranks incl. the head, started here (0: none) */
    const char *key_file;      /* needed with workers; --local makes a one-off key if NULL */
    const char *model_path;    /* the head's model file (workers look it up by name or path) */
    int         tp, pp;        /* 0: derived (tp x pp = ranks; default all TP) */
    const char *tp_weights;    /* "2,1,1" or NULL */
    const char *layers_split;  /* "3,2": layers per pipeline stage, or NULL (even) */
    /* Experts of a mixture: whole experts per TP rank (lk_plan_experts) or
     * rows of every expert. 0: whole when the model has at least tp experts
     * and tp > 1 (the faster decode: BENCHMARKS.md), 1: whole (an error
     * when impossible), -1: rows. */
    int         expert_parallel;
    const char *transport;     /* "auto" (NULL), "tcp", "shm" */
    int         n_ctx, n_batch, n_threads; /* per rank (threads 0: cores / local ranks) */
    int         max_seqs;      /* sequence slots (0: 1) */
    int64_t     kv_tokens;     /* KV positions in every rank's page pool (0: max_seqs x n_ctx) */
    bool        kv_f16;
    const char *wire;          /* all-reduce wire format: "f32" (NULL), "f16", "bf16", "q8" */
    int64_t     dead_after_ms; /* 0: 1500 */
    bool        seal;          /* seal every TCP link of the session (control and mesh; not shm) */
    const char *emulate_link;  /* --emulate-link spec (diag.h's grammar; --local only): relays on the mesh links */
} lk_cluster_opts;

/* Connects to (or starts) the workers, agrees on everything, plans the
 * split over dims, has every worker load its slice and builds the mesh.
 * The head's own slice is in *head_slice; load the head's model with it and
 * point its hooks at lk_cluster_hooks(). */
lk_status lk_cluster_open(const lk_cluster_opts *o, const lk_gguf *g, const lk_plan_dims *dims,
                          lk_cluster **out, lk_slice *head_slice, char *err, size_t errlen);
void lk_cluster_close(lk_cluster *c);
int  lk_cluster_n_ranks(const lk_cluster *c);
/* The session's data mesh and the head's TP group over it (stage 0), for
 * the rank step (step/step.h), which carries every step from here on. */
lk_mesh *lk_cluster_mesh(lk_cluster *c);
lk_comm *lk_cluster_comm(lk_cluster *c);
const lk_slice *lk_cluster_plan(const lk_cluster *c); /* every rank's slice, by rank */
/* The message for a failed step: what the monitor knows (a worker's closed
 * connection or silence, named) before the failed operation's detail. */
const char *lk_cluster_explain(lk_cluster *c, const char *detail);

/* What went wrong, naming the worker (host, rank), and the layer and
 * operation when a collective failed. */
const char *lk_cluster_error(const lk_cluster *c);
/* Worker rank (>= 1): its steps' compute and network-wait seconds so far,
 * as its heartbeats report them (up to 250 ms behind). false for rank 0
 * (the caller times its own steps) or a rank out of range. */
bool lk_cluster_rank_times(lk_cluster *c, int rank, double *compute_s, double *comm_s);
/* The process id of a worker started by --local (0 otherwise): for tests
 * and messages. */
int lk_cluster_local_pid(const lk_cluster *c, int rank);
const char *lk_cpu_features(void);

#endif
