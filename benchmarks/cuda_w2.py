"""CUDA C++ W2 stages (kernels/cuda) against Triton and bf16 (issue #9 s. 4, DeepSeek-V3 shapes).

Three stages per T (default 1, 8, 32): the gate_up kernel (two prefetch depths) vs Triton's gate_up, the down
kernel (two row groupings) vs Triton's down, and the whole op (route -> CUDA gate_up -> CUDA down -> combine,
`moe_mm(..., cuda_w2=W2MoeCuda(...))`) vs Triton's whole op (`moe_mm`) and bf16 `torch._grouped_mm`. Each stage
also has a multi-token variant (`*_multi`: w2_multi.py, one CUDA block per expert and up to 8 of its pairs) run on a
block_tokens 16 workspace of the same routing; every other variant and Triton run on block_tokens 1 workspaces.
Pools, routings, CUDA-graph timing with rotating routings (L2 defeated) and the streaming-read ceiling come
from benchmarks/moe_kernels.py; the pools hold no FP4-resident expert (the CUDA path's restriction).

Order: build (nvcc -> fatbin, driver API load), checks for every T (outputs poisoned with NaN: CUDA vs the
plain-torch references incl. `moe_mm_ref` for the whole op, vs Triton, repeat launches byte-identical, variants
byte-identical to each other; a multi-token variant is compared with its stage's first variant, recorded, not
required byte-identical: another binary), then for each T and stage: CUDA variants and Triton (two rounds, alternating),
the stage's ceiling or bf16. Each step is isolated (benchmarks/moe_kernels.py Runner): a build, launch or check
failure is recorded in the JSON and the rest runs; a failed check marks that CUDA row invalid (time kept aside).

    python3 benchmarks/cuda_w2.py --commit <sha> --json cuda_w2.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REL_TOL = 1e-2
ROUNDS = 2
AHEAD = {"cuda_mma": 1, "cuda_mma_ahead2": 2}  # gate_up variant -> W2_AHEAD (K tiles of loads in flight per lane)
DOWN = {"cuda_down": dict(ahead=2, groups=1), "cuda_down_g2": dict(ahead=2, groups=2)}  # down variant -> W2DownCuda
# whole-op variant -> W2MoeCuda arguments (gate_up: ahead 2, the measured faster one; the down variants above)
# the single-token kernels as before v3 (gate_single / down_single {}: W2MoeCuda's default is its SINGLE, the
# cuda_whole_egp variant below)
WHOLE = {"cuda_whole": dict(gate_ahead=2, down_ahead=2, down_groups=1, gate_single={}, down_single={}),
         "cuda_whole_g2": dict(gate_ahead=2, down_ahead=2, down_groups=2, gate_single={}, down_single={})}
# multi-token variants (w2_multi.py; the whole op's W2MoeCuda picks them for block_tokens 16): stage -> name, options
MULTI = {"gate_up": ("cuda_gate_up_multi", dict(ahead=2)), "down": ("cuda_down_multi", dict(ahead=2, groups=1)),
         "whole": ("cuda_whole_multi", dict(gate_ahead=2, down_ahead=2, down_groups=1, gate_multi={}))}  # v1 gate_up
MULTI_BT = 16  # the multi-token variants' route block size
# v2 of the multi-token gate_up (W2GateUpMultiCuda warps / stage_cols / carveout "fit": benchmarks/cuda-w2-notes.md
# "v2"), alone and in the whole op (W2MoeCuda with that gate_up kernel); built only when --variants names them. Their
# bytes must equal cuda_gate_up_multi's / cuda_whole_multi's when that variant runs too (else INVALID).
V2_GATE = {"s4": dict(warps=8, stage_cols=4, carveout="fit"), "w4s3": dict(warps=4, stage_cols=3, carveout="fit"),
           "w4s2": dict(warps=4, stage_cols=2, carveout="fit"), "e": dict(early=True),
           "s4e": dict(warps=8, stage_cols=4, carveout="fit", early=True),
           "w4s3e": dict(warps=4, stage_cols=3, carveout="fit", early=True)}
MULTI_V2 = ([("gate_up", f"cuda_gate_up_multi_{k}", dict(ahead=2, **o)) for k, o in V2_GATE.items()]
            + [("whole", f"cuda_whole_multi_{k}", dict(MULTI["whole"][1], gate_multi=o)) for k, o in V2_GATE.items()])
# v5 on the multi-token kernels: the runtime's multi-token whole op (gate_up s4e, 8 columns above WIDE_FROM pairs per
# expert, down) with W2_DECODE_MAD on all three, against cuda_whole_multi_s4e (its bytes: cuda_whole_multi's)
MULTI_V2 += [("whole", "cuda_whole_multi_s4em", dict(MULTI["whole"][1], gate_multi=V2_GATE["s4e"] | {"mad": True},
                                                     gate_multi_wide={"mad": True}, down_multi={"mad": True})),
             # the 8-column gate_up at every fill, v5 decode (where WIDE_FROM should lie: cuda-w2-notes.md "v5")
             ("whole", "cuda_whole_multi_m", dict(MULTI["whole"][1], gate_multi={"mad": True},
                                                  gate_multi_wide={"mad": True}, down_multi={"mad": True}))]
# v3 of the single-token kernels (W2GateUpCuda / W2DownCuda early, pairs_grid, route_major, pdl: cuda-w2-notes.md "v3"):
# suffix -> options; gate_up on ahead 2, down on cuda_down's options, the whole op with both kernels so built (pdl: the
# down launch a programmatic dependent of the gate_up's). Built only when --variants names them; INVALID unless
# byte-identical to V3_BASE's variant of the stage, run in the same call.
V3 = {"e": dict(early=True), "g": dict(pairs_grid=True), "r": dict(route_major=True),
      "eg": dict(early=True, pairs_grid=True), "er": dict(early=True, route_major=True),
      "egp": dict(early=True, pairs_grid=True, pdl=True)}
V3_BASE = {"gate_up": "cuda_mma_ahead2", "down": "cuda_down", "whole": "cuda_whole"}
SINGLE_V3 = ([("gate_up", f"cuda_mma_ahead2_{k}", dict(ahead=2, **o)) for k, o in V3.items()]
             + [("down", f"cuda_down_{k}", dict(DOWN["cuda_down"], **o)) for k, o in V3.items()]
             + [("whole", f"cuda_whole_{k}", dict(WHOLE["cuda_whole"], gate_single=o, down_single=o))
                for k, o in V3.items()])
# v4 (cuda-w2-notes.md "v4"): the single-token gate_up's weight tiles staged through n shared-memory stages by
# cp.async (W2GateUpCuda stages=n) on top of v3's options; alone (with early, pairs_grid) and in the whole op (the
# adopted egp with the staged gate_up). Checked like the v3 variants (bytes equal to V3_BASE's of the stage).
V4_STAGES = (3, 4)
SINGLE_V3 += ([("gate_up", f"cuda_mma_ahead2_egs{n}", dict(ahead=2, early=True, pairs_grid=True, stages=n))
               for n in V4_STAGES]
              + [("whole", f"cuda_whole_egps{n}", dict(WHOLE["cuda_whole"], gate_single=V3["egp"] | {"stages": n},
                                                      down_single=V3["egp"])) for n in V4_STAGES])
# v5 (cuda-w2-notes.md "v5"): slot pairs 0..4 decoded by a multiply-add (W2_DECODE_MAD, `mad`) on top of v3's options:
# gate_up alone (early, pairs_grid), down alone (pairs_grid), the whole op (the adopted egp, both kernels so built).
SINGLE_V3 += [("gate_up", "cuda_mma_ahead2_egm", dict(ahead=2, **V3["eg"], mad=True)),
              ("down", "cuda_down_gm", dict(DOWN["cuda_down"], **V3["g"], mad=True)),
              ("whole", "cuda_whole_egpm", dict(WHOLE["cuda_whole"], gate_single=V3["egp"] | {"mad": True},
                                               down_single=V3["egp"] | {"mad": True}))]
# v5 with the v4 stages (the T = 1 gate_up's largest stall after v5 is the global loads: ncu at d227aff)
SINGLE_V3 += ([("gate_up", f"cuda_mma_ahead2_egs{n}m", dict(ahead=2, **V3["eg"], stages=n, mad=True))
               for n in V4_STAGES]
              + [("whole", f"cuda_whole_egps{n}m", dict(WHOLE["cuda_whole"], gate_single=V3["egp"] | {"stages": n,
                                                                                                 "mad": True},
                                                       down_single=V3["egp"] | {"mad": True})) for n in V4_STAGES])
# Pair order (cuda-w2-notes.md "Pair order"): the adopted single-token kernels reading the router's ids instead of the
# route output (pair_order), so moe_mm runs the route beside them on the workspace's side stream; the whole op only.
PAIR_ORDER = V3["egp"] | {"mad": True, "pair_order": True}
SINGLE_V3 += [("whole", "cuda_whole_egpmo", dict(WHOLE["cuda_whole"], gate_single=PAIR_ORDER, down_single=PAIR_ORDER))]
V3_OF = {name: V3_BASE[stage] for stage, name, _ in SINGLE_V3}  # v3-v5 variant -> the variant its bytes must equal
TRITON = {"gate_up": "triton_gate_up", "down": "triton_down", "whole": "triton_whole"}  # each stage's baseline
FIRST = {"gate_up": "cuda_mma", "down": "cuda_down", "whole": "cuda_whole"}  # the variant the others must equal
DEVICE = "cuda"  # the CPU test of this script's bookkeeping sets "cpu"


def _bench_kernels():
    """benchmarks/moe_kernels.py as a module (by path: benchmarks/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location("bench_kernels_for_cuda_w2", ROOT / "benchmarks" / "moe_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _provenance(commit: str | None) -> dict:
    import triton

    from tierstore.kernels import ABI_TAG
    from tierstore.kernels.cuda import loader

    try:
        seen = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        seen = ""
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                nvcc=loader.nvcc_version(), commit=commit or seen or "unknown", commit_seen=seen or None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), abi_tag=ABI_TAG,
                python=sys.version.split()[0])


