/* The forward pass over one rank's slice.
 *
 * Shapes (per rank; H = heads here, KV = KV heads here, hd = head_dim,
 * F = FFN rows here, B = n_batch, d = n_embd):
 *   Wq [H*hd, d]  Wk, Wv [KV*hd, d]  Wo [d, H*hd] (a column slice)
 *   W1, W3 [F, d] W2 [d, F] (a column slice)   Wout [vocab1-vocab0, d]
 * A slice of output rows is a pointer offset; a slice of input columns keeps
 * the full row stride and starts at a block boundary (the plan guarantees
 * block alignment), so single node and every rank use the same views.
 *
 * Weight memory: the matrices a rank multiplies are copied at load, each
 * compacted to its slice, into one anonymous arena backed by 2 MiB pages
 * (madvise MADV_HUGEPAGE), and the file pages they came from are dropped
 * from this process (MADV_DONTNEED), so memory is not doubled. Decode streams
 * every weight once per token; through 4 KiB file pages that cost a TLB miss
 * per 4 KiB and held TinyLlama Q4_0 decode at 81 % of the read bandwidth,
 * 95 % with huge pages (file mappings get none: FilePmdMapped stays 0).
 * Without transparent huge pages, or with LK_WEIGHTS=mmap, the views stay on
 * the file mapping. Norms, biases and the embedding table stay mapped (the
 * table's pages mapped in at load: map_file_pages). */
#include "model/model_impl.h"
#include "kernels/tune.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---------------------------------------------------------------- config */

static bool meta_i64(const lk_gguf *g, const char *arch, const char *suffix, int64_t *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return lk_gguf_get_i64(g, key, out);
}
static bool meta_f64(const lk_gguf *g, const char *arch, const char *suffix, double *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return lk_gguf_get_f64(g, key, out);
}

static lk_status need_i64(const lk_gguf *g, const char *arch, const char *suffix, int64_t lo, int64_t hi,
                          int64_t *out, char *err, size_t errlen) {
    if (!meta_i64(g, arch, suffix, out))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing metadata key %s.%s", lk_gguf_path(g), arch, suffix);
    if (*out < lo || *out > hi)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: metadata %s.%s = %lld is out of range [%lld, %lld]",
                       lk_gguf_path(g), arch, suffix, (long long)*out, (long long)lo, (long long)hi);
    return LK_OK;
}

/* Checks a tensor exists with shape [ne0, ne1] (ne1 = 0 for 1-D) and a type we compute with. */
static lk_status check_tensor(const lk_gguf *g, const char *name, int64_t ne0, int64_t ne1, bool f32_only,
                              const lk_gguf_tensor **out, char *err, size_t errlen) {
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, name);
    if (out) *out = t;
    if (!t) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing tensor '%s'", lk_gguf_path(g), name);
    int want_dims = ne1 ? 2 : 1;
    bool ok = (int64_t)t->ne[0] == ne0 && (ne1 ? (int64_t)t->ne[1] == ne1 && t->n_dims <= 2 : t->n_dims == 1);
    if (!ok)
        return lk_fail(err, errlen, LK_ERR_FORMAT,
                       "%s: tensor '%s' has shape [%llu, %llu] (%d dims), expected [%lld%s%lld] (%d dims)",
                       lk_gguf_path(g), name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], t->n_dims,
                       (long long)ne0, ne1 ? ", " : "", ne1 ? (long long)ne1 : 0LL, want_dims);
    if (f32_only && t->type != LK_TYPE_F32)
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s; lockstep expects f32 here",
                       lk_gguf_path(g), name, lk_type_name(t->type));
    if (!lk_type_supported(t->type))
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s, which lockstep cannot compute with yet",
                       lk_gguf_path(g), name, lk_type_name(t->type));
    return LK_OK;
}

/* The same for a 3-D expert tensor [ne0, ne1, ne2]: ne2 slabs of ne1 rows. */
static lk_status check_tensor3(const lk_gguf *g, const char *name, int64_t ne0, int64_t ne1, int64_t ne2,
                               char *err, size_t errlen) {
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, name);
    if (!t) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing tensor '%s'", lk_gguf_path(g), name);
    if (t->n_dims != 3 || (int64_t)t->ne[0] != ne0 || (int64_t)t->ne[1] != ne1 || (int64_t)t->ne[2] != ne2)
        return lk_fail(err, errlen, LK_ERR_FORMAT,
                       "%s: tensor '%s' has shape [%llu, %llu, %llu] (%d dims), expected [%lld, %lld, %lld]",
                       lk_gguf_path(g), name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                       (unsigned long long)t->ne[2], t->n_dims, (long long)ne0, (long long)ne1, (long long)ne2);
    if (!lk_type_supported(t->type))
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s, which lockstep cannot compute with yet",
                       lk_gguf_path(g), name, lk_type_name(t->type));
    return LK_OK;
}

/* deepseek2's attention: MLA with the split attn_k_b/attn_v_b tensors the
 * current converter writes (the *_mla keys say so; without them llama.cpp
 * expects the legacy unsplit attn_kv_b and runs plain attention). */
static lk_status read_mla(const lk_gguf *g, lk_model_config *c, char *err, size_t errlen) {
    const char *a = c->arch_name;
    int64_t v, rd;
    lk_status st;
    if (!meta_i64(g, a, "attention.key_length_mla", &v) || !meta_i64(g, a, "attention.value_length_mla", &rd))
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: a %s file without %s.attention.key_length_mla/"
                       "value_length_mla (the legacy unsplit attn_kv_b) is not supported; convert it again with a "
                       "current llama.cpp", lk_gguf_path(g), a, a);
    if (v < 2 || v > 4096 || rd < 2 || rd > 4096 || rd % 2)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: MLA key length %lld / value length %lld out of range",
                       lk_gguf_path(g), (long long)v, (long long)rd);
    c->k_head = (int)v;
    c->head_dim = (int)rd;
    if (!meta_i64(g, a, "attention.q_lora_rank", &v) || v == 0)
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: MLA without a query LoRA (DeepSeek-V2-Lite's attn_q) "
                       "is not supported", lk_gguf_path(g));
    if (v < 1 || v > (1 << 16))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.attention.q_lora_rank = %lld out of range", lk_gguf_path(g),
                       a, (long long)v);
    c->q_lora = (int)v;
    if ((st = need_i64(g, a, "attention.kv_lora_rank", 1, 1 << 16, &v, err, errlen))) return st;
    c->kv_lora = (int)v;
    if ((st = need_i64(g, a, "rope.dimension_count", 2, c->k_head - 1, &rd, err, errlen))) return st;
    if (rd % 2)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rope.dimension_count %lld must be even", lk_gguf_path(g),
                       (long long)rd);
    c->qk_nope = c->k_head - (int)rd;
    c->mla = true;
    c->n_head_kv = 1; /* the latent: one cache row per position, shared by every head */
    return LK_OK;
}

/* rope.scaling.*: none and linear with factor 1 anywhere; YaRN for deepseek2
 * (the only architecture whose YaRN attention factor lockstep knows). */
static lk_status read_rope_scaling(const lk_gguf *g, lk_model_config *c, char *err, size_t errlen) {
    const char *a = c->arch_name, *rs;
    size_t rslen;
    char key[160];
    double f;
    int64_t v;
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    const bool has = lk_gguf_get_str(g, key, &rs, &rslen);
    if (has && rslen == 4 && !memcmp(rs, "yarn", 4) && c->arch == LK_ARCH_DEEPSEEK2) {
        snprintf(key, sizeof key, "%s.rope.scaling.factor", a);
        if (!lk_gguf_get_f64(g, key, &f) || !(f >= 1 && f <= 1e6))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: YaRN needs %s.rope.scaling.factor >= 1", lk_gguf_path(g), a);
        c->yarn_factor = (float)f;
        if (!meta_i64(g, a, "rope.scaling.original_context_length", &v) || v < 1 || v > (1 << 24))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: YaRN needs %s.rope.scaling.original_context_length",
                           lk_gguf_path(g), a);
        c->yarn_orig_ctx = (int)v;
        c->yarn_beta_fast = meta_f64(g, a, "rope.scaling.yarn_beta_fast", &f) ? (float)f : 32.0f;
        c->yarn_beta_slow = meta_f64(g, a, "rope.scaling.yarn_beta_slow", &f) ? (float)f : 1.0f;
        c->yarn_log_mul = meta_f64(g, a, "rope.scaling.yarn_log_multiplier", &f) ? (float)f : 0.0f;
        if (!(c->yarn_beta_fast > 0 && c->yarn_beta_slow > 0 && c->yarn_log_mul >= 0 && c->yarn_log_mul < 100))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: YaRN beta_fast %g, beta_slow %g or log multiplier %g out "
                           "of range", lk_gguf_path(g), (double)c->yarn_beta_fast, (double)c->yarn_beta_slow,
                           (double)c->yarn_log_mul);
        /* Two YaRN keys a converter writes only when the HF config has them
         * (attention_factor/attn_factor, extrapolation_factor): llama.cpp
         * multiplies mscale (so kq_scale by its square) and the rotation by
         * the first, and mixes the angles by the second; lockstep computes
         * both as 1, so a file with other values is refused, not run wrong. */
        static const char *const ones[2] = { "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor" };
        for (int i = 0; i < 2; i++)
            if (meta_f64(g, a, ones[i], &f) && f != 1.0)
                return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: %s.%s = %g is not supported (only 1)",
                               lk_gguf_path(g), a, ones[i], f);
        c->rope_yarn = c->yarn_factor > 1;
        /* DeepSeek's attention factor: the converter stores 0.1 x
         * mscale_all_dim as the log multiplier, so mscale = 1 + 0.1 x
         * mscale_all_dim x ln(factor), and scores scale by mscale^2 (the
         * rotation itself is not rescaled: llama.cpp's attn_factor cancels
         * ggml's YaRN magnitude factor). Current llama.cpp computes
         * attn_factor_org x (1 + 0.1 x log_mul' x ln(factor)) after dividing
         * the stored multiplier by 0.1 at load ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX],
         * its PR 17945): the same value while attn_factor_org (the file's
         * yarn_attn_factor) is 1, which the check above makes sure of. */
        const float mscale = 1.0f + c->yarn_log_mul * logf(c->yarn_factor);
        c->kq_scale = mscale * mscale / sqrtf((float)c->k_head);
        return LK_OK;
    }
    if (has && !(rslen == 4 && !memcmp(rs, "none", 4)) && !(rslen == 6 && !memcmp(rs, "linear", 6))) {
        char ss[101];
        lk_str_sanitize(ss, sizeof ss, rs, rslen);
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: rope scaling type '%s' is not supported (none, linear%s)",
                       lk_gguf_path(g), ss, c->arch == LK_ARCH_DEEPSEEK2 ? ", yarn" : "; yarn only for deepseek2");
    }
    snprintf(key, sizeof key, "%s.rope.scaling.factor", a);
    /* a deepseek2 file with its YaRN switched off ("none") keeps its factor, unused */
    const bool none = has && rslen == 4 && !memcmp(rs, "none", 4);
    if (!(none && c->arch == LK_ARCH_DEEPSEEK2) && lk_gguf_get_f64(g, key, &f) && f != 1.0 && f != 0.0) {
        if (none)
            return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: rope scaling type none with factor %g is not "
                           "supported", lk_gguf_path(g), f);
        /* linear: positions divided by the factor (ggml's freq_scale), on
         * every layer but the sliding-window ones (lk_model_config) */
        if (!(f >= 1.0 / 1024 && f <= 1024))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rope scaling factor %g out of range", lk_gguf_path(g), f);
        c->rope_freq_scale = (float)(1.0 / f);
    }
    return LK_OK;
}

/* Gemma 3 (synth README "How llama.cpp computes gemma3"): the window and
 * which layers use it, the local layers' RoPE base, the embedding scale,
 * the attention scale (1/sqrt(key_length), but 1/sqrt(n_embd / n_head) for
 * the 62-layer 27B, as llama.cpp does), optional soft-capping. */
static lk_status read_gemma3(const lk_gguf *g, lk_model_config *c, char *err, size_t errlen) {
    const char *a = c->arch_name;
    int64_t v;
    double f;
    char key[160];
    c->post_norms = c->ffn_gelu = true;
    c->emb_scale = sqrtf((float)c->n_embd);
    c->kq_scale = c->n_layer == 62 ? 1.0f / sqrtf((float)(c->n_embd / c->n_head)) : 1.0f / sqrtf((float)c->head_dim);
    c->rope_base_swa = meta_f64(g, a, "rope.freq_base_swa", &f) ? (float)f : 10000.0f;
    if (!(c->rope_base_swa > 1))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rope.freq_base_swa %g out of range", lk_gguf_path(g),
                       (double)c->rope_base_swa);
    if (meta_f64(g, a, "attn_logit_softcapping", &f) && f != 0) {
        if (!(f > 0 && f < 1e6))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: attn_logit_softcapping %g out of range", lk_gguf_path(g), f);
        c->attn_softcap = (float)f;
    }
    if (meta_f64(g, a, "final_logit_softcapping", &f) && f != 0) {
        if (!(f > 0 && f < 1e6))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: final_logit_softcapping %g out of range", lk_gguf_path(g), f);
        c->logit_softcap = (float)f;
    }
    if (!meta_i64(g, a, "attention.sliding_window", &v) || v == 0) return LK_OK; /* every layer global */
    if (v < 1 || v > (1 << 24))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.attention.sliding_window = %lld out of range", lk_gguf_path(g),
                       a, (long long)v);
    c->swa_window = (int)v;
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
    lk_gguf_vtype et;
    uint64_t n;
    int64_t pattern = 6;
    if (lk_gguf_get_arr(g, key, &et, &n)) {
        if (et != LK_GGUF_BOOL || n != (uint64_t)c->n_layer)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s must be an int or %d bools", lk_gguf_path(g), key,
                           c->n_layer);
        const uint8_t *b = lk_gguf_arr_data(g, key); /* GGUF bools are one byte */
        for (int l = 0; l < c->n_layer; l++)
            if (b && b[l]) c->swa_bits[l / 64] |= 1ull << (l % 64);
        return LK_OK;
    }
    if (lk_gguf_get_i64(g, key, &pattern) && (pattern < 0 || pattern > c->n_layer + 1))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s = %lld out of range", lk_gguf_path(g), key, (long long)pattern);
    /* llama.cpp's set_swa_pattern: layer l local iff l % N < N - 1 (0: all local) */
    for (int l = 0; l < c->n_layer; l++)
        if (pattern == 0 || l % pattern < pattern - 1) c->swa_bits[l / 64] |= 1ull << (l % 64);
    return LK_OK;
}

/* glm4moe's and qwen35moe's pre-FFN norm is named post_attention_norm */
static const char *ffn_norm_name(const lk_model_config *c) {
    return c->arch == LK_ARCH_GLM4MOE || c->arch == LK_ARCH_QWEN35MOE || c->arch == LK_ARCH_QWEN35 ? "post_attention_norm.weight"
                                                                                                 : "ffn_norm.weight";
}

/* qwen35moe's hybrid layout (model.h): the delta net's sizes, which layers
 * are recurrent, and the rotary sections. */
static lk_status read_hybrid(const lk_gguf *g, lk_model_config *c, char *err, size_t errlen) {
    const char *a = c->arch_name;
    int64_t v, inner;
    lk_status st;
    char key[160];
    if ((st = need_i64(g, a, "ssm.conv_kernel", 1, 64, &v, err, errlen))) return st;
    c->ssm_conv = (int)v;
    if ((st = need_i64(g, a, "ssm.state_size", 1, 4096, &v, err, errlen))) return st;
    c->ssm_dk = (int)v;
    if ((st = need_i64(g, a, "ssm.group_count", 1, 4096, &v, err, errlen))) return st;
    c->ssm_nk = (int)v;
    if ((st = need_i64(g, a, "ssm.time_step_rank", 1, 4096, &v, err, errlen))) return st;
    c->ssm_nv = (int)v;
    if ((st = need_i64(g, a, "ssm.inner_size", 1, 1 << 20, &inner, err, errlen))) return st;
    if (c->ssm_nv % c->ssm_nk || inner % c->ssm_nv)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.ssm.time_step_rank %d (value heads) must be a multiple of "
                       "ssm.group_count %d (key heads) and divide ssm.inner_size %lld", lk_gguf_path(g), a, c->ssm_nv,
                       c->ssm_nk, (long long)inner);
    c->ssm_dv = (int)(inner / c->ssm_nv);
    /* the layer pattern: attention.recurrent_layers (bool per layer), else
     * every full_attention_interval-th layer is full attention */
    lk_gguf_vtype et;
    uint64_t n;
    snprintf(key, sizeof key, "%s.attention.recurrent_layers", a);
    memset(c->recurrent, 0, sizeof c->recurrent);
    if (lk_gguf_get_arr(g, key, &et, &n)) {
        if ((et != LK_GGUF_BOOL && et != LK_GGUF_INT8 && et != LK_GGUF_UINT8) || n != (uint64_t)c->n_layer_file)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s must be a bool array of %d layers (it has %llu elements "
                           "of type %d)", lk_gguf_path(g), key, c->n_layer_file, (unsigned long long)n, (int)et);
        const uint8_t *b = lk_gguf_arr_data(g, key);
        for (int l = 0; l < c->n_layer; l++)
            if (b[l]) c->recurrent[l / 64] |= 1ull << (l % 64);
    } else {
        if ((st = need_i64(g, a, "full_attention_interval", 1, 4096, &v, err, errlen))) return st;
        for (int l = 0; l < c->n_layer; l++)
            if ((l + 1) % v) c->recurrent[l / 64] |= 1ull << (l % 64);
    }
    for (int l = 0; l < c->n_layer; l++) c->n_recurrent += (int)(c->recurrent[l / 64] >> (l % 64) & 1);
    c->attn_gate = true;
    /* IMROPE with text positions (p, p, p, 0): a rotary pair whose sector
     * (pair index mod the sections' sum) falls in one of the first three
     * sections turns by p, one in the fourth by 0. lockstep feeds text
     * only, so it needs every pair in the first three: then this is NeoX
     * RoPE on the first rope_dim dims. Anything else is refused. */
    snprintf(key, sizeof key, "%s.rope.dimension_sections", a);
    if (lk_gguf_get_arr(g, key, &et, &n)) {
        int64_t sec[4] = {0};
        int64_t sum = 0;
        for (uint64_t i = 0; i < n && i < 4; i++) sec[i] = lk_gguf_arr_i64(g, key, i), sum += sec[i];
        for (int i = 0; i < 4; i++)
            if (sec[i] < 0 || sec[i] > 4096)
                return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s out of range", lk_gguf_path(g), key);
        for (int i = 0; i < c->rope_dim / 2; i++) {
            const int64_t s = sum ? i % sum : 0;
            const bool p = sum && ((s % 3 == 1 && s < 3 * sec[1]) || (s % 3 == 2 && s < 3 * sec[2]) ||
                                   (s % 3 == 0 && s < 3 * sec[0]));
            if (!p)
                return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: rope sections [%lld, %lld, %lld, %lld] leave rotary "
                               "pair %d to the fourth (non-text) position: multi-section positions are not supported",
                               lk_gguf_path(g), (long long)sec[0], (long long)sec[1], (long long)sec[2],
                               (long long)sec[3], i);
        }
    }
    return LK_OK;
}

