/* lk_ref — comparing lockstep with llama.cpp's reference outputs, for the
 * tests that do (test_model, test_moe, test_qwen35, test_gemma3,
 * test_cluster_ref). Included after lk_test.h; every function is static
 * inline, so a test takes what it needs and the rest costs nothing.
 *
 * A reference file (NAME.json beside NAME.gguf in testdata/reference and
 * ../shared/testdata/synth, whose READMEs name the fields and the
 * tolerances) holds "cases", each with
 *   prompt, prompt_token_ids
 *   prompt_logits_all_positions   one row of n_vocab logits per prompt position
 *   generated_token_ids           llama.cpp's greedy continuation
 *   generated_top1_margin         top-1 minus top-2 logit at each greedy step
 *   checks.<variant>              a must-not-match variant's own greedy tokens
 *                                 and its first_divergence from the correct ones
 * and "tokenizer_cases" ({text, ids}).
 *
 * The comparison every reference test makes, in three pieces a test strings
 * together its own way (MoE tests compare the routing between them):
 * lk_ref_prompt_pass runs a case's prompt in one pass, lk_ref_logit_diff
 * measures max and median |dlogit| against the reference's rows, and
 * lk_ref_greedy follows llama.cpp's tokens one step at a time, up to a
 * bound lk_ref_comparable or lk_ref_variant_upto gives. The forward pass is
 * a function pointer, so the same code drives one model or a group of
 * ranks. The lk_ref_run* functions run the program itself, as a user does. */
#ifndef LK_REF_H
#define LK_REF_H

#include <jansson.h>
#include <math.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "model/model.h"

enum { LK_REF_MAX_ROWS = 256 }; /* rows of one lk_ref_step */

/* ---- reading the reference ---- */

static inline int lk_ref_cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static inline double lk_ref_num(json_t *a, size_t i) { return json_number_value(json_array_get(a, i)); }

/* The reference JSON at lk_td(rel) (caller decrefs), or NULL and a failed check. */
static inline json_t *lk_ref_load(const char *rel) {
    json_error_t je;
    json_t *ref = json_load_file(lk_td(rel), JSON_ALLOW_NUL, &je);
    CHECKF(ref, "%s: %s", rel, je.text);
    return ref;
}

/* Whether ids[0..n) are the JSON array want. */
static inline bool lk_ref_ids_equal(const int32_t *ids, int n, json_t *want) {
    bool same = n == (int)json_array_size(want);
    for (int k = 0; same && k < n; k++) same = ids[k] == json_integer_value(json_array_get(want, (size_t)k));
    return same;
}

/* How many leading entries of the JSON arrays a and b agree, at most max. */
static inline int lk_ref_same_prefix(json_t *a, json_t *b, int max) {
    int n = LK_MIN(max, (int)LK_MIN(json_array_size(a), json_array_size(b))), i = 0;
    while (i < n && json_integer_value(json_array_get(a, (size_t)i)) == json_integer_value(json_array_get(b, (size_t)i)))
        i++;
    return i;
}

static inline int32_t lk_ref_argmax(const float *l, int64_t n) {
    int32_t b = 0;
    for (int64_t j = 1; j < n; j++) if (l[j] > l[b]) b = (int32_t)j;
    return b;
}

/* Greedy steps worth comparing: up to and including the first whose
 * reference top-1 margin is below 2 x tol (there a correct engine whose
 * logits are off by tol may take the other branch); all when none is. */
static inline int lk_ref_comparable(json_t *c, double tol) {
    json_t *mg = json_object_get(c, "generated_top1_margin");
    int n = (int)json_array_size(mg);
    for (int k = 0; k < n; k++)
        if (lk_ref_num(mg, (size_t)k) < 2 * tol) return k + 1;
    return n;
}

/* The steps through a must-not-match variant's first departure from the
 * correct tokens (checks.<variant>.first_divergence), or dflt when the case
 * gives none. */
