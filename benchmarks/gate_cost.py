"""Precision-tier cost benchmark (issue 6, section 5): steps/s with W2 only and with the FP4 pool at
several sizes, the cost of arming the confidence gate when it does not fire (target <= 5%), and
the cost per fire, on synthetic skewed routing with a synthetic per-step confidence. The base
pool holds every expert. Writes benchmarks/results/gate_cost.json with provenance.

    python benchmarks/gate_cost.py [--presets ds-v2-lite] [--layers 8] [--steps 80] [--warmup 20]
        [--fp4-fractions 0.1,0.25,0.5,1] [--gate-fraction 0.25] [--fire-every 4] [--commit HASH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from replay import floats, provenance, skewed_steps

from tierstore.geometry import get_preset
from tierstore.runtime.replay_gate import gate_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--fp4-fractions", default="0.1,0.25,0.5,1")
    parser.add_argument("--gate-fraction", type=float, default=0.25)
    parser.add_argument("--fire-every", type=int, default=4, help="the firing run fires on every N-th step")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs of the forward")
    parser.add_argument("--commit", help="commit of the tree (when it runs without .git)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gate_cost.json"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for preset in args.presets.split(","):
        geometry = get_preset(preset).with_layers(args.layers)
        result = gate_cost(geometry, skewed_steps(geometry, args.steps), fp4_fractions=tuple(floats(args.fp4_fractions)),
                           gate_fraction=args.gate_fraction, fire_every=args.fire_every, device=device,
                           warmup=args.warmup, graph=not args.eager)
        result.update(preset=preset)
        results.append(result)
        for name, run in result["runs"].items():
            s = run["steady"]
            print(f"{preset} {name:>9}: {s['steps_per_s']:8.1f} steps/s  {s['step_ms']:.3f} ms (p50 {s['p50_ms']:.3f} "
                  f"p99 {s['p99_ms']:.3f})  fp4 pairs {100 * run['fp4_pair_share']:.1f}%  fires {s['gate_fired']}", flush=True)
        print(f"{preset}: armed-silent cost {100 * result['armed_cost']:+.1f}% (target <= 5%), "
              f"{result['ms_per_fire']:.3f} ms per fire over {result['fires']} fires", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"provenance": provenance(args.commit), "method": {
        "steps": args.steps, "warmup": args.warmup, "layers": args.layers, "graph": not args.eager,
        "armed_cost": "steady step time, gate armed (confidence 0.99, never fires) / same FP4 pool unarmed - 1",
        "ms_per_fire": "(steady seconds firing run - armed run) / steady fires"}, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
