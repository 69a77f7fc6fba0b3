/* The worker daemon: accepts heads, one session at a time, and runs its
 * slice of the model for them (message sequence in cluster.h).
 *
 * Threads: the accept loop holds every new connection in a gate (one poll
 * loop, transport.h) until the head's HELLO and AUTH are in, then hands it
 * to a short-lived thread that runs the rest of the handshake (so neither a
 * silent nor a stalling client delays anybody); the thread that wins the
 * session runs it; a heartbeat thread per
 * session sends PING every 250 ms, so the head hears from us even while a
 * long prefill keeps the session thread busy. */
#include "cluster/proto.h"
#include "model/model.h"
#include "sampler/sampler.h"
#include "step/step.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <netdb.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

#define MAX_HANDSHAKES 16

#define MAX_VERIFIED 32

/* A cache entry as it was when this process last checked every byte of it
 * (or wrote it): inode, size, change times. */
typedef struct {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
} vstamp;

/* A worker open to the network hears from scanners, from clients of other
 * protocols, and from someone holding its port with junk: one WARN line per
 * refused connection would let any of them fill the log (and bury the one
 * refusal that matters, a head with the wrong key). Per source host, the
 * first REFUSE_BURST refusals of a window are written in full; the rest are
 * counted and summed up in one line when the window ends. */
#define REFUSE_HOSTS 32
#define REFUSE_BURST 3
#define REFUSE_WINDOW_NS 5000000000ull

typedef struct {
    char host[64];      /* without the port: a flood comes from fresh ports */
    uint64_t t0;        /* the window's first refusal (0: slot free) */
    int logged, more;   /* refusals written in full, and counted only */
    char last[200];     /* the latest refusal counted only: "ADDR: reason" */
} refuse_rec;

typedef struct {
    const lk_worker_opts *o;
    atomic_int busy;        /* a session is running */
    atomic_int handshakes;  /* connection threads alive */
    atomic_int sessions;    /* sessions run (once: stop after the first) */
    /* Entries checked byte by byte since we started: a later session only
     * re-checks the identity of one still stamped the same, instead of
     * reading gigabytes at every head's start. Touched only by the session
     * thread (one session at a time). */
    vstamp verified[MAX_VERIFIED];
    int n_verified;
    /* Refusals logged, per source host (log_refusal): connection threads
     * and the accept loop write them, so they share a lock. */
    pthread_mutex_t refuse_mu;
    refuse_rec refuse[REFUSE_HOSTS];
} worker;

typedef struct {
    worker *w;
    lk_link *link;      /* sealed after the handshake when agreed (then it owns the TCP link) */
    bool sealed;
    lk_chan ch;
    pthread_mutex_t send_mu;   /* heartbeat thread and session thread both send */
    pthread_mutex_t hb_mu;
    pthread_cond_t hb_cv;
    bool hb_stop;
    pthread_t hb;
    bool hb_joined;
    char head[96];
    /* loaded state */
    lk_load_msg load;
    lk_gguf *g;
    lk_model *m;
    int mesh_lfd;
    lk_mesh *mesh;
    lk_comm *comm;
    lk_step *step;          /* the rank step, once the mesh is built */
    lk_step_msg msg;        /* the step being run */
    atomic_int stepping;    /* the session thread runs steps: the heartbeat thread owns the control link */
    _Atomic uint64_t compute_ns, comm_ns; /* the steps' time so far, told to the head with each PING */
    bool bench;             /* a netbench session: mesh only, no model */
    bool want_file;         /* asked the head for our slices */
    bool xfer_failed;       /* refused them midway: drop DATA until the head gives up */
    int file_fd;            /* the sparse .part being written (-1: none) */
    char base[1200];        /* <cache-dir>/<identity>-<layout>: the entry's files without suffix */
    lk_file_msg fm;         /* what the head announced */
    lk_ranges rl;           /* where the bytes go: known once the header is in */
    int64_t ri;             /* current range of rl */
    uint64_t roff;          /* bytes of it written */
    uint64_t got;           /* bytes received */
    uint64_t xfer_t0;
    crypto_generichash_state hs; /* digest of the bytes received */
    lk_bench_msg bmsg;
} session;

/* Messages from the link already start with the peer's address; when we
 * name the peer ourselves, drop that prefix. */
static const char *unprefixed(const char *msg, const char *name) {
    size_t n = strlen(name);
    return !strncmp(msg, name, n) && msg[n] == ':' && msg[n + 1] == ' ' ? msg + n + 2 : msg;
}

/* Ends rec's window: the refusals it counted but did not write, in one
 * line. Called with refuse_mu held. */
static void refuse_close(refuse_rec *r, uint64_t now) {
    if (r->more)
        lk_log(LK_LOG_WARN, "worker: %d more refused from %s in the last %.1f s (latest: %s)", r->more, r->host,
               (double)(now - r->t0) / 1e9, r->last);
    memset(r, 0, sizeof *r);
}

/* Closes every window older than REFUSE_WINDOW_NS: the accept loop calls
 * it at every turn (at least every 200 ms), so a burst's summary comes
 * soon after the burst, not at the next refusal. */
static void refuse_flush(worker *w) {
    uint64_t now = lk_time_ns();
    pthread_mutex_lock(&w->refuse_mu);
    for (int i = 0; i < REFUSE_HOSTS; i++)
        if (w->refuse[i].t0 && now - w->refuse[i].t0 >= REFUSE_WINDOW_NS) refuse_close(&w->refuse[i], now);
    pthread_mutex_unlock(&w->refuse_mu);
}

/* "worker: refused PEER: REASON", within the per-host budget above. */
static void log_refusal(worker *w, const char *peer, const char *reason) {
    char host[64];
    int port;
    if (!lk_addr_split(peer, host, sizeof host, &port)) snprintf(host, sizeof host, "%s", peer);
    /* The link's and the handshake's messages may each have named the peer. */
    for (const char *q; (q = unprefixed(reason, peer)) != reason;) reason = q;
    uint64_t now = lk_time_ns();
    pthread_mutex_lock(&w->refuse_mu);
    refuse_rec *r = NULL, *oldest = &w->refuse[0];
    for (int i = 0; i < REFUSE_HOSTS && !r; i++) {
        refuse_rec *e = &w->refuse[i];
        if (e->t0 && now - e->t0 >= REFUSE_WINDOW_NS) refuse_close(e, now);
        if (e->t0 && !strcmp(e->host, host)) r = e;
        else if (e->t0 < oldest->t0 && oldest->t0) oldest = e; /* a free slot (t0 0) stays the pick */
    }
    if (!r) {
        /* More hosts refused at once than slots: the oldest window ends
         * early (its count is written, not lost). */
        r = oldest;
        if (r->t0) refuse_close(r, now);
        snprintf(r->host, sizeof r->host, "%s", host);
        r->t0 = now;
    }
    if (r->logged < REFUSE_BURST) {
        r->logged++;
        lk_log(LK_LOG_WARN, "worker: refused %s: %s", peer, reason);
    } else {
        r->more++;
        snprintf(r->last, sizeof r->last, "%s: %s", peer, reason);
    }
    pthread_mutex_unlock(&w->refuse_mu);
}

static lk_status send_locked(session *s, uint16_t type, const void *p, uint32_t len, char *err, size_t errlen) {
    pthread_mutex_lock(&s->send_mu);
    lk_status st = lk_chan_send(&s->ch, type, p, len, lk_deadline_ms(5000), err, errlen);
    pthread_mutex_unlock(&s->send_mu);
    return st;
}

/* Cuts the data links (mesh sockets), so the step the session thread waits
 * in fails now: the head is gone or silent. */
static void cut_mesh(session *s) {
    for (int r = 0; s->mesh && r < lk_mesh_size(s->mesh); r++)
        if (r != lk_mesh_rank(s->mesh)) shutdown(lk_tcp_fd(lk_mesh_ctl(s->mesh, r)), SHUT_RDWR);
}

