/* fuzz_handshake — lk_handshake against a scripted peer.
 *
 * A peer without the key can only send bytes; one with it can also prove
 * itself, so its INFO and VERDICT frames get parsed as well. The input is a
 * script the harness plays, one record whenever the handshake wants more
 * bytes (so answers may depend on what lockstep sent: its challenge, its
 * INFO frame):
 *     byte 0: bit 0: lockstep initiates (head) or responds (worker);
 *             bits 1-2: its seal mode; bit 3: it has a model
 *     records: u8 op | u8 n | n bytes
 *       op % 5 == 0  raw bytes, as they are
 *       op % 5 == 1  one frame: type = first byte, payload = the rest
 *                    (header with the next sequence number)
 *       op % 5 == 2  HELLO: the bytes as the peer's challenge (32, zero-padded)
 *       op % 5 == 3  AUTH with the right proof (the peer holds the key), or,
 *                    when op / 5 is odd, a VERDICT: ok = first byte, reason =
 *                    the rest, and the right MAC over both INFO frames
 *       op % 5 == 4  INFO: lockstep's own INFO frame mirrored (same build,
 *                    CPU, version), with the bytes xor-ed into it from the
 *                    start, so the facts agree unless the script alters them
 * The proofs and MACs are computed here from cluster.h's description of the
 * protocol (not with handshake.c's code), so they also check that text. */
#include <assert.h>
#include <sodium.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/cluster.h"
#include "fuzz_link.h"

static const uint8_t k_key[LK_KEY_BYTES] = "fuzz key: 32 bytes long, exact.";

typedef struct {
    const uint8_t *p;
    size_t n, pos;
    bool me_initiator;          /* lockstep's role */
    uint64_t seq;               /* the peer's next frame number */
    uint8_t peer_hello[32];
    uint8_t peer_info[1024];
    uint32_t peer_info_len;
} script;

/* Frame number k of what lockstep sent (type and payload), or false. */
static bool sent_frame(const fuzz_link *f, uint16_t type, const uint8_t **pl, uint32_t *len) {
    size_t off = 0;
    while (off + LK_WIRE_HDR <= f->out_len) {
        const uint8_t *h = f->out + off;
        uint16_t t = (uint16_t)(h[6] | h[7] << 8);
        uint32_t n = (uint32_t)h[12] | (uint32_t)h[13] << 8 | (uint32_t)h[14] << 16 | (uint32_t)h[15] << 24;
        if (off + LK_WIRE_HDR + n > f->out_len) return false;
        if (t == type) { *pl = h + LK_WIRE_HDR; *len = n; return true; }
        off += LK_WIRE_HDR + n;
    }
    return false;
}

static void frame(fuzz_link *f, script *s, uint16_t type, const uint8_t *pl, uint32_t n) {
    lk_frame_hdr h = {.magic = LK_WIRE_MAGIC, .version = LK_WIRE_VERSION, .type = type, .len = n, .seq = s->seq++};
    uint8_t hb[LK_WIRE_HDR];
    lk_wire_encode_hdr(&h, hb);
    fuzz_link_feed(f, hb, sizeof hb);
    fuzz_link_feed(f, pl, n);
    if (type == LK_MSG_HELLO) { memset(s->peer_hello, 0, 32); memcpy(s->peer_hello, pl, LK_MIN(n, 32u)); }
    if (type == LK_MSG_INFO && n <= sizeof s->peer_info) { memcpy(s->peer_info, pl, n); s->peer_info_len = n; }
}

/* The challenges in protocol order: the initiator's first. */
static bool challenges(fuzz_link *f, script *s, const uint8_t **ci, const uint8_t **cr) {
    const uint8_t *mine;
    uint32_t n;
    if (!sent_frame(f, LK_MSG_HELLO, &mine, &n) || n != 32) return false;
    *ci = s->me_initiator ? mine : s->peer_hello;
    *cr = s->me_initiator ? s->peer_hello : mine;
    return true;
}

static void hmac_label(crypto_auth_hmacsha256_state *st, const char *label, const uint8_t *ci, const uint8_t *cr) {
    crypto_auth_hmacsha256_init(st, k_key, LK_KEY_BYTES);
    crypto_auth_hmacsha256_update(st, (const uint8_t *)label, strlen(label) + 1);
    crypto_auth_hmacsha256_update(st, ci, 32);
    crypto_auth_hmacsha256_update(st, cr, 32);
}

