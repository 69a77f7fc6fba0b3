/* lockstep run — generate text from a prompt, or from every prompt of a file
 * as concurrent sequences, on one node or a cluster. Both go through the
 * session layer (session/session.h), which owns the generate loop and the
 * stop conditions. */
#include "cli/cli.h"
#include "diag/diag.h"
#include "cli/genflags.h"
#include "engine/engine.h"
#include "parallel/trace.h"
#include "session/session.h"
#include "tokenizer/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One prompt: its text, ids, and the generated text (streamed to stdout for
 * a single prompt without --json, kept otherwise). */
typedef struct {
    char       *prompt;     /* malloc'd */
    size_t      prompt_len;
    int         line;       /* in the prompts file (0: -p) */
    int32_t    *ids;
    int32_t     n_ids;
    lk_request *r;
    char       *text;
    size_t      len, cap;
    bool        stream, done;
} job;

static bool on_token(void *user, lk_request *r, int32_t token, const char *piece, int n) {
    job *j = user;
    if (j->len + (size_t)n + 1 > j->cap) j->text = lk_xrealloc(j->text, j->cap = 2 * j->cap + (size_t)n + 256);
    memcpy(j->text + j->len, piece, (size_t)n);
    j->len += (size_t)n;
    j->text[j->len] = 0;
    if (j->stream && n > 0) {
        fwrite(piece, 1, (size_t)n, stdout);
        fflush(stdout);
    }
    if (token < 0) j->done = true;
    return true;
}

/* ======================================================================
 * the prompts file: one prompt per line, or JSON lines {"prompt": "..."}
 * ==================================================================== */

static void add_job(job **js, int *n, int *cap, const char *text, size_t len, int line) {
    if (*n == *cap) *js = lk_xrealloc(*js, sizeof(job) * (size_t)(*cap = 2 * *cap + 16));
    job *j = &(*js)[(*n)++];
    *j = (job){ .prompt = lk_xmalloc(len + 1), .prompt_len = len, .line = line };
    memcpy(j->prompt, text, len);
    j->prompt[len] = 0;
}

/* Blank lines are skipped; a line whose first non-blank character is '{' is
 * a JSON object with a "prompt" string (other keys are ignored); any other
 * line is the prompt itself. Errors name the file and line. */
static bool read_prompts(const char *path, job **js, int *n, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        lk_fail(err, errlen, LK_ERR_IO, "--prompts-file %s: %s", path, strerror(errno));
        return false;
    }
    char *line = NULL;
    size_t lcap = 0;
    int cap = 0, lineno = 0;
    bool ok = true;
    ssize_t len;
    while (ok && (len = getline(&line, &lcap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (p == line + len) continue;
        if (*p != '{') {
            add_job(js, n, &cap, line, (size_t)len, lineno);
            continue;
        }
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)len, JSON_ALLOW_NUL, &je);
        json_t *pr = o ? json_object_get(o, "prompt") : NULL;
        if (!o) {
            lk_fail(err, errlen, LK_ERR_FORMAT, "--prompts-file %s: line %d: malformed JSON: %s (column %d)", path, lineno,
                    je.text, je.column);
            ok = false;
        } else if (!json_is_object(o) || !json_is_string(pr)) {
            lk_fail(err, errlen, LK_ERR_FORMAT, "--prompts-file %s: line %d: expected an object with a \"prompt\" string",
                    path, lineno);
            ok = false;
        } else {
            add_job(js, n, &cap, json_string_value(pr), json_string_length(pr), lineno);
        }
        json_decref(o);
    }
    if (ok && ferror(f)) {
        lk_fail(err, errlen, LK_ERR_IO, "--prompts-file %s: read failed", path);
        ok = false;
    }
    if (ok && *n == 0) {
        lk_fail(err, errlen, LK_ERR_FORMAT, "--prompts-file %s: no prompts (blank lines are skipped)", path);
        ok = false;
    }
    free(line);
    fclose(f);
    return ok;
}

/* ======================================================================
 * output
 * ==================================================================== */

typedef struct {
    double prefill_s, prefill_tps, decode_s, decode_tps, comm_s;
    int    n_fed, n_gen;
} job_times;

