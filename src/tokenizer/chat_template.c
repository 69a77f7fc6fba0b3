/* chat_template — a small, safe Jinja-subset interpreter for chat templates.
 *
 * Three stages, each a section below: the lexer turns the template into
 * tokens (text, tag delimiters, expression tokens) applying Jinja's whitespace
 * rules; the parser builds a tree of statement and expression nodes; the
 * evaluator walks the tree against a scope chain and appends to an output
 * buffer.
 *
 * Memory: everything a render creates (tokens, nodes, values, strings,
 * buffers) lives in one arena that is freed in one go when the render ends,
 * so an error deep inside an expression can unwind with longjmp without
 * leaking: no malloc'd object is ever owned by a C stack frame in between.
 * The arena, the output and the loop iteration count are bounded, so a
 * hostile template cannot take the process down, only fail. */
#include "tokenizer/chat_template.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ limits */

#define MAX_TEMPLATE  (1u << 20)   /* template source bytes */
#define MAX_OUTPUT    (16u << 20)  /* bytes of any string, the output included */
#define MAX_ARENA     (256u << 20) /* all memory one render may hold */
#define MAX_DEPTH     256          /* nesting of expressions, statements, macro calls; keeps the
                                      * C stack under ~1 MiB even with sanitizers */
#define MAX_STEPS     2000000L     /* loop iterations + macro calls per render */

/* ------------------------------------------------------------------ arena */

typedef struct achunk {
    struct achunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} achunk;

