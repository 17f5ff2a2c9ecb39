"""Shared fixtures and input builders for the moepack test suite.

* Every test starts from fixed seeds (``_fixed_seeds``); inputs that a test builds itself come
  from ``make_moe_inputs(seed=...)`` with its own ``torch.Generator``, so a case produces the
  same tensors whatever ran before it (``-k`` selections, reordering, xdist).
* ``isa`` runs a test once per bf16 kernel path (every level with a bf16 kernel:
  ``moepack.isa.KERNEL_ISAS["bf16"]``, from moepack/isa_levels.py) by capping the dispatcher with ``MOEPACK_MAX_ISA``; a path this host cannot run is skipped with the reason, and a path that
  the dispatcher would not actually pick fails loudly (a test must never silently run a lower
  kernel than its name says). ``simd_isa`` is the same without the scalar baseline.
* Markers (pyproject.toml): ``vllm``, ``arm``, ``emulated``, ``slow``; a test marked ``vllm``,
  ``arm`` or ``emulated`` (or ``requires(name)``) runs only when what the Makefile provides for it
  is here (tests/support/skips.py ``require``: a failure under CI=true, else a ``missing:`` skip).
* The skip rule: a run in which any test was skipped for a reason outside the allowed kinds
  (``host lacks: ...``, ``engine <name>: ...``: tests/support/skips.py) fails, listing them.
* ``MOEPACK_TEST_CPU_LOG=FILE``: one line per test with its CPU seconds (tests/support/cpu_log.py;
  tools/test_suites.py sets it per suite and prints the largest).
* Inputs follow SEMANTICS.md §4: canonical weights ~ N(0, 1)/sqrt(fan_in) rounded to bf16 (the
  packed layout stores bf16, so the canonical weights the reference sees are exactly the packed
  values), routing = softmax top-k of random logits (ids int32, weights fp32, both contiguous).
"""

from __future__ import annotations

import math
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import moepack
from moepack.isa import KERNEL_ISAS, available_isas, host_isa, layout_isas
from moepack.pack import PackedExperts, pack_experts
from moepack.reference import moe_reference
from tests.support import cpu_log, skips
from tests.support.synthetic import SYNTH, write_synthetic_checkpoint

# torch.ops.moepack.* exist once the extension is loaded (importing moepack alone is lazy).
moepack.load_extension()

ALL_ISAS = KERNEL_ISAS["bf16"]  # the levels with a kernel for the default (bf16) layout
SIMD_ISAS = ALL_ISAS[1:]

# Scale of the hidden states. SEMANTICS.md §4 literally says x ~ N(0,1)/sqrt(H); a model's
# post-RMSNorm hidden state is ~N(0,1), and "hot" inputs (4x) drive the gate into the tails
# (sigmoid/exp saturation, tanh saturation, swigluoai clamping at the default limit=7).
X_SCALES = {
    "1/sqrt(H)": lambda h: 1.0 / math.sqrt(h),
    "1": lambda h: 1.0,
    "4": lambda h: 4.0,
}


@contextmanager
def isa_cap(isa: str):
    """MOEPACK_MAX_ISA=isa inside the block, whatever it was (the op reads it on every call)."""
    before = os.environ.get("MOEPACK_MAX_ISA")
    os.environ["MOEPACK_MAX_ISA"] = isa
    try:
        yield
    finally:
        if before is None:
            del os.environ["MOEPACK_MAX_ISA"]
        else:
            os.environ["MOEPACK_MAX_ISA"] = before


# ---------------------------------------------------------------------------------------------
# Markers, what they need, and the skip rule (tests/support/skips.py; docs/CONTRIBUTING.md)

GATED = ("emulated", "arm", "vllm")  # markers whose suites need something the Makefile provides


def pytest_collection_modifyitems(items):
    """``slow``: the test functions tests/support/slow.py lists (measured; keyed by file name and
    function). And the files of ``FIRST`` run first (a stable reorder): under pytest-xdist
    (``--dist loadfile``, tools/test_suites.py) files go to the workers in this order, and the
    longest file started last is what the whole suite waits for at its end."""
    from tests.support.slow import FIRST, SLOW

    for item in items:
        if f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in SLOW:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.path.name not in FIRST)


