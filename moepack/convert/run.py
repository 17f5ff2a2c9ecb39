"""``moepack convert SRC DST``: a Hugging Face checkpoint directory -> a packed directory.

Streaming: the whole plan (every layer, every tensor, every shard's header) is made from the
source's headers and config.json first, so bad input is refused before anything is written;
then one layer at a time is read, packed and written. Everything goes into a temporary sibling
of DST that is renamed to DST only when complete (moepack/container), so an interrupted or
failed convert never leaves a directory under the final name.

Schemes (moepack.schemes): a quantized source (int8 compressed-tensors, int4 GPTQ / AWQ /
pack-quantized) is packed into its scheme's layout with its own codes and scales (never
re-quantized); a float source is packed as is, or quantized one expert at a time into the scheme
``quantize`` names, with that scheme's options (``"int4:g64:asym"``: parse_quantize). Each
layer's manifest entry records ``scheme`` and ``scheme_source``; the report carries the
quantization error of what was quantized (``ConvertReport.quant_error``).

The stages live in their own modules: moepack.convert.plan (the plan), moepack.convert.stages
(packing a layer, the other tensors, the manifest), moepack.convert.resume (the resume journal).
This module keeps the public ``convert``, its report and the run's control flow (temporary
directory, resume, signals, torch threads); the names outside code imports from here
(``parse_quantize``, ``expert_tensor_name``, ``MANIFEST``, ...) are re-exported.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..container.atomic import atomic_directory, os_reason
from ..container.writer import ShardWriter
from .plan import check_carried_values, check_float_shared_values, tensor_nbytes, Options, make_plan, expert_tensor_name, parse_quantize
from .resume import Resume, resume_key
from .stages import build_manifest, write_layer, write_other, check_draft_manifest
from ..errors import ConvertError, LayoutError, MoepackError
from ..layout import DEFAULT_LAYOUT, PackedLayout, layout_get
from ..manifest import write_manifest
from ..runtime.model import FORMAT_VERSION, MANIFEST
from ..schemes import QuantError
from ..sources import Checkpoint

DEFAULT_SHARD_BYTES = 2 << 30
MAX_THREADS = 1024  # convert's ``threads``: past it torch cannot start them (100000 crashed the process)

ProgressFn = Callable[..., None]


@dataclass
class ConvertReport:
    dst: Path
    layout: str = ""  # the layout written (a quantized source or quantize=: that scheme's layout)
    scheme: str = ""  # the scheme written
    quantize: str | None = None  # the quantizer and its options when float weights were quantized ("int4_group:g128:sym")
    quant_error: float | None = None  # ||dequant(q) - w|| / ||w|| over every weight quantized from float
    quant_error_worst: tuple | None = None  # (layer index, its relative error) of the layer quantized worst
    act_modes: list = field(default_factory=list)  # the act modes recorded as the layers' defaults
    shared_float: list = field(default_factory=list)  # layers whose float shared expert (quantized source) stays float
    shared_layout: str = ""  # the layout those shared experts are packed in
    shared_quantize: str | None = None  # --quantize on a quantized source's float shared experts: the quantizer
    layers: int = 0
    experts_bytes: int = 0
    other_bytes: int = 0
    seconds: float = 0.0
    files: list = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return (self.experts_bytes + self.other_bytes) / 1e6 / max(self.seconds, 1e-9)


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    layout: int | str | PackedLayout = DEFAULT_LAYOUT,
    quantize: str | None = None,
    overwrite: bool = False,
    threads: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: ProgressFn | None = None,
    act_mode: str | None = None,
    resume: bool = True,
    pipeline: bool = True,
    tp: int = 1,
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into a packed directory at ``dst``.

    ``quantize``: quantize a float source's experts into a scheme, ``"<scheme>[:option...]"``:
    ``"int8"`` (W8A8, per output channel) or ``"int4"`` (round to nearest; options ``g32`` /
    ``g64`` / ``g128`` (default) / ``ch`` for the group size, ``sym`` (default) / ``asym``, e.g.
    ``"int4:g64:asym"``), packed into that scheme's layout of the family (a quantized source is
    packed into its own scheme anyway, never re-quantized). ``ConvertReport.quant_error`` is the
    resulting weight error; ``verify(..., source=)`` judges the output error.
    ``act_mode`` ("a16" / "a8"): the activation mode recorded as every layer's default (the
    manifest's ``act_mode``), refused when the layout does not serve it; None: each layer's own
    (int4: a16, the checkpoint's meaning; a8 for a compressed-tensors W4A8 checkpoint).

    ``resume``: a temporary directory left by a hard-killed convert to the same ``dst`` with the
    same plan (source fingerprint, layout, options, moepack version) is continued from its last
    complete, re-checked shard; False (or a plan that differs) deletes it and starts over.
    ``pipeline``: pack, hash and write on three threads (False: one after the other on the
    calling thread, the reference path; the bytes are the same). ``tp`` > 1: a tensor-parallel
    pack (moepack/tp.py, docs/PACKED_FORMAT.md): the layers are packed whole into a temporary
    sibling directory first, then each rank's slice of every expert is written contiguously
    (so the disk briefly holds both). SIGTERM and SIGHUP delete the
    temporary directory like Ctrl-C does (docs/ARCHITECTURE.md, "convert")."""
    t0 = time.perf_counter()
    lay = layout_get(layout)
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise ConvertError(f"destination {dst} already exists: choose another path or pass overwrite=True (--overwrite)")
    if dst.resolve() == src.resolve():
        raise ConvertError(f"destination {dst} is the source: write the packed directory somewhere else")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS):
        raise ConvertError(f"threads={threads!r}: must be a positive integer, at most {MAX_THREADS} (torch threads for "
                           "packing; more only exhaust the process's threads)")  # fmt: skip
    if act_mode is not None and act_mode not in ("a16", "a8"):
        raise ConvertError(f"act_mode={act_mode!r}: must be 'a16' or 'a8' (or None: each layer's default)")
    parse_quantize(quantize)  # refused before anything is opened
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConvertError(f"tp={tp!r}: the tensor-parallel degree must be an integer >= 1")
    opts = Options(quantize, act_mode, shard_bytes, resume, pipeline)
    with torch_threads(threads), _signals_interrupt():
        if tp == 1:
            return _convert(src, dst, lay, overwrite, progress, t0, opts)
        return _convert_tp(src, dst, lay, overwrite, progress, t0, opts, tp)


