"""Config `cuda_w2` (TIERSTORE_CUDA_W2): the runtime hands moe_mm the CUDA C++ W2 whole op.

CPU: the knob parses; each unmet condition is a ConfigError at boot that names it (FP4 pool, shapes, backend /
device, nvcc, build); with a stand-in kernel object the triton backend passes it to moe_mm only with the knob on,
only for decode-sized workspaces (one pair per block, or 16-pair expert blocks from experts / 2 pairs), built
once. GPU (marker gpu, needs nvcc too): a tiny model with the knob
generates the tokens it generates without it, and its quarter-pool run is bit-identical to its all-resident run, at
expert inter 512 and 768 (the down kernels' 32- and 16-word tile builds), and with an FP4 pool the CUDA path agrees
with the Triton path on mixed residency at inter 512, 768 and 1408 (both tiers' downs on 16-word tiles).
"""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
from fp4_fixtures import tier_rows
from test_runtime_fixtures import ToyMoE, memory_source, toy_geometry

from tierstore.errors import ConfigError
from tierstore.kernels.cuda import loader
from tierstore.kernels.layout import w2_slot_layout
from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
from tierstore.runtime import compute
from tierstore.runtime.fp4_manager import THREAD_NAME

FITS = dict(layers=1, experts=4, top_k=2, hidden=512, inter=512)  # meets the CUDA kernels' shape rules


def test_knob_parses_from_env_and_config_and_defaults_to_auto():
    assert RuntimeConfig().cuda_w2 == "auto"
    assert RuntimeConfig.from_env({}).cuda_w2 == "auto"
    for raw, value in (("1", True), ("true", True), ("on", True), ("0", False), ("false", False), ("off", False),
                       ("auto", "auto"), ("AUTO", "auto")):
        got = RuntimeConfig.from_env({"TIERSTORE_CUDA_W2": raw}).cuda_w2
        assert got == value and type(got) is type(value), raw
    assert RuntimeConfig.from_env({}, cuda_w2=True).cuda_w2 is True
    with pytest.raises(ConfigError, match="cuda_w2 must be auto, true or false, got 'maybe'"):
        RuntimeConfig.from_env({"TIERSTORE_CUDA_W2": "maybe"})
    with pytest.raises(ConfigError, match="cuda_w2 must be auto, true or false, got 2"):
        RuntimeConfig(cuda_w2=2)


def test_a_refused_boot_with_an_fp4_pool_stops_its_fp4_manager():
    g = toy_geometry(**FITS)
    w2_rows, fp4_rows = tier_rows(g)
    with pytest.raises(ConfigError, match="needs the triton backend on a CUDA device"):
        TieredRuntime(g, MemoryRowSource(w2_rows), pool_slots=4, fp4_source=MemoryRowSource(fp4_rows), fp4_slots=2,
                      config=RuntimeConfig(cuda_w2=True, kpi_every=0))
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]


def test_shapes_off_the_kernels_rules_are_refused():
    g = toy_geometry(**{**FITS, "hidden": 64})
    with pytest.raises(ConfigError, match="TIERSTORE_CUDA_W2.*do not fit the CUDA kernels: hidden must be a multiple "
                                          "of 512, got 64"):
        TieredRuntime(g, memory_source(g), pool_slots=4, config=RuntimeConfig(cuda_w2=True, kpi_every=0))


@pytest.mark.parametrize("inter", [96, 768, 1408])
def test_an_inter_off_the_32_word_tiles_passes_the_shape_rules(inter):
    """The down kernels have a build for 16-word tiles (w2_half_tiles.cuh, fp4_half_tiles.cuh): only the backend /
    device check is left."""
    g = toy_geometry(**{**FITS, "inter": inter})
    with pytest.raises(ConfigError, match="needs the triton backend on a CUDA device"):
        TieredRuntime(g, memory_source(g), pool_slots=4, config=RuntimeConfig(cuda_w2=True, kpi_every=0))


