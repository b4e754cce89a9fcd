"""Both tiers on the CUDA path: `moe_mm(..., cuda_w2=TierMoeCuda())` serves W2- and FP4-resident experts.

`TierMoeCuda()(hidden, top_k, w2, fp4, layer, ws, swiglu_limit)` replaces `moe_gate_up` + `moe_down` between
`moe_route` and `moe_combine` with four launches on the current stream (capture-safe: no allocation, no host
sync), in this order:

1. W2 gate_up (w2_gate_up.cu): act of the W2 pairs; FP4 pairs skipped;
2. W2 down (w2_down.cu): y of the W2 pairs; the y rows of FP4 pairs are written as NaN (the W2 path's marker);
3. FP4 gate_up (fp4_moe.cu): act of the FP4 pairs; W2 pairs skipped;
4. FP4 down (fp4_moe.cu): y of the FP4 pairs, overwriting the NaN rows of step 2. It must run after step 2.

A workspace of block_tokens 1 runs the single-token kernels named above; one of a multiple of 8 (16, 32, 64) the
multi-token kernels of each tier (w2_multi.py, fp4_multi.py: an expert's tile decoded once for several of its
pairs), in the same order with the same roles; above w2_moe.WIDE_FROM pairs per expert (`wide_gate`) both gate_up kernels stage
8 columns per pass instead of 4 (FP4: FP4_GATE_MULTI_WIDE).

The single-token kernels of both tiers run in pair order by default (`FP4_SINGLE`, w2_moe.SINGLE): each block's
expert comes from the router's topk ids, so at block_tokens 1 the op is `route_free` and `moe_mm` runs the route on
the workspace's side stream beside these launches.

So every resident pair's act and y are written exactly once by the tier that holds it (plus the NaN marker
in between), missing pairs are left to the combine as on the Triton path, and the W2 files are unchanged:
`W2MoeCuda` (steps 1 and 2) keeps its W2-only behaviour. Requires bfloat16 and hidden a multiple of 512 (the W2
stages'; the FP4 stages need 256); every inter (both tiers' downs have a build for 16-word tiles).
"""

from __future__ import annotations

from . import fp4_multi, fp4_stages
from .fp4_multi import Fp4DownMultiCuda, Fp4GateUpMultiCuda
from .fp4_stages import Fp4DownCuda, Fp4GateUpCuda
from . import w2_gate_up
from .w2_moe import W2MoeCuda, wide_gate

# The multi-token FP4 gate_up above WIDE_FROM pairs per expert: 8 columns per pass. H200 at 46074cb
# (cuda-fp4-early-deepseek-v3-46074cb.json, every expert FP4, whole op, byte-identical outputs): 7014.3 vs 9055.1 us
# with 4 columns at 16 pairs per expert (T = 512); 4 columns faster at 1 and 2 (T = 32: 1504.0 vs 1658.0, T = 64:
# 2224.6 vs 2326.9). Not measured on a mixed layer.
FP4_GATE_MULTI_WIDE = dict(stage_cols=8)

# The multi-token FP4 stages' default builds: the down at FP4_AHEAD 1 (124 registers, 4 blocks per SM; at 2 it needs
# 164 and runs 3) and launched as the gate_up's programmatic dependent (FP4_PDL on both). H200, deepseek-v3 T = 32,
# byte-identical outputs: FP4_AHEAD 1 alone at b4f70f0 (cuda-fp4-tune-{a,b}-deepseek-v3-b4f70f0.json) 1.9 % faster on
# average than FP4_AHEAD 2 over four rounds; with FP4_PDL at 595ce02 (cuda-fp4-pdl-{a,b}-deepseek-v3-595ce02.json) the
# all-FP4 op 1537.3 vs 1557.1 us on average (faster in 3 of 4 rounds), the mixed layer 1026.8 vs 1055.6 (4 of 4).
FP4_GATE_MULTI = dict(pdl=True)
FP4_DOWN_MULTI = dict(ahead=1, pdl=True)

# The single-token FP4 stages' options besides FP4_AHEAD (Fp4GateUpCuda / Fp4DownCuda: `mad`, `pair_order`). Pair
# order as the W2 kernels' (w2_moe.SINGLE): with both tiers' single-token kernels in pair order the op is route_free and
# moe_mm routes beside it.
FP4_SINGLE: dict = dict(pair_order=True)


