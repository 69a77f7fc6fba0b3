#include "common/lk_common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *lk_status_to_string(lk_status s) {
    switch (s) {
    case LK_OK: return "ok";
    case LK_ERR_ARG: return "bad argument";
    case LK_ERR_IO: return "i/o error";
    case LK_ERR_FORMAT: return "malformed input";
    case LK_ERR_UNSUPPORTED: return "unsupported";
    case LK_ERR_NOMEM: return "out of memory";
    case LK_ERR_NET: return "network error";
    case LK_ERR_AUTH: return "authentication failed";
    case LK_ERR_MISMATCH: return "mismatch";
    case LK_ERR_TIMEOUT: return "timeout";
    case LK_ERR_PEER: return "peer error";
    }
    return "unknown status";
}

lk_status lk_fail(char *err, size_t errlen, lk_status st, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return st;
}

void lk_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "lockstep: internal error: assertion '%s' failed at %s:%d\n", expr, file, line);
    abort();
}

/* Length of the valid UTF-8 character at p (n bytes left), 0 if the bytes
 * there are not one (overlong forms, surrogates and code points past
 * U+10FFFF are invalid, as in RFC 3629). */
static size_t utf8_len(const uint8_t *p, size_t n) {
    uint8_t c = p[0];
    size_t len;
    uint32_t cp, min;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) { len = 2; cp = c & 0x1f; min = 0x80; }
    else if (c >= 0xe0 && c <= 0xef) { len = 3; cp = c & 0x0f; min = 0x800; }
    else if (c >= 0xf0 && c <= 0xf4) { len = 4; cp = c & 0x07; min = 0x10000; }
    else return 0;
    if (len > n) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xc0) != 0x80) return 0;
        cp = cp << 6 | (p[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return len;
}

size_t lk_str_sanitize(char *out, size_t outlen, const void *s, size_t n) {
    LK_ASSERT(outlen > 0);
    const uint8_t *p = s;
    size_t i = 0, o = 0;
    while (i < n) {
        char esc[8];
        const char *piece;
        size_t len = utf8_len(p + i, n - i), plen;
        bool c1 = len == 2 && p[i] == 0xc2 && p[i + 1] < 0xa0; /* U+0080..U+009F */
        if (len == 1 && p[i] == '\\') { piece = "\\\\"; plen = 2; }
        else if (len == 1 && p[i] == '\n') { piece = "\\n"; plen = 2; }
        else if (len == 1 && p[i] == '\t') { piece = "\\t"; plen = 2; }
        else if (len == 0 || c1 || (len == 1 && (p[i] < 0x20 || p[i] == 0x7f))) {
            /* one byte escaped; a C1 character's second byte follows as its own escape */
            snprintf(esc, sizeof esc, "\\x%02x", p[i]);
            piece = esc;
            plen = 4;
            len = 1;
        } else { piece = (const char *)p + i; plen = len; }
        if (o + plen > outlen - 1) break;
        memcpy(out + o, piece, plen);
        o += plen;
        i += len;
    }
    out[o] = 0;
    return i;
}

static int g_log_level = LK_LOG_INFO;
void lk_log_set_level(int level) { g_log_level = level; }
int lk_log_level(void) { return g_log_level; }

void lk_log(int level, const char *fmt, ...) {
    if (level > g_log_level) return;
    static const char *names[] = {"error", "warn", "info", "debug"};
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    /* one fprintf so lines from several threads/processes do not interleave */
    fprintf(stderr, "lockstep %s: %s\n", names[level < 0 ? 0 : level > 3 ? 3 : level], buf);
}

uint64_t lk_time_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
double lk_time_s(void) { return (double)lk_time_ns() * 1e-9; }

static _Noreturn void oom(size_t n) {
    fprintf(stderr, "lockstep: out of memory allocating %zu bytes\n", n);
    abort();
}
void *lk_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) oom(n);
    return p;
}
void *lk_xcalloc(size_t n, size_t sz) {
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p) oom(n * sz);
    return p;
}
void *lk_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) oom(n);
    return q;
}
void lk_buf_put(lk_buf *b, const void *x, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t c = LK_MAX(2 * b->cap, b->n + n + 1);
        b->p = lk_xrealloc(b->p, LK_MAX(c, (size_t)64));
        b->cap = LK_MAX(c, (size_t)64);
    }
    if (n) memcpy(b->p + b->n, x, n);
    b->n += n;
    b->p[b->n] = 0;
}

void lk_buf_printf(lk_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (!b->p || b->n + (size_t)n + 1 > b->cap) {   /* did not fit: grow, then write it again */
        lk_buf_put(b, "", 0);
        size_t need = b->n + (size_t)n + 1;
        if (need > b->cap) { b->p = lk_xrealloc(b->p, need); b->cap = need; }
        va_start(ap, fmt);
        vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
        va_end(ap);
    }
    b->n += (size_t)n;
}

char *lk_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = lk_xmalloc(n);
    memcpy(p, s, n);
    return p;
}
void *lk_xmalloc_aligned(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? (n + 63) & ~(size_t)63 : 64) != 0) oom(n);
    return p;
}

/* IEEE half conversion, round to nearest even (matches F16C / ggml). */
float lk_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) u = sign;
        else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            u = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) u = sign | 0x7f800000u | man << 13;
    else u = sign | (exp + 112) << 23 | man << 13;
    union { uint32_t u; float f; } v = { .u = u };
    return v.f;
}

uint16_t lk_fp32_to_fp16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    uint32_t x = v.u, sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* overflow -> inf */
    if (ax < 0x38800000u) { /* subnormal or zero in half */
        if (ax < 0x33000000u) return (uint16_t)sign;
        uint32_t m = (ax & 0x7fffff) | 0x800000;
        int shift = 126 - (int)(ax >> 23);  /* 14..24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((ax >> 13) - (112u << 10));
    uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

uint16_t lk_fp32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    if ((v.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((v.u >> 16) | 64); /* quiet nan */
    return (uint16_t)((v.u + (0x7fff + ((v.u >> 16) & 1))) >> 16);
}
