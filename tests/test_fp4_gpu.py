"""The precision tier on CUDA (run on the GPU machine): Triton kernels reading the FP4 pool, the
manager's own stream copying into reserved slots, `auto` sizing, and a CUDA-graph decode whose gate
replays reproduce the all-FP4 run bit for bit."""

import warnings

import pytest
import torch
from checkpoint_fixtures import save_hf_checkpoint
from fp4_fixtures import assert_fp4_coherent, tier_rows
from test_runtime_fixtures import ToyMoE, runtime_hf_model, toy_geometry

from tierstore.checkpoint import open_checkpoint
from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
from tierstore.runtime.generation import TieredGenerator
from tierstore.runtime.hf import install_tiered_experts, load_model
from tierstore.runtime.packs import ensure_base_pack, open_base_rows

pytestmark = pytest.mark.gpu
warnings.filterwarnings("ignore", category=FutureWarning)
PROMPT = [5, 17, 33, 8, 60, 12]
GEOMETRY = toy_geometry(hidden=128, inter=64)
ROWS = tier_rows(GEOMETRY)


def runtime(backend, fp4_slots, **config):
    return TieredRuntime(GEOMETRY, MemoryRowSource(ROWS[0]), pool_slots=GEOMETRY.total_routed_experts, arena_slots=16,
                         device="cuda", backend=backend, fp4_source=MemoryRowSource(ROWS[1]), fp4_slots=fp4_slots,
                         fp4_arena_slots=16, config=RuntimeConfig(kpi_every=0, **config))


def test_triton_reads_the_fp4_pool_like_the_torch_layer():
    with runtime("triton", 24, fp4_policy="need") as fast, runtime("torch", 24, fp4_policy="need") as ref:
        x = torch.randn(4, GEOMETRY.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        ids, weights = ToyMoE(GEOMETRY).route(0, x.cpu())
        for rt in (fast, ref):
            rt.preload()
            rt.preload_fp4([(0, int(e)) for e in ids[:, 0].unique().tolist()])
            rt.log.reset()
        got = fast.moe(0, x, ids.cuda(), weights.cuda())
        want = ref.moe(0, x, ids.cuda(), weights.cuda())
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


def test_manager_on_its_stream_keeps_the_pool_coherent_under_a_storm():
    model = ToyMoE(GEOMETRY)
    gen = torch.Generator().manual_seed(1)
    with runtime("triton", 12, fp4_policy="freq", gate=True, gate_tau=0.3, force_fp4_pool=True) as rt:
        for _ in range(200):
            x = torch.randn(1, GEOMETRY.hidden, generator=gen).cuda()
            rt.step(lambda x=x: model.forward(rt, x), lambda: None)
        assert rt.wait_fp4_manager(30)
        assert_fp4_coherent(rt, ROWS[1])
        assert rt.fp4.pool._stream is not None
        assert rt.fp4_stats().promoted_lazy > 0 and rt._fp4_manager.error is None


def test_auto_size_uses_free_device_memory_minus_the_reserve():
    free, _ = torch.cuda.mem_get_info()
    reserve = max(0.0, free / 2**30 - 0.25)  # leave about 256 MiB for the pool
    with runtime("triton", None, fp4_pool_gb="auto", fp4_reserve_gb=reserve) as rt:
        assert 0 < rt.fp4.pool.num_slots <= GEOMETRY.total_routed_experts


@pytest.mark.parametrize("pass_pair", [False, True], ids=["single", "pass_pair"])
def test_cuda_graph_decode_with_the_gate_equals_the_all_fp4_run(tmp_path, pass_pair):
    """With pass_pair the fired run launches pairs (captured as the generator's second graph) beside the FP4 tier
    and the gate; the all-FP4 reference runs single passes."""
    ckpt = save_hf_checkpoint(runtime_hf_model("qwen3_moe", seed=3), tmp_path / "ckpt")
    ensure_base_pack(ckpt, tmp_path / "packs", device="cuda", tags=("base", "fp4"))
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    total = geometry.total_routed_experts

    def generate(forced=None, **config):
        rt = TieredRuntime(geometry, open_base_rows(ckpt, tmp_path / "packs"), pool_slots=total // 2, arena_slots=16,
                           device="cuda", fp4_source=open_base_rows(ckpt, tmp_path / "packs", tag="fp4"),
                           fp4_slots=total, config=RuntimeConfig(kpi_every=0, fp4_policy="need", **config))
        model = load_model(ckpt, torch.bfloat16, "cuda")
        install_tiered_experts(model, rt)
        with rt:
            if forced is not None:
                rt.preload_fp4()
            out = TieredGenerator(model, rt, len(PROMPT) + 17, use_cuda_graph=True).generate(
                PROMPT, 16, keep_logits=True, forced_ids=forced)
            return out, rt.stats()

    fired, stats = generate(gate=True, gate_tau=1.0, gate_fp_max=8, pass_pair=pass_pair, pass_pair_choice="always")
    reference, _ = generate(forced=fired.new_ids, pass_pair=False)
    assert fired.cuda_graph and all(fired.fired[1:])
    assert (stats.pair_steps > 0) == pass_pair
    for a, b in zip(fired.step_logits, reference.step_logits):
        assert torch.equal(a, b)