def _block_tokens(name: str) -> int:
    """The route block size a variant runs on: MULTI_BT for the multi-token variants (v2 included), else 1."""
    return MULTI_BT if name.endswith("_multi") or "_multi_" in name else 1


def _down_wps(geo) -> int:
    """Words per bit slot of the preset's w2 matrix (the down kernels' build: w2_down.wps_of)."""
    from tierstore.kernels.cuda.w2_down import wps_of
    from tierstore.kernels.layout import w2_slot_layout

    return wps_of(w2_slot_layout(geo.hidden, geo.expert_inter))


def _staged_k(geo) -> int:
    """The down kernels' K in shared memory at the preset (w2_down.act_k: inter, or the pair tiles' 512 each)."""
    from tierstore.kernels.cuda.w2_down import act_k
    from tierstore.kernels.layout import w2_slot_layout

    return act_k(w2_slot_layout(geo.hidden, geo.expert_inter))


def _build(stage: str, options: dict, multi: bool = False, geo=None) -> tuple[object, dict]:
    """One CUDA variant of `stage` (gate_up: options {ahead}; down: {ahead, groups}; whole: W2MoeCuda's), the
    multi-token kernel when `multi` (whole: the same W2MoeCuda, run on block_tokens 16); geo: the preset, for the
    multi-token kernels' resident blocks per SM at its K."""
    from tierstore.kernels.cuda.w2_down import W2DownCuda
    from tierstore.kernels.cuda.w2_gate_up import W2GateUpCuda
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda
    from tierstore.kernels.cuda.w2_multi import W2DownMultiCuda, W2GateUpMultiCuda

    started = time.perf_counter()
    if stage != "gate_up" and geo is not None and _down_wps(geo) == 16:
        options = options | {"wps": 16}  # the down kernels' build for the preset's 16-word tiles (inter % 512 != 0)
    classes = {"gate_up": W2GateUpMultiCuda, "down": W2DownMultiCuda} if multi else {"gate_up": W2GateUpCuda,
                                                                                     "down": W2DownCuda}
    built = {**classes, "whole": W2MoeCuda}[stage](**options)  # whole: gate_multi picks the multi gate_up kernel
    k_len = {"gate_up": geo.hidden, "down": _staged_k(geo)} if geo is not None else {}
    if stage == "whole":
        parts = (("gate_up", built.gate_up_multi), ("down", built.down_multi)) if multi else (
            ("gate_up", built.gate_up), ("down", built.down))
        attrs = {f"{part}_{k}": v for part, kernel in parts
                 for k, v in (kernel.attributes(k_len.get(part)) if multi else kernel.attributes()).items()}
    else:
        attrs = built.attributes(k_len.get(stage)) if multi else built.attributes()
    gate_multi = options.get("gate_multi")  # recorded flat (gate_<option>); absent: W2MoeCuda's GATE_MULTI
    single = {key: options.get(key) or {} for key in ("gate_single", "down_single")}  # v3: <key>_<option>
    options = ({k: v for k, v in options.items() if k not in ("gate_multi", *single)}
               | {f"gate_{k}": v for k, v in (gate_multi or {}).items()}
               | {f"{key}_{k}": v for key, opts in single.items() for k, v in opts.items()})
    return built, dict(stage=stage, **options, block_tokens=MULTI_BT if multi else 1,
                       seconds=round(time.perf_counter() - started, 2), **attrs)


