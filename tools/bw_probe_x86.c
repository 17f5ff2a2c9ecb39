/* The x86-64 half of moepack's machine-limit probe (the driver is tools/bw_probe.c; the shared
 * read-kernel template is tools/bw_probe.h). Two kinds of object come from this file:
 *
 *   cc -O2 -DPROBE_ARCH_READS -c bw_probe_x86.c            the read kernels: 32-byte (ymm, AVX2) and
 *                                                          64-byte (zmm, AVX-512F) loads, each in a
 *                                                          target("...") function picked at run time
 *                                                          (__builtin_cpu_supports), prefetcht0 via
 *                                                          _mm_prefetch; built without ISA flags
 *   cc -O2 -mavx2 -mfma -c bw_probe_x86.c -DPROBE_PART_fma_ymm   one object per dot-product
 *   ...                                                          instruction (its own -m flags)
 *
 * moepack/bench/probe.py builds a part only when the CPU has the instruction and the compiler
 * accepts its flags. A part defines long long probe_peak_<name>(long iters): iters iterations of
 * independent accumulator chains; returns the instructions executed (or -1 with a reason).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef PROBE_ARCH_READS
#include <immintrin.h>

#include "bw_probe.h"

#define X86_PREFETCH(q) _mm_prefetch((const char *)(q), _MM_HINT_T0)

#define YMM_LINE(acc, q) \
    _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_load_si256((const __m256i *)(q)), _mm256_load_si256((const __m256i *)((q) + 32))))
#define YMM_FOLD(t) \
    ((uint64_t)_mm256_extract_epi64(t, 0) + (uint64_t)_mm256_extract_epi64(t, 1) + (uint64_t)_mm256_extract_epi64(t, 2) + \
     (uint64_t)_mm256_extract_epi64(t, 3))
PROBE_READ_KERNEL(read_ymm, __attribute__((target("avx2"))), __m256i, _mm256_setzero_si256(), YMM_LINE, _mm256_add_epi64,
                  YMM_FOLD, X86_PREFETCH)

#define ZMM_LINE(acc, q) _mm512_add_epi64(acc, _mm512_load_si512((const void *)(q)))
#define ZMM_FOLD(t) ((uint64_t)_mm512_reduce_add_epi64(t))
PROBE_READ_KERNEL(read_zmm, __attribute__((target("avx512f"))), __m512i, _mm512_setzero_si512(), ZMM_LINE,
                  _mm512_add_epi64, ZMM_FOLD, X86_PREFETCH)

const struct probe_read_kernel *probe_arch_reads(void) {
    static struct probe_read_kernel list[3];
    int n = 0;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) list[n++] = (struct probe_read_kernel){"ymm", read_ymm};
    if (__builtin_cpu_supports("avx512f")) list[n++] = (struct probe_read_kernel){"zmm", read_zmm};
    list[n] = (struct probe_read_kernel){NULL, NULL};
    return list;
}

const char *probe_arch_name(void) { return "x86-64"; }
#endif

/* one instruction part: long long probe_peak_<name>(long iters) -------------------------------- */

#if defined(PROBE_PART_fma_ymm) || defined(PROBE_PART_fma_zmm) || defined(PROBE_PART_vdpbf16ps) || \
    defined(PROBE_PART_vpdpbusd_zmm) || defined(PROBE_PART_vpdpbusd_ymm) ||                     \
    defined(PROBE_PART_vpmaddubsw_ymm) || defined(PROBE_PART_vpmaddubsw_zmm) ||                 \
    defined(PROBE_PART_tdpbf16ps) || defined(PROBE_PART_tdpbssd)
#include <immintrin.h>
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

