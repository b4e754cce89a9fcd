"""The adapter's knobs, read once from the environment and validated before any weight is made.

Every knob has a `TIERSTORE_<NAME>` spelling and, for users of the reference system, a
`VLLM_MOE_W2_<NAME>` alias; setting both to different values is an error. This module does not
import vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tierstore.errors import ConfigError
from tierstore.units import parse_size

PREFIXES = ("TIERSTORE_", "VLLM_MOE_W2_")
ZERO_MODES = ("auto", "sign", "alt")
REPLAY_MODES = ("strict", "approximate")
EXECUTION_MODES = ("eager", "graph")


@dataclass(frozen=True)
class Knob:
    name: str  # without prefix, e.g. "BASE_CACHE_GB"
    default: str
    meaning: str


KNOBS = (
    Knob("ZERO_MODE", "auto", "exact-zero sign rule of the requantizer: auto | sign | alt"),
    Knob("DELTA_GB", "0", "FP4 pool size (GiB or a unit, or `auto`); 0 = no FP4 pool"),
    Knob("GATE", "0", "1 arms the confidence gate (needs an FP4 pool)"),
    Knob("GATE_TAU", "0.60", "gate threshold on the top-1 probability, in (0, 1]"),
    Knob("GATE_TAU_FILE", "", "file holding tau, re-read when it changes"),
    Knob("BASE_CACHE_GB", "0", "GPU expert-cache size for the 2-bit base; 0 = every expert resident"),
    Knob("STORE_DIR", "", "folder of the pack files (built with `tierstore pack`); empty = requantize at load"),
    Knob("BASE_RAM_GB", "", "pinned host arena over the pack (GiB, a unit, or `auto`); empty = whole model in RAM"),
    Knob("BASE_MISS_TOL", "0", "a step with at most this many missing pairs keeps its output"),
    Knob("REPLAY_MODE", "strict", "strict (never return zeroed contributions) | approximate"),
    Knob("FP_MAX", "32", "most fetch-and-replay passes of one step"),
    Knob("TIER_DIRECT", "0", "1 reads the pack with O_DIRECT"),
    Knob("KPI_EVERY", "500", "log tier counters every N steps; 0 = never"),
    Knob("EXECUTION", "eager", "eager: misses fetched inside apply | graph: in-graph miss log, runner replays"),
    Knob("CUDA_W2", "0", "1 runs gate_up and down on the CUDA C++ kernels where measured faster (CUDA, nvcc, "
                         "hidden a multiple of 512)"),
)
_KNOWN = {knob.name for knob in KNOBS}


def read_knobs(environ: Mapping[str, str]) -> dict[str, str]:
    """Knob name -> raw text, with defaults; rejects unknown names and conflicting aliases."""
    values = {knob.name: knob.default for knob in KNOBS}
    seen: dict[str, tuple[str, str]] = {}
    for variable, text in environ.items():
        prefix = next((p for p in PREFIXES if variable.startswith(p)), None)
        if prefix is None:
            continue
        name = variable[len(prefix):]
        if name not in _KNOWN:
            if prefix == "TIERSTORE_":
                continue  # other parts of tierstore own further TIERSTORE_* names
            raise ConfigError(f"{variable} is not a knob the tierstore vLLM adapter knows; "
                              f"known: {', '.join(sorted(_KNOWN))}")
        if name in seen and seen[name][1] != text:
            other = seen[name][0]
            raise ConfigError(f"{other}={seen[name][1]!r} and {variable}={text!r} disagree; set one of them")
        seen[name] = (variable, text)
        values[name] = text
    return values


def _flag(values: dict[str, str], name: str) -> bool:
    text = values[name].strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} must be 0 or 1, got {values[name]!r}")


def _int(values: dict[str, str], name: str, minimum: int) -> int:
    try:
        number = int(values[name])
    except ValueError:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {values[name]!r}") from None
    if number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    return number


def _choice(values: dict[str, str], name: str, choices: tuple[str, ...]) -> str:
    text = values[name].strip().lower()
    if text not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {values[name]!r}")
    return text


def _size_or_auto(values: dict[str, str], name: str, empty_means: int | None) -> int | str | None:
    text = values[name].strip().lower()
    if text == "":
        return empty_means
    if text in ("auto", "-1"):
        return "auto"
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


@dataclass(frozen=True)
class AdapterSettings:
    zero_mode: str = "auto"
    fp4_pool_bytes: int | str = 0  # bytes or "auto"
    gate: bool = False
    gate_tau: float = 0.60
    gate_tau_file: Path | None = None
    base_cache_bytes: int = 0  # 0 = every local expert resident on the device
    store_dir: Path | None = None
    base_ram_bytes: int | str | None = None  # None = whole model in host RAM; bytes or "auto"
    miss_tolerance: int = 0
    replay_mode: str = "strict"
    fp_max: int = 32
    tier_direct: bool = False
    kpi_every: int = 500
    execution: str = "eager"
    cuda_w2: bool = False  # resident layers and the runtime: the CUDA C++ whole op where measured faster

    def __post_init__(self) -> None:
        if self.gate and self.fp4_pool_bytes == 0:
            raise ConfigError("GATE=1 needs an FP4 pool: set DELTA_GB to a size or `auto`")
        if not (0.0 < self.gate_tau <= 1.0) or math.isnan(self.gate_tau):
            raise ConfigError(f"GATE_TAU must lie in (0, 1] (a top-1 probability), got {self.gate_tau}")
        if self.base_ram_bytes is not None and self.store_dir is None:
            raise ConfigError("BASE_RAM_GB sizes an arena over the pack: it needs STORE_DIR")
        if self.tier_direct and self.store_dir is None:
            raise ConfigError("TIER_DIRECT=1 reads the pack: it needs STORE_DIR")
        if self.store_dir is not None and not self.store_dir.is_dir():
            raise ConfigError(f"STORE_DIR {str(self.store_dir)!r} is not a folder")
        if self.gate_tau_file is not None and not self.gate_tau_file.parent.is_dir():
            raise ConfigError(f"GATE_TAU_FILE {str(self.gate_tau_file)!r} lies in a folder that does not exist")

    @property
    def uses_expert_cache(self) -> bool:
        return self.base_cache_bytes > 0

    @property
    def uses_fp4_tier(self) -> bool:
        return self.fp4_pool_bytes != 0

    @property
    def uses_runtime(self) -> bool:
        """Whether the MoE layers go through the process's `tierstore.runtime.TieredRuntime`."""
        return self.uses_expert_cache or self.uses_fp4_tier

    @property
    def needs_runner_hook(self) -> bool:
        """Whether something must drive `runtime.step` around each forward (the tierstore worker):
        the FP4 manager and the gate always, the expert cache in graph execution."""
        return self.uses_fp4_tier or (self.uses_expert_cache and self.execution == "graph")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> AdapterSettings:
        values = read_knobs(os.environ if environ is None else environ)
        try:
            tau = float(values["GATE_TAU"])
        except ValueError:
            raise ConfigError(f"GATE_TAU must be a number, got {values['GATE_TAU']!r}") from None
        base_cache = _size_or_auto(values, "BASE_CACHE_GB", 0)
        if base_cache == "auto":
            raise ConfigError("BASE_CACHE_GB takes a size (e.g. 24 or 512MiB), not `auto`")
        return cls(
            zero_mode=_choice(values, "ZERO_MODE", ZERO_MODES),
            fp4_pool_bytes=_size_or_auto(values, "DELTA_GB", 0),
            gate=_flag(values, "GATE"),
            gate_tau=tau,
            gate_tau_file=Path(values["GATE_TAU_FILE"]) if values["GATE_TAU_FILE"] else None,
            base_cache_bytes=base_cache,
            store_dir=Path(values["STORE_DIR"]) if values["STORE_DIR"] else None,
            base_ram_bytes=_size_or_auto(values, "BASE_RAM_GB", None),
            miss_tolerance=_int(values, "BASE_MISS_TOL", 0),
            replay_mode=_choice(values, "REPLAY_MODE", REPLAY_MODES),
            fp_max=_int(values, "FP_MAX", 1),
            tier_direct=_flag(values, "TIER_DIRECT"),
            kpi_every=_int(values, "KPI_EVERY", 0),
            execution=_choice(values, "EXECUTION", EXECUTION_MODES),
            cuda_w2=_flag(values, "CUDA_W2"),
        )
