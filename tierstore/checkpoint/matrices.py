"""SourceMatrix: one expert matrix as the checkpoint stores it, read lazily, dequantized exactly.

A matrix records only tensor names and its logical shape [N, K] (K = contraction); bytes are read
when `dequantize()` or `mxfp4_parts()` is called, so holding many matrices costs no memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tierstore.checkpoint.files import TensorFiles
from tierstore.errors import CheckpointError
from tierstore.formats import dequantize_fp8_block, dequantize_mxfp4, dequantize_nvfp4

FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32


class SourceMatrix(ABC):
    """A logical [N, K] weight. Subclasses set `shape`, `format` and `tensor_names`."""

    shape: tuple[int, int]
    format: str
    tensor_names: tuple[str, ...]

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """float64 [N, K], exactly the stored value (every supported format fits float64)."""

    def mxfp4_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8 [N, K/2] low nibble = even k, UE8M0 scale bytes uint8 [N, K/32]), verbatim."""
        raise CheckpointError(f"{self.tensor_names[0]} is {self.format}, not mxfp4: it has no raw MXFP4 parts")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tensor_names[0]!r}, shape={list(self.shape)}, format={self.format})"


def _expect(files: TensorFiles, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> None:
    got_shape, got_dtype = files.shape(name), files.dtype(name)
    if got_shape != shape:
        raise CheckpointError(f"tensor {name!r} in {files.file_of(name)} has shape {list(got_shape)}, "
                              f"expected {list(shape)}")
    if got_dtype not in dtypes:
        raise CheckpointError(f"tensor {name!r} in {files.file_of(name)} has dtype {got_dtype}, "
                              f"expected {' or '.join(dtypes)}")


def _require_multiple(files: TensorFiles, name: str, k: int, block: int, fmt: str) -> None:
    if k % block:
        raise CheckpointError(f"tensor {name!r} in {files.file_of(name)}: {fmt} needs K={k} to be a "
                              f"multiple of {block}")


class FloatMatrix(SourceMatrix):
    """bf16 / fp16 / fp32 `name` [N, K]; or row `expert` of a stacked [E, N, K] ([E, K, N] if transposed)."""

    def __init__(self, files: TensorFiles, name: str, shape: tuple[int, int],
                 expert: int | None = None, transposed: bool = False):
        n, k = shape
        stored = (k, n) if transposed else (n, k)
        if expert is not None:
            stored = (files.shape(name)[0], *stored)
        _expect(files, name, stored, tuple(FLOAT_FORMATS))
        self.files, self.name, self.expert, self.transposed = files, name, expert, transposed
        self.shape, self.format, self.tensor_names = shape, FLOAT_FORMATS[files.dtype(name)], (name,)

    def dequantize(self) -> torch.Tensor:
        if self.expert is None:
            stored = self.files.read(self.name)
        else:
            stored = self.files.read_row(self.name, self.expert)
        values = stored.to(torch.float64)
        return values.t().contiguous() if self.transposed else values

    def __repr__(self) -> str:
        where = "" if self.expert is None else f"[{self.expert}]" + (".T" if self.transposed else "")
        return f"FloatMatrix({self.name!r}{where}, shape={list(self.shape)}, format={self.format})"


class Nvfp4Matrix(SourceMatrix):
    """modelopt NVFP4 at `prefix`: weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32.

    weight_scale_2 is per tensor ([] or [1]), per row block ([B] with N % B == 0, e.g. [2] for a
    fused gate_up whose two halves were quantized separately) or per row ([N]); it is expanded
    to one value per row, so each half keeps its own factor exactly.
    """

    def __init__(self, files: TensorFiles, prefix: str, shape: tuple[int, int]):
        n, k = shape
        names = tuple(f"{prefix}.{s}" for s in ("weight", "weight_scale", "weight_scale_2"))
        _require_multiple(files, names[0], k, NVFP4_BLOCK, "nvfp4")
        _expect(files, names[0], (n, k // 2), ("U8",))
        _expect(files, names[1], (n, k // NVFP4_BLOCK), ("F8_E4M3",))
        scale_2_shape = files.shape(names[2])
        if not (scale_2_shape == () or len(scale_2_shape) == 1 and n % scale_2_shape[0] == 0):
            raise CheckpointError(f"tensor {names[2]!r} in {files.file_of(names[2])} has shape "
                                  f"{list(scale_2_shape)}, expected [], or [B] with B dividing N={n}")
        _expect(files, names[2], scale_2_shape, ("F32",))
        self.files, self.shape, self.format, self.tensor_names = files, shape, "nvfp4", names

    def dequantize(self) -> torch.Tensor:
        packed, scale, scale_2 = (self.files.read(name) for name in self.tensor_names)
        if scale_2.dim() == 1 and scale_2.numel() > 1:  # [B] -> one value per row [N]
            scale_2 = scale_2.repeat_interleave(self.shape[0] // scale_2.numel())
        return dequantize_nvfp4(packed, scale, scale_2)


class Fp8BlockMatrix(SourceMatrix):
    """FP8 block-quant at `prefix`: weight e4m3 [N, K], weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)]."""

    def __init__(self, files: TensorFiles, prefix: str, shape: tuple[int, int], block: tuple[int, int]):
        n, k = shape
        names = (f"{prefix}.weight", f"{prefix}.weight_scale_inv")
        _expect(files, names[0], (n, k), ("F8_E4M3",))
        _expect(files, names[1], (-(-n // block[0]), -(-k // block[1])), ("F32",))
        self.files, self.shape, self.format, self.tensor_names = files, shape, "fp8_block", names
        self.block = block

    def dequantize(self) -> torch.Tensor:
        weight, scale_inv = (self.files.read(name) for name in self.tensor_names)
        return dequantize_fp8_block(weight, scale_inv, self.block)


class Mxfp4Matrix(SourceMatrix):
    """MXFP4 at `prefix`: weight uint8 [N, K/2] (low nibble = even k), weight_scale UE8M0 [N, K/32].

    The scale may be stored as uint8 bytes or as float8_e8m0fnu; mxfp4_parts() returns bytes either way.
    """

    def __init__(self, files: TensorFiles, prefix: str, shape: tuple[int, int]):
        n, k = shape
        names = (f"{prefix}.weight", f"{prefix}.weight_scale")
        _require_multiple(files, names[0], k, MXFP4_BLOCK, "mxfp4")
        _expect(files, names[0], (n, k // 2), ("U8",))
        _expect(files, names[1], (n, k // MXFP4_BLOCK), ("U8", "F8_E8M0"))
        self.files, self.shape, self.format, self.tensor_names = files, shape, "mxfp4", names

    def mxfp4_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        packed, scale = (self.files.read(name) for name in self.tensor_names)
        return packed, scale.view(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        return dequantize_mxfp4(*self.mxfp4_parts())


class StackedRows(SourceMatrix):
    """Row blocks of one format stacked along N (w13 = gate rows, then up rows).

    Each block dequantizes with its own scales, so NVFP4 halves with different scale_2 values
    come out exactly as a per-row scale_2 would give.
    """

    def __init__(self, parts: tuple[SourceMatrix, ...]):
        formats = {p.format for p in parts}
        widths = {p.shape[1] for p in parts}
        if len(formats) != 1 or len(widths) != 1:
            raise CheckpointError("cannot stack " + ", ".join(map(repr, parts)) + ": formats or K differ")
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), widths.pop())
        self.format = formats.pop()
        self.tensor_names = tuple(name for p in parts for name in p.tensor_names)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], dim=0)

    def mxfp4_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        packed, scales = zip(*(p.mxfp4_parts() for p in self.parts))
        return torch.cat(packed, dim=0), torch.cat(scales, dim=0)

    def __repr__(self) -> str:
        return f"StackedRows({list(self.parts)!r})"


def matrix_at(files: TensorFiles, prefix: str, shape: tuple[int, int], fp8_block: tuple[int, int]) -> SourceMatrix:
    """The matrix stored under `prefix` ("<prefix>.weight" + companions), its format told by dtypes."""
    weight = f"{prefix}.weight"
    dtype = files.dtype(weight)
    if dtype in FLOAT_FORMATS:
        return FloatMatrix(files, weight, shape)
    if dtype == "F8_E4M3":
        if not files.has(f"{prefix}.weight_scale_inv"):
            raise CheckpointError(f"tensor {prefix}.weight_scale_inv not found in {files.where()} "
                                  f"(FP8 {weight} needs block scales; per-tensor FP8 is unsupported)")
        return Fp8BlockMatrix(files, prefix, shape, fp8_block)
    if dtype == "U8":
        scale = f"{prefix}.weight_scale"
        if files.dtype(scale) == "F8_E4M3":
            return Nvfp4Matrix(files, prefix, shape)
        return Mxfp4Matrix(files, prefix, shape)
    raise CheckpointError(f"tensor {weight!r} in {files.file_of(weight)} has unsupported dtype {dtype}")
