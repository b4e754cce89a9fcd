"""`tierstore bench`: the installed benchmarks run at tiny sizes, write JSON with provenance and
plausible numbers; the repo-only ones say where they live; the checkout's wrappers still work."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.cli import main
from tierstore.io.readers.choice import direct_io_supported

ROOT = Path(__file__).resolve().parents[1]


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _skip_without_direct_io(directory: Path) -> None:
    probe = directory / "probe"
    probe.write_bytes(b"\0" * 4096)
    if not direct_io_supported(probe):
        pytest.skip(f"{directory} does not take O_DIRECT")
    probe.unlink()


def test_help_lists_bench():
    out = subprocess.run([sys.executable, "-P", "-m", "tierstore", "--help"], capture_output=True, text=True, check=True)
    assert "bench" in out.stdout


def test_bench_io_writes_json_and_removes_its_scratch_pack(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    _skip_without_direct_io(cache)
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(cache))  # the default scratch location
    out = tmp_path / "io.json"
    assert main(["bench", "io", "--rows", "4", "--repeats", "1", "--depths", "1,2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "% of baseline" in printed and "arena" in printed
    result = json.loads(out.read_text())
    assert result["benchmark"] == "io"
    prov = result["provenance"]
    for key in ("date", "commit", "tierstore", "python", "torch", "cpu", "cpus", "gpu", "disk"):
        assert key in prov
    assert prov["disk"]["fstype"] and prov["disk"]["free_bytes"] > 0
    assert Path(result["scratch_dir"]).parent == cache
    assert list(cache.iterdir()) == []  # scratch pack removed
    assert result["row_bytes"] > 0 and result["stride"] >= result["row_bytes"]
    backends = result["settings"]["backends"]
    assert "preadv-pool" in backends
    rows = result["disk"]
    assert {(r["backend"], r["path"], r["queue_depth"]) for r in rows} == {
        (b, p, d) for b in backends for p in ("raw", "read-then-verify", "arena") for d in (1, 2)}
    for row in rows:
        assert row["bytes"] == 4 * result["stride"]
        for key in ("seconds", "gb_per_s", "baseline_gb_per_s", "pct_of_baseline"):
            assert _positive_finite(row[key]), (key, row)
    assert ("gpu" in result) != ("gpu_skipped" in result)


def test_bench_io_says_when_the_filesystem_refuses_o_direct(tmp_path, monkeypatch, capsys):
    import tierstore.bench.io as bench_io

    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(bench_io.os, "open", no_direct)
    assert main(["bench", "io", "--rows", "4", "--repeats", "1", "--depths", "1", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not support O_DIRECT" in err and "--dir" in err
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_bench_sim_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["bench", "sim", "--tokens", "200", "--repeats", "1", "--json", str(out)]) == 0
    assert "M events/s" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "sim_speed" and result["trace"]["events"] > 0
    assert {(r["policy"], r["engine"]) for r in result["results"]} == {
        ("lru", "fast"), ("belady", "fast"), ("lru", "reference"), ("belady", "reference")}
    for row in result["results"]:
        assert _positive_finite(row["events_per_s"]) and _positive_finite(row["seconds"])
    assert "numba" in result["provenance"] and "cpu" in result["provenance"]


@pytest.mark.parametrize("name, script", [("kernels", "benchmarks/moe_kernels.py"), ("replay", "benchmarks/replay.py"),
                                          ("gate", "benchmarks/gate_cost.py")])
def test_repo_only_benchmarks_print_their_command(name, script, capsys):
    assert main(["bench", name]) == 2  # nothing measured: not a success
    printed = capsys.readouterr().out
    assert "nothing was measured" in printed and script in printed
    assert (ROOT / script).is_file()


def test_bench_list(capsys):
    assert main(["bench", "list"]) == 0
    printed = capsys.readouterr().out
    for name in ("io", "sim", "kernels", "replay", "gate"):
        assert name in printed


def test_io_fetch_script_keeps_its_command_line_and_json(tmp_path):
    _skip_without_direct_io(tmp_path)
    out = tmp_path / "io_fetch.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "io_fetch.py"), "--dir", str(tmp_path / "pack"),
                          "--rows", "4", "--repeats", "1", "--depths", "1", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "qd=  1" in run.stdout and f"wrote {out}" in run.stdout
    result = json.loads(out.read_text())
    for key in ("provenance", "row_bytes", "stride", "disk"):
        assert key in result
    for key in ("date", "commit", "host", "kernel", "python", "torch", "cpus", "liburing"):
        assert key in result["provenance"]
    assert all(_positive_finite(row["pct_of_baseline"]) for row in result["disk"])
    assert any((tmp_path / "pack").iterdir())  # the pack stays for the next run, as before
