/* The plan on stories260K's dimensions (8 heads / 4 KV heads, n_ff 172,
 * vocab 512, 5 layers: read from the real file's metadata here, so the test
 * follows the model), with expected splits worked out by hand, plus the
 * invariants every plan must keep. */
#include "lk_test.h"
#include "gguf/gguf.h"
#include "parallel/parallel.h"

static lk_plan_dims stories(void) {
    lk_plan_dims d = {.n_layer = 5, .n_head = 8, .n_head_kv = 4, .n_ff = 172, .n_vocab = 512,
                      .head_align = 1, .ff_align = 1, .vocab_align = 1};
    lk_gguf *g;
    char err[LK_ERRLEN];
    if (lk_gguf_open(lk_td("models/stories260K.gguf"), &g, err, sizeof err) == LK_OK) {
        int64_t v;
        if (lk_gguf_get_i64(g, "llama.block_count", &v)) d.n_layer = (int)v;
        if (lk_gguf_get_i64(g, "llama.attention.head_count", &v)) d.n_head = (int)v;
        if (lk_gguf_get_i64(g, "llama.attention.head_count_kv", &v)) d.n_head_kv = (int)v;
        if (lk_gguf_get_i64(g, "llama.feed_forward_length", &v)) d.n_ff = v;
        const lk_gguf_tensor *t = lk_gguf_find_tensor(g, "output.weight");
        if (!t) t = lk_gguf_find_tensor(g, "token_embd.weight");
        if (t) d.n_vocab = (int64_t)t->ne[1];
        lk_gguf_close(g);
    } else {
        printf("  (no %s: %s; using the known dimensions)\n", lk_td("models/stories260K.gguf"), err);
    }
    return d;
}

/* Invariants: ranges tile the model, every part non-empty and aligned, KV
 * heads cover exactly the heads' groups, rank numbering pp*tp + tp_rank. */
static void check_invariants(const lk_plan_dims *d, int tp, int pp, const lk_slice *s) {
    int g = d->n_head / d->n_head_kv;
    for (int p = 0; p < pp; p++) {
        for (int t = 0; t < tp; t++) {
            const lk_slice *x = &s[p * tp + t];
            CHECK(x->tp_rank == t && x->tp_size == tp && x->pp_rank == p && x->pp_size == pp);
            CHECK(x->layer0 < x->layer1 && x->head0 < x->head1 && x->ff0 < x->ff1 && x->vocab0 < x->vocab1);
            CHECK(x->layer0 == (p ? s[(p - 1) * tp].layer1 : 0));
            CHECK(x->head0 == (t ? x[-1].head1 : 0) && x->ff0 == (t ? x[-1].ff1 : 0) &&
                  x->vocab0 == (t ? x[-1].vocab1 : 0));
            CHECK(x->head0 % d->head_align == 0 && x->ff0 % d->ff_align == 0 && x->vocab0 % d->vocab_align == 0);
            CHECK(x->kv_head0 == x->head0 / g && x->kv_head1 == (x->head1 + g - 1) / g);
            /* same TP split on every stage */
            CHECK(x->head0 == s[t].head0 && x->ff1 == s[t].ff1 && x->vocab1 == s[t].vocab1);
        }
        const lk_slice *last = &s[p * tp + tp - 1];
        CHECK(last->head1 == d->n_head && last->ff1 == d->n_ff && last->vocab1 == d->n_vocab);
    }
    CHECK(s[(pp - 1) * tp].layer1 == d->n_layer);
}

TEST(stories_dims) {
    lk_plan_dims d = stories();
    CHECK(d.n_layer == 5 && d.n_head == 8 && d.n_head_kv == 4 && d.n_ff == 172 && d.n_vocab == 512);
}

TEST(full) {
    lk_plan_dims d = stories();
    lk_slice s;
    lk_slice_full(&d, &s);
    CHECK(s.tp_size == 1 && s.pp_size == 1 && s.layer1 == 5 && s.head1 == 8 && s.kv_head1 == 4 && s.ff1 == 172 &&
          s.vocab1 == 512 && s.head0 == 0 && s.ff0 == 0);
}

