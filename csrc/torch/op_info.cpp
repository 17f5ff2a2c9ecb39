// The introspection and test/benchmark ops: layout_desc (the compiled layout table), kernel_choice
// (the kernel a layout runs and why, with the fallback as a value), cpu_flags, gemm_i8_block (the
// int8 integer core of one ISA, for tests), dot_u4_block and grouped_block (one block of a
// grouped-decode layout through one ISA, for tests) and read_experts (the benchmark's plain-read baseline).
#include "op_common.h"

namespace moepack {
namespace {

// Test hook (SEMANTICS.md §4: SIMD integer dot products identical to scalar): the int32
// accumulators of exactly `isa`'s int8 block GEMM. rows int8 [m, kp], block int8 [block_n * kp]
// (one packed column block), colsum int32 [block_n] -> int32 [m, block_n].
at::Tensor gemm_i8_block_cpu(const at::Tensor& rows, const at::Tensor& block, const at::Tensor& colsum, int64_t layout,
                             std::string_view isa) {
  const LayoutDesc& L = layout_or_throw(layout);
  TORCH_CHECK_VALUE(L.scheme == kScheme_int8_channel, "layout ", L.name, " is not an int8_channel layout");
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(1) % L.k_pack == 0 && rows.size(1) <= kMaxI8K, "rows has shape ",
                    shape_str(rows), ": must be [m, kp] with kp a multiple of k_pack=", L.k_pack, " and <= ", kMaxI8K);
  const int64_t m = rows.size(0), kp = rows.size(1);
  check_exact(rows, "rows", at::kChar, {m, kp}, "int8 [m, kp]");
  check_exact(block, "block", at::kChar, {L.block_n * kp}, "one packed int8 column block [block_n * kp]");
  check_exact(colsum, "colsum", at::kInt, {L.block_n}, "int32 [block_n]");
  const Isa want = parse_isa(isa);
  Int8BlockGemmFn fn = find_gemm_i8(int32_t(layout), want);
  TORCH_CHECK_VALUE(fn != nullptr, "no ", isa_name(want), " int8 block GEMM for layout ", L.name, " on this CPU",
                    isa_unavailable_reason(want) ? std::string(" (") + isa_unavailable_reason(want) + ")" : "");
  at::Tensor out = at::empty({m, L.block_n}, rows.options().dtype(at::kInt));
  std::vector<const int8_t*> ptrs(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) ptrs[size_t(i)] = rows.data_ptr<int8_t>() + i * kp;
  if (m > 0) fn(L, ptrs.data(), int(m), block.data_ptr<int8_t>(), kp, colsum.data_ptr<int32_t>(), out.data_ptr<int32_t>());
  return out;
}

// Test hook (SEMANTICS.md §4): the int32 accumulators of exactly `isa`'s W4A8 integer core for
// an int4_group or mxfp4 layout (mxfp4: the integer weights 2 * e2m1(q)). rows int8 [m, kp], block uint8 [block_n * kp / 2] (one packed column
// block), K range [k0, k0 + kk) (multiples of k_pack inside kp) -> int32 [m, block_n].
at::Tensor dot_u4_block_cpu(const at::Tensor& rows, const at::Tensor& block, int64_t k0, int64_t kk, int64_t layout,
                            std::string_view isa) {
  const LayoutDesc& L = layout_or_throw(layout);
  TORCH_CHECK_VALUE(L.scheme == kScheme_int4_group || L.scheme == kScheme_mxfp4, "layout ", L.name,
                    " is not an int4_group layout (nor an mxfp4 one): the W4A8 integer core is theirs");
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(1) % L.k_pack == 0 && rows.size(1) <= kMaxI8K, "rows has shape ",
                    shape_str(rows), ": must be [m, kp] with kp a multiple of k_pack=", L.k_pack, " and <= ", kMaxI8K);
  const int64_t m = rows.size(0), kp = rows.size(1);
  TORCH_CHECK_VALUE(m <= 64, "rows has ", m, " rows: the integer core takes at most 64 (one chunk)");
  TORCH_CHECK_VALUE(k0 >= 0 && kk >= 0 && k0 % L.k_pack == 0 && kk % L.k_pack == 0 && k0 + kk <= kp, "K range [", k0,
                    ", ", k0 + kk, "): must be multiples of ", L.k_pack, " (k_pack) inside [0, kp=", kp, "]");
  check_exact(rows, "rows", at::kChar, {m, kp}, "int8 [m, kp]");
  check_exact(block, "block", at::kByte, {L.block_n * kp * L.weight_bits / 8}, "one packed u4 column block [block_n * kp / 2]");
  const Isa want = parse_isa(isa);
  U4BlockDotFn fn = find_dot_u4(int32_t(layout), want);
  TORCH_CHECK_VALUE(fn != nullptr, "no ", isa_name(want), " W4A8 integer core for layout ", L.name, " on this CPU",
                    isa_unavailable_reason(want) ? std::string(" (") + isa_unavailable_reason(want) + ")" : "");
  at::Tensor out = at::empty({m, L.block_n}, rows.options().dtype(at::kInt));
  std::vector<const int8_t*> ptrs(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) ptrs[size_t(i)] = rows.data_ptr<int8_t>() + i * kp;
  if (m > 0) fn(L, ptrs.data(), int(m), block.data_ptr<uint8_t>(), k0, kk, out.data_ptr<int32_t>());
  return out;
}

