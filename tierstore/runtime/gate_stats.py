"""Counters of the confidence gate and the JSONL dump of its fires."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tierstore.runtime.gated_step import FireRecord


@dataclass(frozen=True)
class GateStats:
    steps: int  # decode steps the gate decided on
    fired: int
    replays: int
    promoted: int
    unconverged: int  # fired steps whose final pass still routed W2 experts

    @property
    def fire_rate(self) -> float:
        return self.fired / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["fire_rate"] = self.fire_rate
        return out


class GateRecorder:
    def __init__(self, dump_path: str | Path | None = None):
        self.steps = self.fired = self.replays = self.promoted = self.unconverged = 0
        self.dump_path = Path(dump_path) if dump_path else None

    def add(self, step: int, record: FireRecord | None) -> None:
        self.steps += 1
        if record is None:
            return
        self.fired += 1
        self.replays += record.replays
        self.promoted += record.promoted
        self.unconverged += not record.converged
        if self.dump_path is not None:
            with self.dump_path.open("a") as out:
                out.write(json.dumps({"step": step, **record.as_dict()}) + "\n")

    def snapshot(self) -> GateStats:
        return GateStats(self.steps, self.fired, self.replays, self.promoted, self.unconverged)
