"""Config `stage_pass_log`: each pass writes its own pass-log read-back (kernels/cuda/log_stage.cu), and the read only
synchronises.

CPU, with the kernel's reference standing in (`RefStager`): a staged pass is read from its staging copy; a pass that
did not stage is read by the copy, also after a staged pass that was never read (the host arms the flag before each
launch); an earlier report's routed experts stay its own when the next pass rewrites the staging copy; the runtime
stages once per read pass (the last MoE layer, or `publish` with output words; never a pair's first pass) and every
step equals the all-resident run, single passes and pairs. GPU: the same runtime on the kernels, eager and under CUDA
graphs, equal to a run with the knob off, every read staged."""

from __future__ import annotations

import pytest
import torch
from test_runtime_fixtures import ToyMoE, arena_runtime, cuda_decode_steps, memory_source, toy_geometry

from tierstore.errors import ConfigError
from tierstore.kernels.cuda.log_stage import stage_log_ref
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.passlog import PassLog

LAYERS, EXPERTS = 3, 8


class RefStager:
    """The kernel's reference behind `LogStager`'s interface (a CPU stand-in); counts the stagings."""

    def __init__(self):
        self.stagings = 0

    def bind(self, words, host, flag):
        def stage():
            self.stagings += 1
            stage_log_ref(words, host.numpy(), flag.numpy())
        return stage


def _pass(log: PassLog, routed: list[int], misses: int = 0, stage: bool = True) -> None:
    """A pass on the CPU, launched as the runtime does (armed): reset, route `routed` (experts of layer 0), count
    `misses`, then stage (or not)."""
    log.arm()
    log.reset()
    log.record(0, torch.tensor([routed]))
    log.counts[:] = torch.tensor([misses, misses], dtype=torch.int32)
    if stage:
        log.stage()


def test_a_staged_pass_is_read_from_its_staging_copy():
    log = PassLog(LAYERS, EXPERTS, top_k=2, capacity=4, device="cpu", stager=RefStager())
    _pass(log, [1, 5], misses=2)
    log.buffer.fill_(-1)  # the device words changed after the pass staged: the read must not copy them
    report = log.read()
    assert log.staged_reads == 1 and report.missing_pairs == 2 and report.routed_ids.tolist() == [1, 5]


def test_a_pass_that_did_not_stage_is_read_by_the_copy_even_after_an_unread_staged_pass():
    log = PassLog(LAYERS, EXPERTS, top_k=2, capacity=4, device="cpu", stager=RefStager())
    _pass(log, [1, 5], misses=2)  # staged, never read
    _pass(log, [2, 3], stage=False)  # armed before it: the flag is the unread pass's no more
    report = log.read()
    assert log.staged_reads == 0 and report.missing_pairs == 0 and report.routed_ids.tolist() == [2, 3]
    assert log.read().routed_ids.tolist() == [2, 3] and log.staged_reads == 0  # read again: the copy again


def test_an_earlier_report_keeps_its_routed_experts_when_the_next_pass_stages():
    log = PassLog(LAYERS, EXPERTS, top_k=2, capacity=4, device="cpu", stager=RefStager())
    _pass(log, [1, 5])
    first = log.read()
    _pass(log, [0, 7])  # rewrites the staging copy before the host looks at `first` again
    second = log.read()
    assert first.routed_ids.tolist() == [1, 5] and second.routed_ids.tolist() == [0, 7]
    assert log.staged_reads == 2


def _staged_runtime(monkeypatch, g, slots: int, output_words: int, **config):
    """A CPU runtime over a pool of `slots` and an arena holding every row, its pass log staging through `RefStager`."""
    stager = RefStager()
    monkeypatch.setattr(TieredRuntime, "_log_stager", lambda self: stager)
    rt = TieredRuntime(g, memory_source(g, seed=7), pool_slots=slots, arena_slots=g.total_routed_experts,
                       config=RuntimeConfig(kpi_every=0, **config), output_words=output_words)
    rt.arena.fetch([(layer, expert) for layer in range(g.num_moe_layers) for expert in range(g.num_experts)], scan=True)
    return rt, stager


