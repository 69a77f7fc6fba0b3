/* qwen35moe — the hybrid of gated delta net (linear attention with a
 * per-sequence recurrent state) and gated full attention, every layer a MoE
 * with a sigmoid-gated shared expert — against llama.cpp
 * (../shared/testdata/synth, README section "Hybrid recurrent MoE and
 * sliding-window attention"): prompt logits, router logits, weights and the
 * shared expert's gate within the README's tolerances, expert sets by the
 * gap rule (a legitimate branch ends the comparison of that prompt: the
 * state carries it to every later position), greedy tokens up to the first
 * near-tie; the grouped V-head pairing (h div 2 instead of the tiled h mod
 * 2) must be caught; sequences batched together, one freed and its slot
 * reused, each give the bits they get alone; the state's keep/fork rules;
 * the qwen35 pre-tokenizer's combining marks.
 *
 * The reference machinery (gap rule, comparable steps, CLI layouts) is
 * test_moe's too: lk_ref_moe.h. */
#include "lk_test.h"

#include "lk_ref_moe.h"

#include "model/model_impl.h"
#include "tokenizer/pretokenize.h"

/* README "suggested tolerances": F16 with F16-rounded activations max 2e-2,
 * router logits 5e-2, weights 5e-3 (the gap tolerance is the router's). */
static const moe_case q35_f16 = { "synth/synth-qwen35moe-f16.gguf", "synth/synth-qwen35moe-f16.json",
                                  2e-2, 5e-3, 5e-2, 5e-2, 5e-3, 8, 0, 0, 0 };
/* Q4_K_M with ggml-exact activation quantisation: max 0.5, router logits
 * 0.05 (README). Its suggested median, 1e-2, is below what llama.cpp's own
 * exact-kernel variants give against the reference (largest per-prompt
 * median 0.019 for ubatch_1 and no_repack, 0.022 for f16_kv); lockstep
 * lands at 0.019 (prompt 3; 2026-12-01, AVX2), so the median bound is 3e-2. */
static const moe_case q35_q4km = { "synth/synth-qwen35moe-q4_k_m.gguf", "synth/synth-qwen35moe-q4_k_m.json",
                                   0.5, 3e-2, 5e-2, 5e-2, 0.05, 4, 0.05, 0, 0 };

TEST(qwen35moe_f16_reference) { check_moe(&q35_f16, 1); }
TEST(qwen35moe_f16_two_threads) { check_moe(&q35_f16, 2); }
TEST(qwen35moe_q4_k_m_reference) { check_moe(&q35_q4km, 2); }

static lk_model *load_model(const char *rel, lk_gguf **g, int n_ctx, int n_batch, int seqs) {
    char err[LK_ERRLEN];
    *g = NULL;
    if (lk_gguf_open(lk_td(rel), g, err, sizeof err)) { CHECKF(0, "%s", err); return NULL; }
    lk_model_params mp = { .n_ctx = n_ctx, .n_batch = n_batch, .max_seqs = seqs, .n_threads = 2 };
    lk_model *m = NULL;
    CHECKF(lk_model_load(*g, NULL, &mp, &m, err, sizeof err) == LK_OK, "%s", err);
    if (!m) { lk_gguf_close(*g); *g = NULL; }
    return m;
}

/* The shared expert's sigmoid gate per prompt position and layer, against
 * the JSON's shared_expert_gate (README: <= 5e-3), up to each prompt's
 * first routing difference. */
