/* Tool calls through the server, end to end with the official openai
 * client: a synthetic model that, after the opening of an assistant turn,
 * always writes one Hermes-style tool call, with the Qwen2.5 chat template
 * (which renders `tools` into the system prompt).
 *
 * The model is made here, not trained: a byte-level BPE vocabulary (the 256
 * byte tokens, <|im_start|>, <|im_end|> and four whole pieces of a tool
 * call), one layer whose attention and feed-forward weights are zero (so the
 * residual stream stays the current token's embedding), one-hot embeddings,
 * and an output matrix that maps each token to a chosen successor: "\n" ->
 * "<tool_call>\n" -> {"name": ..., "arguments": ...} -> "\n</tool_call>" ->
 * <|im_end|>; every other token -> "a". So the reply is known exactly, and
 * what is tested is the server: the template with tools, the parse into
 * tool_calls, finish_reason, the held-back stream, and plain content when
 * the request has no tools. */
#include "lk_test.h"
#include "gguf/gguf.h"
#include "quant/quant.h"
#include "server/server.h"
#include "tokenizer/chat_template.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define E 264   /* embedding width (>= vocabulary) */
#define FF 8

static const char *CHAIN[4] = { "<tool_call>\n", "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
                                "\n</tool_call>", NULL };

/* GPT-2's byte -> code point table, as UTF-8 text of one byte */
static void byte_text(int b, char *out) {
    int cp;
    if ((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) cp = b;
    else {
        int n = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= '!' && x <= '~') || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff))) n++;
        cp = 256 + n;
    }
    if (cp < 0x80) { out[0] = (char)cp; out[1] = 0; }
    else { out[0] = (char)(0xc0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3f)); out[2] = 0; }
}

static char *encoded(const char *s) {
    char *o = malloc(strlen(s) * 2 + 1), b[4];
    o[0] = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        byte_text(*p, b);
        strcat(o, b);
    }
    return o;
}

