"""`TierstoreMoEMethod`: vLLM's FusedMoE quantization method for tierstore's 2-bit experts.

Life of a layer:
1. `create_weights` registers parameters in the checkpoint's own format (bf16, FP8 block,
   NVFP4, MXFP4; see source_formats) so vLLM's weight loader fills and TP-shards them.
2. `process_weights_after_loading` requantizes every local expert to W2, keeps the slot form of
   the rows (device-resident, or host rows behind the process's expert cache) and frees the
   checkpoint-format parameters.
3. `apply` (router already run: topk_ids/topk_weights [T, k]) computes the routed experts on the
   CPU reference or the CUDA kernels. Eager execution fetches missing experts first; graph
   execution records them for the runner's `resolve_misses` + replay.
"""

from __future__ import annotations

import logging

import torch

from tierstore.errors import CapacityError, ConfigError
from tierstore.vllm_adapter.compat import FusedMoEMethodBase, set_weight_attrs
from tierstore.vllm_adapter.expert_compute import KernelBackend, ReferenceBackend, w2_slot_bytes
from tierstore.vllm_adapter.residency import LayerSlots, process_cache, resident_layer
from tierstore.vllm_adapter.settings import AdapterSettings
from tierstore.vllm_adapter.source_formats import (
    SourceFormat,
    check_shard_geometry,
    param_specs,
    requantize_expert,
)

logger = logging.getLogger(__name__)


def _needs_runtime(settings: AdapterSettings) -> list[str]:
    """Knobs whose machinery is the tiered runtime (FP4 pool manager, gate, arena over a pack)."""
    needs = []
    if settings.fp4_pool_bytes != 0:
        needs.append("DELTA_GB (FP4 pool)")
    if settings.gate:
        needs.append("GATE")
    if settings.store_dir is not None:
        needs.append("STORE_DIR (pack boot / NVMe tier)")
    if settings.base_ram_bytes is not None:
        needs.append("BASE_RAM_GB")
    if settings.tier_direct:
        needs.append("TIER_DIRECT")
    return needs


def check_layer_supported(layer: torch.nn.Module, settings: AdapterSettings) -> None:
    """Refuse, with the reason, what this method does not compute."""
    moe = layer.moe_config
    if moe.moe_parallel_config.use_ep:
        raise ConfigError("tierstore does not support expert parallelism (--enable-expert-parallel): "
                          "run with tensor parallelism, which splits every expert's intermediate dimension")
    activation = getattr(moe.activation, "value", moe.activation)
    if activation != "silu":
        raise ConfigError(f"tierstore computes SwiGLU (silu) experts; layer {layer.layer_name!r} uses {activation!r}")
    if moe.has_bias:
        raise ConfigError(f"layer {layer.layer_name!r} has expert biases, which tierstore does not support")
    if getattr(layer, "swiglu_alpha", None) is not None or getattr(layer, "swiglu_beta", None) is not None:
        raise ConfigError(f"layer {layer.layer_name!r} uses a SwiGLU alpha/beta variant; only the clamp is supported")
    if getattr(layer, "apply_router_weight_on_input", False):
        raise ConfigError(f"layer {layer.layer_name!r} applies router weights on the input; not supported")
    unbuilt = _needs_runtime(settings)
    if unbuilt:
        raise ConfigError(f"{', '.join(unbuilt)} need tierstore's tiered runtime, which this adapter does not "
                          "drive yet; unset them (supported now: ZERO_MODE, BASE_CACHE_GB, BASE_MISS_TOL, "
                          "REPLAY_MODE, FP_MAX, EXECUTION)")