lk_status lk_model_config_read(const lk_gguf *g, lk_model_config *c, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    const char *arch;
    size_t alen;
    if (!lk_gguf_get_str(g, "general.architecture", &arch, &alen))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing metadata key general.architecture", lk_gguf_path(g));
    if (alen >= sizeof c->arch_name) alen = sizeof c->arch_name - 1;
    memcpy(c->arch_name, arch, alen);
    c->arch_name[alen] = 0;
    if (!strcmp(c->arch_name, "llama") || !strcmp(c->arch_name, "mistral")) c->arch = LK_ARCH_LLAMA;
    else if (!strcmp(c->arch_name, "qwen2")) c->arch = LK_ARCH_QWEN2;
    else if (!strcmp(c->arch_name, "qwen3")) c->arch = LK_ARCH_QWEN3;
    else if (!strcmp(c->arch_name, "qwen3moe")) c->arch = LK_ARCH_QWEN3MOE;
    else if (!strcmp(c->arch_name, "glm4moe")) c->arch = LK_ARCH_GLM4MOE;
    else if (!strcmp(c->arch_name, "deepseek2")) c->arch = LK_ARCH_DEEPSEEK2;
    else if (!strcmp(c->arch_name, "qwen35moe")) c->arch = LK_ARCH_QWEN35MOE;
    else if (!strcmp(c->arch_name, "qwen35")) c->arch = LK_ARCH_QWEN35; /* the dense Qwen3.5: a SwiGLU FFN per layer */
    else if (!strcmp(c->arch_name, "gemma3")) c->arch = LK_ARCH_GEMMA3;
    else {
        char sa[101]; /* the file's bytes, escapes shown escaped */
        lk_str_sanitize(sa, sizeof sa, arch, alen);
        return lk_fail(err, errlen, LK_ERR_UNSUPPORTED,
                       "%s: architecture '%s' is not supported (supported: llama, mistral, qwen2, qwen3, qwen3moe, "
                       "glm4moe, deepseek2, qwen35, qwen35moe, gemma3)", lk_gguf_path(g), sa);
    }
    const bool moe = c->arch == LK_ARCH_QWEN3MOE || c->arch == LK_ARCH_GLM4MOE || c->arch == LK_ARCH_DEEPSEEK2 ||
                     c->arch == LK_ARCH_QWEN35MOE;
    const char *a = c->arch_name;
    int64_t v;
    double f;
    lk_status st;
    if ((st = need_i64(g, a, "embedding_length", 1, 1 << 20, &v, err, errlen))) return st;
    c->n_embd = (int)v;
    if ((st = need_i64(g, a, "block_count", 1, 4096, &v, err, errlen))) return st;
    c->n_layer = c->n_layer_file = (int)v;
    /* GLM-4.5's converter appends its NextN (multi-token prediction) block
     * to block_count; plain decoding runs only the blocks before it. */
    if (meta_i64(g, a, "nextn_predict_layers", &v) && v > 0) {
        if (v >= c->n_layer)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.nextn_predict_layers = %lld leaves no layers of %d",
                           lk_gguf_path(g), a, (long long)v, c->n_layer);
        c->n_layer -= (int)v;
    }
    if ((st = need_i64(g, a, "attention.head_count", 1, 4096, &v, err, errlen))) return st;
    c->n_head = (int)v;
    if (meta_i64(g, a, "attention.head_count_kv", &v)) {
        if (v < 1 || v > c->n_head || c->n_head % v)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.attention.head_count_kv = %lld does not divide head_count %d",
                           lk_gguf_path(g), a, (long long)v, c->n_head);
        c->n_head_kv = (int)v;
    } else c->n_head_kv = c->n_head;
    if (moe) {
        /* qwen3moe files carry the dense intermediate_size in
         * feed_forward_length although no layer uses it: experts are sized
         * by expert_feed_forward_length, as llama.cpp does. */
        if ((st = need_i64(g, a, "expert_count", 1, 4096, &v, err, errlen))) return st;
        c->n_expert = (int)v;
        if ((st = need_i64(g, a, "expert_used_count", 1, c->n_expert, &v, err, errlen))) return st;
        c->n_expert_used = (int)v;
        c->n_ff = meta_i64(g, a, "feed_forward_length", &v) && v > 0 && v <= (1 << 24) ? v : 0;
        if (meta_i64(g, a, "expert_feed_forward_length", &v)) {
            if (v < 1 || v > (1 << 24))
                return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.expert_feed_forward_length = %lld out of range",
                               lk_gguf_path(g), a, (long long)v);
            c->n_ff_exp = v;
        } else if (c->n_ff > 0) {
            c->n_ff_exp = c->n_ff / c->n_expert_used; /* llama.cpp's fallback */
        } else {
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing metadata key %s.expert_feed_forward_length",
                           lk_gguf_path(g), a);
        }
        if (meta_i64(g, a, "expert_shared_count", &v)) {
            if (v < 0 || v > 64)
                return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.expert_shared_count = %lld out of range",
                               lk_gguf_path(g), a, (long long)v);
            c->n_expert_shared = (int)v;
        }
        c->n_ff_shexp = c->n_ff_exp * c->n_expert_shared;
        if (c->arch == LK_ARCH_QWEN35MOE) {
            /* one shared expert, sized by its own key, behind a sigmoid gate */
            if ((st = need_i64(g, a, "expert_shared_feed_forward_length", 1, 1 << 24, &v, err, errlen))) return st;
            c->n_expert_shared = 1;
            c->n_ff_shexp = v;
            c->shexp_gate = true;
        }
        if (meta_i64(g, a, "leading_dense_block_count", &v)) {
            if (v < 0 || v > c->n_layer)
                return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.leading_dense_block_count = %lld out of range",
                               lk_gguf_path(g), a, (long long)v);
            c->n_dense_lead = (int)v;
        }
        if (c->n_dense_lead > 0 && c->n_ff < 1)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %d dense layers but no %s.feed_forward_length",
                           lk_gguf_path(g), c->n_dense_lead, a);
        if (c->arch == LK_ARCH_QWEN3MOE || c->arch == LK_ARCH_QWEN35MOE) {
            /* llama.cpp's qwen3moe/qwen35moe graphs: softmax, always normalised, no scale (no key switches these) */
            c->gating = LK_GATE_SOFTMAX;
            c->weights_norm = true;
            c->weights_scale = 0;
        } else {
            /* llama.cpp's defaults when the key is 0 or missing: sigmoid for
             * glm4moe, softmax for deepseek2 (DeepSeek-V2's gating) */
            c->gating = c->arch == LK_ARCH_DEEPSEEK2 ? LK_GATE_SOFTMAX : LK_GATE_SIGMOID;
            if (meta_i64(g, a, "expert_gating_func", &v) && v != 0) {
                if (v != LK_GATE_SOFTMAX && v != LK_GATE_SIGMOID)
                    return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: %s.expert_gating_func = %lld is not supported "
                                   "(1 softmax, 2 sigmoid)", lk_gguf_path(g), a, (long long)v);
                c->gating = (lk_gating)v;
            }
            bool b;
            char key[160];
            snprintf(key, sizeof key, "%s.expert_weights_norm", a);
            c->weights_norm = lk_gguf_get_bool(g, key, &b) && b;
            c->weights_scale = meta_f64(g, a, "expert_weights_scale", &f) ? (float)f : 0.0f;
            if (!(c->weights_scale >= 0 && c->weights_scale < 1e6))
                return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.expert_weights_scale %g out of range",
                               lk_gguf_path(g), a, (double)c->weights_scale);
            c->n_expert_group = c->n_group_used = 1;
            if (meta_i64(g, a, "expert_group_count", &v) && v > 1) {
                if (c->arch != LK_ARCH_DEEPSEEK2)
                    return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: group-limited routing (%s.expert_group_count = "
                                   "%lld) is not supported for %s", lk_gguf_path(g), a, (long long)v, a);
                /* a group scores its best two experts: groups of at least 2 */
                if (v > c->n_expert || c->n_expert % v || c->n_expert / v < 2)
                    return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.expert_group_count = %lld does not split %d "
                                   "experts into groups of 2 or more", lk_gguf_path(g), a, (long long)v, c->n_expert);
                c->n_expert_group = (int)v;
                if ((st = need_i64(g, a, "expert_group_used_count", 1, v, &v, err, errlen))) return st;
                c->n_group_used = (int)v;
                if ((int64_t)c->n_group_used * (c->n_expert / c->n_expert_group) < c->n_expert_used)
                    return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %d groups of %d experts leave fewer than the %d "
                                   "experts a token uses", lk_gguf_path(g), c->n_group_used,
                                   c->n_expert / c->n_expert_group, c->n_expert_used);
            }
        }
        c->n_ff_split = c->n_ff_exp;
    } else {
        if ((st = need_i64(g, a, "feed_forward_length", 1, 1 << 24, &v, err, errlen))) return st;
        c->n_ff = v;
        c->n_ff_split = v;
    }
    c->head_dim = c->n_embd / c->n_head;
    if (c->arch == LK_ARCH_DEEPSEEK2) {
        if ((st = read_mla(g, c, err, errlen))) return st;
    } else if (meta_i64(g, a, "attention.key_length", &v)) {
        int64_t vl = v;
        if (v < 1 || v > 4096) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.attention.key_length = %lld out of range", lk_gguf_path(g), a, (long long)v);
        if (meta_i64(g, a, "attention.value_length", &vl) && vl != v)
            return lk_fail(err, errlen, LK_ERR_UNSUPPORTED, "%s: key_length %lld != value_length %lld is not supported", lk_gguf_path(g), (long long)v, (long long)vl);
        c->head_dim = (int)v;
    }
    if (c->head_dim < 2 || c->head_dim % 2)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: head dimension %d must be even", lk_gguf_path(g), c->head_dim);
    c->n_ctx_train = meta_i64(g, a, "context_length", &v) && v > 0 && v < (1 << 24) ? (int)v : 2048;
    c->rms_eps = meta_f64(g, a, "attention.layer_norm_rms_epsilon", &f) ? (float)f : 1e-5f;
    if (!(c->rms_eps > 0 && c->rms_eps < 1))
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rms epsilon %g out of range", lk_gguf_path(g), (double)c->rms_eps);
    c->rope_base = meta_f64(g, a, "rope.freq_base", &f) ? (float)f : 10000.0f;
    if (!(c->rope_base > 1)) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rope.freq_base %g out of range", lk_gguf_path(g), (double)c->rope_base);
    if (c->mla) {
        /* RoPE turns the rope part of the key (k_pe) and of each query head */
        if (!meta_i64(g, a, "rope.dimension_count", &v) || v != c->k_head - c->qk_nope)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s.rope.dimension_count must be the %d rope dims of "
                           "key_length_mla %d", lk_gguf_path(g), a, c->k_head - c->qk_nope, c->k_head);
        c->rope_dim = (int)v;
    } else {
        c->rope_dim = meta_i64(g, a, "rope.dimension_count", &v) ? (int)v : c->head_dim;
        if (c->rope_dim < 2 || c->rope_dim > c->head_dim || c->rope_dim % 2)
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: rope.dimension_count %d must be even and <= head dim %d", lk_gguf_path(g), c->rope_dim, c->head_dim);
    }
    c->kq_scale = 1.0f / sqrtf((float)(c->mla ? c->k_head : c->head_dim));
    c->kv_elems = c->mla ? (int64_t)c->kv_lora + c->rope_dim : 2LL * c->n_head_kv * c->head_dim;
    c->rope_freq_scale = 1;
    c->rope_base_swa = c->rope_base;
    c->emb_scale = 1;
    if ((st = read_rope_scaling(g, c, err, errlen))) return st;
    if ((c->arch == LK_ARCH_QWEN35MOE || c->arch == LK_ARCH_QWEN35) && (st = read_hybrid(g, c, err, errlen))) return st;
    if (c->arch == LK_ARCH_GEMMA3 && (st = read_gemma3(g, c, err, errlen))) return st;
    c->rope_neox = c->arch != LK_ARCH_LLAMA && c->arch != LK_ARCH_DEEPSEEK2;
    c->has_qkv_bias = c->arch == LK_ARCH_QWEN2 || c->arch == LK_ARCH_GLM4MOE;
    /* GLM-4.5-Air has no Q/K norms, GLM-4.5 has them: llama.cpp loads them when present */
    c->has_qk_norm = c->arch == LK_ARCH_QWEN3 || c->arch == LK_ARCH_QWEN3MOE || c->arch == LK_ARCH_QWEN35MOE ||
                     c->arch == LK_ARCH_QWEN35 || c->arch == LK_ARCH_GEMMA3 ||
                     (c->arch == LK_ARCH_GLM4MOE && lk_gguf_find_tensor(g, "blk.0.attn_q_norm.weight"));
    if (moe) {
        char n[64];
        snprintf(n, sizeof n, "blk.%d.exp_probs_b.bias", c->n_dense_lead);
        c->has_exp_probs_b = lk_gguf_find_tensor(g, n) != NULL;
    }

    /* tensors */
    const lk_gguf_tensor *emb = lk_gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: missing tensor 'token_embd.weight'", lk_gguf_path(g));
    c->n_vocab = (int64_t)emb->ne[1];
    if ((st = check_tensor(g, "token_embd.weight", c->n_embd, c->n_vocab, false, NULL, err, errlen))) return st;
    if ((st = check_tensor(g, "output_norm.weight", c->n_embd, 0, true, NULL, err, errlen))) return st;
    c->tied_output = lk_gguf_find_tensor(g, "output.weight") == NULL;
    if (!c->tied_output && (st = check_tensor(g, "output.weight", c->n_embd, c->n_vocab, false, NULL, err, errlen))) return st;
    c->has_rope_freqs = lk_gguf_find_tensor(g, "rope_freqs.weight") != NULL;
    if (c->has_rope_freqs && (st = check_tensor(g, "rope_freqs.weight", c->rope_dim / 2, 0, true, NULL, err, errlen))) return st;
    const int64_t d = c->n_embd, hd = c->head_dim, qd = (int64_t)c->n_head * hd, kvd = (int64_t)c->n_head_kv * hd;
    for (int l = 0; l < c->n_layer; l++) {
        char n[96];
#define T(name, ne0, ne1, f32) \
        do { snprintf(n, sizeof n, "blk.%d.%s", l, name); \
             if ((st = check_tensor(g, n, ne0, ne1, f32, NULL, err, errlen))) return st; } while (0)
        T("attn_norm.weight", d, 0, true);
        const bool rec = lk_model_layer_recurrent(c, l);
        if (rec) {
            const int64_t C = lk_model_ssm_channels(c), nv = c->ssm_nv, vd = nv * c->ssm_dv;
            T("attn_qkv.weight", d, C, false);
            T("attn_gate.weight", d, vd, false);
            T("ssm_conv1d.weight", c->ssm_conv, C, true);
            T("ssm_dt.bias", nv, 0, true);
            T("ssm_a", nv, 0, true);
            T("ssm_beta.weight", d, nv, false);
            T("ssm_alpha.weight", d, nv, false);
            T("ssm_norm.weight", c->ssm_dv, 0, true);
            T("ssm_out.weight", vd, d, false);
        } else if (c->mla) {
            const int64_t H = c->n_head;
            T("attn_q_a.weight", d, c->q_lora, false);
            T("attn_q_a_norm.weight", c->q_lora, 0, true);
            T("attn_q_b.weight", c->q_lora, H * c->k_head, false);
            T("attn_kv_a_mqa.weight", d, c->kv_lora + c->rope_dim, false);
            T("attn_kv_a_norm.weight", c->kv_lora, 0, true);
            snprintf(n, sizeof n, "blk.%d.attn_k_b.weight", l);
            if ((st = check_tensor3(g, n, c->qk_nope, c->kv_lora, H, err, errlen))) return st;
            snprintf(n, sizeof n, "blk.%d.attn_v_b.weight", l);
            if ((st = check_tensor3(g, n, c->kv_lora, hd, H, err, errlen))) return st;
        } else {
            T("attn_q.weight", d, c->attn_gate ? 2 * qd : qd, false);
            T("attn_k.weight", d, kvd, false);
            T("attn_v.weight", d, kvd, false);
        }
        if (!rec) T("attn_output.weight", qd, d, false);
        T(ffn_norm_name(c), d, 0, true);
        if (lk_model_layer_moe(c, l)) {
            const int64_t E = c->n_expert, fe = c->n_ff_exp;
            T("ffn_gate_inp.weight", d, E, false);
            if (c->has_exp_probs_b) T("exp_probs_b.bias", E, 0, true);
#define T3(name, ne0, ne1) \
            do { snprintf(n, sizeof n, "blk.%d.%s", l, name); \
                 if ((st = check_tensor3(g, n, ne0, ne1, E, err, errlen))) return st; } while (0)
            T3("ffn_gate_exps.weight", d, fe);
            T3("ffn_up_exps.weight", d, fe);
            T3("ffn_down_exps.weight", fe, d);
#undef T3
            if (c->shexp_gate) T("ffn_gate_inp_shexp.weight", d, 0, true);
            if (c->n_expert_shared) {
                T("ffn_gate_shexp.weight", d, c->n_ff_shexp, false);
                T("ffn_up_shexp.weight", d, c->n_ff_shexp, false);
                T("ffn_down_shexp.weight", c->n_ff_shexp, d, false);
            }
        } else {
            T("ffn_gate.weight", d, c->n_ff, false);
            T("ffn_up.weight", d, c->n_ff, false);
            T("ffn_down.weight", c->n_ff, d, false);
        }
        if (c->has_qkv_bias) {
            T("attn_q.bias", qd, 0, true);
            T("attn_k.bias", kvd, 0, true);
            T("attn_v.bias", kvd, 0, true);
        }
        if (c->has_qk_norm && !rec) {
            T("attn_q_norm.weight", hd, 0, true);
            T("attn_k_norm.weight", hd, 0, true);
        }
        if (c->post_norms) {
            T("post_attention_norm.weight", d, 0, true);
            T("post_ffw_norm.weight", d, 0, true);
        }
#undef T
    }
    return LK_OK;
}

static int64_t block_of(const lk_gguf *g, const char *name) {
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, name);
    return t ? lk_type_block_size(t->type) : 1;
}

static int64_t lcm64(int64_t a, int64_t b) {
    int64_t x = a, y = b;
    while (y) { int64_t t = x % y; x = y; y = t; }
    return a / x * b;
}

/* Cuts of an FFN's rows must fall on its down projection's blocks (it is
 * cut along its input columns), in every layer that has one. */
static int64_t down_align(const lk_gguf *g, const lk_model_config *c, const char *name) {
    int64_t a = 1;
    for (int l = 0; l < c->n_layer; l++) {
        char n[96];
        snprintf(n, sizeof n, "blk.%d.%s", l, name);
        a = lcm64(a, block_of(g, n));
    }
    return a;
}

void lk_model_plan_dims(const lk_gguf *g, const lk_model_config *c, lk_plan_dims *d) {
    memset(d, 0, sizeof *d);
    d->n_layer = c->n_layer;
    d->n_head = c->n_head;
    d->n_head_kv = c->n_head_kv;
    d->n_ff = c->n_ff_split;
    d->n_vocab = c->n_vocab;
    d->n_expert = c->n_expert;
    /* Wo and W2 are cut along their input columns: a cut must fall on a
     * quantisation block, so heads go in groups of block/head_dim and FFN
     * rows in multiples of the block. Output rows need no alignment. The
     * plan cuts the experts' rows in a mixture (n_ff_split); the dense and
     * shared FFNs follow (lk_model_ffn_ranges). */
    const int64_t wo_blk = down_align(g, c, "attn_output.weight");
    int64_t ha = 1;
    while ((ha * c->head_dim) % wo_blk) ha++;
    if (c->n_recurrent) {
        /* the delta net's key heads follow the query heads (head h0 ->
         * key head h0 nk / n_head, deltanet.c): a cut must be a whole key
         * head, and its value heads' ssm_out columns must fall on blocks */
        const int64_t so_blk = down_align(g, c, "ssm_out.weight");
        int64_t ka = 1;
        while ((ka * c->ssm_dv) % so_blk) ka++;
        const int64_t per_k = LK_MAX(1, c->n_head / c->ssm_nk); /* query heads per key head */
        ha = lcm64(ha, per_k * ka);
    }
    d->head_align = (int)ha;
    d->ff_align = down_align(g, c, c->n_expert ? "ffn_down_exps.weight" : "ffn_down.weight");
    d->vocab_align = 1;
}

/* A cut c of [0, n_ff_split) mapped onto an FFN of W rows whose cuts must
 * fall on multiples of a (model.h, lk_ffn_ranges). */
