"""mxfp4 experts (layout mx4g32_n32k8_x86; e2m1 codes, one e8m0 scale per 32 K): the kernels.

The Python scheme (moepack/schemes/mxfp4) is not what this file tests: the packed tensors are built
here from the layout's declaration (``pack_codes`` puts each 4-bit code where the layout says; the
e8m0 bytes transposed to [E, ceil(Kp / 32), Np] in packed row order, 0 in padding), and the values
come from moepack.schemes.mxfp4.codec (the exact decode, in torch).

Trust chain (ARCHITECTURE.md principle 6):
* one block through each level's real path (``torch.ops.moepack.grouped_block``): with one-hot
  rows C is one weight, so every (e2m1 code, e8m0) pair (e = 0 .. 254, the extremes 0, 1, 126,
  127, 253, 254 included) equals the fp32 value exactly (infinite where the product overflows
  fp32), in A16 (fp32 and bf16 rows) and A8 (one-hot s8 rows: 2 * e2m1(q) * 2^(e - 128));
  e = 255 (NaN, refused at convert and open) gives NaN on every level;
* the A8 integer core (``dot_u4_block`` on the mxfp4 layout): every level's accumulators equal
  the exact integer matmul of s8 rows with 2 * e2m1(q);
* the fused kernel: scalar against ``moe_reference`` on the dequantized weights (A16) and against
  ``moe_reference_a8`` around ``int4_linear_a8_reference`` with w_q = 2 * e2m1(q), zero 0, scale
  2^(e - 128) (A8), every SIMD level this host runs against scalar, over every activation
  (swigluoai with alpha and limit), biases, expert_map, T = 1, 3, 17, 64 and shapes that are not
  multiples of 32 (H = 72, I = 40, E = 3).
"""

from __future__ import annotations

import functools

import pytest
import torch

import moepack
from moepack.isa import MODE_ISAS, available_isas
from moepack.layout import MXFP4_LAYOUT, layout_code_position, layout_expert_shapes, layout_padded_i, layout_padded_k, layout_padded_n
from moepack.pack import PackedExperts, pack_biases, pack_codes, pad_intermediate, unpack_codes, with_biases
from moepack.reference import moe_reference, moe_reference_a8
from moepack.schemes.int4.reference import int4_linear_a8_reference
from moepack.schemes.mxfp4.codec import E2M1_VALUES, decode_e2m1, dequantize_mxfp4, e8m0_to_float
from tests.conftest import isa_cap, make_moe_inputs
from tests.support.kernel_cases import Case
from tests.reference.tolerances import TOL, assert_close, assert_close_int8
from tests.support import skips

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = torch.ops.moepack
MX4 = MXFP4_LAYOUT
BN = MX4.block_n
# 2 * e2m1(q): the A8 integer weights
E2M1_X2 = torch.tensor([int(2 * v) for v in E2M1_VALUES], dtype=torch.int64)


def pow2_exact(e: torch.Tensor, bias: int) -> torch.Tensor:
    """2^(e - bias) in fp32, exactly (float64 then one exact conversion: every such power with
    e - bias >= -149 is an fp32 number)."""
    return torch.pow(2.0, e.double() - bias).float()


def level_isas(mode: str) -> list[str]:
    """Every level with an mxfp4 kernel of ``mode`` that this host runs (scalar first)."""
    out = []
    for isa in MODE_ISAS[("e2m1", mode)]:
        if isa in available_isas():
            out.append(isa)
    return out


def isas_running(mode: str) -> list[str]:
    """The SIMD levels the dispatcher picks for the mxfp4 layout in ``mode`` (each with the cap at it)."""
    out = []
    for isa in available_isas():
        if isa == "scalar":
            continue
        with isa_cap(isa):
            if moepack.kernel_choice(MX4, mode).isa == isa:
                out.append(isa)
    return out


def pack_block(q: torch.Tensor) -> torch.Tensor:
    """Codes [32, kp] of one column block -> its packed bytes [32 * kp / 2]."""
    return pack_codes(MX4, q.to(torch.uint8)).reshape(-1).contiguous()


# One block, every (code, exponent) pair
# ---------------------------------------------------------------------------------------------

KP_ALL = 256  # 8 groups x 32 columns = 256 exponents per block: every e8m0 byte once
EXTREMES = (0, 1, 126, 127, 253, 254)


