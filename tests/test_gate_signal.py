"""The gate's signal on the device: `signal_tensor` (a captured CUDA graph on CUDA) is bit-identical
to the op-by-op `eager_signal`, for both signals, min and quantile aggregation, several shapes and
dtypes; graphs are kept per logits shape, bounded, and skipped where they cannot serve; tau stays
on the host. On CPU both are the torch definition bit for bit; on CUDA the Triton signal, within
MAX_PROB_RTOL of it for max_prob (another summation order) and exact for margin. CPU tests run
everywhere, the `gpu` ones on a CUDA device."""

from __future__ import annotations

import pytest
import torch

from tierstore.runtime import gate as gate_module
from tierstore.runtime.gate import ConfidenceGate, row_signals

CASES = [(signal, agg) for signal in ("max_prob", "margin") for agg in ("min", "q:0.5", "q:0.1")]
SHAPES = [(1, 32000), (32000,), (5, 1000), (3, 2, 517)]
MAX_PROB_RTOL = 1e-5  # the Triton max_prob against softmax().amax(), both float32


def bits(t: torch.Tensor) -> list[int]:
    """The float32 bit patterns (NaN compares equal to the same NaN)."""
    return t.detach().float().cpu().reshape(-1).view(torch.int32).tolist()


def definition(logits: torch.Tensor, signal: str, agg: str) -> torch.Tensor:
    """The signal as first written: row signals, then torch's min or quantile over them."""
    signals = row_signals(logits, signal)
    quantile = None if agg == "min" else float(agg[2:])
    return (signals.min() if quantile is None else torch.quantile(signals, quantile)).reshape(1)


def random_logits(shape, dtype, device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(shape, generator=gen)).to(device, dtype)


@pytest.mark.parametrize("signal,agg", CASES)
def test_signal_tensor_is_the_definition_bit_for_bit_on_cpu(signal, agg):
    gate = ConfidenceGate(signal, agg=agg)
    for seed, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            logits = random_logits(shape, dtype, "cpu", seed)
            got = gate.signal_tensor(logits)
            assert got.dtype == torch.float32 and got.shape == (1,)
            assert bits(got) == bits(definition(logits, signal, agg))
            assert gate.decide(logits).signal == float(got)


def test_one_row_skips_the_min_exactly_nan_and_inf_included():
    gate = ConfidenceGate("margin")
    for row in ([3.0, 1.0, -2.0], [float("inf"), 0.0, 1.0], [float("nan"), 0.0, 1.0], [0.0, 0.0, 0.0]):
        logits = torch.tensor([row])
        assert bits(gate.signal_tensor(logits)) == bits(definition(logits, "margin", "min"))
    assert bits(ConfidenceGate().signal_tensor(torch.tensor([[float("nan"), 1.0]]))) == \
        bits(definition(torch.tensor([[float("nan"), 1.0]]), "max_prob", "min"))


class FakeGraph:
    """A capture stand-in on CPU: replay recomputes from the captured tensor's storage in place."""

    def __init__(self, compute, logits: torch.Tensor, counts: dict):
        self.compute, self.logits, self.counts = compute, logits, counts
        self.out = compute(logits).clone()

    def replay(self) -> None:
        self.counts["replays"] += 1
        self.out.copy_(self.compute(self.logits))


def fake_graphs(monkeypatch, fail: bool = False) -> dict:
    counts = {"captures": 0, "replays": 0}

    def capture(self, logits):
        counts["captures"] += 1
        if fail:
            return None
        graph = FakeGraph(self._compute, logits, counts)
        return graph, graph.out
    monkeypatch.setattr(gate_module, "_graphable", lambda logits: True)
    monkeypatch.setattr(gate_module.SignalGraphs, "_capture", capture)
    return counts


def test_graph_policy_captures_logits_that_stay_put_and_only_those(monkeypatch):
    counts = fake_graphs(monkeypatch)
    gate, after = ConfidenceGate("margin"), gate_module.GRAPH_AFTER
    static = torch.empty(2, 50)
    for call in range(after + 3):
        static.copy_(random_logits((2, 50), torch.float32, "cpu", call))
        assert bits(gate.signal_tensor(static)) == bits(definition(static, "margin", "min"))
    assert counts == {"captures": 1, "replays": 4}  # captured and replayed on call `after`, then 3 replays
    assert gate.signal_graphed(static)
    fresh = [random_logits((2, 50), torch.float32, "cpu", call) for call in range(after + 1)]
    for logits in fresh:  # a new address every call: eager
        gate.signal_tensor(logits)
    repeated = random_logits((2, 50), torch.float32, "cpu", 7)
    for _ in range(after - 1):  # fewer calls in a row (a fired step and its replays): eager
        gate.signal_tensor(repeated)
    assert counts["captures"] == 1
    others = [torch.zeros(1, 10 + i) for i in range(gate_module.GRAPH_KEYS)]
    for logits in others:
        for _ in range(after):
            gate.signal_tensor(logits)
    assert counts["captures"] == 1 + len(others) and all(gate.signal_graphed(b) for b in others)
    assert not gate.signal_graphed(static)  # dropped as the oldest


def test_a_failed_capture_leaves_its_logits_eager_for_good(monkeypatch):
    counts = fake_graphs(monkeypatch, fail=True)
    gate, logits = ConfidenceGate(), random_logits((3, 40), torch.float32, "cpu", 0)
    for _ in range(3 * gate_module.GRAPH_AFTER):
        assert bits(gate.signal_tensor(logits)) == bits(definition(logits, "max_prob", "min"))
    assert counts == {"captures": 1, "replays": 0} and not gate.signal_graphed(logits)


