"""The install's stream ordering through the driver API: the current stream's handle, an event record and a
stream's wait on an event, one ctypes call each.

torch's forms cost several microseconds of host time apiece (`torch.cuda.current_stream` builds a Stream object,
`Event.record` and `Stream.wait_event` pass Python wrappers and checks), and an install that streams makes five of
them while its step's pass runs (`benchmarks/stream_ops_cost.py` times both forms). The events stay torch's own:
`handle` gives a `torch.cuda.Event`'s driver handle, recording it once through torch first when it has none yet
(torch creates an event at its first record), and torch's `query`, `synchronize`, `elapsed_time` and a graph's
wait on it then see the records made here as their own.
"""

from __future__ import annotations

import ctypes

import torch



class StreamOps:
    """`current()`, `record(event, stream)`, `wait(stream, event)` on raw handles (ints) of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        from tierstore.kernels.cuda.loader import driver

        self._driver = driver()
        self._device = device.index if device.index is not None else torch.cuda.current_device()
        self._driver.ensure_context(self._device)
        self._raw_stream = torch._C._cuda_getCurrentRawStream  # (device index) -> cudaStream_t as int
        self._record = self._driver.lib.cuEventRecord
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._record.restype = ctypes.c_int
        self._wait = self._driver.lib.cuStreamWaitEvent
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._wait.restype = ctypes.c_int

    def current(self) -> int:
        """The handle of this thread's current stream on the device."""
        return self._raw_stream(self._device)

    def handle(self, event: torch.cuda.Event) -> int:
        """`event`'s driver handle, created by one torch record on the current stream if it has none yet (that
        record is then the event's last: do this before the event is first waited on or timed)."""
        if not event.cuda_event:
            event.record(torch.cuda.current_stream(self._device))
        return event.cuda_event

    def record(self, event: int, stream: int) -> None:
        """Record event handle `event` on stream handle `stream`."""
        status = self._record(event, stream)
        if status:
            self._driver.retry_in_context(status, self._device, "cuEventRecord", self._record, event, stream)

    def wait(self, stream: int, event: int) -> None:
        """Make stream handle `stream` wait on the device for event handle `event`'s last record."""
        status = self._wait(stream, event, 0)
        if status:
            self._driver.retry_in_context(status, self._device, "cuStreamWaitEvent", self._wait, stream, event, 0)
