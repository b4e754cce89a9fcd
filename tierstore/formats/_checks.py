"""Input checks shared by the format codecs; every failure is a FormatError naming the input."""

from __future__ import annotations

import torch

from tierstore.errors import FormatError

FLOAT_INPUT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def require_dtype(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise FormatError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise FormatError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def require_2d(tensor: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(tensor, torch.Tensor):
        raise FormatError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise FormatError(f"{name}: expected a 2-D tensor [N, K], got shape {tuple(tensor.shape)}")
    return int(tensor.shape[0]), int(tensor.shape[1])


def require_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise FormatError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")


def require_multiple(value: int, multiple: int, what: str) -> None:
    if value % multiple != 0:
        raise FormatError(f"{what} = {value} is not a multiple of {multiple}")


def require_finite(values: torch.Tensor, name: str) -> None:
    """Reject NaN/Inf, naming how many there are and where the first one sits."""
    bad = ~torch.isfinite(values)
    num_bad = int(bad.sum())
    if num_bad:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(f"{name}: {num_bad} non-finite values (NaN/Inf), first at index {list(first)}")


def float_weight_to_f64(weight: torch.Tensor, name: str) -> torch.Tensor:
    """Upcast a bf16/fp16/fp32/fp64 [N, K] weight to float64 (exact) after checking it."""
    require_2d(weight, name)
    if weight.dtype not in FLOAT_INPUT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_INPUT_DTYPES)
        raise FormatError(f"{name}: dtype {weight.dtype} is not one of {allowed}")
    w = weight.to(torch.float64)
    require_finite(w, name)
    return w
