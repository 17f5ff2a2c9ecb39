"""compressed-tensors ``int-quantized`` checkpoints (W8A8 INT8; FORMATS.md §3.2, §3.5).

Per quantized Linear ``P``: ``P.weight`` int8 ``[N, K]`` (symmetric, -128..127) and
``P.weight_scale`` ``[N, 1]`` in the model dtype; ``W = weight * scale``. Activations are
dynamic per-token symmetric int8 (no ``input_scale``): exactly moepack's int8 layout
(SEMANTICS.md §3 "int8 channel" with A8), so the codes and scales are packed as they are, never
re-quantized.

compressed-tensors MoE checkpoints are per-expert 2-D (llm-compressor "linearizes" fused
experts), so the expert tensors are found with the dense reader's per-expert name patterns, for
every family it knows (``experts.<e>.{gate,up,down}_proj`` or ``.{w1,w3,w2}``); gpt-oss'
linearized (de-interleaved) gate/up rows are re-interleaved for swigluoai. The config is checked
before anything else: anything but int8 per-channel symmetric weights with dynamic per-token
int8 activations is refused with the reason, and so is, by name, every tensor that breaks the
format (non-int8 expert weight, missing scale, scale not ``[N, 1]``, scale not finite and > 0).
"""

from __future__ import annotations

import torch

from ..errors import SourceError
from .checkpoint import Checkpoint
from .int4_common import check_scales
from .linears import CarriedLinear, LinearFinder, register_linears, weight_and_scale
from .dense import FLOAT_DTYPES, CanonicalLayer, LayerSpec, discover_layers, read_biases as dense_read_biases, text_config

SCHEME = "int8_channel"
SOURCE_NOTE = "compressed-tensors int-quantized (int8 per-channel weights, dynamic per-token int8 activations)"
_WEIGHTS = (FLOAT_DTYPES | {"I8"}, "compressed-tensors int-quantized expert weights must be I8 (shared experts may be BF16/F16/F32)")


def quantization_config(ckpt: Checkpoint) -> dict | None:
    qc = text_config(ckpt.config).get("quantization_config") or ckpt.config.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def ct_strategy(args: dict) -> str:
    """A quantization args' strategy, spelled out where an older config gives only group_size."""
    s = args.get("strategy")
    if s:
        return s
    gs = args.get("group_size")
    return "group" if isinstance(gs, int) and gs > 0 else "channel" if gs == -1 else "tensor"


def config_groups(qc: dict) -> dict:
    """The config groups of a compressed-tensors quantization_config, after the rules every
    compressed-tensors reader shares (compressed, neither sparse nor transformed, at least one
    group, each a JSON object); a SourceError says which one failed."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise SourceError(f"quantization_status={status!r}: moepack reads compressed checkpoints")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise SourceError(f"{key} is set: sparse or transformed compressed-tensors checkpoints are not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise SourceError("quantization_config has no config_groups")
    for gname, g in groups.items():
        if not isinstance(g, dict):
            raise SourceError(f"config group {gname!r} is {type(g).__name__} {g!r:.60}: a config group is a JSON object")
    return groups


def fp4_groups(qc: dict, fmt: str, label: str, grouping, scale_dtypes: tuple, scale_words: str, *,
               other_formats: dict | None = None, static_acts: bool = True) -> dict | None:
    """The config groups of a 4-bit float (e2m1) format ``fmt`` checked, for the MXFP4 and NVFP4
    readers: each group's format, weights (4-bit float, ``grouping(where, strategy, group_size)``
    raising on the scheme's grouping, symmetric, stored, scale dtype in ``scale_dtypes``), input
    activations a JSON object (dynamic unless ``static_acts``), no output activations; every group
    quantizing activations alike. -> the one input-activations object, or None. ``label``: the
    scheme in messages ("MXFP4"); ``other_formats``: formats refused with their own reason."""
    acts = set()
    first = None
    for gname, g in config_groups(qc).items():
        where = f"config group {gname!r}"
        f = g.get("format") or qc.get("format")
        if other_formats and f in other_formats:
            raise SourceError(f"{where} has format {f!r}: {other_formats[f]}; this reader reads {fmt!r}")
        if f != fmt:
            raise SourceError(f"{where} has format {f!r}: this reader reads {fmt!r} ({label})")
        w = g.get("weights") or {}
        if not isinstance(w, dict):
            raise SourceError(f"{where} weights is {type(w).__name__} {w!r:.60}: the weights' quantization args are a JSON object")
        bits, typ = w.get("num_bits"), w.get("type")
        if (bits, typ) != (4, "float"):
            raise SourceError(f"{where} weights num_bits={bits!r}, type={typ!r}: {label} weights are 4-bit float (e2m1)")
        grouping(where, ct_strategy(w), w.get("group_size"))
        if w.get("symmetric") is False:
            raise SourceError(f"{where} weights symmetric=False: {label} weights have no zero point")
        if w.get("dynamic") not in (False, None):
            raise SourceError(f"{where} has dynamic weights: weights must be stored quantized")
        sd = w.get("scale_dtype")
        if sd not in (None, *scale_dtypes):
            raise SourceError(f"{where} weights scale_dtype={sd!r}: {scale_words}")
        a = g.get("input_activations")
        if a is not None and not isinstance(a, dict):
            raise SourceError(f"{where} input_activations is {type(a).__name__} {a!r:.60}: a JSON object or null")
        if a and not static_acts and a.get("dynamic") not in (True, "local"):
            raise SourceError(f"{where} input_activations={a}: static activation scales are not supported (moepack runs the "
                              "activations in 16 bits; dynamic ones are fine)")  # fmt: skip
        if g.get("output_activations"):
            raise SourceError(f"{where} quantizes output activations: not supported")
        this = dict(a) if a else None
        acts.add(repr(this))
        first = this if len(acts) == 1 else first
    if len(acts) > 1:
        raise SourceError(f"config groups quantize activations differently ({sorted(acts)}): one activation mode per checkpoint")
    return first


def check_float_router(view, s: LayerSpec) -> None:
    """A quantized checkpoint's router (weight, bias) and shared-expert gate stay in float."""
    for key in ("weight", "bias"):
        rn = s.router.get(key)
        if rn and view.info(rn).dtype_str not in FLOAT_DTYPES:
            raise SourceError(f"router tensor {rn!r} has dtype {view.info(rn).dtype_str}: the router must stay in float")
    if s.shared.get("gate") and view.info(s.shared["gate"]).dtype_str not in FLOAT_DTYPES:
        raise SourceError(f"tensor {s.shared['gate']!r} is quantized: the shared-expert gate must stay in float")