def test_torch_backend_on_cpu_refuses_the_knob_and_runs_without_it():
    g = toy_geometry(**FITS)
    with pytest.raises(ConfigError, match="needs the triton backend on a CUDA device; this runtime runs the torch "
                                          "backend on cpu"):
        TieredRuntime(g, memory_source(g), pool_slots=4, config=RuntimeConfig(cuda_w2=True, kpi_every=0))
    with TieredRuntime(g, memory_source(g), pool_slots=4, config=RuntimeConfig(kpi_every=0)):
        pass


def test_missing_nvcc_is_named(monkeypatch):
    monkeypatch.setattr(loader, "nvcc_path", lambda: None)
    layout = w2_slot_layout(512, 512)
    with pytest.raises(ConfigError, match="TIERSTORE_CUDA_W2 .* needs nvcc on PATH or in /usr/local/cuda/bin"):
        compute.load_cuda_w2(layout, None, torch.device("cuda"))


def test_a_failed_build_or_load_is_a_config_error(monkeypatch):
    from tierstore.kernels.cuda import w2_moe

    def fail(**_):
        raise loader.CudaError("cuModuleLoadData failed: CUDA_ERROR_NO_BINARY_FOR_GPU")

    monkeypatch.setattr(loader, "nvcc_path", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(w2_moe, "W2MoeCuda", fail)
    with pytest.raises(ConfigError, match="did not build or load .*CUDA_ERROR_NO_BINARY_FOR_GPU"):
        compute.load_cuda_w2(w2_slot_layout(512, 512), None, torch.device("cuda"))


class _Calls:
    """Stand-ins: the built kernel object (counted builds) and moe_mm (records its cuda_w2 argument)."""

    def __init__(self, monkeypatch):
        moe_mm_module = importlib.import_module("tierstore.kernels.moe_mm")  # the package's `moe_mm` is the function

        self.builds, self.passed = 0, []
        self.kernels = object()

        self.fp4_layouts, self.stream_stages = [], []

        def build(layout, fp4_layout, device, stream=False, stream_stage=False):
            self.builds += 1
            self.fp4_layouts.append(fp4_layout)
            self.stream_stages.append(stream_stage)
            return self.kernels

        def moe_mm(hidden, ids, weights, w2, fp4, layer, misses, workspace, swiglu_limit=None, cuda_w2=None,
                   stream=False):
            self.passed.append((workspace.block_tokens, cuda_w2))
            return torch.zeros_like(hidden)

        monkeypatch.setattr(compute, "load_cuda_w2", build)
        monkeypatch.setattr(moe_mm_module, "moe_mm", moe_mm)


def test_block_size_rule_of_the_knob():
    assert compute.CUDA_MULTI_MAX_PAIRS_PER_EXPERT == 64
    pairs = (8, 64, 127, 128, 256, 257, 4096, 16384, 16385)
    assert [compute.cuda_w2_block_tokens(p, 256) for p in pairs] == [1, 1, 1, 16, 16, 16, 16, 16, None]
    assert [compute.cuda_w2_block_tokens(p, 16) for p in (2, 7, 8, 16, 17, 1024, 1025)] == [1, 1, 16, 16, 16, 16, None]
    # mixtral-8x7b (E = 8, top-2) at T = 8, 32 and 64, olmoe-1b-7b (E = 64, top-8) at T = 32, 64 and 512: the
    # multi-token kernels; mixtral-8x7b at T = 512 (128 pairs per expert): the Triton stages
    assert [compute.cuda_w2_block_tokens(p, 8) for p in (16, 64, 128, 512, 513, 1024)] == [16, 16, 16, 16, None, None]
    assert [compute.cuda_w2_block_tokens(p, 64) for p in (256, 512, 4096)] == [16, 16, 16]
    # with an FP4 pool (TierMoeCuda): one pair per block from experts / 4 pairs, expert blocks from experts / 2 up to
    # 16 pairs per expert, the Triton stages elsewhere
    assert compute.CUDA_MULTI_MAX_PAIRS_PER_EXPERT_FP4 == 16
    fp4_pairs = (8, 63, 64, 127, 128, 256, 257, 4096, 4097)
    assert [compute.cuda_w2_block_tokens(p, 256, fp4=True) for p in fp4_pairs] == [None, None, 1, 1, 16, 16, 16, 16,
                                                                                  None]


def test_with_an_fp4_pool_the_kernels_serve_batches_from_a_quarter_of_the_experts_to_16_pairs_each(monkeypatch):
    pytest.importorskip("triton")
    calls = _Calls(monkeypatch)
    g = toy_geometry(**{**FITS, "experts": 16})
    w2_rows, fp4_rows = tier_rows(g)
    model = ToyMoE(g)
    with TieredRuntime(g, MemoryRowSource(w2_rows), pool_slots=16, fp4_source=MemoryRowSource(fp4_rows), fp4_slots=8,
                       backend="triton", config=RuntimeConfig(cuda_w2=True, kpi_every=0)) as runtime:
        assert calls.fp4_layouts == [runtime.fp4.layout]
        runtime.preload()
        # 2 pairs < 4: Triton; 4 pairs: one pair per block; 8 .. 256 pairs (experts / 2 .. 16 x experts): expert
        # blocks; 258 pairs: Triton (moe_mm's own block size)
        for tokens in (1, 2, 4, 8, 128, 129):
            x = torch.randn(tokens, g.hidden).to(torch.bfloat16)
            runtime.moe(0, x, *model.route(0, x.float()))
    k = calls.kernels
    assert calls.passed == [(1, None), (1, k), (16, k), (16, k), (16, k), (64, None)]


@pytest.mark.parametrize("knob", [False, True])
def test_triton_backend_passes_the_kernels_to_moe_mm_only_with_the_knob(monkeypatch, knob):
    pytest.importorskip("triton")
    calls = _Calls(monkeypatch)
    g = toy_geometry(**{**FITS, "experts": 16})
    model = ToyMoE(g)
    with TieredRuntime(g, memory_source(g), pool_slots=16, backend="triton",
                       config=RuntimeConfig(cuda_w2=knob, kpi_every=0)) as runtime:
        runtime.preload()
        # 2 / 6 pairs < 8: one pair per block; 8 .. 1024 pairs (experts / 2 .. 64 x experts): 16-pair expert
        # blocks (the multi-token kernels); 1026 pairs > 64 x 16 experts: the default workspace, Triton stages
        for tokens in (1, 3, 1, 4, 8, 9, 65, 512, 513):
            x = torch.randn(tokens, g.hidden).to(torch.bfloat16)
            runtime.moe(0, x, *model.route(0, x.float()))
    assert calls.builds == int(knob)  # once per runtime, at boot
    assert calls.stream_stages == [True] * int(knob)  # config stream_stage's default
    want = calls.kernels if knob else None
    if knob:
        assert calls.passed == [(1, want)] * 3 + [(16, want)] * 5 + [(64, None)]
    else:  # moe_mm's own rule: one pair per block up to 4 x experts pairs, 16 up to 16 x experts, then 64
        assert calls.passed == [(1, None)] * 6 + [(16, None)] + [(64, None)] * 2


def test_auto_names_what_is_missing(monkeypatch):
    layout = w2_slot_layout(512, 1408)
    assert "device cpu is not a CUDA device" in compute.cuda_w2_unavailable(layout, None, torch.device("cpu"), "triton")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert "compute capability 8.0: the kernels are built for sm_90a" in compute.cuda_w2_unavailable(
        layout, None, cuda, "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert "hidden must be a multiple of 512, got 64" in compute.cuda_w2_unavailable(
        w2_slot_layout(64, 512), None, cuda, "triton")
    assert "needs the triton backend" in compute.cuda_w2_unavailable(layout, None, cuda, "torch")
    monkeypatch.setattr(loader, "nvcc_path", lambda: None)
    assert "needs nvcc" in compute.cuda_w2_unavailable(layout, None, cuda, "triton")
    monkeypatch.setattr(loader, "nvcc_path", lambda: "/usr/local/cuda/bin/nvcc")
    assert compute.cuda_w2_unavailable(layout, None, cuda, "triton") is None


def test_auto_hands_moe_mm_the_kernels_where_usable_and_triton_elsewhere(monkeypatch):
    """With nothing missing (stood in) auto builds once and passes the kernels for bfloat16 batches; float32 ones run
    the Triton stages (True refuses them, below). With something missing nothing is built."""
    pytest.importorskip("triton")
    g = toy_geometry(**{**FITS, "experts": 16})
    model = ToyMoE(g)
    for missing in (None, "compute capability 8.0"):
        calls = _Calls(monkeypatch)
        monkeypatch.setattr(compute, "cuda_w2_unavailable", lambda *a, missing=missing: missing)
        with TieredRuntime(g, memory_source(g), pool_slots=16, backend="triton",
                           config=RuntimeConfig(kpi_every=0)) as runtime:
            runtime.preload()
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(1, g.hidden).to(dtype)
                runtime.moe(0, x, *model.route(0, x.float()))
        want = calls.kernels if missing is None else None
        assert calls.builds == int(missing is None)
        assert calls.passed == [(1, want), (1, None)]


def test_auto_falls_back_to_triton_when_the_build_fails(monkeypatch, caplog):
    pytest.importorskip("triton")
    calls = _Calls(monkeypatch)
    monkeypatch.setattr(compute, "cuda_w2_unavailable", lambda *a: None)

    def fail(layout, fp4_layout, device, stream=False, stream_stage=False):
        raise ConfigError("TIERSTORE_CUDA_W2 (config cuda_w2): the CUDA kernels did not build or load (nvcc failed)")

    monkeypatch.setattr(compute, "load_cuda_w2", fail)
    g = toy_geometry(**FITS)
    with caplog.at_level("WARNING", logger="tierstore.runtime"):
        with TieredRuntime(g, memory_source(g), pool_slots=4, backend="triton",
                           config=RuntimeConfig(kpi_every=0)) as runtime:
            assert runtime.experts.cuda_w2 is None
            x = torch.randn(1, g.hidden).to(torch.bfloat16)
            runtime.moe(0, x, *ToyMoE(g).route(0, x.float()))
    assert calls.passed == [(1, None)]
    assert "CUDA C++ kernels off (config cuda_w2 auto; the Triton kernels run): " in caplog.text
    assert "did not build or load (nvcc failed)" in caplog.text


def test_the_knob_refuses_hidden_states_other_than_bfloat16(monkeypatch):
    pytest.importorskip("triton")
    calls = _Calls(monkeypatch)
    g = toy_geometry(**FITS)
    with TieredRuntime(g, memory_source(g), pool_slots=4, backend="triton",
                       config=RuntimeConfig(cuda_w2=True, kpi_every=0)) as runtime:
        x = torch.randn(1, g.hidden)
        with pytest.raises(ConfigError, match="needs bfloat16 hidden states, got torch.float32"):
            runtime.moe(0, x, *ToyMoE(g).route(0, x))
    assert calls.passed == []


@pytest.mark.gpu
@pytest.mark.skipif(loader.nvcc_path() is None, reason="needs nvcc to build the CUDA W2 kernels")
@pytest.mark.parametrize("inter", [512, 768])  # 768: the down kernels' 16-word tile build (odd tile count)
def test_generation_with_the_knob_agrees_without_and_tiered_is_bit_identical(tmp_path, monkeypatch, inter):
    from checkpoint_fixtures import save_hf_checkpoint
    from test_runtime_fixtures import runtime_hf_model

    from tierstore.checkpoint import open_checkpoint
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda
    from tierstore.runtime.generation import TieredGenerator
    from tierstore.runtime.hf import install_tiered_experts, load_model
    from tierstore.runtime.packs import ensure_base_pack, open_base_rows

    launches = []
    call = W2MoeCuda.__call__
    monkeypatch.setattr(W2MoeCuda, "__call__", lambda self, *a, **k: (launches.append(1), call(self, *a, **k))[1])
    hf = runtime_hf_model("qwen3_moe", seed=3, hidden_size=512, moe_intermediate_size=inter, intermediate_size=512)
    ckpt = save_hf_checkpoint(hf, tmp_path / "ckpt")
    ensure_base_pack(ckpt, tmp_path / "packs", device="cuda")
    with open_checkpoint(ckpt) as c:
        g = c.geometry
    assert (g.hidden, g.expert_inter) == (512, inter)
    prompt = [5, 17, 33, 8, 60, 12]
    results = {}
    chunk = None  # the 25% run's prefill steps, which the others repeat (a chunked prefill rounds differently)
    for knob, fraction in ((True, 0.25), (False, 1.0), (True, 1.0)):
        runtime = TieredRuntime(g, open_base_rows(ckpt, tmp_path / "packs"), device="cuda", arena_slots=16,
                                pool_slots=round(fraction * g.total_routed_experts),
                                config=RuntimeConfig(kpi_every=0, cuda_w2=knob))
        assert (runtime.experts.cuda_w2 is not None) == knob
        model = load_model(ckpt, torch.bfloat16, "cuda")
        install_tiered_experts(model, runtime)
        before = len(launches)
        with runtime:
            if fraction == 1.0:
                runtime.preload()
            out = TieredGenerator(model, runtime, max_length=64).generate(prompt, 32, keep_logits=True,
                                                                         prefill_chunk=chunk)
            chunk = out.prefill_chunk
            results[knob, fraction] = (out, runtime.stats())
        assert (len(launches) > before) == knob  # the CUDA path ran (prefill and the captured decode)
    off, _ = results[False, 1.0]
    resident, _ = results[True, 1.0]
    small, stats = results[True, 0.25]
    assert resident.cuda_graph and small.cuda_graph
    # different kernels (fp32 tensor-core sums vs bf16x2 partial sums): the same context's logits agree within the
    # bf16 budget, not bit for bit, so greedy tokens may part at a near-tie; only the first step is compared
    first_on, first_off = resident.step_logits[0].float(), off.step_logits[0].float()
    assert (first_on - first_off).abs().max() <= 2e-2 * first_off.abs().max()
    assert small.new_ids == resident.new_ids
    for step, (a, b) in enumerate(zip(small.step_logits, resident.step_logits)):
        assert torch.equal(a, b), f"step {step}"
    assert stats.replayed_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(loader.nvcc_path() is None, reason="needs nvcc to build the CUDA kernels")
@pytest.mark.parametrize("inter", [512, 768, 1408])  # 768: W2 down on 16-word tiles; 1408: both tiers' downs
def test_with_an_fp4_pool_the_cuda_path_agrees_with_the_triton_path_on_mixed_residency(inter):
    g = toy_geometry(**{**FITS, "experts": 16, "inter": inter})
    w2_rows, fp4_rows = tier_rows(g)
    model = ToyMoE(g)
    x = torch.randn(4, g.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids, weights = model.route(0, x.float())  # 4 tokens x top-2 = 8 pairs >= 16 / 4: the CUDA path's batch
    fp4_experts = list(range(0, 16, 2))
    routed = set(ids.reshape(-1).tolist())
    assert routed & set(fp4_experts) and routed - set(fp4_experts)  # both tiers serve this batch
    outs = {}
    for knob in (False, True):
        with TieredRuntime(g, MemoryRowSource(w2_rows), pool_slots=16, fp4_source=MemoryRowSource(fp4_rows),
                           fp4_slots=8, device="cuda", backend="triton",
                           config=RuntimeConfig(cuda_w2=knob, kpi_every=0)) as runtime:
            runtime.pause_fp4_manager()
            runtime.preload()
            runtime.preload_fp4([(0, e) for e in fp4_experts])
            runtime.log.reset()
            first = runtime.moe(0, x.cuda(), ids.cuda(), weights.cuda())
            again = runtime.moe(0, x.cuda(), ids.cuda(), weights.cuda())
            torch.cuda.synchronize()
            assert torch.equal(first, again)  # repeat launches: identical bytes
            assert (runtime.experts.cuda_w2 is not None) == knob
            outs[knob] = first.float().cpu()
    on, off = outs[True], outs[False]
    assert not on.isnan().any()  # every FP4 pair computed (the W2 down marks them NaN until the FP4 down runs)
    assert float((on - off).norm() / off.norm()) <= 2e-2  # other kernels, other sums: within the bf16 budget


def test_config_stream_stage_reaches_the_kernels_build(monkeypatch):
    pytest.importorskip("triton")
    calls = _Calls(monkeypatch)
    g = toy_geometry(**{**FITS, "experts": 16})
    with TieredRuntime(g, memory_source(g), pool_slots=16, backend="triton",
                       config=RuntimeConfig(cuda_w2=True, stream_stage=False, kpi_every=0)):
        pass
    assert calls.stream_stages == [False]
