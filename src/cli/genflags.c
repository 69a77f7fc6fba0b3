#include "cli/genflags.h"
#include "diag/diag.h"
#include "kernels/tune.h"
#include "parallel/parallel.h"
#include "transport/transport.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char lk_seal_help[] =
    "seal every cluster TCP link after the handshake (AES-256-GCM or ChaCha20-Poly1305 records): tampering, "
    "injection or replay fails the link naming the peer; a worker with --seal refuses heads without it, one "
    "without seals when asked; same-host shm links stay unsealed (cost: BENCHMARKS.md, 'netbench --seal')";

const char lk_emulate_link_help[] =
    "with --local: relay the cluster's mesh links (the data: steps, all-reduces, hand-offs) through link "
    "emulators (TCP, forced). SPEC = [A-B:]DELAY_US[:RATE_GBPS[:JITTER_US]], comma-separated: a rule without A-B "
    "sets every link, one with it the link of ranks A and B (links no rule covers stay direct). \"25:10\" = 25 us "
    "one-way at 10 Gbit/s everywhere; \"0-1:250\" = only ranks 0 and 1 slow; rate 0 = unlimited";

bool lk_emulate_link_check(const char *cmd, const char *spec, int64_t local, const char *workers,
                           const char *transport) {
    if (!spec) return true;
    if (local < 2 || (workers && *workers)) {
        fprintf(stderr, "lockstep %s: --emulate-link needs --local N (N >= 2): the relays run in the head's process on "
                        "loopback\n", cmd);
        return false;
    }
    if (transport && strcmp(transport, "auto") && strcmp(transport, "tcp")) {
        fprintf(stderr, "lockstep %s: --emulate-link relays TCP links, so --transport %s makes no sense with it "
                        "(an emulated link over %s would bypass the relay): give --transport tcp or leave it out\n",
                cmd, transport, transport);
        return false;
    }
    lk_diag_linkemu e;
    char err[LK_ERRLEN];
    if (lk_diag_linkemu_parse(spec, (int)local, &e, err, sizeof err)) {
        fprintf(stderr, "lockstep %s: %s\n", cmd, err);
        return false;
    }
    return true;
}

const char lk_expert_parallel_help[] =
    "mixtures of experts: each TP rank holds whole experts (a contiguous range) and computes only the tokens routed "
    "to them; attention, the shared expert and dense layers stay split by rows. The default whenever the model has "
    "at least as many experts as TP ranks (faster decode of one sequence: BENCHMARKS.md); this flag makes a layout "
    "where it cannot be an error";
const char lk_no_expert_parallel_help[] =
    "mixtures of experts: every TP rank holds a row slice of every expert instead: 3-4 % faster with 16 sequences "
    "in BENCHMARKS.md's run (inside its noise), and better balanced when a step's tokens pick few experts if the "
    "expert rows split evenly over the ranks";

void lk_genflags_init(lk_genflags *f) {
    /* --tp/--pp/--threads -1: not given (the cluster picks, the default
     * thread count); 0 given is an error */
    *f = (lk_genflags){ .top_k = 40, .seed = -1, .last_n = 64, .temp = 0.8, .top_p = 0.95, .min_p = 0.05, .rep = 1.0,
                        .tp = -1, .pp = -1, .threads = -1 };
}

