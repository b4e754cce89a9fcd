"""`tierstore inspect`: geometry, expert bytes, budget fit and codebook report of a checkpoint."""

from __future__ import annotations

import argparse
import json

from tierstore.errors import TierstoreError
from tierstore.units import format_bytes, size_argument


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="geometry, expert bytes, budget fit and codebook report of a checkpoint",
        description="Inspect an HF safetensors MoE checkpoint: MoE geometry, routed-expert bytes at "
        "bf16 / FP4 / W2, what fits in a GPU and RAM budget, and the codebook report "
        "(symmetric {-4,-1,1,4} vs the L2-optimal 4-level set) over sampled expert tensors.",
    )
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--demo", action="store_true",
                        help="inspect the built-in tiny NVFP4 Qwen3-MoE checkpoint (built on first use)")
    parser.add_argument("--gpu-gb", type=size_argument, default=None, metavar="SIZE",
                        help="GPU memory budget: GiB, or a size such as 512MiB")
    parser.add_argument("--ram-gb", type=size_argument, default=None, metavar="SIZE",
                        help="host RAM budget for the pinned arena: GiB, or a size such as 512MiB")
    parser.add_argument("--experts-per-layer", type=int, default=4, metavar="N",
                        help="expert tensors sampled per layer for the codebook report (0 = all; default 4)")
    parser.add_argument("--zero-mode", choices=("auto", "sign", "alt"), default="auto",
                        help="zero-sign rule used for the codebook report (default auto)")
    parser.add_argument("--no-codebook", action="store_true", help="skip the codebook report")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierstore.checkpoint import open_checkpoint
    from tierstore.inspection import demo_checkpoint, inspect_checkpoint

    if args.demo == (args.checkpoint is not None):
        raise TierstoreError("give either a checkpoint directory or --demo")
    if args.experts_per_layer < 0:
        raise TierstoreError(f"--experts-per-layer must be >= 0, got {args.experts_per_layer}")
    path = demo_checkpoint(progress=not args.json) if args.demo else args.checkpoint
    with open_checkpoint(path) as checkpoint:
        report = inspect_checkpoint(checkpoint, gpu_bytes=args.gpu_gb, ram_bytes=args.ram_gb,
                                    experts_per_layer=args.experts_per_layer, zero_mode=args.zero_mode,
                                    codebook=not args.no_codebook,
                                    progress=not args.json)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render(report)
    return 0


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    g = report["geometry"]
    console.print(f"[bold]{report['checkpoint']}[/bold]  {report['model_type']}, experts stored as "
                  f"{report['source_format']}")
    geometry = Table(title="MoE geometry", show_header=False)
    for label, value in (
        ("MoE layers", f"{len(g['moe_layers'])} (decoder layers {_ranges(g['moe_layers'])})"),
        ("routed experts / layer", g["num_experts"]),
        ("top-k", g["top_k"]),
        ("shared experts", f"{g['num_shared_experts']} (intermediate {g['shared_inter']})"),
        ("hidden / expert intermediate", f"{g['hidden']} / {g['expert_inter']}"),
        ("activation, SwiGLU clamp", f"{g['activation']}, {g['swiglu_limit'] or 'none'}"),
        ("router scoring, renormalised top-k", f"{g['scoring']}, {g['norm_topk_prob']}"),
    ):
        geometry.add_row(label, str(value))
    console.print(geometry)

    sizes = Table(title="routed-expert bytes")
    for column in ("precision", "per expert", "all routed experts"):
        sizes.add_column(column, justify="right")
    for name, row in report["expert_bytes"].items():
        sizes.add_row(name.upper(), format_bytes(row["per_expert"]), format_bytes(row["total"]))
    console.print(sizes)
    console.print(f"dense tensors (attention, embeddings, routers, shared experts): {format_bytes(report['dense_bytes'])}")

    fit = report["fit"]
    console.print(f"per-step working set (1 token): {fit['working_set_experts']} experts; smallest GPU pool "
                  f"accepted {format_bytes(fit['min_pool_bytes'])}, comfortable {format_bytes(fit['comfortable_pool_bytes'])}")
    if fit["gpu_bytes"] is None:
        console.print("give --gpu-gb (and --ram-gb) to see what fits where")
    else:
        line = (f"GPU {format_bytes(fit['gpu_bytes'])}: {format_bytes(fit['gpu_bytes_for_experts'])} left for experts, "
                f"{fit['gpu_experts']} W2 experts ({fit['gpu_coverage']:.1%} coverage)")
        if "ram_experts" in fit:
            line += f"; RAM {format_bytes(fit['ram_bytes'])}: {fit['ram_experts']} more; on disk: {format_bytes(fit['disk_bytes'])}"
        console.print(line)
        console.print(f"[bold]{fit['verdict']}[/bold]")

    if "codebook" in report:
        _render_codebook(console, report["codebook"])


def _render_codebook(console, summary: dict) -> None:
    from rich.table import Table

    table = Table(title=f"codebook report over {summary['tensors']} expert tensors (unit space)")
    for column in ("codebook", "mean |bias|", "mean rel. RMS error"):
        table.add_column(column, justify="right")
    table.add_row("symmetric {-4,-1,1,4}", f"{summary['mean_abs_bias_sym']:.5f}", f"{summary['mean_rel_rms_sym']:.4f}")
    table.add_row("L2-optimal 4-level", f"{summary['mean_abs_bias_asym']:.5f}", f"{summary['mean_rel_rms_asym']:.4f}")
    console.print(table)
    levels, count = summary["most_common_asym_levels"]
    console.print(f"the L2-optimal set's |bias| is {summary['bias_ratio_asym_over_sym']:.1f}x the symmetric set's, "
                  f"for a rel. RMS error {1 / summary['rel_rms_ratio_sym_over_asym']:.3f}x as large; its most common "
                  f"levels: {{{', '.join(f'{v:g}' for v in levels)}}} ({count} tensors)")
    console.print(f"{{-4,-1,1,4}} is the best symmetric set for {summary['fraction_default_best_sym']:.0%} of tensors")


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2, 5-6'."""
    spans, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            spans.append(f"{start}-{value}" if value != start else str(value))
            start = None
    return ", ".join(spans)
