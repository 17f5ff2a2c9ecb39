"""``MoepackConfig`` (vLLM's ``quantization="moepack"``) and ``MoepackMoEMethod``, its experts.

What runs where (docs/VLLM.md): vLLM builds the model from the carried config.json and loads
every carried tensor (attention, norms, embeddings, routers, shared experts, dense MLPs) from
the directory's ``model-*.safetensors`` with its own loader, sharded for tensor parallel as
usual. The packed expert tensors (``moepack.layers.<L>.<role>`` in ``experts-*.safetensors``)
are dropped from vLLM's weight stream by name; each MoE layer instead takes its experts from
``moepack.open(DIR)``: views of the memory-mapped shards, never copied, never repacked
(``process_weights_after_loading`` only attaches them). vLLM routes (its router, its grouped /
biased top-k) and hands ``apply`` fp32 weights and int32 ids; ``apply`` runs
``torch.ops.moepack.fused_experts`` on them and returns the layer's partial sum, which vLLM
all-reduces across tensor-parallel ranks and adds to its shared experts' output (vLLM runs
those before ``apply``; ``apply`` never sees them run). Routed scaling is vLLM's too: folded
into the weights, or (DeepSeek on CPU, ``apply_routed_scale_to_output``) applied by vLLM's MoE
runner to what ``apply`` returns.

Tensor parallel: a ``convert --tp N`` pack holds each rank's slice of every expert contiguously
(moepack/tp.py); rank r of an engine with ``tensor_parallel_size=N`` maps only its rows, and the
sum over ranks is the layer output. Such a pack refuses any other N. A pack without ``--tp``
serves any N: rank r runs the experts ``[r*E/N, (r+1)*E/N)`` whole (an ``expert_map`` sends every
other id to -1), no expert sliced or copied, a rank touching only its experts' pages."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from ...errors import PackedDirError, UnsupportedError
from ...manifest import MANIFEST
from . import QUANT_NAME

# model_type -> the vLLM architecture the plugin was tested with (tests/integrations/test_vllm_plugin.py):
# the carried tensors must be what vLLM's model of that family loads, and its MoE layers
# RoutedExperts whose routing equals the pack's.
SUPPORTED_FAMILIES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh", "swigluoai": "swigluoai"}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class MoepackConfig(QuantizationConfig):
    """A packed directory as a vLLM quantization config: MoE layers get ``MoepackMoEMethod``;
    every other layer vLLM's unquantized method where the carried weights are float, or, where
    the source stored its non-expert linears quantized (carried as they are), the method vLLM's
    own config for that source gives it (``inner``: see ``inner_config``)."""

    def __init__(self, config: dict | None = None):
        self.inner: QuantizationConfig | None = None  # set before the base __init__ assigns packed_modules_mapping
        super().__init__()
        self.given = dict(config or {})
        self.path: Path | None = None
        self.manifest: dict | None = None
        self._packed = None  # this process's moepack.open(path): never pickled to workers

    # vLLM assigns (or updates in place) the model's fused-module names here at model build time;
    # the inner config matches its ignore lists and per-layer schemes against the same mapping
    @property
    def packed_modules_mapping(self) -> dict:
        return self._pmm

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value: dict) -> None:
        self._pmm = value
        if self.inner is not None:
            self.inner.packed_modules_mapping = value

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_packed"] = None
        return state

    def __repr__(self) -> str:
        return f"MoepackConfig({str(self.path) if self.path else '?'})"

    def get_name(self):
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # CPU: the platform reports no capability, so vLLM never asks

    @staticmethod
    def get_config_filenames() -> list[str]:
        # `quantization="moepack"` on a directory whose config.json has no quantization_config:
        # vLLM reads the directory's moepack.json and hands it to from_config
        return [MANIFEST]

    @classmethod
    def from_config(cls, config: dict) -> "MoepackConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # a pack carries its source's config.json unchanged: a quantized source's
        # quantization_config is there. `--quantization moepack` claims it, and
        # maybe_update_config then says what the plugin can and cannot serve.
        return "moepack" if user_quant == "moepack" else None

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None):
        """Where vLLM says which directory it loads: read and check its manifest here, in the
        engine process, so a bad setup fails before any worker starts."""
        self.path = Path(model_name)
        if not (self.path / MANIFEST).is_file():
            raise PackedDirError(f"{model_name}: quantization='moepack' needs a moepack packed directory "
                                 f"(a local directory with {MANIFEST}; make one with `moepack convert SRC DST`)")  # fmt: skip
        from ...runtime import open_packed
        from . import pages

        pages.mode()  # a bad MOEPACK_VLLM_PAGES is refused here, before any worker starts
        pm = open_packed(self.path)  # validates the manifest, every header and layout (mmap, no read)
        self.manifest = pm.manifest
        check_family(pm.manifest, str(self.path))
        del pm
        qc = ((self.manifest.get("model") or {}).get("config") or {}).get("quantization_config")
        if quantized_carried(self.manifest):  # check_family let it through: a format delegated to vLLM
            given = self.given if self.given.get("quant_method") else dict(qc)  # vLLM's copy (it adds head counts)
            self.inner = inner_config(given, hf_config, str(self.path))
            self.inner.packed_modules_mapping = self._pmm
            self.inner.maybe_update_config(model_name, hf_config=hf_config, revision=revision)

    def _check_inner_dtype(self) -> None:
        """vLLM checks the model dtype against ``get_supported_act_dtypes`` before the inner config
        exists; the inner config's own list (GPTQ / AWQ: fp16 and bf16) is held here, once."""
        if getattr(self, "_dtype_checked", False):
            return
        from vllm.config import get_current_vllm_config

        dtype = getattr(getattr(get_current_vllm_config(), "model_config", None), "dtype", None)
        ok = self.inner.get_supported_act_dtypes()
        if dtype is not None and dtype not in ok:
            raise UnsupportedError(f"{self.path}: dtype={dtype}: vLLM's {self.inner.get_name()!r} method for the "
                                   f"source's quantized non-expert linears runs {', '.join(map(str, ok))} only")  # fmt: skip
        self._dtype_checked = True

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        if self.inner is not None:
            self.inner.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_cache_scale_mapper(self):
        return (self.inner or QuantizationConfig).get_cache_scale_mapper()

    def packed(self):
        """This process's ``moepack.open`` of the directory (one per worker; mapped, not read)."""
        if self._packed is None:
            if self.path is None:
                raise UnsupportedError("quantization='moepack': vLLM did not say which directory it loads "
                                       "(maybe_update_config was not called)")  # fmt: skip
            from ...runtime import open_packed
            from . import pages

            if pages.mode() in ("reload", "populate"):  # cached small folios out, read back as 2 MiB ones
                pages.drop_cached(sorted(self.path.glob("experts-*.safetensors")))
            self._packed = open_packed(self.path)
        return self._packed

    def get_checkpoint_weight_mapper(self):
        """vLLM's weight stream without the packed expert tensors (the MoE layers take those from
        ``moepack.open``: mapped views) and without the shards' alignment fillers ``__pad__.<i>``
        (docs/PACKED_FORMAT.md §2); the carried tensors load as vLLM loads any checkpoint."""
        from vllm.model_executor.models.utils import WeightsMapper

        return (self.inner or QuantizationConfig).get_checkpoint_weight_mapper() | WeightsMapper(
            orig_to_new_prefix={"moepack.": None, "__pad__.": None})

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        if isinstance(layer, RoutedExperts):
            return MoepackMoEMethod(layer.moe_config, self, self.layer_entry(prefix))
        if self.inner is not None:  # quantized carried linears: vLLM's own method for the source's format
            self._check_inner_dtype()
            if not getattr(self, "_kernels_checked", False):
                check_inner_kernels(self.manifest, str(self.path))
                self._kernels_checked = True
            return self.inner.get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def layer_entry(self, prefix: str) -> dict:
        """The manifest's layer of vLLM's MoE module ``prefix`` (``model.layers.3.mlp.experts``):
        the layer whose source prefix it extends, else the one with its layer number."""
        layers = (self.manifest or {}).get("layers") or []
        for e in layers:
            if prefix.startswith(e["prefix"] + "."):
                return e
        m = _LAYER_RE.search(prefix)
        if m:
            for e in layers:
                if int(e["index"]) == int(m.group(1)):
                    return e
        raise UnsupportedError(f"{self.path}: vLLM's MoE layer {prefix!r} has no packed layer in {MANIFEST} "
                               f"(packed: {', '.join(e['prefix'] for e in layers) or 'none'})")  # fmt: skip


