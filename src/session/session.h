/* session — requests over one engine, and conversations rendered into
 * them: what `run`, `chat` and `serve` drive.
 *
 * A request is a prompt (token ids), sampling settings, a limit of new
 * tokens and its stop conditions. The session runs many requests as
 * concurrent sequences (engine slots) of one lk_engine:
 *
 *   - every step carries one decode token per running sequence, then chunks
 *     of prompts filling the rest of the engine's token budget
 *     (lk_engine_n_batch): chunked prefill, so a long prompt does not stall
 *     the streams already running;
 *   - at most `parallel` requests run at once; the others wait, and start in
 *     arrival order (a request never overtakes an earlier one);
 *   - a request starts only when the KV pages it may still take (its prompt
 *     plus max_new tokens, capped by the context) fit beside what the running
 *     ones may still take, so a running request never runs out of pages;
 *   - with pipeline stages (lk_engine_depth() > 1) up to depth steps are in
 *     flight, each on its own share of the sequences, so every stage works;
 *   - a finished request's slot keeps its KV (prompt and reply) for prefix
 *     reuse: a new request whose prompt starts with tokens a slot holds
 *     continues that slot (chat's next turn) or forks it (two requests with
 *     one system prompt; a running sequence's prompt) instead of computing
 *     those positions again. Kept slots are given up, least recently used
 *     first, when a slot or pages are needed. `no_reuse` frees them at once.
 *
 * A request stops at an end-of-generation token (unless ignore_eos), after
 * max_new tokens, when its sequence fills the context (--ctx), when its token
 * callback returns false, or when it is cancelled. (Stop strings: later.)
 *
 * Determinism: the engine is batch invariant, so a greedy request gives the
 * same tokens whatever runs beside it and whatever prefix it reused; a
 * sampled one too (its sampler is its slot's, seeded by its own settings).
 *
 * Ownership and threading: the session borrows the engine and the tokenizer
 * (both outlive it) and is driven by the engine's one thread. A request is
 * created by lk_session_submit and lives until lk_session_release (after it
 * finished: its results stay readable until then). Submitting copies the
 * prompt and sizes the request's buffers; lk_session_create sizes everything
 * else, so steps allocate nothing. */
#ifndef LK_SESSION_H
#define LK_SESSION_H

#include "common/lk_common.h"
#include "engine/engine.h"
#include "sampler/sampler.h"
#include "tokenizer/tokenizer.h"

typedef enum {
    LK_FINISH_NONE = 0,   /* waiting or running */
    LK_FINISH_EOG,        /* an end-of-generation token (the last generated token) */
    LK_FINISH_LENGTH,     /* max_new tokens */
    LK_FINISH_CTX,        /* the sequence filled the context (--ctx) */
    LK_FINISH_KV,         /* the KV budget had no page left (--kv-budget) */
    LK_FINISH_STOPPED,    /* the token callback returned false */
    LK_FINISH_CANCELLED,  /* lk_session_cancel / release */
    LK_FINISH_ERROR,      /* the engine failed (lk_session_step returned its status) */
} lk_finish;
const char *lk_finish_to_string(lk_finish f);

typedef struct lk_session lk_session;
typedef struct lk_request lk_request;

/* Called for every generated token right after it is sampled, in order:
 * `piece` is its printable text (n bytes; 0 for a control token, an
 * end-of-generation token, or the first bytes of a UTF-8 character still
 * waiting for the rest). Return false to stop the request after this token.
 * Called once more when the request finishes, with token -1 and whatever
 * text was still pending (lk_request_finish tells why; the return value is
 * ignored). Must not call lk_session_step; may cancel or submit. */
typedef bool (*lk_request_cb)(void *user, lk_request *r, int32_t token, const char *piece, int n);

typedef struct {
    const int32_t *prompt;       /* copied by submit */
    int   n_prompt;              /* >= 1 and below the context */
    lk_sampler_params sampling;
    int   max_new;               /* most new tokens; < 0: until a stop or a full context */
    bool  ignore_eos;            /* keep going after end-of-generation tokens */
    int   n_cand;                /* > 0: candidates each rank sends (at most the engine's 1024; 0: the sampler's) */
    lk_request_cb on_token;      /* optional */
    void *user;
} lk_request_params;

typedef struct {
    int  parallel;   /* most requests running at once (0, or more than the engine has: all its slots) */
    bool no_reuse;   /* free a finished request's KV at once (no prefix reuse) */
} lk_session_opts;

/* tok may be NULL (no text, no end-of-generation stops). */
lk_status lk_session_create(lk_engine *e, const lk_tokenizer *tok, const lk_session_opts *o, lk_session **out,
                            char *err, size_t errlen);
/* Releases every request (their slots' KV stays in the engine). */
void      lk_session_free(lk_session *s);

/* Queues a request. NULL with a message for one that can never run (empty,
 * token ids outside the vocabulary, a prompt that fills the context, more KV
 * pages than the budget has). */
