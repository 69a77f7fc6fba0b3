/* engine — what `run`, `chat`, `bench` and `serve` drive: "the model", whether
 * it lives in this process or is spread over a cluster.
 *
 * One mechanism for both: the engine feeds tokens at positions, every rank
 * runs its slice (lk_model), and the next token is chosen from candidates
 * (each rank's best tokens from its vocabulary slice, with the penalties
 * applied) so nobody gathers full logits. With no workers the engine is one
 * rank holding everything.
 *
 * Ownership: the engine owns the GGUF mapping, the model and (cluster) the
 * connections. One thread drives an engine. */
#ifndef LK_ENGINE_H
#define LK_ENGINE_H

#include "common/lk_common.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "sampler/sampler.h"

typedef struct {
    const char *model_path;
    int   n_threads;        /* 0: lk_threads_default() (split among --local ranks; --workers ranks pick their own) */
    int   n_ctx;            /* 0: model's, capped */
    int   n_batch;          /* 0: 512 */
    bool  kv_f16;
    int   max_seqs;         /* sequence slots (0: 1; `--parallel`) */
    int64_t kv_budget;      /* KV positions shared by all sequences (0: from free memory, see lk_engine_open) */
    int64_t kv_budget_bytes;/* or: bytes of KV cache for the whole model (all ranks), converted to positions */
    /* cluster layout (all zero/NULL: one node) */
    const char *workers;    /* "host:port,host:port" */
    const char *key_file;
    int   local;            /* start this many local ranks in total (head included) */
    int   tp, pp;
    const char *tp_weights; /* "2,1,1" */
    const char *layers_split; /* "3,2" layers per stage */
    int   expert_parallel;  /* mixtures: whole experts per TP rank: 0 when possible (default), 1 always
                               (--expert-parallel), -1 never: rows of every expert (--no-expert-parallel) */
    const char *transport;  /* "auto" | "tcp" | "shm" */
    const char *wire;       /* all-reduce wire format: "f32" (default), "f16", "bf16", "q8" */
    bool  seal;             /* seal the cluster's TCP links (--seal) */
    const char *emulate_link; /* --emulate-link spec (--local only; cluster.h) */
} lk_engine_opts;

typedef struct lk_engine lk_engine;

lk_status lk_engine_open(const lk_engine_opts *o, lk_engine **out, char *err, size_t errlen);
void      lk_engine_close(lk_engine *e);

const lk_gguf          *lk_engine_gguf(const lk_engine *e);
const lk_model_config  *lk_engine_cfg(const lk_engine *e);
int      lk_engine_n_ctx(const lk_engine *e);
int      lk_engine_n_ranks(const lk_engine *e);
int      lk_engine_threads(const lk_engine *e);     /* threads of this rank's pool */
uint64_t lk_engine_weight_bytes(const lk_engine *e);  /* this rank's (the head's) weights read per token */

/* ---- many sequences per step ---------------------------------------------------
 *
 * Sequences are slots [0, lk_engine_max_seqs). Every rank keeps, per slot,
 * the KV pages of its layers and heads, the token ids the slot holds and the
 * slot's sampling settings (every rank applies the penalties to its own
 * vocabulary rows). Slot operations are queued here and travel with the next
 * submitted step to every rank, which applies them, in order, before that
 * step's forward pass.
 *
 * A step is a list of items, each a run of tokens appended to one slot (a
 * decode token, or a chunk of a prompt: chunked prefill); a slot appears at
 * most once per step. Every weight matrix is read once per step for all its
 * tokens. Items that `sample` produce the slot's next token (penalties, then
 * the slot's sampler on the head over every rank's best candidates).
 *
 * Pipelines: with pp stages, lk_engine_depth() steps may be in flight:
 * submit several (on disjoint slots), then collect them oldest first; stages
 * work on different steps at once. With one stage depth is 1 and submit
 * computes the whole step.
 *
 * A slot's logits do not depend on what else is in the step (batch
 * invariance: every kernel gives a token's row the same bits whatever the
 * number of tokens beside it), so greedy output does not change with load. */

