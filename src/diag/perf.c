/* The performance model: decode and prefill tok/s and memory per node of one
 * layout (TP k x PP m) from a model's shape and the figures of its nodes
 * and links. Every term below is one thing the engine does per step
 * (docs/ARCHITECTURE.md sections 2-4); nothing is fitted.
 *
 * Terms (rank = one of k x m processes; stage s holds L_s layers, cut as
 * lk_plan_make_split cuts them: round(L x i / m)):
 *
 *   share      f = 1/k of query heads, FFN rows and vocabulary rows;
 *              f_kv = max(1/k, 1/n_head_kv) of Wk, Wv and the KV cache (past
 *              n_head_kv ranks a KV head is computed by every rank using it)
 *   weights    W_s = L_s (Wqo f + Wkv f_kv + Wffn f) [+ Wout f on the last
 *              stage when the step samples]: bytes a rank streams per step,
 *              once for all the step's tokens
 *   KV         Q items x c positions x kv_pos_s bytes, kv_pos_s = L_s x
 *              kv_row f_kv x (4 F32, 2 F16), kv_row = 2 x n_head_kv x
 *              head_dim (MLA: kv_lora + rope, the latent, on every rank)
 *   compute    2 x elements per token (T tokens) + attention 4 x L_s x
 *              n_head f x head_dim x c per token + 2 x Wout f elements per
 *              sampling item, at the node's GFLOP/s
 *   roofline   t_stage = max(bytes / bw, flops / F) + all-reduces
 *   all-reduce 2 per layer (attention, FFN), T x n_embd x 4 bytes each;
 *              below 64 KiB the exchange: one one-way latency (ranks in
 *              step send at once: measured, see allreduce_cost) + (k-1) x
 *              bytes / rate; from 64 KiB the scatter: two latencies + 2
 *              (k-1)/k x bytes / rate
 *              (lk_comm_pick); netbench's measured times replace this when
 *              given (interpolated on size, log-log)
 *   per step   the step message to the TP peers of rank 0 (one latency, TP
 *              only: rank 0 starts first and waits at its first all-reduce),
 *              the candidates back to rank 0 (one latency, any cluster), one
 *              hand-off per stage boundary (latency + T x n_embd x 4 bytes)
 *   pipeline   D = min(m, 16) steps in flight (lk_engine_depth), each with
 *              b = ceil(S / min(D, S)) sequences, n_mb = ceil(S / b) of
 *              them: a cycle that gives every sequence one token takes
 *              max(n_mb x slowest stage, one step's round trip through all
 *              stages); S / cycle tok/s. One sequence in m stages: the
 *              round trip, each stage idle (m-1)/m of the time (the bubble).
 *   prefill    S prompts of P tokens in steps of T = min(n_batch, P x
 *              sequences per step) tokens, the same cycle with T tokens
 *              per step and attention at c = P/2
 *   --local    the ranks share one host: bw and F are the host's divided by
 *              the ranks working at once (k x the stages busy), capped by
 *              what one rank reaches alone (rank_mem_bw_gbs, rank_gflops)
 *   memory     per rank: its weights (+ the embedding on the first stage,
 *              which stays on the file mapping), S x ctx KV positions,
 *              scratch for n_batch rows; the fullest rank (the host's sum
 *              with --local)
 *
 * Not modelled: per-dispatch costs of the thread pool (~5 per layer, us
 * each), the sampler, the kernels' efficiency (give the rate they reach:
 * `lockstep bench` prints weights MiB/token x tg tok/s), rank imbalance and
 * noise (a TP step waits for its slowest rank), MoE. */
#include "diag/diag.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *lk_diag_bottleneck_name(lk_diag_bottleneck b) {
    switch (b) {
    case LK_BN_MEMORY: return "memory";
    case LK_BN_COMPUTE: return "compute";
    case LK_BN_LATENCY: return "latency";
    case LK_BN_LINK: return "link";
    case LK_BN_PIPELINE: return "pipeline";
    case LK_BN_CAPACITY: return "capacity";
    }
    return "?";
}

