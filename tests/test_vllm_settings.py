"""The adapter's knobs and checkpoint-format detection (no vLLM needed: these modules do not import it)."""

import pytest
import torch

from tierstore.errors import ConfigError
from tierstore.vllm_adapter.settings import KNOBS, AdapterSettings, read_knobs
from tierstore.vllm_adapter.source_formats import param_specs, source_format_from_quant_config, SourceFormat


def test_defaults_when_nothing_is_set():
    settings = AdapterSettings.from_environ({})
    assert settings == AdapterSettings()
    assert not settings.uses_expert_cache and settings.replay_mode == "strict" and settings.fp_max == 32


def test_reference_names_and_tierstore_names_are_aliases(tmp_path):
    env = {"VLLM_MOE_W2_BASE_CACHE_GB": "1.5", "TIERSTORE_FP_MAX": "4", "VLLM_MOE_W2_REPLAY_MODE": "approximate",
           "VLLM_MOE_W2_DELTA_GB": "auto", "VLLM_MOE_W2_GATE": "1", "TIERSTORE_GATE_TAU": "0.7",
           "VLLM_MOE_W2_STORE_DIR": str(tmp_path), "VLLM_MOE_W2_BASE_RAM_GB": "512MiB"}
    settings = AdapterSettings.from_environ(env)
    assert settings.base_cache_bytes == int(1.5 * 2**30)
    assert settings.fp_max == 4 and settings.replay_mode == "approximate"
    assert settings.fp4_pool_bytes == "auto" and settings.gate and settings.gate_tau == 0.7
    assert settings.store_dir == tmp_path and settings.base_ram_bytes == 512 * 2**20


def test_every_knob_has_a_default_and_a_meaning():
    names = [k.name for k in KNOBS]
    assert len(names) == len(set(names))
    assert all(k.meaning for k in KNOBS)
    assert set(read_knobs({})) == set(names)


@pytest.mark.parametrize("env, message", [
    ({"VLLM_MOE_W2_FP_MAX": "2", "TIERSTORE_FP_MAX": "3"}, "disagree"),
    ({"VLLM_MOE_W2_NO_SUCH_KNOB": "1"}, "VLLM_MOE_W2_NO_SUCH_KNOB"),
    ({"TIERSTORE_GATE": "1"}, "needs an FP4 pool"),
    ({"TIERSTORE_GATE_TAU": "1.5"}, "GATE_TAU"),
    ({"TIERSTORE_GATE_TAU": "high"}, "GATE_TAU"),
    ({"TIERSTORE_REPLAY_MODE": "lenient"}, "REPLAY_MODE"),
    ({"TIERSTORE_FP_MAX": "0"}, "FP_MAX"),
    ({"TIERSTORE_BASE_MISS_TOL": "-1"}, "BASE_MISS_TOL"),
    ({"TIERSTORE_BASE_CACHE_GB": "lots"}, "BASE_CACHE_GB"),
    ({"TIERSTORE_BASE_CACHE_GB": "auto"}, "not `auto`"),
    ({"TIERSTORE_BASE_RAM_GB": "4"}, "needs STORE_DIR"),
    ({"TIERSTORE_TIER_DIRECT": "1"}, "needs STORE_DIR"),
    ({"TIERSTORE_STORE_DIR": "/no/such/folder"}, "is not a folder"),
    ({"TIERSTORE_ZERO_MODE": "zero"}, "ZERO_MODE"),
    ({"TIERSTORE_EXECUTION": "lazy"}, "EXECUTION"),
    ({"TIERSTORE_GATE": "maybe"}, "GATE must be 0 or 1"),
    ({"TIERSTORE_CUDA_W2": "maybe"}, "CUDA_W2 must be 0 or 1"),
])
def test_bad_knobs_are_refused_naming_the_knob(env, message):
    with pytest.raises(ConfigError, match=message):
        AdapterSettings.from_environ(env)


def test_other_tierstore_variables_are_not_the_adapters_business():
    assert AdapterSettings.from_environ({"TIERSTORE_CACHE_DIR": "/tmp"}) == AdapterSettings()


@pytest.mark.parametrize("quant_config, name, block", [
    (None, "bf16", (128, 128)),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "nvfp4", (128, 128)),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}, "nvfp4", (128, 128)),
    ({"quant_method": "fp8", "weight_block_size": [64, 32]}, "fp8_block", (64, 32)),
    ({"quant_method": "mxfp4"}, "mxfp4", (128, 128)),
    ({"quant_method": "tierstore", "source_format": "fp8_block", "weight_block_size": [32, 32]}, "fp8_block", (32, 32)),
])
def test_source_format_from_checkpoint_quant_config(quant_config, name, block):
    assert source_format_from_quant_config(quant_config) == SourceFormat(name, block)


@pytest.mark.parametrize("quant_config, message", [
    ({"quant_method": "gptq"}, "'gptq'"),
    ({"quant_method": "fp8"}, "block"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "only NVFP4"),
    ({"quant_method": "tierstore", "source_format": "int3"}, "int3"),
])
def test_unreadable_formats_are_named(quant_config, message):
    with pytest.raises(ConfigError, match=message):
        source_format_from_quant_config(quant_config)


