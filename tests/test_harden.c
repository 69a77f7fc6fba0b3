/* Hardening (issue 14): text that comes from a model file reaches no
 * terminal raw. A hostile GGUF's tokenizer names, tokens and chat template
 * (its parse errors and raise_exception's message) are quoted in errors with
 * their escape sequences written as \xNN (lk_str_sanitize): checked on the
 * library's messages and on what `lockstep run` / `chat` print for a copy
 * of stories260K with hostile metadata (files written with the GGUF writer). */
#include "lk_test.h"

#include "gguf/gguf.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

#include <sys/wait.h>
#include <unistd.h>

/* ESC ] 0 ; ... BEL sets the window title, ESC [ 2 J clears the screen, a
 * C1 CSI (U+009B) and a DEL: what a hostile file would put on the screen. */
#define EVIL "\x1b]0;owned\x07\x1b[2J\xc2\x9b" "31m\x7f"

/* No byte a terminal obeys: C0 controls (but the newlines between a
 * program's lines), DEL, C1 (as UTF-8 U+0080..U+009F). */
static bool printable(const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if ((*p < 0x20 && *p != '\n') || *p == 0x7f || (p[0] == 0xc2 && p[1] >= 0x80 && p[1] < 0xa0)) return false;
    return true;
}

static bool tmp_path(char *path) {
    int fd = mkstemp(path);
    if (fd < 0) return false;
    close(fd);
    return true;
}

/* A tokenizer-only GGUF: model name, optional pre-tokenizer, tokens. */
static bool write_vocab(const char *path, const char *model, const char *pre, const char *const *toks, int n) {
    char err[LK_ERRLEN];
    lk_gguf_writer *w = NULL;
    if (lk_gguf_writer_open(path, &w, err, sizeof err)) return false;
    lk_gguf_writer_set_str(w, "general.architecture", "llama");
    lk_gguf_writer_set_str(w, "tokenizer.ggml.model", model);
    if (pre) lk_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
    lk_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)n);
    const char *merges[1] = {"a b"};
    lk_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1);
    return !lk_gguf_writer_begin_data(w, err, sizeof err) && !lk_gguf_writer_close(w, err, sizeof err);
}

/* Loads path's tokenizer, which must fail; err gets the message. */
static bool load_fails(const char *path, char *err, size_t errlen) {
    lk_gguf *g = NULL;
    if (lk_gguf_open(path, &g, err, errlen)) return false;
    lk_tokenizer *t = NULL;
    lk_status st = lk_tokenizer_load(g, &t, err, errlen);
    lk_tokenizer_free(t);
    lk_gguf_close(g);
    return st != LK_OK;
}

TEST(tokenizer_errors_sanitized) {
    char path[] = "/tmp/lk_test_harden_tok.XXXXXX", err[LK_ERRLEN];
    CHECK(tmp_path(path));
    const char *toks[4] = {"a", "b", "ab", "c"};
    /* an unknown tokenizer.ggml.model */
    CHECK(write_vocab(path, "llama" EVIL, NULL, toks, 4));
    CHECK(load_fails(path, err, sizeof err));
    CHECKF(printable(err) && strstr(err, "\\x1b]0;owned\\x07\\x1b[2J\\xc2\\x9b31m\\x7f"), "%s", err);
    /* an unknown pre-tokenizer */
    CHECK(write_vocab(path, "gpt2", "default" EVIL, toks, 4));
    CHECK(load_fails(path, err, sizeof err));
    CHECKF(printable(err) && strstr(err, "tokenizer.ggml.pre='default\\x1b]0;owned"), "%s", err);
    /* a duplicate token quoted in the error */
    const char *dup[4] = {"a", EVIL, "b", EVIL};
    CHECK(write_vocab(path, "gpt2", NULL, dup, 4));
    CHECK(load_fails(path, err, sizeof err));
    CHECKF(printable(err) && strstr(err, "duplicate token '\\x1b]0;owned"), "%s", err);
    unlink(path);
}