/* The session's second thread. It sends a PING every 250 ms, so the head
 * hears from us however long a step computes. Once the session thread runs
 * steps (they arrive over the mesh), it also owns every read of the control
 * link: the head's PINGs (every 500 ms) are its signs of life, a BYE or a
 * closed link ends the session, and head_silence_ms without a frame means
 * the head froze or lost its network: the mesh is cut so the step loop
 * fails at once instead of waiting forever. Steps count as life only
 * through the PINGs, which the head sends whatever it computes, so a
 * generation of any length is never mistaken for silence. */
static void *heartbeat_main(void *p) {
    session *s = p;
    uint64_t k = 0, next_ping = 0, last_news = lk_time_ns();
    int64_t silence = s->w->o->head_silence_ms > 0 ? s->w->o->head_silence_ms : 10000;
    char err[LK_ERRLEN];
    for (;;) {
        pthread_mutex_lock(&s->hb_mu);
        bool stop = s->hb_stop;
        pthread_mutex_unlock(&s->hb_mu);
        if (stop) break;
        uint64_t now = lk_time_ns();
        if (now >= next_ping) {
            next_ping = now + 250000000ull;
            /* nonce, then the step time totals in us modulo 2^32 (the head
             * adds up the differences: one wrap per 71 minutes is fine) */
            uint8_t b[16];
            lk_wbuf wb = {b, sizeof b, 0, true};
            lk_wb_u64(&wb, k++);
            lk_wb_u32(&wb, (uint32_t)(atomic_load(&s->compute_ns) / 1000));
            lk_wb_u32(&wb, (uint32_t)(atomic_load(&s->comm_ns) / 1000));
            if (send_locked(s, LK_MSG_PING, b, wb.len, err, sizeof err)) {
                cut_mesh(s); /* the session thread notices the dead connection too */
                break;
            }
        }
        if (!atomic_load(&s->stepping)) {
            /* set-up: the session thread reads the control link; wait a little */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
            pthread_mutex_lock(&s->hb_mu);
            if (!s->hb_stop) pthread_cond_timedwait(&s->hb_cv, &s->hb_mu, &ts);
            pthread_mutex_unlock(&s->hb_mu);
            last_news = lk_time_ns();
            continue;
        }
        struct pollfd pf = {.fd = lk_tcp_fd(s->link), .events = POLLIN};
        int pr = poll(&pf, 1, 50);
        now = lk_time_ns();
        if (pr > 0) {
            uint8_t buf[1024];
            lk_frame_hdr h;
            lk_status st = lk_chan_recv(&s->ch, &h, buf, sizeof buf, lk_deadline_ms(5000), err, sizeof err);
            if (st) {
                lk_log(LK_LOG_WARN, "worker: head %s: %s: ending the session", s->head, unprefixed(err, s->head));
                cut_mesh(s);
                break;
            }
            last_news = now;
            if (h.type == LK_MSG_BYE) {
                lk_log(LK_LOG_INFO, "worker: head %s said goodbye", s->head);
                cut_mesh(s); /* normally the end step came first and nothing waits */
                break;
            }
            if (h.type != LK_MSG_PING) {
                lk_log(LK_LOG_WARN, "worker: head %s sent an unexpected %s during steps", s->head, lk_msg_name(h.type));
                cut_mesh(s);
                break;
            }
        } else if ((int64_t)(now - last_news) > silence * 1000000) {
            lk_log(LK_LOG_WARN, "worker: head %s silent for %lld ms: abandoning its session", s->head, (long long)silence);
            cut_mesh(s);
            break;
        }
    }
    return NULL;
}

static void xfer_drop(session *s);

static void session_free_model(session *s) {
    xfer_drop(s); /* an interrupted transfer leaves nothing behind */
    lk_step_free(s->step); /* before the comm whose hooks it set */
    s->step = NULL;
    lk_comm_free(s->comm);
    s->comm = NULL;
    lk_mesh_free(s->mesh);
    s->mesh = NULL;
    if (s->mesh_lfd >= 0) close(s->mesh_lfd);
    s->mesh_lfd = -1;
    lk_model_free(s->m);
    s->m = NULL;
    lk_gguf_close(s->g);
    s->g = NULL;
    lk_step_msg_free(&s->msg);
}

/* The address our side of the control connection has: the head reached us
 * there, so the other ranks can too (the mesh listener binds to it). */
static void local_host(session *s, char *host, size_t len) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    snprintf(host, len, "127.0.0.1");
    if (getsockname(lk_tcp_fd(s->link), (struct sockaddr *)&ss, &sl) == 0)
        getnameinfo((struct sockaddr *)&ss, sl, host, (socklen_t)len, NULL, 0, NI_NUMERICHOST);
}

