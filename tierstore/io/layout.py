"""What a pack file holds and where: the pack spec, its identity key and the row geometry.

A pack stores one row per (layer, expert) at `(layer * num_experts + expert) * stride`, where
`stride` is the row size rounded up to 4 KiB so that every row is O_DIRECT-legal (offset, length
and a page-aligned destination).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from tierstore.errors import PackFormatError

PAGE_BYTES = 4096
PACK_FORMAT_VERSION = 1

MAX_LAYERS = 4096
MAX_EXPERTS = 65536
MAX_ROW_BYTES = 1 << 36
MAX_WORLD = 4096
MAX_SEGMENTS = 64

_TAG_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_TOKEN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}")


def round_up_to_page(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def _check_int(what: str, value: object, low: int, high: int) -> int:
    if type(value) is not int:
        raise PackFormatError(f"{what} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise PackFormatError(f"{what} must be in [{low}, {high}], got {value}")
    return value


def _check_token(what: str, value: object, pattern: re.Pattern = _TOKEN_RE) -> str:
    if type(value) is not str or not pattern.fullmatch(value):
        raise PackFormatError(f"{what} must match {pattern.pattern!r}, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class RowSegment:
    """One named piece of a row: `nbytes` bytes at `offset`, holding a `dtype` array of `shape`."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str = "uint8"

    def to_dict(self) -> dict:
        return {"name": self.name, "offset": self.offset, "nbytes": self.nbytes,
                "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, raw: object) -> RowSegment:
        if type(raw) is not dict or set(raw) != {"name", "offset", "nbytes", "shape", "dtype"}:
            raise PackFormatError(f"row segment must be an object with name, offset, nbytes, shape, dtype: {raw!r:.120}")
        shape = raw["shape"]
        if type(shape) is not list or not 1 <= len(shape) <= 8:
            raise PackFormatError(f"row segment shape must be a list of 1 to 8 integers, got {shape!r:.80}")
        return cls(
            name=_check_token("row segment name", raw["name"]),
            offset=_check_int("row segment offset", raw["offset"], 0, MAX_ROW_BYTES),
            nbytes=_check_int("row segment nbytes", raw["nbytes"], 1, MAX_ROW_BYTES),
            shape=tuple(_check_int("row segment dimension", d, 1, MAX_ROW_BYTES) for d in shape),
            dtype=_check_token("row segment dtype", raw["dtype"]),
        )


@dataclass(frozen=True)
class PackSpec:
    """Everything a pack's contents depend on. Two configurations share a pack file only when
    their specs are equal; any difference gives a different file name and, for an existing file,
    makes its sidecar stale."""

    tag: str
    num_layers: int
    num_experts: int
    row_bytes: int
    checkpoint_id: str
    abi_tag: str
    zero_mode: str
    rank: int = 0
    world: int = 1
    segments: tuple[RowSegment, ...] = field(default=())

    def __post_init__(self) -> None:
        _check_token("pack tag", self.tag, _TAG_RE)
        _check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        _check_int("num_experts", self.num_experts, 1, MAX_EXPERTS)
        _check_int("row_bytes", self.row_bytes, 1, MAX_ROW_BYTES)
        _check_token("checkpoint_id", self.checkpoint_id)
        _check_token("abi_tag", self.abi_tag)
        _check_token("zero_mode", self.zero_mode)
        _check_int("world", self.world, 1, MAX_WORLD)
        _check_int("rank", self.rank, 0, self.world - 1)
        if len(self.segments) > MAX_SEGMENTS:
            raise PackFormatError(f"a row has at most {MAX_SEGMENTS} segments, got {len(self.segments)}")
        end = 0
        for segment in self.segments:
            if segment.offset < end:
                raise PackFormatError(f"row segment {segment.name!r} overlaps the one before it")
            end = segment.offset + segment.nbytes
        if end > self.row_bytes:
            raise PackFormatError(f"row segments end at byte {end}, past row_bytes {self.row_bytes}")

    @property
    def stride(self) -> int:
        return round_up_to_page(self.row_bytes)

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def file_bytes(self) -> int:
        return self.num_rows * self.stride

    def row_offset(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise PackFormatError(
                f"row ({layer}, {expert}) is outside the pack's {self.num_layers} layers x {self.num_experts} experts")
        return (layer * self.num_experts + expert) * self.stride

    def to_dict(self) -> dict:
        return {
            "tag": self.tag, "num_layers": self.num_layers, "num_experts": self.num_experts,
            "row_bytes": self.row_bytes, "checkpoint_id": self.checkpoint_id, "abi_tag": self.abi_tag,
            "zero_mode": self.zero_mode, "rank": self.rank, "world": self.world,
            "segments": [s.to_dict() for s in self.segments],
        }

    @classmethod
    def from_dict(cls, raw: object) -> PackSpec:
        expected = {"tag", "num_layers", "num_experts", "row_bytes", "checkpoint_id", "abi_tag",
                    "zero_mode", "rank", "world", "segments"}
        if type(raw) is not dict or set(raw) != expected:
            got = sorted(raw) if type(raw) is dict else type(raw).__name__
            raise PackFormatError(f"pack spec must be an object with exactly {sorted(expected)}, got {got!r:.200}")
        segments = raw["segments"]
        if type(segments) is not list or len(segments) > MAX_SEGMENTS:
            raise PackFormatError(f"pack spec segments must be a list of at most {MAX_SEGMENTS} entries")
        return cls(**{**raw, "segments": tuple(RowSegment.from_dict(s) for s in segments)})

    def key(self) -> str:
        """First 20 hex digits of SHA-256 over the canonical JSON of the spec."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:20]

    def file_stem(self) -> str:
        return f"{self.tag}.v{PACK_FORMAT_VERSION}.{self.key()}.rank{self.rank}of{self.world}"