/* One all-reduce of `bytes` among k ranks: seconds, split into the part
 * that is round trips (*lat) and the part that is bytes at the link rate. */
static void allreduce_cost(const lk_diag_hw *hw, int k, double bytes, double *lat, double *link) {
    *lat = *link = 0;
    if (k < 2) return;
    if (hw->n_ar > 0) {
        /* measured: log-log interpolation, flat beyond the ends */
        double t;
        if (bytes <= hw->ar_bytes[0]) t = hw->ar_us[0];
        else if (bytes >= hw->ar_bytes[hw->n_ar - 1]) t = hw->ar_us[hw->n_ar - 1] * bytes / hw->ar_bytes[hw->n_ar - 1];
        else {
            int i = 1;
            while (hw->ar_bytes[i] < bytes) i++;
            double x0 = log(hw->ar_bytes[i - 1]), x1 = log(hw->ar_bytes[i]);
            double y0 = log(hw->ar_us[i - 1]), y1 = log(hw->ar_us[i]);
            t = exp(y0 + (y1 - y0) * (log(bytes) - x0) / (x1 - x0));
        }
        *lat = t * 1e-6;
        return;
    }
    /* Below 64 KiB the exchange: every rank sends its vector to every other
     * at once and then waits for theirs, so ranks that run in step (a decode
     * step's layers) pay one one-way delay, not a round trip. Measured
     * through --emulate-link on the 16-core Xeon (BENCHMARKS.md, "Latency
     * against bandwidth"): tp 2 of a 2-layer model at 1000 us ran 6.96 ms per
     * token, 6 one-way delays (4 all-reduces, the step message, the
     * candidates) plus compute, where a round trip per all-reduce would be
     * 10 delays. (netbench's isolated all-reduce loop measures about a round
     * trip per call: its iterations do not overlap the two directions the
     * way a step's layers do.) From 64 KiB the scatter: a reduce-scatter
     * round and an all-gather round, two delays. */
    double L = hw->latency_us * 1e-6, rate = hw->link_gbps * 1e9 / 8;
    if (bytes < 65536) *lat = L, *link = (k - 1) * bytes / rate;
    else *lat = 2 * L, *link = 2.0 * (k - 1) / k * bytes / rate;
}

/* The profile's (a, b) at T tokens: linear between measured T, extended
 * along the last segment beyond the largest, flat below the smallest. */
static void profile_at(const lk_diag_hw *hw, double T, double *a, double *b) {
    int n = hw->n_prof;
    if (n == 1 || T <= hw->prof_tok[0]) { *a = hw->prof_a[0], *b = hw->prof_b[0]; return; }
    int i = 1;
    while (i < n - 1 && hw->prof_tok[i] < T) i++;
    double x0 = hw->prof_tok[i - 1], x1 = hw->prof_tok[i], w = (T - x0) / (x1 - x0);
    *a = hw->prof_a[i - 1] + w * (hw->prof_a[i] - hw->prof_a[i - 1]);
    *b = hw->prof_b[i - 1] + w * (hw->prof_b[i] - hw->prof_b[i - 1]);
    if (*a < 0) *a = 0;
    if (*b < 0) *b = 0;
}

typedef struct {
    double t_mem, t_cmp;   /* seconds */
    double ar_lat, ar_link; /* all of the stage's all-reduces */
    int    n_ar;
    double bw;             /* B/s this rank read at (shared under --local) */
} stage_cost;

typedef struct {
    const lk_diag_shape *s;
    const lk_diag_hw    *hw;
    int    k, m;
    double f, f_kv, kvel;  /* shares; bytes per KV element */
    int64_t lcut[257];
} ctx_t;

