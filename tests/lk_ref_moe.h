/* lk_ref_moe — the mixture-of-experts part of the reference comparison
 * (lk_ref.h), for test_moe and test_qwen35: against llama.cpp's JSON
 * (../shared/testdata/synth, README sections "Mixture of experts"), prompt
 * logits within a case's tolerances, router logits and weights, expert sets
 * identical wherever the reference's routing gap exceeds the router
 * tolerance (the "gap rule"; a smaller gap is a legitimate branch: that
 * position and the rest of its prompt are not compared), greedy tokens
 * identical up to the first near-tie of the logits or of the routing; the
 * same through the program's cluster layouts and batches. Included after
 * lk_test.h; every function static inline. */
#ifndef LK_REF_MOE_H
#define LK_REF_MOE_H

#include <pthread.h>

#include "gguf/gguf.h"
#include "lk_ref.h"
#include "model/model.h"

typedef struct {
    const char *gguf, *json;
    double logit_max, logit_median; /* |dlogit| */
    double router_tol;              /* |d router logit| */
    double gap_tol;                 /* a gap below this (in selection units) may branch */
    double weight_tol;              /* |d weight| where the expert sets agree */
    int min_gen;                    /* greedy tokens that must match per prompt (when comparable) */
    double gen_tol;                 /* logit error assumed for greedy near-ties (0: logit_max) */
    int groups, groups_used;        /* group-limited routing (deepseek2); 0: none */
} moe_case;

/* The reference's selection scores of one row: softmax routing ranks by the
 * router logits themselves (the README's gaps are in logit units there),
 * sigmoid routing by sigmoid + exp_probs_b (given in the JSON). */
static inline void ref_scores(json_t *layer, size_t row, int E, float *sc) {
    json_t *sel = json_object_get(layer, "selection_scores");
    json_t *src = sel ? json_array_get(sel, row) : json_array_get(json_object_get(layer, "router_logits"), row);
    for (int e = 0; e < E; e++) sc[e] = (float)lk_ref_num(src, (size_t)e);
}

/* Gap between the k-th and (k+1)-th best scores: what decides the set. */
static inline double set_gap(const float *sc, int E, int k) {
    float s[256];
    memcpy(s, sc, sizeof(float) * (size_t)E);
    qsort(s, (size_t)E, sizeof(float), lk_ref_cmp_f);
    return (double)s[E - k] - (double)s[E - k - 1];
}

/* The gap that decides a row's expert set. With group-limited routing
 * (deepseek2, synth README "Near-ties") it is the smaller of the gap between
 * the last kept and the first dropped group (a group scores the sum of its
 * two best) and the k-th/(k+1)-th gap among the kept groups' experts. */
static inline double sel_gap(const moe_case *mc, const float *sc, int E, int k) {
    if (mc->groups <= 1) return set_gap(sc, E, k);
    const int G = mc->groups, per = E / G;
    float gs[64], kept[256];
    int order[64];
    for (int g = 0; g < G; g++) {
        float s[256];
        memcpy(s, sc + g * per, sizeof(float) * (size_t)per);
        qsort(s, (size_t)per, sizeof(float), lk_ref_cmp_f);
        gs[g] = s[per - 1] + s[per - 2];
        order[g] = g;
    }
    for (int i = 0; i < G; i++) /* groups best first */
        for (int j = i + 1; j < G; j++)
            if (gs[order[j]] > gs[order[i]]) { int t = order[i]; order[i] = order[j]; order[j] = t; }
    double ggap = (double)gs[order[mc->groups_used - 1]] - (double)gs[order[mc->groups_used]];
    int nk = 0;
    for (int u = 0; u < mc->groups_used; u++)
        for (int e = 0; e < per; e++) kept[nk++] = sc[order[u] * per + e];
    return fmin(ggap, set_gap(kept, nk, k));
}

typedef struct {
    int n_layer, n_batch, E, k;
    float *logits, *weights;
    int32_t *experts;
} trace_buf;

