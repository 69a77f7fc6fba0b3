/* The batched engine (engine.h) on one node and on local clusters of real
 * processes: a sequence's logits do not depend on what else is in the step
 * (batch invariance, bit for bit), pipelined steps in flight give the
 * sequential tokens, shared prefixes (fork, copy on write) give the logits
 * of a fresh computation, bad steps are refused with a clear message, and
 * the head allocates nothing per step. */
#include "lk_test.h"
#include "engine/engine.h"
#include "gguf/gguf.h"

#include <jansson.h>

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define NV 512 /* stories260K */

static const int32_t P[4][6] = {{1, 403, 407, 261, 378, 7}, {1, 52, 99, 301, 12, 400},
                                {1, 7, 7, 7, 7, 7}, {1, 300, 200, 100, 50, 25}};

static lk_engine *open_engine(const char *model, int local, int tp, int pp, int max_seqs, int64_t kv, char *err) {
    lk_engine_opts o = {.model_path = lk_td(model), .n_threads = 1, .n_ctx = 128, .n_batch = 32, .max_seqs = max_seqs,
                        .kv_budget = kv, .local = local, .tp = tp, .pp = pp};
    lk_engine *e = NULL;
    if (lk_engine_open(&o, &e, err, LK_ERRLEN)) return NULL;
    return e;
}

/* Every slot greedy, asking each rank for all its vocabulary rows. */
static bool all_params(lk_engine *e, int n_cand, char *err) {
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    sp.temp = 0;
    for (int s = 0; s < lk_engine_max_seqs(e); s++)
        if (lk_engine_seq_params(e, s, &sp, n_cand, err, LK_ERRLEN)) return false;
    return true;
}

/* The merged candidates of item i as a full row of nv (NaN where missing). */
static void row_nv(lk_engine *e, int i, float *full, int nv) {
    const int32_t *ids;
    const float *vals;
    int n = lk_engine_candidates(e, i, &ids, &vals);
    for (int k = 0; k < nv; k++) full[k] = NAN;
    for (int k = 0; k < n; k++) full[ids[k]] = vals[k];
}
/* ... of stories260K's vocabulary */
static void row_of(lk_engine *e, int i, float *full) { row_nv(e, i, full, NV); }

static bool same_bits(const float *a, const float *b, int n) { return !memcmp(a, b, sizeof(float) * (size_t)n); }

/* Sequence 0's logits after its prompt and three decode tokens, alone, then
 * with other sequences beside it in every step (prompts of other lengths,
 * decode tokens of others), in several slot orders: the same bits. */
static void invariance(const char *model, int local, int tp, int pp) {
    char err[LK_ERRLEN];
    static float ref[4][NV], got[NV];
    for (int mode = 0; mode < 3; mode++) {
        lk_engine *e = open_engine(model, local, tp, pp, 4, 0, err);
        CHECKF(e != NULL, "%s: %s", model, err);
        if (!e) return;
        CHECK(all_params(e, NV, err));
        int32_t cur[4];
        /* mode 0: alone in slot 0; 1: with 3 others, first; 2: with 3 others, last, in slot 3 */
        const int me = mode == 2 ? 3 : 0;
        lk_engine_item it[4];
        int n = 0;
        if (mode == 2)
            for (int s = 0; s < 3; s++) it[n++] = (lk_engine_item){.seq = s, .n = 2 + s, .tokens = P[s + 1], .sample = true};
        it[n++] = (lk_engine_item){.seq = me, .n = 6, .tokens = P[0], .sample = true};
        if (mode == 1)
            for (int s = 1; s < 4; s++) it[n++] = (lk_engine_item){.seq = s, .n = 1 + s, .tokens = P[s], .sample = true};
        int32_t next[4];
        lk_status st = lk_engine_batch(e, it, n, next, err, LK_ERRLEN);
        CHECKF(st == LK_OK, "%s mode %d: %s", model, mode, err);
        if (st) { lk_engine_close(e); return; }
        int mine = mode == 2 ? n - 1 : 0;
        row_of(e, mine, got);
        if (mode == 0) memcpy(ref[0], got, sizeof got);
        else CHECKF(same_bits(ref[0], got, NV), "%s tp %d pp %d: prompt logits differ in a batch (mode %d)", model, tp, pp, mode);
        for (int i = 0; i < n; i++) cur[i] = next[i];
        for (int step = 1; step <= 3; step++) {
            for (int i = 0; i < n; i++) it[i] = (lk_engine_item){.seq = it[i].seq, .n = 1, .tokens = &cur[i], .sample = true};
            st = lk_engine_batch(e, it, n, next, err, LK_ERRLEN);
            CHECKF(st == LK_OK, "%s: %s", model, err);
            if (st) break;
            row_of(e, mine, got);
            if (mode == 0) memcpy(ref[step], got, sizeof got);
            else CHECKF(same_bits(ref[step], got, NV), "%s tp %d pp %d: decode %d logits differ in a batch (mode %d)", model,
                        tp, pp, step, mode);
            for (int i = 0; i < n; i++) cur[i] = next[i];
        }
        lk_engine_close(e);
    }
}

