/* The doctor: what `lockstep doctor` measures and concludes, in the order a
 * careful engineer works (issue 12):
 *   1. each node alone: CPU and SIMD level, cores vs threads, free memory vs
 *      what the layout needs, other load, this host's memory bandwidth;
 *   2. agreement: every worker is reached and authenticated, and its
 *      protocol version, build and CPU facts are read from its handshake;
 *   3. every link head <-> worker on its own (a 2-rank benchmark session per
 *      worker): which transport, one-way latency (median, p99), rate; a link
 *      markedly slower than its peers is flagged;
 *   4. the all-reduce of the whole cluster at the size decode sends (one
 *      embedding row of f32);
 *   5. the model: the cluster opened exactly as `run` opens it (so a worker
 *      with another file is named by the same check that would stop a run),
 *      then a few real decode steps with their communication wait;
 *   6. plan's model fed with these figures: the verdict (what bounds decode,
 *      with the arithmetic) and the layout plan ranks first.
 * Nothing here aborts on a peer's failure: each becomes a FAIL check.
 *
 * --local clusters: the links and collectives are measured against worker
 * daemons forked here for the purpose (on loopback, with a one-off key);
 * the decode check opens the cluster with --local itself, as run does. */
#include "diag/diag.h"

#include "cluster/cluster.h"
#include "engine/engine.h"
#include "kernels/membw.h"
#include "sampler/sampler.h"

#include <jansson.h>

#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

const char *lk_doctor_level_name(lk_doctor_level l) {
    static const char *n[] = {"ok", "warn", "FAIL", "skip"};
    return l <= LK_DOC_SKIP ? n[l] : "?";
}

static void check(lk_doctor_report *r, int node, const char *what, lk_doctor_level lv, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void check(lk_doctor_report *r, int node, const char *what, lk_doctor_level lv, const char *fmt, ...) {
    if (lv == LK_DOC_FAIL) r->ok = false;
    if (r->n_checks == LK_DOCTOR_MAX_CHECKS) return;
    lk_doctor_check *c = &r->checks[r->n_checks++];
    c->node = node;
    c->level = lv;
    snprintf(c->what, sizeof c->what, "%s", what);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->detail, sizeof c->detail, fmt, ap);
    va_end(ap);
}

static void simd_of(const char *cpu, char *out, size_t len) {
    const char *s = strstr(cpu, "simd=");
    snprintf(out, len, "%s", s ? s + 5 : "?");
    out[strcspn(out, " ")] = 0;
}

/* ---- 1. this host ------------------------------------------------------------ */

