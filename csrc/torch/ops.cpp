// The moepack op library. Each op lives in its own file with its schema, CPU and Meta kernels
// (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL): op_fused_experts.cpp, op_pack_weight.cpp,
// op_route.cpp, op_info.cpp; their shared argument checks are in op_common.h. This file only
// declares the library, which torch allows exactly once.
#include <torch/library.h>

TORCH_LIBRARY(moepack, m) {}
