/* diag: the performance model's arithmetic on shapes and figures whose
 * answers were worked out by hand (in the comments), the GGUF header reader
 * on a cut file, netbench's and bench's outputs as inputs, and the link
 * emulator's delay and rate measured through real sockets on loopback. */
#include "diag/diag.h"
#include "gguf/gguf.h"
#include "quant/quant.h"
#include "lk_test.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

static bool near(double a, double b, double rel) { return fabs(a - b) <= rel * fabs(b); }

/* 4 layers; per layer Wq+Wo 1 MB, Wk+Wv 1 MB, FFN 2 MB (elements: twice the
 * bytes); output 4 MB, embedding 4 MB; 8 heads = 8 KV heads of 128. */
static lk_diag_shape toy(void) {
    lk_diag_shape s = {.n_embd = 1024, .n_layer = 4, .n_head = 8, .n_head_kv = 8, .head_dim = 128, .n_ff = 4096,
                       .n_vocab = 1000, .kv_row = 2 * 8 * 128};
    s.qo_bytes = 1e6, s.kv_bytes = 1e6, s.ffn_bytes = 2e6;
    s.qo_elems = 2e6, s.kv_elems = 2e6, s.ffn_elems = 4e6;
    s.out_bytes = 4e6, s.out_elems = 8e6, s.embd_bytes = 4e6;
    return s;
}
/* 1 GB/s, compute nearly free, 100 us one way, 8 Gbit/s = 1e9 B/s */
static lk_diag_hw toy_hw(void) {
    lk_diag_hw h = {.mem_bw_gbs = 1, .gflops = 1e6, .latency_us = 100, .link_gbps = 8};
    return h;
}
static const lk_diag_run toy_run = {.seqs = 1, .ctx = 0, .prompt = 1, .n_batch = 1};

TEST(one_node_memory_bound) {
    lk_diag_shape s = toy();
    lk_diag_hw h = toy_hw();
    lk_diag_est e;
    lk_diag_estimate(&s, &h, &toy_run, 1, 1, &e);
    /* 4 x 4 MB + 4 MB output = 20 MB at 1 GB/s = 20 ms: 50 tok/s, no network */
    CHECKF(near(e.decode_tok_s, 50, 1e-9), "%.9g", e.decode_tok_s);
    CHECK(e.bottleneck == LK_BN_MEMORY);
    CHECKF(e.n_allreduce == 0 && e.t_latency_ms == 0, "%d %g", e.n_allreduce, e.t_latency_ms);
    CHECKF(strstr(e.reason, "memory-bound: 20 MB of weights per rank at 1.0 GB/s = 20.0 ms of a 20.0 ms token"), "%s",
           e.reason);
}

TEST(tp2_terms) {
    lk_diag_shape s = toy();
    lk_diag_hw h = toy_hw();
    lk_diag_est e;
    lk_diag_estimate(&s, &h, &toy_run, 2, 1, &e);
    /* per rank 4 x 2 MB + 2 MB output = 10 ms; 8 all-reduces of 4096 B
     * (one one-way delay, 100 us, + 4096 B / 1e9 B/s = 104.096 us) = 0.832768 ms;
     * step message and candidates 2 x 100 us: 11.032768 ms */
    CHECKF(near(e.decode_tok_s, 1000 / 11.032768, 1e-9), "%.9g", e.decode_tok_s);
    CHECK(e.n_allreduce == 8);
    CHECKF(near(e.allreduce_us, 104.096, 1e-9), "%.9g", e.allreduce_us);
    CHECKF(near(e.t_latency_ms, 8 * 0.1 + 0.2, 1e-9), "%.9g", e.t_latency_ms);
    CHECKF(near(e.t_link_ms, 8 * 0.004096, 1e-9), "%.9g", e.t_link_ms);
    CHECK(e.bottleneck == LK_BN_MEMORY);
    /* memory of a rank: 8 MB layers + 2 MB output + 4 MB embedding + scratch
     * 1 row x 4 x (4 x 1024 + 3 x 4096 / 2) + 16 x 4 x 1000 / 2 = 14.07296 MB */
    CHECKF(near(e.mem_per_node_gb, 0.01407296, 1e-9), "%.9g", e.mem_per_node_gb);
    /* 2 ms one way: 8 x 2004.096 us + 4 ms + 10 ms = 30.032768 ms, latency-bound */
    h.latency_us = 2000;
    lk_diag_estimate(&s, &h, &toy_run, 2, 1, &e);
    CHECKF(near(e.decode_tok_s, 1000 / 30.032768, 1e-9), "%.9g", e.decode_tok_s);
    CHECK(e.bottleneck == LK_BN_LATENCY);
    CHECKF(strstr(e.reason, "latency-bound: 8 all-reduces x 2004 us = 16.0 ms of a 30.0 ms token"), "%s", e.reason);
    /* a fitting check: 14 MB do not fit in 10 MB */
    h.mem_gb = 0.01;
    lk_diag_estimate(&s, &h, &toy_run, 2, 1, &e);
    CHECK(!e.fits && e.bottleneck == LK_BN_CAPACITY);
}

