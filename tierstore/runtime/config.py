"""Runtime knobs: one frozen dataclass, validated at construction; the environment is read only
in `RuntimeConfig.from_env`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from tierstore.errors import ConfigError

REPLAY_MODES = ("strict", "approximate")
ENV_PREFIX = "TIERSTORE_"


@dataclass(frozen=True)
class RuntimeConfig:
    """How a tiered step treats misses.

    - `replay_mode`: `strict` (default) fetches and replays until no pair misses, and raises after
      `fp_max` replays rather than return logits with zeroed contributions; `approximate` is an
      explicit degraded mode: one replay is mandatory, further ones only while the residue is
      <= `fp_thresh`; what is left is accepted and counted.
    - `miss_tolerance`: a step with at most this many missing pairs keeps its logits without a
      replay (degraded, counted); its missing experts are still fetched for later steps.
    - `policy`: eviction policy of the device pool (any name of the policy registry).
    - `force_pool`: start even when the pool is below the per-step working set
      (`working_set_margin` x layers x top-k x `tokens_per_step`).
    - `kpi_every`: log a KPI line every that many steps (0 = never).
    """

    replay_mode: str = "strict"
    fp_max: int = 32
    fp_thresh: int = 0
    miss_tolerance: int = 0
    policy: str = "lru"
    force_pool: bool = False
    working_set_margin: float = 1.15
    tokens_per_step: int = 1
    kpi_every: int = 500

    def __post_init__(self) -> None:
        if self.replay_mode not in REPLAY_MODES:
            raise ConfigError(f"replay_mode must be one of {', '.join(REPLAY_MODES)}, got {self.replay_mode!r}")
        for name in ("fp_max", "tokens_per_step"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("fp_thresh", "miss_tolerance", "kpi_every"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not self.working_set_margin >= 1.0:
            raise ConfigError(f"working_set_margin must be >= 1.0, got {self.working_set_margin!r}")

    @property
    def degraded(self) -> bool:
        """Whether this configuration may return logits with zeroed expert contributions."""
        return self.replay_mode == "approximate" or self.miss_tolerance > 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> RuntimeConfig:
        """Defaults, then `TIERSTORE_<FIELD>` variables (e.g. TIERSTORE_REPLAY_MODE), then `overrides`."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in fields(cls):
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = _parse(field.name, raw, type(getattr(cls(), field.name)))
        values.update(overrides)
        return cls(**values)


def _parse(name: str, raw: str, kind: type):
    try:
        if kind is bool:
            if raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from None
