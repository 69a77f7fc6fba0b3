/* The handshake (see cluster.h for the message sequence), the cluster key,
 * and the facts the two sides compare: build id and CPU features. */
#include "cluster/cluster.h"

#include <ctype.h>
#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>

#ifndef LK_BUILD_ID
/* The Makefile may pass the source revision; without it, the protocol
 * version stands in (builds of one protocol then count as compatible). */
#define LK_BUILD_ID "lockstep-proto3"
#endif

const char *lk_build_id(void) { return LK_BUILD_ID; }

/* The features that change which kernels run, and so the exact bits of a
 * result: two ranks computing with different SIMD paths would make
 * "bitwise identical on every rank" false. From the program's one CPU probe
 * (lk_cpu), with the SIMD level in force ("simd=avx2"). */
const char *lk_cpu_features(void) {
    static char buf[160];
    static _Atomic int done;
    if (done) return buf;
    char tmp[160] = "";
#if defined(__x86_64__)
    static const uint32_t named[] = {LK_CPU_AVX2, LK_CPU_FMA, LK_CPU_F16C, LK_CPU_AVX512F,
                                     LK_CPU_AVX512BW, LK_CPU_AVX512VNNI, LK_CPU_AVX512BF16, LK_CPU_AMXBF16};
    strcat(tmp, "x86_64");
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (lk_cpu()->feat & named[i]) {
            strcat(tmp, " ");
            strcat(tmp, lk_cpu_feature_name(named[i]));
        }
#elif defined(__aarch64__)
    strcat(tmp, "aarch64");
#else
    strcat(tmp, "other");
#endif
    /* the level in force too: two ranks of one CPU model run different
     * kernels when LK_SIMD differs (a mismatch, named with both strings) */
    strcat(tmp, " simd=");
    strcat(tmp, lk_simd_level_name(lk_cpu()->level));
    memcpy(buf, tmp, sizeof buf); /* same bytes from any racing thread */
    done = 1;
    return buf;
}

/* Whether `word` is one of the space-separated words of `list`. */
static bool has_word(const char *list, const char *word) {
    const size_t n = strlen(word);
    for (const char *p = list; (p = strstr(p, word)); p += n)
        if ((p == list || p[-1] == ' ') && (p[n] == ' ' || p[n] == 0)) return true;
    return false;
}

/* What would make two feature strings (lk_cpu_features) agree, for a
 * mismatch's message: the features side `a` has and `b` lacks, as the
 * LK_CPU_OFF that takes them away on a's side; when only the levels
 * differ, the LK_SIMD that brings the higher one down. Empty when a has
 * nothing to give up. */
static void agree_hint(const char *a, const char *b, const char *side, char *out, size_t len) {
    char words[160], off[160] = "";
    const char *sa = strstr(a, "simd="), *sb = strstr(b, "simd=");
    snprintf(words, sizeof words, "%s", a);
    for (char *save = NULL, *w = strtok_r(words, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
        if (!strncmp(w, "simd=", 5) || has_word(b, w)) continue;
        size_t k = strlen(off);
        snprintf(off + k, sizeof off - k, "%s%s", k ? "," : "", w);
    }
    lk_simd_level la, lb;
    out[0] = 0;
    if (off[0])
        snprintf(out, len, "; LK_CPU_OFF=%s on the %s would make them agree", off, side);
    else if (sa && sb && lk_simd_level_parse(sa + 5, &la) && lk_simd_level_parse(sb + 5, &lb) && la > lb)
        snprintf(out, len, "; LK_SIMD=%s on the %s would make them agree", sb + 5, side);
}

/* The first line of FILE that starts with KEY, after its ':' (or the whole
 * first line when KEY is NULL), trimmed and made printable ASCII. */
static void read_fact(const char *file, const char *key, char *out, size_t len) {
    snprintf(out, len, "?");
    FILE *f = fopen(file, "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        const char *v = line;
        if (key) {
            if (strncmp(line, key, strlen(key))) continue;
            const char *c = strchr(line, ':');
            if (!c) continue;
            v = c + 1;
        }
        while (*v == ' ' || *v == '\t') v++;
        snprintf(out, len, "%s", v);
        out[strcspn(out, "\n")] = 0;
        for (char *p = out; *p; p++)
            if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e) *p = '?';
        if (!out[0]) snprintf(out, len, "?");
        break;
    }
    fclose(f);
}

