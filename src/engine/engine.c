/* The engine: one node, or the head of a cluster (cluster/ does the talking
 * until the mesh stands; step/ runs every step on every rank, the head's
 * included). */
#include "engine/engine.h"
#include "cluster/cluster.h"
#include "step/step.h"

#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

/* What the head remembers of a submitted step until it is collected. */
typedef struct {
    int n_items;
    int32_t *res;       /* (max items) result index of each item, -1: it does not sample */
} inflight;

struct lk_engine {
    lk_gguf *g;
    lk_model *m;
    lk_cluster *c;          /* NULL on one node */
    lk_step *st;
    lk_step_msg msg;        /* the next step: queued slot operations gather here */
    uint64_t next_no;
    inflight fl[LK_STEP_MAX_DEPTH];
    int fl_head, fl_n, depth, max_items;
    int32_t *last_res;      /* (max items) of the last collected step */
    int last_n_items;
    double busy_s;          /* time inside submit/collect since the last collect */
    double t_compute, t_comm;
    bool broken;            /* a step failed: the ranks may disagree; nothing more runs */
    /* lk_engine_step (slot 0) */
    lk_sampler_params leg_sp;
    bool leg_set;
    bool caller_picks;      /* lk_engine_step: the caller's sampler picks, not the slot's */
};

static bool is_cluster(const lk_engine_opts *o) {
    return (o->workers && *o->workers) || o->local > 1;
}

/* KV positions for the page pool: asked for in positions or bytes (of the
 * whole model's cache, all layers and KV heads), or by default every slot's
 * full context as far as half of the head's MemAvailable allows, read
 * before the weights load (so the other half is left for them and the rest
 * of the system), but never less than one full context. Every rank gets the
 * same number of positions: the pools must agree page for page. */
/* Bytes per pool position (the layers that take pages: not the sliding-
 * window ones that have rings, model.h) and of every slot's ring. */
static int64_t kv_per_pos(const lk_engine_opts *o, const lk_model_config *cfg, int n_ctx, int64_t *ring_bytes,
                          int max_seqs) {
    int ringed = 0;
    const int ring = lk_model_swa_ring(cfg, n_ctx, o->n_batch),
              paged = lk_model_paged_layers(cfg, 0, cfg->n_layer, ring, &ringed);
    const int64_t esz = o->kv_f16 ? 2 : 4;
    if (ring_bytes) *ring_bytes = (int64_t)max_seqs * ring * LK_KV_PAGE * ringed * cfg->kv_elems * esz;
    /* MLA: the latent row only; recurrent layers (qwen35moe) have no pages */
    return LK_MAX((int64_t)paged * cfg->kv_elems * esz, 1);
}

static int64_t kv_positions(const lk_engine_opts *o, const lk_model_config *cfg, int n_ctx, int max_seqs) {
    const int64_t per_pos = kv_per_pos(o, cfg, n_ctx, NULL, max_seqs);
    if (o->kv_budget > 0) return o->kv_budget;
    if (o->kv_budget_bytes > 0) return LK_MAX(o->kv_budget_bytes / per_pos, 1);
    int64_t want = (int64_t)max_seqs * n_ctx;
    uint64_t avail = lk_mem_available();
    if (avail) {
        int64_t fits = (int64_t)(avail / 2) / per_pos;
        if (want > fits) want = LK_MAX(fits, (int64_t)n_ctx);
    }
    return want;
}

static double gib(double bytes) { return bytes / (1024.0 * 1024 * 1024); }

/* What --ctx and the KV budget cost this machine, checked against
 * MemAvailable before anything is allocated: the KV cache (positions x
 * layers x KV heads x head_dim x K and V x 4 bytes, 2 with --kv-f16; for
 * MLA layers x (kv_lora + rope dims) x 4 bytes: cfg->kv_elems), the
 * RoPE tables (ctx x rope_dim floats) and the attention scores (threads x
 * 16 x ctx floats). Allocations are lazy, so an oversized context would
 * otherwise be found only as the tables are written (minutes of paging, then
 * an abort). On one node (or --local ranks, which share this machine) the
 * whole KV counts; with --workers each rank holds its share, so the head
 * counts its tables and an even share. */
