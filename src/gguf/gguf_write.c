/* gguf writer: key/values and tensor infos are collected in memory (they are
 * small: a 150k-token vocabulary is a few MB), then the header goes out in one
 * piece and tensor data streams after it, each tensor padded to the
 * alignment, so a model of any size is written without being held.
 *
 * Layout written (GGUF v3, exactly as ggml/gguf-py write it): header, key/values
 * in the order first set, tensor infos in declaration order with offsets
 * assigned back to back (each rounded up to the alignment), zero padding to
 * the alignment, then the data of each tensor followed by zero padding to the
 * alignment (after the last tensor too). A file without tensors has no padding
 * after its metadata. */
#include "gguf/gguf.h"
#include "quant/quant.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    char    *key;
    uint8_t *val;  /* u32 type + encoded value, (len) */
    size_t   len;
} wkv;

typedef struct {
    char    *name;
    uint32_t type;
    int      n_dims;
    uint64_t ne[LK_GGUF_MAX_DIMS];
    uint64_t nbytes;
    uint64_t offset; /* in the data section, assigned by begin_data */
} wtensor;

struct lk_gguf_writer {
    char    *path;
    FILE    *fp;
    wkv     *kv;      /* (n_kv) */
    size_t   n_kv, cap_kv;
    wtensor *t;       /* (n_t) */
    size_t   n_t, cap_t;
    bool     in_data; /* begin_data done: no more declarations */
    uint32_t alignment;
    size_t   cur;     /* tensor receiving data */
    uint64_t cur_done;/* bytes of it received */
    char    *iobuf;
};

enum { IOBUF = 4 << 20 };

lk_status lk_gguf_writer_open(const char *path, lk_gguf_writer **out, char *err, size_t errlen) {
    *out = NULL;
    FILE *fp = fopen(path, "wb");
    if (!fp) return lk_fail(err, errlen, LK_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    lk_gguf_writer *w = lk_xcalloc(1, sizeof *w);
    w->path = lk_xstrdup(path);
    w->fp = fp;
    w->alignment = 32;
    /* large stdio buffer: tensor rows arrive in small pieces */
    w->iobuf = lk_xmalloc(IOBUF);
    setvbuf(fp, w->iobuf, _IOFBF, IOBUF);
    *out = w;
    return LK_OK;
}

static void writer_free(lk_gguf_writer *w) {
    for (size_t i = 0; i < w->n_kv; i++) { free(w->kv[i].key); free(w->kv[i].val); }
    for (size_t i = 0; i < w->n_t; i++) free(w->t[i].name);
    free(w->kv);
    free(w->t);
    free(w->path);
    free(w->iobuf);
    free(w);
}

/* Removes what was written, but only if it is a regular file: writing to
 * /dev/null (benchmarks) must never unlink it. */
static void remove_output(lk_gguf_writer *w) {
    struct stat sb;
    if (stat(w->path, &sb) == 0 && S_ISREG(sb.st_mode)) unlink(w->path);
}

void lk_gguf_writer_abort(lk_gguf_writer *w) {
    if (!w) return;
    if (w->fp) fclose(w->fp);
    remove_output(w);
    writer_free(w);
}

/* ---- key/values ---------------------------------------------------------- */

/* Sets key to an encoded value (type + bytes). A key set again is removed and
 * appended with its new value, as ggml's gguf_set_* does, so `quantize` can
 * copy every key, override general.file_type, and order the keys exactly as
 * llama-quantize does. */
static void set_raw(lk_gguf_writer *w, const char *key, uint32_t type, const void *v, size_t n) {
    LK_ASSERT(!w->in_data && key && key[0]);
    uint8_t *val = lk_xmalloc(4 + n);
    memcpy(val, &type, 4);
    if (n) memcpy(val + 4, v, n);
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kv[i].key, key)) {
            free(w->kv[i].key);
            free(w->kv[i].val);
            memmove(&w->kv[i], &w->kv[i + 1], (w->n_kv - i - 1) * sizeof *w->kv);
            w->n_kv--;
            break;
        }
    if (w->n_kv == w->cap_kv) {
        w->cap_kv = w->cap_kv ? w->cap_kv * 2 : 32;
        w->kv = lk_xrealloc(w->kv, w->cap_kv * sizeof *w->kv);
    }
    w->kv[w->n_kv++] = (wkv){lk_xstrdup(key), val, 4 + n};
}