TEST(qwen35moe_shared_expert_gate) {
    lk_gguf *g;
    lk_model *m = load_model(q35_f16.gguf, &g, 512, 64, 1);
    json_t *ref = lk_ref_load(q35_f16.json);
    if (!m || !ref) { json_decref(ref); if (m) { lk_model_free(m); lk_gguf_close(g); } return; }
    trace_buf tb;
    trace_init(&tb, m);
    float *sg = calloc((size_t)tb.n_layer * tb.n_batch, sizeof(float));
    lk_route_trace rt = { tb.logits, tb.experts, tb.weights, sg };
    lk_model_trace_routing(m, &rt);
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    double worst = 0, lo = 1, hi = 0;
    int compared = 0;
    size_t ci;
    json_t *c;
    json_array_foreach(json_object_get(ref, "cases"), ci, c) {
        int n;
        free(lk_ref_prompt_pass(lk_ref_model_fwd, m, nv, c, &n));
        json_t *pr = json_object_get(c, "prompt_routing");
        for (int i = 0; i < n; i++) {
            bool same = true;
            size_t li;
            json_t *L;
            json_array_foreach(pr, li, L) {
                int layer = (int)json_integer_value(json_object_get(L, "layer"));
                same &= same_experts(tb.experts + ((size_t)layer * tb.n_batch + i) * tb.k,
                                     json_array_get(json_object_get(L, "experts"), (size_t)i), tb.k);
            }
            if (!same) break;
            json_array_foreach(pr, li, L) {
                int layer = (int)json_integer_value(json_object_get(L, "layer"));
                double want = lk_ref_num(json_object_get(L, "shared_expert_gate"), (size_t)i),
                       got = sg[(size_t)layer * tb.n_batch + i];
                worst = fmax(worst, fabs(got - want));
                lo = fmin(lo, got), hi = fmax(hi, got);
                compared++;
            }
        }
    }
    CHECKF(compared >= 100, "only %d gates compared", compared);
    CHECKF(worst <= 5e-3, "shared-expert gate differs by %.3g > 5e-3", worst);
    printf("  shared-expert gate: %d (position, layer) compared, max |d| %.2e, range %.2f..%.2f\n", compared, worst, lo, hi);
    free(sg);
    trace_free(&tb);
    lk_model_free(m);
    lk_gguf_close(g);
    json_decref(ref);
}

/* README "must not match": value head h paired with key head h div 2 (the
 * HF checkpoint's grouped order) instead of the tiled h mod 2. With that
 * knob lockstep must leave the reference by far and instead give
 * llama.cpp's own grouped-order run (the JSON's v_heads_grouped_order: a
 * file permuted so that its tiled pairing is the grouped one), token for
 * token through that run's first departure from the correct one. */
TEST(qwen35moe_grouped_pairing_is_caught) {
    lk_gguf *g;
    lk_model *m = load_model(q35_f16.gguf, &g, 512, 64, 1);
    json_t *ref = lk_ref_load(q35_f16.json);
    if (!m || !ref) { json_decref(ref); if (m) { lk_model_free(m); lk_gguf_close(g); } return; }
    m->dn_grouped = true;
    lk_ref_variant_stats vs;
    lk_ref_variant(m, ref, "v_heads_grouped_order", 4, 4, NULL, NULL, &vs);
    CHECKF(vs.max > 10 * q35_f16.logit_max, "the grouped pairing moved the logits only %.3g", vs.max);
    CHECKF(vs.tokens >= 3, "only %d tokens of llama.cpp's grouped-order run compared", vs.tokens);
    printf("  grouped V-head pairing: max |dlogit| %.2f vs the reference; %d tokens as llama.cpp's grouped-order run\n",
           vs.max, vs.tokens);
    lk_model_free(m);
    lk_gguf_close(g);
    json_decref(ref);
}

/* ---- sequences: batches, a slot freed and reused, keep and fork ---- */

/* Two qwen35moe sequences of different lengths share batches (prompt
 * beside prompt, decode beside decode, decode beside a new prompt); one is
 * freed mid-way and its slot reused by a third. Each row must carry the
 * bits its sequence gets alone (the state is per slot, reset with it), and
 * no step allocates. */
