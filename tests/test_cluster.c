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
#include "step/step.h"

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

/* The head side of a session as the engine runs it: the cluster (life
 * cycle), the head's model slice and the rank step, with slot 0 asking
 * every rank for all its vocabulary rows as candidates, so the merged list
 * rebuilds the full logits row. */
typedef struct {
    lk_model *m;
    lk_cluster *c;
    lk_step *st;
    lk_step_msg msg;
    uint64_t no;
} head;
static head H[4];

static head *head_of(lk_model *m) {
    for (int i = 0; i < 4; i++)
        if (H[i].m == m) return &H[i];
    LK_ASSERT(0);
    return NULL;
}

static int g_batch = 8;

/* Queues slot 0's settings (sp, or greedy without penalties) and the
 * candidates each rank sends (0: what the sampler needs). */
static lk_status head_params(head *h, const lk_sampler_params *sp, int n_cand, char *err) {
    lk_step_op op = {.kind = LK_STEP_OP_PARAMS, .seq = 0, .a = n_cand};
    lk_sampler_params_default(&op.sp);
    op.sp.temp = 0;
    if (sp) op.sp = *sp;
    lk_status st = lk_step_apply(h->st, &op, err, LK_ERRLEN);
    if (!st) h->msg.ops[h->msg.n_ops++] = op;
    return st;
}

static lk_status open_head(lk_cluster_opts *o, lk_cluster **c, lk_model **m, char *err) {
    lk_slice sl;
    o->model_path = lk_gguf_path(F.g);
    o->n_ctx = 64;
    o->n_batch = g_batch;
    o->n_threads = 1;
    o->max_seqs = 1;
    lk_status st = lk_cluster_open(o, F.g, &F.dims, c, &sl, err, LK_ERRLEN);
    if (st) return st;
    lk_model_params mp = {.n_ctx = 64, .n_batch = g_batch, .n_threads = 1, .max_seqs = 1};
    if ((st = lk_model_load(F.g, &sl, &mp, m, err, LK_ERRLEN))) { lk_cluster_close(*c); return st; }
    head *h = NULL;
    for (int i = 0; i < 4 && !h; i++)
        if (!H[i].m) h = &H[i];
    LK_ASSERT(h);
    *h = (head){.m = *m, .c = *c};
    lk_step_params sp = {.m = *m, .mesh = lk_cluster_mesh(*c), .tp = lk_cluster_comm(*c), .plan = lk_cluster_plan(*c)};
    if ((st = lk_step_create(&sp, &h->st, err, LK_ERRLEN))) { lk_model_free(*m); lk_cluster_close(*c); h->m = NULL; return st; }
    lk_step_msg_init(&h->msg, 1, g_batch);
    return head_params(h, NULL, (int)F.cfg.n_vocab, err);
}

static void close_head(lk_cluster *c, lk_model *m) {
    head *h = head_of(m);
    char err[LK_ERRLEN];
    lk_step_msg_clear(&h->msg);
    h->msg.end = true;
    h->msg.no = h->no++;
    lk_step_send(h->st, &h->msg, err, sizeof err);
    lk_step_free(h->st);
    lk_step_msg_free(&h->msg);
    lk_model_free(m);
    lk_cluster_close(c);
    h->m = NULL;
}

/* Sends one step (tokens t[0..n) appended to slot 0 at pos0, sampling if
 * `sample`), without running the head's share. */
static lk_status head_send(head *h, const int32_t *t, int n, int pos0, bool sample, char *err) {
    lk_status st;
    if (pos0 < lk_model_seq_len(h->m, 0)) {
        lk_step_op op = {.kind = LK_STEP_OP_KEEP, .seq = 0, .a = pos0};
        if ((st = lk_step_apply(h->st, &op, err, LK_ERRLEN))) return st;
        h->msg.ops[h->msg.n_ops++] = op;
    }
    h->msg.n_items = 1;
    h->msg.items[0] = (lk_step_item){.seq = 0, .pos0 = pos0, .n = n, .sample = sample};
    memcpy(h->msg.tokens, t, sizeof(int32_t) * (size_t)n);
    h->msg.n_tok = n;
    h->msg.no = h->no++;
    char why[LK_ERRLEN];
    if ((st = lk_step_send(h->st, &h->msg, why, sizeof why)))
        snprintf(err, LK_ERRLEN, "%s", lk_cluster_explain(h->c, why));
    return st;
}

