/* cpu.c — the program's one CPU-feature probe and SIMD level (see
 * lk_common.h, "CPU features").
 *
 * Every SIMD dispatcher (quant, kernels/vec.c, kernels/membw.c, the wire
 * codecs of parallel/comm.c) and the handshake's feature string read this
 * instead of probing on their own, so LK_SIMD reaches every kernel and one
 * warning explains a refused LK_SIMD once.
 *
 * The probe is CPUID plus XGETBV: a CPU may have AVX or AVX-512 units that
 * the OS does not save on a context switch (XCR0), and then it must not use
 * them, which is what libgcc's __builtin_cpu_supports checks too. */
#include "common/lk_common.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* What each whole level needs: the target attributes of its kernels
 * (quant_avx2.c: avx2,fma,f16c,bmi,bmi2; quant_avx512.c adds avx512f/bw/vl/
 * dq/vnni/vbmi and gfni). AVX-512 BF16 is optional within avx512: the BF16
 * matrix kernel checks it on its own. */
static const uint32_t k_level_need[LK_SIMD_LEVELS] = {
    [LK_SIMD_SCALAR] = 0,
    [LK_SIMD_AVX2] = LK_CPU_AVX | LK_CPU_AVX2 | LK_CPU_FMA | LK_CPU_F16C | LK_CPU_BMI1 | LK_CPU_BMI2,
    [LK_SIMD_AVX512] = LK_CPU_AVX | LK_CPU_AVX2 | LK_CPU_FMA | LK_CPU_F16C | LK_CPU_BMI1 | LK_CPU_BMI2 |
                       LK_CPU_AVX512F | LK_CPU_AVX512BW | LK_CPU_AVX512VL | LK_CPU_AVX512DQ |
                       LK_CPU_AVX512VNNI | LK_CPU_AVX512VBMI | LK_CPU_GFNI,
};

static const char *const k_level_names[LK_SIMD_LEVELS] = {"scalar", "avx2", "avx512"};

/* Bit order of the handshake's feature string and of warnings. */
static const struct { uint32_t bit; const char *name; } k_feat_names[] = {
    {LK_CPU_AVX, "avx"},           {LK_CPU_AVX2, "avx2"},           {LK_CPU_FMA, "fma"},
    {LK_CPU_F16C, "f16c"},         {LK_CPU_BMI1, "bmi"},            {LK_CPU_BMI2, "bmi2"},
    {LK_CPU_AVX512F, "avx512f"},   {LK_CPU_AVX512BW, "avx512bw"},   {LK_CPU_AVX512VL, "avx512vl"},
    {LK_CPU_AVX512DQ, "avx512dq"}, {LK_CPU_AVX512VNNI, "avx512vnni"}, {LK_CPU_AVX512VBMI, "avx512vbmi"},
    {LK_CPU_GFNI, "gfni"},         {LK_CPU_AVX512BF16, "avx512bf16"}, {LK_CPU_AMX, "amx"},
    {LK_CPU_AMXBF16, "amxbf16"},
};

static uint32_t probe_features(void) {
    uint32_t f = 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d, max = __get_cpuid_max(0, NULL);
    if (max < 1) return 0;
    __cpuid(1, a, b, c, d);
    /* OSXSAVE: XGETBV exists; XCR0 bits 1-2 = SSE and AVX state saved by
     * the OS, 5-7 = the AVX-512 opmask and upper ZMM state */
    uint64_t xcr0 = 0;
    if (c & bit_OSXSAVE) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = (uint64_t)hi << 32 | lo;
    }
    const bool os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;
    if (!os_avx) return 0;
    if (c & bit_AVX) f |= LK_CPU_AVX;
    if (c & bit_FMA) f |= LK_CPU_FMA;
    if (c & bit_F16C) f |= LK_CPU_F16C;
    if (max < 7) return f;
    unsigned eax7;
    __cpuid_count(7, 0, eax7, b, c, d);
    if (b & bit_BMI) f |= LK_CPU_BMI1;
    if (b & bit_BMI2) f |= LK_CPU_BMI2;
    if (b & bit_AVX2) f |= LK_CPU_AVX2;
    if (!os_avx512) return f;
    if (b & bit_AVX512F) f |= LK_CPU_AVX512F;
    if (b & bit_AVX512BW) f |= LK_CPU_AVX512BW;
    if (b & bit_AVX512VL) f |= LK_CPU_AVX512VL;
    if (b & bit_AVX512DQ) f |= LK_CPU_AVX512DQ;
    if (c & (1u << 1)) f |= LK_CPU_AVX512VBMI;
    if (c & (1u << 11)) f |= LK_CPU_AVX512VNNI;
    /* GFNI counts only with AVX-512: the kernels use its EVEX (zmm) form */
    if (c & (1u << 8)) f |= LK_CPU_GFNI;
    /* AMX: CPUID.7.0 EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), and XCR0
     * bits 17-18 (the tile configuration and data saved by the OS). Linux
     * then also wants each process to ask for the tile data's room in its
     * signal frames (arch_prctl ARCH_REQ_XCOMP_PERM, feature 18) before its
     * first tile instruction, which otherwise dies of SIGILL. */
    const bool amx_cpu = (d & (1u << 24)) && (d & (1u << 25)) && (xcr0 & (3u << 17)) == (3u << 17);
    const bool amx_bf16 = d & (1u << 22); /* AMX-BF16 */
    if (eax7 >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        if (a & (1u << 5)) f |= LK_CPU_AVX512BF16;
    }
