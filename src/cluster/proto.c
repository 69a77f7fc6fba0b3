/* Session payload codecs (see proto.h). */
#include "cluster/proto.h"

#include <string.h>

static void put_slice(lk_wbuf *w, const lk_slice *s) {
    lk_wb_u32(w, (uint32_t)s->tp_rank); lk_wb_u32(w, (uint32_t)s->tp_size);
    lk_wb_u32(w, (uint32_t)s->pp_rank); lk_wb_u32(w, (uint32_t)s->pp_size);
    lk_wb_u32(w, (uint32_t)s->layer0); lk_wb_u32(w, (uint32_t)s->layer1);
    lk_wb_u32(w, (uint32_t)s->head0); lk_wb_u32(w, (uint32_t)s->head1);
    lk_wb_u32(w, (uint32_t)s->kv_head0); lk_wb_u32(w, (uint32_t)s->kv_head1);
    lk_wb_u64(w, (uint64_t)s->ff0); lk_wb_u64(w, (uint64_t)s->ff1);
    lk_wb_u64(w, (uint64_t)s->vocab0); lk_wb_u64(w, (uint64_t)s->vocab1);
    lk_wb_u8(w, s->ep); lk_wb_u32(w, (uint32_t)s->expert0); lk_wb_u32(w, (uint32_t)s->expert1); /* version 4 */
}

static void get_slice(lk_rbuf *r, lk_slice *s) {
    s->tp_rank = (int)lk_rb_u32(r); s->tp_size = (int)lk_rb_u32(r);
    s->pp_rank = (int)lk_rb_u32(r); s->pp_size = (int)lk_rb_u32(r);
    s->layer0 = (int)lk_rb_u32(r); s->layer1 = (int)lk_rb_u32(r);
    s->head0 = (int)lk_rb_u32(r); s->head1 = (int)lk_rb_u32(r);
    s->kv_head0 = (int)lk_rb_u32(r); s->kv_head1 = (int)lk_rb_u32(r);
    s->ff0 = (int64_t)lk_rb_u64(r); s->ff1 = (int64_t)lk_rb_u64(r);
    s->vocab0 = (int64_t)lk_rb_u64(r); s->vocab1 = (int64_t)lk_rb_u64(r);
    uint8_t ep = lk_rb_u8(r);
    s->ep = ep != 0;
    s->expert0 = (int)lk_rb_u32(r); s->expert1 = (int)lk_rb_u32(r);
    if (ep > 1) r->ok = false;
}

/* Ranges in order and inside sane bounds; the model checks them against
 * its own dimensions when it loads the slice. Head and FFN ranges may be
 * empty (a rank holding only FFN rows, or only heads: parallel/plan.c), but
 * not both, and a rank without query heads holds no KV heads. */
static bool slice_sane(const lk_slice *s) {
    bool heads = s->head0 >= 0 && s->kv_head0 >= 0 &&
                 (s->head0 == s->head1 ? s->kv_head0 == s->kv_head1 : s->head0 < s->head1 && s->kv_head0 < s->kv_head1);
    return s->tp_size >= 1 && s->tp_size <= LK_MAX_RANKS && s->tp_rank >= 0 && s->tp_rank < s->tp_size &&
           s->pp_size >= 1 && s->pp_size <= LK_MAX_RANKS && s->pp_rank >= 0 && s->pp_rank < s->pp_size &&
           s->layer0 >= 0 && s->layer0 < s->layer1 && heads && s->ff0 >= 0 && s->ff0 <= s->ff1 &&
           (s->head0 < s->head1 || s->ff0 < s->ff1) && s->vocab0 >= 0 && s->vocab0 < s->vocab1 &&
           s->expert0 >= 0 && s->expert0 <= s->expert1 && s->expert1 <= 65536 && (!s->ep || s->expert0 < s->expert1);
}

uint32_t lk_proto_load_encode(const lk_load_msg *m, uint8_t *buf, uint32_t cap) {
    lk_wbuf w = {buf, cap, 0, true};
    lk_wb_u32(&w, (uint32_t)m->rank); lk_wb_u32(&w, (uint32_t)m->n_ranks); lk_wb_u32(&w, (uint32_t)m->tp);
    put_slice(&w, &m->slice);
    lk_wb_str(&w, m->model_name);
    lk_wb_str(&w, m->model_path);
    lk_wb_bytes(&w, m->model_id, LK_MODEL_ID_BYTES);
    lk_wb_u32(&w, (uint32_t)m->n_ctx); lk_wb_u32(&w, (uint32_t)m->n_batch); lk_wb_u32(&w, (uint32_t)m->n_threads);
    lk_wb_u8(&w, m->kv_f16); lk_wb_u8(&w, m->shm); lk_wb_u8(&w, m->wire);
    lk_wb_u32(&w, (uint32_t)m->max_seqs); lk_wb_u64(&w, (uint64_t)m->kv_tokens);
    LK_ASSERT(w.ok);
    return w.len;
}