// Test hook (docs/SEMANTICS.md §4; the mxfp4 exactness checks): one packed column block through
// exactly `isa`'s grouped-decode path (int4_group, fp8_block, mxfp4) in `act_mode`, as the fused
// kernel's stage GEMM runs it. codes: the block's bytes [block_n * kp * bits / 8]; scale: [ng,
// block_n] in the layout's scale dtype (ng K groups of group_size over kp; 1 per channel); zero:
// [ng, block_n] uint8 where the layout has zero points (nvfp4: its float32 [block_n] globals). a16: rows float32 / bfloat16 / float16 [m,
// kp] (stored for the level in its row format); a8: rows int8 [m, kp] and row_scales float32 [m].
// -> float32 [m, block_n].
at::Tensor grouped_block_cpu(const at::Tensor& rows, const at::Tensor& codes, const at::Tensor& scale,
                             const std::optional<at::Tensor>& zero, const std::optional<at::Tensor>& row_scales,
                             int64_t layout, std::string_view isa, std::string_view act_mode) {
  const LayoutDesc& L = layout_or_throw(layout);
  TORCH_CHECK_VALUE(L.scheme == kScheme_int4_group || L.scheme == kScheme_fp8_block || L.scheme == kScheme_mxfp4 ||
                        L.scheme == kScheme_nvfp4,
                    "layout ", L.name, " is not a grouped-decode layout (int4_group, fp8_block, mxfp4, nvfp4)");
  const int32_t mode = parse_act_mode(L, act_mode);
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(1) % L.k_pack == 0 && rows.size(1) <= kMaxI8K, "rows has shape ",
                    shape_str(rows), ": must be [m, kp] with kp a multiple of k_pack=", L.k_pack, " and <= ", kMaxI8K);
  const int64_t m = rows.size(0), kp = rows.size(1);
  TORCH_CHECK_VALUE(m <= 64, "rows has ", m, " rows: one block call takes at most 64 (one chunk)");
  const int64_t G = L.group_size ? L.group_size : std::max<int64_t>(kp, 1);
  const int64_t ng = std::max<int64_t>(1, (kp + G - 1) / G);
  check_exact(codes, "codes", at::kByte, {L.block_n * kp * L.weight_bits / 8}, "one packed column block");
  const int si = [&] {
    for (int i = 0; i < L.num_tensors; ++i)
      if (L.tensors[i].role == kRole_scale) return i;
    return -1;
  }();
  TORCH_CHECK_VALUE(si >= 0, "layout ", L.name, " declares no scale tensor");
  check_exact(scale, "scale", scalar_type_of(L.tensors[si].dtype), {ng, L.block_n}, "[groups, block_n] of the block");
  const bool nv4 = L.scheme == kScheme_nvfp4;  // `zero` carries the block's fp32 globals [block_n]
  const bool has_zero = L.zero_kind != kZeroKind_none || nv4;
  TORCH_CHECK_VALUE(has_zero == zero.has_value(), "zero is ", zero ? "given" : "missing", ": layout ", L.name,
                    nv4 ? " takes its per-column fp32 globals there" : has_zero ? " has zero points" : " has no zero points");
  if (zero && nv4) check_exact(*zero, "zero", at::kFloat, {L.block_n}, "float32 [block_n]: the block's nvfp4 globals");
  if (zero && !nv4) check_exact(*zero, "zero", at::kByte, {ng, L.block_n}, "uint8 [groups, block_n] of the block");
  DType dt = DType::f32;
  at::Tensor vals;
  if (mode == kAct_a8) {
    check_exact(rows, "rows", at::kChar, {m, kp}, "int8 [m, kp] (a8)");
    TORCH_CHECK_VALUE(row_scales.has_value(), "row_scales is missing: a8 rows need their float32 [m] scales");
    check_exact(*row_scales, "row_scales", at::kFloat, {m}, "float32 [m]");
  } else {
    dt = dtype_of(rows, "rows");
    vals = rows.to(at::kFloat).contiguous();
  }
  const Isa want = parse_isa(isa);
  GroupedBlockFn fn = find_grouped_block(int32_t(layout), want, mode);
  TORCH_CHECK_VALUE(fn != nullptr, "no ", isa_name(want), " ", mode == kAct_a8 ? "a8" : "a16", " kernel for layout ",
                    L.name, " on this CPU",
                    isa_unavailable_reason(want) ? std::string(" (") + isa_unavailable_reason(want) + ")" : "");
  at::Tensor out = at::zeros({m, L.block_n}, rows.options().dtype(at::kFloat));
  std::vector<const void*> ptrs(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) {
    ptrs[size_t(i)] = mode == kAct_a8 ? static_cast<const void*>(rows.data_ptr<int8_t>() + i * kp)
                                      : static_cast<const void*>(vals.data_ptr<float>() + i * kp);
  }
  if (m > 0) {
    fn(L, dt, ptrs.data(), mode == kAct_a8 ? row_scales->data_ptr<float>() : nullptr, int(m), codes.data_ptr<uint8_t>(),
       scale.data_ptr(), zero ? zero->data_ptr() : nullptr, L.block_n, kp, out.data_ptr<float>());
  }
  return out;
}

