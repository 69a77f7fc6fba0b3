/* limits.c — what this process may use of the machine: CPUs (the affinity
 * mask, a cgroup CPU quota, physical cores among them) and memory
 * (MemAvailable, a cgroup memory limit, RLIMIT_AS). See lk_common.h.
 *
 * Why not sysconf(_SC_NPROCESSORS_ONLN): it counts every online CPU of the
 * host, also those `taskset`, a container's cpuset or its CPU quota keep
 * from us, and SMT siblings that add little to memory-bound decoding; a
 * pool of that many threads then waits at every barrier for threads that
 * have no CPU to run on. Why not MemAvailable alone: inside a container it
 * is the host's, and a KV cache sized by it is killed by the cgroup's OOM
 * killer instead of refused with the numbers. */
#include "common/lk_common.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

/* ---- cgroups ------------------------------------------------------------------------
 * A process's cgroup is in /proc/self/cgroup: "0::/path" (v2, mounted at
 * /sys/fs/cgroup) or "N:controllers:/path" (v1, mounted at
 * /sys/fs/cgroup/<controller>). A limit may sit on any ancestor, so the
 * directories are read from ours up to the root. In a container the path
 * is usually "/" (its own namespace), and the mount shows its own group. */

static bool read_line(const char *path, char *buf, size_t len) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(buf, (int)len, f) != NULL;
    fclose(f);
    return ok;
}

/* The cgroup path of this process for a v1 controller ("cpu", "memory"), or
 * for v2 with controller NULL. False when there is none. */
static bool cgroup_path(const char *controller, char *out, size_t len) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        line[strcspn(line, "\n")] = 0;
        *c2 = 0;
        const char *ctl = c1 + 1, *path = c2 + 1;
        if (!controller) found = !*ctl && !strcmp(line, "0");
        else
            for (const char *p = ctl; *p && !found;) { /* "cpu,cpuacct" */
                size_t n = strcspn(p, ",");
                found = n == strlen(controller) && !strncmp(p, controller, n);
                p += n + (p[n] == ',');
            }
        if (found) snprintf(out, len, "%s", path);
    }
    fclose(f);
    return found;
}

/* Calls fn(dir, arg) for the group's directory under mount and every
 * ancestor up to mount itself. */
static void cgroup_walk(const char *mount, const char *path, void (*fn)(const char *dir, void *arg), void *arg) {
    char p[1024], dir[1200];
    snprintf(p, sizeof p, "%s", path);
    for (;;) {
        snprintf(dir, sizeof dir, "%s%s", mount, p);
        fn(dir, arg);
        char *slash = strrchr(p, '/');
        if (!slash || slash == p) {
            if (!strcmp(p, "/") || !*p) break;
            p[1] = 0; /* "/a" -> "/" */
            continue;
        }
        *slash = 0;
    }
}

/* CPU quota: v2 cpu.max "QUOTA PERIOD" or "max PERIOD"; v1
 * cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us. */
static void cpu_quota_at(const char *dir, void *arg) {
    double *cpus = arg, q = 0, per = 0;
    char f[1300], line[128];
    snprintf(f, sizeof f, "%s/cpu.max", dir);
    if (read_line(f, line, sizeof line)) {
        if (sscanf(line, "%lf %lf", &q, &per) != 2) return; /* "max 100000" */
    } else {
        snprintf(f, sizeof f, "%s/cpu.cfs_quota_us", dir);
        if (!read_line(f, line, sizeof line) || (q = atof(line)) <= 0) return;
        snprintf(f, sizeof f, "%s/cpu.cfs_period_us", dir);
        if (!read_line(f, line, sizeof line)) return;
        per = atof(line);
    }
    if (q > 0 && per > 0 && (*cpus == 0 || q / per < *cpus)) *cpus = q / per;
}

/* Memory room: the limit less what the group uses, its inactive file
 * cache counted as free (the kernel drops that before it kills).
 * v2 memory.max / memory.current / memory.stat inactive_file; v1
 * memory.limit_in_bytes / memory.usage_in_bytes / total_inactive_file
 * (v1 writes "no limit" as a huge number). */
static void mem_room_at(const char *dir, void *arg) {
    uint64_t *room = arg;
    char f[1300], line[256];
    unsigned long long lim = 0, use = 0, cache = 0, v;
    bool v2;
    snprintf(f, sizeof f, "%s/memory.max", dir);
    if ((v2 = read_line(f, line, sizeof line))) {
        if (sscanf(line, "%llu", &lim) != 1) return; /* "max" */
        snprintf(f, sizeof f, "%s/memory.current", dir);
    } else {
        snprintf(f, sizeof f, "%s/memory.limit_in_bytes", dir);
        if (!read_line(f, line, sizeof line) || sscanf(line, "%llu", &lim) != 1 || lim >= (1ull << 60)) return;
        snprintf(f, sizeof f, "%s/memory.usage_in_bytes", dir);
    }
    if (!read_line(f, line, sizeof line) || sscanf(line, "%llu", &use) != 1) return;
    snprintf(f, sizeof f, "%s/memory.stat", dir);
    FILE *st = fopen(f, "r");
    if (st) {
        char key[64];
        while (fscanf(st, "%63s %llu", key, &v) == 2)
            if (!strcmp(key, v2 ? "inactive_file" : "total_inactive_file")) cache = v;
        fclose(st);
    }
    const uint64_t r = lim > use ? lim - use + cache : cache;
    if (!*room || r < *room) *room = r;
}

/* ---- CPUs ------------------------------------------------------------------------ */