def check_family(manifest: dict, where: str) -> None:
    """Refuse, in one line, a pack the plugin cannot serve: a family it was not tested with, or
    non-expert linears its source stored quantized (carried as they are) in a format whose
    vLLM CPU linear method the plugin does not hand them to (``DELEGATED``)."""
    cfg = (manifest.get("model") or {}).get("config") or {}
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_FAMILIES:
        raise UnsupportedError(f"{where}: model_type={mt!r}: the moepack vLLM plugin supports "
                               f"{', '.join(sorted(SUPPORTED_FAMILIES))}")  # fmt: skip
    qc = cfg.get("quantization_config")
    quantized = quantized_carried(manifest)
    if qc and not manifest.get("tensors"):
        raise UnsupportedError(f"{where}: {MANIFEST} lists no carried tensors, so whether the source's quantized "
                               "non-expert linears are float cannot be told; re-convert it with this moepack")  # fmt: skip
    if isinstance(qc, dict) and qc.get("kv_cache_scheme"):
        raise UnsupportedError(f"{where}: the source's quantization_config sets kv_cache_scheme="
                               f"{qc['kv_cache_scheme']!r} (a quantized KV cache with its scales): the moepack vLLM "
                               "plugin does not pass it to vLLM's attention, which would run the KV cache unquantized "
                               "and drop the scales; serve it with moepack.load_model")  # fmt: skip
    if not quantized:
        return
    qm = qc.get("quant_method") if isinstance(qc, dict) else qc
    why = delegated_format(qc if isinstance(qc, dict) else {})
    if why is not None:
        raise UnsupportedError(f"{where}: the source stores its non-expert linears quantized (quant_method={qm!r}, "
                               f"carried: {quantized[0]}): {why}")  # fmt: skip