TEST(tp_splits) {
    lk_plan_dims d = stories();
    char err[LK_ERRLEN];
    lk_slice s[16];
    for (int tp = 2; tp <= 4; tp++) {
        CHECKF(lk_plan_make(&d, tp, 1, NULL, s, err, sizeof err) == LK_OK, "tp %d: %s", tp, err);
        check_invariants(&d, tp, 1, s);
    }
    /* tp 2: halves; KV heads 2 each. */
    lk_plan_make(&d, 2, 1, NULL, s, err, sizeof err);
    CHECK(s[0].head1 == 4 && s[0].kv_head0 == 0 && s[0].kv_head1 == 2 && s[1].kv_head0 == 2 && s[1].kv_head1 == 4);
    CHECK(s[0].ff1 == 86 && s[0].vocab1 == 256);
    /* tp 3: heads move in whole KV groups of 2: 4 groups -> 1,2,1 (cuts at
     * round(4/3)=1, round(8/3)=3), so no KV head is stored twice; FFN rows
     * cut at round(172/3)=57 and round(344/3)=115. */
    lk_plan_make(&d, 3, 1, NULL, s, err, sizeof err);
    CHECK(s[0].head0 == 0 && s[0].head1 == 2 && s[1].head1 == 6 && s[2].head1 == 8);
    CHECK(s[0].kv_head1 == 1 && s[1].kv_head0 == 1 && s[1].kv_head1 == 3 && s[2].kv_head0 == 3);
    CHECK(s[0].ff1 == 57 && s[1].ff1 == 115 && s[2].ff1 == 172);
    CHECK(s[0].vocab1 == 171 && s[1].vocab1 == 341);
    /* tp 4: one KV head each. */
    lk_plan_make(&d, 4, 1, NULL, s, err, sizeof err);
    for (int t = 0; t < 4; t++) CHECK(s[t].head0 == 2 * t && s[t].kv_head0 == t && s[t].kv_head1 == t + 1);
    /* tp 8: more ranks than KV heads: one query head each, KV heads shared
     * by pairs (replicated). */
    CHECK(lk_plan_make(&d, 8, 1, NULL, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 8, 1, s);
    for (int t = 0; t < 8; t++) CHECK(s[t].head0 == t && s[t].kv_head0 == t / 2 && s[t].kv_head1 == t / 2 + 1);
}

TEST(pp_and_combined) {
    lk_plan_dims d = stories();
    char err[LK_ERRLEN];
    lk_slice s[16];
    CHECK(lk_plan_make(&d, 1, 2, NULL, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 1, 2, s);
    CHECK(s[0].layer1 == 3 && s[1].layer0 == 3); /* round(5/2) = 3 */
    CHECK(lk_plan_make(&d, 1, 3, NULL, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 1, 3, s);
    CHECK(s[0].layer1 == 2 && s[1].layer1 == 3 && s[2].layer1 == 5); /* round(5/3)=2, round(10/3)=3 */
    CHECK(lk_plan_make(&d, 2, 2, NULL, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 2, 2, s);
    CHECK(s[3].pp_rank == 1 && s[3].tp_rank == 1 && s[3].layer0 == 3 && s[3].head0 == 4);
    CHECK(lk_plan_make(&d, 3, 3, NULL, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 3, 3, s);
    int layers[3] = {1, 1, 3};
    CHECK(lk_plan_make_split(&d, 2, 3, NULL, layers, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 2, 3, s);
    CHECK(s[0].layer1 == 1 && s[2].layer0 == 1 && s[2].layer1 == 2 && s[4].layer0 == 2 && s[5].layer1 == 5);
}

TEST(uneven_weights) {
    lk_plan_dims d = stories();
    char err[LK_ERRLEN];
    lk_slice s[4];
    double w[3] = {2, 1, 1};
    CHECK(lk_plan_make(&d, 3, 1, w, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 3, 1, s);
    /* half to rank 0: 2 of 4 KV groups, 86 of 172 rows, 256 of 512 */
    CHECK(s[0].head1 == 4 && s[1].head1 == 6 && s[0].ff1 == 86 && s[1].ff1 == 129 && s[0].vocab1 == 256 &&
          s[1].vocab1 == 384);
    /* A tiny weight still gets one unit. */
    double w2[2] = {1000, 1};
    CHECK(lk_plan_make(&d, 2, 1, w2, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 2, 1, s);
    CHECK(s[1].head0 == 6 && s[1].head1 == 8 && s[1].ff0 == 171);
}

TEST(alignment) {
    lk_plan_dims d = stories();
    d.ff_align = 32; /* e.g. Q4_0 ffn_down: 172 rows -> 6 blocks (the last one short) */
    d.head_align = 2;
    char err[LK_ERRLEN];
    lk_slice s[4];
    CHECK(lk_plan_make(&d, 3, 1, NULL, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 3, 1, s);
    CHECK(s[0].ff1 == 64 && s[1].ff1 == 128 && s[2].ff1 == 172);
    CHECK(lk_plan_make(&d, 4, 1, NULL, s, err, sizeof err) == LK_OK);
    check_invariants(&d, 4, 1, s);
}

TEST(impossible) {
    lk_plan_dims d = stories();
    char err[LK_ERRLEN] = "";
    lk_slice s[64];
    /* 9 ranks over 8 heads: the last rank holds FFN rows only */
    CHECK(lk_plan_make(&d, 9, 1, NULL, s, err, sizeof err) == LK_OK);
    CHECK(s[8].head0 == s[8].head1 && s[8].ff1 > s[8].ff0);
    /* 8 heads + 172 FFN rows are 180 units of work: 200 ranks cannot all work */
    CHECK(lk_plan_make(&d, 200, 1, NULL, s, err, sizeof err) == LK_ERR_ARG);
    CHECKF(strstr(err, "--tp 200") && strstr(err, "heads"), "%s", err);
    CHECK(lk_plan_make(&d, 1, 6, NULL, s, err, sizeof err) == LK_ERR_ARG);
    CHECKF(strstr(err, "--pp 6") && strstr(err, "5 layers"), "%s", err);
    int bad[2] = {2, 2};
    CHECK(lk_plan_make_split(&d, 1, 2, NULL, bad, s, err, sizeof err) == LK_ERR_ARG);
    CHECKF(strstr(err, "4 layers") && strstr(err, "has 5"), "%s", err);
    int zero[2] = {5, 0};
    CHECK(lk_plan_make_split(&d, 1, 2, NULL, zero, s, err, sizeof err) == LK_ERR_ARG);
    double w[2] = {1, -1};
    CHECK(lk_plan_make(&d, 2, 1, w, s, err, sizeof err) == LK_ERR_ARG);
    CHECKF(strstr(err, "weight 2"), "%s", err);
    lk_plan_dims q = d;
    q.ff_align = 64;   /* 172 rows -> 3 blocks */
    q.head_align = 8;  /* 8 heads -> 1 group */
    CHECK(lk_plan_make(&q, 5, 1, NULL, s, err, sizeof err) == LK_ERR_ARG); /* 4 units of work for 5 ranks */
    CHECKF(strstr(err, "FFN") && strstr(err, "heads"), "%s", err);
    /* 1 head group + 3 FFN blocks over 2 ranks: rank 0 takes the heads,
     * rank 1 (no heads) the larger FFN share; nobody is idle */
    CHECK(lk_plan_make(&q, 2, 1, NULL, s, err, sizeof err) == LK_OK);
    CHECK(s[0].head0 == 0 && s[0].head1 == 8 && s[1].head0 == s[1].head1 && s[1].kv_head0 == s[1].kv_head1);
    CHECKF(s[0].ff1 - s[0].ff0 == 64 && s[1].ff0 == 64 && s[1].ff1 == 172, "ff %lld-%lld %lld-%lld",
           (long long)s[0].ff0, (long long)s[0].ff1, (long long)s[1].ff0, (long long)s[1].ff1);
    q = d;
    q.head_align = 3; /* 8 heads -> 3 groups */
    CHECK(lk_plan_make(&q, 3, 1, NULL, s, err, sizeof err) == LK_OK);
    CHECK(lk_plan_make(&d, 0, 1, NULL, s, err, sizeof err) == LK_ERR_ARG);
}

int main(void) {
    RUN(stories_dims);
    RUN(full);
    RUN(tp_splits);
    RUN(pp_and_combined);
    RUN(uneven_weights);
    RUN(alignment);
    RUN(impossible);
    return lk_test_end();
}