def _routed(geo, tokens, ids, w2, f4, block_tokens: int, dtype=torch.bfloat16):
    """A workspace of `block_tokens` routed for `ids` (outside any timing, as benchmarks/moe_kernels.py does)."""
    from tierstore.kernels import MissLog, MoeWorkspace, moe_route

    ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, dtype, DEVICE,
                               block_tokens=block_tokens)
    moe_route(ids, w2, f4, 0, MissLog.allocate(16, DEVICE), ws)
    return ws


def _workspace(geo, tokens, routing, w2, f4, dtype=torch.bfloat16):
    """x [T, H] and {block_tokens: workspace} for 1 and MULTI_BT, routed for `routing`."""
    x = torch.randn(tokens, geo.hidden, device=DEVICE, dtype=dtype)
    return x, {bt: _routed(geo, tokens, routing[0], w2, f4, bt, dtype) for bt in (1, MULTI_BT)}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.view(view), b.view(view)))


def _variant_row(kb, first, second, ref, tri, vs_first: dict) -> dict:
    cu = first.float()
    return dict(rel_err=kb._rel_err(cu, ref), rel_err_vs_triton=float((cu - tri).norm() / tri.norm()),
                max_abs_err=float((cu - ref).abs().max()), nan=bool(cu.isnan().any()),
                repeat_identical=_same_bytes(first, second), **vs_first)


