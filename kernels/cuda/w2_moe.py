"""The CUDA C++ gate_up and down stages together: `moe_mm(..., cuda_w2=W2MoeCuda())` (opt-in at `moe_mm`; the
runtime passes it wherever it can run, config `cuda_w2` auto: tierstore/runtime/compute.py).

`W2MoeCuda()(hidden, top_k, w2, fp4, layer, ws, swiglu_limit, topk_ids=...)` replaces `moe_gate_up` + `moe_down`
between `moe_route` and `moe_combine`: ws.act then ws.y for every W2-resident pair, on the current stream
(capture-safe: two launches, no allocation, no host sync). Route and combine stay the Triton launches, so misses are
counted once, by the route, and the combine reads y exactly as on the default path. The single-token kernels run in
pair order by default (`SINGLE`: each block's expert read from topk_ids, not from the route output), so for a
block_tokens 1 workspace `route_free` is true and `moe_mm` runs the route beside them on the workspace's side stream.

The kernels follow the workspace's block size: block_tokens 1 runs the single-token kernels (one routed pair per
CUDA block: w2_gate_up.cu, w2_down.cu); a multiple of 8 (16, 32, 64) runs the multi-token kernels (one expert's
weights decoded once for up to 8 of its pairs: w2_multi.py), with the gate_up kernel picked by the batch's pairs per
expert (`WIDE_FROM`). Same outputs per pair either way.

Restriction: the Triton stages compute W2 and FP4 pairs in one launch (per block, by the expert's tier); they
have no switch to leave W2 pairs out, and running them whole beside the CUDA kernels would do the W2 work twice.
So this path computes no FP4 pair: use it for layers without FP4-resident experts. An FP4 pair that reaches it
anyway gets NaN y rows (written by the down kernel), hence a NaN output row for its token, never stale data.
Requires bfloat16, hidden a multiple of 512 (gate_up's K) and of 64 * groups. The down kernels are built for the
w2 matrix's tile width (`wps`: 32 words per bit slot when inter is a multiple of 512, else 16; `w2_down.wps_of`).
"""

from __future__ import annotations

from . import w2_down, w2_gate_up, w2_multi
from .w2_down import W2DownCuda
from .w2_gate_up import W2GateUpCuda
from .w2_multi import W2DownMultiCuda, W2GateUpMultiCuda


# The multi-token gate_up's options (W2GateUpMultiCuda): "v2 s4e", adopted by the rule of cuda-w2-notes.md from the
# H200 run at 57f6217 (cuda-w2-v2-deepseek-v3.json): 4 staged columns, the "fit" carveout, the early prologue; whole op
# at T = 32 851.7 vs 961.5 us with the first multi kernel (1.13x), 311.2 vs 347.5 at T = 8, byte-identical outputs.
# v5 (cuda-w2-notes.md "v5", H200 at b152159, cuda-w2-v5b-*.json): slot pairs 0..4 decoded by a multiply-add (`mad`)
# on every multi-token kernel, same bytes; whole op at T = 32 792.8 vs 849.2 us (DeepSeek-V3), faster on every preset
# timed (ds-v2-lite, qwen3-30b-a3b at T = 8 / 32, mixtral-8x7b at T = 32 on the 8-column gate_up).
GATE_MULTI = dict(warps=8, stage_cols=4, carveout="fit", early=True, mad=True)

# Batches with more than WIDE_FROM routed pairs per expert on average run the multi-token gate_up with all 8 columns
# staged (GATE_MULTI_WIDE: the v1 kernel, W2GateUpMultiCuda's defaults) instead of GATE_MULTI's 4: a block then
# decodes its expert's tile once per 8 pairs instead of once per 4. H200 at cf5719c (cuda-w2-*-t64-512-cf5719c.json,
# whole op, byte-identical outputs): 4 columns faster at 1.33 / 1.5 / 2 pairs per expert (kimi-k2 / ds4-flash /
# deepseek-v3 at T = 64: 1468 vs 1621, 654 vs 700, 1224 vs 1326 us), 8 columns faster from 8 (olmoe-1b-7b T = 64:
# 149 vs 178 us) to 128 (mixtral-8x7b T = 512: 3824 vs 5139 us; deepseek-v3 T = 512, 16: 4271 vs 5340 us). Between
# 2 and 8 not measured: the switch is set halfway.
WIDE_FROM = 4
GATE_MULTI_WIDE = dict(mad=True)


