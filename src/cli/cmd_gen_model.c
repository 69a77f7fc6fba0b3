/* lockstep gen-model — a random-weight GGUF with the exact tensor names,
 * shapes and metadata of a real model, for benchmarks and cluster tests
 * without downloading tens of gigabytes.
 *
 * The file is streamed: tensors are produced a chunk of rows at a time by a
 * few threads (each row's values depend only on the seed, the tensor's name
 * and the row index, so the result does not depend on the thread count or on
 * --layers for the layers that remain), quantised with lk_quantize_row and
 * appended with the gguf writer. Memory use is a few chunk buffers. */
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "quant/quant.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- shapes ---------------------------------------------------------------- */

/* DeepSeek-V3's additions (deepseek2): multi-head latent attention, shared
 * experts, leading dense layers, group-limited sigmoid routing, YaRN. */
typedef struct {
    int64_t q_lora, kv_lora, qk_nope, qk_rope, v_head; /* v_head is also shape_t.head_dim */
    int64_t n_shared, n_dense_lead, n_group, n_group_used;
    float weights_scale, yarn_factor;
    uint32_t yarn_orig_ctx;
} mla_t;

/* Qwen3.5's hybrid layout (qwen35moe): gated delta net layers of nk key
 * heads and nv value heads (dk, dv), a conv of `conv` taps, every
 * interval-th layer gated full attention with rope_dim of head_dim rotated
 * (IMROPE sections), a sigmoid-gated shared expert of n_ff_shexp rows. */
typedef struct {
    int64_t nk, nv, dk, dv, conv, interval, rope_dim, n_ff_shexp;
    int32_t sections[4];
} hyb_t;
/* Gemma 3's additions (gemma3): sliding-window layers (llama.cpp's default
 * pattern: 5 local, 1 global; no pattern key, as real files), the local
 * layers' RoPE base, linear scaling on the global ones; post-norms and
 * per-head q/k norms are implied by the architecture. */
typedef struct {
    uint32_t window;
    float rope_base_swa, rope_scale;
} gemma_t;

typedef struct {
    const char *name, *arch;
    int64_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab;
    uint32_t n_ctx;
    float rope_base, eps;
    bool tied, qk_norm; /* tied: no output.weight; qk_norm: per-head RMS norms on Q and K (qwen3) */
    /* mixture of experts (qwen3moe): every layer routes to n_expert_used of
     * n_expert experts of n_ff_exp rows; n_ff is then only the metadata key
     * real files carry (the dense intermediate_size), no tensor uses it */
    int64_t n_expert, n_expert_used, n_ff_exp;
    const mla_t *mla;   /* deepseek2 only */
    const hyb_t *hyb;   /* qwen35moe only */
    const gemma_t *gemma; /* gemma3 only */
} shape_t;

/* DeepSeek-V3 (config.json: q_lora_rank 1536, kv_lora_rank 512,
 * qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, 1 shared
 * expert, first_k_dense_replace 3, n_group 8, topk_group 4,
 * routed_scaling_factor 2.5, rope_scaling yarn factor 40 over 4096,
 * mscale_all_dim 1); the tiny one has the synth file's ratios with rows
 * that stay whole blocks of every type where they can. */
static const mla_t k_dsv3 = {1536, 512, 128, 64, 128, 1, 3, 8, 4, 2.5f, 40.0f, 4096};
static const mla_t k_ds_tiny = {256, 128, 64, 32, 64, 2, 1, 4, 2, 2.827f, 8.0f, 64};
/* Qwen3.5-397B-A17B (config.json text_config: linear_num_key_heads 16,
 * linear_num_value_heads 64, linear key/value head dims 128,
 * linear_conv_kernel_dim 4, full_attention_interval 4, partial_rotary_factor
 * 0.25 of head_dim 256, mrope_section [11, 11, 10],
 * shared_expert_intermediate_size 1024). */
static const hyb_t k_q35 = {16, 64, 128, 128, 4, 4, 64, 1024, {11, 11, 10, 0}};
/* ... and at the synth file's size (tests: the layout without the bool array) */
static const hyb_t k_q35_tiny = {2, 4, 32, 32, 4, 4, 16, 128, {3, 3, 2, 0}};
/* Gemma 3 4B/12B/27B (config.json: sliding_window 1024, rope_local_base_freq
 * 10000, rope_scaling linear factor 8) */
static const gemma_t k_gemma3 = {1024, 10000.0f, 8.0f};

