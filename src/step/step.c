/* The rank step (step.h). */
#include "step/step.h"
#include "parallel/trace.h"
#include "kernels/kernels.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Logits are computed for this many sampling rows at a time: the buffer is
 * [LOGIT_ROWS][vocabulary rows here], not one row per slot. */
enum { LOGIT_ROWS = 16 };

/* What rank 0 remembers of a step between run and collect. */
typedef struct {
    int n_out;          /* sampling items */
    int32_t *seq, *k;   /* (max items) their slots and candidate counts */
    uint8_t *lse;       /* (max items) 1: a log-sum-exp pair follows the candidates */
    int64_t total_k;
    bool got;           /* its candidates are in `all` already (pp > 1) */
} flight;

struct lk_step {
    lk_model *m;
    lk_mesh *mesh;
    lk_comm *tp;
    const lk_slice *sl;
    int64_t voc[64][2]; /* rank 0: the vocabulary rows of each last-stage TP rank (for checking candidates) */
    int rank, n_ranks, max_seqs, n_batch, n_ctx;
    int64_t n_vocab, nvoc;
    /* per slot */
    lk_sampler **smp;   /* (max_seqs) NULL until PARAMS */
    int32_t *ncand;     /* (max_seqs) */
    uint8_t *lse_on;    /* (max_seqs) 1: the slot's candidates end with the slice's log-sum-exp */
    int32_t *hist;      /* (max_seqs, n_ctx) the ids each slot holds */
    int32_t *hlen;      /* (max_seqs) */
    /* per step */
    float *logits;      /* (LOGIT_ROWS, nvoc) */
    int32_t *rows;      /* (max items) */
    lk_batch_item *bi;  /* (max items) */
    int32_t *ids;       /* (LK_STEP_MAX_CAND) one row's top-k */
    float *vals;
    uint8_t *pairs;     /* (max items * (LK_STEP_MAX_CAND + 1) * 8) this rank's candidates */
    uint8_t *all;       /* rank 0: (tp, same) everyone's */
    int32_t *res_ids;   /* rank 0: (max items, LK_STEP_MAX_CAND) merged */
    float *res_vals;
    int32_t *res_n, *res_seq;
    float *res_lse;     /* rank 0: (max items) log-sum-exp over the whole vocabulary, or NaN */
    int n_res;
    flight fl[LK_STEP_MAX_DEPTH];
    int fl_head, fl_n, depth;
    uint64_t comm_ns;
    lk_tp_hooks inner;  /* the comm's own hook, which ours times */
    char comm_err[LK_ERRLEN];
    uint64_t next_no;   /* the step number expected next (workers) */
};

/* ---- the message --------------------------------------------------------- */

static size_t body_cap(const lk_step_msg *m) {
    return 16 + (size_t)m->cap_ops * LK_STEP_OP_BYTES + (size_t)m->cap_items * 16 + (size_t)m->cap_tok * 4;
}

void lk_step_msg_init(lk_step_msg *msg, int max_seqs, int n_batch) {
    memset(msg, 0, sizeof *msg);
    msg->cap_items = LK_MIN(max_seqs, n_batch);
    msg->cap_ops = 4 * max_seqs + 16;
    msg->cap_tok = n_batch;
    msg->ops = lk_xcalloc((size_t)msg->cap_ops, sizeof(lk_step_op));
    msg->items = lk_xcalloc((size_t)msg->cap_items, sizeof(lk_step_item));
    msg->tokens = lk_xcalloc((size_t)msg->cap_tok, sizeof(int32_t));
    msg->wire_cap = LK_STEP_HDR + body_cap(msg);
    msg->wire = lk_xmalloc(msg->wire_cap);
}

void lk_step_msg_free(lk_step_msg *msg) {
    free(msg->ops);
    free(msg->items);
    free(msg->tokens);
    free(msg->wire);
    memset(msg, 0, sizeof *msg);
}

void lk_step_msg_clear(lk_step_msg *msg) {
    msg->n_ops = msg->n_items = msg->n_tok = 0;
    msg->end = false;
}

static void put32(uint8_t **p, uint32_t v) { for (int i = 0; i < 4; i++) *(*p)++ = (uint8_t)(v >> (8 * i)); }
static void put64(uint8_t **p, uint64_t v) { for (int i = 0; i < 8; i++) *(*p)++ = (uint8_t)(v >> (8 * i)); }
static void putf(uint8_t **p, float f) { uint32_t u; memcpy(&u, &f, 4); put32(p, u); }
static uint32_t get32(const uint8_t **p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)(*p)[i] << (8 * i);
    *p += 4;
    return v;
}
static uint64_t get64(const uint8_t **p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)(*p)[i] << (8 * i);
    *p += 8;
    return v;
}
static float getf(const uint8_t **p) { uint32_t u = get32(p); float f; memcpy(&f, &u, 4); return f; }