#if defined(__x86_64__) && defined(__linux__)
    if (amx_cpu && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0) {
        f |= LK_CPU_AMX;
        if (amx_bf16) f |= LK_CPU_AMXBF16;
    }
#else
    (void)amx_cpu, (void)amx_bf16;
#endif
#endif
    return f;
}

static lk_cpu_info g_cpu;
static pthread_once_t g_cpu_once = PTHREAD_ONCE_INIT;

static bool runs(uint32_t feat, lk_simd_level l) { return (feat & k_level_need[l]) == k_level_need[l]; }

/* "avx512vnni avx512vbmi gfni": the features of level l that feat lacks */
static void missing(uint32_t feat, lk_simd_level l, char *buf, size_t len) {
    buf[0] = 0;
    for (size_t i = 0; i < sizeof k_feat_names / sizeof k_feat_names[0]; i++)
        if ((k_level_need[l] & k_feat_names[i].bit) && !(feat & k_feat_names[i].bit)) {
            size_t o = strlen(buf);
            snprintf(buf + o, len - o, "%s%s", o ? " " : "", k_feat_names[i].name);
        }
}

/* LK_CPU_OFF="avx512bf16,gfni": features the process acts as if the CPU
 * lacked (comma- or space-separated k_feat_names), so the code paths of
 * another CPU can be run and tested here; unknown names are warned of. */
static uint32_t features_off(const char *env) {
    uint32_t off = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", env);
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        size_t i = 0, n = sizeof k_feat_names / sizeof k_feat_names[0];
        while (i < n && strcmp(tok, k_feat_names[i].name)) i++;
        if (i < n) off |= k_feat_names[i].bit;
        else lk_log(LK_LOG_WARN, "LK_CPU_OFF: unknown feature '%s' (one of avx avx2 fma f16c bmi bmi2 avx512f avx512bw "
                                 "avx512vl avx512dq avx512vnni avx512vbmi gfni avx512bf16 amx amxbf16); ignored", tok);
    }
    return off;
}

static void cpu_init(void) {
    lk_cpu_info c = {.feat = probe_features()};
    const char *off = getenv("LK_CPU_OFF");
    if (off && *off) c.feat &= ~features_off(off);
    if (!(c.feat & LK_CPU_AMX)) c.feat &= ~LK_CPU_AMXBF16; /* no tiles, none of their kinds */
    c.best = runs(c.feat, LK_SIMD_AVX512) ? LK_SIMD_AVX512 : runs(c.feat, LK_SIMD_AVX2) ? LK_SIMD_AVX2 : LK_SIMD_SCALAR;
    c.level = c.best;
    c.cap = LK_SIMD_AVX512;
    const char *env = getenv("LK_SIMD");
    if (env && *env) {
        lk_simd_level want;
        if (!lk_simd_level_parse(env, &want)) {
            lk_log(LK_LOG_WARN, "LK_SIMD=%s: unknown level (scalar|avx2|avx512); using %s", env,
                   k_level_names[c.best]);
        } else if (!runs(c.feat, want)) {
            char miss[160];
            missing(c.feat, want, miss, sizeof miss);
            lk_log(LK_LOG_WARN, "LK_SIMD=%s: this CPU lacks it (no %s); using %s", env, miss,
                   k_level_names[c.best]);
        } else {
            c.level = want;
        }
        /* whatever was asked, no kernel goes above the level the message
         * names: LK_SIMD=avx2 on an AVX-512 CPU keeps vec.c's AVX-512 code
         * out too */
        c.cap = c.level;
    }
    g_cpu = c;
}

const lk_cpu_info *lk_cpu(void) {
    pthread_once(&g_cpu_once, cpu_init);
    return &g_cpu;
}

bool lk_cpu_can(lk_simd_level l, uint32_t need) {
    const lk_cpu_info *c = lk_cpu();
    return l <= c->cap && (c->feat & need) == need;
}

bool lk_cpu_runs_level(lk_simd_level l) {
    return l >= LK_SIMD_SCALAR && l < LK_SIMD_LEVELS && runs(lk_cpu()->feat, l);
}

const char *lk_simd_level_name(lk_simd_level l) {
    return l >= LK_SIMD_SCALAR && l < LK_SIMD_LEVELS ? k_level_names[l] : "?";
}

bool lk_simd_level_parse(const char *s, lk_simd_level *out) {
    for (int l = 0; s && l < LK_SIMD_LEVELS; l++)
        if (!strcmp(s, k_level_names[l])) { *out = (lk_simd_level)l; return true; }
    return false;
}

const char *lk_cpu_feature_name(uint32_t bit) {
    for (size_t i = 0; i < sizeof k_feat_names / sizeof k_feat_names[0]; i++)
        if (k_feat_names[i].bit == bit) return k_feat_names[i].name;
    return "?";
}
