"""Step statistics of the tiered runtime and its KPI line."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW = 4096


@dataclass(frozen=True)
class RuntimeStats:
    steps: int
    replayed_steps: int  # steps that replayed at least once
    replays: int  # replays in total
    second_order_steps: int  # steps that needed more than one replay
    missing_pairs_per_step: float  # first pass, mean over steps
    tolerated_steps: int  # steps that kept zeroed contributions under the miss tolerance
    residue_steps: int  # approximate mode: steps returned with residue
    residue_pairs: int
    failed_steps: int
    fetched_rows: int
    fetched_bytes: int
    fetch_seconds: float  # host time in fetches; on CUDA their copies finish after (copy_seconds)
    copy_seconds: float  # the copies' own time (device events on CUDA, the memcpys on CPU)
    step_p50_s: float
    step_p99_s: float
    arena_hit_share: float  # share of fetched rows the arena served without a pack read
    pool_slots: int
    pool_coverage: float  # pool slots / routed experts of the model
    early_fetched_rows: int  # of fetched_rows, those fetched while their pass still ran (config early_fetch)
    located_rows: int  # of fetched_rows, those a step fetched by the located path (arena rows, victims planned)
    gathered_rows: int  # of fetched_rows, those passes fetched for themselves (config gather_in_pass, pass_pair)
    pair_steps: int  # steps launched as a pass pair (config pass_pair; their replay counted in `replays`)
    prefill_hot_evictions: int  # decode hot-set experts a prefill fetch had to evict (the pool lacked room)
    # pass_pair's timed choice: median wall ms of the recent steps likely to miss run as a pair / a single pass
    # (0.0 for a kind not timed yet; `runtime/pair_choice.py`)
    pair_step_ms: float = 0.0
    single_step_ms: float = 0.0
    # decode steps of a pool holding every expert that were not read (nothing could miss; config full_pool_reads):
    # counted in `steps`, not in the step times, which are the read steps' (the host does not wait for the others)
    unread_steps: int = 0
    # of pair_steps, those whose copies worked over the wide grid (config pass_pair_wide_blocks; its timed choice)
    wide_pairs: int = 0
    # config stream_arena: steps whose last pass computed experts from their arena rows instead of missing them, those
    # experts, and the rows installed after such passes (config stream_install; also counted in fetched_rows)
    streamed_steps: int = 0
    streamed_experts: int = 0
    streamed_installs: int = 0

    @property
    def replay_rate(self) -> float:
        return self.replayed_steps / self.steps if self.steps else 0.0

    @property
    def fetch_gbps(self) -> float:
        return self.fetched_bytes / self.fetch_seconds / 1e9 if self.fetch_seconds else 0.0

    @property
    def copy_gbps(self) -> float:
        return self.fetched_bytes / self.copy_seconds / 1e9 if self.copy_seconds else 0.0

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out.update(replay_rate=self.replay_rate, fetch_gbps=self.fetch_gbps, copy_gbps=self.copy_gbps)
        return out


class StatsRecorder:
    def __init__(self, pool_slots: int, total_experts: int):
        self.pool_slots, self.total_experts = pool_slots, total_experts
        self.steps = self.replayed = self.replays = self.second_order = 0
        self.tolerated = self.residue_steps = self.residue_pairs = self.failed = 0
        self.first_pass_misses = 0
        self.fetched_rows = self.fetched_bytes = self.early_fetched_rows = self.located_rows = self.gathered_rows = 0
        self.fetch_seconds = 0.0
        self.prefill_hot_evictions = 0
        self.pairs = 0  # steps launched as a pass pair
        self.wide_pairs = 0  # of those, with the wide copy grid
        self.streamed_steps = self.streamed_experts = self.streamed_installs = 0  # config stream_arena
        self.unread = 0  # steps not read (`add_unread_step`)
        self.arena_seconds = self.install_seconds = 0.0  # the parts of fetch_seconds in the arena and the pool
        self.read_seconds = 0.0  # pass-log reads (their sync waits for the forward and any copies in flight)
        self.forward_seconds = 0.0  # host time in the step's forward calls (on CUDA with graphs: their launches)
        self.prep_seconds = 0.0  # host work of a read before its sync (policy hits, victim plans, staged spares)
        self.step_seconds: deque[float] = deque(maxlen=WINDOW)
        self.recent: deque[tuple[bool, int]] = deque(maxlen=WINDOW)  # (replayed, first-pass missing pairs)

    def add_fetch(self, rows: int, nbytes: int, seconds: float, arena_seconds: float, install_seconds: float,
                  during_pass: bool = False, located: bool = False, gathered: bool = False) -> None:
        self.fetched_rows += rows
        self.early_fetched_rows += rows if during_pass else 0
        self.located_rows += rows if located else 0
        self.gathered_rows += rows if gathered else 0
        self.fetched_bytes += nbytes
        self.fetch_seconds += seconds
        self.arena_seconds += arena_seconds
        self.install_seconds += install_seconds

    def add_step(self, replays: int, first_misses: int, seconds: float, tolerated: bool, residue: int) -> None:
        self.steps += 1
        self.replays += replays
        self.replayed += replays > 0
        self.second_order += replays > 1
        self.first_pass_misses += first_misses
        self.tolerated += tolerated
        self.residue_steps += residue > 0
        self.residue_pairs += residue
        self.step_seconds.append(seconds)
        self.recent.append((replays > 0, first_misses))

    def add_unread_step(self, host_seconds: float) -> None:
        """A step that launched its forward and read nothing: no miss by construction, no step time (the host
        did not wait for it); its host time is forward time."""
        self.steps += 1
        self.unread += 1
        self.forward_seconds += host_seconds
        self.recent.append((False, 0))

    def snapshot(self, arena_hits: int, arena_misses: int, copy_seconds: float,
                 pair_medians_ms: tuple[float, float] = (0.0, 0.0)) -> RuntimeStats:
        times = np.asarray(self.step_seconds) if self.step_seconds else np.zeros(1)
        looked_up = arena_hits + arena_misses
        return RuntimeStats(
            steps=self.steps, replayed_steps=self.replayed, replays=self.replays,
            second_order_steps=self.second_order,
            missing_pairs_per_step=self.first_pass_misses / self.steps if self.steps else 0.0,
            tolerated_steps=self.tolerated, residue_steps=self.residue_steps, residue_pairs=self.residue_pairs,
            failed_steps=self.failed, fetched_rows=self.fetched_rows, fetched_bytes=self.fetched_bytes,
            fetch_seconds=self.fetch_seconds, copy_seconds=copy_seconds,
            step_p50_s=float(np.percentile(times, 50)), step_p99_s=float(np.percentile(times, 99)),
            arena_hit_share=arena_hits / looked_up if looked_up else 0.0,
            pool_slots=self.pool_slots, pool_coverage=self.pool_slots / self.total_experts,
            early_fetched_rows=self.early_fetched_rows, located_rows=self.located_rows, gathered_rows=self.gathered_rows,
            pair_steps=self.pairs, prefill_hot_evictions=self.prefill_hot_evictions,
            pair_step_ms=pair_medians_ms[0], single_step_ms=pair_medians_ms[1], unread_steps=self.unread,
            wide_pairs=self.wide_pairs, streamed_steps=self.streamed_steps, streamed_experts=self.streamed_experts,
            streamed_installs=self.streamed_installs,
        )

    def kpi_line(self, last: int, arena_hits: int, arena_misses: int, copy_seconds: float,
                 pair_medians_ms: tuple[float, float] = (0.0, 0.0)) -> str:
        """"[tierstore] KPI: replay X% of last N steps (avg Y missing pairs/step; cumulative Z% of M) ..." """
        stats = self.snapshot(arena_hits, arena_misses, copy_seconds, pair_medians_ms)
        window = list(self.recent)[-last:] if last else list(self.recent)
        n = len(window)
        recent_rate = sum(r for r, _ in window) / n if n else 0.0
        recent_misses = sum(m for _, m in window) / n if n else 0.0
        step_times = (f"step p50 {1e3 * stats.step_p50_s:.2f} ms p99 {1e3 * stats.step_p99_s:.2f} ms"
                      if self.step_seconds else "no step read")
        line = (f"[tierstore] KPI: replay {100 * recent_rate:.1f}% of last {n} steps "
                f"(avg {recent_misses:.2f} missing pairs/step; cumulative {100 * stats.replay_rate:.1f}% of "
                f"{stats.steps}) - pool {stats.pool_slots} slots = {100 * stats.pool_coverage:.1f}% of experts | "
                f"fetch {stats.fetched_rows} rows {stats.fetched_bytes / 2**20:.1f} MiB, host "
                f"{stats.fetch_seconds:.3f} s, copies at {stats.copy_gbps:.2f} GB/s | "
                f"{step_times} | "
                f"arena hits {100 * stats.arena_hit_share:.1f}%")
        if stats.second_order_steps:
            line += f" | second-order replays {stats.second_order_steps}"
        if stats.tolerated_steps:
            line += f" | DEGRADED: {stats.tolerated_steps} steps kept misses under the tolerance"
        if stats.residue_steps:
            line += f" | DEGRADED: {stats.residue_steps} steps with residue ({stats.residue_pairs} pairs)"
        if stats.early_fetched_rows:
            line += f" | {stats.early_fetched_rows} rows fetched during their pass"
        if stats.gathered_rows:
            line += f" | {stats.gathered_rows} rows gathered by their pass"
        if stats.pair_steps:
            line += f" | {stats.pair_steps} steps launched as a pass pair"
            if stats.wide_pairs:
                line += f" ({stats.wide_pairs} with the wide copy grid)"
            if stats.pair_step_ms and stats.single_step_ms:
                line += f" (recent medians: pair {stats.pair_step_ms:.2f} ms, single {stats.single_step_ms:.2f} ms)"
        if stats.streamed_steps:
            line += (f" | {stats.streamed_steps} steps streamed {stats.streamed_experts} experts from the arena "
                     f"(no replay), {stats.streamed_installs} rows installed after them")
        if stats.unread_steps:
            line += (f" | {stats.unread_steps} steps not read (every expert resident, nothing can miss; step times "
                     "are the read steps')")
        if stats.prefill_hot_evictions:
            line += f" | prefill evicted {stats.prefill_hot_evictions} decode-hot experts (pool short of room)"
        return line


def precision_kpi(fp4, gate) -> str:
    """KPI suffix of the precision tier: " | fp4 M/S slots, X% of routed pairs, promoted ... | gate ..."
    (`fp4`: Fp4Stats, `gate`: GateStats or None)."""
    line = (f" | fp4 {fp4.mapped}/{fp4.slots} slots, {100 * fp4.fp4_pair_share:.1f}% of routed pairs, promoted "
            f"{fp4.promoted_lazy} lazy + {fp4.promoted_forced} forced + {fp4.promoted_prefill} prefill, "
            f"evicted {fp4.evicted}")
    if fp4.unrestored:
        line += f", UNRESTORED {fp4.unrestored}"
    if gate is not None:
        line += (f" | gate fired {gate.fired}/{gate.steps} steps ({100 * gate.fire_rate:.1f}%), "
                 f"{gate.replays} replays, {gate.promoted} promoted")
        if gate.unconverged:
            line += f", {gate.unconverged} not all-FP4"
    return line