static int stage_layers(const ctx_t *c, int st) { return (int)(c->lcut[st + 1] - c->lcut[st]); }

/* One rank of stage st doing a step of T tokens over Q items, each at
 * context cpos (mean position attended), n_samp of them sampling, while
 * `active` ranks of the host work at once. */
static stage_cost stage_step(const ctx_t *c, int st, double T, double Q, double cpos, double n_samp, int active) {
    const lk_diag_shape *s = c->s;
    const lk_diag_hw *hw = c->hw;
    double Ls = stage_layers(c, st);
    bool last = st == c->m - 1;
    double bytes = Ls * (s->qo_bytes * c->f + s->kv_bytes * c->f_kv + s->ffn_bytes * c->f);
    double elems = Ls * (s->qo_elems * c->f + s->kv_elems * c->f_kv + s->ffn_elems * c->f);
    double kv_pos = Ls * s->kv_row * c->f_kv * c->kvel;
    bytes += Q * cpos * kv_pos;
    double flops = 2.0 * T * elems + T * 4.0 * Ls * (double)s->n_head * c->f * (double)s->head_dim * cpos;
    if (last && n_samp > 0) bytes += s->out_bytes * c->f, flops += 2.0 * n_samp * s->out_elems * c->f;
    double bw = hw->mem_bw_gbs * 1e9, F = hw->gflops * 1e9;
    if (hw->n_prof > 0) {
        /* measured node: the stage's share of the per-layer (and output)
         * bytes of the whole model's step at T tokens; of that, the part a
         * shrinks with the TP share, b does not (see lk_diag_hw_bench) */
        double full = (double)s->n_layer * (s->qo_bytes + s->kv_bytes + s->ffn_bytes) + s->out_bytes;
        double mine = Ls * (s->qo_bytes + s->kv_bytes + s->ffn_bytes) + (last && n_samp > 0 ? s->out_bytes : 0);
        double a, b;
        profile_at(hw, T, &a, &b);
        double t = mine / full * (a * c->f + b);
        if (cpos > hw->prof_ctx) t += Q * (cpos - hw->prof_ctx) * kv_pos / bw; /* KV beyond the profiled context */
        stage_cost r = {.t_mem = T <= 1 ? t : 0, .t_cmp = T <= 1 ? 0 : t, .bw = bw};
        if (c->k > 1) {
            double lat, link;
            allreduce_cost(hw, c->k, T * (double)s->n_embd * 4, &lat, &link);
            r.n_ar = 2 * (int)Ls;
            r.ar_lat = r.n_ar * lat, r.ar_link = r.n_ar * link;
        }
        return r;
    }
    if (hw->local) {
        bw /= active, F /= active;
        if (hw->rank_mem_bw_gbs > 0) bw = fmin(bw, hw->rank_mem_bw_gbs * 1e9);
        if (hw->rank_gflops > 0) F = fmin(F, hw->rank_gflops * 1e9);
    }
    stage_cost r = {.t_mem = bytes / bw, .t_cmp = flops / F, .bw = bw};
    if (c->k > 1) {
        double lat, link;
        allreduce_cost(hw, c->k, T * (double)s->n_embd * 4, &lat, &link);
        r.n_ar = 2 * (int)Ls;
        r.ar_lat = r.n_ar * lat, r.ar_link = r.n_ar * link;
    }
    return r;
}

static double stage_time(const stage_cost *x) { return fmax(x->t_mem, x->t_cmp) + x->ar_lat + x->ar_link; }

typedef struct {
    double cycle, roundtrip, slowest;  /* seconds */
    double mem, cmp_excess, lat, link; /* the round trip, split */
    double work;                       /* sum of the stages' times of one step */
    double bw;                         /* B/s a rank read at */
    int    n_ar, busy, n_mb;
} cycle_t;

/* n_mb micro-batches in flight, each T tokens of Q items at context cpos,
 * n_samp sampling: the cycle that completes all of them once. */
