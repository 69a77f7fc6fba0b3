/* Collectives over a transport mesh: all-reduce (three algorithms),
 * broadcast, gather, barrier, argmax.
 *
 * Latency is the whole game for decode: a 4096-float hidden vector is 16 KiB,
 * which a link moves in a few microseconds, while every *round* costs a full
 * link latency (27 us blocked, ~5 us spinning on TCP loopback). So small
 * vectors use the fewest rounds: one full exchange (everyone sends its
 * partial to everyone; 1 round, N-1 messages out per rank) while N is small,
 * recursive doubling (log2 N rounds) for more ranks, and the ring (2(N-1)
 * rounds, but only 2(N-1)/N of the vector per rank on the wire) only for
 * large prefill vectors where bytes dominate.
 *
 * Nothing here allocates after lk_comm_reserve(): scratch and transfer
 * tables are sized once. */
#include "parallel/parallel.h"
#include "transport/transport.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct lk_comm {
    lk_mesh  *mesh;
    int       me, n;        /* position in the group, group size */
    int      *ranks;        /* [n] mesh rank of each group member */
    lk_link **links;        /* [n] link to each member (NULL for me) */
    lk_xfer  *xf;           /* [2n] transfer table */
    float    *scratch;      /* [scratch_n] */
    int64_t   scratch_n;
    int64_t   timeout_ms;
    lk_ar_algo force;
    char      err[LK_ERRLEN];
};

const char *lk_ar_algo_name(lk_ar_algo a) {
    switch (a) {
    case LK_AR_AUTO: return "auto";
    case LK_AR_EXCHANGE: return "exchange";
    case LK_AR_DOUBLING: return "doubling";
    case LK_AR_RING: return "ring";
    }
    return "?";
}

/* Thresholds: below 64 KiB the round count dominates on every link we have
 * measured (TCP loopback, shm, 1-25 GbE), so exchange (1 round) while the
 * N-1 outgoing copies stay cheap (N <= 4), else doubling. Above, the ring's
 * 2/N share of bytes per rank wins once N > 2. */
lk_ar_algo lk_comm_pick(int n_ranks, size_t bytes) {
    if (bytes <= 64 * 1024) return n_ranks <= 4 ? LK_AR_EXCHANGE : LK_AR_DOUBLING;
    return n_ranks <= 2 ? LK_AR_EXCHANGE : LK_AR_RING;
}

lk_status lk_comm_create(lk_mesh *mesh, const int *ranks, int n, lk_comm **out, char *err, size_t errlen) {
    *out = NULL;
    int mn = lk_mesh_size(mesh), mr = lk_mesh_rank(mesh);
    if (!ranks) n = mn;
    /* 64: the small fixed tables of exchange/argmax; far above any TP group. */
    if (n < 1 || n > mn || n > 64)
        return lk_fail(err, errlen, LK_ERR_ARG, "comm: group of %d ranks in a mesh of %d (at most 64)", n, mn);
    lk_comm *c = lk_xcalloc(1, sizeof *c);
    c->mesh = mesh;
    c->n = n;
    c->me = -1;
    c->ranks = lk_xcalloc((size_t)n, sizeof *c->ranks);
    c->links = lk_xcalloc((size_t)n, sizeof *c->links);
    c->xf = lk_xcalloc((size_t)(2 * n), sizeof *c->xf);
    c->timeout_ms = 30000;
    for (int i = 0; i < n; i++) {
        int r = ranks ? ranks[i] : i;
        bool dup = false;
        for (int j = 0; j < i; j++) dup |= c->ranks[j] == r;
        if (r < 0 || r >= mn || dup) {
            lk_comm_free(c);
            return lk_fail(err, errlen, LK_ERR_ARG, "comm: bad or repeated mesh rank %d in group", r);
        }
        c->ranks[i] = r;
        if (r == mr) c->me = i;
        else c->links[i] = lk_mesh_link(mesh, r);
    }
    if (c->me < 0) {
        lk_comm_free(c);
        return lk_fail(err, errlen, LK_ERR_ARG, "comm: mesh rank %d is not in the group", mr);
    }
    *out = c;
    return LK_OK;
}

void lk_comm_free(lk_comm *c) {
    if (!c) return;
    free(c->ranks);
    free(c->links);
    free(c->xf);
    free(c->scratch);
    free(c);
}

