"""The JSON sidecar next to a pack file: its spec, which layers are written, one checksum per row.

Parsing is strict and bounded: a sidecar is untrusted input. Anything that is not exactly the
documented shape raises PackFormatError naming the defect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tierstore.errors import PackFormatError
from tierstore.io.checksum import CHECKSUM_RE
from tierstore.io.layout import PACK_FORMAT_VERSION, PackSpec

SIDECAR_FORMAT = "tierstore-pack"
MAX_SIDECAR_BYTES = 64 << 20
_FIELDS = {"format", "version", "spec", "stride", "file_bytes", "layers", "checksums"}


@dataclass(frozen=True)
class Sidecar:
    """`checksums[layer]` holds one row checksum per expert for every written layer."""

    spec: PackSpec
    checksums: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.checksums)

    def with_layer(self, layer: int, layer_checksums: tuple[str, ...]) -> Sidecar:
        return Sidecar(self.spec, {**self.checksums, layer: tuple(layer_checksums)})

    def to_json(self) -> bytes:
        body = {
            "format": SIDECAR_FORMAT,
            "version": PACK_FORMAT_VERSION,
            "spec": self.spec.to_dict(),
            "stride": self.spec.stride,
            "file_bytes": self.spec.file_bytes,
            "layers": sorted(self.checksums),
            "checksums": {str(layer): list(self.checksums[layer]) for layer in sorted(self.checksums)},
        }
        return json.dumps(body, indent=1).encode()


def parse_sidecar(raw: bytes) -> Sidecar:
    if len(raw) > MAX_SIDECAR_BYTES:
        raise PackFormatError(f"sidecar is {len(raw)} bytes, more than the {MAX_SIDECAR_BYTES} allowed")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise PackFormatError(f"sidecar is not valid JSON: {exc}") from None
    if type(body) is not dict or set(body) != _FIELDS:
        got = sorted(body) if type(body) is dict else type(body).__name__
        raise PackFormatError(f"sidecar must be an object with exactly {sorted(_FIELDS)}, got {got!r:.200}")
    if body["format"] != SIDECAR_FORMAT or body["version"] != PACK_FORMAT_VERSION or type(body["version"]) is not int:
        raise PackFormatError(
            f"sidecar is {body['format']!r:.40} version {body['version']!r:.20}, "
            f"expected {SIDECAR_FORMAT!r} version {PACK_FORMAT_VERSION}")
    spec = PackSpec.from_dict(body["spec"])
    for name, expected in (("stride", spec.stride), ("file_bytes", spec.file_bytes)):
        if type(body[name]) is not int or body[name] != expected:
            raise PackFormatError(f"sidecar {name} is {body[name]!r:.40}, the spec gives {expected}")
    return Sidecar(spec, _parse_checksums(body["layers"], body["checksums"], spec))


def _parse_checksums(layers: object, checksums: object, spec: PackSpec) -> dict[int, tuple[str, ...]]:
    if type(layers) is not list or len(layers) > spec.num_layers:
        raise PackFormatError(f"sidecar layers must be a list of at most {spec.num_layers} layer indices")
    for layer in layers:
        if type(layer) is not int or not 0 <= layer < spec.num_layers:
            raise PackFormatError(f"sidecar layer {layer!r:.40} is not an index in [0, {spec.num_layers})")
    if len(set(layers)) != len(layers):
        raise PackFormatError("sidecar layers are not unique")
    if type(checksums) is not dict or set(checksums) != {str(layer) for layer in layers}:
        raise PackFormatError("sidecar checksums must have exactly one entry per written layer")
    parsed: dict[int, tuple[str, ...]] = {}
    for layer in layers:
        row_sums = checksums[str(layer)]
        if type(row_sums) is not list or len(row_sums) != spec.num_experts:
            raise PackFormatError(f"sidecar checksums of layer {layer} must list {spec.num_experts} rows")
        for row_sum in row_sums:
            if type(row_sum) is not str or not CHECKSUM_RE.fullmatch(row_sum):
                raise PackFormatError(f"sidecar checksum {row_sum!r:.40} of layer {layer} is not 16 hex digits")
        parsed[layer] = tuple(row_sums)
    return parsed


def read_sidecar(path: Path) -> Sidecar:
    """Read and parse a sidecar file; a missing or oversized file raises PackFormatError."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SIDECAR_BYTES + 1)
    except FileNotFoundError:
        raise PackFormatError(f"no sidecar at {path}") from None
    try:
        return parse_sidecar(raw)
    except PackFormatError as exc:
        raise PackFormatError(f"{path}: {exc}") from None
