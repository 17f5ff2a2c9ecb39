// [NOTE] AMX-BF16 fused-MoE kernel for layout bf16_n32k2_x86, ISA level `amx_bf16` (docs/KERNELS.md).
// Compiled with the avx512_bf16 level's flags plus -mamx-tile -mamx-bf16; registered by
// dispatch.cpp only where cpuid, XCR0 and the kernel's permission (csrc/x86/cpu_features.cpp:
// arch_prctl ARCH_REQ_XCOMP_PERM) say tiles can be used.
//
// bf16 rows, m >= kAmxMinRows: tile matrix multiply. The packed block is [Kp/2][32 columns][2]
// bf16, so 16 consecutive K pairs of 16 columns are 16 rows of 64 bytes at a stride of 128:
// exactly a B tile in the pair-interleaved ("VNNI") order tdpbf16ps takes, loaded straight from
// the packed weights (columns 0-15 at offset 0, 16-31 at offset 64). The driver keeps a chunk's
// rows consecutive (MK::kContiguousRows), so 16 rows x 16 K pairs of them are one A tile at a
// stride of Kp * 2 bytes. Tiles: C 2x2 (32 rows x 32 columns of fp32), A 2, B 2; per 16 K pairs
// 4 loads and 4 tdpbf16ps. The K pairs after the last whole 16 (Kp/2 mod 16) are added with
// vdpbf16ps, as are calls of fewer rows (decode) and fp32/fp16 inputs (avx512_common.h).
// The last row group of a call gets a tile configuration with exactly its rows
// (amx_common.h), so no tile reads or writes a row past the call's.
#if defined(MOEPACK_OMIT_LEVEL)
// setup.py found no compiler support for this level's flags: register nothing (the dispatcher
// then reports the level as a fallback).
#include "moepack/kernel.h"
namespace moepack {
void register_amx_bf16(KernelTable&) {}
}  // namespace moepack
#else
#include "amx_common.h"
#include "avx512_bf16_common.h"
#include "avx512_u4_bf16.h"
#include "avx512_f8.h"
#include "avx512_f8_bf16.h"
#include "avx512_mx4_amx.h"
#include "avx512_mx4_bf16.h"
#include "avx512_mx4_f32.h"
#include "amx_a16_decode.h"

namespace moepack {
namespace amx_bf16 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;
using namespace x86_amx;

constexpr int kAmxMinRows = 4;  // fewer rows: vdpbf16ps streams the block as well as tiles do

// Adds the K pairs [p0, npairs) of row x against the block (from pair p0 on) to C[0, 32).
static inline void add_tail_row(const uint16_t* x, const uint16_t* B, int64_t p0, int64_t npairs, float* C) {
  __m512 a0 = _mm512_loadu_ps(C), a1 = _mm512_loadu_ps(C + 16);
  const __m512i* b = reinterpret_cast<const __m512i*>(B) + 2 * p0;
  for (int64_t kk = p0; kk < npairs; ++kk, b += 2) {
    const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x + 2 * kk))));
    a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_loadu_si512(b)), xr);
    a1 = _mm512_dpbf16_ps(a1, as_bh(_mm512_loadu_si512(b + 1)), xr);
  }
  _mm512_storeu_ps(C, a0);
  _mm512_storeu_ps(C + 16, a1);
}

MOEPACK_AMX_DP(DpBf16, _tile_dpbf16ps);

// C[m, 32] = A[m, :kp] . B^T, A = m bf16 rows of kp elements at `x`, one every `stride` elements.
static void gemm_amx(const uint16_t* x, int64_t stride, int m, const uint16_t* B, int64_t kp, float* C) {
  const int64_t npairs = kp / 2, full = npairs / 16 * 16;
  tile_block<DpBf16>(reinterpret_cast<const char*>(x), stride * 2, m, reinterpret_cast<const char*>(B), full, C);
  if (full < npairs) {
    for (int i = 0; i < m; ++i) add_tail_row(x + int64_t(i) * stride, B, full, npairs, C + int64_t(i) * 32);
  }
}

