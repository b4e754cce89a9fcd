"""benchmarks/fetch_overhead.py: its hooks reach the step's fetch of this tree (CPU worker)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pytest  # noqa: E402
from _cpu_bench import run_rounds  # noqa: E402
from fetch_overhead import PARTS, worker  # noqa: E402


def test_every_steady_fetch_is_timed_in_each_part():
    """At 25 % every steady step fetches: the located fetch (arena.locate, pool.install_located) and the latency
    from the read to its first copy are each timed once per steady step, the parts inside the whole."""
    result = worker(steps=30, warmup=10, device="cpu", coverage=0.25, preset="ds-v2-lite", layers=2)
    assert result["fetches"] == 20
    assert result["rows_per_fetch_call"] > 0
    for part in PARTS:
        assert result[f"{part}_p50_us"] > 0
    assert result["arena_mean_us"] + result["install_mean_us"] <= result["fetch_mean_us"]


def test_a_failing_worker_names_its_tree_and_shows_its_error(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('the worker broke here', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(SystemExit, match=r"(?s)the old tree's worker .* exited 3:.*the worker broke here"):
        run_rounds(script, {"old": tmp_path}, 1, [])
