"""kernels/cuda: the CUDA C++ FP4 gate_up and down (fp4_moe.cu, fp4_stages.py) and both tiers together
(tier_moe.TierMoeCuda: W2 stages, then FP4 stages).

CPU: a numpy model that follows fp4_fragments.cuh and fp4_moe.cu lane by lane (PRMT table decode, the biased
scale pairs, mul.rn.bf16x2, the shared-memory activation pairs, mma.m16n8k16 fragments as the PTX ISA defines
them) against `unpack_matrix_ref` for every e2m1 code in every nibble slot at every scale byte 0..240, and the
model's stages against the references on random inputs; argument kinds against the kernel signatures; the
kernels compiling without spills (where nvcc exists). The model checks the index and bit arithmetic, not the
hardware; the GPU tests (marker gpu) run the kernels.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from tests.cuda_fixtures import (M32, bench_module, bench_on_cpu, bf16_bits, down_ref, gate_up_ref, launched_twice,
                                  needs_nvcc, placed, ptxas_report, random_slots, registers, replayed_once, run_whole,
                                  same_bytes, signature_kinds, slot_rows, to_cuda, w2_pool)
from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_gate_up, moe_mm, moe_mm_ref, moe_route, w2_tier
from tierstore.kernels.cuda import fp4_multi, fp4_stages
from tierstore.kernels.cuda.fp4_stages import (Fp4DownCuda, Fp4GateUpCuda, check_geometry, fp4_down_ref,
                                               fp4_gate_up_ref)
from tierstore.kernels.layout import MAX_SCALE_BYTE, fp4_slot_layout, unpack_matrix_ref


def _header_constant(name: str) -> int:
    text = (fp4_stages.SOURCE.parent / "fp4_fragments.cuh").read_text()
    return int(re.search(name + r" = (0x[0-9A-Fa-f]+)u", text).group(1), 16)


LO_TABLE = (_header_constant("kLoTable0"), _header_constant("kLoTable1"))  # the tables the kernels use
HI_TABLE = (_header_constant("kHiTable0"), _header_constant("kHiTable1"))


# ---- host side -------------------------------------------------------------------------------------------

def _launch_inputs(tokens: int, block_tokens: int):
    """An FP4 tier (H 512, I 256, 8 experts), a workspace (top-2) and zero activations [tokens, 512] on the CPU: what
    the launch-argument builders read (pointers and shapes, no launch)."""
    f4 = fp4_tier(512, 256, 2, 2, 8, "cpu")
    ws = MoeWorkspace.allocate(tokens, 2, 8, 512, 256, torch.bfloat16, "cpu", block_tokens=block_tokens)
    return f4, ws, torch.zeros(tokens, 512, dtype=torch.bfloat16)


def _assert_kinds(kinds: str, args: list) -> None:
    """One launch argument per kind letter, a float where the kernel takes `f`, an int (pointer or integer)
    elsewhere."""
    assert len(args) == len(kinds)
    for kind, value in zip(kinds, args):
        assert isinstance(value, float if kind == "f" else int)


def test_arg_kinds_match_the_kernel_signatures_and_launch_args():
    text = fp4_stages.SOURCE.read_text()
    assert signature_kinds(text, fp4_stages.GATE_UP_KERNEL) == fp4_stages.GATE_UP_ARG_KINDS
    assert signature_kinds(text, fp4_stages.DOWN_KERNEL) == fp4_stages.DOWN_ARG_KINDS
    f4, ws, x = _launch_inputs(tokens=1, block_tokens=1)
    _assert_kinds(fp4_stages.GATE_UP_ARG_KINDS, fp4_stages.gate_up_args(x, 2, f4, 1, ws, ws.act, 0.5))
    _assert_kinds(fp4_stages.DOWN_ARG_KINDS, fp4_stages.down_args(f4, 1, ws, ws.y))
    gate = fp4_stages.gate_up_args(x, 2, f4, 1, ws, ws.act, None)
    assert gate[6:8] == [512 // 8, 512 // 32] and gate[9] == 8 and gate[-2:] == [0.0, 0]
    down = fp4_stages.down_args(f4, 1, ws, ws.y)
    assert down[4:8] == [f4.layout.w2_words_offset, f4.layout.w2_scales_offset, 256 // 8, 256 // 32]


def test_geometry_limits():
    check_geometry(fp4_slot_layout(7168, 2048))  # DeepSeek-V3
    with pytest.raises(ValueError, match="hidden must be a multiple of 256"):
        check_geometry(fp4_slot_layout(1152, 256))
    check_geometry(fp4_slot_layout(2048, 1408))  # ds-v2-lite: the down's 16-word tile build reads its inter
    fp4_stages.check_down_build(fp4_slot_layout(2048, 1408), 16)
    with pytest.raises(ValueError, match="FP4 down kernel was built for 32-word tiles; the pool's w2 matrix \\(inter "
                                         "1408\\) has 16-word tiles: build it with wps=16"):
        fp4_stages.check_down_build(fp4_slot_layout(2048, 1408), 32)
    with pytest.raises(ValueError, match="FP4 slots only"):
        from tierstore.kernels.layout import w2_slot_layout
        check_geometry(w2_slot_layout(1024, 512))


@needs_nvcc
@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_kernels_compile_without_spills(tmp_path, ahead):
    report = ptxas_report(fp4_stages.SOURCE, tmp_path / "k.cubin", {"FP4_AHEAD": ahead})
    for kernel in (fp4_stages.GATE_UP_KERNEL, fp4_stages.DOWN_KERNEL):
        info = report.split(f"Compiling entry function '{kernel}'")[1]
        regs = registers(info)
        assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores", info) and regs <= 128  # 4 blocks / SM


def test_multi_arg_kinds_match_the_kernel_signatures_and_launch_args():
    text = fp4_multi.SOURCE.read_text()
    assert signature_kinds(text, fp4_multi.GATE_KERNEL) == fp4_multi.GATE_ARG_KINDS
    assert signature_kinds(text, fp4_multi.DOWN_KERNEL) == fp4_multi.DOWN_ARG_KINDS
    f4, ws, x = _launch_inputs(tokens=4, block_tokens=16)
    gate = fp4_multi.gate_launch_args(x, 2, f4, 1, ws, ws.act, 0.5)
    down = fp4_multi.down_launch_args(f4, 1, ws, ws.y)
    _assert_kinds(fp4_multi.GATE_ARG_KINDS, gate)
    _assert_kinds(fp4_multi.DOWN_ARG_KINDS, down)
    assert gate[6:8] == [512 // 8, 512 // 32] and gate[9] == 8 and gate[14:16] == [16, 2] and gate[-2:] == [0.5, 1]
    assert gate[11] == ws.block_fill.data_ptr() and down[11] == ws.block_fill.data_ptr() and down[14] == 16
    assert down[4:8] == [f4.layout.w2_words_offset, f4.layout.w2_scales_offset, 256 // 8, 256 // 32]


def test_multi_shared_memory_and_the_pad():
    """Columns of K / 2 + 2 words: 8-byte aligned (the units' stores) and 2 mod 32 words apart (no bank conflict in
    a half warp's B reads, fp4_moe_multi.cu); DeepSeek-V3: 57.4 KB gate_up (4 columns), 32.8 KB down (8)."""
    assert fp4_multi.shared_bytes(7168, 4) == 4 * 4 * 3586 and fp4_multi.shared_bytes(2048, 8) == 4 * 8 * 1026
    for k in (256, 1024, 2048, 7168):
        stride = k // 2 + fp4_multi.PAD_WORDS
        assert stride % 2 == 0 and stride % 32 == 2
        banks = {(g * stride + 8 * c) % 32 for g in range(4) for c in range(4)}  # a half warp's first words
        assert banks == set(range(0, 32, 2))
    with pytest.raises(ValueError, match="warps 4 or 8"):
        fp4_multi.Fp4GateUpMultiCuda(warps=6)


@needs_nvcc
@pytest.mark.parametrize("defines", [{"FP4_AHEAD": 2}, {"FP4_AHEAD": 1}, {"FP4_AHEAD": 2, "FP4_STAGE_COLS": 8},
                                     {"FP4_AHEAD": 2, "FP4_WARPS": 4, "FP4_STAGE_COLS": 8},
                                     {"FP4_AHEAD": 2, "FP4_EARLY": 1}, {"FP4_AHEAD": 1, "FP4_PDL": 1}])
def test_multi_kernels_compile_without_spills(tmp_path, defines):
    report = ptxas_report(fp4_multi.SOURCE, tmp_path / "k.cubin", defines)
    down_blocks = 3 if defines["FP4_AHEAD"] >= 2 else 4
    for kernel, blocks in ((fp4_multi.GATE_KERNEL, 16 // defines.get("FP4_WARPS", 8)), (fp4_multi.DOWN_KERNEL, down_blocks)):
        info = report.split(f"Compiling entry function '{kernel}'")[1]
        threads = 32 * defines.get("FP4_WARPS", 8) if kernel == fp4_multi.GATE_KERNEL else 128
        assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores", info), info[:400]
        assert registers(info) * threads * blocks <= 65536  # the launch bounds' blocks per SM fit the registers


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, *args, **kwargs):
        self.log.append(self.name)


def _tier_with_recorders(log):
    from tierstore.kernels.cuda.tier_moe import TierMoeCuda

    tier = object.__new__(TierMoeCuda)  # no build: the launches are recorders
    names = ("w2 stages", "fp4 gate_up", "fp4 down", "fp4 gate_up multi", "fp4 gate_up multi wide", "fp4 down multi")
    (tier.w2, tier.fp4_gate_up, tier.fp4_down, tier.fp4_gate_up_multi, tier.fp4_gate_up_multi_wide,
     tier.fp4_down_multi) = (_Recorder(n, log) for n in names)
    tier.fp4_gate_up_multi.rows_per_block = tier.fp4_gate_up_multi_wide.rows_per_block = 64
    tier.fp4_gate_up.pair_order = tier.fp4_down.pair_order = False  # route order: no ids needed
    tier.fp4_wps = 32
    return tier


@pytest.mark.parametrize("block_tokens,tokens,fp4_stages_run", [
    (1, 1, ["fp4 gate_up", "fp4 down"]), (16, 1, ["fp4 gate_up multi", "fp4 down multi"]),
    (16, 16, ["fp4 gate_up multi", "fp4 down multi"]),  # 32 pairs over 8 experts: 4 per expert
    (16, 17, ["fp4 gate_up multi wide", "fp4 down multi"])])  # 34 pairs: above WIDE_FROM (4) per expert
def test_tier_moe_launches_w2_stages_before_the_fp4_down_and_checks_first(monkeypatch, block_tokens, tokens,
                                                                           fp4_stages_run):
    from tierstore.kernels.cuda import fp4_multi

    for module in (fp4_stages, fp4_multi):  # CPU tensors: no CUDA check here
        monkeypatch.setattr(module, "check_gate_up_inputs", lambda *a: None)
        monkeypatch.setattr(module, "check_down_inputs", lambda *a: None)
    log = []
    w2, f4 = w2_tier(1024, 512, 1, 1, 8, "cpu"), fp4_tier(1024, 512, 1, 1, 8, "cpu")
    ws = MoeWorkspace.allocate(tokens, 2, 8, 1024, 512, torch.bfloat16, "cpu", block_tokens=block_tokens)
    _tier_with_recorders(log)(torch.zeros(tokens, 1024, dtype=torch.bfloat16), 2, w2, f4, 0, ws)
    assert log == ["w2 stages"] + fp4_stages_run  # the FP4 down overwrites the W2 down's NaN rows
    log.clear()
    with pytest.raises(ValueError, match="same shape"):
        _tier_with_recorders(log)(torch.zeros(1, 1024, dtype=torch.bfloat16), 2, w2, fp4_tier(1024, 512, 1, 2, 8, "cpu"),
                                  0, ws)
    assert log == []  # nothing launched


@pytest.mark.parametrize("block_tokens", [1, 16])
def test_tier_moe_refuses_bad_fp4_inputs_before_any_launch(block_tokens):
    log = []
    w2 = w2_tier(1024, 512, 1, 1, 8, "cpu")
    ws = MoeWorkspace.allocate(1, 2, 8, 1024, 512, torch.bfloat16, "cpu", block_tokens=block_tokens)
    with pytest.raises(ValueError, match="FP4 slots only"):  # a W2 tier passed as the FP4 one
        _tier_with_recorders(log)(torch.zeros(1, 1024, dtype=torch.bfloat16), 2, w2, w2, 0, ws)
    assert log == []


# ---- numpy model of fp4_fragments.cuh / fp4_moe.cu ---------------------------------------------------------

def prmt(a: int, b: int, sel: int) -> int:
    """__byte_perm(a, b, sel), selectors without the sign-replicate bit (asserted)."""
    assert all(not (sel >> (4 * n + 3)) & 1 for n in range(4))
    both = (b << 32) | a
    return sum(((both >> (8 * ((sel >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def selectors(w: int) -> tuple[int, int]:
    """f4_selectors."""
    nonzero = (w | (w >> 2)) & 0x11111111
    return w & 0x77777777, ((w >> 1) & 0x77777777) | nonzero


def pair_bits(sel: tuple[int, int], i: int) -> int:
    """f4_pair_bits: byte i (nibbles 2i, 2i+1) as unscaled bf16x2."""
    shift = (i >> 1) * 16
    lo = prmt(*LO_TABLE, (sel[0] >> shift) & 0xFFFF)
    hi = prmt(*HI_TABLE, (sel[1] >> shift) & 0xFFFF)
    return prmt(lo, hi, 0x7362 if i & 1 else 0x5140)


def scale_pair(q: tuple[int, int], i: int) -> int:
    """f4_scale_pair(f4_biased(q), i): q = the tile's two scale words as loaded."""
    biased = [(v + 0x02020202) & M32 for v in q]
    return (prmt(biased[i >> 1], 0, 0x4342 if i & 1 else 0x4140) << 7) & M32


def bf16_value(bits: int) -> float:
    return float(np.array([(bits & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0])


def bf16_halves(p: int) -> tuple[float, float]:
    return bf16_value(p), bf16_value(p >> 16)


def mul_bf16x2(a: int, b: int) -> int:
    """mul.rn.bf16x2 where every product is exact in bf16 (asserted: the decode's claim)."""
    out = 0
    for h in range(2):
        prod = bf16_value(a >> (16 * h)) * bf16_value(b >> (16 * h))
        as32 = int(np.array([prod], dtype=np.float32).view(np.uint32)[0])
        assert float(np.float32(prod)) == prod and as32 & 0xFFFF == 0 and (prod == 0 or abs(prod) >= 2.0 ** -126)
        out |= (as32 >> 16) << (16 * h)
    return out


def decode(w: int, i: int, q: tuple[int, int]) -> tuple[float, float]:
    """What a lane's A register holds for byte i of word w with the tile's scale words q (times the 2^2 bias)."""
    return bf16_halves(mul_bf16x2(pair_bits(selectors(w), i), scale_pair(q, i)))


def build_pairs(a_bits: list[int]) -> list[int]:
    """f4_build_pairs: xp[8q + 2m + h] = a[k0 + 16h + m] | a[k0 + 32 + 16h + m] << 16, k0 = 64 (q >> 2) + 4 (q & 3)."""
    xp = [0] * (len(a_bits) // 2)
    for q in range(len(a_bits) // 16):
        k0 = 64 * (q >> 2) + 4 * (q & 3)
        for m in range(4):
            for h in range(2):
                xp[8 * q + 2 * m + h] = a_bits[k0 + 16 * h + m] | (a_bits[k0 + 32 + 16 * h + m] << 16)
    return xp


def warp_mma(lo, hi, lo_scales, hi_scales, xp, tiles) -> tuple[np.ndarray, np.ndarray]:
    """One warp's K loop (f4_tile_mma): A rows 0..7 = `lo` (8 rows of words), 8..15 = `hi`; returns rows g (lane
    (g, 0), d0) and g + 8 (d2) after the final * 0.25. Checks that all D columns are equal."""
    acc = np.zeros((2, 16, 8))
    for t in range(tiles):
        for m in range(4):
            for i in range(4):
                a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
                for lane in range(32):
                    g, c = lane >> 2, lane & 3
                    ql, qh = lo_scales[g][2 * t: 2 * t + 2], hi_scales[g][2 * t: 2 * t + 2]
                    u0, u1 = 32 * t + 4 * c + m, 32 * t + 16 + 4 * c + m
                    regs = (decode(lo[g][u0], i, ql), decode(hi[g][u0], i, qh),
                            decode(lo[g][u1], i, ql), decode(hi[g][u1], i, qh))
                    for reg, (row, col) in zip(regs, ((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
                        a_mat[row, col: col + 2] = reg  # PTX ISA: A fragment of m16n8k16
                    b = xp[t * 128 + i * 32 + 8 * c + 2 * m: t * 128 + i * 32 + 8 * c + 2 * m + 2]
                    for reg in range(2):
                        b_mat[2 * c + 8 * reg: 2 * c + 8 * reg + 2, g] = bf16_halves(b[reg])
                acc[i & 1] += a_mat @ b_mat
    total = acc.sum(0) * 0.25
    assert np.all(total == total[:, :1])  # B is the same in every column
    return total[:8, 0], total[8:, 0]


def model_gate_up(slot: torch.Tensor, layout, x: torch.Tensor, limit: float | None = None) -> np.ndarray:
    """float64 [I]: what fp4_gate_up_mma writes (before bf16 rounding) for one pair, warp by warp."""
    words, scales = slot_rows(slot, layout, "w13")
    xp, inter, out = build_pairs(bf16_bits(x)), layout.inter, np.zeros(layout.inter)
    for n0 in range(0, inter, 8):  # one warp: gate rows n0.., up rows n0 + I..
        gate, up = warp_mma(words[n0: n0 + 8], words[inter + n0: inter + n0 + 8], scales[n0: n0 + 8],
                            scales[inter + n0: inter + n0 + 8], xp, layout.w13.words_per_row // 32)
        if limit is not None:
            gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
        out[n0: n0 + 8] = gate / (1 + np.exp(-gate)) * up
    return out


def model_down(slot: torch.Tensor, layout, act: torch.Tensor) -> np.ndarray:
    """float64 [H]: what fp4_down_mma writes for one pair (a warp: rows n0..n0+15 = one mma A tile)."""
    words, scales = slot_rows(slot, layout, "w2")
    xp, out = build_pairs(bf16_bits(act)), np.zeros(layout.hidden)
    for n0 in range(0, layout.hidden, 16):
        out[n0: n0 + 8], out[n0 + 8: n0 + 16] = warp_mma(words[n0: n0 + 8], words[n0 + 8: n0 + 16], scales[n0: n0 + 8],
                                                          scales[n0 + 8: n0 + 16], xp, layout.w2.words_per_row // 32)
    return out


def _every_code_slot(layout) -> torch.Tensor:
    """One FP4 slot whose w13 rows hold every e2m1 code in every nibble slot (word u, nibble j: (u + 3j + r) % 16)
    and whose scale byte of row r, block j is (8r + j) % 241: every byte 0..240 in every nibble slot."""
    m = layout.w13
    slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    rows = torch.arange(m.n).view(-1, 1, 1)
    nib = (torch.arange(m.words_per_row).view(1, -1, 1) + 3 * torch.arange(8).view(1, 1, -1) + rows) % 16
    words = (nib << (4 * torch.arange(8))).sum(-1)  # [N, words]
    slot[: m.word_bytes] = (words - ((words >> 31) << 32)).to(torch.int32).view(torch.uint8).reshape(-1)
    blocks = (8 * torch.arange(m.n).view(-1, 1) + torch.arange(m.blocks_per_row).view(1, -1)) % (MAX_SCALE_BYTE + 1)
    slot[layout.w13_scales_offset: layout.w13_scales_offset + m.scale_bytes] = blocks.to(torch.uint8).reshape(-1)
    return slot


def test_model_decode_is_exact_for_every_code_slot_and_scale_byte():
    layout = fp4_slot_layout(256, 256)  # w13: 512 rows x one 32-word tile
    slot = _every_code_slot(layout)
    ref = unpack_matrix_ref(slot, layout, "w13")  # [512, 256] float32
    words, scales = slot_rows(slot, layout, "w13")
    seen = set()
    for r in range(layout.w13.n):
        for u in range(32):
            for i in range(4):
                got = decode(words[r][u], i, tuple(scales[r][0:2]))
                for h in range(2):
                    j = 2 * i + h
                    assert got[h] == 4.0 * float(ref[r, 32 * j + u]), (r, u, j)  # exact, with the 2^2 bias
                    seen.add(((words[r][u] >> (4 * j)) & 15, j, (scales[r][j // 4] >> (8 * (j % 4))) & 0xFF))
    assert seen == {(code, j, byte) for code in range(16) for j in range(8) for byte in range(MAX_SCALE_BYTE + 1)}


def _random_fp4_slot(layout, gen, lo=116, hi=128) -> torch.Tensor:
    return random_slots(torch.empty(1, layout.slot_bytes, dtype=torch.uint8), layout, gen, lo, hi)[0]


@pytest.mark.parametrize("limit", [None, 0.75])
def test_model_of_the_gate_up_kernel_matches_the_reference(limit):
    gen = torch.Generator().manual_seed(11)
    layout = fp4_slot_layout(512, 32)  # two K tiles, 4 warps of 8 rows
    slot = _random_fp4_slot(layout, gen)
    x = torch.randn(512, generator=gen).to(torch.bfloat16)
    gate, up = (unpack_matrix_ref(slot, layout, "w13").double() @ x.double()).chunk(2)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    ref = (torch.nn.functional.silu(gate) * up).numpy()
    got = model_gate_up(slot, layout, x, limit)
    assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()


def test_model_of_the_down_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(12)
    layout = fp4_slot_layout(64, 512)  # four 16-row groups, two K tiles
    slot = _random_fp4_slot(layout, gen, 0, 241)  # every scale byte, extremes included
    act = torch.randn(512, generator=gen).to(torch.bfloat16)
    ref = (unpack_matrix_ref(slot, layout, "w2").double() @ act.double()).numpy()
    got = model_down(slot, layout, act)
    assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()


# ---- the kernels on a GPU ---------------------------------------------------------------------------------

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 512, 8, 3  # W2 stages need multiples of 512; FP4 K tiles: 4 (gate_up), 2 (down)
FP4_EXPERTS = {1: 0, 2: 1, 4: 2}  # expert -> FP4 slot; expert 2 is in both tiers (FP4 wins)
MISSING = 6


@pytest.fixture(scope="module")
def case():
    gen = torch.Generator().manual_seed(13)
    w2 = w2_pool(HIDDEN, INTER, EXPERTS, gen, (112, 124), missing=MISSING)
    f4 = fp4_tier(HIDDEN, INTER, len(FP4_EXPERTS), 1, EXPERTS, "cpu")
    for expert, slot in FP4_EXPERTS.items():
        f4.slots[slot] = _random_fp4_slot(f4.layout, gen)
        f4.table[0, expert] = slot
    return dict(w2=to_cuda(w2), f4=to_cuda(f4), gen=gen, gate_up={a: Fp4GateUpCuda(ahead=a) for a in (1, 2, 3)},
                down={a: Fp4DownCuda(ahead=a) for a in (1, 2, 3)})


@pytest.fixture(scope="module")
def tier():
    """TierMoeCuda (builds the W2 kernels too: only the whole-op tests depend on them)."""
    from tierstore.kernels.cuda.tier_moe import TierMoeCuda

    return TierMoeCuda()


def _ids(case, tokens):
    """Random distinct experts per token; the first rows route to FP4, both-tier, W2 and missing experts."""
    rows = [torch.randperm(EXPERTS, generator=case["gen"])[:TOP_K].tolist() for _ in range(tokens)]
    fixed = [[1, 0, MISSING], [2, 5, 3]][:tokens] if tokens > 1 else [[4, MISSING, 0]]
    return torch.tensor(fixed + rows[len(fixed):], dtype=torch.int32).cuda()


def _routed(case, tokens):
    ids = _ids(case, tokens)
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, case["w2"], case["f4"], 0, MissLog.allocate(8, "cuda"), ws)
    return ids, ws


def _fp4_rows(ids):
    return torch.tensor([e in FP4_EXPERTS for e in ids.reshape(-1).tolist()], device="cuda")


TRITON_MARGIN = 2e-3  # CUDA's relative error may exceed Triton's (both vs the float32 reference) by at most this


def _no_less_accurate_than_triton(got, tri, ref, limit):
    """Triton is a second implementation, not the ground truth: CUDA's error vs the reference must not exceed
    Triton's error vs the same reference by more than TRITON_MARGIN (the caller already holds CUDA's within 1e-2).
    The direct CUDA-vs-Triton distance must stay within 1e-2 only without the SwiGLU clamp, where both errors sit
    far below it (H200 at 998c5b7, benchmarks/cuda_fp4 checks: CUDA 0.0016-0.0017, Triton 0.004-0.006 for gate_up,
    whole op and mixed layer). With the clamp 0.75 that distance was 0.017-0.018 on the H200 with CUDA's own error
    within 1e-2 (the log does not say how the two errors split): it is reported as a warning with both errors, not
    asserted."""
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    err, tri_err, dist = rel(got, ref), rel(tri, ref), rel(got, tri)
    assert not tri.isnan().any() and err <= tri_err + TRITON_MARGIN, (err, tri_err)
    if limit is None:
        assert dist <= 1e-2, (err, tri_err)
    elif dist > 1e-2:
        warnings.warn(f"swiglu_limit={limit}: CUDA vs Triton {dist:.4g} (CUDA vs reference {err:.4g}, Triton vs "
                      f"reference {tri_err:.4g})", stacklevel=2)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens,limit", [(1, None), (2, None), (8, None), (32, None), (8, 0.75)])
def test_fp4_gate_up_matches_reference_and_leaves_other_pairs(case, tokens, limit):
    ids, ws = _routed(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    outs = launched_twice(case["gate_up"], ws.act, float("nan"),
                          lambda kernel, out: kernel(x, TOP_K, case["f4"], 0, ws, out=out, swiglu_limit=limit))
    torch.cuda.synchronize()
    ref = fp4_gate_up_ref(x, ids, case["f4"], 0, swiglu_limit=limit)
    rows = _fp4_rows(ids)
    first = outs[2][0]
    assert rows.any() and first[~rows].isnan().all() and not first[rows].isnan().any()
    assert float((first[rows].float() - ref[rows]).norm() / ref[rows].norm()) <= 1e-2
    assert all(same_bytes(o, first) for pair in outs.values() for o in pair)  # repeats, prefetch depth
    ws.act.fill_(float("nan"))
    moe_gate_up(x, TOP_K, case["w2"], case["f4"], 0, ws, limit)
    _no_less_accurate_than_triton(first[rows], ws.act[rows], ref[rows], limit)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_fp4_down_matches_reference_and_leaves_other_pairs(case, tokens):
    ids, ws = _routed(case, tokens)
    ws.act.copy_(torch.randn(ws.act.shape, generator=case["gen"]).to(torch.bfloat16))
    outs = launched_twice(case["down"], ws.y, -7.0, lambda kernel, out: kernel(case["f4"], 0, ws, out=out))
    torch.cuda.synchronize()
    ref = fp4_down_ref(ws.act, ids, case["f4"], 0)
    rows = _fp4_rows(ids)
    first = outs[2][0]
    assert (first[~rows] == -7.0).all() and not first[rows].isnan().any()
    assert float((first[rows] - ref[rows]).norm() / ref[rows].norm()) <= 1e-5  # fp32 sums of exact products
    assert all(same_bytes(o, first) for pair in outs.values() for o in pair)


@pytest.mark.gpu
@needs_nvcc
def test_fp4_down_decodes_every_scale_byte_exactly_on_the_device(case):
    """One-hot act rows: y = one weight column, exact (no rounding), for an FP4 down matrix whose scale bytes run
    over 0..240 (bytes 0 and 1 give bf16 / fp32 subnormal weights without the 2^2 bias)."""
    layout = case["f4"].layout
    m = layout.w2
    slots = case["f4"].slots.clone()
    blocks = (7 * torch.arange(m.n).view(-1, 1) + torch.arange(m.blocks_per_row).view(1, -1)) % (MAX_SCALE_BYTE + 1)
    slots[:, layout.w2_scales_offset: layout.w2_scales_offset + m.scale_bytes] = blocks.to(torch.uint8).reshape(-1).cuda()
    f4 = type(case["f4"])(slots, case["f4"].table, layout)
    ids, ws = _routed(case, 32)
    ks = torch.randint(0, INTER, (ids.numel(),), generator=case["gen"])
    ws.act.zero_()
    ws.act[torch.arange(ids.numel()).cuda(), ks.cuda()] = 1.0
    out = case["down"][2](f4, 0, ws, out=torch.full_like(ws.y, float("nan")))
    torch.cuda.synchronize()
    for p, e in enumerate(ids.reshape(-1).tolist()):
        if e in FP4_EXPERTS:
            col = unpack_matrix_ref(slots[FP4_EXPERTS[e]], layout, "w2")[:, int(ks[p])]
            assert torch.equal(out[p], col), p


@pytest.fixture(scope="module")
def multi():
    """The multi-token FP4 kernels: gate_up in the default build and four others, down in three builds."""
    return dict(gate_up={"w8s4": fp4_multi.Fp4GateUpMultiCuda(), "w8s8": fp4_multi.Fp4GateUpMultiCuda(stage_cols=8),
                         "w4s8max": fp4_multi.Fp4GateUpMultiCuda(warps=4, stage_cols=8, carveout="max"),
                         "a1": fp4_multi.Fp4GateUpMultiCuda(ahead=1), "early": fp4_multi.Fp4GateUpMultiCuda(early=True),
                         "pdl": fp4_multi.Fp4GateUpMultiCuda(pdl=True)},
                down={2: fp4_multi.Fp4DownMultiCuda(), 1: fp4_multi.Fp4DownMultiCuda(ahead=1),
                      "early": fp4_multi.Fp4DownMultiCuda(early=True),
                      "pdl": fp4_multi.Fp4DownMultiCuda(ahead=1, pdl=True)})


def _routed_bt(case, ids, block_tokens):
    ws = MoeWorkspace.allocate(ids.shape[0], TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda",
                               block_tokens=block_tokens)
    moe_route(ids, case["w2"], case["f4"], 0, MissLog.allocate(8, "cuda"), ws)
    return ws


MULTI_TOKENS = [(1, None), (2, None), (8, None), (32, None), (64, None), (32, 0.75)]


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens,limit", MULTI_TOKENS)
def test_fp4_multi_gate_up_equals_the_single_token_kernel(case, multi, tokens, limit):
    """Each pair's act bytes equal the single-token kernel's (same mma column arithmetic) in every build; at 32 and
    64 tokens an FP4 expert's 16-pair route blocks run several passes and (64) several route blocks."""
    ids, ws1 = _routed(case, tokens)
    ws = _routed_bt(case, ids, 16)
    if tokens >= 32:
        assert int(ws.block_fill[: int(ws.num_blocks[0])].max()) > 8
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    outs = launched_twice(multi["gate_up"], ws.act, float("nan"),
                          lambda kernel, out: kernel(x, TOP_K, case["f4"], 0, ws, out=out, swiglu_limit=limit))
    single = case["gate_up"][2](x, TOP_K, case["f4"], 0, ws1, out=torch.full_like(ws1.act, float("nan")),
                                swiglu_limit=limit)
    torch.cuda.synchronize()
    rows = _fp4_rows(ids)
    first = outs["w8s4"][0]
    assert rows.any() and first[~rows].isnan().all() and not first[rows].isnan().any()
    ref = fp4_gate_up_ref(x, ids, case["f4"], 0, swiglu_limit=limit)
    assert float((first[rows].float() - ref[rows]).norm() / ref[rows].norm()) <= 1e-2
    assert same_bytes(first, single)
    assert all(same_bytes(o, first) for pair in outs.values() for o in pair)  # repeats, builds


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 2, 8, 32, 64])
def test_fp4_multi_down_equals_the_single_token_kernel(case, multi, tokens):
    ids, ws1 = _routed(case, tokens)
    ws = _routed_bt(case, ids, 16)
    ws.act.copy_(torch.randn(ws.act.shape, generator=case["gen"]).to(torch.bfloat16))
    ws1.act.copy_(ws.act)
    outs = launched_twice(multi["down"], ws.y, -7.0, lambda kernel, out: kernel(case["f4"], 0, ws, out=out))
    single = case["down"][2](case["f4"], 0, ws1, out=torch.full_like(ws1.y, -7.0))
    torch.cuda.synchronize()
    rows = _fp4_rows(ids)
    first = outs[2][0]
    assert (first[~rows] == -7.0).all() and not first[rows].isnan().any()
    ref = fp4_down_ref(ws.act, ids, case["f4"], 0)
    assert float((first[rows] - ref[rows]).norm() / ref[rows].norm()) <= 1e-5
    assert same_bytes(first, single)
    assert all(same_bytes(o, first) for pair in outs.values() for o in pair)


def _whole(case, ids, x, weights, cuda_w2, limit=None, out=None):
    return run_whole(x, ids, weights, case["w2"], case["f4"], cuda_w2, INTER, EXPERTS, 8, limit=limit, out=out)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens,limit", [(1, None), (2, None), (8, None), (32, None), (8, 0.75)])
def test_tier_moe_matches_reference_with_mixed_residency(case, tier, tokens, limit):
    ids = _ids(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    flat = ids.reshape(-1).tolist()
    assert any(e in FP4_EXPERTS for e in flat) and MISSING in flat and any(e not in FP4_EXPERTS and e != MISSING
                                                                           for e in flat)
    ref, missing_pairs, missing = moe_mm_ref(x, ids, weights, case["w2"], case["f4"], 0, swiglu_limit=limit,
                                             act_dtype=torch.bfloat16)
    out, counts, entries = _whole(case, ids, x, weights, tier, limit)
    assert not out.isnan().any()
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    assert counts == [missing_pairs, len(missing)] and [tuple(e) for e in entries[: len(missing)]] == missing
    again, _, _ = _whole(case, ids, x, weights, tier, limit)
    assert same_bytes(out, again)
    tri, tri_counts, tri_entries = _whole(case, ids, x, weights, None, limit)
    assert tri_counts == counts and tri_entries == entries
    _no_less_accurate_than_triton(out, tri, ref, limit)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens,limit", [(2, None), (8, None), (32, None), (64, None), (32, 0.75)])
def test_tier_moe_with_expert_blocks_equals_one_pair_per_block(case, tier, tokens, limit):
    """block_tokens 16 (the multi-token kernels of both tiers) gives the bytes of block_tokens 1 (the single-token
    ones) and the same misses."""
    ids = _ids(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    single, counts, entries = _whole(case, ids, x, weights, tier, limit)
    out, counts16, entries16 = run_whole(x, ids, weights, case["w2"], case["f4"], tier, INTER, EXPERTS, 8, 16,
                                         limit=limit)
    assert not out.isnan().any() and counts16 == counts and entries16 == entries
    ref, _, _ = moe_mm_ref(x, ids, weights, case["w2"], case["f4"], 0, swiglu_limit=limit, act_dtype=torch.bfloat16)
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    assert same_bytes(out, single)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [8, 32, 64])
def test_tier_moe_with_programmatic_launch_gives_the_same_bytes(case, tier, tokens):
    """FP4_PDL on both multi-token FP4 stages (the down launched as the gate_up's programmatic dependent): the bytes
    of the default launches, eager and replayed in a CUDA graph."""
    from tierstore.kernels.cuda.tier_moe import TierMoeCuda

    pdl = TierMoeCuda(w2=tier.w2, fp4_gate_multi=dict(pdl=True), fp4_down_multi=dict(ahead=1, pdl=True))
    ids = _ids(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    expected, counts, _ = run_whole(x, ids, weights, case["w2"], case["f4"], tier, INTER, EXPERTS, 8, 16)
    got, got_counts, _ = run_whole(x, ids, weights, case["w2"], case["f4"], pdl, INTER, EXPERTS, 8, 16)
    assert same_bytes(got, expected) and got_counts == counts
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=16)
    misses = MissLog.allocate(8, "cuda")
    out = torch.full_like(x, float("nan"))
    replayed_once(lambda: moe_mm(x, ids, weights, case["w2"], case["f4"], 0, misses, ws, out=out, cuda_w2=pdl),
                  misses, out)
    assert same_bytes(out, expected)


@pytest.mark.gpu
@needs_nvcc
def test_tier_moe_with_expert_blocks_replays_in_a_cuda_graph(case, tier):
    tokens = 32
    ids = _ids(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    eager, counts, _ = run_whole(x, ids, weights, case["w2"], case["f4"], tier, INTER, EXPERTS, 8, 16)
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=16)
    misses = MissLog.allocate(8, "cuda")
    out = torch.full_like(x, float("nan"))
    call = lambda: moe_mm(x, ids, weights, case["w2"], case["f4"], 0, misses, ws, out=out, cuda_w2=tier)
    replayed_once(call, misses, out)
    assert same_bytes(out, eager) and misses.counts.tolist() == counts


@pytest.mark.gpu
@needs_nvcc
def test_tier_moe_replays_in_a_cuda_graph(case, tier):
    tokens = 8
    ids = _ids(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    eager, counts, _ = _whole(case, ids, x, weights, tier)
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=1)
    misses = MissLog.allocate(8, "cuda")
    out = torch.full_like(x, float("nan"))
    call = lambda: moe_mm(x, ids, weights, case["w2"], case["f4"], 0, misses, ws, out=out, cuda_w2=tier)
    replayed_once(call, misses, out)  # Triton compiles outside capture
    assert same_bytes(out, eager) and misses.counts.tolist() == counts  # one replay counts the misses once


# ---- benchmarks/cuda_fp4.py bookkeeping (no GPU: Triton interpreter, stand-ins for the CUDA kernels) --------

def _fp4_blocks(ws, f4, layer):
    """(pair, FP4 slot) of each routed pair whose expert is FP4-resident."""
    for expert, pair in placed(ws):
        slot = int(f4.table[layer, expert])
        if slot >= 0:
            yield pair, f4.slots[slot]


class _GateUpStandIn:
    """Stands in for Fp4GateUpCuda in the CPU run of the benchmark (plain torch from the route output)."""

    def __call__(self, x, top_k, f4, layer, ws, out=None, swiglu_limit=None):
        out = ws.act if out is None else out
        for pair, slot in _fp4_blocks(ws, f4, layer):
            out[pair] = gate_up_ref(slot, f4.layout, x[pair // top_k]).to(out.dtype)
        return out


class _DownStandIn:
    """Stands in for Fp4DownCuda in the CPU run of the benchmark."""

    def __call__(self, f4, layer, ws, out=None):
        out = ws.y if out is None else out
        for pair, slot in _fp4_blocks(ws, f4, layer):
            out[pair] = down_ref(slot, f4.layout, ws.act[pair])
        return out


class _TierStandIn:
    """Stands in for TierMoeCuda: W2 pairs in plain torch, then the FP4 stand-ins."""

    def __call__(self, hidden, top_k, w2, f4, layer, ws, swiglu_limit=None):
        for expert, pair in placed(ws):
            if int(f4.table[layer, expert]) < 0:
                slot = w2.slots[int(w2.table[layer, expert])]
                ws.act[pair] = gate_up_ref(slot, w2.layout, hidden[pair // top_k]).to(ws.act.dtype)
                ws.y[pair] = down_ref(slot, w2.layout, ws.act[pair])
        _GateUpStandIn()(hidden, top_k, f4, layer, ws)
        _DownStandIn()(f4, layer, ws)


def _bench_module():
    return bench_module("cuda_fp4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter (set without CUDA)")
def test_bench_runs_end_to_end_on_cpu_with_stand_in_kernels(monkeypatch):
    import argparse

    bench = _bench_module()
    cw2 = bench._load("cuda_w2")
    kb = cw2._bench_kernels()

    def build(name, geo):
        stage, ahead = bench.VARIANTS[name]
        stages = bench.Fp4Only(_GateUpStandIn(), _DownStandIn())
        built = {"gate_up": stages.gate_up, "down": stages.down, "whole": stages, "mixed": _TierStandIn()}[stage]
        return built, dict(stage=stage, ahead=ahead)

    bench_on_cpu(monkeypatch, bench, kb, build, (8, 2, 256, 256))
    result, emitted = {}, []
    bench.run(kb, cw2, argparse.Namespace(preset="tiny", tokens="2", reps=1, variants=None), result,
              lambda r: emitted.append(r["status"]))
    assert result["status"] == "complete" and not result["errors"], result["errors"]
    assert [(c["tokens"], c["stage"]) for c in result["checks"]] == [(2, s) for s in ("gate_up", "down", "whole",
                                                                                     "mixed")]
    for check in result["checks"]:
        for name in check["variants"]:
            assert cw2._invalid([check], name) == [], (check["stage"], name, check["variants"][name])
    timed = {(r["tokens"], r["variant"]) for r in result["cases"] if r.get("us") is not None}
    assert {(2, name) for name in bench.VARIANTS} <= timed and (2, "bf16_grouped_mm") in timed
    whole = [r for r in result["cases"] if r["variant"] == "cuda_fp4_whole"]
    assert whole[0]["triton_over_this"] > 0 and whole[0]["bf16_over_this"] == pytest.approx(5.0)
    mixed = [r for r in result["cases"] if r["variant"] == "cuda_tier_mixed"]
    assert mixed[0]["triton_over_this"] == pytest.approx(1.0)  # against triton_mixed's 10 us (both stand-in times)
    per_expert = lambda lay: lay.w13.word_bytes + lay.w13.scale_bytes + lay.w2.word_bytes + lay.w2.scale_bytes
    from tierstore.kernels.layout import w2_slot_layout
    mixed_per_expert = mixed[0]["bytes"] / mixed[0]["unique_experts"]
    assert per_expert(w2_slot_layout(256, 256)) < mixed_per_expert < per_expert(fp4_slot_layout(256, 256))
