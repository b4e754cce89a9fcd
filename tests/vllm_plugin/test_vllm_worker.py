"""tierstore's worker and model-runner hook against the real vLLM package on CPU: loading through
vLLM's own worker import path, the deployment refusals, the batch read from vLLM's
SchedulerOutput, and the hooked `_model_forward` (vLLM's own base method underneath) replaying a
graph-execution expert cache to the resident result. Nothing here launches CUDA: `init_device`,
graph capture and a served request need a GPU with vLLM."""

import dataclasses

import pytest
import torch

from tierstore.errors import ConfigError
from tierstore.vllm_adapter.settings import AdapterSettings
from tierstore.vllm_adapter.step_hook import StepBatch, hooked_forward, step_batch
from tierstore.vllm_adapter.worker_check import WORKER_QUALNAME, check_hook_deployment

from moe_helpers import E, H, I, apply, built_layer, routing

pytestmark = pytest.mark.vllm


def init_worker(harness, path, **parallel):
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    config = VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=harness.model_config(path),
                        parallel_config=ParallelConfig(worker_cls=WORKER_QUALNAME, **parallel))
    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.init_worker([{"vllm_config": config, "local_rank": 0, "rank": 0, "is_driver_worker": True,
                          "distributed_init_method": f"tcp://127.0.0.1:{harness.free_port()}"}])
    return wrapper.worker


def test_vllm_loads_the_worker_by_its_qualified_name(harness, checkpoints, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from tierstore.vllm_adapter.worker import TieredModelRunner, TieredWorker

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    worker = init_worker(harness, checkpoints["bf16"])
    assert type(worker) is TieredWorker and isinstance(worker, Worker)
    assert issubclass(TieredModelRunner, GPUModelRunner)
    assert "_model_forward" in TieredModelRunner.__dict__ and "execute_model" in TieredModelRunner.__dict__
    assert "_model_forward" in GPUModelRunner.__dict__  # the method vLLM documents for subclasses exists


def test_worker_refuses_a_deployment_when_vllm_builds_it(harness, checkpoints, monkeypatch):
    """(vLLM refuses Model Runner V2 on CPU itself, so the worker's V2 refusal is tested through
    check_hook_deployment below.)"""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv("VLLM_MOE_W2_DELTA_GB", "1")
    with pytest.raises(ConfigError, match="data parallelism"):
        init_worker(harness, checkpoints["bf16"], data_parallel_size=2)


def test_worker_setting_is_seen_by_the_layer_check(harness):
    from tierstore.vllm_adapter.worker_check import tierstore_worker_configured

    with harness.cpu_vllm():
        assert not tierstore_worker_configured()
    with harness.cpu_vllm(tiered_worker=True):
        assert tierstore_worker_configured()


GATED = AdapterSettings(fp4_pool_bytes=2**30, gate=True)
GRAPH_CACHE = AdapterSettings(base_cache_bytes=2**30, execution="graph")
EAGER_FP4 = AdapterSettings(fp4_pool_bytes=2**30)
ONE = dict(v2_runner=False, pipeline_size=1, data_size=1, tensor_size=1, speculative=False)


@pytest.mark.parametrize("settings, change, message", [
    (EAGER_FP4, {"pipeline_size": 2}, "pipeline parallelism"),
    (EAGER_FP4, {"data_size": 2}, "data parallelism"),
    (EAGER_FP4, {"speculative": True}, "speculative decoding"),
    (GATED, {"tensor_size": 2}, "tensor parallelism"),
    (GRAPH_CACHE, {"tensor_size": 2}, "tensor parallelism"),
    (EAGER_FP4, {"v2_runner": True}, "VLLM_USE_V2_MODEL_RUNNER=0"),
])
def test_hook_refuses_what_it_cannot_run(settings, change, message):
    with pytest.raises(ConfigError, match=message):
        check_hook_deployment(settings, **{**ONE, **change})


def test_hook_accepts_tp_with_eager_fp4_pool_and_anything_without_tiers():
    check_hook_deployment(EAGER_FP4, **{**ONE, "tensor_size": 4})
    check_hook_deployment(AdapterSettings(), **{**ONE, "tensor_size": 4, "pipeline_size": 2, "speculative": True,
                                             "v2_runner": True})


V2 = {**ONE, "v2_runner": True, "vllm_version": "0.33.0"}


@pytest.mark.parametrize("change, says, not_says", [
    ({}, ["vLLM 0.33.0 chose Model Runner V2 by default", "set VLLM_USE_V2_MODEL_RUNNER=0"], ["=1"]),
    ({"v2_env": True}, ["VLLM_USE_V2_MODEL_RUNNER=1 selects Model Runner V2", "set VLLM_USE_V2_MODEL_RUNNER=0"],
     ["by default"]),
    ({"v2_forced_by": "watermarking (watermark_config)"},
     ["vLLM 0.33.0 requires Model Runner V2 for watermarking", "VLLM_USE_V2_MODEL_RUNNER=0 does not override",
      "turn watermarking (watermark_config) off"], ["set VLLM_USE_V2_MODEL_RUNNER=0"]),
])
def test_v2_refusal_names_the_knobs_and_what_chose_v2(change, says, not_says):
    with pytest.raises(ConfigError) as refused:
        check_hook_deployment(GATED, **{**V2, **change})
    message = str(refused.value)
    assert message.startswith("DELTA_GB") and "GATE" in message and "`_model_forward`" in message
    assert all(s in message for s in says) and not any(s in message for s in not_says)


def test_v2_forced_by_reads_the_features_vllm_033_forces_v2_for():
    from types import SimpleNamespace

    from tierstore.vllm_adapter.worker import v2_forced_by

    plain = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), watermark_config=None)
    assert v2_forced_by(plain) is None and v2_forced_by(SimpleNamespace()) is None  # 0.24: neither field
    hisparse = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=object()), watermark_config=None)
    assert v2_forced_by(hisparse).startswith("HiSparse")
    assert v2_forced_by(SimpleNamespace(watermark_config=object())).startswith("watermarking")