def _launch_twice(kernels: dict, like: torch.Tensor, launch) -> dict:
    """Each variant launched twice by `launch(kernel, out, block_tokens)`, into two NaN-poisoned tensors shaped as
    `like`: {name: [first, second]}, or {name: the exception} when its launch raised (e.g. a refused programmatic
    launch), so that one variant's failure does not void the other variants' checks."""
    outs = {}
    for name, cuda in kernels.items():
        try:
            pair = [torch.full_like(like, float("nan")) for _ in range(2)]
            for out in pair:
                launch(cuda, out, _block_tokens(name))
            outs[name] = pair
        except Exception as exc:  # noqa: BLE001: recorded in the variant's check row, which makes it INVALID
            outs[name] = exc
    return outs


def _ran(outs: dict, name: str):
    """The first output of variant `name`, None when it did not run or raised."""
    got = outs.get(name)
    return None if got is None or isinstance(got, Exception) else got[0]


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _vs_first(name: str, out, first, multi=None, base=None) -> dict:
    """Comparison with the stage's first variant: required byte-identical for single-token variants (prefetch depth
    and row grouping change no arithmetic); recorded for the multi-token ones (another binary). A v2 variant
    (`_multi_` in its name) is also compared with the stage's current multi-token variant's output `multi`:
    required byte-identical (same binary arithmetic per pair). A v3 variant (V3_OF) is compared with its default
    variant's output `base` (same_bytes_as_default; None when that variant did not run: INVALID too)."""
    v2 = dict(same_bytes_as_multi=_same_bytes(out, multi)) if "_multi_" in name and multi is not None else {}
    v3 = dict(same_bytes_as_default=None if base is None else _same_bytes(out, base)) if name in V3_OF else {}
    if first is None:
        return dict(same_bytes_as_first=None, **v2, **v3)
    if _block_tokens(name) == 1:
        return dict(same_bytes_as_first=_same_bytes(out, first), **v3)
    diff = float((out.float() - first.float()).norm() / first.float().norm())
    return dict(same_bytes_as_first=None, same_bytes_as_single=_same_bytes(out, first), rel_diff_vs_single=diff, **v2)


def _stage_check(kb, stage: str, tokens, outs: dict, ref, tri) -> dict:
    """A gate_up or down check row: Triton's output `tri` and every variant's `outs` against `ref`."""
    first, multi, base = _ran(outs, FIRST[stage]), _ran(outs, MULTI[stage][0]), _ran(outs, V3_BASE[stage])
    return dict(tokens=tokens, stage=stage, pairs=ref.shape[0], rel_err_triton=kb._rel_err(tri, ref),
                variants={name: dict(error=_failure(got)) if isinstance(got, Exception) else
                          _variant_row(kb, got[0], got[1], ref, tri, _vs_first(name, got[0], first, multi, base))
                          for name, got in outs.items()})


def _check_gate_up(kb, geo, state, kernels: dict, tokens) -> dict:
    """Every gate_up variant against the reference and Triton, on NaN-poisoned outputs, launched twice."""
    from tierstore.kernels import moe_gate_up
    from tierstore.kernels.cuda.w2_gate_up import w2_gate_up_ref

    w2, f4 = state["w2"], state["f4"]
    routing = kb._routings(tokens, geo.top_k, geo.num_experts, 1, state["gen"], DEVICE)[0]
    x, wss = _workspace(geo, tokens, routing, w2, f4)
    ws = wss[1]
    ws.act.fill_(float("nan"))
    moe_gate_up(x, geo.top_k, w2, f4, 0, ws)
    outs = _launch_twice(kernels, ws.act, lambda cuda, out, bt: cuda(x, geo.top_k, w2, f4, 0, wss[bt], out=out))
    ref = w2_gate_up_ref(x, routing[0], w2, f4, 0)
    return _stage_check(kb, "gate_up", tokens, outs, ref, ws.act.float())