def _check_config(qc: dict) -> str | None:
    """None when ``qc`` is a W8A8 int8 per-channel compressed-tensors config, else why not."""
    if qc.get("quant_method") != "compressed-tensors":
        return f"quant_method={qc.get('quant_method')!r}, not 'compressed-tensors'"
    try:
        groups = config_groups(qc)
    except SourceError as e:
        return str(e)
    for gname, g in groups.items():
        fmt = g.get("format") or qc.get("format")
        if fmt != "int-quantized":
            return f"config group {gname!r} has format {fmt!r}: moepack reads 'int-quantized' (W8A8 INT8)"
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("symmetric"), ct_strategy(w)) != (8, "int", True, "channel"):
            return (
                f"config group {gname!r} weights are num_bits={w.get('num_bits')}, type={w.get('type')!r}, "
                f"symmetric={w.get('symmetric')}, strategy={ct_strategy(w)!r}: moepack's int8 layout needs 8-bit int, "
                "symmetric, one scale per output channel"
            )
        if w.get("dynamic") not in (False, None):
            return f"config group {gname!r} has dynamic weights: weights must be stored quantized"
        a = g.get("input_activations")
        want = (8, "int", True, "token", True)
        got = None if not a else (a.get("num_bits"), a.get("type"), a.get("symmetric"), ct_strategy(a), a.get("dynamic"))
        if got != want:
            return (
                f"config group {gname!r} input_activations={a}: moepack runs int8 weights with dynamic per-token "
                "symmetric int8 activations (W8A8) only (weight-only int8 / static activation scales are not supported)"
            )
        if g.get("output_activations"):
            return f"config group {gname!r} quantizes output activations: not supported"
    return None


def detect(ckpt: Checkpoint) -> tuple[bool, str]:
    qc = quantization_config(ckpt)
    if qc is None:
        return False, "no quantization_config"
    why = _check_config(qc)
    if why:
        return False, why
    return True, SOURCE_NOTE


