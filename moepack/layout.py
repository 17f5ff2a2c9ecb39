"""The table of packed layouts, and all byte/offset math over them.

Every number that describes how packed bytes are arranged lives here, once. The C++ side reads
the same numbers from ``csrc/include/moepack/layouts_gen.h``, which ``tools/gen_layouts.py``
writes from this file (``--check`` fails when the header is stale), and the extension reports
its compiled table through ``torch.ops.moepack.layout_desc`` so a test can compare both.

A packed weight is the canonical ``[N, K]`` matrix (torch Linear order: N outputs, K inputs) of
one expert, zero-padded to ``[Np, Kp]`` and rearranged so that a kernel streams it in order:

    blocks of ``block_n`` output columns; inside a block, groups of ``k_pack`` adjacent K values
    of one column are contiguous, and the columns of a block follow each other:

        element(n, k) -> (n // block_n) * block_n * Kp      # which column block
                         + (k // k_pack) * block_n * k_pack # which K group inside it
                         + (n % block_n) * k_pack           # which column inside the group
                         + k % k_pack                       # which K inside the group

For ``bf16_n32k2_x86`` one K group of a block is 32 columns x 2 bf16 = 128 bytes, two cache
lines: one AVX-512 register of 16 bf16 pairs holds half of it (what ``vdpbf16ps`` consumes), an
AVX2 register a quarter. For ``i8_n32k4_x86`` one K group is 32 columns x 4 int8 = 128 bytes
too: a 32-bit word holds ``w[n][k..k+3]`` (the operand of ``vpdpbusd``); its per-channel fp32
scales and int32 column sums are separate ``[E, N]`` tensors (moepack/schemes/int8: ``pack_experts_int8``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
from dataclasses import dataclass

from .errors import LayoutError

# Values of ``PackedLayout.family``: which ISA family the blocking was chosen for. A layout of
# any family runs everywhere through the scalar kernel; SIMD kernels register per family.
FAMILIES = ("x86", "arm")
# Element type of the stored codes/values -> bits per element. Sub-byte codes (4 bits) are stored
# two to a byte in a uint8 tensor (TensorSpec.dtype), low nibble first.
WEIGHT_DTYPES = {"bf16": 16, "f32": 32, "i8": 8, "u4": 4, "f8e4m3": 8, "e2m1": 4}
SCALE_DTYPES = ("none", "f32", "bf16", "e8m0", "e4m3")
ZERO_KINDS = ("none", "u4", "bf16")
# The packed weight schemes (docs/SEMANTICS.md §3): one name everywhere (CLI, manifest, Python
# API, docs); moepack/schemes/ has one module per scheme.
SCHEMES = ("dense", "int8_channel", "int4_group", "fp8_block", "mxfp4", "nvfp4")
# Activation modes a layout serves (docs/SEMANTICS.md §3): a16 = activations in their own dtype,
# a8 = per-token dynamic int8.
ACT_MODES = ("a16", "a8")

# The tensors one packed weight consists of (PackedLayout.tensors), and their vocabulary:
TENSOR_ROLES = ("codes", "scale", "zero", "sum", "global")  # what the driver hands a micro-kernel
TENSOR_DTYPES = {"bfloat16": 2, "int8": 1, "uint8": 1, "float32": 4, "int32": 4}  # torch names -> bytes
# How a tensor's shape follows from one expert matrix [N, K] padded to [Np, Kp]:
#   packed   [E, Np, Kp * weight_bits / (8 * element bytes)]   the codes, block-interleaved
#   channel  [E, Np]                                           one value per output channel
#   group    [E, ceil(Kp / group_size), Np]                    one value per (K group, channel)
TENSOR_SHAPES = ("packed", "channel", "group")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a packed weight. It is stored as ``<weight><suffix>`` (``w13``, ``w13_scale``).

    Every tensor is in packed row order (row ``n`` of ``w13`` is gate row ``n`` for ``n < Ip``,
    up row ``n - Ip`` after it, or interleaved pairs) and zero in its padding rows/columns,
    unless ``pad`` says otherwise."""

    role: str  # TENSOR_ROLES
    suffix: str  # "" for the codes, else "_<name>"
    dtype: str  # TENSOR_DTYPES
    shape: str  # TENSOR_SHAPES
    pad: str = "zero"  # what padding holds
    note: str = ""  # what one element is, for docs and error messages

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PackedLayout:
    """One packed weight layout. ``id`` is written into every manifest and never reused."""

    id: int  # stable; never reused
    name: str  # <dtype>_n<block_n>k<k_pack>_<family>
    weight_dtype: str  # element type of the stored codes/values ("bf16", ...)
    weight_bits: int  # bits per stored weight element
    group_size: int  # K per scale; 0 = no scales (dense) or per output channel
    block_n: int  # output columns per block (one tile of accumulators)
    k_pack: int  # adjacent K values of one column stored together
    scale_dtype: str  # "none" for dense layouts
    zero_kind: str  # "none" for dense and symmetric layouts
    family: str  # ISA family the blocking targets ("x86" | "arm")
    i_align: int  # the intermediate size I is zero-padded to a multiple of this
    scheme: str = "dense"  # SCHEMES: what a packed weight means
    act_modes: tuple[str, ...] = ("a16",)  # ACT_MODES this layout's kernels serve
    tensors: tuple[TensorSpec, ...] = ()  # one packed weight's tensors; tensors[0] is the codes
    # Sub-byte codes only (weight_bits < 8): where element j (0 <= j < k_pack) of one column's run
    # of k_pack consecutive K values sits inside the run's k_pack * weight_bits / 8 bytes, as a slot
    # s: byte s // (8 // weight_bits), bits (s % (8 // weight_bits)) * weight_bits upward. Empty =
    # slot j (K order, low bits first). layout_code_position is the one reader of it.
    code_order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = f"layout {self.name}"
        if self.family not in FAMILIES:
            raise LayoutError(f"{where}: family={self.family!r} is not one of {FAMILIES}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise LayoutError(f"{where}: weight_dtype={self.weight_dtype!r} is not one of {tuple(WEIGHT_DTYPES)}")
        if self.weight_bits != WEIGHT_DTYPES[self.weight_dtype]:
            raise LayoutError(f"{where}: weight_bits={self.weight_bits} does not match {self.weight_dtype}")
        if self.block_n <= 0 or self.k_pack <= 0 or self.i_align % self.block_n or self.i_align % self.k_pack:
            raise LayoutError(
                f"{where}: i_align={self.i_align} must be a multiple of block_n={self.block_n} and k_pack={self.k_pack}"
            )
        if self.block_n % 2:
            raise LayoutError(f"{where}: block_n={self.block_n} must be even (interleaved gate/up pairs)")
        if (self.k_pack * self.weight_bits) % 8:
            raise LayoutError(f"{where}: k_pack={self.k_pack} x {self.weight_bits} bits is not a whole number of bytes")
        if self.scale_dtype not in SCALE_DTYPES or self.zero_kind not in ZERO_KINDS:
            raise LayoutError(f"{where}: scale_dtype/zero_kind {self.scale_dtype}/{self.zero_kind} unknown")
        if self.scheme not in SCHEMES:
            raise LayoutError(f"{where}: scheme={self.scheme!r} is not one of {SCHEMES}")
        if not self.act_modes or any(m not in ACT_MODES for m in self.act_modes):
            raise LayoutError(f"{where}: act_modes={self.act_modes!r} must be a non-empty subset of {ACT_MODES}")
        if self.weight_bits < 16 and self.scale_dtype == "none":
            raise LayoutError(f"{where}: integer weights ({self.weight_dtype}) need a scale_dtype")
        if self.code_order and (self.weight_bits >= 8 or sorted(self.code_order) != list(range(self.k_pack))):
            raise LayoutError(f"{where}: code_order={self.code_order!r} must be a permutation of 0..k_pack-1 "
                              f"(k_pack={self.k_pack}), and only sub-byte codes have one")  # fmt: skip
        if self.group_size < 0 or (self.group_size and self.group_size % self.k_pack):
            raise LayoutError(f"{where}: group_size={self.group_size} must be 0 or a positive multiple of k_pack={self.k_pack}")
        self._check_tensors(where)

    def _check_tensors(self, where: str) -> None:
        if not self.tensors or self.tensors[0].role != "codes" or self.tensors[0].suffix != "":
            raise LayoutError(f"{where}: tensors[0] must be the codes (role 'codes', suffix '')")
        if len(self.tensors) > MAX_LAYOUT_TENSORS:
            raise LayoutError(f"{where}: {len(self.tensors)} tensors; a layout declares at most {MAX_LAYOUT_TENSORS}")
        seen_roles, seen_suffix = set(), set()
        for i, t in enumerate(self.tensors):
            tw = f"{where}: tensors[{i}] ({t.role!r})"
            if t.role not in TENSOR_ROLES or t.dtype not in TENSOR_DTYPES or t.shape not in TENSOR_SHAPES:
                raise LayoutError(f"{tw}: role/dtype/shape {t.role}/{t.dtype}/{t.shape} must be in {TENSOR_ROLES}/{tuple(TENSOR_DTYPES)}/{TENSOR_SHAPES}")
            if t.role in seen_roles or t.suffix in seen_suffix:
                raise LayoutError(f"{tw}: role {t.role!r} or suffix {t.suffix!r} declared twice")
            seen_roles.add(t.role)
            seen_suffix.add(t.suffix)
            if (t.role == "codes") != (t.shape == "packed"):
                raise LayoutError(f"{tw}: the codes and only the codes have shape 'packed'")
            if i and not t.suffix.startswith("_"):
                raise LayoutError(f"{tw}: suffix {t.suffix!r} must start with '_'")
            if t.shape == "group" and not self.group_size:
                raise LayoutError(f"{tw}: shape 'group' needs group_size > 0")
            if t.suffix in RESERVED_SUFFIXES:
                raise LayoutError(f"{tw}: suffix {t.suffix!r} is reserved ({', '.join(RESERVED_SUFFIXES)}: the biases, the act-order permutation)")
        codes = self.tensors[0]
        if (self.weight_bits * self.k_pack) % (8 * TENSOR_DTYPES[codes.dtype]):
            raise LayoutError(f"{where}: codes dtype {codes.dtype} does not hold k_pack={self.k_pack} x {self.weight_bits} bits")
        want_codes = CODES_DTYPES[self.weight_dtype]
        if codes.dtype != want_codes:
            raise LayoutError(f"{where}: weight_dtype {self.weight_dtype} is stored as {want_codes} codes, not {codes.dtype}")
        # the declaration and the scale/zero fields say the same thing
        for role, field, value, dtypes in (("scale", "scale_dtype", self.scale_dtype, SCALE_TENSOR_DTYPES),
                                           ("zero", "zero_kind", self.zero_kind, ZERO_TENSOR_DTYPES)):  # fmt: skip
            decl = [t for t in self.tensors if t.role == role]
            if (value == "none") != (not decl):
                raise LayoutError(f"{where}: {field}={value!r} but the tensors declare {len(decl)} {role} tensor(s): "
                                  f"a {role} tensor is declared exactly when {field} is not 'none'")  # fmt: skip
            if decl and decl[0].dtype != dtypes[value]:
                raise LayoutError(f"{where}: {field}={value!r} is stored as {dtypes[value]}, the {role} tensor says {decl[0].dtype}")

    @property
    def elem_bytes(self) -> float:
        """Bytes per stored weight element (0.5 for 4-bit codes)."""
        return self.weight_bits / 8

    def tensor_names(self, weight: str) -> tuple[str, ...]:
        """The stored names of one packed weight's tensors (``weight`` = "w13", "w2",
        "shared_w13", ...), in declared order: the order the op takes them in."""
        return tuple(weight + t.suffix for t in self.tensors)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["act_modes"] = list(self.act_modes)
        d["code_order"] = list(self.code_order)
        d["tensors"] = [t.to_dict() for t in self.tensors]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PackedLayout":
        d = dict(d)
        d["act_modes"] = tuple(d.get("act_modes", ("a16",)))
        d["code_order"] = tuple(d.get("code_order", ()))
        d["tensors"] = tuple(TensorSpec(**t) for t in d.get("tensors", ()))
        return cls(**d)


MAX_LAYOUT_TENSORS = 4
# w13_bias / w2_bias are the optional biases of every layout; w13_perm the optional act-order
# permutation of int4_group layouts (PERM_SCHEMES)
RESERVED_SUFFIXES = ("_bias", "_perm")
PERM_SCHEMES = ("int4_group",)  # the schemes whose layers may carry a w13_perm
CODES_DTYPES = {"bf16": "bfloat16", "f32": "float32", "i8": "int8", "u4": "uint8", "f8e4m3": "uint8", "e2m1": "uint8"}  # weight_dtype -> codes tensor
SCALE_TENSOR_DTYPES = {"f32": "float32", "bf16": "bfloat16", "e8m0": "uint8", "e4m3": "uint8"}
ZERO_TENSOR_DTYPES = {"u4": "uint8", "bf16": "bfloat16"}
# The fields of a layout descriptor in a format-version-1 manifest (before layouts declared their
# tensors); moepack.runtime compares only these for such a manifest.
V1_FIELDS = ("id", "name", "weight_dtype", "weight_bits", "group_size", "block_n", "k_pack", "scale_dtype",
             "zero_kind", "family", "i_align")  # fmt: skip

_BF16_CODES = TensorSpec("codes", "", "bfloat16", "packed", note="bf16 weight values")
_I8_TENSORS = (
    TensorSpec("codes", "", "int8", "packed", note="int8 codes, -128..127"),
    TensorSpec("scale", "_scale", "float32", "channel", note="fp32 per-output-channel scale (0 in padding)"),
    TensorSpec("sum", "_colsum", "int32", "channel", note="int32 sum over K of the channel's codes"),
)

# int4 group (SEMANTICS.md §3): unsigned 4-bit codes 0..15, (q - z[g, n]) * s[g, n] with one fp32
# scale and one zero point (0..15, one per byte; 8 for symmetric sources) per (K group, output
# channel). One K group of a block is 32 columns x 8 codes = 128 bytes, one 32-bit word per
# column holding its 8 consecutive K values k0..k0+7 as: byte j (0..3) = code[k0 + j] | code[k0 +
# 4 + j] << 4 (U4_NIBBLE_ORDER). So `word & 0x0F0F0F0F` gives the bytes k0..k0+3 and `(word >> 4)
# & 0x0F0F0F0F` the bytes k0+4..k0+7: each the u8 operand of vpdpbusd (W4A8) / vpmaddubsw, and
# byte lanes that widen straight to the bf16 pairs of the dense kernels (W4A16). Padding codes
# (K beyond the real K, inside a partial last group) hold the group's zero point, so every
# padded weight dequantizes to exactly 0; padded channels have scale 0 and zero 0. Groups follow
# K from 0: a group size that does not divide K leaves the last group partial. One layout per
# group size (the scale tensors' shape depends on it); "ch" = one group over all of K.
def _u4_tensors(shape: str) -> tuple[TensorSpec, ...]:
    where = "per (K group, output channel)" if shape == "group" else "per output channel"
    return (
        TensorSpec("codes", "", "uint8", "packed", pad="zero point",
                   note="4-bit codes 0..15, two per byte (U4_NIBBLE_ORDER)"),  # fmt: skip
        TensorSpec("scale", "_scale", "float32", shape, note=f"fp32 scale {where} (0 in padding)"),
        TensorSpec("zero", "_zero", "uint8", shape, note=f"zero point 0..15 {where}, one per byte (8: symmetric)"),
    )


def _u4_layout(id_: int, group: int, family: str = "x86", block_n: int = 32) -> "PackedLayout":
    tag = f"g{group}" if group else "ch"
    return PackedLayout(
        id=id_, name=f"u4{tag}_n{block_n}k8_{family}", weight_dtype="u4", weight_bits=4, group_size=group, block_n=block_n,
        k_pack=8, scale_dtype="f32", zero_kind="u4", family=family, i_align=32, scheme="int4_group",
        act_modes=("a16", "a8"), tensors=_u4_tensors("group" if group else "channel"), code_order=U4_CODE_ORDER,
    )  # fmt: skip


# Within the k_pack = 8 codes of one column in a u4 K group: element j sits in byte j % 4, low
# nibble for j < 4, high nibble for j >= 4: slot 2 * (j % 4) + j // 4 (PackedLayout.code_order).
U4_NIBBLE_ORDER = "byte j%4, nibble j//4"
U4_CODE_ORDER = tuple(2 * (j % 4) + j // 4 for j in range(8))  # (0, 2, 4, 6, 1, 3, 5, 7)
U4_GROUP_SIZES = (32, 64, 128)  # the u4 layouts' group sizes (and 0 = per channel)

# fp8 block (SEMANTICS.md §3, W8A16): float8 e4m3fn codes, one byte each (their bit patterns,
# never widened), fp8(q) * s[g, n] with one fp32 scale per (K group of 128, output channel):
# a source's 2-D block scales [ceil(N/bn), ceil(K/bk)] are expanded over the block's rows, so
# any row blocking (and gate/up halves whose blocks do not line up with 32-column blocks) packs
# exactly. The codes are blocked like bf16_n32k2_x86 (a K pair of 32 columns = 64 bytes), so a
# decoded K slice is the SIMD levels' dense bf16 block byte for byte. Padding codes are 0x00
# (+0); padded channels have scale 0. "ch": per output channel (FP8_DYNAMIC; a per-tensor
# scale is expanded to every channel).
def _f8_tensors(shape: str) -> tuple[TensorSpec, ...]:
    where = "per (K group, output channel)" if shape == "group" else "per output channel"
    return (
        TensorSpec("codes", "", "uint8", "packed", note="float8 e4m3fn bit patterns, one per byte"),
        TensorSpec("scale", "_scale", "float32", shape, note=f"fp32 scale {where} (0 in padding)"),
    )


def _f8_layout(id_: int, group: int, family: str = "x86", block_n: int = 32, k_pack: int = 2) -> "PackedLayout":
    tag = f"g{group}" if group else "ch"
    return PackedLayout(
        id=id_, name=f"f8{tag}_n{block_n}k{k_pack}_{family}", weight_dtype="f8e4m3", weight_bits=8, group_size=group,
        block_n=block_n, k_pack=k_pack, scale_dtype="f32", zero_kind="none", family=family, i_align=32, scheme="fp8_block",
        act_modes=("a16",), tensors=_f8_tensors("group" if group else "channel"),
    )  # fmt: skip


F8_GROUP_SIZES = (128,)  # the fp8 layouts' K block sizes (and 0 = per channel)

# mxfp4 (SEMANTICS.md §3 "mxfp4", OCP MX v1.0): 4-bit e2m1 codes (bit 3 the sign, bits 2-1 the
# exponent with bias 1, bit 0 the mantissa: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) and one e8m0
# exponent byte e per (K group of 32, output channel): w = e2m1(q) * 2^(e - 127), e = 255 (NaN)
# refused. The codes sit exactly where the u4 layouts put theirs (k_pack 8, U4_CODE_ORDER: byte j
# of a column's 32-bit word holds codes j and j + 4), so the int4 kernels' nibble handling reads
# them; a 16-entry table per nibble gives the value (A16: the bf16 bits of e2m1(q); A8: the
# integer 2 * e2m1(q), -12..12). The scales stay one byte each ([E, Kp/32, Np] uint8, 1/16 of the
# codes' bytes). Padding codes are 0 (+0) and padding scales 0 (2^-127): a padded weight is 0.
def _mx4_layout(id_: int, family: str = "x86", block_n: int = 32) -> "PackedLayout":
    return PackedLayout(
        id=id_, name=f"mx4g32_n{block_n}k8_{family}", weight_dtype="e2m1", weight_bits=4, group_size=32, block_n=block_n,
        k_pack=8, scale_dtype="e8m0", zero_kind="none", family=family, i_align=32, scheme="mxfp4",
        act_modes=("a16", "a8"), code_order=U4_CODE_ORDER,
        tensors=(
            TensorSpec("codes", "", "uint8", "packed", note="e2m1 codes, two per byte (U4_NIBBLE_ORDER)"),
            TensorSpec("scale", "_scale", "uint8", "group",
                       note="e8m0 exponent e per (K group of 32, output channel): 2^(e - 127); 0 in padding"),
        ),
    )  # fmt: skip


MX4_GROUP = 32  # OCP MX: one e8m0 scale per 32 K values


# nvfp4 (SEMANTICS.md §3 "nvfp4"): the e2m1 codes exactly where the mx4 layouts put theirs (k_pack
# 8, U4_CODE_ORDER), one float8 e4m3fn scale byte per (K group of 16, output channel) as stored
# ([E, Kp/16, Np] uint8, 1/8 of the codes' bytes: 4.5 bits a weight) and one fp32 per output channel,
# the tensor-wide ("global") scale of the source Linear the channel came from, kept apart from the
# byte scales because folding it into them is not exact: g > 0 is compressed-tensors'
# weight_global_scale, a divisor (the group's scale is fp32(e4m3 / g)); g <= 0 is ModelOpt's
# weight_scale_2 negated, a multiplier (fp32(e4m3 * -g)). Either way the group's scale is the
# source's own fp32 rounding of it, and w = e2m1(q) * that scale. Padding codes 0, padding scale
# bytes 0 and padding globals 0 (a multiplier of 0): a padded weight is 0.
def _nv4_layout(id_: int, family: str = "x86", block_n: int = 32) -> "PackedLayout":
    return PackedLayout(
        id=id_, name=f"nv4g16_n{block_n}k8_{family}", weight_dtype="e2m1", weight_bits=4, group_size=16, block_n=block_n,
        k_pack=8, scale_dtype="e4m3", zero_kind="none", family=family, i_align=32, scheme="nvfp4",
        act_modes=("a16", "a8"), code_order=U4_CODE_ORDER,
        tensors=(
            TensorSpec("codes", "", "uint8", "packed", note="e2m1 codes, two per byte (U4_NIBBLE_ORDER)"),
            TensorSpec("scale", "_scale", "uint8", "group",
                       note="float8 e4m3fn scale byte per (K group of 16, output channel), never negative or NaN; 0 in padding"),
            TensorSpec("global", "_global", "float32", "channel",
                       note="fp32 global scale of the channel's source Linear: > 0 divides (compressed-tensors), "
                            "<= 0 multiplies by its negation (ModelOpt); 0 in padding"),
        ),
    )  # fmt: skip


NV4_GROUP = 16  # NVFP4: one e4m3 scale per 16 K values

LAYOUTS: tuple[PackedLayout, ...] = (
    PackedLayout(
        id=1,
        name="bf16_n32k2_x86",
        weight_dtype="bf16",
        weight_bits=16,
        group_size=0,
        block_n=32,
        k_pack=2,
        scale_dtype="none",
        zero_kind="none",
        family="x86",
        i_align=32,
        scheme="dense",
        act_modes=("a16",),
        tensors=(_BF16_CODES,),
    ),
    # W8A8 (SEMANTICS.md §3 "int8 channel"): int8 codes, one fp32 scale per output channel
    # (separate [E, N] tensors, plus int32 column sums for the VNNI kernel's u8 activations).
    # One K group of a block = 32 columns x 4 int8 = 128 bytes: a 32-bit lane holds
    # w[n][k..k+3], the operand of vpdpbusd (AVX-512 VNNI) and of vpmaddubsw + vpmaddwd (AVX2).
    PackedLayout(
        id=2,
        name="i8_n32k4_x86",
        weight_dtype="i8",
        weight_bits=8,
        group_size=0,
        block_n=32,
        k_pack=4,
        scale_dtype="f32",
        zero_kind="none",
        family="x86",
        i_align=32,
        scheme="int8_channel",
        act_modes=("a8",),
        tensors=_I8_TENSORS,
    ),
    _u4_layout(3, 32),
    _u4_layout(4, 64),
    _u4_layout(5, 128),
    _u4_layout(6, 0),
    _f8_layout(7, 128),
    _f8_layout(8, 0),
    _mx4_layout(9),
    # ---- the arm family (AArch64 NEON, csrc/arm/; docs/KERNELS.md "ARM"): blocks of 16 columns,
    # so a 128-bit register holds two columns' K runs (the B operand of the 2x2 matrix-multiply
    # instructions) and a level keeps one or two rows' accumulators of a block in its 32 registers.
    # I is still padded to 32, like the x86 layouts.
    #
    # Dense bf16: runs of 4 K values. One 16-byte vector = columns n, n+1 x K k..k+3 = the B operand
    # of BFMMLA (2 rows x 4 K . 4 K x 2 columns); for BFDOT (an odd row) its 32-bit lanes are the
    # K pairs (n: k..k+1, n: k+2..k+3, n+1: ..), against the row's 4 values broadcast to both 64-bit
    # halves, the two partial sums of a column added at the end; without bf16 instructions (level
    # neon) the low and high halves widen (shll #16) to the fp32 runs of columns n and n+1 for fmla.
    # One layout serves the three.
    PackedLayout(
        id=10, name="bf16_n16k4_arm", weight_dtype="bf16", weight_bits=16, group_size=0, block_n=16, k_pack=4,
        scale_dtype="none", zero_kind="none", family="arm", i_align=32, scheme="dense", act_modes=("a16",),
        tensors=(_BF16_CODES,),
    ),
    # int8 (W8A8): runs of 8 K values. One 16-byte vector = columns n, n+1 x K k..k+7 = the B operand
    # of SMMLA (2 rows x 8 K . 8 K x 2 columns); for SDOT its 32-bit lanes are the K quads (n: k..k+3,
    # n: k+4..k+7, n+1: ..) against the row's 8 codes broadcast to both halves (pairwise added at the
    # end); without SDOT (level neon) smull of each half + sadalp. One layout for SDOT and SMMLA, so
    # a pack runs at the best level of any ARM CPU (a k_pack 4 layout would suit SDOT alone).
    PackedLayout(
        id=11, name="i8_n16k8_arm", weight_dtype="i8", weight_bits=8, group_size=0, block_n=16, k_pack=8,
        scale_dtype="f32", zero_kind="none", family="arm", i_align=32, scheme="int8_channel", act_modes=("a8",),
        tensors=_I8_TENSORS,
    ),
    # int4 group: the x86 code arrangement (runs of 8, U4_CODE_ORDER) in blocks of 16 columns: one
    # 16-byte vector = 4 columns x 8 codes whose low nibbles are K k..k+3 and high nibbles k+4..k+7,
    # each the 4-byte lane operand of SDOT. (The ARM levels decode them through the portable codec
    # into their dense block today: docs/KERNELS.md.) The default group size 128 first.
    _u4_layout(12, 128, "arm", 16),
    _u4_layout(13, 32, "arm", 16),
    _u4_layout(14, 64, "arm", 16),
    _u4_layout(15, 0, "arm", 16),
    # fp8 block: blocked like bf16_n16k4_arm, so a decoded K slice is the ARM dense block.
    _f8_layout(16, 128, "arm", 16, 4),
    _f8_layout(17, 0, "arm", 16, 4),
    # mxfp4: e2m1 nibbles where the arm u4 layouts put their codes (a vector = 4 columns x 8 codes,
    # `& 0x0f` K k..k+3, `>> 4` k+4..k+7), one e8m0 byte per (K group of 32, column) like
    # mx4g32_n32k8_x86; a 16-entry `tbl` turns a nibble into its bf16 bytes (A16) or 2 * e2m1 (A8).
    _mx4_layout(18, "arm", 16),
    # nvfp4: the mxfp4 blockings (x86 n32k8, arm n16k8) with one e4m3 byte per 16 K and a per-channel
    # fp32 global scale.
    _nv4_layout(19),
    _nv4_layout(20, "arm", 16),
)

_BY_ID = {layout.id: layout for layout in LAYOUTS}
_BY_NAME = {layout.name: layout for layout in LAYOUTS}
assert len(_BY_ID) == len(LAYOUTS) and len(_BY_NAME) == len(LAYOUTS), "duplicate layout id or name"

# ---- Test-only schemes (docs/ARCHITECTURE.md "What a new weight scheme touches"). A folder
# tests/schemes/<s>/ with a ``layouts.py`` holds a whole scheme that only tests run. Its layouts.py
# declares ``SCHEME`` (the name), ``WEIGHT_KINDS`` ({weight kind: (bits, codes tensor dtype)}),
# optionally ``FAMILIES`` (layout families of its own: one that no level of moepack/isa_levels.py
# targets is run by the scalar level alone) and ``layouts()`` (its PackedLayouts, ids never
# reused); its scheme.py is the Python scheme, its *.inc the C++ codec. tools/gen_layouts.py
# always adds them (add_testonly_schemes), so the C++ tables and kernels know them
# (csrc/kernels/schemes_gen.inc includes their C++); moepack adds them to these tables, and
# moepack.schemes registers their schemes, only when MOEPACK_TEST_SCHEMES=1 is set when it is
# imported (a source checkout's tests set it in a child process), so the CLI, the API and packs
# never see them. They come after every real kind, scheme and family, so no enum value moves.
TEST_SCHEMES_ENV = "MOEPACK_TEST_SCHEMES"
TEST_SCHEMES_DIR = pathlib.Path(__file__).resolve().parent.parent / "tests" / "schemes"
_TEST_SCHEMES: dict = {}  # name -> the folder, once added


def scheme_dirs_for_tests() -> list[pathlib.Path]:
    """The test-only scheme folders of this source tree (none in an installed moepack)."""
    return sorted(p.parent for p in TEST_SCHEMES_DIR.glob("*/layouts.py"))


def schemes_for_tests_enabled() -> bool:
    return os.environ.get(TEST_SCHEMES_ENV) == "1"


def add_testonly_schemes() -> dict:
    """Add every test-only scheme's weight kinds, name and layouts to this module's tables (once)
    -> {scheme name: its folder}. A kind, name, id or layout name already taken is a LayoutError."""
    global SCHEMES, LAYOUTS, FAMILIES
    for folder in scheme_dirs_for_tests():
        if folder in _TEST_SCHEMES.values():
            continue
        spec = importlib.util.spec_from_file_location(f"moepack._test_scheme_layouts_{folder.name}", folder / "layouts.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        where = f"test scheme {folder.name} ({folder / 'layouts.py'})"
        taken = [k for k in mod.WEIGHT_KINDS if k in WEIGHT_DTYPES] + [mod.SCHEME] * (mod.SCHEME in SCHEMES)
        if taken:
            raise LayoutError(f"{where}: {', '.join(taken)} already taken: a test scheme declares new names")
        for kind, (bits, dtype) in mod.WEIGHT_KINDS.items():
            WEIGHT_DTYPES[kind] = bits
            CODES_DTYPES[kind] = dtype
        SCHEMES = SCHEMES + (mod.SCHEME,)
        FAMILIES = FAMILIES + tuple(f for f in getattr(mod, "FAMILIES", ()) if f not in FAMILIES)
        new = tuple(mod.layouts())
        for x in new:
            if x.scheme != mod.SCHEME or x.id in _BY_ID or x.name in _BY_NAME:
                raise LayoutError(f"{where}: layout {x.name} (id {x.id}, scheme {x.scheme}): a test scheme's layouts are of "
                                  "its scheme, with an id and a name no other layout has")  # fmt: skip
            _BY_ID[x.id], _BY_NAME[x.name] = x, x
        LAYOUTS = LAYOUTS + new
        _TEST_SCHEMES[mod.SCHEME] = folder
    return dict(_TEST_SCHEMES)


if schemes_for_tests_enabled():
    add_testonly_schemes()

DEFAULT_LAYOUT = _BY_NAME["bf16_n32k2_x86"]
INT8_LAYOUT = _BY_NAME["i8_n32k4_x86"]
INT4_LAYOUT = _BY_NAME["u4g128_n32k8_x86"]  # pack_experts' int4 default (symmetric, group 128)
FP8_LAYOUT = _BY_NAME["f8g128_n32k2_x86"]  # DeepSeek-style 128 x 128 blocks
MXFP4_LAYOUT = _BY_NAME["mx4g32_n32k8_x86"]
NVFP4_LAYOUT = _BY_NAME["nv4g16_n32k8_x86"]
ARM_LAYOUT = _BY_NAME["bf16_n16k4_arm"]  # the arm family's dense layout


def int4_layout_for(group_size: int, family: str = "x86") -> PackedLayout:
    """The int4_group layout of one group size (0 or -1 = per output channel), or a LayoutError
    naming the sizes there are layouts for."""
    g = 0 if group_size in (0, -1) else group_size
    for x in LAYOUTS:
        if x.scheme == "int4_group" and x.family == family and x.group_size == g:
            return x
    have = ", ".join(str(x.group_size or -1) for x in LAYOUTS if x.scheme == "int4_group" and x.family == family)
    raise LayoutError(f"int4 group_size={group_size}: moepack has int4 layouts for group sizes {have} (-1 = per channel)")


def layout_get(key: int | str | PackedLayout) -> PackedLayout:
    """Look a layout up by id, name or identity; unknown keys raise ``LayoutError``."""
    if isinstance(key, PackedLayout):
        return key
    table = _BY_ID if isinstance(key, int) else _BY_NAME
    try:
        return table[key]
    except KeyError:
        known = ", ".join(f"{x.name} (id {x.id})" for x in LAYOUTS)
        raise LayoutError(f"layout {key!r} is unknown; known layouts: {known}") from None


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def layout_padded_n(layout: PackedLayout, n: int) -> int:
    """Output columns after padding to whole blocks."""
    return _round_up(n, layout.block_n)


def layout_padded_k(layout: PackedLayout, k: int) -> int:
    """Input size after padding to whole K groups."""
    return _round_up(k, layout.k_pack)


def layout_padded_i(layout: PackedLayout, intermediate: int) -> int:
    """Intermediate size after zero padding (gate and up halves are padded separately)."""
    return _round_up(intermediate, layout.i_align)


def layout_matrix_bytes(layout: PackedLayout, n: int, k: int) -> int:
    """Bytes of one packed ``[n, k]`` matrix's codes (one expert's weight), padding included."""
    return layout_padded_n(layout, n) * layout_padded_k(layout, k) * layout.weight_bits // 8


def layout_element_offset(layout: PackedLayout, n: int, k: int, kp: int) -> int:
    """Element index of logical ``(n, k)`` inside one packed matrix whose padded K is ``kp``."""
    bn, kpk = layout.block_n, layout.k_pack
    return (n // bn) * bn * kp + (k // kpk) * bn * kpk + (n % bn) * kpk + k % kpk


def layout_code_position(layout: PackedLayout, n: int, k: int, kp: int) -> tuple[int, int]:
    """``(byte, bit shift)`` of logical code ``(n, k)`` inside one packed matrix whose padded K is
    ``kp``: ``layout_element_offset`` gives the element's run of ``k_pack`` values, the layout's
    ``code_order`` the slot inside the run (sub-byte codes); wider codes start at
    ``offset * weight_bits / 8`` with shift 0."""
    e = layout_element_offset(layout, n, k, kp)
    bits = layout.weight_bits
    if bits >= 8:
        return e * bits // 8, 0
    j = k % layout.k_pack
    slot = layout.code_order[j] if layout.code_order else j
    bit = (e - j + slot) * bits
    return bit // 8, bit % 8


@dataclass(frozen=True)
class ExpertShapes:
    """Logical and padded sizes of one MoE layer's packed experts."""

    num_experts: int
    hidden: int  # H
    intermediate: int  # I (real)
    padded_intermediate: int  # Ip
    w13_shape: tuple[int, int, int]  # packed [E, 2*Ip, Kp(H)]; [E, Ip, Kp(H)] for non-gated (relu2) experts
    w2_shape: tuple[int, int, int]  # packed [E, Np(H), Ip]


def layout_expert_shapes(layout: PackedLayout, num_experts: int, hidden: int, intermediate: int,
                         gated: bool = True) -> ExpertShapes:  # fmt: skip
    """The packed matrix shapes for a layer (logical [N, K] of the codes); all padding decisions
    are made here. ``gated=False``: non-gated experts (relu2), whose w13 holds the up rows alone."""
    if num_experts <= 0 or hidden <= 0 or intermediate <= 0:
        raise LayoutError(
            f"expert shapes E={num_experts}, H={hidden}, I={intermediate}: every size must be positive"
        )
    ip = layout_padded_i(layout, intermediate)
    return ExpertShapes(
        num_experts=num_experts,
        hidden=hidden,
        intermediate=intermediate,
        padded_intermediate=ip,
        w13_shape=(num_experts, (2 if gated else 1) * ip, layout_padded_k(layout, hidden)),
        w2_shape=(num_experts, layout_padded_n(layout, hidden), layout_padded_k(layout, ip)),
    )


def tensor_shape(layout: PackedLayout, spec: TensorSpec, e: int, np_: int, kp: int) -> tuple[int, ...]:
    """The shape of one declared tensor of a packed [E, np_, kp] weight (TENSOR_SHAPES). The C++
    twin is ``tensor_shape`` in csrc/include/moepack/layout_shapes.h (tests/engine/test_layout_sync.py)."""
    if spec.shape == "packed":
        return (e, np_, kp * layout.weight_bits // (8 * TENSOR_DTYPES[spec.dtype]))
    if spec.shape == "channel":
        return (e, np_)
    return (e, -(-kp // layout.group_size), np_)  # "group"


@dataclass(frozen=True)
class TensorPlan:
    """One stored tensor of a layer's packed experts: its name (``w13_scale``), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name (TENSOR_DTYPES)
    weight: str  # the weight it belongs to: "w13" or "w2" (with the prefix)
    role: str  # TENSOR_ROLES, or "bias", or "perm"


def layout_tensor_plan(
    layout: PackedLayout, num_experts: int, hidden: int, intermediate: int, *, bias: bool = False, perm: bool = False,
    prefix: str = "", gated: bool = True,
) -> list[TensorPlan]:
    """THE shape function: every tensor of one layer's packed experts, in the order the op takes
    them (w13's declared tensors, then w2's; then the fp32 biases w13_bias [E, 2*Ip] and w2_bias
    [E, Np(H)] when ``bias``; then, when ``perm``, the act-order permutation w13_perm int32 [E, H]:
    column j of w13's codes is input channel w13_perm[e, j], docs/SEMANTICS.md §3; int4_group
    layouts only). ``gated=False``: non-gated experts (activation relu2), w13 of Ip up rows alone.
    convert's plan, the manifest check, ``moepack.open``, verify and the packers use it; the op
    checks the same shapes in C++ (layout_shapes.h)."""
    if perm and layout.scheme not in PERM_SCHEMES:
        raise LayoutError(
            f"w13_perm with layout {layout.name} (scheme {layout.scheme}): only {' / '.join(PERM_SCHEMES)} layouts carry an "
            "act-order permutation"
        )
    sh = layout_expert_shapes(layout, num_experts, hidden, intermediate, gated)
    out = []
    for w, (e, np_, kp) in (("w13", sh.w13_shape), ("w2", sh.w2_shape)):
        for spec in layout.tensors:
            out.append(TensorPlan(prefix + w + spec.suffix, tensor_shape(layout, spec, e, np_, kp), spec.dtype, prefix + w, spec.role))
    if bias:
        out.append(TensorPlan(prefix + "w13_bias", (num_experts, sh.w13_shape[1]), "float32", prefix + "w13", "bias"))
        out.append(TensorPlan(prefix + "w2_bias", (num_experts, sh.w2_shape[1]), "float32", prefix + "w2", "bias"))
    if perm:
        out.append(TensorPlan(prefix + "w13_perm", (num_experts, hidden), "int32", prefix + "w13", "perm"))
    return out


def layout_flops(tokens: int, topk: int, hidden: int, intermediate: int) -> int:
    """Useful multiply-adds x 2 of one fused MoE call (padding not counted)."""
    return 2 * tokens * topk * 3 * hidden * intermediate


__all__ = [
    "layout_code_position",
    "U4_CODE_ORDER",
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "INT8_LAYOUT",
    "INT4_LAYOUT",
    "FP8_LAYOUT",
    "int4_layout_for",
    "PackedLayout",
    "ExpertShapes",
    "TensorSpec",
    "TensorPlan",
    "SCHEMES",
    "ACT_MODES",
    "tensor_shape",
    "layout_tensor_plan",
    "layout_get",
    "layout_padded_n",
    "layout_padded_k",
    "layout_padded_i",
    "layout_matrix_bytes",
    "layout_element_offset",
    "layout_expert_shapes",
    "layout_flops",
]
