/* Machine-limit probe for moepack's benchmark: the read rate the machine reaches, found by a
 * search over read patterns, and the peaks of the dot-product instructions.
 *
 * Not part of the extension. moepack/bench/probe.py compiles it on the fly when a C compiler is
 * there and caches the binary (by hash of sources, flags, compiler and the parts built). This file
 * is the driver and names no architecture; each architecture's loads, prefetch and instruction
 * peaks live in its own file, tools/bw_probe_<arch>.c, compiled only for it (moepack/bench/probe.py
 * picks the file for the host), all read kernels stamped from the one template in tools/bw_probe.h:
 *
 *   cc -O2 -fopenmp -DPROBE_ARCH_READS -DPROBE_KERNELS='X(fma_ymm)...' -c bw_probe.c    driver
 *   cc -O2 -DPROBE_ARCH_READS -c bw_probe_<arch>.c                        the arch's read kernels
 *   cc -O2 <its -m flags> -DPROBE_PART_<name> -c bw_probe_<arch>.c        one per instruction
 *   cc -fopenmp driver.o <arch>.o <parts>.o -o bw_probe
 *
 * Without PROBE_ARCH_READS (an architecture without its file) the driver has its plain-C reads
 * alone. Nothing is compiled with ISA flags but the instruction parts, and wider loads run only
 * where the CPU has them, so the binary starts on any CPU of its architecture.
 *
 *     bw_probe THREADS BYTES PASSES PEAK_SECONDS [--quick] [--expert=BYTES] [--budget=SECONDS] [KERNEL ...]
 *
 * prints one JSON line (format "probe": 3):
 *
 *     {"probe": 3, "arch": ..., "threads": 2, "bytes": ..., "expert_bytes": ..., "window_bytes": ...,
 *      "llc_bytes": ..., "passes": 3, "loads": ["c", "ymm", "zmm"], "pages": {...},
 *      "read": [{"threads": 2, "load": "c", "streams": 1, "prefetch": 0, "split": 0, "pages": "4k",
 *                "shape": "buffer", "bytes": ..., "role": "plain", "passes": [...], "gbs": ...}, ...],
 *      "best": <index into read>, "read_seconds": ..., "over_budget": 0,
 *      "peaks": [{"name": "fma_zmm", "threads": 2, "instr_per_s": ..., "passes": [...]}, ...],
 *      "errors": {"tdpbf16ps": "..."}}
 *
 * Read patterns. Every pattern is timed the same way: the best of PASSES passes, each pass the
 * bytes all threads read divided by the time from a barrier before the first load to a barrier
 * after the last. A pattern is a choice along each of these axes:
 *
 *   threads   1, 2, 3, 4, then doubling, and THREADS (never above THREADS)
 *   load      "c": 16-byte GCC vectors (the plain-C fallback, any CPU); the architecture's own
 *             loads where the CPU has them ("ymm" and "zmm": 32- and 64-byte vectors; "neon")
 *   streams   1, 2, 4, 8 sequential streams per thread, read in one loop one 64-byte line of each
 *             per step (moepack's decode reads several 4 KiB segments of a weight block at once)
 *   prefetch  none, or a software prefetch 256 B .. 4 KiB ahead in every stream
 *   split     how a thread finds its bytes: 0 = each region cut into THREADS contiguous parts;
 *             C > 0 = the regions cut into chunks of C bytes dealt round-robin to the threads
 *             (64 KiB, 1 MiB, and one expert's size)
 *   pages     "4k": the buffer madvise(MADV_NOHUGEPAGE)d; "thp": madvise(MADV_HUGEPAGE)
 *             (transparent huge pages, Linux only; "pages" in the output says how many bytes the
 *             kernel actually backed with huge pages)
 *   shape     what one pass reads: "buffer" = all BYTES; "window" = 8 experts' worth of
 *             contiguous bytes (a decode call's working set, 75 MB at qwen3-30b-a3b's 9.4 MB
 *             experts); "experts" = 8 regions of one expert each, scattered over the buffer (an
 *             MoE decode call: each expert read once). Windows and experts rotate through the
 *             buffer pass after pass, so a byte is read again only after BYTES others: with BYTES
 *             well above the last-level cache the reads come from memory, not from a warm cache.
 *
 * The search starts at the plain pattern (THREADS threads, "c" loads, 1 stream, no prefetch,
 * contiguous split, 4 KiB pages, the whole buffer: the probe's read before format 3, also
 * measured at 1 thread) and walks the axes one at a time (shape first, then threads, load,
 * streams, prefetch, split), keeping the value that reads fastest, twice round (once with
 * --quick); then again from the winner on huge pages. The full cross
 * product would be over a thousand patterns; this measures about fifty. "best" is the fastest
 * pattern measured. After --budget seconds (default 15: a loaded machine reads slowly) the search
 * measures no new pattern; "over_budget" counts those it left out.
 *
 * Buffers are filled by the threads that read them, with non-zero data (untouched or all-zero
 * pages can come from the shared zero page, which measures the cache). One buffer of BYTES is
 * allocated at a time.
 *
 * peaks: for each KERNEL, probe_peak_<KERNEL>(iters) (from the architecture's parts) runs iters
 * iterations of independent accumulator chains on each thread and returns the instructions it
 * executed (or -1 with a reason); iters is calibrated on one thread so that a pass takes about
 * PEAK_SECONDS / 4, then the best of 3 passes on all threads is kept. Operations per instruction
 * are not counted here: probe.py's table has them.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "bw_probe.h"

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

/* the plain-C read kernel: 16-byte GCC vectors (baseline ISA of any architecture) */
typedef uint64_t v2u64 __attribute__((vector_size(16)));
#define C_LINE(acc, q) \
    ((acc) + ((((const v2u64 *)(q))[0] + ((const v2u64 *)(q))[1]) + (((const v2u64 *)(q))[2] + ((const v2u64 *)(q))[3])))
