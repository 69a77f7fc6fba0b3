/* Sealed links: a link transport that wraps a TCP link and carries its bytes
 * as authenticated, encrypted records (AES-256-GCM where both ends have
 * AES-NI, else ChaCha20-Poly1305 in its IETF variant: both take a 32-byte
 * key and a 12-byte nonce and append a 16-byte tag), so that after the
 * handshake an on-path attacker can neither read nor alter,
 * inject, replay, reorder, drop or cut off anything unnoticed.
 *
 * Record on the wire (every field checked before use):
 *     length u32 LE (plaintext bytes, 1..LK_SEAL_MAX_RECORD)
 *     ciphertext[length]
 *     tag[16]
 * The length is the AEAD's associated data, so altering it fails the tag.
 * The nonce is never sent: it is 4 zero bytes and the record's counter (u64
 * LE) in this direction, counted from 0 by both ends. Keys are per direction
 * and per connection (derived in the cluster handshake from the cluster key
 * and both sides' fresh challenges), so a counter never repeats under one
 * key, and a replayed, reordered or dropped record is opened with the wrong
 * counter and fails its tag.
 *
 * Non-blocking semantics are the inner link's: send_some seals one record
 * (at most LK_SEAL_MAX_RECORD bytes of what it is given) into the send
 * buffer and reports those bytes as moved only once the whole record is in
 * the socket, so a caller that saw all its bytes "sent" never leaves a record
 * sitting in our buffer; until then it answers 0 and lk_xfer_run polls the
 * socket for writing, then calls again with the same bytes (the sealed record
 * is kept, not sealed anew). recv_some never reads past the ciphertext of the
 * plaintext bytes the caller asked for: code that polls the socket before
 * reading a frame (the head's monitor) thus never finds its frame stranded in
 * our buffer while the socket is quiet. Records follow the sender's send
 * calls, which are whole frames or parts of one.
 *
 * Memory: the three buffers are allocated when the link is made; nothing
 * per message. Threading: one thread may send while another receives (the
 * head's monitor reads while the main thread sends): the two directions
 * share no mutable state. */
#include "transport/transport.h"

#include <sodium.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HDR 4
#define TAG crypto_aead_chacha20poly1305_ietf_ABYTES
#define OVH (HDR + TAG)
#define REC_MAX (HDR + LK_SEAL_MAX_RECORD + TAG)

_Static_assert(crypto_aead_chacha20poly1305_ietf_KEYBYTES == LK_SEAL_KEY_BYTES, "key size");
_Static_assert(crypto_aead_chacha20poly1305_ietf_NPUBBYTES == 12, "IETF nonce");
_Static_assert(crypto_aead_aes256gcm_KEYBYTES == LK_SEAL_KEY_BYTES && crypto_aead_aes256gcm_NPUBBYTES == 12 &&
               crypto_aead_aes256gcm_ABYTES == TAG, "AES-256-GCM takes the same key, nonce and tag sizes");

static const char AUTH_FAILED[] = "authentication of received data failed (tampered or corrupted link)";

typedef struct {
    /* AES key schedules, expanded once (first: libsodium wants them 16-byte
     * aligned, which malloc gives) */
    crypto_aead_aes256gcm_state tx_gcm, rx_gcm;
    lk_link base;
    lk_link *inner;
    lk_seal_cipher cipher;
    /* sending (one thread) */
    uint8_t  tx_key[LK_SEAL_KEY_BYTES];
    uint64_t tx_ctr;
    uint8_t *obuf;        /* (REC_MAX) the record being written */
    size_t   olen, opos;  /* its size, bytes already in the socket */
    size_t   oplain;      /* its plaintext bytes (0: none pending) */
    const void *osrc;     /* where they came from, to recognise the retry */
    bool     tx_failed;
    /* receiving (one thread) */
    uint8_t  rx_key[LK_SEAL_KEY_BYTES];
    uint64_t rx_ctr;
    uint8_t *ibuf;        /* (REC_MAX) ciphertext read, not yet opened */
    size_t   ilen, ipos;  /* bytes in it, start of the first unopened record */
    uint8_t *pbuf;        /* (LK_SEAL_MAX_RECORD) opened plaintext the caller has not taken */
    size_t   ppos, pavail;
    char     rx_why[LK_ERRLEN]; /* non-empty: receiving failed for good, this is why */
} seal_link;

/* base is not the first member: from an lk_link * back to its seal_link */
static seal_link *of(const lk_link *l) { return (seal_link *)((char *)l - offsetof(seal_link, base)); }

static void put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void nonce_of(uint64_t ctr, uint8_t n[12]) {
    memset(n, 0, 4);
    for (int i = 0; i < 8; i++) n[4 + i] = (uint8_t)(ctr >> (8 * i));
}

