/* lockstep bench — prefill and decode speed next to the memory-bandwidth
 * bound measured in the same process just before (llama-bench style).
 *
 * Decode reads every weight once per token, so tok/s <= bandwidth / weight
 * bytes per token; decode_bound_fraction says how close the kernels get. */
#include "cli/cli.h"
#include "engine/engine.h"
#include "kernels/membw.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int lk_cmd_bench(int argc, char **argv) {
    const char *model = NULL, *threads_s = NULL;
    int64_t p = 512, n = 128, reps = 3, bw_mib = 0;
    bool json = false, csv = false, md = false, kv_f16 = false;
    const lk_opt opts[] = {
        { "--model", "-m", LK_OPT_STR, &model, "FILE", "GGUF model (required)" },
        { "--threads", "-t", LK_OPT_STR, &threads_s, "N[,N..]", "thread counts to measure (default: all cores)" },
        { "--n-prompt", "-p", LK_OPT_INT, &p, "N", "prompt tokens for the prefill test; 0 = skip (default 512)" },
        { "--n-gen", "-n", LK_OPT_INT, &n, "N", "tokens to decode; 0 = skip (default 128)" },
        { "--reps", "-r", LK_OPT_INT, &reps, "N", "repetitions; median, min and max are reported (default 3)" },
        { "--kv-f16", NULL, LK_OPT_FLAG, &kv_f16, NULL, "F16 KV cache" },
        { "--bw-mib", NULL, LK_OPT_INT, &bw_mib, "MIB", "bandwidth probe buffer (default: 8 x last-level cache, >= 512 MiB)" },
        { "--json", NULL, LK_OPT_FLAG, &json, NULL, "one JSON object per thread count" },
        { "--csv", NULL, LK_OPT_FLAG, &csv, NULL, "CSV rows" },
        { "--md", NULL, LK_OPT_FLAG, &md, NULL, "a Markdown table (default)" },
        { NULL, NULL, 0, NULL, NULL, NULL },
    };
    const char *pos[1];
    int np = lk_args_parse("bench", "-m FILE [-t N,N] [-p 512] [-n 128] [-r REPS] [--json|--csv|--md]", opts, argc, argv, pos, 0);
    if (np == LK_ARGS_HELP) return 0;
    if (np < 0) return 2;
    if (!model) { fprintf(stderr, "lockstep bench: -m FILE is required (see 'lockstep bench --help')\n"); return 2; }
    if (p < 0 || n < 0 || reps < 1 || reps > 1000 || bw_mib < 0 || (p == 0 && n == 0) || p + n + 1 > 1 << 20) {
        fprintf(stderr, "lockstep bench: -p, -n and -r must be sensible (p, n >= 0, not both 0; 1 <= r <= 1000)\n");
        return 2;
    }
    int tlist[16], nt = 1;
    tlist[0] = 0;
    if (threads_s && (nt = parse_list(threads_s, tlist, 16)) < 0) {
        fprintf(stderr, "lockstep bench: --threads expects a list like 1,2,4, got '%s'\n", threads_s);
        return 2;
    }
    if ((int)json + (int)csv + (int)md > 1) { fprintf(stderr, "lockstep bench: choose one of --json, --csv, --md\n"); return 2; }
    if (csv) printf("model,threads,prefill_tok_s,prefill_min,prefill_max,decode_tok_s,decode_min,decode_max,mem_bw_gbs,weight_bytes_per_token,decode_bound_tok_s,decode_bound_fraction\n");
    else if (!json) {
        printf("| model | threads | pp%lld tok/s | tg%lld tok/s | mem bw GB/s | weights MiB/token | bound tok/s | decode / bound |\n", (long long)p, (long long)n);
        printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    const char *base = strrchr(model, '/') ? strrchr(model, '/') + 1 : model;
    int rc = 0;
    for (int ti = 0; ti < nt; ti++) {
        char err[LK_ERRLEN];
        lk_engine_opts eo = { .model_path = model, .n_threads = tlist[ti], .n_ctx = (int)(p + n + 1),
                              .n_batch = p > 0 ? (int)p : 1, .kv_f16 = kv_f16 };
        lk_engine *e = NULL;
        if (lk_engine_open(&eo, &e, err, sizeof err)) { fprintf(stderr, "lockstep bench: %s\n", err); return 1; }
        int threads = tlist[ti] ? tlist[ti] : lk_engine_threads(e);
        /* the bound, measured now, with as many threads as the model uses */
        size_t llc = lk_membw_llc_bytes();
        size_t bw_bytes = bw_mib ? (size_t)bw_mib << 20 : LK_MAX((size_t)512 << 20, 8 * llc);
        double bw = lk_membw_read_gbs(threads, bw_bytes, 5);
        const int64_t nv = lk_engine_cfg(e)->n_vocab;
        int32_t *toks = lk_xmalloc(sizeof(int32_t) * (size_t)(p + n + 1));
        for (int64_t i = 0; i < p + n + 1; i++) toks[i] = (int32_t)((i * 7919 + 13) % nv);
        lk_sampler_params sp;
        lk_sampler_params_default(&sp);
        sp.temp = 0;
        lk_sampler *s = lk_sampler_create(&sp);
        double *pp = lk_xcalloc((size_t)reps, sizeof(double)), *tg = lk_xcalloc((size_t)reps, sizeof(double));
        int32_t next;
        lk_status st = LK_OK;
        /* warm-up: page in the weights and settle the thread pool */
        st = lk_engine_step(e, toks, 1, 0, s, &next, err, sizeof err);
        for (int r = 0; r < reps && st == LK_OK; r++) {
            if (p > 0) {
                double t0 = lk_time_s();
                st = lk_engine_step(e, toks, (int)p, 0, s, &next, err, sizeof err);
                pp[r] = (double)p / (lk_time_s() - t0);
            }
            if (n > 0 && st == LK_OK) {
                double t0 = lk_time_s();
                for (int64_t i = 0; i < n && st == LK_OK; i++)
                    st = lk_engine_step(e, &toks[p + i], 1, (int)(p + i), s, &next, err, sizeof err);
                tg[r] = (double)n / (lk_time_s() - t0);
            }
            if (!json && !csv) fprintf(stderr, "\rbench: threads %d rep %d/%lld", threads, r + 1, (long long)reps);
        }
        if (!json && !csv) fprintf(stderr, "\r%40s\r", "");
        if (st) { fprintf(stderr, "lockstep bench: %s\n", err); rc = 1; }
        stat3 P = stats(pp, (int)reps), T = stats(tg, (int)reps);
        double wb = (double)lk_engine_weight_bytes(e);
        double bound = bw > 0 ? bw * 1e9 / wb : 0, frac = bound > 0 ? T.med / bound : 0;
        if (rc == 0) {
            if (json) {
                json_t *o = json_object();
                json_object_set_new(o, "model", json_string(base));
                json_object_set_new(o, "threads", json_integer(threads));
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
                char *str = json_dumps(o, JSON_COMPACT);
                printf("%s\n", str);
                free(str);
                json_decref(o);
            } else if (csv) {
                printf("%s,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.0f,%.2f,%.3f\n", base, threads, P.med, P.min, P.max,
                       T.med, T.min, T.max, bw, wb, bound, frac);
            } else {
                printf("| %s | %d | %.1f (%.1f–%.1f) | %.2f (%.2f–%.2f) | %.1f | %.1f | %.2f | %.0f %% |\n", base, threads,
                       P.med, P.min, P.max, T.med, T.min, T.max, bw, wb / (1 << 20), bound, 100 * frac);
            }
            fflush(stdout);
        }
        free(pp); free(tg); free(toks);
        lk_sampler_free(s);
        lk_engine_close(e);
        if (rc) break;
    }
    return rc;
}
