"""Sweeps over capacities and policies, and their table / CSV / JSON output."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from tierstore.sim.simulation import simulate
from tierstore.sim.trace import Trace

COLUMNS = ("policy", "gpu_slots", "coverage", "token_hit_rate", "zero_miss_step_fraction", "misses_mean",
           "misses_p99", "fp4_share", "arena_hit_rate", "tokens_per_s")


def sweep(trace: Trace, policies, capacities, **options) -> list[dict]:
    """One row per (policy, GPU slot count): the KPIs of `simulate` with the same options."""
    rows = []
    for policy in policies:
        for slots in capacities:
            r = simulate(trace, gpu_slots=int(slots), policy=policy, **options)
            misses = r.misses_per_step()
            rows.append({
                "policy": policy, "gpu_slots": int(slots), "coverage": r.params["coverage"],
                "token_hit_rate": r.token_hit_rate, "zero_miss_step_fraction": r.zero_miss_step_fraction,
                "misses_mean": misses["mean"], "misses_p99": misses["p99"],
                "fp4_share": r.fp4_share if options.get("fp4_slots") or options.get("fp4_gb") else None,
                "arena_hit_rate": r.arena_hit_rate if r.params["arena_slots"] is not None else None,
                "tokens_per_s": r.tokens_per_s if r.geometry is not None else None,
            })
    return rows


def write_csv(rows: list[dict], path: str | Path) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def write_json(rows: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps(rows, indent=2) + "\n")


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if value < 10 else f"{value:,.0f}"
    return str(value)


def render_table(rows: list[dict], title: str) -> str:
    """The rows as a rich table (rendered to text); columns that are empty everywhere are left out."""
    from rich.console import Console
    from rich.table import Table

    shown = [c for c in COLUMNS if any(row[c] is not None for row in rows)]
    table = Table(title=title)
    for column in shown:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in rows:
        table.add_row(*(_fmt(row[c]) for c in shown))
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()