static lk_status check_memory(const lk_engine_opts *o, const lk_model_config *cfg, int n_ctx, int64_t kv, int max_seqs,
                              char *err, size_t errlen) {
    int64_t rings = 0;
    const double per_pos = (double)kv_per_pos(o, cfg, n_ctx, &rings, max_seqs);
    const bool remote = o->workers && *o->workers;
    int ranks = 1;
    if (remote)
        for (const char *p = o->workers; *p; p++) ranks += *p == ',';
    const int local = !remote && o->local > 1 ? o->local : 1;
    const double threads = o->n_threads > 0 ? (double)o->n_threads * local : (double)lk_threads_default();
    const double kv_bytes = ((double)kv * per_pos + (double)rings) / ranks;
    /* a recurrent model's per-slot state (model.h): conv window and delta-rule state per recurrent layer */
    const double state = (double)max_seqs * cfg->n_recurrent * 4 / ranks *
                         ((double)(cfg->ssm_conv - 1) * (double)lk_model_ssm_channels(cfg) +
                          (double)cfg->ssm_nv * cfg->ssm_dk * cfg->ssm_dv);
    const double tables = local * (double)n_ctx * cfg->rope_dim * 4 + threads * 16.0 * n_ctx * 4 + state;
    const uint64_t avail = lk_mem_available();
    if (!avail || kv_bytes + tables <= (double)avail) return LK_OK;
    const bool budget = o->kv_budget > 0 || o->kv_budget_bytes > 0;
    char what[64];
    if (budget) snprintf(what, sizeof what, "--kv-budget (%lld positions)", (long long)kv);
    else snprintf(what, sizeof what, "--ctx %d", n_ctx);
    return lk_fail(err, errlen, LK_ERR_NOMEM,
                   "%s needs %.2f GiB (KV cache %lld positions x %.0f bytes = %.2f GiB%s, RoPE and attention "
                   "tables%s %.2f GiB) but %.2f GiB of memory is available: lower %s%s", what, gib(kv_bytes + tables),
                   (long long)kv, per_pos, gib(kv_bytes), remote ? " on the head" : "",
                   cfg->n_recurrent ? ", recurrent state" : "", gib(tables), gib((double)avail),
                   budget ? "--kv-budget" : "--ctx", o->kv_f16 ? "" : " or add --kv-f16");
}

