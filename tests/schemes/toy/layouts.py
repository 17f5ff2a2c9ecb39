"""The toy scheme's facts for the layout table: a test-only scheme (README.md here).

Loaded by path by ``moepack.layout.add_testonly_schemes`` (tools/gen_layouts.py always; moepack
only under MOEPACK_TEST_SCHEMES=1), with ``moepack.layout`` already in sys.modules: standard
library and moepack.layout only, so the generators run it without torch or the extension.
"""

from moepack.layout import PackedLayout, TensorSpec

SCHEME = "toy"
# toy_u8: unsigned 8-bit codes q, value q - 128 (-128..127, exact in bf16), one byte each.
WEIGHT_KINDS = {"toy_u8": (8, "uint8")}
# "portable": a blocking chosen for no SIMD level. No ISA level of moepack/isa_levels.py targets
# this family, so the scalar level alone registers the toy's kernel (its C++ codec: toy_codec.inc).
FAMILIES = ("portable",)
TOY_GROUP = 24  # K values per scale: a group size no real scheme uses
TOY_LAYOUT_ID = 21  # never reused, like every layout id (the next real layout is 22)


def layouts() -> tuple:
    # Blocks of 16 columns, runs of 4 K values (a blocking no real 8-bit layout has); one bf16
    # scale per (K group of 24, output channel), [E, ceil(Kp / 24), Np]. Padding: code 128 (value
    # 0) and scale 0.
    return (
        PackedLayout(
            id=TOY_LAYOUT_ID, name="toy_u8g24_n16k4_portable", weight_dtype="toy_u8", weight_bits=8, group_size=TOY_GROUP,
            block_n=16, k_pack=4, scale_dtype="bf16", zero_kind="none", family="portable", i_align=32, scheme=SCHEME,
            act_modes=("a16",),
            tensors=(
                TensorSpec("codes", "", "uint8", "packed", pad="code 128 (value 0)", note="toy_u8 codes q, value q - 128"),
                TensorSpec("scale", "_scale", "bfloat16", "group", note="bf16 scale per (K group of 24, output channel); 0 in padding"),
            ),
        ),
    )  # fmt: skip
