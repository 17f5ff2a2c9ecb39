/* Machine-limit probe for moepack's benchmark: read bandwidth and dot-product peaks.
 *
 * Not part of the extension. moepack/bench/probe.py compiles it on the fly when a C compiler is
 * there and caches the binary (by hash of source, flags, compiler and the parts built). One
 * source, several objects, like the extension's one-file-per-ISA rule:
 *
 *   cc -O2 -fopenmp -c bw_probe.c -DPROBE_KERNELS='X(fma_ymm)X(vdpbf16ps)...'   main + bandwidth
 *   cc -O2 -mavx2 -mfma -c bw_probe.c -DPROBE_PART_fma_ymm                       one per instruction
 *   ...                                                                          (its own -m flags)
 *   cc -fopenmp main.o fma_ymm.o ... -o bw_probe
 *
 * probe.py builds a part only when the CPU has the instruction (/proc/cpuinfo flags) and the
 * compiler accepts its flags, and lists the parts it built in PROBE_KERNELS. The main object is
 * compiled without ISA flags, so the binary starts on any CPU of the architecture.
 *
 *     bw_probe THREADS BYTES PASSES PEAK_SECONDS PREFETCH_BYTES [KERNEL ...]
 *
 * prints one JSON line:
 *
 *     {"probe": 2, "threads": 2, "bytes": ..., "prefetch_bytes": 1024,
 *      "read": [{"threads": 1, "streams": 1, "prefetch": 0, "gbs": ..., "passes": [...]}, ...],
 *      "peaks": [{"name": "fma_zmm", "threads": 2, "instr_per_s": ..., "passes": [...]}, ...],
 *      "errors": {"tdpbf16ps": "..."}}
 *
 * read: each pattern is the best of PASSES reads of the whole BYTES buffer (written first by the
 * threads that read it, with non-zero data: untouched or all-zero pages can come from the shared
 * zero page, which measures the cache). Thread t reads its own contiguous slice; a pattern with
 * S streams splits the slice into S regions and reads one 64-byte line of each region per step
 * (S independent address streams for the hardware prefetchers and the line-fill buffers), with
 * prefetch: also a prefetcht0 PREFETCH_BYTES ahead in each stream. Patterns: S in {1, 2, 4, 8},
 * prefetch off/on, at 1 thread and at THREADS threads. S=1 without prefetch is the plain read.
 * Loads are 16-byte vectors (GCC vector extensions, baseline ISA): a read bound by memory, not by
 * the core, at any rate a core can take from DRAM.
 *
 * peaks: for each KERNEL, probe_peak_<KERNEL>(iters) runs iters iterations of independent
 * accumulator chains on each thread and returns the instructions it executed (or -1 with a
 * reason); iters is calibrated on one thread so that a pass takes about PEAK_SECONDS / 4, then the
 * best of 3 passes on all threads is kept (so one kernel takes about PEAK_SECONDS). Operations per instruction are not counted here: probe.py's table has them.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* one instruction part: long long probe_peak_<name>(long iters) -------------------------------- */

#if defined(PROBE_PART_fma_ymm) || defined(PROBE_PART_fma_zmm) || defined(PROBE_PART_vdpbf16ps) || \
    defined(PROBE_PART_vpdpbusd_zmm) || defined(PROBE_PART_vpdpbusd_ymm) ||                     \
    defined(PROBE_PART_vpmaddubsw_ymm) || defined(PROBE_PART_vpmaddubsw_zmm) ||                 \
    defined(PROBE_PART_tdpbf16ps) || defined(PROBE_PART_tdpbssd)
#include <immintrin.h>
#define PROBE_A_PART 1
static volatile float probe_sink_f;
static volatile int probe_sink_i;
#define R6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define R12(X) R8(X) X(8) X(9) X(10) X(11)
#define R16(X) R12(X) X(12) X(13) X(14) X(15)
#endif

