/* The rank step against a hostile or broken peer, over real sockets: a
 * rank that sends bad candidates (ids outside its vocabulary rows, NaN,
 * padding followed by ids) is named by rank 0, never an assertion; a worker
 * that receives a malformed step message (magic, step number, counts, slots,
 * tokens) refuses it with the field named. The peer here is a thread that
 * speaks the protocol by hand. */
#include "lk_test.h"
#include "model/model.h"
#include "step/step.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static lk_gguf *G;
static lk_model_config CFG;
static lk_slice SL[2];

/* Two meshes of 2 ranks joined by a socketpair. */
static void mesh_pair(lk_mesh **m0, lk_mesh **m1) {
    int sv[2];
    LK_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    lk_link *a[2] = {NULL, lk_tcp_wrap(sv[0], "rank 1")}, *b[2] = {lk_tcp_wrap(sv[1], "rank 0"), NULL};
    *m0 = lk_mesh_from_links(0, 2, a);
    *m1 = lk_mesh_from_links(1, 2, b);
}

/* A real rank r: its model slice, TP comm and step. */
typedef struct {
    lk_model *m;
    lk_comm *c;
    lk_step *st;
} rank;

static bool rank_open(rank *r, lk_mesh *mesh, int me, char *err) {
    lk_model_params mp = {.n_ctx = 64, .n_batch = 8, .n_threads = 1, .max_seqs = 2};
    if (lk_model_load(G, &SL[me], &mp, &r->m, err, LK_ERRLEN)) return false;
    if (lk_comm_create(mesh, NULL, 2, &r->c, err, LK_ERRLEN)) return false;
    lk_comm_set_timeout_ms(r->c, 5000);
    lk_step_params sp = {.m = r->m, .mesh = mesh, .tp = r->c, .plan = SL};
    return lk_step_create(&sp, &r->st, err, LK_ERRLEN) == LK_OK;
}

static void rank_close(rank *r) {
    lk_step_free(r->st);
    lk_comm_free(r->c);
    lk_model_free(r->m);
}

/* ---- a rank 1 that sends bad candidates ---------------------------------- */

typedef struct {
    lk_mesh *mesh;
    int kind;       /* which bad candidate list */
    int k;          /* candidates per rank */
} fake1;

static void *fake_rank1(void *p) {
    fake1 *f = p;
    lk_link *l = lk_mesh_link(f->mesh, 0);
    char err[LK_ERRLEN];
    uint8_t hdr[LK_STEP_HDR], body[4096];
    if (lk_link_recv(l, hdr, sizeof hdr, lk_deadline_ms(5000), err, sizeof err)) return NULL;
    uint32_t len;
    memcpy(&len, hdr + 4, 4);
    if (len > sizeof body || lk_link_recv(l, body, len, lk_deadline_ms(5000), err, sizeof err)) return NULL;
    uint32_t n_tok;
    memcpy(&n_tok, body + 8, 4);
    /* the all-reduces of the forward pass (exchange: each sends its partial):
     * ours are zeros, so rank 0's sum is its own */
    static float zero[8 * 64], got[8 * 64];
    size_t bytes = sizeof(float) * n_tok * (size_t)CFG.n_embd;
    for (int i = 0; i < 2 * CFG.n_layer; i++) {
        if (lk_link_send(l, zero, bytes, lk_deadline_ms(5000), err, sizeof err)) return NULL;
        if (lk_link_recv(l, got, bytes, lk_deadline_ms(5000), err, sizeof err)) return NULL;
    }
    int32_t id[17];
    float v[17];
    for (int i = 0; i < f->k; i++) id[i] = (int32_t)SL[1].vocab0 + i, v[i] = 1.0f - 0.01f * (float)i;
    switch (f->kind) {
    case 0: id[1] = (int32_t)CFG.n_vocab + 7; break;  /* outside the vocabulary */
    case 1: id[2] = (int32_t)SL[0].vocab0; break;     /* another rank's row */
    case 2: v[0] = NAN; break;
    case 3: id[1] = -1; v[1] = 0; break;              /* padding, then an id again */
    case 4: v[3] = INFINITY; break;
    }
    /* the slot named its count (logprobs): the log-sum-exp pair follows */
    id[f->k] = -2, v[f->k] = 2.0f;
    switch (f->kind) {
    case 5: id[f->k] = -1; break;                     /* not the pair's marker */
    case 6: v[f->k] = 0.5f; break;                    /* below the best candidate (1.0) */
    case 7: v[f->k] = NAN; break;
    }
    uint8_t pairs[17 * 8];
    for (int i = 0; i <= f->k; i++) {
        memcpy(pairs + 8 * i, &id[i], 4);
        memcpy(pairs + 8 * i + 4, &v[i], 4);
    }
    lk_link_send(l, pairs, 8 * (size_t)(f->k + 1), lk_deadline_ms(5000), err, sizeof err);
    return NULL;
}

