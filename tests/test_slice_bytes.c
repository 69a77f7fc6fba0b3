/* lk_model_slice_bytes: the bytes a slice reads. Checked by poisoning: a
 * copy of the file keeps only those bytes (plus nothing else: every other
 * byte is 0xff, NaN in every float and scale format), and a model loaded
 * from the copy with that slice must compute bit for bit what the same
 * slice computes over the real file. A byte the list misses would be read
 * as poison. Also: the identity's sampled bytes (lk_cluster_model_id_ranges)
 * suffice to recompute the model identity, and the range-list helpers. */
#include "lk_test.h"

#include <math.h>
#include <unistd.h>

#include "cluster/proto.h"
#include "model/model.h"

/* A copy of g's file holding only the listed bytes, the rest 0xff. */
static const char *poisoned_copy(const lk_gguf *g, const lk_ranges *l, char *path, size_t len) {
    snprintf(path, len, "/tmp/lk-slice-bytes-%d-XXXXXX", (int)getpid());
    int fd = mkstemp(path);
    LK_ASSERT(fd >= 0);
    uint64_t size = lk_gguf_file_size(g);
    uint8_t *b = malloc(size);
    memset(b, 0xff, size);
    const uint8_t *src = lk_gguf_file_bytes(g);
    for (int64_t i = 0; i < l->n; i++) memcpy(b + l->r[i].off, src + l->r[i].off, l->r[i].len);
    LK_ASSERT(write(fd, b, size) == (ssize_t)size);
    close(fd);
    free(b);
    return path;
}

/* Runs the slice's part of two forward passes, a 5-token prefill (the batch
 * kernels) then a 1-token step (the decode kernels): embed (first stage) or
 * fixed input rows, its layers, its logits (last stage). out gets the
 * hidden rows and the logits of both. */
static size_t run_slice(const lk_gguf *g, const lk_slice *s, float *out, char *err) {
    lk_model_params mp = {.n_ctx = 16, .n_batch = 8, .n_threads = 1};
    lk_model *m;
    if (lk_model_load(g, s, &mp, &m, err, LK_ERRLEN)) return 0;
    const lk_model_config *c = lk_model_cfg(m);
    int32_t toks[6] = {1, 7, 3, 11, (int32_t)(c->n_vocab - 1), 2};
    float *x = lk_model_hidden(m);
    size_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        int nt = pass ? 1 : 5, pos0 = pass ? 5 : 0;
        if (s->pp_rank == 0) lk_model_embed(m, toks + pos0, nt, x);
        else
            for (int64_t i = 0; i < nt * (int64_t)c->n_embd; i++) x[i] = sinf((float)(i + pos0) * 0.37f);
        lk_batch_item it = {0, pos0, nt};
        if (lk_model_batch(m, &it, 1, err, LK_ERRLEN)) { lk_model_free(m); return 0; }
        lk_model_layers(m, x);
        memcpy(out + n, x, (size_t)nt * c->n_embd * sizeof(float));
        n += (size_t)nt * c->n_embd;
        if (s->pp_rank == s->pp_size - 1) {
            int32_t last = nt - 1;
            lk_model_logits(m, x, &last, 1, out + n);
            n += (size_t)(s->vocab1 - s->vocab0);
        }
    }
    lk_model_free(m);
    return n;
}

/* Whether the (normalised) list holds any byte of [off, off + len). */
static bool holds_any(const lk_ranges *l, uint64_t off, uint64_t len) {
    for (int64_t i = 0; i < l->n; i++)
        if (l->r[i].off < off + len && off < l->r[i].off + l->r[i].len) return true;
    return false;
}

/* An expert-parallel slice reads every byte of the experts it holds and
 * not one byte of the others' slabs. */
static void check_expert_slabs(const lk_gguf *g, const lk_model_config *c, const lk_slice *s, const lk_ranges *l,
                               const char *what) {
    const char *names[3] = {"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"};
    for (int layer = s->layer0; layer < s->layer1; layer++) {
        if (!lk_model_layer_moe(c, layer)) continue;
        for (int k = 0; k < 3; k++) {
            char n[96];
            snprintf(n, sizeof n, "blk.%d.%s", layer, names[k]);
            const lk_gguf_tensor *t = lk_gguf_find_tensor(g, n);
            const uint64_t slab = t->nbytes / (uint64_t)c->n_expert, at = lk_gguf_data_offset(g) + t->offset;
            for (int e = 0; e < c->n_expert; e++) {
                const bool mine = e >= s->expert0 && e < s->expert1;
                bool all = false;
                for (int64_t i = 0; i < l->n && !all; i++)
                    all = l->r[i].off <= at + e * slab && at + (e + 1) * slab <= l->r[i].off + l->r[i].len;
                CHECKF(mine ? all : !holds_any(l, at + e * slab, slab), "%s: %s expert %d: %s", what, n, e,
                       mine ? "a held expert is not read whole" : "another rank's expert is read");
            }
        }
    }
}