// Benchmark baseline (moepack bench): reads every byte of experts `ids` of the packed w13 and
// w2 ([E, ...], contiguous) on the extension's threads, in 64 KiB pieces, and returns a checksum
// (so the reads cannot be elided). Timed next to fused_experts on the same experts, it says how
// close the kernel is to merely reading its weights on this machine at this moment.
int64_t read_experts_cpu(const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& ids) {
  TORCH_CHECK_VALUE(w13.device().is_cpu() && w2.device().is_cpu() && ids.device().is_cpu(),
                    "read_experts: every tensor must be on the CPU");
  TORCH_CHECK_VALUE(w13.is_contiguous() && w2.is_contiguous() && w13.dim() >= 1 && w2.dim() >= 1 &&
                        w13.size(0) == w2.size(0),
                    "read_experts: w13 ", shape_str(w13), " and w2 ", shape_str(w2),
                    " must be contiguous with the same leading expert dimension");
  TORCH_CHECK_VALUE(ids.dim() == 1 && (ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong),
                    "read_experts: ids must be a 1-D int32 or int64 tensor, got ", shape_str(ids), " ", ids.scalar_type());
  const int64_t E = w13.size(0);
  const at::Tensor id64 = ids.to(at::kLong).contiguous();
  constexpr int64_t kPiece = 65536;
  std::vector<std::pair<const char*, int64_t>> pieces;
  for (int64_t i = 0; i < id64.numel(); ++i) {
    const int64_t e = id64.data_ptr<int64_t>()[i];
    TORCH_CHECK_INDEX(e >= 0 && e < E, "read_experts: ids[", i, "] = ", e, " is out of range [0, ", E, ")");
    for (const at::Tensor* w : {&w13, &w2}) {
      const int64_t per = w->nbytes() / E;
      const char* base = static_cast<const char*>(w->data_ptr()) + e * per;
      for (int64_t off = 0; off < per; off += kPiece) pieces.emplace_back(base + off, std::min(kPiece, per - off));
    }
  }
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, int64_t(pieces.size()), 1, [&](int64_t b, int64_t e) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int64_t p = b; p < e; ++p) {
      const char* q = pieces[size_t(p)].first;
      const int64_t n = pieces[size_t(p)].second;
      int64_t k = 0;
      for (; k + 32 <= n; k += 32) {
        uint64_t v[4];
        std::memcpy(v, q + k, 32);
        a0 += v[0];
        a1 += v[1];
        a2 += v[2];
        a3 += v[3];
      }
      for (; k < n; ++k) a0 += uint8_t(q[k]);
    }
    total.fetch_add(a0 + a1 + a2 + a3, std::memory_order_relaxed);
  });
  return int64_t(total.load());
}

