/* gguf reader: parse and validate a whole GGUF v2/v3 file up front, then
 * answer queries from the read-only mapping.
 *
 * File layout (all little-endian):
 *   "GGUF" u32 version, u64 n_tensors, u64 n_kv,
 *   n_kv   x { string key, u32 type, value }
 *   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset }
 *   padding to general.alignment (default 32), then the data section; each
 *   tensor's offset is relative to the data section.
 *   string = u64 length + bytes (no NUL); array = u32 elem type, u64 n, elems.
 *
 * Validation strategy: a cursor walks the file with every read bounds-checked
 * against the file size; counts read from the file are checked against the
 * bytes that remain (each element needs a known minimum number of bytes)
 * before anything proportional to them is allocated, and the per-entry tables
 * grow as entries actually parse, so a lying header cannot make us allocate
 * more than the file could describe. */
#include "gguf/gguf.h"
#include "quant/quant.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "GGUF reading assumes a little-endian host");

/* Limits on things real files never approach; beyond them the file is
 * treated as malformed rather than trusted. */
#define KEY_MAX_LEN      65535u   /* the spec's bound on key length */
#define NAME_MAX_LEN     1024u    /* tensor names (ggml itself uses 64) */
#define ARRAY_MAX_DEPTH  8        /* arrays of arrays of ... */
#define ALIGN_MAX        (1u << 20)

/* A key or tensor name from the file as it may appear in a message: control
 * bytes and escapes shown escaped (lk_str_sanitize), cut to fit buf. */
static const char *safe(char *buf, size_t len, const char *s) {
    lk_str_sanitize(buf, len, s, strlen(s));
    return buf;
}

typedef struct {
    char         *key;      /* NUL-terminated copy, (key_len + 1) */
    lk_gguf_vtype type;
    uint64_t      off;      /* file offset of the value (scalars, strings: length prefix) */
    uint64_t      end;      /* file offset just past the value */
    /* arrays only */
    lk_gguf_vtype elem;
    uint64_t      n;
    uint64_t      data;     /* file offset of element 0 */
    uint64_t     *str_off;  /* string arrays: file offset of each element's length prefix, (n) */
} kv_t;

typedef struct {
    const char *name;
    int64_t     idx;
} name_idx;

struct lk_gguf {
    char          *path;
    const uint8_t *map;       /* (size) */
    uint64_t       size;
    uint32_t       version;
    uint32_t       alignment;
    uint64_t       data_off;
    int64_t        n_kv, n_tensors;
    kv_t          *kv;        /* (n_kv) */
    lk_gguf_tensor *t;        /* (n_tensors) */
    name_idx      *kv_sorted; /* (n_kv) by key, for bsearch */
    name_idx      *t_sorted;  /* (n_tensors) by name */
};

/* ---- cursor ---------------------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    uint64_t       size, off;
    const char    *path;
    char          *err;
    size_t         errlen;
    char           what[160]; /* what is being parsed, for messages */
} cur;

static lk_status truncated(cur *c, uint64_t need, const char *field) {
    return lk_fail(c->err, c->errlen, LK_ERR_FORMAT,
                   "%s: %s%s%s at byte %" PRIu64 " needs %" PRIu64 " bytes but the file ends at %" PRIu64
                   " (truncated?)", c->path, c->what, c->what[0] ? ": " : "", field, c->off, need, c->size);
}

static uint64_t remaining(const cur *c) { return c->size - c->off; }

static lk_status rd(cur *c, void *dst, uint64_t n, const char *field) {
    if (n > remaining(c)) return truncated(c, n, field);
    memcpy(dst, c->p + c->off, n);
    c->off += n;
    return LK_OK;
}
static lk_status rd_u32(cur *c, uint32_t *v, const char *f) { return rd(c, v, 4, f); }
static lk_status rd_u64(cur *c, uint64_t *v, const char *f) { return rd(c, v, 8, f); }

/* A string: returns its bytes' offset and length after checking both fit. */
static lk_status rd_str(cur *c, uint64_t *soff, uint64_t *slen, uint64_t maxlen, const char *field) {
    uint64_t at = c->off, n = 0;
    lk_status st = rd_u64(c, &n, field);
    if (st) return st;
    if (n > remaining(c)) {
        c->off = at;
        return lk_fail(c->err, c->errlen, LK_ERR_FORMAT,
                       "%s: %s%s%s length %" PRIu64 " at byte %" PRIu64 " extends past end of file (%" PRIu64 " bytes)",
                       c->path, c->what, c->what[0] ? ": " : "", field, n, at, c->size);
    }
    if (maxlen && n > maxlen) {
        c->off = at;
        return lk_fail(c->err, c->errlen, LK_ERR_FORMAT,
                       "%s: %s%s%s length %" PRIu64 " at byte %" PRIu64 " exceeds the limit of %" PRIu64,
                       c->path, c->what, c->what[0] ? ": " : "", field, n, at, maxlen);
    }
    *soff = c->off;
    *slen = n;
    c->off += n;
    return LK_OK;
}