static void check_model(const char *rel, int *layouts_checked, double *worst_fraction) {
    char err[LK_ERRLEN];
    lk_gguf *g;
    if (lk_gguf_open(lk_td(rel), &g, err, sizeof err)) { CHECKF(0, "%s", err); return; }
    lk_model_config cfg;
    LK_ASSERT(!lk_model_config_read(g, &cfg, err, sizeof err));
    lk_plan_dims d;
    lk_model_plan_dims(g, &cfg, &d);
    size_t cap = 6 * (size_t)cfg.n_embd + 2 * (size_t)cfg.n_vocab;
    float *a = malloc(cap * sizeof(float)), *b = malloc(cap * sizeof(float));
    /* tp, pp, expert parallelism (mixtures only) */
    const int layouts[][3] = {{1, 1, 0}, {2, 1, 0}, {3, 1, 0}, {4, 1, 0}, {1, 2, 0}, {2, 2, 0},
                              {2, 1, 1}, {3, 1, 1}, {2, 2, 1}};
    for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++) {
        int tp = layouts[k][0], pp = layouts[k][1], ep = layouts[k][2];
        lk_slice sl[8];
        if (lk_plan_make(&d, tp, pp, NULL, sl, err, sizeof err)) continue; /* too small to split so */
        if (ep && !cfg.n_expert) {
            CHECKF(lk_plan_experts(&d, tp, pp, NULL, sl, err, sizeof err) == LK_ERR_ARG && strstr(err, "dense"),
                   "%s: expert parallelism on a dense model: %s", rel, err);
            continue;
        }
        if (ep) CHECKF(lk_plan_experts(&d, tp, pp, NULL, sl, err, sizeof err) == LK_OK, "%s: %s", rel, err);
        for (int r = 0; r < tp * pp; r++) {
            lk_ranges l = {0};
            lk_status st = lk_model_slice_bytes(g, &sl[r], &l, err, sizeof err);
            CHECKF(!st, "%s tp %d pp %d%s rank %d: %s", rel, tp, pp, ep ? " ep" : "", r, err);
            if (ep) {
                char what[160];
                snprintf(what, sizeof what, "%s tp %d pp %d ep rank %d (experts %d-%d)", rel, tp, pp, r, sl[r].expert0,
                         sl[r].expert1 - 1);
                check_expert_slabs(g, &cfg, &sl[r], &l, what);
            }
            char path[128];
            poisoned_copy(g, &l, path, sizeof path);
            lk_gguf *pg;
            if (lk_gguf_open(path, &pg, err, sizeof err)) { CHECKF(0, "%s", err); unlink(path); lk_ranges_free(&l); continue; }
            size_t na = run_slice(g, &sl[r], a, err), nb = run_slice(pg, &sl[r], b, err);
            CHECKF(na && na == nb && !memcmp(a, b, na * sizeof(float)), "%s tp %d pp %d%s rank %d: the slice read bytes "
                   "outside its list (%zu vs %zu values)", rel, tp, pp, ep ? " ep" : "", r, na, nb);
            double frac = (double)lk_ranges_total(&l) / (double)lk_gguf_file_size(g);
            if (tp * pp >= 2 && frac > *worst_fraction) *worst_fraction = frac;
            if (tp * pp == 1) CHECKF(frac > 0.95, "%s: one rank reads only %.2f of the file", rel, frac);
            (*layouts_checked)++;
            lk_gguf_close(pg);
            unlink(path);
            lk_ranges_free(&l);
        }
    }
    /* the identity from the sampled bytes alone */
    lk_ranges l = {0};
    lk_cluster_model_id_ranges(g, &l);
    char path[128];
    poisoned_copy(g, &l, path, sizeof path);
    lk_gguf *pg;
    if (!lk_gguf_open(path, &pg, err, sizeof err)) {
        uint8_t ia[32], ib[32];
        lk_cluster_model_id(g, ia);
        lk_cluster_model_id(pg, ib);
        CHECKF(!memcmp(ia, ib, 32), "%s: identity from its sampled ranges differs", rel);
        lk_gguf_close(pg);
    } else CHECKF(0, "%s", err);
    unlink(path);
    lk_ranges_free(&l);
    free(a);
    free(b);
    lk_gguf_close(g);
}

