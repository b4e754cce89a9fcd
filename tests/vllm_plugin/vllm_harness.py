"""Builds vLLM's own MoE layer on CPU with tierstore's method and loads checkpoint tensors into it
through vLLM's own weight loader. Imported only by `vllm`-marked tests (it imports vLLM)."""

from __future__ import annotations

import dataclasses
import socket
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.fused_moe import layer as fused_moe_layer
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

from tierstore.vllm_adapter.compat import moe_factory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_initialised = False


def model_config(path, quantization="tierstore", enforce_eager=False):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), skip_tokenizer_init=True, quantization=quantization,
                      enforce_eager=enforce_eager).create_model_config()


@contextmanager
def cpu_vllm(model=None, enforce_eager=False, tiered_worker=False, **config):
    """A CPU VllmConfig set as current (with the model config of checkpoint folder `model`, if
    given; with `--worker-cls` tierstore's worker if `tiered_worker`) and a one-rank gloo group
    (set up once per process)."""
    global _initialised
    if model is not None:
        config["model_config"] = model_config(model, enforce_eager=enforce_eager)
    if tiered_worker:
        from vllm.config import ParallelConfig

        from tierstore.vllm_adapter.worker_check import WORKER_QUALNAME

        config["parallel_config"] = ParallelConfig(worker_cls=WORKER_QUALNAME)
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"), **config)
    with set_current_vllm_config(vllm_config):
        if not _initialised:
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo")
            initialize_model_parallel(1, 1)
            _initialised = True
        yield vllm_config


def softmax_topk(hidden_states, gating_output, topk, renormalize):
    """Pure-torch router (vLLM's default router is a CUDA op)."""
    probs = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = probs.topk(topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


@contextmanager
def tensor_parallel_rank(tp_size: int, tp_rank: int):
    """Make vLLM's MoE factory build the layer of one TP rank without a multi-process group."""
    original = fused_moe_layer.make_parallel_config

    def one_rank(*args, **kwargs):
        return dataclasses.replace(FusedMoEParallelConfig.make_no_parallel(), tp_size=tp_size, tp_rank=tp_rank)

    fused_moe_layer.make_parallel_config = one_rank
    try:
        yield
    finally:
        fused_moe_layer.make_parallel_config = original


def build_moe(quant_config, *, num_experts: int, top_k: int, hidden: int, inter: int, prefix: str,
              swiglu_limit: float | None = None, params_dtype=torch.bfloat16):
    """vLLM's MoE runner (FusedMoE / FusedMoEFactory) with `quant_config`; returns the runner."""
    return moe_factory()(num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                         params_dtype=params_dtype, renormalize=True, quant_config=quant_config, prefix=prefix,
                         custom_routing_function=softmax_topk, swiglu_limit=swiglu_limit)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def load_layer(routed_experts, tensors: dict[str, torch.Tensor], block_prefix: str, num_experts: int,
               keyword_style: bool = False) -> int:
    """Feed every expert tensor under `block_prefix` (e.g. 'model.layers.0.mlp') to the layer's
    parameters through vLLM's expert-name mapping and each parameter's weight_loader."""
    mapping = fused_moe_layer.fused_moe_make_expert_params_mapping(
        torch.nn.Module(), "gate_proj", "down_proj", "up_proj", num_experts)
    loaded = 0
    for name, tensor in tensors.items():
        if not name.startswith(f"{block_prefix}.experts."):
            continue
        for param_prefix, weight_prefix, expert_id, shard_id in mapping:
            if weight_prefix not in name:
                continue
            suffix = name.split(weight_prefix, 1)[1]
            param_name = param_prefix.rsplit(".", 1)[-1] + suffix  # e.g. w13_weight_scale
            param = getattr(routed_experts, param_name)
            mapped_name = name.replace(weight_prefix, param_prefix)
            if keyword_style:  # the 0.33 RoutedExperts.load_weights call style
                ok = param.weight_loader(param=param, loaded_weight=tensor, weight_name=mapped_name,
                                         shard_id=shard_id, expert_id=expert_id, return_success=True)
                assert ok, f"vLLM's loader refused {name}"
            else:  # the 0.24 model call style
                param.weight_loader(param, tensor, mapped_name, shard_id=shard_id, expert_id=expert_id)
            loaded += 1
            break
        else:
            raise AssertionError(f"no expert mapping entry matches {name}")
    return loaded
