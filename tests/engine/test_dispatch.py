"""Kernel selection (csrc/dispatch.cpp, csrc/torch/ops.cpp select_or_throw): what runs, why, and
how MOEPACK_MAX_ISA / MOEPACK_STRICT change it.

The contract as implemented:
* ISA levels in the order of moepack.isa.ISAS (the one list: moepack/isa_levels.py), each
  available when cpuid AND xgetbv allow its own requirements (they do not nest); the host ISA
  is the best available one;
* a layout runs on the best available level that SERVES it (the dot-product levels serve one
  weight kind: moepack.isa.KERNEL_ISAS) at or below MOEPACK_MAX_ISA (read on every call; it can
  only LOWER the choice; an unknown value is a ValueError);
* if the build has no kernel for such a level, the next one down runs and that is a fallback,
  reported in the reason ("<isa>: fallback: ...") and as kernel_choice's is_fallback, which
  MOEPACK_STRICT=1 turns into an error.
  A cap the user asked for is not a fallback. This host never has a fallback; tests/cpp checks
  the rule on simulated CPUs (Alder Lake, Skylake-SP, Ice Lake, Sapphire Rapids, Zen 5) and a
  table with a kernel missing.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import moepack
from moepack.errors import MoepackError
from moepack.isa import host_family, ISAS, KERNEL_ISAS, available_isas, host_isa, layout_isas, max_isa
from moepack.isa_levels import LEVELS, features, features_of
from moepack.layout import LAYOUTS
from tests.conftest import make_moe_inputs, run_packed
from tests.support import skips


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("MOEPACK_MAX_ISA", raising=False)
    monkeypatch.delenv("MOEPACK_STRICT", raising=False)


# Every cpu_flags name each level needs (its base's included), from the list.
LEVEL_NEEDS = {lv.name: set(features_of(lv)) for lv in LEVELS if lv.arch is not None}


def expected_levels(flags: set[str]) -> list[str]:
    return ["scalar"] + [lv for lv in ISAS[1:] if LEVEL_NEEDS[lv] <= flags]


def expected_choice(layout, cap: str) -> str:
    """The best available level at or below cap that has a kernel for the layout's weight kind."""
    serving = layout_isas(layout)
    return [lv for lv in available_isas() if lv in serving and ISAS.index(lv) <= ISAS.index(cap)][-1]


def test_host_isa_matches_cpu_flags():
    flags = moepack.cpu_flags()
    host_flags = [f for f in flags if f.startswith("host_isa=")]
    assert len(host_flags) == 1
    assert available_isas() == expected_levels(set(flags))
    assert host_isa() == host_flags[0].split("=", 1)[1] == available_isas()[-1]
    assert available_isas()[0] == "scalar"


def test_levels_table_is_complete():
    assert set(LEVEL_NEEDS) == set(ISAS[1:])
    assert {lv for levels in KERNEL_ISAS.values() for lv in levels} == set(ISAS)
    assert set(KERNEL_ISAS) == {lay.weight_dtype for lay in LAYOUTS}


def test_cpu_flags_agree_with_the_kernel():
    """cpuid as the extension reads it vs /proc/cpuinfo (Linux clears flags the OS disables)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        skips.host_lacks("/proc/cpuinfo (not Linux): nothing to compare cpuid with")
    line = next((x for x in cpuinfo.read_text().splitlines() if x.startswith("flags")), None)
    if line is None:
        skips.host_lacks("an x86 /proc/cpuinfo flags line (not an x86 CPU)")
    linux = set(line.split(":", 1)[1].split())
    ours = set(moepack.cpu_flags())
    for flag in features(by="cpu"):  # the OS-state ones (os_*) are not CPU flags
        assert (flag in ours) == (flag in linux), f"{flag}: extension {'has' if flag in ours else 'lacks'} it, /proc/cpuinfo disagrees"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_default_choice_is_the_best_serving_level(layout):
    isa, reason, is_fallback = moepack.kernel_choice(layout)
    assert isa == expected_choice(layout, host_isa()) and not is_fallback
    assert reason.startswith(f"{isa}: best ISA of this CPU for layout {layout.name}")
    serving = layout_isas(layout)
    if isa != serving[-1]:  # says why not the next level up that has a kernel for the layout
        nxt = serving[serving.index(isa) + 1]
        assert any(f"({nxt}: {why}" in reason for why in ("the CPU lacks", "the OS", "not an ")), reason  # not an arm CPU


def _caps_of_this_machine() -> list[str]:
    """The levels MOEPACK_MAX_ISA may name here: scalar and this architecture's."""
    import platform

    from moepack.isa import LEVELS, build_arch

    here = build_arch(platform.machine())
    return [lv.name for lv in LEVELS if lv.arch is None or (here is not None and lv.arch == here.name)]


