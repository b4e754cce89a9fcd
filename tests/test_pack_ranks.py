"""Tensor-parallel rank packs: each rank's rows are exactly the slices of the single-GPU
requantization, the ranks together are the full expert, ranks never stand in for each other, and
splits that would cut a scale block are clear errors."""

import shutil

import pytest
import torch
from pack_helpers import read_row

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.cli import main
from tierstore.errors import PackFormatError, TierstoreError
from tierstore.formats import W2Tensor, quantize_w2
from tierstore.io.pack import Pack, PackPaths
from tierstore.io.pack_build import RankShard, build_packs, pack_specs, requantize
from tierstore.io.row_codec import decode_row
from tierstore.slot_codec import KERNEL_SLOT_CODEC

INTER = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt"), num_layers=2, num_experts=3, top_k=2,
                                      hidden=64, expert_inter=INTER, seed=4)


@pytest.fixture(scope="module")
def packs(checkpoint, tmp_path_factory):
    """Portable base + fp4 packs of world 1, 2 and 4 in one directory."""
    out = tmp_path_factory.mktemp("packs")
    for world in (1, 2, 4):
        for rank in range(world):
            build_packs(checkpoint, out, tags=("base", "fp4"), device="cpu", progress=False, rank=rank, world=world)
    return out


def decoded(checkpoint, directory, tag, layer, expert, rank, world) -> dict[str, torch.Tensor]:
    with open_checkpoint(checkpoint) as ckpt:
        spec = pack_specs(ckpt, ("base", "fp4"), "auto", rank=rank, world=world)[tag]
    return decode_row(read_row(directory, spec, layer, expert), spec.segments)


