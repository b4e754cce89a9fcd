"""The runtime on CUDA (run on the GPU machine): Triton kernels over the device pool, pinned arena,
side-stream fetch and a captured CUDA graph of the decode step. Not run in this CPU-only session."""

import warnings

import pytest
import torch
from checkpoint_fixtures import save_hf_checkpoint
from test_runtime_fixtures import ToyMoE, memory_source, runtime_hf_model, toy_geometry

from tierstore.checkpoint import open_checkpoint
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.generation import TieredGenerator
from tierstore.runtime.hf import install_tiered_experts, load_model
from tierstore.runtime.packs import ensure_base_pack, open_base_rows

pytestmark = pytest.mark.gpu
warnings.filterwarnings("ignore", category=FutureWarning)
PROMPT = [5, 17, 33, 8, 60, 12]


def toy_runtime(fraction, backend, seed=0):
    g = toy_geometry(hidden=128, inter=64)
    return g, TieredRuntime(g, memory_source(g, seed), pool_slots=round(fraction * g.total_routed_experts),
                            arena_slots=16, device="cuda", backend=backend, config=RuntimeConfig(kpi_every=0))


def test_triton_layer_matches_the_torch_layer_on_the_same_slots():
    g, triton_rt = toy_runtime(1.0, "triton")
    _, torch_rt = toy_runtime(1.0, "torch")
    with triton_rt, torch_rt:
        triton_rt.preload()
        torch_rt.preload()
        x = torch.randn(4, g.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        ids, weights = ToyMoE(g).route(0, x.cpu())
        ids, weights = ids.cuda(), weights.cuda()
        for rt in (triton_rt, torch_rt):
            rt.log.reset()
        got = triton_rt.moe(0, x, ids, weights)
        want = torch_rt.moe(0, x, ids, weights)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_small_pool_steps_are_bit_identical_on_cuda():
    g, resident = toy_runtime(1.0, "triton")
    _, small = toy_runtime(0.25, "triton")
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    with resident, small:
        resident.preload()
        for step in range(50):
            x = torch.randn(1, g.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, _ = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step}"
            small.pool.check_coherent()
        assert small.stats().replayed_steps > 0


@pytest.mark.parametrize("pass_pair", [False, True], ids=["single", "pass_pair"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_cuda_graph_decode_with_quarter_pool_is_bit_identical(model_type, pass_pair, tmp_path):
    ckpt = save_hf_checkpoint(runtime_hf_model(model_type, seed=3), tmp_path / "ckpt")
    ensure_base_pack(ckpt, tmp_path / "packs", device="cuda")
    with open_checkpoint(ckpt) as c:
        g = c.geometry
    results = []
    chunk = None  # the 25% run's prefill steps, which the resident run repeats (a chunked prefill rounds differently)
    for fraction in (0.25, 1.0):
        runtime = TieredRuntime(g, open_base_rows(ckpt, tmp_path / "packs"), device="cuda", arena_slots=16,
                                pool_slots=round(fraction * g.total_routed_experts),
                                config=RuntimeConfig(kpi_every=0, pass_pair=pass_pair))
        model = load_model(ckpt, torch.bfloat16, "cuda")
        install_tiered_experts(model, runtime)
        with runtime:
            if fraction == 1.0:
                runtime.preload()
            out = TieredGenerator(model, runtime, max_length=80).generate(PROMPT, 64, keep_logits=True,
                                                                         prefill_chunk=chunk)
            chunk = out.prefill_chunk
            results.append((out, runtime.stats()))
    (small, stats), (resident, _) = results
    assert small.cuda_graph and resident.cuda_graph
    assert small.new_ids == resident.new_ids
    for step, (a, b) in enumerate(zip(small.step_logits, resident.step_logits)):
        assert torch.equal(a, b), f"step {step}"
    assert stats.replayed_steps > 0
    if pass_pair:  # captured as a second graph, with the cache's step back inside it (whether a pair finds its
        # rows in this 16-slot arena depends on the model: qwen3_moe's pairs gathered none on the H200)
        assert stats.pair_steps > 0


@pytest.mark.parametrize("cuda_w2", [False, True], ids=["triton", "cuda_w2"])
def test_prefill_layer_beyond_the_pool_runs_in_token_chunks_on_cuda(cuda_w2):
    """A 40-token prefill over a pool of 8 of 16 slots routes more experts than the pool holds: the layer runs in
    token chunks (`TieredRuntime.moe`) that fetch, wait for their rows and compute on the device. Within the bf16
    budget of the all-resident prefill (a chunk's GEMMs run over fewer tokens); the pool stays coherent. One MoE
    layer: a second one would route on bf16 hidden states that differ in the last bits, where a near-tie can
    pick another expert for a token."""
    from tierstore.kernels.cuda import loader

    if cuda_w2 and loader.nvcc_path() is None:
        pytest.skip("needs nvcc to build the CUDA W2 kernels")
    g = toy_geometry(layers=1, experts=16, hidden=512, inter=512)
    model = ToyMoE(g)
    model.routers = model.routers.cuda().to(torch.bfloat16)  # bf16 hidden states: the CUDA W2 kernels need them
    x = (torch.randn(40, g.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(7)) * 0.1).bfloat16()
    outs = {}
    for slots in (g.total_routed_experts, 8):
        with TieredRuntime(g, memory_source(g), pool_slots=slots, arena_slots=16, device="cuda", backend="triton",
                           config=RuntimeConfig(kpi_every=0, cuda_w2=cuda_w2)) as runtime:
            if slots == g.total_routed_experts:
                runtime.preload()
            out, outcome = runtime.step(lambda: model.forward(runtime, x), lambda: None, prefill=True)
            torch.cuda.synchronize()
            runtime.pool.check_coherent()
            assert outcome.first_pass_missing_pairs == 0
            outs[slots] = (out.float().cpu(), runtime.stats().fetched_rows)
    (want, _), (got, fetched) = outs[g.total_routed_experts], outs[8]
    assert fetched > 8  # the chunks refetched into the same 8 slots
    assert not got.isnan().any()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