@pytest.mark.parametrize("cap", _caps_of_this_machine())
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_max_isa_can_only_lower(monkeypatch, cap, layout):
    monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
    isa, reason, is_fallback = moepack.kernel_choice(layout)
    best = expected_choice(layout, ISAS[-1])
    want = expected_choice(layout, cap)
    assert isa == want
    assert max_isa() == ISAS[min(ISAS.index(cap), ISAS.index(host_isa()))]
    if want != best:
        assert reason == f"{want}: MOEPACK_MAX_ISA={cap} lowers the CPU's {best} for layout {layout.name}"
    else:  # the cap does not change the choice: no mention of it
        assert "best ISA of this CPU" in reason and "MOEPACK_MAX_ISA" not in reason
    assert not is_fallback and ": fallback:" not in reason  # a cap the user asked for is no fallback


def test_empty_max_isa_means_unset(monkeypatch):
    monkeypatch.setenv("MOEPACK_MAX_ISA", "")
    assert moepack.kernel_choice()[0] == expected_choice(LAYOUTS[0], host_isa())
    assert max_isa() == host_isa()


@pytest.mark.parametrize("bad", ["bogus", "AVX2", "avx", " scalar", "avx512bf16", "avxvnni"])
def test_invalid_max_isa(monkeypatch, bad):
    monkeypatch.setenv("MOEPACK_MAX_ISA", bad)
    with pytest.raises(ValueError, match=re.escape(f"MOEPACK_MAX_ISA='{bad}' is not one of {', '.join(ISAS)} (")):
        moepack.kernel_choice()


def test_max_isa_of_another_architecture_is_refused(monkeypatch):
    """A level of another architecture would lower nothing (x86: `neon`) or everything (ARM: an
    x86 level): the dispatcher and moepack.isa.max_isa refuse it in one line naming both."""
    import platform

    from moepack.isa import LEVELS, build_arch

    here = build_arch(platform.machine())
    other = next(lv.name for lv in LEVELS if lv.arch is not None and (here is None or lv.arch != here.name))
    monkeypatch.setenv("MOEPACK_MAX_ISA", other)
    with pytest.raises(ValueError, match=re.escape(f"MOEPACK_MAX_ISA='{other}' is a level of another architecture (")):
        moepack.kernel_choice()
    with pytest.raises(MoepackError, match=re.escape(f"MOEPACK_MAX_ISA={other!r} is a level of the ")):
        max_isa()


def test_kernel_choice_is_a_named_triple():
    choice = moepack.kernel_choice()
    assert isinstance(choice, tuple) and len(choice) == 3
    assert (choice.isa, choice.reason, choice.is_fallback) == (choice[0], choice[1], choice[2])
    assert isinstance(choice.is_fallback, bool)
    assert torch.ops.moepack.kernel_choice(LAYOUTS[0].id) == tuple(choice)


def BF16_LEVELS() -> list[str]:  # noqa: N802 - reads like the constant it stands for
    """The levels with a kernel for the default (bf16) layout that this host runs."""
    return [lv for lv in available_isas() if lv in KERNEL_ISAS["bf16"]]


def test_env_is_read_on_every_call(monkeypatch):
    if len(BF16_LEVELS()) < 2:
        skips.host_lacks(f"a second bf16 kernel level to switch to (this CPU runs {BF16_LEVELS()} only)")
    inp = make_moe_inputs(tokens=67, hidden=130, intermediate=88, topk=2, seed=60)
    packed = inp.pack()
    outs = {}
    for cap in BF16_LEVELS():
        monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
        assert moepack.kernel_choice()[0] == cap
        outs[cap] = run_packed(packed, inp)
    monkeypatch.setenv("MOEPACK_MAX_ISA", "scalar")
    assert torch.equal(run_packed(packed, inp), outs["scalar"])
    # fp32 results of different kernels differ in the last bits (summation order), so equal
    # outputs would mean the cap was ignored; 67x130 outputs never all agree by chance.
    assert not torch.equal(outs["scalar"], outs[BF16_LEVELS()[-1]])


