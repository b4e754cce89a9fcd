"""CUDA C++ FP4 stages (kernels/cuda/fp4_moe.cu) against Triton and bf16, every routed expert FP4-resident
(issue #9, DeepSeek-V3 shapes; benchmarks/cuda-fp4-notes.md).

Per T (default 1, 8, 32), three stages side by side: FP4 gate_up (CUDA vs Triton's `moe_gate_up`), FP4 down
(CUDA vs `moe_down`), each with its streaming-read ceiling, and the whole op: `moe_mm(..., cuda_w2=
TierMoeCuda(...))` (route -> W2 gate_up -> W2 down -> FP4 gate_up -> FP4 down -> combine; the W2 launches find
no W2 pair here and only mark NaN rows that the FP4 down overwrites), the FP4 stages alone between the same
route and combine (`cuda_fp4_only`: what the W2 launches cost), Triton's whole op and bf16 `torch._grouped_mm`.
A fourth stage, `mixed`, times both ops on a mixed-residency layer (a quarter of the experts FP4, the rest W2):
`cuda_tier_mixed` (TierMoeCuda) against `triton_mixed`.
Pools, routings, graph timing with rotating routings (L2 defeated), ceilings, bf16 and the runner come from
benchmarks/moe_kernels.py; provenance, validity rule, derived columns and the printed table from
benchmarks/cuda_w2.py. Checks first (outputs poisoned with NaN, against the plain-torch references incl.
`moe_mm_ref`, vs Triton, repeats byte-identical, variants byte-identical, miss counts equal); a failed check
marks its CUDA rows invalid (time kept aside). JSON written after every step.

    python3 benchmarks/cuda_fp4.py --commit <sha> --json cuda_fp4.json [--variants cuda_fp4_gate_up_m,...]
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 2
# variant -> (stage, FP4_AHEAD); the first of each stage is the one the others must equal byte for byte
VARIANTS = {"cuda_fp4_gate_up": ("gate_up", 2), "cuda_fp4_gate_up_a3": ("gate_up", 3), "cuda_fp4_gate_up_a1": ("gate_up", 1),
            "cuda_fp4_down": ("down", 2), "cuda_fp4_down_a3": ("down", 3), "cuda_fp4_down_a1": ("down", 1),
            "cuda_fp4_whole": ("whole", 2), "cuda_fp4_whole_a3": ("whole", 3), "cuda_fp4_only": ("whole", 2),
            "cuda_tier_mixed": ("mixed", 2), "cuda_fp4_whole_multi": ("whole", 2), "cuda_fp4_whole_multi_s8": ("whole", 2),
            "cuda_tier_mixed_multi": ("mixed", 2), "cuda_fp4_whole_multi_e": ("whole", 2),
            "cuda_tier_mixed_multi_e": ("mixed", 2), "cuda_fp4_whole_multi_d1": ("whole", 2),
            "cuda_fp4_whole_multi_w4s3": ("whole", 2), "cuda_fp4_whole_multi_s2": ("whole", 2),
            "cuda_fp4_whole_multi_max": ("whole", 2), "cuda_fp4_whole_multi_pdl": ("whole", 2),
            "cuda_tier_mixed_multi_pdl": ("mixed", 2), "cuda_tier_mixed_multi_d1": ("mixed", 2),
            "cuda_fp4_gate_up_m": ("gate_up", 2), "cuda_fp4_down_m": ("down", 2), "cuda_fp4_whole_m": ("whole", 2),
            "cuda_tier_mixed_m": ("mixed", 2), "cuda_fp4_whole_multi_pdl_m": ("whole", 2),
            "cuda_tier_mixed_multi_pdl_m": ("mixed", 2), "cuda_fp4_whole_ro": ("whole", 2),
            "cuda_tier_mixed_ro": ("mixed", 2)}
# single-token variants built with FP4_DECODE_MAD (`mad`: the decode's shifts on the FMA pipe; cuda-fp4-notes.md "v2")
SINGLE_MAD = {"cuda_fp4_gate_up_m", "cuda_fp4_down_m", "cuda_fp4_whole_m", "cuda_tier_mixed_m"}
# single-token whole ops in route order (both tiers' kernels read the route output; moe_mm routes before them), beside
# the default pair order (the route beside the kernels: cuda-fp4-notes.md "Pair order")
ROUTE_ORDER = {"cuda_fp4_whole_ro", "cuda_tier_mixed_ro"}
# multi-token variants (TierMoeCuda on a block_tokens MULTI_BT workspace: fp4_multi.py and w2_multi.py) -> the FP4
# kernels' options (Fp4GateUpMultiCuda, Fp4DownMultiCuda; gate={} / down={}: no FP4_PDL, the down at FP4_AHEAD 2, as
# measured before b4f70f0); their bytes must equal the stage's first variant's (one pair per block)
EARLY = dict(gate=dict(early=True), down=dict(early=True))
MULTI = {"cuda_fp4_whole_multi": dict(gate={}, down={}),
         "cuda_fp4_whole_multi_s8": dict(gate=dict(stage_cols=8), down={}),
         "cuda_tier_mixed_multi": dict(gate={}, down={}), "cuda_fp4_whole_multi_e": EARLY,
         "cuda_tier_mixed_multi_e": EARLY,
         # the multi-token op at T = 32 (3.01x - 3.02x / 2.91x - 2.92x bf16): down at FP4_AHEAD 1 (124 registers: 4
         # blocks per SM instead of 3), gate_up at 4 warps x 3 columns (4 blocks per SM), at 2 columns, at the
         # largest carveout
         "cuda_fp4_whole_multi_d1": dict(gate={}, down=dict(ahead=1)),  # TierMoeCuda's default b4f70f0 - 595ce02
         "cuda_fp4_whole_multi_w4s3": dict(gate=dict(warps=4, stage_cols=3), down={}),
         "cuda_fp4_whole_multi_s2": dict(gate=dict(stage_cols=2), down={}),
         "cuda_fp4_whole_multi_max": dict(gate=dict(carveout="max"), down={}),
         # FP4_PDL: the down a programmatic dependent of the gate_up (as the W2 single-token kernels' adopted egp),
         # beside the down of d1; adopted after 595ce02 (TierMoeCuda's FP4_GATE_MULTI / FP4_DOWN_MULTI)
         "cuda_fp4_whole_multi_pdl": dict(gate=dict(pdl=True), down=dict(ahead=1, pdl=True)),
         "cuda_tier_mixed_multi_pdl": dict(gate=dict(pdl=True), down=dict(ahead=1, pdl=True)),
         "cuda_tier_mixed_multi_d1": dict(gate={}, down=dict(ahead=1)),
         # the adopted multi-token builds with FP4_DECODE_MAD
         "cuda_fp4_whole_multi_pdl_m": dict(gate=dict(pdl=True, mad=True), down=dict(ahead=1, pdl=True, mad=True)),
         "cuda_tier_mixed_multi_pdl_m": dict(gate=dict(pdl=True, mad=True), down=dict(ahead=1, pdl=True, mad=True))}
MULTI_BT = 16
FIRST = {"gate_up": "cuda_fp4_gate_up", "down": "cuda_fp4_down", "whole": "cuda_fp4_whole", "mixed": "cuda_tier_mixed"}
MIXED_EVERY = 4  # the mixed-residency stage: experts e % 4 == 0 FP4-resident, the others W2
DEVICE = "cuda"  # the CPU test of this script's bookkeeping sets "cpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}_for_cuda_fp4", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Fp4Only:
    """The two FP4 launches alone in moe_mm's cuda_w2 slot: correct only when no pair is W2-resident (here)."""

    def __init__(self, gate_up, down):
        self.gate_up, self.down = gate_up, down

    def __call__(self, hidden, top_k, w2, fp4, layer, ws, swiglu_limit=None):
        self.gate_up(hidden, top_k, fp4, layer, ws, swiglu_limit=swiglu_limit)
        self.down(fp4, layer, ws)