int lk_comm_rank(const lk_comm *c) { return c->me; }
int lk_comm_size(const lk_comm *c) { return c->n; }
void lk_comm_set_timeout_ms(lk_comm *c, int64_t ms) { c->timeout_ms = ms > 0 ? ms : 1; }
void lk_comm_set_algo(lk_comm *c, lk_ar_algo a) { c->force = a; }
const char *lk_comm_last_error(const lk_comm *c) { return c->err; }

static int64_t scratch_need(int n_ranks, int64_t n) {
    /* exchange: one slot per peer; doubling: one vector; ring: one chunk. */
    return (int64_t)(n_ranks > 1 ? n_ranks - 1 : 1) * n;
}

void lk_comm_reserve(lk_comm *c, int64_t n) {
    int64_t need = scratch_need(c->n, n);
    if (need <= c->scratch_n) return;
    free(c->scratch);
    c->scratch = lk_xmalloc_aligned((size_t)need * sizeof(float));
    c->scratch_n = need;
}

static uint64_t deadline(const lk_comm *c) { return lk_deadline_ms(c->timeout_ms); }

/* Records "op context: transport message" as the comm's last error. */
static lk_status failed(lk_comm *c, lk_status st, const char *why, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static lk_status failed(lk_comm *c, lk_status st, const char *why, const char *fmt, ...) {
    char ctx[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx, sizeof ctx, fmt, ap);
    va_end(ap);
    snprintf(c->err, sizeof c->err, "%s: %s", ctx, why);
    return st;
}

static inline lk_xfer xsend(lk_link *l, const void *p, size_t n) {
    return (lk_xfer){.link = l, .is_send = true, .buf = (void *)p, .n = n};
}
static inline lk_xfer xrecv(lk_link *l, void *p, size_t n) {
    return (lk_xfer){.link = l, .is_send = false, .buf = p, .n = n};
}

/* ---- all-reduce ---------------------------------------------------------- */

static lk_status ar_exchange(lk_comm *c, float *x, int64_t n, uint64_t dl, char *why, size_t wl) {
    size_t bytes = (size_t)n * sizeof(float);
    int nx = 0;
    for (int r = 0; r < c->n; r++) {
        if (r == c->me) continue;
        float *slot = c->scratch + (int64_t)(r < c->me ? r : r - 1) * n;
        c->xf[nx++] = xsend(c->links[r], x, bytes);
        c->xf[nx++] = xrecv(c->links[r], slot, bytes);
    }
    lk_status st = lk_xfer_run(c->xf, nx, dl, why, wl);
    if (st) return st;
    /* Sum in rank order 0..N-1; x is rank me's partial. */
    const float *part[64];
    LK_ASSERT(c->n <= 64);
    for (int r = 0; r < c->n; r++)
        part[r] = r == c->me ? x : c->scratch + (int64_t)(r < c->me ? r : r - 1) * n;
    for (int64_t i = 0; i < n; i++) {
        float s = part[0][i];
        for (int r = 1; r < c->n; r++) s += part[r][i];
        x[i] = s;
    }
    return LK_OK;
}

/* Adds in a fixed order: lo + hi, whichever of (x, y) holds the lower
 * ranks' sum, so both partners compute the same bits. */
static void add_ordered(float *x, const float *y, int64_t n, bool x_is_lower) {
    if (x_is_lower) for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i];
    else            for (int64_t i = 0; i < n; i++) x[i] = y[i] + x[i];
}

static lk_status ar_doubling(lk_comm *c, float *x, int64_t n, uint64_t dl, char *why, size_t wl) {
    size_t bytes = (size_t)n * sizeof(float);
    int p = 1;
    while (p * 2 <= c->n) p *= 2;
    int me = c->me, extra = c->n - p;
    float *y = c->scratch;
    lk_status st;
    /* Ranks p.. fold into rank (r - p) first, and get the result back last. */
    if (me >= p) {
        c->xf[0] = xsend(c->links[me - p], x, bytes);
        if ((st = lk_xfer_run(c->xf, 1, dl, why, wl))) return st;
        c->xf[0] = xrecv(c->links[me - p], x, bytes);
        return lk_xfer_run(c->xf, 1, dl, why, wl);
    }
    if (me < extra) {
        c->xf[0] = xrecv(c->links[me + p], y, bytes);
        if ((st = lk_xfer_run(c->xf, 1, dl, why, wl))) return st;
        add_ordered(x, y, n, true);
    }
    for (int k = 1; k < p; k <<= 1) {
        int partner = me ^ k;
        c->xf[0] = xsend(c->links[partner], x, bytes);
        c->xf[1] = xrecv(c->links[partner], y, bytes);
        if ((st = lk_xfer_run(c->xf, 2, dl, why, wl))) return st;
        add_ordered(x, y, n, me < partner);
    }
    if (me < extra) {
        c->xf[0] = xsend(c->links[me + p], x, bytes);
        if ((st = lk_xfer_run(c->xf, 1, dl, why, wl))) return st;
    }
    return LK_OK;
}

