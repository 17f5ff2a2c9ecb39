"""``verify --source`` proves the whole model, not only what the manifest lists (issue 12,
defect 1: a pack without a layer, or with another top_k / renormalize, verified with exit 0),
and it streams (its memory does not grow with the number of experts)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import moepack
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import convert_fixtures, edited, rewrite_tensor, set_element
from tests.support.synthetic import mib, peak_rss_child
from tests.container.test_packdir_errors import cli



@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    return convert_fixtures(tmp_path_factory.mktemp("verify_model"), ("qwen3_moe", "deepseek_v3", "gpt_oss"))


def assert_differs(d: Path, fixture: str, *lines: str) -> None:
    """verify --source fails, its report lists ``lines`` among the model differences, and the
    CLI exits 1 printing them; the checksum-only verify passes (the manifest is well formed)."""
    assert moepack.verify(d).ok
    report = moepack.verify(d, source=fixture_dir(fixture))
    assert not report.ok
    for line in lines:
        assert line in report.model, (line, report.model)
        assert f"model: {line}" in report.failures()
    r = cli("verify", d, "--source", fixture_dir(fixture))
    assert r.exit_code == 1, (r.stdout, r.stderr)
    for line in lines:
        assert line in " ".join(r.stdout.split()), r.stdout


def test_the_converted_packs_are_the_source_models(packs):
    for name, d in packs.items():
        report = moepack.verify(d, source=fixture_dir(name))
        assert report.ok and report.model == [], report.failures()
        r = cli("verify", d, "--source", fixture_dir(name))
        assert r.exit_code == 0 and "model: the same MoE layers, experts, routing and carried-over tensors" in r.stdout


# fmt: off
CASES = {
    "a layer removed": ("qwen3_moe", lambda m: m["layers"].pop(1),
                        ["layer 1 (model.layers.1.mlp) is a MoE layer of the source but not in the pack"]),
    "layers = []": ("qwen3_moe", lambda m: m["layers"].clear(),
                    ["layer 0 (model.layers.0.mlp) is a MoE layer of the source but not in the pack",
                     "layer 1 (model.layers.1.mlp) is a MoE layer of the source but not in the pack"]),
    "top_k": ("qwen3_moe", lambda m: m["routing"].update(top_k=1), ["routing.top_k: pack 1, source config 2"]),
    "renormalize": ("qwen3_moe", lambda m: m["routing"].update(renormalize=not m["routing"]["renormalize"]),
                    ["routing.renormalize: pack False, source config True"]),
    "routing dropped": ("qwen3_moe", lambda m: m.update(routing=None), ["routing: pack none, source config has one"]),
    "routed_scaling_factor": ("deepseek_v3", lambda m: m["routing"].update(routed_scaling_factor=1.0),
                              ["routing.routed_scaling_factor: pack 1.0, source config 2.5"]),
    "activation": ("qwen3_moe", lambda m: m["layers"][1].update(activation="gelu"), ["layer 1 activation: pack 'gelu', source 'silu'"]),
    "row order": ("gpt_oss", lambda m: m["layers"][0].update(interleaved=False), ["layer 0 interleaved: pack False, source True"]),
    "swigluoai limit": ("gpt_oss", lambda m: m["layers"][1].update(limit=6.0), ["layer 1 limit: pack 6.0, source 7.0"]),
    "biases dropped": ("gpt_oss", lambda m: [m["layers"][0]["tensors"].pop(r) for r in ("w13_bias", "w2_bias")],
                       ["layer 0 biases: pack False, source True"]),
    "shared expert dropped": ("deepseek_v3", lambda m: m["layers"][0].update(shared=None), ["layer 1 shared expert: pack False, source True"]),
    "router bias dropped": ("gpt_oss", lambda m: m["layers"][0]["router"].pop("bias"),
                            ["layer 0 router: pack {'weight': 'model.layers.0.mlp.router.weight'}, source "
                             "{'weight': 'model.layers.0.mlp.router.weight', 'bias': 'model.layers.0.mlp.router.bias'}"]),
    "a carried tensor dropped": ("qwen3_moe", lambda m: m["tensors"].pop("model.norm.weight"),
                                 ["1 carried-over tensor(s) in the source but not in the pack: 'model.norm.weight'"]),
}
# fmt: on


@pytest.mark.parametrize("case", list(CASES))
def test_a_pack_that_computes_another_model_fails_naming_the_difference(packs, tmp_path, case):
    fixture, edit, lines = CASES[case]
    assert_differs(edited(packs, tmp_path, fixture, edit), fixture, *lines)


def test_a_carried_tensor_with_other_bytes_fails(packs, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(packs["qwen3_moe"], d)
    rewrite_tensor(d, "model.layers.0.input_layernorm.weight", set_element((3,), 2.0))  # sha256 updated: checksums pass
    assert_differs(d, "qwen3_moe", "carried-over tensor 'model.layers.0.input_layernorm.weight': its bytes differ from the source's (sha256)")


def test_blocks_of_experts_give_the_same_verdict(packs, monkeypatch):
    """One expert per step and the whole layer in one step check the same things."""
    from moepack.verify import run as verify_dir

    whole = moepack.verify(packs["deepseek_v3"], source=fixture_dir("deepseek_v3"))
    monkeypatch.setattr(verify_dir, "BLOCK_BYTES", 1)
    one = moepack.verify(packs["deepseek_v3"], source=fixture_dir("deepseek_v3"))
    assert one.ok and whole.ok
    assert [c.tensors for c in one.layers] == [c.tensors for c in whole.layers]
    for a, b in zip(one.layers, whole.layers):
        assert abs(a.rel_err - b.rel_err) <= 1e-6, (a.rel_err, b.rel_err)


def test_a_difference_is_named_at_its_expert_whatever_the_block(packs, tmp_path, monkeypatch):
    from moepack.verify import run as verify_dir
    from tests.support.packdir_edit import set_unpacked

    d = tmp_path / "p"
    shutil.copytree(packs["qwen3_moe"], d)
    rewrite_tensor(d, "moepack.layers.1.w2", set_unpacked(moepack.open(d).layers[1].packed.layout, (6, 3, 5), 1.0))
    monkeypatch.setattr(verify_dir, "BLOCK_BYTES", 1)  # one expert per step: expert 6 is in the 7th
    (msg,) = moepack.verify(d, source=fixture_dir("qwen3_moe")).failures()
    assert "tensor 'moepack.layers.1.w2' [expert 6, row 3, col 5] is 1.0" in msg and "in experts 6..6" in msg, msg


def _verify_growth(tmp_path: Path, experts: int, block_bytes: int) -> int:
    """Peak RSS growth (the child's own VmHWM) of verify --source on a one-layer synthetic model."""
    from tests.support.synthetic import write_synthetic_checkpoint

    src, dst = tmp_path / f"src{experts}", tmp_path / f"dst{experts}"
    write_synthetic_checkpoint(src, layers=1, experts=experts, hidden=512, intermediate=256)
    moepack.convert(src, dst)
    r = peak_rss_child(
        "import moepack.verify.run, moepack.routing, moepack.convert.run",
        """
        moepack.verify.run.BLOCK_BYTES = int(sys.argv[3])
        result = {"ok": moepack.verify(sys.argv[1], source=sys.argv[2]).ok}
        """,
        [dst, src, block_bytes],
        timeout=300,
    )
    assert r["ok"]
    return (r["hwm_kib"] - r["base_kib"]) * 1024


def test_verify_memory_does_not_grow_with_the_expert_count(tmp_path):
    """4 experts or 64 (one layer, H=512, I=256: 48 MiB of bf16 experts), verify --source with
    2-expert blocks peaks at the same RSS: it holds a block of experts, not a layer. (The
    whole-layer verify of before issue 12 grew by 34 MiB and 439 MiB.)"""
    block = 2 * 12 * 512 * 256  # two experts' fp32 weights
    few, many = _verify_growth(tmp_path, 4, block), _verify_growth(tmp_path, 64, block)
    layer = 64 * 3 * 512 * 256 * 2
    msg = f"verify's peak RSS grew by {mib(few)} with 4 experts, {mib(many)} with 64 (their layer: {mib(layer)} of bf16)"
    assert many - few < layer / 2, msg
    print(msg)
