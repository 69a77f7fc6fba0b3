/* pretokenize — Unicode facts (from ICU) and the BPE pre-tokenisers.
 * See pretokenize.h for the contract. */
#include "tokenizer/pretokenize.h"

#include "common/lk_common.h"

#include <unicode/uchar.h>
#include <unicode/unorm2.h>

/* ======================================================================
 * Unicode facts
 * ==================================================================== */

uint16_t lk_unicode_flags(uint32_t c) {
    if (c > 0x10FFFF) return LK_CPT_UNDEFINED;
    uint16_t f;
    switch (u_charType((UChar32)c)) {
    case U_UPPERCASE_LETTER: case U_LOWERCASE_LETTER: case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER: case U_OTHER_LETTER:
        f = LK_CPT_LETTER; break;
    case U_DECIMAL_DIGIT_NUMBER: case U_LETTER_NUMBER: case U_OTHER_NUMBER:
        f = LK_CPT_NUMBER; break;
    case U_SPACE_SEPARATOR: case U_LINE_SEPARATOR: case U_PARAGRAPH_SEPARATOR:
        f = LK_CPT_SEPARATOR; break;
    case U_NON_SPACING_MARK: case U_ENCLOSING_MARK: case U_COMBINING_SPACING_MARK:
        f = LK_CPT_MARK; break;
    case U_DASH_PUNCTUATION: case U_START_PUNCTUATION: case U_END_PUNCTUATION:
    case U_CONNECTOR_PUNCTUATION: case U_OTHER_PUNCTUATION:
    case U_INITIAL_PUNCTUATION: case U_FINAL_PUNCTUATION:
        f = LK_CPT_PUNCT; break;
    case U_MATH_SYMBOL: case U_CURRENCY_SYMBOL: case U_MODIFIER_SYMBOL: case U_OTHER_SYMBOL:
        f = LK_CPT_SYMBOL; break;
    case U_UNASSIGNED: /* Cn: llama.cpp's tables mark these undefined */
        f = LK_CPT_UNDEFINED; break;
    default: /* Cc, Cf, Cs, Co */
        f = LK_CPT_CONTROL; break;
    }
    if (u_isUWhiteSpace((UChar32)c)) f |= LK_CPT_WHITESPACE;
    return f;
}

uint32_t lk_unicode_tolower(uint32_t c) {
    if (c > 0x10FFFF) return c;
    return (uint32_t)u_tolower((UChar32)c);
}

uint32_t lk_unicode_nfd_first(uint32_t c) {
    if (c > 0x10FFFF) return c;
    UErrorCode st = U_ZERO_ERROR;
    const UNormalizer2 *nfd = unorm2_getNFDInstance(&st);
    if (U_FAILURE(st)) return c;
    UChar buf[32];
    int32_t n = unorm2_getDecomposition(nfd, (UChar32)c, buf, 32, &st);
    if (U_FAILURE(st) || n <= 0) return c;
    if (n >= 2 && buf[0] >= 0xD800 && buf[0] <= 0xDBFF && buf[1] >= 0xDC00 && buf[1] <= 0xDFFF)
        return 0x10000 + (((uint32_t)buf[0] - 0xD800) << 10) + ((uint32_t)buf[1] - 0xDC00);
    return buf[0];
}

/* Mirrors llama.cpp's decoder exactly, including what it does not check
 * (overlong forms and surrogates decode as their arithmetic value), so that
 * our words and theirs agree byte for byte. */
