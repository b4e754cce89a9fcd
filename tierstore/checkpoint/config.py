"""config.json -> MoEGeometry and the declared weight format, per supported model_type."""

from __future__ import annotations

import json
from pathlib import Path

from tierstore.errors import CheckpointError
from tierstore.geometry import MoEGeometry

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
DEFAULT_FP8_BLOCK = (128, 128)


def load_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _require(config: dict, *keys: str, default=None, where: str):
    """The first of `keys` present in `config`, else `default`; None default means required."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise CheckpointError(f"{where}: config.json lacks {' / '.join(keys)}")
    return default


def _positive_int(value, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where}: config.json {key} must be a non-negative integer, got {value!r}")
    return value


def moe_layer_indices(config: dict, model_type: str, where: str) -> tuple[int, ...]:
    """Decoder-layer indices that hold routed experts, by each family's own rule."""
    num_layers = _positive_int(_require(config, "num_hidden_layers", where=where), "num_hidden_layers", where)
    if model_type in ("mixtral", "olmoe"):
        return tuple(range(num_layers))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = _positive_int(config.get("decoder_sparse_step") or 1, "decoder_sparse_step", where)
        dense = set(config.get("mlp_only_layers") or ())
        return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    first_dense = _positive_int(config.get("first_k_dense_replace") or 0, "first_k_dense_replace", where)
    freq = _positive_int(config.get("moe_layer_freq") or 1, "moe_layer_freq", where)
    return tuple(i for i in range(first_dense, num_layers) if i % freq == 0)


def _scoring(config: dict, model_type: str, where: str) -> str:
    default = "sigmoid" if model_type == "deepseek_v3" else "softmax"
    scoring = config.get("scoring_func") or default
    if scoring not in ("softmax", "sigmoid"):
        raise CheckpointError(f"{where}: unsupported router scoring_func {scoring!r} (softmax or sigmoid)")
    return scoring


def _norm_topk_prob(config: dict, model_type: str) -> bool:
    if model_type == "mixtral":  # softmax over the top-k logits == renormalised top-k probabilities
        return True
    default = model_type == "deepseek_v3"
    return bool(config.get("norm_topk_prob", default))


def _shared(config: dict, model_type: str, expert_inter: int, where: str) -> tuple[int, int]:
    """(number of shared experts, intermediate size of the one dense shared MLP)."""
    if model_type == "qwen2_moe":
        inter = _positive_int(config.get("shared_expert_intermediate_size") or 0,
                              "shared_expert_intermediate_size", where)
        return (1, inter) if inter else (0, 0)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        count = _positive_int(config.get("n_shared_experts") or 0, "n_shared_experts", where)
        return count, count * expert_inter  # DeepSeek fuses its shared experts into one MLP
    return 0, 0


def geometry_from_config(config: dict, name: str) -> MoEGeometry:
    """Routed-expert geometry of a supported model; `name` labels it (and error messages)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{name}: unsupported model_type {model_type!r}; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    where = f"{name} ({model_type})"
    if model_type in ("mixtral", "olmoe"):
        inter_key = ("intermediate_size",)
    else:
        inter_key = ("moe_intermediate_size",)
    expert_inter = _positive_int(_require(config, *inter_key, where=where), inter_key[0], where)
    num_shared, shared_inter = _shared(config, model_type, expert_inter, where)
    experts = _require(config, "n_routed_experts", "num_experts", "num_local_experts", where=where)
    limit = config.get("swiglu_limit")
    try:
        return MoEGeometry(
            name=name,
            moe_layers=moe_layer_indices(config, model_type, where),
            num_experts=_positive_int(experts, "num_experts", where),
            top_k=_positive_int(_require(config, "num_experts_per_tok", where=where), "num_experts_per_tok", where),
            hidden=_positive_int(_require(config, "hidden_size", where=where), "hidden_size", where),
            expert_inter=expert_inter,
            num_shared_experts=num_shared,
            shared_inter=shared_inter,
            activation=str(config.get("hidden_act", "silu")),
            swiglu_limit=None if limit is None else float(limit),
            scoring=_scoring(config, model_type, where),
            norm_topk_prob=_norm_topk_prob(config, model_type),
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: inconsistent config.json: {e}") from None


def declared_format(config: dict, hf_quant_config: dict | None, where: str) -> tuple[str | None, tuple[int, int]]:
    """(quantized format named by the config or None, FP8 block shape) from quantization_config."""
    quant = config.get("quantization_config")
    if quant is None and hf_quant_config is not None:  # modelopt's separate hf_quant_config.json
        quant = {"quant_method": "modelopt", **(hf_quant_config.get("quantization") or {})}
    if quant is None:
        return None, DEFAULT_FP8_BLOCK
    method = str(quant.get("quant_method", "")).lower()
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise CheckpointError(f"{where}: modelopt quant_algo {algo!r} unsupported (only NVFP4)")
        return "nvfp4", DEFAULT_FP8_BLOCK
    if method == "fp8":
        block = quant.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise CheckpointError(f"{where}: fp8 quantization_config needs weight_block_size [rows, cols] "
                                  f"(per-tensor FP8 is unsupported), got {block!r}")
        return "fp8_block", (block[0], block[1])
    if method == "mxfp4":
        return "mxfp4", DEFAULT_FP8_BLOCK
    raise CheckpointError(f"{where}: unsupported quantization_config quant_method {method!r} "
                          "(modelopt NVFP4, fp8 block, mxfp4)")