static int64_t ff_map(int64_t c, int64_t n, int64_t W, int64_t a) {
    if (W <= 0 || n <= 0) return 0;
    const int64_t U = (W + a - 1) / a;
    int64_t r = (2 * c * U + n) / (2 * n);
    return LK_MIN(W, a * r);
}

void lk_model_ffn_ranges(const lk_gguf *g, const lk_model_config *c, const lk_slice *s, lk_ffn_ranges *r) {
    const int64_t n = c->n_ff_split, ff0 = s->ff0, ff1 = s->ff1;
    memset(r, 0, sizeof *r);
    if (c->n_expert == 0) {
        r->dense0 = ff0, r->dense1 = ff1;
        return;
    }
    int64_t ad = down_align(g, c, "ffn_down.weight"), ae = down_align(g, c, "ffn_down_exps.weight"),
            as = down_align(g, c, "ffn_down_shexp.weight");
    if (c->n_dense_lead > 0) r->dense0 = ff_map(ff0, n, c->n_ff, ad), r->dense1 = ff_map(ff1, n, c->n_ff, ad);
    if (s->ep) {
        /* whole experts: no cut of their rows, so no block to respect */
        r->e0 = s->expert0, r->e1 = s->expert1;
        r->exp1 = r->e1 > r->e0 ? c->n_ff_exp : 0;
    } else {
        r->exp0 = ff_map(ff0, n, c->n_ff_exp, ae), r->exp1 = ff_map(ff1, n, c->n_ff_exp, ae);
        r->e1 = r->exp1 > r->exp0 ? c->n_expert : 0;
    }
    if (c->n_expert_shared) r->sh0 = ff_map(ff0, n, c->n_ff_shexp, as), r->sh1 = ff_map(ff1, n, c->n_ff_shexp, as);
}

void lk_model_param_counts(const lk_gguf *g, const lk_model_config *c, uint64_t *total, uint64_t *active) {
    uint64_t all = 0, act = 0;
    for (int64_t i = 0; i < lk_gguf_n_tensors(g); i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
        uint64_t ne = t->n_elements;
        all += ne;
        int l = -1;
        if (sscanf(t->name, "blk.%d.", &l) == 1 && l >= c->n_layer) continue; /* NextN blocks: never run */
        if (strstr(t->name, "_exps.")) act += ne / (uint64_t)c->n_expert * (uint64_t)c->n_expert_used;
        else if (!strcmp(t->name, "token_embd.weight")) act += (uint64_t)c->n_embd; /* one row per token */
        else act += ne;
    }
    if (c->tied_output) act += (uint64_t)c->n_embd * (uint64_t)c->n_vocab; /* the output reads all of token_embd */
    *total = all;
    *active = act;
}

/* ---------------------------------------------------------------- load */

static lk_mat mat_rows(const lk_gguf_tensor *t, int64_t r0, int64_t r1) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    return (lk_mat){ .type = (lk_type)t->type, .cols = (int64_t)t->ne[0], .rows = r1 - r0,
                     .data = (const char *)t->data + (size_t)r0 * rb, .row_stride = rb };
}

static lk_mat mat_cols(const lk_gguf_tensor *t, int64_t c0, int64_t c1) {
    size_t rb = 0, off = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    LK_ASSERT(c0 % lk_type_block_size(t->type) == 0);
    LK_ASSERT(c0 == 0 || lk_type_row_bytes(t->type, c0, &off));
    return (lk_mat){ .type = (lk_type)t->type, .cols = c1 - c0, .rows = (int64_t)t->ne[1],
                     .data = (const char *)t->data + off, .row_stride = rb };
}

/* Rows [r0, r1) of slab e of a 3-D tensor (expert e). */
static lk_mat mat_slab_rows(const lk_gguf_tensor *t, int e, int64_t r0, int64_t r1) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    return (lk_mat){ .type = (lk_type)t->type, .cols = (int64_t)t->ne[0], .rows = r1 - r0,
                     .data = (const char *)t->data + ((size_t)e * t->ne[1] + (size_t)r0) * rb, .row_stride = rb };
}

/* Columns [c0, c1) of every row of slab e (c0 on a block boundary). */
static lk_mat mat_slab_cols(const lk_gguf_tensor *t, int e, int64_t c0, int64_t c1) {
    size_t rb = 0, off = 0;
    LK_ASSERT(lk_type_row_bytes(t->type, (int64_t)t->ne[0], &rb));
    LK_ASSERT(c0 % lk_type_block_size(t->type) == 0);
    LK_ASSERT(c0 == 0 || lk_type_row_bytes(t->type, c0, &off));
    return (lk_mat){ .type = (lk_type)t->type, .cols = c1 - c0, .rows = (int64_t)t->ne[1],
                     .data = (const char *)t->data + (size_t)e * t->ne[1] * rb + off, .row_stride = rb };
}

static uint64_t mat_bytes(const lk_mat *m) {
    size_t rb = 0;
    lk_type_row_bytes(m->type, m->cols, &rb);
    return (uint64_t)rb * (uint64_t)m->rows;
}

static const lk_gguf_tensor *tensor(const lk_gguf *g, int l, const char *name) {
    char n[96];
    if (l >= 0) snprintf(n, sizeof n, "blk.%d.%s", l, name);
    else snprintf(n, sizeof n, "%s", name);
    const lk_gguf_tensor *t = lk_gguf_find_tensor(g, n);
    LK_ASSERT(t); /* checked by lk_model_config_read */
    return t;
}

void lk_model_free(lk_model *m) {
    if (!m) return;
    if (m->arena) munmap(m->arena, m->arena_len);
    if (m->own_pool) lk_pool_free(m->pool);
    free(m->rope_cos); free(m->rope_sin); free(m->rope_cos_swa); free(m->rope_sin_swa);
    for (int i = 0; i < 2; i++)
        if (m->kv_map[i]) munmap(m->kv_map[i], m->kv_map_len);
    free(m->page_ref); free(m->free_pages); free(m->ptab); free(m->seq_len); free(m->swa_lo); free(m->swa_hi);
    free(m->items); free(m->item_row0); free(m->row_item); free(m->row_pos); free(m->task0); free(m->hgrp0); free(m->out_rows);
    free(m->x); free(m->xb); free(m->q); free(m->k); free(m->v); free(m->att); free(m->o);
    free(m->hg); free(m->hu); free(m->scores); free(m->kvw); free(m->act);
    free(m->mqa); free(m->mkva); free(m->mqb); free(m->mvo); free(m->hact);
    lk_deltanet_free(m);
    free(m->kv_li); free(m->gate); free(m->ms.shg);
    if (m->layers)
        for (int i = 0; i < m->sl.layer1 - m->sl.layer0; i++) free(m->layers[i].ex);
    free(m->ms.logits); free(m->ms.probs); free(m->ms.bsel); free(m->ms.gsc); free(m->ms.sel); free(m->ms.wgt); free(m->ms.row_slot);
    free(m->ms.slot_row); free(m->ms.cnt); free(m->ms.off); free(m->ms.act); free(m->ms.ain); free(m->ms.adn);
    free(m->ms.hg); free(m->ms.hu); free(m->ms.eo);
    free(m->layers);
    free(m);
}

/* A slice may hold no attention heads or no FFN rows (small or coarsely
 * quantised models split over many ranks: see parallel/plan.c); it then adds
 * zeros for that part to the all-reduce. */
static lk_status check_slice(const lk_model_config *c, const lk_slice *s, char *err, size_t errlen) {
    int group = c->n_head / c->n_head_kv;
    bool heads_ok = s->head0 == s->head1 ? s->kv_head0 == s->kv_head1 && s->head0 >= 0 && s->head0 <= c->n_head
                  : s->head0 >= 0 && s->head0 < s->head1 && s->head1 <= c->n_head &&
                    s->kv_head0 >= 0 && s->kv_head0 < s->kv_head1 && s->kv_head1 <= c->n_head_kv &&
                    s->kv_head0 <= s->head0 / group && s->kv_head1 > (s->head1 - 1) / group;
    /* recurrent layers: a head cut must be a key-head cut (lk_model_plan_dims) */
    if (c->n_recurrent && (((int64_t)s->head0 * c->ssm_nk) % c->n_head || ((int64_t)s->head1 * c->ssm_nk) % c->n_head))
        heads_ok = false;
    bool ok = heads_ok && s->layer0 >= 0 && s->layer0 < s->layer1 && s->layer1 <= c->n_layer &&
              s->ff0 >= 0 && s->ff0 <= s->ff1 && s->ff1 <= c->n_ff_split && (s->ff1 > s->ff0 || s->head1 > s->head0) &&
              s->vocab0 >= 0 && s->vocab0 < s->vocab1 && s->vocab1 <= c->n_vocab;
    if (ok && s->ep && (c->n_expert == 0 || s->expert0 < 0 || s->expert0 >= s->expert1 || s->expert1 > c->n_expert))
        return lk_fail(err, errlen, LK_ERR_ARG, "expert-parallel slice does not fit the model: experts [%d,%d) of %d%s",
                       s->expert0, s->expert1, c->n_expert, c->n_expert ? "" : " (a dense model)");
    if (!ok)
        return lk_fail(err, errlen, LK_ERR_ARG,
                       "slice does not fit the model: layers [%d,%d) heads [%d,%d) kv [%d,%d) ff [%lld,%lld) vocab [%lld,%lld)",
                       s->layer0, s->layer1, s->head0, s->head1, s->kv_head0, s->kv_head1,
                       (long long)s->ff0, (long long)s->ff1, (long long)s->vocab0, (long long)s->vocab1);
    return LK_OK;
}

/* ---- the huge-page weight arena (see the file comment) ---- */

static bool thp_available(void) {
    const char *env = getenv("LK_WEIGHTS");
    if (env && !strcmp(env, "mmap")) return false;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false;
    char buf[128] = {0};
    bool ok = fgets(buf, sizeof buf, f) && !strstr(buf, "[never]");
    fclose(f);
    return ok;
}

typedef struct {
    lk_mat **mats;
    int n;
    uint8_t *dst0;
    const size_t *off;
    const lk_type *to;  /* each matrix's type in the arena (lk_type_repacked) */
} copy_job;

static size_t compact_bytes(const lk_mat *w) {
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(w->type, w->cols, &rb));
    return rb * (size_t)w->rows;
}

/* A KV cache of `bytes`, zeros, on 2 MiB pages where the kernel gives
 * them (madvise: a kernel whose transparent huge pages are "madvise" gives
 * none otherwise): decode reads every page of a sequence once a token, and
 * through 4 KiB pages each of a head's pages would cost a TLB miss. *map
 * and *len are for munmap. Pages never written read as zeros (a copy of a
 * page copies its unwritten tail too; nothing ever reads it). */
static void *kv_alloc(size_t bytes, void **map, size_t *len) {
    const size_t huge = (size_t)2 << 20;
    *len = (bytes + huge - 1) / huge * huge + huge; /* room to align the start */
    *map = mmap(NULL, *len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (*map == MAP_FAILED) {
        fprintf(stderr, "lockstep: out of memory allocating a KV cache of %zu MiB\n", bytes >> 20);
        abort();
    }
    uint8_t *p = (uint8_t *)(((uintptr_t)*map + huge - 1) & ~(uintptr_t)(huge - 1));
    madvise(p, *len - (size_t)(p - (uint8_t *)*map), MADV_HUGEPAGE);
    return p;
}

/* Drops this process's pages of [p, p+len) of the read-only file mapping
 * (whole pages inside the range only; they are refetched if read again). */
static void drop_file_pages(const void *p, size_t len) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)p + pg - 1) & ~(pg - 1), b = ((uintptr_t)p + len) & ~(pg - 1);
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
}

/* Maps the file pages of [p, p+len) into this process now (MADV_POPULATE_READ,
 * Linux 5.14; before it, a readahead hint only). For the embedding table,
 * which stays on the file mapping: otherwise a prefill's first touch of each
 * token's row faulted its page in, from the disk once the page cache had
 * dropped it (the first 64-token prefill after a cold start spent 10-14 % of
 * its time so on the Xeon guest, BENCHMARKS.md). */
static void map_file_pages(const void *p, size_t len) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)p & ~(pg - 1), b = ((uintptr_t)p + len + pg - 1) & ~(pg - 1);
    if (b <= a) return;
#ifdef MADV_POPULATE_READ
    if (madvise((void *)a, b - a, MADV_POPULATE_READ) == 0) return;
#endif
    madvise((void *)a, b - a, MADV_WILLNEED);
}

/* Copies matrices i = ith, ith+nth, ... into the arena, rows packed. */
static void copy_fn(void *arg, int ith, int nth) {
    copy_job *j = arg;
    for (int i = ith; i < j->n; i += nth) {
        lk_mat *w = j->mats[i];
        size_t rb = 0;
        LK_ASSERT(lk_type_row_bytes(w->type, w->cols, &rb));
        uint8_t *dst = j->dst0 + j->off[i];
        const uint8_t *src = w->data;
        if (j->to[i] != w->type) lk_quant_repack(j->to[i], w->type, w->cols, w->rows, src, w->row_stride, dst);
        else if (w->row_stride == rb) memcpy(dst, src, rb * (size_t)w->rows);
        else
            for (int64_t r = 0; r < w->rows; r++) memcpy(dst + (size_t)r * rb, src + (size_t)r * w->row_stride, rb);
        /* at once, so the process never holds both copies of much more than one matrix */
        drop_file_pages(src, (size_t)(w->rows - 1) * w->row_stride + rb);
    }
}

/* The kernels' speed settings for this machine (kernels/tune.h), chosen
 * on the weight type with the most bytes and its largest matrix's shape
 * (timed on the model's own matrices of that type), once the weights are in
 * place and before any token. */
static void tune_for(lk_model *m, lk_mat **mats, int n) {
    uint64_t by_type[LK_TYPE_ALL] = {0}, total = 0;
    for (int i = 0; i < n; i++) {
        uint64_t b = mat_bytes(mats[i]);
        if (mats[i]->type < LK_TYPE_ALL) by_type[mats[i]->type] += b;
        total += b;
    }
    int t = 0;
    for (int k = 1; k < LK_TYPE_ALL; k++)
        if (by_type[k] > by_type[t]) t = k;
    /* a layer's matrix: the output matrix (as large as 16 of them) is one per model */
    const lk_mat *big = NULL;
    for (int i = 0; i < n; i++)
        if ((int)mats[i]->type == t && mats[i] != &m->wout && (!big || mat_bytes(mats[i]) > mat_bytes(big)))
            big = mats[i];
    if (!big && (int)m->wout.type == t) big = &m->wout;
    if (big) lk_tune_init(m->pool, (lk_type)t, big->cols, big->rows, total, mats, n);
}

/* The matrices into one huge-page arena, each in the layout its kernels read
 * best (lk_type_repacked: Q4_0 and Q8_0 interleaved by 16 rows on AVX-512) where
 * `repack[i]`: matrices read only through row ranges that start at
 * multiples of 16 (the kernels part's splits; not MLA's per-head views). */
static void weights_to_arena(lk_model *m, lk_mat **mats, const bool *repack, int n) {
    if (n == 0 || !thp_available()) return;
    const size_t huge = (size_t)2 << 20;
    size_t *off = lk_xmalloc(sizeof(size_t) * (size_t)n), total = 0;
    for (int i = 0; i < n; i++) {
        off[i] = total;
        total += (compact_bytes(mats[i]) + 63) & ~(size_t)63;
    }
    /* A model larger than free memory still runs from the file mapping
     * (paged in and out by the kernel); an anonymous copy would not fit. */
    uint64_t avail = lk_mem_available();
    if (avail && total > avail / 10 * 9) {
        lk_log(LK_LOG_WARN, "model: %zu MiB of weights but %llu MiB of memory available: keeping them on the file "
                            "mapping (slower decode)", total >> 20, (unsigned long long)(avail >> 20));
        free(off);
        return;
    }
    size_t len = (total + huge - 1) / huge * huge + huge; /* room to align the start */
    void *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        lk_log(LK_LOG_WARN, "model: no memory for a %zu MiB huge-page copy of the weights; using the file mapping "
                            "(slower decode)", len >> 20);
        free(off);
        return;
    }
    uint8_t *dst = (uint8_t *)(((uintptr_t)map + huge - 1) & ~(uintptr_t)(huge - 1));
    madvise(dst, len - (size_t)(dst - (uint8_t *)map), MADV_HUGEPAGE);
    lk_type *to = lk_xmalloc(sizeof(lk_type) * (size_t)n);
    int nrep = 0;
    size_t brep = 0;
    bool rtype[LK_TYPE_ALL] = {false};
    for (int i = 0; i < n; i++) to[i] = repack[i] ? lk_type_repacked(mats[i]->type, mats[i]->rows) : mats[i]->type;
    copy_job j = {mats, n, dst, off, to};
    lk_pool_run(m->pool, copy_fn, &j);
    for (int i = 0; i < n; i++) {
        lk_mat *w = mats[i];
        size_t rb = 0;
        LK_ASSERT(lk_type_row_bytes(w->type, w->cols, &rb));
        w->data = dst + off[i];
        w->row_stride = rb;
        if (w->type != to[i]) nrep++, brep += compact_bytes(w), rtype[to[i]] = true;
        w->type = to[i]; /* the same bytes a row */
    }
    if (nrep) {
        char names[128] = "";
        for (int t = 0, k = 0; t < LK_TYPE_ALL; t++)
            if (rtype[t] && k < (int)sizeof names)
                k += snprintf(names + k, sizeof names - (size_t)k, "%s%s", k ? ", " : "", lk_type_name((uint32_t)t));
        lk_log(LK_LOG_DEBUG, "model: %d matrices (%zu MiB) repacked into 16-row groups (%s) for the %s kernels "
                             "(LK_REPACK=0: as in the file)", nrep, brep >> 20, names, lk_quant_simd_name());
    }
    free(to);
    m->arena = map;
    m->arena_len = len;
    free(off);
}

static void moe_scratch_alloc(lk_model *m);
static size_t attn_buf_floats(const lk_model *m);
static size_t kvw_floats(const lk_model *m);

/* ggml's YaRN correction dimension: the pair index whose wavelength makes
 * n_rot turns over the original context. */
static float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2 * 3.14159265358979323846f)) / (2 * logf(base));
}

/* A RoPE table, computed like ggml: theta_i = pos * base^(-2i/rope_dim)
 * by repeated multiplication in float, divided by the llama3 factor, times
 * the linear freq_scale (ggml's theta_interp = freq_scale * theta). */
static void rope_table(const lk_model_config *c, int n_ctx, float base, float freq_scale, const float *ff, float **cosp,
                       float **sinp) {
    const int half = c->rope_dim / 2;
    float *rc = lk_xmalloc(sizeof(float) * (size_t)n_ctx * half), *rs = lk_xmalloc(sizeof(float) * (size_t)n_ctx * half);
    const float theta_scale = powf(base, -2.0f / (float)c->rope_dim);
    /* YaRN (ggml's rope_yarn): pair i mixes theta / factor and theta by
     * ramp_i = 1 - clamp((i - low) / max(0.001, high - low), 0, 1) over the
     * correction dims [low, high]; cos and sin carry ggml's magnitude factor
     * 1 + 0.1 ln(factor) times llama.cpp's attn_factor, its inverse (1 give
     * or take a rounding: computed as llama.cpp does, in float). */
    float fs = 1, corr0 = 0, corr1 = 0, ymag = 1;
    if (c->rope_yarn) {
        fs = 1.0f / c->yarn_factor;
        corr0 = LK_MAX(0.0f, floorf(yarn_corr_dim(c->rope_dim, c->yarn_orig_ctx, c->yarn_beta_fast, base)));
        corr1 = LK_MIN((float)(c->rope_dim - 1), ceilf(yarn_corr_dim(c->rope_dim, c->yarn_orig_ctx, c->yarn_beta_slow, base)));
        const float mag = 1.0f + 0.1f * logf(1.0f / fs);
        ymag = (1.0f / mag) * mag;
    }
    for (int pos = 0; pos < n_ctx; pos++) {
        float theta = (float)pos;
        for (int i = 0; i < half; i++) {
            float t = ff ? theta / ff[i] : theta;
            if (c->rope_yarn) {
                const float y = ((float)i - corr0) / LK_MAX(0.001f, corr1 - corr0);
                const float ramp = 1 - LK_MIN(1.0f, LK_MAX(0.0f, y));
                t = fs * t * (1 - ramp) + t * ramp;
            } else if (freq_scale != 1.0f) {
                t = freq_scale * t;
            }
            rc[(size_t)pos * half + i] = cosf(t) * ymag;
            rs[(size_t)pos * half + i] = sinf(t) * ymag;
            theta *= theta_scale;
        }
    }
    *cosp = rc;
    *sinp = rs;
}