TEST(slices_read_only_their_bytes) {
    const char *models[] = {"models/stories260K.gguf", "synth/synth-llama-q4_0.gguf", "synth/synth-llama-q4_k_m.gguf",
                            "synth/synth-qwen2-f32.gguf", "synth/synth-qwen3-q8_0.gguf",
                            "synth/synth-llama-tied-f16.gguf", "synth/synth-llama3rope-f32.gguf",
                            "synth/synth-qwen3moe-f16.gguf", "synth/synth-glm4moe-f16.gguf",
                            "synth/synth-deepseek2-f16.gguf", "synth/synth-deepseek2-q4_k_m.gguf",
                            "synth/synth-qwen35moe-f16.gguf", "synth/synth-qwen35moe-q4_k_m.gguf"};
    int checked = 0;
    double worst = 0;
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) check_model(models[i], &checked, &worst);
    CHECKF(checked >= 40, "only %d slices checked", checked);
    /* a split rank never needs the whole file */
    CHECKF(worst < 0.9, "a rank of a split reads %.2f of the file", worst);
    printf("# %d slices checked; the largest share of a file one rank of a split reads: %.2f\n", checked, worst);
}

TEST(range_helpers) {
    lk_ranges l = {0};
    lk_ranges_add(&l, 100, 50);
    lk_ranges_add(&l, 150, 10); /* touches: merged on add */
    lk_ranges_add(&l, 0, 10);
    lk_ranges_add(&l, 5, 10);   /* overlaps [0, 10) */
    lk_ranges_add(&l, 4096 * 3 + 1, 2);
    lk_ranges_add(&l, 7, 0);    /* empty: ignored */
    lk_ranges_normalize(&l);
    CHECK(l.n == 3 && l.r[0].off == 0 && l.r[0].len == 15 && l.r[1].off == 100 && l.r[1].len == 60 &&
          l.r[2].off == 4096 * 3 + 1);
    CHECK(lk_ranges_total(&l) == 15 + 60 + 2);
    CHECK(lk_ranges_disk(&l, 4096) == 2 * 4096); /* blocks 0 and 3 */
    lk_ranges_add(&l, 4095, 2); /* straddles blocks 0 and 1 */
    lk_ranges_normalize(&l);
    CHECK(lk_ranges_disk(&l, 4096) == 3 * 4096);
    lk_ranges_free(&l);
    CHECK(l.n == 0 && !l.r);
}

/* A slice from a peer that does not fit the model is an error, not a crash. */
TEST(bad_slices_refused) {
    char err[LK_ERRLEN];
    lk_gguf *g;
    if (lk_gguf_open(lk_td("synth/synth-llama-q4_0.gguf"), &g, err, sizeof err)) { CHECKF(0, "%s", err); return; }
    lk_model_config cfg;
    LK_ASSERT(!lk_model_config_read(g, &cfg, err, sizeof err));
    lk_plan_dims d;
    lk_model_plan_dims(g, &cfg, &d);
    lk_slice s;
    lk_slice_full(&d, &s);
    lk_ranges l = {0};
    lk_slice bad = s;
    bad.layer1 = cfg.n_layer + 1;
    CHECK(lk_model_slice_bytes(g, &bad, &l, err, sizeof err) == LK_ERR_ARG && strstr(err, "does not fit"));
    bad = s;
    bad.ff0 = 1; /* cuts ffn_down inside a Q4_0 block */
    CHECKF(lk_model_slice_bytes(g, &bad, &l, err, sizeof err) == LK_ERR_ARG && strstr(err, "inside a"), "%s", err);
    bad = s; /* experts on a dense model: the loader and the byte list both refuse it */
    bad.ep = true, bad.expert0 = 0, bad.expert1 = 1;
    CHECKF(lk_model_slice_bytes(g, &bad, &l, err, sizeof err) == LK_ERR_ARG && strstr(err, "expert"), "%s", err);
    lk_model *m = NULL;
    CHECKF(lk_model_load(g, &bad, NULL, &m, err, sizeof err) == LK_ERR_ARG && strstr(err, "dense"), "%s", err);
    lk_ranges_free(&l);
    lk_gguf_close(g);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    RUN(range_helpers);
    RUN(bad_slices_refused);
    RUN(slices_read_only_their_bytes);
    return lk_test_end();
}
