"""moepack inside other engines. ``moepack.integrations.vllm``: the vLLM plugin (docs/VLLM.md).

Nothing here is imported by ``import moepack``: an integration imports its engine."""
