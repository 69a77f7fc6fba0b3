/* lockstep serve — the OpenAI-compatible HTTP API over one node or a
 * cluster (server/server.h). Prints the URL when the model is ready, serves
 * until SIGINT/SIGTERM. */
#include "cli/cli.h"
#include "parallel/trace.h"
#include "cli/genflags.h"
#include "server/server.h"
#include "tokenizer/chat_template.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static const char *SYNOPSIS = "-m FILE [--host H] [--port P] [--parallel S] [--ctx N] [--api-key-file F] [options]";

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { (void)sig; g_stop = 1; }

/* The first line of a file, without its end (an API key). */
static char *read_key(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    char *line = NULL;
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, f);
    fclose(f);
    if (n < 0) { free(line); return lk_xstrdup(""); }
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ')) line[--n] = 0;
    return line;
}

int lk_cmd_serve(int argc, char **argv) {
    lk_genflags f;
    lk_genflags_init(&f);
    const char *host = "127.0.0.1", *key_path = NULL, *name = NULL, *tmpl_name = NULL, *trace = NULL;
    int64_t port = 8080, parallel = 4, queue = 64, max_tokens = -1, max_body_kb = 8192, timeout = 30, max_conns = 1000,
            http_threads = 2, retries = 0;
    double retry_s = 2;
    bool no_reuse = false, verbose = false;
    char tmpl_help[512];
    snprintf(tmpl_help, sizeof tmpl_help,
             "chat template: a built-in name (%s) or Jinja text (default: the model's; ChatML with a warning when it has none)",
             lk_chat_template_names());
    const lk_opt own[] = {
        { "--host", NULL, LK_OPT_STR, &host, "H", "address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)" },
        { "--port", NULL, LK_OPT_INT, &port, "P", "TCP port (default 8080; 0 = any free port, printed)" },
        { "--parallel", "-np", LK_OPT_INT, &parallel, "S", "requests decoded at once, batched into each step (default 4)" },
        { "--queue", NULL, LK_OPT_INT, &queue, "N", "requests that may wait beyond those; more get 429 (default 64)" },
        { "--trace", NULL, LK_OPT_STR, &trace, "FILE",
          "write Chrome trace events (Perfetto) of every engine step of this host's ranks until the server stops "
          "(see 'lockstep run --help'; it grows with every step: for short sessions)" },
        { "--api-key-file", NULL, LK_OPT_STR, &key_path, "F",
          "require 'Authorization: Bearer KEY' on /v1 with KEY the file's first line (default: no key)" },
        { "--alias", "-a", LK_OPT_STR, &name, "NAME", "the model id /v1/models lists (default: the file's name)" },
        { "--chat-template", NULL, LK_OPT_STR, &tmpl_name, "NAME", tmpl_help },
        { "--max-tokens", "-n", LK_OPT_INT, &max_tokens, "N",
          "chat replies' limit when a request gives none; -1 = until end of turn or a full context (default -1)" },
        { "--max-body-kb", NULL, LK_OPT_INT, &max_body_kb, "KB", "largest request body (default 8192 KiB); larger: 413" },
        { "--timeout", NULL, LK_OPT_INT, &timeout, "S",
          "seconds a client may take to send its request, headers and body (default 30); slower: 408" },
        { "--max-conns", NULL, LK_OPT_INT, &max_conns, "N", "open connections at most (default 1000)" },
        { "--http-threads", NULL, LK_OPT_INT, &http_threads, "N", "threads parsing and writing HTTP (default 2)" },
        { "--max-retries", NULL, LK_OPT_INT, &retries, "N",
          "after the engine fails (a rank lost), tries to reopen it this often, then exits (default 0: forever)" },
        { "--retry-interval", NULL, LK_OPT_F64, &retry_s, "S", "seconds between those attempts (default 2)" },
        { "--no-kv-reuse", NULL, LK_OPT_FLAG, &no_reuse, NULL, "no prefix cache: every request computes its whole prompt" },
        { "--verbose", "-v", LK_OPT_FLAG, &verbose, NULL, "log every request" },
    };
    lk_opt opts[64];
    int no = 0;
    lk_genflags_opts(&f, opts, &no, 63);
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) opts[no++] = own[i];
    opts[no] = (lk_opt){ 0 };
    const char *pos[1];
    int np = lk_args_parse("serve", SYNOPSIS, opts, argc, argv, pos, 0);
    if (np == LK_ARGS_VERSION) return 0;
    if (np == LK_ARGS_HELP) {
        printf("\nAPI (OpenAI-compatible): POST /v1/chat/completions, POST /v1/completions (both with \"stream\": true\n"
               "as Server-Sent Events), GET /v1/models; GET /health (200 ready, 503 loading or degraded, with the\n"
               "reason), GET /metrics (Prometheus text). Requests join the running batch at step boundaries; a\n"
               "conversation's next turn and shared system prompts reuse the KV cache of earlier requests.\n"
               "Sampling flags above are the defaults of requests that do not set their own.\n"
               "When a cluster rank is lost, running requests end with an error naming it, /health says degraded,\n"
               "and the server reopens the cluster (every --retry-interval): a --local cluster restarts its ranks itself; with\n"
               "--workers, restart the lost worker and the server reconnects.\n"
               "Example: lockstep serve -m model.gguf --local 2 --tp 2 --port 8080\n"
               "         curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n"
               "              -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'\n");
        return 0;
    }
    if (np < 0) return 2;
    if (!f.model) {
        fprintf(stderr, "lockstep serve: -m FILE is required (see 'lockstep serve --help')\n");
        return 2;
    }
    struct { const char *flag; int64_t v, lo, hi; } ranges[] = {
        { "--port", port, 0, 65535 }, { "--parallel", parallel, 1, 1024 }, { "--queue", queue, 0, 1 << 20 },
        { "--max-body-kb", max_body_kb, 1, 1 << 20 }, { "--timeout", timeout, 1, 86400 },
        { "--max-conns", max_conns, 1, 1 << 20 }, { "--http-threads", http_threads, 1, 256 },
        { "--max-retries", retries, 0, 1 << 30 },
    };
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
        if (ranges[i].v < ranges[i].lo || ranges[i].v > ranges[i].hi) {
            fprintf(stderr, "lockstep serve: %s must be between %lld and %lld (got %lld)\n", ranges[i].flag,
                    (long long)ranges[i].lo, (long long)ranges[i].hi, (long long)ranges[i].v);
            return 2;
        }
    if (!(retry_s >= 0.01 && retry_s <= 3600)) {
        fprintf(stderr, "lockstep serve: --retry-interval must be between 0.01 and 3600 seconds\n");
        return 2;
    }
    if (max_tokens < -1 || max_tokens == 0) {
        fprintf(stderr, "lockstep serve: --max-tokens must be -1 or positive\n");
        return 2;
    }
    lk_server_opts so;
    lk_server_opts_default(&so);
    if (!lk_genflags_finish(&f, "serve", &so.eo, &so.defaults)) return 2;
    char err[LK_ERRLEN];
    if (tmpl_name && lk_chat_template_select(tmpl_name, NULL, &so.chat_template, err, sizeof err)) {
        fprintf(stderr, "lockstep serve: %s\n", err);
        return 2;
    }
    char *key = NULL;
    if (key_path) {
        if (!(key = read_key(key_path))) {
            fprintf(stderr, "lockstep serve: --api-key-file %s: %s\n", key_path, strerror(errno));
            return 2;
        }
        if (strlen(key) < 8) {
            fprintf(stderr, "lockstep serve: --api-key-file %s: the key (its first line) must have at least 8 characters\n",
                    key_path);
            free(key);
            return 2;
        }
    }
    so.host = host;
    so.port = (int)port;
    so.parallel = (int)parallel;
    so.queue = (int)queue;
    so.api_key = key;
    so.model_name = name;
    so.default_max_tokens = (int)max_tokens;
    so.max_body = (size_t)max_body_kb << 10;
    so.request_timeout = (double)timeout;
    so.max_conns = (int)max_conns;
    so.http_threads = (int)http_threads;
    so.no_reuse = no_reuse;
    so.max_retries = (int)retries;
    so.retry_s = retry_s;
    if (verbose) lk_log_set_level(LK_LOG_DEBUG);
    /* a connection is a file descriptor: as many as the limit allows */
    struct rlimit rl;
    if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = { 0 };
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    if (trace && lk_trace_start(trace, err, sizeof err)) {   /* before the ranks are forked: they inherit it */
        fprintf(stderr, "lockstep serve: %s\n", err);
        free(key);
        return 1;
    }
    lk_server *srv = NULL;
    int bound = 0;
    if (lk_server_start(&so, &srv, &bound, err, sizeof err)) {
        fprintf(stderr, "lockstep serve: %s\n", err);
        free(key);
        return 1;
    }
    fprintf(stderr, "lockstep serve: listening on http://%s:%d, loading %s ...\n", host, bound, f.model);
    if (lk_server_wait_ready(srv, err, sizeof err)) {
        fprintf(stderr, "lockstep serve: %s\n", err);
        lk_server_stop(srv);
        free(key);
        return 1;
    }
    printf("lockstep serve: ready at http://%s:%d/v1 (model %s, %d request%s at once%s)\n", host, bound, f.model,
           (int)parallel, parallel > 1 ? "s" : "", key ? ", API key required" : "");
    fflush(stdout);
    while (!g_stop && !lk_server_failed(srv)) usleep(100 * 1000);
    int rc = lk_server_failed(srv) ? 1 : 0;
    if (rc) fprintf(stderr, "lockstep serve: giving up: %s\n", lk_server_reason(srv));
    fprintf(stderr, "lockstep serve: stopping\n");
    lk_server_stop(srv);
    free(key);
    int tr_ranks, tr_events;
    if (trace && lk_trace_finish(&tr_ranks, &tr_events, err, sizeof err)) {
        fprintf(stderr, "lockstep serve: %s\n", err);
        rc = rc ? rc : 1;
    } else if (trace) {
        fprintf(stderr, "lockstep serve: trace of %d rank%s (%d events) in %s\n", tr_ranks, tr_ranks == 1 ? "" : "s",
                tr_events, trace);
    }
    return rc;
}