bool lk_proto_load_decode(const uint8_t *buf, uint32_t len, lk_load_msg *m) {
    memset(m, 0, sizeof *m);
    lk_rbuf r = {buf, len, 0, true};
    m->rank = (int32_t)lk_rb_u32(&r); m->n_ranks = (int32_t)lk_rb_u32(&r); m->tp = (int32_t)lk_rb_u32(&r);
    get_slice(&r, &m->slice);
    lk_rb_str(&r, m->model_name, sizeof m->model_name);
    lk_rb_str(&r, m->model_path, sizeof m->model_path);
    lk_rb_bytes(&r, m->model_id, LK_MODEL_ID_BYTES);
    m->n_ctx = (int32_t)lk_rb_u32(&r); m->n_batch = (int32_t)lk_rb_u32(&r); m->n_threads = (int32_t)lk_rb_u32(&r);
    m->kv_f16 = lk_rb_u8(&r); m->shm = lk_rb_u8(&r); m->wire = lk_rb_u8(&r);
    m->max_seqs = (int32_t)lk_rb_u32(&r); m->kv_tokens = (int64_t)lk_rb_u64(&r);
    return r.ok && m->max_seqs >= 0 && m->max_seqs <= (1 << 16) && m->kv_tokens >= 0 && m->kv_tokens <= ((int64_t)1 << 40) && r.pos == r.len && m->n_ranks >= 2 && m->n_ranks <= LK_MAX_RANKS && m->rank >= 1 &&
           m->rank < m->n_ranks && m->tp >= 1 && m->tp <= m->n_ranks && slice_sane(&m->slice) &&
           !strchr(m->model_name, '/') && m->model_name[0] && m->model_name[0] != '.' && m->n_ctx >= 0 &&
           m->n_ctx <= (1 << 24) && m->n_batch >= 0 && m->n_batch <= (1 << 16) && m->n_threads >= 0 &&
           m->n_threads <= 1024 && m->kv_f16 <= 1 && m->shm <= LK_MESH_MPI && m->wire <= LK_WIRE_Q8;
}

uint32_t lk_proto_loaded_encode(const lk_loaded_msg *m, uint8_t *buf, uint32_t cap) {
    lk_wbuf w = {buf, cap, 0, true};
    lk_wb_u8(&w, m->ok);
    lk_wb_str(&w, m->reason);
    lk_wb_str(&w, m->mesh_addr);
    lk_wb_u8(&w, m->want_file);
    LK_ASSERT(w.ok);
    return w.len;
}

bool lk_proto_loaded_decode(const uint8_t *buf, uint32_t len, lk_loaded_msg *m) {
    memset(m, 0, sizeof *m);
    lk_rbuf r = {buf, len, 0, true};
    m->ok = lk_rb_u8(&r);
    lk_rb_str(&r, m->reason, sizeof m->reason);
    lk_rb_str(&r, m->mesh_addr, sizeof m->mesh_addr);
    m->want_file = lk_rb_u8(&r);
    return r.ok && r.pos == r.len && m->ok <= 1 && m->want_file <= 1 && (!m->ok || m->mesh_addr[0]) &&
           !(m->ok && m->want_file);
}

uint32_t lk_proto_mesh_encode(const lk_mesh_msg *m, uint8_t *buf, uint32_t cap) {
    lk_wbuf w = {buf, cap, 0, true};
    lk_wb_u32(&w, (uint32_t)m->n);
    for (int i = 0; i < m->n; i++) lk_wb_str(&w, m->addrs[i]);
    LK_ASSERT(w.ok);
    return w.len;
}

bool lk_proto_mesh_decode(const uint8_t *buf, uint32_t len, lk_mesh_msg *m) {
    memset(m, 0, sizeof *m);
    lk_rbuf r = {buf, len, 0, true};
    m->n = (int32_t)lk_rb_u32(&r);
    if (m->n < 2 || m->n > LK_MAX_RANKS) return false;
    for (int i = 0; i < m->n; i++) lk_rb_str(&r, m->addrs[i], LK_ADDR_LEN);
    return r.ok && r.pos == r.len;
}

uint32_t lk_proto_bench_encode(const lk_bench_msg *m, uint8_t *buf, uint32_t cap) {
    lk_wbuf w = {buf, cap, 0, true};
    lk_wb_u32(&w, (uint32_t)m->rank); lk_wb_u32(&w, (uint32_t)m->n_ranks);
    lk_wb_u8(&w, m->shm);
    lk_wb_u64(&w, (uint64_t)m->spin_ns);
    lk_wb_u64(&w, (uint64_t)m->cfg.iters);
    lk_wb_u8(&w, (uint8_t)m->cfg.wire);
    lk_wb_u8(&w, m->cfg.allreduce_only);
    lk_wb_u32(&w, (uint32_t)m->cfg.nsizes);
    for (int i = 0; i < m->cfg.nsizes; i++) lk_wb_u64(&w, m->cfg.sizes[i]);
    LK_ASSERT(w.ok);
    return w.len;
}

