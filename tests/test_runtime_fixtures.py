"""Synthetic experts and a toy routed model for the runtime tests (import as `from test_runtime_fixtures import ...`).

`ToyMoE` is a stack of MoE layers with a residual stream and softmax top-k routing computed from
the hidden state, so a miss in an early layer changes the routing of later ones (second-order
misses), like a real model. Its `forward()` signature matches what `TieredRuntime.step` drives.
"""

from __future__ import annotations

import torch

from tierstore.geometry import MoEGeometry
from tierstore.kernels.layout import pack_slot, w2_slot_layout
from tierstore.runtime import MemoryRowSource


def toy_geometry(layers: int = 3, experts: int = 16, top_k: int = 2, hidden: int = 64, inter: int = 32,
                 swiglu_limit: float | None = None) -> MoEGeometry:
    return MoEGeometry(name="toy", moe_layers=tuple(range(layers)), num_experts=experts, top_k=top_k, hidden=hidden,
                       expert_inter=inter, swiglu_limit=swiglu_limit)


def random_slot_rows(geometry: MoEGeometry, seed: int = 0) -> torch.Tensor:
    """uint8 [L, E, slot_bytes]: random W2 codes with scale bytes around 2^-6 (kernel slot layout)."""
    gen = torch.Generator().manual_seed(seed)
    layout = w2_slot_layout(geometry.hidden, geometry.expert_inter)
    h, i = geometry.hidden, geometry.expert_inter
    rows = torch.zeros(geometry.num_moe_layers, geometry.num_experts, layout.slot_bytes, dtype=torch.uint8)
    for layer in range(geometry.num_moe_layers):
        for expert in range(geometry.num_experts):
            parts = []
            for n, k in ((2 * i, h), (h, i)):
                parts.append(torch.randint(0, 4, (n, k), generator=gen, dtype=torch.uint8))
                parts.append(torch.randint(119, 123, (n, k // 32), generator=gen, dtype=torch.uint8))
            rows[layer, expert] = pack_slot(layout, *parts)
    return rows


def memory_source(geometry: MoEGeometry, seed: int = 0) -> MemoryRowSource:
    return MemoryRowSource(random_slot_rows(geometry, seed))


class ToyMoE:
    """hidden [T, H] -> logits [T, H] through L MoE layers driven by `runtime.moe`."""

    def __init__(self, geometry: MoEGeometry, seed: int = 0):
        gen = torch.Generator().manual_seed(seed + 1)
        self.geometry = geometry
        self.routers = torch.randn(geometry.num_moe_layers, geometry.num_experts, geometry.hidden, generator=gen)

    def route(self, layer: int, x: torch.Tensor):
        probs = torch.softmax(x @ self.routers[layer].to(x.device).T, dim=-1)  # [T, E]
        weights, ids = probs.topk(self.geometry.top_k, dim=-1)  # [T, k]
        return ids, weights / weights.sum(-1, keepdim=True)

    def forward(self, runtime, x: torch.Tensor) -> torch.Tensor:
        for layer in range(self.geometry.num_moe_layers):
            ids, weights = self.route(layer, x)
            x = x + 16 * runtime.moe(layer, x, ids, weights)
        return x


# Tiny transformers configs whose expert sizes fit the kernel slot layout (multiples of 32) and
# with enough experts that a 25% pool still holds one step's working set.
_COMMON = dict(vocab_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
               bos_token_id=0, eos_token_id=1, pad_token_id=2, max_position_embeddings=256)
_DEEPSEEK = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                 num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=16, hidden_size=64,
                 intermediate_size=96, moe_intermediate_size=32)
RUNTIME_HF_CONFIGS = {
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=32, num_local_experts=16)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=16, decoder_sparse_step=1,
                                         mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=16, head_dim=16, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(hidden_size=64, intermediate_size=32, num_experts=16, num_key_value_heads=4)),
    "deepseek_v2": ("DeepseekV2Config", dict(_DEEPSEEK, n_shared_experts=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(_DEEPSEEK, n_shared_experts=1, n_group=2, topk_group=1)),
}


def runtime_hf_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A seeded random-init transformers causal LM whose routed experts suit the runtime."""
    import transformers

    class_name, kwargs = RUNTIME_HF_CONFIGS[model_type]
    config = getattr(transformers, class_name)(**{**_COMMON, **kwargs, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():  # random-init routers are near-uniform (DeepSeek's are zero); make routing matter
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model.to(dtype).eval()


def on_copy_stream(stream: torch.cuda.Stream | int):
    """`torch.cuda.stream` of a pool's copy stream as its hooks get it: a torch stream, or its raw handle (the located
    installs pass handles: `StreamOps`)."""
    return torch.cuda.stream(stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.ExternalStream(stream))


def cuda_toy_model() -> tuple[MoEGeometry, ToyMoE]:
    """(geometry, model) of the CUDA runtime tests: `toy_geometry` at hidden 128, inter 64, the routers on the GPU;
    skips the test without CUDA."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = toy_geometry(hidden=128, inter=64)
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    return g, model


