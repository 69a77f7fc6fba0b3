/* The server's scheduler thread: it owns the engine, the session and every
 * sequence; requests come in through an inbox, text goes out through the
 * request objects (server.h has the contract). */
#include "server/server_impl.h"
#include "diag/diag.h"
#include "tokenizer/chat_template.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Histogram bounds (seconds) for time to first token and inter-token latency. */
const double srv_ttft_bounds[SRV_TTFT_BUCKETS] = { 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60 };
const double srv_itl_bounds[SRV_ITL_BUCKETS] = { 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5 };

void lk_server_opts_default(lk_server_opts *o) {
    *o = (lk_server_opts){ .host = "127.0.0.1", .port = 8080, .parallel = 4, .queue = 64,
                           .default_max_tokens = -1, .max_body = 8u << 20, .max_header = 32u << 10,
                           .request_timeout = 30, .max_conns = 1000, .http_threads = 2, .retry_s = 2 };
    lk_sampler_params_default(&o->defaults);
}

static void req_free(srv_req *r) {
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->text.p);
    free(r->lp);
    free(r->body.p);
    free(r->out.p);
    free(r);
}

void srv_req_unref(lk_server *s, srv_req *r) {
    (void)s;
    LK_ASSERT(r->refs > 0);
    if (--r->refs == 0) req_free(r);
}

void srv_wake_conn(srv_req *r) {
    if (r->suspended && !r->conn_done) {
        r->suspended = false;
        MHD_resume_connection(r->conn);
    }
}

void srv_count_status(lk_server *s, int status) {
    if (status >= 100 && status < 600) s->status_count[status]++;
}

void srv_enqueue(lk_server *s, srv_req *r) {
    r->state = ST_QUEUED;
    r->refs++;   /* the scheduler's */
    r->t_enq = lk_time_s();
    r->tool_at = SIZE_MAX;
    r->next = NULL;
    if (s->inbox_tail) s->inbox_tail->next = r;
    else s->inbox = r;
    s->inbox_tail = r;
    s->n_inbox++;
    pthread_cond_broadcast(&s->cv);
}

static void hist_add(uint64_t *h, const double *bounds, int nb, double v) {
    int i = 0;
    while (i < nb && v > bounds[i]) i++;
    h[i]++;
}

/* ======================================================================
 * tokens in, text out (callbacks on the scheduler thread)
 * ==================================================================== */

static void active_remove(lk_server *s, srv_req *r) {
    for (srv_req **pp = &s->active; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            r->next = NULL;
            s->n_active--;
            return;
        }
}

/* Ends r (under mu): its final text and reason are set; wakes its client. */
static void finalize(lk_server *s, srv_req *r) {
    r->safe = r->text.n;
    r->state = ST_DONE;
    if (lk_log_level() >= LK_LOG_DEBUG) {   /* serve --verbose: a line per request */
        double now = lk_time_s();
        lk_log(LK_LOG_DEBUG, "serve: %s %s: prompt %d tokens (%d reused), %d generated, %s%s%s, first token %.3f s, "
                             "total %.3f s", r->id, r->kind == RQ_CHAT ? "chat" : "completion", r->n_prompt, r->n_reused,
               r->n_gen, r->err_status ? "error: " : "finish ", r->err_status ? r->err : lk_finish_to_string(r->finish == SRV_FINISH_STOP ? LK_FINISH_STOPPED : (lk_finish)r->finish),
               r->finish == SRV_FINISH_STOP ? " (stop string)" : "", r->n_gen ? r->t_first - r->t_enq : 0.0, now - r->t_enq);
    }
    if (!r->err_status) {
        s->prompt_tokens += (uint64_t)r->n_prompt;
        s->gen_tokens += (uint64_t)r->n_gen;
        s->reused_tokens += (uint64_t)r->n_reused;
    }
    srv_wake_conn(r);
}

/* Where the shown text must stop for now: before anything that may still
 * become a stop string, and (with tools) before a tool call. Never moves back. */
