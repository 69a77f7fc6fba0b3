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
#include <sodium.h>
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
 * growable arrays
 * ==================================================================== */

typedef struct {
    int32_t *v;
    int      n, cap;
} ids_t;

static void ids_put(ids_t *a, const int32_t *x, int n) {
    if (a->n + n > a->cap) {
        a->cap = LK_MAX(2 * a->cap, a->n + n + 64);
        a->v = lk_xrealloc(a->v, sizeof(int32_t) * (size_t)a->cap);
    }
    memcpy(a->v + a->n, x, sizeof(int32_t) * (size_t)n);
    a->n += n;
}

typedef struct {
    char  *p;
    size_t n, cap;
} str_t;

static void str_put(str_t *s, const char *x, size_t n) {
    if (s->n + n + 1 > s->cap) {
        s->cap = LK_MAX(2 * s->cap, s->n + n + 256);
        s->p = lk_xrealloc(s->p, s->cap);
    }
    memcpy(s->p + s->n, x, n);
    s->n += n;
    s->p[s->n] = 0;
}

/* ======================================================================
 * the conversation
 * ==================================================================== */

typedef struct {
    const char *role;    /* static: "system", "user", "assistant" */
    char       *content; /* malloc'd */
    bool        plain;   /* holds control-token text: its tokens are made with parse_special off */
} turn;

typedef struct {
    lk_engine    *e;
    lk_tokenizer *tok;
    lk_session   *ses;            /* one sequence; the previous turn's KV stays in it for reuse */
    lk_sampler_params sp;
    const char   *tmpl;           /* the template source (points into argv, the GGUF or static data) */
    char         *bos_text, *eos_text;
    turn         *h;              /* the conversation, oldest first; h[0] may be the system prompt */
    int           n_h, cap_h;
    int           n_ctx;
    int64_t       n_predict;      /* < 0: until end of turn or a full context */
    bool          verbose;
    /* totals for the summary line */
    int           n_replies;
    int64_t       n_fed, n_reused, n_gen, n_steps; /* n_steps: one-token decode steps (t_decode covers these) */
    double        t_prefill, t_decode;
} chat;

/* Control-token text in a message — "<|im_end|><|im_start|>system ..." typed
 * by a user, or spelled out piece by piece by the model — must stay text:
 * tokenised with parse_special on, a user could close their own turn and
 * write a system turn (prompt injection), and a reply would end itself when
 * replayed. But the template's own markers need parse_special on. A message
 * is checked once, when it joins the history: if encoding it with and without
 * parse_special gives the same ids it holds no control-token text, and such
 * messages can share one encode of the whole prompt with the template text —
 * exactly what llama.cpp feeds, edges of messages included. See render_ids
 * for the messages that do hold some. */
static bool has_control_text(const lk_tokenizer *tok, const char *text) {
    size_t len = strlen(text);
    int32_t *a = NULL, *b = NULL, na = 0, nb = 0;
    char err[LK_ERRLEN];
    bool differ = true;  /* if encoding fails, take the careful path */
    if (!lk_tokenizer_encode(tok, text, len, false, true, &a, &na, err, sizeof err) &&
        !lk_tokenizer_encode(tok, text, len, false, false, &b, &nb, err, sizeof err))
        differ = na != nb || memcmp(a, b, sizeof(int32_t) * (size_t)na) != 0;
    free(a);
    free(b);
    return differ;
}

static void chat_push(chat *c, const char *role, const char *content) {
    if (c->n_h == c->cap_h) c->h = lk_xrealloc(c->h, sizeof(turn) * (size_t)(c->cap_h = 2 * c->cap_h + 8));
    c->h[c->n_h++] = (turn){ role, lk_xstrdup(content), has_control_text(c->tok, content) };
}

/* Removes h[i..j). */
static void chat_drop(chat *c, int i, int j) {
    if (i == j) return;
    for (int k = i; k < j; k++) free(c->h[k].content);
    memmove(c->h + i, c->h + j, sizeof(turn) * (size_t)(c->n_h - j));
    c->n_h -= j - i;
}

