/* bench_pool — what a pool dispatch costs: the wall time of a job of
 * n_tasks tasks against the work in it, at each thread count.
 *
 *   make B=build build/bench/bench_pool
 *   build/bench/bench_pool [threads,..] [tasks per thread] [work us per thread]
 *   (defaults 1,2,4,8,16  4  25: a decode matmul of TinyLlama's 2048 x 2048 Q4_0
 *   at 16 threads is ~25 us of streaming per thread)
 *
 * Each task spins on the clock for its share of the work (no memory
 * traffic), so what the job takes beyond work / threads is the pool's:
 * publishing, waking, claiming, stealing, the last task's tail and the
 * caller's wait. Prints per thread count: empty job us, job us, efficiency
 * (work / threads / job time), medians of 2000 jobs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

typedef struct { uint64_t ns; } job;

static void spin_fn(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    const job *j = arg;
    if (!j->ns) return;
    const uint64_t t0 = lk_time_ns();
    while (lk_time_ns() - t0 < j->ns) { }
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static double median_job_us(lk_pool *p, job *j, int n_tasks, int reps) {
    uint64_t *t = malloc(sizeof(uint64_t) * (size_t)reps);
    for (int r = 0; r < reps; r++) {
        const uint64_t t0 = lk_time_ns();
        lk_pool_run_n(p, spin_fn, j, n_tasks);
        t[r] = lk_time_ns() - t0;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_u64);
    const double us = t[reps / 2] / 1e3;
    free(t);
    return us;
}

int main(int argc, char **argv) {
    const char *ts = argc > 1 ? argv[1] : "1,2,4,8,16";
    const int per = argc > 2 ? atoi(argv[2]) : 4;
    const double work_us = argc > 3 ? atof(argv[3]) : 25;
    if (per < 1 || per > 64 || !(work_us >= 0 && work_us < 1e6)) {
        fprintf(stderr, "usage: bench_pool [threads,..] [tasks per thread 1-64] [work us per thread]\n");
        return 2;
    }
    printf("| threads | tasks | empty job us | job us (work %.1f us per thread) | efficiency |\n|---:|---:|---:|---:|---:|\n",
           work_us);
    char *copy = strdup(ts), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        const int nt = atoi(tok);
        if (nt < 1 || nt > 1024) { fprintf(stderr, "bench_pool: bad thread count '%s'\n", tok); return 2; }
        lk_pool *p = lk_pool_create(nt);
        const int n_tasks = nt * per;
        job e = { 0 }, w = { (uint64_t)(work_us * 1e3 * nt / n_tasks) };
        median_job_us(p, &w, n_tasks, 200); /* warm: threads running, lines settled */
        const double empty = median_job_us(p, &e, n_tasks, 2000);
        const double full = median_job_us(p, &w, n_tasks, 2000);
        printf("| %d | %d | %.2f | %.2f | %.0f %% |\n", nt, n_tasks, empty, full, 100 * work_us / full);
        lk_pool_free(p);
    }
    free(copy);
    return 0;
}
