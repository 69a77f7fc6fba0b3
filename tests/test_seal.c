/* Sealed links (src/transport/seal.c) over socketpairs, and the sealed
 * handshake over loopback TCP. The record format is checked against records
 * made and opened here with libsodium directly (length u32 LE as associated
 * data, ChaCha20-Poly1305 IETF, nonce = 4 zero bytes + counter u64 LE); the
 * attacks (flipped byte, replay, reorder, drop, truncation, oversized
 * length) are crafted on the raw socket between two sealed ends. */
#include "lk_test.h"
#include "cluster/cluster.h"
#include "transport/transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <sys/socket.h>
#include <unistd.h>

static uint8_t K1[32], K2[32];
static lk_seal_cipher CIPHER; /* the socketpair tests run once per cipher this CPU has */

static void keys(void) {
    for (int i = 0; i < 32; i++) K1[i] = (uint8_t)(i * 7 + 1), K2[i] = (uint8_t)(200 - i);
}

/* A socketpair; *a and *b get its two ends as links (b may be left raw). */
static void sock_pair(int fds[2]) { LK_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0); }

static lk_link *named(lk_link *l) {
    l->peer_rank = 2;
    snprintf(l->peer_addr, sizeof l->peer_addr, "10.0.0.3:7070");
    return l;
}

/* Our own sealing of one record, from the format's description. */
static size_t ref_seal(const uint8_t *key, uint64_t ctr, const uint8_t *m, uint32_t n, uint8_t *out) {
    for (int i = 0; i < 4; i++) out[i] = (uint8_t)(n >> (8 * i));
    uint8_t nonce[12] = {0};
    for (int i = 0; i < 8; i++) nonce[4 + i] = (uint8_t)(ctr >> (8 * i));
    unsigned long long cl;
    if (CIPHER == LK_SEAL_AES256_GCM) crypto_aead_aes256gcm_encrypt(out + 4, &cl, m, n, out, 4, NULL, nonce, key);
    else crypto_aead_chacha20poly1305_ietf_encrypt(out + 4, &cl, m, n, out, 4, NULL, nonce, key);
    return 4 + (size_t)cl;
}

/* Reads exactly n bytes from a blocking fd. */
static bool read_full(int fd, uint8_t *p, size_t n) {
    while (n) {
        ssize_t k = read(fd, p, n);
        if (k <= 0) return false;
        p += k;
        n -= (size_t)k;
    }
    return true;
}

/* ---- round trips ---------------------------------------------------------- */

static void fill(uint8_t *p, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (uint8_t)(seed >> 24);
    }
}

typedef struct { lk_link *l; const void *p; size_t n; lk_status st; } send_arg;

static void *send_thread(void *p) {
    send_arg *a = p;
    char err[LK_ERRLEN];
    a->st = lk_link_send(a->l, a->p, a->n, lk_deadline_ms(5000), err, sizeof err);
    return NULL;
}

