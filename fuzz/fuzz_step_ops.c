/* fuzz_step_ops — structured step messages: well-formed on the wire,
 * arbitrary in meaning.
 *
 * fuzz_step feeds raw bodies, and byte mutations rarely keep a body's exact
 * length, so most inputs stop at the decoder's length check. Here the input
 * is a program that *builds* messages through the step message's own
 * encoder (includes step.c, as fuzz_step does): counts within the caps,
 * then each op's kind, slot, arguments and sampling settings, each item's
 * slot, position, length and sample flag, and the tokens, every field drawn
 * from values that probe its limits (negative, zero, the cap, one past it,
 * huge, NaN and infinities for the floats) or taken raw. encode() then
 * decode() as a worker does; a body decode accepts must come back field for
 * field (asserted), and is then run and collected on stories260K (4 slots of
 * 64 positions, batches of 16), so the checks behind the decoder see
 * positions past the context, tokens outside the vocabulary, forks of empty
 * or the same slot, items on slots without PARAMS, and samplers with odd
 * settings. Up to 8 messages per input, the state carried between them. */
#include "../src/step/step.c"

#include <assert.h>
#include <math.h>

static lk_gguf *g_gguf;
static lk_model *g_model;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    lk_log_set_level(LK_LOG_ERROR);
    const char *path = getenv("LK_FUZZ_MODEL");
    if (!path || !*path) path = "testdata/models/stories260K.gguf";
    char err[LK_ERRLEN];
    lk_model_params mp = {.n_ctx = 64, .n_batch = 16, .max_seqs = 4, .n_threads = 1};
    if (lk_gguf_open(path, &g_gguf, err, sizeof err) || lk_model_load(g_gguf, NULL, &mp, &g_model, err, sizeof err)) {
        fprintf(stderr, "fuzz_step_ops: %s (run from the repository root, or set LK_FUZZ_MODEL)\n", err);
        exit(1);
    }
    return 0;
}

/* ---- the input as a stream of choices (zeros once it runs out) ---------------- */

typedef struct { const uint8_t *p; size_t n, off; } src_t;

static uint8_t u8(src_t *s) { return s->off < s->n ? s->p[s->off++] : 0; }
static uint32_t u32(src_t *s) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)u8(s) << (8 * i);
    return v;
}

/* An integer near the limit `lim` (a slot count, the context, the vocabulary)
 * most of the time, anything otherwise. */
static int32_t pick_int(src_t *s, int32_t lim) {
    const uint8_t c = u8(s);
    switch (c & 7) {
    case 0: return 0;
    case 1: return -1 - (int32_t)(c >> 3);          /* small negatives */
    case 2: return lim - 1;
    case 3: return lim;
    case 4: return lim + 1 + (int32_t)(c >> 3);     /* just past */
    case 5: return (int32_t)u32(s);                 /* anything, INT32_MIN/MAX included */
    default: return lim > 0 ? (int32_t)(u8(s) % (uint32_t)lim) : 0; /* valid */
    }
}

static float pick_float(src_t *s, float typical) {
    const uint8_t c = u8(s);
    switch (c & 7) {
    case 0: return 0.0f;
    case 1: return -typical;
    case 2: return NAN;
    case 3: return (c & 8) ? INFINITY : -INFINITY;
    case 4: { uint32_t u = u32(s); float f; memcpy(&f, &u, 4); return f; } /* any bit pattern */
    case 5: return 1e30f;
    default: return typical * (float)(c >> 3) / 8.0f;
    }
}

static void build_op(src_t *s, lk_step_op *o, int slots, int ctx) {
    const uint8_t k = u8(s);
    o->kind = k < 240 ? 1 + k % 3 : (int32_t)(k & 15) - 4; /* mostly the three kinds, some invalid */
    o->seq = pick_int(s, slots);
    o->a = pick_int(s, o->kind == LK_STEP_OP_FORK ? slots : o->kind == LK_STEP_OP_PARAMS ? LK_STEP_MAX_CAND : ctx);
    o->b = pick_int(s, ctx);
    lk_sampler_params_default(&o->sp);
    if (o->kind != LK_STEP_OP_PARAMS) return;
    o->sp.temp = pick_float(s, 0.8f);
    o->sp.top_k = pick_int(s, 40);
    o->sp.top_p = pick_float(s, 0.95f);
    o->sp.min_p = pick_float(s, 0.05f);
    o->sp.repeat_penalty = pick_float(s, 1.1f);
    o->sp.freq_penalty = pick_float(s, 0.5f);
    o->sp.presence_penalty = pick_float(s, 0.5f);
    o->sp.penalty_last_n = pick_int(s, 64);
    o->sp.seed = (uint64_t)u32(s) << 32 | u32(s);
}

