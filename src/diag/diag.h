/* diag — finding out why a cluster is slow before buying hardware or loading
 * a model: the performance model behind `lockstep plan`, the model's shape
 * read from a GGUF header alone, and the link emulator behind `lockstep
 * linkemu`.
 *
 * Owns: nothing that runs on the step path. The model is arithmetic over a
 * shape (lk_diag_shape) and figures of nodes and links (lk_diag_hw); the
 * emulator is a TCP relay with its own threads. Callers: cli (cmd_plan.c,
 * cmd_linkemu.c) and the tests. Uses gguf's facts only through quant (type
 * sizes): the header reader here is its own, because gguf's reader
 * validates (and needs) the whole file, and `plan` must work on the first
 * megabytes of a 365 GB download.
 *
 * Threading: the model functions are pure; a lk_diag_relay owns one accept
 * thread and one thread per relayed connection until lk_diag_relay_stop.
 *
 * The doctor (doctor.c, behind `lockstep doctor`) is the one part of diag
 * that runs a cluster: it uses cluster/ (handshake, benchmark sessions) and
 * engine/ (the cluster opened as run opens it, real decode steps), and
 * forks worker daemons for --local; it is called by cmd_doctor.c only.
 * energy.c reads the machine's power counters for run, bench and serve
 * (one sampling thread, off the step path). */
#ifndef LK_DIAG_H
#define LK_DIAG_H

#include "common/lk_common.h"

/* ======================================================================
 * the model's shape
 * ==================================================================== */

/* What the performance model needs to know of a model: its dimensions and
 * the bytes and weight elements of each kind of matrix. Per-layer figures
 * are averages over the layers (files may mix types by layer). */
typedef struct {
    char    arch[32], name[64];
    int64_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train;
    int64_t n_expert, n_expert_used;   /* 0: dense (MoE is not modelled yet) */
    /* KV cache elements per position and layer, whole model: keys and
     * values, 2 x n_head_kv x head_dim; MLA (deepseek2) caches the latent,
     * kv_lora + rope dims, once (n_head_kv 1: every rank with heads holds it) */
    double  kv_row;
    /* per layer, bytes and elements: */
    double  qo_bytes, qo_elems;        /* Wq + Wo: split by query heads under TP */
    double  kv_bytes, kv_elems;        /* Wk + Wv: split by KV heads (replicated past n_head_kv ranks) */
    double  ffn_bytes, ffn_elems;      /* gate + up + down: split by FFN rows */
    double  embd_bytes;                /* token_embd: rows gathered on the first stage, never streamed */
    double  out_bytes, out_elems;      /* output matrix (the embedding when tied), read on the last stage */
    uint64_t header_bytes;             /* of a GGUF: bytes read to learn all this */
} lk_diag_shape;

/* Reads the shape from a GGUF file's header, metadata and tensor index only:
 * the tensor data need not be present (a download's first megabytes do).
 * Every length is bounded before use; a file that ends inside the header is
 * an LK_ERR_FORMAT naming the byte offset. */
lk_status lk_diag_shape_gguf(const char *path, lk_diag_shape *out, char *err, size_t errlen);

/* A built-in shape (the published hyper-parameters gen-model knows, copied
 * from src/cli/cmd_gen_model.c) with every matrix of type `type` (a GGML
 * type id; rows that are not whole blocks become F16, as gen-model writes
 * them). False for an unknown name. */
bool lk_diag_shape_builtin(const char *name, uint32_t type, lk_diag_shape *out);
/* The built-in names, NULL past the end. */
const char *lk_diag_shape_name(int i);

/* ======================================================================
 * the performance model (perf.c; the formula and its terms are documented
 * there, beside the code)
 * ==================================================================== */