TEST(qwen35moe_batch_free_and_reuse) {
    lk_gguf *g;
    lk_model *m = load_model(q35_f16.gguf, &g, 64, 32, 3);
    if (!m) return;
    char err[LK_ERRLEN];
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    const int32_t a[9] = { 5, 77, 300, 12, 9, 401, 33, 250, 18 }, b[6] = { 99, 3, 512, 45, 45, 180 },
                  c[5] = { 7, 7, 123, 456, 42 };
    const int32_t ad[3] = { 61, 2, 88 }, bd = 300;
    static float A[12 * 601], B[7 * 601], Cc[5 * 601], out[16 * 601];
    /* alone, each in slot 0 from empty */
    lk_batch_item it = { 0, 0, 9 };
    lk_ref_step(m, &it, 1, a, A);
    for (int s = 0; s < 3; s++) {
        it = (lk_batch_item){ 0, 9 + s, 1 };
        lk_ref_step(m, &it, 1, &ad[s], A + (size_t)(9 + s) * nv);
    }
    CHECK(lk_model_seq_keep(m, 0, 0, err, sizeof err) == LK_OK);
    it = (lk_batch_item){ 0, 0, 6 };
    lk_ref_step(m, &it, 1, b, B);
    it = (lk_batch_item){ 0, 6, 1 };
    lk_ref_step(m, &it, 1, &bd, B + 6 * nv);
    CHECK(lk_model_seq_keep(m, 0, 0, err, sizeof err) == LK_OK);
    it = (lk_batch_item){ 0, 0, 5 };
    lk_ref_step(m, &it, 1, c, Cc);
    CHECK(lk_model_seq_keep(m, 0, 0, err, sizeof err) == LK_OK);
    /* together: a in slot 1 and b in slot 2 */
    long before = lk_test_allocs();
    lk_batch_item two[2] = { { 2, 0, 6 }, { 1, 0, 9 } };
    int32_t toks[16];
    memcpy(toks, b, sizeof b);
    memcpy(toks + 6, a, sizeof a);
    lk_ref_step(m, two, 2, toks, out);
    CHECKF(!memcmp(out, B, sizeof(float) * 6 * nv), "b's prompt logits changed beside a");
    CHECKF(!memcmp(out + 6 * nv, A, sizeof(float) * 9 * nv), "a's prompt logits changed beside b");
    two[0] = (lk_batch_item){ 1, 9, 1 }, two[1] = (lk_batch_item){ 2, 6, 1 };
    toks[0] = ad[0], toks[1] = bd;
    lk_ref_step(m, two, 2, toks, out);
    CHECKF(!memcmp(out, A + 9 * nv, sizeof(float) * nv), "a's first decode changed beside b");
    CHECKF(!memcmp(out + nv, B + 6 * nv, sizeof(float) * nv), "b's decode changed beside a");
    /* b is freed; its slot takes c, beside a's decode */
    CHECK(lk_model_seq_keep(m, 2, 0, err, sizeof err) == LK_OK);
    two[0] = (lk_batch_item){ 2, 0, 5 }, two[1] = (lk_batch_item){ 1, 10, 1 };
    memcpy(toks, c, sizeof c);
    toks[5] = ad[1];
    lk_ref_step(m, two, 2, toks, out);
    CHECKF(!memcmp(out, Cc, sizeof(float) * 5 * nv), "c's logits in b's reused slot differ from c alone");
    CHECKF(!memcmp(out + 5 * nv, A + 10 * nv, sizeof(float) * nv), "a's second decode changed beside c");
    it = (lk_batch_item){ 1, 11, 1 };
    lk_ref_step(m, &it, 1, &ad[2], out);
    CHECKF(!memcmp(out, A + 11 * nv, sizeof(float) * nv), "a's third decode differs");
    CHECKF(lk_test_allocs() == before, "%ld allocations in the steps", lk_test_allocs() - before);
    lk_model_free(m);
    lk_gguf_close(g);
}

/* The state exists only for all a slot holds: keep(n) between 0 and the
 * length and fork of a prefix are refused with a message; fork of the
 * whole copies the state (continuing the copy equals continuing the
 * source), keep(0) resets it (a prompt again gives its first logits). */
