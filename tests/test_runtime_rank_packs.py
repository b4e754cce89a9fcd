"""The runtime's pack helpers for tensor-parallel ranks: `ensure_base_pack` / `open_base_rows` with
rank and world build and serve that rank's share of every expert (kernel slot rows), and a rank
whose pack is missing or replaced by another rank's gets an error naming what the folder holds
and the exact `tierstore pack` command that builds its pack."""

import shutil

import pytest
import torch

from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.errors import PackFormatError
from tierstore.kernels.layout import unpack_matrix_ref, w2_slot_layout
from tierstore.runtime.packs import ensure_base_pack, open_base_rows

HIDDEN, INTER, EXPERTS = 64, 128, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt"), num_layers=2, num_experts=EXPERTS, top_k=2,
                                      hidden=HIDDEN, expert_inter=INTER, seed=8)


def matrices(rows, layer, expert, inter) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2*inter, H], w2 [H, inter]) values of one row of `rows` (kernel slot layout)."""
    dest = torch.zeros(rows.stride, dtype=torch.uint8)
    rows.read_rows([(layer, expert)], [memoryview(dest.numpy())])
    layout = w2_slot_layout(HIDDEN, inter)
    slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    slot[:rows.row_bytes] = dest[:rows.row_bytes]
    return unpack_matrix_ref(slot, layout, "w13"), unpack_matrix_ref(slot, layout, "w2")


def test_rank_rows_are_the_ranks_share_of_the_whole_expert(checkpoint, tmp_path):
    ensure_base_pack(checkpoint, tmp_path, device="cpu")
    whole = open_base_rows(checkpoint, tmp_path, direct=False)
    world, size = 4, INTER // 4
    for rank in range(world):
        report = ensure_base_pack(checkpoint, tmp_path, device="cpu", rank=rank, world=world)
        assert report.packs["base"].name.endswith(f".rank{rank}of{world}.pack")
        rows = open_base_rows(checkpoint, tmp_path, direct=False, rank=rank, world=world)
        assert (rows.pack.spec.rank, rows.pack.spec.world) == (rank, world)
        for layer, expert in ((0, 0), (1, EXPERTS - 1)):
            w13, w2 = matrices(rows, layer, expert, size)
            full_w13, full_w2 = matrices(whole, layer, expert, INTER)
            part = slice(rank * size, (rank + 1) * size)
            assert torch.equal(w13, torch.cat((full_w13[:INTER][part], full_w13[INTER:][part])))
            assert torch.equal(w2, full_w2[:, part])
        rows.close()
    whole.close()


def test_missing_rank_pack_names_what_is_there_and_the_command(checkpoint, tmp_path):
    ensure_base_pack(checkpoint, tmp_path, device="cpu")
    ensure_base_pack(checkpoint, tmp_path, device="cpu", rank=0, world=2)
    with pytest.raises(PackFormatError) as missing:
        open_base_rows(checkpoint, tmp_path, direct=False, rank=1, world=2, zero_mode="auto")
    message = str(missing.value)
    assert "no valid base pack of rank 1 of 2" in message
    assert "packs of: whole experts (rank 0 of 1), rank 0 of 2;" in message
    assert message.endswith(f"build it with: tierstore pack {checkpoint} --out {tmp_path} --tp-size 2 --tp-rank 1")
    with pytest.raises(PackFormatError, match=r"--tier fp4 --zero-mode alt --tp-size 4 --tp-rank 3$"):
        open_base_rows(checkpoint, tmp_path, direct=False, rank=3, world=4, zero_mode="alt", tag="fp4")


def test_another_ranks_pack_under_a_ranks_name_is_refused_then_rebuilt(checkpoint, tmp_path):
    rank0 = ensure_base_pack(checkpoint, tmp_path / "rank0", device="cpu", rank=0, world=2).packs["base"]
    rank1 = ensure_base_pack(checkpoint, tmp_path, device="cpu", rank=1, world=2).packs["base"]
    shutil.copyfile(rank0, rank1)
    shutil.copyfile(rank0.with_suffix(".json"), rank1.with_suffix(".json"))
    with pytest.raises(PackFormatError, match=f"{rank1.with_suffix('.json').name} holds rank 0 of 2") as refused:
        open_base_rows(checkpoint, tmp_path, direct=False, rank=1, world=2)
    assert str(refused.value).endswith("--tp-size 2 --tp-rank 1")
    assert ensure_base_pack(checkpoint, tmp_path, device="cpu", rank=1, world=2).written == {"base": [0, 1]}
    rows = open_base_rows(checkpoint, tmp_path, direct=False, rank=1, world=2)
    assert (rows.pack.spec.rank, rows.pack.spec.world) == (1, 2)
    rows.close()
