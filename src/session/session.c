/* The session: requests, the scheduler that runs them as concurrent
 * sequences of one engine, and prefix reuse (session.h has the contract).
 *
 * State, all sized at lk_session_create:
 *   - slots[n_slots]: per engine slot, FREE, KEPT (a finished request's KV,
 *     kept for prefix reuse) or ACTIVE (a running request's), with the token
 *     ids at its positions, so a new prompt can be matched against it;
 *   - run[]: the running requests in the order they started (prompt chunks
 *     are handed out in that order, so earlier requests get their first
 *     token first); the waiting requests are a FIFO through the requests;
 *   - steps[depth]: a ring of the steps in flight (items, their requests,
 *     the tokens the engine returns).
 * A request's tokens on the way in: its prompt positions [0, fed) are in the
 * slot (reused ones included); after its last prompt chunk every step
 * returns a token, which the next step feeds (`next`, has_next) unless the
 * request stops there. So a slot holds prompt + gen[0 .. n_gen-1): the last
 * sampled token is never fed. */
#include "session/session.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { SLOT_FREE, SLOT_KEPT, SLOT_ACTIVE };

typedef struct {
    int         state;
    int32_t    *toks;   /* (n_ctx) the ids at positions [0, len) */
    int         len;    /* positions once the submitted steps apply (= lk_engine_seq_len) */
    int         done;   /* positions whose steps were collected (what a fork may share of an ACTIVE slot) */
    uint64_t    used;   /* last use, for giving up KEPT slots least recently used first */
    lk_request *r;      /* ACTIVE: its request */
} slot;

struct lk_request {
    lk_session       *s;
    int32_t          *prompt;      /* (n_prompt) a copy */
    int               n_prompt;
    int32_t          *gen;         /* (cap_gen) */
    int               n_gen, cap_gen;
    lk_sampler_params sp;
    int               n_cand, max_new;
    bool              ignore_eos;
    lk_request_cb     cb;
    void             *user;
    int               limit;       /* most positions its sequence may hold (pages are promised for them) */
    int               seq;         /* -1 until it starts */
    int               fed;         /* prompt positions in the slot (reused + submitted) */
    int               n_reused;
    int32_t           next;        /* the last sampled token, fed by the next step if has_next */
    bool              has_next, in_flight, cancel, released, waiting;
    bool              in_cb;       /* its callback runs: cancel and release wait until it returns */
    lk_finish         finish;
    lk_detok          dt;
    double            t_submit, t_start, t_first, t_done, comm;
    lk_request       *qnext;       /* the waiting FIFO */
    lk_request       *prev, *nxt;  /* every request not yet released */
};

typedef struct {
    lk_engine_item *items;   /* (n_slots) */
    lk_request    **reqs;    /* (n_slots) item i's request */
    bool           *decode;  /* (n_slots) item i feeds a sampled token */
    int32_t        *next;    /* (n_slots) what collect returns */
    int             n;
} step_rec;

struct lk_session {
    lk_engine          *e;
    const lk_tokenizer *tok;
    int                 n_slots, n_ctx, n_batch, depth, page, parallel;
    int64_t             n_vocab;
    bool                reuse, failed;
    /* the model keeps recurrent per-sequence state (qwen35moe; model.h):
     * a slot's state exists only for all it holds, so only a KEPT slot's
     * whole content is reused (continued, or forked with its state copied),
     * never a prefix of it, and never a running slot's */
    bool                recurrent;
    slot               *slots;      /* (n_slots) */
    lk_request        **run;        /* (n_slots) running, in start order */
    int                 n_run, rr;  /* rr: where the decode round starts (fairness when n_batch < n_run) */
    lk_request         *wait_head, *wait_tail;
    int                 n_wait;
    lk_request         *all;        /* every unreleased request */
    step_rec           *steps;      /* (depth) ring */
    int                 head, n_flight;
    int                 cb_item;    /* the collected step's item whose token a callback is handed (-1: none) */
    char               *piece;      /* (piece_cap) one token's text */
    int32_t             piece_cap;
    uint64_t            clock;
};

