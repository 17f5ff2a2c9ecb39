"""moepack.container: golden bytes, interop with the safetensors library, zero-copy open, refusal
of corrupt files (hand-made and fuzzed), and the all-or-nothing output directory."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from moepack.container import (
    DATA_ALIGNMENT,
    WRITER_DTYPES,
    ShardPlan,
    ShardWriter,
    atomic_directory,
    open_shard,
    read_safetensors_header,
    sha256_of,
)
from moepack.errors import ContainerError, MoepackError

# --------------------------------------------------------------------------------------------
# helpers


def _tiny_tensors():
    return {
        "a": torch.tensor([1.0, 2.0], dtype=torch.float32),
        "b": torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.bfloat16),
        "c": torch.tensor([7], dtype=torch.uint8),
    }


def _write(path, tensors: dict, **plan_kw):
    plan = ShardPlan(**plan_kw)
    for name, t in tensors.items():
        plan.add(name, t.dtype, t.shape)
    with ShardWriter(path, plan, fsync=False) as w:
        for name, t in tensors.items():
            w.write(name, t)
    return plan, w


def _raw_file(path, header, data: bytes = b"", *, n=None, pad_to=8):
    """Write a file by hand: header is a dict (dumped compactly) or raw bytes."""
    js = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % pad_to)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js) if n is None else n) + js + data)
    return path


def _refused(path, match, **kw):
    with pytest.raises(ContainerError, match=match) as ei:
        read_safetensors_header(path, **kw)
    msg = str(ei.value)
    assert msg.startswith(os.path.basename(str(path)) + ": "), msg  # names the file
    return msg


# --------------------------------------------------------------------------------------------
# golden bytes

GOLDEN_JSON = (
    '{"__metadata__":{"format":"moepack","format_version":"1","alignment":"64"},'
    '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    '"__pad__.0":{"dtype":"U8","shape":[56],"data_offsets":[8,64]},'
    '"b":{"dtype":"BF16","shape":[1,3],"data_offsets":[64,70]},'
    '"__pad__.1":{"dtype":"U8","shape":[58],"data_offsets":[70,128]},'
    '"c":{"dtype":"U8","shape":[1],"data_offsets":[128,129]}}'
)
GOLDEN_DATA = (
    bytes.fromhex("0000803f" "00000040")  # F32 1.0, 2.0
    + bytes(56)
    + bytes.fromhex("803f" "00c0" "003f")  # BF16 1.0, -2.0, 0.5
    + bytes(58)
    + b"\x07"
)


def test_golden_bytes(tmp_path):
    p = tmp_path / "golden.safetensors"
    plan, w = _write(p, _tiny_tensors())
    b = p.read_bytes()
    n = 4096 - 8
    assert len(b) == plan.nbytes == 4096 + 129
    assert b[:8] == struct.pack("<Q", n)
    assert b[8 : 8 + n] == GOLDEN_JSON.encode() + b" " * (n - len(GOLDEN_JSON))
    assert b[4096:] == GOLDEN_DATA
    assert plan.header_bytes() == b[:4096]
    assert hashlib.sha256(b).hexdigest() == "83792e232a80c7d63256312f2bfc694c2098db1d0b4f76de0594de56928d1264"
    # the digests are those of each tensor's stored bytes
    assert w.digests == {
        "a": hashlib.sha256(GOLDEN_DATA[0:8]).hexdigest(),
        "b": hashlib.sha256(GOLDEN_DATA[64:70]).hexdigest(),
        "c": hashlib.sha256(GOLDEN_DATA[128:129]).hexdigest(),
    }
    h = read_safetensors_header(p, require_alignment=64)
    assert h.header_len == n and h.data_start == 4096 and h.file_size == len(b)
    assert h.names == ["a", "b", "c"]
    assert [e.name for e in h.entries] == ["a", "__pad__.0", "b", "__pad__.1", "c"]
    for e in h.tensors.values():
        assert e.file_offset % 64 == 0
    assert h.tensors["a"].file_offset % 4096 == 0


def test_plan_order_is_kept_and_fillers_only_where_needed(tmp_path):
    plan = ShardPlan()
    plan.add("z", torch.float32, (16,))  # 64 bytes: no filler after it
    plan.add("a", torch.uint8, (3,))
    plan.add("m", torch.int64, ())
    assert [e.name for e in plan.entries] == ["z", "a", "__pad__.0", "m"]
    assert plan.names == ["z", "a", "m"]
    assert [(e.begin, e.end) for e in plan.entries] == [(0, 64), (64, 67), (67, 128), (128, 136)]
    assert plan.nbytes == DATA_ALIGNMENT + 136
    with pytest.raises(ContainerError, match="frozen"):
        plan.add("late", torch.uint8, (1,))


def test_per_tensor_page_alignment(tmp_path):
    ts = {"small": torch.ones(3, dtype=torch.uint8), "big": torch.ones(100, dtype=torch.bfloat16)}
    plan = ShardPlan()
    plan.add("small", torch.uint8, (3,))
    plan.add("big", torch.bfloat16, (100,), align=4096)
    with ShardWriter(tmp_path / "x.safetensors", plan, fsync=False) as w:
        for k, t in ts.items():
            w.write(k, t)
    s = open_shard(tmp_path / "x.safetensors")
    assert s.info("big").file_offset % 4096 == 0
    assert s.tensor("big").data_ptr() % 4096 == 0
    assert torch.equal(s.tensor("big"), ts["big"])
    with pytest.raises(ContainerError, match="align"):
        ShardPlan().add("t", torch.uint8, (1,), align=32)
    with pytest.raises(ContainerError, match="align"):
        ShardPlan().add("t", torch.uint8, (1,), align=8192)


# --------------------------------------------------------------------------------------------
# interop with the safetensors library, round trips


def _random_tensor(dtype, shape, gen):
    """Random bytes viewed as dtype (every bit pattern, NaNs included: compare bytes)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).view(shape)


