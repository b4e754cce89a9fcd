"""Booting a model's W2 experts from its pack (STORE_DIR) instead of requantizing them.

The first boot builds the pack (requantizing once, resumable, crash-safe); every later boot reads
its checksummed rows, which are already in the kernels' slot layout. With DELTA_GB the `fp4` pack
(the same experts' e2m1 nibbles and scales, in the kernels' FP4 slot layout) is built next to it.

Under tensor parallelism each rank boots from its own pack (rank r of W: every expert's 1/W share
of the intermediate dimension, split as vLLM splits it), built by that rank on its first boot or
beforehand with `tierstore pack CHECKPOINT --out STORE_DIR --tp-size W`. The rank geometry is part
of the pack's identity, and every layer checks that its boot serves its own rank.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from tierstore.checkpoint import open_checkpoint
from tierstore.errors import ConfigError, PackFormatError
from tierstore.io.pack_build import RankShard
from tierstore.kernels.layout import w2_slot_layout
from tierstore.runtime.rank_packs import check_pack_rank, pack_command, rank_label

_DECODER_LAYER = re.compile(r"layers\.(\d+)\.")


def decoder_layer(prefix: str) -> int:
    """The decoder-layer number in a vLLM module name such as 'model.layers.3.mlp.experts'."""
    match = _DECODER_LAYER.search(prefix)
    if match is None:
        raise ConfigError(f"cannot find the decoder-layer number in MoE layer name {prefix!r}")
    return int(match.group(1))


class PackBoot:
    """The base pack of tensor-parallel rank `rank` of `world` of the checkpoint at `model_path`,
    built under `store_dir` if missing. `geometry` is the rank's: expert_inter is its share."""

    def __init__(self, model_path: str | Path, store_dir: Path, zero_mode: str, direct: bool, fp4: bool = False,
                 rank: int = 0, world: int = 1):
        from tierstore.runtime.packs import ensure_base_pack, open_base_rows

        model_path = Path(model_path)
        if not (model_path / "config.json").is_file():
            raise ConfigError(f"STORE_DIR packs need a local checkpoint folder; vLLM's model {str(model_path)!r} "
                              "has no config.json (download it first and pass its path)")
        with open_checkpoint(model_path) as checkpoint:
            full = checkpoint.geometry
        self.geometry = dataclasses.replace(full, expert_inter=RankShard(full.expert_inter, rank, world).size)
        self.model_path, self.store_dir, self.zero_mode, self.rank, self.world = \
            model_path, store_dir, zero_mode, rank, world
        tags = ("base", "fp4") if fp4 else ("base",)
        self.report = ensure_base_pack(model_path, store_dir, zero_mode=zero_mode, tags=tags, rank=rank, world=world)
        self.rows = open_base_rows(model_path, store_dir, zero_mode=zero_mode, direct=direct, rank=rank, world=world)
        self.fp4_rows = open_base_rows(model_path, store_dir, zero_mode=zero_mode, direct=direct, tag="fp4",
                                       rank=rank, world=world) if fp4 else None  # the FP4 pool's rows (DELTA_GB)
        self.layout = w2_slot_layout(self.geometry.hidden, self.geometry.expert_inter)

    def check_layer(self, prefix: str, num_experts: int, inter: int, rank: int, world: int) -> None:
        """Refuse to serve this boot's rows to a layer of another TP rank geometry or shape (the
        error names the `tierstore pack` command that builds the layer's pack)."""
        for rows in (self.rows, self.fp4_rows):
            if rows is None:
                continue
            try:
                check_pack_rank(rows.pack.spec, rank, world, self.model_path, self.store_dir, self.zero_mode)
            except PackFormatError as exc:
                raise ConfigError(f"{prefix}: {exc}") from None
        if (self.geometry.num_experts, self.geometry.expert_inter) != (num_experts, inter):
            command = pack_command(self.model_path, self.store_dir, "base", self.zero_mode, rank, world)
            raise ConfigError(f"{prefix}: the pack of {rank_label(self.rank, self.world)} holds "
                              f"{self.geometry.num_experts} experts of intermediate size {self.geometry.expert_inter}, "
                              f"the layer has {num_experts} of {inter} (a pack for it: {command})")

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


_boots: dict[tuple[str, str, str, bool, int, int], PackBoot] = {}


def pack_boot(model_path: str | Path, store_dir: Path, zero_mode: str, direct: bool, fp4: bool = False,
              rank: int = 0, world: int = 1) -> PackBoot:
    """One PackBoot per (checkpoint, store, zero mode, with the FP4 pack, TP rank and world) in the
    process, shared by its layers."""
    if model_path is None:
        raise ConfigError("STORE_DIR needs vLLM's model path (no model config is set)")
    key = (str(Path(model_path).resolve()), str(store_dir.resolve()), zero_mode, fp4, rank, world)
    if key not in _boots:
        _boots[key] = PackBoot(model_path, store_dir, zero_mode, direct, fp4, rank, world)
    return _boots[key]


def forget_pack_boots() -> None:
    """Close and drop every PackBoot of the process (tests build several models in one process)."""
    for boot in _boots.values():
        boot.close()
    _boots.clear()