def expected_share(w13: W2Tensor, w2: W2Tensor, rank: int, world: int) -> tuple[W2Tensor, W2Tensor]:
    """The slices of the full-matrix requantization that rank `rank` of `world` must hold."""
    size = INTER // world
    gate = torch.arange(rank * size, (rank + 1) * size)
    rows = torch.cat((gate, INTER + gate))
    cols = slice(rank * size, (rank + 1) * size)
    blocks = slice(rank * size // 32, (rank + 1) * size // 32)
    return (W2Tensor(w13.nibbles()[rows], w13.scale_bytes()[rows], w13.zero_mode),
            W2Tensor(w2.nibbles()[:, cols], w2.scale_bytes()[:, blocks], w2.zero_mode))


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_holds_exactly_the_slices_of_the_single_gpu_requantization(checkpoint, packs, world):
    with open_checkpoint(checkpoint) as ckpt:
        for layer, expert in ((0, 0), (1, 2)):
            weights = ckpt.layer(layer).experts[expert]
            w13, w2 = quantize_w2(weights.w13.dequantize()), quantize_w2(weights.w2.dequantize())
            for rank in range(world):
                base = decoded(checkpoint, packs, "base", layer, expert, rank, world)
                fp4 = decoded(checkpoint, packs, "fp4", layer, expert, rank, world)
                for name, tensor in zip(("w13", "w2"), expected_share(w13, w2, rank, world)):
                    assert torch.equal(base[f"{name}.codes"], tensor.packed_codes())
                    assert torch.equal(fp4[f"{name}.nibbles"], tensor.packed_nibbles())
                    assert torch.equal(base[f"{name}.scales"], tensor.scale_bytes())
                    assert torch.equal(fp4[f"{name}.scales"], tensor.scale_bytes())


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_together_are_the_full_expert(checkpoint, packs, world):
    for tag, payload in (("base", "codes"), ("fp4", "nibbles")):
        full = decoded(checkpoint, packs, tag, 1, 1, 0, 1)
        shares = [decoded(checkpoint, packs, tag, 1, 1, rank, world) for rank in range(world)]
        for part in (payload, "scales"):
            gates = [share[f"w13.{part}"][:INTER // world] for share in shares]
            ups = [share[f"w13.{part}"][INTER // world:] for share in shares]
            assert torch.equal(torch.cat(gates + ups), full[f"w13.{part}"])
            assert torch.equal(torch.cat([share[f"w2.{part}"] for share in shares], dim=1), full[f"w2.{part}"])


def test_kernel_slot_rank_rows_encode_the_slices(checkpoint, tmp_path):
    build_packs(checkpoint, tmp_path, tags=("base",), device="cpu", progress=False, codec=KERNEL_SLOT_CODEC,
                rank=1, world=2)
    with open_checkpoint(checkpoint) as ckpt:
        spec = pack_specs(ckpt, ("base",), "auto", codec=KERNEL_SLOT_CODEC, rank=1, world=2)["base"]
        weights = ckpt.layer(0).experts[1]
        w13, w2 = quantize_w2(weights.w13.dequantize()), quantize_w2(weights.w2.dequantize())
    share = expected_share(w13, w2, 1, 2)
    assert torch.equal(read_row(tmp_path, spec, 0, 1), KERNEL_SLOT_CODEC.encode("base", spec.segments, *share))


def test_auto_zero_mode_is_decided_on_the_full_matrix(tmp_path):
    class Matrix:  # a source matrix whose exact zeros are one-signed overall but not in rank 1's share
        def dequantize(self):
            weight = torch.linspace(-3, 3, 64 * INTER, dtype=torch.float64).reshape(64, INTER)
            weight[:, :INTER // 2] = 0.0
            weight[:8, INTER // 2:INTER // 2 + 16] = -0.0
            weight[8:16, INTER // 2:INTER // 2 + 16] = 0.0
            return weight

    full = quantize_w2(Matrix().dequantize(), zero_mode="auto")
    share_alone = quantize_w2(Matrix().dequantize()[:, INTER // 2:], zero_mode="auto")
    assert full.zero_mode == "alt" and share_alone.zero_mode == "sign"
    shard = RankShard(INTER, 1, 2)
    share = requantize(Matrix(), "bf16", "auto", "cpu", shard.w2_columns, shard.w2)
    assert share.zero_mode == "alt"
    assert torch.equal(share.nibbles(), full.nibbles()[:, INTER // 2:])
    assert torch.equal(share.scale_bytes(), full.scale_bytes()[:, INTER // 64:])


def test_mxfp4_rank_packs_slice_the_verbatim_nibbles(tmp_path):
    ckpt_dir = write_synthetic_checkpoint(tmp_path / "mx", num_layers=1, num_experts=2, top_k=1, hidden=64,
                                          expert_inter=64, fmt="mxfp4", seed=1)
    build_packs(ckpt_dir, tmp_path / "packs", tags=("fp4",), device="cpu", progress=False, rank=1, world=2)
    with open_checkpoint(ckpt_dir) as ckpt:
        spec = pack_specs(ckpt, ("fp4",), "auto", rank=1, world=2)["fp4"]
        packed, scales = ckpt.layer(0).experts[1].w2.mxfp4_parts()
    row = decode_row(read_row(tmp_path / "packs", spec, 0, 1), spec.segments)
    assert torch.equal(row["w2.nibbles"], packed[:, 16:32])
    assert torch.equal(row["w2.scales"], scales.view(torch.uint8)[:, 1:2])


def test_ranks_are_different_files_and_never_served_for_each_other(checkpoint, packs, tmp_path):
    with open_checkpoint(checkpoint) as ckpt:
        specs = [pack_specs(ckpt, ("base",), "auto", rank=rank, world=world)["base"]
                 for world in (1, 2, 4) for rank in range(world)]
    stems = [spec.file_stem() for spec in specs]
    assert len(set(stems)) == len(stems)
    assert stems[1].endswith(".rank0of2") and stems[2].endswith(".rank1of2")
    assert specs[1].segments[0].shape == (INTER, 16)  # [2I/2, H/4]
    rank0, rank1 = PackPaths.for_spec(packs, specs[1]), PackPaths.for_spec(tmp_path, specs[2])
    shutil.copyfile(rank0.pack, rank1.pack)  # rank 0's files under rank 1's names
    shutil.copyfile(rank0.sidecar, rank1.sidecar)
    with pytest.raises(PackFormatError, match="another configuration"):
        Pack(tmp_path, specs[2])
    report = build_packs(checkpoint, tmp_path, device="cpu", progress=False, rank=1, world=2)
    assert report.written["base"] == [0, 1]  # rebuilt, not reused
    assert torch.equal(read_row(tmp_path, specs[2], 1, 2), read_row(packs, specs[2], 1, 2))


@pytest.mark.parametrize("rank, world, message", [
    (0, 3, "cannot split expert_inter 128"),  # 128 / 3 is not whole
    (0, 8, r"\(128 / 8\) must be a whole multiple of the 32-wide scale block"),  # 16 cuts a block
    (2, 2, "rank 2 of 2 is not a rank"),
])
def test_bad_splits_are_clear_errors(checkpoint, tmp_path, rank, world, message):
    with open_checkpoint(checkpoint) as ckpt, pytest.raises(TierstoreError, match=message):
        pack_specs(ckpt, ("base",), "auto", rank=rank, world=world)
    with pytest.raises(TierstoreError, match=message):
        build_packs(checkpoint, tmp_path, device="cpu", progress=False, rank=rank, world=world)
    assert list(tmp_path.iterdir()) == []


def test_cli_builds_every_rank_or_one_and_verify_checks_them(checkpoint, tmp_path, capsys):
    assert main(["pack", str(checkpoint), "--out", str(tmp_path / "all"), "--tp-size", "2", "--device", "cpu",
                 "--no-progress"]) == 0
    assert sorted(p.name.rsplit(".", 2)[1] for p in (tmp_path / "all").glob("*.pack")) == ["rank0of2", "rank1of2"]
    assert main(["pack", str(checkpoint), "--out", str(tmp_path / "one"), "--tp-size", "2", "--tp-rank", "1",
                 "--device", "cpu", "--no-progress"]) == 0
    rank1 = [p.name for p in (tmp_path / "all").glob("*.rank1of2.pack")]
    assert [p.name for p in (tmp_path / "one").glob("*.pack")] == rank1
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "all")]) == 0
    assert capsys.readouterr().out.count("ok ") == 2
    assert main(["pack", str(checkpoint), "--out", str(tmp_path / "bad"), "--tp-size", "3", "--device", "cpu",
                 "--no-progress"]) == 2
    assert "cannot split expert_inter 128" in capsys.readouterr().err
    assert main(["pack", str(checkpoint), "--out", str(tmp_path / "bad"), "--tp-size", "0", "--no-progress"]) == 2
