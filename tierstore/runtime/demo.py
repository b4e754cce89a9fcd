"""The built-in default model for `tierstore generate --demo`: a tiny random-init Qwen3-MoE saved by
transformers (byte-level vocabulary, no tokenizer files), built once under $TIERSTORE_CACHE_DIR
(default ~/.cache/tierstore) in a temporary folder and renamed into place."""

from __future__ import annotations

from pathlib import Path

from tierstore.atomic_files import build_once, cache_dir

DEMO_NAME = "demo-generate-qwen3-moe-v1"
DEMO_CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=32,
                   num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   norm_topk_prob=True, max_position_embeddings=512, bos_token_id=0, eos_token_id=None)
DEMO_SEED = 0


def demo_checkpoint(progress: bool = False) -> Path:
    return build_once(cache_dir() / DEMO_NAME, _save_demo_model, progress)


def _save_demo_model(staging: Path) -> None:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(**DEMO_CONFIG)
    with torch.random.fork_rng():
        torch.manual_seed(DEMO_SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # sharper routers than the near-uniform random init, so routing is skewed
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, 0.3)
    model.to(torch.bfloat16).save_pretrained(staging)