def graph_replayer(forward):
    """`forward` (CUDA) captured into a CUDA graph after one warm-up call on a side stream (compiles the kernels
    outside the capture): a callable that replays the graph and returns the captured output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    from tierstore.runtime.replay_if import capturing

    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with capturing(pool), torch.cuda.graph(graph, pool=pool):
        out = forward()
    return lambda: (graph.replay(), out)[1]


def cuda_decode_steps(rt, model: ToyMoE, geometry: MoEGeometry, graph: bool, steps: int = 24,
                      seeds: list[int] | None = None, outcomes: list | None = None,
                      dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """`steps` single-token decode steps of `model` through `rt` on CUDA (inputs seeded by the step, or by `seeds`),
    eager or each forward captured as a graph (`graph_replayer`; its warm-up call is not armed, so it gathers
    nothing); with config pass_pair the step's pass pair too, with config unwaited_first_pass its first pass.
    Returns each step's output; `outcomes` gets (launched a pair, outcome) of each step. `dtype`: the inputs' (the
    model's routers must match it)."""
    x = torch.zeros(1, geometry.hidden, device="cuda", dtype=dtype)
    forward = lambda: model.forward(rt, x)  # noqa: E731
    pair = rt.pass_pair(forward, lambda: None) if rt.pairs else None
    first = rt.first_pass(forward) if rt.first_passes else None
    if graph:
        pair = graph_replayer(pair) if pair is not None else None
        first = graph_replayer(first) if first is not None else None
        forward = graph_replayer(forward)
    outputs = []
    for step, seed in enumerate(seeds if seeds is not None else range(steps)):
        x.copy_((torch.randn(1, geometry.hidden, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype).cuda())
        pairs = rt.stats().pair_steps if outcomes is not None else 0
        got, outcome = rt.step(forward, lambda: None, forward_pair=pair, forward_first=first)
        outputs.append(got.clone())
        if outcomes is not None:
            outcomes.append((rt.stats().pair_steps > pairs, outcome))
    return outputs


def arena_runtime(geometry: MoEGeometry, slots: int, arena_slots: int | str, tokens: int = 1, device: str = "cpu",
                  backend: str = "auto", **config):
    """(runtime, source): a runtime over `memory_source(geometry, seed=7)` with a pool of `slots` and the config
    fields given; arena_slots "all": an arena holding every row (filled before it returns)."""
    from tierstore.runtime import RuntimeConfig, TieredRuntime

    source = memory_source(geometry, seed=7)
    every = [(layer, expert) for layer in range(geometry.num_moe_layers) for expert in range(geometry.num_experts)]
    rt = TieredRuntime(geometry, source, pool_slots=slots,
                       arena_slots=len(every) if arena_slots == "all" else arena_slots, device=device, backend=backend,
                       config=RuntimeConfig(kpi_every=0, tokens_per_step=tokens, **config))
    if arena_slots == "all":
        rt.arena.fetch(every, scan=True)
    return rt, source
