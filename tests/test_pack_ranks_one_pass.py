"""`build_rank_packs` / `tierstore pack --tp-size W`: every rank's packs in one pass over the
checkpoint, byte for byte the per-rank packs, resumable per rank, each matrix read and
requantized once, bad splits refused before any file is touched."""

import os

import pytest

from tierstore.checkpoint.files import TensorFiles
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.cli import main
from tierstore.errors import TierstoreError
from tierstore.io import pack_build
from tierstore.io.pack_build import build_packs, build_rank_packs
from tierstore.io.row_codec import DEFAULT_ROW_CODEC
from tierstore.slot_codec import KERNEL_SLOT_CODEC

INTER, LAYERS, EXPERTS = 128, 3, 3
MATRICES = 2 * EXPERTS  # w13 and w2 of every expert, per layer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt"), num_layers=LAYERS, num_experts=EXPERTS,
                                      top_k=2, hidden=64, expert_inter=INTER, seed=7)


@pytest.fixture
def spy(monkeypatch):
    """Counts requantize calls and checkpoint tensor reads (whole tensors and stacked rows)."""
    counts = {"requantize": 0, "reads": 0}
    real_requantize, real_read, real_read_row = pack_build.requantize, TensorFiles.read, TensorFiles.read_row

    def requantize(*args):
        counts["requantize"] += 1
        return real_requantize(*args)

    def read(self, *args):
        counts["reads"] += 1
        return real_read(self, *args)

    def read_row(self, *args):
        counts["reads"] += 1
        return real_read_row(self, *args)

    monkeypatch.setattr(pack_build, "requantize", requantize)
    monkeypatch.setattr(TensorFiles, "read", read)
    monkeypatch.setattr(TensorFiles, "read_row", read_row)

    def take():
        taken = dict(counts)
        counts.update(requantize=0, reads=0)
        return taken

    return take


