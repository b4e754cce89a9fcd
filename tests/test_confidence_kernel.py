"""The gate's Triton signal (`kernels.confidence`) against its plain-torch reference and against the softmax
definition the gate started from: random logits of several vocab sizes (non-multiples of the chunk) and rows
1..8, ties, -inf (single entries, whole chunks, whole rows), +inf and NaN rows, fp32 / fp16 / bf16; repeated calls
give identical bytes; rows and min slots are all written (output poisoned first). Without CUDA the kernels run
in Triton's CPU interpreter (fp32 / fp16); the `gpu` tests run compiled, bf16 included, and under a CUDA graph."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tierstore.kernels.confidence import MAX_BLOCK, MAX_CHUNKS, confidence, confidence_ref, supported  # noqa: E402
from tierstore.runtime.gate import row_signals  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIGNALS = ("max_prob", "margin")
RTOL = 1e-5  # max_prob against the reference and softmax().amax(): float32 sums in another order; margin: exact
POISON = -12345.0
VOCABS = [2, 3, 100, 257, 1000, 4099, 32000, 40961]


def random_logits(rows: int, vocab: int, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, vocab, generator=gen)).to(DEVICE, dtype)


def run(logits: torch.Tensor, signal: str, reduce_min: bool) -> torch.Tensor:
    """The kernel into a poisoned out [R + 1]: the slots it must not write stay poisoned (checked)."""
    rows = logits.reshape(-1, logits.shape[-1]).shape[0]
    out = torch.full((rows + 1,), POISON, device=logits.device)
    got = confidence(logits, signal, reduce_min, out=out)
    assert got.data_ptr() == (out[rows:] if reduce_min else out).data_ptr()
    assert not reduce_min or (out[:rows] != POISON).all()  # the row signals are written either way
    assert reduce_min or out[rows].item() == POISON
    return got


def check(got: torch.Tensor, want: torch.Tensor, signal: str) -> None:
    """max_prob within RTOL, margin equal; NaN exactly where want is NaN (any NaN bits)."""
    torch.testing.assert_close(got, want, rtol=RTOL if signal == "max_prob" else 0, atol=0, equal_nan=True)


def softmax_definition(logits: torch.Tensor, signal: str, reduce_min: bool) -> torch.Tensor:
    """max_prob as softmax().amax() in float64: torch's own float32 softmax strays from it by up to 1.3e-5 over
    40961 logits on some CPUs (the kernel by 1e-7), more than RTOL; margin as the gate's host signal."""
    if signal == "max_prob":
        signals = torch.softmax(logits.reshape(-1, logits.shape[-1]).double(), dim=-1).amax(dim=-1).float()
        return signals.min().reshape(1) if reduce_min else signals
    signals = row_signals(logits, signal)
    return signals.min().reshape(1) if reduce_min else signals


@pytest.mark.parametrize("signal", SIGNALS)
def test_random_logits_match_the_reference_and_the_softmax_definition(signal):
    for seed, vocab in enumerate(VOCABS):
        for rows in (1, 2, 5, 8):
            logits = random_logits(rows, vocab, torch.float32, 100 * seed + rows)
            for reduce_min in (True, False):
                got = run(logits, signal, reduce_min)
                assert got.dtype == torch.float32 and got.shape == ((1,) if reduce_min else (rows,))
                check(got, confidence_ref(logits, signal, reduce_min), signal)
                check(got, softmax_definition(logits, signal, reduce_min), signal)


@pytest.mark.parametrize("signal", SIGNALS)
def test_ties_infinities_and_nan_rows_are_the_definition(signal):
    vocab = 4099  # chunks of 256: the last one partial
    logits = random_logits(8, vocab, torch.float32, 7)
    logits[0, 5] = logits[0, 4000] = 30.0  # a tied top-1 in two chunks: margin 0, max_prob ~1/2
    logits[1, 10] = logits[1, 11] = 30.0  # tied inside one chunk
    logits[2, :3000] = float("-inf")  # whole chunks of -inf
    logits[3, ::3] = float("-inf")  # scattered -inf
    logits[4] = float("-inf")  # a row of -inf only: NaN for both signals (softmax and topk alike)
    logits[5, 2048] = float("inf")  # one +inf: max_prob NaN (softmax), margin inf
    logits[6] = 1.5  # constant row: max_prob 1/V, margin 0
    for row, reduce_min in ((7, False), (None, True)):
        if row is not None:
            logits[row, 1234] = float("nan")
        rows = run(logits, signal, False)
        check(rows, confidence_ref(logits, signal, False), signal)
        check(rows, softmax_definition(logits, signal, False), signal)
        check(run(logits, signal, True), softmax_definition(logits, signal, True), signal)
    assert run(logits, signal, True).isnan().item()  # a NaN row makes the min NaN, as torch.min
    assert not run(logits[:4], signal, True).isnan().item()
    tied = run(logits[:2], signal, False)
    if signal == "margin":
        assert tied.tolist() == [0.0, 0.0]
    else:
        assert 0.49 < tied.min().item() <= 0.5


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_half_logits_accumulate_in_float32(dtype):
    for signal in SIGNALS:
        for seed, (rows, vocab) in enumerate([(1, 32000), (3, 1000), (8, 517)]):
            logits = random_logits(rows, vocab, dtype, seed)
            for reduce_min in (True, False):
                got = run(logits, signal, reduce_min)
                check(got, confidence_ref(logits, signal, reduce_min), signal)
                check(got, softmax_definition(logits, signal, reduce_min), signal)


def test_repeated_calls_give_identical_bytes_and_views_are_read_in_place():
    base = random_logits(12, 5000, torch.float32, 3).reshape(4, 3, 5000)
    view = base[:, 1, :]  # [4, 5000], row stride 15000
    assert not view.is_contiguous() and supported(view)
    for signal in SIGNALS:
        first = run(view, signal, False).cpu()
        for _ in range(2):
            assert torch.equal(run(view, signal, False).cpu().view(torch.int32), first.view(torch.int32))
        check(first, confidence_ref(view.contiguous(), signal, False).cpu(), signal)  # `first` came to the host


def test_what_the_kernel_does_not_take():
    assert not supported(torch.zeros(1, MAX_CHUNKS * MAX_BLOCK + 1, device=DEVICE))
    assert supported(torch.zeros(1, MAX_CHUNKS * MAX_BLOCK, device=DEVICE))
    assert not supported(torch.zeros(1, 100, dtype=torch.float64, device=DEVICE))
    assert not supported(torch.zeros(100, 3, device=DEVICE).t())  # column stride != 1
    with pytest.raises(ValueError, match="signal"):
        confidence(torch.zeros(1, 10, device=DEVICE), "entropy", True)
    with pytest.raises(ValueError, match="out"):
        confidence(torch.zeros(2, 10, device=DEVICE), "margin", True, out=torch.empty(2, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936, MAX_CHUNKS * MAX_BLOCK])
def test_large_vocabs_and_a_captured_graph_on_cuda(vocab):
    for signal in SIGNALS:
        logits = random_logits(2, vocab, torch.bfloat16, vocab)
        eager = run(logits, signal, True).clone()
        check(eager, softmax_definition(logits, signal, True), signal)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = confidence(logits, signal, True)
        graph.replay()
        assert torch.equal(captured.view(torch.int32), eager.view(torch.int32))
        logits.copy_(random_logits(2, vocab, torch.bfloat16, vocab + 1))
        graph.replay()
        assert torch.equal(captured.view(torch.int32), confidence(logits, signal, True).view(torch.int32))
