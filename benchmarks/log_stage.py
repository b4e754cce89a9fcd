"""A pass writing its own pass-log read-back (`log_stage.cu`), measured by benchmarks/sync_wake.py: `LogStager` builds
`stage_log_words` and launches it (`stage`); the kernel copies the log's int32 words into pinned host memory and
then sets a host flag (on the current stream, capturable); `stage_log_ref` is the plain-torch reference.

Tried in the runtime in the thirteenth session (config `stage_pass_log`, d518448-c7e9d20) and removed: its read waited
~5 us less in sync_wake, but the runtime's steps were not measurably faster (docs/runtime-history.md, "The pass's own
read-back")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tierstore.kernels.cuda import loader

SOURCE = Path(__file__).resolve().with_name("log_stage.cu")
THREADS = 1024  # one block: the log is a few thousand words


class LogStager:
    """Builds (nvcc, cached) and loads `stage_log_words` once; `stage` launches it."""

    def __init__(self, device: int | None = None) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        self.kernel = loader.load(loader.build(SOURCE), "stage_log_words", self.device)

    def stage(self, words: torch.Tensor, host: torch.Tensor, flag: torch.Tensor) -> None:
        """`words` (int32 [n], device) into `host` (int32 [n], pinned), then flag[0] = 1 (int32 [1], pinned), on the
        current stream (capturable: a graph keeps these addresses, so the tensors must outlive it)."""
        check_stage_buffers(words, host, flag)
        quads = words.numel() // 4
        self.kernel.launch((1,), (THREADS,), 0, torch.cuda.current_stream().cuda_stream, "ppippip",
                           [words.data_ptr(), host.data_ptr(), quads, words.data_ptr() + 16 * quads,
                            host.data_ptr() + 16 * quads, words.numel() - 4 * quads, flag.data_ptr()])


def check_stage_buffers(words: torch.Tensor, host: torch.Tensor, flag: torch.Tensor) -> None:
    """ValueError unless words, host and flag are contiguous int32, host as long as words, flag one word, both pinned,
    and words and host 16-byte aligned (the kernel moves 16-byte words, then the tail)."""
    for name, tensor in (("words", words), ("host", host), ("flag", flag)):
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError(f"the log's staging needs contiguous int32 tensors: {name} is {tensor.dtype}"
                             f"{'' if tensor.is_contiguous() else ', not contiguous'}")
    if host.numel() != words.numel() or flag.numel() != 1:
        raise ValueError(f"host has {host.numel()} words for {words.numel()}, flag {flag.numel()} (needs 1)")
    if not (host.is_pinned() and flag.is_pinned()):
        raise ValueError("the log's staging writes pinned host memory: host and flag must be pinned")
    if words.data_ptr() % 16 or host.data_ptr() % 16:
        raise ValueError("the log's staging moves 16-byte words: words and host must be 16-byte aligned")


def stage_log_ref(words: torch.Tensor, host: np.ndarray, flag: np.ndarray) -> None:
    """What `stage_log_words` leaves on the host: host[:] = words, then flag[0] = 1."""
    host[:] = words.cpu().numpy()
    flag[0] = 1
