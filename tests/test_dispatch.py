"""Kernel selection (csrc/dispatch.cpp, csrc/torch/ops.cpp select_or_throw): what runs, why, and
how MOEPACK_MAX_ISA / MOEPACK_STRICT change it.

The contract as implemented:
* the host ISA is the best of scalar < avx2 < avx512 that cpuid AND xgetbv allow;
* MOEPACK_MAX_ISA (read on every call) can only LOWER it; a value above the host is the host;
  an unknown value is a ValueError;
* the chosen kernel is the best REGISTERED one at or below min(cap, host); if that is below
  min(cap, host) (no kernel for the layout at the wanted ISA) it is a fallback, reported in the
  reason, and MOEPACK_STRICT=1 turns exactly that into an error. A cap the user asked for is
  not a fallback, so MOEPACK_STRICT=1 with a cap below the host still runs.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import moepack
from moepack.isa import ISAS, available_isas, host_isa, max_isa
from moepack.layout import LAYOUTS
from tests.conftest import make_moe_inputs, run_packed


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("MOEPACK_MAX_ISA", raising=False)
    monkeypatch.delenv("MOEPACK_STRICT", raising=False)


def expected_host_isa(flags: set[str]) -> str:
    avx2 = {"avx2", "fma", "f16c", "os_avx"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "os_avx512"} <= flags
    return "avx512" if avx512 else "avx2" if avx2 else "scalar"


def test_host_isa_matches_cpu_flags():
    flags = moepack.cpu_flags()
    host_flags = [f for f in flags if f.startswith("host_isa=")]
    assert len(host_flags) == 1
    assert host_isa() == host_flags[0].split("=", 1)[1] == expected_host_isa(set(flags))
    assert available_isas() == list(ISAS[: ISAS.index(host_isa()) + 1])
    assert available_isas()[0] == "scalar"


def test_cpu_flags_agree_with_the_kernel():
    """cpuid as the extension reads it vs /proc/cpuinfo (Linux clears flags the OS disables)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this OS")
    line = next((x for x in cpuinfo.read_text().splitlines() if x.startswith("flags")), None)
    if line is None:
        pytest.skip("/proc/cpuinfo has no flags line (not x86?)")
    linux = set(line.split(":", 1)[1].split())
    ours = set(moepack.cpu_flags())
    for flag in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"):
        assert (flag in ours) == (flag in linux), f"{flag}: extension {'has' if flag in ours else 'lacks'} it, /proc/cpuinfo disagrees"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_default_choice_is_the_host_isa(layout):
    isa, reason = moepack.kernel_choice(layout)
    assert isa == host_isa() == max_isa()
    assert reason.startswith(f"{isa}: best ISA of this CPU")
    if isa != "avx512":  # says why not the next one up
        nxt = ISAS[ISAS.index(isa) + 1]
        assert f"({nxt}: " in reason


@pytest.mark.parametrize("cap", ISAS)
def test_max_isa_can_only_lower(monkeypatch, cap):
    monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
    isa, reason = moepack.kernel_choice()
    host = host_isa()
    want = ISAS[min(ISAS.index(cap), ISAS.index(host))]
    assert isa == want == max_isa()
    if ISAS.index(cap) < ISAS.index(host):
        assert reason == f"{cap}: MOEPACK_MAX_ISA={cap} lowers the CPU's {host}"
    else:  # at or above the host: not lowered, no mention of the cap
        assert "best ISA of this CPU" in reason and "MOEPACK_MAX_ISA" not in reason


def test_empty_max_isa_means_unset(monkeypatch):
    monkeypatch.setenv("MOEPACK_MAX_ISA", "")
    assert moepack.kernel_choice()[0] == host_isa() == max_isa()


@pytest.mark.parametrize("bad", ["bogus", "AVX2", "avx", " scalar", "avx512bf16"])
def test_invalid_max_isa(monkeypatch, bad):
    monkeypatch.setenv("MOEPACK_MAX_ISA", bad)
    with pytest.raises(ValueError, match=f"MOEPACK_MAX_ISA='{bad}' is not one of scalar, avx2, avx512"):
        moepack.kernel_choice()


def test_env_is_read_on_every_call(monkeypatch):
    if len(available_isas()) < 2:
        pytest.skip("one ISA only: nothing to switch between")
    inp = make_moe_inputs(tokens=67, hidden=130, intermediate=88, topk=2, seed=60)
    packed = inp.pack()
    outs = {}
    for cap in available_isas():
        monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
        assert moepack.kernel_choice()[0] == cap
        outs[cap] = run_packed(packed, inp)
    monkeypatch.setenv("MOEPACK_MAX_ISA", "scalar")
    assert torch.equal(run_packed(packed, inp), outs["scalar"])
    # fp32 results of different kernels differ in the last bits (summation order), so equal
    # outputs would mean the cap was ignored; 67x130 outputs never all agree by chance.
    assert not torch.equal(outs["scalar"], outs[available_isas()[-1]])


@pytest.mark.parametrize("strict", ["1", "yes"])
def test_strict_with_a_cap_is_not_a_fallback(monkeypatch, strict):
    inp = make_moe_inputs(tokens=5, hidden=72, intermediate=40, topk=2, dtype=torch.bfloat16, bias=True, seed=61)
    packed = inp.pack()
    for cap in available_isas():
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
    """Every layout has a kernel at every ISA this host runs (no fallback to refuse): a strict
    run succeeds at each cap and the reason never reports a missing kernel. (The refusal path
    itself needs a layout without a SIMD kernel; none exists yet.)"""
    monkeypatch.setenv("MOEPACK_STRICT", "1")
    for cap in available_isas():
        monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
        isa, reason = moepack.kernel_choice(layout)
        assert isa == cap and "kernel is registered" not in reason  # the fallback wording
        inp = make_moe_inputs(tokens=2, hidden=72, intermediate=40, topk=1, seed=64)
        assert run_packed(inp.pack(layout=layout), inp).shape == (2, 72)

