/* The gated delta net: qwen35moe's linear-attention mixer (model.h).
 *
 * Per token t of a sequence, with h = RMSNorm(x) . attn_norm:
 *   qkv = attn_qkv . h            C channels: q (nk x dk), k (nk x dk), v (nv x dv)
 *   z   = attn_gate . h           (nv x dv)
 *   c   = silu(causal depthwise conv of qkv over the last ssm_conv tokens)
 *   q, k: L2-normalised per head, x / sqrt(sum x^2 + eps)
 *   per value head v (reading key head v mod nk, the converter's tiled order):
 *     beta = sigmoid(ssm_beta . h), g = softplus(ssm_alpha . h + dt) * a   (a < 0)
 *     S <- exp(g) S                         (decay first; S is dk x dv, [key][value])
 *     delta = beta (v - S^T k)              (what the decayed state mispredicts)
 *     S <- S + k delta^T
 *     o = S^T q / sqrt(dk)
 *     o <- RMSNorm(o) . ssm_norm * silu(z_v)
 *   out = ssm_out . concat(o)
 * as llama.cpp computes it (synth README "How llama.cpp computes
 * qwen35moe"). The state is the sequence's: the conv window (the last
 * ssm_conv - 1 inputs of every channel) and S per value head, F32, in the
 * slot's row of m->rstate, advanced once per token. A batched prompt runs
 * the recurrence over its tokens in order (the conv sees the item's earlier
 * tokens); items never share state.
 *
 * Work: the projections are matrix products over the whole batch; then one
 * pool dispatch convolves and normalises, tasks (item, head of q, k or v
 * channels); a second runs the recurrence, tasks (item, value head), each
 * task walking its item's tokens in order. The state update per token is two
 * passes over the dk x dv matrix, vectorised along the value dimension: a
 * read-only one for both S^T k and S^T q of the old state, then one that
 * writes exp(g) S + k delta^T; the output needs no third pass, since
 *   o = S_new^T q = exp(g) S_old^T q + (k . q) delta.
 * (llama.cpp reads it from the updated state: the same value, rounded in
 * another order.) With the Qwen3.5-397B shape (64 value heads of 128 x 128)
 * this was 65 % of the layer's projections' time per prefill token as four
 * scalar-and-axpy passes, 12 % in this form (bench/bench_deltanet).
 *
 * Tensor parallelism splits key heads: a rank with key heads [k0, k1) holds
 * the value heads whose key head (h mod nk) is among them, j nk + k0 ..
 * j nk + k1 - 1 for j < nv / nk, so its value heads pair with its own key
 * heads (local value head i reads local key head i mod (k1 - k0)), and the
 * conv channels and state go with their heads. Those rows are not
 * contiguous in the file: lk_deltanet_load gathers them into memory of the
 * layer's own (one node: plain views). */
#include "model/model_impl.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- load */

typedef struct { int64_t a, b; } span;

static const lk_gguf_tensor *tens(const lk_gguf *g, int l, const char *name) {
    char n[96];
    snprintf(n, sizeof n, "blk.%d.%s", l, name);
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, n);
    LK_ASSERT(t); /* checked by lk_model_config_read */
    return t;
}

/* The value heads of key heads [k0, k1), scaled by `unit` (elements per
 * head), offset by `base`: nv / nk spans. */
static int vspans(const lk_model_config *c, int k0, int k1, int64_t unit, int64_t base, span *out) {
    const int r = c->ssm_nv / c->ssm_nk;
    for (int j = 0; j < r; j++)
        out[j] = (span){ base + ((int64_t)j * c->ssm_nk + k0) * unit, base + ((int64_t)j * c->ssm_nk + k1) * unit };
    return r;
}

static int64_t spans_len(const span *s, int n) {
    int64_t t = 0;
    for (int i = 0; i < n; i++) t += s[i].b - s[i].a;
    return t;
}