def wide_gate(tokens: int, top_k: int, experts: int) -> bool:
    """Whether a multi-token batch runs the 8-column gate_up: above WIDE_FROM routed pairs per expert on average
    (W2MoeCuda, and TierMoeCuda's FP4 gate_up)."""
    return tokens * top_k > WIDE_FROM * experts


# The single-token kernels' options (W2GateUpCuda / W2DownCuda): "v3 egp", adopted by the rule of cuda-w2-notes.md from
# the H200 run at 6f908d0 (cuda-w2-v3-deepseek-v3.json): the early prologue, a grid of the routed pairs only, the down
# launch a programmatic dependent of the gate_up's; whole op at T = 1 56.2 vs 60.8 us (5.25x vs 4.86x bf16), at T = 8
# 303.9 vs 308.8 us, byte-identical outputs.
# v5 (cuda-w2-notes.md "v5", H200 at d227aff, cuda-w2-v5-deepseek-v3.json): slot pairs 0..4 decoded by a multiply-add
# (`mad`), same bytes; whole op at T = 1 53.3 vs 55.7 us (5.60x vs 5.35x bf16), at T = 8 281.1 vs 303.1 us.
# Pair order (cuda-w2-notes.md "Pair order", H200 at 692b975, cuda-w2-pairorder-*.json): both kernels read each block's
# expert from the router's ids, so moe_mm routes beside them (route_free); same bytes; whole op at T = 1 47.4-47.5 vs
# 49.0-49.4 us on DeepSeek-V3 (6.30x vs 6.06x-6.11x bf16), 13.8 vs 15.7 on ds-v2-lite, 13.0-13.2 vs 14.9-15.0 on
# qwen3-30b-a3b; at T = 8 274.3 vs 275.3-275.5.
SINGLE = dict(early=True, pairs_grid=True, pdl=True, mad=True, pair_order=True)

# The multi-token down's options (W2DownMultiCuda besides ahead / groups / wps): v5's decode, as GATE_MULTI.
DOWN_MULTI = dict(mad=True)


