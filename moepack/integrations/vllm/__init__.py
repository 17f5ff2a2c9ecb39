"""The vLLM plugin: ``vllm serve PACKED_DIR --quantization moepack`` runs a packed directory's
experts with moepack's kernels and everything else with vLLM's own code (docs/VLLM.md).

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it once in every process it
starts (the engine, every spawned worker), so it is idempotent; it imports nothing heavy until a
model asks for ``quantization="moepack"``."""

from __future__ import annotations

import logging

from .version import SUPPORTED_VLLM, check_vllm_version

QUANT_NAME = "moepack"

_registered = False
_log = logging.getLogger(__name__)


def register() -> None:
    """Register the ``moepack`` quantization config with vLLM (once per process).

    A vLLM outside ``SUPPORTED_VLLM`` still gets a ``moepack`` config, one whose every use fails
    with the one-line version error (rather than vLLM's "unknown quantization method", or an
    AttributeError deep inside a vLLM whose internals moved)."""
    global _registered
    if _registered:
        return
    import vllm
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    problem = check_vllm_version(vllm.__version__, raise_error=False)
    if problem is not None:
        from .refuse import refusing_config

        cls = refusing_config(problem)
        _log.warning("moepack: %s", problem)
    else:
        from .config import MoepackConfig as cls
    if QUANT_NAME not in QUANTIZATION_METHODS or _current(QUANT_NAME) is not cls:
        register_quantization_config(QUANT_NAME)(cls)
    _registered = True


def _current(name: str):
    from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG

    return _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(name)


__all__ = ["register", "QUANT_NAME", "SUPPORTED_VLLM", "check_vllm_version"]