def _tile_widths(geo) -> tuple[int, int]:
    """The preset's down tile widths (w2_down.wps_of): W2's and FP4's (16 where inter is not a multiple of 512 / 256)."""
    from tierstore.kernels.cuda.w2_down import wps_of
    from tierstore.kernels.layout import fp4_slot_layout, w2_slot_layout

    return wps_of(w2_slot_layout(geo.hidden, geo.expert_inter)), wps_of(fp4_slot_layout(geo.hidden, geo.expert_inter))


def _build(name: str, geo) -> tuple[object, dict]:
    from tierstore.kernels.cuda.fp4_stages import Fp4DownCuda, Fp4GateUpCuda
    from tierstore.kernels.cuda.tier_moe import FP4_SINGLE, TierMoeCuda
    from tierstore.kernels.cuda.w2_moe import SINGLE as W2_SINGLE, W2MoeCuda

    stage, ahead = VARIANTS[name]
    mad = name in SINGLE_MAD
    w2_wps, fp4_wps = _tile_widths(geo)
    started = time.perf_counter()
    if name == "cuda_fp4_only":
        built = Fp4Only(Fp4GateUpCuda(ahead), Fp4DownCuda(ahead, wps=fp4_wps))
        attrs = {f"{k}_{a}": v for k, s in (("gate_up", built.gate_up), ("down", built.down))
                 for a, v in s.attributes().items()}
    elif stage in ("whole", "mixed"):
        options = MULTI.get(name, {})
        order = {"pair_order": name not in ROUTE_ORDER}
        w2_single = {k: v for k, v in W2_SINGLE.items() if k != "pair_order"} | order
        built = TierMoeCuda(w2=W2MoeCuda(wps=w2_wps, gate_single=w2_single, down_single=w2_single), fp4_ahead=ahead,
                            fp4_gate_multi=options.get("gate"), fp4_down_multi=options.get("down"), fp4_wps=fp4_wps,
                            fp4_single=FP4_SINGLE | order | ({"mad": True} if mad else {}))
        multi = name in MULTI
        attrs = {f"fp4_{k}_{a}": v for k, s in (("gate_up", built.fp4_gate_up_multi if multi else built.fp4_gate_up),
                                                ("down", built.fp4_down_multi if multi else built.fp4_down))
                 for a, v in s.attributes().items()}
    else:
        built = Fp4GateUpCuda(ahead, mad=mad) if stage == "gate_up" else Fp4DownCuda(ahead, wps=fp4_wps, mad=mad)
        attrs = built.attributes()
    widths = dict(w2_wps=w2_wps, fp4_wps=fp4_wps) if (w2_wps, fp4_wps) != (32, 32) else {}  # recorded where not 32
    return built, dict(stage=stage, ahead=ahead, seconds=round(time.perf_counter() - started, 2), **widths, **attrs)