def _scale_name(ckpt: Checkpoint, weight: str, n: int) -> str:
    """``weight``'s per-channel scale tensor (header checks: present, float, [N, 1] or [N])."""
    name = weight[: -len(".weight")] + ".weight_scale"
    if name not in ckpt.tensors:
        raise SourceError(f"tensor {weight!r} is int8 but {name!r} is missing: int-quantized weights need their scale")
    ti = ckpt.info(name)
    if ti.dtype_str not in FLOAT_DTYPES:
        raise SourceError(f"tensor {name!r} has dtype {ti.dtype_str}: scales must be BF16, F16 or F32")
    if tuple(ti.shape) not in ((n, 1), (n,)):
        raise SourceError(
            f"tensor {name!r} has shape {list(ti.shape)}: expected [{n}, 1] (one scale per output channel of {weight!r})"
        )
    for extra in (".weight_zero_point", ".input_scale", ".weight_g_idx"):
        other = weight[: -len(".weight")] + extra
        if other in ckpt.tensors:
            raise SourceError(f"tensor {other!r} is present: moepack reads symmetric int8 weights with dynamic activations only")
    return name


def layers(ckpt: Checkpoint) -> list[LayerSpec]:
    specs = discover_layers(ckpt, _WEIGHTS)
    for s in specs:
        if s.kind != "per_expert":
            raise SourceError(
                f"layer {s.prefix!r}: expert tensors are fused ({s.kind}, {s.names.get('gate_up')!r}); compressed-tensors "
                "int-quantized experts are per-expert Linear weights"
            )
        if s.dtype != "I8":
            name = s.names[(0, "gate", "weight")]
            raise SourceError(f"tensor {name!r} has dtype {s.dtype}: {_WEIGHTS[1]}")
        i, h = s.intermediate, s.hidden
        for e in range(s.num_experts):
            for role, n in (("gate", i), ("up", i), ("down", h)):
                sn = _scale_name(ckpt, s.names[(e, role, "weight")], n)
                _read_scale(ckpt, sn)  # values too (small): bad scales are refused before anything is written
                s.names[(e, role, "scale")] = sn
                s.expert_tensors.append(sn)
        s.expert_tensors.sort()
        if s.activation == "swigluoai":  # gpt-oss, linearized: gate/up de-interleaved; re-interleave
            s.interleaved = True
        if s.shared and ckpt.info(s.shared["gate_proj"]).dtype_str == "I8":
            si = s.shared["intermediate"]
            s.shared["scales"] = [
                _scale_name(ckpt, s.shared[p], n) for p, n in (("gate_proj", si), ("up_proj", si), ("down_proj", h))
            ]
            for sn in s.shared["scales"]:
                _read_scale(ckpt, sn)
        check_float_router(ckpt, s)
    return specs


def _read_scale(ckpt: Checkpoint, name: str) -> torch.Tensor:
    s = ckpt.read(name).float().reshape(-1)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise SourceError(f"tensor {name!r}[{i}] = {s[i].item()!r}: scales must be finite and > 0")
    return s


def _read_q(ckpt: Checkpoint, name: str) -> torch.Tensor:
    return ckpt.read(name)  # dtype I8 was checked from the header


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """rows 2j = gate_j, 2j+1 = up_j (swigluoai's canonical order)."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def read_expert_w13_q(ckpt: Checkpoint, s: LayerSpec, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s gate/up codes ``[2I, H]`` int8 and scales ``[2I]`` fp32 (canonical row order)."""
    g, u = _read_q(ckpt, s.names[(e, "gate", "weight")]), _read_q(ckpt, s.names[(e, "up", "weight")])
    gs, us = _read_scale(ckpt, s.names[(e, "gate", "scale")]), _read_scale(ckpt, s.names[(e, "up", "scale")])
    if s.interleaved:
        return _interleave(g, u), _interleave(gs, us)
    return torch.cat([g, u]), torch.cat([gs, us])


