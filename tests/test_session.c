/* The session layer (src/session) over a real engine: requests that start
 * and finish at different steps, with different lengths, one cancelled half
 * way, give every request the greedy tokens it gets alone (the engine's
 * one-sequence lk_engine_step on a fresh engine); chunked prefill keeps a
 * running stream decoding every step; prefix reuse (a kept slot continued, a
 * kept slot forked, a running slot forked) gives the tokens of no reuse and
 * reuses what it should; stop conditions (end of generation, length,
 * callback, context); bad requests are refused with a message; the steps of
 * the steady state allocate nothing. On one node, and the scheduling tests
 * also on local clusters (tp 2, and pp 2 where two steps are in flight). */
#include "lk_test.h"

#include "engine/engine.h"
#include "session/session.h"
#include "tokenizer/tokenizer.h"

#define STORIES "models/stories260K.gguf"

typedef struct {
    int local, tp, pp;
    const char *name;
} layout;

static const layout ONE = { 0, 0, 0, "one node" };
static const layout TP2 = { 2, 2, 0, "--local 2 --tp 2" };
static const layout PP2 = { 2, 0, 2, "--local 2 --pp 2" };

static lk_engine *open_engine(const char *model, layout l, int max_seqs, int n_batch, int n_ctx) {
    char err[LK_ERRLEN];
    lk_engine_opts o = { .model_path = lk_td(model), .n_threads = 1, .n_ctx = n_ctx, .n_batch = n_batch,
                         .max_seqs = max_seqs, .local = l.local, .tp = l.tp, .pp = l.pp };
    lk_engine *e = NULL;
    lk_status st = lk_engine_open(&o, &e, err, sizeof err);
    CHECKF(st == LK_OK, "%s (%s): %s", model, l.name, err);
    return st ? NULL : e;
}

static lk_tokenizer *load_tok(lk_engine *e) {
    char err[LK_ERRLEN];
    lk_tokenizer *t = NULL;
    lk_status st = lk_tokenizer_load(lk_engine_gguf(e), &t, err, sizeof err);
    CHECKF(st == LK_OK, "%s", err);
    return t;
}

/* A prompt's ids (BOS as the model says). */
typedef struct {
    int32_t *v;
    int32_t  n;
} ids;

static ids encode(const lk_tokenizer *t, const char *text) {
    char err[LK_ERRLEN];
    ids r = { 0 };
    CHECKF(lk_tokenizer_encode(t, text, strlen(text), true, false, &r.v, &r.n, err, sizeof err) == LK_OK, "%s", err);
    return r;
}

static ids concat(ids a, const int32_t *b, int nb) {
    ids r = { malloc(sizeof(int32_t) * (size_t)(a.n + nb)), a.n + nb };
    memcpy(r.v, a.v, sizeof(int32_t) * (size_t)a.n);
    memcpy(r.v + a.n, b, sizeof(int32_t) * (size_t)nb);
    return r;
}

/* Greedy tokens of a prompt alone: the engine's one-sequence path on an
 * engine of its own (one slot, the default batch). */
static void alone(lk_engine *ref, ids p, int n_gen, int32_t *out) {
    char err[LK_ERRLEN];
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    sp.temp = 0;
    lk_sampler *s = lk_sampler_create(&sp);
    int32_t next = -1;
    lk_status st = lk_engine_step(ref, p.v, p.n, 0, s, &next, err, sizeof err);
    CHECKF(st == LK_OK, "%s", err);
    for (int k = 0; k < n_gen && st == LK_OK; k++) {
        out[k] = next;
        if (k + 1 < n_gen) {
            int32_t fed = next;
            st = lk_engine_step(ref, &fed, 1, p.n + k, s, &next, err, sizeof err);
            CHECKF(st == LK_OK, "%s", err);
        }
    }
    lk_sampler_free(s);
}

/* What a callback saw of one request. */
typedef struct {
    int  *clock;        /* the test's step counter */
    int   first_step, last_step, n_tokens, gaps, ends;
    int   stop_after;   /* > 0: the callback returns false at this many tokens */
    int   prev_step;
} seen;

