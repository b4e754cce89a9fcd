"""The reader against transformers' own parameters, for checkpoints written by save_pretrained."""

from __future__ import annotations

import pytest
import torch
from checkpoint_fixtures import (
    TINY_CONFIGS,
    expected_experts,
    save_hf_checkpoint,
    tiny_hf_model,
    transpose_fused_checkpoint,
)

from tierstore.checkpoint import open_checkpoint

pytest.importorskip("transformers")

MODEL_TYPES = list(TINY_CONFIGS)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """model_type -> (state dict, config, {layout: checkpoint dir}); each model built once per session."""
    built = {}
    for model_type in MODEL_TYPES:
        model = tiny_hf_model(model_type, seed=7)
        root = tmp_path_factory.mktemp(model_type)
        dirs = {"classic": save_hf_checkpoint(model, root / "classic"),
                "fused": save_hf_checkpoint(model, root / "fused", fused=True)}
        dirs["fused_transposed"] = transpose_fused_checkpoint(dirs["fused"], root / "fused_t")
        built[model_type] = (model.state_dict(), model.config, dirs)
    return built


EXPECTED_MOE_LAYERS = {"mixtral": (0, 1, 2), "qwen2_moe": (0, 2), "qwen3_moe": (0, 1, 2), "olmoe": (0, 1, 2),
                       "deepseek_v2": (1, 2), "deepseek_v3": (1, 2)}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_geometry_matches_the_transformers_config(hf_models, model_type):
    state, config, dirs = hf_models[model_type]
    with open_checkpoint(dirs["classic"]) as ckpt:
        g = ckpt.geometry
    assert g.moe_layers == EXPECTED_MOE_LAYERS[model_type]
    gate_up = state[f"model.layers.{g.moe_layers[0]}.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    assert (g.num_experts, 2 * g.expert_inter, g.hidden) == tuple(gate_up.shape)
    assert g.top_k == config.num_experts_per_tok
    assert g.activation == config.hidden_act
    assert g.scoring == ("sigmoid" if model_type == "deepseek_v3" else "softmax")
    assert g.norm_topk_prob == (model_type in ("mixtral", "qwen3_moe", "deepseek_v3"))
    shared = {"qwen2_moe": (1, 24), "deepseek_v2": (2, 32), "deepseek_v3": (1, 32)}.get(model_type, (0, 0))
    assert (g.num_shared_experts, g.shared_inter) == shared


@pytest.mark.parametrize("layout", ["classic", "fused", "fused_transposed"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_experts_equal_the_model_parameters_exactly(hf_models, model_type, layout):
    state, _, dirs = hf_models[model_type]
    with open_checkpoint(dirs[layout]) as ckpt:
        assert ckpt.source_format == "bf16"
        seen = []
        for layer in ckpt.iter_layers():
            seen.append(layer.decoder_layer)
            expected = expected_experts(state, layer.decoder_layer)
            assert [w.expert for w in layer.experts] == list(range(len(expected)))
            for weights, (w13, w2) in zip(layer.experts, expected):
                got13, got2 = weights.w13.dequantize(), weights.w2.dequantize()
                assert got13.dtype == torch.float64 and weights.w13.shape == tuple(w13.shape)
                assert torch.equal(got13, w13)
                assert torch.equal(got2, w2)
        assert tuple(seen) == ckpt.geometry.moe_layers


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_router_and_shared_experts_equal_the_model_parameters(hf_models, model_type):
    state, _, dirs = hf_models[model_type]
    with open_checkpoint(dirs["classic"]) as ckpt:
        for index, decoder_layer in enumerate(ckpt.geometry.moe_layers):
            block = f"model.layers.{decoder_layer}.mlp"
            assert torch.equal(ckpt.router_weight(index), state[f"{block}.gate.weight"])
            bias = ckpt.router_bias(index)
            if model_type == "deepseek_v3":
                assert torch.equal(bias, state[f"{block}.gate.e_score_correction_bias"])
            else:
                assert bias is None
            shared = ckpt.shared_experts(index)
            name = {"qwen2_moe": "shared_expert", "deepseek_v2": "shared_experts",
                    "deepseek_v3": "shared_experts"}.get(model_type)
            if name is None:
                assert shared is None
                continue
            gate, up, down = (state[f"{block}.{name}.{p}.weight"].double()
                              for p in ("gate_proj", "up_proj", "down_proj"))
            assert torch.equal(shared.w13.dequantize(), torch.cat([gate, up]))
            assert torch.equal(shared.w2.dequantize(), down)
            if model_type == "qwen2_moe":
                assert torch.equal(ckpt.read_tensor(shared.gate_name), state[f"{block}.shared_expert_gate.weight"])
            else:
                assert shared.gate_name is None


def test_layer_experts_dict_and_identity_files(hf_models):
    _, _, dirs = hf_models["mixtral"]
    with open_checkpoint(dirs["classic"]) as ckpt:
        experts = ckpt.layer_experts(1)
        assert sorted(experts) == [0, 1, 2, 3]
        assert experts[2].w13.tensor_names == ("model.layers.1.block_sparse_moe.experts.2.w1.weight",
                                               "model.layers.1.block_sparse_moe.experts.2.w3.weight")
        assert [p.name for p in ckpt.identity_files()] == ["config.json", "model.safetensors"]


def test_float32_checkpoint_reads_as_fp32(tmp_path):
    model = tiny_hf_model("olmoe", seed=3, dtype=torch.float32)
    state = model.state_dict()
    with open_checkpoint(save_hf_checkpoint(model, tmp_path / "olmoe32")) as ckpt:
        assert ckpt.source_format == "fp32"
        layer = next(ckpt.iter_layers())
        w13, w2 = expected_experts(state, layer.decoder_layer)[3]
        assert torch.equal(layer.experts[3].w13.dequantize(), w13)
        assert torch.equal(layer.experts[3].w2.dequantize(), w2)