def files(directory) -> dict[str, bytes]:
    """Every file of a pack directory (packs, sidecars, locks) by name, with its bytes."""
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def per_rank(checkpoint, out, world, tags, codec):
    for rank in range(world):
        build_packs(checkpoint, out, tags=tags, device="cpu", progress=False, codec=codec, rank=rank, world=world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("codec", [KERNEL_SLOT_CODEC, DEFAULT_ROW_CODEC], ids=["kernel", "portable"])
def test_one_pass_packs_are_byte_identical_to_the_per_rank_packs(checkpoint, tmp_path, spy, world, codec):
    tags = ("base", "fp4")
    per_rank(checkpoint, tmp_path / "per-rank", world, tags, codec)
    old = spy()
    report = build_rank_packs(checkpoint, tmp_path / "one-pass", tags=tags, device="cpu", progress=False,
                              codec=codec, world=world)
    new = spy()
    expected, got = files(tmp_path / "per-rank"), files(tmp_path / "one-pass")
    assert sorted(got) == sorted(expected)
    assert len([name for name in got if name.endswith(".pack")]) == 2 * world
    assert len([name for name in got if name.endswith(".json")]) == 2 * world  # sidecars: no timestamps in them
    for name in expected:
        assert got[name] == expected[name], name
    assert old["requantize"] == world * LAYERS * MATRICES and old["reads"] >= world * LAYERS * MATRICES
    assert new["requantize"] == LAYERS * MATRICES and new["reads"] == old["reads"] // world
    assert report.layers_read == list(range(LAYERS))
    assert sorted(report.ranks) == list(range(world))
    for rank, rank_report in report.ranks.items():
        assert rank_report.written == {"base": [0, 1, 2], "fp4": [0, 1, 2]}
        assert rank_report.skipped == {"base": [], "fp4": []}
        assert rank_report.packs["base"].name.endswith(f".rank{rank}of{world}.pack")
    assert report.bytes_written == sum(r.bytes_written for r in report.ranks.values()) > 0
    assert main(["verify", str(tmp_path / "one-pass")]) == 0


def test_mxfp4_one_pass_cuts_the_verbatim_nibbles_as_the_per_rank_path(tmp_path):
    ckpt = write_synthetic_checkpoint(tmp_path / "mx", num_layers=2, num_experts=2, top_k=1, hidden=64,
                                      expert_inter=64, fmt="mxfp4", seed=1)
    per_rank(ckpt, tmp_path / "per-rank", 2, ("base", "fp4"), KERNEL_SLOT_CODEC)
    build_rank_packs(ckpt, tmp_path / "one-pass", tags=("base", "fp4"), device="cpu", progress=False,
                     codec=KERNEL_SLOT_CODEC, world=2)
    assert files(tmp_path / "one-pass") == files(tmp_path / "per-rank")


def test_resume_after_deleting_one_ranks_pack_rebuilds_only_that_rank(checkpoint, tmp_path, spy):
    out = tmp_path / "packs"
    build_rank_packs(checkpoint, out, tags=("base", "fp4"), device="cpu", progress=False, world=4)
    reference = files(out)
    spy()
    victims = sorted(out.glob("*.rank2of4.*"))
    assert len([p for p in victims if p.suffix in (".pack", ".json")]) == 4  # base + fp4, pack + sidecar
    for path in victims:
        path.unlink()
    others = {path.name: os.stat(path).st_mtime_ns for path in out.iterdir() if ".rank2of4." not in path.name
              and path.suffix in (".pack", ".json")}
    report = build_rank_packs(checkpoint, out, tags=("base", "fp4"), device="cpu", progress=False, world=4)
    counts = spy()
    assert counts["requantize"] == LAYERS * MATRICES  # each matrix once, for the one rank that needs it
    assert report.layers_read == list(range(LAYERS))
    for rank, rank_report in report.ranks.items():
        if rank == 2:
            assert rank_report.written == {"base": [0, 1, 2], "fp4": [0, 1, 2]}
        else:
            assert rank_report.written == {"base": [], "fp4": []}
            assert rank_report.skipped == {"base": [0, 1, 2], "fp4": [0, 1, 2]}
            assert rank_report.bytes_written == 0
    assert {name: os.stat(out / name).st_mtime_ns for name in others} == others  # never rewritten
    assert files(out) == reference
    again = build_rank_packs(checkpoint, out, tags=("base", "fp4"), device="cpu", progress=False, world=4)
    assert spy() == {"requantize": 0, "reads": 0}  # every rank has every layer: nothing is read
    assert again.layers_read == [] and again.bytes_written == 0


def test_a_crash_mid_pass_resumes_with_only_the_missing_layers(checkpoint, tmp_path, monkeypatch, spy):
    out = tmp_path / "packs"
    calls = []
    counting = pack_build.requantize  # the spy's wrapper

    def crash_in_layer_1(*args):
        calls.append(args[0])
        if len(calls) > MATRICES:  # layer 0 completes, the first matrix of layer 1 fails
            raise RuntimeError("injected crash during layer 1")
        return counting(*args)

    monkeypatch.setattr(pack_build, "requantize", crash_in_layer_1)
    with pytest.raises(RuntimeError, match="injected"):
        build_rank_packs(checkpoint, out, device="cpu", progress=False, world=2)
    monkeypatch.setattr(pack_build, "requantize", counting)
    spy()
    report = build_rank_packs(checkpoint, out, device="cpu", progress=False, world=2)
    assert spy()["requantize"] == (LAYERS - 1) * MATRICES
    assert report.layers_read == [1, 2]
    assert all(r.skipped["base"] == [0] and r.written["base"] == [1, 2] for r in report.ranks.values())
    per_rank(checkpoint, tmp_path / "per-rank", 2, ("base",), DEFAULT_ROW_CODEC)
    assert files(out) == files(tmp_path / "per-rank")


@pytest.mark.parametrize("world, message", [
    (3, "cannot split expert_inter 128"),  # 128 / 3 is not whole
    (8, r"\(128 / 8\) must be a whole multiple of the 32-wide scale block"),  # 16 cuts a block
    (0, "world size must be a whole number >= 1"),
])
def test_bad_splits_are_refused_before_any_file_is_touched(checkpoint, tmp_path, spy, world, message):
    out = tmp_path / "packs"
    with pytest.raises(TierstoreError, match=message):
        build_rank_packs(checkpoint, out, tags=("base", "fp4"), device="cpu", progress=False, world=world)
    assert not out.exists()
    assert spy() == {"requantize": 0, "reads": 0}


def test_an_existing_directory_is_left_untouched_by_a_refused_split(checkpoint, tmp_path):
    build_rank_packs(checkpoint, tmp_path, device="cpu", progress=False, world=2)
    before = {name: (data, os.stat(tmp_path / name).st_mtime_ns) for name, data in files(tmp_path).items()}
    with pytest.raises(TierstoreError, match="cannot split"):
        build_rank_packs(checkpoint, tmp_path, device="cpu", progress=False, world=3)
    with pytest.raises(TierstoreError, match="unknown tier"):
        build_rank_packs(checkpoint, tmp_path, tags=("base", "fp8"), device="cpu", progress=False, world=2)
    assert {name: (data, os.stat(tmp_path / name).st_mtime_ns) for name, data in files(tmp_path).items()} == before


def test_cli_without_tp_rank_builds_every_rank_in_one_pass(checkpoint, tmp_path, spy, capsys):
    assert main(["pack", str(checkpoint), "--out", str(tmp_path / "all"), "--tp-size", "4", "--tier", "both",
                 "--device", "cpu", "--no-progress"]) == 0
    assert spy()["requantize"] == LAYERS * MATRICES
    out = capsys.readouterr().out
    assert "read 3 of the checkpoint's layers once for all 4 ranks" in out
    assert out.count("(wrote 3 layers, skipped 0 already built)") == 8
    for rank in range(4):
        assert main(["pack", str(checkpoint), "--out", str(tmp_path / "one"), "--tp-size", "4", "--tp-rank",
                     str(rank), "--tier", "both", "--device", "cpu", "--no-progress"]) == 0
    assert files(tmp_path / "all") == files(tmp_path / "one")
    assert main(["pack", str(checkpoint), "--out", str(tmp_path / "bad"), "--tp-size", "8", "--device", "cpu",
                 "--no-progress"]) == 2
    assert "must be a whole multiple of the 32-wide scale block" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
