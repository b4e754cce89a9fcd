"""Which experts a pass streamed from the arena are worth a slot (config `stream_install` hotter).

With `stream_arena` an expert without a slot costs a pass its row over the bus, and installing it costs the bus the
same bytes once more. `StreamHeat` keeps each expert's heat (the decode steps that routed it, resident or not,
halved every `halving` steps so that a change of regime shows) and admits a streamed expert only into a free slot
or over a colder resident one: a row then crosses the bus a second time only where it is expected to save more
streaming than the expert it displaces. On the H200 with the trace recorded from `tierstore generate` this installed
0.17-0.55 rows per steady step where installing every streamed expert over LRU victims installed 0.17-11.3, and fewer
rows were streamed (docs/runtime-history.md, "Streamed installs under the next pass, only the hotter experts").
"""

from __future__ import annotations

from collections.abc import Set

import numpy as np


class StreamHeat:
    def __init__(self, total_experts: int, halving: int):
        self.heat = np.zeros(total_experts, dtype=np.int32)  # [L * E] by key id
        self._halving = halving
        self._steps = 0

    def observe(self, routed_ids: np.ndarray) -> None:
        """One decode step's routed key ids (distinct)."""
        self.heat[routed_ids] += 1
        self._steps += 1
        if self._halving and self._steps % self._halving == 0:
            self.heat >>= 1

    def admit(self, candidates: list[int], free: int, mirror: np.ndarray, routed: np.ndarray,
              pinned: Set[int]) -> tuple[list[int], list[int]]:
        """(admitted key ids ascending, victims) for streamed experts `candidates` (distinct, not resident): the
        hottest `free` take free slots; each next hottest displaces the coldest resident expert (`mirror` >= 0,
        int [L * E] slot or -1) that the pass did not route (`routed` == 0, its counts [L * E]) and that is not
        pinned, while it is strictly hotter. Victims pair with the admitted ids beyond the free slots in no
        particular order (any free slot or victim slot takes any row)."""
        heat = self.heat
        order = sorted(candidates, key=lambda key_id: -heat[key_id])
        admitted, rest = order[:free], order[free:]
        victims: list[int] = []
        if rest:
            eligible = np.flatnonzero((mirror >= 0) & (routed == 0))  # [n] resident, outside the pass
            if pinned:
                eligible = eligible[~np.isin(eligible, np.fromiter(pinned, dtype=np.int64))]
            count = min(len(rest), len(eligible))
            if count:
                if count < len(eligible):
                    eligible = eligible[np.argpartition(heat[eligible], count - 1)[:count]]
                coldest = eligible[np.argsort(heat[eligible], kind="stable")].tolist()
                for candidate, victim in zip(rest, coldest):
                    if heat[candidate] <= heat[victim]:
                        break
                    admitted.append(candidate)
                    victims.append(victim)
        return sorted(admitted), victims
