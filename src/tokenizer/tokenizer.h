/* tokenizer — text <-> token ids from the vocabulary in a GGUF file, exactly
 * as llama.cpp tokenises it; chat templates.
 *
 * Owns: SentencePiece-style (`tokenizer.ggml.model` = "llama") and byte-level
 * BPE ("gpt2", with the pre-tokeniser named by `tokenizer.ggml.pre`)
 * vocabularies, special tokens, streaming-safe decoding, chat templates.
 * Callers: cli (run, tokenize, chat), serve. An lk_tokenizer copies what it
 * needs out of the GGUF at load, so it outlives the lk_gguf. Read-only after
 * load: any number of threads may encode/decode at once. */
#ifndef LK_TOKENIZER_H
#define LK_TOKENIZER_H

#include "common/lk_common.h"
#include "gguf/gguf.h"

typedef struct lk_tokenizer lk_tokenizer;

lk_status lk_tokenizer_load(const lk_gguf *g, lk_tokenizer **out, char *err, size_t errlen);
void      lk_tokenizer_free(lk_tokenizer *t);

int32_t lk_tokenizer_n_vocab(const lk_tokenizer *t);
int32_t lk_tokenizer_bos(const lk_tokenizer *t);   /* -1 if none */
int32_t lk_tokenizer_eos(const lk_tokenizer *t);   /* -1 if none */
bool    lk_tokenizer_add_bos(const lk_tokenizer *t); /* the model's add_bos_token */
/* End of generation: EOS, EOT, and the tokens llama.cpp treats as EOG. */
bool    lk_tokenizer_is_eog(const lk_tokenizer *t, int32_t id);

/* Encodes text[0..len). add_special: add BOS/EOS as the model's flags say.
 * parse_special: recognise control tokens written in the text (never for
 * untrusted user text). *ids is malloc'd (caller frees), *n_ids its length. */
lk_status lk_tokenizer_encode(const lk_tokenizer *t, const char *text, size_t len,
                              bool add_special, bool parse_special,
                              int32_t **ids, int32_t *n_ids, char *err, size_t errlen);

/* The bytes a token stands for when detokenising (SentencePiece "▁" -> " ",
 * byte tokens -> the byte, BPE byte symbols -> bytes). Control tokens give ""
 * unless `special`. Returns the length written (<= cap), or -needed if cap
 * is too small. */
int32_t lk_tokenizer_piece(const lk_tokenizer *t, int32_t id, bool special, char *buf, int32_t cap);

/* The vocabulary entry text as stored (for `info`, `tokenize`). */
const char *lk_tokenizer_token_text(const lk_tokenizer *t, int32_t id, size_t *len);

/* Streaming decoder: feeds tokens one at a time and emits only whole UTF-8
 * characters; handles SentencePiece's leading-space removal after BOS. */
typedef struct {
    const lk_tokenizer *tok;
    char   pending[8];
    int    n_pending;
    bool   at_start;
} lk_detok;
void    lk_detok_init(lk_detok *d, const lk_tokenizer *t);
/* Appends the printable bytes for `id` to out (cap bytes); returns bytes written. */
int32_t lk_detok_push(lk_detok *d, int32_t id, char *out, int32_t cap);
/* Emits whatever is still pending (invalid UTF-8 as U+FFFD). */
int32_t lk_detok_flush(lk_detok *d, char *out, int32_t cap);

#endif