TEST(chat_template_errors_sanitized) {
    char err[LK_ERRLEN], *out = NULL;
    const lk_chat_msg msgs[1] = {{"user", "hi", NULL}};
    /* raise_exception's text is the template's */
    CHECK(lk_chat_render("{{ raise_exception('" EVIL "') }}", msgs, 1, true, "", "", &out, err, sizeof err) == LK_ERR_ARG);
    CHECKF(printable(err) && strstr(err, "rejected the conversation: \\x1b]0;owned\\x07\\x1b[2J"), "%s", err);
    /* a parse error quoting the template */
    CHECK(lk_chat_template_check("{{ messages \x1b[2J }}", err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(printable(err) && !strchr(err, '\n') && strstr(err, "\\x1b"), "%s", err);
    CHECK(lk_chat_render("{{ x | no_such_filter" EVIL " }}", msgs, 1, true, "", "", &out, err, sizeof err) != LK_OK);
    CHECKF(printable(err), "%s", err);
    free(out);
}

/* stories260K with key `key` set to the string val (the others and every
 * tensor copied). */
static bool hostile_copy(const char *src, const char *dst, const char *key, const char *val) {
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(src, &g, err, sizeof err)) return false;
    lk_gguf_writer *w = NULL;
    if (lk_gguf_writer_open(dst, &w, err, sizeof err)) { lk_gguf_close(g); return false; }
    for (int64_t i = 0; i < lk_gguf_n_kv(g); i++)
        if (strcmp(lk_gguf_kv_key(g, i), key)) lk_gguf_writer_copy_kv(w, g, i);
    lk_gguf_writer_set_str(w, key, val);
    for (int64_t i = 0; i < lk_gguf_n_tensors(g); i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
        lk_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne);
    }
    bool ok = !lk_gguf_writer_begin_data(w, err, sizeof err);
    for (int64_t i = 0; ok && i < lk_gguf_n_tensors(g); i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
        ok = !lk_gguf_writer_write(w, t->data, t->nbytes, err, sizeof err);
    }
    ok = !lk_gguf_writer_close(w, err, sizeof err) && ok;
    lk_gguf_close(g);
    return ok;
}

/* Runs cmd (stdin from /dev/null or as given in cmd) and returns its exit
 * status with its stderr (and stdout too when both) in buf. */
static int run_out(const char *cmd, bool both, char *buf, size_t len) {
    char full[2048];
    snprintf(full, sizeof full, both ? "%s 2>&1" : "%s 2>&1 >/dev/null", cmd);
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t n = fread(buf, 1, len - 1, p);
    buf[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(cli_hostile_model) {
    const char *exe = getenv("LOCKSTEP");
    if (!exe || !*exe) { printf("  (LOCKSTEP not set: skipped; tests/run.sh sets it)\n"); return; }
    const char *src = lk_td("models/stories260K.gguf");
    char path[] = "/tmp/lk_test_harden_model.XXXXXX", cmd[1024], out[8192];
    CHECK(tmp_path(path));
    /* chat with the model's own (hostile) template */
    CHECK(hostile_copy(src, path, "tokenizer.chat_template", "{{ raise_exception('" EVIL "') }}"));
    snprintf(cmd, sizeof cmd, "echo hi | %s chat -m %s -n 2", exe, path);
    int rc = run_out(cmd, false, out, sizeof out);
    CHECKF(rc == 1, "exit %d: %s", rc, out);
    CHECKF(printable(out) && strstr(out, "rejected the conversation: \\x1b]0;owned\\x07\\x1b[2J"), "%s", out);
    /* run with a hostile tokenizer name */
    CHECK(hostile_copy(src, path, "tokenizer.ggml.model", "llama" EVIL));
    snprintf(cmd, sizeof cmd, "%s run -m %s -p hi -n 2 </dev/null", exe, path);
    rc = run_out(cmd, false, out, sizeof out);
    CHECKF(rc == 1, "exit %d: %s", rc, out);
    CHECKF(printable(out) && strstr(out, "unsupported tokenizer.ggml.model 'llama\\x1b]0;owned"), "%s", out);
    /* the model's name as info and plan show it */
    CHECK(hostile_copy(src, path, "general.name", "stories" EVIL));
    snprintf(cmd, sizeof cmd, "%s info -m %s </dev/null", exe, path);
    rc = run_out(cmd, true, out, sizeof out);
    CHECKF(rc == 0 && printable(out) && strstr(out, "stories\\x1b]0;owned"), "exit %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s plan -m %s --nodes 2 </dev/null", exe, path);
    rc = run_out(cmd, true, out, sizeof out);
    CHECKF(rc == 0 && printable(out) && strstr(out, "stories\\x1b]0;owned"), "exit %d: %s", rc, out);
    unlink(path);
}

int main(void) {
    RUN(tokenizer_errors_sanitized);
    RUN(chat_template_errors_sanitized);
    RUN(cli_hostile_model);
    return lk_test_end();
}