static bool watch(void *user, lk_request *r, int32_t token, const char *piece, int n) {
    seen *w = user;
    if (token < 0) { w->ends++; return true; }
    if (w->n_tokens == 0) w->first_step = *w->clock;
    else if (*w->clock != w->prev_step + 1) w->gaps++;
    w->prev_step = w->last_step = *w->clock;
    w->n_tokens++;
    return !(w->stop_after > 0 && w->n_tokens >= w->stop_after);
}

static lk_request_params greedy(ids p, int max_new, seen *w) {
    lk_request_params rp = { .prompt = p.v, .n_prompt = p.n, .max_new = max_new, .ignore_eos = true,
                             .on_token = watch, .user = w };
    lk_sampler_params_default(&rp.sampling);
    rp.sampling.temp = 0;
    return rp;
}

static const char *TEXTS[] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They saw a big tree with red apples and a bird that sang a happy song all day long.",
    "One day, a girl named",
    "Ben had a red ball. He liked to throw it high in the sky and catch it with his hands.",
};
enum { N_TEXTS = 5 };

/* Checks a request's tokens against the alone reference. */
static void same_tokens(lk_request *r, const int32_t *want, int n_want, const char *what, const char *where) {
    lk_request_info in;
    lk_request_get(r, &in);
    CHECKF(in.n_gen == n_want, "%s (%s): %d tokens, want %d (%s)", what, where, in.n_gen, n_want, lk_finish_to_string(in.finish));
    int k = 0;
    while (k < LK_MIN(in.n_gen, n_want) && in.gen[k] == want[k]) k++;
    CHECKF(k == LK_MIN(in.n_gen, n_want), "%s (%s): token %d is %d, alone %d", what, where, k, in.gen[k], want[k]);
}

/* ======================================================================
 * staggered arrivals
 * ==================================================================== */

/* Five requests over four slots, at most three running: A starts alone; B
 * (a prompt longer than the 16-token batch, so it is prefilled in chunks
 * beside A's decoding) comes 3 steps later; C and D 2 steps after that (D
 * waits for a free place); E comes last and is cancelled after 5 tokens;
 * the callback stops C at 12. Every request gets its alone tokens. */