typedef struct jctx jctx;
static _Noreturn void fail(jctx *c, lk_status st, int pos, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* --------------------------------------------------------------- values */

enum { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT, V_FUNC, V_MACRO };

typedef struct jstr { size_t n; char p[]; } jstr;  /* p is NUL-terminated too */
typedef struct jlist jlist;
typedef struct jdict jdict;
typedef struct node node;

typedef struct jv {
    int t;
    union {
        bool b;
        int64_t i;
        double f;
        jstr *s;
        jlist *l;
        jdict *d;
        int fn;             /* V_FUNC: F_* */
        node *m;            /* V_MACRO */
        const char *uname;  /* V_UNDEF: the name that was missing, for errors */
    };
} jv;

struct jlist { int n, cap; bool tuple; jv *a; }; /* tuple: prints as (a, b), else a list */
struct jdict { int n, cap; bool ns; jstr **k; jv *v; }; /* insertion-ordered; ns: namespace() */

enum { F_RAISE, F_NAMESPACE, F_RANGE, F_DICT, F_STRFTIME };

/* ------------------------------------------------------------------ tokens */

enum {
    T_EOF, T_TEXT, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END,
    T_NAME, T_STR, T_INT, T_FLOAT, T_OP,
};

typedef struct {
    int t, pos;
    jstr *s;       /* T_TEXT, T_NAME, T_STR (decoded), T_OP (spelling) */
    int64_t i;
    double f;
} tok;

/* ------------------------------------------------------------------ nodes */

enum {
    /* expressions */
    E_LIT, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NEG, E_POS,
    E_NOT, E_AND, E_OR, E_BIN, E_CMP, E_COND, E_LIST, E_DICT,
    /* statements */
    S_TEXT, S_OUT, S_IF, S_FOR, S_SET, S_SETATTR, S_SETBLOCK, S_MACRO, S_FILTER,
    S_BREAK, S_CONTINUE, S_BODY,
};

struct node {
    int k, pos;
    jv lit;              /* E_LIT */
    jstr *name;          /* E_NAME, E_ATTR, E_FILTER, E_TEST, S_SET(ATTR), S_MACRO; op spelling for E_BIN/E_CMP */
    node *a, *b, *c;     /* operands; S_IF: a=cond; S_FOR: a=iter, b=filter cond */
    node **args; int nargs;
    jstr **kwn; node **kwv; int nkw;
    bool neg;            /* E_TEST: `is not`; E_LIST: a tuple */
    node **body; int nbody;
    node **els;  int nels;
    jstr **tg;   int ntg; /* S_FOR / S_SET targets; S_MACRO parameter names (defaults in kwv) */
};

/* ------------------------------------------------------------------ context */

typedef struct { char *p; size_t n, cap; } sbuf;

typedef struct frame { struct frame *parent; jdict *vars; } frame;

struct jctx {
    achunk *chunks;
    size_t arena_total;
    jmp_buf jb;
    lk_status st;
    char *err; size_t errlen;
    const char *src; size_t srclen;
    /* lexer/parser */
    tok *toks; int ntoks, captoks, tp;
    /* evaluator */
    frame *root;
    int depth;
    long steps;
    json_t *pending;  /* a parsed JSON document being converted, freed on error */
};

/* Messages quote the template (names, tokens, raise_exception's text), which
 * comes from the model file: written through lk_str_sanitize, so its
 * escapes reach no terminal (a backslash of our own shows as \\). */
static _Noreturn void fail(jctx *c, lk_status st, int pos, const char *fmt, ...) {
    char raw[384], msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    lk_str_sanitize(msg, sizeof msg, raw, strlen(raw));
    if (pos >= 0 && c->src) {
        int line = 1, col = 1;
        for (int i = 0; i < pos && (size_t)i < c->srclen; i++) {
            if (c->src[i] == '\n') { line++; col = 1; } else col++;
        }
        lk_fail(c->err, c->errlen, st, "chat template line %d col %d: %s", line, col, msg);
    } else {
        lk_fail(c->err, c->errlen, st, "chat template: %s", msg);
    }
    c->st = st;
    longjmp(c->jb, 1);
}

static void *amalloc(jctx *c, size_t n) {
    n = (n + 15) & ~(size_t)15;
    achunk *h = c->chunks;
    if (!h || h->cap - h->used < n) {
        size_t cap = n > (64u << 10) ? n : (64u << 10);
        if (c->arena_total + cap > MAX_ARENA)
            fail(c, LK_ERR_NOMEM, -1, "render needs more than %u MiB of memory", MAX_ARENA >> 20);
        h = malloc(sizeof *h + cap);
        if (!h) fail(c, LK_ERR_NOMEM, -1, "out of memory");
        h->cap = cap; h->used = 0; h->next = c->chunks; c->chunks = h;
        c->arena_total += cap;
    }
    void *p = h->data + h->used;
    h->used += n;
    return p;
}

static void *acalloc(jctx *c, size_t n) { void *p = amalloc(c, n); memset(p, 0, n); return p; }

static void arena_free(jctx *c) {
    for (achunk *h = c->chunks, *nx; h; h = nx) { nx = h->next; free(h); }
    c->chunks = NULL;
}

/* Grows an arena array of elem-sized items to hold at least need items. */
static void *agrow(jctx *c, void *old, int n, int *cap, int need, size_t elem) {
    if (need <= *cap) return old;
    int nc = *cap ? *cap * 2 : 8;
    while (nc < need) nc *= 2;
    void *p = amalloc(c, (size_t)nc * elem);
    if (n) memcpy(p, old, (size_t)n * elem);
    *cap = nc;
    return p;
}

/* ------------------------------------------------------------ strings */

static jstr *mkstr(jctx *c, const char *p, size_t n) {
    if (n > MAX_OUTPUT) fail(c, LK_ERR_FORMAT, -1, "string longer than %u MiB", MAX_OUTPUT >> 20);
    jstr *s = amalloc(c, sizeof *s + n + 1);
    s->n = n;
    if (n) memcpy(s->p, p, n);
    s->p[n] = 0;
    return s;
}
static jstr *cstr(jctx *c, const char *p) { return mkstr(c, p, strlen(p)); }

static void sb_put(jctx *c, sbuf *b, const char *p, size_t n) {
    if (!n) return;
    if (b->n + n > MAX_OUTPUT) fail(c, LK_ERR_FORMAT, -1, "output longer than %u MiB", MAX_OUTPUT >> 20);
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        while (nc < b->n + n + 1) nc *= 2;
        char *np = amalloc(c, nc);
        if (b->n) memcpy(np, b->p, b->n);
        b->p = np; b->cap = nc;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_puts(jctx *c, sbuf *b, const char *s) { sb_put(c, b, s, strlen(s)); }
static void sb_printf(jctx *c, sbuf *b, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void sb_printf(jctx *c, sbuf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) sb_put(c, b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}
static jstr *sb_str(jctx *c, sbuf *b) { return mkstr(c, b->p ? b->p : "", b->n); }

/* UTF-8: length of the sequence starting with byte b (1 for invalid bytes, so
 * every byte string still splits into "characters"). */
static size_t u8len(const char *p, size_t n) {
    unsigned char b = (unsigned char)p[0];
    size_t l = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1;
    if (l > n) return 1;
    for (size_t i = 1; i < l; i++)
        if (((unsigned char)p[i] & 0xC0) != 0x80) return 1;
    return l;
}
static int64_t u8count(const jstr *s) {
    int64_t k = 0;
    for (size_t i = 0; i < s->n; i += u8len(s->p + i, s->n - i)) k++;
    return k;
}
/* Byte offset of code point index ci (0 <= ci <= count). */
static size_t u8off(const jstr *s, int64_t ci) {
    size_t i = 0;
    while (ci-- > 0 && i < s->n) i += u8len(s->p + i, s->n - i);
    return i;
}

/* Python's str.isspace() for the characters templates meet: ASCII whitespace,
 * the separators 0x1c-0x1f, NEL, NBSP and the Unicode space block. Returns
 * the byte length of the space at p, or 0. */
static size_t space_at(const char *p, size_t n) {
    unsigned char b = (unsigned char)p[0];
    if (b == ' ' || (b >= 0x09 && b <= 0x0d) || (b >= 0x1c && b <= 0x1f)) return 1;
    if (n >= 2 && b == 0xC2 && ((unsigned char)p[1] == 0x85 || (unsigned char)p[1] == 0xA0)) return 2;
    if (n >= 3) {
        unsigned cp = ((b & 0x0Fu) << 12) | (((unsigned char)p[1] & 0x3Fu) << 6) | ((unsigned char)p[2] & 0x3Fu);
        if ((b >> 4) == 14 && (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
                               cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000))
            return 3;
    }
    return 0;
}
/* Length of the space ending at p+n (looking backwards), or 0. */
static size_t space_before(const char *p, size_t n) {
    for (size_t l = 1; l <= 3 && l <= n; l++) {
        size_t k = space_at(p + n - l, l);
        if (k == l) return l;
    }
    return 0;
}

/* ------------------------------------------------------------ value helpers */

static jv v_undef(const char *name) { jv v = { .t = V_UNDEF }; v.uname = name; return v; }
static jv v_none(void) { jv v = { .t = V_NONE }; return v; }
static jv v_bool(bool b) { jv v = { .t = V_BOOL }; v.b = b; return v; }
static jv v_int(int64_t i) { jv v = { .t = V_INT }; v.i = i; return v; }
static jv v_float(double f) { jv v = { .t = V_FLOAT }; v.f = f; return v; }
static jv v_str(jstr *s) { jv v = { .t = V_STR }; v.s = s; return v; }
static jv v_cstr(jctx *c, const char *s) { return v_str(cstr(c, s)); }
static jv v_list(jlist *l) { jv v = { .t = V_LIST }; v.l = l; return v; }
static jv v_dict(jdict *d) { jv v = { .t = V_DICT }; v.d = d; return v; }

static jlist *list_new(jctx *c) { return acalloc(c, sizeof(jlist)); }
static void list_push(jctx *c, jlist *l, jv v) {
    if (l->n >= (1 << 24)) fail(c, LK_ERR_FORMAT, -1, "list longer than %d items", 1 << 24);
    l->a = agrow(c, l->a, l->n, &l->cap, l->n + 1, sizeof(jv));
    l->a[l->n++] = v;
}
static jdict *dict_new(jctx *c) { return acalloc(c, sizeof(jdict)); }
static int dict_find(const jdict *d, const char *k, size_t n) {
    for (int i = 0; i < d->n; i++)
        if (d->k[i]->n == n && memcmp(d->k[i]->p, k, n) == 0) return i;
    return -1;
}
static void dict_set(jctx *c, jdict *d, jstr *k, jv v) {
    int i = dict_find(d, k->p, k->n);
    if (i >= 0) { d->v[i] = v; return; }
    int cap = d->cap;
    d->k = agrow(c, d->k, d->n, &cap, d->n + 1, sizeof(jstr *));
    cap = d->cap;
    d->v = agrow(c, d->v, d->n, &cap, d->n + 1, sizeof(jv));
    d->cap = cap;
    d->k[d->n] = k; d->v[d->n] = v; d->n++;
}
static bool dict_get(const jdict *d, const char *k, jv *out) {
    int i = dict_find(d, k, strlen(k));
    if (i < 0) return false;
    *out = d->v[i];
    return true;
}

static const char *type_name(const jv *v) {
    switch (v->t) {
    case V_UNDEF: return "undefined";
    case V_NONE: return "none";
    case V_BOOL: return "boolean";
    case V_INT: return "integer";
    case V_FLOAT: return "float";
    case V_STR: return "string";
    case V_LIST: return "list";
    case V_DICT: return v->d->ns ? "namespace" : "dict";
    case V_FUNC: return "function";
    case V_MACRO: return "macro";
    }
    return "?";
}

static bool truthy(const jv *v) {
    switch (v->t) {
    case V_UNDEF: case V_NONE: return false;
    case V_BOOL: return v->b;
    case V_INT: return v->i != 0;
    case V_FLOAT: return v->f != 0.0;
    case V_STR: return v->s->n != 0;
    case V_LIST: return v->l->n != 0;
    case V_DICT: return v->d->ns || v->d->n != 0;
    default: return true;
    }
}

static bool is_num(const jv *v) { return v->t == V_BOOL || v->t == V_INT || v->t == V_FLOAT; }
static double num_f(const jv *v) { return v->t == V_FLOAT ? v->f : v->t == V_INT ? (double)v->i : v->b; }
static int64_t num_i(const jv *v) { return v->t == V_INT ? v->i : v->t == V_BOOL ? v->b : (int64_t)v->f; }

/* Python ==. Values nested deeper than any template builds on purpose (a
 * bounded recursion) compare unequal rather than overflow the stack. */
static bool veq_d(const jv *a, const jv *b, int lvl) {
    if (lvl > 256) return false;
    if (is_num(a) && is_num(b)) {
        if (a->t != V_FLOAT && b->t != V_FLOAT) return num_i(a) == num_i(b);
        return num_f(a) == num_f(b);
    }
    if (a->t != b->t) return false;
    switch (a->t) {
    case V_UNDEF: case V_NONE: return true;
    case V_STR: return a->s->n == b->s->n && memcmp(a->s->p, b->s->p, a->s->n) == 0;
    case V_LIST:
        if (a->l == b->l) return true;
        if (a->l->n != b->l->n) return false;
        for (int i = 0; i < a->l->n; i++)
            if (!veq_d(&a->l->a[i], &b->l->a[i], lvl + 1)) return false;
        return true;
    case V_DICT:
        if (a->d == b->d) return true;
        if (a->d->ns || b->d->ns || a->d->n != b->d->n) return false;
        for (int i = 0; i < a->d->n; i++) {
            int j = dict_find(b->d, a->d->k[i]->p, a->d->k[i]->n);
            if (j < 0 || !veq_d(&a->d->v[i], &b->d->v[j], lvl + 1)) return false;
        }
        return true;
    case V_FUNC: return a->fn == b->fn;
    case V_MACRO: return a->m == b->m;
    }
    return false;
}
static bool veq(const jv *a, const jv *b) { return veq_d(a, b, 0); }

/* Python's repr() of a float: the shortest digits that read back the same,
 * positional for exponents -4..15, otherwise d.ddde+XX; integral values keep
 * a ".0". */
static void fmt_float(double f, char *out, size_t cap) {
    if (isnan(f)) { snprintf(out, cap, "nan"); return; }
    if (isinf(f)) { snprintf(out, cap, f < 0 ? "-inf" : "inf"); return; }
    if (f == 0) { snprintf(out, cap, signbit(f) ? "-0.0" : "0.0"); return; }
    char e[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, f);
        if (strtod(e, NULL) == f) break;
    }
    /* e = [-]d[.ddd]e[+-]XX */
    char digits[24]; int nd = 0; bool negative = e[0] == '-';
    const char *q = e + negative;
    for (; *q && *q != 'e'; q++) if (*q >= '0' && *q <= '9') digits[nd++] = *q;
    int ex = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    char *o = out; size_t left = cap;
#define PUT(ch) do { if (left > 1) { *o++ = (ch); left--; } } while (0)
    if (negative) PUT('-');
    if (ex >= -4 && ex < 16) {
        if (ex < 0) {
            PUT('0'); PUT('.');
            for (int i = 0; i < -ex - 1; i++) PUT('0');
            for (int i = 0; i < nd; i++) PUT(digits[i]);
        } else {
            for (int i = 0; i <= ex; i++) PUT(i < nd ? digits[i] : '0');
            PUT('.');
            if (nd > ex + 1) for (int i = ex + 1; i < nd; i++) PUT(digits[i]);
            else PUT('0');
        }
    } else {
        PUT(digits[0]);
        if (nd > 1) { PUT('.'); for (int i = 1; i < nd; i++) PUT(digits[i]); }
        char x[16];
        snprintf(x, sizeof x, "e%c%02d", ex < 0 ? '-' : '+', ex < 0 ? -ex : ex);
        for (char *y = x; *y; y++) PUT(*y);
    }
#undef PUT
    *o = 0;
}

static void repr_str(jctx *c, sbuf *b, const jstr *s) {
    bool has_sq = memchr(s->p, '\'', s->n) != NULL, has_dq = memchr(s->p, '"', s->n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    sb_put(c, b, &q, 1);
    for (size_t i = 0; i < s->n; i++) {
        unsigned char ch = (unsigned char)s->p[i];
        if (ch == '\\') sb_puts(c, b, "\\\\");
        else if (ch == (unsigned char)q) { sb_put(c, b, "\\", 1); sb_put(c, b, &s->p[i], 1); }
        else if (ch == '\n') sb_puts(c, b, "\\n");
        else if (ch == '\r') sb_puts(c, b, "\\r");
        else if (ch == '\t') sb_puts(c, b, "\\t");
        else if (ch < 0x20 || ch == 0x7f) sb_printf(c, b, "\\x%02x", ch);
        else sb_put(c, b, &s->p[i], 1);
    }
    sb_put(c, b, &q, 1);
}

static void to_str_into(jctx *c, sbuf *b, const jv *v, bool repr);
static void enter(jctx *c, int pos);
static void leave(jctx *c);

/* Python's str() (repr for items inside lists and dicts). */
static void to_str_into(jctx *c, sbuf *b, const jv *v, bool repr) {
    char tmp[40];
    if (v->t == V_LIST || v->t == V_DICT) enter(c, -1);
    switch (v->t) {
    case V_UNDEF: break;
    case V_NONE: sb_puts(c, b, "None"); break;
    case V_BOOL: sb_puts(c, b, v->b ? "True" : "False"); break;
    case V_INT: sb_printf(c, b, "%lld", (long long)v->i); break;
    case V_FLOAT: fmt_float(v->f, tmp, sizeof tmp); sb_puts(c, b, tmp); break;
    case V_STR: if (repr) repr_str(c, b, v->s); else sb_put(c, b, v->s->p, v->s->n); break;
    case V_LIST:
        sb_put(c, b, v->l->tuple ? "(" : "[", 1);
        for (int i = 0; i < v->l->n; i++) {
            if (i) sb_puts(c, b, ", ");
            to_str_into(c, b, &v->l->a[i], true);
        }
        if (v->l->tuple && v->l->n == 1) sb_put(c, b, ",", 1);
        sb_put(c, b, v->l->tuple ? ")" : "]", 1);
        break;
    case V_DICT:
        if (v->d->ns) sb_puts(c, b, "<Namespace {");
        else sb_put(c, b, "{", 1);
        for (int i = 0; i < v->d->n; i++) {
            if (i) sb_puts(c, b, ", ");
            repr_str(c, b, v->d->k[i]);
            sb_puts(c, b, ": ");
            to_str_into(c, b, &v->d->v[i], true);
        }
        sb_puts(c, b, v->d->ns ? "}>" : "}");
        break;
    case V_FUNC: sb_puts(c, b, "<built-in function>"); break;
    case V_MACRO: sb_puts(c, b, "<macro>"); break;
    }
    if (v->t == V_LIST || v->t == V_DICT) leave(c);
}

static jstr *to_str(jctx *c, const jv *v) {
    if (v->t == V_STR) return v->s;
    sbuf b = {0};
    to_str_into(c, &b, v, false);
    return sb_str(c, &b);
}

/* HF's tojson: json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort). */
static void json_str(jctx *c, sbuf *b, const jstr *s) {
    sb_put(c, b, "\"", 1);
    for (size_t i = 0; i < s->n; i++) {
        unsigned char ch = (unsigned char)s->p[i];
        switch (ch) {
        case '"': sb_puts(c, b, "\\\""); break;
        case '\\': sb_puts(c, b, "\\\\"); break;
        case '\n': sb_puts(c, b, "\\n"); break;
        case '\r': sb_puts(c, b, "\\r"); break;
        case '\t': sb_puts(c, b, "\\t"); break;
        case '\b': sb_puts(c, b, "\\b"); break;
        case '\f': sb_puts(c, b, "\\f"); break;
        default:
            if (ch < 0x20) sb_printf(c, b, "\\u%04x", ch);
            else sb_put(c, b, &s->p[i], 1);
        }
    }
    sb_put(c, b, "\"", 1);
}

static int cmp_keys(const void *a, const void *b) {
    const jstr *x = *(jstr *const *)a, *y = *(jstr *const *)b;
    size_t n = x->n < y->n ? x->n : y->n;
    int r = memcmp(x->p, y->p, n);
    return r ? r : (x->n > y->n) - (x->n < y->n);
}

static void to_json(jctx *c, sbuf *b, const jv *v, int indent, bool sort, int level, int pos) {
    if (level > MAX_DEPTH) fail(c, LK_ERR_FORMAT, pos, "tojson: value nested too deeply");
    char tmp[40];
    switch (v->t) {
    case V_UNDEF: case V_NONE: sb_puts(c, b, "null"); return;
    case V_BOOL: sb_puts(c, b, v->b ? "true" : "false"); return;
    case V_INT: sb_printf(c, b, "%lld", (long long)v->i); return;
    case V_FLOAT:
        if (isnan(v->f)) sb_puts(c, b, "NaN");
        else if (isinf(v->f)) sb_puts(c, b, v->f < 0 ? "-Infinity" : "Infinity");
        else { fmt_float(v->f, tmp, sizeof tmp); sb_puts(c, b, tmp); }
        return;
    case V_STR: json_str(c, b, v->s); return;
    case V_LIST: case V_DICT: {
        bool isl = v->t == V_LIST;
        int n = isl ? v->l->n : v->d->n;
        sb_put(c, b, isl ? "[" : "{", 1);
        if (n == 0) { sb_put(c, b, isl ? "]" : "}", 1); return; }
        int *order = NULL;
        if (!isl) {
            order = amalloc(c, sizeof(int) * (size_t)n);
            for (int i = 0; i < n; i++) order[i] = i;
            if (sort) { /* stable insertion sort by key: dicts here are small */
                for (int i = 1; i < n; i++)
                    for (int j = i; j > 0 && cmp_keys(&v->d->k[order[j - 1]], &v->d->k[order[j]]) > 0; j--) {
                        int t = order[j]; order[j] = order[j - 1]; order[j - 1] = t;
                    }
            }
        }
        for (int i = 0; i < n; i++) {
            if (i) sb_puts(c, b, indent >= 0 ? "," : ", ");
            if (indent >= 0) {
                sb_put(c, b, "\n", 1);
                for (int s = 0; s < indent * (level + 1); s++) sb_put(c, b, " ", 1);
            }
            if (isl) {
                to_json(c, b, &v->l->a[i], indent, sort, level + 1, pos);
            } else {
                json_str(c, b, v->d->k[order[i]]);
                sb_puts(c, b, ": ");
                to_json(c, b, &v->d->v[order[i]], indent, sort, level + 1, pos);
            }
        }
        if (indent >= 0) {
            sb_put(c, b, "\n", 1);
            for (int s = 0; s < indent * level; s++) sb_put(c, b, " ", 1);
        }
        sb_put(c, b, isl ? "]" : "}", 1);
        return;
    }
    default: fail(c, LK_ERR_FORMAT, pos, "tojson: cannot serialise a %s", type_name(v));
    }
}

/* ------------------------------------------------------------------ lexer */

static void push_tok(jctx *c, tok t) {
    c->toks = agrow(c, c->toks, c->ntoks, &c->captoks, c->ntoks + 1, sizeof(tok));
    c->toks[c->ntoks++] = t;
}

static bool is_ident0(char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_'; }
static bool is_digit(char ch) { return ch >= '0' && ch <= '9'; }
static bool is_ident(char ch) { return is_ident0(ch) || is_digit(ch); }
static bool is_ws(char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f'; }

static void put_utf8(jctx *c, sbuf *b, uint32_t cp) {
    char u[4]; size_t n;
    if (cp < 0x80) { u[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F)); n = 2; }
    else if (cp < 0x10000) { u[0] = (char)(0xE0 | (cp >> 12)); u[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[2] = (char)(0x80 | (cp & 0x3F)); n = 3; }
    else { u[0] = (char)(0xF0 | (cp >> 18)); u[1] = (char)(0x80 | ((cp >> 12) & 0x3F)); u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[3] = (char)(0x80 | (cp & 0x3F)); n = 4; }
    sb_put(c, b, u, n);
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* A Python string literal starting at src[*pi] (the quote); escapes as Python
 * decodes them. Returns the decoded string and moves *pi past the literal. */
static jstr *lex_string(jctx *c, size_t *pi, size_t end) {
    const char *s = c->src;
    size_t i = *pi;
    char q = s[i++];
    sbuf b = {0};
    sb_put(c, &b, "", 0);
    for (;;) {
        if (i >= end) fail(c, LK_ERR_FORMAT, (int)*pi, "unterminated string literal");
        char ch = s[i];
        if (ch == q) { i++; break; }
        if (ch != '\\') { sb_put(c, &b, &s[i], 1); i++; continue; }
        if (i + 1 >= end) fail(c, LK_ERR_FORMAT, (int)*pi, "unterminated string literal");
        char e = s[i + 1];
        i += 2;
        switch (e) {
        case 'n': sb_put(c, &b, "\n", 1); break;
        case 't': sb_put(c, &b, "\t", 1); break;
        case 'r': sb_put(c, &b, "\r", 1); break;
        case 'b': sb_put(c, &b, "\b", 1); break;
        case 'f': sb_put(c, &b, "\f", 1); break;
        case 'v': sb_put(c, &b, "\v", 1); break;
        case 'a': sb_put(c, &b, "\a", 1); break;
        case '0': sb_put(c, &b, "\0", 1); break;
        case '\\': sb_put(c, &b, "\\", 1); break;
        case '\'': sb_put(c, &b, "'", 1); break;
        case '"': sb_put(c, &b, "\"", 1); break;
        case '\n': break; /* line continuation */
        case 'x': case 'u': case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int k = 0; k < nd; k++) {
                int h = i + (size_t)k < end ? hexval(s[i + k]) : -1;
                if (h < 0) fail(c, LK_ERR_FORMAT, (int)i - 2, "bad \\%c escape in string literal", e);
                cp = cp * 16 + (uint32_t)h;
            }
            if (cp > 0x10FFFF) fail(c, LK_ERR_FORMAT, (int)i - 2, "bad \\%c escape in string literal", e);
            i += (size_t)nd;
            put_utf8(c, &b, cp);
            break;
        }
        default: /* Python keeps unknown escapes as written */
            sb_put(c, &b, "\\", 1);
            sb_put(c, &b, &e, 1);
        }
    }
    *pi = i;
    return sb_str(c, &b);
}

static const char *const OPS[] = {
    "**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "=",
    "(", ")", "[", "]", "{", "}", ",", ".", ":", "|", NULL,
};

/* Lexes the inside of a {{ }} or {% %} tag starting at i; stops at the closing
 * delimiter (not consumed). Returns the index of the closing delimiter and
 * whether it carried a '-' (strip following whitespace) or '+'. */
static size_t lex_tag(jctx *c, size_t i, size_t end, bool is_var, int open_pos, char *sign) {
    const char *s = c->src;
    int braces = 0;
    for (;;) {
        while (i < end && is_ws(s[i])) i++;
        if (i >= end) fail(c, LK_ERR_FORMAT, open_pos, "unclosed %s tag", is_var ? "{{" : "{%");
        /* closing delimiter, possibly with a '-' or '+' in front */
        /* the closing delimiter, possibly with '-' or '+' in front; inside
         * an expression `}}` may also close nested dict literals */
        char close = is_var ? '}' : '%';
        bool can_close = braces == 0 || !is_var;
        size_t k = i;
        char sg = 0;
        if ((s[k] == '-' || s[k] == '+') && k + 2 < end && s[k + 1] == close && s[k + 2] == '}') {
            sg = s[k];
            k++;
        }
        if (can_close && s[k] == close && k + 1 < end && s[k + 1] == '}') {
            *sign = sg;
            return k;
        }
        if (!is_var && s[k] == '}' && k + 1 < end && s[k + 1] == '}' && braces == 0)
            fail(c, LK_ERR_FORMAT, (int)i, "'}}' inside a {%% %%} tag");
        tok t = { .pos = (int)i };
        char ch = s[i];
        if (ch == '\'' || ch == '"') {
            t.t = T_STR;
            t.s = lex_string(c, &i, end);
        } else if (is_digit(ch)) {
            size_t j = i;
            while (j < end && (is_digit(s[j]) || s[j] == '_')) j++;
            bool isf = false;
            if (j + 1 < end && s[j] == '.' && is_digit(s[j + 1])) {
                isf = true; j++;
                while (j < end && (is_digit(s[j]) || s[j] == '_')) j++;
            }
            if (j < end && (s[j] == 'e' || s[j] == 'E')) {
                size_t m = j + 1;
                if (m < end && (s[m] == '+' || s[m] == '-')) m++;
                if (m < end && is_digit(s[m])) {
                    isf = true; j = m;
                    while (j < end && is_digit(s[j])) j++;
                }
            }
            char num[64]; size_t nn = 0;
            for (size_t q = i; q < j && nn < sizeof num - 1; q++) if (s[q] != '_') num[nn++] = s[q];
            num[nn] = 0;
            if (j - i >= sizeof num - 1) fail(c, LK_ERR_FORMAT, (int)i, "number literal too long");
            if (isf) { t.t = T_FLOAT; t.f = strtod(num, NULL); }
            else {
                t.t = T_INT;
                errno = 0;
                unsigned long long u = strtoull(num, NULL, 10);
                if (errno || u > INT64_MAX) fail(c, LK_ERR_FORMAT, (int)i, "integer literal too large");
                t.i = (int64_t)u;
            }
            i = j;
        } else if (is_ident0(ch)) {
            size_t j = i;
            while (j < end && is_ident(s[j])) j++;
            t.t = T_NAME;
            t.s = mkstr(c, s + i, j - i);
            i = j;
        } else {
            int o;
            for (o = 0; OPS[o]; o++) {
                size_t l = strlen(OPS[o]);
                if (i + l <= end && memcmp(s + i, OPS[o], l) == 0) break;
            }
            if (!OPS[o]) fail(c, LK_ERR_FORMAT, (int)i, "unexpected character '%c' in tag", ch);
            t.t = T_OP;
            t.s = cstr(c, OPS[o]);
            if (ch == '{') braces++;
            else if (ch == '}' && braces > 0) braces--;
            i += strlen(OPS[o]);
        }
        push_tok(c, t);
    }
}

/* Jinja (and llama.cpp) read "\r\n" and a lone "\r" as "\n", in text and in
 * string literals alike; then the source is lexed. */
static void lex(jctx *c);
static void load_source(jctx *c, const char *src, size_t n) {
    c->src = src;
    c->srclen = n;
    if (memchr(src, '\r', n)) {
        char *norm = amalloc(c, n + 1);
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (src[i] == '\r') {
                norm[k++] = '\n';
                if (i + 1 < n && src[i + 1] == '\n') i++;
            } else norm[k++] = src[i];
        }
        norm[k] = 0;
        c->src = norm;
        c->srclen = k;
    }
    lex(c);
}

/* Jinja's whitespace rules, as HF and llama.cpp configure them
 * (trim_blocks, lstrip_blocks, keep_trailing_newline off). */
static void lex(jctx *c) {
    const char *s = c->src;
    size_t end = c->srclen, i = 0;
    if (end && s[end - 1] == '\n') end--;
    bool strip_next = false;   /* previous tag ended with '-' */
    bool trim_next = false;    /* previous tag was a block/comment without '+' */
    bool line_start = true;    /* the text starts at the beginning of a line */
    while (i <= end) {
        size_t j = i;
        while (j + 1 < end && !(s[j] == '{' && (s[j + 1] == '{' || s[j + 1] == '%' || s[j + 1] == '#'))) j++;
        if (j + 1 >= end) j = end;
        size_t ts = i, te = j;
        if (strip_next) {
            while (ts < te && is_ws(s[ts])) ts++;
            line_start = ts > i && s[ts - 1] == '\n';
        } else if (trim_next) {
            if (ts < te && s[ts] == '\n') { ts++; line_start = true; }
        }
        if (j < end) {
            char kind = s[j + 1];
            char sign = j + 2 < end ? s[j + 2] : 0;
            if (sign == '-') {
                while (te > ts && is_ws(s[te - 1])) te--;
            } else if (sign != '+' && kind != '{') {
                size_t l = te;
                while (l > ts && s[l - 1] != '\n') l--;
                bool at_line = l > ts || line_start;
                bool blank = true;
                for (size_t q = l; q < te; q++) if (!is_ws(s[q])) { blank = false; break; }
                if (at_line && blank) te = l;
            }
        }
        if (te > ts) push_tok(c, (tok){ .t = T_TEXT, .pos = (int)ts, .s = mkstr(c, s + ts, te - ts) });
        if (j >= end) break;
        char kind = s[j + 1];
        size_t body = j + 2;
        if (body < end && (s[body] == '-' || s[body] == '+')) body++;
        if (kind == '#') {
            size_t k = body;
            while (k + 1 < end && !(s[k] == '#' && s[k + 1] == '}')) k++;
            if (k + 1 >= end) fail(c, LK_ERR_FORMAT, (int)j, "unclosed comment '{#'");
            char sg = k > body && (s[k - 1] == '-' || s[k - 1] == '+') ? s[k - 1] : 0;
            strip_next = sg == '-';
            trim_next = sg == 0;
            line_start = false;
            i = k + 2;
            continue;
        }
        bool is_var = kind == '{';
        /* {% raw %} ... {% endraw %}: the text between is output as written */
        if (!is_var) {
            size_t k = body;
            while (k < end && is_ws(s[k])) k++;
            if (k + 3 <= end && memcmp(s + k, "raw", 3) == 0 && (k + 3 == end || !is_ident(s[k + 3]))) {
                size_t m = k + 3;
                while (m < end && is_ws(s[m])) m++;
                char sg = 0;
                if (m < end && (s[m] == '-' || s[m] == '+')) sg = s[m++];
                if (m + 1 < end && s[m] == '%' && s[m + 1] == '}') {
                    size_t rs = m + 2, r = rs;
                    for (;;) {
                        while (r + 1 < end && !(s[r] == '{' && s[r + 1] == '%')) r++;
                        if (r + 1 >= end) fail(c, LK_ERR_FORMAT, (int)j, "'raw' block without 'endraw'");
                        size_t q = r + 2;
                        char esg = 0;
                        if (q < end && (s[q] == '-' || s[q] == '+')) esg = s[q++];
                        while (q < end && is_ws(s[q])) q++;
                        if (q + 6 <= end && memcmp(s + q, "endraw", 6) == 0) {
                            q += 6;
                            while (q < end && is_ws(s[q])) q++;
                            char csg = 0;
                            if (q < end && (s[q] == '-' || s[q] == '+')) csg = s[q++];
                            if (q + 1 < end && s[q] == '%' && s[q + 1] == '}') {
                                size_t a = rs, bnd = r;
                                if (sg == '-') while (a < bnd && is_ws(s[a])) a++;
                                else if (sg != '+' && a < bnd && s[a] == '\n') a++;
                                if (esg == '-') while (bnd > a && is_ws(s[bnd - 1])) bnd--;
                                if (bnd > a) push_tok(c, (tok){ .t = T_TEXT, .pos = (int)a, .s = mkstr(c, s + a, bnd - a) });
                                strip_next = csg == '-';
                                trim_next = csg == 0;
                                line_start = false;
                                i = q + 2;
                                break;
                            }
                        }
                        r += 2;
                    }
                    continue;
                }
            }
        }
        push_tok(c, (tok){ .t = is_var ? T_VAR_BEGIN : T_BLOCK_BEGIN, .pos = (int)j });
        char sg = 0;
        size_t k = lex_tag(c, body, end, is_var, (int)j, &sg);
        push_tok(c, (tok){ .t = is_var ? T_VAR_END : T_BLOCK_END, .pos = (int)k });
        strip_next = sg == '-';
        trim_next = !is_var && sg == 0;
        line_start = false;
        i = k + 2;
    }
    push_tok(c, (tok){ .t = T_EOF, .pos = (int)c->srclen });
}

/* ------------------------------------------------------------------ parser */

static tok *peek(jctx *c) { return &c->toks[c->tp]; }
static tok *peek2(jctx *c) { return &c->toks[c->tp + 1 < c->ntoks ? c->tp + 1 : c->tp]; }
static tok *next(jctx *c) { tok *t = &c->toks[c->tp]; if (t->t != T_EOF) c->tp++; return t; }
static bool is_op(const tok *t, const char *op) { return t->t == T_OP && strcmp(t->s->p, op) == 0; }
static bool is_name(const tok *t, const char *nm) { return t->t == T_NAME && strcmp(t->s->p, nm) == 0; }
static bool accept_op(jctx *c, const char *op) { if (is_op(peek(c), op)) { next(c); return true; } return false; }
static bool accept_name(jctx *c, const char *nm) { if (is_name(peek(c), nm)) { next(c); return true; } return false; }

static const char *tok_desc(const tok *t) {
    switch (t->t) {
    case T_EOF: return "end of template";
    case T_TEXT: return "text";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_STR: return "a string";
    case T_INT: case T_FLOAT: return "a number";
    default: return t->s->p;
    }
}

static void expect_op(jctx *c, const char *op) {
    tok *t = peek(c);
    if (!is_op(t, op)) fail(c, LK_ERR_FORMAT, t->pos, "expected '%s', found %s", op, tok_desc(t));
    next(c);
}
static jstr *expect_name(jctx *c, const char *what) {
    tok *t = peek(c);
    if (t->t != T_NAME) fail(c, LK_ERR_FORMAT, t->pos, "expected %s, found %s", what, tok_desc(t));
    next(c);
    return t->s;
}
static void expect_block_end(jctx *c, const char *stmt) {
    tok *t = peek(c);
    if (t->t != T_BLOCK_END)
        fail(c, LK_ERR_FORMAT, t->pos, "unexpected %s in '%s' statement", tok_desc(t), stmt);
    next(c);
}

static node *mknode(jctx *c, int k, int pos) {
    node *n = acalloc(c, sizeof *n);
    n->k = k; n->pos = pos;
    return n;
}

typedef struct { node **a; int n, cap; } nvec;
static void nv_push(jctx *c, nvec *v, node *x) {
    v->a = agrow(c, v->a, v->n, &v->cap, v->n + 1, sizeof(node *));
    v->a[v->n++] = x;
}
typedef struct { jstr **a; int n, cap; } svec;
static void sv_push(jctx *c, svec *v, jstr *x) {
    v->a = agrow(c, v->a, v->n, &v->cap, v->n + 1, sizeof(jstr *));
    v->a[v->n++] = x;
}

static node *parse_expr(jctx *c);
static node *parse_or(jctx *c);
static node *parse_unary(jctx *c, bool with_filter);

static void enter(jctx *c, int pos) {
    if (++c->depth > MAX_DEPTH) fail(c, LK_ERR_FORMAT, pos, "nested more than %d levels deep", MAX_DEPTH);
}
static void leave(jctx *c) { c->depth--; }

/* (args) after a callee, filter or test: positional then name=value. */
static void parse_args(jctx *c, node *n) {
    nvec pa = {0}, kv = {0};
    svec kn = {0};
    if (!accept_op(c, ")")) {
        for (;;) {
            tok *t = peek(c);
            if (t->t == T_NAME && is_op(peek2(c), "=")) {
                next(c); next(c);
                sv_push(c, &kn, t->s);
                nv_push(c, &kv, parse_expr(c));
            } else {
                if (kn.n) fail(c, LK_ERR_FORMAT, t->pos, "positional argument after keyword argument");
                nv_push(c, &pa, parse_expr(c));
            }
            if (accept_op(c, ")")) break;
            expect_op(c, ",");
            if (accept_op(c, ")")) break;
        }
    }
    n->args = pa.a; n->nargs = pa.n;
    n->kwn = kn.a; n->kwv = kv.a; n->nkw = kn.n;
}

static node *parse_primary(jctx *c) {
    tok *t = next(c);
    node *n;
    switch (t->t) {
    case T_STR: {
        /* adjacent literals concatenate, as in Python */
        jstr *s = t->s;
        while (peek(c)->t == T_STR) {
            jstr *u = next(c)->s;
            sbuf b = {0};
            sb_put(c, &b, s->p, s->n);
            sb_put(c, &b, u->p, u->n);
            s = sb_str(c, &b);
        }
        n = mknode(c, E_LIT, t->pos);
        n->lit = v_str(s);
        return n;
    }
    case T_INT: n = mknode(c, E_LIT, t->pos); n->lit = v_int(t->i); return n;
    case T_FLOAT: n = mknode(c, E_LIT, t->pos); n->lit = v_float(t->f); return n;
    case T_NAME: {
        const char *w = t->s->p;
        n = mknode(c, E_LIT, t->pos);
        if (!strcmp(w, "true") || !strcmp(w, "True")) n->lit = v_bool(true);
        else if (!strcmp(w, "false") || !strcmp(w, "False")) n->lit = v_bool(false);
        else if (!strcmp(w, "none") || !strcmp(w, "None")) n->lit = v_none();
        else { n->k = E_NAME; n->name = t->s; }
        return n;
    }
    case T_OP:
        if (is_op(t, "(")) {
            if (accept_op(c, ")")) { n = mknode(c, E_LIST, t->pos); n->neg = true; return n; }
            node *e = parse_expr(c);
            if (accept_op(c, ")")) return e;
            /* a tuple: behaves as a list */
            nvec v = {0};
            nv_push(c, &v, e);
            while (accept_op(c, ",")) {
                if (is_op(peek(c), ")")) break;
                nv_push(c, &v, parse_expr(c));
            }
            expect_op(c, ")");
            n = mknode(c, E_LIST, t->pos);
            n->args = v.a; n->nargs = v.n;
            n->neg = true; /* a tuple */
            return n;
        }
        if (is_op(t, "[")) {
            nvec v = {0};
            while (!accept_op(c, "]")) {
                nv_push(c, &v, parse_expr(c));
                if (accept_op(c, "]")) break;
                expect_op(c, ",");
            }
            n = mknode(c, E_LIST, t->pos);
            n->args = v.a; n->nargs = v.n;
            return n;
        }
        if (is_op(t, "{")) {
            nvec k = {0}, v = {0};
            while (!accept_op(c, "}")) {
                nv_push(c, &k, parse_expr(c));
                expect_op(c, ":");
                nv_push(c, &v, parse_expr(c));
                if (accept_op(c, "}")) break;
                expect_op(c, ",");
            }
            n = mknode(c, E_DICT, t->pos);
            n->args = k.a; n->nargs = k.n; n->kwv = v.a; n->nkw = v.n;
            return n;
        }
        break;
    default: break;
    }
    fail(c, LK_ERR_FORMAT, t->pos, "expected an expression, found %s", tok_desc(t));
}

static node *parse_postfix(jctx *c, node *n) {
    for (;;) {
        tok *t = peek(c);
        if (is_op(t, ".")) {
            next(c);
            tok *a = next(c);
            node *x = mknode(c, E_ATTR, t->pos);
            x->a = n;
            if (a->t == T_NAME) x->name = a->s;
            else if (a->t == T_INT) { x->k = E_ITEM; x->b = mknode(c, E_LIT, a->pos); x->b->lit = v_int(a->i); }
            else fail(c, LK_ERR_FORMAT, a->pos, "expected an attribute name after '.', found %s", tok_desc(a));
            n = x;
        } else if (is_op(t, "[")) {
            next(c);
            node *lo = NULL, *hi = NULL, *st = NULL;
            bool slice = false;
            if (!is_op(peek(c), ":")) lo = parse_expr(c);
            if (accept_op(c, ":")) {
                slice = true;
                if (!is_op(peek(c), "]") && !is_op(peek(c), ":")) hi = parse_expr(c);
                if (accept_op(c, ":") && !is_op(peek(c), "]")) st = parse_expr(c);
            }
            expect_op(c, "]");
            node *x = mknode(c, slice ? E_SLICE : E_ITEM, t->pos);
            x->a = n;
            if (slice) { x->b = lo; x->c = hi; x->args = acalloc(c, sizeof(node *)); x->args[0] = st; x->nargs = 1; }
            else x->b = lo;
            n = x;
        } else if (is_op(t, "(")) {
            next(c);
            node *x = mknode(c, E_CALL, t->pos);
            x->a = n;
            parse_args(c, x);
            n = x;
        } else {
            return n;
        }
    }
}

/* Does the next token start an argument of a test written without parens
 * (`x is divisibleby 3`, `x is equalto 'a'`)? */
static bool starts_test_arg(jctx *c) {
    tok *t = peek(c);
    if (t->t == T_STR || t->t == T_INT || t->t == T_FLOAT) return true;
    if (t->t == T_NAME) {
        static const char *const kw[] = { "else", "or", "and", "if", "in", "is", "not", NULL };
        for (int i = 0; kw[i]; i++) if (!strcmp(t->s->p, kw[i])) return false;
        return true;
    }
    return is_op(t, "[") || is_op(t, "{");
}

/* Filter and test names are checked while parsing, so a template that uses
 * one outside the subset is refused as a whole, not only when the branch
 * that uses it runs. Keep in step with apply_filter and apply_test. */
static const char *const FILTER_NAMES[] = {
    "trim", "length", "count", "string", "safe", "upper", "lower", "title", "capitalize", "tojson",
    "default", "d", "join", "replace", "list", "first", "last", "reverse", "unique", "selectattr",
    "rejectattr", "select", "reject", "map", "sort", "dictsort", "sum", "min", "max", "items", "int",
    "float", "abs", "indent", NULL,
};
static const char *const TEST_NAMES[] = {
    "defined", "undefined", "none", "string", "number", "integer", "float", "boolean", "true",
    "false", "mapping", "iterable", "sequence", "callable", "lower", "upper", "odd", "even",
    "divisibleby", "eq", "equalto", "==", "ne", "!=", "lt", "<", "le", "<=", "gt", ">", "ge", ">=",
    "sameas", "in", NULL,
};
static void check_name(jctx *c, const char *const *names, const char *what, const jstr *name, int pos) {
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], name->p)) return;
    fail(c, LK_ERR_FORMAT, pos, "unknown %s '%s'", what, name->p);
}

