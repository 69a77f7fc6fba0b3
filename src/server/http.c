/* The server's HTTP side: libmicrohttpd glue, the OpenAI request parser and
 * the response writers (server.h has the contract).
 *
 * A connection's life: libmicrohttpd reads the headers; the first call of
 * the access handler answers 431 (an OpenAI error object) when they take
 * more than max_header bytes (libmicrohttpd's own memory limit is twice
 * that and more, so only headers far over the limit get its plain 431
 * page), routes the request and checks the key and the announced length; the body
 * arrives in pieces (at most max_body bytes: 413; all of it within
 * request_timeout of the connection's start: 408); the last call parses the
 * JSON, renders and tokenises, queues the request and suspends the
 * connection. The scheduler resumes it when there is something to write:
 * the whole response, or (stream) the first token, after which a content
 * reader hands out Server-Sent Events and suspends itself whenever it has
 * written everything made so far. A reaper thread closes connections that
 * take longer than request_timeout to send a request (a slow-loris client
 * gets 408 and a closed socket, and holds one connection meanwhile). */
#include "server/server_impl.h"
#include "diag/diag.h"
#include "tokenizer/chat_template.h"

#include <arpa/inet.h>
#include <limits.h>
#include <stdarg.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* per connection (libmicrohttpd's socket context): for the reaper */
typedef struct conn_ctx {
    int              fd;
    double           t_mark;     /* accepted, or its last request completed */
    bool             busy;       /* a whole request arrived: its response is being made or sent */
    bool             served;     /* it completed a request before (idle keep-alive: closed quietly) */
    bool             reaped;
    struct conn_ctx *prev, *next;
} conn_ctx;

typedef struct {
    lk_server *s;
    pthread_t  reaper;
    bool       reaper_started;
    conn_ctx  *conns;
    int        n_conns;
} http_state;

static http_state *HS(lk_server *s);

/* ======================================================================
 * JSON helpers
 * ==================================================================== */

/* Bytes as valid UTF-8 (invalid sequences become U+FFFD), for JSON strings. */
static char *utf8_fix(const char *s, size_t n, size_t *out_n) {
    char *o = lk_xmalloc(3 * n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len && i + len <= n;
        for (size_t j = 1; ok && j < len; j++) ok = ((unsigned char)s[i + j] >> 6) == 2;
        if (ok && len == 2) ok = c >= 0xc2;
        if (ok && len == 3) {
            unsigned c1 = (unsigned char)s[i + 1];
            ok = !(c == 0xe0 && c1 < 0xa0) && !(c == 0xed && c1 >= 0xa0);
        }
        if (ok && len == 4) {
            unsigned c1 = (unsigned char)s[i + 1];
            ok = c <= 0xf4 && !(c == 0xf0 && c1 < 0x90) && !(c == 0xf4 && c1 >= 0x90);
        }
        if (ok && len == 1 && c == 0) ok = false;   /* NUL: JSON can carry it, C strings cannot */
        if (ok) {
            memcpy(o + k, s + i, len);
            k += len;
            i += len;
        } else {
            memcpy(o + k, "\xef\xbf\xbd", 3);
            k += 3;
            i++;
        }
    }
    o[k] = 0;
    *out_n = k;
    return o;
}

static json_t *jstr(const char *s, size_t n) {
    size_t m;
    char *f = utf8_fix(s, n, &m);
    json_t *j = json_stringn(f, m);
    free(f);
    return j ? j : json_string("");
}

static json_t *jbytes(const char *s, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

static const char *status_type(int st) {
    switch (st) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 408: return "timeout_error";
    case 429: return "rate_limit_error";
    case 499: return "cancelled";
    default: return st >= 500 ? "server_error" : "invalid_request_error";
    }
}

static json_t *error_obj(int st, const char *msg, const char *param) {
    return json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", msg, "type", status_type(st), "param",
                     param ? json_string(param) : json_null(), "code",
                     st == 401 ? json_string("invalid_api_key") : json_null());
}

/* ======================================================================
 * responses
 * ==================================================================== */

/* An idle kept-alive connection is closed after --timeout (the reaper):
 * clients that read the hint close theirs first, so a request never meets
 * a connection being closed under it. */
static void keep_alive_hint(lk_server *s, struct MHD_Response *resp) {
    char v[32];
    snprintf(v, sizeof v, "timeout=%d", (int)LK_MAX(1.0, s->o.request_timeout - 1));
    MHD_add_response_header(resp, "Keep-Alive", v);
}

static enum MHD_Result send_text(struct MHD_Connection *c, lk_server *s, int status, const char *type, char *body,
                                 size_t n) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(n, body, MHD_RESPMEM_MUST_FREE);
    MHD_add_response_header(resp, "Content-Type", type);
    keep_alive_hint(s, resp);
    if (status == 401) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    if (status == 431) MHD_add_response_header(resp, "Connection", "close"); /* such a client is not kept */
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    pthread_mutex_lock(&s->mu);
    srv_count_status(s, status);
    pthread_mutex_unlock(&s->mu);
    return ret;
}

static enum MHD_Result send_json(struct MHD_Connection *c, lk_server *s, int status, json_t *j) {
    char *body = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!body) body = strdup("{}");
    size_t n = strlen(body);
    body = lk_xrealloc(body, n + 2);   /* jansson allocates with malloc (no allocator of ours is set) */
    body[n] = '\n';
    body[n + 1] = 0;
    return send_text(c, s, status, "application/json", body, n + 1);
}

static enum MHD_Result send_error(struct MHD_Connection *c, lk_server *s, int status, const char *msg, const char *param) {
    return send_json(c, s, status, error_obj(status, msg, param));
}

/* ======================================================================
 * parsing a request
 * ==================================================================== */

typedef struct {
    char msg[600];
    char param[80];   /* a copy: the name may point into the request's JSON, freed before the answer */
} perr;