/* The listener the other ranks reach us on for this session's mesh. */
static lk_status open_mesh_listener(session *s, lk_loaded_msg *rep, char *err, size_t errlen) {
    char host[96];
    local_host(s, host, sizeof host);
    char addr[LK_ADDR_LEN];
    int port = 0;
    snprintf(addr, sizeof addr, strchr(host, ':') ? "[%s]:0" : "%s:0", host);
    lk_status st = lk_tcp_listen(addr, &s->mesh_lfd, &port, err, errlen);
    if (!st) snprintf(rep->mesh_addr, sizeof rep->mesh_addr, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    return st;
}

static lk_status do_bench(session *s, const uint8_t *p, uint32_t len, lk_loaded_msg *rep, char *err, size_t errlen) {
    if (s->m || s->bench) return lk_fail(err, errlen, LK_ERR_FORMAT, "BENCH after LOAD or BENCH");
    if (!lk_proto_bench_decode(p, len, &s->bmsg)) return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed BENCH message");
    s->bench = true;
    /* the mesh code reads rank and size from the LOAD fields */
    s->load.rank = s->bmsg.rank;
    s->load.n_ranks = s->bmsg.n_ranks;
    s->load.shm = s->bmsg.shm;
    return open_mesh_listener(s, rep, err, errlen);
}

/* Opens path and keeps it if it holds the head's model. */
static lk_status try_model(session *s, const char *path, char *err, size_t errlen) {
    lk_status st = lk_gguf_open(path, &s->g, err, errlen);
    if (st) return st;
    uint8_t id[LK_MODEL_ID_BYTES];
    lk_cluster_model_id(s->g, id);
    if (memcmp(id, s->load.model_id, sizeof id)) {
        char a[LK_MODEL_ID_HEX], b[LK_MODEL_ID_HEX];
        lk_cluster_model_id_pair(s->load.model_id, id, a, b);
        unsigned long long size = (unsigned long long)lk_gguf_file_size(s->g);
        lk_gguf_close(s->g);
        s->g = NULL;
        return lk_fail(err, errlen, LK_ERR_MISMATCH, "model mismatch: head has %s, worker has %s (%s, %llu bytes)", a,
                       b, path, size);
    }
    return LK_OK;
}

/* What the head's --ctx (and KV budget) costs this worker, checked against
 * the memory it may still get (lk_mem_available: MemAvailable, a cgroup
 * limit, RLIMIT_AS) before anything is allocated, as the head checks its
 * own: this rank's share of the KV cache (its layers and KV heads, every
 * position of the page pool), its RoPE tables and attention scores. The
 * head checks only its own machine (and an even share for --workers); a
 * worker with less room would otherwise be killed midway by the kernel or
 * an allocation, and the head would hear a lost connection. */
static lk_status check_kv_memory(session *s, const lk_model_params *mp, char *err, size_t errlen) {
    lk_model_config cfg;
    lk_status st = lk_model_config_read(s->g, &cfg, err, errlen);
    if (st) return st;
    const lk_slice *sl = &s->load.slice;
    const int n_ctx = mp->n_ctx > 0 ? mp->n_ctx : LK_MIN(cfg.n_ctx_train, 4096);
    const int64_t kv = mp->kv_tokens > 0 ? mp->kv_tokens : (int64_t)LK_MAX(mp->max_seqs, 1) * n_ctx;
    int rec = 0; /* recurrent layers (qwen35moe) have no pages but a state per slot */
    for (int l = LK_MAX(sl->layer0, 0); l < sl->layer1 && l < cfg.n_layer; l++) /* the slice is checked at load */
        rec += lk_model_layer_recurrent(&cfg, l);
    /* per position, as model.c's pages hold it: keys and values of head_dim
     * for each of this rank's KV heads, or one latent row (kv_lora + rope
     * dims, values included) for MLA; sliding-window layers in every
     * slot's ring instead, recurrent layers nowhere (model.h) */
    const int ring = lk_model_swa_ring(&cfg, n_ctx, mp->n_batch);
    int ringed = 0;
    const int layers = lk_model_paged_layers(&cfg, sl->layer0, sl->layer1, ring, &ringed), heads = sl->kv_head1 - sl->kv_head0;
    const double row = cfg.mla ? (double)cfg.kv_lora + cfg.rope_dim : 2.0 * cfg.head_dim;
    const double per_pos = (double)layers * heads * row * (mp->kv_f16 ? 2 : 4);
    const double rings = (double)LK_MAX(mp->max_seqs, 1) * ring * LK_KV_PAGE * ringed * heads *
                         row * (mp->kv_f16 ? 2 : 4);
    const double kv_bytes = (double)kv * per_pos + rings, gib = 1024.0 * 1024 * 1024;
    /* this rank's share of the delta net's heads: its key heads of all (lk_model_load) */
    const double kshare = cfg.n_recurrent ? (double)(sl->head1 - sl->head0) / cfg.n_head : 0;
    const double state = (double)LK_MAX(mp->max_seqs, 1) * rec * 4 * kshare *
                         ((double)(cfg.ssm_conv - 1) * (double)lk_model_ssm_channels(&cfg) +
                          (double)cfg.ssm_nv * cfg.ssm_dk * cfg.ssm_dv);
    const double tables = (double)n_ctx * cfg.rope_dim * 4 + (double)mp->n_threads * 16.0 * n_ctx * 4 + state;
    const uint64_t avail = lk_mem_available();
    if (!avail || kv_bytes + tables <= (double)avail) return LK_OK;
    char what[64];
    if (s->load.kv_tokens > 0 && s->load.kv_tokens != (int64_t)LK_MAX(mp->max_seqs, 1) * n_ctx)
        snprintf(what, sizeof what, "the KV budget (%lld positions)", (long long)kv);
    else snprintf(what, sizeof what, "--ctx %d", n_ctx);
    return lk_fail(err, errlen, LK_ERR_NOMEM,
                   "%s needs %.2f GiB on this worker (its KV cache share: %lld positions x %d layers x %d KV heads = "
                   "%.2f GiB, RoPE and attention tables %.2f GiB) but only %.2f GiB of memory is available to it: lower "
                   "--ctx or --kv-budget%s, or give the worker more memory", what, (kv_bytes + tables) / gib,
                   (long long)kv, layers, heads, kv_bytes / gib, tables / gib, (double)avail / gib,
                   mp->kv_f16 ? "" : ", add --kv-f16");
}

/* With the model open in s->g: the slice, the buffers, the mesh listener. */
static lk_status finish_load(session *s, const char *path, lk_loaded_msg *rep, char *err, size_t errlen) {
    const lk_load_msg *L = &s->load;
    lk_model_params mp = {.n_ctx = L->n_ctx, .n_batch = L->n_batch, .kv_f16 = L->kv_f16, .max_seqs = L->max_seqs,
                          .kv_tokens = L->kv_tokens,
                          .n_threads = s->w->o->n_threads ? s->w->o->n_threads : L->n_threads ? L->n_threads : lk_threads_default()};
    lk_status st = check_kv_memory(s, &mp, err, errlen);
    if (st) return st;
    st = lk_model_load(s->g, &L->slice, &mp, &s->m, err, errlen);
    if (st) return st;
    const lk_slice *sl = lk_model_slice(s->m);
    if ((st = open_mesh_listener(s, rep, err, errlen))) return st;
    char ex[48] = "";
    if (sl->ep) snprintf(ex, sizeof ex, ", experts %d-%d whole", sl->expert0, sl->expert1 - 1);
    lk_log(LK_LOG_INFO, "worker: rank %d of %d loaded %s: layers %d-%d, heads %d-%d, ffn rows %lld-%lld%s, vocab %lld-%lld",
           L->rank, L->n_ranks, path, sl->layer0, sl->layer1 - 1, sl->head0, sl->head1 - 1, (long long)sl->ff0,
           (long long)sl->ff1 - 1, ex, (long long)sl->vocab0, (long long)sl->vocab1 - 1);
    return LK_OK;
}

/* ---- the slice cache ------------------------------------------------------------------
 *
 * A worker without the model keeps what heads sent it in --cache-dir, one
 * entry per (model identity, layout):
 *   <identity hex>-<layout hex>.gguf  a sparse file of the model's full size
 *                                     holding only this slice's bytes (and
 *                                     the identity's samples): holes elsewhere
 *   <identity hex>-<layout hex>.meta  what was received and its digest
 * The layout is a hash of what decides the bytes (layers, heads, FFN and
 * vocabulary rows, first/last stage), so ranks of different clusters with
 * the same share reuse one entry; without one, an entry of another layout
 * that holds every byte of ours (a share that shrank) is used instead. An
 * entry is used only after checking it (parse, range list, digest of every
 * byte, identity; the digest once per process while the file stays
 * untouched) and touched then, so the entry evicted first when the cache
 * outgrows --cache-max is the one used longest ago. */

#define META_MAGIC "lockstep-slice-cache 1"
#define CACHE_MAX_DEFAULT (64ull << 30)

static uint64_t cache_max(const session *s) {
    return s->w->o->cache_max ? s->w->o->cache_max : CACHE_MAX_DEFAULT;
}

static void hex(const uint8_t *b, int n, char *out) {
    for (int i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
}

static void human(uint64_t n, char *buf, size_t len) {
    if (n < 10000) snprintf(buf, len, "%llu B", (unsigned long long)n);
    else if (n < (10ull << 20)) snprintf(buf, len, "%.1f KiB", (double)n / 1024);
    else if (n < (10ull << 30)) snprintf(buf, len, "%.1f MiB", (double)n / 1048576);
    else snprintf(buf, len, "%.1f GiB", (double)n / 1073741824);
}

/* <cache>/<identity>-<layout> for the loaded slice. */
static void entry_base(session *s) {
    const lk_slice *sl = &s->load.slice;
    /* an expert-parallel slice adds its experts (the other layouts keep the names they had) */
    int64_t f[15] = {sl->layer0, sl->layer1, sl->head0, sl->head1, sl->kv_head0, sl->kv_head1,
                     sl->ff0, sl->ff1, sl->vocab0, sl->vocab1, sl->pp_rank == 0, sl->pp_rank == sl->pp_size - 1,
                     sl->ep, sl->expert0, sl->expert1};
    const int nf = sl->ep ? 15 : 12;
    uint8_t b[8 * 15], lh[crypto_generichash_BYTES_MIN]; /* 16: the shortest BLAKE2b libsodium gives; 8 are used */
    for (int i = 0; i < nf; i++)
        for (int k = 0; k < 8; k++) b[8 * i + k] = (uint8_t)((uint64_t)f[i] >> (8 * k));
    LK_ASSERT(crypto_generichash(lh, sizeof lh, b, (size_t)(8 * nf), NULL, 0) == 0);
    char id[2 * LK_MODEL_ID_BYTES + 1], lay[17];
    hex(s->load.model_id, LK_MODEL_ID_BYTES, id);
    hex(lh, 8, lay);
    snprintf(s->base, sizeof s->base, "%s/%s-%s", s->w->o->cache_dir, id, lay);
}

static void entry_path(const session *s, const char *suffix, char *buf, size_t len) {
    snprintf(buf, len, "%s%s", s->base, suffix);
}

/* The file being received: named by our pid too, so two workers sharing a
 * cache never write one file (the second rename simply wins). */
static void part_path(const session *s, char *buf, size_t len) {
    snprintf(buf, len, "%s.gguf.%d.part", s->base, (int)getpid());
}

static void entry_remove(const char *base) {
    char p[1500];
    snprintf(p, sizeof p, "%s.gguf", base);
    unlink(p);
    snprintf(p, sizeof p, "%s.meta", base);
    unlink(p);
}

typedef struct {
    uint64_t size, n_bytes, n_ranges;
    uint8_t ranges_hash[32], digest[32];
    lk_slice slice;         /* what decides the ranges (the stage reduced to first/last) */
} meta;

static bool was_verified(const worker *w, const char *path);

static bool unhex(const char *h, uint8_t *out, int n) {
    for (int i = 0; i < n; i++)
        if (sscanf(h + 2 * i, "%2hhx", &out[i]) != 1) return false;
    return h[2 * n] == 0;
}

/* The record at path, for the model the head named. */
static lk_status meta_read(const session *s, const char *p, meta *m, char *err, size_t errlen) {
    char line[256], rh[80] = "", dg[80] = "", id[80] = "", want[2 * LK_MODEL_ID_BYTES + 1];
    memset(m, 0, sizeof *m);
    FILE *f = fopen(p, "r");
    if (!f) return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", p, strerror(errno));
    lk_slice *sl = &m->slice;
    int first = 0, last = 0;
    long long ff0 = 0, ff1 = 0, v0 = 0, v1 = 0;
    bool ok = fgets(line, sizeof line, f) && !strncmp(line, META_MAGIC "\n", sizeof META_MAGIC) &&
              fscanf(f, "model %70s size %llu bytes %llu ranges %llu ranges_hash %70s digest %70s", id,
                     (unsigned long long *)&m->size, (unsigned long long *)&m->n_bytes,
                     (unsigned long long *)&m->n_ranges, rh, dg) == 6 &&
              fscanf(f, " slice layers %d %d heads %d %d kv %d %d ff %lld %lld vocab %lld %lld first %d last %d",
                     &sl->layer0, &sl->layer1, &sl->head0, &sl->head1, &sl->kv_head0, &sl->kv_head1, &ff0, &ff1,
                     &v0, &v1, &first, &last) == 12;
    /* an expert-parallel slice's experts follow on the same line */
    int e0 = 0, e1 = 0;
    if (ok && fscanf(f, " experts %d %d", &e0, &e1) == 2) sl->ep = true, sl->expert0 = e0, sl->expert1 = e1;
    fclose(f);
    sl->ff0 = ff0, sl->ff1 = ff1, sl->vocab0 = v0, sl->vocab1 = v1;
    /* a stage that is first and/or last, which is all lk_model_slice_bytes asks */
    sl->pp_rank = first ? 0 : 1;
    sl->pp_size = last ? sl->pp_rank + 1 : sl->pp_rank + 2;
    sl->tp_size = 1;
    hex(s->load.model_id, LK_MODEL_ID_BYTES, want);
    if (!ok || strcmp(id, want) || !unhex(rh, m->ranges_hash, 32) || !unhex(dg, m->digest, 32))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s is not a valid cache record", p);
    return LK_OK;
}

/* Written to a temporary name and renamed: a record is whole or absent. */
static lk_status meta_write(const session *s, const uint8_t digest[32], char *err, size_t errlen) {
    char p[1400], tmp[1410], id[2 * LK_MODEL_ID_BYTES + 1], rh[65], dg[65];
    entry_path(s, ".meta", p, sizeof p);
    snprintf(tmp, sizeof tmp, "%s.tmp", p);
    hex(s->load.model_id, LK_MODEL_ID_BYTES, id);
    hex(s->fm.ranges_hash, 32, rh);
    hex(digest, 32, dg);
    FILE *f = fopen(tmp, "w");
    if (!f) return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", tmp, strerror(errno));
    const lk_slice *sl = &s->load.slice;
    fprintf(f, META_MAGIC "\nmodel %s\nsize %llu\nbytes %llu\nranges %llu\nranges_hash %s\ndigest %s\n", id,
            (unsigned long long)s->fm.size, (unsigned long long)s->fm.n_bytes, (unsigned long long)s->fm.n_ranges,
            rh, dg);
    fprintf(f, "slice layers %d %d heads %d %d kv %d %d ff %lld %lld vocab %lld %lld first %d last %d", sl->layer0,
            sl->layer1, sl->head0, sl->head1, sl->kv_head0, sl->kv_head1, (long long)sl->ff0, (long long)sl->ff1,
            (long long)sl->vocab0, (long long)sl->vocab1, sl->pp_rank == 0, sl->pp_rank == sl->pp_size - 1);
    if (sl->ep) fprintf(f, " experts %d %d", sl->expert0, sl->expert1);
    fputc('\n', f);
    bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0 && ok) ok = false, e = errno;
    if (!ok || rename(tmp, p) != 0) {
        if (ok) e = errno;
        unlink(tmp);
        return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", p, strerror(e));
    }
    return LK_OK;
}

/* Checks the entry <base>.gguf against its record <base>.meta: the header
 * parses, the range list of the recorded slice is the recorded one, and
 * those bytes hash to the recorded digest (skipped for a file this process
 * checked and that is unchanged since). Its ranges go to *have (if not
 * NULL). */
static lk_status entry_verify(const session *s, const char *base, lk_ranges *have, char *err, size_t errlen) {
    char p[1500];
    meta m;
    snprintf(p, sizeof p, "%s.meta", base);
    lk_status st = meta_read(s, p, &m, err, errlen);
    if (st) return st;
    snprintf(p, sizeof p, "%s.gguf", base);
    lk_gguf *g;
    if ((st = lk_gguf_open(p, &g, err, errlen))) return st;
    lk_ranges l = {0};
    uint8_t rh[32], dg[32];
    st = lk_proto_slice_ranges(g, &m.slice, &l, err, errlen);
    if (!st) {
        lk_proto_ranges_hash(&l, lk_gguf_file_size(g), rh);
        if (lk_gguf_file_size(g) != m.size || lk_ranges_total(&l) != m.n_bytes || memcmp(rh, m.ranges_hash, 32))
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: its ranges are not the recorded ones", p);
    }
    if (!st && !was_verified(s->w, p)) {
        lk_proto_digest_file(g, &l, dg);
        if (memcmp(dg, m.digest, 32))
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: its bytes do not match the recorded digest (corrupted)", p);
    }
    if (!st && have) *have = l;
    else lk_ranges_free(&l);
    lk_gguf_close(g);
    return st;
}

/* Opens our cache entry, checks it (entry_verify) and then the identity
 * (header, samples) against the head's. On success s->g holds it. */
static lk_status entry_check(session *s, char *err, size_t errlen) {
    lk_status st = entry_verify(s, s->base, NULL, err, errlen);
    char p[1400];
    entry_path(s, ".gguf", p, sizeof p);
    return st ? st : try_model(s, p, err, errlen);
}

/* need within have (both normalised: sorted, disjoint, not touching). */
static bool covers(const lk_ranges *have, const lk_ranges *need) {
    int64_t j = 0;
    for (int64_t i = 0; i < need->n; i++) {
        const lk_byte_range *r = &need->r[i];
        while (j < have->n && have->r[j].off + have->r[j].len <= r->off) j++;
        if (j == have->n || have->r[j].off > r->off || have->r[j].off + have->r[j].len < r->off + r->len) return false;
    }
    return true;
}

static bool ours(const char *n, const char *suffix, size_t *stem);

/* Our entry is not there: another layout's entry of the same model may
 * hold every byte our slice reads (a rank whose share shrank: tp 2, then
 * tp 4, say). If one checks out, *path names it and s->g holds it. */
static bool find_covering(session *s, char *path, size_t pathlen) {
    char id[2 * LK_MODEL_ID_BYTES + 1], why[LK_ERRLEN];
    hex(s->load.model_id, LK_MODEL_ID_BYTES, id);
    const char *dir = s->w->o->cache_dir;
    DIR *d = opendir(dir);
    if (!d) return false;
    struct dirent *de;
    bool found = false;
    while (!found && (de = readdir(d))) {
        size_t stem;
        if (!ours(de->d_name, ".meta", &stem) || strncmp(de->d_name, id, 2 * LK_MODEL_ID_BYTES) ||
            stem != 2 * LK_MODEL_ID_BYTES + 17)
            continue;
        char base[1300];
        snprintf(base, sizeof base, "%s/%.*s", dir, (int)stem, de->d_name);
        snprintf(path, pathlen, "%s.gguf", base);
        lk_ranges have = {0}, need = {0};
        lk_gguf *g;
        if (lk_gguf_open(path, &g, why, sizeof why)) continue;
        lk_status st = lk_proto_slice_ranges(g, &s->load.slice, &need, why, sizeof why);
        lk_gguf_close(g);
        if (!st && !entry_verify(s, base, &have, why, sizeof why) && covers(&have, &need) &&
            !try_model(s, path, why, sizeof why))
            found = true;
        lk_ranges_free(&have);
        lk_ranges_free(&need);
    }
    closedir(d);
    return found;
}

typedef struct {
    char name[300];
    time_t mtime;
    uint64_t disk;
} centry;

static int cmp_mtime(const void *a, const void *b) {
    const centry *x = a, *y = b;
    return x->mtime < y->mtime ? -1 : x->mtime > y->mtime;
}

/* A file of ours in the cache: "<64 hex>[-<16 hex>]<suffix>", the suffix
 * ".gguf", or ".part" for "<stem>.gguf.<pid>.part". */
static bool ours(const char *n, const char *suffix, size_t *stem) {
    size_t k = strspn(n, "0123456789abcdef");
    if (k != 2 * LK_MODEL_ID_BYTES) return false;
    if (n[k] == '-') {
        size_t j = strspn(n + k + 1, "0123456789abcdef");
        if (j != 16) return false;
        k += 1 + j;
    }
    *stem = k;
    if (!strcmp(suffix, ".part")) {
        size_t len = strlen(n);
        return !strncmp(n + k, ".gguf.", 6) && len > k + 6 + 5 && !strcmp(n + len - 5, ".part");
    }
    return !strcmp(n + k, suffix);
}

static uint64_t disk_of(const char *path, time_t *mtime) {
    struct stat sb;
    if (stat(path, &sb) != 0) return 0;
    if (mtime) *mtime = sb.st_mtime;
    return (uint64_t)sb.st_blocks * 512;
}

/* Makes room for `need` more bytes on disk: evicts the entries used longest
 * ago while the cache would exceed --cache-max (and partial files left by a
 * worker that died over 10 minutes ago), then checks the disk has the room. */
static lk_status cache_make_room(session *s, uint64_t need, char *err, size_t errlen) {
    const char *dir = s->w->o->cache_dir;
    uint64_t max = cache_max(s);
    char a[32], b[32], c[32];
    human(need, a, sizeof a);
    human(max, b, sizeof b);
    if (need > max)
        return lk_fail(err, errlen, LK_ERR_IO, "cache limit: this rank's slices need %s on disk, more than --cache-max %s "
                       "allows (raise it, or give the worker the model with --model-dir)", a, b);
    DIR *d = opendir(dir);
    if (!d) return lk_fail(err, errlen, LK_ERR_IO, "cache directory %s: %s", dir, strerror(errno));
    centry *e = NULL;
    size_t n = 0, cap = 0;
    uint64_t used = 0;
    time_t now = time(NULL);
    struct dirent *de;
    while ((de = readdir(d))) {
        char p[1400];
        size_t stem;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (ours(de->d_name, ".part", &stem)) {
            time_t mt = now;
            uint64_t k = disk_of(p, &mt);
            if (now - mt > 600) { unlink(p); continue; }
            used += k;
            continue;
        }
        if (!ours(de->d_name, ".gguf", &stem) || stem >= sizeof e->name) continue;
        if (n == cap) e = lk_xrealloc(e, (cap = cap ? 2 * cap : 16) * sizeof *e);
        centry *x = &e[n++];
        snprintf(x->name, sizeof x->name, "%.*s", (int)stem, de->d_name);
        x->mtime = now;
        x->disk = disk_of(p, &x->mtime);
        snprintf(p, sizeof p, "%s/%s.meta", dir, x->name);
        x->disk += disk_of(p, NULL);
        used += x->disk;
    }
    closedir(d);
    if (n) qsort(e, n, sizeof *e, cmp_mtime);
    for (size_t i = 0; i < n && used + need > max; i++) {
        char base[1400];
        snprintf(base, sizeof base, "%s/%s", dir, e[i].name);
        entry_remove(base);
        used -= LK_MIN(used, e[i].disk);
        human(e[i].disk, c, sizeof c);
        lk_log(LK_LOG_INFO, "worker: cache over --cache-max %s: removed %s (%s, the least recently used)", b, e[i].name, c);
    }
    free(e);
    struct statvfs vs;
    if (statvfs(dir, &vs) == 0 && (uint64_t)vs.f_bavail * vs.f_frsize < need) {
        human((uint64_t)vs.f_bavail * vs.f_frsize, c, sizeof c);
        return lk_fail(err, errlen, LK_ERR_IO, "cache disk full: %s has %s free, this rank's slices need %s", dir, c, a);
    }
    return LK_OK;
}

static bool stamp_of(const char *path, vstamp *v) {
    struct stat sb;
    if (stat(path, &sb) != 0) return false;
    *v = (vstamp){.dev = sb.st_dev, .ino = sb.st_ino, .size = sb.st_size, .mtime = sb.st_mtim, .ctime = sb.st_ctim};
    return true;
}

static bool same_stamp(const vstamp *a, const vstamp *b) {
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size && a->mtime.tv_sec == b->mtime.tv_sec &&
           a->mtime.tv_nsec == b->mtime.tv_nsec && a->ctime.tv_sec == b->ctime.tv_sec &&
           a->ctime.tv_nsec == b->ctime.tv_nsec;
}

static bool was_verified(const worker *w, const char *path) {
    vstamp v;
    if (!stamp_of(path, &v)) return false;
    for (int i = 0; i < w->n_verified; i++)
        if (same_stamp(&w->verified[i], &v)) return true;
    return false;
}

/* Marks the entry at path used now (its mtime: evicted last) and checked. */
static void touch_verified(worker *w, const char *path) {
    utimensat(AT_FDCWD, path, NULL, 0);
    vstamp v;
    if (!stamp_of(path, &v)) return;
    int k = 0;
    while (k < w->n_verified && (w->verified[k].dev != v.dev || w->verified[k].ino != v.ino)) k++;
    if (k == MAX_VERIFIED) { /* full: forget the oldest */
        memmove(w->verified, w->verified + 1, sizeof w->verified[0] * (MAX_VERIFIED - 1));
        k = MAX_VERIFIED - 1;
    }
    w->verified[k] = v;
    if (k == w->n_verified) w->n_verified++;
}

/* Finds the head's model: by name in --model-dir (or at the head's path);
 * then, with a cache, a verified entry for our slice (or a whole copy,
 * <identity>.gguf); failing those, asks the head for our slices
 * (rep->want_file). */
static lk_status do_load(session *s, const uint8_t *p, uint32_t len, lk_loaded_msg *rep, char *err, size_t errlen) {
    if (s->m || s->g || s->bench) return lk_fail(err, errlen, LK_ERR_FORMAT, "LOAD twice in one session");
    if (!lk_proto_load_decode(p, len, &s->load)) return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed LOAD message");
    const lk_load_msg *L = &s->load;
    char path[1400];
    if (s->w->o->model_dir) snprintf(path, sizeof path, "%s/%s", s->w->o->model_dir, L->model_name);
    else snprintf(path, sizeof path, "%s", L->model_path);
    lk_status st = try_model(s, path, err, errlen);
    if (!st || !s->w->o->cache_dir) return st ? st : finish_load(s, path, rep, err, errlen);
    char first[LK_ERRLEN], why[LK_ERRLEN], id[2 * LK_MODEL_ID_BYTES + 1];
    snprintf(first, sizeof first, "%s", err);
    hex(L->model_id, LK_MODEL_ID_BYTES, id);
    snprintf(path, sizeof path, "%s/%s.gguf", s->w->o->cache_dir, id);
    if (access(path, F_OK) == 0 && !try_model(s, path, why, sizeof why)) return finish_load(s, path, rep, err, errlen);
    entry_base(s);
    entry_path(s, ".gguf", path, sizeof path);
    if (access(path, F_OK) == 0) {
        uint64_t t0 = lk_time_ns();
        bool known = was_verified(s->w, path);
        if (!(st = entry_check(s, why, sizeof why))) {
            touch_verified(s->w, path);
            char a[32], b[32];
            human(disk_of(path, NULL), a, sizeof a);
            human(lk_gguf_file_size(s->g), b, sizeof b);
            lk_log(LK_LOG_INFO, "worker: reusing cached slices %s (%s on disk of a %s file; %s in %.2f s)", path, a, b,
                   known ? "unchanged since checked, identity checked" : "every byte checked", (double)(lk_time_ns() - t0) / 1e9);
            return finish_load(s, path, rep, err, errlen);
        }
        lk_log(LK_LOG_WARN, "worker: cache entry %s is unusable (%s): removing it and asking the head again", path,
               unprefixed(why, path));
        entry_remove(s->base);
    }
    if (find_covering(s, path, sizeof path)) {
        touch_verified(s->w, path);
        lk_log(LK_LOG_INFO, "worker: reusing cached slices %s: recorded for another layout, it holds all of this one's",
               path);
        return finish_load(s, path, rep, err, errlen);
    }
    rep->want_file = 1;
    return lk_fail(err, errlen, LK_ERR_IO, "no copy of the model here (%s): please send my slices", first);
}

static void xfer_drop(session *s) {
    if (s->file_fd >= 0) {
        char part[1400];
        part_path(s, part, sizeof part);
        close(s->file_fd);
        unlink(part);
        s->file_fd = -1;
    }
    lk_ranges_free(&s->rl);
    s->got = 0;
}

/* FILE: our slices are coming. Room is made (or refused) before a byte
 * arrives; they go to a sparse <entry>.gguf.part of the file's full size. */
static lk_status do_file(session *s, const uint8_t *p, uint32_t len, char *err, size_t errlen) {
    if (!s->want_file || s->file_fd >= 0) return lk_fail(err, errlen, LK_ERR_FORMAT, "unexpected FILE message");
    if (!lk_proto_file_decode(p, len, &s->fm)) return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed FILE message");
    lk_status st = cache_make_room(s, s->fm.disk, err, errlen);
    if (st) return st;
    char part[1400];
    part_path(s, part, sizeof part);
    int fd = open(part, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", part, strerror(errno));
    if (ftruncate(fd, (off_t)s->fm.size) != 0) {
        int e = errno;
        close(fd);
        unlink(part);
        return lk_fail(err, errlen, LK_ERR_IO, "%s: cannot size it to %llu bytes: %s", part,
                       (unsigned long long)s->fm.size, strerror(e));
    }
    s->file_fd = fd;
    s->got = 0;
    s->ri = 0;
    s->roff = 0;
    s->xfer_t0 = lk_time_ns();
    lk_proto_digest_init(&s->hs, s->fm.size);
    char a[32], b[32];
    human(s->fm.n_bytes, a, sizeof a);
    human(s->fm.size, b, sizeof b);
    lk_log(LK_LOG_INFO, "worker: receiving rank %d's slices of %s from %s: %s of a %s file, into %s", s->load.rank,
           s->load.model_name, s->head, a, b, part);
    return LK_OK;
}

static lk_status put(session *s, const uint8_t *p, uint64_t n, uint64_t off, char *err, size_t errlen) {
    while (n) {
        ssize_t k = pwrite(s->file_fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            char part[1400];
            part_path(s, part, sizeof part);
            if (k < 0 && (errno == ENOSPC || errno == EDQUOT))
                return lk_fail(err, errlen, LK_ERR_IO, "cache disk full writing %s: need %llu more bytes", part,
                               (unsigned long long)(s->fm.n_bytes - s->got));
            return lk_fail(err, errlen, LK_ERR_IO, "writing %s: %s", part, k < 0 ? strerror(errno) : "no progress");
        }
        p += k, n -= (uint64_t)k, off += (uint64_t)k;
    }
    return LK_OK;
}

/* The header is in: parse it from the .part and compute where the rest goes
 * (the same function the head used), and check it is the head's list. */
static lk_status xfer_plan(session *s, char *err, size_t errlen) {
    char part[1400];
    part_path(s, part, sizeof part);
    lk_gguf *g;
    lk_status st = lk_gguf_open(part, &g, err, errlen);
    if (st) return st;
    uint8_t rh[32];
    st = lk_proto_slice_ranges(g, &s->load.slice, &s->rl, err, errlen);
    if (!st) {
        lk_proto_ranges_hash(&s->rl, s->fm.size, rh);
        if (lk_gguf_data_offset(g) != s->fm.header_len || s->rl.r[0].off != 0 || s->rl.r[0].len < s->fm.header_len ||
            (uint64_t)s->rl.n != s->fm.n_ranges || lk_ranges_total(&s->rl) != s->fm.n_bytes ||
            lk_ranges_disk(&s->rl, LK_DISK_BLOCK) != s->fm.disk || memcmp(rh, s->fm.ranges_hash, 32))
            st = lk_fail(err, errlen, LK_ERR_MISMATCH,
                         "the head's byte ranges for this slice (%llu bytes in %llu ranges) are not ours "
                         "(%llu bytes in %lld ranges)", (unsigned long long)s->fm.n_bytes,
                         (unsigned long long)s->fm.n_ranges, (unsigned long long)lk_ranges_total(&s->rl),
                         (long long)s->rl.n);
    }
    lk_gguf_close(g);
    s->roff = s->fm.header_len; /* the header is range 0's beginning */
    return st;
}

/* DATA: the next bytes, in range order. */
static lk_status do_data(session *s, const uint8_t *p, uint32_t len, char *err, size_t errlen) {
    if (s->file_fd < 0 || len > s->fm.n_bytes - s->got)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "unexpected DATA message");
    crypto_generichash_update(&s->hs, p, len);
    lk_status st;
    if (s->got < s->fm.header_len) { /* the header: at offset 0 on, before the list is known */
        uint32_t k = (uint32_t)LK_MIN((uint64_t)len, s->fm.header_len - s->got);
        if ((st = put(s, p, k, s->got, err, errlen))) return st;
        s->got += k, p += k, len -= k;
        if (s->got == s->fm.header_len && (st = xfer_plan(s, err, errlen))) return st;
    }
    while (len) {
        LK_ASSERT(s->ri < s->rl.n); /* total checked against n_bytes */
        const lk_byte_range *r = &s->rl.r[s->ri];
        uint32_t k = (uint32_t)LK_MIN((uint64_t)len, r->len - s->roff);
        if ((st = put(s, p, k, r->off + s->roff, err, errlen))) return st;
        s->got += k, p += k, len -= k, s->roff += k;
        if (s->roff == r->len) s->ri++, s->roff = 0;
    }
    return LK_OK;
}

/* FILE_END: every byte is in. Check the digest, make it durable, check the
 * identity, then it becomes the cache entry and we load it. */
static lk_status do_file_end(session *s, const uint8_t *p, uint32_t len, lk_loaded_msg *rep, char *err, size_t errlen) {
    if (s->file_fd < 0 || s->got != s->fm.n_bytes || len != 32)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "unexpected FILE_END message (%llu of %llu bytes received)",
                       (unsigned long long)s->got, (unsigned long long)s->fm.n_bytes);
    uint8_t dg[32];
    crypto_generichash_final(&s->hs, dg, 32);
    char part[1400], path[1400];
    part_path(s, part, sizeof part);
    entry_path(s, ".gguf", path, sizeof path);
    if (memcmp(dg, p, 32)) return lk_fail(err, errlen, LK_ERR_FORMAT, "the slices received do not match the head's digest");
    if (fsync(s->file_fd) != 0) {
        int e = errno;
        if (e == ENOSPC || e == EDQUOT) return lk_fail(err, errlen, LK_ERR_IO, "cache disk full writing %s", part);
        return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", part, strerror(e));
    }
    int fd = s->file_fd;
    s->file_fd = -1;
    if (close(fd) != 0) {
        unlink(part);
        return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", part, strerror(errno));
    }
    lk_status st = try_model(s, part, err, errlen); /* identity: header, index, samples */
    if (!st) st = meta_write(s, dg, err, errlen);
    if (!st && rename(part, path) != 0) st = lk_fail(err, errlen, LK_ERR_IO, "%s: %s", path, strerror(errno));
    if (st) {
        unlink(part);
        entry_remove(s->base);
        return st;
    }
    touch_verified(s->w, path);
    double secs = (double)(lk_time_ns() - s->xfer_t0) / 1e9;
    char a[32];
    human(disk_of(path, NULL), a, sizeof a);
    lk_log(LK_LOG_INFO, "worker: received %llu of %llu bytes in %.2f s (%.1f MB/s); cached as %s (%s on disk)",
           (unsigned long long)s->got, (unsigned long long)s->fm.size, secs, (double)s->got / 1e6 / (secs > 0 ? secs : 1e-9),
           path, a);
    lk_ranges_free(&s->rl);
    s->want_file = false;
    return finish_load(s, path, rep, err, errlen);
}