TEST(batch_invariance_one_node) {
    invariance("models/stories260K.gguf", 0, 0, 0);
    invariance("models/stories260K-q8_0.gguf", 0, 0, 0);
    invariance("models/stories260K-q4_0.gguf", 0, 0, 0);
}

TEST(batch_invariance_clusters) {
    invariance("models/stories260K.gguf", 2, 2, 1);
    invariance("models/stories260K.gguf", 2, 1, 2);
}

/* A sequence's logits do not depend on the thread count: 1 and 8 threads
 * split the matrices differently, and decode attention takes stories260K's
 * query heads two to a KV head at 1 thread, one at a time at 8 (one
 * sequence: head_groups in model.c keeps every thread a task). A 6-token
 * prompt, then 60 decode steps (past the first KV pages), the same bits
 * at every step; alone and beside a second sequence (two decode items). */
TEST(thread_count_invariance) {
    char err[LK_ERRLEN];
    enum { STEPS = 60 };
    static float ref[2][STEPS + 1][NV], got[NV];
    static const int threads[2] = {1, 8};
    for (int two = 0; two < 2; two++)
        for (int k = 0; k < 2; k++) {
            lk_engine_opts o = {.model_path = lk_td("models/stories260K.gguf"), .n_threads = threads[k], .n_ctx = 128,
                                .n_batch = 32, .max_seqs = 2};
            lk_engine *e = NULL;
            CHECKF(lk_engine_open(&o, &e, err, LK_ERRLEN) == LK_OK, "%d threads: %s", threads[k], err);
            if (!e) return;
            CHECK(all_params(e, NV, err));
            lk_engine_item it[2] = {{.seq = 0, .n = 6, .tokens = P[0], .sample = true},
                                    {.seq = 1, .n = 6, .tokens = P[1], .sample = true}};
            int32_t cur[2];
            lk_status st = lk_engine_batch(e, it, 1 + two, cur, err, LK_ERRLEN);
            for (int step = 0; step <= STEPS && !st; step++) {
                row_of(e, 0, got);
                if (k == 0) memcpy(ref[two][step], got, sizeof got);
                else if (!same_bits(ref[two][step], got, NV)) {
                    CHECKF(false, "%d sequences: step %d logits differ between 1 and 8 threads", 1 + two, step);
                    break;
                }
                if (step == STEPS) break;
                for (int i = 0; i <= two; i++) it[i] = (lk_engine_item){.seq = i, .n = 1, .tokens = &cur[i], .sample = true};
                st = lk_engine_batch(e, it, 1 + two, cur, err, LK_ERRLEN);
            }
            CHECKF(st == LK_OK, "%s", err);
            lk_engine_close(e);
        }
}

/* Long decode: one sequence past 1024 positions (8 key blocks of
 * attn_rows) on 1 and 8 threads, where head_groups cuts the head groups
 * differently. The logits of every step agree bit for bit, and the last
 * step's equal a fresh slot's prefill of the same tokens (decode gives
 * prefill's bits, whatever the blocks and tiles). Gemma 3's sliding-window
 * layers start their keys mid-block; DeepSeek's latent attention reads
 * its keys as rows. With an F16 cache too. */
