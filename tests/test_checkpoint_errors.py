"""Broken checkpoints fail with a CheckpointError that names the model_type, tensor or file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.errors import CheckpointError

DIMS = dict(num_layers=2, num_experts=4, top_k=2, hidden=64, expert_inter=32)


def rewrite_tensors(path: Path, change) -> None:
    """Apply `change(tensors)` to the single-file checkpoint at `path`."""
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_model_type_is_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", **DIMS)
    edit_config(path, model_type="jamba")
    with pytest.raises(CheckpointError, match="unsupported model_type 'jamba'"):
        open_checkpoint(path)


def test_missing_expert_tensor_is_named_with_its_file(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", **DIMS)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    rewrite_tensors(path, lambda t: t.pop(name))
    ckpt = open_checkpoint(path)  # layer 0 is intact
    with pytest.raises(CheckpointError, match=re.escape(f"{name} not found in {path / 'model.safetensors'}")):
        list(ckpt.iter_layers())


def test_missing_tensor_in_sharded_checkpoint_names_the_index(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", num_shards=2, **DIMS)
    with pytest.raises(CheckpointError, match=re.escape(f"'model.layers.0.nope' not found in "
                                                        f"{path / 'model.safetensors.index.json'}")):
        open_checkpoint(path).read_tensor("model.layers.0.nope")


def test_missing_router_is_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", arch="mixtral", **DIMS)
    rewrite_tensors(path, lambda t: t.pop("model.layers.0.block_sparse_moe.gate.weight"))
    with pytest.raises(CheckpointError, match=re.escape("model.layers.0.block_sparse_moe.gate.weight not found")):
        open_checkpoint(path)


def test_wrong_shape_is_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", **DIMS)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    rewrite_tensors(path, lambda t: t.update({name: torch.zeros(64, 16, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}' in {path / 'model.safetensors'} has shape "
                                                        "[64, 16], expected [64, 32]")):
        open_checkpoint(path).layer(0)


def test_wrong_quantized_scale_shape_is_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", fmt="nvfp4", **DIMS)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale"
    rewrite_tensors(path, lambda t: t.update({name: t[name][:, :2].contiguous()}))
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}'") + ".*shape \\[32, 2\\], expected \\[32, 4\\]"):
        open_checkpoint(path).layer(1)


def test_nvfp4_scale_2_that_does_not_divide_the_rows_is_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", fmt="nvfp4", **DIMS)
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale_2"
    rewrite_tensors(path, lambda t: t.update({name: torch.ones(3)}))
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}'") + ".*shape \\[3\\], expected \\[\\], or \\[B\\]"):
        open_checkpoint(path).layer(0)


def test_declared_format_must_match_the_stored_tensors(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", **DIMS)
    edit_config(path, quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})
    with pytest.raises(CheckpointError, match="declares nvfp4 but model.layers.0.mlp.experts.0.gate_proj.weight "
                                              "is stored as bf16"):
        open_checkpoint(path)


def test_an_expert_in_another_format_is_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", fmt="fp8_block", **DIMS)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    rewrite_tensors(path, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=re.escape(f"{name} is stored as bf16 but the checkpoint's experts "
                                                        "are fp8_block")):
        list(open_checkpoint(path).iter_layers())


def test_fused_experts_of_wrong_shape_are_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", **DIMS)

    def fuse_badly(tensors):
        tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 60, 64, dtype=torch.bfloat16)
        tensors["model.layers.0.mlp.experts.down_proj"] = torch.zeros(4, 64, 32, dtype=torch.bfloat16)

    rewrite_tensors(path, fuse_badly)
    with pytest.raises(CheckpointError, match=re.escape("'model.layers.0.mlp.experts.gate_up_proj' [4, 60, 64]")):
        open_checkpoint(path)


def test_index_pointing_at_the_wrong_shard_is_named(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", num_shards=2, **DIMS)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.gate.weight"] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="maps tensor 'model.layers.0.mlp.gate.weight' to "
                                              "model-00002-of-00002.safetensors, which does not hold it"):
        open_checkpoint(path)


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "config.json").unlink(), "config.json not found"),
    (lambda p: (p / "config.json").write_text("{"), "config.json is not valid JSON"),
    (lambda p: (p / "model.safetensors").unlink(), "neither model.safetensors nor model.safetensors.index.json"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x05\x00"), "truncated safetensors file"),
    (lambda p: (p / "model.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!"),
     "malformed safetensors header"),
])
def test_damaged_files_are_named(tmp_path, damage, message):
    path = write_synthetic_checkpoint(tmp_path / "c", **DIMS)
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)


def test_layer_index_out_of_range(tmp_path):
    ckpt = open_checkpoint(write_synthetic_checkpoint(tmp_path / "c", **DIMS))
    with pytest.raises(CheckpointError, match="MoE layer 2 out of range 0..1"):
        ckpt.router_weight(2)
    with pytest.raises(CheckpointError, match="is not a directory"):
        open_checkpoint(tmp_path / "absent")
