"""Which decode steps launch a pass pair (`runtime/pair_choice.py`, config `pass_pair_choice`): the timed choice
learns by trying both kinds in runs, then runs the kind whose recent samples had the lower mean and explores the
other; only a step after one of its own kind is a sample; `always`'s back-off after a pair that fell short; failed,
interrupted and backed-off steps are not timed. And the runtime with the timed choice: every step equal to the
all-resident run, both kinds run, the means in its stats and KPI line."""

from __future__ import annotations

import pytest
import torch
from test_runtime_fixtures import ToyMoE, arena_runtime, memory_source, toy_geometry

from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.pair_choice import (EXPLORE_EVERY, EXPLORE_EVERY_WIDE, PAIR_RETRY_STEPS, TIMED_MIN,
                                           TRIAL_RUN, PairChoice)

LEARNING = 2 * TRIAL_RUN * TIMED_MIN  # eligible steps until each kind has TIMED_MIN samples


def _run(choice: PairChoice, steps: int, seconds_of, eligible: bool = True) -> list[bool]:
    """`steps` decode steps, each timed `seconds_of(paired, previous kind)`; the kinds chosen."""
    kinds = []
    for _ in range(steps):
        previous = choice._last
        paired = choice.take(eligible)
        choice.done(seconds_of(paired, previous))
        kinds.append(paired)
    return kinds


def _steady(pair_s: float, single_s: float):
    return lambda paired, previous: pair_s if paired else single_s


def test_the_timed_choice_tries_both_kinds_in_runs_until_each_has_its_samples():
    choice = PairChoice("timed")
    assert choice.faster() is None and choice.recent_ms() == (0.0, 0.0)
    kinds = _run(choice, LEARNING, _steady(0.001, 0.002))
    assert kinds == ([True] * TRIAL_RUN + [False] * TRIAL_RUN) * TIMED_MIN
    assert choice.faster() is True
    assert choice.recent_ms() == pytest.approx((1.0, 2.0))
    choice = PairChoice("timed")
    _run(choice, LEARNING, _steady(0.001, 0.001))
    assert choice.faster() is True  # a tie keeps the pair


@pytest.mark.parametrize("pair_s,single_s,every", [(0.97e-3, 1.0e-3, EXPLORE_EVERY), (1.05e-3, 1.0e-3, EXPLORE_EVERY),
                                                     (0.8e-3, 1.0e-3, EXPLORE_EVERY_WIDE),
                                                     (1.3e-3, 1.0e-3, EXPLORE_EVERY_WIDE)])
def test_the_timed_choice_runs_the_faster_kind_and_explores_the_other(pair_s, single_s, every):
    """One exploring run in every EXPLORE_EVERY eligible steps, or every EXPLORE_EVERY_WIDE where the other kind is
    over 1.1x slower."""
    choice = PairChoice("timed")
    kinds = _run(choice, LEARNING + 4 * every, _steady(pair_s, single_s))
    faster = pair_s < single_s
    settled = kinds[LEARNING:]
    assert settled.count(not faster) == 4 * TRIAL_RUN
    assert choice.faster() is faster
    assert choice.recent_ms() == pytest.approx((1e3 * pair_s, 1e3 * single_s))


def test_a_step_after_a_switch_is_no_sample():
    """A single pass after a pair pays the pair's deferred host work and a pair after a single pass does not, so
    timing every step (the twelfth session's choice) would prefer pairs here; the steady costs favour singles."""
    costs = {(True, True): 1.05e-3, (False, False): 1.0e-3, (False, True): 1.6e-3, (True, False): 0.7e-3}
    choice = PairChoice("timed")
    kinds = _run(choice, LEARNING + 4 * EXPLORE_EVERY,
                 lambda paired, previous: costs[paired, previous if previous is not None else paired])
    assert choice.faster() is False
    assert choice.recent_ms() == pytest.approx((1.05, 1.0))
    assert kinds[LEARNING:].count(True) == 4 * TRIAL_RUN


def test_the_mean_decides_and_a_stall_is_left_out():
    """Pairs with the lower median and the higher mean (one in three replays twice) lose; one 50x stall among the
    singles' samples does not turn the choice."""
    pair_times = iter([0.9e-3, 0.9e-3, 1.6e-3] * 100)
    choice = PairChoice("timed")
    _run(choice, LEARNING + EXPLORE_EVERY,
         lambda paired, previous: next(pair_times) if paired else 1.0e-3)
    assert choice.faster() is False
    stalled = iter([50e-3])
    _run(choice, 3 * EXPLORE_EVERY, lambda paired, previous: 1.1e-3 if paired else next(stalled, 1.0e-3))
    assert choice.faster() is False and choice.recent_ms()[1] == pytest.approx(1.0)