TEST(bad_candidates_named) {
    const char *want[8] = {"rank 1 sent a bad candidate for slot 0: id 519", "rank 1 sent a bad candidate for slot 0: id 0 (its rows 256..511)",
                           "value nan", "rank 1 sent a bad candidate", "value inf",
                           "rank 1 sent a bad log-sum-exp for slot 0: id -1", "bad log-sum-exp for slot 0: id -2, value 0.5",
                           "bad log-sum-exp for slot 0: id -2, value nan"};
    for (int kind = 0; kind < 8; kind++) {
        lk_mesh *m0, *m1;
        mesh_pair(&m0, &m1);
        rank r0 = {0};
        char err[LK_ERRLEN];
        bool ok = rank_open(&r0, m0, 0, err);
        CHECKF(ok, "%s", err);
        if (!ok) { lk_mesh_free(m0); lk_mesh_free(m1); return; }
        fake1 f = {.mesh = m1, .kind = kind, .k = 4};
        pthread_t th;
        pthread_create(&th, NULL, fake_rank1, &f);
        lk_step_msg msg;
        lk_step_msg_init(&msg, 2, 8);
        lk_step_op op = {.kind = LK_STEP_OP_PARAMS, .seq = 0, .a = 4};
        lk_sampler_params_default(&op.sp);
        op.sp.temp = 0;
        CHECK(lk_step_apply(r0.st, &op, err, sizeof err) == LK_OK);
        msg.ops[msg.n_ops++] = op;
        static const int32_t toks[5] = {1, 403, 407, 261, 378};
        msg.items[0] = (lk_step_item){.seq = 0, .pos0 = 0, .n = 5, .sample = true};
        msg.n_items = 1;
        memcpy(msg.tokens, toks, sizeof toks);
        msg.n_tok = 5;
        lk_status st = lk_step_send(r0.st, &msg, err, sizeof err);
        if (!st) st = lk_step_run(r0.st, &msg, true, err, sizeof err);
        CHECKF(st == LK_OK, "kind %d: %s", kind, err);
        err[0] = 0;
        st = lk_step_collect(r0.st, err, sizeof err);
        CHECKF(st != LK_OK && strstr(err, want[kind]), "kind %d: %s", kind, err);
        printf("  %s\n", err);
        pthread_join(th, NULL);
        lk_step_msg_free(&msg);
        rank_close(&r0);
        lk_mesh_free(m0);
        lk_mesh_free(m1);
    }
}

/* ---- a rank 0 that sends malformed steps ------------------------------------ */

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

TEST(malformed_steps_refused) {
    struct { const char *what, *want; } cases[] = {
        {"magic", "malformed step header from rank 0: magic"},
        {"number", "step 5 (expected 0)"},
        {"length", "bytes"},
        {"counts", "malformed step 0: 0 ops (<= 24), 9 items (<= 2)"},
        {"flags", "flags 7"},
        {"slot", "item 0: slot 9"},
        {"token", "token id 600 outside the vocabulary"},
        {"position", "slot 0 holds 0 positions, not 3"},
        {"sample", "samples without sampling settings"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        lk_mesh *m0, *m1;
        mesh_pair(&m0, &m1);
        rank r1 = {0};
        char err[LK_ERRLEN];
        bool ok = rank_open(&r1, m1, 1, err);
        CHECKF(ok, "%s", err);
        if (!ok) { lk_mesh_free(m0); lk_mesh_free(m1); return; }
        /* a well-formed message: one item of one token in slot 0 */
        uint8_t w[LK_STEP_HDR + 16 + 16 + 4];
        uint8_t *b = w + LK_STEP_HDR;
        put32(w, LK_STEP_MAGIC);
        put32(w + 4, sizeof w - LK_STEP_HDR);
        put64(w + 8, 0);
        put32(b, 0); put32(b + 4, 1); put32(b + 8, 1); put32(b + 12, 0);
        put32(b + 16, 0); put32(b + 20, 0); put32(b + 24, 1); put32(b + 28, 0);
        put32(b + 32, 1);
        const char *c = cases[k].what;
        if (!strcmp(c, "magic")) put32(w, 0x12345678);
        else if (!strcmp(c, "number")) put64(w + 8, 5);
        else if (!strcmp(c, "length")) put32(w + 4, 1u << 30);
        else if (!strcmp(c, "counts")) put32(b + 4, 9);
        else if (!strcmp(c, "flags")) put32(b + 12, 7);
        else if (!strcmp(c, "slot")) put32(b + 16, 9);
        else if (!strcmp(c, "token")) put32(b + 32, 600);
        else if (!strcmp(c, "position")) put32(b + 20, 3);
        else if (!strcmp(c, "sample")) put32(b + 28, 1);
        lk_link_send(lk_mesh_link(m0, 1), w, sizeof w, lk_deadline_ms(2000), err, sizeof err);
        lk_step_msg msg;
        lk_step_msg_init(&msg, 2, 8);
        err[0] = 0;
        lk_status st = lk_step_recv(r1.st, &msg, lk_deadline_ms(2000), err, sizeof err);
        if (!st) st = lk_step_run(r1.st, &msg, false, err, sizeof err);
        CHECKF(st != LK_OK && strstr(err, cases[k].want), "%s: %s", c, err);
        printf("  %s: %s\n", c, err);
        lk_step_msg_free(&msg);
        rank_close(&r1);
        lk_mesh_free(m0);
        lk_mesh_free(m1);
    }
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    lk_log_set_level(LK_LOG_ERROR);
    char err[LK_ERRLEN];
    if (lk_gguf_open(lk_td("models/stories260K.gguf"), &G, err, sizeof err) || lk_model_config_read(G, &CFG, err, sizeof err)) {
        printf("FAIL fixture: %s\n", err);
        return 1;
    }
    lk_plan_dims d;
    lk_model_plan_dims(G, &CFG, &d);
    if (lk_plan_make(&d, 2, 1, NULL, SL, err, sizeof err)) {
        printf("FAIL plan: %s\n", err);
        return 1;
    }
    RUN(bad_candidates_named);
    RUN(malformed_steps_refused);
    lk_gguf_close(G);
    return lk_test_end();
}