// The compiled layout table, for tests/test_layout_sync.py: (name, numbers, tensors as
// "role:suffix:dtype:shape" with the enums' indices).
std::tuple<std::string, std::vector<int64_t>, std::vector<std::string>> layout_desc(int64_t id) {
  const LayoutDesc& L = layout_or_throw(id);
  std::vector<std::string> tensors;
  for (int i = 0; i < L.num_tensors; ++i) {
    const TensorDesc& t = L.tensors[i];
    tensors.push_back(std::to_string(t.role) + ":" + t.suffix + ":" + std::to_string(t.dtype) + ":" + std::to_string(t.shape));
  }
  return {L.name,
          {L.id, L.weight_dtype, L.weight_bits, L.group_size, L.block_n, L.k_pack, L.scale_dtype, L.zero_kind, L.family,
           L.i_align, L.scheme, L.act_modes},
          tensors};
}

// (isa, reason, is_fallback): is_fallback is Selection::fallback, what MOEPACK_STRICT refuses.
std::tuple<std::string, std::string, bool> kernel_choice(int64_t layout, std::string_view act_mode) {
  const Selection sel = select_under_cap(layout, parse_act_mode(layout_or_throw(layout), act_mode));
  return {isa_name(sel.isa), sel.reason, sel.fallback};
}