static void staggered(layout l) {
    lk_engine *e = open_engine(STORIES, l, 4, 16, 256), *ref = open_engine(STORIES, ONE, 1, 0, 256);
    if (!e || !ref) { lk_engine_close(e); lk_engine_close(ref); return; }
    lk_tokenizer *tok = load_tok(e);
    ids p[N_TEXTS];
    for (int i = 0; i < N_TEXTS; i++) p[i] = encode(tok, TEXTS[i]);
    CHECKF(p[2].n > 32, "prompt 2 has %d tokens: want more than two batches", p[2].n);
    static const int max_new[N_TEXTS] = { 40, 10, 25, 30, 50 };
    static int32_t want[N_TEXTS][64];
    for (int i = 0; i < N_TEXTS; i++) alone(ref, p[i], max_new[i], want[i]);

    char err[LK_ERRLEN];
    lk_session *s = NULL;
    CHECKF(lk_session_create(e, tok, &(lk_session_opts){ .parallel = 3, .no_reuse = true }, &s, err, sizeof err) == LK_OK,
           "%s", err);
    if (!s) goto out;
    int clock = 0;
    seen w[N_TEXTS];
    for (int i = 0; i < N_TEXTS; i++) w[i] = (seen){ .clock = &clock };
    w[2].stop_after = 12;
    lk_request *r[N_TEXTS] = { 0 };
    /* A 0 (4, 3, 1 arrive later), B 1 at step 3, C 2 and D 3 at step 5, E 4 at step 6 */
    static const int order[N_TEXTS] = { 0, 1, 2, 3, 4 }, when[N_TEXTS] = { 0, 3, 5, 5, 6 };
    int next_arrival = 0;
    bool busy = true, cancelled = false;
    for (clock = 0; (busy || next_arrival < N_TEXTS) && clock < 2000; clock++) {
        while (next_arrival < N_TEXTS && when[next_arrival] <= clock) {
            int i = order[next_arrival++];
            lk_request_params rp = greedy(p[i], max_new[i], &w[i]);
            r[i] = lk_session_submit(s, &rp, err, sizeof err);
            CHECKF(r[i], "submit %d: %s", i, err);
        }
        if (!cancelled && r[4] && w[4].n_tokens >= 5) {
            lk_session_cancel(s, r[4]);
            cancelled = true;
        }
        lk_status st = lk_session_step(s, &busy, err, sizeof err);
        CHECKF(st == LK_OK, "step %d: %s", clock, err);
        if (st) break;
        CHECK(lk_session_running(s) <= 3);
    }
    CHECKF(!busy, "still busy after %d steps", clock);
    for (int i = 0; i < N_TEXTS; i++) {
        if (!r[i]) continue;
        lk_request_info in;
        lk_request_get(r[i], &in);
        char what[32];
        snprintf(what, sizeof what, "request %c", 'A' + i);
        if (i == 2) {
            CHECKF(in.finish == LK_FINISH_STOPPED, "C: %s", lk_finish_to_string(in.finish));
            same_tokens(r[i], want[i], 12, what, l.name);
        } else if (i == 4) {
            CHECKF(in.finish == LK_FINISH_CANCELLED, "E: %s", lk_finish_to_string(in.finish));
            /* cancelled after its 5th token: with steps in flight it may get one more */
            CHECKF(in.n_gen >= 5 && in.n_gen <= 5 + lk_engine_depth(e), "E: %d tokens", in.n_gen);
            same_tokens(r[i], want[i], in.n_gen, what, l.name);
        } else {
            CHECKF(in.finish == LK_FINISH_LENGTH, "%s: %s", what, lk_finish_to_string(in.finish));
            same_tokens(r[i], want[i], max_new[i], what, l.name);
        }
        CHECKF(w[i].ends == 1, "%s: the end was reported %d times", what, w[i].ends);
    }
    /* they started and finished at different steps */
    CHECKF(w[1].first_step > w[0].first_step && w[0].last_step != w[1].last_step && w[3].first_step > w[2].first_step,
           "first tokens at steps %d %d %d %d", w[0].first_step, w[1].first_step, w[2].first_step, w[3].first_step);
    /* D waited for a place: it started after one of A, B, C ended */
    CHECKF(w[3].first_step > LK_MIN(w[1].last_step, w[2].last_step), "D's first token at step %d, B ended at %d, C at %d",
           w[3].first_step, w[1].last_step, w[2].last_step);
    /* chunked prefill: with one stage A decoded at every step, B's chunks beside it */
    if (lk_engine_depth(e) == 1) CHECKF(w[0].gaps == 0, "A skipped %d steps (a prompt stalled it)", w[0].gaps);
    /* every slot was freed */
    CHECKF(lk_engine_pages_free(e) == lk_engine_pages_total(e), "%lld of %lld pages free",
           (long long)lk_engine_pages_free(e), (long long)lk_engine_pages_total(e));
    for (int i = 0; i < 4; i++) CHECKF(lk_engine_seq_len(e, i) == 0, "slot %d holds %d positions", i, lk_engine_seq_len(e, i));
    printf("  staggered (%s): %d steps, A %d..%d, B %d..%d, C %d..%d, D %d..%d, E %d..%d\n", l.name, clock,
           w[0].first_step, w[0].last_step, w[1].first_step, w[1].last_step, w[2].first_step, w[2].last_step,
           w[3].first_step, w[3].last_step, w[4].first_step, w[4].last_step);
out:
    lk_session_free(s);
    for (int i = 0; i < N_TEXTS; i++) free(p[i].v);
    lk_tokenizer_free(tok);
    lk_engine_close(ref);
    lk_engine_close(e);
}

TEST(staggered_one_node) { staggered(ONE); }
TEST(staggered_tp2) { staggered(TP2); }
TEST(staggered_pp2) { staggered(PP2); }

/* Many requests at once, more than the slots: every one gets its alone
 * tokens, at parallel 1, 2 and all. */