typedef struct {
    double mem_gb;        /* memory of one node */
    double mem_bw_gbs;    /* rate the decode kernels read weights at, one node (GB/s = 1e9 B/s) */
    double gflops;        /* rate of the matrix kernels on many tokens, one node (GFLOP/s) */
    double latency_us;    /* one-way latency of a link (a small message, ping-pong / 2) */
    double link_gbps;     /* link rate, Gbit/s */
    /* --local: the ranks are processes on one host. mem_bw_gbs and gflops
     * are then the host's, shared by the ranks working at the same moment,
     * and rank_* cap what one rank's threads reach alone (0: no cap). */
    bool   local;
    double rank_mem_bw_gbs, rank_gflops;
    /* all-reduce times measured by netbench, (bytes, us), ascending; used
     * instead of the latency formula when present */
    int    n_ar;
    double ar_bytes[32], ar_us[32];
    /* A node profile (lk_diag_hw_bench): the whole model's step time at T
     * tokens as `lockstep bench --json` measured it on one node, split into
     * the part that shrinks with a rank's share of the rows (a) and the part
     * that does not (b: what splitting the rows over 2x the threads did not
     * speed up). Replaces the roofline of mem_bw_gbs and gflops when present. */
    int    n_prof;
    double prof_tok[16], prof_a[16], prof_b[16]; /* T ascending; seconds per step */
    double prof_bytes;                           /* weight bytes per token of the profiled model */
    double prof_ctx;                             /* mean context of its decode */
    int    prof_threads;                         /* threads per rank it describes */
} lk_diag_hw;

typedef struct {
    int  seqs;     /* S: sequences decoding together (the "S" figures; 1 allowed) */
    int  ctx;      /* positions in a sequence's KV cache while it decodes */
    int  prompt;   /* prompt tokens per sequence for the prefill figures */
    int  n_batch;  /* tokens per step at most (prefill chunks) */
    bool kv_f16;
    bool rank_seqs; /* the split and reason describe the S-sequence step (else one sequence's) */
} lk_diag_run;

typedef enum {
    LK_BN_MEMORY, LK_BN_COMPUTE, LK_BN_LATENCY, LK_BN_LINK, LK_BN_PIPELINE, LK_BN_CAPACITY,
} lk_diag_bottleneck;
const char *lk_diag_bottleneck_name(lk_diag_bottleneck b);  /* "memory", "latency", ... */

typedef struct {
    int    tp, pp;
    double decode_tok_s, decode_tok_s_seqs;    /* one sequence; S sequences (aggregate) */
    double prefill_tok_s, prefill_tok_s_seqs;  /* one prompt; S prompts */
    double mem_per_node_gb;                    /* the fullest rank's (with --local: the host's total) */
    bool   fits;
    /* The one-sequence decode token, split (ms): what the reason quotes. */
    double t_token_ms;          /* = 1000 / decode_tok_s */
    double t_mem_ms;            /* reading weights and KV, all stages in turn */
    double t_compute_ms;        /* what compute adds beyond memory (roofline excess) */
    double t_latency_ms;        /* round trips: all-reduce rounds, hand-offs, step message, candidates */
    double t_link_ms;           /* bytes on the wire at the link rate */
    int    n_allreduce;         /* per token, on the slowest stage path */
    double allreduce_us;        /* one decode all-reduce */
    double weight_gb_rank;      /* weights the fullest rank streams per token */
    int    busy_stages;         /* stages working at once with S sequences */
    lk_diag_bottleneck bottleneck;     /* of the figure layouts are ranked by */
    char   reason[200];
} lk_diag_est;

/* Estimates one layout. tp x pp ranks; run->seqs the S of the *_seqs
 * figures. Asserts tp, pp >= 1 (callers check user input). */
void lk_diag_estimate(const lk_diag_shape *s, const lk_diag_hw *hw, const lk_diag_run *run, int tp, int pp,
                      lk_diag_est *out);

/* Fills hw's latency, link rate and all-reduce table from the text that
 * `lockstep netbench` prints (its table: size, ping-pong median, p99, MB/s,
 * all-reduce columns, auto). Fields it cannot find are left alone. */
lk_status lk_diag_hw_netbench(const char *text, lk_diag_hw *hw, char *err, size_t errlen);

/* Fills hw's node profile from `lockstep bench --json` lines of one node
 * (ranks 1): the rows of the fewest threads t give step times at T = seqs
 * (decode) and T = n_prompt (prefill of one sequence); rows of 2t threads,
 * when present, give the split into a and b (else b = 0). Also sets
 * mem_bw_gbs to the rate decode reached (weight bytes x tok/s). */
