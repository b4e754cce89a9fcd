"""What the tierstore worker (`tierstore.vllm_adapter.worker`) is needed for, whether vLLM is
configured with it, and the deployments its step hook refuses. Imports vLLM only inside
`tierstore_worker_configured`; the rest is plain Python so it can be tested without vLLM."""

from __future__ import annotations

from tierstore.errors import ConfigError
from tierstore.vllm_adapter.settings import AdapterSettings

WORKER_QUALNAME = "tierstore.vllm_adapter.worker.TieredWorker"


def runner_hook_reason(settings: AdapterSettings) -> str:
    """The knobs that make `settings.needs_runner_hook` true, for error messages."""
    reasons = []
    if settings.uses_fp4_tier:
        reasons.append("DELTA_GB (the FP4 pool's manager is woken at step end)")
    if settings.gate:
        reasons.append("GATE (it reads the step's logits)")
    if settings.uses_expert_cache and settings.execution == "graph":
        reasons.append("BASE_CACHE_GB with EXECUTION=graph (misses are replayed around the forward)")
    return ", ".join(reasons)


def tierstore_worker_configured() -> bool:
    """Whether the current vLLM config's `worker_cls` is tierstore's worker or a subclass of it."""
    from vllm.config import get_current_vllm_config

    name = get_current_vllm_config().parallel_config.worker_cls
    if name == WORKER_QUALNAME:
        return True
    if not isinstance(name, str) or name == "auto":
        return False
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from tierstore.vllm_adapter.worker import TieredWorker

    worker = resolve_obj_by_qualname(name)
    return isinstance(worker, type) and issubclass(worker, TieredWorker)


def v2_runner_refusal(why: str, *, vllm_version: str, env_value: bool | None, forced_by: str | None) -> str:
    """The error for a hook that is needed (`why`: the knobs) while vLLM chose Model Runner V2, naming
    what chose it: a feature that requires V2 (`forced_by`), VLLM_USE_V2_MODEL_RUNNER=1
    (`env_value` True), or vLLM's default (`env_value` None)."""
    cannot = ("tierstore's step hook wraps the V1 GPU model runner's `_model_forward`; Model Runner V2 "
              "(vllm/v1/worker/gpu/model_runner.py) runs its forward inline in `execute_model` and cannot be "
              "hooked without patching vLLM")
    if forced_by is not None:
        return (f"{why}: {cannot}, and vLLM {vllm_version} requires Model Runner V2 for {forced_by} "
                f"(VLLM_USE_V2_MODEL_RUNNER=0 does not override it): turn {forced_by} off, or drop the knobs")
    chose = ("VLLM_USE_V2_MODEL_RUNNER=1 selects Model Runner V2" if env_value
             else f"vLLM {vllm_version} chose Model Runner V2 by default for this model")
    return f"{why}: {cannot}; {chose}: set VLLM_USE_V2_MODEL_RUNNER=0"


def check_hook_deployment(settings: AdapterSettings, *, v2_runner: bool, pipeline_size: int, data_size: int,
                          tensor_size: int, speculative: bool, vllm_version: str = "(unknown version)",
                          v2_env: bool | None = None, v2_forced_by: str | None = None) -> None:
    """Refuse, naming the setting, what the step hook cannot run correctly. Without a knob that needs
    the hook everything passes (the worker then leaves vLLM's runner, V1 or V2, unchanged);
    `v2_env` / `v2_forced_by` say why vLLM chose Model Runner V2 (see `v2_runner_refusal`)."""
    if not settings.needs_runner_hook:
        return  # the hook passes every forward through unchanged
    why = runner_hook_reason(settings)
    if v2_runner:
        raise ConfigError(v2_runner_refusal(why, vllm_version=vllm_version, env_value=v2_env,
                                            forced_by=v2_forced_by))
    if pipeline_size > 1:
        raise ConfigError(f"{why}: the step hook needs the whole model in one process; pipeline parallelism "
                          f"({pipeline_size}) is not supported")
    if data_size > 1:
        raise ConfigError(f"{why}: a replay on one data-parallel rank would desynchronise the others; "
                          f"data parallelism ({data_size}) is not supported")
    if speculative:
        raise ConfigError(f"{why}: speculative decoding is not supported by the step hook (a verify step has "
                          "several logits rows per request); remove the speculative config")
    replays_differ = settings.gate or (settings.uses_expert_cache and settings.execution == "graph")
    if tensor_size > 1 and replays_differ:
        raise ConfigError(f"{why}: each TP rank decides its replays from its own pools, and ranks that disagree "
                          f"would desynchronise the TP collectives; tensor parallelism ({tensor_size}) is "
                          "supported only with EXECUTION=eager and without GATE")
