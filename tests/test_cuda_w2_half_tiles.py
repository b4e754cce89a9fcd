"""The CUDA down kernels built for 16-word tiles (W2_WPS 16, w2_half_tiles.cuh): inter not a multiple of 512, as
ds-v2-lite's 1408 (six 16-word tiles, the last half padding) and qwen3-30b-a3b's 768 (three: the last pair tile holds
one).

CPU: a numpy model that follows w2_half_tiles.cuh (pair tiles read with the 32-word loads, the upper tile clamped to
the last one, both halves of a bf16x2 scaled by one byte, activation pairs in the pair tiles' K order and zero from
inter on) against the float64 reference, with random bytes in every padding word and scale; the wrappers' tile width
rules; the builds compile, and the 32-word builds give the SASS of the commit before W2_WPS existed. GPU: the single-
and multi-token down kernels and the whole op at both presets' expert shapes against the references (outputs
poisoned, FP4 pairs NaN, missing pairs untouched, repeats byte-identical, multi-token bytes equal to single-token),
Triton's down within the bf16 budget, and a CUDA-graph replay equal to eager.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import test_cuda_fp4 as fp4_model
from tests.cuda_fixtures import (bf16_bits, fp4_pool, launched_twice, needs_nvcc, ptxas_report, random_pool,
                                  random_slots, registers, replayed_once, run_whole, same_bytes, slot_rows, to_cuda,
                                  w2_pool)
from tests.test_cuda_w2 import M32, _cuobjdump, bf16_halves, down_model_and_reference, prmt, w2_pair, warp_acc
from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_down, moe_mm, moe_mm_ref, moe_route, w2_tier
from tierstore.kernels.cuda import fp4_multi, fp4_stages, w2_down, w2_gate_up, w2_multi
from tierstore.kernels.cuda.w2_down import W2DownCuda, w2_down_ref
from tierstore.kernels.cuda.w2_moe import W2MoeCuda
from tierstore.kernels.layout import fp4_slot_layout, unpack_matrix_ref, w2_slot_layout

WPS32_BASELINE_COMMIT = "95b47b6"  # the down kernels before W2_WPS
PRESET_SHAPES = {"ds-v2-lite": (2048, 1408), "qwen3-30b-a3b": (2048, 768)}  # (hidden, expert inter)
EXPERTS, TOP_K, FP4_EXPERT, MISSING_EXPERT = 8, 2, 3, 6


# ---- numpy model of w2_half_tiles.cuh ----------------------------------------------------------------------

def scale_both(q: list[int], j: int) -> int:
    """`scale_both`: byte j of the 16 scale bytes q (4 words) in both bf16 exponent fields."""
    return (prmt(q[j >> 2], 0, 0x4040 | (j & 3) * 0x0101) << 7) & M32


def put_a16(a_mat, lo, hi, lo_scales, hi_scales, t, i, mm, g, c, tiles16):
    """Lane (g, c)'s four A registers of pair tile t (`load_tile16` + `tile_mma16`), as `put_a` places them."""
    up = min(2 * t + 1, tiles16 - 1)  # the upper 16-word tile, or tile 2t again

    def scales(row):  # .sa / .sb: tile 2t's 8 bytes (2 words), then tile `up`'s
        return row[4 * t: 4 * t + 2] + row[2 * up: 2 * up + 2]

    sa, sb = scales(lo_scales[g]), scales(hi_scales[g])
    a = (w2_pair(lo[g][32 * t + 4 * c + mm], i, scale_both(sa, i)),
         w2_pair(hi[g][32 * t + 4 * c + mm], i, scale_both(sb, i)),
         w2_pair(lo[g][16 * up + 4 * c + mm], i, scale_both(sa, 8 + i)),
         w2_pair(hi[g][16 * up + 4 * c + mm], i, scale_both(sb, 8 + i)))
    for reg, (row, col) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
        a_mat[row, col: col + 2] = bf16_halves(a[reg])