def test_worker_leaves_vllms_v2_runner_as_built(monkeypatch):
    """Past the check, V2 means no knob needs the hook: 0.33's factory defers to vLLM's, and 0.24's
    inline-built runner is not adopted (a V1 runner is)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from tierstore.vllm_adapter.worker import TieredModelRunner, TieredWorker

    class V2Runner:  # stands in for vllm.v1.worker.gpu.model_runner.GPUModelRunner (needs CUDA to build)
        pass

    worker = object.__new__(TieredWorker)
    if hasattr(Worker, "_make_model_runner"):  # vLLM >= 0.33
        monkeypatch.setattr(Worker, "_make_model_runner", lambda self: V2Runner())
        worker.use_v2_model_runner = True
        assert type(worker._make_model_runner()) is V2Runner
    built = {True: V2Runner, False: lambda: object.__new__(GPUModelRunner)}
    for v2, expected in ((True, V2Runner), (False, TieredModelRunner)):
        monkeypatch.setattr(Worker, "init_device", lambda self: setattr(self, "model_runner", built[v2]()))
        worker.use_v2_model_runner = v2
        worker.init_device()
        assert type(worker.model_runner) is expected


def scheduler_output(**fields):
    from vllm.v1.core.sched.output import SchedulerOutput

    return dataclasses.replace(SchedulerOutput.make_empty(), **fields)


def test_step_batch_reads_vllms_scheduler_output():
    decode = scheduler_output(num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2)
    assert step_batch(decode) == StepBatch(decode=True, rows=2)
    chunk = scheduler_output(num_scheduled_tokens={"a": 1, "b": 7}, total_num_scheduled_tokens=8)
    assert step_batch(chunk) == StepBatch(decode=False, rows=2)
    new = scheduler_output(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, scheduled_new_reqs=[object()])
    assert not step_batch(new).decode
    spec = scheduler_output(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
                            scheduled_spec_decode_tokens={"a": [5]})
    assert not step_batch(spec).decode
    assert step_batch(scheduler_output()) is None


def test_hook_without_runtime_or_batch_is_one_plain_forward():
    calls = []

    def forward():
        calls.append(1)
        return torch.ones(1)

    hooked_forward(None, forward, StepBatch(True, 1), compute_logits=None)
    hooked_forward(object(), forward, None, compute_logits=None)
    assert len(calls) == 2


class TwoLayerModel(torch.nn.Module):
    """Stands in for vLLM's model under the runner: vLLM's real MoE layers, chained."""

    def __init__(self, layers, weights, ids):
        super().__init__()
        self.layers, self.weights, self.ids = layers, weights, ids

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        first = inputs_embeds + apply(self.layers[0], inputs_embeds, self.weights, self.ids)
        return first + apply(self.layers[1], first, self.weights, self.ids)


def test_hooked_model_forward_replays_a_graph_cache_to_the_resident_result(harness, checkpoints, monkeypatch):
    """The runner's `_model_forward` as vLLM 0.24's worker installs it (the built runner adopted as
    TieredModelRunner), over vLLM's own base method, with a device pool that starts empty."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tierstore.vllm_adapter.expert_compute import w2_slot_bytes
    from tierstore.vllm_adapter.tiered import current_runtime
    from tierstore.vllm_adapter.worker import TieredModelRunner

    x, _, weights, ids = routing(harness, tokens=6, seed=21)
    with harness.cpu_vllm():
        layers = [built_layer(harness, checkpoints["bf16"], layer=layer)[1] for layer in (0, 1)]
        expected = TwoLayerModel(layers, weights, ids)(None, None, inputs_embeds=x)
    monkeypatch.setenv("VLLM_MOE_W2_BASE_CACHE_GB", f"{2 * E * w2_slot_bytes(H, I)}B")
    monkeypatch.setenv("VLLM_MOE_W2_EXECUTION", "graph")
    with harness.cpu_vllm(tiered_worker=True):
        layers = [built_layer(harness, checkpoints["bf16"], layer=layer)[1] for layer in (0, 1)]
        runner = object.__new__(GPUModelRunner)  # no CUDA: the instance without GPUModelRunner.__init__
        runner.__class__ = TieredModelRunner
        runner.model = TwoLayerModel(layers, weights, ids)
        runner._tierstore_batch = StepBatch(decode=True, rows=6)
        out = runner._model_forward(input_ids=None, positions=None, inputs_embeds=x)
        stats = current_runtime().stats()
    assert torch.equal(out, expected)
    assert stats.steps == 1 and stats.replays >= 1


def test_execute_model_exposes_the_batch_during_the_call_only(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tierstore.vllm_adapter.worker import TieredModelRunner

    seen = []
    monkeypatch.setattr(GPUModelRunner, "execute_model", lambda self, out, tensors=None: seen.append(
        self._tierstore_batch) or "output")
    runner = object.__new__(TieredModelRunner)
    output = scheduler_output(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1)
    assert runner.execute_model(output) == "output"
    assert seen == [StepBatch(True, 1)] and runner._tierstore_batch is None
