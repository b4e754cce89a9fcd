"""Which decode steps launch a pass pair (config `pass_pair`): the back-off after a pair that fell short, and the
choice between a pair and a single pass by their measured step times (`pass_pair_choice`); `TimedChoice`, the timed
choice between two kinds of step, also picks the pair's copy grid (config `pass_pair_wide_blocks`)."""

from __future__ import annotations

from collections import deque
from statistics import median

PAIR_CHOICES = ("timed", "always")  # pass_pair_choice
PAIR_RETRY_STEPS = 8  # `always`: single-pass decode steps after a pair that gathered fewer experts than it missed
TIMED_WINDOW = 5  # step times kept per kind (the median of these decides)
MISS_WINDOW = 8  # pair choice: offered steps over which the share whose first pass missed is counted
EXPLORE_EVERY = 16  # timed: offered steps from a new preference to the first step that runs the other kind
EXPLORE_EVERY_MAX = 64  # ... doubling after each such step that left the preference as it was, up to this


class TimedChoice:
    """Two kinds of step (True, False) chosen by their wall times. Over the first offered steps it alternates, True
    first, until each kind has 3 times; then it runs the kind whose last `TIMED_WINDOW` samples have the lower
    median, and now and then one step of the other kind, so that a change of regime turns the choice:
    `EXPLORE_EVERY` offered steps after the preference was formed or turned, then at twice the distance after each
    exploring step that did not turn it, up to `EXPLORE_EVERY_MAX` (a kind that keeps losing costs less to keep
    measured).

    Per offered step: `next_kind` (counts it, returns its kind), then `start(kind)` when it runs as that kind and is
    to be timed, and `done(seconds)` after it (or `failed()`; `clear()` forgets a step that was not started)."""

    def __init__(self) -> None:
        self._seconds: dict[bool, deque[float]] = {True: deque(maxlen=TIMED_WINDOW),
                                                  False: deque(maxlen=TIMED_WINDOW)}
        self._medians: dict[bool, float | None] = {True: None, False: None}  # of `_seconds`, kept by `done`
        self._offered = 0  # steps offered so far
        self._preferred: bool | None = None  # `faster()` after the last sample
        self.explore_every = EXPLORE_EVERY  # offered steps from the last exploring step to the next
        self._explore_at = 0  # the first offered step (by `_offered`) to run the other kind
        self.sample: bool | None = None  # the kind the step under way is a sample of (None: not a sample)

    def next_kind(self) -> bool:
        """One more offered step: its kind."""
        self._offered += 1
        return self._kind_at(self._offered)

    def upcoming(self) -> bool:
        """The kind of the next offered step (the step under way counted as the sample it is)."""
        return self._kind_at(self._offered + 1, pending=self.sample)

    def start(self, kind: bool) -> None:
        """The offered step runs as `kind` and is timed."""
        if self._preferred is not None and kind != self._preferred:  # exploring
            self.explore_every = min(2 * self.explore_every, EXPLORE_EVERY_MAX)  # back to EXPLORE_EVERY if it turns
            self._explore_at = self._offered + self.explore_every
        self.sample = kind

    def clear(self) -> None:
        """No step of this choice is under way."""
        self.sample = None

    failed = clear  # the step under way raised: it is no sample

    def done(self, seconds: float) -> None:
        """After a started step: its wall time."""
        if self.sample is None:
            return
        self._record(self.sample, seconds)
        self._decide()

    def _record(self, kind: bool, seconds: float) -> None:
        self._seconds[kind].append(seconds)
        self._medians[kind] = median(self._seconds[kind])

    def _score(self, kind: bool) -> float:
        """What `faster` compares (the lower wins): the median of the kind's recent times."""
        return self._medians[kind]

    def _decide(self) -> None:
        """After a sample: form or turn the preference."""
        preferred = self.faster()
        if preferred is not None and preferred != self._preferred:  # formed or turned: explore the other soon
            self._preferred, self.explore_every = preferred, EXPLORE_EVERY
            self._explore_at = self._offered + EXPLORE_EVERY
        self.sample = None

    def medians_ms(self) -> tuple[float, float]:
        """The median wall time in ms of the recent samples of True and of False (0.0 for a kind not yet timed)."""
        return tuple(1e3 * self._medians[kind] if self._medians[kind] is not None else 0.0 for kind in (True, False))

    def faster(self) -> bool | None:
        """The kind now preferred, None while either has fewer than 3 times."""
        if len(self._seconds[True]) < 3 or len(self._seconds[False]) < 3:
            return None
        return self._score(True) <= self._score(False)

    def _kind_at(self, index: int, pending: bool | None = None) -> bool:
        """The kind of the `index`-th offered step (`pending`: a sample not yet timed)."""
        trues, falses = (len(self._seconds[kind]) + (pending is kind) for kind in (True, False))
        preferred = self.faster()
        if preferred is None or min(trues, falses) < 3:  # learning: alternate, True first
            return trues <= falses
        return (not preferred) if index >= self._explore_at else preferred


