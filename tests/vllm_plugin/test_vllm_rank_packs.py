"""STORE_DIR under tensor parallelism inside vLLM's MoE layer on CPU: a worker of TP rank r of W
boots from the rank-r pack of a W-way pack set (built on its first boot, or beforehand by
`tierstore pack --tp-size W`), its W2 slot rows are byte for byte the rows the requantize-at-load
path makes from vLLM's shard, later boots requantize nothing, and a pack of another rank
geometry is never served (the error names the `tierstore pack` command that builds the right
one). TP ranks are emulated as in test_vllm_moe_layer: one process, vLLM's MoE parallel config
set to the rank."""

import pytest
import torch

from tierstore.cli import main
from tierstore.errors import ConfigError
from tierstore.reference_moe import reference_moe
from tierstore.vllm_adapter.expert_compute import w2_slot_bytes

from moe_helpers import E, FORMATS, H, I, apply, built_layer, reference_tier, routing

pytestmark = pytest.mark.vllm


def requantized_rows(routed) -> torch.Tensor:
    """uint8 [E, slot_bytes]: the W2 slot rows the requantize-at-load path makes from the layer's
    loaded (TP-sharded) parameters."""
    return routed.quant_method._requantized_slot_rows(routed)[0]


def boot_of(routed):
    """The PackBoot the layer was served from (its rank's)."""
    from tierstore.vllm_adapter.pack_boot import pack_boot

    method = routed.quant_method
    settings = method.settings
    return pack_boot(method.model_path, settings.store_dir, settings.zero_mode, settings.tier_direct,
                     rank=method.tp_rank, world=method.tp_size)


