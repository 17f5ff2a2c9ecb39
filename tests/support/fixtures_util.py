"""Helpers for the tiny real Hugging Face MoE checkpoints under fixtures/.

The checkpoints are written by ``tools/make_fixtures.py`` (transformers' own
``save_pretrained``); see fixtures/README.md and each fixtures/<name>/FIXTURE.json
for the on-disk inventory (expert / router / shared-expert tensor names, shapes, dtypes).

    from tests.support.fixtures_util import fixture_dir, load_hf_model, moe_block, route

    model = load_hf_model("deepseek_v3")             # saved dtype, eval mode, eager experts
    block, run = moe_block(model, 1)                 # layer 1 is MoE (layer 0 is dense)
    y = run(x)                                       # x [T, H] -> y [T, H] (model dtype)
    logits, weights, ids = route(block, x)           # [T, E], [T, k], [T, k]

Only ``fixture_dir``/``fixture_names``/``fixture_info`` work without transformers;
everything else imports transformers lazily (a test dependency that ``make setup-test``
installs: a test that needs it imports it, and fails where it is missing).

Router logits ([T, E]) for the same input, per family -- ``route(block, x)[0]`` returns
exactly what transformers computes; by hand it is ``F.linear(x, W, b)`` with:

- mixtral:     ``block.gate``;   disk ``block_sparse_moe.gate.weight``; ``x @ W.T`` in the model dtype
- qwen2_moe, qwen3_moe, olmoe: ``block.gate``; disk ``mlp.gate.weight``; ``x @ W.T`` in the model dtype
- deepseek_v2: ``block.gate``; disk ``mlp.gate.weight`` (BF16); ``x.float() @ W.float().T`` (W is
  kept F32 in memory); no correction bias
- deepseek_v3, glm4_moe: ``block.gate``; disk ``mlp.gate.weight`` (BF16) and
  ``mlp.gate.e_score_correction_bias`` (F32, used for expert selection only, not in the logits);
  ``x.float() @ W.float().T`` (W is kept F32 in memory)
- granitemoe:  ``block.router``; disk ``block_sparse_moe.router.layer.weight``; ``(x @ W.T).float()``
- gpt_oss:     ``block.router``; disk ``mlp.router.weight`` + ``mlp.router.bias``; ``x @ W.T + b``
- phimoe:      ``block.router`` (an nn.Linear); disk ``block_sparse_moe.gate.weight``; ``x @ W.T``
- llama4_text: ``block.router`` (an nn.Linear); disk ``feed_forward.router.weight``; ``x @ W.T``

Note the in-memory module names differ from the on-disk names for some families
(transformers 5 renames on load/save): Mixtral's and Phi-MoE's blocks are ``layer.mlp`` in
memory but ``block_sparse_moe`` on disk (Phi-MoE's ``mlp.router`` is ``block_sparse_moe.gate``
on disk); Granite-MoE's router is ``router.weight`` in memory but
``router.layer.weight`` on disk; in memory every family's experts are fused
``experts.gate_up_proj``/``experts.down_proj`` whatever the disk layout.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Callable

FIXTURES_ROOT = Path(__file__).resolve().parents[2] / "fixtures"

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def fixture_names() -> list[str]:
    """Names of the dense fixtures (directories holding a FIXTURE.json that transformers wrote);
    quantized variants of them are ``quantized_fixture_names()``."""
    return sorted(p.parent.name for p in FIXTURES_ROOT.glob("*/FIXTURE.json") if "base_fixture" not in json.loads(p.read_text()))


def quantized_fixture_names() -> list[str]:
    """Fixtures written by a quantization library from a dense fixture's weights (FIXTURE.json
    names its ``base_fixture``), e.g. qwen3_moe_w8a8 (compressed-tensors int-quantized)."""
    return sorted(p.parent.name for p in FIXTURES_ROOT.glob("*/FIXTURE.json") if "base_fixture" in json.loads(p.read_text()))


def fixture_dir(name: str) -> Path:
    """fixtures/<name> as an absolute path; FileNotFoundError if it is not a fixture."""
    d = FIXTURES_ROOT / name
    if not (d / "FIXTURE.json").is_file():
        raise FileNotFoundError(
            f"no fixture {name!r} under {FIXTURES_ROOT} (have: {', '.join(fixture_names()) or 'none'}); "
            "regenerate with `python tools/make_fixtures.py --seed 0`"
        )
    return d


@lru_cache(maxsize=None)
def _info(name: str) -> str:
    return (fixture_dir(name) / "FIXTURE.json").read_text()


def fixture_info(name: str) -> dict:
    """The parsed FIXTURE.json (a fresh copy each call)."""
    return json.loads(_info(name))


def saved_dtype(name: str):
    """torch dtype the fixture's weights were saved in (config.json ``dtype``)."""
    import torch

    cfg = json.loads((fixture_dir(name) / "config.json").read_text())
    return getattr(torch, _DTYPES[cfg.get("dtype") or cfg.get("torch_dtype")])


