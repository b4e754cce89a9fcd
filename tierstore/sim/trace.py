"""Routing traces: the in-memory `Trace` and its on-disk npz format (``tierstore-trace-v1``).

An npz file holds (arrays saved without pickle):

- ``experts``    int16/int32 [tokens, layers, top_k]: routed expert ids, -1 where a slot is empty;
- ``request``    int32 [tokens]: request (prompt) index of each token, non-decreasing;
- ``meta``       0-d str: JSON with ``format`` = ``tierstore-trace-v1``, ``num_experts``, and
  optionally ``geometry`` (a preset name), ``source``;
- optional ``weights`` float32 [tokens, layers, top_k] (routing weights), ``step`` int64
  [tokens] (decode step of each token, non-decreasing: tokens of one batched step share it),
  ``confidence`` float32 [tokens] (top-1 probability of the final logits, for gate studies).

Layers are MoE layers indexed densely from 0. Keys are ``layer * num_experts + expert``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierstore.errors import TraceFormatError

FORMAT = "tierstore-trace-v1"


@dataclass
class Trace:
    experts: np.ndarray
    num_experts: int
    request: np.ndarray | None = None
    weights: np.ndarray | None = None
    step: np.ndarray | None = None
    confidence: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.experts = np.asarray(self.experts)
        if self.request is None:
            self.request = np.zeros(len(self.experts), np.int32)
        validate(self)

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def num_keys(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def num_events(self) -> int:
        """Routed (token, layer, expert) pairs."""
        return int(np.count_nonzero(self.experts >= 0))

    def keys(self) -> np.ndarray:
        """int64 [tokens, layers * top_k] dense keys, -1 where a slot is empty, layer-major."""
        layer_base = (np.arange(self.num_layers, dtype=np.int64) * self.num_experts)[None, :, None]
        keys = np.where(self.experts >= 0, self.experts.astype(np.int64) + layer_base, -1)
        return keys.reshape(self.num_tokens, -1)

    def __repr__(self) -> str:
        return (f"Trace({self.num_tokens} tokens, {self.num_layers} layers x {self.num_experts} experts, "
                f"top-{self.top_k}, {int(self.request.max(initial=-1)) + 1} requests)")


def _fail(what: str) -> None:
    raise TraceFormatError(f"trace: {what}")


def validate(trace: Trace) -> None:
    e = trace.experts
    if e.ndim != 3 or not np.issubdtype(e.dtype, np.integer):
        _fail(f"experts must be an integer array [tokens, layers, top_k], got {e.dtype} {e.shape}")
    if trace.num_experts <= 0:
        _fail(f"num_experts must be positive, got {trace.num_experts}")
    if e.size and (e.min() < -1 or e.max() >= trace.num_experts):
        _fail(f"expert ids must lie in [-1, {trace.num_experts}), got {e.min()}..{e.max()}")
    n = e.shape[0]
    for name in ("request", "step", "confidence"):
        arr = getattr(trace, name)
        if arr is not None:
            arr = np.asarray(arr)
            setattr(trace, name, arr)
            if arr.shape != (n,):
                _fail(f"{name} must have shape ({n},), got {arr.shape}")
    for name in ("request", "step"):
        arr = getattr(trace, name)
        if arr is not None and n and (not np.issubdtype(arr.dtype, np.integer) or np.any(np.diff(arr) < 0)):
            _fail(f"{name} must be a non-decreasing integer array")
    if trace.weights is not None:
        trace.weights = np.asarray(trace.weights, np.float32)
        if trace.weights.shape != e.shape:
            _fail(f"weights shape {trace.weights.shape} differs from experts shape {e.shape}")


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write `trace` as an npz file (no pickle) and return the path."""
    meta = {**trace.meta, "format": FORMAT, "num_experts": trace.num_experts}
    arrays = {"experts": trace.experts, "request": trace.request.astype(np.int32), "meta": np.array(json.dumps(meta))}
    for name in ("weights", "step", "confidence"):
        if getattr(trace, name) is not None:
            arrays[name] = getattr(trace, name)
    path = Path(path)
    with open(path, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    return path


def load_npz(path: str | Path) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise TraceFormatError(f"trace {path}: not a readable npz file ({exc})") from None
    for required in ("experts", "meta"):
        if required not in arrays:
            raise TraceFormatError(f"trace {path}: missing array {required!r}")
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"trace {path}: meta is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TraceFormatError(f"trace {path}: meta.format must be {FORMAT!r}")
    num_experts = meta.get("num_experts")
    if not isinstance(num_experts, int):
        raise TraceFormatError(f"trace {path}: meta.num_experts must be an integer")
    unknown = set(arrays) - {"experts", "request", "weights", "step", "confidence"}
    if unknown:
        raise TraceFormatError(f"trace {path}: unknown arrays {sorted(unknown)}")
    return Trace(num_experts=num_experts, meta=meta, **arrays)


def concat_traces(traces: list[Trace]) -> Trace:
    """Consecutive requests: request and step indices are renumbered to follow one another."""
    if not traces:
        raise TraceFormatError("no traces to join")
    first = traces[0]
    for t in traces[1:]:
        if (t.num_layers, t.num_experts) != (first.num_layers, first.num_experts):
            raise TraceFormatError(f"cannot join traces of {first.num_layers}x{first.num_experts} and "
                                   f"{t.num_layers}x{t.num_experts} layers x experts")
    top_k = max(t.top_k for t in traces)

    def padded(arr, fill):
        pad = top_k - arr.shape[2]
        return np.pad(arr, ((0, 0), (0, 0), (0, pad)), constant_values=fill) if pad else arr

    requests, steps, offset_r, offset_s = [], [], 0, 0
    for t in traces:
        requests.append(t.request + offset_r)
        offset_r += int(t.request.max(initial=-1)) + 1
        s = t.step if t.step is not None else np.arange(t.num_tokens, dtype=np.int64)
        steps.append(s + offset_s)
        offset_s += int(s.max(initial=-1)) + 1
    has = {name: all(getattr(t, name) is not None for t in traces) for name in ("weights", "step", "confidence")}
    return Trace(
        experts=np.concatenate([padded(t.experts, -1) for t in traces]),
        num_experts=first.num_experts,
        request=np.concatenate(requests).astype(np.int32),
        weights=np.concatenate([padded(t.weights, 0.0) for t in traces]) if has["weights"] else None,
        step=np.concatenate(steps) if has["step"] else None,
        confidence=np.concatenate([t.confidence for t in traces]) if has["confidence"] else None,
        meta={**first.meta, "source": [t.meta.get("source") for t in traces]},
    )