@pytest.mark.parametrize("pairs", [False, True], ids=["single", "pairs"])
@pytest.mark.parametrize("publish", [False, True], ids=["no-outputs", "publish"])
def test_the_runtime_stages_each_read_pass_once_and_equals_the_resident_run(monkeypatch, pairs, publish):
    g = toy_geometry(layers=4, experts=16)
    model = ToyMoE(g, seed=3)
    resident = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts,
                             config=RuntimeConfig(kpi_every=0))
    resident.preload()
    config = dict(pass_pair=True, pass_pair_choice="always") if pairs else {}
    # a log with output words: `publish` stages, the last MoE layer does not
    rt, stager = _staged_runtime(monkeypatch, g, 24, 1 if publish else 0, **config)
    log = rt.log

    def forward(x):
        out = model.forward(rt, x)
        if publish:
            rt.publish(out.argmax(-1))
        return out

    reads = 0
    original = log.read

    def counted_read():
        nonlocal reads
        reads += 1
        return original()
    monkeypatch.setattr(log, "read", counted_read)
    with resident, rt:
        for step in range(32):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            run = lambda x=x: forward(x)  # noqa: E731
            got, outcome = rt.step(run, lambda: None,
                                   forward_pair=rt.pass_pair(run, lambda: None) if pairs else None)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            if publish:
                assert outcome.last_pass.outputs[0] == int(want.argmax(-1)[0])
        stats = rt.stats()
    assert stats.replayed_steps > 0 and (stats.pair_steps > 0) == pairs
    assert log.staged_reads == reads == stager.stagings  # each read pass staged once, and only those


def test_a_failed_steps_staged_pass_never_passes_for_a_later_pass_that_did_not_stage(monkeypatch):
    """A step whose forward staged and then raised is never read; the next step's pass does not stage (a log with
    output words whose forward does not publish): its read must copy its own pass, not take the failed one's."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    plain = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts,
                          config=RuntimeConfig(kpi_every=0))
    rt, stager = _staged_runtime(monkeypatch, g, g.total_routed_experts, 1)
    rt.preload()
    plain.preload()
    x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(0)) * 3
    y = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(1)) * 3

    def staged_then_fails():
        out = model.forward(rt, x)
        rt.publish(out.argmax(-1))
        raise RuntimeError("the caller's forward failed after its last MoE layer")

    with rt, plain:
        want = plain.step(lambda: model.forward(plain, y), lambda: None)[1].last_pass.routed_ids.tolist()
        assert want != plain.step(lambda: model.forward(plain, x), lambda: None)[1].last_pass.routed_ids.tolist()
        with pytest.raises(RuntimeError, match="failed after"):
            rt.step(staged_then_fails, lambda: None)
        assert stager.stagings == 1
        _, outcome = rt.step(lambda: model.forward(rt, y), lambda: None)
        assert outcome.last_pass.routed_ids.tolist() == want and rt.log.staged_reads == 0


def test_the_knob_refuses_a_cpu_device_when_required_and_is_off_there_by_default():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    with pytest.raises(ConfigError, match="stage_pass_log needs a CUDA device"):
        TieredRuntime(g, memory_source(g), pool_slots=12, config=RuntimeConfig(stage_pass_log=True))
    with TieredRuntime(g, memory_source(g), pool_slots=12, config=RuntimeConfig(kpi_every=0)) as rt:
        assert not rt.log.stages
    assert RuntimeConfig.from_env({"TIERSTORE_STAGE_PASS_LOG": "0"}).stage_pass_log is False
    with pytest.raises(ConfigError, match="stage_pass_log must be auto, true or false"):
        RuntimeConfig(stage_pass_log="sometimes")


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_cuda_staged_reads_equal_the_copied_reads(graph):
    g = toy_geometry(layers=LAYERS, experts=16, hidden=128, inter=64)
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    runs = {}
    for staged in (False, True):
        rt, _ = arena_runtime(g, 20, "all", device="cuda", backend="triton", stage_pass_log=staged)
        with rt:
            assert rt.log.stages == staged
            runs[staged] = cuda_decode_steps(rt, model, g, graph)
            stats = rt.stats()
            reads = stats.steps + stats.replays - stats.pair_steps  # a pair: two passes, one read
            assert rt.log.staged_reads == (reads if staged else 0) and stats.replayed_steps > 0
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))
