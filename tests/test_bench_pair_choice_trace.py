"""benchmarks/pair_choice_trace.py: the runtime's pair choice over the recorded trace with modelled step times."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module():
    path = ROOT / "benchmarks" / "pair_choice_trace.py"
    spec = importlib.util.spec_from_file_location("bench_pair_choice_trace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_counts_every_step_after_the_warm_up_by_kind_and_outcome(capsys):
    assert _module().main(["--layers", "4", "--experts", "32", "--coverage", "0.5", "--warmup", "10"]) == 0
    first, kinds = capsys.readouterr().out.splitlines()[:2]
    counts = {kind: int(n) for kind, n in re.findall(r"'([Ps][m-])': (\d+)", first)}
    steps = kinds.split()
    assert sum(counts.values()) == len(steps) > 100 and set(steps) <= {"Pm", "P-", "sm", "s-"}
    assert counts.get("sm", 0) + counts.get("Pm", 0) > 0  # the pool at 50 % misses now and then
    mean = float(re.search(r"mean step ([0-9.]+) ms", first).group(1))
    assert 0.39 <= mean <= 0.98  # between the modelled single no-miss and miss times
