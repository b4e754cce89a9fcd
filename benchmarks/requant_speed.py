"""CPU requantization speed: the numba path of quantize_w2 and the slot word packing against the
previous torch implementation (still the CUDA path), side by side in one process.

Run: .venv/bin/python benchmarks/requant_speed.py [--n 7168] [--k 2048] [--repeats 5]
     [--pack-experts 2] [--out benchmarks/results/requant_speed_cpu-devbox.json]

Part 1, one matrix [n, k] (float64 holding bf16 values, as FloatMatrix.dequantize returns for a bf16
checkpoint; default a DeepSeek-V3 expert's w2): the stages quantize_w2 (zero mode auto), W2 word
packing (nibbles -> unpacked codes -> slot words) and FP4 word packing, old and new alternating, best of
--repeats; the outputs are checked byte for byte. Part 2, `build_packs --device cpu --tier both`
with the kernel slot codec on a synthetic bf16 checkpoint of one layer x --pack-experts experts at
hidden = k... (H = n, I = k), old and new alternating (best of 2), pack files compared byte for
byte; plus a cProfile of one build each way (top functions by own time; in the new build the
numba kernels' time shows as the lock the calling thread waits on while its row chunks run).
Both paths use torch.get_num_threads() threads (torch's default unless set in the environment).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import functools
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path


@contextlib.contextmanager
def old_path():
    """Route quantize_w2, resolve_zero_mode (in pack_build) and the word packing to the torch code,
    and put back the previous W2Tensor.unpacked_codes and RankShard.w13_rows."""
    from tierstore.formats import w2
    from tierstore.io import pack_build
    from tierstore.kernels import layout

    import torch

    def unpacked_codes(self):  # W2Tensor.unpacked_codes before the numpy path
        table = torch.tensor(w2._NIBBLE_TO_CODE, dtype=torch.uint8, device=self.device)
        return table[self._nibbles.long()]

    def w13_rows(self, tensor):  # RankShard.w13_rows before the world-1 shortcut
        start = self.rank * self.size
        gate, up = tensor[start:start + self.size], tensor[self.inter + start:self.inter + start + self.size]
        return torch.cat((gate, up))

    saved = (w2._quantize_w2_cpu, layout._pack_words_cpu, pack_build.resolve_zero_mode,
             w2.W2Tensor.unpacked_codes, pack_build.RankShard.w13_rows)
    w2._quantize_w2_cpu = lambda weight, zero_mode: None
    layout._pack_words_cpu = lambda values, m: None
    pack_build.resolve_zero_mode = functools.partial(w2.resolve_zero_mode, fast=False)
    w2.W2Tensor.unpacked_codes, pack_build.RankShard.w13_rows = unpacked_codes, w13_rows
    try:
        yield
    finally:
        (w2._quantize_w2_cpu, layout._pack_words_cpu, pack_build.resolve_zero_mode,
         w2.W2Tensor.unpacked_codes, pack_build.RankShard.w13_rows) = saved


def stages(weight):
    """{stage: (seconds, output)} of one matrix through quantize_w2 and both word packings."""
    from tierstore.formats import quantize_w2
    from tierstore.kernels.layout import pack_fp4_words, pack_w2_words

    out = {}
    started = time.perf_counter()
    q = quantize_w2(weight, zero_mode="auto")
    out["quantize_w2"] = (time.perf_counter() - started, (q.nibbles(), q.scale_bytes(), q.zero_mode))
    started = time.perf_counter()
    codes = q.unpacked_codes()
    words = pack_w2_words(codes, q.scale_bytes())
    out["pack_w2_words"] = (time.perf_counter() - started, words)
    started = time.perf_counter()
    words = pack_fp4_words(q.nibbles(), q.scale_bytes())
    out["pack_fp4_words"] = (time.perf_counter() - started, words)
    return out


def same(a, b) -> bool:
    import torch

    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def top_functions(profile: cProfile.Profile, count: int = 8) -> list[dict]:
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": calls, "own_s": round(own, 3),
             "cumulative_s": round(cum, 3)} for (f, line, name), (_, calls, own, cum, _) in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=7168)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pack-experts", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import numba
    import torch

    from tierstore.bench.provenance import provenance
    from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
    from tierstore.io.pack_build import build_packs
    from tierstore.slot_codec import KERNEL_SLOT_CODEC

    torch.manual_seed(0)
    weight = (torch.randn(args.n, args.k, dtype=torch.float64) * 0.02).to(torch.bfloat16).to(torch.float64)
    weight[0, :64] = 0.0  # a few exact zeros of both signs
    weight[1, :8] = -0.0
    stages(weight)  # compile (numba caches to __pycache__) and warm up
    times: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    outputs = {}
    for _ in range(args.repeats):
        for way in ("old", "new"):
            with old_path() if way == "old" else contextlib.nullcontext():
                result = stages(weight)
            for stage, (seconds, value) in result.items():
                times[way].setdefault(stage, []).append(seconds)
            outputs[way] = {stage: value for stage, (_, value) in result.items()}
    identical = all(same(outputs["old"][s], outputs["new"][s]) for s in outputs["old"])

    matrix = {}
    for stage in times["old"]:
        old, new = min(times["old"][stage]), min(times["new"][stage])
        matrix[stage] = {"old_best_s": round(old, 4), "new_best_s": round(new, 4), "speedup": round(old / new, 1),
                         "old_runs_s": [round(t, 4) for t in times["old"][stage]],
                         "new_runs_s": [round(t, 4) for t in times["new"][stage]]}
    old_total = sum(matrix[s]["old_best_s"] for s in matrix)
    new_total = sum(matrix[s]["new_best_s"] for s in matrix)

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        ckpt = write_synthetic_checkpoint(root / "ckpt", num_layers=1, num_experts=args.pack_experts, top_k=1,
                                          hidden=args.n, expert_inter=args.k, seed=0)
        common = dict(tags=("base", "fp4"), device="cpu", progress=False, codec=KERNEL_SLOT_CODEC)
        build_times: dict[str, list[float]] = {"old": [], "new": []}
        profiles = {}
        for repeat in range(3):
            for way in ("old", "new"):
                out = root / f"{way}-{repeat}"
                profile = cProfile.Profile() if repeat == 2 else None
                with old_path() if way == "old" else contextlib.nullcontext():
                    started = time.perf_counter()
                    if profile:
                        profile.enable()
                    build_packs(ckpt, out, **common)
                    if profile:
                        profile.disable()
                    if not profile:
                        build_times[way].append(time.perf_counter() - started)
                if profile:
                    profiles[way] = top_functions(profile)
        names = sorted(p.name for p in (root / "old-0").iterdir())
        packs_identical = names == sorted(p.name for p in (root / "new-0").iterdir()) and all(
            (root / "old-0" / n).read_bytes() == (root / "new-0" / n).read_bytes() for n in names)
        pack_bytes = sum((root / "new-0" / n).stat().st_size for n in names if n.endswith(".pack"))

    per_expert = {way: min(build_times[way]) / args.pack_experts for way in build_times}
    ds_v3_experts = 58 * 256
    result = {
        "benchmark": "requant_speed",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "provenance": provenance(),
        "threads": {"torch": torch.get_num_threads(), "requant_kernel_threads": torch.get_num_threads(),
                    "numba_version": numba.__version__},
        "matrix": {"shape": [args.n, args.k], "dtype": "float64 (bf16 values)", "repeats": args.repeats,
                   "stages": matrix, "old_total_s": round(old_total, 4), "new_total_s": round(new_total, 4),
                   "speedup": round(old_total / new_total, 1), "outputs_identical": identical},
        "pack_build": {"checkpoint": f"synthetic bf16, 1 layer x {args.pack_experts} experts, H={args.n}, "
                                     f"I={args.k}", "tiers": "base+fp4", "device": "cpu",
                       "old_best_s": round(min(build_times["old"]), 3),
                       "new_best_s": round(min(build_times["new"]), 3),
                       "old_runs_s": [round(t, 3) for t in build_times["old"]],
                       "new_runs_s": [round(t, 3) for t in build_times["new"]],
                       "speedup": round(min(build_times["old"]) / min(build_times["new"]), 1),
                       "pack_bytes": pack_bytes, "packs_identical": packs_identical,
                       "per_expert_s": {w: round(s, 3) for w, s in per_expert.items()},
                       "ds_v3_58x256_estimate_h": {w: round(s * ds_v3_experts / 3600, 1)
                                                   for w, s in per_expert.items()},
                       "profile_top_own_time": profiles},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if not (identical and packs_identical):
        raise SystemExit("old and new outputs differ")


if __name__ == "__main__":
    main()