static inline void trace_init(trace_buf *t, lk_model *m) {
    const lk_model_config *c = lk_model_cfg(m);
    t->n_layer = c->n_layer, t->n_batch = lk_model_n_batch(m), t->E = c->n_expert, t->k = c->n_expert_used;
    size_t rows = (size_t)t->n_layer * t->n_batch;
    t->logits = calloc(rows * t->E, sizeof(float));
    t->weights = calloc(rows * t->k, sizeof(float));
    t->experts = calloc(rows * t->k, sizeof(int32_t));
    lk_route_trace rt = { t->logits, t->experts, t->weights, NULL };
    lk_model_trace_routing(m, &rt);
}
static inline void trace_free(trace_buf *t) { free(t->logits); free(t->weights); free(t->experts); }

/* Whether our k experts ex are the set the reference row re names (any order). */
static inline bool same_experts(const int32_t *ex, json_t *re, int k) {
    bool same = true;
    for (int j = 0; j < k; j++) {
        bool found = false;
        for (int i = 0; i < k; i++) found |= ex[i] == (int32_t)json_integer_value(json_array_get(re, (size_t)j));
        same &= found;
    }
    return same;
}

typedef struct { double router, weight; int sets_differ, branches, decisions; } route_stats;

/* Compares row `row` of our trace with row `rrow` of the reference's routing
 * (one entry per MoE layer), up to the first layer whose expert set
 * differs. Returns false there: a legitimate branch (a different set where
 * the reference gap is below gap_tol), or a failure above it. */
static inline bool compare_routing(const moe_case *mc, const trace_buf *t, json_t *routing, int row, size_t rrow,
                                   route_stats *st, const char *where) {
    bool same_all = true;
    size_t li;
    json_t *L;
    json_array_foreach(routing, li, L) {
        int layer = (int)json_integer_value(json_object_get(L, "layer"));
        const float *lg = t->logits + ((size_t)layer * t->n_batch + row) * t->E;
        const int32_t *ex = t->experts + ((size_t)layer * t->n_batch + row) * t->k;
        const float *wg = t->weights + ((size_t)layer * t->n_batch + row) * t->k;
        json_t *rl = json_array_get(json_object_get(L, "router_logits"), rrow);
        json_t *re = json_array_get(json_object_get(L, "experts"), rrow);
        json_t *rw = json_array_get(json_object_get(L, "weights"), rrow);
        for (int e = 0; e < t->E; e++) st->router = fmax(st->router, fabs(lg[e] - lk_ref_num(rl, (size_t)e)));
        const bool same = same_experts(ex, re, t->k);
        for (int j = 0; j < t->k; j++) /* weights of the experts both chose */
            for (int i = 0; i < t->k; i++)
                if (ex[i] == (int32_t)json_integer_value(json_array_get(re, (size_t)j)))
                    st->weight = fmax(st->weight, fabs(wg[i] - lk_ref_num(rw, (size_t)j)));
        st->decisions++;
        if (!same) {
            float sc[256];
            ref_scores(L, rrow, t->E, sc);
            double gap = sel_gap(mc, sc, t->E, t->k);
            st->sets_differ++;
            CHECKF(gap < mc->gap_tol, "%s %s layer %d: experts differ where the reference gap is %.4f (> %.4f)",
                   mc->json, where, layer, gap, mc->gap_tol);
            if (gap < mc->gap_tol) st->branches++;
            same_all = false;
            break; /* the later layers follow from other experts' output */
        }
    }
    return same_all;
}

/* The smallest reference gap of one routing row over all MoE layers. */
static inline double min_gap(const moe_case *mc, json_t *routing, size_t rrow, int E, int k) {
    double g = INFINITY;
    size_t li;
    json_t *L;
    json_array_foreach(routing, li, L) {
        float sc[256];
        ref_scores(L, rrow, E, sc);
        g = fmin(g, sel_gap(mc, sc, E, k));
    }
    return g;
}

/* Greedy steps of a case worth comparing: up to and including the first
 * whose reference top-1 margin is below 2x the logit tolerance or that
 * follows a routing decision closer than the gap tolerance (there a correct
 * engine may branch, so only that last step may differ). */
