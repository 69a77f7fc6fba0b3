/* Model identity as people read it: two ids of a mismatch message must never
 * print as the same string. The ids are made by hand here (finding two real
 * files whose BLAKE2b ids agree on 8 bytes would take 2^32 tries at best). */
#include "lk_test.h"
#include "cluster/cluster.h"

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

int main(void) {
    RUN(pair_differs_early);
    RUN(pair_differs_late);
    return lk_test_end();
}