void lk_host_facts(char *cpu_model, size_t mlen, char *clocksource, size_t clen) {
    read_fact("/proc/cpuinfo", "model name", cpu_model, mlen);
    read_fact("/sys/devices/system/clocksource/clocksource0/current_clocksource", NULL, clocksource, clen);
}

/* ---- key ------------------------------------------------------------------------ */

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

lk_status lk_key_load(const char *path, uint8_t key[LK_KEY_BYTES], char *err, size_t errlen) {
    if (!path || !*path) return lk_fail(err, errlen, LK_ERR_ARG, "no --key-file given (make one with 'lockstep keygen > cluster.key')");
    FILE *f = fopen(path, "r");
    if (!f) return lk_fail(err, errlen, LK_ERR_IO, "key file %s: %s", path, strerror(errno));
    char buf[256];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    bool rerr = ferror(f);
    fclose(f);
    if (rerr) return lk_fail(err, errlen, LK_ERR_IO, "key file %s: read error", path);
    buf[n] = 0;
    char *s = buf;
    while (*s && isspace((unsigned char)*s)) s++;
    size_t len = 0;
    while (s[len] && !isspace((unsigned char)s[len])) len++;
    for (size_t i = len; s[i]; i++)
        if (!isspace((unsigned char)s[i]))
            return lk_fail(err, errlen, LK_ERR_FORMAT, "key file %s: unexpected text after the key", path);
    if (len != 2 * LK_KEY_BYTES)
        return lk_fail(err, errlen, LK_ERR_FORMAT, "key file %s: expected %d hex digits, found %zu characters%s", path,
                       2 * LK_KEY_BYTES, len, n == sizeof buf - 1 ? " or more" : "");
    for (int i = 0; i < LK_KEY_BYTES; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            sodium_memzero(buf, sizeof buf);
            return lk_fail(err, errlen, LK_ERR_FORMAT, "key file %s: character %d is not a hex digit", path,
                           2 * i + (hi < 0 ? 1 : 2));
        }
        key[i] = (uint8_t)(hi << 4 | lo);
    }
    sodium_memzero(buf, sizeof buf);
    return LK_OK;
}

static void sodium_ready(void) {
    /* Idempotent and thread-safe per libsodium; -1 only if no entropy source. */
    if (sodium_init() < 0) LK_ASSERT(!"libsodium could not initialise (no entropy source?)");
}

void lk_key_generate(char hex[2 * LK_KEY_BYTES + 1]) {
    sodium_ready();
    uint8_t k[LK_KEY_BYTES];
    randombytes_buf(k, sizeof k);
    sodium_bin2hex(hex, 2 * LK_KEY_BYTES + 1, k, sizeof k);
    sodium_memzero(k, sizeof k);
}

/* ---- handshake ---------------------------------------------------------------------- */

void lk_hs_defaults(lk_hs_params *p, const uint8_t *key, const char *role) {
    memset(p, 0, sizeof *p);
    p->key = key;
    p->role = role;
    p->version = LK_WIRE_VERSION;
    p->build_id = lk_build_id();
    p->cpu = lk_cpu_features();
    p->timeout_ms = 5000;
}

#define CHALLENGE 32

static void proof(const uint8_t *key, bool initiator, const uint8_t ci[CHALLENGE], const uint8_t cr[CHALLENGE],
                  uint8_t out[crypto_auth_hmacsha256_BYTES]) {
    crypto_auth_hmacsha256_state st;
    const char *label = initiator ? "lockstep-auth-v1 initiator" : "lockstep-auth-v1 responder";
    crypto_auth_hmacsha256_init(&st, key, LK_KEY_BYTES);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, strlen(label) + 1);
    crypto_auth_hmacsha256_update(&st, ci, CHALLENGE);
    crypto_auth_hmacsha256_update(&st, cr, CHALLENGE);
    crypto_auth_hmacsha256_final(&st, out);
}

