"""The built-in default model for `tierstore generate --demo`: a tiny random-init Qwen3-MoE saved by
transformers (byte-level vocabulary, no tokenizer files), built once under $TIERSTORE_CACHE_DIR
(default ~/.cache/tierstore) in a temporary folder and renamed into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DEMO_NAME = "demo-generate-qwen3-moe-v1"
DEMO_CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=32,
                   num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   norm_topk_prob=True, max_position_embeddings=512, bos_token_id=0, eos_token_id=None)
DEMO_SEED = 0


def cache_dir() -> Path:
    return Path(os.environ.get("TIERSTORE_CACHE_DIR") or Path.home() / ".cache" / "tierstore")


def demo_checkpoint(progress: bool = False) -> Path:
    import torch
    import transformers

    target = cache_dir() / DEMO_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{DEMO_NAME}.{os.getpid()}.tmp"
    if progress:
        print(f"building the demo checkpoint in {target} (first use only)")
    config = transformers.Qwen3MoeConfig(**DEMO_CONFIG)
    with torch.random.fork_rng():
        torch.manual_seed(DEMO_SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # sharper routers than the near-uniform random init, so routing is skewed
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, 0.3)
    model.to(torch.bfloat16).save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first; keep its copy
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return target
