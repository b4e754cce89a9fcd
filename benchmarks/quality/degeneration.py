"""The degeneration (repetition-loop) detector used for every configuration's greedy generations.

Definition: a generation is degenerate when, over its last WINDOW = 64 generated tokens, at most
MAX_DISTINCT_FRACTION = 25% of the 4-grams are distinct (61 4-grams, so at most 15 distinct).
Any loop with a period of at most 15 tokens that fills the window qualifies (it has at most
`period` distinct 4-grams); ordinary text and code, even repetitive code, keep most 4-grams
distinct. Generations shorter than the window are not judged.
"""

from __future__ import annotations

from collections.abc import Sequence

WINDOW = 64
NGRAM = 4
MAX_DISTINCT_FRACTION = 0.25


def distinct_ngram_fraction(tokens: Sequence[int], n: int = NGRAM) -> float:
    """Distinct n-grams / all n-grams of `tokens` (1.0 when there are none)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def is_degenerate(generated: Sequence[int], window: int = WINDOW, n: int = NGRAM,
                  max_distinct_fraction: float = MAX_DISTINCT_FRACTION) -> bool | None:
    """True/False by the definition above for the generated tokens (prompt excluded); None if too short."""
    if len(generated) < window:
        return None
    return distinct_ngram_fraction(list(generated[-window:]), n) <= max_distinct_fraction