static void encode(lk_step_msg *m) {
    uint8_t *p = m->wire + LK_STEP_HDR;
    put32(&p, (uint32_t)m->n_ops);
    put32(&p, (uint32_t)m->n_items);
    put32(&p, (uint32_t)m->n_tok);
    put32(&p, m->end ? 1u : 0u);
    for (int i = 0; i < m->n_ops; i++) {
        const lk_step_op *o = &m->ops[i];
        put32(&p, (uint32_t)o->kind); put32(&p, (uint32_t)o->seq); put32(&p, (uint32_t)o->a); put32(&p, (uint32_t)o->b);
        putf(&p, o->sp.temp); put32(&p, (uint32_t)o->sp.top_k); putf(&p, o->sp.top_p); putf(&p, o->sp.min_p);
        putf(&p, o->sp.repeat_penalty); putf(&p, o->sp.freq_penalty); putf(&p, o->sp.presence_penalty);
        put32(&p, (uint32_t)o->sp.penalty_last_n); put64(&p, o->sp.seed);
    }
    for (int i = 0; i < m->n_items; i++) {
        const lk_step_item *it = &m->items[i];
        put32(&p, (uint32_t)it->seq); put32(&p, (uint32_t)it->pos0); put32(&p, (uint32_t)it->n);
        put32(&p, it->sample ? 1u : 0u);
    }
    for (int i = 0; i < m->n_tok; i++) put32(&p, (uint32_t)m->tokens[i]);
    m->wire_len = (size_t)(p - m->wire);
    uint8_t *h = m->wire;
    put32(&h, LK_STEP_MAGIC);
    put32(&h, (uint32_t)(m->wire_len - LK_STEP_HDR));
    put64(&h, m->no);
}

/* Parses a body of len bytes into msg; counts are checked against the caps
 * before anything is read. */
static lk_status decode(lk_step_msg *m, const uint8_t *b, size_t len, char *err, size_t errlen) {
    if (len < 16) return lk_fail(err, errlen, LK_ERR_FORMAT, "step %llu: body of %zu bytes", (unsigned long long)m->no, len);
    const uint8_t *p = b;
    uint32_t no = get32(&p), ni = get32(&p), nt = get32(&p), fl = get32(&p);
    if (no > (uint32_t)m->cap_ops || ni > (uint32_t)m->cap_items || nt > (uint32_t)m->cap_tok || fl > 1 ||
        len != 16 + (size_t)no * LK_STEP_OP_BYTES + (size_t)ni * 16 + (size_t)nt * 4)
        return lk_fail(err, errlen, LK_ERR_FORMAT,
                       "malformed step %llu: %u ops (<= %d), %u items (<= %d), %u tokens (<= %d), flags %u in %zu bytes",
                       (unsigned long long)m->no, no, m->cap_ops, ni, m->cap_items, nt, m->cap_tok, fl, len);
    m->n_ops = (int)no;
    m->n_items = (int)ni;
    m->n_tok = (int)nt;
    m->end = fl & 1;
    for (uint32_t i = 0; i < no; i++) {
        lk_step_op *o = &m->ops[i];
        o->kind = (int32_t)get32(&p); o->seq = (int32_t)get32(&p); o->a = (int32_t)get32(&p); o->b = (int32_t)get32(&p);
        o->sp.temp = getf(&p); o->sp.top_k = (int32_t)get32(&p); o->sp.top_p = getf(&p); o->sp.min_p = getf(&p);
        o->sp.repeat_penalty = getf(&p); o->sp.freq_penalty = getf(&p); o->sp.presence_penalty = getf(&p);
        o->sp.penalty_last_n = (int32_t)get32(&p); o->sp.seed = get64(&p);
    }
    for (uint32_t i = 0; i < ni; i++) {
        lk_step_item *it = &m->items[i];
        it->seq = (int32_t)get32(&p); it->pos0 = (int32_t)get32(&p); it->n = (int32_t)get32(&p);
        uint32_t f = get32(&p);
        if (f > 1) return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed step %llu: item %u flags %u", (unsigned long long)m->no, i, f);
        it->sample = f & 1;
    }
    for (uint32_t i = 0; i < nt; i++) m->tokens[i] = (int32_t)get32(&p);
    return LK_OK;
}

/* ---- life cycle ------------------------------------------------------------ */

static lk_status timed_hook(void *ctx, float *x, int64_t n, int layer, const char *what) {
    lk_step *s = ctx;
    uint64_t t0 = lk_time_ns();
    lk_status st = s->inner.allreduce_sum(s->inner.ctx, x, n, layer, what);
    s->comm_ns += lk_time_ns() - t0;
    if (st) snprintf(s->comm_err, sizeof s->comm_err, "%s", lk_comm_last_error(s->tp));
    return st;
}

