"""Shared pytest set-up: markers `gpu` and `vllm` skip cleanly where their hardware or package is absent."""

import importlib.util
import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads this switch when a
# kernel is decorated, so it must be set before any test module imports the kernels.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_vllm() -> bool:
    # A test folder named `vllm` on sys.path looks like a namespace package (no origin): not vLLM.
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def pytest_collection_modifyitems(config, items):
    has_cuda = _has_cuda()
    has_vllm = _has_vllm()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_vllm = pytest.mark.skip(reason="needs the vllm package")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(skip_vllm)