/* Receives exactly one frame of `type` with a payload of [min, cap] bytes. */
static lk_status recv_type(lk_chan *c, uint16_t type, void *buf, uint32_t min, uint32_t cap, uint32_t *len,
                           uint64_t dl, const char *peer, char *err, size_t errlen) {
    lk_frame_hdr h;
    char why[LK_ERRLEN];
    lk_status st = lk_chan_recv(c, &h, buf, cap, dl, why, sizeof why);
    if (st == LK_ERR_PEER) return lk_fail(err, errlen, st, "%s refused: %s", peer, why);
    if (st) {
        /* Say why to the peer too (it may be an honest but different build). */
        if (st == LK_ERR_FORMAT || st == LK_ERR_MISMATCH) lk_chan_send_error(c, why);
        return lk_fail(err, errlen, st, "%s: %s", peer, why);
    }
    if (h.type != type || h.len < min) {
        lk_fail(why, sizeof why, LK_ERR_FORMAT, "expected a %s frame, got %s of %u bytes", lk_msg_name(type),
                lk_msg_name(h.type), h.len);
        lk_chan_send_error(c, why);
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s: %s", peer, why);
    }
    if (len) *len = h.len;
    return LK_OK;
}

/* A send that failed because the peer closed: it may have said why first
 * (a busy worker answers with an ERROR frame and closes at once, perhaps
 * before our HELLO is out). Its reason beats "Broken pipe". */
static lk_status sent(lk_chan *c, lk_status st, const char *peer, char *err, size_t errlen) {
    if (st != LK_ERR_NET) return st;
    lk_frame_hdr h;
    char why[LK_ERRLEN];
    uint8_t b[CHALLENGE];
    if (lk_chan_recv(c, &h, b, sizeof b, lk_deadline_ms(100), why, sizeof why) == LK_ERR_PEER)
        return lk_fail(err, errlen, LK_ERR_PEER, "%s refused: %s", peer, why);
    return st;
}

const char *lk_seal_mode_desc(lk_seal_mode m) {
    return m == LK_SEAL_ON ? "requires sealed links (--seal)"
         : m == LK_SEAL_EITHER ? "seals only when asked (no --seal)" : "does not seal (no --seal)";
}

/* One direction's key (see cluster.h): keyed with the cluster key, so only
 * the two holders of it can compute it; fresh per connection through both
 * challenges; bound to everything the plain part of the handshake said. */
static void seal_key(const uint8_t *key, bool i2r, const uint8_t ci[CHALLENGE], const uint8_t cr[CHALLENGE],
                     const uint8_t transcript[32], uint8_t out[LK_SEAL_KEY_BYTES]) {
    const char *label = i2r ? "lockstep-seal-v1 initiator->responder" : "lockstep-seal-v1 responder->initiator";
    crypto_generichash_state st;
    crypto_generichash_init(&st, key, LK_KEY_BYTES, LK_SEAL_KEY_BYTES);
    crypto_generichash_update(&st, (const uint8_t *)label, strlen(label) + 1);
    crypto_generichash_update(&st, ci, CHALLENGE);
    crypto_generichash_update(&st, cr, CHALLENGE);
    crypto_generichash_update(&st, transcript, 32);
    crypto_generichash_final(&st, out, LK_SEAL_KEY_BYTES);
}

static void hash_part(crypto_generichash_state *st, const uint8_t *p, uint32_t n) {
    uint8_t len[4] = {(uint8_t)n, (uint8_t)(n >> 8), (uint8_t)(n >> 16), (uint8_t)(n >> 24)};
    crypto_generichash_update(st, len, 4); /* length-prefixed: no two splits hash alike */
    crypto_generichash_update(st, p, n);
}

/* HMAC of both INFO payloads (initiator's first) under the cluster key and
 * this connection's challenges, labelled by who sends it (no reflection). */
