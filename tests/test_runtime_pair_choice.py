"""Which decode steps launch a pass pair (`runtime/pair_choice.py`, config `pass_pair_choice`): the timed choice
learns by alternating, then runs the kind whose recent steps were faster and explores the other, weighing each kind's
times with and without a first-pass miss by how often recent first passes missed; `always`'s back-off
after a pair that fell short; failed and backed-off steps are not timed. And the runtime with the timed choice: every
step equal to the all-resident run, both kinds run, the medians in its stats and KPI line."""

from __future__ import annotations

import pytest
import torch
from test_runtime_fixtures import ToyMoE, arena_runtime, memory_source, toy_geometry

from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.pair_choice import (EXPLORE_EVERY, EXPLORE_EVERY_MAX, MISS_WINDOW, PAIR_RETRY_STEPS,
                                           TIMED_WINDOW, ExpectedTimeChoice, PairChoice, TimedChoice)


def _run(choice: PairChoice, steps: int, seconds_of, eligible: bool = True) -> list[bool]:
    """`steps` eligible decode steps, each timed `seconds_of(paired)`; the kinds chosen."""
    kinds = []
    for _ in range(steps):
        paired = choice.take(eligible)
        choice.done(seconds_of(paired))
        kinds.append(paired)
    return kinds


PAIR_MS, SINGLE_HIT_MS, SINGLE_MISS_MS = 0.76, 0.39, 0.98  # the recorded trace at qwen3-30b-a3b 50 % (H200)


def _outcome_run(choice: TimedChoice, steps: int, misses: bool) -> list[bool]:
    """`steps` offered steps whose first pass missed (`misses`) or not, timed like the recorded trace's."""
    kinds = []
    for _ in range(steps):
        paired = choice.next_kind()
        choice.start(paired)
        ms = PAIR_MS if paired else SINGLE_MISS_MS if misses else SINGLE_HIT_MS
        if isinstance(choice, ExpectedTimeChoice):
            choice.done(ms / 1e3, first_missed=misses)
        else:
            choice.done(ms / 1e3)
        kinds.append(paired)
    return kinds


def test_pairs_win_while_first_passes_miss_and_lose_once_they_stop():
    choice, by_medians = ExpectedTimeChoice(), TimedChoice()  # the second: the kinds' own medians alone
    for timed in (choice, by_medians):
        _outcome_run(timed, 12, misses=True)  # a burst of misses (a pool warming up): a pair beats a miss + replay
        assert timed.faster() is True
    steps = MISS_WINDOW + 2 * EXPLORE_EVERY
    kinds = _outcome_run(choice, steps, misses=False)  # isolated misses after it: eligible steps no longer miss
    assert choice.faster() is False  # a pair's second pass is now wasted
    assert sum(kinds[-EXPLORE_EVERY:]) <= 1  # single passes, but for an exploring pair
    # the medians alone keep pairing much longer: the singles' last five times are the burst's misses
    assert sum(_outcome_run(by_medians, steps, misses=False)) > sum(kinds) + EXPLORE_EVERY


def test_single_passes_outside_the_choice_give_the_no_miss_time_and_turn_it_soon():
    choice = PairChoice("timed")
    for _ in range(12):  # a burst of misses: every step eligible, pairs win
        paired = choice.take(True)
        choice.done((PAIR_MS if paired else SINGLE_MISS_MS) / 1e3, *((1, 1) if paired else ()), first_missed=True)
    assert choice.faster() is True
    kinds = []
    for _ in range(6):  # then isolated misses: 9 steps no pair could replace, then one eligible that misses not
        for _ in range(9):
            assert not choice.take(False)
            choice.done(SINGLE_HIT_MS / 1e3, first_missed=False)
        paired = choice.take(True)
        choice.done((PAIR_MS if paired else SINGLE_HIT_MS) / 1e3, *((0, 0) if paired else ()), first_missed=False)
        kinds.append(paired)
    assert choice.faster() is False and kinds[-2:] == [False, False], kinds  # within a few eligible steps


def test_a_kind_without_a_time_for_an_outcome_recent_steps_had_runs_next():
    choice = ExpectedTimeChoice()
    _outcome_run(choice, 8, misses=True)  # learned on misses only: pairs preferred, no single no-miss time
    assert choice.faster() is True and choice.next_kind() is True
    choice.start(True)
    choice.done(PAIR_MS / 1e3, first_missed=False)  # a pair whose first pass missed nothing
    assert choice.next_kind() is False  # a single pass now: its no-miss time is unknown
    choice.start(False)
    choice.done(SINGLE_HIT_MS / 1e3, first_missed=False)
    assert choice.faster() is True and choice.next_kind() is True  # measured: the expected times decide again


