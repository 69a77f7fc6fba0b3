/* Conversations: chat messages rendered by a chat template into the prompt
 * tokens llama.cpp would feed (session.h has the contract). Moved here from
 * `chat` so the server renders the same way. */
#include "session/session.h"
#include "tokenizer/chat_template.h"

#include <inttypes.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *role, *content;  /* malloc'd; content NULL: `none` (an assistant turn that only calls tools) */
    char *fields;          /* malloc'd JSON object of extra members (tool_calls, ...) or NULL */
    bool  plain;           /* holds control-token text: its tokens are made with parse_special off */
} turn;

struct lk_conv {
    const lk_tokenizer *tok;
    const char         *tmpl;               /* borrowed */
    char               *bos_text, *eos_text;
    char               *extra;              /* JSON object of extra template variables (tools) or NULL */
    turn               *h;                  /* oldest first */
    int                 n_h, cap_h;
};

/* growable id list */
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

static char *copy_token_text(const lk_tokenizer *tok, int32_t id) {
    size_t len = 0;
    const char *s = id >= 0 ? lk_tokenizer_token_text(tok, id, &len) : NULL;
    char *r = lk_xmalloc(len + 1);
    if (s) memcpy(r, s, len);
    r[len] = 0;
    return r;
}

lk_status lk_conv_create(const lk_tokenizer *tok, const char *tmpl, lk_conv **out, char *err, size_t errlen) {
    *out = NULL;
    if (sodium_init() < 0) return lk_fail(err, errlen, LK_ERR_IO, "libsodium failed to initialise");
    lk_conv *c = lk_xcalloc(1, sizeof *c);
    c->tok = tok;
    c->tmpl = tmpl;
    c->bos_text = copy_token_text(tok, lk_tokenizer_bos(tok));
    c->eos_text = copy_token_text(tok, lk_tokenizer_eos(tok));
    *out = c;
    return LK_OK;
}

void lk_conv_free(lk_conv *c) {
    if (!c) return;
    lk_conv_drop(c, 0, c->n_h);
    free(c->h);
    free(c->bos_text);
    free(c->eos_text);
    free(c->extra);
    free(c);
}

int lk_conv_len(const lk_conv *c) { return c->n_h; }
const char *lk_conv_role(const lk_conv *c, int i) { return c->h[i].role; }
const char *lk_conv_content(const lk_conv *c, int i) { return c->h[i].content; }

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

void lk_conv_push(lk_conv *c, const char *role, const char *content) { lk_conv_push_ex(c, role, content, NULL); }

void lk_conv_push_ex(lk_conv *c, const char *role, const char *content, const char *fields_json) {
    if (c->n_h == c->cap_h) c->h = lk_xrealloc(c->h, sizeof(turn) * (size_t)(c->cap_h = 2 * c->cap_h + 8));
    c->h[c->n_h++] = (turn){ lk_xstrdup(role), content ? lk_xstrdup(content) : NULL,
                             fields_json ? lk_xstrdup(fields_json) : NULL,
                             content && has_control_text(c->tok, content) };
}

void lk_conv_set_extra(lk_conv *c, const char *extra_json) {
    free(c->extra);
    c->extra = extra_json ? lk_xstrdup(extra_json) : NULL;
}

void lk_conv_drop(lk_conv *c, int i, int j) {
    LK_ASSERT(0 <= i && i <= j && j <= c->n_h);
    if (i == j) return;
    for (int k = i; k < j; k++) {
        free(c->h[k].role);
        free(c->h[k].content);
        free(c->h[k].fields);
    }
    memmove(c->h + i, c->h + j, sizeof(turn) * (size_t)(c->n_h - j));
    c->n_h -= j - i;
}

static lk_status render(const lk_conv *c, const char *const *content, char **out, char *err, size_t errlen) {
    lk_chat_msg *m = lk_xmalloc(sizeof(lk_chat_msg) * (size_t)(c->n_h ? c->n_h : 1));
    for (int i = 0; i < c->n_h; i++)
        m[i] = (lk_chat_msg){ c->h[i].role, content ? content[i] : c->h[i].content, c->h[i].fields };
    lk_status st = lk_chat_render_ex(c->tmpl, m, c->n_h, true, c->bos_text, c->eos_text, c->extra, out, err, errlen);
    free(m);
    return st;
}

static lk_status encode_into(const lk_conv *c, ids_t *out, const char *text, size_t len, bool parse_special,
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
static lk_status render_ids(const lk_conv *c, ids_t *out, char *err, size_t errlen) {
    out->n = 0;
    bool any_plain = false;
    for (int i = 0; i < c->n_h; i++) any_plain |= c->h[i].plain;
    char *text = NULL;
    lk_status st;
    if (!any_plain) {
        if ((st = render(c, NULL, &text, err, errlen))) return st;
        if (lk_log_level() >= LK_LOG_DEBUG) fprintf(stderr, "lockstep debug: prompt text:\n%s\n", text);
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
            lk_log(LK_LOG_DEBUG, "message %ld holds control-token text: encoded as plain text", i);
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

lk_status lk_conv_fit(lk_conv *c, int n_ctx, int reserve, int32_t **ids, int *n, int *dropped, char *err,
                      size_t errlen) {
    ids_t prompt = { 0 };
    *ids = NULL;
    *n = *dropped = 0;
    for (;;) {
        lk_status st = render_ids(c, &prompt, err, errlen);
        if (st) { free(prompt.v); return st; }
        if (prompt.n + LK_MAX(reserve, 1) <= n_ctx) break;
        int first = c->n_h > 0 && !strcmp(c->h[0].role, "system") ? 1 : 0;
        int last_user = c->n_h - 1;  /* the turn being sent */
        if (first >= last_user) {
            if (prompt.n + 1 <= n_ctx) break;
            lk_fail(err, errlen, LK_ERR_ARG, "this message makes a prompt of %d tokens, which does not fit the context of %d "
                    "tokens (--ctx)", prompt.n, n_ctx);
            free(prompt.v);
            return LK_ERR_ARG;
        }
        int j = first + 1;  /* the exchange: h[first] and everything up to the next user turn */
        while (j < last_user && strcmp(c->h[j].role, "user")) j++;
        *dropped += j - first;
        lk_conv_drop(c, first, j);
    }
    *ids = prompt.v;
    *n = prompt.n;
    return LK_OK;
}