static node *parse_filters(jctx *c, node *n) {
    for (;;) {
        tok *t = peek(c);
        if (is_op(t, "|")) {
            next(c);
            node *f = mknode(c, E_FILTER, peek(c)->pos);
            f->name = expect_name(c, "a filter name");
            check_name(c, FILTER_NAMES, "filter", f->name, f->pos);
            f->a = n;
            if (accept_op(c, "(")) parse_args(c, f);
            n = f;
        } else if (is_name(t, "is")) {
            next(c);
            node *x = mknode(c, E_TEST, peek(c)->pos);
            x->neg = accept_name(c, "not");
            tok *nt = peek(c);
            if (nt->t == T_NAME) x->name = next(c)->s;
            else if (nt->t == T_OP && (is_op(nt, "==") || is_op(nt, "!=") || is_op(nt, "<") ||
                                       is_op(nt, "<=") || is_op(nt, ">") || is_op(nt, ">=")))
                x->name = next(c)->s;
            else fail(c, LK_ERR_FORMAT, nt->pos, "expected a test name after 'is', found %s", tok_desc(nt));
            check_name(c, TEST_NAMES, "test", x->name, x->pos);
            x->a = n;
            if (accept_op(c, "(")) parse_args(c, x);
            else if (starts_test_arg(c)) {
                x->args = acalloc(c, sizeof(node *));
                x->args[0] = parse_postfix(c, parse_primary(c));
                x->nargs = 1;
            }
            n = x;
        } else {
            return n;
        }
    }
}

