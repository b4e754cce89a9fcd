"""The few vLLM names that moved between the supported releases (0.24 ... 0.33), found once.

Importing this module imports vLLM; only the adapter's vLLM-facing modules do.
"""

from __future__ import annotations

import importlib

import vllm
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs

from tierstore.errors import ConfigError

MIN_VLLM = (0, 24)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


VLLM_VERSION = _version_tuple(vllm.__version__)
if VLLM_VERSION[:2] < MIN_VLLM:
    raise ConfigError(f"tierstore's vLLM adapter needs vLLM >= {'.'.join(map(str, MIN_VLLM))} "
                      f"(the RoutedExperts layer); found {vllm.__version__}")


def moe_factory():
    """vLLM's MoE layer factory: `FusedMoE` (0.24-0.26) or `FusedMoEFactory` (0.27+)."""
    module = importlib.import_module("vllm.model_executor.layers.fused_moe")
    factory = getattr(module, "FusedMoEFactory", None) or getattr(module, "FusedMoE")
    return factory


def linear_base_and_unquantized() -> tuple[type, type]:
    linear = importlib.import_module("vllm.model_executor.layers.linear")
    return linear.LinearBase, linear.UnquantizedLinearMethod


__all__ = [
    "FusedMoEMethodBase",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "RoutedExperts",
    "VLLM_VERSION",
    "linear_base_and_unquantized",
    "moe_factory",
    "set_weight_attrs",
]