def selected(only: str | None) -> list[str]:
    """The variants to build, check and time: all, or those named in the comma-separated `only` plus each stage's
    first (the one the others must equal byte for byte)."""
    if only is None:
        return list(VARIANTS)
    names = set(only.split(","))
    unknown = names - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; known: {list(VARIANTS)}")
    return [name for name in VARIANTS if name in names or name in FIRST.values()]


def _workspace(geo, tokens, ids, state, f4=None, block_tokens=1):
    from tierstore.kernels import MissLog, MoeWorkspace, moe_route

    ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, torch.bfloat16,
                               DEVICE, block_tokens=block_tokens)
    moe_route(ids, state["w2"], state["f4"] if f4 is None else f4, 0, MissLog.allocate(16, DEVICE), ws)
    return ws


def _mixed_pool(f4):
    """The FP4 pool's slots with a table holding only experts e % MIXED_EVERY == 0."""
    table = f4.table.clone()
    table[:, torch.arange(table.shape[1], device=table.device) % MIXED_EVERY != 0] = -1
    return type(f4)(f4.slots, table, f4.layout)


def _row(kb, cw2, a, b, ref, tri, first) -> dict:
    """Check columns of one variant's two outputs `a`, `b` (as the kernel wrote them) against `ref`, Triton's `tri`
    and the stage's first variant's output `first` (None: this is the first)."""
    return dict(rel_err=kb._rel_err(a, ref), rel_err_vs_triton=kb._rel_err(a, tri.float()),
                nan=bool(a.isnan().any()), repeat_identical=cw2._same_bytes(a, b),
                same_bytes_as_first=None if first is None else cw2._same_bytes(a, first))


