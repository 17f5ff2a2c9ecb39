"""moepack/layout.py is THE layout table: the generated C++ header must match it, the compiled
extension must report the same numbers, and the size/offset math must be what the packer does."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import moepack
from moepack import layout as lay
from moepack.errors import LayoutError
from moepack.layout import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    layout_expert_shapes,
    layout_get,
    layout_matrix_bytes,
    layout_padded_i,
    layout_padded_k,
    layout_padded_n,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
GEN = ROOT / "tools" / "gen_layouts.py"
HEADER = pathlib.Path("csrc/include/moepack/layouts_gen.h")


def run_check(root: pathlib.Path) -> subprocess.CompletedProcess:
    # A subprocess: gen_layouts.py loads moepack/layout.py under sys.modules["moepack.layout"],
    # which must not replace the real module inside the test process.
    return subprocess.run(
        [sys.executable, str(root / "tools" / "gen_layouts.py"), "--check"], capture_output=True, text=True, timeout=60
    )


def test_generated_header_is_up_to_date():
    r = run_check(ROOT)
    assert r.returncode == 0, f"tools/gen_layouts.py --check failed:\n{r.stdout}{r.stderr}"
    assert "up to date" in r.stdout


@pytest.fixture
def repo_copy(tmp_path) -> pathlib.Path:
    """The files gen_layouts.py reads and writes, in a scratch tree (the test-only schemes' too)."""
    testonly = [str(f.relative_to(ROOT)) for d in lay.scheme_dirs_for_tests() for f in (d / "layouts.py", *d.glob("*.inc"))]
    for rel in ("tools/gen_layouts.py", "moepack/layout.py", "moepack/errors.py", str(HEADER), "csrc/kernels/schemes_gen.inc", *testonly):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_check_detects_a_stale_header(repo_copy):
    assert run_check(repo_copy).returncode == 0
    header = repo_copy / HEADER
    header.write_text(header.read_text().replace(", 32, 2, kScaleDtype_none", ", 16, 2, kScaleDtype_none"))
    r = run_check(repo_copy)
    assert r.returncode == 1 and "stale" in r.stderr


def test_check_detects_a_changed_table(repo_copy):
    src = repo_copy / "moepack" / "layout.py"
    text = src.read_text()
    assert "i_align=32," in text
    src.write_text(text.replace("i_align=32,", "i_align=64,", 1))
    assert run_check(repo_copy).returncode == 1


def test_check_fails_without_a_header(repo_copy):
    (repo_copy / HEADER).unlink()
    assert run_check(repo_copy).returncode == 1


def enum_index(values, name: str) -> int:
    return list(values).index(name)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_compiled_table_equals_python_table(layout):
    name, fields, tensors = torch.ops.moepack.layout_desc(layout.id)
    assert name == layout.name
    expected = [
        layout.id,
        enum_index(lay.WEIGHT_DTYPES, layout.weight_dtype),
        layout.weight_bits,
        layout.group_size,
        layout.block_n,
        layout.k_pack,
        enum_index(lay.SCALE_DTYPES, layout.scale_dtype),
        enum_index(lay.ZERO_KINDS, layout.zero_kind),
        enum_index(lay.FAMILIES, layout.family),
        layout.i_align,
        enum_index(lay.SCHEMES, layout.scheme),
        sum(1 << enum_index(lay.ACT_MODES, m) for m in layout.act_modes),
    ]
    names = ["id", "weight_dtype", "weight_bits", "group_size", "block_n", "k_pack", "scale_dtype", "zero_kind",
             "family", "i_align", "scheme", "act_modes"]  # fmt: skip
    assert len(fields) == len(expected) == len(names)
    for field, got, want in zip(names, fields, expected):
        assert got == want, f"{layout.name}.{field}: extension says {got}, moepack/layout.py says {want}"
    want_tensors = [
        f"{enum_index(lay.TENSOR_ROLES, t.role)}:{t.suffix}:{enum_index(lay.TENSOR_DTYPES, t.dtype)}:"
        f"{enum_index(lay.TENSOR_SHAPES, t.shape)}"
        for t in layout.tensors
    ]
    assert list(tensors) == want_tensors, f"{layout.name}: compiled tensor declaration {tensors} != {want_tensors}"


def test_compiled_table_has_no_other_layouts():
    """Beyond moepack.layout's layouts the extension has only the test-only schemes' (moepack adds
    them under MOEPACK_TEST_SCHEMES=1; their scheme indices follow the real schemes')."""
    known = {x.id for x in LAYOUTS}
    for lid in range(0, max(known) + 8):
        if lid in known:
            continue
        try:
            name, fields, _ = torch.ops.moepack.layout_desc(lid)
        except ValueError as e:
            assert f"layout={lid} is unknown" in str(e)
            continue
        assert fields[10] >= len(lay.SCHEMES), f"layout {lid} ({name}) is compiled in but not in moepack.layout"


def test_layout_table_invariants():
    assert len({x.id for x in LAYOUTS}) == len(LAYOUTS) and len({x.name for x in LAYOUTS}) == len(LAYOUTS)
    for x in LAYOUTS:
        # grouped schemes name their group (g<G>, or ch per channel); the f8 layouts' names say f8 (e4m3fn
        # is the one fp8 they hold), the mxfp4 ones mx4 (e2m1 codes, OCP MX), the nvfp4 ones nv4
        tag = (f"g{x.group_size}" if x.group_size else "ch") if x.scheme in ("int4_group", "fp8_block", "mxfp4", "nvfp4") else ""
        short = {"f8e4m3": "f8", "e2m1": "nv4" if x.scheme == "nvfp4" else "mx4"}.get(x.weight_dtype, x.weight_dtype)
        assert x.name == f"{short}{tag}_n{x.block_n}k{x.k_pack}_{x.family}"
        assert x.i_align % x.block_n == 0
        assert x.weight_bits == lay.WEIGHT_DTYPES[x.weight_dtype] == 8 * x.elem_bytes
        assert layout_get(x.id) is x and layout_get(x.name) is x and layout_get(x) is x
        assert lay.PackedLayout.from_dict(x.to_dict()) == x
        assert x.tensor_names("w13")[0] == "w13" and x.tensors[0].role == "codes"


@pytest.mark.parametrize("key", [0, 99, -1, 10**6, "bf16_n32k2_arm", "", "BF16_N32K2_X86", "i8_n32k4_arm"])
def test_unknown_layout_lookup_raises_layout_error(key):
    with pytest.raises(LayoutError, match="is unknown; known layouts: bf16_n32k2_x86 \\(id 1\\), i8_n32k4_x86 \\(id 2\\)"):
        layout_get(key)


@pytest.mark.parametrize(
    "bad",
    [
        dict(family="riscv"),
        dict(weight_dtype="int3"),
        dict(weight_bits=8),
        dict(i_align=48),
        dict(block_n=0),
        dict(k_pack=0),
        dict(scale_dtype="f8"),
        dict(zero_kind="i8"),
    ],
    ids=lambda d: next(iter(d)),
)
def test_invalid_layout_records_are_refused(bad):
    with pytest.raises(LayoutError, match="layout bf16_n32k2_x86"):
        lay.PackedLayout.from_dict({**DEFAULT_LAYOUT.to_dict(), **bad})


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(tensors=()), "tensors\\[0\\] must be the codes"),
        (dict(tensors=(lay.TensorSpec("scale", "_scale", "float32", "channel"),)), "tensors\\[0\\] must be the codes"),
        (dict(tensors=(lay.TensorSpec("codes", "", "bfloat16", "channel"),)), "only the codes have shape 'packed'"),
        (dict(tensors=(lay.TensorSpec("codes", "", "bfloat16", "packed"), lay.TensorSpec("zero", "_z", "uint8", "group"))),
         "shape 'group' needs group_size > 0"),
        (dict(scheme="int3_group"), "scheme='int3_group' is not one of"),
        (dict(act_modes=("a4",)), "act_modes"),
        (dict(tensors=(lay.TensorSpec("codes", "", "int8", "packed"),)), "weight_dtype bf16 is stored as bfloat16 codes, not int8"),
        (dict(tensors=(lay.TensorSpec("codes", "", "bfloat16", "packed"), lay.TensorSpec("sum", "_bias", "int32", "channel"))),
         "suffix '_bias' is reserved"),
        (dict(tensors=(lay.TensorSpec("codes", "", "bfloat16", "packed"), lay.TensorSpec("scale", "_scale", "float32", "channel"))),
         "scale_dtype='none' but the tensors declare 1 scale tensor"),
    ],
)
def test_invalid_tensor_declarations_are_refused(bad, match):
    with pytest.raises(LayoutError, match=match):
        lay.PackedLayout(**{**{f.name: getattr(DEFAULT_LAYOUT, f.name) for f in lay.dataclasses.fields(lay.PackedLayout)}, **bad})


