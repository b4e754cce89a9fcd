"""The arena's hot-set file (`<pack>.heat.json`): strict parsing, and a background writer that
never lets a young arena clobber the hot set it booted from.

A snapshot is taken on the fetching thread (the only thread that touches the slot table) and
handed to one writer thread; a newer snapshot replaces one not yet written. Every write is an
atomic replace. What is written is the arena's published keys, hottest first, followed by the
keys the file held at open that the arena does not hold, truncated to the arena's size: an arena
that has published fewer rows than it booted from (or none: a write is then skipped) keeps the
rest of the old hot set instead of erasing it.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierstore.atomic_files import atomic_write_bytes
from tierstore.errors import PackFormatError

log = logging.getLogger("tierstore.cache")

HEAT_FORMAT = "tierstore-heat"
HEAT_VERSION = 1
MAX_HEAT_BYTES = 64 << 20

Key = tuple[int, int]


def parse_heat(path: Path, num_layers: int, num_experts: int) -> list[Key]:
    """Keys of a heat file, hottest first, deduplicated; PackFormatError naming any defect."""
    with open(path, "rb") as handle:
        raw = handle.read(MAX_HEAT_BYTES + 1)
    if len(raw) > MAX_HEAT_BYTES:
        raise PackFormatError(f"{path} is larger than {MAX_HEAT_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise PackFormatError(f"{path} is not valid JSON: {exc}") from None
    fields = {"format", "version", "num_layers", "num_experts", "keys"}
    if type(body) is not dict or set(body) != fields:
        raise PackFormatError(f"{path} must be an object with exactly {sorted(fields)}")
    if body["format"] != HEAT_FORMAT or body["version"] != HEAT_VERSION or type(body["version"]) is not int:
        raise PackFormatError(f"{path} is not a {HEAT_FORMAT} version {HEAT_VERSION} file")
    if body["num_layers"] != num_layers or body["num_experts"] != num_experts:
        raise PackFormatError(f"{path} describes another geometry ({body['num_layers']!r:.20} x "
                              f"{body['num_experts']!r:.20}, expected {num_layers} x {num_experts})")
    keys = body["keys"]
    if type(keys) is not list or len(keys) > num_layers * num_experts:
        raise PackFormatError(f"{path}: keys must be a list of at most {num_layers * num_experts} entries")
    parsed: dict[Key, None] = {}
    for entry in keys:
        if (type(entry) is not list or len(entry) != 2 or any(type(v) is not int for v in entry)
                or not 0 <= entry[0] < num_layers or not 0 <= entry[1] < num_experts):
            raise PackFormatError(f"{path}: key {entry!r:.60} is not a [layer, expert] pair in range")
        parsed[(entry[0], entry[1])] = None
    return list(parsed)


class HeatWriter:
    """Writes the hot set of an arena of `limit` slots to `path`, merged with `booted_from` (the
    keys the file held at open)."""

    def __init__(self, path: Path, num_layers: int, num_experts: int, booted_from: list[Key], limit: int):
        self.path = path
        self.num_layers, self.num_experts = num_layers, num_experts
        self.booted_from = booted_from
        self.limit = limit
        self._pending_lock = threading.Lock()  # never held across a file write: submit never waits
        self._write_lock = threading.Lock()  # serialises file writes
        self._pending: list[Key] | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-heat")

    def merged(self, hottest_first: list[Key]) -> list[Key]:
        keys = dict.fromkeys(hottest_first)
        keys.update(dict.fromkeys(self.booted_from))
        return list(keys)[:self.limit]

    def write(self, hottest_first: list[Key]) -> None:
        """Write now, on the calling thread (atomic replace); nothing is written for no keys."""
        keys = self.merged(hottest_first)
        if not keys:
            return
        body = {"format": HEAT_FORMAT, "version": HEAT_VERSION, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "keys": [list(k) for k in keys]}
        with self._write_lock:
            atomic_write_bytes(self.path, json.dumps(body).encode())

    def submit(self, hottest_first: list[Key]) -> None:
        """Write in the background; a snapshot not yet written is replaced by this one."""
        with self._pending_lock:
            idle = self._pending is None
            self._pending = hottest_first
        if idle:
            self._thread.submit(self._drain)

    def _drain(self) -> None:
        with self._pending_lock:
            keys, self._pending = self._pending, None
        try:
            self.write(keys)
        except Exception as exc:  # a hint file: a failed write must never fail a fetch
            log.warning("could not write the heat file %s: %s", self.path, exc)

    def close(self) -> None:
        """Wait for background writes to finish."""
        self._thread.shutdown(wait=True)
