"""`load_model` builds every checkpoint's model on the meta device and reads only its dense tensors:
the same model as transformers' `from_pretrained` outside the routed experts (bit for bit, fp32 and
bf16, six families), the same generated tokens and logits, the experts never read, clear errors,
and a peak RSS during loading far below the experts' bytes."""

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import save_hf_checkpoint
from safetensors.torch import load_file, save_file
from test_runtime_fixtures import runtime_hf_model

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.files import TensorFiles
from tierstore.errors import CheckpointError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.generation import TieredGenerator
from tierstore.runtime.hf import install_tiered_experts, load_full_model, load_model
from tierstore.runtime.hf_dense import ExpertsNotLoaded
from tierstore.runtime.packs import ensure_base_pack, open_base_rows

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", category=FutureWarning)

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"]
PROMPT = [5, 17, 33, 8, 60, 12]
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}

    def get(model_type, packs=False, **overrides):
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in built:
            root = tmp_path_factory.mktemp(model_type)
            built[key] = save_hf_checkpoint(runtime_hf_model(model_type, seed=3, **overrides), root / "ckpt")
        ckpt = built[key]
        if packs and not (ckpt.parent / "packs").exists():
            ensure_base_pack(ckpt, ckpt.parent / "packs", device="cpu")
        return ckpt

    return get


def assert_same_as_from_pretrained(ckpt, dtype):
    dense, full = load_model(ckpt, dtype), load_full_model(ckpt, dtype)
    got = dict(dense.state_dict())
    want = {name: t for name, t in full.state_dict().items() if ".experts." not in name}
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    buffers = dict(dense.named_buffers())  # non-persistent ones (rotary inv_freq) too
    for name, tensor in full.named_buffers():
        assert buffers[name].dtype == tensor.dtype and torch.equal(buffers[name], tensor), name
    assert not any(".experts." in name for name, _ in dense.named_parameters())
    assert all(type(block.experts) is ExpertsNotLoaded for block in
               (layer.mlp for layer in dense.model.layers) if hasattr(block, "gate"))
    return dense


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_model_equals_from_pretrained_outside_the_experts(model_type, dtype, checkpoints):
    assert_same_as_from_pretrained(checkpoints(model_type), dtype)


def test_tied_embeddings_are_tied_and_equal(checkpoints):
    ckpt = checkpoints("qwen3_moe", tie_word_embeddings=True)
    assert not TensorFiles(ckpt).has("lm_head.weight")
    model = assert_same_as_from_pretrained(ckpt, torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_mixtral_checkpoint_names_are_renamed_like_transformers(checkpoints):
    names = TensorFiles(checkpoints("mixtral")).names()
    assert "model.layers.0.block_sparse_moe.gate.weight" in names  # the checkpoint's name; the model's is .mlp.


def generate(ckpt, model):
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    runtime = TieredRuntime(geometry, open_base_rows(ckpt, ckpt.parent / "packs"),
                            pool_slots=round(0.5 * geometry.total_routed_experts), arena_slots=16,
                            config=RuntimeConfig(kpi_every=0))
    install_tiered_experts(model, runtime)
    with runtime:
        return TieredGenerator(model, runtime, max_length=len(PROMPT) + 9).generate(PROMPT, 8, keep_logits=True)


def fresh_storage(model):
    """The same values in freshly allocated (64-byte aligned) tensors: from_pretrained's CPU tensors
    keep their offset in the mapped shard (data_ptr % 64 == 24 here), and CPU matmul kernels round
    differently on unaligned operands (last-bit logit differences, same tokens); on CUDA every
    tensor is aligned after `.to(device)` anyway."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generate_is_bit_identical_to_the_full_loading_path(model_type, checkpoints):
    ckpt = checkpoints(model_type, packs=True)
    got = generate(ckpt, load_model(ckpt, torch.float32))
    want = generate(ckpt, fresh_storage(load_full_model(ckpt, torch.float32)))
    assert got.new_ids == want.new_ids and len(got.step_logits) == 8
    for step, (a, b) in enumerate(zip(got.step_logits, want.step_logits)):
        assert torch.equal(a, b), f"step {step} differs"
    as_loaded = generate(ckpt, load_full_model(ckpt, torch.float32))
    assert as_loaded.new_ids == got.new_ids
    for a, b in zip(got.step_logits, as_loaded.step_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_routed_experts_are_never_read(checkpoints, monkeypatch):
    ckpt = checkpoints("deepseek_v3")
    read = []
    original = TensorFiles.read
    monkeypatch.setattr(TensorFiles, "read", lambda self, name: read.append(name) or original(self, name))
    load_model(ckpt, torch.float32)
    assert read and not any(".experts." in name for name in read)
    assert any("shared_experts." in name for name in read)  # shared experts are dense and loaded


def rewrite(src, dst, edit):
    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_unexpected_and_misshapen_tensors_are_named(checkpoints, tmp_path):
    ckpt = checkpoints("qwen3_moe")
    missing = rewrite(ckpt, tmp_path / "missing", lambda t: t.pop("model.layers.1.self_attn.q_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.1.self_attn.q_norm.weight'\] \(1\), "
                                              r"unexpected \[\] \(0\)"):
        load_model(missing, torch.float32)
    extra = rewrite(ckpt, tmp_path / "extra", lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected \['model.layers.0.extra.weight'\] \(1\)"):
        load_model(extra, torch.float32)
    shaped = rewrite(ckpt, tmp_path / "shape", lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[3\], the model's 'model.norm.weight' \[64\]"):
        load_model(shaped, torch.float32)


CHILD = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from tierstore.runtime import hf
    from tierstore.runtime.hf_dense import model_skeleton

    def high_water_mark():  # this process's own peak RSS
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    ckpt, mode = sys.argv[1], sys.argv[2]
    model_skeleton(ckpt)  # imports the model code (no storage), so the baseline holds it
    baseline = high_water_mark()
    model = (hf.load_model if mode == "dense" else hf.load_full_model)(ckpt, torch.bfloat16)
    logits = model.model.embed_tokens.weight.float().sum()  # touch the loaded weights
    print(json.dumps({"baseline": baseline, "peak": high_water_mark()}))
""")


def peak_growth(ckpt, mode):
    out = subprocess.run([sys.executable, "-P", "-c", CHILD, str(ckpt), mode], capture_output=True, text=True, timeout=300,
                         check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report["peak"] - report["baseline"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux /proc")
def test_peak_rss_while_loading_stays_far_below_the_experts(tmp_path):
    # 3 MoE layers x 8 experts x 9 MiB of bf16 (216 MiB) beside 0.4 MiB of dense tensors: large enough that
    # the fixed costs of a first load (allocator, readahead around the dense tensors: 4-11 MiB seen) stay
    # far under the bound while loading the experts would exceed it many times over
    model = runtime_hf_model("qwen3_moe", seed=1, dtype=torch.bfloat16, hidden_size=256, moe_intermediate_size=6144,
                             num_experts=8)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    ckpt = save_hf_checkpoint(model, tmp_path / "ckpt")
    del model
    grown = peak_growth(ckpt, "dense")
    print(f"load_model: peak RSS grew {grown / MiB:.1f} MiB; routed experts {expert_bytes / MiB:.0f} MiB")
    assert grown < expert_bytes / 8
