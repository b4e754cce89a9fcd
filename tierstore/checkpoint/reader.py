"""open_checkpoint(): geometry, format and layer-by-layer expert access of an HF safetensors MoE checkpoint.

Layers are addressed by their dense MoE index 0..L-1 (the index tiers use); `MoELayer.decoder_layer`
and `geometry.moe_layers` give the decoder-layer index.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tierstore.checkpoint.config import declared_format, geometry_from_config, load_json
from tierstore.checkpoint.files import TensorFiles
from tierstore.checkpoint.layout import ExpertWeights, LayerLayout, SharedExperts
from tierstore.errors import CheckpointError
from tierstore.geometry import MoEGeometry

CONFIG_FILE = "config.json"
MODELOPT_CONFIG_FILE = "hf_quant_config.json"


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's routed experts (in expert order) and the names of its router tensors."""

    index: int
    decoder_layer: int
    experts: tuple[ExpertWeights, ...]
    shared: SharedExperts | None
    router_name: str
    router_bias_name: str | None


class Checkpoint:
    """A checkpoint directory opened for reading. Use as a context manager or call close()."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint {self.path} is not a directory")
        self.config = load_json(self.path / CONFIG_FILE)
        modelopt_path = self.path / MODELOPT_CONFIG_FILE
        self._modelopt_path = modelopt_path if modelopt_path.exists() else None
        modelopt = load_json(modelopt_path) if self._modelopt_path else None
        self.model_type: str = self.config.get("model_type")
        self.geometry: MoEGeometry = geometry_from_config(self.config, self.path.name)
        declared, self.fp8_block = declared_format(self.config, modelopt, str(self.path))
        self.files = TensorFiles(self.path)
        first = self._layout(0).experts()[0].w13
        if declared is not None and first.format != declared:
            raise CheckpointError(f"{self.path}: quantization_config declares {declared} but "
                                  f"{first.tensor_names[0]} is stored as {first.format}")
        self.source_format: str = first.format
        self.files.release()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.files.release()

    def __repr__(self) -> str:
        g = self.geometry
        return (f"Checkpoint({str(self.path)!r}, {self.model_type}, {self.source_format}, "
                f"{g.num_moe_layers} MoE layers x {g.num_experts} experts)")

    def identity_files(self) -> list[Path]:
        """Files whose name/size/mtime identify this checkpoint: config, quant config, index, shards."""
        extra = [p for p in (self._modelopt_path, self.files.index_path) if p is not None]
        return [self.path / CONFIG_FILE, *extra, *self.files.shards]

    def _layout(self, layer: int) -> LayerLayout:
        layers = self.geometry.moe_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
            raise CheckpointError(f"{self.path}: MoE layer {layer!r} out of range 0..{len(layers) - 1}")
        return LayerLayout(self.files, self.model_type, layers[layer], self.geometry, self.fp8_block)

    def _experts(self, layout: LayerLayout) -> tuple[ExpertWeights, ...]:
        experts = layout.experts()
        for weights in experts:
            for matrix in (weights.w13, weights.w2):
                if matrix.format != self.source_format:
                    raise CheckpointError(f"{matrix.tensor_names[0]} is stored as {matrix.format} but the "
                                          f"checkpoint's experts are {self.source_format}")
        return experts

    def layer(self, layer: int) -> MoELayer:
        """MoE layer `layer` (dense index); its matrices read lazily."""
        layout = self._layout(layer)
        return MoELayer(layer, self.geometry.moe_layers[layer], self._experts(layout), layout.shared(),
                        layout.router_name, layout.router_bias_name)

    def layer_experts(self, layer: int) -> dict[int, ExpertWeights]:
        return {w.expert: w for w in self.layer(layer).experts}

    def iter_layers(self, progress: bool = False) -> Iterator[MoELayer]:
        """Every MoE layer in order; files touched for one layer are unmapped before the next."""
        for index in tqdm(range(self.geometry.num_moe_layers), desc="MoE layers", unit="layer",
                          disable=not progress):
            yield self.layer(index)
            self.files.release()

    def router_weight(self, layer: int) -> torch.Tensor:
        """Router weight [E, H] as stored."""
        return self.files.read(self._layout(layer).router_name)

    def router_bias(self, layer: int) -> torch.Tensor | None:
        """DeepSeek-V3's e_score_correction_bias [E] (added for expert selection only), or None."""
        name = self._layout(layer).router_bias_name
        return None if name is None else self.files.read(name)

    def shared_experts(self, layer: int) -> SharedExperts | None:
        return self._layout(layer).shared()

    def read_tensor(self, name: str) -> torch.Tensor:
        """Any tensor of the checkpoint by its full name, as stored."""
        return self.files.read(name)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF safetensors MoE checkpoint directory (config.json + model.safetensors or shards)."""
    return Checkpoint(path)
