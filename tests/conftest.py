"""Shared pytest set-up: markers `gpu` and `vllm` skip cleanly where their hardware or package is absent."""

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _keep_the_repository_root_off_sys_path() -> None:
    """The source folder `kernels/` installs as `tierstore.kernels`; on sys.path under its bare name
    it shadows PyPI's `kernels` (Hugging Face's hub kernels, which vLLM and transformers >= 5.25
    install and transformers imports: `from kernels import CUDAProperties` then fails).
    `python -m pytest` puts the root first, so it comes off here; the folders the tests import from
    the root without an install (`tests`, `benchmarks`) are registered from their folders instead.
    A Python the tests start with `-c` or `-m` gets `-P` for the same reason
    (tests/test_source_folders_off_path.py checks that they do)."""
    here = {str(ROOT), ""} if Path.cwd() == ROOT else {str(ROOT)}
    sys.path[:] = [entry for entry in sys.path if entry not in here]
    for name in ("tests", "benchmarks"):
        if name not in sys.modules:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(ROOT / name)]
            sys.modules[name] = importlib.util.module_from_spec(spec)


_keep_the_repository_root_off_sys_path()


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
