"""Crash-safe file replacement (write a temp file, fsync it, rename it over the target, fsync the
directory: a reader sees the old file or the new one, never a mix) and build-once folders."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
        raise
    fsync_directory(path.parent)


def atomic_create_sparse(path: Path, size: int) -> None:
    """Replace `path` with a new all-holes file of `size` bytes."""
    path = Path(path)
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(temp_name, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(temp_name):
            os.unlink(temp_name)
        raise
    fsync_directory(path.parent)


def cache_dir() -> Path:
    """Where tierstore keeps what it builds for itself: $TIERSTORE_CACHE_DIR, else ~/.cache/tierstore."""
    return Path(os.environ.get("TIERSTORE_CACHE_DIR") or Path.home() / ".cache" / "tierstore")


def build_once(target: Path, build, progress: bool = False) -> Path:
    """`target` (a folder), calling `build(staging_folder)` first if it does not exist yet.

    The build writes into a temporary sibling that is renamed into place, so an interrupted build
    never leaves a half-written folder; when two processes race, the first rename wins.
    """
    target = Path(target)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{os.getpid()}.tmp"
    if progress:
        print(f"building {target} (first use only)")
    shutil.rmtree(staging, ignore_errors=True)
    build(staging)
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.exists():
            raise
    fsync_directory(target.parent)
    return target
