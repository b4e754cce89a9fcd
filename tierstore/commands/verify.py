"""`tierstore verify DIR`: check every pack in DIR; exit 0 only when all is sound."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser("verify", help="check pack files against their sidecars and row checksums")
    parser.add_argument("directory", help="pack directory (as given to `tierstore pack --out`)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierstore.io.verify import verify_directory

    reports = verify_directory(args.directory)
    if not reports:
        print(f"no packs found in {args.directory}")
        return 1
    for report in reports:
        if report.problem is not None:
            print(f"BAD   {report.sidecar.name}: {report.problem}")
        for layer, expert in report.bad_rows:
            print(f"BAD   {report.sidecar.name}: row (layer {layer}, expert {expert}) fails its checksum")
        if report.sound:
            print(f"ok    {report.sidecar.name}: {report.layers} layers, {report.rows_checked} rows")
    return 0 if all(r.sound for r in reports) else 1