static inline int lk_ref_variant_upto(json_t *c, const char *variant, int dflt) {
    json_t *fd = json_object_get(json_object_get(json_object_get(c, "checks"), variant), "first_divergence");
    return json_is_integer(fd) ? (int)json_integer_value(fd) + 1 : dflt;
}

/* ---- running the model against it ---- */

/* The GGUF at path and a model on it with mp; NULL (a failed check, *g
 * NULL) if either fails. The caller frees both. */
static inline lk_model *lk_ref_open_model(const char *path, const lk_model_params *mp, lk_gguf **g) {
    char err[LK_ERRLEN];
    lk_model *m = NULL;
    *g = NULL;
    if (lk_gguf_open(path, g, err, sizeof err)) { CHECKF(0, "%s", err); *g = NULL; return NULL; }
    CHECKF(lk_model_load(*g, NULL, mp, &m, err, sizeof err) == LK_OK, "%s", err);
    if (!m) { lk_gguf_close(*g); *g = NULL; }
    return m;
}

/* A forward pass: n tokens at positions pos0.., logits of the last n_out rows. */
typedef lk_status (*lk_ref_fwd)(void *ctx, const int32_t *toks, int n, int pos0, int n_out, float *logits);
static inline lk_status lk_ref_model_fwd(void *m, const int32_t *toks, int n, int pos0, int n_out, float *logits) {
    return lk_model_forward(m, toks, n, pos0, n_out, logits);
}

/* Runs case c's prompt in one pass from position 0; returns the logits of
 * every position (n_vocab each; caller frees), the prompt's length in *n. */
static inline float *lk_ref_prompt_pass(lk_ref_fwd fwd, void *ctx, int64_t nv, json_t *c, int *n) {
    json_t *jids = json_object_get(c, "prompt_token_ids");
    *n = (int)json_array_size(jids);
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)(*n + 1));
    for (int i = 0; i < *n; i++) toks[i] = (int32_t)json_integer_value(json_array_get(jids, (size_t)i));
    float *logits = malloc(sizeof(float) * (size_t)nv * (size_t)LK_MAX(*n, 1));
    CHECK(fwd(ctx, toks, *n, 0, *n, logits) == LK_OK);
    free(toks);
    return logits;
}

/* |dlogit| between logits and case c's reference rows over the first
 * `rows` positions: the maximum into *max, the median returned. */
static inline double lk_ref_logit_diff(const float *logits, json_t *c, int rows, int64_t nv, double *max) {
    json_t *ref = json_object_get(c, "prompt_logits_all_positions");
    CHECKF((int)json_array_size(ref) >= rows, "%zu reference rows for %d positions", json_array_size(ref), rows);
    rows = LK_MIN(rows, (int)json_array_size(ref));
    float *diffs = malloc(sizeof(float) * (size_t)nv * (size_t)LK_MAX(rows, 1));
    size_t nd = 0;
    double mx = 0;
    for (int i = 0; i < rows; i++) {
        json_t *row = json_array_get(ref, (size_t)i);
        for (int64_t j = 0; j < nv; j++) {
            double d = fabs(logits[(size_t)i * nv + j] - lk_ref_num(row, (size_t)j));
            diffs[nd++] = (float)d;
            mx = fmax(mx, d);
        }
    }
    qsort(diffs, nd, sizeof(float), lk_ref_cmp_f);
    double median = nd ? diffs[nd / 2] : 0;
    free(diffs);
    *max = mx;
    return median;
}

/* Greedy decoding along llama.cpp's tokens `want` (a JSON array): at each of
 * at most `steps` steps the argmax of the current logits (first: `last`,
 * n_vocab floats) must be want[s]; want[s] is then fed at position pos + s
 * (into buf, n_vocab floats) unless it was the last step. Returns how many
 * steps matched; at the first that did not, *got is our token (else -1). */