static void node_self(const lk_doctor_cfg *cfg, int ranks_here, lk_doctor_report *r) {
    lk_doctor_node *n = &r->nodes[0];
    snprintf(n->addr, sizeof n->addr, "this host");
    n->reachable = true;
    snprintf(n->build, sizeof n->build, "%s", lk_build_id());
    snprintf(n->cpu, sizeof n->cpu, "%s", lk_cpu_features());
    simd_of(n->cpu, n->simd, sizeof n->simd);
    n->version = LK_WIRE_VERSION;
    lk_host_facts(n->cpu_model, sizeof n->cpu_model, n->clocksource, sizeof n->clocksource);
    /* the CPUs this process may run on (affinity, cgroup quota); run's
     * default threads: the physical cores among them, shared by the ranks */
    n->cores = LK_MAX(1, lk_cpus_usable());
    n->threads = cfg->threads > 0 ? cfg->threads : LK_MAX(1, lk_threads_default() / ranks_here);
    n->mem_avail_gb = (double)lk_mem_available() / 1e9;
    n->clock_offset_us = 0;
    check(r, 0, "cpu", LK_DOC_PASS, "%s (%s), clock source %s: kernels at %s", n->cpu_model, n->cpu, n->clocksource,
          n->simd);
    int want = n->threads * ranks_here;
    if (want > n->cores)
        check(r, 0, "threads", LK_DOC_FAIL,
              "oversubscribed: %d rank%s x %d threads = %d threads on %d CPUs: a rank that waits for a descheduled "
              "thread stalls every all-reduce (use --threads %d)",
              ranks_here, ranks_here > 1 ? "s" : "", n->threads, want, n->cores, LK_MAX(1, n->cores / ranks_here));
    else
        check(r, 0, "threads", LK_DOC_PASS, "%d rank%s x %d threads on %d CPUs", ranks_here, ranks_here > 1 ? "s" : "",
              n->threads, n->cores);
    double load = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &load) != 1) load = -1;
        fclose(f);
    }
    if (load > n->cores)
        check(r, 0, "load", LK_DOC_WARN, "load average %.1f on %d CPUs: other work competes, figures below are low",
              load, n->cores);
    else if (load >= 0)
        check(r, 0, "load", LK_DOC_PASS, "load average %.1f on %d CPUs", load, n->cores);
    /* the memory bandwidth decode reads weights at: all cores, and one rank's threads */
    size_t llc = lk_membw_llc_bytes(), bytes = LK_MAX((size_t)64 << 20, 4 * llc);
    r->membw_gbs = lk_membw_read_gbs(n->cores, bytes, 3);
    r->rank_membw_gbs = lk_membw_read_gbs(n->threads, bytes, 3);
    check(r, 0, "memory bw", r->membw_gbs > 0 ? LK_DOC_PASS : LK_DOC_WARN,
          "%.1f GB/s with %d threads, %.1f GB/s with one rank's %d (%s reads of %zu MiB)", r->membw_gbs, n->cores,
          r->rank_membw_gbs, n->threads, lk_membw_simd_name(), bytes >> 20);
    /* energy: a RAPL package counter or a hwmon power sensor someone can read */
    const char *energy = NULL;
    static const char *cands[] = {"/sys/class/powercap/intel-rapl:0/energy_uj", "/sys/class/powercap/amd-rapl:0/energy_uj",
                                  "/sys/class/hwmon/hwmon0/power1_average", "/sys/class/hwmon/hwmon0/power1_input",
                                  "/sys/class/hwmon/hwmon1/power1_average", "/sys/class/hwmon/hwmon1/power1_input"};
    for (size_t i = 0; i < sizeof cands / sizeof cands[0] && !energy; i++)
        if (access(cands[i], R_OK) == 0) energy = cands[i];
    if (energy) check(r, 0, "energy", LK_DOC_PASS, "power readable at %s", energy);
    else
        check(r, 0, "energy", LK_DOC_SKIP,
              "unavailable: no readable RAPL counter (/sys/class/powercap) or hwmon power sensor (/sys/class/hwmon): "
              "joules per token cannot be measured on this node");
}

/* ---- 2. workers: reach and agree ----------------------------------------------- */

