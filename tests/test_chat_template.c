/* Chat templates: every built-in family's published template renders a
 * multi-turn conversation into the prompt text its model card documents
 * (expected strings written out by hand from those formats, not produced by
 * this code); the template inside a real GGUF renders; Jinja whitespace
 * rules match Jinja's documented behaviour; malformed and hostile templates
 * fail with a message naming the construct and never crash, hang or leak
 * (this program also runs under ASan+UBSan). */
#include "lk_test.h"

#include "gguf/gguf.h"
#include "tokenizer/chat_template.h"

/* The conversation every family renders: system + user + assistant + user. */
static const lk_chat_msg CONV[] = {
    { "system", "You are a helpful assistant.", NULL },
    { "user", "Hello!", NULL },
    { "assistant", "Hi! How can I help?", NULL },
    { "user", "What is 2+2?", NULL },
};

static char ERR[LK_ERRLEN];

/* Renders and returns the text (static rotating storage freed by the
 * caller via free()), or NULL with ERR set. */
static char *render_ex(const char *tmpl, const lk_chat_msg *m, int n, bool agp, const char *bos,
                       const char *eos, const char *extra, lk_status *st_out) {
    char *out = NULL;
    ERR[0] = 0;
    lk_status st = lk_chat_render_ex(tmpl, m, n, agp, bos, eos, extra, &out, ERR, sizeof ERR);
    if (st_out) *st_out = st;
    if (st != LK_OK) { if (out) { free(out); out = NULL; } }
    return out;
}
static char *render(const char *tmpl, const lk_chat_msg *m, int n, bool agp, const char *bos, const char *eos) {
    return render_ex(tmpl, m, n, agp, bos, eos, NULL, NULL);
}

#define CHECK_RENDER(got, want)                                                       \
    do {                                                                              \
        char *g_ = (got);                                                             \
        CHECKF(g_ && strcmp(g_, (want)) == 0, "\n    got:  %s%s%s\n    want: \"%s\"", \
               g_ ? "\"" : "(error) ", g_ ? g_ : ERR, g_ ? "\"" : "", (want));        \
        free(g_);                                                                     \
    } while (0)

static const char *builtin(const char *name) {
    const char *t = lk_chat_template_builtin(name);
    CHECKF(t != NULL, "no built-in template '%s'", name);
    return t ? t : "";
}

/* ---------------------------------------------------------------- families */

