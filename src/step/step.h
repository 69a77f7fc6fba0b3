/* step — the one step every rank runs, on one node and in every cluster
 * layout: apply the slot operations, run this rank's part of the forward
 * pass for a batch of sequences (TP all-reduces inside, pipeline hand-offs
 * between stages), then, on the last stage, each sampling sequence's
 * penalties and best candidates from this rank's vocabulary rows, sent to
 * rank 0, which merges them and (through the engine) picks.
 *
 * Below cluster/ and engine/: the cluster part keeps only the life cycle
 * (handshake, load, slices, heartbeats, naming failures), the engine decides
 * what goes into a step. Rank 0 is the head.
 *
 * The step message. Rank 0 sends it to every other rank over the data mesh
 * (the spinning links, not the TCP control link: a worker blocked in poll()
 * on the control socket paid a 20-25 us wake-up per token). Little-endian:
 *     header   u32 magic "LKS1" | u32 body bytes | u64 step number (from 0)
 *     body     u32 n_ops | u32 n_items | u32 n_tokens | u32 flags (1: end of session)
 *              n_ops x 56-byte ops:   u32 kind | i32 seq | i32 a | i32 b |
 *                                     f32 temp | i32 top_k | f32 top_p | f32 min_p |
 *                                     f32 repeat | f32 freq | f32 presence |
 *                                     i32 penalty_last_n | u64 seed
 *              n_items x 16-byte items: i32 seq | i32 pos0 | i32 n | u32 flags (1: sample)
 *              n_tokens x i32 (the items' tokens, in item order)
 * Every count, slot, position and token is checked against this rank's
 * limits before it is used; a malformed message is an error naming the
 * field, never an assertion.
 *
 * Candidates: for each sampling item, in item order, k (id i32, value f32)
 * pairs, best first, ties to the lower id, padded with id -1; k is the
 * slot's candidate count, which every rank derives from the slot's
 * settings. A slot whose PARAMS named its count (a > 0: logprobs) adds one
 * pair (id -2, log-sum-exp of the values over all the sender's vocabulary
 * rows), so rank 0 normalises over the whole vocabulary, exactly, without
 * gathering it. pp = 1: gathered to rank 0 over the TP group; pp > 1: the last
 * stage's ranks send theirs to rank 0 directly. Rank 0 checks every pair
 * (id inside the sender's vocabulary rows or -1 padding, finite value) and
 * names the rank otherwise.
 *
 * Per slot, every rank keeps the token ids the slot holds and a sampler
 * whose penalty window is the last penalty_last_n of them (prompt tokens
 * included, as llama.cpp counts them), so no history travels per step. On
 * rank 0 the same sampler picks (its random state is the slot's).
 *
 * Pipelines: rank 0 may send several steps before collecting the first;
 * each stage works through them in order, so with pp stages and pp steps in
 * flight every stage is busy. Threading: one thread drives an lk_step. */
#ifndef LK_STEP_H
#define LK_STEP_H

#include "common/lk_common.h"
#include "model/model.h"
#include "parallel/parallel.h"
#include "sampler/sampler.h"
#include "transport/transport.h"

#define LK_STEP_MAGIC    0x31534b4cu /* "LKS1" */
#define LK_STEP_HDR      16
#define LK_STEP_OP_BYTES 56
#define LK_STEP_MAX_CAND 1024        /* candidates per sampling item at most */
#define LK_STEP_MAX_DEPTH 16         /* steps in flight at most (pipeline stages) */

typedef enum {
    LK_STEP_OP_PARAMS = 1,  /* seq's sampling settings; a = candidates per rank (0: what the sampler needs;
                             * > 0 adds the log-sum-exp pair) */
    LK_STEP_OP_KEEP   = 2,  /* seq keeps its first a positions */
    LK_STEP_OP_FORK   = 3,  /* seq (dst) shares the first b positions of slot a */
} lk_step_op_kind;

typedef struct {
    int32_t kind, seq, a, b;
    lk_sampler_params sp;   /* PARAMS only */
} lk_step_op;

typedef struct {
    int32_t seq, pos0, n;
    bool sample;
} lk_step_item;

typedef struct {
    uint64_t no;
    bool end;               /* the session ends: the worker leaves its step loop */
    int n_ops, n_items, n_tok;
    lk_step_op *ops;        /* (cap_ops) */
    lk_step_item *items;    /* (cap_items) */
    int32_t *tokens;        /* (cap_tok) */
    int cap_ops, cap_items, cap_tok;
    uint8_t *wire;          /* encoded message (header + body) */
    size_t wire_len, wire_cap;
} lk_step_msg;

/* Caps from the model: items <= slots, tokens <= n_batch, ops <= 4 x slots + 16. */
void lk_step_msg_init(lk_step_msg *msg, int max_seqs, int n_batch);
void lk_step_msg_free(lk_step_msg *msg);
void lk_step_msg_clear(lk_step_msg *msg);   /* no ops, items, tokens; keeps the number */

typedef struct lk_step lk_step;

typedef struct {
    lk_model *m;            /* this rank's slice, loaded */
    lk_mesh  *mesh;         /* NULL: one node */
    lk_comm  *tp;           /* this rank's TP group over mesh (NULL: one node) */
    const lk_slice *plan;   /* rank 0: every rank's slice (candidates are checked against their rows) */
} lk_step_params;

/* Sizes every buffer (no allocation per step afterwards) and points the
 * model's all-reduce hook at tp. */
lk_status lk_step_create(const lk_step_params *p, lk_step **out, char *err, size_t errlen);
void      lk_step_free(lk_step *s);

/* Applies one slot operation to this rank now: rank 0 applies each as the
 * engine queues it (so its counts are current); the others through run. */
lk_status lk_step_apply(lk_step *s, const lk_step_op *op, char *err, size_t errlen);

/* Rank 0: encodes msg and sends it to every other rank. */
lk_status lk_step_send(lk_step *s, lk_step_msg *msg, char *err, size_t errlen);
/* Other ranks: waits (until deadline_ns) for rank 0's next message. */
lk_status lk_step_recv(lk_step *s, lk_step_msg *msg, uint64_t deadline_ns, char *err, size_t errlen);

/* Runs this rank's part of msg: its ops (unless ops_applied), the forward
 * pass, candidates. On rank 0 the candidates wait for lk_step_collect; with
 * pp > 1 rank 0 returns once its rows went on to stage 1. */
lk_status lk_step_run(lk_step *s, const lk_step_msg *msg, bool ops_applied, char *err, size_t errlen);

/* Rank 0: the oldest step run and not yet collected: gathers every rank's
 * candidates and merges them per sampling item. */
lk_status lk_step_collect(lk_step *s, char *err, size_t errlen);
int  lk_step_in_flight(const lk_step *s);      /* steps run and not collected (rank 0) */
/* After collect: the sampling items of that step, in item order. */
int  lk_step_n_results(const lk_step *s);
int  lk_step_result(const lk_step *s, int i, int *seq, const int32_t **ids, const float **vals);  /* returns the count */
/* Log-sum-exp of result i's values over the whole vocabulary (every rank's
 * rows): vals[j] - it is token ids[j]'s log-probability. NaN unless the
 * slot's PARAMS named its candidate count. */
float lk_step_result_lse(const lk_step *s, int i);
lk_sampler *lk_step_sampler(lk_step *s, int seq); /* NULL before the slot's PARAMS */
/* Seconds spent waiting on the network by the runs and collects since the
 * last call (and resets it). */
double lk_step_take_comm_s(lk_step *s);
/* The last failure's detail from the collectives (for messages). */
const char *lk_step_comm_error(const lk_step *s);

#endif