/* Chunk k of n elements split into N near-equal parts. */
static inline int64_t chunk_at(int64_t n, int N, int k) { return n * k / N; }

static lk_status ar_ring(lk_comm *c, float *x, int64_t n, uint64_t dl, char *why, size_t wl) {
    int N = c->n, me = c->me;
    lk_link *next = c->links[(me + 1) % N], *prev = c->links[(me + N - 1) % N];
    float *y = c->scratch;
    lk_status st;
    /* Reduce-scatter: at step s we pass on chunk (me - s) and fold the
     * incoming chunk (me - s - 1) into ours as (incoming + mine): chunk k's
     * sum is built in the order k, k+1, ..., k-1 on every run. */
    for (int s = 0; s < N - 1; s++) {
        int cs = ((me - s) % N + N) % N, cr = ((me - s - 1) % N + N) % N;
        int64_t s0 = chunk_at(n, N, cs), s1 = chunk_at(n, N, cs + 1);
        int64_t r0 = chunk_at(n, N, cr), r1 = chunk_at(n, N, cr + 1);
        c->xf[0] = xsend(next, x + s0, (size_t)(s1 - s0) * sizeof(float));
        c->xf[1] = xrecv(prev, y, (size_t)(r1 - r0) * sizeof(float));
        if ((st = lk_xfer_run(c->xf, 2, dl, why, wl))) return st;
        for (int64_t i = 0; i < r1 - r0; i++) x[r0 + i] = y[i] + x[r0 + i];
    }
    /* All-gather: rank me now owns the full sum of chunk (me + 1). */
    for (int s = 0; s < N - 1; s++) {
        int cs = ((me + 1 - s) % N + N) % N, cr = ((me - s) % N + N) % N;
        int64_t s0 = chunk_at(n, N, cs), s1 = chunk_at(n, N, cs + 1);
        int64_t r0 = chunk_at(n, N, cr), r1 = chunk_at(n, N, cr + 1);
        c->xf[0] = xsend(next, x + s0, (size_t)(s1 - s0) * sizeof(float));
        c->xf[1] = xrecv(prev, x + r0, (size_t)(r1 - r0) * sizeof(float));
        if ((st = lk_xfer_run(c->xf, 2, dl, why, wl))) return st;
    }
    return LK_OK;
}

lk_status lk_comm_allreduce_sum(lk_comm *c, float *x, int64_t n, int layer, const char *what) {
    if (c->n == 1 || n <= 0) return LK_OK;
    size_t bytes = (size_t)n * sizeof(float);
    lk_ar_algo a = c->force ? c->force : lk_comm_pick(c->n, bytes);
    if (a == LK_AR_RING && n < c->n) a = LK_AR_EXCHANGE; /* chunks would be empty */
    if (scratch_need(c->n, n) > c->scratch_n) {
        lk_log(LK_LOG_DEBUG, "comm: growing all-reduce scratch to %lld floats", (long long)n);
        lk_comm_reserve(c, n);
    }
    char why[LK_ERRLEN];
    uint64_t dl = deadline(c);
    lk_status st = a == LK_AR_EXCHANGE ? ar_exchange(c, x, n, dl, why, sizeof why)
                 : a == LK_AR_DOUBLING ? ar_doubling(c, x, n, dl, why, sizeof why)
                                       : ar_ring(c, x, n, dl, why, sizeof why);
    if (st) {
        char lay[32] = "";
        if (layer >= 0) snprintf(lay, sizeof lay, " layer %d", layer);
        return failed(c, st, why, "all-reduce%s %s (%zu B, %s)", lay, what ? what : "", bytes, lk_ar_algo_name(a));
    }
    return LK_OK;
}

