/* Shared by tools/bw_probe.c (the driver, architecture-neutral) and the per-architecture files
 * (tools/bw_probe_<arch>.c): the read-kernel interface and the loop template
 * every read kernel is stamped from, so that all load widths walk memory the same way.
 *
 * A read kernel reads S streams at once: stream s covers [p + s * len, p + (s + 1) * len); each
 * step reads one 64-byte line of every stream (S independent address streams for the hardware
 * prefetchers and the line-fill buffers) and, with a prefetch distance d > 0, first issues a
 * software prefetch d bytes ahead in each stream. len is a multiple of 64. It returns a fold of
 * what it read, so that no load can be left out. */
#ifndef MOEPACK_BW_PROBE_H
#define MOEPACK_BW_PROBE_H
#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*probe_read_fn)(const char *p, size_t len, int streams, size_t prefetch);

struct probe_read_kernel {
    const char *name; /* "c" (the driver's 16-byte GCC vectors), or the architecture's: "ymm", "zmm", "neon" */
    probe_read_fn fn;
};

/* The architecture file's entry points (only when the driver is built with PROBE_ARCH_READS):
 * the read kernels this CPU runs, NULL-terminated, and the architecture's name for the output. */
const struct probe_read_kernel *probe_arch_reads(void);
const char *probe_arch_name(void);

/* One kernel for S streams, prefetch on/off (PF), from:
 *   ATTR           function attributes (a target("...") for a wider ISA, or nothing)
 *   T, ZERO        the accumulator type and its zero
 *   LINE(acc, q)   acc plus the 64 bytes at q (the loads of one line)
 *   ADD(a, b)      two accumulators summed
 *   FOLD(t)        an accumulator to uint64_t
 *   PREFETCH(q)    the architecture's prefetch-for-read of address q */
#define PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, S, PF)                  \
    ATTR static uint64_t NAME##_s##S##_p##PF(const char *p, size_t len, size_t dist) {          \
        T acc[S];                                                                            \
        _Pragma("GCC unroll 8") for (int s = 0; s < S; ++s) acc[s] = ZERO;                   \
        for (size_t off = 0; off < len; off += 64) {                                         \
            _Pragma("GCC unroll 8") for (int s = 0; s < S; ++s) {                            \
                const char *q = p + (size_t)s * len + off;                                   \
                if (PF) PREFETCH(q + dist);                                                  \
                acc[s] = LINE(acc[s], q);                                                    \
            }                                                                                \
        }                                                                                    \
        T t = acc[0];                                                                        \
        _Pragma("GCC unroll 8") for (int s = 1; s < S; ++s) t = ADD(t, acc[s]);              \
        return FOLD(t);                                                                      \
    }

/* The kernel NAME(p, len, streams, prefetch) with its 8 specialisations (S in 1, 2, 4, 8). */
#define PROBE_READ_KERNEL(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH)                          \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 1, 0)                         \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 1, 1)                         \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 2, 0)                         \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 2, 1)                         \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 4, 0)                         \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 4, 1)                         \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 8, 0)                         \
    PROBE_STREAMS_FN(NAME, ATTR, T, ZERO, LINE, ADD, FOLD, PREFETCH, 8, 1)                         \
    ATTR static uint64_t NAME(const char *p, size_t len, int streams, size_t dist) {              \
        switch (streams * 2 + (dist > 0)) {                                                       \
        case 2: return NAME##_s1_p0(p, len, dist);                                                \
        case 3: return NAME##_s1_p1(p, len, dist);                                                \
        case 4: return NAME##_s2_p0(p, len, dist);                                                \
        case 5: return NAME##_s2_p1(p, len, dist);                                                \
        case 8: return NAME##_s4_p0(p, len, dist);                                                \
        case 9: return NAME##_s4_p1(p, len, dist);                                                \
        case 16: return NAME##_s8_p0(p, len, dist);                                               \
        default: return NAME##_s8_p1(p, len, dist);                                               \
        }                                                                                         \
    }

#endif
