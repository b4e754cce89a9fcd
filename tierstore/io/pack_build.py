"""Building packs from a checkpoint: stream it layer by layer, requantize each expert once, write
its rows to every requested tier's pack. Resumable: layers already committed are skipped.

`build_packs` builds one tensor-parallel rank's packs (requantizing only that rank's share);
`build_rank_packs` builds every rank's packs of a world in one pass over the checkpoint."""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.matrices import SourceMatrix
from tierstore.errors import TierstoreError
from tierstore.formats import W2Tensor, quantize_w2, w2_from_mxfp4
from tierstore.formats.w2 import resolve_zero_mode
from tierstore.io.identity import checkpoint_identity
from tierstore.io.layout import PackSpec
from tierstore.io.pack_writer import PackWriter
from tierstore.io.row_codec import DEFAULT_ROW_CODEC, TAGS, RowCodec, row_bytes

VERBATIM_ZERO_MODE = "verbatim"  # MXFP4 sources keep their nibbles: no zero signs are chosen
SCALE_BLOCK = 32  # weights per scale byte along K


@dataclass(frozen=True)
class RankShard:
    """Tensor-parallel rank `rank` of `world`'s share of every expert, split as vLLM splits it: the
    intermediate dimension I in `world` equal contiguous shards of `size` = I / world. w13 [2I, H]
    keeps gate rows [r*size, (r+1)*size) and up rows [I + r*size, I + (r+1)*size); w2 [H, I] keeps
    columns [r*size, (r+1)*size). A shard is a whole number of 32-wide scale blocks, so per-row and
    per-block scales make the shard's requantization the slice of the full matrix's."""

    inter: int
    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise TierstoreError(f"tensor-parallel rank {self.rank} of {self.world} is not a rank of that world")
        if self.inter % self.world or (self.inter // self.world) % SCALE_BLOCK:
            raise TierstoreError(
                f"tensor parallelism {self.world} cannot split expert_inter {self.inter}: each rank's share "
                f"({self.inter} / {self.world}) must be a whole multiple of the {SCALE_BLOCK}-wide scale block")

    @property
    def size(self) -> int:
        return self.inter // self.world

    def w13_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's gate and up rows of a [2I, ...] tensor (the tensor itself for a world of 1)."""
        if self.world == 1:
            return tensor
        start = self.rank * self.size
        gate, up = tensor[start:start + self.size], tensor[self.inter + start:self.inter + start + self.size]
        return torch.cat((gate, up))

    def w2_columns(self, tensor: torch.Tensor, per_column: int = 1) -> torch.Tensor:
        """This rank's columns of a [H, I / per_column] tensor (per_column = 32 for scale bytes)."""
        width = self.size // per_column
        return tensor[:, self.rank * width:(self.rank + 1) * width]

    def w13(self, tensor: W2Tensor) -> W2Tensor:
        return W2Tensor(self.w13_rows(tensor.nibbles()), self.w13_rows(tensor.scale_bytes()), tensor.zero_mode)

    def w2(self, tensor: W2Tensor) -> W2Tensor:
        return W2Tensor(self.w2_columns(tensor.nibbles()), self.w2_columns(tensor.scale_bytes(), SCALE_BLOCK),
                        tensor.zero_mode)


@dataclass
class BuildReport:
    packs: dict[str, Path] = field(default_factory=dict)
    written: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, list[int]] = field(default_factory=dict)
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0


def pack_specs(checkpoint, tags: tuple[str, ...], zero_mode: str, checkpoint_id: str | None = None,
               codec: RowCodec = DEFAULT_ROW_CODEC, rank: int = 0, world: int = 1) -> dict[str, PackSpec]:
    """The spec of each tier's pack for an open checkpoint (what a reader at boot also computes);
    `codec` decides the row layout and its ABI tag. A tensor-parallel rank's pack (`rank` of
    `world`) holds rows of expert_inter I / world (see RankShard)."""
    shard = RankShard(checkpoint.geometry.expert_inter, rank, world)
    geometry = dataclasses.replace(checkpoint.geometry, expert_inter=shard.size)
    identity = checkpoint_identity(checkpoint.identity_files(), checkpoint_id)
    mode = VERBATIM_ZERO_MODE if checkpoint.source_format == "mxfp4" else zero_mode
    specs = {}
    for tag in tags:
        segments = codec.segments(tag, geometry)
        specs[tag] = PackSpec(tag=tag, num_layers=geometry.num_moe_layers, num_experts=geometry.num_experts,
                              row_bytes=row_bytes(segments), checkpoint_id=identity, abi_tag=codec.abi_tag,
                              zero_mode=mode, rank=rank, world=world, segments=segments)
    return specs


