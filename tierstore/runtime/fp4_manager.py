"""The FP4 manager: one named daemon thread that promotes and evicts in the background.

It sleeps on a coalescing wake event set by the runner at step end (no polling, no idle timer: a
spontaneous mutation could race the next forward). A pass takes the windows pushed to the
snapshot since the last take (host counts, merged), feeds the tier's frequencies and policy, and
promotes lazily in one batch, until nothing is pending. Mutations take the tier's lock, which the
runner holds across each step, so they happen only between steps; the rows they install are read
from host RAM or the pack before the lock is taken (`Fp4Tier.promote_lazy`), and the window's
bookkeeping takes only the tier's `state_lock`.

`pause()` holds the pool's residency still (benchmarks that compare two configurations at the same
FP4 residency): a paused manager takes no window (they keep merging in the snapshot, none is
lost) and mutates nothing until `resume()`; the runner's wakes are not delivered meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time

from tierstore.runtime.fp4_tier import Fp4Tier
from tierstore.runtime.seen_snapshot import ChainedSnapshot

log = logging.getLogger("tierstore.runtime")

THREAD_NAME = "tierstore-fp4-manager"


class Fp4Manager:
    def __init__(self, tier: Fp4Tier, snapshot: ChainedSnapshot):
        self.tier, self.snapshot = tier, snapshot
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._stop = False
        self._paused = False
        self.passes = self.windows = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A step ended (the runner). Not delivered while paused (`resume` wakes the manager): a
        paused manager would only take the GIL to go back to sleep."""
        if not self._paused:
            self._wake.set()

    def pause(self, timeout: float | None = None) -> bool:
        """Stop taking windows after the current pass; returns once no pass runs (False on timeout)."""
        self._paused = True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left if left is not None else 0.05)
        return True

    def resume(self) -> None:
        """Take windows again (the ones merged while paused first)."""
        self._paused = False
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every pushed window was consumed and no pass runs (tests, shutdown); while
        paused, until no pass runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy or (not self._paused and (self._wake.is_set() or (self.snapshot.pending
                                                                                and self.error is None))):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left if left is not None else 0.05)
        return True

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._idle:
                self._wake.clear()
                if self._paused and not self._stop:
                    self._idle.notify_all()
                    continue
                self._busy = True
            if self._stop:
                break
            try:
                self._pass()
            except BaseException as exc:  # keep serving on W2; report through stats and the log
                self.error = exc
                log.exception("FP4 manager pass failed")
            with self._idle:
                self._busy = False
                self._idle.notify_all()
        with self._idle:
            self._busy = False
            self._idle.notify_all()

    def _pass(self) -> None:
        """One pass: windows until none is pending (steps that end meanwhile add one more)."""
        self.passes += 1
        while True:
            counts = self.snapshot.take()
            if counts is None:
                return
            self.windows += 1
            window = self.tier.observe_window(counts)
            self.tier.promote_lazy(window)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (after its current pass) and join it."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("FP4 manager did not stop within %.1f s", timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
