/* Frames: the fixed header, per-type limits, sequence numbers, and the
 * bounds-checked payload reader/writer. Everything a peer sends is treated as
 * hostile until checked: the header is validated field by field and the
 * payload length against both the type's limit and the caller's buffer before
 * any payload byte is read. */
#include "cluster/cluster.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>

/* The numbers are the protocol: renumbering one would make two builds
 * misread each other silently. */
static_assert(LK_MSG_HELLO == 1 && LK_MSG_AUTH == 2 && LK_MSG_INFO == 3 && LK_MSG_VERDICT == 4 &&
              LK_MSG_ERROR == 5, "handshake message numbers are fixed");
static_assert(LK_MSG_PING == 16 && LK_MSG_PONG == 17 && LK_MSG_LOAD == 18 && LK_MSG_LOADED == 19 &&
              LK_MSG_STEP == 20 && LK_MSG_RESULT == 21 && LK_MSG_BYE == 22 && LK_MSG_MESH == 23 &&
              LK_MSG_READY == 24 && LK_MSG_BENCH == 25 && LK_MSG_FILE == 26 && LK_MSG_DATA == 27 &&
              LK_MSG_FILE_END == 28,
              "control message numbers are fixed");
static_assert(LK_WIRE_HDR == 4 + 2 + 2 + 4 + 4 + 8, "header layout is frozen");

uint32_t lk_wire_max_payload(uint16_t type) {
    switch (type) {
    case LK_MSG_HELLO: return 64;
    case LK_MSG_AUTH: return 64;
    case LK_MSG_INFO: return 1024;
    case LK_MSG_VERDICT: return 1024;
    case LK_MSG_ERROR: return 1024;
    case LK_MSG_PING: case LK_MSG_PONG: return 16;
    case LK_MSG_LOAD: return 64 * 1024;
    case LK_MSG_LOADED: return 1024;
    case LK_MSG_BYE: return 1024;
    case LK_MSG_MESH: return 64 * 1024;
    case LK_MSG_READY: return 1024;
    case LK_MSG_BENCH: return 1024;
    case LK_MSG_FILE: return 1024;
    case LK_MSG_DATA: return 1u << 20;
    case LK_MSG_FILE_END: return 64;
    }
    return 0;
}

const char *lk_msg_name(uint16_t type) {
    switch (type) {
    case LK_MSG_HELLO: return "HELLO";
    case LK_MSG_AUTH: return "AUTH";
    case LK_MSG_INFO: return "INFO";
    case LK_MSG_VERDICT: return "VERDICT";
    case LK_MSG_ERROR: return "ERROR";
    case LK_MSG_PING: return "PING";
    case LK_MSG_PONG: return "PONG";
    case LK_MSG_LOAD: return "LOAD";
    case LK_MSG_LOADED: return "LOADED";
    case LK_MSG_STEP: return "STEP";
    case LK_MSG_RESULT: return "RESULT";
    case LK_MSG_BYE: return "BYE";
    case LK_MSG_MESH: return "MESH";
    case LK_MSG_READY: return "READY";
    case LK_MSG_BENCH: return "BENCH";
    case LK_MSG_FILE: return "FILE";
    case LK_MSG_DATA: return "DATA";
    case LK_MSG_FILE_END: return "FILE_END";
    }
    return "?";
}

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

void lk_wire_encode_hdr(const lk_frame_hdr *h, uint8_t out[LK_WIRE_HDR]) {
    put32(out, h->magic);
    put16(out + 4, h->version);
    put16(out + 6, h->type);
    put32(out + 8, h->flags);
    put32(out + 12, h->len);
    put64(out + 16, h->seq);
}

lk_status lk_wire_decode_hdr(const uint8_t in[LK_WIRE_HDR], uint16_t expect_version, lk_frame_hdr *h,
                             char *err, size_t errlen) {
    h->magic = get32(in);
    h->version = get16(in + 4);
    h->type = get16(in + 6);
    h->flags = get32(in + 8);
    h->len = get32(in + 12);
    h->seq = get64(in + 16);
    if (h->magic != LK_WIRE_MAGIC)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "not a lockstep frame (magic %02x %02x %02x %02x)", in[0], in[1],
                       in[2], in[3]);
    uint32_t max = lk_wire_max_payload(h->type);
    if (h->version != expect_version && h->type != LK_MSG_ERROR)
        return lk_fail(err, errlen, LK_ERR_MISMATCH, "protocol version mismatch: peer speaks %u, we speak %u",
                       h->version, expect_version);
    if (!max) return lk_fail(err, errlen, LK_ERR_FORMAT, "unknown message type %u", h->type);
    if (h->flags) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s frame with unknown flags 0x%x", lk_msg_name(h->type), h->flags);
    if (h->len > max)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s frame of %u bytes exceeds its limit of %u", lk_msg_name(h->type),
                       h->len, max);
    return LK_OK;
}

void lk_chan_init(lk_chan *c, lk_link *link) {
    memset(c, 0, sizeof *c);
    c->link = link;
    c->version = LK_WIRE_VERSION;
}

