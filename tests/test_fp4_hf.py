"""The precision tier on real model code: a tiny random-init transformers Qwen3-MoE served from
its base and fp4 packs on the CPU device (issue 6, section 3 (a)-(d))."""

import warnings

import pytest
import torch
from checkpoint_fixtures import save_hf_checkpoint
from test_runtime_fixtures import runtime_hf_model

from tierstore.checkpoint import open_checkpoint
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.generation import TieredGenerator
from tierstore.runtime.hf import install_tiered_experts, load_model
from tierstore.runtime.packs import ensure_base_pack, open_base_rows

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", category=FutureWarning)

PROMPT = [5, 17, 33, 8, 60, 12]
STEPS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe_fp4")
    ckpt = save_hf_checkpoint(runtime_hf_model("qwen3_moe", seed=3), root / "ckpt")
    ensure_base_pack(ckpt, root / "packs", device="cpu", tags=("base", "fp4"))
    return ckpt, root / "packs"


def generate(checkpoint, *, pool_frac=0.5, fp4_frac=1.0, preload_fp4=False, forced_ids=None, **config):
    ckpt, packs = checkpoint
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    total = geometry.total_routed_experts
    runtime = TieredRuntime(geometry, open_base_rows(ckpt, packs), pool_slots=round(pool_frac * total), arena_slots=16,
                            fp4_source=open_base_rows(ckpt, packs, tag="fp4"), fp4_slots=round(fp4_frac * total),
                            fp4_arena_slots=16, config=RuntimeConfig(kpi_every=0, **config))
    model = load_model(ckpt, torch.float32)
    install_tiered_experts(model, runtime)
    with runtime:
        if preload_fp4:
            runtime.preload_fp4()
        out = TieredGenerator(model, runtime, max_length=len(PROMPT) + STEPS + 1).generate(
            PROMPT, STEPS, keep_logits=True, forced_ids=forced_ids)
        assert runtime.wait_fp4_manager(10)
        return out, runtime.fp4_stats(), runtime.gate_stats()


def test_gate_at_tau_one_reproduces_the_all_fp4_run_exactly(checkpoint):
    fired, _, _ = generate(checkpoint, gate=True, gate_tau=1.0, gate_fp_max=8, fp4_policy="need")
    reference, _, _ = generate(checkpoint, preload_fp4=True, fp4_policy="need", forced_ids=fired.new_ids)
    assert all(fired.fired[1:]) and not fired.fired[0]  # decode steps fire, prefill never
    for step in range(1, len(fired.step_logits)):
        assert torch.equal(fired.step_logits[step], reference.step_logits[step]), f"decode step {step}"
    assert torch.equal(fired.step_logits[0], reference.step_logits[0])  # prefill at FP4 (the pool holds it)


def test_unfired_steps_are_unchanged_by_arming_the_gate(checkpoint):
    off, _, _ = generate(checkpoint, fp4_policy="need")
    armed, _, gate = generate(checkpoint, gate=True, gate_tau=-1.0, fp4_policy="need")
    assert gate.fired == 0 and gate.steps == STEPS - 1 and not any(armed.fired)
    assert all(torch.equal(a, b) for a, b in zip(off.step_logits, armed.step_logits))


def test_need_fills_only_on_fires_and_freq_promotes_in_the_background(checkpoint):
    _, quiet, _ = generate(checkpoint, gate=True, gate_tau=-1.0, fp4_policy="need", fp4_frac=0.5, fp4_prefill=False)
    assert quiet.mapped == 0
    _, prefilled, _ = generate(checkpoint, gate=True, gate_tau=-1.0, fp4_policy="need", fp4_frac=0.5)
    assert prefilled.mapped == prefilled.promoted_prefill > 0  # decode steps add nothing
    _, stats, gate = generate(checkpoint, gate=True, gate_tau=0.9, fp4_policy="need", fp4_frac=0.5)
    assert gate.fired > 0 and stats.promoted_lazy == 0 and stats.promoted_forced > 0
    _, lazy, _ = generate(checkpoint, fp4_policy="freq", fp4_frac=0.5, fp4_prefill=False)
    assert lazy.promoted_lazy > 0 and lazy.promoted_forced == 0