static void update_safe(srv_req *r) {
    size_t n = r->text.n, safe = n - lk_srv_stop_holdback(r->text.p, n, r->stop, r->n_stop);
    if (r->tools) {
        if (r->tool_at == SIZE_MAX || r->tool_at >= n) {
            size_t t = lk_srv_tool_start(r->text.p, n, r->tool_scan);
            r->tool_at = t < n ? t : SIZE_MAX;
            r->tool_scan = n > 16 ? n - 16 : 0;  /* a marker is < 16 bytes: text before was ruled out */
        }
        if (r->tool_at != SIZE_MAX) safe = LK_MIN(safe, r->tool_at);
    }
    r->safe = LK_MAX(r->safe, safe);
}

static bool on_token(void *user, lk_request *lr, int32_t tok, const char *piece, int n) {
    srv_req *r = user;
    lk_server *s = r->srv;
    srv_lp e = { 0 };
    if (tok >= 0 && r->want_lp) {
        const int32_t *ids;
        const float *vals;
        int k = lk_request_candidates(lr, &ids, &vals);
        e.id = tok;
        e.lp = -INFINITY;
        if (k > 0) {
            /* log-softmax over the whole vocabulary: every rank adds its
             * rows' log-sum-exp to its candidates (the engine combines them) */
            double lse = lk_request_candidates_lse(lr);
            for (int i = 0; i < k; i++)
                if (ids[i] == tok) e.lp = (float)(vals[i] - lse);
            e.n_top = LK_MIN(r->top_lp, k);
            for (int i = 0; i < e.n_top; i++) {
                e.top_id[i] = ids[i];
                e.top_lp[i] = (float)(vals[i] - lse);
            }
        }
    }
    pthread_mutex_lock(&s->mu);
    double now = lk_time_s();
    size_t a = r->text.n;
    if (n > 0) lk_buf_put(&r->text, piece, (size_t)n);
    bool go_on = !r->gone;
    if (tok >= 0) {
        r->n_gen++;
        if (r->n_gen == 1) {
            r->t_first = now;
            s->ttft_sum += now - r->t_enq;
            s->ttft_n++;
            hist_add(s->ttft_hist, srv_ttft_bounds, SRV_TTFT_BUCKETS, now - r->t_enq);
        } else {
            s->itl_sum += now - r->t_last;
            s->itl_n++;
            hist_add(s->itl_hist, srv_itl_bounds, SRV_ITL_BUCKETS, now - r->t_last);
        }
        r->t_last = now;
        if (r->want_lp) {
            if (r->n_lp == r->cap_lp) r->lp = lk_xrealloc(r->lp, sizeof(srv_lp) * (size_t)(r->cap_lp = 2 * r->cap_lp + 16));
            e.a = a;
            e.b = r->text.n;
            r->lp[r->n_lp++] = e;
        }
    } else if (r->want_lp && r->n_lp && n > 0) {
        r->lp[r->n_lp - 1].b = r->text.n;   /* bytes that were waiting for the rest of a character */
    }
    if (r->n_stop && r->finish != SRV_FINISH_STOP) {
        size_t from = r->scan;
        long at = lk_srv_find_stop(r->text.p, r->text.n, from, r->stop, r->n_stop);
        if (at >= 0) {
            r->text.n = (size_t)at;
            r->text.p[at] = 0;
            r->finish = SRV_FINISH_STOP;
            go_on = false;
        }
    }
    /* the next search starts where a stop string could still begin */
    size_t longest = r->stop_longest;
    r->scan = longest && r->text.n >= longest ? r->text.n - longest + 1 : 0;
    if (tok >= 0) {
        update_safe(r);
        if (r->stream) srv_wake_conn(r);
    } else {
        /* the end */
        lk_request_info in;
        lk_request_get(lr, &in);
        r->n_reused = in.n_reused;
        lk_finish f = lk_request_finish(lr);
        if (r->finish != SRV_FINISH_STOP) r->finish = (int)f;
        r->sr = NULL;
        lk_session_release(s->ses, lr);
        if (f == LK_FINISH_ERROR) {
            /* the engine failed: the scheduler names the cause once the step returns */
        } else {
            if (f == LK_FINISH_CANCELLED && !r->err_status) {
                r->err_status = 499;
                snprintf(r->err, sizeof r->err, "the request was cancelled");
            }
            active_remove(s, r);
            finalize(s, r);
            srv_req_unref(s, r);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return go_on;
}

/* ======================================================================
 * the engine's life: load, serve, fail, reopen
 * ==================================================================== */

static void set_state(lk_server *s, srv_state st, const char *reason) {
    pthread_mutex_lock(&s->mu);
    s->state = st;
    snprintf(s->reason, sizeof s->reason, "%s", reason ? reason : "");
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static lk_status engine_up(lk_server *s, char *err, size_t errlen) {
    lk_engine_opts eo = s->o.eo;
    /* slots beyond the running ones keep finished conversations for prefix reuse */
    eo.max_seqs = s->o.no_reuse ? s->o.parallel : 2 * s->o.parallel;
    lk_status st = lk_engine_open(&eo, &s->e, err, errlen);
    if (st) return st;
    if ((st = lk_session_create(s->e, s->tok, &(lk_session_opts){ .parallel = s->o.parallel, .no_reuse = s->o.no_reuse },
                                &s->ses, err, errlen))) {
        lk_engine_close(s->e);
        s->e = NULL;
        return st;
    }
    pthread_mutex_lock(&s->mu);
    s->n_ctx = lk_engine_n_ctx(s->e);
    s->pages_total = lk_engine_pages_total(s->e);
    s->pages_free = lk_engine_pages_free(s->e);
    s->n_ranks = LK_MIN(lk_engine_n_ranks(s->e), SRV_MAX_RANKS);
    memset(s->rank_raw, 0, sizeof s->rank_raw); /* a new engine's workers count from 0 */
    pthread_mutex_unlock(&s->mu);
    return LK_OK;
}

/* Adds what each worker rank computed and waited since the last look (its
 * heartbeats tell the engine), so the counters stay monotonic across
 * reopened engines. Under s->mu. */
static void note_rank_times(lk_server *s) {
    for (int r = 1; r < s->n_ranks; r++) {
        double t[2];
        if (!lk_engine_rank_times(s->e, r, &t[0], &t[1])) continue;
        for (int k = 0; k < 2; k++) {
            s->rank_s[r][k] += t[k] >= s->rank_raw[r][k] ? t[k] - s->rank_raw[r][k] : t[k];
            s->rank_raw[r][k] = t[k];
        }
    }
}

static void engine_down(lk_server *s) {
    lk_session_free(s->ses);
    s->ses = NULL;
    lk_engine_close(s->e);
    s->e = NULL;
}

/* Ends with a 503 every active request (but those still queued in the
 * session when `queued_too` is false), saying `what` and the cause. */
static void end_active(lk_server *s, bool queued_too, const char *what, const char *err) {
    pthread_mutex_lock(&s->mu);
    for (srv_req *r = s->active, *nx; r; r = nx) {
        nx = r->next;
        if (r->sr && !queued_too) continue;
        r->sr = NULL;
        r->err_status = 503;
        snprintf(r->err, sizeof r->err, "the engine failed %s: %s", what, err);
        active_remove(s, r);
        finalize(s, r);
        srv_req_unref(s, r);
    }
    pthread_mutex_unlock(&s->mu);
}

/* The engine failed (err): every request it held ends with an error naming
 * the cause; the inbox's wait for the reopened engine. Those still queued in
 * the session end with it (engine_down: the session ended them all and a
 * release is owed), then with their own message. */
static void engine_failed(lk_server *s, const char *err) {
    pthread_mutex_lock(&s->mu);
    s->engine_failures++;
    pthread_mutex_unlock(&s->mu);
    end_active(s, false, "while running this request", err);
    engine_down(s);
    end_active(s, true, "before this request ran", err);
}

/* Takes the inbox's requests into the session. A request stays counted in
 * n_inbox until the same critical section counts it in n_active (or ends
 * it): the connection threads' queue check (http.c) adds the two, and a
 * request counted in neither for a moment let one more in than --queue
 * allows (6 at once against --parallel 2 --queue 1 were 4 served). */
static void admit(lk_server *s) {
    pthread_mutex_lock(&s->mu);
    srv_req *in = s->inbox;
    s->inbox = s->inbox_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    for (srv_req *r = in, *nx; r; r = nx) {
        nx = r->next;
        r->next = NULL;
        pthread_mutex_lock(&s->mu);
        const bool gone = r->gone;
        s->n_inbox--;
        if (!gone) {
            r->state = ST_RUNNING;
            r->next = s->active;      /* on the list before a callback may take it off */
            s->active = r;
            s->n_active++;
        }
        pthread_mutex_unlock(&s->mu);
        char err[LK_ERRLEN];
        lk_request *lr = NULL;
        if (!gone) {
            int n_cand = r->want_lp ? (int)LK_MIN((int64_t)1024, s->n_vocab) : 0;
            lk_request_params rp = { .prompt = r->prompt, .n_prompt = r->n_prompt, .sampling = r->sp,
                                     .max_new = r->max_new, .ignore_eos = r->ignore_eos, .n_cand = n_cand,
                                     .on_token = on_token, .user = r };
            lr = lk_session_submit(s->ses, &rp, err, sizeof err);
        }
        pthread_mutex_lock(&s->mu);
        if (lr) {
            if (r->state != ST_DONE) r->sr = lr;
        } else {
            if (!gone) active_remove(s, r);
            r->err_status = gone ? 499 : 400;
            snprintf(r->err, sizeof r->err, "%s", gone ? "the client went away" : err);
            finalize(s, r);
            srv_req_unref(s, r);
        }
        pthread_mutex_unlock(&s->mu);
    }
}

/* Clients that hung up: their requests are cancelled (pages freed at the
 * step boundary). A suspended connection is not watched by the HTTP
 * library, so the scheduler polls the sockets (cheap: only the active ones). */
static void watch_hangups(lk_server *s) {
    pthread_mutex_lock(&s->mu);
    for (srv_req *r = s->active; r; r = r->next) {
        if (r->gone || r->conn_done || r->fd < 0) continue;
        struct pollfd p = { .fd = r->fd, .events = POLLRDHUP };
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            r->gone = true;
            srv_wake_conn(r);        /* the library then sees the closed socket and lets go */
        }
    }
    srv_req *cancel[64];
    int nc = 0;
    for (srv_req *r = s->active; r && nc < 64; r = r->next)
        if ((r->gone || r->conn_done) && r->sr) cancel[nc++] = r;
    pthread_mutex_unlock(&s->mu);
    /* only the scheduler touches sr; cancelling runs callbacks that lock mu */
    for (int i = 0; i < nc; i++)
        if (cancel[i]->sr) lk_session_cancel(s->ses, cancel[i]->sr);
}

static void *sched_main(void *arg) {
    lk_server *s = arg;
    char err[LK_ERRLEN];
    lk_status st = engine_up(s, err, sizeof err);
    if (st) {
        pthread_mutex_lock(&s->mu);
        s->load_status = st;
        pthread_mutex_unlock(&s->mu);
        set_state(s, SRV_FAILED, err);
        return NULL;
    }
    set_state(s, SRV_READY, NULL);
    double last_watch = 0;
    int attempts = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        bool stop = s->stop;
        srv_state state = s->state;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        if (state == SRV_DEGRADED) {
            /* reopen the engine (a --local cluster starts its ranks again; workers must be back) */
            struct timespec ts = { (time_t)s->o.retry_s, (long)((s->o.retry_s - (time_t)s->o.retry_s) * 1e9) };
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&s->mu);
            stop = s->stop;
            pthread_mutex_unlock(&s->mu);
            if (stop) break;
            attempts++;
            lk_log(LK_LOG_INFO, "serve: reopening the engine (attempt %d)", attempts);
            if (!engine_up(s, err, sizeof err)) {
                pthread_mutex_lock(&s->mu);
                s->reopens++;
                pthread_mutex_unlock(&s->mu);
                lk_log(LK_LOG_INFO, "serve: the engine is back after %d attempt%s: serving again", attempts,
                       attempts > 1 ? "s" : "");
                set_state(s, SRV_READY, NULL);
                attempts = 0;
            } else {
                char why[sizeof s->reason];
                snprintf(why, sizeof why, "%.900s; reopening it failed (attempt %d): %.900s", s->fail_reason, attempts, err);
                lk_log(LK_LOG_WARN, "serve: reopening the engine failed (attempt %d): %s", attempts, err);
                bool give_up = s->o.max_retries > 0 && attempts >= s->o.max_retries;
                set_state(s, give_up ? SRV_FAILED : SRV_DEGRADED, why);
                if (give_up) break;
            }
            continue;
        }
        admit(s);
        double now = lk_time_s();
        if (now - last_watch > 0.02) {
            watch_hangups(s);
            last_watch = now;
        }
        bool busy = lk_session_running(s->ses) + lk_session_waiting(s->ses) > 0;
        if (busy) {
            st = lk_session_step(s->ses, &busy, err, sizeof err);
            double compute = 0, comm = 0;
            if (!st) lk_engine_last_timing(s->e, &compute, &comm);
            pthread_mutex_lock(&s->mu);
            s->steps++;
            s->compute_s += compute;
            s->comm_s += comm;
            note_rank_times(s);
            if (!st) {
                s->running = lk_session_running(s->ses);
                s->waiting = lk_session_waiting(s->ses);
                s->pages_free = lk_engine_pages_free(s->e);
            }
            pthread_mutex_unlock(&s->mu);
            if (st) {
                lk_log(LK_LOG_ERROR, "serve: the engine failed: %s", err);
                snprintf(s->fail_reason, sizeof s->fail_reason, "the engine failed: %s", err);
                engine_failed(s, err);
                pthread_mutex_lock(&s->mu);
                s->running = s->waiting = 0;
                pthread_mutex_unlock(&s->mu);
                set_state(s, SRV_DEGRADED, s->fail_reason);
            }
            continue;
        }
        pthread_mutex_lock(&s->mu);
        s->running = s->waiting = 0;
        if (s->e) {
            s->pages_free = lk_engine_pages_free(s->e);
            /* the workers' last steps reach the head with their next
             * heartbeat, after our last step: keep looking while idle */
            note_rank_times(s);
        }
        if (!s->inbox && !s->stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
        pthread_mutex_unlock(&s->mu);
    }
    /* stopping: everything still held ends with an error */
    if (s->ses) {
        pthread_mutex_lock(&s->mu);
        srv_req *cancel[256];
        int nc = 0;
        for (srv_req *r = s->active; r && nc < 256; r = r->next)
            if (r->sr) cancel[nc++] = r;
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < nc; i++)
            if (cancel[i]->sr) lk_session_cancel(s->ses, cancel[i]->sr);
        for (bool busy = true; busy && s->ses;)
            if (lk_session_step(s->ses, &busy, err, sizeof err)) break;
    }
    pthread_mutex_lock(&s->mu);
    for (srv_req *r = s->inbox, *nx; r; r = nx) {
        nx = r->next;
        r->err_status = 503;
        snprintf(r->err, sizeof r->err, "the server is stopping");
        finalize(s, r);
        srv_req_unref(s, r);
    }
    s->inbox = s->inbox_tail = NULL;
    s->n_inbox = 0;
    pthread_mutex_unlock(&s->mu);
    /* the engine ends on the thread that opened it: its --local workers die
     * with that thread (PR_SET_PDEATHSIG), so closing it after this thread
     * ended found them killed and reported a lost worker on every stop */
    engine_down(s);
    return NULL;
}

