"""Codebook experiments: the fixed symmetric 4-level set vs the L2-optimal one, per tensor.

Everything is a function of the tensor's 16-bin histogram of W2 nibbles (the FP4 tier, same
block exponents and zero mode as `quantize_w2`), in e2m1 unit space: a weight's value is its
e2m1 nibble value, its reconstruction the level that nibble maps to. Errors are
reconstruction - value. Values and levels lie on a 0.5 grid, so every sum is an exact integer
count of quarter units; only the final ratios are floats.
"""

from __future__ import annotations

import itertools
import math

import torch

from tierstore.errors import FormatError
from tierstore.formats.fp_codecs import E2M1_MAGNITUDES, e2m1_table
from tierstore.formats.w2 import W2_LEVELS, W2Tensor, quantize_w2

NUM_NIBBLES = 16
GRID_VALUES = tuple(sorted({-m for m in E2M1_MAGNITUDES} | set(E2M1_MAGNITUDES)))
"""The 15 distinct signed e2m1 values (+0 and -0 merged), ascending."""

ASYM_CANDIDATES = tuple(itertools.combinations(GRID_VALUES, 4))
"""All C(15, 4) = 1365 four-level sets, in lexicographic order (the first minimum wins ties)."""

SYM_CANDIDATES = tuple(
    (-b, -a, a, b) for a, b in itertools.combinations(E2M1_MAGNITUDES[1:], 2)
)
"""The 21 sets {-b, -a, a, b}, 0 < a < b on the grid, ordered by (a, b) (the first minimum wins)."""


def nibble_histogram(nibbles: torch.Tensor) -> torch.Tensor:
    """int64 [16]: how many of the uint8 nibbles take each value 0..15."""
    return torch.bincount(nibbles.reshape(-1).long(), minlength=NUM_NIBBLES).cpu()


def assign_levels(levels: torch.Tensor) -> torch.Tensor:
    """float64 [S, 16]: the level each nibble maps to, for each candidate set in `levels` [S, L].

    Nearest level; ties prefer the level whose sign matches the nibble's sign bit (a zero level
    matches both), then the smaller magnitude. So +0 and -0 never both go to one signed level.
    """
    values = e2m1_table()  # [16]
    negative_nibble = torch.arange(NUM_NIBBLES) >= 8  # [16]
    candidate = levels[:, None, :]  # [S, 1, L]
    distance = (values[None, :, None] - candidate).abs()  # [S, 16, L]
    sign_mismatch = torch.where(negative_nibble[None, :, None], candidate > 0, candidate < 0)  # [S, 16, L]
    # distance and |level| are multiples of 0.5 below 16, so this integer key orders
    # (distance, sign mismatch, |level|) lexicographically and has no ties.
    key = (4 * distance) * 1000 + sign_mismatch.to(torch.float64) * 100 + 4 * candidate.abs()
    choice = key.argmin(dim=2, keepdim=True)  # [S, 16, 1]
    return torch.gather(candidate.expand_as(distance), 2, choice)[..., 0]  # [S, 16]


