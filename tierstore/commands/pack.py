"""`tierstore pack CHECKPOINT --out DIR`: requantize a checkpoint into pack files (resumable)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser("pack", help="build the pack files (persistent quantization cache) of a checkpoint")
    parser.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="pack directory")
    parser.add_argument("--tier", choices=("base", "fp4", "both"), default="base",
                        help="which tier's pack to build (default: base)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where to requantize (default: cuda when available, else cpu; results are identical)")
    parser.add_argument("--zero-mode", choices=("auto", "sign", "alt"), default="auto",
                        help="sign of exact zeros (default: auto)")
    parser.add_argument("--checkpoint-id", default=None,
                        help="override the checkpoint identity (default: hash of config, index and shard stats)")
    parser.add_argument("--layout", choices=("kernel", "portable"), default="kernel",
                        help="row layout: `kernel` (default) stores rows as the GPU kernels' expert slots, the "
                        "packs `tierstore generate` and the runtime serve; `portable` stores plain packed codes "
                        "and scale bytes (see docs/pack-and-io.md)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel world size: build one pack per rank, each holding its 1/W share of "
                        "every expert's intermediate dimension (default: 1, the single-GPU pack)")
    parser.add_argument("--tp-rank", type=int, default=None,
                        help="build only this tensor-parallel rank's packs (default: every rank of --tp-size, "
                        "all in one pass over the checkpoint)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierstore.errors import TierstoreError
    from tierstore.io.pack_build import build_packs
    from tierstore.io.row_codec import DEFAULT_ROW_CODEC

    if args.layout == "kernel":
        from tierstore.slot_codec import KERNEL_SLOT_CODEC as codec
    else:
        codec = DEFAULT_ROW_CODEC
    tags = ("base", "fp4") if args.tier == "both" else (args.tier,)
    if args.tp_size < 1:
        raise TierstoreError(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.tp_rank is None and args.tp_size > 1:
        return _run_all_ranks(args, tags, codec)
    rank = 0 if args.tp_rank is None else args.tp_rank
    report = build_packs(args.checkpoint, args.out, tags=tags, device=args.device, zero_mode=args.zero_mode,
                         checkpoint_id=args.checkpoint_id, progress=not args.no_progress, codec=codec,
                         rank=rank, world=args.tp_size)
    _print_rank(report, tags, rank, args.tp_size)
    _print_totals(report)
    return 0


def _run_all_ranks(args: argparse.Namespace, tags: tuple[str, ...], codec) -> int:
    """Every rank's packs in one pass: each expert is read and requantized once, then cut per rank."""
    from tierstore.io.pack_build import build_rank_packs

    report = build_rank_packs(args.checkpoint, args.out, tags=tags, device=args.device, zero_mode=args.zero_mode,
                              checkpoint_id=args.checkpoint_id, progress=not args.no_progress, codec=codec,
                              world=args.tp_size)
    for rank, rank_report in report.ranks.items():
        _print_rank(rank_report, tags, rank, args.tp_size)
    print(f"read {len(report.layers_read)} of the checkpoint's layers once for all {args.tp_size} ranks")
    _print_totals(report)
    return 0


def _print_rank(report, tags: tuple[str, ...], rank: int, world: int) -> None:
    for tag in tags:
        print(f"{tag} rank {rank} of {world}: {report.packs[tag]} (wrote {len(report.written[tag])} "
              f"layers, skipped {len(report.skipped[tag])} already built)")


def _print_totals(report) -> None:
    rate = report.bytes_written / report.seconds / 2**20 if report.seconds else 0.0
    print(f"wrote {report.bytes_written / 2**20:.1f} MiB in {report.seconds:.1f} s ({rate:.1f} MiB/s); "
          f"peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB")
