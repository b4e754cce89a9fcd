"""A pack's files on disk and the read side: open a pack, learn which layers are sound to read.

Files of one pack, all in one directory, named after the spec's key:
`<stem>.pack` (rows), `<stem>.json` (sidecar), `<stem>.lock` (flock), `<stem>.pack.heat.json`
(the arena's hot set). Nothing outside that directory is ever touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from tierstore.errors import PackFormatError
from tierstore.io.layout import PackSpec
from tierstore.io.sidecar import Sidecar, read_sidecar


@dataclass(frozen=True)
class PackPaths:
    directory: Path
    stem: str

    @classmethod
    def for_spec(cls, directory: Path | str, spec: PackSpec) -> PackPaths:
        return cls(Path(directory), spec.file_stem())

    @property
    def pack(self) -> Path:
        return self.directory / f"{self.stem}.pack"

    @property
    def sidecar(self) -> Path:
        return self.directory / f"{self.stem}.json"

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.stem}.lock"

    @property
    def heat(self) -> Path:
        return self.directory / f"{self.stem}.pack.heat.json"


@contextlib.contextmanager
def locked(paths: PackPaths, exclusive: bool):
    """Hold the pack's flock (exclusive for writers, shared for readers) for the block."""
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def check_pack_file(paths: PackPaths, spec: PackSpec) -> os.stat_result:
    """The pack file's stat, after checking it exists with exactly the spec's size."""
    try:
        info = os.stat(paths.pack)
    except FileNotFoundError:
        raise PackFormatError(f"pack file {paths.pack} is missing") from None
    if info.st_size != spec.file_bytes:
        raise PackFormatError(f"pack file {paths.pack} is {info.st_size} bytes, its spec needs {spec.file_bytes}")
    return info


def load_valid_sidecar(paths: PackPaths, spec: PackSpec) -> tuple[Sidecar, os.stat_result]:
    """The sidecar and pack-file stat when both are valid for `spec`; otherwise PackFormatError
    saying why the pack is stale. Call with the pack lock held."""
    sidecar = read_sidecar(paths.sidecar)
    if sidecar.spec != spec:
        raise PackFormatError(f"{paths.sidecar} describes another configuration (stale pack)")
    return sidecar, check_pack_file(paths, spec)


class Pack:
    """A consistent snapshot of a valid pack: its layers and row checksums.

    Rows of layers not in the snapshot are never read. `refresh()` picks up layers that
    writers have added since.
    """

    def __init__(self, directory: Path | str, spec: PackSpec):
        self.spec = spec
        self.paths = PackPaths.for_spec(directory, spec)
        self._load()

    def _load(self) -> None:
        with locked(self.paths, exclusive=False):
            self.sidecar, info = load_valid_sidecar(self.paths, self.spec)
        self.inode = (info.st_dev, info.st_ino)

    def refresh(self) -> None:
        self._load()

    @property
    def path(self) -> Path:
        return self.paths.pack

    @property
    def layers(self) -> frozenset[int]:
        return self.sidecar.layers

    def has_layer(self, layer: int) -> bool:
        return layer in self.sidecar.checksums

    def checksum(self, layer: int, expert: int) -> str:
        try:
            return self.sidecar.checksums[layer][expert]
        except (KeyError, IndexError):
            raise PackFormatError(f"row ({layer}, {expert}) is not written in {self.path}") from None
