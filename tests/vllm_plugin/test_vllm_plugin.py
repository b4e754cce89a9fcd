"""Plugin discovery and config selection through vLLM's own code paths (CPU, real vllm package)."""

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from tierstore.checkpoint.synthetic import write_synthetic_checkpoint

pytestmark = pytest.mark.vllm


def test_entry_point_is_declared_and_vllm_loads_it():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.plugins import load_general_plugins

    ours = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "tierstore"]
    assert [ep.value for ep in ours] == ["tierstore.vllm_adapter:register"]
    load_general_plugins()
    from tierstore.vllm_adapter.quant_config import TierstoreConfig

    assert "tierstore" in QUANTIZATION_METHODS
    assert get_quantization_config("tierstore") is TierstoreConfig


def test_register_is_idempotent():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from tierstore.vllm_adapter import register

    register()
    register()
    assert QUANTIZATION_METHODS.count("tierstore") == 1


def test_importing_the_plugin_package_does_not_import_vllm():
    code = "import sys, tierstore.vllm_adapter; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_register_in_a_fresh_process_through_vllms_loader():
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.model_executor.layers.quantization import get_quantization_config as g; "
            "print(g('tierstore').__name__)")
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "TierstoreConfig"


def _model_config(path, quantization):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), skip_tokenizer_init=True, quantization=quantization).create_model_config()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    made = {}
    for fmt in ("bf16", "nvfp4", "fp8_block", "mxfp4"):
        made[fmt] = write_synthetic_checkpoint(root / fmt, arch="qwen3_moe", num_layers=1, num_experts=8, top_k=2,
                                               hidden=128, expert_inter=64, fmt=fmt, fp8_block=(32, 32))
    native = write_synthetic_checkpoint(root / "native", arch="qwen3_moe", num_layers=1, num_experts=8, top_k=2,
                                        hidden=128, expert_inter=64, fmt="bf16")
    config = json.loads((native / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "tierstore", "source_format": "bf16"}
    (native / "config.json").write_text(json.dumps(config))
    made["native"] = native
    return made


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8_block", "mxfp4"])
def test_cli_quantization_tierstore_selects_the_config(checkpoints, fmt):
    assert _model_config(checkpoints[fmt], "tierstore").quantization == "tierstore"


def test_checkpoint_quant_method_selects_the_config_without_cli(checkpoints):
    assert _model_config(checkpoints["native"], None).quantization == "tierstore"


def test_checkpoint_without_cli_keeps_its_own_method(checkpoints):
    assert _model_config(checkpoints["fp8_block"], None).quantization == "fp8"


def test_vllm_builds_the_config_with_the_checkpoint_format(checkpoints):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    from tierstore.vllm_adapter.quant_config import TierstoreConfig

    for fmt, expected in (("nvfp4", "nvfp4"), ("fp8_block", "fp8_block"), ("bf16", "bf16"), ("native", "bf16")):
        config = get_quant_config(_model_config(checkpoints[fmt], "tierstore"), LoadConfig())
        assert isinstance(config, TierstoreConfig)
        assert config.source_format.name == expected
    assert get_quant_config(_model_config(checkpoints["fp8_block"], "tierstore"), LoadConfig()).source_format.fp8_block \
        == (32, 32)


def test_unreadable_checkpoint_format_is_refused_by_name(checkpoints, tmp_path):
    config = json.loads((checkpoints["bf16"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="'gptq' is not an expert format tierstore reads"):
        _model_config(tmp_path, "tierstore")