const char *lk_finish_to_string(lk_finish f) {
    switch (f) {
    case LK_FINISH_NONE: return "running";
    case LK_FINISH_EOG: return "end of generation";
    case LK_FINISH_LENGTH: return "length";
    case LK_FINISH_CTX: return "context full";
    case LK_FINISH_KV: return "KV budget full";
    case LK_FINISH_STOPPED: return "stopped";
    case LK_FINISH_CANCELLED: return "cancelled";
    case LK_FINISH_ERROR: return "engine error";
    }
    return "?";
}

/* ======================================================================
 * life cycle
 * ==================================================================== */

lk_status lk_session_create(lk_engine *e, const lk_tokenizer *tok, const lk_session_opts *o, lk_session **out,
                            char *err, size_t errlen) {
    *out = NULL;
    lk_session_opts d = { 0 };
    if (!o) o = &d;
    if (o->parallel < 0) return lk_fail(err, errlen, LK_ERR_ARG, "parallel must be >= 0 (got %d)", o->parallel);
    lk_session *s = lk_xcalloc(1, sizeof *s);
    s->e = e;
    s->tok = tok;
    s->n_slots = lk_engine_max_seqs(e);
    s->n_ctx = lk_engine_n_ctx(e);
    s->n_batch = lk_engine_n_batch(e);
    s->depth = LK_MAX(1, lk_engine_depth(e));
    s->page = LK_MAX(1, lk_engine_page_tokens(e));
    s->n_vocab = lk_engine_cfg(e)->n_vocab;
    LK_ASSERT(s->n_slots >= 1 && s->n_ctx >= 1 && s->n_batch >= 1);
    s->parallel = o->parallel > 0 ? LK_MIN(o->parallel, s->n_slots) : s->n_slots;
    s->reuse = !o->no_reuse;
    s->recurrent = lk_engine_cfg(e)->n_recurrent > 0;
    s->slots = lk_xcalloc((size_t)s->n_slots, sizeof(slot));
    for (int i = 0; i < s->n_slots; i++) {
        s->slots[i].toks = lk_xmalloc(sizeof(int32_t) * (size_t)s->n_ctx);
        /* slots the engine already holds (another session before this one)
         * are not known token by token: free them */
        if (lk_engine_seq_len(e, i) > 0) {
            lk_status st = lk_engine_seq_keep(e, i, 0, err, errlen);
            if (st) { lk_session_free(s); return st; }
        }
    }
    s->run = lk_xcalloc((size_t)s->n_slots, sizeof(lk_request *));
    s->steps = lk_xcalloc((size_t)s->depth, sizeof(step_rec));
    for (int i = 0; i < s->depth; i++) {
        step_rec *r = &s->steps[i];
        r->items = lk_xcalloc((size_t)s->n_slots, sizeof(lk_engine_item));
        r->reqs = lk_xcalloc((size_t)s->n_slots, sizeof(lk_request *));
        r->decode = lk_xcalloc((size_t)s->n_slots, sizeof(bool));
        r->next = lk_xcalloc((size_t)s->n_slots, sizeof(int32_t));
    }
    s->piece_cap = tok ? 3 * (lk_tokenizer_max_piece(tok) + 4) : 16; /* enough for any token (tokenizer.h) */
    s->piece = lk_xmalloc((size_t)s->piece_cap);
    s->cb_item = -1;
    *out = s;
    return LK_OK;
}

static void request_free(lk_session *s, lk_request *r) {
    if (r->prev) r->prev->nxt = r->nxt;
    else s->all = r->nxt;
    if (r->nxt) r->nxt->prev = r->prev;
    free(r->prompt);
    free(r->gen);
    free(r);
}