def _convert_tp(src: Path, dst: Path, lay: PackedLayout, overwrite: bool, progress, t0: float, opts, tp: int):
    """``convert(..., tp=N)``: the whole pack into the sibling ``.<dst>.tp-whole`` first, then its
    ``--tp N`` form written at ``dst`` (moepack.tp.reshard_dir, itself an atomic directory), then
    the whole one deleted.

    The run holds ``.<dst>.tp-lock`` throughout, so a second ``--tp`` convert to the same ``dst``
    is refused naming the owner and never deletes this run's files. A finished whole pack carries
    its plan's resume key (``TP_WHOLE_KEY``, with its ConvertReport): after a hard kill in the
    reshard phase the next run with the same plan (and ``resume``) re-checks its bytes against
    its manifest and reslices it instead of packing again; any other whole pack is deleted. A
    kill during the packing phase is resumed by the whole pack's own journal (``_convert``).
    Exceptions (Ctrl-C, SIGTERM, a refusal) delete the whole pack, as they delete a temporary
    directory."""
    import dataclasses
    import shutil

    from ..container.atomic import FileLock
    from ..tp import reshard_dir, tp_slice_size

    notify = progress or (lambda *a, **k: None)
    # every layer's slice checked from the plan (the source's headers), before anything is packed
    pl = make_plan(src, lay, opts.quantize, opts.shard_bytes, opts.act_mode)
    for spec in pl.specs:
        try:
            tp_slice_size(pl.layout, int(spec.intermediate), tp, f"layer {spec.index} ({spec.prefix})")
        except LayoutError as ex:
            raise ConvertError(f"--tp {tp}: {ex}") from None
    run_lock = FileLock(dst.parent / f".{dst.name}.tp-lock")
    try:
        taken = run_lock.acquire()
    except OSError as e:
        raise ConvertError(f"{dst}: cannot create the output directory in {str(dst.parent)!r}: {os_reason(e)}") from None
    if not taken:
        raise ConvertError(f"{dst}: {run_lock.owner()} is writing it right now ({run_lock.path.name} is locked): "
                           "wait for that run to finish or choose another destination")  # fmt: skip
    whole = dst.parent / f".{dst.name}.tp-whole"
    try:
        key = resume_key(pl, opts)
        report = _reusable_whole(whole, key, notify) if opts.resume else None
        if report is None:
            if whole.exists():
                shutil.rmtree(whole)
            report = _convert(src, whole, lay, False, progress, t0, opts)
            record = {"key": key, "report": {k: v for k, v in dataclasses.asdict(report).items() if k not in ("dst", "seconds")}}
            part = whole / (TP_WHOLE_KEY + ".part")
            part.write_text(json.dumps(record))
            os.replace(part, whole / TP_WHOLE_KEY)
        notify("tp_reshard", tp=tp)
        reshard_dir(whole, dst, tp, overwrite=overwrite)
        shutil.rmtree(whole, ignore_errors=True)
    except BaseException:
        shutil.rmtree(whole, ignore_errors=True)
        raise
    finally:
        run_lock.release(unlink=True)
    return dataclasses.replace(report, dst=dst, seconds=time.perf_counter() - t0)


