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
    _tile_loadconfig(&c);
    loaded = rows;
  }
  ~TileState() {
    if (loaded >= 0) _tile_release();
  }
};

}  // namespace
}  // namespace x86_amx
}  // namespace moepack
