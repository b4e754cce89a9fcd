"""PNG plots of a sweep: hit rate and zero-miss-step fraction against coverage, one line per policy."""

from __future__ import annotations

from pathlib import Path


def plot_sweep(rows: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    for policy in policies:
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["coverage"])
        x = [100 * r["coverage"] for r in mine]
        style = {"linestyle": "--", "color": "black"} if policy == "belady" else {"marker": "o"}
        label = "belady (bound)" if policy == "belady" else policy
        axes[0].plot(x, [100 * r["token_hit_rate"] for r in mine], label=label, **style)
        axes[1].plot(x, [100 * r["zero_miss_step_fraction"] for r in mine], label=label, **style)
    for ax, ylabel in zip(axes, ("token hit rate (%)", "steps with zero misses (%)")):
        ax.set_xlabel("GPU pool coverage (% of routed experts)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 100)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
