/* lockstep quantize — rewrite a GGUF with its 2-D weights quantised, choosing
 * per-tensor types as llama-quantize does for the same file type (for an F32
 * source the result is byte-identical to llama-quantize's, but for q4_0's
 * output matrix (below): the quantisers
 * are ggml's reference algorithms, used when there is no importance matrix).
 *
 *   --type   base     general.file_type   per-tensor rules (below)
 *   q8_0     Q8_0      7                  -
 *   q4_0     Q4_0      2                  output Q8_0 (llama-quantize: Q6_K; lockstep's q4_0
 *                                         files kept what they were before it had Q6_K)
 *   q5_0     Q5_0      8                  output Q6_K
 *   q5_1     Q5_1      9                  output Q6_K
 *   q2_k     Q2_K     10                  output Q6_K; attn_v Q4_K if heads/kv_heads >= 4, else
 *                                         Q3_K; ffn_down* Q3_K; attn_output Q3_K
 *   q2_k_s   Q2_K     21                  output Q6_K; attn_v Q4_K if heads/kv_heads >= 4;
 *                                         ffn_down* Q4_K in the first n_layer/8 layers
 *   q3_k_s   Q3_K     11                  output Q6_K
 *   q3_k_m   Q3_K     12                  output Q6_K; attn_v Q5_K for the first 2, then Q4_K;
 *   (= q3_k)                              ffn_down* Q5_K in the first n_layer/16 layers, then
 *                                         Q4_K; attn_output Q4_K; attn_qkv Q4_K
 *   q3_k_l   Q3_K     13                  output Q6_K; attn_v Q5_K; ffn_down* Q5_K;
 *                                         attn_output Q5_K; attn_qkv Q4_K
 *   q4_k_s   Q4_K     14                  output Q6_K; attn_v Q5_K for the first 4; ffn_down*
 *                                         Q5_K in the first n_layer/8 layers
 *   q4_k_m   Q4_K     15                  output Q6_K; attn_v and ffn_down* Q6_K where
 *   (= q4_k)                              use_more_bits(i, n); attn_qkv Q5_K
 *   q5_k_s   Q5_K     16                  output Q6_K
 *   q5_k_m   Q5_K     17                  output Q6_K; attn_v, ffn_down* Q6_K where
 *   (= q5_k)                              use_more_bits(i, n); attn_qkv Q6_K
 *   q6_k     Q6_K     18                  -
 *
 * use_more_bits(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, with i the
 * layer of the tensor (attn_v: its index among the attn_v tensors) and n the
 * block count. "output" is output.weight, or token_embd.weight when there is
 * no output.weight (tied embeddings). Models with 8 experts (Mixtral-like):
 * attn_k and attn_v Q8_0, and attn_output Q5_K for q2_k, q3_k_s, q3_k_m,
 * q4_k_s, q4_k_m. Rows that are not whole blocks of the chosen type take
 * llama-quantize's fallback: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0
 * (output rows not whole 256-blocks: Q8_0); Q2_K and Q3_K -> IQ4_NL there,
 * which lockstep cannot write: it uses Q5_0 instead (1 bit more per weight
 * on those tensors; say so when it happens); F16 if even that does not fit.
 * Not reproduced: llama-quantize's 70B-model attn_v bump (Q3_K/Q4_K ->
 * Q5_K, for LLM_TYPE_70B) and the Falcon-specific rules.
 *
 * Which tensors are quantised: 2-D (and higher) "*weight" tensors, except
 * norms, the MoE router (ffn_gate_inp) and ssm_conv1d; everything else
 * (norms, biases, 1-D) is copied verbatim. Every key/value is copied in
 * order, then general.quantization_version = 2 and general.file_type are
 * set; tensors are written in llama.cpp's order: tensors outside blocks
 * first, then block by block (by layer number), by name within each. */
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "quant/quant.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    const lk_gguf_tensor *src;
    uint32_t type;  /* output type */
    int64_t  layer; /* from "blk.N.", -1 outside blocks */
} qtensor;