lk_status lk_model_load(const lk_gguf *g, const lk_slice *slice, const lk_model_params *p,
                        lk_model **out, char *err, size_t errlen) {
    *out = NULL;
    lk_model_config cfg;
    lk_status st = lk_model_config_read(g, &cfg, err, errlen);
    if (st) return st;
    lk_plan_dims dims;
    lk_model_plan_dims(g, &cfg, &dims);
    lk_slice sl;
    if (slice) sl = *slice;
    else lk_slice_full(&dims, &sl);
    if ((st = check_slice(&cfg, &sl, err, errlen))) return st;
    lk_ffn_ranges fr;
    lk_model_ffn_ranges(g, &cfg, &sl, &fr);
    /* column cuts must be on block boundaries */
    for (int l = sl.layer0; l < sl.layer1; l++) {
        if (lk_model_layer_recurrent(&cfg, l)) {
            /* the value heads' ssm_out columns (deltanet.c) start on blocks */
            const int64_t bs = lk_type_block_size(tensor(g, l, "ssm_out.weight")->type), nk = cfg.ssm_nk;
            const int64_t k0 = (int64_t)sl.head0 * nk / cfg.n_head, k1 = (int64_t)sl.head1 * nk / cfg.n_head;
            for (int64_t j = 0; j < cfg.ssm_nv / nk && k1 > k0; j++)
                if (((j * nk + k0) * cfg.ssm_dv) % bs || ((j * nk + k1) * cfg.ssm_dv) % bs)
                    return lk_fail(err, errlen, LK_ERR_ARG, "key heads [%lld,%lld) cut blk.%d.ssm_out.weight inside a "
                                   "%lld-element block", (long long)k0, (long long)k1, l, (long long)bs);
        }
        int64_t bo = lk_model_layer_recurrent(&cfg, l) ? 1 : lk_type_block_size(tensor(g, l, "attn_output.weight")->type);
        if (((int64_t)sl.head0 * cfg.head_dim) % bo || (((int64_t)sl.head1 * cfg.head_dim) % bo && sl.head1 != cfg.n_head))
            return lk_fail(err, errlen, LK_ERR_ARG, "heads [%d,%d) cut blk.%d.attn_output.weight inside a %lld-element block",
                           sl.head0, sl.head1, l, (long long)bo);
        const bool moe = lk_model_layer_moe(&cfg, l);
        const struct { const char *name; int64_t f0, f1, w; } cuts[2] = {
            { moe ? "ffn_down_exps.weight" : "ffn_down.weight", moe ? fr.exp0 : fr.dense0, moe ? fr.exp1 : fr.dense1,
              moe ? cfg.n_ff_exp : cfg.n_ff },
            { "ffn_down_shexp.weight", fr.sh0, fr.sh1, cfg.n_ff_shexp },
        };
        for (int k = moe && sl.ep ? 1 : 0; k < (moe && cfg.n_expert_shared ? 2 : 1); k++) {
            int64_t bd = lk_type_block_size(tensor(g, l, cuts[k].name)->type);
            if (cuts[k].f0 % bd || (cuts[k].f1 % bd && cuts[k].f1 != cuts[k].w))
                return lk_fail(err, errlen, LK_ERR_ARG, "FFN rows [%lld,%lld) cut blk.%d.%s inside a %lld-element block",
                               (long long)cuts[k].f0, (long long)cuts[k].f1, l, cuts[k].name, (long long)bd);
        }
    }

    lk_model *m = lk_xcalloc(1, sizeof *m);
    m->cfg = cfg;
    m->sl = sl;
    m->g = g;
    m->nh = sl.head1 - sl.head0;
    m->nkv = sl.kv_head1 - sl.kv_head0;
    m->fr = fr;
    m->nff = fr.dense1 - fr.dense0;
    m->nfe = fr.exp1 - fr.exp0;
    m->ex0 = fr.e0;
    m->ex1 = fr.e1;
    m->nfs = fr.sh1 - fr.sh0;
    m->nvoc = sl.vocab1 - sl.vocab0;
    if (cfg.n_recurrent) { /* the delta net's key heads follow the query heads' share (check_slice) */
        m->kh0 = (int)((int64_t)sl.head0 * cfg.ssm_nk / cfg.n_head);
        m->nkl = (int)((int64_t)sl.head1 * cfg.ssm_nk / cfg.n_head) - m->kh0;
        m->nvl = m->nkl * (cfg.ssm_nv / cfg.ssm_nk);
    }
    m->n_ctx = p && p->n_ctx > 0 ? p->n_ctx : LK_MIN(cfg.n_ctx_train, 4096);
    m->n_batch = p && p->n_batch > 0 ? p->n_batch : 512;
    if (m->n_batch > m->n_ctx) m->n_batch = m->n_ctx;
    m->kv_f16 = p && p->kv_f16;
    if (p && p->pool) m->pool = p->pool;
    else { m->pool = lk_pool_create(p ? p->n_threads : 0); m->own_pool = true; }

    const int64_t d = cfg.n_embd, hd = cfg.head_dim;
    m->tok_embd = tensor(g, -1, "token_embd.weight");
    m->out_norm = tensor(g, -1, "output_norm.weight")->data;
    const lk_gguf_tensor *wout = cfg.tied_output ? m->tok_embd : tensor(g, -1, "output.weight");
    m->wout = mat_rows(wout, sl.vocab0, sl.vocab1);
    m->weight_bytes = sl.pp_rank == sl.pp_size - 1 ? mat_bytes(&m->wout) : 0;
    int nl = sl.layer1 - sl.layer0;
    m->layers = lk_xcalloc((size_t)nl, sizeof(layer_w));
    for (int i = 0; i < nl; i++) {
        int l = sl.layer0 + i;
        layer_w *w = &m->layers[i];
        w->attn_norm = tensor(g, l, "attn_norm.weight")->data;
        w->ffn_norm = tensor(g, l, ffn_norm_name(&cfg))->data;
        if (lk_model_layer_recurrent(&cfg, l)) {
            w->ri = m->n_rec++;
            lk_deltanet_load(m, l, w);
            m->weight_bytes += mat_bytes(&w->wqkv) + mat_bytes(&w->wz) + mat_bytes(&w->wbeta) + mat_bytes(&w->walpha) +
                               mat_bytes(&w->wso);
        } else if (cfg.mla) {
            /* a rank without heads reads none of the attention */
            const int64_t any = m->nh > 0, kl = cfg.kv_lora;
            w->wqa = mat_rows(tensor(g, l, "attn_q_a.weight"), 0, any * cfg.q_lora);
            w->wkva = mat_rows(tensor(g, l, "attn_kv_a_mqa.weight"), 0, any * (kl + cfg.rope_dim));
            w->wqb = mat_rows(tensor(g, l, "attn_q_b.weight"), sl.head0 * (int64_t)cfg.k_head, sl.head1 * (int64_t)cfg.k_head);
            w->wkb = mat_rows(tensor(g, l, "attn_k_b.weight"), sl.head0 * kl, sl.head1 * kl);
            w->wvb = mat_rows(tensor(g, l, "attn_v_b.weight"), sl.head0 * hd, sl.head1 * hd);
            w->q_a_norm = tensor(g, l, "attn_q_a_norm.weight")->data;
            w->kv_a_norm = tensor(g, l, "attn_kv_a_norm.weight")->data;
            m->weight_bytes += mat_bytes(&w->wqa) + mat_bytes(&w->wkva) + mat_bytes(&w->wqb) + mat_bytes(&w->wkb) +
                               mat_bytes(&w->wvb);
        } else {
            const int64_t qw = cfg.attn_gate ? 2 * hd : hd; /* gated: per head [q | gate] */
            w->gated = cfg.attn_gate;
            w->wq = mat_rows(tensor(g, l, "attn_q.weight"), sl.head0 * qw, sl.head1 * qw);
            w->wk = mat_rows(tensor(g, l, "attn_k.weight"), sl.kv_head0 * hd, sl.kv_head1 * hd);
            w->wv = mat_rows(tensor(g, l, "attn_v.weight"), sl.kv_head0 * hd, sl.kv_head1 * hd);
        }
        if (!w->rec) w->wo = mat_cols(tensor(g, l, "attn_output.weight"), sl.head0 * hd, sl.head1 * hd);
        if (lk_model_layer_moe(&cfg, l)) {
            const int E = cfg.n_expert, k = cfg.n_expert_used;
            w->moe = true;
            w->wr = mat_rows(tensor(g, l, "ffn_gate_inp.weight"), 0, E);
            if (cfg.has_exp_probs_b) w->exp_b = tensor(g, l, "exp_probs_b.bias")->data;
            if (cfg.shexp_gate) w->sh_gate = tensor(g, l, "ffn_gate_inp_shexp.weight")->data;
            w->ex = lk_xcalloc((size_t)E, sizeof(ffn_w));
            const lk_gguf_tensor *tg = tensor(g, l, "ffn_gate_exps.weight"), *tu = tensor(g, l, "ffn_up_exps.weight"),
                                 *td = tensor(g, l, "ffn_down_exps.weight");
            /* the experts held here (all of them, or with expert
             * parallelism a range); the others stay empty views */
            for (int e = fr.e0; e < fr.e1; e++) {
                w->ex[e].w1 = mat_slab_rows(tg, e, fr.exp0, fr.exp1);
                w->ex[e].w3 = mat_slab_rows(tu, e, fr.exp0, fr.exp1);
                w->ex[e].w2 = mat_slab_cols(td, e, fr.exp0, fr.exp1);
            }
            /* a token reads k experts; the expected share held here is
             * (e1 - e0) / E of them (all of them without expert
             * parallelism, each a slice of its rows) */
            const uint64_t one = fr.e1 > fr.e0 ? mat_bytes(&w->ex[fr.e0].w1) + mat_bytes(&w->ex[fr.e0].w3) +
                                                     mat_bytes(&w->ex[fr.e0].w2) : 0;
            m->weight_bytes += mat_bytes(&w->wr) + (uint64_t)k * (uint64_t)(fr.e1 - fr.e0) * one / (uint64_t)E;
            if (cfg.n_expert_shared) {
                w->sh.w1 = mat_rows(tensor(g, l, "ffn_gate_shexp.weight"), fr.sh0, fr.sh1);
                w->sh.w3 = mat_rows(tensor(g, l, "ffn_up_shexp.weight"), fr.sh0, fr.sh1);
                w->sh.w2 = mat_cols(tensor(g, l, "ffn_down_shexp.weight"), fr.sh0, fr.sh1);
                m->weight_bytes += mat_bytes(&w->sh.w1) + mat_bytes(&w->sh.w3) + mat_bytes(&w->sh.w2);
            }
        } else {
            w->w1 = mat_rows(tensor(g, l, "ffn_gate.weight"), fr.dense0, fr.dense1);
            w->w3 = mat_rows(tensor(g, l, "ffn_up.weight"), fr.dense0, fr.dense1);
            w->w2 = mat_cols(tensor(g, l, "ffn_down.weight"), fr.dense0, fr.dense1);
        }
        if (cfg.has_qkv_bias) {
            w->bq = (const float *)tensor(g, l, "attn_q.bias")->data + sl.head0 * hd;
            w->bk = (const float *)tensor(g, l, "attn_k.bias")->data + sl.kv_head0 * hd;
            w->bv = (const float *)tensor(g, l, "attn_v.bias")->data + sl.kv_head0 * hd;
        }
        if (cfg.has_qk_norm && !w->rec) {
            w->q_norm = tensor(g, l, "attn_q_norm.weight")->data;
            w->k_norm = tensor(g, l, "attn_k_norm.weight")->data;
        }
        if (cfg.post_norms) {
            w->post_attn_norm = tensor(g, l, "post_attention_norm.weight")->data;
            w->post_ffn_norm = tensor(g, l, "post_ffw_norm.weight")->data;
        }
        w->swa = lk_model_layer_swa(&cfg, l);
        m->weight_bytes += mat_bytes(&w->wq) + mat_bytes(&w->wk) + mat_bytes(&w->wv) + mat_bytes(&w->wo) +
                           mat_bytes(&w->w1) + mat_bytes(&w->w2) + mat_bytes(&w->w3);
    }
    {
        /* per layer: 7 attention/dense matrices, the router, 3 per expert and 3 shared */
        const size_t per = 7 + 1 + 3 * (size_t)cfg.n_expert + 3 + 5 + 5;
        lk_mat **mats = lk_xmalloc(sizeof(lk_mat *) * (per * (size_t)nl + 1));
        bool *rep = lk_xmalloc(sizeof(bool) * (per * (size_t)nl + 1));
        int nm = 0;
        if (sl.pp_rank == sl.pp_size - 1) rep[nm] = true, mats[nm++] = &m->wout;
        for (int i = 0; i < nl; i++) {
            layer_w *w = &m->layers[i];
            lk_mat *all[16] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w1, &w->w3, &w->w2, &w->wr,
                               &w->sh.w1, &w->sh.w3, &w->sh.w2, &w->wqa, &w->wkva, &w->wqb, &w->wkb, &w->wvb};
            /* MLA's k_b and v_b (from 14) are read by heads (heads_fn), at rows
             * no layout of 16-row groups promises to start a group at; its
             * q_a, kv_a and q_b go through lk_matmul as any matrix does */
            for (int k = 0; k < 16; k++)
                if (all[k]->rows > 0 && all[k]->cols > 0) rep[nm] = k < 14, mats[nm++] = all[k];
            lk_mat *dn[5] = {&w->wqkv, &w->wz, &w->wbeta, &w->walpha, &w->wso};
            for (int k = 0; k < 5 && w->rec && !w->own; k++) /* gathered ones are already compact, in memory of their own */
                if (dn[k]->rows > 0 && dn[k]->cols > 0) rep[nm] = false, mats[nm++] = dn[k];
            for (int e = 0; w->moe && e < cfg.n_expert; e++) {
                lk_mat *ex[3] = {&w->ex[e].w1, &w->ex[e].w3, &w->ex[e].w2};
                for (int k = 0; k < 3; k++)
                    if (ex[k]->rows > 0 && ex[k]->cols > 0) rep[nm] = true, mats[nm++] = ex[k];
            }
        }
        weights_to_arena(m, mats, rep, nm);
        tune_for(m, mats, nm);
        free(mats);
        free(rep);
    }
    /* the first stage embeds; after the copies, which drop a tied output's
     * file pages, the table's too */
    if (sl.layer0 == 0) map_file_pages(m->tok_embd->data, (size_t)m->tok_embd->nbytes);

    const float *ff = cfg.has_rope_freqs ? tensor(g, -1, "rope_freqs.weight")->data : NULL;
    rope_table(&cfg, m->n_ctx, cfg.rope_base, cfg.rope_freq_scale, ff, &m->rope_cos, &m->rope_sin);
    if (cfg.swa_window > 0) /* Gemma 3's local layers: their own base, no scaling */
        rope_table(&cfg, m->n_ctx, cfg.rope_base_swa, 1.0f, ff, &m->rope_cos_swa, &m->rope_sin_swa);

    m->max_seqs = p && p->max_seqs > 0 ? p->max_seqs : 1;
    m->max_pps = (m->n_ctx + LK_KV_PAGE - 1) / LK_KV_PAGE;
    int64_t kv_tokens = p && p->kv_tokens > 0 ? p->kv_tokens : (int64_t)m->max_seqs * m->n_ctx;
    m->n_pages = LK_MAX((kv_tokens + LK_KV_PAGE - 1) / LK_KV_PAGE, 1);
    m->ahd = cfg.mla ? cfg.kv_lora + cfg.rope_dim : cfg.head_dim;
    /* only attention layers have pages (recurrent ones keep per-slot
     * state), and of them only the global ones when sliding-window layers
     * have rings (model.h): kv_li is a layer's place in a page or in a ring */
    m->swa_ring = lk_model_swa_ring(&cfg, m->n_ctx, m->n_batch);
    m->kv_li = lk_xmalloc(sizeof(int32_t) * (size_t)nl);
    for (int i = 0; i < nl; i++) {
        const layer_w *w = &m->layers[i];
        m->kv_li[i] = w->rec ? -1 : m->swa_ring && w->swa ? m->n_swa++ : m->n_kv_layers++;
    }
    m->page_elems = (size_t)m->n_kv_layers * m->nkv * LK_KV_PAGE * m->ahd;
    m->swa_page_elems = (size_t)m->n_swa * m->nkv * LK_KV_PAGE * m->ahd;
    const size_t kv_elems = (size_t)m->n_pages * m->page_elems + (size_t)m->max_seqs * m->swa_ring * m->swa_page_elems;
    size_t esz = m->kv_f16 ? 2 : 4;
    m->kcache = kv_elems ? kv_alloc(kv_elems * esz, &m->kv_map[0], &m->kv_map_len) : NULL;
    m->vcache = kv_elems && !cfg.mla ? kv_alloc(kv_elems * esz, &m->kv_map[1], &m->kv_map_len) : NULL;
    m->swa_lo = lk_xcalloc((size_t)m->max_seqs, sizeof(int32_t));
    m->swa_hi = lk_xmalloc(sizeof(int32_t) * (size_t)m->max_seqs);
    for (int i = 0; i < m->max_seqs; i++) m->swa_hi[i] = -1;
    m->page_ref = lk_xcalloc((size_t)m->n_pages, sizeof(int32_t));
    m->free_pages = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_pages);
    /* popped from the end: page 0 first */
    for (int64_t i = 0; i < m->n_pages; i++) m->free_pages[i] = (int32_t)(m->n_pages - 1 - i);
    m->n_free = m->n_pages;
    m->ptab = lk_xmalloc(sizeof(int32_t) * (size_t)m->max_seqs * m->max_pps);
    for (size_t i = 0; i < (size_t)m->max_seqs * m->max_pps; i++) m->ptab[i] = -1;
    m->seq_len = lk_xcalloc((size_t)m->max_seqs, sizeof(int32_t));
    m->items = lk_xmalloc(sizeof(lk_batch_item) * (size_t)m->n_batch);
    m->item_row0 = lk_xmalloc(sizeof(int32_t) * (size_t)(m->n_batch + 1));
    m->row_item = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_batch);
    m->row_pos = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_batch);
    m->task0 = lk_xmalloc(sizeof(int64_t) * (size_t)(m->n_batch + 1));
    m->hgrp0 = lk_xmalloc(sizeof(int32_t) * (size_t)(m->nh + 1));
    m->out_rows = lk_xmalloc(sizeof(int32_t) * (size_t)m->n_batch);

    const size_t B = (size_t)m->n_batch;
    m->x = lk_xmalloc_aligned(sizeof(float) * B * d);
    m->xb = lk_xmalloc_aligned(sizeof(float) * B * LK_MAX(d, m->nh * hd));
    m->q = lk_xmalloc_aligned(sizeof(float) * B * m->nh * m->ahd);
    m->k = lk_xmalloc_aligned(sizeof(float) * B * m->nkv * hd);
    m->v = lk_xmalloc_aligned(sizeof(float) * B * m->nkv * hd);
    m->att = lk_xmalloc_aligned(sizeof(float) * B * m->nh * m->ahd);
    m->o = lk_xmalloc_aligned(sizeof(float) * B * d);
    m->hg = lk_xmalloc_aligned(sizeof(float) * B * m->nff);
    m->hu = lk_xmalloc_aligned(sizeof(float) * B * m->nff);
    m->scores = lk_xmalloc_aligned(sizeof(float) * (size_t)lk_pool_size(m->pool) * attn_buf_floats(m));
    /* defined from the start: a block's softmax loads whole vectors of its rows, keys no task wrote included */
    memset(m->scores, 0, sizeof(float) * (size_t)lk_pool_size(m->pool) * attn_buf_floats(m));
    if (cfg.mla) { /* defined from the start: kv_keys's pages are read whole */
        m->kvw = lk_xmalloc_aligned(sizeof(float) * (size_t)lk_pool_size(m->pool) * kvw_floats(m));
        memset(m->kvw, 0, sizeof(float) * (size_t)lk_pool_size(m->pool) * kvw_floats(m));
    }
    int64_t maxcols = LK_MAX(LK_MAX(d, m->nff), (int64_t)m->nh * hd);
    if (cfg.mla) {
        maxcols = LK_MAX(maxcols, cfg.q_lora);
        m->mqa = lk_xmalloc_aligned(sizeof(float) * B * cfg.q_lora);
        m->mkva = lk_xmalloc_aligned(sizeof(float) * B * m->ahd);
        m->mqb = lk_xmalloc_aligned(sizeof(float) * B * m->nh * cfg.k_head);
        m->mvo = lk_xmalloc_aligned(sizeof(float) * B * m->nh * hd);
        /* F32 activations are the widest of any type */
        m->hact_stride = ((size_t)LK_MAX(cfg.qk_nope, cfg.kv_lora) * sizeof(float) + 63) & ~(size_t)63;
        m->hact = lk_xmalloc_aligned(m->hact_stride * B * (size_t)lk_pool_size(m->pool));
    }
    m->act = lk_xmalloc_aligned(lk_matmul_scratch_bytes(maxcols, (int64_t)B));
    if (cfg.n_expert) moe_scratch_alloc(m);
    if (cfg.n_recurrent) lk_deltanet_alloc(m);
    if (cfg.attn_gate) m->gate = lk_xmalloc_aligned(sizeof(float) * B * (size_t)LK_MAX(m->nh * 2 * hd, 1));
    *out = m;
    return LK_OK;
}