TEST(pp2_pipeline) {
    lk_diag_shape s = toy();
    lk_diag_hw h = toy_hw();
    lk_diag_est e;
    lk_diag_estimate(&s, &h, &toy_run, 1, 2, &e);
    /* stages: 2 layers = 8 ms; 2 layers + output = 12 ms; one hand-off
     * (100 us + 4096 B / 1e9) and the candidates back (100 us):
     * 20.204096 ms per token, each stage idle half the time */
    CHECKF(near(e.decode_tok_s, 1000 / 20.204096, 1e-9), "%.9g", e.decode_tok_s);
    CHECK(e.bottleneck == LK_BN_PIPELINE);
    /* two sequences: two micro-batches of one, cycle max(2 x 12, 20.204) = 24 ms */
    lk_diag_run r = toy_run;
    r.seqs = 2;
    lk_diag_estimate(&s, &h, &r, 1, 2, &e);
    CHECKF(near(e.decode_tok_s_seqs, 2 / 0.024, 1e-9), "%.9g", e.decode_tok_s_seqs);
}

TEST(compute_bound_and_batching) {
    lk_diag_shape s = toy();
    lk_diag_hw h = toy_hw();
    h.gflops = 0.01; /* 1e7 flop/s */
    lk_diag_est e;
    lk_diag_estimate(&s, &h, &toy_run, 1, 1, &e);
    /* 2 x (4 x 8e6 + 8e6) = 8e7 flops = 8 s against 20 ms of reads */
    CHECKF(near(e.decode_tok_s, 0.125, 1e-9), "%.9g", e.decode_tok_s);
    CHECK(e.bottleneck == LK_BN_COMPUTE);
    /* memory-bound: 4 sequences share one read of the weights */
    h.gflops = 1e6;
    lk_diag_run r = toy_run;
    r.seqs = 4;
    lk_diag_estimate(&s, &h, &r, 1, 1, &e);
    CHECKF(near(e.decode_tok_s_seqs, 200, 1e-6), "%.9g", e.decode_tok_s_seqs);
}

