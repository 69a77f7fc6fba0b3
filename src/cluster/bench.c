/* The network benchmark, on one rank of an established mesh: ping-pong
 * latency and bandwidth between ranks 0 and 1 per message size, then the
 * all-reduce time of every algorithm (over MPI links, MPI_Allreduce's too,
 * on a line of its own under the row), all in one run so they can be read
 * side by side. `lockstep netbench` runs it with --local or --addrs, and a
 * worker daemon runs it for a head that sends BENCH (--workers). */
#include "cluster/cluster.h"
#include "kernels/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

static void fmt_size(size_t n, char *buf, size_t len) {
    if (n >= (1u << 20) && !(n & ((1u << 20) - 1))) snprintf(buf, len, "%zu MiB", n >> 20);
    else if (n >= 1024 && !(n & 1023)) snprintf(buf, len, "%zu KiB", n >> 10);
    else snprintf(buf, len, "%zu B", n);
}

/* How many timed repetitions for one size: enough for a p99 when messages are
 * small, bounded in bytes when they are large. */
static int reps_for(const lk_bench_cfg *c, size_t bytes) {
    int64_t r = c->iters;
    int64_t cap = (int64_t)((256ull << 20) / bytes);
    if (r > cap) r = cap;
    return (int)(r < 20 ? 20 : r);
}

static void pool_runner(void *ctx, lk_comm_task_fn fn, void *arg, int n) { lk_pool_run_n(ctx, fn, arg, n); }