const lk_model_config *lk_model_cfg(const lk_model *m) { return &m->cfg; }
const lk_slice *lk_model_slice(const lk_model *m) { return &m->sl; }
int lk_model_n_ctx(const lk_model *m) { return m->n_ctx; }
int lk_model_n_batch(const lk_model *m) { return m->n_batch; }
int lk_model_threads(const lk_model *m) { return lk_pool_size(m->pool); }
lk_pool *lk_model_pool(const lk_model *m) { return m->pool; }
void lk_model_set_hooks(lk_model *m, const lk_tp_hooks *h) { if (h) m->hooks = *h; else memset(&m->hooks, 0, sizeof m->hooks); }
uint64_t lk_model_weight_bytes(const lk_model *m) { return m->weight_bytes; }
float *lk_model_hidden(lk_model *m) { return m->x; }

/* ---- sequences and pages ---- */

int lk_model_max_seqs(const lk_model *m) { return m->max_seqs; }
bool lk_model_recurrent(const lk_model *m) { return m->cfg.n_recurrent > 0; }
int lk_model_seq_len(const lk_model *m, int seq) { return seq >= 0 && seq < m->max_seqs ? m->seq_len[seq] : 0; }
int64_t lk_model_pages_total(const lk_model *m) { return m->n_pages; }
int64_t lk_model_pages_free(const lk_model *m) { return m->n_free; }

static int32_t *ptab_of(const lk_model *m, int seq) { return m->ptab + (size_t)seq * m->max_pps; }

int lk_model_swa_ring(const lk_model_config *c, int n_ctx, int n_batch) {
    if (c->swa_window <= 0) return 0;
    const int nb = LK_MIN(n_batch > 0 ? n_batch : 512, n_ctx), pps = (n_ctx + LK_KV_PAGE - 1) / LK_KV_PAGE;
    const int64_t ring = ((int64_t)c->swa_window - 1 + nb + LK_KV_PAGE - 1) / LK_KV_PAGE + 1;
    return ring < pps ? (int)ring : 0;
}

int lk_model_paged_layers(const lk_model_config *c, int l0, int l1, int ring, int *ring_layers) {
    int n = 0, r = 0;
    for (int l = LK_MAX(l0, 0); l < l1 && l < c->n_layer; l++) { /* a slice from a peer is checked at load */
        if (lk_model_layer_recurrent(c, l)) continue;
        if (ring && lk_model_layer_swa(c, l)) r++;
        else n++;
    }
    if (ring_layers) *ring_layers = r;
    return n;
}

uint64_t lk_model_kv_bytes(const lk_model *m) {
    const uint64_t elems = (uint64_t)m->n_pages * m->page_elems + (uint64_t)m->max_seqs * m->swa_ring * m->swa_page_elems;
    return elems * (m->kv_f16 ? 2 : 4) * (m->vcache ? 2 : 1);
}

/* The first page a query at position n (the next one appended) reads in a
 * sliding-window layer. */
static int swa_first_page(const lk_model *m, int n) { return LK_MAX(0, n - m->cfg.swa_window + 1) / LK_KV_PAGE; }

bool lk_model_seq_can_keep(const lk_model *m, int seq, int n) {
    if (!m->swa_ring || n <= 0 || seq < 0 || seq >= m->max_seqs) return true;
    const int first = swa_first_page(m, n);
    return first >= m->swa_lo[seq] && first > m->swa_hi[seq] - m->swa_ring;
}

/* Error for a cut the ring cannot serve (model.h). */
static lk_status swa_gone(const lk_model *m, int seq, int n, const char *what, char *err, size_t errlen) {
    return lk_fail(err, errlen, LK_ERR_ARG, "%s: slot %d's sliding-window cache no longer holds positions %d..%d "
                   "(it keeps %d pages of %d positions); recompute that prefix instead", what, seq,
                   LK_MAX(0, n - m->cfg.swa_window + 1), n - 1, m->swa_ring, LK_KV_PAGE);
}

static void page_release(lk_model *m, int32_t pg) {
    LK_ASSERT(pg >= 0 && pg < m->n_pages && m->page_ref[pg] > 0);
    if (--m->page_ref[pg] == 0) m->free_pages[m->n_free++] = pg;
}

int64_t lk_model_pages_needed(const lk_model *m, int seq, int n) {
    if (seq < 0 || seq >= m->max_seqs || n <= 0) return 0;
    const int32_t *pt = ptab_of(m, seq);
    int pos0 = m->seq_len[seq];
    int64_t need = 0;
    for (int j = pos0 / LK_KV_PAGE; j <= (pos0 + n - 1) / LK_KV_PAGE && j < m->max_pps; j++)
        if (pt[j] < 0 || m->page_ref[pt[j]] > 1) need++;
    return need;
}

static lk_status check_seq(const lk_model *m, int seq, const char *what, char *err, size_t errlen) {
    if (seq < 0 || seq >= m->max_seqs)
        return lk_fail(err, errlen, LK_ERR_ARG, "%s: sequence slot %d out of range (%d slots)", what, seq, m->max_seqs);
    return LK_OK;
}

lk_status lk_model_seq_keep(lk_model *m, int seq, int n, char *err, size_t errlen) {
    lk_status st = check_seq(m, seq, "keep", err, errlen);
    if (st) return st;
    if (n < 0 || n > m->seq_len[seq])
        return lk_fail(err, errlen, LK_ERR_ARG, "keep: slot %d holds %d positions, cannot keep %d", seq, m->seq_len[seq], n);
    if (m->cfg.n_recurrent && n > 0 && n < m->seq_len[seq])
        return lk_fail(err, errlen, LK_ERR_ARG, "keep: slot %d holds %d positions of a recurrent model, whose state "
                       "cannot go back to %d (only 0 or all)", seq, m->seq_len[seq], n);
    if (n == 0) lk_deltanet_reset(m, seq);
    if (!lk_model_seq_can_keep(m, seq, n)) return swa_gone(m, seq, n, "keep", err, errlen);
    if (n == 0) m->swa_lo[seq] = 0, m->swa_hi[seq] = -1;
    int32_t *pt = ptab_of(m, seq);
    for (int j = (n + LK_KV_PAGE - 1) / LK_KV_PAGE; j < m->max_pps && pt[j] >= 0; j++) {
        page_release(m, pt[j]);
        pt[j] = -1;
    }
    m->seq_len[seq] = n;
    return LK_OK;
}

lk_status lk_model_seq_fork(lk_model *m, int dst, int src, int n, char *err, size_t errlen) {
    lk_status st;
    if ((st = check_seq(m, dst, "fork", err, errlen)) || (st = check_seq(m, src, "fork", err, errlen))) return st;
    if (dst == src || n < 0 || n > m->seq_len[src])
        return lk_fail(err, errlen, LK_ERR_ARG, "fork: slot %d from slot %d (%d positions) with %d positions", dst, src,
                       m->seq_len[src], n);
    if (m->cfg.n_recurrent && n > 0 && n < m->seq_len[src])
        return lk_fail(err, errlen, LK_ERR_ARG, "fork: slot %d holds %d positions of a recurrent model; its state is "
                       "there only for all of them, not for a prefix of %d", src, m->seq_len[src], n);
    if (!lk_model_seq_can_keep(m, src, n)) return swa_gone(m, src, n, "fork", err, errlen);
    if ((st = lk_model_seq_keep(m, dst, 0, err, errlen))) return st;
    if (n > 0) lk_deltanet_copy(m, dst, src);
    const int32_t *ps = ptab_of(m, src);
    int32_t *pd = ptab_of(m, dst);
    for (int j = 0; j < (n + LK_KV_PAGE - 1) / LK_KV_PAGE; j++) {
        pd[j] = ps[j];
        m->page_ref[ps[j]]++;
    }
    if (m->swa_ring && n > 0) {
        /* the ring entries of the window the next position sees */
        const int first = swa_first_page(m, n), last = (n - 1) / LK_KV_PAGE;
        const size_t eb = m->swa_page_elems * (m->kv_f16 ? 2 : 4), base = (size_t)m->n_pages * m->page_elems;
        for (int j = first; j <= last && eb; j++) {
            const size_t from = base + ((size_t)src * m->swa_ring + (size_t)(j % m->swa_ring)) * m->swa_page_elems,
                         to = base + ((size_t)dst * m->swa_ring + (size_t)(j % m->swa_ring)) * m->swa_page_elems;
            const size_t es = m->kv_f16 ? 2 : 4;
            memcpy((char *)m->kcache + to * es, (char *)m->kcache + from * es, eb);
            if (m->vcache) memcpy((char *)m->vcache + to * es, (char *)m->vcache + from * es, eb);
        }
        m->swa_lo[dst] = first;
        m->swa_hi[dst] = last;
    }
    m->seq_len[dst] = n;
    return LK_OK;
}

/* Makes positions [pos0, pos0+n) of seq writable: new pages, and private
 * copies of shared ones. The caller checked the free count. */
static void pages_take(lk_model *m, int seq, int pos0, int n) {
    int32_t *pt = ptab_of(m, seq);
    const size_t es = m->kv_f16 ? 2 : 4, bytes = (size_t)LK_KV_PAGE * m->ahd * es,
                 stride = (size_t)m->n_pages * bytes; /* from one (layer, KV head)'s pages to the next's */
    const size_t parts = (size_t)m->n_kv_layers * m->nkv;
    for (int j = pos0 / LK_KV_PAGE; j <= (pos0 + n - 1) / LK_KV_PAGE; j++) {
        if (pt[j] >= 0 && m->page_ref[pt[j]] == 1) continue;
        LK_ASSERT(m->n_free > 0);
        int32_t pg = m->free_pages[--m->n_free];
        m->page_ref[pg] = 1;
        if (pt[j] >= 0) { /* copy on write, a (layer, KV head) at a time */
            for (size_t i = 0; i < parts; i++) {
                const size_t to = i * stride + (size_t)pg * bytes, from = i * stride + (size_t)pt[j] * bytes;
                memcpy((char *)m->kcache + to, (char *)m->kcache + from, bytes);
                if (m->vcache) memcpy((char *)m->vcache + to, (char *)m->vcache + from, bytes);
            }
            page_release(m, pt[j]);
        }
        pt[j] = pg;
    }
}

/* The local KV head that local query head h attends to. */
static int kv_head(const lk_model *m, int h) {
    return (m->sl.head0 + h) / (m->cfg.n_head / m->cfg.n_head_kv) - m->sl.kv_head0;
}

/* Decode attention takes the query heads that read the same KV head
 * together (grouped-query attention): one pass over the group's keys and
 * values instead of one per head, the heads scored together by
 * attn_rows's kernels. The size of a group only cuts the work: each query
 * gets the same bits whatever the queries beside it, so it is chosen for
 * the pool: as many heads as share a KV head (at most ATT_QB, a task's
 * queries), fewer when the step's decode items would then leave threads
 * without a task. Groups are runs of consecutive local heads with the same
 * KV head (kv_head), cut at that size. */
static void head_groups(lk_model *m, int n_dec) {
    const int group = m->cfg.n_head / m->cfg.n_head_kv, nth = lk_pool_size(m->pool);
    int g = (int)LK_MIN((int64_t)n_dec * m->nh / LK_MAX(nth, 1), (int64_t)LK_MIN(group, ATT_QB));
    g = LK_MAX(g, 1);
    if (g == m->hgrp_size) return;
    m->hgrp_size = g;
    m->n_hgrp = 0;
    for (int h = 0, e; h < m->nh; h = e) {
        for (e = h + 1; e < m->nh && e - h < g && kv_head(m, e) == kv_head(m, h); e++) {}
        m->hgrp0[m->n_hgrp++] = h;
    }
    m->hgrp0[m->n_hgrp] = m->nh;
}

lk_status lk_model_batch(lk_model *m, const lk_batch_item *items, int n_items, char *err, size_t errlen) {
    m->n_items = m->n_rows = 0;
    if (n_items < 1 || n_items > m->n_batch)
        return lk_fail(err, errlen, LK_ERR_ARG, "batch of %d items (1..%d)", n_items, m->n_batch);
    int rows = 0;
    int64_t need = 0;
    for (int i = 0; i < n_items; i++) {
        const lk_batch_item *it = &items[i];
        lk_status st = check_seq(m, it->seq, "batch", err, errlen);
        if (st) return st;
        for (int k = 0; k < i; k++)
            if (items[k].seq == it->seq)
                return lk_fail(err, errlen, LK_ERR_ARG, "batch: slot %d appears twice", it->seq);
        if (it->n < 1 || it->n > m->n_batch - rows)
            return lk_fail(err, errlen, LK_ERR_ARG, "batch: item %d has %d tokens; the batch holds %d", i, it->n, m->n_batch);
        if (it->pos0 != m->seq_len[it->seq])
            return lk_fail(err, errlen, LK_ERR_ARG, "batch: slot %d holds %d positions but item %d starts at %d", it->seq,
                           m->seq_len[it->seq], i, it->pos0);
        if ((int64_t)it->pos0 + it->n > m->n_ctx)
            return lk_fail(err, errlen, LK_ERR_ARG, "context full: positions %d..%d of slot %d do not fit in --ctx %d",
                           it->pos0, it->pos0 + it->n - 1, it->seq, m->n_ctx);
        rows += it->n;
        need += lk_model_pages_needed(m, it->seq, it->n);
    }
    if (need > m->n_free)
        return lk_fail(err, errlen, LK_ERR_NOMEM, "KV cache full: the batch needs %lld pages, %lld of %lld are free (--kv-budget)",
                       (long long)need, (long long)m->n_free, (long long)m->n_pages);
    int n_dec = 0;
    for (int i = 0; i < n_items; i++) n_dec += items[i].n == 1;
    head_groups(m, n_dec);
    int64_t tasks = 0;
    rows = 0;
    for (int i = 0; i < n_items; i++) {
        const lk_batch_item *it = &items[i];
        pages_take(m, it->seq, it->pos0, it->n);
        m->seq_len[it->seq] = it->pos0 + it->n;
        m->swa_hi[it->seq] = LK_MAX(m->swa_hi[it->seq], (it->pos0 + it->n - 1) / LK_KV_PAGE);
        m->items[i] = *it;
        m->item_row0[i] = rows;
        m->task0[i] = tasks;
        for (int t = 0; t < it->n; t++) {
            m->row_item[rows + t] = i;
            m->row_pos[rows + t] = it->pos0 + t;
        }
        rows += it->n;
        tasks += it->n == 1 ? m->n_hgrp : (int64_t)((it->n + ATT_QB - 1) / ATT_QB) * m->nh;
    }
    m->item_row0[n_items] = rows;
    m->task0[n_items] = tasks;
    m->n_items = n_items;
    m->n_rows = rows;
    return LK_OK;
}

int lk_model_batch_rows(const lk_model *m) { return m->n_rows; }

/* ---------------------------------------------------------------- forward */

lk_status lk_model_embed(lk_model *m, const int32_t *tokens, int n, float *x) {
    LK_ASSERT(n >= 0 && n <= m->n_batch);
    const lk_gguf_tensor *e = m->tok_embd;
    size_t rb = 0;
    LK_ASSERT(lk_type_row_bytes(e->type, (int64_t)e->ne[0], &rb));
    for (int t = 0; t < n; t++) {
        LK_ASSERT(tokens[t] >= 0 && tokens[t] < m->cfg.n_vocab); /* callers validate ids */
        float *xt = x + (size_t)t * m->cfg.n_embd;
        lk_dequantize_row((lk_type)e->type, (const char *)e->data + (size_t)tokens[t] * rb, xt, m->cfg.n_embd);
        if (m->cfg.emb_scale != 1.0f)
            for (int64_t i = 0; i < m->cfg.n_embd; i++) xt[i] *= m->cfg.emb_scale;
    }
    return LK_OK;
}

/* Rotates v (one head) to position pos; swa: with the sliding-window
 * layers' table. */
static void rope_at(const lk_model *m, bool swa, float *v, int pos) {
    const int half = m->cfg.rope_dim / 2;
    const float *c = (swa ? m->rope_cos_swa : m->rope_cos) + (size_t)pos * half,
                *s = (swa ? m->rope_sin_swa : m->rope_sin) + (size_t)pos * half;
    if (m->cfg.rope_neox) {
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * c[i] - b * s[i];
            v[i + half] = a * s[i] + b * c[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * c[i] - b * s[i];
            v[2 * i + 1] = a * s[i] + b * c[i];
        }
    }
}
static void rope(const lk_model *m, float *v, int pos) { rope_at(m, false, v, pos); }

typedef struct {
    lk_model *m;
    int li;
} attn_job;

/* Offset (in elements, into kcache/vcache) of the LK_KV_PAGE keys/values
 * of page j of slot seq for KV head kvh of layer li (both local). */
static size_t kv_page_kv(const lk_model *m, int seq, int j, int li, int kvh) {
    const layer_w *w = &m->layers[li];
    LK_ASSERT(m->kv_li[li] >= 0);
    const size_t part = (size_t)m->kv_li[li] * m->nkv + (size_t)kvh, pe = (size_t)LK_KV_PAGE * m->ahd;
    if (m->swa_ring && w->swa) /* the slot's ring (model.h) */
        return (size_t)m->n_pages * m->page_elems +
               ((size_t)seq * m->swa_ring + (size_t)(j % m->swa_ring)) * m->swa_page_elems + part * pe;
    return (part * (size_t)m->n_pages + (size_t)ptab_of(m, seq)[j]) * pe;
}
/* ... for the KV head that query head h (local) attends to. */
static size_t kv_page(const lk_model *m, int seq, int j, int li, int h) {
    return kv_page_kv(m, seq, j, li, kv_head(m, h));
}

/* The first position a query at pos sees in layer li: pos - window + 1
 * in a sliding-window layer (llama.cpp masks key j when pos - j >= window),
 * else 0. */
static int attn_lo(const lk_model *m, int li, int pos) {
    return m->layers[li].swa ? LK_MAX(0, pos - m->cfg.swa_window + 1) : 0;
}

