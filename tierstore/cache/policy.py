"""Eviction-policy API shared by the simulator and the runtime pools.

Keys are dense ints: ``key = layer * num_experts + expert`` (see `expert_key`). A policy tracks
the resident keys of one pool through hooks and orders them for eviction; it owns no bytes and
never decides capacity, which stays with the pool. Hook protocol, in the pool's order of calls:

- ``begin_step(now)`` once per step (``now`` = step index in the simulator, seconds in the
  runtime); ``observe(keys)`` with the step's routed keys (counts usage, even of non-resident
  keys, for frequency-driven promotion);
- ``on_insert(key, size)`` when a key becomes resident, ``on_access(key)`` on a hit,
  ``on_evict(key)`` when the pool removes the key it asked `victim` for, ``on_remove(key)``
  when a key leaves for any other reason;
- ``on_insert_many`` / ``on_access_many`` / ``on_evict_many``: the same hook for each key of a
  batch, in order (a pool's install or step close); a policy may override them with a faster loop
  that leaves the same state;
- ``victim(exclude)`` names the key to evict next, never a pinned or excluded one, and
  changes nothing observable: asking twice gives the same answer.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator

from tierstore.errors import CapacityError, TierstoreError

_EMPTY: frozenset[int] = frozenset()


class UnknownPolicyError(TierstoreError, ValueError):
    """A policy name is not registered, or its parameters do not fit it."""


def expert_key(layer: int, expert: int, num_experts: int) -> int:
    """The dense key of (layer, expert): ``layer * num_experts + expert``."""
    if not 0 <= expert < num_experts or layer < 0:
        raise ValueError(f"expert key out of range: layer {layer}, expert {expert} of {num_experts}")
    return layer * num_experts + expert


def split_key(key: int, num_experts: int) -> tuple[int, int]:
    """Inverse of `expert_key`: (layer, expert)."""
    return divmod(key, num_experts)


class EvictionPolicy:
    """Base class: bookkeeping of resident keys, sizes and pins; subclasses define the order."""

    name = "base"
    # True where `eviction_order(exclude)` is `eviction_order()` less the excluded keys and the order changes only
    # with `version`: a victim list planned ahead then only needs filtering (`DevicePool.plan_victims`)
    filtered_order = False

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.pinned: set[int] = set()
        self.now: float = 0
        self.version = 0  # bumped by every hook; sweeping policies key their victim plans on it

    # --- hooks -------------------------------------------------------------------------
    def begin_step(self, now: float) -> None:
        self.now = now
        self.version += 1

    def observe(self, keys: Iterable[int]) -> None:
        """The keys routed this step (resident or not). Default: ignored."""

    def on_insert(self, key: int, size: int = 1) -> None:
        if key in self.sizes:
            raise KeyError(f"policy {self.name}: key {key} inserted twice")
        if size <= 0:
            raise ValueError(f"policy {self.name}: size of key {key} must be positive, got {size}")
        self.sizes[key] = size
        self.version += 1
        self._inserted(key)

    def on_access(self, key: int) -> None:
        self._require(key)
        self.version += 1
        self._accessed(key)

    def on_remove(self, key: int) -> None:
        self._require(key)
        del self.sizes[key]
        self.pinned.discard(key)
        self.version += 1
        self._removed(key)

    def on_evict(self, key: int) -> None:
        """Remove `key` because it was chosen as victim (sweeping policies settle their hand here)."""
        self.on_remove(key)

    def on_insert_many(self, keys: Iterable[int]) -> None:
        """`on_insert(key)` (size 1) for each key in order; a policy may do the same faster."""
        for key in keys:
            self.on_insert(key)

    def on_access_many(self, keys: Iterable[int]) -> None:
        """`on_access(key)` for each key in order; a policy may do the same faster."""
        for key in keys:
            self.on_access(key)

    def on_evict_many(self, keys: Iterable[int]) -> None:
        """`on_evict(key)` for each key in order; a policy may do the same faster."""
        for key in keys:
            self.on_evict(key)

    def pin(self, key: int) -> None:
        self._require(key)
        self.pinned.add(key)
        self.version += 1

    def unpin(self, key: int) -> None:
        self.pinned.discard(key)
        self.version += 1

    # --- queries -----------------------------------------------------------------------
    def __contains__(self, key: int) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def used(self) -> int:
        """Sum of resident sizes."""
        return sum(self.sizes.values())

    def evictable(self, key: int, exclude: Iterable[int] | frozenset = _EMPTY) -> bool:
        return key in self.sizes and key not in self.pinned and key not in exclude

    def victim(self, exclude: frozenset[int] | set[int] = _EMPTY) -> int | None:
        """The next key to evict (not pinned, not in `exclude`), or None when there is none."""
        for key in self.eviction_order(exclude):
            return key
        return None

    def victims(self, size: int, exclude: frozenset[int] | set[int] = _EMPTY) -> list[int]:
        """Keys to evict, in order, whose sizes add up to at least `size` (CapacityError if they cannot)."""
        chosen, freed = [], 0
        for key in self.eviction_order(exclude):
            if freed >= size:
                break
            chosen.append(key)
            freed += self.sizes[key]
        if freed < size:
            raise CapacityError(f"policy {self.name}: only {freed} of {size} size units are evictable")
        return chosen

    def eviction_order(self, exclude: frozenset[int] | set[int] = _EMPTY) -> Iterator[int]:
        """Evictable keys, first victim first. Must not change the policy's state."""
        raise NotImplementedError

    # --- subclass hooks ----------------------------------------------------------------
    def _inserted(self, key: int) -> None: ...

    def _accessed(self, key: int) -> None: ...

    def _removed(self, key: int) -> None: ...

    def _require(self, key: int) -> None:
        if key not in self.sizes:
            raise KeyError(f"policy {self.name}: key {key} is not resident")


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {}
_BUILTINS_LOADED = False


def register_policy(name: str, factory: Callable[..., EvictionPolicy] | None = None, *, replace: bool = False):
    """Register a policy class (or factory) under `name`; usable as a class decorator."""

    def add(obj):
        if name in _REGISTRY and _REGISTRY[name] is not obj and not replace:
            raise UnknownPolicyError(f"policy name {name!r} is already registered (pass replace=True)")
        _REGISTRY[name] = obj
        return obj

    return add(factory) if factory is not None else add


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        importlib.import_module("tierstore.cache.policies")


def policy_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_policy(name: str, **params) -> EvictionPolicy:
    """A fresh policy instance by registered name, e.g. ``get_policy("freq", half_life=64)``."""
    _load_builtins()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(f"unknown policy {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise UnknownPolicyError(f"policy {name!r}: bad parameters {params}: {exc}") from None


def get_decaying_policy(name: str, half_life: float) -> EvictionPolicy:
    """`get_policy(name)`, with `half_life=half_life` where the policy's factory takes one (`freq`, `freq-dense`,
    `need`, or a registered policy with that parameter): the runtime's pools call `begin_step` with seconds."""
    _load_builtins()
    factory = _REGISTRY.get(name)
    try:
        decays = factory is not None and "half_life" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a factory without a signature Python can read
        decays = False
    return get_policy(name, half_life=half_life) if decays else get_policy(name)
