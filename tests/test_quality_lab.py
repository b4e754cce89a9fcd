"""Smoke tests of the quality lab (benchmarks/quality) on a tiny synthetic corpus, CPU only."""

import json

import pytest
import torch
from quality_fixtures import train_and_export_tiny, write_corpus

from benchmarks.quality import degeneration
from benchmarks.quality.corpus import Corpus, CorpusMismatchError, require_same_corpus
from benchmarks.quality.evaluate import Configuration, EvalSettings, evaluate
from benchmarks.quality.tokenizer import tokenizer_hash, train_tokenizer
from tierstore.checkpoint import open_checkpoint
from tierstore.formats import dequantize_nvfp4
from tierstore.sim import load_trace

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    base = tmp_path_factory.mktemp("quality")
    corpus_root, record, summary = train_and_export_tiny(base, max_steps=12, num_shards=2)
    return base, corpus_root, record, summary


def test_corpus_is_deterministic_and_split_by_file(tmp_path):
    root = write_corpus(tmp_path / "c")
    first, second = Corpus(root), Corpus(root)
    assert first.corpus_hash == second.corpus_hash
    splits = {f.split for f in first.files}
    assert splits == {"train", "validation"}
    manifest = first.manifest()
    assert manifest["splits"]["train"]["bytes"] + manifest["splits"]["validation"]["bytes"] == \
        sum((root / f.relpath).stat().st_size for f in first.files)
    (root / "pkg0" / "mod_0.py").write_text("changed\n", encoding="utf-8")
    with pytest.raises(CorpusMismatchError):
        require_same_corpus(first.corpus_hash, Corpus(root).corpus_hash, "test")


def test_corpus_adds_named_packages_under_their_own_prefix(tmp_path):
    root = write_corpus(tmp_path / "c")
    plain, with_numpy = Corpus(root), Corpus(root, ["numpy"])
    added = [f for f in with_numpy.files if f.relpath.startswith("site-packages/numpy/")]
    assert added and len(with_numpy.files) == len(plain.files) + len(added)
    assert with_numpy.corpus_hash != plain.corpus_hash
    first = added[0]
    assert with_numpy.path_of(first.relpath).stat().st_size == first.num_bytes
    manifest = with_numpy.manifest()
    assert manifest["packages"]["numpy"]["files"] == len(added)
    assert manifest["packages"]["numpy"]["licence"].startswith("BSD")
    with pytest.raises(ValueError, match="not one the corpus may use"):
        Corpus(root, ["requests"])


def test_tokenizer_training_is_deterministic(tmp_path):
    texts = Corpus(write_corpus(tmp_path / "c")).texts("train")
    first, second = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert tokenizer_hash(first) == tokenizer_hash(second)
    sample = "def f(x):\n    return x  # ünïcode\n"
    assert first.decode(first.encode(sample).ids) == sample


def test_training_lowers_the_loss(lab):
    _, _, record, _ = lab
    losses = [h["validation_loss"] for h in record["validation"]]
    assert record["steps"] == 12
    assert record["selected"]["validation_loss"] == min(losses)
    assert record["final_validation_loss"] == min(losses)
    assert record["samples"] and all("error" not in sample for sample in record["samples"])
    assert losses[-1] < losses[0] if len(losses) > 1 else losses[-1] < torch.log(torch.tensor(320.0)).item()


def test_export_reads_back_exactly_through_open_checkpoint(lab):
    base, _, _, summary = lab
    ckpt = base / "ckpt"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["output_router_logits"] is False
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert summary["expert_matrices_verified"] == 2 * 8 * 3
    from safetensors.torch import load_file

    from transformers import AutoModelForCausalLM
    trained = AutoModelForCausalLM.from_pretrained(str(base / "run" / "model"), dtype=torch.bfloat16)
    tensors = {}
    for shard in sorted(ckpt.glob("model-*.safetensors")):
        tensors.update(load_file(str(shard)))
    with open_checkpoint(ckpt) as opened:
        assert opened.source_format == "nvfp4"
        layer = opened.layer(1)
        expert = layer.experts[5]
        prefix = "model.layers.1.mlp.experts.5.down_proj"
        parts = [tensors[f"{prefix}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2")]
        assert torch.equal(expert.w2.dequantize(), dequantize_nvfp4(*parts))
        original = trained.model.layers[1].mlp.experts.down_proj[5].double()
        error = (expert.w2.dequantize() - original).abs().max() / original.abs().max()
        assert error < 0.2  # NVFP4 of the trained bf16 weight, not something else


def test_evaluation_runs_and_the_gate_at_tau_one_equals_the_fp4_tier(lab, tmp_path):
    base, corpus_root, _, _ = lab
    settings = EvalSettings(windows=2, decode_windows=2, decode_len=16, prompts=2, prompt_len=8, new_tokens=64,
                            pool_calibration_windows=2, batch_size=2)
    configs = [Configuration("fp4_checkpoint", "fp4_checkpoint"), Configuration("fp4_tier", "fp4_tier"),
               Configuration("w2_sym", "w2_sym"), Configuration("w2_asym", "w2_asym"),
               Configuration("w2_sym+pool0.50", "w2_sym", 0.5), Configuration("w2_sym+gate1.00", "w2_sym", 0.0, 1.0)]
    result = evaluate(base / "ckpt", torch.device("cpu"), torch.float32, settings, corpus_root, tmp_path / "traces",
                      configs, log=lambda line: None)
    assert result["heldout"]["fp4_checkpoint"]["agreement"] == 1.0
    assert result["heldout"]["fp4_checkpoint"]["kl"] == 0.0
    decode = result["heldout_decode"]
    assert decode["w2_sym+gate1.00"]["fire_rate"] == 1.0
    assert decode["w2_sym+gate1.00"]["nll"] == decode["fp4_tier"]["nll"]
    assert len(result["codebook"]["tensors"]) == 2 * 8 * 3
    assert result["corpus_hash"] == Corpus(corpus_root).corpus_hash
    trace = load_trace(result["generation"]["w2_sym"]["trace"])
    assert trace.experts.shape[1:] == (2, 2)  # (MoE layers, top-k)
    assert trace.num_tokens == 63 * (int(trace.request.max()) + 1)  # one request per prompt, 63 decode steps
    json.dumps(result)


def test_degeneration_detector_flags_loops_only():
    loop = [5, 6, 7, 8, 9] * 20
    varied = list(range(100))
    assert degeneration.is_degenerate(loop) is True
    assert degeneration.is_degenerate(varied) is False
    assert degeneration.is_degenerate(loop[:10]) is None
    code_like = [(i * 7919) % 97 for i in range(100)]  # repeats only with period 97
    assert degeneration.is_degenerate(code_like) is False
