"""Issue 5 §1 Observability: with `kpi_every=2` the runtime logs its KPI line after steps 2, 4, 6 and
after no other step, and the line carries what `stats()` reports over the last 2 steps."""

import logging
import re

from test_runtime_fixtures import ToyMoE, memory_source, toy_geometry
from test_runtime_reliability import hostile_tokens

from tierstore.runtime import RuntimeConfig, TieredRuntime


def test_kpi_line_is_logged_every_second_step_with_the_stats_fields(caplog):
    """After each of 7 steps over a 25% pool: a KPI record exactly when the step count is even, equal to
    `kpi_line(2)`, and naming stats()'s replay rate, steps, pool, fetched rows and arena hit share."""
    g = toy_geometry(layers=3, experts=16)
    model = ToyMoE(g, seed=7)
    runtime = TieredRuntime(g, memory_source(g, seed=1), pool_slots=12, arena_slots=16,
                            config=RuntimeConfig(kpi_every=2))
    logged = {}
    with runtime, caplog.at_level(logging.INFO, logger="tierstore.runtime"):
        for step in range(1, 8):
            caplog.clear()
            x = hostile_tokens(g, step, 1)  # [1, H]
            runtime.step(lambda: model.forward(runtime, x), lambda: None)
            lines = [r.getMessage() for r in caplog.records if "KPI" in r.getMessage()]
            logged[step] = lines
            if step % 2:
                continue
            stats = runtime.stats()
            assert lines == [runtime.kpi_line(2)]
            line = lines[0]
            assert re.search(r"replay \d+\.\d% of last 2 steps \(avg \d+\.\d\d missing pairs/step;", line)
            assert f"cumulative {100 * stats.replay_rate:.1f}% of {step})" in line
            assert f"pool {stats.pool_slots} slots = {100 * stats.pool_coverage:.1f}% of experts" in line
            assert f"fetch {stats.fetched_rows} rows {stats.fetched_bytes / 2**20:.1f} MiB" in line
            assert re.search(r"copies at \d+\.\d\d GB/s \| step p50 \d+\.\d\d ms p99 \d+\.\d\d ms", line)
            assert f"arena hits {100 * stats.arena_hit_share:.1f}%" in line
            assert stats.steps == step and stats.fetched_rows > 0  # the lines describe a run that fetched
    assert [step for step, lines in logged.items() if lines] == [2, 4, 6]
