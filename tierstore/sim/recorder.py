"""`TraceRecorder`: the runtime appends each decode step's routing; `trace()` / `save()` give a Trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tierstore.errors import TraceFormatError
from tierstore.sim.trace import Trace, save_trace


class TraceRecorder:
    def __init__(self, num_layers: int, top_k: int, num_experts: int, **meta) -> None:
        self.shape = (num_layers, top_k)
        self.num_experts = num_experts
        self.meta = meta
        self._experts: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._confidence: list[np.ndarray] = []
        self._request: list[int] = []
        self._step: list[int] = []
        self._next_step = 0
        self._current_request = 0

    def new_request(self) -> None:
        """Tokens recorded from now on belong to a new request."""
        if self._request and self._request[-1] == self._current_request:
            self._current_request += 1

    def record_step(self, experts, weights=None, confidence=None) -> None:
        """One decode step: `experts` [tokens, layers, top_k] (or [layers, top_k] for one token)."""
        experts = np.asarray(experts)
        if experts.ndim == 2:
            experts = experts[None]
        if experts.shape[1:] != self.shape:
            raise TraceFormatError(f"recorder: step routing shape {experts.shape[1:]} != (layers, top_k) {self.shape}")
        tokens = experts.shape[0]
        if (weights is None) != (not self._weights) and self._experts:
            raise TraceFormatError("recorder: routing weights must be given for every step or for none")
        if (confidence is None) != (not self._confidence) and self._experts:
            raise TraceFormatError("recorder: confidence must be given for every step or for none")
        self._experts.append(experts.astype(np.int32))
        if weights is not None:
            self._weights.append(np.asarray(weights, np.float32).reshape(experts.shape))
        if confidence is not None:
            self._confidence.append(np.asarray(confidence, np.float32).reshape(tokens))
        self._request.extend([self._current_request] * tokens)
        self._step.extend([self._next_step] * tokens)
        self._next_step += 1

    def trace(self) -> Trace:
        if not self._experts:
            raise TraceFormatError("recorder: nothing recorded")
        return Trace(
            experts=np.concatenate(self._experts),
            num_experts=self.num_experts,
            request=np.asarray(self._request, np.int32),
            step=np.asarray(self._step, np.int64),
            weights=np.concatenate(self._weights) if self._weights else None,
            confidence=np.concatenate(self._confidence) if self._confidence else None,
            meta={"source": "recorder", **self.meta},
        )

    def save(self, path: str | Path) -> Path:
        return save_trace(self.trace(), path)