static lk_status do_mesh(session *s, const uint8_t *p, uint32_t len, char *err, size_t errlen) {
    if ((!s->m && !s->bench) || s->mesh) return lk_fail(err, errlen, LK_ERR_FORMAT, "MESH before LOAD, or twice");
    lk_mesh_msg mm;
    if (!lk_proto_mesh_decode(p, len, &mm) || mm.n != s->load.n_ranks)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed MESH message");
    const char *addrs[LK_MAX_RANKS];
    for (int i = 0; i < mm.n; i++) addrs[i] = mm.addrs[i];
    char role[32];
    snprintf(role, sizeof role, "rank %d", s->load.rank);
    lk_hs_params hp;
    lk_hs_defaults(&hp, s->w->o->key, role);
    /* every rank learns from its own control link whether the head seals */
    hp.seal = s->sealed ? LK_SEAL_ON : LK_SEAL_OFF;
    lk_mesh_params mp = {.rank = s->load.rank, .n = mm.n, .addrs = addrs, .listen_fd = s->mesh_lfd,
                         .shm = (lk_mesh_shm)s->load.shm, .spin_ns = s->bench ? s->bmsg.spin_ns : -1,
                         .timeout_ms = 20000, .auth = &lk_hs_mesh_auth, .auth_ctx = &hp};
    lk_status st = lk_mesh_create(&mp, &s->mesh, err, errlen);
    close(s->mesh_lfd);
    s->mesh_lfd = -1;
    if (st || s->bench) return st;
    /* Our TP group: the ranks of our pipeline stage. */
    const lk_slice *sl = &s->load.slice;
    int group[LK_MAX_RANKS];
    if ((int64_t)sl->tp_size * sl->pp_size != mm.n)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "LOAD: tp %d x pp %d is not the %d ranks", sl->tp_size, sl->pp_size, mm.n);
    for (int t = 0; t < sl->tp_size; t++) group[t] = sl->pp_rank * sl->tp_size + t;
    if ((st = lk_comm_create(s->mesh, group, sl->tp_size, &s->comm, err, errlen))) return st;
    /* Long: a slow peer's long prefill is not a failure. Dead peers are
     * found by closed connections, and the head by its heartbeats. */
    lk_comm_set_timeout_ms(s->comm, 120000);
    lk_comm_set_wire(s->comm, (lk_wire_fmt)s->load.wire);
    lk_step_params sp = {.m = s->m, .mesh = s->mesh, .tp = s->comm};
    if ((st = lk_step_create(&sp, &s->step, err, errlen))) return st;
    lk_step_msg_init(&s->msg, lk_model_max_seqs(s->m), lk_model_n_batch(s->m));
    return LK_OK;
}

