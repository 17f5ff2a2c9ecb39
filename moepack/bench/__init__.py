"""Benchmark: moepack's fused experts against the plain torch per-expert loop, on real MoE shapes.

    python -m moepack.bench --shapes qwen3-30b-a3b --tokens 1,8,64,512 --threads 2 --json out.json
    moepack bench ...                       # the same command through the CLI

For each shape, random bf16 weights are made once and packed; then, for each token count T, both
implementations run in the same process, on the same activations and the same routings:

* routings are pre-generated (random logits -> softmax -> top-k, renormalized; ids int32,
  weights fp32), a new one for every call, so each call touches other experts than the one
  before (for T=1 the experts of consecutive calls are disjoint whenever E >= 2k): the weights
  come from memory, as in decoding, not from a cache warmed by the previous call;
* each implementation is warmed up once, then timed over N calls with ``time.perf_counter``
  (N adaptive: enough calls for ``min_time`` seconds, at least 3), each call timed on its own.

Per row: ms per call (mean over the timed calls), effective weight bandwidth (bytes of the
experts the call touched -- unique ids x bytes per expert, summed over calls -- / total time),
GFLOP/s (``2*T*k*3*H*I`` per call / time) and torch_ms / moepack_ms. The same run measures the
machine with tools/bw_probe.c (compiled on the fly, see ``probe_machine``): stream-read
bandwidth and fp32 FMA peak with the same thread count, and moepack's fraction of each.

``--scheme int8_channel`` (alias ``int8``) packs the same weights as W8A8 int8 experts (``quantize_int8_per_channel``,
layout ``i8_n32k4_x86``): GB/s then counts the int8 packed bytes (codes + fp32 scales + int32
column sums) and GFLOP/s reads as GOP/s (the same ``2*T*k*3*H*I`` operations, done as int8
multiply-adds). The "% FMA peak" column stays relative to the machine's fp32 FMA peak, which is
not the int8 peak (see the note the run prints).

The run also records how much CPU other processes took while each measurement ran
(``*_bg_cpus``, from /proc/stat): on a shared machine a number taken while another process
used a whole CPU is not a measurement of the code. ``--wait-quiet S`` waits (up to S seconds)
for the other processes to go idle before each measurement, and ``--retries N`` re-times a
measurement that was disturbed anyway, keeping the least disturbed attempt.
"""


from .probe import PROBE_SOURCE, MachineProbe, build_probe, cpu_model, machine_info, probe_machine
from .report import TABLE_COLUMNS, BenchResult, Row, machine_line, render_markdown, render_table, table_cells, write_json
from .run import BenchConfig, main, make_weights, run_benchmark
from .shapes import DEFAULT_SHAPES, DEFAULT_TOKENS, DTYPES, SHAPES, MoeShape, parse_shapes, parse_tokens
from .timing import BUSY_CPUS, RoutingStream, Timing, wait_quiet

__all__ = [
    "BUSY_CPUS", "DEFAULT_SHAPES", "DEFAULT_TOKENS", "DTYPES", "PROBE_SOURCE", "SHAPES", "TABLE_COLUMNS",
    "BenchConfig", "BenchResult", "MachineProbe", "MoeShape", "Row", "RoutingStream", "Timing",
    "build_probe", "cpu_model", "machine_info", "machine_line", "main", "make_weights", "parse_shapes",
    "parse_tokens", "probe_machine", "render_markdown", "render_table", "run_benchmark", "table_cells",
    "wait_quiet", "write_json",
]
