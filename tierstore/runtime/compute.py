"""Routed-expert compute over the device pool, one MoE layer per call.

Two backends with the same contract: weights come from the FP4 pool's slot when the expert has one,
else from the base pool's, through their slot tables; a pair whose expert has neither contributes
exactly zero and is logged in the PassLog;
the top-k combine runs in a fixed order, so a token's result does not depend on other tokens. With config
`gather_in_pass` each call first lets the pass fetch the layer's missing arena rows itself (`PassGather.layer`,
after the pass log recorded the routing).

- `TorchExperts`: plain torch (float32) decoding the same slot bytes with the kernels' reference
  decoder; the CPU variant of the runtime (no sync-free guarantee: it reads the table on the host).
- `TritonExperts`: `tierstore.kernels.moe_mm` (route, gate_up, down, combine), capture-safe. With config
  `cuda_w2` (true, or `auto` where `cuda_w2_unavailable` finds nothing missing) it hands `moe_mm` the CUDA C++ whole
  op (`load_cuda_w2`, built once at boot: the W2 stages, plus the FP4 stages with an FP4 pool) for the batch sizes
  `cuda_w2_block_tokens` gives it; other batches run the Triton gate_up and down.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tierstore.errors import ConfigError
from tierstore.kernels.layout import SlotLayout, unpack_matrix_ref
from tierstore.reference_moe import swiglu
from tierstore.runtime.pass_gather import PassGather
from tierstore.runtime.passlog import PassLog
from tierstore.runtime.pools import DevicePool
from tierstore.runtime.stream_rows import StreamRows

log = logging.getLogger("tierstore.runtime")
KNOB = "TIERSTORE_CUDA_W2 (config cuda_w2)"


def check_cuda_w2(layout: SlotLayout, fp4_layout: SlotLayout | None, device: torch.device, backend: str) -> None:
    """The conditions of config `cuda_w2` that need no CUDA: ConfigError naming the first one unmet. `fp4_layout`:
    the FP4 pool's, when the runtime has one (its pairs then run the CUDA FP4 stages)."""
    from tierstore.kernels.cuda import fp4_stages, loader, w2_down, w2_gate_up

    try:
        w2_gate_up.check_geometry(layout)
        w2_down.check_geometry(layout)
        if fp4_layout is not None:
            fp4_stages.check_geometry(fp4_layout)
    except ValueError as error:
        raise ConfigError(f"{KNOB} is on but the expert shapes (hidden {layout.hidden}, expert inter {layout.inter}) "
                          f"do not fit the CUDA kernels: {error}; turn the knob off") from None
    if backend != "triton" or device.type != "cuda":
        raise ConfigError(f"{KNOB} needs the triton backend on a CUDA device; this runtime runs the {backend} backend "
                          f"on {device}")
    if loader.nvcc_path() is None:
        raise ConfigError(f"{KNOB} needs nvcc on PATH or in /usr/local/cuda/bin (the CUDA toolkit) to build the "
                          "CUDA kernels; install it or turn the knob off")


