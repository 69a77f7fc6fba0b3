/* seedgen — writes the fuzzers' seed corpora from the test data, so that no
 * corpus is kept in the repository: `make fuzz` runs it into
 * $(B)/fuzz/seeds/<harness>/.
 *
 *   seedgen OUTDIR [TESTDATA...]
 *
 * TESTDATA folders (default: testdata, the in-repo set, then $LK_TESTDATA or
 * ../shared/testdata when present) are searched for GGUF files under
 * models/, vocab/ and synth/. From them:
 *   gguf/           small GGUFs: every file's metadata with its vocabulary
 *                   cut to 600 tokens and no tensors, and two whole small
 *                   llama models (F32 and Q8_0) built from stories260K's
 *                   metadata with one layer and tiny shapes, which pass the
 *                   configuration check and load their tokenizer
 *   chat_template/  the built-in templates and every template a GGUF carries
 *   wire/           frames (header + payload) of every session message,
 *                   made by proto.c's own encoders, singly and as a stream
 *   handshake/      scripts (see fuzz_handshake.c) of complete handshakes in
 *                   both roles and every seal mode, and of a keyless peer
 *   step/           step bodies (see fuzz_step.c): settings, prefill, decode,
 *                   keep, fork, end of session
 *   http/           request bodies (see fuzz_http.c): chat with every
 *                   sampling field, stops, logprobs, tools and a tool-call
 *                   history, completions from text and from token ids, and
 *                   model replies holding tool calls in both forms */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cluster/cluster.h"
#include "cluster/proto.h"
#include "gguf/gguf.h"
#include "quant/quant.h"
#include "step/step.h"
#include "tokenizer/chat_template.h"

static const char *g_out;
static int g_count;

static void mkdirs(const char *sub) {
    char p[4096];
    snprintf(p, sizeof p, "%s", g_out);
    mkdir(p, 0777);
    snprintf(p, sizeof p, "%s/%s", g_out, sub);
    mkdir(p, 0777);
}

static void put(const char *sub, const char *name, const void *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/%s", g_out, sub, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f)) { fprintf(stderr, "seedgen: %s: %s\n", path, strerror(errno)); exit(1); }
    g_count++;
}

/* ---- GGUF ----------------------------------------------------------------- */

#define KEEP_TOKENS 600
#define KEEP_MERGES 300

/* Copies g's metadata, arrays cut to KEEP_TOKENS (merges to KEEP_MERGES). */
static void copy_kvs_cut(lk_gguf_writer *w, const lk_gguf *g) {
    for (int64_t i = 0; i < lk_gguf_n_kv(g); i++) {
        const char *key = lk_gguf_kv_key(g, i);
        lk_gguf_vtype et;
        uint64_t n;
        if (!lk_gguf_get_arr(g, key, &et, &n) || n <= KEEP_TOKENS) { lk_gguf_writer_copy_kv(w, g, i); continue; }
        uint64_t k = strstr(key, "merges") ? KEEP_MERGES : KEEP_TOKENS;
        if (et == LK_GGUF_STRING) {
            char **s = calloc(k, sizeof *s);
            for (uint64_t j = 0; j < k; j++) {
                size_t l;
                const char *p = lk_gguf_arr_str(g, key, j, &l);
                s[j] = strndup(p, l);
            }
            lk_gguf_writer_set_arr_str(w, key, (const char *const *)s, k);
            for (uint64_t j = 0; j < k; j++) free(s[j]);
            free(s);
        } else if (et == LK_GGUF_FLOAT32) {
            float *v = malloc(k * sizeof *v);
            for (uint64_t j = 0; j < k; j++) v[j] = (float)lk_gguf_arr_f64(g, key, j);
            lk_gguf_writer_set_arr_f32(w, key, v, k);
            free(v);
        } else if (et == LK_GGUF_INT32 || et == LK_GGUF_UINT32) {
            int32_t *v = malloc(k * sizeof *v);
            for (uint64_t j = 0; j < k; j++) v[j] = (int32_t)lk_gguf_arr_i64(g, key, j);
            lk_gguf_writer_set_arr_i32(w, key, v, k);
            free(v);
        } /* other large arrays are left out */
    }
}

