"""`TieredRuntime`: the device pool over the host arena over a row source (a pack), the MoE compute
that reads the pool, and the step protocol that keeps results exact.

    runtime = TieredRuntime(geometry, PackRows(...), pool_slots=..., arena_slots=..., device="cuda")
    out = runtime.moe(layer, hidden, topk_ids, topk_weights)      # called by every MoE layer
    logits, outcome = runtime.step(forward, rewind)                 # one decode step, exact
    runtime.stats(); runtime.kpi_line(); runtime.close()

With an FP4 row source (`fp4_source=`, the `fp4` pack) the runtime adds the precision tier: an
FP4 pool the kernels prefer over the base pool, its background manager, and (config `gate`) the
confidence gate on decode steps (docs/precision-tier.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext

import numpy as np
import torch

from tierstore.cache.arena import Arena, RowSource
from tierstore.cache.policy import get_decaying_policy
from tierstore.errors import CapacityError, ConfigError
from tierstore.geometry import MoEGeometry
from tierstore.kernels.cuda.pass_gather import PLAN_THREADS
from tierstore.kernels.layout import fp4_slot_layout, w2_slot_layout
from tierstore.runtime.compute import TorchExperts, TritonExperts
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.fp4_manager import Fp4Manager
from tierstore.runtime.fp4_sizing import check_fire_floor, fp4_pool_slots
from tierstore.runtime.fp4_tier import Fp4Stats, Fp4Tier
from tierstore.runtime.gate import ConfidenceGate
from tierstore.runtime.gate_stats import GateRecorder, GateStats
from tierstore.runtime.gated_step import run_gated
from tierstore.runtime.pair_choice import PairChoice, TimedChoice
from tierstore.runtime.pass_gather import PassGather, gather_capacity
from tierstore.runtime.passlog import UNREAD_PASS, PassLog, PassReport
from tierstore.runtime.pools import DevicePool
from tierstore.runtime.replay_if import (ConditionalReplay, body_side_stream, conditional_capture_available,
                                        copy_into, prepare_if_nodes)
from tierstore.runtime.rows import check_row_source
from tierstore.runtime.seen_snapshot import ChainedSnapshot
from tierstore.runtime.stats import RuntimeStats, StatsRecorder, precision_kpi
from tierstore.runtime.stream_heat import StreamHeat
from tierstore.runtime.stream_rows import StreamRows, check_arena
from tierstore.runtime.step import StepOutcome, run_step
from tierstore.runtime.token_chunks import token_chunks

log = logging.getLogger("tierstore.runtime")

Key = tuple[int, int]
BACKENDS = ("auto", "torch", "triton")
NO_IDS = np.empty(0, dtype=np.int64)
NO_LOCK = nullcontext()  # a step's safe point without an FP4 tier (reusable: it holds nothing)
UNREAD_OUTCOME = StepOutcome(0, 0, 0, False, UNREAD_PASS)  # a decode step of a complete full pool (`_unread_step`)
COUNTERS = ("steps", "replays", "fetched_bytes", "fetch_s", "arena_hit_rows", "arena_miss_rows", "arena_s",
            "install_s", "copy_s", "copy_wait_s", "read_s", "forward_s", "prep_s", "pairs",
            "first_missing", "streamed")  # TieredRuntime.counters(); first_missing: pairs the steps' first passes
# missed; streamed: experts last passes computed from their arena rows (config stream_arena)




def working_set_slots(geometry: MoEGeometry, tokens_per_step: int, margin: float) -> int:
    """Slots one step may need at once: margin x MoE layers x distinct experts a layer can route."""
    per_layer = min(geometry.num_experts, geometry.top_k * tokens_per_step)
    return math.ceil(margin * geometry.num_moe_layers * per_layer)


def slots_for(geometry: MoEGeometry, slot_bytes: int, *, gib: float | None = None, fraction: float | None = None) -> int:
    """Pool slots for a size in GiB or a fraction of the model's routed experts (exactly one given)."""
    if (gib is None) == (fraction is None):
        raise ConfigError("give the pool size either in GiB or as a fraction of the experts")
    if gib is not None:
        if not gib > 0:
            raise ConfigError(f"pool size must be > 0 GiB, got {gib}")
        return int(gib * 2**30) // slot_bytes
    if not 0 < fraction <= 1:
        raise ConfigError(f"pool fraction must be in (0, 1], got {fraction}")
    return max(1, round(fraction * geometry.total_routed_experts))


def check_working_set(geometry: MoEGeometry, pool_slots: int, slot_bytes: int, config: RuntimeConfig) -> None:
    need = working_set_slots(geometry, config.tokens_per_step, config.working_set_margin)
    if pool_slots >= need:
        return
    message = (f"device pool of {pool_slots} slots ({pool_slots * slot_bytes / 2**30:.3f} GiB) is below the per-step "
               f"working set of {need} slots ({config.working_set_margin} x {geometry.num_moe_layers} layers x "
               f"top-{geometry.top_k} x {config.tokens_per_step} tokens); a pool of >= {need} slots "
               f"({need * slot_bytes / 2**30:.3f} GiB) would work")
    if not config.force_pool:
        raise CapacityError(message + " (or force it)")
    log.warning("%s; forced, steps may fail or degrade", message)