static cycle_t pipeline_cycle(const ctx_t *c, int n_mb, double T, double Q, double cpos, double n_samp) {
    const lk_diag_hw *hw = c->hw;
    cycle_t y = {0};
    y.busy = n_mb < c->m ? n_mb : c->m;
    int active = c->k * y.busy;
    double L = hw->latency_us * 1e-6, rate = hw->link_gbps * 1e9 / 8;
    for (int st = 0; st < c->m; st++) {
        stage_cost x = stage_step(c, st, T, Q, cpos, n_samp, active);
        double t = stage_time(&x);
        y.slowest = fmax(y.slowest, t);
        y.roundtrip += t;
        y.work += t;
        y.bw = x.bw;
        y.mem += x.t_mem;
        y.cmp_excess += fmax(0, x.t_cmp - x.t_mem);
        y.lat += x.ar_lat;
        y.link += x.ar_link;
        y.n_ar += x.n_ar;
    }
    int N = c->k * c->m;
    double extra_lat = (c->k > 1 ? L : 0) + (N > 1 ? L : 0) + (c->m - 1) * L;
    double extra_link = (c->m - 1) * T * (double)c->s->n_embd * 4 / rate;
    y.roundtrip += extra_lat + extra_link;
    y.lat += extra_lat;
    y.link += extra_link;
    y.n_mb = n_mb;
    y.cycle = fmax(n_mb * y.slowest, y.roundtrip);
    return y;
}

static double ceil_div(double a, double b) { return ceil(a / b - 1e-9); }

/* decode of S sequences at context ctx: tok/s and the cycle */
static double decode_rate(const ctx_t *c, int S, double ctxpos, cycle_t *cy) {
    int D = c->m < 16 ? c->m : 16;
    int b = c->m == 1 ? S : (int)ceil_div(S, D < S ? D : S);
    int n_mb = (int)ceil_div(S, b);
    *cy = pipeline_cycle(c, n_mb, b, b, ctxpos, b);
    return S / cy->cycle;
}

static double prefill_rate(const ctx_t *c, int S, int P, int n_batch) {
    int D = c->m < 16 ? c->m : 16;
    int per_step = c->m == 1 ? S : (int)ceil_div(S, D < S ? D : S);
    double T = fmin((double)n_batch, (double)P * per_step);
    double Q = ceil_div(T, P), n_steps = ceil_div((double)S * P, T);
    int n_mb = c->m == 1 ? 1 : (int)fmin(D, n_steps);
    cycle_t cy = pipeline_cycle(c, n_mb, T, Q, P / 2.0, T / P);
    double t = ceil_div(n_steps, n_mb) * cy.cycle;
    return (double)S * P / t;
}

