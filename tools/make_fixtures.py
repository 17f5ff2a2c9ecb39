#!/usr/bin/env python
"""Regenerate the tiny real Hugging Face MoE checkpoints under fixtures/.

    python tools/make_fixtures.py --seed 0 [--out fixtures] [--only NAME ...]

Each fixture is written by transformers' own ``save_pretrained`` from a seeded
random config (``AutoConfig.for_model`` -> ``AutoModelForCausalLM.from_config``),
so the on-disk tensor names, shapes, dtypes and config.json keys are exactly what
transformers produces. Next to each checkpoint this script writes FIXTURE.json:
the generation parameters, library versions and an inventory of the MoE tensors
(experts, router, shared experts, biases) read back with ``safetensors.safe_open``.

The output is deterministic: the same seed and the same library versions give
byte-identical files. Tested with transformers 5.24.0, torch 2.13.0+cpu,
safetensors 0.8.0 (see fixtures/README.md).

Nothing here is imported by moepack; it needs torch + transformers only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import zlib
import sys
from pathlib import Path

# Quiet, deterministic, offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SEED = 0  # --seed (the quantized fixtures' built base models use it too)

# Common to every fixture. initializer_range is raised from the usual 0.02 so the
# expert MLPs produce O(0.1-1) outputs and the router logits are O(1) and well
# separated: with 0.02 an MoE block's output is ~1e-3 and any absolute tolerance
# in a test would pass trivially.
COMMON = dict(
    num_hidden_layers=2,
    vocab_size=128,
    tie_word_embeddings=True,
    initializer_range=0.1,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# The attention (MLA) and expert shapes both DeepSeek fixtures share; their routing differs.
_DEEPSEEK_SHAPES = dict(
    hidden_size=72, num_attention_heads=2, num_key_value_heads=2,
    q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    intermediate_size=96,  # dense MLP of layers < first_k_dense_replace
    moe_intermediate_size=40, n_routed_experts=8, num_experts_per_tok=2,
)

# name -> spec. "config" is passed verbatim (with COMMON) to AutoConfig.for_model.
# H = hidden_size (never a power of two nor a multiple of 32); the expert
# intermediate size is a multiple of 8 but not of 32.
FIXTURES: dict[str, dict] = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        dtype="bfloat16",
        config=dict(
            hidden_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=36,
            intermediate_size=96,  # dense MLP size (unused: every layer is MoE)
            moe_intermediate_size=40, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        ),
    ),
    "mixtral": dict(
        model_type="mixtral",
        dtype="bfloat16",
        config=dict(
            hidden_size=56, num_attention_heads=2, num_key_value_heads=1, head_dim=28,
            intermediate_size=88,  # = expert size for Mixtral
            num_local_experts=4, num_experts_per_tok=2,
        ),
    ),
    # Same model as "mixtral" (same seed/config), saved in 3 shards + index.
    "mixtral_sharded": dict(
        model_type="mixtral",
        dtype="bfloat16",
        same_as="mixtral",
        max_shard_size="100KB",
        config=dict(
            hidden_size=56, num_attention_heads=2, num_key_value_heads=1, head_dim=28,
            intermediate_size=88,
            num_local_experts=4, num_experts_per_tok=2,
        ),
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        dtype="bfloat16",
        config=dict(
            **_DEEPSEEK_SHAPES,
            n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
            first_k_dense_replace=1, norm_topk_prob=True,
            # Not read by transformers' DeepseekV3 code (which hard-codes sigmoid +
            # noaux_tc) but present in the official DeepSeek-V3 config.json; kept so
            # readers see the real key set.
            topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
        ),
        # HF initialises the buffer to zeros; real checkpoints have a non-zero F32
        # bias. Overwritten after init (see randomize_extra) and stored as F32 like
        # the official DeepSeek-V3 release (router weight stays BF16).
        randomize=["e_score_correction_bias"],
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        dtype="bfloat16",
        config=dict(
            **_DEEPSEEK_SHAPES,
            # DeepseekV2TopkRouter: softmax, then group_limited_greedy (group score = the
            # group's max softmax score, keep topk_group of n_group groups), top-k, no
            # renormalisation (transformers defines norm_topk_prob=False and never reads
            # it), x routed_scaling_factor. No e_score_correction_bias in this family.
            topk_method="group_limited_greedy", n_group=2, topk_group=1,
            n_shared_experts=2, routed_scaling_factor=2.0,
            first_k_dense_replace=1, norm_topk_prob=False,
            # Not read by transformers' DeepseekV2 code (softmax is hard-coded) but present
            # in the official DeepSeek-V2 config.json.
            scoring_func="softmax", moe_layer_freq=1,
        ),
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        dtype="float32",  # covers an F32 source checkpoint
        config=dict(
            hidden_size=40, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64,  # dense MLP size (unused: every layer is MoE)
            moe_intermediate_size=88, shared_expert_intermediate_size=56,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[],
        ),
    ),
    "olmoe": dict(
        model_type="olmoe",
        dtype="float16",  # covers an F16 source checkpoint
        config=dict(
            hidden_size=56, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=24,  # = expert size for OLMoE
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        ),
    ),
    "phimoe": dict(
        model_type="phimoe",
        dtype="bfloat16",
        config=dict(
            hidden_size=72, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=40,  # = expert size for Phi-MoE
            num_local_experts=4, num_experts_per_tok=2,
            # sparsemixer eps. Phi-3.5-MoE ships 0.01, with which ~99% of tokens get
            # weights exactly 1.0 here; 0.2 gives non-trivial masked-softmax weights for
            # ~25-30% of tokens, so the sparsemixer rule is actually exercised.
            router_jitter_noise=0.2, input_jitter_noise=0.0,
        ),
    ),
    "glm4_moe": dict(
        model_type="glm4_moe",
        dtype="bfloat16",
        config=dict(
            hidden_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=36,
            intermediate_size=96,  # dense MLP of layers < first_k_dense_replace
            moe_intermediate_size=40, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5,
            first_k_dense_replace=1, norm_topk_prob=True,
        ),
        randomize=["e_score_correction_bias"],
    ),
    "granitemoe": dict(
        model_type="granitemoe",
        dtype="bfloat16",
        config=dict(
            hidden_size=72, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=40,  # = expert size
            num_local_experts=4, num_experts_per_tok=2,
        ),
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        dtype="bfloat16",
        config=dict(
            hidden_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=36,
            intermediate_size=40,  # = expert size
            num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
            # YaRN factor 32 over original 4096 (the gpt-oss default): keeps transformers
            # from warning that max_position_embeddings disagrees with the rope factor.
            max_position_embeddings=131072,
        ),
        # HF initialises all three biases to zeros.
        randomize=["router.bias", "gate_up_proj_bias", "down_proj_bias"],
    ),
    "llama4_text": dict(
        model_type="llama4_text",
        dtype="bfloat16",
        config=dict(
            hidden_size=72, num_attention_heads=2, num_key_value_heads=1, head_dim=36,
            intermediate_size=40,  # = expert (and shared expert) size
            intermediate_size_mlp=96,  # dense layers
            num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2,  # layer 0 dense, layer 1 MoE (like Maverick)
            attention_chunk_size=64,
        ),
    ),
}

BIAS_STD = {"e_score_correction_bias": 0.2, "router.bias": 0.5, "gate_up_proj_bias": 0.1, "down_proj_bias": 0.1}

# Keys of config.json that describe the MoE structure / routing (recorded when present).
ROUTING_KEYS = [
    "model_type", "architectures", "dtype", "hidden_size", "num_hidden_layers", "hidden_act",
    "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp",
    "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "norm_topk_prob", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq",
    "n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor",
    "decoder_sparse_step", "mlp_only_layers", "router_jitter_noise", "input_jitter_noise",
    "interleave_moe_layer_step", "moe_layers", "swiglu_limit", "swiglu_alpha", "tie_word_embeddings",
]

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def versions() -> dict:
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def extra_seed(name: str, seed: int) -> int:
    """Seed of the generator for the post-init bias overwrite (distinct per fixture)."""
    return seed * 100003 + 1000 + zlib.crc32(name.encode()) % 1000


def build_model(name: str, spec: dict, seed: int):
    cfg = AutoConfig.for_model(spec["model_type"], **{**COMMON, **spec["config"]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.eval()
    model.to(TORCH_DTYPES[spec["dtype"]])
    randomize_extra(model, spec, extra_seed(name, seed))
    return model


@torch.no_grad()
def randomize_extra(model, spec: dict, seed: int) -> None:
    """Overwrite parameters/buffers that transformers zero-initialises (biases) with
    seeded random values, so routing and bias handling are actually exercised."""
    names = spec.get("randomize", [])
    if not names:
        return
    gen = torch.Generator().manual_seed(seed)
    for full, t in sorted(list(model.named_parameters()) + list(model.named_buffers())):
        for pat in names:
            if full.endswith(pat):
                vals = torch.randn(t.shape, generator=gen, dtype=torch.float32) * BIAS_STD[pat]
                if pat == "e_score_correction_bias":
                    # Real DeepSeek-V3 / GLM-4.5 store this buffer as F32; transformers
                    # also keeps it F32 in memory (_keep_in_fp32_modules_strict).
                    owner = model.get_submodule(full.rsplit(".", 1)[0])
                    owner.e_score_correction_bias = vals  # re-registers the buffer as F32
                else:
                    t.copy_(vals.to(t.dtype))


# --------------------------------------------------------------------------- inventory

def read_tensors(d: Path) -> dict[str, dict]:
    """name -> {shape, dtype, file} for every tensor in the checkpoint (sharded or not)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = {"shape": list(s.get_shape()), "dtype": s.get_dtype(), "file": f.name}
    return out