/* ---- values ----------------------------------------------------------------- */

const char *lk_gguf_vtype_name(lk_gguf_vtype t) {
    switch (t) {
    case LK_GGUF_UINT8: return "u8";
    case LK_GGUF_INT8: return "i8";
    case LK_GGUF_UINT16: return "u16";
    case LK_GGUF_INT16: return "i16";
    case LK_GGUF_UINT32: return "u32";
    case LK_GGUF_INT32: return "i32";
    case LK_GGUF_FLOAT32: return "f32";
    case LK_GGUF_BOOL: return "bool";
    case LK_GGUF_STRING: return "string";
    case LK_GGUF_ARRAY: return "array";
    case LK_GGUF_UINT64: return "u64";
    case LK_GGUF_INT64: return "i64";
    case LK_GGUF_FLOAT64: return "f64";
    }
    return "invalid";
}

/* Bytes of a fixed-size value type; 0 for string/array/invalid. */
static uint64_t vtype_size(uint32_t t) {
    switch (t) {
    case LK_GGUF_UINT8: case LK_GGUF_INT8: case LK_GGUF_BOOL: return 1;
    case LK_GGUF_UINT16: case LK_GGUF_INT16: return 2;
    case LK_GGUF_UINT32: case LK_GGUF_INT32: case LK_GGUF_FLOAT32: return 4;
    case LK_GGUF_UINT64: case LK_GGUF_INT64: case LK_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}
static bool vtype_valid(uint32_t t) { return t <= LK_GGUF_FLOAT64; }

/* Fewest bytes one element of type t can occupy (for count sanity checks). */
static uint64_t vtype_min_size(uint32_t t) {
    if (t == LK_GGUF_STRING) return 8;
    if (t == LK_GGUF_ARRAY) return 12;
    return vtype_size(t);
}

static lk_status bad_type(cur *c, uint64_t at, uint32_t t, const char *field) {
    return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: invalid %s %" PRIu32 " at byte %" PRIu64
                   " (valid: 0..12)", c->path, c->what, field, t, at);
}

/* Array body after its element type (read at `at`): count, then elements.
 * Skips over (validating) every element; for a top-level string array, fills
 * kv->str_off. depth counts enclosing arrays. */
static lk_status skip_array(cur *c, uint32_t elem, int depth, kv_t *kv) {
    uint64_t at = c->off, n = 0;
    lk_status st = rd_u64(c, &n, "array length");
    if (st) return st;
    uint64_t min = vtype_min_size(elem);
    if (min && n > remaining(c) / min)
        return lk_fail(c->err, c->errlen, LK_ERR_FORMAT,
                       "%s: %s: array length %" PRIu64 " at byte %" PRIu64 " cannot fit in the %" PRIu64
                       " bytes left (elements of type %s need >= %" PRIu64 " bytes each)",
                       c->path, c->what, n, at, remaining(c), lk_gguf_vtype_name(elem), min);
    if (kv) { kv->elem = elem; kv->n = n; kv->data = c->off; }
    if (elem == LK_GGUF_STRING) {
        /* n <= remaining/8 was checked, so the index is bounded by the file size */
        if (kv && n) kv->str_off = lk_xmalloc(n * sizeof(uint64_t));
        for (uint64_t i = 0; i < n; i++) {
            uint64_t so, sl;
            if (kv) kv->str_off[i] = c->off;
            if ((st = rd_str(c, &so, &sl, 0, "string element"))) {
                /* name the element only on failure: formatting 150k field
                 * names would dominate the time to open a vocabulary */
                char f[48];
                snprintf(f, sizeof f, "string element %" PRIu64, i);
                return rd_str(c, &so, &sl, 0, f);
            }
        }
    } else if (elem == LK_GGUF_ARRAY) {
        if (depth + 1 >= ARRAY_MAX_DEPTH)
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: arrays nested deeper than %d at byte %" PRIu64,
                           c->path, c->what, ARRAY_MAX_DEPTH, at);
        for (uint64_t i = 0; i < n; i++) {
            uint64_t tat = c->off;
            uint32_t et;
            if ((st = rd_u32(c, &et, "nested array element type"))) return st;
            if (!vtype_valid(et)) return bad_type(c, tat, et, "nested array element type");
            if ((st = skip_array(c, et, depth + 1, NULL))) return st;
        }
    } else {
        c->off += n * min; /* n * min <= remaining, checked above */
    }
    return LK_OK;
}

/* ---- open --------------------------------------------------------------------- */

