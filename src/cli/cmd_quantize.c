/* lockstep quantize — rewrite a GGUF with its 2-D weights in q8_0 or q4_0.
 *
 * Follows llama-quantize's choices for these two types, so the result is what
 * llama.cpp users expect (for an F32 source it is byte-identical to
 * llama-quantize's output):
 *   - 2-D (and higher) "*weight" tensors whose rows are whole 32-blocks are
 *     converted (dequantised to F32 first, then lk_quantize_row); the MoE
 *     router (ffn_gate_inp) is never quantised;
 *   - a quantisable weight whose row is not whole blocks becomes F16;
 *   - the output projection (output.weight, or token_embd.weight when the
 *     embeddings are tied) stays at higher precision: llama.cpp gives it Q6_K
 *     (Q8_0 when rows are not 256-multiples); lockstep writes Q8_0;
 *   - everything else (norms, biases, 1-D) is copied verbatim;
 *   - every key/value is copied in order, then general.quantization_version = 2
 *     and general.file_type (Q8_0 = 7, Q4_0 = 2) are set;
 *   - tensors are written in llama.cpp's order: tensors outside blocks first,
 *     then block by block (by layer number), by name within each. */
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "quant/quant.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* The output type of one tensor (see the file comment). */
static uint32_t choose_type(const lk_gguf *g, const lk_gguf_tensor *t, lk_type target) {
    bool quantisable = t->n_dims >= 2 && ends_with(t->name, "weight") && !strstr(t->name, "ffn_gate_inp.weight");
    if (!quantisable) return t->type;
    bool is_output = !strcmp(t->name, "output.weight") ||
                     (!strcmp(t->name, "token_embd.weight") && !lk_gguf_find_tensor(g, "output.weight"));
    lk_type want = is_output ? LK_TYPE_Q8_0 : target;
    if (t->ne[0] % (uint64_t)lk_type_block_size(want)) want = LK_TYPE_F16;
    return want;
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
    int64_t threads = 0;
    bool quiet = false;
    const lk_opt opts[] = {
        {"--type", NULL, LK_OPT_STR, &type_name, "TYPE", "q8_0 or q4_0 (required)"},
        {"--threads", "-t", LK_OPT_INT, &threads, "N", "converter threads (default: CPUs, at most 16)"},
        {"--quiet", "-q", LK_OPT_FLAG, &quiet, NULL, "no progress line"},
        {0},
    };
    const char *pos[2];
    int np = lk_args_parse("quantize", "IN.gguf OUT.gguf --type q8_0|q4_0", opts, argc, argv, pos, 2);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (np != 2) {
        fprintf(stderr, "lockstep quantize: need an input and an output file (usage: lockstep quantize IN OUT --type q8_0|q4_0)\n");
        return 2;
    }
    lk_type target;
    if (!type_name || !lk_type_from_name(type_name, &target) || (target != LK_TYPE_Q8_0 && target != LK_TYPE_Q4_0)) {
        fprintf(stderr, "lockstep quantize: --type must be q8_0 or q4_0 (got '%s')\n", type_name ? type_name : "nothing");
        return 2;
    }
    if (threads < 0 || threads > 256) {
        fprintf(stderr, "lockstep quantize: --threads must be 1..256 (got %" PRId64 ")\n", threads);
        return 2;
    }
    if (!threads) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        threads = nc < 1 ? 1 : nc > 16 ? 16 : nc;
    }
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
        qt[i] = (qtensor){t, choose_type(g, t, target), layer_of(t->name)};
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
    qsort(qt, (size_t)nt, sizeof *qt, cmp_order);

    lk_gguf_writer *w = NULL;
    if (lk_gguf_writer_open(out, &w, err, sizeof err) != LK_OK) {
        fprintf(stderr, "lockstep quantize: %s\n", err);
        free(qt);
        lk_gguf_close(g);
        return 1;
    }
    for (int64_t i = 0; i < lk_gguf_n_kv(g); i++) lk_gguf_writer_copy_kv(w, g, i);
    lk_gguf_writer_set_u32(w, "general.quantization_version", 2);
    lk_gguf_writer_set_u32(w, "general.file_type", target == LK_TYPE_Q8_0 ? 7 : 2);
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
        if (!quiet && now - last > 0.25) {
            last = now;
            fprintf(stderr, "\rquantize: %5.1f%%  %8.1f / %.1f MB read ", 100.0 * (double)done_in / (double)total_in,
                    (double)done_in / 1e6, (double)total_in / 1e6);
        }
    }
    if (!quiet && !st && last > 0) /* close the progress line at 100 % */
        fprintf(stderr, "\rquantize: %5.1f%%  %8.1f / %.1f MB read \n", 100.0, (double)done_in / 1e6, (double)total_in / 1e6);
    free(running);
    free(buf[0]);
    free(buf[1]);
    free(scratch);
    free(jobs);
    free(tids);
    if (!st) st = lk_gguf_writer_close(w, err, sizeof err);
    else lk_gguf_writer_abort(w);
    if (st) {
        if (!quiet) fprintf(stderr, "\n");
        fprintf(stderr, "lockstep quantize: %s\n", err);
        free(qt);
        lk_gguf_close(g);
        return 1;
    }
    if (!quiet) {
        int64_t counts[LK_TYPE_COUNT] = {0};
        for (int64_t i = 0; i < nt; i++) counts[qt[i].type < LK_TYPE_COUNT ? qt[i].type : 0]++;
        fprintf(stderr, "\rwrote %s: %.1f MB -> %.1f MB in %.2f s;", out, (double)total_in / 1e6, (double)total_out / 1e6,
                lk_time_s() - t0);
        for (int ty = 0; ty < LK_TYPE_COUNT; ty++)
            if (counts[ty]) fprintf(stderr, " %s %" PRId64, lk_type_name((uint32_t)ty), counts[ty]);
        fprintf(stderr, "\n");
    }
    free(qt);
    lk_gguf_close(g);
    return 0;
}
