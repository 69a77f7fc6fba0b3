/* The engine: one node, or the head of a cluster (cluster/ does the talking;
 * the head runs its own slice with the same lk_model). */
#include "engine/engine.h"
#include "cluster/cluster.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_CAND 1024

struct lk_engine {
    lk_gguf *g;
    lk_model *m;
    lk_cluster *c;          /* NULL on one node */
    float *logits;          /* (vocab slice) last-position logits of this rank */
    int32_t *cand_ids;      /* (MAX_CAND) */
    float *cand_vals;
    double t_compute, t_comm;
};

static bool is_cluster(const lk_engine_opts *o) {
    return (o->workers && *o->workers) || o->local > 1;
}

lk_status lk_engine_open(const lk_engine_opts *o, lk_engine **out, char *err, size_t errlen) {
    *out = NULL;
    if (!is_cluster(o) && (o->tp > 1 || o->pp > 1))
        return lk_fail(err, errlen, LK_ERR_ARG, "--tp/--pp need ranks: give --local N or --workers LIST");
    lk_engine *e = lk_xcalloc(1, sizeof *e);
    lk_status st = lk_gguf_open(o->model_path, &e->g, err, errlen);
    if (st) { free(e); return st; }
    lk_model_params mp = { .n_ctx = o->n_ctx, .n_batch = o->n_batch, .kv_f16 = o->kv_f16, .n_threads = o->n_threads };
    lk_slice head_slice, *slice = NULL;
    if (is_cluster(o)) {
        lk_model_config cfg;
        if ((st = lk_model_config_read(e->g, &cfg, err, errlen))) { lk_engine_close(e); return st; }
        lk_plan_dims dims;
        lk_model_plan_dims(e->g, &cfg, &dims);
        lk_cluster_opts co = { .workers = o->workers, .local = o->local, .key_file = o->key_file,
                               .model_path = o->model_path, .tp = o->tp, .pp = o->pp, .tp_weights = o->tp_weights,
                               .layers_split = o->layers_split, .transport = o->transport, .n_ctx = o->n_ctx,
                               .n_batch = o->n_batch, .n_threads = o->n_threads, .kv_f16 = o->kv_f16, .wire = o->wire,
                               .seal = o->seal };
        if ((st = lk_cluster_open(&co, e->g, &dims, &e->c, &head_slice, err, errlen))) { lk_engine_close(e); return st; }
        slice = &head_slice;
        if (!o->n_threads && o->local > 1) {
            /* local ranks share this machine's cores */
            long cores = sysconf(_SC_NPROCESSORS_ONLN);
            mp.n_threads = (int)LK_MAX(1, cores / o->local);
        }
    }
    if ((st = lk_model_load(e->g, slice, &mp, &e->m, err, errlen))) { lk_engine_close(e); return st; }
    if (e->c) {
        lk_tp_hooks h;
        lk_cluster_hooks(e->c, &h);
        lk_model_set_hooks(e->m, &h);
    }
    const lk_slice *sl = lk_model_slice(e->m);
    e->logits = lk_xmalloc(sizeof(float) * (size_t)(sl->vocab1 - sl->vocab0));
    e->cand_ids = lk_xmalloc(sizeof(int32_t) * MAX_CAND);
    e->cand_vals = lk_xmalloc(sizeof(float) * MAX_CAND);
    *out = e;
    return LK_OK;
}

void lk_engine_close(lk_engine *e) {
    if (!e) return;
    lk_cluster_close(e->c);
    lk_model_free(e->m);
    lk_gguf_close(e->g);
    free(e->logits);
    free(e->cand_ids);
    free(e->cand_vals);
    free(e);
}

const lk_gguf *lk_engine_gguf(const lk_engine *e) { return e->g; }
const lk_model_config *lk_engine_cfg(const lk_engine *e) { return lk_model_cfg(e->m); }
int lk_engine_n_ctx(const lk_engine *e) { return lk_model_n_ctx(e->m); }
int lk_engine_n_ranks(const lk_engine *e) { return e->c ? lk_cluster_n_ranks(e->c) : 1; }
int lk_engine_threads(const lk_engine *e) { return lk_model_threads(e->m); }
uint64_t lk_engine_weight_bytes(const lk_engine *e) { return lk_model_weight_bytes(e->m); }
void lk_engine_last_timing(const lk_engine *e, double *c, double *m) { *c = e->t_compute; *m = e->t_comm; }

static lk_status check_tokens(const lk_engine *e, const int32_t *tokens, int n, int pos0, char *err, size_t errlen) {
    const int64_t nv = lk_model_cfg(e->m)->n_vocab;
    if (n <= 0) return lk_fail(err, errlen, LK_ERR_ARG, "no tokens to feed");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= nv)
            return lk_fail(err, errlen, LK_ERR_ARG, "token id %d at position %d is outside the vocabulary (%lld)",
                           tokens[i], pos0 + i, (long long)nv);
    if (pos0 < 0 || pos0 + n > lk_model_n_ctx(e->m))
        return lk_fail(err, errlen, LK_ERR_ARG, "context full: positions %d..%d do not fit in --ctx %d",
                       pos0, pos0 + n - 1, lk_model_n_ctx(e->m));
    return LK_OK;
}

lk_status lk_engine_step(lk_engine *e, const int32_t *tokens, int n, int pos0, lk_sampler *s,
                         int32_t *next, char *err, size_t errlen) {
    lk_status st = check_tokens(e, tokens, n, pos0, err, errlen);
    if (st) return st;
    double t0 = lk_time_s();
    int k = lk_sampler_n_candidates(s), m = 0;
    if (e->c) {
        lk_cluster_penalties pen;
        lk_sampler_penalties(s, &pen.repeat, &pen.freq, &pen.presence, &pen.hist, &pen.n_hist);
        st = lk_cluster_forward(e->c, e->m, tokens, n, pos0, k, &pen, e->cand_ids, e->cand_vals, &m, err, errlen);
        if (st) return st;
    } else {
        const int B = lk_model_n_batch(e->m);
        for (int i = 0; i < n; i += B) {
            int nb = LK_MIN(B, n - i);
            st = lk_model_forward(e->m, tokens + i, nb, pos0 + i, i + nb == n ? 1 : 0, e->logits);
            if (st) return lk_fail(err, errlen, st, "forward pass failed at position %d", pos0 + i);
        }
        const lk_slice *sl = lk_model_slice(e->m);
        int64_t nv = sl->vocab1 - sl->vocab0;
        lk_sampler_penalize(s, e->logits, sl->vocab0, nv);
        m = lk_sampler_top(e->logits, sl->vocab0, nv, e->cand_ids, e->cand_vals, k);
    }
    *next = lk_sampler_pick(s, e->cand_ids, e->cand_vals, m);
    double total = lk_time_s() - t0;
    e->t_comm = e->c ? lk_cluster_last_comm_s(e->c) : 0;
    e->t_compute = total - e->t_comm;
    return LK_OK;
}

lk_status lk_engine_logits(lk_engine *e, const int32_t *tokens, int n, int pos0, int n_out,
                           float *logits, char *err, size_t errlen) {
    lk_status st = check_tokens(e, tokens, n, pos0, err, errlen);
    if (st) return st;
    if (e->c) return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "full logits are not gathered across a cluster (by design)");
    if (n > lk_model_n_batch(e->m) || n_out > n || n_out < 0)
        return lk_fail(err, errlen, LK_ERR_ARG, "lk_engine_logits: %d tokens exceed the batch of %d", n, lk_model_n_batch(e->m));
    return lk_model_forward(e->m, tokens, n, pos0, n_out, logits);
}
