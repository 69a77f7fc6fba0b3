/* Shared-memory transport for two processes on one host: one segment with
 * two single-producer/single-consumer byte rings (one per direction).
 *
 * Why this shape: a ring with monotonically increasing head/tail counters
 * needs no locks and no syscalls while both sides are awake — about 0.4 us
 * for 4 KiB here, against 4-6 us for TCP loopback. Head and tail live on
 * separate cache lines so producer and consumer do not fight over one.
 *
 * Sleeping: each side has a futex "bell" that the other side bumps after
 * any change it makes (data written, or space freed), and a "sleeping" flag
 * so the bump costs a syscall only when someone actually sleeps. Both the
 * waiter (flag store, then ring load) and the ringer (ring store, then flag
 * load) use sequentially consistent atomics, so one of them always sees the
 * other (no lost wake-up).
 *
 * Death: a peer that dies never rings. While waiting we look at the TCP
 * control link every few milliseconds; EOF or an error there means the peer
 * is gone.
 *
 * The window: besides the rings, each side owns two slots that the other
 * side reads in place, for collectives (lk_shm_win_* in transport.h). A
 * post bumps the side's counter pub[s]; the slots alternate by the post's
 * parity.
 *
 * Room: the creator reserves the whole segment in /dev/shm up front
 * (posix_fallocate), so a full or small /dev/shm (a container's 64 MiB)
 * is an error at setup, which the mesh answers with TCP, instead of a
 * SIGBUS when a page of the rings is first touched mid-run. */
#include "transport/transport.h"
#include <pthread.h>
#include <signal.h>
#include <dirent.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHM_MAGIC 0x4c4b5348u /* "LKSH" */
#define SHM_MAX_RING (64u << 20)
#define SHM_MIN_RING 4096u

typedef struct {
    _Alignas(64) _Atomic uint64_t head; /* bytes ever written (producer owns) */
    _Alignas(64) _Atomic uint64_t tail; /* bytes ever read (consumer owns) */
} ring;

typedef struct {
    uint32_t magic, ring_bytes, win_bytes;
    ring r[2];                          /* r[s]: side s -> side 1-s */
    _Alignas(64) _Atomic uint32_t bell[2];     /* side s sleeps on bell[s] */
    _Alignas(64) _Atomic uint32_t sleeping[2];
    struct { _Alignas(64) _Atomic uint64_t n; } pub[2]; /* window posts of side s, a line each */
    _Alignas(64) unsigned char data[];  /* [2][ring_bytes] rings, then [2 sides][2 parities][win_bytes] window */
} segment;

/* bytes of a segment: the rings and the window */
static size_t seg_bytes(size_t ring_bytes, size_t win_bytes) { return sizeof(segment) + 2 * ring_bytes + 4 * win_bytes; }

typedef struct {
    lk_link  base;
    segment *seg;
    size_t   map_len;
    int      side;       /* 0 creator, 1 opener */
    uint32_t cap, mask;
    uint32_t win;        /* window slot bytes */
    lk_link *ctl;        /* not owned: watched for the peer's death */
    uint64_t next_ctl_check;
    uint64_t win_seq;    /* window posts made */
} shm_link;

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Tell the other side something changed. */
static void ring_bell(shm_link *s) {
    int o = 1 - s->side;
    atomic_fetch_add(&s->seg->bell[o], 1);
    if (atomic_load(&s->seg->sleeping[o])) futex(&s->seg->bell[o], FUTEX_WAKE, 1, NULL);
}

static ssize_t shm_send_some(lk_link *l, const void *buf, size_t n, char *err, size_t errlen) {
    shm_link *s = (shm_link *)l;
    ring *r = &s->seg->r[s->side];
    unsigned char *d = s->seg->data + (size_t)s->side * s->cap;
    uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    size_t space = s->cap - (size_t)(head - tail);
    size_t k = LK_MIN(n, space);
    if (!k) return 0;
    size_t off = (size_t)(head & s->mask), first = LK_MIN(k, s->cap - off);
    memcpy(d + off, buf, first);
    memcpy(d, (const char *)buf + first, k - first);
    atomic_store_explicit(&r->head, head + k, memory_order_seq_cst);
    ring_bell(s);
    return (ssize_t)k;
}

static ssize_t shm_recv_some(lk_link *l, void *buf, size_t n, char *err, size_t errlen) {
    shm_link *s = (shm_link *)l;
    int o = 1 - s->side;
    ring *r = &s->seg->r[o];
    const unsigned char *d = s->seg->data + (size_t)o * s->cap;
    uint64_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&r->head, memory_order_acquire);
    size_t avail = (size_t)(head - tail);
    size_t k = LK_MIN(n, avail);
    if (!k) return 0;
    size_t off = (size_t)(tail & s->mask), first = LK_MIN(k, s->cap - off);
    memcpy(buf, d + off, first);
    memcpy((char *)buf + first, d, k - first);
    atomic_store_explicit(&r->tail, tail + k, memory_order_seq_cst);
    ring_bell(s);
    return (ssize_t)k;
}

