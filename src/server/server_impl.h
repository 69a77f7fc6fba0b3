/* The server's insides, shared by the scheduler (server.c) and the HTTP
 * side (http.c). server.h has the contract. */
#ifndef LK_SERVER_IMPL_H
#define LK_SERVER_IMPL_H

#include "server/server.h"
#include "gguf/gguf.h"
#include "session/session.h"
#include "tokenizer/tokenizer.h"

#include <microhttpd.h>
#include <pthread.h>


/* One generated token's log-probabilities (logprobs requests). */
#define SRV_MAX_TOP 20
#define SRV_MAX_RANKS 64   /* ranks whose times /metrics shows (a cluster has at most 64) */
typedef struct {
    size_t  a, b;                 /* its text: text[a, b) */
    int32_t id;
    float   lp;                   /* its log-probability */
    int     n_top;
    int32_t top_id[SRV_MAX_TOP];
    float   top_lp[SRV_MAX_TOP];
} srv_lp;

enum { RQ_CHAT, RQ_COMPLETION };
enum { ST_NEW, ST_QUEUED, ST_RUNNING, ST_DONE };

typedef struct srv_req srv_req;
struct srv_req {
    lk_server         *srv;
    /* ---- set by the HTTP side before it is queued, then read-only ---- */
    int                kind;
    bool               stream, include_usage, want_lp, tools, echo_role;
    int                top_lp;
    int32_t           *prompt;
    int                n_prompt;
    lk_sampler_params  sp;
    int                max_new;
    bool               ignore_eos;
    char             **stop;
    int                n_stop;
    size_t             stop_longest;      /* the longest stop string's bytes */
    char               id[48];
    long long          created;
    int                fd;                /* the client's socket (hang-up polls) */
    struct MHD_Connection *conn;
    /* ---- under the server's mutex ---- */
    int                refs;              /* the connection's and the scheduler's */
    int                state;
    bool               suspended, gone, conn_done;
    lk_buf            text;              /* all generated text so far */
    size_t             safe;              /* text[0, safe) may be shown: no stop string or tool call can start before */
    size_t             scan;              /* stop strings were searched up to here */
    size_t             tool_at;           /* where a tool call may start (SIZE_MAX when none) */
    size_t             tool_scan;         /* tool markers were ruled out before here */
    srv_lp            *lp;
    int                n_lp, cap_lp;
    int                finish;            /* LK_FINISH_* (+ SRV_FINISH_STOP for a stop string) */
    int                err_status;        /* != 0: the request failed with this HTTP status */
    char               err[1024];
    int                n_gen, n_reused;
    double             t_enq, t_first, t_last;
    /* ---- the HTTP side's own (one thread at a time per connection) ---- */
    lk_buf            body;              /* the request body as it arrives */
    bool               answered;          /* an error was queued before the body ended */
    size_t             sent;              /* stream: bytes of text already sent */
    int                lp_sent;           /* stream: logprob entries already sent */
    bool               head_sent, tail_sent;
    lk_buf            out;               /* stream: formatted bytes not yet handed to the library */
    size_t             out_off;
    double             t_accept;
    /* ---- the scheduler's own ---- */
    lk_request        *sr;
    srv_req           *next;              /* the inbox, or the active list */
};
#define SRV_FINISH_STOP 100

typedef enum { SRV_LOADING, SRV_READY, SRV_DEGRADED, SRV_FAILED, SRV_STOPPING } srv_state;

#define SRV_TTFT_BUCKETS 12
#define SRV_ITL_BUCKETS  12

struct lk_server {
    lk_server_opts       o;
    struct lk_energy    *energy;          /* the machine's power counters (diag.h), or NULL: /metrics */
    char                *model_name;
    struct MHD_Daemon   *d;
    void                *http;            /* http.c's state (connections, the reaper) */
    long long            t_start_wall;
    pthread_t            sched;
    bool                 sched_started;
    pthread_mutex_t      mu;
    pthread_cond_t       cv;              /* the scheduler waits for work; lk_server_wait_ready for the load */
    srv_state            state;
    char                 reason[2048];    /* why degraded or failed (under mu) */
    char                 fail_reason[1024]; /* the scheduler's: the engine's last failure */
    lk_status            load_status;
    bool                 stop;
    /* the model (the scheduler's; the HTTP side reads tok, tmpl, n_ctx, n_vocab once ready) */
    lk_engine           *e;
    lk_gguf             *gguf;            /* the server's own mapping, for the tokenizer and template */
    lk_tokenizer        *tok;
    lk_session          *ses;
    const char          *tmpl;
    char                *tmpl_owned;
    int                  n_ctx;
    int64_t              n_vocab;
    /* requests */
    srv_req             *inbox, *inbox_tail;
    srv_req             *active;          /* queued or running in the session */
    int                  n_inbox, n_active;
    /* metrics (under mu) */
    uint64_t             status_count[600];
    uint64_t             prompt_tokens, gen_tokens, reused_tokens;
    uint64_t             ttft_hist[SRV_TTFT_BUCKETS + 1], itl_hist[SRV_ITL_BUCKETS + 1];
    double               ttft_sum, itl_sum;
    uint64_t             ttft_n, itl_n;
    int                  running, waiting;
    int64_t              pages_total, pages_free;
    double               compute_s, comm_s;  /* rank 0's steps */
    int                  n_ranks;
    double               rank_s[SRV_MAX_RANKS][2];   /* workers' compute, network seconds (all engines) */
    double               rank_raw[SRV_MAX_RANKS][2]; /* the current engine's totals last read */
    uint64_t             steps, engine_failures, reopens;
    double               t_start;
};

extern const double srv_ttft_bounds[SRV_TTFT_BUCKETS];
extern const double srv_itl_bounds[SRV_ITL_BUCKETS];

/* the HTTP side (http.c) */
lk_status srv_http_start(lk_server *s, int *port, char *err, size_t errlen);
/* Its request parser: a body for r (r->kind set) -> r's settings, prompt and
 * stops; false with the message and the parameter it names ("" for none) of
 * a 400. Reads s->tok, tmpl, n_ctx, n_vocab and o. fuzz/fuzz_http.c runs it. */
bool      srv_parse_request(lk_server *s, srv_req *r, const char *body, size_t n, char msg[600], char param[80]);
void      srv_http_stop(lk_server *s);
/* the scheduler (server.c) */
void      srv_enqueue(lk_server *s, srv_req *r);        /* under mu */
void      srv_req_unref(lk_server *s, srv_req *r);      /* under mu */
void      srv_wake_conn(srv_req *r);                    /* under mu: resumes its connection if suspended */
void      srv_count_status(lk_server *s, int status);   /* under mu */

#endif