static inline int lk_ref_greedy(lk_ref_fwd fwd, void *ctx, int64_t nv, const float *last, json_t *want, int steps,
                                int pos, float *buf, int32_t *got) {
    *got = -1;
    steps = LK_MIN(steps, (int)json_array_size(want));
    for (int s = 0; s < steps; s++) {
        int32_t best = lk_ref_argmax(last, nv), w = (int32_t)json_integer_value(json_array_get(want, (size_t)s));
        if (best != w) { *got = best; return s; }
        if (s + 1 == steps) break;
        CHECK(fwd(ctx, &w, 1, pos + s, 1, buf) == LK_OK);
        last = buf;
    }
    return steps;
}

/* One step of m (lk_model_batch, embed, layers, logits) over the given
 * items, their tokens in item order: every row's logits into out. */
static inline void lk_ref_step(lk_model *m, const lk_batch_item *it, int n_items, const int32_t *toks, float *out) {
    char err[LK_ERRLEN];
    int rows = 0;
    for (int i = 0; i < n_items; i++) rows += it[i].n;
    int32_t r[LK_REF_MAX_ROWS];
    LK_ASSERT(rows <= LK_REF_MAX_ROWS);
    CHECKF(lk_model_batch(m, it, n_items, err, sizeof err) == LK_OK, "%s", err);
    lk_model_embed(m, toks, rows, lk_model_hidden(m));
    CHECK(lk_model_layers(m, lk_model_hidden(m)) == LK_OK);
    for (int i = 0; i < rows; i++) r[i] = i;
    lk_model_logits(m, lk_model_hidden(m), r, rows, out);
}

/* Batch invariance: a (na tokens) alone in slot 0, then b (nb) alone in
 * slot 1, then both in one batch (b in slot 2, a in slot 0 again): each row
 * must carry the bits it had alone (grouping rows must not change a row's
 * arithmetic), and the two lone steps must not allocate. m needs 3 slots
 * and a batch of na + nb. Failures name `what`. */
static inline void lk_ref_batch_invariance(lk_model *m, const int32_t *a, int na, const int32_t *b, int nb,
                                           const char *what) {
    char err[LK_ERRLEN];
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    const size_t rows = (size_t)(na + nb);
    float *alone = malloc(sizeof(float) * rows * nv), *mixed = malloc(sizeof(float) * rows * nv);
    int32_t *toks = malloc(sizeof(int32_t) * rows);
    lk_batch_item ia = { 0, 0, na }, ib = { 1, 0, nb }, both[2] = { { 2, 0, nb }, { 0, 0, na } };
    long before = lk_test_allocs();
    lk_ref_step(m, &ia, 1, a, alone);
    lk_ref_step(m, &ib, 1, b, alone + (size_t)na * nv);
    CHECKF(lk_test_allocs() == before, "%s: %ld allocations in two steps", what, lk_test_allocs() - before);
    CHECK(lk_model_seq_keep(m, 0, 0, err, sizeof err) == LK_OK);
    memcpy(toks, b, sizeof(int32_t) * (size_t)nb);
    memcpy(toks + nb, a, sizeof(int32_t) * (size_t)na);
    lk_ref_step(m, both, 2, toks, mixed);
    CHECKF(!memcmp(mixed + (size_t)nb * nv, alone, sizeof(float) * (size_t)na * nv), "%s: a's logits changed beside b",
           what);
    CHECKF(!memcmp(mixed, alone + (size_t)na * nv, sizeof(float) * (size_t)nb * nv), "%s: b's logits changed beside a",
           what);
    free(alone);
    free(mixed);
    free(toks);
}

/* Token s of the JSON array a (for messages). */
static inline int lk_ref_tok(json_t *a, int s) { return (int)json_integer_value(json_array_get(a, (size_t)s)); }

/* One reference case through one model, the whole comparison of a dense
 * model: its prompt in one pass, |dlogit| at every position, then greedy
 * steps along llama.cpp's tokens up to the first near-tie (a margin below
 * 2 x gen_tol). step: n_vocab floats of scratch. */
