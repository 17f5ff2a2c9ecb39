// [NOTE] The optional micro-kernel hooks: one table, MOEPACK_MK_HOOKS below, names each hook and
// its signature once; the MkHook bits, their names, the signatures, the concepts and the build
// checks all come from it.
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
#include <string_view>

#include "moepack/kernel.h"
#include "f8_table.h"  // kF8Bf16: what unpack_f8 produces

namespace moepack {

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

// ---- the hooks: what each one computes ---------------------------------------------------------
// gemm_prefetch       dense A16. gemm(L, fmt, rows, m, B, kp, C, next, next_bytes): DenseA16's gemm,
//                     also prefetching next_bytes of the worker's next block `next` (null: none)
//                     while this one computes.
// gemm_i8_prefetch    int8 A8. gemm_i8(L, rows, m, B, kp, colsum, acc, next, next_bytes): Int8A8's
//                     gemm_i8, prefetching likewise.
// quantize_row_i8     A8 rows. quantize_row_i8(v, n, np, q, flip) -> scale: bit for bit the
//                     driver's quantize_row_i8.
// unpack_u4           int4 A16. unpack_u4(codes, k0, kk, z, out): K [k0, k0 + kk) of one u4 block
//                     (MK::kU4Blocking) -> the dense bf16 block (MK's dense format) of (q - z[n]), exact.
// dot_u4_s8           int4 A8. dot_u4_s8(rows, m, codes, k0, kk, acc): acc[i * block_n + n] = sum
//                     over K [k0, k0 + kk) of rows[i][k] * q[n][k], exact.
// gemm_u4a16          int4 A16. gemm_u4a16(fmt, rows, m, codes, scale, zero, group_stride, kp, G, C,
//                     memo) -> taken: fp32 C[m, block_n] of one block; false leaves the call to the
//                     grouped-decode path. memo: the worker's S::RowMemo (MK::U4A16Memo), or null.
// gemm_u4a8           int4 A8. gemm_u4a8(rows, row_scales, m, codes, scale, zero, group_stride, kp, G,
//                     xsum, C): fp32 C[m, block_n] of one block, in the order of the grouped-decode
//                     path (docs/SEMANTICS.md §3).
// unpack_f8           fp8 A16. unpack_f8(codes, n, out): out[i] = kF8Bf16.v[codes[i]] for i < n (any
//                     n >= 0), bit for bit (NaN codes included). The f8 layouts are blocked like MK's
//                     dense bf16 block (block_n x kDenseKPack), so a K slice of a block decodes
//                     element-wise, in place order.
// gemm_f8a16          fp8 A16. gemm_f8a16(fmt, rows, m, codes, scale, group_stride, kp, G, C) ->
//                     taken: fp32 C[m, block_n] of one f8 block, C = sum over K groups g of
//                     (rows . fp8(q)) * s[g, n]; false leaves the call to the grouped-decode path.
// The mxfp4 hooks read the blocking MK::kU4Blocking declares (the mx4 layout puts its nibbles
// where the u4 layouts put theirs); e8m0 scales are bytes e: 2^(e - 127), e = 255 never reaches a
// kernel (refused at convert and open). kMx4Bf16 (codec_mx4.inc) is the exact value table.
// unpack_mx4          mxfp4 A16. unpack_mx4(codes, k0, kk, out): K [k0, k0 + kk) (multiples of
//                     k_pack) of one mx4 block -> the dense bf16 block (MK's dense format) of the
//                     unscaled values e2m1(q), exact (kMx4Bf16).
// gemm_mx4a16         mxfp4 A16. gemm_mx4a16(fmt, rows, m, codes, scale, group_stride, kp, C, memo)
//                     -> taken: fp32 C[m, block_n] of one block, C = sum over the K groups g of 32
//                     (any fp32 summation order) of (rows . e2m1(q_g)) * 2^(e[g, n] - 127), the scale
//                     applied in fp32 after each group's dot product or folded into the bf16 weight
//                     where that is exact (never where the weight would be a bf16 subnormal); false
//                     leaves the call to the grouped-decode path. memo: the worker's S::RowMemo
//                     (MK::Mx4A16Memo), or null.
// dot_mx4_s8          mxfp4 A8. dot_mx4_s8(rows, m, codes, k0, kk, acc): acc[i * block_n + n] = sum
//                     over K [k0, k0 + kk) of rows[i][k] * 2 * e2m1(q[n][k]) (an integer -12..12), exact.
// gemm_mx4a8          mxfp4 A8. gemm_mx4a8(rows, row_scales, m, codes, scale, group_stride, kp, xsum,
//                     C): fp32 C[m, block_n] of one block, C = row_scale * sum over groups g (in
//                     order) of float(acc_g) * 2^(e[g, n] - 128), acc_g = dot_mx4_s8 over the group;
//                     xsum: the rows' s8 sums per group of 32 (A8Sums: for kernels that offset the
//                     weights to unsigned bytes; asked for only where read).
// The nvfp4 hooks read the mx4 blocking too (MK::kU4Blocking) with one e4m3fn byte c per (K group
// of G = 16, column) and the block's per-column fp32 globals gl; the group's scale s[g, n] is
// codec_nvfp4.inc's nv4_group_scale(c, gl[n]) (fp32(e4m3(c) / g) for g > 0, fp32(e4m3(c) * -g)
// else), bit for bit. Both decline (return false, nothing written) a call they do not take (G other
// than 16 among them), leaving it to the grouped-decode path.
// gemm_nv4a16         nvfp4 A16. gemm_nv4a16(fmt, rows, m, codes, scale, global, group_stride, kp, G, C,
//                     memo) -> taken: fp32 C[m, block_n] of one block, C = sum over the K groups g (any
//                     fp32 summation order) of (rows . e2m1(q_g)) * s[g, n], the scale applied in fp32
//                     after each group's dot product. memo: the worker's S::RowMemo (MK::Nv4A16Memo), or
//                     null.
// gemm_nv4a8          nvfp4 A8. gemm_nv4a8(rows, row_scales, m, codes, scale, global, group_stride, kp, G,
//                     xsum, C) -> taken: fp32 C[m, block_n] of one block, C = row_scale * sum over groups g
//                     (in order) of float(acc_g) * (s[g, n] * 0.5), acc_g = dot_mx4_s8 over the group (the
//                     grouped-decode path's operations in its order); xsum as gemm_mx4a8's.

// ---- the table ---------------------------------------------------------------------------------
// X(name, member, return type, (parameters)), in MkHook bit order: the hook kHook_<name> is MK's
// static member `member` with signature Hook_<name> = return type(parameters). A hook whose member
// is also a required member of its scheme (gemm, gemm_i8) is that member with more parameters.
#define MOEPACK_MK_HOOKS(X)                                                                                           \
  X(gemm_prefetch, gemm, void,                                                                                        \
    (const LayoutDesc&, RowFormat, const void* const*, int, const uint16_t*, int64_t, float*, const char*, int64_t))  \
  X(gemm_i8_prefetch, gemm_i8, void,                                                                                  \
    (const LayoutDesc&, const int8_t* const*, int, const int8_t*, int64_t, const int32_t*, int32_t*, const char*,     \
     int64_t))                                                                                                        \
  X(quantize_row_i8, quantize_row_i8, float, (const float*, int64_t, int64_t, int8_t*, uint8_t))                      \
  X(unpack_u4, unpack_u4, void, (const uint8_t*, int64_t, int64_t, const uint8_t*, uint16_t*))                        \
  X(dot_u4_s8, dot_u4_s8, void, (const int8_t* const*, int, const uint8_t*, int64_t, int64_t, int32_t*))              \
  X(gemm_u4a16, gemm_u4a16, bool,                                                                                     \
    (RowFormat, const void* const*, int, const uint8_t*, const float*, const uint8_t*, int64_t, int64_t, int64_t,     \
     float*, void*))                                                                                                  \
  X(gemm_u4a8, gemm_u4a8, void,                                                                                       \
    (const int8_t* const*, const float*, int, const uint8_t*, const float*, const uint8_t*, int64_t, int64_t,         \
     int64_t, const int32_t*, float*))                                                                                \
  X(unpack_f8, unpack_f8, void, (const uint8_t*, int64_t, uint16_t*))                                                 \
  X(gemm_f8a16, gemm_f8a16, bool,                                                                                     \
    (RowFormat, const void* const*, int, const uint8_t*, const float*, int64_t, int64_t, int64_t, float*))            \
  X(unpack_mx4, unpack_mx4, void, (const uint8_t*, int64_t, int64_t, uint16_t*))                                      \
  X(gemm_mx4a16, gemm_mx4a16, bool,                                                                                   \
    (RowFormat, const void* const*, int, const uint8_t*, const uint8_t*, int64_t, int64_t, float*, void*))            \
  X(dot_mx4_s8, dot_mx4_s8, void, (const int8_t* const*, int, const uint8_t*, int64_t, int64_t, int32_t*))            \
  X(gemm_mx4a8, gemm_mx4a8, void,                                                                                     \
    (const int8_t* const*, const float*, int, const uint8_t*, const uint8_t*, int64_t, int64_t, const A8Sums&,        \
     float*))                                                                                                         \
  X(gemm_nv4a16, gemm_nv4a16, bool,                                                                                   \
    (RowFormat, const void* const*, int, const uint8_t*, const uint8_t*, const float*, int64_t, int64_t, int64_t,     \
     float*, void*))                                                                                                  \
  X(gemm_nv4a8, gemm_nv4a8, bool,                                                                                     \
    (const int8_t* const*, const float*, int, const uint8_t*, const uint8_t*, const float*, int64_t, int64_t,         \
     int64_t, const A8Sums&, float*))

// ---- what comes from it ------------------------------------------------------------------------
// kHookIndex_<name>: the bit index; kHook_<name>: the bit; kMkHookNames: the names, for tests.
#define MOEPACK_MK_HOOK_INDEX(name, member, ret, params) kHookIndex_##name,
enum MkHookIndex : int { MOEPACK_MK_HOOKS(MOEPACK_MK_HOOK_INDEX) kHookIndexEnd };
#undef MOEPACK_MK_HOOK_INDEX
constexpr int kNumMkHooks = kHookIndexEnd;
#define MOEPACK_MK_HOOK_BIT(name, member, ret, params) kHook_##name = 1u << kHookIndex_##name,
enum MkHook : uint32_t { MOEPACK_MK_HOOKS(MOEPACK_MK_HOOK_BIT) };
#undef MOEPACK_MK_HOOK_BIT
#define MOEPACK_MK_HOOK_NAME(name, member, ret, params) #name,
constexpr const char* kMkHookNames[kNumMkHooks] = {MOEPACK_MK_HOOKS(MOEPACK_MK_HOOK_NAME)};
#undef MOEPACK_MK_HOOK_NAME
static constexpr int mk_hook_index(uint32_t bit) {
  int i = 0;
  while (bit > 1u) bit >>= 1, ++i;
  return i;
}

// Hook_<name>: the signature. HasHook_<name><M>: M's member converts to it exactly.
// mk_hook_member_<name><M>(): M has a member that would be the hook, whatever its signature (a
// member only the hook has: any member of that name; gemm / gemm_i8, required of their schemes:
// only the hook's signature).
#define MOEPACK_MK_HOOK_DECLARE(name, member, ret, params)                                \
  using Hook_##name = ret params;                                                         \
  template <class M>                                                                      \
  concept HasHook_##name = requires { static_cast<Hook_##name*>(&M::member); };           \
  template <class M>                                                                      \
  constexpr bool mk_hook_member_##name() {                                                \
    if constexpr (std::string_view(#name) == std::string_view(#member)) {                 \
      return requires { &M::member; };                                                    \
    } else {                                                                              \
      return HasHook_##name<M>;                                                           \
    }                                                                                     \
  }
MOEPACK_MK_HOOKS(MOEPACK_MK_HOOK_DECLARE)
#undef MOEPACK_MK_HOOK_DECLARE

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
// its members disagree, for every hook of the table.
template <class M>
constexpr bool check_mk_hooks() {
#define MOEPACK_MK_HOOK_CHECK(name, member, ret, params)                                                 \
  static_assert(!mk_states<M>(kHook_##name) || HasHook_##name<M>,                                        \
                "MK states kHook_" #name " but its " #member " is not Hook_" #name " (csrc/kernels/mk_hooks.h)"); \
  static_assert(mk_states<M>(kHook_##name) || !mk_hook_member_##name<M>(),                               \
                "MK has the " #member " of hook " #name " but does not state kHook_" #name " in kHooks");
  MOEPACK_MK_HOOKS(MOEPACK_MK_HOOK_CHECK)
#undef MOEPACK_MK_HOOK_CHECK
  return true;
}

}  // namespace moepack
