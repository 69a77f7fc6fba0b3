/* Shared-memory segments left behind by a lockstep process killed while its
 * peer was mapping them are removed by the next process that sets up a
 * segment (lk_shm_sweep_stale, run once by lk_shm_pair); a live process's
 * segment and names that are not ours are kept. */
#include "lk_test.h"
#include "transport/transport.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/socket.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static bool make_seg(const char *name) {
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return false;
    bool ok = ftruncate(fd, 4096) == 0;
    close(fd);
    return ok;
}

static bool exists(const char *name) {
    char p[300];
    snprintf(p, sizeof p, "/dev/shm%s", name);
    return access(p, F_OK) == 0;
}

TEST(stale_segments_removed) {
    /* a pid that is surely gone: a child that exited and was reaped */
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    char stale[96], live[96], other[96];
    snprintf(stale, sizeof stale, "/lockstep-%d-0-deadbeef", (int)dead);
    snprintf(live, sizeof live, "/lockstep-%d-77-cafef00d", (int)getpid());
    snprintf(other, sizeof other, "/lockstep-notours-%d", (int)dead);
    CHECK(make_seg(stale) && make_seg(live) && make_seg(other));
    int n = lk_shm_sweep_stale();
    CHECKF(n >= 1, "removed %d", n);
    CHECK(!exists(stale));
    CHECK(exists(live));   /* its creator (we) still runs */
    CHECK(exists(other));  /* not a name lockstep makes */
    shm_unlink(live);
    shm_unlink(other);
}

/* lk_shm_pair sweeps by itself before it creates its first segment. */
typedef struct { lk_link *l; lk_link *out; lk_status st; } side;
static void *joiner(void *p) {
    side *s = p;
    char err[LK_ERRLEN];
    s->st = lk_shm_pair(s->l, false, 0, 0, lk_deadline_ms(5000), &s->out, err, sizeof err);
    return NULL;
}

TEST(pairing_sweeps) {
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    char stale[96];
    snprintf(stale, sizeof stale, "/lockstep-%d-3-0badf00d", (int)dead);
    CHECK(make_seg(stale));
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    lk_link *a = lk_tcp_wrap(sv[0], "a"), *b = lk_tcp_wrap(sv[1], "b");
    side j = {.l = b};
    pthread_t th;
    pthread_create(&th, NULL, joiner, &j);
    char err[LK_ERRLEN];
    lk_link *mine = NULL;
    lk_status st = lk_shm_pair(a, true, 0, 0, lk_deadline_ms(5000), &mine, err, sizeof err);
    pthread_join(th, NULL);
    CHECKF(st == LK_OK && j.st == LK_OK, "%s", err);
    CHECK(!exists(stale));
    lk_link_close(mine);
    lk_link_close(j.out);
    lk_link_close(a);
    lk_link_close(b);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    RUN(pairing_sweeps);        /* first: the pair's one sweep must find it */
    RUN(stale_segments_removed);
    return lk_test_end();
}