static bool contiguous(const span *s, int n) {
    for (int i = 1; i < n; i++)
        if (s[i].a != s[i - 1].b) return false;
    return true;
}

/* Rows `s` of a 2-D tensor as one matrix: a view when they are contiguous,
 * else copied, in order, to *dst (advanced). */
static lk_mat gather_rows(const lk_gguf_tensor *t, const span *s, int n, char **dst) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    lk_mat m = { .type = (lk_type)t->type, .cols = (int64_t)t->ne[0], .rows = spans_len(s, n), .row_stride = rb };
    if (contiguous(s, n)) {
        m.data = (const char *)t->data + (size_t)s[0].a * rb;
        return m;
    }
    m.data = *dst;
    for (int i = 0; i < n; i++) {
        memcpy(*dst, (const char *)t->data + (size_t)s[i].a * rb, (size_t)(s[i].b - s[i].a) * rb);
        *dst += (size_t)(s[i].b - s[i].a) * rb;
    }
    return m;
}

/* Columns `s` (on block boundaries) of every row, as one matrix. */
static lk_mat gather_cols(const lk_gguf_tensor *t, const span *s, int n, char **dst) {
    size_t rb = 0, nb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    const int64_t cols = spans_len(s, n);
    LK_ASSERT(lk_type_row_bytes(t->type, cols, &nb));
    lk_mat m = { .type = (lk_type)t->type, .cols = cols, .rows = (int64_t)t->ne[1], .row_stride = rb };
    if (contiguous(s, n)) {
        size_t off = 0;
        LK_ASSERT(s[0].a == 0 || lk_type_row_bytes(t->type, s[0].a, &off));
        m.data = (const char *)t->data + off;
        return m;
    }
    m.data = *dst;
    m.row_stride = nb;
    for (int64_t r = 0; r < m.rows; r++)
        for (int i = 0; i < n; i++) {
            size_t off = 0, len = 0;
            LK_ASSERT(s[i].a % lk_type_block_size(t->type) == 0);
            LK_ASSERT(s[i].a == 0 || lk_type_row_bytes(t->type, s[i].a, &off));
            LK_ASSERT(lk_type_row_bytes(t->type, s[i].b - s[i].a, &len));
            memcpy(*dst, (const char *)t->data + (size_t)r * rb + off, len);
            *dst += len;
        }
    return m;
}

/* F32 vectors: elements s of a 1-D tensor, or rows s of a [K, C] one. */
static const float *gather_f32(const lk_gguf_tensor *t, const span *s, int n, int64_t per, char **dst) {
    const float *src = t->data;
    if (contiguous(s, n)) return src + s[0].a * per;
    float *out = (float *)*dst;
    for (int i = 0; i < n; i++) {
        memcpy(*dst, src + s[i].a * per, sizeof(float) * (size_t)((s[i].b - s[i].a) * per));
        *dst += sizeof(float) * (size_t)((s[i].b - s[i].a) * per);
    }
    return out;
}

static size_t mat_sz(const lk_gguf_tensor *t, int64_t cols, int64_t rows) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, cols, &rb));
    return rb * (size_t)rows;
}