def all_pairs_block() -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [32, 256], exponents [8, 32]): code(n, k) = (k + n) % 16 (each column sees every code
    twice per group), e[g, n] = 32 g + n, so bytes 0..254 and 255 (column 31 of group 7) each
    appear once; the caller replaces 255 where it wants finite results."""
    n = torch.arange(BN).reshape(-1, 1)
    k = torch.arange(KP_ALL).reshape(1, -1)
    q = ((k + n) % 16).to(torch.uint8)
    e = (torch.arange(KP_ALL // 32).reshape(-1, 1) * 32 + torch.arange(BN).reshape(1, -1)).to(torch.uint8)
    return q, e


def one_hot_run(isa: str, mode: str, q: torch.Tensor, e: torch.Tensor, dtype=F32, rows_per_call: int = 64) -> torch.Tensor:
    """C [kp, 32] of one block through ``isa``'s path, row k one-hot at K k: C[k, n] = w(n, k).
    ``rows_per_call`` rows a block call (1 to 4: the few-row A16 decode kernels)."""
    kp = q.shape[1]
    codes = pack_block(q)
    out = []
    for k0 in range(0, kp, rows_per_call):
        m = min(rows_per_call, kp - k0)
        if mode == "a16":
            rows = torch.zeros(m, kp, dtype=dtype)
            rows[torch.arange(m), k0 + torch.arange(m)] = 1
            out.append(OPS.grouped_block(rows, codes, e.contiguous(), None, None, MX4.id, isa, "a16"))
        else:
            rows = torch.zeros(m, kp, dtype=torch.int8)
            rows[torch.arange(m), k0 + torch.arange(m)] = 1
            out.append(OPS.grouped_block(rows, codes, e.contiguous(), None, torch.ones(m), MX4.id, isa, "a8"))
    return torch.cat(out)


def expected_weights(q: torch.Tensor, e: torch.Tensor, mode: str) -> torch.Tensor:
    """[kp, 32]: the exact fp32 weight of each (column n, K k), as C[k, n] of one_hot_run."""
    eg = e.repeat_interleave(32, dim=0)[: q.shape[1]].t()  # [32, kp]
    if mode == "a16":
        w = decode_e2m1(q) * e8m0_to_float(eg)
    else:  # float(1 * 2 e2m1(q)) * 2^(e - 128), times the row scale 1
        w = E2M1_X2[q.long()].float() * pow2_exact(eg, 128)
    return w.t()


def test_codec_tables_are_the_contract():
    """The torch decode this file checks against: e8m0 bytes are exact powers of two (2^-127 a
    subnormal), 2 * e2m1 the integers the A8 core multiplies."""
    e = torch.arange(255)
    assert torch.equal(e8m0_to_float(e.to(torch.uint8)), pow2_exact(e, 127))
    assert int(e8m0_to_float(torch.tensor([0], dtype=torch.uint8)).view(torch.int32)) == 0x00400000
    assert torch.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()
    assert E2M1_X2.tolist() == [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


@pytest.mark.parametrize("mode", ["a16", "a8"])
def test_every_code_and_exponent_exact_on_every_level(mode):
    q, e = all_pairs_block()
    e[7, 31] = 127  # 255 is checked below; every other byte stays
    want = expected_weights(q, e, mode)
    finite = torch.isfinite(want)
    assert (~finite).any() and finite.sum() > 0.9 * want.numel()  # the overflowing products are in the test
    isas = level_isas(mode)
    assert isas[0] == "scalar"
    for isa in isas:
        # A16: fp32 and bf16 rows 64 a call, and bf16 rows 1 and 2 a call (the decode kernels)
        runs = ((F32, 64), (BF16, 64), (F32, 1), (BF16, 1), (BF16, 2)) if mode == "a16" else ((F32, 64),)
        for dt, rpc in runs:
            got = one_hot_run(isa, mode, q, e, dt, rpc)
            what = f"{isa} {mode} {dt} {rpc} rows a call"
            assert torch.equal(got[finite], want[finite]), f"{what}: a finite weight differs"
            assert torch.equal(got[~finite], want[~finite]), f"{what}: an overflowing weight is not that inf"
            # the signs and the subnormals bit for bit (torch.equal takes -0 == +0 and compares values)
            sub = finite & (want != 0)
            assert torch.equal(got[sub].view(torch.int32), want[sub].view(torch.int32)), f"{what}: bits differ"


@pytest.mark.parametrize("mode", ["a16", "a8"])
@pytest.mark.parametrize("ex", EXTREMES)
def test_extreme_exponents_every_code(mode, ex):
    """e in {0, 1, 126, 127, 253, 254} on every column and group: all 16 codes, each level."""
    n = torch.arange(BN).reshape(-1, 1)
    k = torch.arange(64).reshape(1, -1)
    q = ((k * 3 + n) % 16).to(torch.uint8)
    e = torch.full((2, BN), ex, dtype=torch.uint8)
    want = expected_weights(q, e, mode)
    runs = ((F32, 64), (F32, 2), (BF16, 1), (BF16, 2)) if mode == "a16" else ((F32, 64),)
    for isa in level_isas(mode):
        for dt, rpc in runs:
            got = one_hot_run(isa, mode, q, e, dt, rpc)
            what = f"{isa} {mode} e={ex} {dt} {rpc} rows a call"
            same = got == want  # the overflowing products: inf == inf
            assert bool(same.all()), f"{what}: {got[~same][:4].tolist()} != {want[~same][:4].tolist()}"
            nz = want != 0
            assert torch.equal(got[nz].view(torch.int32), want[nz].view(torch.int32)), f"{what}: bits"


@pytest.mark.parametrize("mode", ["a16", "a8"])
def test_nan_exponent_gives_nan_on_every_level(mode):
    """e = 255 (e8m0 NaN) never comes from convert or open; a hostile pack gets NaN in exactly its
    column (every row), on every level alike."""
    q = (torch.arange(64).reshape(1, -1) + torch.arange(BN).reshape(-1, 1)) % 16
    e = torch.full((2, BN), 120, dtype=torch.uint8)
    e[1, 5] = 255
    gen = torch.Generator().manual_seed(5)
    for isa in level_isas(mode):
        if mode == "a16":
            rows = torch.randn(3, 64, generator=gen)
            out = OPS.grouped_block(rows, pack_block(q), e, None, None, MX4.id, isa, "a16")
        else:
            rows = torch.randint(-127, 128, (3, 64), generator=gen, dtype=torch.int8)
            out = OPS.grouped_block(rows, pack_block(q), e, None, torch.full((3,), 0.01), MX4.id, isa, "a8")
        want = torch.zeros(3, BN, dtype=torch.bool)
        want[:, 5] = True
        assert torch.equal(out.isnan(), want), f"{isa} {mode}"


def test_a16_random_rows_on_every_level():
    """Random rows (fp32, bf16, fp16), codes and exponents over 5 groups: each level against the
    fp64 sum of (x . e2m1(q_g)) * 2^(e - 127), and against scalar, within fp32 summation order."""
    gen = torch.Generator().manual_seed(11)
    kp = 160
    q = torch.randint(0, 16, (BN, kp), generator=gen, dtype=torch.uint8)
    e = torch.randint(110, 140, (5, BN), generator=gen, dtype=torch.uint8)
    for dt in (F32, BF16, F16):
        rows = torch.randn(7, kp, generator=gen).to(dt)
        w = (decode_e2m1(q).double() * e8m0_to_float(e.repeat_interleave(32, 0).t()).double())  # [32, kp]
        ref = (rows.double() @ w.t()).float()
        scalar = OPS.grouped_block(rows, pack_block(q), e, None, None, MX4.id, "scalar", "a16")
        for isa in level_isas("a16"):
            # 7 rows a call, and 1, 2 and 4 (the few-row decode kernels)
            got = OPS.grouped_block(rows, pack_block(q), e, None, None, MX4.id, isa, "a16")
            for m in (1, 2, 4):
                few = torch.cat([OPS.grouped_block(rows[i : i + m].contiguous(), pack_block(q), e, None, None, MX4.id, isa, "a16")
                                 for i in range(0, 7, m)])
                for g, what in ((got, "7 rows"), (few, f"{m} rows a call")):
                    rel = ((g.double() - ref.double()).norm() / ref.double().norm()).item()
                    assert rel < 1e-6, f"{isa} {dt} {what}: rel {rel}"
                    rel_s = ((g.double() - scalar.double()).norm() / scalar.double().norm()).item()
                    assert rel_s < 1e-6, f"{isa} {dt} {what} vs scalar: rel {rel_s}"


def test_a16_few_rows_subnormal_activations():
    """Which few-row A16 kernel ran, told apart by what they do with subnormal bf16 activations:
    the fp32 FMA kernel (``avx512_mx4_f32.h``) takes them as they are, so 1 or 2 rows of 2^-127
    against code 1.0 at e = 200 give the exact 64 * 2^-127 * 2^73 per column; ``vdpbf16ps`` treats
    subnormal inputs as 0 (docs/KERNELS.md "mxfp4 W4A16 decode"), so where it runs the columns are
    0. fp32 FMAs run for bf16 rows on the BF16 levels where the process's choice is fp32
    (``MOEPACK_MX4_A16_DOT``; the other choice runs this in a subprocess below), and on the
    avx512 level (fp32 rows) and scalar always."""
    from moepack._ops import mx4_a16_dot

    fp32_dot = mx4_a16_dot().startswith("fp32")
    kp = 64
    q = torch.full((BN, kp), 2, dtype=torch.uint8)  # e2m1 code 2 = 1.0
    e = torch.full((2, BN), 200, dtype=torch.uint8)
    exact = torch.tensor(kp * 2.0**-127 * 2.0**73, dtype=torch.float32)
    assert exact.item() == 2.0**-48
    for m in (1, 2):
        rows = torch.full((m, kp), 2.0**-127).to(BF16)
        assert rows.view(torch.int16)[0, 0].item() == 0x0040  # a bf16 subnormal, exactly 2^-127
        for isa in level_isas("a16"):
            got = OPS.grouped_block(rows, pack_block(q), e, None, None, MX4.id, isa, "a16")
            if isa in ("avx512_bf16", "amx_bf16") and not fp32_dot:
                want = torch.zeros(m, BN)
            elif isa in ("scalar", "avx512", "avx512_bf16", "amx_bf16"):
                want = exact.expand(m, BN)
            else:
                continue  # the other levels' dense paths: not what this test tells apart
            assert torch.equal(got, want), f"{isa} m={m} ({mx4_a16_dot()}): {got[0, :4].tolist()}"


def test_a8_integer_core_identical_on_every_level():
    """dot_u4_block on the mxfp4 layout: acc = x_s8 . 2 e2m1(q) exactly, on every level, over every
    K sub-range of whole runs (one group, several, a run inside a group)."""
    gen = torch.Generator().manual_seed(12)
    kp = 288
    q = torch.randint(0, 16, (BN, kp), generator=gen, dtype=torch.uint8)
    rows = torch.randint(-127, 128, (13, kp), generator=gen, dtype=torch.int8)
    rows[0] = 127
    rows[1] = -127
    q[:, :32] = 7  # +6 everywhere: the largest |acc| of a group (127 * 12 * 32)
    block = pack_block(q)
    wint = E2M1_X2[q.long()]
    isas = level_isas("a8")
    assert isas[0] == "scalar"
    for k0, kk in ((0, 32), (0, 288), (32, 64), (8, 16), (280, 8)):
        want = (rows[:, k0 : k0 + kk].long() @ wint[:, k0 : k0 + kk].t()).to(torch.int32)
        for isa in isas:
            got = OPS.dot_u4_block(rows, block, k0, kk, MX4.id, isa)
            assert torch.equal(got, want), f"{isa} K [{k0}, {k0 + kk})"


def test_a8_block_matches_the_contract_on_every_level():
    """grouped_block a8 with random s8 rows: int4_linear_a8_reference with w_q = 2 e2m1(q), zero 0,
    scale 2^(e - 128), row scale last; every level bit for bit (the integer core is exact and the
    epilogue's order is the contract's)."""
    gen = torch.Generator().manual_seed(13)
    kp = 192
    q = torch.randint(0, 16, (BN, kp), generator=gen, dtype=torch.uint8)
    e = torch.randint(100, 150, (kp // 32, BN), generator=gen, dtype=torch.uint8)
    e[0, 0], e[1, 1], e[2, 2] = 0, 1, 254
    rows = torch.randint(-127, 128, (9, kp), generator=gen, dtype=torch.int8)
    rs = torch.rand(9, generator=gen) * 0.01
    want = int4_linear_a8_reference(rows.float(), rs.reshape(-1, 1), E2M1_X2[q.long()].float(),
                                    pow2_exact(e.t(), 128), torch.zeros(BN, kp // 32), 32, None)  # fmt: skip
    for isa in level_isas("a8"):
        got = OPS.grouped_block(rows, pack_block(q), e, None, rs, MX4.id, isa, "a8")
        assert torch.equal(got, want), f"{isa}: {(got - want).abs().max().item()}"


# A8 on amx_int8: tiles with the e8m0 scales folded into the integer weights
# ---------------------------------------------------------------------------------------------

FOLD_CHUNK, FOLD_SUB, FOLD_SHIFT, FOLD_MIN_E, FOLD_MAX_E = 256, 64, 3, 2, 230  # avx512_mx4_amx_int8.h


def fold_plan(e: torch.Tensor) -> list[tuple[int, int, bool]]:
    """The amx_int8 tile kernel's plan for a block's e8m0 bytes e [ng, 32]: (k0, kk, folded) pieces
    in K order. The whole K is one folded piece when every column's bytes over all its groups lie
    within 3 of their minimum and in [2, 230] (and kp is a multiple of 64); else a chunk of 256 K
    folds when it fits so (and kk is a multiple of 64); else its 64-K sub-chunks, each folded when
    it fits, and single groups for the rest."""
    kp = e.shape[0] * 32

    def fits(k0, kk):
        g = e[k0 // 32 : (k0 + kk) // 32].int()
        lo, hi = g.min(0).values, g.max(0).values
        return bool(((hi - lo) <= FOLD_SHIFT).all() and (lo >= FOLD_MIN_E).all() and (hi <= FOLD_MAX_E).all())

    if kp % FOLD_SUB == 0 and fits(0, kp):
        return [(0, kp, True)]
    out = []
    for c0 in range(0, kp, FOLD_CHUNK):
        kk = min(FOLD_CHUNK, kp - c0)
        if kk % FOLD_SUB == 0 and fits(c0, kk):
            out.append((c0, kk, True))
            continue
        for s0 in range(c0, c0 + kk, FOLD_SUB):
            sk = min(FOLD_SUB, c0 + kk - s0)
            if sk == FOLD_SUB and fits(s0, sk):
                out.append((s0, sk, True))
            else:
                out.extend((g0, 32, False) for g0 in range(s0, s0 + sk, 32))
    return out


def folded_a8_expected(rows: torch.Tensor, rs: torch.Tensor, q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """C of the amx_int8 tile kernel, computed independently: per piece of fold_plan in K order, a
    folded piece's exact integer sum x . (2 e2m1(q) << (e - e_min)), rounded to fp32 (exact below
    2^24: a 256-K chunk's always is), times 2^(e_min - 128) (a normal power of two: exact); a
    group's float(acc_g) * 2^(e - 128); the terms added to C in fp32, C times the row scale last."""
    w = E2M1_X2[q.long()]  # [32, kp]
    x = rows.long()
    C = torch.zeros(rows.shape[0], BN, dtype=torch.float32)
    for k0, kk, folded in fold_plan(e):
        g = e[k0 // 32 : (k0 + kk) // 32].long()  # [groups, 32]
        if folded:
            emin = g.min(0).values
            shift = (g - emin).repeat_interleave(32, dim=0).t()  # [32, kk]
            acc = x[:, k0 : k0 + kk] @ (w[:, k0 : k0 + kk] << shift).t()
            assert acc.abs().max() < 2**31
            C = C + acc.float() * pow2_exact(emin, 128)  # int64 -> fp32: round to nearest even, as vcvtdq2ps
        else:
            acc = x[:, k0 : k0 + kk] @ w[:, k0 : k0 + kk].t()
            C = C + acc.float() * pow2_exact(g[0], 128)
    return C * rs.reshape(-1, 1)


def fold_case(kind: str, ng: int, gen: torch.Generator) -> torch.Tensor:
    """e8m0 bytes [ng, 32] of one kind of block (test_a8_folded_tiles)."""
    if kind == "fits":  # every chunk folds: spans of at most 3, chunk c's bytes 5c higher
        e = torch.randint(119, 123, (ng, BN), generator=gen, dtype=torch.uint8)
        return e + (torch.arange(ng) // 8 * 5).to(torch.uint8).reshape(-1, 1)
    if kind == "bounds":  # folds at the range's edges: columns 0-15 in [2, 5], 16-31 in [227, 230]
        e = torch.randint(2, 6, (ng, BN), generator=gen, dtype=torch.uint8)
        e[:, 16:] += 225
        return e
    if kind == "mixed":  # one column 4 above in some groups: those chunks split, some sub-chunks per group
        e = torch.randint(119, 123, (ng, BN), generator=gen, dtype=torch.uint8)
        e[1::5, 7] = 126
        return e
    if kind == "extremes":  # 0, 1, 126, 127, 253, 254 (outside [2, 230]: per group) among folding groups
        e = torch.randint(124, 128, (ng, BN), generator=gen, dtype=torch.uint8)
        for i, v in enumerate(EXTREMES):  # in the first two groups: their sub-chunk per group
            e[i % 2, 5 * i] = v
        return e
    assert kind == "none"  # nothing folds: the vpdpbusd path
    return torch.randint(100, 150, (ng, BN), generator=gen, dtype=torch.uint8)


@skips.host_lacks_mark("amx_int8" not in available_isas(), "amx_int8 (AMX-INT8)")
@pytest.mark.parametrize("kind", ["fits", "bounds", "mixed", "extremes", "none"])
@pytest.mark.parametrize("kp, m", [(352, 13), (256, 4), (1024, 64), (96, 37)])
def test_a8_folded_tiles(kind, kp, m):
    """amx_int8's W4A8 block GEMM (4+ rows as one matrix) equals the fold plan's sum bit for bit
    (folded pieces rounded once, the rest per group), and the per-group contract (every other
    level) within fp32 rounding; where some piece folds and rows are large the two orders differ,
    so the check tells the paths apart."""
    gen = torch.Generator().manual_seed(kp * 7 + m)
    ng = kp // 32
    e = fold_case(kind, ng, gen)
    q = torch.randint(0, 16, (BN, kp), generator=gen, dtype=torch.uint8)
    rows = torch.randint(-127, 128, (m, kp), generator=gen, dtype=torch.int8)
    rows[0] = 127
    q[:, :32] = 7  # +6: the largest products
    rs = torch.rand(m, generator=gen) * 0.01 + 0.001
    plan = fold_plan(e)
    folded = sum(kk for _, kk, f in plan if f)
    if kind in ("fits", "bounds"):
        assert folded == kp or (kp % 64 and folded == kp - 32)
    elif kind == "none":
        assert folded == 0
    elif kp >= 256:
        assert 0 < folded < kp, plan
    want = folded_a8_expected(rows, rs, q, e)
    got = OPS.grouped_block(rows, pack_block(q), e, None, rs, MX4.id, "amx_int8", "a8")
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda s: f"{kind}: {s}")
    contract = int4_linear_a8_reference(rows.float(), rs.reshape(-1, 1), E2M1_X2[q.long()].float(),
                                        pow2_exact(e.t(), 128), torch.zeros(BN, ng), 32, None)  # fmt: skip
    finite = contract.isfinite() & got.isfinite()
    assert torch.equal(finite, contract.isfinite()), kind
    # fp32 summation order only: within a few ulp of the sum of |terms|
    mag = int4_linear_a8_reference(rows.float().abs(), rs.reshape(-1, 1), E2M1_X2[q.long()].float().abs(),
                                   pow2_exact(e.t(), 128), torch.zeros(BN, ng), 32, None)  # fmt: skip
    err = (got - contract).abs()[finite]
    assert (err <= mag[finite] * ng * 2**-23).all(), f"{kind}: {(err / mag[finite]).max().item()}"
    if folded == 0:
        assert torch.equal(got[finite], contract[finite]), kind


@skips.host_lacks_mark("amx_int8" not in available_isas(), "amx_int8 (AMX-INT8)")
def test_a8_folded_tiles_whole_block_sum_above_2_24():
    """A block that folds over its whole K (gpt-oss' K 2880): one integer sum per column, here
    above 2^24 for row 0 (127 x 6 x 2 everywhere, half the groups shifted by 3), so its float
    rounds once, as the plan says; the other rows random."""
    gen = torch.Generator().manual_seed(77)
    kp, m = 2880, 16
    e = torch.full((kp // 32, BN), 119, dtype=torch.uint8)
    e[1::2] = 122
    q = torch.randint(0, 16, (BN, kp), generator=gen, dtype=torch.uint8)
    q[:4] = 7
    q[0, 0] = 1  # one odd product: row 0's sum is odd, so its float rounds
    rows = torch.randint(-127, 128, (m, kp), generator=gen, dtype=torch.int8)
    rows[0] = 127
    rs = torch.rand(m, generator=gen) + 0.5
    assert fold_plan(e) == [(0, kp, True)]
    big = (rows[0].long() @ (E2M1_X2[q[0].long()] << (e.long() - 119).repeat_interleave(32, 0)[:, 0])).item()
    assert big > 2**24 and float(torch.tensor(big).float().item()) != big  # the rounding is exercised
    want = folded_a8_expected(rows, rs, q, e)
    got = OPS.grouped_block(rows, pack_block(q), e, None, rs, MX4.id, "amx_int8", "a8")
    assert torch.equal(got, want)


def test_a8_folded_tiles_tell_the_orders_apart():
    """The fold plan's sum is not the per-group sum bit for bit on such data, and amx_int8 gives
    the fold plan's (so test_a8_folded_tiles checks the tile path, not a per-group fallback)."""
    gen = torch.Generator().manual_seed(5)
    kp, m = 1024, 16
    # chunk c's bytes in [100 + 6c, 103 + 6c]: each chunk folds, the partial sums mix magnitudes
    e = torch.randint(100, 104, (kp // 32, BN), generator=gen, dtype=torch.uint8)
    e += (torch.arange(kp // 32) // 8 * 6).to(torch.uint8).reshape(-1, 1)
    q = torch.randint(0, 16, (BN, kp), generator=gen, dtype=torch.uint8)
    rows = torch.randint(-127, 128, (m, kp), generator=gen, dtype=torch.int8)
    rs = torch.ones(m)
    contract = int4_linear_a8_reference(rows.float(), rs.reshape(-1, 1), E2M1_X2[q.long()].float(),
                                        pow2_exact(e.t(), 128), torch.zeros(BN, kp // 32), 32, None)  # fmt: skip
    assert all(f for _, _, f in fold_plan(e))
    want = folded_a8_expected(rows, rs, q, e)
    assert not torch.equal(want, contract)
    if "amx_int8" in available_isas():
        assert torch.equal(OPS.grouped_block(rows, pack_block(q), e, None, rs, MX4.id, "amx_int8", "a8"), want)


def test_grouped_block_refusals():
    q = torch.zeros(BN, 32, dtype=torch.uint8)
    e = torch.zeros(1, BN, dtype=torch.uint8)
    rows = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="zero is given: layout mx4g32_n32k8_x86 has no zero points"):
        OPS.grouped_block(rows, pack_block(q), e, e, None, MX4.id, "scalar", "a16")
    with pytest.raises(TypeError, match="scale has dtype Float: must be Byte"):
        OPS.grouped_block(rows, pack_block(q), e.float(), None, None, MX4.id, "scalar", "a16")
    with pytest.raises(ValueError, match="row_scales is missing"):
        OPS.grouped_block(rows.to(torch.int8), pack_block(q), e, None, None, MX4.id, "scalar", "a8")


# Packing: the C++ packer puts e2m1 nibbles where the layout says
# ---------------------------------------------------------------------------------------------


def test_pack_weight_puts_codes_where_the_layout_says():
    gen = torch.Generator().manual_seed(14)
    q = torch.randint(0, 16, (2, 70, 75), generator=gen, dtype=torch.uint8)
    packed = OPS.pack_weight(q, MX4.id, 96, 80, None)
    assert torch.equal(packed, pack_codes(MX4, q, n_padded=96, k_padded=80))
    back = unpack_codes(MX4, packed)
    assert torch.equal(back[:, :70, :75], q)
    assert int(back[:, 70:].abs().sum()) == 0 and int(back[:, :, 75:].abs().sum()) == 0  # padding: code 0 (+0)
    bad = q.clone()
    bad[1, 3, 4] = 16
    with pytest.raises(ValueError, match=r"weight\[1, 3, 4\] = 16: layout mx4g32_n32k8_x86's 4-bit codes are 0..15"):
        OPS.pack_weight(bad, MX4.id, 0, 0, None)


# The fused kernel
# ---------------------------------------------------------------------------------------------

E2M1_GRID = torch.tensor(sorted(set(abs(v) for v in E2M1_VALUES)))  # 0, 0.5, ..., 6


def quantize_mx4(w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (codes uint8 [E, N, K], e8m0 uint8 [E, N, ceil(K / 32)]): per group of 32,
    e = floor(log2(amax)) - 2 + 127 (amax / 2^(e - 127) in [4, 8): clipped to 6), each value to the
    nearest e2m1 magnitude (ties to the lower); then 1 code in 16 replaced by a random code."""
    e_, n, k = w.shape
    ng = -(-k // 32)
    wp = torch.zeros(e_, n, ng * 32)
    wp[..., :k] = w.float()
    blocks = wp.view(e_, n, ng, 32)
    amax = blocks.abs().amax(-1)
    ex = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2 + 127, torch.full_like(amax, 127.0))
    ex = ex.clamp(0, 254)
    v = blocks / pow2_exact(ex, 127)[..., None]
    mag = (v.abs().unsqueeze(-1) - E2M1_GRID).abs().argmin(-1)  # index 0..7 = magnitude code
    q = (mag + 8 * (v < 0)).to(torch.uint8).view(e_, n, ng * 32)[..., :k].contiguous()
    gen = torch.Generator().manual_seed(seed)
    pick = torch.rand(q.shape, generator=gen) < 1 / 16
    q[pick] = torch.randint(0, 16, (int(pick.sum()),), generator=gen, dtype=torch.uint8)
    return q, ex.to(torch.uint8)


def pack_mx4_weight(name: str, q, e, *, interleaved: bool = False) -> dict[str, torch.Tensor]:
    """One weight's codes [E, N, K] and e8m0 [E, N, ng] -> {name, name_scale} as the layout declares."""
    e_, n, k = q.shape
    if name == "w13":
        ip = layout_padded_i(MX4, n // 2)
        q, e = pad_intermediate(q, ip, interleaved), pad_intermediate(e, ip, interleaved)
        np_, kp = 2 * ip, layout_padded_k(MX4, k)
    else:
        np_, kp = layout_padded_n(MX4, n), layout_padded_k(MX4, layout_padded_i(MX4, k))
    codes = OPS.pack_weight(q.contiguous(), MX4.id, np_, kp, None)
    s = torch.zeros(e_, -(-kp // 32), np_, dtype=torch.uint8)
    s[:, : e.shape[2], : e.shape[1]] = e.transpose(1, 2)
    return {name: codes, f"{name}_scale": s}


@functools.lru_cache(maxsize=None)
def packed_case(case: Case, experts: int):
    """(inputs, PackedExperts, canonical codes/exponents) of a case's weights rounded to mxfp4."""
    inp = make_moe_inputs(tokens=case.tokens, hidden=case.hidden, intermediate=case.intermediate, experts=experts,
                          topk=case.topk, dtype=case.dtype, bias=case.bias, interleaved=case.interleaved,
                          x_scale=case.x_scale, seed=case.seed)  # fmt: skip
    q13, e13 = quantize_mx4(inp.w13, case.seed)
    q2, e2 = quantize_mx4(inp.w2, case.seed + 1)
    h, i = case.hidden, case.intermediate
    shapes = layout_expert_shapes(MX4, experts, h, i)
    b13, b2 = pack_biases(inp.w13_bias, inp.w2_bias, experts, h, i, inp.interleaved, MX4)
    t = pack_mx4_weight("w13", q13, e13, interleaved=inp.interleaved)
    t.update(pack_mx4_weight("w2", q2, e2))
    p = PackedExperts(layout=MX4, num_experts=experts, hidden=h, intermediate=i, padded_intermediate=shapes.padded_intermediate,
                      interleaved=inp.interleaved, tensors=with_biases(t, b13, b2))  # fmt: skip
    return inp, p, {"w13_q": q13, "w13_scale": e13, "w2_q": q2, "w2_scale": e2}


def run(p, inp, mode: str, **kw) -> torch.Tensor:
    return moepack.fused_experts(inp.x, p.weight("w13"), p.weight("w2"), kw.pop("topk_weights", inp.topk_weights),
                                 kw.pop("topk_ids", inp.topk_ids), layout=MX4, interleaved=p.interleaved,
                                 w13_bias=p.w13_bias, w2_bias=p.w2_bias, act_mode=mode, **kw)  # fmt: skip


def mx4_linear_a8(qc: torch.Tensor, ec: torch.Tensor):
    """linear(e, q, q_scale, bias) of moe_reference_a8 for canonical codes [E, N, K] / e8m0 [E, N, ng]."""

    def linear(x, q, qs, b):
        return int4_linear_a8_reference(q, qs, E2M1_X2[qc[x].long()].float(), pow2_exact(ec[x], 128),
                                        torch.zeros(ec[x].shape), 32, b)  # fmt: skip

    return linear


def references(inp, c: dict, act_kwargs: dict, **route):
    """(A16 reference, fp32-pipeline reference, (A8 reference, flip)) of a case."""
    w13 = dequantize_mxfp4(c["w13_q"], c["w13_scale"])
    w2 = dequantize_mxfp4(c["w2_q"], c["w2_scale"])
    ids = route.pop("topk_ids", inp.topk_ids)
    kw = dict(act_kwargs, interleaved=inp.interleaved, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, **route)
    ref = moe_reference(inp.x, w13, w2, inp.topk_weights, ids, **kw)
    ref32 = moe_reference(inp.x.float(), w13, w2, inp.topk_weights, ids, **kw)

    def column_norm(e):
        return w2[e].double().norm(dim=0).max().item()

    a8 = moe_reference_a8(inp.x, w13.shape[0], mx4_linear_a8(c["w13_q"], c["w13_scale"]),
                          mx4_linear_a8(c["w2_q"], c["w2_scale"]), column_norm, inp.topk_weights, ids,
                          return_flip=True, **kw)  # fmt: skip
    return ref, ref32, a8


def check_a16(out, ref, ref32, dtype, base: str, what: str):
    assert_close(out, ref, TOL["scalar_vs_reference" if base == "reference" else "simd_vs_scalar", dtype], what)
    kind = "scalar_vs_reference" if dtype == F32 else "half_vs_fp32_pipeline"
    assert_close(out, ref32, TOL[kind, dtype], what + " vs the fp32 pipeline")


def check_a8(out, ref, ref32, flip, dtype, base: str, what: str):
    kind = "int8_scalar_vs_reference" if base == "reference" else "int8_simd_vs_scalar"
    assert_close_int8(out, ref, TOL[kind, dtype], flip, what)
    assert_close_int8(out, ref32, TOL["int8_vs_fp32_dequantized", dtype], 0.0, what + " vs the fp32 pipeline")


# dtype, activation, x scale, H, I, T, k, bias, seed (E = 3 experts)
FUSED = [
    Case(F32, "silu", "1", 72, 40, 1, 2, True, 41),
    Case(BF16, "gelu", "1", 72, 40, 3, 2, False, 42),
    Case(F16, "gelu_tanh", "1/sqrt(H)", 72, 40, 17, 1, True, 43),
    Case(BF16, "swigluoai", "1", 72, 40, 64, 3, True, 44),
    Case(F32, "swigluoai_a1.2_l0.75", "4", 200, 88, 17, 2, True, 45),
    Case(BF16, "swigluoai_a1.2_l0.75", "1", 130, 72, 3, 2, False, 46),
    Case(F32, "gelu", "1", 93, 40, 64, 2, False, 47),
    Case(BF16, "silu", "1", 296, 104, 1, 3, True, 48),
]


@pytest.mark.parametrize("case", FUSED, ids=[c.id for c in FUSED])
def test_fused_every_level(case: Case):
    inp, p, c = packed_case(case, 3)
    ref, ref32, (ref8, flip) = references(inp, c, case.act_kwargs)
    out = {}
    for mode in ("a16", "a8"):
        with isa_cap("scalar"):
            out[mode] = run(p, inp, mode, **case.act_kwargs)
        assert out[mode].shape == (case.tokens, case.hidden) and out[mode].dtype == case.dtype
    check_a16(out["a16"], ref, ref32, case.dtype, "reference", f"scalar a16 {case.id}")
    check_a8(out["a8"], ref8, ref32, flip, case.dtype, "reference", f"scalar a8 {case.id}")
    for mode in ("a16", "a8"):
        for isa in isas_running(mode):
            with isa_cap(isa):
                got = run(p, inp, mode, **case.act_kwargs)
            if mode == "a16":
                check_a16(got, out["a16"], ref32, case.dtype, "scalar", f"{isa} a16 {case.id}")
            else:
                check_a8(got, out["a8"], ref32, flip, case.dtype, "scalar", f"{isa} a8 {case.id}")


def test_fused_expert_map():
    """Global ids through expert_map (3 of 7 global experts are remote), both modes, every level."""
    case = Case(BF16, "swigluoai", "1", 72, 40, 9, 3, True, 49)
    inp, p, c = packed_case(case, 4)
    emap = torch.tensor([0, -1, 1, -1, 2, 3, -1], dtype=torch.int32)
    gen = torch.Generator().manual_seed(50)
    ids = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(9)]).to(torch.int32)
    ref, ref32, (ref8, flip) = references(inp, c, case.act_kwargs, expert_map=emap, topk_ids=ids)
    for mode in ("a16", "a8"):
        with isa_cap("scalar"):
            scalar = run(p, inp, mode, topk_ids=ids, expert_map=emap, **case.act_kwargs)
        if mode == "a16":
            check_a16(scalar, ref, ref32, BF16, "reference", "scalar a16 expert_map")
        else:
            check_a8(scalar, ref8, ref32, flip, BF16, "reference", "scalar a8 expert_map")
        for isa in isas_running(mode):
            with isa_cap(isa):
                got = run(p, inp, mode, topk_ids=ids, expert_map=emap, **case.act_kwargs)
            if mode == "a16":
                check_a16(got, scalar, ref32, BF16, "scalar", f"{isa} a16 expert_map")
            else:
                check_a8(got, scalar, ref32, flip, BF16, "scalar", f"{isa} a8 expert_map")


def test_each_mode_runs_on_its_levels():
    """a16 on the bf16 dot-product levels, a8 on the int8 ones (MODE_ISAS), no fallback; the layout
    serves both modes and a16 is its default."""
    assert MX4.act_modes == ("a16", "a8")
    for mode in ("a16", "a8"):
        choice = moepack.kernel_choice(MX4, mode)
        assert not choice.is_fallback, choice.reason
        best = [x for x in MODE_ISAS[("e2m1", mode)] if x in available_isas()][-1]
        assert choice.isa == best, choice.reason
    assert "avx512_bf16" in MODE_ISAS[("e2m1", "a16")] and "avx512_bf16" not in MODE_ISAS[("e2m1", "a8")]
    assert "avx512_vnni" in MODE_ISAS[("e2m1", "a8")] and "avx512_vnni" not in MODE_ISAS[("e2m1", "a16")]


def test_packed_codes_positions():
    q = torch.randint(0, 16, (1, 33, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(51))
    flat = pack_codes(MX4, q, n_padded=64, k_padded=40).reshape(-1)
    for n, k in ((0, 0), (32, 39), (5, 4), (31, 8), (7, 3)):
        byte, shift = layout_code_position(MX4, n, k, 40)  # U4_CODE_ORDER: codes j, j + 4 share byte j
        assert (int(flat[byte]) >> shift) & 15 == int(q[0, n, k])


def test_exactness_with_the_other_a16_dot():
    """The few-row A16 decode kernels have two dot products (fp32 FMAs on a vpermps table, or
    vdpbf16ps; csrc/dispatch.cpp mx4_a16_fp32, chosen once per process by CPU): the exactness
    tests above ran the process's choice; here they run again in a process that takes the other
    (MOEPACK_MX4_A16_DOT), so both kernels are held to every (code, exponent) pair on any host."""
    import os
    import pathlib
    import subprocess
    import sys

    from moepack._ops import mx4_a16_dot

    other = "bf16" if mx4_a16_dot().startswith("fp32") else "fp32"
    env = {**os.environ, "MOEPACK_MX4_A16_DOT": other}
    probe = subprocess.run([sys.executable, "-c", "from moepack._ops import mx4_a16_dot; print(mx4_a16_dot())"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.startswith("fp32" if other == "fp32" else "vdpbf16ps"), probe
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "every_code or extreme_exponents or nan_exponent or random_rows or subnormal_activations"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=str(pathlib.Path(__file__).resolve().parents[3]))
    assert r.returncode == 0 and " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