def test_sub_byte_codes_are_expressible():
    """A 4-bit grouped layout (the INT4 work's shape) is a valid record, and the one shape function
    gives its tensors: codes two per byte, per-group scales / zero points [E, ceil(Kp/G), Np]."""
    u4 = lay.PackedLayout(
        id=99, name="u4_n32k8_x86", weight_dtype="u4", weight_bits=4, group_size=32, block_n=32, k_pack=8,
        scale_dtype="bf16", zero_kind="u4", family="x86", i_align=32, scheme="dense", act_modes=("a16", "a8"),
        tensors=(
            lay.TensorSpec("codes", "", "uint8", "packed", note="two 4-bit codes per byte"),
            lay.TensorSpec("scale", "_scale", "bfloat16", "group"),
            lay.TensorSpec("zero", "_zero", "uint8", "group", note="two 4-bit zero points per byte in the INT4 work"),
        ),
    )  # fmt: skip
    plan = {t.name: t.shape for t in lay.layout_tensor_plan(u4, 3, 100, 40)}
    assert plan == {
        "w13": (3, 128, 52), "w13_scale": (3, 4, 128), "w13_zero": (3, 4, 128),  # H=100 -> Kp 104 -> 52 bytes, 4 groups
        "w2": (3, 128, 32), "w2_scale": (3, 2, 128), "w2_zero": (3, 2, 128),  # Ip=64: 2 groups; Np(H)=128
    }  # fmt: skip
    assert lay.layout_matrix_bytes(u4, 128, 104) == 128 * 52