void lk_genflags_opts(lk_genflags *f, lk_opt *opts, int *n, int cap) {
    const lk_opt shared[] = {
        { "--model", "-m", LK_OPT_STR, &f->model, "FILE", "GGUF model file (required)" },
        { "--temp", NULL, LK_OPT_F64, &f->temp, "T", "temperature; 0 = greedy (default 0.8)" },
        { "--top-k", NULL, LK_OPT_INT, &f->top_k, "K", "keep the K most likely tokens; 0 = off (default 40)" },
        { "--top-p", NULL, LK_OPT_F64, &f->top_p, "P", "nucleus sampling; 1 = off (default 0.95)" },
        { "--min-p", NULL, LK_OPT_F64, &f->min_p, "P", "drop tokens below P x the best one's probability (default 0.05)" },
        { "--repeat-penalty", NULL, LK_OPT_F64, &f->rep, "R", "penalise recent tokens; 1 = off (default 1)" },
        { "--frequency-penalty", NULL, LK_OPT_F64, &f->freq, "F", "subtract F x count of recent uses (default 0)" },
        { "--presence-penalty", NULL, LK_OPT_F64, &f->pres, "F", "subtract F if used recently (default 0)" },
        { "--penalty-last-n", NULL, LK_OPT_INT, &f->last_n, "N", "how many recent tokens penalties see (default 64)" },
        { "--seed", NULL, LK_OPT_INT, &f->seed, "S", "random seed (default: from the clock, printed)" },
        { "--threads", "-t", LK_OPT_INT, &f->threads, "N", "threads per rank (default: the physical cores this process may run on, shared by --local ranks)" },
        { "--ctx", "-c", LK_OPT_INT, &f->ctx, "N", "context length / KV cache size (default: model's, at most 4096)" },
        { "--ctx-size", NULL, LK_OPT_INT, &f->ctx, "N", "same as --ctx (llama.cpp's name)" },
        { "--batch", "-b", LK_OPT_INT, &f->batch, "N", "most prompt tokens per forward pass (default 512)" },
        { "--kv-f16", NULL, LK_OPT_FLAG, &f->kv_f16, NULL, "store the KV cache in F16: half the memory and half the bytes attention reads (default F32)" },
        { "--kv-budget", NULL, LK_OPT_STR, &f->kv_budget, "N",
          "KV cache shared by all sequences: N positions, or bytes with a K/M/G suffix (e.g. 2G: the whole model's "
          "KV on one node; cluster ranks each hold their share) (default: from free memory)" },
        { "--workers", "-w", LK_OPT_STR, &f->workers, "LIST", "cluster workers host:port,host:port,..." },
        { "--key-file", NULL, LK_OPT_STR, &f->key_file, "FILE", "cluster key (lockstep keygen)" },
        { "--local", NULL, LK_OPT_INT, &f->local, "N", "start a local cluster of N ranks (head included)" },
        { "--tp", NULL, LK_OPT_INT, &f->tp, "N", "tensor-parallel ranks" },
        { "--pp", NULL, LK_OPT_INT, &f->pp, "N", "pipeline stages" },
        { "--tp-weights", NULL, LK_OPT_STR, &f->tp_weights, "W,W,..", "relative share of each TP rank (mixed-speed nodes)" },
        { "--layers-split", NULL, LK_OPT_STR, &f->layers_split, "N,N,..", "layers per pipeline stage" },
        { "--expert-parallel", NULL, LK_OPT_FLAG, &f->expert_parallel, NULL, lk_expert_parallel_help },
        { "--no-expert-parallel", NULL, LK_OPT_FLAG, &f->no_expert_parallel, NULL, lk_no_expert_parallel_help },
        { "--transport", NULL, LK_OPT_STR, &f->transport, "NAME", "auto | tcp | shm | ucx | mpi (default auto; mpi under mpirun)" },
        { "--wire", NULL, LK_OPT_STR, &f->wire, "FMT", "all-reduce wire format: f32 (default, exact), f16, bf16, q8" },
        { "--seal", NULL, LK_OPT_FLAG, &f->seal, NULL, lk_seal_help },
        { "--emulate-link", NULL, LK_OPT_STR, &f->emulate_link, "SPEC", lk_emulate_link_help },
        { "--no-tune", NULL, LK_OPT_FLAG, &f->no_tune, NULL, LK_NO_TUNE_HELP },
        { "--tune", NULL, LK_OPT_STR, &f->tune, "SPEC", LK_TUNE_HELP },
    };
    for (size_t i = 0; i < sizeof shared / sizeof shared[0]; i++) {
        LK_ASSERT(*n < cap);
        opts[(*n)++] = shared[i];
    }
}

/* "4096" (positions) or "512M", "2G", "1.5GiB" (bytes, binary units):
 * *bytes says which. */
static bool parse_budget(const char *s, int64_t *v, bool *bytes) {
    double x, mul;
    bool b;
    if (!lk_parse_units(s, &x, &mul, &b) || !(x >= 1) || (b && mul == 1)) return false;
    *bytes = mul > 1;
    if (x * mul > 1e18 || (!*bytes && x != (double)(int64_t)x)) return false;
    *v = (int64_t)(x * mul);
    return true;
}

/* cluster/proto.h's LK_MAX_RANKS (the protocol's bound; proto.h is the
 * cluster's private header). */
enum { LK_CLUSTER_MAX_RANKS = 64 };

/* The number of HOST:PORT entries of --workers (empty entries do not count). */
static int count_workers(const char *w) {
    int n = 0;
    for (const char *p = w; *p;) {
        size_t len = strcspn(p, ",");
        n += len > 0;
        p += len + (p[len] == ',');
    }
    return n;
}