# -- CUDA --------------------------------------------------------------------------------------------


def refill(buffer: torch.Tensor, seed: int) -> torch.Tensor:
    """New values in place (a captured forward's output: same address every step)."""
    return buffer.copy_(random_logits(buffer.shape, buffer.dtype, buffer.device, seed))


def near_definition(got: torch.Tensor, logits: torch.Tensor, signal: str, agg: str) -> None:
    """margin: equal to the definition; max_prob: within MAX_PROB_RTOL of it; NaN where it is NaN (any NaN bits)."""
    rtol = MAX_PROB_RTOL if signal == "max_prob" else 0
    torch.testing.assert_close(got, definition(logits, signal, agg), rtol=rtol, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("signal,agg", CASES)
def test_the_graph_signal_is_the_eager_signal_bit_for_bit(signal, agg):
    for seed, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            gate = ConfidenceGate(signal, agg=agg)
            logits = torch.empty(shape, dtype=dtype, device="cuda")
            for call in range(gate_module.GRAPH_AFTER + 2):  # eager, ..., capture + replay, replay
                refill(logits, 10 * seed + call)
                got = gate.signal_tensor(logits).clone()
                assert bits(got) == bits(gate.eager_signal(logits))
                near_definition(got, logits, signal, agg)
                assert gate.decide(logits).signal == float(got)
            assert gate.signal_graphed(logits), f"no graph for {shape} {dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("signal", ["max_prob", "margin"])
def test_nan_inf_and_tied_rows_on_cuda_give_the_definition(signal):
    gate = ConfidenceGate(signal)
    logits = torch.empty(4, 32000, device="cuda")
    for call in range(gate_module.GRAPH_AFTER + 2):
        refill(logits, call)
        logits[1, :20000] = float("-inf")  # whole chunks of -inf
        logits[2, 7] = logits[2, 31000] = 50.0  # a tied top-1 in two chunks
        if call % 2:
            logits[3, 12345] = float("nan")  # a NaN row: the min is NaN, as torch.min
        got = gate.signal_tensor(logits).clone()
        assert bits(got) == bits(gate.eager_signal(logits))
        near_definition(got, logits, signal, "min")
        assert (got.isnan().item()) == bool(call % 2)
    assert gate.signal_graphed(logits)


@pytest.mark.gpu
def test_a_strided_view_is_read_in_place_and_new_addresses_run_eagerly():
    gate = ConfidenceGate("margin", agg="q:0.5")
    base = torch.empty(4, 3, 4000, device="cuda")
    view = base[:, -1, :]  # [4, 4000], row stride 12000
    for seed in range(gate_module.GRAPH_AFTER + 2):
        refill(base, seed)
        assert bits(gate.signal_tensor(view)) == bits(gate.eager_signal(view))
    assert gate.signal_graphed(view)
    kept = []
    for seed in range(gate_module.GRAPH_AFTER + 2):
        kept.append(random_logits((4, 4000), torch.float32, "cuda", 100 + seed))  # kept alive: a new address each call
        assert bits(gate.signal_tensor(kept[-1])) == bits(gate.eager_signal(kept[-1]))
    assert not any(gate.signal_graphed(logits) for logits in kept)


@pytest.mark.gpu
def test_graphs_are_bounded_and_skipped_for_repeats_large_or_captured_logits():
    gate = ConfidenceGate("max_prob")
    buffers = [torch.empty(1, 100 + i, device="cuda") for i in range(gate_module.GRAPH_KEYS + 2)]
    for i, logits in enumerate(buffers):
        for call in range(gate_module.GRAPH_AFTER):
            assert bits(gate.signal_tensor(refill(logits, call))) == bits(gate.eager_signal(logits))
    kept = [b for b in buffers if gate.signal_graphed(b)]
    assert kept == buffers[-gate_module.GRAPH_KEYS:]
    once_more = torch.empty(1, 77, device="cuda")
    for call in range(gate_module.GRAPH_AFTER - 1):  # a fired step's replay repeats its logits: no capture
        gate.signal_tensor(refill(once_more, call))
    assert not gate.signal_graphed(once_more)
    large = torch.empty(1, gate_module.GRAPH_MAX_ELEMENTS + 1, device="cuda")
    for call in range(gate_module.GRAPH_AFTER + 1):
        assert bits(gate.signal_tensor(refill(large, call))) == bits(gate.eager_signal(large))
    assert not gate.signal_graphed(large)
    # inside someone else's capture the ops go into their graph
    logits = refill(torch.empty(1, 999, device="cuda"), 1)
    for _ in range(gate_module.GRAPH_AFTER - 1):
        gate.signal_tensor(logits)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        captured = gate.signal_tensor(logits)
    outer.replay()
    assert bits(captured) == bits(gate.eager_signal(logits)) and not gate.signal_graphed(logits)


@pytest.mark.gpu
def test_tau_changes_apply_to_graph_signals(tmp_path):
    path = tmp_path / "tau"
    gate = ConfidenceGate("max_prob", tau=0.5, tau_file=path)
    logits = torch.zeros(1, 64, device="cuda")
    logits[0, 0] = 5.0  # top-1 probability ~0.70
    host = torch.empty(1, pin_memory=True)
    after, decisions = gate_module.GRAPH_AFTER, []
    for step in range(after + 4):
        if step == after + 1:
            gate.set_tau(0.8)
        if step == after + 3:
            path.write_text("0.6")
        host.copy_(gate.signal_tensor(logits), non_blocking=True)
        torch.cuda.synchronize()
        decisions.append(gate.decide_value(float(host[0])).fires)
    assert decisions == [False] * (after + 1) + [True, True, False]
    assert gate.signal_graphed(logits)