static int64_t layer_of(const char *name) {
    if (strncmp(name, "blk.", 4)) return -1;
    char *end;
    long long v = strtoll(name + 4, &end, 10);
    return end != name + 4 && *end == '.' && v >= 0 ? v : -1;
}

static int cmp_order(const void *a, const void *b) {
    const qtensor *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return strcmp(x->src->name, y->src->name);
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

/* ---- the per-tensor rules of llama-quantize (see the file comment) ---------- */

typedef struct {
    const char *name;   /* --type value */
    lk_type     base;   /* default type of quantised tensors */
    uint32_t    ftype;  /* llama_ftype, written to general.file_type */
} qspec;

static const qspec k_specs[] = {
    {"q8_0", LK_TYPE_Q8_0, 7},    {"q4_0", LK_TYPE_Q4_0, 2},    {"q5_0", LK_TYPE_Q5_0, 8},
    {"q5_1", LK_TYPE_Q5_1, 9},    {"q2_k", LK_TYPE_Q2_K, 10},   {"q2_k_s", LK_TYPE_Q2_K, 21},
    {"q3_k_s", LK_TYPE_Q3_K, 11}, {"q3_k_m", LK_TYPE_Q3_K, 12}, {"q3_k", LK_TYPE_Q3_K, 12},
    {"q3_k_l", LK_TYPE_Q3_K, 13}, {"q4_k_s", LK_TYPE_Q4_K, 14}, {"q4_k_m", LK_TYPE_Q4_K, 15},
    {"q4_k", LK_TYPE_Q4_K, 15},   {"q5_k_s", LK_TYPE_Q5_K, 16}, {"q5_k_m", LK_TYPE_Q5_K, 17},
    {"q5_k", LK_TYPE_Q5_K, 17},   {"q6_k", LK_TYPE_Q6_K, 18},
};
enum { FT_Q2_K = 10, FT_Q3_K_S = 11, FT_Q3_K_M = 12, FT_Q3_K_L = 13, FT_Q4_K_S = 14, FT_Q4_K_M = 15,
       FT_Q5_K_M = 17, FT_Q2_K_S = 21 };

/* Facts of the model the rules read, and the attn_v counter. */
typedef struct {
    int64_t n_layer, n_expert, n_gqa; /* block count; expert count (0: dense); heads per KV head */
    int64_t n_attn_v, i_attn_v;       /* attn_v tensors in the file; those seen so far */
    bool    has_output;
    int     n_fallback_q50;           /* Q2_K/Q3_K rows that llama-quantize would make IQ4_NL */
} qstate;

static int64_t kv_int(const lk_gguf *g, const char *arch, size_t alen, const char *suffix, int64_t dflt) {
    char key[256];
    snprintf(key, sizeof key, "%.*s.%s", (int)alen, arch, suffix);
    int64_t v;
    return lk_gguf_get_i64(g, key, &v) ? v : dflt;
}

static void qstate_init(const lk_gguf *g, qstate *qs) {
    memset(qs, 0, sizeof *qs);
    const char *arch = "";
    size_t alen = 0;
    lk_gguf_get_str(g, "general.architecture", &arch, &alen);
    qs->n_layer = kv_int(g, arch, alen, "block_count", 0);
    qs->n_expert = kv_int(g, arch, alen, "expert_count", 0);
    int64_t nh = kv_int(g, arch, alen, "attention.head_count", 1);
    int64_t nkv = kv_int(g, arch, alen, "attention.head_count_kv", nh); /* absent or per-layer: MHA */
    qs->n_gqa = nkv > 0 ? nh / nkv : 1;
    qs->has_output = lk_gguf_find_tensor(g, "output.weight") != NULL;
    for (int64_t i = 0; i < lk_gguf_n_tensors(g); i++) {
        const char *n = lk_gguf_tensor_at(g, i)->name;
        if (strstr(n, "attn_v.weight") || strstr(n, "attn_qkv.weight") || strstr(n, "attn_kv_b.weight")) qs->n_attn_v++;
    }
}

static bool use_more_bits(int64_t i, int64_t n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

static bool quantisable(const lk_gguf_tensor *t) {
    return t->n_dims >= 2 && ends_with(t->name, "weight") && !strstr(t->name, "_norm.weight") &&
           !strstr(t->name, "ffn_gate_inp.weight") && !strstr(t->name, "ssm_conv1d.weight");
}

/* The output type of one tensor (llama-quantize's llama_tensor_get_type for
 * the file types above). Called in write order (attn_v counter). */
static uint32_t choose_type(qstate *qs, const lk_gguf_tensor *t, const qspec *sp) {
    if (!quantisable(t)) return t->type;
    const char *name = t->name;
    const uint32_t ft = sp->ftype;
    const int64_t nx = (int64_t)t->ne[0], il = layer_of(name), nl = qs->n_layer;
    lk_type ty = sp->base;
    if (!strcmp(name, "output.weight") || (!qs->has_output && !strcmp(name, "token_embd.weight"))) {
        if (nx % lk_type_block_size(ty) || ty == LK_TYPE_Q4_0) ty = LK_TYPE_Q8_0; /* q4_0: see the file comment */
        else if (ty != LK_TYPE_Q8_0) ty = LK_TYPE_Q6_K;
    } else if (!strcmp(name, "token_embd.weight")) {
        /* rules only for IQ and TQ types */
    } else if (strstr(name, "attn_v.weight")) {
        if (ft == FT_Q2_K) ty = qs->n_gqa >= 4 ? LK_TYPE_Q4_K : LK_TYPE_Q3_K;
        else if (ft == FT_Q2_K_S && qs->n_gqa >= 4) ty = LK_TYPE_Q4_K;
        else if (ft == FT_Q3_K_M) ty = qs->i_attn_v < 2 ? LK_TYPE_Q5_K : LK_TYPE_Q4_K;
        else if (ft == FT_Q3_K_L) ty = LK_TYPE_Q5_K;
        else if ((ft == FT_Q4_K_M || ft == FT_Q5_K_M) && use_more_bits(qs->i_attn_v, qs->n_attn_v)) ty = LK_TYPE_Q6_K;
        else if (ft == FT_Q4_K_S && qs->i_attn_v < 4) ty = LK_TYPE_Q5_K;
        if (qs->n_expert == 8) ty = LK_TYPE_Q8_0;
        qs->i_attn_v++;
    } else if (strstr(name, "attn_k.weight")) {
        if (qs->n_expert == 8) ty = LK_TYPE_Q8_0;
    } else if (strstr(name, "ffn_down")) {
        if (ft == FT_Q2_K) ty = LK_TYPE_Q3_K;
        else if (ft == FT_Q2_K_S) { if (il < nl / 8) ty = LK_TYPE_Q4_K; }
        else if (ft == FT_Q3_K_M) ty = il < nl / 16 ? LK_TYPE_Q5_K : LK_TYPE_Q4_K;
        else if (ft == FT_Q3_K_L) ty = LK_TYPE_Q5_K;
        else if (ft == FT_Q4_K_M) { if (use_more_bits(il, nl)) ty = LK_TYPE_Q6_K; }
        else if (ft == FT_Q5_K_M && use_more_bits(il, nl)) ty = LK_TYPE_Q6_K;
        else if (ft == FT_Q4_K_S && il < nl / 8) ty = LK_TYPE_Q5_K;
    } else if (strstr(name, "attn_output.weight")) {
        if (qs->n_expert == 8) {
            if (ft == FT_Q2_K || ft == FT_Q3_K_S || ft == FT_Q3_K_M || ft == FT_Q4_K_S || ft == FT_Q4_K_M)
                ty = LK_TYPE_Q5_K;
        } else if (ft == FT_Q2_K) ty = LK_TYPE_Q3_K;
        else if (ft == FT_Q3_K_M) ty = LK_TYPE_Q4_K;
        else if (ft == FT_Q3_K_L) ty = LK_TYPE_Q5_K;
    } else if (strstr(name, "attn_qkv.weight")) {
        if (ft == FT_Q3_K_M || ft == FT_Q3_K_L) ty = LK_TYPE_Q4_K;
        else if (ft == FT_Q4_K_M) ty = LK_TYPE_Q5_K;
        else if (ft == FT_Q5_K_M) ty = LK_TYPE_Q6_K;
    }
    if (nx % lk_type_block_size(ty)) { /* llama-quantize's fallback types */
        switch (ty) {
        case LK_TYPE_Q2_K: case LK_TYPE_Q3_K: ty = LK_TYPE_Q5_0; qs->n_fallback_q50++; break; /* IQ4_NL there */
        case LK_TYPE_Q4_K: ty = LK_TYPE_Q5_0; break;
        case LK_TYPE_Q5_K: ty = LK_TYPE_Q5_1; break;
        case LK_TYPE_Q6_K: ty = LK_TYPE_Q8_0; break;
        default: break;
        }
        if (nx % lk_type_block_size(ty)) ty = LK_TYPE_F16;
    }
    return ty;
}

/* ---- row conversion, a chunk at a time, across threads ---------------------- */

typedef struct {
    const lk_gguf_tensor *t;
    uint32_t out_type;
    uint64_t row0, row1;
    size_t   in_rb, out_rb;
    uint8_t *out;     /* (row1 - row0) * out_rb */
    float   *scratch; /* (ne[0]) */
} qjob;

static void *run_qjob(void *arg) {
    qjob *j = arg;
    int64_t n = (int64_t)j->t->ne[0];
    for (uint64_t r = j->row0; r < j->row1; r++) {
        const uint8_t *src = (const uint8_t *)j->t->data + r * j->in_rb;
        lk_dequantize_row((lk_type)j->t->type, src, j->scratch, n);
        lk_quantize_row((lk_type)j->out_type, j->scratch, j->out + (r - j->row0) * j->out_rb, n);
    }
    return NULL;
}

int lk_cmd_quantize(int argc, char **argv) {
    const char *type_name = NULL;
    int64_t threads = -1;
    bool quiet = false;
    const lk_opt opts[] = {
        {"--type", NULL, LK_OPT_STR, &type_name, "TYPE",
         "q8_0, q4_0, q5_0, q5_1, q2_k, q2_k_s, q3_k_s, q3_k_m (= q3_k), q3_k_l, q4_k_s, q4_k_m (= q4_k), "
         "q5_k_s, q5_k_m (= q5_k) or q6_k: llama-quantize's per-tensor mixes (required)"},
        {"--threads", "-t", LK_OPT_INT, &threads, "N", "converter threads (default: the CPUs this process may run on, at most 16)"},
        {"--quiet", "-q", LK_OPT_FLAG, &quiet, NULL, "no progress line"},
        {0},
    };
    const char *pos[2];
    int np = lk_args_parse("quantize", "IN.gguf OUT.gguf --type TYPE", opts, argc, argv, pos, 2);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (np != 2) {
        fprintf(stderr, "lockstep quantize: need an input and an output file (usage: lockstep quantize IN OUT --type TYPE)\n");
        return 2;
    }
    const qspec *spec = NULL;
    for (size_t k = 0; type_name && k < sizeof k_specs / sizeof k_specs[0]; k++)
        if (!strcasecmp(type_name, k_specs[k].name)) spec = &k_specs[k];
    if (!spec) {
        fprintf(stderr, "lockstep quantize: --type must be one of q8_0 q4_0 q5_0 q5_1 q2_k q2_k_s q3_k_s q3_k_m q3_k "
                        "q3_k_l q4_k_s q4_k_m q4_k q5_k_s q5_k_m q5_k q6_k (got '%s')\n",
                type_name ? type_name : "nothing");
        return 2;
    }
    if (threads == 0 || threads < -1 || threads > 256) {
        fprintf(stderr, "lockstep quantize: --threads %" PRId64 " is out of range: 1 to 256 (leave it out for the default)\n", threads);
        return 2;
    }
    const bool threads_given = threads > 0;
    if (!threads_given) threads = LK_MIN(lk_cpus_usable(), 16);
    fprintf(stderr, "lockstep quantize: %" PRId64 " thread%s (%s)\n", threads, threads > 1 ? "s" : "",
            threads_given ? "-t" : "default: the CPUs this process may run on, at most 16");
    const char *in = pos[0], *out = pos[1];
    struct stat si, so;
    if (stat(in, &si) == 0 && stat(out, &so) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino) {
        fprintf(stderr, "lockstep quantize: the output %s is the input file\n", out);
        return 2;
    }
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(in, &g, err, sizeof err) != LK_OK) {
        fprintf(stderr, "lockstep quantize: %s\n", err);
        return 1;
    }
    int64_t nt = lk_gguf_n_tensors(g);
    qtensor *qt = lk_xcalloc((size_t)(nt ? nt : 1), sizeof *qt);
    uint64_t total_in = 0, max_ne0 = 1;
    for (int64_t i = 0; i < nt; i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
        qt[i] = (qtensor){t, t->type, layer_of(t->name)};
    }
    qsort(qt, (size_t)nt, sizeof *qt, cmp_order);
    qstate qs;
    qstate_init(g, &qs);
    for (int64_t i = 0; i < nt; i++) {
        const lk_gguf_tensor *t = qt[i].src;
        qt[i].type = choose_type(&qs, t, spec); /* in write order: the attn_v rules count */
        total_in += t->nbytes;
        if (qt[i].type != t->type) {
            max_ne0 = LK_MAX(max_ne0, t->ne[0]);
            if (!lk_type_supported(t->type)) {
                fprintf(stderr, "lockstep quantize: %s: tensor '%s' has type %s, which lockstep cannot dequantise\n",
                        in, t->name, lk_type_name(t->type));
                free(qt);
                lk_gguf_close(g);
                return 1;
            }
        }
    }
    if (qs.n_fallback_q50 && !quiet)
        fprintf(stderr, "lockstep quantize: %d tensor(s) with rows that are not whole 256-blocks get Q5_0 "
                        "(llama-quantize would write IQ4_NL, which lockstep cannot)\n", qs.n_fallback_q50);

    lk_gguf_writer *w = NULL;
    if (lk_gguf_writer_open(out, &w, err, sizeof err) != LK_OK) {
        fprintf(stderr, "lockstep quantize: %s\n", err);
        free(qt);
        lk_gguf_close(g);
        return 1;
    }
    for (int64_t i = 0; i < lk_gguf_n_kv(g); i++) lk_gguf_writer_copy_kv(w, g, i);
    lk_gguf_writer_set_u32(w, "general.quantization_version", 2);
    lk_gguf_writer_set_u32(w, "general.file_type", spec->ftype);
    for (int64_t i = 0; i < nt; i++) lk_gguf_writer_add_tensor(w, qt[i].src->name, qt[i].type, qt[i].src->n_dims, qt[i].src->ne);
    lk_status st = lk_gguf_writer_begin_data(w, err, sizeof err);

    /* Work goes in units: a tensor copied verbatim (written straight from the
     * mapping) or a chunk of about 16 MB of converted rows. A two-stage
     * pipeline: while the threads convert one unit into buf[cur], this thread
     * writes the previous unit, so conversion and disk writes overlap. */
    enum { CHUNK = 16 << 20 };
    int nth = (int)threads;
    uint8_t *buf[2];
    for (int k = 0; k < 2; k++) buf[k] = lk_xmalloc_aligned(CHUNK + max_ne0 * sizeof(float)); /* >= one output row */
    float *scratch = lk_xmalloc_aligned((size_t)nth * max_ne0 * sizeof(float));
    qjob *jobs = lk_xcalloc((size_t)nth, sizeof *jobs);
    pthread_t *tids = lk_xcalloc((size_t)nth, sizeof *tids);
    bool *running = lk_xcalloc((size_t)nth, sizeof *running);
    uint64_t done_in = 0, total_out = 0;
    double t0 = lk_time_s(), last = 0;
    const bool tty = isatty(STDERR_FILENO);
    const void *prev = NULL; /* the previous unit's output, waiting to be written */
    uint64_t prev_n = 0, prev_in = 0;
    int cur = 0;
    int64_t i = 0;
    uint64_t r0 = 0;
    while (!st) {
        const void *next = NULL;
        uint64_t next_n = 0, next_in = 0;
        if (i < nt) {
            const lk_gguf_tensor *t = qt[i].src;
            if (qt[i].type == t->type) {
                next = t->data;
                next_n = next_in = t->nbytes;
                i++;
            } else {
                size_t in_rb, out_rb;
                LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &in_rb));
                LK_ASSERT(lk_type_row_bytes(qt[i].type, (int64_t)t->ne[0], &out_rb));
                uint64_t rows = t->n_elements / t->ne[0];
                uint64_t r1 = LK_MIN(rows, r0 + LK_MAX(1, CHUNK / out_rb)), nr = r1 - r0;
                int use = (int)LK_MIN((uint64_t)nth, nr);
                for (int k = 0; k < use; k++) {
                    uint64_t a = r0 + nr * (uint64_t)k / (uint64_t)use, b = r0 + nr * (uint64_t)(k + 1) / (uint64_t)use;
                    jobs[k] = (qjob){t, qt[i].type, a, b, in_rb, out_rb, buf[cur] + (a - r0) * out_rb,
                                     scratch + (size_t)k * max_ne0};
                    running[k] = pthread_create(&tids[k], NULL, run_qjob, &jobs[k]) == 0;
                    if (!running[k]) run_qjob(&jobs[k]); /* no thread: do it here */
                }
                for (int k = use; k < nth; k++) running[k] = false;
                next = buf[cur];
                next_n = nr * out_rb;
                next_in = nr * in_rb;
                cur ^= 1;
                r0 = r1;
                if (r0 == rows) { i++; r0 = 0; }
            }
        }
        if (prev) st = lk_gguf_writer_write(w, prev, prev_n, err, sizeof err);
        for (int k = 0; k < nth; k++)
            if (running[k]) { pthread_join(tids[k], NULL); running[k] = false; }
        total_out += prev_n;
        done_in += prev_in;
        if (!next) break;
        prev = next, prev_n = next_n, prev_in = next_in;
        double now = lk_time_s();
        /* a terminal's line is rewritten 4 times a second; a log gets a line every 5 s */
        if (!quiet && now - last > (tty ? 0.25 : 5.0)) {
            last = now;
            fprintf(stderr, "%squantize: %5.1f%%  %8.1f / %.1f MB read %s", tty ? "\r" : "",
                    100.0 * (double)done_in / (double)total_in, (double)done_in / 1e6, (double)total_in / 1e6,
                    tty ? "" : "\n");
        }
    }
    if (!quiet && !st && last > 0) /* close the progress line at 100 % */
        fprintf(stderr, "%squantize: %5.1f%%  %8.1f / %.1f MB read \n", tty ? "\r" : "", 100.0, (double)done_in / 1e6,
                (double)total_in / 1e6);
    free(running);
    free(buf[0]);
    free(buf[1]);
    free(scratch);
    free(jobs);
    free(tids);
    if (!st) st = lk_gguf_writer_close(w, err, sizeof err);
    else lk_gguf_writer_abort(w);
    if (st) {
        if (!quiet && tty && last > 0) fprintf(stderr, "\n");
        fprintf(stderr, "lockstep quantize: %s\n", err);
        free(qt);
        lk_gguf_close(g);
        return 1;
    }
    if (!quiet) {
        int64_t counts[LK_TYPE_COUNT] = {0};
        for (int64_t i = 0; i < nt; i++) counts[qt[i].type < LK_TYPE_COUNT ? qt[i].type : 0]++;
        fprintf(stderr, "%swrote %s: %.1f MB -> %.1f MB in %.2f s;", tty ? "\r" : "", out, (double)total_in / 1e6, (double)total_out / 1e6,
                lk_time_s() - t0);
        for (int ty = 0; ty < LK_TYPE_COUNT; ty++)
            if (counts[ty]) fprintf(stderr, " %s %" PRId64, lk_type_name((uint32_t)ty), counts[ty]);
        fprintf(stderr, "\n");
    }
    free(qt);
    lk_gguf_close(g);
    return 0;
}
