// [NOTE] The optional micro-kernel hooks: one named signature each, written here once.
//
// A micro-kernel struct (`MK` of an ISA file) gets a scheme by registering it and speed by adding
// hooks: members the driver calls instead of its portable code. Each MK states the hooks it
// provides in `static constexpr uint32_t kHooks` (a set of MkHook bits); the driver calls a hook
// only when it is stated, and check_mk_hooks<MK>() (static_asserted by the driver for every ISA
// file) fails the build when
//   - a stated hook does not have its signature here (exact: the member must convert to the
//     function pointer type below, so an added or changed parameter is an error, not a silently
//     unused overload), or
//   - an MK has a member of a hook's name that it does not state (it would never run).
// Why: the hooks used to be found by `if constexpr (requires {...})`; when gemm_u4a16 grew its
// RowMemo argument, the AVX2 one with the old signature stopped matching and its one-row W4A16
// decode kernel silently never ran again (issue 27).
//
// tests/cpp builds with MOEPACK_COUNT_HOOKS: every hook call is counted per ISA object, and
// test_hooks_run checks that each hook a level states (for the schemes it registers) ran.
#pragma once
#include <cstdint>

#include "moepack/kernel.h"
#include "f8_table.h"  // kF8Bf16: what unpack_f8 produces

namespace moepack {

enum MkHook : uint32_t {
  kHook_gemm_prefetch = 1u << 0,     // dense A16: gemm with the next block to prefetch
  kHook_gemm_i8_prefetch = 1u << 1,  // int8 A8: gemm_i8 with the next block to prefetch
  kHook_quantize_row_i8 = 1u << 2,   // A8 rows: the vectorized per-row quantizer
  kHook_unpack_u4 = 1u << 3,         // int4 A16: a K slice of codes -> the MK's dense bf16 block
  kHook_dot_u4_s8 = 1u << 4,         // int4 A8: the exact integer core of one block
  kHook_gemm_u4a16 = 1u << 5,        // int4 A16: the whole block (may decline: returns false)
  kHook_gemm_u4a8 = 1u << 6,         // int4 A8: the whole block
  kHook_unpack_f8 = 1u << 7,         // fp8 A16: n e4m3fn codes -> n bf16 (exact: kF8Bf16)
  kHook_gemm_f8a16 = 1u << 8,        // fp8 A16: the whole block (may decline: returns false)
  kHook_unpack_mx4 = 1u << 9,        // mxfp4 A16: a K slice of codes -> the MK's dense bf16 block
  kHook_gemm_mx4a16 = 1u << 10,      // mxfp4 A16: the whole block (may decline: returns false)
  kHook_dot_mx4_s8 = 1u << 11,       // mxfp4 A8: the exact integer core of one block
  kHook_gemm_mx4a8 = 1u << 12,       // mxfp4 A8: the whole block
};
constexpr int kNumMkHooks = 13;
constexpr const char* kMkHookNames[kNumMkHooks] = {"gemm_prefetch", "gemm_i8_prefetch", "quantize_row_i8", "unpack_u4",
                                                   "dot_u4_s8",     "gemm_u4a16",       "gemm_u4a8",       "unpack_f8",
                                                   "gemm_f8a16",    "unpack_mx4",       "gemm_mx4a16",     "dot_mx4_s8",
                                                   "gemm_mx4a8"};
static constexpr int mk_hook_index(uint32_t bit) {
  int i = 0;
  while (bit > 1u) bit >>= 1, ++i;
  return i;
}

// ---- the signatures ---------------------------------------------------------------------------
// gemm(L, fmt, rows, m, B, kp, C, next, next_bytes): DenseA16's gemm, also prefetching
// next_bytes of the worker's next block `next` (null: none) while this one computes.
using HookGemmPrefetch = void(const LayoutDesc&, RowFormat, const void* const*, int, const uint16_t*, int64_t, float*,
                              const char*, int64_t);
// gemm_i8(L, rows, m, B, kp, colsum, acc, next, next_bytes): Int8A8's gemm_i8, prefetching likewise.
using HookGemmI8Prefetch = void(const LayoutDesc&, const int8_t* const*, int, const int8_t*, int64_t, const int32_t*,
                                int32_t*, const char*, int64_t);
// quantize_row_i8(v, n, np, q, flip) -> scale: bit for bit the driver's quantize_row_i8.
using HookQuantizeRowI8 = float(const float*, int64_t, int64_t, int8_t*, uint8_t);
// unpack_u4(codes, k0, kk, z, out): K [k0, k0 + kk) of one u4 block (MK::kU4Blocking) -> the
// dense bf16 block (MK's dense format) of (q - z[n]), exact.
using HookUnpackU4 = void(const uint8_t*, int64_t, int64_t, const uint8_t*, uint16_t*);
// dot_u4_s8(rows, m, codes, k0, kk, acc): acc[i * block_n + n] = sum over K [k0, k0 + kk) of
// rows[i][k] * q[n][k], exact.
using HookDotU4S8 = void(const int8_t* const*, int, const uint8_t*, int64_t, int64_t, int32_t*);
// gemm_u4a16(fmt, rows, m, codes, scale, zero, group_stride, kp, G, C, memo) -> taken: fp32
// C[m, block_n] of one block; false leaves the call to the grouped-decode path. memo: the
// worker's S::RowMemo (MK::U4A16Memo), or null.
using HookGemmU4A16 = bool(RowFormat, const void* const*, int, const uint8_t*, const float*, const uint8_t*, int64_t,
                           int64_t, int64_t, float*, void*);
// gemm_u4a8(rows, row_scales, m, codes, scale, zero, group_stride, kp, G, xsum, C): fp32
// C[m, block_n] of one block, in the order of the grouped-decode path (docs/SEMANTICS.md §3).
using HookGemmU4A8 = void(const int8_t* const*, const float*, int, const uint8_t*, const float*, const uint8_t*, int64_t,
                          int64_t, int64_t, const int32_t*, float*);
// unpack_f8(codes, n, out): out[i] = kF8Bf16.v[codes[i]] for i < n (any n >= 0), bit for bit
// (NaN codes included). The f8 layouts are blocked like MK's dense bf16 block (block_n x
// kDenseKPack), so a K slice of a block decodes element-wise, in place order.
using HookUnpackF8 = void(const uint8_t*, int64_t, uint16_t*);
// gemm_f8a16(fmt, rows, m, codes, scale, group_stride, kp, G, C) -> taken: fp32 C[m, block_n] of
// one f8 block, C = sum over K groups g of (rows . fp8(q)) * s[g, n]; false leaves the call to
// the grouped-decode path.
using HookGemmF8A16 = bool(RowFormat, const void* const*, int, const uint8_t*, const float*, int64_t, int64_t, int64_t,
                           float*);
// The mxfp4 hooks read the blocking MK::kU4Blocking declares (the mx4 layout puts its nibbles
// where the u4 layouts put theirs); e8m0 scales are bytes e: 2^(e - 127), e = 255 never reaches a
// kernel (refused at convert and open). kMx4Bf16 (codec_mx4.inc) is the exact value table.
// unpack_mx4(codes, k0, kk, out): K [k0, k0 + kk) (multiples of k_pack) of one mx4 block -> the
// dense bf16 block (MK's dense format) of the unscaled values e2m1(q), exact (kMx4Bf16).
using HookUnpackMx4 = void(const uint8_t*, int64_t, int64_t, uint16_t*);
// gemm_mx4a16(fmt, rows, m, codes, scale, group_stride, kp, C, memo) -> taken: fp32 C[m, block_n]
// of one block, C = sum over the K groups g of 32 (any fp32 summation order) of (rows . e2m1(q_g)) *
// 2^(e[g, n] - 127), the scale applied in fp32 after each group's dot product or folded into the
// bf16 weight where that is exact (never where the weight would be a bf16 subnormal); false leaves the call to the
// grouped-decode path. memo: the worker's S::RowMemo (MK::Mx4A16Memo), or null.
using HookGemmMx4A16 = bool(RowFormat, const void* const*, int, const uint8_t*, const uint8_t*, int64_t, int64_t, float*,
                            void*);
// dot_mx4_s8(rows, m, codes, k0, kk, acc): acc[i * block_n + n] = sum over K [k0, k0 + kk) of
// rows[i][k] * 2 * e2m1(q[n][k]) (an integer -12..12), exact.
using HookDotMx4S8 = void(const int8_t* const*, int, const uint8_t*, int64_t, int64_t, int32_t*);
// The s8 row sums per K group of an A8 block call, made when a kernel first asks for them:
// get()[i * ng + g] = row i's s8 sum over group g (ng = ceil(kp / G)). The grouped-decode driver
// (GroupedA8, its per-worker memo A8RowSums) hands a mxfp4 kernel this instead of the sums: the
// kernels that offset the weights to unsigned bytes read them, amx_int8's folded tile pass
// (signed weights) does not, and summing every row there cost ~10% of a W4A8 T=512 call.
struct A8Sums {
  using MakeFn = const int32_t*(void* memo, const int8_t* const* x, int m, int64_t kp, int64_t G);
  MakeFn* make = nullptr;
  void* memo = nullptr;
  const int8_t* const* x = nullptr;
  int m = 0;
  int64_t kp = 0, G = 0;
  mutable const int32_t* sums = nullptr;  // made by the first get()
  const int32_t* get() const {
    if (!sums) sums = make(memo, x, m, kp, G);
    return sums;
  }
};
// gemm_mx4a8(rows, row_scales, m, codes, scale, group_stride, kp, xsum, C): fp32 C[m, block_n] of
// one block, C = row_scale * sum over groups g (in order) of float(acc_g) * 2^(e[g, n] - 128),
// acc_g = dot_mx4_s8 over the group; xsum: the rows' s8 sums per group of 32 (A8Sums: for kernels
// that offset the weights to unsigned bytes; asked for only where read).
using HookGemmMx4A8 = void(const int8_t* const*, const float*, int, const uint8_t*, const uint8_t*, int64_t, int64_t,
                           const A8Sums&, float*);

// ---- one concept per hook: M's member converts to the exact signature -------------------------
template <class M>
concept MkGemmPrefetch = requires { static_cast<HookGemmPrefetch*>(&M::gemm); };
template <class M>
concept MkGemmI8Prefetch = requires { static_cast<HookGemmI8Prefetch*>(&M::gemm_i8); };
template <class M>
concept MkQuantizeRowI8 = requires { static_cast<HookQuantizeRowI8*>(&M::quantize_row_i8); };
template <class M>
concept MkUnpackU4 = requires { static_cast<HookUnpackU4*>(&M::unpack_u4); };
template <class M>
concept MkDotU4S8 = requires { static_cast<HookDotU4S8*>(&M::dot_u4_s8); };
template <class M>
concept MkGemmU4A16 = requires { static_cast<HookGemmU4A16*>(&M::gemm_u4a16); };
template <class M>
concept MkGemmU4A8 = requires { static_cast<HookGemmU4A8*>(&M::gemm_u4a8); };
template <class M>
concept MkUnpackF8 = requires { static_cast<HookUnpackF8*>(&M::unpack_f8); };
template <class M>
concept MkGemmF8A16 = requires { static_cast<HookGemmF8A16*>(&M::gemm_f8a16); };
template <class M>
concept MkUnpackMx4 = requires { static_cast<HookUnpackMx4*>(&M::unpack_mx4); };
template <class M>
concept MkGemmMx4A16 = requires { static_cast<HookGemmMx4A16*>(&M::gemm_mx4a16); };
template <class M>
concept MkDotMx4S8 = requires { static_cast<HookDotMx4S8*>(&M::dot_mx4_s8); };
template <class M>
concept MkGemmMx4A8 = requires { static_cast<HookGemmMx4A8*>(&M::gemm_mx4a8); };

// The hooks M states (every MK declares kHooks; the scalar one states none).
template <class M>
constexpr uint32_t mk_hooks() {
  return M::kHooks;
}
template <class M>
constexpr bool mk_states(uint32_t hook) {
  return (M::kHooks & hook) != 0;
}

// Fails the build (static_assert messages name the hook and the rule) where M's statement and
// its members disagree. A member whose name is a hook's but that is not stated is an error too;
// gemm / gemm_i8 are required members, so only their prefetching forms count as the hooks.
template <class M>
constexpr bool check_mk_hooks() {
  static_assert(!mk_states<M>(kHook_gemm_prefetch) || MkGemmPrefetch<M>,
                "MK states kHook_gemm_prefetch but its gemm is not HookGemmPrefetch (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_gemm_prefetch) || !MkGemmPrefetch<M>,
                "MK's gemm takes the prefetch arguments but MK does not state kHook_gemm_prefetch");
  static_assert(!mk_states<M>(kHook_gemm_i8_prefetch) || MkGemmI8Prefetch<M>,
                "MK states kHook_gemm_i8_prefetch but its gemm_i8 is not HookGemmI8Prefetch (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_gemm_i8_prefetch) || !MkGemmI8Prefetch<M>,
                "MK's gemm_i8 takes the prefetch arguments but MK does not state kHook_gemm_i8_prefetch");
  static_assert(!mk_states<M>(kHook_quantize_row_i8) || MkQuantizeRowI8<M>,
                "MK states kHook_quantize_row_i8 but quantize_row_i8 is not HookQuantizeRowI8 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_quantize_row_i8) || !requires { &M::quantize_row_i8; },
                "MK has a quantize_row_i8 but does not state kHook_quantize_row_i8 in kHooks");
  static_assert(!mk_states<M>(kHook_unpack_u4) || MkUnpackU4<M>,
                "MK states kHook_unpack_u4 but unpack_u4 is not HookUnpackU4 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_unpack_u4) || !requires { &M::unpack_u4; },
                "MK has an unpack_u4 but does not state kHook_unpack_u4 in kHooks");
  static_assert(!mk_states<M>(kHook_dot_u4_s8) || MkDotU4S8<M>,
                "MK states kHook_dot_u4_s8 but dot_u4_s8 is not HookDotU4S8 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_dot_u4_s8) || !requires { &M::dot_u4_s8; },
                "MK has a dot_u4_s8 but does not state kHook_dot_u4_s8 in kHooks");
  static_assert(!mk_states<M>(kHook_gemm_u4a16) || MkGemmU4A16<M>,
                "MK states kHook_gemm_u4a16 but gemm_u4a16 is not HookGemmU4A16 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_gemm_u4a16) || !requires { &M::gemm_u4a16; },
                "MK has a gemm_u4a16 but does not state kHook_gemm_u4a16 in kHooks");
  static_assert(!mk_states<M>(kHook_gemm_u4a8) || MkGemmU4A8<M>,
                "MK states kHook_gemm_u4a8 but gemm_u4a8 is not HookGemmU4A8 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_gemm_u4a8) || !requires { &M::gemm_u4a8; },
                "MK has a gemm_u4a8 but does not state kHook_gemm_u4a8 in kHooks");
  static_assert(!mk_states<M>(kHook_unpack_f8) || MkUnpackF8<M>,
                "MK states kHook_unpack_f8 but unpack_f8 is not HookUnpackF8 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_unpack_f8) || !requires { &M::unpack_f8; },
                "MK has an unpack_f8 but does not state kHook_unpack_f8 in kHooks");
  static_assert(!mk_states<M>(kHook_gemm_f8a16) || MkGemmF8A16<M>,
                "MK states kHook_gemm_f8a16 but gemm_f8a16 is not HookGemmF8A16 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_gemm_f8a16) || !requires { &M::gemm_f8a16; },
                "MK has a gemm_f8a16 but does not state kHook_gemm_f8a16 in kHooks");
  static_assert(!mk_states<M>(kHook_unpack_mx4) || MkUnpackMx4<M>,
                "MK states kHook_unpack_mx4 but unpack_mx4 is not HookUnpackMx4 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_unpack_mx4) || !requires { &M::unpack_mx4; },
                "MK has an unpack_mx4 but does not state kHook_unpack_mx4 in kHooks");
  static_assert(!mk_states<M>(kHook_gemm_mx4a16) || MkGemmMx4A16<M>,
                "MK states kHook_gemm_mx4a16 but gemm_mx4a16 is not HookGemmMx4A16 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_gemm_mx4a16) || !requires { &M::gemm_mx4a16; },
                "MK has a gemm_mx4a16 but does not state kHook_gemm_mx4a16 in kHooks");
  static_assert(!mk_states<M>(kHook_dot_mx4_s8) || MkDotMx4S8<M>,
                "MK states kHook_dot_mx4_s8 but dot_mx4_s8 is not HookDotMx4S8 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_dot_mx4_s8) || !requires { &M::dot_mx4_s8; },
                "MK has a dot_mx4_s8 but does not state kHook_dot_mx4_s8 in kHooks");
  static_assert(!mk_states<M>(kHook_gemm_mx4a8) || MkGemmMx4A8<M>,
                "MK states kHook_gemm_mx4a8 but gemm_mx4a8 is not HookGemmMx4A8 (csrc/kernels/mk_hooks.h)");
  static_assert(mk_states<M>(kHook_gemm_mx4a8) || !requires { &M::gemm_mx4a8; },
                "MK has a gemm_mx4a8 but does not state kHook_gemm_mx4a8 in kHooks");
  return true;
}

}  // namespace moepack
