"""Replay the pass pair's choice (config `pass_pair_choice`) offline, over step times measured on the GPU.

Each replay JSON's tiered runs (`benchmarks/replay.py`, the default config with pairs) hold per step its wall time and
whether it launched a pair. A step's time depends on its own kind and on the kind of the step before it (a pair
leaves the host work on its gathered rows to the next read and needs spares staged by the step before), so the
steps of each cell (preset, coverage) are pooled by (previous kind, kind), separately for the cold and the steady
steps. A policy is then driven for the same number of cold and steady steps, each step's time drawn at random
from the measured steps of its cell, phase and (previous kind, kind), and the steady mean is reported against the
same cell's measured single-pass run (`tiered_flipped`, `--compare-config pass_pair=0`), with the pairs chosen.

Policies: `library` is `tierstore.runtime.pair_choice.PairChoice("timed")` (every eligible step a sample, windows
of 5, the median decides, exploring steps 16, 32, then 64 apart while the choice holds). The others take a sample only from a step that follows
a step of its own kind, try a kind in runs of two and explore every 16 / 32 / 64 eligible steps (by the gap, 1.1x /
1.25x); they differ in the estimate that decides: `median5`, `mean8` (the window's mean, samples over 3x its median
left out), `ewma25` / `ewma10` (running means, each sample weighing 0.25 / 0.10, capped at 2x the mean),
`trimmed10` (the mean of the last 10 without the top fifth). A model, not a measurement: it knows no more than the
measured steps (drawn independently, so stretches of slow steps and the pool's state after each choice are not
modelled), and a policy's effect on the host is not in it.

    python3 benchmarks/pair_choice_sim.py benchmarks/results/replay_h200_closing17_*.json.gz --seeds 30
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from tierstore.runtime.pair_choice import PairChoice

Cell = dict[str, dict[tuple[bool, bool], list[float]]]  # phase ("cold", "steady") -> (previous, kind) -> ms


def load_cells(paths: list[str]) -> tuple[dict[tuple[str, float], Cell], dict[tuple[str, float], list[float]]]:
    """The measured steps of every cell with pairs: (preset, coverage) -> phase -> (previous kind, kind) -> ms; and
    (preset, coverage) -> the single-pass run's steady step ms."""
    cells: dict[tuple[str, float], Cell] = {}
    singles: dict[tuple[str, float], list[float]] = {}
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
        for result in data["results"]:
            runs = result["runs"]
            if "tiered_flipped" not in runs or not any(runs["tiered"]["steady"]["per_step"]["pairs"]):
                continue
            key = (result["preset"], round(result["coverage"], 3))
            cell = cells.setdefault(key, {"cold": {}, "steady": {}})
            for phase in ("cold", "steady"):
                steps = runs["tiered"][phase]["per_step"]
                kinds = [bool(p) for p in steps["pairs"]]
                for i in range(1, len(kinds)):
                    cell[phase].setdefault((kinds[i - 1], kinds[i]), []).append(steps["ms"][i])
            singles.setdefault(key, []).extend(runs["tiered_flipped"]["steady"]["per_step"]["ms"])
    return cells, singles


class SameKindChoice:
    """The choice with samples only after a step of their own kind, kinds tried in runs of two, and `estimate`
    (a kind's samples, oldest first -> seconds) deciding. Same calls as `PairChoice` (eligible steps only)."""

    def __init__(self, estimate: Callable[[list[float]], float], least: int = 3, run: int = 2,
                 every: tuple[int, int, int] = (16, 32, 64)):
        self.estimate, self.least, self.run, self.every = estimate, least, run, every
        self.samples: dict[bool, list[float]] = {True: [], False: []}
        self.index, self.last, self.timing = 0, None, None

    def faster(self) -> bool | None:
        if min(len(s) for s in self.samples.values()) < self.least:
            return None
        return self.estimate(self.samples[True]) <= self.estimate(self.samples[False])

    def take(self, eligible: bool = True) -> bool:
        self.index += 1
        preferred = self.faster()
        if preferred is None:
            pair = (self.index - 1) // self.run % 2 == 0
        else:
            fast, slow = (self.estimate(self.samples[kind]) for kind in (preferred, not preferred))
            every = self.every[2] if slow > 1.25 * fast else self.every[1] if slow > 1.10 * fast else self.every[0]
            pair = (not preferred) if self.index % every >= every - self.run else preferred
        self.timing = pair if pair == self.last else None
        self.last = pair
        return pair

    def done(self, seconds: float) -> None:
        if self.timing is not None:
            self.samples[self.timing].append(seconds)


