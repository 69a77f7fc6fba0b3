/* The worker daemon: accepts heads, one session at a time, and runs its
 * slice of the model for them (message sequence in cluster.h).
 *
 * Threads: the accept loop hands every connection to a short-lived thread
 * that runs the handshake (so a client that stalls mid-handshake delays
 * nobody); the thread that wins the session runs it; a heartbeat thread per
 * session sends PING every 250 ms, so the head hears from us even while a
 * long prefill keeps the session thread busy. */
#include "cluster/proto.h"
#include "model/model.h"
#include "sampler/sampler.h"

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
#include <netdb.h>
#include <time.h>
#include <unistd.h>

#define MAX_HANDSHAKES 16
#define MAX_CAND 65536

typedef struct {
    const lk_worker_opts *o;
    atomic_int busy;        /* a session is running */
    atomic_int handshakes;  /* connection threads alive */
    atomic_int sessions;    /* sessions run (once: stop after the first) */
} worker;

typedef struct {
    worker *w;
    lk_link *link;
    lk_chan ch;
    pthread_mutex_t send_mu;   /* heartbeat thread and session thread both send */
    pthread_mutex_t hb_mu;
    pthread_cond_t hb_cv;
    bool hb_stop;
    pthread_t hb;
    char head[96];
    /* loaded state */
    lk_load_msg load;
    lk_gguf *g;
    lk_model *m;
    int mesh_lfd;
    lk_mesh *mesh;
    lk_comm *comm;
    float *logits;          /* (vocab1 - vocab0) */
    int32_t *ids;           /* (MAX_CAND) */
    float *vals;            /* (MAX_CAND) */
    uint8_t *pairs;         /* (MAX_CAND * 8): gathered to rank 0 */
    lk_sampler *pen;        /* applies the head's penalties to our slice */
    _Atomic uint64_t step_since; /* lk_time_ns when the current STEP began; 0 between steps */
    bool bench;             /* a netbench session: mesh only, no model */
    bool want_file;         /* asked the head for the model file */
    int file_fd;            /* the cache file being received (-1: none) */
    uint64_t file_left;
    lk_bench_msg bmsg;
    lk_sampler_params pen_p;
} session;

/* Messages from the link already start with the peer's address; when we
 * name the peer ourselves, drop that prefix. */
static const char *unprefixed(const char *msg, const char *name) {
    size_t n = strlen(name);
    return !strncmp(msg, name, n) && msg[n] == ':' && msg[n + 1] == ' ' ? msg + n + 2 : msg;
}

static lk_status send_locked(session *s, uint16_t type, const void *p, uint32_t len, char *err, size_t errlen) {
    pthread_mutex_lock(&s->send_mu);
    lk_status st = lk_chan_send(&s->ch, type, p, len, lk_deadline_ms(5000), err, errlen);
    pthread_mutex_unlock(&s->send_mu);
    return st;
}

/* While the session thread computes a STEP it reads nothing, so a head that
 * froze (or lost its network) would keep it in a collective until that
 * deadline. The head pings every 500 ms; if no new byte reaches the control
 * socket for head_silence_ms during a step, cut our sockets so the step
 * fails now and the session ends. */
static void watch_head(session *s, int *last_avail, uint64_t *last_news) {
    uint64_t since = atomic_load(&s->step_since), now = lk_time_ns();
    int fd = lk_tcp_fd(s->link), avail = 0;
    if (!since) { *last_news = now; *last_avail = -1; return; }
    if (ioctl(fd, FIONREAD, &avail) == 0 && avail != *last_avail) { *last_avail = avail; *last_news = now; }
    int64_t silence = s->w->o->head_silence_ms > 0 ? s->w->o->head_silence_ms : 10000;
    if ((int64_t)(now - *last_news) < silence * 1000000) return;
    lk_log(LK_LOG_WARN, "worker: head %s silent for %lld ms during a step: abandoning it", s->head, (long long)silence);
    shutdown(fd, SHUT_RDWR);
    for (int r = 0; s->mesh && r < lk_mesh_size(s->mesh); r++)
        if (r != lk_mesh_rank(s->mesh)) shutdown(lk_tcp_fd(lk_mesh_ctl(s->mesh, r)), SHUT_RDWR);
    *last_news = now;
}

