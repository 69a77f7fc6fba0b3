/* Cluster layouts against the references, through the real program: every
 * layout the issue names (tp 2/3/4, pp 2/3, tp 2 x pp 2) over shared memory
 * and over TCP must produce exactly llama.cpp's greedy tokens for the four
 * stories260K prompts (one node does, see test_model), and the dense
 * quantised synth models must produce the one-node tokens. Runs `lockstep run
 * --local N --json` as a user would; $LOCKSTEP names the program. */
#include "lk_test.h"

#include "lk_ref.h"

/* The program's greedy ids (a JSON array; caller decrefs) or NULL, with
 * the command's stderr tail in err. */
static json_t *run_ids(const char *model, const char *prompt, int n, const char *layout, char *err, size_t errlen) {
    json_t *o = lk_ref_run(model, prompt, n, layout, err, errlen);
    json_t *ids = o ? json_incref(json_object_get(o, "generated_ids")) : NULL;
    json_decref(o);
    return ids;
}

static const char *layouts[] = {
    "--local 2 --transport shm", "--local 2 --transport tcp",
    "--local 3 --transport shm", "--local 3 --transport tcp",
    "--local 4 --transport shm", "--local 4 --transport tcp",
    "--local 2 --pp 2 --transport shm", "--local 2 --pp 2 --transport tcp",
    "--local 3 --pp 3 --transport shm", "--local 3 --pp 3 --transport tcp",
    "--local 4 --tp 2 --pp 2 --transport shm", "--local 4 --tp 2 --pp 2 --transport tcp",
};

TEST(stories260k_every_layout_matches_llama_cpp) {
    json_t *ref = lk_ref_load("reference/stories260K.json");
    if (!ref) return;
    char err[1024];
    for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
        int ok = 0;
        size_t ci;
        json_t *c;
        json_array_foreach(json_object_get(ref, "cases"), ci, c) {
            json_t *want = json_object_get(c, "generated_token_ids");
            json_t *got = run_ids(lk_td("models/stories260K.gguf"), json_string_value(json_object_get(c, "prompt")),
                                  (int)json_array_size(want), layouts[l], err, sizeof err);
            CHECKF(got, "%s", err);
            if (!got) continue;
            int k = lk_ref_same_prefix(got, want, INT32_MAX);
            CHECKF(k == (int)json_array_size(want), "%s, prompt %zu: first difference at token %d", layouts[l], ci, k);
            ok += k == (int)json_array_size(want);
            json_decref(got);
        }
        printf("  stories260K %-40s %d/4 prompts token-identical to llama.cpp\n", layouts[l], ok);
    }
    json_decref(ref);
}

TEST(quantised_synth_models_match_one_node) {
    static const char *models[] = {
        "synth/synth-llama-q8_0.gguf", "synth/synth-llama-q4_0.gguf", "synth/synth-qwen3-q8_0.gguf",
        "synth/synth-llama-q4_k_m.gguf", "synth/synth-llama-q5_k_m.gguf", "synth/synth-llama-q6_k.gguf",
        "synth/synth-qwen2-q4_k_m.gguf", "synth/synth-llama-f16.gguf", "synth/synth-llama-bf16.gguf",
    };
    static const char *prompts[] = { "Once upon a time", "Hello, World!" };
    static const char *lay[] = { "--local 2 --transport shm", "--local 3 --transport tcp", "--local 4",
                                 "--local 2 --pp 2 --transport tcp", "--local 4 --tp 2 --pp 2" };
    char err[1024];
    for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
        for (size_t pi = 0; pi < 2; pi++) {
            json_t *one = run_ids(lk_td(models[mi]), prompts[pi], 24, "", err, sizeof err);
            CHECKF(one, "%s", err);
            if (!one) continue;
            for (size_t l = 0; l < sizeof lay / sizeof lay[0]; l++) {
                json_t *got = run_ids(lk_td(models[mi]), prompts[pi], 24, lay[l], err, sizeof err);
                CHECKF(got, "%s", err);
                if (!got) continue;
                int k = lk_ref_same_prefix(got, one, INT32_MAX);
                CHECKF(k == (int)json_array_size(one) && json_array_size(got) == json_array_size(one),
                       "%s %s prompt %zu: first difference at token %d", models[mi], lay[l], pi, k);
                json_decref(got);
            }
            json_decref(one);
        }
    }
}

int main(void) {
    RUN(stories260k_every_layout_matches_llama_cpp);
    RUN(quantised_synth_models_match_one_node);
    return lk_test_end();
}