static node *parse_unary(jctx *c, bool with_filter) {
    tok *t = peek(c);
    enter(c, t->pos);
    node *n;
    if (is_op(t, "-") || is_op(t, "+")) {
        next(c);
        n = mknode(c, is_op(t, "-") ? E_NEG : E_POS, t->pos);
        n->a = parse_unary(c, false);
    } else {
        n = parse_postfix(c, parse_primary(c));
    }
    if (with_filter) n = parse_filters(c, n);
    leave(c);
    return n;
}

static node *mkbin(jctx *c, int k, const char *op, node *a, node *b, int pos) {
    node *n = mknode(c, k, pos);
    n->name = cstr(c, op); n->a = a; n->b = b;
    return n;
}

static node *parse_pow(jctx *c) {
    node *n = parse_unary(c, true);
    while (is_op(peek(c), "**")) {
        int pos = next(c)->pos;
        n = mkbin(c, E_BIN, "**", n, parse_unary(c, true), pos);
    }
    return n;
}
static node *parse_math2(jctx *c) {
    node *n = parse_pow(c);
    for (;;) {
        tok *t = peek(c);
        if (is_op(t, "*") || is_op(t, "/") || is_op(t, "//") || is_op(t, "%")) {
            next(c);
            n = mkbin(c, E_BIN, t->s->p, n, parse_pow(c), t->pos);
        } else return n;
    }
}
static node *parse_concat(jctx *c) {
    node *n = parse_math2(c);
    while (is_op(peek(c), "~")) {
        int pos = next(c)->pos;
        n = mkbin(c, E_BIN, "~", n, parse_math2(c), pos);
    }
    return n;
}
static node *parse_math1(jctx *c) {
    node *n = parse_concat(c);
    for (;;) {
        tok *t = peek(c);
        if (is_op(t, "+") || is_op(t, "-")) {
            next(c);
            n = mkbin(c, E_BIN, t->s->p, n, parse_concat(c), t->pos);
        } else return n;
    }
}
static node *parse_compare(jctx *c) {
    node *n = parse_math1(c);
    node *chain = NULL; /* the last comparison of a chain */
    for (;;) {
        tok *t = peek(c);
        const char *op = NULL;
        if (t->t == T_OP && (is_op(t, "==") || is_op(t, "!=") || is_op(t, "<") || is_op(t, "<=") ||
                             is_op(t, ">") || is_op(t, ">="))) { op = t->s->p; next(c); }
        else if (is_name(t, "in")) { op = "in"; next(c); }
        else if (is_name(t, "not") && is_name(peek2(c), "in")) { op = "notin"; next(c); next(c); }
        else break;
        node *r = parse_math1(c);
        /* a < b < c means (a < b) and (b < c) */
        node *cmp = mkbin(c, E_CMP, op, chain ? chain->b : n, r, t->pos);
        n = chain ? mkbin(c, E_AND, "and", n, cmp, t->pos) : cmp;
        chain = cmp;
    }
    return n;
}
static node *parse_not(jctx *c) {
    tok *t = peek(c);
    if (is_name(t, "not")) {
        next(c);
        enter(c, t->pos);
        node *n = mknode(c, E_NOT, t->pos);
        n->a = parse_not(c);
        leave(c);
        return n;
    }
    return parse_compare(c);
}
static node *parse_and(jctx *c) {
    node *n = parse_not(c);
    while (is_name(peek(c), "and")) {
        int pos = next(c)->pos;
        n = mkbin(c, E_AND, "and", n, parse_not(c), pos);
    }
    return n;
}
static node *parse_or(jctx *c) {
    node *n = parse_and(c);
    while (is_name(peek(c), "or")) {
        int pos = next(c)->pos;
        n = mkbin(c, E_OR, "or", n, parse_and(c), pos);
    }
    return n;
}
static node *parse_expr(jctx *c) {
    tok *t = peek(c);
    enter(c, t->pos);
    node *n = parse_or(c);
    if (is_name(peek(c), "if")) {
        int pos = next(c)->pos;
        node *x = mknode(c, E_COND, pos);
        x->b = n;
        x->a = parse_or(c);
        if (accept_name(c, "else")) x->c = parse_expr(c);
        n = x;
    }
    leave(c);
    return n;
}
/* expr [, expr ...]: a bare tuple (right side of `set a, b = ...`). */
static node *parse_tuple(jctx *c) {
    node *e = parse_expr(c);
    if (!is_op(peek(c), ",")) return e;
    nvec v = {0};
    nv_push(c, &v, e);
    while (accept_op(c, ",")) {
        if (peek(c)->t == T_BLOCK_END) break;
        nv_push(c, &v, parse_expr(c));
    }
    node *n = mknode(c, E_LIST, e->pos);
    n->args = v.a; n->nargs = v.n;
    n->neg = true;
    return n;
}

/* Parses statements until a block whose keyword is one of stops (NULL-
 * terminated); leaves that keyword consumed and returns its index, or -1 at
 * end of template (an error unless stops is empty). */
static int parse_body(jctx *c, nvec *out, const char *const *stops, const char *opener, int open_pos);

static node *parse_stmt(jctx *c, tok *kw) {
    const char *w = kw->s->p;
    int pos = kw->pos;
    if (!strcmp(w, "if")) {
        node *n = mknode(c, S_IF, pos);
        n->a = parse_expr(c);
        expect_block_end(c, "if");
        static const char *const stops[] = { "elif", "else", "endif", NULL };
        nvec body = {0};
        int s = parse_body(c, &body, stops, "if", pos);
        n->body = body.a; n->nbody = body.n;
        if (s == 0) { /* elif: a nested if in the else branch */
            tok *k2 = &c->toks[c->tp - 1];
            node *e = parse_stmt(c, &(tok){ .t = T_NAME, .pos = k2->pos, .s = cstr(c, "if") });
            n->els = acalloc(c, sizeof(node *)); n->els[0] = e; n->nels = 1;
            return n;
        }
        if (s == 1) {
            expect_block_end(c, "else");
            static const char *const st2[] = { "endif", NULL };
            nvec els = {0};
            parse_body(c, &els, st2, "if", pos);
            n->els = els.a; n->nels = els.n;
        }
        expect_block_end(c, "endif");
        return n;
    }
    if (!strcmp(w, "for")) {
        node *n = mknode(c, S_FOR, pos);
        svec tg = {0};
        bool paren = accept_op(c, "(");
        do sv_push(c, &tg, expect_name(c, "a loop variable")); while (accept_op(c, ","));
        if (paren) expect_op(c, ")");
        n->tg = tg.a; n->ntg = tg.n;
        if (!accept_name(c, "in")) fail(c, LK_ERR_FORMAT, peek(c)->pos, "expected 'in' in 'for' statement, found %s", tok_desc(peek(c)));
        n->a = parse_or(c);
        if (accept_name(c, "if")) n->b = parse_expr(c);
        if (is_name(peek(c), "recursive")) fail(c, LK_ERR_FORMAT, peek(c)->pos, "unsupported: recursive loops");
        expect_block_end(c, "for");
        static const char *const stops[] = { "else", "endfor", NULL };
        nvec body = {0};
        int s = parse_body(c, &body, stops, "for", pos);
        n->body = body.a; n->nbody = body.n;
        if (s == 0) {
            expect_block_end(c, "else");
            static const char *const st2[] = { "endfor", NULL };
            nvec els = {0};
            parse_body(c, &els, st2, "for", pos);
            n->els = els.a; n->nels = els.n;
        }
        expect_block_end(c, "endfor");
        return n;
    }
    if (!strcmp(w, "set")) {
        jstr *first = expect_name(c, "a variable name");
        if (accept_op(c, ".")) {
            node *n = mknode(c, S_SETATTR, pos);
            n->tg = acalloc(c, sizeof(jstr *)); n->tg[0] = first; n->ntg = 1;
            n->name = expect_name(c, "an attribute name");
            expect_op(c, "=");
            n->a = parse_tuple(c);
            expect_block_end(c, "set");
            return n;
        }
        svec tg = {0};
        sv_push(c, &tg, first);
        while (accept_op(c, ",")) sv_push(c, &tg, expect_name(c, "a variable name"));
        if (accept_op(c, "=")) {
            node *n = mknode(c, S_SET, pos);
            n->tg = tg.a; n->ntg = tg.n;
            n->a = parse_tuple(c);
            expect_block_end(c, "set");
            return n;
        }
        /* block set: {% set x %}...{% endset %}, optionally {% set x | filter %} */
        if (tg.n != 1) fail(c, LK_ERR_FORMAT, pos, "block 'set' takes one variable");
        node *n = mknode(c, S_SETBLOCK, pos);
        n->tg = tg.a; n->ntg = 1;
        node *holder = mknode(c, E_LIT, pos); /* filters applied to the captured text */
        n->a = parse_filters(c, holder);
        expect_block_end(c, "set");
        static const char *const stops[] = { "endset", NULL };
        nvec body = {0};
        parse_body(c, &body, stops, "set", pos);
        n->body = body.a; n->nbody = body.n;
        n->b = holder;
        expect_block_end(c, "endset");
        return n;
    }
    if (!strcmp(w, "macro")) {
        node *n = mknode(c, S_MACRO, pos);
        n->name = expect_name(c, "a macro name");
        expect_op(c, "(");
        svec pn = {0};
        nvec dv = {0};
        while (!accept_op(c, ")")) {
            sv_push(c, &pn, expect_name(c, "a parameter name"));
            nv_push(c, &dv, accept_op(c, "=") ? parse_expr(c) : NULL);
            if (accept_op(c, ")")) break;
            expect_op(c, ",");
        }
        n->tg = pn.a; n->ntg = pn.n; n->kwv = dv.a;
        expect_block_end(c, "macro");
        static const char *const stops[] = { "endmacro", NULL };
        nvec body = {0};
        parse_body(c, &body, stops, "macro", pos);
        n->body = body.a; n->nbody = body.n;
        if (peek(c)->t == T_NAME) next(c); /* {% endmacro name %} */
        expect_block_end(c, "endmacro");
        return n;
    }
    if (!strcmp(w, "filter")) {
        node *n = mknode(c, S_FILTER, pos);
        node *holder = mknode(c, E_LIT, pos);
        node *f = mknode(c, E_FILTER, peek(c)->pos);
        f->name = expect_name(c, "a filter name");
        check_name(c, FILTER_NAMES, "filter", f->name, f->pos);
        f->a = holder;
        if (accept_op(c, "(")) parse_args(c, f);
        n->a = parse_filters(c, f);
        n->b = holder;
        expect_block_end(c, "filter");
        static const char *const stops[] = { "endfilter", NULL };
        nvec body = {0};
        parse_body(c, &body, stops, "filter", pos);
        n->body = body.a; n->nbody = body.n;
        expect_block_end(c, "endfilter");
        return n;
    }
    if (!strcmp(w, "generation")) { /* HF's assistant-mask marker: no effect on text */
        node *n = mknode(c, S_BODY, pos);
        expect_block_end(c, "generation");
        static const char *const stops[] = { "endgeneration", NULL };
        nvec body = {0};
        parse_body(c, &body, stops, "generation", pos);
        n->body = body.a; n->nbody = body.n;
        expect_block_end(c, "endgeneration");
        return n;
    }
    if (!strcmp(w, "break") || !strcmp(w, "continue")) {
        node *n = mknode(c, w[0] == 'b' ? S_BREAK : S_CONTINUE, pos);
        expect_block_end(c, w);
        return n;
    }
    fail(c, LK_ERR_FORMAT, pos, "unsupported statement '%s'", w);
}

static int parse_body(jctx *c, nvec *out, const char *const *stops, const char *opener, int open_pos) {
    enter(c, open_pos);
    for (;;) {
        tok *t = next(c);
        if (t->t == T_EOF) {
            if (opener) {
                int last = 0;
                while (stops[last + 1]) last++;
                fail(c, LK_ERR_FORMAT, open_pos, "'%s' is never closed (expected '%s')", opener, stops[last]);
            }
            leave(c);
            return -1;
        }
        if (t->t == T_TEXT) {
            node *n = mknode(c, S_TEXT, t->pos);
            n->lit = v_str(t->s);
            nv_push(c, out, n);
        } else if (t->t == T_VAR_BEGIN) {
            node *n = mknode(c, S_OUT, t->pos);
            if (peek(c)->t == T_VAR_END) fail(c, LK_ERR_FORMAT, t->pos, "empty expression '{{ }}'");
            n->a = parse_expr(c);
            tok *e = peek(c);
            if (e->t != T_VAR_END) fail(c, LK_ERR_FORMAT, e->pos, "unexpected %s in expression (expected '}}')", tok_desc(e));
            next(c);
            nv_push(c, out, n);
        } else if (t->t == T_BLOCK_BEGIN) {
            tok *kw = next(c);
            if (kw->t != T_NAME) fail(c, LK_ERR_FORMAT, kw->pos, "expected a statement name after '{%%', found %s", tok_desc(kw));
            for (int i = 0; stops && stops[i]; i++)
                if (!strcmp(kw->s->p, stops[i])) { leave(c); return i; }
            static const char *const closers[] = { "elif", "else", "endif", "endfor", "endset", "endmacro", "endfilter", "endgeneration", "endraw", NULL };
            for (int i = 0; closers[i]; i++)
                if (!strcmp(kw->s->p, closers[i]))
                    fail(c, LK_ERR_FORMAT, kw->pos, "unexpected '%s'%s%s", kw->s->p,
                         opener ? " inside " : " outside any block", opener ? opener : "");
            nv_push(c, out, parse_stmt(c, kw));
        } else {
            fail(c, LK_ERR_FORMAT, t->pos, "unexpected %s", tok_desc(t));
        }
    }
}

/* ------------------------------------------------------------------ evaluator */

static jv eval(jctx *c, node *n, frame *f);
static int exec_body(jctx *c, node **body, int nb, frame *f, sbuf *out);

static frame *frame_new(jctx *c, frame *parent) {
    frame *f = amalloc(c, sizeof *f);
    f->parent = parent;
    f->vars = dict_new(c);
    return f;
}
static bool lookup(frame *f, const char *name, jv *out) {
    for (; f; f = f->parent)
        if (dict_get(f->vars, name, out)) return true;
    return false;
}

static void step(jctx *c, int pos) {
    if (++c->steps > MAX_STEPS) fail(c, LK_ERR_FORMAT, pos, "more than %ld loop iterations", MAX_STEPS);
}

static _Noreturn void type_fail(jctx *c, int pos, const char *what, const jv *v) {
    if (v->t == V_UNDEF) fail(c, LK_ERR_FORMAT, pos, "%s: '%s' is undefined", what, v->uname ? v->uname : "value");
    fail(c, LK_ERR_FORMAT, pos, "%s: unsupported for a %s", what, type_name(v));
}

static jstr *need_str(jctx *c, const jv *v, int pos, const char *what) {
    if (v->t != V_STR) type_fail(c, pos, what, v);
    return v->s;
}
static int64_t need_int(jctx *c, const jv *v, int pos, const char *what) {
    if (v->t == V_INT || v->t == V_BOOL) return num_i(v);
    if (v->t == V_FLOAT && v->f == floor(v->f) && fabs(v->f) < 9e18) return (int64_t)v->f;
    type_fail(c, pos, what, v);
}