/* Published hyper-parameters of each model (config.json of the originals). */
static const shape_t k_shapes[] = {
    {"tiny", "llama", 256, 2, 8, 2, 32, 768, 512, 2048, 10000.0f, 1e-5f, false, false, 0, 0, 0, NULL, NULL, NULL},
    {"tinyllama-1.1b", "llama", 2048, 22, 32, 4, 64, 5632, 32000, 2048, 10000.0f, 1e-5f, false, false, 0, 0, 0, NULL, NULL, NULL},
    {"llama3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 128256, 131072, 500000.0f, 1e-5f, true, false, 0, 0, 0, NULL, NULL, NULL},
    {"llama3-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, 8192, 500000.0f, 1e-5f, false, false, 0, 0, 0, NULL, NULL, NULL},
    {"llama3-70b", "llama", 8192, 80, 64, 8, 128, 28672, 128256, 8192, 500000.0f, 1e-5f, false, false, 0, 0, 0, NULL, NULL, NULL},
    {"qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 40960, 1e6f, 1e-6f, true, true, 0, 0, 0, NULL, NULL, NULL},
    {"qwen3-8b", "qwen3", 4096, 36, 32, 8, 128, 12288, 151936, 40960, 1e6f, 1e-6f, false, true, 0, 0, 0, NULL, NULL, NULL},
    {"qwen3-30b-a3b", "qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, 40960, 1e6f, 1e-6f, false, true, 128, 8, 768, NULL, NULL, NULL},
    {"deepseek-v3", "deepseek2", 7168, 61, 128, 1, 128, 18432, 129280, 163840, 10000.0f, 1e-6f, false, false, 256, 8, 2048, &k_dsv3, NULL, NULL},
    {"deepseek2-tiny", "deepseek2", 256, 3, 4, 1, 64, 512, 512, 512, 10000.0f, 1e-6f, false, false, 8, 2, 256, &k_ds_tiny, NULL, NULL},
    {"qwen3.5-397b-a17b", "qwen35moe", 4096, 60, 32, 2, 256, 0, 248320, 262144, 1e7f, 1e-6f, false, true, 512, 10, 1024, NULL, &k_q35, NULL},
    {"qwen3.5-tiny", "qwen35moe", 256, 4, 4, 2, 64, 0, 512, 512, 1e7f, 1e-6f, false, true, 8, 2, 128, NULL, &k_q35_tiny, NULL},
    {"qwen3.5-dense-tiny", "qwen35", 256, 4, 4, 2, 64, 512, 512, 512, 1e7f, 1e-6f, false, true, 0, 0, 0, NULL, &k_q35_tiny, NULL},
    /* Gemma 3 27B: query_pre_attn_scalar 168 = n_embd / n_head, which
     * llama.cpp applies to the 62-layer model by itself (no key) */
    {"gemma-3-27b", "gemma3", 5376, 62, 32, 16, 128, 21504, 262144, 131072, 1e6f, 1e-6f, true, true, 0, 0, 0, NULL, NULL, &k_gemma3},
};
enum { N_SHAPES = sizeof k_shapes / sizeof k_shapes[0] };

typedef struct {
    char     name[64];
    uint32_t type;
    int      n_dims;
    uint64_t ne[3];   /* [in, out, experts] (ne[2] = 1 unless 3-D) */
    bool     norm;    /* 1-D scale vector: values near 1 */
    bool     neg;     /* ... near -1 (qwen35moe's ssm_a: a decay rate, negative) */
    uint64_t hash;    /* of the name: seeds the rows */
} gtensor;

static uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Tensor list in llama.cpp's names and [in, out] dims. 2-D weights get `wtype`
 * (F16 if a row is not whole blocks of it); 1-D tensors are F32. */
static int64_t build_tensors(const shape_t *s, uint32_t wtype, gtensor *out) {
    int64_t n = 0;
    int64_t q = s->n_head * s->head_dim, kv = s->n_head_kv * s->head_dim;
#define ADD2(nm, in, o)                                                                   \
    do {                                                                                  \
        gtensor *t = &out[n++];                                                           \
        snprintf(t->name, sizeof t->name, "%s", nm);                                     \
        t->n_dims = 2, t->ne[0] = (uint64_t)(in), t->ne[1] = (uint64_t)(o), t->ne[2] = 1, t->norm = false; \
        t->type = (uint64_t)(in) % (uint64_t)lk_type_block_size(wtype) ? LK_TYPE_F16 : wtype; \
    } while (0)
#define ADD3(nm, in, o, ne2)                                                              \
    do {                                                                                  \
        ADD2(nm, in, o);                                                                  \
        out[n - 1].n_dims = 3, out[n - 1].ne[2] = (uint64_t)(ne2);                        \
    } while (0)
#define ADD1(nm, len)                                                                     \
    do {                                                                                  \
        gtensor *t = &out[n++];                                                           \
        snprintf(t->name, sizeof t->name, "%s", nm);                                     \
        t->n_dims = 1, t->ne[0] = (uint64_t)(len), t->ne[1] = 1, t->ne[2] = 1, t->norm = true, t->neg = false; \
        t->type = LK_TYPE_F32;                                                            \
    } while (0)
    ADD2("token_embd.weight", s->n_embd, s->n_vocab);
    char nm[64];
    for (int64_t l = 0; l < s->n_layer; l++) {
#define NM(suffix) (snprintf(nm, sizeof nm, "blk.%" PRId64 "." suffix, l), nm)
        ADD1(NM("attn_norm.weight"), s->n_embd);
        const mla_t *x = s->mla;
        const hyb_t *y = s->hyb;
        if (y && (l + 1) % y->interval) { /* a gated delta net layer (llama.cpp's names, [in, out]) */
            const int64_t C = 2 * y->nk * y->dk + y->nv * y->dv, vd = y->nv * y->dv;
            ADD2(NM("attn_qkv.weight"), s->n_embd, C);
            ADD2(NM("attn_gate.weight"), s->n_embd, vd);
            ADD2(NM("ssm_conv1d.weight"), y->conv, C);
            out[n - 1].type = LK_TYPE_F32; /* llama-quantize never quantises it */
            ADD1(NM("ssm_dt.bias"), y->nv);
            ADD1(NM("ssm_a"), y->nv);
            out[n - 1].neg = true;
            ADD2(NM("ssm_beta.weight"), s->n_embd, y->nv);
            ADD2(NM("ssm_alpha.weight"), s->n_embd, y->nv);
            ADD1(NM("ssm_norm.weight"), y->dv);
            ADD2(NM("ssm_out.weight"), vd, s->n_embd);
        } else if (y) { /* gated attention: per head [q | gate] */
            ADD2(NM("attn_q.weight"), s->n_embd, 2 * q);
            ADD2(NM("attn_k.weight"), s->n_embd, kv);
            ADD2(NM("attn_v.weight"), s->n_embd, kv);
            ADD1(NM("attn_q_norm.weight"), s->head_dim);
            ADD1(NM("attn_k_norm.weight"), s->head_dim);
            ADD2(NM("attn_output.weight"), q, s->n_embd);
        } else if (x) {
            ADD2(NM("attn_q_a.weight"), s->n_embd, x->q_lora);
            ADD1(NM("attn_q_a_norm.weight"), x->q_lora);
            ADD2(NM("attn_q_b.weight"), x->q_lora, s->n_head * (x->qk_nope + x->qk_rope));
            ADD2(NM("attn_kv_a_mqa.weight"), s->n_embd, x->kv_lora + x->qk_rope);
            ADD1(NM("attn_kv_a_norm.weight"), x->kv_lora);
            ADD3(NM("attn_k_b.weight"), x->qk_nope, x->kv_lora, s->n_head);
            ADD3(NM("attn_v_b.weight"), x->kv_lora, x->v_head, s->n_head);
        } else {
            ADD2(NM("attn_q.weight"), s->n_embd, q);
            ADD2(NM("attn_k.weight"), s->n_embd, kv);
            ADD2(NM("attn_v.weight"), s->n_embd, kv);
        }
        if (!y) ADD2(NM("attn_output.weight"), q, s->n_embd);
        if (s->qk_norm && !y) {
            ADD1(NM("attn_q_norm.weight"), s->head_dim);
            ADD1(NM("attn_k_norm.weight"), s->head_dim);
        }
        if (y) ADD1(NM("post_attention_norm.weight"), s->n_embd); /* qwen35moe's pre-FFN norm */
        else ADD1(NM("ffn_norm.weight"), s->n_embd);
        if (s->gemma) ADD1(NM("post_attention_norm.weight"), s->n_embd); /* Gemma's post-norm (order as the converter's) */
        if (s->n_expert && (!x || l >= x->n_dense_lead)) {
            /* the router stays F32, as llama-quantize leaves it */
            ADD2(NM("ffn_gate_inp.weight"), s->n_embd, s->n_expert);
            out[n - 1].type = LK_TYPE_F32;
            ADD3(NM("ffn_gate_exps.weight"), s->n_embd, s->n_ff_exp, s->n_expert);
            ADD3(NM("ffn_up_exps.weight"), s->n_embd, s->n_ff_exp, s->n_expert);
            ADD3(NM("ffn_down_exps.weight"), s->n_ff_exp, s->n_embd, s->n_expert);
            if (y) { /* one shared expert behind a per-token sigmoid gate (an F32 vector of weights) */
                ADD1(NM("ffn_gate_inp_shexp.weight"), s->n_embd);
                out[n - 1].norm = false;
                ADD2(NM("ffn_gate_shexp.weight"), s->n_embd, y->n_ff_shexp);
                ADD2(NM("ffn_up_shexp.weight"), s->n_embd, y->n_ff_shexp);
                ADD2(NM("ffn_down_shexp.weight"), y->n_ff_shexp, s->n_embd);
            }
            if (x) {
                ADD1(NM("exp_probs_b.bias"), s->n_expert); /* values near 1: a near-uniform selection bias */
                ADD2(NM("ffn_gate_shexp.weight"), s->n_embd, s->n_ff_exp * x->n_shared);
                ADD2(NM("ffn_up_shexp.weight"), s->n_embd, s->n_ff_exp * x->n_shared);
                ADD2(NM("ffn_down_shexp.weight"), s->n_ff_exp * x->n_shared, s->n_embd);
            }
        } else {
            ADD2(NM("ffn_gate.weight"), s->n_embd, s->n_ff);
            ADD2(NM("ffn_up.weight"), s->n_embd, s->n_ff);
            ADD2(NM("ffn_down.weight"), s->n_ff, s->n_embd);
        }
        if (s->gemma) ADD1(NM("post_ffw_norm.weight"), s->n_embd);
#undef NM
    }
    ADD1("output_norm.weight", s->n_embd);
    if (!s->tied) ADD2("output.weight", s->n_embd, s->n_vocab);
#undef ADD1
#undef ADD2
#undef ADD3
    for (int64_t i = 0; i < n; i++) out[i].hash = fnv1a(out[i].name);
    return n;
}

/* ---- random values --------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct { uint64_t s[4]; } rng_t; /* xoshiro256+ : fast, plenty for weights */

static void rng_seed(rng_t *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}
static inline uint64_t rng_next(rng_t *r) {
    uint64_t *s = r->s, res = s[0] + s[3], t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t;
    s[3] = (s[3] << 45) | (s[3] >> 19);
    return res;
}

/* One row of values: weights ~ N(0, 0.02) approximated by the sum of four
 * 16-bit uniforms (Irwin-Hall, variance 4/12 of the unit), norms 1 +- 0.05.
 * Small, zero-mean weights and unit norms keep activations in a sane range
 * through any number of layers, like an initialised (untrained) model. */
static void gen_row(const gtensor *t, uint64_t seed, uint64_t row, float *dst) {
    rng_t r;
    rng_seed(&r, seed ^ t->hash ^ (row * 0xd1b54a32d192ed03ull));
    int64_t n = (int64_t)t->ne[0];
    if (t->norm) {
        for (int64_t i = 0; i < n; i++) dst[i] = 1.0f + 0.1f * ((float)(rng_next(&r) >> 40) * (1.0f / 16777216.0f) - 0.5f);
        if (t->neg)
            for (int64_t i = 0; i < n; i++) dst[i] = -dst[i];
        return;
    }
    const float scale = 0.02f * 1.7320508f / 65536.0f; /* sigma * sqrt(3) / unit */
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = rng_next(&r);
        int32_t sum = (int32_t)(v & 0xffff) + (int32_t)((v >> 16) & 0xffff) + (int32_t)((v >> 32) & 0xffff) +
                      (int32_t)(v >> 48) - 2 * 65535;
        dst[i] = (float)sum * scale;
    }
}

/* ---- parallel chunk generation ------------------------------------------------ */

typedef struct {
    const gtensor *t;
    uint64_t seed, row0, row1;
    size_t   row_bytes;
    uint8_t *out;      /* (row1 - row0) * row_bytes */
    float   *scratch;  /* (ne[0]) */
} job_t;

static void *run_job(void *arg) {
    job_t *j = arg;
    for (uint64_t r = j->row0; r < j->row1; r++) {
        uint8_t *dst = j->out + (r - j->row0) * j->row_bytes;
        if (j->t->type == LK_TYPE_F32) {
            gen_row(j->t, j->seed, r, (float *)(void *)dst);
        } else {
            gen_row(j->t, j->seed, r, j->scratch);
            lk_quantize_row((lk_type)j->t->type, j->scratch, dst, (int64_t)j->t->ne[0]);
        }
    }
    return NULL;
}

/* ---- vocabulary ----------------------------------------------------------------- */

/* A SentencePiece ("llama") vocabulary of n tokens: <unk> <s> </s>, the 256
 * byte tokens, then distinct pronounceable pieces ("▁ka", "ro", "▁kiru"...),
 * word-initial and continuation forms alternating, scores descending, so that
 * random-weight output decodes to readable-ish text. */
static void set_synthetic_vocab(lk_gguf_writer *w, int64_t n) {
    static const char cons[] = "bdfghklmnprstvwz", vow[] = "aeiou";
    enum { NSYL = 16 * 5 };
    char **tok = lk_xmalloc((size_t)n * sizeof *tok);
    float *score = lk_xmalloc((size_t)n * sizeof *score);
    int32_t *type = lk_xmalloc((size_t)n * sizeof *type);
    /* pieces are at most 3 bytes of "▁" + 2 per syllable x 4 syllables + NUL */
    char *pool = lk_xmalloc((size_t)n * 16), *p = pool;
    for (int64_t i = 0; i < n; i++) {
        tok[i] = p;
        if (i == 0) strcpy(p, "<unk>");
        else if (i == 1) strcpy(p, "<s>");
        else if (i == 2) strcpy(p, "</s>");
        else if (i < 259) sprintf(p, "<0x%02X>", (unsigned)(i - 3));
        else {
            int64_t k = i - 259, w2 = k / 2; /* even k: word-initial "▁..." */
            char *q = p;
            if (!(k & 1)) { memcpy(q, "\xe2\x96\x81", 3); q += 3; }
            /* bijective base-NSYL numeral of w2: distinct w2 -> distinct strings */
            char syl[8][2];
            int ns = 0;
            int64_t x = w2 + 1;
            while (x > 0 && ns < 8) {
                int64_t d = (x - 1) % NSYL;
                syl[ns][0] = cons[d / 5];
                syl[ns][1] = vow[d % 5];
                ns++;
                x = (x - 1) / NSYL;
            }
            for (int s = ns - 1; s >= 0; s--) { *q++ = syl[s][0]; *q++ = syl[s][1]; }
            *q = 0;
        }
        p += strlen(p) + 1;
        score[i] = i < 259 ? 0.0f : -(float)(i - 259);
        type[i] = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1; /* UNKNOWN, CONTROL, BYTE, NORMAL */
    }
    lk_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    lk_gguf_writer_set_str(w, "tokenizer.ggml.pre", "default");
    lk_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tok, (uint64_t)n);
    lk_gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", score, (uint64_t)n);
    lk_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", type, (uint64_t)n);
    lk_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    lk_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    lk_gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    lk_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true);
    lk_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false);
    free(tok);
    free(score);
    free(type);
    free(pool);
}