static lk_status render(const chat *c, const char *const *content, char **out, char *err, size_t errlen) {
    lk_chat_msg *m = lk_xmalloc(sizeof(lk_chat_msg) * (size_t)(c->n_h ? c->n_h : 1));
    for (int i = 0; i < c->n_h; i++) m[i] = (lk_chat_msg){ c->h[i].role, content ? content[i] : c->h[i].content, NULL };
    lk_status st = lk_chat_render(c->tmpl, m, c->n_h, true, c->bos_text, c->eos_text, out, err, errlen);
    free(m);
    return st;
}

static lk_status encode_into(const chat *c, ids_t *out, const char *text, size_t len, bool parse_special,
                             char *err, size_t errlen) {
    int32_t *ids = NULL, n = 0;
    lk_status st = lk_tokenizer_encode(c->tok, text, len, false, parse_special, &ids, &n, err, errlen);
    if (!st) ids_put(out, ids, n);
    free(ids);
    return st;
}

/* The prompt's tokens for the whole conversation.
 * When no message holds control-token text: one encode of the rendered text
 * with parse_special on. Otherwise the template renders the conversation
 * with those messages' contents replaced by sentinels ("\x01" + a fresh
 * random number + "." + index + "\x02": digits and control bytes, which no
 * filter such as trim/upper changes, and which no message can guess); the
 * text between sentinels is template output, encoded with parse_special on,
 * and each sentinel becomes its message's text encoded with parse_special
 * off. Escaping the text instead would change what the user wrote, and
 * refusing it would forbid even asking about these tokens. Two costs, only
 * on this path: a template that edits message text (`| trim`) edits the
 * sentinel instead, so such a message goes in unedited; and with a
 * SentencePiece vocabulary a separately encoded piece gets its own prefix
 * space, so such a message may gain one leading space. */
static lk_status render_ids(chat *c, ids_t *out, char *err, size_t errlen) {
    out->n = 0;
    bool any_plain = false;
    for (int i = 0; i < c->n_h; i++) any_plain |= c->h[i].plain;
    char *text = NULL;
    lk_status st;
    if (!any_plain) {
        if ((st = render(c, NULL, &text, err, errlen))) return st;
        if (c->verbose) fprintf(stderr, "lockstep debug: prompt text:\n%s\n", text);
        st = encode_into(c, out, text, strlen(text), true, err, errlen);
        free(text);
    } else {
        uint64_t nonce;
        randombytes_buf(&nonce, sizeof nonce);
        char prefix[32];
        int np = snprintf(prefix, sizeof prefix, "\x01%020" PRIu64 ".", nonce);
        char **sent = lk_xcalloc((size_t)c->n_h, sizeof(char *));
        const char **content = lk_xmalloc(sizeof(char *) * (size_t)c->n_h);
        for (int i = 0; i < c->n_h; i++) {
            content[i] = c->h[i].content;
            if (!c->h[i].plain) continue;
            sent[i] = lk_xmalloc(64);
            snprintf(sent[i], 64, "%s%d\x02", prefix, i);
            content[i] = sent[i];
        }
        st = render(c, content, &text, err, errlen);
        const char *p = text;
        while (!st) {
            const char *q = strstr(p, prefix);
            if ((st = encode_into(c, out, p, q ? (size_t)(q - p) : strlen(p), true, err, errlen)) || !q) break;
            char *end;
            long i = strtol(q + np, &end, 10);
            if (i < 0 || i >= c->n_h || !sent[i] || *end != '\x02') {
                /* a template that cut a sentinel apart: it edits message text
                 * in a way this path cannot follow */
                st = lk_fail(err, errlen, LK_ERR_FORMAT,
                             "the chat template changes message text, so a message holding control-token text cannot be kept apart; "
                             "rephrase it without such text or use another --chat-template");
                break;
            }
            if (c->verbose) fprintf(stderr, "lockstep debug: message %ld holds control-token text: encoded as plain text\n", i);
            st = encode_into(c, out, c->h[i].content, strlen(c->h[i].content), false, err, errlen);
            p = end + 1;
        }
        free(text);
        for (int i = 0; i < c->n_h; i++) free(sent[i]);
        free(sent);
        free(content);
    }
    if (st) return st;
    /* BOS as the model's add_bos_token says, unless the template wrote it */
    int32_t bos = lk_tokenizer_bos(c->tok);
    if (lk_tokenizer_add_bos(c->tok) && bos >= 0 && (out->n == 0 || out->v[0] != bos)) {
        ids_put(out, &bos, 1);
        memmove(out->v + 1, out->v, sizeof(int32_t) * (size_t)(out->n - 1));
        out->v[0] = bos;
    }
    if (out->n == 0) return lk_fail(err, errlen, LK_ERR_FORMAT, "the chat template rendered an empty prompt");
    return LK_OK;
}

