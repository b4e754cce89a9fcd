"""Next-token agreement with an all-FP4 run: bare W2, W2 + FP4 pool, W2 + pool + gate at several tau.

The all-FP4 run decodes greedily; every other configuration is fed the same tokens (teacher
forcing) and scored on whether its argmax equals the all-FP4 argmax at each step. Writes JSON with
provenance. On the demo model (random init) this exercises the machinery; it is weak evidence of
quality (a trained model is needed for that; see docs/precision-tier.md).

    python benchmarks/precision_agreement.py [--checkpoint DIR | --demo] [--tokens 24] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tierstore.checkpoint import open_checkpoint
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.demo import demo_checkpoint
from tierstore.runtime.generation import TieredGenerator
from tierstore.runtime.hf import install_tiered_experts, load_model
from tierstore.runtime.packs import ensure_base_pack, open_base_rows

PROMPTS = ([5, 17, 33, 8, 60, 12], [72, 101, 108, 108, 111, 32, 116], [3, 1, 4, 1, 5, 9, 2, 6])
TAUS = (0.0080, 0.0083, 0.0086, 0.6)  # the random-init demo is near-uniform: its top-1 probability is ~0.8%


def configurations(total: int) -> dict[str, tuple[int, dict]]:
    """name -> (FP4 pool slots, RuntimeConfig fields); pools hold a quarter of the experts at FP4."""
    quarter = max(1, total // 4)
    configs = {"bare W2": (0, {}), "W2 + FP4 pool 25% (freq)": (quarter, dict(fp4_policy="freq"))}
    for tau in TAUS:
        configs[f"W2 + pool 25% (need) + gate tau {tau}"] = (
            quarter, dict(fp4_policy="need", gate=True, gate_tau=tau, force_fp4_pool=True))
    return configs


def run(ckpt, packs, geometry, model, prompt, tokens, fp4_slots, config, forced=None, all_fp4=False):
    total = geometry.total_routed_experts
    runtime = TieredRuntime(geometry, open_base_rows(ckpt, packs), pool_slots=total, arena_slots=0,
                            fp4_source=open_base_rows(ckpt, packs, tag="fp4") if fp4_slots or all_fp4 else None,
                            fp4_slots=total if all_fp4 else (fp4_slots or None),
                            config=RuntimeConfig(kpi_every=0, **config))
    install_tiered_experts(model, runtime)
    with runtime:
        runtime.preload()
        if all_fp4:
            runtime.preload_fp4()
        result = TieredGenerator(model, runtime, len(prompt) + tokens + 1).generate(
            prompt, tokens, keep_logits=True, forced_ids=forced)
        gate = runtime.gate_stats()
    return result, gate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", default="benchmarks/results/precision_agreement_demo_cpu.json")
    args = parser.parse_args()
    ckpt = Path(args.checkpoint) if args.checkpoint else demo_checkpoint(progress=True)
    packs = Path(tempfile.mkdtemp(prefix="tierstore-agreement-"))
    ensure_base_pack(ckpt, packs, device="cpu", tags=("base", "fp4"))
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    model = load_model(ckpt, torch.float32)
    scores = {name: [0, 0, 0, 0] for name in configurations(geometry.total_routed_experts)}  # agree, steps, fired, gate steps
    started = time.time()
    for prompt in PROMPTS:
        reference, _ = run(ckpt, packs, geometry, model, prompt, args.tokens, 0, dict(fp4_policy="need"), all_fp4=True)
        want = [int(l.argmax()) for l in reference.step_logits]
        for name, (slots, config) in configurations(geometry.total_routed_experts).items():
            config = dict(config, fp4_prefill=slots > 0)
            got, gate = run(ckpt, packs, geometry, model, prompt, args.tokens, slots, config, forced=reference.new_ids)
            score = scores[name]
            score[0] += sum(int(l.argmax()) == w for l, w in zip(got.step_logits, want))
            score[1] += len(want)
            score[2] += gate.fired
            score[3] += gate.steps
    rows = [dict(config=name, agreement=a / n, steps=n, fire_rate=(f / g if g else None)) for name, (a, n, f, g) in scores.items()]
    for row in rows:
        fire = "" if row["fire_rate"] is None else f", gate fires {100 * row['fire_rate']:.1f}% of decode steps"
        print(f"{row['config']:<40} agreement with all-FP4 {100 * row['agreement']:.1f}% of {row['steps']} steps{fire}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(
        provenance=dict(device="cpu", host=platform.node(), torch=torch.__version__, commit=commit,
                        date=time.strftime("%Y-%m-%d", time.gmtime()), seconds=round(time.time() - started, 1)),
        checkpoint=str(ckpt.name), geometry=geometry.name, prompts=len(PROMPTS), tokens=args.tokens,
        note="random-init demo model: weak evidence of quality; the L2-optimal asymmetric control is pending",
        rows=rows), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
