/* gguf — reading (and writing) GGUF files, v2 and v3.
 *
 * Owns: the header, metadata key/values, the tensor index and the mmap of the
 * file. Every count, offset and size read from the file is checked against the
 * file size and sane limits before it is used; a malformed or truncated file
 * yields LK_ERR_FORMAT and a one-line message naming the field and its byte
 * offset, e.g. "model.gguf: tensor 3 'blk.0.attn_q.weight': data [1024, 5000)
 * extends past end of file (4096 bytes)". Never a crash or a huge allocation.
 *
 * Lifetimes: an lk_gguf owns its mapping; every pointer it hands out (key
 * names, strings, array data, tensor data) lives until lk_gguf_close().
 * Strings from the file are NOT NUL-terminated: use the returned length.
 * Threading: read-only after open, so any thread may query it.
 * Byte order: little-endian files on little-endian hosts only (checked). */
#ifndef LK_GGUF_H
#define LK_GGUF_H

#include "common/lk_common.h"

typedef enum {
    LK_GGUF_UINT8 = 0, LK_GGUF_INT8 = 1, LK_GGUF_UINT16 = 2, LK_GGUF_INT16 = 3,
    LK_GGUF_UINT32 = 4, LK_GGUF_INT32 = 5, LK_GGUF_FLOAT32 = 6, LK_GGUF_BOOL = 7,
    LK_GGUF_STRING = 8, LK_GGUF_ARRAY = 9, LK_GGUF_UINT64 = 10, LK_GGUF_INT64 = 11,
    LK_GGUF_FLOAT64 = 12,
} lk_gguf_vtype;

const char *lk_gguf_vtype_name(lk_gguf_vtype t);

typedef struct lk_gguf lk_gguf;

#define LK_GGUF_MAX_DIMS 4

typedef struct {
    const char *name;        /* NUL-terminated copy */
    uint32_t    type;        /* GGML type id (see quant/quant.h lk_type) */
    int         n_dims;
    uint64_t    ne[LK_GGUF_MAX_DIMS]; /* ne[0] = row length (input dim), ne[1] = rows ... unused = 1 */
    uint64_t    n_elements;
    uint64_t    offset;      /* relative to the data section */
    uint64_t    nbytes;      /* from type and shape */
    const void *data;        /* into the mapping */
} lk_gguf_tensor;

/* Opens and validates the whole file (header, every key/value, every tensor
 * info, data ranges inside the file, no overlaps, known types, and data
 * aligned as its type is read: f32 on 4 bytes, f16/bf16 on 2, element types
 * on their size, blocks anywhere; general.alignment = 1 is accepted, a
 * tensor it leaves misaligned is refused with its name and byte offset).
 * Messages quote the file's names through lk_str_sanitize. */
lk_status lk_gguf_open(const char *path, lk_gguf **out, char *err, size_t errlen);
void      lk_gguf_close(lk_gguf *g);

uint32_t    lk_gguf_version(const lk_gguf *g);
const char *lk_gguf_path(const lk_gguf *g);
uint64_t    lk_gguf_file_size(const lk_gguf *g);
uint64_t    lk_gguf_data_offset(const lk_gguf *g);   /* start of tensor data in the file */
uint32_t    lk_gguf_alignment(const lk_gguf *g);
const void *lk_gguf_file_bytes(const lk_gguf *g);    /* whole mapping, file_size bytes */

/* --- metadata ----------------------------------------------------------- */
int64_t       lk_gguf_n_kv(const lk_gguf *g);
const char   *lk_gguf_kv_key(const lk_gguf *g, int64_t i);       /* NUL-terminated */
lk_gguf_vtype lk_gguf_kv_type(const lk_gguf *g, int64_t i);
int64_t       lk_gguf_find_kv(const lk_gguf *g, const char *key); /* -1 if absent */

/* Typed getters by key. Return false if the key is absent or its type does
 * not convert: get_i64/get_u64 accept any integer type (u64 rejects negative
 * values, i64 rejects u64 > INT64_MAX), get_f64 accepts floats and integers,
 * get_bool accepts bool. */
bool lk_gguf_get_i64(const lk_gguf *g, const char *key, int64_t *out);
bool lk_gguf_get_u64(const lk_gguf *g, const char *key, uint64_t *out);
bool lk_gguf_get_f64(const lk_gguf *g, const char *key, double *out);
bool lk_gguf_get_bool(const lk_gguf *g, const char *key, bool *out);
bool lk_gguf_get_str(const lk_gguf *g, const char *key, const char **s, size_t *len);

