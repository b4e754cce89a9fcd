"""benchmarks/moe_kernels.py on CPU: each variant and check is isolated, failures are recorded in the JSON
(written after every stage), a CUDA error stops later GPU variants, a failed check marks its rows invalid.
The timing and check functions are replaced by fakes; the pools are real (tiny geometry, CPU)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tierstore.geometry import _preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def kb(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_kernels_isolation", ROOT / "benchmarks" / "moe_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "get_preset", lambda name: _preset("tiny", 1, 8, 2, 512, 512))
    monkeypatch.setattr(mod, "_provenance", lambda commit: dict(commit=commit))
    mod.calls = []

    def fused(geo, w2, f4, routings, reps, stage="all", config=(64, 4), **ws_kw):
        assert stage in mod.STAGES
        mod.calls.append(dict(stage=stage, fp4=bool((f4.table[0] >= 0).any()), **ws_kw))
        return 10.0 + (ws_kw.get("block_tokens") or 0)

    monkeypatch.setattr(mod, "_fused_case", fused)
    monkeypatch.setattr(mod, "_bf16_case", lambda *a: 100.0)
    monkeypatch.setattr(mod, "_dequant_case", lambda *a: 200.0)
    monkeypatch.setattr(mod, "_stream_us", lambda nbytes, copies, reps, device="cuda": 5.0)

    def default_check(geo, w2, f4, tier, tokens, gen, device):
        return dict(rel_err=6e-3, nan=False, repeat_identical=True), dict(tier=tier, tokens=tokens)

    monkeypatch.setattr(mod, "_default_check", default_check)
    monkeypatch.setattr(mod, "_fp4_mode_check", lambda geo, w2, f4, inp, mode, device: {
        f"fp4_{mode}_rel_err": 2e-3, f"fp4_{mode}_nan": False, f"fp4_{mode}_repeat_identical": True,
        "out": torch.zeros(2)})
    monkeypatch.setattr(mod, "_candidate_check", lambda geo, w2, f4, inp, options, device: dict(
        rel_err=6e-3, nan=False, repeat_identical=True, equals_default=True))
    return mod


def _main(kb, tmp_path, tokens="1,8"):
    path = tmp_path / "out.json"
    code = kb.main(["--tokens", tokens, "--json", str(path), "--device", "cpu", "--reps", "1"])
    return code, json.loads(path.read_text())


def _rows(result):
    return {(r["tokens"], r["variant"]): r for r in result["cases"]}


def test_all_variants_measured_when_nothing_fails(kb, tmp_path):
    code, result = _main(kb, tmp_path)
    assert code == 0 and result["status"] == "complete" and result["errors"] == []
    rows = _rows(result)
    # T = 1 and 8 with top-2 over 8 experts: BT = 1 by default at both (2 and 16 pairs <= 4 per expert); T = 1 runs
    # every variant but the forced one-pair-per-program ones (the default there already)
    assert {v for t, v in rows if t == 1} == set(kb.BASELINE_VARIANTS + kb.NEW_VARIANTS) - {"w2_fused_bt1",
                                                                                           "fp4_fused_bt1"}
    assert all(r["us"] is not None and "error" not in r and "invalid" not in r for r in rows.values())
    assert rows[(1, "w2_fused")]["stream_us"] == 5.0 and rows[(1, "w2_down")]["stream_us"] == 5.0
    assert rows[(1, "w2_down")]["bytes"] < rows[(1, "w2_fused")]["bytes"]
    assert rows[(1, "w2_route_combine")]["bytes"] == 0 and "gb_per_s" not in rows[(1, "w2_route_combine")]
    assert rows[(1, "w2_fused_down64w8")]["bytes"] == rows[(1, "w2_fused")]["bytes"]
    assert rows[(1, "fp4_fused_down64w8")]["bytes"] == rows[(1, "fp4_fused")]["bytes"]
    assert rows[(1, "w2_fused")]["speedup_vs_bf16"] == pytest.approx(10.0)
    # baselines of every T are timed before any new variant; FP4 variants run with the FP4 pool resident
    order = [(r["tokens"], r["variant"]) for r in result["cases"]]
    last_baseline = max(i for i, (t, v) in enumerate(order) if v in kb.BASELINE_VARIANTS)
    assert kb.NEW_VARIANTS and all(i > last_baseline for i, (t, v) in enumerate(order) if v in kb.NEW_VARIANTS)
    assert [(c["stage"], c["fp4"], c["down_block_n"], c["down_num_warps"]) for c in kb.calls if "down_block_n" in c
            ] == [("all", False, 64, 8), ("all", True, 64, 8)]
    stages = {(c["stage"], c["fp4"]) for c in kb.calls}
    assert stages == {("all", False), ("gate_up", False), ("down", False), ("route_combine", False), ("all", True),
                      ("gate_up", True)}
    fp4_row = result["checks"][2]
    assert fp4_row["fp4_off_rel_err"] == 2e-3 and fp4_row["fp4_triton_equals_off"] is True
    assert result["checks"][0]["down64w8_equals_default"] is True and "down64w8_rel_err" in fp4_row


def test_a_failing_variant_is_recorded_and_the_rest_still_run(kb, tmp_path, monkeypatch):
    fused = kb._fused_case

    def failing(*a, ptx_w2=True, **kw):
        if not ptx_w2:
            raise RuntimeError("PTXAS error: Internal Triton PTX codegen error\nptxas fatal: bad operand")
        return fused(*a, ptx_w2=ptx_w2, **kw)

    monkeypatch.setattr(kb, "_fused_case", failing)
    code, result = _main(kb, tmp_path)
    rows = _rows(result)
    for name in ("w2_fused_plain", "w2_gate_up_plain"):
        err = rows[(1, name)]["error"]
        assert rows[(1, name)]["us"] is None and err["type"] == "RuntimeError"
        assert err["message"].startswith("PTXAS error") and any("PTXAS" in line for line in err["traceback"])
    assert all(r["us"] is not None for k, r in rows.items() if not k[1].endswith("_plain"))
    assert code == 0 and result["status"].startswith("complete, 2 failure")
    assert [e["label"] for e in result["errors"]] == ["T=1 w2_fused_plain", "T=1 w2_gate_up_plain"]


def test_a_cuda_error_stops_later_gpu_variants_but_keeps_the_json(kb, tmp_path, monkeypatch):
    fused = kb._fused_case

    def crashing(*a, block_tokens=None, **kw):
        if block_tokens == 16:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return fused(*a, block_tokens=block_tokens, **kw)

    monkeypatch.setattr(kb, "_fused_case", crashing)
    code, result = _main(kb, tmp_path, tokens="1,2")
    order = [r["variant"] for r in result["cases"] if r["tokens"] == 1]
    crash = order.index("w2_fused_mma16")
    cases = result["cases"]
    assert all(r["us"] is not None for r in cases[:crash])  # measured before the crash
    assert cases[crash]["error"]["cuda_context_lost"] is True
    assert len(cases) > crash + 1 and all(r["error"]["type"] == "Skipped" and r["error"]["skipped"]
                                          for r in cases[crash + 1:])
    assert {r["tokens"] for r in cases} == {1}  # T=2's routings (GPU work) were skipped too
    assert result["status"].startswith("stopped early: T=1 w2_fused_mma16 raised a CUDA error")
    assert len(result["errors"]) == 1 and code == 0


def test_a_check_that_leaves_the_context_broken_poisons_too(kb, tmp_path, monkeypatch):
    def probe():
        raise RuntimeError("context gone")

    monkeypatch.setattr(kb, "_cuda_probe", probe)
    runner = kb.Runner(probe=kb._cuda_probe)
    assert runner.attempt("x", lambda: 1 / 0)[1]["type"] == "ZeroDivisionError"
    assert runner.poisoned.startswith("x left the CUDA context unusable")
    assert runner.attempt("y", lambda: 1)[1]["skipped"] is True
    assert runner.attempt("host", lambda: 2, gpu=False) == (2, None)


def test_failed_checks_mark_their_timing_rows_invalid(kb, tmp_path, monkeypatch):
    def fp4_check(geo, w2, f4, inp, mode, device):
        if mode == "off":
            raise ValueError("asm operand mismatch")
        return {f"fp4_{mode}_rel_err": 4e-3, "out": torch.zeros(2)}

    monkeypatch.setattr(kb, "_fp4_mode_check", fp4_check)
    default = kb._default_check
    monkeypatch.setattr(kb, "_default_check", lambda geo, w2, f4, tier, tokens, gen, device: (
        (dict(rel_err=float("nan"), nan=True, repeat_identical=True), dict(tier=tier, tokens=tokens))
        if tier == "fp4" and tokens == 8 else
        (dict(rel_err=6e-3, nan=False, repeat_identical=False), dict(tier=tier, tokens=tokens))
        if tier == "w2" and tokens == 1 else default(geo, w2, f4, tier, tokens, gen, device)))
    code, result = _main(kb, tmp_path, tokens="1")
    rows = _rows(result)
    for name in ("w2_fused", "w2_gate_up", "w2_down", "w2_route_combine", "fp4_fused", "fp4_gate_up"):
        row = rows[(1, name)]
        assert row["us"] is None and row["invalid_us"] > 0 and row["invalid"], name
        assert "gb_per_s" not in row and "speedup_vs_bf16" not in row
    assert any("repeat run not bit-identical" in why for why in rows[(1, "w2_down")]["invalid"])
    assert any("NaN" in why for why in rows[(1, "fp4_fused")]["invalid"])
    for name in ("w2_fused_plain", "w2_fused_mma16", "bf16_grouped_mm", "dequant_grouped_mm"):
        assert rows[(1, name)]["us"] is not None and "invalid" not in rows[(1, name)], name
    assert set(result["invalid_checks"]) == {"w2_default", "fp4_default"}
    assert "fp4_off_error" in result["checks"][2] and "fp4_triton_equals_off" not in result["checks"][2]


def test_candidates_are_invalid_only_by_their_own_checks(kb, tmp_path, monkeypatch):
    """A designed-exact candidate whose bytes differ from the default's is invalid (W2 and FP4 rows); the
    defaults stay valid."""
    monkeypatch.setattr(kb, "_candidate_check", lambda geo, w2, f4, inp, options, device: dict(
        rel_err=6e-3, nan=False, repeat_identical=True, equals_default=inp["tier"] == "w2"))
    code, result = _main(kb, tmp_path, tokens="1")
    rows = _rows(result)
    assert rows[(1, "fp4_fused_down64w8")]["us"] is None
    assert any("down64w8_equals_default is False" in why for why in rows[(1, "fp4_fused_down64w8")]["invalid"])
    for name in ("w2_fused_down64w8", "w2_fused", "fp4_fused"):
        assert rows[(1, name)]["us"] is not None and "invalid" not in rows[(1, name)], name
    assert set(result["invalid_checks"]) == {"fp4_down64w8"}


def test_skip_leaves_variants_untimed(kb, tmp_path):
    path = tmp_path / "out.json"
    assert kb.main(["--tokens", "1", "--json", str(path), "--device", "cpu", "--skip", "w2_fused_mma16,dequant_grouped_mm"]) == 0
    result = json.loads(path.read_text())
    variants = {r["variant"] for r in result["cases"]}
    assert not variants & {"w2_fused_mma16", "dequant_grouped_mm"} and "w2_fused_plain" in variants
    assert result["skipped_variants"] == ["w2_fused_mma16", "dequant_grouped_mm"]


def test_json_is_written_after_each_stage_and_on_sigterm(kb, tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    seen = []
    write = kb._write_json
    monkeypatch.setattr(kb, "_write_json", lambda p, r: (write(p, r), seen.append(len(r["cases"]))))
    fused = kb._fused_case

    def killed(*a, block_tokens=None, **kw):
        if block_tokens == 16:
            kb._on_sigterm(15, None)
        return fused(*a, block_tokens=block_tokens, **kw)

    monkeypatch.setattr(kb, "_fused_case", killed)
    code = kb.main(["--tokens", "1,8", "--json", str(path), "--device", "cpu"])
    result = json.loads(path.read_text())
    assert code == 124
    assert result["status"].startswith("terminated by SIGTERM (running: current kernels and baselines, T=1)")
    # after: the checks, then main's final write with the rows measured before the kill
    assert seen == [0, len(result["cases"])]
    order = [r["variant"] for r in result["cases"]]
    assert order == list(kb.BASELINE_VARIANTS[: kb.BASELINE_VARIANTS.index("w2_fused_mma16")])
    assert not path.with_name("out.json.tmp").exists()


def test_cuda_error_classification(kb):
    import torch
    assert kb._is_cuda_error(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    assert kb._is_cuda_error(RuntimeError("CUDA error: misaligned address"))
    assert not kb._is_cuda_error(RuntimeError("PTXAS error: Internal Triton PTX codegen error"))
    assert not kb._is_cuda_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not kb._is_cuda_error(ValueError("bad shape"))