/* The cluster layout the flags ask for, checked before anything starts
 * (the same rule as the cluster's: a missing --tp or --pp is what makes
 * tp x pp equal the ranks). Messages name only flags the user gave. */
static bool check_layout(const lk_genflags *f, const char *cmd) {
    const bool workers = f->workers && *f->workers;
    if (workers && f->local > 1) {
        fprintf(stderr, "lockstep %s: give --workers or --local, not both\n", cmd);
        return false;
    }
    if (workers && !f->key_file) {
        fprintf(stderr, "lockstep %s: --workers needs --key-file (make one with 'lockstep keygen')\n", cmd);
        return false;
    }
    if (f->local > LK_CLUSTER_MAX_RANKS) {
        fprintf(stderr, "lockstep %s: --local %lld: at most %d ranks\n", cmd, (long long)f->local, LK_CLUSTER_MAX_RANKS);
        return false;
    }
    const int ranks = workers ? 1 + count_workers(f->workers) : f->local > 1 ? (int)f->local : 1;
    const char *who = workers ? "--workers" : "--local";
    char given[64];
    if (f->tp > 0 && f->pp > 0) snprintf(given, sizeof given, "--tp %lld x --pp %lld", (long long)f->tp, (long long)f->pp);
    else if (f->tp > 0) snprintf(given, sizeof given, "--tp %lld", (long long)f->tp);
    else snprintf(given, sizeof given, "--pp %lld", (long long)f->pp);
    if (ranks == 1) {
        if (f->tp > 1 || f->pp > 1) {
            fprintf(stderr, "lockstep %s: %s needs ranks: give --local N or --workers LIST\n", cmd, given);
            return false;
        }
        return true;
    }
    if (f->tp < 0 && f->pp < 0) return true;
    const int64_t tp = f->tp > 0 ? f->tp : ranks / f->pp, pp = f->pp > 0 ? f->pp : ranks / f->tp;
    if (ranks % (f->tp > 0 ? f->tp : f->pp) || tp * pp != ranks) {
        if (workers)
            fprintf(stderr, "lockstep %s: %s does not match the %d ranks of --workers (the head and %d worker%s)\n", cmd,
                    given, ranks, ranks - 1, ranks > 2 ? "s" : "");
        else
            fprintf(stderr, "lockstep %s: %s does not match the %d ranks of %s %d\n", cmd, given, ranks, who, ranks);
        return false;
    }
    return true;
}

/* --threads: 1..LK_THREADS_MAX when given (more than the CPUs we may run on
 * is allowed, with a warning); not given, the default for this machine,
 * split among --local ranks, while --workers ranks choose their own (0 in
 * the engine options). Says the count on one line either way. */
static bool check_threads(lk_genflags *f, const char *cmd) {
    if (f->threads == 0 || f->threads < -1 || f->threads > LK_THREADS_MAX) {
        fprintf(stderr, "lockstep %s: --threads %lld is out of range: 1 to %d (leave it out for the default, %d here)\n",
                cmd, (long long)f->threads, LK_THREADS_MAX, lk_threads_default());
        return false;
    }
    const bool given = f->threads > 0, workers = f->workers && *f->workers;
    const int ranks = !workers && f->local > 1 ? (int)f->local : 1, cpus = lk_cpus_usable();
    if (!given) f->threads = LK_MAX(1, lk_threads_default() / ranks);
    char line[256];
    lk_threads_describe((int)f->threads, ranks, given, line, sizeof line);
    fprintf(stderr, "lockstep %s: %s%s\n", cmd, line, workers ? " on the head; workers: what -t says, else their own default" : "");
    if (given && f->threads * ranks > cpus)
        lk_log(LK_LOG_WARN, "%s: %lld thread%s on %d CPU%s this process may run on: threads will wait for each other",
               ranks > 1 ? "--threads x --local" : "--threads", (long long)(f->threads * ranks), f->threads * ranks > 1 ? "s" : "",
               cpus, cpus > 1 ? "s" : "");
    if (!given && workers) f->threads = 0; /* each worker its own default; the head's engine its own */
    return true;
}

bool lk_tune_flags(const char *cmd, bool no_tune, const char *tune) {
    if (no_tune && tune) {
        fprintf(stderr, "lockstep %s: --no-tune and --tune exclude each other\n", cmd);
        return false;
    }
    if (tune && strcmp(tune, "calibrate")) {
        lk_tune_set s;
        lk_tune_defaults(&s);
        char err[200];
        if (!lk_tune_parse(tune, &s, err, sizeof err)) {
            fprintf(stderr, "lockstep %s: --tune: %s\n", cmd, err);
            return false;
        }
    }
    if (no_tune || tune) setenv("LK_TUNE", no_tune ? "off" : tune, 1);
    return true;
}