/* Items of an iterable: list items, dict keys, string characters. */
static jlist *iter_items(jctx *c, const jv *v, int pos) {
    jlist *l;
    switch (v->t) {
    case V_LIST: return v->l;
    case V_UNDEF: return list_new(c);
    case V_DICT:
        if (v->d->ns) break;
        l = list_new(c);
        for (int i = 0; i < v->d->n; i++) list_push(c, l, v_str(v->d->k[i]));
        return l;
    case V_STR:
        l = list_new(c);
        for (size_t i = 0; i < v->s->n;) {
            size_t k = u8len(v->s->p + i, v->s->n - i);
            list_push(c, l, v_str(mkstr(c, v->s->p + i, k)));
            i += k;
        }
        return l;
    default: break;
    }
    type_fail(c, pos, "iteration", v);
}

static jv getattr_v(jctx *c, const jv *o, const char *name, size_t nlen) {
    (void)c;
    if (o->t == V_DICT) {
        int i = dict_find(o->d, name, nlen);
        if (i >= 0) return o->d->v[i];
    }
    return v_undef(name);
}

static int64_t norm_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

static jv getitem_v(jctx *c, const jv *o, const jv *k, int pos) {
    if (o->t == V_DICT) {
        if (k->t == V_STR) return getattr_v(c, o, k->s->p, k->s->n);
        return v_undef(NULL);
    }
    if (o->t == V_LIST && (k->t == V_INT || k->t == V_BOOL)) {
        int64_t i = norm_index(num_i(k), o->l->n);
        if (i < 0 || i >= o->l->n) return v_undef("list index");
        return o->l->a[i];
    }
    if (o->t == V_STR && (k->t == V_INT || k->t == V_BOOL)) {
        int64_t n = u8count(o->s), i = norm_index(num_i(k), n);
        if (i < 0 || i >= n) return v_undef("string index");
        size_t a = u8off(o->s, i);
        return v_str(mkstr(c, o->s->p + a, u8len(o->s->p + a, o->s->n - a)));
    }
    if (o->t == V_UNDEF) return v_undef(o->uname);
    if (k->t == V_STR) return v_undef(k->s->p);
    type_fail(c, pos, "subscript", o);
}

/* Python slice bounds for length n. */
static void slice_bounds(int64_t n, bool has_lo, int64_t lo, bool has_hi, int64_t hi, int64_t st,
                         int64_t *start, int64_t *stop) {
    if (st > 0) {
        lo = has_lo ? (lo < 0 ? LK_MAX(lo + n, 0) : LK_MIN(lo, n)) : 0;
        hi = has_hi ? (hi < 0 ? LK_MAX(hi + n, 0) : LK_MIN(hi, n)) : n;
    } else {
        lo = has_lo ? (lo < 0 ? LK_MAX(lo + n, -1) : LK_MIN(lo, n - 1)) : n - 1;
        hi = has_hi ? (hi < 0 ? LK_MAX(hi + n, -1) : LK_MIN(hi, n - 1)) : -1;
    }
    *start = lo; *stop = hi;
}

static jv do_slice(jctx *c, node *n, frame *f) {
    jv o = eval(c, n->a, f);
    jv lo = n->b ? eval(c, n->b, f) : v_none(), hi = n->c ? eval(c, n->c, f) : v_none();
    jv st = n->args[0] ? eval(c, n->args[0], f) : v_none();
    int64_t step_ = st.t == V_NONE ? 1 : need_int(c, &st, n->pos, "slice step");
    if (step_ == 0) fail(c, LK_ERR_FORMAT, n->pos, "slice step cannot be zero");
    bool hl = lo.t != V_NONE, hh = hi.t != V_NONE;
    int64_t l = hl ? need_int(c, &lo, n->pos, "slice start") : 0;
    int64_t h = hh ? need_int(c, &hi, n->pos, "slice stop") : 0;
    if (o.t == V_LIST) {
        int64_t a, b;
        slice_bounds(o.l->n, hl, l, hh, h, step_, &a, &b);
        jlist *r = list_new(c);
        for (int64_t i = a; step_ > 0 ? i < b : i > b; i += step_) list_push(c, r, o.l->a[i]);
        return v_list(r);
    }
    if (o.t == V_STR) {
        int64_t cnt = u8count(o.s), a, b;
        /* code point offsets, so slicing never splits a character */
        size_t *off = amalloc(c, sizeof(size_t) * (size_t)(cnt + 1));
        size_t p = 0;
        for (int64_t i = 0; i < cnt; i++) { off[i] = p; p += u8len(o.s->p + p, o.s->n - p); }
        off[cnt] = o.s->n;
        slice_bounds(cnt, hl, l, hh, h, step_, &a, &b);
        if (step_ == 1) return v_str(mkstr(c, o.s->p + off[a], a < b ? off[b] - off[a] : 0));
        sbuf r = {0};
        sb_put(c, &r, "", 0);
        for (int64_t i = a; step_ > 0 ? i < b : i > b; i += step_) sb_put(c, &r, o.s->p + off[i], off[i + 1] - off[i]);
        return v_str(sb_str(c, &r));
    }
    if (o.t == V_UNDEF) return o;
    type_fail(c, n->pos, "slice", &o);
}

/* kwargs lookup for filters/functions: positional index pi or keyword name. */
typedef struct { jv *pa; int np; jstr **kn; jv *kv; int nk; } argv_t;
static bool arg_get(const argv_t *a, int pi, const char *name, jv *out) {
    if (pi >= 0 && pi < a->np) { *out = a->pa[pi]; return true; }
    for (int i = 0; i < a->nk; i++)
        if (name && !strcmp(a->kn[i]->p, name)) { *out = a->kv[i]; return true; }
    return false;
}
static argv_t eval_args(jctx *c, node *n, frame *f) {
    argv_t a = {0};
    a.np = n->nargs;
    a.pa = amalloc(c, sizeof(jv) * (size_t)(a.np + 1));
    for (int i = 0; i < n->nargs; i++) a.pa[i] = eval(c, n->args[i], f);
    a.nk = n->nkw;
    a.kn = n->kwn;
    a.kv = amalloc(c, sizeof(jv) * (size_t)(a.nk + 1));
    for (int i = 0; i < n->nkw; i++) a.kv[i] = eval(c, n->kwv[i], f);
    return a;
}

/* ---- string helpers used by filters and methods ---- */

static bool in_chars(const char *p, size_t l, const jstr *chars) {
    for (size_t i = 0; i < chars->n;) {
        size_t k = u8len(chars->p + i, chars->n - i);
        if (k == l && memcmp(chars->p + i, p, l) == 0) return true;
        i += k;
    }
    return false;
}
/* Python str.strip/lstrip/rstrip: whitespace, or any character of chars. */
static jstr *strip_str(jctx *c, const jstr *s, const jstr *chars, bool left, bool right) {
    size_t a = 0, b = s->n;
    if (left) {
        while (a < b) {
            size_t l = chars ? u8len(s->p + a, b - a) : space_at(s->p + a, b - a);
            if (!l || (chars && !in_chars(s->p + a, l, chars))) break;
            a += l;
        }
    }
    if (right) {
        while (b > a) {
            size_t l;
            if (chars) {
                l = 1;
                while (l < b - a && l < 4 && ((unsigned char)s->p[b - l] & 0xC0) == 0x80) l++;
                if (!in_chars(s->p + b - l, l, chars)) break;
            } else {
                l = space_before(s->p + a, b - a);
                if (!l) break;
            }
            b -= l;
        }
    }
    return mkstr(c, s->p + a, b - a);
}

/* mode 0 lower, 1 upper, 2 Jinja's title filter (words split at whitespace
 * and -([{<), 3 capitalize, 4 Python's str.title() (any non-letter splits). */
static jstr *case_str(jctx *c, const jstr *s, int mode) {
    jstr *r = mkstr(c, s->p, s->n);
    bool after_letter = false, word_start = true;
    for (size_t i = 0; i < r->n; i++) {
        char ch = r->p[i];
        bool lo = ch >= 'a' && ch <= 'z', hi = ch >= 'A' && ch <= 'Z';
        bool up = mode == 1 || (mode == 4 && !after_letter) || (mode == 2 && word_start) || (mode == 3 && i == 0);
        word_start = is_ws(ch) || ch == '-' || ch == '(' || ch == '{' || ch == '[' || ch == '<';
        if (up && lo) r->p[i] = (char)(ch - 32);
        else if (!up && hi) r->p[i] = (char)(ch + 32);
        after_letter = lo || hi || (unsigned char)ch >= 0x80;
    }
    return r;
}

static jstr *replace_str(jctx *c, const jstr *s, const jstr *a, const jstr *b, int64_t count) {
    sbuf r = {0};
    sb_put(c, &r, "", 0);
    size_t i = 0;
    int64_t done = 0;
    if (a->n == 0) { /* Python inserts b between characters */
        for (;;) {
            if (count < 0 || done < count) { sb_put(c, &r, b->p, b->n); done++; }
            if (i >= s->n) break;
            size_t k = u8len(s->p + i, s->n - i);
            sb_put(c, &r, s->p + i, k);
            i += k;
        }
        return sb_str(c, &r);
    }
    while (i < s->n) {
        if ((count < 0 || done < count) && s->n - i >= a->n && memcmp(s->p + i, a->p, a->n) == 0) {
            sb_put(c, &r, b->p, b->n);
            i += a->n;
            done++;
        } else {
            sb_put(c, &r, s->p + i, 1);
            i++;
        }
    }
    return sb_str(c, &r);
}

static jlist *split_str(jctx *c, const jstr *s, const jstr *sep, int64_t maxsplit) {
    jlist *l = list_new(c);
    size_t i = 0;
    int64_t done = 0;
    if (!sep) { /* runs of whitespace, no empty strings */
        for (;;) {
            size_t k;
            while (i < s->n && (k = space_at(s->p + i, s->n - i))) i += k;
            if (i >= s->n) break;
            if (maxsplit >= 0 && done >= maxsplit) {
                size_t e = s->n;
                while (e > i && (k = space_before(s->p + i, e - i))) e -= k;
                list_push(c, l, v_str(mkstr(c, s->p + i, e - i)));
                break;
            }
            size_t a = i;
            while (i < s->n && !space_at(s->p + i, s->n - i)) i += u8len(s->p + i, s->n - i);
            list_push(c, l, v_str(mkstr(c, s->p + a, i - a)));
            done++;
        }
        return l;
    }
    size_t a = 0;
    while (i + sep->n <= s->n) {
        if ((maxsplit < 0 || done < maxsplit) && memcmp(s->p + i, sep->p, sep->n) == 0) {
            list_push(c, l, v_str(mkstr(c, s->p + a, i - a)));
            i += sep->n; a = i; done++;
        } else i++;
    }
    list_push(c, l, v_str(mkstr(c, s->p + a, s->n - a)));
    return l;
}

static int64_t find_str(const jstr *s, const jstr *sub) {
    if (sub->n == 0) return 0;
    for (size_t i = 0; i + sub->n <= s->n; i++)
        if (memcmp(s->p + i, sub->p, sub->n) == 0) {
            int64_t cp = 0;
            for (size_t q = 0; q < i; q += u8len(s->p + q, s->n - q)) cp++;
            return cp;
        }
    return -1;
}

static bool prefix_match(const jstr *s, const jv *p, bool suffix) {
    if (p->t == V_LIST) {
        for (int i = 0; i < p->l->n; i++) if (prefix_match(s, &p->l->a[i], suffix)) return true;
        return false;
    }
    if (p->t != V_STR || p->s->n > s->n) return false;
    return memcmp(suffix ? s->p + s->n - p->s->n : s->p, p->s->p, p->s->n) == 0;
}

static jstr *join_list(jctx *c, const jv *seq, const jstr *sep, const char *attr, int pos) {
    jlist *l = iter_items(c, seq, pos);
    sbuf b = {0};
    sb_put(c, &b, "", 0);
    for (int i = 0; i < l->n; i++) {
        if (i && sep) sb_put(c, &b, sep->p, sep->n);
        jv it = l->a[i];
        if (attr) it = getattr_v(c, &it, attr, strlen(attr));
        to_str_into(c, &b, &it, false);
    }
    return sb_str(c, &b);
}

/* ---- tests (`is`) ---- */

static bool less_v(jctx *c, const jv *a, const jv *b, int pos);

static bool apply_test(jctx *c, const char *name, const jv *v, const argv_t *a, int pos) {
    jv arg = v_undef(NULL);
    bool has = arg_get(a, 0, NULL, &arg);
    if (!strcmp(name, "defined")) return v->t != V_UNDEF;
    if (!strcmp(name, "undefined")) return v->t == V_UNDEF;
    if (!strcmp(name, "none")) return v->t == V_NONE;
    if (!strcmp(name, "string")) return v->t == V_STR;
    if (!strcmp(name, "number")) return v->t == V_INT || v->t == V_FLOAT;
    if (!strcmp(name, "integer")) return v->t == V_INT;
    if (!strcmp(name, "float")) return v->t == V_FLOAT;
    if (!strcmp(name, "boolean")) return v->t == V_BOOL;
    if (!strcmp(name, "true")) return v->t == V_BOOL && v->b;
    if (!strcmp(name, "false")) return v->t == V_BOOL && !v->b;
    if (!strcmp(name, "mapping")) return v->t == V_DICT && !v->d->ns;
    if (!strcmp(name, "iterable")) return v->t == V_LIST || v->t == V_STR || (v->t == V_DICT && !v->d->ns);
    if (!strcmp(name, "sequence")) return v->t == V_LIST || v->t == V_STR || (v->t == V_DICT && !v->d->ns);
    if (!strcmp(name, "callable")) return v->t == V_FUNC || v->t == V_MACRO;
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        if (v->t != V_STR) return false;
        bool up = name[0] == 'u', any = false;
        for (size_t i = 0; i < v->s->n; i++) {
            char ch = v->s->p[i];
            if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z')) {
                any = true;
                if (up != (ch >= 'A' && ch <= 'Z')) return false;
            }
        }
        return any;
    }
    if (!strcmp(name, "odd") || !strcmp(name, "even")) {
        int64_t i = need_int(c, v, pos, name);
        return (i % 2 != 0) == (name[0] == 'o');
    }
    if (!strcmp(name, "divisibleby")) {
        if (!has) fail(c, LK_ERR_FORMAT, pos, "test 'divisibleby' needs an argument");
        int64_t d = need_int(c, &arg, pos, name);
        if (d == 0) fail(c, LK_ERR_FORMAT, pos, "divisibleby 0");
        return need_int(c, v, pos, name) % d == 0;
    }
    bool cmp = !strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "==") || !strcmp(name, "ne") ||
               !strcmp(name, "!=") || !strcmp(name, "lt") || !strcmp(name, "<") || !strcmp(name, "le") ||
               !strcmp(name, "<=") || !strcmp(name, "gt") || !strcmp(name, ">") || !strcmp(name, "ge") ||
               !strcmp(name, ">=") || !strcmp(name, "sameas") || !strcmp(name, "in");
    if (cmp) {
        if (!has) fail(c, LK_ERR_FORMAT, pos, "test '%s' needs an argument", name);
        if (!strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "==")) return veq(v, &arg);
        if (!strcmp(name, "ne") || !strcmp(name, "!=")) return !veq(v, &arg);
        if (!strcmp(name, "sameas")) {
            if (v->t != arg.t) return false;
            if (v->t == V_LIST) return v->l == arg.l;
            if (v->t == V_DICT) return v->d == arg.d;
            return veq(v, &arg);
        }
        if (!strcmp(name, "in")) {
            if (arg.t == V_STR && v->t == V_STR)
                return v->s->n == 0 || find_str(arg.s, v->s) >= 0;
            jlist *l = iter_items(c, &arg, pos);
            for (int i = 0; i < l->n; i++) if (veq(&l->a[i], v)) return true;
            return false;
        }
        if (!strcmp(name, "lt") || !strcmp(name, "<")) return less_v(c, v, &arg, pos);
        if (!strcmp(name, "gt") || !strcmp(name, ">")) return less_v(c, &arg, v, pos);
        if (!strcmp(name, "le") || !strcmp(name, "<=")) return !less_v(c, &arg, v, pos);
        return !less_v(c, v, &arg, pos); /* ge */
    }
    fail(c, LK_ERR_FORMAT, pos, "unknown test '%s'", name);
}

