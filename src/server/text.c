/* The server's pure text functions: stop strings and tool calls
 * (server.h has the contract). */
#include "server/server.h"

#include <jansson.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

long lk_srv_find_stop(const char *text, size_t n, size_t from, char *const *stops, int n_stops) {
    long best = -1;
    for (int i = 0; i < n_stops; i++) {
        size_t m = strlen(stops[i]);
        if (!m || m > n) continue;
        for (size_t p = from; p + m <= n && (best < 0 || (long)p < best); p++)
            if (text[p] == stops[i][0] && !memcmp(text + p, stops[i], m)) {
                best = (long)p;
                break;
            }
    }
    return best;
}

size_t lk_srv_stop_holdback(const char *text, size_t n, char *const *stops, int n_stops) {
    size_t hold = 0;
    for (int i = 0; i < n_stops; i++) {
        size_t m = strlen(stops[i]);
        /* the longest k < m with text's last k bytes == the stop's first k */
        for (size_t k = LK_MIN(m - (m > 0), n); k > hold; k--)
            if (!memcmp(text + n - k, stops[i], k)) {
                hold = k;
                break;
            }
    }
    return hold;
}

static const char TOOL_OPEN[] = "<tool_call>", TOOL_CLOSE[] = "</tool_call>", PY_TAG[] = "<|python_tag|>";

size_t lk_srv_tool_start(const char *text, size_t n, size_t from) {
    size_t i = 0;
    while (i < n && (text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r')) i++;
    if (i < n && text[i] == '{') return i;       /* Llama 3: the reply is one JSON object */
    const char *marks[] = { TOOL_OPEN, PY_TAG };
    size_t best = n;
    for (int k = 0; k < 2; k++) {
        size_t m = strlen(marks[k]);
        for (size_t p = from; p < n && p < best; p++) {
            size_t have = LK_MIN(m, n - p);
            if (!memcmp(text + p, marks[k], have)) {
                best = p;
                break;
            }
        }
    }
    return best;
}

/* One call object from {"name": ..., "arguments" | "parameters": {...}}. */
static json_t *make_call(json_t *obj) {
    if (!json_is_object(obj)) return NULL;
    json_t *name = json_object_get(obj, "name");
    json_t *args = json_object_get(obj, "arguments");
    if (!args) args = json_object_get(obj, "parameters");
    if (!json_is_string(name) || !args) return NULL;
    char *a = json_is_string(args) ? strdup(json_string_value(args)) : json_dumps(args, JSON_COMPACT);
    if (!a) return NULL;
    unsigned char rnd[12];
    randombytes_buf(rnd, sizeof rnd);
    char id[40] = "call_";
    for (size_t i = 0; i < sizeof rnd; i++) snprintf(id + 5 + 2 * i, 3, "%02x", rnd[i]);
    json_t *fn = json_pack("{s:s, s:s}", "name", json_string_value(name), "arguments", a);
    free(a);
    return json_pack("{s:s, s:s, s:o}", "id", id, "type", "function", "function", fn);
}

static bool blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\n' && s[i] != '\t' && s[i] != '\r') return false;
    return true;
}

/* text without leading and trailing whitespace, malloc'd; NULL if blank */
static char *trimmed(const char *s, size_t n) {
    while (n && (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r')) { s++; n--; }
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\n' || s[n - 1] == '\t' || s[n - 1] == '\r')) n--;
    if (!n) return NULL;
    char *r = lk_xmalloc(n + 1);
    memcpy(r, s, n);
    r[n] = 0;
    return r;
}

int lk_srv_parse_tool_calls(const char *text, size_t n, char **calls_json, char **content) {
    *calls_json = NULL;
    *content = NULL;
    json_t *calls = json_array();
    char *rest = lk_xmalloc(n + 1);
    size_t nr = 0;
    /* Llama 3: the whole reply (after an optional <|python_tag|>) is one object */
    const char *s = text;
    size_t sn = n;
    while (sn && (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r')) { s++; sn--; }
    if (sn >= strlen(PY_TAG) && !memcmp(s, PY_TAG, strlen(PY_TAG))) { s += strlen(PY_TAG); sn -= strlen(PY_TAG); }
    if (sn && *s == '{') {
        json_error_t je;
        json_t *o = json_loadb(s, sn, JSON_DISABLE_EOF_CHECK, &je);
        json_t *c = o ? make_call(o) : NULL;
        if (c && blank(s + je.position, sn - (size_t)je.position)) json_array_append_new(calls, c);
        else json_decref(c);
        json_decref(o);
    }
    if (json_array_size(calls) == 0) {
        /* Hermes / Qwen: <tool_call>{...}</tool_call> blocks anywhere */
        size_t p = 0;
        while (p < n) {
            const char *q = memmem(text + p, n - p, TOOL_OPEN, strlen(TOOL_OPEN));
            if (!q) break;
            size_t a = (size_t)(q - text) + strlen(TOOL_OPEN);
            const char *e = memmem(text + a, n - a, TOOL_CLOSE, strlen(TOOL_CLOSE));
            size_t b = e ? (size_t)(e - text) : n;   /* an unclosed last block (cut by max_tokens or EOS) */
            json_t *o = json_loadb(text + a, b - a, 0, NULL);
            json_t *c = o ? make_call(o) : NULL;
            json_decref(o);
            if (!c) {                                 /* not a call: keep it as text */
                size_t end = e ? b + strlen(TOOL_CLOSE) : n;
                memcpy(rest + nr, text + p, end - p);
                nr += end - p;
                p = end;
                continue;
            }
            json_array_append_new(calls, c);
            memcpy(rest + nr, text + p, (size_t)(q - text) - p);
            nr += (size_t)(q - text) - p;
            p = e ? b + strlen(TOOL_CLOSE) : n;
        }
        if (json_array_size(calls)) {
            memcpy(rest + nr, text + p, n - p);
            nr += n - p;
        }
    }
    int k = (int)json_array_size(calls);
    if (k) {
        *calls_json = json_dumps(calls, JSON_COMPACT);
        *content = trimmed(rest, nr);
    }
    json_decref(calls);
    free(rest);
    return k;
}