TEST(round_trip_sizes_partial_sends_no_alloc) {
    int fds[2];
    sock_pair(fds);
    /* A small send buffer: a 64 KiB record goes out over many calls. */
    int small = 4096;
    setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
    setsockopt(fds[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    lk_link *a = lk_seal_wrap(named(lk_tcp_wrap(fds[0], "a")), CIPHER, K1, K2);
    lk_link *b = lk_seal_wrap(lk_tcp_wrap(fds[1], "b"), CIPHER, K2, K1);
    CHECK(lk_seal_is(a) && lk_seal_is(b) && !lk_seal_is(NULL));
    CHECK(lk_tcp_fd(a) == fds[0] && lk_tcp_fd(b) == fds[1]);
    CHECK(a->peer_rank == 2 && !strcmp(a->peer_addr, "10.0.0.3:7070"));
    static uint8_t src[1 << 20], dst[1 << 20];
    const size_t sizes[] = {1, 2, 15, 16, 24, 100, 4095, 4096, 16384, 65535, 65536, 65537, 131072, 200001, 1 << 20};
    const int ns = (int)(sizeof sizes / sizeof sizes[0]);
    char err[LK_ERRLEN];
    long allocs = 0;
    for (int pass = 0; pass < 2; pass++) {
        long a0 = lk_test_allocs();
        for (int i = 0; i < ns; i++) {
            size_t n = sizes[i];
            fill(src, n, (uint32_t)(i + 1 + 100 * pass));
            memset(dst, 0, n);
            /* both directions, sender and receiver driven together */
            lk_link *from = (i + pass) & 1 ? a : b, *to = from == a ? b : a;
            lk_xfer x[2] = {{.link = from, .is_send = true, .buf = src, .n = n},
                            {.link = to, .is_send = false, .buf = dst, .n = n}};
            lk_status st = lk_xfer_run(x, 2, lk_deadline_ms(5000), err, sizeof err);
            CHECKF(!st, "%zu bytes: %s", n, err);
            CHECKF(!memcmp(src, dst, n), "%zu bytes differ", n);
        }
        /* The receiver takes it in odd pieces (a frame header, then the
         * rest), while a thread sends it in one call. */
        fill(src, 70000, 9);
        memset(dst, 0, 70000);
        send_arg sa = {.l = a, .p = src, .n = 70000};
        pthread_t t;
        pthread_create(&t, NULL, send_thread, &sa);
        size_t got = 0, piece[] = {24, 1, 7, 5000, 70000};
        for (int k = 0; got < 70000; k++) {
            size_t want = LK_MIN(piece[k < 5 ? k : 4], 70000 - got);
            lk_status st = lk_link_recv(b, dst + got, want, lk_deadline_ms(5000), err, sizeof err);
            CHECKF(!st, "%s", err);
            if (st) break;
            got += want;
        }
        pthread_join(t, NULL);
        CHECK(!sa.st && !memcmp(src, dst, 70000));
        /* pass 0 warms up (libsodium picks its code paths on first use) */
        if (pass == 1) allocs = lk_test_allocs() - a0;
    }
    CHECKF(allocs == 0, "%ld allocations while sending and receiving", allocs);
    lk_link_close(a);
    lk_link_close(b);
}

/* The wire bytes are the documented format: open a captured record with
 * libsodium ourselves, and have the link open a record we sealed. */
TEST(record_format_matches_reference) {
    int fds[2];
    sock_pair(fds);
    lk_link *a = lk_seal_wrap(lk_tcp_wrap(fds[0], "a"), CIPHER, K1, K2);
    char err[LK_ERRLEN];
    const char *msg[2] = {"first record", "second, longer record"};
    for (int i = 0; i < 2; i++) CHECK(!lk_link_send(a, msg[i], strlen(msg[i]), lk_deadline_ms(1000), err, sizeof err));
    for (uint64_t i = 0; i < 2; i++) {
        uint8_t hdr[4], body[256], plain[256];
        CHECK(read_full(fds[1], hdr, 4));
        uint32_t n = hdr[0] | hdr[1] << 8 | hdr[2] << 16 | (uint32_t)hdr[3] << 24;
        CHECKF(n == strlen(msg[i]), "length %u", n);
        if (n != strlen(msg[i])) break;
        CHECK(read_full(fds[1], body, n + 16));
        uint8_t nonce[12] = {0};
        nonce[4] = (uint8_t)i;
        unsigned long long pl;
        int bad = CIPHER == LK_SEAL_AES256_GCM
                      ? crypto_aead_aes256gcm_decrypt(plain, &pl, NULL, body, n + 16, hdr, 4, nonce, K1)
                      : crypto_aead_chacha20poly1305_ietf_decrypt(plain, &pl, NULL, body, n + 16, hdr, 4, nonce, K1);
        CHECK(!bad);
        CHECK(pl == n && !memcmp(plain, msg[i], n));
        CHECK(memcmp(body, msg[i], n)); /* not in clear */
    }
    /* the other way: records we seal, read by the link (rx key K2) */
    uint8_t rec[300];
    char out[64] = {0};
    size_t k = ref_seal(K2, 0, (const uint8_t *)"hello ", 6, rec);
    k += ref_seal(K2, 1, (const uint8_t *)"world", 5, rec + k);
    CHECK(write(fds[1], rec, k) == (ssize_t)k);
    CHECK(!lk_link_recv(a, out, 11, lk_deadline_ms(1000), err, sizeof err) && !strcmp(out, "hello world"));
    lk_link_close(a);
    close(fds[1]);
}

/* ---- attacks ----------------------------------------------------------------- */

/* Feeds the raw bytes to a sealed receiver (rx key K1, peer named) and
 * reads nrecs messages of the given sizes; returns the status of the first
 * failure (LK_OK if all arrived) with its message in err. close_after: the
 * sender hangs up after the bytes. */
static lk_status feed(const uint8_t *bytes, size_t n, const size_t *sizes, int nrecs, bool close_after, int *ok_count,
                      char *err, size_t errlen) {
    int fds[2];
    sock_pair(fds);
    lk_link *r = lk_seal_wrap(named(lk_tcp_wrap(fds[0], "r")), CIPHER, K2, K1);
    LK_ASSERT(write(fds[1], bytes, n) == (ssize_t)n);
    if (close_after) close(fds[1]);
    long a0 = lk_test_allocs();
    lk_status st = LK_OK;
    uint8_t buf[70000];
    *ok_count = 0;
    for (int i = 0; i < nrecs && !st; i++) {
        st = lk_link_recv(r, buf, sizes[i], lk_deadline_ms(300), err, errlen);
        if (!st) ++*ok_count;
    }
    if (st) {
        /* failure is final: the next read fails at once, saying the same */
        char again[LK_ERRLEN];
        uint64_t t0 = lk_time_ns();
        if (lk_link_recv(r, buf, 1, lk_deadline_ms(1000), again, sizeof again) == LK_OK ||
            lk_time_ns() - t0 > 500000000ull || strncmp(again, err, 40))
            st = LK_ERR_UNSUPPORTED; /* a status no check expects */
    }
    long allocs = lk_test_allocs() - a0;
    LK_ASSERT(allocs == 0); /* nothing from the peer sizes an allocation */
    lk_link_close(r);
    if (!close_after) close(fds[1]);
    return st;
}

static size_t three_records(uint8_t *out, size_t off[4]) {
    uint8_t m[3][40];
    fill(m[0], 40, 1), fill(m[1], 40, 2), fill(m[2], 40, 3);
    size_t k = 0;
    for (int i = 0; i < 3; i++) {
        off[i] = k;
        k += ref_seal(K1, (uint64_t)i, m[i], 40, out + k);
    }
    off[3] = k;
    return k;
}

#define AUTH_MSG "rank 2 (10.0.0.3:7070): authentication of received data failed (tampered or corrupted link)"

TEST(attacks_detected) {
    uint8_t recs[512], bad[1024];
    size_t off[4], n = three_records(recs, off);
    const size_t sz[3] = {40, 40, 40};
    char err[LK_ERRLEN];
    int okc;
    /* intact */
    CHECKF(!feed(recs, n, sz, 3, false, &okc, err, sizeof err) && okc == 3, "%s", err);

    /* a flipped byte in the ciphertext, the tag, the length */
    size_t where[3] = {off[1] + 4 + 10, off[1] + 4 + 40 + 3, off[1] + 0};
    for (int w = 0; w < 3; w++) {
        memcpy(bad, recs, n);
        bad[where[w]] ^= 0x20;
        lk_status st = feed(bad, n, sz, 3, true, &okc, err, sizeof err);
        CHECKF(st == LK_ERR_NET && okc == 1, "flip %d: st %d ok %d", w, st, okc);
        /* the length flip (40 -> 8) breaks the tag of a shorter record */
        CHECKF(!strncmp(err, AUTH_MSG, strlen(AUTH_MSG)), "flip %d: %s", w, err);
    }

    /* a replayed record: 0 0 1 */
    size_t k = 0;
    memcpy(bad, recs, off[1]), k = off[1];
    memcpy(bad + k, recs, off[1]), k += off[1];
    memcpy(bad + k, recs + off[1], off[2] - off[1]), k += off[2] - off[1];
    CHECK(feed(bad, k, sz, 3, false, &okc, err, sizeof err) == LK_ERR_NET && okc == 1 && strstr(err, AUTH_MSG));

    /* reordered: 1 0 2 */
    k = 0;
    memcpy(bad, recs + off[1], off[2] - off[1]), k = off[2] - off[1];
    memcpy(bad + k, recs, off[1]), k += off[1];
    memcpy(bad + k, recs + off[2], off[3] - off[2]), k += off[3] - off[2];
    CHECK(feed(bad, k, sz, 3, false, &okc, err, sizeof err) == LK_ERR_NET && okc == 0 && strstr(err, AUTH_MSG));

    /* dropped: 0 2 */
    k = 0;
    memcpy(bad, recs, off[1]), k = off[1];
    memcpy(bad + k, recs + off[2], off[3] - off[2]), k += off[3] - off[2];
    CHECK(feed(bad, k, sz, 3, false, &okc, err, sizeof err) == LK_ERR_NET && okc == 1 && strstr(err, AUTH_MSG));

    /* truncated: the last record cut short, then the connection closes */
    CHECK(feed(recs, n - 5, sz, 3, true, &okc, err, sizeof err) == LK_ERR_NET && okc == 2);
    CHECKF(strstr(err, "rank 2 (10.0.0.3:7070): connection closed by peer in the middle of a sealed record (truncated)"),
           "%s", err);
    /* truncated, and the next record's bytes follow: they cannot complete it */
    k = 0;
    memcpy(bad, recs, off[1] - 5), k = off[1] - 5;
    memcpy(bad + k, recs + off[1], off[3] - off[1]), k += off[3] - off[1];
    CHECK(feed(bad, k, sz, 3, true, &okc, err, sizeof err) == LK_ERR_NET && okc == 0 && strstr(err, AUTH_MSG));

    /* too long a length (and zero): refused from the header alone */
    uint32_t lens[2] = {LK_SEAL_MAX_RECORD + 1, 0};
    for (int i = 0; i < 2; i++) {
        memcpy(bad, recs, n);
        for (int j = 0; j < 4; j++) bad[off[1] + j] = (uint8_t)(lens[i] >> (8 * j));
        CHECK(feed(bad, off[1] + 4, sz, 3, false, &okc, err, sizeof err) == LK_ERR_NET && okc == 1);
        char want[128];
        snprintf(want, sizeof want, "rank 2 (10.0.0.3:7070): sealed record of %u bytes (allowed 1..65536)", lens[i]);
        CHECKF(strstr(err, want), "%s", err);
    }
    /* 0xffffffff as well: no allocation, no wait for 4 GiB */
    memset(bad, 0xff, 4);
    CHECK(feed(bad, 4, sz, 1, false, &okc, err, sizeof err) == LK_ERR_NET && strstr(err, "4294967295 bytes"));

    /* the right bytes under the other direction's key (a reflected stream) */
    k = ref_seal(K2, 0, recs, 40, bad);
    CHECK(feed(bad, k, sz, 1, false, &okc, err, sizeof err) == LK_ERR_NET && strstr(err, AUTH_MSG));
}

/* ---- the sealed handshake -------------------------------------------------------- */

static const uint8_t CKEY[LK_KEY_BYTES] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};

typedef struct {
    lk_link *l;
    bool initiator;
    lk_seal_mode mode;
    uint8_t ciphers; /* lk_hs_params.seal_ciphers */
    const char *role;
    lk_status st;
    lk_hs_peer peer;
    char err[LK_ERRLEN];
} hs_arg;

static void *hs_thread(void *p) {
    hs_arg *a = p;
    lk_hs_params hp;
    lk_hs_defaults(&hp, CKEY, a->role);
    hp.seal = a->mode;
    hp.seal_ciphers = a->ciphers;
    lk_chan c;
    lk_chan_init(&c, a->l);
    a->st = lk_handshake(&c, a->initiator, &hp, &a->peer, a->err, sizeof a->err);
    a->l = c.link;
    if (!a->st) {
        /* one control frame each way over whatever the link became */
        uint8_t b[64];
        lk_frame_hdr h;
        lk_status s1 = lk_chan_send(&c, LK_MSG_PING, a->role, (uint32_t)strlen(a->role), lk_deadline_ms(2000), a->err,
                                    sizeof a->err);
        if (!s1) s1 = lk_chan_recv(&c, &h, b, sizeof b, lk_deadline_ms(2000), a->err, sizeof a->err);
        if (!s1 && h.type != LK_MSG_PING) s1 = LK_ERR_FORMAT;
        a->st = s1;
    }
    return NULL;
}

static void handshake_pair(lk_seal_mode head, lk_seal_mode worker, hs_arg out[2]) {
    int fds[2];
    sock_pair(fds);
    out[0] = (hs_arg){.l = lk_tcp_wrap(fds[0], "worker-addr"), .initiator = true, .mode = head, .role = "head"};
    out[1] = (hs_arg){.l = lk_tcp_wrap(fds[1], "head-addr"), .initiator = false, .mode = worker, .role = "worker"};
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, hs_thread, &out[i]);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
}

