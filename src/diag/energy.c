/* Joules from the machine's own counters (diag.h: lk_energy).
 *
 * Sources, the first that can be read:
 *  1. RAPL package zones under /sys/class/powercap: every top-level zone
 *     (`intel-rapl:N`; AMD's kernels name theirs the same) whose energy_uj
 *     reads. The counter is microjoules since some past moment and wraps at
 *     max_energy_range_uj (about 262 kJ on Intel: 22 minutes at 200 W), so a
 *     sampler reads it every 250 ms and adds the deltas modulo the range
 *     (a wrap is missed only if the sampler sleeps through a whole range).
 *  2. hwmon power sensors under /sys/class/hwmon: power1_average, else
 *     power1_input (microwatts; AMD APUs' amdgpu and k10temp-style drivers,
 *     laptops' batteries are not hwmon). These are rates: the sampler reads
 *     them every 100 ms and integrates (trapezoids).
 * LK_POWERCAP_ROOT and LK_HWMON_ROOT replace the two roots (tests; a machine
 * with its sysfs elsewhere). The sampler sleeps between reads: it costs
 * nothing on the step path. */
#include "diag/diag.h"

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_SRC = 16 };

struct lk_energy {
    bool rapl;                   /* counters (else power sensors) */
    int n;
    char path[MAX_SRC][512];
    double range_j[MAX_SRC];     /* RAPL: the wrap */
    double last[MAX_SRC];        /* RAPL: last reading, J; hwmon: last power, W */
    double t_last;
    double joules;               /* accumulated since open */
    char source[160];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    bool stop;
};

static bool read_num(const char *path, double *v) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char buf[64];
    bool ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    if (!ok) return false;
    char *end;
    double x = strtod(buf, &end);
    if (end == buf || x < 0) return false;
    *v = x;
    return true;
}

/* Top-level RAPL zones: a name like "intel-rapl:0" (one colon), not a subzone "intel-rapl:0:1". */
static bool rapl_zone(const char *name) {
    const char *c = strchr(name, ':');
    return c && !strchr(c + 1, ':') && strstr(name, "rapl");
}

static int find_rapl(lk_energy *e, const char *root) {
    DIR *d = opendir(root);
    if (!d) return 0;
    struct dirent *de;
    while ((de = readdir(d)) && e->n < MAX_SRC) {
        if (!rapl_zone(de->d_name)) continue;
        char p[512], q[512];
        double v, range;
        snprintf(p, sizeof p, "%s/%s/energy_uj", root, de->d_name);
        snprintf(q, sizeof q, "%s/%s/max_energy_range_uj", root, de->d_name);
        if (!read_num(p, &v)) continue;
        if (!read_num(q, &range) || range <= 0) range = 0;
        snprintf(e->path[e->n], sizeof e->path[0], "%s", p);
        e->range_j[e->n] = range * 1e-6;
        e->last[e->n] = v * 1e-6;
        e->n++;
    }
    closedir(d);
    return e->n;
}

static int find_hwmon(lk_energy *e, const char *root) {
    DIR *d = opendir(root);
    if (!d) return 0;
    struct dirent *de;
    while ((de = readdir(d)) && e->n < MAX_SRC) {
        if (de->d_name[0] == '.') continue;
        static const char *files[] = { "power1_average", "power1_input" };
        for (int k = 0; k < 2; k++) {
            char p[512];
            double v;
            snprintf(p, sizeof p, "%s/%s/%s", root, de->d_name, files[k]);
            if (!read_num(p, &v)) continue;
            snprintf(e->path[e->n], sizeof e->path[0], "%s", p);
            e->last[e->n] = v * 1e-6;
            e->n++;
            break;
        }
    }
    closedir(d);
    return e->n;
}

/* One reading of every source, added to e->joules (under e->mu). */
static void sample(lk_energy *e) {
    double now = lk_time_s(), dt = now - e->t_last;
    for (int i = 0; i < e->n; i++) {
        double v;
        if (!read_num(e->path[i], &v)) continue;   /* a transient read error: the next sample catches up (RAPL) */
        v *= 1e-6;
        if (e->rapl) {
            double dj = v - e->last[i];
            if (dj < 0) dj += e->range_j[i];       /* wrapped (once: the sampler reads often) */
            if (dj >= 0) e->joules += dj;
        } else {
            e->joules += 0.5 * (v + e->last[i]) * dt;
        }
        e->last[i] = v;
    }
    e->t_last = now;
}

static void *sampler(void *arg) {
    lk_energy *e = arg;
    double period = e->rapl ? 0.25 : 0.1;
    pthread_mutex_lock(&e->mu);
    while (!e->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = ts.tv_sec + ts.tv_nsec * 1e-9 + period;
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        if (!e->stop) sample(e);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

lk_energy *lk_energy_open(void) {
    lk_energy *e = lk_xcalloc(1, sizeof *e);
    const char *pc = getenv("LK_POWERCAP_ROOT"), *hw = getenv("LK_HWMON_ROOT");
    if (find_rapl(e, pc && *pc ? pc : "/sys/class/powercap")) {
        e->rapl = true;
        snprintf(e->source, sizeof e->source, "RAPL, %d package zone%s (%s)", e->n, e->n > 1 ? "s" : "",
                 pc && *pc ? pc : "/sys/class/powercap");
    } else if (find_hwmon(e, hw && *hw ? hw : "/sys/class/hwmon")) {
        snprintf(e->source, sizeof e->source, "hwmon, %d power sensor%s (%s)", e->n, e->n > 1 ? "s" : "",
                 hw && *hw ? hw : "/sys/class/hwmon");
    } else {
        free(e);
        return NULL;
    }
    e->t_last = lk_time_s();
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    if (pthread_create(&e->th, NULL, sampler, e)) {
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->cv);
        free(e);
        return NULL;
    }
    return e;
}

const char *lk_energy_source(const lk_energy *e) { return e ? e->source : "unavailable"; }

double lk_energy_joules(lk_energy *e) {
    if (!e) return 0;
    pthread_mutex_lock(&e->mu);
    sample(e);
    double j = e->joules;
    pthread_mutex_unlock(&e->mu);
    return j;
}

void lk_energy_close(lk_energy *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->th, NULL);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}