lk_status lk_engine_open(const lk_engine_opts *o, lk_engine **out, char *err, size_t errlen) {
    *out = NULL;
    if (!is_cluster(o) && (o->tp > 1 || o->pp > 1))
        return lk_fail(err, errlen, LK_ERR_ARG, "--tp/--pp need ranks: give --local N or --workers LIST");
    if (o->max_seqs < 0 || o->max_seqs > 4096)
        return lk_fail(err, errlen, LK_ERR_ARG, "--parallel %d: between 1 and 4096 sequences", o->max_seqs);
    lk_engine *e = lk_xcalloc(1, sizeof *e);
    lk_status st = lk_gguf_open(o->model_path, &e->g, err, errlen);
    if (st) { free(e); return st; }
    lk_model_config cfg;
    if ((st = lk_model_config_read(e->g, &cfg, err, errlen))) { lk_engine_close(e); return st; }
    if (o->expert_parallel > 0 && cfg.n_expert == 0) {
        lk_engine_close(e);
        return lk_fail(err, errlen, LK_ERR_ARG, "--expert-parallel needs a mixture-of-experts model; %s is dense (%s)",
                       o->model_path, cfg.arch_name);
    }
    const int max_seqs = o->max_seqs > 0 ? o->max_seqs : 1;
    const int n_ctx = o->n_ctx > 0 ? o->n_ctx : LK_MIN(cfg.n_ctx_train, 4096);
    const int64_t kv = kv_positions(o, &cfg, n_ctx, max_seqs);
    if ((st = check_memory(o, &cfg, n_ctx, kv, max_seqs, err, errlen))) { lk_engine_close(e); return st; }
    if (o->n_ctx > cfg.n_ctx_train)
        lk_log(LK_LOG_WARN, "--ctx %d is beyond the %d positions the model was trained on: text past them may degrade",
               o->n_ctx, cfg.n_ctx_train);
    lk_model_params mp = { .n_ctx = o->n_ctx, .n_batch = o->n_batch, .kv_f16 = o->kv_f16,
                           .n_threads = o->n_threads ? o->n_threads : lk_threads_default(), .max_seqs = max_seqs, .kv_tokens = kv };
    lk_slice head_slice, *slice = NULL;
    if (is_cluster(o)) {
        lk_plan_dims dims;
        lk_model_plan_dims(e->g, &cfg, &dims);
        lk_cluster_opts co = { .workers = o->workers, .local = o->local, .key_file = o->key_file,
                               .model_path = o->model_path, .tp = o->tp, .pp = o->pp, .tp_weights = o->tp_weights,
                               .layers_split = o->layers_split, .expert_parallel = o->expert_parallel,
                               .transport = o->transport, .n_ctx = o->n_ctx,
                               .n_batch = o->n_batch, .n_threads = o->n_threads, .kv_f16 = o->kv_f16, .wire = o->wire,
                               .seal = o->seal, .max_seqs = max_seqs, .kv_tokens = kv,
                               .emulate_link = o->emulate_link };
        if ((st = lk_cluster_open(&co, e->g, &dims, &e->c, &head_slice, err, errlen))) { lk_engine_close(e); return st; }
        slice = &head_slice;
        if (!o->n_threads && o->local > 1) {
            /* local ranks share this machine's cores */
            mp.n_threads = LK_MAX(1, lk_threads_default() / o->local);
        }
    }
    if ((st = lk_model_load(e->g, slice, &mp, &e->m, err, errlen))) { lk_engine_close(e); return st; }
    lk_step_params sp = { .m = e->m, .mesh = e->c ? lk_cluster_mesh(e->c) : NULL, .tp = e->c ? lk_cluster_comm(e->c) : NULL,
                          .plan = e->c ? lk_cluster_plan(e->c) : NULL };
    if ((st = lk_step_create(&sp, &e->st, err, errlen))) { lk_engine_close(e); return st; }
    lk_step_msg_init(&e->msg, lk_model_max_seqs(e->m), lk_model_n_batch(e->m));
    e->depth = LK_MIN(lk_model_slice(e->m)->pp_size, LK_STEP_MAX_DEPTH);
    e->max_items = e->msg.cap_items;
    for (int i = 0; i < LK_STEP_MAX_DEPTH; i++) e->fl[i].res = lk_xmalloc(sizeof(int32_t) * (size_t)e->max_items);
    e->last_res = lk_xmalloc(sizeof(int32_t) * (size_t)e->max_items);
    lk_log(LK_LOG_DEBUG, "engine: %d slots, %lld KV pages of %d positions, batch %d tokens", max_seqs,
           (long long)lk_model_pages_total(e->m), LK_KV_PAGE, lk_model_n_batch(e->m));
    *out = e;
    return LK_OK;
}

void lk_engine_close(lk_engine *e) {
    if (!e) return;
    if (e->c && e->st && !e->broken) {
        /* the workers leave their step loops, then BYE (lk_cluster_close) */
        char err[LK_ERRLEN];
        lk_step_msg_clear(&e->msg);
        e->msg.end = true;
        e->msg.no = e->next_no++;
        lk_step_send(e->st, &e->msg, err, sizeof err);
    }
    lk_step_free(e->st);
    lk_cluster_close(e->c);
    lk_model_free(e->m);
    lk_gguf_close(e->g);
    lk_step_msg_free(&e->msg);
    for (int i = 0; i < LK_STEP_MAX_DEPTH; i++) free(e->fl[i].res);
    free(e->last_res);
    free(e);
}

const lk_gguf *lk_engine_gguf(const lk_engine *e) { return e->g; }
const lk_model_config *lk_engine_cfg(const lk_engine *e) { return lk_model_cfg(e->m); }
int lk_engine_n_ctx(const lk_engine *e) { return lk_model_n_ctx(e->m); }
int lk_engine_n_ranks(const lk_engine *e) { return e->c ? lk_cluster_n_ranks(e->c) : 1; }
int lk_engine_threads(const lk_engine *e) { return lk_model_threads(e->m); }
uint64_t lk_engine_weight_bytes(const lk_engine *e) { return lk_model_weight_bytes(e->m); }
void lk_engine_last_timing(const lk_engine *e, double *c, double *m) { *c = e->t_compute; *m = e->t_comm; }
bool lk_engine_rank_times(lk_engine *e, int rank, double *c, double *m) {
    return e->c && lk_cluster_rank_times(e->c, rank, c, m);
}

