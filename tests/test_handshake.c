/* Wire frames, key files, model identity and the handshake. The refusals run
 * against one listener thread on 127.0.0.1 that must keep serving after each
 * bad client: wrong key, wrong version, other model, garbage, half a frame
 * then silence, oversized and out-of-sequence frames. */
#include "lk_test.h"
#include "cluster/cluster.h"

#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <unistd.h>

/* ---- frames ------------------------------------------------------------------- */

TEST(header_bytes) {
    lk_frame_hdr h = {LK_WIRE_MAGIC, 1, LK_MSG_INFO, 0, 5, 0x0102030405060708ull};
    uint8_t b[LK_WIRE_HDR];
    lk_wire_encode_hdr(&h, b);
    static const uint8_t want[LK_WIRE_HDR] = {'L', 'K', 'W', '1', 1, 0, 3, 0, 0, 0, 0, 0,
                                              5, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1};
    CHECK(!memcmp(b, want, sizeof want));
    lk_frame_hdr d;
    char err[LK_ERRLEN];
    CHECK(lk_wire_decode_hdr(want, 1, &d, err, sizeof err) == LK_OK && d.type == 3 && d.len == 5 &&
          d.seq == 0x0102030405060708ull);
    uint8_t x[LK_WIRE_HDR];
    memcpy(x, want, sizeof x); x[0] = 'G';
    CHECK(lk_wire_decode_hdr(x, 1, &d, err, sizeof err) == LK_ERR_FORMAT && strstr(err, "not a lockstep frame"));
    memcpy(x, want, sizeof x); x[4] = 2;
    CHECK(lk_wire_decode_hdr(x, 1, &d, err, sizeof err) == LK_ERR_MISMATCH && strstr(err, "peer speaks 2, we speak 1"));
    memcpy(x, want, sizeof x); x[4] = 9; x[6] = LK_MSG_ERROR; /* ERROR frames readable at any version */
    CHECK(lk_wire_decode_hdr(x, 1, &d, err, sizeof err) == LK_OK);
    memcpy(x, want, sizeof x); x[6] = 99;
    CHECK(lk_wire_decode_hdr(x, 1, &d, err, sizeof err) == LK_ERR_FORMAT && strstr(err, "unknown message type 99"));
    memcpy(x, want, sizeof x); x[8] = 1;
    CHECK(lk_wire_decode_hdr(x, 1, &d, err, sizeof err) == LK_ERR_FORMAT && strstr(err, "flags"));
    memcpy(x, want, sizeof x); x[14] = 1; /* INFO of 65541 bytes > 1024 */
    CHECK(lk_wire_decode_hdr(x, 1, &d, err, sizeof err) == LK_ERR_FORMAT && strstr(err, "exceeds its limit"));
    memcpy(x, want, sizeof x); x[6] = LK_MSG_RESULT; x[15] = 0xff; /* 4 GiB */
    CHECK(lk_wire_decode_hdr(x, 1, &d, err, sizeof err) == LK_ERR_FORMAT);
}

TEST(payload_reader_bounds) {
    uint8_t buf[16];
    lk_wbuf w = {buf, sizeof buf, 0, true};
    lk_wb_u32(&w, 7);
    lk_wb_str(&w, "abc");
    CHECK(w.ok && w.len == 9);
    lk_wb_u64(&w, 1);
    CHECK(!w.ok); /* 17 > 16 */
    lk_rbuf r = {buf, 9, 0, true};
    char s[8];
    CHECK(lk_rb_u32(&r) == 7);
    lk_rb_str(&r, s, sizeof s);
    CHECK(r.ok && !strcmp(s, "abc") && r.pos == 9);
    CHECK(lk_rb_u8(&r) == 0 && !r.ok); /* past the end */
    uint8_t evil[6] = {4, 0, 'a', 0x1b, 'b', 'c'}; /* escape character */
    r = (lk_rbuf){evil, 6, 0, true};
    lk_rb_str(&r, s, sizeof s);
    CHECK(!r.ok);
    uint8_t lie[4] = {0xff, 0xff, 'a', 'b'}; /* length beyond the payload */
    r = (lk_rbuf){lie, 4, 0, true};
    lk_rb_str(&r, s, sizeof s);
    CHECK(!r.ok && s[0] == 0);
}

