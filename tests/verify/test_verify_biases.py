"""``moepack verify --source`` checks the routed experts' biases bit for bit (gpt-oss: gate/up
biases interleaved for swigluoai, down biases padded to Np(H)): the packed fp32 values must be the
source's values widened exactly, in packed row order, with zero padding; the output check alone
could miss a changed bias of an expert the seeded tokens never route to.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import moepack
from moepack.verify.run import verify
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import rewrite_tensor, set_element


@pytest.fixture(scope="module", params=[None, "int8"], ids=["bf16", "int8"])
def packed_gpt_oss(request, tmp_path_factory) -> tuple[Path, str | None]:
    dst = tmp_path_factory.mktemp("vb") / f"gpt_oss-{request.param}"
    moepack.convert(fixture_dir("gpt_oss"), dst, quantize=request.param)
    return dst, request.param


def test_biases_are_compared_and_counted(packed_gpt_oss):
    dst, _ = packed_gpt_oss
    report = verify(dst, source=fixture_dir("gpt_oss"))
    assert report.ok, [c.detail for c in report.layers]
    for c in report.layers:
        assert c.tensors[f"moepack.layers.{c.index}.w13_bias"] is True
        assert c.tensors[f"moepack.layers.{c.index}.w2_bias"] is True
    equal, checked = report.weights_checked()
    assert equal == checked and checked == len(report.layers) * (8 if packed_gpt_oss[1] else 4)


# gpt_oss fixture: H=72 (Np=96), I=40 (Ip=64), gate/up interleaved: w13_bias column 3 is up row 1.
@pytest.mark.parametrize(
    "role,idx,value,words",
    [
        ("w13_bias", (1, 3), 9.0, "[expert 1, up row 1] is 9.0"),
        ("w13_bias", (0, 100), 0.5, "[expert 0, padding row 100] is 0.5"),
        ("w2_bias", (2, 5), -4.0, "[expert 2, row 5] is -4.0"),
        ("w2_bias", (0, 80), 1.0, "[expert 0, padding row 80] is 1.0"),
    ],
)
def test_a_changed_bias_fails_verify_by_name(packed_gpt_oss, tmp_path, role, idx, value, words):
    import shutil

    src, _ = packed_gpt_oss
    d = tmp_path / "packed"
    shutil.copytree(src, d)
    name = f"moepack.layers.0.{role}"
    rewrite_tensor(d, name, set_element(idx, value))  # sha256 updated: only the source can tell
    assert verify(d).ok  # the checksum pass alone is clean
    report = verify(d, source=fixture_dir("gpt_oss"))
    assert not report.ok
    c = report.layers[0]
    assert c.tensors[name] is False and not c.weights_exact
    assert f"tensor {name!r} {words}" in c.detail
    assert "must equal it exactly" in c.detail
