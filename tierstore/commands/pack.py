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
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierstore.io.pack_build import build_packs
    from tierstore.io.row_codec import DEFAULT_ROW_CODEC

    if args.layout == "kernel":
        from tierstore.slot_codec import KERNEL_SLOT_CODEC as codec
    else:
        codec = DEFAULT_ROW_CODEC
    tags = ("base", "fp4") if args.tier == "both" else (args.tier,)
    report = build_packs(args.checkpoint, args.out, tags=tags, device=args.device, zero_mode=args.zero_mode,
                         checkpoint_id=args.checkpoint_id, progress=not args.no_progress, codec=codec)
    for tag in tags:
        print(f"{tag}: {report.packs[tag]} (wrote {len(report.written[tag])} layers, "
              f"skipped {len(report.skipped[tag])} already built)")
    rate = report.bytes_written / report.seconds / 2**20 if report.seconds else 0.0
    print(f"wrote {report.bytes_written / 2**20:.1f} MiB in {report.seconds:.1f} s ({rate:.1f} MiB/s); "
          f"peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB")
    return 0
