/* lockstep bench — prefill and decode speed next to the memory-bandwidth
 * bound measured in the same process just before each repetition, on one
 * node or a cluster (the same flags as run: --local N --tp/--pp, --workers).
 * decode / bound is the median of the repetitions' own fractions, each
 * against the probe run right before it; mem bw the median of the probes.
 *
 * Decode reads every weight once per step, so with one sequence
 * tok/s <= bandwidth / weight bytes per token; decode_bound_fraction says how
 * close the kernels get. With S sequences decoding together (--seqs) a step
 * carries S tokens for the same weight reads, so the memory bound is S times
 * higher, and the matrix kernels' own rate caps it: the bound is the lower of
 * S x the memory bound and the prefill rate measured in the same row (the
 * GEMM's rate with these threads). In a cluster the weight bytes are the
 * head's slice (--local ranks share one machine's bandwidth). */
#include "cli/cli.h"
#include "cli/genflags.h"
#include "diag/diag.h"
#include "engine/engine.h"
#include "kernels/membw.h"
#include "kernels/tune.h"
#include "parallel/trace.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct { double med, min, max; } stat3;
static stat3 stats(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    stat3 s = { n ? (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])) : 0, n ? v[0] : 0, n ? v[n - 1] : 0 };
    return s;
}

/* The decode bound in tok/s of S sequences: S x the memory bound (bw GB/s
 * over wb weight bytes a step), and with several sequences no more than
 * the prefill's rate pp (a step of S tokens cannot beat a prompt's); 0
 * without a probe. */
static double decode_bound(int S, double bw, double wb, double pp) {
    double b = bw > 0 ? S * bw * 1e9 / wb : 0;
    if (S > 1 && pp > 0) b = LK_MIN(b, pp);
    return b;
}

/* Parses "1,2,4" into at most cap positive ints; returns the count or -1. */
static int parse_list(const char *s, int *out, int cap) {
    int n = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v <= 0 || v > 4096 || n == cap) return -1;
        out[n++] = (int)v;
        s = end;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return n;
}

/* ======================================================================
 * feeding S sequences (slots 0..S-1) through the engine
 * ==================================================================== */

typedef struct {
    lk_engine      *e;
    int             S, depth, n_batch;
    lk_engine_item *items;   /* (depth x S) the steps in flight */
    int            *n_items; /* (depth) */
    int32_t        *next;    /* (S) */
    bool           *busy;    /* (S) in a step in flight */
    int            *left, *fed;
    int32_t       **toks;    /* (S) each sequence's tokens (positions 0..) */
    lk_energy      *en;      /* the machine's power counters, or NULL */
    double          tg_j, tg_s;  /* the last rep's decode: joules and seconds */
    bool            prof;        /* --profile: the phases' profiles, summed over a row's reps */
    lk_prof         prof_pp, prof_tg;
    double          prof_pp_s, prof_tg_s;
} driver;

static void prof_sum(lk_prof *acc) {
    lk_prof p;
    lk_prof_get(&p);
    for (int k = 0; k < LK_PROF_N; k++) {
        acc->wall_ns[k] += p.wall_ns[k];
        acc->busy_ns[k] += p.busy_ns[k];
        acc->calls[k] += p.calls[k];
        acc->before_ns[k] += p.before_ns[k];
        acc->after_ns[k] += p.after_ns[k];
    }
}

/* Where a phase's time went, as shares of its wall time (the head's rank:
 * its model's layers and logits; "outside" is the engine around them:
 * embedding, sampling, the steps' messages). */
typedef struct { double wall, matmul, quant, attn, moe, par, comm, serial, logits, logits_mm, outside;
                 double mm_busy, mm_before, mm_after, attn_busy; } prof_view;

