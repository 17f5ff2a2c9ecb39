// The kernel objects linked into this tests/cpp binary (tests/cpp/linked.h).
// tests/cpp/build.py defines MOEPACK_TEST_REGISTRARS(X): one X(label, register function, level,
// level the host needs to run it) per kernel object it links (moe_L.cpp natively, through SIMDe,
// and natively again with -Dregister_L=register_L_native), from moepack/isa_levels.py.
#include "linked.h"

#ifndef MOEPACK_TEST_REGISTRARS
#error "build with tests/cpp/build.py: it defines MOEPACK_TEST_REGISTRARS(X), the kernel objects it links"
#endif

namespace moepack {
#define MOEPACK_DECLARE_LINKED(label, fn, level, host) void fn(KernelTable& t);
MOEPACK_TEST_REGISTRARS(MOEPACK_DECLARE_LINKED)
#undef MOEPACK_DECLARE_LINKED

const LinkedObject kLinkedObjects[] = {
#define MOEPACK_LINKED(label, fn, level, host) {label, fn, Isa::level, Isa::host},
    MOEPACK_TEST_REGISTRARS(MOEPACK_LINKED)
#undef MOEPACK_LINKED
    {nullptr, nullptr, Isa::scalar, Isa::scalar},  // the end (the list may be empty)
};
const int kNumLinkedObjects = int(sizeof(kLinkedObjects) / sizeof(kLinkedObjects[0])) - 1;
}  // namespace moepack