static ssize_t seal_send_some(lk_link *l, const void *buf, size_t n, char *err, size_t errlen) {
    seal_link *s = of(l);
    if (s->tx_failed) {
        lk_fail(err, errlen, LK_ERR_NET, "sealed link already failed while sending");
        return -1;
    }
    if (!n) return 0;
    if (!s->oplain) {
        size_t m = LK_MIN(n, (size_t)LK_SEAL_MAX_RECORD);
        uint8_t nonce[12];
        nonce_of(s->tx_ctr++, nonce);
        put_le32(s->obuf, (uint32_t)m);
        unsigned long long clen = 0;
        if (s->cipher == LK_SEAL_AES256_GCM)
            crypto_aead_aes256gcm_encrypt_afternm(s->obuf + HDR, &clen, buf, m, s->obuf, HDR, NULL, nonce, &s->tx_gcm);
        else
            crypto_aead_chacha20poly1305_ietf_encrypt(s->obuf + HDR, &clen, buf, m, s->obuf, HDR, NULL, nonce,
                                                      s->tx_key);
        LK_ASSERT(clen == m + TAG);
        s->olen = HDR + m + TAG;
        s->opos = 0;
        s->oplain = m;
        s->osrc = buf;
    } else if (buf != s->osrc || n < s->oplain) {
        /* A transfer gave up (deadline) with a record half in the socket,
         * and someone sends anew: the stream is broken either way. */
        s->tx_failed = true;
        lk_fail(err, errlen, LK_ERR_NET, "sealed link unusable: an earlier send was abandoned mid-record");
        return -1;
    }
    ssize_t k = s->inner->ops->send_some(s->inner, s->obuf + s->opos, s->olen - s->opos, err, errlen);
    if (k < 0) {
        s->tx_failed = true;
        return -1;
    }
    s->opos += (size_t)k;
    if (s->opos < s->olen) return 0;
    size_t done = s->oplain;
    s->oplain = 0;
    s->osrc = NULL;
    return (ssize_t)done;
}

static ssize_t rx_fail(seal_link *s, const char *why, char *err, size_t errlen) {
    snprintf(s->rx_why, sizeof s->rx_why, "%.400s", why);
    lk_fail(err, errlen, LK_ERR_NET, "%s", why);
    return -1;
}

static ssize_t seal_recv_some(lk_link *l, void *buf, size_t n, char *err, size_t errlen) {
    seal_link *s = of(l);
    if (s->rx_why[0]) {
        lk_fail(err, errlen, LK_ERR_NET, "%s", s->rx_why);
        return -1;
    }
    uint8_t *out = buf;
    size_t got = 0;
    if (s->pavail) {
        size_t k = LK_MIN(n, s->pavail);
        memcpy(out, s->pbuf + s->ppos, k);
        s->ppos += k;
        s->pavail -= k;
        return (ssize_t)k;
    }
    while (got < n) {
        /* Open every complete record at the front, straight into the
         * caller's buffer when it takes the whole plaintext. */
        while (got < n && s->ilen - s->ipos >= HDR) {
            const uint8_t *r = s->ibuf + s->ipos;
            uint32_t m = get_le32(r);
            if (m == 0 || m > LK_SEAL_MAX_RECORD) {
                char why[160];
                snprintf(why, sizeof why, "sealed record of %u bytes (allowed 1..%u): corrupted or hostile stream",
                         m, (unsigned)LK_SEAL_MAX_RECORD);
                return rx_fail(s, why, err, errlen);
            }
            if (s->ilen - s->ipos < HDR + m + TAG) break;
            uint8_t nonce[12];
            nonce_of(s->rx_ctr, nonce);
            bool direct = n - got >= m;
            uint8_t *dst = direct ? out + got : s->pbuf;
            int bad = s->cipher == LK_SEAL_AES256_GCM
                          ? crypto_aead_aes256gcm_decrypt_afternm(dst, NULL, NULL, r + HDR, m + TAG, r, HDR, nonce,
                                                                  &s->rx_gcm)
                          : crypto_aead_chacha20poly1305_ietf_decrypt(dst, NULL, NULL, r + HDR, m + TAG, r, HDR, nonce,
                                                                      s->rx_key);
            if (bad) return rx_fail(s, AUTH_FAILED, err, errlen);
            s->rx_ctr++;
            s->ipos += HDR + m + TAG;
            if (direct) {
                got += m;
            } else {
                size_t k = n - got;
                memcpy(out + got, s->pbuf, k);
                s->ppos = k;
                s->pavail = m - k;
                got = n;
            }
        }
        if (got == n) break;
        if (s->ipos) {
            memmove(s->ibuf, s->ibuf + s->ipos, s->ilen - s->ipos);
            s->ilen -= s->ipos;
            s->ipos = 0;
        }
        /* Read no further than the records that carry the n - got bytes
         * wanted: the current one, plus at least OVH + (what it lacks) of
         * the following ones. */
        size_t want = n - got, have = s->ilen, safe;
        if (have >= HDR) {
            size_t m = get_le32(s->ibuf);
            safe = HDR + m + TAG + (want > m ? OVH + (want - m) : 0);
        } else {
            safe = OVH + want;
        }
        if (safe > REC_MAX) safe = REC_MAX;
        LK_ASSERT(safe > have);
        char why[LK_ERRLEN];
        ssize_t k = s->inner->ops->recv_some(s->inner, s->ibuf + have, safe - have, why, sizeof why);
        if (k < 0) {
            if (have) {
                char w2[LK_ERRLEN];
                snprintf(w2, sizeof w2, "%.400s in the middle of a sealed record (truncated)", why);
                return rx_fail(s, w2, err, errlen);
            }
            return rx_fail(s, why, err, errlen);
        }
        if (k == 0) break;
        s->ilen += (size_t)k;
    }
    return (ssize_t)got;
}

