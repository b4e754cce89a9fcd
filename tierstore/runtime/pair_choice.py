"""Which decode steps launch a pass pair (config `pass_pair`): the back-off after a pair that fell short, and the
choice between a pair and a single pass by their measured step times (`pass_pair_choice`)."""

from __future__ import annotations

from collections import deque
from statistics import fmean, median

PAIR_CHOICES = ("timed", "always")  # pass_pair_choice
PAIR_RETRY_STEPS = 8  # `always`: single-pass decode steps after a pair that gathered fewer experts than it missed
TIMED_WINDOW = 8  # samples kept per kind (their mean decides)
TIMED_MIN = 3  # samples each kind needs before the choice goes by time
TRIAL_RUN = 2  # eligible steps a kind runs in a row when it is tried (learning, exploring); the first is no sample
EXPLORE_EVERY = 32  # timed: in every this many eligible steps, a trial run of the slower kind, to keep its time current
EXPLORE_EVERY_WIDE = 64  # ... when the slower kind's mean is more than WIDE_GAP x the faster's
WIDE_GAP = 1.10
OUTLIER = 3.0  # a sample over this many times its window's median is left out of the mean (a host stall)


class PairChoice:
    """For each decode step of a runtime that can launch pairs: pair or single.

    A step is *eligible* when the runtime could launch a pair (the caller gave one, a recent pass missed). `always`
    pairs every eligible step but the `PAIR_RETRY_STEPS` decode steps after a pair whose first pass gathered fewer
    experts than it missed (spares short, rows not in the arena), which run single (the back-off). `timed` tries
    each kind in runs of `TRIAL_RUN` eligible steps, pairs first, until each has `TIMED_MIN` samples, then runs the
    kind whose last `TIMED_WINDOW` samples have the lower mean wall time, and in every `EXPLORE_EVERY` eligible
    steps a run of the other kind (every `EXPLORE_EVERY_WIDE` while it is more than `WIDE_GAP` x slower), so that
    a change of regime (coverage, routing, load) turns the choice; a pair that fell short is a slow sample there,
    not a back-off (on the H200 an isolated short pair at 50 % coverage sent 8 steps that pairs ran faster to
    single passes).

    A step is a sample of its kind only when the decode step before it ran the same kind: a pair's host work on
    the rows it gathered runs at the next pass's read, and a pair needs spares staged by the pass before it, so a
    step after a switch carries part of the other kind's cost (on the H200 a single pass after a pair took up to
    0.34 ms longer than one after a single pass, and a pair after a single pass up to 0.23 ms less than one after
    a pair). The mean, not the median, decides, since the total time is what a decode loop pays: at 25 % coverage
    pairs had the lower median and the higher mean (a third of them replayed twice).

    A pair needs spares staged while the pass before it ran: `stages_next` tells that pass's read whether the next
    step is to be a pair (staging takes victims from the plan a single pass's fetch would use). Call `take` at a
    step's start and `done` after it succeeded (`interrupted` after it raised or a prefill ran)."""

    def __init__(self, choice: str = "timed"):
        if choice not in PAIR_CHOICES:
            raise ValueError(f"pass_pair_choice must be one of {', '.join(PAIR_CHOICES)}, got {choice!r}")
        self.choice = choice
        self._seconds: dict[bool, deque[float]] = {True: deque(maxlen=TIMED_WINDOW),
                                                  False: deque(maxlen=TIMED_WINDOW)}
        self._means: dict[bool, float | None] = {True: None, False: None}  # of `_seconds`, kept by `done`
        self._eligible = 0  # eligible steps seen outside the back-off
        self.backoff_left = 0  # decode steps the back-off still runs single
        self._last: bool | None = None  # the kind the last decode step ran (None: none yet, or it failed)
        self._timing: bool | None = None  # the kind the step under way is a sample of (None: not a sample)

    def take(self, eligible: bool, staged: bool = True) -> bool:
        """Whether this decode step launches its pair (`staged`: spares were staged for it; a pair chosen without
        them runs single, no sample)."""
        pair, chosen = self._choose(eligible, staged)
        self._timing = pair if chosen and pair == self._last else None
        self._last = pair
        return pair

    def _choose(self, eligible: bool, staged: bool) -> tuple[bool, bool]:
        """(pair, chosen): the step's kind, and whether the choice made it (not the back-off, not ineligibility,
        not spares lacking)."""
        if self.backoff_left:
            self.backoff_left -= 1
            return False, False
        if not eligible:
            return False, False
        self._eligible += 1
        pair = self.choice == "always" or self._timed_kind(self._eligible)
        return (False, False) if pair and not staged else (pair, True)

    def stages_next(self) -> bool:
        """At the read of a decode pass: whether the next eligible step is to be a pair (the step under way counted
        as the sample it is)."""
        if self.backoff_left:
            return False
        return self.choice == "always" or self._timed_kind(self._eligible + 1, pending=self._timing)

    def done(self, seconds: float, gathered: int | None = None, missed: int | None = None) -> None:
        """After a step that `take` was asked about: its wall time, and for a pair the experts its first pass
        gathered and missed (with `always`, fewer gathered than missed starts the back-off)."""
        if self._timing is not None:
            window = self._seconds[self._timing]
            window.append(seconds)
            bound = OUTLIER * median(window)
            self._means[self._timing] = fmean(s for s in window if s <= bound)
            self._timing = None
        if self.choice == "always" and gathered is not None and missed is not None and gathered < missed:
            self.backoff_left = PAIR_RETRY_STEPS

    def interrupted(self) -> None:
        """The step under way raised, or a prefill step ran: no sample, and the next decode step follows no kind."""
        self._timing = None
        self._last = None

    def recent_ms(self) -> tuple[float, float]:
        """The mean wall time in ms of the recent samples of a pair and of a single pass (0.0 for a kind not yet
        timed)."""
        return tuple(1e3 * self._means[kind] if self._means[kind] is not None else 0.0 for kind in (True, False))

    def faster(self, pending: bool | None = None) -> bool | None:
        """The kind the timed choice now prefers (True: the pair), None while either has fewer than `TIMED_MIN`
        samples (`pending`: the kind of a sample under way, counted though not yet timed)."""
        if min(len(self._seconds[kind]) + (pending is kind) for kind in (True, False)) < TIMED_MIN:
            return None  # (TIMED_MIN > 1: each kind then has a mean)
        return self._means[True] <= self._means[False]

    def _timed_kind(self, index: int, pending: bool | None = None) -> bool:
        """The timed choice's kind for the `index`-th eligible step (`pending`: a sample not yet timed)."""
        preferred = self.faster(pending)
        if preferred is None:  # learning: runs of both kinds in turn, the pair first
            return (index - 1) // TRIAL_RUN % 2 == 0
        fast, slow = self._means[preferred], self._means[not preferred]
        every = EXPLORE_EVERY_WIDE if slow > WIDE_GAP * fast else EXPLORE_EVERY
        return (not preferred) if index % every >= every - TRIAL_RUN else preferred
