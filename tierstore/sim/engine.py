"""Reference simulator: replays steps through GPU base pool, FP4 pool and host arena with
pluggable policy objects (the same classes the runtime uses).

Per step: every routed key is looked up against the state at step start (FP4 pool first, then
the base pool); hits are accessed in routed order; then the misses are fetched as one batch
(arena row if resident, else a pack read that also enters the arena) and inserted into the base
pool, evicting only keys the step does not use. If the confidence gate fires, the step's routed
keys are force-promoted to FP4 (and the step replays). Lazy FP4 promotion (every policy but
`need`) promotes up to `fp4_promote_per_step` of the step's routed non-FP4 keys, hottest first
by decayed routing frequency; into a full pool only when hotter than the policy's victim
(`freq`) or unconditionally (other policies).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tierstore.cache.policies.decay import DecayedCounter
from tierstore.cache.policy import EvictionPolicy, get_policy
from tierstore.sim.pool import SlotPool
from tierstore.sim.result import empty_counters
from tierstore.sim.steps import StepKeys


def policy_factory(name: str | Callable[[], EvictionPolicy], params: dict | None, steps: StepKeys) -> Callable[[], EvictionPolicy]:
    """A zero-argument constructor; `belady` is given the trace's future, `static-hot` a profile
    of the whole trace unless one is passed."""
    if callable(name):
        return name
    params = dict(params or {})
    if name == "belady" and "future" not in params:
        params["future"] = [steps.step(s)[0] for s in range(steps.num_steps)]
    if name == "static-hot" and "profile" not in params:
        counts = np.bincount(steps.keys, weights=steps.counts)
        params["profile"] = {int(k): float(v) for k, v in enumerate(counts) if v}
    get_policy(name, **params)  # fail early on a bad name or parameters
    return lambda: get_policy(name, **params)


class TierEngine:
    def __init__(self, steps: StepKeys, num_layers: int, num_experts: int, *, gpu_slots: int, policy="lru",
                 policy_params=None, pool="global", fp4_slots=0, fp4_policy="freq", fp4_params=None,
                 fp4_promote_per_step=8, fp4_half_life=256.0, gate_tau=None, confidence=None,
                 fp4_force_budget=None, arena_slots=None, arena_policy="lru") -> None:
        self.steps = steps
        self.num_experts = num_experts
        make = policy_factory(policy, policy_params, steps)
        if pool == "global":
            self.pools = [SlotPool(gpu_slots, make())]
        elif pool == "per-layer":
            self.pools = [SlotPool(gpu_slots // num_layers, make()) for _ in range(num_layers)]
        else:
            raise ValueError(f"pool must be 'global' or 'per-layer', got {pool!r}")
        self.per_layer = pool == "per-layer"
        self.fp4 = SlotPool(fp4_slots, policy_factory(fp4_policy, fp4_params, steps)()) if fp4_slots else None
        self.fp4_lazy = fp4_policy != "need"
        self.fp4_promote = fp4_promote_per_step
        self.heat = DecayedCounter(fp4_half_life)
        self.gate_tau = gate_tau
        self.confidence = confidence
        if gate_tau is not None and (confidence is None or self.fp4 is None):
            raise ValueError("the confidence gate needs an FP4 pool (fp4_slots > 0) and a trace with confidence")
        self.force_budget = fp4_force_budget
        self.arena = (SlotPool(arena_slots, policy_factory(arena_policy, None, steps)()) if arena_slots is not None
                      else None)

    def _pool(self, key: int) -> SlotPool:
        return self.pools[key // self.num_experts] if self.per_layer else self.pools[0]

    def _policies(self):
        yield from (p.policy for p in self.pools)
        if self.fp4 is not None:
            yield self.fp4.policy
        if self.arena is not None:
            yield self.arena.policy

    def run(self) -> dict[str, np.ndarray]:
        c = empty_counters(self.steps.num_steps)
        c["tokens"][:] = self.steps.tokens_per_step
        for s in range(self.steps.num_steps):
            keys, counts = self.steps.step(s)
            keys = [int(k) for k in keys]
            exclude = frozenset(keys)
            for policy in self._policies():
                policy.begin_step(s)
            for pool in self.pools:
                pool.policy.observe(k for k in keys if self._pool(k) is pool)
            if self.fp4 is not None:
                self.fp4.policy.observe(keys)
            c["pairs"][s] = counts.sum()
            missing = []
            for key, n in zip(keys, counts):
                if self.fp4 is not None and key in self.fp4:
                    self.fp4.policy.on_access(key)
                    c["fp4_pairs"][s] += n
                    c["fp4_keys"][s] += 1
                elif key in self._pool(key):
                    self._pool(key).policy.on_access(key)
                    c["base_keys"][s] += 1
                else:
                    missing.append(key)
                    continue
                c["hit_pairs"][s] += n
            c["miss_keys"][s] = len(missing)
            if self.arena is not None:  # the keys the arena is asked for (a frequency policy counts them)
                self.arena.policy.observe(missing)
            c["base_keys"][s] += len(missing)
            for key in missing:
                if self.arena is not None:
                    if key in self.arena:
                        self.arena.policy.on_access(key)
                        c["arena_rows"][s] += 1
                    else:
                        self.arena.insert(key, exclude)
                self._pool(key).insert(key, exclude)
            if self.arena is None:
                c["arena_rows"][s] = len(missing)
            if self.fp4 is not None:
                self._fp4_step(s, keys, exclude, c)
        return c

    def _fp4_step(self, s, keys, exclude, c) -> None:
        for key in keys:
            self.heat.add(key, s)
        if self.gate_tau is not None and self.confidence[s] <= self.gate_tau:
            c["fired"][s] = 1
            record = getattr(self.fp4.policy, "record_need", None)
            if record is not None:
                record(keys)
            wanted = [k for k in keys if k not in self.fp4][: self.force_budget]
            for key in wanted:
                self.fp4.insert(key, exclude)
            c["forced_rows"][s] = len(wanted)
        if not self.fp4_lazy:
            return
        candidates = sorted((k for k in keys if k not in self.fp4), key=lambda k: -self.heat.value(k, s))
        for key in candidates[: self.fp4_promote]:
            if len(self.fp4) >= self.fp4.capacity:
                victim = self.fp4.policy.victim(exclude)
                if victim is None:
                    break
                heat_of = getattr(self.fp4.policy, "heat", None)
                if heat_of is not None and heat_of(victim) >= self.heat.value(key, s):
                    break
            self.fp4.insert(key, exclude)
            c["promoted_rows"][s] += 1
