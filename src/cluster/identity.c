/* Model identity: which model a file holds, cheaply. Hashing every byte of a
 * 40 GB file at every start is not an option; hashing only the header would
 * call a re-quantised or fine-tuned file with the same shapes "the same".
 * So: every byte before the tensor data (header, all metadata, the tensor
 * index with names, types, shapes and offsets), the file size, and the first
 * and last 4 KiB of every tensor's data. */
#include "cluster/cluster.h"
#include "model/model.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>

#define SAMPLE 4096

void lk_cluster_model_id(const lk_gguf *g, uint8_t id[LK_MODEL_ID_BYTES]) {
    if (sodium_init() < 0) LK_ASSERT(!"libsodium could not initialise");
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, LK_MODEL_ID_BYTES);
    const uint8_t *file = lk_gguf_file_bytes(g);
    /* A file without tensors (a vocabulary) may end before its padded data
     * offset (gguf.h), so the bytes before the data are those in the file:
     * the same range lk_cluster_model_id_ranges gives. */
    uint64_t size = lk_gguf_file_size(g), data = LK_MIN(lk_gguf_data_offset(g), size);
    uint8_t sz[8];
    for (int i = 0; i < 8; i++) sz[i] = (uint8_t)(size >> (8 * i));
    crypto_generichash_update(&st, sz, sizeof sz);
    crypto_generichash_update(&st, file, data);
    for (int64_t t = 0; t < lk_gguf_n_tensors(g); t++) {
        const lk_gguf_tensor *x = lk_gguf_tensor_at(g, t);
        const uint8_t *p = x->data;
        if (x->nbytes <= 2 * SAMPLE) {
            crypto_generichash_update(&st, p, x->nbytes);
        } else {
            crypto_generichash_update(&st, p, SAMPLE);
            crypto_generichash_update(&st, p + x->nbytes - SAMPLE, SAMPLE);
        }
    }
    crypto_generichash_final(&st, id, LK_MODEL_ID_BYTES);
}

void lk_cluster_model_id_ranges(const lk_gguf *g, lk_ranges *out) {
    uint64_t data = lk_gguf_data_offset(g);
    lk_ranges_add(out, 0, LK_MIN(data, lk_gguf_file_size(g)));
    for (int64_t t = 0; t < lk_gguf_n_tensors(g); t++) {
        const lk_gguf_tensor *x = lk_gguf_tensor_at(g, t);
        uint64_t at = data + x->offset;
        if (x->nbytes <= 2 * SAMPLE) {
            lk_ranges_add(out, at, x->nbytes);
        } else {
            lk_ranges_add(out, at, SAMPLE);
            lk_ranges_add(out, at + x->nbytes - SAMPLE, SAMPLE);
        }
    }
    lk_ranges_normalize(out);
}

const char *lk_cluster_model_id_short(const uint8_t id[LK_MODEL_ID_BYTES], char *buf, size_t len) {
    char hex[17];
    for (int i = 0; i < 8; i++) snprintf(hex + 2 * i, 3, "%02x", id[i]);
    snprintf(buf, len, "%s", hex);
    return buf;
}

static void hex_bytes(const uint8_t *id, int n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < n; i++) {
        out[2 * i] = digits[id[i] >> 4];
        out[2 * i + 1] = digits[id[i] & 15];
    }
    out[2 * n] = 0;
}

/* Eight bytes tell two different BLAKE2b ids apart all but never; the rule
 * still has to hold for any two ids (a damaged cache entry, a peer's INFO),
 * since two equal strings in a "mismatch" message send the reader hunting
 * for a bug that is not there. */
void lk_cluster_model_id_pair(const uint8_t a[LK_MODEL_ID_BYTES], const uint8_t b[LK_MODEL_ID_BYTES],
                              char ahex[LK_MODEL_ID_HEX], char bhex[LK_MODEL_ID_HEX]) {
    int n = memcmp(a, b, 8) ? 8 : LK_MODEL_ID_BYTES;
    hex_bytes(a, n, ahex);
    hex_bytes(b, n, bhex);
}
