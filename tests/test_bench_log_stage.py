"""benchmarks/log_stage.cu (a pass writing its own pass-log read-back, timed by sync_wake.py) against its plain-torch
reference."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cuda_fixtures import needs_nvcc, ptxas_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from log_stage import SOURCE, LogStager, check_stage_buffers, stage_log_ref  # noqa: E402


def test_the_reference_copies_the_words_then_sets_the_flag():
    words = torch.arange(-5, 6, dtype=torch.int32)
    host, flag = np.full(11, 77, np.int32), np.zeros(1, np.int32)
    stage_log_ref(words, host, flag)
    assert host.tolist() == list(range(-5, 6)) and flag[0] == 1


def test_buffers_are_checked_by_name():
    words = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="host is torch.int64"):
        check_stage_buffers(words, torch.zeros(8, dtype=torch.int64), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="host has 7 words for 8"):
        check_stage_buffers(words, torch.zeros(7, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be pinned"):
        check_stage_buffers(words, torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


@needs_nvcc
def test_the_kernel_compiles_without_spills(tmp_path):
    info = ptxas_report(SOURCE, tmp_path / "log_stage.cubin", {}).split("Compiling entry function 'stage_log_words'")[1]
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores", info), info[:300]


@pytest.mark.gpu
@pytest.mark.parametrize("words", [1, 3, 4, 1601, 6203, 9000])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_cuda_stage_equals_the_reference_on_fresh_words(words, graph):
    """Every word and the flag, on poisoned host buffers, eager and replayed from a CUDA graph with new words each
    replay (a graph's staging reads the words at replay time, not at capture)."""
    stager = LogStager()
    gen = torch.Generator().manual_seed(words)
    device_words = torch.empty(words, dtype=torch.int32, device="cuda")
    host = torch.empty(words, dtype=torch.int32, pin_memory=True)
    flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
    run = lambda: stager.stage(device_words, host, flag)  # noqa: E731
    if graph:
        captured = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(captured, stream=stream):
            run()
        run = captured.replay
    for _ in range(3):
        device_words.copy_(torch.randint(-2**31, 2**31 - 1, (words,), generator=gen, dtype=torch.int32))
        want_host, want_flag = np.full(words, -1, np.int32), np.zeros(1, np.int32)
        stage_log_ref(device_words, want_host, want_flag)
        host.fill_(-123456789)  # poison
        flag.fill_(0)
        run()
        torch.cuda.synchronize()
        assert np.array_equal(host.numpy(), want_host) and flag.item() == want_flag[0] == 1