static void gguf_cut(const char *path, const char *name) {
    lk_gguf *g;
    char err[LK_ERRLEN], out[4096];
    if (lk_gguf_open(path, &g, err, sizeof err)) { fprintf(stderr, "seedgen: %s\n", err); return; }
    snprintf(out, sizeof out, "%s/gguf/%s", g_out, name);
    lk_gguf_writer *w;
    if (lk_gguf_writer_open(out, &w, err, sizeof err)) { fprintf(stderr, "seedgen: %s\n", err); exit(1); }
    copy_kvs_cut(w, g);
    if (lk_gguf_writer_begin_data(w, err, sizeof err) || lk_gguf_writer_close(w, err, sizeof err)) {
        fprintf(stderr, "seedgen: %s\n", err);
        exit(1);
    }
    g_count++;
    /* the template it carries, if any */
    const char *t;
    size_t tl;
    if (lk_gguf_get_str(g, "tokenizer.chat_template", &t, &tl)) put("chat_template", name, t, tl);
    lk_gguf_close(g);
}

static uint32_t rng = 12345;
static uint32_t next_rand(void) { rng = rng * 1664525u + 1013904223u; return rng >> 8; }

/* One-layer llama with stories260K's metadata (tokenizer included), shaped
 * n_embd / n_ff, heads of 4: F32, or Q8_0 for the matrices (n_embd and n_ff
 * multiples of 32). */
static void mini_llama(const char *src, const char *name, uint32_t wtype, int n_embd, int n_ff) {
    lk_gguf *g;
    char err[LK_ERRLEN], out[4096];
    if (lk_gguf_open(src, &g, err, sizeof err)) { fprintf(stderr, "seedgen: %s\n", err); return; }
    int64_t n_vocab = 0;
    lk_gguf_vtype et;
    uint64_t nv;
    if (lk_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &nv)) n_vocab = (int64_t)nv;
    snprintf(out, sizeof out, "%s/gguf/%s", g_out, name);
    lk_gguf_writer *w;
    if (lk_gguf_writer_open(out, &w, err, sizeof err)) { fprintf(stderr, "seedgen: %s\n", err); exit(1); }
    for (int64_t i = 0; i < lk_gguf_n_kv(g); i++) lk_gguf_writer_copy_kv(w, g, i);
    const int n_head = n_embd / 4, n_head_kv = n_head / 2, kv = n_head_kv * 4;
    lk_gguf_writer_set_u32(w, "llama.embedding_length", (uint32_t)n_embd);
    lk_gguf_writer_set_u32(w, "llama.feed_forward_length", (uint32_t)n_ff);
    lk_gguf_writer_set_u32(w, "llama.block_count", 1);
    lk_gguf_writer_set_u32(w, "llama.attention.head_count", (uint32_t)n_head);
    lk_gguf_writer_set_u32(w, "llama.attention.head_count_kv", (uint32_t)n_head_kv);
    lk_gguf_writer_set_u32(w, "llama.rope.dimension_count", 4);
    struct { const char *name; int64_t ne0, ne1; } t[] = {
        {"token_embd.weight", n_embd, n_vocab}, {"output_norm.weight", n_embd, 1}, {"output.weight", n_embd, n_vocab},
        {"blk.0.attn_norm.weight", n_embd, 1}, {"blk.0.attn_q.weight", n_embd, n_embd},
        {"blk.0.attn_k.weight", n_embd, kv}, {"blk.0.attn_v.weight", n_embd, kv},
        {"blk.0.attn_output.weight", n_embd, n_embd}, {"blk.0.ffn_norm.weight", n_embd, 1},
        {"blk.0.ffn_gate.weight", n_embd, n_ff}, {"blk.0.ffn_up.weight", n_embd, n_ff},
        {"blk.0.ffn_down.weight", n_ff, n_embd},
    };
    const int nt = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < nt; i++) {
        uint64_t ne[2] = {(uint64_t)t[i].ne0, (uint64_t)t[i].ne1};
        lk_gguf_writer_add_tensor(w, t[i].name, t[i].ne1 == 1 ? LK_TYPE_F32 : wtype, t[i].ne1 == 1 ? 1 : 2, ne);
    }
    if (lk_gguf_writer_begin_data(w, err, sizeof err)) { fprintf(stderr, "seedgen: %s\n", err); exit(1); }
    for (int i = 0; i < nt; i++) {
        int64_t n = t[i].ne0 * t[i].ne1;
        if (t[i].ne1 == 1 || wtype == LK_TYPE_F32) {
            float *v = malloc((size_t)n * sizeof *v);
            for (int64_t j = 0; j < n; j++) v[j] = t[i].ne1 == 1 ? 1.0f : ((float)(next_rand() % 2001) - 1000.0f) / 4000.0f;
            lk_gguf_writer_write(w, v, (size_t)n * sizeof *v, err, sizeof err);
            free(v);
        } else { /* Q8_0 blocks: f16 scale, 32 int8 */
            size_t nb = (size_t)n / 32;
            uint8_t *b = malloc(nb * 34);
            for (size_t j = 0; j < nb; j++) {
                uint16_t d = lk_fp32_to_fp16(0.002f);
                memcpy(b + j * 34, &d, 2);
                for (int q = 0; q < 32; q++) b[j * 34 + 2 + q] = (uint8_t)next_rand();
            }
            lk_gguf_writer_write(w, b, nb * 34, err, sizeof err);
            free(b);
        }
    }
    if (lk_gguf_writer_close(w, err, sizeof err)) { fprintf(stderr, "seedgen: %s\n", err); exit(1); }
    g_count++;
    lk_gguf_close(g);
}