/* Rows [0, np) of page pg's keys or values (cache: kcache or vcache) for
 * the KV head of local head h in layer li: an F32 cache's rows where they
 * are, an F16 cache's widened into buf (exact, so both caches run the same
 * F32 arithmetic on the values they hold). */
static const float *kv_rows(const lk_model *m, const void *cache, int seq, int pg, int li, int h, int np, float *buf) {
    const size_t at = kv_page(m, seq, pg, li, h);
    if (!m->kv_f16) return (const float *)cache + at;
    lk_vec_f16_to_f32(buf, (const uint16_t *)cache + at, (int64_t)np * m->ahd);
    return buf;
}

/* Page pg's keys for local head h in layer li, transposed (kernels.h:
 * element d of key p at d LK_ATT_KW + p), as F32: an F32 cache's page
 * where it is (the cache keeps keys so, qk_prepare); MLA's latent rows,
 * which are also its values, read as rows (kv_rows, widened into tmp for
 * an F16 cache) and turned into buf (np of them). An F16 cache's other
 * pages go to the kernels as they are (attn_rows). */
_Static_assert(LK_KV_PAGE == LK_ATT_KW, "a page of keys is a page of the attention kernels");
static const float *kv_keys(const lk_model *m, int seq, int pg, int li, int h, int np, float *buf, float *tmp) {
    const int64_t hd = m->ahd;
    if (m->cfg.mla) {
        const float *r = kv_rows(m, m->kcache, seq, pg, li, h, np, tmp);
        for (int p = 0; p < np; p++)
            for (int64_t d = 0; d < hd; d++) buf[d * LK_KV_PAGE + p] = r[(size_t)p * (size_t)hd + (size_t)d];
        return buf;
    }
    LK_ASSERT(!m->kv_f16);
    return (const float *)m->kcache + kv_page(m, seq, pg, li, h);
}

/* Asks for share `part` of nparts of page pg's first np rows (keys or
 * values of local head h) ahead of their use: a head's pages lie apart
 * where its sequence's pages were not taken in a row (sequences prefilled
 * together interleave theirs), and a decode query reads each once, so
 * without it such a page began with a stall on memory that the hardware's
 * stream detection does not hide. */
static void kv_prefetch(const lk_model *m, const void *cache, int seq, int pg, int li, int h, int np, int part,
                        int nparts) {
    const size_t es = m->kv_f16 ? 2 : 4, e = (size_t)np * (size_t)m->ahd * es;
    const char *p = (const char *)cache + kv_page(m, seq, pg, li, h) * es;
    const size_t lines = (e + 63) / 64, l0 = lines * (size_t)part / (size_t)nparts, l1 = lines * (size_t)(part + 1) / (size_t)nparts;
    for (size_t l = l0; l < l1; l++) __builtin_prefetch(p + 64 * l, 0, 3);
}
/* ... if the sequence has page pg (npos positions) */
static void kv_next(const lk_model *m, const void *cache, int seq, int li, int h, int pg, int npos, int part,
                    int nparts) {
    if (pg * LK_KV_PAGE < npos) /* a page of keys (not MLA's) is transposed: all of it */
        kv_prefetch(m, cache, seq, pg, li, h,
                    cache == m->kcache && !m->cfg.mla ? LK_KV_PAGE : LK_MIN(LK_KV_PAGE, npos - pg * LK_KV_PAGE), part,
                    nparts);
}
enum { KV_SLICE = 8 }; /* keys (positions) per slice of a page, each slice asking for its share of the next page */

/* One task's attention: nq <= ATT_QB queries that read the KV head of
 * local head h (a decode item's head group, or a block of a prefill item's
 * queries of one head), FlashAttention's order with the keys in the lanes
 * of the vector kernels (kernels.h: lk_vec_attn_qk, _softmax, _av). Query
 * g (row q + g qs, output row out + g os) sees positions [lo[g], npos[g]).
 * The keys go in blocks of ATT_KB pages, aligned to position 0: the
 * queries' scores against the block's pages of keys (a row of S per
 * query), the block's step of the running softmax (the outputs scaled
 * where a maximum grew), then the weighted sums of the block's pages of
 * values, 4 queries per pass; the sums divide at the end. A block's scores
 * (ATT_QB rows of ATT_KB x LK_KV_PAGE floats) stay in L1. Before, each
 * query's whole row of scores was written, then scaled, searched for its
 * maximum, exponentiated and read by the sums: at 2048 positions a
 * 16-query block's rows (128 KB) crossed L2 five times.
 *
 * The keys are in the lanes because a task may have one query or sixteen:
 * a decode head group on many threads is one or two heads (head_groups),
 * and kernels with the queries in the lanes ran those at 2 of 16 lanes
 * (decode of one sequence at 2048 positions on 16 threads: 8-17 % slower
 * than the dot products before). A page of keys is kept transposed for
 * it (kv_keys).
 *
 * Every query's arithmetic is the same whichever queries share its task:
 * the kernels work query by query, blocks begin at the same positions, and
 * keys a query does not see weigh exactly 0. So a row's bits depend on its
 * own sequence only, and decode gives prefill's bits. Keys past a query's
 * causal limit (or before its window) are scored and ignored.
 *
 * pf (decode): the block's values are asked for before its scores are
 * computed, and the next block's keys while its values are summed, a share
 * before each slice of KV_SLICE keys: spread so, the requests wait less
 * for free miss buffers (decode attention at 4 x 1024 positions on a Zen
 * 5, when the order was a page at a time: 10.6-11.3 -> 8.8-9.9 ms a step
 * with an F16 cache, 12.4-13.9 -> 11.3-11.8 with F32). Spreading the
 * values' requests over parts of the scores' work measured no better on
 * the 16-core Xeon. A prefill block reads each page for 16 queries, from
 * cache. */
static void attn_rows(lk_model *m, int li, int seq, int h, const float *q, size_t qs, float *out, size_t os, int nq,
                      const int32_t *lo, const int32_t *npos, float *S, float *wk, float *wv, bool pf) {
    const int hd = m->ahd;
    const void *vcache = m->vcache ? m->vcache : m->kcache; /* MLA: the values are the latent rows' first kv_lora */
    const size_t ss = (size_t)ATT_KB * LK_KV_PAGE;
    if (qs != (size_t)hd) { /* a prefill block's rows lie a token's heads apart, in the same cache sets: together */
        float *qc = S + (size_t)ATT_QB * ss;
        for (int g = 0; g < nq; g++) memcpy(qc + (size_t)g * hd, q + (size_t)g * qs, sizeof(float) * (size_t)hd);
        q = qc;
        qs = (size_t)hd;
    }
    int lmin = lo[0], nmax = npos[0];
    for (int g = 0; g < nq; g++) {
        memset(out + (size_t)g * os, 0, sizeof(float) * (size_t)hd);
        lmin = LK_MIN(lmin, lo[g]);
        nmax = LK_MAX(nmax, npos[g]);
    }
    float mx[ATT_QB], al[ATT_QB];
    double sum[ATT_QB];
    int32_t a[ATT_QB], b[ATT_QB];
    const float *K[ATT_KB];
    const uint16_t *Kh[ATT_KB];
    const bool h16 = m->kv_f16 && !m->cfg.mla; /* F16 pages read in place, widened by the kernels */
    for (int g = 0; g < nq; g++) { mx[g] = -INFINITY; sum[g] = 0; }
    const int pg0 = lmin / LK_KV_PAGE, ns = pf ? LK_KV_PAGE / KV_SLICE : 1, sl_keys = pf ? KV_SLICE : LK_KV_PAGE;
    for (int kb = pg0 / ATT_KB; kb * ATT_KB * LK_KV_PAGE < nmax; kb++) {
        const int bp = kb * ATT_KB * LK_KV_PAGE, nb = LK_MIN(ATT_KB * LK_KV_PAGE, nmax - bp);
        const int p0 = LK_MAX(pg0, kb * ATT_KB), p1 = (bp + nb - 1) / LK_KV_PAGE + 1;
        const int o = p0 * LK_KV_PAGE - bp, nk = bp + nb - p0 * LK_KV_PAGE;
        for (int pg = p0; pg < p1; pg++) {
            if (pf && kb == pg0 / ATT_KB) kv_next(m, m->kcache, seq, li, h, pg, nmax, 0, 1);
            if (h16) Kh[pg - p0] = (const uint16_t *)m->kcache + kv_page(m, seq, pg, li, h);
            else
                K[pg - p0] = kv_keys(m, seq, pg, li, h, LK_MIN(LK_KV_PAGE, nmax - pg * LK_KV_PAGE),
                                     wk ? wk + (size_t)(pg - p0) * LK_KV_PAGE * hd : NULL, wv); /* wv: free until the sums */
        }
        if (pf)
            for (int pg = p0; pg < p1; pg++) kv_next(m, vcache, seq, li, h, pg, nmax, 0, 1);
        if (h16) lk_vec_attn_qk_f16(S + o, ss, q, qs, nq, Kh, nk, hd);
        else lk_vec_attn_qk(S + o, ss, q, qs, nq, K, nk, hd);
        for (int g = 0; g < nq; g++) {
            a[g] = LK_MIN(LK_MAX(lo[g] - bp, 0), nb);
            b[g] = LK_MIN(LK_MAX(npos[g] - bp, 0), nb);
            if (b[g] <= a[g]) a[g] = b[g] = 0;
        }
        lk_vec_attn_softmax(S, ss, nb, a, b, nq, m->cfg.kq_scale, m->cfg.attn_softcap, mx, sum, al);
        for (int g = 0; g < nq; g++)
            if (al[g] != 1.f) lk_vec_scale(out + (size_t)g * os, hd, al[g]);
        const int q0 = (kb + 1) * ATT_KB; /* the next block's first page */
        for (int pg = p0; pg < p1; pg++) {
            const int np = LK_MIN(LK_KV_PAGE, nmax - pg * LK_KV_PAGE), op = pg * LK_KV_PAGE - bp;
            const float *V = h16 ? NULL : kv_rows(m, vcache, seq, pg, li, h, np, wv);
            const uint16_t *Vh = h16 ? (const uint16_t *)vcache + kv_page(m, seq, pg, li, h) : NULL;
            for (int s0 = 0, sl = 0; sl < ns; s0 += sl_keys, sl++) {
                if (pf) kv_next(m, m->kcache, seq, li, h, q0 + pg - p0, nmax, sl, ns);
                for (int g = 0; g < nq && s0 < np; g += 4) {
                    const int n4 = LK_MIN(4, nq - g);
                    int lim = 0; /* the pass's last position seen, + 1 */
                    for (int i = g; i < g + n4; i++) lim = LK_MAX(lim, npos[i]);
                    const int n = LK_MIN(LK_MIN(sl_keys, np - s0), lim - pg * LK_KV_PAGE - s0);
                    if (n > 0 && h16)
                        lk_vec_attn_av_f16(out + (size_t)g * os, os, S + (size_t)g * ss + (size_t)(op + s0), ss, 1,
                                           Vh + (size_t)s0 * hd, n, n4, hd);
                    else if (n > 0)
                        lk_vec_attn_av_f32(out + (size_t)g * os, os, S + (size_t)g * ss + (size_t)(op + s0), ss, 1,
                                           V + (size_t)s0 * hd, n, n4, hd);
                }
            }
        }
    }
    for (int g = 0; g < nq; g++) lk_vec_scale(out + (size_t)g * os, hd, (float)(1.0 / sum[g]));
}

/* The thread's attention buffer: a key block's scores, a row per query,
 * and the queries (attn_rows) */
static size_t attn_buf_floats(const lk_model *m) { return (size_t)ATT_QB * (ATT_KB * LK_KV_PAGE + m->ahd); }
/* The thread's widened pages (kv_keys, kv_rows): ATT_KB of keys, one of values */
static size_t kvw_floats(const lk_model *m) { return (size_t)(ATT_KB + 1) * LK_KV_PAGE * m->ahd; }

/* Attention, prefill and decode, either cache: one task per (item, head,
 * block of ATT_QB of the item's queries), or for an item of one query
 * (decode) one per head group (head_groups); each is one attn_rows. Blocks
 * never mix sequences. */
static void attn_block_fn(void *arg, int ith, int nth) {
    attn_job *j = arg;
    lk_model *m = j->m;
    const int hd = m->ahd;
    float *buf = m->scores + (size_t)ith * attn_buf_floats(m);
    float *wk = m->kvw ? m->kvw + (size_t)ith * kvw_floats(m) : NULL, *wv = wk ? wk + (size_t)ATT_KB * LK_KV_PAGE * hd : NULL;
    const int64_t ntask = m->task0[m->n_items];
    int32_t lo[ATT_QB], npos[ATT_QB];
    int it = 0;
    for (int64_t task = ith; task < ntask; task += nth) {
        while (task >= m->task0[it + 1]) it++;
        const lk_batch_item *item = &m->items[it];
        const int64_t local = task - m->task0[it];
        const int r0 = m->item_row0[it];
        if (item->n == 1) {
            const int k = (int)local, h0 = m->hgrp0[k], nq = m->hgrp0[k + 1] - h0;
            const size_t qrow = (size_t)r0 * m->nh + (size_t)h0;
            for (int g = 0; g < nq; g++) { lo[g] = attn_lo(m, j->li, item->pos0); npos[g] = item->pos0 + 1; }
            attn_rows(m, j->li, item->seq, h0, m->q + qrow * hd, (size_t)hd, m->att + qrow * hd, (size_t)hd, nq, lo,
                      npos, buf, wk, wv, true);
            continue;
        }
        const int qb = (int)(local / m->nh), h = (int)(local % m->nh);
        const int t0 = qb * ATT_QB, t1 = LK_MIN(item->n, t0 + ATT_QB);
        const size_t os = (size_t)m->nh * hd, row = ((size_t)(r0 + t0) * m->nh + h) * hd;
        for (int t = t0; t < t1; t++) { lo[t - t0] = attn_lo(m, j->li, item->pos0 + t); npos[t - t0] = item->pos0 + t + 1; }
        attn_rows(m, j->li, item->seq, h, m->q + row, os, m->att + row, os, t1 - t0, lo, npos, buf, wk, wv, false);
    }
}

static lk_status allreduce(lk_model *m, float *x, int64_t n, int layer, const char *what) {
    if (!m->hooks.allreduce_sum) return LK_OK;
    const uint64_t t0 = lk_prof_t0();
    lk_status st = m->hooks.allreduce_sum(m->hooks.ctx, x, n, layer, what);
    lk_prof_add(LK_PROF_COMM, t0);
    return st;
}

/* ---- per-row work beside the matrices ----
 * RMSNorm of a batch's rows and the residual adds are independent per row:
 * from PAR_ROWS rows on they are spread over the pool (each row's
 * arithmetic unchanged, so the bits do not depend on the split). Serial,
 * they and attention's q/k preparation were 15-18 % of a 16-token step at
 * 16 threads (bench --profile, BENCHMARKS.md); one row stays inline, where a
 * dispatch would cost more than it saves. The q/k preparation goes by
 * heads instead, over the pool even for one row (qk_prepare_rows). */
enum { PAR_ROWS = 4 };

/* fn over a batch's n rows: on the pool (a task per thread, at most one per
 * row) from PAR_ROWS rows on, else inline; fn splits the rows by its task */
static void run_rows(lk_model *m, lk_pool_fn fn, void *arg, int n) {
    const int nt = LK_MIN(n, lk_pool_size(m->pool));
    if (n >= PAR_ROWS && nt > 1) lk_pool_run_k(m->pool, LK_PROF_PAR, fn, arg, nt);
    else fn(arg, 0, 1);
}

typedef struct {
    float *out;
    const float *x, *w;
    int64_t d;
    float eps;
    int n;
} norm_job;

static void norm_rows_fn(void *arg, int ith, int nth) {
    const norm_job *j = arg;
    int64_t a, b;
    lk_split_range(j->n, 1, ith, nth, &a, &b);
    for (int64_t t = a; t < b; t++) lk_rmsnorm(j->out + t * j->d, j->x + t * j->d, j->w, j->d, j->eps);
}

/* out[t] = rmsnorm(x[t]) * w for t < n rows of d (out may be x) */
static void norm_rows(lk_model *m, float *out, const float *x, const float *w, int n, int64_t d) {
    norm_job j = { out, x, w, d, m->cfg.rms_eps, n };
    run_rows(m, norm_rows_fn, &j, n);
}

/* A token's q/k after the projections: biases, q/k norms, RoPE, and its
 * keys and values into the KV cache, head by head. */

/* Row t's query head h: bias, q norm, RoPE, in place */
static void qk_prepare_q(lk_model *m, int li, int t, int h) {
    const lk_model_config *c = &m->cfg;
    const layer_w *w = &m->layers[li];
    const int64_t hd = c->head_dim, qd = (int64_t)m->nh * hd;
    float *q = m->q + t * qd + h * hd;
    if (w->bq)
        for (int64_t i = 0; i < hd; i++) q[i] += w->bq[h * hd + i];
    if (w->q_norm) lk_rmsnorm(q, q, w->q_norm, hd, c->rms_eps);
    rope_at(m, w->swa, q, m->row_pos[t]);
}

/* Row t's KV head h: biases, k norm, RoPE, then the key written transposed
 * into its page (kv_keys) and the value as a row */
static void qk_prepare_kv(lk_model *m, int li, int t, int h) {
    const lk_model_config *c = &m->cfg;
    const layer_w *w = &m->layers[li];
    const int64_t hd = c->head_dim, kvd = (int64_t)m->nkv * hd;
    float *k = m->k + t * kvd + h * hd, *v = m->v + t * kvd + h * hd;
    const int pos = m->row_pos[t], seq = m->items[m->row_item[t]].seq;
    if (w->bq)
        for (int64_t i = 0; i < hd; i++) { k[i] += w->bk[h * hd + i]; v[i] += w->bv[h * hd + i]; }
    if (w->k_norm) lk_rmsnorm(k, k, w->k_norm, hd, c->rms_eps);
    rope_at(m, w->swa, k, pos);
    const size_t page = kv_page_kv(m, seq, pos / LK_KV_PAGE, li, h), kat = page + (size_t)(pos % LK_KV_PAGE),
                 at = page + (size_t)(pos % LK_KV_PAGE) * hd;
    if (m->kv_f16) {
        uint16_t *kc = (uint16_t *)m->kcache + kat, *vc = (uint16_t *)m->vcache + at;
        for (int i = 0; i < hd; i++) {
            kc[(size_t)i * LK_KV_PAGE] = lk_fp32_to_fp16(k[i]);
            vc[i] = lk_fp32_to_fp16(v[i]);
        }
    } else {
        for (int i = 0; i < hd; i++) ((float *)m->kcache)[kat + (size_t)i * LK_KV_PAGE] = k[i];
        memcpy((float *)m->vcache + at, v, sizeof(float) * hd);
    }
}

typedef struct {
    lk_model *m;
    int li;
} qk_job;

/* Task ith of nth. A decode row (an item of one token) goes by attention's
 * head groups, each to the task that will attend with it (attn_block_fn:
 * the item's tasks from task0, dealt round-robin), with its KV head going
 * with the head's first group: so the heads' RoPE'd rows and the key's
 * lines are in the cache of the thread that reads them next. A prefill
 * row goes whole to task t % nth. Every head's arithmetic is the same
 * whatever the split. */
static void qk_prepare_fn(void *arg, int ith, int nth) {
    const qk_job *j = arg;
    lk_model *m = j->m;
    for (int t = 0; t < m->n_rows; t++) {
        const int it = m->row_item[t];
        if (m->items[it].n > 1) {
            if (t % nth != ith) continue;
            for (int h = 0; h < m->nkv; h++) qk_prepare_kv(m, j->li, t, h);
            for (int h = 0; h < m->nh; h++) qk_prepare_q(m, j->li, t, h);
            continue;
        }
        for (int k = 0; k < m->n_hgrp; k++) {
            if ((m->task0[it] + k) % nth != ith) continue;
            const int h0 = m->hgrp0[k], kv = kv_head(m, h0);
            if (k == 0 || kv_head(m, m->hgrp0[k - 1]) != kv) qk_prepare_kv(m, j->li, t, kv);
            for (int h = h0; h < m->hgrp0[k + 1]; h++) qk_prepare_q(m, j->li, t, h);
        }
    }
}