TEST(node_profile_from_bench) {
    /* t threads: T=1 0.1 s, T=4 0.2 s, T=32 0.5 s; 2t: 0.0625, 0.125, 0.32 s
     * -> a = 2 (t1 - t2), b = 2 t2 - t1: (0.075, 0.025), (0.15, 0.05), (0.36, 0.14) */
    const char *txt =
        "{\"threads\":1,\"seqs\":1,\"ranks\":1,\"n_prompt\":32,\"n_gen\":32,\"prefill_tok_s\":64,\"decode_tok_s\":10,\"weight_bytes_per_token\":20000000}\n"
        "{\"threads\":1,\"seqs\":4,\"ranks\":1,\"n_prompt\":32,\"n_gen\":32,\"prefill_tok_s\":60,\"decode_tok_s\":20,\"weight_bytes_per_token\":20000000}\n"
        "some other line\n"
        "{\"threads\":2,\"seqs\":1,\"ranks\":1,\"n_prompt\":32,\"n_gen\":32,\"prefill_tok_s\":100,\"decode_tok_s\":16,\"weight_bytes_per_token\":20000000}\n"
        "{\"threads\":2,\"seqs\":4,\"ranks\":1,\"n_prompt\":32,\"n_gen\":32,\"prefill_tok_s\":90,\"decode_tok_s\":32,\"weight_bytes_per_token\":20000000}\n"
        "{\"threads\":1,\"seqs\":1,\"ranks\":2,\"n_prompt\":32,\"n_gen\":32,\"prefill_tok_s\":1,\"decode_tok_s\":1,\"weight_bytes_per_token\":1}\n";
    lk_diag_hw h = toy_hw();
    char err[256];
    CHECK(lk_diag_hw_bench(txt, &h, err, sizeof err) == LK_OK);
    CHECKF(h.n_prof == 3, "%d", h.n_prof);
    double wa[3] = {0.075, 0.15, 0.36}, wb[3] = {0.025, 0.05, 0.14}, wt[3] = {1, 4, 32};
    for (int i = 0; i < 3 && i < h.n_prof; i++)
        CHECKF(h.prof_tok[i] == wt[i] && near(h.prof_a[i], wa[i], 1e-9) && near(h.prof_b[i], wb[i], 1e-9),
               "%d: T %g a %g b %g", i, h.prof_tok[i], h.prof_a[i], h.prof_b[i]);
    CHECKF(near(h.mem_bw_gbs, 0.2, 1e-9), "%g", h.mem_bw_gbs); /* 20 MB x 10 tok/s */
    CHECK(h.prof_threads == 1);
    /* TP 2 on the toy (same bytes: 20 MB): 0.075 / 2 + 0.025 = 62.5 ms, 8
     * all-reduces of 4096 B at no latency = 32.768 us */
    h.latency_us = 0;
    lk_diag_shape s = toy();
    lk_diag_est e;
    lk_diag_estimate(&s, &h, &toy_run, 2, 1, &e);
    CHECKF(near(e.decode_tok_s, 1 / (0.0625 + 32.768e-6), 1e-9), "%.9g", e.decode_tok_s);
    /* T = 2 interpolates: a = 0.1, b = 1/30; one node decode of 2 sequences = 2 / 0.13333 */
    lk_diag_run r = toy_run;
    r.seqs = 2;
    lk_diag_estimate(&s, &h, &r, 1, 1, &e);
    CHECKF(near(e.decode_tok_s_seqs, 2 / (0.1 + 0.025 + 0.025 / 3), 1e-9), "%.9g", e.decode_tok_s_seqs);
    CHECK(lk_diag_hw_bench("nothing here\n", &h, err, sizeof err) == LK_ERR_FORMAT);
}