def pytest_runtest_setup(item):
    for name in GATED:
        if item.get_closest_marker(name) is not None:
            skips.require(name, name)
    for m in item.iter_markers("requires"):
        for name in m.args:
            marker = next((g for g in GATED if item.get_closest_marker(g) is not None), None)
            skips.require(name, marker)


_cpu_log = cpu_log.recorder_from_env()  # MOEPACK_TEST_CPU_LOG: per-test CPU seconds (tests/support/cpu_log.py)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    done = _cpu_log.measure(item.nodeid) if _cpu_log is not None else None
    yield
    if done is not None:
        done()


_offending: list[tuple[str, str]] = []  # (nodeid, reason) of skips outside the allowed kinds
_allowed: dict[str, int] = {}  # allowed reason -> count


def _skip_reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr)


def _note_skip(report) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report).removeprefix("Skipped: ")
    if skips.kind(reason) is None:
        _offending.append((report.nodeid, reason))
    else:
        _allowed[reason] = _allowed.get(reason, 0) + 1


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)  # a module skipped as a whole


def pytest_sessionfinish(session, exitstatus):
    if _offending and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _cpu_log is not None:
        _cpu_log.close()


def pytest_terminal_summary(terminalreporter):
    if not _offending:
        return
    tr = terminalreporter
    tr.section("skips outside the allowed kinds: this run FAILS", sep="!", red=True, bold=True)
    tr.line("A test may be skipped only for what this host cannot have ('host lacks: ...') or an engine that "
            "`make test` deliberately leaves out ('engine <name>: ...'); tests/support/skips.py. Install what is "
            "missing (make setup-test, make vllm-venv) or deselect its suite (-m \"not vllm and not arm and not "
            "emulated\").", red=True)
    by_reason: dict[str, list[str]] = {}
    for nodeid, reason in _offending:
        by_reason.setdefault(reason, []).append(nodeid)
    for reason, ids in by_reason.items():
        tr.line(f"{len(ids)} skipped: {reason}", red=True)
        for nodeid in ids[:5]:
            tr.line(f"    {nodeid}")
        if len(ids) > 5:
            tr.line(f"    ... and {len(ids) - 5} more")


@pytest.fixture(autouse=True)
def _fixed_seeds():
    torch.manual_seed(0)
    random.seed(0)
    yield


def _use_isa(isa: str, monkeypatch: pytest.MonkeyPatch) -> str:
    if isa not in available_isas():
        skips.host_lacks(f"{isa} kernels cannot run on this CPU (host ISA: {host_isa()}; flags: {moepack.cpu_flags()})")
    monkeypatch.setenv("MOEPACK_MAX_ISA", isa)
    monkeypatch.delenv("MOEPACK_STRICT", raising=False)
    chosen, reason, _ = moepack.kernel_choice()
    assert chosen == isa, f"MOEPACK_MAX_ISA={isa} but the dispatcher picks {chosen} ({reason})"
    return isa


@pytest.fixture(params=ALL_ISAS)
def isa(request, monkeypatch) -> str:
    """Runs the test on one kernel path (MOEPACK_MAX_ISA set for the test's duration)."""
    return _use_isa(request.param, monkeypatch)


# Every (layout, kernel level) pair this build has: the driver's routing, expert_map, strides,
# threads and refusals are shared by every scheme, so their tests run on each pair.
LAYOUT_ISAS = [(lay, lv) for lay in moepack.LAYOUTS for lv in layout_isas(lay)]


@pytest.fixture(params=LAYOUT_ISAS, ids=[f"{lay.name}-{lv}" for lay, lv in LAYOUT_ISAS])
def layout_isa(request, monkeypatch):
    """(layout, isa): the test packs with ``layout`` and runs on kernel level ``isa``."""
    lay, lv = request.param
    if lv not in available_isas():
        skips.host_lacks(f"{lv} kernels cannot run on this CPU (host ISA: {host_isa()})")
    monkeypatch.setenv("MOEPACK_MAX_ISA", lv)
    monkeypatch.delenv("MOEPACK_STRICT", raising=False)
    chosen, reason, _ = moepack.kernel_choice(lay)
    assert chosen == lv, f"MOEPACK_MAX_ISA={lv} but the dispatcher picks {chosen} for {lay.name} ({reason})"
    return lay


