/* lockstep run — generate text from a prompt, on one node or a cluster. */
#include "cli/cli.h"
#include "cli/genflags.h"
#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The generated text: kept for --json, streamed to stdout otherwise. */
typedef struct {
    char  *text;
    size_t len, cap;
    bool   stream;
} text_out;

static void emit(text_out *o, const char *piece, int32_t k) {
    if (o->len + (size_t)k + 1 > o->cap) o->text = lk_xrealloc(o->text, o->cap = 2 * o->cap + (size_t)k);
    memcpy(o->text + o->len, piece, (size_t)k);
    o->len += (size_t)k;
    if (o->stream) {
        fwrite(piece, 1, (size_t)k, stdout);
        fflush(stdout);
    }
}

static const char *SYNOPSIS = "-m FILE -p TEXT [options]";

int lk_cmd_run(int argc, char **argv) {
    const char *prompt = NULL;
    int64_t n_predict = 128;
    bool json = false, no_bos = false, verbose = false, ignore_eos = false;
    lk_genflags f;
    lk_genflags_init(&f);
    lk_opt opts[48];
    int no = 0;
    const lk_opt own[] = {
        { "--prompt", "-p", LK_OPT_STR, &prompt, "TEXT", "prompt text (required)" },
        { "--n-predict", "-n", LK_OPT_INT, &n_predict, "N", "tokens to generate (default 128)" },
        { "--no-bos", NULL, LK_OPT_FLAG, &no_bos, NULL, "do not add the BOS token" },
        { "--ignore-eos", NULL, LK_OPT_FLAG, &ignore_eos, NULL, "keep generating after end-of-generation tokens" },
        { "--json", NULL, LK_OPT_FLAG, &json, NULL, "print one JSON object (ids, text, timings) instead of streaming" },
        { "--verbose", "-v", LK_OPT_FLAG, &verbose, NULL, "more log output" },
    };
    lk_genflags_opts(&f, opts, &no, 47);
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) opts[no++] = own[i];
    opts[no] = (lk_opt){ 0 };
    const char *pos[1];
    int np = lk_args_parse("run", SYNOPSIS, opts, argc, argv, pos, 0);
    if (np == LK_ARGS_HELP) return 0;
    if (np < 0) return 2;
    if (!f.model || !prompt) {
        fprintf(stderr, "lockstep run: %s is required (see 'lockstep run --help')\n", !f.model ? "-m FILE" : "-p TEXT");
        return 2;
    }
    if (n_predict < 0) {
        fprintf(stderr, "lockstep run: -n must be >= 0\n");
        return 2;
    }
    lk_engine_opts eo;
    lk_sampler_params sp;
    if (!lk_genflags_finish(&f, "run", &eo, &sp)) return 2;
    if (verbose) lk_log_set_level(LK_LOG_DEBUG);
    int64_t seed = f.seed;

    char err[LK_ERRLEN];
    lk_engine *e = NULL;
    double t_load = lk_time_s();
    if (lk_engine_open(&eo, &e, err, sizeof err)) {
        fprintf(stderr, "lockstep run: %s\n", err);
        return 1;
    }
    t_load = lk_time_s() - t_load;
    lk_tokenizer *tok = NULL;
    if (lk_tokenizer_load(lk_engine_gguf(e), &tok, err, sizeof err)) {
        fprintf(stderr, "lockstep run: %s\n", err);
        lk_engine_close(e);
        return 1;
    }
    int32_t *ids = NULL, n_ids = 0;
    if (lk_tokenizer_encode(tok, prompt, strlen(prompt), !no_bos, false, &ids, &n_ids, err, sizeof err)) {
        fprintf(stderr, "lockstep run: prompt: %s\n", err);
        lk_tokenizer_free(tok);
        lk_engine_close(e);
        return 1;
    }
    if (no_bos && n_ids > 0 && ids[0] == lk_tokenizer_bos(tok)) { memmove(ids, ids + 1, sizeof(int32_t) * --n_ids); }
    int n_ctx = lk_engine_n_ctx(e), rc = 0;
    if (n_ids == 0) {
        fprintf(stderr, "lockstep run: the prompt is empty after tokenisation (and no BOS is added)\n");
        rc = 2;
    } else if (n_ids >= n_ctx) {
        fprintf(stderr, "lockstep run: the prompt has %d tokens, which does not fit the context of %d (--ctx)\n", n_ids, n_ctx);
        rc = 2;
    }
    lk_sampler *s = lk_sampler_create(&sp);
    int32_t *gen = lk_xmalloc(sizeof(int32_t) * (size_t)(n_predict + 1));
    int n_gen = 0;
    text_out out = { .cap = 4096, .stream = !json };
    out.text = lk_xmalloc(out.cap);
    double t_prefill = 0, t_decode = 0, t_decode_comm = 0;
    if (rc == 0) {
        for (int i = 0; i < n_ids; i++) lk_sampler_accept(s, ids[i]);
        lk_detok dt;
        lk_detok_init(&dt, tok);
        int32_t next = -1;
        double t0 = lk_time_s();
        lk_status st = n_predict > 0 ? lk_engine_step(e, ids, n_ids, 0, s, &next, err, sizeof err) : LK_OK;
        t_prefill = lk_time_s() - t0;
        int pos = n_ids;
        t0 = lk_time_s();
        /* big enough for any token (tokenizer.h), so nothing is ever dropped */
        int32_t piece_cap = 3 * (lk_tokenizer_max_piece(tok) + 4);
        char *piece = lk_xmalloc((size_t)piece_cap);
        while (st == LK_OK && n_gen < n_predict) {
            gen[n_gen++] = next;
            lk_sampler_accept(s, next);
            bool eog = !ignore_eos && lk_tokenizer_is_eog(tok, next);
            int32_t k = eog ? 0 : lk_detok_push(&dt, next, piece, piece_cap);
            if (k > 0) emit(&out, piece, k);
            if (eog || n_gen == n_predict) break;
            if (pos + 1 > n_ctx) { lk_log(LK_LOG_WARN, "context of %d tokens is full; stopping", n_ctx); break; }
            st = lk_engine_step(e, &next, 1, pos++, s, &next, err, sizeof err);
            double tc, tn;
            lk_engine_last_timing(e, &tc, &tn);
            t_decode_comm += tn;
        }
        t_decode = lk_time_s() - t0;
        int32_t k = lk_detok_flush(&dt, piece, piece_cap);
        if (k > 0) emit(&out, piece, k);
        free(piece);
        if (st) {
            fprintf(stderr, "\nlockstep run: %s\n", err);
            rc = 1;
        }
    }
    out.text[out.len] = 0;
    double pre_tps = t_prefill > 0 ? n_ids / t_prefill : 0;
    double dec_tps = n_gen > 1 && t_decode > 0 ? (n_gen - 1) / t_decode : 0;
    if (!json && rc == 0) {
        printf("\n");
        fflush(stdout); /* before the stderr summary, also when stdout is a pipe */
    }
    if (rc == 0 || rc == 1) {
        fprintf(stderr, "lockstep: load %.2f s | prefill %d tokens %.1f tok/s | decode %d tokens %.1f tok/s | %d rank%s | seed %lld\n",
                t_load, n_ids, pre_tps, n_gen, dec_tps, lk_engine_n_ranks(e), lk_engine_n_ranks(e) > 1 ? "s" : "", (long long)seed);
        if (lk_engine_n_ranks(e) > 1 && n_gen > 1)
            fprintf(stderr, "lockstep: decode per token %.2f ms = compute %.2f ms + network wait %.2f ms (head's view)\n",
                    1e3 * t_decode / (n_gen - 1), 1e3 * (t_decode - t_decode_comm) / (n_gen - 1), 1e3 * t_decode_comm / (n_gen - 1));
    }
    if (json && rc == 0) {
        json_t *o = json_object(), *pi = json_array(), *gi = json_array();
        for (int i = 0; i < n_ids; i++) json_array_append_new(pi, json_integer(ids[i]));
        for (int i = 0; i < n_gen; i++) json_array_append_new(gi, json_integer(gen[i]));
        json_object_set_new(o, "prompt_ids", pi);
        json_object_set_new(o, "generated_ids", gi);
        json_object_set_new(o, "text", json_stringn(out.text, out.len));
        json_object_set_new(o, "seed", json_integer(seed));
        json_object_set_new(o, "ranks", json_integer(lk_engine_n_ranks(e)));
        json_t *tm = json_object();
        json_object_set_new(tm, "load_s", json_real(t_load));
        json_object_set_new(tm, "prefill_s", json_real(t_prefill));
        json_object_set_new(tm, "prefill_tok_s", json_real(pre_tps));
        json_object_set_new(tm, "decode_s", json_real(t_decode));
        json_object_set_new(tm, "decode_tok_s", json_real(dec_tps));
        json_object_set_new(tm, "decode_network_wait_s", json_real(t_decode_comm));
        json_object_set_new(o, "timings", tm);
        char *s2 = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
        printf("%s\n", s2);
        free(s2);
        json_decref(o);
    }
    free(out.text);
    free(gen);
    free(ids);
    lk_sampler_free(s);
    lk_tokenizer_free(tok);
    lk_engine_close(e);
    return rc;
}