/* Arrays. lk_gguf_get_arr finds an array by key and gives its element type
 * and count. Numeric elements are read with lk_gguf_arr_*; they convert like
 * the scalar getters. String elements: lk_gguf_arr_str (O(1), an offset index
 * is built at open). Arrays of arrays are validated but only their element
 * type and count are exposed. */
bool lk_gguf_get_arr(const lk_gguf *g, const char *key, lk_gguf_vtype *elem_type, uint64_t *n);
int64_t     lk_gguf_arr_i64(const lk_gguf *g, const char *key, uint64_t i);  /* 0 if not convertible */
double      lk_gguf_arr_f64(const lk_gguf *g, const char *key, uint64_t i);
const char *lk_gguf_arr_str(const lk_gguf *g, const char *key, uint64_t i, size_t *len);
/* Raw element pointer for numeric arrays (little-endian, maybe unaligned). */
const void *lk_gguf_arr_data(const lk_gguf *g, const char *key);

/* The encoded value of key/value i as it lies in the file (after its u32 type
 * field): n bytes. Used by the writer to copy values verbatim. */
const void *lk_gguf_kv_raw(const lk_gguf *g, int64_t i, size_t *n);

/* Human-readable rendering of one value (arrays abbreviated), for `info`. */
void lk_gguf_kv_format(const lk_gguf *g, int64_t i, char *buf, size_t buflen);

/* --- tensors ------------------------------------------------------------ */
int64_t               lk_gguf_n_tensors(const lk_gguf *g);
const lk_gguf_tensor *lk_gguf_tensor_at(const lk_gguf *g, int64_t i);
const lk_gguf_tensor *lk_gguf_find_tensor(const lk_gguf *g, const char *name); /* NULL if absent */

/* --- writing -------------------------------------------------------------
 * Streaming writer: declare every key/value and every tensor (name, type,
 * shape) first, then lk_gguf_writer_begin_data() writes the header, and the
 * tensor data is appended in declaration order with lk_gguf_writer_write()
 * (any number of calls per tensor; padding between tensors is automatic).
 * The model is never held in memory. GGUF v3, alignment 32 unless
 * general.alignment is set. Setting a key again replaces its value and moves
 * it to the end (as ggml does). Caller bugs (a key or tensor after
 * begin_data, duplicate tensor names, rows not whole blocks) assert. */
typedef struct lk_gguf_writer lk_gguf_writer;
lk_status lk_gguf_writer_open(const char *path, lk_gguf_writer **out, char *err, size_t errlen);
void lk_gguf_writer_set_u32(lk_gguf_writer *w, const char *key, uint32_t v);
void lk_gguf_writer_set_i32(lk_gguf_writer *w, const char *key, int32_t v);
void lk_gguf_writer_set_u64(lk_gguf_writer *w, const char *key, uint64_t v);
void lk_gguf_writer_set_f32(lk_gguf_writer *w, const char *key, float v);
void lk_gguf_writer_set_bool(lk_gguf_writer *w, const char *key, bool v);
void lk_gguf_writer_set_str(lk_gguf_writer *w, const char *key, const char *v);
/* Arrays: elements copied. strs: n NUL-terminated strings. */
void lk_gguf_writer_set_arr_str(lk_gguf_writer *w, const char *key, const char *const *strs, uint64_t n);
void lk_gguf_writer_set_arr_f32(lk_gguf_writer *w, const char *key, const float *v, uint64_t n);
void lk_gguf_writer_set_arr_i32(lk_gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
/* Copies key/value i of an open file verbatim (used by `quantize`). */
void lk_gguf_writer_copy_kv(lk_gguf_writer *w, const lk_gguf *g, int64_t i);
void lk_gguf_writer_add_tensor(lk_gguf_writer *w, const char *name, uint32_t type,
                               int n_dims, const uint64_t *ne);
lk_status lk_gguf_writer_begin_data(lk_gguf_writer *w, char *err, size_t errlen);
lk_status lk_gguf_writer_write(lk_gguf_writer *w, const void *data, size_t n, char *err, size_t errlen);
/* Checks every declared tensor received exactly its bytes, then closes. On
 * any failure (here or an earlier write) the partial file is removed. */
lk_status lk_gguf_writer_close(lk_gguf_writer *w, char *err, size_t errlen);
void      lk_gguf_writer_abort(lk_gguf_writer *w); /* close and unlink */

#endif
