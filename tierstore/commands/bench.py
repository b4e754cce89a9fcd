"""`tierstore bench`: measure tierstore on this machine, next to a plain baseline in the same run.

    tierstore bench io  [--rows 64] [--repeats 3] [--depths 1,8,32] [--dir DIR] [--json PATH]
    tierstore bench sim [--tokens 20000] [--preset ds-v2-lite] [--json PATH]
    tierstore bench list

`io` writes a scratch pack (a temporary folder under --dir, by default under the cache dir,
removed afterwards) and times pack -> arena for each reader backend against a plain O_DIRECT
read, then arena -> GPU against a plain pinned copy when CUDA is present. `sim` times the
simulator's fast path and reference engine. The GPU kernel, replay and gate benchmarks need the
source checkout; `tierstore bench kernels|replay|gate` prints the command that runs them.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path

from tierstore.errors import ConfigError, TierstoreError


def _depths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--depths needs comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--depths needs integers >= 1, got {text!r}")
    return values


def register(subparsers) -> None:
    from tierstore.bench import REPO_BENCHMARKS

    parser = subparsers.add_parser("bench", help="benchmark tierstore on this machine (io, sim; list)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True

    io = benches.add_parser("io", help="pack -> arena and arena -> GPU against plain O_DIRECT / pinned-copy baselines")
    io.add_argument("--rows", type=int, default=64,
                    help="rows per batch (ds4-flash base rows, 6.75 MiB each; the pack holds 2x; default 64)")
    io.add_argument("--repeats", type=int, default=3, help="timed repeats per path; the best is reported (default 3)")
    io.add_argument("--depths", type=_depths, default=[1, 8, 32], help="queue depths (default 1,8,32)")
    io.add_argument("--backend", action="append", choices=("preadv-pool", "io_uring"),
                    help="measure only this reader backend (repeatable; default every available one)")
    io.add_argument("--dir", help="where the scratch pack goes: a folder on the disk to measure "
                                  "(default: under $TIERSTORE_CACHE_DIR, ~/.cache/tierstore)")
    io.add_argument("--keep", action="store_true", help="keep the scratch pack (reported path) instead of removing it")
    io.add_argument("--no-gpu", action="store_true", help="skip arena -> GPU even with CUDA")
    io.add_argument("--json", help="write the result, with provenance, to this path")
    io.set_defaults(func=run_io)

    sim = benches.add_parser("sim", help="simulator routing events per second, fast path and reference engine")
    sim.add_argument("--tokens", type=int, default=20000, help="synthetic trace length (default 20000)")
    sim.add_argument("--preset", default="ds-v2-lite", help="geometry the trace is shaped like (default ds-v2-lite)")
    sim.add_argument("--repeats", type=int, default=3, help="timed repeats of the fast path (default 3)")
    sim.add_argument("--no-reference", action="store_true", help="skip the (slow) reference engine")
    sim.add_argument("--json", help="write the result, with provenance, to this path")
    sim.set_defaults(func=run_sim)

    listing = benches.add_parser("list", help="what can be measured here and how")
    listing.set_defaults(func=run_list)
    for bench in REPO_BENCHMARKS:
        repo = benches.add_parser(bench.name, help=f"in the source checkout only: {bench.what}")
        repo.set_defaults(func=run_repo, repo_bench=bench)


def _write_json(result: dict, path: str | None) -> None:
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
        print(f"wrote {target}")


def _console():
    from rich.console import Console

    return Console(width=max(100, shutil.get_terminal_size((120, 24)).columns), highlight=False)


def _print_provenance(info: dict) -> None:
    parts = [f"tierstore {info['tierstore']}"]
    if info.get("commit"):
        parts.append(f"commit {info['commit'][:10]}{' (dirty)' if info.get('commit_dirty') else ''}")
    parts += [f"torch {info['torch']}", f"{info['cpu'] or info['machine']} x{info['cpus']}",
              f"GPU {info['gpu'] or 'none'}"]
    disk = info.get("disk")
    if disk:
        parts.append(f"disk {disk.get('device')} ({disk.get('fstype')}) at {disk.get('mount')}")
    print("; ".join(parts))


def run_io(args) -> int:
    from rich.table import Table

    from tierstore.atomic_files import cache_dir
    from tierstore.bench.io import run_io as measure

    if args.rows < 1 or args.repeats < 1:
        raise ConfigError("--rows and --repeats must be >= 1")
    parent = Path(args.dir) if args.dir else cache_dir()
    try:
        parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="bench-io-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"cannot make a scratch folder under {parent}: {exc.strerror}; pass --dir") from exc
    pack_mib = 2 * args.rows * 6.75
    print(f"scratch pack: {scratch} ({pack_mib:.0f} MiB of ds4-flash base rows; "
          f"{'kept' if args.keep else 'removed afterwards'})", flush=True)
    try:
        result = measure(scratch, rows=args.rows, repeats=args.repeats, depths=tuple(args.depths),
                         backends=args.backend, gpu=False if args.no_gpu else None,
                         log=lambda line: print(line, flush=True))
    except OSError as exc:
        raise TierstoreError(f"I/O failed in {scratch}: {exc}; pass --dir on another disk") from exc
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    result["benchmark"] = "io"
    result["scratch_dir"] = str(scratch)

    table = Table(title=f"pack -> arena, {args.rows} rows x {result['stride'] / 2**20:.2f} MiB per batch, "
                        f"best of {args.repeats} (O_DIRECT)")
    for column in ("backend", "path", "QD", "GB/s", "baseline GB/s", "% of baseline"):
        table.add_column(column, justify="left" if column in ("backend", "path") else "right")
    for row in result["disk"]:
        table.add_row(row["backend"], row["path"], str(row["queue_depth"]), f"{row['gb_per_s']:.2f}",
                      f"{row['baseline_gb_per_s']:.2f}", f"{row['pct_of_baseline']:.1f}%")
    console = _console()
    console.print(table)
    console.print("baseline: a plain os.preadv O_DIRECT loop on a thread pool of QD threads, same bytes, "
                  "same memory, same run. raw = tierstore reader only; read-then-verify = reads, then "
                  "checksums; arena = Arena.fetch (checksums overlapped, then publish).")
    if result.get("warning"):
        console.print(f"[bold]warning:[/bold] {result['warning']}")
    if result.get("settings", {}).get("io_uring_unavailable"):
        console.print(f"io_uring not measured: {result['settings']['io_uring_unavailable']}")
    if "gpu" in result:
        gpu = Table(title="arena -> GPU (one copy per row) vs one plain pinned copy_")
        for column in ("path", "GB/s", "baseline GB/s", "% of baseline"):
            gpu.add_column(column, justify="left" if column == "path" else "right")
        for row in result["gpu"]:
            gpu.add_row(row["path"], f"{row['gb_per_s']:.2f}", f"{row['baseline_gb_per_s']:.2f}",
                        f"{row['pct_of_baseline']:.1f}%")
        console.print(gpu)
    else:
        console.print(f"arena -> GPU not measured: {result.get('gpu_skipped')}")
    _print_provenance(result["provenance"])
    _check_finite(result)
    _write_json(result, args.json)
    return 0


def run_sim(args) -> int:
    import os

    os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # before numba is imported: one core, as documented
    from rich.table import Table

    from tierstore.bench.sim import run_sim as measure

    result = measure(tokens=args.tokens, preset=args.preset, repeats=args.repeats,
                     reference=not args.no_reference)
    trace = result["trace"]
    table = Table(title=f"simulator, {trace['preset']}-shaped synthetic trace: {trace['tokens']} tokens, "
                        f"{trace['events']:,} events, {trace['gpu_slots']} GPU slots (25% coverage), one core")
    for column in ("policy", "engine", "M events/s", "target", "seconds"):
        table.add_column(column, justify="left" if column in ("policy", "engine") else "right")
    for row in result["results"]:
        target = (f"{row['target'] / 1e6:.0f} M/s {'met' if row['meets_target'] else 'MISSED'}"
                  if "target" in row else "-")
        table.add_row(row["policy"], row["engine"], f"{row['events_per_s'] / 1e6:.2f}", target,
                      f"{row['seconds']:.4f}")
    console = _console()
    console.print(table)
    console.print("fast = the numba path (compile excluded); reference = the policy-object engine, on a "
                  "trace of max(200, tokens / 20) tokens: it is for semantics, not speed.")
    _print_provenance(result["provenance"])
    _check_finite(result)
    _write_json(result, args.json)
    return 0


def _check_finite(result) -> None:
    def walk(value, where):
        if isinstance(value, float) and not math.isfinite(value):
            raise TierstoreError(f"measured a non-finite value at {where}: the timer resolution is too coarse "
                                 "for this size; use larger sizes")
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{where}[{index}]")
    walk(result, "result")


def run_list(args) -> int:
    from rich.table import Table

    from tierstore.bench import REPO_BENCHMARKS
    from tierstore.bench.provenance import source_checkout

    root = source_checkout()
    table = Table(title="tierstore bench")
    for column in ("name", "measures", "how to run"):
        table.add_column(column)
    table.add_row("io", "pack -> arena per reader backend vs a plain O_DIRECT read; arena -> GPU vs a "
                  "plain pinned copy (CUDA)", "tierstore bench io [--dir DISK] [--json out.json]")
    table.add_row("sim", "simulator events/s (numba fast path, reference engine) on one core",
                  "tierstore bench sim [--json out.json]")
    for bench in REPO_BENCHMARKS:
        table.add_row(bench.name, bench.what, f"source checkout: {bench.command}")
    _console().print(table)
    print(f"source checkout: {root}" if root else
          "the kernels / replay / gate benchmarks are not in the installed package: clone the tierstore "
          "repository and run them from its root")
    return 0


def run_repo(args) -> int:
    from tierstore.bench.provenance import source_checkout

    bench = args.repo_bench
    root = source_checkout()
    print(f"`{bench.name}` is not part of the installed package ({bench.what}); nothing was measured.")
    if root is not None:
        print(f"run it from this checkout:\n  cd {root} && {bench.command}")
    else:
        print(f"run it from a tierstore source checkout's root:\n  {bench.command}")
    if bench.installed:
        print(f"installed command measuring something close:\n  {bench.installed}")
    return 2