static prof_view prof_make(const lk_prof *p, double wall_s, int threads) {
    const double ns = 1e-9;
    prof_view v = { .wall = wall_s };
    v.matmul = p->wall_ns[LK_PROF_MATMUL] * ns;
    v.quant = p->wall_ns[LK_PROF_QUANT] * ns;
    v.attn = p->wall_ns[LK_PROF_ATTN] * ns;
    v.moe = p->wall_ns[LK_PROF_MOE] * ns;
    v.par = p->wall_ns[LK_PROF_PAR] * ns;
    v.comm = p->wall_ns[LK_PROF_COMM] * ns;
    v.serial = p->wall_ns[LK_PROF_LAYERS] * ns - v.matmul - v.attn - v.moe - v.par - v.comm;
    v.logits = p->wall_ns[LK_PROF_LOGITS] * ns;
    v.logits_mm = p->wall_ns[LK_PROF_LOGITS_MATMUL] * ns;
    v.outside = wall_s - p->wall_ns[LK_PROF_LAYERS] * ns - v.logits;
    if (v.matmul > v.quant) {
        const double tt = (v.matmul - v.quant) * threads;
        v.mm_busy = p->busy_ns[LK_PROF_MATMUL] * ns / tt;
        v.mm_before = p->before_ns[LK_PROF_MATMUL] * ns / tt;
        v.mm_after = p->after_ns[LK_PROF_MATMUL] * ns / tt;
    }
    if (v.attn > 0) v.attn_busy = p->busy_ns[LK_PROF_ATTN] * ns / (v.attn * threads);
    return v;
}

static void prof_print(const char *phase, const prof_view *v, int threads, int S) {
    if (v->wall <= 0) return;
    const double w = 100 / v->wall;
    fprintf(stderr,
            "profile: threads %d seqs %d %s %.1f ms: matmul %.1f %% (activations %.1f %%, threads busy %.0f %% of "
            "it, idle %.0f %% before their first task and %.0f %% after their last), attention %.1f %% (busy %.0f %%), "
            "experts %.1f %%, other parallel %.1f %%, all-reduce %.1f %%, "
            "serial in layers %.1f %%, logits %.1f %% (matmul %.1f %%), outside the model %.1f %%\n",
            threads, S, phase, 1e3 * v->wall, w * v->matmul, w * v->quant, 100 * v->mm_busy, 100 * v->mm_before,
            100 * v->mm_after, w * v->attn,
            100 * v->attn_busy, w * v->moe, w * v->par, w * v->comm, w * v->serial, w * v->logits, w * v->logits_mm,
            w * v->outside);
}

static json_t *prof_json(const prof_view *v) {
    json_t *o = json_object();
    json_object_set_new(o, "wall_s", json_real(v->wall));
    json_object_set_new(o, "matmul_s", json_real(v->matmul));
    json_object_set_new(o, "activations_s", json_real(v->quant));
    json_object_set_new(o, "matmul_threads_busy", json_real(v->mm_busy));
    json_object_set_new(o, "matmul_threads_idle_before", json_real(v->mm_before));
    json_object_set_new(o, "matmul_threads_idle_after", json_real(v->mm_after));
    json_object_set_new(o, "attention_s", json_real(v->attn));
    json_object_set_new(o, "attention_threads_busy", json_real(v->attn_busy));
    json_object_set_new(o, "experts_s", json_real(v->moe));
    json_object_set_new(o, "other_parallel_s", json_real(v->par));
    json_object_set_new(o, "allreduce_s", json_real(v->comm));
    json_object_set_new(o, "serial_in_layers_s", json_real(v->serial));
    json_object_set_new(o, "logits_s", json_real(v->logits));
    json_object_set_new(o, "logits_matmul_s", json_real(v->logits_mm));
    json_object_set_new(o, "outside_model_s", json_real(v->outside));
    return o;
}

/* Feeds every sequence its next left[i] tokens: each step gives each
 * sequence not already in flight up to `chunk` tokens (sampling at the end
 * of its tokens, or every token when chunk is 1), within the batch, and at
 * most per_step sequences, so that with pipeline stages depth steps on
 * different sequences are in flight at once. */
