"""How soon the host learns that a pass ended: the pass log's read-back ways, side by side on the same captured work.

Each iteration launches one CUDA graph (a device sleep of about a decode pass, then a small kernel writing the log
buffer), then one of the read-back variants below, and times the host from the launch to the variant's return; the
device work is the same in every variant, so their differences are what each way of waiting costs:

    sync        copy the log buffer to pinned memory, `stream.synchronize()` (what `PassLog.read` does)
    event       the same copy, an event recorded after it, `event.synchronize()`
    stamp_spin  the same copy, then a 4-byte stamp copied after it on the same stream; the host spins on the stamp in
                pinned memory (stream order: the stamp lands after the log and after the graph's last kernel)
    bare        no copy, `stream.synchronize()` (the floor: what a resident step waits for)
    staged_kernel   the graph ends with `stage_log_words` (benchmarks/log_stage.cu: one block writes the log into
                pinned host memory, then a host flag); the host only synchronises (the pass writes its own read-back)
    staged_memcpy   the graph ends with the log's copy to pinned memory as a captured memcpy node; the host only
                synchronises

The staged variants' graphs differ from the others' by that last node (the point: its device cost is in their times).

Variants run interleaved (round robin), so the host's drift falls on all of them alike. Also checks that every
variant returned the log's bytes of its own iteration (a stale read fails the run).

    python3 benchmarks/sync_wake.py --iterations 400 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from log_stage import LogStager

VARIANTS = ("sync", "event", "stamp_spin", "bare", "staged_kernel", "staged_memcpy")


def _graph(buffer: torch.Tensor, counter: torch.Tensor, sleep_cycles: int, stage=None) -> torch.cuda.CUDAGraph:
    """A captured pass: a device sleep, then the log buffer := the pass's counter (bumped on the device), then
    `stage()` when given (the pass's own read-back)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            torch.cuda._sleep(sleep_cycles)
            counter.add_(1)
            buffer.copy_(counter.expand_as(buffer))
            if stage is not None:
                stage()
    torch.cuda.current_stream().wait_stream(side)
    return graph


def run(iterations: int, words: int, sleep_cycles: int) -> dict:
    stream = torch.cuda.current_stream()
    buffer = torch.zeros(words, dtype=torch.int32, device="cuda")  # [words] the pass log
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    host = torch.zeros(words, dtype=torch.int32, pin_memory=True)
    stamp_device = torch.zeros(1, dtype=torch.int32, device="cuda")
    stamp_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    stamp_view, host_view = stamp_host.numpy(), host.numpy()
    event = torch.cuda.Event()
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    flag_view = flag.numpy()
    stager = LogStager()
    graph = _graph(buffer, counter, sleep_cycles)
    graphs = {name: graph for name in VARIANTS}
    graphs["staged_kernel"] = _graph(buffer, counter, sleep_cycles, lambda: stager.stage(buffer, host, flag))
    graphs["staged_memcpy"] = _graph(buffer, counter, sleep_cycles, lambda: host.copy_(buffer, non_blocking=True))
    for each in set(graphs.values()):
        each.replay()
    torch.cuda.synchronize()
    expected = int(counter.item())
    times = {name: [] for name in VARIANTS}
    for i in range(iterations):
        for name in VARIANTS:
            expected += 1
            flag_view[0] = 0
            started = time.perf_counter()
            graphs[name].replay()
            if name == "sync":
                host.copy_(buffer, non_blocking=True)
                stream.synchronize()
            elif name == "event":
                host.copy_(buffer, non_blocking=True)
                event.record(stream)
                event.synchronize()
            elif name == "stamp_spin":
                host.copy_(buffer, non_blocking=True)
                stamp_device.fill_(expected)
                stamp_host.copy_(stamp_device, non_blocking=True)
                while stamp_view[0] != expected:
                    pass
            else:  # bare, and the staged ones: the pass wrote the host copy
                stream.synchronize()
            elapsed = time.perf_counter() - started
            if name == "staged_kernel" and flag_view[0] != 1:
                raise AssertionError(f"staged_kernel: iteration {i} left the flag at {flag_view[0]}")
            if name != "bare" and not (host_view[0] == expected and host_view[-1] == expected):
                raise AssertionError(f"{name}: iteration {i} read {host_view[0]}..{host_view[-1]}, expected {expected}")
            if i >= iterations // 10:  # warm-up left out
                times[name].append(elapsed * 1e6)
    torch.cuda.synchronize()
    bare = statistics.median(times["bare"])
    return {name: {"median_us": statistics.median(t), "p90_us": sorted(t)[int(0.9 * len(t))],
                   "minus_bare_us": statistics.median(t) - bare} for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--words", type=int, default=1600, help="int32 words of the log buffer (ds-v2-lite 8 layers: ~1.6k)")
    parser.add_argument("--sleep-cycles", type=int, default=300_000, help="device sleep per pass (~0.15-0.2 ms)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    result = run(args.iterations, args.words, args.sleep_cycles)
    for name, r in result.items():
        print(f"{name:11s} median {r['median_us']:8.1f} us  p90 {r['p90_us']:8.1f} us  over bare {r['minus_bare_us']:+6.1f} us")
    if args.json is not None:
        provenance = {"commit": args.commit, "torch": torch.__version__, "device": torch.cuda.get_device_name()}
        args.json.write_text(json.dumps({"provenance": provenance, "method": __doc__,
                                         "args": vars(args) | {"json": str(args.json)}, "results": result}, indent=1)
                             + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
