"""NVFP4 / FP8-block / MXFP4 checkpoints (sharded, with an index) against the formats' own decoders."""

from __future__ import annotations

import pytest
import torch
from checkpoint_fixtures import quantize_checkpoint, save_hf_checkpoint, tiny_hf_model
from safetensors.torch import load_file, save_file

from tierstore.checkpoint import open_checkpoint
from tierstore.errors import CheckpointError
from tierstore.formats import dequantize_fp8_block, dequantize_mxfp4, dequantize_nvfp4

pytest.importorskip("transformers")

FP8_BLOCK = (16, 32)  # rectangular and smaller than the matrices, so edge blocks are partial


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory):
    """A DeepSeek-V3-style bf16 checkpoint (dense layer 0, routed + shared experts, K multiples of 32)."""
    return save_hf_checkpoint(tiny_hf_model("deepseek_v3", seed=11), tmp_path_factory.mktemp("dsv3") / "bf16")


FORMATS = ["nvfp4", "fp8_block", "mxfp4"]


@pytest.fixture(scope="module")
def quantized_checkpoints(bf16_source, tmp_path_factory):
    """fmt -> (checkpoint dir, every tensor written), three shards each."""
    built = {}
    for fmt in FORMATS:
        dst = tmp_path_factory.mktemp(fmt) / "ckpt"
        built[fmt] = dst, quantize_checkpoint(bf16_source, dst, fmt, num_shards=3, fp8_block=FP8_BLOCK)
    return built


