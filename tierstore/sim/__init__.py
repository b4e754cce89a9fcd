"""Routing traces, the tier simulator and the capacity planner.

Stable calls: `load_trace(path)` and `simulate(trace, gpu_slots=N, policy="lru", **options)`.
Submodules load on first use, so importing this package stays light (numba and matplotlib load
only when a fast simulation or a plot runs).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Trace": "tierstore.sim.trace",
    "save_trace": "tierstore.sim.trace",
    "concat_traces": "tierstore.sim.trace",
    "load_trace": "tierstore.sim.importers",
    "read_csv_trace": "tierstore.sim.importers",
    "read_jsonl_trace": "tierstore.sim.importers",
    "TraceRecorder": "tierstore.sim.recorder",
    "synthetic_trace": "tierstore.sim.synthetic",
    "synthetic_for": "tierstore.sim.synthetic",
    "simulate": "tierstore.sim.simulation",
    "SimResult": "tierstore.sim.result",
    "CostModel": "tierstore.sim.cost",
    "sweep": "tierstore.sim.sweep",
    "plot_sweep": "tierstore.sim.plot",
    "plan": "tierstore.sim.planner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tierstore.sim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