def read_expert_w2_q(ckpt: Checkpoint, s: LayerSpec, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s down codes ``[H, I]`` int8 and scales ``[H]`` fp32."""
    return _read_q(ckpt, s.names[(e, "down", "weight")]), _read_scale(ckpt, s.names[(e, "down", "scale")])


def _deq(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.reshape(-1, 1)


def read_expert_w13(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    return _deq(*read_expert_w13_q(ckpt, s, e))


def read_expert_w2(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    return _deq(*read_expert_w2_q(ckpt, s, e))


def read_biases(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    b13, b2 = dense_read_biases(ckpt, s)
    if b13 is not None and s.interleaved:
        i = s.intermediate
        b13 = _interleave(b13[:, :i].t(), b13[:, i:].t()).t().contiguous()
    return b13, b2


def read_expert_canonical(ckpt: Checkpoint, s: LayerSpec, weight: str, e: int) -> dict[str, torch.Tensor]:
    """Scheme int8_channel's canonical tensors of expert ``e``'s ``weight`` ("w13" or "w2"):
    {"w13_q": [2I, H] int8, "w13_scale": [2I] fp32} (or w2_q / w2_scale), as stored."""
    q, sc = (read_expert_w13_q if weight == "w13" else read_expert_w2_q)(ckpt, s, e)
    return {f"{weight}_q": q, f"{weight}_scale": sc}


def read_shared_canonical(ckpt: Checkpoint, s: LayerSpec) -> dict[str, torch.Tensor] | None:
    """The int8 shared expert's canonical tensors as a one-expert set (w13_q [1, 2Is, H], ...),
    or None (no shared expert, or a float one)."""
    q = read_shared_q(ckpt, s)
    if q is None:
        return None
    (q13, s13), (q2, s2) = q
    return {"w13_q": q13, "w13_scale": s13.float(), "w2_q": q2, "w2_scale": s2.float()}


def read_layer(ckpt: Checkpoint, s: LayerSpec) -> CanonicalLayer:
    q13, s13, q2, s2 = [], [], [], []
    for e in range(s.num_experts):
        q, sc = read_expert_w13_q(ckpt, s, e)
        q13.append(q)
        s13.append(sc)
        q, sc = read_expert_w2_q(ckpt, s, e)
        q2.append(q)
        s2.append(sc)
    w13_q, w13_scale, w2_q, w2_scale = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)
    b13, b2 = read_biases(ckpt, s)
    return CanonicalLayer(
        spec=s,
        w13=w13_q.float() * w13_scale.unsqueeze(-1),
        w2=w2_q.float() * w2_scale.unsqueeze(-1),
        w13_bias=b13,
        w2_bias=b2,
        canonical={"w13_q": w13_q, "w13_scale": w13_scale, "w2_q": w2_q, "w2_scale": w2_scale},
    )


def read_shared(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert as float (dequantized if int8), one-expert canonical pair."""
    q = read_shared_q(ckpt, s)
    if q is not None:
        (q13, s13), (q2, s2) = q
        return _deq(q13[0], s13[0])[None], _deq(q2[0], s2[0])[None]
    from .dense import read_shared as dense_read_shared

    return dense_read_shared(ckpt, s)


def read_shared_q(ckpt: Checkpoint, s: LayerSpec):
    """The int8 shared expert as ((w13_q [1, 2Is, H], scale [1, 2Is]), (w2_q [1, H, Is], scale
    [1, H])), or None (no shared expert, or a float one)."""
    if not s.shared or "scales" not in s.shared:
        return None
    gs, us, ds = (_read_scale(ckpt, n) for n in s.shared["scales"])
    g, u, d = (_read_q(ckpt, s.shared[p]) for p in ("gate_proj", "up_proj", "down_proj"))
    return (torch.cat([g, u])[None], torch.cat([gs, us])[None]), (d[None], ds[None])


__all__ = ["SCHEME", "detect", "layers", "read_layer", "read_expert_canonical", "read_shared_canonical"]


# --------------------------------------------------------------------------- carried Linears


def _linears(view, qc: dict) -> dict:
    """The int-quantized Linears: I8 ``weight`` + ``weight_scale`` [N, 1] (one scale per channel)."""
    out = {}
    for name, ti in view.tensors.items():
        if not name.endswith(".weight") or ti.dtype_str != "I8":
            continue
        p, s, n, k = weight_and_scale(view, name, ti)
        symmetric_scales(view, p, name, ti)
        sti = view.info(s)
        if tuple(sti.shape) not in ((n, 1), (n,)):
            raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: expected [{n}, 1] (one scale per output channel of {name!r})")
        out[p] = CarriedLinear(p, "int8", n, k, {"weight": name, "scale": s})
    return out


def symmetric_scales(view, p: str, name: str, ti) -> None:
    """A compressed-tensors int8 / FP8 Linear: symmetric, without act-order, float scales."""
    for extra in (".weight_zero_point", ".weight_g_idx"):
        if p + extra in view.tensors:
            raise SourceError(f"tensor {p + extra!r} is present: moepack reads symmetric {ti.dtype_str} weights without act-order")
    s = f"{p}.weight_scale"
    if view.info(s).dtype_str not in FLOAT_DTYPES:
        raise SourceError(f"tensor {s!r} has dtype {view.info(s).dtype_str}: scales must be BF16, F16 or F32")


def _values(view, lin, dequant: bool = True) -> torch.Tensor | None:
    s = check_scales(lin.tensors["scale"], view.read(lin.tensors["scale"]))
    return view.read(lin.tensors["weight"]).float() * s.reshape(-1, 1) if dequant else None


register_linears("int8", _values, LinearFinder(("compressed-tensors",), _linears, order=3, ct_formats=("int-quantized",)))
