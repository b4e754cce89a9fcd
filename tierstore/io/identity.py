"""Checkpoint identity: which checkpoint a pack was built from.

SHA-256 over a version tag, the contents of every JSON file (config.json, quantization config,
safetensors index) and, for every other file (the shards), its name, size and mtime_ns. Shards
are not hashed by content: identity must be cheap at every boot. Users who know better (e.g.
copied checkpoints with new mtimes) pass an explicit override.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from tierstore.errors import PackFormatError

IDENTITY_VERSION = b"tierstore-ckpt-id-v1"
_OVERRIDE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}")


def checkpoint_identity(files: Iterable[Path | str], override: str | None = None) -> str:
    """64 hex digits identifying the checkpoint made of `files`, or `override` itself."""
    if override is not None:
        if not _OVERRIDE_RE.fullmatch(override):
            raise PackFormatError(f"checkpoint id override {override!r:.80} must match {_OVERRIDE_RE.pattern}")
        return override
    digest = hashlib.sha256(IDENTITY_VERSION)
    for path in sorted(Path(f) for f in files):
        digest.update(b"\0" + path.name.encode())
        if path.suffix == ".json":
            digest.update(b"\0content\0" + hashlib.sha256(path.read_bytes()).digest())
        else:
            info = os.stat(path)
            digest.update(f"\0stat\0{info.st_size}\0{info.st_mtime_ns}".encode())
    return digest.hexdigest()