int     lk_engine_max_seqs(const lk_engine *e);
int     lk_engine_n_batch(const lk_engine *e);      /* most tokens per step, all items together */
int     lk_engine_depth(const lk_engine *e);        /* steps that may be in flight (pipeline stages) */
int     lk_engine_page_tokens(const lk_engine *e);  /* positions per KV page */
int64_t lk_engine_pages_total(const lk_engine *e);
/* Free pages once the queued operations and the submitted steps are applied. */
int64_t lk_engine_pages_free(const lk_engine *e);
/* Positions slot `seq` holds once the queued operations and submitted steps are applied. */
int     lk_engine_seq_len(const lk_engine *e, int seq);
/* Pages appending n tokens to seq (after everything queued) would take:
 * new pages, and copies of pages it shares with another slot. */
int64_t lk_engine_pages_needed(const lk_engine *e, int seq, int n);

/* Queued slot operations (errors: a bad slot or length, named).
 *  - params: the slot's sampling settings from now on (its penalty window is
 *    rebuilt from the tokens it holds); n_cand > 0 overrides the number of
 *    candidates each rank sends, at most LK_STEP_MAX_CAND (1024): tests of
 *    small vocabularies ask for all of it to rebuild full logits rows.
 *  - keep: keep the first n positions (0 frees every page).
 *  - fork: dst holds the first n positions of src (whole pages shared,
 *    copied on the first write: a shared system prompt, the next chat turn).
 *    dst keeps its own sampling settings. */
lk_status lk_engine_seq_params(lk_engine *e, int seq, const lk_sampler_params *sp, int n_cand, char *err, size_t errlen);
lk_status lk_engine_seq_keep(lk_engine *e, int seq, int n, char *err, size_t errlen);
lk_status lk_engine_seq_fork(lk_engine *e, int dst, int src, int n, char *err, size_t errlen);
/* Whether keep or fork may cut seq at n (after everything queued): false
 * where a sliding-window layer's ring (model.h) no longer holds the window
 * position n needs; that prefix must then be recomputed. */
bool lk_engine_seq_can_keep(const lk_engine *e, int seq, int n);

typedef struct {
    int seq;
    int n;                  /* tokens, >= 1 */
    const int32_t *tokens;  /* appended at positions seq_len .. seq_len+n-1 */
    bool sample;            /* produce the next token from the last one */
} lk_engine_item;

/* Checks the items (slots, vocabulary, context, pages: a clear error and
 * nothing sent), sends the step to every rank and runs the head's part. */
lk_status lk_engine_submit(lk_engine *e, const lk_engine_item *items, int n_items, char *err, size_t errlen);
/* Finishes the oldest submitted step: next[i] is item i's new token (-1
 * where it does not sample). After it, lk_engine_candidates gives item i's
 * merged candidates (best first) until the next collect. */
lk_status lk_engine_collect(lk_engine *e, int32_t *next, char *err, size_t errlen);
int       lk_engine_candidates(const lk_engine *e, int item, const int32_t **ids, const float **vals);
/* Log-sum-exp over the whole vocabulary of item i's values (vals[j] - it is
 * a log-probability), for a slot given an explicit n_cand; NaN otherwise. */
float     lk_engine_candidates_lse(const lk_engine *e, int item);
/* submit + collect. */
lk_status lk_engine_batch(lk_engine *e, const lk_engine_item *items, int n_items, int32_t *next, char *err,
                          size_t errlen);

/* ---- one sequence (slot 0): the convenience the single-stream commands use ----
 * Feeds tokens[0..n) at positions pos0.. (any n: split into batches; pos0
 * below the slot's length first drops the positions from pos0 on), then
 * picks the next token with the sampler `s` (its settings are sent to the
 * ranks when they change; its own history is not used: the ranks keep the
 * slot's). Does not call lk_sampler_accept. */
lk_status lk_engine_step(lk_engine *e, const int32_t *tokens, int n, int pos0, lk_sampler *s,
                         int32_t *next, char *err, size_t errlen);

/* Time split of the last collected step (seconds): compute and communication. */
void lk_engine_last_timing(const lk_engine *e, double *compute_s, double *comm_s);
/* A worker rank's (>= 1) compute and network seconds since the engine
 * opened, as its heartbeats tell them (up to 250 ms behind); false for
 * rank 0 (the sum of lk_engine_last_timing is its own) or out of range. */
bool lk_engine_rank_times(lk_engine *e, int rank, double *compute_s, double *comm_s);

#endif
