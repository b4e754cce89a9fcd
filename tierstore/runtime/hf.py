"""transformers integration: swap the routed experts of Mixtral, Qwen2/3-MoE, OLMoE and
DeepSeek-V2/V3 models for tierstore's tiered layer.

transformers' MoE blocks call `self.experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`
after their own router; only that `experts` module is replaced, so attention, norms, routing
(softmax / sigmoid, group-limited, correction bias, scaling) and shared experts stay the
original code. Imports transformers lazily (at call time), never at `import tierstore`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tierstore.errors import CheckpointError

BYTE_VOCAB = 256


class TieredExperts(nn.Module):
    """Drop-in for a transformers `...Experts` module, served by a TieredRuntime."""

    def __init__(self, runtime, layer: int):
        super().__init__()
        self.runtime = runtime
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.moe(self.layer, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"moe_layer={self.layer}"


def moe_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder-layer index, MoE block) of every decoder layer whose MLP has routed experts."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise CheckpointError(f"{type(model).__name__} has no .model.layers; not a supported decoder model")
    blocks = []
    for index, layer in enumerate(layers):
        block = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
        if block is not None and hasattr(block, "experts") and hasattr(block, "gate"):
            blocks.append((index, block))
    return blocks


def install_tiered_experts(model: nn.Module, runtime) -> int:
    """Replace every MoE block's experts with a TieredExperts of `runtime`; returns how many."""
    blocks = moe_blocks(model)
    found = tuple(index for index, _ in blocks)
    if found != tuple(runtime.geometry.moe_layers):
        raise CheckpointError(f"model has MoE blocks at decoder layers {found}, the runtime's geometry expects "
                              f"{tuple(runtime.geometry.moe_layers)}")
    for dense, (_, block) in enumerate(blocks):
        block.experts = TieredExperts(runtime, dense)
    return len(blocks)


def load_model(checkpoint: Path | str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
    """The checkpoint's transformers causal LM (eval mode) in `dtype` on `device`, without its routed
    experts.

    Every checkpoint, with or without a `quantization_config`, is built on the meta device and only
    its dense tensors (attention, norms, embeddings, routers, shared experts) are read, one at a
    time, onto `device` (`hf_dense`); the routed experts are never read or allocated and stand as
    `ExpertsNotLoaded` until `install_tiered_experts` replaces them. Quantized tensors outside the
    experts (e.g. FP8 attention) fail here."""
    from tierstore.runtime.hf_dense import load_dense_model

    return load_dense_model(checkpoint, dtype, device)


def load_full_model(checkpoint: Path | str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
    """The checkpoint loaded by transformers' `from_pretrained`, routed experts included (memory:
    the whole model). A reference for tests and comparisons; `load_model` is the runtime's loader."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"transformers cannot load {checkpoint}: {exc}") from None
    return model.to(device).eval()


class ByteTokenizer:
    """Fallback for checkpoints without tokenizer files: UTF-8 bytes are token ids (vocab >= 256)."""

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_VOCAB:
            raise CheckpointError(f"the checkpoint has no tokenizer and a vocabulary of {vocab_size} < 256 "
                                  "tokens, so text cannot be mapped to bytes; pass token ids instead")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")


def load_tokenizer(checkpoint: Path | str, vocab_size: int):
    """The checkpoint's own tokenizer when it ships one, else a ByteTokenizer."""
    path = Path(checkpoint)
    if any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(str(path))
    return ByteTokenizer(vocab_size)
