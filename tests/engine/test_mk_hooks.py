"""The micro-kernel hooks are one table (csrc/kernels/mk_hooks.h MOEPACK_MK_HOOKS): the bits, the
names, the signatures, the concepts and check_mk_hooks' rules come from it. One compile of toy
MKs shows each rule failing the build with its message, and the legal forms passing."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (toy MK, the static_assert message it must raise; None: it must compile)
CASES = {
    "stated_wrong_signature": (
        "static constexpr uint32_t kHooks = kHook_unpack_u4;"
        " static void unpack_u4(const uint8_t*, int64_t, uint16_t*) {}",
        "MK states kHook_unpack_u4 but its unpack_u4 is not Hook_unpack_u4"),
    "member_not_stated": (
        "static constexpr uint32_t kHooks = 0;"
        " static void dot_mx4_s8(const int8_t* const*, int, const uint8_t*, int64_t, int64_t, int32_t*) {}",
        "MK has the dot_mx4_s8 of hook dot_mx4_s8 but does not state kHook_dot_mx4_s8"),
    "prefetch_gemm_not_stated": (
        "static constexpr uint32_t kHooks = 0; static void gemm(const LayoutDesc&, RowFormat, const void* const*,"
        " int, const uint16_t*, int64_t, float*, const char*, int64_t) {}",
        "MK has the gemm of hook gemm_prefetch but does not state kHook_gemm_prefetch"),
    "plain_gemm": (
        "static constexpr uint32_t kHooks = 0; static void gemm(const LayoutDesc&, RowFormat, const void* const*,"
        " int, const uint16_t*, int64_t, float*) {}", None),
    "stated_right_signature": (
        "static constexpr uint32_t kHooks = kHook_gemm_mx4a8; static void gemm_mx4a8(const int8_t* const*,"
        " const float*, int, const uint8_t*, const uint8_t*, int64_t, int64_t, const A8Sums&, float*) {}", None),
}


def test_the_hook_table_drives_bits_names_and_checks(tmp_path):
    compiler = shlex.split(os.environ.get("CXX", "g++"))
    assert shutil.which(compiler[0]), f"no C++ compiler ({compiler[0]})"
    table = (ROOT / "csrc/kernels/mk_hooks.h").read_text()
    names = re.findall(r"^  X\((\w+), ", table, re.M)
    assert len(names) == 15 and len(set(names)) == len(names), names
    src = ['#include "mk_hooks.h"', "using namespace moepack;"]
    src += [f"struct MK_{case} {{ {body} }};\nstatic_assert(check_mk_hooks<MK_{case}>());"
            for case, (body, _) in CASES.items()]
    # bit i and name i of every hook, in the table's order
    src += [f'static_assert(kHook_{n} == (1u << {i}) && std::string_view(kMkHookNames[{i}]) == "{n}");' for i, n in enumerate(names)]
    src.append(f"static_assert(kNumMkHooks == {len(names)});")
    (tmp_path / "hooks.cpp").write_text("\n".join(src) + "\n")
    r = subprocess.run(compiler + ["-std=c++20", "-fsyntax-only", f"-I{ROOT / 'csrc/include'}",
                                   f"-I{ROOT / 'csrc/kernels'}", str(tmp_path / "hooks.cpp")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    failed = re.findall(r"static assertion failed: (.*)", r.stderr)
    want = [why for _, why in CASES.values() if why]
    assert r.returncode != 0 and len(failed) == len(want), r.stderr[-4000:]
    for why in want:
        assert any(why in f for f in failed), (why, failed)