/* The collectives' copies on the model's pool, idle while its caller waits
 * on them */
static void pool_runner(void *ctx, lk_comm_task_fn fn, void *arg, int n) { lk_pool_run_k(ctx, LK_PROF_COMM, fn, arg, n); }

lk_status lk_step_create(const lk_step_params *p, lk_step **out, char *err, size_t errlen) {
    *out = NULL;
    lk_step *s = lk_xcalloc(1, sizeof *s);
    s->m = p->m;
    s->mesh = p->mesh;
    s->tp = p->tp;
    s->sl = lk_model_slice(p->m);
    s->rank = p->mesh ? lk_mesh_rank(p->mesh) : 0;
    s->n_ranks = p->mesh ? lk_mesh_size(p->mesh) : 1;
    if ((int64_t)s->sl->tp_size * s->sl->pp_size != s->n_ranks || (p->mesh && !p->tp) || s->sl->tp_size > 64 ||
        s->rank != s->sl->pp_rank * s->sl->tp_size + s->sl->tp_rank) {
        lk_fail(err, errlen, LK_ERR_ARG, "step: rank %d of %d does not fit slice tp %d/%d pp %d/%d", s->rank, s->n_ranks,
                s->sl->tp_rank, s->sl->tp_size, s->sl->pp_rank, s->sl->pp_size);
        free(s);
        return LK_ERR_ARG;
    }
    s->max_seqs = lk_model_max_seqs(p->m);
    s->n_batch = lk_model_n_batch(p->m);
    s->n_ctx = lk_model_n_ctx(p->m);
    s->n_vocab = lk_model_cfg(p->m)->n_vocab;
    s->nvoc = s->sl->vocab1 - s->sl->vocab0;
    s->depth = s->sl->pp_size;
    for (int t = 0; t < s->sl->tp_size; t++) {
        const lk_slice *ls = p->plan ? &p->plan[(s->sl->pp_size - 1) * s->sl->tp_size + t] : NULL;
        s->voc[t][0] = ls ? ls->vocab0 : 0;
        s->voc[t][1] = ls ? ls->vocab1 : s->n_vocab;
    }
    const int max_items = LK_MIN(s->max_seqs, s->n_batch);
    s->smp = lk_xcalloc((size_t)s->max_seqs, sizeof(lk_sampler *));
    s->ncand = lk_xcalloc((size_t)s->max_seqs, sizeof(int32_t));
    s->lse_on = lk_xcalloc((size_t)s->max_seqs, 1);
    s->hist = lk_xmalloc(sizeof(int32_t) * (size_t)s->max_seqs * s->n_ctx);
    s->hlen = lk_xcalloc((size_t)s->max_seqs, sizeof(int32_t));
    s->logits = lk_xmalloc_aligned(sizeof(float) * LOGIT_ROWS * (size_t)s->nvoc);
    s->rows = lk_xmalloc(sizeof(int32_t) * (size_t)max_items);
    s->bi = lk_xmalloc(sizeof(lk_batch_item) * (size_t)max_items);
    s->ids = lk_xmalloc(sizeof(int32_t) * LK_STEP_MAX_CAND);
    s->vals = lk_xmalloc(sizeof(float) * LK_STEP_MAX_CAND);
    const size_t pb = (size_t)max_items * (LK_STEP_MAX_CAND + 1) * 8;
    s->pairs = lk_xmalloc(pb);
    if (s->rank == 0) {
        s->all = lk_xmalloc(pb * (size_t)s->sl->tp_size);
        s->res_ids = lk_xmalloc(sizeof(int32_t) * (size_t)max_items * LK_STEP_MAX_CAND);
        s->res_vals = lk_xmalloc(sizeof(float) * (size_t)max_items * LK_STEP_MAX_CAND);
        s->res_n = lk_xmalloc(sizeof(int32_t) * (size_t)max_items);
        s->res_seq = lk_xmalloc(sizeof(int32_t) * (size_t)max_items);
        s->res_lse = lk_xmalloc(sizeof(float) * (size_t)max_items);
        for (int i = 0; i < LK_STEP_MAX_DEPTH; i++) {
            s->fl[i].seq = lk_xmalloc(sizeof(int32_t) * (size_t)max_items);
            s->fl[i].k = lk_xmalloc(sizeof(int32_t) * (size_t)max_items);
            s->fl[i].lse = lk_xmalloc((size_t)max_items);
        }
    }
    if (s->tp) {
        lk_comm_reserve(s->tp, (int64_t)s->n_batch * lk_model_cfg(p->m)->n_embd);
        lk_comm_tp_hooks(s->tp, &s->inner);
        lk_comm_set_runner(s->tp, pool_runner, lk_model_pool(s->m), lk_model_threads(s->m));
        lk_tp_hooks h = {.ctx = s, .allreduce_sum = timed_hook};
        lk_model_set_hooks(s->m, &h);
    }
    *out = s;
    return LK_OK;
}