lk_status lk_diag_hw_bench(const char *text, lk_diag_hw *hw, char *err, size_t errlen);

/* ======================================================================
 * the link emulator (linkemu.c)
 * ==================================================================== */

typedef struct {
    const char *listen;     /* "127.0.0.1:7000" or ":0" style, as lk_tcp_listen takes */
    const char *to;         /* where each accepted connection is relayed */
    double delay_us;        /* one-way delay added to every byte, each direction */
    double rate_gbps;       /* 0: unlimited */
    double jitter_us;       /* uniform in [-J, +J] on each chunk's delay (order kept) */
    int    max_conns;       /* 0: unlimited; else stop accepting after this many */
} lk_diag_relay_cfg;

typedef struct lk_diag_relay lk_diag_relay;

/* Listens, then relays in the background until stopped. *port_out (may be
 * NULL) gets the port listened on. */
lk_status lk_diag_relay_start(const lk_diag_relay_cfg *cfg, lk_diag_relay **out, int *port_out, char *err,
                              size_t errlen);
/* --emulate-link: which links of a --local cluster go through a relay, and
 * with what. SPEC is a comma-separated list of rules
 *     [A-B:]DELAY_US[:RATE_GBPS[:JITTER_US]]
 * A rule with A-B (ranks, either order) sets that pair's link; a rule
 * without sets every pair no A-B rule names. Pairs no rule covers stay
 * direct TCP. Rate 0 or left out: unlimited. "25:10" = every link 25 us
 * one-way at 10 Gbit/s; "0-1:250" = only ranks 0 and 1 250 us apart. */
#define LK_LINKEMU_MAX_RULES 32
typedef struct {
    int    a, b;            /* ranks; -1, -1: the default rule */
    double delay_us, rate_gbps, jitter_us;
} lk_diag_link_rule;
typedef struct {
    int n;
    lk_diag_link_rule rule[LK_LINKEMU_MAX_RULES];
} lk_diag_linkemu;
/* Parses SPEC (the message names the bad rule); ranks are checked against
 * n_ranks (0: not checked). */
lk_status lk_diag_linkemu_parse(const char *spec, int n_ranks, lk_diag_linkemu *out, char *err, size_t errlen);
/* The rule for the link between ranks a and b; false when it stays direct. */
bool lk_diag_linkemu_pair(const lk_diag_linkemu *e, int a, int b, lk_diag_link_rule *out);
/* "250 us one-way +- 10 us, 10 Gbit/s" (or ", rate unlimited") */
void lk_diag_link_rule_describe(const lk_diag_link_rule *r, char *buf, size_t len);
/* The rule for (a, b) as a SPEC of its own ("D:R:J", every pair), or "" when
 * that link is direct: for a 2-rank session that measures this one link. */
void lk_diag_linkemu_pair_spec(const lk_diag_linkemu *e, int a, int b, char *buf, size_t len);

/* Connections relayed so far, and bytes in each direction. */
void      lk_diag_relay_stats(lk_diag_relay *r, int *conns, uint64_t *bytes_fwd, uint64_t *bytes_back);
void      lk_diag_relay_stop(lk_diag_relay *r);

/* ======================================================================
 * the doctor (doctor.c): every node, every link, the collectives and a
 * few real decode steps of a cluster, then a verdict
 * ==================================================================== */

/* What `lockstep doctor` examines: the cluster as `run` would open it. */
typedef struct {
    const char *model;        /* the head's GGUF (NULL: no model checks, no decode) */
    const char *workers;      /* "host:port,..." (with key), or NULL */
    const char *key_file;     /* with workers */
    const uint8_t *key;       /* its bytes (lk_key_load), with workers */
    int         local;        /* ranks started here, head included (0: none) */
    int         tp, pp;       /* 0: as run derives them (all TP) */
    int         threads;      /* per rank (0: run's default) */
    int         ctx;          /* positions for the decode check (0: 256) */
    const char *transport;    /* "auto" (NULL), "tcp", "shm" */
    int         iters;        /* ping-pong repetitions per size (0: 200) */
    const char *emulate_link; /* --emulate-link spec (--local only): every measurement and the decode
                                 steps go through those relays, over TCP */
} lk_doctor_cfg;

