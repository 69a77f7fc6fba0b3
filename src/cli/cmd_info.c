/* lockstep info — what is in a GGUF file: architecture and shapes, tensor
 * types and sizes, every metadata key, optionally every tensor. Reads only
 * the header (the data stays unmapped pages), so it is instant on any size. */
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "quant/quant.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

static void human_bytes(uint64_t n, char *buf, size_t len) {
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024 && u < 4) { v /= 1024; u++; }
    if (u == 0) snprintf(buf, len, "%" PRIu64 " B", n);
    else snprintf(buf, len, "%.2f %s", v, units[u]);
}

/* "<arch>.<suffix>" as an integer, or -1. */
static int64_t arch_int(const lk_gguf *g, const char *arch, const char *suffix) {
    char key[256];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int64_t v;
    return lk_gguf_get_i64(g, key, &v) ? v : -1;
}
static bool arch_f64(const lk_gguf *g, const char *arch, const char *suffix, double *v) {
    char key[256];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return lk_gguf_get_f64(g, key, v);
}

static void print_shape(const lk_gguf *g) {
    const char *a = NULL;
    size_t alen = 0;
    if (!lk_gguf_get_str(g, "general.architecture", &a, &alen)) {
        printf("architecture: (none: general.architecture is missing)\n");
        return;
    }
    /* arch builds the keys looked up below; what is printed from the file
     * goes through lk_str_sanitize, so its escapes cannot reach the terminal */
    char arch[128], sa[128], sn[201];
    snprintf(arch, sizeof arch, "%.*s", (int)LK_MIN(alen, sizeof arch - 1), a);
    lk_str_sanitize(sa, sizeof sa, a, alen);
    const char *name = NULL;
    size_t nlen = 0;
    printf("architecture: %s", sa);
    if (lk_gguf_get_str(g, "general.name", &name, &nlen)) {
        lk_str_sanitize(sn, sizeof sn, name, nlen);
        printf("  (name \"%s\")", sn);
    }
    printf("\n");
    static const struct { const char *label, *suffix; } ints[] = {
        {"n_embd", "embedding_length"}, {"n_layer", "block_count"}, {"n_head", "attention.head_count"},
        {"n_head_kv", "attention.head_count_kv"}, {"head_dim_k", "attention.key_length"},
        {"head_dim_v", "attention.value_length"}, {"n_ff", "feed_forward_length"},
        {"n_expert", "expert_count"}, {"n_expert_used", "expert_used_count"},
        {"n_ctx_train", "context_length"}, {"n_rot", "rope.dimension_count"},
    };
    printf("shape:       ");
    int64_t n_embd = arch_int(g, arch, "embedding_length"), n_head = arch_int(g, arch, "attention.head_count");
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        int64_t v = arch_int(g, arch, ints[i].suffix);
        if (v >= 0) printf(" %s %" PRId64, ints[i].label, v);
        else if (!strcmp(ints[i].label, "head_dim_k") && n_embd > 0 && n_head > 0)
            printf(" head_dim %" PRId64, n_embd / n_head);
    }
    uint64_t n_vocab = 0;
    int64_t vs = arch_int(g, arch, "vocab_size");
    if (lk_gguf_get_arr(g, "tokenizer.ggml.tokens", NULL, &n_vocab)) printf(" n_vocab %" PRIu64, n_vocab);
    else if (vs >= 0) printf(" n_vocab %" PRId64, vs);
    double d;
    if (arch_f64(g, arch, "rope.freq_base", &d)) printf(" rope_base %g", d);
    if (arch_f64(g, arch, "attention.layer_norm_rms_epsilon", &d)) printf(" rms_eps %g", d);
    printf("\n");
    const char *tm = NULL;
    size_t tml = 0;
    if (lk_gguf_get_str(g, "tokenizer.ggml.model", &tm, &tml)) {
        const char *pre = NULL;
        size_t pl = 0;
        char st[65];
        lk_str_sanitize(st, sizeof st, tm, tml);
        printf("tokenizer:    %s", st);
        if (lk_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pl)) {
            lk_str_sanitize(st, sizeof st, pre, pl);
            printf(" (pre %s)", st);
        }
        printf(", %" PRIu64 " tokens\n", n_vocab);
    }
}

static void fmt_params(uint64_t n, char *buf, size_t len) {
    if (n >= 1000000000) snprintf(buf, len, "%.2f B", (double)n / 1e9);
    else if (n >= 1000000) snprintf(buf, len, "%.2f M", (double)n / 1e6);
    else snprintf(buf, len, "%" PRIu64, n);
}

/* What the engine will run: routing, multi-head latent attention and its
 * cache, YaRN. Every figure from the configuration lockstep loads. */