def _same_bytes(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and sha256_of(x) == sha256_of(y)


def test_required_dtypes_are_supported():
    names = set(WRITER_DTYPES.values())
    for d in ("BF16", "F16", "F32", "I32", "I64", "U8", "I8", "BOOL", "F8_E4M3"):
        assert d in names
    assert WRITER_DTYPES[torch.float8_e4m3fn] == "F8_E4M3"
    if hasattr(torch, "float8_e8m0fnu"):
        assert WRITER_DTYPES[torch.float8_e8m0fnu] == "F8_E8M0"


def test_round_trip_every_dtype(tmp_path):
    gen = torch.Generator().manual_seed(1)
    shapes = [(3,), (2, 5), (), (0, 4), (1, 3, 7)]
    ts = {}
    for i, dt in enumerate(WRITER_DTYPES):
        for j, shape in enumerate(shapes):
            ts[f"t{i}.{j}"] = _random_tensor(dt, shape, gen)
    p = tmp_path / "all.safetensors"
    _, w = _write(p, ts)
    theirs = load_file(p)
    assert set(theirs) - set(ts) == {k for k in theirs if k.startswith("__pad__.")}
    s = open_shard(p)
    assert s.names == list(ts)
    for k, t in ts.items():
        assert _same_bytes(theirs[k], t), k
        assert _same_bytes(s.tensor(k), t), k
        assert w.digests[k] == sha256_of(t) == sha256_of(s.tensor(k)) == sha256_of(s.raw(k))
        assert s.tensor(k).data_ptr() % 64 == 0 or s.tensor(k).numel() == 0


def test_reads_files_written_by_safetensors(tmp_path):
    gen = torch.Generator().manual_seed(2)
    ts = {
        "w.i64": _random_tensor(torch.int64, (3,), gen),
        "w.f32": _random_tensor(torch.float32, (2, 3), gen),
        "w.bf16": _random_tensor(torch.bfloat16, (5,), gen),
        "w.u8": _random_tensor(torch.uint8, (7,), gen),
        "w.fp8": _random_tensor(torch.float8_e4m3fn, (4, 4), gen),
        "scalar": _random_tensor(torch.float16, (), gen),
    }
    p = tmp_path / "theirs.safetensors"
    save_file(ts, p, metadata={"format": "pt"})
    h = read_safetensors_header(p)
    assert h.metadata == {"format": "pt"} and set(h.names) == set(ts)
    s = open_shard(p, require_alignment=None)
    for k, t in ts.items():
        assert _same_bytes(s.tensor(k), t), k
    # save_file aligns only to 8: whether 64-alignment is refused follows from the offsets
    unaligned = [e.name for e in h.entries if e.file_offset % 64]
    if unaligned:
        _refused(p, "required alignment 64", require_alignment=64)
    else:
        read_safetensors_header(p, require_alignment=64)


def test_unaligned_source_tensor_is_copied_not_refused(tmp_path):
    header = {
        "u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "f": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]},
    }
    p = _raw_file(tmp_path / "odd.safetensors", header, b"\x01" + struct.pack("<f", 3.5))
    s = open_shard(p, require_alignment=None)
    assert s.tensor("f").item() == 3.5
    _refused(p, r"tensor 'u' starts at file offset", require_alignment=64)


def test_sub_byte_dtype_header_and_raw(tmp_path):
    p = _raw_file(tmp_path / "f4.safetensors", {"q": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}, b"\x12" * 4)
    s = open_shard(p, require_alignment=None)
    assert s.raw("q").tolist() == [0x12] * 4
    with pytest.raises(ContainerError, match="sub-byte"):
        s.tensor("q")
    p2 = _raw_file(tmp_path / "f4odd.safetensors", {"q": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\x00" * 2)
    _refused(p2, "not a whole number of bytes")


# --------------------------------------------------------------------------------------------
# zero copy


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_open_is_zero_copy(tmp_path):
    p = tmp_path / "big.safetensors"
    total = 256 << 20
    part = torch.arange(16 << 20, dtype=torch.int32).view(torch.uint8)[: 16 << 20]  # 16 MiB
    plan = ShardPlan()
    plan.add("head", torch.bfloat16, (3,))
    plan.add("big", torch.uint8, (total // part.numel(), part.numel()))
    with ShardWriter(p, plan, fsync=False) as w:
        w.write("head", torch.ones(3, dtype=torch.bfloat16))
        d = w.write_parts("big", (part.view(1, -1) for _ in range(total // part.numel())))
    expected = hashlib.sha256()
    for _ in range(total // part.numel()):
        expected.update(part.numpy())
    assert d == expected.hexdigest()
    del part

    before = _rss_bytes()
    s = open_shard(p)
    views = {k: s.tensor(k) for k in s.names}
    grown = _rss_bytes() - before
    assert grown < 0.05 * total, f"RSS grew by {grown} bytes opening a {total}-byte file"
    base = s._storage.data_ptr()
    for k, t in views.items():
        assert t.data_ptr() == base + s.info(k).file_offset
        assert t.untyped_storage().data_ptr() == base
        assert t.data_ptr() % 64 == 0
    assert views["head"].data_ptr() % 4096 == 0
    assert views["big"].shape == (16, 16 << 20)
    # MAP_PRIVATE: writing to a view never reaches the file
    views["head"][0] = 5
    assert load_file(p)["head"][0].item() == 1.0


# --------------------------------------------------------------------------------------------
# writer refusals


def test_plan_refusals():
    plan = ShardPlan()
    plan.add("x", torch.float32, (2,))
    for name, dtype, shape, match in [
        ("x", torch.float32, (2,), "already in the plan"),
        ("", torch.float32, (2,), "non-empty"),
        ("__pad__.0", torch.uint8, (2,), "reserved"),
        ("__pad__", torch.uint8, (2,), "reserved"),
        ("__metadata__", torch.uint8, (2,), "reserved"),
        ("c", torch.complex64, (2,), "dtype"),
        ("c", "F32", (2,), "dtype"),
        ("n", torch.float32, (2, -1), "negative"),
    ]:
        with pytest.raises(ContainerError, match=match):
            plan.add(name, dtype, shape)
    with pytest.raises(ContainerError, match="reserved"):
        ShardPlan(metadata={"format": "pt"})
    with pytest.raises(ContainerError, match="power of two"):
        ShardPlan(alignment=48)


def test_writer_refusals(tmp_path):
    ts = _tiny_tensors()
    plan = ShardPlan()
    for k, t in ts.items():
        plan.add(k, t.dtype, t.shape)
    p = tmp_path / "w.safetensors"
    with ShardWriter(p, plan, fsync=False) as w:
        with pytest.raises(ContainerError, match=r"got tensor 'b' but the plan expects 'a' next \(tensors must be written in plan order\)"):
            w.write("b", ts["b"])
        with pytest.raises(ContainerError, match=r"'nope' .*not in the plan"):
            w.write("nope", ts["a"])
        with pytest.raises(ContainerError, match=r"tensor 'a': expected torch.float32 \[2\], got torch.float64 \[2\]"):
            w.write("a", ts["a"].double())
        with pytest.raises(ContainerError, match=r"tensor 'a': expected torch.float32 \[2\], got torch.float32 \[1, 2\]"):
            w.write("a", ts["a"].view(1, 2))
        w.write("a", ts["a"])
        with pytest.raises(ContainerError, match="already written"):
            w.write("a", ts["a"])
        w.write("b", ts["b"])
        w.write("c", ts["c"])
        with pytest.raises(ContainerError, match="every planned tensor is already written"):
            w.write("c", ts["c"])
    # missing tensor at close: error, and the partial file is gone
    assert p.exists()
    with pytest.raises(ContainerError, match=r"1 planned tensor\(s\) not written: 'c'"):
        with ShardWriter(tmp_path / "w2.safetensors", plan, fsync=False) as w:
            w.write("a", ts["a"])
            w.write("b", ts["b"])
    assert not (tmp_path / "w2.safetensors").exists()
    # never overwrites
    with pytest.raises(ContainerError, match="already exists"):
        ShardWriter(p, plan)
    # an exception inside the block deletes the partial file
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "w3.safetensors", plan, fsync=False) as w:
            w.write("a", ts["a"])
            raise RuntimeError("boom")
    assert not (tmp_path / "w3.safetensors").exists()


def test_write_parts(tmp_path):
    gen = torch.Generator().manual_seed(3)
    full = _random_tensor(torch.bfloat16, (5, 3, 4), gen)
    plan = ShardPlan()
    plan.add("e", torch.bfloat16, (5, 3, 4))
    plan.add("f", torch.bfloat16, (2, 2))
    p = tmp_path / "p.safetensors"
    with ShardWriter(p, plan, fsync=False) as w:
        d = w.write_parts("e", [full[:2], full[2:3], full[3:]])
        assert d == sha256_of(full)
        w.write("f", full[0, :2, :2])  # non-contiguous input is fine
    assert _same_bytes(open_shard(p).tensor("e"), full)
    with pytest.raises(ContainerError, match=r"wrote 48 bytes \(2 of 5 rows\), plan says 120"):
        with ShardWriter(tmp_path / "q.safetensors", plan, fsync=False) as w:
            w.write_parts("e", [full[:2]])
    with pytest.raises(ContainerError, match=r"expected torch.bfloat16 \['\*', 3, 4\]"):
        with ShardWriter(tmp_path / "q.safetensors", plan, fsync=False) as w:
            w.write_parts("e", [full[:2, :2]])
    with pytest.raises(ContainerError, match="more than 5 rows"):
        with ShardWriter(tmp_path / "q.safetensors", plan, fsync=False) as w:
            w.write_parts("e", [full, full[:1]])
    assert not (tmp_path / "q.safetensors").exists()


# --------------------------------------------------------------------------------------------
# corrupt files

E = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def test_truncated_at_many_points(tmp_path):
    src = tmp_path / "ok.safetensors"
    _write(src, _tiny_tensors())
    b = src.read_bytes()
    cuts = [0, 1, 7, 8, 100, 4095, 4096, 4100, 4096 + 64, len(b) - 1]
    for cut in cuts:
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(b[:cut])
        with pytest.raises(ContainerError) as ei:
            open_shard(p)
        assert "cut" in str(ei.value)


@pytest.mark.parametrize(
    "case, match",
    [
        ("header_past_end", r"header length 4096 runs past the end of the file \(72 bytes; truncated\?\)"),
        ("huge_header", r"header length 18446744073709551615 exceeds the limit of 100000000"),
        ("not_json", r"header is not valid JSON"),
        ("not_utf8", r"not valid UTF-8"),
        ("array", r"MUST begin with '\{'"),
        ("json_array_in_braces", r"not valid JSON"),
        ("leading_space", r"MUST begin with '\{'"),
        ("duplicate_key", r"duplicate key 'a'"),
        ("entry_not_object", r"tensor 'a' is a JSON list"),
        ("missing_dtype", r"tensor 'a' has no 'dtype'"),
        ("missing_offsets", r"tensor 'a' has no 'data_offsets'"),
        ("unknown_dtype", r"tensor 'a' has unknown dtype 'F33'"),
        ("float_shape", r"tensor 'a' has shape \[2.0\], must be a list of integers"),
        ("bool_shape", r"tensor 'a' has shape \[true\]|must be a list of integers"),
        ("negative_shape", r"tensor 'a' has shape \[-2\] with a negative dimension"),
        ("overflow_shape", r"tensor 'a' shape \[1099511627776, 1099511627776\] overflows"),
        ("bad_offsets", r"tensor 'a' has data_offsets \[0\], must be \[begin, end\]"),
        ("reversed_offsets", r"tensor 'a' has data_offsets \[8, 0\]; need 0 <= begin <= end"),
        ("nbytes_mismatch", r"tensor 'a' data_offsets \[0, 8\] hold 8 bytes but F32 \[3\] needs 12"),
        ("overlap", r"tensor 'b' data_offsets \[4, 12\] overlaps tensor 'a' \[0, 8\]"),
        ("hole", r"tensor 'b' data_offsets \[12, 20\] leaves a hole of 4 bytes after tensor 'a' \[0, 8\]"),
        ("hole_at_start", r"tensor 'a' data_offsets \[4, 12\] leaves a hole of 4 bytes at the start"),
        ("past_end", r"tensor 'a' data_offsets \[0, 16\] run past the end of the data buffer \(8 bytes"),
        ("trailing_garbage", r"tensors end at data offset 8 but the data buffer holds 12 bytes"),
        ("bad_metadata", r"__metadata__ must map strings to strings"),
        ("nan_constant", r"not valid JSON: non-standard JSON constant NaN"),
        ("deep_nesting", r"nested too deeply|not valid JSON"),
    ],
)
def test_corrupt_file_refused(tmp_path, case, match):
    p = tmp_path / f"{case}.safetensors"
    d8 = bytes(8)
    if case == "header_past_end":
        _raw_file(p, {"a": E}, d8, n=4096)
    elif case == "huge_header":
        _raw_file(p, {"a": E}, d8, n=2**64 - 1)
    elif case == "not_json":
        _raw_file(p, b'{"a": {"dtype": "F32", ', d8)
    elif case == "not_utf8":
        _raw_file(p, b'{"\xff\xfe": 1}', d8)
    elif case == "array":
        _raw_file(p, json.dumps([E]).encode())
    elif case == "json_array_in_braces":
        _raw_file(p, b"{[1, 2]}")
    elif case == "leading_space":
        _raw_file(p, b' {"a":' + json.dumps(E).encode() + b"}", d8)
    elif case == "duplicate_key":
        _raw_file(p, b'{"a":' + json.dumps(E).encode() + b',"a":' + json.dumps(E).encode() + b"}", d8)
    elif case == "entry_not_object":
        _raw_file(p, {"a": [1, 2]}, d8)
    elif case == "missing_dtype":
        _raw_file(p, {"a": {"shape": [2], "data_offsets": [0, 8]}}, d8)
    elif case == "missing_offsets":
        _raw_file(p, {"a": {"dtype": "F32", "shape": [2]}}, d8)
    elif case == "unknown_dtype":
        _raw_file(p, {"a": dict(E, dtype="F33")}, d8)
    elif case == "float_shape":
        _raw_file(p, {"a": dict(E, shape=[2.0])}, d8)
    elif case == "bool_shape":
        _raw_file(p, {"a": dict(E, shape=[True])}, d8)
    elif case == "negative_shape":
        _raw_file(p, {"a": dict(E, shape=[-2])}, d8)
    elif case == "overflow_shape":
        _raw_file(p, {"a": dict(E, shape=[2**40, 2**40])}, d8)
    elif case == "bad_offsets":
        _raw_file(p, {"a": dict(E, data_offsets=[0])}, d8)
    elif case == "reversed_offsets":
        _raw_file(p, {"a": dict(E, data_offsets=[8, 0])}, d8)
    elif case == "nbytes_mismatch":
        _raw_file(p, {"a": dict(E, shape=[3])}, d8)
    elif case == "overlap":
        _raw_file(p, {"a": E, "b": dict(E, data_offsets=[4, 12])}, bytes(12))
    elif case == "hole":
        _raw_file(p, {"a": E, "b": dict(E, data_offsets=[12, 20])}, bytes(20))
    elif case == "hole_at_start":
        _raw_file(p, {"a": dict(E, data_offsets=[4, 12])}, bytes(12))
    elif case == "past_end":
        _raw_file(p, {"a": dict(E, shape=[4], data_offsets=[0, 16])}, d8)
    elif case == "trailing_garbage":
        _raw_file(p, {"a": E}, bytes(12))
    elif case == "bad_metadata":
        _raw_file(p, {"__metadata__": {"format": 1}, "a": E}, d8)
    elif case == "nan_constant":
        _raw_file(p, b'{"__metadata__": {"x": NaN}}')
    elif case == "deep_nesting":
        _raw_file(p, b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    else:  # pragma: no cover
        raise AssertionError(case)
    msg = _refused(p, match)
    assert isinstance(ContainerError(msg), (MoepackError, ValueError))
    with pytest.raises(ContainerError):
        open_shard(p, require_alignment=None)


def test_unaligned_tensor_refused_when_alignment_required(tmp_path):
    header = {"a": E, "b": dict(E, data_offsets=[8, 16])}
    p = tmp_path / "u.safetensors"
    # the data starts 64-aligned, so only 'b' is off
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 64)
    p.write_bytes(struct.pack("<Q", len(js)) + js + bytes(16))
    read_safetensors_header(p)  # valid safetensors
    msg = _refused(p, r"tensor 'b' starts at file offset \d+ \(data_offsets \[8, 16\]\), not a multiple of the required alignment 64", require_alignment=64)
    assert "'a'" not in msg


def test_fuzz_only_container_errors(tmp_path):
    """Random byte flips and truncations of valid files: success or ContainerError, nothing else."""
    ours = tmp_path / "ours.safetensors"
    _write(ours, _tiny_tensors())
    theirs = tmp_path / "theirs.safetensors"
    save_file({k: v.contiguous() for k, v in _tiny_tensors().items()}, theirs)
    bases = []
    for p in (ours, theirs):
        b = p.read_bytes()
        (n,) = struct.unpack("<Q", b[:8])
        json_end = 8 + len(b[8 : 8 + n].rstrip(b" "))
        bases.append((b, json_end))
    rng = random.Random(1234)
    p = tmp_path / "fuzz.safetensors"
    outcomes = {"ok": 0, "refused": 0}
    for i in range(400):
        b, json_end = bases[i % 2]
        b = bytearray(b)
        kind = rng.random()
        if kind < 0.2:
            b = b[: rng.randrange(len(b))]
        elif kind < 0.9:
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(json_end + 8)  # header region and the first data bytes
                if rng.random() < 0.5:
                    b[pos] ^= 1 << rng.randrange(8)
                else:
                    b[pos] = rng.choice(b'{}[]",:0123456789 -eE.aFU\x00\xff')
        else:
            cut = rng.randrange(8, json_end)
            b = b[:cut] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + b[cut:]
        p.write_bytes(bytes(b))
        try:
            s = open_shard(p, require_alignment=None)
            for k in s.names:
                if s.info(k).torch_dtype is not None:
                    sha256_of(s.tensor(k))
                sha256_of(s.raw(k))
            outcomes["ok"] += 1
        except ContainerError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["ok"] > 0, outcomes


def test_missing_file_is_container_error(tmp_path):
    with pytest.raises(ContainerError, match="cannot read"):
        read_safetensors_header(tmp_path / "nope.safetensors")
    with pytest.raises(ContainerError, match="no tensor named 'zz'"):
        p = tmp_path / "ok.safetensors"
        _write(p, _tiny_tensors())
        open_shard(p).tensor("zz")


# --------------------------------------------------------------------------------------------
# atomic_directory


def _siblings(tmp_path, name="dst"):
    return sorted(x for x in os.listdir(tmp_path) if name in x)


def test_atomic_directory_success(tmp_path):
    dst = tmp_path / "dst"
    with atomic_directory(dst) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".dst.tmp-")
        assert not dst.exists()
        _write(tmp / "experts-00001.safetensors", _tiny_tensors())
        (tmp / "moepack.json").write_text("{}")
    assert sorted(os.listdir(dst)) == ["experts-00001.safetensors", "moepack.json"]
    assert _siblings(tmp_path) == ["dst"]
    assert torch.equal(open_shard(dst / "experts-00001.safetensors").tensor("a"), _tiny_tensors()["a"])


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_atomic_directory_failure_leaves_nothing(tmp_path, exc):
    dst = tmp_path / "dst"
    with pytest.raises(exc):
        with atomic_directory(dst) as tmp:
            plan = ShardPlan()
            plan.add("a", torch.float32, (2,))
            plan.add("b", torch.float32, (2,))
            with ShardWriter(tmp / "x.safetensors", plan, fsync=False) as w:
                w.write("a", torch.ones(2))
                raise exc("interrupted mid-write")
    assert not dst.exists()
    assert _siblings(tmp_path) == []


def test_atomic_directory_existing_destination(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(ContainerError, match="already exists"):
        with atomic_directory(dst):
            pass  # pragma: no cover
    assert os.listdir(dst) == ["old.txt"] and _siblings(tmp_path) == ["dst"]
    with atomic_directory(dst, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(dst) == ["new.txt"] and _siblings(tmp_path) == ["dst"]
    # a failed overwrite keeps the old directory intact
    with pytest.raises(RuntimeError):
        with atomic_directory(dst, overwrite=True) as tmp:
            (tmp / "newer.txt").write_text("x")
            raise RuntimeError
    assert os.listdir(dst) == ["new.txt"] and _siblings(tmp_path) == ["dst"]


def test_atomic_directory_overwrite_keeps_old_mappings_valid(tmp_path):
    dst = tmp_path / "dst"
    with atomic_directory(dst) as tmp:
        _write(tmp / "s.safetensors", _tiny_tensors())
    old = open_shard(dst / "s.safetensors").tensor("a")
    with atomic_directory(dst, overwrite=True) as tmp:
        _write(tmp / "s.safetensors", {"a": torch.tensor([9.0, 9.0])})
    assert old.tolist() == [1.0, 2.0]
    assert open_shard(dst / "s.safetensors").tensor("a").tolist() == [9.0, 9.0]
    with pytest.raises(ContainerError, match="parent directory"):
        with atomic_directory(tmp_path / "no" / "such"):
            pass  # pragma: no cover
