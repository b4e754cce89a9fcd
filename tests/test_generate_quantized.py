"""`tierstore generate` on a checkpoint transformers cannot load: a tiny Qwen3-MoE trained and
exported by the quality lab as modelopt NVFP4 (experts NVFP4, everything else bf16, its own
byte-level BPE tokenizer). Also the dense loader (`tierstore.runtime.hf_dense`) on its own."""

import ast
import re
import shutil
import warnings

import pytest
import torch
from quality_fixtures import train_and_export_tiny

from tierstore.cli import main
from tierstore.errors import CheckpointError

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
warnings.filterwarnings("ignore", category=FutureWarning)

PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("nvfp4")
    train_and_export_tiny(base, max_steps=4, num_shards=2)
    return base


def test_generate_uses_the_checkpoint_tokenizer_and_is_bit_identical(exported, tmp_path, capsys):
    from transformers import AutoTokenizer

    ckpt = exported / "ckpt"
    args = ["generate", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "6", "--gpu-pool-frac", "0.5",
            "--verify-resident", "--pack-dir", str(tmp_path / "packs")]
    assert main(args) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "built 2 layers, reused 0" in out
    assert "bit-identical: yes (6 steps)" in out
    assert "[tierstore] KPI: replay" in out and "pool 8 slots = 50.0% of experts" in out
    tokens = len(AutoTokenizer.from_pretrained(str(ckpt)).encode(PROMPT))
    assert tokens < len(PROMPT.encode())  # BPE merges: not the byte fallback
    assert f"prompt: {PROMPT!r} ({tokens} tokens," in out
    text = ast.literal_eval(re.search(r"^output: (.*)$", out, flags=re.MULTILINE).group(1))
    assert isinstance(text, str) and text

    assert main(args) == 0  # the second run reuses the pack and generates the same text
    again = capsys.readouterr().out
    assert "built 0 layers, reused 2" in again
    assert f"output: {text!r}" in again


def test_dense_loader_loads_every_non_expert_tensor_and_leaves_no_expert_behind(exported):
    from transformers import AutoModelForCausalLM

    from tierstore.runtime.hf import load_model
    from tierstore.runtime.hf_dense import ExpertsNotLoaded

    trained = AutoModelForCausalLM.from_pretrained(str(exported / "run" / "model"), dtype=torch.bfloat16)
    model = load_model(exported / "ckpt", torch.bfloat16, "cpu")
    loaded = dict(model.named_parameters())
    compared = 0
    for name, param in trained.named_parameters():
        if ".mlp.experts." in name:
            assert name not in loaded
            continue
        assert torch.equal(loaded[name], param), name
        compared += 1
    assert compared == len(loaded) > 0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert [type(layer.mlp.experts) for layer in model.model.layers] == [ExpertsNotLoaded] * 2
    with pytest.raises(CheckpointError, match="decoder layer 0 were not loaded"):
        model(input_ids=torch.tensor([[3, 4, 5]]))


def test_dense_loader_refuses_quantized_tensors_outside_the_experts(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    from tierstore.runtime.hf_dense import load_dense_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported / "ckpt", ckpt)
    shard = ckpt / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' is F8_E4M3"):
        load_dense_model(ckpt)


def test_dense_loader_names_tensors_that_do_not_fit(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    from tierstore.runtime.hf_dense import load_dense_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported / "ckpt", ckpt)
    shard = ckpt / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = (ckpt / "model.safetensors.index.json")
    index.write_text(index.read_text().replace('"model.norm.weight"', '"model.extra.weight"'))
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\].*unexpected \['model.extra.weight'\]"):
        load_dense_model(ckpt)
