"""`tierstore generate` end to end on the CPU device: demo checkpoint, pack, small pool, KPIs,
--verify-resident, trace recording."""

import warnings

import pytest

from tierstore.cli import main
from tierstore.runtime.cli_generate import first_differing_step
from tierstore.sim import load_trace

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", category=FutureWarning)


def test_generate_demo_verifies_bit_identity_and_records_a_trace(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    trace = tmp_path / "routing.npz"
    code = main(["generate", "--demo", "--prompt", "tiers", "--max-new-tokens", "5", "--gpu-pool-frac", "0.25",
                 "--verify-resident", "--record-trace", str(trace)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bit-identical: yes (5 steps)" in out
    assert "[tierstore] KPI: replay" in out and "pool 32 slots = 25.0% of experts" in out
    recorded = load_trace(trace)
    assert (recorded.num_tokens, recorded.num_layers, recorded.top_k, recorded.num_experts) == (4, 4, 4, 32)


@pytest.mark.parametrize("flag,kpi", [("--early-fetch", "rows fetched during their pass"),
                                      ("--gather-in-pass", "rows gathered by their pass"),
                                      ("--pass-pair", "steps launched as a pass pair")])
def test_generate_with_a_fetch_during_the_pass_stays_bit_identical(tmp_path, monkeypatch, capsys, flag, kpi):
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    code = main(["generate", "--demo", "--prompt", "tiers", "--max-new-tokens", "6", "--gpu-pool-frac", "0.25", flag,
                 "--verify-resident"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bit-identical: yes (6 steps)" in out
    assert kpi in out  # the KPI line names those rows only when there were some


def test_generate_prefills_in_steps_when_one_layer_of_the_prompt_cannot_fit_and_stays_bit_identical(
        tmp_path, monkeypatch, capsys):
    """A 20-slot pool (16%) passes the start-up check (4 layers x top-4 x 1.15 = 19) but one layer of a 40-token
    prompt may route all 32 experts: the prompt runs in prefill steps of 20 // 4 = 5 tokens, the resident run
    repeats them, and every step matches (before, the prefill failed with CapacityError)."""
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    code = main(["generate", "--demo", "--prompt", "a longer prompt that routes many experts", "--max-new-tokens", "4",
                 "--gpu-pool-frac", "0.16", "--verify-resident"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(40 tokens, ByteTokenizer); prefill in steps of 5 tokens" in out
    assert "bit-identical: yes (4 steps)" in out


def test_generate_with_a_full_pool_reads_its_token_itself_and_stays_bit_identical(tmp_path, monkeypatch, capsys):
    """A pool of every expert is filled before the prompt and folds no token into the pass-log read: its decode steps
    read nothing, the generator reads the token itself, and the run equals the resident one bit for bit."""
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    code = main(["generate", "--demo", "--prompt", "tiers", "--max-new-tokens", "6", "--gpu-pool-frac", "1.0",
                 "--verify-resident"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bit-identical: yes (6 steps)" in out and "pool 128 slots = 100.0% of experts" in out
    assert "pool: every expert installed (128)" in out and "5 steps not read" in out  # 6 tokens: 5 decode steps


def test_generate_refuses_a_pool_below_the_working_set(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    assert main(["generate", "--demo", "--max-new-tokens", "2", "--gpu-pool-frac", "0.1"]) == 2
    assert "below the per-step working set" in capsys.readouterr().err


def test_first_differing_step():
    import torch

    a = [torch.zeros(3), torch.ones(3)]
    assert first_differing_step(a, [t.clone() for t in a]) is None
    assert first_differing_step(a, [torch.zeros(3), torch.tensor([1.0, 1.0, 1.0 + 2**-20])]) == 1
    assert first_differing_step(a, a[:1]) == 1


def test_generate_cuda_w2_flag_reaches_the_runtime_and_its_refusal_names_the_reason(tmp_path, monkeypatch, capsys):
    """`--cuda-w2` sets config cuda_w2 (it was reachable only from RuntimeConfig.from_env): on the demo checkpoint,
    whose hidden size does not fit the CUDA kernels, the runtime refuses it at boot with the reason, exit 2."""
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    code = main(["generate", "--demo", "--prompt", "tiers", "--max-new-tokens", "2", "--cuda-w2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "tierstore generate: error: TIERSTORE_CUDA_W2 (config cuda_w2) is on but the expert shapes" in err
    assert "do not fit the CUDA kernels" in err