/* The session from READY on: steps from rank 0 over the mesh until one
 * says "end" (or the mesh fails: the head died, or the heartbeat thread cut
 * it). Idle waits are unbounded: a server may wait hours for a request;
 * liveness is the heartbeat thread's business. */
static void step_loop(session *s) {
    char err[LK_ERRLEN];
    atomic_store(&s->stepping, 1);
    for (;;) {
        lk_status st = lk_step_recv(s->step, &s->msg, lk_deadline_ms(365LL * 24 * 3600 * 1000), err, sizeof err);
        if (!st && s->msg.end) {
            /* BYE follows on the control link: the heartbeat thread reads
             * it (or sees the link close, or the head fall silent) and
             * ends; leaving before it would look like a crash to the head */
            lk_log(LK_LOG_DEBUG, "worker: head %s ended its steps", s->head);
            pthread_join(s->hb, NULL);
            s->hb_joined = true;
            return;
        }
        if (!st) {
            uint64_t t0 = lk_time_ns();
            st = lk_step_run(s->step, &s->msg, false, err, sizeof err);
            uint64_t run = lk_time_ns() - t0, comm = (uint64_t)(lk_step_take_comm_s(s->step) * 1e9);
            atomic_fetch_add(&s->comm_ns, comm);
            atomic_fetch_add(&s->compute_ns, run > comm ? run - comm : 0);
        }
        if (st) {
            lk_log(LK_LOG_WARN, "worker: step for %s failed: %s", s->head, err);
            pthread_mutex_lock(&s->send_mu);
            lk_chan_send_error(&s->ch, err);
            pthread_mutex_unlock(&s->send_mu);
            return;
        }
    }
}