static void *heartbeat_main(void *p) {
    session *s = p;
    uint64_t k = 0, last_news = lk_time_ns();
    int last_avail = -1;
    pthread_mutex_lock(&s->hb_mu);
    while (!s->hb_stop) {
        pthread_mutex_unlock(&s->hb_mu);
        watch_head(s, &last_avail, &last_news);
        uint8_t b[8];
        for (int i = 0; i < 8; i++) b[i] = (uint8_t)(k >> (8 * i));
        k++;
        char err[LK_ERRLEN];
        if (send_locked(s, LK_MSG_PING, b, 8, err, sizeof err)) {
            pthread_mutex_lock(&s->hb_mu);
            break; /* the session thread will notice the dead connection too */
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_mutex_lock(&s->hb_mu);
        if (!s->hb_stop) pthread_cond_timedwait(&s->hb_cv, &s->hb_mu, &ts);
    }
    pthread_mutex_unlock(&s->hb_mu);
    return NULL;
}

static void cache_path(session *s, char *buf, size_t len, const char *suffix);

static void session_free_model(session *s) {
    if (s->file_fd >= 0) {
        /* an interrupted transfer leaves nothing behind */
        char part[1400];
        cache_path(s, part, sizeof part, ".part");
        close(s->file_fd);
        unlink(part);
        s->file_fd = -1;
    }
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
    free(s->logits); s->logits = NULL;
    free(s->ids); s->ids = NULL;
    free(s->vals); s->vals = NULL;
    free(s->pairs); s->pairs = NULL;
    lk_sampler_free(s->pen); s->pen = NULL;
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
        char a[40], b[40];
        lk_gguf_close(s->g);
        s->g = NULL;
        return lk_fail(err, errlen, LK_ERR_MISMATCH, "model mismatch: head has %s, worker has %s (%s)",
                       lk_cluster_model_id_short(s->load.model_id, a, sizeof a), lk_cluster_model_id_short(id, b, sizeof b), path);
    }
    return LK_OK;
}

