/* lockstep tokenize — the tokens of a text, as the model's own tokenizer (and
 * llama.cpp's llama-tokenize) makes them. Loads only the vocabulary from the
 * GGUF metadata, never the weights. */
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Whole file (or stdin for "-") into memory; sizes come from reading, so no
 * size is trusted before the bytes exist. */
static char *slurp(const char *path, size_t *len, char *err, size_t errlen) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) {
        lk_fail(err, errlen, LK_ERR_IO, "open %s: cannot read", path);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *b = lk_xmalloc(cap);
    for (;;) {
        if (n == cap) b = lk_xrealloc(b, cap *= 2);
        size_t r = fread(b + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    bool bad = ferror(f);
    if (f != stdin) fclose(f);
    if (bad) {
        free(b);
        lk_fail(err, errlen, LK_ERR_IO, "read %s failed", path);
        return NULL;
    }
    *len = n;
    return b;
}

int lk_cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *file = NULL;
    bool ids_only = false, no_bos = false, special = false, timing = false;
    const lk_opt opts[] = {
        {"--model", "-m", LK_OPT_STR, &model, "FILE", "GGUF model whose vocabulary to use"},
        {"--ids", NULL, LK_OPT_FLAG, &ids_only, NULL, "print only the ids, as [1, 2, 3]"},
        {"--no-bos", NULL, LK_OPT_FLAG, &no_bos, NULL, "do not add BOS/EOS even where the model adds them"},
        {"--special", NULL, LK_OPT_FLAG, &special, NULL, "recognise control tokens written in the text (e.g. <|im_start|>)"},
        {"--file", "-f", LK_OPT_STR, &file, "FILE", "read the text from FILE ('-' = stdin) instead of the argument"},
        {"--time", NULL, LK_OPT_FLAG, &timing, NULL, "print the tokenising speed to stderr"},
        {0},
    };
    const char *pos[1];
    const char *syn = "-m FILE [--ids] [--no-bos] [--special] TEXT | -f FILE";
    int np = lk_args_parse("tokenize", syn, opts, argc, argv, pos, 1);
    if (np == LK_ARGS_HELP || np == LK_ARGS_VERSION) return 0;
    if (np < 0) return 2;
    if (!model) {
        fprintf(stderr, "lockstep tokenize: no model given (usage: lockstep tokenize %s)\n", syn);
        return 2;
    }
    if ((np == 1) == (file != NULL)) {
        fprintf(stderr, "lockstep tokenize: give the text either as the argument or with --file\n");
        return 2;
    }
    char err[LK_ERRLEN];
    lk_gguf *g = NULL;
    if (lk_gguf_open(model, &g, err, sizeof err) != LK_OK) {
        fprintf(stderr, "lockstep tokenize: %s\n", err);
        return 1;
    }
    lk_tokenizer *t = NULL;
    lk_status st = lk_tokenizer_load(g, &t, err, sizeof err);
    lk_gguf_close(g);
    if (st != LK_OK) {
        fprintf(stderr, "lockstep tokenize: %s\n", err);
        return 1;
    }
    char *owned = NULL;
    const char *text = pos[0];
    size_t len = np == 1 ? strlen(pos[0]) : 0;
    if (file) {
        owned = slurp(file, &len, err, sizeof err);
        if (!owned) {
            fprintf(stderr, "lockstep tokenize: %s\n", err);
            lk_tokenizer_free(t);
            return 1;
        }
        text = owned;
    }
    int32_t *ids = NULL, n = 0;
    double t0 = lk_time_s();
    st = lk_tokenizer_encode(t, text, len, !no_bos, special, &ids, &n, err, sizeof err);
    double dt = lk_time_s() - t0;
    if (st != LK_OK) {
        fprintf(stderr, "lockstep tokenize: %s\n", err);
        free(owned);
        lk_tokenizer_free(t);
        return 1;
    }
    if (ids_only) {
        printf("[");
        for (int32_t i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
        printf("]\n");
    } else {
        int32_t cap = lk_tokenizer_max_piece(t) + 1;
        char *piece = lk_xmalloc((size_t)cap), *safe = lk_xmalloc(4 * (size_t)cap + 8);
        for (int32_t i = 0; i < n; i++) {
            int32_t m = lk_tokenizer_piece(t, ids[i], true, piece, cap);
            /* pieces come from the file: escaped, never raw control bytes */
            lk_str_sanitize(safe, 4 * (size_t)cap + 8, piece, (size_t)(m > 0 ? m : 0));
            printf("%6d -> '%s'\n", ids[i], safe);
        }
        free(piece);
        free(safe);
    }
    if (timing)
        fprintf(stderr, "tokenize: %zu bytes -> %d tokens in %.3f ms (%.1f MiB/s)\n", len, n, dt * 1e3,
                dt > 0 ? (double)len / dt / (1024.0 * 1024.0) : 0.0);
    free(ids);
    free(owned);
    lk_tokenizer_free(t);
    return 0;
}
