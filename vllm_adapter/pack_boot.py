"""Booting a model's W2 experts from its pack (STORE_DIR) instead of requantizing them.

The first boot builds the pack (requantizing once, resumable, crash-safe); every later boot reads
its checksummed rows, which are already in the kernels' slot layout. With DELTA_GB the `fp4` pack
(the same experts' e2m1 nibbles and scales, in the kernels' FP4 slot layout) is built next to it. A pack holds whole experts,
so this path needs tensor parallelism 1.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tierstore.checkpoint import open_checkpoint
from tierstore.errors import ConfigError
from tierstore.kernels.layout import w2_slot_layout

_DECODER_LAYER = re.compile(r"layers\.(\d+)\.")


def decoder_layer(prefix: str) -> int:
    """The decoder-layer number in a vLLM module name such as 'model.layers.3.mlp.experts'."""
    match = _DECODER_LAYER.search(prefix)
    if match is None:
        raise ConfigError(f"cannot find the decoder-layer number in MoE layer name {prefix!r}")
    return int(match.group(1))


class PackBoot:
    """The base pack of the checkpoint at `model_path`, built under `store_dir` if missing."""

    def __init__(self, model_path: str | Path, store_dir: Path, zero_mode: str, direct: bool, fp4: bool = False):
        from tierstore.runtime.packs import ensure_base_pack, open_base_rows

        model_path = Path(model_path)
        if not (model_path / "config.json").is_file():
            raise ConfigError(f"STORE_DIR packs need a local checkpoint folder; vLLM's model {str(model_path)!r} "
                              "has no config.json (download it first and pass its path)")
        with open_checkpoint(model_path) as checkpoint:
            self.geometry = checkpoint.geometry
        tags = ("base", "fp4") if fp4 else ("base",)
        self.report = ensure_base_pack(model_path, store_dir, zero_mode=zero_mode, tags=tags)
        self.rows = open_base_rows(model_path, store_dir, zero_mode=zero_mode, direct=direct)
        self.fp4_rows = open_base_rows(model_path, store_dir, zero_mode=zero_mode, direct=direct, tag="fp4") \
            if fp4 else None  # the FP4 pool's rows (DELTA_GB)
        self.layout = w2_slot_layout(self.geometry.hidden, self.geometry.expert_inter)

    @property
    def requantized_layers(self) -> list[int]:
        """Layers this boot had to requantize for any of its packs (empty when they all existed)."""
        return sorted(set().union(*self.report.written.values()))

    def dense_layer(self, prefix: str) -> int:
        layer = decoder_layer(prefix)
        if layer not in self.geometry.moe_layers:
            raise ConfigError(f"{prefix!r}: decoder layer {layer} is not an MoE layer of the checkpoint "
                              f"(MoE layers: {self.geometry.moe_layers})")
        return self.geometry.moe_layers.index(layer)

    def slot_rows(self, dense_layer: int) -> torch.Tensor:
        """uint8 [E, slot_bytes]: the layer's experts as kernel slots (checksums verified)."""
        experts, stride = self.geometry.num_experts, self.rows.stride
        buffer = torch.zeros(experts, stride, dtype=torch.uint8)
        views = [memoryview(buffer[e].numpy()) for e in range(experts)]
        self.rows.read_rows([(dense_layer, e) for e in range(experts)], views)
        slots = torch.zeros(experts, self.layout.slot_bytes, dtype=torch.uint8)
        slots[:, :self.rows.row_bytes] = buffer[:, :self.rows.row_bytes]
        return slots

    def close(self) -> None:
        self.rows.close()
        if self.fp4_rows is not None:
            self.fp4_rows.close()


_boots: dict[tuple[str, str, str, bool], PackBoot] = {}


def pack_boot(model_path: str | Path, store_dir: Path, zero_mode: str, direct: bool, fp4: bool = False) -> PackBoot:
    """One PackBoot per (checkpoint, store, zero mode, with the FP4 pack) in the process, shared by
    its layers."""
    if model_path is None:
        raise ConfigError("STORE_DIR needs vLLM's model path (no model config is set)")
    key = (str(Path(model_path).resolve()), str(store_dir.resolve()), zero_mode, fp4)
    if key not in _boots:
        _boots[key] = PackBoot(model_path, store_dir, zero_mode, direct, fp4)
    return _boots[key]


def forget_pack_boots() -> None:
    """Close and drop every PackBoot of the process (tests build several models in one process)."""
    for boot in _boots.values():
        boot.close()
    _boots.clear()