TEST(handshake_negotiates_seal) {
    struct { lk_seal_mode h, w; bool sealed; } ok[] = {
        {LK_SEAL_OFF, LK_SEAL_EITHER, false}, {LK_SEAL_ON, LK_SEAL_EITHER, true}, {LK_SEAL_ON, LK_SEAL_ON, true},
        {LK_SEAL_OFF, LK_SEAL_OFF, false},    {LK_SEAL_EITHER, LK_SEAL_ON, true},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        hs_arg a[2];
        handshake_pair(ok[i].h, ok[i].w, a);
        for (int s = 0; s < 2; s++) {
            CHECKF(!a[s].st, "case %zu side %d: %s", i, s, a[s].err);
            CHECKF(a[s].peer.sealed == ok[i].sealed && lk_seal_is(a[s].l) == ok[i].sealed, "case %zu side %d", i, s);
            CHECK(lk_tcp_fd(a[s].l) >= 0);
            lk_link_close(a[s].l);
        }
    }
    /* mismatches: refused on both sides, each naming both settings */
    lk_seal_mode bad[2][2] = {{LK_SEAL_OFF, LK_SEAL_ON}, {LK_SEAL_ON, LK_SEAL_OFF}};
    for (int i = 0; i < 2; i++) {
        hs_arg a[2];
        handshake_pair(bad[i][0], bad[i][1], a);
        for (int s = 0; s < 2; s++) {
            CHECKF(a[s].st == LK_ERR_MISMATCH && strstr(a[s].err, "seal mismatch") &&
                       strstr(a[s].err, "requires sealed links (--seal)") && strstr(a[s].err, "does not seal (no --seal)"),
                   "case %d side %d: %d %s", i, s, a[s].st, a[s].err);
            CHECK(!lk_seal_is(a[s].l));
            lk_link_close(a[s].l);
        }
    }
}

