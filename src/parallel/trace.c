/* Chrome trace events per rank: the sink behind `run --trace` (trace.h).
 *
 * Each process writes FILE.part.<pid>: one event per line, no commas (the
 * merge adds them). A step's span is written when the step begins, with a
 * fixed-width duration that every flush rewrites in place (pwrite), so a
 * forked rank that leaves with _exit after its last step still leaves a
 * step span that covers every event it flushed. */
#include "parallel/trace.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

bool lk_trace_on;

static struct {
    pthread_mutex_t mu;
    char     path[PATH_MAX];
    pid_t    pid;          /* the process the fields below belong to */
    int      fd;           /* FILE.part.<pid>, -1 until the first event */
    int      rank;         /* -1: not yet known */
    char     buf[1 << 16];
    size_t   len;
    off_t    off;          /* bytes written to fd */
    bool     step_open;
    uint64_t step_no, step_t0, last_end;
    int      step_tokens;
    off_t    step_line;    /* offset of the open step's line in fd (-1: still in buf) */
    size_t   step_buf;     /* ... or its position in buf */
} T = {.mu = PTHREAD_MUTEX_INITIALIZER, .fd = -1, .rank = -1, .step_line = -1};

static double us(uint64_t ns) { return (double)ns / 1e3; }

/* The step's line: fixed width, so it can be rewritten in place. */
#define STEP_FMT "{\"name\":\"step %llu\",\"cat\":\"step\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%16.3f,\"args\":{\"tokens\":%d}}\n"

static void step_line(char *out, size_t cap, uint64_t end) {
    double dur = end > T.step_t0 ? us(end - T.step_t0) : 0;
    snprintf(out, cap, STEP_FMT, (unsigned long long)T.step_no, T.rank, us(T.step_t0), dur, T.step_tokens);
}

