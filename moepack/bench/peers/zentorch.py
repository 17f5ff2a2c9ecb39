"""zentorch 2.13's fused experts (``torch.ops.zentorch.zentorch_fused_moe``) on moepack's
canonical tensors, written from its documented call (unpacked w13 [E, 2I, H] and w2 [E, H, I];
int8 with fp32 per-channel scales [E, N]). Not run on the development machine: zentorch was not
installed there. An engine module names schemes: it is the table of what the engine runs."""

from __future__ import annotations

import torch

from . import PeerArm, PeerUnsupported, _nbytes, check_engine

SCHEMES = ("dense", "int8_channel")


def build(scheme: str, c: dict) -> PeerArm:
    check_engine("zentorch")
    if scheme == "dense":
        a, b, sa, sb = c["w13"].contiguous(), c["w2"].contiguous(), None, None
        act, weights = "bf16", "the same bf16 weights"
    elif scheme == "int8_channel":
        a, b = c["w13_q"].contiguous(), c["w2_q"].contiguous()
        sa, sb = c["w13_scale"].float().contiguous(), c["w2_scale"].float().contiguous()
        act, weights = "W8A8", "the same int8 codes and per-channel scales"
    else:
        raise PeerUnsupported(f"zentorch has no {scheme} path (it runs {', '.join(SCHEMES)})")
    op = torch.ops.zentorch.zentorch_fused_moe

    def fn(x, tw, ti):
        out = torch.empty_like(x)
        op(out, x, a, b, None, None, tw, ti, False, "silu", sa, sb)
        return out

    return PeerArm("zentorch", "zentorch_fused_moe", act, weights, fn, _nbytes(a, b, sa, sb) / a.shape[0])
