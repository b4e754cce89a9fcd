"""Host cost of the step protocol on CPU, old tree vs new tree in one run.

Two workloads, each timed through `TieredRuntime.step` with a forward that does only what a
CUDA-graph replay leaves for the host to read (the pass log's routed counts, no misses), so what
is timed is the protocol around the forward:

- `nomiss`: ds-v2-lite routing shape (8 MoE layers, 64 experts, top-6, one token per step),
  every expert resident, no FP4 tier: the host work of a step at 100% coverage.
- `nomiss_token`: `nomiss` plus a decoder's readback of a sampled token every step (here
  `argmax` of the routed counts): a tree whose runtime has `publish` (output_words) folds it into
  the pass-log read; an older tree reads it back after the step (`int(token)`); `readback` in the
  result says which.
- `nomiss_async`: `nomiss` with an emulated asynchronous device: the forward "launches" a device
  pass of `--device-us` (500 us, about the H200's 8-layer ds-v2-lite step) and the pass log's
  read waits for it first, as its sync would. Host work between the launch and the read overlaps
  the device; what is left after it is exposed: `exposed_us` = step - device time.
- `fp4_held`: `nomiss` with an FP4 pool (25% of the experts) preloaded and its manager paused:
  what the FP4 tier adds to the host work of a step at held residency (compare with `nomiss`).
- `fp4`: the same routing with an FP4 pool (25% of the experts, filled lazily by the manager from
  host RAM (`MemoryRowSource`, as in `benchmarks/gate_cost.py`) through an FP4 arena); the forward sleeps `--forward-ms` (a device forward during which
  the host waits, GIL released). Reports how long the runner waited for the FP4 tier's lock per
  step, and how long the manager held it, split into its host reads (arena fetch) and its device
  installs; and what the manager achieved (windows taken, rows promoted, FP4 share of routed pairs).

The parent process alternates rounds between the trees (`--baseline REV`, checked out as a git
worktree, and the working tree), each round a fresh subprocess importing that tree's tierstore.

    python benchmarks/step_overhead.py --baseline 8cf37d1 --out benchmarks/results/step_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

from _cpu_bench import baseline_worktree, emit, git_out, run_rounds as run_tree_rounds, wrap_timed

LAYERS, EXPERTS, TOP_K = 8, 64, 6


def routing_sequence(steps: int, seed: int):
    """int32 [steps, L, E] routed counts: per layer top-k distinct experts drawn Zipf(1.1)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, EXPERTS + 1) ** 1.1
    weights /= weights.sum()
    seen = np.zeros((steps, LAYERS, EXPERTS), dtype=np.int32)
    for s in range(steps):
        for layer in range(LAYERS):
            seen[s, layer, rng.choice(EXPERTS, TOP_K, replace=False, p=weights)] = 1
    return seen


