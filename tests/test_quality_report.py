"""docs/quality.md's generated tables are what benchmarks/quality/report.py renders from the committed results."""

from __future__ import annotations

from pathlib import Path

import pytest
from quality_fixtures import ROOT

from benchmarks.quality import report

PAGE = ROOT / "docs" / "quality.md"

pytestmark = pytest.mark.skipif(not report.QUALITY.exists(), reason="no committed quality.json")


def test_the_page_block_is_the_rendered_report():
    page = PAGE.read_text(encoding="utf-8")
    block = report.render(*report.load())
    assert block in page, "docs/quality.md is stale: run python -m benchmarks.quality.report --write docs/quality.md"


def test_committed_results_hold_the_invariants_the_page_states():
    quality, training, manifest = report.load()
    for section in ("heldout_decode", "generation"):
        rows = quality[section]
        for gated in ("w2_sym+gate1.00", "w2_sym+pool0.25+gate1.00"):  # every step fires: the FP4 tier exactly
            assert rows[gated]["fire_rate"] == 1.0
            assert {k: rows[gated][k] for k in ("nll", "agreement", "kl")} == \
                {k: rows["fp4_tier"][k] for k in ("nll", "agreement", "kl")}
    assert training["selected"]["validation_loss"] == min(v["validation_loss"] for v in training["validation"])
    assert sum(s["files"] for s in manifest["splits"].values()) == len(manifest["files"])


def test_replace_block_keeps_the_rest_of_the_page(tmp_path: Path):
    page = f"intro\n{report.BEGIN}\nold\n{report.END}\noutro\n"
    assert report.replace_block(page, f"{report.BEGIN}\nnew\n{report.END}\n") == \
        f"intro\n{report.BEGIN}\nnew\n{report.END}\noutro\n"
    with pytest.raises(ValueError):
        report.replace_block("no markers\n", "x")
