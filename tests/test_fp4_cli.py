"""`tierstore generate` with the precision tier on the CPU device: fp4 pack, FP4 pool, gate,
--verify-fp4, the fire dump, and the refusals."""

import json
import sys
import warnings

import pytest
import torch

from tierstore.cli import main
from tierstore.runtime.cli_fp4 import fired_steps_match, report_fp4_verification
from tierstore.runtime.generation import GenerationResult

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", category=FutureWarning)


def test_gate_at_tau_one_verifies_against_all_fp4_and_dumps_fires(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    dump = tmp_path / "fires.jsonl"
    code = main(["generate", "--demo", "--prompt", "tiers", "--max-new-tokens", "5", "--fp4-pool-frac", "0.5",
                 "--fp4-policy", "need", "--gate", "--gate-tau", "1.0", "--verify-fp4", "--gate-dump", str(dump)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bit-identical to all-FP4: yes (4 of 4 fired steps compared)" in out
    assert "gate fired 4/4 steps (100.0%)" in out and "fp4 " in out and "fp4.v1." in out
    assert [json.loads(line)["tau"] for line in dump.read_text().splitlines()] == [1.0] * 4


def test_gate_without_an_fp4_pool_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    assert main(["generate", "--demo", "--max-new-tokens", "2", "--gate"]) == 2
    assert "need an FP4 pool" in capsys.readouterr().err


def test_fired_steps_match_checks_fired_steps_or_everything_when_all_fired():
    a = GenerationResult([1], [2, 3, 4], step_logits=[torch.zeros(3), torch.ones(3), torch.ones(3)],
                         fired=[False, True, False], all_fp4=[True, True, False])
    b = GenerationResult([1], [2, 3, 4], step_logits=[torch.ones(3), torch.ones(3), torch.zeros(3)])
    assert fired_steps_match(a, b) == (True, 1, [1], [])  # only step 1 fired
    a.fired = [False, True, True]
    assert fired_steps_match(a, b) == (False, 2, [0, 1, 2], [0, 2])  # all decode steps fired: every step


def test_a_fired_step_after_a_step_with_w2_experts_is_not_compared(capsys):
    """Its KV context came from W2 experts, so the all-FP4 run's logits are not what it should equal."""
    logits = [torch.full((3,), float(v)) for v in range(5)]
    gated = GenerationResult([1], [2, 3, 4, 5, 6], step_logits=logits, fired=[False, True, False, True, False],
                             all_fp4=[True, True, False, True, True])
    reference = GenerationResult([1], [2, 3, 4, 5, 6], step_logits=[t.clone() for t in logits])
    reference.step_logits[3] = torch.zeros(3)  # differs where the context differs: not a failure
    assert fired_steps_match(gated, reference) == (True, 2, [1], [])
    reference.step_logits[1] = torch.zeros(3)  # an all-FP4 context that differs: a failure
    assert fired_steps_match(gated, reference) == (False, 2, [1], [1])
    gated.all_fp4[2] = True  # now step 3's context is all-FP4 too, so it is compared
    assert fired_steps_match(gated, reference) == (False, 2, [1, 3], [1, 3])
    reference.step_logits[1], reference.step_logits[3] = logits[1].clone(), logits[3].clone()
    gated.all_fp4[2] = False
    assert report_fp4_verification(gated, reference, sys.stdout) == 0
    out = capsys.readouterr().out
    assert "yes (1 of 2 fired steps compared; 1 fired after a step that used W2 experts" in out
