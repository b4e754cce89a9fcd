"""Byte sizes as people write them: `24` or `24GiB` (GiB when no unit), `512MiB`, `1.5TB`."""

from __future__ import annotations

import argparse
import re

from tierstore.errors import ConfigError

_UNITS = {
    "": 2**30, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | float | int) -> int:
    """Bytes in `text`; a bare number means GiB."""
    if isinstance(text, (int, float)):
        text = str(text)
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}: use a number of GiB or a unit such as 512MiB, 24GiB, 1.5TB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(count: float) -> str:
    """`count` bytes in binary units with three significant figures, e.g. '1.50 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return f"{int(count)} B"


def size_argument(text: str) -> int:
    """`parse_size` for argparse `type=`: a bad size becomes a usage error that names it."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
