"""Choosing a reader backend: io_uring when it sets up here, else the preadv pool. The choice is
made once per process and logged; it can be forced."""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

from tierstore.errors import ReadError
from tierstore.io.readers.base import Reader
from tierstore.io.readers.preadv_pool import PreadvPoolReader
from tierstore.io.readers.uring import UringReader, load_liburing

log = logging.getLogger("tierstore.io")

BACKENDS = ("auto", "io_uring", "preadv-pool")
URING_MIN_KERNEL = (6, 14)  # what the pinned liburing binding documents


def kernel_version(release: str | None = None) -> tuple[int, int]:
    release = release or platform.release()
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def uring_unavailable_reason() -> str | None:
    """Why io_uring cannot serve reads here, or None when a ring sets up."""
    if kernel_version() < URING_MIN_KERNEL:
        return f"kernel {platform.release()} is older than {'.'.join(map(str, URING_MIN_KERNEL))}"
    try:
        uring = load_liburing()
    except ReadError as exc:
        return str(exc)
    ring = uring.Ring()
    try:
        uring.io_uring_queue_init(4, ring)
    except OSError as exc:
        return f"io_uring_setup failed: {exc}"
    uring.io_uring_queue_exit(ring)
    return None


@functools.cache
def chosen_backend(requested: str = "auto") -> str:
    """Resolve `requested` to a concrete backend, once per process, and log the choice."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown reader backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if requested == "preadv-pool":
        log.info("reader backend: preadv-pool (forced)")
        return requested
    reason = uring_unavailable_reason()
    if requested == "io_uring":
        if reason is not None:
            raise ReadError(f"io_uring was requested but is unavailable: {reason}")
        log.info("reader backend: io_uring (forced)")
        return requested
    if reason is None:
        log.info("reader backend: io_uring")
        return "io_uring"
    log.info("reader backend: preadv-pool (io_uring unavailable: %s)", reason)
    return "preadv-pool"


def make_reader(path: Path | str, direct: bool = False, backend: str = "auto", threads: int = 8,
                depth: int = 64, registered: memoryview | None = None) -> Reader:
    """A reader of `path` on the process's chosen backend. `registered`: memory most reads land
    in (the arena), registered with io_uring as a fixed buffer."""
    if chosen_backend(backend) == "io_uring":
        return UringReader(path, direct=direct, depth=depth, registered=registered)
    return PreadvPoolReader(path, direct=direct, threads=threads)


def direct_io_supported(path: Path | str) -> bool:
    """Whether the filesystem holding `path` accepts O_DIRECT opens."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True
