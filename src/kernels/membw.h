/* membw — how fast this machine streams memory into one or more cores.
 *
 * Decode on a CPU is bounded by memory bandwidth (BENCHMARKS.md states every
 * figure against it): `lockstep bench` divides the weight bytes a token reads by this
 * figure to print the fraction of the bound a kernel reaches.
 *
 * The probe reads (never writes) a buffer with the widest SIMD loads the CPU
 * has, split into contiguous chunks over n_threads pthreads, and reports the
 * median over several passes. `bytes` should be well above the last-level
 * cache (several times it) to measure DRAM rather than cache; it allocates and
 * frees the buffer itself. Not for the per-token path. Thread-safe. */
#ifndef LK_MEMBW_H
#define LK_MEMBW_H

#include <stddef.h>

/* GB/s (1e9 bytes per second) of a streaming read of `bytes` by n_threads
 * threads (>= 1), median of `passes` passes (0: a default of 7). Returns a
 * negative value if the buffer or threads cannot be had. */
double lk_membw_read_gbs(int n_threads, size_t bytes, int passes);

/* GB/s of one streaming read of the caller's `bytes` at p (64-byte
 * aligned) by the calling thread, with the probe's read loop: so a
 * benchmark can time the probe over the very bytes its kernel reads,
 * pass for pass with it (bench_quant BENCH_PAIRED). Reads the whole
 * 256-byte steps of it; -1 if there is none or p is not 64-byte
 * aligned. */
double lk_membw_read_once(const void *p, size_t bytes);

/* Size of the last-level cache in bytes as the OS reports it (sysfs), or 0 if
 * unknown: callers size the probe at a multiple of it. */
size_t lk_membw_llc_bytes(void);
/* The SIMD level of the probe's read loop ("scalar", "avx2", "avx512"). */
const char *lk_membw_simd_name(void);

#endif