/* The cipher: AES-256-GCM when both offer it, else ChaCha20-Poly1305. */
TEST(handshake_picks_cipher) {
    bool aes = lk_seal_cipher_available(LK_SEAL_AES256_GCM);
    uint8_t offers[3][2] = {{0, 0}, {1, 0}, {0, 1}};
    for (int i = 0; i < 3; i++) {
        int fds[2];
        sock_pair(fds);
        hs_arg a[2] = {{.l = lk_tcp_wrap(fds[0], "w"), .initiator = true, .mode = LK_SEAL_ON, .ciphers = offers[i][0],
                        .role = "head"},
                       {.l = lk_tcp_wrap(fds[1], "h"), .initiator = false, .mode = LK_SEAL_EITHER,
                        .ciphers = offers[i][1], .role = "worker"}};
        pthread_t t[2];
        for (int s = 0; s < 2; s++) pthread_create(&t[s], NULL, hs_thread, &a[s]);
        for (int s = 0; s < 2; s++) pthread_join(t[s], NULL);
        lk_seal_cipher want = i == 0 && aes ? LK_SEAL_AES256_GCM : LK_SEAL_CHACHA20_POLY1305;
        for (int s = 0; s < 2; s++) {
            CHECKF(!a[s].st && a[s].peer.sealed, "offer %d side %d: %s", i, s, a[s].err);
            if (!a[s].st) CHECKF(a[s].peer.cipher == want && lk_seal_cipher_of(a[s].l) == want, "offer %d side %d", i, s);
            lk_link_close(a[s].l);
        }
    }
}