void lk_session_free(lk_session *s) {
    if (!s) return;
    while (s->all) request_free(s, s->all);
    for (int i = 0; s->slots && i < s->n_slots; i++) free(s->slots[i].toks);
    free(s->slots);
    free(s->run);
    for (int i = 0; s->steps && i < s->depth; i++) {
        free(s->steps[i].items);
        free(s->steps[i].reqs);
        free(s->steps[i].decode);
        free(s->steps[i].next);
    }
    free(s->steps);
    free(s->piece);
    free(s);
}

int lk_session_parallel(const lk_session *s) { return s->parallel; }
int lk_session_waiting(const lk_session *s) { return s->n_wait; }
int lk_session_running(const lk_session *s) { return s->n_run; }

/* ======================================================================
 * requests
 * ==================================================================== */

static int64_t pages_for(const lk_session *s, int64_t positions) { return (positions + s->page - 1) / s->page; }

lk_request *lk_session_submit(lk_session *s, const lk_request_params *p, char *err, size_t errlen) {
    if (s->failed) {
        lk_fail(err, errlen, LK_ERR_PEER, "the engine failed earlier; no request can run");
        return NULL;
    }
    if (p->n_cand < 0) {
        lk_fail(err, errlen, LK_ERR_ARG, "n_cand must be >= 0 (got %d)", p->n_cand);
        return NULL;
    }
    if (!p->prompt || p->n_prompt <= 0) {
        lk_fail(err, errlen, LK_ERR_ARG, "the prompt is empty");
        return NULL;
    }
    if (p->n_prompt >= s->n_ctx) {
        lk_fail(err, errlen, LK_ERR_ARG, "the prompt has %d tokens, which does not fit the context of %d (--ctx)",
                p->n_prompt, s->n_ctx);
        return NULL;
    }
    for (int i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= s->n_vocab) {
            lk_fail(err, errlen, LK_ERR_ARG, "prompt token %d (id %d) is outside the vocabulary (%lld)", i, p->prompt[i],
                    (long long)s->n_vocab);
            return NULL;
        }
    int64_t total = lk_engine_pages_total(s->e);
    if (pages_for(s, p->n_prompt + 1) > total) {
        lk_fail(err, errlen, LK_ERR_ARG,
                "the prompt has %d tokens; with its first reply token that is %lld KV pages of %d positions, "
                "and the KV budget has %lld pages (--kv-budget)",
                p->n_prompt, (long long)pages_for(s, p->n_prompt + 1), s->page, (long long)total);
        return NULL;
    }
    lk_request *r = lk_xcalloc(1, sizeof *r);
    r->s = s;
    r->n_prompt = p->n_prompt;
    r->prompt = lk_xmalloc(sizeof(int32_t) * (size_t)p->n_prompt);
    memcpy(r->prompt, p->prompt, sizeof(int32_t) * (size_t)p->n_prompt);
    /* at most one token per position left, plus the last one (never fed) */
    int room = s->n_ctx - p->n_prompt + 1;
    r->cap_gen = p->max_new >= 0 ? LK_MIN(p->max_new, room) : room;
    r->gen = lk_xmalloc(sizeof(int32_t) * (size_t)LK_MAX(1, r->cap_gen));
    r->sp = p->sampling;
    r->n_cand = p->n_cand;
    r->max_new = p->max_new;
    r->ignore_eos = p->ignore_eos;
    r->cb = p->on_token;
    r->user = p->user;
    r->limit = p->max_new >= 0 ? (int)LK_MIN((int64_t)s->n_ctx, (int64_t)p->n_prompt + p->max_new - 1) : s->n_ctx;
    r->limit = LK_MAX(r->limit, p->n_prompt);
    r->seq = -1;
    r->t_submit = lk_time_s();
    if (s->tok) lk_detok_init(&r->dt, s->tok);
    r->nxt = s->all;
    if (s->all) s->all->prev = r;
    s->all = r;
    if (p->max_new == 0) {          /* nothing to generate: done without a step */
        r->finish = LK_FINISH_LENGTH;
        r->t_start = r->t_first = r->t_done = r->t_submit;
        if (r->cb) r->cb(r->user, r, -1, s->piece, 0);
        return r;
    }
    r->waiting = true;
    if (s->wait_tail) s->wait_tail->qnext = r;
    else s->wait_head = r;
    s->wait_tail = r;
    s->n_wait++;
    return r;
}

