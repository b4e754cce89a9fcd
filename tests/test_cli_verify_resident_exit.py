"""Issue 5 §3: `tierstore generate --verify-resident` exits non-zero and names the differing step when
one step's logits of the all-resident reference run differ from the tiered run's (the reference is
perturbed in its last bit through monkeypatch), end to end through the CLI entry."""

import warnings

import pytest
import torch

from tierstore.cli import main
from tierstore.runtime import cli_generate

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", category=FutureWarning)


def perturbing_generator(step: int):
    """cli_generate's TieredGenerator, except that on an all-resident runtime (the reference run) the
    logits [V] of `step` come back with one value moved to the next float."""
    class Perturbing(cli_generate.TieredGenerator):
        def generate(self, *args, **kwargs):
            result = super().generate(*args, **kwargs)
            if self.runtime.pool.num_slots == self.runtime.geometry.total_routed_experts:
                logits = result.step_logits[step].clone()  # [V]
                logits[0] = torch.nextafter(logits[0], torch.tensor(float("inf")))
                result.step_logits[step] = logits
            return result

    return Perturbing


@pytest.mark.parametrize("step", [0, 3])
def test_verify_resident_exits_1_and_names_the_differing_step(step, tmp_path, monkeypatch, capsys):
    """Prefill (step 0) or a decode step perturbed in the reference: exit status 1, the report names
    that step, and no "bit-identical: yes" line."""
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cli_generate, "TieredGenerator", perturbing_generator(step))
    code = main(["generate", "--demo", "--prompt", "tiers", "--max-new-tokens", "5", "--gpu-pool-frac", "0.25",
                 "--verify-resident"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"bit-identical: NO: step {step} differs from the all-resident run (5 vs 5 steps)" in out
    assert "bit-identical: yes" not in out
