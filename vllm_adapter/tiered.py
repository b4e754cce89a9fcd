"""The process's `tierstore.runtime.TieredRuntime`, shared by every MoE layer: the GPU as expert
cache (BASE_CACHE_GB: device pool over a host arena over the rows) and/or the precision tier
(DELTA_GB: FP4 pool and its manager; GATE: the confidence gate). With DELTA_GB alone the base pool
holds every expert (preloaded), so only the FP4 tier changes anything.

Layers register while vLLM post-processes weights; the runtime is assembled at the first forward
(vLLM's profile run, before any CUDA-graph capture), when every layer is known. Rows come from the
packs when STORE_DIR is set (`base` and, with DELTA_GB, `fp4`; base arena sized by BASE_RAM_GB),
otherwise from the requantized weights held in host RAM (W2 slots, and FP4 slots with DELTA_GB).

Execution `eager`: `moe()` fetches a call's missing experts before computing it, so no pair is
served as a miss. Execution `graph`: `moe()` computes with the pool as it is (misses are logged
on the device) and the model runner must drive `runtime.step(forward, rewind)`. The FP4 manager and
the gate are driven by the same runner hook (`tierstore.vllm_adapter.worker`); see docs/vllm.md.
"""

from __future__ import annotations

import logging

import torch

from tierstore.errors import ConfigError
from tierstore.geometry import MoEGeometry
from tierstore.kernels.layout import w2_slot_layout
from tierstore.runtime.token_chunks import token_chunks
from tierstore.vllm_adapter.pack_boot import PackBoot
from tierstore.vllm_adapter.settings import AdapterSettings

GIB = 2**30
log = logging.getLogger("tierstore.vllm_adapter")


def runtime_config(settings: AdapterSettings):
    """The adapter's knobs as the runtime's `RuntimeConfig` (one decode token per request and step; no pass pairs:
    the adapter does not launch them yet; no streaming from the arena: not run under vLLM on a GPU yet)."""
    from tierstore.runtime import RuntimeConfig

    pool = settings.fp4_pool_bytes
    return RuntimeConfig(replay_mode=settings.replay_mode, fp_max=settings.fp_max,
                         miss_tolerance=settings.miss_tolerance, kpi_every=settings.kpi_every, tokens_per_step=1,
                         fp4_pool_gb="auto" if pool == "auto" else repr(pool / GIB), gate=settings.gate,
                         gate_tau=settings.gate_tau, cuda_w2=settings.cuda_w2, pass_pair=False, stream_arena=False,
                         gate_tau_file=str(settings.gate_tau_file) if settings.gate_tau_file is not None else "")