/* ---- filters ---- */

static jv arith(jctx *c, const char *op, const jv *a, const jv *b, int pos);

static jv apply_filter(jctx *c, const char *name, jv v, const argv_t *a, int pos, frame *f);

static int64_t length_of(jctx *c, const jv *v, int pos) {
    switch (v->t) {
    case V_STR: return u8count(v->s);
    case V_LIST: return v->l->n;
    case V_DICT: return v->d->n;
    case V_UNDEF: return 0;
    default: type_fail(c, pos, "length", v);
    }
}

static jv select_items(jctx *c, const jv *seq, const argv_t *a, bool by_attr, bool keep, int pos) {
    jlist *in = iter_items(c, seq, pos), *out = list_new(c);
    int ai = 0;
    jv attr = v_undef(NULL), test = v_undef(NULL);
    if (by_attr) {
        if (!arg_get(a, ai++, NULL, &attr) || attr.t != V_STR)
            fail(c, LK_ERR_FORMAT, pos, "%s needs an attribute name", keep ? "selectattr" : "rejectattr");
    }
    bool has_test = arg_get(a, ai++, NULL, &test);
    if (has_test && test.t != V_STR) fail(c, LK_ERR_FORMAT, pos, "test name must be a string");
    argv_t ta = { .pa = a->np > ai ? a->pa + ai : NULL, .np = a->np > ai ? a->np - ai : 0 };
    for (int i = 0; i < in->n; i++) {
        jv it = in->a[i];
        jv x = by_attr ? getattr_v(c, &it, attr.s->p, attr.s->n) : it;
        bool ok = has_test ? apply_test(c, test.s->p, &x, &ta, pos) : truthy(&x);
        if (ok == keep) list_push(c, out, it);
    }
    return v_list(out);
}

static jv apply_filter(jctx *c, const char *name, jv v, const argv_t *a, int pos, frame *f) {
    jv x;
    if (!strcmp(name, "trim")) {
        jstr *chars = arg_get(a, 0, "chars", &x) && x.t == V_STR ? x.s : NULL;
        jstr *s = to_str(c, &v);
        return v_str(strip_str(c, s, chars, true, true));
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) return v_int(length_of(c, &v, pos));
    if (!strcmp(name, "string")) return v_str(to_str(c, &v));
    if (!strcmp(name, "safe")) return v;
    if (!strcmp(name, "upper")) return v_str(case_str(c, to_str(c, &v), 1));
    if (!strcmp(name, "lower")) return v_str(case_str(c, to_str(c, &v), 0));
    if (!strcmp(name, "title")) return v_str(case_str(c, to_str(c, &v), 2));
    if (!strcmp(name, "capitalize")) return v_str(case_str(c, to_str(c, &v), 3));
    if (!strcmp(name, "tojson")) {
        int indent = -1;
        if (arg_get(a, 0, "indent", &x) && x.t != V_NONE) indent = (int)need_int(c, &x, pos, "tojson indent");
        if (indent > 64) indent = 64;
        bool sort = arg_get(a, -1, "sort_keys", &x) && truthy(&x);
        sbuf b = {0};
        sb_put(c, &b, "", 0);
        to_json(c, &b, &v, indent, sort, 0, pos);
        return v_str(sb_str(c, &b));
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        jv def = v_cstr(c, "");
        arg_get(a, 0, "default_value", &def);
        bool boolean = arg_get(a, 1, "boolean", &x) && truthy(&x);
        if (v.t == V_UNDEF || (boolean && !truthy(&v))) return def;
        return v;
    }
    if (!strcmp(name, "join")) {
        jv sep = v_cstr(c, "");
        arg_get(a, 0, "d", &sep);
        jv attr = v_undef(NULL);
        arg_get(a, 1, "attribute", &attr);
        return v_str(join_list(c, &v, to_str(c, &sep), attr.t == V_STR ? attr.s->p : NULL, pos));
    }
    if (!strcmp(name, "replace")) {
        jv o, n2, cnt = v_int(-1);
        if (!arg_get(a, 0, "old", &o) || !arg_get(a, 1, "new", &n2))
            fail(c, LK_ERR_FORMAT, pos, "filter 'replace' needs two arguments");
        arg_get(a, 2, "count", &cnt);
        int64_t k = cnt.t == V_NONE ? -1 : need_int(c, &cnt, pos, "replace count");
        return v_str(replace_str(c, to_str(c, &v), to_str(c, &o), to_str(c, &n2), k));
    }
    if (!strcmp(name, "list")) {
        jlist *l = iter_items(c, &v, pos), *r = list_new(c);
        for (int i = 0; i < l->n; i++) list_push(c, r, l->a[i]);
        return v_list(r);
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jlist *l = iter_items(c, &v, pos);
        if (!l->n) return v_undef(name);
        return l->a[name[0] == 'f' ? 0 : l->n - 1];
    }
    if (!strcmp(name, "reverse")) {
        if (v.t == V_STR) {
            jlist *l = iter_items(c, &v, pos);
            sbuf b = {0};
            sb_put(c, &b, "", 0);
            for (int i = l->n - 1; i >= 0; i--) sb_put(c, &b, l->a[i].s->p, l->a[i].s->n);
            return v_str(sb_str(c, &b));
        }
        jlist *l = iter_items(c, &v, pos), *r = list_new(c);
        for (int i = l->n - 1; i >= 0; i--) list_push(c, r, l->a[i]);
        return v_list(r);
    }
    if (!strcmp(name, "unique")) {
        jlist *l = iter_items(c, &v, pos), *r = list_new(c);
        for (int i = 0; i < l->n; i++) {
            bool seen = false;
            for (int j = 0; j < r->n && !seen; j++) seen = veq(&r->a[j], &l->a[i]);
            if (!seen) list_push(c, r, l->a[i]);
        }
        return v_list(r);
    }
    if (!strcmp(name, "selectattr")) return select_items(c, &v, a, true, true, pos);
    if (!strcmp(name, "rejectattr")) return select_items(c, &v, a, true, false, pos);
    if (!strcmp(name, "select")) return select_items(c, &v, a, false, true, pos);
    if (!strcmp(name, "reject")) return select_items(c, &v, a, false, false, pos);
    if (!strcmp(name, "map")) {
        jlist *l = iter_items(c, &v, pos), *r = list_new(c);
        jv attr;
        if (arg_get(a, -1, "attribute", &attr)) {
            jv def = v_undef(NULL);
            bool hd = arg_get(a, -1, "default", &def);
            for (int i = 0; i < l->n; i++) {
                jv it = attr.t == V_STR ? getattr_v(c, &l->a[i], attr.s->p, attr.s->n) : getitem_v(c, &l->a[i], &attr, pos);
                list_push(c, r, it.t == V_UNDEF && hd ? def : it);
            }
            return v_list(r);
        }
        jv fname;
        if (!arg_get(a, 0, NULL, &fname) || fname.t != V_STR)
            fail(c, LK_ERR_FORMAT, pos, "filter 'map' needs a filter name or attribute=");
        argv_t fa = { .pa = a->pa + 1, .np = a->np - 1, .kn = a->kn, .kv = a->kv, .nk = a->nk };
        for (int i = 0; i < l->n; i++) list_push(c, r, apply_filter(c, fname.s->p, l->a[i], &fa, pos, f));
        return v_list(r);
    }
    if (!strcmp(name, "sort") || !strcmp(name, "dictsort")) {
        /* stable insertion sort (lists in templates are short); strings
         * compare case-insensitively unless case_sensitive, as in Jinja */
        bool ds = name[0] == 'd';
        jv rev = v_bool(false), cs = v_bool(false), attr = v_undef(NULL), by = v_cstr(c, "key");
        arg_get(a, ds ? 1 : 0, "reverse", &rev);
        arg_get(a, ds ? 0 : 1, "case_sensitive", &cs);
        if (!ds) arg_get(a, 2, "attribute", &attr);
        else arg_get(a, 2, "by", &by);
        jlist *src, *r = list_new(c);
        if (ds) {
            if (v.t != V_DICT || v.d->ns) type_fail(c, pos, "filter 'dictsort'", &v);
            src = list_new(c);
            for (int i = 0; i < v.d->n; i++) {
                jlist *p = list_new(c);
                p->tuple = true;
                list_push(c, p, v_str(v.d->k[i]));
                list_push(c, p, v.d->v[i]);
                list_push(c, src, v_list(p));
            }
        } else src = iter_items(c, &v, pos);
        jv *keys = amalloc(c, sizeof(jv) * (size_t)(src->n + 1));
        for (int i = 0; i < src->n; i++) {
            jv k = src->a[i];
            if (ds) k = k.l->a[by.t == V_STR && !strcmp(by.s->p, "value") ? 1 : 0];
            else if (attr.t == V_STR) k = getattr_v(c, &k, attr.s->p, attr.s->n);
            if (k.t == V_STR && !truthy(&cs)) k = v_str(case_str(c, k.s, 0));
            keys[i] = k;
            list_push(c, r, src->a[i]);
            for (int j = i; j > 0; j--) {
                bool out_of_order = truthy(&rev) ? less_v(c, &keys[j - 1], &keys[j], pos)
                                                 : less_v(c, &keys[j], &keys[j - 1], pos);
                if (!out_of_order) break;
                jv t = keys[j]; keys[j] = keys[j - 1]; keys[j - 1] = t;
                t = r->a[j]; r->a[j] = r->a[j - 1]; r->a[j - 1] = t;
            }
        }
        return v_list(r);
    }
    if (!strcmp(name, "sum") || !strcmp(name, "min") || !strcmp(name, "max")) {
        jlist *l = iter_items(c, &v, pos);
        jv attr = v_undef(NULL);
        arg_get(a, -1, "attribute", &attr);
        if (name[1] == 'u') {
            jv acc = v_int(0);
            arg_get(a, 1, "start", &acc);
            for (int i = 0; i < l->n; i++) {
                jv it = attr.t == V_STR ? getattr_v(c, &l->a[i], attr.s->p, attr.s->n) : l->a[i];
                acc = arith(c, "+", &acc, &it, pos);
            }
            return acc;
        }
        if (!l->n) return v_undef(name);
        jv best = l->a[0];
        for (int i = 1; i < l->n; i++)
            if (name[1] == 'i' ? less_v(c, &l->a[i], &best, pos) : less_v(c, &best, &l->a[i], pos)) best = l->a[i];
        return best;
    }
    if (!strcmp(name, "items")) {
        if (v.t == V_UNDEF) return v_list(list_new(c));
        if (v.t != V_DICT || v.d->ns) type_fail(c, pos, "filter 'items'", &v);
        jlist *r = list_new(c);
        for (int i = 0; i < v.d->n; i++) {
            jlist *p = list_new(c);
            p->tuple = true;
            list_push(c, p, v_str(v.d->k[i]));
            list_push(c, p, v.d->v[i]);
            list_push(c, r, v_list(p));
        }
        return v_list(r);
    }
    if (!strcmp(name, "int")) {
        jv def = v_int(0);
        arg_get(a, 0, "default", &def);
        if (v.t == V_INT) return v;
        if (v.t == V_BOOL) return v_int(v.b);
        if (v.t == V_FLOAT) return isfinite(v.f) && fabs(v.f) < 9e18 ? v_int((int64_t)v.f) : def;
        if (v.t == V_STR) {
            char *e;
            errno = 0;
            long long r = strtoll(v.s->p, &e, 10);
            while (*e && is_ws(*e)) e++;
            if (!errno && e != v.s->p && !*e) return v_int(r);
            double d = strtod(v.s->p, &e);
            while (*e && is_ws(*e)) e++;
            if (e != v.s->p && !*e && isfinite(d) && fabs(d) < 9e18) return v_int((int64_t)d);
        }
        return def;
    }
    if (!strcmp(name, "float")) {
        jv def = v_float(0);
        arg_get(a, 0, "default", &def);
        if (is_num(&v)) return v_float(num_f(&v));
        if (v.t == V_STR) {
            char *e;
            double d = strtod(v.s->p, &e);
            while (*e && is_ws(*e)) e++;
            if (e != v.s->p && !*e) return v_float(d);
        }
        return def;
    }
    if (!strcmp(name, "abs")) {
        if (v.t == V_FLOAT) return v_float(fabs(v.f));
        int64_t i = need_int(c, &v, pos, "abs");
        if (i == INT64_MIN) fail(c, LK_ERR_FORMAT, pos, "integer overflow");
        return v_int(i < 0 ? -i : i);
    }
    if (!strcmp(name, "indent")) {
        jv w = v_int(4), first = v_bool(false), blank = v_bool(false);
        arg_get(a, 0, "width", &w);
        arg_get(a, 1, "first", &first);
        arg_get(a, 2, "blank", &blank);
        jstr *pad = w.t == V_STR ? w.s : NULL;
        int64_t wi = pad ? 0 : need_int(c, &w, pos, "indent width");
        if (wi < 0 || wi > 256) fail(c, LK_ERR_FORMAT, pos, "indent width out of range");
        if (!pad) { char sp[257]; memset(sp, ' ', (size_t)wi); pad = mkstr(c, sp, (size_t)wi); }
        jstr *s = to_str(c, &v);
        sbuf b = {0};
        sb_put(c, &b, "", 0);
        size_t i = 0;
        bool firstline = true;
        while (i <= s->n) {
            size_t e = i;
            while (e < s->n && s->p[e] != '\n') e++;
            bool empty = e == i;
            if (firstline ? truthy(&first) : (!empty || truthy(&blank)))
                sb_put(c, &b, pad->p, pad->n);
            sb_put(c, &b, s->p + i, e - i);
            if (e < s->n) sb_put(c, &b, "\n", 1);
            firstline = false;
            if (e >= s->n) break;
            i = e + 1;
        }
        return v_str(sb_str(c, &b));
    }
    fail(c, LK_ERR_FORMAT, pos, "unknown filter '%s'", name);
}

/* ---- methods on str / dict / list values ---- */