void lk_diag_estimate(const lk_diag_shape *s, const lk_diag_hw *hw, const lk_diag_run *run, int tp, int pp,
                      lk_diag_est *e) {
    LK_ASSERT(tp >= 1 && pp >= 1 && pp <= 256 && run->seqs >= 1);
    memset(e, 0, sizeof *e);
    ctx_t c = {.s = s, .hw = hw, .k = tp, .m = pp};
    c.f = 1.0 / tp;
    c.f_kv = fmin(1.0, fmax(1.0 / tp, s->n_head_kv > 0 ? 1.0 / (double)s->n_head_kv : 1.0));
    c.kvel = run->kv_f16 ? 2 : 4;
    for (int i = 0; i <= pp; i++) c.lcut[i] = (int64_t)floor((double)s->n_layer * i / pp + 0.5);
    e->tp = tp, e->pp = pp;

    cycle_t one, many;
    e->decode_tok_s = decode_rate(&c, 1, run->ctx, &one);
    e->decode_tok_s_seqs = decode_rate(&c, run->seqs, run->ctx, &many);
    e->prefill_tok_s = prefill_rate(&c, 1, run->prompt, run->n_batch);
    e->prefill_tok_s_seqs = prefill_rate(&c, run->seqs, run->prompt, run->n_batch);

    /* memory: the fullest rank */
    double kvel = c.kvel, worst = 0, total = 0;
    for (int st = 0; st < pp; st++) {
        double Ls = stage_layers(&c, st);
        double w = Ls * (s->qo_bytes * c.f + s->kv_bytes * c.f_kv + s->ffn_bytes * c.f);
        if (st == pp - 1) w += s->out_bytes * c.f;
        if (st == 0) w += s->embd_bytes;
        double kv = (double)run->seqs * run->ctx * Ls * s->kv_row * c.f_kv * kvel;
        double scratch = (double)run->n_batch * 4.0 * (4.0 * (double)s->n_embd + 3.0 * (double)s->n_ff * c.f) +
                         16.0 * 4.0 * (double)s->n_vocab * c.f;
        double r = w + kv + scratch;
        worst = fmax(worst, r);
        total += r * tp;
    }
    e->mem_per_node_gb = (hw->local ? total : worst) / 1e9;
    e->fits = hw->mem_gb <= 0 || e->mem_per_node_gb <= hw->mem_gb;

    /* the split of the ranked figure's step: S sequences when asked for, else one */
    bool by_s = run->rank_seqs && run->seqs > 1;
    const cycle_t *y = by_s ? &many : &one;
    double tstep = y->roundtrip;
    e->t_token_ms = tstep * 1e3;
    e->t_mem_ms = y->mem * 1e3, e->t_compute_ms = y->cmp_excess * 1e3;
    e->t_latency_ms = y->lat * 1e3, e->t_link_ms = y->link * 1e3;
    e->n_allreduce = y->n_ar;
    e->busy_stages = y->busy;
    double ar_lat, ar_link;
    allreduce_cost(hw, tp, (by_s ? ceil_div(run->seqs, pp < run->seqs ? pp : run->seqs) : 1) * s->n_embd * 4.0,
                   &ar_lat, &ar_link);
    e->allreduce_us = (ar_lat + ar_link) * 1e6;
    double w0 = 0;
    for (int st = 0; st < pp; st++)
        w0 = fmax(w0, stage_layers(&c, st) * (s->qo_bytes * c.f + s->kv_bytes * c.f_kv + s->ffn_bytes * c.f) +
                          (st == pp - 1 ? s->out_bytes * c.f : 0));
    e->weight_gb_rank = w0 / 1e9;

    if (!e->fits) {
        e->bottleneck = LK_BN_CAPACITY;
        snprintf(e->reason, sizeof e->reason, "does not fit: %.1f GB per node needed, %.1f GB present",
                 e->mem_per_node_gb, hw->mem_gb);
        return;
    }
    /* idle share of the stages over a cycle: the bubble */
    double idle = pp > 1 ? 1.0 - (y->n_mb * y->work / pp) / y->cycle : 0;
    double parts[4] = {y->mem, y->cmp_excess, y->lat, y->link};
    int big = 0;
    for (int i = 1; i < 4; i++)
        if (parts[i] > parts[big]) big = i;
    int S = by_s ? run->seqs : 1;
    const char *unit = S > 1 ? "step" : "token";
    if (pp > 1 && idle > 0.4) {
        e->bottleneck = LK_BN_PIPELINE;
        snprintf(e->reason, sizeof e->reason,
                 "pipeline-bound: %d sequence%s keep%s %d of %d stages busy; each stage idles %.0f %% of the time",
                 S, S > 1 ? "s" : "", S > 1 ? "" : "s", y->busy, pp, 100 * idle);
    } else if (big == 0) {
        e->bottleneck = LK_BN_MEMORY;
        snprintf(e->reason, sizeof e->reason,
                 "memory-bound: %.0f MB of weights per rank%s at %.1f GB/s = %.1f ms of a %.1f ms %s",
                 e->weight_gb_rank * 1e3, pp > 1 ? " per stage" : "", y->bw / 1e9, y->mem * 1e3, tstep * 1e3, unit);
    } else if (big == 1) {
        e->bottleneck = LK_BN_COMPUTE;
        snprintf(e->reason, sizeof e->reason,
                 "compute-bound: the matrix kernels at %.0f GFLOP/s add %.1f ms to the weight reads of a %.1f ms %s",
                 hw->gflops, y->cmp_excess * 1e3, tstep * 1e3, unit);
    } else if (big == 2) {
        e->bottleneck = LK_BN_LATENCY;
        snprintf(e->reason, sizeof e->reason, "latency-bound: %d all-reduces x %.0f us = %.1f ms of a %.1f ms %s",
                 y->n_ar, e->allreduce_us, y->n_ar * e->allreduce_us * 1e-3, tstep * 1e3, unit);
    } else {
        e->bottleneck = LK_BN_LINK;
        snprintf(e->reason, sizeof e->reason, "link-bound: bytes at %.1f Gbit/s take %.1f ms of a %.1f ms %s",
                 hw->link_gbps, y->link * 1e3, tstep * 1e3, unit);
    }
}

