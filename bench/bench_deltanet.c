/* bench_deltanet — the gated delta net's recurrence (deltanet.c's delta_fn:
 * decay, delta rule, output, gated RMSNorm, token by token) at a real
 * shape, one thread, against the layer's projections at the same shape
 * (lk_matmul of attn_qkv + attn_gate and ssm_out in a weight type), to say
 * what share of a recurrent layer's prefill the token-by-token recurrence
 * takes (issue 16: "prefill runs the recurrence chunk-wise ... at a speed
 * comparable to attention").
 *
 *   make B=build build/bench/bench_deltanet
 *   build/bench/bench_deltanet [ntok] [type]   (defaults 64, q4_K; the Qwen3.5-397B shape:
 *                                               n_embd 4096, 16 key / 64 value heads of 128)
 *
 * It includes deltanet.c, so it times the engine's own code, on a model
 * struct holding only what delta_fn reads. */
#include "../src/model/deltanet.c"

#include "common/lk_common.h"
#include "quant/quant.h"

static uint64_t rng = 88172645463325252ull;
static float rnd(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((int64_t)(rng % 2001) - 1000) / 1000.f;
}

static lk_mat rand_mat(lk_type t, int64_t rows, int64_t cols) {
    size_t rb = 0;
    lk_type_row_bytes(t, cols, &rb);
    char *d = lk_xmalloc(rb * (size_t)rows);
    float *row = lk_xmalloc(sizeof(float) * (size_t)cols);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < cols; i++) row[i] = 0.02f * rnd();
        lk_quantize_row(t, row, d + (size_t)r * rb, cols);
    }
    free(row);
    return (lk_mat){ .type = t, .cols = cols, .rows = rows, .data = d, .row_stride = rb };
}

int main(int argc, char **argv) {
    const int ntok = argc > 1 ? atoi(argv[1]) : 64;
    lk_type wt = LK_TYPE_Q4_K;
    if (argc > 2 && !lk_type_from_name(argv[2], &wt)) { fprintf(stderr, "unknown type %s\n", argv[2]); return 2; }
    if (ntok < 1 || ntok > 4096) { fprintf(stderr, "ntok 1..4096\n"); return 2; }
    const int d = 4096, nk = 16, nv = 64, dk = 128, dv = 128, K = 4;
    const int64_t C = 2LL * nk * dk + (int64_t)nv * dv, VD = (int64_t)nv * dv;
    static lk_model m;
    m.cfg.ssm_conv = K, m.cfg.ssm_nk = nk, m.cfg.ssm_nv = nv, m.cfg.ssm_dk = dk, m.cfg.ssm_dv = dv, m.cfg.rms_eps = 1e-6f;
    m.nkl = nk, m.nvl = nv, m.n_rec = 1, m.max_seqs = 1, m.n_batch = ntok;
    m.rs_elems = (size_t)(K - 1) * (size_t)C + (size_t)nv * dk * dv;
    m.rstate = calloc(m.rs_elems, sizeof(float));
    lk_batch_item item = { 0, 0, ntok };
    int32_t row0[2] = { 0, ntok };
    m.items = &item, m.item_row0 = row0, m.n_items = 1, m.n_rows = ntok;
    m.dn_qkv = malloc(sizeof(float) * (size_t)ntok * C);
    m.dn_z = malloc(sizeof(float) * (size_t)ntok * VD);
    m.dn_ab = malloc(sizeof(float) * (size_t)ntok * 2 * nv);
    m.dn_o = malloc(sizeof(float) * (size_t)ntok * VD);
    float *dt = malloc(sizeof(float) * nv), *sa = malloc(sizeof(float) * nv), *nw = malloc(sizeof(float) * dv);
    for (int i = 0; i < nv; i++) dt[i] = rnd(), sa[i] = -0.05f - 0.4f * (rnd() + 1) / 2;
    for (int i = 0; i < dv; i++) nw[i] = 1 + 0.1f * rnd();
    layer_w w = { .ri = 0, .dt = dt, .ssm_a = sa, .ssm_norm = nw };
    for (int64_t i = 0; i < (int64_t)ntok * C; i++) m.dn_qkv[i] = rnd();
    for (int64_t i = 0; i < (int64_t)ntok * VD; i++) m.dn_z[i] = rnd();
    for (int64_t i = 0; i < (int64_t)ntok * 2 * nv; i++) m.dn_ab[i] = rnd();
    /* q and k L2-normalised, as conv_fn leaves them */
    for (int t = 0; t < ntok; t++)
        for (int h = 0; h < 2 * nk; h++) {
            float *x = m.dn_qkv + (size_t)t * C + (size_t)h * dk, ss = 0;
            for (int i = 0; i < dk; i++) ss += x[i] * x[i];
            for (int i = 0; i < dk; i++) x[i] /= sqrtf(ss + 1e-6f);
        }
    dn_job j = { &m, &w };
    double best_rec = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = lk_time_s();
        delta_fn(&j, 0, 1);
        best_rec = fmin(best_rec, lk_time_s() - t0);
    }
    /* the layer's projections: attn_qkv and attn_gate (d -> C + VD), ssm_out (VD -> d) */
    lk_pool *pool = lk_pool_create(1);
    lk_mat wqkv = rand_mat(wt, C, d), wz = rand_mat(wt, VD, d), wo = rand_mat(wt, d, VD);
    float *x = malloc(sizeof(float) * (size_t)ntok * d), *y = malloc(sizeof(float) * (size_t)ntok * C);
    for (int64_t i = 0; i < (int64_t)ntok * d; i++) x[i] = rnd();
    void *act = lk_xmalloc_aligned(lk_matmul_scratch_bytes(VD, ntok));
    double best_mm = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = lk_time_s();
        lk_matmul(pool, &wqkv, x, d, ntok, y, C, act);
        lk_matmul(pool, &wz, x, d, ntok, y, VD, act);
        lk_matmul(pool, &wo, m.dn_o, VD, ntok, y, d, act);
        best_mm = fmin(best_mm, lk_time_s() - t0);
    }
    printf("delta net, Qwen3.5-397B shape (64 value heads of 128x128 state), %d tokens, 1 thread (%s):\n"
           "  recurrence (delta_fn)       %8.3f ms  %7.1f us/token\n"
           "  projections (%s, 3 matmuls) %8.3f ms  %7.1f us/token\n"
           "  recurrence / projections: %.1f %%\n",
           ntok, lk_vec_simd_name(), best_rec * 1e3, best_rec * 1e6 / ntok, lk_type_name(wt), best_mm * 1e3,
           best_mm * 1e6 / ntok, 100 * best_rec / best_mm);
    lk_pool_free(pool);
    return 0;
}
