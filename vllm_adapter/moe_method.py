"""`TierstoreMoEMethod`: vLLM's FusedMoE quantization method for tierstore's 2-bit experts.

Life of a layer:
1. `create_weights` registers parameters in the checkpoint's own format (bf16, FP8 block,
   NVFP4, MXFP4; see source_formats) so vLLM's weight loader fills and TP-shards them.
2. `process_weights_after_loading` turns every local expert into W2 -- requantized from those
   parameters, or read from the pack when STORE_DIR is set (no requantization after the pack's
   first build; under tensor parallelism the pack of this TP rank) -- and frees the
   checkpoint-format parameters.
3. `apply` (router already run: topk_ids/topk_weights [T, k]) computes the routed experts:
   all resident on the CPU reference or the CUDA kernels, or through the process's tiered
   runtime when an expert cache (BASE_CACHE_GB) or an FP4 pool (DELTA_GB) is configured.
"""

from __future__ import annotations

import logging

import torch

from tierstore.errors import ConfigError
from tierstore.vllm_adapter.compat import FusedMoEMethodBase, set_weight_attrs
from tierstore.vllm_adapter.expert_compute import (KernelBackend, ReferenceBackend, cuda_w2_kernels, fp4_slot_row,
                                                   w2_slot_row)
from tierstore.vllm_adapter.pack_boot import decoder_layer, pack_boot
from tierstore.vllm_adapter.residency import LayerSlots, resident_layer
from tierstore.vllm_adapter.settings import AdapterSettings
from tierstore.vllm_adapter.source_formats import (
    SourceFormat,
    check_shard_geometry,
    param_specs,
    requantize_expert,
)
from tierstore.vllm_adapter.tiered import TieredModel, tiered_model
from tierstore.vllm_adapter.worker_check import WORKER_QUALNAME, runner_hook_reason, tierstore_worker_configured

logger = logging.getLogger(__name__)


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
    if settings.needs_runner_hook and not tierstore_worker_configured():
        raise ConfigError(f"{runner_hook_reason(settings)} needs tierstore's model-runner hook: start vLLM with "
                          f"--worker-cls {WORKER_QUALNAME} (and VLLM_USE_V2_MODEL_RUNNER=0)")


class TierstoreMoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, source_format: SourceFormat, settings: AdapterSettings, prefix: str):
        super().__init__(moe)
        self.source_format = source_format
        self.settings = settings
        self.prefix = prefix
        self.slots: LayerSlots | None = None  # resident experts
        self.tiered: TieredModel | None = None  # or the process's expert cache
        self.backend: ReferenceBackend | KernelBackend | None = None

    # -- weights ---------------------------------------------------------------------------

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        check_layer_supported(layer, self.settings)
        parallel = layer.moe_config.moe_parallel_config
        self.tp_rank, self.tp_size = parallel.tp_rank, parallel.tp_size  # this rank's pack under STORE_DIR
        check_shard_geometry(self.source_format, hidden_size, intermediate_size_per_partition, self.tp_size)
        if self.settings.uses_expert_cache and self.settings.execution == "eager" and torch.cuda.is_available() \
                and not _moe_runs_outside_graphs():
            raise ConfigError("BASE_CACHE_GB with EXECUTION=eager fetches experts inside the MoE op, which a "
                              "captured CUDA graph would not repeat: run with --enforce-eager, or use piecewise "
                              "graphs only (cudagraph_mode PIECEWISE) with 'vllm::moe_forward' and "
                              "'vllm::moe_forward_shared' in compilation_config.splitting_ops")
        attrs = {k: v for k, v in extra_weight_attrs.items() if k == "weight_loader"}
        specs = param_specs(self.source_format, num_experts, hidden_size, intermediate_size_per_partition, params_dtype)
        for spec in specs:
            param = torch.nn.Parameter(torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=False)
            layer.register_parameter(spec.name, param)
            set_weight_attrs(param, attrs if spec.quant_method is None else {**attrs, "quant_method": spec.quant_method})
        self._param_names = [spec.name for spec in specs]
        self.hidden, self.inter, self.num_experts = hidden_size, intermediate_size_per_partition, num_experts
        self.decoder_layer = decoder_layer(self.prefix)
        self.model_path = _current_model_path()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        device = getattr(layer, self._param_names[0]).device
        if device.type == "cuda":
            # resident layers' CUDA whole op; with the runtime its own (RuntimeConfig.cuda_w2) computes the layer
            resident_cuda = self.settings.cuda_w2 and not self.settings.uses_runtime
            kernels = cuda_w2_kernels(self.hidden, self.inter, device) if resident_cuda else None
            self.backend = KernelBackend(self.hidden, self.inter, self.num_experts, cuda_w2=kernels)
        elif self.settings.cuda_w2:
            raise ConfigError(f"CUDA_W2=1 runs CUDA C++ kernels; {self.prefix} lives on {device}: unset the knob")
        else:
            self.backend = ReferenceBackend(self.hidden, self.inter, self.num_experts)
        boot = None
        if self.settings.store_dir is not None:
            boot = pack_boot(self.model_path, self.settings.store_dir, self.settings.zero_mode,
                             self.settings.tier_direct, fp4=self.settings.uses_fp4_tier, rank=self.tp_rank,
                             world=self.tp_size)
            boot.check_layer(self.prefix, self.num_experts, self.inter, self.tp_rank, self.tp_size)
        if self.settings.uses_runtime:
            self.tiered = tiered_model(settings=self.settings, top_k=layer.top_k, hidden=self.hidden, inter=self.inter,
                                       swiglu_limit=getattr(layer, "swiglu_limit", None), device=device, boot=boot)
            if boot is not None:
                self.tiered.add_layer(self.decoder_layer, self.num_experts, None)
            else:
                self.tiered.add_layer(self.decoder_layer, self.num_experts, *self._requantized_slot_rows(layer))
            source = "pack" if boot is not None else "requantized"
        elif boot is not None:
            slots = boot.slot_rows(boot.dense_layer(self.prefix))  # [E, slot_bytes]
            self.slots = resident_layer(self.backend.rows_from_slots(slots), device)
            source = "pack"
        else:
            per_expert = [self.backend.expert_rows(*w2) for w2 in self._requantized(layer)]
            self.slots = resident_layer([torch.stack(parts) for parts in zip(*per_expert)], device)
            source = "requantized"
        for name in self._param_names:  # the checkpoint-format copies are not needed any more
            delattr(layer, name)
        logger.info("tierstore: %s: %d experts as W2 (%s), %s, %s", self.prefix, self.num_experts, source,
                    "expert cache" if self.tiered is not None else "resident", self.backend.name)

    def _requantized(self, layer: torch.nn.Module):
        params = {name: getattr(layer, name).data for name in self._param_names}
        return [requantize_expert(self.source_format, params, e, self.settings.zero_mode)
                for e in range(self.num_experts)]

    def _requantized_slot_rows(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W2 slot rows uint8 [E, slot_bytes], FP4 slot rows uint8 [E, fp4 slot bytes] with DELTA_GB
        else None) from one requantization."""
        experts = [(w13.to("cpu"), w2.to("cpu")) for w13, w2 in self._requantized(layer)]
        base = torch.stack([w2_slot_row(w13, w2) for w13, w2 in experts])
        if not self.settings.uses_fp4_tier:
            return base, None
        return base, torch.stack([fp4_slot_row(w13, w2) for w13, w2 in experts])

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # tierstore computes the experts itself; no vLLM modular kernel is involved

    # -- forward ---------------------------------------------------------------------------

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        """x [T, H], topk_ids [T, k] (global ids = local ids: no EP), topk_weights [T, k] -> [T, H]."""
        if self.tiered is not None:
            return self.tiered.moe(self.decoder_layer, x, topk_ids, topk_weights)
        if self.slots is None:
            raise RuntimeError(f"{self.prefix}: apply before process_weights_after_loading")
        return self.backend.run(x, topk_ids, topk_weights, self.slots.table, self.slots.slots,
                                getattr(layer, "swiglu_limit", None))


def _moe_runs_outside_graphs() -> bool:
    """True when MoE runs outside captured CUDA graphs: enforce_eager, or piecewise-only graphs
    with `vllm::moe_forward` among the splitting ops (full graphs would capture it)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    if config.model_config is not None and config.model_config.enforce_eager:
        return True
    compilation = config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is not None and mode.has_full_cudagraphs():
        return False
    return any("moe_forward" in op for op in compilation.splitting_ops or [])


def _current_model_path() -> str | None:
    from vllm.config import get_current_vllm_config

    model_config = get_current_vllm_config().model_config
    return None if model_config is None else model_config.model