static void unqueue(lk_session *s, lk_request *r) {
    lk_request **pp = &s->wait_head, *prev = NULL;
    while (*pp && *pp != r) { prev = *pp; pp = &(*pp)->qnext; }
    LK_ASSERT(*pp == r);
    *pp = r->qnext;
    if (s->wait_tail == r) s->wait_tail = prev;
    r->qnext = NULL;
    r->waiting = false;
    s->n_wait--;
}

/* Ends r: its slot is kept for reuse (or freed), the callback hears the end,
 * and a released request goes away. r is not in a step in flight. */
static void finish(lk_session *s, lk_request *r, lk_finish why) {
    LK_ASSERT(!r->in_flight && r->finish == LK_FINISH_NONE);
    r->finish = why;
    r->t_done = lk_time_s();
    if (r->waiting) unqueue(s, r);
    if (r->seq >= 0) {
        int i = 0;
        while (i < s->n_run && s->run[i] != r) i++;
        LK_ASSERT(i < s->n_run);
        memmove(s->run + i, s->run + i + 1, sizeof(lk_request *) * (size_t)(s->n_run - i - 1));
        s->n_run--;
        if (s->rr > i) s->rr--;
        slot *sl = &s->slots[r->seq];
        sl->r = NULL;
        sl->used = ++s->clock;
        sl->state = SLOT_KEPT;
        if (s->failed) {                  /* the engine's state is unknown */
            sl->state = SLOT_FREE;
            sl->len = sl->done = 0;
        } else if (!s->reuse || sl->len == 0) {
            char e2[LK_ERRLEN];
            lk_status st = lk_engine_seq_keep(s->e, r->seq, 0, e2, sizeof e2);
            LK_ASSERT(st == LK_OK);       /* a slot number of ours */
            sl->state = SLOT_FREE;
            sl->len = sl->done = 0;
        }
    }
    int32_t n = s->tok ? lk_detok_flush(&r->dt, s->piece, s->piece_cap) : 0;
    if (r->cb) {
        r->in_cb = true;
        r->cb(r->user, r, -1, s->piece, LK_MAX(n, 0));
        r->in_cb = false;
    }
    if (r->released) request_free(s, r);
}

void lk_session_cancel(lk_session *s, lk_request *r) {
    if (r->finish != LK_FINISH_NONE) return;
    if (r->in_flight || r->in_cb) r->cancel = true;  /* once its step is collected / its callback returned */
    else finish(s, r, LK_FINISH_CANCELLED);
}

void lk_session_release(lk_session *s, lk_request *r) {
    if (!r) return;
    r->released = true;
    if (r->finish == LK_FINISH_NONE) lk_session_cancel(s, r);  /* frees it, now or when it ends */
    else if (!r->in_cb) request_free(s, r);                  /* else finish() frees it after the callback */
}

void lk_request_get(const lk_request *r, lk_request_info *o) {
    *o = (lk_request_info){ .finish = r->finish, .prompt = r->prompt, .n_prompt = r->n_prompt, .gen = r->gen,
                            .n_gen = r->n_gen, .n_reused = r->n_reused, .seq = r->seq, .t_submit = r->t_submit,
                            .t_start = r->t_start, .t_first = r->t_first, .t_done = r->t_done,
                            .decode_comm_s = r->comm };
}
lk_finish lk_request_finish(const lk_request *r) { return r->finish; }