#ifdef PROBE_PART_fma_ymm /* -mavx2 -mfma: 12 chains (2 FMA ports x 4-5 cycles, 16 ymm registers) */
long long probe_peak_fma_ymm(long iters) {
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
#define D(i) __m256 c##i = _mm256_set1_ps(1.0f + 0.01f * (i));
#define S(i) c##i = _mm256_fmadd_ps(c##i, a, b);
#define A(i) s = _mm256_add_ps(s, c##i);
    R12(D)
    for (long n = 0; n < iters; ++n) { R12(S) }
    __m256 s = _mm256_setzero_ps();
    R12(A)
    probe_sink_f = _mm256_cvtss_f32(s);
#undef D
#undef S
#undef A
    return iters * 12;
}
#endif

#ifdef PROBE_PART_fma_zmm /* -mavx512f: 16 chains (32 zmm registers) */
long long probe_peak_fma_zmm(long iters) {
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
#define D(i) __m512 c##i = _mm512_set1_ps(1.0f + 0.01f * (i));
#define S(i) c##i = _mm512_fmadd_ps(c##i, a, b);
#define A(i) s = _mm512_add_ps(s, c##i);
    R16(D)
    for (long n = 0; n < iters; ++n) { R16(S) }
    __m512 s = _mm512_setzero_ps();
    R16(A)
    probe_sink_f = _mm512_reduce_add_ps(s);
#undef D
#undef S
#undef A
    return iters * 16;
}
#endif

#ifdef PROBE_PART_vdpbf16ps /* -mavx512f -mavx512bf16: 16 chains of vdpbf16ps zmm */
long long probe_peak_vdpbf16ps(long iters) {
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00); /* 1, 2^-7 */
#define D(i) __m512 c##i = _mm512_set1_ps((float)(i));
#define S(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
#define A(i) s = _mm512_add_ps(s, c##i);
    R16(D)
    for (long n = 0; n < iters; ++n) { R16(S) }
    __m512 s = _mm512_setzero_ps();
    R16(A)
    probe_sink_f = _mm512_reduce_add_ps(s);
#undef D
#undef S
#undef A
    return iters * 16;
}
#endif

#ifdef PROBE_PART_vpdpbusd_zmm /* -mavx512f -mavx512vnni: 16 chains of vpdpbusd zmm */
long long probe_peak_vpdpbusd_zmm(long iters) {
    const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
#define D(i) __m512i c##i = _mm512_set1_epi32(i);
#define S(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
#define A(i) s = _mm512_add_epi32(s, c##i);
    R16(D)
    for (long n = 0; n < iters; ++n) { R16(S) }
    __m512i s = _mm512_setzero_si512();
    R16(A)
    probe_sink_i = _mm512_reduce_add_epi32(s);
#undef D
#undef S
#undef A
    return iters * 16;
}
#endif

#ifdef PROBE_PART_vpdpbusd_ymm /* -mavx2 -mavxvnni: the VEX ({vex}) vpdpbusd on ymm, 12 chains */
long long probe_peak_vpdpbusd_ymm(long iters) {
    const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(2);
#define D(i) __m256i c##i = _mm256_set1_epi32(i);
#define S(i) c##i = _mm256_dpbusd_avx_epi32(c##i, a, b);
#define A(i) s = _mm256_add_epi32(s, c##i);
    R12(D)
    for (long n = 0; n < iters; ++n) { R12(S) }
    __m256i s = _mm256_setzero_si256();
    R12(A)
    probe_sink_i = _mm256_extract_epi32(s, 0);
#undef D
#undef S
#undef A
    return iters * 12;
}
#endif

/* The AVX2 / AVX-512 BW int8 dot product: vpmaddubsw (u8 x s8, adjacent pairs summed to s16),
 * vpmaddwd by ones (-> s32), vpaddd into the accumulator. One "instruction" counted here is that
 * sequence, per chain. As in the kernels, one u8 operand (the activations) meets a different s8
 * vector (the weights: here a small array, from L1) in each chain; the empty asm makes the u8
 * operand look new to the compiler every iteration, so the products are not hoisted out of the
 * loop as invariants. */
#ifdef PROBE_PART_vpmaddubsw_ymm /* -mavx2: 6 chains (6 accumulators + 6 products + 2 operands: 16 ymm) */
static __m256i probe_w_ymm[6];
long long probe_peak_vpmaddubsw_ymm(long iters) {
    __m256i a = _mm256_set1_epi8(1);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 6; ++i) probe_w_ymm[i] = _mm256_set1_epi8((char)(i + 1));
