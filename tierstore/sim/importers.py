"""Importers for routing logs written by other tools, and `load_trace` for any supported input.

- CSV (one file per prompt): header ``Layer ID,Batch Number,Token,Activated Expert IDs``, one row
  per token per layer, rows grouped by layer, the ids a quoted Python-style list. A token's
  position is its row order within its (layer, batch); layers numbered from 1 are shifted to 0.
- JSONL: one object per (token, layer) with ``layer``, ``token_idx`` or ``token_pos``,
  ``topk_ids`` or ``experts``, optionally ``topk_weights`` or ``gating_probs`` and ``req_id``.
  The n-th record of a given (req_id, token, layer) belongs to the n-th token of that
  position (logs that restart positions at 0 for every decode step stay in order).
"""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path

import numpy as np

from tierstore.errors import TraceFormatError
from tierstore.sim.trace import Trace, concat_traces, load_npz

CSV_HEADER = ["Layer ID", "Batch Number", "Token", "Activated Expert IDs"]


def _parse_ids(text: str, where: str) -> list[int]:
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise TraceFormatError(f"{where}: expert ids must be a bracketed list, got {text!r}")
    try:
        return [int(x) for x in body[1:-1].split(",") if x.strip()]
    except ValueError:
        raise TraceFormatError(f"{where}: expert ids must be integers, got {text!r}") from None


def _build(records, path, num_experts, layer_base, source) -> Trace:
    """records: (token_order_key, request, layer, ids, weights|None) in file order."""
    if not records:
        raise TraceFormatError(f"{path}: no routing records")
    layers = np.array([r[2] for r in records])
    base = layers.min() if layer_base == "auto" else layer_base
    if layer_base == "auto" and base not in (0, 1):
        raise TraceFormatError(f"{path}: layer numbers start at {base}; pass layer_base explicitly")
    layers = layers - base
    if layers.min() < 0:
        raise TraceFormatError(f"{path}: layer {layers.min() + base} is below layer_base {base}")
    token_ids: dict = {}
    for r in records:
        token_ids.setdefault(r[0], len(token_ids))
    top_k = max(len(r[3]) for r in records)
    experts = np.full((len(token_ids), int(layers.max()) + 1, top_k), -1, np.int32)
    has_weights = all(r[4] is not None for r in records)
    weights = np.zeros(experts.shape, np.float32) if has_weights else None
    requests = np.zeros(len(token_ids), np.int64)
    for r, layer in zip(records, layers):
        t = token_ids[r[0]]
        experts[t, layer, : len(r[3])] = r[3]
        requests[t] = r[1]
        if has_weights:
            if len(r[4]) != len(r[3]):
                raise TraceFormatError(f"{path}: {len(r[4])} weights for {len(r[3])} experts")
            weights[t, layer, : len(r[4])] = r[4]
    if np.any(np.diff(requests) < 0):
        raise TraceFormatError(f"{path}: requests interleave; records of one request must be contiguous")
    _, request = np.unique(requests, return_inverse=True)
    found = int(experts.max()) + 1
    if num_experts is not None and found > num_experts:
        raise TraceFormatError(f"{path}: expert id {found - 1} >= num_experts {num_experts}")
    return Trace(experts=experts, num_experts=num_experts or found, request=request.astype(np.int32),
                 weights=weights, meta={"source": source})


def read_csv_trace(path, num_experts: int | None = None, layer_base="auto") -> Trace:
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != CSV_HEADER:
            raise TraceFormatError(f"{path}: CSV header must be {','.join(CSV_HEADER)}, got {header}")
        position: dict[tuple[int, int], int] = {}
        records = []
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            where = f"{path}:{line_no}"
            if len(row) != 4:
                raise TraceFormatError(f"{where}: expected 4 fields, got {len(row)}")
            try:
                layer, batch = int(row[0]), int(row[1])
            except ValueError:
                raise TraceFormatError(f"{where}: Layer ID and Batch Number must be integers") from None
            pos = position.get((layer, batch), 0)
            position[(layer, batch)] = pos + 1
            records.append(((batch, pos), 0, layer, _parse_ids(row[3], where), None))
    return _build(records, path, num_experts, layer_base, f"csv:{path.name}")


def _pick(obj: dict, names: tuple[str, ...], where: str, required: bool = True):
    for name in names:
        if name in obj:
            return obj[name]
    if required:
        raise TraceFormatError(f"{where}: needs one of the keys {', '.join(names)}")
    return None


def read_jsonl_trace(path, num_experts: int | None = None, layer_base="auto") -> Trace:
    path = Path(path)
    seen: dict[tuple, int] = {}
    records = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: each line must be a JSON object")
            layer = _pick(obj, ("layer",), where)
            token = _pick(obj, ("token_idx", "token_pos"), where)
            ids = _pick(obj, ("topk_ids", "experts"), where)
            weights = _pick(obj, ("topk_weights", "gating_probs"), where, required=False)
            request = obj.get("req_id", 0)
            if not isinstance(layer, int) or not isinstance(token, int) or not isinstance(ids, list) \
                    or not all(isinstance(i, int) for i in ids):
                raise TraceFormatError(f"{where}: layer and token must be integers and experts a list of integers")
            if weights is not None and not (isinstance(weights, list) and all(isinstance(w, (int, float)) for w in weights)):
                raise TraceFormatError(f"{where}: routing weights must be a list of numbers")
            occurrence = seen.get((request, token, layer), 0)
            seen[(request, token, layer)] = occurrence + 1
            records.append(((request, occurrence, token), str(request), layer, ids, weights))
    # Requests are numbered in order of first appearance.
    order: dict[str, int] = {}
    records = [(k, order.setdefault(r, len(order)), layer, ids, w) for k, r, layer, ids, w in records]
    return _build(records, path, num_experts, layer_base, f"jsonl:{path.name}")


READERS = {".npz": lambda p, **kw: load_npz(p), ".csv": read_csv_trace, ".jsonl": read_jsonl_trace}


def _files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in READERS)
    elif any(ch in str(path) for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(path)) if Path(f).suffix in READERS)
    elif p.exists():
        files = [p]
    else:
        raise TraceFormatError(f"trace path {path} does not exist")
    if not files:
        raise TraceFormatError(f"no trace files (.npz, .csv, .jsonl) at {path}")
    return files


def load_trace(path: str | Path, num_experts: int | None = None, layer_base="auto") -> Trace:
    """Load one trace file, or every trace file of a directory or glob as consecutive requests."""
    traces = []
    for f in _files(path):
        reader = READERS.get(f.suffix)
        if reader is None:
            raise TraceFormatError(f"{f}: unknown trace format {f.suffix!r}; use .npz, .csv or .jsonl")
        traces.append(reader(f, num_experts=num_experts, layer_base=layer_base))
    if num_experts is None and len(traces) > 1:  # files may have seen different id ranges
        width = max(t.num_experts for t in traces)
        for t in traces:
            t.num_experts = width
    return traces[0] if len(traces) == 1 else concat_traces(traces)