int lk_request_candidates(const lk_request *r, const int32_t **ids, const float **vals) {
    const lk_session *s = r->s;
    if (s->cb_item < 0 || !r->in_cb) return 0;
    return lk_engine_candidates(s->e, s->cb_item, ids, vals);
}
float lk_request_candidates_lse(const lk_request *r) {
    const lk_session *s = r->s;
    if (s->cb_item < 0 || !r->in_cb) return NAN;
    return lk_engine_candidates_lse(s->e, s->cb_item);
}
void *lk_request_user(const lk_request *r) { return r->user; }

/* ======================================================================
 * starting requests: slots, prefix reuse, pages
 * ==================================================================== */

/* Pages the running requests may still take (what they were promised). */
static int64_t pages_promised(const lk_session *s) {
    int64_t n = 0;
    for (int i = 0; i < s->n_run; i++) {
        const lk_request *r = s->run[i];
        int more = r->limit - s->slots[r->seq].len;
        if (more > 0) n += lk_engine_pages_needed(s->e, r->seq, more);
    }
    return n;
}

/* The slot holding the longest prefix of prompt[0 .. n_prompt-1) (the last
 * prompt token is always fed: its logits pick the first token). An ACTIVE
 * slot offers only positions already computed. Ties: a KEPT slot, then the
 * most recently used. */
static int best_match(const lk_session *s, const lk_request *r, int *common) {
    int best = -1, bc = 0;
    for (int i = 0; i < s->n_slots; i++) {
        const slot *sl = &s->slots[i];
        if (sl->state == SLOT_FREE || (s->recurrent && sl->state != SLOT_KEPT)) continue;
        int n = LK_MIN(sl->state == SLOT_KEPT ? sl->len : sl->done, r->n_prompt - 1), c = 0;
        while (c < n && sl->toks[c] == r->prompt[c]) c++;
        /* a recurrent state is there only for a slot's whole content; a
         * sliding-window layer's ring may no longer hold the window of that
         * prefix's end (model.h): then it is recomputed */
        if (c == 0 || (s->recurrent && c != sl->len) || !lk_engine_seq_can_keep(s->e, i, c)) continue;
        bool better = c > bc;
        if (!better && c == bc && best >= 0) {
            const slot *b = &s->slots[best];
            better = (sl->state == SLOT_KEPT && b->state != SLOT_KEPT) ||
                     (sl->state == b->state && sl->used > b->used);
        }
        if (better) { best = i; bc = c; }
    }
    *common = bc;
    return best;
}

/* Whether a running request is still computing a prompt prefix r shares
 * with it, whole pages more than the c positions r could reuse now: then r
 * waits for it (two prompts with one system prompt arriving together: the
 * second forks the first's pages instead of computing them beside it). */
static bool prefix_coming(const lk_session *s, const lk_request *r, int c) {
    if (s->recurrent) return false; /* a running slot's prefix is never forked */
    for (int i = 0; i < s->n_run; i++) {
        const lk_request *a = s->run[i];
        int n = LK_MIN(a->n_prompt, r->n_prompt - 1), k = 0;
        while (k < n && a->prompt[k] == r->prompt[k]) k++;
        k -= k % s->page;
        if (k > c && s->slots[a->seq].done < k) return true;
    }
    return false;
}

/* The KEPT slot used least recently, other than a and b; -1 if none. */
static int lru_kept(const lk_session *s, int a, int b) {
    int best = -1;
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].state == SLOT_KEPT && i != a && i != b && (best < 0 || s->slots[i].used < s->slots[best].used))
            best = i;
    return best;
}

static lk_status evict(lk_session *s, int i, char *err, size_t errlen) {
    lk_status st = lk_engine_seq_keep(s->e, i, 0, err, errlen);
    s->slots[i].state = SLOT_FREE;
    s->slots[i].len = s->slots[i].done = 0;
    return st;
}