static void gguf_dir(const char *td, const char *sub, const char **stories) {
    char d[4096];
    snprintf(d, sizeof d, "%s/%s", td, sub);
    DIR *dir = opendir(d);
    if (!dir) return;
    struct dirent *e;
    while ((e = readdir(dir))) {
        size_t l = strlen(e->d_name);
        if (l < 6 || strcmp(e->d_name + l - 5, ".gguf")) continue;
        char p[8192], name[512];
        snprintf(p, sizeof p, "%s/%s", d, e->d_name);
        snprintf(name, sizeof name, "cut-%s", e->d_name);
        gguf_cut(p, name);
        if (!*stories && !strcmp(e->d_name, "stories260K.gguf")) *stories = strdup(p);
    }
    closedir(dir);
}

/* ---- wire ----------------------------------------------------------------- */

static uint32_t frame(uint8_t *out, uint16_t type, uint64_t seq, const void *pl, uint32_t n) {
    lk_frame_hdr h = {.magic = LK_WIRE_MAGIC, .version = LK_WIRE_VERSION, .type = type, .len = n, .seq = seq};
    lk_wire_encode_hdr(&h, out);
    memcpy(out + LK_WIRE_HDR, pl, n);
    return LK_WIRE_HDR + n;
}

static void wire_seeds(void) {
    static uint8_t pl[8][4096], stream[65536];
    uint32_t n[8];
    uint16_t types[8];
    lk_load_msg lm = {.rank = 1, .n_ranks = 2, .tp = 2, .n_ctx = 512, .n_batch = 64, .n_threads = 2, .max_seqs = 4,
                      .kv_tokens = 2048, .slice = {.tp_rank = 1, .tp_size = 2, .pp_rank = 0, .pp_size = 1, .layer0 = 0,
                      .layer1 = 5, .head0 = 4, .head1 = 8, .kv_head0 = 2, .kv_head1 = 4, .ff0 = 86, .ff1 = 172,
                      .vocab0 = 256, .vocab1 = 512}};
    snprintf(lm.model_name, sizeof lm.model_name, "stories260K.gguf");
    snprintf(lm.model_path, sizeof lm.model_path, "/models/stories260K.gguf");
    types[0] = LK_MSG_LOAD; n[0] = lk_proto_load_encode(&lm, pl[0], sizeof pl[0]);
    lk_loaded_msg ld = {.ok = 1};
    snprintf(ld.mesh_addr, sizeof ld.mesh_addr, "127.0.0.1:7071");
    types[1] = LK_MSG_LOADED; n[1] = lk_proto_loaded_encode(&ld, pl[1], sizeof pl[1]);
    lk_mesh_msg mm = {.n = 3};
    for (int i = 0; i < 3; i++) snprintf(mm.addrs[i], LK_ADDR_LEN, "10.0.0.%d:7070", i + 1);
    types[2] = LK_MSG_MESH; n[2] = lk_proto_mesh_encode(&mm, pl[2], sizeof pl[2]);
    lk_bench_msg bm = {.rank = 1, .n_ranks = 2, .spin_ns = -1, .cfg = {.sizes = {4096, 65536}, .nsizes = 2, .iters = 10}};
    types[3] = LK_MSG_BENCH; n[3] = lk_proto_bench_encode(&bm, pl[3], sizeof pl[3]);
    lk_file_msg fm = {.size = 1185376, .header_len = 14176, .n_bytes = 600000, .disk = 606208, .n_ranges = 40};
    types[4] = LK_MSG_FILE; n[4] = lk_proto_file_encode(&fm, pl[4], sizeof pl[4]);
    types[5] = LK_MSG_ERROR; n[5] = (uint32_t)snprintf((char *)pl[5], 4096, "model mismatch: head has 3f2a91c0, worker has 9bc1d2e4");
    types[6] = LK_MSG_PING; n[6] = 8; memset(pl[6], 7, 8);
    types[7] = LK_MSG_READY; n[7] = 1; pl[7][0] = 1;
    uint32_t sl = 0;
    for (int i = 0; i < 8; i++) {
        uint8_t one[4096 + LK_WIRE_HDR];
        char name[32];
        uint32_t fl = frame(one, types[i], 0, pl[i], n[i]);
        snprintf(name, sizeof name, "%s", lk_msg_name(types[i]));
        put("wire", name, one, fl);
        snprintf(name, sizeof name, "%s.payload", lk_msg_name(types[i]));
        put("wire", name, pl[i], n[i]); /* the raw input is decoded as a payload too */
        sl += frame(stream + sl, types[i], (uint64_t)i, pl[i], n[i]);
    }
    put("wire", "stream", stream, sl);
}

