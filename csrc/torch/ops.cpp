// The moepack op library, one translation unit. Each op lives in its own part with its schema, CPU
// and Meta kernels (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL): op_fused_experts.inc,
// op_pack_weight.inc, op_route.inc, op_info.inc; their shared argument checks are in op_common.h.
// They are compiled together because the torch headers they need cost far more to parse than the
// ops themselves (the four parts alone: ~95 CPU seconds at -O3; together: ~30; docs/NOTES.md): the
// extension's build and its aarch64 cross-build each parse them once. Names in the parts' anonymous
// namespaces share one scope. This file declares the library, which torch allows exactly once.
#include <torch/library.h>

TORCH_LIBRARY(moepack, m) {}

#include "op_fused_experts.inc"
#include "op_info.inc"
#include "op_pack_weight.inc"
#include "op_route.inc"