void lk_deltanet_load(lk_model *m, int l, layer_w *w) {
    const lk_model_config *c = &m->cfg;
    const lk_gguf *g = m->g;
    const int k0 = m->kh0, k1 = m->kh0 + m->nkl, nk = c->ssm_nk;
    const int64_t dk = c->ssm_dk, dv = c->ssm_dv, d = c->n_embd, K = c->ssm_conv;
    w->rec = true;
    if (m->nkl == 0) return; /* no heads here: the layer adds zeros (lk_deltanet) */
    span ch[2 + 64], vd[64], vh[64];
    LK_ASSERT(c->ssm_nv / nk <= 64);
    ch[0] = (span){ k0 * dk, k1 * dk };
    ch[1] = (span){ (nk + k0) * dk, (nk + k1) * dk };
    const int r = vspans(c, k0, k1, dv, 2 * nk * dk, ch + 2);
    vspans(c, k0, k1, dv, 0, vd);
    vspans(c, k0, k1, 1, 0, vh);
    const int64_t C = 2 * (k1 - k0) * dk + (int64_t)m->nvl * dv, VD = (int64_t)m->nvl * dv;
    const lk_gguf_tensor *tqkv = tens(g, l, "attn_qkv.weight"), *tz = tens(g, l, "attn_gate.weight"),
                         *tb = tens(g, l, "ssm_beta.weight"), *ta = tens(g, l, "ssm_alpha.weight"),
                         *to = tens(g, l, "ssm_out.weight"), *tc = tens(g, l, "ssm_conv1d.weight"),
                         *tdt = tens(g, l, "ssm_dt.bias"), *tsa = tens(g, l, "ssm_a");
    char *p = NULL;
    if (m->nkl < nk && m->nkl > 0) { /* a split: the value heads are not contiguous */
        size_t need = mat_sz(tqkv, d, C) + mat_sz(tz, d, VD) + mat_sz(tb, d, m->nvl) + mat_sz(ta, d, m->nvl) +
                      mat_sz(to, VD, d) + sizeof(float) * (size_t)(C * K + 2 * m->nvl) + 64;
        w->own = p = lk_xmalloc(need);
    }
    w->wqkv = gather_rows(tqkv, ch, 2 + r, &p);
    w->wz = gather_rows(tz, vd, r, &p);
    w->wbeta = gather_rows(tb, vh, r, &p);
    w->walpha = gather_rows(ta, vh, r, &p);
    w->wso = gather_cols(to, vd, r, &p);
    w->conv = gather_f32(tc, ch, 2 + r, K, &p);
    w->dt = gather_f32(tdt, vh, r, 1, &p);
    w->ssm_a = gather_f32(tsa, vh, r, 1, &p);
    w->ssm_norm = tens(g, l, "ssm_norm.weight")->data;
}

void lk_deltanet_alloc(lk_model *m) {
    const lk_model_config *c = &m->cfg;
    const size_t B = (size_t)m->n_batch;
    const int64_t C = 2LL * m->nkl * c->ssm_dk + (int64_t)m->nvl * c->ssm_dv, VD = (int64_t)m->nvl * c->ssm_dv;
    m->rs_elems = (size_t)(c->ssm_conv - 1) * (size_t)C + (size_t)m->nvl * c->ssm_dk * c->ssm_dv;
    m->rstate = lk_xcalloc((size_t)m->max_seqs * (size_t)LK_MAX(m->n_rec, 1) * LK_MAX(m->rs_elems, 1), sizeof(float));
    m->dn_qkv = lk_xmalloc_aligned(sizeof(float) * B * (size_t)LK_MAX(C, 1));
    m->dn_z = lk_xmalloc_aligned(sizeof(float) * B * (size_t)LK_MAX(VD, 1));
    m->dn_ab = lk_xmalloc_aligned(sizeof(float) * B * (size_t)LK_MAX(2 * m->nvl, 1));
    m->dn_o = lk_xmalloc_aligned(sizeof(float) * B * (size_t)LK_MAX(VD, 1));
}

void lk_deltanet_free(lk_model *m) {
    free(m->rstate);
    free(m->dn_qkv); free(m->dn_z); free(m->dn_ab); free(m->dn_o);
    if (m->layers)
        for (int i = 0; i < m->sl.layer1 - m->sl.layer0; i++) free(m->layers[i].own);
}

/* ---------------------------------------------------------------- state */

static float *slot_state(const lk_model *m, int seq) {
    return m->rstate + (size_t)seq * (size_t)m->n_rec * m->rs_elems;
}