def rank_reference(path, x, weights, ids, rank, tp, zero_mode="sign"):
    shard = I // tp
    rows = slice(rank * shard, (rank + 1) * shard)
    tier = reference_tier(path, row_slice=rows, col_slice=rows, zero_mode=zero_mode)
    return reference_moe(x, ids, weights, layer=0, tiers=[tier]).output


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_boots_from_its_pack_with_the_requantized_bytes(harness, checkpoints, monkeypatch, tmp_path, fmt,
                                                                   tp):
    """ZERO_MODE=sign: under `auto` the pack decides zero signs on the full matrix and vLLM's
    shard requantization on the shard (see the next test)."""
    monkeypatch.setenv("TIERSTORE_ZERO_MODE", "sign")
    monkeypatch.setenv("TIERSTORE_STORE_DIR", str(tmp_path))
    x, _, weights, ids = routing(harness, seed=5)
    total = torch.zeros(6, H)
    for rank in range(tp):
        with harness.cpu_vllm(model=checkpoints[fmt]), harness.tensor_parallel_rank(tp, rank):
            _, routed = built_layer(harness, checkpoints[fmt], process=False)
            expected = requantized_rows(routed)  # [E, slot_bytes]
            assert expected.shape == (E, w2_slot_bytes(H, I // tp))
            routed.quant_method.process_weights_after_loading(routed)
            boot = boot_of(routed)
            assert boot.rows.pack.path.name.endswith(f".rank{rank}of{tp}.pack")
            assert boot.report.written == {"base": [0, 1]}
            assert torch.equal(boot.slot_rows(0), expected), f"rank {rank} of {tp}"
            out = apply(routed, x, weights, ids)
        assert torch.equal(out, rank_reference(checkpoints[fmt], x, weights, ids, rank, tp)), f"rank {rank}"
        total += out
    full = reference_moe(x, ids, weights, layer=0, tiers=[reference_tier(checkpoints[fmt], zero_mode="sign")]).output
    torch.testing.assert_close(total, full, rtol=1e-4, atol=1e-6)
    assert len(list(tmp_path.glob("base.v1.*.pack"))) == tp


def test_auto_zero_mode_rank_packs_are_slices_of_the_single_gpu_pack(harness, checkpoints, monkeypatch, tmp_path):
    """Under `auto` a rank pack holds the slices of the TP-1 requantization (zero mode decided on
    the full matrix), while the requantize-at-load path decides on vLLM's shard: on the fp8_block
    fixture, whose exact zeros are one-signed in some shards only, the two differ."""
    from tierstore.vllm_adapter.expert_compute import ReferenceBackend

    monkeypatch.setenv("TIERSTORE_STORE_DIR", str(tmp_path))
    path, tp = checkpoints["fp8_block"], 4
    with harness.cpu_vllm(model=path):
        whole_w13, whole_w2 = ReferenceBackend(H, I, E).rows_from_slots(boot_of(built_layer(harness, path)[1])
                                                                        .slot_rows(0))  # [E, 2I, H], [E, H, I]
    differs = 0
    shard = I // tp
    for rank in range(tp):
        with harness.cpu_vllm(model=path), harness.tensor_parallel_rank(tp, rank):
            _, routed = built_layer(harness, path, process=False)
            at_load = requantized_rows(routed)
            routed.quant_method.process_weights_after_loading(routed)
            rows = boot_of(routed).slot_rows(0)
        w13, w2 = ReferenceBackend(H, shard, E).rows_from_slots(rows)
        part = slice(rank * shard, (rank + 1) * shard)
        assert torch.equal(w13, torch.cat((whole_w13[:, :I][:, part], whole_w13[:, I:][:, part]), dim=1))
        assert torch.equal(w2, whole_w2[:, :, part])
        differs += not torch.equal(rows, at_load)
    assert differs > 0


def test_packs_built_by_the_cli_boot_every_rank_without_requantizing(harness, checkpoints, monkeypatch, tmp_path):
    import tierstore.io.pack_build as pack_build
    import tierstore.vllm_adapter.moe_method as moe_method

    path, tp = checkpoints["nvfp4"], 2
    assert main(["pack", str(path), "--out", str(tmp_path), "--zero-mode", "sign", "--tp-size", str(tp),
                 "--device", "cpu", "--no-progress"]) == 0

    def refuse(*args, **kwargs):
        raise AssertionError("requantized at boot although the rank pack exists")

    monkeypatch.setattr(pack_build, "requantize", refuse)
    monkeypatch.setattr(moe_method, "requantize_expert", refuse)
    monkeypatch.setenv("TIERSTORE_ZERO_MODE", "sign")
    monkeypatch.setenv("TIERSTORE_STORE_DIR", str(tmp_path))
    x, _, weights, ids = routing(harness, seed=6)
    for rank in range(tp):
        with harness.cpu_vllm(model=path), harness.tensor_parallel_rank(tp, rank):
            routed = built_layer(harness, path)[1]
            assert boot_of(routed).requantized_layers == []
            out = apply(routed, x, weights, ids)
        assert torch.equal(out, rank_reference(path, x, weights, ids, rank, tp))


def test_expert_cache_under_tp_serves_the_rank_pack(harness, checkpoints, monkeypatch, tmp_path):
    from tierstore.vllm_adapter.tiered import forget_tiered_model

    path, tp = checkpoints["bf16"], 2
    monkeypatch.setenv("TIERSTORE_ZERO_MODE", "sign")
    monkeypatch.setenv("TIERSTORE_STORE_DIR", str(tmp_path))
    monkeypatch.setenv("TIERSTORE_BASE_CACHE_GB", f"{E * w2_slot_bytes(H, I // tp)}B")
    monkeypatch.setenv("TIERSTORE_BASE_RAM_GB", "auto")
    x, _, weights, ids = routing(harness, seed=7)
    for rank in range(tp):
        forget_tiered_model()
        with harness.cpu_vllm(model=path, enforce_eager=True), harness.tensor_parallel_rank(tp, rank):
            routed = built_layer(harness, path)[1]
            assert routed.quant_method.tiered.boot.rows.pack.spec.rank == rank
            out = apply(routed, x, weights, ids)
        assert torch.equal(out, rank_reference(path, x, weights, ids, rank, tp)), f"rank {rank}"


@pytest.mark.parametrize("built, wanted", [((0, 2), (1, 2)), ((1, 2), (3, 4)), ((0, 1), (1, 2))],
                         ids=["rank0-to-rank1", "world2-to-world4", "whole-to-rank"])
def test_a_pack_of_another_rank_geometry_is_never_served(harness, checkpoints, monkeypatch, tmp_path, built, wanted):
    from tierstore.vllm_adapter.pack_boot import pack_boot

    path = checkpoints["bf16"]
    boot = pack_boot(path, tmp_path, "sign", False, rank=built[0], world=built[1])
    rank, world = wanted
    command = f"tierstore pack {path} --out {tmp_path} --zero-mode sign --tp-size {world} --tp-rank {rank}"
    with pytest.raises(ConfigError, match="holds") as refused:
        boot.check_layer("model.layers.0.mlp.experts", E, I // world, rank, world)
    assert command in str(refused.value)
    assert f"this process is rank {rank} of {world}" in str(refused.value)
