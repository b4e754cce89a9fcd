"""Which decode steps launch a pass pair (config `pass_pair`): the back-off after a pair that fell short, and the
choice between a pair and a single pass by their measured step times (`pass_pair_choice`)."""

from __future__ import annotations

from collections import deque
from statistics import median

PAIR_CHOICES = ("timed", "always")  # pass_pair_choice
PAIR_RETRY_STEPS = 8  # `always`: single-pass decode steps after a pair that gathered fewer experts than it missed
TIMED_WINDOW = 5  # step times kept per kind (the median of these decides)
EXPLORE_EVERY = 16  # timed: eligible steps from a new preference to the first step that runs the other kind
EXPLORE_EVERY_MAX = 64  # ... doubling after each such step that left the preference as it was, up to this


class PairChoice:
    """For each decode step of a runtime that can launch pairs: pair or single.

    A step is *eligible* when the runtime could launch a pair (the caller gave one, a recent pass missed). `always`
    pairs every eligible step but the `PAIR_RETRY_STEPS` decode steps after a pair whose first pass gathered fewer
    experts than it missed (spares short, rows not in the arena), which run single (the back-off). `timed`
    alternates pairs and single passes over the first eligible steps, then runs the kind whose last `TIMED_WINDOW`
    eligible steps have the lower median wall time, and now and then one step of the other kind, so that a change
    of regime (coverage, routing, load) turns the choice: `EXPLORE_EVERY` eligible steps after the preference was
    formed or turned, then at twice the distance after each exploring step that did not turn it, up to
    `EXPLORE_EVERY_MAX` (a kind that keeps losing costs less to keep measured; at 10 % coverage on the H200, pairs
    lost by 6-8 % and their exploring steps cost 1-2 %). A pair that fell short is a slow sample there, not a
    back-off (on the H200 an isolated short pair at 50 % coverage sent 8 steps that pairs ran faster to single
    passes).

    A pair needs spares staged while the pass before it ran: `stages_next` tells that pass's read whether the next
    step is to be a pair (staging takes victims from the plan a single pass's fetch would use). Call `take` at a
    step's start and `done` after it succeeded; a step that failed is not timed."""

    def __init__(self, choice: str = "timed"):
        if choice not in PAIR_CHOICES:
            raise ValueError(f"pass_pair_choice must be one of {', '.join(PAIR_CHOICES)}, got {choice!r}")
        self.choice = choice
        self._seconds: dict[bool, deque[float]] = {True: deque(maxlen=TIMED_WINDOW),
                                                  False: deque(maxlen=TIMED_WINDOW)}
        self._medians: dict[bool, float | None] = {True: None, False: None}  # of `_seconds`, kept by `done`
        self._eligible = 0  # eligible steps seen outside the back-off
        self._preferred: bool | None = None  # `faster()` after the last sample
        self._explore_every = EXPLORE_EVERY  # timed: eligible steps from the last exploring step to the next
        self._explore_at = 0  # timed: the first eligible step (by `_eligible`) to run the other kind
        self.backoff_left = 0  # decode steps the back-off still runs single
        self._timing: bool | None = None  # the kind the step under way is a sample of (None: not a sample)

    def take(self, eligible: bool, staged: bool = True) -> bool:
        """Whether this decode step launches its pair (`staged`: spares were staged for it; a pair chosen without
        them runs single, untimed)."""
        self._timing = None
        if self.backoff_left:
            self.backoff_left -= 1
            return False
        if not eligible:
            return False
        self._eligible += 1
        pair = self.choice == "always" or self._timed_kind(self._eligible)
        if pair and not staged:
            return False
        if self.choice == "timed" and self._preferred is not None and pair != self._preferred:  # exploring
            self._explore_every = min(2 * self._explore_every, EXPLORE_EVERY_MAX)  # back to EXPLORE_EVERY if it turns
            self._explore_at = self._eligible + self._explore_every
        self._timing = pair
        return pair

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
            self._seconds[self._timing].append(seconds)
            self._medians[self._timing] = median(self._seconds[self._timing])
            preferred = self.faster()
            if preferred is not None and preferred != self._preferred:  # formed or turned: explore the other soon
                self._preferred, self._explore_every = preferred, EXPLORE_EVERY
                self._explore_at = self._eligible + EXPLORE_EVERY
            self._timing = None
        if self.choice == "always" and gathered is not None and missed is not None and gathered < missed:
            self.backoff_left = PAIR_RETRY_STEPS

    def failed(self) -> None:
        """The step under way raised: it is no sample."""
        self._timing = None

    def medians_ms(self) -> tuple[float, float]:
        """The median wall time in ms of the recent eligible steps run as a pair and as a single pass (0.0 for a
        kind not yet timed)."""
        return tuple(1e3 * self._medians[kind] if self._medians[kind] is not None else 0.0 for kind in (True, False))

    def faster(self) -> bool | None:
        """The kind the timed choice now prefers (True: the pair), None while either has fewer than 3 times."""
        if len(self._seconds[True]) < 3 or len(self._seconds[False]) < 3:
            return None
        return self._medians[True] <= self._medians[False]

    def _timed_kind(self, index: int, pending: bool | None = None) -> bool:
        """The timed choice's kind for the `index`-th eligible step (`pending`: a sample not yet timed)."""
        pairs, singles = (len(self._seconds[kind]) + (pending is kind) for kind in (True, False))
        preferred = self.faster()
        if preferred is None or min(pairs, singles) < 3:  # learning: alternate, the pair first
            return pairs <= singles
        return (not preferred) if index >= self._explore_at else preferred