#define D(i) __m256i c##i = _mm256_set1_epi32(i);
#define S(i) c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_maddubs_epi16(a, probe_w_ymm[i]), ones));
#define A(i) s = _mm256_add_epi32(s, c##i);
    R6(D)
    for (long n = 0; n < iters; ++n) {
        __asm__ volatile("" : "+x"(a));
        R6(S)
    }
    __m256i s = _mm256_setzero_si256();
    R6(A)
    probe_sink_i = _mm256_extract_epi32(s, 0);
#undef D
#undef S
#undef A
    return iters * 6;
}
#endif

#ifdef PROBE_PART_vpmaddubsw_zmm /* -mavx512f -mavx512bw: 12 chains */
static __m512i probe_w_zmm[12];
long long probe_peak_vpmaddubsw_zmm(long iters) {
    __m512i a = _mm512_set1_epi8(1);
    const __m512i ones = _mm512_set1_epi16(1);
    for (int i = 0; i < 12; ++i) probe_w_zmm[i] = _mm512_set1_epi8((char)(i + 1));
#define D(i) __m512i c##i = _mm512_set1_epi32(i);
#define S(i) c##i = _mm512_add_epi32(c##i, _mm512_madd_epi16(_mm512_maddubs_epi16(a, probe_w_zmm[i]), ones));
#define A(i) s = _mm512_add_epi32(s, c##i);
    R12(D)
    for (long n = 0; n < iters; ++n) {
        __asm__ volatile("" : "+v"(a));
        R12(S)
    }
    __m512i s = _mm512_setzero_si512();
    R12(A)
    probe_sink_i = _mm512_reduce_add_epi32(s);
#undef D
#undef S
#undef A
    return iters * 12;
}
#endif

/* AMX: tiles 0-3 accumulate C[i][j] += A[i] . B[j] (2 x 2 blocking, 4 independent accumulator
 * tiles: enough to cover a tile multiply's latency); A in tiles 4-5, B in tiles 6-7; all 16 rows
 * x 64 bytes (palette 1). Linux hands out tile data only after ARCH_REQ_XCOMP_PERM. */
#if defined(PROBE_PART_tdpbf16ps) || defined(PROBE_PART_tdpbssd)
#include <sys/syscall.h>
#include <unistd.h>
struct probe_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static int probe_amx_start(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return -1;
    static _Alignas(64) struct probe_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    return 0;
}
static _Alignas(64) uint16_t probe_amx_src[16 * 32];
static _Alignas(64) float probe_amx_dst[16 * 16];
#define PROBE_AMX_BODY(DP)                                                        \
    if (probe_amx_start() != 0) return -1;                                        \
    for (int i = 0; i < 16 * 32; ++i) probe_amx_src[i] = 0x3c00; /* bf16 2^-7; int8 0, 60 */ \
    _tile_zero(0);                                                                \
    _tile_zero(1);                                                                \
    _tile_zero(2);                                                                \
    _tile_zero(3);                                                                \
    _tile_loadd(4, probe_amx_src, 64);                                            \
    _tile_loadd(5, probe_amx_src, 64);                                            \
    _tile_loadd(6, probe_amx_src, 64);                                            \
    _tile_loadd(7, probe_amx_src, 64);                                            \
    for (long n = 0; n < iters; ++n) {                                            \
        DP(0, 4, 6);                                                              \
        DP(1, 4, 7);                                                              \
        DP(2, 5, 6);                                                              \
        DP(3, 5, 7);                                                              \
    }                                                                             \
    _tile_stored(0, probe_amx_dst, 64);                                           \
    _tile_release();                                                              \
    probe_sink_f = probe_amx_dst[0];                                              \
    return iters * 4;
#endif

#ifdef PROBE_PART_tdpbf16ps /* -mamx-tile -mamx-bf16 */
long long probe_peak_tdpbf16ps(long iters) { PROBE_AMX_BODY(_tile_dpbf16ps) }
#endif