static void print_model_facts(const lk_model_config *c) {
    if (c->n_expert) {
        printf("routing:      %s", c->gating == LK_GATE_SIGMOID ? "sigmoid" : "softmax");
        if (c->has_exp_probs_b) printf(" + selection bias (exp_probs_b)");
        if (c->n_expert_group > 1)
            printf(", %d groups of %d (the best %d compete)", c->n_expert_group, c->n_expert / c->n_expert_group,
                   c->n_group_used);
        printf(", top %d", c->n_expert_used);
        if (c->weights_norm) printf(", weights normalised");
        if (c->weights_scale != 0.0f && c->weights_scale != 1.0f) printf(" x %g", (double)c->weights_scale);
        if (c->n_expert_shared) printf(", %d shared expert%s (%" PRId64 " rows)", c->n_expert_shared,
                                       c->n_expert_shared == 1 ? "" : "s", c->n_ff_shexp);
        printf("\n");
    }
    const int n_attn = c->n_layer - c->n_recurrent;
    const double per_layer = (double)c->kv_elems, per_tok = per_layer * n_attn * 4;
    char kb[32];
    human_bytes((uint64_t)per_tok, kb, sizeof kb);
    if (c->n_recurrent) {
        /* the layer kinds, one letter per layer: L linear (gated delta net), A full attention */
        printf("layers:       %d gated delta net (L), %d gated full attention (A): ", c->n_recurrent, n_attn);
        for (int l = 0; l < c->n_layer; l++) putchar(lk_model_layer_recurrent(c, l) ? 'L' : 'A');
        printf("\n");
        const double st = ((double)(c->ssm_conv - 1) * (double)lk_model_ssm_channels(c) +
                           (double)c->ssm_nv * c->ssm_dk * c->ssm_dv) * 4 * c->n_recurrent;
        char sb[32];
        human_bytes((uint64_t)st, sb, sizeof sb);
        printf("linear attn:  %d key heads, %d value heads (value head h reads key head h mod %d), dims %d/%d, conv %d "
               "taps; state %s per sequence (F32)\n", c->ssm_nk, c->ssm_nv, c->ssm_nk, c->ssm_dk, c->ssm_dv, c->ssm_conv,
               sb);
        printf("attention:    %d heads, %d KV heads of %d, output gate, rope on %d dims\n", c->n_head, c->n_head_kv,
               c->head_dim, c->rope_dim);
    }
    if (c->mla) {
        const double expanded = (double)c->n_head * (c->k_head + c->head_dim);
        printf("attention:    MLA, %d heads: q_lora %d, kv_lora %d, key %d (%d nope + %d rope), value %d\n", c->n_head,
               c->q_lora, c->kv_lora, c->k_head, c->qk_nope, c->rope_dim, c->head_dim);
        printf("KV cache:     the latent [c | rope(k_pe)]: %.0f floats per position and layer, %s per token in F32 "
               "(expanded keys and values would be %.0f floats per layer: %.1fx)\n", per_layer, kb, expanded,
               expanded / per_layer);
    } else {
        printf("KV cache:     %.0f floats per position and layer, %s per token in F32%s\n", per_layer, kb,
               c->n_recurrent ? " (attention layers only)" : "");
    }
    if (c->swa_window > 0) {
        /* the layer kinds, as runs: "0-4 local (window 32), 5 global" */
        printf("layers:      ");
        for (int l = 0; l < c->n_layer;) {
            const bool swa = lk_model_layer_swa(c, l);
            int e = l;
            while (e + 1 < c->n_layer && lk_model_layer_swa(c, e + 1) == swa) e++;
            if (e > l) printf(" %d-%d", l, e);
            else printf(" %d", l);
            printf(" %s%s", swa ? "local" : "global", e + 1 < c->n_layer ? "," : "");
            l = e + 1;
        }
        printf(" (sliding window %d positions on the local layers)\n", c->swa_window);
        printf("rope:         global layers base %g, positions / %g (linear); local layers base %g, unscaled\n",
               (double)c->rope_base, 1.0 / (double)c->rope_freq_scale, (double)c->rope_base_swa);
    } else if (c->rope_freq_scale != 1.0f) {
        printf("rope:         linear scaling: positions divided by %g\n", 1.0 / (double)c->rope_freq_scale);
    }
    if (c->logit_softcap > 0 || c->attn_softcap > 0)
        printf("soft-capping: final logits %g, attention scores %g (0: none)\n", (double)c->logit_softcap,
               (double)c->attn_softcap);
    if (c->rope_yarn)
        printf("rope:         YaRN x%g (original context %d, beta_fast %g, beta_slow %g), attention scale %.7g "
               "(mscale %.7g)\n", (double)c->yarn_factor, c->yarn_orig_ctx, (double)c->yarn_beta_fast,
               (double)c->yarn_beta_slow, (double)c->kq_scale, 1.0 + (double)c->yarn_log_mul * log(c->yarn_factor));
}