#define C_ADD(a, b) ((a) + (b))
#define C_FOLD(t) ((t)[0] + (t)[1])
#define C_PREFETCH(q) __builtin_prefetch((const void *)(q), 0, 3)
PROBE_READ_KERNEL(read_c, , v2u64, ((v2u64){0, 0}), C_LINE, C_ADD, C_FOLD, C_PREFETCH)

#define MAX_LOADS 8
static struct probe_read_kernel loads[MAX_LOADS];
static int n_loads;

static void collect_loads(void) {
    loads[n_loads++] = (struct probe_read_kernel){"c", read_c};
#ifdef PROBE_ARCH_READS
    for (const struct probe_read_kernel *k = probe_arch_reads(); k && k->name && n_loads < MAX_LOADS; ++k) loads[n_loads++] = *k;
#endif
}

static const char *arch_name(void) {
#ifdef PROBE_ARCH_READS
    return probe_arch_name();
#else
    return "unknown";
#endif
}

/* buffers ------------------------------------------------------------------------------------ */

struct buffer {
    char *p, *map;
    size_t bytes, map_bytes;
    int huge;
    long long huge_bytes; /* bytes the kernel backed with huge pages, -1 unknown */
};

#define HUGE_ALIGN ((size_t)2 << 20)

/* the AnonHugePages of the mapping that holds p (Linux /proc/self/smaps), -1 where unknown */
static long long huge_bytes_of(const void *p) {
#ifdef __linux__
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int inside = 0;
    long long found = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        long long kb;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
            inside = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        else if (inside && sscanf(line, "AnonHugePages: %lld kB", &kb) == 1) {
            found = kb * 1024;
            break;
        }
    }
    fclose(f);
    return found;
#else
    (void)p;
    return -1;
#endif
}