static inline int comparable_steps(const moe_case *mc, json_t *c, int E, int k, bool prompt_gaps) {
    json_t *groute = json_object_get(c, "generation_routing"), *proute = json_object_get(c, "prompt_routing");
    int n = (int)json_array_size(json_object_get(c, "prompt_token_ids"));
    /* without a routing trace (a cluster run), a prompt near-tie may have branched unseen */
    for (int i = 0; prompt_gaps && i < n; i++)
        if (min_gap(mc, proute, (size_t)i, E, k) < mc->gap_tol) return 1;
    const int steps = lk_ref_comparable(c, mc->gen_tol > 0 ? mc->gen_tol : mc->logit_max);
    /* token s comes from the step that fed token s - 1 (routing row s - 1) */
    for (int s = 1; s < steps; s++)
        if (min_gap(mc, groute, (size_t)s - 1, E, k) < mc->gap_tol) return s + 1;
    return steps;
}

/* ---- expert parallelism in one process: each rank a thread ----
 * The ranks of a `--tp N --expert-parallel` split, planned as the head plans
 * it (lk_plan_make, then lk_plan_experts), each a model on its own thread,
 * joined by an all-reduce that adds the partials in rank order as lk_comm's
 * exchange does; ep_forward runs every rank's pass and puts the vocabulary
 * slices together into whole logits rows. Rank 0 runs on the caller's
 * thread (its routing trace is the test's). */
typedef struct ep_ranks ep_ranks;
typedef struct { ep_ranks *g; int rank; } ep_rank;
struct ep_ranks {
    int n;
    int64_t nv;
    lk_model *m[4];
    lk_slice sl[4];
    ep_rank me[4];
    float *part[4], *lg[4]; /* each rank's all-reduce partial, its logits slice */
    pthread_t th[4];
    pthread_barrier_t ar, go;
    const int32_t *toks;
    int nt, pos0, n_out;
    bool quit;
    lk_status st[4];
};

static inline lk_status ep_allreduce(void *ctx, float *x, int64_t n, int layer, const char *what) {
    ep_rank *r = ctx;
    ep_ranks *g = r->g;
    memcpy(g->part[r->rank], x, sizeof(float) * (size_t)n);
    pthread_barrier_wait(&g->ar);
    for (int64_t i = 0; i < n; i++) {
        float s = g->part[0][i];
        for (int k = 1; k < g->n; k++) s += g->part[k][i];
        x[i] = s;
    }
    pthread_barrier_wait(&g->ar); /* nobody overwrites a partial still being read */
    return LK_OK;
}

static inline void ep_run(ep_ranks *g, int r) {
    g->st[r] = lk_model_forward(g->m[r], g->toks, g->nt, g->pos0, g->n_out, g->lg[r]);
}

static inline void *ep_main(void *arg) {
    ep_rank *r = arg;
    for (;;) {
        pthread_barrier_wait(&r->g->go);
        if (r->g->quit) return NULL;
        ep_run(r->g, r->rank);
        pthread_barrier_wait(&r->g->go);
    }
}

static inline lk_status ep_forward(ep_ranks *g, const int32_t *toks, int n, int pos0, int n_out, float *logits) {
    g->toks = toks, g->nt = n, g->pos0 = pos0, g->n_out = n_out;
    pthread_barrier_wait(&g->go);
    ep_run(g, 0);
    pthread_barrier_wait(&g->go);
    lk_status st = LK_OK;
    for (int r = 0; r < g->n; r++) {
        const int64_t v0 = g->sl[r].vocab0, nvr = g->sl[r].vocab1 - v0;
        for (int i = 0; i < n_out; i++)
            memcpy(logits + (size_t)i * g->nv + v0, g->lg[r] + (size_t)i * nvr, sizeof(float) * (size_t)nvr);
        if (g->st[r] && !st) st = g->st[r];
    }
    return st;
}