class TieredModel:
    """The MoE layers of one model in one process and, once built, their runtime."""

    def __init__(self, settings: AdapterSettings, top_k: int, hidden: int, inter: int, swiglu_limit: float | None,
                 device: torch.device, boot: PackBoot | None):
        self.settings, self.top_k, self.hidden, self.inter = settings, top_k, hidden, inter
        self.swiglu_limit, self.device, self.boot = swiglu_limit, device, boot
        self.slot_bytes = w2_slot_layout(hidden, inter).slot_bytes
        self._rows: dict[int, torch.Tensor] = {}  # decoder layer -> uint8 [E, slot_bytes] (no pack)
        self._fp4_rows: dict[int, torch.Tensor] = {}  # decoder layer -> uint8 [E, fp4 slot bytes] (no pack)
        self._num_experts: int | None = None
        self._dense: dict[int, int] = {}  # decoder layer -> the runtime's dense MoE-layer index
        self.runtime = None

    def add_layer(self, decoder_layer: int, num_experts: int, slot_rows: torch.Tensor | None,
                  fp4_rows: torch.Tensor | None = None) -> None:
        """Register a layer; without a pack, its W2 `slot_rows` (uint8 [E, slot_bytes]) and, with
        DELTA_GB, its FP4 slot rows (uint8 [E, fp4 slot bytes])."""
        if self.runtime is not None:
            raise ConfigError("an MoE layer was added after the tiered runtime started")
        if self._num_experts not in (None, num_experts):
            raise ConfigError(f"MoE layers disagree on the expert count ({self._num_experts} vs {num_experts})")
        self._num_experts = num_experts
        if slot_rows is not None:
            self._rows[decoder_layer] = slot_rows.cpu()
        if fp4_rows is not None:
            self._fp4_rows[decoder_layer] = fp4_rows.cpu()

    def get_runtime(self):
        if self.runtime is None:
            self.runtime = self._build()
        return self.runtime

    def _build(self):
        from tierstore.cache.arena import arena_slots
        from tierstore.runtime import TieredRuntime
        from tierstore.runtime.rows import MemoryRowSource

        settings = self.settings
        fp4_source = None
        if self.boot is not None:
            geometry, source = self.boot.geometry, self.boot.rows
            pack_bytes = source.stride * geometry.num_moe_layers * geometry.num_experts
            ram = settings.base_ram_bytes
            arena = 0 if ram is None else arena_slots("auto" if ram == "auto" else ram / 2**30, source.stride,
                                                      pack_bytes)
            if settings.uses_fp4_tier:
                fp4_source = self.boot.fp4_rows
        else:
            layers = sorted(self._rows)
            geometry = MoEGeometry("vllm", tuple(layers), self._num_experts, self.top_k, self.hidden, self.inter,
                                   swiglu_limit=self.swiglu_limit)
            source = MemoryRowSource(torch.stack([self._rows[layer] for layer in layers]))  # [L, E, slot_bytes]
            if settings.uses_fp4_tier:
                fp4_source = MemoryRowSource(torch.stack([self._fp4_rows[layer] for layer in layers]))
            self._rows.clear()
            self._fp4_rows.clear()
            arena = 0
        self._dense = {layer: index for index, layer in enumerate(geometry.moe_layers)}
        pool = settings.base_cache_bytes // self.slot_bytes if settings.uses_expert_cache else \
            geometry.total_routed_experts
        runtime = TieredRuntime(geometry, source, pool_slots=pool, arena_slots=arena, device=self.device,
                                config=runtime_config(settings), fp4_source=fp4_source)
        if not settings.uses_expert_cache:
            runtime.preload()  # DELTA_GB without an expert cache: every expert's base is resident
        return runtime

    def moe(self, decoder_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed experts of the layer: x [T, H], topk_ids/topk_weights [T, k] -> [T, H]."""
        runtime = self.get_runtime()
        dense_layer = self._dense[decoder_layer]
        if self.settings.execution != "eager":
            return runtime.moe(dense_layer, x, topk_ids, topk_weights)
        keys = [(dense_layer, int(e)) for e in topk_ids.unique().tolist()]
        if len(keys) <= runtime.pool.num_slots:  # the batch's experts fit the cache: one fetch, one compute
            runtime.fetch(keys, protect=keys)
            return runtime.moe(dense_layer, x, topk_ids, topk_weights)
        outputs, chunks = [], token_chunks(topk_ids.tolist(), runtime.pool.num_slots)
        log.info("tierstore: MoE layer %d: %d routed experts over %d cache slots, %d tokens run in %d chunks (last-bit "
                 "differences from one batch)", dense_layer, len(keys), runtime.pool.num_slots, x.shape[0], len(chunks))
        for start, stop in chunks:
            keys = [(dense_layer, int(e)) for e in topk_ids[start:stop].unique().tolist()]
            runtime.fetch(keys, protect=keys)
            outputs.append(runtime.moe(dense_layer, x[start:stop], topk_ids[start:stop], topk_weights[start:stop]))
        return torch.cat(outputs)


_model: TieredModel | None = None


def tiered_model(**kwargs) -> TieredModel:
    """The process's TieredModel, created by the first layer that asks."""
    global _model
    if _model is None:
        _model = TieredModel(**kwargs)
    return _model


def current_runtime():
    """The process's TieredRuntime (None before the first forward, or without BASE_CACHE_GB and
    DELTA_GB): what the model-runner hook calls `step(forward, rewind, logits_of=...)` on."""
    return None if _model is None else _model.runtime


def runtime_for_step():
    """The runtime the step hook drives: built now if the model's MoE layers are registered but no
    forward has run yet (vLLM's profile run normally builds it first); None without one."""
    return None if _model is None else _model.get_runtime()


def forget_tiered_model() -> None:
    """Close and drop the process's runtime (tests build several models in one process)."""
    global _model
    if _model is not None and _model.runtime is not None:
        _model.runtime.close()
    _model = None
