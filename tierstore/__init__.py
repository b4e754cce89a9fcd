"""tierstore: run MoE models whose routed experts do not fit on the GPU.

Importing this package loads neither vllm, triton nor transformers; GPU kernels live in
`tierstore.kernels` and the vLLM plugin in `tierstore.vllm_adapter`.
"""

from tierstore.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    FormatError,
    PackFormatError,
    ReadError,
    TierstoreError,
    TraceFormatError,
)
from tierstore.geometry import PRESETS, MoEGeometry, get_preset

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "CheckpointError",
    "ConfigError",
    "FormatError",
    "MoEGeometry",
    "PRESETS",
    "PackFormatError",
    "ReadError",
    "TierstoreError",
    "TraceFormatError",
    "get_preset",
    "__version__",
]