/* ---- command ---------------------------------------------------------------------- */

static void list_shapes(FILE *f) {
    fprintf(f, "shapes:\n");
    for (int i = 0; i < N_SHAPES; i++) {
        const shape_t *s = &k_shapes[i];
        fprintf(f, "  %-15s %-8s n_embd %5" PRId64 ", %2" PRId64 " layers, %2" PRId64 "/%" PRId64 " heads, n_ff %5" PRId64
                ", vocab %6" PRId64 "%s", s->name, s->arch, s->n_embd, s->n_layer, s->n_head, s->n_head_kv,
                s->n_expert ? s->n_ff_exp : s->n_ff, s->n_vocab, s->tied ? ", tied" : "");
        if (s->n_expert) fprintf(f, ", %" PRId64 " of %" PRId64 " experts", s->n_expert_used, s->n_expert);
        if (s->gemma) fprintf(f, ", window %u on 5 of 6 layers", s->gemma->window);
        fprintf(f, "\n");
    }
}

static uint32_t file_type_of(uint32_t t) {
    switch (t) {
    case LK_TYPE_F32: return 0;  /* LLAMA_FTYPE_ALL_F32 */
    case LK_TYPE_F16: return 1;  /* MOSTLY_F16 */
    case LK_TYPE_Q4_0: return 2; /* MOSTLY_Q4_0 */
    case LK_TYPE_Q8_0: return 7; /* MOSTLY_Q8_0 */
    case LK_TYPE_BF16: return 32; /* MOSTLY_BF16 */
    case LK_TYPE_Q4_K: return 14; /* MOSTLY_Q4_K_S: every 2-D weight Q4_K */
    }
    return 0;
}