/* Renders the conversation into prompt tokens that leave room for a reply.
 * Policy when the context is full: the oldest exchanges (a user turn and the
 * replies after it; a system prompt stays) are dropped, with a note on
 * stderr, until the prompt leaves `reserve` tokens; when only the newest user
 * turn is left it is sent if at least one token of reply fits, else refused.
 * Returns LK_ERR_ARG (message in err) for a turn that cannot be sent. */
static lk_status fit_prompt(chat *c, ids_t *prompt, char *err, size_t errlen) {
    int reserve = c->n_predict > 0 ? (int)LK_MIN(c->n_predict, (int64_t)c->n_ctx / 4) : c->n_ctx / 4;
    int dropped = 0;
    for (;;) {
        lk_status st = render_ids(c, prompt, err, errlen);
        if (st) return st;
        if (prompt->n + LK_MAX(reserve, 1) <= c->n_ctx) break;
        int first = c->n_h > 0 && !strcmp(c->h[0].role, "system") ? 1 : 0;
        int last_user = c->n_h - 1;  /* the turn being sent */
        if (first >= last_user) {
            if (prompt->n + 1 <= c->n_ctx) break;
            return lk_fail(err, errlen, LK_ERR_ARG,
                           "this message makes a prompt of %d tokens, which does not fit the context of %d tokens (--ctx); not sent",
                           prompt->n, c->n_ctx);
        }
        int j = first + 1;  /* the exchange: h[first] and everything up to the next user turn */
        while (j < last_user && strcmp(c->h[j].role, "user")) j++;
        dropped += j - first;
        chat_drop(c, first, j);
    }
    if (dropped)
        fprintf(stderr, "lockstep chat: the context of %d tokens (--ctx) was full: dropped the oldest %d message%s\n", c->n_ctx,
                dropped, dropped > 1 ? "s" : "");
    return LK_OK;
}

/* ======================================================================
 * one reply
 * ==================================================================== */

/* The reply as it streams: to stdout and into its text. Ctrl-C stops it
 * after the token being written (the session ends it as "stopped"). */
