"""The confidence gate: decide from a decode step's logits whether to re-run it at FP4.

Signal per logits row: `max_prob` = top-1 softmax probability, or `margin` = top1 - top2 logit
(nats). Rows aggregate by `min` (any doubtful row fires the whole batch) or a quantile. The gate
fires when the aggregate is <= tau, or is NaN while tau >= 0 (logits with a NaN row are the most
doubtful of all: an armed gate must not read them as confident). tau changes at runtime through
`set_tau` or a watched file (re-read when its mtime changes; a bad value is logged and ignored); a
tau that can never be reached (e.g. -1) turns the gate off, NaN signals included.

In the runtime the signal is computed on the device right after each forward (`signal_tensor`)
and copied asynchronously to pinned host memory ahead of the pass log's read, whose
synchronisation covers it: a step under an armed gate that does not fire makes no host sync of
its own (`decide_value` on the host copy). `decide` (signal + sync) remains for callers without
that path. On CUDA, logits that stay at one address get their signal from a captured graph of the
same kernels (`SignalGraphs`): one launch per step instead of one per kernel; tau stays on the host.

On CUDA (with triton) the signal and the min over rows run as two Triton launches that split each row over up
to 64 programs (`tierstore.kernels.confidence`; softmax runs one program per row): max_prob there is
1 / sum_i exp(x_i - max), the same number summed in another order (within 1e-5 relative of
softmax().amax() in float32; margin and NaN rows are exact). A quantile takes torch.quantile of the kernel's
row signals. Off CUDA, and for logits the kernel does not take, `row_signals` / `aggregate_tensor`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tierstore.errors import ConfigError
from tierstore.kernels import HAS_TRITON
from tierstore.runtime.config import GATE_SIGNALS, RuntimeConfig, parse_gate_agg

if HAS_TRITON:
    from tierstore.kernels.confidence import confidence, supported

log = logging.getLogger("tierstore.runtime")

GRAPH_MAX_ELEMENTS = 1 << 20  # larger logits run eagerly: their kernels outweigh the launches
GRAPH_AFTER = 8  # calls in a row on the same logits that capture their signal (> 1 + gate_fp_max's default 3)
GRAPH_KEYS = 4  # captured logits kept, the oldest dropped first


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
    if quantile is None:  # one row: its own signal (min of one value is that value, NaN included)
        return signals.reshape(1) if signals.numel() == 1 else signals.min().reshape(1)
    return torch.quantile(signals, quantile).reshape(1)


def aggregate(signals: torch.Tensor, quantile: float | None) -> float:
    """min over rows (quantile None) or that quantile, on the host (a sync)."""
    return float(aggregate_tensor(signals, quantile))


def _on_kernel(logits: torch.Tensor) -> bool:
    """Whether the Triton signal takes these logits (CUDA, triton, a dtype and row length it supports)."""
    return logits.is_cuda and HAS_TRITON and supported(logits)


def _graphable(logits: torch.Tensor) -> bool:
    """CUDA logits of at most GRAPH_MAX_ELEMENTS, outside anyone's capture."""
    return logits.is_cuda and logits.numel() <= GRAPH_MAX_ELEMENTS and not torch.cuda.is_current_stream_capturing()


def _key(logits: torch.Tensor) -> tuple:
    return logits.data_ptr(), logits.shape, logits.stride(), logits.dtype, logits.device


class SignalGraphs:
    """`compute(logits)` on CUDA as one graph launch per call, for logits that stay where they are
    (a decoder's captured forward writes them to the same address every step).

    A graph reads the logits in place, so it is keyed by their address, shape, strides, dtype and
    device; a key gets its graph on its GRAPH_AFTER-th call in a row (a fired step's decision and
    replays on one set of logits do not capture), at most GRAPH_KEYS are kept. The graph holds the very kernels
    `compute` runs eagerly: its output is bit-identical, and overwritten by its next replay. Eager:
    logits off CUDA, above GRAPH_MAX_ELEMENTS or at a new address, calls inside someone else's
    capture, and keys whose capture failed."""

    def __init__(self, compute: Callable[[torch.Tensor], torch.Tensor]):
        self._compute = compute
        self._graphs: dict[tuple, tuple | None] = {}  # key -> (graph, output), None: capture failed
        self._last: tuple | None = None  # key of the last call without a graph
        self._repeats = 0  # calls in a row with that key

    def graphed(self, logits: torch.Tensor) -> bool:
        """Whether a call on these logits replays a captured graph."""
        return self._graphs.get(_key(logits)) is not None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not _graphable(logits):
            return self._compute(logits)
        key = _key(logits)
        if key not in self._graphs:
            self._repeats = self._repeats + 1 if key == self._last else 1
            self._last = key
            if self._repeats < GRAPH_AFTER:
                return self._compute(logits)
            self._keep(key, self._capture(logits))
        entry = self._graphs[key]
        if entry is None:
            return self._compute(logits)
        graph, out = entry
        graph.replay()
        return out

    def _keep(self, key: tuple, entry: tuple | None) -> None:
        self._graphs[key] = entry
        if len(self._graphs) > GRAPH_KEYS:
            del self._graphs[next(iter(self._graphs))]

    def _capture(self, logits: torch.Tensor) -> tuple | None:
        """(graph, output), or None (logged) when the capture fails. One eager warm-up on a side
        stream first, as torch asks; the capture itself computes nothing."""
        current = torch.cuda.current_stream(logits.device)
        side = torch.cuda.Stream(logits.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(logits.device), torch.cuda.stream(side):
                self._compute(logits)
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = self._compute(logits)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            log.warning("gate signal: CUDA graph capture failed for logits %s %s, they run eagerly (%s)",
                        tuple(logits.shape), logits.dtype, exc)
            return None
        finally:
            current.wait_stream(side)
        return graph, out


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
        self._graphs = SignalGraphs(self.eager_signal)

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

    def eager_signal(self, logits: torch.Tensor) -> torch.Tensor:
        """The aggregated signal of logits [R, V] as float32 [1] on their device, op by op; no host sync.
        On CUDA the Triton signal where it takes the logits (module doc), else `row_signals` and `aggregate_tensor`."""
        if _on_kernel(logits):
            if self.quantile is None:
                return confidence(logits, self.signal, reduce_min=True)
            return torch.quantile(confidence(logits, self.signal, reduce_min=False), self.quantile).reshape(1)
        return aggregate_tensor(row_signals(logits, self.signal), self.quantile)

    def signal_tensor(self, logits: torch.Tensor) -> torch.Tensor:
        """`eager_signal`'s value; on CUDA possibly a graph's output (`SignalGraphs`), which the
        next call on the same logits overwrites: copy it before then."""
        return self._graphs(logits)

    def signal_graphed(self, logits: torch.Tensor) -> bool:
        """Whether `signal_tensor(logits)` replays a captured CUDA graph (else it runs op by op)."""
        return self._graphs.graphed(logits)

    def decide_value(self, value: float) -> GateDecision:
        """Decide on an aggregated signal already on the host."""
        tau = self.tau
        return GateDecision(value, tau, value <= tau or (math.isnan(value) and tau >= 0))

    def decide(self, logits: torch.Tensor) -> GateDecision:
        return self.decide_value(float(self.eager_signal(logits)))
