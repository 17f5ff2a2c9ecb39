// The kernel objects a tests/cpp binary links, as data: tests/cpp/linked.cpp defines the list from
// MOEPACK_TEST_REGISTRARS (tests/cpp/build.py compiles it once per binary), so the harness
// (test_kernels.cpp, the large unit) is compiled once for every binary of a build directory.
#pragma once
#include "moepack/kernel.h"

namespace moepack {
struct LinkedObject {
  const char* label;             // "avx2", "avx512-emu", ...
  void (*reg)(KernelTable&);     // its register function
  Isa level;                     // the level it registers
  Isa host;                      // the level the CPU must have to run it
};
extern const LinkedObject kLinkedObjects[];
extern const int kNumLinkedObjects;
}  // namespace moepack
