"""Whole transformers models on packed experts (moepack.patch, moepack.load_model; docs/COMPATIBILITY.md).

For every family of tests/fixtures and every scheme it has (dense as saved; int8 W8A8 by
``convert --quantize int8``; the compressed-tensors int8 / int4 fixtures), against an ORACLE: the
transformers model in fp32 carrying exactly the weights the pack means (the saved bf16 values;
bf16-rounded experts of an fp32 source; the dequantized int8 codes of moepack's own quantizer;
compressed-tensors' own decompression of a quantized fixture, with fp32 scales):

* logits of the patched model and of load_model (same dtype as the saved model): relative
  error to the oracle's <= the error of transformers' own run in that dtype + SEMANTICS.md §4's
  bound for the activations (fp32 1e-5, bf16/fp16 1e-2, A8 3e-2), and load_model == patch bit
  for bit (the same computation from the same memory map);
* 16 greedily generated tokens identical to the original model's (in the same dtype); a token
  that differs must be a near-tie (``_check_same_tokens``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import transformers

import moepack  # noqa: E402
import moepack.hf as hf  # noqa: E402
from moepack.errors import MoepackError, UnsupportedError  # noqa: E402
from moepack.schemes.int8 import dequantize_int8, quantize_int8_per_channel  # noqa: E402
from tests.support.fixtures_util import fixture_dir, fixture_info, fixture_names, load_hf_model, saved_dtype  # noqa: E402
from tests.support.packdir_edit import reseal  # noqa: E402

DENSE = [n for n in fixture_names() if n != "mixtral_sharded"]  # mixtral_sharded: mixtral's weights in 3 shards
QUANTIZED = ["qwen3_moe_w8a8", "qwen2_moe_w4a16", "qwen2_moe_w4a16_asym", "qwen3_moe_w4a16_channel"]
# SEMANTICS.md §4: fp32 pipeline, bf16/fp16 activations against fp32, A8 modes
ACT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
A8_TOL = 3e-2
PROMPT = [5, 77, 23, 101, 9, 64, 3, 120, 44, 17]
N_NEW = 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """(fixture, scheme) -> packed directory, converted once per module."""
    root = tmp_path_factory.mktemp("hf_packs")
    made = {}

    def get(name: str, scheme: str = "dense") -> Path:
        if (name, scheme) not in made:
            dst = root / f"{name}-{scheme}"
            moepack.convert(fixture_dir(name), dst, quantize="int8" if scheme == "int8" else None,
                            act_mode="a8" if scheme == "a8" else None)  # fmt: skip
            made[(name, scheme)] = dst
        return made[(name, scheme)]

    return get


# --------------------------------------------------------------------------- oracles


def _fake_int8(w: torch.Tensor, out_dim_last: bool) -> torch.Tensor:
    """moepack's int8 quantizer (per output channel, fp32) then dequantized, in w's own layout."""
    v = w.float().transpose(-1, -2) if out_dim_last else w.float()
    q, s = quantize_int8_per_channel(v)
    d = dequantize_int8(q, s)
    return d.transpose(-1, -2) if out_dim_last else d


def _set_expert_weights(model, fn) -> None:
    """Apply ``fn(weight, out_dim_last)`` to every routed and shared expert weight of the model."""
    fam = hf.FAMILIES[model.config.model_type]
    for block in hf._moe_blocks(model, fam).values():
        ex = block.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)
            p.data = fn(p.data, fam.in_major)
        sh = getattr(block, fam.shared, None) if fam.shared else None
        if sh is not None:
            for lin in (sh.gate_proj, sh.up_proj, sh.down_proj):
                lin.weight.data = fn(lin.weight.data, False)


def _ct_dequantized_state(name: str) -> dict[str, torch.Tensor]:
    """A compressed-tensors fixture's tensors with every quantized Linear decompressed by
    compressed-tensors itself (fp32 scales, so the dequantized values are exact), in the model's
    in-memory names (qwen2/qwen3: per-expert gate/up/down fused to gate_up_proj / down_proj)."""
    import compressed_tensors as ct
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    d = fixture_dir(name)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    (grp,) = qc["config_groups"].values()
    scheme = QuantizationScheme(targets=grp["targets"], weights=QuantizationArgs(**grp["weights"]))
    comp = PackedQuantizationCompressor if grp["format"] == "pack-quantized" else IntQuantizationCompressor
    raw = {}
    for f in sorted(d.glob("*.safetensors")):
        raw.update(load_file(f))
    quant = {k.rsplit(".", 1)[0] for k in raw if k.endswith(".weight_scale")}
    state = {}
    for k, v in raw.items():
        mod = k.rsplit(".", 1)[0]
        if mod not in quant:
            state[k] = v.float()
    for mod in quant:
        sub = {k[len(mod) + 1 :]: v for k, v in raw.items() if k.startswith(mod + ".")}
        sub["weight_scale"] = sub["weight_scale"].float()
        if "bias" in sub:
            state[f"{mod}.bias"] = sub.pop("bias").float()
        state[f"{mod}.weight"] = comp.decompress(sub, scheme)["weight"].float()
    assert ct is not None
    cfg = json.loads((d / "config.json").read_text())
    e = cfg.get("num_experts") or cfg.get("num_local_experts")
    out = {}
    for k, v in state.items():
        if ".mlp.experts." not in k:
            out[k] = v
    for layer in sorted({int(k.split(".")[2]) for k in state if ".mlp.experts." in k}):
        p = f"model.layers.{layer}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{p}.{j}.gate_proj.weight"], state[f"{p}.{j}.up_proj.weight"]]) for j in range(e)]
        )
        out[f"{p}.down_proj"] = torch.stack([state[f"{p}.{j}.down_proj.weight"] for j in range(e)])
    return out


def _oracle(name: str, scheme: str):
    """(the oracle fp32 model, a maker of the original model in the saved dtype (carrying the same
    weights), that dtype, the activation tolerance)."""
    if name in QUANTIZED:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = json.loads((fixture_dir(name) / "config.json").read_text())
        cfg.pop("quantization_config")
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        state = _ct_dequantized_state(name)
        dtype = getattr(torch, cfg["dtype"])

        def make(dt):
            m = AutoModelForCausalLM.from_config(config, dtype=dt).eval()
            missing, unexpected = m.load_state_dict(state, strict=False)  # copies, casting to dt
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            m.tie_weights()
            return m

        a8 = name.endswith("w8a8") or scheme == "a8"
        return make(torch.float32), lambda: make(dtype), dtype, A8_TOL if a8 else ACT_TOL[dtype]
    dtype = saved_dtype(name)
    m32 = load_hf_model(name, dtype=torch.float32)
    if scheme == "int8":
        fn, tol = (lambda w, last: _fake_int8(w, last).to(w.dtype)), A8_TOL
    elif dtype == torch.float32:  # no fp32 packed layout: the pack means the bf16-rounded experts
        fn, tol = (lambda w, last: w.to(torch.bfloat16).to(w.dtype)), ACT_TOL[dtype]
    else:
        fn, tol = None, ACT_TOL[dtype]

    def make():
        m = load_hf_model(name)
        if fn is not None:
            _set_expert_weights(m, fn)
        return m

    if fn is not None:
        _set_expert_weights(m32, fn)
    return m32, make, dtype, tol


def _check_same_tokens(what: str, ours: hf.Generation, orig: hf.Generation, run32: hf.Generation) -> int:
    """Our greedy tokens equal the original's; at the first step where they do not, it must be a
    near-tie: the original's top-2 margin is within twice the logit difference measured at that
    step (the change of the difference can swap them) and at most 1% of the logits' spread, and
    our token is one of the fp32 run's top 2 there. Returns the number of steps compared equal."""
    for s, (a, b) in enumerate(zip(ours.tokens, orig.tokens)):
        if a == b:
            continue
        lo = orig.logits[s]
        top = torch.topk(lo, 2)
        margin = float(top.values[0] - top.values[1])
        diff = float((ours.logits[s] - lo).abs().max())
        spread = float(lo.max() - lo.min())
        assert margin <= 2 * diff and margin <= 0.01 * spread, (
            f"{what}: token {s} is {a}, the original's {b}: not a near-tie (margin {margin:.3g}, "
            f"logit difference {diff:.3g}, spread {spread:.3g})"
        )
        assert a in torch.topk(run32.logits[s], 2).indices.tolist(), f"{what}: token {s} = {a} is not in the fp32 run's top 2"
        return s
    assert len(ours.tokens) == len(orig.tokens) == N_NEW
    return N_NEW


