"""`tierstore pack` / `tierstore verify` on small synthetic checkpoints: exact rows, resumability,
identity, kill -9 safety, corruption reports."""

import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from pack_helpers import read_row
from process_helpers import Watched

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.cli import main
from tierstore.errors import PackFormatError
from tierstore.formats import quantize_w2
from tierstore.io import pack_build
from tierstore.io.identity import checkpoint_identity
from tierstore.io.pack import Pack
from tierstore.io.pack_build import build_packs, pack_specs
from tierstore.io.row_codec import decode_row
from tierstore.slot_codec import KERNEL_SLOT_CODEC

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt"), num_layers=3, num_experts=4, top_k=2,
                                      hidden=64, expert_inter=32, seed=3)


def test_rows_hold_exactly_the_requantized_codes_nibbles_and_scales(checkpoint, tmp_path):
    report = build_packs(checkpoint, tmp_path, tags=("base", "fp4"), device="cpu", progress=False)
    assert report.written == {"base": [0, 1, 2], "fp4": [0, 1, 2]}
    assert report.peak_rss_bytes > 0 and report.bytes_written > 0
    with open_checkpoint(checkpoint) as ckpt:
        specs = pack_specs(ckpt, ("base", "fp4"), "auto")
        for layer, expert in ((0, 0), (2, 3)):
            weights = ckpt.layer(layer).experts[expert]
            w13, w2 = quantize_w2(weights.w13.dequantize()), quantize_w2(weights.w2.dequantize())
            base = decode_row(read_row(tmp_path, specs["base"], layer, expert), specs["base"].segments)
            fp4 = decode_row(read_row(tmp_path, specs["fp4"], layer, expert), specs["fp4"].segments)
            for name, tensor in (("w13", w13), ("w2", w2)):
                assert torch.equal(base[f"{name}.codes"], tensor.packed_codes())
                assert torch.equal(fp4[f"{name}.nibbles"], tensor.packed_nibbles())
                assert torch.equal(base[f"{name}.scales"], tensor.scale_bytes())
                assert torch.equal(fp4[f"{name}.scales"], tensor.scale_bytes())


def test_segments_are_64_byte_aligned_and_the_abi_tag_is_in_the_identity(checkpoint):
    with open_checkpoint(checkpoint) as ckpt:
        spec = pack_specs(ckpt, ("base",), "auto")["base"]
        assert [s.name for s in spec.segments] == ["w13.codes", "w13.scales", "w2.codes", "w2.scales"]
        assert all(s.offset % 64 == 0 for s in spec.segments)
        assert spec.segments[0].shape == (64, 16) and spec.segments[3].shape == (64, 1)
        assert spec.abi_tag.startswith("tsym4-") and "row64-v1" in spec.abi_tag
        assert pack_specs(ckpt, ("base",), "sign")["base"].key() != spec.key()


def test_rerun_skips_built_layers_and_resumes_after_a_failure(checkpoint, tmp_path, monkeypatch):
    calls = []
    real = pack_build.requantize

    def fail_in_layer_2(matrix, *args):
        calls.append(matrix)
        if len(calls) > 2 * 4 * 2:  # layers 0 and 1 (4 experts x w13/w2) succeed
            raise RuntimeError("injected crash during layer 2")
        return real(matrix, *args)

    monkeypatch.setattr(pack_build, "requantize", fail_in_layer_2)
    with pytest.raises(RuntimeError, match="injected"):
        build_packs(checkpoint, tmp_path, device="cpu", progress=False)
    monkeypatch.setattr(pack_build, "requantize", real)
    report = build_packs(checkpoint, tmp_path, device="cpu", progress=False)
    assert report.skipped["base"] == [0, 1] and report.written["base"] == [2]
    again = build_packs(checkpoint, tmp_path, device="cpu", progress=False)
    assert again.written["base"] == [] and again.bytes_written == 0