/* A man in the middle who rewrites the head's INFO to say "no --seal", or
 * cuts the seal byte off as if the head were an older build (so that a
 * worker accepting either would talk in clear, and he could take over the
 * session): both VERDICTs carry a MAC over the INFO frames as each side saw
 * them, so both sides refuse, and nothing is exchanged in clear. */
typedef struct { int from, to; int frames_seen; int tamper; } relay_arg;

static void *relay_thread(void *p) {
    relay_arg *r = p;
    uint8_t hdr[24], body[2048];
    /* frames: HELLO, AUTH, INFO, VERDICT from the head, then whatever */
    for (;;) {
        if (!read_full(r->from, hdr, 24)) break;
        uint32_t len = hdr[12] | hdr[13] << 8 | hdr[14] << 16 | (uint32_t)hdr[15] << 24;
        uint16_t type = (uint16_t)(hdr[6] | hdr[7] << 8);
        if (len > sizeof body || !read_full(r->from, body, len)) break;
        if (r->tamper == 1 && type == LK_MSG_INFO && len) body[len - 1] = LK_SEAL_EITHER; /* the seal byte */
        if (r->tamper == 2 && type == LK_MSG_INFO && len) {
            /* no seal byte at all: the frame cut where it begins (version,
             * three strings, has_model, the model id), as a peer of a build
             * that never sealed sends it; the optional tail after it goes too */
            uint32_t at = 4;
            for (int k = 0; k < 3 && at + 2 <= len; k++) at += 2 + (uint32_t)(body[at] | body[at + 1] << 8);
            at += 1 + LK_MODEL_ID_BYTES;
            if (at < len) len = at;
            hdr[12] = (uint8_t)len, hdr[13] = (uint8_t)(len >> 8);
        }
        if (r->tamper == 3 && type == LK_MSG_VERDICT && len >= 32) {
            len -= 32; /* the MAC cut off */
            hdr[12] = (uint8_t)len, hdr[13] = (uint8_t)(len >> 8);
        }
        if (write(r->to, hdr, 24) != 24 || write(r->to, body, len) != (ssize_t)len) break;
        if (++r->frames_seen == 4) {
            /* after the handshake frames: copy raw bytes */
            ssize_t k;
            while ((k = read(r->from, body, sizeof body)) > 0)
                if (write(r->to, body, (size_t)k) != k) break;
            break;
        }
    }
    shutdown(r->to, SHUT_WR);
    return NULL;
}