/* ---- handshake scripts ---------------------------------------------------- */

static void hs_seeds(void) {
    for (int role = 0; role < 2; role++)
        for (int seal = 0; seal < 3; seal++) {
            uint8_t s[256];
            size_t n = 0;
            s[n++] = (uint8_t)(role | seal << 1 | 1 << 3);
            s[n++] = 2; s[n++] = 32;                          /* HELLO */
            for (int i = 0; i < 32; i++) s[n++] = (uint8_t)(i * 7 + role);
            s[n++] = 3; s[n++] = 0;                           /* AUTH, right proof */
            s[n++] = 4; s[n++] = 0;                           /* INFO, as lockstep's own */
            s[n++] = 8; s[n++] = 1; s[n++] = 1;               /* VERDICT ok, right MAC */
            s[n++] = 0; s[n++] = 16;                          /* a sealed check record's worth of bytes */
            for (int i = 0; i < 16; i++) s[n++] = (uint8_t)i;
            char name[32];
            snprintf(name, sizeof name, "ok-%s-seal%d", role ? "head" : "worker", seal);
            put("handshake", name, s, n);
        }
    /* a peer without the key: HELLO, then a made-up proof */
    uint8_t s[128];
    size_t n = 0;
    s[n++] = 0;
    s[n++] = 2; s[n++] = 32;
    for (int i = 0; i < 32; i++) s[n++] = (uint8_t)i;
    s[n++] = 1; s[n++] = 33; s[n++] = LK_MSG_AUTH;
    for (int i = 0; i < 32; i++) s[n++] = 0xaa;
    put("handshake", "keyless", s, n);
    /* a peer of another version: an ERROR frame first */
    n = 0;
    s[n++] = 1;
    s[n++] = 1; s[n++] = 20; s[n++] = LK_MSG_ERROR;
    memcpy(s + n, "version 2 refused\x01\x1b", 19); n += 19;
    put("handshake", "error", s, n);
}

/* ---- step bodies ---------------------------------------------------------- */