static void info_mac(const uint8_t *key, bool initiator, const uint8_t *ci, const uint8_t *cr, const uint8_t *info_i,
                     uint32_t len_i, const uint8_t *info_r, uint32_t len_r, uint8_t out[32]) {
    const char *label = initiator ? "lockstep-info-v1 initiator" : "lockstep-info-v1 responder";
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, key, LK_KEY_BYTES);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, strlen(label) + 1);
    crypto_auth_hmacsha256_update(&st, ci, CHALLENGE);
    crypto_auth_hmacsha256_update(&st, cr, CHALLENGE);
    uint8_t l[8] = {(uint8_t)len_i, (uint8_t)(len_i >> 8), (uint8_t)(len_i >> 16), (uint8_t)(len_i >> 24),
                    (uint8_t)len_r, (uint8_t)(len_r >> 8), (uint8_t)(len_r >> 16), (uint8_t)(len_r >> 24)};
    crypto_auth_hmacsha256_update(&st, l, sizeof l);
    crypto_auth_hmacsha256_update(&st, info_i, len_i);
    crypto_auth_hmacsha256_update(&st, info_r, len_r);
    crypto_auth_hmacsha256_final(&st, out);
}

#define SEAL_CHECK "lockstep sealed"

/* Bit c set: this side can seal with cipher c (lk_seal_cipher). */
static uint8_t my_ciphers(const lk_hs_params *p) {
    uint8_t m = 0;
    for (int c = LK_SEAL_CHACHA20_POLY1305; c <= LK_SEAL_AES256_GCM; c++)
        if (lk_seal_cipher_available((lk_seal_cipher)c)) m |= (uint8_t)(1u << c);
    if (p->seal_ciphers) m &= p->seal_ciphers;
    return m | 1; /* ChaCha20-Poly1305 always */
}

/* Switches c to a sealed link and proves both ends hold the same keys: each
 * sends a first sealed record and opens the other's. */
static lk_status seal_start(lk_chan *c, bool initiator, lk_seal_cipher cipher, const uint8_t *key, const uint8_t *ci,
                            const uint8_t *cr, const uint8_t transcript[32], uint64_t dl, const char *pname, char *err,
                            size_t errlen) {
    uint8_t k_ir[LK_SEAL_KEY_BYTES], k_ri[LK_SEAL_KEY_BYTES];
    seal_key(key, true, ci, cr, transcript, k_ir);
    seal_key(key, false, ci, cr, transcript, k_ri);
    c->link = lk_seal_wrap(c->link, cipher, initiator ? k_ir : k_ri, initiator ? k_ri : k_ir);
    sodium_memzero(k_ir, sizeof k_ir);
    sodium_memzero(k_ri, sizeof k_ri);
    char why[LK_ERRLEN];
    uint8_t got[sizeof SEAL_CHECK];
    lk_status st = lk_link_send(c->link, SEAL_CHECK, sizeof SEAL_CHECK, dl, why, sizeof why);
    if (!st) st = lk_link_recv(c->link, got, sizeof got, dl, why, sizeof why);
    if (!st && memcmp(got, SEAL_CHECK, sizeof got)) st = lk_fail(why, sizeof why, LK_ERR_AUTH, "wrong check record");
    if (st) {
        c->link = lk_seal_unwrap(c->link);
        return lk_fail(err, errlen, st == LK_ERR_TIMEOUT ? st : LK_ERR_AUTH,
                       "%s: sealed link check failed (was the handshake altered in transit?): %s", pname, why);
    }
    return LK_OK;
}

