/* cli — the `lockstep` program: one function per subcommand, plus a shared
 * flag parser so every command gets --help, clear errors on unknown or
 * malformed flags, and the same spelling of common options.
 * Each command returns the process exit status (0 ok, 1 runtime failure,
 * 2 usage error). */
#ifndef LK_CLI_H
#define LK_CLI_H

#include "common/lk_common.h"

typedef enum { LK_OPT_STR, LK_OPT_INT, LK_OPT_F64, LK_OPT_FLAG } lk_opt_kind;

typedef struct {
    const char *name;     /* "--threads" */
    const char *alias;    /* "-t" or NULL */
    lk_opt_kind kind;
    void       *dst;      /* const char **, int64_t *, double *, bool * */
    const char *metavar;  /* "N" (NULL for flags) */
    const char *help;
} lk_opt;

/* Parses argv[0..argc) (argv[0] is the first argument after the command
 * name). Positional arguments are stored into pos (at most max_pos).
 * Returns the number of positionals, LK_ARGS_HELP after printing the usage
 * for --help/-h, or LK_ARGS_ERROR after printing a one-line error and a hint. */
/* --version (every command, like llama.cpp's) prints LK_VERSION and returns
 * LK_ARGS_VERSION: the caller exits 0 without doing anything. */
enum { LK_ARGS_HELP = -1, LK_ARGS_ERROR = -2, LK_ARGS_VERSION = -3 };
#define LK_VERSION "0.1.0"
void lk_print_version(void);
int  lk_args_parse(const char *cmd, const char *synopsis, const lk_opt *opts,
                   int argc, char **argv, const char **pos, int max_pos);
void lk_args_usage(const char *cmd, const char *synopsis, const lk_opt *opts);

/* Subcommands (each in its own file under src/cli/). */
/* A number with an optional binary unit: "123", "1.5G", "512MiB", "64GB",
 * "100B". *num gets the number, *mul the unit (1024 for K, ... 2^40 for T;
 * 1 without one), *b whether a trailing B followed. False when the number
 * is malformed or anything else follows; ranges are the caller's. */
bool lk_parse_units(const char *s, double *num, double *mul, bool *b);

/* --threads' upper bound in every command (the cluster protocol's; a
 * pool's threads are real pthreads, and far more than the CPUs only wait). */
#define LK_THREADS_MAX 1024

int lk_cmd_run(int argc, char **argv);
int lk_cmd_info(int argc, char **argv);
int lk_cmd_quantize(int argc, char **argv);
int lk_cmd_gen_model(int argc, char **argv);
int lk_cmd_tokenize(int argc, char **argv);
int lk_cmd_chat(int argc, char **argv);
int lk_cmd_bench(int argc, char **argv);
int lk_cmd_worker(int argc, char **argv);
int lk_cmd_keygen(int argc, char **argv);
int lk_cmd_netbench(int argc, char **argv);
int lk_cmd_serve(int argc, char **argv);
int lk_cmd_plan(int argc, char **argv);
int lk_cmd_doctor(int argc, char **argv);

#endif