TEST(qwen35moe_keep_and_fork_rules) {
    lk_gguf *g;
    lk_model *m = load_model(q35_f16.gguf, &g, 64, 32, 3);
    if (!m) return;
    char err[LK_ERRLEN] = "";
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    const int32_t a[9] = { 5, 77, 300, 12, 9, 401, 33, 250, 18 }, nx = 61;
    static float first[9 * 601], x0[601], x1[601];
    CHECK(lk_model_recurrent(m));
    lk_batch_item it = { 0, 0, 9 };
    lk_ref_step(m, &it, 1, a, first);
    lk_status st = lk_model_seq_keep(m, 0, 4, err, sizeof err);
    CHECKF(st == LK_ERR_ARG && strstr(err, "recurrent"), "keep 4 of 9: status %d '%s'", (int)st, err);
    CHECK(lk_model_seq_len(m, 0) == 9);
    CHECK(lk_model_seq_keep(m, 0, 9, err, sizeof err) == LK_OK);
    st = lk_model_seq_fork(m, 1, 0, 5, err, sizeof err);
    CHECKF(st == LK_ERR_ARG && strstr(err, "prefix"), "fork 5 of 9: status %d '%s'", (int)st, err);
    CHECKF(lk_model_seq_fork(m, 1, 0, 9, err, sizeof err) == LK_OK, "%s", err);
    it = (lk_batch_item){ 1, 9, 1 };
    lk_ref_step(m, &it, 1, &nx, x1);
    it = (lk_batch_item){ 0, 9, 1 };
    lk_ref_step(m, &it, 1, &nx, x0);
    CHECKF(!memcmp(x0, x1, sizeof x0), "the fork's continuation differs from the source's");
    CHECK(lk_model_seq_keep(m, 1, 0, err, sizeof err) == LK_OK);
    static float again[9 * 601];
    it = (lk_batch_item){ 1, 0, 9 };
    lk_ref_step(m, &it, 1, a, again);
    CHECKF(!memcmp(again, first, sizeof(float) * 9 * nv), "after keep 0 the prompt's logits differ (state not reset)");
    lk_model_free(m);
    lk_gguf_close(g);
}

/* pre=qwen35: \p{M} beside \p{L} (llama.cpp's regex
 * [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+ | ?[^\s\p{L}\p{M}\p{N}]+...), so a
 * decomposed accent stays in its word; qwen2's splits it off. */
TEST(qwen35_pretokenizer_marks) {
    /* "cafe\u0301s ok": c a f e U+0301 s ' ' o k */
    const uint32_t cp[9] = { 'c', 'a', 'f', 'e', 0x301, 's', ' ', 'o', 'k' };
    uint16_t fl[9];
    for (int i = 0; i < 9; i++) fl[i] = lk_unicode_flags(cp[i]);
    uint32_t lens[9], tmp[9];
    size_t n35 = lk_pretok_split(LK_PRE_QWEN35, cp, fl, 9, lens, tmp);
    CHECKF(n35 == 2 && lens[0] == 6 && lens[1] == 3, "qwen35: %zu words, first %u", n35, lens[0]);
    size_t n2 = lk_pretok_split(LK_PRE_QWEN2, cp, fl, 9, lens, tmp);
    CHECKF(n2 == 3 && lens[0] == 4 && lens[1] == 2, "qwen2: %zu words, first %u", n2, lens[0]);
}

/* All reference prompts as concurrent sequences through `run
 * --prompts-file` (the session and engine, slots and state): llama.cpp's
 * greedy tokens up to each prompt's first near-tie. */
static const char *const q35_batch_layouts[] = { "" };
TEST(qwen35moe_f16_batched) { check_batched(&q35_f16, q35_batch_layouts, 1); }

/* --local 2 --tp 2 (key heads split, each rank's value heads paired with
 * its own key heads, conv channels and state with them) and --local 2
 * --pp 2 (the state of each stage's layers on that stage): llama.cpp's
 * greedy tokens up to the first near-tie of any prompt decision, and the
 * one-process run's 32 tokens for every reference prompt up to the first
 * generation step whose reference routing gap is below 0.005 or top-1
 * margin below 0.02: tensor parallelism sums in another order, and prompt
 * 1's step 15 follows a routing gap of 0.0008 (layer 2), which it flips
 * (only that step may differ). Pipeline stages keep every sum: all 32. */