static void node_hello(const lk_doctor_cfg *cfg, int i, lk_doctor_report *r) {
    lk_doctor_node *n = &r->nodes[i];
    n->cores = -1, n->mem_avail_gb = -1, n->clock_offset_us = NAN;
    n->threads = cfg->threads;
    char err[LK_ERRLEN];
    lk_link *l = NULL;
    uint64_t t0 = lk_time_ns();
    lk_status st = lk_tcp_connect(n->addr, lk_deadline_ms(5000), &l, err, sizeof err);
    if (st) {
        check(r, i, "reachable", LK_DOC_FAIL, "%s: %s", n->addr, err);
        return;
    }
    double conn_ms = (double)(lk_time_ns() - t0) / 1e6;
    lk_chan ch;
    lk_chan_init(&ch, l);
    lk_hs_params hp;
    lk_hs_defaults(&hp, cfg->key, "doctor");
    lk_hs_peer peer;
    memset(&peer, 0, sizeof peer);
    st = lk_handshake(&ch, true, &hp, &peer, err, sizeof err);
    if (st == LK_ERR_MISMATCH || (st == LK_ERR_PEER && strstr(err, "mismatch"))) {
        n->reachable = true;
        check(r, i, "reachable", LK_DOC_PASS, "%s answers (connect %.2f ms)", n->addr, conn_ms);
        check(r, i, "agreement", LK_DOC_FAIL, "%s", err);
    } else if (st) {
        check(r, i, "reachable", LK_DOC_FAIL, "%s: connected, but the handshake failed: %s", n->addr, err);
    } else {
        n->reachable = true;
        snprintf(n->build, sizeof n->build, "%s", peer.build_id);
        snprintf(n->cpu, sizeof n->cpu, "%s", peer.cpu);
        simd_of(n->cpu, n->simd, sizeof n->simd);
        n->version = peer.version;
        if (peer.has_facts) {
            snprintf(n->cpu_model, sizeof n->cpu_model, "%s", peer.cpu_model);
            snprintf(n->clocksource, sizeof n->clocksource, "%s", peer.clocksource);
            n->cores = peer.cpus;
            n->mem_avail_gb = (double)peer.mem_avail / 1e9;
            if (n->threads <= 0) n->threads = peer.threads_default; /* what the worker takes without -t */
        }
        check(r, i, "reachable", LK_DOC_PASS, "%s: authenticated in %.2f ms", n->addr,
              (double)(lk_time_ns() - t0) / 1e6);
        bool same = peer.version == LK_WIRE_VERSION && !strcmp(peer.build_id, lk_build_id());
        check(r, i, "agreement", same ? LK_DOC_PASS : LK_DOC_FAIL, "protocol %u, build %s, cpu %s", peer.version,
              peer.build_id, peer.cpu);
        if (peer.has_facts && cfg->local <= 1) {
            check(r, i, "cpu", LK_DOC_PASS, "%s (%s), clock source %s, %d CPUs, %.2f GB free", n->cpu_model, n->cpu,
                  n->clocksource, n->cores, n->mem_avail_gb);
            if (n->threads > n->cores)
                check(r, i, "threads", LK_DOC_FAIL,
                      "oversubscribed: %d threads on its %d CPUs: a rank that waits for a descheduled thread stalls "
                      "every all-reduce (use --threads %d)", n->threads, n->cores, n->cores);
        }
        lk_chan_send(&ch, LK_MSG_BYE, NULL, 0, lk_deadline_ms(1000), err, sizeof err);
    }
    lk_link_close(ch.link);
}

/* ---- 3, 4. links and collectives (netbench sessions) -------------------------------- */

/* A benchmark session with `workers`; the table netbench prints, parsed. */
static lk_status bench(const lk_doctor_cfg *cfg, const char *workers, const char *emu, const size_t *sizes, int nsizes,
                       bool ar_only, lk_diag_hw *hw, double *p99_out, char *transport, size_t tlen, char *err,
                       size_t errlen) {
    lk_bench_cfg bc = {.nsizes = nsizes, .iters = cfg->iters > 0 ? cfg->iters : 200, .allreduce_only = ar_only,
                       .emulate_link = emu && *emu ? emu : NULL};
    memcpy(bc.sizes, sizes, sizeof(size_t) * (size_t)nsizes);
    lk_mesh_shm shm = LK_MESH_SHM_AUTO;
    lk_status st0 = lk_transport_parse(cfg->transport ? cfg->transport : "auto", &shm, err, errlen);
    if (st0) return st0;
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    if (!out) return lk_fail(err, errlen, LK_ERR_IO, "open_memstream failed");
    lk_status st = lk_cluster_bench(workers, cfg->key, &bc, shm, -1, out, err, errlen);
    fclose(out);
    if (!st) {
        const char *d = strstr(text, "data over ");
        if (transport && d) {
            snprintf(transport, tlen, "%s", d + 10);
            transport[strcspn(transport, ", \n")] = 0;
        }
        /* p99 of the smallest size: the second number of its row */
        st = lk_diag_hw_netbench(text, hw, err, errlen);
        const char *row = strstr(text, "\n64 B");
        double med, p99;
        if (!st && p99_out && row && sscanf(row + 5, "%lf %lf", &med, &p99) == 2) *p99_out = p99;
    }
    free(text);
    return st;
}

static double median_of(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n ? v[n / 2] : 0;
}

/* ---- 5. the model, as run opens it, and real decode steps ---------------------------- */