int lk_cmd_gen_model(int argc, char **argv) {
    const char *shape_name = NULL, *type_name = "q8_0", *out = NULL, *vocab = NULL;
    int64_t layers = 0, seed = 1, threads = -1;
    bool list = false, quiet = false;
    const lk_opt opts[] = {
        {"--shape", NULL, LK_OPT_STR, &shape_name, "NAME", "model shape (see --list)"},
        {"--type", NULL, LK_OPT_STR, &type_name, "TYPE", "f32, f16, bf16, q8_0 (default), q4_0 or q4_k for 2-D weights"},
        {"--output", "-o", LK_OPT_STR, &out, "FILE", "GGUF file to write"},
        {"--layers", NULL, LK_OPT_INT, &layers, "N", "override the number of layers (quick runs of big shapes)"},
        {"--seed", NULL, LK_OPT_INT, &seed, "S", "random seed (default 1); same seed, same file"},
        {"--vocab", NULL, LK_OPT_STR, &vocab, "GGUF", "copy the tokenizer.* keys of this file (and its vocab size)"},
        {"--threads", "-t", LK_OPT_INT, &threads, "N", "generator threads (default: the CPUs this process may run on, at most 16)"},
        {"--quiet", "-q", LK_OPT_FLAG, &quiet, NULL, "no progress line"},
        {"--list", NULL, LK_OPT_FLAG, &list, NULL, "list the shapes and exit"},
        {0},
    };
    const char *syn = "--shape NAME -o FILE [--type f32|f16|bf16|q8_0|q4_0|q4_k] [--layers N] [--seed S] [--vocab GGUF]";
    int np = lk_args_parse("gen-model", syn, opts, argc, argv, NULL, 0);
    if (np == LK_ARGS_VERSION) return 0;
    if (np == LK_ARGS_HELP) { list_shapes(stdout); return 0; }
    if (np < 0) return 2;
    if (list) { list_shapes(stdout); return 0; }
    const shape_t *sp = NULL;
    for (int i = 0; shape_name && i < N_SHAPES; i++)
        if (!strcmp(k_shapes[i].name, shape_name)) sp = &k_shapes[i];
    if (!sp) {
        if (shape_name) fprintf(stderr, "lockstep gen-model: unknown shape '%s'\n", shape_name);
        else fprintf(stderr, "lockstep gen-model: --shape is required\n");
        list_shapes(stderr);
        return 2;
    }
    lk_type wtype;
    if (!lk_type_from_name(type_name, &wtype) ||
        (wtype != LK_TYPE_F32 && wtype != LK_TYPE_F16 && wtype != LK_TYPE_BF16 && wtype != LK_TYPE_Q8_0 &&
         wtype != LK_TYPE_Q4_0 && wtype != LK_TYPE_Q4_K)) {
        fprintf(stderr, "lockstep gen-model: --type must be f32, f16, bf16, q8_0, q4_0 or q4_k (got '%s')\n", type_name);
        return 2;
    }
    if (!out) {
        fprintf(stderr, "lockstep gen-model: -o FILE is required\n");
        return 2;
    }
    if (layers < 0 || layers > 1000) {
        fprintf(stderr, "lockstep gen-model: --layers must be 1..1000 (got %" PRId64 ")\n", layers);
        return 2;
    }
    if (threads == 0 || threads < -1 || threads > 256) {
        fprintf(stderr, "lockstep gen-model: --threads %" PRId64 " is out of range: 1 to 256 (leave it out for the default)\n", threads);
        return 2;
    }
    const bool threads_given = threads > 0;
    if (!threads_given) threads = LK_MIN(lk_cpus_usable(), 16);
    fprintf(stderr, "lockstep gen-model: %" PRId64 " thread%s (%s)\n", threads, threads > 1 ? "s" : "",
            threads_given ? "-t" : "default: the CPUs this process may run on, at most 16");
    shape_t s = *sp;
    if (layers) s.n_layer = layers;

    char err[LK_ERRLEN];
    lk_gguf *vg = NULL;
    if (vocab) {
        if (lk_gguf_open(vocab, &vg, err, sizeof err) != LK_OK) {
            fprintf(stderr, "lockstep gen-model: --vocab: %s\n", err);
            return 1;
        }
        uint64_t nv = 0;
        lk_gguf_vtype et;
        if (!lk_gguf_get_arr(vg, "tokenizer.ggml.tokens", &et, &nv) || et != LK_GGUF_STRING || nv == 0 ||
            nv > (1u << 24)) {
            fprintf(stderr, "lockstep gen-model: --vocab %s has no usable tokenizer.ggml.tokens array\n", vocab);
            lk_gguf_close(vg);
            return 1;
        }
        s.n_vocab = (int64_t)nv;
    }

    lk_gguf_writer *w = NULL;
    if (lk_gguf_writer_open(out, &w, err, sizeof err) != LK_OK) {
        fprintf(stderr, "lockstep gen-model: %s\n", err);
        lk_gguf_close(vg);
        return 1;
    }
    char key[128];
#define AK(suffix) (snprintf(key, sizeof key, "%s." suffix, s.arch), key)
    lk_gguf_writer_set_str(w, "general.architecture", s.arch);
    char gname[160];
    snprintf(gname, sizeof gname, "%s (random weights, seed %" PRId64 ")", s.name, seed);
    lk_gguf_writer_set_str(w, "general.name", gname);
    lk_gguf_writer_set_u32(w, AK("context_length"), s.n_ctx);
    lk_gguf_writer_set_u32(w, AK("embedding_length"), (uint32_t)s.n_embd);
    lk_gguf_writer_set_u32(w, AK("block_count"), (uint32_t)s.n_layer);
    lk_gguf_writer_set_u32(w, AK("feed_forward_length"), (uint32_t)s.n_ff);
    lk_gguf_writer_set_u32(w, AK("attention.head_count"), (uint32_t)s.n_head);
    lk_gguf_writer_set_u32(w, AK("attention.head_count_kv"), (uint32_t)s.n_head_kv);
    const mla_t *x = s.mla;
    if (x) {
        /* as convert_hf_to_gguf.py writes DeepseekV3ForCausalLM: key/value
         * lengths of the latent cache, the per-head ones in *_mla */
        lk_gguf_writer_set_u32(w, AK("attention.key_length"), (uint32_t)(x->kv_lora + x->qk_rope));
        lk_gguf_writer_set_u32(w, AK("attention.value_length"), (uint32_t)x->kv_lora);
        lk_gguf_writer_set_u32(w, AK("attention.key_length_mla"), (uint32_t)(x->qk_nope + x->qk_rope));
        lk_gguf_writer_set_u32(w, AK("attention.value_length_mla"), (uint32_t)x->v_head);
        lk_gguf_writer_set_u32(w, AK("attention.q_lora_rank"), (uint32_t)x->q_lora);
        lk_gguf_writer_set_u32(w, AK("attention.kv_lora_rank"), (uint32_t)x->kv_lora);
        lk_gguf_writer_set_u32(w, AK("leading_dense_block_count"), (uint32_t)LK_MIN(x->n_dense_lead, s.n_layer));
        lk_gguf_writer_set_u32(w, AK("expert_shared_count"), (uint32_t)x->n_shared);
        lk_gguf_writer_set_u32(w, AK("expert_group_count"), (uint32_t)x->n_group);
        lk_gguf_writer_set_u32(w, AK("expert_group_used_count"), (uint32_t)x->n_group_used);
        lk_gguf_writer_set_u32(w, AK("expert_gating_func"), 2); /* sigmoid */
        lk_gguf_writer_set_f32(w, AK("expert_weights_scale"), x->weights_scale);
        lk_gguf_writer_set_bool(w, AK("expert_weights_norm"), true);
        lk_gguf_writer_set_str(w, AK("rope.scaling.type"), "yarn");
        lk_gguf_writer_set_f32(w, AK("rope.scaling.factor"), x->yarn_factor);
        lk_gguf_writer_set_u32(w, AK("rope.scaling.original_context_length"), x->yarn_orig_ctx);
        lk_gguf_writer_set_f32(w, AK("rope.scaling.yarn_beta_fast"), 32.0f);
        lk_gguf_writer_set_f32(w, AK("rope.scaling.yarn_beta_slow"), 1.0f);
        lk_gguf_writer_set_f32(w, AK("rope.scaling.yarn_log_multiplier"), 0.1f); /* 0.1 x mscale_all_dim */
    } else if (s.head_dim * s.n_head != s.n_embd || s.qk_norm) {
        lk_gguf_writer_set_u32(w, AK("attention.key_length"), (uint32_t)s.head_dim);
        lk_gguf_writer_set_u32(w, AK("attention.value_length"), (uint32_t)s.head_dim);
    }
    if (s.gemma) {
        lk_gguf_writer_set_u32(w, AK("attention.sliding_window"), s.gemma->window);
        lk_gguf_writer_set_f32(w, AK("rope.freq_base_swa"), s.gemma->rope_base_swa);
        lk_gguf_writer_set_str(w, AK("rope.scaling.type"), "linear");
        lk_gguf_writer_set_f32(w, AK("rope.scaling.factor"), s.gemma->rope_scale);
    }
    lk_gguf_writer_set_f32(w, AK("attention.layer_norm_rms_epsilon"), s.eps);
    lk_gguf_writer_set_f32(w, AK("rope.freq_base"), s.rope_base);
    lk_gguf_writer_set_u32(w, AK("rope.dimension_count"), (uint32_t)(x ? x->qk_rope : s.hyb ? s.hyb->rope_dim : s.head_dim));
    const hyb_t *y = s.hyb;
    if (y) { /* as convert_hf_to_gguf.py writes Qwen3_5MoeForCausalLM (the interval, not the bool array) */
        lk_gguf_writer_set_arr_i32(w, AK("rope.dimension_sections"), y->sections, 4);
        if (s.n_expert) lk_gguf_writer_set_u32(w, AK("expert_shared_feed_forward_length"), (uint32_t)y->n_ff_shexp);
        lk_gguf_writer_set_u32(w, AK("ssm.conv_kernel"), (uint32_t)y->conv);
        lk_gguf_writer_set_u32(w, AK("ssm.state_size"), (uint32_t)y->dk);
        lk_gguf_writer_set_u32(w, AK("ssm.group_count"), (uint32_t)y->nk);
        lk_gguf_writer_set_u32(w, AK("ssm.time_step_rank"), (uint32_t)y->nv);
        lk_gguf_writer_set_u32(w, AK("ssm.inner_size"), (uint32_t)(y->nv * y->dv));
        lk_gguf_writer_set_u32(w, AK("full_attention_interval"), (uint32_t)y->interval);
    }
    lk_gguf_writer_set_u32(w, AK("vocab_size"), (uint32_t)s.n_vocab);
    if (s.n_expert) {
        lk_gguf_writer_set_u32(w, AK("expert_count"), (uint32_t)s.n_expert);
        lk_gguf_writer_set_u32(w, AK("expert_used_count"), (uint32_t)s.n_expert_used);
        lk_gguf_writer_set_u32(w, AK("expert_feed_forward_length"), (uint32_t)s.n_ff_exp);
    }
#undef AK
    lk_gguf_writer_set_u32(w, "general.file_type", file_type_of(wtype));
    lk_gguf_writer_set_u32(w, "general.quantization_version", 2);
    if (vg) {
        for (int64_t i = 0; i < lk_gguf_n_kv(vg); i++)
            if (!strncmp(lk_gguf_kv_key(vg, i), "tokenizer.", 10)) lk_gguf_writer_copy_kv(w, vg, i);
        lk_gguf_close(vg);
    } else {
        set_synthetic_vocab(w, s.n_vocab);
    }

    int64_t max_t = 4 + s.n_layer * 20;
    gtensor *ts = lk_xcalloc((size_t)max_t, sizeof *ts);
    int64_t nt = build_tensors(&s, wtype, ts);
    LK_ASSERT(nt <= max_t);
    uint64_t total = 0;
    for (int64_t i = 0; i < nt; i++) {
        lk_gguf_writer_add_tensor(w, ts[i].name, ts[i].type, ts[i].n_dims, ts[i].ne);
        size_t rb;
        LK_ASSERT(lk_type_row_bytes(ts[i].type, (int64_t)ts[i].ne[0], &rb));
        total += rb * ts[i].ne[1] * ts[i].ne[2];
    }
    lk_status st = lk_gguf_writer_begin_data(w, err, sizeof err);

    /* Chunks of about 16 MB of output, split across the threads, in a
     * two-stage pipeline: while the threads fill one buffer, this thread
     * writes the previous one, so generation and disk writes overlap. */
    enum { CHUNK = 16 << 20 };
    int nth = (int)threads;
    int64_t max_ne0 = 1;
    for (int64_t k = 0; k < nt; k++) max_ne0 = LK_MAX(max_ne0, (int64_t)ts[k].ne[0]);
    uint8_t *buf[2];
    for (int k = 0; k < 2; k++) buf[k] = lk_xmalloc_aligned(CHUNK + (size_t)max_ne0 * sizeof(float)); /* >= one row */
    float *scratch = lk_xmalloc_aligned((size_t)nth * (size_t)max_ne0 * sizeof(float));
    job_t *jobs = lk_xcalloc((size_t)nth, sizeof *jobs);
    pthread_t *tids = lk_xcalloc((size_t)nth, sizeof *tids);
    bool *running = lk_xcalloc((size_t)nth, sizeof *running);
    double t0 = lk_time_s(), last = 0;
    const bool tty = isatty(STDERR_FILENO);
    uint64_t done = 0, pending = 0; /* bytes of the previous chunk, waiting in buf[cur ^ 1] */
    int cur = 0;
    int64_t i = 0;
    uint64_t r0 = 0;
    while (!st) {
        /* start the next chunk (if any) on the threads */
        uint64_t produced = 0;
        if (i < nt) {
            const gtensor *t = &ts[i];
            size_t rb;
            lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb);
            const uint64_t rows = t->ne[1] * t->ne[2]; /* an expert tensor's slabs one after another */
            uint64_t r1 = LK_MIN(rows, r0 + LK_MAX(1, CHUNK / rb)), nr = r1 - r0;
            int use = (int)LK_MIN((uint64_t)nth, nr);
            for (int k = 0; k < use; k++) {
                uint64_t a = r0 + nr * (uint64_t)k / (uint64_t)use, b = r0 + nr * (uint64_t)(k + 1) / (uint64_t)use;
                jobs[k] = (job_t){t, (uint64_t)seed, a, b, rb, buf[cur] + (a - r0) * rb, scratch + (size_t)k * (size_t)max_ne0};
                running[k] = pthread_create(&tids[k], NULL, run_job, &jobs[k]) == 0;
                if (!running[k]) run_job(&jobs[k]); /* no thread: do it here */
            }
            for (int k = use; k < nth; k++) running[k] = false;
            produced = nr * rb;
            r0 = r1;
            if (r0 == rows) { i++; r0 = 0; }
        }
        /* meanwhile, write the previous chunk */
        if (pending) st = lk_gguf_writer_write(w, buf[cur ^ 1], pending, err, sizeof err);
        for (int k = 0; k < nth; k++)
            if (running[k]) { pthread_join(tids[k], NULL); running[k] = false; }
        done += pending;
        if (!produced) break;
        pending = produced;
        cur ^= 1;
        double now = lk_time_s();
        /* a terminal's line is rewritten 4 times a second; a log gets a line every 5 s */
        if (!quiet && now - last > (tty ? 0.25 : 5.0)) {
            last = now;
            fprintf(stderr, "%sgen-model %s: %5.1f%%  %8.1f / %.1f MB  %6.0f MB/s %s", tty ? "\r" : "", s.name,
                    100.0 * (double)done / (double)total, (double)done / 1e6, (double)total / 1e6,
                    (double)done / 1e6 / (now - t0 + 1e-9), tty ? "" : "\n");
        }
    }
    free(running);
    free(buf[1]);
    free(buf[0]);
    if (!quiet && tty && last > 0) fprintf(stderr, "\n"); /* end the progress line */
    free(scratch);
    free(jobs);
    free(tids);
    free(ts);
    if (st) {
        lk_gguf_writer_abort(w);
        fprintf(stderr, "lockstep gen-model: %s\n", err);
        return 1;
    }
    if ((st = lk_gguf_writer_close(w, err, sizeof err)) != LK_OK) {
        fprintf(stderr, "lockstep gen-model: %s\n", err);
        return 1;
    }
    double dt = lk_time_s() - t0;
    if (!quiet)
        fprintf(stderr, "wrote %s: %s %" PRId64 " layers, %" PRId64 " tensors, %.1f MB of weights in %.2f s (%.0f MB/s)\n",
                out, s.name, s.n_layer, nt, (double)total / 1e6, dt, (double)total / 1e6 / (dt + 1e-9));
    return 0;
}