def _graph_mode_allowed() -> bool:
    """True when MoE runs outside captured CUDA graphs (enforce_eager, or moe_forward split out)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    if config.model_config is not None and config.model_config.enforce_eager:
        return True
    splitting = getattr(config.compilation_config, "splitting_ops", None) or []
    return any("moe_forward" in op for op in splitting)


class TierstoreMoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, source_format: SourceFormat, settings: AdapterSettings, prefix: str):
        super().__init__(moe)
        self.source_format = source_format
        self.settings = settings
        self.prefix = prefix
        self.slots: LayerSlots | None = None
        self.backend: ReferenceBackend | KernelBackend | None = None
        self._miss_log = None

    # -- weights ---------------------------------------------------------------------------

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        check_layer_supported(layer, self.settings)
        tp_size = layer.moe_config.moe_parallel_config.tp_size
        check_shard_geometry(self.source_format, hidden_size, intermediate_size_per_partition, tp_size)
        if self.settings.uses_expert_cache and self.settings.execution == "eager" and torch.cuda.is_available() \
                and not _graph_mode_allowed():
            raise ConfigError("BASE_CACHE_GB with EXECUTION=eager fetches experts inside the MoE op, which a "
                              "captured CUDA graph would not repeat: run with --enforce-eager, or add "
                              "'vllm::moe_forward' and 'vllm::moe_forward_shared' to compilation_config.splitting_ops")
        attrs = {k: v for k, v in extra_weight_attrs.items() if k == "weight_loader"}
        specs = param_specs(self.source_format, num_experts, hidden_size, intermediate_size_per_partition, params_dtype)
        for spec in specs:
            param = torch.nn.Parameter(torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=False)
            layer.register_parameter(spec.name, param)
            set_weight_attrs(param, attrs if spec.quant_method is None else {**attrs, "quant_method": spec.quant_method})
        self._param_names = [spec.name for spec in specs]
        self.hidden, self.inter, self.num_experts = hidden_size, intermediate_size_per_partition, num_experts

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        params = {name: getattr(layer, name).data for name in self._param_names}
        device = params["w13_weight"].device
        self.backend = (KernelBackend(self.hidden, self.inter, self.num_experts) if device.type == "cuda"
                        else ReferenceBackend(self.hidden, self.inter))
        per_expert = [self.backend.expert_rows(*requantize_expert(self.source_format, params, e, self.settings.zero_mode))
                      for e in range(self.num_experts)]
        rows = tuple(torch.stack(parts) for parts in zip(*per_expert))  # each [E, ...]
        for name in self._param_names:  # the checkpoint-format copies are not needed any more
            delattr(layer, name)
        if self.settings.uses_expert_cache:
            slot_bytes = w2_slot_bytes(self.hidden, self.inter)
            cache = process_cache(self.settings.base_cache_bytes // slot_bytes, slot_bytes, device,
                                  lambda n: self.backend.empty_slots(n, device))
            self.slots = cache.add_layer(self.prefix, tuple(r.cpu() for r in rows))
        else:
            self.slots = resident_layer(self.prefix, rows, device)
        if self.backend.name == "kernels":
            self._miss_log = self.backend.miss_log(device)
        logger.info("tierstore: %s: %d experts as W2 (%s, %s)", self.prefix, self.num_experts, self.backend.name,
                    "expert cache" if self.settings.uses_expert_cache else "resident")

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # tierstore computes the experts itself; no vLLM modular kernel is involved

    # -- forward ---------------------------------------------------------------------------

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        """x [T, H], topk_ids [T, k] (global ids = local ids: no EP), topk_weights [T, k] -> [T, H]."""
        if self.slots is None:
            raise RuntimeError(f"{self.prefix}: apply before process_weights_after_loading")
        cache = self._cache()
        if cache is not None and self.settings.execution == "eager":
            cache.ensure_resident(self.prefix, topk_ids.unique().tolist())
        swiglu_limit = getattr(layer, "swiglu_limit", None)
        if self.backend.name == "reference":
            out, missing, pairs = self.backend.run(x, topk_ids, topk_weights, self.slots.table, self.slots.slots,
                                                   swiglu_limit)
            self._account_misses(cache, missing, pairs)
            return out
        return self.backend.run(x, topk_ids, topk_weights, self.slots.table, self.slots.slots, swiglu_limit,
                                self._miss_log)

    def _cache(self):
        from tierstore.vllm_adapter.residency import current_cache

        return current_cache() if self.settings.uses_expert_cache else None

    def _account_misses(self, cache, missing: list[int], pairs: int) -> None:
        if not missing:
            return
        if cache is None or self.settings.execution == "eager":
            raise CapacityError(f"{self.prefix}: experts {missing} were not resident after the fetch "
                                "(a bug: eager execution fetches every routed expert first)")
        cache.record_misses(self.prefix, missing, pairs)
