"""Where the host time of a tiered step goes: cProfile around `drive` on the ds-v2-lite preset (8 layers) at 25%
coverage with a preloaded 4 GiB arena, bf16, CUDA graphs: the replay benchmark's warm case. A diagnostic (cProfile
slows the Python parts), not a timing: the printed step time is the profiled one.

    python3 benchmarks/miss_step_profile.py --coverage 0.25 --steps 200   (CUDA; builds the synthetic pack in /tmp/rp)
"""
import argparse
import cProfile
import pstats
import sys
import time

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from replay import skewed_steps  # noqa: E402

from tierstore.geometry import get_preset  # noqa: E402
from tierstore.runtime import RuntimeConfig, TieredRuntime  # noqa: E402
from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, preload_arena  # noqa: E402
from tierstore.runtime.replay_drive import drive  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--coverage", type=float, default=0.25, help="pool slots over the routed experts")
parser.add_argument("--steps", type=int, default=200, help="profiled steps (after 60 unprofiled)")
args = parser.parse_args()
g = get_preset("ds-v2-lite").with_layers(8)
spec = ensure_synthetic_pack(g, "/tmp/rp")
steps = skewed_steps(g, 60 + args.steps)
cfg = RuntimeConfig(kpi_every=0, force_pool=True, pass_pair=False)  # the single pass's miss step
with TieredRuntime(g, open_synthetic_rows(spec, "/tmp/rp"), pool_slots=round(args.coverage * g.total_routed_experts),
                   arena_slots=int(4 * 2**30) // spec.stride, device="cuda", config=cfg, output_words=1) as rt:
    preload_arena(rt)
    drive(rt, steps[:60], warmup=10, graph=True, readback="folded", dtype=torch.bfloat16)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    out = drive(rt, steps[60:], warmup=0, graph=True, readback="folded", dtype=torch.bfloat16)
    prof.disable()
    step_ms = out["steady"].as_dict()["step_ms"]
    print(f"profiled: {(time.perf_counter() - t) * 1e3 / args.steps:.3f} ms/step (drive: {step_ms:.3f})")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