static bool write_model(const char *path) {
    enum { NB = 256, IM_START = 256, IM_END = 257, T0 = 258, V = 261 };
    char *tok[V];
    int32_t type[V];
    for (int b = 0; b < NB; b++) {
        char t[4];
        byte_text(b, t);
        tok[b] = strdup(t);
        type[b] = 1;
    }
    tok[IM_START] = strdup("<|im_start|>");
    tok[IM_END] = strdup("<|im_end|>");
    type[IM_START] = type[IM_END] = 3;
    for (int i = 0; i < 3; i++) {
        tok[T0 + i] = encoded(CHAIN[i]);
        type[T0 + i] = 1;
    }
    int succ[V];
    for (int i = 0; i < V; i++) succ[i] = 'a';
    succ['\n'] = T0;
    succ[T0] = T0 + 1;
    succ[T0 + 1] = T0 + 2;
    succ[T0 + 2] = IM_END;
    char err[256];
    lk_gguf_writer *w;
    if (lk_gguf_writer_open(path, &w, err, sizeof err)) return false;
    lk_gguf_writer_set_str(w, "general.architecture", "llama");
    lk_gguf_writer_set_str(w, "general.name", "tool-echo");
    lk_gguf_writer_set_u32(w, "llama.context_length", 4096);
    lk_gguf_writer_set_u32(w, "llama.embedding_length", E);
    lk_gguf_writer_set_u32(w, "llama.block_count", 1);
    lk_gguf_writer_set_u32(w, "llama.feed_forward_length", FF);
    lk_gguf_writer_set_u32(w, "llama.attention.head_count", 2);
    lk_gguf_writer_set_u32(w, "llama.attention.head_count_kv", 2);
    lk_gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    lk_gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f);
    lk_gguf_writer_set_u32(w, "llama.rope.dimension_count", E / 2);
    lk_gguf_writer_set_u32(w, "llama.vocab_size", V);
    lk_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    lk_gguf_writer_set_str(w, "tokenizer.ggml.pre", "qwen2");
    lk_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tok, V);
    lk_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", type, V);
    lk_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", NULL, 0);
    lk_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", IM_END);
    lk_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", IM_END);
    lk_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false);
    const char *tmpl = NULL;
    if (lk_chat_template_select("qwen2", NULL, &tmpl, err, sizeof err)) { lk_gguf_writer_abort(w); return false; }
    lk_gguf_writer_set_str(w, "tokenizer.chat_template", tmpl);
    struct { const char *name; int64_t ne0, ne1; } ts[] = {
        { "token_embd.weight", E, V }, { "output_norm.weight", E, 1 }, { "output.weight", E, V },
        { "blk.0.attn_norm.weight", E, 1 }, { "blk.0.attn_q.weight", E, E }, { "blk.0.attn_k.weight", E, E },
        { "blk.0.attn_v.weight", E, E }, { "blk.0.attn_output.weight", E, E }, { "blk.0.ffn_norm.weight", E, 1 },
        { "blk.0.ffn_gate.weight", E, FF }, { "blk.0.ffn_up.weight", E, FF }, { "blk.0.ffn_down.weight", FF, E },
    };
    int nt = (int)(sizeof ts / sizeof ts[0]);
    for (int i = 0; i < nt; i++) {
        uint64_t ne[2] = { (uint64_t)ts[i].ne0, (uint64_t)ts[i].ne1 };
        lk_gguf_writer_add_tensor(w, ts[i].name, LK_TYPE_F32, ts[i].ne1 == 1 ? 1 : 2, ne);
    }
    bool ok = !lk_gguf_writer_begin_data(w, err, sizeof err);
    for (int i = 0; ok && i < nt; i++) {
        size_t n = (size_t)(ts[i].ne0 * ts[i].ne1);
        float *d = calloc(n, sizeof(float));
        if (strstr(ts[i].name, "norm")) for (size_t k = 0; k < n; k++) d[k] = 1;
        if (!strcmp(ts[i].name, "token_embd.weight")) for (int t = 0; t < V; t++) d[(size_t)t * E + t] = 1;
        if (!strcmp(ts[i].name, "output.weight")) for (int t = 0; t < V; t++) d[(size_t)succ[t] * E + t] = 1;
        ok = !lk_gguf_writer_write(w, d, n * sizeof(float), err, sizeof err);
        free(d);
    }
    ok = ok && !lk_gguf_writer_close(w, err, sizeof err);
    if (!ok) printf("  writing %s: %s\n", path, err);
    for (int i = 0; i < V; i++) free(tok[i]);
    return ok;
}

static char g_model[256];

TEST(tool_calls_with_openai_client) {
    snprintf(g_model, sizeof g_model, "/tmp/lk-tool-echo-%d.gguf", (int)getpid());
    CHECK(write_model(g_model));
    if (access("tests/server/node_modules/openai", F_OK) &&
        system("npm ci --silent --no-audit --no-fund --prefix tests/server >/dev/null 2>&1")) {
        printf("  npm ci --prefix tests/server failed (the openai package is needed)\n");
        CHECK(false);
        return;
    }
    lk_server_opts o;
    lk_server_opts_default(&o);
    o.port = 0;
    o.parallel = 2;
    o.eo.model_path = g_model;
    o.eo.n_threads = 1;
    o.eo.n_ctx = 4096;
    o.defaults.temp = 0;
    lk_server *s = NULL;
    int port = 0;
    char err[512];
    lk_status st = lk_server_start(&o, &s, &port, err, sizeof err);
    CHECKF(st == LK_OK, "%s", err);
    if (st) return;
    st = lk_server_wait_ready(s, err, sizeof err);
    CHECKF(st == LK_OK, "%s", err);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "node tests/server/tools.mjs http://127.0.0.1:%d/v1", port);
    fflush(stdout);
    int rc = system(cmd);
    CHECKF(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "tools.mjs exit %d", rc);
    lk_server_stop(s);
    unlink(g_model);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    RUN(tool_calls_with_openai_client);
    return lk_test_end();
}