/* ---- the others ---------------------------------------------------------- */

lk_status lk_comm_broadcast(lk_comm *c, void *buf, size_t bytes, int root, const char *what) {
    LK_ASSERT(root >= 0 && root < c->n);
    if (c->n == 1 || !bytes) return LK_OK;
    int nx = 0;
    if (c->me == root) {
        for (int r = 0; r < c->n; r++)
            if (r != root) c->xf[nx++] = xsend(c->links[r], buf, bytes);
    } else {
        c->xf[nx++] = xrecv(c->links[root], buf, bytes);
    }
    char why[LK_ERRLEN];
    lk_status st = lk_xfer_run(c->xf, nx, deadline(c), why, sizeof why);
    if (st) return failed(c, st, why, "broadcast %s (%zu B from rank %d)", what ? what : "", bytes, root);
    return LK_OK;
}

lk_status lk_comm_gather(lk_comm *c, const void *in, size_t bytes, void *out, int root, const char *what) {
    LK_ASSERT(root >= 0 && root < c->n);
    int nx = 0;
    if (c->me == root) {
        memcpy((char *)out + (size_t)root * bytes, in, bytes);
        for (int r = 0; r < c->n; r++)
            if (r != root) c->xf[nx++] = xrecv(c->links[r], (char *)out + (size_t)r * bytes, bytes);
    } else {
        c->xf[nx++] = xsend(c->links[root], in, bytes);
    }
    if (!nx || !bytes) return LK_OK;
    char why[LK_ERRLEN];
    lk_status st = lk_xfer_run(c->xf, nx, deadline(c), why, sizeof why);
    if (st) return failed(c, st, why, "gather %s (%zu B to rank %d)", what ? what : "", bytes, root);
    return LK_OK;
}

/* Everyone sends `bytes` from `mine` to everyone; slot r of `all` gets rank
 * r's (slot me is left to the caller). */
static lk_status exchange_all(lk_comm *c, const void *mine, void *all, size_t bytes, char *why, size_t wl) {
    int nx = 0;
    for (int r = 0; r < c->n; r++) {
        if (r == c->me) continue;
        c->xf[nx++] = xsend(c->links[r], mine, bytes);
        c->xf[nx++] = xrecv(c->links[r], (char *)all + (size_t)r * bytes, bytes);
    }
    return lk_xfer_run(c->xf, nx, deadline(c), why, wl);
}

lk_status lk_comm_barrier(lk_comm *c) {
    if (c->n == 1) return LK_OK;
    uint8_t mine = 1, all[64];
    LK_ASSERT(c->n <= 64);
    char why[LK_ERRLEN];
    lk_status st = exchange_all(c, &mine, all, 1, why, sizeof why);
    if (st) return failed(c, st, why, "barrier");
    return LK_OK;
}

typedef struct {
    float   v;
    int32_t pad;
    int64_t i;
} vi_pair;

lk_status lk_comm_argmax(lk_comm *c, float *value, int64_t *index) {
    if (c->n == 1) return LK_OK;
    vi_pair mine = {*value, 0, *index}, all[64];
    LK_ASSERT(c->n <= 64);
    char why[LK_ERRLEN];
    lk_status st = exchange_all(c, &mine, all, sizeof mine, why, sizeof why);
    if (st) return failed(c, st, why, "argmax");
    all[c->me] = mine;
    vi_pair best = {-INFINITY, 0, -1};
    bool have = false;
    for (int r = 0; r < c->n; r++) {
        vi_pair p = all[r];
        if (isnan(p.v)) continue;
        if (!have || p.v > best.v || (p.v == best.v && p.i < best.i)) best = p, have = true;
    }
    if (!have) best = all[0]; /* all NaN: still the same answer everywhere */
    *value = best.v;
    *index = best.i;
    return LK_OK;
}

static lk_status tp_hook(void *ctx, float *x, int64_t n, int layer, const char *what) {
    return lk_comm_allreduce_sum(ctx, x, n, layer, what);
}

void lk_comm_tp_hooks(lk_comm *c, lk_tp_hooks *h) {
    h->ctx = c;
    h->allreduce_sum = tp_hook;
}