static void run_session(session *s) {
    int64_t silence = s->w->o->head_silence_ms > 0 ? s->w->o->head_silence_ms : 10000;
    uint8_t *buf = lk_xmalloc_aligned(1u << 20);
    char err[LK_ERRLEN];
    lk_log(LK_LOG_INFO, "worker: session with head %s", s->head);
    pthread_create(&s->hb, NULL, heartbeat_main, s);
    for (;;) {
        lk_frame_hdr h;
        lk_status st = lk_chan_recv(&s->ch, &h, buf, 1u << 20, lk_deadline_ms(silence), err, sizeof err);
        if (st) {
            if (st == LK_ERR_TIMEOUT) lk_log(LK_LOG_WARN, "worker: head %s silent for %lld ms: ending the session", s->head, (long long)silence);
            else lk_log(LK_LOG_WARN, "worker: head %s: %s: ending the session", s->head, unprefixed(err, s->head));
            break;
        }
        if (h.type == LK_MSG_PING) continue;
        if (h.type == LK_MSG_BYE) { lk_log(LK_LOG_INFO, "worker: head %s said goodbye", s->head); break; }
        if (h.type == LK_MSG_LOAD || h.type == LK_MSG_BENCH) {
            lk_loaded_msg rep = {0};
            st = h.type == LK_MSG_LOAD ? do_load(s, buf, h.len, &rep, rep.reason, sizeof rep.reason)
                                       : do_bench(s, buf, h.len, &rep, rep.reason, sizeof rep.reason);
            rep.ok = st == LK_OK;
            if (rep.want_file) {
                s->want_file = true;
                lk_log(LK_LOG_INFO, "worker: asking %s for our slices: %s", s->head, rep.reason);
            } else if (st) {
                lk_log(LK_LOG_WARN, "worker: LOAD from %s refused: %s", s->head, rep.reason);
            }
            uint8_t out[1024];
            uint32_t n = lk_proto_loaded_encode(&rep, out, sizeof out);
            if (send_locked(s, LK_MSG_LOADED, out, n, err, sizeof err) || (st && !rep.want_file)) break;
            continue;
        }
        if (h.type == LK_MSG_FILE || h.type == LK_MSG_DATA || h.type == LK_MSG_FILE_END) {
            /* After a refusal the head may still have frames of our slices
             * in flight: drop them until it says goodbye. */
            if (s->xfer_failed && h.type != LK_MSG_FILE) continue;
            lk_loaded_msg rep = {0};
            st = h.type == LK_MSG_FILE   ? do_file(s, buf, h.len, rep.reason, sizeof rep.reason)
               : h.type == LK_MSG_DATA   ? do_data(s, buf, h.len, rep.reason, sizeof rep.reason)
                                         : do_file_end(s, buf, h.len, &rep, rep.reason, sizeof rep.reason);
            if (!st && h.type != LK_MSG_FILE_END) continue;
            if (st) {
                lk_log(LK_LOG_WARN, "worker: receiving slices from %s: %s", s->head, rep.reason);
                xfer_drop(s);
                s->xfer_failed = true;
            }
            rep.ok = st == LK_OK;
            uint8_t out[1024];
            uint32_t n = lk_proto_loaded_encode(&rep, out, sizeof out);
            if (send_locked(s, LK_MSG_LOADED, out, n, err, sizeof err)) break;
            continue;
        }
        if (h.type == LK_MSG_MESH) {
            char why[512] = "";
            st = do_mesh(s, buf, h.len, why, sizeof why);
            uint8_t out[600];
            lk_wbuf w = {out, sizeof out, 0, true};
            lk_wb_u8(&w, st == LK_OK);
            lk_wb_str(&w, why);
            if (st) lk_log(LK_LOG_WARN, "worker: mesh for %s failed: %s", s->head, why);
            if (send_locked(s, LK_MSG_READY, out, w.len, err, sizeof err) || st) break;
            if (!s->bench) {
                step_loop(s);
                break;
            }
            {
                /* Our part of the benchmark, then wait for BYE. */
                if ((st = lk_bench_run(s->mesh, &s->bmsg.cfg, NULL, err, sizeof err))) {
                    lk_log(LK_LOG_WARN, "worker: benchmark for %s failed: %s", s->head, err);
                    break;
                }
                lk_mesh_free(s->mesh);
                s->mesh = NULL;
            }
            continue;
        }
        snprintf(err, sizeof err, "unexpected %s message", lk_msg_name(h.type));
        lk_log(LK_LOG_WARN, "worker: head %s: %s", s->head, err);
        pthread_mutex_lock(&s->send_mu);
        lk_chan_send_error(&s->ch, err);
        pthread_mutex_unlock(&s->send_mu);
        break;
    }
    pthread_mutex_lock(&s->hb_mu);
    s->hb_stop = true;
    pthread_cond_signal(&s->hb_cv);
    pthread_mutex_unlock(&s->hb_mu);
    if (!s->hb_joined) pthread_join(s->hb, NULL);
    session_free_model(s);
    free(buf);
    lk_log(LK_LOG_INFO, "worker: session with %s over; ready for the next head", s->head);
}