bool lk_proto_bench_decode(const uint8_t *buf, uint32_t len, lk_bench_msg *m) {
    memset(m, 0, sizeof *m);
    lk_rbuf r = {buf, len, 0, true};
    m->rank = (int32_t)lk_rb_u32(&r); m->n_ranks = (int32_t)lk_rb_u32(&r);
    m->shm = lk_rb_u8(&r);
    m->spin_ns = (int64_t)lk_rb_u64(&r);
    m->cfg.iters = (int64_t)lk_rb_u64(&r);
    uint8_t wire = lk_rb_u8(&r), aro = lk_rb_u8(&r);
    uint32_t ns = lk_rb_u32(&r);
    if (!r.ok || ns < 1 || ns > 32) return false;
    m->cfg.nsizes = (int)ns;
    for (uint32_t i = 0; i < ns; i++) {
        uint64_t v = lk_rb_u64(&r);
        if (v < 1 || v > (256u << 20)) return false; /* the same bounds as netbench's --sizes */
        m->cfg.sizes[i] = (size_t)v;
    }
    m->cfg.wire = (lk_wire_fmt)wire;
    m->cfg.allreduce_only = aro != 0;
    return r.ok && r.pos == r.len && m->n_ranks >= 2 && m->n_ranks <= LK_MAX_RANKS && m->rank >= 1 &&
           m->rank < m->n_ranks && m->shm <= LK_MESH_MPI && wire <= LK_WIRE_Q8 && aro <= 1 &&
           m->cfg.iters >= 1 && m->cfg.iters <= 1000000 && m->spin_ns <= 1000000000;
}

/* ---- slices ------------------------------------------------------------------------ */

uint32_t lk_proto_file_encode(const lk_file_msg *m, uint8_t *buf, uint32_t cap) {
    lk_wbuf w = {buf, cap, 0, true};
    lk_wb_u64(&w, m->size); lk_wb_u64(&w, m->header_len); lk_wb_u64(&w, m->n_bytes);
    lk_wb_u64(&w, m->disk); lk_wb_u64(&w, m->n_ranges);
    lk_wb_bytes(&w, m->ranges_hash, 32);
    LK_ASSERT(w.ok);
    return w.len;
}

bool lk_proto_file_decode(const uint8_t *buf, uint32_t len, lk_file_msg *m) {
    memset(m, 0, sizeof *m);
    lk_rbuf r = {buf, len, 0, true};
    m->size = lk_rb_u64(&r); m->header_len = lk_rb_u64(&r); m->n_bytes = lk_rb_u64(&r);
    m->disk = lk_rb_u64(&r); m->n_ranges = lk_rb_u64(&r);
    lk_rb_bytes(&r, m->ranges_hash, 32);
    /* 4 TiB: larger than any model, small enough that no sum below overflows */
    return r.ok && r.pos == r.len && m->size >= 24 && m->size <= (1ull << 42) && m->header_len >= 24 &&
           m->header_len <= m->n_bytes && m->n_bytes <= m->size && m->n_ranges >= 1 && m->n_ranges <= m->n_bytes &&
           m->disk <= m->size + 4096;
}

lk_status lk_proto_slice_ranges(const lk_gguf *g, const lk_slice *s, lk_ranges *out, char *err, size_t errlen) {
    lk_status st = lk_model_slice_bytes(g, s, out, err, errlen);
    if (!st) lk_cluster_model_id_ranges(g, out);
    return st;
}

static void put64le(uint8_t b[8], uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
}

void lk_proto_ranges_hash(const lk_ranges *l, uint64_t size, uint8_t out[32]) {
    crypto_generichash_state st;
    crypto_generichash_init(&st, (const uint8_t *)"lockstep-ranges-v1", 18, 32);
    uint8_t b[16];
    put64le(b, size);
    put64le(b + 8, (uint64_t)l->n);
    crypto_generichash_update(&st, b, 16);
    for (int64_t i = 0; i < l->n; i++) {
        put64le(b, l->r[i].off);
        put64le(b + 8, l->r[i].len);
        crypto_generichash_update(&st, b, 16);
    }
    crypto_generichash_final(&st, out, 32);
}

void lk_proto_digest_init(crypto_generichash_state *st, uint64_t size) {
    if (sodium_init() < 0) LK_ASSERT(!"libsodium could not initialise");
    crypto_generichash_init(st, (const uint8_t *)"lockstep-slices-v1", 18, 32);
    uint8_t b[8];
    put64le(b, size);
    crypto_generichash_update(st, b, 8);
}

void lk_proto_digest_file(const lk_gguf *g, const lk_ranges *l, uint8_t out[32]) {
    crypto_generichash_state st;
    lk_proto_digest_init(&st, lk_gguf_file_size(g));
    const uint8_t *p = lk_gguf_file_bytes(g);
    for (int64_t i = 0; i < l->n; i++) {
        LK_ASSERT(l->r[i].off + l->r[i].len <= lk_gguf_file_size(g));
        crypto_generichash_update(&st, p + l->r[i].off, l->r[i].len);
    }
    crypto_generichash_final(&st, out, 32);
}
