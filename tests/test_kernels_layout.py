"""Slot layout: packing is lossless (decoding the packed slot equals the format's own dequantization)."""

import pytest
import torch

from tierstore.kernels import layout as L


def _matrix(n, k, levels, gen):
    values = torch.randint(0, levels, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (n, k // 32), dtype=torch.uint8, generator=gen)
    return values, scales


def test_w2_bit_slots_tile_the_word():
    bits = [L.w2_mag_bit(j) for j in range(16)] + [L.w2_sign_bit(j) for j in range(16)]
    assert sorted(bits) == list(range(32))


@pytest.mark.parametrize("hidden,inter", [(512, 64), (256, 96), (1024, 1408 // 4)])
@pytest.mark.parametrize("tier", ["w2", "fp4"])
def test_packed_slot_decodes_to_the_format_values(hidden, inter, tier):
    gen = torch.Generator().manual_seed(hidden * 7 + inter)
    layout = L.w2_slot_layout(hidden, inter) if tier == "w2" else L.fp4_slot_layout(hidden, inter)
    levels, dequant = (4, L.dequant_w2_ref) if tier == "w2" else (16, L.dequant_fp4_ref)
    w13 = _matrix(2 * inter, hidden, levels, gen)
    w2 = _matrix(hidden, inter, levels, gen)
    slot = L.pack_slot(layout, *w13, *w2)
    assert slot.numel() == layout.slot_bytes
    assert torch.equal(L.unpack_matrix_ref(slot, layout, "w13"), dequant(*w13))
    assert torch.equal(L.unpack_matrix_ref(slot, layout, "w2"), dequant(*w2))


def test_w2_values_match_the_codebook():
    codes = torch.tensor([[0, 1, 2, 3] * 8], dtype=torch.uint8)
    scales = torch.tensor([[127]], dtype=torch.uint8)
    assert L.dequant_w2_ref(codes, scales)[0, :4].tolist() == [-4.0, -1.0, 1.0, 4.0]


def test_words_per_slot_and_padding():
    assert L.words_per_slot(7168, 16) == 32 and L.padded_k(7168, 16) == 7168
    assert L.words_per_slot(768, 16) == 16 and L.padded_k(768, 16) == 768
    assert L.padded_k(1408, 16) == 1536 and L.padded_k(1408, 8) == 1408


@pytest.mark.parametrize("bad", ["level", "scale", "shape"])
def test_bad_inputs_are_named(bad):
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    scales = torch.full((4, 2), 127, dtype=torch.uint8)
    if bad == "level":
        codes[0, 0] = 4
    elif bad == "scale":
        scales[0, 0] = 241
    else:
        scales = scales[:, :1]
    with pytest.raises(ValueError, match="W2 codes"):
        L.pack_w2_words(codes, scales)


def test_abi_tag_is_a_stable_string():
    assert L.ABI_TAG.startswith("tierstore-kernels/slot-v1")
