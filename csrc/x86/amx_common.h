// AMX tile configuration shared by the AMX levels (moe_amx_bf16.cpp, moe_amx_int8.cpp). Include
// only from a file compiled with -mamx-tile, inside that level's namespace (internal linkage).
//
// The kernels use palette 1 with: tiles 0-3 = C (2 x 2 of rows x 16 fp32/int32 columns), 4-5 =
// A (rows x 64 bytes of K), 6-7 = B (16 rows of K groups x 64 bytes = 16 columns). A row group
// is 32 rows (A tiles 4 and 5); the last group of a call may have fewer, and gets a
// configuration with exactly those rows, so no tile ever loads or stores a row past the call's.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace moepack {
namespace x86_amx {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Rows `top` (1..16) in C tiles 0-1 and A tile 4, `bottom` (0..16) in C tiles 2-3 and A tile 5
// (0: those tiles are left unconfigured and must not be used); B tiles 16 x 64 bytes.
inline TileConfig tile_config(int top, int bottom) {
  TileConfig c;
  auto set = [&](int t, int rows) {
    c.rows[t] = uint8_t(rows);
    c.colsb[t] = rows ? 64 : 0;
  };
  set(0, top);
  set(1, top);
  set(4, top);
  set(2, bottom);
  set(3, bottom);
  set(5, bottom);
  set(6, 16);
  set(7, 16);
  return c;
}

// Loads the configuration for a row group of `rows` (1..32) unless it is the one loaded.
struct TileState {
  int loaded = -1;  // rows of the loaded configuration, -1: none
  void group(int rows) {
    if (rows == loaded) return;
    const TileConfig c = tile_config(rows < 16 ? rows : 16, rows > 16 ? rows - 16 : 0);
    // Not _tile_loadconfig: GCC 12's amxtileintrin.h gives that asm only the configuration's
    // first 8 bytes as its memory operand, so where GCC emits this function out of line it may
    // drop the stores of the row counts and column widths, load a configuration of no tiles, and
    // the first tile instruction raises #UD (seen as SIGILL with two bf16 mxfp4 rows at -O3).
    // This asm reads all 64 bytes.
    asm volatile("ldtilecfg %0" : : "m"(c));
    loaded = rows;
  }
  ~TileState() {
    if (loaded >= 0) _tile_release();
  }
};

// The configuration a driver worker keeps loaded across its tasks (MK::WorkerScope = TileScope):
// loading and releasing a configuration costs about a microsecond here (a KVM guest), as much as
// one 32 x 32 x 2048 block's tile arithmetic, so it is done once per worker, not once per block.
// Outside a scope (tests calling a kernel directly) each call loads and releases its own.
inline thread_local TileState* t_worker_tiles = nullptr;
struct TileScope {
  TileState tiles;
  TileState* prev;
  TileScope() : prev(t_worker_tiles) { t_worker_tiles = &tiles; }
  ~TileScope() { t_worker_tiles = prev; }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};
// The worker's tile state, or `local` (released when the caller returns) outside a worker.
static inline TileState& tile_state(TileState& local) { return t_worker_tiles ? *t_worker_tiles : local; }

// The tile dot product of a kernel: C tile (row half, column half) += A tile x B tile. A macro,
// because the tile intrinsics take tile numbers that the assembler sees as text.
#define MOEPACK_AMX_DP(NAME, INSN)                  \
  struct NAME {                                     \
    static inline void c00() { INSN(0, 4, 6); }     \
    static inline void c01() { INSN(1, 4, 7); }     \
    static inline void c10() { INSN(2, 5, 6); }     \
    static inline void c11() { INSN(3, 5, 7); }     \
  }

// C[m, 32] (4-byte elements: fp32 or int32) = A[m, groups] . B over the first `groups` K groups
// (a multiple of 16) of one 32-column block; a K group is 4 bytes of one row (a bf16 pair, an
// int8 quad) and 128 bytes of the block (32 columns). A = m rows of `row_bytes` bytes apart at
// `a`. Dp (MOEPACK_AMX_DP) names the tile dot product (tdpbf16ps, tdpbssd, tdpbsud).
// `accumulate`: C += (the C tiles are loaded from C first) instead of C =.
// `stream_b`: B is read from memory (the packed weights, not an unpacked copy in L1): during the
// first row group each K step prefetches, into L2, the 2 KiB of B kTileBPrefetchSteps steps
// ahead, which past the block's end are the start of the next block in the packed tensor (the
// block a worker usually takes next). Tile loads that miss the caches stall the tile unit:
// qwen3 T=512 on this SPR-class guest, int8 42.5 -> 35-36 ms, bf16 65 -> 58-59 ms; 2 and 4 steps
// ahead measured alike, 8 and 16 worse, and prefetching into L1 instead about as good.
// Page touch: once per 4 KiB of B, one more line kTilePageTouchBytes ahead. A directory opened
// with moepack.open is a memory map on the page cache's pages, mostly 4 KiB ones, and each page
// the stream enters is a TLB miss (in a virtual machine a walk of two page tables) that the
// 8 KiB prefetch above does not run far enough ahead to hide. qwen3 T=128..1024, 2 threads, the
// SPR-class guest, arms in shuffled order in one process (docs/KERNELS.md "Page touch"): bf16 on
// 4 KiB pages 1.08-1.12x, on the opened pack 1.11-1.18x, on 2 MiB pages 1.02-1.03x; int8 1.05-1.08x,
// 1.03-1.07x, 1.02-1.03x.
constexpr int64_t kTileBPrefetchSteps = 4;
constexpr int64_t kTilePageTouchBytes = 16384;
template <class Dp, class T>
static inline void tile_rows(TileState& tiles, const char* a, int64_t row_bytes, int m, const char* bb, int64_t groups,
                             bool accumulate, T* C, bool stream_b = false) {
  for (int r0 = 0; r0 < m; r0 += 32) {
    const int rows = m - r0 < 32 ? m - r0 : 32;
    const bool two = rows > 16;  // a second row tile (rows r0+16 ..)
    tiles.group(rows);
    const char* a0 = a + int64_t(r0) * row_bytes;
    const char* a1 = a0 + 16 * row_bytes;
    T* c = C + int64_t(r0) * 32;
    if (accumulate) {
      _tile_loadd(0, c, 128);
      _tile_loadd(1, c + 16, 128);
      if (two) {
        _tile_loadd(2, c + 16 * 32, 128);
        _tile_loadd(3, c + 16 * 32 + 16, 128);
      }
    } else {
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
      }
    }
    for (int64_t g = 0; g < groups; g += 16) {
      if (stream_b && r0 == 0) {
        const char* p = bb + (g + 16 * kTileBPrefetchSteps) * 128;
        for (int l = 0; l < 32; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
        if ((g & 31) == 0) _mm_prefetch(bb + g * 128 + kTilePageTouchBytes, _MM_HINT_T1);  // 32 K groups: 4 KiB of B
      }
      _tile_loadd(6, bb + g * 128, 128);
      _tile_loadd(7, bb + g * 128 + 64, 128);
      _tile_loadd(4, a0 + g * 4, row_bytes);
      Dp::c00();
      Dp::c01();
      if (two) {
        _tile_loadd(5, a1 + g * 4, row_bytes);
        Dp::c10();
        Dp::c11();
      }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
      _tile_stored(2, c + 16 * 32, 128);
      _tile_stored(3, c + 16 * 32 + 16, 128);
    }
  }
}

// C = A . B as tile_rows with B streamed from the packed weights, with the worker's tile state (or
// one of its own outside a worker).
template <class Dp, class T>
static inline void tile_block(const char* a, int64_t row_bytes, int m, const char* bb, int64_t groups, T* C) {
  TileState local;
  tile_rows<Dp>(tile_state(local), a, row_bytes, m, bb, groups, false, C, true);
}

}  // namespace
}  // namespace x86_amx
}  // namespace moepack