static lk_status drive(driver *d, int chunk, int per_step, char *err, size_t errlen) {
    int head = 0, flight = 0;
    lk_status st;
    for (;;) {
        while (flight < d->depth) {
            int k = (head + flight) % d->depth, m = 0, budget = d->n_batch;
            lk_engine_item *it = d->items + (size_t)k * d->S;
            for (int i = 0; i < d->S && m < per_step && budget > 0; i++) {
                if (d->busy[i] || d->left[i] == 0) continue;
                int n = LK_MIN(LK_MIN(chunk, d->left[i]), budget);
                it[m++] = (lk_engine_item){ .seq = i, .n = n, .tokens = d->toks[i] + d->fed[i],
                                            .sample = n == d->left[i] || chunk == 1 };
                d->busy[i] = true;
                d->fed[i] += n;
                d->left[i] -= n;
                budget -= n;
            }
            if (m == 0) break;
            d->n_items[k] = m;
            if ((st = lk_engine_submit(d->e, it, m, err, errlen))) return st;
            flight++;
        }
        if (flight == 0) return LK_OK;
        if ((st = lk_engine_collect(d->e, d->next, err, errlen))) return st;
        for (int j = 0; j < d->n_items[head]; j++) d->busy[d->items[(size_t)head * d->S + j].seq] = false;
        head = (head + 1) % d->depth;
        flight--;
    }
}

/* One repetition with S sequences: each prefills its own p-token prompt
 * (or one token when p is 0), then all decode n tokens together. */
static lk_status rep_seqs(driver *d, int S, int p, int n, double *pp, double *tg, char *err, size_t errlen) {
    lk_status st;
    d->S = S;
    for (int i = 0; i < S; i++) {
        if ((st = lk_engine_seq_keep(d->e, i, 0, err, errlen))) return st;
        d->fed[i] = 0;
        d->left[i] = p > 0 ? p : 1;
        d->busy[i] = false;
    }
    int share = (S + LK_MIN(d->depth, S) - 1) / LK_MIN(d->depth, S);
    if (d->prof) lk_prof_reset();
    double t0 = lk_time_s();
    if ((st = drive(d, d->n_batch, d->depth > 1 ? share : S, err, errlen))) return st;
    *pp = p > 0 ? (double)S * p / (lk_time_s() - t0) : 0;
    if (d->prof) {
        prof_sum(&d->prof_pp);
        d->prof_pp_s += lk_time_s() - t0;
    }
    if (n > 0) {
        for (int i = 0; i < S; i++) d->left[i] = n;
        double j0 = lk_energy_joules(d->en);
        if (d->prof) lk_prof_reset();
        t0 = lk_time_s();
        if ((st = drive(d, 1, share, err, errlen))) return st;
        d->tg_s = lk_time_s() - t0;
        if (d->prof) {
            prof_sum(&d->prof_tg);
            d->prof_tg_s += d->tg_s;
        }
        d->tg_j = lk_energy_joules(d->en) - j0;
        *tg = (double)S * n / d->tg_s;
    }
    return LK_OK;
}

/* ======================================================================
 * the command
 * ==================================================================== */

