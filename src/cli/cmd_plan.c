/* lockstep plan — predicts decode and prefill tok/s and memory per node of
 * every layout (TP k x PP m on at most --nodes nodes) from a model's shape
 * and the figures of nodes and links, ranks them and says why the best one
 * is as fast as it is and what would help most. The model and its terms are
 * in src/diag/perf.c; BENCHMARKS.md compares its predictions with
 * lockstep's own measurements.
 *
 *   lockstep plan -m model.gguf --nodes 4 --latency-us 25 --link-gbps 10
 *   lockstep plan --shape llama3-70b --type q4_0 --nodes 8 --mem-gb 64 --json
 *   lockstep netbench --local 2 > nb.txt; lockstep plan -m m.gguf --netbench nb.txt --tp 2
 *
 * The GGUF needs only its header, metadata and tensor index: a file cut
 * anywhere after those works. */
#include "cli/cli.h"
#include "diag/diag.h"
#include "quant/quant.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LAYOUTS 512

typedef struct {
    const lk_diag_shape *s;
    lk_diag_run run;
    int nodes, tp, pp;   /* tp, pp: 0 = every value */
    bool by_seqs;        /* rank by the S-sequence aggregate */
} space;

static double figure(const space *sp, const lk_diag_est *e) {
    if (!e->fits) return -1;
    return sp->by_seqs ? e->decode_tok_s_seqs : e->decode_tok_s;
}

/* Every layout of the space, ranked best first; returns the count. */
static int rank_layouts(const space *sp, const lk_diag_hw *hw, lk_diag_est *out) {
    int n = 0;
    for (int tp = 1; tp <= sp->nodes; tp++)
        for (int pp = 1; tp * pp <= sp->nodes && pp <= sp->s->n_layer; pp++) {
            if ((sp->tp && tp != sp->tp) || (sp->pp && pp != sp->pp) || n == MAX_LAYOUTS) continue;
            lk_diag_estimate(sp->s, hw, &sp->run, tp, pp, &out[n++]);
        }
    /* insertion sort: best figure first; ties to fewer nodes */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0; j--) {
            double a = figure(sp, &out[j - 1]), b = figure(sp, &out[j]);
            int na = out[j - 1].tp * out[j - 1].pp, nb = out[j].tp * out[j].pp;
            if (b > a * 1.0005 || (fabs(b - a) <= a * 0.0005 && nb < na)) {
                lk_diag_est t = out[j];
                out[j] = out[j - 1];
                out[j - 1] = t;
            } else break;
        }
    return n;
}

static double best_figure(const space *sp, const lk_diag_hw *hw, lk_diag_est *scratch) {
    int n = rank_layouts(sp, hw, scratch);
    return n ? figure(sp, &scratch[0]) : -1;
}

static bool parse_pos(const char *flag, double v, bool zero_ok) {
    if (isfinite(v) && (v > 0 || (zero_ok && v == 0))) return true;
    fprintf(stderr, "lockstep plan: %s must be a positive number (got %g)\n", flag, v);
    return false;
}

static char *slurp(const char *path, char *err, size_t errlen) {
    FILE *f = !strcmp(path, "-") ? stdin : fopen(path, "r");
    if (!f) { snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno)); return NULL; }
    size_t cap = 1 << 16, n = 0;
    char *b = lk_xmalloc(cap);
    size_t k;
    while ((k = fread(b + n, 1, cap - 1 - n, f)) > 0) {
        n += k;
        if (n == cap - 1) {
            if (cap >= (16u << 20)) break;
            cap *= 2;
            b = lk_xrealloc(b, cap);
        }
    }
    b[n] = 0;
    if (f != stdin) fclose(f);
    return b;
}