lk_status lk_chan_send(lk_chan *c, uint16_t type, const void *payload, uint32_t len, uint64_t deadline_ns,
                       char *err, size_t errlen) {
    LK_ASSERT(len <= lk_wire_max_payload(type));
    uint8_t hb[LK_WIRE_HDR + 4096];
    lk_frame_hdr h = {LK_WIRE_MAGIC, c->version, type, 0, len, c->seq_out++};
    lk_wire_encode_hdr(&h, hb);
    /* Small frames go out in one piece: with TCP_NODELAY, header and payload
     * sent apart would be two packets and two wake-ups at the peer. */
    if (len <= sizeof hb - LK_WIRE_HDR) {
        if (len) memcpy(hb + LK_WIRE_HDR, payload, len);
        return lk_link_send(c->link, hb, LK_WIRE_HDR + len, deadline_ns, err, errlen);
    }
    lk_status st = lk_link_send(c->link, hb, LK_WIRE_HDR, deadline_ns, err, errlen);
    if (!st) st = lk_link_send(c->link, payload, len, deadline_ns, err, errlen);
    return st;
}

/* Keeps a peer's text printable: it ends up on our terminal and in logs. */
static void sanitise(char *s) {
    for (; *s; s++)
        if (*s < 0x20 || *s > 0x7e) *s = '?';
}

lk_status lk_chan_recv(lk_chan *c, lk_frame_hdr *h, void *buf, uint32_t cap, uint64_t deadline_ns,
                       char *err, size_t errlen) {
    uint8_t hb[LK_WIRE_HDR];
    lk_status st = lk_link_recv(c->link, hb, sizeof hb, deadline_ns, err, errlen);
    if (st) return st;
    st = lk_wire_decode_hdr(hb, c->version, h, err, errlen);
    if (st) return st;
    if (h->type == LK_MSG_ERROR) {
        /* Read the reason into our own bounded buffer, whatever cap is. */
        char reason[1025];
        st = lk_link_recv(c->link, reason, h->len, deadline_ns, err, errlen);
        if (st) return st;
        reason[h->len] = 0;
        sanitise(reason);
        c->seq_in++;
        return lk_fail(err, errlen, LK_ERR_PEER, "%s", reason);
    }
    if (h->seq != c->seq_in)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s frame out of sequence (got %llu, expected %llu)",
                       lk_msg_name(h->type), (unsigned long long)h->seq, (unsigned long long)c->seq_in);
    if (h->len > cap)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s frame of %u bytes where at most %u were expected",
                       lk_msg_name(h->type), h->len, cap);
    if (h->len) st = lk_link_recv(c->link, buf, h->len, deadline_ns, err, errlen);
    if (!st) c->seq_in++;
    return st;
}

void lk_chan_send_error(lk_chan *c, const char *reason) {
    size_t n = strlen(reason);
    if (n > 1024) n = 1024;
    lk_chan_send(c, LK_MSG_ERROR, reason, (uint32_t)n, lk_deadline_ms(200), NULL, 0);
}

/* ---- payload builder / parser ---------------------------------------------------- */

static uint8_t *wb_room(lk_wbuf *b, uint32_t n) {
    if (!b->ok || n > b->cap - b->len) { b->ok = false; return NULL; }
    uint8_t *p = b->p + b->len;
    b->len += n;
    return p;
}
void lk_wb_u8(lk_wbuf *b, uint8_t v) { uint8_t *p = wb_room(b, 1); if (p) *p = v; }
void lk_wb_u32(lk_wbuf *b, uint32_t v) { uint8_t *p = wb_room(b, 4); if (p) put32(p, v); }
void lk_wb_u64(lk_wbuf *b, uint64_t v) { uint8_t *p = wb_room(b, 8); if (p) put64(p, v); }
void lk_wb_bytes(lk_wbuf *b, const void *src, uint32_t n) { uint8_t *p = wb_room(b, n); if (p && n) memcpy(p, src, n); }
void lk_wb_str(lk_wbuf *b, const char *s) {
    size_t n = strlen(s);
    if (n > 0xffff) { b->ok = false; return; }
    uint8_t *p = wb_room(b, 2 + (uint32_t)n);
    if (p) { put16(p, (uint16_t)n); memcpy(p + 2, s, n); }
}

static const uint8_t *rb_take(lk_rbuf *b, uint32_t n) {
    if (!b->ok || n > b->len - b->pos) { b->ok = false; return NULL; }
    const uint8_t *p = b->p + b->pos;
    b->pos += n;
    return p;
}
uint8_t lk_rb_u8(lk_rbuf *b) { const uint8_t *p = rb_take(b, 1); return p ? *p : 0; }
uint32_t lk_rb_u32(lk_rbuf *b) { const uint8_t *p = rb_take(b, 4); return p ? get32(p) : 0; }
uint64_t lk_rb_u64(lk_rbuf *b) { const uint8_t *p = rb_take(b, 8); return p ? get64(p) : 0; }
void lk_rb_bytes(lk_rbuf *b, void *out, uint32_t n) {
    const uint8_t *p = rb_take(b, n);
    if (p) memcpy(out, p, n);
    else memset(out, 0, n);
}
void lk_rb_str(lk_rbuf *b, char *out, size_t outlen) {
    out[0] = 0;
    const uint8_t *lp = rb_take(b, 2);
    if (!lp) return;
    uint16_t n = get16(lp);
    const uint8_t *p = rb_take(b, n);
    if (!p) return;
    if ((size_t)n + 1 > outlen) { b->ok = false; return; }
    for (uint16_t i = 0; i < n; i++)
        if (p[i] < 0x20 || p[i] > 0x7e) { b->ok = false; return; }
    memcpy(out, p, n);
    out[n] = 0;
}
