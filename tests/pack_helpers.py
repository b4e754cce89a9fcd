"""Test helper shared by the pack tests (import as `from pack_helpers import read_row`)."""

import torch

from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.readers import PreadvPoolReader


def read_row(directory, spec, layer, expert) -> torch.Tensor:
    """One checksummed row of the pack `spec` in `directory`, as uint8 [row_bytes]."""
    pack = Pack(directory, spec)
    with PreadvPoolReader(pack.path) as reader:
        dest = torch.empty(spec.stride, dtype=torch.uint8)
        PackRows(pack, reader).read_rows([(layer, expert)], [memoryview(dest.numpy())])
    return dest[:spec.row_bytes]