TEST(llama3_1) {
    /* Llama 3.1+ format: a system header that always carries the knowledge
     * cut-off and date lines, then one header/eot block per turn. */
    CHECK_RENDER(render(builtin("llama3"), CONV, 4, true, "<|begin_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
    /* no system message: the system block is still there, empty after the date */
    CHECK_RENDER(render(builtin("llama3"), CONV + 1, 1, false, "<|begin_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>");
    /* date_string and tools are template variables; tools go, with the
     * instructions, into the first user message, as JSON indented by 4 */
    const lk_chat_msg q[] = { { "user", "Weather in Paris?", NULL } };
    CHECK_RENDER(render_ex(builtin("llama3"), q, 1, true, "<|begin_of_text|>", "<|eot_id|>",
                           "{\"date_string\": \"01 Jan 2025\", \"tools\": [{\"type\": \"function\", "
                           "\"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}]}",
                           NULL),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.\n\n"
        "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
        "Do not use variables.\n\n"
        "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n"
        "        \"parameters\": {\n            \"type\": \"object\"\n        }\n    }\n}\n\n"
        "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(llama3_0) {
    /* Meta-Llama-3-Instruct: BOS on the first block, content trimmed */
    const lk_chat_msg m[] = { { "system", "You are a helpful assistant.", NULL }, { "user", "  Hello!\n", NULL } };
    CHECK_RENDER(render(builtin("llama3.0"), m, 2, true, "<|begin_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

#define CHATML_CONV                                                                   \
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"                    \
    "<|im_start|>user\nHello!<|im_end|>\n"                                            \
    "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n"                          \
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"

TEST(chatml_qwen2) {
    CHECK_RENDER(render(builtin("chatml"), CONV, 4, true, "", "<|im_end|>"),
                 CHATML_CONV "<|im_start|>assistant\n");
    CHECK_RENDER(render(builtin("chatml"), CONV, 4, false, "", "<|im_end|>"), CHATML_CONV);
    CHECK_RENDER(render(builtin("qwen2"), CONV, 4, true, NULL, "<|im_end|>"),
                 CHATML_CONV "<|im_start|>assistant\n");
    /* Qwen2.5 supplies its own system prompt when the conversation has none */
    CHECK_RENDER(render(builtin("qwen2.5"), CONV + 1, 1, true, NULL, "<|im_end|>"),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n");
}

TEST(qwen2_tools) {
    /* tools in the system block; an assistant turn that only calls a tool
     * (fields_json carries tool_calls) and the tool's answer as a user turn */
    const lk_chat_msg m[] = {
        { "system", "Sys", NULL },
        { "user", "Weather?", NULL },
        { "assistant", NULL,
          "{\"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
          "\"arguments\": {\"city\": \"Paris\"}}}]}" },
        { "tool", "22C", "{\"tool_call_id\": \"call00001\"}" },
    };
    CHECK_RENDER(render_ex(builtin("qwen2"), m, 4, true, NULL, "<|im_end|>",
                           "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                           "\"parameters\": {\"type\": \"object\"}}}]}", NULL),
        "<|im_start|>system\nSys\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n");
    lk_status st;
    const lk_chat_msg bad[] = { { "user", "x", "[1, 2]" } };
    char *o = render_ex(builtin("qwen2"), bad, 1, true, NULL, NULL, NULL, &st);
    CHECK(o == NULL && st == LK_ERR_ARG);
    CHECKF(strstr(ERR, "message 0: fields are not a JSON object") != NULL, "%s", ERR);
    free(o);
}

TEST(qwen3) {
    CHECK_RENDER(render(builtin("qwen3"), CONV, 4, true, NULL, "<|im_end|>"),
                 CHATML_CONV "<|im_start|>assistant\n");
    /* enable_thinking=false pre-fills an empty think block */
    CHECK_RENDER(render_ex(builtin("qwen3"), CONV, 4, true, NULL, "<|im_end|>", "{\"enable_thinking\": false}", NULL),
                 CHATML_CONV "<|im_start|>assistant\n<think>\n\n</think>\n\n");
    /* reasoning of earlier turns is dropped; the turn after the last user
     * query keeps it, re-spaced */
    const lk_chat_msg m[] = {
        { "user", "Hi", NULL },
        { "assistant", "<think>\nold reasoning\n</think>\n\nHello.", NULL },
        { "user", "2+2?", NULL },
        { "assistant", "<think>\n\nadd\n</think>\n4", NULL },
    };
    CHECK_RENDER(render(builtin("qwen3"), m, 4, false, NULL, "<|im_end|>"),
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n");
}

TEST(mistral_v03) {
    /* v0.3: [INST] blocks, a space before each answer, and the system prompt
     * joined to the last user message */
    CHECK_RENDER(render(builtin("mistral"), CONV, 4, true, "<s>", "</s>"),
        "<s>[INST] Hello![/INST] Hi! How can I help?</s>"
        "[INST] You are a helpful assistant.\n\nWhat is 2+2?[/INST]");
    lk_status st;
    const lk_chat_msg bad[] = { { "user", "a", NULL }, { "user", "b", NULL } };
    char *o = render_ex(builtin("mistral"), bad, 2, true, "<s>", "</s>", NULL, &st);
    CHECK(o == NULL && st == LK_ERR_ARG);
    CHECKF(strstr(ERR, "conversation roles must alternate user/assistant/user/assistant/...") != NULL, "%s", ERR);
    free(o);
}

TEST(gemma2) {
    CHECK_RENDER(render(builtin("gemma"), CONV + 1, 3, true, "<bos>", "<eos>"),
        "<bos><start_of_turn>user\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n");
    /* Gemma refuses system messages through raise_exception */
    lk_status st;
    char *o = render_ex(builtin("gemma"), CONV, 4, true, "<bos>", "<eos>", NULL, &st);
    CHECK(o == NULL && st == LK_ERR_ARG);
    CHECKF(strstr(ERR, "System role not supported") != NULL, "%s", ERR);
    free(o);
}

TEST(gemma3) {
    /* Gemma 3 puts the system prompt in front of the first user turn */
    CHECK_RENDER(render(builtin("gemma3"), CONV, 4, true, "<bos>", "<eos>"),
        "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n");
    /* content given as parts (fields_json replaces content) */
    const lk_chat_msg m[] = {
        { "user", NULL, "{\"content\": [{\"type\": \"text\", \"text\": \" Describe: \"}, {\"type\": \"image\"}]}" },
    };
    CHECK_RENDER(render(builtin("gemma3"), m, 1, false, "<bos>", "<eos>"),
        "<bos><start_of_turn>user\nDescribe:<start_of_image><end_of_turn>\n");
}

TEST(phi3) {
    CHECK_RENDER(render(builtin("phi3"), CONV, 4, true, "<s>", "<|endoftext|>"),
        "<|system|>\nYou are a helpful assistant.<|end|>\n"
        "<|user|>\nHello!<|end|>\n"
        "<|assistant|>\nHi! How can I help?<|end|>\n"
        "<|user|>\nWhat is 2+2?<|end|>\n"
        "<|assistant|>\n");
    /* without the generation prompt the template ends with EOS */
    CHECK_RENDER(render(builtin("phi3"), CONV + 1, 1, false, "<s>", "<|endoftext|>"),
        "<|user|>\nHello!<|end|>\n<|endoftext|>");
}

#define DS_BOS "<\xef\xbd\x9c" "begin\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"
#define DS_EOS "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"
#define DS_USER "<\xef\xbd\x9cUser\xef\xbd\x9c>"
#define DS_ASSISTANT "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"

TEST(deepseek) {
    CHECK_RENDER(render(builtin("deepseek"), CONV, 4, true, DS_BOS, DS_EOS),
        DS_BOS "You are a helpful assistant.\n\n"
        "User: Hello!\n\n"
        "Assistant: Hi! How can I help?" DS_EOS
        "User: What is 2+2?\n\n"
        "Assistant:");
    CHECK_RENDER(render(builtin("deepseek3"), CONV, 4, true, DS_BOS, DS_EOS),
        DS_BOS "You are a helpful assistant."
        DS_USER "Hello!" DS_ASSISTANT "Hi! How can I help?" DS_EOS
        DS_USER "What is 2+2?" DS_ASSISTANT);
}

/* The template stored in a real GGUF (llama.cpp's Phi-3 vocabulary file): the
 * early Phi-3 template, which knows user and assistant turns only. */
TEST(gguf_template) {
    lk_gguf *g = NULL;
    char err[LK_ERRLEN];
    lk_status st = lk_gguf_open(lk_td("vocab/ggml-vocab-phi-3.gguf"), &g, err, sizeof err);
    CHECKF(st == LK_OK, "%s", err);
    if (st != LK_OK) return;
    const char *s;
    size_t n;
    CHECK(lk_gguf_get_str(g, "tokenizer.chat_template", &s, &n));
    char *tmpl = malloc(n + 1);
    memcpy(tmpl, s, n);
    tmpl[n] = 0;
    CHECK(strcmp(lk_chat_template_guess(tmpl), "phi3") == 0);
    CHECK_RENDER(render(tmpl, CONV, 4, true, "<s>", "<|endoftext|>"),
        "<s><|user|>\nHello!<|end|>\n<|assistant|>\n"
        "Hi! How can I help?<|end|>\n"
        "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n");
    free(tmpl);
    lk_gguf_close(g);
}

TEST(select_template) {
    const char *src = NULL;
    char err[LK_ERRLEN];
    CHECK(lk_chat_template_select("gemma", "{{ model }}", &src, err, sizeof err) == LK_OK);
    CHECK(src == lk_chat_template_builtin("gemma"));
    CHECK(lk_chat_template_select("{{ inline }}", "{{ model }}", &src, err, sizeof err) == LK_OK);
    CHECK(strcmp(src, "{{ inline }}") == 0);
    CHECK(lk_chat_template_select(NULL, "{{ model }}", &src, err, sizeof err) == LK_OK);
    CHECK(strcmp(src, "{{ model }}") == 0);
    CHECK(lk_chat_template_select("", NULL, &src, err, sizeof err) == LK_ERR_ARG && src == NULL);
    CHECKF(strstr(err, "no tokenizer.chat_template") && strstr(err, "llama3"), "%s", err);
    CHECK(lk_chat_template_select("vicuna", "{{ model }}", &src, err, sizeof err) == LK_ERR_ARG);
    CHECKF(strstr(err, "vicuna: unknown name") && strstr(err, "chatml"), "%s", err);
}

TEST(builtins_and_guess) {
    static const char *const names[] = { "llama3", "llama3.0", "chatml", "qwen2", "qwen3", "mistral",
                                         "gemma", "gemma3", "phi3", "deepseek", "deepseek3" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *t = builtin(names[i]);
        CHECKF(strcmp(lk_chat_template_guess(t), names[i]) == 0, "guess(%s) = %s", names[i],
               lk_chat_template_guess(t));
        CHECKF(strstr(lk_chat_template_names(), names[i]) != NULL, "%s not listed", names[i]);
        /* every built-in renders an empty conversation without error */
        char *o = render(t, NULL, 0, true, "", "");
        CHECKF(o != NULL, "%s: %s", names[i], ERR);
        free(o);
    }
    char err[LK_ERRLEN];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        CHECKF(lk_chat_template_check(builtin(names[i]), err, sizeof err) == LK_OK, "%s: %s", names[i], err);
    CHECK(lk_chat_template_check("{% for x in y %}", err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "'for' is never closed") != NULL, "%s", err);
    CHECK(lk_chat_template_check("{% if a %}{{ a|nope }}{% endif %}", err, sizeof err) == LK_ERR_FORMAT);
    CHECKF(strstr(err, "unknown filter 'nope'") != NULL, "%s", err);
    CHECK(lk_chat_template_builtin("nope") == NULL);
    CHECK(lk_chat_template_builtin(NULL) == NULL);
    CHECK(strcmp(lk_chat_template_guess("{{ messages }}"), "unknown") == 0);
    CHECK(lk_chat_template_builtin("llama3.1") == lk_chat_template_builtin("llama3"));
}

/* ----------------------------------------------------------------- Jinja */

static void expect_text(const char *tmpl, const char *want) {
    const lk_chat_msg m[] = { { "user", "hi", NULL }, { "assistant", "yo", NULL } };
    char *o = render(tmpl, m, 2, true, "<s>", "</s>");
    CHECKF(o && strcmp(o, want) == 0, "\n    template: %s\n    got:  %s\n    want: %s", tmpl, o ? o : ERR, want);
    free(o);
}

TEST(whitespace_rules) {
    /* trim_blocks: the newline after a block tag goes; lstrip_blocks: the
     * indentation before a block tag goes; expression tags keep both */
    expect_text("  {% if true %}\n  x\n  {% endif %}\n  y {{ 1 }}\n  {# c #}\n z", "  x\n  y 1\n z");
    expect_text("a\n\n{%- if true -%}\n\n b \n{%- endif %}", "ab");
    expect_text("{%- for m in messages -%}\n    {{- m.role }}\n{%- endfor %}", "userassistant");
    expect_text("X {%+ if true %}keep{% endif %}\n{% if true +%}\nkept\n{% endif %}\nend\n", "X keep\nkept\nend");
    expect_text("{{ 'a' }}\n{{ 'b' }}\n", "a\nb");       /* one trailing newline of the template goes */
    expect_text("{% raw %}{{ x }}{% if %}{% endraw %}", "{{ x }}{% if %}");
    expect_text("{% for m in messages %}\r\n  {{ m.role }}\r\n{% endfor %}\r\n", "  user\n  assistant\n"); /* CRLF reads as LF */
    expect_text("{% macro m(x) -%}\n  [{{ x }}]\n{%- endmacro %}{{ m(1) }} {{ m(2) }}", "[1] [2]");
}

TEST(expressions) {
    expect_text("{{ 1.0 }} {{ 3/2 }} {{ 7//2 }} {{ -7 % 3 }} {{ 2**10 }} {{ 0.1+0.2 }} {{ 1e16 }}",
                "1.0 1.5 3 2 1024 0.30000000000000004 1e+16");
    expect_text("{{ [1,'a',none,true] }} {{ {'a': 1} }} {{ 'a' ~ x ~ none }}", "[1, 'a', None, True] {'a': 1} aNone");
    expect_text("{{ 'h\xc3\xa9llo'|length }} {{ 'h\xc3\xa9llo'[1] }} {{ 'abc'[::-1] }} {{ [1,2,3][1:] }} {{ [1,2,3][-1] }}",
                "5 \xc3\xa9 cba [2, 3] 3");
    expect_text("{{ {'b': 1, 'a': '\xc3\xa9\"'}|tojson }}", "{\"b\": 1, \"a\": \"\xc3\xa9\\\"\"}");
    expect_text("{{ x is defined }} {{ none is none }} {{ 'a' in 'cat' }} {{ 'z' not in ['a'] }} {{ 1 < 2 < 3 }}",
                "False True True True True");
    expect_text("{% set ns = namespace(a=1) %}{% for i in range(3) %}{% set ns.a = ns.a + i %}{% set b = i %}{% endfor %}"
                "{{ ns.a }}{{ b }}", "4");
    expect_text("{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}"
                "{{ i }}{% endfor %}", "0134");
    expect_text("{% for m in [1,2,3,4,5] if m is odd %}{{ loop.index }}/{{ loop.length }}:{{ m }} {% endfor %}",
                "1/3:1 2/3:3 3/3:5 ");
    expect_text("{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(',') }}", "hi");
    expect_text("{{ ' a b '.split() }} {{ 'a</think>b'.split('</think>')[-1] }} {{ '\\n\\nx\\n'.strip('\\n') }}",
                "['a', 'b'] b x");
    expect_text("{% set x %}in {{ 1 }}{% endset %}[{{ x }}]{% filter upper %}shout{% endfilter %}", "[in 1]SHOUT");
    expect_text("{{ x|default('d') }} {{ ''|default('d', true) }} {{ 'hello world'|title }} {{ 1 if 0 else 2 }}",
                "d d Hello World 2");
    expect_text("{{ [3,1,2]|sort }} {{ {'b': 1, 'a': 2}|dictsort }} {{ [1,2,3]|sum }} {{ (1,) }} "
                "{{ [{'n': 'b'}, {'n': 'a'}]|sort(attribute='n')|map(attribute='n')|join }}",
                "[1, 2, 3] [('a', 2), ('b', 1)] 6 (1,) ab");
    /* Llama 3.2's template asks for today's date this way */
    expect_text("{{ strftime_now is defined }} {{ strftime_now('%Y')|length }} {{ strftime_now('%d %b %Y')|length }}",
                "True 4 11");
}

/* -------------------------------------------------------------- failures */

static void expect_error(const char *tmpl, lk_status want, const char *needle) {
    char *out = (char *)"untouched";
    char err[LK_ERRLEN] = "";
    const lk_chat_msg m[] = { { "user", "hi", NULL } };
    lk_status st = lk_chat_render(tmpl, m, 1, true, "", "", &out, err, sizeof err);
    CHECKF(st == want, "template %.60s: status %s, want %s (%s)", tmpl, lk_status_to_string(st),
           lk_status_to_string(want), err);
    CHECKF(out == NULL, "template %.60s: output set on error", tmpl);
    CHECKF(strstr(err, needle) != NULL, "template %.60s: message \"%s\" lacks \"%s\"", tmpl, err, needle);
    if (st == LK_OK) free(out);
}

TEST(malformed_templates) {
    expect_error("{% if x %}yes", LK_ERR_FORMAT, "'if' is never closed (expected 'endif')");
    expect_error("{% for m in messages %}", LK_ERR_FORMAT, "'for' is never closed");
    expect_error("a {{ x ", LK_ERR_FORMAT, "line 1 col 3: unclosed {{ tag");
    expect_error("{% if x ", LK_ERR_FORMAT, "unclosed {% tag");
    expect_error("text\n{# never closed", LK_ERR_FORMAT, "line 2 col 1: unclosed comment");
    expect_error("{{ x|frobnicate }}", LK_ERR_FORMAT, "unknown filter 'frobnicate'");
    expect_error("{{ x is frob }}", LK_ERR_FORMAT, "unknown test 'frob'");
    /* found while parsing, even in a branch that never runs */
    expect_error("{% if false %}{{ x|frobnicate }}{% endif %}", LK_ERR_FORMAT, "line 1 col 20: unknown filter 'frobnicate'");
    expect_error("{{ 1 + }}", LK_ERR_FORMAT, "expected an expression");
    expect_error("{{ }}", LK_ERR_FORMAT, "empty expression");
    expect_error("{{ 'abc }}", LK_ERR_FORMAT, "unterminated string literal");
    expect_error("{{ a @ b }}", LK_ERR_FORMAT, "unexpected character '@'");
    expect_error("{{ a b }}", LK_ERR_FORMAT, "unexpected b in expression");
    expect_error("{% include 'other.jinja' %}", LK_ERR_FORMAT, "unsupported statement 'include'");
    expect_error("{% endfor %}", LK_ERR_FORMAT, "unexpected 'endfor' outside any block");
    expect_error("{% if x %}{% endfor %}", LK_ERR_FORMAT, "unexpected 'endfor' inside if");
    expect_error("{% set %}", LK_ERR_FORMAT, "expected a variable name");
    expect_error("{% for in x %}{% endfor %}", LK_ERR_FORMAT, "expected 'in'");
    expect_error("{{ foo(1) }}", LK_ERR_FORMAT, "unknown function 'foo'");
    expect_error("{{ 'a'.nomethod() }}", LK_ERR_FORMAT, "unknown method 'nomethod'");
    expect_error("{{ 1 / 0 }}", LK_ERR_FORMAT, "division by zero");
    expect_error("{{ 'a' + 1 }}", LK_ERR_FORMAT, "unsupported operand types for '+'");
    expect_error("{{ undefined_name + 'x' }}", LK_ERR_FORMAT, "'undefined_name' is undefined");
    expect_error("{% set x = 1 %}{% set x.y = 2 %}", LK_ERR_FORMAT, "only on a namespace");
    expect_error("{% for x in none %}{% endfor %}", LK_ERR_FORMAT, "'for' over");
    expect_error("{{ 9223372036854775807 + 1 }}", LK_ERR_FORMAT, "integer overflow");
    expect_error("{{ raise_exception('Only user and assistant roles are supported!') }}", LK_ERR_ARG,
                 "Only user and assistant roles are supported!");
}

TEST(hostile_templates) {
    /* nesting, loops, output and memory are all bounded */
    char *deep = malloc(4096);
    size_t k = 0;
    k += (size_t)sprintf(deep + k, "{{ ");
    for (int i = 0; i < 1000; i++) deep[k++] = '(';
    deep[k++] = '1';
    for (int i = 0; i < 1000; i++) deep[k++] = ')';
    k += (size_t)sprintf(deep + k, " }}");
    deep[k] = 0;
    expect_error(deep, LK_ERR_FORMAT, "nested more than");
    free(deep);

    size_t n = 200000;
    char *chain = malloc(n * 2 + 16);
    k = (size_t)sprintf(chain, "{{ 1");
    while (k < n * 2) { chain[k++] = '+'; chain[k++] = '1'; }
    strcpy(chain + k, " }}");
    expect_error(chain, LK_ERR_FORMAT, "nested more than");   /* a left-deep tree, not a stack overflow */
    free(chain);

    expect_error("{% for i in range(100000000) %}{% endfor %}", LK_ERR_FORMAT, "loop iterations");
    expect_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", LK_ERR_FORMAT,
                 "loop iterations");
    expect_error("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}", LK_ERR_FORMAT, "output longer than");
    expect_error("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 LK_ERR_FORMAT, "longer than");
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(5000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                 "{{ ns.x }}", LK_ERR_FORMAT, "nested more than");
    expect_error("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", LK_ERR_FORMAT, "nested more than");
}

/* Every prefix and many byte-level mutations of every built-in template
 * either render or fail cleanly. */
TEST(mutated_templates) {
    static const char *const names[] = { "llama3", "llama3.0", "chatml", "qwen2", "qwen3", "mistral",
                                         "gemma", "gemma3", "phi3", "deepseek", "deepseek3" };
    static const char junk[] = "{}%#-+()[]'\".|~ \n\r=!<>abcifendfor";
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    int ok = 0, failed = 0;
    for (size_t t = 0; t < sizeof names / sizeof names[0]; t++) {
        const char *src = lk_chat_template_builtin(names[t]);
        size_t len = strlen(src);
        char *buf = malloc(len + 1);
        for (size_t cut = 0; cut < len; cut += 13) {
            memcpy(buf, src, cut);
            buf[cut] = 0;
            char *o = NULL, e[LK_ERRLEN];
            if (lk_chat_render(buf, CONV, 4, true, "<s>", "</s>", &o, e, sizeof e) == LK_OK) { ok++; free(o); }
            else failed++;
        }
        for (int it = 0; it < 150; it++) {
            memcpy(buf, src, len + 1);
            for (int m = 0; m < 3; m++) {
                rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
                buf[rng % len] = junk[(rng >> 32) % (sizeof junk - 1)];
            }
            char *o = NULL, e[LK_ERRLEN];
            if (lk_chat_render(buf, CONV, 4, true, "<s>", "</s>", &o, e, sizeof e) == LK_OK) { ok++; free(o); }
            else { failed++; CHECKF(e[0] != 0, "error without a message"); }
        }
        free(buf);
    }
    CHECK(ok > 0 && failed > 0);
}

TEST(bad_arguments) {
    char *o = NULL;
    char err[LK_ERRLEN];
    CHECK(lk_chat_render(NULL, CONV, 4, true, "", "", &o, err, sizeof err) == LK_ERR_ARG);
    const lk_chat_msg noroles[] = { { NULL, "x", NULL } };
    CHECK(lk_chat_render("{{ 1 }}", noroles, 1, true, "", "", &o, err, sizeof err) == LK_ERR_ARG);
    CHECK(o == NULL);
    CHECK(lk_chat_render_ex("{{ 1 }}", CONV, 4, true, "", "", "[1]", &o, err, sizeof err) == LK_ERR_ARG);
    CHECK(lk_chat_render_ex("{{ 1 }}", CONV, 4, true, "", "", "{bad", &o, err, sizeof err) == LK_ERR_ARG);
    /* a NULL content is `none` (an assistant turn that only calls tools) */
    const lk_chat_msg m[] = { { "assistant", NULL, NULL } };
    CHECK_RENDER(render("{{ messages[0].content is none }}", m, 1, true, "", ""), "True");
}

int main(void) {
    RUN(llama3_1);
    RUN(llama3_0);
    RUN(chatml_qwen2);
    RUN(qwen2_tools);
    RUN(qwen3);
    RUN(mistral_v03);
    RUN(gemma2);
    RUN(gemma3);
    RUN(phi3);
    RUN(deepseek);
    RUN(gguf_template);
    RUN(select_template);
    RUN(builtins_and_guess);
    RUN(whitespace_rules);
    RUN(expressions);
    RUN(malformed_templates);
    RUN(hostile_templates);
    RUN(mutated_templates);
    RUN(bad_arguments);
    return lk_test_end();
}
