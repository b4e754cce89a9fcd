"""Stream memory operations through the driver API: a stream waits until a 32-bit word in device memory equals a
value (`cuStreamWaitValue32`), or writes one once the stream's earlier work is done (`cuStreamWriteValue32`).

The pass pair with engine copies (config `pass_pair_copies` "engine") uses them to let a captured replay wait for
copies the host issues while the graph already runs: the host writes each layer's flag on its copy stream after
that layer's rows, the replay waits for the flag before the layer. Both calls are capturable (a wait in a captured
stream becomes a graph node). `probe()` checks once that the device and driver support them.
"""

from __future__ import annotations

import ctypes

import torch

WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


class StreamValues:
    def __init__(self, device: torch.device) -> None:
        from tierstore.kernels.cuda.loader import driver

        self._driver = driver()
        self._device = device.index if device.index is not None else torch.cuda.current_device()
        self._driver.ensure_context(self._device)
        lib = self._driver.lib
        # CUDA 12 exports the _v2 entry points (the plain names are their aliases in the headers)
        self._wait = "cuStreamWaitValue32_v2" if hasattr(lib, "cuStreamWaitValue32_v2") else "cuStreamWaitValue32"
        self._write = "cuStreamWriteValue32_v2" if hasattr(lib, "cuStreamWriteValue32_v2") else "cuStreamWriteValue32"
        for name in (self._wait, self._write):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

    def wait(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """`stream` waits until the word at `address` (device memory) equals `value`."""
        self._driver.check(self._wait, stream.cuda_stream, address, value, WAIT_EQ)

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """Writes `value` to the word at `address` after `stream`'s earlier work (a memory barrier first)."""
        self._driver.check(self._write, stream.cuda_stream, address, value, 0)

    def probe(self) -> None:
        """A write and a wait on a scratch word, synchronised: RuntimeError (CudaError) where they are not
        supported."""
        word = torch.zeros(1, dtype=torch.int32, device=f"cuda:{self._device}")
        stream = torch.cuda.current_stream(self._device)
        self.write(stream, word.data_ptr(), 7)
        self.wait(stream, word.data_ptr(), 7)
        stream.synchronize()
        if int(word) != 7:
            raise RuntimeError("cuStreamWriteValue32 did not write its word")