class TieredRuntime:
    def __init__(self, geometry: MoEGeometry, source: RowSource, *, pool_slots: int, arena_slots: int = 0,
                 device: torch.device | str = "cpu", config: RuntimeConfig | None = None, backend: str = "auto",
                 heat_path=None, record_tokens: int = 0, output_words: int = 0, on_close: Sequence[Callable[[], None]] = (),
                 fp4_source: RowSource | None = None, fp4_slots: int | None = None, fp4_arena_slots: int = 0):
        self.geometry = geometry
        self.config = config or RuntimeConfig()
        self.device = torch.device(device)
        self.layout = w2_slot_layout(geometry.hidden, geometry.expert_inter)
        shape = (geometry.num_moe_layers, geometry.num_experts)
        check_row_source(source, geometry, self.layout.slot_bytes, "base")
        check_working_set(geometry, pool_slots, self.layout.slot_bytes, self.config)
        # overlap: a fetch returns with its copies in flight; the next pass waits for them on the device, per
        # layer with config layer_waits (each MoE layer waits for its own rows: `moe`), except in a pool that
        # holds every expert (filled once by `preload`; nothing to overlap, no wait nodes in the graphs)
        slots = min(pool_slots, geometry.total_routed_experts)
        policy = get_decaying_policy(self.config.policy, self.config.policy_half_life_s)  # begin_step: time.monotonic()
        self.pool = DevicePool(slots, self.layout.slot_bytes, *shape, self.device, policy,
                               overlap=True,
                               layer_waits=self.config.layer_waits and slots < geometry.total_routed_experts,
                               copy_streams=self.config.copy_streams)
        # the pool's deferred hits reach its policy before each pass-log read, while the forward runs on the
        # device, not in a fetch after the sync; only where a fetch can evict and the device runs asynchronously
        self._early_hits = self.device.type == "cuda" and self.pool.num_slots < geometry.total_routed_experts
        # the step's fetch from the arena (`_fetch_located`): victims planned while the pass runs (on CUDA; on a CPU
        # the pass is done by then, the logic the same), where a fetch can evict, the pool can install located rows
        # and the policy's order can be planned and filtered
        self._plans_victims = (self.pool.num_slots < geometry.total_routed_experts and self.pool.installs_located
                               and self.pool.policy.filtered_order)
        self.arena = Arena(source, arena_slots, heat_path=heat_path, pin=self.device.type == "cuda",
                           policy=self.config.arena_policy, half_life_s=self.config.policy_half_life_s)
        self.source = source
        # config stream_arena: a decode pass computes a missing expert from its arena row (`StreamRows`, published
        # before each step) instead of missing it; the rows it streamed are installed at the next step's first read
        self.backend = _resolve_backend(backend, self.device)
        self._stream_rows = None
        if self._streams_wanted(slots, arena_slots, fp4_source is not None):
            self._stream_rows = StreamRows(self.pool.slots, *shape)
        # config stream_install hotter: each expert's heat, for which streamed experts take a slot
        self._stream_heat = (StreamHeat(geometry.total_routed_experts, self.config.stream_heat_halving)
                             if self._stream_rows is not None and self.config.stream_install == "hotter" else None)
        self._decode_pending: PassReport | None = None  # the last decode step's last pass, not yet followed up
        # early_fetch: a pool that can miss reads each finished layer's routing while the pass runs (`moe`, `step`)
        self._early = self.config.early_fetch and slots < geometry.total_routed_experts
        if self._early and self.device.type == "cuda" and not self.pool.layer_waits:
            raise ConfigError("early_fetch needs layer_waits: the copies it starts during a pass must be waited for "
                              "per layer by the replay")
        # config unwaited_first_pass: a decode step's first pass (`first_pass`, the caller's forward_first) and a pass
        # pair read the pool without its per-layer waits, after one device wait for the installs still in flight;
        # replays and prefill keep them. Not with early_fetch, whose copies start during the pass
        self.first_passes = (self.config.unwaited_first_pass and slots < geometry.total_routed_experts
                             and not self._early)
        # gather_in_pass: decode passes map and copy their own missing arena rows (`PassGather`); pass_pair: the
        # first pass of a pair does, while the pair's replay waits for them (`pass_pair`)
        can_miss = slots < geometry.total_routed_experts
        paired = self._pairs_wanted(can_miss, arena_slots)
        knob = "pass_pair" if paired else "gather_in_pass"
        gathers = (self.config.gather_in_pass or paired) and can_miss
        if gathers and self.device.type == "cuda" and self.backend == "torch":
            raise ConfigError(f"{knob} on CUDA needs the triton backend: the torch backend reuses decoded "
                              "slots by the host's generation counts, which a pass's own fetch changes only at its "
                              "read")

        def pass_log(spares: int) -> PassLog:
            return PassLog(*shape, geometry.top_k, capacity=shape[0] * shape[1], device=self.device,
                           record_tokens=record_tokens, output_words=output_words, early_layers=self._early,
                           gather_capacity=spares)
        spares = (gather_capacity(slots, shape[0], min(shape[1], geometry.top_k * self.config.tokens_per_step))
                  if gathers else 0)
        self.log, self._gather = pass_log(spares), None
        if gathers:
            try:
                self._gather = PassGather(self.pool, self.arena, self.log, spares, paired=paired,
                                          copy_blocks=self.config.pass_pair_copy_blocks,
                                          copies=self.config.pass_pair_copies, plans=self.config.pass_pair_plans,
                                          keeps_recent=self.config.gather_keeps_recent,
                                          wide_blocks=self.config.pass_pair_wide_blocks)
            except ConfigError as error:
                if not (paired and self.config.pass_pair == "auto"):
                    raise
                log.warning("pass_pair auto: off (%s)", error)
                self.log = pass_log(0)
        self.pairs = self._gather is not None and self._gather.paired  # decode steps may launch a pass pair
        if self.pairs and self.device.type == "cuda" and self.config.pass_pair_replay_segment:
            prepare_if_nodes(self.device)  # before any capture: its streams, and IF nodes where torch has none
        self._pair_half = 0  # while a pass pair runs (or is captured): 1 in its first pass, 2 in its replay
        self._conditional: ConditionalReplay | None = None  # while a pair's skippable replay is captured
        self._told_conditional = False
        # config pass_pair_replay_segment: the last pair launched or captured leaves out its replay when its first
        # pass missed nothing; the predicates of the captured conditionals, kept with the runtime like its graphs
        self._pairs_skip_replay = False
        self._replay_predicates: list[torch.Tensor] = []
        self._last_gathered = 0  # experts the last pass read gathered for itself (`_recent_missing`)
        # (key ids, slots, victims) a read pass mapped for itself, not yet on the host (`_settle_gathered`)
        self._pending_gathered: tuple[list[int], list[int], list[int]] | None = None
        self.fp4, self.gate, self._fp4_manager, self._gate_budget = None, None, None, None
        self._setup_precision_tier(fp4_source, fp4_slots, fp4_arena_slots)
        experts_class = TritonExperts if self.backend == "triton" else TorchExperts
        kernel_options = {"stream_stage": self.config.stream_stage} if self.backend == "triton" else {}
        fp4_pool = self.fp4.pool if self.fp4 is not None else None
        fp4_layout = self.fp4.layout if self.fp4 is not None else None
        try:  # a refused compute (e.g. config cuda_w2 beside an FP4 pool) must not leave the FP4 manager running
            self.experts = experts_class(self.pool, self.layout, self.log, geometry.swiglu_limit, fp4_pool, fp4_layout,
                                         cuda_w2=self.config.cuda_w2,
                                         gather=self._gather if not self.pairs else None, stream=self._stream_rows,
                                         **kernel_options)
        except BaseException:
            if self._fp4_manager is not None:
                self._fp4_manager.close()
                self.fp4.close()
            raise
        self._gate_stats = GateRecorder(self.config.gate_dump or None)
        self._stats = StatsRecorder(self.pool.num_slots, geometry.total_routed_experts)
        self._scan = False
        self._on_close = list(on_close)
        self.last_pass: PassReport | None = None
        # experts a recent decode pass missed or gathered for itself, decaying: updated by each read
        # (`_read_pass`), it sizes the victim plan (`_victim_plan_size`) and the spares (`_stage_spares`)
        self._recent_missing = 0
        # a pass of this step or the last decode step's first pass missed pairs (`_read_pass`: whether to plan a fetch)
        self._missed_lately = False
        # pass_pair: which decode steps likely to miss launch their pair (the back-off, the timed choice)
        self._pair_choice = PairChoice(self.config.pass_pair_choice)
        # pass_pair with a wide copy grid (config pass_pair_wide_blocks): the pairs' grid, timed (True: wide)
        self._grid_choice = (TimedChoice() if self.pairs and self.config.pass_pair_wide_blocks
                             and self.config.pass_pair_copies == "kernel" else None)
        self._pairs_offered = False  # a decode step was given a pair: reads stage spares for a next one to pair
        self._untouched = None  # (last pass report, time) of the last step, not yet told to the pool's policy
        # a pool that holds every expert never evicts: its policy's order is never asked for, so steps do not tell it
        # what they routed (the no-miss step's host work at full coverage)
        self._tells_policy = can_miss
        self._decode_pass: PassReport | None = None  # the last decode step's last pass: prefill evicts its experts last
        # a pool that holds every expert, once all are installed, cannot miss: its decode steps are not read unless the
        # read brings something back (config full_pool_reads: read anyway)
        self._skips_reads = (not can_miss and self.log.outputs is None and not self.config.full_pool_reads_passes(
            fp4=self.fp4 is not None, records=self.log.routing is not None))
        self._experts_total = geometry.total_routed_experts
        self.closed = False
        log.info("device pool: %d slots x %.2f MiB = %.3f GiB (%.1f%% of %d experts) on %s, backend %s; arena %d slots",
                 self.pool.num_slots, self.layout.slot_bytes / 2**20, self.pool.num_slots * self.layout.slot_bytes / 2**30,
                 100 * self.pool.num_slots / geometry.total_routed_experts, geometry.total_routed_experts,
                 self.device, self.backend, arena_slots)

    def _streams_wanted(self, slots: int, arena_slots: int, fp4_tier: bool) -> bool:
        """Config stream_arena resolved, for a pool of `slots`: never where the pool holds every expert; true: on,
        ConfigError where it cannot run (an arena short of every expert, an FP4 tier; the compute objects check the
        backend); auto: on a CUDA device with the triton backend (its Triton stages stream, and the CUDA kernels' stream
        builds where config cuda_w2 runs them), an arena of every expert, no FP4 tier and none of gather_in_pass,
        early_fetch and pass_pair true."""
        config, total = self.config, self.geometry.total_routed_experts
        if not config.stream_arena or slots >= total:
            return False
        if config.stream_arena is True:
            check_arena(arena_slots, total)
            if fp4_tier:
                raise ConfigError("stream_arena streams W2 rows only: it does not run beside an FP4 tier; turn one off")
            return True
        return (self.device.type == "cuda" and self.backend == "triton" and arena_slots >= total and not fp4_tier
                and not config.gather_in_pass and not config.early_fetch and config.pass_pair is not True)

    def _pairs_wanted(self, can_miss: bool, arena_slots: int) -> bool:
        """Config pass_pair resolved: as given when true or false; auto: on a CUDA device with the triton backend,
        a pool that can miss, an arena, experts the plan kernel covers, and none of gather_in_pass, early_fetch and
        stream_arena."""
        config = self.config
        if config.pass_pair != "auto":
            return config.pass_pair
        return (can_miss and self.device.type == "cuda" and self.backend == "triton" and arena_slots > 0
                and not config.gather_in_pass and not config.early_fetch and self._stream_rows is None
                and self.geometry.num_experts <= PLAN_THREADS)

    def _setup_precision_tier(self, source: RowSource | None, slots: int | None, arena_slots: int) -> None:
        """The FP4 tier (pool, manager) and the gate, before any compute object binds the pools."""
        g, config = self.geometry, self.config
        slot_bytes = fp4_slot_layout(g.hidden, g.expert_inter).slot_bytes
        if source is not None:
            if slots is None:
                slots = fp4_pool_slots(config, slot_bytes, g.total_routed_experts, self.device)
            if slots > 0:
                self._gate_budget = check_fire_floor(g, slots, slot_bytes, config) if config.gate else None
                self.fp4 = Fp4Tier(g, source, slots, self.device, config, arena_slots)
                self._fp4_snapshot = ChainedSnapshot(g.num_moe_layers, g.num_experts)
                self._fp4_manager = Fp4Manager(self.fp4, self._fp4_snapshot)
                log.info("FP4 pool: %d slots x %.2f MiB = %.3f GiB, policy %s", self.fp4.pool.num_slots,
                         slot_bytes / 2**20, self.fp4.pool.num_slots * slot_bytes / 2**30, config.fp4_policy)
        if config.gate:
            if self.fp4 is None:
                raise ConfigError("the confidence gate needs an FP4 pool: give an fp4 row source and a pool size > 0")
            self.gate = ConfidenceGate.from_config(config)
            # the last forward's aggregated gate signal, copied ahead of the pass log's read (its sync covers it)
            self._gate_signal = torch.full((1,), float("nan"), dtype=torch.float32, pin_memory=self.device.type == "cuda")

    # -- the MoE layer ------------------------------------------------------------------------
    def moe(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed experts of MoE layer `layer` (dense index): hidden [T, H], topk [T, k] -> [T, H]."""
        if layer == 0:
            replay = self._pair_half == 2
            if self._gather is not None and not replay:
                self._gather.begin_pass()  # the last pass's routed counts, before they are zeroed
            self.log.reset(pair_replay=replay)
        if self._pair_half:
            out = self._pair_experts(layer, hidden, topk_ids, topk_weights)
        elif not self._scan:
            out = self._experts(layer, hidden, topk_ids, topk_weights)
        else:
            keys = self._keys(layer, topk_ids)
            if len(keys) <= self.pool.num_slots:
                self._scan_fetch(keys)
                out = self._experts(layer, hidden, topk_ids, topk_weights)
            else:  # a prefill layer routing more experts than the pool holds: token chunks that fit, in order
                chunks = token_chunks(topk_ids.tolist(), self.pool.num_slots)
                log.info("MoE layer %d: %d routed experts over %d pool slots, %d tokens run in %d chunks (last-bit "
                         "differences from one batch)", layer, len(keys), self.pool.num_slots, hidden.shape[0],
                         len(chunks))
                outs = []
                for start, stop in chunks:
                    self._scan_fetch(self._keys(layer, topk_ids[start:stop]))
                    outs.append(self._experts(layer, hidden[start:stop], topk_ids[start:stop],
                                              topk_weights[start:stop]))
                out = torch.cat(outs)
        if self._early:
            self.log.publish_layer(layer)  # after the layer's MoE: its routing reaches the host during the pass
        return out

    @staticmethod
    def _keys(layer: int, topk_ids: torch.Tensor) -> list[Key]:
        return [(layer, int(e)) for e in topk_ids.reshape(-1).unique().tolist()]

    def _scan_fetch(self, keys: list[Key]) -> None:
        """A prefill layer's routed set made resident before the layer runs (arena scan discipline)."""
        if self.fp4 is not None and self.config.fp4_prefill:
            self.fp4.force_promote(keys, keys, None, prefill=True)  # KV written at FP4 where the pool allows
        self.fetch(keys, keys, scan=True)

    def _pair_experts(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """A layer of a pass pair: the first pass gathers the layer's missing rows after its experts saw them
        missing; the replay waits for them before its experts."""
        if self._pair_half == 2:
            if self._conditional is not None:  # the segment's IF node waited for its rows
                self._conditional.layer(layer)
            else:
                self._gather.wait_rows(layer)
        out = self._experts(layer, hidden, topk_ids, topk_weights)
        if self._pair_half == 1:
            self._gather.plan_and_fork(layer, self.experts.fp4_table)
        return out

    def _experts(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        self.pool.wait_layer(layer)  # this layer's rows of the last fetch (the only readers of the pool are here)
        return self.experts(layer, hidden, topk_ids, topk_weights)

    def publish(self, values: torch.Tensor) -> None:
        """Hand `values` (e.g. the sampled token ids, int [T]) to the step's pass-log read: call it
        at the end of the forward (capturable); `outcome.last_pass.outputs` (int32) then holds them,
        with no device-to-host copy or sync of their own. Needs `output_words` >= their count."""
        self.log.publish(values)

    # -- fetch --------------------------------------------------------------------------------
    def fetch(self, keys: Iterable[Key], protect: Iterable[Key], scan: bool = False, partial: bool = False,
              finished_layers: int | None = None) -> int:
        """Make `keys` resident in one batch (arena hits are zero-copy; misses read the source),
        never evicting `protect`. Returns how many were installed, on CUDA with their copies still
        in flight: work launched after it on the current stream waits for them on the device
        (`DevicePool` with `overlap`). Fails closed: on a read error nothing is mapped and the
        error propagates. `finished_layers` (early fetch, while a pass runs that has finished its
        first `finished_layers` MoE layers): victims come from those layers only, and the copies
        do not wait for the pass."""
        return self._fetch(keys, frozenset(self.pool.key_ids(protect)), scan, partial, finished_layers)

    def _fetch(self, keys: Iterable[Key], protect_ids: frozenset[int], scan: bool = False, partial: bool = False,
               finished_layers: int | None = None, after_read: bool = False) -> int:
        """`fetch` with the protected experts as key ids (layer * E + expert): the step's path, where the
        pass report holds them so (no key tuples between the pass-log read and the first row copy). `after_read`:
        nothing was launched on the compute stream since a pass-log read synchronised it, so the copies need not
        wait for it (the step's fetch: no kernel that could read a victim's slot is still running)."""
        self.settle()
        if self._gather is not None:  # its installs may take the staged spares' free slots
            self._gather.drop_staged()
        keys = self.pool.missing(dict.fromkeys(keys))
        if not keys:
            return 0
        # the install's victims, walked once (here): nothing changes the pool's policy before the install
        lacking = len(keys) - self.pool.num_free
        below = None if finished_layers is None else finished_layers * self.geometry.num_experts
        victims = self._victims(protect_ids, lacking, scan, below) if lacking > 0 else []
        room = min(len(keys), self.pool.num_free + len(victims))  # = capacity_for(protect, enough=len(keys))
        if len(keys) > room:
            if not partial:
                raise CapacityError(
                    f"device pool of {self.pool.num_slots} slots cannot hold this step's routed experts: {len(keys)} "
                    f"more needed, {room} can be made free without evicting the {len(protect_ids)} routed this step")
            keys = keys[:room]
            if not keys:
                return 0
        if scan and self._decode_hot.size and victims:
            self._stats.prefill_hot_evictions += int(np.isin(victims, self._decode_hot).sum())
        started, waited = time.perf_counter(), self.pool.wait_seconds
        # before a read the arena rewrites rows, maybe ones that copies still in flight read: the pool waits for them
        rows = self.arena.fetch(keys, scan=scan, before_read=self.pool.wait)
        installing, waited = time.perf_counter(), self.pool.wait_seconds - waited
        self.pool.install(keys, rows, (), victims, after_compute=finished_layers is None and not after_read,
                          runtime_fetch=True)
        done = time.perf_counter()
        self._stats.add_fetch(len(keys), sum(r.numel() for r in rows), done - started, installing - started - waited,
                              done - installing, during_pass=finished_layers is not None)
        return len(keys)

    @property
    def _decode_hot(self) -> np.ndarray:
        """int64 [n] key ids the last decode step routed (empty before one)."""
        return self._decode_pass.routed_ids if self._decode_pass is not None else NO_IDS

    def _victims(self, protect_ids: frozenset[int], lacking: int, scan: bool, below: int | None = None) -> list[int]:
        """Key ids an install lacking `lacking` free slots evicts, never one of `protect_ids` (nor an id
        at or above `below`). A prefill (`scan`) fetch takes them outside the decode hot set (the last
        decode step's routed experts) when the pool has that much room there, so a long prompt does
        not flush what decode needs; otherwise, since the layer must run, from the policy's plain order."""
        if scan and self._decode_hot.size:
            victims = self.pool.evictable_ids(protect_ids.union(self._decode_hot.tolist()), lacking, below)
            if len(victims) == lacking:
                return victims
        return self.pool.evictable_ids(protect_ids, lacking, below)

    def _fetch_during_pass(self) -> None:
        """`early_fetch`: while the launched pass runs, read each finished MoE layer's routing (in
        layer order, polling its host copy), and whenever the last install's copies are done fetch
        what the finished layers miss, evicting only their experts that this pass did not route.
        Returns at the last layer, or when the pass ended without publishing the next one."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        fp4 = self.fp4.pool if self.fp4 is not None else None  # its residency holds still: the step has its lock
        routed: list[Key] = []  # this pass's routed experts of its finished layers
        pending: list[Key] = []  # of those, the ones the pass missed (in neither pool) and not fetched yet
        for layer in range(self.geometry.num_moe_layers):
            seen = self.log.layer_seen(layer)  # int32 [E] or None
            while seen is None:
                done = stream is None or stream.query()
                seen = self.log.layer_seen(layer)
                if seen is None and done:
                    return
            layer_routed = [(layer, expert) for expert in np.flatnonzero(seen).tolist()]
            routed += layer_routed
            missed = self.pool.missing(layer_routed)
            pending += fp4.missing(missed) if fp4 is not None else missed  # an FP4-resident pair does not miss
            if pending and self.pool.idle():
                self.fetch(pending, routed, partial=True, finished_layers=layer + 1)
                pending = []

    def preload(self, keys: Iterable[Key] | None = None) -> None:
        """Install `keys` (default: every expert, which needs a pool that holds them all)."""
        g = self.geometry
        keys = list(keys) if keys is not None else [(l, e) for l in range(g.num_moe_layers) for e in range(g.num_experts)]
        self.fetch(keys, keys, scan=True)
        self.pool.wait()  # every row in place on return (callers may use the arena directly next)

    # -- the step -----------------------------------------------------------------------------
    def pass_pair(self, forward: Callable[[], object], rewind: Callable[[], None]) -> Callable[[], object]:
        """Config `pass_pair`: the step's pass, `rewind`, and its replay as one callable (capture it as one CUDA
        graph where `forward` is captured: `rewind` must then be capturable), to give to `step` as `forward_pair`.
        Returns what the replay's `forward()` returns."""
        if not self.pairs:
            raise ConfigError("pass_pair is off (or this pool holds every expert): a step has no pass pair")

        segment = self.config.pass_pair_replay_segment

        def run():
            with self.pool.unwaited() if self.first_passes else nullcontext():
                try:
                    self._pair_half = 1
                    first = forward()
                    self._gather.join_plans()
                    self._pairs_skip_replay = bool(segment) and self._replay_skippable()
                    if self._pairs_skip_replay:
                        return self._replay_if_missed(first, forward, rewind, segment)
                    rewind()
                    self._pair_half = 2
                    return forward()
                finally:
                    self._pair_half, self._conditional = 0, None
        return run

    def _replay_skippable(self) -> bool:
        """Config pass_pair_replay_segment: whether this pair's replay can be left out when its first pass missed
        nothing: eager, always (the host decides); in a CUDA graph capture, where IF nodes can be captured (by torch,
        or by the CUDA runtime in a capture tierstore makes: `replay_if.conditional_capture_available`)."""
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return True
        if conditional_capture_available(self.device):
            return True
        if not self._told_conditional:
            log.info("pass_pair_replay_segment: no conditional graph nodes in this capture (torch captures none "
                     "before 2.12; the CUDA runtime's need nvcc and a capture made by tierstore); a captured pair's "
                     "replay always runs")
            self._told_conditional = True
        return False

    def _replay_if_missed(self, first, forward: Callable[[], object], rewind: Callable[[], None], segment: int):
        """A pair's replay run only when its first pass missed: in a capture as conditional segments
        (`ConditionalReplay`), eagerly by the host's reading of the count. Returns the first pass's result, with the
        replay's written over it when the replay ran."""
        missed = self.log.counts[:1]  # [1] the first pass's missing pairs, before the replay's reset moves them
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._conditional = ConditionalReplay(missed, self.pool.num_layers, segment, self._gather.wait_rows)
            self._replay_predicates.append(self._conditional.predicate)
            self.experts.body_side_stream = body_side_stream(self.device)
            self._conditional.open()
            try:
                rewind()
                self._pair_half = 2
                second = forward()
                return copy_into(first, second)
            finally:
                self._conditional.close()
                self.experts.body_side_stream = None
        if int(missed[0]) == 0:  # a sync on CUDA: eager pairs only
            return first
        rewind()
        self._pair_half = 2
        return copy_into(first, forward())

    def first_pass(self, forward: Callable[[], object]) -> Callable[[], object]:
        """Config `unwaited_first_pass`: `forward` reading the pool without its per-layer waits for a fetch's copies
        (capture it as a CUDA graph where `forward` is captured), to give to `step` as `forward_first`: a decode step
        launches it as its first pass, after one device wait for any install still in flight (none, usually);
        replays launch `forward`. Returns what `forward()` returns."""
        if not self.first_passes:
            raise ConfigError("unwaited_first_pass is off (or this pool holds every expert, or early_fetch is on): "
                              "a step has no first pass of its own")

        def run():
            with self.pool.unwaited():
                return forward()
        return run

    def step(self, forward: Callable[[], torch.Tensor], rewind: Callable[[], None], prefill: bool = False,
             logits_of: Callable[[object], torch.Tensor] | None = None,
             forward_pair: Callable[[], torch.Tensor] | None = None,
             forward_first: Callable[[], torch.Tensor] | None = None):
        """One step to its fixed point: (result of the last forward, StepOutcome). `prefill`: each MoE
        layer fetches its routed set before it runs (arena scan discipline). With the gate armed, a
        decode step (not `prefill`) whose logits (`logits_of(result)`, default the result itself)
        fire is re-run with its routed experts forced to FP4 (`outcome.gate` tells how). `forward_pair`
        (config `pass_pair`: `pass_pair(forward, rewind)`, or its captured graph): a decode step launches it
        instead of `forward` first when a recent pass missed and spares are staged (one replay counted).
        `forward_first` (config `unwaited_first_pass`: `first_pass(forward)`, or its captured graph): a decode step
        that launches no pair launches it as its first pass, replays launch `forward`.
        A decode step of a pool that holds every expert, all installed, is not read (config `full_pool_reads`):
        it returns `forward()`'s result at once, without a sync, with `UNREAD_OUTCOME`."""
        if self._skips_reads and not prefill and self.pool.num_mapped == self._experts_total:
            return self._unread_step(forward)
        started = time.perf_counter()
        if self._stream_rows is not None:
            self._stream_rows.refresh(self.arena)  # rows the arena gained since the last step (rare)
        self._scan = prefill
        if prefill:  # its layers fetch their routed sets and take victims of their own
            self._decode_pending = None
        step_routed: set = set()  # every pass's routed keys, kept only when the gate fires
        wide_pair = False  # a pair launched with the wide copy grid (config pass_pair_wide_blocks)
        try:
            # the safe point: the FP4 manager mutates only while nobody holds the tier's lock
            with self.fp4.lock if self.fp4 is not None else NO_LOCK:
                gated = self.gate is not None and not prefill
                opening = forward_first if self.first_passes and not prefill else None  # the first pass, unwaited
                if gated:
                    forward = self._with_signal(forward, logits_of or (lambda r: r))
                    opening = self._with_signal(opening, logits_of or (lambda r: r)) if opening is not None else None
                during_pass = None
                if self._early and not prefill:
                    forward, during_pass = self._with_cleared_layers(forward), self._fetch_during_pass
                first_forward, first_replays = None, 0
                if self._gather is not None:
                    if prefill:  # its layers fetch for themselves: no spares
                        self._gather.drop_staged()
                    elif not self.pairs:
                        forward = self._with_armed_gather(forward)
                        opening = self._with_armed_gather(opening) if opening is not None else None
                    elif self._pair_choice.take(forward_pair is not None and self._recent_missing > 0,
                                                self._gather.has_staged()):
                        if self._grid_choice is not None:
                            wide_pair = self._grid_choice.next_kind()
                            self._grid_choice.start(wide_pair)
                            self._gather.use_wide_copies(wide_pair)
                        first_forward = self._with_armed_gather(self._with_served_copies(forward_pair))
                        first_replays = 1
                        if gated:
                            first_forward = self._with_signal(first_forward, logits_of or (lambda r: r))
                    else:  # a single pass: it gathers nothing
                        self._gather.drop_staged()
                    self._pairs_offered = self._pairs_offered or forward_pair is not None
                first_forward = first_forward or opening
                if first_forward is not None and self.first_passes:  # launched without the per-layer waits
                    first_forward = self._after_installs(first_forward)
                forward = self._clocked(forward)
                first_forward = self._clocked(first_forward) if first_forward is not None else None
                read_pass, pair_first = self._read_pass, []
                if first_replays:  # what the pair's first pass missed is in the first read's log

                    def read_pass():
                        report = self._read_pass()
                        if not pair_first:  # (missing pairs, missing experts, experts it gathered)
                            pair_first.extend((*self.log.host_first_missing(), self._last_gathered))
                        return report
                first = run_step(forward, rewind, read_pass, self._fetch_for_step, self.config, during_pass,
                                 first_forward=first_forward, first_replays=first_replays)
                if pair_first:
                    # a pair whose replay was left out (its first pass missed nothing) ran no replay
                    replays = first[1].replays - (self._pairs_skip_replay and not pair_first[0])
                    first = first[0], dataclasses.replace(first[1], first_pass_missing_pairs=pair_first[0],
                                                          replays=replays)
                    self._stats.pairs += 1
                result, outcome = first
                if self._stream_rows is not None and not prefill:
                    self._defer_streamed(outcome.last_pass)
                if gated:
                    result, outcome = self._gated(first, forward, rewind, logits_of, step_routed, during_pass)
                if self.fp4 is not None:  # read under the lock: the manager cannot change residency here
                    outcome = outcome.with_all_fp4(self.fp4.pool.all_resident(outcome.last_pass.routed_ids))
        except BaseException:
            if self._early and self.device.type == "cuda":  # a pass that failed before its read may still run:
                torch.cuda.current_stream(self.device).synchronize()  # its host copies land before the next clear
            if self._gather is not None:
                self._recover_gathered()
            self._decode_pending = None
            self._pair_choice.failed()
            if self._grid_choice is not None:
                self._grid_choice.failed()
            self.settle()
            self._stats.failed += 1
            raise
        finally:
            self._scan = False
        # no sync of its own: the last pass-log read synchronised the forward, and nothing the gate or
        # the FP4 tier does after it leaves work on the device (a forced promotion waits for its copies,
        # the gate's decisions read host values, the snapshot push below is host counts)
        # the pool's policy hears of this step's routed experts when the next pass is read (its
        # forward is then running on the device) or when anything uses the pool first: off the
        # host path between a no-miss step's sync and its return (the FP4 tier never uses this pool)
        # the reports, not their routed ids: those are computed when used, at the latest by the pass log's next read
        if self._tells_policy:
            self._untouched = self.last_pass, time.monotonic()
        if not prefill:
            self._decode_pass = self.last_pass
            self._missed_lately = outcome.first_pass_missing_pairs > 0
        if self.fp4 is not None:
            self.fp4.close_step(step_routed if outcome.gate is not None else self.last_pass.routed_ids)
            self._fp4_snapshot.push(self.log.host_seen())  # the last read's counts: no device work
            self._fp4_manager.wake()
        seconds = time.perf_counter() - started
        self._stats.add_step(outcome.replays, outcome.first_pass_missing_pairs, seconds, outcome.tolerated,
                             outcome.residue_pairs)
        if self.pairs and not prefill:  # its time; with `always` a pair that gathered fewer than it missed backs off
            self._pair_choice.done(seconds, *(pair_first[2], pair_first[1]) if pair_first else (),
                                   first_missed=outcome.first_pass_missing_pairs > 0)
            if self._grid_choice is not None and pair_first:  # a pair's time is a sample of its grid
                self._grid_choice.done(seconds)
            elif self._grid_choice is not None:
                self._grid_choice.clear()
            self._stats.wide_pairs += bool(pair_first) and wide_pair
        self._log_kpi()
        return result, outcome

    def _unread_step(self, forward: Callable[[], object]):
        """A decode step that cannot miss: its forward launched, nothing read (no sync), no policy to tell."""
        started = time.perf_counter()
        try:
            result = forward()
        except BaseException:
            self._stats.failed += 1
            raise
        self._stats.add_unread_step(time.perf_counter() - started)
        self._log_kpi()
        return result, UNREAD_OUTCOME

    def _log_kpi(self) -> None:
        """After a step: the KPI line of the last `kpi_every` steps, every `kpi_every` steps."""
        every = self.config.kpi_every
        if every and self._stats.steps % every == 0:
            log.info(self.kpi_line(every))

    def _clocked(self, forward: Callable[[], object]):
        """`forward` with its host time added to the stats' `forward_seconds` (on CUDA with graphs: the launch)."""
        def run():
            started = time.perf_counter()
            try:
                return forward()
            finally:
                self._stats.forward_seconds += time.perf_counter() - started
        return run

    def _with_signal(self, forward: Callable[[], object], logits_of: Callable[[object], torch.Tensor]):
        """`forward` followed by the gate's signal on the device and its asynchronous copy to the
        host: the pass log's read, next on the same stream, synchronises both (no sync of its own)."""
        def run():
            result = forward()
            self._gate_signal.copy_(self.gate.signal_tensor(logits_of(result)), non_blocking=True)
            return result
        return run

    def _with_armed_gather(self, forward: Callable[[], object]):
        """`forward` after arming the spares staged for it while the pass before ran (gather_in_pass; none staged,
        e.g. after a host fetch: it gathers nothing)."""
        def run():
            self._gather.arm_staged()
            return forward()
        return run

    def _after_installs(self, forward: Callable[[], object]):
        """`forward`, which reads the pool without its per-layer waits (`first_pass`, a pass pair), after one device
        wait for the installs whose copies may still run (`DevicePool.before_unwaited_launch`)."""
        def run():
            self.pool.before_unwaited_launch()
            return forward()
        return run

    def _with_served_copies(self, forward_pair: Callable[[], object]):
        """`forward_pair` with its engine copies served by the host while it runs (config pass_pair_copies engine;
        otherwise `serve` returns at once)."""
        def run():
            self._gather.before_pair()
            result = forward_pair()
            self._gather.serve()
            return result
        return run

    def _stage_spares(self) -> None:
        """While a decode pass runs, before its read: the spares of the pass after it (gather_in_pass), from the
        victim plan just made, the free slots this pass may take left out (the device checks each victim when it
        uses it: see `PassGather`)."""
        slots, victims = self.pool.ahead_spares(self.pool.num_free + self._spares_ahead(), self._gather.armed_free)
        self._gather.stage(slots, victims)

    def _settle_gathered(self) -> None:
        """The host state of what the last read pass mapped for itself (gather_in_pass): pool, arena recency, stats.
        Deferred from the read like the policy's hits: `settle` (the next read, a fetch, `stats()`) runs it first."""
        if self._pending_gathered is None:
            return
        ids, slots, victims = self._pending_gathered
        self._pending_gathered = None
        self.pool.map_gathered(ids, slots, victims)
        self.arena.hit_ids(ids)
        self._stats.add_fetch(len(ids), len(ids) * self.source.row_bytes, 0.0, 0.0, 0.0, gathered=True)

    def _recover_gathered(self) -> None:
        """After a failed step (gather_in_pass): disarm, wait for the device, and map on the host what a pass
        that was not read mapped for itself (an entry the device table holds and the mirror does not), so the
        tables and the mirror agree again."""
        self._settle_gathered()
        self._gather.disarm()
        self._gather.sync()
        self._gather.recopy_gathered()
        gathered, table = self.log.gathered.cpu().tolist(), self.pool.table.cpu().view(-1).tolist()
        mirror = self.pool.mirror.reshape(-1)
        entries = [gathered[1 + 3 * i:4 + 3 * i] for i in range(gathered[0])]
        new = [(key, slot, victim) for key, slot, victim in entries if table[key] == slot and mirror[key] != slot]
        if new:
            self.pool.map_gathered(*(list(column) for column in zip(*new)))

    def _with_cleared_layers(self, forward: Callable[[], object]):
        """`forward` after zeroing the pass log's host stamps (early fetch: no stamp of the last pass
        may pass for this one's)."""
        def run():
            self.log.clear_layers()
            return forward()
        return run

    def _gated(self, first, forward, rewind, logits_of, step_routed: set, during_pass=None):
        def rerun():
            rewind()
            again = run_step(forward, rewind, self._read_pass, self._fetch_for_step, self.config, during_pass)
            step_routed.update(again[1].last_pass.routed_keys)
            return again

        (result, last), reruns, _, fire = run_gated(
            first, gate=self.gate, logits_of=logits_of or (lambda r: r), rerun=rerun,
            force_promote=self.fp4.force_promote, record_need=self.fp4.record_need,
            is_fp4=self.fp4.pool.is_resident, budget=self._gate_budget, fp_max=self.config.gate_fp_max,
            signal_of=self._gate_signal.item)
        self._gate_stats.add(self._stats.steps, fire)
        if fire is not None:
            step_routed.update(first[1].last_pass.routed_keys)
        outcomes = [first[1], *reruns]
        outcome = StepOutcome(sum(o.replays for o in outcomes), first[1].first_pass_missing_pairs, last.residue_pairs,
                              any(o.tolerated for o in outcomes), last.last_pass, fire)
        return result, outcome

    def settle(self) -> None:
        """Tell the pool's policy about the last step now (`step` defers it; a fetch, the next
        pass's read, `stats()` and `close()` settle first). Call it before reading
        `runtime.pool.policy` directly."""
        self._settle_gathered()  # first: the experts a pass gathered are resident when the step's hits are counted
        if self._untouched is not None:
            report, now = self._untouched
            self._untouched = None
            self.pool.touch_ids(report.routed_ids, now)

    def _read_pass(self) -> PassReport:
        if self._decode_pending is not None:  # the pass now running on the device hides the host's time
            report, self._decode_pending = self._decode_pending, None
            self._follow_streamed(report)
        preparing = time.perf_counter()
        self.settle()
        # the hits reach the policy here, hidden behind the pass, not in the next install (a streamed one included)
        if self._early_hits:
            self.pool.apply_hits()
        # the victim plan prepares a fetch after this read. A decode pass that streams every expert it lacks from a
        # published arena row does not miss, so nothing is planned for it while passes miss nothing; after a pass
        # that missed all the same (a batch the CUDA multi-token kernels serve, which do not stream) its replays and
        # the next step's passes plan
        fetch_possible = self._stream_rows is None or not self._stream_rows.complete or self._missed_lately
        if self._plans_victims and not self._scan and fetch_possible:
            self.pool.plan_victims(self._victim_plan_size())
        # a pair's spares only where the next step may pair: a recent pass missed, the choice pairs it (staging costs
        # the host ~0.15 ms on the H200, which after isolated misses delayed the next read)
        pair_next = self._pairs_offered and self._recent_missing and self._pair_choice.stages_next()
        if self._gather is not None and not self._scan and (not self.pairs or pair_next):
            self._stage_spares()
        started = time.perf_counter()
        self._stats.prep_seconds += started - preparing
        self.last_pass = self.log.read()
        self._stats.read_seconds += time.perf_counter() - started
        self._missed_lately = self._missed_lately or self.last_pass.missing_pairs > 0
        if self._gather is not None:
            gathered = self.log.host_gathered()
            self._last_gathered = len(gathered[0])
            self._pending_gathered = gathered if gathered[0] else None
        if not self._scan:
            self._recent_missing = max(len(self.last_pass.missing_ids) + self._last_gathered,
                                       self._recent_missing * 7 // 8)
        return self.last_pass

    def _spares_ahead(self) -> int:
        """Victims to stage for the pass after the one running (beside the free slots): `gather_spares_per_miss`
        times the most experts a recent pass missed or gathered for itself (decaying), and a margin. The pass
        running takes its own victims from the head of the same eviction order, and the next one skips those, so
        two a miss run short when a step replaces much of a small pool (config gather_spares_per_miss)."""
        return self.config.gather_spares_per_miss * self._recent_missing + 16

    def _victim_plan_size(self) -> int:
        """How many candidates `plan_victims` notes: the last pass's routed experts (the plan's filter may drop
        that many) plus the spares staged ahead (`_spares_ahead`); a plan that falls short only sends that fetch
        down the general path (or arms fewer spares)."""
        last = self.last_pass
        if last is None:
            return 2 * working_set_slots(self.geometry, self.config.tokens_per_step, 1.0)
        return len(last.routed_ids) + self._spares_ahead()

    def _fetch_for_step(self, report: PassReport, partial: bool) -> int:
        if self._gather is not None:  # the pass's own mappings first; the replay is not armed (copies in flight)
            self._settle_gathered()
            self._gather.drop_staged()
        if self._plans_victims and not self._scan:
            installed = self._fetch_located(report)
            if installed is not None:
                return installed
        return self._fetch(report.missing_keys, report.routed_id_set, scan=self._scan, partial=partial,
                           after_read=True)

    def _fetch_located(self, report: PassReport) -> int | None:
        """The step's fetch after the pass-log read when every missing row is in the arena and the victims
        planned while the pass ran still hold: key ids and host addresses in plain lists (a few dozen rows: no
        array calls), and the first row copy issued before the bookkeeping (the arena's recency, the stats).
        None, having changed nothing, when that is not the case (the general `_fetch` then runs)."""
        started = time.perf_counter()
        # in layer order; resident ones are not fetched again (early fetch may have installed them since they missed)
        ids = self.pool.unmapped_ids(sorted(set(report.missing_ids)))
        if not ids:
            return 0
        addresses = self.arena.locate(ids)
        if addresses is None:
            return None
        lacking = len(ids) - self.pool.num_free
        # the pass's routed experts (the read's counts, indexed by key id) are never victims
        planned = self.pool.planned_victims(self.log.host_routed_counts(), lacking) if lacking > 0 else ([], [])
        if planned is None:
            return None
        installing = time.perf_counter()
        row_bytes = self.source.row_bytes
        self.pool.install_located(ids, addresses, row_bytes, *planned)
        done = time.perf_counter()
        self.arena.hit_ids(ids, installing - started)
        self._stats.add_fetch(len(ids), len(ids) * row_bytes, done - started, installing - started, done - installing,
                              located=True)
        return len(ids)

    def _defer_streamed(self, report: PassReport) -> None:
        """Config stream_arena, after a decode step's last read: count the experts its last pass streamed from the
        arena (logged, not missing: a pass that missed had them fetched before its replay) and leave the report to
        `_follow_streamed` at the next decode step's first pass-log read, whose pass then runs on the device while
        the host does that work instead of on this step's path (that pass streams those experts once more)."""
        if not report.missing_pairs and report.missing_ids:
            self._stats.streamed_steps += 1
            self._stats.streamed_experts += len(report.missing_ids)
        self._decode_pending = report

    def _follow_streamed(self, report: PassReport) -> None:
        """The experts `report`'s pass streamed installed for later passes (`stream_install`): those the heat admits
        (hotter), or as many as free slots and the policy's victims outside that pass's routed set allow (all),
        with nothing launched later waiting for the copies (`DevicePool.install_located(..., streamed=True)`: the
        victims are unmapped on the compute stream after any pass launched since, so none of them is rewritten
        while a launched pass may read it)."""
        started = time.perf_counter()
        if self._stream_heat is not None:
            self._stream_heat.observe(report.routed_ids)
        if report.missing_pairs or not report.missing_ids:
            return
        ids = self.pool.unmapped_ids(sorted(set(report.missing_ids)))
        if not ids:
            return
        routed = self.log.host_routed_counts()  # [L * E] of `report`'s pass: no pass was read since
        if self._stream_heat is not None:
            ids, victims = self._stream_heat.admit(ids, self.pool.num_free, self.pool.mirror.reshape(-1), routed,
                                                   self.pool.policy.pinned)
            victim_slots = self.pool.mirror.reshape(-1)[victims].tolist()
        else:
            ids, victims, victim_slots = self._streamed_over_policy(ids, routed, report)
        addresses = self.arena.locate(ids) if ids else None
        if addresses is None:
            return
        installing = time.perf_counter()
        row_bytes = self.source.row_bytes
        self.pool.install_located(ids, addresses, row_bytes, victims, victim_slots, streamed=True)
        done = time.perf_counter()
        self.arena.hit_ids(ids, installing - started)
        self._stats.streamed_installs += len(ids)
        self._stats.add_fetch(len(ids), len(ids) * row_bytes, done - started, installing - started, done - installing,
                              located=True)

    def _streamed_over_policy(self, ids: list[int], routed: np.ndarray,
                              report: PassReport) -> tuple[list[int], list[int], list[int]]:
        """stream_install all: (ids, victims, their slots) for as many of `ids` (ascending) as the free slots and the
        pool policy's victims outside the pass's routed set take, the first ones in layer order."""
        lacking = len(ids) - self.pool.num_free
        victims: list[int] = []
        victim_slots: list[int] = []
        if lacking > 0:
            planned = self.pool.planned_victims(routed, lacking) if self._plans_victims else None
            if planned is not None:
                victims, victim_slots = planned
            else:
                victims = self.pool.evictable_ids(report.routed_id_set, lacking)
                victim_slots = self.pool.mirror.reshape(-1)[victims].tolist()
        return ids[:len(victims) + self.pool.num_free], victims, victim_slots

    # -- observability ------------------------------------------------------------------------
    def stats(self) -> RuntimeStats:
        """Counters so far (copies still in flight are counted once done)."""
        self.settle()
        self.pool.collect()
        arena = self.arena.stats()
        return self._stats.snapshot(arena.hit_rows, arena.miss_rows, self.pool.copy_seconds,
                                    self._pair_choice.medians_ms())

    def counters(self) -> tuple:
        """Cheap running totals for per-step breakdowns, named by `COUNTERS`. Fetch seconds are the
        host's time in `fetch` (arena, install and any wait for the last fetch's copies); copy
        seconds the copies' own time, counted once they are done (device events on CUDA)."""
        s, pool = self._stats, self.pool
        pool.collect()
        return (s.steps, s.replays, s.fetched_bytes, s.fetch_seconds, *self.arena.row_counts(), s.arena_seconds,
                s.install_seconds, pool.copy_seconds, pool.wait_seconds, s.read_seconds, s.forward_seconds,
                s.prep_seconds, s.pairs, s.first_pass_misses, s.streamed_experts)

    def kpi_line(self, last: int = 0) -> str:
        self._settle_gathered()  # the last pass's own rows counted (gather_in_pass)
        self.pool.collect()
        arena = self.arena.stats()
        line = self._stats.kpi_line(last, arena.hit_rows, arena.miss_rows, self.pool.copy_seconds,
                                    self._pair_choice.medians_ms())
        if self.fp4 is not None:
            line += precision_kpi(self.fp4_stats(), self.gate_stats() if self.gate is not None else None)
        return line

    def fp4_stats(self) -> Fp4Stats | None:
        """Counters of the FP4 tier (None without one)."""
        return self.fp4.stats() if self.fp4 is not None else None

    def gate_stats(self) -> GateStats:
        return self._gate_stats.snapshot()

    def pause_fp4_manager(self, timeout: float | None = None) -> bool:
        """Hold the FP4 pool's residency still: the manager finishes its pass and then takes no
        window (they merge, none is lost) until `resume_fp4_manager()`. Gate fires still promote."""
        return self._fp4_manager.pause(timeout) if self._fp4_manager is not None else True

    def resume_fp4_manager(self) -> None:
        if self._fp4_manager is not None:
            self._fp4_manager.resume()

    def wait_fp4_manager(self, timeout: float | None = None) -> bool:
        """Block until the FP4 manager consumed every step so far (deterministic tests, benchmarks)."""
        return self._fp4_manager.wait_idle(timeout) if self._fp4_manager is not None else True

    def preload_fp4(self, keys: Iterable[Key] | None = None) -> None:
        """Promote `keys` (default: every expert) to FP4 now."""
        if self.fp4 is None:
            raise ConfigError("this runtime has no FP4 pool")
        self.fp4.preload(keys)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Save the arena's heat, release the pool, the pinned arena and the source's files."""
        if self.closed:
            return
        self.settle()
        self.pool.wait()  # no copy may still read the arena when it is freed
        self.closed = True
        if self._fp4_manager is not None:
            self._fp4_manager.close()
            self.fp4.close()
        self.arena.close()
        close_source = getattr(self.source, "close", None)
        if close_source is not None:
            close_source()
        for callback in self._on_close:
            callback()
        del self.experts, self.pool, self.arena, self.log, self.fp4
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> TieredRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown compute backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend
