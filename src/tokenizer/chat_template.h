/* chat_template — turns a conversation into the prompt text a model was
 * trained on, by running the Jinja template its GGUF carries
 * (`tokenizer.chat_template`) through a small, safe Jinja-subset interpreter.
 *
 * Owns: the interpreter (lexer, parser, evaluator) and the built-in templates
 * behind `--chat-template NAME`. Callers: cli (run/chat), serve. Pure
 * functions: no globals, any number of threads may render at once. Every
 * render allocates from its own arena and frees it before returning; the
 * output string is malloc'd and owned by the caller.
 *
 * Rendering follows what llama.cpp's own Jinja engine (common/jinja, formerly
 * minja) and Hugging Face's `apply_chat_template` do, because those define the
 * prompt the model saw in training:
 *   - trim_blocks and lstrip_blocks are ON (a newline right after `%}`/`#}` is
 *     dropped; spaces before `{%`/`{#` at the start of a line are dropped),
 *     a single trailing newline of the template is dropped, and `{%-`, `-%}`,
 *     `{{-`, `-}}`, `{#-`, `-#}` strip whitespace as in Jinja;
 *   - `tojson` is HF's: keys unsorted, no HTML escaping, non-ASCII kept,
 *     separators ", " and ": " (with indent: "," and ": ");
 *   - undefined names print as "" and are false; `x.y` of an undefined `x` is
 *     undefined too (lenient like llama.cpp), but arithmetic on undefined is
 *     an error;
 *   - strings are UTF-8; `length`, indexing and slicing count code points;
 *     `upper`/`lower`/`title` change ASCII letters only.
 *
 * Supported: `{{ }}`, `{% if/elif/else %}`, `{% for a[, b] in x [if c] %}` with
 * `else`, `loop.index/index0/revindex/revindex0/first/last/length/previtem/
 * nextitem`, `break`/`continue`, `set` (also `set ns.attr` and block `set`),
 * `macro` (positional and keyword arguments, defaults), `filter` blocks,
 * `raw`, `generation` (rendered as plain body); expressions with literals
 * (str, int, float, list, tuple, dict, true/false/none), `.attr`, `[i]`,
 * slices, calls, `|filter`, `is [not] test`, `in`/`not in`, `not/and/or`,
 * comparisons, `+ - * / // % **`, `~`, `a if c else b`; filters trim,
 * length/count, tojson, string, upper, lower, title, capitalize, default/d,
 * join, replace, list, first, last, reverse, unique, select/reject,
 * selectattr/rejectattr, map, items, sort, dictsort, sum, min, max, int,
 * float, abs, indent, safe; tests defined, undefined, none, string, number,
 * integer, float, boolean, true, false, mapping, iterable, sequence,
 * callable, lower, upper, odd, even, divisibleby, eq/equalto/ne/lt/le/gt/ge,
 * in, sameas; the string, list and dict methods templates use (strip/lstrip/
 * rstrip/split/startswith/endswith/upper/lower/title/capitalize/replace/find/
 * count/index/join/isdigit/isalpha/isspace, items/keys/values/get,
 * index/count); globals raise_exception, namespace, range, dict,
 * strftime_now (local time). Not supported: include/extends/import/block,
 * call blocks, recursive loops, loop.cycle, `%` string formatting.
 *
 * Safety: bounded template size, output size, memory, recursion depth and
 * loop iterations. A template outside the subset, or a malformed one,
 * returns LK_ERR_FORMAT with a message naming the construct and its line and
 * column. `raise_exception(msg)` returns LK_ERR_ARG with msg: the template
 * judged the conversation (roles, order) unacceptable. */
#ifndef LK_CHAT_TEMPLATE_H
#define LK_CHAT_TEMPLATE_H

#include "common/lk_common.h"

/* One turn. content NULL renders as `none` (an assistant turn that only
 * calls tools). fields_json, if not NULL, is a JSON object whose members are
 * added to the message as the template sees it: "tool_calls", "tool_call_id",
 * "name", "reasoning_content" ... as in OpenAI's chat format (a "content"
 * member replaces content, e.g. with a list of parts). */
typedef struct {
    const char *role;        /* "system", "user", "assistant", "tool", ... */
    const char *content;
    const char *fields_json;
} lk_chat_msg;

/* Renders template_src for msgs[0..n). add_generation_prompt asks the
 * template to end with the opening of an assistant turn. bos_token and
 * eos_token are the texts of the model's BOS/EOS tokens ("" if none; NULL
 * means ""). On LK_OK *out is a malloc'd NUL-terminated string. */
lk_status lk_chat_render(const char *template_src, const lk_chat_msg *msgs, int n,
                         bool add_generation_prompt, const char *bos_token,
                         const char *eos_token, char **out, char *err, size_t errlen);

/* As lk_chat_render, plus extra template variables: extra_json, if not NULL,
 * is a JSON object whose members become variables (e.g.
 * `{"enable_thinking": false}` for Qwen3, `{"tools": [...]}`). */
lk_status lk_chat_render_ex(const char *template_src, const lk_chat_msg *msgs, int n,
                            bool add_generation_prompt, const char *bos_token,
                            const char *eos_token, const char *extra_json,
                            char **out, char *err, size_t errlen);

/* Parses a template without rendering it: LK_OK if it is inside the
 * supported subset, else LK_ERR_FORMAT naming the first construct that is
 * not (for checking a model's template once, at load). */
lk_status lk_chat_template_check(const char *template_src, char *err, size_t errlen);

/* Picks the template to render: `override` (from --chat-template) is a
 * built-in name or, if it contains "{{" or "{%", a template itself; without
 * an override, the model's own `tokenizer.chat_template` (from_model, may be
 * NULL). Fails with LK_ERR_ARG naming the choices when neither gives one.
 * *src points into override, from_model or static data. */
lk_status lk_chat_template_select(const char *override, const char *from_model, const char **src,
                                  char *err, size_t errlen);

/* The published Jinja source of a built-in template, by name, or NULL if the
 * name is unknown. Names: "llama3" (Llama 3.1/3.2/3.3 Instruct), "llama3.0"
 * (Meta-Llama-3-Instruct), "chatml" (plain ChatML), "qwen2" (Qwen2.5
 * Instruct), "qwen3", "mistral" (Mistral-7B-Instruct-v0.3), "gemma"
 * (Gemma 2), "gemma3", "phi3" (Phi-3-mini), "deepseek" (deepseek-llm chat / V2),
 * "deepseek3" (DeepSeek-V3). Aliases: "llama3.1", "qwen2.5", "gemma2". */
const char *lk_chat_template_builtin(const char *name);

/* A comma-separated list of the built-in names, for --help and errors. */
const char *lk_chat_template_names(void);

/* Guesses the family of a template from the markers it writes: one of the
 * built-in names above, or "unknown". For logging only. */
const char *lk_chat_template_guess(const char *template_src);

#endif