static void strip_attempt(int tamper) {
    int h[2], w[2];
    sock_pair(h);
    sock_pair(w);
    hs_arg a[2] = {{.l = lk_tcp_wrap(h[0], "worker-addr"), .initiator = true, .mode = LK_SEAL_ON, .role = "head"},
                   {.l = lk_tcp_wrap(w[0], "head-addr"), .initiator = false, .mode = LK_SEAL_EITHER, .role = "worker"}};
    relay_arg r1 = {.from = h[1], .to = w[1], .tamper = tamper}, r2 = {.from = w[1], .to = h[1]};
    pthread_t t[4];
    pthread_create(&t[2], NULL, relay_thread, &r1);
    pthread_create(&t[3], NULL, relay_thread, &r2);
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, hs_thread, &a[i]);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < 2; i++) {
        const char *want = tamper == 3 && i == 1 ? "head-addr sent no proof of the handshake's INFO frames"
                         : tamper == 3 ? "sealed link check failed"
                                       : "the handshake was altered in transit (its INFO frames differ";
        CHECKF(a[i].st == LK_ERR_AUTH && strstr(a[i].err, want), "tamper %d side %d: %d %s", tamper, i, a[i].st, a[i].err);
        CHECK(!a[i].peer.sealed && !lk_seal_is(a[i].l));
    }
    for (int i = 0; i < 2; i++) lk_link_close(a[i].l);
    shutdown(h[1], SHUT_RDWR);
    shutdown(w[1], SHUT_RDWR);
    pthread_join(t[2], NULL);
    pthread_join(t[3], NULL);
    close(h[1]);
    close(w[1]);
}

