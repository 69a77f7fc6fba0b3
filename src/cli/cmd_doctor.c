/* lockstep doctor — measures every node and link of a cluster given as run
 * takes it (--local N, or --workers ... --key-file ...), checks that they
 * agree, runs a few real decode steps, and says in plain words what bounds
 * decode and which layout plan would pick. The checks and their order are
 * in src/diag/doctor.c. Exit status 1 when a check fails, 2 for bad flags. */
#include "cli/cli.h"
#include "cli/genflags.h"
#include "cluster/cluster.h"
#include "diag/diag.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

static json_t *num_or_null(double v) { return isfinite(v) && v >= 0 ? json_real(v) : json_null(); }

static void print_json(const lk_doctor_report *r) {
    json_t *o = json_object(), *nodes = json_array(), *checks = json_array();
    json_object_set_new(o, "ok", json_boolean(r->ok));
    json_object_set_new(o, "nodes_n", json_integer(r->n_nodes));
    json_object_set_new(o, "tp", json_integer(r->tp));
    json_object_set_new(o, "pp", json_integer(r->pp));
    if (r->have_model) {
        json_object_set_new(o, "model", json_string(r->shape.name));
        json_object_set_new(o, "model_id", json_string(r->model_id));
    }
    for (int i = 0; i < r->n_nodes; i++) {
        const lk_doctor_node *n = &r->nodes[i];
        json_t *j = json_object();
        json_object_set_new(j, "node", json_integer(i));
        json_object_set_new(j, "addr", json_string(n->addr));
        json_object_set_new(j, "reachable", json_boolean(n->reachable));
        json_object_set_new(j, "build", json_string(n->build));
        json_object_set_new(j, "protocol", json_integer(n->version));
        json_object_set_new(j, "cpu", json_string(n->cpu));
        json_object_set_new(j, "simd", json_string(n->simd));
        json_object_set_new(j, "cpu_model", n->cpu_model[0] ? json_string(n->cpu_model) : json_null());
        json_object_set_new(j, "clocksource", n->clocksource[0] ? json_string(n->clocksource) : json_null());
        json_object_set_new(j, "cpus", n->cores > 0 ? json_integer(n->cores) : json_null());
        json_object_set_new(j, "threads", n->threads > 0 ? json_integer(n->threads) : json_null());
        json_object_set_new(j, "mem_avail_gb", num_or_null(n->mem_avail_gb));
        json_object_set_new(j, "clock_offset_us", isfinite(n->clock_offset_us) ? json_real(n->clock_offset_us) : json_null());
        if (i > 0) {
            json_object_set_new(j, "transport", n->transport[0] ? json_string(n->transport) : json_null());
            json_object_set_new(j, "latency_us", n->transport[0] ? json_real(n->lat_us) : json_null());
            json_object_set_new(j, "latency_p99_us", n->transport[0] ? json_real(n->lat_p99_us) : json_null());
            json_object_set_new(j, "link_gbps", n->transport[0] ? json_real(n->gbps) : json_null());
        }
        json_array_append_new(nodes, j);
    }
    json_object_set_new(o, "nodes", nodes);
    for (int i = 0; i < r->n_checks; i++) {
        const lk_doctor_check *c = &r->checks[i];
        json_t *j = json_object();
        json_object_set_new(j, "check", json_string(c->what));
        json_object_set_new(j, "node", c->node >= 0 ? json_integer(c->node) : json_null());
        json_object_set_new(j, "result", json_string(c->level == LK_DOC_FAIL ? "fail" : lk_doctor_level_name(c->level)));
        json_object_set_new(j, "detail", json_string(c->detail));
        json_array_append_new(checks, j);
    }
    json_object_set_new(o, "checks", checks);
    json_object_set_new(o, "membw_gbs", num_or_null(r->membw_gbs));
    json_object_set_new(o, "allreduce_bytes", r->ar_us > 0 ? json_real(r->ar_bytes) : json_null());
    json_object_set_new(o, "allreduce_us", r->ar_us > 0 ? json_real(r->ar_us) : json_null());
    json_t *tab = json_array();
    for (int i = 0; i < r->n_ar; i++) {
        json_t *row = json_array();
        json_array_append_new(row, json_real(r->ar_table_bytes[i]));
        json_array_append_new(row, json_real(r->ar_table_us[i]));
        json_array_append_new(tab, row);
    }
    json_object_set_new(o, "allreduce_table", tab);
    if (r->decoded) {
        json_object_set_new(o, "decode_step_ms", json_real(r->step_ms));
        json_object_set_new(o, "decode_comm_ms", json_real(r->comm_ms));
        json_object_set_new(o, "decode_tok_s", json_real(r->tok_s));
    }
    if (r->have_model) {
        json_object_set_new(o, "allreduces_per_token", json_integer(r->n_allreduce));
        json_object_set_new(o, "predicted_tok_s", json_real(r->est.decode_tok_s));
        json_object_set_new(o, "calibrated_gbs", num_or_null(r->calibrated_gbs > 0 ? r->calibrated_gbs : -1));
        json_t *b = json_object();
        json_object_set_new(b, "tp", json_integer(r->best.tp));
        json_object_set_new(b, "pp", json_integer(r->best.pp));
        json_object_set_new(b, "decode_tok_s", json_real(r->best.decode_tok_s));
        json_object_set_new(b, "bottleneck", json_string(lk_diag_bottleneck_name(r->best.bottleneck)));
        json_object_set_new(b, "reason", json_string(r->best.reason));
        json_object_set_new(o, "recommended", b);
    }
    json_object_set_new(o, "verdict", json_string(r->verdict));
    char *s = json_dumps(o, JSON_COMPACT);
    printf("%s\n", s);
    free(s);
    json_decref(o);
}

