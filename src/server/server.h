/* server — the OpenAI-compatible HTTP API over one engine (one node or the
 * head of a cluster): what `lockstep serve` runs.
 *
 * Threads and ownership:
 *   - HTTP threads (libmicrohttpd's internal polling threads, epoll) only
 *     parse, enqueue and write: they read a request's headers and body
 *     within limits (header bytes, body bytes, time to send them), check the
 *     JSON, render chat messages through the chat template and tokenise
 *     (the tokenizer and template are read-only), then hand a request object
 *     to the scheduler and suspend the connection; they format what the
 *     scheduler produced (a response, or Server-Sent Event chunks) when it
 *     wakes them.
 *   - One scheduler thread owns the engine, the session (session/session.h:
 *     admission, chunked prefill, prefix reuse) and so every sequence and KV
 *     page. It takes new requests at step boundaries, steps the session,
 *     appends each token's text to its request (holding back text that may
 *     still become a stop string or a tool call), wakes the connection, and
 *     cancels the requests whose client went away (it polls their sockets
 *     for a hang-up between steps, since a suspended connection is not
 *     watched by the HTTP library). It also loads the model at start (the
 *     server answers /health with 503 "loading" meanwhile) and, when the
 *     engine fails (a rank lost), ends the running requests with an error
 *     naming the cause, reports "degraded" and reopens the engine (the
 *     cluster) until it succeeds.
 *   - A request object is shared by its connection and the scheduler under
 *     the server's one mutex and freed by whichever lets go last.
 *
 * The pure text functions below (stop strings, tool calls) are exported for
 * unit tests. */
#ifndef LK_SERVER_H
#define LK_SERVER_H

#include "common/lk_common.h"
#include "engine/engine.h"
#include "sampler/sampler.h"

typedef struct {
    const char *host;            /* listen address (default 127.0.0.1) */
    int         port;            /* 0: any free port (printed) */
    int         parallel;        /* sequences decoded at once */
    int         queue;           /* requests waiting beyond those at most (429 past it) */
    const char *api_key;         /* NULL: no key; else "Authorization: Bearer KEY" is required on /v1 */
    const char *model_name;      /* the id /v1/models lists (default: the file's base name) */
    const char *chat_template;   /* the template source to use (NULL: the model's, else ChatML with a warning) */
    lk_engine_opts eo;           /* the model and cluster (max_seqs is set from parallel) */
    lk_sampler_params defaults;  /* sampling when a request gives none */
    int         default_max_tokens; /* < 0: until end of generation or a full context */
    size_t      max_body;        /* bytes */
    size_t      max_header;      /* bytes of a request's header */
    double      request_timeout; /* seconds a client may take to send a request (headers and body) */
    int         max_conns;       /* connections at once */
    int         http_threads;
    bool        no_reuse;        /* no prefix reuse */
    int         max_retries;     /* reopening a failed engine: attempts before giving up (0: forever) */
    double      retry_s;         /* seconds between attempts */
} lk_server_opts;

void lk_server_opts_default(lk_server_opts *o);

typedef struct lk_server lk_server;

/* Starts listening and loading: returns once the socket is open (the
 * engine loads on the scheduler thread; /health says "loading" until it is
 * ready). *port_out gets the port. */
lk_status lk_server_start(const lk_server_opts *o, lk_server **out, int *port_out, char *err, size_t errlen);
/* Blocks until the model is loaded (LK_OK) or the first load failed (its
 * status and message). */
lk_status lk_server_wait_ready(lk_server *s, char *err, size_t errlen);
/* True once the server gave up (the first load failed, or --max-retries
 * reopenings did); lk_server_reason says why (valid until stop). */
bool        lk_server_failed(lk_server *s);
const char *lk_server_reason(lk_server *s);
/* Stops accepting, ends every request (their clients get what was made so
 * far and an error) and frees everything. */
void      lk_server_stop(lk_server *s);

/* ---- pure helpers (unit tested) ---------------------------------------- */

/* Stop strings: the earliest position >= from where one of stops[] begins
 * in text[0..n), or -1. */
long   lk_srv_find_stop(const char *text, size_t n, size_t from, char *const *stops, int n_stops);
/* How many bytes at the end of text[0..n) may still be the beginning of one
 * of stops[] (and so must be held back); 0 when none. */
size_t lk_srv_stop_holdback(const char *text, size_t n, char *const *stops, int n_stops);

/* Tool calls in a reply: the Hermes/Qwen form (one or more
 * "<tool_call>{json}</tool_call>", text around them is the content) and
 * Llama 3's (the whole reply is one JSON object {"name": ..., "parameters"
 * or "arguments": {...}}, optionally after "<|python_tag|>"). On finding
 * some, *calls_json is a malloc'd JSON array of OpenAI tool calls
 * ([{"id","type":"function","function":{"name","arguments": "<json text>"}}])
 * and *content a malloc'd copy of the remaining text (NULL when only
 * whitespace is left); returns the number of calls (0: none, outputs NULL). */
int    lk_srv_parse_tool_calls(const char *text, size_t n, char **calls_json, char **content);
/* Where a tool call may begin in text[0..n) (so text from there on is held
 * back while streaming): the position of "<tool_call>", of "<|python_tag|>"
 * or of a '{' that is the first non-space character, or of an unfinished
 * prefix of one of them at the end; n when none. Markers are looked for
 * from `from` on (text before it was ruled out already). */
size_t lk_srv_tool_start(const char *text, size_t n, size_t from);

#endif