def _t(tensors: dict, name: str) -> dict:
    t = tensors[name]
    return {"name": name, "shape": t["shape"], "dtype": t["dtype"]}


PER_EXPERT_PROJ = {  # on-disk projection name -> role
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
    "w1": "gate", "w3": "up", "w2": "down",
}


def layer_inventory(tensors: dict, L: int, used: set) -> dict:
    """Classify the non-attention, non-norm tensors of layer L. Every such tensor must be
    accounted for; anything left over is an error (the naming table would be wrong)."""
    pre = f"model.layers.{L}."
    mine = sorted(k for k in tensors if k.startswith(pre))
    ffn = [k for k in mine if not re.search(r"\.(self_attn|input_layernorm|post_attention_layernorm)\.", k)]
    inv: dict = {}

    # Per-expert 2-D experts: <block>.experts.<e>.<proj>.weight
    per = {}
    for k in ffn:
        m = re.fullmatch(re.escape(pre) + r"(\w+)\.experts\.(\d+)\.(\w+)\.weight", k)
        if m and m.group(3) in PER_EXPERT_PROJ:
            per.setdefault(int(m.group(2)), {})[PER_EXPERT_PROJ[m.group(3)]] = _t(tensors, k)
            inv["block_prefix"] = pre + m.group(1)
            used.add(k)
    if per:
        inv["kind"] = "moe"
        inv["expert_layout"] = "per_expert_2d"
        inv["num_experts_on_disk"] = len(per)
        inv["experts"] = {str(e): per[e] for e in sorted(per)}
        inv["expert_name_pattern"] = {
            role: re.sub(r"\.experts\.0\.", ".experts.{e}.", per[0][role]["name"]) for role in ("gate", "up", "down")
        }

    # Fused 3-D experts.
    fused_patterns = [
        # granitemoe: input_linear [E, 2I, H] (gate rows then up rows), output_linear [E, H, I]
        (r"block_sparse_moe\.input_linear\.weight", "gate_up",
         "[E, 2I, H] out-major (nn.Linear [out,in] per expert); rows [0:I] = gate, rows [I:2I] = up"),
        (r"block_sparse_moe\.output_linear\.weight", "down", "[E, H, I] out-major (nn.Linear [out,in] per expert)"),
        # gpt_oss: gate_up_proj [E, H, 2I] in-major, gate/up INTERLEAVED along the last dim
        (r"mlp\.experts\.gate_up_proj", "gate_up",
         "[E, H, 2I] in-major (y = x @ W[e]); last dim INTERLEAVED: [..., 0::2] = gate, [..., 1::2] = up"),
        (r"mlp\.experts\.gate_up_proj_bias", "gate_up_bias", "[E, 2I], interleaved like gate_up_proj"),
        (r"mlp\.experts\.down_proj", "down", "[E, I, H] in-major (y = h @ W[e])"),
        (r"mlp\.experts\.down_proj_bias", "down_bias", "[E, H]"),
        # llama4: gate_up_proj [E, H, 2I] in-major, halves
        (r"feed_forward\.experts\.gate_up_proj", "gate_up",
         "[E, H, 2I] in-major (y = x @ W[e]); last dim halves: [..., :I] = gate, [..., I:] = up"),
        (r"feed_forward\.experts\.down_proj", "down", "[E, I, H] in-major (y = h @ W[e])"),
    ]
    fused = {}
    for pat, role, layout in fused_patterns:
        for k in ffn:
            if re.fullmatch(re.escape(pre) + pat, k):
                fused[role] = dict(_t(tensors, k), layout=layout)
                used.add(k)
    if fused:
        assert not per, f"layer {L}: both per-expert and fused expert tensors"
        inv["kind"] = "moe"
        inv["expert_layout"] = "fused_3d"
        inv["experts_fused"] = fused
        inv["num_experts_on_disk"] = fused["gate_up"]["shape"][0]

    # Router.
    router_patterns = [
        (r"(mlp|block_sparse_moe)\.gate\.weight", "router"),
        (r"block_sparse_moe\.router\.layer\.weight", "router"),
        (r"(mlp|feed_forward)\.router\.weight", "router"),
        (r"mlp\.router\.bias", "router_bias"),
        (r"mlp\.gate\.e_score_correction_bias", "e_score_correction_bias"),
    ]
    for pat, role in router_patterns:
        for k in ffn:
            if re.fullmatch(re.escape(pre) + pat, k):
                inv[role] = _t(tensors, k)
                used.add(k)

    # Shared experts.
    shared = {}
    for k in ffn:
        m = re.fullmatch(re.escape(pre) + r"(\w+)\.(shared_experts?)\.(gate_proj|up_proj|down_proj)\.weight", k)
        if m:
            shared[PER_EXPERT_PROJ[m.group(3)]] = _t(tensors, k)
            used.add(k)
    if shared:
        inv["shared_expert"] = shared
    for k in ffn:
        if re.fullmatch(re.escape(pre) + r"mlp\.shared_expert_gate\.weight", k):
            inv["shared_expert_gate"] = _t(tensors, k)
            used.add(k)

    # Dense MLP (no experts in this layer).
    if "kind" not in inv:
        dense = {}
        for k in ffn:
            m = re.fullmatch(re.escape(pre) + r"(mlp|feed_forward)\.(gate_proj|up_proj|down_proj)\.weight", k)
            if m:
                dense[PER_EXPERT_PROJ[m.group(2)]] = _t(tensors, k)
                used.add(k)
        if dense:
            inv["kind"] = "dense"
            inv["mlp"] = dense

    left = [k for k in ffn if k not in used]
    if left:
        raise RuntimeError(f"layer {L}: unclassified FFN tensors {left}")
    return inv


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def write_fixture(name: str, spec: dict, seed: int, out: Path, argv: list[str]) -> Path:
    d = out / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model = build_model(name, spec, seed)
    save_kw = dict(safe_serialization=True)
    if "max_shard_size" in spec:
        save_kw["max_shard_size"] = spec["max_shard_size"]
    model.save_pretrained(str(d), **save_kw)

    cfg = json.loads((d / "config.json").read_text())
    tensors = read_tensors(d)
    nl = cfg["num_hidden_layers"]
    used: set = set()
    layers = {str(L): layer_inventory(tensors, L, used) for L in range(nl)}

    doc = {
        "name": name,
        "family": spec["model_type"],
        "architecture": type(model).__name__,
        "seed": seed,
        "command": "python tools/make_fixtures.py " + " ".join(argv),
        "versions": versions(),
        "saved_dtype": spec["dtype"],
        "generation": {
            "AutoConfig.for_model": {"model_type": spec["model_type"], **{**COMMON, **spec["config"]}},
            "steps": [
                f"torch.manual_seed({seed})",
                "model = AutoModelForCausalLM.from_config(config); model.eval()",
                f"model.to(torch.{spec['dtype']})",
            ] + ([
                f"overwrite {spec['randomize']} with torch.randn(generator=torch.Generator().manual_seed({extra_seed(name, seed)}))"
                f" * std {[BIAS_STD[p] for p in spec['randomize']]}, in sorted parameter-name order"
                + ("; e_score_correction_bias kept float32" if "e_score_correction_bias" in spec["randomize"] else "")
            ] if spec.get("randomize") else []) + [
                "model.save_pretrained(dir, safe_serialization=True"
                + (f", max_shard_size={spec['max_shard_size']!r})" if "max_shard_size" in spec else ")"),
            ],
        },
        "same_weights_as": spec.get("same_as"),
        "routing_config": {k: cfg[k] for k in ROUTING_KEYS if k in cfg},
        "moe_layers": [int(L) for L, v in layers.items() if v["kind"] == "moe"],
        "dense_layers": [int(L) for L, v in layers.items() if v["kind"] == "dense"],
        "layers": layers,
        "files": {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
                  for f in sorted(d.iterdir()) if f.name != "FIXTURE.json"},
        "tensors": tensors,
    }
    if doc["same_weights_as"] is None:
        del doc["same_weights_as"]
    (d / "FIXTURE.json").write_text(json.dumps(doc, indent=1) + "\n")
    return d