# The source formats whose quantized non-expert linears the plugin hands to vLLM's own CPU linear
# method, each run end to end by tests/integrations/test_vllm_plugin.py: compressed-tensors W8A8 (8-bit int
# weights and activations, symmetric, the activations dynamic per token: vLLM's oneDNN scaled
# matmul) and W4A16 (4-bit int weights in groups, symmetric or with zero points), GPTQ (4-bit,
# symmetric, no act-order) and AWQ (4-bit GEMM, zero points): the last three on vLLM's CPUWNA16
# kernel, which on an AMX (or RISC-V) host with bf16 activations quantizes the activations to
# int8 per token (W4A8) unless VLLM_CPU_INT4_W4A8=0, as it does for the checkpoint itself.
DELEGATED = ("compressed-tensors W8A8 (int-quantized, dynamic per-token int8 activations)",
             "compressed-tensors W4A16 (pack-quantized)", "GPTQ (4-bit, sym, desc_act false)",
             "AWQ (4-bit GEMM with zero points)")  # fmt: skip
_REFUSED_TAIL = ("serve a pack of a source whose non-expert linears are float, or run this pack with "
                 "moepack.load_model (it dequantizes them)")  # fmt: skip


def _ct_scheme(group: dict) -> str | None:
    """None where vLLM's CPU path runs a compressed-tensors config group as delegated; else its
    scheme in words."""
    w = group.get("weights") or {}
    a = group.get("input_activations")
    fmt = group.get("format")
    bits, wtype, sym = w.get("num_bits"), w.get("type"), w.get("symmetric")
    if wtype == "int" and bits == 8 and a and a.get("type") == "int" and a.get("num_bits") == 8 and a.get("dynamic") \
            and a.get("strategy") == "token" and a.get("symmetric", True) and sym is not False \
            and fmt in (None, "int-quantized"):
        return None
    if wtype == "int" and bits == 4 and not a and fmt in (None, "pack-quantized"):
        return None
    acts = f"A{a.get('num_bits')}" if a else "A16"
    return f"W{bits}{acts} {wtype} weights, format {fmt!r}{'' if sym or sym is None else ', asymmetric'}"


