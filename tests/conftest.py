"""Shared pytest set-up: markers `gpu` and `vllm` skip cleanly where their hardware or package is absent."""

import importlib.util

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_cuda = _has_cuda()
    has_vllm = importlib.util.find_spec("vllm") is not None
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_vllm = pytest.mark.skip(reason="needs the vllm package")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(skip_vllm)