/* The batch's queries and keys ready for attention: over the pool whenever
 * it has threads, even for one row. Inline, a decode row of TinyLlama's
 * 32 + 4 heads took 8 us a layer on the Xeon guest (the keys' transposed
 * writes 4 us of it: a line missed per dimension; the queries' RoPE 2 us),
 * 0.4 % of one thread's step and about 4 % of a 16-thread one. Over the
 * pool, with each head's work on the thread that attends with it,
 * attention, this job and the serial part together went from 7.4 to 6.1 %
 * of a 16-thread decode step on a 16-core Xeon, 4.8 to 3.6 % at 8 threads;
 * level at 2 threads on the guest (BENCHMARKS.md, thirty-seventh session). */
static void qk_prepare_rows(lk_model *m, int li) {
    qk_job qj = { m, li };
    const int nt = lk_pool_size(m->pool); /* attention's task count (attn_block_fn) */
    if (nt > 1) lk_pool_run_k(m->pool, LK_PROF_PAR, qk_prepare_fn, &qj, nt);
    else qk_prepare_fn(&qj, 0, 1);
}

/* The weights of the product that comes after the one about to run
 * (lk_matmul_prefetch_next): pool threads left without work meanwhile (a
 * product's tail, attention, the serial gaps) fetch their share of its
 * rows into their caches. Decode reads each weight once a step: a row
 * fetched while a thread would wait is one the product does not wait for
 * (BENCHMARKS.md, thirty-eighth session). The order, for the layers
 * of llama's shape: QKV -> Wo -> gate/up -> W2 -> the next layer's QKV, the
 * last W2 -> the output matrix (the last pipeline stage; an earlier
 * stage: its first layer's QKV) -> layer 0's QKV;
 * a MoE layer's Wo -> its router and shared expert, then (moe_ffn) its
 * routing -> the chosen experts' gate/up -> their down -> the next layer;
 * MLA's LoRA-down -> q_b -> k_b -> v_b -> Wo -> the FFN's input. The delta
 * net hints nothing of its own. */
static void next_up(lk_model *m, const lk_mat *a, const lk_mat *b, const lk_mat *c) {
    const lk_mat *W[3] = { a, b, c };
    lk_matmul_prefetch_next(m->pool, W, 3);
}

/* next_up with layer li's first product; li = the slice's layer count:
 * the output matrix on the last pipeline stage, else (a stage that sends
 * its rows on and waits for the next step's) its own first layer's */
static void next_layer(lk_model *m, int li) {
    if (li < m->sl.layer1 - m->sl.layer0) {
        const layer_w *w = &m->layers[li];
        if (w->rec || m->nh == 0) next_up(m, NULL, NULL, NULL);
        else if (m->cfg.mla) next_up(m, &w->wqa, &w->wkva, NULL);
        else next_up(m, &w->wq, &w->wk, &w->wv);
    } else if (m->sl.pp_rank == m->sl.pp_size - 1) {
        next_up(m, &m->wout, NULL, NULL);
    } else {
        next_layer(m, 0);
    }
}

/* next_up with layer w's FFN input: a MoE layer's router and shared
 * expert, a dense one's gate and up */
static void next_ffn(lk_model *m, const layer_w *w) {
    if (w->moe) next_up(m, &w->wr, &w->sh.w1, &w->sh.w3);
    else if (m->nff == 0) next_up(m, NULL, NULL, NULL);
    else next_up(m, &w->w1, &w->w3, NULL);
}

/* A layer half's output product o = W a into m->o. Where this rank holds
 * the whole sum (no all-reduce) and no post-norm comes between, the
 * residual add x += o is made by the product's own tasks, each on the rows
 * it just wrote (lk_matmul_residual): in decode a serial add over lines the
 * other cores wrote took 2 us a layer half (BENCHMARKS.md, thirty-sixth
 * session). half_done then skips its own (m->resid_done). */
static void out_product(lk_model *m, const lk_mat *W, const float *a, int64_t a_stride, int n, float *x,
                        const float *post_norm) {
    const int64_t d = m->cfg.n_embd;
    if (!m->hooks.allreduce_sum && !post_norm) {
        m->resid_bad = lk_matmul_residual(m->pool, W, a, a_stride, n, m->o, d, x, m->act);
        m->resid_done = true;
    } else {
        lk_matmul(m->pool, W, a, a_stride, n, m->o, d, m->act);
    }
}

/* This rank's share of attention for layer li over the current batch:
 * o = Wo_slice . attn(x). A rank without heads contributes zeros. */
static void attention(lk_model *m, int li, float *x) {
    const lk_model_config *c = &m->cfg;
    const layer_w *w = &m->layers[li];
    const int n = m->n_rows;
    const int64_t d = c->n_embd, hd = c->head_dim;
    const int64_t qd = (int64_t)m->nh * hd, kvd = (int64_t)m->nkv * hd;
    if (m->nh == 0) {
        memset(m->o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    const lk_mat *qkv[3] = {&w->wq, &w->wk, &w->wv};
    next_up(m, &w->wo, NULL, NULL);
    float *qout = w->gated ? m->gate : m->q; /* gated: per head [q | gate], split below */
    const int64_t qs = w->gated ? 2 * qd : qd;
    if (lk_matmul_can_fuse(qkv, 3)) {
        float *const ys[3] = {qout, m->k, m->v};
        const int64_t ss[3] = {qs, kvd, kvd};
        lk_matmul_fused_norm(m->pool, qkv, 3, x, w->attn_norm, c->rms_eps, m->xb, n, ys, ss, false, m->act);
    } else {
        norm_rows(m, m->xb, x, w->attn_norm, n, d);
        lk_matmul(m->pool, &w->wq, m->xb, d, n, qout, qs, m->act);
        lk_matmul(m->pool, &w->wk, m->xb, d, n, m->k, kvd, m->act);
        lk_matmul(m->pool, &w->wv, m->xb, d, n, m->v, kvd, m->act);
    }
    if (w->gated)
        for (int t = 0; t < n; t++)
            for (int h = 0; h < m->nh; h++)
                memcpy(m->q + t * qd + h * hd, m->gate + t * 2 * qd + h * 2 * hd, sizeof(float) * (size_t)hd);
    qk_prepare_rows(m, li);
    attn_job aj = { m, li };
    lk_pool_run_k(m->pool, LK_PROF_ATTN, attn_block_fn, &aj, lk_pool_size(m->pool));
    if (w->gated) /* the output gate: sigmoid(gate) on each head's result */
        for (int t = 0; t < n; t++)
            for (int h = 0; h < m->nh; h++) {
                float *a = m->att + t * qd + h * hd;
                const float *gt = m->gate + t * 2 * qd + h * 2 * hd + hd;
                for (int i = 0; i < hd; i++) a[i] *= 1.0f / (1.0f + expf(-gt[i]));
            }
    next_ffn(m, w);
    out_product(m, &w->wo, m->att, qd, n, x, w->post_attn_norm);
}

/* ---- multi-head latent attention (deepseek2; model.h) ----------------------
 * Per-head matrices (attn_k_b, attn_v_b): y(t, h) = W_h . x(t, h) for every
 * token t and local head h, W_h = rows [h R, (h+1) R) of W. One dispatch:
 * tasks are (head, row chunk), with a head's rows cut into chunks only when
 * threads outnumber heads; a thread quantises the activations of each head
 * it takes into its own scratch, and multiplies all n tokens at once, so a
 * head's rows are read once per step and a token's result does not depend
 * on the batch. */
typedef struct {
    lk_model *m;
    const lk_mat *w;
    int64_t R;
    const float *x;
    int64_t x_ts, x_hs;       /* x(t, h) at x + t x_ts + h x_hs, w->cols floats */
    float *y;
    int64_t y_ts, y_hs;       /* y(t, h) at y + t y_ts + h y_hs, R floats */
    int n;
} heads_job;

static void heads_fn(void *arg, int ith, int nth) {
    heads_job *j = arg;
    lk_model *m = j->m;
    const int nh = m->nh, n = j->n;
    const int per = LK_MAX(1, nth / nh);  /* row chunks per head */
    const lk_mat *w = j->w;
    const lk_type at = lk_type_vec_dot(w->type);
    char *a = (char *)m->hact + (size_t)ith * m->hact_stride * (size_t)m->n_batch;
    int quantised = -1;
    for (int task = ith; task < nh * per; task += nth) {
        const int h = task / per, chunk = task % per;
        int64_t r0, r1;
        lk_split_range(j->R, ROW_ALIGN, chunk, per, &r0, &r1);
        if (r1 <= r0) continue;
        if (quantised != h) {
            for (int t = 0; t < n; t++)
                lk_quantize_row_act(at, j->x + (size_t)t * j->x_ts + (size_t)h * j->x_hs, a + (size_t)t * m->hact_stride,
                                    w->cols);
            quantised = h;
        }
        lk_quant_matmul(w->type, w->cols, r1 - r0, (const char *)w->data + (size_t)(h * j->R + r0) * w->row_stride,
                        w->row_stride, n, a, m->hact_stride, j->y + (size_t)h * j->y_hs + r0, (size_t)j->y_ts);
    }
}

/* Writes row t's cache row (F32 or F16) at position pos of its slot. */
static void kv_write_row(lk_model *m, int li, int t, const float *row) {
    const int pos = m->row_pos[t], seq = m->items[m->row_item[t]].seq;
    const size_t at = kv_page_kv(m, seq, pos / LK_KV_PAGE, li, 0) + (size_t)(pos % LK_KV_PAGE) * m->ahd;
    if (m->kv_f16) {
        uint16_t *kc = (uint16_t *)m->kcache + at;
        for (int i = 0; i < m->ahd; i++) kc[i] = lk_fp32_to_fp16(row[i]);
    } else {
        memcpy((float *)m->kcache + at, row, sizeof(float) * (size_t)m->ahd);
    }
}

/* This rank's share of MLA for layer li, in the absorbed form llama.cpp
 * runs (model.h): the cache holds the latent [c | rope(k_pe)] per position,
 * each head's query is turned into the latent space (q_abs = W_UK^T q_nope)
 * and its output taken out of it (W_UV o_latent), so attention itself is
 * multi-query attention with keys of kv_lora + rope_dim and values of
 * kv_lora, and no per-head key or value is ever expanded. Under tensor
 * parallelism every rank with heads computes the (replicated) latent and
 * caches it; q_b, k_b, v_b and Wo's columns are cut by head. */
static void attention_mla(lk_model *m, int li, float *x) {
    const lk_model_config *c = &m->cfg;
    const layer_w *w = &m->layers[li];
    const int n = m->n_rows, nh = m->nh;
    const int64_t d = c->n_embd, ql = c->q_lora, kl = c->kv_lora, rd = c->rope_dim, kh = c->k_head,
                  nope = c->qk_nope, ahd = m->ahd, vh = c->head_dim;
    if (nh == 0) {
        memset(m->o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    norm_rows(m, m->xb, x, w->attn_norm, n, d);
    next_up(m, &w->wqb, NULL, NULL);
    const lk_mat *down[2] = {&w->wqa, &w->wkva};
    if (lk_matmul_can_fuse(down, 2)) {
        float *const ys[2] = {m->mqa, m->mkva};
        const int64_t ss[2] = {ql, ahd};
        lk_matmul_fused(m->pool, down, 2, m->xb, d, n, ys, ss, false, m->act);
    } else {
        lk_matmul(m->pool, &w->wqa, m->xb, d, n, m->mqa, ql, m->act);
        lk_matmul(m->pool, &w->wkva, m->xb, d, n, m->mkva, ahd, m->act);
    }
    for (int t = 0; t < n; t++) {
        float *qa = m->mqa + t * ql, *kv = m->mkva + t * ahd;
        lk_rmsnorm(qa, qa, w->q_a_norm, ql, c->rms_eps);
        lk_rmsnorm(kv, kv, w->kv_a_norm, kl, c->rms_eps); /* k_pe is not normalised */
        rope(m, kv + kl, m->row_pos[t]);
        kv_write_row(m, li, t, kv);
    }
    next_up(m, &w->wkb, NULL, NULL); /* by heads: a thread's heads are its share of the rows */
    lk_matmul(m->pool, &w->wqb, m->mqa, ql, n, m->mqb, nh * kh, m->act);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++) {
            float *qpe = m->mqb + ((size_t)t * nh + h) * kh + nope;
            rope(m, qpe, m->row_pos[t]);
            memcpy(m->q + ((size_t)t * nh + h) * ahd + kl, qpe, sizeof(float) * (size_t)rd);
        }
    /* q_abs(t, h) = attn_k_b[h] . q_nope(t, h), into the first kl of each query */
    heads_job kb = { m, &w->wkb, kl, m->mqb, nh * kh, kh, m->q, nh * ahd, ahd, n };
    next_up(m, &w->wvb, NULL, NULL);
    lk_pool_run_k(m->pool, LK_PROF_ATTN, heads_fn, &kb, lk_pool_size(m->pool));
    attn_job aj = { m, li };
    lk_pool_run_k(m->pool, LK_PROF_ATTN, attn_block_fn, &aj, lk_pool_size(m->pool));
    /* o_h = attn_v_b[h] . o_latent(t, h), heads side by side for Wo */
    heads_job vb = { m, &w->wvb, vh, m->att, nh * ahd, ahd, m->mvo, nh * vh, vh, n };
    next_up(m, &w->wo, NULL, NULL);
    lk_pool_run_k(m->pool, LK_PROF_ATTN, heads_fn, &vb, lk_pool_size(m->pool));
    next_ffn(m, w);
    out_product(m, &w->wo, m->mvo, nh * vh, n, x, w->post_attn_norm);
}

typedef struct {
    lk_model *m;
    int n;
} ffn_job;

/* hg = gelu(hg) * hu over the batch's n rows, cut on ROW_ALIGN. */
static void geglu_fn(void *arg, int ith, int nth) {
    ffn_job *j = arg;
    const int64_t total = (int64_t)j->n * j->m->nff;
    int64_t a, b;
    lk_split_range(total, ROW_ALIGN, ith, nth, &a, &b);
    if (b > a) lk_geglu(j->m->hg + a, j->m->hu + a, b - a);
}

/* This rank's share of the FFN: o = W2_slice . (silu(W1_slice x) * W3_slice x)
 * (Gemma: gelu_tanh instead of silu). */
static void ffn(lk_model *m, int li, float *x, int n) {
    const layer_w *w = &m->layers[li];
    const int64_t d = m->cfg.n_embd;
    if (m->nff == 0) {
        memset(m->o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    const lk_mat *gu[2] = {&w->w1, &w->w3};
    const bool gelu = m->cfg.ffn_gelu;
    next_up(m, &w->w2, NULL, NULL);
    if (lk_matmul_can_fuse(gu, 2)) {
        float *const ys[2] = {m->hg, m->hu};
        const int64_t ss[2] = {m->nff, m->nff};
        lk_matmul_fused_norm(m->pool, gu, 2, x, w->ffn_norm, m->cfg.rms_eps, m->xb, n, ys, ss, !gelu, m->act);
    } else {
        norm_rows(m, m->xb, x, w->ffn_norm, n, d);
        lk_matmul(m->pool, &w->w1, m->xb, d, n, m->hg, m->nff, m->act);
        lk_matmul(m->pool, &w->w3, m->xb, d, n, m->hu, m->nff, m->act);
        if (!gelu) lk_swiglu(m->hg, m->hu, (int64_t)n * m->nff);
    }
    if (gelu) {
        ffn_job fj = { m, n };
        if ((int64_t)n * m->nff >= 4096) lk_pool_run(m->pool, geglu_fn, &fj);
        else geglu_fn(&fj, 0, 1);
    }
    next_layer(m, li + 1);
    out_product(m, &w->w2, m->hg, m->nff, n, x, w->post_ffn_norm);
}

/* ---- mixture of experts ----------------------------------------------------
 * One MoE layer over the batch's n tokens, in four pool dispatches whatever
 * the number of experts:
 *   1. router logits for all tokens (F32 matmul, whole router on every rank);
 *      routing itself (softmax or sigmoid, top-k, weights) is a serial pass
 *      of O(n * E * k) on thread 0, then tokens are grouped by expert;
 *   2. the FFN input of every (token, expert) slot quantised once to the
 *      expert's activation type (serial for a few slots);
 *   3. gate and up of every active expert and the shared expert: each thread
 *      takes its rows of each, so every active expert's rows are read once
 *      per step for all of its tokens; SwiGLU on the thread's own rows;
 *   4. the SwiGLU outputs quantised, then down of every active expert by
 *      output rows, and each thread combines its own output rows:
 *      o = w_1 e_1 + ... + w_k e_k (+ shared), in the router's order, as
 *      llama.cpp adds them.
 * A token's arithmetic does not depend on which other tokens share its
 * experts (the matrix kernels are batch invariant), so the MoE FFN keeps the
 * engine's batch invariance. */

static void moe_scratch_alloc(lk_model *m) {
    const lk_model_config *c = &m->cfg;
    moe_scratch *ms = &m->ms;
    const size_t B = (size_t)m->n_batch, E = (size_t)c->n_expert, k = (size_t)c->n_expert_used, d = (size_t)c->n_embd;
    const size_t slots = B * k + (c->n_expert_shared ? B : 0);
    ms->fmax = LK_MAX(LK_MAX(m->nfe, m->nfs), 1);
    size_t ain = 64, adn = 64;
    for (int i = 0; i < m->sl.layer1 - m->sl.layer0; i++) {
        const layer_w *w = &m->layers[i];
        if (!w->moe) continue;
        const int e = m->ex1 > m->ex0 ? m->ex0 : 0;
        const lk_mat *in[2] = {&w->ex[e].w1, &w->sh.w1}, *dn[2] = {&w->ex[e].w2, &w->sh.w2};
        for (int j = 0; j < 2; j++) {
            size_t rb = 0;
            if (in[j]->rows > 0 && lk_type_row_bytes(lk_type_vec_dot(in[j]->type), (int64_t)d, &rb)) ain = LK_MAX(ain, rb);
            if (dn[j]->cols > 0 && lk_type_row_bytes(lk_type_vec_dot(dn[j]->type), dn[j]->cols, &rb)) adn = LK_MAX(adn, rb);
        }
    }
    ms->ain_stride = (ain + 63) & ~(size_t)63;
    ms->adn_stride = (adn + 63) & ~(size_t)63;
    ms->logits = lk_xmalloc(sizeof(float) * B * E);
    ms->probs = lk_xmalloc(sizeof(float) * E);
    ms->bsel = lk_xmalloc(sizeof(float) * E);
    ms->gsc = lk_xmalloc(sizeof(float) * (size_t)LK_MAX(c->n_expert_group, 1));
    ms->sel = lk_xmalloc(sizeof(int32_t) * B * k);
    ms->wgt = lk_xmalloc(sizeof(float) * B * k);
    ms->row_slot = lk_xmalloc(sizeof(int32_t) * B * k);
    ms->slot_row = lk_xmalloc(sizeof(int32_t) * slots);
    ms->cnt = lk_xmalloc(sizeof(int32_t) * (E + 1));
    ms->off = lk_xmalloc(sizeof(int32_t) * (E + 1));
    ms->act = lk_xmalloc(sizeof(int32_t) * (E + 1));
    ms->ain = lk_xmalloc_aligned(ms->ain_stride * slots);
    ms->adn = lk_xmalloc_aligned(ms->adn_stride * slots);
    ms->hg = lk_xmalloc_aligned(sizeof(float) * slots * (size_t)ms->fmax);
    ms->hu = lk_xmalloc_aligned(sizeof(float) * slots * (size_t)ms->fmax);
    ms->eo = lk_xmalloc_aligned(sizeof(float) * slots * d);
    ms->shg = lk_xmalloc(sizeof(float) * B);
}

/* Chooses row t's experts from its router logits (model.h, lk_model_config). */
static void route_row(const lk_model *m, const layer_w *w, const float *logit, int32_t *sel, float *wgt) {
    const lk_model_config *c = &m->cfg;
    const int E = c->n_expert, k = c->n_expert_used;
    float *p = m->ms.probs;
    if (c->gating == LK_GATE_SOFTMAX) {
        memcpy(p, logit, sizeof(float) * (size_t)E);
        lk_softmax(p, E);
    } else {
        for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-logit[e]));
    }
    float *b = m->ms.bsel;
    for (int e = 0; e < E; e++) b[e] = w->exp_b ? p[e] + w->exp_b[e] : p[e];
    /* group-limited routing (DeepSeek-V3's noaux_tc): a group scores the sum
     * of its two best selection scores; only the n_group_used best groups
     * (ties to the lower group) compete, the others are masked out */
    const int G = c->n_expert_group;
    if (G > 1 && c->n_group_used < G) {
        const int per = E / G;
        float *gs = m->ms.gsc;
        for (int gi = 0; gi < G; gi++) {
            const float *bg = b + gi * per;
            int i1 = 0;
            for (int e = 1; e < per; e++) if (bg[e] > bg[i1]) i1 = e;
            int i2 = i1 == 0 ? 1 : 0;
            for (int e = 0; e < per; e++) if (e != i1 && bg[e] > bg[i2]) i2 = e;
            gs[gi] = bg[i1] + bg[i2];
        }
        for (int u = 0; u < c->n_group_used; u++) { /* the best groups, marked by a score of +inf */
            int best = -1;
            for (int gi = 0; gi < G; gi++)
                if (gs[gi] != INFINITY && (best < 0 || gs[gi] > gs[best])) best = gi;
            gs[best] = INFINITY;
        }
        for (int gi = 0; gi < G; gi++)
            if (gs[gi] != INFINITY)
                for (int e = gi * per; e < (gi + 1) * per; e++) b[e] = -INFINITY;
    }
    /* top k by p (+ the selection bias), best first, ties to the lower id */
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bs = 0;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int i = 0; i < j; i++) taken |= sel[i] == e;
            if (taken) continue;
            float sc = b[e];
            if (best < 0 || sc > bs) best = e, bs = sc;
        }
        sel[j] = best;
        wgt[j] = p[best]; /* the unbiased score: the bias only chooses */
    }
    if (c->weights_norm) {
        double sum = 0;
        for (int j = 0; j < k; j++) sum += wgt[j];
        const float den = LK_MAX((float)sum, 6.103515625e-5f); /* llama.cpp's clamp */
        for (int j = 0; j < k; j++) wgt[j] /= den;
    }
    if (c->weights_scale != 0.0f && c->weights_scale != 1.0f)
        for (int j = 0; j < k; j++) wgt[j] *= c->weights_scale;
}

