"""The ``moepack`` config registered on an unsupported vLLM: every use refuses in one line."""

from __future__ import annotations

from ...errors import UnsupportedError


def refusing_config(problem: str):
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class MoepackUnsupportedVllm(QuantizationConfig):
        def get_name(self):
            return "moepack"

        def get_supported_act_dtypes(self):
            raise UnsupportedError(problem)

        @classmethod
        def get_min_capability(cls):
            return 0

        @staticmethod
        def get_config_filenames():
            return ["moepack.json"]

        @classmethod
        def from_config(cls, config):
            raise UnsupportedError(problem)

        def get_quant_method(self, layer, prefix):
            raise UnsupportedError(problem)

    return MoepackUnsupportedVllm