lk_status lk_handshake(lk_chan *c, bool initiator, const lk_hs_params *p, lk_hs_peer *peer,
                       char *err, size_t errlen) {
    sodium_ready();
    LK_ASSERT(p->key && p->role);
    uint64_t dl = lk_deadline_ms(p->timeout_ms > 0 ? p->timeout_ms : 5000);
    c->version = p->version;
    memset(peer, 0, sizeof *peer);
    char pname[128];
    lk_link_name(c->link, pname, sizeof pname);
    lk_status st;

    /* 1. challenges (ours may have gone out already: lk_hs_mesh_auth.open) */
    uint8_t mine[CHALLENGE], theirs[CHALLENGE];
    if (p->hello_sent) {
        LK_ASSERT(!initiator && c->seq_out == 1);
        memcpy(mine, p->hello_sent, CHALLENGE);
    } else {
        randombytes_buf(mine, sizeof mine);
        st = lk_chan_send(c, LK_MSG_HELLO, mine, CHALLENGE, dl, err, errlen);
        if (st) return sent(c, st, pname, err, errlen);
    }
    if ((st = recv_type(c, LK_MSG_HELLO, theirs, CHALLENGE, CHALLENGE, NULL, dl, pname, err, errlen))) return st;
    const uint8_t *ci = initiator ? mine : theirs, *cr = initiator ? theirs : mine;
    if (sodium_memcmp(mine, theirs, CHALLENGE) == 0)
        return lk_fail(err, errlen, LK_ERR_AUTH, "%s echoed our challenge (reflection?)", pname);

    /* 2. proofs: initiator first, the responder only after checking it */
    uint8_t my_proof[32], want[32], got[32];
    proof(p->key, initiator, ci, cr, my_proof);
    proof(p->key, !initiator, ci, cr, want);
    if (initiator && (st = lk_chan_send(c, LK_MSG_AUTH, my_proof, 32, dl, err, errlen)))
        return sent(c, st, pname, err, errlen);
    if ((st = recv_type(c, LK_MSG_AUTH, got, 32, 32, NULL, dl, pname, err, errlen))) {
        if (st == LK_ERR_PEER && initiator) {
            char why[LK_ERRLEN];
            snprintf(why, sizeof why, "%s", err ? err : "");
            return lk_fail(err, errlen, LK_ERR_AUTH, "%s (do both sides use the same --key-file?)", why);
        }
        return st;
    }
    if (crypto_verify_32(got, want) != 0) {
        lk_chan_send_error(c, "authentication failed: you do not hold this cluster's key");
        return lk_fail(err, errlen, LK_ERR_AUTH, "%s failed authentication: it does not hold our cluster key", pname);
    }
    if (!initiator && (st = lk_chan_send(c, LK_MSG_AUTH, my_proof, 32, dl, err, errlen))) return st;

    /* 3. facts */
    uint8_t ib[1024];
    lk_wbuf w = {ib, sizeof ib, 0, true};
    lk_wb_u32(&w, p->version);
    lk_wb_str(&w, p->role);
    lk_wb_str(&w, p->build_id);
    lk_wb_str(&w, p->cpu);
    lk_wb_u8(&w, p->has_model);
    lk_wb_bytes(&w, p->model_id, LK_MODEL_ID_BYTES);
    /* last and optional: a peer that does not send it does not seal */
    lk_wb_u8(&w, (uint8_t)p->seal);
    lk_wb_u8(&w, my_ciphers(p));
    /* last and optional too: this host's facts, which doctor shows */
    char model[96], clk[32];
    lk_host_facts(model, sizeof model, clk, sizeof clk);
    lk_wb_str(&w, model);
    lk_wb_str(&w, clk);
    lk_wb_u32(&w, (uint32_t)lk_cpus_usable());
    lk_wb_u32(&w, (uint32_t)lk_threads_default());
    lk_wb_u64(&w, lk_mem_available());
    LK_ASSERT(w.ok);
    uint32_t ilen = w.len;
    if ((st = lk_chan_send(c, LK_MSG_INFO, ib, w.len, dl, err, errlen))) return st;
    uint8_t pb[1024];
    uint32_t plen;
    if ((st = recv_type(c, LK_MSG_INFO, pb, 0, sizeof pb, &plen, dl, pname, err, errlen))) return st;
    lk_rbuf r = {pb, plen, 0, true};
    peer->version = lk_rb_u32(&r);
    lk_rb_str(&r, peer->role, sizeof peer->role);
    lk_rb_str(&r, peer->build_id, sizeof peer->build_id);
    lk_rb_str(&r, peer->cpu, sizeof peer->cpu);
    peer->has_model = lk_rb_u8(&r) != 0;
    lk_rb_bytes(&r, peer->model_id, LK_MODEL_ID_BYTES);
    uint8_t pseal = r.pos < r.len ? lk_rb_u8(&r) : LK_SEAL_OFF;
    peer->seal = (lk_seal_mode)pseal;
    peer->seal_ciphers = r.pos < r.len ? lk_rb_u8(&r) : 1;
    if (r.pos < r.len) {
        lk_rb_str(&r, peer->cpu_model, sizeof peer->cpu_model);
        lk_rb_str(&r, peer->clocksource, sizeof peer->clocksource);
        peer->cpus = (int32_t)lk_rb_u32(&r);
        peer->threads_default = (int32_t)lk_rb_u32(&r);
        peer->mem_avail = lk_rb_u64(&r);
        peer->has_facts = r.ok && peer->cpus > 0 && peer->threads_default > 0;
    }
    if (!r.ok || r.pos != r.len || pseal > LK_SEAL_ON) {
        lk_chan_send_error(c, "malformed INFO frame");
        return lk_fail(err, errlen, LK_ERR_FORMAT, "%s sent a malformed INFO frame", pname);
    }

    /* 4. verdicts: both sides compare the same two sets of facts, so each
     * prints the same reason; naming sides by role keeps it unambiguous. */
    char reason[600] = "";
    const char *me = p->role, *them = peer->role;
    if (peer->version != p->version)
        snprintf(reason, sizeof reason, "protocol version mismatch: %s speaks %u, %s speaks %u", me, p->version, them,
                 peer->version);
    else if (strcmp(peer->build_id, p->build_id))
        snprintf(reason, sizeof reason, "build mismatch: %s is %s, %s is %s", me, p->build_id, them, peer->build_id);
    else if (strcmp(peer->cpu, p->cpu)) {
        char ha[200], hb[200];
        agree_hint(p->cpu, peer->cpu, me, ha, sizeof ha);
        agree_hint(peer->cpu, p->cpu, them, hb, sizeof hb);
        snprintf(reason, sizeof reason, "CPU feature mismatch: %.16s has [%.150s], %.16s has [%.150s]%.110s%.110s", me,
                 p->cpu, them, peer->cpu, ha, hb);
    }
    else if (p->has_model && peer->has_model && sodium_memcmp(p->model_id, peer->model_id, LK_MODEL_ID_BYTES)) {
        char a[LK_MODEL_ID_HEX], b[LK_MODEL_ID_HEX]; /* enough bytes that two different ids differ */
        lk_cluster_model_id_pair(p->model_id, peer->model_id, a, b);
        snprintf(reason, sizeof reason, "model mismatch: %s has %s, %s has %s", me, a, them, b);
    } else if ((p->seal == LK_SEAL_ON && peer->seal == LK_SEAL_OFF) ||
               (p->seal == LK_SEAL_OFF && peer->seal == LK_SEAL_ON)) {
        snprintf(reason, sizeof reason, "seal mismatch: %s %s, %s %s", me, lk_seal_mode_desc(p->seal), them,
                 lk_seal_mode_desc(peer->seal));
    }
    /* The VERDICT carries a MAC over both INFO frames as this side saw
     * them: INFO travels in clear, and its facts (the seal modes above all)
     * must not be alterable on the way without both sides noticing. */
    uint8_t my_mac[32], want_mac[32];
    info_mac(p->key, initiator, ci, cr, initiator ? ib : pb, initiator ? ilen : plen, initiator ? pb : ib,
             initiator ? plen : ilen, my_mac);
    info_mac(p->key, !initiator, ci, cr, initiator ? ib : pb, initiator ? ilen : plen, initiator ? pb : ib,
             initiator ? plen : ilen, want_mac);
    uint8_t vb[700];
    w = (lk_wbuf){vb, sizeof vb, 0, true};
    lk_wb_u8(&w, reason[0] == 0);
    lk_wb_str(&w, reason);
    lk_wb_bytes(&w, my_mac, sizeof my_mac);
    LK_ASSERT(w.ok);
    if ((st = lk_chan_send(c, LK_MSG_VERDICT, vb, w.len, dl, err, errlen))) return st;
    uint8_t tb[1024];
    uint32_t tlen;
    st = recv_type(c, LK_MSG_VERDICT, tb, 1, sizeof tb, &tlen, dl, pname, err, errlen);
    if (st) {
        if (reason[0]) return lk_fail(err, errlen, LK_ERR_MISMATCH, "%s: %s", pname, reason);
        return st;
    }
    r = (lk_rbuf){tb, tlen, 0, true};
    uint8_t ok = lk_rb_u8(&r);
    char theirs_reason[600];
    lk_rb_str(&r, theirs_reason, sizeof theirs_reason);
    uint8_t their_mac[32];
    bool has_mac = r.ok && r.len - r.pos == sizeof their_mac; /* an older build sends none */
    if (has_mac) lk_rb_bytes(&r, their_mac, sizeof their_mac);
    /* A wrong MAC explains any disagreement: say so first. */
    if (has_mac && crypto_verify_32(their_mac, want_mac) != 0) {
        lk_chan_send_error(c, "the handshake was altered in transit (INFO frames differ between the two ends)");
        return lk_fail(err, errlen, LK_ERR_AUTH,
                       "%s: the handshake was altered in transit (its INFO frames differ between the two ends)", pname);
    }
    if (reason[0]) return lk_fail(err, errlen, LK_ERR_MISMATCH, "%s: %s", pname, reason);
    if (!r.ok) return lk_fail(err, errlen, LK_ERR_FORMAT, "%s sent a malformed VERDICT frame", pname);
    if (!ok) return lk_fail(err, errlen, LK_ERR_MISMATCH, "%s refused: %s", pname, theirs_reason);
    if (!has_mac) {
        lk_chan_send_error(c, "no proof of the handshake's INFO frames in your VERDICT (an older build?)");
        return lk_fail(err, errlen, LK_ERR_AUTH, "%s sent no proof of the handshake's INFO frames (an older build?)",
                       pname);
    }

    /* 5. sealing, when either side requires it */
    if (p->seal != LK_SEAL_ON && peer->seal != LK_SEAL_ON) return LK_OK;
    uint8_t transcript[32];
    crypto_generichash_state hs;
    crypto_generichash_init(&hs, NULL, 0, sizeof transcript);
    hash_part(&hs, initiator ? ib : pb, initiator ? ilen : plen);
    hash_part(&hs, initiator ? pb : ib, initiator ? plen : ilen);
    hash_part(&hs, initiator ? vb : tb, initiator ? w.len : tlen);
    hash_part(&hs, initiator ? tb : vb, initiator ? tlen : w.len);
    crypto_generichash_final(&hs, transcript, sizeof transcript);
    /* the faster cipher when both have it; ChaCha20-Poly1305 runs everywhere */
    lk_seal_cipher cipher = (my_ciphers(p) & peer->seal_ciphers & 2) ? LK_SEAL_AES256_GCM : LK_SEAL_CHACHA20_POLY1305;
    if ((st = seal_start(c, initiator, cipher, p->key, ci, cr, transcript, dl, pname, err, errlen))) return st;
    peer->sealed = true;
    peer->cipher = cipher;
    return LK_OK;
}