int lk_cmd_bench(int argc, char **argv) {
    const char *model = NULL, *threads_s = NULL, *seqs_s = NULL, *trace = NULL;
    const char *workers = NULL, *key_file = NULL, *transport = NULL, *wire = NULL, *tp_weights = NULL, *layers_split = NULL;
    const char *emulate_link = NULL;
    int64_t p = 512, n = 128, reps = 3, bw_mib = 0, local = 0, tp = 0, pp_stages = 0;
    bool json = false, csv = false, md = false, kv_f16 = false, seal = false, ep = false, no_ep = false,
         no_tune = false, profile = false;
    const char *tune = NULL;
    const lk_opt opts[] = {
        { "--model", "-m", LK_OPT_STR, &model, "FILE", "GGUF model (required)" },
        { "--threads", "-t", LK_OPT_STR, &threads_s, "N[,N..]", "thread counts to measure, per rank (default: the physical cores this process may run on, shared by --local ranks)" },
        { "--n-prompt", "-p", LK_OPT_INT, &p, "N", "prompt tokens for the prefill test (per sequence); 0 = skip (default 512)" },
        { "--n-gen", "-n", LK_OPT_INT, &n, "N", "tokens to decode (per sequence); 0 = skip (default 128)" },
        { "--seqs", "-s", LK_OPT_STR, &seqs_s, "S[,S..]",
          "sequences decoding together, e.g. 1,4,16: each prefills its own -p prompt, then all decode -n tokens; "
          "tg is the aggregate tok/s (default 1)" },
        { "--reps", "-r", LK_OPT_INT, &reps, "N", "repetitions; median, min and max are reported (default 3)" },
        { "--kv-f16", NULL, LK_OPT_FLAG, &kv_f16, NULL, "F16 KV cache" },
        { "--bw-mib", NULL, LK_OPT_INT, &bw_mib, "MIB", "bandwidth probe buffer, read before each repetition (default: 8 x last-level cache, >= 512 MiB)" },
        { "--workers", "-w", LK_OPT_STR, &workers, "LIST", "cluster workers host:port,host:port,..." },
        { "--key-file", NULL, LK_OPT_STR, &key_file, "FILE", "cluster key (lockstep keygen)" },
        { "--local", NULL, LK_OPT_INT, &local, "N", "start a local cluster of N ranks (head included)" },
        { "--tp", NULL, LK_OPT_INT, &tp, "N", "tensor-parallel ranks" },
        { "--pp", NULL, LK_OPT_INT, &pp_stages, "N", "pipeline stages (with several sequences, stages work on different ones at once)" },
        { "--tp-weights", NULL, LK_OPT_STR, &tp_weights, "W,W,..", "relative share of each TP rank" },
        { "--layers-split", NULL, LK_OPT_STR, &layers_split, "N,N,..", "layers per pipeline stage" },
        { "--expert-parallel", NULL, LK_OPT_FLAG, &ep, NULL, lk_expert_parallel_help },
        { "--no-expert-parallel", NULL, LK_OPT_FLAG, &no_ep, NULL, lk_no_expert_parallel_help },
        { "--transport", NULL, LK_OPT_STR, &transport, "NAME", "auto | tcp | shm | ucx (default auto)" },
        { "--wire", NULL, LK_OPT_STR, &wire, "FMT", "all-reduce wire format: f32 (default), f16, bf16, q8" },
        { "--seal", NULL, LK_OPT_FLAG, &seal, NULL, "seal the cluster's TCP links (see 'lockstep run --help')" },
        { "--emulate-link", NULL, LK_OPT_STR, &emulate_link, "SPEC", lk_emulate_link_help },
        { "--no-tune", NULL, LK_OPT_FLAG, &no_tune, NULL, LK_NO_TUNE_HELP },
        { "--tune", NULL, LK_OPT_STR, &tune, "SPEC",
          "force the kernels' speed settings: pf=N (decode prefetch distance in tiles, 0-8), split=N (tasks per "
          "thread of a matrix, 1-16), gemm=off|R[xC] (AVX2 prefill GEMM, R rows per pass, C tokens per chunk), "
          "gtok=N (AVX-512 Q4_0/Q8_0/Q4_K/Q5_K GEMM from N tokens, 5-32; 0 = 5; repacked at load: 16 for Q4_0/Q8_0 (32 on AMD CPUs), 18/8/28 for Q4_K/Q5_K/Q6_K), drows=4|1 (rows per decode tile of the float types and of K-quants not repacked), droll=0|1 (the F16/BF16 4-row decode tile's rows loop unrolled or rolled; default: rolled on AMD CPUs), amx=N|off (Q4_0/Q8_0 through AMX tiles from N tokens; default 64), amxf=N|off (the repacked Q4_0/Q8_0 through AMX's few-token kernel from N tokens up to amx's; default 12), far=KB (the repacked Q4_0/Q8_0 decode's second prefetch, KB ahead into L2, 0-256, 0 = off; default 16 for Q4_0, off for Q8_0), hint=1|0 (pool threads that wait prefetch the next product's rows; default 1); "
          "'calibrate': calibrate now, whatever the load, and cache the result; without it the settings are "
          "calibrated at first use (unless the machine is busy) and cached per CPU and build; the choice and "
          "the calibration's timings are printed (stderr; 'tune' in --json)" },
        { "--json", NULL, LK_OPT_FLAG, &json, NULL, "one JSON object per row (thread count x seqs)" },
        { "--csv", NULL, LK_OPT_FLAG, &csv, NULL, "CSV rows" },
        { "--md", NULL, LK_OPT_FLAG, &md, NULL, "a Markdown table (default)" },
        { "--profile", NULL, LK_OPT_FLAG, &profile, NULL,
          "after each row, where prefill's and decode's time went on the head's rank (stderr; 'profile_prefill' and "
          "'profile_decode' in --json): matrix products (how busy the threads were in them, and "
          "how long they waited for their first task and for the slowest thread's last), attention, "
          "experts, all-reduces, the serial rest of the layers, the logits, and the engine outside the model; "
          "timing every parallel task costs a little speed" },
        { "--trace", NULL, LK_OPT_STR, &trace, "FILE",
          "write Chrome trace events (Perfetto) of every step of this host's ranks, all rows (see 'lockstep run --help')" },
        { NULL, NULL, 0, NULL, NULL, NULL },
    };
    const char *pos[1];
    int np = lk_args_parse("bench", "-m FILE [-t N,N] [-p 512] [-n 128] [--seqs 1,4,16] [-r REPS] [cluster flags] [--json|--csv|--md]",
                           opts, argc, argv, pos, 0);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (!model) { fprintf(stderr, "lockstep bench: -m FILE is required (see 'lockstep bench --help')\n"); return 2; }
    if (p < 0 || n < 0 || reps < 1 || reps > 1000 || bw_mib < 0 || (p == 0 && n == 0) || p + n + 1 > 1 << 20) {
        fprintf(stderr, "lockstep bench: -p, -n and -r must be sensible (p, n >= 0, not both 0; 1 <= r <= 1000)\n");
        return 2;
    }
    if (ep && no_ep) {
        fprintf(stderr, "lockstep bench: give --expert-parallel or --no-expert-parallel, not both\n");
        return 2;
    }
    if (!lk_tune_flags("bench", no_tune, tune)) return 2;
    if (local < 0 || tp < 0 || pp_stages < 0) {
        fprintf(stderr, "lockstep bench: --local, --tp and --pp must be >= 0\n");
        return 2;
    }
    if (!lk_emulate_link_check("bench", emulate_link, local, workers, transport)) return 2;
    int tlist[16], nt = 1, slist[16], ns = 1;
    tlist[0] = 0;
    slist[0] = 1;
    if (threads_s && (nt = parse_list(threads_s, tlist, 16)) < 0) {
        fprintf(stderr, "lockstep bench: --threads expects a list like 1,2,4, got '%s'\n", threads_s);
        return 2;
    }
    for (int i = 0; i < nt; i++)
        if (tlist[i] > LK_THREADS_MAX) {
            fprintf(stderr, "lockstep bench: --threads %d is out of range: 1 to %d\n", tlist[i], LK_THREADS_MAX);
            return 2;
        }
    {
        const int ranks = workers && *workers ? 1 : LK_MAX((int)local, 1);
        char line[256];
        if (threads_s) fprintf(stderr, "lockstep bench: threads %s per rank (-t)\n", threads_s);
        else {
            lk_threads_describe(LK_MAX(1, lk_threads_default() / ranks), ranks, false, line, sizeof line);
            fprintf(stderr, "lockstep bench: %s%s\n", line, workers && *workers ? " on the head" : "");
        }
    }
    if (seqs_s && (ns = parse_list(seqs_s, slist, 16)) < 0) {
        fprintf(stderr, "lockstep bench: --seqs expects a list like 1,4,16 (each 1..4096), got '%s'\n", seqs_s);
        return 2;
    }
    int smax = 1;
    for (int i = 0; i < ns; i++) smax = LK_MAX(smax, slist[i]);
    if ((int)json + (int)csv + (int)md > 1) { fprintf(stderr, "lockstep bench: choose one of --json, --csv, --md\n"); return 2; }
    if (csv) printf("model,threads,seqs,ranks,prefill_tok_s,prefill_min,prefill_max,decode_tok_s,decode_min,decode_max,mem_bw_gbs,weight_bytes_per_token,decode_bound_tok_s,decode_bound_fraction,decode_j_per_token,decode_watts\n");
    const char *base = strrchr(model, '/') ? strrchr(model, '/') + 1 : model;
    int rc = 0;
    {
        char terr[LK_ERRLEN];
        if (trace && lk_trace_start(trace, terr, sizeof terr)) {   /* before the ranks are forked: they inherit it */
            fprintf(stderr, "lockstep bench: %s\n", terr);
            return 1;
        }
    }
    /* joules per decoded token, where the machine has counters: the whole
     * machine's, so a --local cluster's ranks are all in it */
    lk_energy *en = lk_energy_open();
    if (!json && !csv)
        fprintf(stderr, "lockstep bench: energy: %s\n",
                en ? lk_energy_source(en) : "unavailable (no readable RAPL counter or hwmon power sensor)");
    if (!json && !csv) {
        printf("| model | threads | seqs | pp%lld tok/s | tg%lld tok/s | mem bw GB/s | weights MiB/token | bound tok/s | decode / bound |%s\n",
               (long long)p, (long long)n, en ? " decode J/token (W) |" : "");
        printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|%s\n", en ? "---:|" : "");
    }
    for (int ti = 0; ti < nt && rc == 0; ti++) {
        char err[LK_ERRLEN];
        /* every sequence gets its whole context: p + n positions and the sampled last token */
        int ctx = (int)(p + n + 1);
        lk_engine_opts eo = { .model_path = model, .n_threads = tlist[ti], .n_ctx = ctx,
                              .n_batch = (int)LK_MAX(LK_MAX(p, (int64_t)smax), 1), .kv_f16 = kv_f16, .max_seqs = smax,
                              .kv_budget = (int64_t)smax * (ctx + 64), /* a page of slack per sequence (pages are 32 or 64) */
                              .workers = workers, .key_file = key_file, .local = (int)local, .tp = (int)tp,
                              .pp = (int)pp_stages, .tp_weights = tp_weights, .layers_split = layers_split,
                              .expert_parallel = ep ? 1 : no_ep ? -1 : 0,
                              .transport = transport, .wire = wire, .seal = seal,
                              .emulate_link = emulate_link };
        lk_engine *e = NULL;
        if (lk_engine_open(&eo, &e, err, sizeof err)) { fprintf(stderr, "lockstep bench: %s\n", err); lk_energy_close(en); return 1; }
        int threads = tlist[ti] ? tlist[ti] : lk_engine_threads(e), ranks = lk_engine_n_ranks(e);
        /* the kernels' settings for these threads, chosen when the model loaded */
        char amx[256] = "";
        int at = 0;
        if (lk_quant_amx_min_tok() > 0)
            at = snprintf(amx, sizeof amx, "; Q4_0/Q8_0 through AMX tiles from %d tokens", lk_quant_amx_min_tok());
        if (lk_quant_amx_few_min_tok() > 0 && at >= 0 && (size_t)at < sizeof amx)
            at += snprintf(amx + at, sizeof amx - (size_t)at,
                           "; repacked Q4_0/Q8_0 through AMX's few-token kernel from %d tokens", lk_quant_amx_few_min_tok());
        /* BF16's kernel reads its activations as AMX-BF16 tiles only where it multiplies through them */
        if (lk_quant_terms_k(LK_TYPE_BF16) == LK_TERMS_TILES && at >= 0 && (size_t)at < sizeof amx)
            snprintf(amx + at, sizeof amx - (size_t)at, "; BF16 through AMX-BF16 tiles at every token count");
        fprintf(stderr, "lockstep bench: threads %d: tune %s%s%s\n", threads, lk_tune_report(), amx,
                ranks > 1 ? " (the head's; each rank tunes its own)" : "");
        /* the bound: the probe with as many threads as the model uses, run
         * again before each repetition (below), so that a row is stated
         * against the machine of its own seconds: a shared machine's
         * bandwidth moves by up to 2x between runs a minute apart */
        size_t llc = lk_membw_llc_bytes();
        size_t bw_bytes = bw_mib ? (size_t)bw_mib << 20 : LK_MAX((size_t)512 << 20, 8 * llc);
        const int64_t nv = lk_engine_cfg(e)->n_vocab;
        driver d = { .e = e, .en = en, .depth = LK_MAX(1, lk_engine_depth(e)), .n_batch = lk_engine_n_batch(e),
                     .prof = profile };
        d.items = lk_xcalloc((size_t)d.depth * smax, sizeof(lk_engine_item));
        d.n_items = lk_xcalloc((size_t)d.depth, sizeof(int));
        d.next = lk_xcalloc((size_t)smax, sizeof(int32_t));
        d.busy = lk_xcalloc((size_t)smax, sizeof(bool));
        d.left = lk_xcalloc((size_t)smax, sizeof(int));
        d.fed = lk_xcalloc((size_t)smax, sizeof(int));
        d.toks = lk_xcalloc((size_t)smax, sizeof(int32_t *));
        for (int i = 0; i < smax; i++) {
            d.toks[i] = lk_xmalloc(sizeof(int32_t) * (size_t)ctx);
            for (int64_t k = 0; k < ctx; k++) d.toks[i][k] = (int32_t)(((k + 131 * i) * 7919 + 13) % nv);
        }
        lk_sampler_params sp;
        lk_sampler_params_default(&sp);
        sp.temp = 0;
        lk_status st = LK_OK;
        for (int i = 0; i < smax && !st; i++) st = lk_engine_seq_params(e, i, &sp, 0, err, sizeof err);
        /* warm-up: page in the weights and settle the thread pool */
        double w1, w2;
        if (!st) st = rep_seqs(&d, 1, 1, 0, &w1, &w2, err, sizeof err);
        double *pp = lk_xcalloc((size_t)reps, sizeof(double)), *tg = lk_xcalloc((size_t)reps, sizeof(double)),
               *bwr = lk_xcalloc((size_t)reps, sizeof(double)), *fr = lk_xcalloc((size_t)reps, sizeof(double));
        for (int si = 0; si < ns && !st; si++) {
            int S = slist[si];
            memset(pp, 0, sizeof(double) * (size_t)reps);
            memset(tg, 0, sizeof(double) * (size_t)reps);
            double jsum = 0, ssum = 0;
            memset(&d.prof_pp, 0, sizeof d.prof_pp);
            memset(&d.prof_tg, 0, sizeof d.prof_tg);
            d.prof_pp_s = d.prof_tg_s = 0;
            lk_prof_enable(profile);
            /* progress: one line rewritten on a terminal; in a log, a line a
             * repetition, so that it never runs into the table's rows when
             * stdout and stderr share a file */
            const bool tty = isatty(STDERR_FILENO);
            for (int r = 0; r < reps && st == LK_OK; r++) {
                bwr[r] = lk_membw_read_gbs(threads, bw_bytes, 3);
                st = rep_seqs(&d, S, (int)p, (int)n, &pp[r], &tg[r], err, sizeof err);
                jsum += d.tg_j;
                ssum += d.tg_s;
                if (!json && !csv)
                    fprintf(stderr, "%sbench: threads %d seqs %d rep %d/%lld%s", tty ? "\r" : "", threads, S, r + 1,
                            (long long)reps, tty ? "" : "\n");
            }
            lk_prof_enable(false);
            if (!json && !csv && tty) fprintf(stderr, "\r%48s\r", "");
            if (st) break;
            const prof_view pv_pp = prof_make(&d.prof_pp, d.prof_pp_s, threads),
                            pv_tg = prof_make(&d.prof_tg, d.prof_tg_s, threads);
            if (profile) {
                prof_print("prefill", &pv_pp, threads, S);
                prof_print("decode", &pv_tg, threads, S);
            }
            /* each repetition's decode over the bound of its own probe;
             * the row gives the median of those and of the probes (with
             * several sequences the bound is also the prefill's rate: a
             * step of S tokens cannot beat a prompt's) */
            const double wb = (double)lk_engine_weight_bytes(e);
            stat3 P = stats(pp, (int)reps);
            int nfr = 0;
            for (int r = 0; r < reps; r++) {
                const double b = decode_bound(S, bwr[r], wb, P.med);
                if (b > 0) fr[nfr++] = tg[r] / b;
            }
            stat3 T = stats(tg, (int)reps), BW = stats(bwr, (int)reps), F = stats(fr, nfr);
            const double bw = BW.med, bound = decode_bound(S, bw, wb, P.med), frac = F.med;
            bool has_j = en && n > 0 && ssum > 0;
            double jpt = has_j ? jsum / ((double)S * n * reps) : 0, watts = has_j ? jsum / ssum : 0;
            if (json) {
                json_t *o = json_object();
                json_object_set_new(o, "model", json_string(base));
                json_object_set_new(o, "threads", json_integer(threads));
                json_object_set_new(o, "seqs", json_integer(S));
                json_object_set_new(o, "ranks", json_integer(ranks));
                json_object_set_new(o, "n_prompt", json_integer(p));
                json_object_set_new(o, "n_gen", json_integer(n));
                json_object_set_new(o, "reps", json_integer(reps));
                json_object_set_new(o, "prefill_tok_s", json_real(P.med));
                json_object_set_new(o, "prefill_tok_s_min", json_real(P.min));
                json_object_set_new(o, "prefill_tok_s_max", json_real(P.max));
                json_object_set_new(o, "decode_tok_s", json_real(T.med));
                json_object_set_new(o, "decode_tok_s_min", json_real(T.min));
                json_object_set_new(o, "decode_tok_s_max", json_real(T.max));
                json_object_set_new(o, "mem_bw_gbs", json_real(bw));
                json_object_set_new(o, "weight_bytes_per_token", json_integer((json_int_t)wb));
                json_object_set_new(o, "decode_bound_tok_s", json_real(bound));
                json_object_set_new(o, "decode_bound_fraction", json_real(frac));
                json_object_set_new(o, "decode_j_per_token", has_j ? json_real(jpt) : json_null());
                json_object_set_new(o, "decode_watts", has_j ? json_real(watts) : json_null());
                json_object_set_new(o, "tune", json_string(lk_tune_report()));
                if (profile) {
                    json_object_set_new(o, "profile_prefill", prof_json(&pv_pp));
                    json_object_set_new(o, "profile_decode", prof_json(&pv_tg));
                }
                char *str = json_dumps(o, JSON_COMPACT);
                printf("%s\n", str);
                free(str);
                json_decref(o);
            } else if (csv) {
                printf("%s,%d,%d,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.0f,%.2f,%.3f,", base, threads, S, ranks, P.med,
                       P.min, P.max, T.med, T.min, T.max, bw, wb, bound, frac);
                if (has_j) printf("%.4f,%.1f\n", jpt, watts); else printf(",\n");
            } else {
                char where[32] = "";
                if (ranks > 1) snprintf(where, sizeof where, " (%d ranks)", ranks);
                printf("| %s%s | %d | %d | %.1f (%.1f–%.1f) | %.2f (%.2f–%.2f) | %.1f | %.1f | %.2f | %.0f %% |", base,
                       where, threads, S, P.med, P.min, P.max, T.med, T.min, T.max, bw, wb / (1 << 20), bound, 100 * frac);
                if (has_j) printf(" %.3f (%.0f W) |\n", jpt, watts);
                else printf(en ? " – |\n" : "\n");
            }
            fflush(stdout);
        }
        if (st) { fprintf(stderr, "lockstep bench: %s\n", err); rc = 1; }
        free(pp); free(tg); free(bwr); free(fr);
        for (int i = 0; i < smax; i++) free(d.toks[i]);
        free(d.toks); free(d.items); free(d.n_items); free(d.next); free(d.busy); free(d.left); free(d.fed);
        lk_engine_close(e);
    }
    lk_energy_close(en);
    int tr_ranks, tr_events;
    char terr[LK_ERRLEN];
    if (trace && lk_trace_finish(&tr_ranks, &tr_events, terr, sizeof terr)) {
        fprintf(stderr, "lockstep bench: %s\n", terr);
        rc = rc ? rc : 1;
    } else if (trace) {
        fprintf(stderr, "lockstep bench: trace of %d rank%s (%d events) in %s\n", tr_ranks, tr_ranks == 1 ? "" : "s",
                tr_events, trace);
    }
    return rc;
}
