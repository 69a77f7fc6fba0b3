/* lockstep chat — an interactive conversation on one node or a cluster,
 * rendered with the model's chat template (or --chat-template).
 *
 * Each turn: the whole conversation is rendered by the template (ending with
 * the opening of an assistant turn), tokenised, and sent to the session
 * (session/session.h) as one request: the session continues the sequence
 * that holds the previous turn, feeding only the tokens after the prefix it
 * shares with the new prompt (so a long conversation costs one new turn per
 * turn, not the whole history). The reply streams to stdout until an
 * end-of-generation token, -n tokens, or a full context, and joins the
 * history as text.
 *
 * Input is one user turn per line on stdin (a line ending in '\' continues on
 * the next), so it works piped as well as typed; "> " is shown only when
 * stdin is a terminal. Commands: /reset, /quit (or EOF), /help.
 * Replies go to stdout; everything else (notes, errors, timings) to stderr. */
#include "cli/cli.h"
#include "engine/engine.h"
#include "session/session.h"
#include "tokenizer/chat_template.h"
#include "cli/genflags.h"
#include "tokenizer/tokenizer.h"

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *SYNOPSIS = "-m FILE [-s SYSTEM] [--chat-template NAME] [options]  (user turns on stdin, one per line)";

/* Ctrl-C (interactive only) stops the reply being written, not the program,
 * as users of interactive chats expect; at the prompt it ends the chat. The
 * flag is this file's one process-wide singleton: all a handler may set. */
static volatile sig_atomic_t g_interrupted;
static void on_sigint(int sig) { (void)sig; g_interrupted = 1; }
/* While a reply is generated system calls restart (transports, the pool and
 * stdout need not see EINTR); at the prompt the read is interrupted so
 * Ctrl-C ends the chat at once. Installed before the engine starts local
 * ranks: forked ranks inherit it, so a Ctrl-C from the terminal (sent to the
 * whole process group) does not kill them in the middle of a reply. */
static void sigint_mode(bool restart) {
    struct sigaction sa = { 0 };
    sa.sa_handler = on_sigint;
    sa.sa_flags = restart ? SA_RESTART : 0;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

/* ======================================================================
 * the conversation
 * ==================================================================== */

typedef struct {
    lk_engine    *e;
    lk_tokenizer *tok;
    lk_session   *ses;            /* one sequence; the previous turn's KV stays in it for reuse */
    lk_sampler_params sp;
    lk_conv      *conv;           /* the messages, oldest first; the first may be the system prompt */
    int           n_ctx;
    int64_t       n_predict;      /* < 0: until end of turn or a full context */
    bool          verbose;
    /* totals for the summary line */
    int           n_replies;
    int64_t       n_fed, n_reused, n_gen, n_steps; /* n_steps: one-token decode steps (t_decode covers these) */
    double        t_prefill, t_decode;
} chat;

/* ======================================================================
 * one reply
 * ==================================================================== */

/* The reply as it streams: to stdout and into its text. Ctrl-C stops it
 * after the token being written (the session ends it as "stopped"). */
static bool reply_token(void *user, lk_request *r, int32_t token, const char *piece, int n) {
    lk_buf *text = user;
    if (n > 0) {
        lk_buf_put(text, piece, (size_t)n);
        fwrite(piece, 1, (size_t)n, stdout);
        fflush(stdout);
    }
    if (token < 0 || !g_interrupted) return true;
    g_interrupted = 0;
    return false;
}

/* Sends the prompt as one request and streams the reply; *reply is its text
 * (malloc'd). A failing engine (a peer gone) returns its status: the session
 * can then run nothing more. */
static lk_status generate(chat *c, const int32_t *prompt, int n_prompt, char **reply, char *err, size_t errlen) {
    lk_buf text = { 0 };
    lk_buf_put(&text, "", 0);
    lk_request_params rp = { .prompt = prompt, .n_prompt = n_prompt, .sampling = c->sp,
                             .max_new = c->n_predict >= 0 ? (int)LK_MIN(c->n_predict, 1 << 30) : -1,
                             .on_token = reply_token, .user = &text };
    lk_request *r = lk_session_submit(c->ses, &rp, err, errlen);
    if (!r) {
        free(text.p);
        return LK_ERR_ARG;
    }
    lk_status st = lk_session_run(c->ses, err, errlen);
    fputc('\n', stdout);
    fflush(stdout);
    lk_request_info in;
    lk_request_get(r, &in);
    if (in.n_gen > 0) {
        c->t_prefill += in.t_first - in.t_start;
        c->t_decode += in.t_done - in.t_first;
    }
    c->n_fed += in.n_prompt - in.n_reused;
    c->n_reused += in.n_reused;
    c->n_gen += in.n_gen;
    c->n_steps += LK_MAX(in.n_gen - 1, 0);
    c->n_replies++;
    lk_session_release(c->ses, r);
    if (st) {
        free(text.p);
        return st;
    }
    const char *why = in.finish == LK_FINISH_EOG ? "end of turn" : in.finish == LK_FINISH_LENGTH ? "-n limit"
                    : in.finish == LK_FINISH_STOPPED ? "interrupted" : lk_finish_to_string(in.finish);
    if (in.finish == LK_FINISH_STOPPED) fprintf(stderr, "lockstep chat: reply interrupted (Ctrl-C); it stays in the conversation\n");
    if (in.finish == LK_FINISH_CTX)
        fprintf(stderr, "lockstep chat: the context of %d tokens (--ctx) is full: the reply was cut; "
                        "the next turn drops the oldest messages (or /reset)\n", c->n_ctx);
    if (in.finish == LK_FINISH_KV)
        fprintf(stderr, "lockstep chat: the KV cache (--kv-budget) is full: the reply was cut\n");
    if (c->verbose)
        fprintf(stderr, "lockstep debug: turn: prompt %d tokens (%d reused from the cache, %d fed), reply %d tokens (%s)\n",
                in.n_prompt, in.n_reused, in.n_prompt - in.n_reused, in.n_gen, why);
    *reply = text.p;
    return LK_OK;
}

/* ======================================================================
 * the command
 * ==================================================================== */

/* One user turn from stdin: a line without its end; a line ending in '\'
 * continues on the next. NULL at EOF with nothing read. */
static char *read_turn(bool tty) {
    lk_buf t = { 0 };
    char *line = NULL;
    size_t cap = 0;
    if (tty) { g_interrupted = 0; sigint_mode(false); }
    for (;;) {
        if (tty) { fputs(t.n || t.p ? "... " : "> ", stdout); fflush(stdout); }
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0) {
            if (tty && g_interrupted) { fputc('\n', stdout); free(t.p); t.p = NULL; } /* Ctrl-C: end */
            break;
        }
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) n--;
        bool more = n > 0 && line[n - 1] == '\\';
        lk_buf_put(&t, line, (size_t)(more ? n - 1 : n));
        if (!more) break;
        lk_buf_put(&t, "\n", 1);
    }
    free(line);
    if (tty) sigint_mode(true);
    return t.p;
}