static bool fail(perr *e, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(perr *e, const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    return false;
}

static bool num_in(json_t *v, const char *name, double lo, double hi, double *out, perr *e) {
    if (json_is_null(v)) return true;
    if (!json_is_number(v)) return fail(e, name, "'%s' must be a number", name);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return fail(e, name, "'%s' must be between %g and %g (got %g)", name, lo, hi, x);
    *out = x;
    return true;
}

static bool int_in(json_t *v, const char *name, long long lo, long long hi, long long *out, perr *e) {
    if (json_is_null(v)) return true;
    if (!json_is_integer(v)) return fail(e, name, "'%s' must be an integer", name);
    long long x = json_integer_value(v);
    if (x < lo || x > hi) return fail(e, name, "'%s' must be between %lld and %lld (got %lld)", name, lo, hi, x);
    *out = x;
    return true;
}

static bool bool_of(json_t *v, const char *name, bool *out, perr *e) {
    if (json_is_null(v)) return true;
    if (!json_is_boolean(v)) return fail(e, name, "'%s' must be true or false", name);
    *out = json_is_true(v);
    return true;
}

/* The text of a message's content: a string, null, or a list of parts of
 * which only text is understood. *text NULL for null. */
static bool content_text(json_t *v, int i, char **text, perr *e) {
    *text = NULL;
    if (!v || json_is_null(v)) return true;
    if (json_is_string(v)) {
        *text = lk_xstrdup(json_string_value(v));
        return true;
    }
    if (!json_is_array(v)) return fail(e, "messages", "messages[%d].content must be a string, null or a list of parts", i);
    lk_buf b = { 0 };
    lk_buf_put(&b, "", 0);
    size_t k;
    json_t *part;
    json_array_foreach(v, k, part) {
        json_t *t = json_object_get(part, "type");
        json_t *tx = json_object_get(part, "text");
        if (!json_is_string(t) || strcmp(json_string_value(t), "text") || !json_is_string(tx)) {
            free(b.p);
            return fail(e, "messages", "messages[%d].content[%zu]: only parts of type \"text\" are supported", i, k);
        }
        lk_buf_put(&b, json_string_value(tx), json_string_length(tx));
    }
    *text = b.p;
    return true;
}

static void random_id(char *out, size_t cap, const char *prefix) {
    unsigned char r[12];
    randombytes_buf(r, sizeof r);
    int n = snprintf(out, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof r && (size_t)n + 2 < cap; i++) n += snprintf(out + n, cap - (size_t)n, "%02x", r[i]);
}

/* The fields every completion request shares. */
static bool common_field(lk_server *s, srv_req *r, const char *k, json_t *v, perr *e, bool *handled, bool chat) {
    *handled = true;
    double x;
    long long n;
    if (!strcmp(k, "model")) {
        if (!json_is_string(v) && !json_is_null(v)) return fail(e, k, "'model' must be a string");
    } else if (!strcmp(k, "stream")) {
        return bool_of(v, k, &r->stream, e);
    } else if (!strcmp(k, "stream_options")) {
        if (json_is_null(v)) return true;
        if (!json_is_object(v)) return fail(e, k, "'stream_options' must be an object");
        const char *kk;
        json_t *vv;
        json_object_foreach(v, kk, vv) {
            if (strcmp(kk, "include_usage")) return fail(e, k, "unknown field 'stream_options.%s'", kk);
            if (!bool_of(vv, "stream_options.include_usage", &r->include_usage, e)) return false;
        }
    } else if (!strcmp(k, "max_tokens") || !strcmp(k, "max_completion_tokens")) {
        n = r->max_new;
        if (!int_in(v, k, 1, 1 << 30, &n, e)) return false;
        if (!json_is_null(v) && n > s->n_ctx)
            return fail(e, k, "'%s' is %lld, more than the context of %d tokens (--ctx)", k, n, s->n_ctx);
        r->max_new = (int)n;
    } else if (!strcmp(k, "temperature")) {
        x = r->sp.temp;
        if (!num_in(v, k, 0, 2, &x, e)) return false;
        r->sp.temp = (float)x;
    } else if (!strcmp(k, "top_p")) {
        x = r->sp.top_p;
        if (!num_in(v, k, 0, 1, &x, e)) return false;
        r->sp.top_p = (float)x;
    } else if (!strcmp(k, "min_p")) {
        x = r->sp.min_p;
        if (!num_in(v, k, 0, 1, &x, e)) return false;
        r->sp.min_p = (float)x;
    } else if (!strcmp(k, "top_k")) {
        n = r->sp.top_k;
        if (!int_in(v, k, 0, 1 << 20, &n, e)) return false;
        r->sp.top_k = (int)n;
    } else if (!strcmp(k, "seed")) {
        n = 0;
        if (!json_is_null(v) && !int_in(v, k, LLONG_MIN, LLONG_MAX, &n, e)) return false;
        if (!json_is_null(v)) r->sp.seed = (uint64_t)n;
    } else if (!strcmp(k, "presence_penalty")) {
        x = r->sp.presence_penalty;
        if (!num_in(v, k, -2, 2, &x, e)) return false;
        r->sp.presence_penalty = (float)x;
    } else if (!strcmp(k, "frequency_penalty")) {
        x = r->sp.freq_penalty;
        if (!num_in(v, k, -2, 2, &x, e)) return false;
        r->sp.freq_penalty = (float)x;
    } else if (!strcmp(k, "repeat_penalty")) {
        x = r->sp.repeat_penalty;
        if (!num_in(v, k, 0.01, 100, &x, e)) return false;
        r->sp.repeat_penalty = (float)x;
    } else if (!strcmp(k, "stop")) {
        if (json_is_null(v)) return true;
        json_t *arr = json_is_string(v) ? json_pack("[O]", v) : json_incref(v);
        bool ok = json_is_array(arr) && json_array_size(arr) <= 16;
        size_t i;
        json_t *it;
        if (ok) json_array_foreach(arr, i, it) ok = ok && json_is_string(it) && json_string_length(it) > 0 &&
                                                       json_string_length(it) <= 256;
        if (!ok) {
            json_decref(arr);
            return fail(e, k, "'stop' must be a string or a list of at most 16 strings of 1 to 256 bytes");
        }
        r->n_stop = (int)json_array_size(arr);
        r->stop = lk_xcalloc((size_t)r->n_stop + 1, sizeof(char *));
        json_array_foreach(arr, i, it) {
            r->stop[i] = lk_xstrdup(json_string_value(it));
            r->stop_longest = LK_MAX(r->stop_longest, strlen(r->stop[i]));
        }
        json_decref(arr);
    } else if (!strcmp(k, "n")) {
        n = 1;
        if (!int_in(v, k, 1, 1, &n, e)) return fail(e, k, "only 'n': 1 is supported");
    } else if (!strcmp(k, "ignore_eos")) {
        return bool_of(v, k, &r->ignore_eos, e);
    } else if (!strcmp(k, "user") || !strcmp(k, "store") || !strcmp(k, "metadata") || !strcmp(k, "service_tier")) {
        /* accepted and ignored: they do not change the output */
    } else if (!strcmp(k, "logit_bias")) {
        if (!json_is_null(v) && !(json_is_object(v) && json_object_size(v) == 0))
            return fail(e, k, "'logit_bias' is not supported");
    } else {
        (void)chat;
        *handled = false;
    }
    return true;
}

/* The prompt of a chat: messages through the chat template. */
static bool chat_prompt(lk_server *s, srv_req *r, json_t *msgs, json_t *tools, json_t *kwargs, perr *e) {
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return fail(e, "messages", "'messages' must be a non-empty list");
    lk_conv *cv = NULL;
    char err[LK_ERRLEN];
    if (lk_conv_create(s->tok, s->tmpl, &cv, err, sizeof err)) return fail(e, NULL, "%s", err);
    bool ok = true;
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        if (!json_is_object(m)) { ok = fail(e, "messages", "messages[%zu] must be an object", i); break; }
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) { ok = fail(e, "messages", "messages[%zu].role must be a string", i); break; }
        const char *rs = json_string_value(role);
        if (strcmp(rs, "system") && strcmp(rs, "developer") && strcmp(rs, "user") && strcmp(rs, "assistant") &&
            strcmp(rs, "tool")) {
            ok = fail(e, "messages", "messages[%zu].role \"%.40s\" is not one of system, developer, user, assistant, tool", i, rs);
            break;
        }
        json_t *fields = json_object();
        const char *k;
        json_t *v;
        json_object_foreach(m, k, v) {
            if (!strcmp(k, "role") || !strcmp(k, "content")) continue;
            if (!strcmp(k, "name") || !strcmp(k, "tool_call_id") || !strcmp(k, "reasoning_content")) {
                if (!json_is_string(v)) { ok = fail(e, "messages", "messages[%zu].%s must be a string", i, k); break; }
            } else if (!strcmp(k, "tool_calls")) {
                if (!json_is_array(v)) { ok = fail(e, "messages", "messages[%zu].tool_calls must be a list", i); break; }
                /* templates read arguments as an object: OpenAI sends them as JSON text */
                json_t *tc = json_deep_copy(v);
                size_t j;
                json_t *call;
                json_array_foreach(tc, j, call) {
                    json_t *fn = json_object_get(call, "function");
                    json_t *args = fn ? json_object_get(fn, "arguments") : NULL;
                    if (json_is_string(args)) {
                        json_t *parsed = json_loads(json_string_value(args), 0, NULL);
                        if (parsed) json_object_set_new(fn, "arguments", parsed);
                    }
                }
                json_object_set_new(fields, k, tc);
                continue;
            } else {
                ok = fail(e, "messages", "unknown field 'messages[%zu].%s'", i, k);
                break;
            }
            json_object_set(fields, k, v);
        }
        char *text = NULL;
        if (ok) ok = content_text(json_object_get(m, "content"), (int)i, &text, e);
        if (ok && !text && strcmp(rs, "assistant"))
            ok = fail(e, "messages", "messages[%zu].content is required for role \"%s\"", i, rs);
        if (ok) {
            char *fj = json_object_size(fields) ? json_dumps(fields, JSON_COMPACT) : NULL;
            lk_conv_push_ex(cv, strcmp(rs, "developer") ? rs : "system", text, fj);
            free(fj);
        }
        free(text);
        json_decref(fields);
        if (!ok) break;
    }
    if (ok && (tools || kwargs)) {
        json_t *extra = kwargs ? json_deep_copy(kwargs) : json_object();
        if (tools) json_object_set(extra, "tools", tools);
        char *x = json_dumps(extra, JSON_COMPACT);
        lk_conv_set_extra(cv, x);
        free(x);
        json_decref(extra);
    }
    if (ok) {
        int32_t *ids = NULL;
        int n = 0, dropped = 0;
        lk_status st = lk_conv_fit(cv, 1 << 30, 1, &ids, &n, &dropped, err, sizeof err);
        if (st) ok = fail(e, "messages", "%s", err);
        else {
            r->prompt = ids;
            r->n_prompt = n;
        }
    }
    lk_conv_free(cv);
    return ok;
}