def _int4_scheme(qc: dict) -> str | None:
    """The same for a GPTQ or AWQ quantization_config."""
    qm = qc.get("quant_method")
    bits = qc.get("bits", qc.get("w_bit"))
    if qm == "gptq":
        if qc.get("dynamic"):  # per-module overrides (bits, sym, desc_act) vLLM would apply layer by layer
            return f"per-module 'dynamic' overrides {sorted(qc['dynamic'])!r} (not run through vLLM's CPU path here)"
        if bits == 4 and qc.get("sym", True) and not qc.get("desc_act"):
            return None
        # vLLM 0.32 itself refuses desc_act=True ("no longer supported") and sym=False GPTQ
        return (f"bits={bits}, sym={qc.get('sym', True)}, desc_act={bool(qc.get('desc_act'))} "
                "(vLLM 0.32 runs 4-bit sym GPTQ without act-order only)")  # fmt: skip
    version = str(qc.get("version", "gemm")).lower()
    if bits == 4 and qc.get("zero_point", True) and version == "gemm":
        return None
    return f"bits={bits}, zero_point={qc.get('zero_point', True)}, version={version!r}"


def delegated_format(qc: dict) -> str | None:
    """None where the source's quantized non-expert linears go to vLLM's own method (DELEGATED);
    else why not, in words."""
    qm = str(qc.get("quant_method") or "")
    served = ("the moepack vLLM plugin hands quantized non-expert linears to vLLM's own CPU method for "
              f"{', '.join(DELEGATED)} only")  # fmt: skip
    if qm in ("gptq", "awq"):
        why = _int4_scheme(qc)
        return None if why is None else f"{qm} with {why}; {served}; {_REFUSED_TAIL}"
    if qm != "compressed-tensors":
        return f"{served}; {_REFUSED_TAIL}"
    groups = qc.get("config_groups") or {}
    if not groups:
        return f"its quantization_config has no config_groups; {served}; {_REFUSED_TAIL}"
    for name, g in groups.items():
        g = {**g, "format": g.get("format") or qc.get("format")}
        why = _ct_scheme(g)
        if why is not None:
            return f"config group {name!r} is {why}; {served}; {_REFUSED_TAIL}"
    return None


def inner_config(qc: dict, hf_config, where: str) -> QuantizationConfig:
    """vLLM's own quantization config for the source's ``quantization_config``, as vLLM would
    choose it for that checkpoint: its ``ModelConfig`` rule (each override method asked in vLLM's
    order of preference, then the source's quant_method), then that class's ``from_config``."""
    from types import SimpleNamespace

    from vllm.config.model import ModelConfig
    from vllm.model_executor.layers.quantization import get_quantization_config

    probe = SimpleNamespace(quantization=None, model_arch_config=SimpleNamespace(quantization_config=qc),
                            hf_config=hf_config, allow_deprecated_quantization=False)  # fmt: skip
    try:
        ModelConfig._verify_quantization(probe)
    except Exception as e:
        raise UnsupportedError(f"{where}: vLLM has no quantization method for the source's non-expert linears "
                               f"(quant_method={qc.get('quant_method')!r}): {e}") from e  # fmt: skip
    name = probe.quantization or qc.get("quant_method")
    if name == QUANT_NAME:  # cannot happen with user_quant None; never delegate to ourselves
        raise UnsupportedError(f"{where}: the source's quantization_config names quant_method={name!r}")
    try:
        return get_quantization_config(name).from_config(dict(qc))
    except Exception as e:  # e.g. a GPTQ config without "sym", an AWQ one without "zero_point"
        raise UnsupportedError(f"{where}: vLLM's {name!r} config does not accept the source's quantization_config "
                               f"for its non-expert linears: {e}") from e  # fmt: skip