int lk_engine_max_seqs(const lk_engine *e) { return lk_model_max_seqs(e->m); }
int lk_engine_n_batch(const lk_engine *e) { return lk_model_n_batch(e->m); }
int lk_engine_depth(const lk_engine *e) { return e->depth; }
int lk_engine_page_tokens(const lk_engine *e) { (void)e; return LK_KV_PAGE; }
int64_t lk_engine_pages_total(const lk_engine *e) { return lk_model_pages_total(e->m); }
int64_t lk_engine_pages_free(const lk_engine *e) { return lk_model_pages_free(e->m); }
int lk_engine_seq_len(const lk_engine *e, int seq) { return lk_model_seq_len(e->m, seq); }
int64_t lk_engine_pages_needed(const lk_engine *e, int seq, int n) { return lk_model_pages_needed(e->m, seq, n); }

/* ---- failures ---- */

/* A failed step leaves the ranks possibly out of step with each other: the
 * engine refuses further work with the first error. */
static lk_status fail_step(lk_engine *e, lk_status st, const char *detail, char *err, size_t errlen) {
    e->broken = true;
    if (e->c) return lk_fail(err, errlen, st, "%s", lk_cluster_explain(e->c, detail));
    return lk_fail(err, errlen, st, "%s", detail);
}

static lk_status check_usable(const lk_engine *e, char *err, size_t errlen) {
    if (e->broken) return lk_fail(err, errlen, LK_ERR_ARG, "the engine stopped after a failed step");
    return LK_OK;
}

/* ---- queued slot operations ---- */

/* Sends the queued operations alone when the next step's list is full. */
static lk_status flush_ops(lk_engine *e, char *err, size_t errlen) {
    if (e->msg.n_ops < e->msg.cap_ops) return LK_OK;
    e->msg.no = e->next_no++;
    e->msg.n_items = e->msg.n_tok = 0;
    char why[LK_ERRLEN];
    lk_status st = lk_step_send(e->st, &e->msg, why, sizeof why);
    lk_step_msg_clear(&e->msg);
    if (st) return fail_step(e, st, why, err, errlen);
    return LK_OK;
}

static lk_status queue_op(lk_engine *e, const lk_step_op *op, char *err, size_t errlen) {
    lk_status st;
    if ((st = check_usable(e, err, errlen)) || (st = flush_ops(e, err, errlen))) return st;
    /* applied here at once (the head's counts stay current) and on the
     * other ranks before the next step: the same order everywhere */
    if ((st = lk_step_apply(e->st, op, err, errlen))) return st;
    e->msg.ops[e->msg.n_ops++] = *op;
    return LK_OK;
}

lk_status lk_engine_seq_params(lk_engine *e, int seq, const lk_sampler_params *sp, int n_cand, char *err, size_t errlen) {
    if (n_cand < 0 || n_cand > LK_STEP_MAX_CAND)
        return lk_fail(err, errlen, LK_ERR_ARG, "slot %d: %d candidates per rank (at most %d)", seq, n_cand, LK_STEP_MAX_CAND);
    lk_step_op op = {.kind = LK_STEP_OP_PARAMS, .seq = seq, .a = n_cand, .sp = *sp};
    return queue_op(e, &op, err, errlen);
}

lk_status lk_engine_seq_keep(lk_engine *e, int seq, int n, char *err, size_t errlen) {
    lk_step_op op = {.kind = LK_STEP_OP_KEEP, .seq = seq, .a = n};
    return queue_op(e, &op, err, errlen);
}

lk_status lk_engine_seq_fork(lk_engine *e, int dst, int src, int n, char *err, size_t errlen) {
    lk_step_op op = {.kind = LK_STEP_OP_FORK, .seq = dst, .a = src, .b = n};
    return queue_op(e, &op, err, errlen);
}

bool lk_engine_seq_can_keep(const lk_engine *e, int seq, int n) { return lk_model_seq_can_keep(e->m, seq, n); }

/* ---- steps ---- */