static bool next_record(fuzz_link *f) {
    script *s = f->ctx;
    if (s->pos + 2 > s->n) return false;
    uint8_t op = s->p[s->pos], n = s->p[s->pos + 1];
    s->pos += 2;
    if (n > s->n - s->pos) n = (uint8_t)(s->n - s->pos);
    const uint8_t *b = s->p + s->pos;
    s->pos += n;
    const bool peer_init = !s->me_initiator;
    const uint8_t *ci, *cr;
    switch (op % 5) {
    case 0: fuzz_link_feed(f, b, n); break;
    case 1: frame(f, s, n ? b[0] : 0, b + (n > 0), n ? n - 1u : 0); break;
    case 2: {
        uint8_t c[32] = {0};
        memcpy(c, b, LK_MIN(n, 32));
        frame(f, s, LK_MSG_HELLO, c, 32);
        break;
    }
    case 3:
        if (!challenges(f, s, &ci, &cr)) { fuzz_link_feed(f, b, n); break; }
        if ((op / 5) % 2 == 0) {
            crypto_auth_hmacsha256_state st;
            uint8_t proof[32];
            hmac_label(&st, peer_init ? "lockstep-auth-v1 initiator" : "lockstep-auth-v1 responder", ci, cr);
            crypto_auth_hmacsha256_final(&st, proof);
            frame(f, s, LK_MSG_AUTH, proof, 32);
        } else {
            const uint8_t *mine;
            uint32_t ml;
            if (!sent_frame(f, LK_MSG_INFO, &mine, &ml)) { fuzz_link_feed(f, b, n); break; }
            const uint8_t *ii = s->me_initiator ? mine : s->peer_info, *ir = s->me_initiator ? s->peer_info : mine;
            uint32_t li = s->me_initiator ? ml : s->peer_info_len, lr = s->me_initiator ? s->peer_info_len : ml;
            crypto_auth_hmacsha256_state st;
            hmac_label(&st, peer_init ? "lockstep-info-v1 initiator" : "lockstep-info-v1 responder", ci, cr);
            uint8_t l[8] = {(uint8_t)li, (uint8_t)(li >> 8), (uint8_t)(li >> 16), (uint8_t)(li >> 24),
                            (uint8_t)lr, (uint8_t)(lr >> 8), (uint8_t)(lr >> 16), (uint8_t)(lr >> 24)};
            crypto_auth_hmacsha256_update(&st, l, sizeof l);
            crypto_auth_hmacsha256_update(&st, ii, li);
            crypto_auth_hmacsha256_update(&st, ir, lr);
            uint8_t v[1 + 2 + 255 + 32];
            uint32_t rl = n ? n - 1u : 0;
            v[0] = n ? b[0] : 1;
            v[1] = (uint8_t)rl; v[2] = 0;
            memcpy(v + 3, b + (n > 0), rl);
            crypto_auth_hmacsha256_final(&st, v + 3 + rl);
            frame(f, s, LK_MSG_VERDICT, v, 3 + rl + 32);
        }
        break;
    case 4: {
        const uint8_t *mine;
        uint32_t ml;
        if (!sent_frame(f, LK_MSG_INFO, &mine, &ml)) { fuzz_link_feed(f, b, n); break; }
        uint8_t info[1024];
        memcpy(info, mine, ml);
        for (uint32_t i = 0; i < n && i < ml; i++) info[i] ^= b[i];
        frame(f, s, LK_MSG_INFO, info, ml);
        break;
    }
    }
    return true;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    lk_log_set_level(LK_LOG_ERROR);
    if (sodium_init() < 0) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static fuzz_link f;
    static bool init;
    if (!init) { fuzz_link_init(&f); init = true; }
    fuzz_link_reset(&f);
    script s = {.p = data, .n = size, .pos = 1, .me_initiator = data[0] & 1};
    f.more = next_record;
    f.ctx = &s;

    lk_hs_params p;
    lk_hs_defaults(&p, k_key, s.me_initiator ? "head" : "worker");
    p.seal = (lk_seal_mode)((data[0] >> 1) % 3);
    p.has_model = (data[0] >> 3) & 1;
    memset(p.model_id, 0x5a, sizeof p.model_id);
    p.timeout_ms = 2000;
    lk_chan c;
    lk_chan_init(&c, &f.base);
    lk_hs_peer peer;
    char err[LK_ERRLEN];
    lk_status st = lk_handshake(&c, s.me_initiator, &p, &peer, err, sizeof err);
    if (st == LK_OK) {
        /* Only a peer that proved the key gets here, and with facts that agree. */
        assert(peer.version == LK_WIRE_VERSION && !strcmp(peer.build_id, p.build_id));
        if (peer.sealed) lk_link_close(lk_seal_unwrap(c.link));
    } else {
        assert(c.link == &f.base); /* a failed handshake hands the link back unwrapped */
    }
    return 0;
}
