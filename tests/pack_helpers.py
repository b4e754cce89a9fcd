"""Test helpers shared by the pack and arena tests (import as `from pack_helpers import read_row`)."""

import hashlib

import torch

from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import PreadvPoolReader


def shake_row(layer: int, expert: int, nbytes: int) -> bytes:
    """A row's bytes, distinct per (layer, expert)."""
    return hashlib.shake_128(f"{layer},{expert}".encode()).digest(nbytes)


def write_shake_pack(directory, spec) -> Pack:
    """A pack of `spec` in `directory` with every layer written, row (l, e) = `shake_row(l, e, spec.row_bytes)`."""
    with PackWriter(directory, spec) as writer:
        for layer in range(spec.num_layers):
            writer.write_layer(layer, (shake_row(layer, e, spec.row_bytes) for e in range(spec.num_experts)))
    return Pack(directory, spec)


def read_row(directory, spec, layer, expert) -> torch.Tensor:
    """One checksummed row of the pack `spec` in `directory`, as uint8 [row_bytes]."""
    pack = Pack(directory, spec)
    with PreadvPoolReader(pack.path) as reader:
        dest = torch.empty(spec.stride, dtype=torch.uint8)
        PackRows(pack, reader).read_rows([(layer, expert)], [memoryview(dest.numpy())])
    return dest[:spec.row_bytes]