static job_times times_of(const job *j) {
    lk_request_info in;
    lk_request_get(j->r, &in);
    job_times t = { .n_fed = in.n_prompt - in.n_reused, .n_gen = in.n_gen, .comm_s = in.decode_comm_s };
    if (in.n_gen > 0) {
        t.prefill_s = in.t_first - in.t_start;
        t.decode_s = in.t_done - in.t_first;
    }
    t.prefill_tps = t.prefill_s > 0 ? t.n_fed / t.prefill_s : 0;
    t.decode_tps = in.n_gen > 1 && t.decode_s > 0 ? (in.n_gen - 1) / t.decode_s : 0;
    return t;
}

static void print_json(const job *j, int64_t seed, int ranks, double t_load) {
    lk_request_info in;
    lk_request_get(j->r, &in);
    job_times t = times_of(j);
    json_t *o = json_object(), *pi = json_array(), *gi = json_array();
    for (int i = 0; i < in.n_prompt; i++) json_array_append_new(pi, json_integer(in.prompt[i]));
    for (int i = 0; i < in.n_gen; i++) json_array_append_new(gi, json_integer(in.gen[i]));
    json_object_set_new(o, "prompt_ids", pi);
    json_object_set_new(o, "generated_ids", gi);
    json_object_set_new(o, "text", json_stringn(j->text ? j->text : "", j->len));
    json_object_set_new(o, "seed", json_integer(seed));
    json_object_set_new(o, "ranks", json_integer(ranks));
    json_t *tm = json_object();
    json_object_set_new(tm, "load_s", json_real(t_load));
    /* nothing generated: the prompt was not fed, so there is no speed to give */
    json_object_set_new(tm, "prefill_s", t.n_gen > 0 ? json_real(t.prefill_s) : json_null());
    json_object_set_new(tm, "prefill_tok_s", t.n_gen > 0 ? json_real(t.prefill_tps) : json_null());
    json_object_set_new(tm, "decode_s", t.n_gen > 1 ? json_real(t.decode_s) : json_null());
    json_object_set_new(tm, "decode_tok_s", t.n_gen > 1 ? json_real(t.decode_tps) : json_null());
    json_object_set_new(tm, "decode_network_wait_s", json_real(t.comm_s));
    json_object_set_new(o, "timings", tm);
    char *s = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
    printf("%s\n", s);
    free(s);
    json_decref(o);
}

/* A prompt file's result without --json: a header naming the prompt (its
 * first 72 bytes, control characters as spaces), then the text. */
static void print_block(const job *j, int index, int n_jobs) {
    char head[80];
    size_t k = 0;
    for (; k < j->prompt_len && k < 72; k++) {
        unsigned char c = (unsigned char)j->prompt[k];
        head[k] = c < 0x20 || c == 0x7f ? ' ' : (char)c;
    }
    while (k > 0 && k < j->prompt_len && ((unsigned char)head[k] & 0xC0) == 0x80) k--; /* whole characters */
    head[k] = 0;
    printf("=== %d/%d: %s%s\n%s\n\n", index + 1, n_jobs, head, k < j->prompt_len ? "..." : "", j->text ? j->text : "");
}

/* ======================================================================
 * the command
 * ==================================================================== */

static const char *SYNOPSIS = "-m FILE (-p TEXT | -f FILE | --prompts-file FILE [--parallel N]) [options]";

/* The whole of a file, or of stdin for "-" (-p - and -f -): the prompt,
 * newlines included, as llama.cpp's --file reads it. */