TEST(netbench_table) {
    const char *txt =
        "netbench: 2 ranks, data over tcp, spin on, all-reduce wire f32, build lockstep-proto3\n"
        "          ping-pong one-way (us)             | all-reduce median / p99 (us)        \n"
        "size         median       p99        MB/s | exchange        doubling        ring            scatter         auto\n"
        "64 B           3.80      9.10        16.8 | 6.1 / 20.0      6.0 / 19.0      7.5 / 30.0      6.5 / 21.0      exchange\n"
        "8 KiB          4.10     10.00      1998.0 | 11.3 / 71.0     11.0 / 70.0     14.0 / 80.0     12.0 / 75.0     exchange\n"
        "1 MiB        300.00    400.00      3495.3 | 1500.0 / 2000.0 1400.0 / 1900.0 1108.0 / 1500.0 763.0 / 900.0   scatter\n";
    lk_diag_hw h = toy_hw();
    char err[256];
    CHECK(lk_diag_hw_netbench(txt, &h, err, sizeof err) == LK_OK);
    CHECKF(near(h.latency_us, 3.8, 1e-9), "%g", h.latency_us);
    CHECKF(near(h.link_gbps, 3495.3 * 8e-3, 1e-9), "%g", h.link_gbps);
    CHECKF(h.n_ar == 3 && h.ar_bytes[1] == 8192 && near(h.ar_us[1], 11.3, 1e-9) && near(h.ar_us[2], 763, 1e-9), "%d %g %g",
           h.n_ar, h.ar_bytes[1], h.ar_us[2]);
    /* the model then uses the measured time: 8 KiB decode all-reduce of the toy is 4 KiB -> flat below the first
     * size? no: 4096 B lies between 64 B and 8 KiB, log-log: exp(ln 6.1 + ln(11.3/6.1) x ln(64) / ln(128)) */
    lk_diag_shape s = toy();
    lk_diag_est e;
    lk_diag_estimate(&s, &h, &toy_run, 2, 1, &e);
    double want = exp(log(6.1) + log(11.3 / 6.1) * log(4096.0 / 64) / log(8192.0 / 64));
    CHECKF(near(e.allreduce_us, want, 1e-9), "%g want %g", e.allreduce_us, want);
    CHECK(lk_diag_hw_netbench("hello\n", &h, err, sizeof err) == LK_ERR_FORMAT);
}

TEST(builtin_shape) {
    lk_diag_shape s;
    CHECK(!lk_diag_shape_builtin("no-such", LK_TYPE_Q4_0, &s));
    CHECK(lk_diag_shape_builtin("tinyllama-1.1b", LK_TYPE_Q4_0, &s));
    /* Q4_0: 18 bytes per 32 weights. Wq 2048x2048 + Wo = 2 x 2048 x 2048 x 18 / 32 */
    CHECKF(s.qo_bytes == 2.0 * 2048 * 2048 * 18 / 32, "%g", s.qo_bytes);
    CHECKF(s.kv_bytes == 2.0 * 2048 * 256 * 18 / 32, "%g", s.kv_bytes);
    CHECKF(s.ffn_bytes == 3.0 * 2048 * 5632 * 18 / 32, "%g", s.ffn_bytes);
    CHECK(s.n_layer == 22 && s.n_head_kv == 4 && s.out_bytes == 2048.0 * 32000 * 18 / 32);
    CHECK(lk_diag_shape_name(0) && !lk_diag_shape_name(1000));
    CHECK(s.kv_row == 2.0 * 4 * 64);
}

/* MLA (deepseek2): the file's key_length is the absorbed key, kv_lora +
 * rope (the synth file: 128 + 32 = 160), and the cache holds that one
 * latent row per position and layer, not keys and values per head: the KV
 * term of plan must count 160 elements, not 2 x 1 x 160. */
TEST(mla_shape_counts_the_latent) {
    lk_diag_shape s;
    char err[512];
    if (lk_diag_shape_gguf(lk_td("synth/synth-deepseek2-f16.gguf"), &s, err, sizeof err)) { CHECKF(0, "%s", err); return; }
    CHECKF(s.n_head_kv == 1 && s.kv_row == 160, "n_head_kv %lld kv_row %g", (long long)s.n_head_kv, s.kv_row);
    if (lk_diag_shape_gguf(lk_td("synth/synth-qwen3moe-f16.gguf"), &s, err, sizeof err)) { CHECKF(0, "%s", err); return; }
    CHECKF(s.kv_row == 2.0 * (double)s.n_head_kv * (double)s.head_dim, "qwen3moe kv_row %g", s.kv_row);
}

/* A GGUF of a small llama shape, then the same file cut right after its
 * header (no tensor data at all) and cut inside the header. */
