/* fuzz_chat_template — the Jinja-subset interpreter on any template text.
 *
 * A model file carries its own template, so the interpreter runs text from
 * whoever made the file. Input: the template source, then optionally a NUL
 * byte and text used as the user's message content and tool-call argument
 * (so string filters and tojson see arbitrary bytes too). The template is
 * checked (lk_chat_template_check), guessed, and rendered for a short
 * conversation with a system turn, a tool call and its result, with and
 * without the generation prompt. A render either succeeds with a
 * NUL-terminated string or fails with a message; the interpreter's own
 * bounds (template size, output, memory, depth, steps) keep it finite. */
#include <assert.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/chat_template.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    lk_log_set_level(LK_LOG_ERROR);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *tmpl = malloc(size + 1);
    memcpy(tmpl, data, size);
    tmpl[size] = 0;
    size_t tl = strlen(tmpl);
    const char *content = tl < size ? tmpl + tl + 1 : "Hello, who are you?";
    char err[LK_ERRLEN];
    lk_chat_template_check(tmpl, err, sizeof err);
    const char *guess = lk_chat_template_guess(tmpl);
    assert(guess != NULL);

    char fields[256];
    snprintf(fields, sizeof fields,
             "{\"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1}}}]}");
    const lk_chat_msg msgs[] = {
        {"system", "You are a helpful assistant.", NULL},
        {"user", content, NULL},
        {"assistant", NULL, fields},
        {"tool", "{\"result\": 42}", "{\"tool_call_id\": \"call_1\", \"name\": \"f\"}"},
        {"assistant", "The answer is 42.", NULL},
        {"user", content, NULL},
    };
    const int n = (int)(sizeof msgs / sizeof msgs[0]);
    for (int gen = 0; gen < 2; gen++) {
        char *out = NULL;
        lk_status st = lk_chat_render_ex(tmpl, msgs, gen ? n : 2, gen, "<s>", "</s>",
                                         gen ? "{\"enable_thinking\": false, \"tools\": [{\"type\": \"function\"}]}" : NULL,
                                         &out, err, sizeof err);
        if (st == LK_OK) {
            assert(out != NULL);
            (void)strlen(out);
        } else {
            assert(out == NULL || st != LK_OK);
            assert(memchr(err, 0, sizeof err) != NULL);
        }
        free(out);
    }
    free(tmpl);
    return 0;
}