@pytest.mark.parametrize("strict", ["1", "yes"])
def test_strict_with_a_cap_is_not_a_fallback(monkeypatch, strict):
    inp = make_moe_inputs(tokens=5, hidden=72, intermediate=40, topk=2, dtype=torch.bfloat16, bias=True, seed=61)
    packed = inp.pack()
    for cap in BF16_LEVELS():
        monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
        monkeypatch.delenv("MOEPACK_STRICT", raising=False)
        relaxed = run_packed(packed, inp)
        monkeypatch.setenv("MOEPACK_STRICT", strict)
        assert moepack.kernel_choice()[0] == cap
        assert torch.equal(run_packed(packed, inp), relaxed)


@pytest.mark.parametrize("value", ["0", ""])
def test_strict_off_values(monkeypatch, value):
    monkeypatch.setenv("MOEPACK_STRICT", value)
    inp = make_moe_inputs(tokens=2, hidden=72, intermediate=40, topk=1, seed=62)
    assert run_packed(inp.pack(), inp).shape == (2, 72)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_strict_never_refuses_on_this_host(monkeypatch, layout):
    """Every layout has a kernel at every level this host runs that serves it (no fallback to
    refuse): a strict run succeeds at each cap and the reason never reports a fallback. (The
    refusal rule itself is checked on simulated CPUs and kernel tables in tests/cpp: test_select.)"""
    monkeypatch.setenv("MOEPACK_STRICT", "1")
    for cap in available_isas():
        monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
        isa, reason, is_fallback = moepack.kernel_choice(layout)
        assert isa == expected_choice(layout, cap) and not is_fallback and ": fallback:" not in reason
        inp = make_moe_inputs(tokens=2, hidden=72, intermediate=40, topk=1, seed=64)
        assert run_packed(inp.pack(layout=layout), inp).shape == (2, 72)