void lk_deltanet_reset(lk_model *m, int seq) {
    if (m->n_rec) memset(slot_state(m, seq), 0, sizeof(float) * (size_t)m->n_rec * m->rs_elems);
}

void lk_deltanet_copy(lk_model *m, int dst, int src) {
    if (m->n_rec) memcpy(slot_state(m, dst), slot_state(m, src), sizeof(float) * (size_t)m->n_rec * m->rs_elems);
}

/* ---------------------------------------------------------------- forward */

typedef struct {
    lk_model *m;
    const layer_w *w;
} dn_job;

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* Tasks (item, channel group): 2 nkl groups of dk (q heads, k heads), then
 * nvl of dv. Convolves the item's tokens in order through the slot's
 * window, silu, and L2-normalises q and k heads. */
static void conv_fn(void *arg, int ith, int nth) {
    dn_job *j = arg;
    lk_model *m = j->m;
    const lk_model_config *c = &m->cfg;
    const int K = c->ssm_conv, ng = 2 * m->nkl + m->nvl;
    const int64_t dk = c->ssm_dk, dv = c->ssm_dv, C = 2 * m->nkl * dk + (int64_t)m->nvl * dv;
    const float eps = c->rms_eps;
    for (int task = ith; task < m->n_items * ng; task += nth) {
        const int it = task / ng, grp = task % ng;
        const lk_batch_item *item = &m->items[it];
        const int64_t c0 = grp < 2 * m->nkl ? grp * dk : 2 * m->nkl * dk + (grp - 2 * m->nkl) * dv;
        const int64_t nc = grp < 2 * m->nkl ? dk : dv;
        float *win = slot_state(m, item->seq) + (size_t)j->w->ri * m->rs_elems; /* [K-1][C] */
        for (int t = 0; t < item->n; t++) {
            float *row = m->dn_qkv + (size_t)(m->item_row0[it] + t) * C;
            for (int64_t ci = c0; ci < c0 + nc; ci++) {
                const float *tap = j->w->conv + ci * K;
                const float in = row[ci];
                float acc = 0;
                for (int k = 0; k < K - 1; k++) acc += tap[k] * win[(size_t)k * C + ci];
                acc += tap[K - 1] * in;
                for (int k = 0; k + 1 < K - 1; k++) win[(size_t)k * C + ci] = win[(size_t)(k + 1) * C + ci];
                if (K > 1) win[(size_t)(K - 2) * C + ci] = in;
                row[ci] = silu(acc);
            }
            if (grp < 2 * m->nkl) {
                float *h = row + c0;
                float ss = 0;
                for (int64_t i = 0; i < nc; i++) ss += h[i] * h[i];
                const float s = 1.0f / sqrtf(ss + eps);
                for (int64_t i = 0; i < nc; i++) h[i] *= s;
            }
        }
    }
}

/* The two passes over one value head's state S (dk rows of dv), see the
 * file comment: sk = S^T k and sq = S^T q; then S = decay S + k delta^T.
 * The scalar passes are the AVX2 ones' arithmetic per element (each
 * column summed down the rows in order by fused multiply-adds; decay S
 * rounded, then k delta^T fused onto it), so both levels give the same
 * state bits. */