TEST(gguf_header_only) {
    char path[] = "/tmp/lk_diag_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    char err[512];
    lk_gguf_writer *w = NULL;
    CHECK(lk_gguf_writer_open(path, &w, err, sizeof err) == LK_OK);
    if (!w) return;
    lk_gguf_writer_set_str(w, "general.architecture", "llama");
    lk_gguf_writer_set_str(w, "general.name", "toy");
    lk_gguf_writer_set_u32(w, "llama.block_count", 2);
    lk_gguf_writer_set_u32(w, "llama.embedding_length", 64);
    lk_gguf_writer_set_u32(w, "llama.feed_forward_length", 128);
    lk_gguf_writer_set_u32(w, "llama.attention.head_count", 4);
    lk_gguf_writer_set_u32(w, "llama.attention.head_count_kv", 2);
    lk_gguf_writer_set_u32(w, "llama.context_length", 256);
    const char *toks[3] = {"a", "b", "c"};
    lk_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    struct { const char *n; uint64_t in, out; } mats[] = {
        {"token_embd.weight", 64, 3}, {"output.weight", 64, 3},
        {"blk.0.attn_q.weight", 64, 64}, {"blk.0.attn_k.weight", 64, 32}, {"blk.0.attn_v.weight", 64, 32},
        {"blk.0.attn_output.weight", 64, 64}, {"blk.0.ffn_gate.weight", 64, 128}, {"blk.0.ffn_up.weight", 64, 128},
        {"blk.0.ffn_down.weight", 128, 64},
        {"blk.1.attn_q.weight", 64, 64}, {"blk.1.attn_k.weight", 64, 32}, {"blk.1.attn_v.weight", 64, 32},
        {"blk.1.attn_output.weight", 64, 64}, {"blk.1.ffn_gate.weight", 64, 128}, {"blk.1.ffn_up.weight", 64, 128},
        {"blk.1.ffn_down.weight", 128, 64},
    };
    int nm = (int)(sizeof mats / sizeof mats[0]);
    for (int i = 0; i < nm; i++) {
        uint64_t ne[2] = {mats[i].in, mats[i].out};
        lk_gguf_writer_add_tensor(w, mats[i].n, LK_TYPE_Q8_0, 2, ne);
    }
    uint64_t ne1[1] = {64};
    lk_gguf_writer_add_tensor(w, "blk.0.attn_norm.weight", LK_TYPE_F32, 1, ne1);
    CHECK(lk_gguf_writer_begin_data(w, err, sizeof err) == LK_OK);
    static uint8_t zero[1 << 16];
    for (int i = 0; i < nm; i++) {
        size_t row = 0;
        lk_type_row_bytes(LK_TYPE_Q8_0, (int64_t)mats[i].in, &row);
        CHECK(lk_gguf_writer_write(w, zero, row * mats[i].out, err, sizeof err) == LK_OK);
    }
    CHECK(lk_gguf_writer_write(w, zero, 64 * 4, err, sizeof err) == LK_OK);
    CHECK(lk_gguf_writer_close(w, err, sizeof err) == LK_OK);
    lk_gguf *g = NULL;
    CHECK(lk_gguf_open(path, &g, err, sizeof err) == LK_OK);
    uint64_t data_off = g ? lk_gguf_data_offset(g) : 0;
    lk_gguf_close(g);

    lk_diag_shape s;
    CHECKF(lk_diag_shape_gguf(path, &s, err, sizeof err) == LK_OK, "%s", err);
    /* Q8_0: 34 bytes per 32. Per layer Wq + Wo = 2 x 64 x 64 x 34/32 = 8704 */
    CHECKF(s.qo_bytes == 8704 && s.kv_bytes == 2 * 32 * 68 && s.ffn_bytes == 3 * 128 * 68, "%g %g %g", s.qo_bytes,
           s.kv_bytes, s.ffn_bytes);
    CHECK(s.n_layer == 2 && s.n_embd == 64 && s.n_head == 4 && s.n_head_kv == 2 && s.head_dim == 16 && s.n_ff == 128);
    CHECK(s.n_vocab == 3 && s.out_bytes == 3 * 68 && s.embd_bytes == 3 * 68 && !strcmp(s.arch, "llama"));
    /* cut after the tensor index: the tensor data is gone, the shape is not */
    CHECK(truncate(path, (off_t)data_off) == 0);
    lk_diag_shape s2;
    CHECKF(lk_diag_shape_gguf(path, &s2, err, sizeof err) == LK_OK, "%s", err);
    CHECK(s2.qo_bytes == s.qo_bytes && s2.out_bytes == s.out_bytes && s2.n_layer == 2);
    /* gguf's own reader refuses that file: why plan has its own */
    CHECK(lk_gguf_open(path, &g, err, sizeof err) != LK_OK);
    /* cut inside the tensor index */
    CHECK(truncate(path, (off_t)s.header_bytes - 20) == 0);
    CHECK(lk_diag_shape_gguf(path, &s2, err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "ends at byte") && strstr(err, "tensor"), "%s", err);
    CHECK(lk_diag_shape_gguf("/nonexistent/x.gguf", &s2, err, sizeof err) == LK_ERR_IO);
    unlink(path);
}