# (E, H, I) -> Ip, packed w13 shape, packed w2 shape (bf16_n32k2_x86: block_n 32, k_pack 2, i_align 32)
SHAPES = {
    (5, 93, 88): (96, (5, 192, 94), (5, 96, 96)),
    (5, 200, 88): (96, (5, 192, 200), (5, 224, 96)),
    (1, 1, 1): (32, (1, 64, 2), (1, 32, 32)),
    (8, 2048, 768): (768, (8, 1536, 2048), (8, 2048, 768)),  # Qwen3-30B-A3B: no padding at all
    (32, 2880, 2880): (2880, (32, 5760, 2880), (32, 2880, 2880)),  # gpt-oss: 2880 = 90 * 32
    (3, 130, 176): (192, (3, 384, 130), (3, 160, 192)),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=lambda s: "E%dH%dI%d" % s)
def test_expert_shapes_and_bytes(shape):
    e, h, i = shape
    ip, w13_shape, w2_shape = SHAPES[shape]
    L = DEFAULT_LAYOUT
    s = layout_expert_shapes(L, e, h, i)
    assert (s.num_experts, s.hidden, s.intermediate, s.padded_intermediate) == (e, h, i, ip)
    assert s.w13_shape == w13_shape and s.w2_shape == w2_shape
    assert layout_padded_i(L, i) == ip
    assert layout_matrix_bytes(L, 2 * ip, h) == w13_shape[1] * w13_shape[2] * 2
    assert layout_matrix_bytes(L, h, ip) == w2_shape[1] * w2_shape[2] * 2
    assert layout_padded_n(L, h) == w2_shape[1] and layout_padded_k(L, h) == w13_shape[2]


@pytest.mark.parametrize("shape", [(5, 93, 88), (1, 1, 1), (3, 130, 176)], ids=lambda s: "E%dH%dI%d" % s)
def test_expert_shapes_are_what_the_packer_produces(shape):
    e, h, i = shape
    s = layout_expert_shapes(DEFAULT_LAYOUT, e, h, i)
    p = moepack.pack_experts(torch.randn(e, 2 * i, h), torch.randn(e, h, i), torch.randn(e, 2 * i), torch.randn(e, h))
    assert tuple(p.w13.shape) == s.w13_shape and tuple(p.w2.shape) == s.w2_shape
    assert p.w13.numel() * 2 == e * layout_matrix_bytes(DEFAULT_LAYOUT, 2 * s.padded_intermediate, h)
    assert p.w2.numel() * 2 == e * layout_matrix_bytes(DEFAULT_LAYOUT, h, s.padded_intermediate)
    assert tuple(p.w13_bias.shape) == (e, 2 * s.padded_intermediate) and tuple(p.w2_bias.shape) == (e, s.w2_shape[1])


@pytest.mark.parametrize("sizes", [(0, 8, 8), (4, 0, 8), (4, 8, 0), (-1, 8, 8)])
def test_expert_shapes_refuse_non_positive_sizes(sizes):
    with pytest.raises(LayoutError, match="every size must be positive"):
        layout_expert_shapes(DEFAULT_LAYOUT, *sizes)


def test_flops():
    assert lay.layout_flops(tokens=3, topk=2, hidden=72, intermediate=40) == 2 * 3 * 2 * 3 * 72 * 40
