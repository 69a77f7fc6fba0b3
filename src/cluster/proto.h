/* proto — the payloads of the session messages (LOAD, LOADED, MESH, READY,
 * STEP, PING) shared by worker.c and head.c. Internal to the cluster part.
 * Decoders validate every field a peer sent and return false on anything
 * malformed; the caller then refuses with the message type named. */
#ifndef LK_CLUSTER_PROTO_H
#define LK_CLUSTER_PROTO_H

#include "cluster/cluster.h"

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

/* STEP: u32 n, pos0, n_cand, n_hist; f32 repeat, freq, presence penalties;
 * then n token ids and n_hist penalty-window ids. Header fixed at 28 bytes. */
#define LK_STEP_HDR 28
#define LK_STEP_MAX_TOKENS ((int)((1u << 20) - LK_STEP_HDR) / 4 - LK_CLUSTER_MAX_HIST)

#endif