static bool call_method(jctx *c, const jv *o, const char *m, const argv_t *a, int pos, jv *out) {
    jv x;
    if (o->t == V_STR) {
        const jstr *s = o->s;
        if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
            jstr *chars = arg_get(a, 0, "chars", &x) && x.t == V_STR ? x.s : NULL;
            *out = v_str(strip_str(c, s, chars, m[0] != 'r', m[0] != 'l'));
            return true;
        }
        if (!strcmp(m, "split")) {
            jstr *sep = arg_get(a, 0, "sep", &x) && x.t == V_STR ? x.s : NULL;
            if (sep && sep->n == 0) fail(c, LK_ERR_FORMAT, pos, "split: empty separator");
            int64_t mx = arg_get(a, 1, "maxsplit", &x) ? need_int(c, &x, pos, "split maxsplit") : -1;
            *out = v_list(split_str(c, s, sep, mx));
            return true;
        }
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
            if (!arg_get(a, 0, NULL, &x)) fail(c, LK_ERR_FORMAT, pos, "%s needs an argument", m);
            *out = v_bool(prefix_match(s, &x, m[0] == 'e'));
            return true;
        }
        if (!strcmp(m, "upper")) { *out = v_str(case_str(c, s, 1)); return true; }
        if (!strcmp(m, "lower")) { *out = v_str(case_str(c, s, 0)); return true; }
        if (!strcmp(m, "title")) { *out = v_str(case_str(c, s, 4)); return true; }
        if (!strcmp(m, "capitalize")) { *out = v_str(case_str(c, s, 3)); return true; }
        if (!strcmp(m, "replace")) {
            jv o2, n2, cnt = v_int(-1);
            if (!arg_get(a, 0, NULL, &o2) || !arg_get(a, 1, NULL, &n2)) fail(c, LK_ERR_FORMAT, pos, "replace needs two arguments");
            arg_get(a, 2, "count", &cnt);
            *out = v_str(replace_str(c, s, need_str(c, &o2, pos, "replace"), need_str(c, &n2, pos, "replace"),
                                     need_int(c, &cnt, pos, "replace count")));
            return true;
        }
        if (!strcmp(m, "find") || !strcmp(m, "count") || !strcmp(m, "index")) {
            if (!arg_get(a, 0, NULL, &x)) fail(c, LK_ERR_FORMAT, pos, "%s needs an argument", m);
            jstr *sub = need_str(c, &x, pos, m);
            if (m[0] == 'c') {
                int64_t k = 0;
                if (sub->n == 0) k = u8count(s) + 1;
                else for (size_t i = 0; i + sub->n <= s->n;)
                    if (memcmp(s->p + i, sub->p, sub->n) == 0) { k++; i += sub->n; } else i++;
                *out = v_int(k);
            } else {
                int64_t r = find_str(s, sub);
                if (r < 0 && m[0] == 'i') fail(c, LK_ERR_FORMAT, pos, "index: substring not found");
                *out = v_int(r);
            }
            return true;
        }
        if (!strcmp(m, "join")) {
            if (!arg_get(a, 0, NULL, &x)) fail(c, LK_ERR_FORMAT, pos, "join needs an argument");
            *out = v_str(join_list(c, &x, s, NULL, pos));
            return true;
        }
        if (!strcmp(m, "isdigit") || !strcmp(m, "isalpha") || !strcmp(m, "isspace")) {
            bool ok = s->n > 0;
            for (size_t i = 0; i < s->n && ok; i++) {
                char ch = s->p[i];
                ok = m[2] == 'd' ? is_digit(ch) : m[2] == 'a' ? ((ch | 32) >= 'a' && (ch | 32) <= 'z') : is_ws(ch);
            }
            *out = v_bool(ok);
            return true;
        }
        return false;
    }
    if (o->t == V_DICT && !o->d->ns) {
        const jdict *d = o->d;
        if (!strcmp(m, "items") || !strcmp(m, "keys") || !strcmp(m, "values")) {
            jlist *r = list_new(c);
            for (int i = 0; i < d->n; i++) {
                if (m[0] == 'k') list_push(c, r, v_str(d->k[i]));
                else if (m[0] == 'v') list_push(c, r, d->v[i]);
                else {
                    jlist *p = list_new(c);
                    p->tuple = true;
                    list_push(c, p, v_str(d->k[i]));
                    list_push(c, p, d->v[i]);
                    list_push(c, r, v_list(p));
                }
            }
            *out = v_list(r);
            return true;
        }
        if (!strcmp(m, "get")) {
            if (!arg_get(a, 0, NULL, &x)) fail(c, LK_ERR_FORMAT, pos, "get needs an argument");
            jv def = v_none();
            arg_get(a, 1, NULL, &def);
            int i = x.t == V_STR ? dict_find(d, x.s->p, x.s->n) : -1;
            *out = i >= 0 ? d->v[i] : def;
            return true;
        }
        return false;
    }
    if (o->t == V_LIST) {
        if (!strcmp(m, "index") || !strcmp(m, "count")) {
            if (!arg_get(a, 0, NULL, &x)) fail(c, LK_ERR_FORMAT, pos, "%s needs an argument", m);
            int64_t k = 0, at = -1;
            for (int i = 0; i < o->l->n; i++)
                if (veq(&o->l->a[i], &x)) { k++; if (at < 0) at = i; }
            if (m[0] == 'i' && at < 0) fail(c, LK_ERR_FORMAT, pos, "index: value not in list");
            *out = v_int(m[0] == 'i' ? at : k);
            return true;
        }
    }
    return false;
}

/* ---- operators ---- */

static bool less_v(jctx *c, const jv *a, const jv *b, int pos) {
    if (is_num(a) && is_num(b)) {
        if (a->t != V_FLOAT && b->t != V_FLOAT) return num_i(a) < num_i(b);
        return num_f(a) < num_f(b);
    }
    if (a->t == V_STR && b->t == V_STR) {
        size_t n = a->s->n < b->s->n ? a->s->n : b->s->n;
        int r = memcmp(a->s->p, b->s->p, n);
        return r < 0 || (r == 0 && a->s->n < b->s->n);
    }
    if (a->t == V_LIST && b->t == V_LIST) {
        enter(c, pos);
        bool r = a->l->n < b->l->n;
        for (int i = 0; i < a->l->n && i < b->l->n; i++) {
            if (less_v(c, &a->l->a[i], &b->l->a[i], pos)) { r = true; break; }
            if (less_v(c, &b->l->a[i], &a->l->a[i], pos)) { r = false; break; }
        }
        leave(c);
        return r;
    }
    fail(c, LK_ERR_FORMAT, pos, "cannot compare a %s with a %s", type_name(a), type_name(b));
}

static bool contains(jctx *c, const jv *hay, const jv *x, int pos) {
    if (hay->t == V_STR) {
        if (x->t != V_STR) fail(c, LK_ERR_FORMAT, pos, "'in <string>' needs a string on the left, not a %s", type_name(x));
        return find_str(hay->s, x->s) >= 0;
    }
    if (hay->t == V_DICT && !hay->d->ns) return x->t == V_STR && dict_find(hay->d, x->s->p, x->s->n) >= 0;
    if (hay->t == V_LIST) {
        for (int i = 0; i < hay->l->n; i++) if (veq(&hay->l->a[i], x)) return true;
        return false;
    }
    if (hay->t == V_UNDEF) return false;
    type_fail(c, pos, "'in'", hay);
}

static jv arith(jctx *c, const char *op, const jv *a, const jv *b, int pos) {
    if (op[0] == '~' ) {
        sbuf s = {0};
        sb_put(c, &s, "", 0);
        to_str_into(c, &s, a, false);
        to_str_into(c, &s, b, false);
        return v_str(sb_str(c, &s));
    }
    if (a->t == V_UNDEF) type_fail(c, pos, op, a);
    if (b->t == V_UNDEF) type_fail(c, pos, op, b);
    if (op[0] == '+' && a->t == V_STR && b->t == V_STR) {
        sbuf s = {0};
        sb_put(c, &s, a->s->p, a->s->n);
        sb_put(c, &s, b->s->p, b->s->n);
        return v_str(sb_str(c, &s));
    }
    if (op[0] == '+' && a->t == V_LIST && b->t == V_LIST) {
        jlist *r = list_new(c);
        for (int i = 0; i < a->l->n; i++) list_push(c, r, a->l->a[i]);
        for (int i = 0; i < b->l->n; i++) list_push(c, r, b->l->a[i]);
        return v_list(r);
    }
    if (op[0] == '*' && op[1] == 0 && ((a->t == V_STR && (b->t == V_INT || b->t == V_BOOL)) ||
                                       (b->t == V_STR && (a->t == V_INT || a->t == V_BOOL)))) {
        const jstr *s = a->t == V_STR ? a->s : b->s;
        int64_t k = a->t == V_STR ? num_i(b) : num_i(a);
        sbuf r = {0};
        sb_put(c, &r, "", 0);
        if (k > 0 && s->n && (uint64_t)k > MAX_OUTPUT / s->n) fail(c, LK_ERR_FORMAT, pos, "string repetition too long");
        for (int64_t i = 0; i < k; i++) sb_put(c, &r, s->p, s->n);
        return v_str(sb_str(c, &r));
    }
    if (!is_num(a) || !is_num(b))
        fail(c, LK_ERR_FORMAT, pos, "unsupported operand types for '%s': %s and %s", op, type_name(a), type_name(b));
    bool fl = a->t == V_FLOAT || b->t == V_FLOAT;
    if (!strcmp(op, "/")) {
        double d = num_f(b);
        if (d == 0) fail(c, LK_ERR_FORMAT, pos, "division by zero");
        return v_float(num_f(a) / d);
    }
    if (fl) {
        double x = num_f(a), y = num_f(b);
        switch (op[0]) {
        case '+': return v_float(x + y);
        case '-': return v_float(x - y);
        case '*': if (op[1] == '*') return v_float(pow(x, y)); return v_float(x * y);
        case '/': if (y == 0) fail(c, LK_ERR_FORMAT, pos, "division by zero"); return v_float(floor(x / y));
        case '%': if (y == 0) fail(c, LK_ERR_FORMAT, pos, "modulo by zero");
            { double r = fmod(x, y); if (r != 0 && ((r < 0) != (y < 0))) r += y; return v_float(r); }
        }
    }
    int64_t x = num_i(a), y = num_i(b), r = 0;
    bool ovf = false;
    switch (op[0]) {
    case '+': ovf = __builtin_add_overflow(x, y, &r); break;
    case '-': ovf = __builtin_sub_overflow(x, y, &r); break;
    case '*':
        if (op[1] == '*') {
            if (y < 0) return v_float(pow((double)x, (double)y));
            r = 1;
            for (int64_t i = 0; i < y && !ovf; i++) ovf = __builtin_mul_overflow(r, x, &r);
        } else ovf = __builtin_mul_overflow(x, y, &r);
        break;
    case '/': case '%':
        if (y == 0) fail(c, LK_ERR_FORMAT, pos, "%s by zero", op[0] == '%' ? "modulo" : "division");
        if (x == INT64_MIN && y == -1) { ovf = true; break; }
        r = op[0] == '%' ? x % y : x / y;
        if (op[0] == '%') { if (r != 0 && ((r < 0) != (y < 0))) r += y; }
        else if ((x % y != 0) && ((x < 0) != (y < 0))) r -= 1; /* floor division */
        break;
    }
    if (ovf) fail(c, LK_ERR_FORMAT, pos, "integer overflow in '%s'", op);
    return v_int(r);
}

/* ---- calls ---- */

static jv call_macro(jctx *c, node *m, const argv_t *a, int pos) {
    step(c, pos);
    enter(c, pos);
    frame *f = frame_new(c, c->root);
    if (a->np > m->ntg)
        fail(c, LK_ERR_FORMAT, pos, "macro '%s' takes %d arguments, got %d", m->name->p, m->ntg, a->np);
    for (int i = 0; i < a->nk; i++) {
        bool known = false;
        for (int j = 0; j < m->ntg && !known; j++) known = !strcmp(m->tg[j]->p, a->kn[i]->p);
        if (!known) fail(c, LK_ERR_FORMAT, pos, "macro '%s' has no parameter '%s'", m->name->p, a->kn[i]->p);
    }
    for (int j = 0; j < m->ntg; j++) {
        jv v;
        if (!arg_get(a, j, m->tg[j]->p, &v))
            v = m->kwv[j] ? eval(c, m->kwv[j], f) : v_undef(m->tg[j]->p);
        dict_set(c, f->vars, m->tg[j], v);
    }
    sbuf out = {0};
    sb_put(c, &out, "", 0);
    exec_body(c, m->body, m->nbody, f, &out);
    leave(c);
    return v_str(sb_str(c, &out));
}

static jv call_builtin(jctx *c, int fn, const argv_t *a, int pos) {
    jv x;
    switch (fn) {
    case F_RAISE: {
        jstr *msg = arg_get(a, 0, NULL, &x) ? to_str(c, &x) : cstr(c, "raise_exception called");
        char safe[384];
        lk_str_sanitize(safe, sizeof safe, msg->p, msg->n);
        lk_fail(c->err, c->errlen, LK_ERR_ARG, "chat template rejected the conversation: %s", safe);
        c->st = LK_ERR_ARG;
        longjmp(c->jb, 1);
    }
    case F_NAMESPACE: case F_DICT: {
        jdict *d = dict_new(c);
        d->ns = fn == F_NAMESPACE;
        if (a->np && a->pa[0].t == V_DICT)
            for (int i = 0; i < a->pa[0].d->n; i++) dict_set(c, d, a->pa[0].d->k[i], a->pa[0].d->v[i]);
        for (int i = 0; i < a->nk; i++) dict_set(c, d, a->kn[i], a->kv[i]);
        return v_dict(d);
    }
    case F_RANGE: {
        int64_t lo = 0, hi, st = 1;
        if (a->np == 1) hi = need_int(c, &a->pa[0], pos, "range");
        else if (a->np == 2 || a->np == 3) {
            lo = need_int(c, &a->pa[0], pos, "range");
            hi = need_int(c, &a->pa[1], pos, "range");
            if (a->np == 3) st = need_int(c, &a->pa[2], pos, "range");
        } else fail(c, LK_ERR_FORMAT, pos, "range takes 1 to 3 arguments");
        if (st == 0) fail(c, LK_ERR_FORMAT, pos, "range step cannot be zero");
        jlist *l = list_new(c);
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) {
            step(c, pos);
            list_push(c, l, v_int(i));
        }
        return v_list(l);
    }
    case F_STRFTIME: {
        if (!arg_get(a, 0, NULL, &x) || x.t != V_STR) fail(c, LK_ERR_FORMAT, pos, "strftime_now needs a format string");
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        char buf[256];
        size_t n = strftime(buf, sizeof buf, x.s->p, &tmv);
        return v_str(mkstr(c, buf, n));
    }
    }
    fail(c, LK_ERR_FORMAT, pos, "bad builtin");
}

static jv eval_call(jctx *c, node *n, frame *f) {
    node *callee = n->a;
    if (callee->k == E_ATTR) {
        jv o = eval(c, callee->a, f);
        if (o.t == V_STR || o.t == V_LIST || (o.t == V_DICT && !o.d->ns)) {
            argv_t a = eval_args(c, n, f);
            jv out;
            if (call_method(c, &o, callee->name->p, &a, n->pos, &out)) return out;
        }
        jv fnv = getattr_v(c, &o, callee->name->p, callee->name->n);
        if (fnv.t == V_MACRO) { argv_t a = eval_args(c, n, f); return call_macro(c, fnv.m, &a, n->pos); }
        fail(c, LK_ERR_FORMAT, n->pos, "unknown method '%s' of a %s", callee->name->p, type_name(&o));
    }
    jv fnv = eval(c, callee, f);
    argv_t a = eval_args(c, n, f);
    if (fnv.t == V_FUNC) return call_builtin(c, fnv.fn, &a, n->pos);
    if (fnv.t == V_MACRO) return call_macro(c, fnv.m, &a, n->pos);
    if (fnv.t == V_UNDEF && callee->k == E_NAME)
        fail(c, LK_ERR_FORMAT, n->pos, "unknown function '%s'", callee->name->p);
    type_fail(c, n->pos, "call", &fnv);
}

static jv eval_node(jctx *c, node *n, frame *f);
/* Every evaluation counts against the depth bound: a left-deep chain such as
 * `a + a + ... + a` recurses once per operator. */
static jv eval(jctx *c, node *n, frame *f) {
    enter(c, n->pos);
    jv v = eval_node(c, n, f);
    leave(c);
    return v;
}