/* Builds r from a chat or completion request body; false with e set. */
static bool parse_request(lk_server *s, srv_req *r, const char *body, size_t n, perr *e) {
    json_error_t je;
    json_t *j = json_loadb(body, n, 0, &je);
    if (!j) return fail(e, NULL, "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    if (!json_is_object(j)) {
        json_decref(j);
        return fail(e, NULL, "the body must be a JSON object");
    }
    bool chat = r->kind == RQ_CHAT;
    r->sp = s->o.defaults;
    randombytes_buf(&r->sp.seed, sizeof r->sp.seed);
    r->max_new = chat ? s->o.default_max_tokens : 16;
    if (r->max_new < 0) r->max_new = -1;
    bool ok = true, have_lp = false;
    long long top_lp = 0;
    json_t *msgs = NULL, *prompt = NULL, *tools = NULL, *kwargs = NULL;
    bool tool_none = false;
    const char *k;
    json_t *v;
    json_object_foreach(j, k, v) {
        bool handled;
        if (!(ok = common_field(s, r, k, v, e, &handled, chat))) break;
        if (handled) continue;
        if (chat && !strcmp(k, "messages")) msgs = v;
        else if (chat && !strcmp(k, "logprobs")) ok = bool_of(v, k, &r->want_lp, e);
        else if (chat && !strcmp(k, "top_logprobs")) ok = int_in(v, k, 0, SRV_MAX_TOP, &top_lp, e);
        else if (chat && !strcmp(k, "tools")) {
            if (json_is_null(v)) continue;
            if (!json_is_array(v)) { ok = fail(e, k, "'tools' must be a list"); break; }
            size_t i;
            json_t *t;
            json_array_foreach(v, i, t) {
                json_t *fn = json_object_get(t, "function");
                if (!json_is_object(t) || !json_is_object(fn) || !json_is_string(json_object_get(fn, "name"))) {
                    ok = fail(e, k, "tools[%zu] must be {\"type\": \"function\", \"function\": {\"name\": ...}}", i);
                    break;
                }
            }
            tools = json_array_size(v) ? v : NULL;
        } else if (chat && !strcmp(k, "tool_choice")) {
            if (json_is_string(v)) {
                const char *c = json_string_value(v);
                if (!strcmp(c, "none")) tool_none = true;
                else if (strcmp(c, "auto") && strcmp(c, "required"))
                    ok = fail(e, k, "'tool_choice' must be \"none\", \"auto\", \"required\" or an object");
            } else if (!json_is_object(v) && !json_is_null(v)) ok = fail(e, k, "'tool_choice' must be a string or an object");
        } else if (chat && !strcmp(k, "parallel_tool_calls")) {
            bool b;
            ok = bool_of(v, k, &b, e);
        } else if (chat && !strcmp(k, "response_format")) {
            json_t *t = json_object_get(v, "type");
            if (!json_is_null(v) && !(json_is_string(t) && !strcmp(json_string_value(t), "text")))
                ok = fail(e, k, "only 'response_format' {\"type\": \"text\"} is supported");
        } else if (chat && !strcmp(k, "chat_template_kwargs")) {
            if (!json_is_object(v) && !json_is_null(v)) ok = fail(e, k, "'chat_template_kwargs' must be an object");
            else kwargs = json_is_object(v) ? v : NULL;
        } else if (!chat && !strcmp(k, "prompt")) prompt = v;
        else if (!chat && !strcmp(k, "logprobs")) {
            ok = int_in(v, k, 0, 5, &top_lp, e);
            have_lp = !json_is_null(v);
        } else if (!chat && !strcmp(k, "echo")) {
            bool b = false;
            if ((ok = bool_of(v, k, &b, e)) && b) ok = fail(e, k, "'echo': true is not supported");
        } else if (!chat && !strcmp(k, "suffix")) {
            if (!json_is_null(v)) ok = fail(e, k, "'suffix' is not supported");
        } else if (!chat && !strcmp(k, "best_of")) {
            long long b = 1;
            if (!int_in(v, k, 1, 1, &b, e)) ok = fail(e, k, "only 'best_of': 1 is supported");
        } else ok = fail(e, k, "unknown field '%s'", k);
        if (!ok) break;
    }
    if (ok && !chat) {
        r->want_lp = have_lp;
    }
    if (ok && top_lp && chat && !r->want_lp) ok = fail(e, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r->top_lp = (int)top_lp;
    if (ok && chat) {
        if (!msgs) ok = fail(e, "messages", "'messages' is required");
        else {
            r->tools = tools && !tool_none;
            ok = chat_prompt(s, r, msgs, tools && !tool_none ? tools : NULL, kwargs, e);
        }
    }
    if (ok && !chat) {
        if (json_is_array(prompt) && json_array_size(prompt) == 1 && json_is_string(json_array_get(prompt, 0)))
            prompt = json_array_get(prompt, 0);
        if (!prompt) ok = fail(e, "prompt", "'prompt' is required");
        else if (json_is_string(prompt)) {
            char err[LK_ERRLEN];
            if (lk_tokenizer_encode(s->tok, json_string_value(prompt), json_string_length(prompt), true, false, &r->prompt,
                                    &r->n_prompt, err, sizeof err))
                ok = fail(e, "prompt", "%s", err);
        } else if (json_is_array(prompt) && json_array_size(prompt) > 0) {
            size_t i;
            json_t *t;
            r->n_prompt = (int)LK_MIN(json_array_size(prompt), (size_t)1 << 30);
            r->prompt = lk_xmalloc(sizeof(int32_t) * (size_t)r->n_prompt);
            json_array_foreach(prompt, i, t) {
                if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= s->n_vocab) {
                    ok = fail(e, "prompt", "'prompt' as a list must hold token ids between 0 and %lld (item %zu)",
                              (long long)s->n_vocab - 1, i);
                    break;
                }
                r->prompt[i] = (int32_t)json_integer_value(t);
            }
        } else ok = fail(e, "prompt", "'prompt' must be a string, a list of one string, or a list of token ids");
        if (ok && r->n_prompt == 0) ok = fail(e, "prompt", "'prompt' is empty");
    }
    if (ok && r->n_prompt >= s->n_ctx)
        ok = fail(e, chat ? "messages" : "prompt",
                  "the prompt has %d tokens, but the context is %d tokens (--ctx): it must leave room for one more",
                  r->n_prompt, s->n_ctx);
    json_decref(j);
    return ok;
}