size_t lk_utf8_decode(const char *str, size_t n, uint32_t *cpts) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0, k = 0;
    while (i < n) {
        unsigned c = s[i];
        if (!(c & 0x80)) { cpts[k++] = c; i += 1; continue; }
        int len = 0;
        if (!(c & 0x40)) len = 0;          /* stray continuation byte */
        else if (!(c & 0x20)) len = 2;
        else if (!(c & 0x10)) len = 3;
        else if (!(c & 0x08)) len = 4;
        bool ok = len > 0 && i + (size_t)len <= n;
        for (int j = 1; ok && j < len; j++) ok = (s[i + j] & 0xC0) == 0x80;
        if (!ok) { cpts[k++] = 0xFFFD; i += 1; continue; }
        uint32_t v;
        if (len == 2) v = ((c & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
        else if (len == 3) v = ((c & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
        else v = ((c & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
        cpts[k++] = v;
        i += (size_t)len;
    }
    return k;
}

int lk_utf8_encode(uint32_t c, char *o) {
    if (c > 0x10FFFF) c = 0xFFFD;
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xC0 | (c >> 6)); o[1] = (char)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | (c >> 12)); o[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (char)(0x80 | (c & 0x3F)); return 3;
    }
    o[0] = (char)(0xF0 | (c >> 18)); o[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3F)); o[3] = (char)(0x80 | (c & 0x3F)); return 4;
}

/* ======================================================================
 * Splitting machinery
 *
 * A split is a list of segment lengths. Each pass takes the segments of the
 * previous pass and cuts every one of them independently (a regex never sees
 * across a segment boundary: lookaheads and `$` stop at the segment end).
 * ==================================================================== */

typedef struct {
    const uint32_t *c;  /* code points */
    const uint16_t *f;  /* their flags */
} text_t;

typedef struct {
    uint32_t *lens;
    size_t    n;
} out_t;

static inline void emit(out_t *o, size_t len) {
    if (len) o->lens[o->n++] = (uint32_t)len;
}

/* Flags at i if inside [s, e), else 0 — the "out of range" of the segment. */
static inline uint16_t F(const text_t *t, size_t i, size_t e) { return i < e ? t->f[i] : 0; }

#define IS_WS(fl) ((fl) & LK_CPT_WHITESPACE)
#define IS_L(fl) ((fl) & LK_CPT_LETTER)
#define IS_N(fl) ((fl) & LK_CPT_NUMBER)
#define IS_P(fl) ((fl) & LK_CPT_PUNCT)

/* --- GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * llama.cpp runs this one with a hand-written splitter; this follows it. */
static void split_gpt2(const text_t *t, size_t s, size_t e, out_t *o) {
    size_t pos = s;
    while (pos < e) {
        uint32_t c = t->c[pos];
        uint16_t f = t->f[pos];
        if (c == '\'' && pos + 1 < e) {
            uint32_t n1 = t->c[pos + 1];
            if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') { emit(o, 2); pos += 2; continue; }
            if (pos + 2 < e) {
                uint32_t n2 = t->c[pos + 2];
                if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
                    emit(o, 3); pos += 3; continue;
                }
            }
        }
        size_t start = pos;
        uint16_t f2 = c == ' ' ? F(t, pos + 1, e) : f;
        if (IS_L(f2)) {
            pos += c == ' ';
            while (IS_L(F(t, pos, e))) pos++;
            emit(o, pos - start); continue;
        }
        if (IS_N(f2)) {
            pos += c == ' ';
            while (IS_N(F(t, pos, e))) pos++;
            emit(o, pos - start); continue;
        }
        if (!(f2 & (LK_CPT_WHITESPACE | LK_CPT_LETTER | LK_CPT_NUMBER)) && f2) {
            pos += c == ' ';
            for (uint16_t g = F(t, pos, e); !(g & (LK_CPT_WHITESPACE | LK_CPT_LETTER | LK_CPT_NUMBER)) && g;
                 g = F(t, pos, e))
                pos++;
            emit(o, pos - start); continue;
        }
        size_t nws = 0;
        while (IS_WS(F(t, pos + nws, e))) nws++;
        if (nws > 1 && pos + nws < e) { pos += nws - 1; emit(o, pos - start); continue; } /* \s+(?!\S) */
        if (nws > 0) { pos += nws; emit(o, pos - start); continue; }                     /* \s+ */
        pos++;
        emit(o, 1);
    }
}

/* --- Llama 3 (max_digits 3), Qwen2 (max_digits 1) and Qwen3.5 (max_digits 1,
 * `marks`: \p{M} joins \p{L} in the letter run and in the punctuation
 * class, [\p{L}\p{M}]+ and [^\s\p{L}\p{M}\p{N}]; the optional prefix
 * [^\r\n\p{L}\p{N}]? is unchanged, and a mark it takes is in the run's
 * class anyway, so the spans are the same):
 * (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
 *   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * llama.cpp has a hand-written splitter for the Llama 3 form and runs the Qwen2
 * form through std::regex; for these alternatives the two agree (leftmost-first,
 * greedy with backtracking), so one routine serves both. */
static void split_llama3(const text_t *t, size_t s, size_t e, out_t *o, size_t max_digits, bool marks) {
    const uint16_t L = LK_CPT_LETTER | (marks ? LK_CPT_MARK : 0);
    size_t pos = s;
    while (pos < e) {
        uint32_t c = t->c[pos];
        uint16_t f = t->f[pos];
        size_t start = pos;
        if (c == '\'' && pos + 1 < e) {
            uint32_t n1 = lk_unicode_tolower(t->c[pos + 1]);
            if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') { emit(o, 2); pos += 2; continue; }
            if (pos + 2 < e) {
                uint32_t n2 = lk_unicode_tolower(t->c[pos + 2]);
                if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
                    emit(o, 3); pos += 3; continue;
                }
            }
        }
        /* [^\r\n\p{L}\p{N}]?\p{L}+ */
        if (!(c == '\r' || c == '\n' || IS_N(f))) {
            if ((f & L) || (F(t, pos + 1, e) & L)) {
                pos++;
                while (F(t, pos, e) & L) pos++;
                emit(o, pos - start); continue;
            }
        }
        /* \p{N}{1,max} */
        if (IS_N(f)) {
            size_t ini = pos;
            while (IS_N(F(t, pos, e))) {
                pos++;
                if (pos - ini >= max_digits) { emit(o, pos - ini); ini = pos; }
            }
            emit(o, pos - ini); continue;
        }
        /* ` ?[^\s\p{L}\p{N}]+[\r\n]*` */
        uint16_t f2 = c == ' ' ? F(t, pos + 1, e) : f;
        if (!(f2 & (LK_CPT_WHITESPACE | L | LK_CPT_NUMBER)) && f) {
            pos += c == ' ';
            for (uint16_t g = F(t, pos, e); !(g & (LK_CPT_WHITESPACE | L | LK_CPT_NUMBER)) && g;
                 g = F(t, pos, e))
                pos++;
            while (pos < e && (t->c[pos] == '\r' || t->c[pos] == '\n')) pos++;
            emit(o, pos - start); continue;
        }
        size_t nws = 0, last_rn = 0;
        while (IS_WS(F(t, pos + nws, e))) {
            uint32_t c2 = t->c[pos + nws];
            if (c2 == '\r' || c2 == '\n') last_rn = pos + nws + 1;
            nws++;
        }
        if (last_rn > 0) { pos = last_rn; emit(o, pos - start); continue; }                 /* \s*[\r\n]+ */
        if (nws > 1 && pos + nws < e) { pos += nws - 1; emit(o, pos - start); continue; } /* \s+(?!\S) */
        if (nws > 0) { pos += nws; emit(o, pos - start); continue; }                     /* \s+ */
        pos++;
        emit(o, 1);
    }
}

