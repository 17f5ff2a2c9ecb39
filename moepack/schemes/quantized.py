"""The base of the quantized schemes' layer packers (int8_channel, int4_group, and the next).

What they share: the codes of w13 / w2 stream out one expert at a time while each expert's
other packed tensors (scales, zero points, column sums, the act-order permutation) are gathered
into the layer's tensors, which the plan writes right after their codes; a source of the scheme
gives its own canonical tensors (never re-quantized), a float source is quantized with the
convert's options and its quantization error is summed into ``LayerSource.error``; the shared
expert is packed as a one-expert set the same way. A scheme supplies three functions of ONE
weight: quantize, dequantize (for the error) and pack.
"""

from __future__ import annotations

import torch

from ..errors import ConvertError, LayoutError
from ..layout import layout_tensor_plan
from ..pack.registry import get_scheme
from . import LayerPacker


class QuantizedLayer(LayerPacker):
    """Subclasses define ``quantize_weight(w) -> {"q": ..., "scale": ..., ...}`` (one float weight
    ``[1, N, K]`` -> its canonical tensors, unprefixed), ``dequantize_weight(d) -> fp32`` and
    ``pack_weight(role, canonical, interleaved) -> {stored name: packed tensor}`` (one expert);
    optionally ``finish(name, tensor)`` for a gathered tensor before it is written."""

    def __init__(self, src):
        super().__init__(src)
        s = self.spec
        self.scheme = get_scheme(self.layout)
        # every per-expert tensor other than the codes and the biases, filled as the codes stream
        plan = layout_tensor_plan(self.layout, s.num_experts, s.hidden, s.intermediate, perm=self.scheme.has_perm(s))
        self.gathered = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in plan if t.role not in ("codes", "bias")}

    # -- the scheme's part ------------------------------------------------------------------
    def quantize_weight(self, w: torch.Tensor) -> dict:
        raise NotImplementedError

    def dequantize_weight(self, d: dict) -> torch.Tensor:
        raise NotImplementedError

    def pack_weight(self, role: str, c: dict, interleaved: bool) -> dict:
        raise NotImplementedError

    def finish(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t

    # -- shared -----------------------------------------------------------------------------
    def _quantized(self, w: torch.Tensor, role: str, where: str, e: int) -> dict:
        """Quantize float ``w`` [1, N, K] (a non-finite value is named in the SOURCE by ``checked``)
        and add its error to the convert's; -> canonical tensors prefixed with ``role``."""
        src = self.src
        d = src.checked(self.quantize_weight, w, where, e)
        if src.error is not None:
            src.error.add(self.spec.index, w, self.dequantize_weight(d))
        return {f"{role}_{k}": v for k, v in d.items()}

    def canonical(self, role: str, e: int) -> dict:
        """Expert ``e``'s canonical tensors of ``role`` ("w13" / "w2"), one-expert [1, ...]."""
        src, r, s = self.src, self.src.reader, self.spec
        if self.scheme.keeps_source(r):
            return {k: v[None] for k, v in r.read_expert_canonical(src.ckpt, s, role, e).items()}
        w = (r.read_expert_w13 if role == "w13" else r.read_expert_w2)(src.ckpt, s, e)
        return self._quantized(w[None], role, role, e)

    def parts(self, name: str):
        s, g = self.spec, self.gathered
        if name in g:  # gathered while the codes streamed (plan order: after them)
            yield self.finish(name, g[name])
            return
        if name not in ("w13", "w2"):
            yield from self.bias_parts(name)
            return
        for e in range(s.num_experts):
            c = self.scheme.complete(self.canonical(name, e), self.layout)
            one = self.pack_weight(name, c, s.interleaved)
            for k, t in g.items():
                if k in one:
                    t[e] = one[k][0]
                elif k in c and k.startswith(name):  # stored as the source gives it (w13_perm)
                    t[e] = c[k].reshape(t[e].shape)
            yield one[name]

    def shared(self):
        """The shared expert packed as one-expert PackedExperts: the source's own canonical
        tensors of this scheme, or its float weights quantized."""
        src, r, s = self.src, self.src.reader, self.spec
        if not s.shared:
            return None
        c = r.read_shared_canonical(src.ckpt, s) if self.scheme.keeps_source(r) else None
        if c is None:
            sw13, sw2 = r.read_shared(src.ckpt, s)
            c = {**self._quantized(sw13, "w13", "shared_w13", 0), **self._quantized(sw2, "w2", "shared_w2", 0)}
        return self.scheme.pack(self.scheme.complete(c, self.layout), interleaved=False, layout=self.layout)


__all__ = ["QuantizedLayer"]


def grouped_source_layout(specs: list, layout, facts, layout_for, what: str, describe=lambda f: ""):
    """The layout a grouped scheme's source packs into (int4, fp8): the scheme's layout of the
    source's own group size, never re-grouped. ``facts(spec)`` is a layer's scheme facts (None:
    not of the scheme), with ``group_size`` and ``shared`` (the shared expert's facts or None);
    every MoE layer and quantized shared expert must have the same group size (one layout per
    directory), and ``layout_for(group_size, family)`` must know it (its LayoutError becomes a
    ConvertError naming where the size came from). ``describe(f)``: words added to a place."""
    sizes = {}
    for s in specs:
        f = facts(s)
        if f is None:
            continue
        sizes.setdefault(f.group_size, f"layer {s.index} ({s.prefix}{describe(f)})")
        if f.shared is not None:
            sizes.setdefault(f.shared.group_size, f"layer {s.index}'s shared expert{describe(f.shared)}")
    if not sizes:
        return layout
    if len(sizes) != 1:
        listed = "; ".join(f"group_size={g} in {where}" for g, where in sizes.items())
        raise ConvertError(f"{what} source with several group sizes ({listed}): moepack packs one {what} layout per directory")
    (g,) = sizes
    try:
        return layout_for(g, layout.family)
    except LayoutError as e:
        raise ConvertError(f"{sizes[g]}: {e}") from None