# Quantized fixtures written by the quantization library itself, from a dense fixture's weights
# (FORMATS.md §3.6: compressed-tensors 0.20 quantizes and packs on CPU). name -> spec.
QUANTIZED: dict[str, dict] = {
    # W8A8 INT8 (format int-quantized): every Linear but the routers; int8 weight + per-channel
    # weight_scale [N, 1] in the model dtype; dynamic per-token int8 activations (no input_scale).
    "qwen3_moe_w8a8": dict(base="qwen3_moe", preset="W8A8", ignore=["lm_head", "re:.*mlp.gate$"]),
    # W4A16 / W4A16_ASYM (format pack-quantized) with group 32, on a qwen2_moe built here (not a
    # dense fixture: compressed-tensors 0.20.1 refuses K % group_size != 0, so H = 96 and I = 64
    # are multiples of 32 but not of 128), shared expert included; routers and the shared-expert
    # gate stay bf16. weight_packed [N, K/8] int32, weight_scale [N, K/32] bf16, asym:
    # weight_zero_point [ceil(N/8), K/32] int32.
    "qwen2_moe_w4a16": dict(model=dict(
        model_type="qwen2_moe", dtype="bfloat16",
        config=dict(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                    moe_intermediate_size=64, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    ), preset="W4A16", weights={"group_size": 32}, ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]),
    "qwen2_moe_w4a16_asym": dict(same_model_as="qwen2_moe_w4a16", preset="W4A16_ASYM", weights={"group_size": 32},
                                 ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]),
    # per-channel asymmetric 4-bit (strategy channel: any K) on fixtures/qwen3_moe (H=72, I=40)
    "qwen3_moe_w4a16_channel": dict(base="qwen3_moe", preset="W4A16_ASYM", weights={"strategy": "channel", "group_size": None},
                                    ignore=["lm_head", "re:.*mlp.gate$"], only="re:.*mlp\\.experts\\..*"),
}


