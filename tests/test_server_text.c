/* The server's pure text functions: stop strings held back while they may
 * still match, and tool calls in both forms models write them. */
#include "lk_test.h"
#include "server/server.h"

#include <jansson.h>

static char *S1[] = { "</s>", "\n\nUser:" };

TEST(stop_found_earliest) {
    const char *t = "hello\n\nUser: hi</s>";
    CHECK(lk_srv_find_stop(t, strlen(t), 0, S1, 2) == 5);
    CHECK(lk_srv_find_stop(t, strlen(t), 6, S1, 2) == 15);
    CHECK(lk_srv_find_stop("abc", 3, 0, S1, 2) == -1);
    CHECK(lk_srv_find_stop("", 0, 0, S1, 2) == -1);
}

TEST(stop_holdback) {
    /* the end may still grow into a stop string: held back */
    CHECK(lk_srv_stop_holdback("hello <", 7, S1, 2) == 1);
    CHECK(lk_srv_stop_holdback("hello </", 8, S1, 2) == 2);
    CHECK(lk_srv_stop_holdback("hello </s", 9, S1, 2) == 3);
    CHECK(lk_srv_stop_holdback("hello\n", 6, S1, 2) == 1);
    CHECK(lk_srv_stop_holdback("hello\n\nUse", 10, S1, 2) == 5);
    /* ruled out */
    CHECK(lk_srv_stop_holdback("hello <x", 8, S1, 2) == 0);
    CHECK(lk_srv_stop_holdback("hello", 5, S1, 2) == 0);
    CHECK(lk_srv_stop_holdback("", 0, S1, 2) == 0);
    char *one[] = { "x" };
    CHECK(lk_srv_stop_holdback("abcx", 4, one, 1) == 0);   /* a whole match is found, not held */
}

static json_t *calls_of(const char *text, char **content) {
    char *calls = NULL;
    int n = lk_srv_parse_tool_calls(text, strlen(text), &calls, content);
    json_t *j = n ? json_loads(calls, 0, NULL) : NULL;
    free(calls);
    if (j) CHECK((int)json_array_size(j) == n);
    return j;
}

static bool call_is(json_t *c, const char *name, const char *args_json) {
    json_t *fn = json_object_get(c, "function");
    const char *id = json_string_value(json_object_get(c, "id"));
    json_t *a = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, NULL);
    json_t *b = json_loads(args_json, 0, NULL);
    bool ok = id && !strncmp(id, "call_", 5) && !strcmp(json_string_value(json_object_get(c, "type")), "function") &&
              !strcmp(json_string_value(json_object_get(fn, "name")), name) && a && b && json_equal(a, b);
    json_decref(a);
    json_decref(b);
    return ok;
}

TEST(tool_calls_hermes) {
    char *content = NULL;
    json_t *j = calls_of("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", &content);
    CHECK(j && call_is(json_array_get(j, 0), "get_weather", "{\"city\": \"Paris\"}"));
    CHECK(content == NULL);
    json_decref(j);
    free(content);
    /* two calls with text before them; an unclosed last one (cut by EOS) */
    j = calls_of("Let me check.\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n"
                 "<tool_call>{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}", &content);
    CHECK(j && json_array_size(j) == 2);
    CHECK(j && call_is(json_array_get(j, 0), "a", "{}") && call_is(json_array_get(j, 1), "b", "{\"x\": [1, 2]}"));
    CHECK(content && !strcmp(content, "Let me check."));
    json_decref(j);
    free(content);
    /* not JSON inside: no call, the text stays */
    j = calls_of("<tool_call>not json</tool_call>", &content);
    CHECK(j == NULL && content == NULL);
}

TEST(tool_calls_llama3) {
    char *content = NULL;
    json_t *j = calls_of(" {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}\n", &content);
    CHECK(j && call_is(json_array_get(j, 0), "get_weather", "{\"city\": \"Oslo\"}"));
    CHECK(content == NULL);
    json_decref(j);
    j = calls_of("<|python_tag|>{\"name\": \"f\", \"arguments\": {\"q\": \"x\"}}", &content);
    CHECK(j && call_is(json_array_get(j, 0), "f", "{\"q\": \"x\"}"));
    json_decref(j);
    /* JSON that is not a call, or followed by more text, is content */
    CHECK(calls_of("{\"a\": 1}", &content) == NULL);
    CHECK(calls_of("{\"name\": \"f\", \"parameters\": {}} and more", &content) == NULL);
}

TEST(tool_start) {
    CHECK(lk_srv_tool_start("hello", 5, 0) == 5);
    CHECK(lk_srv_tool_start("hi <tool_call>{", 15, 0) == 3);
    CHECK(lk_srv_tool_start("hi <tool", 8, 0) == 3);       /* may still become one */
    CHECK(lk_srv_tool_start("hi <b>", 6, 0) == 6);
    CHECK(lk_srv_tool_start("  {\"name\"", 9, 0) == 2);    /* Llama 3: a reply that opens with an object */
    CHECK(lk_srv_tool_start("a {", 3, 0) == 3);
    CHECK(lk_srv_tool_start("x <|python_tag|>", 16, 0) == 2);
}

int main(void) {
    RUN(stop_found_earliest);
    RUN(stop_holdback);
    RUN(tool_calls_hermes);
    RUN(tool_calls_llama3);
    RUN(tool_start);
    return lk_test_end();
}
