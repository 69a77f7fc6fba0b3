/* The cluster end to end with real processes on 127.0.0.1: a head (this
 * process) and forked workers run stories260K split by tensor parallelism,
 * and the logits must match the one-node forward pass; then failures: a
 * worker killed, a worker frozen (SIGSTOP), a slow head; a worker daemon that
 * outlives a vanished head and bad clients and serves the next head. */
#include "lk_test.h"
#include "cluster/cluster.h"
#include "cluster/proto.h"
#include "model/model.h"
#include "sampler/sampler.h"

#include <math.h>
#include <glob.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const int32_t toks[6] = {1, 403, 301, 52, 7, 99};
#define NV_MAX 512

typedef struct {
    lk_gguf *g;
    lk_model_config cfg;
    lk_plan_dims dims;
    float ref[2][NV_MAX]; /* one-node logits after toks[0..5) and after toks[5] */
} fixture;

static fixture F;

static bool fixture_open(void) {
    char err[LK_ERRLEN];
    if (lk_gguf_open(lk_td("models/stories260K.gguf"), &F.g, err, sizeof err) ||
        lk_model_config_read(F.g, &F.cfg, err, sizeof err)) {
        printf("  %s\n", err);
        return false;
    }
    lk_model_plan_dims(F.g, &F.cfg, &F.dims);
    lk_model_params mp = {.n_ctx = 64, .n_batch = 8, .n_threads = 1};
    lk_model *m;
    if (lk_model_load(F.g, NULL, &mp, &m, err, sizeof err)) { printf("  %s\n", err); return false; }
    bool ok = F.cfg.n_vocab <= NV_MAX && !lk_model_forward(m, toks, 5, 0, 1, F.ref[0]) &&
              !lk_model_forward(m, toks + 5, 1, 5, 1, F.ref[1]);
    lk_model_free(m);
    return ok;
}

/* One head-side step: tell the workers, run our slice, gather everyone's
 * candidates, and rebuild the full logits row from them. */
static lk_status cluster_step_pen(lk_cluster *c, lk_model *m, const int32_t *t, int n, int pos0, float *full,
                                  const lk_cluster_penalties *pen, lk_sampler *head_pen, char *err) {
    int nv = (int)F.cfg.n_vocab, N = lk_cluster_n_ranks(c);
    static float mine[NV_MAX], vals[NV_MAX], allv[8 * NV_MAX];
    static int32_t ids[NV_MAX], alli[8 * NV_MAX];
    lk_status st = lk_cluster_step(c, t, n, pos0, nv, pen, err, LK_ERRLEN);
    if (st) return st;
    if ((st = lk_model_forward(m, t, n, pos0, 1, mine))) {
        snprintf(err, LK_ERRLEN, "%s", lk_cluster_error(c));
        return st;
    }
    const lk_slice *sl = lk_model_slice(m);
    if (head_pen) lk_sampler_penalize(head_pen, mine, sl->vocab0, sl->vocab1 - sl->vocab0);
    int got = lk_sampler_top(mine, sl->vocab0, sl->vocab1 - sl->vocab0, ids, vals, nv);
    for (int i = got; i < nv; i++) ids[i] = -1, vals[i] = 0;
    if ((st = lk_cluster_gather(c, ids, vals, nv, alli, allv, err, LK_ERRLEN))) return st;
    for (int i = 0; i < nv; i++) full[i] = NAN;
    for (int i = 0; i < N * nv; i++)
        if (alli[i] >= 0 && alli[i] < nv) full[alli[i]] = allv[i];
    return LK_OK;
}

static lk_status cluster_step(lk_cluster *c, lk_model *m, const int32_t *t, int n, int pos0, float *full,
                              char *err) {
    return cluster_step_pen(c, m, t, n, pos0, full, NULL, NULL, err);
}

static int g_batch = 8;