def check_routing(layer, model: dict, where: str) -> None:
    """vLLM routes; the pack's model config says how its family routes. For plain softmax top-k
    families (mixtral, qwen3_moe, olmoe) the two must agree on top_k and on renormalizing the
    chosen weights (``norm_topk_prob``): vLLM builds OLMoE's layer with renormalize=False
    whatever the config says, so an OLMoE checkpoint with norm_topk_prob=true would be served
    with other weights than moepack.load_model and transformers give it. Refused, naming both."""
    from ...routing import RoutingConfig

    try:
        rc = RoutingConfig.from_hf_config(model.get("config") or {})
    except Exception:  # a family whose routing moepack does not model: nothing to hold vLLM's against
        return
    if rc.method != "softmax":
        return
    for k, want in (("top_k", int(rc.top_k)), ("renormalize", bool(rc.renormalize))):
        got = getattr(layer, k, None)
        if got is not None and (int(got) if k == "top_k" else bool(got)) != want:
            raise UnsupportedError(f"{where}: the pack's routing has {k}={want} (model config: num_experts_per_tok, "
                                   f"norm_topk_prob), vLLM built the layer with {k}={got}: its tokens would not be "
                                   "this model's")  # fmt: skip


def check_engine(model: dict, settings, where: str) -> None:
    """vLLM 0.32's CPU path computes DeepSeek-V3 (MLA attention) wrongly in two settings, with
    its own experts as with the plugin's (docs/VLLM.md "DeepSeek-V3"); refused there, naming
    the setting and the one that gives the model's tokens:

    - its C++ ``rotary_embedding`` op (custom op on, the eager default) rotates the MLA query's
      rope part wrongly when there is more than one head (a 3-D ``[tokens, heads, 64]`` view)
      and the key's (a view into the latent projection), so every position after the first
      attends with wrong scores. Plain RoPE (rope_type "default") only: vLLM builds YaRN-scaled
      DeepSeek RoPE with its own class, which runs torch code on CPU.
    - its compiled graph (enforce_eager False, the default) gives different tokens from run to
      run on the same engine settings (NaN logits among them).

    ``settings()`` gives (compiled, rope_op, rope_type) of the engine (``engine_settings``;
    rope_type: the one vLLM builds the model with, None when it cannot be read, and then the
    pack's model config decides); asked only for this family."""
    cfg = model.get("config") or {}
    if cfg.get("model_type") != "deepseek_v3":
        return
    compiled, rope_op, rope_type = settings()
    if rope_type is None:  # the source's config.json as the pack recorded it: the first key naming one
        for key in ("rope_parameters", "rope_scaling"):
            rp = cfg.get(key) or {}
            rope_type = rp.get("rope_type") or rp.get("type")
            if rope_type:
                break
    plain = rope_type in (None, "default")
    if compiled:
        also = (" and with torch RoPE, compilation_config={'custom_ops': ['all', '-rotary_embedding']} (plain RoPE: "
                "vLLM's C++ rotary_embedding op, on in eager mode, rotates the MLA query wrongly)") if plain else ""
        raise UnsupportedError(f"{where}: model_type='deepseek_v3' under vLLM's compiled CPU graph (enforce_eager=False): "
                               "vLLM 0.32 gives run-to-run different tokens there, with its own experts too; serve it "
                               f"with enforce_eager=True (--enforce-eager){also}")  # fmt: skip
    if rope_op and plain:
        raise UnsupportedError(f"{where}: model_type='deepseek_v3' with plain RoPE and vLLM's C++ rotary_embedding op "
                               "(custom op on): vLLM 0.32's CPU kernel rotates the MLA query of more than one head "
                               "wrongly; serve it with compilation_config={'custom_ops': ['all', '-rotary_embedding']} "
                               "(torch RoPE)")  # fmt: skip