void lk_step_free(lk_step *s) {
    if (!s) return;
    for (int i = 0; i < s->max_seqs; i++) lk_sampler_free(s->smp[i]);
    free(s->smp); free(s->ncand); free(s->lse_on); free(s->hist); free(s->hlen);
    free(s->logits); free(s->rows); free(s->bi); free(s->ids); free(s->vals); free(s->pairs); free(s->all);
    free(s->res_ids); free(s->res_vals); free(s->res_n); free(s->res_seq); free(s->res_lse);
    for (int i = 0; i < LK_STEP_MAX_DEPTH; i++) { free(s->fl[i].seq); free(s->fl[i].k); free(s->fl[i].lse); }
    lk_model_set_hooks(s->m, NULL);
    if (s->tp) lk_comm_set_runner(s->tp, NULL, NULL, 0);
    free(s);
}

lk_sampler *lk_step_sampler(lk_step *s, int seq) { return seq >= 0 && seq < s->max_seqs ? s->smp[seq] : NULL; }
int lk_step_in_flight(const lk_step *s) { return s->fl_n; }
const char *lk_step_comm_error(const lk_step *s) { return s->comm_err; }
double lk_step_take_comm_s(lk_step *s) {
    double t = (double)s->comm_ns / 1e9;
    s->comm_ns = 0;
    return t;
}

/* ---- slot operations -------------------------------------------------------- */

/* The penalty window: the last penalty_last_n ids the slot holds. */
static void rewindow(lk_step *s, int seq) {
    lk_sampler *sm = s->smp[seq];
    if (!sm) return;
    lk_sampler_reset(sm);
    int n = lk_sampler_get_params(sm)->penalty_last_n, len = s->hlen[seq];
    for (int i = LK_MAX(0, len - n); i < len; i++) lk_sampler_accept(sm, s->hist[(size_t)seq * s->n_ctx + i]);
}

static bool params_ok(const lk_sampler_params *p) {
    return isfinite(p->temp) && isfinite(p->top_p) && isfinite(p->min_p) && isfinite(p->repeat_penalty) &&
           p->repeat_penalty > 0 && isfinite(p->freq_penalty) && isfinite(p->presence_penalty) &&
           p->penalty_last_n >= 0 && p->penalty_last_n <= 1 << 20 && p->top_k >= -1;
}

lk_status lk_step_apply(lk_step *s, const lk_step_op *op, char *err, size_t errlen) {
    if (op->seq < 0 || op->seq >= s->max_seqs)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "slot operation %d on slot %d (%d slots)", op->kind, op->seq, s->max_seqs);
    lk_status st;
    switch (op->kind) {
    case LK_STEP_OP_PARAMS: {
        if (!params_ok(&op->sp) || op->a < 0 || op->a > LK_STEP_MAX_CAND)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "slot %d: malformed sampling settings (candidates %d)", op->seq, op->a);
        lk_sampler *n = lk_sampler_create(&op->sp);
        lk_sampler_free(s->smp[op->seq]);
        s->smp[op->seq] = n;
        int k = op->a ? op->a : lk_sampler_n_candidates(n);
        s->ncand[op->seq] = (int32_t)LK_MIN(k, LK_STEP_MAX_CAND);
        s->lse_on[op->seq] = op->a > 0;
        rewindow(s, op->seq);
        return LK_OK;
    }
    case LK_STEP_OP_KEEP:
        if ((st = lk_model_seq_keep(s->m, op->seq, op->a, err, errlen))) return st;
        s->hlen[op->seq] = op->a;
        rewindow(s, op->seq);
        return LK_OK;
    case LK_STEP_OP_FORK:
        if (op->a < 0 || op->a >= s->max_seqs)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "fork into slot %d from slot %d (%d slots)", op->seq, op->a, s->max_seqs);
        if ((st = lk_model_seq_fork(s->m, op->seq, op->a, op->b, err, errlen))) return st;
        memcpy(s->hist + (size_t)op->seq * s->n_ctx, s->hist + (size_t)op->a * s->n_ctx, sizeof(int32_t) * (size_t)op->b);
        s->hlen[op->seq] = op->b;
        rewindow(s, op->seq);
        return LK_OK;
    default:
        return lk_fail(err, errlen, LK_ERR_FORMAT, "unknown slot operation %d", op->kind);
    }
}

/* ---- sending and receiving steps ---------------------------------------------- */

lk_status lk_step_send(lk_step *s, lk_step_msg *msg, char *err, size_t errlen) {
    encode(msg);
    if (s->n_ranks == 1) return LK_OK;
    lk_xfer xf[64];
    int nx = 0;
    for (int r = 1; r < s->n_ranks && nx < 64; r++)
        xf[nx++] = (lk_xfer){.link = lk_mesh_link(s->mesh, r), .is_send = true, .buf = msg->wire, .n = msg->wire_len};
    uint64_t t0 = lk_time_ns();
    lk_status st = lk_xfer_run(xf, nx, lk_deadline_ms(60000), err, errlen);
    s->comm_ns += lk_time_ns() - t0;
    return st;
}