/* ---- lk_hs_mesh_auth: the handshake in steps for a gate (transport.h) -------- */

static lk_status auth_connect(void *ctx, lk_link **l, uint64_t deadline_ns, char *err, size_t errlen) {
    lk_hs_params hp = *(const lk_hs_params *)ctx;
    int64_t left = (int64_t)(deadline_ns - lk_time_ns()) / 1000000;
    if (left < 1) left = 1;
    if (!hp.timeout_ms || hp.timeout_ms > left) hp.timeout_ms = left;
    lk_chan c;
    lk_chan_init(&c, *l);
    lk_hs_peer peer;
    lk_status st = lk_handshake(&c, true, &hp, &peer, err, errlen);
    *l = c.link;
    return st;
}

bool lk_hs_busy(lk_status st, const char *err) { return st == LK_ERR_PEER && err && strstr(err, LK_GATE_BUSY); }

static bool auth_retry(void *ctx, lk_status st, const char *err) {
    (void)ctx;
    return lk_hs_busy(st, err);
}

/* Our HELLO, at accept: the initiator sends its AUTH only after it. */
static lk_status auth_open(void *ctx, lk_link *l, uint8_t state[LK_AUTH_STATE], char *err, size_t errlen) {
    const lk_hs_params *hp = ctx;
    sodium_ready();
    randombytes_buf(state, CHALLENGE);
    lk_chan c;
    lk_chan_init(&c, l);
    c.version = hp->version;
    return lk_chan_send(&c, LK_MSG_HELLO, state, CHALLENGE, lk_deadline_ms(200), err, errlen);
}