class TierMoeCuda:
    """w2: the W2 stages (a `W2MoeCuda`, built with its defaults when None); fp4_ahead: FP4_AHEAD of the FP4
    kernels; fp4_gate_multi / fp4_down_multi: the multi-token FP4 kernels' other options (Fp4GateUpMultiCuda /
    Fp4DownMultiCuda; an "ahead" there wins over fp4_ahead; None: FP4_GATE_MULTI, FP4_DOWN_MULTI); fp4_single: the
    single-token FP4 kernels' other options (None: FP4_SINGLE); fp4_wps: the FP4 pool's w2 tile width both FP4 downs
    read (`w2_down.wps_of(fp4 layout)`)."""

    def __init__(self, w2: W2MoeCuda | None = None, fp4_ahead: int = 2, device: int | None = None,
                 fp4_gate_multi: dict | None = None, fp4_down_multi: dict | None = None, fp4_wps: int = 32,
                 fp4_single: dict | None = None):
        self.w2 = W2MoeCuda(device=device) if w2 is None else w2
        self.fp4_wps = fp4_wps
        single = FP4_SINGLE if fp4_single is None else fp4_single
        self.fp4_gate_up = Fp4GateUpCuda(ahead=fp4_ahead, device=device, **single)
        self.fp4_down = Fp4DownCuda(ahead=fp4_ahead, device=device, wps=fp4_wps, **single)
        gate = {"ahead": fp4_ahead, **(FP4_GATE_MULTI if fp4_gate_multi is None else fp4_gate_multi)}
        self.fp4_gate_up_multi = Fp4GateUpMultiCuda(device=device, **gate)
        self.fp4_gate_up_multi_wide = Fp4GateUpMultiCuda(device=device, **{**gate, **FP4_GATE_MULTI_WIDE})
        down = FP4_DOWN_MULTI if fp4_down_multi is None else {"ahead": fp4_ahead, **fp4_down_multi}
        self.fp4_down_multi = Fp4DownMultiCuda(device=device, wps=fp4_wps, **down)

    def route_free(self, ws) -> bool:
        """Whether every kernel this op launches for `ws` reads the router's ids instead of the route output (the
        single-token kernels of both tiers in pair order), so that `moe_mm` may route beside it."""
        return self.w2.route_free(ws) and self.fp4_gate_up.pair_order and self.fp4_down.pair_order

    def __call__(self, hidden, top_k: int, w2, fp4, layer: int, ws, swiglu_limit: float | None = None,
                 topk_ids=None) -> None:
        # the FP4 stages' inputs before any launch (W2MoeCuda checks its own before its first launch)
        ids = {}  # what the FP4 kernels read besides the route: the router's ids, for pair-order ones
        if ws.block_tokens == 1:
            fp4_stages.check_gate_up_inputs(hidden, fp4, ws, ws.act)
            fp4_stages.check_down_inputs(fp4, ws, ws.y, self.fp4_wps)
            gate_up, down = self.fp4_gate_up, self.fp4_down
            if self.fp4_gate_up.pair_order or self.fp4_down.pair_order:
                w2_gate_up.check_topk_ids(topk_ids, ws)
                ids = dict(topk_ids=topk_ids)
        else:
            wide = wide_gate(hidden.shape[0], top_k, fp4.table.shape[1])
            gate_up = self.fp4_gate_up_multi_wide if wide else self.fp4_gate_up_multi
            fp4_multi.check_gate_up_inputs(hidden, fp4, ws, ws.act, gate_up.rows_per_block)
            fp4_multi.check_down_inputs(fp4, ws, ws.y, self.fp4_wps)
            down = self.fp4_down_multi
        if fp4.table.shape != w2.table.shape:
            raise ValueError("the W2 and FP4 tables must have the same shape")
        self.w2(hidden, top_k, w2, fp4, layer, ws, swiglu_limit, topk_ids=topk_ids)
        gate_up(hidden, top_k, fp4, layer, ws, swiglu_limit=swiglu_limit, **ids)
        down(fp4, layer, ws, **ids)  # after the W2 down: overwrites its NaN rows of FP4 pairs
