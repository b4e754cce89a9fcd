"""Packs for the runtime: built (or reused) with the kernel slot codec, opened as a row source."""

from __future__ import annotations

import logging
from pathlib import Path

from tierstore.checkpoint import open_checkpoint
from tierstore.io.pack import Pack
from tierstore.io.pack_build import BuildReport, build_packs, pack_specs
from tierstore.io.pack_rows import PackRows
from tierstore.io.readers import Reader, make_reader
from tierstore.io.readers.choice import direct_io_supported
from tierstore.slot_codec import KERNEL_SLOT_CODEC

log = logging.getLogger("tierstore.runtime")


def ensure_base_pack(checkpoint: Path | str, pack_dir: Path | str, *, device: str | None = None,
                     zero_mode: str = "auto", progress: bool = False, tags: tuple[str, ...] = ("base",)) -> BuildReport:
    """Build the W2 (`base`) pack of `checkpoint` in kernel slot layout (and the FP4 pack when
    `tags` holds "fp4"); layers already built are reused."""
    report = build_packs(checkpoint, pack_dir, tags=tags, device=device, zero_mode=zero_mode,
                         progress=progress, codec=KERNEL_SLOT_CODEC)
    for tag in tags:
        log.info("%s pack %s: built %d layers, reused %d", tag, report.packs[tag], len(report.written[tag]),
                 len(report.skipped[tag]))
    return report


def open_base_rows(checkpoint: Path | str, pack_dir: Path | str, *, zero_mode: str = "auto",
                   direct: bool | None = None, reader: Reader | None = None, tag: str = "base") -> PackRows:
    """The checksummed rows of the checkpoint's base pack (or, with tag="fp4", its FP4 pack).
    `reader` (e.g. a FaultyReader) must be open on that pack file; by default one is made on the
    process's reader backend (O_DIRECT where the filesystem allows it)."""
    with open_checkpoint(checkpoint) as ckpt:
        spec = pack_specs(ckpt, (tag,), zero_mode, codec=KERNEL_SLOT_CODEC)[tag]
    pack = Pack(pack_dir, spec)
    if reader is None:
        use_direct = direct_io_supported(pack.path) if direct is None else direct
        reader = make_reader(pack.path, direct=use_direct)
    return PackRows(pack, reader)