lk_status lk_bench_run(lk_mesh *mesh, const lk_bench_cfg *c, FILE *out, char *err, size_t errlen) {
    lk_comm *comm = NULL;
    lk_status st0 = lk_comm_create(mesh, NULL, lk_mesh_size(mesh), &comm, err, errlen);
    if (st0) return st0;
    lk_pool *pool = c->threads > 1 ? lk_pool_create(c->threads) : NULL;
    if (pool) lk_comm_set_runner(comm, pool_runner, pool, c->threads);
    int rank = lk_mesh_rank(mesh), n = lk_mesh_size(mesh);
    lk_comm_set_timeout_ms(comm, 20000);
    lk_comm_set_wire(comm, c->wire);
    size_t maxb = 0;
    for (int i = 0; i < c->nsizes; i++) maxb = LK_MAX(maxb, c->sizes[i]);
    maxb = (maxb + 3) & ~(size_t)3;
    char *buf = lk_xmalloc_aligned(maxb);
    float *x = lk_xmalloc_aligned(maxb);
    memset(buf, 1, maxb);
    lk_comm_reserve(comm, (int64_t)(maxb / 4));
    int maxreps = reps_for(c, 1);
    double *t = lk_xmalloc(sizeof(double) * (size_t)maxreps);
    lk_link *peer = n > 1 ? lk_mesh_link(mesh, rank == 0 ? 1 : 0) : NULL;
    int rc = 0;
    char why[LK_ERRLEN];
    if (err && errlen) err[0] = 0;
    if (rank == 0 && out) {
        fprintf(out, "netbench: %d ranks, data over %s, spin %s, all-reduce wire %s, %d thread%s a rank, build %s\n", n,
               peer ? peer->ops->name : "-", peer && peer->spin_ns ? "on" : "off", lk_wire_fmt_name(c->wire),
               LK_MAX(c->threads, 1), c->threads > 1 ? "s" : "", lk_build_id());
        fprintf(out, "%-9s %-22s %-11s | all-reduce median / p99 (us)        %s\n", "", "ping-pong one-way (us)", "", "");
        fprintf(out, "%-9s %9s %9s %11s | %-15s %-15s %-15s %-15s %s\n", "size", "median", "p99", "MB/s", "exchange",
                "doubling", "ring", "scatter", "auto");
    }
    for (int si = 0; si < c->nsizes && !rc; si++) {
        size_t bytes = c->sizes[si];
        int reps = reps_for(c, bytes), warm = reps / 10 + 2;
        double pp_med = 0, pp_p99 = 0;
        /* ping-pong between ranks 0 and 1 (the rest wait at the barrier) */
        if (n > 1 && !c->allreduce_only && rank <= 1) {
            for (int i = -warm; i < reps && !rc; i++) {
                uint64_t t0 = lk_time_ns();
                lk_status st;
                if (rank == 0) {
                    st = lk_link_send(peer, buf, bytes, lk_deadline_ms(10000), why, sizeof why);
                    if (!st) st = lk_link_recv(peer, buf, bytes, lk_deadline_ms(10000), why, sizeof why);
                } else {
                    st = lk_link_recv(peer, buf, bytes, lk_deadline_ms(10000), why, sizeof why);
                    if (!st) st = lk_link_send(peer, buf, bytes, lk_deadline_ms(10000), why, sizeof why);
                }
                if (st) { lk_fail(err, errlen, st, "rank %d: ping-pong: %s", rank, why); rc = 1; }
                if (i >= 0) t[i] = (double)(lk_time_ns() - t0) / 2e3;
            }
            if (!rc && rank == 0) {
                pp_med = pct(t, reps, 0.5);
                pp_p99 = pct(t, reps, 0.99);
            }
        }
        if (!rc && lk_comm_barrier(comm)) rc = lk_fail(err, errlen, LK_ERR_NET, "%s", lk_comm_last_error(comm)) != LK_OK;
        double ar_med[5] = {0}, ar_p99[5] = {0};
        int64_t nf = (int64_t)((bytes + 3) / 4);
        for (int a = LK_AR_EXCHANGE; a <= LK_AR_SCATTER && !rc && n > 1; a++) {
            if (a == LK_AR_RING && nf < n) continue;
            lk_comm_set_algo(comm, (lk_ar_algo)a);
            for (int i = -warm; i < reps && !rc; i++) {
                for (int64_t k = 0; k < nf; k++) x[k] = 1.0f;
                uint64_t t0 = lk_time_ns();
                if (lk_comm_allreduce_sum(comm, x, nf, -1, "netbench")) {
                    lk_fail(err, errlen, LK_ERR_NET, "rank %d: %s", rank, lk_comm_last_error(comm));
                    rc = 1;
                }
                if (i >= 0) t[i] = (double)(lk_time_ns() - t0) / 1e3;
            }
            if (!rc && fabsf(x[0] - (float)n) > 0.01f * (float)n) { /* exact for f32 and f16 */
                lk_fail(err, errlen, LK_ERR_PEER, "rank %d: wrong all-reduce result %g (want %d)", rank, x[0], n);
                rc = 1;
            }
            if (!rc) {
                ar_med[a] = pct(t, reps, 0.5);
                ar_p99[a] = pct(t, reps, 0.99);
            }
            if (!rc && lk_comm_barrier(comm)) rc = lk_fail(err, errlen, LK_ERR_NET, "%s", lk_comm_last_error(comm)) != LK_OK;
        }
        /* Over MPI links: MPI's own all-reduce too, for comparison (every
         * rank's links are MPI, so all of them get here) */
        double mpi_med = 0, mpi_p99 = 0;
        if (!rc && n > 1 && lk_mpi_report(peer)) {
            for (int i = -warm; i < reps && !rc; i++) {
                for (int64_t k = 0; k < nf; k++) x[k] = 1.0f;
                uint64_t t0 = lk_time_ns();
                if (lk_mpi_allreduce_f32(x, nf, lk_deadline_ms(20000), why, sizeof why)) {
                    lk_fail(err, errlen, LK_ERR_NET, "rank %d: %s", rank, why);
                    rc = 1;
                }
                if (i >= 0) t[i] = (double)(lk_time_ns() - t0) / 1e3;
            }
            if (!rc && x[0] != (float)n) {
                lk_fail(err, errlen, LK_ERR_PEER, "rank %d: wrong MPI_Allreduce result %g (want %d)", rank, x[0], n);
                rc = 1;
            }
            if (!rc) {
                mpi_med = pct(t, reps, 0.5);
                mpi_p99 = pct(t, reps, 0.99);
            }
            if (!rc && lk_comm_barrier(comm)) rc = lk_fail(err, errlen, LK_ERR_NET, "%s", lk_comm_last_error(comm)) != LK_OK;
        }
        if (!rc && rank == 0 && out) {
            char sz[32], cell[4][32];
            fmt_size(bytes, sz, sizeof sz);
            for (int a = 1; a <= 4; a++) {
                if (ar_med[a] > 0) snprintf(cell[a - 1], 32, "%.1f / %.1f", ar_med[a], ar_p99[a]);
                else snprintf(cell[a - 1], 32, "-");
            }
            const char *pick = lk_ar_algo_name(lk_comm_algo(comm, bytes));
            if (c->allreduce_only || n < 2)
                fprintf(out, "%-9s %9s %9s %11s | %-15s %-15s %-15s %-15s %s\n", sz, "-", "-", "-", cell[0], cell[1],
                        cell[2], cell[3], pick);
            else
                fprintf(out, "%-9s %9.2f %9.2f %11.1f | %-15s %-15s %-15s %-15s %s\n", sz, pp_med, pp_p99,
                        (double)bytes / pp_med, cell[0], cell[1], cell[2], cell[3], pick);
            /* not a table row (no number first): readers of the table skip it */
            if (mpi_med > 0) fprintf(out, "%-9s %-33s | MPI_Allreduce %.1f / %.1f\n", "", "", mpi_med, mpi_p99);
            fflush(out);
        }
    }
    free(t);
    free(buf);
    free(x);
    lk_comm_free(comm);
    lk_pool_free(pool);
    return rc ? (err && err[0] ? LK_ERR_NET : lk_fail(err, errlen, LK_ERR_NET, "benchmark failed")) : LK_OK;
}

