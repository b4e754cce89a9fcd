"""The confidence gate: decide from a decode step's logits whether to re-run it at FP4.

Signal per logits row: `max_prob` = top-1 softmax probability, or `margin` = top1 - top2 logit
(nats). Rows aggregate by `min` (any doubtful row fires the whole batch) or a quantile. The gate
fires when the aggregate is <= tau. tau changes at runtime through `set_tau` or a watched file
(re-read when its mtime changes; a bad value is logged and ignored); a tau that can never be
reached (e.g. -1) turns the gate off.

In the runtime the signal is computed on the device right after each forward (`signal_tensor`)
and copied asynchronously to pinned host memory ahead of the pass log's read, whose
synchronisation covers it: a step under an armed gate that does not fire makes no host sync of
its own (`decide_value` on the host copy). `decide` (signal + sync) remains for callers without
that path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tierstore.errors import ConfigError
from tierstore.runtime.config import GATE_SIGNALS, RuntimeConfig, parse_gate_agg

log = logging.getLogger("tierstore.runtime")


def row_signals(logits: torch.Tensor, signal: str) -> torch.Tensor:
    """float32 [R] confidence of each row of logits [R, V] (or [V])."""
    rows = logits.reshape(-1, logits.shape[-1]).float()  # [R, V]
    if signal == "max_prob":  # one fused softmax + one reduction (logsumexp is several kernels on CUDA, ms on a busy CPU)
        return torch.softmax(rows, dim=-1).amax(dim=-1)
    if signal == "margin":
        top2 = rows.topk(2, dim=-1).values  # [R, 2]
        return top2[:, 0] - top2[:, 1]
    raise ConfigError(f"gate signal must be one of {', '.join(GATE_SIGNALS)}, got {signal!r}")


def aggregate_tensor(signals: torch.Tensor, quantile: float | None) -> torch.Tensor:
    """min over rows (quantile None) or that quantile, as a float32 [1] tensor on the signals' device (no sync)."""
    if quantile is None:
        return signals.min().reshape(1)
    return torch.quantile(signals, quantile).reshape(1)


def aggregate(signals: torch.Tensor, quantile: float | None) -> float:
    """min over rows (quantile None) or that quantile, on the host (a sync)."""
    return float(aggregate_tensor(signals, quantile))


@dataclass(frozen=True)
class GateDecision:
    signal: float
    tau: float
    fires: bool


class ConfidenceGate:
    def __init__(self, signal: str = "max_prob", tau: float | None = None, agg: str = "min",
                 tau_file: str | os.PathLike | None = None):
        if signal not in GATE_SIGNALS:
            raise ConfigError(f"gate signal must be one of {', '.join(GATE_SIGNALS)}, got {signal!r}")
        self.signal = signal
        self.quantile = parse_gate_agg(agg)
        self._tau = RuntimeConfig(gate_signal=signal, gate_tau=tau).effective_gate_tau
        self.tau_file = Path(tau_file) if tau_file else None
        self._tau_mtime: int | None = None

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> ConfidenceGate:
        return cls(config.gate_signal, config.gate_tau, config.gate_agg, config.gate_tau_file or None)

    @property
    def tau(self) -> float:
        self._poll_tau_file()
        return self._tau

    def set_tau(self, tau: float) -> None:
        """Change tau now (a later change of the watched file overrides it again)."""
        tau = float(tau)
        if tau != tau:
            raise ConfigError("gate tau must be a number, got NaN")
        self._tau = tau

    def _poll_tau_file(self) -> None:
        if self.tau_file is None:
            return
        try:
            mtime = self.tau_file.stat().st_mtime_ns
        except OSError:
            return  # no file (yet): keep the current tau
        if mtime == self._tau_mtime:
            return
        self._tau_mtime = mtime
        try:
            self.set_tau(float(self.tau_file.read_text().strip()))
            log.info("gate tau = %s (from %s)", self._tau, self.tau_file)
        except (OSError, ValueError, ConfigError) as exc:
            log.warning("gate tau file %s ignored (%s); tau stays %s", self.tau_file, exc, self._tau)

    def signal_tensor(self, logits: torch.Tensor) -> torch.Tensor:
        """The aggregated signal of logits [R, V] as float32 [1] on their device; no host sync."""
        return aggregate_tensor(row_signals(logits, self.signal), self.quantile)

    def decide_value(self, value: float) -> GateDecision:
        """Decide on an aggregated signal already on the host."""
        tau = self.tau
        return GateDecision(value, tau, value <= tau)

    def decide(self, logits: torch.Tensor) -> GateDecision:
        return self.decide_value(aggregate(row_signals(logits, self.signal), self.quantile))
