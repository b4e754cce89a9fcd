"""Benchmarks that ship with the package (`tierstore bench`): each measures tierstore's own code
next to a plain baseline in the same run, on the machine it runs on, and returns a JSON-able dict
with its provenance.

- `tierstore.bench.io`: pack -> arena per reader backend and queue depth against a plain O_DIRECT
  read; arena -> GPU against a plain pinned copy (with CUDA).
- `tierstore.bench.sim`: simulator routing events per second, fast path and reference engine.

The GPU kernel, replay and gate benchmarks stay in the source checkout's `benchmarks/` folder;
`REPO_BENCHMARKS` names them and the command that runs each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RepoBenchmark:
    name: str
    script: str  # path inside a source checkout
    what: str
    command: str  # the documented command line, run from the checkout's root
    installed: str | None = None  # an installed command measuring something close, if any


REPO_BENCHMARKS = (
    RepoBenchmark("kernels", "benchmarks/moe_kernels.py",
                  "fused W2 / FP4 MoE kernels beside torch._grouped_mm bf16 and a streaming-read ceiling "
                  "(CUDA + Triton)",
                  "python benchmarks/moe_kernels.py --preset deepseek-v3 --tokens 1,8,32 --config 64,8 "
                  "--json kernels.json"),
    RepoBenchmark("replay", "benchmarks/replay.py",
                  "tiered decode at preset shapes, pool coverage x arena size, beside all-resident and "
                  "naive baselines (CUDA)",
                  "python benchmarks/replay.py --pack-dir /path/on/the/disk --presets ds-v2-lite "
                  "--coverages 0.25,1 --out replay.json",
                  installed="tierstore replay --trace T.npz --preset ds-v2-lite --gpu-pool-frac 0.25 "
                            "--pack-dir /path/on/the/disk"),
    RepoBenchmark("gate", "benchmarks/gate_cost.py",
                  "precision tier: steps/s with W2 only and with the FP4 pool, cost of the armed "
                  "confidence gate and per fire (CUDA)",
                  "python benchmarks/gate_cost.py --presets ds-v2-lite --out gate_cost.json"),
)