typedef struct {
    lk_model *m;
    const layer_w *w;
    int n;
} moe_job;

/* Group gi of the active list: its weights, first slot, tokens and rows here. */
static const ffn_w *moe_group(const lk_model *m, const layer_w *w, int gi, int *s0, int *ns, int64_t *F) {
    const moe_scratch *ms = &m->ms;
    const int e = ms->act[gi];
    *s0 = ms->off[e];
    *ns = ms->cnt[e];
    if (e == m->cfg.n_expert) {
        *F = m->nfs;
        return &w->sh;
    }
    *F = m->nfe;
    return &w->ex[e];
}

static void moe_quant_in_fn(void *arg, int ith, int nth) {
    moe_job *j = arg;
    lk_model *m = j->m;
    const moe_scratch *ms = &m->ms;
    const int64_t d = m->cfg.n_embd;
    const int routed = ms->n_routed, slots = routed + (m->nfs > 0 ? j->n : 0);
    const lk_type te = lk_type_vec_dot(j->w->ex[m->ex0].w1.type), ts = lk_type_vec_dot(j->w->sh.w1.type);
    int64_t a, b;
    lk_split_range(slots, 1, ith, nth, &a, &b);
    for (int64_t s = a; s < b; s++) {
        lk_quantize_row_act(s < routed ? te : ts, m->xb + (size_t)ms->slot_row[s] * d,
                            (char *)ms->ain + (size_t)s * ms->ain_stride, d);
    }
}

static void moe_gate_up_fn(void *arg, int ith, int nth) {
    moe_job *j = arg;
    lk_model *m = j->m;
    const moe_scratch *ms = &m->ms;
    const int64_t d = m->cfg.n_embd, fm = ms->fmax;
    for (int gi = 0; gi < ms->n_act; gi++) {
        int s0, ns;
        int64_t F, r0, r1;
        const ffn_w *f = moe_group(m, j->w, gi, &s0, &ns, &F);
        lk_split_range(F, ROW_ALIGN, ith, nth, &r0, &r1);
        if (r1 <= r0 || ns == 0) continue;
        const void *a = (const char *)ms->ain + (size_t)s0 * ms->ain_stride;
        float *hg = ms->hg + (size_t)s0 * fm + r0, *hu = ms->hu + (size_t)s0 * fm + r0;
        lk_quant_matmul(f->w1.type, d, r1 - r0, (const char *)f->w1.data + (size_t)r0 * f->w1.row_stride,
                        f->w1.row_stride, ns, a, ms->ain_stride, hg, (size_t)fm);
        lk_quant_matmul(f->w3.type, d, r1 - r0, (const char *)f->w3.data + (size_t)r0 * f->w3.row_stride,
                        f->w3.row_stride, ns, a, ms->ain_stride, hu, (size_t)fm);
        for (int t = 0; t < ns; t++) lk_swiglu(hg + (size_t)t * fm, hu + (size_t)t * fm, r1 - r0);
    }
}

static void moe_quant_dn_fn(void *arg, int ith, int nth) {
    moe_job *j = arg;
    lk_model *m = j->m;
    const moe_scratch *ms = &m->ms;
    const int routed = ms->n_routed, slots = routed + (m->nfs > 0 ? j->n : 0);
    const lk_type te = lk_type_vec_dot(j->w->ex[m->ex0].w2.type), ts = lk_type_vec_dot(j->w->sh.w2.type);
    int64_t a, b;
    lk_split_range(slots, 1, ith, nth, &a, &b);
    for (int64_t s = a; s < b; s++) {
        lk_quantize_row_act(s < routed ? te : ts, ms->hg + (size_t)s * ms->fmax,
                            (char *)ms->adn + (size_t)s * ms->adn_stride, s < routed ? m->nfe : m->nfs);
    }
}

static void moe_down_fn(void *arg, int ith, int nth) {
    moe_job *j = arg;
    lk_model *m = j->m;
    const moe_scratch *ms = &m->ms;
    const int64_t d = m->cfg.n_embd;
    const int k = m->cfg.n_expert_used;
    int64_t r0, r1;
    lk_split_range(d, ROW_ALIGN, ith, nth, &r0, &r1);
    if (r1 <= r0) return;
    for (int gi = 0; gi < ms->n_act; gi++) {
        int s0, ns;
        int64_t F;
        const ffn_w *f = moe_group(m, j->w, gi, &s0, &ns, &F);
        if (F == 0 || ns == 0) continue;
        lk_quant_matmul(f->w2.type, F, r1 - r0, (const char *)f->w2.data + (size_t)r0 * f->w2.row_stride,
                        f->w2.row_stride, ns, (const char *)ms->adn + (size_t)s0 * ms->adn_stride, ms->adn_stride,
                        ms->eo + (size_t)s0 * d + r0, (size_t)d);
    }
    /* this thread's output rows of every token: the weighted experts held
     * here in the router's order (each weight applied once, by the rank
     * holding the expert), then the shared expert's share */
    for (int t = 0; t < j->n; t++) {
        float *o = m->o + (size_t)t * d;
        bool first = true;
        for (int q = 0; q < k; q++) {
            const int32_t sq = ms->row_slot[t * k + q];
            if (sq < 0) continue;
            const float *eq = ms->eo + (size_t)sq * d;
            const float wq = ms->wgt[t * k + q];
            if (first)
                for (int64_t i = r0; i < r1; i++) o[i] = wq * eq[i];
            else
                for (int64_t i = r0; i < r1; i++) o[i] += wq * eq[i];
            first = false;
        }
        if (first) memset(o + r0, 0, sizeof(float) * (size_t)(r1 - r0));
        if (m->nfs > 0) {
            const float *sh = ms->eo + (size_t)ms->off[m->cfg.n_expert] * d + (size_t)t * d;
            if (j->w->sh_gate) {
                const float gs = ms->shg[t];
                for (int64_t i = r0; i < r1; i++) o[i] += gs * sh[i];
            } else {
                for (int64_t i = r0; i < r1; i++) o[i] += sh[i];
            }
        }
    }
}

/* next_up with the active experts' gate and up (down false) or down
 * matrices, in the order moe_gate_up_fn / moe_down_fn take them (each
 * thread its share of every expert's rows) */
static void moe_next(lk_model *m, const layer_w *w, bool down) {
    const lk_mat *W[LK_POOL_PREFETCH_MAX];
    int nw = 0;
    for (int gi = 0; gi < m->ms.n_act && nw + 2 <= LK_POOL_PREFETCH_MAX; gi++) {
        int s0, ns;
        int64_t F;
        const ffn_w *f = moe_group(m, w, gi, &s0, &ns, &F);
        if (down) W[nw++] = &f->w2;
        else W[nw++] = &f->w1, W[nw++] = &f->w3;
    }
    lk_matmul_prefetch_next(m->pool, W, nw);
}

/* This rank's share of a MoE layer's FFN into m->o (see above). */
static void moe_ffn(lk_model *m, int li, const float *x, int n) {
    const lk_model_config *c = &m->cfg;
    const layer_w *w = &m->layers[li];
    moe_scratch *ms = &m->ms;
    const int64_t d = c->n_embd;
    const int E = c->n_expert, k = c->n_expert_used, layer = m->sl.layer0 + li;
    const bool experts = m->ex1 > m->ex0 && m->nfe > 0;
    if (!experts && m->nfs == 0 && !m->trace.logits) {
        memset(m->o, 0, sizeof(float) * (size_t)n * d);
        return;
    }
    norm_rows(m, m->xb, x, w->ffn_norm, n, d);
    lk_matmul(m->pool, &w->wr, m->xb, d, n, ms->logits, E, m->act);
    for (int t = 0; t < n; t++) route_row(m, w, ms->logits + (size_t)t * E, ms->sel + t * k, ms->wgt + t * k);
    if (w->sh_gate) /* qwen35moe: the shared expert's per-token sigmoid gate */
        for (int t = 0; t < n; t++)
            ms->shg[t] = 1.0f / (1.0f + expf(-lk_vec_dot_f32(m->xb + t * d, w->sh_gate, d)));
    if (w->sh_gate && m->trace.shared_gate)
        memcpy(m->trace.shared_gate + (size_t)layer * m->n_batch, ms->shg, sizeof(float) * (size_t)n);
    if (m->trace.logits) {
        const size_t base = (size_t)layer * m->n_batch;
        memcpy(m->trace.logits + base * E, ms->logits, sizeof(float) * (size_t)n * E);
        memcpy(m->trace.experts + base * k, ms->sel, sizeof(int32_t) * (size_t)n * k);
        memcpy(m->trace.weights + base * k, ms->wgt, sizeof(float) * (size_t)n * k);
        if (!experts && m->nfs == 0) {
            memset(m->o, 0, sizeof(float) * (size_t)n * d);
            return;
        }
    }
    /* group the (token, expert) pairs of the experts held here by expert: a
     * counting sort (the others are another rank's: no slot) */
    const int e0 = experts ? m->ex0 : 0, e1 = experts ? m->ex1 : 0;
    memset(ms->cnt, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (int i = 0; i < n * k; i++) ms->cnt[ms->sel[i]]++;
    int32_t acc = 0;
    ms->n_act = 0;
    for (int e = 0; e < E; e++) {
        ms->off[e] = acc;
        if (e >= e0 && e < e1) {
            acc += ms->cnt[e];
            if (ms->cnt[e]) ms->act[ms->n_act++] = e;
        }
        ms->cnt[e] = 0; /* refilled below as a cursor */
    }
    ms->n_routed = acc;
    for (int t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            const int e = ms->sel[t * k + j];
            if (e < e0 || e >= e1) {
                ms->row_slot[t * k + j] = -1;
                continue;
            }
            const int s = ms->off[e] + ms->cnt[e]++;
            ms->slot_row[s] = t;
            ms->row_slot[t * k + j] = s;
        }
    if (m->nfs > 0) {
        ms->off[E] = acc;
        ms->cnt[E] = n;
        for (int t = 0; t < n; t++) ms->slot_row[acc + t] = t;
        ms->act[ms->n_act++] = E;
    }
    moe_job j = { m, w, n };
    const int slots = acc + (m->nfs > 0 ? n : 0);
    const bool par = slots >= 4 && lk_pool_size(m->pool) > 1;
    moe_next(m, w, false); /* the experts' gate/up, while the inputs are quantised */
    if (par) lk_pool_run_k(m->pool, LK_PROF_MOE, moe_quant_in_fn, &j, lk_pool_size(m->pool));
    else moe_quant_in_fn(&j, 0, 1);
    moe_next(m, w, true); /* their down, in gate/up's tail */
    lk_pool_run_k(m->pool, LK_PROF_MOE, moe_gate_up_fn, &j, lk_pool_size(m->pool));
    if (par) lk_pool_run_k(m->pool, LK_PROF_MOE, moe_quant_dn_fn, &j, lk_pool_size(m->pool));
    else moe_quant_dn_fn(&j, 0, 1);
    next_layer(m, li + 1);
    lk_pool_run_k(m->pool, LK_PROF_MOE, moe_down_fn, &j, lk_pool_size(m->pool));
}

void lk_model_trace_routing(lk_model *m, const lk_route_trace *t) {
    if (t) m->trace = *t;
    else memset(&m->trace, 0, sizeof m->trace);
}

/* The residual stream: x += o (lk_vec_axpy_f32 with 1, the same bits as a
 * plain sum), then whether the sums went non-finite; from PAR_ROWS rows on,
 * rows over the pool (o's lines were written by every thread's matmul rows,
 * so one thread reading them all waited on the other cores' caches). */
typedef struct {
    float *x;
    const float *o;
    int64_t d;
    int n;
    _Atomic bool bad;
} resid_job;

static void resid_fn(void *arg, int ith, int nth) {
    resid_job *j = arg;
    int64_t a, b;
    lk_split_range(j->n, 1, ith, nth, &a, &b);
    if (b <= a) return;
    lk_vec_axpy_f32(j->x + a * j->d, 1.0f, j->o + a * j->d, (b - a) * j->d);
    if (lk_any_nonfinite(j->x + a * j->d, (b - a) * j->d)) atomic_store_explicit(&j->bad, true, memory_order_relaxed);
}

static bool add_nonfinite(lk_model *m, float *x, const float *o, int n) {
    resid_job j = { .x = x, .o = o, .d = m->cfg.n_embd, .n = n };
    atomic_init(&j.bad, false);
    run_rows(m, resid_fn, &j, n);
    return atomic_load(&j.bad);
}

/* Gemma's post-norms: o = rmsnorm(o) * w per row, after the all-reduce
 * (every rank then holds the whole sum), before the residual add. */
static void post_norm(lk_model *m, const float *w, int n) {
    if (!w) return;
    const int64_t d = m->cfg.n_embd;
    norm_rows(m, m->o, m->o, w, n, d);
}

static lk_status model_layers(lk_model *m, float *x);

lk_status lk_model_layers(lk_model *m, float *x) {
    const uint64_t t0 = lk_prof_t0();
    lk_status st = model_layers(m, x);
    lk_prof_add(LK_PROF_LAYERS, t0);
    return st;
}

/* The end of layer li's attention (ffn false) or FFN half: unless its
 * output product made the residual add (out_product), the all-reduce, the
 * post-norm and x += o; then the first non-finite sum is noted. */
static lk_status half_done(lk_model *m, float *x, int li, bool ffn) {
    const int n = m->n_rows, layer = m->sl.layer0 + li;
    if (!m->resid_done) {
        lk_status st = allreduce(m, m->o, (int64_t)n * m->cfg.n_embd, layer,
                                 ffn ? "FFN output all-reduce" : "attention output all-reduce");
        if (st) return st;
        post_norm(m, ffn ? m->layers[li].post_ffn_norm : m->layers[li].post_attn_norm, n);
        m->resid_bad = add_nonfinite(m, x, m->o, n);
    }
    m->resid_done = false;
    if (m->resid_bad && m->bad_layer < 0) m->bad_layer = layer, m->bad_ffn = ffn;
    return LK_OK;
}

static lk_status model_layers(lk_model *m, float *x) {
    LK_ASSERT(m->n_rows > 0); /* lk_model_batch first */
    const int n = m->n_rows;
    const int64_t nd = (int64_t)n * m->cfg.n_embd;
    lk_status st;
    m->bad_layer = lk_any_nonfinite(x, nd) ? m->sl.layer0 - 1 : -1; /* -1 + layer0: the rows came in non-finite */
    m->resid_done = false;
    for (int li = 0; li < m->sl.layer1 - m->sl.layer0; li++) {
        if (m->layers[li].rec) lk_deltanet(m, li, x);
        else if (m->cfg.mla) attention_mla(m, li, x);
        else attention(m, li, x);
        if ((st = half_done(m, x, li, false))) return st;
        if (m->layers[li].moe) moe_ffn(m, li, x, n);
        else ffn(m, li, x, n);
        if ((st = half_done(m, x, li, true))) return st;
    }
    return LK_OK;
}

int lk_model_first_nonfinite(const lk_model *m, bool *ffn) {
    if (ffn) *ffn = m->bad_ffn;
    return m->bad_layer;
}

lk_status lk_model_logits(lk_model *m, const float *x, const int32_t *rows, int n_rows, float *logits) {
    LK_ASSERT(n_rows >= 0 && n_rows <= m->n_batch);
    const uint64_t t0 = lk_prof_t0();
    const int64_t d = m->cfg.n_embd;
    for (int t = 0; t < n_rows; t++) {
        LK_ASSERT(rows[t] >= 0 && rows[t] < m->n_batch);
        lk_rmsnorm(m->xb + t * d, x + (size_t)rows[t] * d, m->out_norm, d, m->cfg.rms_eps);
    }
    const lk_prof_kind mk = lk_prof_matmul_kind(LK_PROF_LOGITS_MATMUL);
    next_layer(m, 0);
    lk_matmul(m->pool, &m->wout, m->xb, d, n_rows, logits, m->nvoc, m->act);
    lk_prof_matmul_kind(mk);
    const float cap = m->cfg.logit_softcap;
    if (cap > 0)
        for (int64_t i = 0; i < (int64_t)n_rows * m->nvoc; i++) logits[i] = cap * tanhf(logits[i] / cap);
    lk_prof_add(LK_PROF_LOGITS, t0);
    return LK_OK;
}

lk_status lk_model_forward(lk_model *m, const int32_t *tokens, int n, int pos0, int n_out, float *logits) {
    LK_ASSERT(n_out >= 0 && n_out <= n);
    char err[LK_ERRLEN];
    lk_status st;
    if (pos0 < m->seq_len[0] && (st = lk_model_seq_keep(m, 0, pos0, err, sizeof err))) return st;
    lk_batch_item it = {0, pos0, n};
    if ((st = lk_model_batch(m, &it, 1, err, sizeof err))) {
        lk_log(LK_LOG_ERROR, "%s", err);
        return st;
    }
    if ((st = lk_model_embed(m, tokens, n, m->x))) return st;
    if ((st = lk_model_layers(m, m->x))) return st;
    for (int r = 0; r < n_out; r++) m->out_rows[r] = n - n_out + r;
    return lk_model_logits(m, m->x, m->out_rows, n_out, logits);
}