TP_WHOLE_KEY = ".moepack-tp-whole.json"  # in a finished ``.<dst>.tp-whole``: its plan's resume key and ConvertReport


def _reusable_whole(whole: Path, key: dict, notify) -> ConvertReport | None:
    """The ConvertReport of the whole pack a hard-killed ``--tp`` run left at ``whole`` when its
    plan is ``key`` and every byte still matches its manifest (verify's integrity steps), else
    None (the caller deletes it). ``notify``: "tp_whole_reused" or "stale_removed"."""
    from ..verify.run import verify

    rec_path = whole / TP_WHOLE_KEY
    if not rec_path.is_file():
        return None  # no whole pack, or one killed before its key was written
    why = None
    try:
        rec = json.loads(rec_path.read_text())
        if rec.get("key") != json.loads(json.dumps(key)):
            why = "a different plan (source, layout, options or moepack version)"
        else:
            rep = verify(whole)
            if not rep.ok:
                why = "its bytes no longer match its manifest"
    except (OSError, ValueError, MoepackError) as e:
        why = f"unreadable ({e})"
    if why is not None:
        notify("stale_removed", path=str(whole), reason=why)
        return None
    notify("tp_whole_reused", path=str(whole))
    r = rec["report"]
    return ConvertReport(dst=whole, **{**r, "quant_error_worst": tuple(r["quant_error_worst"]) if r.get("quant_error_worst") else None})


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a convert: raised like Ctrl-C's KeyboardInterrupt, so the same
    cleanup runs (the temporary directory is deleted), then the signal is delivered again."""

    def __init__(self, signum: int):
        super().__init__(f"convert stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt():
    """SIGTERM / SIGHUP raise ``Terminated`` in the main thread for the block. After the cleanup,
    a signal whose previous handler was the default is sent again so that the process ends by
    it (exit status 128+N, as without moepack); a Python handler is called instead. A second
    signal during the cleanup is ignored rather than cutting the cleanup short. A signal the
    process already ignores (SIGHUP under ``nohup``) is left ignored: it does not stop the convert."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [x for x in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if x is not None]
    fired: list[int] = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise Terminated(signum)

    # a signal the process ignores stays ignored: under `nohup` (SIGHUP ignored) a hangup must not
    # stop the convert that nohup was asked to keep running
    before = {x: signal.signal(x, handler) for x in sigs if signal.getsignal(x) != signal.SIG_IGN}
    try:
        yield
    except Terminated as e:
        for x, h in before.items():
            signal.signal(x, h)
        prev = before[e.signum]
        if prev == signal.SIG_DFL:
            os.kill(os.getpid(), e.signum)
        elif callable(prev):
            prev(e.signum, None)
        raise
    finally:
        for x, h in before.items():
            signal.signal(x, h)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's thread count (process-wide) set to ``n`` for the block, restored after; None
    leaves it alone."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _convert(src: Path, dst: Path, lay: PackedLayout, overwrite: bool, progress, t0: float, opts: Options):
    """plan -> per layer, the scheme's packer streams into the expert shards -> the other tensors
    -> the manifest, all inside a temporary directory renamed to ``dst`` only when complete; a
    hard-killed run's directory with the same plan is continued from its last complete shard."""
    notify = progress or (lambda *a, **k: None)
    pl = make_plan(src, lay, opts.quantize, opts.shard_bytes, opts.act_mode)
    check_carried_values(pl)  # before anything is written
    check_float_shared_values(pl)  # likewise: a float shared expert kept float must have an exact bf16 form
    check_draft_manifest(pl, dst, opts.act_mode)  # likewise: the manifest as planned, through open's own schema
    notify("plan", layers=len(pl.specs), expert_files=len(pl.expert_files), other_files=len(pl.other_files),
           other_tensors=sum(len(x) for x in pl.other_shards))  # fmt: skip
    report = ConvertReport(dst=dst, layout=pl.layout.name, act_modes=sorted(set(pl.act_modes.values())), scheme=pl.scheme.name,
                           quantize=pl.quantizer, shared_float=sorted(pl.shared_layouts), shared_quantize=pl.shared_quantizer,
                           shared_layout=", ".join(sorted({x.name for x in pl.shared_layouts.values()})))  # fmt: skip
    error = QuantError()
    tensors: dict[str, dict] = {}
    layers = []
    journal = Resume(resume_key(pl, opts), notify)
    reuse = journal.matches if opts.resume else None
    with atomic_directory(dst, overwrite=overwrite, reuse=reuse) as tmp:
        journal.start(tmp)
        work = [(f, sh, "experts") for f, sh in zip(pl.expert_files, pl.expert_shards)]
        work += [(f, names, "other") for f, names in zip(pl.other_files, pl.other_shards)]
        fresh = journal.resumed is None
        for fname, items, kind in work:
            shard = pl.shard_plans[fname]
            entry = None if fresh else journal.finished(tmp, fname, shard)
            if entry is not None:  # already written by the killed run, and checked
                tensors.update(entry["tensors"])
                layers += entry["layers"]
                report.layers += len(entry["layers"])
                report.experts_bytes += entry["experts_bytes"]
                report.other_bytes += entry["other_bytes"]
                for i, (d, r) in entry.get("quant_error", {}).items():  # the killed run's quantization error of its layers
                    error.layers[int(i)] = [d, r]
                    error.err2, error.ref2 = error.err2 + d, error.ref2 + r
                report.files.append(fname)
                notify("shard_resumed", file=fname)
                continue
            if not fresh:  # the first shard that is not complete: it and everything after are redone
                fresh = True
                for f, _, _ in work[work.index((fname, items, kind)) :]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp / f)
            before = (dict(tensors), len(layers), report.experts_bytes, report.other_bytes, set(error.layers))
            with ShardWriter(tmp / fname, shard, pipeline=opts.pipeline, display=dst / fname) as w:
                if kind == "experts":
                    for s in items:
                        notify("layer_start", layer=s.index, num_experts=s.num_experts)
                        layers.append(write_layer(pl, s, w, shard, fname, tensors, report, error))
                        report.layers += 1
                        notify("layer_done", layer=s.index, bytes=sum(tensor_nbytes(d, shp) for _, d, shp in pl.layer_tensors[s.index]))
                else:
                    write_other(pl, fname, items, w, tensors, report)
            report.files.append(fname)
            journal.done(tmp, fname, {
                "tensors": {k: v for k, v in tensors.items() if k not in before[0]}, "layers": layers[before[1] :],
                "experts_bytes": report.experts_bytes - before[2], "other_bytes": report.other_bytes - before[3],
                "quant_error": {str(i): v for i, v in error.layers.items() if i not in before[4]},
            })  # fmt: skip
            notify("shard_done", file=fname)
            if kind == "other":
                notify("other_done", file=fname, tensors=len(items))
        carried, carried_sha = [], {}
        what = dst
        try:
            for p in pl.ckpt.carried_files():
                what = dst / p.name
                shutil.copy2(p, tmp / p.name)
                carried.append(p.name)
                # the copy's own bytes (what verify re-hashes), read back after the copy
                carried_sha[p.name] = _file_digest(tmp / p.name)
            journal.finish(tmp)
            manifest = build_manifest(pl, tmp, layers, tensors, carried, report, journal.created_at, carried_sha, opts.act_mode)
            what = dst / MANIFEST
            write_manifest(tmp, manifest, dst)  # sealed, and checked by open's own schema before it is written
        except OSError as e:
            raise ConvertError(f"{what}: cannot write: {os_reason(e)}") from None
    report.seconds = time.perf_counter() - t0
    report.quant_error = error.rel  # None when nothing was quantized (resumed shards: from their journal)
    report.quant_error_worst = error.worst()
    notify("done", report=report)
    return report


def _file_digest(path: Path) -> str:
    """sha256 of a whole (small) file: a carried file's checksum in the manifest."""
    from ..verify.report import file_sha256

    return file_sha256(path, 0, path.stat().st_size)


def load_manifest_json(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


__all__ = ["convert", "ConvertReport", "MANIFEST", "FORMAT_VERSION", "expert_tensor_name", "Checkpoint"]
