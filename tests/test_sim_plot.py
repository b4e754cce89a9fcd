"""The sweep plot: a real PNG whose lines are the sweep's own numbers."""

import pytest

from tierstore.sim import load_trace, plot_sweep, sweep

GOLDEN = "tests/golden/trace.npz"


def test_plot_sweep_writes_a_png_with_one_line_per_policy(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep(load_trace(GOLDEN), ["lru", "belady"], [8, 16, 32])
    drawn = []
    original_savefig = plt.Figure.savefig

    def capture(fig, *args, **kwargs):
        drawn.extend(fig.axes)
        return original_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", capture)
    path = plot_sweep(rows, tmp_path / "sweep.png", title="golden trace")

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    hit_axis, zero_miss_axis = drawn
    assert [line.get_label() for line in hit_axis.get_lines()] == ["lru", "belady (bound)"]
    lru_rows = [r for r in rows if r["policy"] == "lru"]
    lru_line = hit_axis.get_lines()[0]
    assert list(lru_line.get_xdata()) == pytest.approx([100 * r["coverage"] for r in lru_rows])
    assert list(lru_line.get_ydata()) == pytest.approx([100 * r["token_hit_rate"] for r in lru_rows])
    belady_zero_miss = zero_miss_axis.get_lines()[1].get_ydata()
    assert list(belady_zero_miss) == pytest.approx(
        [100 * r["zero_miss_step_fraction"] for r in rows if r["policy"] == "belady"])