/* --- generic single-regex passes: a matcher returns the length of the match
 * starting at p (0: none); the pass finds leftmost matches one after another
 * and keeps the text between them as segments of their own. */
typedef size_t (*matcher_fn)(const text_t *t, size_t p, size_t e);

static void split_regex(const text_t *t, size_t s, size_t e, out_t *o, matcher_fn m) {
    size_t prev = s;
    for (size_t p = s; p < e;) {
        size_t len = m(t, p, e);
        if (!len) { p++; continue; }
        emit(o, p - prev);
        emit(o, len);
        p += len;
        prev = p;
    }
    emit(o, e - prev);
}

typedef struct { uint32_t lo, hi; } crange;

static bool in_ranges(uint32_t c, const crange *r, size_t n) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c < r[mid].lo) hi = mid;
        else if (c > r[mid].hi) lo = mid + 1;
        else return true;
    }
    return false;
}

/* The character classes of deepseek-llm's pre-tokeniser, written in its
 * tokenizer.json (and llama.cpp) as literal characters; here as code points.
 * llama.cpp matches these with std::wregex on text whose non-ASCII white space
 * was replaced by U+000B, so such white space never matches a class. */
static const crange k_ds_letters[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xB5, 0xB5}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x1BA},
    {0x1BC, 0x1BF}, {0x1C4, 0x293}, {0x295, 0x2AF}, {0x370, 0x373}, {0x376, 0x377},
    {0x37B, 0x37D}, {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C}, {0x38E, 0x3A1},
    {0x3A3, 0x3F5}, {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556}, {0x10A0, 0x10C5}, {0x13A0, 0x13F5},
    {0x13F8, 0x13FD}, {0x1C90, 0x1CBA}, {0x1CBD, 0x1CBF}, {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A},
    {0x1E00, 0x1F15}, {0x1F18, 0x1F1D}, {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59},
    {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE},
    {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4},
    {0x1FF6, 0x1FFC}, {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D},
    {0x2124, 0x2124}, {0x2126, 0x2126}, {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139},
    {0x213C, 0x213F}, {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B},
    {0x2C7E, 0x2CE4}, {0x2CEB, 0x2CEE}, {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B},
    {0xA722, 0xA76F}, {0xA771, 0xA787}, {0xA78B, 0xA78E}, {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17},
    {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB}, {0x10C80, 0x10CB2},
    {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};