def window_mean(samples: list[float]) -> float:
    window = samples[-8:]
    bound = 3 * statistics.median(window)
    return statistics.fmean(s for s in window if s <= bound)


def running_mean(weight: float) -> Callable[[list[float]], float]:
    def estimate(samples: list[float]) -> float:
        mean = samples[0]
        for s in samples[1:]:
            mean += weight * (min(s, 2 * mean) - mean)
        return mean
    return estimate


def trimmed_mean(samples: list[float]) -> float:
    window = sorted(samples[-10:])
    return statistics.fmean(window[:len(window) - len(window) // 5])


POLICIES: dict[str, Callable[[], object]] = {
    "library": lambda: PairChoice("timed"),
    "median5": lambda: SameKindChoice(lambda s: statistics.median(s[-5:])),
    "mean8": lambda: SameKindChoice(window_mean),
    "ewma25": lambda: SameKindChoice(running_mean(0.25)),
    "ewma10": lambda: SameKindChoice(running_mean(0.10)),
    "trimmed10": lambda: SameKindChoice(trimmed_mean),
}


def drive(policy, cell: Cell, seed: int, cold: int, steady: int) -> tuple[float, int]:
    """(mean steady step ms, steady pairs) of `policy` over `cold` + `steady` eligible steps drawn from `cell`."""
    rng, previous, total, pairs = random.Random(seed), None, 0.0, 0
    for i in range(cold + steady):
        phase = "cold" if i < cold else "steady"
        pair = policy.take(True)
        transition = (pair if previous is None else previous, pair)
        drawn = cell[phase].get(transition) or cell["steady"].get(transition) or cell["steady"][pair, pair]
        ms = rng.choice(drawn)
        policy.done(ms / 1e3)
        previous = pair
        if phase == "steady":
            total, pairs = total + ms, pairs + pair
    return total / steady, pairs


def simulate(cells, singles, seeds: int, cold: int, steady: int, policies=POLICIES) -> list[dict]:
    """Per cell and policy: the mean over `seeds` of the steady mean step / the single-pass run's, and the pairs."""
    rows = []
    for (preset, coverage), cell in sorted(cells.items()):
        if (True, True) not in cell["steady"] or (False, False) not in cell["steady"]:
            continue  # a kind never ran twice in a row there: nothing to draw its samples from
        single = statistics.fmean(singles[preset, coverage])
        for name, make in policies.items():
            runs = [drive(make(), cell, seed, cold, steady) for seed in range(seeds)]
            rows.append({"preset": preset, "coverage": coverage, "policy": name,
                         "vs_single": statistics.fmean(ms for ms, _ in runs) / single,
                         "pairs": statistics.fmean(p for _, p in runs), "single_ms": single})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("replays", nargs="+", help="replay JSONs (.json or .json.gz) with per-step times")
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--cold", type=int, default=20, help="cold steps before the steady ones (replay.py --warmup)")
    parser.add_argument("--steady", type=int, default=600)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    missing = [p for p in args.replays if not Path(p).is_file()]
    if missing:
        parser.error(f"no such replay JSON: {', '.join(missing)}")
    cells, singles = load_cells(args.replays)
    if not cells:
        parser.error("no cell with pairs and a single-pass run (--compare-config pass_pair=0) in these files")
    rows = simulate(cells, singles, args.seeds, args.cold, args.steady)
    names = list(POLICIES)
    print(f"{'cell':<22}" + "".join(f"{n:>18}" for n in names) + "   (steady step / single-pass run; pairs)")
    for preset, coverage in sorted({(r["preset"], r["coverage"]) for r in rows}):
        cell = {r["policy"]: r for r in rows if (r["preset"], r["coverage"]) == (preset, coverage)}
        print(f"{preset + ' ' + format(coverage, '.0%'):<22}"
              + "".join(f"{cell[n]['vs_single']:>11.3f}x {cell[n]['pairs']:>4.0f}" for n in names))
    means = {n: statistics.fmean(r["vs_single"] for r in rows if r["policy"] == n) for n in names}
    print(f"{'mean over cells':<22}" + "".join(f"{means[n]:>11.4f}x     " for n in names))
    if args.json:
        args.json.write_text(json.dumps({"seeds": args.seeds, "cold": args.cold, "steady": args.steady,
                                         "replays": args.replays, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