/* ======================================================================
 * writing results
 * ==================================================================== */

bool srv_parse_request(lk_server *s, srv_req *r, const char *body, size_t n, char msg[600], char param[80]) {
    perr e = { { 0 }, { 0 } };
    bool ok = parse_request(s, r, body, n, &e);
    if (!ok) {
        memcpy(msg, e.msg, sizeof e.msg);
        memcpy(param, e.param, sizeof e.param);
    }
    return ok;
}

static const char *finish_reason(const srv_req *r, bool calls) {
    if (calls) return "tool_calls";
    switch (r->finish) {
    case SRV_FINISH_STOP:
    case LK_FINISH_EOG:
    case LK_FINISH_STOPPED:
    case LK_FINISH_CANCELLED: return "stop";
    default: return "length";
    }
}

static json_t *piece_obj(lk_server *s, int32_t id, float lp, bool chat) {
    char buf[1024];
    int32_t n = lk_tokenizer_piece(s->tok, id, false, buf, sizeof buf);
    if (n < 0) n = 0;
    if (chat) return json_pack("{s:o, s:f, s:o}", "token", jstr(buf, (size_t)n), "logprob", (double)lp, "bytes", jbytes(buf, (size_t)n));
    (void)lp;
    return jstr(buf, (size_t)n);
}

/* logprobs for the entries [i0, i1) */
static json_t *lp_json(lk_server *s, const srv_req *r, int i0, int i1) {
    bool chat = r->kind == RQ_CHAT;
    if (chat) {
        json_t *content = json_array();
        for (int i = i0; i < i1; i++) {
            const srv_lp *e = &r->lp[i];
            json_t *o = piece_obj(s, e->id, isfinite(e->lp) ? e->lp : -9999.0f, true);
            json_t *top = json_array();
            for (int t = 0; t < e->n_top; t++) json_array_append_new(top, piece_obj(s, e->top_id[t], e->top_lp[t], true));
            json_object_set_new(o, "top_logprobs", top);
            json_array_append_new(content, o);
        }
        return json_pack("{s:o}", "content", content);
    }
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (int i = i0; i < i1; i++) {
        const srv_lp *e = &r->lp[i];
        json_array_append_new(toks, piece_obj(s, e->id, 0, false));
        json_array_append_new(lps, json_real(isfinite(e->lp) ? e->lp : -9999.0));
        json_t *t = json_object();
        for (int k = 0; k < e->n_top; k++) {
            json_t *p = piece_obj(s, e->top_id[k], 0, false);
            json_object_set_new(t, json_string_value(p), json_real(e->top_lp[k]));
            json_decref(p);
        }
        json_array_append_new(tops, t);
        json_array_append_new(offs, json_integer((json_int_t)e->a));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops, "text_offset", offs);
}

static json_t *usage_json(const srv_req *r) {
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", r->n_prompt, "completion_tokens", r->n_gen, "total_tokens",
                     r->n_prompt + r->n_gen, "prompt_tokens_details", "cached_tokens", r->n_reused);
}

/* entries whose text lies before `end` */
static int lp_before(const srv_req *r, size_t end) {
    int k = 0;
    while (k < r->n_lp && r->lp[k].a < end) k++;
    return k;
}

/* The whole response of a finished non-streaming request (under mu). */
static json_t *full_response(lk_server *s, srv_req *r) {
    bool chat = r->kind == RQ_CHAT;
    char *calls = NULL, *content = NULL;
    int n_calls = r->tools ? lk_srv_parse_tool_calls(r->text.p ? r->text.p : "", r->text.n, &calls, &content) : 0;
    json_t *choice;
    json_t *lp = r->want_lp ? lp_json(s, r, 0, lp_before(r, r->text.n)) : json_null();
    if (chat) {
        json_t *msg = json_pack("{s:s}", "role", "assistant");
        if (n_calls) {
            json_object_set_new(msg, "content", content ? json_string(content) : json_null());
            json_object_set_new(msg, "tool_calls", json_loads(calls, 0, NULL));
        } else {
            json_object_set_new(msg, "content", jstr(r->text.p ? r->text.p : "", r->text.n));
        }
        choice = json_pack("{s:i, s:o, s:o, s:s}", "index", 0, "message", msg, "logprobs", lp, "finish_reason",
                           finish_reason(r, n_calls > 0));
    } else {
        choice = json_pack("{s:o, s:i, s:o, s:s}", "text", jstr(r->text.p ? r->text.p : "", r->text.n), "index", 0,
                           "logprobs", lp, "finish_reason", finish_reason(r, false));
    }
    free(calls);
    free(content);
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:[o], s:o}", "id", r->id, "object", chat ? "chat.completion" : "text_completion",
                     "created", (json_int_t)r->created, "model", s->model_name, "system_fingerprint", "lockstep",
                     "choices", choice, "usage", usage_json(r));
}