def _linear_weights(sd: dict) -> dict:
    """module name -> 2-D weight of every nn.Linear-like tensor (not embeddings or norms)."""
    return {
        n[: -len(".weight")]: t
        for n, t in sd.items()
        if n.endswith(".weight") and t.dim() == 2 and "embed" not in n and "norm" not in n
    }


def write_quantized_fixture(name: str, spec: dict, out: Path, argv: list[str]) -> Path:
    """Quantize a dense fixture's Linear weights with compressed-tensors and save the result the
    way a compressed-tensors checkpoint is saved (safetensors state dict + update_config)."""
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    d = out / name
    model_spec = spec.get("model") or (QUANTIZED[spec["same_model_as"]]["model"] if "same_model_as" in spec else None)
    tmp = None
    if model_spec is not None:  # a base model built here, from a seeded config, like write_fixture's
        import tempfile

        tmp = tempfile.TemporaryDirectory()
        base = Path(tmp.name)
        build_model(spec.get("same_model_as", name), model_spec, SEED).save_pretrained(str(base), safe_serialization=True)
    else:
        base = out / spec["base"]
        if not (base / "config.json").is_file():
            raise SystemExit(f"{name}: the dense fixture {base} must exist first (make it without --only, or with --only {spec['base']})")
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    sd = {}
    for f in sorted(base.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    root = torch.nn.Module()
    for mname, w in _linear_weights(sd).items():
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=f"{mname}.bias" in sd, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if lin.bias is not None:
                lin.bias.copy_(sd[f"{mname}.bias"])
        cur = root
        parts = mname.split(".")
        for p in parts[:-1]:
            if not hasattr(cur, p):
                cur.add_module(p, torch.nn.Module())
            cur = getattr(cur, p)
        cur.add_module(parts[-1], lin)
    scheme = preset_name_to_scheme(spec["preset"], [spec["only"]] if spec.get("only") else ["Linear"])
    if spec.get("weights"):
        scheme.weights = scheme.weights.model_copy(update=spec["weights"])
    apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": scheme}, ignore=spec["ignore"]))
    # the observers live in llm-compressor: fill the scales from each channel's min/max
    for m in root.modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.float()
            if m.weight_scale.shape[-1] > 1:  # group strategy: min/max per group of columns
                w = w.unflatten(-1, (m.weight_scale.shape[-1], -1))
            lo = torch.clamp(w.amin(dim=-1), max=0).reshape(m.weight_scale.shape)
            hi = torch.clamp(w.amax(dim=-1), min=0).reshape(m.weight_scale.shape)
            scale, zp = calculate_qparams(lo, hi, m.quantization_scheme.weights)
            with torch.no_grad():
                m.weight_scale.copy_(scale.to(m.weight_scale.dtype))
                if hasattr(m, "weight_zero_point"):
                    m.weight_zero_point.copy_(zp.to(m.weight_zero_point.dtype))
    comp = ModelCompressor.from_pretrained_model(root)
    comp.compress_model(root)
    quantized = {k: v.detach().contiguous() for k, v in root.state_dict().items()}
    out_sd = {n: t for n, t in sd.items() if n[: -len(".weight")] not in _linear_weights(sd) or n in quantized}
    out_sd.update(quantized)
    save_file({k: out_sd[k] for k in sorted(out_sd)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if (base / f).is_file():
            shutil.copy(base / f, d / f)
    comp.update_config(str(d))
    cfg = json.loads((d / "config.json").read_text())
    if tmp is not None:
        tmp.cleanup()
    doc = {
        "name": name,
        "family": cfg.get("model_type"),
        "base_fixture": spec.get("base"),  # None: the base model was built here (base_model)
        **({"base_model": {"seed": SEED, "AutoConfig.for_model": {"model_type": model_spec["model_type"], **{**COMMON, **model_spec["config"]}},
                           "dtype": model_spec["dtype"]}} if model_spec is not None else {}),
        "command": "python tools/make_fixtures.py " + " ".join(argv),
        "versions": {**versions(), "compressed_tensors": compressed_tensors.__version__},
        "generation": {
            "steps": [
                (f"every 2-D Linear weight of fixtures/{spec['base']}" if spec.get("base") else
                 f"every 2-D Linear weight of the base_model (build_model + save_pretrained, seed {SEED})")
                + " (not embeddings, norms) as an nn.Linear",
                f"apply_quantization_config(root, QuantizationConfig(config_groups={{'group_0': "
                f"preset_name_to_scheme({spec['preset']!r}, {[spec['only']] if spec.get('only') else ['Linear']!r})"
                f"{' with weights ' + repr(spec['weights']) if spec.get('weights') else ''}}}, ignore={spec['ignore']!r}))",
                "weight_scale, weight_zero_point = calculate_qparams(min(w, 0), max(w, 0)) per output channel"
                " (per group of columns for strategy group)",
                "ModelCompressor.from_pretrained_model(root).compress_model(root); save_file(state dict + the "
                "base's other tensors, sorted); ModelCompressor.update_config(dir)",
            ]
        },
        "quantization_config": cfg.get("quantization_config"),
        "files": {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in sorted(d.iterdir())},
        "tensors": read_tensors(d),
    }
    (d / "FIXTURE.json").write_text(json.dumps(doc, indent=1) + "\n")
    return d


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO_ROOT / "fixtures"))
    ap.add_argument("--only", nargs="*", choices=sorted(FIXTURES) + sorted(QUANTIZED), help="regenerate only these fixtures")
    args = ap.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    global SEED
    SEED = args.seed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec_argv = ["--seed", str(args.seed)]
    for name in args.only or list(FIXTURES) + list(QUANTIZED):
        if name in QUANTIZED:  # after its dense base (compressed-tensors must be installed)
            d = write_quantized_fixture(name, QUANTIZED[name], out, rec_argv + ["--only", name])
        else:
            d = write_fixture(name, FIXTURES[name], args.seed, out, rec_argv)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{name:18s} {size / 1024:8.1f} KiB  {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