typedef struct {
    double max, median;   /* |dlogit| over the prompt's positions */
    int ngen, comparable; /* llama.cpp's greedy tokens; the steps compared */
    int matched;          /* steps that gave llama.cpp's token */
    int32_t got, want;    /* at the first that did not: ours and llama.cpp's (-1: none) */
} lk_ref_case_result;
static inline void lk_ref_case(lk_model *m, json_t *c, double gen_tol, float *step, lk_ref_case_result *r) {
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    int n;
    float *logits = lk_ref_prompt_pass(lk_ref_model_fwd, m, nv, c, &n);
    CHECK((int)json_array_size(json_object_get(c, "prompt_logits_all_positions")) == n);
    r->median = lk_ref_logit_diff(logits, c, n, nv, &r->max);
    json_t *gen = json_object_get(c, "generated_token_ids");
    r->ngen = (int)json_array_size(gen);
    r->comparable = LK_MIN(lk_ref_comparable(c, gen_tol), r->ngen);
    r->matched = lk_ref_greedy(lk_ref_model_fwd, m, nv, logits + (size_t)(n - 1) * nv, gen, r->comparable, n, step,
                               &r->got);
    r->want = r->got < 0 ? -1 : lk_ref_tok(gen, r->matched);
    free(logits);
}

/* What a must-not-match variant (README "checks") gives, all cases:
 * the largest |dlogit| against the correct reference's prompt logits, and
 * how many greedy steps (through each case's first departure, at most cap;
 * dflt where a case gives none) gave llama.cpp's tokens for the variant;
 * a different token is a failed check. each(arg, case, n), when given, runs
 * after every prompt pass (to read a routing trace). */
typedef struct { double max; int tokens, compared; } lk_ref_variant_stats;
static inline void lk_ref_variant(lk_model *m, json_t *ref, const char *variant, int dflt, int cap,
                                  void (*each)(void *arg, json_t *c, int n), void *arg, lk_ref_variant_stats *st) {
    const int64_t nv = lk_model_cfg(m)->n_vocab;
    float *buf = malloc(sizeof(float) * (size_t)nv);
    memset(st, 0, sizeof *st);
    size_t ci;
    json_t *c;
    json_array_foreach(json_object_get(ref, "cases"), ci, c) {
        int n;
        float *logits = lk_ref_prompt_pass(lk_ref_model_fwd, m, nv, c, &n);
        double mx;
        lk_ref_logit_diff(logits, c, n, nv, &mx);
        st->max = fmax(st->max, mx);
        if (each) each(arg, c, n);
        json_t *want = json_object_get(json_object_get(json_object_get(c, "checks"), variant), "generated_token_ids");
        int upto = LK_MIN(lk_ref_variant_upto(c, variant, dflt), cap), got;
        int k = lk_ref_greedy(lk_ref_model_fwd, m, nv, logits + (size_t)(n - 1) * nv, want, upto, n, buf, &got);
        CHECKF(got < 0, "%s case %zu step %d: %d, llama.cpp's variant %d", variant, ci, k, got, lk_ref_tok(want, k));
        st->tokens += k, st->compared += LK_MIN(upto, (int)json_array_size(want));
        free(logits);
    }
    free(buf);
}

/* ---- files ---- */

/* The whole file at path in a malloc'd buffer (caller frees), its size in *size; NULL if unreadable. */
static inline uint8_t *lk_ref_read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    uint8_t *b = NULL;
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (b = malloc((size_t)n + 1)) && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *size = b ? (size_t)n : 0;
    return b;
}

/* Writes b[0..n) to /tmp/lk-<tag>-<pid>.gguf, its name into path; false (and a failed check) if it cannot. */
static inline bool lk_ref_write_tmp(const char *tag, const void *b, size_t n, char *path, size_t len) {
    snprintf(path, len, "/tmp/lk-%s-%d.gguf", tag, (int)getpid());
    FILE *f = fopen(path, "wb");
    bool ok = f && fwrite(b, 1, n, f) == n;
    if (f) ok &= fclose(f) == 0;
    CHECKF(ok, "cannot write %s", path);
    return ok;
}

