"""The schema of ``moepack.json``, checked once before anything reads the manifest.

docs/PACKED_FORMAT.md §4 describes every field; this module is the same description as code.
``check_manifest(path, m)`` walks the whole manifest (every version still readable: 1 to 7)
and refuses the first field that breaks a rule with ONE ``ManifestError`` line that names the
file, the field's path, its value and the rule::

    /models/q3: moepack.json: layers[0].routing ... top_k=99: must be an integer in 1..8 (num_experts)

After it passes, the runtime (``moepack.open``), ``inspect``, ``run`` and ``verify`` index the
manifest without guarding: every key they read is there with the type and range stated here, so
a hand-edited or hostile manifest can only be refused, never crash them (tests/container/test_manifest.py
fuzzes that). Rules, beyond each field's type:

* known values: ``format`` "moepack", ``format_version`` an integer this build reads, layout
  ids of this build whose stored descriptor equals this build's, activations, act modes, routing
  methods, dtype names;
* ranges: sizes >= 1, ``routing.top_k`` in 1..num_experts, finite positive scaling factors;
* cross-field: layer indices strictly ascending (so unique) and below the model's
  ``num_hidden_layers`` (when config.json states it), prefixes unique, every tensor a layer names
  listed in ``tensors`` with the dtype and shape of the layout math (``layout_tensor_plan``),
  ``padded_intermediate`` equal to it, ``routing.num_experts`` equal to every layer's, a
  correction bias exactly where the routing has one, router and gate tensors of the shapes the
  layer multiplies them with, every tensor's file listed in ``files``, file names plain names of
  the directory (never a path out of it), ``w13_perm`` only in version 3 and int4_group layers,
  a shared expert's own ``layout_id`` (of the layer's family) only in version 5 and later, a layer's
  ``silu_limit`` (silu layers) and ``router.hash`` (an integer [vocab, k] table) only in version 6;
  ``post_norm``, ``identity_experts``, ``out_bias`` and the activation relu2 only in version 7, with
  ``routing.num_experts`` = a layer's ``num_experts`` + its ``identity_experts``;
* the seal (version 6): ``manifest_sha256`` equal to ``manifest_digest`` of the other fields,
  checked last, so that a field edited to a value the rules above accept is still refused.

Keys the schema does not know are ignored (§7), except inside ``routing``, which is a
``RoutingConfig`` exactly (a routing key this moepack does not know would change routing).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from .errors import MoepackError, PackedDirError

MANIFEST = "moepack.json"
# The manifest's format versions (docs/PACKED_FORMAT.md §7). 2: layouts in the manifest declare their
# tensors (scheme, act_modes, tensors). Version 1 directories (before that) still open: their
# layouts are the same table entries, compared on the fields version 1 had.
# 3: version 2 plus the act-order permutation w13_perm of int4_group layers; written only by
# directories that have one (a version-2 reader would ignore the tensor and run such a layer
# wrongly); before version 6 every other directory was written as version 2.
PERM_FORMAT_VERSION = 3
# 4: version 3 plus tensor-parallel slices (``convert --tp N``): the top-level ``tp`` and each
# layer's ``tp``, whose tensors hold tp*E slice experts of intermediate I/tp (moepack/tp.py);
# written only by --tp packs (a version-3 reader would run the slices as E experts, wrongly).
TP_FORMAT_VERSION = 4
# 5: version 4 plus a shared expert in its own layout (``layers[].shared.layout_id``: a quantized
# checkpoint's float shared expert kept float, in the float layout beside the routed experts'
# codes); written only by directories that have one (a version-4 reader would read its tensors in
# the layer's layout).
SHARED_LAYOUT_FORMAT_VERSION = 5
# 6: every manifest is sealed: ``manifest_sha256``, the sha256 of all its other fields
# (``manifest_digest``), and ``act_mode_option`` and ``carried_sha256`` always present, so that a
# field edited after convert (a layer's ``act_mode`` together with ``act_mode_option``, an
# activation, a routing field) is refused by open and verify instead of read. Version 6 also
# brings two DeepSeek-V4 features: a layer's ``silu_limit`` (a clamped SwiGLU on silu experts,
# routed and shared) and its ``router.hash`` (a token id -> expert ids table); a version 1-5
# manifest with either is refused (its reader would run the layer unclamped, or route by
# logits). convert writes version 6 for every directory but version 7's (its perm, tp and shared-layout features
# included); versions 1-5 still open without a seal (verify says so in its notes).
SEALED_FORMAT_VERSION = 6
FORMAT_VERSION = SEALED_FORMAT_VERSION  # what convert writes
# 7: version 6 plus a shared expert on a layer whose activation is not silu (MiniMax-M3's swigluoai
# shared expert): it runs the layer's activation (alpha, limit), gate rows then up rows; and a layer's
# ``post_norm`` (A.X-K1: an RMSNorm of the block's output, {"weight": a carried tensor, "eps"}); a layer's
# ``identity_experts`` Z (LongCat-Flash: router ids E .. E+Z-1 return the token times its weight); a layer's
# ``out_bias`` (JetMoE: a carried [H] bias added to the block output); the non-gated activation "relu2"
# (Nemotron-H: w13 of up rows alone). Written only by directories that have one: a version-6 reader ran
# every shared expert as silu and would ignore post_norm, identity experts and out_bias, so it must refuse
# such a file rather than read it.
BLOCK_PARTS_FORMAT_VERSION = 7
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
SILU_LIMIT_FORMAT_VERSION = SEALED_FORMAT_VERSION  # the first version with silu_limit / router.hash
INT_DTYPES = ("int64", "int32")

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")


def gated(activation: str) -> bool:
    """Whether a layer of this activation has gate rows in w13 (relu2's non-gated experts hold up rows only)."""
    return activation != "relu2"


SOURCE_KINDS = ("per_expert", "fused_out", "fused_in", "granite", "dbrx")
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_VALUE_CHARS = 60  # a value in a message is cut to this many characters (one line, readable)


class ManifestError(PackedDirError):
    """A field of moepack.json breaks the schema (docs/PACKED_FORMAT.md §4): the message names
    the file, the field's path, its value and the rule."""


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= _VALUE_CHARS else r[: _VALUE_CHARS - 5] + "…" + r[-4:]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


FLOAT32_MAX = 3.4028234663852886e38


def swiglu_param_problem(key: str, v: Any) -> str | None:
    """The one rule for swigluoai's ``alpha`` and ``limit``: a manifest layer's fields (open)
    and config.json's ``swiglu_alpha`` / ``swiglu_limit`` (convert, before it writes anything),
    so convert cannot write a pack that open refuses. None when ``v`` keeps it, else the rule:
    a finite number that float32 holds (the kernels and the reference compute in float32; a
    larger one becomes Inf there), and ``limit`` > 0 (swigluoai clamps the gate at it)."""
    if not _is_num(v) or abs(v) > FLOAT32_MAX:
        return "must be a finite number float32 holds (|v| <= 3.4028235e+38): the kernels compute in float32"
    if key == "limit" and not v > 0:
        return "must be > 0 (swigluoai clamps the gate at limit)"
    return None


def _type_word(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)  # fmt: skip


_MISSING = object()


class _Check:
    """One manifest being checked: ``fail`` raises the one-line error for a field."""

    def __init__(self, path: Path):
        self.path = path
        self.ctx = ""  # " (layer 3)" while a layer is checked: the field path counts entries, people count layers

    def fail(self, field: str, value: Any, rule: str):
        if value is _MISSING:
            raise ManifestError(f"{self.path}: {MANIFEST}: {field} is missing{self.ctx}: {rule}")
        raise ManifestError(f"{self.path}: {MANIFEST}: {field}={_short(value)}{self.ctx}: {rule}")

    def obj(self, parent: dict, key: str, field: str, *, required: bool = True, null: bool = False) -> Any:
        v = parent.get(key, _MISSING)
        if v is _MISSING:
            if required:
                self.fail(field, v, "must be an object" + (" or null" if null else ""))
            return None
        if v is None and null:
            return None
        if not isinstance(v, dict):
            self.fail(field, v, f"must be an object{' or null' if null else ''}, not {_type_word(v)}")
        return v

    def val(self, parent: dict, key: str, field: str, kind: str, *, required: bool = True, null: bool = False,
            choices: tuple | None = None, lo: float | None = None, hi: float | None = None, why: str = "") -> Any:  # fmt: skip
        """``parent[key]`` of ``kind`` ("int", "num", "bool", "str", "strs", "ints"); with
        ``choices`` one of them, with ``lo``/``hi`` inside the range."""
        v = parent.get(key, _MISSING)
        words = {"int": "an integer", "num": "a finite number", "bool": "a boolean (true or false)", "str": "a string",
                 "strs": "an array of strings", "ints": "an array of integers >= 0"}[kind]  # fmt: skip
        if v is _MISSING:
            if required:
                self.fail(field, v, f"must be {words}{' or null' if null else ''}{why}")
            return None
        if v is None and null:
            return None
        ok = {
            "int": _is_int(v),
            "num": _is_num(v),
            "bool": isinstance(v, bool),
            "str": isinstance(v, str),
            "strs": isinstance(v, list) and all(isinstance(x, str) for x in v),
            "ints": isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
        }[kind]
        if not ok:
            self.fail(field, v, f"must be {words}{' or null' if null else ''}{why}")
        if choices is not None and v not in choices:
            self.fail(field, v, f"must be one of {', '.join(map(repr, choices))}{why}")
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f"in {lo}..{hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
            self.fail(field, v, f"must be {rng}{why}")
        return v


def check_manifest(path: str | os.PathLike, m: Any) -> None:
    """Check the manifest ``m`` (parsed moepack.json of the directory ``path``) against the
    schema above and this build's layout table; raise ``ManifestError`` on the first
    field that breaks a rule."""
    from .layout import LAYOUTS, V1_FIELDS

    c = _Check(Path(path))
    if not isinstance(m, dict):
        c.fail("the top level", m, "must be a JSON object")
    fmt = m.get("format", _MISSING)
    if fmt != "moepack" or not isinstance(fmt, str):
        raise ManifestError(f"{c.path}: {MANIFEST}: format={None if fmt is _MISSING else fmt!r}, expected 'moepack'")
    version = m.get("format_version", _MISSING)
    if not _is_int(version) or version not in READABLE_VERSIONS:
        typed = "" if _is_int(version) else " (missing)" if version is _MISSING else f" ({_type_word(version)}: the version is a JSON integer)"
        raise ManifestError(
            f"{c.path}: {MANIFEST}: format_version={None if version is _MISSING else version!r}{typed}; this moepack reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}: convert the checkpoint again with this moepack "
            "(`moepack convert SRC DST --overwrite`) or open it with the release that wrote it"
        )
    for key in ("created_by", "created_at", "routing_note"):
        c.val(m, key, key, "str", required=False, null=True)
    sealed = version >= SEALED_FORMAT_VERSION  # every key below convert writes is then required, and the seal
    carried = c.val(m, "carried_files", "carried_files", "strs", required=sealed) or []
    for pos, name in enumerate(carried):
        if name in carried[:pos]:
            c.fail(f"carried_files[{pos}]", name, "is listed twice: every carried file once")
        if not _plain_name(name):
            c.fail("carried_files", name, "every entry must be the plain name of a file in the directory (no folder, not "
                                          "hidden, not moepack.json)")  # fmt: skip
    sums = c.obj(m, "carried_sha256", "carried_sha256", required=sealed)
    if sums is not None:
        if set(sums) != set(carried):
            extra = sorted(set(sums) ^ set(carried))[0]
            c.fail("carried_sha256", extra, "must hold one sha256 for each name of carried_files, and no other")
        for name, sha in sums.items():
            if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
                c.fail(f"carried_sha256[{name!r}]", sha, "must be 64 lowercase hex digits")
    seal = c.val(m, "manifest_sha256", "manifest_sha256", "str", required=sealed,
                 why=f" (the sha256 of every other field; format_version {SEALED_FORMAT_VERSION} on)")
    if seal is not None and not _SHA256.fullmatch(seal):
        c.fail("manifest_sha256", seal, "must be 64 lowercase hex digits (docs/PACKED_FORMAT.md §3)")
    c.val(m, "act_mode_option", "act_mode_option", "str", required=sealed, null=True, choices=("a16", "a8"),
          why=" (the --act-mode convert was given; null: each layer's own meaning)")
    source = c.obj(m, "source", "source")
    for key in ("path", "reader", "fingerprint"):
        c.val(source, key, f"source.{key}", "str", required=False, null=True)
    c.val(source, "files", "source.files", "strs", required=False)
    model = c.obj(m, "model", "model")
    c.val(model, "model_type", "model.model_type", "str", required=False, null=True)
    c.val(model, "hidden_size", "model.hidden_size", "int", required=False, null=True)
    config = c.obj(model, "config", "model.config", required=False)
    for key, typ in (("layers", list), ("tensors", dict), ("files", dict), ("layouts", dict)):
        if not isinstance(m.get(key), typ):
            c.fail(key, m.get(key, _MISSING), f"must be {_type_word(typ())}")

    # layouts: this build's, field for field (the tensors' notes are words, not format)
    known = {str(x.id): x for x in LAYOUTS}
    for lid, desc in m["layouts"].items():
        if lid not in known:
            raise ManifestError(f"{c.path}: {MANIFEST}: layouts: layout id {lid} is unknown to this build "
                                f"(known: {sorted(known)})")  # fmt: skip
        if not isinstance(desc, dict):
            c.fail(f"layouts[{lid!r}]", desc, "must be an object (the layout descriptor)")
        ours = _identity(known[lid].to_dict())
        theirs = _identity(desc)
        for k in V1_FIELDS if version == 1 else tuple(ours):
            if k in IMPLIED_LAYOUT_FIELDS and k not in theirs:
                continue  # written before the field existed: the layout id implies its value
            if theirs.get(k) != ours[k] or type(theirs.get(k)) is not type(ours[k]):
                raise ManifestError(f"{c.path}: {MANIFEST}: layout {ours['name']} (id {lid}) in the file has "
                                    f"{k}={_short(theirs.get(k))}, this build has {k}={ours[k]!r}")  # fmt: skip

    # files: plain names of the directory's own shards
    for fname, meta in m["files"].items():
        f = f"files[{fname!r}]"
        if not (fname.endswith(".safetensors") and fname == os.path.basename(fname) and not fname.startswith(".")
                and "\\" not in fname and "\0" not in fname):  # fmt: skip
            c.fail("files", fname, "every key must be the plain file name of a shard in the directory (*.safetensors, "
                                   "no folder, not hidden)")  # fmt: skip
        if not isinstance(meta, dict):
            c.fail(f, meta, "must be an object {\"size\": <bytes>}")
        c.val(meta, "size", f"{f}.size", "int", lo=0)

    # tensors: where each is, what it is, its checksum
    dtypes = _torch_dtype_names()
    for name, e in m["tensors"].items():
        f = f"tensors[{name!r}]"
        if not isinstance(e, dict):
            c.fail(f, e, "must be an object {file, dtype, shape, sha256}")
        fname = c.val(e, "file", f"{f}.file", "str")
        if fname not in m["files"]:
            raise ManifestError(f"{c.path}: {MANIFEST}: tensor {name!r} names file {fname!r}, not listed in 'files'")
        c.val(e, "dtype", f"{f}.dtype", "str", choices=dtypes)
        c.val(e, "shape", f"{f}.shape", "ints")
        sha = c.val(e, "sha256", f"{f}.sha256", "str")
        if not _SHA256.fullmatch(sha):
            c.fail(f"{f}.sha256", sha, "must be 64 lowercase hex digits (docs/PACKED_FORMAT.md §3)")

    top_tp = c.val(m, "tp", "tp", "int", required=False, lo=1, why=" (the tensor-parallel degree of a --tp pack)")
    if top_tp is not None and top_tp > 1 and version < TP_FORMAT_VERSION:
        c.fail("tp", top_tp, f"needs format_version {TP_FORMAT_VERSION} (the file says {version})")
    routing = _check_routing(c, m)
    n_layers = None
    if config is not None:
        from .sources import text_config

        n_layers = text_config(config).get("num_hidden_layers")
        n_layers = n_layers if _is_int(n_layers) and n_layers > 0 else None
    prev, prefixes = None, {}
    for pos, entry in enumerate(m["layers"]):
        idx = _check_layer(c, m, pos, entry, version, routing, n_layers)
        c.ctx = ""
        if prev is not None and idx <= prev:
            rule = f"duplicates layer {idx}" if idx == prev else f"comes after layer {prev}"
            c.fail(f"layers[{pos}].index", idx, f"{rule}: layer indices must be unique and ascending")
        prev = idx
        c.ctx = f" (layer {idx})"
        if entry["prefix"] in prefixes:
            c.fail(f"layers[{pos}].prefix", entry["prefix"], f"is also layer {prefixes[entry['prefix']]}'s: "
                                                             "every MoE layer has its own source prefix")  # fmt: skip
        prefixes[entry["prefix"]] = idx
        c.ctx = ""
    # last: every field above is well-formed, so an edit to a bad value is named by its own rule;
    # an edit to a good value (act_mode and act_mode_option, an activation) is named here
    if seal is not None and seal != manifest_digest(m):
        c.fail("manifest_sha256", seal, f"differs from the sha256 of the manifest's other fields ({manifest_digest(m)[:16]}…): "
                                        "a field was edited after convert (packs are never edited in place: convert the "
                                        "checkpoint again)")  # fmt: skip


def manifest_digest(m: dict) -> str:
    """The seal of a manifest (``manifest_sha256``, format version 6, docs/PACKED_FORMAT.md §3):
    the sha256 of the UTF-8 bytes of every field but the seal itself, as JSON with keys sorted and
    no whitespace (``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``), so
    it does not depend on how the file is indented or its keys ordered."""
    import hashlib

    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal_manifest(m: dict) -> dict:
    """``m`` with its ``manifest_sha256`` set to its digest (the writers call it last)."""
    m["manifest_sha256"] = manifest_digest(m)
    return m


def write_manifest(path: str | os.PathLike, m: dict, display: str | os.PathLike | None = None) -> None:
    """Seal ``m``, check it with the one schema ``moepack.open`` runs (``check_manifest``), and only
    then write it as ``path/moepack.json``: a writer (convert, --tp) cannot write a manifest that
    open refuses. ``path`` is the writer's temporary directory; an error names ``display`` (the
    directory's final name), else ``path``."""
    seal_manifest(m)
    check_manifest(display if display is not None else path, m)
    (Path(path) / MANIFEST).write_text(json.dumps(m, indent=1, sort_keys=False, allow_nan=False) + "\n")


# Layout fields added after a format version was released: a manifest written before a field
# existed lacks it, and the layout id fixes its value (code_order: the u4 layouts always had it).
IMPLIED_LAYOUT_FIELDS = ("code_order",)


def _plain_name(name: str) -> bool:
    """A file name of the directory itself: no folder, not hidden, not the manifest."""
    return bool(name) and name == os.path.basename(name) and not name.startswith(".") and "\\" not in name \
        and "\0" not in name and name != MANIFEST


def _identity(desc: dict) -> dict:
    """A layout descriptor without its words: the tensors' ``note`` strings document, they do not
    decide how bytes are read, so editing one never makes a directory unreadable."""
    out = dict(desc)
    if isinstance(out.get("tensors"), list):
        out["tensors"] = [{k: v for k, v in t.items() if k != "note"} if isinstance(t, dict) else t for t in out["tensors"]]
    return out


def _torch_dtype_names() -> tuple[str, ...]:
    from .container.reader import SAFETENSORS_TO_TORCH

    return tuple(sorted(str(d).replace("torch.", "") for d in SAFETENSORS_TO_TORCH.values()))


def _check_routing(c: _Check, m: dict):
    """``routing``: null, or a RoutingConfig's fields exactly, typed, and its own cross-field
    rules (RoutingConfig.__post_init__); returns the RoutingConfig or None."""
    from .errors import UnsupportedError
    from .routing import CONFIG_METHODS, RoutingConfig

    r = c.obj(m, "routing", "routing", null=True)
    if r is None:
        return None
    import dataclasses

    names = [f.name for f in dataclasses.fields(RoutingConfig)]
    for k in r:
        if k not in names:
            c.fail(f"routing.{k}", r[k], f"is not a routing field (fields: {', '.join(names)})")
    # every field that decides how tokens are routed is required (the writer writes them all,
    # RoutingConfig.to_dict): a default filled in for a deleted one would route differently
    c.val(r, "method", "routing.method", "str", choices=CONFIG_METHODS)
    c.val(r, "top_k", "routing.top_k", "int", lo=1)
    for k in ("renormalize", "has_correction_bias", "apply_router_weight_on_input"):
        c.val(r, k, f"routing.{k}", "bool")
    for k in ("num_expert_group", "topk_group"):
        c.val(r, k, f"routing.{k}", "int", lo=0)
    c.val(r, "scoring_func", "routing.scoring_func", "str", required=False)
    c.val(r, "routed_scaling_factor", "routing.routed_scaling_factor", "num")
    c.val(r, "sparsemixer_eps", "routing.sparsemixer_eps", "num")
    c.val(r, "num_experts", "routing.num_experts", "int", null=True, lo=1)
    c.val(r, "model_type", "routing.model_type", "str", required=False, null=True)
    try:
        return RoutingConfig.from_dict(r)
    except UnsupportedError as e:
        msg = str(e)  # "RoutingConfig <field>=<value> ...: <rule>": the field is routing's
        raise ManifestError(f"{c.path}: {MANIFEST}: " + ("routing." + msg[len("RoutingConfig "):] if msg.startswith("RoutingConfig ")
                                                         else f"routing: {msg}")) from None  # fmt: skip


def _check_layer(c: _Check, m: dict, pos: int, entry: Any, version: int, routing, n_layers: int | None) -> int:
    """One ``layers`` entry; returns its index."""
    from .layout import PERM_SCHEMES, layout_get, layout_padded_i, layout_tensor_plan

    f = f"layers[{pos}]"
    if not isinstance(entry, dict):
        c.fail(f, entry, "must be an object (one MoE layer)")
    idx = c.val(entry, "index", f"{f}.index", "int", lo=0)
    if n_layers is not None and idx >= n_layers:
        c.fail(f"{f}.index", idx, f"must be < {n_layers}, the model's num_hidden_layers (model.config)")
    at = f
    c.ctx = f" (layer {idx})"
    c.val(entry, "prefix", f"{at}.prefix", "str")
    if not entry["prefix"]:
        c.fail(f"{at}.prefix", "", "must name the source MoE block (e.g. 'model.layers.1.mlp')")
    c.val(entry, "source_kind", f"{at}.source_kind", "str", required=False, choices=SOURCE_KINDS)

    c.val(entry, "source_dtype", f"{at}.source_dtype", "str", required=False)
    e = c.val(entry, "num_experts", f"{at}.num_experts", "int", lo=1)
    h = c.val(entry, "hidden", f"{at}.hidden", "int", lo=1)
    i = c.val(entry, "intermediate", f"{at}.intermediate", "int", lo=1)
    c.val(entry, "padded_intermediate", f"{at}.padded_intermediate", "int", lo=1)
    c.val(entry, "activation", f"{at}.activation", "str", choices=ACTIVATIONS)
    for k in ("alpha", "limit"):  # convert applies the same rule to config.json before writing
        v = entry.get(k, _MISSING)
        rule = None if v is _MISSING else swiglu_param_problem(k, v)
        if rule:
            c.fail(f"{at}.{k}", v, rule)
    sl = entry.get("silu_limit", _MISSING)
    if sl is not _MISSING:
        if version < SILU_LIMIT_FORMAT_VERSION:
            c.fail(f"{at}.silu_limit", sl, f"needs format_version {SILU_LIMIT_FORMAT_VERSION} (the file says {version})")
        rule = silu_limit_problem(sl)
        if rule:
            c.fail(f"{at}.silu_limit", sl, rule)
        if entry["activation"] != "silu":
            c.fail(f"{at}.silu_limit", sl, f"is an option of silu experts only (this layer's activation is {entry['activation']!r})")
    c.val(entry, "interleaved", f"{at}.interleaved", "bool")
    is_gated = gated(entry["activation"])
    if not is_gated and version < BLOCK_PARTS_FORMAT_VERSION:
        c.fail(f"{at}.activation", entry["activation"], f"(non-gated experts) needs format_version {BLOCK_PARTS_FORMAT_VERSION} "
               f"(the file says {version})")  # fmt: skip
    if not is_gated and entry["interleaved"]:
        c.fail(f"{at}.interleaved", True, "non-gated (relu2) experts have no (gate, up) pairs to interleave")
    pn = c.obj(entry, "post_norm", f"{at}.post_norm", required=False, null=False)
    if pn is not None:
        if version < BLOCK_PARTS_FORMAT_VERSION:
            c.fail(f"{at}.post_norm", "a norm after the block", f"needs format_version {BLOCK_PARTS_FORMAT_VERSION} "
                   f"(the file says {version}): a version-6 reader would not apply it")  # fmt: skip
        eps = pn.get("eps", _MISSING)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            c.fail(f"{at}.post_norm.eps", None if eps is _MISSING else eps, "must be a finite number > 0")
    z = c.val(entry, "identity_experts", f"{at}.identity_experts", "int", required=False, lo=1) or 0
    if z and version < BLOCK_PARTS_FORMAT_VERSION:
        c.fail(f"{at}.identity_experts", z, f"needs format_version {BLOCK_PARTS_FORMAT_VERSION} (the file says {version}): a "
               "version-6 reader would refuse the router's identity-expert ids or run them as packed experts")  # fmt: skip
    lid = c.val(entry, "layout_id", f"{at}.layout_id", "int")
    if str(lid) not in m["layouts"]:
        raise ManifestError(f"{c.path}: {MANIFEST}: {at}.layout_id={lid!r} is not described in the manifest's "
                            f"'layouts' ({sorted(m['layouts'])}): every layer's layout must be")  # fmt: skip
    lay = layout_get(lid)
    c.val(entry, "act_mode", f"{at}.act_mode", "str", required=False, choices=lay.act_modes,
          why=f" (layout {lay.name} runs with {' or '.join(lay.act_modes)} activations)")  # fmt: skip
    c.val(entry, "scheme", f"{at}.scheme", "str", required=False, choices=(lay.scheme,), why=f" (the scheme of layout {lay.name})")
    c.val(entry, "scheme_source", f"{at}.scheme_source", "str", required=False, null=True)
    c.val(entry, "quantizer", f"{at}.quantizer", "str", required=False, null=True)
    c.val(entry, "source_tensors", f"{at}.source_tensors", "strs", required=False)
    names = c.obj(entry, "tensors", f"{at}.tensors")
    sh = c.obj(entry, "shared", f"{at}.shared", required=False, null=True)
    if routing is not None:
        k = routing.top_k
        # the router picks among the E packed experts and the layer's Z identity experts (ids E .. E+Z-1)
        if routing.num_experts is not None and routing.num_experts != e + z:
            c.fail(f"{at}.num_experts", e, f"must equal routing.num_experts={routing.num_experts}"
                   + (f" less the layer's identity_experts={z}" if z else ""))  # fmt: skip
        if k > e + z:
            c.fail("routing.top_k", k, f"must be in 1..{e + z} (layer {idx} has num_experts={e}"
                   + (f" and identity_experts={z})" if z else ")"))  # fmt: skip
    slay = lay  # the shared expert's layout: the layer's, or its own (version 5: a float one kept float)
    if sh and "layout_id" in sh:
        sid = c.val(sh, "layout_id", f"{at}.shared.layout_id", "int")
        if str(sid) not in m["layouts"]:
            c.fail(f"{at}.shared.layout_id", sid, f"is not described in the manifest's 'layouts' ({sorted(m['layouts'])}): "
                                                  "every layout a layer uses must be")  # fmt: skip
        slay = layout_get(sid)
        if slay.family != lay.family:
            c.fail(f"{at}.shared.layout_id", sid, f"layout {slay.name} is of the {slay.family} family, the layer's "
                                                  f"{lay.name} of {lay.family}: a layer's experts run on one family")  # fmt: skip
        if sid != lid and version < SHARED_LAYOUT_FORMAT_VERSION:
            c.fail(f"{at}.shared.layout_id", sid, f"a shared expert in a layout other than its layer's ({lay.name}) needs "
                                                  f"format_version {SHARED_LAYOUT_FORMAT_VERSION} (the file says {version})")  # fmt: skip
    if sh:
        c.val(sh, "quantizer", f"{at}.shared.quantizer", "str", required=False, null=True)
        if "silu_limit" in sh:  # version 7: the shared expert's own clamp (null: none; hy_v4 clamps routed experts only)
            ssl = sh["silu_limit"]
            if version < BLOCK_PARTS_FORMAT_VERSION:
                c.fail(f"{at}.shared.silu_limit", ssl, f"needs format_version {BLOCK_PARTS_FORMAT_VERSION} (the file "
                       f"says {version}): a version-6 reader would clamp the shared expert with the layer's silu_limit")  # fmt: skip
            rule = None if ssl is None else silu_limit_problem(ssl)
            if rule:
                c.fail(f"{at}.shared.silu_limit", ssl, rule)
            if entry["activation"] != "silu":
                c.fail(f"{at}.shared.silu_limit", ssl, f"is an option of silu experts only (this layer's activation is "
                       f"{entry['activation']!r})")  # fmt: skip
        if entry["activation"] != "silu" and version < BLOCK_PARTS_FORMAT_VERSION:
            c.fail(f"{at}.shared", "a shared expert", f"on a {entry['activation']} layer needs format_version "
                   f"{BLOCK_PARTS_FORMAT_VERSION} (the file says {version}): a version-6 reader runs it as silu")  # fmt: skip
    for what, group, glay in (("", names, lay), ("shared.", sh or {}, slay)):
        if "w13_perm" in group:
            if glay.scheme not in PERM_SCHEMES:
                c.fail(f"{at}.{what}w13_perm", group["w13_perm"], f"layout {glay.name} (scheme {glay.scheme}) carries no "
                                                                  f"act-order permutation: only {' / '.join(PERM_SCHEMES)} layouts do")  # fmt: skip
            if version < PERM_FORMAT_VERSION:
                c.fail(f"{at}.{what}w13_perm", group["w13_perm"], f"needs format_version {PERM_FORMAT_VERSION} "
                                                                  f"(the file says {version})")  # fmt: skip
    tp = c.val(entry, "tp", f"{at}.tp", "int", required=False, lo=1) or 1
    if tp != (m.get("tp") or 1):
        c.fail(f"{at}.tp", tp, f"must equal the top-level tp={m.get('tp') or 1}: every layer is sliced alike")
    if tp > 1:
        from .errors import LayoutError
        from .tp import tp_slice_size

        try:
            tp_slice_size(lay, i, tp)
        except LayoutError as ex:
            c.fail(f"{at}.tp", tp, str(ex))
    sets = [("", names, layout_tensor_plan(lay, e * tp, h, i // tp, bias=True, perm="w13_perm" in names, gated=is_gated),
             layout_padded_i(lay, i // tp), entry)]  # fmt: skip
    if sh:  # a one-expert set of the layer's layout, or of its own (shared.layout_id)
        si = c.val(sh, "intermediate", f"{at}.shared.intermediate", "int", lo=1)
        c.val(sh, "padded_intermediate", f"{at}.shared.padded_intermediate", "int", lo=1)
        c.val(sh, "source_tensors", f"{at}.shared.source_tensors", "strs", required=False)
        c.val(sh, "scheme_source", f"{at}.shared.scheme_source", "str", required=False, null=True)
        sets.append(("shared ", sh, layout_tensor_plan(slay, 1, h, si, perm="w13_perm" in sh, gated=is_gated), layout_padded_i(slay, si),
                     sh, slay))  # fmt: skip
    sets[0] = (*sets[0], lay)
    for what, group, plan, want_ip, holder, glay in sets:
        fg = f"{at}.{'shared' if what else 'tensors'}"
        for t in plan:
            if t.name not in group:
                if t.role == "bias":
                    continue
                raise ManifestError(f"{c.path}: {MANIFEST}: {fg}.{t.name} is missing: layer {idx}: {what}tensor role "
                                    f"{t.name!r} (layout {glay.name}) must name its tensor")  # fmt: skip
            tname = c.val(group, t.name, f"{fg}.{t.name}", "str")
            got = m["tensors"].get(tname)
            if got is None:
                c.fail(f"{fg}.{t.name}", tname, "names a tensor that 'tensors' does not list")
            if list(got["shape"]) != list(t.shape) or got["dtype"] != t.dtype:
                raise ManifestError(f"{c.path}: {MANIFEST}: {fg}.{t.name}: layer {idx}: {what}tensor {tname!r} is "
                                    f"{got['dtype']} {got['shape']}, layout math says {t.dtype} {list(t.shape)}")  # fmt: skip
        if holder["padded_intermediate"] != want_ip:
            c.fail(f"{at}.{what.strip() + '.' if what else ''}padded_intermediate", holder["padded_intermediate"],
                   f"layout math says {want_ip} (layout {glay.name})")  # fmt: skip
    router = c.obj(entry, "router", f"{at}.router", required=False, null=True) or {}
    refs = [("weight", [e + z, h]), ("bias", [e + z]), ("correction_bias", [e + z])]
    for key, shape in refs:
        cb = m["tensors"].get(router.get(key) or "") if key == "correction_bias" else None
        if cb is not None and list(cb["shape"]) == [1, e + z]:  # ernie4_5_moe stores it as [1, E] (carried as stored)
            shape = [1, e + z]
        _check_ref(c, m, router, key, f"{at}.router.{key}", shape, idx)
    if sh:
        _check_ref(c, m, sh, "gate", f"{at}.shared.gate", [1, h], idx)
    if "out_bias" in entry:  # version 7: a bias [H] the block adds to its output (JetMoE)
        if version < BLOCK_PARTS_FORMAT_VERSION:
            c.fail(f"{at}.out_bias", entry["out_bias"], f"needs format_version {BLOCK_PARTS_FORMAT_VERSION} (the file says "
                   f"{version}): a version-6 reader would not add it")  # fmt: skip
        if not isinstance(entry["out_bias"], str) or not entry["out_bias"]:
            c.fail(f"{at}.out_bias", entry["out_bias"], "must name the bias's carried tensor")
        _check_ref(c, m, entry, "out_bias", f"{at}.out_bias", [h], idx)
    if entry.get("post_norm"):
        _check_ref(c, m, entry["post_norm"], "weight", f"{at}.post_norm.weight", [h], idx)
        if not entry["post_norm"].get("weight"):
            c.fail(f"{at}.post_norm.weight", None, "must name the norm's carried weight")
    hashed = _check_hash(c, m, router, f"{at}.router.hash", routing, version)
    # a hash layer selects by token id: no correction bias (DeepseekV4HashRouter has none)
    if (routing is not None and routing.method != "custom"
            and bool(router.get("correction_bias")) != (routing.has_correction_bias and not hashed)):  # fmt: skip
        c.fail(f"{at}.router.correction_bias", router.get("correction_bias"),
               f"routing.has_correction_bias={routing.has_correction_bias}: a layer has a correction bias exactly when "
               "its routing uses one and it does not route by token id (router.hash)")  # fmt: skip
    return idx


def _check_ref(c: _Check, m: dict, holder: dict, key: str, field: str, shape: list, idx: int) -> None:
    """A name of a carried-over float tensor (router weight, bias, shared gate): null or absent,
    or a tensor of ``tensors`` of the shape the layer multiplies it with."""
    name = c.val(holder, key, field, "str", required=False, null=True)
    if not name:
        return
    got = m["tensors"].get(name)
    if got is None:
        c.fail(field, name, "names a tensor that 'tensors' does not list")
    if list(got["shape"]) != shape or got["dtype"] not in FLOAT_DTYPES:
        c.fail(field, name, f"is {got['dtype']} {got['shape']}, must be a float tensor of shape {shape}")


def silu_limit_problem(v: Any) -> str | None:
    """The rule of a silu layer's ``silu_limit`` (the manifest, open) and of the config value convert
    records there (``swiglu_limit``), so convert cannot write a pack that open refuses: a finite
    number > 0 that float32 holds. None when ``v`` keeps it."""
    if not _is_num(v) or abs(v) > FLOAT32_MAX or not v > 0:
        return "must be a finite number > 0 that float32 holds: the gate is clamped to <= it, the up to [-it, it]"
    return None


def _check_hash(c: _Check, m: dict, router: dict, field: str, routing, version: int) -> bool:
    """``router.hash``: null or absent, or an integer tensor [vocab, top_k] of expert ids (the
    layer routes token t to hash[t]; DeepSeek-V4's ``gate.tid2eid``), version 6. True when present."""
    name = c.val(router, "hash", field, "str", required=False, null=True)
    if not name:
        return False
    if version < SILU_LIMIT_FORMAT_VERSION:
        c.fail(field, name, f"needs format_version {SILU_LIMIT_FORMAT_VERSION} (the file says {version})")
    got = m["tensors"].get(name)
    if got is None:
        c.fail(field, name, "names a tensor that 'tensors' does not list")
    k = routing.top_k if routing is not None else None
    if len(got["shape"]) != 2 or got["dtype"] not in INT_DTYPES or (k is not None and got["shape"][1] != k):
        c.fail(field, name, f"is {got['dtype']} {got['shape']}, must be an int64 / int32 tensor [vocab, top_k={k}]")
    return True


def load_manifest(path: str | os.PathLike) -> dict:
    """Read, parse and check ``path/moepack.json``: the manifest, or a ``PackedDirError``."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise PackedDirError(f"{path}: no {MANIFEST} (not a packed directory; make one with `moepack convert`)")
    try:
        m = json.loads(mpath.read_bytes().decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, _Constant) as e:
        raise PackedDirError(f"{path}: {MANIFEST} is not valid JSON ({e})") from None
    check_manifest(path, m)
    return m


class _Constant(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """JSON objects with a key twice are refused: which one a reader takes is up to the reader."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Constant(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def _no_constant(name: str):
    raise _Constant(f"{name} is not JSON: numbers must be finite")


__all__ = ["MANIFEST", "FORMAT_VERSION", "PERM_FORMAT_VERSION", "TP_FORMAT_VERSION", "SHARED_LAYOUT_FORMAT_VERSION",
           "SEALED_FORMAT_VERSION", "SILU_LIMIT_FORMAT_VERSION", "BLOCK_PARTS_FORMAT_VERSION", "silu_limit_problem", "READABLE_VERSIONS", "ManifestError",
           "check_manifest", "load_manifest", "manifest_digest", "seal_manifest", "write_manifest", "MoepackError"]  # fmt: skip
