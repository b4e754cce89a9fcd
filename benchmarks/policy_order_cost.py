"""The base pool's policy work per decode step on the host, `freq-dense` of this tree against `lru` (`--baseline`: an
older tree's `freq-dense` too), at the presets' pool sizes, all driven through the same steps in one process.

A step as the runtime's pool drives its policy: `begin_step(seconds)`, `observe` of the routed keys (one token,
Zipf-skewed routing per layer), the victim plan while the pass runs (`islice(eviction_order(), plan)`, the last
pass's routed keys plus 16 spares: `DevicePool.plan_victims`), then the hits (`on_access_many`) and, for the misses,
victims from the order less the routed keys (`on_evict_many`) and the inserts (`on_insert_many`). Times the plan
and the whole step, median over the steps after a warm-up, and checks that the two trees' `freq-dense` chose the
same victims. Writes JSON with provenance.

    python3 benchmarks/policy_order_cost.py --baseline 4584795 --json out.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from itertools import islice
from pathlib import Path

import numpy as np

from tierstore.bench.provenance import provenance
from tierstore.cache import policy as policy_module
from tierstore.cache.policy import get_policy
from tierstore.geometry import get_preset

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"ds-v2-lite": 8, "qwen3-30b-a3b": 16, "deepseek-v3": 58}  # preset -> MoE layers driven
COVERAGES = (0.5, 0.25)


def baseline_class(commit: str):
    """`DenseFrequencyPolicy` as `commit` has it (its file loaded apart, not registered)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:tierstore/cache/policies/freq_dense.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "freq_dense_baseline.py"
    path.write_text(source)
    register = policy_module.register_policy
    policy_module.register_policy = lambda name, factory=None, **_: (lambda cls: cls)  # no second "freq-dense"
    try:
        spec = importlib.util.spec_from_file_location("freq_dense_baseline", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        policy_module.register_policy = register
    return module.DenseFrequencyPolicy


def routing(layers: int, experts: int, top_k: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Per step the routed key ids (layer * experts + expert), ascending: one token, Zipf-skewed per layer."""
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, experts + 1) ** 1.1
    probs /= probs.sum()
    orders = [rng.permutation(experts) for _ in range(layers)]
    return [np.sort(np.concatenate([layer * experts + orders[layer][rng.choice(experts, top_k, replace=False,
                                                                               p=probs)] for layer in range(layers)]))
            for _ in range(steps)]


def drive(policy, steps: list[np.ndarray], capacity: int, warmup: int) -> dict:
    """Run `steps` through a pool of `capacity` keys: per step the plan's and the whole step's seconds, and the
    victims chosen."""
    resident: set[int] = set()
    plan_s, step_s, chosen = [], [], []
    plan = len(steps[0]) + 16
    for index, routed in enumerate(steps):
        started = time.perf_counter()
        policy.begin_step(index * 0.005)
        policy.observe(routed)
        planning = time.perf_counter()
        planned = list(islice(policy.eviction_order(), plan))
        planned_s = time.perf_counter() - planning
        keys = routed.tolist()
        hits = [key for key in keys if key in resident]
        misses = [key for key in keys if key not in resident]
        if hits:
            policy.on_access_many(hits)
        lacking = len(resident) + len(misses) - capacity
        victims = list(islice(policy.eviction_order(frozenset(keys)), lacking)) if lacking > 0 else []
        if victims:
            policy.on_evict_many(victims)
            resident.difference_update(victims)
        policy.on_insert_many(misses)
        resident.update(misses)
        if index >= warmup:
            plan_s.append(planned_s)
            step_s.append(time.perf_counter() - started)
        chosen.append((planned[:8], victims))
    return {"plan_us": 1e6 * statistics.median(plan_s), "step_us": 1e6 * statistics.median(step_s), "chosen": chosen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="an older tree's commit to compare (its freq_dense.py from git)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="each policy's runs, taking turns")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    makers = {"freq-dense": lambda: get_policy("freq-dense", half_life=60.0)}
    if args.baseline:
        old = baseline_class(args.baseline)
        makers[f"freq-dense@{args.baseline}"] = lambda: old(half_life=60.0)
    makers["lru"] = lambda: get_policy("lru")
    rows = []
    print(f"{'preset':>14s} {'cov':>4s} {'keys':>6s} {'pool':>5s} " + " ".join(f"{name:>30s}" for name in makers)
          + "   (plan / whole step, us, median)")
    for preset, layers in SHAPES.items():
        g = get_preset(preset)
        total = layers * g.num_experts
        steps = routing(layers, g.num_experts, g.top_k, args.steps)
        for coverage in COVERAGES:
            capacity = round(coverage * total)
            runs: dict[str, list[dict]] = {name: [] for name in makers}
            for round_ in range(args.rounds):
                names = list(makers)[round_ % len(makers):] + list(makers)[:round_ % len(makers)]
                for name in names:
                    runs[name].append(drive(makers[name](), steps, capacity, args.warmup))
            dense = [run["chosen"] for name, group in runs.items() if name != "lru" for run in group]
            same = all(chosen == dense[0] for chosen in dense)
            if not same:
                raise SystemExit(f"{preset} {coverage}: the freq-dense trees chose different victims")
            cells = {name: {"plan_us": statistics.median(r["plan_us"] for r in group),
                            "step_us": statistics.median(r["step_us"] for r in group)} for name, group in runs.items()}
            rows.append({"preset": preset, "layers": layers, "keys": total, "pool": capacity, "coverage": coverage,
                         "same_victims": same, **cells})
            print(f"{preset:>14s} {coverage:4.2f} {total:6d} {capacity:5d} "
                  + " ".join(f"{c['plan_us']:13.1f} / {c['step_us']:13.1f}" for c in cells.values()), flush=True)
    if args.json:
        report = {"provenance": provenance(None), "baseline": args.baseline, "steps": args.steps,
                  "warmup": args.warmup, "rounds": args.rounds, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
