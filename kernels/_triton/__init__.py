"""Triton kernels behind the public ops in `kernels`; import only where triton is installed."""