static inline void ep_close(ep_ranks *g) {
    if (!g->n) return;
    g->quit = true;
    pthread_barrier_wait(&g->go);
    for (int r = 1; r < g->n; r++) pthread_join(g->th[r], NULL);
    for (int r = 0; r < g->n; r++) {
        lk_model_free(g->m[r]);
        free(g->part[r]);
        free(g->lg[r]);
    }
    pthread_barrier_destroy(&g->ar);
    pthread_barrier_destroy(&g->go);
    memset(g, 0, sizeof *g);
}

static inline lk_status ep_open(ep_ranks *g, const lk_gguf *gg, int tp, const lk_model_params *mp, char *err) {
    memset(g, 0, sizeof *g);
    lk_model_config c;
    lk_plan_dims d;
    lk_status st = lk_model_config_read(gg, &c, err, LK_ERRLEN);
    if (st) return st;
    lk_model_plan_dims(gg, &c, &d);
    LK_ASSERT(tp <= 4);
    if ((st = lk_plan_make(&d, tp, 1, NULL, g->sl, err, LK_ERRLEN)) ||
        (st = lk_plan_experts(&d, tp, 1, NULL, g->sl, err, LK_ERRLEN)))
        return st;
    for (int r = 0; r < tp; r++) {
        if ((st = lk_model_load(gg, &g->sl[r], mp, &g->m[r], err, LK_ERRLEN))) {
            while (r--) lk_model_free(g->m[r]);
            return st;
        }
        g->me[r] = (ep_rank){ g, r };
        lk_tp_hooks h = { &g->me[r], ep_allreduce };
        lk_model_set_hooks(g->m[r], &h);
        const int B = lk_model_n_batch(g->m[r]);
        g->part[r] = malloc(sizeof(float) * (size_t)B * c.n_embd);
        g->lg[r] = malloc(sizeof(float) * (size_t)B * (size_t)(g->sl[r].vocab1 - g->sl[r].vocab0));
    }
    g->n = tp, g->nv = c.n_vocab;
    pthread_barrier_init(&g->ar, NULL, (unsigned)tp);
    pthread_barrier_init(&g->go, NULL, (unsigned)tp);
    for (int r = 1; r < tp; r++) pthread_create(&g->th[r], NULL, ep_main, &g->me[r]);
    return LK_OK;
}

/* The forward pass the reference loop drives (lk_ref_fwd): one model, or
 * the expert-parallel ranks together. A one-token step while groute is set
 * also compares its routing with that generation_routing row (the step that
 * feeds token s is row s). */
typedef struct {
    ep_ranks *grp;
    lk_model *m;
    const moe_case *mc;
    const trace_buf *tb;
    route_stats *rs;
    json_t *groute;
    size_t ci;
    int n; /* the prompt's length: a step at pos0 fed token pos0 - n */
} moe_fwd;

static inline lk_status moe_forward(void *ctx, const int32_t *toks, int n, int pos0, int n_out, float *logits) {
    moe_fwd *f = ctx;
    lk_status st = f->grp->n ? ep_forward(f->grp, toks, n, pos0, n_out, logits)
                             : lk_model_forward(f->m, toks, n, pos0, n_out, logits);
    if (f->groute && n == 1) {
        char where[64];
        snprintf(where, sizeof where, "case %zu step %d", f->ci, pos0 - f->n);
        compare_routing(f->mc, f->tb, f->groute, 0, (size_t)(pos0 - f->n), f->rs, where);
    }
    return st;
}

/* ep_tp > 1: the model split over that many expert-parallel ranks (one
 * thread each), else one model on n_threads. */
