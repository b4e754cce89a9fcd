"""codebook_report against a brute-force pure-Python reference (Fractions, explicit tie rules),
and the sign-bias property on symmetric heavy-tailed weights."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import FormatError
from tierstore.formats import (
    E2M1_MAGNITUDES,
    W2_LEVELS,
    codebook_report,
    codebook_report_from_histogram,
    quantize_w2,
    summarise_codebook_reports,
)

# nibble n: value and sign bit (nibble 8 is -0)
NIBBLE_VALUES = [Fraction(m) for m in E2M1_MAGNITUDES] + [-Fraction(m) for m in E2M1_MAGNITUDES]
NIBBLE_NEGATIVE = [n >= 8 for n in range(16)]
GRID = sorted(set(NIBBLE_VALUES))


def ref_nearest(value: Fraction, negative: bool, levels) -> Fraction:
    def rank(level):
        wrong_sign = (level > 0 and negative) or (level < 0 and not negative)
        return (abs(value - level), wrong_sign, abs(level))

    return min(levels, key=rank)


def ref_mapping(levels) -> list[Fraction]:
    return [ref_nearest(NIBBLE_VALUES[n], NIBBLE_NEGATIVE[n], levels) for n in range(16)]


ASYM_SETS = list(itertools.combinations(GRID, 4))
ASYM_MAPS = [ref_mapping(s) for s in ASYM_SETS]
SYM_SETS = [(-b, -a, a, b) for a in GRID for b in GRID if 0 < a < b]
SYM_MAPS = [ref_mapping(s) for s in SYM_SETS]


DOUBLED_VALUES = [int(2 * v) for v in NIBBLE_VALUES]


def ref_cost(histogram, mapping) -> int:
    """4 * sum of squared errors, in integers (values and levels are multiples of 1/2)."""
    return sum(h * (int(2 * mapping[n]) - DOUBLED_VALUES[n]) ** 2 for n, h in enumerate(histogram) if h)


def ref_stats(histogram, mapping) -> tuple[float, float]:
    count = sum(histogram)
    bias = sum(h * (mapping[n] - NIBBLE_VALUES[n]) for n, h in enumerate(histogram)) / count
    energy = sum(h * DOUBLED_VALUES[n] ** 2 for n, h in enumerate(histogram))
    error = ref_cost(histogram, mapping)
    rel_rms = math.sqrt(Fraction(error, energy)) if energy else (math.inf if error else 0.0)
    return float(bias), rel_rms


def ref_best(histogram, sets, maps):
    costs = [ref_cost(histogram, m) for m in maps]
    best = costs.index(min(costs))  # first minimum in lexicographic order
    return tuple(float(v) for v in sets[best]), maps[best]


def as_floats(levels) -> tuple[float, ...]:
    return tuple(float(v) for v in levels)


HISTOGRAMS = st.lists(st.integers(0, 50) | st.just(0), min_size=16, max_size=16).filter(lambda h: sum(h) > 0)


@settings(max_examples=30, deadline=None)
@given(histogram=HISTOGRAMS)
def test_report_matches_brute_force(histogram):
    report = codebook_report_from_histogram(torch.tensor(histogram))
    asym_levels, asym_map = ref_best(histogram, ASYM_SETS, ASYM_MAPS)
    sym_levels, _ = ref_best(histogram, SYM_SETS, SYM_MAPS)
    assert report["asym"]["levels"] == asym_levels
    assert report["best_sym_levels"] == sym_levels
    assert report["best_sym_is_default"] == (sym_levels == W2_LEVELS)
    assert report["sym"]["levels"] == W2_LEVELS
    assert (report["sym"]["bias"], report["sym"]["rel_rms"]) == ref_stats(histogram, ref_mapping(
        [Fraction(v) for v in W2_LEVELS]))
    assert (report["asym"]["bias"], report["asym"]["rel_rms"]) == ref_stats(histogram, asym_map)
    assert report["numel"] == sum(histogram) and report["histogram"] == histogram


def test_signed_zeros_split_by_sign_not_first_argmin():
    histogram = [0] * 16
    histogram[0] = histogram[8] = 10  # +0 and -0 only
    report = codebook_report_from_histogram(torch.tensor(histogram))
    assert report["sym"]["bias"] == 0.0
    assert report["sym"]["rel_rms"] == math.inf  # all values zero, error not


def test_report_of_weight_uses_w2_nibbles_and_zero_mode():
    rng = np.random.default_rng(0)
    w = rng.laplace(size=(8, 128))
    w[rng.random(w.shape) < 0.2] = 0.0  # one-signed (+0) zeros
    weight = torch.from_numpy(w)
    q_sign = quantize_w2(weight, zero_mode="sign")
    report_sign = codebook_report(weight, zero_mode="sign")
    assert report_sign["histogram"] == np.bincount(q_sign.nibbles().numpy().ravel(), minlength=16).tolist()
    assert report_sign == codebook_report(q_sign) | {"zero_mode": "sign"}
    report_auto = codebook_report(weight)
    assert report_auto["zero_mode"] == "alt"
    odd_zeros = int(np.sum((w == 0) & (np.arange(128) % 2 == 1)))
    shift = (report_sign["sym"]["bias"] - report_auto["sym"]["bias"]) * w.size
    assert shift == 2 * odd_zeros  # each odd-k zero moves from +1 to -1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("distribution", ["laplace", "student_t3"])
def test_l2_optimal_set_is_sign_biased(seed, distribution):
    rng = np.random.default_rng(seed)
    shape = (256, 1024)
    w = rng.laplace(size=shape) if distribution == "laplace" else rng.standard_t(3, size=shape)
    report = codebook_report(torch.from_numpy(w).float())
    levels = report["asym"]["levels"]
    assert levels != tuple(-v for v in reversed(levels))  # sign-asymmetric
    assert report["best_sym_is_default"]
    assert abs(report["asym"]["bias"]) > 20 * abs(report["sym"]["bias"])
    assert report["asym"]["rel_rms"] <= report["sym"]["rel_rms"]  # it is L2-optimal


def test_summarise():
    reports = [codebook_report(torch.from_numpy(np.random.default_rng(s).laplace(size=(4, 64)))) for s in range(3)]
    summary = summarise_codebook_reports(reports)
    assert summary["tensors"] == 3
    assert summary["mean_abs_bias_sym"] == sum(abs(r["sym"]["bias"]) for r in reports) / 3
    assert summary["mean_abs_bias_asym"] == sum(abs(r["asym"]["bias"]) for r in reports) / 3
    assert summary["mean_rel_rms_asym"] == sum(r["asym"]["rel_rms"] for r in reports) / 3
    assert summary["fraction_default_best_sym"] == sum(r["best_sym_is_default"] for r in reports) / 3
    assert summary["bias_ratio_asym_over_sym"] == summary["mean_abs_bias_asym"] / summary["mean_abs_bias_sym"]
    with pytest.raises(FormatError, match="no codebook reports"):
        summarise_codebook_reports([])


def test_bad_histograms():
    with pytest.raises(FormatError, match="16 non-negative counts"):
        codebook_report_from_histogram(torch.ones(15, dtype=torch.int64))
    with pytest.raises(FormatError, match="16 non-negative counts"):
        codebook_report_from_histogram(torch.tensor([-1] + [1] * 15))
    with pytest.raises(FormatError, match="empty"):
        codebook_report(torch.zeros(0, 32))