static lk_status open_head(lk_cluster_opts *o, lk_cluster **c, lk_model **m, char *err) {
    lk_slice sl;
    o->model_path = lk_gguf_path(F.g);
    o->n_ctx = 64;
    o->n_batch = g_batch;
    o->n_threads = 1;
    lk_status st = lk_cluster_open(o, F.g, &F.dims, c, &sl, err, LK_ERRLEN);
    if (st) return st;
    lk_model_params mp = {.n_ctx = 64, .n_batch = g_batch, .n_threads = 1};
    if ((st = lk_model_load(F.g, &sl, &mp, m, err, LK_ERRLEN))) { lk_cluster_close(*c); return st; }
    lk_tp_hooks h;
    lk_cluster_hooks(*c, &h);
    lk_model_set_hooks(*m, &h);
    return LK_OK;
}

static int compare(const float *got, const float *ref, int nv, double *maxd) {
    int bad = 0, ag = 0, ar = 0;
    *maxd = 0;
    for (int i = 0; i < nv; i++) {
        if (isnan(got[i])) { bad++; continue; }
        double d = fabs(got[i] - ref[i]);
        if (d > *maxd) *maxd = d;
        if (d > 1e-3 + 1e-4 * fabs(ref[i])) bad++;
        if (got[i] > got[ag]) ag = i;
        if (ref[i] > ref[ar]) ar = i;
    }
    return bad + (ag != ar);
}

TEST(tp_matches_one_node) {
    for (int N = 2; N <= 3; N++) {
        const char *tr[2] = {"auto", "tcp"};
        for (int k = 0; k < 2; k++) {
            lk_cluster_opts o = {.local = N, .transport = tr[k]};
            lk_cluster *c;
            lk_model *m;
            char err[LK_ERRLEN];
            lk_status st = open_head(&o, &c, &m, err);
            CHECKF(st == LK_OK, "N=%d: %s", N, err);
            if (st) continue;
            float full[NV_MAX];
            double d;
            st = cluster_step(c, m, toks, 5, 0, full, err);
            CHECKF(st == LK_OK, "%s", err);
            int bad = compare(full, F.ref[0], (int)F.cfg.n_vocab, &d);
            CHECKF(!st && bad == 0, "N=%d %s prefill: %d bad, max diff %g", N, tr[k], bad, d);
            st = cluster_step(c, m, toks + 5, 1, 5, full, err); /* decode: uses every rank's KV cache */
            bad = compare(full, F.ref[1], (int)F.cfg.n_vocab, &d);
            CHECKF(!st && bad == 0, "N=%d %s decode: %d bad, max diff %g", N, tr[k], bad, d);
            lk_model_free(m);
            lk_cluster_close(c);
        }
    }
}

TEST(uneven_weights) {
    lk_cluster_opts o = {.local = 3, .tp_weights = "2,1,1"};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); return; }
    CHECK(lk_model_slice(m)->head1 - lk_model_slice(m)->head0 == 4);
    float full[NV_MAX];
    double d = 0;
    lk_status st = cluster_step(c, m, toks, 5, 0, full, err);
    CHECKF(!st && compare(full, F.ref[0], (int)F.cfg.n_vocab, &d) == 0, "%s max diff %g", st ? err : "", d);
    lk_model_free(m);
    lk_cluster_close(c);
}

/* Compact all-reduce wire formats end to end: the logits move by the
 * rounding of the partial sums; the size of that effect is printed. */
TEST(wire_formats_accuracy) {
    const char *w[3] = {"f16", "bf16", "q8"};
    const double tol[3] = {0.02, 0.1, 0.2}; /* logits of stories260K span about +-15 */
    for (int k = 0; k < 3; k++) {
        lk_cluster_opts o = {.local = 2, .wire = w[k]};
        lk_cluster *c;
        lk_model *m;
        char err[LK_ERRLEN];
        if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); continue; }
        float full[NV_MAX];
        double d = 0, d2 = 0;
        lk_status st = cluster_step(c, m, toks, 5, 0, full, err);
        if (!st) compare(full, F.ref[0], (int)F.cfg.n_vocab, &d);
        bool same_top = true;
        if (!st) st = cluster_step(c, m, toks + 5, 1, 5, full, err);
        if (!st) {
            compare(full, F.ref[1], (int)F.cfg.n_vocab, &d2);
            int ag = 0, ar = 0;
            for (int i = 0; i < F.cfg.n_vocab; i++) {
                if (full[i] > full[ag]) ag = i;
                if (F.ref[1][i] > F.ref[1][ar]) ar = i;
            }
            same_top = ag == ar;
        }
        printf("  wire %-4s tp 2: max |logit - one node| %.4f (prefill), %.4f (decode); same argmax: %s\n", w[k], d, d2,
               same_top ? "yes" : "no");
        CHECKF(!st && d <= tol[k] && d2 <= tol[k], "%s: %s", w[k], st ? err : "too far");
        lk_model_free(m);
        lk_cluster_close(c);
    }
}

