"""The pass log's read-back written by the pass (`log_stage.cu`): `LogStager` builds both kernels and binds them to a
log's buffers: `stage_log_words` copies the log's int32 words into pinned host memory and then sets a host flag,
`reset_log_words` zeroes the per-pass words and the flag at a pass's start (both on the current stream, capturable);
`stage_log_ref` and `reset_log_ref` are the plain-torch references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tierstore.kernels.cuda import loader

SOURCE = Path(__file__).resolve().with_name("log_stage.cu")
THREADS = 1024  # one block: the log is a few thousand words


class LogStager:
    """Builds (nvcc, cached) and loads both kernels once; `bind` / `bind_reset` check a log's buffers once and return
    their launcher."""

    def __init__(self, device: int | None = None) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        image = loader.build(SOURCE)
        self.kernel = loader.load(image, "stage_log_words", self.device)
        self.reset_kernel = loader.load(image, "reset_log_words", self.device)

    def bind(self, words: torch.Tensor, host: torch.Tensor, flag: torch.Tensor) -> Callable[[], None]:
        """A launcher of the staging of `words` (int32 [n], device) into `host` (int32 [n], pinned), then flag[0] = 1
        (int32 [1], pinned), on the current stream at each call (capturable). The tensors must outlive it."""
        check_stage_buffers(words, host, flag)
        quads = words.numel() // 4
        tail = words.numel() - 4 * quads
        values = [words.data_ptr(), host.data_ptr(), quads, words.data_ptr() + 16 * quads, host.data_ptr() + 16 * quads,
                  tail, flag.data_ptr()]

        def stage() -> None:
            self.kernel.launch((1,), (THREADS,), 0, torch.cuda.current_stream().cuda_stream, "ppippip", values)
        return stage

    def bind_reset(self, words: torch.Tensor, flag: torch.Tensor) -> Callable[[], None]:
        """A launcher that zeroes `words` (int32 [n], device, 16-byte aligned) and sets flag[0] = 0 (int32 [1],
        pinned), on the current stream at each call (capturable). The tensors must outlive it."""
        check_reset_buffers(words, flag)
        quads = words.numel() // 4
        values = [words.data_ptr(), quads, words.data_ptr() + 16 * quads, words.numel() - 4 * quads, flag.data_ptr()]

        def reset() -> None:
            self.reset_kernel.launch((1,), (THREADS,), 0, torch.cuda.current_stream().cuda_stream, "pipip", values)
        return reset

    def stage(self, words: torch.Tensor, host: torch.Tensor, flag: torch.Tensor) -> None:
        """`bind(words, host, flag)()`: once."""
        self.bind(words, host, flag)()


def check_stage_buffers(words: torch.Tensor, host: torch.Tensor, flag: torch.Tensor) -> None:
    """ValueError unless words, host and flag are contiguous int32, host as long as words and pinned with flag, and
    words and host 16-byte aligned (the kernel moves 16-byte words, then the tail)."""
    _check_words(("words", words), ("host", host), ("flag", flag))
    if host.numel() != words.numel():
        raise ValueError(f"host has {host.numel()} words for {words.numel()}")
    if not host.is_pinned():
        raise ValueError("the log's staging writes pinned host memory: host must be pinned")
    _check_flag(flag)


def check_reset_buffers(words: torch.Tensor, flag: torch.Tensor) -> None:
    """ValueError unless words (16-byte aligned) and flag (one word, pinned) are contiguous int32."""
    _check_words(("words", words), ("flag", flag))
    _check_flag(flag)


def _check_words(*named: tuple[str, torch.Tensor]) -> None:
    for name, tensor in named:
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError(f"the log's staging needs contiguous int32 tensors: {name} is {tensor.dtype}"
                             f"{'' if tensor.is_contiguous() else ', not contiguous'}")
        if name != "flag" and tensor.data_ptr() % 16:
            raise ValueError(f"the log's staging moves 16-byte words: {name} must be 16-byte aligned")


def _check_flag(flag: torch.Tensor) -> None:
    if flag.numel() != 1:
        raise ValueError(f"flag has {flag.numel()} words (needs 1)")
    if not flag.is_pinned():
        raise ValueError("the log's staging writes pinned host memory: flag must be pinned")


def stage_log_ref(words: torch.Tensor, host: np.ndarray, flag: np.ndarray) -> None:
    """What `stage_log_words` leaves on the host: host[:] = words, then flag[0] = 1."""
    host[:] = words.cpu().numpy()
    flag[0] = 1


def reset_log_ref(words: torch.Tensor, flag: np.ndarray) -> None:
    """What `reset_log_words` does: words[:] = 0, flag[0] = 0."""
    words.zero_()
    flag[0] = 0