static void print_text(const lk_doctor_report *r) {
    printf("doctor: %d node%s", r->n_nodes, r->n_nodes > 1 ? "s" : "");
    if (r->have_model)
        printf(", model %s (%s, %lld layers, embedding %lld, identity %s), layout tp %d x pp %d", r->shape.name,
               r->shape.arch, (long long)r->shape.n_layer, (long long)r->shape.n_embd, r->model_id, r->tp, r->pp);
    printf("\n\nnodes:\n");
    for (int i = 0; i < r->n_nodes; i++) {
        const lk_doctor_node *n = &r->nodes[i];
        printf("  %d  %-22s ", i, n->addr);
        if (!n->reachable) { printf("not reached\n"); continue; }
        if (n->cpu_model[0]) printf("%s, ", n->cpu_model);
        printf("%s, build %s", n->cpu[0] ? n->cpu : "cpu ?", n->build[0] ? n->build : "?");
        if (n->cores > 0) printf(", %d CPUs, %d threads/rank, %.2f GB free", n->cores, n->threads, n->mem_avail_gb);
        if (n->clocksource[0]) printf(", clock %s", n->clocksource);
        if (i > 0 && n->transport[0])
            printf("\n     link: %s, %.1f us one-way (p99 %.1f), %.2f Gbit/s", n->transport, n->lat_us, n->lat_p99_us, n->gbps);
        printf("\n");
    }
    printf("\nchecks:\n");
    for (int i = 0; i < r->n_checks; i++) {
        const lk_doctor_check *c = &r->checks[i];
        char who[16];
        if (c->node >= 0) snprintf(who, sizeof who, "node %d", c->node);
        else snprintf(who, sizeof who, "cluster");
        printf("  %-4s  %-7s  %-10s %s\n", lk_doctor_level_name(c->level), who, c->what, c->detail);
    }
    printf("\nverdict: %s\n", r->verdict);
    if (r->have_model) {
        printf("plan: this layout (tp %d x pp %d) predicted %.2f tok/s", r->est.tp, r->est.pp, r->est.decode_tok_s);
        if (r->calibrated_gbs > 0) printf(" (weights read at the %.1f GB/s per rank the decode steps reached)", r->calibrated_gbs);
        if (r->decoded) printf(", measured %.2f tok/s", r->tok_s);
        printf("\nplan recommends: --tp %d --pp %d: %.2f tok/s predicted (%s)\n", r->best.tp, r->best.pp,
               r->best.decode_tok_s, r->best.reason);
    }
    int fails = 0;
    for (int i = 0; i < r->n_checks; i++) fails += r->checks[i].level == LK_DOC_FAIL;
    if (fails) printf("\n%d check%s failed\n", fails, fails > 1 ? "s" : "");
    else printf("\nall checks passed\n");
}