static char *slurp(const char *what, const char *path, size_t *len, char *err, size_t errlen) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) {
        lk_fail(err, errlen, LK_ERR_IO, "%s %s: %s", what, path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0, k;
    char *buf = lk_xmalloc(cap);
    while ((k = fread(buf + n, 1, cap - n - 1, f)) > 0)
        if ((n += k) + 1 == cap) buf = lk_xrealloc(buf, cap *= 2);
    bool bad = ferror(f);
    if (f != stdin) fclose(f);
    if (bad) {
        free(buf);
        lk_fail(err, errlen, LK_ERR_IO, "%s %s: read failed", what, path);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

int lk_cmd_run(int argc, char **argv) {
    const char *prompt = NULL, *prompts_file = NULL, *prompt_file = NULL, *trace = NULL;
    int64_t n_predict = 128, parallel = -1;  /* -1: not given */
    bool json = false, no_bos = false, verbose = false, ignore_eos = false;
    lk_genflags f;
    lk_genflags_init(&f);
    lk_opt opts[48];
    int no = 0;
    const lk_opt own[] = {
        { "--prompt", "-p", LK_OPT_STR, &prompt, "TEXT", "prompt text; - reads it from stdin (this, -f or --prompts-file is required)" },
        { "--file", "-f", LK_OPT_STR, &prompt_file, "FILE", "the prompt is the whole of FILE (- for stdin)" },
        { "--prompts-file", NULL, LK_OPT_STR, &prompts_file, "FILE",
          "run every prompt of FILE as concurrent sequences: one prompt per line, or JSON lines {\"prompt\": \"...\"} "
          "(for prompts with newlines; other keys are ignored); blank lines are skipped; results in input order" },
        { "--parallel", NULL, LK_OPT_INT, &parallel, "N",
          "most sequences at once (engine slots; default: every prompt of the file, at most --batch: a step "
          "decodes one token of each); the others wait their turn" },
        { "--n-predict", "-n", LK_OPT_INT, &n_predict, "N",
          "tokens to generate per prompt; -1 = until end of generation or a full context (default 128)" },
        { "--no-bos", NULL, LK_OPT_FLAG, &no_bos, NULL, "do not add the BOS token" },
        { "--ignore-eos", NULL, LK_OPT_FLAG, &ignore_eos, NULL, "keep generating after end-of-generation tokens" },
        { "--json", NULL, LK_OPT_FLAG, &json, NULL,
          "one JSON object per prompt (prompt_ids, generated_ids, text, seed, ranks, timings) instead of text" },
        { "--verbose", "-v", LK_OPT_FLAG, &verbose, NULL, "more log output" },
        { "--trace", NULL, LK_OPT_STR, &trace, "FILE",
          "write Chrome trace events (Perfetto, chrome://tracing) of every step of this host's ranks: steps, compute, "
          "collectives per layer, one track per rank (workers of --workers are not traced)" },
    };
    lk_genflags_opts(&f, opts, &no, 47);
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) opts[no++] = own[i];
    opts[no] = (lk_opt){ 0 };
    const char *pos[1];
    int np = lk_args_parse("run", SYNOPSIS, opts, argc, argv, pos, 0);
    if (np == LK_ARGS_VERSION) return 0;
    if (np == LK_ARGS_HELP) {
        printf("\nWith --prompts-file every prompt is a sequence of its own: each step decodes one token of every\n"
               "running sequence and fills the rest of the batch (--batch) with prompt chunks. Every prompt gets the\n"
               "same sampling settings and seed, so its tokens are those of 'run -p' with that prompt alone.\n"
               "Without --json each prompt's text is printed as a block ('=== N/M: prompt'), in input order.\n");
        return 0;
    }
    if (np < 0) return 2;
    if (!f.model || (!prompt && !prompts_file && !prompt_file)) {
        fprintf(stderr, "lockstep run: %s is required (see 'lockstep run --help')\n",
                !f.model ? "-m FILE" : "-p TEXT, -f FILE or --prompts-file FILE");
        return 2;
    }
    if ((prompt != NULL) + (prompts_file != NULL) + (prompt_file != NULL) > 1) {
        fprintf(stderr, "lockstep run: give one of -p TEXT, -f FILE or --prompts-file FILE\n");
        return 2;
    }
    if (n_predict < -1) {
        fprintf(stderr, "lockstep run: -n %lld: give N >= 0, or -1 for until end of generation or a full context\n",
                (long long)n_predict);
        return 2;
    }
    if (parallel != -1 && (parallel < 1 || parallel > 4096)) {
        fprintf(stderr, "lockstep run: --parallel must be between 1 and 4096 (see 'lockstep run --help')\n");
        return 2;
    }
    lk_engine_opts eo;
    lk_sampler_params sp;
    if (!lk_genflags_finish(&f, "run", &eo, &sp)) return 2;
    if (verbose) lk_log_set_level(LK_LOG_DEBUG);
    int64_t seed = f.seed;

    char err[LK_ERRLEN];
    job *js = NULL;
    int n_jobs = 0;
    if (prompts_file) {
        if (!read_prompts(prompts_file, &js, &n_jobs, err, sizeof err)) {
            fprintf(stderr, "lockstep run: %s\n", err);
            for (int i = 0; i < n_jobs; i++) free(js[i].prompt);
            free(js);
            return 2;
        }
    } else if (prompt_file || !strcmp(prompt, "-")) {
        size_t len = 0;
        char *text = slurp(prompt_file ? "-f" : "-p", prompt_file ? prompt_file : "-", &len, err, sizeof err);
        if (!text) {
            fprintf(stderr, "lockstep run: %s\n", err);
            return 2;
        }
        add_job(&js, &n_jobs, &(int){ 0 }, text, len, 0);
        free(text);
    } else {
        add_job(&js, &n_jobs, &(int){ 0 }, prompt, strlen(prompt), 0);
    }
    eo.max_seqs = parallel > 0 ? (int)parallel : prompts_file ? LK_MIN(n_jobs, eo.n_batch > 0 ? eo.n_batch : 512) : 1;

    int rc = 0;
    lk_engine *e = NULL;
    lk_tokenizer *tok = NULL;
    lk_session *ses = NULL;
    if (trace && lk_trace_start(trace, err, sizeof err)) { /* before the ranks are forked: they inherit it */
        fprintf(stderr, "lockstep run: %s\n", err);
        rc = 1;
        goto out;
    }
    double t_load = lk_time_s();
    if (lk_engine_open(&eo, &e, err, sizeof err)) {
        fprintf(stderr, "lockstep run: %s\n", err);
        rc = 1;
        goto out;
    }
    t_load = lk_time_s() - t_load;
    if (lk_tokenizer_load(lk_engine_gguf(e), &tok, err, sizeof err) ||
        lk_session_create(e, tok, &(lk_session_opts){ .parallel = (int)eo.max_seqs }, &ses, err, sizeof err)) {
        fprintf(stderr, "lockstep run: %s\n", err);
        rc = 1;
        goto out;
    }
    if (parallel > lk_session_parallel(ses))
        lk_log(LK_LOG_WARN, "--parallel %lld: the engine has %d sequence slots; running %d at once", (long long)parallel,
               lk_engine_max_seqs(e), lk_session_parallel(ses));

    /* tokenise and queue every prompt (they start in this order) */
    for (int i = 0; i < n_jobs && rc == 0; i++) {
        job *j = &js[i];
        char where[64] = "";
        if (prompts_file) snprintf(where, sizeof where, "prompt %d (line %d): ", i + 1, j->line);
        if (lk_tokenizer_encode(tok, j->prompt, j->prompt_len, !no_bos, false, &j->ids, &j->n_ids, err, sizeof err)) {
            fprintf(stderr, "lockstep run: %s%s\n", where, err);
            rc = 1;
            break;
        }
        if (no_bos && j->n_ids > 0 && j->ids[0] == lk_tokenizer_bos(tok)) memmove(j->ids, j->ids + 1, sizeof(int32_t) * (size_t)--j->n_ids);
        if (j->n_ids == 0) {
            fprintf(stderr, "lockstep run: %sthe prompt is empty after tokenisation (and no BOS is added)\n", where);
            rc = 2;
            break;
        }
        j->stream = !json && !prompts_file;
        lk_request_params rp = { .prompt = j->ids, .n_prompt = j->n_ids, .sampling = sp, .max_new = n_predict < 0 ? -1 : (int)LK_MIN(n_predict, 1 << 30),
                                 .ignore_eos = ignore_eos, .on_token = on_token, .user = j };
        if (!(j->r = lk_session_submit(ses, &rp, err, sizeof err))) {
            fprintf(stderr, "lockstep run: %s%s\n", where, err);
            rc = 2;
        }
    }

    /* generate; results in input order as soon as they and all before them are done */
    lk_energy *en = rc == 0 ? lk_energy_open() : NULL;   /* joules, where the machine counts them */
    double j_gen = lk_energy_joules(en);
    double t_gen = lk_time_s();
    int printed = 0;
    for (bool busy = rc == 0; busy;) {
        if (lk_session_step(ses, &busy, err, sizeof err)) {
            fprintf(stderr, "\nlockstep run: %s\n", err);
            rc = 1;
            break;
        }
        for (; prompts_file && printed < n_jobs && js[printed].done; printed++) {
            if (json) print_json(&js[printed], seed, lk_engine_n_ranks(e), t_load);
            else print_block(&js[printed], printed, n_jobs);
            fflush(stdout);
        }
    }
    t_gen = lk_time_s() - t_gen;
    j_gen = lk_energy_joules(en) - j_gen;
    for (int i = 0; rc == 0 && i < n_jobs; i++) {
        char which[48] = "";
        if (prompts_file) snprintf(which, sizeof which, "prompt %d: ", i + 1);
        if (lk_request_finish(js[i].r) == LK_FINISH_CTX)
            lk_log(LK_LOG_WARN, "%scontext of %d tokens is full; stopped", which, lk_engine_n_ctx(e));
        if (lk_request_finish(js[i].r) == LK_FINISH_KV)
            lk_log(LK_LOG_WARN, "%sthe KV cache (--kv-budget) is full; stopped", which);
    }

    int ranks = lk_engine_n_ranks(e);
    if (!prompts_file && (rc == 0 || rc == 1) && js[0].r) {
        job_times t = times_of(&js[0]);
        if (!json && rc == 0) {
            printf("\n");
            fflush(stdout); /* before the stderr summary, also when stdout is a pipe */
        }
        /* speeds only where something was measured: -n 0 feeds nothing, one
         * token has no decode step */
        char speed[160];
        if (t.n_gen == 0)
            snprintf(speed, sizeof speed, "prompt %d tokens, nothing generated%s", js[0].n_ids, n_predict == 0 ? " (-n 0)" : "");
        else if (t.n_gen == 1)
            snprintf(speed, sizeof speed, "prefill %d tokens %.1f tok/s | decode 1 token", t.n_fed, t.prefill_tps);
        else
            snprintf(speed, sizeof speed, "prefill %d tokens %.1f tok/s | decode %d tokens %.1f tok/s", t.n_fed,
                     t.prefill_tps, t.n_gen, t.decode_tps);
        fprintf(stderr, "lockstep: load %.2f s | %s | %d rank%s | seed %lld\n", t_load, speed, ranks, ranks > 1 ? "s" : "",
                (long long)seed);
        if (ranks > 1 && t.n_gen > 1)
            fprintf(stderr, "lockstep: decode per token %.2f ms = compute %.2f ms + network wait %.2f ms (head's view)\n",
                    1e3 * t.decode_s / (t.n_gen - 1), 1e3 * (t.decode_s - t.comm_s) / (t.n_gen - 1),
                    1e3 * t.comm_s / (t.n_gen - 1));
        if (json && rc == 0) print_json(&js[0], seed, ranks, t_load);
    } else if (prompts_file && rc == 0) {
        int64_t fed = 0, reused = 0, gen = 0;
        for (int i = 0; i < n_jobs; i++) {
            lk_request_info in;
            lk_request_get(js[i].r, &in);
            fed += in.n_prompt - in.n_reused;
            reused += in.n_reused;
            gen += in.n_gen;
        }
        fprintf(stderr, "lockstep: load %.2f s | %d prompts, %d at once | prefill %lld tokens (%lld reused) | "
                        "%lld tokens generated in %.2f s: %.1f tok/s in all | %d rank%s | seed %lld\n",
                t_load, n_jobs, lk_session_parallel(ses), (long long)fed, (long long)reused, (long long)gen, t_gen,
                t_gen > 0 ? gen / t_gen : 0.0, ranks, ranks > 1 ? "s" : "", (long long)seed);
    }
    int64_t n_generated = 0;
    for (int i = 0; rc == 0 && i < n_jobs; i++) {
        lk_request_info in;
        lk_request_get(js[i].r, &in);
        n_generated += in.n_gen;
    }
    if (en && rc == 0 && t_gen > 0)
        fprintf(stderr, "lockstep: energy %.1f J while generating: %.1f W average, %.3f J per generated token (%s; the whole machine)\n",
                j_gen, j_gen / t_gen, n_generated > 0 ? j_gen / (double)n_generated : 0.0, lk_energy_source(en));
    lk_energy_close(en);
out:
    lk_session_free(ses);
    for (int i = 0; i < n_jobs; i++) {
        free(js[i].prompt);
        free(js[i].ids);
        free(js[i].text);
    }
    free(js);
    lk_tokenizer_free(tok);
    lk_engine_close(e);
    int tr_ranks, tr_events;
    if (trace && lk_trace_finish(&tr_ranks, &tr_events, err, sizeof err)) {
        fprintf(stderr, "lockstep run: %s\n", err);
        rc = rc ? rc : 1;
    } else if (trace) {
        fprintf(stderr, "lockstep: trace of %d rank%s (%d events) in %s\n", tr_ranks, tr_ranks == 1 ? "" : "s", tr_events,
                trace);
    }
    return rc;
}