static int seal_poll_fd(lk_link *l) {
    seal_link *s = of(l);
    return s->inner->ops->poll_fd(s->inner);
}

static lk_link *seal_inner(const lk_link *l) { return of(l)->inner; }

static void seal_free(seal_link *s) {
    sodium_memzero(s->tx_key, sizeof s->tx_key);
    sodium_memzero(s->rx_key, sizeof s->rx_key);
    sodium_memzero(&s->tx_gcm, sizeof s->tx_gcm);
    sodium_memzero(&s->rx_gcm, sizeof s->rx_gcm);
    free(s->obuf);
    free(s->ibuf);
    if (s->pbuf) sodium_memzero(s->pbuf, LK_SEAL_MAX_RECORD);
    free(s->pbuf);
    free(s);
}

static void seal_close(lk_link *l) {
    seal_link *s = of(l);
    lk_link_close(s->inner);
    seal_free(s);
}

static const lk_link_ops seal_ops = {
    .name = "tcp+seal",
    .send_some = seal_send_some,
    .recv_some = seal_recv_some,
    .poll_fd = seal_poll_fd,
    .wait = NULL,
    .close = seal_close,
    .inner = seal_inner,
};

bool lk_seal_cipher_available(lk_seal_cipher c) {
    if (c == LK_SEAL_CHACHA20_POLY1305) return true;
    return c == LK_SEAL_AES256_GCM && sodium_init() >= 0 && crypto_aead_aes256gcm_is_available();
}

const char *lk_seal_cipher_name(lk_seal_cipher c) {
    return c == LK_SEAL_AES256_GCM ? "AES-256-GCM" : "ChaCha20-Poly1305";
}

lk_seal_cipher lk_seal_cipher_of(const lk_link *l) {
    LK_ASSERT(lk_seal_is(l));
    return of(l)->cipher;
}

lk_link *lk_seal_wrap(lk_link *inner, lk_seal_cipher cipher, const uint8_t tx_key[LK_SEAL_KEY_BYTES],
                      const uint8_t rx_key[LK_SEAL_KEY_BYTES]) {
    LK_ASSERT(inner && inner->ops->poll_fd && inner->ops->poll_fd(inner) >= 0);
    LK_ASSERT(lk_seal_cipher_available(cipher));
    seal_link *s = lk_xcalloc(1, sizeof *s);
    LK_ASSERT(((uintptr_t)s & 15) == 0);
    s->cipher = cipher;
    if (cipher == LK_SEAL_AES256_GCM) {
        crypto_aead_aes256gcm_beforenm(&s->tx_gcm, tx_key);
        crypto_aead_aes256gcm_beforenm(&s->rx_gcm, rx_key);
    }
    s->base = *inner;
    s->base.ops = &seal_ops;
    s->inner = inner;
    memcpy(s->tx_key, tx_key, LK_SEAL_KEY_BYTES);
    memcpy(s->rx_key, rx_key, LK_SEAL_KEY_BYTES);
    s->obuf = lk_xmalloc(REC_MAX);
    s->ibuf = lk_xmalloc(REC_MAX);
    s->pbuf = lk_xmalloc(LK_SEAL_MAX_RECORD);
    return &s->base;
}

lk_link *lk_seal_unwrap(lk_link *l) {
    LK_ASSERT(lk_seal_is(l));
    seal_link *s = of(l);
    lk_link *inner = s->inner;
    seal_free(s);
    return inner;
}

bool lk_seal_is(const lk_link *l) { return l && l->ops == &seal_ops; }
