"""tierstore's vLLM worker: `--worker-cls tierstore.vllm_adapter.worker.TieredWorker`.

It is vLLM's GPU `Worker` whose model runner is `TieredModelRunner`, vLLM's V1 GPU model runner
with its `_model_forward` (the method vLLM documents for subclasses to override) wrapped by
`tierstore.vllm_adapter.step_hook`: miss check, batched fetch and replay around the forward, the
confidence gate on decode batches, the FP4 manager woken at step end. vLLM 0.33 builds the runner
in `Worker._make_model_runner`, which this worker overrides; vLLM 0.24 builds it inline in
`init_device`, so there the runner it built is adopted as a `TieredModelRunner` (the subclass adds
no state, only the two methods). Model Runner V2 has no such method (its forward is inline in
`execute_model`): when a knob needs the hook it is refused, naming what selected it; otherwise the
worker leaves vLLM's runner, V1 or V2, as vLLM builds it (docs/vllm.md).
"""

from __future__ import annotations

import vllm
from vllm import envs
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from tierstore.vllm_adapter.settings import AdapterSettings
from tierstore.vllm_adapter.step_hook import StepBatch, hooked_forward, step_batch
from tierstore.vllm_adapter.tiered import runtime_for_step
from tierstore.vllm_adapter.worker_check import check_hook_deployment


class TieredModelRunner(GPUModelRunner):
    _tierstore_batch: StepBatch | None = None  # the batch of the execute_model call in progress

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._tierstore_batch = step_batch(scheduler_output)
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._tierstore_batch = None

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        def forward():
            return super(TieredModelRunner, self)._model_forward(
                input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                inputs_embeds=inputs_embeds, **model_kwargs)

        def compute_logits(hidden):
            return self.model.compute_logits(hidden)

        return hooked_forward(runtime_for_step(), forward, self._tierstore_batch, compute_logits)


def v2_forced_by(config) -> str | None:
    """The feature of `config` for which vLLM 0.33 selects Model Runner V2 whatever
    VLLM_USE_V2_MODEL_RUNNER says (`VllmConfig.use_v2_model_runner`); None when there is none."""
    if getattr(getattr(config, "attention_config", None), "hisparse_config", None) is not None:
        return "HiSparse attention (attention_config.hisparse_config)"
    if getattr(config, "watermark_config", None) is not None:
        return "watermarking (watermark_config)"
    return None


class TieredWorker(Worker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.vllm_config
        parallel = config.parallel_config
        check_hook_deployment(AdapterSettings.from_environ(), v2_runner=self.use_v2_model_runner,
                              pipeline_size=parallel.pipeline_parallel_size, data_size=parallel.data_parallel_size,
                              tensor_size=parallel.tensor_parallel_size,
                              speculative=config.speculative_config is not None, vllm_version=vllm.__version__,
                              v2_env=envs.VLLM_USE_V2_MODEL_RUNNER, v2_forced_by=v2_forced_by(config))
        # past the check, Model Runner V2 means no knob needs the hook: vLLM's runner is left as built

    def _make_model_runner(self):
        """vLLM >= 0.33's runner factory."""
        if self.use_v2_model_runner:
            return super()._make_model_runner()
        return TieredModelRunner(self.vllm_config, self.device)

    def init_device(self) -> None:
        super().init_device()
        if not self.use_v2_model_runner and not isinstance(self.model_runner, TieredModelRunner):
            # vLLM 0.24: built inline, adopt it
            self.model_runner.__class__ = TieredModelRunner