static void sse(lk_buf *b, json_t *j) {
    char *t = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    lk_buf_put(b, "data: ", 6);
    lk_buf_put(b, t, strlen(t));
    lk_buf_put(b, "\n\n", 2);
    free(t);
}

static json_t *chunk(lk_server *s, const srv_req *r, json_t *choice) {
    bool chat = r->kind == RQ_CHAT;
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:o}", "id", r->id, "object", chat ? "chat.completion.chunk" : "text_completion",
                     "created", (json_int_t)r->created, "model", s->model_name, "system_fingerprint", "lockstep",
                     "choices", choice ? json_pack("[o]", choice) : json_array());
}

/* Formats what is new since the last call into r->out (under mu). */
static void stream_more(lk_server *s, srv_req *r) {
    bool chat = r->kind == RQ_CHAT;
    if (!r->head_sent) {
        r->head_sent = true;
        if (chat)
            sse(&r->out, chunk(s, r, json_pack("{s:i, s:{s:s, s:s}, s:n, s:n}", "index", 0, "delta", "role", "assistant",
                                               "content", "", "logprobs", "finish_reason")));
    }
    bool done = r->state == ST_DONE;
    size_t end = done ? r->text.n : r->safe;
    /* with tools, text from where a call starts is parsed at the end */
    char *calls = NULL, *content = NULL;
    int n_calls = 0;
    if (done && r->tools && !r->err_status) {
        size_t t = r->tool_at != SIZE_MAX ? r->tool_at : r->text.n;
        if (t < r->text.n) {
            n_calls = lk_srv_parse_tool_calls(r->text.p + t, r->text.n - t, &calls, &content);
            if (n_calls) end = t;
        }
    }
    if (end > r->sent || (r->want_lp && lp_before(r, end) > r->lp_sent)) {
        /* whole characters only: the text is cut at token edges, which are character edges */
        int i1 = r->want_lp ? lp_before(r, end) : 0;
        json_t *lp = r->want_lp ? lp_json(s, r, r->lp_sent, i1) : json_null();
        json_t *txt = jstr(r->text.p + r->sent, end - r->sent);
        json_t *c = chat ? json_pack("{s:i, s:{s:o}, s:o, s:n}", "index", 0, "delta", "content", txt, "logprobs", lp, "finish_reason")
                         : json_pack("{s:o, s:i, s:o, s:n}", "text", txt, "index", 0, "logprobs", lp, "finish_reason");
        sse(&r->out, chunk(s, r, c));
        r->sent = end;
        r->lp_sent = i1;
    }
    if (done && !r->tail_sent) {
        r->tail_sent = true;
        if (r->err_status && r->err_status != 499) {
            json_t *eo = error_obj(r->err_status, r->err, NULL);
            sse(&r->out, eo);
        } else {
            if (n_calls) {
                json_t *arr = json_loads(calls, 0, NULL);
                size_t i;
                json_t *call;
                json_array_foreach(arr, i, call) json_object_set_new(call, "index", json_integer((json_int_t)i));
                json_t *delta = json_pack("{s:o}", "tool_calls", arr);
                if (content) json_object_set_new(delta, "content", json_string(content));
                sse(&r->out, chunk(s, r, json_pack("{s:i, s:o, s:n, s:n}", "index", 0, "delta", delta, "logprobs", "finish_reason")));
            }
            json_t *c = chat ? json_pack("{s:i, s:{}, s:n, s:s}", "index", 0, "delta", "logprobs", "finish_reason",
                                         finish_reason(r, n_calls > 0))
                             : json_pack("{s:s, s:i, s:n, s:s}", "text", "", "index", 0, "logprobs", "finish_reason",
                                         finish_reason(r, false));
            sse(&r->out, chunk(s, r, c));
            if (r->include_usage) {
                json_t *u = chunk(s, r, NULL);
                json_object_set_new(u, "usage", usage_json(r));
                sse(&r->out, u);
            }
        }
        lk_buf_put(&r->out, "data: [DONE]\n\n", 14);
    }
    free(calls);
    free(content);
}

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    srv_req *r = cls;
    lk_server *s = r->srv;
    pthread_mutex_lock(&s->mu);
    if (r->gone) {
        pthread_mutex_unlock(&s->mu);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    if (r->out_off == r->out.n) {
        r->out.n = r->out_off = 0;
        if (!r->tail_sent) stream_more(s, r);
        if (r->out.n == 0) {
            if (r->tail_sent) {
                pthread_mutex_unlock(&s->mu);
                return MHD_CONTENT_READER_END_OF_STREAM;
            }
            r->suspended = true;
            MHD_suspend_connection(r->conn);
            pthread_mutex_unlock(&s->mu);
            return 0;
        }
    }
    size_t n = LK_MIN(max, r->out.n - r->out_off);
    memcpy(buf, r->out.p + r->out_off, n);
    r->out_off += n;
    pthread_mutex_unlock(&s->mu);
    return (ssize_t)n;
}

static void sse_free(void *cls) {
    srv_req *r = cls;
    lk_server *s = r->srv;
    pthread_mutex_lock(&s->mu);
    srv_req_unref(s, r);
    pthread_mutex_unlock(&s->mu);
}

/* ======================================================================
 * metrics, health, models
 * ==================================================================== */

static void hist_text(lk_buf *b, const char *name, const char *help, const uint64_t *h, const double *bounds, int nb,
                      double sum, uint64_t n) {
    lk_buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t acc = 0;
    for (int i = 0; i < nb; i++) {
        acc += h[i];
        lk_buf_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, bounds[i], (unsigned long long)acc);
    }
    lk_buf_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", name, (unsigned long long)n, name, sum,
                   name, (unsigned long long)n);
}