static void decode_check(const lk_doctor_cfg *cfg, lk_doctor_report *r) {
    lk_engine_opts eo = {.model_path = cfg->model, .n_threads = cfg->threads, .n_ctx = cfg->ctx > 0 ? cfg->ctx : 256,
                         .n_batch = 64, .workers = cfg->workers, .key_file = cfg->key_file, .local = cfg->local,
                         .tp = cfg->tp, .pp = cfg->pp, .transport = cfg->transport, .max_seqs = 1,
                         .emulate_link = cfg->emulate_link};
    char err[LK_ERRLEN];
    lk_engine *e = NULL;
    if (lk_engine_open(&eo, &e, err, sizeof err)) {
        int node = -1, rk;
        const char *w = strstr(err, "worker rank ");
        if (w && sscanf(w + 12, "%d", &rk) == 1 && rk > 0 && rk < r->n_nodes) node = rk;
        if (cfg->local) node = -1; /* ranks of this host: the rank is not a node of the list */
        const char *what = strstr(err, "model mismatch") ? "model" : strstr(err, "memory") ? "memory" : "open";
        check(r, node, what, LK_DOC_FAIL, "the cluster does not open as run would open it: %s", err);
        return;
    }
    check(r, -1, "model", LK_DOC_PASS, "every rank loaded the same model (identity %s) and built the mesh",
          r->model_id);
    lk_sampler_params sp;
    lk_sampler_params_default(&sp);
    sp.temp = 0;
    lk_sampler *s = lk_sampler_create(&sp);
    int32_t prompt[8], next = 0;
    int64_t nv = r->shape.n_vocab > 0 ? r->shape.n_vocab : 2;
    for (int i = 0; i < 8; i++) prompt[i] = (int32_t)(1 + (i * 37) % (nv - 1));
    lk_status st = lk_engine_step(e, prompt, 8, 0, s, &next, err, sizeof err);
    enum { STEPS = 24 };
    double step[STEPS], comm[STEPS];
    int n = 0, pos = 8;
    for (; !st && n < STEPS; n++) {
        int32_t tok = next >= 0 && next < nv ? next : 1;
        uint64_t t0 = lk_time_ns();
        st = lk_engine_step(e, &tok, 1, pos++, s, &next, err, sizeof err);
        step[n] = (double)(lk_time_ns() - t0) / 1e6;
        double cs = 0, ms = 0;
        lk_engine_last_timing(e, &cs, &ms);
        comm[n] = ms * 1e3;
    }
    if (st) {
        check(r, -1, "decode", LK_DOC_FAIL, "a decode step failed: %s", err);
    } else {
        r->decoded = true;
        r->step_ms = median_of(step, n);
        r->comm_ms = median_of(comm, n);
        r->tok_s = 1000 / r->step_ms;
        check(r, -1, "decode", LK_DOC_PASS, "%d steps: %.2f ms per token (%.1f tok/s), of which %.2f ms waiting for "
              "the network", n, r->step_ms, r->tok_s, r->comm_ms);
    }
    lk_sampler_free(s);
    lk_engine_close(e);
}

/* ---- local worker daemons ------------------------------------------------------------ */

static int spawn_local(int n, int threads, const uint8_t *key, pid_t *pids, char *addrs, size_t alen, char *err,
                       size_t errlen) {
    addrs[0] = 0;
    int started = 0;
    for (int i = 0; i < n; i++) {
        int fd, port;
        if (lk_tcp_listen("127.0.0.1:0", &fd, &port, err, errlen)) return started;
        fflush(stdout);
        fflush(stderr);
        pid_t p = fork();
        if (p < 0) {
            close(fd);
            lk_fail(err, errlen, LK_ERR_IO, "fork failed");
            return started;
        }
        if (p == 0) {
            lk_log_set_level(LK_LOG_ERROR);
            lk_worker_opts o = {.listen_fd = fd, .key = key, .n_threads = threads};
            char e2[LK_ERRLEN];
            _exit(lk_worker_serve(&o, e2, sizeof e2) ? 1 : 0);
        }
        close(fd);
        pids[started++] = p;
        size_t k = strlen(addrs);
        snprintf(addrs + k, alen - k, "%s127.0.0.1:%d", k ? "," : "", port);
    }
    return started;
}

/* ---- 6. the verdict ------------------------------------------------------------------ */

