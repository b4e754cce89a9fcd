"""The driver's shared failure path for raw calls (`_Driver.retry_in_context`), on a fake libcuda: no GPU needed."""

import pytest

from tierstore.kernels.cuda.loader import INVALID_CONTEXT, _Driver


class _FakeLib:
    def cuGetErrorName(self, status, out):  # noqa: N802 (the driver's name)
        out._obj.value = {1: b"CUDA_ERROR_INVALID_VALUE", INVALID_CONTEXT: b"CUDA_ERROR_INVALID_CONTEXT"}.get(status)
        return 0


def _driver(contexts):
    driver = object.__new__(_Driver)  # no cuInit: the fake library stands in for libcuda
    driver.lib = _FakeLib()
    driver.ensure_context = contexts.append
    return driver


def test_a_call_without_a_context_gets_the_devices_and_runs_once_more():
    contexts, calls = [], []
    _driver(contexts).retry_in_context(INVALID_CONTEXT, 3, "cuEventRecord", lambda *a: calls.append(a) or 0, 7, 8)
    assert contexts == [3] and calls == [(7, 8)]


def test_a_call_that_fails_again_raises_naming_the_call_and_the_error():
    contexts = []
    with pytest.raises(RuntimeError, match="cuStreamWaitEvent failed: CUDA_ERROR_INVALID_VALUE"):
        _driver(contexts).retry_in_context(INVALID_CONTEXT, 0, "cuStreamWaitEvent", lambda: 1)
    assert contexts == [0]


def test_any_other_status_raises_at_once_without_a_retry():
    contexts, calls = [], []
    with pytest.raises(RuntimeError, match="cuMemcpyHtoDAsync of 64 bytes failed: 999"):
        _driver(contexts).retry_in_context(999, 0, "cuMemcpyHtoDAsync of 64 bytes", lambda: calls.append(1) or 0)
    assert contexts == [] and calls == []
