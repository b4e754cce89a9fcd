"""benchmarks/moe_kernels.py's streaming-read ceiling indexes reads of more than 2^31 words in int64.

kimi-k2's presets run at 54fb697 stopped at T = 512 with an illegal memory access in the fp4_fused ceiling: a
read of 8984199168 bytes (2246049792 int32 words) whose word index (pid * ITERS + i) * BLOCK + offs was int32 and
wrapped negative past 2^31 - 1. The fault itself needs an 8 GiB buffer (the GPU test below); on CPU the tests
run the kernel's index helper in Triton's interpreter at the program ids of that read, where the int32 form
wraps, and check that the int32 form (which measured every earlier ceiling) is kept below that size."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "kernels-kimi-k2-54fb697.json"


def _load():
    spec = importlib.util.spec_from_file_location("bench_kernels_stream_ceiling", ROOT / "benchmarks" / "moe_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kb = _load()


@triton.jit
def _block_start_probe(pid_ptr, i, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.load(pid_ptr)  # int32, as tl.program_id(0) gives it
    tl.store(out_ptr, kb._stream_block_start(pid, i, BLOCK, ITERS, WIDE).to(tl.int64))


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _block_start(pid: int, i: int, block: int, iters: int, wide: bool) -> int:
    pid_t = torch.tensor([pid], dtype=torch.int32, device=_device())
    out = torch.zeros(1, dtype=torch.int64, device=_device())
    _block_start_probe[(1,)](pid_t, i, out, BLOCK=block, ITERS=iters, WIDE=wide)
    return int(out.item())


def _measured_bytes(tokens: int, variant: str) -> int:
    rows = json.loads(RESULT.read_text())["cases"]
    return int(next(r["bytes"] for r in rows if r["tokens"] == tokens and r["variant"] == variant))


def test_kimi_k2_t512_fp4_read_passes_int32_and_gets_int64_indices():
    words = _measured_bytes(512, "fp4_fused") // 4
    assert words == 2246049792 > kb.INT32_MAX
    for block, iters in kb.STREAM_CONFIGS:
        assert kb._stream_wide(words, block, iters), (block, iters)


def test_earlier_ceilings_keep_the_int32_kernel():
    # the largest ceilings measured before: deepseek-v3 T = 512 fp4_fused (54fb697) and kimi-k2 T = 512 w2_fused
    rows = json.loads((ROOT / "benchmarks" / "results" / "kernels-deepseek-v3-t64-512-54fb697.json").read_text())
    ds_bytes = int(next(r["bytes"] for r in rows["cases"] if r["tokens"] == 512 and r["variant"] == "fp4_fused"))
    for nbytes in (ds_bytes, _measured_bytes(512, "w2_fused")):
        for block, iters in kb.STREAM_CONFIGS:
            assert not kb._stream_wide(nbytes // 4, block, iters), (nbytes, block, iters)


def test_wide_exactly_where_the_last_index_passes_int32():
    for block, iters in kb.STREAM_CONFIGS:
        span = block * iters
        full = (kb.INT32_MAX + 1) // span  # programs whose last index is exactly INT32_MAX
        assert not kb._stream_wide(full * span, block, iters)
        assert kb._stream_wide(full * span + 1, block, iters)


@pytest.mark.parametrize("block,iters", kb.STREAM_CONFIGS)
def test_last_block_start_of_the_kimi_read_is_exact(block, iters):
    words = _measured_bytes(512, "fp4_fused") // 4
    pid, i = triton.cdiv(words, block * iters) - 1, iters - 1
    exact = (pid * iters + i) * block
    assert exact > kb.INT32_MAX
    assert _block_start(pid, i, block, iters, kb._stream_wide(words, block, iters)) == exact
    # the int32 form, the kernel's code before the fix, wraps here: this is the negative index that faulted
    assert _block_start(pid, i, block, iters, False) == exact - 2**32 < 0


@pytest.mark.parametrize("wide", [False, True])
def test_stream_read_sums_every_word(wide):
    block, iters = 32, 2
    words = 5 * block * iters + 7
    src = torch.arange(words + 100, dtype=torch.int32, device=_device()) % 1000
    partial = torch.zeros(triton.cdiv(words, block * iters), dtype=torch.int32, device=_device())
    kb._stream_read_kernel[(partial.numel(),)](src, partial, words, BLOCK=block, ITERS=iters, WIDE=wide)
    assert int(partial.long().sum()) == int(src[:words].long().sum())


@pytest.mark.gpu
def test_stream_read_past_2_31_words_on_the_gpu():
    """The read that faulted at kimi-k2 T = 512, at just over 2^31 words (8 GiB of int32 ones)."""
    words = 2**31 + 3 * 8192 * 4 + 5
    src = torch.ones(words, dtype=torch.int32, device="cuda")
    for block, iters in kb.STREAM_CONFIGS:
        partial = torch.zeros(triton.cdiv(words, block * iters), dtype=torch.int32, device="cuda")
        kb._stream_launch(src, partial, words, block, iters)
        torch.cuda.synchronize()
        assert int(partial.long().sum()) == words, (block, iters)
