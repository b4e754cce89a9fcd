"""What `tierstore inspect` reports about a checkpoint: geometry, expert bytes per precision, what
fits in a GPU and RAM budget, and the codebook report over a sample of expert tensors."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from tierstore.atomic_files import build_once, cache_dir
from tierstore.geometry import MoEGeometry

WORKING_SET_REFUSAL = 1.15  # pools below layers x top-k x tokens x this are refused at start
WORKING_SET_COMFORT = 1.40  # the reference system's comfortable pool size
DEMO_CHECKPOINT_NAME = "demo-qwen3-moe-nvfp4-v2"


def expert_bytes_table(geometry: MoEGeometry) -> dict[str, dict[str, int]]:
    """Per-expert and whole-model routed-expert bytes at bf16, FP4 and W2."""
    per_expert = {"bf16": geometry.bf16_expert_bytes, "fp4": geometry.fp4_expert_bytes, "w2": geometry.w2_expert_bytes}
    return {
        name: {"per_expert": size, "total": size * geometry.total_routed_experts}
        for name, size in per_expert.items()
    }


def budget_fit(geometry: MoEGeometry, dense_bytes: int, gpu_bytes: int | None, ram_bytes: int | None,
               tokens_per_step: int = 1) -> dict:
    """Where W2 experts would live under a budget. Dense weights (attention, embeddings, routers,
    shared experts) stay on the GPU at checkpoint precision; routed experts fill what is left."""
    w2 = geometry.w2_expert_bytes
    total = w2 * geometry.total_routed_experts
    working_set = geometry.num_moe_layers * min(geometry.top_k * tokens_per_step, geometry.num_experts)
    fit = {
        "w2_total_bytes": total,
        "working_set_experts": working_set,
        "min_pool_bytes": math.ceil(working_set * WORKING_SET_REFUSAL) * w2,
        "comfortable_pool_bytes": math.ceil(working_set * WORKING_SET_COMFORT) * w2,
        "gpu_bytes": gpu_bytes,
        "ram_bytes": ram_bytes,
    }
    if gpu_bytes is None:
        return fit
    for_experts = max(gpu_bytes - dense_bytes, 0)
    gpu_experts = min(for_experts // w2, geometry.total_routed_experts)
    fit["gpu_bytes_for_experts"] = for_experts
    fit["gpu_experts"] = gpu_experts
    fit["gpu_coverage"] = gpu_experts / geometry.total_routed_experts
    fit["fp4_all_fit_on_gpu"] = geometry.fp4_expert_bytes * geometry.total_routed_experts <= for_experts
    remaining = total - gpu_experts * w2
    if ram_bytes is not None:
        ram_experts = min(ram_bytes // w2, geometry.total_routed_experts - gpu_experts)
        fit["ram_experts"] = ram_experts
        fit["disk_bytes"] = remaining - ram_experts * w2
    fit["verdict"] = _verdict(fit, dense_bytes)
    return fit


def _verdict(fit: dict, dense_bytes: int) -> str:
    if fit["gpu_bytes_for_experts"] == 0:
        return f"does not run: dense weights ({dense_bytes} B) leave no GPU memory for experts"
    if fit["gpu_bytes_for_experts"] < fit["min_pool_bytes"]:
        return "does not run: the GPU pool would be below the per-step working set (refused at start)"
    if fit["gpu_coverage"] >= 1.0:
        return "all W2 experts fit on the GPU"
    if "disk_bytes" not in fit:
        return "GPU holds part of the W2 experts; give --ram-gb to place the rest"
    if fit["disk_bytes"] == 0:
        return "GPU holds part of the W2 experts, the RAM arena the rest; no disk reads"
    return "GPU and RAM hold part of the W2 experts; the rest is read from the NVMe pack"


def dense_tensor_bytes(checkpoint) -> int:
    """Bytes of every tensor that is not a routed expert's, at checkpoint precision."""
    routed = set()
    for layer in range(checkpoint.geometry.num_moe_layers):
        for expert in checkpoint.layer(layer).experts:
            routed.update(expert.w13.tensor_names)
            routed.update(expert.w2.tensor_names)
    files = checkpoint.files
    return sum(_tensor_bytes(files.dtype(n), files.shape(n)) for n in files.names() if n not in routed)


def _tensor_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    from tierstore.checkpoint.files import DTYPES

    numel = math.prod(shape)
    return numel * DTYPES[dtype].itemsize if dtype in DTYPES else numel


def sampled_experts(num_experts: int, per_layer: int) -> list[int]:
    """`per_layer` expert ids spread evenly over [0, num_experts); 0 means all."""
    if per_layer <= 0 or per_layer >= num_experts:
        return list(range(num_experts))
    return sorted({round(i * (num_experts - 1) / (per_layer - 1)) for i in range(per_layer)} if per_layer > 1 else {0})


def codebook_summary(checkpoint, experts_per_layer: int, zero_mode: str, progress: bool) -> dict:
    """The codebook report (symmetric vs L2-optimal 4-level set) summarised over sampled tensors."""
    from tierstore.formats import codebook_report, summarise_codebook_reports

    geometry = checkpoint.geometry
    experts = sampled_experts(geometry.num_experts, experts_per_layer)
    reports = []
    bar = tqdm(total=geometry.num_moe_layers * len(experts) * 2, desc="codebook report", unit="tensor",
               disable=not progress)
    for layer in checkpoint.iter_layers():
        for expert in (layer.experts[e] for e in experts):
            for matrix in (expert.w13, expert.w2):
                reports.append(codebook_report(matrix.dequantize(), zero_mode=zero_mode))
                bar.update()
    bar.close()
    summary = summarise_codebook_reports(reports)
    levels, count = Counter(tuple(r["asym"]["levels"]) for r in reports).most_common(1)[0]
    summary["most_common_asym_levels"] = [list(levels), count]
    return summary


def inspect_checkpoint(checkpoint, *, gpu_bytes: int | None = None, ram_bytes: int | None = None,
                       experts_per_layer: int = 4, zero_mode: str = "auto", codebook: bool = True,
                       progress: bool = False) -> dict:
    """The whole report as plain data (JSON-serialisable)."""
    geometry = checkpoint.geometry
    dense = dense_tensor_bytes(checkpoint)
    report = {
        "checkpoint": str(checkpoint.path),
        "model_type": checkpoint.model_type,
        "source_format": checkpoint.source_format,
        "geometry": dataclasses.asdict(geometry),
        "expert_bytes": expert_bytes_table(geometry),
        "dense_bytes": dense,
        "fit": budget_fit(geometry, dense, gpu_bytes, ram_bytes),
    }
    if codebook:
        report["codebook"] = codebook_summary(checkpoint, experts_per_layer, zero_mode, progress)
    return report


def demo_checkpoint(progress: bool = False) -> Path:
    """The built-in default checkpoint (a tiny Qwen3-MoE in NVFP4), built on first use under
    $TIERSTORE_CACHE_DIR (default ~/.cache/tierstore)."""
    from tierstore.checkpoint.synthetic import write_synthetic_checkpoint

    return build_once(cache_dir() / DEMO_CHECKPOINT_NAME,
                      lambda staging: write_synthetic_checkpoint(staging, arch="qwen3_moe", fmt="nvfp4", seed=0),
                      progress)