/* After a fork the inherited state is the parent's: start afresh. */
static bool ensure(void) {
    if (T.pid != getpid() || T.fd < 0) {
        if (T.pid != getpid()) {
            T.pid = getpid();
            T.len = 0, T.off = 0, T.step_open = false, T.rank = -1, T.step_line = -1;
            T.fd = -1;
        }
        char part[PATH_MAX + 32];
        snprintf(part, sizeof part, "%s.part.%d", T.path, (int)T.pid);
        T.fd = open(part, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (T.fd < 0) {
            lk_log(LK_LOG_WARN, "trace: cannot write %s: %s (tracing off in this process)", part, strerror(errno));
            lk_trace_on = false;
            return false;
        }
    }
    return true;
}

static void flush(void) {
    if (T.fd < 0) return;
    size_t done = 0;
    while (done < T.len) {
        ssize_t k = write(T.fd, T.buf + done, T.len - done);
        if (k <= 0) break;
        done += (size_t)k;
    }
    if (T.step_open && T.step_line < 0) T.step_line = T.off + (off_t)T.step_buf;
    T.off += (off_t)done;
    T.len = 0;
    if (T.step_open && T.step_line >= 0) { /* the open step now ends at its last event */
        char line[512];
        step_line(line, sizeof line, T.last_end);
        if (pwrite(T.fd, line, strlen(line), T.step_line) < 0) lk_log(LK_LOG_DEBUG, "trace: pwrite failed");
    }
}

static void put(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void put(const char *fmt, ...) {
    if (T.len > sizeof T.buf - 600) flush();
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(T.buf + T.len, sizeof T.buf - T.len, fmt, ap);
    va_end(ap);
    if (k > 0) T.len += LK_MIN((size_t)k, sizeof T.buf - T.len - 1);
}

static void set_rank(int rank) {
    if (T.rank == rank) return;
    T.rank = rank;
    put("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}\n", rank, rank);
    put("{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"sort_index\":%d}}\n", rank, rank);
}

/* The open step's stretch from its previous event to t as a compute span */
static void compute_until(int rank, uint64_t t) {
    if (T.step_open && t > T.last_end)
        put("{\"name\":\"compute\",\"cat\":\"compute\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f}\n",
            rank, us(T.last_end), us(t - T.last_end));
}

lk_status lk_trace_start(const char *path, char *err, size_t errlen) {
    if (strlen(path) >= sizeof T.path - 32) return lk_fail(err, errlen, LK_ERR_ARG, "--trace %s: path too long", path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return lk_fail(err, errlen, LK_ERR_IO, "--trace %s: %s", path, strerror(errno));
    close(fd);
    snprintf(T.path, sizeof T.path, "%s", path);
    T.pid = getpid();
    T.fd = -1;
    lk_trace_on = true;
    return LK_OK;
}

void lk_trace_step(int rank, uint64_t no, int n_tokens) {
    if (!lk_trace_on) return;
    uint64_t now = lk_time_ns();
    pthread_mutex_lock(&T.mu);
    if (ensure()) {
        set_rank(rank);
        flush(); /* closes the previous step at its last event */
        T.step_open = true;
        T.step_no = no, T.step_t0 = now, T.last_end = now, T.step_tokens = n_tokens;
        T.step_line = -1, T.step_buf = T.len;
        char line[512];
        step_line(line, sizeof line, now);
        put("%s", line);
        /* out at once: a rank whose step has no collective (a pipeline
         * stage of one) would otherwise keep its last step in the buffer
         * when it leaves with _exit */
        flush();
    }
    pthread_mutex_unlock(&T.mu);
}

void lk_trace_comm(int rank, const char *op, const char *what, int layer, size_t bytes, uint64_t t0, uint64_t t1) {
    if (!lk_trace_on) return;
    pthread_mutex_lock(&T.mu);
    if (ensure()) {
        set_rank(rank);
        compute_until(rank, t0);
        char name[96];
        /* the callers' names say what it is ("attention output all-reduce") */
        if (what && layer >= 0) snprintf(name, sizeof name, "%s L%d", what, layer);
        else snprintf(name, sizeof name, "%s%s%s", op, what ? " " : "", what ? what : "");
        for (char *q = name; *q; q++)
            if (*q == '"' || *q == '\\' || (unsigned char)*q < 0x20) *q = '_'; /* stays valid JSON */
        put("{\"name\":\"%s\",\"cat\":\"comm\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,"
            "\"args\":{\"layer\":%d,\"bytes\":%zu}}\n",
            name, rank, us(t0), us(t1 > t0 ? t1 - t0 : 0), layer, bytes);
        if (T.step_open && t1 > T.last_end) T.last_end = t1;
        /* a gather (the candidates) ends a rank's step: out now, since a
         * forked rank leaves with _exit after its last one */
        if (!strcmp(op, "gather") || T.len > sizeof T.buf / 2) flush();
    }
    pthread_mutex_unlock(&T.mu);
}

void lk_trace_work(int rank) {
    if (!lk_trace_on) return;
    const uint64_t now = lk_time_ns();
    pthread_mutex_lock(&T.mu);
    if (ensure() && T.step_open && now > T.last_end) {
        set_rank(rank);
        compute_until(rank, now);
        T.last_end = now;
        flush(); /* rewrites the step's line: it now ends here */
    }
    pthread_mutex_unlock(&T.mu);
}

lk_status lk_trace_finish(int *n_ranks, int *n_events, char *err, size_t errlen) {
    if (n_ranks) *n_ranks = 0;
    if (n_events) *n_events = 0;
    if (!T.path[0]) return LK_OK;
    pthread_mutex_lock(&T.mu);
    if (T.pid == getpid()) flush();
    if (T.fd >= 0) close(T.fd);
    T.fd = -1;
    T.step_open = false;
    lk_trace_on = false;
    pthread_mutex_unlock(&T.mu);
    /* the parts: FILE.part.<pid> in FILE's folder */
    char dir[PATH_MAX], base[PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s", T.path);
    char *slash = strrchr(dir, '/');
    if (slash) {
        snprintf(base, sizeof base, "%s.part.", slash + 1);
        if (slash == dir) dir[1] = 0;
        else *slash = 0;
    } else {
        snprintf(base, sizeof base, "%s.part.", T.path);
        snprintf(dir, sizeof dir, ".");
    }
    FILE *out = fopen(T.path, "w");
    if (!out) return lk_fail(err, errlen, LK_ERR_IO, "--trace %s: %s", T.path, strerror(errno));
    fprintf(out, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    DIR *d = opendir(dir);
    int events = 0, ranks = 0;
    struct dirent *de;
    char *line = NULL;
    size_t cap = 0;
    while (d && (de = readdir(d))) {
        if (strncmp(de->d_name, base, strlen(base))) continue;
        char part[PATH_MAX * 2 + 2];
        snprintf(part, sizeof part, "%s/%s", dir, de->d_name);
        FILE *f = fopen(part, "r");
        if (!f) continue;
        ssize_t k;
        bool any = false;
        while ((k = getline(&line, &cap, f)) > 0) {
            if (line[k - 1] == '\n') line[--k] = 0;
            if (!k) continue;
            fprintf(out, "%s%s", events ? ",\n" : "", line);
            events++;
            any = true;
        }
        ranks += any;
        fclose(f);
        unlink(part);
    }
    free(line);
    if (d) closedir(d);
    fprintf(out, "\n]}\n");
    bool bad = ferror(out);
    if (fclose(out) || bad) return lk_fail(err, errlen, LK_ERR_IO, "--trace %s: write failed", T.path);
    if (n_ranks) *n_ranks = ranks;
    if (n_events) *n_events = events;
    return LK_OK;
}