// W4A16 with tiles (docs/KERNELS.md): per K group (<= kU4TileStepK values at a time), the
// block's exact (q - z) unpacked to a dense bf16 block, multiplied by tiles against the rows at
// their own stride (the rows of one call are one matrix: every row `stride` elements after the
// last), and the group's product scaled into C: C += (rows . (q - z)) * s[g, n], as the driver's
// general path computes it. False (nothing written) when the rows are not one matrix or are more
// than kU4TileMaxRows.
// The same for fp8 (gemm_f8a16_amx): decode(k1, kk, g, w) writes K [k1, k1 + kk) of group g.
constexpr int64_t kU4TileStepK = 256;
constexpr int kU4TileMaxRows = 64;
constexpr int kU4AmxMinRows = 3;  // qwen3 T=8 W4A16: 8.1-8.4 ms at 3, 9.1-9.2 ms at 2
template <class Decode>
static bool gemm_decoded_amx(const uint16_t* const* x, int m, const float* scale, int64_t gstride, int64_t kp, int64_t G,
                             float* C, Decode&& decode) {
  const int64_t stride = x[1] - x[0];
  if (m > kU4TileMaxRows || stride < kp || x[m - 1] != x[0] + int64_t(m - 1) * stride) return false;
  alignas(64) uint16_t w[kU4TileStepK * 32];
  alignas(64) float grp[kU4TileMaxRows * 32];
  const int64_t row_bytes = stride * 2;
  TileState local;
  TileState& tiles = tile_state(local);
  for (int i = 0; i < m * 32; ++i) C[i] = 0.0f;
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    for (int64_t k1 = k0; k1 < kend; k1 += kU4TileStepK) {
      const int64_t kk = kend - k1 < kU4TileStepK ? kend - k1 : kU4TileStepK;
      decode(k1, kk, g, w);
      const int64_t npairs = kk / 2, full = npairs / 16 * 16;
      tile_rows<DpBf16>(tiles, reinterpret_cast<const char*>(x[0] + k1), row_bytes, m, reinterpret_cast<const char*>(w), full,
                        k1 != k0, grp);
      if (full < npairs) {  // the K pairs after the last whole 16: vdpbf16ps per row
        for (int i = 0; i < m; ++i) add_tail_row(x[i] + k1, w, full, npairs, grp + int64_t(i) * 32);
      }
    }
    const float* sc = scale + g * gstride;
    const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);
    for (int i = 0; i < m; ++i) {
      float* ci = C + int64_t(i) * 32;
      const float* p = grp + int64_t(i) * 32;
      _mm512_storeu_ps(ci, _mm512_fmadd_ps(_mm512_loadu_ps(p), s0, _mm512_loadu_ps(ci)));
      _mm512_storeu_ps(ci + 16, _mm512_fmadd_ps(_mm512_loadu_ps(p + 16), s1, _mm512_loadu_ps(ci + 16)));
    }
  }
  return true;
}
static bool gemm_u4a16_amx(const uint16_t* const* x, int m, const uint8_t* codes, const float* scale,
                           const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, float* C) {
  return gemm_decoded_amx(x, m, scale, gstride, kp, G, C, [&](int64_t k1, int64_t kk, int64_t g, uint16_t* w) {
    x86_avx512_u4::unpack_u4_avx512(codes, k1, kk, zero + g * gstride, w);
  });
}
static bool gemm_f8a16_amx(const uint16_t* const* x, int m, const uint8_t* codes, const float* scale, int64_t gstride,
                           int64_t kp, int64_t G, float* C) {
  return gemm_decoded_amx(x, m, scale, gstride, kp, G, C, [&](int64_t k1, int64_t kk, int64_t, uint16_t* w) {
    x86_avx512_f8::unpack_f8_avx512(codes + k1 * 32, kk * 32, w);
  });
}
constexpr int kF8AmxMinRows = 3;
constexpr int kMx4AmxMinRows = 3;  // as int4 W4A16: from 3 rows one decode for all rows beats one per row pair
// int4 W4A16, 2..4 rows (the row memo's): the decode into B tiles in registers
// (amx_a16_decode.h). One row: vdpbf16ps (tools/bench_a16_tile.cpp, docs/BENCH.md "What bounds
// W4A16 decode"). mxfp4's two rows stay on the few-row kernels (fp32 FMAs or vdpbf16ps: the
// same decode into tiles gave nothing end to end; docs/KERNELS.md "W4A16 decode through tiles").
constexpr int kU4AmxDecMinRows = 2;

