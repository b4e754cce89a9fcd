"""Host time of the install's stream-ordering calls, torch's form against the driver's (`StreamOps`), side by side in
one process on one CUDA device: the current stream, an event record, a stream's wait on an event, and the located
install's whole ordering (current stream, record, wait, two records: what `_issue_streamed` makes besides its
copies). (At aba1411 it also timed an event's query and the time between two events through the driver: slower than
torch's, 0.98 against 0.54 and 2.03 against 1.49 us, so the pool kept torch's for those.)

Each variant runs `--calls` times per round, the variants taking turns round by round; the table gives the median
over rounds of the mean per call, microseconds, and the ratio driver / torch. The work queued is only event
records and waits (nothing to wait for), synchronised between rounds.

    python3 benchmarks/stream_ops_cost.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierstore.runtime.stream_ops import StreamOps  # noqa: E402


def variants(ops: StreamOps, copy: torch.cuda.Stream):
    """(name, torch's form, the driver's form) of each call, each a no-argument function."""
    device = torch.cuda.current_device()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    handles = [ops.handle(mark) for mark in marks]
    copy_handle = copy.cuda_stream

    def torch_ordering():
        compute = torch.cuda.current_stream(device)
        marks[0].record(compute)
        copy.wait_event(marks[0])
        marks[1].record(copy)
        marks[2].record(copy)

    def driver_ordering():
        compute = ops.current()
        ops.record(handles[0], compute)
        ops.wait(copy_handle, handles[0])
        ops.record(handles[1], copy_handle)
        ops.record(handles[2], copy_handle)

    return [("current stream", lambda: torch.cuda.current_stream(device), ops.current),
            ("event record", lambda: marks[1].record(copy), lambda: ops.record(handles[1], copy_handle)),
            ("stream waits on event", lambda: copy.wait_event(marks[0]), lambda: ops.wait(copy_handle, handles[0])),
            ("install ordering (5 calls)", torch_ordering, driver_ordering)]


def per_call_us(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stream_ops_cost.py needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    ops, copy = StreamOps(device), torch.cuda.Stream(device)
    rows = []
    for name, torch_form, driver_form in variants(ops, copy):
        times = {"torch": [], "driver": []}
        for _ in range(args.rounds):
            for form, fn in (("torch", torch_form), ("driver", driver_form)):
                times[form].append(per_call_us(fn, args.calls))
                torch.cuda.synchronize()
        torch_us, driver_us = statistics.median(times["torch"]), statistics.median(times["driver"])
        rows.append({"call": name, "torch_us": torch_us, "driver_us": driver_us, "ratio": driver_us / torch_us})
    print(f"{'call':30s} {'torch us':>9s} {'driver us':>10s} {'driver/torch':>13s}")
    for row in rows:
        print(f"{row['call']:30s} {row['torch_us']:9.2f} {row['driver_us']:10.2f} {row['ratio']:12.2f}x")
    if args.json:
        report = {"provenance": {"commit": args.commit, "torch": torch.__version__,
                                 "device": torch.cuda.get_device_name(device), "calls": args.calls,
                                 "rounds": args.rounds}, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