def _check(kb, cw2, geo, state, kernels: dict, stage: str, tokens) -> dict:
    """Every CUDA variant of `stage` twice on NaN-poisoned outputs against the reference and Triton."""
    from tierstore.kernels import MissLog, moe_down, moe_gate_up, moe_mm, moe_mm_ref
    from tierstore.kernels.cuda.fp4_stages import fp4_down_ref, fp4_gate_up_ref

    w2, f4, top_k = state["w2"], state["f4_mixed" if stage == "mixed" else "f4"], geo.top_k
    ids, weights = kb._routings(tokens, top_k, geo.num_experts, 1, state["gen"], DEVICE)[0]
    x = torch.randn(tokens, geo.hidden, device=DEVICE, dtype=torch.bfloat16)
    ws = _workspace(geo, tokens, ids, state, f4)
    ws_multi = _workspace(geo, tokens, ids, state, f4, MULTI_BT)
    names = [n for n in kernels if VARIANTS[n][0] == stage]
    outs, extra = {}, {}
    if stage in ("whole", "mixed"):
        def run(cuda, ws=ws):
            ws.act.fill_(float("nan"))
            ws.y.fill_(float("nan"))
            misses = MissLog.allocate(16, DEVICE)
            out = moe_mm(x, ids, weights, w2, f4, 0, misses, ws, out=torch.full_like(x, float("nan")), cuda_w2=cuda)
            return out, misses.counts.tolist()
        tri, tri_misses = run(None)
        ref, missing_pairs, _ = moe_mm_ref(x, ids, weights, w2, f4, 0, act_dtype=torch.bfloat16)
        for name in names:
            on = ws_multi if name in MULTI else ws
            (a, misses_a), (b, _) = run(kernels[name], on), run(kernels[name], on)
            outs[name] = (a, b)
            extra[name] = dict(misses_equal_triton=misses_a == tri_misses)
    else:
        if stage == "gate_up":
            launch = lambda k, out: k(x, top_k, f4, 0, ws, out=out)
            like, ref = ws.act, fp4_gate_up_ref(x, ids, f4, 0)
            moe_gate_up(x, top_k, w2, f4, 0, ws)
            tri = ws.act.clone()
        else:
            moe_gate_up(x, top_k, w2, f4, 0, ws)  # act from Triton, the same for every variant
            launch = lambda k, out: k(f4, 0, ws, out=out)
            like, ref = ws.y, fp4_down_ref(ws.act, ids, f4, 0)
            moe_down(top_k, w2, f4, 0, ws)
            tri = ws.y.clone()
        for name in names:
            pair = tuple(torch.full_like(like, float("nan")) for _ in range(2))
            for out in pair:
                launch(kernels[name], out)
            outs[name] = pair
    first = outs.get(FIRST[stage], (None,))[0]
    variants = {name: dict(_row(kb, cw2, a, b, ref, tri, None if name == FIRST[stage] else first),
                           **extra.get(name, {})) for name, (a, b) in outs.items()}
    return dict(tokens=tokens, stage=stage, pairs=ids.numel(), rel_err_triton=kb._rel_err(tri, ref), variants=variants)


def _time_case(kb, cw2, geo, state, kernels: dict, tokens, runner) -> list[dict]:
    from tierstore.kernels import MissLog, moe_down, moe_gate_up, moe_mm

    w2, f4, f4_mixed, top_k = state["w2"], state["f4"], state["f4_mixed"], geo.top_k
    expert_bytes = lambda lay: lay.w13.word_bytes + lay.w13.scale_bytes + lay.w2.word_bytes + lay.w2.scale_bytes
    stage_bytes, routings, unique = cw2._timing_routings(kb, geo, state, f4.layout, tokens, DEVICE)
    mixed_bytes = sum(expert_bytes(f4.layout if e % MIXED_EVERY == 0 else w2.layout)
                      for ids, _ in routings for e in torch.unique(ids).tolist()) / len(routings)
    cases = [(torch.randn(tokens, geo.hidden, device=DEVICE, dtype=torch.bfloat16), _workspace(geo, tokens, r[0], state))
             for r in routings]
    # the multi-token variants' workspaces: the same routings on block_tokens MULTI_BT (each tier's table routes them)
    multi_ws = {key: [_workspace(geo, tokens, r[0], state, f, MULTI_BT) for r in routings]
                for key, f in (("whole", f4), ("mixed", f4_mixed))}
    for _, ws in cases:
        ws.act.copy_(torch.randn_like(ws.act))  # the down stage alone reads act
    misses = MissLog.allocate(16, DEVICE)
    outs = [torch.empty_like(x) for x, _ in cases]
    acts = [torch.empty_like(ws.act) for _, ws in cases]
    stage_calls = {
        "gate_up": lambda k: [lambda x=x, ws=ws, o=o: k(x, top_k, f4, 0, ws, out=o) for (x, ws), o in zip(cases, acts)],
        "down": lambda k: [lambda ws=ws: k(f4, 0, ws) for _, ws in cases],
        "whole": lambda k: [lambda x=x, ws=ws, o=o, r=r: moe_mm(x, r[0], r[1], w2, f4, 0, misses, ws, out=o, cuda_w2=k)
                            for (x, ws), o, r in zip(cases, outs, routings)],
        "mixed": lambda k: [lambda x=x, ws=ws, o=o, r=r: moe_mm(x, r[0], r[1], w2, f4_mixed, 0, misses, ws, out=o,
                                                                cuda_w2=k) for (x, ws), o, r in zip(cases, outs, routings)]}
    fns = {stage: {name: stage_calls[stage](k) for name, k in kernels.items()
                   if VARIANTS[name][0] == stage and name not in MULTI} for stage in stage_calls}
    for name, k in kernels.items():
        if name in MULTI:
            stage = VARIANTS[name][0]
            f = f4_mixed if stage == "mixed" else f4
            fns[stage][name] = [lambda x=x, ws=ws, o=o, r=r, k=k, f=f: moe_mm(x, r[0], r[1], w2, f, 0, misses, ws, out=o,
                                                                              cuda_w2=k)
                                for (x, _), ws, o, r in zip(cases, multi_ws[stage], outs, routings)]
    fns["gate_up"]["triton_gate_up"] = [lambda x=x, ws=ws: moe_gate_up(x, top_k, w2, f4, 0, ws) for x, ws in cases]
    fns["down"]["triton_down"] = [lambda ws=ws: moe_down(top_k, w2, f4, 0, ws) for _, ws in cases]
    fns["whole"]["triton_whole"] = stage_calls["whole"](None)
    fns["mixed"]["triton_mixed"] = stage_calls["mixed"](None)
    rows = []
    for stage, variants in fns.items():
        nbytes = mixed_bytes if stage == "mixed" else unique * stage_bytes[stage]
        rows += cw2._stage_rows(kb, geo, state, runner, tokens, stage, variants, nbytes, unique, routings, DEVICE,
                                ROUNDS)
    return rows