def _squared_error_quarters(histogram: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """int64 [S]: sum over weights of (2 * error)^2 for each candidate set [S, L]."""
    doubled_error = (2 * (assign_levels(levels) - e2m1_table())).to(torch.int64)  # [S, 16]
    return (doubled_error**2) @ histogram


def _best(histogram: torch.Tensor, candidates: tuple[tuple[float, ...], ...]) -> tuple[float, ...]:
    cost = _squared_error_quarters(histogram, torch.tensor(candidates, dtype=torch.float64))
    return candidates[int(cost.argmin())]


def _stats(histogram: torch.Tensor, levels: tuple[float, ...]) -> dict:
    doubled_error = (2 * (assign_levels(torch.tensor([levels], dtype=torch.float64))[0] - e2m1_table()))
    doubled_error = doubled_error.to(torch.int64)  # [16]
    doubled_value = (2 * e2m1_table()).to(torch.int64)  # [16]
    count = int(histogram.sum())
    error_sum = int(doubled_error @ histogram)  # 2 * sum(error)
    error_square = int(doubled_error**2 @ histogram)  # 4 * sum(error^2)
    value_square = int(doubled_value**2 @ histogram)  # 4 * sum(value^2)
    if value_square:
        rel_rms = math.sqrt(error_square / value_square)
    else:
        rel_rms = math.inf if error_square else 0.0
    return {"levels": tuple(levels), "bias": error_sum / (2 * count), "rel_rms": rel_rms,
            "mse": error_square / (4 * count)}


def codebook_report_from_histogram(histogram: torch.Tensor) -> dict:
    """The report of `codebook_report` from a 16-bin nibble histogram (int64 [16])."""
    histogram = torch.as_tensor(histogram, dtype=torch.int64).cpu()
    if tuple(histogram.shape) != (NUM_NIBBLES,) or bool((histogram < 0).any()):
        raise FormatError(f"histogram must be 16 non-negative counts, got shape {tuple(histogram.shape)}")
    if int(histogram.sum()) == 0:
        raise FormatError("codebook report of an empty tensor")
    best_sym = _best(histogram, SYM_CANDIDATES)
    return {
        "numel": int(histogram.sum()),
        "histogram": histogram.tolist(),
        "sym": _stats(histogram, W2_LEVELS),
        "asym": _stats(histogram, _best(histogram, ASYM_CANDIDATES)),
        "best_sym": _stats(histogram, best_sym),
        "best_sym_levels": best_sym,
        "best_sym_is_default": best_sym == W2_LEVELS,
    }


def codebook_report(weight: torch.Tensor | W2Tensor, *, zero_mode: str = "auto") -> dict:
    """Per-tensor codebook report: fixed {-4, -1, 1, 4} (`sym`) vs the L2-optimal grid set (`asym`).

    `weight` is a float [N, K] tensor (quantized with `quantize_w2(weight, zero_mode=zero_mode)`)
    or an existing W2Tensor. `asym` is the exact minimiser of the squared error over all 1365
    four-level subsets of the 15 grid values; `best_sym_levels` the best {-b, -a, a, b}. Each of
    `sym`, `asym`, `best_sym` holds `levels`, `bias` (mean signed error, unit space), `rel_rms`
    (RMS error / RMS of the FP4 unit values) and `mse`. Also: `numel`, `histogram`, `zero_mode`,
    `best_sym_is_default`.
    """
    w2 = weight if isinstance(weight, W2Tensor) else quantize_w2(weight, zero_mode=zero_mode)
    report = codebook_report_from_histogram(nibble_histogram(w2.nibbles()))
    report["zero_mode"] = w2.zero_mode
    return report


def summarise_codebook_reports(reports: list[dict]) -> dict:
    """Aggregate per-tensor reports: mean |bias| and mean rel_rms of sym vs asym, their ratios,
    and the fraction of tensors whose best symmetric set is {-4, -1, 1, 4}."""
    if not reports:
        raise FormatError("no codebook reports to summarise")
    count = len(reports)
    mean_abs_bias_sym = sum(abs(r["sym"]["bias"]) for r in reports) / count
    mean_abs_bias_asym = sum(abs(r["asym"]["bias"]) for r in reports) / count
    mean_rel_rms_sym = sum(r["sym"]["rel_rms"] for r in reports) / count
    mean_rel_rms_asym = sum(r["asym"]["rel_rms"] for r in reports) / count
    return {
        "tensors": count,
        "mean_abs_bias_sym": mean_abs_bias_sym,
        "mean_abs_bias_asym": mean_abs_bias_asym,
        "bias_ratio_asym_over_sym": mean_abs_bias_asym / mean_abs_bias_sym if mean_abs_bias_sym else math.inf,
        "mean_rel_rms_sym": mean_rel_rms_sym,
        "mean_rel_rms_asym": mean_rel_rms_asym,
        "rel_rms_ratio_sym_over_asym": mean_rel_rms_sym / mean_rel_rms_asym if mean_rel_rms_asym else math.inf,
        "fraction_default_best_sym": sum(r["best_sym_is_default"] for r in reports) / count,
    }
