/* lockstep — entry point: dispatches to a subcommand. */
#include "cli/cli.h"
#include "cluster/launch.h"

#include <stdio.h>
#include <string.h>

/* Weak so that a subcommand still being built does not break the program. */
#define WEAK __attribute__((weak))
WEAK int lk_cmd_run(int, char **);
WEAK int lk_cmd_info(int, char **);
WEAK int lk_cmd_quantize(int, char **);
WEAK int lk_cmd_gen_model(int, char **);
WEAK int lk_cmd_tokenize(int, char **);
WEAK int lk_cmd_chat(int, char **);
WEAK int lk_cmd_bench(int, char **);
WEAK int lk_cmd_worker(int, char **);
WEAK int lk_cmd_keygen(int, char **);
WEAK int lk_cmd_netbench(int, char **);
WEAK int lk_cmd_serve(int, char **);
WEAK int lk_cmd_plan(int, char **);
WEAK int lk_cmd_doctor(int, char **);
WEAK int lk_cmd_linkemu(int, char **);

static const struct {
    const char *name;
    const char *what;
} cmds[] = {
    {"run", "generate text from a prompt (one node, or a cluster with --workers/--local)"},
    {"info", "print a GGUF model's architecture, shapes, tensor types and metadata"},
    {"tokenize", "print the tokens of a text"},
    {"chat", "interactive chat using the model's chat template"},
    {"bench", "prefill/decode speed against the memory-bandwidth bound"},
    {"quantize", "convert a GGUF model to another type (q8_0, q4_0, q5_0/1, the K-quant mixes)"},
    {"gen-model", "write a random-weight GGUF of a real model's shape"},
    {"worker", "serve a head as one rank of a cluster"},
    {"keygen", "print a new cluster key"},
    {"netbench", "measure latency, bandwidth and all-reduce time between ranks"},
    {"serve", "OpenAI-compatible HTTP server"},
    {"plan", "predict tok/s per layout for a model and a network"},
    {"doctor", "measure every node and link of a cluster"},
    {"linkemu", "relay TCP with a set one-way delay and rate (emulate a network)"},
};

static int (*lookup(const char *name))(int, char **) {
    if (!strcmp(name, "run")) return lk_cmd_run;
    if (!strcmp(name, "info")) return lk_cmd_info;
    if (!strcmp(name, "tokenize")) return lk_cmd_tokenize;
    if (!strcmp(name, "chat")) return lk_cmd_chat;
    if (!strcmp(name, "bench")) return lk_cmd_bench;
    if (!strcmp(name, "quantize")) return lk_cmd_quantize;
    if (!strcmp(name, "gen-model")) return lk_cmd_gen_model;
    if (!strcmp(name, "worker")) return lk_cmd_worker;
    if (!strcmp(name, "keygen")) return lk_cmd_keygen;
    if (!strcmp(name, "netbench")) return lk_cmd_netbench;
    if (!strcmp(name, "serve")) return lk_cmd_serve;
    if (!strcmp(name, "plan")) return lk_cmd_plan;
    if (!strcmp(name, "doctor")) return lk_cmd_doctor;
    if (!strcmp(name, "linkemu")) return lk_cmd_linkemu;
    return NULL;
}

static void usage(FILE *f) {
    fprintf(f, "lockstep — run one language model across several machines, faster than one.\n\n"
               "usage: lockstep COMMAND [options]   (lockstep COMMAND --help for each)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (lookup(cmds[i].name)) fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].what);
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        lk_print_version();
        return 0;
    }
    int (*fn)(int, char **) = lookup(argv[1]);
    if (!fn) {
        bool known = false;
        for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) known |= !strcmp(cmds[i].name, argv[1]);
        if (known) fprintf(stderr, "lockstep: command '%s' is not available in this build\n", argv[1]);
        else fprintf(stderr, "lockstep: unknown command '%s' (see 'lockstep --help')\n", argv[1]);
        return 2;
    }
    /* under mpirun/srun a cluster command runs on every rank (launch.h) */
    int ac = argc - 2, rc;
    char **av = argv + 2;
    if ((!strcmp(argv[1], "run") || !strcmp(argv[1], "chat") || !strcmp(argv[1], "serve") || !strcmp(argv[1], "bench") ||
         !strcmp(argv[1], "netbench")) &&
        lk_launch_from_env(argv[1], &ac, &av, &rc))
        return rc;
    rc = fn(ac, av);
    lk_launch_end(rc);
    return rc;
}