static void verdict(const lk_doctor_cfg *cfg, const lk_diag_hw *hw0, lk_doctor_report *r) {
    int ranks = r->n_nodes;
    lk_diag_run run = {.seqs = 8, .ctx = cfg->ctx > 0 ? cfg->ctx : 256, .prompt = 128, .n_batch = 512};
    lk_diag_hw hwc = *hw0, *hw = &hwc;
    lk_diag_estimate(&r->shape, hw, &run, r->tp, r->pp, &r->est);
    /* The probe streams DRAM; a model that lives in cache, or kernels that
     * reach less than the probe, read at another rate. With real decode
     * steps measured, the rate is the one they reached: the weights a rank
     * read over the compute part of the step (the network wait taken out). */
    double comp_s = r->decoded ? (r->step_ms - r->comm_ms) / 1e3 : 0;
    if (comp_s > 0 && r->est.weight_gb_rank > 0) {
        double bw = r->est.weight_gb_rank / comp_s;
        if (hw->local) hw->rank_mem_bw_gbs = bw, hw->mem_bw_gbs = bw * ranks;
        else hw->mem_bw_gbs = bw;
        r->calibrated_gbs = bw;
        lk_diag_estimate(&r->shape, hw, &run, r->tp, r->pp, &r->est);
    }
    r->n_allreduce = r->est.n_allreduce;
    /* plan's best layout over these nodes (ties to fewer nodes) */
    bool have = false;
    for (int tp = 1; tp <= ranks; tp++)
        for (int pp = 1; tp * pp <= ranks && pp <= r->shape.n_layer; pp++) {
            lk_diag_est e;
            lk_diag_estimate(&r->shape, hw, &run, tp, pp, &e);
            if (!e.fits) continue;
            if (!have || e.decode_tok_s > r->best.decode_tok_s * 1.0005) r->best = e, have = true;
        }
    if (!have) r->best = r->est;
    double lat_ms = r->n_allreduce * (r->ar_us > 0 ? r->ar_us : r->est.allreduce_us) / 1e3;
    double comp_ms = r->decoded ? r->step_ms - r->comm_ms : r->est.t_mem_ms + r->est.t_compute_ms;
    const char *src = r->decoded ? "measured" : "predicted";
    if (ranks < 2 || r->n_allreduce == 0) {
        snprintf(r->verdict, sizeof r->verdict, "one rank: decode is bound by this node's %s (%.2f ms/token %s)",
                 lk_diag_bottleneck_name(r->est.bottleneck), r->decoded ? r->step_ms : r->est.t_token_ms, src);
    } else if (lat_ms > comp_ms) {
        snprintf(r->verdict, sizeof r->verdict,
                 "decode is bound by link latency: %d all-reduces x %.0f us = %.2f ms/token, more than compute %.2f ms "
                 "(%s)", r->n_allreduce, r->ar_us > 0 ? r->ar_us : r->est.allreduce_us, lat_ms, comp_ms, src);
    } else {
        snprintf(r->verdict, sizeof r->verdict,
                 "decode is bound by compute: %.2f ms/token (%s); the links add %d all-reduces x %.0f us = %.2f ms",
                 comp_ms, src, r->n_allreduce, r->ar_us > 0 ? r->ar_us : r->est.allreduce_us, lat_ms);
    }
    /* plan's best layout uses fewer nodes and is markedly faster: say so */
    if (r->best.tp * r->best.pp < ranks && r->best.decode_tok_s > 1.1 * r->est.decode_tok_s)
        check(r, -1, "layout", LK_DOC_WARN,
              "fewer nodes would be faster: plan ranks --tp %d --pp %d first at %.2f tok/s against %.2f for tp %d x pp %d "
              "(%s)", r->best.tp, r->best.pp, r->best.decode_tok_s, r->est.decode_tok_s, r->tp, r->pp, r->est.reason);
    /* Waiting far beyond what the all-reduces themselves take is ranks
     * waiting for each other, not the network. */
    if (r->decoded && ranks > 1 && r->comm_ms > 2 * lat_ms + 0.05) {
        size_t k = strlen(r->verdict);
        snprintf(r->verdict + k, sizeof r->verdict - k,
                 "; of the %.2f ms each step waited on the network only %.2f ms is the all-reduces: the rest is ranks "
                 "waiting for each other (other load, unequal shares, descheduled threads)",
                 r->comm_ms, lat_ms);
    }
}