/* ---- key files ------------------------------------------------------------------ */

static const char *write_tmp(const char *name, const char *text) {
    static char path[8][256];
    static int k;
    char *p = path[k++ & 7];
    snprintf(p, 256, "/tmp/lk-test-%d-%s", (int)getpid(), name);
    FILE *f = fopen(p, "w");
    fputs(text, f);
    fclose(f);
    return p;
}

TEST(key_files) {
    char hex[65], err[LK_ERRLEN];
    lk_key_generate(hex);
    CHECK(strlen(hex) == 64);
    char again[65];
    lk_key_generate(again);
    CHECK(strcmp(hex, again) != 0);
    char text[80];
    snprintf(text, sizeof text, "  %s\n", hex);
    uint8_t key[32];
    const char *good = write_tmp("good", text);
    CHECKF(lk_key_load(good, key, err, sizeof err) == LK_OK, "%s", err);
    char back[65];
    sodium_bin2hex(back, sizeof back, key, 32);
    CHECK(!strcmp(back, hex));
    CHECK(lk_key_load("/nonexistent/k", key, err, sizeof err) == LK_ERR_IO && strstr(err, "/nonexistent/k"));
    const char *shortk = write_tmp("short", "abcd\n");
    CHECK(lk_key_load(shortk, key, err, sizeof err) == LK_ERR_FORMAT && strstr(err, "64 hex digits"));
    char bad[80];
    snprintf(bad, sizeof bad, "%s", hex);
    bad[10] = 'z';
    const char *badk = write_tmp("bad", bad);
    CHECK(lk_key_load(badk, key, err, sizeof err) == LK_ERR_FORMAT && strstr(err, "not a hex digit"));
    snprintf(text, sizeof text, "%s extra", hex);
    const char *extra = write_tmp("extra", text);
    CHECK(lk_key_load(extra, key, err, sizeof err) == LK_ERR_FORMAT);
    CHECK(lk_key_load("", key, err, sizeof err) == LK_ERR_ARG && strstr(err, "keygen"));
    unlink(good); unlink(shortk); unlink(badk); unlink(extra);
}

/* ---- model identity ---------------------------------------------------------------- */

/* The identity recomputed here from its definition, reading the file with
 * stdio (the data offset comes from the gguf reader). */
