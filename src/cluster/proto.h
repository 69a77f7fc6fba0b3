/* proto — the payloads of the session messages (LOAD, LOADED, FILE, MESH, READY,
 * PING) shared by worker.c and head.c. Internal to the cluster part.
 * Decoders validate every field a peer sent and return false on anything
 * malformed; the caller then refuses with the message type named. */
#ifndef LK_CLUSTER_PROTO_H
#define LK_CLUSTER_PROTO_H

#include "cluster/cluster.h"
#include "model/model.h"

#include <sodium.h>

#define LK_MAX_RANKS 64
#define LK_ADDR_LEN 128

typedef struct {
    int32_t  rank, n_ranks, tp;
    lk_slice slice;
    char     model_name[256];  /* file name, looked up in the worker's --model-dir */
    char     model_path[1024]; /* the head's path (used when the worker has no --model-dir) */
    uint8_t  model_id[LK_MODEL_ID_BYTES];
    int32_t  n_ctx, n_batch, n_threads;
    uint8_t  kv_f16, shm;      /* lk_mesh_shm */
    uint8_t  wire;             /* lk_wire_fmt of all-reduce payloads */
    int32_t  max_seqs;         /* sequence slots */
    int64_t  kv_tokens;        /* KV positions in the page pool (0: max_seqs x n_ctx) */
} lk_load_msg;

typedef struct {
    uint8_t  ok;
    char     reason[512];
    char     mesh_addr[LK_ADDR_LEN];
    uint8_t  want_file;        /* not loaded: send the model file (FILE, DATA...) */
} lk_loaded_msg;

typedef struct {
    int32_t n;
    char    addrs[LK_MAX_RANKS][LK_ADDR_LEN];
} lk_mesh_msg;

typedef struct {
    int32_t      rank, n_ranks;
    uint8_t      shm;
    int64_t      spin_ns;      /* < 0: automatic */
    lk_bench_cfg cfg;
} lk_bench_msg;

uint32_t lk_proto_bench_encode(const lk_bench_msg *m, uint8_t *buf, uint32_t cap);
bool     lk_proto_bench_decode(const uint8_t *buf, uint32_t len, lk_bench_msg *m);
uint32_t lk_proto_load_encode(const lk_load_msg *m, uint8_t *buf, uint32_t cap);
bool     lk_proto_load_decode(const uint8_t *buf, uint32_t len, lk_load_msg *m);
uint32_t lk_proto_loaded_encode(const lk_loaded_msg *m, uint8_t *buf, uint32_t cap);
bool     lk_proto_loaded_decode(const uint8_t *buf, uint32_t len, lk_loaded_msg *m);
uint32_t lk_proto_mesh_encode(const lk_mesh_msg *m, uint8_t *buf, uint32_t cap);
bool     lk_proto_mesh_decode(const uint8_t *buf, uint32_t len, lk_mesh_msg *m);

/* --emulate-link (emulate.c): relays on the mesh links of a --local
 * cluster. lk_emu_open parses the spec (NULL: *out NULL, nothing emulated),
 * refuses it without --local or with a transport other than TCP, and turns
 * auto into tcp. lk_emu_route gives worker r its MESH: all's addresses, with
 * each lower rank whose link to r is emulated replaced by a relay started
 * here. The relays run until lk_emu_close. */
typedef struct lk_emu lk_emu;
lk_status lk_emu_open(const char *spec, int n_ranks, bool local, lk_mesh_shm *shm, lk_emu **out, char *err,
                      size_t errlen);
lk_status lk_emu_route(lk_emu *e, const lk_mesh_msg *all, int r, lk_mesh_msg *out, char *err, size_t errlen);
void      lk_emu_close(lk_emu *e); /* NULL ok */

/* FILE: what the head is about to send (see cluster.h). The worker computes
 * the range list itself from the header (the first header_len bytes) and
 * its slice, and checks it against n_ranges / n_bytes / ranges_hash. */
/* The unit a sparse file takes disk in (ext4, xfs, tmpfs): the disk need of
 * a slice is counted in whole blocks. */
#define LK_DISK_BLOCK 4096

typedef struct {
    uint64_t size;             /* of the whole file (the sparse copy's size) */
    uint64_t header_len;       /* header + tensor index: the stream's first bytes */
    uint64_t n_bytes;          /* bytes that follow in DATA frames */
    uint64_t disk;             /* bytes of the LK_DISK_BLOCK blocks those bytes touch */
    uint64_t n_ranges;
    uint8_t  ranges_hash[32];  /* lk_proto_ranges_hash */
} lk_file_msg;

uint32_t lk_proto_file_encode(const lk_file_msg *m, uint8_t *buf, uint32_t cap);
bool     lk_proto_file_decode(const uint8_t *buf, uint32_t len, lk_file_msg *m);

/* The ranges a worker with this slice is sent: lk_model_slice_bytes plus the
 * bytes the model identity samples (lk_cluster_model_id_ranges). */
lk_status lk_proto_slice_ranges(const lk_gguf *g, const lk_slice *s, lk_ranges *out, char *err, size_t errlen);
/* The identity's bytes: header and tensor index, first/last 4 KiB of each tensor. */
void lk_cluster_model_id_ranges(const lk_gguf *g, lk_ranges *out);
/* BLAKE2b-256 of the file size and the (offset, length) list. */
void lk_proto_ranges_hash(const lk_ranges *l, uint64_t size, uint8_t out[32]);
/* The digest of the bytes sent: BLAKE2b-256 of a label, the file size, then
 * the bytes of every range in order (FILE_END; the worker's .meta). */
void lk_proto_digest_init(crypto_generichash_state *st, uint64_t size);
/* The same over a whole file (the worker's cache check). */
void lk_proto_digest_file(const lk_gguf *g, const lk_ranges *l, uint8_t out[32]);

#endif