#define AVX2 __attribute__((target("avx2,fma")))
static void pass_read_scalar(const float *S, const float *k, const float *q, float *sk, float *sq, int64_t dk, int64_t dv) {
    memset(sk, 0, sizeof(float) * (size_t)dv);
    memset(sq, 0, sizeof(float) * (size_t)dv);
    for (int64_t i = 0; i < dk; i++)
        for (int64_t e = 0; e < dv; e++) {
            sk[e] = lk_fmaf(k[i], S[i * dv + e], sk[e]);
            sq[e] = lk_fmaf(q[i], S[i * dv + e], sq[e]);
        }
}
static void pass_write_scalar(float *S, float decay, const float *k, const float *delta, int64_t dk, int64_t dv) {
    for (int64_t i = 0; i < dk; i++)
        for (int64_t e = 0; e < dv; e++) S[i * dv + e] = lk_fmaf(k[i], delta[e], decay * S[i * dv + e]);
}
/* dv a multiple of 16: columns in blocks of 16, accumulated in registers down the dk rows */
AVX2 static void pass_read_avx2(const float *S, const float *k, const float *q, float *sk, float *sq, int64_t dk,
                                int64_t dv) {
    for (int64_t e = 0; e < dv; e += 16) {
        __m256 k0 = _mm256_setzero_ps(), k1 = k0, q0 = k0, q1 = k0;
        for (int64_t i = 0; i < dk; i++) {
            const __m256 s0 = _mm256_loadu_ps(S + i * dv + e), s1 = _mm256_loadu_ps(S + i * dv + e + 8);
            const __m256 vk = _mm256_set1_ps(k[i]), vq = _mm256_set1_ps(q[i]);
            k0 = _mm256_fmadd_ps(vk, s0, k0), k1 = _mm256_fmadd_ps(vk, s1, k1);
            q0 = _mm256_fmadd_ps(vq, s0, q0), q1 = _mm256_fmadd_ps(vq, s1, q1);
        }
        _mm256_storeu_ps(sk + e, k0), _mm256_storeu_ps(sk + e + 8, k1);
        _mm256_storeu_ps(sq + e, q0), _mm256_storeu_ps(sq + e + 8, q1);
    }
}
AVX2 static void pass_write_avx2(float *S, float decay, const float *k, const float *delta, int64_t dk, int64_t dv) {
    const __m256 vd = _mm256_set1_ps(decay);
    for (int64_t e = 0; e < dv; e += 16) {
        const __m256 d0 = _mm256_loadu_ps(delta + e), d1 = _mm256_loadu_ps(delta + e + 8);
        for (int64_t i = 0; i < dk; i++) {
            float *r = S + i * dv + e;
            const __m256 vk = _mm256_set1_ps(k[i]);
            _mm256_storeu_ps(r, _mm256_fmadd_ps(vk, d0, _mm256_mul_ps(vd, _mm256_loadu_ps(r))));
            _mm256_storeu_ps(r + 8, _mm256_fmadd_ps(vk, d1, _mm256_mul_ps(vd, _mm256_loadu_ps(r + 8))));
        }
    }
}

/* Tasks (item, local value head): the delta rule over the item's tokens,
 * then the gated RMSNorm of each token's output. */