static inline void check_moe_ep(const moe_case *mc, int n_threads, int ep_tp) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    lk_status st = lk_gguf_open(lk_td(mc->gguf), &g, err, sizeof err);
    CHECKF(st == LK_OK, "%s", err);
    if (st) return;
    json_t *ref = lk_ref_load(mc->json);
    lk_model_params mp = { .n_ctx = 512, .n_threads = n_threads };
    lk_model *m = NULL;
    ep_ranks grp = {0};
    if (ep_tp > 1) {
        st = ep_open(&grp, g, ep_tp, &mp, err);
        if (!st) m = grp.m[0];
    } else {
        st = lk_model_load(g, NULL, &mp, &m, err, sizeof err);
    }
    CHECKF(st == LK_OK, "%s", err);
    if (st || !ref) {
        if (grp.n) ep_close(&grp);
        else lk_model_free(m);
        json_decref(ref);
        lk_gguf_close(g);
        return;
    }
    trace_buf tb;
    trace_init(&tb, m);
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    double worst = 0, worst_median = 0;
    route_stats rs = {0};
    moe_fwd fw = { &grp, m, mc, &tb, &rs, NULL, 0, 0 };
    float *step = malloc(sizeof(float) * nv);
    int matched_total = 0, gen_total = 0, compared_pos = 0, all_pos = 0;
    size_t ci;
    json_t *c;
    json_array_foreach(json_object_get(ref, "cases"), ci, c) {
        int n;
        fw.groute = NULL;
        float *logits = lk_ref_prompt_pass(moe_forward, &fw, nv, c, &n);
        json_t *proute = json_object_get(c, "prompt_routing");
        /* positions up to the first legitimate routing branch */
        int upto = n;
        for (int i = 0; i < n && upto == n; i++) { /* positions after a branch see its output */
            char where[64];
            snprintf(where, sizeof where, "case %zu position %d", ci, i);
            if (!compare_routing(mc, &tb, proute, i, (size_t)i, &rs, where) && upto == n) upto = i;
        }
        double mx, median = lk_ref_logit_diff(logits, c, upto, nv, &mx);
        compared_pos += upto, all_pos += n;
        worst = fmax(worst, mx), worst_median = fmax(worst_median, median);
        if (getenv("LK_MOE_VERBOSE")) printf("    case %zu: max %.3g median %.3g\n", ci, mx, median);
        CHECKF(mx <= mc->logit_max, "%s case %zu: max |dlogit| %.3g > %.3g", mc->json, ci, mx, mc->logit_max);
        CHECKF(median <= mc->logit_median, "%s case %zu: median |dlogit| %.3g > %.3g", mc->json, ci, median,
               mc->logit_median);
        /* greedy decoding, up to the first near-tie of logits or routing */
        json_t *gen = json_object_get(c, "generated_token_ids");
        int ngen = (int)json_array_size(gen), comparable = upto == n ? comparable_steps(mc, c, tb.E, tb.k, false) : 0;
        fw.groute = json_object_get(c, "generation_routing"), fw.ci = ci, fw.n = n;
        int32_t got;
        int matched = lk_ref_greedy(moe_forward, &fw, nv, logits + (size_t)(n - 1) * nv, gen, comparable, n, step, &got);
        CHECKF(got < 0 || (matched == comparable - 1 && comparable < ngen),
               "%s case %zu: generated token %d is %d, want %d", mc->json, ci, matched, got, lk_ref_tok(gen, matched));
        CHECKF(matched >= LK_MIN(mc->min_gen, comparable), "%s case %zu: only %d greedy tokens matched (%d comparable)",
               mc->json, ci, matched, comparable);
        matched_total += matched, gen_total += ngen;
        free(logits);
    }
    CHECKF(rs.router <= mc->router_tol, "%s: router logits differ by %.3g > %.3g", mc->json, rs.router, mc->router_tol);
    CHECKF(rs.weight <= mc->weight_tol, "%s: expert weights differ by %.3g > %.3g", mc->json, rs.weight, mc->weight_tol);
    if (ep_tp > 1) {
        printf("  expert-parallel, %d ranks (experts", ep_tp);
        for (int r = 0; r < ep_tp; r++) printf(" %d-%d", grp.sl[r].expert0, grp.sl[r].expert1 - 1);
        printf("):\n");
    }
    printf("  %-30s t=%d max|d|=%.2e median|d|=%.2e (%d/%d positions) router %.1e weights %.1e sets %d/%d equal "
           "(%d near-tie branches) greedy %d/%d\n", mc->gguf, n_threads, worst, worst_median, compared_pos, all_pos,
           rs.router, rs.weight, rs.decisions - rs.sets_differ, rs.decisions, rs.branches, matched_total, gen_total);
    free(step);
    trace_free(&tb);
    if (grp.n) ep_close(&grp);
    else lk_model_free(m);
    json_decref(ref);
    lk_gguf_close(g);
}