typedef struct {
    worker *w;
    lk_link *link;
    uint8_t hello[LK_AUTH_STATE];
} conn_arg;

/* Takes the one session slot. A head that reconnects right after its last
 * session (or after a crash) may arrive while that session is still being
 * torn down: wait a little before calling ourselves busy. */
static bool claim(worker *w) {
    for (int i = 0; i < 100; i++) { /* 1 s */
        int zero = 0;
        if (atomic_compare_exchange_strong(&w->busy, &zero, 1)) return true;
        usleep(10000);
    }
    return false;
}

/* A connection the gate handed out (the head's HELLO and AUTH are in;
 * our HELLO, with challenge hello, went out at accept). */
static void serve_conn(worker *w, lk_link *link, const uint8_t *hello) {
    session *s = lk_xcalloc(1, sizeof *s);
    s->w = w;
    s->link = link;
    s->mesh_lfd = -1;
    s->file_fd = -1;
    pthread_mutex_init(&s->send_mu, NULL);
    pthread_mutex_init(&s->hb_mu, NULL);
    pthread_cond_init(&s->hb_cv, NULL);
    snprintf(s->head, sizeof s->head, "%s", link->peer_addr);
    lk_chan_init(&s->ch, link);
    s->ch.seq_out = 1; /* our HELLO */
    lk_hs_params hp;
    lk_hs_defaults(&hp, w->o->key, "worker");
    hp.seal = w->o->seal ? LK_SEAL_ON : LK_SEAL_EITHER;
    hp.hello_sent = hello;
    /* The proof is checked at once (the gate waited for it); only a key
     * holder gets further, and a few round trips take far less than 3 s. */
    hp.timeout_ms = 3000;
    lk_hs_peer peer;
    char err[LK_ERRLEN];
    lk_status st = lk_handshake(&s->ch, false, &hp, &peer, err, sizeof err);
    s->link = s->ch.link; /* the sealed link, when sealed */
    s->sealed = peer.sealed;
    if (!st && peer.sealed)
        lk_log(LK_LOG_INFO, "worker: head %s: link sealed (%s)", s->head, lk_seal_cipher_name(peer.cipher));
    if (st) {
        log_refusal(w, link->peer_addr, err);
    } else if (!claim(w)) {
        log_refusal(w, link->peer_addr, "busy with another head");
        lk_chan_send_error(&s->ch, "worker busy: serving another head");
    } else {
        run_session(s);
        atomic_fetch_add(&w->sessions, 1);
        atomic_store(&w->busy, 0);
    }
    lk_link_close(s->link);
    pthread_mutex_destroy(&s->send_mu);
    pthread_mutex_destroy(&s->hb_mu);
    pthread_cond_destroy(&s->hb_cv);
    free(s);
}