/* Starts the oldest waiting request if a slot and its pages are there.
 * *started: whether it did (or ended it: it can never get its pages).
 *
 * Where it goes:
 *   - a KEPT slot whose whole content begins the prompt (chat's next turn,
 *     or the same prompt again): that slot, continued;
 *   - else a FREE slot, or the least recently used KEPT one; it forks the
 *     slot sharing the longest prefix when that covers at least a whole page
 *     (shared pages cost nothing; a page partly shared is copied on the
 *     first write, so less is not worth it), or continues it when the slot
 *     given up is that very slot;
 *   - it waits while a running request is still computing whole pages of
 *     a prefix they share (prefix_coming).
 * Pages: those it may take (prompt + max_new, minus the whole pages it
 * shares) must fit beside what the running requests were promised; KEPT
 * slots are given up for them, least recently used first. When nothing runs
 * and it still does not fit, it starts anyway (reuse dropped) if its prompt
 * and one token fit: it may then end with LK_FINISH_KV. */
static lk_status admit_one(lk_session *s, bool *started, char *err, size_t errlen) {
    *started = false;
    lk_request *r = s->wait_head;
    if (!r || s->n_run >= s->parallel) return LK_OK;
    int c = 0, src = s->reuse ? best_match(s, r, &c) : -1, dst = -1;
    if (s->reuse && prefix_coming(s, r, c)) return LK_OK;
    lk_status st;
    /* a continuation: the prompt covers all the slot holds (or all but its
     * last position, which has to be fed again for its logits) */
    if (src >= 0 && s->slots[src].state == SLOT_KEPT &&
        (c == s->slots[src].len || (c == r->n_prompt - 1 && c == s->slots[src].len - 1))) {
        dst = src;
    } else {
        for (int i = 0; i < s->n_slots && dst < 0; i++)
            if (s->slots[i].state == SLOT_FREE) dst = i;
        if (dst < 0) dst = lru_kept(s, -1, -1);
        LK_ASSERT(dst >= 0);  /* fewer requests run than there are slots */
        if (dst != src && c < s->page) src = -1, c = 0;
        if (dst != src && s->slots[dst].state == SLOT_KEPT && (st = evict(s, dst, err, errlen))) return st;
    }
    slot *d = &s->slots[dst];
    if (src == dst && c < d->len) {    /* continued: what follows the shared part goes now */
        if ((st = lk_engine_seq_keep(s->e, dst, c, err, errlen))) return st;
        d->len = d->done = c;
    }
    int64_t need = pages_for(s, r->limit) - c / s->page;
    int64_t promised = pages_promised(s), avail = lk_engine_pages_free(s->e) - promised;
    while (need > avail) {
        int v = lru_kept(s, src, dst);
        if (v < 0) break;
        if ((st = evict(s, v, err, errlen))) return st;
        avail = lk_engine_pages_free(s->e) - promised;
    }
    if (need > avail) {
        if (s->n_run > 0) return LK_OK;  /* wait for running requests to end */
        for (int i = 0; i < s->n_slots; i++)
            if (s->slots[i].state == SLOT_KEPT && (st = evict(s, i, err, errlen))) return st;
        src = -1;
        c = 0;
        if (pages_for(s, r->n_prompt + 1) > lk_engine_pages_free(s->e)) {
            /* the pages are held outside this session */
            finish(s, r, LK_FINISH_KV);
            *started = true;
            return LK_OK;
        }
    }
    if (src >= 0 && src != dst) {
        if ((st = lk_engine_seq_fork(s->e, dst, src, c, err, errlen))) return st;
        memcpy(d->toks, s->slots[src].toks, sizeof(int32_t) * (size_t)c);
        s->slots[src].used = ++s->clock;
    }
    if ((st = lk_engine_seq_params(s->e, dst, &r->sp, r->n_cand, err, errlen))) return st;
    unqueue(s, r);
    d->state = SLOT_ACTIVE;
    d->r = r;
    d->len = d->done = c;
    d->used = ++s->clock;
    r->seq = dst;
    r->fed = r->n_reused = c;
    r->t_start = lk_time_s();
    s->run[s->n_run++] = r;
    *started = true;
    return LK_OK;
}