def test_a_touched_shard_is_another_checkpoint_and_gets_a_new_pack(checkpoint, tmp_path):
    with open_checkpoint(checkpoint) as ckpt:
        files = ckpt.identity_files()
    before = checkpoint_identity(files)
    assert checkpoint_identity(files) == before
    shard = next(f for f in files if f.suffix == ".safetensors")
    stat = os.stat(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        assert checkpoint_identity(files) != before
    finally:
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert checkpoint_identity(files, override="my-model-2026") == "my-model-2026"
    with pytest.raises(Exception, match="override"):
        checkpoint_identity(files, override="../x")


def test_mxfp4_checkpoints_keep_their_nibbles_verbatim(tmp_path):
    ckpt_dir = write_synthetic_checkpoint(tmp_path / "mx", num_layers=2, num_experts=2, top_k=1, hidden=64,
                                          expert_inter=32, fmt="mxfp4", seed=1)
    build_packs(ckpt_dir, tmp_path / "packs", tags=("fp4",), device="cpu", progress=False)
    with open_checkpoint(ckpt_dir) as ckpt:
        spec = pack_specs(ckpt, ("fp4",), "auto")["fp4"]
        assert spec.zero_mode == "verbatim"
        packed, scales = ckpt.layer(1).experts[1].w2.mxfp4_parts()
    row = decode_row(read_row(tmp_path / "packs", spec, 1, 1), spec.segments)
    assert torch.equal(row["w2.nibbles"], packed)
    assert torch.equal(row["w2.scales"], scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales)


def test_verify_names_every_flipped_row_and_fails(checkpoint, tmp_path, capsys):
    assert main(["pack", str(checkpoint), "--out", str(tmp_path), "--tier", "both", "--device", "cpu",
                 "--no-progress"]) == 0
    assert main(["verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("ok ") == 2
    with open_checkpoint(checkpoint) as ckpt:
        spec = pack_specs(ckpt, ("fp4",), "auto", codec=KERNEL_SLOT_CODEC)["fp4"]
    pack_path = Pack(tmp_path, spec).path
    rng = random.Random(9)
    victims = rng.sample([(layer, expert) for layer in range(3) for expert in range(4)], 3)
    with open(pack_path, "r+b") as handle:
        for layer, expert in victims:
            handle.seek(spec.row_offset(layer, expert) + rng.randrange(spec.row_bytes))
            byte = handle.read(1)[0]
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte ^ 0xFF]))
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    for layer, expert in victims:
        assert f"row (layer {layer}, expert {expert}) fails its checksum" in out
    assert out.count("BAD") == 3 and "ok    base." in out
    layer, expert = victims[0]
    with pytest.raises(Exception, match="fail their checksum"):
        read_row(tmp_path, spec, layer, expert)


def test_verify_reports_hostile_and_truncated_packs_without_touching_other_files(checkpoint, tmp_path, capsys):
    build_packs(checkpoint, tmp_path, device="cpu", progress=False)
    (tmp_path / "evil.json").write_text('{"format": "tierstore-pack", "version": 1, "spec": {"tag": "../../x"}}')
    (tmp_path / "junk.json").write_bytes(b"\x00\xff{")
    pack_path = next(tmp_path.glob("*.pack"))
    os.truncate(pack_path, os.path.getsize(pack_path) - 4096)
    before = sorted(os.listdir(tmp_path))
    parent_before = sorted(os.listdir(tmp_path.parent))
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "BAD   evil.json" in out and "BAD   junk.json" in out and "bytes, its spec needs" in out
    assert sorted(os.listdir(tmp_path)) == before and sorted(os.listdir(tmp_path.parent)) == parent_before
    assert main(["verify", str(tmp_path / "nowhere")]) == 2