static int cmp_name_idx(const void *a, const void *b) {
    return strcmp(((const name_idx *)a)->name, ((const name_idx *)b)->name);
}

static void free_parsed(lk_gguf *g) {
    for (int64_t i = 0; i < g->n_kv; i++) { free(g->kv[i].key); free(g->kv[i].str_off); }
    for (int64_t i = 0; i < g->n_tensors; i++) free((char *)g->t[i].name);
    free(g->kv);
    free(g->t);
    free(g->kv_sorted);
    free(g->t_sorted);
}

void lk_gguf_close(lk_gguf *g) {
    if (!g) return;
    free_parsed(g);
    if (g->map) munmap((void *)g->map, g->size);
    free(g->path);
    free(g);
}

static lk_status parse_kvs(lk_gguf *g, cur *c, uint64_t n_kv) {
    lk_status st;
    size_t cap = 0;
    for (uint64_t i = 0; i < n_kv; i++) {
        snprintf(c->what, sizeof c->what, "key/value %" PRIu64, i);
        uint64_t ko, kl;
        if ((st = rd_str(c, &ko, &kl, KEY_MAX_LEN, "key"))) return st;
        if (kl == 0)
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: key/value %" PRIu64 ": empty key at byte %" PRIu64,
                           c->path, i, ko - 8);
        if ((size_t)g->n_kv == cap) {
            cap = cap ? cap * 2 : 32;
            g->kv = lk_xrealloc(g->kv, cap * sizeof *g->kv);
        }
        kv_t *kv = &g->kv[g->n_kv++];
        memset(kv, 0, sizeof *kv);
        kv->key = lk_xmalloc(kl + 1);
        memcpy(kv->key, c->p + ko, kl);
        kv->key[kl] = 0;
        char sk[101];
        snprintf(c->what, sizeof c->what, "key/value %" PRIu64 " '%s'", i, safe(sk, sizeof sk, kv->key));
        if (memchr(kv->key, 0, kl))
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: key contains a NUL byte", c->path, c->what);
        uint64_t tat = c->off;
        uint32_t t;
        if ((st = rd_u32(c, &t, "value type"))) return st;
        if (!vtype_valid(t)) return bad_type(c, tat, t, "value type");
        kv->type = (lk_gguf_vtype)t;
        kv->off = c->off;
        if (t == LK_GGUF_STRING) {
            uint64_t so, sl;
            if ((st = rd_str(c, &so, &sl, 0, "string value"))) return st;
        } else if (t == LK_GGUF_ARRAY) {
            uint64_t eat = c->off;
            uint32_t et;
            if ((st = rd_u32(c, &et, "array element type"))) return st;
            if (!vtype_valid(et)) return bad_type(c, eat, et, "array element type");
            if ((st = skip_array(c, et, 0, kv))) return st;
        } else {
            uint64_t sz = vtype_size(t);
            if (sz > remaining(c)) return truncated(c, sz, "value");
            c->off += sz;
        }
        kv->end = c->off;
    }
    c->what[0] = 0;
    /* duplicates: sort once, compare neighbours (n log n, not n^2) */
    g->kv_sorted = lk_xmalloc((size_t)(g->n_kv ? g->n_kv : 1) * sizeof *g->kv_sorted);
    for (int64_t i = 0; i < g->n_kv; i++) g->kv_sorted[i] = (name_idx){g->kv[i].key, i};
    qsort(g->kv_sorted, (size_t)g->n_kv, sizeof *g->kv_sorted, cmp_name_idx);
    char sk[201];
    for (int64_t i = 1; i < g->n_kv; i++)
        if (!strcmp(g->kv_sorted[i - 1].name, g->kv_sorted[i].name))
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: duplicate key '%s' (key/values %" PRId64 " and %" PRId64 ")",
                           c->path, safe(sk, sizeof sk, g->kv_sorted[i].name), LK_MIN(g->kv_sorted[i - 1].idx, g->kv_sorted[i].idx),
                           LK_MAX(g->kv_sorted[i - 1].idx, g->kv_sorted[i].idx));
    return LK_OK;
}

