"""Model and training presets: `h200` (the run that makes the lab's model) and `tiny` (CPU smoke tests).

Shapes keep every expert contraction dimension a multiple of 32 (the W2 block) and the h200
expert intermediate size a multiple of 256 (the kernels pad otherwise).

h200 size estimate (NVFP4 experts at 4.5 bits per weight, everything else bf16): routed experts
8 layers x 32 experts x 3 x 256 x 256 = 50.3M weights -> 28.3 MB; attention 8 x 196,608 = 1.57M
-> 3.1 MB; tied embedding 4096 x 256 -> 2.1 MB; routers and norms < 0.2 MB: about 34 MB in all.
Compute per token ~6 x 8.9M active weights = 53 MFLOP plus attention.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainPreset:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    seq_len: int
    batch_size: int  # sequences per optimizer step
    learning_rate: float
    min_lr_ratio: float  # final learning rate / peak
    warmup_fraction: float  # of the schedule (steps or seconds)
    weight_decay: float
    router_aux_loss_coef: float
    eval_windows: int  # validation windows of seq_len tokens per evaluation
    eval_every_s: float
    corpus_packages: tuple[str, ...] = ()  # installed packages whose sources join the stdlib corpus

    def model_config(self, bos_id: int, eos_id: int, pad_id: int):
        """The transformers Qwen3MoeConfig of this preset (every decoder layer is an MoE layer)."""
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=4 * self.hidden_size, moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=4 * self.seq_len, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=self.router_aux_loss_coef,
            tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
            rope_theta=10000.0,
        )

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "h200": TrainPreset(vocab_size=4096, hidden_size=256, moe_intermediate_size=256, num_experts=32,
                        num_experts_per_tok=4, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, seq_len=512, batch_size=64, learning_rate=2e-3, min_lr_ratio=0.1,
                        warmup_fraction=0.03, weight_decay=0.1, router_aux_loss_coef=0.01, eval_windows=256,
                        eval_every_s=30.0,
                        corpus_packages=("networkx", "numpy", "pandas", "scipy", "sklearn", "sympy", "torch")),
    "tiny": TrainPreset(vocab_size=320, hidden_size=64, moe_intermediate_size=64, num_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=32, seq_len=64, batch_size=8, learning_rate=3e-3, min_lr_ratio=0.1,
                        warmup_fraction=0.1, weight_decay=0.0, router_aux_loss_coef=0.01, eval_windows=4,
                        eval_every_s=0.0),
}
