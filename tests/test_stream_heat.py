"""`StreamHeat` (config stream_install hotter): heat counts and halving, and `admit` against a plain reference on
random pools."""

import numpy as np
import pytest

from tierstore.runtime.stream_heat import StreamHeat


def test_heat_counts_routed_steps_and_halves():
    heat = StreamHeat(8, halving=4)
    for _ in range(3):
        heat.observe(np.array([1, 5]))
    heat.observe(np.array([5]))  # the fourth step: counted, then every heat halved
    assert heat.heat.tolist() == [0, 1, 0, 0, 0, 2, 0, 0]
    never = StreamHeat(4, halving=0)
    for _ in range(9):
        never.observe(np.array([2]))
    assert never.heat.tolist() == [0, 0, 9, 0]


def _reference(heat, candidates, free, mirror, routed, pinned):
    """Hottest candidates first into free slots, then each over the coldest eligible resident while strictly hotter."""
    order = sorted(candidates, key=lambda c: (-heat[c], candidates.index(c)))
    admitted = order[:free]
    eligible = [k for k in range(len(mirror)) if mirror[k] >= 0 and routed[k] == 0 and k not in pinned]
    coldest = sorted(eligible, key=lambda k: heat[k])
    victims = []
    for candidate, victim in zip(order[free:], coldest):
        if heat[candidate] <= heat[victim]:
            break
        admitted.append(candidate)
        victims.append(victim)
    return sorted(admitted), victims


@pytest.mark.parametrize("seed", range(40))
def test_admit_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(4, 64))
    heat = StreamHeat(total, halving=0)
    heat.heat[:] = rng.integers(0, 6, total)  # ties on purpose
    resident = rng.random(total) < 0.5
    mirror = np.where(resident, np.arange(total), -1)  # [total] slot or -1
    routed = (rng.random(total) < 0.3).astype(np.int32)  # [total]
    absent = np.flatnonzero(~resident).tolist()
    candidates = rng.permutation(absent)[: int(rng.integers(0, len(absent) + 1))].tolist()
    pinned = set(rng.choice(total, int(rng.integers(0, 3)), replace=False).tolist())
    free = int(rng.integers(0, 4))
    admitted, victims = heat.admit(candidates, free, mirror, routed, pinned)
    want_admitted, want_victims = _reference(heat.heat, candidates, free, mirror, routed, pinned)
    assert admitted == want_admitted
    # victims with equal heat are interchangeable: compare their heats, and that each is eligible and distinct
    assert sorted(heat.heat[victims].tolist()) == sorted(heat.heat[want_victims].tolist())
    assert len(set(victims)) == len(victims) == len(admitted) - min(free, len(candidates))
    assert all(mirror[v] >= 0 and routed[v] == 0 and v not in pinned for v in victims)
