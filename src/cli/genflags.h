/* genflags — the flags every generating command shares (run, chat, later
 * serve): model, sampling, threads/context, and the cluster layout. One table,
 * one validation, so the commands cannot drift apart. */
#ifndef LK_CLI_GENFLAGS_H
#define LK_CLI_GENFLAGS_H

#include "cli/cli.h"
#include "engine/engine.h"
#include "sampler/sampler.h"

typedef struct {
    const char *model, *workers, *key_file, *tp_weights, *layers_split, *transport, *wire, *kv_budget, *emulate_link,
               *tune;
    int64_t threads, ctx, batch, top_k, seed, last_n, local, tp, pp;
    double temp, top_p, min_p, rep, freq, pres;
    bool kv_f16, seal, expert_parallel, no_expert_parallel, no_tune;
} lk_genflags;

/* --no-tune and --tune SPEC (run, chat, serve, bench, worker): checked here
 * (a bad SPEC is an error naming it), then passed on as LK_TUNE in the
 * environment, which the kernels' tuner reads when a model loads and which
 * --local ranks inherit (kernels/tune.h). */
#define LK_NO_TUNE_HELP "skip the kernels' calibration at first use: default speed settings (LK_TUNE=off)"
#define LK_TUNE_HELP "force the kernels' speed settings, e.g. pf=2,split=4,gemm=off, or 'calibrate' now (LK_TUNE=SPEC; see 'lockstep bench')"
bool lk_tune_flags(const char *cmd, bool no_tune, const char *tune);

/* --seal's help, shared by run/chat, worker and netbench: what it does and
 * what it costs (measured with 'lockstep netbench --local 2 --transport tcp
 * [--seal]'; the figures are in genflags.c). */
extern const char lk_seal_help[];
/* --expert-parallel's and --no-expert-parallel's help, shared with bench:
 * what they do and when each wins (measured: BENCHMARKS.md). */
extern const char lk_expert_parallel_help[], lk_no_expert_parallel_help[];

/* --emulate-link's help and its check (run, chat, serve, bench, doctor):
 * the spec parses (diag.h's grammar, ranks below `ranks`), --local is given,
 * and the transport is auto or tcp. False after a one-line error. */
extern const char lk_emulate_link_help[];
bool lk_emulate_link_check(const char *cmd, const char *spec, int64_t local, const char *workers,
                           const char *transport);

/* --ctx's upper bound (positions are int32; memory is checked at open). */
#define LK_CTX_MAX (1 << 30)

/* Defaults (llama.cpp's sampling defaults; seed -1 = from the clock). */
void lk_genflags_init(lk_genflags *f);
/* Appends the shared options to opts[*n..] (cap entries in all); the caller
 * terminates the table with a zero entry. */
void lk_genflags_opts(lk_genflags *f, lk_opt *opts, int *n, int cap);
/* Checks ranges (a one-line error naming the command, false on failure),
 * says the thread count on stderr (one line), picks the seed and fills the engine options and sampler parameters
 * (--kv-budget: positions, or bytes with a K/M/G suffix). */
bool lk_genflags_finish(lk_genflags *f, const char *cmd, lk_engine_opts *eo, lk_sampler_params *sp);

#endif