/* [!-/:-~！-／：-～‘-‟　-。] (sorted) */
static const crange k_ds_punct[] = {
    {0x21, 0x2F}, {0x3A, 0x7E}, {0x2018, 0x201F}, {0x3000, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E},
};
/* [一-龥ࠀ-一가-퟿] (sorted, merged) */
static const crange k_cjk[] = { {0x800, 0x9FA5}, {0xAC00, 0xD7FF} };

#define NRANGE(a) (sizeof(a) / sizeof((a)[0]))

/* class test for the wregex passes: non-ASCII white space was replaced by U+000B */
static inline bool wclass(const text_t *t, size_t i, const crange *r, size_t n) {
    uint32_t c = t->c[i];
    if (c > 0x7F && IS_WS(t->f[i])) return false;
    return in_ranges(c, r, n);
}

/* \s?[class]+ (wregex) */
static size_t m_ws_class(const text_t *t, size_t p, size_t e, const crange *r, size_t n) {
    size_t q = p;
    if (IS_WS(t->f[p]) && p + 1 < e && wclass(t, p + 1, r, n)) q = p + 1;
    else if (!wclass(t, p, r, n)) return 0;
    while (q < e && wclass(t, q, r, n)) q++;
    return q - p;
}
static size_t m_ds_letters(const text_t *t, size_t p, size_t e) { return m_ws_class(t, p, e, k_ds_letters, NRANGE(k_ds_letters)); }
static size_t m_ds_punct(const text_t *t, size_t p, size_t e) { return m_ws_class(t, p, e, k_ds_punct, NRANGE(k_ds_punct)); }

static size_t m_cjk(const text_t *t, size_t p, size_t e) {
    size_t q = p;
    while (q < e && wclass(t, q, k_cjk, NRANGE(k_cjk))) q++;
    return q - p;
}

static size_t m_crlf(const text_t *t, size_t p, size_t e) {
    (void)e;
    return t->c[p] == '\r' || t->c[p] == '\n';
}

static size_t m_num1(const text_t *t, size_t p, size_t e) { (void)e; return IS_N(t->f[p]) ? 1 : 0; }
static size_t m_num_run(const text_t *t, size_t p, size_t e) {
    size_t q = p;
    while (q < e && IS_N(t->f[q])) q++;
    return q - p;
}

/* \s?\p{X}+ on llama.cpp's "collapsed" text, where every code point is its
 * category and non-ASCII white space is \v: the same as testing flags. */
static size_t m_ws_cat(const text_t *t, size_t p, size_t e, uint16_t cat) {
    size_t q = p;
    if (IS_WS(t->f[p]) && p + 1 < e && (t->f[p + 1] & cat)) q = p + 1;
    else if (!(t->f[p] & cat)) return 0;
    while (q < e && (t->f[q] & cat)) q++;
    return q - p;
}
static size_t m_ws_letters(const text_t *t, size_t p, size_t e) { return m_ws_cat(t, p, e, LK_CPT_LETTER); }
static size_t m_ws_punct(const text_t *t, size_t p, size_t e) { return m_ws_cat(t, p, e, LK_CPT_PUNCT); }

/* [\p{P}\$\+<=>\^~\|]+ (default) and the same with ` (falcon) */
static inline bool punct_sym(const text_t *t, size_t i, bool backtick) {
    uint32_t c = t->c[i];
    if (IS_P(t->f[i])) return true;
    return c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' || c == '~' || c == '|' ||
           (backtick && c == '`');
}
static size_t m_punct_default(const text_t *t, size_t p, size_t e) {
    size_t q = p;
    while (q < e && punct_sym(t, q, false)) q++;
    return q - p;
}
static size_t m_punct_falcon(const text_t *t, size_t p, size_t e) {
    size_t q = p;
    while (q < e && punct_sym(t, q, true)) q++;
    return q - p;
}

/* [0-9][0-9][0-9] */
static size_t m_digits3(const text_t *t, size_t p, size_t e) {
    if (p + 3 > e) return 0;
    for (size_t i = p; i < p + 3; i++)
        if (t->c[i] < '0' || t->c[i] > '9') return 0;
    return 3;
}

/* \s+$ : the white space run that reaches the end of the segment. */
static void split_trailing_ws(const text_t *t, size_t s, size_t e, out_t *o) {
    size_t q = e;
    while (q > s && IS_WS(t->f[q - 1])) q--;
    emit(o, q - s);
    emit(o, e - q);
}

/* ======================================================================
 * Pre-tokenisers: the regex lists llama.cpp uses per `tokenizer.ggml.pre`
 * ==================================================================== */