static char *read_file(const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        lk_fail(err, errlen, LK_ERR_IO, "--chat-template-file %s: cannot open", path);
        return NULL;
    }
    lk_buf t = { 0 };
    char buf[4096];
    size_t n;
    lk_buf_put(&t, "", 0);
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) lk_buf_put(&t, buf, n);
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(t.p);
        lk_fail(err, errlen, LK_ERR_IO, "--chat-template-file %s: read failed", path);
        return NULL;
    }
    return t.p;
}

static void chat_help(void) {
    fprintf(stderr, "commands: /reset (start a new conversation, keeping the system prompt), /quit (or end of input), /help; "
                    "end a line with \\ to continue the message on the next line\n");
}

int lk_cmd_chat(int argc, char **argv) {
    const char *system_prompt = NULL, *tmpl_name = NULL, *tmpl_file = NULL;
    int64_t n_predict = -1;
    bool verbose = false, no_reuse = false;
    lk_genflags f;
    lk_genflags_init(&f);
    char tmpl_help[512];
    snprintf(tmpl_help, sizeof tmpl_help, "chat template: a built-in name (%s) or Jinja text (default: the model's)",
             lk_chat_template_names());
    const lk_opt own[] = {
        { "--system", "-s", LK_OPT_STR, &system_prompt, "TEXT", "system prompt (kept across /reset)" },
        { "--chat-template", NULL, LK_OPT_STR, &tmpl_name, "NAME", tmpl_help },
        { "--chat-template-file", NULL, LK_OPT_STR, &tmpl_file, "FILE", "read the Jinja chat template from FILE" },
        { "--n-predict", "-n", LK_OPT_INT, &n_predict, "N", "most tokens per reply; -1 = until end of turn or a full context (default)" },
        { "--no-kv-reuse", NULL, LK_OPT_FLAG, &no_reuse, NULL, "feed the whole conversation every turn (slow; for checking the cache reuse)" },
        { "--verbose", "-v", LK_OPT_FLAG, &verbose, NULL, "more log output (the rendered prompt, its tokens, cache reuse per turn)" },
    };
    lk_opt opts[48];
    int no = 0;
    lk_genflags_opts(&f, opts, &no, 47);
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) opts[no++] = own[i];
    opts[no] = (lk_opt){ 0 };
    const char *pos[1];
    int np = lk_args_parse("chat", SYNOPSIS, opts, argc, argv, pos, 0);
    if (np == LK_ARGS_VERSION) return 0;
    if (np == LK_ARGS_HELP) {
        printf("\nIn the chat: /reset starts a new conversation (the system prompt stays), /quit or end of input ends;\n"
               "a line ending in \\ continues on the next line. Control-token text typed in a message (e.g. <|im_end|>)\n"
               "stays plain text: only the template writes control tokens.\n");
        return 0;
    }
    if (np < 0) return 2;
    if (!f.model) {
        fprintf(stderr, "lockstep chat: -m FILE is required (see 'lockstep chat --help')\n");
        return 2;
    }
    if (n_predict < -1 || n_predict == 0) {
        fprintf(stderr, "lockstep chat: -n must be -1 or positive (see 'lockstep chat --help')\n");
        return 2;
    }
    lk_engine_opts eo;
    lk_sampler_params sp;
    if (!lk_genflags_finish(&f, "chat", &eo, &sp)) return 2;
    if (tmpl_name && tmpl_file) {
        fprintf(stderr, "lockstep chat: give --chat-template or --chat-template-file, not both\n");
        return 2;
    }
    char err[LK_ERRLEN];
    const char *tmpl = NULL;
    char *tmpl_owned = NULL;
    /* a wrong template name fails before the model loads */
    if (tmpl_name && lk_chat_template_select(tmpl_name, NULL, &tmpl, err, sizeof err)) {
        fprintf(stderr, "lockstep chat: %s\n", err);
        return 2;
    }
    if (tmpl_file && !(tmpl = tmpl_owned = read_file(tmpl_file, err, sizeof err))) {
        fprintf(stderr, "lockstep chat: %s\n", err);
        return 2;
    }
    if (verbose) lk_log_set_level(LK_LOG_DEBUG);

    chat c = { .n_predict = n_predict, .verbose = verbose, .sp = sp };
    int rc = 0;
    bool tty = isatty(STDIN_FILENO);
    if (tty) sigint_mode(true);
    double t_load = lk_time_s();
    if (lk_engine_open(&eo, &c.e, err, sizeof err)) {
        fprintf(stderr, "lockstep chat: %s\n", err);
        free(tmpl_owned);
        return 1;
    }
    t_load = lk_time_s() - t_load;
    if (lk_tokenizer_load(lk_engine_gguf(c.e), &c.tok, err, sizeof err)) {
        fprintf(stderr, "lockstep chat: %s\n", err);
        rc = 1;
        goto out;
    }
    /* the model's template (a GGUF string is not NUL-terminated) */
    if (!tmpl) {
        const char *s = NULL;
        size_t len = 0;
        if (lk_gguf_get_str(lk_engine_gguf(c.e), "tokenizer.chat_template", &s, &len) && len) {
            tmpl_owned = lk_xmalloc(len + 1);
            memcpy(tmpl_owned, s, len);
            tmpl_owned[len] = 0;
        }
        if (!tmpl_owned) {
            /* as llama.cpp does: ChatML, said once, so the chat still works */
            fprintf(stderr, "lockstep chat: warning: the model has no tokenizer.chat_template: using ChatML "
                            "(choose one with --chat-template NAME)\n");
            tmpl_name = "chatml";
        }
        if (lk_chat_template_select(tmpl_owned ? NULL : tmpl_name, tmpl_owned, &tmpl, err, sizeof err)) {
            fprintf(stderr, "lockstep chat: %s\n", err);
            rc = 2;
            goto out;
        }
    }
    if (lk_chat_template_check(tmpl, err, sizeof err)) {
        fprintf(stderr, "lockstep chat: the %s chat template cannot be used: %s%s\n",
                tmpl_name || tmpl_file ? "chosen" : "model's", err,
                tmpl_name || tmpl_file ? "" : " (choose a built-in one with --chat-template NAME)");
        rc = 1;
        goto out;
    }
    lk_log(LK_LOG_DEBUG, "chat template: %s (looks like %s)", tmpl_name ? tmpl_name : tmpl_file ? tmpl_file : "the model's",
           lk_chat_template_guess(tmpl));
    c.n_ctx = lk_engine_n_ctx(c.e);
    if (lk_conv_create(c.tok, tmpl, &c.conv, err, sizeof err) ||
        lk_session_create(c.e, c.tok, &(lk_session_opts){ .parallel = 1, .no_reuse = no_reuse }, &c.ses, err, sizeof err)) {
        fprintf(stderr, "lockstep chat: %s\n", err);
        rc = 1;
        goto out;
    }
    if (system_prompt) lk_conv_push(c.conv, "system", system_prompt);

    if (tty) {
        fprintf(stderr, "lockstep chat: %s, %d rank%s, context %d tokens, template %s. ", f.model, lk_engine_n_ranks(c.e),
                lk_engine_n_ranks(c.e) > 1 ? "s" : "", c.n_ctx, tmpl_name ? tmpl_name : lk_chat_template_guess(tmpl));
        chat_help();
    }
    /* the reply's room when the context is full: -n, at most a quarter of the context */
    int reserve = n_predict > 0 ? (int)LK_MIN(n_predict, (int64_t)c.n_ctx / 4) : c.n_ctx / 4;
    for (char *line; (line = read_turn(tty)); free(line)) {
        const char *t = line;
        while (*t == ' ' || *t == '\t') t++;
        if (!*t) continue;
        if (!strcmp(t, "/quit") || !strcmp(t, "/exit")) { free(line); break; }
        if (!strcmp(t, "/help")) { chat_help(); continue; }
        if (!strcmp(t, "/reset")) {
            lk_conv_drop(c.conv, system_prompt ? 1 : 0, lk_conv_len(c.conv));
            /* the cache stays: the next prompt shares at least the system prompt with it */
            fprintf(stderr, "lockstep chat: new conversation\n");
            continue;
        }
        lk_conv_push(c.conv, "user", line);
        /* when the context is full the oldest exchanges go (a system prompt stays) */
        int32_t *prompt = NULL;
        int n_prompt = 0, dropped = 0;
        lk_status st = lk_conv_fit(c.conv, c.n_ctx, reserve, &prompt, &n_prompt, &dropped, err, sizeof err);
        if (dropped)
            fprintf(stderr, "lockstep chat: the context of %d tokens (--ctx) was full: dropped the oldest %d message%s\n",
                    c.n_ctx, dropped, dropped > 1 ? "s" : "");
        if (st) {
            fprintf(stderr, "lockstep chat: %s%s\n", err, st == LK_ERR_ARG ? "; not sent" : "");
            lk_conv_drop(c.conv, lk_conv_len(c.conv) - 1, lk_conv_len(c.conv));
            rc = 1;
            continue;
        }
        if (verbose) {
            fprintf(stderr, "lockstep debug: prompt ids:");
            for (int i = 0; i < n_prompt; i++) fprintf(stderr, " %d", prompt[i]);
            fputc('\n', stderr);
        }
        char *reply = NULL;
        st = generate(&c, prompt, n_prompt, &reply, err, sizeof err);
        free(prompt);
        if (st == LK_ERR_ARG) {    /* this turn cannot be sent (the KV budget): the chat goes on */
            fprintf(stderr, "lockstep chat: %s; not sent\n", err);
            lk_conv_drop(c.conv, lk_conv_len(c.conv) - 1, lk_conv_len(c.conv));
            rc = 1;
            continue;
        }
        if (st) {
            fprintf(stderr, "lockstep chat: %s\n", err);
            rc = 1;
            free(line);
            break;  /* the engine (or a peer) failed: its state is unknown */
        }
        lk_conv_push(c.conv, "assistant", reply);
        free(reply);
    }
    fprintf(stderr, "lockstep: load %.2f s | %d repl%s | prefill %" PRId64 " tokens %.1f tok/s (%" PRId64 " reused from the cache) | "
                    "decode %" PRId64 " tokens %.1f tok/s | %d rank%s | seed %lld\n",
            t_load, c.n_replies, c.n_replies == 1 ? "y" : "ies", c.n_fed, c.t_prefill > 0 ? c.n_fed / c.t_prefill : 0.0,
            c.n_reused, c.n_gen, c.t_decode > 0 && c.n_steps > 0 ? c.n_steps / c.t_decode : 0.0, lk_engine_n_ranks(c.e),
            lk_engine_n_ranks(c.e) > 1 ? "s" : "", (long long)f.seed);
out:
    lk_conv_free(c.conv);
    lk_session_free(c.ses);
    lk_tokenizer_free(c.tok);
    lk_engine_close(c.e);
    free(tmpl_owned);
    return rc;
}