lk_request *lk_session_submit(lk_session *s, const lk_request_params *p, char *err, size_t errlen);
/* Stops a request: a waiting one at once, a running one after its current step. */
void        lk_session_cancel(lk_session *s, lk_request *r);
/* Gives a request back (cancelling it first if it has not finished). */
void        lk_session_release(lk_session *s, lk_request *r);

/* One round: starts waiting requests, submits steps until lk_engine_depth()
 * are in flight, collects the oldest and hands out its tokens (callbacks).
 * *busy: requests are still waiting or running afterwards. An engine failure
 * (a peer gone) returns its status with the message: every unfinished
 * request then ends with LK_FINISH_ERROR and the engine's state is unknown. */
lk_status lk_session_step(lk_session *s, bool *busy, char *err, size_t errlen);
/* Steps until no request waits or runs. */
lk_status lk_session_run(lk_session *s, char *err, size_t errlen);

int lk_session_parallel(const lk_session *s);   /* requests that may run at once */
int lk_session_waiting(const lk_session *s);
int lk_session_running(const lk_session *s);

/* ---- a request's results (valid until it is released) ---- */
typedef struct {
    lk_finish      finish;       /* LK_FINISH_NONE while waiting or running */
    const int32_t *prompt;       /* (n_prompt) */
    int            n_prompt;
    const int32_t *gen;          /* (n_gen) generated tokens, an ending end-of-generation token included */
    int            n_gen;
    int            n_reused;     /* prompt positions taken from a kept or running slot, not computed */
    int            seq;          /* the engine slot it runs or ran in (-1 before it started) */
    double         t_submit, t_start, t_first, t_done;  /* lk_time_s(): queued, started, first token, finished */
    double         decode_comm_s; /* network wait of the steps that decoded its tokens (head's view) */
} lk_request_info;
void      lk_request_get(const lk_request *r, lk_request_info *out);
lk_finish lk_request_finish(const lk_request *r);
/* Inside the token callback of a generated token: the candidates it was
 * picked from (merged over the ranks, best first, values are the logits
 * after the penalties, before temperature); returns their count (0 outside
 * such a callback). Request n_cand to get more than the sampler needs. */
int       lk_request_candidates(const lk_request *r, const int32_t **ids, const float **vals);
/* ... and their log-sum-exp over the whole vocabulary (NaN when n_cand is 0). */
float     lk_request_candidates_lse(const lk_request *r);
void     *lk_request_user(const lk_request *r);

/* ---- conversations: chat messages rendered into prompt tokens ----------------
 *
 * What `chat` and the server's chat completions send: the messages rendered
 * by a chat template (tokenizer/chat_template.h) ending with the opening of
 * an assistant turn, then tokenised as llama.cpp tokenises them (BOS as the
 * model says, unless the template wrote it). The template's own control
 * tokens count as such; control-token text inside a message
 * ("<|im_end|><|im_start|>system ..." typed by a user or spelled out by the
 * model) stays text, so nobody can close their turn and open another. Each
 * request of a conversation starts with the previous one's tokens, so the
 * session continues the slot holding them (prefix reuse): a long
 * conversation costs one new turn per turn. The conversation borrows the
 * tokenizer and the template source; one thread uses it. */
typedef struct lk_conv lk_conv;

lk_status   lk_conv_create(const lk_tokenizer *tok, const char *tmpl, lk_conv **out, char *err, size_t errlen);
void        lk_conv_free(lk_conv *c);
/* Appends a message (copied; role "system", "user", "assistant", ...). */
void        lk_conv_push(lk_conv *c, const char *role, const char *content);
/* As lk_conv_push, with the message's other members as the template sees
 * them (fields_json: a JSON object such as {"tool_calls": [...]} or
 * {"tool_call_id": "..."}; NULL for none); content may be NULL (`none`). */
void        lk_conv_push_ex(lk_conv *c, const char *role, const char *content, const char *fields_json);
/* Extra template variables for every render (a JSON object such as
 * {"tools": [...]}; NULL: none). Copied. */
void        lk_conv_set_extra(lk_conv *c, const char *extra_json);
/* Removes messages [i, j). */
void        lk_conv_drop(lk_conv *c, int i, int j);
int         lk_conv_len(const lk_conv *c);
const char *lk_conv_role(const lk_conv *c, int i);
const char *lk_conv_content(const lk_conv *c, int i);
/* The prompt's tokens (*ids malloc'd, *n of them) for the whole
 * conversation, leaving `reserve` positions of n_ctx for the reply: while it
 * does not, the oldest exchange (a user message and the replies after it; a
 * system prompt stays) is dropped (*dropped counts the messages). When only
 * the newest message is left it is sent if one token of reply fits, else
 * LK_ERR_ARG with the sizes. Template errors (raise_exception, a construct
 * outside the subset) come back with the template's message. */
lk_status   lk_conv_fit(lk_conv *c, int n_ctx, int reserve, int32_t **ids, int *n, int *dropped, char *err, size_t errlen);

#endif
