/* fuzz_wire — frames and session payloads as a peer could send them.
 *
 * The input is what arrives on a control connection after the handshake:
 * the harness reads frames from it with lk_chan_recv (header checks,
 * sequence numbers, ERROR frames, payload bounds) until the stream ends or
 * is refused, and hands every payload to the session decoders of proto.c
 * (LOAD, LOADED, MESH, BENCH, FILE), whatever its type, so each decoder sees
 * every shape of bytes. A payload a decoder accepts must survive a round
 * trip: encoding the decoded message and decoding that again gives the same
 * message (a decoder that accepts what its encoder cannot write, or an
 * encoder that loses a field, is a bug here too). */
#include <assert.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/cluster.h"
#include "cluster/proto.h"
#include "fuzz_link.h"

/* Decoded messages are compared field by field through memcmp of the whole
 * struct: the decoders memset their output first, so padding is zero. */
#define ROUND_TRIP(kind, type, payload, n)                                            \
    do {                                                                             \
        static type a, b;                                                            \
        static uint8_t enc[128 * 1024];                                              \
        if (lk_proto_##kind##_decode(payload, n, &a)) {                              \
            uint32_t len = lk_proto_##kind##_encode(&a, enc, sizeof enc);            \
            if (!lk_proto_##kind##_decode(enc, len, &b) || memcmp(&a, &b, sizeof a)) { \
                fprintf(stderr, #kind ": accepted payload does not survive encode/decode\n"); \
                abort();                                                             \
            }                                                                        \
        }                                                                            \
    } while (0)

static void decode_all(const uint8_t *p, uint32_t n) {
    ROUND_TRIP(load, lk_load_msg, p, n);
    ROUND_TRIP(loaded, lk_loaded_msg, p, n);
    ROUND_TRIP(mesh, lk_mesh_msg, p, n);
    ROUND_TRIP(bench, lk_bench_msg, p, n);
    ROUND_TRIP(file, lk_file_msg, p, n);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    lk_log_set_level(LK_LOG_ERROR);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fuzz_link f;
    static bool init;
    static uint8_t payload[(1u << 20) + 1];
    if (!init) { fuzz_link_init(&f); init = true; }
    fuzz_link_reset(&f);
    fuzz_link_feed(&f, data, size);

    /* The header decoder alone, at both the current and another version. */
    if (size >= LK_WIRE_HDR) {
        lk_frame_hdr h;
        char err[LK_ERRLEN];
        if (lk_wire_decode_hdr(data, LK_WIRE_VERSION, &h, err, sizeof err) == LK_OK) {
            assert(h.len <= lk_wire_max_payload(h.type) && h.flags == 0);
            uint8_t again[LK_WIRE_HDR];
            lk_wire_encode_hdr(&h, again);
            assert(memcmp(again, data, LK_WIRE_HDR) == 0);
        }
        lk_wire_decode_hdr(data, 2, &h, err, sizeof err);
    }

    /* The stream: frames until the first refusal, each payload decoded. */
    lk_chan c;
    lk_chan_init(&c, &f.base);
    for (int k = 0; k < 64; k++) {
        lk_frame_hdr h;
        char err[LK_ERRLEN];
        lk_status st = lk_chan_recv(&c, &h, payload, sizeof payload - 1, lk_deadline_ms(1000), err, sizeof err);
        if (st == LK_ERR_PEER) {
            for (const char *s = err; *s; s++) assert(*s >= 0x20 && *s <= 0x7e); /* a peer's reason is sanitised */
            continue;
        }
        if (st) break;
        decode_all(payload, h.len);
    }
    /* The raw input as one payload, too (no header needed to reach a decoder). */
    decode_all(data, (uint32_t)LK_MIN(size, (size_t)UINT32_MAX));
    return 0;
}
