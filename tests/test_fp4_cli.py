"""`tierstore generate` with the precision tier on the CPU device: fp4 pack, FP4 pool, gate,
--verify-fp4, the fire dump, and the refusals."""

import json
import warnings

import pytest
import torch

from tierstore.cli import main
from tierstore.runtime.cli_fp4 import fired_steps_match
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
    assert "bit-identical to all-FP4: yes (4 fired steps)" in out
    assert "gate fired 4/4 steps (100.0%)" in out and "fp4 " in out and "fp4.v1." in out
    assert [json.loads(line)["tau"] for line in dump.read_text().splitlines()] == [1.0] * 4


def test_gate_without_an_fp4_pool_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    assert main(["generate", "--demo", "--max-new-tokens", "2", "--gate"]) == 2
    assert "need an FP4 pool" in capsys.readouterr().err


def test_fired_steps_match_checks_fired_steps_or_everything_when_all_fired():
    a = GenerationResult([1], [2, 3, 4], step_logits=[torch.zeros(3), torch.ones(3), torch.ones(3)],
                         fired=[False, True, False])
    b = GenerationResult([1], [2, 3, 4], step_logits=[torch.ones(3), torch.ones(3), torch.zeros(3)])
    assert fired_steps_match(a, b) == (True, 1, [])  # only step 1 fired
    a.fired = [False, True, True]
    assert fired_steps_match(a, b) == (False, 2, [0, 2])  # all decode steps fired: every step must match
