"""Where packed weights and a call's scratch live: pack_experts' huge-page copies
(torch.ops.moepack.huge_page_copy, MOEPACK_HUGE_PAGES) and the driver's scratch, which the
calling thread keeps between calls (docs/KERNELS.md "Scratch", "Decode")."""
import pytest
import torch

import moepack
from moepack._ops import ops
from moepack.pack import HUGE_PAGE_MIN_BYTES
from tests.support import skips


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int32])
def test_huge_page_copy_is_an_equal_contiguous_copy(dtype):
    g = torch.Generator().manual_seed(1)
    n = (5 << 20) // torch.empty(0, dtype=dtype).element_size() + 7  # > 2 MiB pages, odd length
    src = torch.randint(0, 100, (n,), generator=g).to(dtype)
    out = ops().huge_page_copy(src)
    assert out.dtype == dtype and out.shape == src.shape and out.is_contiguous()
    assert out.data_ptr() != src.data_ptr()
    assert torch.equal(out, src)
    strided = src[: n // 2 * 2].view(-1, 2).t()  # non-contiguous input: copied in logical order
    assert torch.equal(ops().huge_page_copy(strided), strided.contiguous())


def _experts(e=4, h=1024, i=768, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    return w13, w2


@pytest.mark.parametrize("layout", ["bf16_n32k2_x86", "i8_n32k4_x86", "u4g128_n32k8_x86"])
def test_pack_experts_huge_pages_change_no_byte(layout, monkeypatch):
    w13, w2 = _experts(e=8)
    a = moepack.pack_experts(w13, w2, layout=layout)
    monkeypatch.setenv("MOEPACK_HUGE_PAGES", "0")
    b = moepack.pack_experts(w13, w2, layout=layout)
    assert a.tensors.keys() == b.tensors.keys()
    assert any(t.numel() * t.element_size() >= HUGE_PAGE_MIN_BYTES for t in a.tensors.values())
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert torch.equal(a.w13, a.tensors["w13"])  # the attributes follow the copies


@pytest.mark.parametrize("layout", ["bf16_n32k2_x86", "i8_n32k4_x86", "u4g128_n32k8_x86"])
def test_scratch_kept_between_calls_changes_no_result(layout):
    """A large call leaves its (non-zero) scratch to the next, smaller one; results must not
    depend on what the scratch held."""
    w13, w2 = _experts(e=8, h=192, i=96, seed=2)
    packed = moepack.pack_experts(w13, w2, layout=layout)
    g = torch.Generator().manual_seed(3)

    def call(t):
        x = torch.randn(t, 192, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]).int()
        w = torch.rand(t, 2, generator=g)
        return x, w, ids

    small, big = call(3), call(300)
    first = moepack.run_experts(packed, *small)
    moepack.run_experts(packed, *big)
    again = moepack.run_experts(packed, *small)
    assert torch.equal(first, again)


def _layer(layout, hidden, seed):
    from tests.conftest import make_moe_inputs

    inp = make_moe_inputs(tokens=24, hidden=hidden, intermediate=64, experts=5, topk=2, dtype=torch.bfloat16,
                          x_scale="1/sqrt(H)", seed=seed)  # fmt: skip
    packed = moepack.pack_experts(inp.w13, inp.w2, layout=layout)
    return packed, (inp.x, inp.topk_weights, inp.topk_ids.int())


def test_padded_x_rows_dense_match_scalar():
    """bf16 x rows of H = 2048 are 4 KiB: the driver pads them by a line (every level reads them
    at that stride; the tile levels load 16 of them per tile)."""
    from tests.conftest import isa_cap
    from tests.reference.tolerances import TOL, assert_close

    packed, args = _layer("bf16_n32k2_x86", 2048, 21)
    best = moepack.run_experts(packed, *args)
    with isa_cap("scalar"):
        ref = moepack.run_experts(packed, *args)
    assert_close(best, ref, TOL["simd_vs_scalar", torch.bfloat16], "padded x rows, best level vs scalar")


def test_padded_x_rows_int8_tiles_equal_vector_kernel():
    """int8 x rows of H = 4096 are 4 KiB (padded by a line): amx_int8's tiles and avx512_vnni's
    vpdpbusd give the same exact integers and the same epilogue, so the same bits."""
    from tests.conftest import isa_cap

    if moepack.kernel_choice("i8_n32k4_x86").isa != "amx_int8":
        skips.host_lacks("AMX-INT8 (and AVX512_VNNI): this test compares amx_int8 tiles with avx512_vnni")
    packed, args = _layer("i8_n32k4_x86", 4096, 22)
    tiles = moepack.run_experts(packed, *args)
    with isa_cap("avx512_vnni"):
        assert moepack.kernel_choice("i8_n32k4_x86").isa == "avx512_vnni"
        vec = moepack.run_experts(packed, *args)
    assert torch.equal(tiles, vec)