def _block_io(model, blocks: list, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of each MoE block in a forward pass of ``model`` on ``ids``."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(i):
        def f(mod, args, out):
            seen[i] = (args[0].detach(), (out[0] if isinstance(out, tuple) else out).detach())

        return f

    handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(blocks))]


def _routing_near_tie(m32, patched, ids: torch.Tensor) -> str | None:
    """Where the patched run selects other experts than the fp32 run at a near-tie, a description of
    the first; None when no selection differs or a difference is not a near-tie. Near-tie: as for
    tokens (``_check_same_tokens``), the fp32 run's margin between its k-th and (k+1)-th router
    logit is within twice the two runs' router logit difference at that token and at most 1% of the
    logits' spread. The router logits are ``x @ W.T (+ b)`` of each block's own router, in fp32."""
    fam = hf.FAMILIES[m32.config.model_type]
    b32 = list(hf._moe_blocks(m32, fam).values())
    bp = hf.packed_blocks(patched)
    k = int(m32.config.num_experts_per_tok)
    for layer, (blk, (x32, _), (xp, _)) in enumerate(zip(b32, _block_io(m32, b32, ids), _block_io(patched, bp, ids))):
        router = getattr(blk, fam.router_attr)
        w, b = router.weight.float(), getattr(router, "bias", None)
        lg32, lgp = (torch.nn.functional.linear(x.float().reshape(-1, x.shape[-1]), w, None if b is None else b.float())
                     for x in (x32, xp))  # fmt: skip
        for t in range(lg32.shape[0]):
            s32, sp = set(lg32[t].topk(k).indices.tolist()), set(lgp[t].topk(k).indices.tolist())
            if s32 == sp:
                continue
            top = lg32[t].topk(k + 1).values
            margin = float(top[k - 1] - top[k])
            diff = float((lgp[t] - lg32[t]).abs().max())
            spread = float(lg32[t].max() - lg32[t].min())
            if not (margin <= 2 * diff and margin <= 0.01 * spread):
                return None
            return f"block {layer} token {t}: experts {sorted(sp)}, fp32 {sorted(s32)}, margin {margin:.3g}"
    return None


