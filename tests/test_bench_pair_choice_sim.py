"""benchmarks/pair_choice_sim.py: measured steps pooled by (previous kind, kind), policies driven over them, the
table against the single-pass run; bad input named."""
import gzip
import json
from pathlib import Path

import pytest
from cuda_fixtures import bench_module


@pytest.fixture(scope="module")
def sim():
    return bench_module("pair_choice_sim")


def per_step(kinds: str, ms_of) -> dict:
    """A run's per-step record: `kinds` P / s, each step's ms `ms_of(previous kind, kind)`."""
    pairs = [k == "P" for k in kinds]
    return {"pairs": [int(p) for p in pairs], "ms": [ms_of(pairs[i - 1] if i else p, p) for i, p in enumerate(pairs)]}


def replay_json(path: Path, ms_of, kinds: str = "PPsPPssPPPsss" * 4, gz: bool = False) -> Path:
    result = {"preset": "toy", "coverage": 0.25, "runs": {
        "tiered": {"cold": {"per_step": per_step(kinds[:6], ms_of)}, "steady": {"per_step": per_step(kinds, ms_of)}},
        "tiered_flipped": {"steady": {"per_step": {"ms": [1.0, 1.0, 1.0]}}}}}
    no_pairs = {"preset": "toy", "coverage": 1.0, "runs": {
        "tiered": {"steady": {"per_step": per_step("sss", ms_of)}},
        "tiered_flipped": {"steady": {"per_step": {"ms": [1.0]}}}}}
    text = json.dumps({"results": [result, no_pairs]})
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


# pairs cheaper after a single pass, singles dearer after a pair; in a steady run the single pass is faster
TRANSITIONS = {(True, True): 1.05, (False, False): 1.0, (False, True): 0.6, (True, False): 1.8}


def test_steps_are_pooled_by_the_kind_before_them(sim, tmp_path):
    path = replay_json(tmp_path / "r.json.gz", lambda prev, kind: TRANSITIONS[prev, kind], gz=True)
    cells, singles = sim.load_cells([str(path)])
    assert list(cells) == [("toy", 0.25)]  # the cell without pairs is left out
    steady = cells["toy", 0.25]["steady"]
    assert {key: set(ms) for key, ms in steady.items()} == {key: {ms} for key, ms in TRANSITIONS.items()}
    assert len(steady[True, True]) == 4 * 4 and len(steady[False, False]) == 3 * 4  # per "PPsPPssPPPsss": 4 and 3
    assert singles == {("toy", 0.25): [1.0, 1.0, 1.0]}


def test_a_policy_that_times_only_steady_steps_picks_the_steady_faster_kind(sim, tmp_path):
    """Timed across switches (the library's choice) pairs look faster and single passes slower than they run in a
    row; a policy sampling only after its own kind runs single passes."""
    cells, singles = sim.load_cells([str(replay_json(tmp_path / "r.json", lambda p, k: TRANSITIONS[p, k]))])
    rows = {r["policy"]: r for r in sim.simulate(cells, singles, seeds=3, cold=6, steady=200)}
    assert rows["median5"]["pairs"] < 40 and rows["mean8"]["pairs"] < 40
    assert rows["library"]["pairs"] > 60
    assert rows["mean8"]["vs_single"] < rows["library"]["vs_single"]
    same = {key: 1.0 if key == (False, False) else 0.7 for key in TRANSITIONS}  # pairs faster in every position
    cells, singles = sim.load_cells([str(replay_json(tmp_path / "p.json", lambda p, k: same[p, k]))])
    rows = {r["policy"]: r for r in sim.simulate(cells, singles, seeds=3, cold=6, steady=200)}
    assert all(r["pairs"] > 170 for r in rows.values()), rows
    assert rows["library"]["vs_single"] == pytest.approx(0.7, abs=0.05)


def test_the_command_prints_the_table_and_names_bad_input(sim, tmp_path, capsys):
    path = replay_json(tmp_path / "r.json", lambda p, k: TRANSITIONS[p, k])
    out = tmp_path / "rows.json"
    assert sim.main([str(path), "--seeds", "2", "--steady", "50", "--cold", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "toy 25%" in printed and "mean over cells" in printed
    assert {row["policy"] for row in json.loads(out.read_text())["rows"]} == set(sim.POLICIES)
    with pytest.raises(SystemExit):
        sim.main([str(tmp_path / "absent.json")])
    assert "no such replay JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"results": []}))
    with pytest.raises(SystemExit):
        sim.main([str(empty)])
    assert "no cell with pairs" in capsys.readouterr().err
