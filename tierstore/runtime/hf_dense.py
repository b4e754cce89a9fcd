"""The transformers model of a MoE checkpoint with only its dense tensors: the routed experts are
never read and never allocated.

Every checkpoint goes through here (`tierstore.runtime.hf.load_model`), with or without a
`quantization_config` (e.g. modelopt NVFP4 experts, which transformers 5.24 cannot load: it warns
"Unknown quantization type, got modelopt" and fails on the packed uint8 expert shapes):

1. the model is built from config.json (its `quantization_config` dropped) on the meta device,
   so no parameter has storage; the dtype each parameter gets is the one transformers'
   `from_pretrained(dtype=...)` would give it (including `_keep_in_fp32_modules(_strict)`);
2. every MoE block's routed experts module is replaced, while still on meta, by
   `ExpertsNotLoaded` (or by the caller's own modules: `prepare`);
3. the checkpoint's tensors outside the routed experts (names without ".experts."; shared experts
   are "shared_expert(s)." and load like attention, norms, embeddings and routers) are checked
   against the model from the safetensors headers alone (dtype bf16 / fp16 / fp32, shape, none
   missing, none left over), then read one at a time, cast and placed on the target device; the
   shards are unmapped every `RELEASE_BYTES`, so host memory is the dense model (when the device
   is the CPU) plus about one tensor;
4. non-persistent buffers (rotary inv_freq) are computed by the model class's own initialiser,
   as `from_pretrained` does; a tied lm_head is tied to the embedding.

Imports transformers lazily.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tierstore.checkpoint.files import TensorFiles
from tierstore.errors import CheckpointError

ROUTED_EXPERTS = ".experts."
DENSE_DTYPES = ("BF16", "F16", "F32")
RELEASE_BYTES = 256 * 1024 * 1024  # unmap the shards after reading this many bytes
# checkpoint name -> model name, per model_type (transformers 5 renames these on load too)
RENAMES = {"mixtral": ((".block_sparse_moe.", ".mlp."),)}
ALWAYS_IGNORED = (r"rotary_emb\.inv_freq$",)  # old checkpoints stored it; it is recomputed


class ExpertsNotLoaded(nn.Module):
    """Stands where a MoE block's routed experts were: calling it is an error, never a silent zero."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        raise CheckpointError(f"the routed experts of decoder layer {self.layer} were not loaded (tierstore serves "
                              "them from its packs); install tierstore's experts with install_tiered_experts first")

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


def model_skeleton(checkpoint: Path | str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The checkpoint's causal LM built from config.json without `quantization_config`, on the meta
    device (no storage), its parameters in the dtypes `from_pretrained(dtype=dtype)` would give."""
    import transformers

    config = read_config(checkpoint)
    config.pop("quantization_config", None)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise CheckpointError(f"{Path(checkpoint) / 'config.json'} has no model_type")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
        hf_config._name_or_path = str(checkpoint)
        with _meta_context():
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"transformers cannot build a {model_type!r} model from {checkpoint}: {exc}") from None
    return model


def _meta_context():
    from contextlib import ExitStack

    stack = ExitStack()
    stack.enter_context(torch.device("meta"))
    try:  # transformers' own meta build keeps creation ops that __init__ reads back (.item()) on the CPU
        from transformers import initialization

        stack.enter_context(initialization.meta_device_safe_creation_ops())
    except (ImportError, AttributeError):
        pass
    return stack


def _fp32_pattern(model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """transformers' keep-in-fp32 rule (`_get_dtype_plan`): names it matches load as float32."""
    globs = []
    if getattr(model, "_keep_in_fp32_modules", None) and dtype == torch.float16:
        globs += list(model._keep_in_fp32_modules)
    if getattr(model, "_keep_in_fp32_modules_strict", None) and dtype in (torch.float16, torch.bfloat16):
        globs += list(model._keep_in_fp32_modules_strict)
    return re.compile("|".join(g.replace("*", ".*") for g in globs)) if globs else None


def _ignored_pattern(model: nn.Module) -> re.Pattern:
    patterns = list(ALWAYS_IGNORED) + list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def _is_tied(model: nn.Module) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(config, "tie_word_embeddings", False))


