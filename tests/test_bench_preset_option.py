"""benchmarks/moe_kernels.py and benchmarks/cuda_w2.py take --preset NAME and run on that preset's shapes
(tierstore.geometry), and h200_session.sh's `presets` step names only presets those scripts accept.

CPU only: the command lines are parsed and each script's setup is stopped at its first use of the geometry,
which is captured; nothing is timed and no GPU kernel runs."""

import importlib.util
import re
from pathlib import Path

import pytest

from tierstore.geometry import PRESETS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "benchmarks" / "h200_session.sh").read_text()
SHAPE = ("num_experts", "top_k", "hidden", "expert_inter")


class _Stop(Exception):
    """Raised where the benchmark would first allocate on the device."""


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}_preset_option", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _shape(geo) -> tuple:
    return tuple(getattr(geo, field) for field in SHAPE)


def _step(name: str) -> str:
    """The body of one `case` branch of the session script (from `  name)` to its `;;`)."""
    match = re.search(rf"^  {name}\)(.*?)^    ;;$", SCRIPT, re.S | re.M)
    assert match, name
    return match.group(1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_kernels_preset_option_sets_the_shapes(preset, tmp_path, monkeypatch):
    kb = _load("moe_kernels")
    monkeypatch.setattr(kb, "_provenance", lambda commit: dict(commit=commit))
    seen = {}

    def setup(geo, device):
        seen["geo"], seen["device"] = geo, device
        raise _Stop()

    monkeypatch.setattr(kb, "_setup", setup)
    code = kb.main(["--preset", preset, "--tokens", "1,8,32,64,512", "--json", str(tmp_path / "k.json"),
                    "--device", "cpu"])
    assert code == 1  # the fatal-error path: _Stop came from setup, as intended
    assert seen["geo"].name == preset
    assert _shape(seen["geo"]) == _shape(PRESETS[preset])


def test_kernels_default_preset_is_unchanged(tmp_path, monkeypatch):
    kb = _load("moe_kernels")
    monkeypatch.setattr(kb, "_provenance", lambda commit: dict(commit=commit))
    seen = {}

    def setup(geo, device):
        seen["geo"] = geo
        raise _Stop()

    monkeypatch.setattr(kb, "_setup", setup)
    assert kb.main(["--json", str(tmp_path / "k.json"), "--device", "cpu"]) == 1
    assert seen["geo"].name == "deepseek-v3"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cuda_w2_preset_option_sets_the_shapes(preset, monkeypatch):
    cw = _load("cuda_w2")
    kb = _load("moe_kernels")
    args = cw._arguments("cuda_w2", ["--preset", preset, "--tokens", "1,8,32", "--json", "x.json"])
    assert args.preset == preset
    seen = {}

    def setup(geo, device):
        seen["geo"] = geo
        raise _Stop()

    monkeypatch.setattr(kb, "_setup", setup)
    monkeypatch.setattr(cw, "_variants", lambda only: [])  # no nvcc build on the CPU
    monkeypatch.setattr(cw, "DEVICE", "cpu")
    with pytest.raises(_Stop):
        cw.run(kb, args, {}, lambda result: None)
    assert _shape(seen["geo"]) == _shape(PRESETS[preset])
    assert cw._arguments("cuda_w2", ["--json", "x.json"]).preset == "deepseek-v3"


def test_presets_step_covers_every_preset_and_token_count():
    body = _step("presets")
    loop = re.findall(r"for preset in ([^;]+); do\n\s+stage \"kernels-\$preset\".*?--tokens (\S+)", body, re.S)
    assert len(loop) == 1
    names, tokens = loop[0][0].split(), loop[0][1].split(",")
    assert tokens == ["1", "8", "32", "64", "512"]
    assert set(names) | {"deepseek-v3"} == set(PRESETS) and "deepseek-v3" not in names
    assert re.search(r"kernels\.py --preset deepseek-v3 --tokens 64,512 ", body)


def test_presets_step_runs_cuda_w2_only_on_shapes_it_accepts():
    """The presets step (54fb697) ran W2MoeCuda where it then took the shapes: hidden and inter multiples of 512 (since
    9cad872 any inter; ds-v2-lite and qwen3-30b-a3b ran in the halftiles step)."""
    body = _step("presets")
    loop = re.findall(r"for preset in ([^;]+); do\n\s+stage \"cuda-w2-\$preset\"", body)
    assert len(loop) == 1
    names = loop[0].split()
    accepted = {name for name, geo in PRESETS.items() if geo.hidden % 512 == 0 and geo.expert_inter % 512 == 0}
    assert set(names) == accepted - {"deepseek-v3"}  # deepseek-v3: measured at ab6ed8d (verify)
    assert {"ds-v2-lite", "qwen3-30b-a3b"}.isdisjoint(names)


@pytest.mark.parametrize("step", ["resume", "matrix", "presets"])
def test_new_steps_stay_under_570_s_of_stage_limits(step):
    body = _step(step)
    total = 0
    for line in body.splitlines():
        match = re.match(r"\s*stage (\S+) (\d+) ", line)
        if match:
            loop = re.search(r"for \w+ in ([^;]+); do\n" + re.escape(line), body)
            total += int(match.group(2)) * (len(loop.group(1).split()) if loop else 1)
    assert total == {"resume": 560, "matrix": 520, "presets": 560}[step]  # the sums the script's comments give
    assert total < 570
