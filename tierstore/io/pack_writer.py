"""Crash-safe, resumable, multi-process pack writes, one layer at a time.

Protocol (every step survives a crash at any point):
1. Open: under the exclusive flock, load the sidecar; if it is missing, malformed or describes
   another configuration, or the pack file has the wrong size, start a new generation: first
   reset the sidecar to no layers (atomic), then replace the pack with a fresh sparse file
   (temp + rename + directory fsync). Nothing of a stale generation is trusted.
2. Write a layer: pwrite its rows (partial writes looped, bounded chunks), fdatasync. No lock is
   held, so writers of different layers overlap.
3. Commit: under the exclusive flock, re-read and re-validate the sidecar, check the pack file
   is still the inode we wrote to, merge this layer and its row checksums into the sidecar
   (atomic replace). A layer is readable only after its commit; a crash before it leaves the
   layer unrecorded and a rerun rewrites it.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tierstore.errors import CapacityError, PackFormatError
from tierstore.atomic_files import atomic_create_sparse, atomic_write_bytes
from tierstore.io.checksum import row_checksum
from tierstore.io.layout import PackSpec
from tierstore.io.pack import PackPaths, load_valid_sidecar, locked
from tierstore.io.sidecar import Sidecar

log = logging.getLogger("tierstore.io")

WRITE_CHUNK_BYTES = 64 << 20


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite all of `data` at `offset`, looping over partial writes in bounded chunks."""
    done = 0
    while done < len(data):
        written = os.pwrite(fd, data[done:done + WRITE_CHUNK_BYTES], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {written} bytes at offset {offset + done}")
        done += written


class PackWriter:
    """Writes layers of one pack. Use as a context manager; `written_layers()` lists what a rerun
    can skip."""

    def __init__(self, directory: Path | str, spec: PackSpec):
        self.spec = spec
        self.paths = PackPaths.for_spec(directory, spec)
        self.paths.directory.mkdir(parents=True, exist_ok=True)
        with locked(self.paths, exclusive=True):
            self._ensure_valid_generation()
            self._fd = os.open(self.paths.pack, os.O_WRONLY)
        info = os.fstat(self._fd)
        self._inode = (info.st_dev, info.st_ino)

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _ensure_valid_generation(self) -> Sidecar:
        try:
            sidecar, _ = load_valid_sidecar(self.paths, self.spec)
            return sidecar
        except PackFormatError as reason:
            if self.paths.sidecar.exists() or self.paths.pack.exists():
                log.warning("starting a new pack generation at %s: %s", self.paths.pack, reason)
        empty = Sidecar(self.spec)
        atomic_write_bytes(self.paths.sidecar, empty.to_json())
        atomic_create_sparse(self.paths.pack, self.spec.file_bytes)
        return empty

    def written_layers(self) -> frozenset[int]:
        with locked(self.paths, exclusive=False):
            try:
                sidecar, _ = load_valid_sidecar(self.paths, self.spec)
            except PackFormatError:
                return frozenset()
        return sidecar.layers

    def write_layer(self, layer: int, rows: Iterable) -> None:
        """Write and commit `layer`: `rows` yields one bytes-like row of `spec.row_bytes` bytes per
        expert, in expert order. Only one row is held at a time."""
        pending = self.begin_layer(layer)
        for expert, row in enumerate(rows):
            pending.write_row(expert, row)
        pending.commit()

    def begin_layer(self, layer: int) -> LayerWrite:
        """Start writing `layer` row by row (for callers that interleave several packs)."""
        if type(layer) is not int or not 0 <= layer < self.spec.num_layers:
            raise PackFormatError(f"layer {layer!r} is outside the pack's {self.spec.num_layers} layers")
        return LayerWrite(self, layer)

    def _write(self, layer: int, payload: memoryview, offset: int) -> None:
        try:
            write_all(self._fd, payload, offset)
        except OSError as exc:
            self._raise_write_error(layer, exc)

    def _raise_write_error(self, layer: int, exc: OSError):
        if exc.errno == errno.ENOSPC:
            raise CapacityError(f"disk full while writing layer {layer} to {self.paths.pack} "
                                f"(a layer needs {self.spec.num_experts * self.spec.stride} bytes); "
                                "layers already committed are intact") from exc
        raise exc

    def _commit(self, layer: int, checksums: tuple[str, ...]) -> None:
        with locked(self.paths, exclusive=True):
            try:
                sidecar, info = load_valid_sidecar(self.paths, self.spec)
            except PackFormatError as exc:
                raise PackFormatError(f"pack was invalidated while layer {layer} was written ({exc}); "
                                      "rerun to rebuild it") from None
            if (info.st_dev, info.st_ino) != self._inode:
                raise PackFormatError(f"{self.paths.pack} was replaced by a new generation while layer "
                                      f"{layer} was written; rerun to rebuild it")
            try:
                atomic_write_bytes(self.paths.sidecar, sidecar.with_layer(layer, checksums).to_json())
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise CapacityError(f"disk full while recording layer {layer} in {self.paths.sidecar}; "
                                        "layers already committed are intact") from exc
                raise


class LayerWrite:
    """One layer being written: `write_row` each expert (any order), then `commit`."""

    def __init__(self, writer: PackWriter, layer: int):
        self.writer = writer
        self.layer = layer
        self._checksums: dict[int, str] = {}

    def write_row(self, expert: int, row) -> None:
        spec, layer = self.writer.spec, self.layer
        if type(expert) is not int or not 0 <= expert < spec.num_experts:
            raise PackFormatError(f"layer {layer}: expert {expert!r} is outside the pack's {spec.num_experts} experts")
        payload = memoryview(row).cast("B")
        if len(payload) != spec.row_bytes:
            raise PackFormatError(f"layer {layer} expert {expert}: row is {len(payload)} bytes, "
                                  f"the pack's rows are {spec.row_bytes}")
        offset = spec.row_offset(layer, expert)
        self.writer._write(layer, payload, offset)
        self.writer._write(layer, memoryview(bytes(spec.stride - spec.row_bytes)), offset + spec.row_bytes)
        self._checksums[expert] = row_checksum(payload)

    def commit(self) -> None:
        spec = self.writer.spec
        if len(self._checksums) != spec.num_experts:
            raise PackFormatError(f"layer {self.layer}: {len(self._checksums)} rows given, {spec.num_experts} needed")
        try:
            os.fdatasync(self.writer._fd)
        except OSError as exc:
            self.writer._raise_write_error(self.layer, exc)
        self.writer._commit(self.layer, tuple(self._checksums[e] for e in range(spec.num_experts)))