/* ======================================================================
 * steps
 * ==================================================================== */

/* Fills rec with the next step: one decode token per ready sequence (round
 * robin from rr when they outnumber the token budget), then prompt chunks in
 * start order for the rest of the budget. With pipeline stages a step takes
 * only its share of the running sequences (ceil(running / depth)), so that
 * depth steps in flight keep every stage busy. A sequence whose next
 * positions find no free page ends (LK_FINISH_KV; only a request started
 * without its full promise can meet this). Returns the number of items. */
static int build(lk_session *s, step_rec *rec) {
    int budget = s->n_batch, cap = s->n_slots;
    if (s->depth > 1) cap = LK_MIN(cap, (s->n_run + s->depth - 1) / s->depth);
    int64_t avail = lk_engine_pages_free(s->e);
    rec->n = 0;
    for (int k = 0, n_run = s->n_run; k < n_run && rec->n < cap && budget > 0; k++) {
        int i = (s->rr + k) % n_run;
        lk_request *r = s->run[i];
        if (r->in_flight || !r->has_next) continue;
        slot *sl = &s->slots[r->seq];
        int64_t need = lk_engine_pages_needed(s->e, r->seq, 1);
        if (need > avail) continue;   /* ended below */
        avail -= need;
        sl->toks[sl->len] = r->next;
        rec->items[rec->n] = (lk_engine_item){ .seq = r->seq, .n = 1, .tokens = &sl->toks[sl->len], .sample = true };
        rec->reqs[rec->n] = r;
        rec->decode[rec->n++] = true;
        sl->len++;
        r->has_next = false;
        r->in_flight = true;
        budget--;
    }
    if (s->n_run) s->rr = (s->rr + rec->n) % s->n_run;
    for (int i = 0; i < s->n_run && rec->n < cap && budget > 0; i++) {
        lk_request *r = s->run[i];
        if (r->in_flight || r->fed >= r->n_prompt) continue;
        slot *sl = &s->slots[r->seq];
        int n = LK_MIN(r->n_prompt - r->fed, budget);
        int64_t need = lk_engine_pages_needed(s->e, r->seq, n);
        if (need > avail) continue;
        avail -= need;
        memcpy(sl->toks + sl->len, r->prompt + r->fed, sizeof(int32_t) * (size_t)n);
        rec->items[rec->n] = (lk_engine_item){ .seq = r->seq, .n = n, .tokens = r->prompt + r->fed,
                                               .sample = r->fed + n == r->n_prompt };
        rec->reqs[rec->n] = r;
        rec->decode[rec->n++] = false;
        sl->len += n;
        r->fed += n;
        r->in_flight = true;
        budget -= n;
    }
    /* ready sequences left out for want of pages end here, unless a step in
     * flight may still free some (then they wait) */
    if (rec->n == 0 && s->n_flight == 0)
        for (int i = s->n_run - 1; i >= 0; i--) {
            if (i >= s->n_run) continue;  /* a callback ended others */
            lk_request *r = s->run[i];
            if (!r->in_flight && (r->has_next || r->fed < r->n_prompt)) finish(s, r, LK_FINISH_KV);
        }
    return rec->n;
}

/* A token for r: stored, turned into text, handed to the callback, then the
 * stop conditions in the order the single-stream commands always had. */