def _wanted(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> meta tensor of every parameter and persistent buffer still to load (a tied lm_head
    and whatever `prepare` installed with storage excluded)."""
    wanted = {name: t for name, t in model.state_dict(keep_vars=True).items() if t.is_meta}
    if _is_tied(model):
        wanted.pop("lm_head.weight", None)
    return wanted


def plan_dense_load(model: nn.Module, files: TensorFiles, where: str) -> list[tuple[str, str]]:
    """[(checkpoint name, model name)] of every tensor to load, checked from the headers alone:
    dense dtype, shape, nothing missing, nothing unexpected."""
    renames = RENAMES.get(getattr(model.config, "model_type", ""), ())
    ignored = _ignored_pattern(model)
    wanted = _wanted(model)
    tied_head = _is_tied(model)
    plan, unexpected, quantized = [], [], []
    for name in files.names():
        if ROUTED_EXPERTS in name or ignored.search(name):
            continue
        target = name
        for old, new in renames:
            if target not in wanted and old in target:
                target = target.replace(old, new)
        if tied_head and target == "lm_head.weight":
            continue  # tied to the embedding, as transformers does
        if target not in wanted:
            unexpected.append(name)
            continue
        if files.dtype(name) not in DENSE_DTYPES:
            quantized.append(name)
            continue
        if tuple(files.shape(name)) != tuple(wanted[target].shape):
            raise CheckpointError(f"{where}: dense tensors do not fit the model built from its config.json: {name!r} "
                                  f"has shape {list(files.shape(name))}, the model's {target!r} "
                                  f"{list(wanted[target].shape)}")
        plan.append((name, target))
    if quantized:
        raise CheckpointError(f"{where}: only the routed experts may be quantized, but {quantized[0]!r} is "
                              f"{files.dtype(quantized[0])} ({len(quantized)} such tensors outside the experts)")
    loaded = {target for _, target in plan}
    missing = [name for name in wanted if name not in loaded]
    duplicated = len(plan) - len(loaded)
    if missing or unexpected or duplicated:
        raise CheckpointError(f"{where}: dense tensors do not fit the model built from its config.json: "
                              f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
                              + (f", {duplicated} model tensors named twice" if duplicated else ""))
    return plan


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        owner._buffers[leaf] = value


def load_dense_weights(model: nn.Module, checkpoint: Path | str, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> None:
    """Load the dense tensors of `checkpoint` into the meta-built `model`, one at a time, in the
    dtype transformers would use, directly on `device`; then its non-persistent buffers and ties."""
    device = torch.device(device)
    files = TensorFiles(Path(checkpoint))
    fp32 = _fp32_pattern(model, dtype)
    try:
        plan = plan_dense_load(model, files, str(checkpoint))
        wanted = _wanted(model)
        read = 0
        for name, target in sorted(plan, key=lambda pair: (str(files.file_of(pair[0])), pair[0])):
            want = torch.float32 if fp32 is not None and fp32.search(target) else wanted[target].dtype
            stored = files.read(name)
            value = stored.to(dtype=want, copy=True)  # never a view of the mapped shard
            del stored
            _set_tensor(model, target, value.to(device))
            read += value.numel() * value.element_size()
            del value
            if read >= RELEASE_BYTES:
                files.release()
                read = 0
    finally:
        files.release()
    _init_non_persistent_buffers(model, device)
    if _is_tied(model):
        model.tie_weights()
    left = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{checkpoint}: {len(left)} model tensors were left without values, e.g. {left[:5]}")


def _init_non_persistent_buffers(model: nn.Module, device: torch.device) -> None:
    """Compute the buffers a checkpoint does not store (rotary inv_freq) with the model class's own
    initialiser, on the CPU then moved, as `from_pretrained` does; refuse any it leaves unset."""
    owners = []
    for module_name, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
                 and module._buffers[n].is_meta]
        for leaf in names:
            buffer = module._buffers[leaf]
            if not buffer.is_floating_point():
                raise CheckpointError(f"cannot compute the non-persistent buffer {module_name}.{leaf} ({buffer.dtype})")
            module._buffers[leaf] = torch.full(buffer.shape, float("nan"), dtype=buffer.dtype)
        if names:
            owners.append((module_name, module, names))
    with torch.no_grad():
        for module_name, module, names in owners:
            model._init_weights(module)
            for leaf in names:
                value = module._buffers[leaf]
                if bool(value.isnan().any()):
                    raise CheckpointError(f"transformers' initialiser left the buffer {module_name}.{leaf} unset")
                module._buffers[leaf] = value.to(device)


def load_dense_model(checkpoint: Path | str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                     prepare: Callable[[nn.Module], object] | None = None) -> nn.Module:
    """The checkpoint's causal LM (eval mode) in `dtype` on `device` with its dense tensors loaded.

    `prepare(model)` runs on the meta-built model before any weight is loaded and may install its
    own experts modules; without it every MoE block's experts become `ExpertsNotLoaded`. Nothing
    of the routed experts is read or allocated either way."""
    from tierstore.runtime.hf import moe_blocks

    model = model_skeleton(checkpoint, dtype)
    if prepare is not None:
        prepare(model)
    else:
        for index, block in moe_blocks(model):
            block.experts = ExpertsNotLoaded(index)
    load_dense_weights(model, checkpoint, dtype, device)
    _load_generation_config(model, checkpoint)
    return model.to(device).eval()


def _load_generation_config(model: nn.Module, checkpoint: Path | str) -> None:
    if not (Path(checkpoint) / "generation_config.json").exists():
        return
    import transformers

    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(checkpoint))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}: unreadable generation_config.json: {exc}") from None
