"""Trace format, recorder, importers and synthetic generators."""

import json

import numpy as np
import pytest

from tierstore.errors import TraceFormatError
from tierstore.sim import TraceRecorder, load_trace, save_trace, synthetic_trace
from tierstore.sim.steps import group_steps
from tierstore.sim.trace import Trace


def test_npz_roundtrip_keeps_every_array(tmp_path):
    t = synthetic_trace(50, 3, 8, 2, seed=1, tokens_per_request=20, geometry="olmoe-1b-7b")
    t.weights = np.random.default_rng(0).random(t.experts.shape).astype(np.float32)
    t.confidence = np.linspace(0, 1, 50).astype(np.float32)
    back = load_trace(save_trace(t, tmp_path / "t.npz"))
    assert np.array_equal(back.experts, t.experts) and np.array_equal(back.request, t.request)
    assert np.allclose(back.weights, t.weights) and np.allclose(back.confidence, t.confidence)
    assert back.meta["geometry"] == "olmoe-1b-7b" and back.num_experts == 8


def test_bad_npz_rejected(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, experts=np.zeros((2, 1, 1), np.int32), meta=np.array(json.dumps({"format": "other"})))
    with pytest.raises(TraceFormatError, match="meta.format"):
        load_trace(bad)
    np.savez(bad, experts=np.full((2, 1, 1), 9, np.int32),
             meta=np.array(json.dumps({"format": "tierstore-trace-v1", "num_experts": 4})))
    with pytest.raises(TraceFormatError, match="expert ids"):
        load_trace(bad)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceFormatError, match="npz"):
        load_trace(tmp_path / "junk.npz")
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_trace(tmp_path / "missing.npz")


def test_recorder_steps_requests_and_shape_check():
    rec = TraceRecorder(num_layers=2, top_k=2, num_experts=4, geometry="x")
    rec.record_step([[0, 1], [2, 3]], confidence=[0.9])
    rec.record_step([[[1, 2], [3, 0]], [[0, 3], [1, 2]]], confidence=[0.5, 0.4])
    rec.new_request()
    rec.record_step([[3, 2], [1, 0]], confidence=[0.7])
    t = rec.trace()
    assert t.num_tokens == 4 and list(t.step) == [0, 1, 1, 2] and list(t.request) == [0, 0, 0, 1]
    assert t.meta["geometry"] == "x"
    steps = group_steps(t, "recorded")
    assert steps.num_steps == 3 and list(steps.tokens_per_step) == [1, 2, 1]
    with pytest.raises(TraceFormatError, match="shape"):
        rec.record_step([[0, 1, 2], [0, 1, 2]])


CSV = '''Layer ID,Batch Number,Token,Activated Expert IDs
1,0,<s>,"[3, 1]"
1,0,hi,"[0, 2]"
1,0,",","[1, 2]"
2,0,<s>,"[4, 0]"
2,0,hi,"[1, 3]"
2,0,",","[2, 4]"
'''


def test_csv_import_shifts_one_based_layers(tmp_path):
    (tmp_path / "p1.csv").write_text(CSV)
    t = load_trace(tmp_path / "p1.csv")
    assert t.experts.shape == (3, 2, 2) and t.num_experts == 5
    assert t.experts[2].tolist() == [[1, 2], [2, 4]]


def test_directory_of_files_becomes_consecutive_requests(tmp_path):
    (tmp_path / "a.csv").write_text(CSV)
    (tmp_path / "b.csv").write_text(CSV.replace('"[4, 0]"', '"[5, 0]"'))
    t = load_trace(tmp_path)
    assert t.num_tokens == 6 and list(t.request) == [0, 0, 0, 1, 1, 1] and t.num_experts == 6
    g = load_trace(str(tmp_path / "*.csv"))
    assert np.array_equal(g.experts, t.experts)


def test_csv_errors_name_the_line(tmp_path):
    (tmp_path / "h.csv").write_text("a,b\n")
    with pytest.raises(TraceFormatError, match="header"):
        load_trace(tmp_path / "h.csv")
    (tmp_path / "l.csv").write_text(CSV.replace('"[0, 2]"', '"0, 2"'))
    with pytest.raises(TraceFormatError, match="l.csv:3"):
        load_trace(tmp_path / "l.csv")


def test_jsonl_import_both_key_spellings_and_repeated_positions(tmp_path):
    rows = [
        {"layer": 0, "token_pos": 0, "experts": [1, 2], "gating_probs": [0.6, 0.4]},
        {"layer": 1, "token_pos": 0, "experts": [0, 3], "gating_probs": [0.5, 0.5]},
        {"layer": 0, "token_pos": 0, "experts": [3, 2], "gating_probs": [0.7, 0.3]},  # next decode token
        {"layer": 1, "token_pos": 0, "experts": [1, 0], "gating_probs": [0.9, 0.1]},
    ]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    t = load_trace(tmp_path / "r.jsonl")
    assert t.experts.tolist() == [[[1, 2], [0, 3]], [[3, 2], [1, 0]]]
    assert np.allclose(t.weights[1, 0], [0.7, 0.3])
    other = [{"type": "route", "req_id": "a", "token_idx": i, "layer": 0, "topk_ids": [i % 3], "topk_weights": [1.0]}
             for i in range(3)]
    (tmp_path / "o.jsonl").write_text("\n".join(json.dumps(r) for r in other))
    assert load_trace(tmp_path / "o.jsonl").experts[:, 0, 0].tolist() == [0, 1, 2]


def test_jsonl_errors(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"layer": 0, "experts": [1]}\n')
    with pytest.raises(TraceFormatError, match="token_idx, token_pos"):
        load_trace(tmp_path / "x.jsonl")
    (tmp_path / "y.jsonl").write_text("{oops\n")
    with pytest.raises(TraceFormatError, match="y.jsonl:1: not JSON"):
        load_trace(tmp_path / "y.jsonl")


def test_synthetic_is_seeded_distinct_and_skewed():
    a = synthetic_trace(400, 4, 32, 4, skew=1.2, seed=7)
    assert np.array_equal(a.experts, synthetic_trace(400, 4, 32, 4, skew=1.2, seed=7).experts)
    assert not np.array_equal(a.experts, synthetic_trace(400, 4, 32, 4, skew=1.2, seed=8).experts)
    s = np.sort(a.experts, axis=2)
    assert np.all(s[:, :, 1:] != s[:, :, :-1])  # top-k distinct per layer
    counts = np.sort(np.bincount(a.experts[:, 0].ravel(), minlength=32))[::-1]
    assert counts[:4].sum() > 3 * counts[-4:].sum()  # Zipf: the hot head dominates the tail


def test_synthetic_locality_repeats_previous_token():
    loose = synthetic_trace(2000, 2, 64, 2, locality=0.0, seed=1)
    sticky = synthetic_trace(2000, 2, 64, 2, locality=0.8, seed=1)

    def repeats(t):
        return np.mean(np.all(t.experts[1:] == t.experts[:-1], axis=2))

    assert repeats(sticky) > 0.7 > 0.2 > repeats(loose)


def test_trace_validation_messages():
    with pytest.raises(TraceFormatError, match="integer array"):
        Trace(experts=np.zeros((2, 2), np.int32), num_experts=4)
    with pytest.raises(TraceFormatError, match="non-decreasing"):
        Trace(experts=np.zeros((2, 1, 1), np.int32), num_experts=4, request=np.array([1, 0]))