def cuda_w2_unavailable(layout: SlotLayout, fp4_layout: SlotLayout | None, device: torch.device,
                        backend: str) -> str | None:
    """Why config `cuda_w2` "auto" leaves the CUDA kernels off for this runtime, or None when nothing is missing:
    a CUDA device of compute capability 9.x (the kernels are sm_90a builds), then `check_cuda_w2`'s conditions."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"compute capability {major}.{minor}: the kernels are built for sm_90a (Hopper)"
    try:
        check_cuda_w2(layout, fp4_layout, device, backend)
    except ConfigError as error:
        return str(error)
    return None


def auto_cuda_w2(layout: SlotLayout, fp4_layout: SlotLayout | None, device: torch.device, stream: bool = False,
                 stream_stage: bool = False):
    """Config `cuda_w2` "auto": the CUDA whole op where nothing is missing (`cuda_w2_unavailable`) and it builds, else
    None (the Triton stages), the reason logged: INFO where a condition is unmet on a CUDA device, WARNING when the
    build or load fails. `stream`, `stream_stage`: its stream builds (`load_cuda_w2`)."""
    reason = cuda_w2_unavailable(layout, fp4_layout, device, "triton")
    if reason is not None:
        if device.type == "cuda":
            log.info("CUDA C++ kernels off (config cuda_w2 auto; the Triton kernels run): %s", reason)
        return None
    log.info("config cuda_w2 auto: building or loading the CUDA C++ kernels (nvcc on first use, cached after)")
    try:
        return load_cuda_w2(layout, fp4_layout, device, stream=stream, stream_stage=stream_stage)
    except ConfigError as error:
        log.warning("CUDA C++ kernels off (config cuda_w2 auto; the Triton kernels run): %s", error)
        return None


def load_cuda_w2(layout: SlotLayout, fp4_layout: SlotLayout | None, device: torch.device, stream: bool = False,
                 stream_stage: bool = False):
    """The CUDA whole op for config `cuda_w2`, after `check_cuda_w2`: `W2MoeCuda` (the W2 stages), or with an FP4
    pool `TierMoeCuda` (the W2 stages, then the FP4 stages for FP4-resident pairs). nvcc builds cached on disk,
    loaded into torch's context; a failed build or load is a ConfigError. One object serves every layer and batch
    size: the kernels take the shapes and buffers as launch arguments. `stream` (config stream_arena, no FP4 pool):
    the single-token kernels' stream builds; `stream_stage` (config stream_stage, with `stream`): their W2_STREAM_STAGE
    builds."""
    check_cuda_w2(layout, fp4_layout, device, "triton")
    from tierstore.kernels.cuda import w2_down
    from tierstore.kernels.cuda.loader import CudaError
    from tierstore.kernels.cuda.tier_moe import TierMoeCuda
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda

    try:
        kernels = W2MoeCuda(device=device.index, wps=w2_down.wps_of(layout), stream=stream,
                            stream_stage=stream and stream_stage)
        if fp4_layout is not None:
            kernels = TierMoeCuda(w2=kernels, device=device.index, fp4_wps=w2_down.wps_of(fp4_layout))
    except (CudaError, OSError) as error:
        raise ConfigError(f"{KNOB}: the CUDA kernels did not build or load ({error}); they need nvcc and an "
                          "sm_90a (Hopper) GPU, or turn the knob off") from None
    log.info("CUDA whole op on: gate_up and down of decode batches on CUDA C++ kernels (%s)",
             "W2 and FP4 tiers" if fp4_layout is not None else "W2 tier")
    return kernels


CUDA_MULTI_MAX_PAIRS_PER_EXPERT = 64  # cuda_w2_block_tokens: the multi-token kernels' last measured win
CUDA_MULTI_MAX_PAIRS_PER_EXPERT_FP4 = 16  # the same with an FP4 pool (the FP4 multi-token kernels' largest measured)


def cuda_w2_block_tokens(pairs: int, experts: int, fp4: bool = False) -> int | None:
    """The route block size config `cuda_w2` gives a batch of `pairs` routed pairs, None where the CUDA kernels
    do not serve it (the Triton stages on moe_mm's default workspace).

    Without an FP4 pool: below experts / 2 pairs 1 (the single-token kernels, one pair per block); from there up to
    CUDA_MULTI_MAX_PAIRS_PER_EXPERT pairs per expert on average 16 (the multi-token kernels, each expert's tile
    decoded once per column group of its pairs; W2MoeCuda picks the group width by pairs per expert); above that None.
    With an FP4 pool (`TierMoeCuda`: the W2 stages, then the FP4 stages, single- or multi-token as above): 1 from
    experts / 4 to experts / 2 pairs, 16 from there up to CUDA_MULTI_MAX_PAIRS_PER_EXPERT_FP4 pairs per expert, else
    None. The H200 measurements behind each bound: benchmarks/cuda-w2-notes.md, "The runtime's block rule"."""
    if fp4:
        if 4 * pairs < experts or pairs > CUDA_MULTI_MAX_PAIRS_PER_EXPERT_FP4 * experts:
            return None
        return 16 if 2 * pairs >= experts else 1
    if pairs > CUDA_MULTI_MAX_PAIRS_PER_EXPERT * experts:
        return None
    return 16 if 2 * pairs >= experts else 1


class TorchExperts:
    """`stream` (config stream_arena): an expert without a slot whose row `stream.row` gives is computed from that row
    and logged without counting its pairs as missing, as the CUDA stream kernels do."""

    def __init__(self, pool: DevicePool, layout: SlotLayout, log: PassLog, swiglu_limit: float | None,
                 fp4_pool: DevicePool | None = None, fp4_layout: SlotLayout | None = None, cuda_w2: bool | str = False,
                 gather: PassGather | None = None, stream: StreamRows | None = None):
        if cuda_w2 is True:  # raises: the knob needs the triton backend (after naming any other unmet condition)
            check_cuda_w2(layout, fp4_layout if fp4_pool is not None else None, pool.device, "torch")
        if stream is not None and pool.device.type == "cuda":
            raise ConfigError("stream_arena on CUDA needs the triton backend (the CUDA stream kernels)")
        self.pool, self.layout, self.log, self.swiglu_limit, self.gather = pool, layout, log, swiglu_limit, gather
        self.stream = stream
        self.tiers = [(pool, layout)] + ([(fp4_pool, fp4_layout)] if fp4_pool is not None else [])
        self._decoded: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor]] = {}  # (tier, slot) -> (gen, w13, w2)

    @property
    def fp4_table(self) -> torch.Tensor | None:
        """int32 [L, E]: the FP4 pool's slot table (None without one)."""
        return self.tiers[1][0].table if len(self.tiers) > 1 else None

    def _weights(self, tier: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, layout = self.tiers[tier]
        generation = int(pool.generation[slot])
        cached = self._decoded.get((tier, slot))
        if cached is None or cached[0] != generation:
            raw = pool.slots[slot]
            cached = (generation, unpack_matrix_ref(raw, layout, "w13"), unpack_matrix_ref(raw, layout, "w2"))
            self._decoded[(tier, slot)] = cached
        return cached[1], cached[2]  # [2I, H], [H, I] float32

    def _slots(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tier int64 [T, k], slot int64 [T, k]); tier 1 = FP4 where resident, slot -1 = miss."""
        slots = self.pool.table[layer].to(torch.int64)[ids]  # [T, k]
        tiers = torch.zeros_like(slots)
        if len(self.tiers) > 1:
            fp4 = self.tiers[1][0].table[layer].to(torch.int64)[ids]  # [T, k]
            tiers = (fp4 >= 0).to(torch.int64)
            slots = torch.where(fp4 >= 0, fp4, slots)
        return tiers, slots

    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        x = hidden.to(torch.float32)  # [T, H]
        ids = topk_ids.to(torch.int64)  # [T, k]
        tokens, top_k = ids.shape
        self.log.record(layer, ids)
        if self.gather is not None:
            self.gather.layer(layer, self.fp4_table)
        tiers, slots = self._slots(layer, ids)  # [T, k], slot -1 = miss
        absent = slots < 0
        streamed = self._streamed(layer, ids, absent)  # [T, k] absent pairs computed from arena rows
        missing = absent & ~streamed
        self._log_misses(layer, ids[absent], int(missing.sum()))
        pair_out = torch.zeros(tokens, top_k, x.shape[1], dtype=torch.float32, device=x.device)  # [T, k, H]
        stride = max(pool.num_slots for pool, _ in self.tiers)
        tier_slot = tiers * stride + slots  # [T, k], one id per (tier, slot)
        for both in tier_slot[~absent].unique().tolist():
            rows, cols = (tier_slot == both).nonzero(as_tuple=True)
            w13, w2 = self._weights(*divmod(both, stride))
            pair_out[rows, cols] = swiglu(x[rows] @ w13.T, self.swiglu_limit) @ w2.T  # [n, H]
        for expert in ids[streamed].unique().tolist():
            rows, cols = (ids == expert).nonzero(as_tuple=True)
            raw = self.stream.row(layer * self.pool.num_experts + expert)
            w13, w2 = unpack_matrix_ref(raw, self.layout, "w13"), unpack_matrix_ref(raw, self.layout, "w2")
            pair_out[rows, cols] = swiglu(x[rows] @ w13.T, self.swiglu_limit) @ w2.T  # [n, H]
        weights = topk_weights.to(torch.float32).masked_fill(missing, 0.0)  # [T, k]
        out = torch.zeros_like(x)  # [T, H]
        for j in range(top_k):
            out += weights[:, j:j + 1] * pair_out[:, j]
        return out.to(hidden.dtype)

    def _streamed(self, layer: int, ids: torch.Tensor, absent: torch.Tensor) -> torch.Tensor:
        """bool [T, k]: the absent pairs whose expert has an arena row to stream from (none without `stream`)."""
        if self.stream is None or not absent.any():
            return torch.zeros_like(absent)
        has_row = self.stream.at.view(self.pool.num_layers, -1)[layer] != 0  # [E]
        return absent & has_row[ids]

    def _log_misses(self, layer: int, absent_ids: torch.Tensor, missing_pairs: int) -> None:
        """The route's log: each absent expert (missing or streamed) listed, `missing_pairs` counted."""
        if absent_ids.numel() == 0:
            return
        experts = absent_ids.unique()  # sorted
        first = int(self.log.counts[1])
        room = max(0, min(experts.numel(), self.log.entries.shape[0] - first))
        self.log.entries[first:first + room, 0] = layer
        self.log.entries[first:first + room, 1] = experts[:room].to(torch.int32)
        self.log.counts[0] += missing_pairs
        self.log.counts[1] += experts.numel()


class TritonExperts:
    """`stream` (config stream_arena, no FP4 pool): every pass computes an expert without a slot from its arena row,
    `stream.at` (the Triton stages' STREAM, and with config cuda_w2 the CUDA op's stream builds for the batches its
    single-token kernels serve; the batches of its multi-token kernels miss such experts as without streaming);
    `stream_stage` (config stream_stage): those CUDA stream builds stage a streamed block's rows in shared memory."""

    def __init__(self, pool: DevicePool, layout: SlotLayout, log: PassLog, swiglu_limit: float | None,
                 fp4_pool: DevicePool | None = None, fp4_layout: SlotLayout | None = None, cuda_w2: bool | str = False,
                 gather: PassGather | None = None, stream: StreamRows | None = None, stream_stage: bool = False):
        from tierstore.kernels.moe_mm import MissLog, TierPool, fp4_tier

        # config cuda_w2: the CUDA C++ gate_up + down, built here once (boot), or None (Triton stages); `auto` falls back
        # to the Triton stages where a condition is unmet (also per call: hidden states other than bfloat16)
        tier4 = fp4_layout if fp4_pool is not None else None
        self._cuda_w2_required = cuda_w2 is True
        if stream is not None and fp4_pool is not None:
            raise ConfigError("stream_arena streams W2 rows only: it does not run beside an FP4 pool")
        self._streams = stream is not None
        self.cuda_w2 = (auto_cuda_w2(layout, tier4, pool.device, self._streams, stream_stage) if cuda_w2 == "auto"
                        else load_cuda_w2(layout, tier4, pool.device, self._streams, stream_stage) if cuda_w2 else None)
        self._fp4 = fp4_pool is not None
        self.log, self.swiglu_limit, self.gather = log, swiglu_limit, gather
        self.w2_pool = TierPool(pool.slots, pool.table, layout, stream_at=stream.at if stream is not None else None)
        if fp4_pool is None:  # the kernels always take an FP4 tier: an empty one
            self.fp4_pool = fp4_tier(layout.hidden, layout.inter, 1, pool.num_layers, pool.num_experts, pool.device)
        else:
            self.fp4_pool = TierPool(fp4_pool.slots, fp4_pool.table, fp4_layout)
        self.misses = MissLog(log.counts, log.entries)
        self.num_experts = pool.num_experts
        self._workspaces: dict = {}
        # while a pass pair's conditional replay is captured: the stream the layers' side work forks to there (the
        # workspaces' own joined the capture outside the conditional bodies, so it cannot join one)
        self.body_side_stream = None

    @property
    def fp4_table(self) -> torch.Tensor:
        """int32 [L, E]: the FP4 pool's slot table (all -1 without one)."""
        return self.fp4_pool.table

    def _workspace(self, tokens: int, top_k: int, dtype: torch.dtype):
        from tierstore.kernels.moe_mm import MoeWorkspace

        key = (tokens, top_k, dtype)
        if key not in self._workspaces:
            layout = self.w2_pool.layout
            cuda = self.cuda_w2 is not None and (dtype == torch.bfloat16 or self._cuda_w2_required)
            block_tokens = cuda_w2_block_tokens(tokens * top_k, self.num_experts, self._fp4) if cuda else None
            workspace = MoeWorkspace.allocate(tokens, top_k, self.num_experts, layout.hidden, layout.inter, dtype,
                                              self.w2_pool.slots.device, block_tokens=block_tokens)
            self._workspaces[key] = (workspace, self.cuda_w2 if block_tokens is not None else None)
        return self._workspaces[key]

    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from tierstore.kernels.moe_mm import moe_mm

        ids = topk_ids.to(torch.int32).contiguous()  # [T, k]
        self.log.record(layer, ids)
        if self.gather is not None:  # config gather_in_pass: the layer's missing arena rows, before its route
            self.gather.layer(layer, self.fp4_table)
        # with config cuda_w2: decode-sized batches run the CUDA kernels (`cuda_w2_block_tokens`), larger ones (prefill)
        # keep the Triton stages
        workspace, cuda_w2 = self._workspace(ids.shape[0], ids.shape[1], hidden.dtype)
        if self.body_side_stream is not None and workspace.side_stream is not None:
            workspace = dataclasses.replace(workspace, side_stream=self.body_side_stream)
        if cuda_w2 is not None and hidden.dtype != torch.bfloat16:
            raise ConfigError(f"{KNOB} needs bfloat16 hidden states, got {hidden.dtype}; turn the knob off")
        return moe_mm(hidden.contiguous(), ids, topk_weights.to(torch.float32).contiguous(), self.w2_pool,
                      self.fp4_pool, layer, self.misses, workspace, swiglu_limit=self.swiglu_limit, cuda_w2=cuda_w2,
                      stream=self._streams)
