"""Decoding through SwitchableExperts with the confidence gate, and the teacher-forced scores.

A gated step runs the model once; rows whose top-1 probability is <= tau ("fired") are re-run
after the KV cache is cropped back to the step's start, with every routed expert of those rows
served from the upgrade (FP4) bank in every layer. Re-routing of later layers is part of that
forward, so one replay reaches the fixed point an unlimited per-step budget would. Rows that did
not fire are recomputed with the same weights and keep their values. With `fp4_prefill` the
prompt runs on the upgrade bank (the design's rule that prefill must not write a 2-bit KV cache). Promotions do not persist
across steps here (no pool dynamics); a static pool is the separate `pool` setting.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from benchmarks.quality.switchable import PrecisionControl


def _cache_keyword(model) -> str:
    """transformers renamed `past_key_values` to `cache` in the 5.x series; accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


@dataclass
class DecodeResult:
    logits: torch.Tensor  # float32 [B, S, V]: the final logits of every scored step
    fired: torch.Tensor  # bool [B, S]: the gate fired on that row's step (prefill never fires)
    routing: list[torch.Tensor]  # per decode step: int [L, B, k], the final routing of that step
    tokens: torch.Tensor | None = None  # int64 [B, N] generated tokens (greedy mode)


class GatedDecoder:
    def __init__(self, model, control: PrecisionControl, tau: float | None, fp4_prefill: bool = False):
        self.model, self.control, self.tau, self.fp4_prefill = model, control, tau, fp4_prefill
        self.keyword = _cache_keyword(model)

    def _forward(self, ids: torch.Tensor, cache, force_rows: torch.Tensor | None):
        self.control.force_rows = force_rows
        self.control.start_capture()
        try:
            logits = self.model(input_ids=ids, use_cache=True, **{self.keyword: cache}).logits[:, -1].float()
        finally:
            self.control.force_rows = None
            routing = self.control.stop_capture()
        return logits, torch.stack(routing)  # [B, V], [L, B, k]

    def _prefill_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Prefill never fires the gate; with `fp4_prefill` every prompt row runs on the upgrade bank."""
        return torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if self.fp4_prefill else None

    def _step(self, ids: torch.Tensor, cache):
        """One decode step: ([B, V] logits, [B] fired, [L, B, k] routing)."""
        logits, routing = self._forward(ids, cache, None)
        fired = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        if self.tau is not None:
            fired = torch.softmax(logits, dim=-1).amax(dim=-1) <= self.tau
            if bool(fired.any()):
                cache.crop(-1)  # drop this step's entries (a negative count removes tokens in every 5.x)
                replay, replay_routing = self._forward(ids, cache, fired)
                logits = torch.where(fired[:, None], replay, logits)
                routing = torch.where(fired[None, :, None], replay_routing, routing)
        return logits, fired, routing

    @torch.no_grad()
    def score(self, ids: torch.Tensor, prefill: int) -> DecodeResult:
        """Teacher-forced: prefill ids[:, :prefill], then one gated step per later token but the last.

        Returns logits predicting ids[:, prefill:] (S = T - prefill steps).
        """
        cache = _new_cache(self.model)
        first, _ = self._forward(ids[:, :prefill], cache, self._prefill_rows(ids))
        logits, fired, routing = [first], [torch.zeros_like(ids[:, 0], dtype=torch.bool)], []
        for t in range(prefill, ids.shape[1] - 1):
            step_logits, step_fired, step_routing = self._step(ids[:, t:t + 1], cache)
            logits.append(step_logits)
            fired.append(step_fired)
            routing.append(step_routing)
        return DecodeResult(torch.stack(logits, 1), torch.stack(fired, 1), routing)

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, new_tokens: int) -> DecodeResult:
        """Greedy continuation of equal-length prompts [B, P] by `new_tokens` tokens (EOS not special)."""
        cache = _new_cache(self.model)
        step_logits, _ = self._forward(prompts, cache, self._prefill_rows(prompts))
        logits, fired, routing, tokens = [step_logits], [torch.zeros_like(prompts[:, 0], dtype=torch.bool)], [], []
        for n in range(new_tokens):
            tokens.append(step_logits.argmax(dim=-1))
            if n == new_tokens - 1:
                break
            step_logits, step_fired, step_routing = self._step(tokens[-1][:, None], cache)
            logits.append(step_logits)
            fired.append(step_fired)
            routing.append(step_routing)
        return DecodeResult(torch.stack(logits, 1), torch.stack(fired, 1), routing, torch.stack(tokens, 1))


@torch.no_grad()
def teacher_forced_logits(model, control: PrecisionControl, windows: torch.Tensor, batch_size: int,
                          device: torch.device) -> torch.Tensor:
    """float32 [n, L-1, V] logits predicting windows[:, 1:], full-sequence forwards, no gate."""
    control.force_rows = None
    out = []
    for chunk in windows.split(batch_size):
        out.append(model(input_ids=chunk.to(device)).logits[:, :-1].float())
    return torch.cat(out)


@torch.no_grad()
def compare(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> dict:
    """NLL / perplexity of `targets` under `logits`, argmax agreement with `reference`, KL(reference || logits).

    logits, reference: float32 [..., V]; targets: int64 [...].
    """
    logp = torch.log_softmax(logits, dim=-1)
    ref_logp = torch.log_softmax(reference, dim=-1)
    nll = -logp.gather(-1, targets[..., None]).mean()
    agreement = (logits.argmax(dim=-1) == reference.argmax(dim=-1)).float().mean()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1).mean()
    return {"nll": float(nll), "perplexity": float(torch.exp(nll)), "agreement": float(agreement), "kl": float(kl),
            "positions": int(targets.numel())}
