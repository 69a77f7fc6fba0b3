/* lockstep netbench: latency, bandwidth and all-reduce time between ranks,
 * per message size, all measured in one run so the all-reduce figures can be
 * read against the link's own ping-pong latency.
 *
 *   lockstep netbench --local 2                 # 2 processes on this host
 *   lockstep netbench --local 4 --transport tcp # loopback TCP instead of shm
 *   on each of N hosts: lockstep netbench --addrs h0:7000,h1:7000 --rank R
 *
 * With --local the command forks N-1 copies of itself (each one rank with
 * its own listening socket on 127.0.0.1) and is rank 0; they exit with it. */
#include "cli/cli.h"
#include "cli/genflags.h"
#include "cluster/cluster.h"
#include "parallel/parallel.h"
#include "transport/transport.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_SIZES 32
#define MAX_RANKS 64

typedef struct {
    int n, rank;
    const char **addrs;
    int lfd;
    lk_mesh_shm shm;
    int64_t spin_ns;
    const uint8_t *key; /* NULL: no authentication */
    bool seal;          /* seal the TCP links (needs key) */
    lk_bench_cfg cfg;
} bench_cfg;

static bool parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return false;
    if (*end == 'k' || *end == 'K') v <<= 10, end++;
    else if (*end == 'm' || *end == 'M') v <<= 20, end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end || v == 0 || v > (256ull << 20)) return false;
    *out = (size_t)v;
    return true;
}

static int run_rank(const bench_cfg *c) {
    char err[LK_ERRLEN];
    lk_hs_params hp;
    lk_mesh_params mp = {.rank = c->rank, .n = c->n, .addrs = c->addrs, .listen_fd = c->lfd, .shm = c->shm,
                         .spin_ns = c->spin_ns, .timeout_ms = 20000};
    if (c->key) {
        lk_hs_defaults(&hp, c->key, c->rank ? "rank" : "rank 0");
        hp.seal = c->seal ? LK_SEAL_ON : LK_SEAL_OFF;
        mp.auth = &lk_hs_mesh_auth;
        mp.auth_ctx = &hp;
    }
    lk_mesh *mesh = NULL;
    lk_status st = lk_mesh_create(&mp, &mesh, err, sizeof err);
    if (!st) st = lk_bench_run(mesh, &c->cfg, stdout, err, sizeof err);
    if (st) fprintf(stderr, "lockstep netbench: rank %d: %s\n", c->rank, err);
    lk_mesh_free(mesh);
    return st ? 1 : 0;
}