def _check_down(kb, geo, state, kernels: dict, tokens) -> dict:
    """Every down variant on Triton's act against the reference and Triton's y, NaN-poisoned, launched twice."""
    from tierstore.kernels import moe_down, moe_gate_up
    from tierstore.kernels.cuda.w2_down import w2_down_ref

    w2, f4 = state["w2"], state["f4"]
    routing = kb._routings(tokens, geo.top_k, geo.num_experts, 1, state["gen"], DEVICE)[0]
    x, wss = _workspace(geo, tokens, routing, w2, f4)
    ws = wss[1]
    moe_gate_up(x, geo.top_k, w2, f4, 0, ws)
    wss[MULTI_BT].act.copy_(ws.act)
    ws.y.fill_(float("nan"))
    moe_down(geo.top_k, w2, f4, 0, ws)
    outs = _launch_twice(kernels, ws.y, lambda cuda, out, bt: cuda(w2, f4, 0, wss[bt], out=out))
    ref = w2_down_ref(ws.act, routing[0], w2, f4, 0)
    return _stage_check(kb, "down", tokens, outs, ref, ws.y.clone())


def _check_whole(kb, geo, state, kernels: dict, tokens) -> dict:
    """Every whole-op variant (moe_mm with cuda_w2) against moe_mm_ref and Triton's moe_mm; misses counted."""
    from tierstore.kernels import MissLog, MoeWorkspace, moe_mm, moe_mm_ref

    w2, f4 = state["w2"], state["f4"]
    ids, weights = kb._routings(tokens, geo.top_k, geo.num_experts, 1, state["gen"], DEVICE)[0]
    x = torch.randn(tokens, geo.hidden, device=DEVICE, dtype=torch.bfloat16)

    def run(cuda_w2, block_tokens=1):
        ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, DEVICE,
                                   block_tokens=block_tokens)
        ws.act.fill_(float("nan"))
        ws.y.fill_(float("nan"))
        misses = MissLog.allocate(16, DEVICE)
        out = torch.full_like(x, float("nan"))
        moe_mm(x, ids, weights, w2, f4, 0, misses, ws, out=out, cuda_w2=cuda_w2)
        return out, misses.counts.tolist()

    tri, tri_misses = run(None)
    ref, missing_pairs, _ = moe_mm_ref(x, ids, weights, w2, f4, 0, act_dtype=torch.bfloat16)
    outs = {}
    for name, cuda in kernels.items():
        try:
            outs[name] = [run(cuda, _block_tokens(name)) for _ in range(2)]
        except Exception as exc:  # noqa: BLE001: this variant's check row records it (INVALID), the others still run
            outs[name] = exc
    first, multi, base = ((_ran(outs, key) or (None, None))[0] for key in (FIRST["whole"], MULTI["whole"][0],
                                                                         V3_BASE["whole"]))
    variants = {}
    for name, got in outs.items():
        if isinstance(got, Exception):
            variants[name] = dict(error=_failure(got))
            continue
        (a, misses_a), (b, _) = got
        variants[name] = _variant_row(kb, a, b, ref, tri.float(), _vs_first(name, a, first, multi, base))
        variants[name]["misses_equal_triton"] = misses_a == tri_misses
    return dict(tokens=tokens, stage="whole", pairs=ids.numel(), missing_pairs=missing_pairs,
                rel_err_triton=kb._rel_err(tri, ref), variants=variants)


def _invalid(checks: list[dict], name: str) -> list[str]:
    """Why variant `name`'s rows must not be read (empty: valid), from its T's check rows."""
    found = [c["variants"][name] for c in checks if name in c.get("variants", {})]
    if not found:
        return ["check did not run or raised"]
    v, why = found[0], []
    if "error" in v:
        return [f"check raised: {v['error']}"]
    if not v["rel_err"] <= REL_TOL:
        why.append(f"rel_err {v['rel_err']:.3g} > {REL_TOL:g}")
    if not v["rel_err_vs_triton"] <= REL_TOL:
        why.append(f"rel_err_vs_triton {v['rel_err_vs_triton']:.3g} > {REL_TOL:g}")
    if v["nan"]:
        why.append("NaN in the output (a row not written)")
    if not v["repeat_identical"]:
        why.append("repeat launches not byte-identical")
    if v["same_bytes_as_first"] is False:
        why.append("bytes differ from the stage's first variant (prefetch depth / row grouping must not change "
                   "arithmetic)")
    if v.get("same_bytes_as_multi") is False:
        why.append("bytes differ from the current multi-token variant's (v2 must not change arithmetic)")
    if name in V3_OF and v.get("same_bytes_as_default") is False:
        why.append(f"bytes differ from {V3_OF[name]}'s (v3 must not change arithmetic)")
    elif name in V3_OF and v.get("same_bytes_as_default") is None:
        why.append(f"not compared with {V3_OF[name]} (name it in --variants too)")
    if v.get("misses_equal_triton") is False:
        why.append("miss counts differ from the Triton op's")
    return why


def _timed(runner, label, calls, reps, kb, tokens, stage, variant, rnd, nbytes, unique, rotations) -> dict:
    us, err = runner.attempt(label, lambda: kb._graph_time_us(calls, reps))
    return dict(tokens=tokens, stage=stage, variant=variant, round=rnd, us=us, bytes=nbytes, unique_experts=unique,
                rotations=rotations, block_tokens=_block_tokens(variant), **({"error": err} if err else {}))