def test_param_shapes_per_format():
    import torch

    shapes = {s.name: s.shape for s in param_specs(SourceFormat("nvfp4"), 4, 256, 64, torch.bfloat16)}
    assert shapes["w13_weight"] == (4, 128, 128) and shapes["w2_weight"] == (4, 256, 32)
    assert shapes["w13_weight_scale"] == (4, 128, 16) and shapes["w13_weight_scale_2"] == (4, 2)
    fp8 = {s.name: s.shape for s in param_specs(SourceFormat("fp8_block", (128, 128)), 4, 256, 192, torch.bfloat16)}
    assert fp8["w13_weight_scale_inv"] == (4, 4, 2) and fp8["w2_weight_scale_inv"] == (4, 2, 2)


def test_adapter_knobs_map_onto_the_runtime_config(tmp_path):
    from tierstore.runtime.fp4_sizing import fp4_pool_slots
    from tierstore.vllm_adapter.tiered import runtime_config

    settings = AdapterSettings.from_environ({
        "VLLM_MOE_W2_DELTA_GB": "512MiB", "VLLM_MOE_W2_GATE": "1", "VLLM_MOE_W2_GATE_TAU": "0.7",
        "VLLM_MOE_W2_GATE_TAU_FILE": str(tmp_path / "tau"), "VLLM_MOE_W2_FP_MAX": "4",
        "VLLM_MOE_W2_REPLAY_MODE": "approximate", "VLLM_MOE_W2_BASE_MISS_TOL": "2", "VLLM_MOE_W2_KPI_EVERY": "9"})
    config = runtime_config(settings)
    assert (config.gate, config.gate_tau, config.gate_tau_file) == (True, 0.7, str(tmp_path / "tau"))
    assert (config.fp_max, config.replay_mode, config.miss_tolerance, config.kpi_every) == (4, "approximate", 2, 9)
    assert fp4_pool_slots(config, 1000, 10**9, torch.device("cpu")) == 512 * 2**20 // 1000  # the bytes, exactly
    assert runtime_config(AdapterSettings(fp4_pool_bytes="auto")).fp4_pool_gb == "auto"
    assert runtime_config(AdapterSettings()).fp4_pool_gb == "0.0" and not runtime_config(AdapterSettings()).gate
    assert not config.cuda_w2 and settings.cuda_w2 is False
    assert config.pass_pair is False  # the adapter does not launch pass pairs
    assert config.stream_arena is False  # nor stream from the arena (not run under vLLM on a GPU yet)
    knob = AdapterSettings.from_environ({"VLLM_MOE_W2_CUDA_W2": "1"})
    assert knob.cuda_w2 and runtime_config(knob).cuda_w2  # the expert cache / FP4 runtime gets the knob too


def test_resident_kernel_backend_hands_moe_mm_the_cuda_kernels_where_the_rule_says(monkeypatch):
    """KernelBackend with CUDA_W2: a workspace per batch shape routed at the runtime's block size, the CUDA whole op
    passed only where the rule serves the batch; without the knob moe_mm's own rule and no CUDA op."""
    pytest.importorskip("triton")
    import tierstore.kernels as kernels_module
    from tierstore.runtime.compute import cuda_w2_block_tokens
    from tierstore.vllm_adapter.expert_compute import KernelBackend

    passed = []

    def moe_mm(x, ids, weights, w2, fp4, layer, misses, workspace, swiglu_limit=None, cuda_w2=None):
        passed.append((workspace.block_tokens, cuda_w2))
        return torch.zeros_like(x)

    monkeypatch.setattr(kernels_module, "moe_mm", moe_mm)
    experts, top_k, hidden, inter = 16, 2, 512, 512
    table = torch.arange(experts, dtype=torch.int32).view(1, -1)
    slots = (torch.zeros(experts, KernelBackend(hidden, inter, experts).layout.slot_bytes, dtype=torch.uint8),)
    op = object()  # stands in for the CUDA whole op (built on a GPU machine by cuda_w2_kernels)
    tokens = (1, 4, 64, 512, 513)  # 2 / 8 / 128 / 1024 / 1026 pairs over 16 experts
    for cuda_w2, dtype in ((op, torch.bfloat16), (None, torch.float32)):
        backend = KernelBackend(hidden, inter, experts, cuda_w2=cuda_w2)
        for t in tokens:
            ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(t)])
            backend.run(torch.zeros(t, hidden, dtype=dtype), ids, torch.ones(t, top_k), table, slots, None)
    rule = [cuda_w2_block_tokens(t * top_k, experts) for t in tokens]
    assert rule == [1, 16, 16, 16, None]
    assert passed[:5] == [(1, op), (16, op), (16, op), (16, op), (64, None)]  # 1026 pairs: moe_mm's own 64
    assert passed[5:] == [(1, None), (1, None), (16, None), (64, None), (64, None)]
    with pytest.raises(ConfigError, match="CUDA_W2=1 needs bfloat16 hidden states, got torch.float32"):
        KernelBackend(hidden, inter, experts, cuda_w2=op).run(torch.zeros(1, hidden), torch.zeros(1, top_k, dtype=torch.long),
                                                             torch.ones(1, top_k), table, slots, None)


@pytest.mark.parametrize("settings, runtime, hook", [
    (AdapterSettings(), False, False),
    (AdapterSettings(base_cache_bytes=1), True, False),
    (AdapterSettings(base_cache_bytes=1, execution="graph"), True, True),
    (AdapterSettings(execution="graph"), False, False),
    (AdapterSettings(fp4_pool_bytes=1), True, True),
    (AdapterSettings(fp4_pool_bytes="auto", gate=True), True, True),
])
def test_which_settings_use_the_runtime_and_need_the_runner_hook(settings, runtime, hook):
    assert settings.uses_runtime == runtime and settings.needs_runner_hook == hook