void lk_doctor_run(const lk_doctor_cfg *cfg0, lk_doctor_report *r) {
    lk_doctor_cfg cfg = *cfg0;
    memset(r, 0, sizeof *r);
    r->ok = true;
    char err[LK_ERRLEN];
    /* the nodes: the head, then each worker in --workers order (or the local ranks) */
    int n = 1;
    uint8_t local_key[LK_KEY_BYTES];
    pid_t pids[LK_DOCTOR_MAX_NODES];
    int n_pids = 0;
    static char addrs[LK_DOCTOR_MAX_NODES * 64];
    /* --emulate-link: checked by the command; links then go over TCP, emulated or not, so they compare */
    lk_diag_linkemu emul = {0};
    if (cfg.emulate_link) {
        if (lk_diag_linkemu_parse(cfg.emulate_link, cfg.local, &emul, err, sizeof err))
            check(r, -1, "local", LK_DOC_FAIL, "%s", err);
        cfg.transport = "tcp";
    }
    if (cfg.local > 1) {
        char hex[2 * LK_KEY_BYTES + 1];
        lk_key_generate(hex);
        for (int i = 0; i < LK_KEY_BYTES; i++) {
            unsigned v;
            sscanf(hex + 2 * i, "%2x", &v);
            local_key[i] = (uint8_t)v;
        }
        cfg.key = local_key;
        int threads = cfg.threads > 0 ? cfg.threads : LK_MAX(1, lk_threads_default() / cfg.local);
        n_pids = spawn_local(LK_MIN(cfg.local - 1, LK_DOCTOR_MAX_NODES - 1), threads, local_key, pids, addrs,
                             sizeof addrs, err, sizeof err);
        if (n_pids < cfg.local - 1) check(r, -1, "local", LK_DOC_FAIL, "starting local ranks: %s", err);
    } else if (cfg.workers) {
        snprintf(addrs, sizeof addrs, "%s", cfg.workers);
    }
    for (char *p = addrs; *p && n < LK_DOCTOR_MAX_NODES;) {
        size_t k = strcspn(p, ",");
        snprintf(r->nodes[n].addr, sizeof r->nodes[n].addr, "%.*s", (int)k, p);
        n++;
        p += k + (p[k] == ',');
    }
    r->n_nodes = n;
    r->tp = cfg.tp > 0 ? cfg.tp : n / (cfg.pp > 0 ? cfg.pp : 1);
    r->pp = cfg.pp > 0 ? cfg.pp : 1;
    node_self(&cfg, cfg.local > 1 ? cfg.local : 1, r);

    /* the model: identity and shape (the header is enough) */
    if (cfg.model) {
        lk_gguf *g = NULL;
        if (lk_gguf_open(cfg.model, &g, err, sizeof err) || lk_diag_shape_gguf(cfg.model, &r->shape, err, sizeof err)) {
            check(r, 0, "model", LK_DOC_FAIL, "%s", err);
        } else {
            uint8_t id[LK_MODEL_ID_BYTES];
            lk_cluster_model_id(g, id);
            lk_cluster_model_id_short(id, r->model_id, sizeof r->model_id);
            r->have_model = true;
        }
        lk_gguf_close(g);
    }

    for (int i = 1; i < n; i++) {
        node_hello(&cfg, i, r);
        if (cfg.local > 1) { /* ranks of this host: its cores, its threads per rank, its clock */
            r->nodes[i].cores = r->nodes[0].cores, r->nodes[i].threads = r->nodes[0].threads;
            r->nodes[i].mem_avail_gb = r->nodes[0].mem_avail_gb, r->nodes[i].clock_offset_us = 0;
        }
    }

    /* every link on its own */
    lk_diag_hw hw = {.mem_gb = r->nodes[0].mem_avail_gb, .mem_bw_gbs = r->membw_gbs > 0 ? 0.85 * r->membw_gbs : 50,
                     .gflops = 500, .latency_us = 0, .link_gbps = 100, .local = cfg.local > 1,
                     .rank_mem_bw_gbs = cfg.local > 1 && r->rank_membw_gbs > 0 ? 0.85 * r->rank_membw_gbs : 0};
    double worst_lat = 0, best_lat = INFINITY, worst_gbps = INFINITY;
    int n_links = 0;
    for (int i = 1; i < n; i++) {
        lk_doctor_node *nd = &r->nodes[i];
        if (!nd->reachable) continue;
        static const size_t sz[] = {64, 64 << 10, 1 << 20};
        lk_diag_hw h = hw;
        /* an emulated link keeps its rule in the session of two ranks that measures it */
        char emu[96] = "";
        if (cfg.emulate_link) lk_diag_linkemu_pair_spec(&emul, 0, i, emu, sizeof emu);
        if (bench(&cfg, nd->addr, emu, sz, 3, false, &h, &nd->lat_p99_us, nd->transport, sizeof nd->transport, err,
                  sizeof err)) {
            check(r, i, "link", LK_DOC_FAIL, "benchmark with %s failed: %s", nd->addr, err);
            continue;
        }
        nd->lat_us = h.latency_us, nd->gbps = h.link_gbps;
        worst_lat = fmax(worst_lat, nd->lat_us), best_lat = fmin(best_lat, nd->lat_us);
        worst_gbps = fmin(worst_gbps, nd->gbps);
        n_links++;
    }
    for (int i = 1; i < n; i++) {
        lk_doctor_node *nd = &r->nodes[i];
        if (!nd->transport[0]) continue;
        /* markedly slower than the best peer: twice its latency, and by more than noise */
        bool slow = n_links > 1 && nd->lat_us > 2 * best_lat && nd->lat_us - best_lat > 20;
        char emu[128] = "", what[96];
        lk_diag_link_rule rule;
        if (cfg.emulate_link && lk_diag_linkemu_pair(&emul, 0, i, &rule)) {
            lk_diag_link_rule_describe(&rule, what, sizeof what);
            snprintf(emu, sizeof emu, " (emulated: %s)", what);
        }
        if (slow)
            check(r, i, "link", LK_DOC_FAIL,
                  "head <-> node %d (%s) over %s: %.1f us one-way (p99 %.1f), %.2f Gbit/s%s: markedly slower than the "
                  "best peer's link (%.1f us): every all-reduce waits for the slowest", i, nd->addr, nd->transport,
                  nd->lat_us, nd->lat_p99_us, nd->gbps, emu, best_lat);
        else
            check(r, i, "link", LK_DOC_PASS, "head <-> node %d (%s) over %s: %.1f us one-way (p99 %.1f), %.2f Gbit/s%s", i,
                  nd->addr, nd->transport, nd->lat_us, nd->lat_p99_us, nd->gbps, emu);
    }
    if (n_links) hw.latency_us = worst_lat, hw.link_gbps = worst_gbps;

    /* the collective at the size decode sends: one f32 row of the embedding */
    if (n > 1 && n_links == n - 1) {
        size_t row = r->have_model ? (size_t)r->shape.n_embd * 4 : 16384;
        size_t sz[3] = {row, 8 * row, 64 * row};
        lk_diag_hw h = hw;
        if (bench(&cfg, addrs, cfg.emulate_link, sz, 3, true, &h, NULL, NULL, 0, err, sizeof err)) {
            check(r, -1, "all-reduce", LK_DOC_FAIL, "all-reduce benchmark of %d ranks failed: %s", n, err);
        } else {
            hw.n_ar = h.n_ar;
            memcpy(hw.ar_bytes, h.ar_bytes, sizeof hw.ar_bytes);
            memcpy(hw.ar_us, h.ar_us, sizeof hw.ar_us);
            if (h.n_ar) r->ar_bytes = h.ar_bytes[0], r->ar_us = h.ar_us[0];
            r->n_ar = LK_MIN(h.n_ar, 8);
            for (int k = 0; k < r->n_ar; k++) r->ar_table_bytes[k] = h.ar_bytes[k], r->ar_table_us[k] = h.ar_us[k];
            check(r, -1, "all-reduce", LK_DOC_PASS, "%d ranks, %.0f bytes (decode's size): %.1f us median", n,
                  r->ar_bytes, r->ar_us);
        }
    }
    for (int i = 0; i < n_pids; i++) {
        kill(pids[i], SIGTERM);
        waitpid(pids[i], NULL, 0);
    }

    /* memory: what the layout needs against what is free here */
    if (r->have_model) {
        lk_diag_run run = {.seqs = 1, .ctx = cfg.ctx > 0 ? cfg.ctx : 256, .prompt = 128, .n_batch = 512};
        lk_diag_est e;
        lk_diag_estimate(&r->shape, &hw, &run, r->tp, r->pp, &e);
        double need = e.mem_per_node_gb, have = r->nodes[0].mem_avail_gb;
        check(r, 0, "memory", need > have ? LK_DOC_FAIL : LK_DOC_PASS, "%s needs %.3f GB (tp %d x pp %d), %.2f GB free",
              cfg.local > 1 ? "this host's ranks" : "the head's share", need, r->tp, r->pp, have);
        /* each worker against its share (the fullest rank's: plan's figure), from what its handshake said */
        for (int i = 1; i < n && cfg.local <= 1; i++)
            if (r->nodes[i].mem_avail_gb >= 0)
                check(r, i, "memory", need > r->nodes[i].mem_avail_gb ? LK_DOC_FAIL : LK_DOC_PASS,
                      "its share needs %.3f GB (tp %d x pp %d), %.2f GB free there", need, r->tp, r->pp,
                      r->nodes[i].mem_avail_gb);
    }

    /* the model through the cluster, and real decode steps: not when a
     * worker is out of reach or refused us (the open would only repeat it) */
    bool ready = true;
    for (int i = 0; i < r->n_checks; i++)
        if (r->checks[i].level == LK_DOC_FAIL && (!strcmp(r->checks[i].what, "reachable") ||
                                                  !strcmp(r->checks[i].what, "agreement")))
            ready = false;
    if (r->have_model) {
        if (ready) decode_check(&cfg, r);
        else check(r, -1, "decode", LK_DOC_SKIP, "not tried: fix the failures above first");
        verdict(&cfg, &hw, r);
    } else {
        snprintf(r->verdict, sizeof r->verdict, "no model given (-m): nodes and links only");
    }
}