lk_status lk_step_recv(lk_step *s, lk_step_msg *msg, uint64_t deadline_ns, char *err, size_t errlen) {
    lk_link *l = lk_mesh_link(s->mesh, 0);
    uint8_t h[LK_STEP_HDR];
    lk_status st = lk_link_recv(l, h, sizeof h, deadline_ns, err, errlen);
    if (st) return st;
    const uint8_t *p = h;
    uint32_t magic = get32(&p), len = get32(&p);
    uint64_t no = get64(&p);
    if (magic != LK_STEP_MAGIC || no != s->next_no || len > body_cap(msg))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "malformed step header from rank 0: magic %08x, step %llu (expected %llu), %u bytes",
                       magic, (unsigned long long)no, (unsigned long long)s->next_no, len);
    /* the message's own buffer: the body follows the header there */
    if ((st = lk_link_recv(l, msg->wire + LK_STEP_HDR, len, lk_deadline_ms(60000), err, errlen))) return st;
    msg->no = no;
    s->next_no++;
    return decode(msg, msg->wire + LK_STEP_HDR, len, err, errlen);
}

/* ---- running a step ------------------------------------------------------------- */

static lk_status check_items(lk_step *s, const lk_step_msg *msg, char *err, size_t errlen) {
    int tok = 0;
    for (int i = 0; i < msg->n_items; i++) {
        const lk_step_item *it = &msg->items[i];
        if (it->seq < 0 || it->seq >= s->max_seqs || it->n < 1 || it->n > msg->n_tok - tok)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "step %llu item %d: slot %d, %d tokens (%d left of %d)",
                           (unsigned long long)msg->no, i, it->seq, it->n, msg->n_tok - tok, msg->n_tok);
        if (it->sample && !s->smp[it->seq])
            return lk_fail(err, errlen, LK_ERR_FORMAT, "step %llu item %d: slot %d samples without sampling settings",
                           (unsigned long long)msg->no, i, it->seq);
        tok += it->n;
    }
    if (tok != msg->n_tok)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "step %llu: items hold %d tokens, the message %d", (unsigned long long)msg->no, tok,
                       msg->n_tok);
    for (int i = 0; i < msg->n_tok; i++)
        if (msg->tokens[i] < 0 || msg->tokens[i] >= s->n_vocab)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "step %llu: token id %d outside the vocabulary (%lld)",
                           (unsigned long long)msg->no, msg->tokens[i], (long long)s->n_vocab);
    return LK_OK;
}

/* Candidates of every sampling row of the batch into s->pairs (last
 * stage); *total gets their count. A row with a NaN or infinite logit
 * (weights or activations overflowed: a broken file, or a kernel bug) fails
 * the step naming the slot and position, instead of sampling garbage: a
 * scan of the rank's vocabulary rows, cheap beside the output matrix. */
static lk_status candidates(lk_step *s, const lk_step_msg *msg, const float *x, int64_t *total, char *err,
                            size_t errlen) {
    int n_out = 0, row = 0;
    for (int i = 0; i < msg->n_items; i++) {
        row += msg->items[i].n;
        if (msg->items[i].sample) s->rows[n_out++] = row - 1;
    }
    int64_t at = 0;
    int oi = 0;
    for (int i0 = 0; i0 < n_out; i0 += LOGIT_ROWS) {
        int nr = LK_MIN(LOGIT_ROWS, n_out - i0);
        lk_model_logits(s->m, x, s->rows + i0, nr, s->logits);
        for (int r = 0; r < nr; r++) {
            while (!msg->items[oi].sample) oi++;
            const lk_step_item *it = &msg->items[oi++];
            int seq = it->seq, k = s->ncand[seq];
            float *lg = s->logits + (size_t)r * s->nvoc;
            if (lk_any_nonfinite(lg, s->nvoc))
                for (int64_t v = 0; v < s->nvoc; v++)
                    if (!isfinite(lg[v])) {
                        bool ffn;
                        int bl = lk_model_first_nonfinite(s->m, &ffn);
                        char where[160];
                        if (bl < 0)
                            snprintf(where, sizeof where, "every layer's output was finite: the output norm or matrix");
                        else if (bl < s->sl->layer0)
                            snprintf(where, sizeof where, "the hidden rows came non-finite from the pipeline stage before "
                                     "layer %d", s->sl->layer0);
                        else
                            snprintf(where, sizeof where, "first non-finite after layer %d's %s", bl, ffn ? "FFN" : "attention");
                        return lk_fail(err, errlen, LK_ERR_FORMAT,
                                       "non-finite logit %g for token %lld of slot %d at position %d (%s): the model's "
                                       "weights or activations overflowed (a damaged file?)",
                                       (double)lg[v], (long long)(s->sl->vocab0 + v), seq, it->pos0 + it->n - 1, where);
                    }
            lk_sampler_penalize(s->smp[seq], lg, s->sl->vocab0, s->nvoc);
            int got = lk_sampler_top(lg, s->sl->vocab0, s->nvoc, s->ids, s->vals, k);
            for (int c = 0; c < k; c++, at++) {
                int32_t id = c < got ? s->ids[c] : -1;
                float v = c < got ? s->vals[c] : 0.0f;
                memcpy(s->pairs + 8 * at, &id, 4);
                memcpy(s->pairs + 8 * at + 4, &v, 4);
            }
            if (s->lse_on[seq]) {
                /* log-sum-exp over all this rank's rows (lg is spent now),
                 * so rank 0 normalises over the whole vocabulary */
                float v = -FLT_MAX; /* no rows here: adds nothing (exp gives 0) */
                if (got > 0) v = s->vals[0] + (float)log(lk_vec_exp_sum(lg, s->nvoc, s->vals[0]));
                int32_t id = -2;
                memcpy(s->pairs + 8 * at, &id, 4);
                memcpy(s->pairs + 8 * at + 4, &v, 4);
                at++;
            }
        }
    }
    *total = at;
    return LK_OK;
}

