/* Launch by mpirun / srun: see launch.h. */
#include "cluster/launch.h"
#include "cluster/cluster.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef LK_HAVE_MPI
#include <mpi.h>
#endif

static bool env_int(const char *name, int *v) {
    const char *s = getenv(name);
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (errno || *end || x < 0 || x > 1000000) return false;
    *v = (int)x;
    return true;
}

bool lk_launch_env(int *rank, int *size, const char **by) {
    static const struct { const char *rank, *size, *by; } kinds[] = {
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"},
        {"PMI_RANK", "PMI_SIZE", "mpirun (PMI)"},
        {"SLURM_PROCID", "SLURM_NTASKS", "srun"},
    };
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        int r, n;
        if (!env_int(kinds[i].rank, &r) || !env_int(kinds[i].size, &n)) continue;
        /* SLURM_PROCID is set in a batch script too: only a job step's
         * tasks are ranks */
        if (i == 2 && !getenv("SLURM_STEP_ID")) continue;
        if (n < 2 || r >= n) return false;
        *rank = r, *size = n;
        if (by) *by = kinds[i].by;
        return true;
    }
    return false;
}

void lk_launch_end(int rc) { lk_mpi_end(rc); }

#ifndef LK_HAVE_MPI

bool lk_launch_from_env(const char *cmd, int *argc, char ***argv, int *rc) {
    int rank, size;
    const char *by;
    if (!lk_launch_env(&rank, &size, &by)) return false;
    if (rank == 0)
        fprintf(stderr, "lockstep %s: started by %s as %d ranks, but lockstep was built without MPI "
                        "(install libopenmpi-dev and rebuild)\n", cmd, by, size);
    *rc = 2;
    return true;
}

#else

static bool has_flag(int argc, char **argv, const char *a, const char *b) {
    for (int i = 0; i < argc; i++) {
        size_t k = strlen(a);
        if (!strcmp(argv[i], a) || (b && !strcmp(argv[i], b)) || (!strncmp(argv[i], a, k) && argv[i][k] == '='))
            return true;
    }
    return false;
}

/* The value of a flag given as "--name V" or "--name=V"; NULL if absent. */
static const char *flag_value(int argc, char **argv, const char *name) {
    size_t k = strlen(name);
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], name)) return i + 1 < argc ? argv[i + 1] : NULL;
        if (!strncmp(argv[i], name, k) && argv[i][k] == '=') return argv[i] + k + 1;
    }
    return NULL;
}

#define HOST_LEN 64
/* the head's new argv, for the life of the process (and reachable for LSan) */
static char **g_argv, *g_workers;
typedef struct {
    char host[HOST_LEN];
    int32_t port; /* -1: could not listen */
    char why[120];
} rank_info;

static bool bootstrap_fail(int rank, int *rc, int code) {
    *rc = code;
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && !lk_mpi_active()) MPI_Finalize();
    (void)rank;
    return true;
}