/* The head's share of the step just sent, and the merged candidates. */
static lk_status head_finish(head *h, bool sample, char *err) {
    char why[LK_ERRLEN];
    lk_status st = lk_step_run(h->st, &h->msg, true, why, sizeof why);
    lk_step_msg_clear(&h->msg);
    if (!st) st = lk_step_collect(h->st, why, sizeof why);
    if (st) snprintf(err, LK_ERRLEN, "%s", lk_cluster_explain(h->c, why));
    (void)sample;
    return st;
}

/* Feeds t[0..n) at pos0 in batches of the model's size; after the last,
 * ids/vals get the merged candidates (best first) and the count. */
static lk_status head_forward(head *h, const int32_t *t, int n, int pos0, const int32_t **ids, const float **vals,
                              int *got, char *err) {
    const int B = lk_model_n_batch(h->m);
    for (int i = 0; i < n; i += B) {
        int nb = LK_MIN(B, n - i);
        bool last = i + nb == n;
        lk_status st = head_send(h, t + i, nb, pos0 + i, last, err);
        if (!st) st = head_finish(h, last, err);
        if (st) return st;
    }
    *got = lk_step_n_results(h->st) ? lk_step_result(h->st, 0, NULL, ids, vals) : 0;
    return LK_OK;
}

static lk_status cluster_step(lk_cluster *c, lk_model *m, const int32_t *t, int n, int pos0, float *full,
                              char *err) {
    (void)c;
    const int32_t *ids;
    const float *vals;
    int got = 0;
    lk_status st = head_forward(head_of(m), t, n, pos0, &ids, &vals, &got, err);
    if (st) return st;
    for (int i = 0; i < F.cfg.n_vocab; i++) full[i] = NAN;
    for (int i = 0; i < got; i++)
        if (ids[i] >= 0 && ids[i] < F.cfg.n_vocab) full[ids[i]] = vals[i];
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
            close_head(c, m);
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
    close_head(c, m);
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
        close_head(c, m);
    }
}

/* Sampling penalties applied by every rank to its own vocabulary rows (the
 * window: the tokens the slot holds, which every rank records) give exactly
 * the one-node penalised logits. */
TEST(penalties_match_one_node) {
    lk_cluster_opts o = {.local = 3};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); return; }
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    sp.temp = 0;
    sp.repeat_penalty = 1.3f;
    sp.freq_penalty = 0.2f;
    sp.presence_penalty = -0.4f; /* negative: raises logits, so candidates must be chosen after penalising */
    sp.penalty_last_n = 8;
    CHECK(head_params(head_of(m), &sp, (int)F.cfg.n_vocab, err) == LK_OK);
    lk_sampler *s = lk_sampler_create(&sp);
    for (int i = 0; i < 5; i++) lk_sampler_accept(s, toks[i]);
    float full[NV_MAX], ref[NV_MAX];
    lk_status st = cluster_step(c, m, toks, 5, 0, full, err);
    memcpy(ref, F.ref[0], sizeof ref);
    lk_sampler_penalize(s, ref, 0, F.cfg.n_vocab);
    double d = 0;
    CHECKF(!st && compare(full, ref, (int)F.cfg.n_vocab, &d) == 0, "%s max diff %g", st ? err : "", d);
    double bite = 0; /* the penalties did change something */
    for (int i = 0; i < 5; i++) bite = fmax(bite, fabs(ref[toks[i]] - F.ref[0][toks[i]]));
    CHECKF(bite > 0.05, "largest change %g", bite);
    lk_sampler_free(s);
    close_head(c, m);
}

/* A prompt longer than the batch (three steps), then a decode step; the
 * merged candidates are the one-node top 10 in order. */