def vllm_has_op(name: str) -> bool:
    """Whether the vLLM kernel library loaded for this CPU registers ``torch.ops._C.<name>``
    (vLLM 0.32's CPU wheel loads an AVX-512 or an AVX2 library; the AVX2 one has fewer ops)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernel library for this CPU)

    return hasattr(torch.ops._C, name)


def vllm_has_shm_communicator() -> bool:
    """Whether this CPU's vLLM kernel library has its shared-memory communicator (vLLM's CPU
    communicator uses it for tensor parallel all-reduces when ``init_shm_manager`` exists, else
    torch.distributed). vLLM 0.32's CPU wheel builds it into its AVX-512 libraries only."""
    return vllm_has_op("init_shm_manager")


def check_tensor_parallel(tp: int, settings, where: str, has_shm=vllm_has_shm_communicator) -> None:
    """vLLM 0.32 under tensor parallel, its compiled CPU graph and no shared-memory communicator
    (an AVX2-only CPU: AMD EPYC Zen 3, Intel before Skylake-SP) computes wrong tokens, with its
    own experts too: on a Zen 3 its own engine's TP=2 greedy tokens left TP=1's at the second
    decode step, where TP=1's logits rank their token 1.8 above (no near-tie); eager TP=2 equals
    TP=1 up to a near-tie. Refused there, naming the setting that works (docs/VLLM.md)."""
    if tp <= 1 or has_shm():
        return
    compiled, _, _ = settings()
    if compiled:
        raise UnsupportedError(f"{where}: tensor_parallel_size={tp} under vLLM's compiled CPU graph (enforce_eager=False) "
                               "without vLLM's shared-memory communicator (this CPU's vLLM library has no "
                               "init_shm_manager: no AVX-512): vLLM 0.32 computes wrong tokens there, with its own "
                               "experts too; serve it with enforce_eager=True (--enforce-eager)")  # fmt: skip


def engine_settings() -> tuple[bool, bool, str | None]:
    """(compiled, rope_op, rope_type) of the vLLM engine being built: whether it compiles the
    model graph, whether its RotaryEmbedding runs vLLM's C++ op, and the RoPE type of the model
    config vLLM builds from (after its ``hf_overrides``; DeepSeek's attention, built before the
    MoE layer, has renamed a non-default type "deepseek_yarn" by then). Read while vLLM builds
    the model (its config is current then)."""
    from vllm.config import CompilationMode, get_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    vcfg = get_current_vllm_config()
    hf = getattr(getattr(vcfg, "model_config", None), "hf_config", None)
    rp = getattr(hf, "rope_parameters", None) or {}
    rope_type = rp.get("rope_type") if isinstance(rp, dict) else None
    return vcfg.compilation_config.mode != CompilationMode.NONE, bool(RotaryEmbedding.enabled()), rope_type


_FLOAT = {"bfloat16", "float16", "float32", "float64"}
# tensor names quantized formats store next to (or instead of) a Linear's float weight
_QUANT_SUFFIX = re.compile(r"\.(weight_packed|weight_scale|weight_zero_point|weight_shape|weight_g_idx|input_scale|"
                           r"qweight|qzeros|scales|g_idx|weight_scale_inv|weight_global_scale)$")


# 4-bit packed carried weights (compressed-tensors pack-quantized, GPTQ, AWQ): vLLM's CPUWNA16 kernel
_PACKED_4BIT = re.compile(r"\.(weight_packed|qweight)$")


def check_inner_kernels(manifest: dict, where: str) -> None:
    """vLLM runs the carried 4-bit linears on its CPUWNA16 kernel, whose ops (``cpu_gemm_wna16``;
    ``int4_scaled_mm_cpu`` on AMX) vLLM 0.32's CPU wheel builds into its AVX-512 library only:
    on an AVX2-only CPU (AMD Zen 3, Intel before Skylake-SP) it loads ``_C_AVX2``, which has
    neither, and the engine would fail at its first forward pass with an AttributeError inside
    torch.compile. Refused when the model is built (after the dtype check), naming the tensor and the op."""
    packed = [n for n, e in (manifest.get("tensors") or {}).items()
              if not n.startswith("moepack.") and _PACKED_4BIT.search(n)]  # fmt: skip
    if packed and not vllm_has_op("cpu_gemm_wna16"):
        raise UnsupportedError(
            f"{where}: the source's 4-bit non-expert linears ({sorted(packed)[0]} and {len(packed) - 1} more) are run by "
            "vLLM's CPUWNA16 kernel, and this vLLM build has no cpu_gemm_wna16 op on this CPU (vLLM's CPU wheel loads "
            "its AVX2 library here, which lacks it; it needs AVX-512): moepack.load_model serves this pack")