typedef struct { uint8_t b[4096]; size_t n; } buf;
static void u32(buf *b, uint32_t v) { for (int i = 0; i < 4; i++) b->b[b->n++] = (uint8_t)(v >> (8 * i)); }
static void f32(buf *b, float f) { uint32_t u; memcpy(&u, &f, 4); u32(b, u); }
static void u64(buf *b, uint64_t v) { u32(b, (uint32_t)v); u32(b, (uint32_t)(v >> 32)); }
static void params_op(buf *b, int seq, float temp, int top_k) {
    u32(b, LK_STEP_OP_PARAMS); u32(b, (uint32_t)seq); u32(b, 0); u32(b, 0);
    f32(b, temp); u32(b, (uint32_t)top_k); f32(b, 0.95f); f32(b, 0.05f); f32(b, 1.1f); f32(b, 0.0f); f32(b, 0.0f);
    u32(b, 64); u64(b, 42);
}
static void plain_op(buf *b, int kind, int seq, int a, int bb) {
    u32(b, (uint32_t)kind); u32(b, (uint32_t)seq); u32(b, (uint32_t)a); u32(b, (uint32_t)bb);
    for (int i = 0; i < 8; i++) u32(b, 0);
    u64(b, 0);
}
/* One body, with its u16 length in front, onto the seed. */
static void body(buf *seed, const buf *b) {
    seed->b[seed->n++] = (uint8_t)b->n;
    seed->b[seed->n++] = (uint8_t)(b->n >> 8);
    memcpy(seed->b + seed->n, b->b, b->n);
    seed->n += b->n;
}

static void step_seeds(void) {
    static const int32_t prompt[] = {1, 403, 407, 261, 378};
    buf seed = {.n = 0}, b;
    /* settings + prefill of slot 0, then a decode step, then keep and fork */
    b.n = 0;
    u32(&b, 1); u32(&b, 1); u32(&b, 5); u32(&b, 0);
    params_op(&b, 0, 0.0f, 1);
    u32(&b, 0); u32(&b, 0); u32(&b, 5); u32(&b, 1);
    for (int i = 0; i < 5; i++) u32(&b, (uint32_t)prompt[i]);
    body(&seed, &b);
    put("step", "prefill", seed.b, seed.n);
    b.n = 0;
    u32(&b, 0); u32(&b, 1); u32(&b, 1); u32(&b, 0);
    u32(&b, 0); u32(&b, 5); u32(&b, 1); u32(&b, 1);
    u32(&b, 302);
    body(&seed, &b);
    put("step", "prefill-decode", seed.b, seed.n);
    b.n = 0;
    u32(&b, 3); u32(&b, 2); u32(&b, 2); u32(&b, 0);
    params_op(&b, 1, 0.8f, 40);
    plain_op(&b, LK_STEP_OP_FORK, 1, 0, 4);
    plain_op(&b, LK_STEP_OP_KEEP, 0, 3, 0);
    u32(&b, 0); u32(&b, 3); u32(&b, 1); u32(&b, 1);
    u32(&b, 1); u32(&b, 4); u32(&b, 1); u32(&b, 1);
    u32(&b, 261); u32(&b, 378);
    body(&seed, &b);
    put("step", "prefill-decode-fork-keep", seed.b, seed.n);
    b.n = 0;
    u32(&b, 0); u32(&b, 0); u32(&b, 0); u32(&b, 1);
    seed.n = 0;
    body(&seed, &b);
    put("step", "end", seed.b, seed.n);
}

/* ---- programs for fuzz_step_ops (its input is choices, see there) --------------- */

static void step_ops_seeds(void) {
    /* message 1: PARAMS for slot 0 (typical settings), an item prefilling 4
     * tokens of slot 0 and sampling; message 2: one decode token at 4 */
    static const uint8_t prog[] = {
        1, 1,                                    /* 1 op, 1 item */
        0, 6, 0, 0, 0,                           /* PARAMS, seq 0, a 0, b 0 */
        0x46, 2, 0x46, 0x46, 0x46, 0, 0, 2,      /* temp, top_k 39, top_p, min_p, repeat, freq, presence, last_n 63 */
        1, 0, 0, 0, 7, 0, 0, 0,                  /* seed */
        6, 0, 0, 2, 1,                           /* item: seq 0, pos0 0, n 4, sample */
        0,                                       /* the token total the items give */
        6, 1, 6, 50, 6, 60, 6, 70,               /* 4 tokens */
        0,                                       /* not the end */
        0, 1,                                    /* message 2: 0 ops, 1 item */
        6, 0, 6, 4, 6, 1, 1,                     /* seq 0, pos0 4, n 1, sample */
        0, 6, 100, 0,
    };
    put("step_ops", "prefill-decode", prog, sizeof prog);
    put("step_ops", "empty", prog, 1);
}