TEST(seal_cannot_be_stripped) {
    strip_attempt(1);
    strip_attempt(2);
    strip_attempt(3);
}

/* ---- a sealed mesh through a man in the middle ------------------------------------- */

typedef struct {
    int lfd, target_port;
    atomic_int flip;      /* set: flip one bit of the next bytes from rank 1 */
    uint8_t seen[1 << 16];/* what passed from rank 1 to rank 0 (first 64 KiB) */
    size_t nseen;
} mitm_arg;

static void *mitm_thread(void *p) {
    mitm_arg *m = p;
    int a = accept(m->lfd, NULL, NULL);
    if (a < 0) return NULL;
    int b = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)m->target_port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(b, (struct sockaddr *)&sa, sizeof sa) != 0) { close(a); close(b); return NULL; }
    struct pollfd pf[2] = {{.fd = a, .events = POLLIN}, {.fd = b, .events = POLLIN}};
    uint8_t buf[4096];
    for (;;) {
        if (poll(pf, 2, 5000) <= 0) break;
        int from = pf[0].revents ? 0 : 1;
        ssize_t k = read(pf[from].fd, buf, sizeof buf);
        if (k <= 0) break;
        if (from == 0) {
            if (atomic_exchange(&m->flip, 0)) buf[k / 2] ^= 0x10;
            size_t c = LK_MIN((size_t)k, sizeof m->seen - m->nseen);
            memcpy(m->seen + m->nseen, buf, c);
            m->nseen += c;
        }
        if (write(pf[1 - from].fd, buf, (size_t)k) != k) break;
    }
    close(a);
    close(b);
    return NULL;
}

typedef struct {
    int rank, lfd;
    const char *const *addrs;
    lk_mesh *mesh;
    lk_status st;
    char err[LK_ERRLEN];
} mrank;

static void *mesh_rank_thread(void *p) {
    mrank *r = p;
    lk_hs_params hp;
    lk_hs_defaults(&hp, CKEY, r->rank ? "rank 1" : "rank 0");
    hp.seal = LK_SEAL_ON;
    lk_mesh_params mp = {.rank = r->rank, .n = 2, .addrs = r->addrs, .listen_fd = r->lfd, .shm = LK_MESH_SHM_OFF,
                         .spin_ns = 0, .timeout_ms = 5000, .auth = &lk_hs_mesh_auth, .auth_ctx = &hp};
    r->st = lk_mesh_create(&mp, &r->mesh, r->err, sizeof r->err);
    return NULL;
}