static lk_status check_items(const lk_engine *e, const lk_engine_item *items, int n_items, char *err, size_t errlen) {
    if (n_items < 1 || n_items > e->max_items)
        return lk_fail(err, errlen, LK_ERR_ARG, "a step of %d items (1..%d)", n_items, e->max_items);
    const int64_t nv = lk_model_cfg(e->m)->n_vocab;
    const int S = lk_model_max_seqs(e->m), n_ctx = lk_model_n_ctx(e->m);
    int tok = 0;
    int64_t pages = 0;
    for (int i = 0; i < n_items; i++) {
        const lk_engine_item *it = &items[i];
        if (it->seq < 0 || it->seq >= S)
            return lk_fail(err, errlen, LK_ERR_ARG, "item %d: slot %d out of range (%d slots)", i, it->seq, S);
        for (int k = 0; k < i; k++)
            if (items[k].seq == it->seq) return lk_fail(err, errlen, LK_ERR_ARG, "slot %d appears twice in one step", it->seq);
        if (it->n < 1 || !it->tokens) return lk_fail(err, errlen, LK_ERR_ARG, "item %d (slot %d): no tokens", i, it->seq);
        for (int t = 0; t < it->n; t++)
            if (it->tokens[t] < 0 || it->tokens[t] >= nv)
                return lk_fail(err, errlen, LK_ERR_ARG, "token id %d (slot %d) is outside the vocabulary (%lld)",
                               it->tokens[t], it->seq, (long long)nv);
        int len = lk_model_seq_len(e->m, it->seq);
        if ((int64_t)len + it->n > n_ctx)
            return lk_fail(err, errlen, LK_ERR_ARG, "context full: positions %d..%d of slot %d do not fit in --ctx %d",
                           len, len + it->n - 1, it->seq, n_ctx);
        if (it->sample && !lk_step_sampler(e->st, it->seq))
            return lk_fail(err, errlen, LK_ERR_ARG, "slot %d samples but has no sampling settings (lk_engine_seq_params)",
                           it->seq);
        tok += it->n;
        pages += lk_model_pages_needed(e->m, it->seq, it->n);
    }
    if (tok > lk_model_n_batch(e->m))
        return lk_fail(err, errlen, LK_ERR_ARG, "a step of %d tokens; the batch holds %d", tok, lk_model_n_batch(e->m));
    if (pages > lk_model_pages_free(e->m))
        return lk_fail(err, errlen, LK_ERR_NOMEM, "KV cache full: the step needs %lld pages of %d positions, %lld of %lld are free "
                       "(--kv-budget)", (long long)pages, LK_KV_PAGE, (long long)lk_model_pages_free(e->m),
                       (long long)lk_model_pages_total(e->m));
    if (e->fl_n >= e->depth)
        return lk_fail(err, errlen, LK_ERR_ARG, "%d steps in flight already (lk_engine_depth)", e->fl_n);
    return LK_OK;
}

lk_status lk_engine_submit(lk_engine *e, const lk_engine_item *items, int n_items, char *err, size_t errlen) {
    lk_status st;
    if ((st = check_usable(e, err, errlen)) || (st = check_items(e, items, n_items, err, errlen))) return st;
    double t0 = lk_time_s();
    lk_step_msg *m = &e->msg;
    inflight *f = &e->fl[(e->fl_head + e->fl_n) % LK_STEP_MAX_DEPTH];
    int n_res = 0;
    m->n_items = n_items;
    m->n_tok = 0;
    for (int i = 0; i < n_items; i++) {
        const lk_engine_item *it = &items[i];
        m->items[i] = (lk_step_item){.seq = it->seq, .pos0 = lk_model_seq_len(e->m, it->seq), .n = it->n, .sample = it->sample};
        memcpy(m->tokens + m->n_tok, it->tokens, sizeof(int32_t) * (size_t)it->n);
        m->n_tok += it->n;
        f->res[i] = it->sample ? n_res++ : -1;
    }
    f->n_items = n_items;
    m->no = e->next_no++;
    char why[LK_ERRLEN];
    if ((st = lk_step_send(e->st, m, why, sizeof why)) || (st = lk_step_run(e->st, m, true, why, sizeof why))) {
        lk_step_msg_clear(m);
        return fail_step(e, st, why, err, errlen);
    }
    lk_step_msg_clear(m);
    e->fl_n++;
    e->busy_s += lk_time_s() - t0;
    return LK_OK;
}