void lk_cpu_budget_get(lk_cpu_budget *b) {
    *b = (lk_cpu_budget){0};
    cpu_set_t set;
    CPU_ZERO(&set);
    const bool mask = sched_getaffinity(0, sizeof set, &set) == 0;
    b->cpus = mask ? CPU_COUNT(&set) : 0;
    if (b->cpus < 1) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        b->cpus = n > 0 ? (int)LK_MIN(n, CPU_SETSIZE) : 1;
    }
    /* physical cores: distinct (package, core) pairs among our CPUs */
    int cores = 0;
    static const int cap = CPU_SETSIZE;
    long *seen = lk_xmalloc(sizeof(long) * (size_t)cap);
    for (int c = 0; c < cap && mask; c++) {
        if (!CPU_ISSET(c, &set)) continue;
        char f[128], line[64];
        long pkg = 0, core = c;
        snprintf(f, sizeof f, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
        if (read_line(f, line, sizeof line)) pkg = atol(line);
        snprintf(f, sizeof f, "/sys/devices/system/cpu/cpu%d/topology/core_id", c);
        if (read_line(f, line, sizeof line)) core = atol(line);
        const long key = pkg << 20 | (core & 0xfffff);
        int k = 0;
        while (k < cores && seen[k] != key) k++;
        if (k == cores) seen[cores++] = key;
    }
    free(seen);
    b->cores = cores > 0 ? LK_MIN(cores, b->cpus) : b->cpus;
    char path[1024];
    double quota = 0;
    if (cgroup_path(NULL, path, sizeof path)) cgroup_walk("/sys/fs/cgroup", path, cpu_quota_at, &quota);
    if (!quota && cgroup_path("cpu", path, sizeof path)) {
        cgroup_walk("/sys/fs/cgroup/cpu", path, cpu_quota_at, &quota);
        if (!quota) cgroup_walk("/sys/fs/cgroup/cpu,cpuacct", path, cpu_quota_at, &quota);
    }
    b->quota = quota;
    /* a quota of 1.5 CPUs runs 1 thread at full speed; 2 threads would be
     * throttled in turn and meet at every barrier late */
    int th = b->cores;
    if (quota > 0) th = LK_MIN(th, (int)quota);
    b->threads = LK_MAX(th, 1);
}

int lk_threads_default(void) {
    lk_cpu_budget b;
    lk_cpu_budget_get(&b);
    return b.threads;
}

int lk_cpus_usable(void) {
    lk_cpu_budget b;
    lk_cpu_budget_get(&b);
    return b.quota > 0 ? LK_MAX(1, LK_MIN(b.cpus, (int)(b.quota + 0.999))) : b.cpus;
}

void lk_threads_describe(int threads, int ranks, bool given, char *buf, size_t len) {
    lk_cpu_budget b;
    lk_cpu_budget_get(&b);
    char why[160];
    if (given) snprintf(why, sizeof why, "-t %d", threads);
    else {
        int o = snprintf(why, sizeof why, "default: %d physical core%s of the %d CPU%s this process may run on", b.cores,
                         b.cores == 1 ? "" : "s", b.cpus, b.cpus == 1 ? "" : "s");
        if (b.quota > 0 && o > 0 && (size_t)o < sizeof why)
            snprintf(why + o, sizeof why - (size_t)o, ", a CPU quota of %.2f", b.quota);
    }
    if (ranks > 1)
        snprintf(buf, len, "%d thread%s per rank x %d local ranks (%s)", threads, threads == 1 ? "" : "s", ranks, why);
    else snprintf(buf, len, "%d thread%s (%s)", threads, threads == 1 ? "" : "s", why);
}

/* ---- memory ----------------------------------------------------------------------- */

static uint64_t meminfo_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

/* RLIMIT_AS less the address space in use (VmSize): 0 without a limit. */
static uint64_t rlimit_room(bool *limited) {
    struct rlimit rl;
    *limited = getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY;
    if (!*limited) return 0;
    FILE *f = fopen("/proc/self/status", "r");
    unsigned long long kb = 0;
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "VmSize: %llu kB", &kb) == 1) break;
        fclose(f);
    }
    const uint64_t used = (uint64_t)kb * 1024;
    return rl.rlim_cur > used ? (uint64_t)rl.rlim_cur - used : 1; /* 1: none left, but known */
}

uint64_t lk_mem_available(void) {
    uint64_t avail = meminfo_available(), room = 0;
    char path[1024];
    if (cgroup_path(NULL, path, sizeof path)) cgroup_walk("/sys/fs/cgroup", path, mem_room_at, &room);
    if (!room && cgroup_path("memory", path, sizeof path)) cgroup_walk("/sys/fs/cgroup/memory", path, mem_room_at, &room);
    if (room && (!avail || room < avail)) avail = room;
    bool limited;
    const uint64_t as = rlimit_room(&limited);
    if (limited && (!avail || as < avail)) avail = as;
    const char *cap_s = getenv("LK_MEM_AVAILABLE");   /* rehearsing a smaller node */
    if (cap_s && *cap_s) {
        char *end;
        double v = strtod(cap_s, &end);
        double mul = *end == 'K' || *end == 'k' ? 1024.0 : *end == 'M' || *end == 'm' ? 1048576.0
                   : *end == 'G' || *end == 'g' ? 1073741824.0 : 1.0;
        if (end != cap_s && v >= 0 && v * mul < 1.8e19) {
            uint64_t cap = (uint64_t)(v * mul);
            if (!avail || cap < avail) avail = cap ? cap : 1;   /* 1: none left, but known */
        } else {
            lk_log(LK_LOG_WARN, "LK_MEM_AVAILABLE='%s' is not a size like 512M or 2G: ignored", cap_s);
        }
    }
    return avail;
}