static int shm_poll_fd(lk_link *l) { return -1; }

/* What a waiter waits for: room to send (for_send), bytes to receive, or
 * (post > 0) the peer's window post number `post`. */
static bool ready(shm_link *s, bool for_send, uint64_t post) {
    if (post) return atomic_load(&s->seg->pub[1 - s->side].n) >= post;
    if (for_send) {
        ring *r = &s->seg->r[s->side];
        return atomic_load(&r->head) - atomic_load(&r->tail) < s->cap;
    }
    ring *r = &s->seg->r[1 - s->side];
    return atomic_load(&r->head) != atomic_load(&r->tail);
}

/* Is the peer still there? Looks at the TCP control link without consuming. */
static bool ctl_dead(shm_link *s, char *err, size_t errlen) {
    char why[96];
    if (!lk_tcp_peer_gone(s->ctl, why, sizeof why)) return false;
    lk_fail(err, errlen, LK_ERR_NET, "%s", why);
    return true;
}

/* Sleeps on our bell until ready(for_send, post) may hold or timeout_ns
 * passed (5 ms at most), having looked at the control link first (every 5
 * ms at most): -1 with the reason in err when the peer is gone. */
static int bell_wait(shm_link *s, bool for_send, uint64_t post, uint64_t timeout_ns, char *err, size_t errlen) {
    uint64_t now = lk_time_ns();
    if (now >= s->next_ctl_check) {
        if (ctl_dead(s, err, errlen)) return -1;
        s->next_ctl_check = now + 5000000; /* every 5 ms at most */
    }
    /* Sleep at most 5 ms at a time so a dead peer is noticed promptly. */
    if (timeout_ns > 5000000) timeout_ns = 5000000;
    int me = s->side;
    atomic_store(&s->seg->sleeping[me], 1);
    uint32_t v = atomic_load(&s->seg->bell[me]);
    if (!ready(s, for_send, post)) {
        struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
        futex(&s->seg->bell[me], FUTEX_WAIT, v, &ts);
    }
    atomic_store(&s->seg->sleeping[me], 0);
    return 0;
}

static int shm_wait(lk_link *l, bool for_send, uint64_t timeout_ns, char *err, size_t errlen) {
    return bell_wait((shm_link *)l, for_send, 0, timeout_ns, err, errlen);
}

static void shm_close(lk_link *l) {
    shm_link *s = (shm_link *)l;
    if (s->seg) munmap(s->seg, s->map_len);
    free(s);
}

static const lk_link_ops shm_ops = {
    .name = "shm",
    .send_some = shm_send_some,
    .recv_some = shm_recv_some,
    .poll_fd = shm_poll_fd,
    .wait = shm_wait,
    .close = shm_close,
};

/* ---- the window ------------------------------------------------------- */

static shm_link *as_shm(const lk_link *l) { return l && l->ops == &shm_ops ? (shm_link *)l : NULL; }

static unsigned char *win_slot(shm_link *s, int side, uint64_t seq) {
    return s->seg->data + 2 * (size_t)s->cap + ((size_t)side * 2 + (size_t)(seq & 1)) * s->win;
}

size_t lk_shm_win_bytes(const lk_link *l) {
    shm_link *s = as_shm(l);
    return s ? s->win : 0;
}

void *lk_shm_win_slot(lk_link *l) {
    shm_link *s = as_shm(l);
    LK_ASSERT(s);
    return win_slot(s, s->side, s->win_seq);
}

void lk_shm_win_post(lk_link *l) {
    shm_link *s = as_shm(l);
    LK_ASSERT(s);
    atomic_store_explicit(&s->seg->pub[s->side].n, ++s->win_seq, memory_order_seq_cst);
    ring_bell(s);
}

/* Spins for the link's budget (and backs off from spinning as lk_xfer_run
 * does when it keeps not paying), then sleeps on the bell as the rings'
 * waiters do (bell_wait), looking at the control link between sleeps. */