static void delta_fn(void *arg, int ith, int nth) {
    dn_job *j = arg;
    lk_model *m = j->m;
    const lk_model_config *c = &m->cfg;
    const layer_w *w = j->w;
    const int nvl = m->nvl, nkl = m->nkl, K = c->ssm_conv;
    const int64_t dk = c->ssm_dk, dv = c->ssm_dv, C = 2 * nkl * dk + (int64_t)nvl * dv, VD = (int64_t)nvl * dv;
    const float qscale = 1.0f / sqrtf((float)dk);
    const bool avx2 = dv % 16 == 0 && lk_vec_simd_level() >= LK_SIMD_AVX2; /* the vector kernels' level */
    float kv[1024], sq[1024], delta[1024];
    for (int task = ith; task < m->n_items * nvl; task += nth) {
        const int it = task / nvl, vi = task % nvl, ki = m->dn_grouped ? vi / (nvl / nkl) : vi % nkl;
        const lk_batch_item *item = &m->items[it];
        float *S = slot_state(m, item->seq) + (size_t)w->ri * m->rs_elems + (size_t)(K - 1) * C +
                   (size_t)vi * dk * dv;
        for (int t = 0; t < item->n; t++) {
            const int row = m->item_row0[it] + t;
            const float *r = m->dn_qkv + (size_t)row * C;
            const float *q = r + ki * dk, *k = r + (nkl + ki) * dk, *v = r + 2 * nkl * dk + vi * dv;
            const float *ab = m->dn_ab + (size_t)row * 2 * nvl;
            const float beta = 1.0f / (1.0f + expf(-ab[vi]));
            const float sp = ab[nvl + vi] + w->dt[vi];
            const float gsp = sp > 20.0f ? sp : log1pf(expf(sp)); /* softplus */
            const float decay = expf(gsp * w->ssm_a[vi]);
            /* the old state's S^T k and S^T q; delta = beta (v - decay S^T k) */
            if (avx2) pass_read_avx2(S, k, q, kv, sq, dk, dv);
            else pass_read_scalar(S, k, q, kv, sq, dk, dv);
            float kq = 0;
            for (int64_t i = 0; i < dk; i++) kq += k[i] * q[i];
            float *o = m->dn_o + (size_t)row * VD + (size_t)vi * dv;
            for (int64_t e = 0; e < dv; e++) {
                delta[e] = beta * (v[e] - decay * kv[e]);
                o[e] = (decay * sq[e] + kq * delta[e]) * qscale; /* S_new^T q / sqrt(dk) */
            }
            /* S <- decay S + k delta^T */
            if (avx2) pass_write_avx2(S, decay, k, delta, dk, dv);
            else pass_write_scalar(S, decay, k, delta, dk, dv);
            /* gated RMSNorm: RMSNorm(o) . ssm_norm * silu(z) */
            lk_rmsnorm(o, o, w->ssm_norm, dv, c->rms_eps);
            const float *z = m->dn_z + (size_t)row * VD + (size_t)vi * dv;
            for (int64_t e = 0; e < dv; e++) o[e] *= silu(z[e]);
        }
    }
}

void lk_deltanet(lk_model *m, int li, const float *x) {
    const lk_model_config *c = &m->cfg;
    const layer_w *w = &m->layers[li];
    const int n = m->n_rows;
    const int64_t d = c->n_embd, C = 2LL * m->nkl * c->ssm_dk + (int64_t)m->nvl * c->ssm_dv,
                  VD = (int64_t)m->nvl * c->ssm_dv;
    if (m->nkl == 0) {
        memset(m->o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    for (int t = 0; t < n; t++) lk_rmsnorm(m->xb + t * d, x + t * d, w->attn_norm, d, c->rms_eps);
    const lk_mat *pz[2] = {&w->wqkv, &w->wz}, *pab[2] = {&w->wbeta, &w->walpha};
    if (lk_matmul_can_fuse(pz, 2)) {
        float *const ys[2] = {m->dn_qkv, m->dn_z};
        const int64_t ss[2] = {C, VD};
        lk_matmul_fused(m->pool, pz, 2, m->xb, d, n, ys, ss, false, m->act);
    } else {
        lk_matmul(m->pool, &w->wqkv, m->xb, d, n, m->dn_qkv, C, m->act);
        lk_matmul(m->pool, &w->wz, m->xb, d, n, m->dn_z, VD, m->act);
    }
    if (lk_matmul_can_fuse(pab, 2)) {
        float *const ys[2] = {m->dn_ab, m->dn_ab + m->nvl};
        const int64_t ss[2] = {2 * m->nvl, 2 * m->nvl};
        lk_matmul_fused(m->pool, pab, 2, m->xb, d, n, ys, ss, false, m->act);
    } else {
        lk_matmul(m->pool, &w->wbeta, m->xb, d, n, m->dn_ab, 2 * m->nvl, m->act);
        lk_matmul(m->pool, &w->walpha, m->xb, d, n, m->dn_ab + m->nvl, 2 * m->nvl, m->act);
    }
    dn_job j = { m, w };
    lk_pool_run(m->pool, conv_fn, &j);
    lk_pool_run(m->pool, delta_fn, &j);
    lk_matmul(m->pool, &w->wso, m->dn_o, VD, n, m->o, d, m->act);
}