def test_the_expected_time_weighs_each_outcome_by_the_recent_share_of_misses():
    choice = ExpectedTimeChoice()
    for kind, missed, ms in [(True, True, 0.8), (False, True, 1.0), (True, False, 0.7), (False, False, 0.4),
                             (True, True, 0.8), (False, False, 0.4), (True, False, 0.7), (False, False, 0.4)]:
        choice.start(kind)
        choice.done(ms / 1e3, first_missed=missed)
    p = 3 / 8  # three of the eight offered steps missed
    want = ((1 - p) * 0.7 + p * 0.8, (1 - p) * 0.4 + p * 1.0)
    assert choice.expected_ms() == pytest.approx(want)
    assert choice.faster() is False
    lone = ExpectedTimeChoice()  # one outcome only: its median
    for ms in (0.5, 0.9, 0.6):
        lone.start(True)
        lone.done(ms / 1e3, first_missed=False)
    assert lone.expected_ms() == pytest.approx((0.6, 0.0))


def test_the_timed_choice_alternates_until_both_kinds_have_three_times():
    choice = PairChoice("timed")
    assert choice.faster() is None and choice.medians_ms() == (0.0, 0.0)
    assert _run(choice, 6, lambda paired: 0.001) == [True, False] * 3
    assert choice.faster() is True  # a tie keeps the pair


@pytest.mark.parametrize("pair_s,single_s", [(0.97e-3, 1.0e-3), (1.05e-3, 1.0e-3), (0.8e-3, 1.0e-3), (1.3e-3, 1.0e-3)])
def test_the_timed_choice_runs_the_faster_kind_and_explores_the_other_less_and_less(pair_s, single_s):
    """The other kind runs EXPLORE_EVERY eligible steps after the preference formed, then at twice the distance
    after each exploring step that left it as it was, up to EXPLORE_EVERY_MAX."""
    choice = PairChoice("timed")
    kinds = _run(choice, 6 + 16 * EXPLORE_EVERY, lambda paired: pair_s if paired else single_s)
    faster = pair_s < single_s
    exploring = [index for index, kind in enumerate(kinds) if index >= 6 and kind is not faster]
    distances = [b - a for a, b in zip([5] + exploring, exploring)]  # the preference formed at the 6th step
    assert distances == [EXPLORE_EVERY, 2 * EXPLORE_EVERY] + [EXPLORE_EVERY_MAX] * (len(distances) - 2)
    assert len(distances) >= 4
    assert choice.faster() is faster
    assert choice.medians_ms() == pytest.approx((1e3 * pair_s, 1e3 * single_s))


def test_an_exploring_step_that_turns_the_choice_starts_the_distances_over():
    """Singles faster until the pairs' exploring steps get fast: once the pairs' median is the lower, singles are
    explored EXPLORE_EVERY steps on, not EXPLORE_EVERY_MAX."""
    choice = PairChoice("timed")
    pair_s = [1.3e-3]
    kinds = _run(choice, 6 + EXPLORE_EVERY + 2 * EXPLORE_EVERY + 3 * EXPLORE_EVERY_MAX,
                 lambda paired: pair_s[0] if paired else 1.0e-3)
    assert choice.faster() is False and choice.timed.explore_every == EXPLORE_EVERY_MAX
    pair_s[0] = 0.8e-3
    turned = []
    while choice.faster() is False:  # three fast exploring pairs turn the median of five
        turned += _run(choice, 1, lambda paired: pair_s[0] if paired else 1.0e-3)
    assert turned.count(True) == 3
    after = _run(choice, EXPLORE_EVERY, lambda paired: pair_s[0] if paired else 1.0e-3)
    assert after == [True] * (EXPLORE_EVERY - 1) + [False]


def test_the_timed_choice_turns_when_the_regime_changes():
    """Pairs fast at first, then slow (say the coverage fell): within a window of exploring steps it runs singles."""
    choice = PairChoice("timed")
    _run(choice, 40, lambda paired: 0.8e-3 if paired else 1.0e-3)
    assert choice.faster() is True
    kinds = _run(choice, 5 * EXPLORE_EVERY, lambda paired: 1.3e-3 if paired else 1.0e-3)
    assert choice.faster() is False and kinds[-2 * EXPLORE_EVERY:].count(True) <= 1


