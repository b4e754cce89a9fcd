"""Runtime knobs: one frozen dataclass, validated at construction; the environment is read only
in `RuntimeConfig.from_env`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from tierstore.cache.slots import ARENA_POLICIES
from tierstore.errors import ConfigError
from tierstore.runtime.pair_choice import PAIR_CHOICES

REPLAY_MODES = ("strict", "approximate")
PAIR_COPIES = ("kernel", "engine")  # pass_pair_copies: who moves a pass pair's rows on CUDA
PAIR_PLANS = ("stream", "inline")  # pass_pair_plans: where a pass pair's first pass plans its layers' rows on CUDA
STREAM_INSTALLS = ("hotter", "all")  # stream_install: which experts a pass streamed are installed after it
GATE_SIGNALS = ("max_prob", "margin")
DEFAULT_GATE_TAU = {"max_prob": 0.60, "margin": 1.5}
ENV_PREFIX = "TIERSTORE_"
_OPTIONAL_KINDS = {"gate_tau": float}  # fields whose default is None: their type when given


@dataclass(frozen=True)
class RuntimeConfig:
    """How a tiered step treats misses.

    - `replay_mode`: `strict` (default) fetches and replays until no pair misses, and raises after
      `fp_max` replays rather than return logits with zeroed contributions; `approximate` is an
      explicit degraded mode: one replay is mandatory, further ones only while the residue is
      <= `fp_thresh`; what is left is accepted and counted.
    - `miss_tolerance`: a step with at most this many missing pairs keeps its logits without a
      replay (degraded, counted); its missing experts are still fetched for later steps.
    - `policy`: eviction policy of the device pool (any name of the policy registry). Default `freq-dense` (the
      routed counts decayed by `policy_half_life_s`; since the twenty-ninth session, when it read 4-43 % fewer rows
      from the disk than `lru` on issue #5's replay where the two differed; docs/runtime.md "The base pool's policy").
    - `policy_half_life_s`: wall-clock half-life in seconds of the routing counts of a device-pool policy that
      decays them (`freq`, `freq-dense`, `need`; the pool calls `begin_step` with time.monotonic()), and of the
      arena's counts under `arena_policy` `freq-dense`.
    - `arena_policy` (`lru`, the default, or `freq-dense`): what the host arena evicts when it is full, the least
      recently used row or the row asked for least (its requests, the pool's misses, counted with that half-life).
      In the simulator `freq-dense` read 0.55x-0.85x the pack rows of `lru` in 11 of 12 cells (docs/simulator.md,
      "The host arena's policy"); not measured on the H200, where the replay's arena holds every row and never
      evicts, hence not the default.
    - `force_pool`: start even when the pool is below the per-step working set
      (`working_set_margin` x layers x top-k x `tokens_per_step`).
    - `kpi_every`: log a KPI line every that many steps (0 = never).
    - `full_pool_reads` (default off): once a pool that holds every expert has them all installed, nothing can
      miss, so its decode steps launch the forward and return without reading the pass log: no device-to-host
      copy and no sync of their own (the caller's read of the result waits for the forward; `outcome.last_pass`
      is then `UNREAD_PASS`). Not where the read brings something back: an FP4 tier, the gate, `output_words`,
      recorded routing. On: every pass is read anyway (one copy and one sync per step: a check of that invariant).

    FP4 precision tier (docs/precision-tier.md):

    - `fp4_pool_gb`: size of the FP4 pool in GiB, `0` (no pool, the default) or `auto` (free
      device memory after everything else minus `fp4_reserve_gb`, capped by `fp4_max_gb` when
      > 0; CUDA only). A constructor's explicit slot count wins over it.
    - `fp4_policy`: eviction policy of the FP4 pool (`freq`, `need`, `lru` or any registered
      name); `need` never promotes lazily, the pool is then filled by gate fires only.
    - `fp4_half_life_s`: wall-clock half-life in seconds of the routing frequencies (and of the
      `freq` / `need` policies' counters).
    - `fp4_promote`: lazy promotions per manager pass (one batch).
    - `fp4_cold_steps`: a lazy eviction takes only experts not routed for this many steps.
    - `fp4_hysteresis`: h > 0: into a full pool a lazy candidate displaces only if its frequency
      > h x the weakest evictable expert's + 4 (off at 0); forced promotions are never gated.
    - `fp4_prefill`: before each prefill MoE layer, promote its routed set to FP4 where the pool
      allows (prefill on bare W2 writes a degraded KV cache); counted apart from gate promotions.
    - `gate`: arm the confidence gate (needs an FP4 pool). `gate_signal`: `max_prob` (top-1
      probability) or `margin` (top1 - top2 logit); `gate_tau`: fire when the signal is <= tau
      (None = 0.60 for max_prob, 1.5 for margin); `gate_tau_file`: a file holding tau, re-read
      when its mtime changes; `gate_agg`: `min` over the logits rows or `q:<f>` (that quantile).
    - `gate_fp_max`: promote-and-replay iterations per fired step; `gate_budget`: forced
      promotions per step, shared by its iterations (0 = unlimited, refused on a sub-floor pool).
    - `force_fp4_pool`: start with an FP4 pool below the gate's fire floor.
    - `gate_dump`: append one JSON line per fire to this file ("" = off).

    - `layer_waits` (default on; CUDA): a replay after a fetch starts at once and each MoE layer waits on
      the device only for its own layer's rows (`DevicePool` with `layer_waits`), so the early layers run
      while the later layers' rows are still copied; off: the replay waits for the whole fetch first.
      Same bytes either way (the same slots and kernels), only when each layer may start. A pool that
      holds every expert never waits per layer (it is filled once, before any step).
    - `unwaited_first_pass` (default on; a pool that can miss, not with `early_fetch`): a decode step's first pass,
      when the caller gives one (`TieredRuntime.first_pass`, captured as its own CUDA graph: `tierstore generate`,
      the replay benchmark), and a pass pair read the pool without the per-layer waits, after one device wait for
      the installs still in flight (usually none: a step's replay waited for its fetch's rows); replays and
      prefill keep the waits. Same slots and bytes: the result is unchanged. On the H200 the waits cost a no-miss
      pass ~40 us (its graph's launch ~20 us of it) at 50 % coverage on the recorded trace (docs/runtime-history.md,
      "A first pass without the layer waits").
    - `copy_streams` (1 or 2, default 1; with `layer_waits`): a fetch's row copies alternate between this
      many copy streams, so one copy's set-up overlaps another's transfer (each MoE layer then waits on one
      event per stream).
    - `early_fetch` (default off; with `layer_waits`, decode steps): while a pass runs, the host reads each
      finished MoE layer's routed experts (copied to pinned memory by the pass itself) and fetches the
      missing ones whenever the last such fetch's copies are done, evicting only experts of finished layers
      that the pass did not route, so the copies overlap the rest of the pass; what is still missing at the
      pass-log read is fetched as before, without waiting for those copies. Same bytes and kernels: the
      replay's result is unchanged; the pass pays two small device-to-host copies per MoE layer. On the H200
      it was slower than the default in 16 of 24 cells and faster in 8, by at most 1.22x (docs/runtime-history.md,
      "Early fetch"), hence off.
    - `gather_in_pass` (default off; decode steps, a pool that can miss, an arena): the pass fetches for itself.
      Before each decode pass the host arms spare slots (free ones, then the first experts of the policy's
      eviction order as victims); before each MoE layer's experts the pass maps the layer's missing experts that
      the arena holds into those spares and copies their rows from pinned host memory with a kernel, skipping a
      victim the pass has routed so far. The pass-log read brings the mappings back and the host state follows
      them; what still misses (no spare left, a row not in the arena) is fetched as before. Same rows and kernels:
      the result is unchanged. Not with `early_fetch`, nor with the torch backend on CUDA; armed only when no
      fetch's copies are in flight. On CUDA the kernels are CUDA C++ built with nvcc (`kernels/cuda/pass_gather.cu`);
      on a CPU their torch reference.
      On the H200 it was even with the default at 50 % coverage (0.98x-1.04x its step time over four runs) and
      slower at 25 % (by 2-13 %) (docs/runtime-history.md, "The pass's own fetch"), hence off.
    - `pass_pair` (`auto`, the default; true; false; decode steps, a pool that can miss, an arena): a decode step
      that is likely to miss (a recent pass missed) is launched as a pair, its pass and the replay together (one
      CUDA graph where the caller captures `TieredRuntime.pass_pair`): after each MoE layer's experts the first
      pass maps the layer's missing arena rows into armed spares (as `gather_in_pass` does) and copies them on a
      side stream while its later layers run; the replay waits for each layer's rows before that layer. The host
      launches once and reads once; what the replay still misses is fetched and replayed as before. Same rows and
      kernels: the result is unchanged. Not with `gather_in_pass` or `early_fetch`, nor with the torch backend on CUDA.
      `auto`: on where it can run and pays, a CUDA device with the triton backend, an arena and neither of those
      knobs (its CUDA kernels failing to build turn it off with a warning); off on a CPU, where a pass is not
      asynchronous and a pair costs two. The caller launches the pairs (`tierstore generate`, the replay
      benchmark; not yet the vLLM adapter, which turns it off). On the H200 it was faster than single passes at
      50 % coverage on average (1.05x-1.07x), even with them at 25 % and 1-3 % slower at 10 %
      (docs/runtime-history.md, "The timed choice"); since the seventeenth session's deeper spares and timed copy
      grid the default is 0.83x-0.92x / 0.85x-0.99x / 0.94x-1.02x the single passes' step at 50 / 25 / 10 % on the
      synthetic trace, and 1.13x at 50 % on the recorded trace, where misses are rare (docs/runtime-history.md,
      "The pair's spares staged deeper and its copy grid timed").
      `pass_pair_copy_blocks` (default 4) is the side stream's copy grid, which shares the SMs with both passes,
      and `pass_pair_wide_blocks` (default 16; 0: none) a wider one for pairs whose copies are most of the step:
      with both, each pair's copies work over one of the two, picked by their recent pair times (a timed choice as
      `pass_pair_choice`'s, kernel copies). On the H200 (seventeenth session) 16 blocks beat 4 at 25 % and at
      qwen3-30b-a3b 10 % (by 6-10 %; even at ds-v2-lite 10 %) and lost by 9 % at qwen3-30b-a3b 50 %
      (docs/runtime-history.md, "The pair's spares staged deeper and its copy grid timed").
      `pass_pair_choice` ("timed", the default; "always"): which decode steps likely to miss launch their pair:
      those where a pair's expected wall time is below a single pass's: each kind's recent times with and without a
      first-pass miss, weighed by the share of the last 8 such steps whose first pass missed (whichever kind ran;
      since the eighteenth session: the kinds' plain medians kept pairing steps after isolated misses, which then
      rarely missed; a kind without a time for an outcome recent steps had runs next). The two kinds alternate until
      each has three times, then the slower one runs now and then to stay measured: 16 such steps after the choice
      formed or turned, then twice as far apart after each run that did not turn it, up to 64;
      `runtime/pair_choice.py`. Or every one but the 8 steps after a pair whose first pass
      gathered fewer experts than it missed (spares short, rows not in the arena). The next pass's spares are
      staged only after a recent miss.
      `pass_pair_replay_segment` (default 0: off; kernel copies): a pair's replay runs only when its first pass
      missed something; in the pair's CUDA graph it is cut into conditional (IF) nodes of this many MoE layers
      each, whose predicate the device computes after the first pass, so a pair that missed nothing costs one pass.
      Each segment waits for the copies of all its layers before it starts (a conditional body cannot wait for a
      node outside it), where the replay otherwise waits layer by layer. Torch captures IF nodes from 2.12; for an
      older torch (the H200's 2.11) the CUDA runtime makes them (`kernels/cuda/graph_if.cu`, nvcc) in the captures
      tierstore makes; without either, a captured replay always runs. Eager, the host reads the count (a sync on
      CUDA). The result is unchanged. Off by default: on the H200 (nineteenth session, segments of 4) a skipped pair
      cost 0.30-0.65 ms against 0.23-0.37 ms for a single pass that missed nothing (its staging of the next pair's
      spares is host work the shorter step no longer hides), a pair that missed 1-10 % more than before (the
      segments' waits and nodes), so the step was 0.997x-1.057x the replay-always one on the recorded trace and
      0.84x-1.08x on the synthetic one (docs/runtime-history.md, "A pair's replay only when its first pass missed").
      `stream_arena` (default auto): a decode pass computes an expert without a pool slot straight from its row in
      the pinned arena, read over the bus by the kernels (the Triton stages' STREAM, and where config `cuda_w2` runs
      the CUDA kernels their W2_STREAM builds; `runtime/stream_rows.py`), instead of missing it: the same bytes as
      from a slot, so the same logits, and no replay. Such experts are logged, not counted as missing, and installed
      later (below) with nothing launched after waiting for the copies: a later pass reads the new slot once its
      table entry lands, the arena row before. True needs the triton backend on CUDA (or the torch backend on a
      CPU), an arena that holds every routed expert (it then never evicts, so a row the kernels may read never
      moves), no FP4 tier, and none of `gather_in_pass`, `early_fetch` and `pass_pair` true (`pass_pair` auto is
      then off); auto is on where all of that holds on CUDA. Passes of every batch size and dtype stream, except
      the batches of the CUDA multi-token kernels (route blocks of 16, from experts / 2 routed pairs up), which
      miss as before. The CPU runtime (torch backend) streams the same way (`TorchExperts`) when asked (true), for
      tests. On the H200
      (twenty-first session, the CUDA kernels) auto's steps took 0.61x-1.01x the time of steps
      without streaming on the recorded trace and 0.80x-0.99x on the synthetic one (docs/runtime-history.md, "Streamed
      installs under the next pass, only the hotter experts").
      A step's streamed rows are installed while the next decode step's first pass runs (their host work off the
      step's path), and `stream_install` picks which ones: `hotter` (the default) installs a streamed expert into a
      free slot, or over the coldest resident expert outside the pass's routed set while the streamed one is hotter
      (each expert's heat: the decode steps that routed it, halved every `stream_heat_halving` decode steps, 0 =
      never), so a row crosses the bus a second time only where it displaces a colder one; `all` installs every
      streamed expert over the pool's policy's victims (the twentieth session's rule: each missed row then crosses
      the bus twice). `stream_stage` (default true; the CUDA kernels' stream builds): a streamed expert's block
      first copies its rows from the arena into shared memory in contiguous runs (each warp instruction 512
      contiguous bytes, where the K loop's loads take 64 bytes of each of eight rows), then computes from there; where
      the stage does not fit a block's shared memory (DeepSeek-V3's gate_up) it reads as without. Same bytes, same
      results.
      `pass_pair_copies` ("kernel", the default; "engine"): who moves the rows on CUDA: the copy kernel above, or
      the copy engine, driven by the host while the pair runs (each layer's plan in pinned memory, the rows issued
      on a copy stream, a flag written after them that the replay waits for); on a CPU both run the references.
      `pass_pair_plans` ("stream", the default; "inline"; kernel copies on CUDA): where the first pass plans each
      layer's rows: on a stream of their own, each plan after its layer's experts while the pass goes on to its next
      layers (only the last plan stays between the passes: the replay starts after it), or on the compute stream
      between the layers (each plan, ~7 us on the H200, then lies on the pass's path). Either way the replay reads
      only rows that landed and slots no plan is still unmapping, so its result is the same; with plans on their
      own stream a later layer of the first pass may still read a victim the plan is taking (that pass's result is
      thrown away; the replay then misses the victim and fetches it, as when a layer routes a victim later).
      `gather_keeps_recent` (default false; with `gather_in_pass` or `pass_pair`): true, a pass that maps its own
      missing experts skips a staged victim that the pass before it routed (the spares were planned before that
      pass's hits reached the policy); false takes it like any other victim, so the spares run short less often.
      A policy choice only: either way a victim routed later in the same pass is missed there and fetched. On the
      H200 (interleaved) the guard's step took 1.057x-1.062x the time at qwen3-30b-a3b 25 %; without it 50 % was
      1.4-1.5 % slower there, ds-v2-lite within -1.5 % to +0.6 % (docs/runtime-history.md, "The pair's spares and
      the pass before").
      `gather_spares_per_miss` (default 4; with `gather_in_pass` or `pass_pair`): the victims staged for the next
      pass, as a multiple of the most experts a recent pass missed or gathered (plus 16 and the free slots). They are
      planned while the pass before runs, from the head of the eviction order that pass takes its own victims from,
      so the next pass skips those first: with 2 (the setting until the seventeenth session) a pair after a pair ran
      short whenever a step replaced much of a small pool (every second pair at 10 % coverage). A policy choice only.
      On the H200, 4 against 2 (pairs with 16 blocks): 0.909x / 0.974x / 0.983x the step time at qwen3-30b-a3b 10 /
      25 / 50 % (same section).

    Kernels:

    - `cuda_w2` (`auto`, the default; true; false): the triton backend runs gate_up and down with the CUDA C++ whole op between the
      Triton route and combine (`tierstore.kernels.cuda`: `W2MoeCuda`, with an FP4 pool `TierMoeCuda`, which adds
      the FP4 stages; benchmarks/cuda-w2-notes.md, cuda-fp4-notes.md) for the batch sizes where it was measured
      faster (`compute.cuda_w2_block_tokens`): without an FP4 pool batches up to 64 routed pairs per expert on
      average (one pair per block below experts / 2 pairs, 16-pair expert blocks for the multi-token kernels from
      there: prefill batches too), with an FP4 pool from experts / 4 pairs (expert blocks from experts / 2, up to 16 pairs
      per expert); other batches keep the Triton stages. Other kernels,
      other summation order: logits may differ in the last bits from a run with the knob off (every run of one
      configuration uses the same kernels, so replays stay bit-identical). Its conditions: hidden a multiple of 512
      (any expert inter: both tiers' down kernels have a build for 16-word tiles), the triton backend on a CUDA
      device of compute capability 9.x (the kernels are sm_90a builds), nvcc (PATH or /usr/local/cuda/bin), a build
      that loads, and bfloat16 hidden states. `true`: each unmet condition is a ConfigError (at boot; the dtype at
      the first call). `auto`: on where they all hold, else the Triton stages, with the reason logged (INFO, or a
      WARNING when the build fails); hidden states of another dtype run the Triton stages.
    """

    replay_mode: str = "strict"
    fp_max: int = 32
    fp_thresh: int = 0
    miss_tolerance: int = 0
    policy: str = "freq-dense"
    policy_half_life_s: float = 60.0
    arena_policy: str = "lru"
    force_pool: bool = False
    working_set_margin: float = 1.15
    tokens_per_step: int = 1
    kpi_every: int = 500
    fp4_pool_gb: str = "0"
    fp4_reserve_gb: float = 3.0
    fp4_max_gb: float = 0.0
    fp4_policy: str = "freq"
    fp4_half_life_s: float = 5.0
    fp4_promote: int = 8
    fp4_cold_steps: int = 2
    fp4_hysteresis: float = 0.0
    fp4_prefill: bool = True
    gate: bool = False
    gate_signal: str = "max_prob"
    gate_tau: float | None = None
    gate_tau_file: str = ""
    gate_agg: str = "min"
    gate_fp_max: int = 3
    gate_budget: int = 64
    force_fp4_pool: bool = False
    gate_dump: str = ""
    layer_waits: bool = True
    unwaited_first_pass: bool = True
    copy_streams: int = 1
    early_fetch: bool = False
    gather_in_pass: bool = False
    pass_pair: bool | str = "auto"
    pass_pair_copy_blocks: int = 4
    pass_pair_wide_blocks: int = 16
    pass_pair_copies: str = "kernel"
    pass_pair_plans: str = "stream"
    gather_keeps_recent: bool = False
    gather_spares_per_miss: int = 4
    pass_pair_choice: str = "timed"
    pass_pair_replay_segment: int = 0
    stream_arena: bool | str = "auto"
    stream_install: str = "hotter"
    stream_heat_halving: int = 128
    stream_stage: bool = True
    cuda_w2: bool | str = "auto"
    full_pool_reads: bool = False

    def __post_init__(self) -> None:
        if self.replay_mode not in REPLAY_MODES:
            raise ConfigError(f"replay_mode must be one of {', '.join(REPLAY_MODES)}, got {self.replay_mode!r}")
        for name in ("fp_max", "tokens_per_step", "pass_pair_copy_blocks", "gather_spares_per_miss"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("fp_thresh", "miss_tolerance", "kpi_every", "pass_pair_wide_blocks", "pass_pair_replay_segment",
                     "stream_heat_halving"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.copy_streams not in (1, 2) or type(self.copy_streams) is not int:
            raise ConfigError(f"copy_streams must be 1 or 2, got {self.copy_streams!r}")
        if self.gather_in_pass and self.early_fetch:
            raise ConfigError("gather_in_pass and early_fetch both fetch while a pass runs; turn one of them off")
        if self.pass_pair_copies not in PAIR_COPIES:
            raise ConfigError(f"pass_pair_copies must be one of {', '.join(PAIR_COPIES)}, got {self.pass_pair_copies!r}")
        if self.pass_pair_plans not in PAIR_PLANS:
            raise ConfigError(f"pass_pair_plans must be one of {', '.join(PAIR_PLANS)}, got {self.pass_pair_plans!r}")
        if self.pass_pair_choice not in PAIR_CHOICES:
            raise ConfigError(f"pass_pair_choice must be one of {', '.join(PAIR_CHOICES)}, "
                              f"got {self.pass_pair_choice!r}")
        if self.pass_pair_replay_segment and self.pass_pair_copies == "engine":
            raise ConfigError("pass_pair_replay_segment with pass_pair_copies engine failed its GPU test (a held-back "
                              "row read stale, nineteenth session): use kernel copies")
        if self.stream_install not in STREAM_INSTALLS:
            raise ConfigError(f"stream_install must be one of {', '.join(STREAM_INSTALLS)}, got {self.stream_install!r}")
        object.__setattr__(self, "stream_arena", _switch_setting("stream_arena", self.stream_arena))
        if self.stream_arena is True and (self.gather_in_pass or self.early_fetch):
            other = "gather_in_pass" if self.gather_in_pass else "early_fetch"
            raise ConfigError(f"stream_arena and {other} both serve misses during a pass; turn one of them off")
        object.__setattr__(self, "pass_pair", _switch_setting("pass_pair", self.pass_pair))
        if self.stream_arena is True and self.pass_pair is True:
            raise ConfigError("stream_arena computes missing experts in the pass, so a pass pair has nothing to "
                              "replay: set pass_pair to auto or false")
        if self.pass_pair is True and (self.gather_in_pass or self.early_fetch):
            other = "gather_in_pass" if self.gather_in_pass else "early_fetch"
            raise ConfigError(f"pass_pair and {other} both fetch while a pass runs; turn one of them off")
        object.__setattr__(self, "cuda_w2", _switch_setting("cuda_w2", self.cuda_w2))  # frozen: normalised once here
        if not self.policy_half_life_s > 0:
            raise ConfigError(f"policy_half_life_s must be > 0 seconds, got {self.policy_half_life_s!r}")
        if self.arena_policy not in ARENA_POLICIES:
            raise ConfigError(f"arena_policy must be one of {', '.join(ARENA_POLICIES)}, got {self.arena_policy!r}")
        if not self.working_set_margin >= 1.0:
            raise ConfigError(f"working_set_margin must be >= 1.0, got {self.working_set_margin!r}")
        self._check_precision_tier()

    def _check_precision_tier(self) -> None:
        if self.fp4_pool_gb != "auto":
            try:
                gib = float(self.fp4_pool_gb)
            except (TypeError, ValueError):
                gib = -1.0
            if not gib >= 0:
                raise ConfigError(f"fp4_pool_gb must be a number of GiB >= 0 or 'auto', got {self.fp4_pool_gb!r}")
        for name in ("fp4_reserve_gb", "fp4_max_gb", "fp4_hysteresis"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.fp4_half_life_s > 0:
            raise ConfigError(f"fp4_half_life_s must be > 0 seconds, got {self.fp4_half_life_s!r}")
        for name in ("fp4_promote", "fp4_cold_steps", "gate_budget"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if type(self.gate_fp_max) is not int or self.gate_fp_max < 1:
            raise ConfigError(f"gate_fp_max must be an integer >= 1, got {self.gate_fp_max!r}")
        if self.gate_signal not in GATE_SIGNALS:
            raise ConfigError(f"gate_signal must be one of {', '.join(GATE_SIGNALS)}, got {self.gate_signal!r}")
        if self.gate_tau is not None and not isinstance(self.gate_tau, (int, float)):
            raise ConfigError(f"gate_tau must be a number, got {self.gate_tau!r}")
        parse_gate_agg(self.gate_agg)

    @property
    def effective_gate_tau(self) -> float:
        """`gate_tau`, or the signal's default when it is None."""
        return DEFAULT_GATE_TAU[self.gate_signal] if self.gate_tau is None else float(self.gate_tau)

    @property
    def degraded(self) -> bool:
        """Whether this configuration may return logits with zeroed expert contributions."""
        return self.replay_mode == "approximate" or self.miss_tolerance > 0

    def full_pool_reads_passes(self, fp4: bool = False, records: bool = False) -> bool:
        """Whether a runtime whose pool holds every expert still reads its decode passes, its tokens not folded into
        them (no `output_words`): with `full_pool_reads`, the gate, an FP4 tier (`fp4`) or recorded routing
        (`records`) the read brings something back."""
        return self.full_pool_reads or self.gate or fp4 or records

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> RuntimeConfig:
        """Defaults, then `TIERSTORE_<FIELD>` variables (e.g. TIERSTORE_REPLAY_MODE), then `overrides`."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in fields(cls):
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                kind = _OPTIONAL_KINDS.get(field.name) or type(getattr(cls(), field.name))
                values[field.name] = _parse(field.name, raw, kind)
        values.update(overrides)
        return cls(**values)


def _parse(name: str, raw: str, kind: type):
    try:
        if kind is bool:
            if raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from None


def _switch_setting(name: str, value) -> bool | str:
    """A knob `name` as True, False or "auto" (also from the strings 1 / true / yes / on, 0 / false / no / off,
    auto)."""
    if value is True or value is False or value == "auto":
        return value
    text = value.lower() if isinstance(value, str) else None
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    if text == "auto":
        return "auto"
    raise ConfigError(f"{name} must be auto, true or false, got {value!r}")


def parse_gate_agg(text: str) -> float | None:
    """`min` -> None; `q:<f>` with 0 <= f <= 1 -> f (the quantile of the rows' signals)."""
    if text == "min":
        return None
    if text.startswith("q:"):
        try:
            quantile = float(text[2:])
        except ValueError:
            quantile = -1.0
        if 0 <= quantile <= 1:
            return quantile
    raise ConfigError(f"gate_agg must be 'min' or 'q:<f>' with 0 <= f <= 1, got {text!r}")