#ifdef PROBE_PART_tdpbssd /* -mamx-tile -mamx-int8 */
long long probe_peak_tdpbssd(long iters) { PROBE_AMX_BODY(_tile_dpbssd) }
#endif

/* main: bandwidth patterns and the peak driver ------------------------------------------------ */

#ifndef PROBE_A_PART
#include <omp.h>

#ifndef PROBE_KERNELS
#define PROBE_KERNELS
#endif
#define X(n) long long probe_peak_##n(long iters);
PROBE_KERNELS
#undef X
static const struct {
    const char *name;
    long long (*fn)(long);
} kernels[] = {
#define X(n) {#n, probe_peak_##n},
    PROBE_KERNELS
#undef X
    {NULL, NULL}};

typedef uint64_t v2u64 __attribute__((vector_size(16)));

/* S streams of `region` bytes each from `base`; `pf`: prefetch `dist` bytes ahead in each. Inlined
 * into one loop per (S, pf) so that S and pf are constants there. */
static inline __attribute__((always_inline)) uint64_t read_streams(const char *base, size_t region, int S, int pf,
                                                                   size_t dist) {
    v2u64 acc[8] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}};
    for (size_t off = 0; off < region; off += 64) {
        for (int s = 0; s < S; ++s) {
            const v2u64 *p = (const v2u64 *)(base + (size_t)s * region + off);
            if (pf) __builtin_prefetch((const char *)p + dist, 0, 3);
            acc[s] += (p[0] + p[1]) + (p[2] + p[3]);
        }
    }
    v2u64 t = acc[0];
    for (int s = 1; s < S; ++s) t += acc[s];
    return t[0] + t[1];
}

static uint64_t read_slice(const char *base, size_t region, int S, int pf, size_t dist) {
    switch (S * 2 + pf) {
    case 2: return read_streams(base, region, 1, 0, dist);
    case 3: return read_streams(base, region, 1, 1, dist);
    case 4: return read_streams(base, region, 2, 0, dist);
    case 5: return read_streams(base, region, 2, 1, dist);
    case 8: return read_streams(base, region, 4, 0, dist);
    case 9: return read_streams(base, region, 4, 1, dist);
    case 16: return read_streams(base, region, 8, 0, dist);
    default: return read_streams(base, region, 8, 1, dist);
    }
}

/* one read of the buffer by `threads` threads; returns seconds, adds the bytes read to *nbytes */
static double read_pass(const char *buf, size_t bytes, int threads, int S, int pf, size_t dist, size_t *nbytes,
                        uint64_t *sink) {
    double t0 = 0.0, t1 = 0.0;
    uint64_t total = 0;
    size_t region = (bytes / (size_t)threads / (size_t)S) & ~(size_t)4095; /* each stream: whole pages */
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const char *slice = buf + (size_t)omp_get_thread_num() * region * (size_t)S;
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        total += read_slice(slice, region, S, pf, dist);
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
    }
    *sink += total;
    *nbytes = region * (size_t)S * (size_t)threads;
    return t1 - t0;
}

/* one peak pass: every thread runs fn(iters); returns seconds, *count = instructions (or -1) */
static double peak_pass(long long (*fn)(long), long iters, int threads, long long *count) {
    double t0 = 0.0, t1 = 0.0;
    long long total = 0, failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total, failed)
    {
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        long long c = fn(iters);
        if (c < 0) failed += 1;
        else total += c;
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
    }
    *count = failed ? -1 : total;
    return t1 - t0;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s THREADS BYTES PASSES PEAK_SECONDS PREFETCH_BYTES [KERNEL ...]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    size_t bytes = (size_t)strtoull(argv[2], NULL, 10);
    int passes = atoi(argv[3]);
    double peak_s = atof(argv[4]);
    size_t dist = (size_t)strtoull(argv[5], NULL, 10);
    if (threads < 1 || passes < 1 || !(peak_s > 0) || dist == 0 || bytes < (size_t)threads * 8 * 4096 * 2) {
        fprintf(stderr, "bad arguments: THREADS >= 1, PASSES >= 1, PEAK_SECONDS > 0, PREFETCH_BYTES > 0, "
                        "BYTES >= THREADS * 64 KiB\n");
        return 2;
    }
    for (int k = 6; k < argc; ++k) {
        int found = 0;
        for (int j = 0; kernels[j].name; ++j) found |= strcmp(kernels[j].name, argv[k]) == 0;
        if (!found) {
            fprintf(stderr, "kernel %s was not compiled into this probe\n", argv[k]);
            return 2;
        }
    }
    char *buf = NULL;
    if (posix_memalign((void **)&buf, 4096, bytes) != 0) {
        fprintf(stderr, "cannot allocate %zu bytes\n", bytes);
        return 3;
    }
    size_t n_words = bytes / sizeof(uint64_t);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n_words; ++i) ((uint64_t *)buf)[i] = i * 0x9E3779B97F4A7C15ull;

    uint64_t sink = 0;
    size_t nb = 0;
    read_pass(buf, bytes, threads, 1, 0, dist, &nb, &sink); /* warm-up: TLB, frequency */
    printf("{\"probe\": 2, \"threads\": %d, \"bytes\": %zu, \"prefetch_bytes\": %zu, \"read\": [", threads, bytes, dist);
    const int stream_counts[4] = {1, 2, 4, 8};
    int first = 1;
    for (int ti = 0; ti < 2; ++ti) {
        int nt = ti == 0 ? 1 : threads;
        if (ti == 1 && threads == 1) break;
        for (int si = 0; si < 4; ++si)
            for (int pf = 0; pf < 2; ++pf) {
                double best = 0.0;
                printf("%s{\"threads\": %d, \"streams\": %d, \"prefetch\": %d, \"passes\": [", first ? "" : ", ", nt,
                       stream_counts[si], pf);
                first = 0;
                for (int p = 0; p < passes; ++p) {
                    double t = read_pass(buf, bytes, nt, stream_counts[si], pf, dist, &nb, &sink);
                    double gbs = (double)nb / t / 1e9;
                    if (gbs > best) best = gbs;
                    printf("%s%.3f", p ? ", " : "", gbs);
                }
                printf("], \"gbs\": %.3f}", best);
            }
    }
    free(buf);
    printf("], \"peaks\": [");
    char errors[4096] = "";
    first = 1;
    for (int k = 6; k < argc; ++k) {
        long long (*fn)(long) = NULL;
        for (int j = 0; kernels[j].name; ++j)
            if (strcmp(kernels[j].name, argv[k]) == 0) fn = kernels[j].fn;
        /* calibrate on this thread alone (a scheduling delay in a parallel pass would pass for
           work), which also warms it up (frequency, AVX-512 license); then check on all threads */
        long long count = 0;
        long iters = 1000;
        double t0 = omp_get_wtime();
        count = fn(iters);
        double t = omp_get_wtime() - t0;
        while (count >= 0 && t < peak_s / 30 && iters < (1L << 40)) {
            iters *= 2;
            t0 = omp_get_wtime();
            count = fn(iters);
            t = omp_get_wtime() - t0;
        }
        if (count >= 0) peak_pass(fn, 1000, threads, &count);
        if (count < 0) {
            size_t len = strlen(errors);
            snprintf(errors + len, sizeof errors - len, "%s\"%s\": \"the OS refused the instruction's register state "
                     "(arch_prctl ARCH_REQ_XCOMP_PERM)\"", len ? ", " : "", argv[k]);
            continue;
        }
        iters = (long)(iters * (peak_s / 4) / t) + 1;
        double best = 0.0;
        printf("%s{\"name\": \"%s\", \"threads\": %d, \"passes\": [", first ? "" : ", ", argv[k], threads);
        first = 0;
        for (int p = 0; p < 3; ++p) {
            t = peak_pass(fn, iters, threads, &count);
            double rate = (double)count / t;
            if (rate > best) best = rate;
            printf("%s%.6g", p ? ", " : "", rate);
        }
        printf("], \"instr_per_s\": %.6g}", best);
    }
    printf("], \"errors\": {%s}, \"sink\": %llu}\n", errors, (unsigned long long)sink);
    return 0;
}
#endif