class W2MoeCuda:
    """gate_ahead: W2_AHEAD of both gate_up kernels (2: the measured faster one); down_ahead / down_groups: both
    down kernels' (w2_down.py); gate_multi: the multi-token gate_up's other options (None: GATE_MULTI);
    gate_multi_wide: the same for batches above WIDE_FROM pairs per expert (None: GATE_MULTI_WIDE); down_multi: the
    multi-token down's other options (None: DOWN_MULTI); gate_single / down_single: the single-token kernels' v3 / v5
    options (W2GateUpCuda / W2DownCuda; None: SINGLE; {}: the kernels before v3; `pair_order` in both or neither);
    wps: the w2 matrix's words per bit slot both down kernels read (`w2_down.wps_of(layout)` of the pools this op
    serves); stream: the single-token kernels' W2_STREAM builds (pair order needed), which compute a pair without a
    slot from its arena row (`w2.stream_at`; `streams`); stream_prefetch: their W2_STREAM_PREFETCH (a streamed pair's
    rows asked into L2 first); stream_stage: their W2_STREAM_STAGE (a streamed pair's rows copied into shared memory
    in contiguous runs first, where the stage fits; there the prefetch is skipped); stream_stage_carveout: their
    shared-memory carveout (`w2_gate_up.ask_stage_carveout`)."""

    def __init__(self, gate_ahead: int = 2, down_ahead: int = 2, down_groups: int = 1, device: int | None = None,
                 gate_multi: dict | None = None, gate_single: dict | None = None, down_single: dict | None = None,
                 gate_multi_wide: dict | None = None, wps: int = 32, down_multi: dict | None = None,
                 stream: bool = False, stream_prefetch: bool = True, stream_stage: bool = False,
                 stream_stage_carveout: str = "max"):
        gate_single = SINGLE if gate_single is None else gate_single
        down_single = SINGLE if down_single is None else down_single
        if gate_single.get("pair_order", False) != down_single.get("pair_order", False):
            raise ValueError("gate_single and down_single take pair_order together (the route runs beside both or "
                             "before both)")
        if stream:
            extra = {"stream": True, "prefetch": stream_prefetch, "stage": stream_stage}
            extra |= {"stage_carveout": stream_stage_carveout} if stream_stage else {}
            gate_single, down_single = gate_single | extra, down_single | extra
        self.stream = stream
        self.gate_up = W2GateUpCuda(ahead=gate_ahead, device=device, **gate_single)
        self.down = W2DownCuda(ahead=down_ahead, groups=down_groups, device=device, wps=wps, **down_single)
        self.gate_up_multi = W2GateUpMultiCuda(ahead=gate_ahead, device=device,
                                               **(GATE_MULTI if gate_multi is None else gate_multi))
        self.gate_up_multi_wide = W2GateUpMultiCuda(
            ahead=gate_ahead, device=device, **(GATE_MULTI_WIDE if gate_multi_wide is None else gate_multi_wide))
        self.down_multi = W2DownMultiCuda(ahead=down_ahead, groups=down_groups, device=device, wps=wps,
                                          **(DOWN_MULTI if down_multi is None else down_multi))

    def route_free(self, ws) -> bool:
        """Whether this op's kernels for `ws` read the router's topk ids instead of the route output (the single-token
        kernels built with pair_order), so that `moe_mm` may run the route beside them."""
        return ws.block_tokens == 1 and self.gate_up.pair_order and self.down.pair_order

    def streams(self, ws) -> bool:
        """Whether this op's kernels for `ws` compute streamed pairs (the single-token stream builds), so that the
        route and the combine must treat them as computed (`moe_mm`)."""
        return self.stream and ws.block_tokens == 1

    def __call__(self, hidden, top_k: int, w2, fp4, layer: int, ws, swiglu_limit: float | None = None,
                 topk_ids=None) -> None:
        """topk_ids: the router's ids, read by pair-order single-token kernels only (whether or not the route ran
        first: `moe_mm` runs it beside them when this op is `route_free`, before them when it is TierMoeCuda's)."""
        if ws.block_tokens == 1:
            w2_gate_up._check_inputs(hidden, w2, fp4, ws, ws.act)  # both stages' inputs before either launches
            w2_down._check_inputs(w2, fp4, ws, ws.y, self.down.groups, self.down.wps)
            if self.route_free(ws):  # the gate_up checks topk_ids before it launches; the down reads the same
                self.gate_up(hidden, top_k, w2, fp4, layer, ws, swiglu_limit=swiglu_limit, topk_ids=topk_ids)
                self.down(w2, fp4, layer, ws, topk_ids=topk_ids)  # a programmatic dependent of the gate_up (pdl)
                return
            gate_up, down = self.gate_up, self.down
        else:
            w2_multi.gate_check_inputs(hidden, w2, fp4, ws, ws.act)
            w2_multi.down_check_inputs(w2, fp4, ws, ws.y, self.down.groups, self.down.wps)
            wide = wide_gate(hidden.shape[0], top_k, w2.table.shape[1])
            gate_up, down = (self.gate_up_multi_wide if wide else self.gate_up_multi), self.down_multi
        gate_up(hidden, top_k, w2, fp4, layer, ws, swiglu_limit=swiglu_limit)
        down(w2, fp4, layer, ws)
