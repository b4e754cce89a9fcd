"""The confidence gate's signal, aggregation, tau (API and watched file) and its config knobs."""

from __future__ import annotations

import os

import pytest
import torch

from tierstore.errors import ConfigError
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.gate import ConfidenceGate, aggregate, row_signals


def test_max_prob_is_the_top1_softmax_probability_and_margin_the_top2_gap():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.25, 3.0]])
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(row_signals(logits, "max_prob"), probs.max(dim=-1).values)
    torch.testing.assert_close(row_signals(logits, "margin"), torch.tensor([2.0, 2.5]))
    assert row_signals(logits[0], "margin").shape == (1,)  # a single [V] row
    with pytest.raises(ConfigError, match="gate signal"):
        row_signals(logits, "entropy")


def test_min_fires_on_any_doubtful_row_and_a_quantile_ignores_outliers():
    signals = torch.tensor([0.9, 0.95, 0.2, 0.99])
    assert aggregate(signals, None) == pytest.approx(0.2)
    assert aggregate(signals, 0.5) == pytest.approx(0.925)
    confident, doubtful = torch.tensor([[9.0, 0.0]]), torch.tensor([[0.1, 0.0]])
    gate = ConfidenceGate("max_prob")
    assert gate.tau == 0.60 and not gate.decide(confident).fires and gate.decide(doubtful).fires
    assert gate.decide(torch.cat([confident, doubtful])).fires
    assert not ConfidenceGate("max_prob", agg="q:0.9").decide(torch.cat([confident, confident, doubtful])).fires


def test_defaults_per_signal_and_a_tau_that_never_fires():
    assert ConfidenceGate("margin").tau == 1.5
    gate = ConfidenceGate("max_prob", tau=-1.0)
    assert not gate.decide(torch.zeros(1, 8)).fires  # uniform logits: the least confident a row can be
    gate.set_tau(1.0)
    assert gate.decide(torch.tensor([[50.0, 0.0]])).fires  # max_prob <= 1 always
    with pytest.raises(ConfigError):
        gate.set_tau(float("nan"))


@pytest.mark.parametrize("signal", ["max_prob", "margin"])
def test_a_nan_row_fires_an_armed_gate_and_not_one_turned_off(signal):
    logits = torch.tensor([[9.0, 0.0], [float("nan"), 0.0]])  # one confident row, one NaN row
    armed = ConfidenceGate(signal)
    assert armed.decide(logits[:1]).fires is False and armed.decide(logits).fires is True
    assert armed.decide_value(float("nan")).fires is True
    assert ConfidenceGate(signal, tau=0.0).decide_value(float("nan")).fires is True
    assert ConfidenceGate(signal, tau=-1.0).decide(logits).fires is False


def test_tau_file_is_reread_when_it_changes_and_bad_values_are_ignored(tmp_path):
    path = tmp_path / "tau"
    gate = ConfidenceGate("max_prob", tau_file=path)
    assert gate.tau == 0.60  # no file yet
    path.write_text("0.75\n")
    assert gate.tau == 0.75
    path.write_text("not a number")
    os.utime(path, ns=(1, 10**9))
    assert gate.tau == 0.75
    path.write_text("0.3")
    os.utime(path, ns=(2, 2 * 10**9))
    assert gate.tau == 0.3
    gate.set_tau(0.5)
    assert gate.tau == 0.5  # the API wins until the file changes again


def test_gate_knobs_validate_and_read_the_environment():
    config = RuntimeConfig.from_env({"TIERSTORE_GATE": "1", "TIERSTORE_GATE_TAU": "0.7", "TIERSTORE_GATE_AGG": "q:0.25",
                                     "TIERSTORE_FP4_POOL_GB": "auto", "TIERSTORE_FP4_POLICY": "need"})
    assert (config.gate, config.gate_tau, config.gate_agg, config.fp4_pool_gb, config.fp4_policy) == \
        (True, 0.7, "q:0.25", "auto", "need")
    assert RuntimeConfig(gate_signal="margin").effective_gate_tau == 1.5
    for bad in (dict(gate_signal="entropy"), dict(gate_agg="q:2"), dict(gate_agg="max"), dict(fp4_pool_gb="-1"),
                dict(fp4_pool_gb="lots"), dict(gate_fp_max=0), dict(gate_budget=-1), dict(fp4_half_life_s=0.0)):
        with pytest.raises(ConfigError):
            RuntimeConfig(**bad)
    with pytest.raises(ConfigError, match="TIERSTORE_GATE_TAU"):
        RuntimeConfig.from_env({"TIERSTORE_GATE_TAU": "high"})