static enum MHD_Result metrics(struct MHD_Connection *c, lk_server *s) {
    lk_buf b = { 0 };
    pthread_mutex_lock(&s->mu);
    lk_buf_printf(&b, "# HELP lockstep_requests_total HTTP responses by status code.\n# TYPE lockstep_requests_total counter\n");
    for (int i = 100; i < 600; i++)
        if (s->status_count[i]) lk_buf_printf(&b, "lockstep_requests_total{status=\"%d\"} %llu\n", i, (unsigned long long)s->status_count[i]);
    lk_buf_printf(&b,
                   "# HELP lockstep_prompt_tokens_total Prompt tokens of finished requests (reused ones included).\n"
                   "# TYPE lockstep_prompt_tokens_total counter\nlockstep_prompt_tokens_total %llu\n"
                   "# HELP lockstep_prompt_tokens_reused_total Prompt tokens taken from the prefix cache.\n"
                   "# TYPE lockstep_prompt_tokens_reused_total counter\nlockstep_prompt_tokens_reused_total %llu\n"
                   "# HELP lockstep_generated_tokens_total Generated tokens of finished requests.\n"
                   "# TYPE lockstep_generated_tokens_total counter\nlockstep_generated_tokens_total %llu\n",
                   (unsigned long long)s->prompt_tokens, (unsigned long long)s->reused_tokens,
                   (unsigned long long)s->gen_tokens);
    hist_text(&b, "lockstep_time_to_first_token_seconds", "From a request's arrival to its first token.", s->ttft_hist,
              srv_ttft_bounds, SRV_TTFT_BUCKETS, s->ttft_sum, s->ttft_n);
    hist_text(&b, "lockstep_inter_token_latency_seconds", "Between a request's consecutive tokens.", s->itl_hist,
              srv_itl_bounds, SRV_ITL_BUCKETS, s->itl_sum, s->itl_n);
    lk_buf_printf(&b,
                   "# HELP lockstep_queue_depth Requests waiting to start.\n# TYPE lockstep_queue_depth gauge\nlockstep_queue_depth %d\n"
                   "# HELP lockstep_running_sequences Requests decoding now.\n# TYPE lockstep_running_sequences gauge\n"
                   "lockstep_running_sequences %d\n"
                   "# HELP lockstep_kv_pages_used KV cache pages in use (kept prefixes included).\n# TYPE lockstep_kv_pages_used gauge\n"
                   "lockstep_kv_pages_used %lld\n"
                   "# HELP lockstep_kv_pages_free KV cache pages free.\n# TYPE lockstep_kv_pages_free gauge\nlockstep_kv_pages_free %lld\n"
                   "# HELP lockstep_steps_total Engine steps.\n# TYPE lockstep_steps_total counter\nlockstep_steps_total %llu\n"
                   "# HELP lockstep_engine_failures_total Times the engine failed (a rank lost).\n"
                   "# TYPE lockstep_engine_failures_total counter\nlockstep_engine_failures_total %llu\n"
                   "# HELP lockstep_ready 1 when serving, 0 when loading or degraded.\n# TYPE lockstep_ready gauge\nlockstep_ready %d\n",
                   s->waiting + s->n_inbox, s->running, (long long)(s->pages_total - s->pages_free), (long long)s->pages_free,
                   (unsigned long long)s->steps, (unsigned long long)s->engine_failures,
                   s->state == SRV_READY);
    /* per rank: rank 0 times its own steps, workers tell theirs with each heartbeat */
    static const char *const rank_metric[2][2] = {
        {"lockstep_rank_compute_seconds_total", "Compute time of the engine's steps, per rank (workers: up to 250 ms behind)."},
        {"lockstep_rank_comm_seconds_total", "Time waiting on the network (collectives, hand-offs) in the engine's steps, per rank."},
    };
    for (int k = 0; k < 2; k++) {
        lk_buf_printf(&b, "# HELP %s %s\n# TYPE %s counter\n%s{rank=\"0\"} %.6f\n", rank_metric[k][0], rank_metric[k][1],
                       rank_metric[k][0], rank_metric[k][0], k ? s->comm_s : s->compute_s);
        for (int r = 1; r < s->n_ranks; r++)
            lk_buf_printf(&b, "%s{rank=\"%d\"} %.6f\n", rank_metric[k][0], r, s->rank_s[r][k]);
    }
    pthread_mutex_unlock(&s->mu);
    if (s->energy)   /* outside the lock: the counters are files */
        lk_buf_printf(&b, "# HELP lockstep_energy_joules_total Energy this machine used since the server started (%s; the whole "
                          "machine, not only this process).\n# TYPE lockstep_energy_joules_total counter\n"
                          "lockstep_energy_joules_total %.3f\n", lk_energy_source(s->energy), lk_energy_joules(s->energy));
    return send_text(c, s, 200, "text/plain; version=0.0.4", b.p, b.n);
}

static enum MHD_Result health(struct MHD_Connection *c, lk_server *s) {
    pthread_mutex_lock(&s->mu);
    srv_state st = s->state;
    json_t *j = json_pack("{s:s}", "status", st == SRV_READY ? "ok" : st == SRV_LOADING ? "loading" : st == SRV_DEGRADED ? "degraded"
                                                                 : st == SRV_FAILED ? "failed" : "stopping");
    if (st != SRV_READY && st != SRV_LOADING) json_object_set_new(j, "reason", jstr(s->reason, strlen(s->reason)));
    if (st == SRV_READY) {
        json_object_set_new(j, "running", json_integer(s->running));
        json_object_set_new(j, "waiting", json_integer(s->waiting + s->n_inbox));
    }
    pthread_mutex_unlock(&s->mu);
    return send_json(c, s, st == SRV_READY ? 200 : 503, j);
}

static json_t *model_obj(lk_server *s) {
    return json_pack("{s:s, s:s, s:I, s:s, s:{s:i}}", "id", s->model_name, "object", "model", "created",
                     (json_int_t)s->t_start_wall, "owned_by", "lockstep", "meta", "n_ctx", s->n_ctx);
}

/* ======================================================================
 * the access handler
 * ==================================================================== */

static bool key_ok(lk_server *s, struct MHD_Connection *c) {
    if (!s->o.api_key) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7)) return false;
    h += 7;
    size_t n = strlen(h), m = strlen(s->o.api_key);
    return n == m && sodium_memcmp(h, s->o.api_key, n) == 0;
}

static conn_ctx *ctx_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* Answers a finished (or failed) request on its connection (non-stream, or a
 * stream that failed before its first token). Under mu. */
static enum MHD_Result answer_done(struct MHD_Connection *c, lk_server *s, srv_req *r) {
    if (r->err_status) {
        if (r->err_status == 499) return MHD_NO;
        json_t *e = error_obj(r->err_status, r->err, NULL);
        pthread_mutex_unlock(&s->mu);
        enum MHD_Result ret = send_json(c, s, r->err_status, e);
        pthread_mutex_lock(&s->mu);
        return ret;
    }
    json_t *j = full_response(s, r);
    pthread_mutex_unlock(&s->mu);
    enum MHD_Result ret = send_json(c, s, 200, j);
    pthread_mutex_lock(&s->mu);
    return ret;
}

