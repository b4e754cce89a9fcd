"""The timing rounds and table shared by benchmarks/h2d_batch.py and benchmarks/h2d_gather.py: each round runs every
variant once on a fresh plan of rows, host time of the issuing call by perf_counter, device time by two events on
the copy stream; medians after the first 5 rounds."""
import statistics
import time

import torch

WARM_ROUNDS = 5  # rounds left out of the medians


def timed_rounds(variants: dict, plan, stream, rounds: int, total_bytes: int) -> dict:
    """{name: device_ms, gbps, host_issue_us} for `variants` {name: fn(*plan())} run `rounds` times on `stream`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device_ms = {name: [] for name in variants}
    host_us = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            args = plan()
            stream.synchronize()
            start.record(stream)
            t = time.perf_counter()
            fn(*args)
            host_us[name].append((time.perf_counter() - t) * 1e6)
            end.record(stream)
            end.synchronize()
            device_ms[name].append(start.elapsed_time(end))
    results = {}
    for name in variants:
        ms = statistics.median(device_ms[name][WARM_ROUNDS:])
        results[name] = dict(device_ms=ms, gbps=total_bytes / ms / 1e6,
                             host_issue_us=statistics.median(host_us[name][WARM_ROUNDS:]))
    return results


def print_table(results: dict, rows: int, row_bytes: int, layers: int, rounds: int) -> None:
    """The results against the `per_row` variant's device time."""
    base = results["per_row"]["device_ms"]
    print(f"{rows} rows x {row_bytes} B over {layers} layers ({rows * row_bytes / 1e6:.1f} MB), "
          f"median of {rounds - WARM_ROUNDS}:")
    print(f"{'variant':20s} {'device ms':>10s} {'GB/s':>7s} {'host us':>8s} {'device x per_row':>16s}")
    for name, r in results.items():
        print(f"{name:20s} {r['device_ms']:10.3f} {r['gbps']:7.1f} {r['host_issue_us']:8.1f} "
              f"{base / r['device_ms']:16.3f}")


def check_rows(name: str, pool, arena, src, dst) -> None:
    """After variant `name` ran (synchronized): pool slot dst[i] holds arena row src[i] for every i, else exit."""
    for s, d in zip(src, dst):
        if not torch.equal(pool[d].cpu(), arena[s]):
            raise SystemExit(f"{name}: slot {d} != arena row {s}")
    print(f"{name}: bytes checked", flush=True)