/* Sampling penalties applied by every rank to its own vocabulary rows give
 * exactly the one-node penalised logits. */
TEST(penalties_match_one_node) {
    lk_cluster_opts o = {.local = 3};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); return; }
    /* the window: tokens of every rank's vocabulary slice, some repeated */
    int32_t hist[8] = {403, 301, 52, 7, 99, 403, 500, 2};
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    sp.repeat_penalty = 1.3f;
    sp.freq_penalty = 0.2f;
    sp.presence_penalty = -0.4f; /* negative: raises logits, so candidates must be chosen after penalising */
    sp.penalty_last_n = 8;
    lk_sampler *s = lk_sampler_create(&sp);
    for (int i = 0; i < 8; i++) lk_sampler_accept(s, hist[i]);
    lk_cluster_penalties pen = {sp.repeat_penalty, sp.freq_penalty, sp.presence_penalty, hist, 8};
    float full[NV_MAX], ref[NV_MAX];
    lk_status st = cluster_step_pen(c, m, toks, 5, 0, full, &pen, s, err);
    memcpy(ref, F.ref[0], sizeof ref);
    lk_sampler_penalize(s, ref, 0, F.cfg.n_vocab);
    double d = 0;
    CHECKF(!st && compare(full, ref, (int)F.cfg.n_vocab, &d) == 0, "%s max diff %g", st ? err : "", d);
    double bite = 0; /* the penalties did change something */
    for (int i = 0; i < 8; i++) bite = fmax(bite, fabs(ref[hist[i]] - F.ref[0][hist[i]]));
    CHECKF(bite > 0.05, "largest change %g", bite);
    lk_sampler_free(s);
    lk_model_free(m);
    lk_cluster_close(c);
}

/* lk_cluster_forward, the engine's entry point: a prompt longer than the
 * batch (three STEPs), then a decode step; the merged candidates are the
 * one-node top 10 in order. */
TEST(forward_candidates) {
    g_batch = 2;
    lk_cluster_opts o = {.local = 3};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    lk_status st = open_head(&o, &c, &m, err);
    g_batch = 8;
    if (st) { CHECKF(0, "%s", err); return; }
    for (int step = 0; step < 2; step++) {
        int32_t ids[10], rids[10];
        float vals[10], rvals[10];
        int got = 0;
        st = step == 0 ? lk_cluster_forward(c, m, toks, 5, 0, 10, NULL, ids, vals, &got, err, sizeof err)
                       : lk_cluster_forward(c, m, toks + 5, 1, 5, 10, NULL, ids, vals, &got, err, sizeof err);
        CHECKF(st == LK_OK && got == 10, "%s", err);
        int rn = lk_sampler_top(F.ref[step], 0, F.cfg.n_vocab, rids, rvals, 10);
        int bad = 0;
        for (int i = 0; i < rn && i < got; i++) bad += ids[i] != rids[i] || fabsf(vals[i] - rvals[i]) > 1e-3f;
        CHECKF(bad == 0, "step %d: %d of the top 10 differ (first: %d vs %d)", step, bad, ids[0], rids[0]);
    }
    lk_model_free(m);
    lk_cluster_close(c);
}

/* Pipeline stages, alone and combined with TP: the full candidate list
 * (every vocabulary row) rebuilds the one-node logits. */
