/* The aarch64 half of moepack's machine-limit probe (the driver is tools/bw_probe.c; the shared
 * read-kernel template is tools/bw_probe.h):
 *
 *   cc -O2 -DPROBE_ARCH_READS -c bw_probe_arm.c
 *
 * The read kernel "neon": four 16-byte Advanced SIMD loads (vld1q_u64) per 64-byte line, and
 * __builtin_prefetch (prfm pldl1keep) for the software prefetch. Advanced SIMD is part of the
 * AArch64 baseline, so no flag and no run-time check are needed. No dot-product peaks yet: the
 * ARM instructions' table belongs with the ARM kernels (moepack/bench/probe.py says so per
 * instruction). */
#include <arm_neon.h>
#include <stdint.h>

#include "bw_probe.h"

#ifdef PROBE_ARCH_READS
#define NEON_PREFETCH(q) __builtin_prefetch((const void *)(q), 0, 3)
#define NEON_LINE(acc, q)                                                                                 \
    vaddq_u64(acc, vaddq_u64(vaddq_u64(vld1q_u64((const uint64_t *)(q)), vld1q_u64((const uint64_t *)((q) + 16))), \
                             vaddq_u64(vld1q_u64((const uint64_t *)((q) + 32)), vld1q_u64((const uint64_t *)((q) + 48)))))
#define NEON_FOLD(t) (vgetq_lane_u64(t, 0) + vgetq_lane_u64(t, 1))
PROBE_READ_KERNEL(read_neon, , uint64x2_t, vdupq_n_u64(0), NEON_LINE, vaddq_u64, NEON_FOLD, NEON_PREFETCH)

const struct probe_read_kernel *probe_arch_reads(void) {
    static const struct probe_read_kernel list[] = {{"neon", read_neon}, {NULL, NULL}};
    return list;
}

const char *probe_arch_name(void) { return "aarch64"; }
#endif