def _check_blocks(m32, orig, patched, ids: torch.Tensor, tol: float, what: str) -> None:
    """Each packed block, on the inputs the original model gives its block, against the fp32 block
    on the same inputs: relative error <= the original block's own + tol."""
    fam = hf.FAMILIES[m32.config.model_type]
    b32, bo = (list(hf._moe_blocks(m, fam).values()) for m in (m32, orig))
    bp = hf.packed_blocks(patched)
    assert len(b32) == len(bo) == len(bp)
    for layer, ((x, y_orig), blk32, blkp) in enumerate(zip(_block_io(orig, bo, ids), b32, bp)):
        with torch.no_grad():
            want = blk32(x.float())
            got = blkp(x)
        want = want[0] if isinstance(want, tuple) else want
        got = got[0] if isinstance(got, tuple) else got
        own, rel = _rel(y_orig, want), _rel(got, want)
        assert rel <= own + tol, f"{what}: block {layer} rel {rel:.3g} > the original block's {own:.3g} + {tol:g}"


CASES = (
    [pytest.param(n, "dense", id=f"{n}-dense") for n in DENSE]
    + [pytest.param(n, "int8", id=f"{n}-int8") for n in DENSE]
    + [pytest.param(n, "as-saved", id=n) for n in QUANTIZED]
    + [pytest.param(n, "a8", id=f"{n}-a8") for n in QUANTIZED if "w4a16" in n]  # int4 run as W4A8
)


@pytest.mark.parametrize("name,scheme", CASES)
def test_model_matches_original(packs, name, scheme):
    pack = packs(name, scheme if scheme in ("int8", "a8") else "dense")
    m32, make_orig, dtype, tol = _oracle(name, scheme)
    orig = make_orig()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = m32(ids).logits.float()
        base = _rel(orig(ids).logits, want)  # transformers' own error in the saved dtype
        patched = hf.patch(make_orig(), pack)
        got_p = patched(ids).logits
    assert hf.packed_blocks(patched) and not any(hasattr(b, "experts") for b in hf.packed_blocks(patched))
    loaded = hf.load_model(pack)
    assert loaded.dtype == dtype
    with torch.no_grad():
        got_l = loaded(ids).logits
    assert torch.equal(got_l, got_p), f"load_model differs from patch: {_rel(got_l, got_p):.3g}"
    rel = _rel(got_p, want)
    if rel > base + tol:
        # One expert chosen differently at a routing near-tie moves the logits far more than any
        # rounding; that alone may break the bound, and then each block is held to it instead.
        tie = _routing_near_tie(m32, patched, ids)
        assert tie, f"{name} {scheme}: logits rel {rel:.3g} > transformers' own {base:.3g} + {tol:g}"
        _check_blocks(m32, orig, patched, ids, tol, f"{name} {scheme} ({tie})")

    g_orig = hf.greedy_generate(orig, PROMPT[:4], N_NEW)
    g32 = hf.greedy_generate(m32, PROMPT[:4], N_NEW)
    for what, model in (("patch", patched), ("load_model", loaded)):
        g = hf.greedy_generate(model, PROMPT[:4], N_NEW)
        _check_same_tokens(f"{name} {scheme} {what}", g, g_orig, g32)
        assert g.moe_seconds > 0 and 0 < g.moe_share < 1


