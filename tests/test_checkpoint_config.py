"""config.json -> MoEGeometry and the declared format, per family rule."""

from __future__ import annotations

import pytest

from tierstore.checkpoint.config import declared_format, geometry_from_config
from tierstore.errors import CheckpointError

BASE = {"hidden_size": 128, "num_hidden_layers": 8, "num_experts_per_tok": 2, "hidden_act": "silu"}


def test_qwen_sparse_step_and_mlp_only_layers():
    config = dict(BASE, model_type="qwen2_moe", num_experts=8, moe_intermediate_size=32, decoder_sparse_step=2,
                  mlp_only_layers=[3], shared_expert_intermediate_size=64, norm_topk_prob=True)
    g = geometry_from_config(config, "q")
    assert g.moe_layers == (1, 5, 7)  # (i + 1) % 2 == 0, minus layer 3
    assert (g.num_experts, g.expert_inter, g.num_shared_experts, g.shared_inter) == (8, 32, 1, 64)
    assert g.norm_topk_prob is True


def test_qwen3_moe_accepts_num_local_experts_as_transformers_5_writes_it():
    config = dict(BASE, model_type="qwen3_moe", num_local_experts=6, moe_intermediate_size=16)
    g = geometry_from_config(config, "q3")
    assert g.num_experts == 6 and g.moe_layers == tuple(range(8)) and g.num_shared_experts == 0


def test_deepseek_dense_prefix_layer_freq_scoring_and_clamp():
    config = dict(BASE, model_type="deepseek_v3", n_routed_experts=16, moe_intermediate_size=24,
                  n_shared_experts=2, first_k_dense_replace=3, moe_layer_freq=2, swiglu_limit=10,
                  hidden_act="silu")
    g = geometry_from_config(config, "ds")
    assert g.moe_layers == (4, 6)
    assert (g.num_shared_experts, g.shared_inter) == (2, 48)
    assert g.scoring == "sigmoid" and g.swiglu_limit == 10.0 and g.norm_topk_prob is True
    v2 = geometry_from_config(dict(config, model_type="deepseek_v2", swiglu_limit=None), "ds2")
    assert v2.scoring == "softmax" and v2.swiglu_limit is None and v2.norm_topk_prob is False
    explicit = geometry_from_config(dict(config, model_type="deepseek_v2", scoring_func="sigmoid"), "ds2")
    assert explicit.scoring == "sigmoid"


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"hidden_size": -4}, "hidden_size must be a non-negative integer"),
    ({"num_experts_per_tok": 99}, "top_k 99 > num_experts 8"),
    ({"scoring_func": "relu"}, "scoring_func 'relu'"),
])
def test_bad_configs_are_named(change, message):
    config = dict(BASE, model_type="mixtral", num_local_experts=8, intermediate_size=64)
    with pytest.raises(CheckpointError, match=message):
        geometry_from_config({**config, **change}, "m")


def test_declared_formats():
    assert declared_format({}, None, "x") == (None, (128, 128))
    assert declared_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 128]}},
                           None, "x") == ("fp8_block", (64, 128))
    modelopt = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    assert declared_format(modelopt, None, "x")[0] == "nvfp4"
    assert declared_format({}, {"quantization": {"quant_algo": "NVFP4"}}, "x")[0] == "nvfp4"
    assert declared_format({"quantization_config": {"quant_method": "mxfp4"}}, None, "x")[0] == "mxfp4"


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "fp8"}, "weight_block_size"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8'"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
])
def test_unsupported_quantization_is_named(quant, message):
    with pytest.raises(CheckpointError, match=message):
        declared_format({"quantization_config": quant}, None, "x")
