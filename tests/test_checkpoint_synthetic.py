"""The synthetic checkpoint writer: real naming per family, every format, sharding, heavy tails."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open

from tierstore.checkpoint import SUPPORTED_MODEL_TYPES, open_checkpoint
from tierstore.checkpoint.synthetic import laplace, write_synthetic_checkpoint
from tierstore.errors import CheckpointError

SMALL = dict(num_layers=3, num_experts=4, top_k=2, hidden=64, expert_inter=32)
SHARED = {"qwen2_moe": 1, "deepseek_v2": 2, "deepseek_v3": 1}
DENSE = {"qwen2_moe": 1, "qwen3_moe": 1, "deepseek_v2": 1, "deepseek_v3": 1}


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_every_family_round_trips_through_the_reader(tmp_path, arch):
    path = write_synthetic_checkpoint(tmp_path / arch, arch=arch, num_shared_experts=SHARED.get(arch, 0),
                                      dense_layers=DENSE.get(arch, 0), swiglu_limit=7.0, **SMALL)
    with open_checkpoint(path) as ckpt:
        g = ckpt.geometry
        assert g.moe_layers == tuple(range(DENSE.get(arch, 0), 3))
        assert (g.num_experts, g.top_k, g.hidden, g.expert_inter) == (4, 2, 64, 32)
        assert g.num_shared_experts == SHARED.get(arch, 0) and g.swiglu_limit == 7.0
        assert ckpt.source_format == "bf16"
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for layer in ckpt.iter_layers():
                gate, up, down = layer.experts[3].w13.tensor_names + layer.experts[3].w2.tensor_names
                stored = torch.cat([f.get_tensor(gate), f.get_tensor(up)]).double()
                assert torch.equal(layer.experts[3].w13.dequantize(), stored)
                assert torch.equal(layer.experts[3].w2.dequantize(), f.get_tensor(down).double())
                assert (layer.shared is not None) == (arch in SHARED)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block", "mxfp4"])
def test_quantized_formats_are_declared_and_close_to_the_float_weights(tmp_path, fmt):
    bf16 = open_checkpoint(write_synthetic_checkpoint(tmp_path / "bf16", seed=5, **SMALL))
    quant = open_checkpoint(write_synthetic_checkpoint(tmp_path / fmt, fmt=fmt, seed=5, num_shards=2,
                                                       fp8_block=(32, 32), **SMALL))
    assert quant.source_format == fmt
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    method = {"nvfp4": "modelopt", "fp8_block": "fp8", "mxfp4": "mxfp4"}[fmt]
    assert config["quantization_config"]["quant_method"] == method
    reference = bf16.layer_experts(2)[1].w13.dequantize()
    got = quant.layer_experts(2)[1].w13.dequantize()
    rel = ((got - reference).norm() / reference.norm()).item()
    assert rel < {"nvfp4": 0.15, "fp8_block": 0.05, "mxfp4": 0.25}[fmt]
    assert rel > 0  # it really was quantized


def test_sharded_checkpoint_has_index_and_one_shard_per_layer_group(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "s", num_shards=3, **SMALL)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["weight_map"]["model.layers.2.mlp.experts.0.gate_proj.weight"] == shards[2]
    with open_checkpoint(path) as ckpt:
        assert [p.name for p in ckpt.identity_files()] == ["config.json", "model.safetensors.index.json", *shards]


def test_weights_are_heavy_tailed_and_seeded():
    gen = torch.Generator().manual_seed(0)
    w = laplace((400_000,), gen).double()
    kurtosis = ((w - w.mean()) ** 4).mean() / w.var() ** 2
    assert 5.5 < kurtosis.item() < 6.5  # Laplace has kurtosis 6; a Gaussian has 3
    assert abs(w.std().item() - 0.02) < 0.003
    again = laplace((400_000,), torch.Generator().manual_seed(0))
    assert torch.equal(again.double(), w)


def test_default_demo_checkpoint_is_realistic_and_quick(tmp_path):
    start = time.perf_counter()
    path = write_synthetic_checkpoint(tmp_path / "demo")
    elapsed = time.perf_counter() - start
    with open_checkpoint(path) as ckpt:
        g = ckpt.geometry
    assert (g.num_moe_layers, g.num_experts, g.top_k, g.hidden, g.expert_inter) == (4, 16, 4, 256, 128)
    assert elapsed < 10  # ~0.2 s here; generous for a loaded 2-core CI machine


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="gpt_oss"), "unsupported synthetic arch 'gpt_oss'"),
    (dict(fmt="int4"), "unsupported synthetic format 'int4'"),
    (dict(arch="mixtral", num_shared_experts=1), "mixtral has no shared experts"),
    (dict(arch="olmoe", dense_layers=1), "olmoe has no dense layers"),
    (dict(num_shards=9), "num_shards"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        write_synthetic_checkpoint(tmp_path / "x", **{**SMALL, **kwargs})