def _timing_routings(kb, geo, state, lay, tokens, device) -> tuple[dict, list, int]:
    """(bytes of one expert's matrices per stage in layout `lay`, the T's rotating routings on `device` (enough to
    defeat L2, as benchmarks/moe_kernels.py), the experts they route to on average)."""
    stage_bytes = {"gate_up": lay.w13.word_bytes + lay.w13.scale_bytes, "down": lay.w2.word_bytes + lay.w2.scale_bytes}
    stage_bytes["whole"] = stage_bytes["gate_up"] + stage_bytes["down"]
    count = max(4, min(32, int(8 * 2**20 * 60 / (tokens * geo.top_k * stage_bytes["whole"]) + 1)))  # as moe_kernels.py
    routings = kb._routings(tokens, geo.top_k, geo.num_experts, count, state["gen"], device)
    return stage_bytes, routings, kb._unique_experts(routings)


def _time_case(kb, geo, state, kernels: dict, tokens, runner) -> list[dict]:
    """Rows for one T: per stage the CUDA variants and Triton (ROUNDS each, alternating), then the stage's
    streaming ceiling (gate_up, down) or bf16 `_grouped_mm` (whole)."""
    from tierstore.kernels import MissLog, moe_down, moe_gate_up, moe_mm

    w2, f4 = state["w2"], state["f4"]
    stage_bytes, routings, unique = _timing_routings(kb, geo, state, w2.layout, tokens, DEVICE)
    both = [_workspace(geo, tokens, r, w2, f4) for r in routings]
    for _, wss in both:
        wss[1].act.copy_(torch.randn_like(wss[1].act))  # the down stage alone reads act
        wss[MULTI_BT].act.copy_(wss[1].act)
    cases = [(x, wss[1]) for x, wss in both]
    acts = [torch.empty_like(ws.act) for _, ws in cases]
    ys = [torch.empty_like(ws.y) for _, ws in cases]
    outs = [torch.empty_like(x) for x, _ in cases]
    misses = MissLog.allocate(16, DEVICE)
    fns = {"gate_up": {name: [lambda x=x, ws=wss[_block_tokens(name)], o=o, k=k: k(x, geo.top_k, w2, f4, 0, ws, out=o)
                              for (x, wss), o in zip(both, acts)] for name, k in kernels["gate_up"].items()},
           "down": {name: [lambda ws=wss[_block_tokens(name)], o=o, k=k: k(w2, f4, 0, ws, out=o)
                           for (_, wss), o in zip(both, ys)] for name, k in kernels["down"].items()},
           "whole": {name: [lambda x=x, ws=wss[_block_tokens(name)], o=o, r=r, k=k: moe_mm(x, r[0], r[1], w2, f4, 0,
                                                                                          misses, ws, out=o, cuda_w2=k)
                            for (x, wss), o, r in zip(both, outs, routings)] for name, k in kernels["whole"].items()}}
    fns["gate_up"]["triton_gate_up"] = [lambda x=x, ws=ws: moe_gate_up(x, geo.top_k, w2, f4, 0, ws) for x, ws in cases]
    fns["down"]["triton_down"] = [lambda ws=ws: moe_down(geo.top_k, w2, f4, 0, ws) for _, ws in cases]
    fns["whole"]["triton_whole"] = [lambda x=x, ws=ws, o=o, r=r: moe_mm(x, r[0], r[1], w2, f4, 0, misses, ws, out=o)
                                    for (x, ws), o, r in zip(cases, outs, routings)]
    rows = []
    for stage, variants in fns.items():
        rows += _stage_rows(kb, geo, state, runner, tokens, stage, variants, unique * stage_bytes[stage], unique,
                            routings, DEVICE)
    return rows


def _stage_rows(kb, geo, state, runner, tokens, stage, variants: dict, nbytes, unique, routings, device,
                rounds: int = ROUNDS) -> list[dict]:
    """One stage's rows for one T: its `variants` ({name: calls}, CUDA and Triton) timed `rounds` times, alternating,
    then its ceiling: bf16 `_grouped_mm` (whole) or the streaming read of `nbytes` (gate_up, down); none otherwise."""
    reps, count, rows = state["reps"], len(routings), []
    for rnd in range(rounds):
        for name, calls in variants.items():
            rows.append(_timed(runner, f"T={tokens} {name} round {rnd}", calls, reps, kb, tokens, stage, name, rnd,
                               nbytes, unique, count))
    if stage == "whole":
        us, err = runner.attempt(f"T={tokens} bf16", lambda: kb._bf16_case(geo, state["w13_bf16"], state["w2_bf16"],
                                                                          routings, reps))
        rows.append(dict(tokens=tokens, stage=stage, variant="bf16_grouped_mm", round=0, us=us,
                         bytes=unique * 2 * 3 * geo.hidden * geo.expert_inter, unique_experts=unique,
                         rotations=count, **({"error": err} if err else {})))
    elif stage in ("gate_up", "down"):
        copies = 4 if nbytes > 256e6 else max(4, int(4 * 64e6 / nbytes) + 1)
        us, err = runner.attempt(f"T={tokens} {stage} stream", lambda: kb._stream_us(int(nbytes), copies, reps, device))
        rows.append(dict(tokens=tokens, stage=stage, variant=f"stream_read_{stage}", round=0, us=us, bytes=nbytes,
                         unique_experts=unique, rotations=copies, **({"error": err} if err else {})))
    return rows