/* ---- netbench's table -------------------------------------------------------- */

lk_status lk_diag_hw_netbench(const char *text, lk_diag_hw *hw, char *err, size_t errlen) {
    /* rows: "8 KiB      3.20      9.80      2560.0 | 10.2 / 112.0   ...  exchange"
     * the ping-pong columns are "-" with --allreduce-only */
    int n = 0;
    double lat = -1, best_mbs = 0;
    const char *p = text;
    while (*p) {
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p) : strlen(p);
        char line[512];
        if (len >= sizeof line) len = sizeof line - 1;
        memcpy(line, p, len);
        line[len] = 0;
        p += len + (eol ? 1 : 0);
        double v, med, p99, mbs;
        char unit[8], rest[400];
        int got = sscanf(line, "%lf %7s %lf %lf %lf | %399[^\n]", &v, unit, &med, &p99, &mbs, rest);
        bool pp_cols = got == 6;
        if (!pp_cols && sscanf(line, "%lf %7s - - - | %399[^\n]", &v, unit, rest) != 3) continue;
        double mul = !strcmp(unit, "B") ? 1 : !strcmp(unit, "KiB") ? 1024 : !strcmp(unit, "MiB") ? 1048576 : 0;
        if (mul == 0) continue;
        double bytes = v * mul;
        if (pp_cols) {
            if (lat < 0) lat = med; /* the smallest size comes first */
            best_mbs = fmax(best_mbs, mbs);
        }
        /* the algorithm auto picks is the last word; its column's median */
        static const char *names[4] = {"exchange", "doubling", "ring", "scatter"};
        char *last = strrchr(rest, ' ');
        const char *algo = last ? last + 1 : rest;
        int col = -1;
        for (int a = 0; a < 4; a++)
            if (!strcmp(algo, names[a])) col = a;
        double cells[4] = {0};
        char *q = rest;
        for (int a = 0; a < 4; a++) {
            while (*q == ' ') q++;
            if (*q == '-') { cells[a] = 0; q++; }
            else {
                char *end;
                cells[a] = strtod(q, &end);
                if (end == q) break;
                q = end;
                while (*q == ' ') q++;
                if (*q == '/') { q++; strtod(q, &end); q = end; }
            }
        }
        if (col >= 0 && cells[col] > 0 && n < 32 && (n == 0 || bytes > hw->ar_bytes[n - 1])) {
            hw->ar_bytes[n] = bytes;
            hw->ar_us[n] = cells[col];
            n++;
        }
    }
    if (n == 0 && lat < 0)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "no netbench table found (expected the output of 'lockstep netbench')");
    if (lat > 0) hw->latency_us = lat;
    if (best_mbs > 0) hw->link_gbps = best_mbs * 8e6 / 1e9;
    hw->n_ar = n;
    return LK_OK;
}