int lk_cmd_netbench(int argc, char **argv) {
    int64_t local = 0, rank = -1, iters = 1000, spin_us = -1, threads = 1;
    const char *addrs_s = NULL, *workers = NULL, *transport = "auto", *sizes_s = "64,1K,4K,16K,64K,256K,1M,4M", *key_file = NULL,
               *wire = "f32";
    bool ar_only = false, seal = false;
    const lk_opt opts[] = {
        {"--local", NULL, LK_OPT_INT, &local, "N", "start N ranks on this host (this process is rank 0)"},
        {"--workers", "-w", LK_OPT_STR, &workers, "H:P,...", "running worker daemons (with --key-file); this process is rank 0"},
        {"--addrs", NULL, LK_OPT_STR, &addrs_s, "H:P,...", "every rank's address, for runs across hosts (with --rank)"},
        {"--rank", NULL, LK_OPT_INT, &rank, "R", "this process's rank in --addrs"},
        {"--transport", NULL, LK_OPT_STR, &transport, "T", "auto (shm between local ranks, default), tcp, shm, ucx or mpi (under mpirun)"},
        {"--sizes", NULL, LK_OPT_STR, &sizes_s, "LIST", "message sizes, e.g. 64,4K,16K,1M"},
        {"--iters", NULL, LK_OPT_INT, &iters, "K", "timed repetitions per size (default 1000; fewer for big sizes)"},
        {"--spin-us", NULL, LK_OPT_INT, &spin_us, "US", "spin before blocking (default: 50 while ranks fit the cores, else 0)"},
        {"--key-file", NULL, LK_OPT_STR, &key_file, "FILE", "authenticate every connection with this cluster key"},
        {"--seal", NULL, LK_OPT_FLAG, &seal, NULL, lk_seal_help},
        {"--allreduce-only", NULL, LK_OPT_FLAG, &ar_only, NULL, "skip the ping-pong"},
        {"--wire", NULL, LK_OPT_STR, &wire, "FMT", "all-reduce payload format: f32 (default), f16, bf16, q8"},
        {"--threads", "-t", LK_OPT_INT, &threads, "N",
         "threads per rank that copy and add an exchange's bytes through shm windows, as run's -t does "
         "(default 1; --local and --addrs only)"},
        {0},
    };
    const char *syn = "--local N | --workers H:P,... --key-file F | --addrs H:P,... --rank R  [--transport auto|tcp|shm|ucx|mpi] "
                      "[--sizes LIST] [--seal]";
    int np = lk_args_parse("netbench", syn, opts, argc, argv, NULL, 0);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (threads < 1 || threads > 1024) { fprintf(stderr, "lockstep netbench: --threads must be 1..1024\n"); return 2; }
    bench_cfg c = {.lfd = -1, .cfg = {.iters = iters, .allreduce_only = ar_only, .threads = (int)threads}};
    char terr[LK_ERRLEN];
    if (lk_transport_parse(transport, &c.shm, terr, sizeof terr)) { fprintf(stderr, "lockstep netbench: %s\n", terr); return 2; }
    if (!lk_wire_fmt_parse(wire, &c.cfg.wire)) {
        fprintf(stderr, "lockstep netbench: --wire must be f32, f16, bf16 or q8 (got '%s')\n", wire);
        return 2;
    }
    if (iters < 1 || iters > 1000000) { fprintf(stderr, "lockstep netbench: --iters must be 1..1000000\n"); return 2; }
    c.spin_ns = spin_us < 0 ? -1 : spin_us * 1000;
    char *sz = lk_xstrdup(sizes_s), *save = NULL;
    for (char *tok = strtok_r(sz, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (c.cfg.nsizes == MAX_SIZES || !parse_size(tok, &c.cfg.sizes[c.cfg.nsizes])) {
            fprintf(stderr, "lockstep netbench: bad --sizes entry '%s' (1 B .. 256 MiB, at most %d sizes)\n", tok, MAX_SIZES);
            free(sz);
            return 2;
        }
        c.cfg.nsizes++;
    }
    free(sz);
    uint8_t key[LK_KEY_BYTES];
    char err[LK_ERRLEN];
    if (key_file) {
        if (lk_key_load(key_file, key, err, sizeof err)) { fprintf(stderr, "lockstep netbench: %s\n", err); return 2; }
        c.key = key;
    } else if (seal && local) {
        /* ranks forked from us share a fresh key: sealing needs one */
        char hex[2 * LK_KEY_BYTES + 1];
        lk_key_generate(hex);
        for (int i = 0; i < LK_KEY_BYTES; i++) {
            unsigned v;
            sscanf(hex + 2 * i, "%2x", &v);
            key[i] = (uint8_t)v;
        }
        c.key = key;
    }
    if (seal && !c.key) {
        fprintf(stderr, "lockstep netbench: --seal needs --key-file (the cluster key the keys are derived from)\n");
        return 2;
    }
    c.seal = seal;
    c.cfg.seal = seal;
    if (workers) {
        if (local || addrs_s || rank >= 0) {
            fprintf(stderr, "lockstep netbench: --workers excludes --local, --addrs and --rank\n");
            return 2;
        }
        if (!c.key) {
            fprintf(stderr, "lockstep netbench: --workers needs --key-file (the workers' cluster key)\n");
            return 2;
        }
        if (lk_cluster_bench(workers, c.key, &c.cfg, c.shm, c.spin_ns, stdout, err, sizeof err)) {
            fprintf(stderr, "lockstep netbench: %s\n", err);
            return 1;
        }
        return 0;
    }
    static char abuf[MAX_RANKS][64];
    const char *addrs[MAX_RANKS];
    int lfds[MAX_RANKS];
    if (local) {
        if (addrs_s || rank >= 0 || local < 1 || local > MAX_RANKS) {
            fprintf(stderr, "lockstep netbench: --local takes 1..%d and excludes --addrs/--rank\n", MAX_RANKS);
            return 2;
        }
        c.n = (int)local;
        for (int r = 0; r < c.n; r++) {
            int port;
            if (lk_tcp_listen("127.0.0.1:0", &lfds[r], &port, err, sizeof err)) {
                fprintf(stderr, "lockstep netbench: %s\n", err);
                return 1;
            }
            snprintf(abuf[r], sizeof abuf[r], "127.0.0.1:%d", port);
            addrs[r] = abuf[r];
        }
        c.addrs = addrs;
        fflush(stdout);
        pid_t kids[MAX_RANKS];
        for (int r = 1; r < c.n; r++) {
            kids[r] = fork();
            if (kids[r] < 0) { perror("lockstep netbench: fork"); return 1; }
            if (kids[r] == 0) {
                for (int s = 0; s < c.n; s++)
                    if (s != r) close(lfds[s]);
                c.rank = r;
                c.lfd = lfds[r];
                _exit(run_rank(&c));
            }
        }
        for (int s = 1; s < c.n; s++) close(lfds[s]);
        c.rank = 0;
        c.lfd = lfds[0];
        int rc = run_rank(&c);
        close(lfds[0]);
        for (int r = 1; r < c.n; r++) {
            int ws;
            if (rc) kill(kids[r], SIGTERM);
            waitpid(kids[r], &ws, 0);
            if (!WIFEXITED(ws) || WEXITSTATUS(ws)) rc = 1;
        }
        return rc;
    }
    if (!addrs_s || rank < 0) {
        fprintf(stderr, "lockstep netbench: give --local N, or --addrs and --rank (see --help)\n");
        return 2;
    }
    char *al = lk_xstrdup(addrs_s);
    save = NULL;
    for (char *tok = strtok_r(al, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (c.n == MAX_RANKS) { fprintf(stderr, "lockstep netbench: at most %d ranks\n", MAX_RANKS); free(al); return 2; }
        snprintf(abuf[c.n], sizeof abuf[c.n], "%s", tok);
        addrs[c.n] = abuf[c.n];
        c.n++;
    }
    free(al);
    if (rank >= c.n) { fprintf(stderr, "lockstep netbench: --rank %lld but only %d addresses\n", (long long)rank, c.n); return 2; }
    c.addrs = addrs;
    c.rank = (int)rank;
    return run_rank(&c);
}