/* ---- doctor's JSON as plan's input ------------------------------------------------------- */

lk_status lk_diag_hw_doctor(const char *text, lk_diag_hw *hw, char *err, size_t errlen) {
    json_error_t je;
    json_t *o = json_loads(text, 0, &je);
    if (!json_is_object(o) || !json_is_array(json_object_get(o, "nodes"))) {
        json_decref(o);
        return lk_fail(err, errlen, LK_ERR_FORMAT, "not the output of 'lockstep doctor --json'");
    }
    json_t *nodes = json_object_get(o, "nodes"), *n;
    size_t i;
    double lat = -1, gbps = -1;
    bool local = false;
    json_array_foreach(nodes, i, n) {
        if (i == 0) continue;
        json_t *l = json_object_get(n, "latency_us"), *g = json_object_get(n, "link_gbps");
        if (json_is_number(l) && json_number_value(l) > lat) lat = json_number_value(l);
        if (json_is_number(g) && (gbps < 0 || json_number_value(g) < gbps)) gbps = json_number_value(g);
        json_t *a = json_object_get(n, "addr"); /* ranks doctor started itself for --local */
        if (json_is_string(a) && !strncmp(json_string_value(a), "127.", 4) && json_is_number(json_object_get(n, "cpus")))
            local = true;
    }
    if (lat > 0) hw->latency_us = lat;
    if (gbps > 0) hw->link_gbps = gbps;
    json_t *t = json_object_get(o, "allreduce_table"), *row;
    int k = 0;
    json_array_foreach(t, i, row) {
        double b = json_number_value(json_array_get(row, 0)), u = json_number_value(json_array_get(row, 1));
        if (k < 32 && b > 0 && u > 0 && (k == 0 || b > hw->ar_bytes[k - 1])) hw->ar_bytes[k] = b, hw->ar_us[k++] = u;
    }
    if (k) hw->n_ar = k;
    json_t *bw = json_object_get(o, "calibrated_gbs");
    if (json_is_number(bw) && json_number_value(bw) > 0) {
        double v = json_number_value(bw);
        if (local) hw->local = true, hw->rank_mem_bw_gbs = v, hw->mem_bw_gbs = v * (double)json_array_size(nodes);
        else hw->mem_bw_gbs = v;
    }
    json_decref(o);
    return LK_OK;
}