int lk_cmd_doctor(int argc, char **argv) {
    const char *model = NULL, *workers = NULL, *key_file = NULL, *transport = "auto", *emulate_link = NULL;
    int64_t local = 0, tp = 0, pp = 0, threads = 0, ctx = 256, iters = 200;
    bool json = false, verbose = false;
    const lk_opt opts[] = {
        {"--model", "-m", LK_OPT_STR, &model, "FILE", "the model (its identity on every node, real decode steps, the plan)"},
        {"--local", NULL, LK_OPT_INT, &local, "N", "a local cluster of N ranks, head included, as run --local N"},
        {"--workers", "-w", LK_OPT_STR, &workers, "H:P,...", "running worker daemons (with --key-file), as run takes them"},
        {"--key-file", NULL, LK_OPT_STR, &key_file, "FILE", "the cluster key (with --workers)"},
        {"--tp", NULL, LK_OPT_INT, &tp, "K", "tensor-parallel ranks of the layout to check (default: all ranks)"},
        {"--pp", NULL, LK_OPT_INT, &pp, "M", "pipeline stages of the layout to check (default 1)"},
        {"--threads", "-t", LK_OPT_INT, &threads, "N", "threads per rank (default: as run: the cores / local ranks)"},
        {"--ctx", "-c", LK_OPT_INT, &ctx, "N", "context for the memory check and the decode steps (default 256)"},
        {"--transport", NULL, LK_OPT_STR, &transport, "T", "auto (shm between local ranks, default), tcp, shm, ucx or mpi (under mpirun)"},
        {"--emulate-link", NULL, LK_OPT_STR, &emulate_link, "SPEC", lk_emulate_link_help},
        {"--iters", NULL, LK_OPT_INT, &iters, "K", "ping-pong and all-reduce repetitions per size (default 200)"},
        {"--verbose", "-v", LK_OPT_FLAG, &verbose, NULL, "the cluster's own log lines too"},
        {"--json", NULL, LK_OPT_FLAG, &json, NULL, "one JSON object: nodes, checks, figures, verdict, recommended layout"},
        {0},
    };
    const char *syn = "[-m FILE] [--local N | --workers H:P,... --key-file F] [--tp K] [--pp M] [--threads N] [--json]";
    int np = lk_args_parse("doctor", syn, opts, argc, argv, NULL, 0);
    if (np == LK_ARGS_VERSION) return 0;
    if (np == LK_ARGS_HELP) {
        printf("\nChecks, in order: this node (CPU and SIMD level, threads vs cores, load, free memory, memory\n"
               "bandwidth); each worker (reached, authenticated, protocol, build and CPU from its handshake); each\n"
               "link head <-> worker on its own (transport, one-way latency median and p99, rate; a link twice as\n"
               "slow as the best peer's fails); the all-reduce of all ranks at decode's size; the model opened on\n"
               "every rank as run opens it (a worker with another file is named) and 24 real decode steps with\n"
               "their network wait; then plan's model with these figures: a verdict and the layout it ranks first.\n"
               "Workers report their CPU model, CPUs, free memory and clock source in the handshake (null in --json\n"
               "from a worker that does not); a worker's threads beyond its CPUs, or its share beyond its free memory,\n"
               "fails.\n"
               "Exit status: 0 all checks passed (warnings allowed), 1 a check failed, 2 bad flags.\n");
        return 0;
    }
    if (np < 0) return 2;
    if (local && workers) { fprintf(stderr, "lockstep doctor: give --local N or --workers, not both\n"); return 2; }
    if (local < 0 || local > LK_DOCTOR_MAX_NODES) {
        fprintf(stderr, "lockstep doctor: --local takes 1..%d\n", LK_DOCTOR_MAX_NODES);
        return 2;
    }
    if (workers && !key_file) {
        fprintf(stderr, "lockstep doctor: --workers needs --key-file (the workers' cluster key)\n");
        return 2;
    }
    if (tp < 0 || pp < 0 || threads < 0 || threads > 4096 || ctx < 16 || ctx > (1 << 20) || iters < 1 || iters > 100000) {
        fprintf(stderr, "lockstep doctor: --tp, --pp, --threads must be >= 0, --ctx 16..%d, --iters 1..100000\n", 1 << 20);
        return 2;
    }
    {
        lk_mesh_shm tm;
        char terr[LK_ERRLEN];
        if (lk_transport_parse(transport, &tm, terr, sizeof terr)) {
            fprintf(stderr, "lockstep doctor: %s\n", terr);
            return 2;
        }
    }
    if (!lk_emulate_link_check("doctor", emulate_link, local, workers, transport)) return 2;
    int n_workers = 0;
    for (const char *p = workers; p && *p; p++) n_workers += *p == ',';
    int ranks = local > 1 ? (int)local : workers ? n_workers + 2 : 1;
    if (ranks > LK_DOCTOR_MAX_NODES) {
        fprintf(stderr, "lockstep doctor: at most %d nodes\n", LK_DOCTOR_MAX_NODES);
        return 2;
    }
    if ((tp || pp) && (tp ? tp : ranks / (pp ? pp : 1)) * (pp ? pp : 1) != ranks) {
        fprintf(stderr, "lockstep doctor: --tp %lld x --pp %lld does not match the %d ranks (head included)\n",
                (long long)(tp ? tp : ranks / (pp ? pp : 1)), (long long)(pp ? pp : 1), ranks);
        return 2;
    }
    uint8_t key[LK_KEY_BYTES];
    char err[LK_ERRLEN];
    if (key_file && lk_key_load(key_file, key, err, sizeof err)) {
        fprintf(stderr, "lockstep doctor: %s\n", err);
        return 2;
    }
    lk_doctor_cfg cfg = {.model = model, .workers = workers, .key_file = key_file, .key = key_file ? key : NULL,
                         .local = (int)local, .tp = (int)tp, .pp = (int)pp, .threads = (int)threads, .ctx = (int)ctx,
                         .transport = transport, .iters = (int)iters, .emulate_link = emulate_link};
    if (!verbose) lk_log_set_level(LK_LOG_WARN);
    static lk_doctor_report r;
    lk_doctor_run(&cfg, &r);
    if (json) print_json(&r);
    else print_text(&r);
    return r.ok ? 0 : 1;
}