TEST(pipeline_matches_one_node) {
    struct { int local, tp, pp; const char *split; } L[3] = {{2, 1, 2, NULL}, {3, 1, 3, "1,1,3"}, {4, 2, 2, "3,2"}};
    for (int k = 0; k < 3; k++) {
        g_batch = 2;
        lk_cluster_opts o = {.local = L[k].local, .tp = L[k].tp, .pp = L[k].pp, .layers_split = L[k].split};
        lk_cluster *c;
        lk_model *m;
        char err[LK_ERRLEN];
        lk_status st = open_head(&o, &c, &m, err);
        g_batch = 8;
        if (st) { CHECKF(0, "tp %d pp %d: %s", L[k].tp, L[k].pp, err); continue; }
        int nv = (int)F.cfg.n_vocab;
        static int32_t ids[NV_MAX];
        static float vals[NV_MAX], full[NV_MAX];
        for (int step = 0; step < 2; step++) {
            int got = 0;
            st = step == 0 ? lk_cluster_forward(c, m, toks, 5, 0, nv, NULL, ids, vals, &got, err, sizeof err)
                           : lk_cluster_forward(c, m, toks + 5, 1, 5, nv, NULL, ids, vals, &got, err, sizeof err);
            for (int i = 0; i < nv; i++) full[i] = NAN;
            for (int i = 0; i < got; i++) full[ids[i]] = vals[i];
            double d = 0;
            CHECKF(!st && got == nv && compare(full, F.ref[step], nv, &d) == 0, "tp %d pp %d step %d: %s (max diff %g)",
                   L[k].tp, L[k].pp, step, st ? err : "", d);
        }
        lk_model_free(m);
        lk_cluster_close(c);
    }
}

/* A worker killed mid-session: the next step fails fast and names it. */
TEST(killed_worker_named) {
    lk_cluster_opts o = {.local = 3, .dead_after_ms = 1000};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); return; }
    float full[NV_MAX];
    CHECK(cluster_step(c, m, toks, 5, 0, full, err) == LK_OK);
    kill(lk_cluster_local_pid(c, 2), SIGKILL);
    uint64_t t0 = lk_time_ns();
    lk_status st = cluster_step(c, m, toks + 5, 1, 5, full, err);
    double s = (double)(lk_time_ns() - t0) / 1e9;
    CHECK(st != LK_OK);
    CHECKF(s < 2.0, "took %.2f s", s);
    /* the dead one is named first, not the survivor that reported it */
    CHECKF(!strncmp(lk_cluster_error(c), "lost worker rank 2 (127.0.0.1:", 30), "%s", lk_cluster_error(c));
    lk_model_free(m);
    lk_cluster_close(c);
}

/* A frozen worker (alive socket, no answers): declared dead by heartbeats
 * within dead_after, and the blocked all-reduce is cut off. */
TEST(frozen_worker_named) {
    lk_cluster_opts o = {.local = 2, .dead_after_ms = 1000};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); return; }
    float full[NV_MAX];
    CHECK(cluster_step(c, m, toks, 5, 0, full, err) == LK_OK);
    int pid = lk_cluster_local_pid(c, 1);
    kill(pid, SIGSTOP);
    uint64_t t0 = lk_time_ns();
    lk_status st = cluster_step(c, m, toks + 5, 1, 5, full, err);
    double s = (double)(lk_time_ns() - t0) / 1e9;
    CHECK(st != LK_OK);
    CHECKF(s < 2.0, "took %.2f s", s);
    CHECKF(strstr(lk_cluster_error(c), "worker rank 1 (127.0.0.1:") &&
           strstr(lk_cluster_error(c), "stopped answering heartbeats") && strstr(lk_cluster_error(c), "all-reduce layer"),
           "%s", lk_cluster_error(c));
    kill(pid, SIGKILL);
    lk_model_free(m);
    lk_cluster_close(c);
}

/* Workers that wait a long time on a slow head are not declared dead (and
 * do not declare the head dead): heartbeats flow while compute waits. */
TEST(slow_is_not_dead) {
    lk_cluster_opts o = {.local = 2, .dead_after_ms = 500};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); return; }
    int32_t t[5];
    memcpy(t, toks, sizeof t);
    CHECK(lk_cluster_step(c, t, 5, 0, 0, NULL, err, sizeof err) == LK_OK);
    usleep(1500000); /* the worker sits in its first all-reduce for 1.5 s */
    float logits[NV_MAX];
    lk_status st = lk_model_forward(m, t, 5, 0, 0, logits);
    CHECKF(st == LK_OK, "%s", lk_cluster_error(c));
    float full[NV_MAX];
    double d = 0;
    st = cluster_step(c, m, toks + 5, 1, 5, full, err);
    CHECKF(!st && compare(full, F.ref[1], (int)F.cfg.n_vocab, &d) == 0, "%s", st ? err : "");
    lk_model_free(m);
    lk_cluster_close(c);
}