#define LK_DOCTOR_MAX_NODES 16
#define LK_DOCTOR_MAX_CHECKS 64

typedef enum { LK_DOC_PASS, LK_DOC_WARN, LK_DOC_FAIL, LK_DOC_SKIP } lk_doctor_level;
const char *lk_doctor_level_name(lk_doctor_level l); /* "ok", "warn", "FAIL", "skip" */

typedef struct {
    char   what[24];          /* "reachable", "agreement", "model", "threads", "memory", "link", ... */
    int    node;              /* 0: the head; -1: the cluster as a whole */
    lk_doctor_level level;
    char   detail[400];       /* the evidence, in words and numbers */
} lk_doctor_check;

typedef struct {
    char   addr[64];          /* "this host" for the head */
    bool   reachable;
    char   build[64], cpu[160], simd[16];
    char   cpu_model[96], clocksource[32]; /* "" when not reported */
    uint32_t version;
    int    cores;             /* CPUs it may run on; -1: not reported (a worker of an older build) */
    int    threads;           /* per rank on this node */
    double mem_avail_gb;      /* -1: not reported */
    double clock_offset_us;   /* NAN: not measured */
    /* the link head <-> this node (node 0: none) */
    char   transport[16];
    double lat_us, lat_p99_us, gbps;
} lk_doctor_node;

typedef struct {
    int    n_nodes, tp, pp;
    lk_doctor_node nodes[LK_DOCTOR_MAX_NODES];
    int    n_checks;
    lk_doctor_check checks[LK_DOCTOR_MAX_CHECKS];
    bool   have_model;
    lk_diag_shape shape;
    char   model_id[24];
    double membw_gbs, rank_membw_gbs;    /* this host: all cores, one rank's threads */
    double ar_bytes, ar_us;              /* the decode all-reduce at the model's size (0: none) */
    int    n_ar;                         /* all-reduce times measured, (bytes, us) ascending */
    double ar_table_bytes[8], ar_table_us[8];
    bool   decoded;                      /* the real decode steps ran */
    double step_ms, comm_ms;             /* median decode step, and its communication wait */
    double tok_s;
    int    n_allreduce;                  /* per token (plan's count for the layout) */
    double calibrated_gbs;               /* the weight read rate decode reached per rank (0: not measured) */
    lk_diag_est est;                     /* plan's estimate for the measured layout */
    lk_diag_est best;                    /* plan's best layout over these nodes */
    char   verdict[400];
    bool   ok;                           /* no check failed */
} lk_doctor_report;

/* Runs every check, in the order a careful engineer would: each node alone,
 * agreement, every link, the collective at the model's size, real decode
 * steps, then the plan and the verdict. Never fails as a whole: what went
 * wrong is a check of level FAIL (report->ok false). Starts (and ends)
 * local worker processes for --local. */
void lk_doctor_run(const lk_doctor_cfg *cfg, lk_doctor_report *r);

/* Fills hw from `lockstep doctor --json`'s object: the slowest link's
 * one-way latency and rate, the all-reduce table, and the weight read rate
 * its decode steps reached (per node; with the ranks of one host, per rank
 * and local). Fields it lacks are left alone. */
lk_status lk_diag_hw_doctor(const char *text, lk_diag_hw *hw, char *err, size_t errlen);

/* ======================================================================
 * energy (energy.c)
 * ==================================================================== */

/* Joules this machine used, from its own counters: RAPL package zones
 * (/sys/class/powercap, wrap-corrected) or else hwmon power sensors
 * (/sys/class/hwmon, integrated), sampled by a sleeping thread of its own.
 * The figure covers the whole machine (every process on it: all ranks of a
 * --local cluster together), not this process. NULL from open: nothing
 * readable (most VMs); the others accept NULL. */
typedef struct lk_energy lk_energy;
lk_energy  *lk_energy_open(void);
const char *lk_energy_source(const lk_energy *e);
double      lk_energy_joules(lk_energy *e);   /* since open */
void        lk_energy_close(lk_energy *e);

#endif