/* ---- the link emulator through real sockets ------------------------------------- */

typedef struct { int lfd; size_t sink; } echo_t;

/* echoes every byte back; or, with sink > 0, reads `sink` bytes and answers one */
static void *echo_main(void *arg) {
    echo_t *e = arg;
    for (;;) {
        int c = accept(e->lfd, NULL, NULL);
        if (c < 0) return NULL;
        int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char buf[65536];
        ssize_t n;
        size_t got = 0;
        while ((n = recv(c, buf, sizeof buf, 0)) > 0) {
            if (!e->sink) {
                if (send(c, buf, (size_t)n, MSG_NOSIGNAL) != n) break;
            } else if ((got += (size_t)n) >= e->sink) {
                send(c, buf, 1, MSG_NOSIGNAL);
                got = 0;
            }
        }
        close(c);
    }
}

static int listen_any(int *port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(fd, (struct sockaddr *)&a, sizeof a);
    listen(fd, 8);
    socklen_t l = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &l);
    *port = ntohs(a.sin_port);
    return fd;
}

static int dial(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { close(fd); return -1; }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* median one-way time (RTT / 2) of n 64-byte ping-pongs, us */
static double pingpong_us(int fd, int n) {
    double *t = malloc(sizeof(double) * (size_t)n);
    char buf[64] = {1};
    for (int i = -20; i < n; i++) {
        uint64_t t0 = lk_time_ns();
        if (send(fd, buf, sizeof buf, MSG_NOSIGNAL) != (ssize_t)sizeof buf) { free(t); return -1; }
        size_t got = 0;
        while (got < sizeof buf) {
            ssize_t k = recv(fd, buf + got, sizeof buf - got, 0);
            if (k <= 0) { free(t); return -1; }
            got += (size_t)k;
        }
        if (i >= 0) t[i] = (double)(lk_time_ns() - t0) / 2e3;
    }
    qsort(t, (size_t)n, sizeof *t, cmp_d);
    double m = t[n / 2];
    free(t);
    return m;
}

static double through_relay(int echo_port, double delay, double rate, int n, double *moved_s, size_t bulk) {
    char to[32], err[256];
    snprintf(to, sizeof to, "127.0.0.1:%d", echo_port);
    lk_diag_relay_cfg cfg = {.listen = "127.0.0.1:0", .to = to, .delay_us = delay, .rate_gbps = rate};
    lk_diag_relay *r = NULL;
    int port = 0;
    if (lk_diag_relay_start(&cfg, &r, &port, err, sizeof err)) return -1;
    int fd = dial(port);
    double us = -1;
    if (fd >= 0 && !bulk) us = pingpong_us(fd, n);
    if (fd >= 0 && bulk) {
        /* bulk bytes to the sink, which answers one byte when all arrived */
        char *buf = calloc(1, 65536);
        uint64_t t0 = lk_time_ns();
        size_t sent = 0;
        while (sent < bulk) {
            size_t k = bulk - sent < 65536 ? bulk - sent : 65536;
            ssize_t s = send(fd, buf, k, MSG_NOSIGNAL);
            if (s <= 0) break;
            sent += (size_t)s;
        }
        ssize_t k = recv(fd, buf, 1, 0);
        *moved_s = (double)(lk_time_ns() - t0) / 1e9;
        free(buf);
        us = k == 1 ? 0 : -1;
    }
    if (fd >= 0) close(fd);
    int conns;
    lk_diag_relay_stats(r, &conns, NULL, NULL);
    lk_diag_relay_stop(r);
    return conns == 1 ? us : -1;
}

TEST(linkemu_delay_and_rate) {
    int eport;
    echo_t e = {.lfd = listen_any(&eport)};
    pthread_t th;
    pthread_create(&th, NULL, echo_main, &e);
    int fd = dial(eport);
    double direct = pingpong_us(fd, 300);
    close(fd);
    /* what the relay adds one way: its own hop at delay 0 (a second socket,
     * 10-20 us on loopback); with a delay, the delay (timed from the kernel's
     * arrival stamp, which hides the relay's wake-up) plus its send */
    double r0 = through_relay(eport, 0, 0, 300, NULL, 0);
    double r50 = through_relay(eport, 50, 0, 300, NULL, 0);
    double r200 = through_relay(eport, 200, 0, 200, NULL, 0);
    /* the direct figure again, on a fresh connection (the echo serves one at
     * a time), and the lower of the two: one stall on the loaded CI machine
     * during the first measurement made the relay seem to add -134 us */
    fd = dial(eport);
    direct = LK_MIN(direct, pingpong_us(fd, 300));
    close(fd);
    double a0 = r0 - direct, a50 = r50 - direct, a200 = r200 - direct;
    printf("  linkemu: direct one-way %.1f us; through the relay +%.1f (delay 0), +%.1f (delay 50), +%.1f (delay 200)\n",
           direct, a0, a50, a200);
    CHECKF(direct > 0 && a0 > -5 && a0 < 200, "direct %g, relay adds %g", direct, a0);
    /* never less than the delay; beyond it, at most the relay's own hop as
     * measured in this run (which grows with the machine's load) plus slack:
     * the loaded 2-core CI machine added 41 us at 200 us set with a fixed 40 us
     * bound, and 89 us (hop 15) under ASan beside a compile; a relay that
     * doubled a delay or slept twice would still be far outside; --help
     * quotes the figures measured on a quiet machine */
    double slack = LK_MAX(120.0, 2 * a0 + 60.0);
    CHECKF(a50 - 50 > -5 && a50 - 50 < slack, "set 50 us, added %.1f (hop %.1f)", a50, a0);
    CHECKF(a200 - 200 > -5 && a200 - 200 < slack, "set 200 us, added %.1f (hop %.1f)", a200, a0);
    shutdown(e.lfd, SHUT_RDWR);
    close(e.lfd);
    pthread_join(th, NULL);
    /* rate: 4 MiB at 0.1 Gbit/s = 0.336 s on the emulated wire */
    echo_t sk = {.lfd = listen_any(&eport), .sink = 4u << 20};
    pthread_create(&th, NULL, echo_main, &sk);
    double moved = 0;
    CHECK(through_relay(eport, 0, 0.1, 0, &moved, 4u << 20) == 0);
    double want = (4u << 20) * 8 / 0.1e9;
    printf("  linkemu: 4 MiB at 0.1 Gbit/s arrived in %.3f s (the wire alone: %.3f s)\n", moved, want);
    CHECKF(moved > want * 0.98 && moved < want * 1.15, "moved in %.3f s, want about %.3f", moved, want);
    e = sk;
    shutdown(e.lfd, SHUT_RDWR);
    close(e.lfd);
    pthread_join(th, NULL);
}

int main(void) {
    RUN(one_node_memory_bound);
    RUN(tp2_terms);
    RUN(pp2_pipeline);
    RUN(compute_bound_and_batching);
    RUN(node_profile_from_bench);
    RUN(netbench_table);
    RUN(builtin_shape);
    RUN(mla_shape_counts_the_latent);
    RUN(gguf_header_only);
    RUN(linkemu_delay_and_rate);
    return lk_test_end();
}