def build_pairs16(x_bits: list[int], k_len: int, k_real: int) -> list[int]:
    """`store_unit(load_unit16(x, q, k_real))` for every unit of k_len: xp [k_len / 2]."""
    at = lambda k: x_bits[k] if k < k_real else 0  # noqa: E731 - runs of 4 past k_real are zero
    xp = []
    for q in range(k_len // 16):
        ti, c = q >> 2, q & 3
        k = (ti >> 3) * 512 + (ti & 7) * 32 + 4 * c
        for m in range(4):
            xp += [at(k + m) | (at(k + 16 + m) << 16), at(k + 256 + m) | (at(k + 272 + m) << 16)]
    return xp


def model_down16(slot: torch.Tensor, layout, act: torch.Tensor) -> np.ndarray:
    """float64 [H]: what w2_down_mma built with W2_WPS 16 writes for one pair, lane by lane."""
    words, scales = slot_rows(slot, layout, "w2")
    tiles16 = layout.w2.words_per_row // 16
    pair_tiles = -(-tiles16 // 2)
    xp = build_pairs16(bf16_bits(act), w2_down.act_k(layout), layout.inter)
    put = functools.partial(put_a16, tiles16=tiles16)
    out = np.zeros(layout.hidden)
    for n0 in range(0, layout.hidden, 16):
        acc = warp_acc(words[n0: n0 + 8], words[n0 + 8: n0 + 16], scales[n0: n0 + 8], scales[n0 + 8: n0 + 16], xp,
                       [0] * 8, pair_tiles, put)
        out[n0: n0 + 8], out[n0 + 8: n0 + 16] = acc[:, :8, 0].sum(0), acc[:, 8:, 2].sum(0)
    return out


def test_model_scale_both_places_one_byte_in_both_halves():
    q = [0x04030201, 0x08070605, 0x0C0B0A09, 0x100F0E0D]  # byte j = j + 1
    for j in range(16):
        assert scale_both(q, j) == ((j + 1) << 7) | ((j + 1) << 23)


@pytest.mark.parametrize("inter", [224, 352, 768, 1408])
def test_model_of_the_half_tile_down_matches_the_reference(inter):
    """224: one 16-word tile (a lone half pair tile); 352: two, the second mostly padding; 768 (qwen3-30b-a3b): three;
    1408 (ds-v2-lite): six, the last half padding. random_pool fills every word and scale byte, padding included."""
    layout = w2_slot_layout(32, inter)
    assert layout.w2.wps == 16
    got, ref = down_model_and_reference(model_down16, 32, inter, inter)
    assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()


def test_model_negative_control_without_zeroed_activations_the_padding_leaks():
    """The zeros past inter are what cancels the padding: with the next values in their place the model is off."""
    inter = 352
    layout = w2_slot_layout(32, inter)
    gen = torch.Generator().manual_seed(9)
    w2 = w2_tier(32, inter, 1, 1, EXPERTS, "cpu")
    random_pool(w2, gen)
    act = torch.randn(512, generator=gen).to(torch.bfloat16)  # values past inter that a missing guard would read
    ref = (unpack_matrix_ref(w2.slots[0], layout, "w2").double() @ act[:inter].double()).numpy()[:16]  # rows 0..15
    words, scales = slot_rows(w2.slots[0], layout, "w2")
    xp = build_pairs16(bf16_bits(act), 512, 512)  # no guard
    acc = warp_acc(words[:8], words[8:16], scales[:8], scales[8:16], xp, [0] * 8, 1,
                   functools.partial(put_a16, tiles16=2))
    leaked = np.concatenate([acc[:, :8, 0].sum(0), acc[:, 8:, 2].sum(0)])
    assert np.abs(leaked - ref).max() > 1e-3 * np.abs(ref).max()


# ---- numpy model of fp4_half_tiles.cuh (the FP4 down on 16-word tiles) --------------------------------------

def f4_scale_both(word: int, i: int) -> int:
    """`f4_scale_both(biased word, i)`: byte i (+ the exponent bias 2) in both bf16 exponent fields."""
    return (fp4_model.prmt((word + 0x02020202) & M32, 0, 0x4040 | i * 0x0101) << 7) & M32


def f4_decode16(w: int, i: int, scale_word: int) -> tuple[float, float]:
    return fp4_model.bf16_halves(fp4_model.mul_bf16x2(fp4_model.pair_bits(fp4_model.selectors(w), i),
                                                      f4_scale_both(scale_word, i)))


def f4_build_pairs16(a_bits: list[int], k_len: int, k_real: int) -> list[int]:
    """`f4_build_pairs16`: unit q's pairs, zero past k_real."""
    at = lambda k: a_bits[k] if k < k_real else 0  # noqa: E731
    xp = [0] * (k_len // 2)
    for q in range(k_len // 16):
        k = 256 * (q >> 4) + 32 * ((q >> 2) & 3) + 4 * (q & 3)
        for m in range(4):
            for h in range(2):
                xp[8 * q + 2 * m + h] = at(k + 128 * h + m) | (at(k + 128 * h + 16 + m) << 16)
    return xp


def f4_model_down16(slot: torch.Tensor, layout, act: torch.Tensor) -> np.ndarray:
    """float64 [H]: what fp4_down_mma built with FP4_WPS 16 writes for one pair, lane by lane."""
    words, scales = slot_rows(slot, layout, "w2")  # scale words: one per 16-word tile
    tiles16 = layout.w2.words_per_row // 16
    xp = f4_build_pairs16(bf16_bits(act), w2_down.act_k(layout), layout.inter)
    out = np.zeros(layout.hidden)
    for n0 in range(0, layout.hidden, 16):
        lo, hi = words[n0: n0 + 8], words[n0 + 8: n0 + 16]
        acc = np.zeros((2, 16, 8))
        for t in range(-(-tiles16 // 2)):
            up = min(2 * t + 1, tiles16 - 1)
            for m in range(4):
                for i in range(4):
                    a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
                    for lane in range(32):
                        g, c = lane >> 2, lane & 3
                        sl, sh = scales[n0 + g], scales[n0 + 8 + g]
                        regs = (f4_decode16(lo[g][32 * t + 4 * c + m], i, sl[2 * t]),
                                f4_decode16(hi[g][32 * t + 4 * c + m], i, sh[2 * t]),
                                f4_decode16(lo[g][16 * up + 4 * c + m], i, sl[up]),
                                f4_decode16(hi[g][16 * up + 4 * c + m], i, sh[up]))
                        for reg, (row, col) in zip(regs, ((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8),
                                                          (g + 8, 2 * c + 8))):
                            a_mat[row, col: col + 2] = reg
                        b = xp[t * 128 + i * 32 + 8 * c + 2 * m: t * 128 + i * 32 + 8 * c + 2 * m + 2]
                        for reg in range(2):
                            b_mat[2 * c + 8 * reg: 2 * c + 8 * reg + 2, g] = fp4_model.bf16_halves(b[reg])
                    acc[i & 1] += a_mat @ b_mat
        total = acc.sum(0) * 0.25
        out[n0: n0 + 8], out[n0 + 8: n0 + 16] = total[:8, 0], total[8:, 0]
    return out


@pytest.mark.parametrize("inter", [96, 352, 1408])
def test_model_of_the_fp4_half_tile_down_matches_the_reference(inter):
    """96: one 16-word FP4 tile (a lone half pair tile); 352: three, the last mostly padding; 1408 (ds-v2-lite): eleven.
    Every word and scale byte random (0..240), padding included."""
    layout = fp4_slot_layout(32, inter)
    assert layout.w2.wps == 16
    gen = torch.Generator().manual_seed(inter + 1)
    slot = random_slots(torch.empty(1, layout.slot_bytes, dtype=torch.uint8), layout, gen, 0, 241)[0]
    act = torch.randn(inter, generator=gen).to(torch.bfloat16)
    ref = (unpack_matrix_ref(slot, layout, "w2").double() @ act.double()).numpy()
    got = f4_model_down16(slot, layout, act)
    assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()


# ---- the wrappers' tile width ------------------------------------------------------------------------------

@pytest.mark.parametrize("hidden,inter,wps,act_k", [(7168, 2048, 32, 2048), (2048, 1408, 16, 1536),
                                                    (2048, 768, 16, 1024), (512, 96, 16, 512)])
def test_tile_width_and_staged_k_of_a_layout(hidden, inter, wps, act_k):
    layout = w2_slot_layout(hidden, inter)
    assert w2_down.wps_of(layout) == wps and w2_down.act_k(layout) == act_k
    w2_down.check_build(layout, 1, wps)
    other = 48 - wps
    with pytest.raises(ValueError, match=f"built for {other}-word tiles; .* build it with wps={wps}"):
        w2_down.check_build(layout, 1, other)


def test_a_16_word_build_adds_its_define_and_a_32_word_build_keeps_the_command_of_before():
    assert "W2_WPS" not in w2_down.build_defines(2, 1, early=True, pdl=True)
    assert w2_down.build_defines(2, 1, early=True, pdl=True, wps=16)["W2_WPS"] == 16
    with pytest.raises(ValueError, match="wps .* is 32 or 16, got 8"):
        w2_down.check_wps(8)


def test_shared_memory_of_the_multi_token_down_keeps_its_bank_spread():
    """stride / 4 odd (w2_multi.cuh) holds for the pair tiles' K too."""
    for _, inter in PRESET_SHAPES.values():
        k = w2_down.act_k(w2_slot_layout(2048, inter))
        assert ((k // 2 + w2_multi.PAD_WORDS) // 4) % 2 == 1
        assert w2_multi.shared_bytes(k) == 4 * 8 * (k // 2 + w2_multi.PAD_WORDS)


# ---- builds ------------------------------------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("defines", [{}, {"W2_EARLY": 1, "W2_PDL": 1}, {"W2_GROUPS": 2}])
def test_single_token_half_tile_builds_compile_without_spills(tmp_path, defines):
    report = ptxas_report(w2_down.SOURCE, tmp_path / "k.cubin", {"W2_AHEAD": 2, "W2_WPS": 16, **defines})
    assert "0 bytes spill stores" in report and registers(report) <= 128


@needs_nvcc
def test_multi_token_half_tile_build_compiles():
    """The multi-token build at W2_AHEAD 2 spills the few values a row group's end reads (24 bytes, measured with
    nvcc 13.0); W2_AHEAD 1 spills nothing. Both must build."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        for ahead in (1, 2):
            report = ptxas_report(w2_multi.DOWN_SOURCE, Path(tmp) / "k.cubin", {"W2_AHEAD": ahead, "W2_WPS": 16})
            assert registers(report) <= 128
            spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
            assert spilled <= 32 if ahead == 2 else spilled == 0


@needs_nvcc
@pytest.mark.parametrize("source,defines", [("single", {"FP4_AHEAD": 1}), ("single", {"FP4_AHEAD": 2}),
                                            ("single", {"FP4_AHEAD": 3}), ("multi", {"FP4_AHEAD": 1, "FP4_PDL": 1}),
                                            ("multi", {"FP4_AHEAD": 2})])
def test_fp4_half_tile_builds_compile_without_spills(tmp_path, source, defines):
    """The FP4 16-word down within its launch bounds' registers (the single-token kernels 4 blocks of 128 threads,
    the multi-token down 3 at FP4_AHEAD 2, else 4), no spills."""
    path = fp4_stages.SOURCE if source == "single" else fp4_multi.SOURCE
    report = ptxas_report(path, tmp_path / "k.cubin", {**defines, "FP4_WPS": 16})
    assert "0 bytes spill stores" in report
    blocks = 3 if source == "multi" and defines["FP4_AHEAD"] >= 2 else 4
    down = re.search(r"fp4_down_\w+' for 'sm_90a'.*?Used (\d+) registers", report, re.S)
    assert down and int(down.group(1)) * 128 * blocks <= 65536


def _sass(source: Path, defines: dict, cubin: Path) -> list[str]:
    ptxas_report(source, cubin, defines)
    text = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", text)]


@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump")
@needs_nvcc
@pytest.mark.parametrize("source,defines", [(w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1}),
                                            (w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1, "W2_EARLY": 1,
                                                              "W2_PDL": 1}),
                                            (w2_multi.DOWN_SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1}),
                                            (w2_gate_up.SOURCE, {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_PDL": 1}),
                                            (fp4_stages.SOURCE, {"FP4_AHEAD": 2}),
                                            (fp4_multi.SOURCE, {"FP4_AHEAD": 1, "FP4_PDL": 1})])
def test_32_word_builds_give_the_sass_of_before(tmp_path, source, defines):
    """The 32-word builds, and the other kernels that share the K loop generalised for the FP4 pair tiles
    (bf16_mma.cuh), compile to the SASS of before."""
    root = Path(__file__).resolve().parents[1]
    old = tmp_path / "old"
    old.mkdir()
    for path in source.parent.glob("*.cu*"):
        rel = path.relative_to(root).as_posix()
        proc = subprocess.run(["git", "show", f"{WPS32_BASELINE_COMMIT}:{rel}"], capture_output=True, cwd=root)
        if proc.returncode == 0:
            (old / path.name).write_bytes(proc.stdout)
        elif path.name == source.name:
            pytest.skip(f"git show {WPS32_BASELINE_COMMIT}:{rel} failed (no history here)")
    assert _sass(source, defines, tmp_path / "new.cubin") == _sass(old / source.name, defines, tmp_path / "old.cubin")


# ---- GPU ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(PRESET_SHAPES))
def preset_case(request):
    """A preset's expert shapes, 8 experts: expert FP4_EXPERT FP4-resident, MISSING_EXPERT without a slot."""
    hidden, inter = PRESET_SHAPES[request.param]
    gen = torch.Generator().manual_seed(11)
    w2 = w2_pool(hidden, inter, EXPERTS, gen, (112, 124), missing=MISSING_EXPERT)
    assert w2_down.wps_of(w2.layout) == 16
    return dict(name=request.param, w2=to_cuda(w2), f4_with=to_cuda(fp4_pool(hidden, inter, EXPERTS, FP4_EXPERT)),
                f4_none=to_cuda(fp4_pool(hidden, inter, EXPERTS)), gen=gen,
                down={(a, g): W2DownCuda(ahead=a, groups=g, wps=16) for a, g in ((2, 1), (2, 2), (1, 1))},
                down_v3=W2DownCuda(wps=16, early=True, pdl=True, pairs_grid=True),
                down_multi=w2_multi.W2DownMultiCuda(wps=16),
                whole=W2MoeCuda(wps=16))


def _ids(case, tokens: int, with_fp4: bool = True) -> torch.Tensor:
    """Distinct experts per token; token 0 routes the missing expert, the last token the FP4 one (when asked)."""
    rows = [torch.randperm(EXPERTS, generator=case["gen"])[:TOP_K].tolist() for _ in range(tokens)]
    for row, expert in ((rows[0], MISSING_EXPERT), (rows[-1], FP4_EXPERT if with_fp4 else None)):
        if expert is not None and expert not in row:
            row[0 if row[1] != expert else 1] = expert
    return torch.tensor(rows, dtype=torch.int32).cuda()


def _down_ws(case, ids, block_tokens):
    w2 = case["w2"]
    ws = MoeWorkspace.allocate(ids.shape[0], TOP_K, EXPERTS, w2.layout.hidden, w2.layout.inter, torch.bfloat16, "cuda",
                               block_tokens=block_tokens)
    moe_route(ids, w2, case["f4_with"], 0, MissLog.allocate(4, "cuda"), ws)
    return ws


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 3, 8, 32])
def test_half_tile_down_matches_the_reference_and_triton(preset_case, tokens):
    case, w2, f4 = preset_case, preset_case["w2"], preset_case["f4_with"]
    ids = _ids(case, tokens)
    act = torch.randn(tokens * TOP_K, w2.layout.inter, generator=case["gen"]).to(torch.bfloat16).cuda()
    ws1, ws16 = _down_ws(case, ids, 1), _down_ws(case, ids, 16)
    ws1.act.copy_(act)
    ws16.act.copy_(act)
    kernels = dict(case["down"]) | {"v3": case["down_v3"]}
    outs = launched_twice(kernels, ws1.y, -7.0, lambda kernel, out: kernel(w2, f4, 0, ws1, out=out))
    outs["multi"] = launched_twice({0: case["down_multi"]}, ws16.y, -7.0,
                                   lambda kernel, out: kernel(w2, f4, 0, ws16, out=out))[0]
    torch.cuda.synchronize()
    ref = w2_down_ref(act, ids, w2, f4, 0)
    flat = ids.reshape(-1).cpu()
    fp4_rows, missing_rows = (flat == FP4_EXPERT).cuda(), (flat == MISSING_EXPERT).cuda()
    w2_rows = ~(fp4_rows | missing_rows)
    first = outs[(2, 1)][0]
    assert first[fp4_rows].isnan().all() and (first[missing_rows] == -7.0).all()
    got = first[w2_rows]
    assert not got.isnan().any()
    assert float((got - ref[w2_rows]).norm() / ref[w2_rows].norm()) <= 1e-5  # fp32 sums of exact products
    for a, b in outs.values():  # repeats, prefetch depth, row grouping, v3 prologue, multi-token columns
        assert same_bytes(a, first) and same_bytes(b, first)
    ws1.y.fill_(float("nan"))
    moe_down(TOP_K, w2, f4, 0, ws1)  # Triton computes the FP4 pair too: compare the W2 rows
    tri = ws1.y[w2_rows]
    assert float((got - tri).norm() / tri.norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 4, 8, 32])
def test_half_tile_whole_op_matches_moe_mm_ref_with_misses(preset_case, tokens):
    case, f4 = preset_case, preset_case["f4_none"]
    w2 = case["w2"]
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    ids = _ids(case, tokens, with_fp4=False)
    x = torch.randn(tokens, w2.layout.hidden, generator=case["gen"]).to(torch.bfloat16).cuda()
    ref, missing_pairs, missing = moe_mm_ref(x, ids, weights, w2, f4, 0, act_dtype=torch.bfloat16)
    runs = {bt: run_whole(x, ids, weights, w2, f4, case["whole"], w2.layout.inter, EXPERTS, 4, block_tokens=bt)
            for bt in (1, 16)}
    out, counts, entries = runs[1]
    assert not out.isnan().any()
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    assert counts == [missing_pairs, len(missing)] and [tuple(e) for e in entries[: len(missing)]] == missing
    assert same_bytes(runs[16][0], out) and runs[16][1] == counts  # the multi-token kernels: the same bytes
    tri, tri_counts, _ = run_whole(x, ids, weights, w2, f4, None, w2.layout.inter, EXPERTS, 4)
    assert tri_counts == counts and float((out.float() - tri.float()).norm() / tri.float().norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
def test_half_tile_whole_op_replays_in_a_cuda_graph(preset_case):
    case, f4, tokens = preset_case, preset_case["f4_none"], 4
    w2 = case["w2"]
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    ids = _ids(case, tokens, with_fp4=False)
    x = torch.randn(tokens, w2.layout.hidden, generator=case["gen"]).to(torch.bfloat16).cuda()
    eager, counts, _ = run_whole(x, ids, weights, w2, f4, case["whole"], w2.layout.inter, EXPERTS, 4)
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, w2.layout.hidden, w2.layout.inter, torch.bfloat16, "cuda",
                               block_tokens=1)
    misses = MissLog.allocate(4, "cuda")
    out = torch.full_like(x, float("nan"))
    call = lambda: moe_mm(x, ids, weights, w2, f4, 0, misses, ws, out=out, cuda_w2=case["whole"])  # noqa: E731
    replayed_once(call, misses, out)
    assert same_bytes(out, eager) and misses.counts.tolist() == counts


@pytest.mark.gpu
@needs_nvcc
def test_a_32_word_build_refuses_a_half_tile_pool(preset_case):
    w2, f4 = preset_case["w2"], preset_case["f4_none"]
    ids = _ids(preset_case, 2, with_fp4=False)
    ws = _down_ws(preset_case, ids, 1)
    with pytest.raises(ValueError, match="built for 32-word tiles"):
        W2DownCuda()(w2, f4, 0, ws)


# ---- GPU: the FP4 down on 16-word tiles and both tiers together at ds-v2-lite's shapes --------------------

FP4_SLOTS = {1: 0, 2: 1, 4: 2}  # expert -> FP4 slot; expert 2 in both tiers (FP4 wins); MISSING_EXPERT in neither


@pytest.fixture(scope="module")
def fp4_case():
    """ds-v2-lite's expert shapes (inter 1408: 16-word tiles in both tiers), W2 pool with MISSING_EXPERT absent, FP4
    pool with FP4_SLOTS; the FP4 downs and the whole op built for 16-word tiles."""
    from tierstore.kernels.cuda.fp4_multi import Fp4DownMultiCuda
    from tierstore.kernels.cuda.fp4_stages import Fp4DownCuda
    from tierstore.kernels.cuda.tier_moe import TierMoeCuda

    hidden, inter = PRESET_SHAPES["ds-v2-lite"]
    gen = torch.Generator().manual_seed(21)
    w2 = w2_pool(hidden, inter, EXPERTS, gen, (112, 124), missing=MISSING_EXPERT)
    f4 = fp4_tier(hidden, inter, len(FP4_SLOTS), 1, EXPERTS, "cpu")
    for expert, slot in FP4_SLOTS.items():
        f4.slots[slot] = random_slots(f4.slots[slot: slot + 1].clone(), f4.layout, gen, 116, 128)[0]
        f4.table[0, expert] = slot
    assert w2_down.wps_of(f4.layout) == 16
    return dict(w2=to_cuda(w2), f4=to_cuda(f4), gen=gen, down={a: Fp4DownCuda(ahead=a, wps=16) for a in (1, 2)},
                down_multi={a: Fp4DownMultiCuda(ahead=a, wps=16) for a in (1, 2)},
                tier=TierMoeCuda(w2=W2MoeCuda(wps=16), fp4_wps=16))


def _fp4_ids(case, tokens: int) -> torch.Tensor:
    """Distinct experts per token; token 0 routes an FP4-only, a both-tier and the missing expert when it can."""
    rows = [torch.randperm(EXPERTS, generator=case["gen"])[:TOP_K].tolist() for _ in range(tokens)]
    rows[0] = [1, MISSING_EXPERT]
    if tokens > 1:
        rows[1] = [2, 5]
    return torch.tensor(rows, dtype=torch.int32).cuda()


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_fp4_half_tile_down_matches_the_reference(fp4_case, tokens):
    from tierstore.kernels.cuda.fp4_stages import fp4_down_ref

    case, f4 = fp4_case, fp4_case["f4"]
    ids = _fp4_ids(case, tokens)
    act = torch.randn(tokens * TOP_K, f4.layout.inter, generator=case["gen"]).to(torch.bfloat16).cuda()
    runs = {}
    for bt, kernels in ((1, case["down"]), (16, case["down_multi"])):
        ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, f4.layout.hidden, f4.layout.inter, torch.bfloat16, "cuda",
                                   block_tokens=bt)
        moe_route(ids, case["w2"], f4, 0, MissLog.allocate(4, "cuda"), ws)
        ws.act.copy_(act)
        runs[bt] = launched_twice(kernels, ws.y, -7.0, lambda kernel, out, ws=ws: kernel(f4, 0, ws, out=out))
    torch.cuda.synchronize()
    ref = fp4_down_ref(act, ids, f4, 0)
    rows = torch.tensor([e in FP4_SLOTS for e in ids.reshape(-1).tolist()], device="cuda")
    first = runs[1][2][0]
    assert rows.any() and (first[~rows] == -7.0).all() and not first[rows].isnan().any()
    assert float((first[rows] - ref[rows]).norm() / ref[rows].norm()) <= 1e-5  # fp32 sums of exact products
    for outs in runs.values():  # repeats, prefetch depth, the multi-token columns: the single-token bytes
        assert all(same_bytes(o, first) for pair in outs.values() for o in pair)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_both_tiers_on_half_tiles_match_moe_mm_ref_with_mixed_residency(fp4_case, tokens):
    case, w2, f4 = fp4_case, fp4_case["w2"], fp4_case["f4"]
    ids = _fp4_ids(case, tokens)
    x = torch.randn(tokens, w2.layout.hidden, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    ref, missing_pairs, missing = moe_mm_ref(x, ids, weights, w2, f4, 0, act_dtype=torch.bfloat16)
    runs = {bt: run_whole(x, ids, weights, w2, f4, case["tier"], w2.layout.inter, EXPERTS, 4, block_tokens=bt)
            for bt in (1, 16)}
    out, counts, entries = runs[1]
    assert not out.isnan().any()  # every FP4 pair computed (the W2 down marks them NaN until the FP4 down runs)
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    assert counts == [missing_pairs, len(missing)] and [tuple(e) for e in entries[: len(missing)]] == missing
    assert same_bytes(runs[16][0], out) and runs[16][1] == counts
    tri, tri_counts, _ = run_whole(x, ids, weights, w2, f4, None, w2.layout.inter, EXPERTS, 4)
    assert tri_counts == counts and float((out.float() - tri.float()).norm() / tri.float().norm()) <= 1e-2