static void *conn_main(void *p) {
    conn_arg *a = p;
    serve_conn(a->w, a->link, a->hello);
    atomic_fetch_sub(&a->w->handshakes, 1);
    free(a);
    return NULL;
}

static void gate_refused(void *ctx, const char *peer, const char *why) { log_refusal(ctx, peer, why); }

lk_status lk_worker_serve(const lk_worker_opts *o, char *err, size_t errlen) {
    worker w = {.o = o, .refuse_mu = PTHREAD_MUTEX_INITIALIZER};
    int lfd = o->listen_fd, port = 0;
    bool own = false;
    if (lfd < 0) {
        lk_status st = lk_tcp_listen(o->listen, &lfd, &port, err, errlen);
        if (st) return st;
        own = true;
        lk_log(LK_LOG_INFO, "worker: listening on %s (port %d)", o->listen, port);
    }
    /* Every connection waits in the gate, in this thread, until the head's
     * HELLO and AUTH are in (transport.h): silence, a slow drip or garbage
     * hold no thread and no slot for long, one address holds at most 8
     * places, and a full gate answers LK_GATE_BUSY, which heads retry. */
    lk_hs_params ghp;
    lk_hs_defaults(&ghp, o->key, "worker");
    lk_gate_params gp = {.auth = &lk_hs_mesh_auth, .auth_ctx = &ghp, .on_refuse = gate_refused, .refuse_ctx = &w};
    lk_gate *gate = lk_gate_new(lfd, &gp);
    char why[LK_ERRLEN];
    for (;;) {
        if (o->once && atomic_load(&w.sessions) > 0) break;
        refuse_flush(&w);
        lk_link *l;
        uint8_t hello[LK_AUTH_STATE];
        lk_status st = lk_gate_next(gate, lk_deadline_ms(200), &l, hello, why, sizeof why);
        if (st) {
            if (st != LK_ERR_TIMEOUT) {
                lk_log(LK_LOG_WARN, "worker: %s", why);
                usleep(100000);
            }
            continue;
        }
        if (o->once) {
            /* A --local child: its head is the only client; no threads. */
            serve_conn(&w, l, hello);
            continue;
        }
        /* Only a peer that sent a proof gets here, and checking it takes
         * no wait: the threads are few and short unless a head holds them. */
        if (atomic_load(&w.handshakes) >= MAX_HANDSHAKES) {
            lk_gate_refuse(gate, l, LK_GATE_BUSY);
            continue;
        }
        conn_arg *a = lk_xmalloc(sizeof *a);
        a->w = &w;
        a->link = l;
        memcpy(a->hello, hello, sizeof a->hello);
        atomic_fetch_add(&w.handshakes, 1);
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, conn_main, a)) {
            atomic_fetch_sub(&w.handshakes, 1);
            lk_gate_refuse(gate, l, LK_GATE_BUSY);
            free(a);
        }
        pthread_attr_destroy(&at);
    }
    lk_gate_free(gate);
    if (own) close(lfd);
    return LK_OK;
}