static lk_status parse_tensor_infos(lk_gguf *g, cur *c, uint64_t n_tensors) {
    lk_status st;
    size_t cap = 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        snprintf(c->what, sizeof c->what, "tensor %" PRIu64, i);
        uint64_t no, nl;
        if ((st = rd_str(c, &no, &nl, NAME_MAX_LEN, "name"))) return st;
        if ((size_t)g->n_tensors == cap) {
            cap = cap ? cap * 2 : 64;
            g->t = lk_xrealloc(g->t, cap * sizeof *g->t);
        }
        lk_gguf_tensor *t = &g->t[g->n_tensors++];
        memset(t, 0, sizeof *t);
        char *name = lk_xmalloc(nl + 1);
        memcpy(name, c->p + no, nl);
        name[nl] = 0;
        t->name = name;
        char sn[101];
        snprintf(c->what, sizeof c->what, "tensor %" PRIu64 " '%s'", i, safe(sn, sizeof sn, name));
        if (nl == 0 || memchr(name, 0, nl))
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: %s name at byte %" PRIu64, c->path, c->what,
                           nl ? "NUL byte in" : "empty", no - 8);
        uint64_t dat = c->off;
        uint32_t nd;
        if ((st = rd_u32(c, &nd, "n_dims"))) return st;
        if (nd == 0 || nd > LK_GGUF_MAX_DIMS)
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: n_dims %" PRIu32 " at byte %" PRIu64
                           " (must be 1..%d)", c->path, c->what, nd, dat, LK_GGUF_MAX_DIMS);
        t->n_dims = (int)nd;
        uint64_t nel = 1;
        for (int d = 0; d < LK_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint64_t eat = c->off;
            if ((st = rd_u64(c, &t->ne[d], "ne"))) return st;
            if (t->ne[d] == 0 || t->ne[d] > (uint64_t)INT64_MAX)
                return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: ne[%" PRIu32 "] = %" PRIu64 " at byte %" PRIu64
                               " (must be 1..2^63-1)", c->path, c->what, d, t->ne[d], eat);
            if (!lk_mul_ok(nel, t->ne[d], &nel) || nel > (uint64_t)INT64_MAX)
                return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: element count overflows at ne[%" PRIu32
                               "] (byte %" PRIu64 ")", c->path, c->what, d, eat);
        }
        t->n_elements = nel;
        uint64_t tat = c->off;
        if ((st = rd_u32(c, &t->type, "type"))) return st;
        if ((st = rd_u64(c, &t->offset, "offset"))) return st;
        /* ids from LK_TYPE_COUNT on are lockstep's own layouts, never a file's */
        int64_t bs = t->type < LK_TYPE_COUNT ? lk_type_block_size(t->type) : 0;
        if (bs <= 0)
            return lk_fail(c->err, c->errlen, LK_ERR_UNSUPPORTED, "%s: %s: unknown tensor type id %" PRIu32 " at byte %" PRIu64,
                           c->path, c->what, t->type, tat);
        size_t rb;
        if (t->ne[0] % (uint64_t)bs || !lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb))
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: row length ne[0] = %" PRIu64
                           " is not a multiple of %s's block size %" PRId64, c->path, c->what, t->ne[0],
                           lk_type_name(t->type), bs);
        if (!lk_mul_ok(rb, nel / t->ne[0], &t->nbytes))
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: %s: byte size overflows", c->path, c->what);
    }
    c->what[0] = 0;
    g->t_sorted = lk_xmalloc((size_t)(g->n_tensors ? g->n_tensors : 1) * sizeof *g->t_sorted);
    for (int64_t i = 0; i < g->n_tensors; i++) g->t_sorted[i] = (name_idx){g->t[i].name, i};
    qsort(g->t_sorted, (size_t)g->n_tensors, sizeof *g->t_sorted, cmp_name_idx);
    char sn[201];
    for (int64_t i = 1; i < g->n_tensors; i++)
        if (!strcmp(g->t_sorted[i - 1].name, g->t_sorted[i].name))
            return lk_fail(c->err, c->errlen, LK_ERR_FORMAT, "%s: duplicate tensor name '%s' (tensors %" PRId64 " and %" PRId64 ")",
                           c->path, safe(sn, sizeof sn, g->t_sorted[i].name), LK_MIN(g->t_sorted[i - 1].idx, g->t_sorted[i].idx),
                           LK_MAX(g->t_sorted[i - 1].idx, g->t_sorted[i].idx));
    return LK_OK;
}

static int cmp_off(const void *a, const void *b, void *ctx) {
    const lk_gguf_tensor *t = ctx;
    uint64_t x = t[*(const int64_t *)a].offset, y = t[*(const int64_t *)b].offset;
    return x < y ? -1 : x > y;
}

/* The alignment the data of a tensor of type t needs in memory. Element
 * types (f32, f16, bf16, i8..i64, f64) are read through pointers of their
 * element type (norm weights and biases as float *, the float kernels'
 * loads), so their data must be aligned to the element size; a misaligned
 * one is undefined behaviour (UBSan: misaligned load in lk_rmsnorm) and may
 * fault. Block types are read byte-wise (quant_impl.h: every multi-byte
 * field through memcpy), so any address does. The mapping starts on a page,
 * so a file offset with this alignment gives an aligned address. */
static uint64_t type_align(uint32_t t) {
    return lk_type_block_size(t) == 1 ? lk_type_block_bytes(t) : 1;
}