/* ---- through the program, as a user runs it ---- */

/* The last bytes of a file into out (for messages). */
static inline void lk_ref_tail(const char *path, char *out, size_t len) {
    FILE *f = fopen(path, "r");
    size_t k = 0;
    if (f) {
        if (fseek(f, 0, SEEK_END) == 0 && ftell(f) > (long)len - 1) fseek(f, -((long)len - 1), SEEK_END);
        else fseek(f, 0, SEEK_SET);
        k = fread(out, 1, len - 1, f);
        fclose(f);
    }
    out[k] = 0;
}

/* `lockstep run -m model -n n --temp 0 --json -t 1 FLAGS` on prompt (through
 * a file: prompts hold quotes and newlines): its JSON object (caller
 * decrefs), or NULL with the command and its stderr's tail in err. */
static inline json_t *lk_ref_run(const char *model, const char *prompt, int n, const char *flags, char *err,
                                 size_t errlen) {
    char cmd[2048], errpath[64], ppath[64];
    snprintf(errpath, sizeof errpath, "/tmp/lk_ref_%d.err", (int)getpid());
    snprintf(ppath, sizeof ppath, "/tmp/lk_ref_%d.prompt", (int)getpid());
    FILE *pf = fopen(ppath, "w");
    if (!pf) { snprintf(err, errlen, "cannot write %s", ppath); return NULL; }
    fputs(prompt, pf);
    fclose(pf);
    snprintf(cmd, sizeof cmd, "%s run -m %s -f %s -n %d --temp 0 --json -t 1 %s 2>%s", lk_test_bin(), model, ppath, n,
             flags, errpath);
    FILE *p = popen(cmd, "r");
    if (!p) { snprintf(err, errlen, "popen failed"); remove(ppath); return NULL; }
    static char out[1 << 16];
    size_t len = fread(out, 1, sizeof out - 1, p);
    out[len] = 0;
    int rc = pclose(p);
    json_error_t je;
    json_t *o = rc == 0 ? json_loads(out, JSON_ALLOW_NUL, &je) : NULL;
    if (!o) {
        char tail[400];
        lk_ref_tail(errpath, tail, sizeof tail);
        snprintf(err, errlen, "'%.300s' exit %d: %.400s", cmd, rc, tail);
    }
    remove(errpath);
    remove(ppath);
    return o;
}

/* Every case of `cases` as concurrent sequences through the program (`run
 * --prompts-file` of JSON lines, `--parallel parallel`, FLAGS): each result
 * must have the case's prompt tokens and llama.cpp's greedy tokens up to
 * upto[case] (only that last one may differ: a near-tie). Failures name
 * `what`. Returns the tokens that matched; the steps compared into *compared. */