int lk_cmd_plan(int argc, char **argv) {
    const char *model = NULL, *shape = NULL, *type_s = "q4_0", *netbench = NULL, *node_bench = NULL, *doctor = NULL;
    int64_t nodes = 0, tp = 0, pp = 0, seqs = 0, ctx = 512, prompt = 512, batch = 512;
    double mem_gb = -1, bw = -1, flops = -1, lat = -1, gbps = -1, rank_bw = 0, rank_flops = 0;
    bool json = false, local = false, kv_f16 = false;
    const lk_opt opts[] = {
        {"--model", "-m", LK_OPT_STR, &model, "FILE", "GGUF model: only its header, metadata and tensor index are read"},
        {"--shape", NULL, LK_OPT_STR, &shape, "NAME", "a built-in shape instead (gen-model's: tinyllama-1.1b, llama3-8b, ...)"},
        {"--type", NULL, LK_OPT_STR, &type_s, "T", "weight type with --shape (default q4_0)"},
        {"--nodes", "-N", LK_OPT_INT, &nodes, "N", "nodes available (default: tp x pp, else 1); layouts use at most N"},
        {"--tp", NULL, LK_OPT_INT, &tp, "K", "only layouts with K tensor-parallel ranks"},
        {"--pp", NULL, LK_OPT_INT, &pp, "M", "only layouts with M pipeline stages"},
        {"--mem-gb", NULL, LK_OPT_F64, &mem_gb, "GB", "memory per node (default 64)"},
        {"--mem-bw-gbs", NULL, LK_OPT_F64, &bw, "GB/s",
         "rate the decode kernels read weights at, per node (default 50; lockstep bench: weights MiB/token x tg tok/s, "
         "or ~0.85 x its probe)"},
        {"--flops", NULL, LK_OPT_F64, &flops, "GFLOP/s",
         "matrix kernels' rate on many tokens, per node (default 500; lockstep bench: pp tok/s x 2 x parameters)"},
        {"--latency-us", NULL, LK_OPT_F64, &lat, "US", "one-way link latency (default 25: TCP over 10 GbE)"},
        {"--link-gbps", NULL, LK_OPT_F64, &gbps, "GBIT/S", "link rate (default 10)"},
        {"--netbench", NULL, LK_OPT_STR, &netbench, "FILE",
         "lockstep netbench's output (- for stdin): its latency, rate and measured all-reduce times"},
        {"--doctor", NULL, LK_OPT_STR, &doctor, "FILE",
         "lockstep doctor --json's output: the slowest link, the all-reduce table, the weight read rate its decode "
         "steps reached"},
        {"--node-bench", NULL, LK_OPT_STR, &node_bench, "FILE",
         "lockstep bench --json of one node, same model, -t T,2T --seqs 1,4,8..: its measured step times replace "
         "--mem-bw-gbs and --flops"},
        {"--local", NULL, LK_OPT_FLAG, &local, NULL,
         "the ranks are processes on one host (--local N runs): --mem-bw-gbs and --flops are the host's, shared"},
        {"--rank-mem-bw-gbs", NULL, LK_OPT_F64, &rank_bw, "GB/s", "with --local: what one rank's threads read alone"},
        {"--rank-flops", NULL, LK_OPT_F64, &rank_flops, "GFLOP/s", "with --local: what one rank's threads compute alone"},
        {"--seqs", "-s", LK_OPT_INT, &seqs, "S",
         "sequences decoding together for the batched figures (default 8); given, layouts are ranked by them"},
        {"--ctx", "-c", LK_OPT_INT, &ctx, "N", "positions in each sequence's KV cache while decoding (default 512)"},
        {"--prompt", "-p", LK_OPT_INT, &prompt, "N", "prompt tokens per sequence for prefill (default 512)"},
        {"--batch", "-b", LK_OPT_INT, &batch, "N", "tokens per step at most (run's --batch, default 512)"},
        {"--kv-f16", NULL, LK_OPT_FLAG, &kv_f16, NULL, "F16 KV cache"},
        {"--json", NULL, LK_OPT_FLAG, &json, NULL, "one JSON object per layout, best first"},
        {0},
    };
    const char *syn = "-m FILE | --shape NAME [--type T]  [--nodes N] [--tp K] [--pp M] [node and link figures] "
                      "[--netbench FILE] [--seqs S] [--json]";
    int np = lk_args_parse("plan", syn, opts, argc, argv, NULL, 0);
    if (np == LK_ARGS_HELP) {
        printf("\nshapes:");
        for (int i = 0; lk_diag_shape_name(i); i++) printf(" %s", lk_diag_shape_name(i));
        printf("\n\nThe model behind the figures (every term) is documented in src/diag/perf.c; its predictions\n"
               "against measured runs are in BENCHMARKS.md. Decode tok/s is for one sequence; 'xS' is S\n"
               "sequences decoding together (aggregate). Layouts that do not fit --mem-gb rank last.\n");
        return 0;
    }
    if (np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (!model == !shape) {
        fprintf(stderr, "lockstep plan: give the model as -m FILE or --shape NAME (one of them; see --help)\n");
        return 2;
    }
    if (nodes < 0 || nodes > 4096 || tp < 0 || tp > 256 || pp < 0 || pp > 256) {
        fprintf(stderr, "lockstep plan: --nodes must be 1..4096, --tp and --pp 1..256\n");
        return 2;
    }
    if (seqs < 0 || seqs > 4096 || ctx < 1 || ctx > (1 << 24) || prompt < 1 || prompt > (1 << 24) || batch < 1 ||
        batch > (1 << 20)) {
        fprintf(stderr, "lockstep plan: --seqs 1..4096, --ctx, --prompt and --batch must be positive\n");
        return 2;
    }
    if (nodes == 0) nodes = (tp ? tp : 1) * (pp ? pp : 1);
    if ((tp ? tp : 1) * (pp ? pp : 1) > nodes) {
        fprintf(stderr, "lockstep plan: --tp %lld x --pp %lld needs %lld nodes, --nodes is %lld\n", (long long)(tp ? tp : 1),
                (long long)(pp ? pp : 1), (long long)((tp ? tp : 1) * (pp ? pp : 1)), (long long)nodes);
        return 2;
    }
    if ((rank_bw || rank_flops) && !local) {
        fprintf(stderr, "lockstep plan: --rank-mem-bw-gbs and --rank-flops go with --local\n");
        return 2;
    }
    lk_diag_hw hw = {.mem_gb = 64, .mem_bw_gbs = 50, .gflops = 500, .latency_us = 25, .link_gbps = 10, .local = local,
                     .rank_mem_bw_gbs = rank_bw, .rank_gflops = rank_flops};
    char assumed[160] = "";
#define FIG(var, field, flag, zero_ok)                                                                              \
    do {                                                                                                            \
        if (var != -1) {                                                                                                 \
            if (!parse_pos(flag, var, zero_ok)) return 2;                                                           \
            hw.field = var;                                                                                         \
        } else                                                                                                      \
            snprintf(assumed + strlen(assumed), sizeof assumed - strlen(assumed), "%s%s", assumed[0] ? ", " : "", flag); \
    } while (0)
    FIG(mem_gb, mem_gb, "--mem-gb", false);
    FIG(bw, mem_bw_gbs, "--mem-bw-gbs", false);
    FIG(flops, gflops, "--flops", false);
    if (rank_bw && !parse_pos("--rank-mem-bw-gbs", rank_bw, false)) return 2;
    if (rank_flops && !parse_pos("--rank-flops", rank_flops, false)) return 2;
    char err[LK_ERRLEN];
    if (netbench) {
        char *text = slurp(netbench, err, sizeof err);
        if (!text) { fprintf(stderr, "lockstep plan: --netbench %s\n", err); return 1; }
        lk_status st = lk_diag_hw_netbench(text, &hw, err, sizeof err);
        free(text);
        if (st) { fprintf(stderr, "lockstep plan: --netbench %s: %s\n", netbench, err); return 1; }
    }
    if (doctor) {
        char *text = slurp(doctor, err, sizeof err);
        if (!text) { fprintf(stderr, "lockstep plan: --doctor %s\n", err); return 1; }
        lk_status st = lk_diag_hw_doctor(text, &hw, err, sizeof err);
        free(text);
        if (st) { fprintf(stderr, "lockstep plan: --doctor %s: %s\n", doctor, err); return 1; }
        bool measured_bw = hw.mem_bw_gbs != 50 || hw.local != local;
        local = hw.local;
        snprintf(assumed, sizeof assumed, "%s%s%s", mem_gb == -1 ? "--mem-gb, " : "", measured_bw ? "" : "--mem-bw-gbs, ",
                 flops == -1 ? "--flops" : "");
        size_t al = strlen(assumed);
        if (al >= 2 && assumed[al - 2] == ',') assumed[al - 2] = 0;
    }
    if (node_bench) {
        if (bw != -1 || flops != -1 || local) {
            fprintf(stderr, "lockstep plan: --node-bench replaces --mem-bw-gbs, --flops and --local\n");
            return 2;
        }
        char *text = slurp(node_bench, err, sizeof err);
        if (!text) { fprintf(stderr, "lockstep plan: --node-bench %s\n", err); return 1; }
        lk_status st = lk_diag_hw_bench(text, &hw, err, sizeof err);
        free(text);
        if (st) { fprintf(stderr, "lockstep plan: --node-bench %s: %s\n", node_bench, err); return 1; }
        assumed[0] = 0;
        if (mem_gb == -1) snprintf(assumed, sizeof assumed, "--mem-gb");
    }
    /* flags given beside --netbench win over it */
    if (lat != -1) { if (!parse_pos("--latency-us", lat, true)) return 2; hw.latency_us = lat; hw.n_ar = 0; }
    else if (!netbench && !doctor) snprintf(assumed + strlen(assumed), sizeof assumed - strlen(assumed), "%s--latency-us", assumed[0] ? ", " : "");
    if (gbps != -1) { if (!parse_pos("--link-gbps", gbps, false)) return 2; hw.link_gbps = gbps; }
    else if (!netbench && !doctor) snprintf(assumed + strlen(assumed), sizeof assumed - strlen(assumed), "%s--link-gbps", assumed[0] ? ", " : "");
#undef FIG

    lk_diag_shape s;
    if (shape) {
        lk_type t;
        if (!lk_type_from_name(type_s, &t)) { fprintf(stderr, "lockstep plan: unknown --type '%s'\n", type_s); return 2; }
        if (!lk_diag_shape_builtin(shape, t, &s)) {
            fprintf(stderr, "lockstep plan: unknown shape '%s' (known:", shape);
            for (int i = 0; lk_diag_shape_name(i); i++) fprintf(stderr, " %s", lk_diag_shape_name(i));
            fprintf(stderr, ")\n");
            return 2;
        }
    } else if (lk_diag_shape_gguf(model, &s, err, sizeof err)) {
        fprintf(stderr, "lockstep plan: %s\n", err);
        return 1;
    }
    if (pp > s.n_layer) {
        fprintf(stderr, "lockstep plan: --pp %lld exceeds the model's %lld layers\n", (long long)pp, (long long)s.n_layer);
        return 2;
    }
    space sp = {.s = &s, .nodes = (int)nodes, .tp = (int)tp, .pp = (int)pp, .by_seqs = seqs > 0,
                .run = {.seqs = seqs > 0 ? (int)seqs : 8, .ctx = (int)ctx, .prompt = (int)prompt,
                        .n_batch = (int)batch, .kv_f16 = kv_f16, .rank_seqs = seqs > 0}};
    static lk_diag_est est[MAX_LAYOUTS], scratch[MAX_LAYOUTS];
    int n = rank_layouts(&sp, &hw, est);
    int S = sp.run.seqs;
    double wbytes = s.n_layer * (s.qo_bytes + s.kv_bytes + s.ffn_bytes) + s.out_bytes;

    if (json) {
        for (int i = 0; i < n; i++) {
            const lk_diag_est *e = &est[i];
            json_t *o = json_object();
            json_object_set_new(o, "rank", json_integer(i + 1));
            json_object_set_new(o, "tp", json_integer(e->tp));
            json_object_set_new(o, "pp", json_integer(e->pp));
            json_object_set_new(o, "nodes", json_integer(e->tp * e->pp));
            json_object_set_new(o, "decode_tok_s", json_real(e->decode_tok_s));
            json_object_set_new(o, "prefill_tok_s", json_real(e->prefill_tok_s));
            json_object_set_new(o, "seqs", json_integer(S));
            json_object_set_new(o, "decode_tok_s_seqs", json_real(e->decode_tok_s_seqs));
            json_object_set_new(o, "prefill_tok_s_seqs", json_real(e->prefill_tok_s_seqs));
            json_object_set_new(o, "mem_per_node_gb", json_real(e->mem_per_node_gb));
            json_object_set_new(o, "fits", json_boolean(e->fits));
            json_object_set_new(o, "bottleneck", json_string(lk_diag_bottleneck_name(e->bottleneck)));
            json_object_set_new(o, "reason", json_string(e->reason));
            json_object_set_new(o, "step_ms", json_real(e->t_token_ms));
            json_object_set_new(o, "allreduces", json_integer(e->n_allreduce));
            json_object_set_new(o, "allreduce_us", json_real(e->allreduce_us));
            char *str = json_dumps(o, JSON_COMPACT);
            printf("%s\n", str);
            free(str);
            json_decref(o);
        }
        return n > 0 && est[0].fits ? 0 : 1;
    }

    printf("plan: %s (%s, %lld layers, embedding %lld, %lld/%lld heads, %.2f GB of weights) on %lld node%s\n", s.name,
           s.arch, (long long)s.n_layer, (long long)s.n_embd, (long long)s.n_head, (long long)s.n_head_kv, wbytes / 1e9,
           (long long)nodes, nodes > 1 ? "s" : "");
    if (hw.n_prof)
        printf("  each node: as measured by bench with %d thread%s per rank (%.1f GB/s decode reads), %.0f GB; links: ",
               hw.prof_threads, hw.prof_threads > 1 ? "s" : "", hw.mem_bw_gbs, hw.mem_gb);
    else
        printf("  %s: %.1f GB/s weight reads, %.0f GFLOP/s, %.0f GB; links: ",
               local ? "host (shared by the ranks)" : "each node", hw.mem_bw_gbs, hw.gflops, hw.mem_gb);
    if (hw.n_ar) printf("all-reduces as netbench measured them, ");
    printf("%.1f us one-way, %.1f Gbit/s\n", hw.latency_us, hw.link_gbps);
    if (assumed[0]) printf("  assumed (not given): %s\n", assumed);
    printf("  decode at %d positions of context; prefill %d-token prompts, steps of at most %d tokens\n\n", sp.run.ctx,
           sp.run.prompt, sp.run.n_batch);
    printf("  %-10s %5s %13s %14s %14s %15s %12s  %s\n", "layout", "nodes", "decode tok/s", "decode x", "prefill tok/s",
           "prefill x", "mem/node GB", "bottleneck");
    for (int i = 0; i < n; i++) {
        const lk_diag_est *e = &est[i];
        char lay[24];
        snprintf(lay, sizeof lay, "tp%d pp%d", e->tp, e->pp);
        printf("  %-10s %5d %13.2f %14.2f %14.1f %15.1f %12.2f  %s%s\n", lay, e->tp * e->pp, e->decode_tok_s,
               e->decode_tok_s_seqs, e->prefill_tok_s, e->prefill_tok_s_seqs, e->mem_per_node_gb,
               lk_diag_bottleneck_name(e->bottleneck), e->fits ? "" : " (does not fit)");
    }
    printf("  (decode x and prefill x: %d sequences together, aggregate)\n\n", S);
    if (n == 0 || !est[0].fits) {
        printf("no layout fits: %s\n", n ? est[0].reason : "no layout");
        return 1;
    }
    const lk_diag_est *b = &est[0];
    printf("best: --tp %d --pp %d: %.2f tok/s decoding %s", b->tp, b->pp, figure(&sp, b),
           sp.by_seqs ? "" : "one sequence");
    if (sp.by_seqs) printf("%d sequences together", S);
    printf(", %.1f tok/s prefill, %.2f GB per node\n", b->prefill_tok_s, b->mem_per_node_gb);
    printf("  why: %s\n", b->reason);
    if (b->tp * b->pp < nodes)
        printf("  uses %d of the %lld nodes: more of them would be slower in this model\n", b->tp * b->pp, (long long)nodes);

    /* what would help most: the best figure of the whole space under each change */
    typedef struct { char what[96]; double fig; } alt_t;
    alt_t alts[6];
    int na = 0;
    lk_diag_hw h;
    space s2;
    if (nodes > 1 || (b->tp * b->pp > 1)) {
        if (hw.latency_us > 5 || hw.n_ar) {
            h = hw, h.latency_us = 5, h.n_ar = 0;
            snprintf(alts[na].what, sizeof alts[na].what, "RDMA-class links (5 us one-way instead of %.0f)", hw.latency_us);
            alts[na++].fig = best_figure(&sp, &h, scratch);
        }
        h = hw, h.link_gbps = hw.link_gbps * 10;
        snprintf(alts[na].what, sizeof alts[na].what, "10x the link rate (%.0f Gbit/s)", h.link_gbps);
        alts[na++].fig = best_figure(&sp, &h, scratch);
    }
    if (hw.n_prof) {
        h = hw;
        for (int i = 0; i < h.n_prof; i++) h.prof_a[i] /= 2, h.prof_b[i] /= 2;
        snprintf(alts[na].what, sizeof alts[na].what, "nodes twice as fast (half the measured step time)");
        alts[na++].fig = best_figure(&sp, &h, scratch);
    } else {
        h = hw, h.mem_bw_gbs *= 2, h.rank_mem_bw_gbs *= 2;
        snprintf(alts[na].what, sizeof alts[na].what, "2x the memory bandwidth per node");
        alts[na++].fig = best_figure(&sp, &h, scratch);
        h = hw, h.gflops *= 2, h.rank_gflops *= 2;
        snprintf(alts[na].what, sizeof alts[na].what, "2x the compute per node");
        alts[na++].fig = best_figure(&sp, &h, scratch);
    }
    if (nodes < 2048 && !tp && !pp) {
        s2 = sp, s2.nodes = (int)nodes * 2;
        snprintf(alts[na].what, sizeof alts[na].what, "%lld nodes instead of %lld", (long long)nodes * 2, (long long)nodes);
        alts[na++].fig = best_figure(&s2, &hw, scratch);
    }
    int bi = 0;
    for (int i = 1; i < na; i++)
        if (alts[i].fig > alts[bi].fig) bi = i;
    double base = figure(&sp, b);
    if (na && alts[bi].fig > base * 1.02)
        printf("  would help most: %s: %.2f tok/s (%+.0f %%)\n", alts[bi].what, alts[bi].fig, 100 * (alts[bi].fig / base - 1));
    else
        printf("  would help most: nothing listed gains more than 2 %% (links, memory, compute, nodes)\n");
    if (!sp.by_seqs && S > 1)
        printf("  batching: %d sequences decode %.1f tok/s together on this layout (%.1fx one)\n", S, b->decode_tok_s_seqs,
               b->decode_tok_s_seqs / b->decode_tok_s);
    return 0;
}