static lk_status check_data(lk_gguf *g, char *err, size_t errlen) {
    char sn[201];
    for (int64_t i = 0; i < g->n_tensors; i++) {
        lk_gguf_tensor *t = &g->t[i];
        if (t->offset % g->alignment)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tensor %" PRId64 " '%s': offset %" PRIu64
                           " is not a multiple of the alignment %" PRIu32, g->path, i, safe(sn, sizeof sn, t->name),
                           t->offset, g->alignment);
        uint64_t a, e;
        if (!lk_add_ok(g->data_off, t->offset, &a) || !lk_add_ok(a, t->nbytes, &e))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tensor %" PRId64 " '%s': offset %" PRIu64
                           " (+ %" PRIu64 " bytes) lies past end of file (%" PRIu64 " bytes)", g->path, i,
                           safe(sn, sizeof sn, t->name), t->offset, t->nbytes, g->size);
        if (e > g->size)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tensor %" PRId64 " '%s': data [%" PRIu64 ", %" PRIu64
                           ") extends past end of file (%" PRIu64 " bytes)", g->path, i, safe(sn, sizeof sn, t->name),
                           a, a + t->nbytes, g->size);
        uint64_t need = type_align(t->type);
        if (a % need)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tensor %" PRId64 " '%s' (%s): data at byte %" PRIu64
                           " of the file (offset %" PRIu64 " in the data section, general.alignment %" PRIu32
                           ") is not aligned to %" PRIu64 " bytes, as %s data must be; rewrite the file with the"
                           " default alignment 32", g->path, i, safe(sn, sizeof sn, t->name), lk_type_name(t->type),
                           a, t->offset, g->alignment, need, lk_type_name(t->type));
        t->data = g->map + a;
    }
    if (g->n_tensors < 2) return LK_OK;
    int64_t *ord = lk_xmalloc((size_t)g->n_tensors * sizeof *ord);
    for (int64_t i = 0; i < g->n_tensors; i++) ord[i] = i;
    qsort_r(ord, (size_t)g->n_tensors, sizeof *ord, cmp_off, g->t);
    lk_status st = LK_OK;
    for (int64_t k = 1; k < g->n_tensors && !st; k++) {
        const lk_gguf_tensor *p = &g->t[ord[k - 1]], *q = &g->t[ord[k]];
        if (p->offset + p->nbytes > q->offset) {
            char sq[201];
            st = lk_fail(err, errlen, LK_ERR_FORMAT, "%s: tensors %" PRId64 " '%s' [%" PRIu64 ", %" PRIu64 ") and %" PRId64
                         " '%s' [%" PRIu64 ", %" PRIu64 ") overlap (offsets relative to the data section)",
                         g->path, ord[k - 1], safe(sn, sizeof sn, p->name), p->offset, p->offset + p->nbytes, ord[k],
                         safe(sq, sizeof sq, q->name), q->offset, q->offset + q->nbytes);
        }
    }
    free(ord);
    return st;
}

static lk_status parse(lk_gguf *g, char *err, size_t errlen) {
    cur c = {.p = g->map, .size = g->size, .path = g->path, .err = err, .errlen = errlen};
    lk_status st;
    char magic[4];
    if ((st = rd(&c, magic, 4, "magic"))) return st;
    if (memcmp(magic, "GGUF", 4))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: bad magic %02x %02x %02x %02x at byte 0 (expected \"GGUF\"): not a GGUF file",
                       g->path, (uint8_t)magic[0], (uint8_t)magic[1], (uint8_t)magic[2], (uint8_t)magic[3]);
    if ((st = rd_u32(&c, &g->version, "version"))) return st;
    if (g->version == 1)
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: GGUF version 1 (at byte 4) is not supported (32-bit counts); "
                       "convert it to v3 with a current llama.cpp", g->path);
    if (g->version != 2 && g->version != 3) {
        if ((g->version & 0xffff) == 0 && (g->version >> 16))
            return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: version field 0x%08" PRIx32 " at byte 4 looks big-endian; "
                           "only little-endian GGUF is supported", g->path, g->version);
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: unsupported GGUF version %" PRIu32 " at byte 4 (supported: 2, 3)",
                       g->path, g->version);
    }
    uint64_t n_tensors, n_kv;
    if ((st = rd_u64(&c, &n_tensors, "n_tensors"))) return st;
    if ((st = rd_u64(&c, &n_kv, "n_kv"))) return st;
    /* minimal sizes: a key/value is >= 8+1+4+1 bytes, a tensor info >= 8+1+4+8+4+8 */
    uint64_t rem = remaining(&c);
    if (n_kv > rem / 14)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: n_kv %" PRIu64 " at byte 16 cannot fit in the %" PRIu64
                       " bytes after the header", g->path, n_kv, rem);
    if (n_tensors > rem / 33 || n_kv * 14 + n_tensors * 33 > rem)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: n_tensors %" PRIu64 " at byte 8 cannot fit in the %" PRIu64
                       " bytes after the header", g->path, n_tensors, rem);
    if ((st = parse_kvs(g, &c, n_kv))) return st;

    g->alignment = 32;
    int64_t ai = lk_gguf_find_kv(g, "general.alignment");
    if (ai >= 0) {
        const kv_t *kv = &g->kv[ai];
        uint32_t a = 0;
        if (kv->type != LK_GGUF_UINT32)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: general.alignment has type %s at byte %" PRIu64 " (must be u32)",
                           g->path, lk_gguf_vtype_name(kv->type), kv->off - 4);
        memcpy(&a, g->map + kv->off, 4);
        if (a == 0 || (a & (a - 1)) || a > ALIGN_MAX)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: general.alignment = %" PRIu32 " at byte %" PRIu64
                           " (must be a power of two <= %u)", g->path, a, kv->off, ALIGN_MAX);
        g->alignment = a;
    }
    if ((st = parse_tensor_infos(g, &c, n_tensors))) return st;
    /* A file without tensors (a vocabulary) may end right after its metadata,
     * without padding, so the data offset may lie at or past the end. */
    g->data_off = (c.off + g->alignment - 1) / g->alignment * g->alignment;
    return check_data(g, err, errlen);
}