def test_info_names_the_kernel_of_every_layout(monkeypatch):
    """`moepack info` (and --json) reports, per layout, the level its kernel runs at and why."""
    import json

    from moepack.cli.main import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["info", "--json"])
    assert r.exit_code == 0, r.output
    kernels = json.loads(r.output)["kernels"]
    assert set(kernels) == {lay.name for lay in LAYOUTS} | {f"{x.name} ({m})" for x in LAYOUTS for m in x.act_modes[1:]}
    for lay in LAYOUTS:
        for m in lay.act_modes[1:]:  # the other mode of a two-mode layout: its own entry
            key = f"{lay.name} ({m})"
            assert kernels[key]["isa"] == moepack.kernel_choice(lay, m).isa and kernels[key]["act_mode"] == m
        assert kernels[lay.name]["isa"] == expected_choice(lay, host_isa())
        assert kernels[lay.name]["reason"] == moepack.kernel_choice(lay)[1]
        assert kernels[lay.name]["is_fallback"] is moepack.kernel_choice(lay).is_fallback is False
    monkeypatch.setenv("MOEPACK_MAX_ISA", "scalar")
    r = CliRunner().invoke(app, ["info"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for lay in LAYOUTS:
        line = next(ln for ln in r.output.splitlines() if ln.startswith(f"kernel {lay.name}"))
        # another family's layouts run scalar as the CPU's best for them, capped or not
        assert "scalar: " in line and ("MOEPACK_MAX_ISA=scalar" in line or host_isa() == "scalar"
                                       or lay.family != host_family())


# ---- decode streams (csrc/dispatch.cpp decode_one_stream; read once per process) -----------------
_DECODE_CHILD = r"""
import sys, torch, moepack
from moepack._ops import decode_streams
g = torch.Generator().manual_seed(3)
E, H, I = 6, 200, 88  # awkward on purpose: neither a multiple of 32
w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
x = torch.randn(2, H, generator=g).to(torch.bfloat16)
ids = torch.tensor([[0, 3], [3, 5]], dtype=torch.int32)
w = torch.tensor([[0.7, 0.3], [0.5, 0.5]])
try:
    reason = decode_streams()
except ValueError as e:
    reason = "error: " + str(e)
outs = {}
for layout in ("bf16_n32k2_x86", "i8_n32k4_x86", "u4g32_n32k8_x86"):
    p = moepack.pack_experts(w13, w2, layout=layout)
    modes = ("a16", "a8") if layout.startswith("u4") else (None,)
    for m in modes:
        try:
            outs[(layout, m)] = moepack.run_experts(p, x, w, ids, act_mode=m).float()
        except ValueError as e:
            outs[(layout, m)] = str(e)
torch.save({"reason": reason, "outs": outs}, sys.argv[1])
"""


def _env_child(tmp_path, code, var, value):
    """Runs ``code`` (which saves its results to argv[1]) in a fresh process with ``var`` set to
    ``value`` (None: unset), and returns what it saved: the choices read once per process."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != var}
    if value is not None:
        env[var] = value
    out = tmp_path / f"{var}_{value}.pt"
    r = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return torch.load(out)


def _decode_child(tmp_path, value):
    return _env_child(tmp_path, _DECODE_CHILD, "MOEPACK_DECODE_STREAMS", value)


def test_decode_streams_choice_override_and_refusal(tmp_path):
    auto = _decode_child(tmp_path, None)
    vendor_amd = "AuthenticAMD" in pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else False
    assert auto["reason"].startswith("one stream" if vendor_amd else "4 K segments"), auto["reason"]
    one, seg = _decode_child(tmp_path, "1"), _decode_child(tmp_path, "4")
    assert one["reason"] == "one stream per weight block (MOEPACK_DECODE_STREAMS=1)"
    assert seg["reason"] == "4 K segments per weight block at once, 2 from 3 rows (MOEPACK_DECODE_STREAMS=4)"
    for key, a in one["outs"].items():
        b = seg["outs"][key]
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (key, a, b)
        # the same sums in another fp32 order, rounded to bf16: at most an ulp here and there
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-3), key
        # the unset variable reaches the kernels as the vendor's choice (bitwise: same code, same sums)
        assert torch.equal(auto["outs"][key], a if vendor_amd else b), key
    bad = _decode_child(tmp_path, "2")
    msg = "MOEPACK_DECODE_STREAMS='2' is not 1 or 4"
    assert bad["reason"].startswith("error: " + msg), bad["reason"]
    assert all(isinstance(v, str) and msg in v for v in bad["outs"].values()), bad["outs"]


# ---- the mxfp4 W4A16 decode's dot product (csrc/dispatch.cpp mx4_a16_fp32; read once per process) ----
_MX4_DOT_CHILD = r"""
import sys, torch, moepack
from moepack._ops import mx4_a16_dot
g = torch.Generator().manual_seed(4)
E, H, I = 5, 224, 96  # K multiples of 32 (the layout's group), neither of 64
w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
try:
    reason = mx4_a16_dot()
except ValueError as e:
    reason = "error: " + str(e)
outs = {}
p = moepack.pack_experts(w13, w2, layout="mx4g32_n32k8_x86")
for T in (1, 2):
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(T, H, generator=g).to(dt)
        ids = torch.tensor([[0, 3], [3, 4]][:T], dtype=torch.int32)
        w = torch.tensor([[0.7, 0.3], [0.5, 0.5]][:T])
        try:
            outs[(T, str(dt))] = moepack.run_experts(p, x, w, ids, act_mode="a16").float()
        except ValueError as e:
            outs[(T, str(dt))] = str(e)
torch.save({"reason": reason, "outs": outs}, sys.argv[1])
"""


def _mx4_dot_child(tmp_path, value):
    return _env_child(tmp_path, _MX4_DOT_CHILD, "MOEPACK_MX4_A16_DOT", value)


def test_mx4_a16_dot_choice_override_and_refusal(tmp_path):
    auto = _mx4_dot_child(tmp_path, None)
    vendor_amd = "AuthenticAMD" in pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else False
    assert auto["reason"].startswith("vdpbf16ps (AMD" if vendor_amd else "fp32 FMAs on a vpermps table ("), auto["reason"]
    f32, bf = _mx4_dot_child(tmp_path, "fp32"), _mx4_dot_child(tmp_path, "bf16")
    assert f32["reason"] == "fp32 FMAs on a vpermps table (MOEPACK_MX4_A16_DOT=fp32)"
    assert bf["reason"] == "vdpbf16ps (MOEPACK_MX4_A16_DOT=bf16)"
    for key, a in f32["outs"].items():
        b = bf["outs"][key]
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (key, a, b)
        # the same exact products summed in another fp32 order: at most an ulp of the output here and there
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-3), key
        # the unset variable reaches the kernels as the vendor's choice (bitwise: same code, same sums)
        assert torch.equal(auto["outs"][key], b if vendor_amd else a), key
        if key[1] == "torch.float32":  # fp32 rows take the fp32 kernel whatever the choice (where a level has it)
            assert torch.equal(a, b), key
    bad = _mx4_dot_child(tmp_path, "fp16")
    msg = "MOEPACK_MX4_A16_DOT='fp16' is not fp32 or bf16"
    assert bad["reason"].startswith("error: " + msg), bad["reason"]
    assert all(isinstance(v, str) and msg in v for v in bad["outs"].values()), bad["outs"]