def run(kb, cw2, args, result: dict, emit) -> None:
    from tierstore.geometry import get_preset

    runner = kb.Runner(probe=kb._cuda_probe if DEVICE == "cuda" else None)
    result.update(status="running: build", errors=runner.errors, checks=[], cases=[], build={})
    kernels = {}
    geo = get_preset(args.preset)
    for name in selected(args.variants):
        built, err = runner.attempt(f"build and load {name}", lambda: _build(name, geo))
        result["build"][name] = built[1] if built else {"error": err}
        if built:
            kernels[name] = built[0]
    emit(result)
    state = kb._setup(geo, DEVICE)
    state["f4"].table[0] = torch.arange(geo.num_experts, dtype=torch.int32, device=DEVICE)  # every expert FP4
    state["f4_mixed"] = _mixed_pool(state["f4"])
    state["reps"] = args.reps
    tokens_list = [int(t) for t in args.tokens.split(",")]
    invalid = {}
    for tokens in tokens_list:
        rows = []
        for stage in ("gate_up", "down", "whole", "mixed"):
            result["status"] = f"running: check T={tokens} {stage}"
            check, err = runner.attempt(f"check T={tokens} {stage}",
                                        lambda: _check(kb, cw2, geo, state, kernels, stage, tokens))
            rows.append(check or dict(tokens=tokens, stage=stage, error=err))
            result["checks"].append(rows[-1])
            emit(result)
        invalid[tokens] = {name: cw2._invalid(rows, name) for name in kernels}
    cw2._time_all(kb, geo, state, runner, tokens_list, invalid, result, emit,
                  lambda tokens: _time_case(kb, cw2, geo, state, kernels, tokens, runner), DEVICE,
                  baselines={**cw2.TRITON, "mixed": "triton_mixed"})  # the mixed stage's Triton baseline


def main(argv: list[str] | None = None) -> int:
    cw2 = _load("cuda_w2")
    args = cw2._arguments(__doc__.splitlines()[0], argv)
    selected(args.variants)  # unknown names fail here, before any GPU work
    if not torch.cuda.is_available():
        print("cuda_fp4: no CUDA device; this benchmark measures GPU kernels only, nothing was run", file=sys.stderr)
        return 2
    kb = cw2._bench_kernels()
    result: dict = dict(provenance=cw2._provenance(args.commit), preset=args.preset, rel_tol=cw2.REL_TOL,
                        fp4_resident="every routed expert")
    return cw2._run_and_report(kb, args.json, result, lambda emit: run(kb, cw2, args, result, emit))


if __name__ == "__main__":
    sys.exit(main())