def test_staging_is_asked_for_only_before_a_step_to_pair():
    """`stages_next` at each step's read names the next step's kind: while learning (the step under way counted),
    once singles are faster only before an exploring step, never in the back-off; a pair chosen with nothing
    staged runs single and untimed."""
    choice = PairChoice("timed")
    for _ in range(6):
        paired = choice.take(True)
        predicted = choice.stages_next()
        choice.done(1.05e-3 if paired else 1e-3)
        assert choice.take(True) == predicted
        choice.done(1.05e-3 if predicted else 1e-3)
    staged_before, kinds = [], []
    for _ in range(EXPLORE_EVERY + 2 * EXPLORE_EVERY_MAX):
        kinds.append(choice.take(True))
        staged_before.append(choice.stages_next())
        choice.done(1.05e-3 if kinds[-1] else 1e-3)
    assert staged_before[:-1] == kinds[1:]  # each read named the next step's kind
    assert sum(kinds) == 3  # the exploring pairs, EXPLORE_EVERY, then 2 x and 4 x that apart
    choice = PairChoice("always")
    assert choice.take(True) and choice.stages_next()
    choice.done(0.002, gathered=1, missed=2)
    for step in range(PAIR_RETRY_STEPS):  # the back-off's steps do not pair; the last one's read stages
        assert not choice.take(True)
        assert choice.stages_next() == (step == PAIR_RETRY_STEPS - 1)
        choice.done(0.001)
    assert not choice.take(True, staged=False)  # its spares fell short: a single pass, not a sample
    choice.done(9.0)
    assert choice.medians_ms() == (2.0, 0.0)


def test_always_pairs_every_eligible_step_and_none_that_is_not():
    choice = PairChoice("always")
    assert _run(choice, 5, lambda paired: 1.0 if paired else 0.001) == [True] * 5
    assert _run(choice, 3, lambda paired: 0.001, eligible=False) == [False] * 3
    assert not PairChoice("timed").take(False)


def test_a_short_pair_backs_off_with_always_and_is_a_sample_with_timed():
    timed = PairChoice("timed")
    assert timed.take(True)
    timed.done(0.004, gathered=3, missed=5)
    assert timed.backoff_left == 0 and timed.medians_ms() == (4.0, 0.0)
    choice = PairChoice("always")
    assert choice.take(True)
    choice.done(0.002, gathered=3, missed=5)
    assert choice.backoff_left == PAIR_RETRY_STEPS
    for _ in range(PAIR_RETRY_STEPS):
        assert not choice.take(True)
        choice.done(0.5)  # not a sample
    assert choice.take(True)
    choice.done(0.002, gathered=5, missed=5)  # a pair that gathered all it missed: no back-off
    assert choice.backoff_left == 0
    assert choice.medians_ms() == (2.0, 0.0)


def test_a_failed_step_is_not_timed():
    choice = PairChoice("timed")
    assert choice.take(True)
    choice.failed()
    choice.done(9.0)
    assert choice.medians_ms() == (0.0, 0.0)
    with pytest.raises(ValueError, match="pass_pair_choice must be one of timed, always"):
        PairChoice("sometimes")
    with pytest.raises(ConfigError, match="pass_pair_choice must be one of timed, always"):
        RuntimeConfig(pass_pair_choice="sometimes")
    assert RuntimeConfig().pass_pair_choice == "timed"
    assert RuntimeConfig.from_env({"TIERSTORE_PASS_PAIR_CHOICE": "always"}).pass_pair_choice == "always"


def test_the_runtime_with_the_timed_choice_runs_both_kinds_and_stays_exact(monkeypatch):
    """The timed choice on a CPU runtime whose pairs are made to look slow after the learning steps: both kinds
    run, every step equals the all-resident run, and the stats and the KPI line carry the two medians."""
    g = toy_geometry(layers=4, experts=16)
    model = ToyMoE(g, seed=3)
    resident = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts,
                             config=RuntimeConfig(kpi_every=0))
    resident.preload()
    small, _ = arena_runtime(g, 24, "all", pass_pair=True)
    choice = small._pair_choice
    done, stage = choice.done, small._stage_spares
    stages = []
    monkeypatch.setattr(small, "_stage_spares", lambda: (stages.append(len(kinds)), stage()))  # the step it ran in
    monkeypatch.setattr(choice, "done", lambda seconds, *shortfall, **outcome: done(
        seconds + (1.0 if choice.timed.sample else 0.0), *shortfall, **outcome))  # every timed pair 1 s slower
    kinds = []
    with resident, small:
        for step in range(40):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            forward = lambda: model.forward(small, x)  # noqa: E731
            before = small.stats().pair_steps
            got, _ = small.step(forward, lambda: None, forward_pair=small.pass_pair(forward, lambda: None))
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            kinds.append(small.stats().pair_steps > before)
        stats = small.stats()
        line = small.kpi_line()
    assert choice.faster() is False
    assert 3 <= stats.pair_steps < 10, kinds  # the learning pairs and the exploring ones
    assert stats.pair_step_ms > 1000 > stats.single_step_ms > 0
    assert "(recent medians: pair " in line
    assert len(set(stages)) <= stats.pair_steps + 3  # steps staging spares for a next one: before the pairs only