def decode(fmt: str, written: dict, prefix: str) -> torch.Tensor:
    """float64 [N, K] from the tensors the fixture wrote, through the formats module's decoder."""
    if fmt == "nvfp4":
        return dequantize_nvfp4(written[f"{prefix}.weight"], written[f"{prefix}.weight_scale"],
                                written[f"{prefix}.weight_scale_2"])
    if fmt == "fp8_block":
        return dequantize_fp8_block(written[f"{prefix}.weight"], written[f"{prefix}.weight_scale_inv"], FP8_BLOCK)
    return dequantize_mxfp4(written[f"{prefix}.weight"], written[f"{prefix}.weight_scale"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_expert_dequantizes_exactly_like_the_formats_decoder(quantized_checkpoints, fmt):
    path, written = quantized_checkpoints[fmt]
    with open_checkpoint(path) as ckpt:
        assert ckpt.source_format == fmt
        assert len(ckpt.identity_files()) == 2 + 3  # config, index, three shards
        layers = 0
        for layer in ckpt.iter_layers():
            layers += 1
            base = f"model.layers.{layer.decoder_layer}.mlp"
            for weights in layer.experts:
                prefix = f"{base}.experts.{weights.expert}"
                want13 = torch.cat([decode(fmt, written, f"{prefix}.gate_proj"),
                                    decode(fmt, written, f"{prefix}.up_proj")])
                assert weights.w13.format == weights.w2.format == fmt
                assert torch.equal(weights.w13.dequantize(), want13)
                assert torch.equal(weights.w2.dequantize(), decode(fmt, written, f"{prefix}.down_proj"))
            shared = layer.shared
            want_shared = torch.cat([decode(fmt, written, f"{base}.shared_experts.gate_proj"),
                                     decode(fmt, written, f"{base}.shared_experts.up_proj")])
            assert torch.equal(shared.w13.dequantize(), want_shared)
            assert torch.equal(shared.w2.dequantize(), decode(fmt, written, f"{base}.shared_experts.down_proj"))
        assert layers == ckpt.geometry.num_moe_layers == 2


def test_nvfp4_w13_halves_keep_their_own_scale_2(quantized_checkpoints):
    path, written = quantized_checkpoints["nvfp4"]
    with open_checkpoint(path) as ckpt:
        w13 = ckpt.layer_experts(0)[1].w13
        gate, up = (f"model.layers.1.mlp.experts.1.{p}" for p in ("gate_proj", "up_proj"))
        scale_2 = [written[f"{p}.weight_scale_2"] for p in (gate, up)]
        assert scale_2[0].item() != scale_2[1].item()
        half = ckpt.geometry.expert_inter
        per_row = torch.cat([scale_2[0].reshape(1).expand(half), scale_2[1].reshape(1).expand(half)])  # [2I]
        fused = dequantize_nvfp4(torch.cat([written[f"{gate}.weight"], written[f"{up}.weight"]]),
                                 torch.cat([written[f"{gate}.weight_scale"], written[f"{up}.weight_scale"]]),
                                 per_row)
        assert torch.equal(w13.dequantize(), fused)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block"])
def test_mxfp4_parts_refused_for_other_formats(quantized_checkpoints, fmt):
    with open_checkpoint(quantized_checkpoints[fmt][0]) as ckpt:
        weights = ckpt.layer_experts(1)[4]
        with pytest.raises(CheckpointError, match="not mxfp4"):
            weights.w13.mxfp4_parts()


def test_mxfp4_parts_are_the_stored_bytes_verbatim(quantized_checkpoints):
    path, written = quantized_checkpoints["mxfp4"]
    with open_checkpoint(path) as ckpt:
        weights = ckpt.layer_experts(1)[4]
        prefix = "model.layers.2.mlp.experts.4"
        packed, scale = weights.w13.mxfp4_parts()
        assert torch.equal(packed, torch.cat([written[f"{prefix}.gate_proj.weight"],
                                              written[f"{prefix}.up_proj.weight"]]))
        assert torch.equal(scale, torch.cat([written[f"{prefix}.gate_proj.weight_scale"],
                                             written[f"{prefix}.up_proj.weight_scale"]]))
        packed2, scale2 = weights.w2.mxfp4_parts()
        assert torch.equal(packed2, written[f"{prefix}.down_proj.weight"])
        assert torch.equal(scale2, written[f"{prefix}.down_proj.weight_scale"])


def test_mxfp4_scales_stored_as_float8_e8m0_read_the_same(quantized_checkpoints, tmp_path):
    path, written = quantized_checkpoints["mxfp4"]
    retyped = tmp_path / "e8m0"
    retyped.mkdir()
    for file in path.iterdir():
        if file.suffix != ".safetensors":
            (retyped / file.name).write_bytes(file.read_bytes())
            continue
        tensors = load_file(file)
        for name in tensors:
            if name.endswith("_proj.weight_scale"):
                tensors[name] = tensors[name].view(torch.float8_e8m0fnu)
        save_file(tensors, str(retyped / file.name))
    prefix = "model.layers.1.mlp.experts.0.down_proj"
    with open_checkpoint(path) as original, open_checkpoint(retyped) as e8m0:
        assert e8m0.files.dtype(f"{prefix}.weight_scale") == "F8_E8M0"
        a, b = original.layer_experts(0)[0], e8m0.layer_experts(0)[0]
        assert torch.equal(b.w2.mxfp4_parts()[1], written[f"{prefix}.weight_scale"])
        assert torch.equal(a.w13.dequantize(), b.w13.dequantize())
        assert torch.equal(a.w2.dequantize(), b.w2.dequantize())


def fuse_gate_up_per_expert(written: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors with each routed expert's gate and up stored as one `gate_up_proj` (NVFP4: scale_2 [2])."""
    fused = {}
    for name, tensor in written.items():
        if ".experts." not in name or ".up_proj." in name:
            continue
        if ".gate_proj." not in name:
            fused[name] = tensor
            continue
        up = written[name.replace(".gate_proj.", ".up_proj.")]
        if name.endswith("input_scale"):  # activation scale, shared by both halves
            together = tensor
        elif name.endswith("weight_scale_2"):
            together = torch.stack([tensor, up])  # [2]: one per half
        else:
            together = torch.cat([tensor, up])
        fused[name.replace(".gate_proj.", ".gate_up_proj.")] = together
    return {**{n: t for n, t in written.items() if ".experts." not in n}, **fused}


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_expert_fused_gate_up_reads_like_separate_halves(quantized_checkpoints, tmp_path, fmt):
    path, written = quantized_checkpoints[fmt]
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_bytes((path / "config.json").read_bytes())
    save_file(fuse_gate_up_per_expert(written), str(fused_dir / "model.safetensors"))
    with open_checkpoint(path) as separate, open_checkpoint(fused_dir) as fused:
        assert fused.source_format == fmt
        for a, b in zip(separate.iter_layers(), fused.iter_layers()):
            for x, y in zip(a.experts, b.experts):
                assert y.w13.tensor_names[0].endswith(f"experts.{y.expert}.gate_up_proj.weight")
                assert torch.equal(x.w13.dequantize(), y.w13.dequantize())
                assert torch.equal(x.w2.dequantize(), y.w2.dequantize())
    if fmt == "nvfp4":
        assert written["model.layers.1.mlp.experts.0.gate_proj.weight_scale_2"].item() != \
            written["model.layers.1.mlp.experts.0.up_proj.weight_scale_2"].item()
