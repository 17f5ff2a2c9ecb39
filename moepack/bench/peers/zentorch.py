"""zentorch 2.13's fused experts (``torch.ops.zentorch.zentorch_fused_moe``) on moepack's
canonical tensors: unpacked w13 [E, 2I, H] and w2 [E, H, I], bf16, or int8 codes with fp32
per-channel scales [E, N] (W8A8: zentorch quantizes the bf16 activations itself). The routing ids
must be int32 (int64 ids are refused: "expected scalar type Int but found Long").

Run on an Intel Sapphire Rapids VM (zentorch 2.13.0.2, torch 2.13.0+cpu, 2 threads): it loads
and runs there without a word about the CPU. Its bf16 path rewrites the weight tensors it is
given, in place, on its first call: every expert's w13 and w2 hold the same values in another
order afterwards (its own blocked layout), even experts no token was routed to; its outputs are
right on that call and the later ones. A caller that reads those tensors again (the fp32
reference, the torch loop, an earlier harness's reference) then computes on scrambled weights:
that is how its bf16 results were once taken for wrong. The adapter hands zentorch copies of the
bf16 weights; its int8 path leaves the codes and scales as they were (checked the same way).
An engine module names schemes: it is the table of what the engine runs."""

from __future__ import annotations

import torch

from . import PeerArm, PeerUnsupported, tensor_nbytes, check_engine

SCHEMES = ("dense", "int8_channel")


def _op():
    """zentorch's fused-experts op (registered by ``import zentorch``, which check_engine does);
    the tests put a stand-in with the same contract here where zentorch is missing."""
    return torch.ops.zentorch.zentorch_fused_moe


def build(scheme: str, c: dict) -> PeerArm:
    check_engine("zentorch")
    if scheme == "dense":
        # copies: zentorch reorders bf16 weights in place (the module's words)
        a, b, sa, sb = c["w13"].contiguous().clone(), c["w2"].contiguous().clone(), None, None
        act, weights = "bf16", "the same bf16 weights (its own copy: it reorders them in place)"
    elif scheme == "int8_channel":
        a, b = c["w13_q"].contiguous(), c["w2_q"].contiguous()
        sa, sb = c["w13_scale"].float().contiguous(), c["w2_scale"].float().contiguous()
        act, weights = "W8A8", "the same int8 codes and per-channel scales"
    else:
        raise PeerUnsupported(f"zentorch has no {scheme} path (it runs {', '.join(SCHEMES)})")
    op = _op()

    def fn(x, tw, ti):
        out = torch.empty_like(x)
        ids = ti if ti.dtype == torch.int32 else ti.to(torch.int32)
        op(out, x, a, b, None, None, tw.float(), ids, False, "silu", sa, sb)
        return out

    return PeerArm("zentorch", "zentorch_fused_moe", act, weights, fn, tensor_nbytes(a, b, sa, sb) / a.shape[0])