/* Floats compared bit for bit (NaN == NaN here: the wire carries bits). */
static bool same_f(float a, float b) { return !memcmp(&a, &b, sizeof a); }

static void assert_same(const lk_step_msg *a, const lk_step_msg *b) {
    assert(a->n_ops == b->n_ops && a->n_items == b->n_items && a->n_tok == b->n_tok && a->end == b->end);
    for (int i = 0; i < a->n_ops; i++) {
        const lk_step_op *x = &a->ops[i], *y = &b->ops[i];
        assert(x->kind == y->kind && x->seq == y->seq && x->a == y->a && x->b == y->b);
        assert(same_f(x->sp.temp, y->sp.temp) && x->sp.top_k == y->sp.top_k && same_f(x->sp.top_p, y->sp.top_p) &&
               same_f(x->sp.min_p, y->sp.min_p) && same_f(x->sp.repeat_penalty, y->sp.repeat_penalty) &&
               same_f(x->sp.freq_penalty, y->sp.freq_penalty) &&
               same_f(x->sp.presence_penalty, y->sp.presence_penalty) &&
               x->sp.penalty_last_n == y->sp.penalty_last_n && x->sp.seed == y->sp.seed);
    }
    for (int i = 0; i < a->n_items; i++)
        assert(a->items[i].seq == b->items[i].seq && a->items[i].pos0 == b->items[i].pos0 &&
               a->items[i].n == b->items[i].n && a->items[i].sample == b->items[i].sample);
    for (int i = 0; i < a->n_tok; i++) assert(a->tokens[i] == b->tokens[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[LK_ERRLEN];
    src_t s = {data, size, 0};
    const int slots = lk_model_max_seqs(g_model), ctx = lk_model_n_ctx(g_model);
    const int32_t n_vocab = (int32_t)lk_model_cfg(g_model)->n_vocab;
    lk_step_params sp = {.m = g_model};
    lk_step *st;
    if (lk_step_create(&sp, &st, err, sizeof err)) { fprintf(stderr, "%s\n", err); abort(); }
    lk_step_msg out, in;
    lk_step_msg_init(&out, slots, lk_model_n_batch(g_model));
    lk_step_msg_init(&in, slots, lk_model_n_batch(g_model));
    for (int k = 0; k < 8 && s.off < s.n; k++) {
        lk_step_msg_clear(&out);
        out.no = in.no = (uint64_t)k;
        out.n_ops = u8(&s) % (out.cap_ops + 1);
        out.n_items = u8(&s) % (out.cap_items + 1);
        for (int i = 0; i < out.n_ops; i++) build_op(&s, &out.ops[i], slots, ctx);
        int left = out.cap_tok;
        for (int i = 0; i < out.n_items; i++) {
            lk_step_item *it = &out.items[i];
            it->seq = pick_int(&s, slots);
            it->pos0 = pick_int(&s, ctx);
            it->n = pick_int(&s, LK_MIN(left, 4) + 1);
            it->sample = u8(&s) & 1;
            /* the tokens travel as one array whose length the message states:
             * the items' n add up to it unless a count is out of range */
            if (it->n > 0 && it->n <= left) left -= it->n;
        }
        out.n_tok = out.cap_tok - left;
        if (u8(&s) == 0xff) out.n_tok = (int)(u8(&s) % (out.cap_tok + 1)); /* a total that disagrees */
        for (int i = 0; i < out.n_tok; i++) out.tokens[i] = pick_int(&s, n_vocab);
        out.end = u8(&s) == 0xfe;
        encode(&out);
        const size_t n = out.wire_len - LK_STEP_HDR;
        assert(n <= body_cap(&in));
        memcpy(in.wire + LK_STEP_HDR, out.wire + LK_STEP_HDR, n);
        /* every message encode writes is well-formed: decode reads it back as it was */
        assert(decode(&in, in.wire + LK_STEP_HDR, n, err, sizeof err) == LK_OK);
        assert_same(&out, &in);
        if (in.end) break;
        if (lk_step_run(st, &in, false, err, sizeof err)) continue;
        if (lk_step_collect(st, err, sizeof err)) continue;
        for (int i = 0; i < lk_step_n_results(st); i++) {
            int seq;
            const int32_t *ids;
            const float *vals;
            int c = lk_step_result(st, i, &seq, &ids, &vals);
            assert(seq >= 0 && seq < slots && c >= 0 && c <= LK_STEP_MAX_CAND + 1);
            for (int j = 0; j < c; j++) assert(ids[j] >= -2 && ids[j] < n_vocab);
        }
    }
    lk_step_msg_free(&out);
    lk_step_msg_free(&in);
    lk_step_free(st);
    for (int q = 0; q < slots; q++) lk_model_seq_keep(g_model, q, 0, err, sizeof err);
    return 0;
}
