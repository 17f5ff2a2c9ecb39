"""The fuzzer of packed directories' manifests and shard headers (tests/container/test_manifest_fuzz.py runs
a few hundred cases, tools/fuzz_manifest.py the long run; not a test module).

A case takes a good packed directory, bends it, opens it and runs it the way a user would
(``moepack.open``, every layer's block on fixed tokens with its own router, its experts on fixed
routes, its shared expert, ``inspect``'s rendering, the checksum-only ``verify``), and files the
outcome in one class:

* ``refused``: a ``MoepackError`` (what bad input must give);
* ``identical``: everything ran and every output is bit-for-bit the unbent directory's;
* ``other_model``: everything ran, outputs differ, and the manifest's *meaning* (``meaning``:
  everything in it that decides what the model computes, as the schema normalises it) differs
  too, e.g. ``activation`` "silu" -> "gelu" or ``top_k`` 2 -> 1: a well-formed manifest of
  another model, which only ``verify --source`` can tell from the real one (header cases: the
  checksums of ``verify`` fail instead, since ``open`` does not hash);
* ``crash``: any other exception (a bug: a traceback for the user);
* ``silent``: outputs differ although the meaning did not (a bug: something the schema does not
  check changed what the model computes);
* ``missed`` (targets that know their source): an ``other_model`` manifest case that
  ``verify --source`` passes (a bug: verify must tell another model from the source's), or an
  ``other_config`` one that it passes;
* ``other_config``: everything ran identically, but what else a run uses (``run_facts``: the
  stored model config that ``load_model`` / ``generate`` build the model from, the carried
  files and their checksums) differs, and ``verify`` (with the source, where the target has one)
  fails it, as it must (issue 29: these passed verify before).

Each case is reproducible from (seed, case number) alone.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import random
import shutil
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

import moepack
from moepack.errors import MoepackError

MANIFEST = "moepack.json"
CLASSES = ("refused", "identical", "other_model", "other_config", "crash", "silent", "missed")
TOKENS = 5

# Values a mutation drops in where another value was: every JSON type, edges of ranges.
POOL = [None, True, False, 0, 1, -1, 2, 3, 7, 8, 99, 2**31, 2**63, -(2**63), 10**30, 0.5, 1.0, -0.0, 1e308, 2.5, "", "x",
        "1", "2", "silu", "gelu", "relu9", "a8", "a16", "bfloat16", "float32", "softmax", "sigmoid", "moepack", [], [0],
        [1, 2], [-1], ["x"], {}, {"a": 1}, {"size": 0}]  # fmt: skip


@dataclass
class Outcome:
    cls: str
    detail: str = ""


@dataclass
class Target:
    """A good packed directory and what it computes (the oracle of every case)."""

    path: Path
    text: str  # its moepack.json
    manifest: dict
    outputs: dict
    meaning: str
    shards: dict = field(default_factory=dict)  # file name -> bytes (for header cases)
    source: Path | None = None  # its source checkpoint: an ``other_model`` case must fail verify --source
    facts: str = ""  # run_facts of its manifest


def run_outputs(d: Path) -> dict:
    """Open ``d`` and compute everything a user would: per layer, the block on fixed tokens with
    its own router, the experts on fixed routes, the shared expert; ``inspect`` (rendered) and the
    checksum-only ``verify`` must run too. Raises what they raise."""
    model = moepack.open(d)
    out = {}
    g = torch.Generator().manual_seed(0)
    for idx, layer in sorted(model.layers.items()):
        x = torch.randn(TOKENS, layer.hidden_size, generator=g)
        k = min(2, layer.num_experts)
        ids = torch.stack([torch.randperm(layer.num_experts, generator=g)[:k] for _ in range(TOKENS)]).to(torch.int32)
        w = torch.rand(TOKENS, k, generator=g)
        out[f"{idx}.experts"] = layer.experts(x, w, ids)
        sh = layer.shared_expert(x)
        if sh is not None:
            out[f"{idx}.shared"] = sh
        try:
            out[f"{idx}.block"] = layer(x)
        except MoepackError as e:  # e.g. no router weight or no routing: part of what the directory is
            out[f"{idx}.block"] = type(e).__name__
    _inspect(d)
    report = moepack.verify(d)
    out["verify_ok"] = report.ok
    return out


def _inspect(d: Path) -> None:
    """``moepack inspect d`` in-process, rich table rendered (its errors reach the caller)."""
    from moepack.cli import packdir

    with contextlib.redirect_stdout(io.StringIO()):
        packdir.inspect.__wrapped__(d, as_json=False)


def _same(a: dict, b: dict) -> bool:
    """Equal keys, and every value equal: tensors bit for bit (dtype and shape too)."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor):
            if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(_bits(v), _bits(w)):
                return False
        elif isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor) or v != w:
            return False
    return True


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def meaning(m: dict) -> str:
    """Everything in a (schema-checked) manifest that decides what the model computes, normalised
    as the runtime reads it (defaults filled in, truthiness of optional names resolved)."""
    from moepack.layout import layout_get
    from moepack.routing import RoutingConfig

    routing = RoutingConfig.from_dict(m["routing"]).to_dict() if m.get("routing") is not None else None
    layers = []
    for e in m["layers"]:
        lay = layout_get(e["layout_id"])
        roles = [*lay.tensor_names("w13"), *lay.tensor_names("w2"), "w13_bias", "w2_bias", "w13_perm"]
        router = e.get("router") or {}
        sh = e.get("shared") or None
        layers.append({
            "index": e["index"], "E": e["num_experts"], "H": e["hidden"], "I": e["intermediate"],
            "Ip": e["padded_intermediate"], "activation": e["activation"], "alpha": float(e.get("alpha", 1.702)),
            "limit": float(e.get("limit", 7.0)), "interleaved": e["interleaved"], "layout": lay.id,
            "act_mode": e.get("act_mode") if e.get("act_mode") in lay.act_modes else lay.act_modes[0],
            "tensors": {r: e["tensors"][r] for r in roles if r in e["tensors"]},
            "router": {k: router.get(k) or None for k in ("weight", "bias", "correction_bias")},
            "shared": None if not sh else {"I": sh["intermediate"], "Ip": sh["padded_intermediate"], "gate": sh.get("gate") or None,
                                           "tensors": {r: sh[r] for r in roles if r in sh},
                                           "silu_limit": sh["silu_limit"] if "silu_limit" in sh else e.get("silu_limit")},
            "silu_limit": e.get("silu_limit"), "post_norm": e.get("post_norm") or None,
        })  # fmt: skip
    return json.dumps({"routing": routing, "layers": layers}, sort_keys=True)