/* Ready once the initiator's HELLO and AUTH are in, or a frame that
 * lk_handshake refuses without reading further: from then on the
 * handshake never waits on a peer that has not proved it holds the key.
 * A first frame other than a HELLO is refused here. */
int lk_hs_ready(uint16_t version, const uint8_t *p, size_t n, char *err, size_t errlen) {
    if (n < LK_WIRE_HDR) return 0;
    lk_frame_hdr h;
    if (lk_wire_decode_hdr(p, version, &h, err, errlen)) return -1;
    if (h.type != LK_MSG_HELLO || h.len != CHALLENGE) {
        lk_fail(err, errlen, LK_ERR_FORMAT, "expected a HELLO frame, got %s of %u bytes", lk_msg_name(h.type), h.len);
        return -1;
    }
    size_t at = LK_WIRE_HDR + CHALLENGE;
    if (n < at + LK_WIRE_HDR) return 0;
    if (lk_wire_decode_hdr(p + at, version, &h, NULL, 0)) return 1;
    /* what lk_chan_recv reads before it can fail: an ERROR's reason, or a
     * payload that fits AUTH's 32 bytes */
    size_t need = h.type == LK_MSG_ERROR ? h.len : h.len <= 32 ? h.len : 0;
    return n >= at + LK_WIRE_HDR + need;
}

