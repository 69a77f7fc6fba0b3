/* Model identity as people read it: two ids of a mismatch message must never
 * print as the same string. The ids are made by hand here (finding two real
 * files whose BLAKE2b ids agree on 8 bytes would take 2^32 tries at best). */
#include "lk_test.h"
#include "cluster/cluster.h"

#include <unistd.h>

/* Ids that differ in the first 8 bytes print as 16 hex digits, as
 * lk_cluster_model_id_short does (so existing messages read the same). */
TEST(pair_differs_early) {
    uint8_t a[LK_MODEL_ID_BYTES], b[LK_MODEL_ID_BYTES];
    for (int i = 0; i < LK_MODEL_ID_BYTES; i++) a[i] = b[i] = (uint8_t)(0x11 * i + 3);
    b[5] ^= 0x80;
    char ah[LK_MODEL_ID_HEX], bh[LK_MODEL_ID_HEX], s[20];
    lk_cluster_model_id_pair(a, b, ah, bh);
    CHECKF(strlen(ah) == 16 && strlen(bh) == 16, "%s %s", ah, bh);
    CHECKF(strcmp(ah, bh) && !strcmp(ah, lk_cluster_model_id_short(a, s, sizeof s)), "%s %s", ah, bh);
    CHECKF(!strcmp(bh, lk_cluster_model_id_short(b, s, sizeof s)), "%s", bh);
}

/* Ids equal in their first 8 bytes (and more) differ in print: all 32 bytes
 * of each, in order. */
TEST(pair_differs_late) {
    for (int at = 8; at < LK_MODEL_ID_BYTES; at++) {
        uint8_t a[LK_MODEL_ID_BYTES], b[LK_MODEL_ID_BYTES];
        for (int i = 0; i < LK_MODEL_ID_BYTES; i++) a[i] = b[i] = (uint8_t)(0x3d * i + 0xa0);
        b[at] ^= 1;
        char ah[LK_MODEL_ID_HEX], bh[LK_MODEL_ID_HEX];
        lk_cluster_model_id_pair(a, b, ah, bh);
        CHECKF(strcmp(ah, bh), "byte %d: both print as %s", at, ah);
        CHECKF(strlen(ah) == 2 * LK_MODEL_ID_BYTES && strlen(bh) == 2 * LK_MODEL_ID_BYTES, "%s %s", ah, bh);
        char want[3];
        snprintf(want, sizeof want, "%02x", b[at]);
        CHECKF(!strncmp(bh + 2 * at, want, 2) && !strncmp(ah, "a0dd", 4), "byte %d: %s %s", at, ah, bh);
    }
}

/* A GGUF without tensors (a vocabulary file) may end before its padded data
 * offset; its identity is taken over the bytes it has (found by fuzz_gguf: a
 * worker asked to load such a file aborted on an assertion). Two such files
 * differing in their last byte differ in identity. */
TEST(id_of_file_ending_before_data_offset) {
    uint8_t f[38] = "GGUF";
    const uint8_t rest[] = {3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, /* v3, 0 tensors, 1 kv */
                            1, 0, 0, 0, 0, 0, 0, 0, 'a', 0, 0, 0, 0, 7};              /* "a" = u8 7 */
    memcpy(f + 4, rest, sizeof rest);
    uint8_t id[2][LK_MODEL_ID_BYTES];
    for (int k = 0; k < 2; k++) {
        char path[] = "/tmp/lk_identity_XXXXXX", err[LK_ERRLEN];
        int fd = mkstemp(path);
        f[37] = (uint8_t)(7 + k);
        CHECK(fd >= 0 && write(fd, f, sizeof f) == (ssize_t)sizeof f);
        close(fd);
        lk_gguf *g = NULL;
        CHECKF(lk_gguf_open(path, &g, err, sizeof err) == LK_OK, "%s", err);
        unlink(path);
        if (!g) return;
        CHECK(lk_gguf_data_offset(g) > lk_gguf_file_size(g));
        lk_cluster_model_id(g, id[k]);
        lk_gguf_close(g);
    }
    CHECK(memcmp(id[0], id[1], LK_MODEL_ID_BYTES) != 0);
}

int main(void) {
    RUN(pair_differs_early);
    RUN(pair_differs_late);
    RUN(id_of_file_ending_before_data_offset);
    return lk_test_end();
}