static void deliver(lk_session *s, lk_request *r, int32_t t) {
    LK_ASSERT(t >= 0 && t < s->n_vocab && r->n_gen < r->cap_gen);  /* the engine checked the candidates */
    r->gen[r->n_gen++] = t;
    if (r->n_gen == 1) r->t_first = lk_time_s();
    bool eog = s->tok && !r->ignore_eos && lk_tokenizer_is_eog(s->tok, t);
    int32_t n = s->tok && !eog ? lk_detok_push(&r->dt, t, s->piece, s->piece_cap) : 0;
    bool go_on = true;
    if (r->cb) {
        r->in_cb = true;
        go_on = r->cb(r->user, r, t, s->piece, LK_MAX(n, 0));
        r->in_cb = false;
    }
    lk_finish why = eog                                      ? LK_FINISH_EOG
                  : r->max_new >= 0 && r->n_gen >= r->max_new ? LK_FINISH_LENGTH
                  : !go_on                                   ? LK_FINISH_STOPPED
                  : r->cancel                                ? LK_FINISH_CANCELLED
                  : s->slots[r->seq].len + 1 > s->n_ctx      ? LK_FINISH_CTX
                                                             : LK_FINISH_NONE;
    if (why != LK_FINISH_NONE) {
        finish(s, r, why);
        return;
    }
    r->next = t;
    r->has_next = true;
}

/* The engine failed: its state is unknown, every request ends. */
static lk_status fail_all(lk_session *s, lk_status st) {
    s->failed = true;
    for (int k = 0; k < s->n_flight; k++) {
        step_rec *rec = &s->steps[(s->head + k) % s->depth];
        for (int i = 0; i < rec->n; i++) rec->reqs[i]->in_flight = false;
    }
    s->n_flight = 0;
    while (s->n_run) finish(s, s->run[s->n_run - 1], LK_FINISH_ERROR);
    while (s->wait_head) finish(s, s->wait_head, LK_FINISH_ERROR);
    return st;
}

static lk_status collect(lk_session *s, char *err, size_t errlen) {
    step_rec *rec = &s->steps[s->head];
    lk_status st = lk_engine_collect(s->e, rec->next, err, errlen);
    if (st) return fail_all(s, st);
    s->head = (s->head + 1) % s->depth;
    s->n_flight--;
    double compute, comm;
    lk_engine_last_timing(s->e, &compute, &comm);
    for (int i = 0; i < rec->n; i++) {
        lk_request *r = rec->reqs[i];
        s->slots[r->seq].done += rec->items[i].n;
        if (rec->decode[i]) r->comm += comm;
    }
    /* A callback may cancel or release any request: those of this step
     * still count as in flight until their turn, so they only take note. */
    for (int i = 0; i < rec->n; i++) {
        lk_request *r = rec->reqs[i];
        r->in_flight = false;
        s->cb_item = i;
        if (rec->items[i].sample) deliver(s, r, rec->next[i]);
        else if (r->cancel) finish(s, r, LK_FINISH_CANCELLED);
        s->cb_item = -1;
    }
    return LK_OK;
}

lk_status lk_session_step(lk_session *s, bool *busy, char *err, size_t errlen) {
    *busy = false;
    if (s->failed) return lk_fail(err, errlen, LK_ERR_PEER, "the engine failed earlier; no request can run");
    lk_status st;
    for (bool started = true; started;)
        if ((st = admit_one(s, &started, err, errlen))) return fail_all(s, st);
    while (s->n_flight < s->depth) {
        step_rec *rec = &s->steps[(s->head + s->n_flight) % s->depth];
        if (build(s, rec) == 0) break;
        if ((st = lk_engine_submit(s->e, rec->items, rec->n, err, errlen))) {
            for (int i = 0; i < rec->n; i++) rec->reqs[i]->in_flight = false;  /* built, never sent */
            return fail_all(s, st);
        }
        s->n_flight++;
    }
    if (s->n_flight > 0 && (st = collect(s, err, errlen))) return st;
    *busy = s->n_run > 0 || s->n_wait > 0 || s->n_flight > 0;
    return LK_OK;
}

lk_status lk_session_run(lk_session *s, char *err, size_t errlen) {
    for (bool busy = true; busy;) {
        lk_status st = lk_session_step(s, &busy, err, errlen);
        if (st) return st;
    }
    return LK_OK;
}