/* ---- a node profile from bench's JSON ------------------------------------------ */

typedef struct { double T, t1, t2; } prow;

static void prow_put(prow *rows, int *n, double T, double t, bool twice) {
    int i = 0;
    while (i < *n && rows[i].T != T) i++;
    if (i == *n) {
        if (*n == 16) return;
        rows[(*n)++] = (prow){T, 0, 0};
    }
    if (twice) rows[i].t2 = t;
    else rows[i].t1 = t;
}

lk_status lk_diag_hw_bench(const char *text, lk_diag_hw *hw, char *err, size_t errlen) {
    /* two passes: the fewest threads first, then the rows */
    int tmin = 0;
    double bytes = 0, ctx = 0;
    prow rows[16];
    int n = 0;
    for (int pass = 0; pass < 2; pass++) {
        const char *p = text;
        while (*p) {
            const char *eol = strchr(p, '\n');
            size_t len = eol ? (size_t)(eol - p) : strlen(p);
            json_error_t je;
            json_t *o = json_loadb(p, len, 0, &je);
            p += len + (eol ? 1 : 0);
            if (!json_is_object(o)) { json_decref(o); continue; }
            int th = (int)json_integer_value(json_object_get(o, "threads"));
            int ranks = (int)json_integer_value(json_object_get(o, "ranks"));
            int S = (int)json_integer_value(json_object_get(o, "seqs"));
            int P = (int)json_integer_value(json_object_get(o, "n_prompt"));
            int N = (int)json_integer_value(json_object_get(o, "n_gen"));
            double tg = json_number_value(json_object_get(o, "decode_tok_s"));
            double pf = json_number_value(json_object_get(o, "prefill_tok_s"));
            double wb = json_number_value(json_object_get(o, "weight_bytes_per_token"));
            json_decref(o);
            if (ranks != 1 || th < 1 || S < 1) continue;
            if (pass == 0) {
                if (!tmin || th < tmin) tmin = th;
                continue;
            }
            if (th != tmin && th != 2 * tmin) continue;
            bool twice = th == 2 * tmin;
            if (tg > 0) prow_put(rows, &n, S, S / tg, twice);
            if (pf > 0 && S == 1 && P > 0) prow_put(rows, &n, P, P / pf, twice);
            if (!twice && wb > 0) bytes = wb, ctx = P + N / 2.0;
        }
    }
    if (!tmin || n == 0 || bytes <= 0)
        return lk_fail(err, errlen, LK_ERR_FORMAT,
                       "no one-node rows found (expected the output of 'lockstep bench --json' without --local)");
    /* ascending T; rows without the fewest threads' time are dropped */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && rows[j].T < rows[j - 1].T; j--) {
            prow t = rows[j]; rows[j] = rows[j - 1]; rows[j - 1] = t;
        }
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (rows[i].t1 <= 0) continue;
        /* t1 = a + b (all rows on t threads), t2 = a / 2 + b (rows split over 2t) */
        double a = rows[i].t1, b = 0;
        if (rows[i].t2 > 0) a = 2 * (rows[i].t1 - rows[i].t2), b = 2 * rows[i].t2 - rows[i].t1;
        if (b < 0) a = rows[i].t1, b = 0;
        if (a < 0) a = 0, b = rows[i].t1;
        hw->prof_tok[m] = rows[i].T, hw->prof_a[m] = a, hw->prof_b[m] = b;
        m++;
    }
    hw->n_prof = m;
    hw->prof_bytes = bytes;
    hw->prof_ctx = ctx;
    hw->prof_threads = tmin;
    if (hw->prof_tok[0] == 1) hw->mem_bw_gbs = bytes / (hw->prof_a[0] + hw->prof_b[0]) / 1e9;
    return LK_OK;
}
