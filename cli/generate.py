"""``moepack generate``: greedy generation with the whole transformers model of a packed directory.

The model comes from ``moepack.load_model`` (the directory alone: its config.json, the non-expert
tensors and the packed experts, all from the memory map). The report gives the tokens, tokens/s
and the share of the time spent in the packed MoE blocks.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from .app import command, console, err_console

_DTYPES = ("bfloat16", "float16", "float32")


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integer token ids, e.g. 1,2,3") from None
    if not ids:
        raise ValueError(f"--prompt-ids {text!r}: expected at least one token id")
    return ids


def _load_facts(model) -> dict:
    r = model.moepack_load
    return {"dequantized_linears": len(r.dequantized), "dequantized_codecs": sorted(set(r.dequantized.values())),
            "quantized_bytes": r.quantized_bytes, "dequantized_bytes": r.dequantized_bytes, "mtp_layers_not_run": r.mtp_layers,
            "mtp_tensors_unused": r.mtp_tensors, "source_tensors_skipped_by_convert": r.convert_skipped}  # fmt: skip


@command(help="Greedy generation with the transformers model of a packed directory (needs transformers): "
              "prints the tokens, tokens/s and the share of time in the MoE layers.")  # fmt: skip
def generate(
    path: str = typer.Argument(..., help="The packed directory (from `moepack convert`)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="The prompt as comma-separated token ids, e.g. 1,2,3."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The prompt as text (the directory must carry a tokenizer that loads offline)."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="How many tokens to generate (exactly that many: no stop at eos)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=f"Activation dtype of the model ({', '.join(_DTYPES)}; default: config.json's)."),
    strict: bool = typer.Option(False, "--strict", help="Refuse a layer whose kernel is a fallback (as MOEPACK_STRICT=1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    import torch

    from moepack.hf import greedy_generate, load_model, load_tokenizer

    if (prompt_ids is None) == (prompt is None):
        raise ValueError("give the prompt as either --prompt-ids 1,2,3 or --prompt TEXT (one of them)")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: must be one of {', '.join(_DTYPES)}")
    tok = None
    if prompt is not None:
        tok = load_tokenizer(path)
        ids = list(tok(prompt)["input_ids"])
    else:
        ids = _ids(prompt_ids)
    t0 = time.perf_counter()
    model = load_model(path, dtype=getattr(torch, dtype) if dtype else None, strict=strict)
    load_s = time.perf_counter() - t0
    gen = greedy_generate(model, ids, max_new_tokens)
    from moepack import variants

    hint = None if as_json else variants.untuned_hint()  # after the run: a refusal stays one line; --json: JSON only
    if hint:
        err_console.print(f"[yellow]note:[/] {hint}", highlight=False, soft_wrap=True)
    result = {
        "path": str(path),
        "model_type": model.config.model_type,
        "dtype": str(model.dtype).replace("torch.", ""),
        "prompt_ids": ids,
        "tokens": gen.tokens,
        "text": tok.decode(gen.tokens) if tok is not None else None,
        "load_seconds": round(load_s, 4),
        "seconds": round(gen.seconds, 4),
        "tokens_per_second": round(gen.tokens_per_second, 3),
        "moe_seconds": round(gen.moe_seconds, 4),
        "moe_share": round(gen.moe_share, 4),
        "threads": torch.get_num_threads(),
        "load": _load_facts(model),
    }
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    for line in model.moepack_load.lines():
        console.print(f"load    {line}")
    console.print(f"prompt  {ids}")
    console.print(f"tokens  {gen.tokens}")
    if result["text"] is not None:
        console.print(f"text    {result['text']!r}")
    console.print(
        f"{len(gen.tokens)} tokens in {gen.seconds:.3f} s: {gen.tokens_per_second:.1f} tokens/s, "
        f"{100 * gen.moe_share:.1f}% of the time in the MoE layers ({result['model_type']}, {result['dtype']}, "
        f"{result['threads']} threads; load {load_s:.2f} s)"
    )