@pytest.fixture(params=SIMD_ISAS)
def simd_isa(request, monkeypatch) -> str:
    """A SIMD kernel path; tests switch to "scalar" themselves for their baseline."""
    return _use_isa(request.param, monkeypatch)


@pytest.fixture
def threads():
    """Restores torch's intra-op thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@dataclass
class MoeInputs:
    """One MoE layer call: canonical weights, activations and routing (E experts, top-k)."""

    x: torch.Tensor  # [T, H] in the activation dtype
    w13: torch.Tensor  # [E, 2I, H] bf16 (gate then up, or interleaved pairs)
    w2: torch.Tensor  # [E, H, I] bf16
    w13_bias: torch.Tensor | None  # [E, 2I] fp32
    w2_bias: torch.Tensor | None  # [E, H] fp32
    topk_weights: torch.Tensor  # [T, k] fp32, contiguous
    topk_ids: torch.Tensor  # [T, k] int32, contiguous
    interleaved: bool

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def pack(self, **kw) -> PackedExperts:
        return pack_experts(self.w13, self.w2, self.w13_bias, self.w2_bias, interleaved=self.interleaved, **kw)


def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SEMANTICS.md §1 default routing: top-k of the logits, softmax(all logits) at those ids."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return weights.float().contiguous(), ids.to(torch.int32).contiguous()


def make_moe_inputs(
    *,
    tokens: int,
    hidden: int,
    intermediate: int,
    experts: int = 5,
    topk: int = 2,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    interleaved: bool = False,
    x_scale: str = "1",
    bias_scale: float = 0.1,
    seed: int = 0,
) -> MoeInputs:
    """Realistic random inputs for one MoE call (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    h, i, e = hidden, intermediate, experts
    x = (torch.randn(tokens, h, generator=g) * X_SCALES[x_scale](h)).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h)).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / math.sqrt(i)).to(torch.bfloat16)
    b13 = torch.randn(e, 2 * i, generator=g) * bias_scale if bias else None
    b2 = torch.randn(e, h, generator=g) * bias_scale if bias else None
    weights, ids = softmax_topk(torch.randn(tokens, e, generator=g), topk)
    return MoeInputs(x, w13, w2, b13, b2, weights, ids, interleaved)


def run_packed(
    packed: PackedExperts,
    inp: MoeInputs,
    *,
    x: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    **kw,
) -> torch.Tensor:
    """moepack.fused_experts on ``packed`` with ``inp``'s activations/routing (overridable)."""
    return moepack.fused_experts(
        inp.x if x is None else x,
        packed.weight("w13"),
        packed.weight("w2"),
        inp.topk_weights if topk_weights is None else topk_weights,
        inp.topk_ids if topk_ids is None else topk_ids,
        layout=packed.layout,
        interleaved=packed.interleaved,
        w13_bias=packed.w13_bias,
        w2_bias=packed.w2_bias,
        **kw,
    )


def reference(inp: MoeInputs, **kw) -> torch.Tensor:
    """moepack.reference.moe_reference on ``inp``'s canonical weights."""
    kw.setdefault("interleaved", inp.interleaved)
    return moe_reference(
        inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, **kw
    )


# ---------------------------------------------------------------------------------------------
# The synthetic ~190 MB checkpoint (tests/support/synthetic.py) of the convert-streaming and
# open-memory tests: written once, and converted once, per test session.


@pytest.fixture(scope="session")
def synthetic_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    """The SYNTH checkpoint: (its directory, its tensor bytes)."""
    path = tmp_path_factory.mktemp("synthetic") / "src"
    return path, write_synthetic_checkpoint(path, **SYNTH)


@pytest.fixture(scope="session")
def synthetic_packed(synthetic_checkpoint) -> Path:
    """The SYNTH checkpoint converted (in this process)."""
    src, _ = synthetic_checkpoint
    dst = src.parent / "packed"
    moepack.convert(src, dst)
    return dst