static void cache_path(session *s, char *buf, size_t len, const char *suffix) {
    char hex[2 * LK_MODEL_ID_BYTES + 1];
    for (int i = 0; i < LK_MODEL_ID_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", s->load.model_id[i]);
    snprintf(buf, len, "%s/%s.gguf%s", s->w->o->cache_dir, hex, suffix);
}

/* With the model open in s->g: the slice, the buffers, the mesh listener. */
static lk_status finish_load(session *s, const char *path, lk_loaded_msg *rep, char *err, size_t errlen) {
    const lk_load_msg *L = &s->load;
    lk_model_params mp = {.n_ctx = L->n_ctx, .n_batch = L->n_batch, .kv_f16 = L->kv_f16,
                          .n_threads = s->w->o->n_threads ? s->w->o->n_threads : L->n_threads};
    lk_status st = lk_model_load(s->g, &L->slice, &mp, &s->m, err, errlen);
    if (st) return st;
    const lk_slice *sl = lk_model_slice(s->m);
    s->logits = lk_xmalloc(sizeof(float) * (size_t)(sl->vocab1 - sl->vocab0));
    s->ids = lk_xmalloc(sizeof(int32_t) * MAX_CAND);
    s->vals = lk_xmalloc(sizeof(float) * MAX_CAND);
    s->pairs = lk_xmalloc(8 * MAX_CAND);
    if ((st = open_mesh_listener(s, rep, err, errlen))) return st;
    lk_log(LK_LOG_INFO, "worker: rank %d of %d loaded %s: layers %d-%d, heads %d-%d, ffn rows %lld-%lld, vocab %lld-%lld",
           L->rank, L->n_ranks, path, sl->layer0, sl->layer1 - 1, sl->head0, sl->head1 - 1, (long long)sl->ff0,
           (long long)sl->ff1 - 1, (long long)sl->vocab0, (long long)sl->vocab1 - 1);
    return LK_OK;
}

/* Finds the head's model: by name in --model-dir (or at the head's path),
 * then in the cache by identity; failing both, with a cache, asks the head
 * for the file (rep->want_file). */
static lk_status do_load(session *s, const uint8_t *p, uint32_t len, lk_loaded_msg *rep, char *err, size_t errlen) {
    if (s->m || s->g || s->bench) return lk_fail(err, errlen, LK_ERR_FORMAT, "LOAD twice in one session");
    if (!lk_proto_load_decode(p, len, &s->load)) return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed LOAD message");
    const lk_load_msg *L = &s->load;
    char path[1400];
    if (s->w->o->model_dir) snprintf(path, sizeof path, "%s/%s", s->w->o->model_dir, L->model_name);
    else snprintf(path, sizeof path, "%s", L->model_path);
    lk_status st = try_model(s, path, err, errlen);
    if (st && s->w->o->cache_dir) {
        char why[LK_ERRLEN];
        cache_path(s, path, sizeof path, "");
        if (try_model(s, path, why, sizeof why)) {
            rep->want_file = 1;
            return lk_fail(err, errlen, LK_ERR_IO, "no copy of the model here (%s): please send it", err);
        }
        st = LK_OK;
    }
    if (st) return st;
    return finish_load(s, path, rep, err, errlen);
}

/* FILE: the head is about to send the model; it goes to <id>.gguf.part in
 * the cache and is renamed once complete and verified. */
static lk_status do_file(session *s, const uint8_t *p, uint32_t len, char *err, size_t errlen) {
    if (!s->want_file || s->file_fd >= 0 || len != 8)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "unexpected FILE message");
    lk_rbuf r = {p, len, 0, true};
    uint64_t size = lk_rb_u64(&r);
    if (size < 8 || size > (1ull << 42)) return lk_fail(err, errlen, LK_ERR_FORMAT, "FILE of %llu bytes", (unsigned long long)size);
    char part[1400];
    cache_path(s, part, sizeof part, ".part");
    s->file_fd = open(part, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
    if (s->file_fd < 0) return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", part, strerror(errno));
    s->file_left = size;
    lk_log(LK_LOG_INFO, "worker: receiving the model from %s (%llu bytes) into %s", s->head, (unsigned long long)size, part);
    return LK_OK;
}

/* DATA: the next bytes. After the last: verify, cache, load. *done says
 * whether the load finished (rep is then the answer to send). */
static lk_status do_data(session *s, const uint8_t *p, uint32_t len, bool *done, lk_loaded_msg *rep, char *err,
                         size_t errlen) {
    *done = false;
    if (s->file_fd < 0 || len > s->file_left) return lk_fail(err, errlen, LK_ERR_FORMAT, "unexpected DATA message");
    for (uint32_t off = 0; off < len;) {
        ssize_t k = write(s->file_fd, p + off, len - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return lk_fail(err, errlen, LK_ERR_IO, "writing the model to the cache: %s", strerror(errno));
        off += (uint32_t)k;
    }
    s->file_left -= len;
    if (s->file_left) return LK_OK;
    *done = true;
    int fd = s->file_fd;
    s->file_fd = -1;
    char part[1400], path[1400];
    cache_path(s, part, sizeof part, ".part");
    cache_path(s, path, sizeof path, "");
    if (fsync(fd) != 0 || close(fd) != 0) {
        unlink(part);
        return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", part, strerror(errno));
    }
    /* Check before it becomes visible under its final name. */
    lk_status st = try_model(s, part, err, errlen);
    if (st) {
        unlink(part);
        return st;
    }
    if (rename(part, path) != 0) return lk_fail(err, errlen, LK_ERR_IO, "%s: %s", path, strerror(errno));
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
    lk_mesh_params mp = {.rank = s->load.rank, .n = mm.n, .addrs = addrs, .listen_fd = s->mesh_lfd,
                         .shm = (lk_mesh_shm)s->load.shm, .spin_ns = s->bench ? s->bmsg.spin_ns : -1,
                         .timeout_ms = 20000, .auth = lk_hs_mesh_auth, .auth_ctx = &hp};
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
    lk_comm_reserve(s->comm, (int64_t)lk_model_n_batch(s->m) * lk_model_cfg(s->m)->n_embd);
    lk_tp_hooks h;
    lk_comm_tp_hooks(s->comm, &h);
    lk_model_set_hooks(s->m, &h);
    return LK_OK;
}

static lk_status do_step(session *s, const uint8_t *p, uint32_t len, char *err, size_t errlen) {
    if (!s->comm) return lk_fail(err, errlen, LK_ERR_FORMAT, "STEP before the mesh is built");
    lk_rbuf r = {p, len, 0, true};
    uint32_t n = lk_rb_u32(&r), pos0 = lk_rb_u32(&r), n_cand = lk_rb_u32(&r), nh = lk_rb_u32(&r);
    uint32_t rb = lk_rb_u32(&r), fb = lk_rb_u32(&r), pb = lk_rb_u32(&r);
    const lk_model_config *cfg = lk_model_cfg(s->m);
    if (!r.ok || n < 1 || n > (uint32_t)lk_model_n_batch(s->m) || nh > LK_CLUSTER_MAX_HIST ||
        len != LK_STEP_HDR + 4 * (n + nh) || (uint64_t)pos0 + n > (uint64_t)lk_model_n_ctx(s->m) || n_cand > MAX_CAND)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed STEP (n %u, pos0 %u, candidates %u)", n, pos0, n_cand);
    /* Ids sit after the 28-byte header, 4-aligned in our buffer. */
    const int32_t *tokens = (const int32_t *)(const void *)(p + LK_STEP_HDR);
    const int32_t *hist = tokens + n;
    for (uint32_t i = 0; i < n + nh; i++)
        if (tokens[i] < 0 || tokens[i] >= cfg->n_vocab)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "STEP token %d outside the vocabulary", tokens[i]);
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    memcpy(&sp.repeat_penalty, &rb, 4);
    memcpy(&sp.freq_penalty, &fb, 4);
    memcpy(&sp.presence_penalty, &pb, 4);
    if (!isfinite(sp.repeat_penalty) || sp.repeat_penalty <= 0 || !isfinite(sp.freq_penalty) ||
        !isfinite(sp.presence_penalty))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed STEP penalties");
    const lk_slice *sl = lk_model_slice(s->m);
    lk_status st;
    if (sl->pp_size == 1) {
        st = lk_model_forward(s->m, tokens, (int)n, (int)pos0, n_cand ? 1 : 0, s->logits);
        if (st) return lk_fail(err, errlen, st, "forward pass at position %u: %s", pos0, lk_comm_last_error(s->comm));
    } else {
        /* A pipeline stage: rows come from the same TP rank of the stage
         * before (or from the tokens), and go on to the next one. */
        float *x = lk_model_hidden(s->m);
        size_t rows = sizeof(float) * (size_t)n * (size_t)cfg->n_embd;
        int me = sl->pp_rank * sl->tp_size + sl->tp_rank;
        char why[LK_ERRLEN] = "";
        if (sl->pp_rank == 0) st = lk_model_embed(s->m, tokens, (int)n, x);
        else st = lk_link_recv(lk_mesh_link(s->mesh, me - sl->tp_size), x, rows, lk_deadline_ms(120000), why, sizeof why);
        if (st) return lk_fail(err, errlen, st, "pipeline stage %d: input rows: %s", sl->pp_rank, why);
        if ((st = lk_model_layers(s->m, x, (int)n, (int)pos0)))
            return lk_fail(err, errlen, st, "forward pass at position %u: %s", pos0, lk_comm_last_error(s->comm));
        if (sl->pp_rank < sl->pp_size - 1) {
            if ((st = lk_link_send(lk_mesh_link(s->mesh, me + sl->tp_size), x, rows, lk_deadline_ms(120000), why,
                                   sizeof why)))
                return lk_fail(err, errlen, st, "pipeline stage %d: passing rows on: %s", sl->pp_rank, why);
            return LK_OK;
        }
        if (!n_cand) return LK_OK;
        if ((st = lk_model_logits(s->m, x, (int)n, 1, s->logits))) return st;
    }
    if (!n_cand) return LK_OK;
    if (nh) {
        /* The one-node sampler's own penalty code on our slice, so the
         * merged candidates are exactly the one-node ones. The sampler is
         * rebuilt only when the penalties change (once per request). */
        if (!s->pen || s->pen_p.repeat_penalty != sp.repeat_penalty || s->pen_p.freq_penalty != sp.freq_penalty ||
            s->pen_p.presence_penalty != sp.presence_penalty) {
            lk_sampler_free(s->pen);
            sp.penalty_last_n = LK_CLUSTER_MAX_HIST;
            s->pen = lk_sampler_create(&sp);
            s->pen_p = sp;
        }
        lk_sampler_reset(s->pen);
        for (uint32_t i = 0; i < nh; i++) lk_sampler_accept(s->pen, hist[i]);
        lk_sampler_penalize(s->pen, s->logits, sl->vocab0, sl->vocab1 - sl->vocab0);
    }
    int got = lk_sampler_top(s->logits, sl->vocab0, sl->vocab1 - sl->vocab0, s->ids, s->vals, (int)n_cand);
    for (uint32_t i = 0; i < n_cand; i++) {
        int32_t id = (int)i < got ? s->ids[i] : -1;
        float v = (int)i < got ? s->vals[i] : 0.0f;
        memcpy(s->pairs + 8 * i, &id, 4);
        memcpy(s->pairs + 8 * i + 4, &v, 4);
    }
    if (sl->pp_size > 1) /* the head is not in the last stage's group: straight to rank 0 */
        return lk_link_send(lk_mesh_link(s->mesh, 0), s->pairs, 8 * (size_t)n_cand, lk_deadline_ms(120000), err, errlen);
    if (lk_comm_gather(s->comm, s->pairs, 8 * n_cand, NULL, 0, "candidates"))
        return lk_fail(err, errlen, LK_ERR_NET, "%s", lk_comm_last_error(s->comm));
    return LK_OK;
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
                lk_log(LK_LOG_INFO, "worker: asking %s for the model: %s", s->head, rep.reason);
            } else if (st) {
                lk_log(LK_LOG_WARN, "worker: LOAD from %s refused: %s", s->head, rep.reason);
            }
            uint8_t out[1024];
            uint32_t n = lk_proto_loaded_encode(&rep, out, sizeof out);
            if (send_locked(s, LK_MSG_LOADED, out, n, err, sizeof err) || (st && !rep.want_file)) break;
            continue;
        }
        if (h.type == LK_MSG_FILE || h.type == LK_MSG_DATA) {
            lk_loaded_msg rep = {0};
            bool done = false;
            st = h.type == LK_MSG_FILE ? do_file(s, buf, h.len, rep.reason, sizeof rep.reason)
                                       : do_data(s, buf, h.len, &done, &rep, rep.reason, sizeof rep.reason);
            if (st) lk_log(LK_LOG_WARN, "worker: receiving the model from %s: %s", s->head, rep.reason);
            if (!st && !done) continue;
            rep.ok = st == LK_OK;
            uint8_t out[1024];
            uint32_t n = lk_proto_loaded_encode(&rep, out, sizeof out);
            if (send_locked(s, LK_MSG_LOADED, out, n, err, sizeof err) || st) break;
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
            if (s->bench) {
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
        if (h.type == LK_MSG_STEP) {
            atomic_store(&s->step_since, lk_time_ns());
            st = do_step(s, buf, h.len, err, sizeof err);
            atomic_store(&s->step_since, 0);
            if (st) {
                lk_log(LK_LOG_WARN, "worker: step for %s failed: %s", s->head, err);
                pthread_mutex_lock(&s->send_mu);
                lk_chan_send_error(&s->ch, err);
                pthread_mutex_unlock(&s->send_mu);
                break;
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
    pthread_join(s->hb, NULL);
    session_free_model(s);
    free(buf);
    lk_log(LK_LOG_INFO, "worker: session with %s over; ready for the next head", s->head);
}

typedef struct {
    worker *w;
    lk_link *link;
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

static void serve_conn(worker *w, lk_link *link) {
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
    lk_hs_params hp;
    lk_hs_defaults(&hp, w->o->key, "worker");
    /* A handshake is a few round trips; a client still mid-way after 3 s is
     * stalled (or hostile), and each one holds a connection thread. */
    hp.timeout_ms = 3000;
    lk_hs_peer peer;
    char err[LK_ERRLEN];
    lk_status st = lk_handshake(&s->ch, false, &hp, &peer, err, sizeof err);
    if (st) {
        lk_log(LK_LOG_WARN, "worker: refused %s: %s", link->peer_addr, unprefixed(err, link->peer_addr));
    } else if (!claim(w)) {
        lk_log(LK_LOG_WARN, "worker: refused %s: busy with another head", link->peer_addr);
        lk_chan_send_error(&s->ch, "worker busy: serving another head");
    } else {
        run_session(s);
        atomic_fetch_add(&w->sessions, 1);
        atomic_store(&w->busy, 0);
    }
    lk_link_close(link);
    pthread_mutex_destroy(&s->send_mu);
    pthread_mutex_destroy(&s->hb_mu);
    pthread_cond_destroy(&s->hb_cv);
    free(s);
}

static void *conn_main(void *p) {
    conn_arg *a = p;
    serve_conn(a->w, a->link);
    atomic_fetch_sub(&a->w->handshakes, 1);
    free(a);
    return NULL;
}

lk_status lk_worker_serve(const lk_worker_opts *o, char *err, size_t errlen) {
    worker w = {.o = o};
    int lfd = o->listen_fd, port = 0;
    bool own = false;
    if (lfd < 0) {
        lk_status st = lk_tcp_listen(o->listen, &lfd, &port, err, errlen);
        if (st) return st;
        own = true;
        lk_log(LK_LOG_INFO, "worker: listening on %s (port %d)", o->listen, port);
    }
    char why[LK_ERRLEN];
    for (;;) {
        if (o->once && atomic_load(&w.sessions) > 0) break;
        lk_link *l;
        if (lk_tcp_accept(lfd, lk_deadline_ms(200), &l, why, sizeof why)) continue;
        if (o->once) {
            /* A --local child: its head is the only client; no threads. */
            serve_conn(&w, l);
            continue;
        }
        if (atomic_load(&w.handshakes) >= MAX_HANDSHAKES) {
            lk_log(LK_LOG_WARN, "worker: refused %s: too many connections in progress", l->peer_addr);
            lk_link_close(l);
            continue;
        }
        conn_arg *a = lk_xmalloc(sizeof *a);
        a->w = &w;
        a->link = l;
        atomic_fetch_add(&w.handshakes, 1);
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, conn_main, a)) {
            atomic_fetch_sub(&w.handshakes, 1);
            lk_link_close(l);
            free(a);
        }
        pthread_attr_destroy(&at);
    }
    if (own) close(lfd);
    return LK_OK;
}
