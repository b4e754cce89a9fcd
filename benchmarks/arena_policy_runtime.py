"""The host arena's policy in the runtime itself: pack rows read per steady step with config `arena_policy` `lru`
against `freq-dense`, the same skewed steps through `run_replay` (tiered run, default config otherwise: the pool's
`freq-dense`), on the CPU at a small geometry, GPU pool and arena at fractions of all experts; the tokens of every
run checked against the resident run's. The runtime's counterpart of `arena_policy_sim.py`.

    python3 benchmarks/arena_policy_runtime.py --json benchmarks/results/arena_policy_runtime.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tierstore.bench.provenance import provenance
from tierstore.geometry import MoEGeometry
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, run_replay

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for replay.py's routing (python -P leaves this folder off)
from replay import skewed_steps  # noqa: E402

POLICIES = ("lru", "freq-dense")
CELLS = ((0.1, 0.25), (0.1, 0.5), (0.25, 0.25), (0.25, 0.5))  # (GPU pool, arena) as fractions of all experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    g = MoEGeometry(name="small", moe_layers=tuple(range(args.layers)), num_experts=args.experts, top_k=args.top_k,
                    hidden=64, expert_inter=32)
    steps = skewed_steps(g, args.steps)
    total = g.total_routed_experts
    rows = []
    with tempfile.TemporaryDirectory() as pack_dir:
        spec = ensure_synthetic_pack(g, pack_dir)
        print(f"{g.num_moe_layers} layers x {g.num_experts} experts, top-{g.top_k}, {args.steps} steps: pack rows "
              f"per steady step, {' / '.join(POLICIES)}")
        for gpu, arena in CELLS:
            cell = {"gpu": gpu, "arena": arena}
            for policy in POLICIES:
                result = run_replay(g, lambda: open_synthetic_rows(spec, pack_dir), steps, pool_slots=int(gpu * total),
                                    arena_slots=int(arena * total), device="cpu", warmup=args.warmup, overhead=False,
                                    config=RuntimeConfig(kpi_every=0, force_pool=True, arena_policy=policy))
                steady = result["runs"]["tiered"]["steady"]
                if not result["tokens_match_resident"]:
                    raise SystemExit(f"gpu {gpu} arena {arena} {policy}: tokens differ from the resident run's")
                cell[policy] = sum(steady["per_step"]["arena_miss_rows"]) / steady["steps"]
            rows.append(cell)
            print(f"  GPU {gpu:.0%}, arena {arena:.0%}: " + " / ".join(f"{cell[p]:.2f}" for p in POLICIES)
                  + (f"  ({cell['freq-dense'] / cell['lru']:.2f}x)" if cell["lru"] else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"provenance": provenance(None), "geometry": g.name, "layers": args.layers,
                                         "experts": args.experts, "top_k": args.top_k, "steps": args.steps,
                                         "warmup": args.warmup, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