def load_hf_model(name: str, dtype=None, experts_implementation: str = "eager"):
    """``AutoModelForCausalLM.from_pretrained(fixture_dir(name), dtype=<as saved>)`` in eval mode.

    ``dtype`` overrides the saved dtype (e.g. ``torch.float32`` for a higher-precision oracle;
    the saved bf16/f16 values upcast exactly). ``experts_implementation`` defaults to
    ``"eager"`` (transformers' plain per-expert loop) rather than its default ``grouped_mm``.
    Note DeepSeek-V3 / GLM-4.5 keep ``gate.weight`` and ``e_score_correction_bias`` in F32 in
    memory whatever ``dtype`` is (``_keep_in_fp32_modules_strict``).
    """
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(fixture_dir(name)),
        dtype=dtype if dtype is not None else saved_dtype(name),
        experts_implementation=experts_implementation,
        local_files_only=True,
    )
    model.eval()
    return model


def _family(model):
    """The family facts moepack keeps for whole-model runs (moepack.hf.FAMILIES: where the block
    and its router sit, in transformers 5's in-memory names)."""
    from moepack.hf import FAMILIES

    return FAMILIES[model.config.model_type]


def moe_block(model, layer_index: int) -> tuple["object", Callable]:
    """The transformers MoE block of decoder layer ``layer_index`` and a runner for it.

    Returns ``(block, run)``; ``run(x)`` takes hidden states ``x`` [T, H] (any float dtype; cast
    to the block's dtype), runs the block under ``torch.no_grad()`` and returns its output
    [T, H] in the block's dtype. Families whose block returns a tuple (gpt_oss:
    ``(out, router_scores)``; llama4: ``(out, router_logits)``) are unwrapped; the block's
    input is passed as [1, T, H] because most blocks require 3-D input.

    ``run`` gives the complete MoE block output: routed experts (weighted) plus any shared
    expert (qwen2_moe: ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``; deepseek_v2 /
    deepseek_v3 / glm4_moe / llama4_text: ``+ shared_expert(s)(x)`` unweighted).

    Raises ValueError for a dense layer (e.g. layer 0 of deepseek_v2, deepseek_v3, glm4_moe,
    llama4_text).
    For the router logits [T, E] of the same input use ``route(block, x)[0]`` (see the module
    docstring for which Linear that is).
    """
    import torch

    layer = model.model.layers[layer_index]
    attr = _family(model).block_attr
    block = getattr(layer, attr, None)
    if block is None or not hasattr(block, "experts"):
        raise ValueError(f"layer {layer_index} of {type(model).__name__} is not an MoE layer ({attr}: {type(block).__name__})")
    dtype = block.experts.down_proj.dtype
    hidden = model.config.hidden_size

    def run(x):
        if x.dim() != 2 or x.shape[-1] != hidden:
            raise ValueError(f"expected hidden states [T, {hidden}], got {tuple(x.shape)}")
        with torch.no_grad():
            out = block(x.to(dtype)[None])
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(x.shape[0], hidden)

    return block, run


def route(block, x):
    """Routing of hidden states ``x`` [T, H] by ``block``'s router, as transformers computes it.

    Returns ``(logits [T, E], weights [T, k], indices [T, k])``; ``logits`` are the raw router
    logits (F32 for deepseek_v2/deepseek_v3/glm4_moe/granitemoe, else the model dtype; gpt_oss
    includes the router bias; deepseek_v3/glm4_moe do NOT include ``e_score_correction_bias``),
    ``weights`` the per-token expert weights actually applied (deepseek/glm4: already
    x ``routed_scaling_factor``; llama4: ``sigmoid(logit)``, which multiplies the expert INPUT),
    ``indices`` the selected experts (order as transformers returns it, not necessarily sorted;
    for phimoe the order matters: column 0 is the sparsemixer's first pick).

    Near-ties between logits can select different experts in bf16 than in fp32 (seen on
    phimoe layer 1 with random inputs), so compare an implementation's routing against
    ``route`` on a model loaded in the same precision, or use ``load_hf_model(name,
    dtype=torch.float32)`` as the oracle and compare only tokens whose selection agrees.
    """
    import torch

    router = block.gate if hasattr(block, "gate") else block.router  # the block has no config: both names
    dtype = block.experts.down_proj.dtype
    with torch.no_grad():
        out = router(x.to(dtype))
    if type(router).__name__ == "Llama4Router":
        scores, logits = out
        k = router.top_k
        indices = torch.topk(logits, k, dim=1).indices
        return logits, scores.gather(1, indices), indices
    logits, weights, indices = out
    return logits, weights, indices


def router_logits(block, x):
    """Shorthand for ``route(block, x)[0]``: router logits [T, E]."""
    return route(block, x)[0]