def requantize(matrix: SourceMatrix, source_format: str, zero_mode: str, device: str,
               cut_weight: Callable[[torch.Tensor], torch.Tensor], cut_w2: Callable[[W2Tensor], W2Tensor]) -> W2Tensor:
    """One rank's share of `matrix`: `cut_weight` cuts it as a float matrix, `cut_w2` as a W2Tensor
    (MXFP4 nibbles are kept verbatim, then cut). Zero mode `auto` is decided on the full matrix and
    applied to the share; `alt` signs follow the parity of k, which a share starting at a multiple
    of 32 keeps. So the share's codes, nibbles and scales are exactly the slice of the full
    matrix's requantization."""
    if source_format == "mxfp4":
        return cut_w2(w2_from_mxfp4(*matrix.mxfp4_parts()))
    weight = matrix.dequantize().to(device)
    return quantize_w2(cut_weight(weight), zero_mode=resolve_zero_mode(weight, zero_mode))


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise TierstoreError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise TierstoreError("--device cuda was asked for but no CUDA device is available")
    return device


def warm_up(device: str) -> None:
    """Compile or load the CPU requantization kernels (numba) before the first expert, so the
    progress bar starts when rows do."""
    if device == "cpu":
        from tierstore.formats._cpu_kernels import warm_up as warm_cpu_kernels

        warm_cpu_kernels()


def check_tags(tags: tuple[str, ...]) -> None:
    for tag in tags:
        if tag not in TAGS:
            raise TierstoreError(f"unknown tier {tag!r}; choose from {', '.join(TAGS)}")


def build_packs(checkpoint_path: Path | str, out_dir: Path | str, tags: tuple[str, ...] = ("base",),
                device: str | None = None, zero_mode: str = "auto", checkpoint_id: str | None = None,
                progress: bool = True, codec: RowCodec = DEFAULT_ROW_CODEC, rank: int = 0,
                world: int = 1) -> BuildReport:
    """Build (or complete) the packs of `tags` for tensor-parallel rank `rank` of `world` (the
    default, rank 0 of 1, is the single-GPU pack)."""
    check_tags(tags)
    device = resolve_device(device)
    started = time.perf_counter()
    warm_up(device)
    report = BuildReport()
    with open_checkpoint(checkpoint_path) as checkpoint:
        specs = pack_specs(checkpoint, tags, zero_mode, checkpoint_id, codec, rank=rank, world=world)
        shard = RankShard(checkpoint.geometry.expert_inter, rank, world)
        writers = {tag: PackWriter(out_dir, spec) for tag, spec in specs.items()}
        try:
            done = {tag: writer.written_layers() for tag, writer in writers.items()}
            num_layers = checkpoint.geometry.num_moe_layers
            for tag in tags:
                report.packs[tag] = writers[tag].paths.pack
                report.skipped[tag] = sorted(done[tag])
                report.written[tag] = []
            todo = [layer for layer in range(num_layers) if any(layer not in done[t] for t in tags)]
            total = sum(specs[t].num_experts * specs[t].row_bytes for layer in todo for t in tags if layer not in done[t])
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="pack",
                      disable=not progress) as bar:
                for layer in todo:
                    missing = [t for t in tags if layer not in done[t]]
                    pending = {tag: writers[tag].begin_layer(layer) for tag in missing}
                    for expert in checkpoint.layer(layer).experts:
                        w13 = requantize(expert.w13, checkpoint.source_format, zero_mode, device, shard.w13_rows,
                                         shard.w13)
                        w2 = requantize(expert.w2, checkpoint.source_format, zero_mode, device, shard.w2_columns,
                                        shard.w2)
                        for tag in missing:
                            row = codec.encode(tag, specs[tag].segments, w13, w2)
                            pending[tag].write_row(expert.expert, row.numpy())
                            bar.update(row.numel())
                            report.bytes_written += row.numel()
                    for tag in missing:
                        pending[tag].commit()
                        report.written[tag].append(layer)
                    checkpoint.files.release()
        finally:
            for writer in writers.values():
                writer.close()
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