class ExpectedTimeChoice(TimedChoice):
    """The timed choice between a pass pair (True) and a single pass (False) by expected wall time. Each kind's recent
    times are kept apart by whether the step's first pass missed; `p`, the share of the last `MISS_WINDOW` offered
    steps whose first pass missed (whichever kind ran: a pair's first pass tells it too), weighs them:

        expected(kind) = (1 - p) x median(its no-miss times) + p x median(its miss times)

    (a kind with times of one outcome only: their median). A pair whose first pass missed nothing wasted a pass; a
    single pass that missed pays a fetch and a replay: which costs less depends on p. The kinds' own medians alone
    follow their last few samples: after a burst of misses (a pool warming up) they kept pairing the steps after
    isolated misses, which then rarely missed again (the trace recorded from `tierstore generate`, H200, seventeenth
    session). The schedule (learning, exploring) is `TimedChoice`'s."""

    def __init__(self) -> None:
        super().__init__()
        # kind -> first pass missed -> recent times
        self._by_outcome = {kind: {missed: deque(maxlen=TIMED_WINDOW) for missed in (False, True)}
                            for kind in (True, False)}
        self._missed: deque[bool] = deque(maxlen=MISS_WINDOW)  # offered steps: whether their first pass missed

    def done(self, seconds: float, first_missed: bool = True) -> None:
        """After a started step: its wall time and whether its first pass missed."""
        if self.sample is None:
            return
        self._by_outcome[self.sample][first_missed].append(seconds)
        self._missed.append(first_missed)
        self._record(self.sample, seconds)
        self._decide()

    def observe(self, kind: bool, seconds: float, first_missed: bool) -> None:
        """A step of `kind` that was not offered (a single pass no pair could replace): its time joins the kind's
        times of its outcome, not the schedule or `p`. Without it the single passes' no-miss times came only from
        exploring steps after a burst of misses, and the pair looked faster than a single pass that no longer
        missed."""
        self._by_outcome[kind][first_missed].append(seconds)

    def _kind_at(self, index: int, pending: bool | None = None) -> bool:
        """`TimedChoice`'s kind, except that while the preferred kind holds, the other one runs first if it has no
        time yet for an outcome that recent steps had (its expected time would be a guess: after learning on a
        cold pool every single pass sampled missed, and the pairs, with no single no-miss time to weigh against,
        kept running through a burst in which half the steps missed nothing)."""
        kind = super()._kind_at(index, pending)
        if self.faster() == kind and any(not self._by_outcome[not kind][missed] for missed in set(self._missed)):
            return not kind
        return kind

    def _score(self, kind: bool) -> float:
        hit, miss = self._by_outcome[kind][False], self._by_outcome[kind][True]
        if not hit or not miss:
            return median(hit or miss)
        p = sum(self._missed) / len(self._missed)
        return (1 - p) * median(hit) + p * median(miss)

    def expected_ms(self) -> tuple[float, float]:
        """The expected wall time in ms of a pair and of a single pass (0.0 for a kind not yet timed)."""
        return tuple(1e3 * self._score(kind) if self._seconds[kind] else 0.0 for kind in (True, False))


class PairChoice:
    """For each decode step of a runtime that can launch pairs: pair or single.

    A step is *eligible* when the runtime could launch a pair (the caller gave one, a recent pass missed). `always`
    pairs every eligible step but the `PAIR_RETRY_STEPS` decode steps after a pair whose first pass gathered fewer
    experts than it missed (spares short, rows not in the arena), which run single (the back-off). `timed` chooses
    among the eligible steps with an `ExpectedTimeChoice` (True: the pair; on the H200 at 10 % coverage before the
    seventeenth session, pairs lost by 6-8 % and their exploring steps cost 1-2 %). A pair that fell short is a slow
    sample there, not a back-off (on the H200 an isolated short pair at 50 % coverage sent 8 steps that pairs ran
    faster to single passes).

    A pair needs spares staged while the pass before it ran: `stages_next` tells that pass's read whether the next
    step is to be a pair (staging takes victims from the plan a single pass's fetch would use). Call `take` at a
    step's start and `done` after it succeeded; a step that failed is not timed."""

    def __init__(self, choice: str = "timed"):
        if choice not in PAIR_CHOICES:
            raise ValueError(f"pass_pair_choice must be one of {', '.join(PAIR_CHOICES)}, got {choice!r}")
        self.choice = choice
        self.timed = ExpectedTimeChoice()  # over eligible steps outside the back-off; `always`: it only keeps times
        self.backoff_left = 0  # decode steps the back-off still runs single

    def take(self, eligible: bool, staged: bool = True) -> bool:
        """Whether this decode step launches its pair (`staged`: spares were staged for it; a pair chosen without
        them runs single, untimed)."""
        self.timed.clear()
        if self.backoff_left:
            self.backoff_left -= 1
            return False
        if not eligible:
            return False
        timed_kind = self.timed.next_kind()
        pair = self.choice == "always" or timed_kind
        if pair and not staged:
            return False
        self.timed.start(pair)
        return pair

    def stages_next(self) -> bool:
        """At the read of a decode pass: whether the next eligible step is to be a pair (the step under way counted
        as the sample it is)."""
        if self.backoff_left:
            return False
        return self.choice == "always" or self.timed.upcoming()

    def done(self, seconds: float, gathered: int | None = None, missed: int | None = None,
             first_missed: bool = True) -> None:
        """After a step that `take` was asked about: its wall time, for a pair the experts its first pass gathered
        and missed (with `always`, fewer gathered than missed starts the back-off), and whether its first pass
        missed (`ExpectedTimeChoice`; a step that ran single without being a sample is observed as a single pass)."""
        if self.timed.sample is None and gathered is None:
            self.timed.observe(False, seconds, first_missed)
        self.timed.done(seconds, first_missed)
        if self.choice == "always" and gathered is not None and missed is not None and gathered < missed:
            self.backoff_left = PAIR_RETRY_STEPS

    def failed(self) -> None:
        """The step under way raised: it is no sample."""
        self.timed.failed()

    def medians_ms(self) -> tuple[float, float]:
        """The median wall time in ms of the recent eligible steps run as a pair and as a single pass (0.0 for a
        kind not yet timed)."""
        return self.timed.medians_ms()

    def faster(self) -> bool | None:
        """The kind the timed choice now prefers (True: the pair), None while either has fewer than 3 times."""
        return self.timed.faster()