int lk_cmd_info(int argc, char **argv) {
    const char *model = NULL;
    bool tensors = false;
    const lk_opt opts[] = {
        {"--model", "-m", LK_OPT_STR, &model, "FILE", "GGUF file to describe (or give it as the argument)"},
        {"--tensors", NULL, LK_OPT_FLAG, &tensors, NULL, "also list every tensor: name, type, shape, bytes"},
        {0},
    };
    const char *pos[1];
    int np = lk_args_parse("info", "[-m] FILE [--tensors]", opts, argc, argv, pos, 1);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (np == 1) {
        if (model) {
            fprintf(stderr, "lockstep info: give the file once (-m FILE or FILE)\n");
            return 2;
        }
        model = pos[0];
    }
    if (!model) {
        fprintf(stderr, "lockstep info: no file given (usage: lockstep info -m FILE)\n");
        return 2;
    }
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(model, &g, err, sizeof err) != LK_OK) {
        fprintf(stderr, "lockstep info: %s\n", err);
        return 1;
    }
    char hb[32];
    human_bytes(lk_gguf_file_size(g), hb, sizeof hb);
    printf("file:         %s (%s, GGUF v%" PRIu32 ", alignment %" PRIu32 ", data at byte %" PRIu64 ")\n", model, hb,
           lk_gguf_version(g), lk_gguf_alignment(g), lk_gguf_data_offset(g));
    print_shape(g);

    /* tensors by type */
    enum { NT = 64 };
    int64_t count[NT] = {0};
    uint64_t bytes[NT] = {0}, total = 0, params = 0;
    int64_t nt = lk_gguf_n_tensors(g);
    for (int64_t i = 0; i < nt; i++) {
        const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
        uint32_t ty = t->type < NT ? t->type : NT - 1; /* types are validated known, < LK_TYPE_COUNT */
        count[ty]++;
        bytes[ty] += t->nbytes;
        total += t->nbytes;
        params += t->n_elements;
    }
    human_bytes(total, hb, sizeof hb);
    char pc[32];
    if (params >= 1000000000) snprintf(pc, sizeof pc, "%.2f B", (double)params / 1e9);
    else if (params >= 1000000) snprintf(pc, sizeof pc, "%.2f M", (double)params / 1e6);
    else snprintf(pc, sizeof pc, "%" PRIu64, params);
    printf("tensors:      %" PRId64 ", %s, %s parameters (%.2f bits per weight)\n", nt, hb, pc,
           params ? 8.0 * (double)total / (double)params : 0.0);
    /* What one token reads: for a mixture, n_expert_used of the experts
     * (what sets decode speed), not the total that sets memory. */
    lk_model_config cfg;
    if (lk_model_config_read(g, &cfg, err, sizeof err) == LK_OK) {
        uint64_t all = 0, active = 0;
        lk_model_param_counts(g, &cfg, &all, &active);
        char ta[32], tb[32];
        fmt_params(all, ta, sizeof ta);
        fmt_params(active, tb, sizeof tb);
        printf("parameters:   %s total, %s active per token", ta, tb);
        if (cfg.n_expert)
            printf(" (%d of %d experts of %" PRId64 " rows%s, %d leading dense layer%s)", cfg.n_expert_used,
                   cfg.n_expert, cfg.n_ff_exp, cfg.n_expert_shared ? " + shared" : "", cfg.n_dense_lead,
                   cfg.n_dense_lead == 1 ? "" : "s");
        printf("\n");
        print_model_facts(&cfg);
    }
    for (int ty = 0; ty < NT; ty++) {
        if (!count[ty]) continue;
        human_bytes(bytes[ty], hb, sizeof hb);
        printf("  %-8s %5" PRId64 " tensors  %s%s\n", lk_type_name((uint32_t)ty), count[ty], hb,
               lk_type_supported((uint32_t)ty) ? "" : "  (lockstep cannot compute with this type)");
    }

    int64_t nkv = lk_gguf_n_kv(g);
    printf("metadata:     %" PRId64 " keys\n", nkv);
    for (int64_t i = 0; i < nkv; i++) {
        char val[400], key[256]; /* kv_format escapes the values; the key is the file's too */
        lk_gguf_kv_format(g, i, val, sizeof val);
        const char *k = lk_gguf_kv_key(g, i);
        lk_str_sanitize(key, sizeof key, k, strlen(k));
        printf("  %-42s %-6s %s\n", key, lk_gguf_vtype_name(lk_gguf_kv_type(g, i)), val);
    }
    if (tensors) {
        printf("tensor list:\n");
        for (int64_t i = 0; i < nt; i++) {
            const lk_gguf_tensor *t = lk_gguf_tensor_at(g, i);
            char shape[128];
            int n = snprintf(shape, sizeof shape, "[");
            for (int d = 0; d < t->n_dims; d++)
                n += snprintf(shape + n, sizeof shape - (size_t)n, "%s%" PRIu64, d ? ", " : "", t->ne[d]);
            snprintf(shape + n, sizeof shape - (size_t)n, "]");
            char name[256];
            lk_str_sanitize(name, sizeof name, t->name, strlen(t->name));
            printf("  %-40s %-6s %-22s %12" PRIu64 " bytes  @ %" PRIu64 "\n", name, lk_type_name(t->type), shape,
                   t->nbytes, lk_gguf_data_offset(g) + t->offset);
        }
    }
    lk_gguf_close(g);
    return 0;
}