lk_status lk_gguf_open(const char *path, lk_gguf **out, char *err, size_t errlen) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return lk_fail(err, errlen, LK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return lk_fail(err, errlen, LK_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return lk_fail(err, errlen, LK_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size < 24) {
        close(fd);
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %lld bytes is too short for a GGUF header (24 bytes; truncated?)",
                       path, (long long)sb.st_size);
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (m == MAP_FAILED) return lk_fail(err, errlen, LK_ERR_IO, "%s: mmap: %s", path, strerror(e));
    lk_gguf *g = lk_xcalloc(1, sizeof *g);
    g->path = lk_xstrdup(path);
    g->map = m;
    g->size = (uint64_t)sb.st_size;
    lk_status st = parse(g, err, errlen);
    if (st) {
        lk_gguf_close(g);
        return st;
    }
    *out = g;
    return LK_OK;
}

/* ---- queries ------------------------------------------------------------------- */

uint32_t lk_gguf_version(const lk_gguf *g) { return g->version; }
const char *lk_gguf_path(const lk_gguf *g) { return g->path; }
uint64_t lk_gguf_file_size(const lk_gguf *g) { return g->size; }
uint64_t lk_gguf_data_offset(const lk_gguf *g) { return g->data_off; }
uint32_t lk_gguf_alignment(const lk_gguf *g) { return g->alignment; }
const void *lk_gguf_file_bytes(const lk_gguf *g) { return g->map; }

int64_t lk_gguf_n_kv(const lk_gguf *g) { return g->n_kv; }
const char *lk_gguf_kv_key(const lk_gguf *g, int64_t i) {
    LK_ASSERT(i >= 0 && i < g->n_kv);
    return g->kv[i].key;
}
lk_gguf_vtype lk_gguf_kv_type(const lk_gguf *g, int64_t i) {
    LK_ASSERT(i >= 0 && i < g->n_kv);
    return g->kv[i].type;
}

int64_t lk_gguf_find_kv(const lk_gguf *g, const char *key) {
    if (!g->kv_sorted) { /* during parsing, before the index exists */
        for (int64_t i = 0; i < g->n_kv; i++)
            if (!strcmp(g->kv[i].key, key)) return i;
        return -1;
    }
    name_idx k = {key, 0};
    const name_idx *r = bsearch(&k, g->kv_sorted, (size_t)g->n_kv, sizeof k, cmp_name_idx);
    return r ? r->idx : -1;
}

static const kv_t *find(const lk_gguf *g, const char *key) {
    int64_t i = lk_gguf_find_kv(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

/* Reads a numeric value of type t at p. Integers go to *iv (with *is_u64 set
 * for u64 values > INT64_MAX), floats to *fv. Returns 0 not numeric, 1 int, 2 float. */
static int read_num(uint32_t t, const uint8_t *p, int64_t *iv, uint64_t *uv, double *fv) {
    switch (t) {
    case LK_GGUF_UINT8: *iv = p[0]; break;
    case LK_GGUF_INT8: *iv = (int8_t)p[0]; break;
    case LK_GGUF_UINT16: { uint16_t v; memcpy(&v, p, 2); *iv = v; break; }
    case LK_GGUF_INT16: { int16_t v; memcpy(&v, p, 2); *iv = v; break; }
    case LK_GGUF_UINT32: { uint32_t v; memcpy(&v, p, 4); *iv = v; break; }
    case LK_GGUF_INT32: { int32_t v; memcpy(&v, p, 4); *iv = v; break; }
    case LK_GGUF_INT64: { int64_t v; memcpy(&v, p, 8); *iv = v; break; }
    case LK_GGUF_UINT64: {
        uint64_t v;
        memcpy(&v, p, 8);
        *uv = v;
        *fv = (double)v;
        return 3; /* unsigned 64 */
    }
    case LK_GGUF_FLOAT32: { float v; memcpy(&v, p, 4); *fv = v; return 2; }
    case LK_GGUF_FLOAT64: { double v; memcpy(&v, p, 8); *fv = v; return 2; }
    default: return 0;
    }
    *uv = (uint64_t)*iv;
    *fv = (double)*iv;
    return 1;
}

static bool num_i64(uint32_t t, const uint8_t *p, int64_t *out) {
    int64_t iv; uint64_t uv; double fv;
    int k = read_num(t, p, &iv, &uv, &fv);
    if (k == 1) { *out = iv; return true; }
    if (k == 3 && uv <= (uint64_t)INT64_MAX) { *out = (int64_t)uv; return true; }
    return false;
}
static bool num_u64(uint32_t t, const uint8_t *p, uint64_t *out) {
    int64_t iv; uint64_t uv; double fv;
    int k = read_num(t, p, &iv, &uv, &fv);
    if ((k == 1 && iv >= 0) || k == 3) { *out = uv; return true; }
    return false;
}
static bool num_f64(uint32_t t, const uint8_t *p, double *out) {
    int64_t iv; uint64_t uv; double fv;
    if (!read_num(t, p, &iv, &uv, &fv)) return false;
    *out = fv;
    return true;
}

bool lk_gguf_get_i64(const lk_gguf *g, const char *key, int64_t *out) {
    const kv_t *kv = find(g, key);
    return kv && num_i64(kv->type, g->map + kv->off, out);
}
bool lk_gguf_get_u64(const lk_gguf *g, const char *key, uint64_t *out) {
    const kv_t *kv = find(g, key);
    return kv && num_u64(kv->type, g->map + kv->off, out);
}
bool lk_gguf_get_f64(const lk_gguf *g, const char *key, double *out) {
    const kv_t *kv = find(g, key);
    return kv && num_f64(kv->type, g->map + kv->off, out);
}
bool lk_gguf_get_bool(const lk_gguf *g, const char *key, bool *out) {
    const kv_t *kv = find(g, key);
    if (!kv || kv->type != LK_GGUF_BOOL) return false;
    *out = g->map[kv->off] != 0;
    return true;
}
bool lk_gguf_get_str(const lk_gguf *g, const char *key, const char **s, size_t *len) {
    const kv_t *kv = find(g, key);
    if (!kv || kv->type != LK_GGUF_STRING) return false;
    uint64_t n;
    memcpy(&n, g->map + kv->off, 8);
    *s = (const char *)g->map + kv->off + 8;
    *len = (size_t)n;
    return true;
}

bool lk_gguf_get_arr(const lk_gguf *g, const char *key, lk_gguf_vtype *elem_type, uint64_t *n) {
    const kv_t *kv = find(g, key);
    if (!kv || kv->type != LK_GGUF_ARRAY) return false;
    if (elem_type) *elem_type = kv->elem;
    if (n) *n = kv->n;
    return true;
}

/* Pointer to numeric element i, or NULL if not a numeric array / out of range. */
static const uint8_t *arr_elem(const lk_gguf *g, const char *key, uint64_t i, uint32_t *t) {
    const kv_t *kv = find(g, key);
    if (!kv || kv->type != LK_GGUF_ARRAY || i >= kv->n) return NULL;
    uint64_t sz = vtype_size(kv->elem);
    if (!sz) return NULL;
    *t = kv->elem;
    return g->map + kv->data + i * sz;
}

int64_t lk_gguf_arr_i64(const lk_gguf *g, const char *key, uint64_t i) {
    uint32_t t;
    const uint8_t *p = arr_elem(g, key, i, &t);
    int64_t v;
    return p && num_i64(t, p, &v) ? v : 0;
}
double lk_gguf_arr_f64(const lk_gguf *g, const char *key, uint64_t i) {
    uint32_t t;
    const uint8_t *p = arr_elem(g, key, i, &t);
    double v;
    return p && num_f64(t, p, &v) ? v : 0.0;
}
const char *lk_gguf_arr_str(const lk_gguf *g, const char *key, uint64_t i, size_t *len) {
    const kv_t *kv = find(g, key);
    if (!kv || kv->type != LK_GGUF_ARRAY || kv->elem != LK_GGUF_STRING || i >= kv->n) {
        if (len) *len = 0;
        return NULL;
    }
    uint64_t n;
    memcpy(&n, g->map + kv->str_off[i], 8);
    if (len) *len = (size_t)n;
    return (const char *)g->map + kv->str_off[i] + 8;
}
const void *lk_gguf_arr_data(const lk_gguf *g, const char *key) {
    const kv_t *kv = find(g, key);
    if (!kv || kv->type != LK_GGUF_ARRAY || !vtype_size(kv->elem)) return NULL;
    return g->map + kv->data;
}

const void *lk_gguf_kv_raw(const lk_gguf *g, int64_t i, size_t *n) {
    LK_ASSERT(i >= 0 && i < g->n_kv);
    *n = (size_t)(g->kv[i].end - g->kv[i].off);
    return g->map + g->kv[i].off;
}

/* ---- rendering ------------------------------------------------------------------ */

typedef struct { char *b; size_t len, pos; } sbuf;

static void sb_printf(sbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *s, const char *fmt, ...) {
    if (s->pos + 1 >= s->len) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(s->b + s->pos, s->len - s->pos, fmt, ap);
    va_end(ap);
    if (n > 0) s->pos = LK_MIN(s->pos + (size_t)n, s->len - 1);
}

/* A string value, quoted, cut after about `max` bytes: escapes, control
 * bytes and invalid UTF-8 escaped as lk_str_sanitize does, quotes as \". */
static void sb_str(sbuf *s, const uint8_t *p, uint64_t n, uint64_t max) {
    sb_printf(s, "\"");
    uint64_t i = 0, end = LK_MIN(n, max);
    while (i < end && s->pos + 1 < s->len) {
        const uint8_t *q = memchr(p + i, '"', (size_t)(end - i));
        uint64_t span = q ? (uint64_t)(q - p) - i : end - i;
        size_t done = lk_str_sanitize(s->b + s->pos, s->len - s->pos, p + i, (size_t)span);
        s->pos += strlen(s->b + s->pos);
        i += done;
        if (done < span) return; /* buffer full */
        if (q) {
            sb_printf(s, "\\\"");
            i++;
        }
    }
    sb_printf(s, n > max ? "\"..." : "\"");
}

static void sb_num(sbuf *s, uint32_t t, const uint8_t *p) {
    int64_t iv; uint64_t uv; double fv;
    if (t == LK_GGUF_BOOL) { sb_printf(s, "%s", p[0] ? "true" : "false"); return; }
    int k = read_num(t, p, &iv, &uv, &fv);
    if (k == 1) sb_printf(s, "%" PRId64, iv);
    else if (k == 3) sb_printf(s, "%" PRIu64, uv);
    else if (k == 2) sb_printf(s, "%.9g", fv);
}

void lk_gguf_kv_format(const lk_gguf *g, int64_t i, char *buf, size_t buflen) {
    LK_ASSERT(i >= 0 && i < g->n_kv && buflen > 0);
    const kv_t *kv = &g->kv[i];
    sbuf s = {buf, buflen, 0};
    buf[0] = 0;
    const uint8_t *p = g->map + kv->off;
    if (kv->type == LK_GGUF_STRING) {
        uint64_t n;
        memcpy(&n, p, 8);
        sb_str(&s, p + 8, n, 200);
    } else if (kv->type == LK_GGUF_ARRAY) {
        enum { SHOW = 8 };
        sb_printf(&s, "[%s x %" PRIu64 "]", lk_gguf_vtype_name(kv->elem), kv->n);
        if (kv->elem == LK_GGUF_ARRAY || kv->n == 0) return;
        sb_printf(&s, " ");
        for (uint64_t k = 0; k < kv->n && k < SHOW; k++) {
            if (k) sb_printf(&s, ", ");
            if (kv->elem == LK_GGUF_STRING) {
                uint64_t n;
                memcpy(&n, g->map + kv->str_off[k], 8);
                sb_str(&s, g->map + kv->str_off[k] + 8, n, 40);
            } else {
                sb_num(&s, kv->elem, g->map + kv->data + k * vtype_size(kv->elem));
            }
        }
        if (kv->n > SHOW) sb_printf(&s, ", ...");
    } else {
        sb_num(&s, kv->type, p);
    }
}

/* ---- tensors ---------------------------------------------------------------------- */

int64_t lk_gguf_n_tensors(const lk_gguf *g) { return g->n_tensors; }
const lk_gguf_tensor *lk_gguf_tensor_at(const lk_gguf *g, int64_t i) {
    LK_ASSERT(i >= 0 && i < g->n_tensors);
    return &g->t[i];
}
const lk_gguf_tensor *lk_gguf_find_tensor(const lk_gguf *g, const char *name) {
    name_idx k = {name, 0};
    const name_idx *r = bsearch(&k, g->t_sorted, (size_t)g->n_tensors, sizeof k, cmp_name_idx);
    return r ? &g->t[r->idx] : NULL;
}