enum { NVMAX = 1024 };
/* tokens [0, n) into slot seq in batches of 256, the last row sampled into *next */
static lk_status prefill_256(lk_engine *e, int seq, const int32_t *toks, int n, int32_t *next, char *err) {
    lk_status st = LK_OK;
    for (int at = 0; at < n && !st; at += 256) {
        lk_engine_item it = {.seq = seq, .n = LK_MIN(256, n - at), .tokens = toks + at, .sample = at + 256 >= n};
        st = lk_engine_batch(e, &it, 1, next, err, LK_ERRLEN);
    }
    return st;
}
static void long_same_bits(const char *model, int nv, bool kv_f16) {
    char err[LK_ERRLEN];
    enum { PROMPT = 1030, STEPS = 24, CTX = 1536 };
    static int32_t toks[PROMPT + STEPS + 1];
    static float ref[STEPS + 1][NVMAX], got[NVMAX], pre[NVMAX];
    uint32_t r = 12345;
    toks[0] = 1;
    for (int i = 1; i < PROMPT; i++) r = r * 1103515245u + 12345u, toks[i] = 3 + (int32_t)((r >> 8) % (uint32_t)(nv - 3));
    static const int threads[2] = {1, 8};
    for (int k = 0; k < 2; k++) {
        lk_engine_opts o = {.model_path = lk_td(model), .n_threads = threads[k], .n_ctx = CTX, .n_batch = 256,
                            .max_seqs = 2, .kv_f16 = kv_f16};
        lk_engine *e = NULL;
        CHECKF(lk_engine_open(&o, &e, err, LK_ERRLEN) == LK_OK, "%s, %d threads: %s", model, threads[k], err);
        if (!e) return;
        CHECK(all_params(e, nv, err));
        int32_t cur = 0;
        lk_status st = prefill_256(e, 0, toks, PROMPT, &cur, err);
        for (int step = 0; step <= STEPS && !st; step++) {
            row_nv(e, 0, got, nv);
            if (k == 0) memcpy(ref[step], got, sizeof got);
            else if (!same_bits(ref[step], got, nv)) {
                CHECKF(false, "%s: step %d (position %d) logits differ between 1 and 8 threads", model, step, PROMPT - 1 + step);
                break;
            }
            if (step == STEPS) break;
            toks[PROMPT + step] = cur;
            lk_engine_item it = {.seq = 0, .n = 1, .tokens = &cur, .sample = true};
            st = lk_engine_batch(e, &it, 1, &cur, err, LK_ERRLEN);
        }
        CHECKF(st == LK_OK, "%s: %s", model, err);
        if (k == 1 && !st) { /* slot 1 prefills what slot 0 decoded */
            int32_t c1;
            const int n = PROMPT + STEPS;
            st = prefill_256(e, 1, toks, n, &c1, err);
            CHECKF(st == LK_OK, "%s: %s", model, err);
            row_nv(e, 0, pre, nv);
            CHECKF(same_bits(pre, ref[STEPS], nv), "%s: a prefill to position %d differs from the decode's logits", model,
                   n - 1);
        }
        lk_engine_close(e);
    }
}
TEST(long_decode_same_bits) {
    long_same_bits("models/stories260K.gguf", NV, false);
    long_same_bits("models/stories260K.gguf", NV, true); /* F16 pages read by the kernels as they are */
    long_same_bits("synth/synth-gemma3-f16.gguf", 603, false);
    long_same_bits("synth/synth-deepseek2-f16.gguf", 601, false); /* MLA: the latent rows turned as read */
    long_same_bits("synth/synth-deepseek2-f16.gguf", 601, true);  /* ... widened first */
}

/* Copy on write: slot 1 forks slot 0's first 5 positions (the fifth page
 * position is mid-page, so the shared page is copied at the first write),
 * both continue differently; each gets the logits a fresh slot computes. */
