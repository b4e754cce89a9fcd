"""benchmarks/first_miss_layers.py: the first missed layer of each fetching step's first pass (CPU)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from first_miss_layers import first_miss_layers  # noqa: E402
from replay import skewed_steps  # noqa: E402

from tierstore.geometry import get_preset  # noqa: E402


def test_one_layer_per_fetching_step_after_the_warm_up_and_in_range():
    geometry = get_preset("ds-v2-lite").with_layers(3)
    small = first_miss_layers(geometry, skewed_steps(geometry, 20), 0.25, warmup=5)
    assert len(small) == 15 and all(0 <= layer < 3 for layer in small)  # at 25% every step after warm-up fetches


def test_a_step_whose_first_layer_is_always_resident_misses_later():
    """Layer 0 routes the same experts every step (resident after the first), the others vary: from the
    second step on, the first miss is never layer 0."""
    geometry = get_preset("ds-v2-lite").with_layers(2)
    steps = skewed_steps(geometry, 20)
    for step in steps:
        step[:, 0, :] = steps[0][:, 0, :]
    assert min(first_miss_layers(geometry, steps, 0.5, warmup=1)) == 1
