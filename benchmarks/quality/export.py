"""Export a trained bf16 model as a vendor-style modelopt NVFP4 checkpoint.

    python -m benchmarks.quality.export --run runs/quality --out benchmarks/quality/checkpoint

Routed experts become per-expert modelopt NVFP4 tensors in the classic naming
(`model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.{weight, weight_scale, weight_scale_2,
input_scale}`: e2m1 nibbles packed two per byte, e4m3 scales per 16 weights, an fp32 scale_2 per
tensor, an fp32 activation scale calibrated per layer on training-split text); everything else is
bf16. config.json carries `quantization_config` {quant_method: modelopt, quant_algo: NVFP4}; the
tokenizer, the corpus manifest and the training record are copied alongside. The export then
re-reads itself through `tierstore.checkpoint.open_checkpoint` and checks every expert matrix
decodes to exactly the values that were encoded.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.quality.corpus import Corpus, require_same_corpus
from benchmarks.quality.data import leading_windows
from benchmarks.quality.tokenizer import load_tokenizer_file, tokenizer_hash
from tierstore.checkpoint import open_checkpoint
from tierstore.formats import dequantize_nvfp4, encode_nvfp4

E2M1_MAX, E4M3_MAX = 6.0, 448.0
QUANTIZATION_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                       "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate"]}
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
CALIBRATION_WINDOWS = 8
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_matrices(experts: torch.nn.Module, expert: int) -> dict[str, torch.Tensor]:
    """{projection: [N, K]} of one expert from stacked gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    gate, up = experts.gate_up_proj[expert].chunk(2, dim=0)  # [I, H] each
    return {"gate_proj": gate, "up_proj": up, "down_proj": experts.down_proj[expert]}


@torch.no_grad()
def calibrate_input_amax(model, windows: torch.Tensor) -> dict[int, dict[str, float]]:
    """{decoder layer: {"gate_up": amax of the MoE input, "down": amax of act(gate) * up over routed pairs}}."""
    amax: dict[int, dict[str, float]] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts

        def hook(module, args, index=index):
            hidden, top_k_index = args[0].float(), args[1]  # [T, H], [T, k]
            seen = amax.setdefault(index, {"gate_up": 0.0, "down": 0.0})
            seen["gate_up"] = max(seen["gate_up"], float(hidden.abs().max()))
            for expert in top_k_index.unique().tolist():
                rows = (top_k_index == expert).any(dim=1)
                gate, up = (hidden[rows] @ module.gate_up_proj[expert].float().t()).chunk(2, dim=-1)
                seen["down"] = max(seen["down"], float((module.act_fn(gate) * up).abs().max()))

        handles.append(experts.register_forward_pre_hook(hook))
    try:
        model(input_ids=windows)
    finally:
        for handle in handles:
            handle.remove()
    return amax


def nvfp4_tensors(prefix: str, weight: torch.Tensor, input_amax: float) -> dict[str, torch.Tensor]:
    packed, scale, scale_2 = encode_nvfp4(weight)
    input_scale = max(input_amax, 1e-12) / (E2M1_MAX * E4M3_MAX)
    return {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_scale_2": scale_2.reshape(()),
            f"{prefix}.input_scale": torch.tensor(input_scale, dtype=torch.float32)}


def layer_tensors(model, index: int, amax: dict[str, float]) -> dict[str, torch.Tensor]:
    experts = model.model.layers[index].mlp.experts
    tensors = {}
    for expert in range(experts.gate_up_proj.shape[0]):
        for projection, weight in expert_matrices(experts, expert).items():
            prefix = f"model.layers.{index}.mlp.experts.{expert}.{projection}"
            tensors.update(nvfp4_tensors(prefix, weight, amax["down" if projection == "down_proj" else "gate_up"]))
    return tensors


