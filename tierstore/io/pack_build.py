"""Building packs from a checkpoint: stream it layer by layer, requantize each expert once, write
its rows to every requested tier's pack. Resumable: layers already committed are skipped."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.matrices import SourceMatrix
from tierstore.errors import TierstoreError
from tierstore.formats import W2Tensor, quantize_w2, w2_from_mxfp4
from tierstore.io.identity import checkpoint_identity
from tierstore.io.layout import PackSpec
from tierstore.io.pack_writer import PackWriter
from tierstore.io.row_codec import DEFAULT_ROW_CODEC, TAGS, RowCodec, row_bytes

VERBATIM_ZERO_MODE = "verbatim"  # MXFP4 sources keep their nibbles: no zero signs are chosen


@dataclass
class BuildReport:
    packs: dict[str, Path] = field(default_factory=dict)
    written: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, list[int]] = field(default_factory=dict)
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0


def pack_specs(checkpoint, tags: tuple[str, ...], zero_mode: str, checkpoint_id: str | None = None,
               codec: RowCodec = DEFAULT_ROW_CODEC) -> dict[str, PackSpec]:
    """The spec of each tier's pack for an open checkpoint (what a reader at boot also computes);
    `codec` decides the row layout and its ABI tag."""
    geometry = checkpoint.geometry
    identity = checkpoint_identity(checkpoint.identity_files(), checkpoint_id)
    mode = VERBATIM_ZERO_MODE if checkpoint.source_format == "mxfp4" else zero_mode
    specs = {}
    for tag in tags:
        segments = codec.segments(tag, geometry)
        specs[tag] = PackSpec(tag=tag, num_layers=geometry.num_moe_layers, num_experts=geometry.num_experts,
                              row_bytes=row_bytes(segments), checkpoint_id=identity, abi_tag=codec.abi_tag,
                              zero_mode=mode, segments=segments)
    return specs


def requantize(matrix: SourceMatrix, source_format: str, zero_mode: str, device: str) -> W2Tensor:
    if source_format == "mxfp4":
        return w2_from_mxfp4(*matrix.mxfp4_parts())
    return quantize_w2(matrix.dequantize().to(device), zero_mode=zero_mode)


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise TierstoreError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise TierstoreError("--device cuda was asked for but no CUDA device is available")
    return device


def build_packs(checkpoint_path: Path | str, out_dir: Path | str, tags: tuple[str, ...] = ("base",),
                device: str | None = None, zero_mode: str = "auto", checkpoint_id: str | None = None,
                progress: bool = True, codec: RowCodec = DEFAULT_ROW_CODEC) -> BuildReport:
    for tag in tags:
        if tag not in TAGS:
            raise TierstoreError(f"unknown tier {tag!r}; choose from {', '.join(TAGS)}")
    device = resolve_device(device)
    started = time.perf_counter()
    report = BuildReport()
    with open_checkpoint(checkpoint_path) as checkpoint:
        specs = pack_specs(checkpoint, tags, zero_mode, checkpoint_id, codec)
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
                        w13 = requantize(expert.w13, checkpoint.source_format, zero_mode, device)
                        w2 = requantize(expert.w2, checkpoint.source_format, zero_mode, device)
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