static jv eval_node(jctx *c, node *n, frame *f) {
    jv a, b;
    switch (n->k) {
    case E_LIT: return n->lit;
    case E_NAME: {
        jv v;
        if (lookup(f, n->name->p, &v)) return v;
        return v_undef(n->name->p);
    }
    case E_ATTR:
        a = eval(c, n->a, f);
        return getattr_v(c, &a, n->name->p, n->name->n);
    case E_ITEM:
        a = eval(c, n->a, f);
        b = eval(c, n->b, f);
        return getitem_v(c, &a, &b, n->pos);
    case E_SLICE: return do_slice(c, n, f);
    case E_CALL: return eval_call(c, n, f);
    case E_FILTER: {
        a = eval(c, n->a, f);
        argv_t args = eval_args(c, n, f);
        return apply_filter(c, n->name->p, a, &args, n->pos, f);
    }
    case E_TEST: {
        a = eval(c, n->a, f);
        argv_t args = eval_args(c, n, f);
        bool r = apply_test(c, n->name->p, &a, &args, n->pos);
        return v_bool(r != n->neg);
    }
    case E_NEG: case E_POS:
        a = eval(c, n->a, f);
        if (a.t == V_FLOAT) return v_float(n->k == E_NEG ? -a.f : a.f);
        if (a.t == V_INT || a.t == V_BOOL) {
            int64_t i = num_i(&a);
            if (n->k == E_NEG && i == INT64_MIN) fail(c, LK_ERR_FORMAT, n->pos, "integer overflow");
            return v_int(n->k == E_NEG ? -i : i);
        }
        type_fail(c, n->pos, "unary minus", &a);
    case E_NOT: a = eval(c, n->a, f); return v_bool(!truthy(&a));
    case E_AND: a = eval(c, n->a, f); return truthy(&a) ? eval(c, n->b, f) : a;
    case E_OR: a = eval(c, n->a, f); return truthy(&a) ? a : eval(c, n->b, f);
    case E_COND:
        a = eval(c, n->a, f);
        if (truthy(&a)) return eval(c, n->b, f);
        return n->c ? eval(c, n->c, f) : v_undef(NULL);
    case E_BIN:
        a = eval(c, n->a, f);
        b = eval(c, n->b, f);
        return arith(c, n->name->p, &a, &b, n->pos);
    case E_CMP: {
        a = eval(c, n->a, f);
        b = eval(c, n->b, f);
        const char *op = n->name->p;
        if (!strcmp(op, "==")) return v_bool(veq(&a, &b));
        if (!strcmp(op, "!=")) return v_bool(!veq(&a, &b));
        if (!strcmp(op, "in")) return v_bool(contains(c, &b, &a, n->pos));
        if (!strcmp(op, "notin")) return v_bool(!contains(c, &b, &a, n->pos));
        if (!strcmp(op, "<")) return v_bool(less_v(c, &a, &b, n->pos));
        if (!strcmp(op, ">")) return v_bool(less_v(c, &b, &a, n->pos));
        if (!strcmp(op, "<=")) return v_bool(!less_v(c, &b, &a, n->pos));
        return v_bool(!less_v(c, &a, &b, n->pos));
    }
    case E_LIST: {
        jlist *l = list_new(c);
        l->tuple = n->neg;
        for (int i = 0; i < n->nargs; i++) list_push(c, l, eval(c, n->args[i], f));
        return v_list(l);
    }
    case E_DICT: {
        jdict *d = dict_new(c);
        for (int i = 0; i < n->nargs; i++) {
            jv k = eval(c, n->args[i], f);
            if (k.t != V_STR) fail(c, LK_ERR_FORMAT, n->args[i]->pos, "dict keys must be strings, not a %s", type_name(&k));
            dict_set(c, d, k.s, eval(c, n->kwv[i], f));
        }
        return v_dict(d);
    }
    }
    fail(c, LK_ERR_FORMAT, n->pos, "statement used as an expression");
}

static void assign(jctx *c, frame *f, jstr **tg, int ntg, jv v, int pos) {
    if (ntg == 1) { dict_set(c, f->vars, tg[0], v); return; }
    if (v.t != V_LIST || v.l->n != ntg)
        fail(c, LK_ERR_FORMAT, pos, "cannot unpack a %s into %d variables", type_name(&v), ntg);
    for (int i = 0; i < ntg; i++) dict_set(c, f->vars, tg[i], v.l->a[i]);
}

enum { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };

static int exec_for(jctx *c, node *n, frame *f, sbuf *out) {
    jv it = eval(c, n->a, f);
    if (it.t == V_NONE || it.t == V_INT || it.t == V_FLOAT || it.t == V_BOOL)
        type_fail(c, n->a->pos, "'for' over", &it);
    jlist *all = iter_items(c, &it, n->a->pos), *items = all;
    if (n->b) { /* loop filter: `for x in xs if cond` — loop.* counts kept items only */
        items = list_new(c);
        for (int i = 0; i < all->n; i++) {
            frame *ff = frame_new(c, f);
            assign(c, ff, n->tg, n->ntg, all->a[i], n->pos);
            jv cond = eval(c, n->b, ff);
            if (truthy(&cond)) list_push(c, items, all->a[i]);
        }
    }
    if (items->n == 0) return n->nels ? exec_body(c, n->els, n->nels, f, out) : FLOW_NORMAL;
    jdict *loop = dict_new(c);
    static const char *const keys[] = { "index", "index0", "revindex", "revindex0", "first", "last",
                                        "length", "previtem", "nextitem", "depth", "depth0" };
    jstr *k[11];
    for (int i = 0; i < 11; i++) { k[i] = cstr(c, keys[i]); dict_set(c, loop, k[i], v_none()); }
    jstr *loopname = cstr(c, "loop");
    int len = items->n;
    for (int i = 0; i < len; i++) {
        step(c, n->pos);
        loop->v[0] = v_int(i + 1);
        loop->v[1] = v_int(i);
        loop->v[2] = v_int(len - i);
        loop->v[3] = v_int(len - i - 1);
        loop->v[4] = v_bool(i == 0);
        loop->v[5] = v_bool(i == len - 1);
        loop->v[6] = v_int(len);
        loop->v[7] = i > 0 ? items->a[i - 1] : v_undef("loop.previtem");
        loop->v[8] = i + 1 < len ? items->a[i + 1] : v_undef("loop.nextitem");
        loop->v[9] = v_int(1);
        loop->v[10] = v_int(0);
        /* a fresh scope per iteration: Jinja's `set` inside a loop body does
         * not survive into the next iteration nor out of the loop */
        frame *ff = frame_new(c, f);
        dict_set(c, ff->vars, loopname, v_dict(loop));
        assign(c, ff, n->tg, n->ntg, items->a[i], n->pos);
        int fl = exec_body(c, n->body, n->nbody, ff, out);
        if (fl == FLOW_BREAK) break;
    }
    return FLOW_NORMAL;
}

static int exec_body(jctx *c, node **body, int nb, frame *f, sbuf *out) {
    for (int i = 0; i < nb; i++) {
        node *n = body[i];
        switch (n->k) {
        case S_TEXT: sb_put(c, out, n->lit.s->p, n->lit.s->n); break;
        case S_OUT: {
            jv v = eval(c, n->a, f);
            to_str_into(c, out, &v, false);
            break;
        }
        case S_IF: {
            enter(c, n->pos);
            jv v = eval(c, n->a, f);
            int fl = truthy(&v) ? exec_body(c, n->body, n->nbody, f, out) : exec_body(c, n->els, n->nels, f, out);
            leave(c);
            if (fl != FLOW_NORMAL) return fl;
            break;
        }
        case S_FOR: {
            enter(c, n->pos);
            exec_for(c, n, f, out);
            leave(c);
            break;
        }
        case S_SET: assign(c, f, n->tg, n->ntg, eval(c, n->a, f), n->pos); break;
        case S_SETATTR: {
            jv ns;
            if (!lookup(f, n->tg[0]->p, &ns)) fail(c, LK_ERR_FORMAT, n->pos, "'%s' is undefined", n->tg[0]->p);
            if (ns.t != V_DICT || !ns.d->ns)
                fail(c, LK_ERR_FORMAT, n->pos, "cannot set attribute '%s' on a %s (only on a namespace)", n->name->p, type_name(&ns));
            dict_set(c, ns.d, n->name, eval(c, n->a, f));
            break;
        }
        case S_SETBLOCK: case S_FILTER: {
            enter(c, n->pos);
            sbuf tmp = {0};
            sb_put(c, &tmp, "", 0);
            int fl = exec_body(c, n->body, n->nbody, f, &tmp);
            n->b->lit = v_str(sb_str(c, &tmp)); /* the holder the filter chain reads */
            jv v = eval(c, n->a, f);
            leave(c);
            if (n->k == S_SETBLOCK) dict_set(c, f->vars, n->tg[0], v);
            else to_str_into(c, out, &v, false);
            if (fl != FLOW_NORMAL) return fl;
            break;
        }
        case S_MACRO: {
            jv m = { .t = V_MACRO };
            m.m = n;
            dict_set(c, f->vars, n->name, m);
            break;
        }
        case S_BODY: {
            int fl = exec_body(c, n->body, n->nbody, f, out);
            if (fl != FLOW_NORMAL) return fl;
            break;
        }
        case S_BREAK: return FLOW_BREAK;
        case S_CONTINUE: return FLOW_CONTINUE;
        default: fail(c, LK_ERR_FORMAT, n->pos, "expression used as a statement");
        }
    }
    return FLOW_NORMAL;
}

/* ------------------------------------------------------------------ JSON in */

static jv from_json(jctx *c, json_t *j, int depth) {
    if (depth > MAX_DEPTH) fail(c, LK_ERR_ARG, -1, "extra variables nested too deeply");
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jdict *d = dict_new(c);
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) dict_set(c, d, cstr(c, k), from_json(c, v, depth + 1));
        return v_dict(d);
    }
    case JSON_ARRAY: {
        jlist *l = list_new(c);
        size_t i;
        json_t *v;
        json_array_foreach(j, i, v) list_push(c, l, from_json(c, v, depth + 1));
        return v_list(l);
    }
    case JSON_STRING: return v_str(mkstr(c, json_string_value(j), json_string_length(j)));
    case JSON_INTEGER: return v_int((int64_t)json_integer_value(j));
    case JSON_REAL: return v_float(json_real_value(j));
    case JSON_TRUE: return v_bool(true);
    case JSON_FALSE: return v_bool(false);
    default: return v_none();
    }
}

/* ------------------------------------------------------------------ API */

lk_status lk_chat_render_ex(const char *template_src, const lk_chat_msg *msgs, int n,
                            bool add_generation_prompt, const char *bos_token,
                            const char *eos_token, const char *extra_json,
                            char **out, char *err, size_t errlen) {
    if (out) *out = NULL;
    if (!template_src || !out || n < 0 || (n > 0 && !msgs))
        return lk_fail(err, errlen, LK_ERR_ARG, "chat template: bad arguments");
    size_t srclen = strlen(template_src);
    if (srclen > MAX_TEMPLATE)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "chat template: %zu bytes, more than the %u allowed", srclen, MAX_TEMPLATE);
    json_t *extra = NULL;
    if (extra_json) {
        json_error_t je;
        extra = json_loads(extra_json, JSON_REJECT_DUPLICATES, &je);
        if (!extra || !json_is_object(extra)) {
            json_decref(extra);
            return lk_fail(err, errlen, LK_ERR_ARG, "chat template: extra variables are not a JSON object (%s)", je.text);
        }
    }
    /* volatile: read after longjmp */
    jctx *volatile c = calloc(1, sizeof(jctx));
    if (!c) { json_decref(extra); return lk_fail(err, errlen, LK_ERR_NOMEM, "chat template: out of memory"); }
    c->err = err; c->errlen = errlen;
    c->src = template_src; c->srclen = srclen;
    c->st = LK_OK;
    lk_status st;
    if (setjmp(c->jb)) {
        st = c->st;
    } else {
        load_source(c, template_src, srclen);
        c->tp = 0;
        nvec prog = {0};
        parse_body(c, &prog, NULL, NULL, 0);
        c->depth = 0;

        frame *root = frame_new(c, NULL);
        c->root = root;
        jdict *g = root->vars;
        jlist *ml = list_new(c);
        jstr *k_role = cstr(c, "role"), *k_content = cstr(c, "content");
        for (int i = 0; i < n; i++) {
            if (!msgs[i].role) fail(c, LK_ERR_ARG, -1, "message %d has no role", i);
            jdict *m = dict_new(c);
            dict_set(c, m, k_role, v_cstr(c, msgs[i].role));
            dict_set(c, m, k_content, msgs[i].content ? v_cstr(c, msgs[i].content) : v_none());
            if (msgs[i].fields_json) {
                json_error_t je;
                json_t *fj = json_loads(msgs[i].fields_json, JSON_REJECT_DUPLICATES, &je);
                if (!fj || !json_is_object(fj)) {
                    json_decref(fj);
                    fail(c, LK_ERR_ARG, -1, "message %d: fields are not a JSON object (%s)", i, je.text);
                }
                c->pending = fj; /* released by the caller if the conversion fails */
                const char *k;
                json_t *v;
                json_object_foreach(fj, k, v) dict_set(c, m, cstr(c, k), from_json(c, v, 0));
                c->pending = NULL;
                json_decref(fj);
            }
            list_push(c, ml, v_dict(m));
        }
        dict_set(c, g, cstr(c, "messages"), v_list(ml));
        dict_set(c, g, cstr(c, "add_generation_prompt"), v_bool(add_generation_prompt));
        dict_set(c, g, cstr(c, "bos_token"), v_cstr(c, bos_token ? bos_token : ""));
        dict_set(c, g, cstr(c, "eos_token"), v_cstr(c, eos_token ? eos_token : ""));
        static const struct { const char *name; int fn; } fns[] = {
            { "raise_exception", F_RAISE }, { "namespace", F_NAMESPACE }, { "range", F_RANGE },
            { "dict", F_DICT }, { "strftime_now", F_STRFTIME },
        };
        for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
            jv fv = { .t = V_FUNC };
            fv.fn = fns[i].fn;
            dict_set(c, g, cstr(c, fns[i].name), fv);
        }
        if (extra) {
            const char *k;
            json_t *v;
            json_object_foreach(extra, k, v) dict_set(c, g, cstr(c, k), from_json(c, v, 0));
        }
        sbuf o = {0};
        sb_put(c, &o, "", 0);
        int fl = exec_body(c, prog.a, prog.n, root, &o);
        if (fl != FLOW_NORMAL) fail(c, LK_ERR_FORMAT, -1, "'break' or 'continue' outside a loop");
        char *r = malloc(o.n + 1);
        if (!r) fail(c, LK_ERR_NOMEM, -1, "out of memory");
        if (o.n) memcpy(r, o.p, o.n);
        r[o.n] = 0;
        *out = r;
        st = LK_OK;
    }
    json_decref(c->pending);
    arena_free(c);
    free(c);
    json_decref(extra);
    return st;
}

lk_status lk_chat_render(const char *template_src, const lk_chat_msg *msgs, int n,
                         bool add_generation_prompt, const char *bos_token,
                         const char *eos_token, char **out, char *err, size_t errlen) {
    return lk_chat_render_ex(template_src, msgs, n, add_generation_prompt, bos_token, eos_token,
                             NULL, out, err, errlen);
}

lk_status lk_chat_template_check(const char *template_src, char *err, size_t errlen) {
    if (!template_src) return lk_fail(err, errlen, LK_ERR_ARG, "chat template: none given");
    size_t srclen = strlen(template_src);
    if (srclen > MAX_TEMPLATE)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "chat template: %zu bytes, more than the %u allowed", srclen, MAX_TEMPLATE);
    jctx *volatile c = calloc(1, sizeof(jctx));
    if (!c) return lk_fail(err, errlen, LK_ERR_NOMEM, "chat template: out of memory");
    c->err = err; c->errlen = errlen;
    c->src = template_src; c->srclen = srclen;
    lk_status st = LK_OK;
    if (setjmp(c->jb)) {
        st = c->st;
    } else {
        load_source(c, template_src, srclen);
        nvec prog = {0};
        parse_body(c, &prog, NULL, NULL, 0);
    }
    arena_free(c);
    free(c);
    return st;
}

lk_status lk_chat_template_select(const char *override, const char *from_model, const char **src,
                                  char *err, size_t errlen) {
    *src = NULL;
    if (override && *override) {
        if (strstr(override, "{{") || strstr(override, "{%")) { *src = override; return LK_OK; }
        *src = lk_chat_template_builtin(override);
        if (!*src)
            return lk_fail(err, errlen, LK_ERR_ARG, "--chat-template %s: unknown name (built-in: %s; or pass the Jinja text itself)",
                           override, lk_chat_template_names());
        return LK_OK;
    }
    if (from_model && *from_model) { *src = from_model; return LK_OK; }
    return lk_fail(err, errlen, LK_ERR_ARG, "the model has no tokenizer.chat_template; choose one with --chat-template NAME (%s)",
                   lk_chat_template_names());
}

const char *lk_chat_template_guess(const char *t) {
    if (!t) return "unknown";
    if (strstr(t, "<|start_header_id|>")) return strstr(t, "Cutting Knowledge Date") ? "llama3" : "llama3.0";
    if (strstr(t, "<|im_start|>")) {
        if (strstr(t, "<think>") || strstr(t, "enable_thinking")) return "qwen3";
        if (strstr(t, "You are Qwen") || strstr(t, "<tool_call>")) return "qwen2";
        return "chatml";
    }
    if (strstr(t, "[INST]")) return "mistral";
    if (strstr(t, "<start_of_turn>")) return strstr(t, "first_user_prefix") ? "gemma3" : "gemma";
    if (strstr(t, "<|assistant|>") && strstr(t, "<|end|>")) return "phi3";
    if (strstr(t, "<\xef\xbd\x9c" "User\xef\xbd\x9c>")) return "deepseek3";
    if (strstr(t, "'User: '") || strstr(t, "\"User: \"")) return "deepseek";
    return "unknown";
}