static void check_split(const moe_case *mc) {
    static const char *const layouts[] = { "--local 2 --tp 2 --transport shm", "--local 2 --pp 2 --transport shm" };
    check_layouts(mc, layouts, 2);
    json_t *ref = lk_ref_load(mc->json);
    if (!ref) return;
    moe_case tight = *mc;
    tight.gap_tol = 0.005, tight.gen_tol = 0.01;
    char err[1024];
    size_t ci;
    json_t *c;
    json_array_foreach(json_object_get(ref, "cases"), ci, c) {
        const char *prompt = json_string_value(json_object_get(c, "prompt"));
        json_t *one = lk_ref_run(lk_td(mc->gguf), prompt, 32, "", err, sizeof err);
        CHECKF(one, "%s", err);
        if (!one) continue;
        const int upto = comparable_steps(&tight, c, 8, 2, false);
        json_t *want = json_object_get(one, "generated_ids");
        for (int l = 0; l < 2; l++) {
            json_t *o = lk_ref_run(lk_td(mc->gguf), prompt, 32, layouts[l], err, sizeof err);
            CHECKF(o, "%s", err);
            if (!o) continue;
            json_t *got = json_object_get(o, "generated_ids");
            int same = lk_ref_same_prefix(got, want, 32);
            const int need = l == 1 ? 32 : upto - 1;
            CHECKF(same >= need, "%s %s case %zu: tokens differ from the one-process run at %d (%d must match)",
                   mc->gguf, layouts[l], ci, same, need);
            printf("  %s case %zu: %d/32 tokens as one process (%d must)\n", layouts[l], ci, same, need);
            json_decref(o);
        }
        json_decref(one);
    }
    json_decref(ref);
}
TEST(qwen35moe_f16_split) { check_split(&q35_f16); }
static const char *const q35_split_batch[] = { "--local 2 --tp 2 --transport shm", "--local 2 --pp 2 --transport shm" };
TEST(qwen35moe_f16_split_batched) { check_batched(&q35_f16, q35_split_batch, 2); }

/* Prefix reuse through the session (`run --prompts-file --parallel 1`, so
 * the first prompt's slot is kept when the second starts): two prompts that
 * share more than a page of tokens, and the same prompt twice. Pages could
 * share that prefix but the state could not, so each result must be the
 * one its prompt gets alone (a silent reuse would change the second). */
TEST(qwen35moe_session_prefix) {
    const char *base = "Once upon a time there was a little girl named Lily who lived in a small house near the "
                       "forest with her mother and her old grey cat, and every morning she";
    char p1[512], p2[512], path[64], cmd[1024], errp[64];
    snprintf(p1, sizeof p1, "%s went out to play", base);
    snprintf(p2, sizeof p2, "%s sang a song", base);
    const char *prompts[3] = { p1, p2, p1 };
    snprintf(path, sizeof path, "/tmp/lk_q35_prefix_%d.txt", (int)getpid());
    snprintf(errp, sizeof errp, "/tmp/lk_q35_prefix_%d.err", (int)getpid());
    FILE *f = fopen(path, "w");
    if (!f) { CHECK(0); return; }
    fprintf(f, "%s\n%s\n%s\n", p1, p2, p1);
    fclose(f);
    const char *model = lk_td(q35_f16.gguf);
    snprintf(cmd, sizeof cmd, "%s run -m %s --prompts-file %s --parallel 1 -n 8 --temp 0 --json -t 1 2>%s", lk_test_bin(), model,
             path, errp);
    FILE *p = popen(cmd, "r");
    char line[1 << 14];
    int got = 0;
    while (p && got < 3 && fgets(line, sizeof line, p)) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        if (!o) continue;
        char err[1024];
        json_t *alone = lk_ref_run(model, prompts[got], 8, "", err, sizeof err);
        CHECKF(alone, "%s", err);
        CHECKF(json_array_size(json_object_get(o, "prompt_ids")) > 32, "prompt %d: only %zu tokens", got,
               json_array_size(json_object_get(o, "prompt_ids")));
        if (alone)
            CHECKF(json_equal(json_object_get(o, "generated_ids"), json_object_get(alone, "generated_ids")),
                   "prompt %d after a shared prefix: tokens differ from its run alone", got);
        json_decref(alone);
        json_decref(o);
        got++;
    }
    int rc = p ? pclose(p) : -1;
    CHECKF(rc == 0 && got == 3, "'%s': exit %d, %d results", cmd, rc, got);
    remove(path);
    remove(errp);
}