/* ---- request bodies for fuzz_http (a settings byte, then the body) --------------- */

static void http_seed(const char *name, uint8_t mode, const char *body) {
    size_t n = strlen(body);
    uint8_t *b = malloc(n + 1);
    b[0] = mode;
    memcpy(b + 1, body, n);
    put("http", name, b, n + 1);
    free(b);
}

static void http_seeds(void) {
    http_seed("chat", 0, "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                         "{\"role\":\"user\",\"content\":\"Once upon a time\"}],\"max_tokens\":8,\"temperature\":0.7,"
                         "\"top_p\":0.9,\"top_k\":40,\"min_p\":0.05,\"seed\":7,\"presence_penalty\":0.5,"
                         "\"frequency_penalty\":0.2,\"stop\":[\"\\n\",\"The end\"],\"stream\":true,"
                         "\"stream_options\":{\"include_usage\":true},\"logprobs\":true,\"top_logprobs\":3}");
    http_seed("chat-parts", 0, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi \"},"
                               "{\"type\":\"text\",\"text\":\"there\"}]}],\"max_completion_tokens\":4,\"n\":1}");
    http_seed("chat-tools", 2, "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},"
                               "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
                               "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]},"
                               "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"18 C\"}],"
                               "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"d\","
                               "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}}],"
                               "\"tool_choice\":\"auto\",\"chat_template_kwargs\":{\"enable_thinking\":false}}");
    http_seed("completion", 1, "{\"model\":\"m\",\"prompt\":\"Once upon a time\",\"max_tokens\":16,\"echo\":false,"
                               "\"stop\":\"\\n\",\"logprobs\":2,\"ignore_eos\":true}");
    http_seed("completion-ids", 1, "{\"prompt\":[1,403,407,261],\"max_tokens\":2,\"temperature\":0}");
    http_seed("reply-hermes", 2, "Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
    http_seed("reply-llama3", 0, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": [1, 2, {\"y\": null}]}}");
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: seedgen OUTDIR [TESTDATA...]\n"); return 2; }
    lk_log_set_level(LK_LOG_ERROR);
    g_out = argv[1];
    mkdirs("gguf"); mkdirs("chat_template"); mkdirs("wire"); mkdirs("handshake"); mkdirs("step"); mkdirs("step_ops"); mkdirs("http");
    const char *dflt[2] = {"testdata", getenv("LK_TESTDATA") && *getenv("LK_TESTDATA") ? getenv("LK_TESTDATA") : "../shared/testdata"};
    const char **tds = argc > 2 ? (const char **)argv + 2 : dflt;
    int ntd = argc > 2 ? argc - 2 : 2;
    const char *stories = NULL;
    for (int i = 0; i < ntd; i++) {
        gguf_dir(tds[i], "models", &stories);
        gguf_dir(tds[i], "vocab", &stories);
        gguf_dir(tds[i], "synth", &stories);
    }
    if (stories) {
        mini_llama(stories, "mini-llama-f32.gguf", LK_TYPE_F32, 8, 16);
        mini_llama(stories, "mini-llama-q8_0.gguf", LK_TYPE_Q8_0, 32, 64);
    } else {
        fprintf(stderr, "seedgen: no stories260K.gguf under the test data: no whole-model GGUF seeds\n");
    }
    for (const char *names = lk_chat_template_names(); *names;) {
        const char *e = strchr(names, ',');
        size_t l = e ? (size_t)(e - names) : strlen(names);
        char name[64];
        snprintf(name, sizeof name, "builtin-%.*s", (int)l, names);
        const char *src = lk_chat_template_builtin(name + 8);
        if (src) put("chat_template", name, src, strlen(src));
        names += l;
        while (*names == ',' || *names == ' ') names++;
    }
    wire_seeds();
    hs_seeds();
    step_seeds();
    step_ops_seeds();
    http_seeds();
    printf("seedgen: %d seeds in %s\n", g_count, g_out);
    return 0;
}
