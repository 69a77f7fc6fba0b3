/* pretokenize — internal to the tokenizer part (only tokenizer.c includes it).
 *
 * Unicode facts and the pre-tokenisers of byte-level BPE vocabularies: text
 * (as code points) is cut into "words" before BPE merges run inside each word.
 * Each pre-tokeniser is the list of regular expressions llama.cpp applies for
 * a `tokenizer.ggml.pre` name; they are implemented here as hand-written
 * matchers with the regex semantics llama.cpp gets (leftmost-first alternation,
 * greedy quantifiers with backtracking, std::regex run on each segment of the
 * previous split separately, unmatched text kept as its own segment).
 *
 * Unicode categories and the White_Space property come from ICU (Debian
 * libicu-dev), which stands in for llama.cpp's generated tables: the same
 * general categories (\p{L}, \p{N}, \p{P}, ...), White_Space for \s, simple
 * lowercase, first code point of the NFD decomposition. */
#ifndef LK_TOKENIZER_PRETOKENIZE_H
#define LK_TOKENIZER_PRETOKENIZE_H

#include <stddef.h>
#include <stdint.h>

/* Code point flags, one category bit each plus white space (as llama.cpp). */
enum {
    LK_CPT_UNDEFINED = 0x001, /* unassigned, or beyond U+10FFFF */
    LK_CPT_NUMBER = 0x002,    /* \p{N} */
    LK_CPT_LETTER = 0x004,    /* \p{L} */
    LK_CPT_SEPARATOR = 0x008, /* \p{Z} */
    LK_CPT_MARK = 0x010,      /* \p{M} */
    LK_CPT_PUNCT = 0x020,     /* \p{P} */
    LK_CPT_SYMBOL = 0x040,    /* \p{S} */
    LK_CPT_CONTROL = 0x080,   /* \p{C} except unassigned: Cc, Cf, Cs, Co */
    LK_CPT_WHITESPACE = 0x100,/* \s: the White_Space property */
};

/* Never 0 for a code point: callers use 0 for "outside the segment". */
uint16_t lk_unicode_flags(uint32_t cpt);
uint32_t lk_unicode_tolower(uint32_t cpt);
/* First code point of the canonical decomposition (WordPiece accent strip). */
uint32_t lk_unicode_nfd_first(uint32_t cpt);

/* UTF-8 -> code points like llama.cpp's unicode_cpts_from_utf8: a byte that
 * does not start a well-formed sequence becomes U+FFFD and decoding resumes at
 * the next byte. cpts must have room for n entries. Returns the count. */
size_t lk_utf8_decode(const char *s, size_t n, uint32_t *cpts);
/* Writes the UTF-8 of cpt (1-4 bytes; > U+10FFFF is written as U+FFFD). */
int lk_utf8_encode(uint32_t cpt, char *out);
/* Length of the UTF-8 sequence a lead byte announces (1 for stray bytes). */
static inline int lk_utf8_len(unsigned char c) {
    static const uint8_t k[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return k[c >> 4];
}

typedef enum {
    LK_PRE_DEFAULT = 0,
    LK_PRE_GPT2,           /* gpt-2, mpt, olmo, phi-2, jina-*, ... */
    LK_PRE_LLAMA3,         /* llama-bpe, llama3, dbrx, smaug-bpe, ... */
    LK_PRE_QWEN2,          /* qwen2, stablelm2, megrez, deepseek-r1-qwen, ... */
    LK_PRE_DEEPSEEK_LLM,
    LK_PRE_DEEPSEEK_CODER,
    LK_PRE_FALCON,
    LK_PRE_STARCODER,      /* starcoder, refact, command-r, smollm, codeshell, exaone, minerva */
    LK_PRE_QWEN35,         /* qwen35: qwen2's with \p{M} beside \p{L} */
} lk_pre_kind;

/* Splits cpts[0..n) into words. flags[i] = lk_unicode_flags(cpts[i]) (the
 * caller computes them once). Word lengths (in code points, all > 0, summing
 * to n) go to lens; tmp is scratch. lens and tmp each hold n entries.
 * Returns the number of words. */
size_t lk_pretok_split(lk_pre_kind kind, const uint32_t *cpts, const uint16_t *flags, size_t n,
                       uint32_t *lens, uint32_t *tmp);

#endif