static enum MHD_Result count_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    *(size_t *)cls += strlen(key) + (value ? strlen(value) : 0) + 4; /* "key: value\r\n" */
    return MHD_YES;
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    lk_server *s = cls;
    srv_req *r = *con_cls;
    if (!r) {
        bool post = !strcmp(method, "POST"), get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
        bool is_chat = !strcmp(url, "/v1/chat/completions") || !strcmp(url, "/chat/completions");
        bool is_cmpl = !strcmp(url, "/v1/completions") || !strcmp(url, "/completions");
        size_t hb = strlen(method) + strlen(url) + 12; /* the request line */
        MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &hb);
        if (hb > s->o.max_header) {
            char msg[200];
            snprintf(msg, sizeof msg, "the request's headers take %zu bytes, over the limit of %zu bytes", hb, s->o.max_header);
            return send_error(c, s, 431, msg, NULL);
        }
        if (!strcmp(url, "/health") || !strcmp(url, "/v1/health")) {
            if (!get) return send_error(c, s, 405, "use GET for /health", NULL);
            return health(c, s);
        }
        if (!strcmp(url, "/metrics")) {
            if (!get) return send_error(c, s, 405, "use GET for /metrics", NULL);
            return metrics(c, s);
        }
        bool is_models = !strcmp(url, "/v1/models") || !strncmp(url, "/v1/models/", 11);
        if (!is_chat && !is_cmpl && !is_models) {
            char msg[512];
            snprintf(msg, sizeof msg, "no route %.20s %.200s (the API: POST /v1/chat/completions, POST /v1/completions, "
                                      "GET /v1/models, GET /health, GET /metrics)", method, url);
            return send_error(c, s, 404, msg, NULL);
        }
        if (!key_ok(s, c))
            return send_error(c, s, 401, "a valid API key is required: send 'Authorization: Bearer KEY' (--api-key-file)", NULL);
        if (is_models) {
            if (!get) return send_error(c, s, 405, "use GET for /v1/models", NULL);
            pthread_mutex_lock(&s->mu);
            json_t *m = model_obj(s);
            pthread_mutex_unlock(&s->mu);
            if (url[10] == '/') {
                if (strcmp(url + 11, s->model_name)) {
                    json_decref(m);
                    char msg[512];
                    snprintf(msg, sizeof msg, "no model '%.200s' (this server has '%.80s')", url + 11, s->model_name);
                    return send_error(c, s, 404, msg, "model");
                }
                return send_json(c, s, 200, m);
            }
            return send_json(c, s, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
        }
        if (!post) return send_error(c, s, 405, "use POST for completions", NULL);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > s->o.max_body) {
            char msg[200];
            snprintf(msg, sizeof msg, "the body of %s bytes is over the limit of %zu bytes", cl, s->o.max_body);
            return send_error(c, s, 413, msg, NULL);
        }
        r = lk_xcalloc(1, sizeof *r);
        r->srv = s;
        r->refs = 1;    /* the connection's, dropped when the request completes */
        r->kind = is_chat ? RQ_CHAT : RQ_COMPLETION;
        r->conn = c;
        r->fd = -1;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci) r->fd = ci->connect_fd;
        /* the request's deadline runs from the connection's start, or on a
         * kept-alive connection from this request's headers (the idle time
         * before it is not the client's slowness) */
        conn_ctx *cc = ctx_of(c);
        double now = lk_time_s();
        r->t_accept = now;
        if (cc) {
            pthread_mutex_lock(&s->mu);
            if (cc->served) cc->t_mark = now;
            else r->t_accept = cc->t_mark;
            pthread_mutex_unlock(&s->mu);
        }
        lk_buf_put(&r->body, "", 0);
        *con_cls = r;
        return MHD_YES;
    }
    if (r->answered) {          /* answered early: the rest of the body is dropped */
        *upload_size = 0;
        return MHD_YES;
    }
    if (r->state == ST_NEW) {
        if (*upload_size) {
            /* a body over the limit or too slow: the rest is dropped and the
             * error answered when the body ends (libmicrohttpd 0.9 refuses a
             * response queued while a body arrives, and the connection then
             * closes without one); the reaper ends a body that never ends */
            if (r->err_status) {
                /* dropped */
            } else if (r->body.n + *upload_size > s->o.max_body) {
                r->err_status = 413;
                snprintf(r->err, sizeof r->err, "the body is over the limit of %zu bytes", s->o.max_body);
            } else if (lk_time_s() - r->t_accept > s->o.request_timeout) {
                r->err_status = 408;
                snprintf(r->err, sizeof r->err, "the request took more than %g s to arrive (headers and body)",
                         s->o.request_timeout);
            } else lk_buf_put(&r->body, upload, *upload_size);
            *upload_size = 0;
            return MHD_YES;
        }
        /* the whole request is here */
        conn_ctx *cc = ctx_of(c);
        if (cc) {
            pthread_mutex_lock(&s->mu);
            cc->busy = true;
            pthread_mutex_unlock(&s->mu);
        }
        if (r->err_status) {
            r->state = ST_DONE;
            return send_error(c, s, r->err_status, r->err, NULL);
        }
        pthread_mutex_lock(&s->mu);
        srv_state st = s->state;
        char reason[sizeof s->reason];
        snprintf(reason, sizeof reason, "%s", s->reason);
        pthread_mutex_unlock(&s->mu);
        if (st != SRV_READY) {
            r->state = ST_DONE;
            char msg[sizeof reason + 64];
            snprintf(msg, sizeof msg, "%s%s", st == SRV_LOADING ? "the model is still loading" : "the server cannot run requests now: ",
                     st == SRV_LOADING ? "" : reason);
            return send_error(c, s, 503, msg, NULL);
        }
        perr e = { { 0 }, { 0 } };
        random_id(r->id, sizeof r->id, r->kind == RQ_CHAT ? "chatcmpl-" : "cmpl-");
        r->created = (long long)time(NULL);
        if (!parse_request(s, r, r->body.p, r->body.n, &e)) {
            r->state = ST_DONE;
            return send_error(c, s, 400, e.msg, e.param[0] ? e.param : NULL);
        }
        free(r->body.p);
        r->body = (lk_buf){ 0 };
        pthread_mutex_lock(&s->mu);
        if (s->state != SRV_READY || s->stop) {
            pthread_mutex_unlock(&s->mu);
            r->state = ST_DONE;
            return send_error(c, s, 503, "the server cannot run requests now", NULL);
        }
        /* every request taken and not finished (the inbox's and the session's,
         * counted at once; s->waiting lags until the next step) against the
         * slots plus the queue */
        int taken = s->n_active + s->n_inbox;
        if (taken >= s->o.parallel + s->o.queue) {
            int q = taken - s->o.parallel;
            pthread_mutex_unlock(&s->mu);
            r->state = ST_DONE;
            char msg[200];
            snprintf(msg, sizeof msg, "the server is busy: %d requests are running and %d waiting already (--parallel %d, --queue %d); retry later",
                     s->o.parallel, q, s->o.parallel, s->o.queue);
            return send_error(c, s, 429, msg, NULL);
        }
        srv_enqueue(s, r);
        r->suspended = true;
        MHD_suspend_connection(c);
        pthread_mutex_unlock(&s->mu);
        return MHD_YES;
    }
    /* resumed: the scheduler has something for us */
    pthread_mutex_lock(&s->mu);
    enum MHD_Result ret = MHD_YES;
    if (r->gone) ret = MHD_NO;
    else if (r->state == ST_DONE && (!r->stream || r->err_status)) {
        ret = answer_done(c, s, r);
        r->head_sent = true;
    } else if (r->stream && (r->state == ST_DONE || r->safe > 0 || r->n_gen > 0)) {
        if (!r->head_sent && !r->out.p) {
            lk_buf_put(&r->out, "", 0);
            r->out.n = 0;
            r->refs++;   /* the response's */
            struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_reader, r, sse_free);
            MHD_add_response_header(resp, "Content-Type", "text/event-stream");
            MHD_add_response_header(resp, "Cache-Control", "no-cache");
            keep_alive_hint(s, resp);
            srv_count_status(s, 200);
            pthread_mutex_unlock(&s->mu);
            ret = MHD_queue_response(c, 200, resp);
            MHD_destroy_response(resp);
            pthread_mutex_lock(&s->mu);
        }
    } else {
        r->suspended = true;
        MHD_suspend_connection(c);
    }
    pthread_mutex_unlock(&s->mu);
    return ret;
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    lk_server *s = cls;
    srv_req *r = *con_cls;
    conn_ctx *cc = ctx_of(c);
    pthread_mutex_lock(&s->mu);
    if (cc) {
        cc->busy = false;
        cc->served = true;
        cc->t_mark = lk_time_s();
    }
    if (r) {
        r->conn_done = true;
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK || r->state != ST_DONE) r->gone = true;
        if (r->state == ST_NEW) r->state = ST_DONE;
        srv_req_unref(s, r);
    }
    pthread_mutex_unlock(&s->mu);
    *con_cls = NULL;
}

