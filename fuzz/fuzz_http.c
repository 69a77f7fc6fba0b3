/* fuzz_http — what the server does with a request body from anyone, and with
 * the text a model writes.
 *
 * Input: one byte of settings, then the body. Bit 0 picks the endpoint
 * (chat or completions), bit 1 the template (ChatML, or Qwen 3's, which
 * renders `tools`). The body goes through the HTTP side's own parser
 * (srv_parse_request: JSON, every field's type and range, messages through
 * the chat template, the prompt through the tokenizer, limits against the
 * context), exactly as a POST's body does once it has arrived; a refusal
 * must come with a message. The same bytes are then read as model output:
 * tool-call extraction (Hermes and Llama 3 forms), where a call may start,
 * and the stop strings the request asked for (when it parsed), found and
 * held back as streaming does. The tokenizer is stories260K's (the
 * repository's testdata), loaded once. */
#include <assert.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"
#include "sampler/sampler.h"
#include "server/server_impl.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

static lk_server *g_srv[2]; /* ChatML, Qwen 3 */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    lk_log_set_level(LK_LOG_ERROR);
    const char *path = getenv("LK_FUZZ_MODEL") ? getenv("LK_FUZZ_MODEL") : "testdata/models/stories260K.gguf";
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    lk_tokenizer *tok = NULL;
    if (lk_gguf_open(path, &g, err, sizeof err) || lk_tokenizer_load(g, &tok, err, sizeof err)) {
        fprintf(stderr, "fuzz_http: %s (run from the repository root, or set LK_FUZZ_MODEL)\n", err);
        abort();
    }
    lk_gguf_close(g);
    static const char *const names[2] = {"chatml", "qwen3"};
    for (int i = 0; i < 2; i++) {
        lk_server *s = calloc(1, sizeof *s);
        s->tok = tok;
        if (lk_chat_template_select(names[i], NULL, &s->tmpl, err, sizeof err)) {
            fprintf(stderr, "fuzz_http: template %s: %s\n", names[i], err);
            abort();
        }
        s->n_ctx = 256;
        s->n_vocab = lk_tokenizer_n_vocab(tok);
        lk_sampler_params_default(&s->o.defaults);
        s->o.default_max_tokens = -1;
        g_srv[i] = s;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const uint8_t mode = data[0];
    const char *body = (const char *)data + 1;
    const size_t n = size - 1;
    lk_server *s = g_srv[(mode >> 1) & 1];

    srv_req *r = calloc(1, sizeof *r);
    r->srv = s;
    r->refs = 1;
    r->kind = mode & 1 ? RQ_COMPLETION : RQ_CHAT;
    char msg[600] = "", param[80] = "";
    bool ok = srv_parse_request(s, r, body, n, msg, param);
    if (ok) {
        assert(r->n_prompt > 0 && r->n_prompt < s->n_ctx);
        for (int i = 0; i < r->n_prompt; i++) assert(r->prompt[i] >= 0 && r->prompt[i] < s->n_vocab);
        assert(r->max_new != 0);
    } else {
        assert(msg[0] != 0); /* every refusal says why */
    }

    /* the bytes as model output */
    char *calls = NULL, *content = NULL;
    int nc = lk_srv_parse_tool_calls(body, n, &calls, &content);
    assert(nc >= 0 && (nc == 0) == (calls == NULL));
    free(calls);
    free(content);
    size_t at = lk_srv_tool_start(body, n, 0);
    assert(at <= n);
    if (ok && r->n_stop) {
        long f = lk_srv_find_stop(body, n, 0, r->stop, r->n_stop);
        assert(f >= -1 && f <= (long)n);
        size_t hold = lk_srv_stop_holdback(body, n, r->stop, r->n_stop);
        assert(hold <= n);
    }
    srv_req_unref(s, r);
    return 0;
}