lk_status lk_shm_win_wait(lk_link *l, const void **peer_slot, uint64_t deadline_ns, char *err, size_t errlen) {
    shm_link *s = as_shm(l);
    LK_ASSERT(s && s->win_seq > 0);
    const int o = 1 - s->side;
    _Atomic uint64_t *peer = &s->seg->pub[o].n;
    const uint64_t want = s->win_seq;
    *peer_slot = win_slot(s, o, want - 1);
    if (atomic_load_explicit(peer, memory_order_acquire) >= want) return LK_OK;
    const int64_t spin = l->spin_skip ? 0 : l->spin_ns;
    if (l->spin_skip) l->spin_skip--;
    const uint64_t t0 = lk_time_ns();
    for (uint64_t now = t0; (int64_t)(now - t0) < spin; now = lk_time_ns())
        for (int k = 0; k < 64; k++) {
            if (atomic_load_explicit(peer, memory_order_acquire) >= want) {
                l->spin_misses = 0;
                return LK_OK;
            }
            lk_cpu_relax();
        }
    if (spin && ++l->spin_misses >= 4) {
        l->spin_misses = 0;
        l->spin_skip = 256;
    }
    for (;;) {
        const uint64_t now = lk_time_ns();
        char name[128], why[LK_ERRLEN];
        if (bell_wait(s, false, want, now < deadline_ns ? deadline_ns - now : 0, why, sizeof why) < 0)
            return lk_fail(err, errlen, LK_ERR_NET, "%s: %s while waiting for its shared-memory post %llu",
                           lk_link_name(l, name, sizeof name), why, (unsigned long long)want);
        if (atomic_load_explicit(peer, memory_order_acquire) >= want) return LK_OK;
        if (lk_time_ns() >= deadline_ns)
            return lk_fail(err, errlen, LK_ERR_TIMEOUT, "%s: timeout after %.0f ms waiting for its shared-memory post %llu",
                           lk_link_name(l, name, sizeof name), (double)(lk_time_ns() - t0) / 1e6,
                           (unsigned long long)want);
    }
}

/* Segments are named /lockstep-<creator pid>-<n>-<random> and unlinked as
 * soon as both sides mapped them; a creator killed inside that window
 * leaves its segment behind. Each process sweeps such leftovers once, before
 * it first creates one: a segment of ours whose creator no longer exists
 * (kill(pid, 0) says ESRCH; a reused pid keeps it, which errs on the safe
 * side) is unlinked. Returns how many were removed. */
int lk_shm_sweep_stale(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid = 0;
        unsigned n = 0, rnd = 0;
        char tail;
        if (sscanf(e->d_name, "lockstep-%d-%u-%8x%c", &pid, &n, &rnd, &tail) != 3 || pid <= 0) continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue;
        struct stat sb;
        char path[300];
        snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
        if (stat(path, &sb) != 0 || sb.st_uid != geteuid()) continue;
        char name[300];
        snprintf(name, sizeof name, "/%s", e->d_name);
        if (shm_unlink(name) == 0) {
            lk_log(LK_LOG_INFO, "shm: removed %s, left by process %d, which is gone", name, pid);
            removed++;
        }
    }
    closedir(d);
    return removed;
}

static void sweep_once(void) { lk_shm_sweep_stale(); }

/* Control message that offers the segment: fixed size, validated. */
typedef struct {
    uint32_t magic, ring_bytes, win_bytes;
    char name[52];
} offer;

static bool pow2_in(uint32_t v, uint32_t lo, uint32_t hi) { return v >= lo && v <= hi && !(v & (v - 1)); }

