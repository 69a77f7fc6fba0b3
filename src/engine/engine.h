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
    int   n_threads;        /* 0: all cores */
    int   n_ctx;            /* 0: model's, capped */
    int   n_batch;          /* 0: 512 */
    bool  kv_f16;
    /* cluster layout (all zero/NULL: one node) */
    const char *workers;    /* "host:port,host:port" */
    const char *key_file;
    int   local;            /* start this many local ranks in total (head included) */
    int   tp, pp;
    const char *tp_weights; /* "2,1,1" */
    const char *layers_split; /* "3,2" layers per stage */
    const char *transport;  /* "auto" | "tcp" | "shm" */
    const char *wire;       /* all-reduce wire format: "f32" (default), "f16", "bf16", "q8" */
    bool  seal;             /* seal the cluster's TCP links (--seal) */
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

/* Feeds tokens[0..n) at positions pos0.. (any n: split into batches), then
 * picks the next token with the sampler from the last position. Does not
 * call lk_sampler_accept. */
lk_status lk_engine_step(lk_engine *e, const int32_t *tokens, int n, int pos0, lk_sampler *s,
                         int32_t *next, char *err, size_t errlen);

/* Full logits for the last n_out of tokens[0..n) (tests, diagnostics); only
 * for n <= n_batch. logits is [n_out][n_vocab]. */
lk_status lk_engine_logits(lk_engine *e, const int32_t *tokens, int n, int pos0, int n_out,
                           float *logits, char *err, size_t errlen);

/* Time split of the last step (seconds): compute and communication. */
void lk_engine_last_timing(const lk_engine *e, double *compute_s, double *comm_s);

#endif