void lk_gguf_writer_set_u32(lk_gguf_writer *w, const char *key, uint32_t v) { set_raw(w, key, LK_GGUF_UINT32, &v, 4); }
void lk_gguf_writer_set_i32(lk_gguf_writer *w, const char *key, int32_t v) { set_raw(w, key, LK_GGUF_INT32, &v, 4); }
void lk_gguf_writer_set_u64(lk_gguf_writer *w, const char *key, uint64_t v) { set_raw(w, key, LK_GGUF_UINT64, &v, 8); }
void lk_gguf_writer_set_f32(lk_gguf_writer *w, const char *key, float v) { set_raw(w, key, LK_GGUF_FLOAT32, &v, 4); }
void lk_gguf_writer_set_bool(lk_gguf_writer *w, const char *key, bool v) {
    uint8_t b = v ? 1 : 0;
    set_raw(w, key, LK_GGUF_BOOL, &b, 1);
}
void lk_gguf_writer_set_str(lk_gguf_writer *w, const char *key, const char *v) {
    uint64_t n = strlen(v);
    uint8_t *b = lk_xmalloc(8 + n);
    memcpy(b, &n, 8);
    memcpy(b + 8, v, n);
    set_raw(w, key, LK_GGUF_STRING, b, 8 + n);
    free(b);
}

/* Array header (element type, count) followed by `n` bytes of elements. */
static void set_arr(lk_gguf_writer *w, const char *key, uint32_t et, uint64_t count, const void *elems, size_t n) {
    uint8_t *b = lk_xmalloc(12 + n);
    memcpy(b, &et, 4);
    memcpy(b + 4, &count, 8);
    if (n) memcpy(b + 12, elems, n);
    set_raw(w, key, LK_GGUF_ARRAY, b, 12 + n);
    free(b);
}
void lk_gguf_writer_set_arr_f32(lk_gguf_writer *w, const char *key, const float *v, uint64_t n) {
    set_arr(w, key, LK_GGUF_FLOAT32, n, v, (size_t)n * 4);
}
void lk_gguf_writer_set_arr_i32(lk_gguf_writer *w, const char *key, const int32_t *v, uint64_t n) {
    set_arr(w, key, LK_GGUF_INT32, n, v, (size_t)n * 4);
}
void lk_gguf_writer_set_arr_str(lk_gguf_writer *w, const char *key, const char *const *strs, uint64_t n) {
    size_t total = 0;
    for (uint64_t i = 0; i < n; i++) total += 8 + strlen(strs[i]);
    uint8_t *b = lk_xmalloc(total ? total : 1), *p = b;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t l = strlen(strs[i]);
        memcpy(p, &l, 8);
        memcpy(p + 8, strs[i], l);
        p += 8 + l;
    }
    set_arr(w, key, LK_GGUF_STRING, n, b, total);
    free(b);
}

void lk_gguf_writer_copy_kv(lk_gguf_writer *w, const lk_gguf *g, int64_t i) {
    size_t n;
    const void *v = lk_gguf_kv_raw(g, i, &n);
    set_raw(w, lk_gguf_kv_key(g, i), lk_gguf_kv_type(g, i), v, n);
}

/* ---- tensors ------------------------------------------------------------- */

void lk_gguf_writer_add_tensor(lk_gguf_writer *w, const char *name, uint32_t type, int n_dims, const uint64_t *ne) {
    LK_ASSERT(!w->in_data && name && name[0] && n_dims >= 1 && n_dims <= LK_GGUF_MAX_DIMS);
    for (size_t i = 0; i < w->n_t; i++) LK_ASSERT(strcmp(w->t[i].name, name) != 0);
    wtensor t = {.name = lk_xstrdup(name), .type = type, .n_dims = n_dims};
    uint64_t rows = 1;
    for (int d = 0; d < LK_GGUF_MAX_DIMS; d++) {
        t.ne[d] = d < n_dims ? ne[d] : 1;
        LK_ASSERT(t.ne[d] > 0);
        if (d > 0) LK_ASSERT(lk_mul_ok(rows, t.ne[d], &rows));
    }
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(type, (int64_t)t.ne[0], &rb)); /* known type, whole blocks */
    LK_ASSERT(lk_mul_ok(rb, rows, &t.nbytes));
    if (w->n_t == w->cap_t) {
        w->cap_t = w->cap_t ? w->cap_t * 2 : 64;
        w->t = lk_xrealloc(w->t, w->cap_t * sizeof *w->t);
    }
    w->t[w->n_t++] = t;
}

/* ---- output -------------------------------------------------------------- */