static void all_at_once(layout l, int parallel) {
    lk_engine *e = open_engine(STORIES, l, 4, 32, 256), *ref = open_engine(STORIES, ONE, 1, 0, 256);
    if (!e || !ref) { lk_engine_close(e); lk_engine_close(ref); return; }
    lk_tokenizer *tok = load_tok(e);
    enum { N = 8 };
    ids p[N];
    static int32_t want[N][32];
    int max_new[N];
    for (int i = 0; i < N; i++) {
        p[i] = encode(tok, TEXTS[i % N_TEXTS]);
        max_new[i] = 8 + 3 * i;
        alone(ref, p[i], max_new[i], want[i]);
    }
    char err[LK_ERRLEN];
    lk_session *s = NULL;
    CHECKF(lk_session_create(e, tok, &(lk_session_opts){ .parallel = parallel }, &s, err, sizeof err) == LK_OK, "%s", err);
    if (s) {
        int clock = 0;
        seen w[N];
        lk_request *r[N];
        for (int i = 0; i < N; i++) {
            w[i] = (seen){ .clock = &clock };
            lk_request_params rp = greedy(p[i], max_new[i], &w[i]);
            r[i] = lk_session_submit(s, &rp, err, sizeof err);
            CHECKF(r[i], "%s", err);
        }
        CHECKF(lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
        char where[64];
        snprintf(where, sizeof where, "%s, parallel %d", l.name, parallel);
        for (int i = 0; i < N; i++) {
            char what[32];
            snprintf(what, sizeof what, "request %d", i);
            if (r[i]) same_tokens(r[i], want[i], max_new[i], what, where);
        }
    }
    lk_session_free(s);
    for (int i = 0; i < N; i++) free(p[i].v);
    lk_tokenizer_free(tok);
    lk_engine_close(ref);
    lk_engine_close(e);
}

TEST(all_at_once_one_node) { all_at_once(ONE, 1); all_at_once(ONE, 2); all_at_once(ONE, 0); }
TEST(all_at_once_pp2) { all_at_once(PP2, 0); }

/* ======================================================================
 * prefix reuse
 * ==================================================================== */

static const char *PREFIX =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her friends. "
    "One day, she saw a big red ball in the park. She ran to get it, but a boy named Tom took it first. ";

static void prefix_reuse(layout l, int n_slots) {
    lk_engine *e = open_engine(STORIES, l, n_slots, 32, 512), *ref = open_engine(STORIES, ONE, 1, 0, 512);
    if (!e || !ref) { lk_engine_close(e); lk_engine_close(ref); return; }
    lk_tokenizer *tok = load_tok(e);
    int page = lk_engine_page_tokens(e);
    ids pre = encode(tok, PREFIX);
    CHECKF(pre.n >= 2 * page, "the shared prefix has %d tokens, less than two pages of %d", pre.n, page);
    ids tail1 = encode(tok, "Lily was sad."), tail2 = encode(tok, "Tom said sorry."), tail3 = encode(tok, "Then they played.");
    /* the tails without their BOS */
    ids p1 = concat(pre, tail1.v + 1, tail1.n - 1), p2 = concat(pre, tail2.v + 1, tail2.n - 1);
    char err[LK_ERRLEN];
    lk_session *s = NULL;
    CHECKF(lk_session_create(e, tok, &(lk_session_opts){ 0 }, &s, err, sizeof err) == LK_OK, "%s", err);
    if (!s) goto out;
    int clock = 0;
    seen w = { .clock = &clock };
    static int32_t want[64];
    char where[64];
    snprintf(where, sizeof where, "%s, %d slots", l.name, n_slots);

    /* 1. a first request: nothing to reuse */
    lk_request_params rp = greedy(p1, 20, &w);
    lk_request *r1 = lk_session_submit(s, &rp, err, sizeof err);
    CHECKF(r1 && lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
    lk_request_info i1;
    lk_request_get(r1, &i1);
    alone(ref, p1, 20, want);
    same_tokens(r1, want, 20, "first", where);
    CHECKF(i1.n_reused == 0, "first: %d reused", i1.n_reused);

    /* 2. the next turn of a chat: prompt, reply (but its last token) and more; continues the slot */
    ids turn = concat(p1, i1.gen, i1.n_gen - 1);
    ids p3 = concat(turn, tail3.v + 1, tail3.n - 1);
    rp = greedy(p3, 16, &w);
    lk_request *r3 = lk_session_submit(s, &rp, err, sizeof err);
    CHECKF(r3 && lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
    lk_request_info i3;
    lk_request_get(r3, &i3);
    alone(ref, p3, 16, want);
    same_tokens(r3, want, 16, "next turn", where);
    CHECKF(i3.n_reused == turn.n, "next turn: %d reused, want %d (the whole first turn)", i3.n_reused, turn.n);
    CHECKF(i3.seq == i1.seq, "next turn in slot %d, the first turn was in %d", i3.seq, i1.seq);

    /* 3. the same system prompt, another question: forks the kept slot (or
     * continues it when it is the only one) */
    rp = greedy(p2, 20, &w);
    lk_request *r2 = lk_session_submit(s, &rp, err, sizeof err);
    CHECKF(r2 && lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
    lk_request_info i2;
    lk_request_get(r2, &i2);
    alone(ref, p2, 20, want);
    same_tokens(r2, want, 20, "shared prefix", where);
    int common = 0;
    while (common < p2.n - 1 && p2.v[common] == p3.v[common]) common++;
    CHECKF(i2.n_reused == common, "shared prefix: %d reused, want %d", i2.n_reused, common);
    if (n_slots > 1) {
        CHECKF(i2.seq != i3.seq, "forked into slot %d, the source is %d", i2.seq, i3.seq);
        /* the source was kept whole: the chat's third turn still continues it */
        ids p4 = concat(p3, i3.gen, i3.n_gen - 1);
        rp = greedy(p4, 8, &w);
        lk_request *r4 = lk_session_submit(s, &rp, err, sizeof err);
        CHECKF(r4 && lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
        lk_request_info i4;
        lk_request_get(r4, &i4);
        alone(ref, p4, 8, want);
        same_tokens(r4, want, 8, "third turn", where);
        CHECKF(i4.n_reused == p4.n - 1, "third turn: %d reused, want %d", i4.n_reused, p4.n - 1);
        CHECKF(i4.seq == i3.seq, "third turn in slot %d, the second was in %d", i4.seq, i3.seq);
        free(p4.v);
    }

    /* 4. a running sequence's prompt is shared: the second of two requests
     * with a new common prefix comes once the first has its first token */
    if (n_slots >= 3) {
        ids q = encode(tok, "Ben and his dad went to the lake to catch fish. They sat on the dock and waited for a long "
                            "time, but no fish came. Then Ben saw a frog jump into the water. ");
        ids qa = concat(q, tail1.v + 1, tail1.n - 1), qb = concat(q, tail2.v + 1, tail2.n - 1);
        seen wa = { .clock = &clock };
        rp = greedy(qa, 30, &wa);
        lk_request *ra = lk_session_submit(s, &rp, err, sizeof err), *rb = NULL;
        bool busy = true;
        for (int k = 0; busy && k < 500; k++) {
            CHECKF(lk_session_step(s, &busy, err, sizeof err) == LK_OK, "%s", err);
            if (!rb && wa.n_tokens >= 2) {
                rp = greedy(qb, 12, &w);
                rb = lk_session_submit(s, &rp, err, sizeof err);
                CHECKF(rb, "%s", err);
            }
        }
        lk_request_info ia, ib;
        lk_request_get(ra, &ia);
        alone(ref, qa, 30, want);
        same_tokens(ra, want, 30, "running source", where);
        CHECKF(rb != NULL, "the second request never came");
        if (rb) {
            lk_request_get(rb, &ib);
            alone(ref, qb, 12, want);
            same_tokens(rb, want, 12, "forked from a running one", where);
            int c = 0;
            while (c < qb.n - 1 && qb.v[c] == qa.v[c]) c++;
            CHECKF(ib.n_reused == c && c >= page, "forked from a running one: %d reused, want %d", ib.n_reused, c);
            CHECKF(ib.seq != ia.seq, "both in slot %d", ia.seq);
        }
        free(q.v); free(qa.v); free(qb.v);
    }
    /* 5. two requests with one (new) system prompt arriving together: the
     * second waits for the first to compute the shared pages, then forks them */
    {
        ids q = encode(tok, "Mia had a little cat named Tom. Every morning the cat sat by the window and looked at the "
                            "birds in the big green tree. One day a bird flew down to the grass. ");
        ids qa = concat(q, tail1.v + 1, tail1.n - 1), qb = concat(q, tail3.v + 1, tail3.n - 1);
        rp = greedy(qa, 10, &w);
        lk_request *ra = lk_session_submit(s, &rp, err, sizeof err);
        rp = greedy(qb, 10, &w);
        lk_request *rb = lk_session_submit(s, &rp, err, sizeof err);
        CHECKF(ra && rb && lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
        int c = 0;
        while (c < qb.n - 1 && qb.v[c] == qa.v[c]) c++;
        lk_request_info ib;
        lk_request_get(rb, &ib);
        CHECKF(ib.n_reused >= c - c % page && ib.n_reused <= c && c >= page,
               "arriving together: %d reused of a shared prefix of %d", ib.n_reused, c);
        alone(ref, qa, 10, want);
        same_tokens(ra, want, 10, "together, first", where);
        alone(ref, qb, 10, want);
        same_tokens(rb, want, 10, "together, second", where);
        free(q.v); free(qa.v); free(qb.v);
    }
    printf("  prefix reuse (%s): reused %d, %d, %d positions of prompts of %d, %d, %d\n", where, i1.n_reused, i3.n_reused,
           i2.n_reused, i1.n_prompt, i3.n_prompt, i2.n_prompt);
    free(turn.v);
    free(p3.v);
out:
    lk_session_free(s);
    free(pre.v); free(tail1.v); free(tail2.v); free(tail3.v); free(p1.v); free(p2.v);
    lk_tokenizer_free(tok);
    lk_engine_close(ref);
    lk_engine_close(e);
}

TEST(prefix_reuse_one_slot) { prefix_reuse(ONE, 1); }
TEST(prefix_reuse_four_slots) { prefix_reuse(ONE, 4); }
TEST(prefix_reuse_tp2) { prefix_reuse(TP2, 4); }
TEST(prefix_reuse_pp2) { prefix_reuse(PP2, 4); }

/* ======================================================================
 * stop conditions and refusals
 * ==================================================================== */

/* synth-qwen2-f32 "Hello, World!" ends with an end-of-generation token after
 * 21 tokens (synth/README.md); ignore_eos goes on; a small context stops. */
TEST(stop_conditions) {
    lk_engine *e = open_engine("synth/synth-qwen2-f32.gguf", ONE, 2, 0, 64);
    if (!e) return;
    lk_tokenizer *tok = load_tok(e);
    ids p = encode(tok, "Hello, World!");
    char err[LK_ERRLEN];
    lk_session *s = NULL;
    CHECKF(lk_session_create(e, tok, &(lk_session_opts){ .parallel = 2 }, &s, err, sizeof err) == LK_OK, "%s", err);
    if (s) {
        int clock = 0;
        seen w1 = { .clock = &clock }, w2 = { .clock = &clock }, w3 = { .clock = &clock };
        lk_request_params a = greedy(p, 32, &w1), b = greedy(p, 32, &w2), c = greedy(p, -1, &w3);
        a.ignore_eos = false;
        lk_request *ra = lk_session_submit(s, &a, err, sizeof err), *rb = lk_session_submit(s, &b, err, sizeof err);
        lk_request *rc = lk_session_submit(s, &c, err, sizeof err);
        CHECKF(ra && rb && rc && lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
        lk_request_info ia, ib, ic;
        lk_request_get(ra, &ia);
        lk_request_get(rb, &ib);
        lk_request_get(rc, &ic);
        CHECKF(ia.finish == LK_FINISH_EOG && ia.n_gen == 21 && lk_tokenizer_is_eog(tok, ia.gen[20]),
               "stop at EOG: %s after %d tokens", lk_finish_to_string(ia.finish), ia.n_gen);
        CHECKF(ib.finish == LK_FINISH_LENGTH && ib.n_gen == 32 && !memcmp(ia.gen, ib.gen, sizeof(int32_t) * 21),
               "ignore_eos: %s after %d tokens", lk_finish_to_string(ib.finish), ib.n_gen);
        /* the context of 64 holds the prompt and 64 - 9 generated tokens fed; one more is sampled */
        CHECKF(ic.finish == LK_FINISH_CTX && ic.n_gen == 64 - p.n + 1, "a full context: %s after %d tokens (prompt %d)",
               lk_finish_to_string(ic.finish), ic.n_gen, p.n);
        lk_session_release(s, ra);
        lk_session_release(s, rb);
        lk_session_release(s, rc);

        /* refusals */
        int32_t bad[2] = { 1, 100000 };
        lk_request_params q = greedy((ids){ bad, 2 }, 4, &w1);
        CHECK(!lk_session_submit(s, &q, err, sizeof err) && strstr(err, "outside the vocabulary"));
        q.n_prompt = 0;
        CHECK(!lk_session_submit(s, &q, err, sizeof err) && strstr(err, "empty"));
        int32_t *big = calloc(64, sizeof(int32_t));
        q = greedy((ids){ big, 64 }, 4, &w1);
        CHECK(!lk_session_submit(s, &q, err, sizeof err) && strstr(err, "does not fit the context of 64"));
        free(big);
        /* max_new 0: done at once */
        q = greedy(p, 0, &w1);
        lk_request *rz = lk_session_submit(s, &q, err, sizeof err);
        CHECK(rz && lk_request_finish(rz) == LK_FINISH_LENGTH);
        lk_session_release(s, rz);
        /* a waiting request cancelled, a running one released half way */
        q = greedy(p, 20, &w1);
        lk_request *x = lk_session_submit(s, &q, err, sizeof err), *y = lk_session_submit(s, &q, err, sizeof err),
                   *z = lk_session_submit(s, &q, err, sizeof err);
        bool busy;
        CHECK(lk_session_step(s, &busy, err, sizeof err) == LK_OK && busy);
        CHECK(lk_session_waiting(s) == 1 && lk_session_running(s) == 2);
        lk_session_cancel(s, z);
        CHECK(lk_request_finish(z) == LK_FINISH_CANCELLED && lk_session_waiting(s) == 0);
        lk_session_release(s, y);
        CHECKF(lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
        CHECK(lk_request_finish(x) == LK_FINISH_LENGTH);
    }
    lk_session_free(s);
    free(p.v);
    lk_tokenizer_free(tok);
    lk_engine_close(e);
}

/* Callbacks may cancel and release requests, their own included, at any
 * token or at the end (ASan checks that nothing is used after release). */
typedef struct {
    lk_session *s;
    lk_request *other;      /* cancelled at token 2 */
    int         n, release_at;  /* release itself at this token (-1: at the end) */
    int        *ends;
} actor;

static bool act(void *user, lk_request *r, int32_t token, const char *piece, int n) {
    actor *a = user;
    if (token < 0) {
        (*a->ends)++;
        if (a->release_at < 0) lk_session_release(a->s, r);
        return true;
    }
    a->n++;
    if (a->other && a->n == 2) lk_session_cancel(a->s, a->other);
    if (a->release_at > 0 && a->n == a->release_at) lk_session_release(a->s, r);
    return true;
}

static void callbacks(layout l) {
    lk_engine *e = open_engine(STORIES, l, 4, 32, 256);
    if (!e) return;
    lk_tokenizer *tok = load_tok(e);
    ids p = encode(tok, TEXTS[0]);
    char err[LK_ERRLEN];
    lk_session *s = NULL;
    CHECKF(lk_session_create(e, tok, &(lk_session_opts){ 0 }, &s, err, sizeof err) == LK_OK, "%s", err);
    if (s) {
        int ends = 0;
        actor a[4] = { { s, NULL, 0, 3, &ends }, { s, NULL, 0, 0, &ends }, { s, NULL, 0, 0, &ends }, { s, NULL, 0, -1, &ends } };
        lk_request *r[4];
        for (int i = 0; i < 4; i++) {
            lk_request_params rp = { .prompt = p.v, .n_prompt = p.n, .max_new = 20, .on_token = act, .user = &a[i] };
            lk_sampler_params_default(&rp.sampling);
            rp.sampling.temp = 0;
            r[i] = lk_session_submit(s, &rp, err, sizeof err);
            CHECKF(r[i], "%s", err);
        }
        a[1].other = r[2];   /* 1 cancels 2 at its second token */
        CHECKF(lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
        CHECKF(ends == 4, "%d ends reported", ends);
        CHECKF(a[0].n == 3, "request 0 got %d tokens after releasing itself at 3", a[0].n);
        CHECKF(lk_request_finish(r[1]) == LK_FINISH_LENGTH, "request 1: %s", lk_finish_to_string(lk_request_finish(r[1])));
        CHECKF(lk_request_finish(r[2]) == LK_FINISH_CANCELLED && a[2].n <= 2 + lk_engine_depth(e),
               "request 2: %s after %d tokens", lk_finish_to_string(lk_request_finish(r[2])), a[2].n);
        CHECK(a[3].n == 20);
        lk_session_release(s, r[1]);
        lk_session_release(s, r[2]);
    }
    lk_session_free(s);
    free(p.v);
    lk_tokenizer_free(tok);
    lk_engine_close(e);
}

TEST(callbacks_cancel_and_release) { callbacks(ONE); callbacks(PP2); }

/* ======================================================================
 * no allocation in the steady state
 * ==================================================================== */

static void no_alloc(layout l) {
    lk_engine *e = open_engine(STORIES, l, 4, 64, 256);
    if (!e) return;
    lk_tokenizer *tok = load_tok(e);
    ids p[4];
    for (int i = 0; i < 4; i++) p[i] = encode(tok, TEXTS[i]);
    char err[LK_ERRLEN];
    lk_session *s = NULL;
    CHECKF(lk_session_create(e, tok, &(lk_session_opts){ 0 }, &s, err, sizeof err) == LK_OK, "%s", err);
    if (s) {
        int clock = 0;
        seen w[4];
        for (int i = 0; i < 4; i++) {
            w[i] = (seen){ .clock = &clock };
            lk_request_params rp = greedy(p[i], 80, &w[i]);
            rp.sampling.temp = 0.8f;            /* the sampled path too */
            rp.sampling.repeat_penalty = 1.1f;
            rp.sampling.seed = 7 + (uint64_t)i;
            CHECKF(lk_session_submit(s, &rp, err, sizeof err), "%s", err);
        }
        bool busy = true;
        /* until every request decodes */
        for (; busy && clock < 40 && (w[0].n_tokens < 2 || w[1].n_tokens < 2 || w[2].n_tokens < 2 || w[3].n_tokens < 2); clock++)
            CHECKF(lk_session_step(s, &busy, err, sizeof err) == LK_OK, "%s", err);
        long before = lk_test_allocs();
        int steps = 0;
        for (; busy && steps < 30; steps++, clock++) CHECKF(lk_session_step(s, &busy, err, sizeof err) == LK_OK, "%s", err);
        long after = lk_test_allocs();
        CHECKF(after == before && steps == 30, "%s: %ld allocations in %d steps of four decoding sequences", l.name,
               after - before, steps);
        CHECKF(lk_session_run(s, err, sizeof err) == LK_OK, "%s", err);
    }
    lk_session_free(s);
    for (int i = 0; i < 4; i++) free(p[i].v);
    lk_tokenizer_free(tok);
    lk_engine_close(e);
}

TEST(no_allocation_steady_state) { no_alloc(ONE); }
TEST(no_allocation_steady_state_local2) { no_alloc(TP2); }

int main(void) {
    RUN(staggered_one_node);
    RUN(staggered_tp2);
    RUN(staggered_pp2);
    RUN(all_at_once_one_node);
    RUN(all_at_once_pp2);
    RUN(prefix_reuse_one_slot);
    RUN(prefix_reuse_four_slots);
    RUN(prefix_reuse_tp2);
    RUN(prefix_reuse_pp2);
    RUN(stop_conditions);
    RUN(callbacks_cancel_and_release);
    RUN(no_allocation_steady_state);
    RUN(no_allocation_steady_state_local2);
    return lk_test_end();
}