def run_facts(m: dict) -> str:
    """What a run uses beyond the layers' meaning (issue 29): the stored model config (load_model
    and generate build the model from it) and the fields derived from it, the carried files.
    ``verify --source`` proves each against the source."""
    model = m.get("model") if isinstance(m.get("model"), dict) else {}
    return json.dumps({"config": model.get("config"), "model_type": model.get("model_type"),
                       "hidden_size": model.get("hidden_size"), "carried": sorted(m.get("carried_files") or [])},
                      sort_keys=True)  # fmt: skip (carried_sha256 is how verify proves the files, not what a run reads)


def make_target(path: Path, source: Path | None = None) -> Target:
    text = (path / MANIFEST).read_text()
    m = json.loads(text)
    shards = {f: (path / f).read_bytes() for f in m["files"]}
    out = run_outputs(path)
    assert out.pop("verify_ok") is True, f"{path} does not verify"
    return Target(path, text, m, out, meaning(m), shards, source, run_facts(m))


# ---------------------------------------------------------------------------------------------
# mutations of the manifest


def _nodes(obj, path=()):
    """Every (path, value) of a JSON tree, the root excluded."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return
    for k, v in items:
        yield path + (k,), v
        yield from _nodes(v, path + (k,))


def _parent(root, path):
    obj = root
    for k in path[:-1]:
        obj = obj[k]
    return obj


def _pick_path(rng: random.Random, m: dict) -> tuple:
    """A random node: first a top-level field (each alike, so the long ``tensors`` table does not
    drown ``routing``), then a node inside it at any depth. ``model.config`` (a copy of config.json:
    load_model builds the model from it) is visited in half the picks of ``model``."""
    key = rng.choice(list(m))
    nodes = [(key,)] + [(key,) + p for p, _ in _nodes(m[key])]
    if key == "model" and rng.random() > 0.5:  # (verify proves model.config since issue 29: visited half the time)
        nodes = [p for p in nodes if p[:2] != ("model", "config")] or nodes
    if key == "tensors" and len(nodes) > 1 and rng.random() < 0.5:  # the layers' own tensors more often
        nodes = [p for p in nodes if len(p) > 1 and p[1].startswith("moepack.")] or nodes
    return rng.choice(nodes)


def _new_value(rng: random.Random, m: dict, old):
    r = rng.random()
    if r < 0.35:
        return copy.deepcopy(rng.choice(POOL))
    if r < 0.6 and isinstance(old, (int, float)) and not isinstance(old, bool):
        return rng.choice([old + 1, old - 1, old * 2, -old, 0, old + 0.5, str(old), float(old), int(old) if old == old else 0])
    if r < 0.7 and isinstance(old, str):
        return rng.choice([old + "x", old[:-1], old.upper(), int(old) if old.isdigit() else old + "1", [old], {"v": old}])
    if r < 0.75 and isinstance(old, bool):
        return rng.choice([not old, int(old), str(old).lower(), [], None])
    # another value of the manifest (swap in what another field holds)
    _, v = rng.choice(list(_nodes(m)))
    return copy.deepcopy(v)


def mutate_manifest(rng: random.Random, m: dict) -> list[str]:
    """Apply 1 to 3 random edits to ``m`` in place; returns their descriptions."""
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        path = _pick_path(rng, m)
        parent, key = _parent(m, path), path[-1]
        op = rng.random()
        if op < 0.2:  # delete
            del parent[key]
            done.append(f"del {list(path)}")
        elif op < 0.3 and isinstance(parent, dict):  # rename the key
            v = parent.pop(key)
            parent[key + rng.choice(["x", "_", "s"]) if isinstance(key, str) else key] = v
            done.append(f"rename {list(path)}")
        elif op < 0.4 and isinstance(parent, list):  # duplicate an entry
            parent.insert(key, copy.deepcopy(parent[key]))
            done.append(f"dup {list(path)}")
        elif op < 0.5:  # swap with another field's value
            other = _pick_path(rng, m)
            try:
                op_, ok = _parent(m, other), other[-1]
                parent[key], op_[ok] = op_[ok], parent[key]
            except (KeyError, IndexError, TypeError):
                continue  # one was inside the other
            done.append(f"swap {list(path)} {list(other)}")
        elif op < 0.55 and isinstance(parent[key], dict):  # an unknown key
            parent[key]["zz_unknown"] = rng.choice(POOL)
            done.append(f"add {list(path)}.zz_unknown")
        else:
            parent[key] = _new_value(rng, m, parent[key])
            done.append(f"set {list(path)}={parent[key]!r:.40}")
    return done


# ---------------------------------------------------------------------------------------------
# mutations of a shard header


def mutate_shard(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A bent copy of a shard: its JSON header edited (an entry's dtype, shape, offsets, the
    metadata), or raw bytes of the header flipped, or the length prefix or the file cut."""
    (n,) = struct.unpack("<Q", data[:8])
    r = rng.random()
    if r < 0.15:  # raw bytes of the header
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(8, 8 + n)] = rng.randrange(256)
        return bytes(b), "flip header bytes"
    if r < 0.22:
        return struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, n + 64, 2**63, len(data)])) + data[8:], "length prefix"
    if r < 0.27:
        return data[: rng.randrange(0, len(data))], "truncated"
    hdr = json.loads(data[8 : 8 + n])
    names = [k for k in hdr if k != "__metadata__"]
    name = rng.choice(names + ["__metadata__"])
    entry = hdr[name]
    what = rng.random()
    if name == "__metadata__":
        key = rng.choice(list(entry) + ["extra"])
        entry[key] = rng.choice(["1", "64", "moepack", "", 1, None, ["x"]])
        desc = f"metadata {key}"
    elif what < 0.25:
        entry["dtype"] = rng.choice(["BF16", "F16", "F32", "I8", "U8", "I32", "F4", "C64", "bf16", 7])
        desc = f"{name} dtype"
    elif what < 0.5:
        s = list(entry["shape"])
        choice = rng.random()
        if s and choice < 0.5:
            i = rng.randrange(len(s))
            s[i] = rng.choice([0, 1, s[i] + 1, s[i] - 1, s[i] * 2, -1, 2**62, "8"])
        elif choice < 0.75:
            s = s[::-1]
        else:
            s = s + [1]
        entry["shape"] = s
        desc = f"{name} shape"
    elif what < 0.8:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[a, b + 64], [a + 64, b + 64], [a - 64, b], [b, a], [a, a], [0, b - a], [a, "x"], [a]])
        desc = f"{name} offsets"
    elif what < 0.9 and len(names) > 1:  # swap two entries' offsets
        other = hdr[rng.choice(names)]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        desc = f"{name} swap offsets"
    else:
        hdr[name + rng.choice(["x", ""])] = hdr.pop(name)
        desc = f"{name} renamed"
    js = json.dumps(hdr, separators=(",", ":")).encode()
    pad = n if len(js) <= n else -(-(8 + len(js)) // 64) * 64 - 8
    return struct.pack("<Q", pad) + js + b" " * (pad - len(js)) + data[8 + n :], desc


# ---------------------------------------------------------------------------------------------
# one case


def _facts_diff(a: str, b: str) -> list[str]:
    x, y = json.loads(a), json.loads(b)
    return [k for k in x if x[k] != y.get(k)]


def _classify(t: Target, d: Path, new_meaning, new_facts=None) -> Outcome:
    try:
        out = run_outputs(d)
    except MoepackError as e:
        return Outcome("refused", str(e).splitlines()[0][-160:])
    except Exception as e:  # noqa: BLE001 - this is what the fuzzer looks for
        return Outcome("crash", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    verify_ok = out.pop("verify_ok")
    if _same(out, t.outputs):
        facts = new_facts() if new_facts is not None else None
        if facts is None or facts == t.facts:
            return Outcome("identical")  # (a changed sha256 only makes verify fail: what it is for)
        if verify_ok and t.source is not None:  # the experts compute the same, the model around them differs
            try:
                caught = not moepack.verify(d, source=t.source).ok
            except MoepackError:
                caught = True
            if not caught:
                return Outcome("missed", "the model config or the carried files differ, and verify --source passes it")
        elif verify_ok:
            return Outcome("identical")  # no source to judge the model config by
        return Outcome("other_config", ", ".join(_facts_diff(facts, t.facts)))
    m = new_meaning()
    if m is not None and m != t.meaning:
        if t.source is not None:  # another model: verify --source must say so
            try:
                caught = not moepack.verify(d, source=t.source).ok
            except MoepackError:
                caught = True
            if not caught:
                return Outcome("missed", "another model, and verify --source passes it")
        return Outcome("other_model")
    if m is None and verify_ok is False:  # header case: different bytes read, verify says so
        return Outcome("other_model", "checksums differ")
    return Outcome("silent", "outputs differ, meaning equal")


def _canon(m) -> str:
    return json.dumps(m, sort_keys=True)


def case_dir(t: Target, work: Path) -> Path:
    """A scratch copy of the target (shards symlinked for manifest cases)."""
    d = work / "case"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    for f in t.path.iterdir():
        if f.name != MANIFEST:
            (d / f.name).symlink_to(f.resolve())
    return d


def run_manifest_case(t: Target, work: Path, seed: int, i: int) -> tuple[Outcome, list[str]]:
    """One bent manifest. Nine cases in ten model an editor who also recomputes the seal
    (``manifest_sha256``, format version 6; unless an edit took the seal itself), so that the
    schema's rules are what refuses them; the tenth leaves the seal as it was, and then any edit
    that changes the manifest must be refused (an unsealed edit that opens is ``missed``)."""
    from moepack.manifest import manifest_digest

    rng = random.Random(seed * 1_000_003 + i)
    m = json.loads(t.text)
    edits = mutate_manifest(rng, m)
    reseal = rng.random() >= 0.1
    if reseal and "manifest_sha256" in m and not any("'manifest_sha256'" in x for x in edits):
        try:
            m["manifest_sha256"] = manifest_digest(m)
        except (TypeError, ValueError):  # an edit JSON cannot hold (a NaN): left unsealed
            reseal = False
    d = case_dir(t, work)
    (d / MANIFEST).write_text(json.dumps(m))
    if not reseal and _canon(m) != _canon(json.loads(t.text)):
        o = _classify(t, d, lambda: None)
        if o.cls not in ("refused", "crash"):
            o = Outcome("missed", f"an edit left unsealed was not refused ({o.cls})")
        return o, edits + ["(unsealed)"]

    def new_meaning():
        try:
            return meaning(m)
        except Exception:  # noqa: BLE001 - it ran, so the schema passed; meaning() reads like the runtime
            return "unreadable"

    def new_facts():
        try:
            return run_facts(m)
        except Exception:  # noqa: BLE001
            return "unreadable"

    return _classify(t, d, new_meaning, new_facts), edits


def run_header_case(t: Target, work: Path, seed: int, i: int) -> tuple[Outcome, list[str]]:
    rng = random.Random(seed * 1_000_003 + i + 7)
    fname = rng.choice(sorted(t.shards))
    data, desc = mutate_shard(rng, t.shards[fname])
    d = case_dir(t, work)
    (d / fname).unlink()
    (d / fname).write_bytes(data)
    m = json.loads(t.text)
    m["files"][fname]["size"] = len(data)  # so that the header itself is what open judges
    from moepack.manifest import manifest_digest

    m["manifest_sha256"] = manifest_digest(m)  # (the seal too)
    (d / MANIFEST).write_text(json.dumps(m))
    return _classify(t, d, lambda: None), [f"{fname}: {desc}"]


def fuzz(targets: list[Target], work: Path, cases: int, seed: int, kind: str = "both", log=None, *, job: int = 0,
         jobs: int = 1, progress=None) -> dict:  # fmt: skip
    """Run cases ``job, job + jobs, ...`` below ``cases`` over ``targets`` (round robin: a case's
    target and edits depend only on its number and the seed, so the counts do not depend on
    ``jobs``); returns {"counts": Counter by (kind, class), "bugs": [(kind, target, case, edits,
    detail)]}. ``progress(done, counts, bugs)``: called after every case."""
    counts, bugs = Counter(), []
    for i in range(job, cases, jobs):
        t = targets[i % len(targets)]
        k = kind if kind != "both" else ("manifest" if i % 4 else "header")
        o, edits = (run_manifest_case if k == "manifest" else run_header_case)(t, work, seed, i)
        counts[(k, o.cls)] += 1
        if o.cls in ("crash", "silent", "missed"):
            bugs.append((k, t.path.name, i, edits, o.detail))
            if log:
                log(f"{o.cls}: {k} case {i} on {t.path.name}: {edits}: {o.detail}")
        if progress:
            progress(sum(counts.values()), counts, bugs)
    return {"counts": counts, "bugs": bugs}