TEST(forward_candidates) {
    g_batch = 2;
    lk_cluster_opts o = {.local = 3};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    lk_status st = open_head(&o, &c, &m, err);
    g_batch = 8;
    if (st) { CHECKF(0, "%s", err); return; }
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    sp.top_k = 10;
    CHECK(head_params(head_of(m), &sp, 0, err) == LK_OK);
    for (int step = 0; step < 2; step++) {
        int32_t rids[10];
        float rvals[10];
        const int32_t *ids;
        const float *vals;
        int got = 0;
        st = step == 0 ? head_forward(head_of(m), toks, 5, 0, &ids, &vals, &got, err)
                       : head_forward(head_of(m), toks + 5, 1, 5, &ids, &vals, &got, err);
        CHECKF(st == LK_OK && got == 10, "%s (%d)", err, got);
        if (st) break;
        int rn = lk_sampler_top(F.ref[step], 0, F.cfg.n_vocab, rids, rvals, 10);
        int bad = 0;
        for (int i = 0; i < rn && i < got; i++) bad += ids[i] != rids[i] || fabsf(vals[i] - rvals[i]) > 1e-3f;
        CHECKF(bad == 0, "step %d: %d of the top 10 differ (first: %d vs %d)", step, bad, ids[0], rids[0]);
    }
    close_head(c, m);
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
        static float full[NV_MAX];
        for (int step = 0; step < 2; step++) {
            st = step == 0 ? cluster_step(c, m, toks, 5, 0, full, err) : cluster_step(c, m, toks + 5, 1, 5, full, err);
            double d = 0;
            CHECKF(!st && compare(full, F.ref[step], nv, &d) == 0, "tp %d pp %d step %d: %s (max diff %g)",
                   L[k].tp, L[k].pp, step, st ? err : "", d);
        }
        close_head(c, m);
    }
}

/* A head over o's local workers takes a good step, then worker `rank`
 * (its pid into *pid) gets signal sig: the next step must fail within 2 s.
 * The head stays open for the caller's checks of the message; false when
 * it did not open. */
static bool step_after_signal(lk_cluster_opts *o, int rank, int sig, lk_cluster **c, lk_model **m, int *pid) {
    char err[LK_ERRLEN];
    if (open_head(o, c, m, err)) { CHECKF(0, "%s", err); return false; }
    float full[NV_MAX];
    CHECK(cluster_step(*c, *m, toks, 5, 0, full, err) == LK_OK);
    *pid = lk_cluster_local_pid(*c, rank);
    kill(*pid, sig);
    uint64_t t0 = lk_time_ns();
    lk_status st = cluster_step(*c, *m, toks + 5, 1, 5, full, err);
    double s = (double)(lk_time_ns() - t0) / 1e9;
    CHECK(st != LK_OK);
    CHECKF(s < 2.0, "took %.2f s", s);
    return true;
}

/* A worker killed mid-session: the next step fails fast and names it. */
TEST(killed_worker_named) {
    lk_cluster_opts o = {.local = 3, .dead_after_ms = 1000};
    lk_cluster *c;
    lk_model *m;
    int pid;
    if (!step_after_signal(&o, 2, SIGKILL, &c, &m, &pid)) return;
    /* the dead one is named first, not the survivor that reported it */
    CHECKF(!strncmp(lk_cluster_error(c), "lost worker rank 2 (127.0.0.1:", 30), "%s", lk_cluster_error(c));
    close_head(c, m);
}

/* A frozen worker (alive socket, no answers): declared dead by heartbeats
 * within dead_after, and the blocked all-reduce is cut off. */
TEST(frozen_worker_named) {
    lk_cluster_opts o = {.local = 2, .dead_after_ms = 1000};
    lk_cluster *c;
    lk_model *m;
    int pid;
    if (!step_after_signal(&o, 1, SIGSTOP, &c, &m, &pid)) return;
    CHECKF(strstr(lk_cluster_error(c), "worker rank 1 (127.0.0.1:") &&
           strstr(lk_cluster_error(c), "stopped answering heartbeats") && strstr(lk_cluster_error(c), "all-reduce layer"),
           "%s", lk_cluster_error(c));
    kill(pid, SIGKILL);
    close_head(c, m);
}

/* Workers that wait a long time on a slow head are not declared dead (and
 * do not declare the head dead): heartbeats flow while compute waits. */
TEST(slow_is_not_dead) {
    lk_cluster_opts o = {.local = 2, .dead_after_ms = 500};
    lk_cluster *c;
    lk_model *m;
    char err[LK_ERRLEN];
    if (open_head(&o, &c, &m, err)) { CHECKF(0, "%s", err); return; }
    CHECK(head_send(head_of(m), toks, 5, 0, false, err) == LK_OK);
    usleep(1500000); /* the worker sits in its first all-reduce for 1.5 s */
    lk_status st = head_finish(head_of(m), false, err);
    CHECKF(st == LK_OK, "%s", err);
    float full[NV_MAX];
    double d = 0;
    st = cluster_step(c, m, toks + 5, 1, 5, full, err);
    CHECKF(!st && compare(full, F.ref[1], (int)F.cfg.n_vocab, &d) == 0, "%s", st ? err : "");
    close_head(c, m);
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
        close_head(c, m);
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
        head_send(head_of(m3), toks, 5, 0, false, err);
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
        close_head(c, m);
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
        close_head(c, m);
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