def test_the_timed_choice_turns_when_the_regime_changes():
    """Pairs fast at first, then slow (say the coverage fell): within a window of samples it runs singles."""
    choice = PairChoice("timed")
    _run(choice, 40, _steady(0.8e-3, 1.0e-3))
    assert choice.faster() is True
    kinds = _run(choice, 5 * EXPLORE_EVERY, _steady(1.3e-3, 1.0e-3))
    assert choice.faster() is False and kinds[-EXPLORE_EVERY_WIDE:].count(True) <= TRIAL_RUN


def test_staging_is_asked_for_only_before_a_step_to_pair():
    """`stages_next` at each step's read names the next step's kind: while learning (the step under way counted),
    once singles are faster only before an exploring pair, never in the back-off; a pair chosen with nothing
    staged runs single and is no sample."""
    choice = PairChoice("timed")
    predicted, staged_before = None, []
    for _ in range(LEARNING + 2 * EXPLORE_EVERY):
        paired = choice.take(True)
        assert predicted is None or paired == predicted
        predicted = choice.stages_next()
        staged_before.append(predicted)
        choice.done(1.05e-3 if paired else 1e-3)
    assert choice.faster() is False
    assert sum(staged_before[LEARNING:]) == 2 * TRIAL_RUN  # one exploring run of pairs in every EXPLORE_EVERY
    choice = PairChoice("always")
    assert choice.take(True) and choice.stages_next()
    choice.done(0.002, gathered=1, missed=2)
    for step in range(PAIR_RETRY_STEPS):  # the back-off's steps do not pair; the last one's read stages
        assert not choice.take(True)
        assert choice.stages_next() == (step == PAIR_RETRY_STEPS - 1)
        choice.done(0.001)
    assert not choice.take(True, staged=False)  # its spares fell short: a single pass, not a sample
    choice.done(9.0)
    assert choice.recent_ms() == (0.0, 0.0)


def test_always_pairs_every_eligible_step_and_none_that_is_not():
    choice = PairChoice("always")
    assert _run(choice, 5, _steady(1.0, 0.001)) == [True] * 5
    assert _run(choice, 3, _steady(0.001, 0.001), eligible=False) == [False] * 3
    assert not PairChoice("timed").take(False)


def test_a_short_pair_backs_off_with_always_and_is_a_sample_with_timed():
    timed = PairChoice("timed")
    for _ in range(TRIAL_RUN):  # the first follows no step: no sample
        assert timed.take(True)
        timed.done(0.004, gathered=3, missed=5)
    assert timed.backoff_left == 0 and timed.recent_ms() == (4.0, 0.0)
    choice = PairChoice("always")
    assert choice.take(True)
    choice.done(0.002, gathered=3, missed=5)
    assert choice.backoff_left == PAIR_RETRY_STEPS
    for _ in range(PAIR_RETRY_STEPS):
        assert not choice.take(True)
        choice.done(0.5)  # not a sample
    for _ in range(2):  # the first after the back-off's single passes: no sample
        assert choice.take(True)
        choice.done(0.002, gathered=5, missed=5)  # a pair that gathered all it missed: no back-off
    assert choice.backoff_left == 0
    assert choice.recent_ms() == (2.0, 0.0)


def test_a_failed_or_interrupted_step_is_not_timed():
    """Nor is the step after it: it follows no kind."""
    choice = PairChoice("timed")
    assert choice.take(True)
    choice.done(0.001)
    assert choice.take(True)  # would be a sample
    choice.interrupted()
    choice.done(9.0)
    assert choice.recent_ms() == (0.0, 0.0)
    for seconds in (5.0, 0.002):  # the learning's singles: the first follows the interruption
        assert not choice.take(True)
        choice.done(seconds)
    assert choice.recent_ms() == (0.0, 2.0)
    with pytest.raises(ValueError, match="pass_pair_choice must be one of timed, always"):
        PairChoice("sometimes")
    with pytest.raises(ConfigError, match="pass_pair_choice must be one of timed, always"):
        RuntimeConfig(pass_pair_choice="sometimes")
    assert RuntimeConfig().pass_pair_choice == "timed"
    assert RuntimeConfig.from_env({"TIERSTORE_PASS_PAIR_CHOICE": "always"}).pass_pair_choice == "always"


def test_the_runtime_with_the_timed_choice_runs_both_kinds_and_stays_exact(monkeypatch):
    """The timed choice on a CPU runtime whose pairs are made to look slow after the learning steps: both kinds
    run, every step equals the all-resident run, and the stats and the KPI line carry the two means."""
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
    monkeypatch.setattr(choice, "done", lambda seconds, *shortfall: done(
        seconds + (1.0 if choice._timing else 0.0), *shortfall))  # every timed pair 1 s slower
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
    assert "(recent means: pair " in line
    assert len(set(stages)) <= stats.pair_steps + 3  # steps staging spares for a next one: before the pairs only