TEST(fork_shares_prefix) {
    char err[LK_ERRLEN];
    lk_engine *e = open_engine("models/stories260K.gguf", 0, 0, 0, 3, 0, err);
    CHECKF(e != NULL, "%s", err);
    if (!e) return;
    CHECK(all_params(e, NV, err));
    static float a[NV], b[NV], fa[NV], fb[NV];
    int32_t next[2];
    lk_engine_item it = {.seq = 0, .n = 5, .tokens = P[0], .sample = false};
    CHECK(lk_engine_batch(e, &it, 1, next, err, LK_ERRLEN) == LK_OK);
    int64_t free0 = lk_engine_pages_free(e);
    CHECK(lk_engine_seq_fork(e, 1, 0, 5, err, LK_ERRLEN) == LK_OK);
    CHECK(lk_engine_pages_free(e) == free0); /* shared, not copied */
    CHECK(lk_engine_pages_needed(e, 1, 1) == 1); /* the shared page is copied at the first write */
    int32_t ta = 99, tb = 100;
    lk_engine_item two[2] = {{.seq = 0, .n = 1, .tokens = &ta, .sample = true}, {.seq = 1, .n = 1, .tokens = &tb, .sample = true}};
    CHECK(lk_engine_batch(e, two, 2, next, err, LK_ERRLEN) == LK_OK);
    row_of(e, 0, a);
    row_of(e, 1, b);
    /* fresh: slot 2 computes each continuation from scratch */
    int32_t seq_a[6], seq_b[6];
    memcpy(seq_a, P[0], 5 * sizeof(int32_t));
    memcpy(seq_b, P[0], 5 * sizeof(int32_t));
    seq_a[5] = ta;
    seq_b[5] = tb;
    lk_engine_item f = {.seq = 2, .n = 6, .tokens = seq_a, .sample = true};
    CHECK(lk_engine_batch(e, &f, 1, next, err, LK_ERRLEN) == LK_OK);
    row_of(e, 0, fa);
    CHECK(lk_engine_seq_keep(e, 2, 0, err, LK_ERRLEN) == LK_OK);
    f.tokens = seq_b;
    CHECK(lk_engine_batch(e, &f, 1, next, err, LK_ERRLEN) == LK_OK);
    row_of(e, 0, fb);
    CHECK(same_bits(a, fa, NV));
    CHECK(same_bits(b, fb, NV));
    /* keep 0 on every slot returns every page */
    for (int s = 0; s < 3; s++) CHECK(lk_engine_seq_keep(e, s, 0, err, LK_ERRLEN) == LK_OK);
    CHECK(lk_engine_pages_free(e) == lk_engine_pages_total(e));
    lk_engine_close(e);
}

/* Two micro-batches in flight on a 2-stage pipeline: the same tokens as one
 * step at a time on one node. */
TEST(pipeline_in_flight) {
    char err[LK_ERRLEN];
    int32_t want[4][12], got[4][12];
    for (int mode = 0; mode < 2; mode++) {
        lk_engine *e = mode ? open_engine("models/stories260K.gguf", 2, 1, 2, 4, 0, err)
                            : open_engine("models/stories260K.gguf", 0, 0, 0, 4, 0, err);
        CHECKF(e != NULL, "%s", err);
        if (!e) return;
        CHECK(all_params(e, 0, err));
        CHECK(lk_engine_depth(e) == (mode ? 2 : 1));
        int32_t (*out)[12] = mode ? got : want;
        int32_t cur[4];
        /* group g holds slots 2g, 2g+1 */
        for (int g = 0; g < 2; g++) {
            lk_engine_item it[2] = {{.seq = 2 * g, .n = 6, .tokens = P[2 * g], .sample = true},
                                    {.seq = 2 * g + 1, .n = 6, .tokens = P[2 * g + 1], .sample = true}};
            CHECK(lk_engine_batch(e, it, 2, cur + 2 * g, err, LK_ERRLEN) == LK_OK);
        }
        for (int s = 0; s < 4; s++) out[s][0] = cur[s];
        for (int k = 1; k < 12; k++) {
            lk_engine_item it[2][2];
            for (int g = 0; g < 2; g++)
                for (int j = 0; j < 2; j++)
                    it[g][j] = (lk_engine_item){.seq = 2 * g + j, .n = 1, .tokens = &cur[2 * g + j], .sample = true};
            lk_status st = LK_OK;
            int32_t nx[2][2];
            if (mode) { /* both groups in flight, then collected oldest first */
                st = lk_engine_submit(e, it[0], 2, err, LK_ERRLEN);
                if (!st) st = lk_engine_submit(e, it[1], 2, err, LK_ERRLEN);
                if (!st) st = lk_engine_collect(e, nx[0], err, LK_ERRLEN);
                if (!st) st = lk_engine_collect(e, nx[1], err, LK_ERRLEN);
            } else {
                st = lk_engine_batch(e, it[0], 2, nx[0], err, LK_ERRLEN);
                if (!st) st = lk_engine_batch(e, it[1], 2, nx[1], err, LK_ERRLEN);
            }
            CHECKF(st == LK_OK, "%s", err);
            if (st) break;
            for (int g = 0; g < 2; g++)
                for (int j = 0; j < 2; j++) cur[2 * g + j] = out[2 * g + j][k] = nx[g][j];
        }
        lk_engine_close(e);
    }
    CHECK(!memcmp(want, got, sizeof want));
}

