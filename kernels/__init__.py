"""GPU kernels for tierstore (installed as `tierstore.kernels`). Depends on torch and triton only."""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None

__all__ = ["HAS_TRITON"]