/* gen-model's qwen3.5-tiny (Qwen3.5's structure at the synth file's size,
 * written as the converter writes it but with full_attention_interval and
 * no attention.recurrent_layers array, as older converters did): lockstep
 * reads the layer pattern back from the interval, `info` prints the layer
 * kinds, `plan` models it, and --local 2 --tp 2 and --pp 2 give one node's
 * tokens. The arithmetic is checked against llama.cpp above; this checks
 * the shape. (By hand, 2026-12-02: llama-server de3ff81 loads this file and
 * gives the same 16 greedy tokens for "Once upon a time" as all three
 * layouts here; llama.cpp is not part of CI.) */
static void check_gen_shape(const char *shape, bool moe) {
    char path[128], cmd[1024], out[8192];
    lk_model_config c;
    if (!lk_ref_gen_model(shape, path, sizeof path, &c)) return;
    CHECKF(c.n_recurrent == 3 && lk_model_layer_recurrent(&c, 0) && !lk_model_layer_recurrent(&c, 3) && c.ssm_nk == 2 &&
           c.ssm_nv == 4 && c.ssm_dk == 32 && c.ssm_dv == 32 && c.rope_dim == 16 && c.attn_gate && c.shexp_gate == moe &&
           (moe ? c.n_ff_shexp == 128 && c.n_expert == 8 : c.n_ff == 512 && c.n_expert == 0),
           "%s config read back: %d recurrent, nk %d nv %d rope %d", shape, c.n_recurrent, c.ssm_nk, c.ssm_nv,
           c.rope_dim);
    snprintf(cmd, sizeof cmd, "%s info %s", lk_test_bin(), path);
    lk_ref_capture(cmd, out, sizeof out);
    CHECKF(strstr(out, "3 gated delta net (L), 1 gated full attention (A): LLLA"), "info does not print the layer kinds:\n%s",
           out);
    snprintf(cmd, sizeof cmd, "%s plan -m %s --tp 2 >/dev/null 2>&1", lk_test_bin(), path);
    CHECKF(system(cmd) == 0, "'%s' failed", cmd);
    static const char *const layouts[] = { "", "--local 2 --tp 2 --transport shm", "--local 2 --pp 2 --transport shm" };
    lk_ref_layouts_agree(path, "Once upon a time", 12, layouts, 3, shape);
    unlink(path);
}
TEST(qwen35_gen_model_shape) { check_gen_shape("qwen3.5-tiny", true); }
/* The dense Qwen3.5 (architecture qwen35: the same mixers, a SwiGLU FFN
 * per layer); by hand, llama-server de3ff81 gives the same 16 tokens. */
TEST(qwen35_dense_gen_model_shape) { check_gen_shape("qwen3.5-dense-tiny", false); }

/* Q4_K_M split: its Q5_K attn_output keeps the 4 attention heads (one
 * 256-block) and so the delta net's key heads on one TP rank; the other
 * holds FFN rows only. */
static const char *const q35_q4km_layouts[] = { "--local 2 --tp 2 --transport shm", "--local 2 --pp 2 --transport shm" };
TEST(qwen35moe_q4_k_m_layouts) { check_layouts(&q35_q4km, q35_q4km_layouts, 2); }

int main(void) {
    RUN(qwen35moe_f16_reference);
    RUN(qwen35moe_f16_two_threads);
    RUN(qwen35moe_q4_k_m_reference);
    RUN(qwen35moe_shared_expert_gate);
    RUN(qwen35moe_grouped_pairing_is_caught);
    RUN(qwen35moe_batch_free_and_reuse);
    RUN(qwen35moe_keep_and_fork_rules);
    RUN(qwen35_pretokenizer_marks);
    RUN(qwen35moe_f16_batched);
    RUN(qwen35moe_f16_split);
    RUN(qwen35moe_f16_split_batched);
    RUN(qwen35moe_session_prefix);
    RUN(qwen35_gen_model_shape);
    RUN(qwen35_dense_gen_model_shape);
    RUN(qwen35moe_q4_k_m_layouts);
    return lk_test_end();
}
