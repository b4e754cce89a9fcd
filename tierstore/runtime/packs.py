"""Packs for the runtime: built (or reused) with the kernel slot codec, opened as a row source.

`rank` / `world` select a tensor-parallel rank's pack (each expert's 1/world share of the
intermediate dimension; see `tierstore.io.pack_build.RankShard`); the default, rank 0 of 1, is the
single-GPU pack of whole experts."""

from __future__ import annotations

import logging
from pathlib import Path

from tierstore.checkpoint import open_checkpoint
from tierstore.errors import PackFormatError
from tierstore.io.pack import Pack
from tierstore.io.pack_build import BuildReport, build_packs, pack_specs
from tierstore.io.pack_rows import PackRows
from tierstore.io.readers import Reader, make_reader
from tierstore.io.readers.choice import direct_io_supported
from tierstore.runtime.rank_packs import no_rank_pack, rank_label
from tierstore.slot_codec import KERNEL_SLOT_CODEC

log = logging.getLogger("tierstore.runtime")


def ensure_base_pack(checkpoint: Path | str, pack_dir: Path | str, *, device: str | None = None,
                     zero_mode: str = "auto", progress: bool = False, tags: tuple[str, ...] = ("base",),
                     rank: int = 0, world: int = 1) -> BuildReport:
    """Build the W2 (`base`) pack of `checkpoint` in kernel slot layout (and the FP4 pack when
    `tags` holds "fp4") for tensor-parallel rank `rank` of `world`; layers already built are
    reused."""
    report = build_packs(checkpoint, pack_dir, tags=tags, device=device, zero_mode=zero_mode,
                         progress=progress, codec=KERNEL_SLOT_CODEC, rank=rank, world=world)
    for tag in tags:
        log.info("%s pack %s (%s): built %d layers, reused %d", tag, report.packs[tag], rank_label(rank, world),
                 len(report.written[tag]), len(report.skipped[tag]))
    return report


def open_base_rows(checkpoint: Path | str, pack_dir: Path | str, *, zero_mode: str = "auto",
                   direct: bool | None = None, reader: Reader | None = None, tag: str = "base",
                   rank: int = 0, world: int = 1) -> PackRows:
    """The checksummed rows of the checkpoint's base pack (or, with tag="fp4", its FP4 pack) of
    tensor-parallel rank `rank` of `world`. A missing or stale pack raises PackFormatError naming
    what the folder holds instead and the `tierstore pack` command that builds this one.
    `reader` (e.g. a FaultyReader) must be open on that pack file; by default one is made on the
    process's reader backend (O_DIRECT where the filesystem allows it)."""
    with open_checkpoint(checkpoint) as ckpt:
        spec = pack_specs(ckpt, (tag,), zero_mode, codec=KERNEL_SLOT_CODEC, rank=rank, world=world)[tag]
    try:
        pack = Pack(pack_dir, spec)
    except PackFormatError as reason:
        raise no_rank_pack(pack_dir, spec, reason, checkpoint, zero_mode) from None
    if reader is None:
        use_direct = direct_io_supported(pack.path) if direct is None else direct
        reader = make_reader(pack.path, direct=use_direct)
    return PackRows(pack, reader)
