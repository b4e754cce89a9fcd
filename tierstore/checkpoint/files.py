"""The safetensors files of a checkpoint: which file holds which tensor, and bounded reads.

Headers of every shard are parsed once (shape and dtype of every tensor, no data). Data is read
through memory-mapped `safetensors.safe_open` handles that stay open only until `release()`, so
the pages a reader touched are unmapped layer by layer instead of accumulating.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from tierstore.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype strings -> torch dtypes (the ones a checkpoint reader meets)
DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "U8": torch.uint8, "I8": torch.int8,
    "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype string, shape) from a .safetensors file's JSON header."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {length} bytes exceeds {MAX_HEADER_BYTES}")
            raw = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"shard {path} not found") from None
    if len(raw) != length:
        raise CheckpointError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            entries[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
    return entries


class TensorFiles:
    """Tensor lookup over `model.safetensors` or the shards named by `model.safetensors.index.json`."""

    def __init__(self, root: Path):
        self.root = root
        index_path = root / INDEX_FILE
        if index_path.exists():
            self.index_path: Path | None = index_path
            shard_of = self._read_index(index_path)
        elif (root / SINGLE_FILE).exists():
            self.index_path = None
            shard_of = None
        else:
            raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self.shards = sorted({root / s for s in shard_of.values()}) if shard_of else [root / SINGLE_FILE]
        self._entries: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for shard in self.shards:
            for name, (dtype, shape) in read_header(shard).items():
                self._entries[name] = (shard, dtype, shape)
        if shard_of is not None:
            for name, shard in shard_of.items():
                got = self._entries.get(name)
                if got is None or got[0] != root / shard:
                    raise CheckpointError(f"{index_path} maps tensor {name!r} to {shard}, which does not hold it")
        self._handles: dict[Path, object] = {}

    def _read_index(self, index_path: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index with a weight_map ({e})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and "/" not in v and v not in ("", ".", "..") for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map names to shard file names in {self.root}")
        return weight_map

    def where(self) -> str:
        """The file a missing tensor was looked for in, for error messages."""
        return str(self.index_path or self.root / SINGLE_FILE)

    def has(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> tuple[Path, str, tuple[int, ...]]:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} not found in {self.where()}") from None

    def file_of(self, name: str) -> Path:
        return self._entry(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (e.g. "BF16", "F8_E4M3", "U8")."""
        return self._entry(name)[1]

    def _handle(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles[path] = handle
        return handle

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, as stored."""
        return self._handle(self.file_of(name)).get_tensor(name)

    def read_row(self, name: str, index: int) -> torch.Tensor:
        """`tensor[index]` of a tensor stacked along its first axis, reading only that slice."""
        shape = self.shape(name)
        if not shape or not 0 <= index < shape[0]:
            raise CheckpointError(f"tensor {name!r} {list(shape)} in {self.file_of(name)} has no row {index}")
        return self._handle(self.file_of(name)).get_slice(name)[index]

    def release(self) -> None:
        """Unmap every open file; later reads reopen what they need."""
        self._handles.clear()

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._entries)