/* ---- a long-running worker daemon ------------------------------------------------ */

static const char *key_path(void) {
    static char p[128]; /* fixed by the first (parent) call: children share it */
    if (!p[0]) snprintf(p, sizeof p, "/tmp/lk-test-cluster-%d.key", (int)getpid());
    return p;
}

TEST(daemon_survives_heads_and_garbage) {
    char hex[65], err[LK_ERRLEN];
    lk_key_generate(hex);
    FILE *f = fopen(key_path(), "w");
    fprintf(f, "%s\n", hex);
    fclose(f);
    uint8_t key[32];
    LK_ASSERT(!lk_key_load(key_path(), key, err, sizeof err));
    int lfd, port;
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd, &port, err, sizeof err));
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    fflush(NULL);
    pid_t daemon = fork();
    if (daemon == 0) {
        lk_log_set_level(LK_LOG_ERROR);
        lk_worker_opts wo = {.listen_fd = lfd, .key = key, .n_threads = 1, .head_silence_ms = 1000};
        lk_worker_serve(&wo, err, sizeof err);
        _exit(1);
    }
    close(lfd);

    /* 1. a head that vanishes mid-session (killed right after a step) */
    pid_t head = fork();
    if (head == 0) {
        lk_cluster_opts o = {.workers = addr, .key_file = key_path()};
        lk_cluster *c;
        lk_model *m;
        if (open_head(&o, &c, &m, err)) { fprintf(stderr, "head child: %s\n", err); _exit(2); }
        float full[NV_MAX];
        if (cluster_step(c, m, toks, 5, 0, full, err)) _exit(3);
        kill(getpid(), SIGKILL);
    }
    int ws;
    waitpid(head, &ws, 0);
    CHECKF(WIFSIGNALED(ws), "head child ended with %d", ws);

    /* 2. garbage, a wrong key, and a stalled half frame left open */
    lk_link *g1, *g2, *stall;
    CHECK(!lk_tcp_connect(addr, lk_deadline_ms(2000), &g1, err, sizeof err));
    lk_link_send(g1, "garbage garbage garbage!", 24, lk_deadline_ms(500), err, sizeof err);
    CHECK(!lk_tcp_connect(addr, lk_deadline_ms(2000), &stall, err, sizeof err));
    lk_link_send(stall, "LKW1\x01\x00", 6, lk_deadline_ms(500), err, sizeof err);
    CHECK(!lk_tcp_connect(addr, lk_deadline_ms(2000), &g2, err, sizeof err));
    uint8_t wrong[32] = {1};
    lk_hs_params hp;
    lk_hs_defaults(&hp, wrong, "head");
    lk_chan ch;
    lk_chan_init(&ch, g2);
    lk_hs_peer peer;
    CHECK(lk_handshake(&ch, true, &hp, &peer, err, sizeof err) == LK_ERR_AUTH);

    /* 3. the next head is served at once, the stalled client still open */
    uint64_t t0 = lk_time_ns();
    lk_cluster_opts o = {.workers = addr, .key_file = key_path()};
    lk_cluster *c;
    lk_model *m;
    lk_status st = open_head(&o, &c, &m, err);
    CHECKF(st == LK_OK, "%s", err);
    if (!st) {
        CHECKF((double)(lk_time_ns() - t0) / 1e9 < 3.0, "the next head waited %.1f s", (double)(lk_time_ns() - t0) / 1e9);
        float full[NV_MAX];
        double d = 0;
        st = cluster_step(c, m, toks, 5, 0, full, err);
        CHECKF(!st && compare(full, F.ref[0], (int)F.cfg.n_vocab, &d) == 0, "%s", st ? err : "");
        /* 4. a second head while this one is served: refused as busy */
        lk_cluster_opts o2 = {.workers = addr, .key_file = key_path()};
        lk_cluster *c2;
        lk_model *m2;
        st = open_head(&o2, &c2, &m2, err);
        CHECKF(st != LK_OK && strstr(err, "busy"), "%s", err);
        lk_model_free(m);
        lk_cluster_close(c);
    }

    /* 5. a head that freezes in the middle of a step (the worker sits in an
     * all-reduce waiting for it): the worker gives up after its silence
     * limit (1 s here) and serves the next head */
    pid_t frozen = fork();
    if (frozen == 0) {
        lk_cluster_opts o3 = {.workers = addr, .key_file = key_path()};
        lk_cluster *c3;
        lk_model *m3;
        if (open_head(&o3, &c3, &m3, err)) _exit(2);
        int32_t t[5];
        memcpy(t, toks, sizeof t);
        lk_cluster_step(c3, t, 5, 0, 0, NULL, err, sizeof err);
        raise(SIGSTOP); /* never runs its own share */
        _exit(0);
    }
    waitpid(frozen, &ws, WUNTRACED);
    t0 = lk_time_ns();
    st = LK_ERR_PEER;
    while (st && (double)(lk_time_ns() - t0) / 1e9 < 6.0) {
        lk_cluster_opts o4 = {.workers = addr, .key_file = key_path()};
        st = open_head(&o4, &c, &m, err);
        if (st) usleep(200000);
    }
    double waited = (double)(lk_time_ns() - t0) / 1e9;
    CHECKF(st == LK_OK && waited < 3.0, "after a frozen head: %s (%.1f s)", st ? err : "ok", waited);
    if (!st) {
        lk_model_free(m);
        lk_cluster_close(c);
    }
    kill(frozen, SIGKILL);
    waitpid(frozen, &ws, 0);
    lk_link_close(g1);
    lk_link_close(g2);
    lk_link_close(stall);
    kill(daemon, SIGKILL);
    waitpid(daemon, &ws, 0);
    unlink(key_path());
}