def _derive(rows: list[dict], invalid: dict[str, list[str]], hbm: float, baselines: dict | None = None) -> None:
    """One T's rows: a CUDA row whose check failed keeps its time as `invalid_us`; every timed row gets GB/s,
    %HBM, % of its stage's ceiling, its stage's Triton best round over this row's time and (whole op) bf16's."""
    best = {}
    for r in rows:
        if invalid.get(r["variant"]) and r.get("us") is not None:
            r["invalid"], r["invalid_us"], r["us"] = invalid[r["variant"]], r["us"], None
        if r.get("us") is not None:
            best[r["variant"]] = min(best.get(r["variant"], float("inf")), r["us"])
    for r in rows:
        if r.get("us") is None:
            continue
        stage = r["stage"]
        r.update(gb_per_s=r["bytes"] / r["us"] / 1e3, pct_hbm=100 * r["bytes"] / (r["us"] * 1e-6) / hbm)
        if f"stream_read_{stage}" in best:
            r["pct_of_stream"] = 100 * best[f"stream_read_{stage}"] / r["us"]
        baseline = (TRITON if baselines is None else baselines).get(stage)
        if baseline in best:
            r["triton_over_this"] = best[baseline] / r["us"]
        if stage == "whole" and "bf16_grouped_mm" in best:
            r["bf16_over_this"] = best["bf16_grouped_mm"] / r["us"]


def _print(result: dict) -> None:
    fmt = lambda d: " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())
    for name, b in result.get("build", {}).items():
        print(f"build {name}: " + (fmt(b) if "error" not in b else f"ERROR {b['error']['type']}: {b['error']['message'][:300]}"))
    for c in result.get("checks", []):
        print(f"check T={c['tokens']} {c.get('stage')}: "
              + fmt({k: v for k, v in c.items() if k not in ("tokens", "stage", "variants")}))
        for name, v in c.get("variants", {}).items():
            print(f"  {name}: {fmt(v)}")
    print(f"\n{'T':>3} {'stage':<7} {'variant':<24} {'rnd':>3} {'us':>8} {'GB/s':>6} {'%HBM':>5} {'%strm':>6} "
          f"{'triton/x':>8} {'bf16/x':>6}")
    for r in result.get("cases", []):
        head = f"{r['tokens']:>3} {r.get('stage', ''):<7} {r['variant']:<24} {r['round']:>3} "
        if r.get("error"):
            print(head + f"ERROR {r['error']['type']}: {(r['error']['message'].splitlines() or [''])[0][:100]}")
        elif r.get("invalid"):
            print(head + f"INVALID ({r['invalid_us']:.1f} us not to be read): {'; '.join(r['invalid'])}")
        else:
            print(head + f"{r['us']:>8.1f} {r['gb_per_s']:>6.0f} {r['pct_hbm']:>5.1f} {r.get('pct_of_stream', 0):>6.1f} "
                  f"{r.get('triton_over_this', 0):>8.2f} {r.get('bf16_over_this', 0):>6.2f}")
    print(f"\nstatus: {result['status']}")


def _variants(only: str | None) -> list[tuple[str, str, dict]]:
    """(stage, name, options) of every CUDA variant, per stage the single-token ones first (FIRST among them), or
    only those named in the comma-separated `only` (which may also name the v2 variants, MULTI_V2, and the v3 ones,
    SINGLE_V3: after the stage's others)."""
    single = ([("gate_up", name, dict(ahead=ahead)) for name, ahead in AHEAD.items()]
              + [("down", name, opts) for name, opts in DOWN.items()]
              + [("whole", name, opts) for name, opts in WHOLE.items()])
    every = [v for stage in TRITON for v in single + [(s, *MULTI[s]) for s in MULTI] if v[0] == stage]
    if only is None:
        return every
    known = [v for stage in TRITON for v in every + MULTI_V2 + SINGLE_V3 if v[0] == stage]
    names = set(only.split(","))
    unknown = names - {name for _, name, _ in known}
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; known: {[name for _, name, _ in known]}")
    return [v for v in known if v[1] in names]


