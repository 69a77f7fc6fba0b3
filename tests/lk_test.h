/* lk_test — the tiny test harness every tests/test_*.c includes once.
 *
 *   TEST(name) { CHECK(x == 1); CHECKF(a < b, "a=%d", a); }
 *   int main(void) { RUN(name); return lk_test_end(); }
 *
 * Each test prints "PASS name" or "FAIL name" (with the first failed checks),
 * or "SKIP name: reason" when it needed test data that is not there;
 * tests/run.sh counts these lines across all test programs and prints the
 * final "N passed, N failed, N skipped". Tests run from the repository root.
 *
 * Test data: lk_td("models/stories260K.gguf") is the repository's own copy
 * (testdata/, the small essential set: every test that uses only it always
 * runs); any other file is looked up in the shared set under LK_TESTDATA
 * (default ../shared/testdata). A test that asked lk_td for a file found in
 * neither place is reported as SKIP naming the file, whatever its checks
 * said (they ran without their data); where the shared set is present
 * nothing is skipped. A test that would crash without its file checks
 * lk_td_have(rel) first and returns.
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
#include <sys/stat.h>

static int lk_t_failed_checks, lk_t_pass, lk_t_fail, lk_t_skip;
static char lk_t_missing[512]; /* the first test data file this test lacked */

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
        lk_t_missing[0] = 0;                                                  \
        fflush(stdout);                                                       \
        name();                                                               \
        if (lk_t_missing[0]) {                                                \
            lk_t_skip++;                                                      \
            printf("SKIP %s: needs %s/%s (not found; set LK_TESTDATA)\n",     \
                   #name, lk_testdata(), lk_t_missing);                       \
        } else if (lk_t_failed_checks) { lk_t_fail++; printf("FAIL %s\n", #name); } \
        else { lk_t_pass++; printf("PASS %s\n", #name); }                     \
        fflush(stdout);                                                       \
    } while (0)

static inline int lk_test_end(void) {
    printf("# %d passed, %d failed, %d skipped\n", lk_t_pass, lk_t_fail, lk_t_skip);
    return lk_t_fail ? 1 : 0;
}

/* The shared test data folder. */
static inline const char *lk_testdata(void) {
    const char *d = getenv("LK_TESTDATA");
    return d && *d ? d : "../shared/testdata";
}
static inline int lk_t_exists(const char *p) { struct stat sb; return stat(p, &sb) == 0; }
/* Path of a test data file (or folder), in a static rotating buffer: the
 * repository's testdata/REL when it exists, else LK_TESTDATA/REL, noted as
 * missing (the running test then reports SKIP) when that does not exist. */
static inline const char *lk_td(const char *rel) {
    static char bufs[8][1024];
    static int k;
    char *b = bufs[k++ & 7];
    snprintf(b, 1024, "testdata/%s", rel);
    if (lk_t_exists(b)) return b;
    snprintf(b, 1024, "%s/%s", lk_testdata(), rel);
    if (!lk_t_exists(b) && !lk_t_missing[0]) {
        size_t n = strlen(rel) < sizeof lk_t_missing ? strlen(rel) : sizeof lk_t_missing - 1;
        memcpy(lk_t_missing, rel, n);
        lk_t_missing[n] = 0;
    }
    return b;
}
/* Whether a test data file is there (if not, the running test reports SKIP). */
static inline int lk_td_have(const char *rel) { return lk_t_exists(lk_td(rel)); }

/* The program under test: $LOCKSTEP, else build/lockstep. */
static inline const char *lk_test_bin(void) {
    const char *b = getenv("LOCKSTEP");
    return b && *b ? b : "build/lockstep";
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