/* ======================================================================
 * start and stop
 * ==================================================================== */

static char *base_name(const char *path) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    char *r = lk_xstrdup(b);
    size_t n = strlen(r);
    if (n > 5 && !strcmp(r + n - 5, ".gguf")) r[n - 5] = 0;
    return r;
}

/* What lk_server_start made before the threads (which are stopped). */
static void server_free(lk_server *s) {
    lk_tokenizer_free(s->tok);
    lk_gguf_close(s->gguf);
    free(s->tmpl_owned);
    free(s->model_name);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    lk_energy_close(s->energy);
    free(s);
}

lk_status lk_server_start(const lk_server_opts *o, lk_server **out, int *port_out, char *err, size_t errlen) {
    *out = NULL;
    lk_server *s = lk_xcalloc(1, sizeof *s);
    s->o = *o;
    s->t_start = lk_time_s();
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->state = SRV_LOADING;
    s->energy = lk_energy_open();
    s->model_name = o->model_name ? lk_xstrdup(o->model_name) : base_name(o->eo.model_path);
    /* the tokenizer and template come from the server's own mapping of the
     * file: they outlive any reopening of the engine */
    lk_status st = lk_gguf_open(o->eo.model_path, &s->gguf, err, errlen);
    if (!st) st = lk_tokenizer_load(s->gguf, &s->tok, err, errlen);
    if (!st) {
        s->n_vocab = lk_tokenizer_n_vocab(s->tok);
        const char *tmpl = o->chat_template;
        if (!tmpl) {
            const char *src = NULL;
            size_t len = 0;
            if (lk_gguf_get_str(s->gguf, "tokenizer.chat_template", &src, &len) && len) {
                s->tmpl_owned = lk_xmalloc(len + 1);
                memcpy(s->tmpl_owned, src, len);
                s->tmpl_owned[len] = 0;
                tmpl = s->tmpl_owned;
                if (lk_chat_template_check(tmpl, err, errlen)) {
                    lk_log(LK_LOG_WARN, "serve: the model's chat template cannot be used (%s): chat completions use "
                                        "ChatML (choose one with --chat-template NAME)", err);
                    tmpl = NULL;
                }
            } else {
                lk_log(LK_LOG_WARN, "serve: the model has no chat template: chat completions use ChatML "
                                    "(choose one with --chat-template NAME)");
            }
            if (!tmpl) st = lk_chat_template_select("chatml", NULL, &tmpl, err, errlen);
        }
        s->tmpl = tmpl;
    }
    if (!st) st = srv_http_start(s, port_out, err, errlen);
    if (st) {
        server_free(s);
        return st;
    }
    if (pthread_create(&s->sched, NULL, sched_main, s)) {
        srv_http_stop(s);
        server_free(s);
        return lk_fail(err, errlen, LK_ERR_IO, "cannot start the scheduler thread");
    }
    s->sched_started = true;
    *out = s;
    return LK_OK;
}

lk_status lk_server_wait_ready(lk_server *s, char *err, size_t errlen) {
    pthread_mutex_lock(&s->mu);
    while (s->state == SRV_LOADING) pthread_cond_wait(&s->cv, &s->mu);
    lk_status st = s->state == SRV_FAILED ? (s->load_status ? s->load_status : LK_ERR_PEER) : LK_OK;
    if (st) lk_fail(err, errlen, st, "%s", s->reason);
    pthread_mutex_unlock(&s->mu);
    return st;
}

bool lk_server_failed(lk_server *s) {
    pthread_mutex_lock(&s->mu);
    bool f = s->state == SRV_FAILED;
    pthread_mutex_unlock(&s->mu);
    return f;
}

const char *lk_server_reason(lk_server *s) { return s->reason; }

void lk_server_stop(lk_server *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    if (s->state != SRV_FAILED) s->state = SRV_STOPPING;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->sched_started) pthread_join(s->sched, NULL);
    srv_http_stop(s);
    engine_down(s);
    server_free(s);
}