static void conn_notify(void *cls, struct MHD_Connection *c, void **socket_context, enum MHD_ConnectionNotificationCode code) {
    lk_server *s = cls;
    http_state *h = HS(s);
    pthread_mutex_lock(&s->mu);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_ctx *cc = lk_xcalloc(1, sizeof *cc);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        cc->fd = ci ? ci->connect_fd : -1;
        cc->t_mark = lk_time_s();
        cc->next = h->conns;
        if (h->conns) h->conns->prev = cc;
        h->conns = cc;
        h->n_conns++;
        *socket_context = cc;
    } else if (*socket_context) {
        conn_ctx *cc = *socket_context;
        if (cc->prev) cc->prev->next = cc->next;
        else h->conns = cc->next;
        if (cc->next) cc->next->prev = cc->prev;
        h->n_conns--;
        free(cc);
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&s->mu);
}

/* Closes connections that take too long to send a request. */
static void *reaper_main(void *arg) {
    lk_server *s = arg;
    http_state *h = HS(s);
    char body[256], R408[512];
    int nb = snprintf(body, sizeof body, "{\"error\":{\"message\":\"the request took more than %g s to arrive (headers and body)\","
                                         "\"type\":\"timeout_error\",\"param\":null,\"code\":null}}\n", s->o.request_timeout);
    int n408 = snprintf(R408, sizeof R408, "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                                           "Connection: close\r\nContent-Length: %d\r\n\r\n%s", nb, body);
    for (;;) {
        struct timespec ts = { 0, 200 * 1000 * 1000 };
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&s->mu);
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        double now = lk_time_s();
        for (conn_ctx *cc = h->conns; cc; cc = cc->next) {
            if (cc->busy || cc->reaped || cc->fd < 0 || now - cc->t_mark <= s->o.request_timeout) continue;
            cc->reaped = true;
            if (!cc->served) {
                ssize_t w = send(cc->fd, R408, (size_t)n408, MSG_DONTWAIT | MSG_NOSIGNAL);
                (void)w;
                srv_count_status(s, 408);
            }
            shutdown(cc->fd, SHUT_RDWR);
        }
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

/* ======================================================================
 * start and stop
 * ==================================================================== */

static http_state *HS(lk_server *s) { return s->http; }

lk_status srv_http_start(lk_server *s, int *port, char *err, size_t errlen) {
    http_state *h = lk_xcalloc(1, sizeof *h);
    h->s = s;
    s->http = h;
    struct sockaddr_in6 a6 = { 0 };
    struct sockaddr_in a4 = { 0 };
    struct sockaddr *sa;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (inet_pton(AF_INET, s->o.host, &a4.sin_addr) == 1) {
        a4.sin_family = AF_INET;
        a4.sin_port = htons((uint16_t)s->o.port);
        sa = (struct sockaddr *)&a4;
    } else if (inet_pton(AF_INET6, s->o.host, &a6.sin6_addr) == 1) {
        a6.sin6_family = AF_INET6;
        a6.sin6_port = htons((uint16_t)s->o.port);
        sa = (struct sockaddr *)&a6;
        flags |= MHD_USE_IPv6;
    } else {
        srv_http_stop(s);
        return lk_fail(err, errlen, LK_ERR_ARG, "--host %s: not an IPv4 or IPv6 address", s->o.host);
    }
    s->t_start_wall = (long long)time(NULL);
    s->d = MHD_start_daemon(flags, (uint16_t)s->o.port, NULL, NULL, handler, s,
                            MHD_OPTION_SOCK_ADDR, sa,
                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned)LK_MAX(1, s->o.http_threads),
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)s->o.max_conns,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, 2 * (size_t)s->o.max_header + 16384,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)LK_MAX(1.0, 2 * s->o.request_timeout),
                            MHD_OPTION_NOTIFY_COMPLETED, completed, s,
                            MHD_OPTION_NOTIFY_CONNECTION, conn_notify, s,
                            MHD_OPTION_LISTENING_ADDRESS_REUSE, (unsigned)1,
                            MHD_OPTION_END);
    if (!s->d) {
        srv_http_stop(s);
        return lk_fail(err, errlen, LK_ERR_IO, "cannot listen on %s:%d (in use? see --port)", s->o.host, s->o.port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    *port = di ? di->port : s->o.port;
    if (pthread_create(&h->reaper, NULL, reaper_main, s) == 0) h->reaper_started = true;
    return LK_OK;
}

void srv_http_stop(lk_server *s) {
    http_state *h = HS(s);
    if (!h) return;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_mutex_unlock(&s->mu);
    if (h->reaper_started) pthread_join(h->reaper, NULL);
    if (s->d) {
        MHD_stop_daemon(s->d);
        s->d = NULL;
    }
    s->http = NULL;
    free(h);
}