struct MK : Avx512Base {
  // The schemes whose few-row (decode) kernels here read decode_one_stream(): Variant::streams
  // (register.inc variant_knobs).
  static constexpr uint32_t kStreamsSchemes = (1u << kScheme_dense) | (1u << kScheme_int4_group) | (1u << kScheme_fp8_block) | (1u << kScheme_mxfp4) |
                                               (1u << kScheme_nvfp4);
  static constexpr uint32_t kPfSchemes = kStreamsSchemes;  // for_k_streams' prefetch distance (Variant::pf)
  static constexpr uint32_t kDotSchemes = 1u << kScheme_mxfp4;  // mx4_a16_fp32(): Variant::dot
  static constexpr uint32_t kHooks = Avx512Base::kHooks | kHook_unpack_u4 | kHook_gemm_u4a16 | kHook_unpack_f8 |
                                     kHook_gemm_f8a16 | kHook_unpack_mx4 | kHook_gemm_mx4a16 | kHook_gemm_nv4a16;
  static constexpr bool kContiguousRows = true;  // the driver keeps a chunk's rows consecutive
  using WorkerScope = TileScope;  // one tile configuration per driver worker (amx_common.h)
  static RowFormat row_format(DType d) { return d == DType::bf16 ? RowFormat::bf16 : RowFormat::f32; }

  // C[m, 32] = A[m, :kp] . B^T for one 32-column block; rows are bf16 bits or fp32 as
  // row_format(dtype) chose; m <= kChunkM.
  static void gemm(const LayoutDesc& L, RowFormat fmt, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
    if (fmt != RowFormat::bf16) return Avx512Base::gemm(L, fmt, rows, m, B, kp, C);
    const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
    // Tiles need the rows as one matrix (one row every `stride` >= kp elements): the driver's
    // promise, checked (two compares) so that a caller that breaks it gets the vdpbf16ps kernel,
    // not wrong rows.
    if (m < kAmxMinRows) return gemm_bf16_rows(x, m, B, kp, C);
    const int64_t stride = x[1] - x[0];
    if (stride < kp || x[m - 1] != x[0] + int64_t(m - 1) * stride) return gemm_bf16_rows(x, m, B, kp, C);
    gemm_amx(x[0], stride, m, B, kp, C);
  }

  // One bf16 row against stage 1's gate and up blocks at once (Variant::pair); fp32 rows: not here.
  static bool gemm_pair1(RowFormat fmt, const void* row, const uint16_t* Bg, const uint16_t* Bu, int64_t kp, float* Cg,
                         float* Cu) {
    if (fmt != RowFormat::bf16) return false;
    x86_avx512_bf16::gemm_bf16_pair_row(static_cast<const uint16_t*>(row), Bg, Bu, kp, Cg, Cu);
    return true;
  }