/* A worker without the model but with a cache: the head sends the file,
 * the worker verifies and caches it, and the next head finds it there. A
 * worker with neither refuses with a clear message. */
TEST(daemon_model_cache) {
    char dir[64], cache[96], models[96], err[LK_ERRLEN];
    snprintf(dir, sizeof dir, "/tmp/lk-cache-test-%d", (int)getpid());
    snprintf(cache, sizeof cache, "%s/cache", dir);
    snprintf(models, sizeof models, "%s/models", dir);
    mkdir(dir, 0700);
    mkdir(cache, 0700);
    mkdir(models, 0700);
    char hex[65];
    lk_key_generate(hex);
    FILE *f = fopen(key_path(), "w");
    fprintf(f, "%s\n", hex);
    fclose(f);
    uint8_t key[32];
    LK_ASSERT(!lk_key_load(key_path(), key, err, sizeof err));
    int lfd[2], port[2];
    pid_t d[2];
    char addr[2][32];
    for (int k = 0; k < 2; k++) {
        LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &lfd[k], &port[k], err, sizeof err));
        snprintf(addr[k], sizeof addr[k], "127.0.0.1:%d", port[k]);
        fflush(NULL);
        d[k] = fork();
        if (d[k] == 0) {
            lk_worker_opts wo = {.listen_fd = lfd[k], .key = key, .n_threads = 1, .model_dir = models,
                                 .cache_dir = k == 0 ? cache : NULL};
            lk_worker_serve(&wo, err, sizeof err);
            _exit(1);
        }
        close(lfd[k]);
    }
    uint8_t id[32];
    lk_cluster_model_id(F.g, id);
    char cached[256], pattern[256];
    int n = snprintf(pattern, sizeof pattern, "%s/", cache);
    for (int i = 0; i < 32; i++) n += snprintf(pattern + n, sizeof pattern - (size_t)n, "%02x", id[i]);
    snprintf(pattern + n, sizeof pattern - (size_t)n, "-*.gguf"); /* <identity>-<layout>.gguf: a sparse copy */
    snprintf(cached, sizeof cached, "%s", pattern);
    struct stat sb1, sb2;
    for (int round = 0; round < 2; round++) {
        lk_cluster_opts o = {.workers = addr[0], .key_file = key_path()};
        lk_cluster *c;
        lk_model *m;
        lk_status st = open_head(&o, &c, &m, err);
        CHECKF(st == LK_OK, "round %d: %s", round, err);
        if (st) break;
        float full[NV_MAX];
        double dd = 0;
        st = cluster_step(c, m, toks, 5, 0, full, err);
        CHECKF(!st && compare(full, F.ref[0], (int)F.cfg.n_vocab, &dd) == 0, "round %d: %s", round, st ? err : "");
        lk_model_free(m);
        lk_cluster_close(c);
        glob_t gl;
        if (glob(pattern, 0, NULL, &gl) == 0 && gl.gl_pathc == 1) snprintf(cached, sizeof cached, "%s", gl.gl_pathv[0]);
        globfree(&gl);
        CHECKF(stat(cached, round ? &sb2 : &sb1) == 0, "no %s", cached);
    }
    /* the second head used the cached copy: not written again (a new copy
     * would be a new file renamed over it; reuse touches its mtime) */
    CHECK(sb1.st_ino == sb2.st_ino && sb1.st_size == (off_t)lk_gguf_file_size(F.g));
    lk_cluster_opts o = {.workers = addr[1], .key_file = key_path()};
    lk_cluster *c;
    lk_model *m;
    lk_status st = open_head(&o, &c, &m, err);
    CHECKF(st == LK_ERR_PEER && strstr(err, "cannot load the model") && strstr(err, "stories260K.gguf"), "%s", err);
    for (int k = 0; k < 2; k++) {
        int ws;
        kill(d[k], SIGKILL);
        waitpid(d[k], &ws, 0);
    }
    unlink(cached);
    snprintf(cached + strlen(cached) - 5, 6, ".meta");
    unlink(cached);
    rmdir(cache);
    rmdir(models);
    rmdir(dir);
    unlink(key_path());
}