/* 0, or -1 with *why set: huge pages cannot be asked for here, or memory ran out */
static int buffer_alloc(struct buffer *b, size_t bytes, int huge, int threads, const char **why) {
    memset(b, 0, sizeof *b);
    b->bytes = bytes;
    b->huge = huge;
#if defined(__linux__) && defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
    b->map_bytes = bytes + HUGE_ALIGN;
    b->map = mmap(NULL, b->map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b->map == MAP_FAILED) {
        b->map = NULL;
        *why = "mmap failed";
        return -1;
    }
    b->p = (char *)(((uintptr_t)b->map + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
    if (madvise(b->p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0 && huge) {
        munmap(b->map, b->map_bytes);
        b->map = NULL;
        *why = "madvise(MADV_HUGEPAGE) refused (no transparent huge pages in this kernel)";
        return -1;
    }
#else
    if (huge) {
        *why = "transparent huge pages are a Linux madvise (MADV_HUGEPAGE): not on this OS";
        return -1;
    }
    if (posix_memalign((void **)&b->map, HUGE_ALIGN, bytes) != 0) {
        b->map = NULL;
        *why = "posix_memalign failed";
        return -1;
    }
    b->p = b->map;
#endif
    size_t n_words = bytes / sizeof(uint64_t);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n_words; ++i) ((uint64_t *)b->p)[i] = i * 0x9E3779B97F4A7C15ull + 1;
    b->huge_bytes = huge_bytes_of(b->p);
    return 0;
}

static void buffer_free(struct buffer *b) {
    if (!b->map) return;
#if defined(__linux__) && defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
    munmap(b->map, b->map_bytes);
#else
    free(b->map);
#endif
    b->map = b->p = NULL;
}

/* patterns ----------------------------------------------------------------------------------- */

enum { SHAPE_BUFFER, SHAPE_WINDOW, SHAPE_EXPERTS, N_SHAPES };
static const char *const shape_names[N_SHAPES] = {"buffer", "window", "experts"};
#define N_DECODE_EXPERTS 8

struct pat {
    int threads, load, streams;
    size_t prefetch, split; /* split: 0 contiguous parts, else chunk bytes dealt round-robin */
    int huge, shape;
};

struct result {
    struct pat pat;
    int role; /* 0 search, 1 plain */
    size_t bytes;
    int n_passes;
    double passes[16];
    double gbs;
};

#define MAX_RESULTS 256
static struct result results[MAX_RESULTS];
static int n_results;

static size_t g_bytes, g_expert, g_window, g_pool, g_stride;
static int g_passes;
static double g_deadline;   /* omp_get_wtime() after which the search measures no new pattern */
static int g_over_budget; /* patterns the search left out for lack of time */
static unsigned long g_rot; /* rotates windows and experts through the buffer, pass after pass */
static uint64_t g_sink;

struct region {
    size_t off, len;
};

static int pass_regions(const struct pat *pt, struct region *reg) {
    if (pt->shape == SHAPE_BUFFER) {
        reg[0] = (struct region){0, g_bytes};
        return 1;
    }
    unsigned long r = g_rot++;
    if (pt->shape == SHAPE_WINDOW) {
        size_t n_win = g_bytes / g_window;
        reg[0] = (struct region){(r % n_win) * g_window, g_window};
        return 1;
    }
    for (int j = 0; j < N_DECODE_EXPERTS; ++j) {
        size_t e = ((r * N_DECODE_EXPERTS + (size_t)j) % g_pool) * g_stride % g_pool;
        reg[j] = (struct region){e * g_expert, g_expert};
    }
    return N_DECODE_EXPERTS;
}

/* one pass of pattern pt over buf: seconds; *nbytes = the bytes all threads read */
static double read_pass(const struct buffer *buf, const struct pat *pt, size_t *nbytes) {
    struct region reg[N_DECODE_EXPERTS];
    int n_reg = pass_regions(pt, reg);
    const int T = pt->threads, S = pt->streams;
    const size_t unit = 64 * (size_t)S, dist = pt->prefetch, split = pt->split;
    const probe_read_fn fn = loads[pt->load].fn;
    double t0 = 0.0, t1 = 0.0;
    uint64_t total = 0;
    size_t got = 0;
#pragma omp parallel num_threads(T) reduction(+ : total, got)
    {
        const size_t t = (size_t)omp_get_thread_num();
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        size_t chunk_no = 0;
        for (int r = 0; r < n_reg; ++r) {
            const char *base = buf->p + reg[r].off;
            const size_t len = reg[r].len;
            if (split == 0) {
                size_t part = len / (size_t)T / unit * unit;
                if (part) total += fn(base + t * part, part / (size_t)S, S, dist), got += part;
            } else {
                for (size_t off = 0; off < len; off += split, ++chunk_no) {
                    if (chunk_no % (size_t)T != t) continue;
                    size_t c = (len - off < split ? len - off : split) / unit * unit;
                    if (c) total += fn(base + off, c / (size_t)S, S, dist), got += c;
                }
            }
        }
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
    }
    g_sink += total;
    *nbytes = got;
    return t1 - t0;
}

static int same_pat(const struct pat *a, const struct pat *b) {
    return a->threads == b->threads && a->load == b->load && a->streams == b->streams && a->prefetch == b->prefetch &&
           a->split == b->split && a->huge == b->huge && a->shape == b->shape;
}

/* the pattern's best rate (GB/s), measured now or remembered */
static double measure(const struct buffer *buf, struct pat pt, int role) {
    for (int i = 0; i < n_results; ++i)
        if (same_pat(&results[i].pat, &pt)) {
            if (role) results[i].role = role;
            return results[i].gbs;
        }
    if (n_results == MAX_RESULTS || (!role && omp_get_wtime() > g_deadline)) {
        g_over_budget += 1;
        return 0.0;
    }
    struct result *res = &results[n_results++];
    memset(res, 0, sizeof *res);
    res->pat = pt;
    res->role = role;
    res->n_passes = g_passes < 16 ? g_passes : 16;
    for (int p = 0; p < res->n_passes; ++p) {
        size_t nb = 0;
        double t = read_pass(buf, &pt, &nb);
        double gbs = t > 0 ? (double)nb / t / 1e9 : 0.0;
        res->passes[p] = gbs;
        res->bytes = nb;
        if (gbs > res->gbs) res->gbs = gbs;
    }
    return res->gbs;
}

/* the axes: each pattern's value along axis a, and the values it takes */
/* the order the search walks them: shape first, since a window or 8 experts take a 20th of a
   whole-buffer pass (a loaded machine's budget then covers every axis), then the others */
enum { AX_SHAPE, AX_THREADS, AX_LOAD, AX_STREAMS, AX_PREFETCH, AX_SPLIT, N_AXES };
#define MAX_VALUES 16
static size_t axis_values[N_AXES][MAX_VALUES];
static int axis_count[N_AXES];

static void set_axis(struct pat *p, int a, size_t v) {
    switch (a) {
    case AX_LOAD: p->load = (int)v; break;
    case AX_STREAMS: p->streams = (int)v; break;
    case AX_PREFETCH: p->prefetch = v; break;
    case AX_SPLIT: p->split = v; break;
    case AX_THREADS: p->threads = (int)v; break;
    case AX_SHAPE: p->shape = (int)v; break;
    default: break;
    }
}

static void add_value(int a, size_t v) {
    for (int i = 0; i < axis_count[a]; ++i)
        if (axis_values[a][i] == v) return;
    if (axis_count[a] < MAX_VALUES) axis_values[a][axis_count[a]++] = v;
}

static void make_axes(int threads, int quick) {
    for (int i = 0; i < n_loads; ++i) add_value(AX_LOAD, (size_t)i);
    for (int s = 1; s <= 8; s *= 2) add_value(AX_STREAMS, (size_t)s);
    add_value(AX_PREFETCH, 0);
    for (size_t d = 256; d <= 4096; d *= 2)
        if (!quick || d == 1024) add_value(AX_PREFETCH, d);
    add_value(AX_SPLIT, 0);
    add_value(AX_SPLIT, (size_t)64 << 10);
    add_value(AX_SPLIT, (size_t)1 << 20);
    add_value(AX_SPLIT, g_expert);
    for (int t = 1; t <= threads; t = t < 4 ? t + 1 : t * 2) add_value(AX_THREADS, (size_t)t);
    add_value(AX_THREADS, (size_t)threads);
    for (int s = 0; s < N_SHAPES; ++s) add_value(AX_SHAPE, (size_t)s);
}

/* coordinate search from `start`: along each axis in turn keep the fastest value; `rounds` times */
static struct pat search(const struct buffer *buf, struct pat start, int rounds) {
    struct pat best = start;
    double best_gbs = measure(buf, best, 0);
    for (int round = 0; round < rounds; ++round)
        for (int a = 0; a < N_AXES; ++a)
            for (int i = 0; i < axis_count[a]; ++i) {
                struct pat p = best;
                set_axis(&p, a, axis_values[a][i]);
                double g = measure(buf, p, 0);
                if (g > best_gbs) best_gbs = g, best = p;
            }
    return best;
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

static size_t gcd_size(size_t a, size_t b) {
    while (b) {
        size_t t = a % b;
        a = b, b = t;
    }
    return a;
}

static long long llc_bytes(void) {
#ifdef _SC_LEVEL3_CACHE_SIZE
    long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (v > 0) return v;
#endif
    return -1;
}

static void print_result(const struct result *r, int first) {
    const struct pat *p = &r->pat;
    printf("%s{\"threads\": %d, \"load\": \"%s\", \"streams\": %d, \"prefetch\": %zu, \"split\": %zu, \"pages\": \"%s\", "
           "\"shape\": \"%s\", \"bytes\": %zu, \"role\": \"%s\", \"passes\": [",
           first ? "" : ", ", p->threads, loads[p->load].name, p->streams, p->prefetch, p->split, p->huge ? "thp" : "4k",
           shape_names[p->shape], r->bytes, r->role ? "plain" : "search");
    for (int i = 0; i < r->n_passes; ++i) printf("%s%.3f", i ? ", " : "", r->passes[i]);
    printf("], \"gbs\": %.3f}", r->gbs);
}

#define DEFAULT_EXPERT_BYTES ((size_t)9437184) /* qwen3-30b-a3b: 3 x 2048 x 768 bf16 */

struct opts {
    int threads, passes, quick, first_kernel;
    size_t bytes, expert;
    double peak_s, budget;
};

/* 0, or the exit status after a message on stderr */
static int parse_args(int argc, char **argv, struct opts *o) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s THREADS BYTES PASSES PEAK_SECONDS [--quick] [--expert=BYTES] [--budget=SECONDS] [KERNEL ...]\n", argv[0]);
        return 2;
    }
    *o = (struct opts){atoi(argv[1]), atoi(argv[3]), 0, 5, (size_t)strtoull(argv[2], NULL, 10), 0, atof(argv[4]), 15.0};
    for (; o->first_kernel < argc && strncmp(argv[o->first_kernel], "--", 2) == 0; ++o->first_kernel) {
        const char *a = argv[o->first_kernel];
        if (strcmp(a, "--quick") == 0) o->quick = 1;
        else if (strncmp(a, "--expert=", 9) == 0) o->expert = (size_t)strtoull(a + 9, NULL, 10);
        else if (strncmp(a, "--budget=", 9) == 0) o->budget = atof(a + 9);
        else {
            fprintf(stderr, "unknown option %s (known: --quick, --expert=BYTES, --budget=SECONDS)\n", a);
            return 2;
        }
    }
    if (o->threads < 1 || o->passes < 1 || !(o->peak_s > 0) || !(o->budget > 0) || o->bytes < (size_t)o->threads * (1 << 20)) {
        fprintf(stderr, "bad arguments: THREADS >= 1, PASSES >= 1, PEAK_SECONDS > 0, BUDGET > 0, BYTES >= THREADS * 1 MiB\n");
        return 2;
    }
    /* one expert: the given size, else qwen3-30b-a3b's, at most a 16th of the buffer (so that 8
       experts rotate through at least two disjoint sets); a multiple of 64 KiB */
    if (o->expert == 0) o->expert = DEFAULT_EXPERT_BYTES;
    if (o->expert > o->bytes / 16) o->expert = o->bytes / 16;
    o->expert &= ~(((size_t)64 << 10) - 1);
    if (o->expert == 0) {
        fprintf(stderr, "BYTES=%zu: too small for 16 experts of at least 64 KiB\n", o->bytes);
        return 2;
    }
    for (int k = o->first_kernel; k < argc; ++k) {
        int found = 0;
        for (int j = 0; kernels[j].name; ++j) found |= strcmp(kernels[j].name, argv[k]) == 0;
        if (!found) {
            fprintf(stderr, "kernel %s was not compiled into this probe\n", argv[k]);
            return 2;
        }
    }
    return 0;
}

/* the search on 4 KiB pages, then on huge pages where they can be asked for; prints the read
   part of the output; 0, or the exit status after a message on stderr */
static int run_reads(const struct opts *o) {
    collect_loads();
    g_bytes = o->bytes, g_expert = o->expert, g_window = o->expert * N_DECODE_EXPERTS, g_passes = o->passes;
    g_pool = o->bytes / o->expert;
    for (g_stride = g_pool / 3 + 1; gcd_size(g_stride, g_pool) != 1; ++g_stride) {
    }
    make_axes(o->threads, o->quick);
    double t_start = omp_get_wtime();
    g_deadline = t_start + o->budget;
    const char *why = NULL, *thp_why = NULL;
    struct buffer buf;
    if (buffer_alloc(&buf, o->bytes, 0, o->threads, &why) != 0) {
        fprintf(stderr, "cannot allocate %zu bytes: %s\n", o->bytes, why);
        return 3;
    }
    long long huge_4k = buf.huge_bytes, huge_thp = -1;
    const struct pat plain = {o->threads, 0, 1, 0, 0, 0, SHAPE_BUFFER};
    size_t nb = 0;
    read_pass(&buf, &plain, &nb); /* warm-up: TLB, frequency */
    measure(&buf, plain, 1);
    if (o->threads > 1) {
        struct pat one = plain;
        one.threads = 1;
        measure(&buf, one, 1);
    }
    struct pat best = search(&buf, plain, o->quick ? 1 : 2);
    buffer_free(&buf);
    if (omp_get_wtime() > g_deadline)
        thp_why = "not measured: the search's time budget ran out first";
    else if (buffer_alloc(&buf, o->bytes, 1, o->threads, &thp_why) == 0) {
        huge_thp = buf.huge_bytes;
        best.huge = 1;
        read_pass(&buf, &plain, &nb); /* warm-up */
        search(&buf, best, 1);
        buffer_free(&buf);
    }
    double read_s = omp_get_wtime() - t_start;
    int best_i = 0;
    for (int i = 1; i < n_results; ++i)
        if (results[i].gbs > results[best_i].gbs) best_i = i;

    printf("{\"probe\": 3, \"arch\": \"%s\", \"threads\": %d, \"bytes\": %zu, \"expert_bytes\": %zu, \"window_bytes\": %zu, "
           "\"llc_bytes\": %lld, \"passes\": %d, \"quick\": %d, \"loads\": [",
           arch_name(), o->threads, o->bytes, g_expert, g_window, llc_bytes(), o->passes, o->quick);
    for (int i = 0; i < n_loads; ++i) printf("%s\"%s\"", i ? ", " : "", loads[i].name);
    printf("], \"pages\": {\"4k\": {\"huge_bytes\": %lld}, \"thp\": ", huge_4k);
    if (thp_why) printf("{\"unavailable\": \"%s\"}", thp_why);
    else printf("{\"huge_bytes\": %lld}", huge_thp);
    printf("}, \"read\": [");
    for (int i = 0; i < n_results; ++i) print_result(&results[i], i == 0);
    printf("], \"best\": %d, \"read_seconds\": %.3f, \"over_budget\": %d", best_i, read_s, g_over_budget);
    return 0;
}

/* the peak of each KERNEL named on the command line; prints the peaks part of the output */
static void run_peaks(const struct opts *o, int argc, char **argv) {
    printf(", \"peaks\": [");
    char errors[4096] = "";
    int first = 1;
    for (int k = o->first_kernel; k < argc; ++k) {
        long long (*fn)(long) = NULL;
        for (int j = 0; kernels[j].name; ++j)
            if (strcmp(kernels[j].name, argv[k]) == 0) fn = kernels[j].fn;
        /* calibrate on this thread alone (a scheduling delay in a parallel pass would pass for
           work), which also warms it up (frequency, wide-vector license); then check on all threads */
        long long count = 0;
        long iters = 1000;
        double t0 = omp_get_wtime();
        count = fn(iters);
        double t = omp_get_wtime() - t0;
        while (count >= 0 && t < o->peak_s / 30 && iters < (1L << 40)) {
            iters *= 2;
            t0 = omp_get_wtime();
            count = fn(iters);
            t = omp_get_wtime() - t0;
        }
        if (count >= 0) peak_pass(fn, 1000, o->threads, &count);
        if (count < 0) { /* a part returns -1 when the OS would not enable the registers it needs */
            size_t len = strlen(errors);
            snprintf(errors + len, sizeof errors - len, "%s\"%s\": \"the OS refused the instruction's register state\"",
                     len ? ", " : "", argv[k]);
            continue;
        }
        iters = (long)(iters * (o->peak_s / 4) / t) + 1;
        double best = 0.0;
        printf("%s{\"name\": \"%s\", \"threads\": %d, \"passes\": [", first ? "" : ", ", argv[k], o->threads);
        first = 0;
        for (int p = 0; p < 3; ++p) {
            t = peak_pass(fn, iters, o->threads, &count);
            double rate = (double)count / t;
            if (rate > best) best = rate;
            printf("%s%.6g", p ? ", " : "", rate);
        }
        printf("], \"instr_per_s\": %.6g}", best);
    }
    printf("], \"errors\": {%s}", errors);
}

int main(int argc, char **argv) {
    struct opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc == 0) rc = run_reads(&o);
    if (rc != 0) return rc;
    run_peaks(&o, argc, argv);
    printf(", \"sink\": %llu}\n", (unsigned long long)g_sink);
    return 0;
}
