"""Per-pair expert precision inside a transformers MoE model, by plain weight substitution.

Each MoE layer's experts module is replaced by `SwitchableExperts`, which holds two weight banks
(the configuration's base, e.g. W2, and its upgrade tier, tierstore's FP4) and serves a routed
(token, expert) pair from the upgrade bank when the expert is in the static FP4 pool of that
layer or the token's row is forced (a gate fire). Decode-sized forwards gather each pair's
weights (a few kernels per layer); large forwards loop over the used experts. A shared `PrecisionControl` carries the
per-row force flags and collects the routing of every forward.
"""

from __future__ import annotations

import torch
from torch import nn


class PrecisionControl:
    """State shared by all layers of one model: force flags per token row, and routing capture."""

    def __init__(self):
        self.force_rows: torch.Tensor | None = None  # bool [B] per batch row for the next forward, None = none
        self.routing: list[torch.Tensor] = []  # int [T, k] per MoE layer, in layer order, while capturing
        self.capture = False

    def start_capture(self) -> None:
        self.routing, self.capture = [], True

    def stop_capture(self) -> list[torch.Tensor]:
        routing, self.routing, self.capture = self.routing, [], False
        return routing


GATHER_PAIRS = 2048  # up to this many routed pairs per forward, gather each pair's weights (decode steps)


class SwitchableExperts(nn.Module):
    """Drop-in for a transformers stacked-experts module: forward(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H].

    `gate_up` [2E, 2I, H] and `down` [2E, H, I] hold the base bank (rows 0..E-1) then the upgrade
    bank (E..2E-1); `pool` bool [E] marks experts served from the upgrade bank for every token.
    """

    def __init__(self, control: PrecisionControl, act_fn):
        super().__init__()
        self.control, self.act_fn = control, act_fn
        self.gate_up = self.down = self.pool = None

    def configure(self, base: tuple[torch.Tensor, torch.Tensor], upgrade: tuple[torch.Tensor, torch.Tensor],
                  pool: torch.Tensor) -> None:
        self.gate_up = torch.cat([base[0], upgrade[0]])
        self.down = torch.cat([base[1], upgrade[1]])
        self.pool = pool

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.control.capture:
            self.control.routing.append(top_k_index.detach())
        num_tokens, top_k = top_k_index.shape
        upgraded = self.pool[top_k_index]  # [T, k]
        if self.control.force_rows is not None:  # bool [B]; the tokens are the B rows' positions, row-major
            forced = self.control.force_rows.repeat_interleave(num_tokens // self.control.force_rows.numel())
            upgraded = upgraded | forced[:, None]  # [T, k]
        bank = top_k_index + self.pool.numel() * upgraded.long()  # [T, k] row of the stacked banks
        weights = top_k_weights.float()
        if bank.numel() <= GATHER_PAIRS:
            pairs = bank.reshape(-1)  # [P]
            x = hidden[:, None, :].expand(-1, top_k, -1).reshape(-1, 1, hidden.shape[-1])  # [P, 1, H]
            gate, up = torch.bmm(x, self.gate_up[pairs].transpose(1, 2)).chunk(2, dim=-1)  # [P, 1, I] each
            y = torch.bmm(self.act_fn(gate) * up, self.down[pairs].transpose(1, 2))  # [P, 1, H]
            out = (y.view(num_tokens, top_k, -1).float() * weights[..., None]).sum(dim=1)  # [T, H]
            return out.to(hidden.dtype)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
        for row in bank.unique().tolist():  # ascending: a fixed accumulation order
            tokens, slots = torch.nonzero(bank == row, as_tuple=True)  # a token routes to an expert once
            gate, up = (hidden[tokens] @ self.gate_up[row].t()).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down[row].t()
            out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
        return out.to(hidden.dtype)


def install(model: nn.Module, control: PrecisionControl) -> list[SwitchableExperts]:
    """Replace the experts of every MoE layer with SwitchableExperts; returns them in layer order."""
    installed = []
    for layer in model.model.layers:
        block = layer.mlp
        if hasattr(block, "experts") and hasattr(block, "gate"):
            act_fn = getattr(block.experts, "act_fn", None) or torch.nn.functional.silu
            block.experts = SwitchableExperts(control, act_fn)
            installed.append(block.experts)
    if not installed:
        raise ValueError(f"{type(model).__name__} has no MoE layers")
    return installed