/* LOAD messages: a slice with no heads (or no FFN rows) is legal, one with
 * neither, or KV heads without query heads, or a path for a name, is
 * refused; so is every truncation. */
TEST(load_message_validation) {
    lk_load_msg L = {.rank = 1, .n_ranks = 2, .tp = 2, .n_ctx = 64, .n_batch = 8};
    L.slice = (lk_slice){.tp_rank = 1, .tp_size = 2, .pp_size = 1, .layer1 = 5, .head0 = 8, .head1 = 8,
                         .kv_head0 = 4, .kv_head1 = 4, .ff0 = 0, .ff1 = 172, .vocab0 = 256, .vocab1 = 512};
    snprintf(L.model_name, sizeof L.model_name, "m.gguf");
    uint8_t buf[4096];
    lk_load_msg back;
    uint32_t n = lk_proto_load_encode(&L, buf, sizeof buf);
    CHECK(lk_proto_load_decode(buf, n, &back) && back.slice.head0 == 8 && back.slice.ff1 == 172);
    int bad = 0;
    for (uint32_t k = 0; k < n; k++) bad += lk_proto_load_decode(buf, k, &back); /* every truncation */
    CHECK(bad == 0);
    L.slice.ff1 = 0; /* no heads and no FFN rows: nothing to do */
    n = lk_proto_load_encode(&L, buf, sizeof buf);
    CHECK(!lk_proto_load_decode(buf, n, &back));
    L.slice.ff1 = 172;
    L.slice.kv_head1 = 5; /* KV heads without query heads */
    n = lk_proto_load_encode(&L, buf, sizeof buf);
    CHECK(!lk_proto_load_decode(buf, n, &back));
    L.slice.kv_head1 = 4;
    snprintf(L.model_name, sizeof L.model_name, "../etc/passwd");
    n = lk_proto_load_encode(&L, buf, sizeof buf);
    CHECK(!lk_proto_load_decode(buf, n, &back));
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    lk_log_set_level(LK_LOG_ERROR);
    if (!fixture_open()) {
        printf("FAIL fixture\n");
        return 1;
    }
    RUN(load_message_validation);
    RUN(tp_matches_one_node);
    RUN(uneven_weights);
    RUN(wire_formats_accuracy);
    RUN(penalties_match_one_node);
    RUN(forward_candidates);
    RUN(pipeline_matches_one_node);
    RUN(killed_worker_named);
    RUN(frozen_worker_named);
    RUN(slow_is_not_dead);
    RUN(daemon_survives_heads_and_garbage);
    RUN(daemon_model_cache);
    lk_gguf_close(F.g);
    return lk_test_end();
}