def test_near_tie_rule_accepts_a_tie_and_refuses_a_clear_winner():
    logits = torch.zeros(N_NEW, 8)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.999  # a near-tie between 3 and 4 at every step
    tokens = [3] * N_NEW
    orig = hf.Generation(tokens, list(logits), 1.0, 0.5)
    flipped = logits.clone()
    flipped[5, 4] = 5.001
    ours = hf.Generation(tokens[:5] + [4] * 11, list(flipped), 1.0, 0.5)
    assert _check_same_tokens("tie", ours, orig, orig) == 5
    clear = logits.clone()
    clear[:, 4] = 1.0  # 3 wins by 4.0 ...
    clear2 = clear.clone()
    clear2[5, 4] = 5.1  # ... and ours picks 4 with a large logit change: not a near-tie
    with pytest.raises(AssertionError, match="not a near-tie"):
        _check_same_tokens("clear", hf.Generation(ours.tokens, list(clear2), 1, 0), hf.Generation(tokens, list(clear), 1, 0), orig)


# --------------------------------------------------------------------------- refusals


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before: dict) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not hf.packed_blocks(model)


def _edited_pack(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "moepack.json").read_text())
    edit(m)
    (dst / "moepack.json").write_text(json.dumps(reseal(m)))
    return dst


def test_patch_refuses_another_family_and_leaves_the_model(packs):
    model = load_hf_model("qwen3_moe")
    before = _state(model)
    with pytest.raises(hf.ModelMismatchError, match=r"model_type: the model is 'qwen3_moe'.* is 'qwen2_moe'"):
        hf.patch(model, packs("qwen2_moe"))
    _assert_unchanged(model, before)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("num_local_experts", 4, r"config field num_local_experts: the model has 8, the packed directory .* has 4"),
        ("num_experts_per_tok", 3, r"config field num_experts_per_tok: the model has 2, .* has 3"),
        ("moe_intermediate_size", 48, r"config field moe_intermediate_size: the model has 40, .* has 48"),
        ("norm_topk_prob", False, r"config field norm_topk_prob"),
    ],
)
def test_patch_refuses_a_config_mismatch(packs, tmp_path, field, value, match):
    pack = _edited_pack(packs("qwen3_moe"), tmp_path / "p", lambda m: m["model"]["config"].__setitem__(field, value))
    model = load_hf_model("qwen3_moe")
    before = _state(model)
    with pytest.raises(hf.ModelMismatchError, match=match):
        hf.patch(model, pack)
    _assert_unchanged(model, before)


def test_patch_refuses_missing_layers_and_shape_mismatch(packs):
    model = load_hf_model("qwen3_moe")
    before = _state(model)
    pm = moepack.open(packs("qwen3_moe"))
    del pm.layers[1]
    with pytest.raises(hf.ModelMismatchError, match=r"MoE layers: the model has \[0, 1\], the packed directory .* has \[0\]"):
        hf.patch(model, pm)
    _assert_unchanged(model, before)
    # a model whose experts are another size than the pack's (the config key that says so removed)
    pm = moepack.open(packs("qwen3_moe"))
    pm.config = {k: v for k, v in pm.config.items() if k != "moe_intermediate_size"}
    other = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen3_moe", **{**_cfg("qwen3_moe"), "moe_intermediate_size": 32})
    )
    before = _state(other)
    with pytest.raises(hf.ModelMismatchError, match=r"layer 0: expert intermediate_size is 32 in the model, 40 in the packed"):
        hf.patch(other, pm)
    _assert_unchanged(other, before)