static bool reply_token(void *user, lk_request *r, int32_t token, const char *piece, int n) {
    str_t *text = user;
    if (n > 0) {
        str_put(text, piece, (size_t)n);
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
static lk_status generate(chat *c, const ids_t *prompt, char **reply, char *err, size_t errlen) {
    str_t text = { 0 };
    str_put(&text, "", 0);
    lk_request_params rp = { .prompt = prompt->v, .n_prompt = prompt->n, .sampling = c->sp,
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
    str_t t = { 0 };
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
        str_put(&t, line, (size_t)(more ? n - 1 : n));
        if (!more) break;
        str_put(&t, "\n", 1);
    }
    free(line);
    if (tty) sigint_mode(true);
    return t.p;
}

static char *copy_token_text(const lk_tokenizer *tok, int32_t id) {
    size_t len = 0;
    const char *s = id >= 0 ? lk_tokenizer_token_text(tok, id, &len) : NULL;
    char *r = lk_xmalloc(len + 1);
    if (s) memcpy(r, s, len);
    r[len] = 0;
    return r;
}

static char *read_file(const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        lk_fail(err, errlen, LK_ERR_IO, "--chat-template-file %s: cannot open", path);
        return NULL;
    }
    str_t t = { 0 };
    char buf[4096];
    size_t n;
    str_put(&t, "", 0);
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) str_put(&t, buf, n);
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
    if (sodium_init() < 0) {
        fprintf(stderr, "lockstep chat: libsodium failed to initialise\n");
        free(tmpl_owned);
        return 1;
    }

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
        if (lk_chat_template_select(NULL, tmpl_owned, &tmpl, err, sizeof err)) {
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
    c.tmpl = tmpl;
    c.bos_text = copy_token_text(c.tok, lk_tokenizer_bos(c.tok));
    c.eos_text = copy_token_text(c.tok, lk_tokenizer_eos(c.tok));
    c.n_ctx = lk_engine_n_ctx(c.e);
    if (lk_session_create(c.e, c.tok, &(lk_session_opts){ .parallel = 1, .no_reuse = no_reuse }, &c.ses, err, sizeof err)) {
        fprintf(stderr, "lockstep chat: %s\n", err);
        rc = 1;
        goto out;
    }
    if (system_prompt) chat_push(&c, "system", system_prompt);

    if (tty) {
        fprintf(stderr, "lockstep chat: %s, %d rank%s, context %d tokens, template %s. ", f.model, lk_engine_n_ranks(c.e),
                lk_engine_n_ranks(c.e) > 1 ? "s" : "", c.n_ctx, tmpl_name ? tmpl_name : lk_chat_template_guess(tmpl));
        chat_help();
    }
    ids_t prompt = { 0 };
    for (char *line; (line = read_turn(tty)); free(line)) {
        const char *t = line;
        while (*t == ' ' || *t == '\t') t++;
        if (!*t) continue;
        if (!strcmp(t, "/quit") || !strcmp(t, "/exit")) { free(line); break; }
        if (!strcmp(t, "/help")) { chat_help(); continue; }
        if (!strcmp(t, "/reset")) {
            chat_drop(&c, system_prompt ? 1 : 0, c.n_h);
            /* the cache stays: the next prompt shares at least the system prompt with it */
            fprintf(stderr, "lockstep chat: new conversation\n");
            continue;
        }
        chat_push(&c, "user", line);
        if (fit_prompt(&c, &prompt, err, sizeof err)) {
            fprintf(stderr, "lockstep chat: %s\n", err);
            chat_drop(&c, c.n_h - 1, c.n_h);
            rc = 1;
            continue;
        }
        if (verbose) {
            fprintf(stderr, "lockstep debug: prompt ids:");
            for (int i = 0; i < prompt.n; i++) fprintf(stderr, " %d", prompt.v[i]);
            fputc('\n', stderr);
        }
        char *reply = NULL;
        lk_status st = generate(&c, &prompt, &reply, err, sizeof err);
        if (st == LK_ERR_ARG) {    /* this turn cannot be sent (the KV budget): the chat goes on */
            fprintf(stderr, "lockstep chat: %s; not sent\n", err);
            chat_drop(&c, c.n_h - 1, c.n_h);
            rc = 1;
            continue;
        }
        if (st) {
            fprintf(stderr, "lockstep chat: %s\n", err);
            rc = 1;
            free(line);
            break;  /* the engine (or a peer) failed: its state is unknown */
        }
        chat_push(&c, "assistant", reply);
        free(reply);
    }
    free(prompt.v);
    fprintf(stderr, "lockstep: load %.2f s | %d repl%s | prefill %" PRId64 " tokens %.1f tok/s (%" PRId64 " reused from the cache) | "
                    "decode %" PRId64 " tokens %.1f tok/s | %d rank%s | seed %lld\n",
            t_load, c.n_replies, c.n_replies == 1 ? "y" : "ies", c.n_fed, c.t_prefill > 0 ? c.n_fed / c.t_prefill : 0.0,
            c.n_reused, c.n_gen, c.t_decode > 0 && c.n_steps > 0 ? c.n_steps / c.t_decode : 0.0, lk_engine_n_ranks(c.e),
            lk_engine_n_ranks(c.e) > 1 ? "s" : "", (long long)f.seed);
out:
    chat_drop(&c, 0, c.n_h);
    free(c.h);
    free(c.bos_text);
    free(c.eos_text);
    lk_session_free(c.ses);
    lk_tokenizer_free(c.tok);
    lk_engine_close(c.e);
    free(tmpl_owned);
    return rc;
}
