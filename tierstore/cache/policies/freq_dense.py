"""`freq`'s eviction order kept in dense arrays: evict the key routed least, recently.

Every routed pair counts (resident or not, via `observe`), decayed with `half_life` in the time unit of
`begin_step(now)`, and the counts survive eviction; ties go to the older last insert or hit (no two resident keys
share one). The order is `freq`'s: the counts here are decayed all at once at each `begin_step`, there one key at a
time when read, which is the same sum (bit for bit where every decay factor is a power of two, e.g. `half_life` 1
and whole-number times; within rounding otherwise). What differs is the cost: the hooks and the order are numpy
operations over arrays indexed by key, so a pool of a thousand experts is ordered in tens of microseconds, where
`freq` sorts Python tuples. The order is kept between calls: a call re-sorts only the keys whose count, touch or
residency changed since the last (merged into the rest in one pass), checks that the result is sorted, and sorts
everything afresh where it is not (a decay that made two counts equal). Keys are dense ints (`expert_key`); the arrays grow to the largest key seen. Time must
not go back: a `begin_step` earlier than the last one decays nothing (where `freq` would grow the counts).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from tierstore.cache.policy import _EMPTY, EvictionPolicy, register_policy

_GROWTH = 1024  # keys of room added at a time past the largest key seen
_MERGE_FROM = 256  # resident keys above which a new order merges into the last (below, a fresh sort is as cheap)
_MERGE_SHARE = 2  # ... while fewer than 1 in this many resident keys changed since (half)
_HEAD = 256  # victims turned into a Python list before the rest is (callers usually take the first few)


@register_policy("freq-dense")
class DenseFrequencyPolicy(EvictionPolicy):
    name = "freq-dense"
    filtered_order = True  # eviction_order(exclude) is eviction_order() less `exclude`

    def __init__(self, half_life: float = 256.0) -> None:
        super().__init__()
        if not half_life > 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = float(half_life)
        self._heat = np.zeros(0, dtype=np.float64)  # [K] decayed routed counts as of `_stamp`
        self._touch = np.zeros(0, dtype=np.int64)  # [K] clock of the last insert or hit (resident keys)
        self._resident = np.zeros(0, dtype=bool)  # [K]
        self._changed = np.zeros(0, dtype=bool)  # [K] count, touch or residency changed since `_order` was taken
        self._clock = 0
        self._stamp: float | None = None  # the time `_heat` is decayed to
        self._order: np.ndarray | None = None  # [R] the resident keys by (heat, touch), as of the last order taken
        self._decayed = False  # the heats were scaled since `_order` was taken

    # --- the arrays ----------------------------------------------------------------------
    def _room(self, top: int) -> None:
        """Arrays long enough to index key `top`."""
        if top >= len(self._heat):
            size = top + 1 + _GROWTH
            self._heat = np.concatenate([self._heat, np.zeros(size - len(self._heat))])
            self._touch = np.concatenate([self._touch, np.zeros(size - len(self._touch), dtype=np.int64)])
            self._resident = np.concatenate([self._resident, np.zeros(size - len(self._resident), dtype=bool)])
            self._changed = np.concatenate([self._changed, np.zeros(size - len(self._changed), dtype=bool)])

    @staticmethod
    def _ids(keys: Iterable[int]) -> np.ndarray:
        ids = keys if isinstance(keys, np.ndarray) else np.fromiter(keys, dtype=np.int64)
        if len(ids) and ids.min() < 0:
            raise ValueError(f"policy freq-dense: keys are dense non-negative ints, got {int(ids.min())}")
        return ids.astype(np.int64, copy=False)

    def heat(self, key: int) -> float:
        """The key's decayed routed count at the last `begin_step` (0.0 for a key never routed)."""
        return float(self._heat[key]) if 0 <= key < len(self._heat) else 0.0

    # --- hooks ---------------------------------------------------------------------------
    def begin_step(self, now: float) -> None:
        super().begin_step(now)
        if self._stamp is not None and now > self._stamp:
            self._heat *= 2.0 ** (-(now - self._stamp) / self.half_life)
            self._decayed = True
        if self._stamp is None or now > self._stamp:
            self._stamp = now

    def observe(self, keys: Iterable[int]) -> None:
        ids = self._ids(keys)
        if len(ids):
            if self._stamp is None:
                self._stamp = self.now
            self._room(int(ids.max()))
            if len(ids) == 1 or (ids[1:] > ids[:-1]).all():  # distinct (a pool's routed ids are, ascending)
                self._heat[ids] += 1.0
            else:
                np.add.at(self._heat, ids, 1.0)  # one add per occurrence, in order: a key routed twice counts twice
            self._changed[ids] = True

    def on_insert(self, key: int, size: int = 1) -> None:
        if key < 0:
            raise ValueError(f"policy freq-dense: keys are dense non-negative ints, got {key}")
        super().on_insert(key, size)

    def _inserted(self, key: int) -> None:
        self._room(key)
        self._clock += 1
        self._touch[key] = self._clock
        self._resident[key] = True
        self._changed[key] = True

    def _accessed(self, key: int) -> None:
        self._clock += 1
        self._touch[key] = self._clock
        self._changed[key] = True

    def _removed(self, key: int) -> None:
        self._resident[key] = False
        self._changed[key] = True

    # the batch hooks of a pool's install and step close as array operations: the state the single hooks leave,
    # and where a key fails, the keys before it applied and the single hook's error for it
    def _batch(self, keys: Iterable[int]) -> np.ndarray:
        ids = self._ids(keys)
        if len(ids):
            self._room(int(ids.max()))
        return ids

    @staticmethod
    def _first_failing(ok: np.ndarray) -> int | None:
        """The index of the first key a batch hook cannot take (`ok` False), or None."""
        return None if ok.all() else int(np.argmin(ok))

    @staticmethod
    def _first_occurrences(ids: np.ndarray) -> np.ndarray:
        once = np.zeros(len(ids), dtype=bool)
        once[np.unique(ids, return_index=True)[1]] = True
        return once

    def on_insert_many(self, keys: Iterable[int]) -> None:
        if type(self) is not DenseFrequencyPolicy:
            return super().on_insert_many(keys)
        ids = self._batch(keys)
        bad = self._first_failing(~self._resident[ids] & self._first_occurrences(ids))
        good = ids if bad is None else ids[:bad]
        self.sizes.update(dict.fromkeys(good.tolist(), 1))
        self._touch[good] = self._clock + 1 + np.arange(len(good))
        self._clock += len(good)
        self._resident[good] = True
        self._changed[good] = True
        self.version += len(good)
        if bad is not None:
            self.on_insert(int(ids[bad]))  # raises, as the single hook does

    def on_access_many(self, keys: Iterable[int]) -> None:
        if type(self) is not DenseFrequencyPolicy:
            return super().on_access_many(keys)
        ids = self._batch(keys)
        bad = self._first_failing(self._resident[ids])
        good = ids if bad is None else ids[:bad]
        accesses = len(good)  # each one ticks the clock, a repeated key's included
        stamps = self._clock + 1 + np.arange(accesses)
        if accesses > 1 and not (good[1:] > good[:-1]).all():  # a repeated key's touch is its last access
            last = accesses - 1 - np.unique(good[::-1], return_index=True)[1]
            good, stamps = good[last], stamps[last]
        self._touch[good] = stamps
        self._changed[good] = True
        self._clock += accesses
        self.version += accesses
        if bad is not None:
            self.on_access(int(ids[bad]))  # raises, as the single hook does

    def on_evict_many(self, keys: Iterable[int]) -> None:
        if type(self) is not DenseFrequencyPolicy:
            return super().on_evict_many(keys)
        ids = self._batch(keys)
        bad = self._first_failing(self._resident[ids] & self._first_occurrences(ids))
        good = ids if bad is None else ids[:bad]
        for key in good.tolist():
            del self.sizes[key]
        self.pinned.difference_update(good.tolist())
        self._resident[good] = False
        self._changed[good] = True
        self.version += len(good)
        if bad is not None:
            self.on_evict(int(ids[bad]))  # raises, as the single hook does

    # --- queries -------------------------------------------------------------------------
    def eviction_order(self, exclude=_EMPTY) -> Iterator[int]:
        order = self._resident_order()  # never written in place: the iterator may read it after later hooks
        skipped = [keys for keys in (self.pinned, exclude) if keys]
        if skipped:
            evictable = np.ones(len(self._resident), dtype=bool)
            for keys in skipped:
                ids = np.fromiter(keys, dtype=np.int64, count=len(keys))
                evictable[ids[(ids >= 0) & (ids < len(evictable))]] = False
            order = order[evictable[order]]
        return _listed(order)

    def _resident_order(self) -> np.ndarray:
        """int64 [R] the resident keys, lowest heat first, then the older touch (`freq`'s (rank, last touch, key):
        resident keys' touches differ, so the order is unique): the last order taken where nothing changed since,
        else that order with the changed keys merged in (`_merged_order`), else sorted afresh."""
        if self._order is not None and not self._decayed and not self._changed.any():
            return self._order
        order = self._merged_order() if len(self.sizes) > _MERGE_FROM else None
        if order is None:
            order = np.flatnonzero(self._resident)
            order = order[np.lexsort((self._touch[order], self._heat[order]))]
        self._order, self._decayed = order, False
        self._changed[:] = False
        return order

    def _merged_order(self) -> np.ndarray | None:
        """The last order taken with the keys changed since sorted and merged into the others (a stable sort by heat
        of the two sorted runs, the unchanged first: a changed resident key was inserted or hit since, so its touch
        is the newer where heats tie). None where there is no such order, where half the keys or more changed, or
        where the result is not sorted and complete (a decay that made heats equal, a count raised without a hit)."""
        if self._order is None:
            return None
        changed = self._changed
        moved = np.flatnonzero(changed & self._resident)  # [M] changed resident keys
        if _MERGE_SHARE * len(moved) >= len(self._order):
            return None
        kept = self._order[~changed[self._order]]  # [U] unchanged resident keys, in their order
        moved = moved[np.lexsort((self._touch[moved], self._heat[moved]))]
        merged = np.concatenate([kept, moved])
        order = merged[np.argsort(self._heat[merged], kind="stable")]
        return order if len(order) == len(self.sizes) and self._sorted(order) else None

    def _sorted(self, order: np.ndarray) -> bool:
        """Whether `order` is in strictly increasing (heat, touch)."""
        heat, touch = self._heat[order], self._touch[order]
        rising = heat[1:] > heat[:-1]
        return bool((rising | ((heat[1:] == heat[:-1]) & (touch[1:] > touch[:-1]))).all())


def _listed(ids: np.ndarray) -> Iterator[int]:
    """The ids of `ids` (an array nothing writes to) as Python ints, the first `_HEAD` converted before the rest."""
    yield from ids[:_HEAD].tolist()
    if len(ids) > _HEAD:
        yield from ids[_HEAD:].tolist()
