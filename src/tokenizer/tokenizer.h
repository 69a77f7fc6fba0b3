/* tokenizer — text <-> token ids from the vocabulary in a GGUF file, exactly
 * as llama.cpp tokenises it; chat templates.
 *
 * Owns: SentencePiece-style (`tokenizer.ggml.model` = "llama") and byte-level
 * BPE ("gpt2", with the pre-tokeniser named by `tokenizer.ggml.pre`)
 * vocabularies, special tokens, streaming-safe decoding, chat templates.
 * Callers: cli (run, tokenize, chat), serve. An lk_tokenizer copies what it
 * needs out of the GGUF at load, so it outlives the lk_gguf. Read-only after
 * load: any number of threads may encode/decode at once.
 *
 * Vocabularies: "llama" (SentencePiece: merges by score, byte fallback, "▁"
 * for spaces plus a prefix space), "gpt2" (byte-level BPE with the
 * pre-tokeniser named by tokenizer.ggml.pre: default, gpt-2, mpt, llama-bpe,
 * qwen2, deepseek-llm, deepseek-coder, falcon, starcoder, refact, ...),
 * "bert" (WordPiece). Output matches llama.cpp token for token. */
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
 * untrusted user text; user-defined "added" tokens are always recognised, as
 * in llama.cpp). *ids is malloc'd (caller frees), *n_ids its length. Any bytes
 * are accepted (invalid UTF-8 included); LK_ERR_ARG only for a NULL text or
 * one over 256 MiB. Cost: ~50 ms per MiB of ordinary text. */
lk_status lk_tokenizer_encode(const lk_tokenizer *t, const char *text, size_t len,
                              bool add_special, bool parse_special,
                              int32_t **ids, int32_t *n_ids, char *err, size_t errlen);

/* The bytes a token stands for when detokenising (SentencePiece "▁" -> " ",
 * byte tokens -> the byte, BPE byte symbols -> bytes). Control and unknown
 * tokens give "" unless `special`. Returns the length written (<= cap), or
 * -needed if cap is too small (nothing written). No allocation. */
int32_t lk_tokenizer_piece(const lk_tokenizer *t, int32_t id, bool special, char *buf, int32_t cap);
/* The longest piece of any token, for sizing buffers. */
int32_t lk_tokenizer_max_piece(const lk_tokenizer *t);

/* Whole-sequence decoding: the pieces of ids[0..n) concatenated, with the
 * leading space of the first piece dropped when the vocabulary adds a prefix
 * space (SentencePiece), so decode(encode(text, add_special=false)) == text.
 * No clean-up of spaces before punctuation (unlike llama.cpp's
 * clean_spaces), so this equals what lk_detok streams. Returns the length, or
 * -needed if cap is too small. */
int32_t lk_tokenizer_decode(const lk_tokenizer *t, const int32_t *ids, int32_t n, bool special,
                            char *buf, int32_t cap);

/* The vocabulary entry text as stored (for `info`, `tokenize`). */
const char *lk_tokenizer_token_text(const lk_tokenizer *t, int32_t id, size_t *len);
/* The id of the entry whose text is exactly text[0..len) (e.g. "<|im_end|>"), or -1. */
int32_t     lk_tokenizer_find(const lk_tokenizer *t, const char *text, size_t len);

/* Streaming decoder: feeds tokens one at a time and emits only whole UTF-8
 * characters (a character split across tokens waits in `pending`; bytes that
 * cannot become valid UTF-8 are emitted as U+FFFD). Control tokens print
 * nothing unless `special` is set. If the stream starts with BOS, the first
 * text piece after it loses the SentencePiece prefix space, so pushing a whole
 * prompt [BOS, "▁Once", ...] prints "Once ..."; a stream that starts mid-text
 * keeps every space.
 * One lk_detok per sequence; no allocation. */
typedef struct {
    const lk_tokenizer *tok;
    char   pending[8];  /* an unfinished UTF-8 character (< 4 bytes) */
    int    n_pending;
    bool   started;     /* a token has been pushed */
    bool   at_start;    /* the stream began with BOS and no text followed yet */
    bool   special;     /* print control tokens too (set after init; default false) */
} lk_detok;
void    lk_detok_init(lk_detok *d, const lk_tokenizer *t);
/* Appends the printable bytes for `id` to out (cap bytes); returns bytes
 * written, or -needed if cap is too small (then nothing is consumed).
 * cap >= 3 * (lk_tokenizer_max_piece() + 4) always suffices. */
int32_t lk_detok_push(lk_detok *d, int32_t id, char *out, int32_t cap);
/* Emits whatever is still pending (an unfinished character: U+FFFD per byte). */
int32_t lk_detok_flush(lk_detok *d, char *out, int32_t cap);

#endif