/* Bad steps are refused before anything is sent, naming what was wrong;
 * the engine goes on working afterwards. */
TEST(bad_steps_refused) {
    char err[LK_ERRLEN];
    lk_engine *e = open_engine("models/stories260K.gguf", 2, 2, 1, 2, 64, err); /* 64 positions: 2 pages */
    CHECKF(e != NULL, "%s", err);
    if (!e) return;
    CHECK(all_params(e, 0, err));
    int32_t t[40] = {1, 2, 3}, bad = 600, next[2];
    struct { lk_engine_item it[2]; int n; const char *want; } cases[] = {
        {{{.seq = 5, .n = 1, .tokens = t}}, 1, "slot 5 out of range"},
        {{{.seq = 0, .n = 1, .tokens = t}, {.seq = 0, .n = 1, .tokens = t}}, 2, "appears twice"},
        {{{.seq = 0, .n = 1, .tokens = &bad}}, 1, "outside the vocabulary"},
        {{{.seq = 0, .n = 33, .tokens = t}}, 1, "the batch holds 32"},
        {{{.seq = 0, .n = 0, .tokens = t}}, 1, "no tokens"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        err[0] = 0;
        lk_status st = lk_engine_batch(e, cases[k].it, cases[k].n, next, err, LK_ERRLEN);
        CHECKF(st != LK_OK && strstr(err, cases[k].want), "case %zu: %s", k, err);
    }
    /* the KV budget: two slots of 32 positions fill both pages */
    lk_engine_item a = {.seq = 0, .n = 32, .tokens = t, .sample = false}, b = {.seq = 1, .n = 1, .tokens = t, .sample = true};
    CHECK(lk_engine_batch(e, &a, 1, next, err, LK_ERRLEN) == LK_OK);
    a.n = 1;
    CHECK(lk_engine_batch(e, &b, 1, next, err, LK_ERRLEN) == LK_OK);
    lk_status st = lk_engine_batch(e, &a, 1, next, err, LK_ERRLEN);
    CHECKF(st != LK_OK && strstr(err, "KV cache full"), "%s", err);
    CHECK(lk_engine_seq_keep(e, 0, 99, err, LK_ERRLEN) != LK_OK && strstr(err, "holds 32 positions"));
    /* still working */
    CHECK(lk_engine_seq_keep(e, 0, 0, err, LK_ERRLEN) == LK_OK);
    st = lk_engine_batch(e, &b, 1, next, err, LK_ERRLEN);
    CHECKF(st == LK_OK && next[0] >= 0 && next[0] < NV, "%s", err);
    lk_engine_close(e);
}

/* The head allocates nothing per step: four sequences decoding together on
 * a 2-rank TP cluster and on a 2-stage pipeline (both in flight), counted
 * through the linker's --wrap (local workers are children of this process
 * and count their own). */
TEST(no_allocation_per_step) {
    char err[LK_ERRLEN];
    struct { int local, tp, pp; } L[3] = {{0, 0, 0}, {2, 2, 1}, {2, 1, 2}};
    for (int k = 0; k < 3; k++) {
        lk_engine *e = open_engine("models/stories260K.gguf", L[k].local, L[k].tp, L[k].pp, 4, 0, err);
        CHECKF(e != NULL, "%s", err);
        if (!e) return;
        CHECK(all_params(e, 0, err));
        int32_t cur[4];
        lk_engine_item it[4];
        for (int s = 0; s < 4; s++) it[s] = (lk_engine_item){.seq = s, .n = 6, .tokens = P[s], .sample = true};
        CHECK(lk_engine_batch(e, it, 4, cur, err, LK_ERRLEN) == LK_OK);
        long before = lk_test_allocs();
        lk_status st = LK_OK;
        for (int step = 0; step < 40 && !st; step++) {
            for (int s = 0; s < 4; s++) it[s] = (lk_engine_item){.seq = s, .n = 1, .tokens = &cur[s], .sample = true};
            if (lk_engine_depth(e) > 1) {
                st = lk_engine_submit(e, it, 2, err, LK_ERRLEN);
                if (!st) st = lk_engine_submit(e, it + 2, 2, err, LK_ERRLEN);
                if (!st) st = lk_engine_collect(e, cur, err, LK_ERRLEN);
                if (!st) st = lk_engine_collect(e, cur + 2, err, LK_ERRLEN);
            } else {
                st = lk_engine_batch(e, it, 4, cur, err, LK_ERRLEN);
            }
        }
        long after = lk_test_allocs();
        CHECKF(st == LK_OK, "%s", err);
        CHECKF(after == before, "local %d tp %d pp %d: %ld allocations in 40 steps of 4 sequences", L[k].local, L[k].tp,
               L[k].pp, after - before);
        lk_engine_close(e);
    }
}

/* A copy of stories260K with a NaN in one F32 tensor. */
static bool nan_copy(const char *tensor, char *path, size_t cap) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(lk_td("models/stories260K.gguf"), &g, err, sizeof err) != LK_OK) return false;
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, tensor);
    uint64_t at = lk_gguf_data_offset(g) + t->offset;
    snprintf(path, cap, "/tmp/lk-nan-%d.gguf", (int)getpid());
    FILE *f = fopen(path, "wb");
    fwrite(lk_gguf_file_bytes(g), 1, lk_gguf_file_size(g), f);
    float nan = NAN;
    fseek(f, (long)at + 4 * 3, SEEK_SET);
    fwrite(&nan, 4, 1, f);
    fclose(f);
    lk_gguf_close(g);
    return true;
}