@dataclass
class RanksBuildReport:
    """What `build_rank_packs` did: one BuildReport per rank (its packs, written and skipped
    layers, bytes), the layers it read from the checkpoint, and the totals of the one pass."""

    world: int
    ranks: dict[int, BuildReport] = field(default_factory=dict)
    layers_read: list[int] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0


def build_rank_packs(checkpoint_path: Path | str, out_dir: Path | str, tags: tuple[str, ...] = ("base",),
                     device: str | None = None, zero_mode: str = "auto", checkpoint_id: str | None = None,
                     progress: bool = True, codec: RowCodec = DEFAULT_ROW_CODEC, world: int = 1) -> RanksBuildReport:
    """Build (or complete) the packs of `tags` of every tensor-parallel rank of `world` in one pass
    over the checkpoint. Each expert matrix is read and requantized once, whole (zero mode `auto`
    decided on the full matrix, as `build_packs` does), then cut per rank with `RankShard` and
    encoded; the packs are byte for byte those `build_packs(rank=r, world=world)` writes. Each
    rank's pack commits each layer with the PackWriter protocol. Resumable per rank and tier:
    a layer is written only to the packs that lack it, and not read at all when none does. The
    split is validated for every rank before any file is touched. One layer is in flight at a
    time (one expert's matrices in memory)."""
    check_tags(tags)
    if type(world) is not int or world < 1:
        raise TierstoreError(f"tensor-parallel world size must be a whole number >= 1, got {world!r}")
    device = resolve_device(device)
    started = time.perf_counter()
    warm_up(device)
    report = RanksBuildReport(world)
    with open_checkpoint(checkpoint_path) as checkpoint:
        inter, fmt = checkpoint.geometry.expert_inter, checkpoint.source_format
        shards = [RankShard(inter, rank, world) for rank in range(world)]  # raises on a bad split
        specs = [pack_specs(checkpoint, tags, zero_mode, checkpoint_id, codec, rank=r, world=world)
                 for r in range(world)]
        writers: dict[tuple[int, str], PackWriter] = {}
        try:
            for rank in range(world):
                for tag in tags:
                    writers[rank, tag] = PackWriter(out_dir, specs[rank][tag])
            done = {key: writer.written_layers() for key, writer in writers.items()}
            for rank in range(world):
                report.ranks[rank] = BuildReport(
                    packs={tag: writers[rank, tag].paths.pack for tag in tags},
                    written={tag: [] for tag in tags},
                    skipped={tag: sorted(done[rank, tag]) for tag in tags})
            num_layers = checkpoint.geometry.num_moe_layers
            todo = [layer for layer in range(num_layers) if any(layer not in d for d in done.values())]
            with tqdm(total=len(todo), unit="layer", desc=f"pack tp{world}", disable=not progress) as bar:
                for layer in todo:
                    missing = [key for key in writers if layer not in done[key]]
                    ranks = sorted({rank for rank, _ in missing})
                    pending = {key: writers[key].begin_layer(layer) for key in missing}
                    for expert in checkpoint.layer(layer).experts:
                        w13 = requantize(expert.w13, fmt, zero_mode, device, _whole, _whole)
                        w2 = requantize(expert.w2, fmt, zero_mode, device, _whole, _whole)
                        shares = {rank: (shards[rank].w13(w13), shards[rank].w2(w2)) for rank in ranks}
                        for rank, tag in missing:
                            row = codec.encode(tag, specs[rank][tag].segments, *shares[rank])
                            pending[rank, tag].write_row(expert.expert, row.numpy())
                            report.ranks[rank].bytes_written += row.numel()
                            report.bytes_written += row.numel()
                        del shares, w13, w2
                    for rank, tag in missing:
                        pending[rank, tag].commit()
                        report.ranks[rank].written[tag].append(layer)
                    report.layers_read.append(layer)
                    checkpoint.files.release()
                    elapsed = time.perf_counter() - started
                    bar.set_postfix_str(f"{report.bytes_written / max(elapsed, 1e-9) / 2**20:.1f} MiB/s", refresh=False)
                    bar.update(1)
        finally:
            for writer in writers.values():
                writer.close()
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for rank_report in report.ranks.values():
        rank_report.seconds, rank_report.peak_rss_bytes = report.seconds, report.peak_rss_bytes
    return report


def _whole(value):
    """The identity cut: `build_rank_packs` requantizes the whole matrix and cuts it afterwards."""
    return value
