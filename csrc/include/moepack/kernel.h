// Kernel-facing types shared by every ISA translation unit, the dispatcher and the torch layer.
// Torch-free on purpose: kernels see raw pointers, sizes and a parallel-for callback, so they
// also run in a plain C++ test binary (tests/cpp) and under emulators.
#pragma once
#include <cstddef>
#include <cstdio>  // snprintf: the driver's registrar writes refusal reasons into the table
#include <cstdint>
#include <sys/mman.h>  // madvise: the driver advises its scratch for transparent huge pages

#include "moepack/isa_gen.h"
#include "moepack/layout_shapes.h"
#include "moepack/layouts_gen.h"

namespace moepack {

// The transparent-huge-page hint (madvise MADV_HUGEPAGE) is Linux's; where the OS has no such
// advice (macOS) it is dropped: the memory is the same, only the TLB pressure differs.
inline void advise_huge_pages(void* p, size_t bytes) {
#if defined(MADV_HUGEPAGE)
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // a hint: refused or ignored where THP is off
#else
  (void)p, (void)bytes;
#endif
}

// Kernel ISA levels: the `Isa` enum (order = preference), kNumIsa, CpuFeatures and the kIsaLevels
// table are generated from moepack/isa_levels.py, the one list of levels, into isa_gen.h
// (docs/KERNELS.md, Dispatch; docs/CONTRIBUTING.md: how to add an ISA level).
const char* isa_name(Isa isa);

enum class DType : int32_t { f32 = 0, bf16 = 1, f16 = 2 };
// relu2: non-gated experts (Nemotron-H): w13 holds the up rows only ([E, Ip, Kp]), a = relu(up)^2
enum class Activation : int32_t { silu = 0, gelu = 1, gelu_tanh = 2, swigluoai = 3, relu2 = 4 };
// How a kernel wants its GEMM A rows (activations, intermediate): fp32, or bf16 bits (only
// for bf16 inputs, whose values are exactly bf16).
enum class RowFormat : int32_t { f32 = 0, bf16 = 1 };

// The one thread pool: the torch layer passes at::parallel_for, tests pass a plain loop.
// run(self, n, body, ctx) must call body(ctx, begin, end) over a partition of [0, n), possibly
// concurrently; it returns when every part is done.
using ParallelBody = void (*)(void* ctx, int64_t begin, int64_t end);
struct Parallel {
  void (*run)(void* self, int64_t n, ParallelBody body, void* ctx) = nullptr;
  void* self = nullptr;
  int num_threads = 1;
};

// One packed weight (w13 or w2 of every local expert): the layout's declared tensors
// (LayoutDesc::tensors, moepack/layout.py), in declared order; t[0] is the codes.
struct PackedWeight {
  const void* t[kMaxLayoutTensors] = {};
};

// Everything one fused-MoE call needs. Shapes (leading dimension in brackets):
//   x            [T, H] (x_stride)        activations, dtype
//   out          [T, H] (H)               result, dtype
//   w13          per the layout over [E, 2*Ip, Kp(H)] (layout_shapes.h: w13_dims); packed rows
//                gate then up, or interleaved (gate, up) pairs when `interleaved`; [E, Ip, Kp(H)]
//                of up rows alone for the non-gated relu2
//   w2           per the layout over [E, Np(H), Ip] (w2_dims)
//   b13, b2      [E, 2*Ip], [E, Np(H)]    fp32 biases in packed row order, or null
//   topk_weights [T, k] fp32, topk_ids [T, k] int32 (global expert ids)
//   expert_map   [E_global] int32: global id -> local id or -1 (null = identity, E_global = E)
//   w13_perm     [E, H] int32 or null: act-order (int4_group only, docs/SEMANTICS.md §3): column j
//                of expert e's w13 is input channel w13_perm[e * H + j], every entry in [0, H)
//                (the op checks the routed experts' rows); the driver feeds stage 1 the rows
//                x[t][w13_perm[e]] per routed position
// Kernel variants (docs/KERNELS.md "Variants and the tuner"): how a fused call walks the weights,
// a run-time choice per (layout, activation mode, token class) so that the host can pick by
// measurement (`moepack tune`) instead of by vendor. Every variant computes the same numbers
// (bitwise, but `streams`, which sums the K segments in another fp32 order). Defaults: today's walk.
struct Variant {
  int8_t walk = 0;     // stage tasks: 0 guided runs from one counter (expert-major), 1 a contiguous
                       // share per worker (expert-major, no counter), 2 strided (worker w takes tasks
                       // w, w + W, ...: the workers read neighbouring blocks of one expert)
  int8_t pair = 0;     // stage 1, gate and up kept apart: 0 the gate block then the up block, 1 both
                       // at once, two streams (where the scheme and level have the kernel: int8, bf16)
  int8_t streams = 0;  // the AVX-512 few-row kernels: 0 the process's choice (decode_one_stream), 1 one
                       // stream per block, 4 K segments at once
  int8_t slow = 0;     // tests only: stage 2 run this many times more (a variant the tuner must reject)
  int8_t dot = 0;      // the mxfp4 W4A16 few-row dot on the AVX-512 BF16 levels: 0 the process's choice
                       // (mx4_a16_fp32), 1 fp32 FMAs, 2 vdpbf16ps
  int8_t nta = 0;      // 1: the decode prefetches (pf) with the non-temporal hint instead of T0
  int16_t touch = 0;   // 64-byte lines at the start of the worker's next block prefetched before each block
  int16_t pf = -1;     // decode kernels that read it: software prefetch distance in bytes (0 none, -1 the
                       // kernel's own)
};
struct FusedMoeArgs {
  const void* x = nullptr;
  int64_t x_stride = 0;
  void* out = nullptr;
  DType dtype = DType::f32;
  int64_t tokens = 0;
  int64_t hidden = 0;
  PackedWeight w13;
  PackedWeight w2;
  const float* b13 = nullptr;
  const float* b2 = nullptr;
  const float* topk_weights = nullptr;
  const int32_t* topk_ids = nullptr;
  int64_t topk = 0;
  const int32_t* expert_map = nullptr;
  const int32_t* w13_perm = nullptr;
  int64_t num_global_experts = 0;
  int64_t num_experts = 0;
  int64_t inter_padded = 0;  // Ip
  const LayoutDesc* layout = nullptr;
  bool interleaved = false;  // w13's row order, as recorded when it was packed
  int32_t act_mode = 0;      // ActMode the call runs in (one of the layout's act_modes); 0: its default
  Activation act = Activation::silu;
  float alpha = 1.702f;  // swigluoai only
  float limit = 7.0f;    // swigluoai only
  // silu only: > 0 clamps the gate to <= silu_limit and the up to [-silu_limit, silu_limit] before
  // silu(gate) * up (a clamped SwiGLU: DeepSeek-V4's swiglu_limit); 0: no clamp. The driver applies
  // it (fused_moe_driver.inc, clamp_silu_inputs), before any level's MK::activation.
  float silu_limit = 0.0f;
  Parallel par;
  Variant variant;  // how the call walks the weights (variant_for; the defaults unless set)
};

using FusedMoeFn = void (*)(const FusedMoeArgs&);

// Checks ids and expert_map (the only data-dependent rules). Returns nullptr when valid, else
// writes "thing, value, rule" into buf and returns it.
const char* fused_moe_check_routing(const FusedMoeArgs& a, char* buf, size_t buf_len);

// The integer core of an int8 layout's kernel, for tests (SEMANTICS.md §4: SIMD and scalar
// integer dot products must be identical): one packed block of L.block_n columns against m
// int8 rows (canonical signed codes, zero-padded to kp), acc[i * block_n + n] = sum_k a_i[k] *
// w[n][k] exactly. colsum: the layout's stored column sums, read by no kernel (the VNNI ones
// correct their u8 offset from the codes; docs/KERNELS.md "int8 column sums").
using Int8BlockGemmFn = void (*)(const LayoutDesc& L, const int8_t* const* rows, int m, const int8_t* B, int64_t kp,
                                 const int32_t* colsum, int32_t* acc);

// The int8 path's per-row activation quantizer of one ISA (SEMANTICS.md §3), for tests: codes
// q[0, np) (q[n, np) = the zero code) XOR `flip`, returns the scale. Every ISA's must equal the
// scalar one bit for bit.
using Int8QuantizeFn = float (*)(const float* v, int64_t n, int64_t np, int8_t* q, uint8_t flip);

// Activation modes index the kernel table: 0 = a16, 1 = a8 (ActMode bits kAct_a16, kAct_a8).
constexpr int kNumActModes = 2;
constexpr int act_index(int32_t mode) { return mode == kAct_a8 ? 1 : 0; }
// A layout's default activation mode: a16 where it serves a16 (the checkpoint's own meaning), else a8.
constexpr int32_t layout_default_act(const LayoutDesc& L) { return (L.act_modes & kAct_a16) ? kAct_a16 : kAct_a8; }

// The integer core of an int4_group or mxfp4 layout's A8 kernel, for tests (SEMANTICS.md §4:
// identical integer accumulators): acc[i * block_n + n] = sum over K [k0, k0 + kk) (multiples of
// k_pack) of rows[i][k] * q[n][k], s8 rows (kp long) against one packed block of layout L; q the
// code's integer value (int4_group: the code; mxfp4: 2 * e2m1(code), -12..12).
using U4BlockDotFn = void (*)(const LayoutDesc& L, const int8_t* const* rows, int m, const uint8_t* codes, int64_t k0,
                              int64_t kk, int32_t* acc);

// An fp8_block level's code decoder, for tests (every level must give the scalar table's bits):
// out[i] = the bf16 bits of e4m3fn code codes[i], i < n.
using F8UnpackFn = void (*)(const uint8_t* codes, int64_t n, uint16_t* out);

// One packed column block through exactly a level's grouped-decode scheme (int4_group, fp8_block,
// mxfp4: grouped_decode.inc), for tests: C[m, block_n] fp32, what the fused kernel's stage GEMM
// gives for these rows and this block (m <= 64). a16: rows[i] are kp fp32 values, stored for the
// level as the driver stores them (its row format, rounded through `dtype`); row_scales unused.
// a8: rows[i] are kp s8 codes and row_scales[i] their scales. scale / zero: the layout's group
// tensors at the block's first column (dtype as declared), group_stride elements from one group
// to the next (zero null where the layout has none).
using GroupedBlockFn = void (*)(const LayoutDesc& L, DType dtype, const void* const* rows, const float* row_scales, int m,
                                const uint8_t* codes, const void* scale, const void* zero, int64_t group_stride,
                                int64_t kp, float* C);

struct KernelTable {
  FusedMoeFn fused[kMaxLayoutId + 1][kNumActModes][kNumIsa] = {};
  // Why a level's kernel file did not register a layout it was asked to (the driver's
  // register_scheme: the layout's blocks do not fit the kernel), or null.
  char refused[kMaxLayoutId + 1][kNumActModes][kNumIsa][160] = {};  // "" = not refused
  Int8BlockGemmFn gemm_i8[kMaxLayoutId + 1][kNumIsa] = {};
  U4BlockDotFn dot_u4[kMaxLayoutId + 1][kNumIsa] = {};  // int4_group and mxfp4 layouts (A8)
  GroupedBlockFn grouped_block[kMaxLayoutId + 1][kNumActModes][kNumIsa] = {};
  Int8QuantizeFn quantize_i8[kNumIsa] = {};
  F8UnpackFn unpack_f8[kNumIsa] = {};  // set where a level registers an fp8_block layout
  // The Variant knobs a registered kernel reads besides the driver's own (walk, touch, slow), as
  // kKnob_* bits: what the tuner varies for it (register.inc variant_knobs).
  uint8_t knobs[kMaxLayoutId + 1][kNumActModes][kNumIsa] = {};
#if defined(MOEPACK_COUNT_HOOKS)
  // tests/cpp only (csrc/kernels/mk_hooks.h): each level object's calls per MK hook, and the
  // hooks its MK states that the schemes it registered call.
  const uint64_t* hook_calls[kNumIsa] = {};
  uint32_t hooks_used[kNumIsa] = {};
#endif
};

// The scalar kernels for one layout of any blocking (register_scalar: every layout of kLayouts).
// L.id indexes the table; a layout outside kLayouts (tests/cpp: test-only blockings) uses id 0,
// which no layout of the table has.
void register_scalar_layout(KernelTable& t, const LayoutDesc& L);

// Each ISA translation unit (csrc/<arch>/moe_<isa>.cpp, csrc/ref/moe_scalar.cpp) exports exactly
// one of these; dispatch.cpp calls it only after the CPU and the OS are known to support the ISA.
#define MOEPACK_DECLARE_REGISTER(isa) void register_##isa(KernelTable& t);
MOEPACK_ISA_LEVELS(MOEPACK_DECLARE_REGISTER)
#undef MOEPACK_DECLARE_REGISTER

// What the CPU has and the OS saves, asked once by csrc/<arch>/cpu_features.cpp of the
// architecture this build is for (compiled without ISA flags; x86: cpuid + xgetbv); all false on
// an architecture moepack/isa_levels.py does not list. cpu_features() caches it.
CpuFeatures detect_cpu_features();
const CpuFeatures& cpu_features();
// The CPU's vendor string (x86: cpuid leaf 0, e.g. "AuthenticAMD", "GenuineIntel"; "" elsewhere).
const char* cpu_vendor();
// Decode streams (docs/KERNELS.md, "Decode streams"): whether the AVX-512 few-row (decode) kernels read a
// weight block as one sequential stream (true) or as several K segments at once (false: 4, or 2
// from 3 rows). Chosen once per process: MOEPACK_DECODE_STREAMS=1 or 4 when set, else by CPU
// (AMD: one stream, measured faster on Zen 4; other vendors: several, measured faster on
// Sapphire Rapids). The kernels read decode_one_stream() per block call.
bool decode_one_stream();
// Why that choice (a sentence for `moepack info`), and why MOEPACK_DECODE_STREAMS was not
// understood (nullptr when it was; the op layer then refuses to run a kernel).
const char* decode_streams_reason();
const char* decode_streams_error();
// Tests: force one stream (1) or several (0); -1 returns to the process's choice.
void set_decode_one_stream(int one);
// The dot product of the mxfp4 W4A16 decode kernels for a few bf16 rows on the AVX-512 levels
// (docs/KERNELS.md, "mxfp4 W4A16 decode: fp32 FMAs or vdpbf16ps"): fp32 FMAs on a vpermps table
// of the e2m1 values (true) or vdpbf16ps on bf16 pairs (false). Chosen once per process:
// MOEPACK_MX4_A16_DOT=fp32 or bf16 when set, else by CPU (AMD: vdpbf16ps, the kernel it had, the
// fp32 one not measured there; other vendors: fp32, measured faster on Sapphire Rapids, where
// vdpbf16ps issues one per ~2 cycles). Read per block call.
bool mx4_a16_fp32();
// Why that choice (a sentence for `moepack info`), and why MOEPACK_MX4_A16_DOT was not understood
// (nullptr when it was; the op layer then refuses to run a kernel).
const char* mx4_a16_dot_reason();
const char* mx4_a16_dot_error();
// Tests: force fp32 FMAs (1) or vdpbf16ps (0); -1 returns to the process's choice.
void set_mx4_a16_fp32(int fp32);
// Variant knobs a kernel reads besides the driver's walk, touch and slow (KernelTable::knobs).
constexpr uint8_t kKnob_pair = 1, kKnob_streams = 2, kKnob_pf = 4, kKnob_dot = 8;
// The knobs the kernel selected for (layout, act_mode) under MOEPACK_MAX_ISA reads (0: none, or no kernel).
uint8_t variant_knobs(int32_t layout_id, int32_t act_mode, Isa max_isa);
// Token classes of the variant table: T = 1, 2..16, more.
constexpr int kNumTokenClasses = 3;
inline int token_class(int64_t tokens) { return tokens <= 1 ? 0 : tokens <= 16 ? 1 : 2; }
// The variant a call of `layout_id` in `act_mode` (kAct_a16/kAct_a8) with `tokens` tokens runs:
// MOEPACK_VARIANT when set (variant_env_error() says when it is not understood), else the table.
Variant variant_for(int32_t layout_id, int32_t act_mode, int64_t tokens);
// Set (or with clear=true, unset) one entry of the table; out-of-range arguments return false.
bool set_variant(int32_t layout_id, int32_t act_mode, int tclass, const Variant& v, bool clear);
// Why MOEPACK_VARIANT was not understood (nullptr when unset or understood).
const char* variant_env_error();
// Parses "walk=guided|static|stride,pair=0|1,streams=0|1|4,touch=N,pf=N,nta=0|1,dot=0|fp32|bf16,slow=0..8"
// (any subset, in any
// order; empty: the defaults) into v; returns nullptr or why not (names the key, the value and the rule).
const char* parse_variant(const char* spec, Variant& v, char* buf, size_t buf_len);
// The variant of the stage worker running on this thread (the kernels read streams and pf).
const Variant& current_variant();
void set_current_variant(const Variant* v);  // null: the defaults
// The decode kernels' prefetch distance in bytes: the current variant's pf, else `own`.
inline int64_t decode_prefetch_bytes(int64_t own) {
  const int16_t pf = current_variant().pf;
  return pf >= 0 ? pf : own;
}
// Best (highest) ISA level the CPU and OS support (ignores MOEPACK_MAX_ISA).
Isa host_isa();
// Why `isa` is not available on this host, or nullptr if it is.
const char* isa_unavailable_reason(Isa isa);
// Whether ISA level `isa` is meant for layouts like L called in activation mode `act_mode` (the
// dot-product levels serve one kind of dot product: bf16 for bf16 weights and u4 with a16, int8
// for int8 weights and u4 with a8).
bool isa_serves(Isa isa, const LayoutDesc& L, int32_t act_mode);

struct Selection {
  FusedMoeFn fn = nullptr;
  Isa isa = Isa::scalar;
  // True when a better level that serves the layout is available (and allowed by the cap) but
  // this build has no kernel for it: MOEPACK_STRICT refuses such a choice.
  bool fallback = false;
  char reason[256] = {0};  // why this kernel (and not a better one) was chosen
};
// Best registered kernel for `layout_id` in activation mode `act_mode` (0: the layout's default)
// among the levels at or below `max_isa` that the host supports and that serve the layout in that
// mode. A mode the layout does not serve gets no kernel and a reason naming the layout's modes.
Selection select_fused(int32_t layout_id, Isa max_isa, int32_t act_mode = 0);
// The same rule for any CPU and kernel table: unavailable[i] says why level i cannot run on that
// CPU (nullptr = it can). select_fused = select_kernel(this build's table, this host, ...).
Selection select_kernel(const KernelTable& t, const char* const unavailable[kNumIsa], int32_t layout_id, Isa max_isa,
                        int32_t act_mode = 0);
// The registered int8 block GEMM of exactly `isa` for `layout_id` (null when none: not an int8
// layout, no such kernel, or the host cannot run `isa`).
Int8BlockGemmFn find_gemm_i8(int32_t layout_id, Isa isa);
// The registered W4A8 integer core of exactly `isa` for an int4_group or mxfp4 layout (null when none).
U4BlockDotFn find_dot_u4(int32_t layout_id, Isa isa);
// The registered one-block path of exactly `isa` for a grouped-decode layout in act_mode (kAct_a16
// or kAct_a8; null when none).
GroupedBlockFn find_grouped_block(int32_t layout_id, Isa isa, int32_t act_mode);
// MOEPACK_MAX_ISA as parsed (host_isa() when unset); throws std::invalid_argument when invalid.
Isa env_max_isa();
const LayoutDesc* layout_find(int32_t id);

// C++ packer: one [N, K] row-major matrix (src_dtype) -> packed bf16 layout bytes [Np, Kp]
// (Np, Kp: whole blocks / K groups, at least the padded N and K). Returns the flat index of the
// first non-finite source element, or -1. The _rows variant packs column blocks
// [block_begin, block_end) only, so callers can split one matrix across threads.
int64_t pack_matrix_bf16(const void* src, DType src_dtype, int64_t n, int64_t k, int64_t np, int64_t kp,
                         const LayoutDesc& layout, uint16_t* dst);
int64_t pack_matrix_bf16_rows(const void* src, DType src_dtype, int64_t n, int64_t k, int64_t np, int64_t kp,
                              const LayoutDesc& layout, uint16_t* dst, int64_t block_begin, int64_t block_end);
// int8 layouts: [N, K] int8 codes -> packed [Np, Kp] (zero padding), column blocks
// [block_begin, block_end) only.
void pack_matrix_i8_rows(const int8_t* src, int64_t n, int64_t k, int64_t np, int64_t kp, const LayoutDesc& layout,
                         int8_t* dst, int64_t block_begin, int64_t block_end);
// Sub-byte layouts (int4): [N, K] codes (one per byte, < 2^weight_bits) -> packed [Np, Kp] codes
// (layout_code_position); K padding of row r holds zero[r * ng + group] (zero: [N, ng], ng groups
// of group_size over Kp, or 1 per channel), padded rows code 0.
void pack_matrix_sub_byte(const uint8_t* src, const uint8_t* zero, int64_t n, int64_t k, int64_t np, int64_t kp,
                          const LayoutDesc& L, uint8_t* dst);
void pack_matrix_i8(const int8_t* src, int64_t n, int64_t k, int64_t np, int64_t kp, const LayoutDesc& layout,
                    int8_t* dst);
// pack_matrix_sub_byte of column blocks [block_begin, block_end) only (torch.ops.moepack.pack_weight
// splits one matrix across threads), with zero [N, ng] of any ng >= 1 (K padding column c takes
// group min(c / group_size, ng - 1), as moepack.schemes.int4.pack_u4_codes pads) or null (K padding
// code 0). Returns the flat index in src of the first code >= 2^weight_bits among these blocks'
// rows, or -1; such a code is packed masked to its low weight_bits bits.
int64_t pack_matrix_sub_byte_rows(const uint8_t* src, const uint8_t* zero, int64_t ng, int64_t n, int64_t k, int64_t np,
                                  int64_t kp, const LayoutDesc& layout, uint8_t* dst, int64_t block_begin,
                                  int64_t block_end);

}  // namespace moepack