std::vector<std::string> cpu_flags() {
  const CpuFeatures& f = cpu_features();
  std::vector<std::string> out;
#define MOEPACK_ADD_FEATURE(name) \
  if (f.name) out.emplace_back(#name);
  MOEPACK_CPU_FEATURES(MOEPACK_ADD_FEATURE)
#undef MOEPACK_ADD_FEATURE
  out.emplace_back(std::string("host_isa=") + isa_name(host_isa()));
  std::string avail = "available_isas=";
  for (int i = 0; i < kNumIsa; ++i) {
    if (isa_unavailable_reason(Isa(i)) == nullptr) avail += std::string(i ? "," : "") + isa_name(Isa(i));
  }
  out.push_back(avail);
  return out;
}

// How the decode kernels read a weight block here (decode_one_stream) and why; refused when
// MOEPACK_DECODE_STREAMS is not understood.
std::string decode_streams_info() {
  TORCH_CHECK_VALUE(decode_streams_error() == nullptr, decode_streams_error());
  return decode_streams_reason();
}

// The dot product of the mxfp4 W4A16 decode kernels here (mx4_a16_fp32) and why; refused when
// MOEPACK_MX4_A16_DOT is not understood.
std::string mx4_a16_dot_info() {
  TORCH_CHECK_VALUE(mx4_a16_dot_error() == nullptr, mx4_a16_dot_error());
  return mx4_a16_dot_reason();
}

// ---- kernel variants (kernel.h Variant; docs/KERNELS.md "Variants and the tuner") --------------
std::string format_variant(const Variant& v) {
  static const char* const kWalk[] = {"guided", "static", "stride"};
  std::string out = std::string("walk=") + kWalk[v.walk >= 0 && v.walk < 3 ? v.walk : 0] +
                    ",pair=" + std::to_string(int(v.pair)) + ",streams=" + std::to_string(int(v.streams)) +
                    ",touch=" + std::to_string(int(v.touch)) + ",pf=" + std::to_string(int(v.pf));
  if (v.nta) out += ",nta=1";
  if (v.dot) out += v.dot == 1 ? ",dot=fp32" : ",dot=bf16";
  if (v.slow) out += ",slow=" + std::to_string(int(v.slow));
  return out;
}

// One entry of the variant table: `spec` (parse_variant's syntax) for (layout, act_mode, token
// class), or none to return the entry to the defaults. Refused: an unknown layout, act mode or
// class, a spec that does not parse (the message names the key, value and rule).
void set_variant_op(int64_t layout, std::string_view act_mode, int64_t tclass, const std::optional<std::string>& spec) {
  const LayoutDesc& L = layout_or_throw(layout);
  const int32_t mode = parse_act_mode(L, act_mode);
  TORCH_CHECK_VALUE(tclass >= 0 && tclass < kNumTokenClasses, "token class ", tclass, ": must be 0 (T = 1), 1 (T = 2..16) or 2 (T > 16)");
  Variant v;
  if (spec) {
    char buf[512];
    const std::string sp = *spec;
    const char* why = parse_variant(sp.c_str(), v, buf, sizeof(buf));
    TORCH_CHECK_VALUE(why == nullptr, "variant for layout ", L.name, ": ", why ? why : "");
  }
  TORCH_CHECK_VALUE(set_variant(int32_t(layout), mode, int(tclass), v, !spec.has_value()), "variant table refused layout ", layout);
}

// The variant a call of (layout, act_mode) with `tokens` tokens runs now, in parse_variant's syntax.
std::string variant_op(int64_t layout, std::string_view act_mode, int64_t tokens) {
  TORCH_CHECK_VALUE(variant_env_error() == nullptr, variant_env_error());
  const LayoutDesc& L = layout_or_throw(layout);
  return format_variant(variant_for(int32_t(layout), parse_act_mode(L, act_mode), tokens));
}

// The knobs the kernel chosen for (layout, act_mode) under MOEPACK_MAX_ISA reads besides the
// driver's walk and touch: a subset of pair, streams, pf.
std::vector<std::string> variant_knobs_op(int64_t layout, std::string_view act_mode) {
  const LayoutDesc& L = layout_or_throw(layout);
  const int32_t mode = parse_act_mode(L, act_mode);
  const uint8_t k = variant_knobs(int32_t(layout), mode, env_max_isa());
  std::vector<std::string> out;
  if (k & kKnob_pair) out.emplace_back("pair");
  if (k & kKnob_streams) out.emplace_back("streams");
  if (k & kKnob_pf) out.emplace_back("pf");
  if (k & kKnob_dot) out.emplace_back("dot");
  return out;
}

}  // namespace
}  // namespace moepack

TORCH_LIBRARY_FRAGMENT(moepack, m) {
  m.def("set_variant(int layout, str act_mode, int tclass, str? spec) -> ()", &moepack::set_variant_op);
  m.def("variant(int layout, str act_mode, int tokens) -> str", &moepack::variant_op);
  m.def("variant_knobs(int layout, str act_mode=\"\") -> str[]", &moepack::variant_knobs_op);
  m.def("gemm_i8_block(Tensor rows, Tensor block, Tensor colsum, int layout, str isa) -> Tensor");
  m.def("read_experts(Tensor w13, Tensor w2, Tensor ids) -> int");
  m.def("layout_desc(int layout) -> (str, int[], str[])", &moepack::layout_desc);
  m.def("kernel_choice(int layout, str act_mode=\"\") -> (str, str, bool)", &moepack::kernel_choice);
  m.def("dot_u4_block(Tensor rows, Tensor block, int k0, int kk, int layout, str isa) -> Tensor");
  m.def(
      "grouped_block(Tensor rows, Tensor codes, Tensor scale, Tensor? zero, Tensor? row_scales, int layout, str isa, "
      "str act_mode) -> Tensor");
  m.def("cpu_flags() -> str[]", &moepack::cpu_flags);
  m.def("decode_streams() -> str", &moepack::decode_streams_info);
  m.def("mx4_a16_dot() -> str", &moepack::mx4_a16_dot_info);
}

TORCH_LIBRARY_IMPL(moepack, CPU, m) {
  m.impl("gemm_i8_block", &moepack::gemm_i8_block_cpu);
  m.impl("dot_u4_block", &moepack::dot_u4_block_cpu);
  m.impl("grouped_block", &moepack::grouped_block_cpu);
  m.impl("read_experts", &moepack::read_experts_cpu);
}
