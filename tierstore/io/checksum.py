"""Row checksums: xxh3-64 over a row's payload bytes (not its page padding), as 16 hex digits."""

from __future__ import annotations

import re

import xxhash

CHECKSUM_RE = re.compile(r"[0-9a-f]{16}")


def row_checksum(payload) -> str:
    """`payload`: any contiguous bytes-like object (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_hexdigest(payload)
