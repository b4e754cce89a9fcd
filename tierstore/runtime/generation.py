"""Greedy generation of a transformers model whose experts a TieredRuntime serves.

A static KV cache makes a step replayable: before each replay the cache's write position is
rewound, so the replay overwrites the same cache entries with the corrected values. On CUDA the
decode step is captured once as a CUDA graph (pools and tables exist before the capture) and
every pass is a graph replay; elsewhere, or when capture fails, the step runs eagerly.

With config `pass_pair` a decode step may launch its pass and the replay together
(`TieredRuntime.pass_pair`): between them the cache's write position steps back by the one token the
first pass wrote (`_step_back`, a device op, so the pair is captured as one CUDA graph like the step). With config
`unwaited_first_pass` a decode step's first pass is a third graph, the step without the pool's per-layer waits
(`TieredRuntime.first_pass`); its replays run the step's graph.

With a runtime made with `output_words >= 1` and no confidence gate, the decode step's argmax is
computed inside the step and published into the pass log (`TieredRuntime.publish`): the pass-log
read that the step makes anyway brings the next token back, with no copy or sync of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tierstore.errors import ConfigError
from tierstore.runtime.graphs import capture_graphs


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    new_ids: list[int]
    step_logits: list[torch.Tensor] = field(default_factory=list)  # float32 [V] per step (prefill first), if kept
    routing: list = field(default_factory=list)  # int32 [L, k] per decode step, if recorded
    fired: list[bool] = field(default_factory=list)  # per step (prefill first): the confidence gate fired
    all_fp4: list[bool | None] = field(default_factory=list)  # per step: its last pass ran only FP4 experts
    seconds: float = 0.0
    decode_seconds: float = 0.0
    cuda_graph: bool = False
    prefill_chunk: int = 0  # prompt tokens per prefill step (the whole prompt: one step)


class TieredGenerator:
    def __init__(self, model, runtime, max_length: int, use_cuda_graph: bool | None = None):
        from transformers import StaticCache

        self.model, self.runtime, self.max_length = model, runtime, max_length
        self.device = runtime.device
        self.cache = StaticCache(config=model.config, max_cache_len=max_length)
        self.use_cuda_graph = self.device.type == "cuda" if use_cuda_graph is None else use_cuda_graph
        if self.use_cuda_graph and self.device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA device")
        self._ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # [1, 1] static decode input
        self._pos = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # [1, 1]
        self._graph = None
        self._graph_logits = None
        self._pair_graph = None  # config pass_pair: the captured pass pair, and its logits
        self._pair_logits = None
        self._first_graph = None  # config unwaited_first_pass: the captured first pass, and its logits
        self._first_logits = None
        # the gate may return a result other than the last pass's, whose published token would then not match
        self._fold = runtime.log.outputs is not None and getattr(runtime, "gate", None) is None

    # -- cache position -----------------------------------------------------------------------
    def _rewind(self, position: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(position)

    def _step_back(self) -> None:
        """The cache's write position one decode token back, on the device (capturable): a pass pair's replay
        overwrites what its first pass wrote."""
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.sub_(1)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]  # [V]

    # -- decode step ----------------------------------------------------------------------------
    def _decode_eager(self) -> torch.Tensor:
        logits = self._forward(self._ids, self._pos)
        if self._fold:
            self.runtime.publish(logits.argmax().view(1))  # the next token, read back with the pass log
        return logits

    def _decode_pair_eager(self) -> torch.Tensor:
        return self.runtime.pass_pair(self._decode_eager, self._step_back)()

    def _decode_first_eager(self) -> torch.Tensor:
        return self.runtime.first_pass(self._decode_eager)()

    def _capture(self, position: int) -> None:
        pairs, firsts = self.runtime.pairs, self.runtime.first_passes
        launches = ([self._decode_eager] + ([self._decode_pair_eager] if pairs else [])  # a pair: unarmed
                    + ([self._decode_first_eager] if firsts else []))
        captured = capture_graphs(launches, self.device, "the decode step", lambda: self._rewind(position))
        if captured is None:
            self.use_cuda_graph = False
            return
        self._graph, self._graph_logits = captured[0]
        others = iter(captured[1:])
        if pairs:
            self._pair_graph, self._pair_logits = next(others)
        if firsts:
            self._first_graph, self._first_logits = next(others)

    def _decode_pass(self) -> torch.Tensor:
        if self._graph is not None:
            self._graph.replay()
            return self._graph_logits
        return self._decode_eager()

    def _decode_first(self) -> torch.Tensor:
        if self._first_graph is not None:
            self._first_graph.replay()
            return self._first_logits
        return self._decode_first_eager()

    def _decode_pair(self) -> torch.Tensor:
        if self._pair_graph is not None:
            self._pair_graph.replay()
            return self._pair_logits
        return self._decode_pair_eager()

    # -- generation -----------------------------------------------------------------------------
    def prefill_chunk(self, prompt_tokens: int) -> int:
        """Prompt tokens per prefill step: the whole prompt when the device pool can hold every expert
        one MoE layer may route for it (min(experts, tokens x top-k) slots), else the most tokens whose
        worst case fits (pool slots // top-k): a prefill step fetches a layer's whole routed set first."""
        g, slots = self.runtime.geometry, self.runtime.pool.num_slots
        if min(g.num_experts, prompt_tokens * g.top_k) <= slots:
            return prompt_tokens
        return max(1, slots // g.top_k)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, keep_logits: bool = False,
                 record_routing: bool = False, eos_token_id: int | None = None,
                 forced_ids: list[int] | None = None, prefill_chunk: int | None = None) -> GenerationResult:
        """Greedy decoding; `forced_ids` feeds these tokens instead of the argmax (teacher forcing,
        to compare another run's logits step by step on the same sequence). The prompt runs in prefill
        steps of `prefill_chunk` tokens (default `self.prefill_chunk(len(prompt_ids))`); a run compared
        with another bit for bit must use the other's chunk (`result.prefill_chunk`): the logits of
        one prefill step and of several differ in the last bits."""
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        chunk = self.prefill_chunk(len(prompt_ids)) if prefill_chunk is None else prefill_chunk
        if chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {chunk}")
        if len(prompt_ids) + max_new_tokens > self.max_length:
            raise ConfigError(f"prompt ({len(prompt_ids)}) + new tokens ({max_new_tokens}) exceed the static "
                              f"cache of {self.max_length} positions")
        if record_routing and self.runtime.log.routing is None:
            raise ConfigError("routing can be recorded only by a runtime made with record_tokens >= 1")
        result = GenerationResult(list(prompt_ids), [], cuda_graph=False, prefill_chunk=chunk)
        started = time.perf_counter()
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1, P]
        positions = torch.arange(len(prompt_ids), device=self.device)[None]  # [1, P]
        prefill_all_fp4: list[bool | None] = []
        for start in range(0, len(prompt_ids), chunk):
            ids, at = prompt[:, start:start + chunk], positions[:, start:start + chunk]  # [1, C]
            self._rewind(start)
            logits, outcome = self.runtime.step(lambda ids=ids, at=at: self._forward(ids, at),
                                                lambda start=start: self._rewind(start), prefill=True)
            prefill_all_fp4.append(outcome.all_fp4)
        result.fired.append(False)
        result.all_fp4.append(None if None in prefill_all_fp4 else all(prefill_all_fp4))
        decode_started = time.perf_counter()
        published = None  # the last decode step's argmax, from its pass-log read
        for position in range(len(prompt_ids), len(prompt_ids) + max_new_tokens):
            step = position - len(prompt_ids)
            if forced_ids is not None and step < len(forced_ids):
                token = forced_ids[step]
            else:
                token = published if published is not None else int(logits.argmax())
            if keep_logits:
                result.step_logits.append(logits.float().cpu().clone())
            result.new_ids.append(token)
            if token == eos_token_id or position == len(prompt_ids) + max_new_tokens - 1:
                break
            self._ids.fill_(token)
            self._pos.fill_(position)
            if self.use_cuda_graph and self._graph is None:
                self._capture(position)
            self._rewind(position)
            logits, outcome = self.runtime.step(self._decode_pass, lambda p=position: self._rewind(p),
                                                forward_pair=self._decode_pair if self.runtime.pairs else None,
                                                forward_first=self._decode_first if self.runtime.first_passes else None)
            published = int(outcome.last_pass.outputs[0]) if self._fold else None
            result.fired.append(outcome.gate is not None)
            result.all_fp4.append(outcome.all_fp4)
            if record_routing:
                result.routing.append(self.runtime.last_pass.routing[:, 0, :].copy())
        result.cuda_graph = self._graph is not None
        result.decode_seconds = time.perf_counter() - decode_started
        result.seconds = time.perf_counter() - started
        return result
