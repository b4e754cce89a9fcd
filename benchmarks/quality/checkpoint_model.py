"""Build a transformers model for an exported NVFP4 checkpoint that transformers itself cannot load.

transformers (5.24 checked) does not know `quant_method: modelopt` and then fails on the uint8
expert tensors; so the model is built from config.json without its quantization_config and its
dense bf16 tensors are loaded by name (`tierstore.runtime.hf_dense`, the loader `tierstore
generate` uses too), and the experts are served by SwitchableExperts from weights read through
tierstore.checkpoint (see variants.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.quality.switchable import PrecisionControl, SwitchableExperts, install
from tierstore.runtime.hf_dense import load_dense_model


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, PrecisionControl,
                                                                              list[SwitchableExperts]]:
    control = PrecisionControl()
    layers: list[SwitchableExperts] = []
    model = load_dense_model(path, dtype, device, prepare=lambda built: layers.extend(install(built, control)))
    return model, control, layers
