#!/usr/bin/env python3
"""The int4 code packers on one qwen3-30b-a3b expert: w13 [1536, 2048] and w2 [2048, 768] codes,
the Python specification (pack_u4_codes use_cpp=False: the padding rule, then pack_codes) against
the C++ packer (torch.ops.moepack.pack_weight with the zero points), with the n/k padding convert
packs with; median of --repeats calls after 3 warm-ups. Both must give the same bytes.

    python tools/bench_pack_u4.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moepack.layout import int4_layout_for, layout_padded_i, layout_padded_k, layout_padded_n
from moepack.schemes.int4 import pack_u4_codes


def _median_ms(fn, repeats: int) -> tuple[float, torch.Tensor]:
    for _ in range(3):
        out = fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--groups", default="128,32,-1", help="int4 group sizes (-1: per channel)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, median of {a.repeats}")
    for g in (int(x) for x in a.groups.split(",")):
        lay = int4_layout_for(g)
        for name, n, k in (("w13", 1536, 2048), ("w2", 2048, 768)):
            q = torch.randint(0, 16, (1, n, k), generator=gen, dtype=torch.uint8)
            z = torch.randint(0, 16, (1, n, 1 if g < 0 else -(-k // g)), generator=gen, dtype=torch.uint8)
            np_ = layout_padded_n(lay, n)
            kp = layout_padded_k(lay, layout_padded_i(lay, k) if name == "w2" else k)
            spec_ms, spec = _median_ms(lambda: pack_u4_codes(q, z, g, lay, np_, kp, use_cpp=False), a.repeats)
            cpp_ms, cpp = _median_ms(lambda: pack_u4_codes(q, z, g, lay, np_, kp, use_cpp=True), a.repeats)
            assert torch.equal(spec, cpp), (lay.name, name)
            print(f"{lay.name:18s} {name:3s} [{n} x {k}]  python spec {spec_ms:6.2f} ms   C++ {cpp_ms:5.2f} ms   "
                  f"x{spec_ms / cpp_ms:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