static int auth_ready(void *ctx, const uint8_t *p, size_t n, char *err, size_t errlen) {
    return lk_hs_ready(((const lk_hs_params *)ctx)->version, p, n, err, errlen);
}

static lk_status auth_accept(void *ctx, lk_link **l, const uint8_t state[LK_AUTH_STATE], uint64_t deadline_ns,
                             char *err, size_t errlen) {
    lk_hs_params hp = *(const lk_hs_params *)ctx;
    int64_t left = (int64_t)(deadline_ns - lk_time_ns()) / 1000000;
    if (left < 1) left = 1;
    if (!hp.timeout_ms || hp.timeout_ms > left) hp.timeout_ms = left;
    hp.hello_sent = state;
    lk_chan c;
    lk_chan_init(&c, *l);
    c.seq_out = 1; /* the HELLO auth_open sent */
    lk_hs_peer peer;
    lk_status st = lk_handshake(&c, false, &hp, &peer, err, errlen);
    *l = c.link;
    return st;
}

static void auth_refuse(void *ctx, lk_link *l, bool opened, const char *why) {
    lk_chan c;
    lk_chan_init(&c, l);
    c.version = ((const lk_hs_params *)ctx)->version;
    c.seq_out = opened; /* ERROR frames are read whatever their number; keep it right anyway */
    lk_chan_send_error(&c, why);
}

const lk_link_auth lk_hs_mesh_auth = {
    .connect = auth_connect,
    .retry = auth_retry,
    .open = auth_open,
    .ready = auth_ready,
    .ready_max = LK_WIRE_HDR + CHALLENGE + LK_WIRE_HDR + 1024, /* HELLO, then at most an ERROR's reason */
    .accept = auth_accept,
    .refuse = auth_refuse,
};