def run(kb, args, result: dict, emit) -> None:
    from tierstore.geometry import get_preset

    runner = kb.Runner(probe=kb._cuda_probe if DEVICE == "cuda" else None)
    result.update(status="running: build", errors=runner.errors, checks=[], cases=[], build={})
    kernels = {"gate_up": {}, "down": {}, "whole": {}}
    geo = get_preset(args.preset)
    for stage, name, opts in _variants(args.variants):
        built, err = runner.attempt(f"build and load {name}", lambda: _build(stage, opts, _block_tokens(name) > 1, geo))
        result["build"][name] = built[1] if built else {"error": err}
        if built:
            kernels[stage][name] = built[0]
    emit(result)
    state = kb._setup(geo, DEVICE)
    state["reps"] = args.reps
    tokens_list = [int(t) for t in args.tokens.split(",")]
    checkers = {"gate_up": _check_gate_up, "down": _check_down, "whole": _check_whole}
    invalid = {}
    for tokens in tokens_list:
        rows = []
        for stage, checker in checkers.items():
            result["status"] = f"running: check T={tokens} {stage}"
            check, err = (runner.attempt(f"check T={tokens} {stage}", lambda: checker(kb, geo, state, kernels[stage],
                                                                                      tokens))
                          if kernels[stage] else (None, None))
            rows.append(check or dict(tokens=tokens, stage=stage, error=err or f"no CUDA {stage} variant built"))
            result["checks"].append(rows[-1])
            emit(result)
        invalid[tokens] = {name: _invalid(rows, name) for stage in kernels for name in kernels[stage]}
    _time_all(kb, geo, state, runner, tokens_list, invalid, result, emit,
              lambda tokens: _time_case(kb, geo, state, kernels, tokens, runner), DEVICE)


def _time_all(kb, geo, state, runner, tokens_list, invalid: dict, result: dict, emit, time_case, device,
              baselines: dict | None = None) -> None:
    """After the checks: the bf16 weights on `device`, then per T the rows of `time_case(T)` (an error row if it
    raised) with their derived columns (`invalid[T]`: the variants whose check failed; `baselines`: stage -> the
    Triton variant of its triton_over_this, default TRITON), emitted; the final status."""
    state["w13_bf16"] = torch.randn(geo.num_experts, 2 * geo.expert_inter, geo.hidden, device=device,
                                    dtype=torch.bfloat16)
    state["w2_bf16"] = torch.randn(geo.num_experts, geo.hidden, geo.expert_inter, device=device, dtype=torch.bfloat16)
    for tokens in tokens_list:
        result["status"] = f"running: timing T={tokens}"
        rows, err = runner.attempt(f"timing T={tokens}", lambda: time_case(tokens))
        rows = rows or [dict(tokens=tokens, stage="all", variant="all", round=0, us=None, error=err)]
        _derive(rows, invalid[tokens], kb.HBM_BYTES_PER_S, baselines)
        result["cases"] += rows
        emit(result)
    result["status"] = (f"stopped early: {runner.poisoned}" if runner.poisoned else
                        f"complete, {len(runner.errors)} failure(s) recorded in `errors`" if runner.errors else "complete")


def _run_and_report(kb, json_path: str, result: dict, run_fn) -> int:
    """`run_fn(emit)` with `result` written to `json_path` after every step, on SIGTERM and on a fatal error (what was
    measured is kept), then the table printed; the exit code (0, 124 terminated, 1 fatal)."""
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    emit = lambda r: kb._write_json(json_path, r)
    previous = signal.signal(signal.SIGTERM, kb._on_sigterm)
    code = 0
    try:
        run_fn(emit)
    except kb._Terminated:
        result["status"] = f"terminated by SIGTERM ({result.get('status')}); rows so far are kept"
        code = 124
    except Exception as exc:  # noqa: BLE001: outside any isolated step (setup): record, keep what was measured
        result["fatal"] = kb._error_dict(exc)
        result["status"] = f"fatal {type(exc).__name__} ({result.get('status')}): {str(exc)[:300]}"
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    emit(result)
    _print(result)
    return code



def _arguments(description: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line of this script and of cuda_fp4.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--tokens", default="1,8,32")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--variants", help="comma-separated CUDA variants to build, check and time (default: all)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--commit", help="commit of the tree being measured (the device copy may have no .git)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(__doc__.splitlines()[0], argv)
    if not torch.cuda.is_available():
        print("cuda_w2: no CUDA device; this benchmark measures GPU kernels only, nothing was run", file=sys.stderr)
        return 2
    kb = _bench_kernels()
    result: dict = dict(provenance=_provenance(args.commit), preset=args.preset, rel_tol=REL_TOL)
    return _run_and_report(kb, args.json, result, lambda emit: run(kb, args, result, emit))


if __name__ == "__main__":
    sys.exit(main())