static inline int lk_ref_run_batch(const char *model, json_t *cases, const int *upto, int parallel, const char *flags,
                                   const char *what, int *compared) {
    const int nc = (int)json_array_size(cases);
    int nmax = 1, tokens = 0;
    *compared = 0;
    char ppath[64], epath[64], cmd[2048];
    snprintf(ppath, sizeof ppath, "/tmp/lk_ref_batch_%d.jsonl", (int)getpid());
    snprintf(epath, sizeof epath, "/tmp/lk_ref_batch_%d.err", (int)getpid());
    FILE *pf = fopen(ppath, "w");
    CHECKF(pf, "cannot write %s", ppath);
    if (!pf) return 0;
    for (int ci = 0; ci < nc; ci++) {
        nmax = LK_MAX(nmax, upto[ci]);
        json_t *line = json_pack("{sO}", "prompt", json_object_get(json_array_get(cases, (size_t)ci), "prompt"));
        char *txt = json_dumps(line, JSON_COMPACT);
        fprintf(pf, "%s\n", txt);
        free(txt);
        json_decref(line);
    }
    fclose(pf);
    snprintf(cmd, sizeof cmd, "%s run -m %s --prompts-file %s --parallel %d -n %d --temp 0 --json -t 1 %s 2>%s",
             lk_test_bin(), model, ppath, parallel, nmax, flags, epath);
    FILE *p = popen(cmd, "r");
    CHECKF(p, "popen failed");
    static char line[1 << 16];
    int got_n = 0;
    while (p && got_n < nc && fgets(line, sizeof line, p)) {
        json_error_t je;
        json_t *o = json_loads(line, JSON_ALLOW_NUL, &je);
        if (!o) continue;
        json_t *c = json_array_get(cases, (size_t)got_n);
        int same = lk_ref_same_prefix(json_object_get(o, "generated_ids"), json_object_get(c, "generated_token_ids"),
                                      upto[got_n]);
        CHECKF(json_equal(json_object_get(o, "prompt_ids"), json_object_get(c, "prompt_token_ids")) &&
                   same >= upto[got_n] - 1,
               "%s case %d: first difference at token %d of %d", what, got_n, same, upto[got_n]);
        tokens += same, *compared += upto[got_n];
        got_n++;
        json_decref(o);
    }
    int rc = p ? pclose(p) : -1;
    CHECKF(rc == 0 && got_n == nc, "'%s': exit %d, %d of %d results", cmd, rc, got_n, nc);
    remove(ppath);
    remove(epath);
    return tokens;
}

/* Runs the shell command cmd: its standard output (at most len - 1 bytes) into out; returns pclose's status. */
static inline int lk_ref_capture(const char *cmd, char *out, size_t len) {
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, len - 1, p) : 0;
    out[n] = 0;
    return p ? pclose(p) : -1;
}

/* A model with no llama.cpp reference (gen-model's shapes): its greedy
 * tokens for prompt under every layout must be those of layouts[0]. */
static inline void lk_ref_layouts_agree(const char *model, const char *prompt, int n, const char *const *layouts,
                                        int n_layouts, const char *what) {
    char err[1024];
    json_t *ref = NULL;
    for (int l = 0; l < n_layouts; l++) {
        json_t *o = lk_ref_run(model, prompt, n, layouts[l], err, sizeof err);
        CHECKF(o, "%s", err);
        if (!o) continue;
        if (!ref) ref = o;
        else {
            CHECKF(json_equal(json_object_get(o, "generated_ids"), json_object_get(ref, "generated_ids")),
                   "%s %s: tokens differ from one node's", what, layouts[l]);
            json_decref(o);
        }
    }
    json_decref(ref);
}

/* gen-model's `shape` (Q8_0, so heads cut on 32-element blocks) written to
 * /tmp/lk-gen-<pid>.gguf (its name into path) and its configuration read
 * back into c; false, with a failed check and no file left, if either fails. */
static inline bool lk_ref_gen_model(const char *shape, char *path, size_t len, lk_model_config *c) {
    char cmd[1024], err[LK_ERRLEN];
    snprintf(path, len, "/tmp/lk-gen-%d.gguf", (int)getpid());
    snprintf(cmd, sizeof cmd, "%s gen-model --shape %s --type q8_0 -o %s -q -t 1 2>/dev/null", lk_test_bin(), shape, path);
    CHECKF(system(cmd) == 0, "'%s' failed", cmd);
    lk_gguf *g = NULL;
    if (lk_gguf_open(path, &g, err, sizeof err)) { CHECKF(0, "%s", err); unlink(path); return false; }
    lk_status st = lk_model_config_read(g, c, err, sizeof err);
    CHECKF(st == LK_OK, "%s", err);
    lk_gguf_close(g);
    if (st) unlink(path);
    return st == LK_OK;
}

#endif