bool lk_launch_from_env(const char *cmd, int *argc, char ***argv, int *rc) {
    int rank, size;
    const char *by;
    if (!lk_launch_env(&rank, &size, &by)) return false;
    /* --help and --version: rank 0 answers, the others have nothing to add */
    if (has_flag(*argc, *argv, "--help", "-h") || has_flag(*argc, *argv, "--version", NULL)) {
        *rc = 0;
        return rank > 0;
    }
    /* the same flag errors on every rank: only rank 0 speaks */
    int bad = has_flag(*argc, *argv, "--workers", "-w") || has_flag(*argc, *argv, "--local", NULL) ||
              has_flag(*argc, *argv, "--key-file", NULL);
    if (bad) {
        if (rank == 0)
            fprintf(stderr, "lockstep %s: started by %s as %d ranks: the job's ranks are the cluster, so --workers, "
                            "--local and --key-file do not apply\n", cmd, by, size);
        *rc = 2;
        return true;
    }
    /* --transport mpi keeps MPI for the data links (transport/mpi.c): every
     * MPI call there holds one lock, so SERIALIZED is enough even though
     * the server's scheduler thread is not this one */
    const char *tr = flag_value(*argc, *argv, "--transport");
    bool keep = tr && !strcmp(tr, "mpi");
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, keep ? MPI_THREAD_SERIALIZED : MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "lockstep %s: MPI_Init failed (rank %d of %d, started by %s)\n", cmd, rank, size, by);
        *rc = 1;
        return true;
    }
    if (keep && provided < MPI_THREAD_SERIALIZED) {
        if (rank == 0)
            fprintf(stderr, "lockstep %s: --transport mpi needs MPI_THREAD_SERIALIZED, this MPI offers level %d\n", cmd,
                    provided);
        return bootstrap_fail(rank, rc, 1);
    }
    int mr = -1, ms = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &mr);
    MPI_Comm_size(MPI_COMM_WORLD, &ms);
    if (mr != rank || ms != size) {
        if (mr == 0)
            fprintf(stderr, "lockstep %s: MPI says rank %d of %d, the environment rank %d of %d (%s)%s\n", cmd, mr, ms,
                    rank, size, by, ms == 1 ? ": MPI did not find the job (under srun, give --mpi=pmix)" : "");
        return bootstrap_fail(mr, rc, 1);
    }
    rank_info me = {.port = 0}, *all = lk_xcalloc((size_t)size, sizeof *all);
    gethostname(me.host, sizeof me.host - 1);
    int lfd = -1;
    if (rank > 0) {
        char e[LK_ERRLEN];
        int port = 0;
        if (lk_tcp_listen("*:0", &lfd, &port, e, sizeof e)) {
            me.port = -1;
            snprintf(me.why, sizeof me.why, "%.119s", e);
        } else
            me.port = port;
    }
    MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, all, (int)sizeof me, MPI_BYTE, MPI_COMM_WORLD);
    char hex[2 * LK_KEY_BYTES + 1] = "";
    if (rank == 0) lk_key_generate(hex);
    MPI_Bcast(hex, (int)sizeof hex, MPI_CHAR, 0, MPI_COMM_WORLD);
    /* Without --transport mpi nothing of MPI is needed past here: finishing
     * now means a rank that dies later cannot leave the others waiting in
     * MPI_Finalize. With it, lk_launch_end finishes (only after a clean run). */
    char why[LK_ERRLEN];
    if (!keep) MPI_Finalize();
    else if (lk_mpi_adopt(why, sizeof why)) {
        if (rank == 0) fprintf(stderr, "lockstep %s: %s\n", cmd, why);
        free(all);
        if (lfd >= 0) close(lfd);
        return bootstrap_fail(rank, rc, 1);
    }
    int here = 0;
    for (int r = 0; r < size; r++) {
        all[r].host[HOST_LEN - 1] = 0;
        all[r].why[sizeof all[r].why - 1] = 0;
        here += !strcmp(all[r].host, me.host);
        if (all[r].port < 0) {
            if (rank == 0) fprintf(stderr, "lockstep %s: rank %d (%s) cannot listen: %s\n", cmd, r, all[r].host, all[r].why);
            free(all);
            if (lfd >= 0) close(lfd);
            *rc = 1;
            return true;
        }
    }
    if (rank > 0) {
        free(all);
        /* only the head writes standard output */
        int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (devnull >= 0) {
            fflush(stdout);
            dup2(devnull, STDOUT_FILENO);
            close(devnull);
        }
        if (lk_log_level() == LK_LOG_INFO && !has_flag(*argc, *argv, "--verbose", "-v")) lk_log_set_level(LK_LOG_WARN);
        uint8_t key[LK_KEY_BYTES];
        for (int i = 0; i < LK_KEY_BYTES; i++) sscanf(hex + 2 * i, "%2hhx", &key[i]);
        lk_worker_opts wo = {.listen_fd = lfd, .key = key, .once = true};
        char e[LK_ERRLEN];
        lk_status st = lk_worker_serve(&wo, e, sizeof e);
        if (st) fprintf(stderr, "lockstep worker (rank %d of %d, %s): %s\n", rank, size, by, e);
        *rc = st ? 1 : 0;
        lk_launch_end(*rc);
        return true;
    }
    /* The head: --workers from the job, the key through a memfd. */
    size_t wlen = (size_t)size * (HOST_LEN + 8);
    char *workers = lk_xcalloc(1, wlen);
    for (int r = 1; r < size; r++) {
        size_t used = strlen(workers);
        snprintf(workers + used, wlen - used, "%s%s:%d", r > 1 ? "," : "",
                 strcmp(all[r].host, me.host) ? all[r].host : "127.0.0.1", all[r].port);
    }
    free(all);
    int kfd = memfd_create("lockstep-cluster-key", MFD_CLOEXEC);
    if (kfd < 0 || write(kfd, hex, strlen(hex)) != (ssize_t)strlen(hex)) {
        fprintf(stderr, "lockstep %s: memfd for the cluster key: %s\n", cmd, strerror(errno));
        free(workers);
        *rc = 1;
        return true;
    }
    static char kpath[48], threads[24];
    snprintf(kpath, sizeof kpath, "/proc/self/fd/%d", kfd);
    char **nv = lk_xcalloc((size_t)*argc + 8, sizeof *nv);
    int n = 0;
    for (int i = 0; i < *argc; i++) nv[n++] = (*argv)[i];
    nv[n++] = "--workers";
    nv[n++] = workers;
    nv[n++] = "--key-file";
    nv[n++] = kpath;
    /* ranks sharing this host share its cores, as --local ranks do
     * (netbench computes nothing and has no --threads) */
    if (strcmp(cmd, "netbench") && !has_flag(*argc, *argv, "--threads", "-t") && here > 1) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        snprintf(threads, sizeof threads, "%ld", cores / here > 0 ? cores / here : 1);
        nv[n++] = "--threads";
        nv[n++] = threads;
    }
    nv[n] = NULL;
    g_argv = nv, g_workers = workers;
    lk_log(LK_LOG_INFO, "started by %s: rank 0 of %d is the head; workers %s", by, size, workers);
    *argc = n;
    *argv = nv; /* lives as long as the process */
    return false;
}

#endif