static inline void check_moe(const moe_case *mc, int n_threads) { check_moe_ep(mc, n_threads, 0); }

/* The routing shape a reference file declares: E experts, k used. */
static inline void ref_moe_shape(json_t *ref, int *E, int *k) {
    json_t *moe = json_object_get(ref, "moe");
    *E = (int)json_integer_value(json_object_get(moe, "n_expert"));
    *k = (int)json_integer_value(json_object_get(moe, "n_expert_used"));
}

/* Every layout, one node included (""), must give llama.cpp's greedy tokens
 * (up to the first near-tie) for every reference prompt, through the program. */
static inline void check_layouts(const moe_case *mc, const char *const *layouts, int n_layouts) {
    json_t *ref = lk_ref_load(mc->json);
    if (!ref) return;
    int E, k;
    ref_moe_shape(ref, &E, &k);
    char err[1024];
    for (int l = 0; l < n_layouts; l++) {
        int tokens = 0, compared = 0;
        size_t ci;
        json_t *c;
        json_array_foreach(json_object_get(ref, "cases"), ci, c) {
            int comparable = comparable_steps(mc, c, E, k, true);
            json_t *o = lk_ref_run(lk_td(mc->gguf), json_string_value(json_object_get(c, "prompt")), comparable,
                                   layouts[l], err, sizeof err);
            CHECKF(o, "%s", err);
            if (!o) continue;
            CHECKF(json_equal(json_object_get(o, "prompt_ids"), json_object_get(c, "prompt_token_ids")),
                   "%s %s case %zu: prompt tokenised differently", mc->gguf, layouts[l], ci);
            json_t *got = json_object_get(o, "generated_ids");
            int same = lk_ref_same_prefix(got, json_object_get(c, "generated_token_ids"), comparable);
            /* only the last comparable step may branch */
            CHECKF((int)json_array_size(got) == comparable && same >= comparable - 1,
                   "%s %s case %zu: first difference at token %d of %d", mc->gguf, layouts[l], ci, same, comparable);
            tokens += same, compared += comparable;
            json_decref(o);
        }
        printf("  %-30s %-28s %d/%d greedy tokens as llama.cpp\n", mc->gguf, *layouts[l] ? layouts[l] : "(one node)",
               tokens, compared);
    }
    json_decref(ref);
}

/* All reference prompts as concurrent sequences (`run --prompts-file`,
 * `--parallel` all of them), so every step batches their prompt chunks and
 * decode tokens together: each must still give llama.cpp's greedy tokens up
 * to its first near-tie, in every layout. */
static inline void check_batched(const moe_case *mc, const char *const *layouts, int n_layouts) {
    json_t *ref = lk_ref_load(mc->json);
    if (!ref) return;
    json_t *cases = json_object_get(ref, "cases");
    const int nc = (int)json_array_size(cases);
    int E, k, upto[8] = {0};
    ref_moe_shape(ref, &E, &k);
    CHECK(nc <= 8);
    for (int ci = 0; ci < nc && ci < 8; ci++) upto[ci] = comparable_steps(mc, json_array_get(cases, (size_t)ci), E, k, true);
    for (int l = 0; l < n_layouts && nc <= 8; l++) {
        char what[256];
        snprintf(what, sizeof what, "%s batched %s", mc->gguf, layouts[l]);
        int compared, tokens = lk_ref_run_batch(lk_td(mc->gguf), cases, upto, nc, layouts[l], what, &compared);
        printf("  %-30s batched x%d %-24s %d/%d greedy tokens as llama.cpp\n", mc->gguf, nc,
               *layouts[l] ? layouts[l] : "(one node)", tokens, compared);
    }
    json_decref(ref);
}

#endif
