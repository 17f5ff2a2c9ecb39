"""CLI options are checked before any work: one line naming the option, its value and the rule,
exit status 2, no traceback and nothing written (issue 49: ``convert --threads 100000``
segfaulted after "can't start new thread", ``--shard-gib inf`` and ``--tokens`` 1e8..1e11 gave
tracebacks, ``--shard-gib nan`` a line that did not name the option, a non-integer ``--tp`` a
multi-line usage box)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import moepack
from moepack.errors import ConvertError
from tests.support.fixtures_util import fixture_dir


def _cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line(r, *needles: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moepack: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bounds") / "p"
    moepack.convert(fixture_dir("qwen3_moe"), d)
    return d


CONVERT = [  # (options, the words of the line)
    (["--threads", "100000"], ["threads=100000: must be a positive integer, at most 1024"]),
    (["--threads", "0"], ["threads=0: must be a positive integer, at most 1024"]),
    (["--threads", "-4"], ["threads=-4: must be a positive integer, at most 1024"]),
    (["--shard-gib", "inf"], ["--shard-gib inf: must be positive and finite"]),
    (["--shard-gib", "nan"], ["--shard-gib nan: must be positive and finite"]),
    (["--shard-gib", "-1"], ["--shard-gib -1.0: must be positive and finite"]),
    (["--tp", "1.5"], ["--tp 1.5: input should be a valid integer"]),
    (["--tp=two"], ["--tp two: input should be a valid integer"]),
    (["--tp", "0"], ["--tp 0: must be positive and at most 65536"]),
    (["--threads", "2.5"], ["--threads 2.5: input should be a valid integer"]),
]


@pytest.mark.parametrize("opts,words", CONVERT, ids=[" ".join(o) for o, _ in CONVERT])
def test_convert_options_are_refused_in_one_line(tmp_path, opts, words):
    dst = tmp_path / "dst"
    _one_line(_cli("convert", fixture_dir("qwen3_moe"), dst, *opts), *words)
    assert not dst.exists() and not list(tmp_path.iterdir())


def test_the_library_refuses_too_many_threads(tmp_path):
    with pytest.raises(ConvertError, match=r"^threads=100000: must be a positive integer, at most 1024"):
        moepack.convert(fixture_dir("qwen3_moe"), tmp_path / "dst", threads=100000)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("tokens", ["100000000", "100000000000", "0", "-3"])
@pytest.mark.parametrize("cmd", ["run", "verify"])
def test_tokens_out_of_range_are_refused(packed, cmd, tokens):
    _one_line(_cli(cmd, packed, "--tokens", tokens), f"--tokens {tokens}: must be positive and at most 65536")


@pytest.mark.parametrize("cmd", ["run", "verify"])
def test_tokens_not_an_integer_are_refused(packed, cmd):
    _one_line(_cli(cmd, packed, "--tokens", "1e8"), "--tokens 1e8: input should be a valid integer")


@pytest.mark.parametrize("tokens,words", [("1,100000000", "--tokens: 100000000 must be a token count in 1..65536"),
                                          ("1e11", "--tokens: '1e11' is not an integer")])  # fmt: skip
def test_bench_tokens_out_of_range_are_refused(tokens, words):
    _one_line(_cli("bench", "--shapes", "tiny", "--tokens", tokens, "--no-probe", "-q"), words)


def test_bench_threads_out_of_range_are_refused():
    _one_line(_cli("bench", "--shapes", "tiny", "--threads", "100000", "--no-probe", "-q"),
              "--threads 100000: must be positive and at most 1024")  # fmt: skip


def test_the_largest_accepted_values_run(packed, tmp_path):
    """The bounds refuse nothing a run needs: --threads 1024 converts (and verifies)."""
    dst = tmp_path / "dst"
    r = _cli("convert", fixture_dir("qwen3_moe"), dst, "--threads", "1024", "--shard-gib", "1e-3")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert moepack.verify(dst).ok
    shutil.rmtree(dst)