typedef enum {
    P_GPT2, P_LLAMA3, P_QWEN2, P_QWEN35, P_CRLF, P_DS_LETTERS, P_DS_PUNCT, P_WS_END, P_CJK, P_NUM_RUN,
    P_NUM1, P_WS_LETTERS, P_WS_PUNCT, P_PUNCT_DEFAULT, P_PUNCT_FALCON, P_DIGITS3, P_END
} pass_t;

static const pass_t *passes_for(lk_pre_kind k) {
    static const pass_t p_default[] = {P_PUNCT_DEFAULT, P_GPT2, P_NUM_RUN, P_DIGITS3, P_END};
    static const pass_t p_gpt2[] = {P_GPT2, P_END};
    static const pass_t p_llama3[] = {P_LLAMA3, P_END};
    static const pass_t p_qwen2[] = {P_QWEN2, P_END};
    static const pass_t p_qwen35[] = {P_QWEN35, P_END};
    static const pass_t p_ds_llm[] = {P_CRLF, P_DS_LETTERS, P_DS_PUNCT, P_WS_END, P_CJK, P_NUM_RUN, P_END};
    static const pass_t p_ds_coder[] = {P_CRLF, P_WS_LETTERS, P_WS_PUNCT, P_CJK, P_NUM1, P_END};
    static const pass_t p_falcon[] = {P_PUNCT_FALCON, P_GPT2, P_DIGITS3, P_END};
    static const pass_t p_starcoder[] = {P_NUM1, P_GPT2, P_END};
    switch (k) {
    case LK_PRE_GPT2: return p_gpt2;
    case LK_PRE_LLAMA3: return p_llama3;
    case LK_PRE_QWEN2: return p_qwen2;
    case LK_PRE_QWEN35: return p_qwen35;
    case LK_PRE_DEEPSEEK_LLM: return p_ds_llm;
    case LK_PRE_DEEPSEEK_CODER: return p_ds_coder;
    case LK_PRE_FALCON: return p_falcon;
    case LK_PRE_STARCODER: return p_starcoder;
    case LK_PRE_DEFAULT: default: return p_default;
    }
}

static void run_pass(pass_t p, const text_t *t, size_t s, size_t e, out_t *o) {
    switch (p) {
    case P_GPT2: split_gpt2(t, s, e, o); break;
    case P_LLAMA3: split_llama3(t, s, e, o, 3, false); break;
    case P_QWEN2: split_llama3(t, s, e, o, 1, false); break;
    case P_QWEN35: split_llama3(t, s, e, o, 1, true); break;
    case P_WS_END: split_trailing_ws(t, s, e, o); break;
    case P_CRLF: split_regex(t, s, e, o, m_crlf); break;
    case P_DS_LETTERS: split_regex(t, s, e, o, m_ds_letters); break;
    case P_DS_PUNCT: split_regex(t, s, e, o, m_ds_punct); break;
    case P_CJK: split_regex(t, s, e, o, m_cjk); break;
    case P_NUM_RUN: split_regex(t, s, e, o, m_num_run); break;
    case P_NUM1: split_regex(t, s, e, o, m_num1); break;
    case P_WS_LETTERS: split_regex(t, s, e, o, m_ws_letters); break;
    case P_WS_PUNCT: split_regex(t, s, e, o, m_ws_punct); break;
    case P_PUNCT_DEFAULT: split_regex(t, s, e, o, m_punct_default); break;
    case P_PUNCT_FALCON: split_regex(t, s, e, o, m_punct_falcon); break;
    case P_DIGITS3: split_regex(t, s, e, o, m_digits3); break;
    case P_END: LK_ASSERT(0);
    }
}

size_t lk_pretok_split(lk_pre_kind kind, const uint32_t *cpts, const uint16_t *flags, size_t n,
                       uint32_t *lens, uint32_t *tmp) {
    if (n == 0) return 0;
    text_t t = {cpts, flags};
    const pass_t *ps = passes_for(kind);
    /* Alternate between the two buffers so the last pass writes into lens. */
    size_t npass = 0;
    while (ps[npass] != P_END) npass++;
    uint32_t *cur = (npass % 2) ? tmp : lens;
    uint32_t *nxt = (npass % 2) ? lens : tmp;
    cur[0] = (uint32_t)n;
    size_t ncur = 1;
    for (size_t k = 0; k < npass; k++) {
        out_t o = {nxt, 0};
        size_t s = 0;
        for (size_t i = 0; i < ncur; i++) {
            size_t e = s + cur[i];
            run_pass(ps[k], &t, s, e, &o);
            s = e;
        }
        LK_ASSERT(s == n && o.n <= n);
        uint32_t *sw = cur; cur = nxt; nxt = sw;
        ncur = o.n;
    }
    LK_ASSERT(cur == lens);
    return ncur;
}
