/* lk_test — the tiny test harness every tests/test_*.c includes once.
 *
 *   TEST(name) { CHECK(x == 1); CHECKF(a < b, "a=%d", a); }
 *   int main(void) { RUN(name); return lk_test_end(); }
 *
 * Each test prints "PASS name" or "FAIL name" (with the first failed checks);
 * tests/run.sh counts these lines across all test programs and prints the
 * final "N passed, N failed". Tests run from the repository root; reference
 * data is under LK_TESTDATA (default ../shared/testdata).
 *
 * Allocation guard: test programs are linked with -Wl,--wrap=malloc,calloc,
 * realloc, so lk_test_allocs() counts every allocation made by lockstep code. */
#ifndef LK_TEST_H
#define LK_TEST_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int lk_t_failed_checks, lk_t_pass, lk_t_fail;

#define CHECK(c) CHECKF(c, "%s", "")
#define CHECKF(c, ...)                                                        \
    do {                                                                      \
        if (!(c)) {                                                           \
            if (lk_t_failed_checks++ < 8) {                                   \
                fprintf(stdout, "  %s:%d: CHECK(%s) failed: ", __FILE__,      \
                        __LINE__, #c);                                        \
                fprintf(stdout, __VA_ARGS__);                                 \
                fputc('\n', stdout);                                          \
            }                                                                 \
        }                                                                     \
    } while (0)

#define TEST(name) static void name(void)
#define RUN(name)                                                             \
    do {                                                                      \
        lk_t_failed_checks = 0;                                               \
        fflush(stdout);                                                       \
        name();                                                               \
        if (lk_t_failed_checks) { lk_t_fail++; printf("FAIL %s\n", #name); } \
        else { lk_t_pass++; printf("PASS %s\n", #name); }                     \
        fflush(stdout);                                                       \
    } while (0)

static inline int lk_test_end(void) {
    printf("# %d passed, %d failed\n", lk_t_pass, lk_t_fail);
    return lk_t_fail ? 1 : 0;
}

static inline const char *lk_testdata(void) {
    const char *d = getenv("LK_TESTDATA");
    return d && *d ? d : "../shared/testdata";
}
/* Path under the test data folder, in a static rotating buffer. */
static inline const char *lk_td(const char *rel) {
    static char bufs[8][1024];
    static int k;
    char *b = bufs[k++ & 7];
    snprintf(b, 1024, "%s/%s", lk_testdata(), rel);
    return b;
}

/* ---- allocation counting via the linker's --wrap ---- */
void *__real_malloc(size_t);
void *__real_calloc(size_t, size_t);
void *__real_realloc(void *, size_t);
static atomic_long lk_t_allocs;
void *__wrap_malloc(size_t n) { atomic_fetch_add(&lk_t_allocs, 1); return __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t s) { atomic_fetch_add(&lk_t_allocs, 1); return __real_calloc(n, s); }
void *__wrap_realloc(void *p, size_t n) { atomic_fetch_add(&lk_t_allocs, 1); return __real_realloc(p, n); }
static inline long lk_test_allocs(void) { return atomic_load(&lk_t_allocs); }

#endif
