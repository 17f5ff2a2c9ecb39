/* Machine probe for moepack's benchmark: memory read bandwidth and fp32 FMA peak.
 *
 * Not part of the extension. moepack/bench.py compiles it on the fly when a C compiler is
 * available (cc -O2 -mavx2 -mfma -fopenmp, cached by hash of source + flags + compiler) and
 * runs it with the benchmark's thread count:
 *
 *     bw_probe THREADS BYTES PASSES FMA_ITERS
 *
 * and reads one JSON line from stdout:
 *
 *     {"isa": "avx2", "threads": 2, "bytes": ..., "read_gbs": ..., "read_gbs_passes": [...],
 *      "fma_gflops": ..., "fma_gflops_passes": [...]}
 *
 * read_gbs: best of PASSES streaming reads of a BYTES buffer (written first, in parallel, so
 * its pages are real and spread over the threads as they will be read). Each thread reads its
 * own contiguous slice with 32-byte loads into 4 independent integer accumulators, which is
 * cheap enough that the loop is bound by memory, not by the core.
 *
 * fma_gflops: best of 3 runs of FMA_ITERS iterations per thread, each iteration 12 independent
 * vfmadd231ps chains on ymm registers (12 accumulators > 2 FMA ports x 4-5 cycles latency, so
 * the ports never wait): 12 * 8 lanes * 2 flops per iteration per thread.
 *
 * Without AVX2+FMA (another compiler target) it falls back to plain C loops the compiler may
 * vectorize; "isa" then says "generic" and the numbers are what plain C reaches, not a peak.
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PROBE_ISA "avx2"
#else
#define PROBE_ISA "generic"
#endif

static double read_pass(const uint64_t *buf, size_t n_words, int threads, uint64_t *sink) {
    uint64_t total = 0;
    double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t per = (n_words / nt) & ~(size_t)15; /* multiple of 16 words = 128 bytes */
        const uint64_t *p = buf + (size_t)tid * per;
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
#if defined(__AVX2__) && defined(__FMA__)
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i < per; i += 16) {
            a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
            a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + 4)));
            a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 8)));
            a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 12)));
        }
        __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, s);
        total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        for (size_t i = 0; i < per; i += 4) {
            a0 += p[i];
            a1 += p[i + 1];
            a2 += p[i + 2];
            a3 += p[i + 3];
        }
        total += a0 + a1 + a2 + a3;
#endif
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
    }
    *sink += total;
    return t1 - t0;
}

static double fma_run(long iters, int threads, float *sink) {
    double t0 = 0.0, t1 = 0.0;
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int tid = omp_get_thread_num();
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 m = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
        __m256 c0 = _mm256_set1_ps(1.0f + tid), c1 = _mm256_set1_ps(1.1f), c2 = _mm256_set1_ps(1.2f),
               c3 = _mm256_set1_ps(1.3f), c4 = _mm256_set1_ps(1.4f), c5 = _mm256_set1_ps(1.5f),
               c6 = _mm256_set1_ps(1.6f), c7 = _mm256_set1_ps(1.7f), c8 = _mm256_set1_ps(1.8f),
               c9 = _mm256_set1_ps(1.9f), c10 = _mm256_set1_ps(2.0f), c11 = _mm256_set1_ps(2.1f);
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        for (long i = 0; i < iters; ++i) {
            c0 = _mm256_fmadd_ps(c0, m, b);
            c1 = _mm256_fmadd_ps(c1, m, b);
            c2 = _mm256_fmadd_ps(c2, m, b);
            c3 = _mm256_fmadd_ps(c3, m, b);
            c4 = _mm256_fmadd_ps(c4, m, b);
            c5 = _mm256_fmadd_ps(c5, m, b);
            c6 = _mm256_fmadd_ps(c6, m, b);
            c7 = _mm256_fmadd_ps(c7, m, b);
            c8 = _mm256_fmadd_ps(c8, m, b);
            c9 = _mm256_fmadd_ps(c9, m, b);
            c10 = _mm256_fmadd_ps(c10, m, b);
            c11 = _mm256_fmadd_ps(c11, m, b);
        }
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                                 _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
        s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
        float lanes[8];
        _mm256_storeu_ps(lanes, s);
        for (int j = 0; j < 8; ++j) total += lanes[j];
#else
        float c[12][8];
        for (int a = 0; a < 12; ++a)
            for (int j = 0; j < 8; ++j) c[a][j] = 1.0f + 0.1f * a + tid;
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        for (long i = 0; i < iters; ++i)
            for (int a = 0; a < 12; ++a)
                for (int j = 0; j < 8; ++j) c[a][j] = c[a][j] * 0.999999f + 1e-7f;
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
        for (int a = 0; a < 12; ++a)
            for (int j = 0; j < 8; ++j) total += c[a][j];
#endif
    }
    *sink += total;
    return t1 - t0;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s THREADS BYTES PASSES FMA_ITERS\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    size_t bytes = (size_t)strtoull(argv[2], NULL, 10);
    int passes = atoi(argv[3]);
    long fma_iters = atol(argv[4]);
    if (threads < 1 || bytes < 4096 || passes < 1 || fma_iters < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    size_t n_words = bytes / sizeof(uint64_t);
    uint64_t *buf = NULL;
    if (posix_memalign((void **)&buf, 4096, n_words * sizeof(uint64_t)) != 0) {
        fprintf(stderr, "cannot allocate %zu bytes\n", bytes);
        return 3;
    }
    /* first touch by the threads that will read, with non-zero data (an untouched or all-zero
       buffer can be served from the shared zero page, which measures the cache, not DRAM) */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n_words; ++i) buf[i] = i * 0x9E3779B97F4A7C15ull;

    uint64_t sink = 0;
    read_pass(buf, n_words, threads, &sink); /* warm-up: TLB, frequency */
    size_t read_bytes = (n_words / threads & ~(size_t)15) * threads * sizeof(uint64_t);
    double best_bw = 0.0;
    printf("{\"isa\": \"%s\", \"threads\": %d, \"bytes\": %zu, \"read_gbs_passes\": [", PROBE_ISA, threads, read_bytes);
    for (int p = 0; p < passes; ++p) {
        double gbs = read_bytes / read_pass(buf, n_words, threads, &sink) / 1e9;
        if (gbs > best_bw) best_bw = gbs;
        printf("%s%.3f", p ? ", " : "", gbs);
    }
    free(buf);

    float fsink = 0.0f;
    double best_fma = 0.0;
    fma_run(fma_iters / 10 + 1, threads, &fsink); /* warm-up */
    printf("], \"read_gbs\": %.3f, \"fma_gflops_passes\": [", best_bw);
    for (int p = 0; p < 3; ++p) {
        double gf = (double)fma_iters * threads * 12 * 8 * 2 / fma_run(fma_iters, threads, &fsink) / 1e9;
        if (gf > best_fma) best_fma = gf;
        printf("%s%.3f", p ? ", " : "", gf);
    }
    printf("], \"fma_gflops\": %.3f, \"sink\": %llu}\n", best_fma,
           (unsigned long long)(sink + (uint64_t)(fsink != 0.0f)));
    return 0;
}
