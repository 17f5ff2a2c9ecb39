"""PackedLayout.code_order and layout_code_position: where each code of a packed matrix sits.

The u4 layouts' order is the one docs/PACKED_FORMAT.md describes (element j of a column's run of
8 K values: byte j % 4, low nibble for j < 4); byte-wide codes have none. A manifest written
before the field existed (it lacks ``code_order``) still opens: the layout id implies it."""

from __future__ import annotations

import pytest

from moepack.errors import LayoutError
from moepack.layout import LAYOUTS, U4_CODE_ORDER, PackedLayout, layout_code_position, layout_element_offset, layout_get
from moepack.manifest import IMPLIED_LAYOUT_FIELDS
from tests.support.packdir_edit import reseal


def test_u4_code_order_is_the_documented_nibble_order():
    L = layout_get("u4g128_n32k8_x86")
    assert L.code_order == U4_CODE_ORDER
    kp = 384
    for n in (0, 1, 31, 32, 45):
        for k in range(0, 40):
            byte, shift = layout_code_position(L, n, k, kp)
            run = layout_element_offset(L, n, k, kp) - k % 8  # first element of the column's run
            assert byte == run // 2 + (k % 8) % 4, (n, k)
            assert shift == 4 * ((k % 8) // 4), (n, k)


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x.weight_bits >= 8], ids=lambda x: x.name)
def test_byte_wide_codes_sit_at_their_element_offset(layout):
    assert layout.code_order == ()
    kp = 4 * layout.k_pack * 3
    for n, k in ((0, 0), (3, 5), (layout.block_n + 1, kp - 1)):
        assert layout_code_position(layout, n, k, kp) == (layout_element_offset(layout, n, k, kp) * layout.weight_bits // 8, 0)


def test_every_code_of_a_sub_byte_matrix_has_its_own_slot():
    for L in (x for x in LAYOUTS if x.weight_bits < 8):
        n, kp = 2 * L.block_n, 2 * L.k_pack * 4
        seen = {layout_code_position(L, a, b, kp) for a in range(n) for b in range(kp)}
        assert len(seen) == n * kp
        assert max(p[0] for p in seen) == n * kp * L.weight_bits // 8 - 1


def test_a_bad_code_order_is_refused():
    d = layout_get("u4g32_n32k8_x86").to_dict()
    d["code_order"] = [0, 1, 2, 3, 4, 5, 6, 6]
    with pytest.raises(LayoutError, match=r"code_order=\(0, 1, 2, 3, 4, 5, 6, 6\) must be a permutation of 0..k_pack-1"):
        PackedLayout.from_dict(d)
    d = layout_get("i8_n32k4_x86").to_dict()
    d["code_order"] = [1, 0, 3, 2]
    with pytest.raises(LayoutError, match="only sub-byte codes have one"):
        PackedLayout.from_dict(d)


def test_a_manifest_without_code_order_still_opens(tmp_path):
    """A u4 directory whose manifest predates the field opens and runs; a wrong order is refused."""
    import json

    import moepack
    from moepack.manifest import ManifestError

    assert "code_order" in IMPLIED_LAYOUT_FIELDS
    dst = tmp_path / "p"
    moepack.convert("fixtures/qwen2_moe_w4a16", dst)
    mpath = dst / "moepack.json"
    m = json.loads(mpath.read_text())
    (desc,) = m["layouts"].values()
    assert desc["code_order"] == list(U4_CODE_ORDER)
    del desc["code_order"]
    mpath.write_text(json.dumps(reseal(m)))
    moepack.open(dst)  # no error: the id implies the order
    desc["code_order"] = list(range(8))
    mpath.write_text(json.dumps(reseal(m)))
    with pytest.raises(ManifestError, match=r"code_order=\[0, 1, 2, 3, 4, 5, 6, 7\], this build has code_order=\[0, 2, 4, 6, 1, 3, 5, 7\]"):
        moepack.open(dst)
