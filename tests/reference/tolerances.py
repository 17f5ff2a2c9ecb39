"""THE table of numerical tolerances of the test suite (SEMANTICS.md §4 is the starting point).

Every comparison of two MoE outputs in the tests goes through ``assert_close(actual, expected,
TOL[...])``. Two checks, both must hold:

* relative norm  ``‖a − e‖ / ‖e‖ <= rel_norm``  (fp32 norms);
* worst element  ``|a − e| <= elem_ulps · ulp(|e|) + rms_eps · eps · rms(e)``, ulp/eps of the
  OUTPUT dtype. The first term is "this element is at most N units in its own last place"; the
  second is an absolute floor at the scale of the whole output, because in MoE the error that
  one rounding difference of the intermediate ``a`` causes is absolute (it is spread by the
  down projection over every output of the token, whatever their own size), so elements that
  cancel to near zero legitimately differ by many of their own ulps.

The numbers were MEASURED (tests/reference/measure_errors.py over the kernel test matrix of
tests/support/kernel_cases.py and 6-25 extra random draws per shape; see each entry) and set with
headroom. Do not loosen one to make a failure go away: a failure is a finding (see the docstring
of each entry for what produces the error it bounds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    name: str
    dtype: torch.dtype  # the dtype of the result under test: its ulp and eps are the units
    rel_norm: float
    elem_ulps: float  # units of ulp(|expected|) in the output dtype
    rms_eps: float  # units of eps(output dtype) * rms(expected)
    why: str


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at |values| (subnormal spacing below the normal range)."""
    fi = torch.finfo(dtype)
    mag = values.abs().float().clamp(min=fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


@dataclass(frozen=True)
class Errors:
    rel_norm: float
    max_abs: float
    max_ulps: float  # max |a - e| / ulp(|e|)
    max_rms_eps: float  # max |a - e| / (eps * rms(e))


def errors(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> Errors:
    a, e = actual.float(), expected.float()
    d = (a - e).abs()
    eps = torch.finfo(dtype).eps
    rms = e.pow(2).mean().sqrt().clamp(min=torch.finfo(torch.float32).tiny)
    norm = e.norm()
    rel = (d.norm() / norm).item() if norm > 0 else (0.0 if d.max() == 0 else float("inf"))
    return Errors(
        rel_norm=rel,
        max_abs=d.max().item() if d.numel() else 0.0,
        max_ulps=(d / ulp(e, dtype)).max().item() if d.numel() else 0.0,
        max_rms_eps=(d / (eps * rms)).max().item() if d.numel() else 0.0,
    )


def elem_ratio(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> float:
    """max over elements of |a - e| / (elem_ulps * ulp(|e|) + rms_eps * eps * rms(e)); <= 1 passes."""
    dtype = tol.dtype
    a, e = actual.float(), expected.float()
    if e.numel() == 0:
        return 0.0
    d = (a - e).abs()
    rms = e.pow(2).mean().sqrt()
    bound = tol.elem_ulps * ulp(e, dtype) + tol.rms_eps * torch.finfo(dtype).eps * rms
    ratio = torch.where(d == 0, torch.zeros_like(d), d / bound)
    return ratio.max().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str = "") -> None:
    """``actual`` has ``tol.dtype``; ``expected`` has it too, or is fp32 (an fp32 pipeline)."""
    assert actual.dtype == tol.dtype, f"{what}: result dtype {actual.dtype}, expected {tol.dtype}"
    assert expected.dtype in (tol.dtype, torch.float32), f"{what}: expected dtype {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert bool(torch.isfinite(actual).all()), f"{what}: non-finite values in the result"
    err = errors(actual, expected, tol.dtype)
    ratio = elem_ratio(actual, expected, tol)
    msg = (
        f"{what} [{tol.name}]: rel-norm {err.rel_norm:.3g} (bound {tol.rel_norm:.3g}), worst element "
        f"{ratio:.3g} x its bound ({tol.elem_ulps:g} ulp + {tol.rms_eps:g} eps*rms); max abs {err.max_abs:.3g}, "
        f"max {err.max_ulps:.3g} ulp, max {err.max_rms_eps:.3g} eps*rms"
    )
    assert err.rel_norm <= tol.rel_norm and ratio <= 1.0, msg


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

TOL: dict[tuple[str, torch.dtype], Tolerance] = {}


def _add(kind: str, dtype: torch.dtype, rel_norm: float, elem_ulps: float, rms_eps: float, why: str) -> None:
    name = f"{kind}/{str(dtype).removeprefix('torch.')}"
    TOL[(kind, dtype)] = Tolerance(name, dtype, rel_norm, elem_ulps, rms_eps, why)


# ---- SIMD kernel vs the scalar C++ kernel (same packed weights, same rounding points) ---------
# fp32: only the fp32 summation order differs (AVX2 splits each dot product into even/odd-K
# accumulators, the scalar kernel sums in K order; the SIMD exp/sigmoid is ~1 ulp from libm).
# SEMANTICS.md's 1e-6 is kept as the contract. Measured over the matrix + 12 redraws (195
# cases): rel-norm 6.6e-7, worst element 36 eps*rms; 1500 extra draws of these shapes: 8.6e-7.
# NOTE the margin is thin and grows like eps*sqrt(H): at H in the thousands a correct kernel
# exceeds 1e-6 and this entry must become H-dependent (reported with this table).
_add("simd_vs_scalar", F32, 1e-6, 0, 128,
     "fp32 reordering only: rel-norm 6.6e-7 measured (1e-6 = SEMANTICS); worst elem 36 eps*rms measured")
# bf16/fp16 outputs: exact agreement is impossible, for two reasons: (1) the single final cast
# of the fp32 combine turns a 1e-7 fp32 difference into a 1-ulp flip when the value sits near a
# rounding boundary; (2) the intermediate a is stored in the activation dtype, so an fp32
# difference flips one element of a by one bf16/fp16 ulp now and then, and the down projection
# spreads that ABSOLUTE error over all H outputs of the token (up to ~10^2 of their own ulps for
# outputs near zero). Hence: 1 ulp of the element + 1 eps*rms of the output, and a rel-norm
# bound. Measured (195 cases): bf16 rel 2.5e-4, worst elem 0.58 of (1 ulp + 1 eps*rms);
# fp16 rel 4.6e-5 (3.9e-4 seen in extra draws at T=1, one flip over 200 outputs), 0.71.
_add("simd_vs_scalar", BF16, 2e-3, 1, 1,
     "final-cast and intermediate-rounding flips: rel 2.5e-4, elem 0.58x of (1 ulp + 1 eps*rms) measured")
_add("simd_vs_scalar", F16, 2e-3, 1, 1,
     "final-cast and intermediate-rounding flips: rel 3.9e-4, elem 0.71x of (1 ulp + 1 eps*rms) measured")

# ---- scalar C++ kernel vs moepack/reference.py (same rounding points, torch GEMMs) ------------
# fp32: the reference's F.linear sums in blocks, the scalar kernel in K order. The brief's
# 1e-5 rel-norm (measured 6.0e-7); worst element 55 eps*rms measured.
_add("scalar_vs_reference", F32, 1e-5, 0, 256,
     "fp32 summation order: rel 6.0e-7, worst elem 55 eps*rms measured")
# bf16/fp16: the reference rounds the intermediate and the output where the kernels do, so the
# same flips as SIMD-vs-scalar and nothing else. SEMANTICS.md's 1e-2 is the bound against an
# fp32 PIPELINE (next entry); here it would hide a kernel that skips the intermediate rounding
# (that kernel measures rel ~3e-3 and ~1.4x of the element bound against this reference), so
# this entry is much tighter. Measured (195 cases): bf16 rel 5.7e-4 / elem 0.61; fp16 8e-5 / 0.72.
_add("scalar_vs_reference", BF16, 2e-3, 1, 1,
     "same rounding points, flips only: rel 5.7e-4, elem 0.61x of (1 ulp + 1 eps*rms) measured")
_add("scalar_vs_reference", F16, 2e-3, 1, 1,
     "same rounding points, flips only: rel 8.0e-5, elem 0.72x of (1 ulp + 1 eps*rms) measured")

# ---- any kernel, bf16/fp16 activations vs an fp32 pipeline (SEMANTICS.md §4: <= 1e-2) ---------
# The fp32 pipeline is moe_reference on x.float(): no intermediate rounding, no final cast. The
# error is the bf16/fp16 rounding of a (about eps/sqrt(12) relative, spread by w2) plus the
# output cast. Measured (390 kernel results): bf16 rel 3.0e-3, worst elem 3.5 eps*rms; fp16 rel
# 3.9e-4, 3.2 eps*rms.
_add("half_vs_fp32_pipeline", BF16, 1e-2, 0, 8,
     "SEMANTICS 1e-2: rel 3.0e-3, worst elem 3.5 eps*rms measured")
_add("half_vs_fp32_pipeline", F16, 1e-2, 0, 8,
     "SEMANTICS 1e-2: rel 3.9e-4, worst elem 3.2 eps*rms measured")

# ---- expert parallelism: sum of the ranks' partial outputs vs one rank with every expert ------
# Same per-slot expert outputs (same rows per expert, so the same kernel tiles); only the fp32
# combine is grouped differently (per-rank partial sums, then the sum over ranks). Measured
# (320 runs, 2/3 ranks, k=2/5, scalar+avx2): rel 6.1e-8, worst elem 7.5 eps*rms. (k=1 is exact
# and tested with torch.equal.)
_add("expert_parallel_sum", F32, 5e-7, 0, 32,
     "fp32 combine regrouped: rel 6.1e-8, worst elem 7.5 eps*rms measured")

# ---- int8 W8A8 layouts (SEMANTICS.md §3 A8) -----------------------------------------------------
# The integer dot products of every kernel are EXACT and identical (tested directly, bitwise, in
# tests/schemes/int8/test_int8.py and tests/cpp), and the dequantization uses the same fp32 operations in the
# same order everywhere. What still differs between two correct implementations is the
# activation (libm vs a SIMD exp vs torch's), by an ulp; the intermediate is then RE-QUANTIZED,
# and a value within an ulp of a code boundary (x / scale = n + 1/2) can land on either code.
# One such flip moves the output by a_scale * w2 column, up to ~5e-3 relative at T = 1: far
# above 1e-5. So int8 comparisons accept rel <= rel_norm OR up to INT8_FLIPS single-flip
# effects (moepack.reference.moe_reference_int8(..., return_flip=True) computes that effect from
# the case's own data). Measured over the kernel test matrix (tests/support/kernel_cases.py) + 12
# redraws (585 cases):
#   scalar vs reference fp32: 1.0e-7 without a flip; ONE case with a flip, 1.9e-3 (its single-flip
#     effect 4.2e-3); bf16/fp16: bitwise equal in every case;
#   avx2 vs scalar: fp32 1.8e-7 (no flip seen); bf16 5.9e-5, fp16 3.8e-5 (intermediate dtype
#     rounding flips, then their codes);
#   any kernel vs the fp32 pipeline on the dequantized weights: 2.3e-2 worst (activation and
#     intermediate quantization noise; SEMANTICS.md: <= 3e-2).
INT8_FLIPS = 2.0
_add("int8_scalar_vs_reference", F32, 1e-5, 0, 0, "SEMANTICS 1e-5 + flips: 1.0e-7 measured without a flip")
_add("int8_scalar_vs_reference", BF16, 2e-3, 0, 0, "bitwise equal in 585 measured cases; flips allowed")
_add("int8_scalar_vs_reference", F16, 2e-3, 0, 0, "bitwise equal in 585 measured cases; flips allowed")
_add("int8_simd_vs_scalar", F32, 1e-6, 0, 0, "SEMANTICS 1e-6 (+ flips): 1.8e-7 measured")
_add("int8_simd_vs_scalar", BF16, 2e-3, 0, 0, "intermediate rounding flips: 5.9e-5 measured")
_add("int8_simd_vs_scalar", F16, 2e-3, 0, 0, "intermediate rounding flips: 3.8e-5 measured")
for _dt in (F32, BF16, F16):
    _add("int8_vs_fp32_dequantized", _dt, 3e-2, 0, 0, "SEMANTICS A8 3e-2: 2.3e-2 worst measured (585 cases)")


def assert_close_int8(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, flip: float = 0.0,
                      what: str = "") -> None:
    """Relative-norm check of int8 results: ``rel <= max(tol.rel_norm, INT8_FLIPS * flip / ‖e‖)``
    (``flip``: the single-flip effect of the case, 0 where flips cannot explain a difference)."""
    assert actual.dtype == tol.dtype, f"{what}: result dtype {actual.dtype}, expected {tol.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert bool(torch.isfinite(actual).all()), f"{what}: non-finite values in the result"
    e = expected.float()
    norm = e.norm().item()
    rel = (actual.float() - e).norm().item() / norm if norm > 0 else (actual.float() - e).norm().item()
    bound = max(tol.rel_norm, INT8_FLIPS * flip / norm if norm > 0 else 0.0)
    assert rel <= bound, (f"{what} [{tol.name}]: rel-norm {rel:.3g} > bound {bound:.3g} "
                          f"(base {tol.rel_norm:.3g}, single-flip effect {flip / max(norm, 1e-30):.3g} relative)")