def _cfg(name: str) -> dict:
    c = json.loads((fixture_dir(name) / "config.json").read_text())
    c.pop("model_type")
    return c


def test_patch_refuses_a_pack_without_routing(packs):
    model = load_hf_model("qwen3_moe")
    before = _state(model)
    pm = moepack.open(packs("qwen3_moe"))
    pm.routing = None
    with pytest.raises(UnsupportedError, match="the manifest has no routing config"):
        hf.patch(model, pm)
    _assert_unchanged(model, before)


def test_patch_twice_is_refused(packs):
    model = hf.patch(load_hf_model("mixtral"), packs("mixtral"))
    with pytest.raises(hf.ModelMismatchError, match="already a PackedMoEBlock"):
        hf.patch(model, packs("mixtral"))


def test_family_unknown_to_transformers(packs, tmp_path):
    pack = _edited_pack(packs("olmoe"), tmp_path / "p", lambda m: (m["model"]["config"].__setitem__("model_type", "nosuch_moe"),
                                                                  m["model"].__setitem__("model_type", "nosuch_moe")))  # fmt: skip
    with pytest.raises(UnsupportedError, match=r"model_type='nosuch_moe': the installed transformers .* has no such family"):
        hf.load_model(pack)


def test_family_moepack_does_not_run(packs, tmp_path):
    """A family transformers has but moepack has no block table for (a dense llama here)."""
    def edit(m):
        m["model"]["config"]["model_type"] = m["model"]["model_type"] = "llama"

    pack = _edited_pack(packs("qwen3_moe"), tmp_path / "p", edit)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=64)  # fmt: skip
    )
    before = _state(model)
    with pytest.raises(UnsupportedError, match=r"model_type='llama': moepack runs whole models of .*qwen3_moe"):
        hf.patch(model, pack)
    _assert_unchanged(model, before)
    with pytest.raises(UnsupportedError, match=r"model_type='llama': moepack runs whole models of"):
        hf.load_model(pack)


def test_strict_refuses_a_fallback_kernel_and_leaves_the_model(packs, monkeypatch):
    """A CPU the pack's layout has no kernel for at its level (simulated: the dispatcher reports a
    fallback) is refused under MOEPACK_STRICT / strict=True before anything changes."""
    import moepack.runtime.model as rm
    from moepack._ops import KernelChoice

    pack = packs("gpt_oss")
    monkeypatch.setattr(rm, "kernel_choice", lambda layout, mode=None: KernelChoice("scalar", "scalar: no avx512 kernel in this build", True))
    model = load_hf_model("gpt_oss")
    before = _state(model)
    with pytest.raises(UnsupportedError, match=r"layer 0: strict mode refuses a fallback: scalar: no avx512 kernel"):
        hf.patch(model, pack, strict=True)
    _assert_unchanged(model, before)
    monkeypatch.setenv("MOEPACK_STRICT", "1")
    with pytest.raises(UnsupportedError, match="strict mode refuses a fallback"):
        hf.patch(model, pack)
    _assert_unchanged(model, before)
    with pytest.raises(UnsupportedError, match="strict mode refuses a fallback"):
        hf.load_model(pack)
    monkeypatch.delenv("MOEPACK_STRICT")
    assert hf.packed_blocks(hf.patch(model, pack))  # without strict the fallback runs


def test_load_model_shares_the_memory_map(packs):
    """Non-expert weights are views of the pack's shards (no copy), the experts never exist as
    dense tensors, and rotary buffers are computed."""
    pack = packs("deepseek_v3")
    model = hf.load_model(pack)
    pm = model._moepack
    emb = model.get_input_embeddings().weight
    assert emb.data_ptr() == pm.tensor("model.embed_tokens.weight").data_ptr()
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()  # tied
    names = dict(model.named_parameters())
    assert not any("experts" in n for n in names), [n for n in names if "experts" in n]
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    ref = load_hf_model("deepseek_v3")
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


