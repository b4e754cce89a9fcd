"""Planner decisions and the `tierstore plan` / `tierstore sim` commands."""

import json

import pytest

from tierstore.cli import main
from tierstore.errors import CapacityError
from tierstore.geometry import get_preset
from tierstore.sim import save_trace, synthetic_for
from tierstore.sim.planner import plan


def test_resident_when_the_base_fits():
    p = plan(get_preset("olmoe-1b-7b"), gpu_gb=80, ram_gb=64)
    assert p.verdict == "resident" and p.gpu_pool_slots == 16 * 64 and p.arena_gib == 0 and p.disk_gib == 0
    assert p.fp4_pool_slots == 16 * 64  # plenty of room: the whole FP4 store too


def test_working_set_factors():
    g = get_preset("deepseek-v3")
    ws_bytes = 58 * 8 * g.w2_expert_bytes / 2**30
    assert plan(g, gpu_gb=4 + 1.10 * ws_bytes, ram_gb=512).verdict == "refused"
    assert plan(g, gpu_gb=4 + 1.30 * ws_bytes, ram_gb=512).verdict == "tight"
    assert plan(g, gpu_gb=4 + 1.50 * ws_bytes, ram_gb=512).verdict == "comfortable"
    small_ram = plan(g, gpu_gb=80, ram_gb=64)
    assert small_ram.arena_slots == int(56 * 2**30 // g.w2_expert_bytes)
    assert plan(g, gpu_gb=80, ram_gb=512, disk_gb=10).verdict == "refused"
    with pytest.raises(CapacityError):
        plan(g, gpu_gb=0, ram_gb=10)


def test_plan_command_with_trace(tmp_path, capsys):
    path = save_trace(synthetic_for(get_preset("ds-v2-lite"), 200, seed=1), tmp_path / "t.npz")
    assert main(["plan", "--preset", "ds-v2-lite", "--gpu-gb", "6", "--ram-gb", "32", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: comfortable" in out and "replay rate" in out
    assert main(["plan", "--preset", "kimi-k2", "--gpu-gb", "8", "--ram-gb", "32"]) == 1
    assert "refused" in capsys.readouterr().out


def test_plan_from_config_json(tmp_path, capsys):
    cfg = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "hidden_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(tmp_path / "config.json"), "--gpu-gb", "8", "--ram-gb", "16"]) == 0
    assert "3 MoE layers x 16 experts, top-2" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["plan", "--config", str(tmp_path / "bad.json"), "--gpu-gb", "8", "--ram-gb", "16"]) == 2


def test_sim_command_sweep_outputs(tmp_path, capsys):
    path = save_trace(synthetic_for(get_preset("olmoe-1b-7b"), 100, seed=2), tmp_path / "t.npz")
    rc = main(["sim", str(path), "--gpu-slots", "100,300", "--policy", "lru,belady",
               "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")])
    assert rc == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(r["policy"], r["gpu_slots"]) for r in rows] == [("lru", 100), ("lru", 300), ("belady", 100), ("belady", 300)]
    assert rows[2]["token_hit_rate"] >= rows[0]["token_hit_rate"]
    assert "token_hit_rate" in capsys.readouterr().out
    assert (tmp_path / "r.csv").read_text().startswith("policy,gpu_slots")
    assert main(["sim", str(path), "--gpu-slots", "10", "--policy", "nope"]) == 2
    assert main(["sim"]) == 2
