"""`TierstoreConfig`: the quantization config vLLM resolves for `--quantization tierstore` or a
checkpoint whose `quantization_config.quant_method` is `tierstore`.

Routed experts get `TierstoreMoEMethod`. Every other layer is left to what the checkpoint's own
format needs: plain layers stay unquantized, and in an FP8 / NVFP4 / MXFP4 checkpoint the
non-expert layers go to vLLM's built-in config of that format.
"""

from __future__ import annotations

from typing import Any

import torch

from tierstore.errors import ConfigError
from tierstore.vllm_adapter.compat import (
    QuantizationConfig,
    QuantizeMethodBase,
    RoutedExperts,
    linear_base_and_unquantized,
)
from tierstore.vllm_adapter.settings import AdapterSettings
from tierstore.vllm_adapter.source_formats import SourceFormat, source_format_from_quant_config

QUANT_NAME = "tierstore"
# vLLM's own config name for the non-expert layers of each quantized source format
_BUILTIN_FOR_FORMAT = {"fp8_block": "fp8", "nvfp4": "modelopt_fp4", "mxfp4": "mxfp4"}
MIN_CAPABILITY = 80  # the Triton kernels need Ampere or newer; the CPU reference runs anywhere


class TierstoreConfig(QuantizationConfig):
    """Argument-free construction means a bf16/fp16 checkpoint (vLLM builds it that way when the
    checkpoint has no quantization_config)."""

    def __init__(self, source_format: SourceFormat | None = None, source_quant_config: dict | None = None):
        super().__init__()
        self.source_format = source_format or SourceFormat("bf16")
        self.source_quant_config = dict(source_quant_config or {})
        self.settings = AdapterSettings.from_environ()
        self._builtin: QuantizationConfig | None = None

    def __repr__(self) -> str:
        return f"TierstoreConfig(source_format={self.source_format.name!r})"

    def get_name(self) -> str:
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TierstoreConfig:
        return cls(source_format_from_quant_config(config), config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Claim a checkpoint in a format tierstore reads when the user asked for tierstore."""
        if user_quant is None or user_quant.lower() != QUANT_NAME:
            return None
        source_format_from_quant_config(hf_quant_cfg)  # raises a clear error for unreadable formats
        return QUANT_NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            from tierstore.vllm_adapter.moe_method import TierstoreMoEMethod

            return TierstoreMoEMethod(layer.moe_config, self.source_format, self.settings, prefix)
        if self.source_format.name == "bf16":
            linear_base, unquantized = linear_base_and_unquantized()
            return unquantized() if isinstance(layer, linear_base) else None
        return self._builtin_config().get_quant_method(layer, prefix)

    def _builtin_config(self) -> QuantizationConfig:
        if self._builtin is None:
            from vllm.model_executor.layers.quantization import get_quantization_config

            name = _BUILTIN_FOR_FORMAT[self.source_format.name]
            try:
                self._builtin = get_quantization_config(name).from_config(self.source_quant_config)
            except Exception as exc:  # vLLM raises assorted types for configs it cannot read
                raise ConfigError(f"vLLM's {name!r} config cannot read this checkpoint's quantization_config "
                                  f"for the non-expert layers: {exc}") from exc
        return self._builtin
