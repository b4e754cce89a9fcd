"""A transformers model for a checkpoint whose routed experts transformers cannot load.

A checkpoint with quantized experts (e.g. modelopt NVFP4: transformers 5.24 warns "Unknown
quantization type, got modelopt" and then fails on the packed uint8 expert shapes) still has
plain bf16 / fp16 / fp32 tensors everywhere else. So the model is built from config.json without
its `quantization_config`, every tensor outside the routed experts (names holding ".experts.";
shared experts are "shared_expert(s).") is loaded by name and checked against the model, and
the routed experts are left to whoever serves them: `load_dense_model` puts `ExpertsNotLoaded`
in their place (tierstore's `install_tiered_experts` replaces it), or the caller installs its own
experts modules first (`prepare`). Imports transformers lazily.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tierstore.checkpoint.files import TensorFiles
from tierstore.errors import CheckpointError

ROUTED_EXPERTS = ".experts."
DENSE_DTYPES = ("BF16", "F16", "F32")


class ExpertsNotLoaded(nn.Module):
    """Stands where a MoE block's routed experts were: calling it is an error, never a silent zero."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        raise CheckpointError(f"the routed experts of decoder layer {self.layer} were not loaded (the checkpoint "
                              "quantizes them); install tierstore's experts with install_tiered_experts first")

    def extra_repr(self) -> str:
        return f"decoder_layer={self.layer}"


def read_config(checkpoint: Path | str) -> dict:
    path = Path(checkpoint) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def declares_quantization(checkpoint: Path | str) -> bool:
    """Whether config.json carries a `quantization_config` (then transformers may not load it)."""
    return "quantization_config" in read_config(checkpoint)


def model_from_config(checkpoint: Path | str) -> nn.Module:
    """The checkpoint's causal LM built from config.json without `quantization_config` (random init)."""
    import transformers

    config = read_config(checkpoint)
    config.pop("quantization_config", None)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise CheckpointError(f"{Path(checkpoint) / 'config.json'} has no model_type")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"transformers cannot build a {model_type!r} model from {checkpoint}: {exc}") from None


def dense_state(checkpoint: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor outside the routed experts, as stored; each must be bf16 / fp16 / fp32."""
    files = TensorFiles(Path(checkpoint))
    try:
        names = [name for name in files.names() if ROUTED_EXPERTS not in name]
        quantized = [name for name in names if files.dtype(name) not in DENSE_DTYPES]
        if quantized:
            raise CheckpointError(f"{checkpoint}: only the routed experts may be quantized, but {quantized[0]!r} is "
                                  f"{files.dtype(quantized[0])} ({len(quantized)} such tensors outside the experts)")
        return {name: files.read(name) for name in names}
    finally:
        files.release()


def load_dense_weights(model: nn.Module, checkpoint: Path | str) -> None:
    """Load `dense_state` into `model` by name; every parameter outside the routed experts must be
    covered (a tied lm_head excepted) and every tensor must have a place."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    try:
        missing, unexpected = model.load_state_dict(dense_state(checkpoint), strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(f"{checkpoint}: dense tensors do not fit the model built from its config.json: "
                              f"{exc}") from None
    missing = [name for name in missing if ROUTED_EXPERTS not in name and not (tied and name == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint}: dense tensors do not fit the model built from its config.json: "
                              f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})")
    if tied:
        model.tie_weights()


def load_dense_model(checkpoint: Path | str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                     prepare: Callable[[nn.Module], object] | None = None) -> nn.Module:
    """The checkpoint's causal LM (eval mode) in `dtype` on `device` with its dense tensors loaded.

    `prepare(model)` runs before the weights are loaded and may install its own experts modules;
    without it every MoE block's experts become `ExpertsNotLoaded` (nothing of the random init is
    kept or moved to the device)."""
    from tierstore.runtime.hf import moe_blocks

    model = model_from_config(checkpoint)
    if prepare is not None:
        prepare(model)
    else:
        for index, block in moe_blocks(model):
            block.experts = ExpertsNotLoaded(index)
    load_dense_weights(model, checkpoint)
    return model.to(device=device, dtype=dtype).eval()