bool lk_genflags_finish(lk_genflags *f, const char *cmd, lk_engine_opts *eo, lk_sampler_params *sp) {
    /* --ctx: positions are int32 everywhere; the memory it needs is checked
     * when the model is opened (lk_engine_open) */
    const char *bad = f->ctx < 0 || f->ctx > LK_CTX_MAX ? "--ctx" : f->batch < 0 ? "--batch"
                    : f->top_k < 0 ? "--top-k" : f->last_n < 0 ? "--penalty-last-n" : f->local < 0 ? "--local"
                    : f->tp == 0 || f->tp < -1 ? "--tp" : f->pp == 0 || f->pp < -1 ? "--pp" : f->temp < 0 ? "--temp"
                    : !(f->top_p > 0 && f->top_p <= 1) ? "--top-p" : !(f->min_p >= 0 && f->min_p <= 1) ? "--min-p"
                    : !(f->rep > 0) ? "--repeat-penalty" : NULL;
    if (bad) {
        const char *range = !strcmp(bad, "--ctx") ? " (0 = the model's, at most 1073741824)"
                          : !strcmp(bad, "--tp") || !strcmp(bad, "--pp") ? " (at least 1)" : "";
        fprintf(stderr, "lockstep %s: %s is out of range%s (see 'lockstep %s --help')\n", cmd, bad, range, cmd);
        return false;
    }
    lk_mesh_shm tmode;
    char terr[LK_ERRLEN];
    if (lk_transport_parse(f->transport, &tmode, terr, sizeof terr)) {
        fprintf(stderr, "lockstep %s: %s\n", cmd, terr);
        return false;
    }
    lk_wire_fmt wire;
    if (f->wire && !lk_wire_fmt_parse(f->wire, &wire)) {
        fprintf(stderr, "lockstep %s: --wire must be f32, f16, bf16 or q8 (got '%s')\n", cmd, f->wire);
        return false;
    }
    if (!check_layout(f, cmd)) return false;
    if (!lk_emulate_link_check(cmd, f->emulate_link, f->local, f->workers, f->transport)) return false;
    if (f->expert_parallel && f->no_expert_parallel) {
        fprintf(stderr, "lockstep %s: give --expert-parallel or --no-expert-parallel, not both\n", cmd);
        return false;
    }
    int64_t kv_budget = 0;
    bool kv_bytes = false;
    if (f->kv_budget && !parse_budget(f->kv_budget, &kv_budget, &kv_bytes)) {
        fprintf(stderr, "lockstep %s: --kv-budget '%s': expected positions (e.g. 16384) or bytes with a K/M/G suffix "
                        "(e.g. 2G)\n", cmd, f->kv_budget);
        return false;
    }
    if (!check_threads(f, cmd)) return false;
    if (!lk_tune_flags(cmd, f->no_tune, f->tune)) return false;
    if (f->seed < 0) f->seed = (int64_t)(time(NULL) ^ getpid());
    *eo = (lk_engine_opts){ .model_path = f->model, .n_threads = (int)f->threads, .n_ctx = (int)f->ctx,
                            .n_batch = (int)f->batch, .kv_f16 = f->kv_f16, .kv_budget = kv_bytes ? 0 : kv_budget,
                            .kv_budget_bytes = kv_bytes ? kv_budget : 0, .workers = f->workers, .key_file = f->key_file,
                            .local = (int)f->local, .tp = (int)LK_MAX(f->tp, 0), .pp = (int)LK_MAX(f->pp, 0), .tp_weights = f->tp_weights,
                            .layers_split = f->layers_split,
                            .expert_parallel = f->expert_parallel ? 1 : f->no_expert_parallel ? -1 : 0,
                            .transport = f->transport, .wire = f->wire, .seal = f->seal, .emulate_link = f->emulate_link };
    lk_sampler_params_default(sp);
    sp->temp = (float)f->temp; sp->top_k = (int)f->top_k; sp->top_p = (float)f->top_p; sp->min_p = (float)f->min_p;
    sp->repeat_penalty = (float)f->rep; sp->freq_penalty = (float)f->freq; sp->presence_penalty = (float)f->pres;
    sp->penalty_last_n = (int)f->last_n; sp->seed = (uint64_t)f->seed;
    return true;
}
