"""Tensor-parallel rank packs: W per-rank passes (`build_packs(rank=r)` for every r, the old
`tierstore pack --tp-size W`) against one pass for all ranks (`build_rank_packs`), side by side.

Run: .venv/bin/python benchmarks/pack_ranks.py [--world 4] [--layers 8] [--experts 16] [--hidden 256]
     [--inter 128] [--tier both] [--repeats 2]

Both builds run in this one process on the same synthetic checkpoint (CPU, kernel-slot rows, the
CLI's defaults), alternating, each into a fresh directory; the script checks that both wrote the
same files byte for byte and prints the wall times (best of --repeats), the requantize calls and
the checkpoint bytes read (the synthetic checkpoint sits in the page cache, so its reads are cheap
here; from a cold disk the per-rank builds read it W times).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=128)
    parser.add_argument("--tier", choices=("base", "fp4", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch

    from tierstore.checkpoint.files import TensorFiles
    from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
    from tierstore.io import pack_build
    from tierstore.slot_codec import KERNEL_SLOT_CODEC

    torch.set_num_threads(1)  # the shared dev VM; both builds get the same
    tags = ("base", "fp4") if args.tier == "both" else (args.tier,)
    calls = {"n": 0}
    real = pack_build.requantize

    def counting(*a):
        calls["n"] += 1
        return real(*a)

    pack_build.requantize = counting
    read, read_row = TensorFiles.read, TensorFiles.read_row

    def counted(method):
        def wrapper(self, *a):
            tensor = method(self, *a)
            calls["bytes"] += tensor.numel() * tensor.element_size()
            return tensor
        return wrapper

    TensorFiles.read, TensorFiles.read_row = counted(read), counted(read_row)
    common = dict(tags=tags, device="cpu", progress=False, codec=KERNEL_SLOT_CODEC)

    def per_rank(out: Path) -> None:
        for rank in range(args.world):
            pack_build.build_packs(ckpt, out, rank=rank, world=args.world, **common)

    def one_pass(out: Path) -> None:
        pack_build.build_rank_packs(ckpt, out, world=args.world, **common)

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        ckpt = write_synthetic_checkpoint(root / "ckpt", num_layers=args.layers, num_experts=args.experts, top_k=2,
                                          hidden=args.hidden, expert_inter=args.inter, seed=0)
        times: dict[str, list[float]] = {"per-rank": [], "one-pass": []}
        requants: dict[str, int] = {}
        read_bytes: dict[str, int] = {}
        for repeat in range(args.repeats):
            for name, build in (("per-rank", per_rank), ("one-pass", one_pass)):
                out = root / f"{name}-{repeat}"
                calls.update(n=0, bytes=0)
                started = time.perf_counter()
                build(out)
                times[name].append(time.perf_counter() - started)
                requants[name] = calls["n"]
                read_bytes[name] = calls["bytes"]
        old, new = root / "per-rank-0", root / "one-pass-0"
        names = sorted(p.name for p in old.iterdir())
        same = names == sorted(p.name for p in new.iterdir()) and all(
            (old / n).read_bytes() == (new / n).read_bytes() for n in names)
        packed = sum((new / n).stat().st_size for n in names if n.endswith(".pack"))

    print(f"checkpoint: {args.layers} layers x {args.experts} experts, H={args.hidden}, I={args.inter}, bf16; "
          f"tier {args.tier}; W={args.world}; {len(names)} files, {packed / 2**20:.1f} MiB of packs")
    for name in times:
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:9s} best {min(times[name]):6.2f} s  (runs: {runs})  requantize calls {requants[name]}, "
              f"checkpoint read {read_bytes[name] / 2**20:.1f} MiB")
    print(f"speed-up {min(times['per-rank']) / min(times['one-pass']):.2f}x; files byte-identical: {same}")


if __name__ == "__main__":
    main()
