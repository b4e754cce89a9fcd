"""Host-to-device copies of pinned bytes through the driver API (`cuMemcpyHtoDAsync`).

One ctypes call per copy costs a few microseconds of host time. torch's `copy_(non_blocking=True)`
from pinned memory costs far more (dispatch, and an event recorded in torch's pinned-memory
allocator for every copy), and on the miss path the host issues a row per expert while the copy
engine drains them: when issuing is slower than copying, the engine idles between rows.

The caller keeps the host bytes alive and unchanged until the copy is done (`DevicePool` waits
before its arena or staging is reused), and passes pinned memory (pageable memory still copies
correctly, but synchronously).
"""

from __future__ import annotations

import ctypes

import torch

class HostToDevice:
    """`copy(dst_ptr, src_ptr, nbytes, stream)`: an asynchronous copy on `stream` (a torch CUDA stream, or its raw
    handle as an int: `StreamOps`)."""

    def __init__(self, device: torch.device) -> None:
        from tierstore.kernels.cuda.loader import driver

        self._driver = driver()
        self._device = device.index if device.index is not None else torch.cuda.current_device()
        self._driver.ensure_context(self._device)
        self._memcpy = self._driver.lib.cuMemcpyHtoDAsync_v2
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int, stream: torch.cuda.Stream | int) -> None:
        handle = stream if type(stream) is int else stream.cuda_stream
        status = self._memcpy(dst_ptr, src_ptr, nbytes, handle)
        if status:
            self._driver.retry_in_context(status, self._device, f"cuMemcpyHtoDAsync of {nbytes} bytes", self._memcpy,
                                          dst_ptr, src_ptr, nbytes, handle)