def quantized_carried(manifest: dict) -> list[str]:
    """The carried (non-expert) tensors a quantized format stored: a non-float dtype or a
    quantization tensor's name, as ``name (dtype)``. Empty where a quantized source quantized
    its experts only (e.g. a compressed-tensors checkpoint whose recipe ignored attention): the
    plugin serves that pack (its experts are moepack's, the rest float)."""
    out = []
    for name, e in (manifest.get("tensors") or {}).items():
        if name.startswith("moepack.") or name.startswith("__pad__."):
            continue
        if e.get("dtype") not in _FLOAT or _QUANT_SUFFIX.search(name):
            out.append(f"{name} ({e.get('dtype')})")
    return out


class MoepackMoEMethod(FusedMoEMethodBase):
    """One MoE layer's experts from the packed directory (see the module docstring)."""

    def __init__(self, moe, qcfg: MoepackConfig, entry: dict):
        super().__init__(moe)
        self.qcfg = qcfg
        self.entry = entry
        self.index = int(entry["index"])
        self.roles13: list[str] = []
        self.roles2: list[str] = []
        self.layout_id = int(entry["layout_id"])
        self.interleaved = bool(entry["interleaved"])
        self.activation = _ACTIVATIONS[entry["activation"]]
        self.alpha = float(entry.get("alpha", 1.702))
        self.limit = float(entry.get("limit", 7.0))
        self.act_mode = ""
        self.has_bias = (False, False)
        self.has_perm = False
        self.has_map = False

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):  # fmt: skip
        """No parameters: the experts are the pack's mapped tensors, attached after loading.
        Here only the shapes vLLM built the layer for are held against the pack's."""
        e = self.entry
        moe = self.moe
        where = f"{self.qcfg.path}: layer {self.index} ({e['prefix']})"
        if moe.use_ep:
            raise UnsupportedError(f"{where}: expert parallel (enable_expert_parallel) is not supported by the moepack "
                                   "vLLM plugin; tensor parallel is (a --tp pack: each rank its slice of every expert; else whole experts per rank)")  # fmt: skip
        pack_tp = int(e.get("tp", 1))
        if pack_tp > 1 and int(moe.tp_size) != pack_tp:
            raise UnsupportedError(f"{self.qcfg.path}: the pack was converted with --tp {pack_tp} (each rank's slice of "
                                   f"every expert); vLLM runs tensor_parallel_size={int(moe.tp_size)}: serve it with "
                                   f"tensor_parallel_size={pack_tp}, or convert without --tp (serves any size)")  # fmt: skip
        total = int(layer.global_num_experts)
        got = {"num_experts": total, "hidden": int(hidden_size), "intermediate": int(moe.intermediate_size)}
        for k, v in got.items():
            if int(e[k]) != v:
                raise UnsupportedError(f"{where}: {k}={e[k]} in {MANIFEST}, vLLM built the layer with {k}={v}: "
                                       "the pack is not this model's")  # fmt: skip
        act = getattr(layer.activation, "value", str(layer.activation))
        if act != self.activation:
            raise UnsupportedError(f"{where}: activation {self.activation!r} in {MANIFEST}, vLLM's layer has {act!r}")
        for key, what in (("silu_limit", "a clamped SwiGLU"), ("hash", "routing by token id"), ("post_norm", "a norm after the block"),
                          ("identity_experts", "zero-computation experts"), ("out_bias", "a bias added to the block's output")):  # fmt: skip
            v = e.get(key) if key != "hash" else (e.get("router") or {}).get(key)
            if v:  # DeepSeek-V4's (format version 6): vLLM's layer would run without it
                raise UnsupportedError(f"{where}: {key}={v!r} in {MANIFEST} ({what}): the moepack vLLM plugin does not run it")
        model = (self.qcfg.manifest or {}).get("model") or {}
        check_routing(layer, model, where)
        check_engine(model, engine_settings, str(self.qcfg.path))
        check_tensor_parallel(int(moe.tp_size), engine_settings, str(self.qcfg.path))

    def get_fused_moe_quant_config(self, layer):
        return FUSED_MOE_UNQUANTIZED_CONFIG

    def process_weights_after_loading(self, layer) -> None:
        """Attach the layer's packed tensors (views of the mapped shards) as non-persistent
        buffers: no copy, no packing. Under ``MOEPACK_STRICT`` a host without the layout's
        best kernel is refused here."""
        from ..._ops import load_extension
        from ...runtime.experts import resolve_act_mode

        load_extension()
        pl = self.qcfg.packed().layers[self.index]
        pl.check_strict()
        packed = pl.packed
        tp, rank = int(self.moe.tp_size), int(self.moe.tp_rank)
        sliced = packed.tp > 1
        if sliced:  # a --tp pack: this rank's slice of every expert, views of its own rows only
            from ...tp import rank_experts

            packed = rank_experts(packed, rank)
        lay = packed.layout
        self.roles13 = list(lay.tensor_names("w13"))
        self.roles2 = list(lay.tensor_names("w2"))
        for role, t in packed.tensors.items():
            layer.register_buffer(f"moepack_{role}", t, persistent=False)
        self.has_bias = ("w13_bias" in packed.tensors, "w2_bias" in packed.tensors)
        self.has_perm = "w13_perm" in packed.tensors
        self.act_mode = resolve_act_mode(lay, None, packed.act_mode)
        self.has_map = tp > 1 and not sliced
        if self.has_map:  # a pack without --tp: rank r runs experts [r*E/tp, (r+1)*E/tp) whole
            n = packed.num_experts
            lo, hi = rank * n // tp, (rank + 1) * n // tp
            emap = torch.full((n,), -1, dtype=torch.int32)
            emap[lo:hi] = torch.arange(lo, hi, dtype=torch.int32)
            layer.register_buffer("moepack_expert_map", emap, persistent=False)
        from . import pages

        # 2 MiB mappings of this rank's bytes only: a --tp pack's views are its slice already; a
        # whole pack under expert_map advises (and under `populate` reads) experts [lo, hi) alone
        mine = packed.tensors.values()
        if self.has_map:
            mine = [t[lo:hi] if t.dim() and t.shape[0] == n else t for t in mine]
        pages.advise(mine, pages.mode())

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        """The routed experts' part of the layer output (this rank's partial sum under tensor
        parallel; vLLM all-reduces it and adds the shared experts)."""
        if layer.apply_router_weight_on_input:  # top-1 models (Llama-4): weight the input, not the output
            x = x * topk_weights.to(x.dtype)
            topk_weights = torch.ones_like(topk_weights)
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        # the native op straight into vLLM's compiled graph: its Meta kernel keeps the token count
        # symbolic (csrc/torch/op_fused_experts.inc), so Dynamo traces it without specializing the
        # batch size, and Inductor calls it as an extern kernel
        return torch.ops.moepack.fused_experts(
            x,
            [getattr(layer, f"moepack_{r}") for r in self.roles13],
            [getattr(layer, f"moepack_{r}") for r in self.roles2],
            topk_weights.float(),
            topk_ids,
            self.layout_id,
            interleaved=self.interleaved,
            activation=self.activation,
            alpha=self.alpha,
            limit=self.limit,
            w13_bias=layer.moepack_w13_bias if self.has_bias[0] else None,
            w2_bias=layer.moepack_w2_bias if self.has_bias[1] else None,
            expert_map=layer.moepack_expert_map if self.has_map else None,
            act_mode=self.act_mode,
            w13_perm=layer.moepack_w13_perm if self.has_perm else None,
        )