static lk_status step_run(lk_step *s, const lk_step_msg *msg, bool ops_applied, char *err, size_t errlen) {
    lk_status st;
    if (!ops_applied)
        for (int i = 0; i < msg->n_ops; i++)
            if ((st = lk_step_apply(s, &msg->ops[i], err, errlen))) return st;
    if ((st = check_items(s, msg, err, errlen))) return st;
    if (s->rank == 0 && s->fl_n == s->depth)
        return lk_fail(err, errlen, LK_ERR_ARG, "step: %d steps already in flight", s->fl_n);
    /* every rank records the tokens, so the penalty windows follow them */
    lk_batch_item *bi = s->bi;
    int tok = 0;
    for (int i = 0; i < msg->n_items; i++) {
        const lk_step_item *it = &msg->items[i];
        bi[i] = (lk_batch_item){it->seq, it->pos0, it->n};
        if (it->pos0 != s->hlen[it->seq])
            return lk_fail(err, errlen, LK_ERR_FORMAT, "step %llu item %d: slot %d holds %d positions, not %d",
                           (unsigned long long)msg->no, i, it->seq, s->hlen[it->seq], it->pos0);
        if ((int64_t)it->pos0 + it->n > s->n_ctx)
            return lk_fail(err, errlen, LK_ERR_ARG, "context full: positions %d..%d of slot %d do not fit in --ctx %d",
                           it->pos0, it->pos0 + it->n - 1, it->seq, s->n_ctx);
    }
    if (msg->n_items && (st = lk_model_batch(s->m, bi, msg->n_items, err, errlen))) return st;
    for (int i = 0; i < msg->n_items; i++) {
        const lk_step_item *it = &msg->items[i];
        int32_t *h = s->hist + (size_t)it->seq * s->n_ctx;
        for (int t = 0; t < it->n; t++) {
            h[it->pos0 + t] = msg->tokens[tok + t];
            if (s->smp[it->seq]) lk_sampler_accept(s->smp[it->seq], msg->tokens[tok + t]);
        }
        s->hlen[it->seq] = it->pos0 + it->n;
        tok += it->n;
    }
    /* rank 0 remembers what to collect */
    flight *f = NULL;
    if (s->rank == 0) {
        f = &s->fl[(s->fl_head + s->fl_n) % LK_STEP_MAX_DEPTH];
        f->n_out = 0;
        f->total_k = 0;
        f->got = false;
        for (int i = 0; i < msg->n_items; i++)
            if (msg->items[i].sample) {
                f->seq[f->n_out] = msg->items[i].seq;
                f->k[f->n_out] = s->ncand[msg->items[i].seq];
                f->lse[f->n_out] = s->lse_on[msg->items[i].seq];
                f->total_k += f->k[f->n_out] + f->lse[f->n_out];
                f->n_out++;
            }
        s->fl_n++;
    }
    if (!msg->n_items) return LK_OK;

    const lk_slice *sl = s->sl;
    const int rows = msg->n_tok;
    const size_t row_bytes = sizeof(float) * (size_t)rows * (size_t)lk_model_cfg(s->m)->n_embd;
    float *x = lk_model_hidden(s->m);
    char why[LK_ERRLEN] = "";
    uint64_t t0;
    if (sl->pp_rank == 0) {
        lk_model_embed(s->m, msg->tokens, rows, x);
    } else {
        t0 = lk_time_ns();
        st = lk_link_recv(lk_mesh_link(s->mesh, s->rank - sl->tp_size), x, row_bytes, lk_deadline_ms(600000), why, sizeof why);
        s->comm_ns += lk_time_ns() - t0;
        if (st) return lk_fail(err, errlen, st, "pipeline stage %d: input rows: %s", sl->pp_rank, why);
    }
    if ((st = lk_model_layers(s->m, x)))
        return lk_fail(err, errlen, st, "forward pass of step %llu: %s", (unsigned long long)msg->no, s->comm_err);
    if (sl->pp_rank < sl->pp_size - 1) {
        lk_xfer xf[65];
        int nx = 0;
        xf[nx++] = (lk_xfer){.link = lk_mesh_link(s->mesh, s->rank + sl->tp_size), .is_send = true, .buf = x, .n = row_bytes};
        /* Rank 0 with an older step in flight takes its candidates while
         * these rows go out: the last stage sends them before it reads our
         * rows, and rows plus candidates may not both fit the links'
         * buffers (each side would wait on the other). */
        flight *old = s->rank == 0 && s->fl_n > 1 ? &s->fl[s->fl_head] : NULL;
        if (old && old->total_k && !old->got) {
            const size_t bytes = 8 * (size_t)old->total_k;
            for (int t = 0; t < sl->tp_size; t++)
                xf[nx++] = (lk_xfer){.link = lk_mesh_link(s->mesh, (sl->pp_size - 1) * sl->tp_size + t), .is_send = false,
                                     .buf = s->all + (size_t)t * bytes, .n = bytes};
            old->got = true;
        }
        t0 = lk_time_ns();
        st = lk_xfer_run(xf, nx, lk_deadline_ms(600000), why, sizeof why);
        s->comm_ns += lk_time_ns() - t0;
        if (st) return lk_fail(err, errlen, st, "pipeline stage %d: passing rows on: %s", sl->pp_rank, why);
        return LK_OK;
    }
    int64_t total = 0;
    if ((st = candidates(s, msg, x, &total, err, errlen))) return st;
    if (s->rank == 0 || !total) return LK_OK; /* rank 0 gathers in collect */
    t0 = lk_time_ns();
    if (sl->pp_size > 1) /* rank 0 is not in the last stage's group: straight to it */
        st = lk_link_send(lk_mesh_link(s->mesh, 0), s->pairs, 8 * (size_t)total, lk_deadline_ms(600000), why, sizeof why);
    else if ((st = lk_comm_gather(s->tp, s->pairs, 8 * (size_t)total, NULL, 0, "candidates")))
        snprintf(why, sizeof why, "%s", lk_comm_last_error(s->tp));
    s->comm_ns += lk_time_ns() - t0;
    if (st) return lk_fail(err, errlen, st, "sending candidates to rank 0: %s", why);
    return LK_OK;
}

