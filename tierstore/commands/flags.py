"""Options shared by several subcommands."""

from __future__ import annotations

import argparse


def add_cuda_w2_flag(parser: argparse.ArgumentParser, subject: str) -> None:
    """--cuda-w2 / --no-cuda-w2 as config cuda_w2: True / False, "auto" when neither is given. `subject`: whose
    gate_up and down the kernels run (the help's first words)."""
    parser.add_argument("--cuda-w2", action=argparse.BooleanOptionalAction, default="auto",
                        help=f"{subject} gate_up and down on the CUDA C++ kernels where measured faster (config "
                             "cuda_w2; Hopper, nvcc, bfloat16, hidden a multiple of 512): --cuda-w2 requires them, "
                             "--no-cuda-w2 runs Triton only; default auto (on where usable)")