  // int4_group layouts (W4A16): the unpack to dense bf16 blocks; one bf16 row straight from the
  // codes (avx512_u4_bf16.h), 2-4 through tiles fed by that decode (amx_a16_decode.h), more
  // through tiles over the unpacked block, one K group at a time (gemm_u4a16_amx).
  static void unpack_u4(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
    x86_avx512_u4::unpack_u4_avx512(codes, k0, kk, z, out);
  }
  // fp8_block layouts (W8A16): the exact table decode to the dense bf16 block (avx512_f8.h).
  static void unpack_f8(const uint8_t* codes, int64_t n, uint16_t* out) { x86_avx512_f8::unpack_f8_avx512(codes, n, out); }
  // ... few bf16 rows straight from the codes (avx512_f8_bf16.h), more through tiles a K group at a time.
  static bool gemm_f8a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const float* scale,
                         int64_t gstride, int64_t kp, int64_t G, float* C) {
    if (fmt == RowFormat::bf16 && m >= kF8AmxMinRows &&
        gemm_f8a16_amx(reinterpret_cast<const uint16_t* const*>(rows), m, codes, scale, gstride, kp, G, C)) {
      return true;
    }
    return x86_avx512_f8_bf16::gemm_f8a16_bf16(fmt, rows, m, codes, scale, gstride, kp, G, C);
  }
  using U4A16Memo = x86_avx512_u4_bf16::U4A16Rows;
  static bool gemm_u4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const float* scale,
                         const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, float* C, void* memo) {
    // 2..kAmxDecMaxRows rows: the codes decoded in registers into B tiles (amx_a16_decode.h);
    // tools/bench_a16_tile.cpp, one thread, cycles per 128 code bytes in L2 / from DRAM: 2 rows
    // 34 / 57 against 47 / 65 (vdpbf16ps); 4 rows 36 / 58 against 42 / 72 (unpack + tiles).
    // One row stays with vdpbf16ps (29 against 32: the tile steps' stores cost what its dot
    // products do). docs/KERNELS.md "W4A16 decode through tiles".
    if (m >= kU4AmxDecMinRows &&
        x86_amx_a16_decode::gemm_u4a16_amxdec(fmt, rows, m, codes, scale, zero, gstride, kp, G, C,
                                              static_cast<U4A16Memo*>(memo))) {
      return true;
    }
    // From kU4AmxMinRows rows the tiles win: the unpack decodes each code once for all rows (the
    // decode kernel decodes it once per row pair), and the tiles' products cost next to nothing.
    if (fmt == RowFormat::bf16 && m >= kU4AmxMinRows &&
        gemm_u4a16_amx(reinterpret_cast<const uint16_t* const*>(rows), m, codes, scale, zero, gstride, kp, G, C)) {
      return true;
    }
    return x86_avx512_u4_bf16::gemm_u4a16_bf16(fmt, rows, m, codes, scale, zero, gstride, kp, G, C,
                                               static_cast<U4A16Memo*>(memo));
  }

  // mxfp4 layout (W4A16): the exact table decode to the dense bf16 block (avx512_mx4_common.h), few
  // rows straight from the codes (avx512_mx4_f32.h's fp32 FMAs for fp32 rows, and for bf16 rows
  // where mx4_a16_fp32(); else avx512_mx4_bf16.h's vdpbf16ps), more through tiles over the whole K
  // with the scales folded into the decoded weights where that is exact (avx512_mx4_amx.h; blocks
  // with extreme scales take the grouped path: unpack_mx4, tiles per group, the scale after).
  static void unpack_mx4(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
    x86_avx512_mx4::unpack_mx4_avx512(codes, k0, kk, out);
  }
  using Mx4A16Memo = x86_avx512_mx4_f32::Mx4A16Rows;
  static bool gemm_mx4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                          int64_t gstride, int64_t kp, float* C, void* memo) {
    if (fmt == RowFormat::bf16 && m >= kMx4AmxMinRows &&
        x86_avx512_mx4_amx::gemm_mx4a16_amx(reinterpret_cast<const uint16_t* const*>(rows), m, codes, scale, gstride, kp, C)) {
      return true;
    }
    // fp32 rows: always fp32 FMAs (no vdpbf16ps for them); bf16 rows: the process's choice
    if ((fmt == RowFormat::f32 || mx4_a16_fp32()) &&
        x86_avx512_mx4_f32::gemm_mx4a16_f32(fmt, rows, m, codes, scale, gstride, kp, C, static_cast<Mx4A16Memo*>(memo))) {
      return true;
    }
    return x86_avx512_mx4_bf16::gemm_mx4a16_bf16(fmt, rows, m, codes, scale, gstride, kp, C);
  }
  // nvfp4 layout (W4A16): the mxfp4 fp32-FMA kernel over groups of 16 with e4m3 scales (avx512_mx4_f32.h,
  // its rows memo), up to 4 rows; more take the grouped path (unpack_mx4, 16 K at a time).
  using Nv4A16Memo = x86_avx512_mx4_f32::Mx4A16Rows;
  static bool gemm_nv4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                          const float* global, int64_t gstride, int64_t kp, int64_t G, float* C, void* memo) {
    return x86_avx512_mx4_f32::gemm_nv4a16_f32(fmt, rows, m, codes, scale, global, gstride, kp, G, C,
                                              static_cast<Nv4A16Memo*>(memo));
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace amx_bf16

void register_amx_bf16(KernelTable& t) { amx_bf16::register_level<Isa::amx_bf16>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
