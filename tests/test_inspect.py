"""`tierstore inspect`, its report functions, the demo checkpoint and size parsing."""

import json
import subprocess
import sys

import pytest

from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.cli import main
from tierstore.errors import TierstoreError
from tierstore.geometry import get_preset
from tierstore.inspection import budget_fit, demo_checkpoint, expert_bytes_table, sampled_experts
from tierstore.units import format_bytes, parse_size

GiB = 2**30


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-moe"
    return write_synthetic_checkpoint(path, arch="qwen3_moe", num_layers=2, num_experts=6, top_k=2,
                                      hidden=128, expert_inter=64, fmt="bf16", seed=3)


def test_expert_bytes_follow_bits_per_weight():
    g = get_preset("deepseek-v3")
    weights = 3 * 7168 * 2048
    table = expert_bytes_table(g)
    assert table["bf16"]["per_expert"] == weights * 2
    assert table["w2"]["per_expert"] == weights * 9 // 32
    assert table["fp4"]["per_expert"] == weights * 17 // 32
    assert table["w2"]["total"] == table["w2"]["per_expert"] * 58 * 256


def test_budget_fit_splits_experts_over_gpu_ram_and_disk():
    g = get_preset("ds-v2-lite")
    w2 = g.w2_expert_bytes
    dense = 3 * GiB
    fit = budget_fit(g, dense, gpu_bytes=dense + 500 * w2 + 7, ram_bytes=300 * w2)
    assert fit["gpu_experts"] == 500
    assert fit["ram_experts"] == 300
    assert fit["disk_bytes"] == (26 * 64 - 800) * w2
    assert fit["working_set_experts"] == 26 * 6
    assert fit["min_pool_bytes"] == -(-26 * 6 * 115 // 100) * w2
    assert "NVMe" in fit["verdict"]
    roomy = budget_fit(g, dense, gpu_bytes=dense + 26 * 64 * w2, ram_bytes=None)
    assert roomy["gpu_coverage"] == 1.0 and roomy["verdict"] == "all W2 experts fit on the GPU"
    tiny = budget_fit(g, dense, gpu_bytes=dense + 10 * w2, ram_bytes=GiB)
    assert tiny["verdict"].startswith("does not run")


def test_sampled_experts_are_spread_and_bounded():
    assert sampled_experts(256, 4) == [0, 85, 170, 255]
    assert sampled_experts(8, 0) == list(range(8))
    assert sampled_experts(3, 10) == [0, 1, 2]
    assert sampled_experts(9, 1) == [0]


def test_inspect_json_report(small_checkpoint, capsys):
    assert main(["inspect", str(small_checkpoint), "--json", "--gpu-gb", "64KiB", "--ram-gb", "1MiB",
                 "--experts-per-layer", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_type"] == "qwen3_moe" and report["source_format"] == "bf16"
    assert report["geometry"]["num_experts"] == 6 and report["geometry"]["top_k"] == 2
    w2_per_expert = 3 * 128 * 64 * 9 // 32
    assert report["expert_bytes"]["w2"]["total"] == 2 * 6 * w2_per_expert
    assert report["dense_bytes"] == 2 * 6 * 128 * 2  # the bf16 routers [E, H] of both layers
    fit = report["fit"]
    assert fit["gpu_experts"] == (64 * 1024 - report["dense_bytes"]) // w2_per_expert == 9
    codebook = report["codebook"]
    assert codebook["tensors"] == 2 * 3 * 2
    # Laplace synthetic weights: the L2-optimal set is sign-asymmetric and buys a little error
    # with a bias several times the symmetric set's (tens of times on large tensors)
    levels, _ = codebook["most_common_asym_levels"]
    assert sorted(-v for v in levels) != sorted(levels)
    assert codebook["mean_abs_bias_asym"] > 4 * codebook["mean_abs_bias_sym"]
    assert codebook["mean_rel_rms_asym"] < codebook["mean_rel_rms_sym"]


def test_inspect_renders_tables(small_checkpoint, capsys):
    assert main(["inspect", str(small_checkpoint), "--gpu-gb", "1MiB", "--experts-per-layer", "1"]) == 0
    out = capsys.readouterr().out
    assert "MoE geometry" in out and "routed-expert bytes" in out and "codebook report over 4" in out
    assert "all W2 experts fit on the GPU" in out


def test_inspect_errors_are_named(tmp_path, capsys):
    assert main(["inspect"]) == 2
    assert "give either a checkpoint directory or --demo" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--gpu-gb", "lots"])
    assert "cannot read size 'lots'" in capsys.readouterr().err


def test_demo_checkpoint_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    first = demo_checkpoint()
    stamp = (first / "config.json").stat().st_mtime_ns
    assert demo_checkpoint() == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging folder left behind


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-P", "-m", "tierstore", "--help"], capture_output=True, text=True, check=True)
    assert "inspect" in out.stdout


@pytest.mark.parametrize("text, expected", [("24", 24 * GiB), ("1.5GiB", 3 * GiB // 2), ("512MiB", 2**29),
                                            ("2GB", 2 * 10**9), ("100 b", 100), (8, 8 * GiB)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_junk_and_format_bytes_reads_back():
    for junk in ("", "GiB", "-1", "1.2.3GiB", "5 parsecs"):
        with pytest.raises(TierstoreError, match="cannot read size"):
            parse_size(junk)
    assert format_bytes(3 * GiB // 2) == "1.5 GiB"
    assert format_bytes(1023) == "1023 B"
