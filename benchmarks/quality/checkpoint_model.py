"""Build a transformers model for an exported NVFP4 checkpoint that transformers itself cannot load.

transformers (5.24 checked) does not know `quant_method: modelopt` and then fails on the uint8
expert tensors; so the model is built from config.json without its quantization_config, the
dense bf16 tensors are loaded by name, and the experts are served by SwitchableExperts from
weights read through tierstore.checkpoint (see variants.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.quality.switchable import PrecisionControl, SwitchableExperts, install


def dense_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint outside the routed experts."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    state = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as handle:
            for key in handle.keys():
                if ".mlp.experts." not in key:
                    state[key] = handle.get_tensor(key)
    return state


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, PrecisionControl,
                                                                              list[SwitchableExperts]]:
    import transformers

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    model_type = config.pop("model_type")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **config))
    control = PrecisionControl()
    layers = install(model, control)
    missing, unexpected = model.load_state_dict(dense_state(path), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"{path}: dense tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device=device, dtype=dtype).eval(), control, layers