def dense_tensors(model) -> dict[str, torch.Tensor]:
    """Every non-expert tensor in bf16 (the tied lm_head is left out, as transformers does)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()
            if ".mlp.experts." not in name and not (tied and name == "lm_head.weight")}


def calibration_windows(run: Path, seq_len: int, corpus_root: Path | None) -> torch.Tensor:
    """int64 [n, seq_len] from the first training-split documents, after checking the run's corpus."""
    record = json.loads((run / "training.json").read_text(encoding="utf-8"))
    corpus = Corpus(corpus_root, record.get("corpus_packages", ()))
    require_same_corpus(record["corpus_hash"], corpus.corpus_hash, f"export of {run}")
    tokenizer = load_tokenizer_file(run / "model" / "tokenizer.json")
    if tokenizer_hash(tokenizer) != record["tokenizer_hash"]:
        raise RuntimeError(f"{run}/model/tokenizer.json does not match the training record")
    return leading_windows(tokenizer, corpus.texts("train"), seq_len, CALIBRATION_WINDOWS)


def export(run: Path, out: Path, num_shards: int = 2, corpus_root: Path | None = None) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(run / "model"), dtype=torch.bfloat16).eval()
    num_layers = len(model.model.layers)
    if not 1 <= num_shards <= num_layers:
        raise ValueError(f"num_shards must be in 1..{num_layers}, got {num_shards}")
    seq_len = json.loads((run / "training.json").read_text(encoding="utf-8"))["preset"]["seq_len"]
    amax = calibrate_input_amax(model, calibration_windows(run, seq_len, corpus_root))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weight_map, expected = {}, {}
    for shard in range(num_shards):
        layers = range(num_layers * shard // num_shards, num_layers * (shard + 1) // num_shards)
        tensors = dense_tensors(model) if shard == 0 else {}
        for index in layers:
            tensors.update(layer_tensors(model, index, amax[index]))
        name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        expected.update({n: t for n, t in tensors.items() if n.endswith((".weight", ".weight_scale", ".weight_scale_2"))
                         and ".mlp.experts." in n})
    index = {"metadata": {"total_size": sum((out / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = model.config.to_dict()
    config.update(torch_dtype="bfloat16", quantization_config=QUANTIZATION_CONFIG)
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    producer = {"name": "tierstore benchmarks/quality/export.py (modelopt-style layout, not produced by modelopt)"}
    hf_quant = {"producer": producer, "quantization": {k: v for k, v in QUANTIZATION_CONFIG.items() if k != "quant_method"}}
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n", encoding="utf-8")
    for name in COPIED_FILES:
        if (run / "model" / name).exists():
            shutil.copy(run / "model" / name, out / name)
    shutil.copy(run / "training.json", out / "quality_training.json")
    shutil.copy(run / "corpus_manifest.json", out / "corpus_manifest.json")
    verified = verify_experts(out, expected)
    size = sum(p.stat().st_size for p in out.iterdir())
    return {"out": str(out), "bytes": size, "expert_matrices_verified": verified, "shards": num_shards}


def verify_experts(out: Path, encoded: dict[str, torch.Tensor]) -> int:
    """Check through open_checkpoint that every expert matrix decodes exactly to what was encoded."""
    verified = 0
    with open_checkpoint(out) as ckpt:
        if ckpt.source_format != "nvfp4":
            raise RuntimeError(f"{out}: open_checkpoint reads {ckpt.source_format}, expected nvfp4")
        for layer in ckpt.iter_layers():
            for weights in layer.experts:
                for matrix, projections in ((weights.w13, ("gate_proj", "up_proj")), (weights.w2, ("down_proj",))):
                    prefix = f"model.layers.{layer.decoder_layer}.mlp.experts.{weights.expert}"
                    parts = [dequantize_nvfp4(*(encoded[f"{prefix}.{p}.{s}"] for s in
                                                ("weight", "weight_scale", "weight_scale_2"))) for p in projections]
                    if not torch.equal(matrix.dequantize(), torch.cat(parts, dim=0)):
                        raise RuntimeError(f"{out}: {prefix} {projections} does not read back exactly")
                    verified += len(projections)
    return verified


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="output folder of train.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--corpus-root", type=Path, default=None)
    args = parser.parse_args(argv)
    print(json.dumps(export(args.run, args.out, args.shards, args.corpus_root), indent=2))


if __name__ == "__main__":
    main()