lk_status lk_step_run(lk_step *s, const lk_step_msg *msg, bool ops_applied, char *err, size_t errlen) {
    if (lk_trace_on) lk_trace_step(s->rank, msg->no, msg->n_tok); /* run --trace (parallel/trace.h) */
    lk_status st = step_run(s, msg, ops_applied, err, errlen);
    if (lk_trace_on) lk_trace_work(s->rank);
    return st;
}

/* ---- collecting (rank 0) ----------------------------------------------------------- */

static bool better(float va, int32_t ia, float vb, int32_t ib) { return va > vb || (va == vb && ia < ib); }

static lk_status step_collect(lk_step *s, char *err, size_t errlen);
lk_status lk_step_collect(lk_step *s, char *err, size_t errlen) {
    lk_status st = step_collect(s, err, errlen);
    if (lk_trace_on) lk_trace_work(s->rank);
    return st;
}

static lk_status step_collect(lk_step *s, char *err, size_t errlen) {
    LK_ASSERT(s->rank == 0);
    if (!s->fl_n) return lk_fail(err, errlen, LK_ERR_ARG, "collect: no step in flight");
    flight *f = &s->fl[s->fl_head];
    s->fl_head = (s->fl_head + 1) % LK_STEP_MAX_DEPTH;
    s->fl_n--;
    s->n_res = 0;
    if (!f->total_k) return LK_OK;
    const lk_slice *sl = s->sl;
    const size_t bytes = 8 * (size_t)f->total_k;
    const int nl = sl->tp_size;        /* lists: the last stage's TP ranks */
    const int base = (sl->pp_size - 1) * sl->tp_size;
    char why[LK_ERRLEN] = "";
    lk_status st = LK_OK;
    uint64_t t0 = lk_time_ns();
    if (sl->pp_size == 1) {
        if (s->tp) {
            if ((st = lk_comm_gather(s->tp, s->pairs, bytes, s->all, 0, "candidates")))
                snprintf(why, sizeof why, "%s", lk_comm_last_error(s->tp));
        } else {
            memcpy(s->all, s->pairs, bytes);
        }
    } else if (!f->got) {
        lk_xfer xf[64];
        for (int t = 0; t < nl; t++)
            xf[t] = (lk_xfer){.link = lk_mesh_link(s->mesh, base + t), .is_send = false, .buf = s->all + (size_t)t * bytes, .n = bytes};
        st = lk_xfer_run(xf, nl, lk_deadline_ms(600000), why, sizeof why);
    }
    s->comm_ns += lk_time_ns() - t0;
    if (st) return lk_fail(err, errlen, st, "candidates: %s", why);
    /* merge per sampling item: nl sorted lists of k each */
    int64_t off = 0;
    for (int i = 0; i < f->n_out; i++) {
        const int k = f->k[i], rec = k + f->lse[i];
        int32_t *ri = s->res_ids + (size_t)i * LK_STEP_MAX_CAND;
        float *rv = s->res_vals + (size_t)i * LK_STEP_MAX_CAND;
        int at[64] = {0}, n = 0;
        /* validate every list first */
        for (int l = 0; l < nl; l++) {
            const uint8_t *pp = s->all + (size_t)l * bytes + 8 * (size_t)off;
            bool pad = false;
            for (int c = 0; c < k; c++) {
                int32_t id;
                float v;
                memcpy(&id, pp + 8 * c, 4);
                memcpy(&v, pp + 8 * c + 4, 4);
                if (id == -1) { pad = true; continue; }
                if (pad || id < s->voc[l][0] || id >= s->voc[l][1] || !isfinite(v))
                    return lk_fail(err, errlen, LK_ERR_FORMAT,
                                   "rank %d sent a bad candidate for slot %d: id %d (its rows %lld..%lld), value %g", base + l,
                                   f->seq[i], id, (long long)s->voc[l][0], (long long)s->voc[l][1] - 1, (double)v);
            }
        }
        /* the lists' log-sum-exps: at least their best value, finite; combined */
        float lse = NAN;
        if (f->lse[i]) {
            double mx = -INFINITY, sum = 0;
            float ls[64];
            for (int l = 0; l < nl; l++) {
                const uint8_t *pp = s->all + (size_t)l * bytes + 8 * (size_t)(off + k);
                int32_t id, id0;
                float v0;
                memcpy(&id, pp, 4);
                memcpy(&ls[l], pp + 4, 4);
                memcpy(&id0, pp - 8 * (size_t)k, 4);
                memcpy(&v0, pp - 8 * (size_t)k + 4, 4);
                if (id != -2 || !isfinite(ls[l]) || (id0 >= 0 && ls[l] < v0))
                    return lk_fail(err, errlen, LK_ERR_FORMAT, "rank %d sent a bad log-sum-exp for slot %d: id %d, value %g",
                                   base + l, f->seq[i], id, (double)ls[l]);
                mx = LK_MAX(mx, (double)ls[l]);
            }
            for (int l = 0; l < nl; l++) sum += exp((double)ls[l] - mx);
            lse = (float)(mx + log(sum));
        }
        while (n < k) {
            int bl = -1;
            int32_t bid = 0;
            float bv = 0;
            for (int l = 0; l < nl; l++) {
                if (at[l] >= k) continue;
                const uint8_t *pp = s->all + (size_t)l * bytes + 8 * (size_t)(off + at[l]);
                int32_t id;
                float v;
                memcpy(&id, pp, 4);
                memcpy(&v, pp + 4, 4);
                if (id < 0) { at[l] = k; continue; }
                if (bl < 0 || better(v, id, bv, bid)) { bl = l; bid = id; bv = v; }
            }
            if (bl < 0) break;
            ri[n] = bid;
            rv[n++] = bv;
            at[bl]++;
        }
        if (!n) return lk_fail(err, errlen, LK_ERR_FORMAT, "no candidates for slot %d", f->seq[i]);
        s->res_n[i] = n;
        s->res_seq[i] = f->seq[i];
        s->res_lse[i] = lse;
        off += rec;
    }
    s->n_res = f->n_out;
    return LK_OK;
}

int lk_step_n_results(const lk_step *s) { return s->n_res; }

int lk_step_result(const lk_step *s, int i, int *seq, const int32_t **ids, const float **vals) {
    LK_ASSERT(i >= 0 && i < s->n_res);
    if (seq) *seq = s->res_seq[i];
    *ids = s->res_ids + (size_t)i * LK_STEP_MAX_CAND;
    *vals = s->res_vals + (size_t)i * LK_STEP_MAX_CAND;
    return s->res_n[i];
}

float lk_step_result_lse(const lk_step *s, int i) {
    LK_ASSERT(i >= 0 && i < s->n_res);
    return s->res_lse[i];
}