lk_status lk_shm_pair(lk_link *ctl, bool creator, size_t ring_bytes, size_t win_bytes, uint64_t deadline_ns,
                      lk_link **out, char *err, size_t errlen) {
    *out = NULL;
    if (!ring_bytes) ring_bytes = 1u << 20;
    if (!win_bytes) win_bytes = 512u << 10;
    LK_ASSERT(pow2_in((uint32_t)ring_bytes, SHM_MIN_RING, SHM_MAX_RING) && ring_bytes <= SHM_MAX_RING &&
              pow2_in((uint32_t)win_bytes, SHM_MIN_RING, SHM_MAX_RING) && win_bytes <= SHM_MAX_RING);
    char name_buf[128];
    lk_link_name(ctl, name_buf, sizeof name_buf);
    offer o = {0};
    int fd = -1;
    segment *seg = NULL;
    size_t map_len = 0;
    lk_status st;
    if (creator) {
        static pthread_once_t swept = PTHREAD_ONCE_INIT;
        pthread_once(&swept, sweep_once);
        static _Atomic unsigned counter;
        uint32_t rnd = (uint32_t)lk_time_ns() ^ (uint32_t)getpid() * 2654435761u;
        o.magic = SHM_MAGIC;
        o.ring_bytes = (uint32_t)ring_bytes;
        o.win_bytes = (uint32_t)win_bytes;
        snprintf(o.name, sizeof o.name, "/lockstep-%d-%u-%08x", (int)getpid(), atomic_fetch_add(&counter, 1), rnd);
        map_len = seg_bytes(ring_bytes, win_bytes);
        fd = shm_open(o.name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
        if (fd < 0) {
            o.magic = 0; /* tell the peer we give up, then report */
            lk_link_send(ctl, &o, sizeof o, deadline_ns, NULL, 0);
            return lk_fail(err, errlen, LK_ERR_IO, "shm_open %s: %s", o.name, strerror(errno));
        }
        int fe = 0;
        if (ftruncate(fd, (off_t)map_len) != 0 || (fe = posix_fallocate(fd, 0, (off_t)map_len)) == ENOSPC ||
            (seg = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
            int e = fe == ENOSPC ? fe : errno;
            seg = NULL;
            close(fd);
            shm_unlink(o.name);
            o.magic = 0;
            lk_link_send(ctl, &o, sizeof o, deadline_ns, NULL, 0);
            if (e == ENOSPC)
                return lk_fail(err, errlen, LK_ERR_IO, "shm segment %s: /dev/shm has no room for its %zu KiB", o.name,
                               map_len >> 10);
            return lk_fail(err, errlen, LK_ERR_IO, "shm segment %s: %s", o.name, strerror(e));
        }
        /* (a filesystem without fallocate, fe EOPNOTSUPP, keeps the old way:
         * pages taken as they are first touched) */
        close(fd);
        seg->magic = SHM_MAGIC;
        seg->ring_bytes = (uint32_t)ring_bytes;
        seg->win_bytes = (uint32_t)win_bytes;
        st = lk_link_send(ctl, &o, sizeof o, deadline_ns, err, errlen);
        uint8_t ack = 0;
        if (!st) st = lk_link_recv(ctl, &ack, 1, deadline_ns, err, errlen);
        /* Both mapped (or the peer gave up): the name is no longer needed,
         * and unlinking now means a crash leaves nothing in /dev/shm. */
        shm_unlink(o.name);
        if (!st && ack != 1) st = lk_fail(err, errlen, LK_ERR_IO, "%s could not map our shm segment", name_buf);
    } else {
        st = lk_link_recv(ctl, &o, sizeof o, deadline_ns, err, errlen);
        if (st) return st;
        if (o.magic != SHM_MAGIC) return lk_fail(err, errlen, LK_ERR_IO, "%s could not create a shm segment", name_buf);
        o.name[sizeof o.name - 1] = 0;
        uint8_t ack = 0;
        if (!pow2_in(o.ring_bytes, SHM_MIN_RING, SHM_MAX_RING) || !pow2_in(o.win_bytes, SHM_MIN_RING, SHM_MAX_RING) ||
            o.name[0] != '/') {
            lk_link_send(ctl, &ack, 1, deadline_ns, NULL, 0);
            return lk_fail(err, errlen, LK_ERR_FORMAT, "%s offered a malformed shm segment", name_buf);
        }
        ring_bytes = o.ring_bytes;
        win_bytes = o.win_bytes;
        map_len = seg_bytes(ring_bytes, win_bytes);
        fd = shm_open(o.name, O_RDWR | O_CLOEXEC, 0600);
        struct stat sb;
        if (fd >= 0 && fstat(fd, &sb) == 0 && (size_t)sb.st_size == map_len)
            seg = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        int e = errno;
        if (fd >= 0) close(fd);
        if (seg == MAP_FAILED) seg = NULL;
        if (seg && (seg->magic != SHM_MAGIC || seg->ring_bytes != ring_bytes || seg->win_bytes != win_bytes)) {
            munmap(seg, map_len);
            seg = NULL;
            e = EINVAL;
        }
        ack = seg != NULL;
        st = lk_link_send(ctl, &ack, 1, deadline_ns, err, errlen);
        if (!st && !seg) st = lk_fail(err, errlen, LK_ERR_IO, "cannot map shm segment %s of %s: %s", o.name, name_buf, strerror(e));
    }
    if (st) {
        if (seg) munmap(seg, map_len);
        return st;
    }
    shm_link *s = lk_xcalloc(1, sizeof *s);
    s->base.ops = &shm_ops;
    s->base.peer_rank = ctl->peer_rank;
    s->base.spin_ns = ctl->spin_ns;
    memcpy(s->base.peer_addr, ctl->peer_addr, sizeof s->base.peer_addr);
    s->seg = seg;
    s->map_len = map_len;
    s->side = creator ? 0 : 1;
    s->cap = (uint32_t)ring_bytes;
    s->mask = (uint32_t)ring_bytes - 1;
    s->win = (uint32_t)win_bytes;
    s->ctl = ctl;
    *out = &s->base;
    return LK_OK;
}
