"""The install's stream ordering and timing through the driver API: the current stream's handle, an event record,
a stream's wait on an event, an event's query and the time between two events, one ctypes call each.

torch's forms cost several microseconds of host time apiece (`torch.cuda.current_stream` builds a Stream object,
`Event.record` and `Stream.wait_event` pass Python wrappers and checks), and an install that streams makes five of
them while its step's pass runs, then a query and an elapsed time per install retired (`benchmarks/stream_ops_cost.py`
times both forms). The events stay torch's own:
`handle` gives a `torch.cuda.Event`'s driver handle, recording it once through torch first when it has none yet
(torch creates an event at its first record), and torch's `query`, `synchronize`, `elapsed_time` and a graph's
wait on it then see the records made here as their own.
"""

from __future__ import annotations

import ctypes

import torch

from tierstore.runtime.h2d import INVALID_CONTEXT

_NOT_READY = 600  # CUDA_ERROR_NOT_READY: the event's last record has not completed


class StreamOps:
    """`current()`, `record(event, stream)`, `wait(stream, event)`, `done(event)`, `elapsed_ms(start, end)` on raw
    handles (ints) of one CUDA device."""

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
        self._query = self._driver.lib.cuEventQuery
        self._query.argtypes = [ctypes.c_void_p]
        self._query.restype = ctypes.c_int
        self._elapsed = self._driver.lib.cuEventElapsedTime
        self._elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self._elapsed.restype = ctypes.c_int
        self._milliseconds = ctypes.c_float()

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
        if status == INVALID_CONTEXT:  # a thread that has not touched CUDA through torch yet
            self._driver.ensure_context(self._device)
            status = self._record(event, stream)
        if status:
            self._fail("cuEventRecord", status)

    def wait(self, stream: int, event: int) -> None:
        """Make stream handle `stream` wait on the device for event handle `event`'s last record."""
        status = self._wait(stream, event, 0)
        if status == INVALID_CONTEXT:
            self._driver.ensure_context(self._device)
            status = self._wait(stream, event, 0)
        if status:
            self._fail("cuStreamWaitEvent", status)

    def done(self, event: int) -> bool:
        """Whether event handle `event`'s last record has completed (never blocks)."""
        status = self._query(event)
        if status == _NOT_READY:
            return False
        if status:
            self._fail("cuEventQuery", status)
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds between two completed records of timing events (`enable_timing=True`)."""
        status = self._elapsed(ctypes.byref(self._milliseconds), start, end)
        if status:
            self._fail("cuEventElapsedTime", status)
        return self._milliseconds.value

    def _fail(self, call: str, status: int) -> None:
        name = ctypes.c_char_p()
        self._driver.lib.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {name.value.decode() if name.value else status}")