lk_status lk_engine_collect(lk_engine *e, int32_t *next, char *err, size_t errlen) {
    lk_status st;
    if ((st = check_usable(e, err, errlen))) return st;
    if (!e->fl_n) return lk_fail(err, errlen, LK_ERR_ARG, "collect: no step in flight");
    double t0 = lk_time_s();
    char why[LK_ERRLEN];
    if ((st = lk_step_collect(e->st, why, sizeof why))) return fail_step(e, st, why, err, errlen);
    inflight *f = &e->fl[e->fl_head];
    e->fl_head = (e->fl_head + 1) % LK_STEP_MAX_DEPTH;
    e->fl_n--;
    for (int i = 0; i < f->n_items; i++) {
        e->last_res[i] = f->res[i];
        if (f->res[i] < 0) {
            if (next) next[i] = -1;
            continue;
        }
        int seq;
        const int32_t *ids;
        const float *vals;
        int n = lk_step_result(e->st, f->res[i], &seq, &ids, &vals);
        /* the slot's sampler on the head picks (its random state is the slot's) */
        if (next) next[i] = e->caller_picks ? -1 : lk_sampler_pick(lk_step_sampler(e->st, seq), (int32_t *)ids, (float *)vals, n);
    }
    e->last_n_items = f->n_items;
    e->busy_s += lk_time_s() - t0;
    e->t_comm = lk_step_take_comm_s(e->st);
    e->t_compute = LK_MAX(e->busy_s - e->t_comm, 0.0);
    e->busy_s = 0;
    return LK_OK;
}

int lk_engine_candidates(const lk_engine *e, int item, const int32_t **ids, const float **vals) {
    if (item < 0 || item >= e->last_n_items || e->last_res[item] < 0) return 0;
    return lk_step_result(e->st, e->last_res[item], NULL, ids, vals);
}

float lk_engine_candidates_lse(const lk_engine *e, int item) {
    if (item < 0 || item >= e->last_n_items || e->last_res[item] < 0) return NAN;
    return lk_step_result_lse(e->st, e->last_res[item]);
}

lk_status lk_engine_batch(lk_engine *e, const lk_engine_item *items, int n_items, int32_t *next, char *err,
                          size_t errlen) {
    lk_status st = lk_engine_submit(e, items, n_items, err, errlen);
    if (st) return st;
    return lk_engine_collect(e, next, err, errlen);
}

/* ---- one sequence in slot 0 ---- */

lk_status lk_engine_step(lk_engine *e, const int32_t *tokens, int n, int pos0, lk_sampler *s,
                         int32_t *next, char *err, size_t errlen) {
    lk_status st;
    if (n <= 0) return lk_fail(err, errlen, LK_ERR_ARG, "no tokens to feed");
    const lk_sampler_params *sp = lk_sampler_get_params(s);
    if (!e->leg_set || memcmp(sp, &e->leg_sp, sizeof *sp)) {
        if ((st = lk_engine_seq_params(e, 0, sp, 0, err, errlen))) return st;
        e->leg_sp = *sp;
        e->leg_set = true;
    }
    int len = lk_model_seq_len(e->m, 0);
    if (pos0 < 0 || pos0 > len)
        return lk_fail(err, errlen, LK_ERR_ARG, "position %d: slot 0 holds %d positions", pos0, len);
    if (pos0 < len && (st = lk_engine_seq_keep(e, 0, pos0, err, errlen))) return st;
    if ((int64_t)pos0 + n > lk_model_n_ctx(e->m))
        return lk_fail(err, errlen, LK_ERR_ARG, "context full: positions %d..%d do not fit in --ctx %d", pos0, pos0 + n - 1,
                       lk_model_n_ctx(e->m));
    const int B = lk_model_n_batch(e->m);
    double comm = 0, comp = 0;
    for (int i = 0; i < n; i += B) {
        lk_engine_item it = {.seq = 0, .n = LK_MIN(B, n - i), .tokens = tokens + i, .sample = i + B >= n};
        int32_t tok;
        e->caller_picks = true;
        st = lk_engine_batch(e, &it, 1, &tok, err, errlen);
        e->caller_picks = false;
        if (st) return st;
        comm += e->t_comm;
        comp += e->t_compute;
    }
    e->t_comm = comm;
    e->t_compute = comp;
    /* the caller's sampler picks, from the merged candidates */
    const int32_t *ids;
    const float *vals;
    int m = lk_engine_candidates(e, 0, &ids, &vals);
    if (m <= 0) return lk_fail(err, errlen, LK_ERR_FORMAT, "no candidates");
    *next = lk_sampler_pick(s, (int32_t *)ids, (float *)vals, m);
    return LK_OK;
}