/* A model holding a NaN: the step fails naming the slot, the position and
 * where it first appeared (the layer and its part, an earlier pipeline
 * stage, or the output norm after finite layers), on one node and through
 * workers, instead of sampling. */
TEST(non_finite_logits_named) {
    static const struct { const char *tensor; int tp, pp; const char *where; } cases[] = {
        {"output_norm.weight", 0, 0, "every layer's output was finite"},
        {"output_norm.weight", 2, 1, "every layer's output was finite"},
        {"blk.2.ffn_down.weight", 0, 0, "first non-finite after layer 2's FFN"},
        {"blk.1.attn_output.weight", 2, 1, "first non-finite after layer 1's attention"},
        {"blk.1.ffn_down.weight", 1, 2, "came non-finite from the pipeline stage before layer 3"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char err[LK_ERRLEN], path[64];
        CHECK(nan_copy(cases[c].tensor, path, sizeof path));
        int local = cases[c].tp ? 2 : 0;
        lk_engine_opts o = {.model_path = path, .n_threads = 1, .n_ctx = 64, .n_batch = 16, .max_seqs = 1, .local = local,
                            .tp = cases[c].tp, .pp = cases[c].pp};
        lk_engine *e = NULL;
        CHECKF(lk_engine_open(&o, &e, err, sizeof err) == LK_OK, "%s", err);
        if (e) {
            CHECK(all_params(e, 0, err));
            lk_engine_item it = {.seq = 0, .n = 5, .tokens = P[0], .sample = true};
            int32_t next;
            err[0] = 0;
            lk_status st = lk_engine_batch(e, &it, 1, &next, err, sizeof err);
            CHECKF(st != LK_OK && strstr(err, "non-finite logit") && strstr(err, "slot 0 at position 4") &&
                   strstr(err, cases[c].where), "%s tp %d pp %d: %s", cases[c].tensor, cases[c].tp, cases[c].pp, err);
            lk_engine_close(e);
        }
        unlink(path);
    }
}

/* Logprobs over the whole vocabulary with few candidates: a slot given an
 * explicit candidate count gets the log-sum-exp of every rank's rows, so
 * vals - lse are log-probabilities. Checked against llama.cpp's final
 * logits of the reference prompt (all 512), with 8 candidates per rank (so
 * normalising over the candidates alone would be far off), one node and
 * tp 2 / pp 2 clusters; a slot without an explicit count gets NaN. */
static void lse_case(int local, int tp, int pp, const json_t *c) {
    char err[LK_ERRLEN];
    lk_engine *e = open_engine("models/stories260K.gguf", local, tp, pp, 2, 0, err);
    CHECKF(e != NULL, "%s", err);
    if (!e) return;
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    sp.temp = 0;
    CHECK(lk_engine_seq_params(e, 0, &sp, 8, err, LK_ERRLEN) == LK_OK);
    CHECK(lk_engine_seq_params(e, 1, &sp, 0, err, LK_ERRLEN) == LK_OK);
    const json_t *ptoks = json_object_get(c, "prompt_token_ids"), *fl = json_object_get(c, "final_logits");
    int32_t toks[64];
    int n = (int)json_array_size(ptoks);
    for (int i = 0; i < n && i < 64; i++) toks[i] = (int32_t)json_integer_value(json_array_get(ptoks, (size_t)i));
    double mx = -INFINITY, sum = 0;
    for (size_t v = 0; v < json_array_size(fl); v++) mx = fmax(mx, json_number_value(json_array_get(fl, v)));
    for (size_t v = 0; v < json_array_size(fl); v++) sum += exp(json_number_value(json_array_get(fl, v)) - mx);
    const double want = mx + log(sum);
    lk_engine_item it[2] = {{.seq = 0, .n = n, .tokens = toks, .sample = true}, {.seq = 1, .n = n, .tokens = toks, .sample = true}};
    int32_t next[2];
    lk_status st = lk_engine_batch(e, it, 2, next, err, LK_ERRLEN);
    CHECKF(st == LK_OK, "%s", err);
    if (!st) {
        const int32_t *ids;
        const float *vals;
        int k = lk_engine_candidates(e, 0, &ids, &vals);
        double lse = lk_engine_candidates_lse(e, 0);
        CHECKF(k == 8 && fabs(lse - want) < 2e-3, "local %d tp %d pp %d: %d candidates, lse %.5f, llama.cpp's %.5f",
               local, tp, pp, k, lse, want);
        for (int j = 0; j < k; j++) {
            double ref = json_number_value(json_array_get(fl, (size_t)ids[j])) - want;
            CHECKF(fabs((vals[j] - lse) - ref) < 2e-3, "token %d: logprob %.5f, llama.cpp's %.5f", ids[j], vals[j] - lse, ref);
        }
        CHECKF(isnan(lk_engine_candidates_lse(e, 1)), "a slot without explicit candidates got lse %g", lk_engine_candidates_lse(e, 1));
    }
    lk_engine_close(e);
}

TEST(logprobs_whole_vocabulary) {
    json_error_t je;
    json_t *ref = json_load_file(lk_td("reference/stories260K.json"), JSON_ALLOW_NUL, &je);
    CHECKF(ref != NULL, "reference: %s", je.text);
    if (!ref) return;
    const json_t *c = json_array_get(json_object_get(ref, "cases"), 0);
    lse_case(0, 0, 0, c);
    lse_case(2, 2, 1, c);
    lse_case(2, 1, 2, c);
    json_decref(ref);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    lk_log_set_level(LK_LOG_ERROR);
    RUN(batch_invariance_one_node);
    RUN(batch_invariance_clusters);
    RUN(thread_count_invariance);
    RUN(long_decode_same_bits);
    RUN(fork_shares_prefix);
    RUN(pipeline_in_flight);
    RUN(bad_steps_refused);
    RUN(no_allocation_per_step);
    RUN(non_finite_logits_named);
    RUN(logprobs_whole_vocabulary);
    return lk_test_end();
}