static void identity_by_hand(const char *path, uint64_t data_off, const lk_gguf *g, uint8_t id[32]) {
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    uint8_t *all = malloc((size_t)size);
    fseek(f, 0, SEEK_SET);
    LK_ASSERT(fread(all, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, 32);
    uint8_t sz[8];
    for (int i = 0; i < 8; i++) sz[i] = (uint8_t)((uint64_t)size >> (8 * i));
    crypto_generichash_update(&st, sz, 8);
    crypto_generichash_update(&st, all, data_off);
    for (int64_t t = 0; t < lk_gguf_n_tensors(g); t++) {
        const lk_gguf_tensor *x = lk_gguf_tensor_at(g, t);
        const uint8_t *p = all + data_off + x->offset;
        if (x->nbytes <= 8192) crypto_generichash_update(&st, p, x->nbytes);
        else {
            crypto_generichash_update(&st, p, 4096);
            crypto_generichash_update(&st, p + x->nbytes - 4096, 4096);
        }
    }
    crypto_generichash_final(&st, id, 32);
    free(all);
}

static uint8_t id_f32[32], id_q8[32];

TEST(model_identity) {
    const char *paths[2] = {lk_td("models/stories260K.gguf"), lk_td("models/stories260K-q8_0.gguf")};
    uint8_t *ids[2] = {id_f32, id_q8};
    for (int i = 0; i < 2; i++) {
        lk_gguf *g;
        char err[LK_ERRLEN];
        if (lk_gguf_open(paths[i], &g, err, sizeof err)) { CHECKF(0, "%s", err); return; }
        lk_cluster_model_id(g, ids[i]);
        uint8_t hand[32];
        identity_by_hand(paths[i], lk_gguf_data_offset(g), g, hand);
        CHECK(!memcmp(hand, ids[i], 32));
        uint8_t again[32];
        lk_cluster_model_id(g, again);
        CHECK(!memcmp(again, ids[i], 32));
        lk_gguf_close(g);
    }
    CHECK(memcmp(id_f32, id_q8, 32) != 0);
}

/* ---- the listener ------------------------------------------------------------------- */

static uint8_t key_a[32], key_b[32];

enum { MAXLOG = 32 };
typedef struct {
    int lfd, port;
    int served;
    lk_status st[MAXLOG];
    char err[MAXLOG][LK_ERRLEN];
    volatile int stop;
    pthread_mutex_t mu;
} server;

/* Accepts connections one after the other, handshakes each as a worker
 * holding key_a and the f32 model, records the outcome, and goes on. */
static void *server_main(void *p) {
    server *s = p;
    while (!s->stop) {
        lk_link *l;
        char err[LK_ERRLEN];
        if (lk_tcp_accept(s->lfd, lk_deadline_ms(100), &l, err, sizeof err)) continue;
        lk_hs_params hp;
        lk_hs_defaults(&hp, key_a, "worker");
        hp.has_model = true;
        memcpy(hp.model_id, id_f32, 32);
        hp.timeout_ms = 300;
        lk_chan c;
        lk_chan_init(&c, l);
        lk_hs_peer peer;
        lk_status st = lk_handshake(&c, false, &hp, &peer, err, sizeof err);
        if (!st) {
            /* One control exchange proves the channel is usable afterwards. */
            lk_frame_hdr h;
            uint8_t ping[16];
            if (!lk_chan_recv(&c, &h, ping, sizeof ping, lk_deadline_ms(300), err, sizeof err) && h.type == LK_MSG_PING)
                lk_chan_send(&c, LK_MSG_PONG, ping, h.len, lk_deadline_ms(300), err, sizeof err);
        }
        lk_link_close(l);
        pthread_mutex_lock(&s->mu);
        if (s->served < MAXLOG) {
            s->st[s->served] = st;
            snprintf(s->err[s->served], LK_ERRLEN, "%s", st ? err : "");
        }
        s->served++;
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

static server srv;
static pthread_t srv_thread;

static void server_start(void) {
    char err[LK_ERRLEN];
    memset(&srv, 0, sizeof srv);
    pthread_mutex_init(&srv.mu, NULL);
    LK_ASSERT(!lk_tcp_listen("127.0.0.1:0", &srv.lfd, &srv.port, err, sizeof err));
    pthread_create(&srv_thread, NULL, server_main, &srv);
}

static void server_stop(void) {
    srv.stop = 1;
    pthread_join(srv_thread, NULL);
    close(srv.lfd);
}

/* Waits until the server has finished with connection number k. */
static bool server_result(int k, lk_status *st, char *err) {
    for (int i = 0; i < 300; i++) {
        pthread_mutex_lock(&srv.mu);
        bool done = srv.served > k;
        if (done) { *st = srv.st[k]; strcpy(err, srv.err[k]); }
        pthread_mutex_unlock(&srv.mu);
        if (done) return true;
        usleep(10000);
    }
    return false;
}

static lk_link *dial(void) {
    char addr[32], err[LK_ERRLEN];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", srv.port);
    lk_link *l = NULL;
    LK_ASSERT(!lk_tcp_connect(addr, lk_deadline_ms(2000), &l, err, sizeof err));
    return l;
}

/* A head-side handshake with the given twists. */
static lk_status client(const uint8_t *key, uint16_t version, const char *build, const uint8_t *model,
                        char *err, bool ping) {
    lk_link *l = dial();
    lk_hs_params hp;
    lk_hs_defaults(&hp, key, "head");
    hp.version = version;
    if (build) hp.build_id = build;
    if (model) { hp.has_model = true; memcpy(hp.model_id, model, 32); }
    hp.timeout_ms = 1000;
    lk_chan c;
    lk_chan_init(&c, l);
    lk_hs_peer peer;
    lk_status st = lk_handshake(&c, true, &hp, &peer, err, LK_ERRLEN);
    if (!st && ping) {
        uint8_t nonce[8] = {1, 2, 3, 4, 5, 6, 7, 8}, back[16];
        lk_frame_hdr h;
        st = lk_chan_send(&c, LK_MSG_PING, nonce, 8, lk_deadline_ms(500), err, LK_ERRLEN);
        if (!st) st = lk_chan_recv(&c, &h, back, sizeof back, lk_deadline_ms(500), err, LK_ERRLEN);
        if (!st && (h.type != LK_MSG_PONG || h.len != 8 || memcmp(back, nonce, 8))) st = LK_ERR_FORMAT;
        if (!st && (strcmp(peer.role, "worker") || peer.version != LK_WIRE_VERSION || !peer.has_model ||
                    memcmp(peer.model_id, id_f32, 32)))
            st = LK_ERR_FORMAT;
    }
    lk_link_close(l);
    return st;
}

TEST(handshake_refusals_and_keeps_serving) {
    server_start();
    char cerr[LK_ERRLEN], serr[LK_ERRLEN];
    lk_status cst, sst;
    int k = 0;
    char hexa[20], hexb[20], want[128];

    /* 1. the good case, with a control message after it */
    cst = client(key_a, LK_WIRE_VERSION, NULL, id_f32, cerr, true);
    CHECKF(cst == LK_OK, "%s", cerr);
    CHECK(server_result(k++, &sst, serr) && sst == LK_OK);

    /* 2. wrong key */
    cst = client(key_b, LK_WIRE_VERSION, NULL, id_f32, cerr, false);
    CHECKF(cst == LK_ERR_AUTH && strstr(cerr, "authentication failed") && strstr(cerr, "--key-file"), "%s", cerr);
    CHECK(server_result(k++, &sst, serr));
    CHECKF(sst == LK_ERR_AUTH && strstr(serr, "does not hold our cluster key"), "%s", serr);

    /* 3. wrong protocol version: both sides print both numbers */
    cst = client(key_a, LK_WIRE_VERSION + 1, NULL, id_f32, cerr, false);
    snprintf(want, sizeof want, "peer speaks %d, we speak %d", LK_WIRE_VERSION + 1, LK_WIRE_VERSION);
    /* The client reads the worker's HELLO (version 1) before its ERROR, so it
     * refuses on its own account: the same two numbers, seen from its side. */
    char want2[128];
    snprintf(want2, sizeof want2, "peer speaks %d, we speak %d", LK_WIRE_VERSION, LK_WIRE_VERSION + 1);
    CHECKF((cst == LK_ERR_PEER && strstr(cerr, want)) || (cst == LK_ERR_MISMATCH && strstr(cerr, want2)), "%s", cerr);
    CHECK(server_result(k++, &sst, serr));
    CHECKF(sst == LK_ERR_MISMATCH && strstr(serr, want), "%s", serr);

    /* 4. another model file */
    cst = client(key_a, LK_WIRE_VERSION, NULL, id_q8, cerr, false);
    snprintf(want, sizeof want, "model mismatch: head has %s, worker has %s", lk_cluster_model_id_short(id_q8, hexa, 20),
             lk_cluster_model_id_short(id_f32, hexb, 20));
    CHECKF(cst == LK_ERR_MISMATCH && strstr(cerr, want), "%s", cerr);
    CHECK(server_result(k++, &sst, serr));
    snprintf(want, sizeof want, "model mismatch: worker has %s, head has %s", hexb, hexa);
    CHECKF(sst == LK_ERR_MISMATCH && strstr(serr, want), "%s", serr);

    /* 5. another build */
    cst = client(key_a, LK_WIRE_VERSION, "other-build", id_f32, cerr, false);
    CHECKF(cst == LK_ERR_MISMATCH && strstr(cerr, "build mismatch: head is other-build, worker is"), "%s", cerr);
    CHECK(server_result(k++, &sst, serr) && sst == LK_ERR_MISMATCH && strstr(serr, "other-build"));

    /* 6. garbage: an HTTP request. The worker answers with an ERROR frame
     * (a lockstep client would print it) and closes. */
    lk_link *l = dial();
    const char *http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    lk_link_send(l, http, strlen(http), lk_deadline_ms(500), cerr, sizeof cerr);
    lk_chan c;
    lk_chan_init(&c, l);
    lk_frame_hdr h;
    uint8_t buf[64];
    /* its HELLO comes first, then the ERROR */
    lk_status st = lk_chan_recv(&c, &h, buf, sizeof buf, lk_deadline_ms(1000), cerr, sizeof cerr);
    CHECK(st == LK_OK && h.type == LK_MSG_HELLO);
    st = lk_chan_recv(&c, &h, buf, sizeof buf, lk_deadline_ms(1000), cerr, sizeof cerr);
    CHECKF(st == LK_ERR_PEER && strstr(cerr, "not a lockstep frame"), "%s", cerr);
    lk_link_close(l);
    CHECK(server_result(k++, &sst, serr));
    CHECKF(sst == LK_ERR_FORMAT && strstr(serr, "not a lockstep frame (magic 47 45 54 20)"), "%s", serr);

    /* 7. half a header, then silence: the worker gives up at its deadline */
    l = dial();
    uint8_t hb[LK_WIRE_HDR];
    lk_frame_hdr fh = {LK_WIRE_MAGIC, LK_WIRE_VERSION, LK_MSG_HELLO, 0, 32, 0};
    lk_wire_encode_hdr(&fh, hb);
    lk_link_send(l, hb, 10, lk_deadline_ms(500), cerr, sizeof cerr);
    uint64_t t0 = lk_time_ns();
    CHECK(server_result(k++, &sst, serr));
    double ms = (double)(lk_time_ns() - t0) / 1e6;
    CHECKF(sst == LK_ERR_TIMEOUT && strstr(serr, "receiving 24 bytes (got 10)"), "%s", serr);
    CHECKF(ms < 1000, "%.0f ms", ms);
    lk_link_close(l);

    /* 8. a whole header announcing a huge HELLO: refused before reading it */
    l = dial();
    fh.len = 1u << 30;
    lk_wire_encode_hdr(&fh, hb);
    lk_link_send(l, hb, sizeof hb, lk_deadline_ms(500), cerr, sizeof cerr);
    CHECK(server_result(k++, &sst, serr));
    CHECKF(sst == LK_ERR_FORMAT && strstr(serr, "exceeds its limit"), "%s", serr);
    lk_link_close(l);

    /* 9. a HELLO with a wrong sequence number */
    l = dial();
    fh.len = 32;
    fh.seq = 5;
    uint8_t frame[LK_WIRE_HDR + 32] = {0};
    lk_wire_encode_hdr(&fh, frame);
    lk_link_send(l, frame, sizeof frame, lk_deadline_ms(500), cerr, sizeof cerr);
    CHECK(server_result(k++, &sst, serr));
    CHECKF(sst == LK_ERR_FORMAT && strstr(serr, "out of sequence"), "%s", serr);
    lk_link_close(l);

    /* 10. a connection closed at once */
    l = dial();
    lk_link_close(l);
    CHECK(server_result(k++, &sst, serr) && sst == LK_ERR_NET);

    /* 11. and the listener still serves a good head */
    cst = client(key_a, LK_WIRE_VERSION, NULL, id_f32, cerr, true);
    CHECKF(cst == LK_OK, "%s", cerr);
    CHECK(server_result(k++, &sst, serr) && sst == LK_OK);
    /* no model on the head's side yet: compared only when both have one */
    cst = client(key_a, LK_WIRE_VERSION, NULL, NULL, cerr, true);
    CHECKF(cst == LK_OK, "%s", cerr);
    CHECK(server_result(k++, &sst, serr) && sst == LK_OK);
    server_stop();
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    LK_ASSERT(sodium_init() >= 0);
    randombytes_buf(key_a, 32);
    randombytes_buf(key_b, 32);
    RUN(header_bytes);
    RUN(payload_reader_bounds);
    RUN(key_files);
    RUN(model_identity);
    RUN(handshake_refusals_and_keeps_serving);
    return lk_test_end();
}
