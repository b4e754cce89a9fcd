"""Test helper for the kill -9 tests (import as `from process_helpers import Watched`).

A subprocess started by a test can spend seconds importing Python and torch on a loaded machine,
so a kill time counted from Popen says nothing about where the kill lands in the work. `Watched`
drains the child's stdout and stderr on threads and notes when a marker first appears on stderr:
kill times are counted from that moment, when the child has really started working."""

import subprocess
import threading
import time

START_TIMEOUT_S = 180.0  # generous: a loaded 2-core CI machine takes seconds to import torch


class Watched:
    """`args` run with both pipes drained; `started_at` is the time.monotonic() at which `marker`
    first appeared on stderr, `stdout_at` when the first stdout byte arrived (None until then)."""

    def __init__(self, args, marker: bytes, **popen):
        self.args, self.marker = list(args), marker
        self.stderr, self.stdout = bytearray(), bytearray()
        self.started_at: float | None = None
        self.stdout_at: float | None = None
        self._started = threading.Event()
        self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
        self._threads = [threading.Thread(target=self._drain, args=(self.process.stderr, True), daemon=True),
                         threading.Thread(target=self._drain, args=(self.process.stdout, False), daemon=True)]
        for thread in self._threads:
            thread.start()

    def _drain(self, pipe, is_stderr: bool) -> None:
        while chunk := pipe.read1(1 << 16):
            now = time.monotonic()
            if is_stderr:
                self.stderr += chunk
                if self.started_at is None and self.marker in self.stderr:
                    self.started_at = now
                    self._started.set()
            else:
                if self.stdout_at is None:
                    self.stdout_at = now
                self.stdout += chunk
        if is_stderr:
            self._started.set()  # EOF: the child is gone; wait_started looks at started_at

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> float:
        """The moment the marker appeared; fails clearly if the child exits or stays silent."""
        if not self._started.wait(timeout) or self.started_at is None:
            self.kill()
            raise AssertionError(
                f"{' '.join(self.args[:5])} ... never started working: no {self.marker!r} on stderr within "
                f"{timeout:.0f} s (exit status {self.process.returncode}); stderr: {bytes(self.stderr[-2000:])!r}")
        return self.started_at

    def kill(self) -> int:
        """kill -9 and reap; returns the exit status (-9 when the kill landed, else the child's own)."""
        self.process.kill()
        status = self.process.wait()
        for thread in self._threads:
            thread.join(10)
        return status

    def wait(self, timeout: float) -> int:
        status = self.process.wait(timeout)
        for thread in self._threads:
            thread.join(10)
        return status
