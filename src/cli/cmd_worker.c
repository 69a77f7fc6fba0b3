/* lockstep worker: the daemon on every non-head machine. Serves one head at
 * a time, refuses (and logs) unauthenticated or malformed connections, and
 * outlives heads that vanish. */
#include "cli/cli.h"
#include "cli/genflags.h"
#include "cluster/cluster.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* "64G", "500M", "1024K", "123" (bytes); binary units. */
static bool parse_size(const char *s, uint64_t *out) {
    double v, mul;
    bool b;
    if (!lk_parse_units(s, &v, &mul, &b) || !(v >= 0) || v * mul > 1e18 || v * mul < 1) return false;
    *out = (uint64_t)(v * mul);
    return true;
}

int lk_cmd_worker(int argc, char **argv) {
    const char *listen = NULL, *key_file = NULL, *model_dir = NULL, *cache_dir = NULL, *cache_max_s = NULL;
    int64_t threads = -1;
    bool verbose = false, seal = false, no_tune = false;
    const char *tune = NULL;
    const lk_opt opts[] = {
        {"--listen", "-l", LK_OPT_STR, &listen, "HOST:PORT", "where heads connect, e.g. 0.0.0.0:7070 (required)"},
        {"--key-file", NULL, LK_OPT_STR, &key_file, "FILE", "cluster key, the same on every node (required)"},
        {"--threads", "-t", LK_OPT_INT, &threads, "N", "compute threads (default: what the head asks, else the physical cores this process may run on)"},
        {"--model-dir", NULL, LK_OPT_STR, &model_dir, "DIR", "find models here by file name (default: the head's path)"},
        {"--cache-dir", NULL, LK_OPT_STR, &cache_dir, "DIR", "without the model, have the head send only this worker's slices and keep them here (sparse files by model identity and layout; reused after a restart); without it a missing model is an error"},
        {"--cache-max", NULL, LK_OPT_STR, &cache_max_s, "SIZE", "disk the cache may use, e.g. 500M, 64G (default 64G); the least recently used entries are removed to make room"},
        {"--seal", NULL, LK_OPT_FLAG, &seal, NULL, lk_seal_help},
        {"--no-tune", NULL, LK_OPT_FLAG, &no_tune, NULL, LK_NO_TUNE_HELP},
        {"--tune", NULL, LK_OPT_STR, &tune, "SPEC", LK_TUNE_HELP},
        {"--verbose", "-v", LK_OPT_FLAG, &verbose, NULL, "debug logging"},
        {0},
    };
    int np = lk_args_parse("worker", "--listen HOST:PORT --key-file FILE [--threads N] [--model-dir DIR] [--cache-dir DIR [--cache-max SIZE]] [--seal]", opts, argc,
                           argv, NULL, 0);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (!listen || !key_file) {
        fprintf(stderr, "lockstep worker: %s is required (see 'lockstep worker --help')\n",
                !listen ? "--listen HOST:PORT" : "--key-file FILE");
        return 2;
    }
    if (threads == 0 || threads < -1 || threads > LK_THREADS_MAX) {
        fprintf(stderr, "lockstep worker: --threads %lld is out of range: 1 to %d (leave it out for the default)\n",
                (long long)threads, LK_THREADS_MAX);
        return 2;
    }
    if (!lk_tune_flags("worker", no_tune, tune)) return 2;
    uint64_t cache_max = 0;
    if (cache_max_s && !parse_size(cache_max_s, &cache_max)) {
        fprintf(stderr, "lockstep worker: --cache-max '%s': expected a size such as 500M or 64G\n", cache_max_s);
        return 2;
    }
    if (cache_max_s && !cache_dir) {
        fprintf(stderr, "lockstep worker: --cache-max needs --cache-dir\n");
        return 2;
    }
    /* A cache we cannot write would only show at the first head's start. */
    if (cache_dir) {
        struct stat sb;
        if ((mkdir(cache_dir, 0755) != 0 && errno != EEXIST) || stat(cache_dir, &sb) != 0 ||
            (!S_ISDIR(sb.st_mode) && (errno = ENOTDIR)) || access(cache_dir, W_OK | X_OK) != 0) {
            fprintf(stderr, "lockstep worker: --cache-dir %s: %s\n", cache_dir, strerror(errno));
            return 2;
        }
    }
    if (verbose) lk_log_set_level(LK_LOG_DEBUG);
    uint8_t key[LK_KEY_BYTES];
    char err[LK_ERRLEN];
    if (lk_key_load(key_file, key, err, sizeof err)) {
        fprintf(stderr, "lockstep worker: %s\n", err);
        return 2;
    }
    char tline[256];
    lk_threads_describe(threads > 0 ? (int)threads : lk_threads_default(), 1, threads > 0, tline, sizeof tline);
    fprintf(stderr, "lockstep worker: %s%s\n", threads > 0 ? "" : "what each head asks (-t on the head), else ", tline);
    if (threads < 0) threads = 0;
    /* A head that vanishes mid-send must not kill us with SIGPIPE. */
    signal(SIGPIPE, SIG_IGN);
    lk_worker_opts o = {.listen = listen, .listen_fd = -1, .key = key, .model_dir = model_dir,
                        .cache_dir = cache_dir, .cache_max = cache_max, .n_threads = (int)threads,
                        .seal = seal};
    if (lk_worker_serve(&o, err, sizeof err)) {
        fprintf(stderr, "lockstep worker: %s\n", err);
        return 1;
    }
    return 0;
}
