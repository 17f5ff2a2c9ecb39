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
machine's limits with tools/bw_probe.c (compiled on the fly, see ``probe.py``): read bandwidth
(the fastest of a search over read patterns, and the plain read) and the peak of each dot-product
instruction the CPU has, at the same thread count. '% read BW' divides by the best read; '% dot
peak' by the peak of the instruction the layout's kernel uses at the ISA level it runs at here
(``kernel_instruction``, from the level's ``float_instruction`` / ``int_instruction`` in
moepack/isa_levels.py: e.g. tdpbf16ps for bf16 on amx_bf16, vpdpbusd zmm for int8 on
avx512_vnni).

``--scheme int8_channel`` (alias ``int8``) packs the same weights as W8A8 int8 experts (``quantize_int8_per_channel``,
layout ``i8_n32k4_x86``): GB/s then counts the int8 packed bytes (codes + fp32 scales + int32
column sums) and GFLOP/s reads as GOP/s (the same ``2*T*k*3*H*I`` operations, done as int8
multiply-adds), against the int8 instruction's GOP/s.

``--vs vllm,zentorch,torch`` times other engines' fused experts against moepack in the same
process, on the same weights (the scheme's codes and scales in each engine's format), calls
alternating (``vs``: the run; ``peers``: one adapter per engine; docs/BENCH.md "Side by side").

``--json out.json`` writes the versioned result file (docs/BENCH.md); ``--compare old.json``
adds, per row present in both runs, the new/old ratios of ms and GB/s, flagged where more than
``--compare-threshold`` percent slower.

Modules: ``shapes`` (the shape table, --shapes/--tokens parsing), ``probe`` (machine facts and
limits), ``timing`` (routings, timed calls, background CPU), ``report`` (rows, JSON, tables,
comparison), ``run`` (BenchConfig, run_benchmark, main).

The run also records how much CPU other processes took while each measurement ran
(``*_bg_cpus``, from /proc/stat): on a shared machine a number taken while another process
used a whole CPU is not a measurement of the code. ``--wait-quiet S`` waits (up to S seconds)
for the other processes to go idle before each measurement, and ``--retries N`` re-times a
measurement that was disturbed anyway, keeping the least disturbed attempt.
"""

from .probe import (
    INSTRUCTIONS,
    PROBE_SOURCE,
    Instruction,
    MachineProbe,
    build_probe,
    cpu_model,
    describe_limits,
    host_cpu_flags,
    kernel_instruction,
    machine_info,
    machine_limits,
    parse_probe_output,
    probe_machine,
)
from .report import (
    DEFAULT_COMPARE_THRESHOLD,
    FORMAT,
    FORMAT_VERSION,
    TABLE_COLUMNS,
    BenchResult,
    Comparison,
    CompareRow,
    Row,
    compare_results,
    load_result,
    machine_line,
    render_compare_markdown,
    render_compare_table,
    render_markdown,
    render_table,
    table_cells,
    threshold_from_percent,
    write_json,
)
from .peers import ENGINES, PeerArm, PeerUnavailable, PeerUnsupported, parse_vs
from .run import BenchConfig, main, make_weights, run_benchmark
from .vs import arm_names, reexec, reexec_python, render_vs_markdown, render_vs_table, run_vs, schedule
from .shapes import DEFAULT_SHAPES, DEFAULT_TOKENS, DTYPES, SHAPES, MoeShape, parse_shapes, parse_tokens
from .timing import BUSY_CPUS, RoutingStream, Timing, wait_quiet

__all__ = [
    "BUSY_CPUS", "DEFAULT_COMPARE_THRESHOLD", "ENGINES", "PeerArm", "PeerUnavailable", "PeerUnsupported", "arm_names",
    "parse_vs", "reexec", "reexec_python", "render_vs_markdown", "render_vs_table", "run_vs", "schedule", "DEFAULT_SHAPES", "DEFAULT_TOKENS", "DTYPES", "FORMAT", "FORMAT_VERSION",
    "INSTRUCTIONS", "PROBE_SOURCE", "SHAPES", "TABLE_COLUMNS",
    "BenchConfig", "BenchResult", "Comparison", "CompareRow", "Instruction", "MachineProbe", "MoeShape", "Row",
    "RoutingStream", "Timing",
    "build_probe", "compare_results", "cpu_model", "describe_limits", "host_cpu_flags", "kernel_instruction",
    "load_result", "machine_info", "machine_limits", "machine_line", "main", "make_weights", "parse_probe_output",
    "parse_shapes", "parse_tokens", "probe_machine", "render_compare_markdown", "render_compare_table",
    "render_markdown", "render_table", "run_benchmark", "table_cells", "threshold_from_percent", "wait_quiet",
    "write_json",
]