TEST(sealed_mesh_tampered_in_flight) {
    char err[LK_ERRLEN];
    int lfd0, p0, lfdm, pm;
    CHECK(!lk_tcp_listen("127.0.0.1:0", &lfd0, &p0, err, sizeof err));
    CHECK(!lk_tcp_listen("127.0.0.1:0", &lfdm, &pm, err, sizeof err));
    static mitm_arg m;
    memset(&m, 0, sizeof m);
    m.lfd = lfdm;
    m.target_port = p0;
    char a0[32], a1[32];
    snprintf(a0, sizeof a0, "127.0.0.1:%d", pm); /* rank 1 reaches rank 0 through the relay */
    snprintf(a1, sizeof a1, "127.0.0.1:1");     /* rank 1 listens nowhere (the highest rank) */
    const char *addrs[2] = {a0, a1};
    mrank r[2] = {{.rank = 0, .lfd = lfd0, .addrs = addrs}, {.rank = 1, .lfd = -1, .addrs = addrs}};
    pthread_t t[3];
    pthread_create(&t[2], NULL, mitm_thread, &m);
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, mesh_rank_thread, &r[i]);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    CHECKF(!r[0].st && !r[1].st, "%s / %s", r[0].err, r[1].err);
    if (!r[0].st && !r[1].st) {
        lk_link *l0 = lk_mesh_link(r[0].mesh, 1), *l1 = lk_mesh_link(r[1].mesh, 0);
        CHECK(lk_seal_is(l0) && lk_seal_is(l1) && l0 == lk_mesh_ctl(r[0].mesh, 1));
        static const char secret[] = "SECRET-PATTERN-SECRET-PATTERN";
        char got[sizeof secret] = {0};
        CHECK(!lk_link_send(l1, secret, sizeof secret, lk_deadline_ms(2000), err, sizeof err));
        CHECK(!lk_link_recv(l0, got, sizeof got, lk_deadline_ms(2000), err, sizeof err) && !strcmp(got, secret));
        CHECK(!memmem(m.seen, m.nseen, "SECRET", 6)); /* never in clear on the wire */
        atomic_store(&m.flip, 1);
        CHECK(!lk_link_send(l1, secret, sizeof secret, lk_deadline_ms(2000), err, sizeof err));
        lk_status st = lk_link_recv(l0, got, sizeof got, lk_deadline_ms(2000), err, sizeof err);
        char want[128];
        snprintf(want, sizeof want, "rank 1 (%s", "127.0.0.1:");
        CHECKF(st == LK_ERR_NET && !strncmp(err, want, strlen(want)) &&
                   strstr(err, "): authentication of received data failed (tampered or corrupted link)"),
               "%d %s", st, err);
    }
    lk_mesh_free(r[0].mesh);
    lk_mesh_free(r[1].mesh);
    pthread_join(t[2], NULL);
    close(lfd0);
    close(lfdm);
}

int main(void) {
    /* relays write to sockets whose other end may be gone: an error, not a signal */
    signal(SIGPIPE, SIG_IGN);
    keys();
    if (sodium_init() < 0) return 1;
    for (int c = LK_SEAL_CHACHA20_POLY1305; c <= LK_SEAL_AES256_GCM; c++) {
        CIPHER = (lk_seal_cipher)c;
        if (!lk_seal_cipher_available(CIPHER)) {
            printf("# %s: not on this CPU, skipped\n", lk_seal_cipher_name(CIPHER));
            continue;
        }
        printf("# %s\n", lk_seal_cipher_name(CIPHER));
        RUN(round_trip_sizes_partial_sends_no_alloc);
        RUN(record_format_matches_reference);
        RUN(attacks_detected);
    }
    RUN(handshake_negotiates_seal);
    RUN(handshake_picks_cipher);
    RUN(seal_cannot_be_stripped);
    RUN(sealed_mesh_tampered_in_flight);
    return lk_test_end();
}