def test_load_model_dtype_override(packs):
    model = hf.load_model(packs("mixtral"), dtype=torch.float32)
    assert model.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    with torch.no_grad():
        out = model(torch.tensor([PROMPT])).logits
    ref = load_hf_model("mixtral", dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits
    assert _rel(out, want) <= ACT_TOL[torch.float32] * 10, _rel(out, want)


def test_generate_refuses_bad_prompts(packs):
    model = hf.load_model(packs("olmoe"))
    with pytest.raises(UnsupportedError, match=r"prompt token id 500: must be in \[0, vocab_size=128\)"):
        hf.greedy_generate(model, [1, 500], 2)
    with pytest.raises(UnsupportedError, match="at least one token"):
        hf.greedy_generate(model, [], 2)


# --------------------------------------------------------------------------- moepack generate


def _cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_generate_json_matches_the_original(packs):
    r = _cli("generate", packs("glm4_moe"), "--prompt-ids", ",".join(map(str, PROMPT[:4])), "--max-new-tokens", 6, "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == hf.greedy_generate(load_hf_model("glm4_moe"), PROMPT[:4], 6).tokens
    assert out["model_type"] == "glm4_moe" and out["dtype"] == "bfloat16" and out["prompt_ids"] == PROMPT[:4]
    assert out["tokens_per_second"] > 0 and 0 < out["moe_share"] < 1 and out["moe_seconds"] <= out["seconds"]


def test_cli_generate_text_output(packs):
    r = _cli("generate", packs("olmoe"), "--prompt-ids", "1, 2, 3", "--max-new-tokens", 3)
    assert r.exit_code == 0, r.stderr
    want = hf.greedy_generate(load_hf_model("olmoe"), [1, 2, 3], 3).tokens
    text = " ".join(r.stdout.split())
    assert f"tokens {want}" in text and "tokens/s" in text and "% of the time in the MoE layers" in text


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated integer token ids"),
        (["--prompt-ids", "1,400"], "prompt token id 400: must be in [0, vocab_size=128)"),
        ([], "give the prompt as either --prompt-ids 1,2,3 or --prompt TEXT"),
        (["--prompt", "hello"], "carries no tokenizer files (use --prompt-ids)"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
        (["--prompt-ids", "1", "--dtype", "int8"], "--dtype 'int8': must be one of"),
    ],
)
def test_cli_generate_refusals(packs, args, message):
    r = _cli("generate", packs("olmoe"), *args)
    assert r.exit_code == 2, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moepack: error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def _word_tokenizer(dst: Path) -> None:
    """A word-level tokenizer of the fixtures' 128 ids, saved the way transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(dst)


def test_cli_generate_from_text_with_a_carried_tokenizer(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3_moe"), src)
    _word_tokenizer(src)
    moepack.convert(src, tmp_path / "p")
    assert "tokenizer.json" in json.loads((tmp_path / "p" / "moepack.json").read_text())["carried_files"]
    r = _cli("generate", tmp_path / "p", "--prompt", "w5 w77 w23", "--max-new-tokens", 4, "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == [5, 77, 23]
    want = hf.greedy_generate(load_hf_model("qwen3_moe"), [5, 77, 23], 4).tokens
    assert out["tokens"] == want and out["text"] == " ".join(f"w{t}" if t > 2 else "" for t in want).strip()


@pytest.mark.parametrize("run_first", [False, True], ids=["patched-then-run", "run-then-patched"])
def test_router_logits_and_aux_loss_are_recorded(packs, run_first):
    """output_router_logits=True: transformers' hooks find the blocks' recorders (also when the model
    ran, and so was hooked, before patch); layer 0's logits equal transformers' (same input)."""
    ids = torch.tensor([PROMPT])
    ref = load_hf_model("gpt_oss")
    model = load_hf_model("gpt_oss")
    with torch.no_grad():
        want = ref(ids, output_router_logits=True)
        if run_first:
            model(ids)
        hf.patch(model, packs("gpt_oss"))
        got = model(ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    assert torch.equal(got.router_logits[0], want.router_logits[0])
    assert abs(float(got.aux_loss) - float(want.aux_loss)) <= 1e-2 * abs(float(want.aux_loss))


def test_patch_frees_the_original_blocks(packs):
    import gc
    import weakref

    model = load_hf_model("qwen2_moe")
    refs = [weakref.ref(layer.mlp) for layer in model.model.layers]
    refs += [weakref.ref(layer.mlp.experts.gate_up_proj) for layer in model.model.layers]
    refs += [weakref.ref(layer.mlp.shared_expert) for layer in model.model.layers]
    hf.patch(model, packs("qwen2_moe"))
    gc.collect()
    assert all(r() is None for r in refs)
    assert not any(".mlp." in n for n, _ in model.named_parameters())


def test_importing_moepack_hf_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, moepack, moepack.hf; assert moepack.load_model and 'transformers' not in sys.modules, 'imported'"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
