/* fuzz_link — an in-memory lk_link for the wire and handshake harnesses.
 *
 * What the code under test receives comes from a byte source the harness
 * fills (the fuzzer's input, or frames it builds on demand through the
 * `more` callback, called when the buffered bytes run out); what it sends is
 * kept, so a harness can answer it (the handshake's scripted peer reads the
 * challenge and INFO frame sent to it). The link never blocks: with nothing
 * left to give, recv fails at once as a peer that closed would, so a
 * handshake waiting for more ends immediately instead of at its deadline. */
#ifndef LK_FUZZ_LINK_H
#define LK_FUZZ_LINK_H

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/lk_common.h"
#include "transport/transport.h"

typedef struct fuzz_link fuzz_link;
struct fuzz_link {
    lk_link base;                 /* first: the code under test sees an lk_link */
    uint8_t *in;                  /* bytes still to be received (in[in_pos, in_len)) */
    size_t in_len, in_pos, in_cap;
    uint8_t *out;                 /* everything sent so far */
    size_t out_len, out_cap;
    bool (*more)(fuzz_link *f);   /* appends the next bytes to in; false: none left */
    void *ctx;
};

static inline void fuzz_link_feed(fuzz_link *f, const void *p, size_t n) {
    if (f->in_len + n > f->in_cap) {
        f->in_cap = (f->in_len + n) * 2 + 64;
        f->in = realloc(f->in, f->in_cap);
        if (!f->in) abort();
    }
    if (n) memcpy(f->in + f->in_len, p, n);
    f->in_len += n;
}

static ssize_t fuzz_link_send(lk_link *l, const void *buf, size_t n, char *err, size_t errlen) {
    fuzz_link *f = (fuzz_link *)l;
    if (f->out_len + n > f->out_cap) {
        f->out_cap = (f->out_len + n) * 2 + 64;
        f->out = realloc(f->out, f->out_cap);
        if (!f->out) abort();
    }
    memcpy(f->out + f->out_len, buf, n);
    f->out_len += n;
    return (ssize_t)n;
}

static ssize_t fuzz_link_recv(lk_link *l, void *buf, size_t n, char *err, size_t errlen) {
    fuzz_link *f = (fuzz_link *)l;
    while (f->in_pos == f->in_len)
        if (!f->more || !f->more(f)) {
            lk_fail(err, errlen, LK_ERR_NET, "peer closed (end of fuzz input)");
            return -1;
        }
    size_t k = LK_MIN(n, f->in_len - f->in_pos);
    memcpy(buf, f->in + f->in_pos, k);
    f->in_pos += k;
    return (ssize_t)k;
}

/* A sealed link (lk_seal_wrap) needs an fd to poll while a record is only
 * partly in: /dev/null is always ready, so such a poll never blocks. */
static int fuzz_link_poll_fd(lk_link *l) {
    static int fd = -1;
    if (fd < 0) fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return fd;
}
static int fuzz_link_wait(lk_link *l, bool for_send, uint64_t timeout_ns, char *err, size_t errlen) {
    lk_fail(err, errlen, LK_ERR_NET, "fuzz link never waits");
    return -1;
}
static void fuzz_link_close(lk_link *l) {}

static const lk_link_ops fuzz_link_ops = {
    .name = "fuzz", .send_some = fuzz_link_send, .recv_some = fuzz_link_recv,
    .poll_fd = fuzz_link_poll_fd, .wait = fuzz_link_wait, .close = fuzz_link_close,
};

static inline void fuzz_link_init(fuzz_link *f) {
    memset(f, 0, sizeof *f);
    f->base.ops = &fuzz_link_ops;
    f->base.peer_rank = -1;
    snprintf(f->base.peer_addr, sizeof f->base.peer_addr, "fuzz");
}
static inline void fuzz_link_reset(fuzz_link *f) {
    f->in_len = f->in_pos = f->out_len = 0;
    f->more = NULL;
    f->ctx = NULL;
}

#endif