static lk_status out(lk_gguf_writer *w, const void *p, size_t n, char *err, size_t errlen) {
    if (n && fwrite(p, 1, n, w->fp) != n)
        return lk_fail(err, errlen, LK_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    return LK_OK;
}
static lk_status out_pad(lk_gguf_writer *w, uint64_t pos, char *err, size_t errlen) {
    static const uint8_t zeros[64];
    uint64_t pad = (w->alignment - pos % w->alignment) % w->alignment;
    lk_status st = LK_OK;
    while (pad && !st) {
        size_t k = (size_t)LK_MIN(pad, sizeof zeros);
        st = out(w, zeros, k, err, errlen);
        pad -= k;
    }
    return st;
}
static lk_status out_str(lk_gguf_writer *w, const char *s, char *err, size_t errlen) {
    uint64_t n = strlen(s);
    lk_status st = out(w, &n, 8, err, errlen);
    return st ? st : out(w, s, n, err, errlen);
}

lk_status lk_gguf_writer_begin_data(lk_gguf_writer *w, char *err, size_t errlen) {
    LK_ASSERT(!w->in_data);
    w->in_data = true;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kv[i].key, "general.alignment")) continue;
        uint32_t type, a = 0;
        memcpy(&type, w->kv[i].val, 4);
        if (type == LK_GGUF_UINT32) memcpy(&a, w->kv[i].val + 4, 4);
        if (type != LK_GGUF_UINT32 || a == 0 || (a & (a - 1)))
            return lk_fail(err, errlen, LK_ERR_ARG, "%s: general.alignment must be a u32 power of two", w->path);
        w->alignment = a;
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        w->t[i].offset = off;
        off += (w->t[i].nbytes + w->alignment - 1) / w->alignment * w->alignment;
    }
    uint32_t version = 3;
    uint64_t nt = w->n_t, nkv = w->n_kv, pos = 4 + 4 + 8 + 8;
    lk_status st;
    if ((st = out(w, "GGUF", 4, err, errlen)) || (st = out(w, &version, 4, err, errlen)) ||
        (st = out(w, &nt, 8, err, errlen)) || (st = out(w, &nkv, 8, err, errlen)))
        return st;
    for (size_t i = 0; i < w->n_kv; i++) {
        if ((st = out_str(w, w->kv[i].key, err, errlen)) || (st = out(w, w->kv[i].val, w->kv[i].len, err, errlen)))
            return st;
        pos += 8 + strlen(w->kv[i].key) + w->kv[i].len;
    }
    for (size_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        uint32_t nd = (uint32_t)t->n_dims;
        if ((st = out_str(w, t->name, err, errlen)) || (st = out(w, &nd, 4, err, errlen)) ||
            (st = out(w, t->ne, 8 * nd, err, errlen)) || (st = out(w, &t->type, 4, err, errlen)) ||
            (st = out(w, &t->offset, 8, err, errlen)))
            return st;
        pos += 8 + strlen(t->name) + 4 + 8 * nd + 4 + 8;
    }
    /* A file without tensors ends right after its metadata, as gguf-py writes
     * vocabulary files (readers seek to the aligned offset; nothing is read). */
    st = w->n_t ? out_pad(w, pos, err, errlen) : LK_OK;
    w->cur = 0;
    w->cur_done = 0;
    return st;
}

lk_status lk_gguf_writer_write(lk_gguf_writer *w, const void *data, size_t n, char *err, size_t errlen) {
    LK_ASSERT(w->in_data);
    const uint8_t *p = data;
    while (n) {
        LK_ASSERT(w->cur < w->n_t); /* more bytes than the declared tensors hold */
        const wtensor *t = &w->t[w->cur];
        size_t k = (size_t)LK_MIN((uint64_t)n, t->nbytes - w->cur_done);
        lk_status st = out(w, p, k, err, errlen);
        if (st) return st;
        p += k;
        n -= k;
        w->cur_done += k;
        if (w->cur_done == t->nbytes) {
            if ((st = out_pad(w, t->nbytes, err, errlen))) return st;
            w->cur++;
            w->cur_done = 0;
        }
    }
    return LK_OK;
}

lk_status lk_gguf_writer_close(lk_gguf_writer *w, char *err, size_t errlen) {
    lk_status st = LK_OK;
    if (!w->in_data) st = lk_gguf_writer_begin_data(w, err, errlen);
    if (!st && w->cur < w->n_t)
        st = lk_fail(err, errlen, LK_ERR_ARG, "%s: tensor %zu '%s' received %llu of its %llu bytes", w->path, w->cur,
                     w->t[w->cur].name, (unsigned long long)w->cur_done, (unsigned long long)w->t[w->cur].nbytes);
    if (!st && fflush(w->fp) != 0)
        st = lk_fail(err, errlen, LK_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    if (st) {
        lk_gguf_writer_abort(w);
        return st;
    }
    int rc = fclose(w->fp);
    w->fp = NULL;
    if (rc != 0) {
        st = lk_fail(err, errlen, LK_ERR_IO, "%s: close failed: %s", w->path, strerror(errno));
        remove_output(w);
    }
    writer_free(w);
    return st;
}