class TiledRows:
    """A RowSource of a few random rows tiled over every (layer, expert) (the base pool's preload)."""

    def __init__(self, rows, num_layers: int, num_experts: int):
        self.rows, self.num_layers, self.num_experts = rows, num_layers, num_experts
        self.row_bytes = rows.shape[1]
        self.stride = -(-self.row_bytes // 4096) * 4096

    def has_layer(self, layer: int) -> bool:
        return 0 <= layer < self.num_layers

    def read_rows(self, keys, dests) -> None:
        for (layer, expert), dest in zip(keys, dests, strict=True):
            dest[:self.row_bytes] = memoryview(self.rows[(layer * self.num_experts + expert) % len(self.rows)].numpy())


class TimedLock:
    """Wraps the tier's RLock: wait time of the runner (main thread), hold time of the manager."""

    def __init__(self, lock):
        self.lock, self.runner_wait, self.manager_hold = lock, [], 0.0
        self._depth = threading.local()

    def acquire(self, *args, **kwargs):
        started = time.perf_counter()
        got = self.lock.acquire(*args, **kwargs)
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            if threading.current_thread() is threading.main_thread():
                self.runner_wait.append(time.perf_counter() - started)
            self._depth.since = time.perf_counter()
        self._depth.n = depth + 1
        return got

    def release(self):
        self._depth.n -= 1
        if self._depth.n == 0 and threading.current_thread() is not threading.main_thread():
            self.manager_hold += time.perf_counter() - self._depth.since
        self.lock.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def timed(owner, name: str, totals: dict, lock: TimedLock):
    """Wrap owner.name: seconds spent in it by the manager thread, split by whether the lock was held."""
    def record(started: float) -> None:
        if threading.current_thread() is not threading.main_thread():
            held = getattr(lock._depth, "n", 0) > 0
            key = f"manager_{name}_{'locked' if held else 'unlocked'}_s"
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - started
    wrap_timed(owner, name, record)


def worker(kind: str, steps: int, forward_ms: float, device_us: float = 0.0) -> dict:
    import torch

    from tierstore.geometry import MoEGeometry
    from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
    from tierstore.runtime.synthetic import random_experts, tiled_rows

    torch.set_num_threads(1)
    hidden, inter = (1024, 704) if kind == "fp4" else (128, 128)
    g = MoEGeometry("ds-v2-lite-routing", tuple(range(LAYERS)), EXPERTS, TOP_K, hidden, inter)
    base = TiledRows(random_experts(g, False, 4), LAYERS, EXPERTS)
    fp4 = dict(fp4_source=MemoryRowSource(tiled_rows(g, True)), fp4_slots=LAYERS * EXPERTS // 4,
               fp4_arena_slots=LAYERS * EXPERTS // 2) if kind in ("fp4", "fp4_held") else {}
    seen = torch.from_numpy(routing_sequence(steps, seed=1))
    folded = False
    if kind == "nomiss_token":
        try:
            runtime = TieredRuntime(g, base, pool_slots=LAYERS * EXPERTS, config=RuntimeConfig(kpi_every=0),
                                    output_words=1)
            folded = True
        except TypeError:  # a tree before output_words / publish
            runtime = TieredRuntime(g, base, pool_slots=LAYERS * EXPERTS, config=RuntimeConfig(kpi_every=0))
    else:
        runtime = TieredRuntime(g, base, pool_slots=LAYERS * EXPERTS, config=RuntimeConfig(kpi_every=0), **fp4)
    runtime.preload()
    if kind == "fp4_held":
        runtime.preload_fp4([divmod(i, EXPERTS) for i in range(0, LAYERS * EXPERTS, 4)])
        assert runtime.pause_fp4_manager(60)
    totals: dict = {}
    lock = None
    if kind == "fp4":
        lock = runtime.fp4.lock = TimedLock(runtime.fp4.lock)
        timed(runtime.fp4.arena, "fetch", totals, lock)
        timed(runtime.fp4.pool, "install", totals, lock)
    device_done = [0.0]
    if kind == "nomiss_async":
        host_read = runtime.log.read

        def read():  # the read's sync: the emulated device pass must be over first
            while time.perf_counter() < device_done[0]:
                pass
            return host_read()
        runtime.log.read = read
    times, tokens = [], 0
    for step in range(steps):
        def forward(counts=seen[step]):
            device_done[0] = time.perf_counter() + device_us / 1e6  # launched
            runtime.log.reset()
            runtime.log.seen.copy_(counts)
            if forward_ms:
                time.sleep(forward_ms / 1e3)
            if kind == "nomiss_token":
                token = counts.view(-1).argmax().view(1)  # [1]
                if folded:
                    runtime.publish(token)
                return token
        started = time.perf_counter()
        token, outcome = runtime.step(forward, lambda: None)
        if kind == "nomiss_token":
            tokens += int(outcome.last_pass.outputs[0]) if folded else int(token[0])
        times.append(time.perf_counter() - started)
    runtime.wait_fp4_manager(60)
    out = dict(steps=steps, step_mean_us=1e6 * statistics.fmean(times), step_p50_us=1e6 * statistics.median(times))
    if kind == "nomiss_token":
        out.update(readback="folded" if folded else "separate", token_sum=tokens)
    if kind == "nomiss_async":
        out.update(device_us=device_us, exposed_p50_us=out["step_p50_us"] - device_us)
    if lock is not None:
        stats = runtime.fp4_stats()
        out.update(runner_lock_wait_mean_us=1e6 * statistics.fmean(lock.runner_wait),
                   runner_lock_wait_max_us=1e6 * max(lock.runner_wait),
                   manager_lock_hold_s=lock.manager_hold, promoted_lazy=stats.promoted_lazy,
                   manager_windows=runtime._fp4_manager.windows, fp4_pair_share=stats.fp4_pair_share,
                   **{k: round(v, 6) for k, v in sorted(totals.items())})
    runtime.close()
    return out


def run_rounds(trees: dict[str, Path], kind: str, rounds: int, steps: int, forward_ms: float,
               device_us: float = 0.0) -> dict:
    return run_tree_rounds(__file__, trees, rounds, [kind, "--steps", str(steps), "--forward-ms", str(forward_ms),
                                                     "--device-us", str(device_us)])


def summary(rows: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("nomiss", "nomiss_token", "nomiss_async", "fp4_held", "fp4"))
    parser.add_argument("--skip-fp4", action="store_true", help="only the no-miss workloads")
    parser.add_argument("--device-us", type=float, default=500.0, help="emulated device pass of nomiss_async")
    parser.add_argument("--baseline", default="8cf37d1", help="git revision of the old tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--fp4-steps", type=int, default=300)
    parser.add_argument("--forward-ms", type=float, default=0.5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.forward_ms, args.device_us)))
        return
    repo = Path(__file__).resolve().parent.parent
    head = git_out(repo, "rev-parse", "HEAD").strip()
    dirty = bool(git_out(repo, "status", "--porcelain", "tierstore").strip())
    with baseline_worktree(repo, args.baseline) as old:
        trees = {"old": old, "new": repo}
        nomiss = run_rounds(trees, "nomiss", args.rounds, args.steps, 0.0)
        token = run_rounds(trees, "nomiss_token", args.rounds, args.steps, 0.0)
        emulated = run_rounds(trees, "nomiss_async", args.rounds, args.steps, 0.0, args.device_us)
        held = run_rounds(trees, "fp4_held", args.rounds, args.steps, 0.0)
        fp4 = {} if args.skip_fp4 else run_rounds(trees, "fp4", args.rounds, args.fp4_steps, args.forward_ms)
    report = dict(
        provenance=dict(old=args.baseline, new=head, new_tree_dirty=dirty, python=platform.python_version(),
                        machine=platform.machine(), cpus=os.cpu_count(), rounds=args.rounds,
                        note="CPU only: no GPU; the forward is a pass-log write (+ sleep in fp4)"),
        nomiss=nomiss, nomiss_token=token, nomiss_async=emulated, fp4_held=held, fp4=fp4,
        medians=dict(
            nomiss_step_us={k: summary(v, "step_p50_us") for k, v in nomiss.items()},
            nomiss_token_step_us={k: summary(v, "step_p50_us") for k, v in token.items()},
            nomiss_token_readback={k: v[0]["readback"] for k, v in token.items()},
            nomiss_async_exposed_us={k: summary(v, "exposed_p50_us") for k, v in emulated.items()},
            fp4_held_step_us={k: summary(v, "step_p50_us") for k, v in held.items()},
            fp4_step_mean_us={k: summary(v, "step_mean_us") for k, v in fp4.items()},
            fp4_runner_lock_wait_mean_us={k: summary(v, "runner_lock_wait_mean_us") for k, v in fp4.items()},
            fp4_manager_lock_hold_s={k: summary(v, "manager_lock_hold_s") for k, v in fp4.items()},
            fp4_promoted_lazy={k: summary(v, "promoted_lazy") for k, v in fp4.items()},
            fp4_pair_share={k: summary(v, "fp4_pair_share") for k, v in fp4.items()}))
    m = report["medians"]
    m["nomiss_new_over_old"] = m["nomiss_step_us"]["new"] / m["nomiss_step_us"]["old"]
    m["nomiss_token_new_over_old"] = m["nomiss_token_step_us"]["new"] / m["nomiss_token_step_us"]["old"]
    m["nomiss_async_exposed_new_over_old"] = m["nomiss_async_exposed_us"]["new"] / m["nomiss_async_exposed_us"]["old"]
    m["fp4_held_over_nomiss_us"] = {k: m["fp4_held_step_us"][k] - m["nomiss_step_us"][k] for k in trees}
    if token["old"][0]["token_sum"] != token["new"][0]["token_sum"]:
        raise SystemExit("the folded tokens differ from the separately read ones")
    emit(m, report, args.out)


if __name__ == "__main__":
    main()