def test_cuda_request_without_a_device_is_a_clear_error(checkpoint, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["pack", str(checkpoint), "--out", str(tmp_path), "--device", "cuda", "--no-progress"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_requantization_gives_exactly_the_cpu_pack(checkpoint, tmp_path):
    build_packs(checkpoint, tmp_path / "cpu", tags=("base", "fp4"), device="cpu", progress=False)
    build_packs(checkpoint, tmp_path / "gpu", tags=("base", "fp4"), device="cuda", progress=False)
    for cpu_file in (tmp_path / "cpu").glob("*.pack"):
        assert cpu_file.read_bytes() == (tmp_path / "gpu" / cpu_file.name).read_bytes()


PROGRESS_STARTED = b"\rpack: "  # tqdm's first bar, drawn once the pack generation exists and before any row


def spread_fractions(rng: random.Random, count: int) -> list[float]:
    """`count` kill moments as fractions of a write window, one in each of `count` equal strata
    (so they cover the whole window, start to end), in random order."""
    fractions = [(i + rng.random()) / count for i in range(count)]
    rng.shuffle(fractions)
    return fractions


@pytest.mark.slow
def test_kill_9_of_tierstore_pack_never_serves_a_wrong_row_and_a_rerun_completes_only_what_is_missing(tmp_path):
    """Kill times count from the subprocess's first progress output (not from Popen: importing
    torch takes seconds on a loaded machine) and are spread over the write window, measured here
    by an uninterrupted run and scaled to the layers each rerun still has to write."""
    num_layers = 8
    ckpt_dir = write_synthetic_checkpoint(tmp_path / "ckpt", num_layers=num_layers, num_experts=8, top_k=2,
                                          hidden=128, expert_inter=64, seed=5)
    out = tmp_path / "packs"

    def command(directory):
        return [sys.executable, "-P", "-m", "tierstore", "pack", str(ckpt_dir), "--out", str(directory), "--device",
                "cpu"]  # with its progress bar: the bar's first draw is the "started working" signal

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    reference = tmp_path / "reference"
    build_packs(ckpt_dir, reference, device="cpu", progress=False, codec=KERNEL_SLOT_CODEC)  # the CLI's default
    reference_bytes = next(reference.glob("*.pack")).read_bytes()
    with open_checkpoint(ckpt_dir) as ckpt:
        spec = pack_specs(ckpt, ("base",), "auto", codec=KERNEL_SLOT_CODEC)["base"]

    timed = Watched(command(tmp_path / "timed"), PROGRESS_STARTED, env=env)
    began = timed.wait_started()
    assert timed.wait(timeout=600) == 0, bytes(timed.stderr[-2000:])
    assert timed.stdout_at is not None and b"wrote 8 layers" in timed.stdout
    window = timed.stdout_at - began  # first progress draw .. the report printed after the last commit
    assert next((tmp_path / "timed").glob("*.pack")).read_bytes() == reference_bytes

    rng = random.Random(11)
    fractions: list[float] = []
    kills = interrupted = advanced = torn = 0
    while interrupted < 10 or advanced < 2 or torn < 2:
        assert kills < 30, (f"of {kills} kills only {interrupted} landed while `tierstore pack` was writing, "
                            f"{advanced} after a rerun had committed some layers and {torn} between a layer's "
                            f"row writes and its commit (write window {window:.2f} s)")
        if not fractions:
            fractions = spread_fractions(rng, 10)
        before = Pack(out, spec).layers if out.exists() else frozenset()  # every kill below leaves a generation
        if len(before) == num_layers:
            shutil.rmtree(out)  # complete: start over, so later kills land in a write again
            before = frozenset()
        run = Watched(command(out), PROGRESS_STARTED, env=env)
        began = run.wait_started()
        remaining = num_layers - len(before)
        fraction = fractions.pop()
        time.sleep(max(0.0, began + fraction * window * remaining / num_layers - time.monotonic()))
        run.kill()
        kills += 1
        pack = Pack(out, spec)  # the generation exists: the bar is drawn only after it was created
        layers = pack.layers
        assert before <= layers, "a killed rerun lost layers that were committed before it"
        for layer in layers:
            for expert in range(spec.num_experts):
                assert torch.equal(read_row(out, spec, layer, expert), read_row(reference, spec, layer, expert))
        image, on_disk = pack.path.read_bytes(), False
        for layer in set(range(num_layers)) - layers:
            with pytest.raises(PackFormatError, match="not written"):
                read_row(out, spec, layer, 0)
            rows = (image[spec.row_offset(layer, e):spec.row_offset(layer, e) + spec.row_bytes]
                    for e in range(spec.num_experts))
            on_disk |= any(row.count(0) != len(row) for row in rows)  # rows written, layer not committed
        torn += on_disk
        if len(layers) < num_layers:
            interrupted += 1  # killed mid-write: the run had started and had layers left to commit
            advanced += len(layers) > len(before)
            if fraction * remaining >= 2 and len(layers) == len(before):
                window *= 1.4  # late in the window yet no new commit: the machine got slower; aim later
        else:
            window *= 0.7  # this run finished before its kill (the machine got faster): aim earlier
    recorded = Pack(out, spec).layers
    report = build_packs(ckpt_dir, out, device="cpu", progress=False, codec=KERNEL_SLOT_CODEC)
    assert report.written["base"] == sorted(set(range(num_layers)) - recorded)
    assert Path(report.packs["base"]).read_bytes() == reference_bytes


def test_cli_packs_are_the_ones_the_runtime_serves(tmp_path):
    from tierstore.runtime.packs import ensure_base_pack

    ckpt_dir = write_synthetic_checkpoint(tmp_path / "ckpt", num_layers=2, num_experts=4, top_k=2, hidden=64,
                                          expert_inter=32, seed=2)
    assert main(["pack", str(ckpt_dir), "--out", str(tmp_path / "packs"), "--tier", "both", "--device", "cpu",
                 "--no-progress"]) == 0
    report = ensure_base_pack(ckpt_dir, tmp_path / "packs", device="cpu", tags=("base", "fp4"))
    assert report.written == {"base": [], "fp4": []}
    assert report.skipped == {"base": [0, 1], "fp4": [0, 1]}
    assert main(["pack", str(ckpt_dir), "--out", str(tmp_path / "portable"), "--layout", "portable", "--device",
                 "cpu", "--no-progress"]) == 0
    assert ensure_base_pack(ckpt_dir, tmp_path / "portable", device="cpu").written == {"base": [0, 1]}
