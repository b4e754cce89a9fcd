"""Install layout and import hygiene: `kernels/` and `vllm_adapter/` live only under `tierstore.`,
and `import tierstore` stays light."""

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json, sys
import tierstore, tierstore.kernels, tierstore.vllm_adapter
print(json.dumps({
    "tierstore_file": tierstore.__file__,
    "kernels_file": tierstore.kernels.__file__,
    "adapter_file": tierstore.vllm_adapter.__file__,
    "bare_kernels": getattr(importlib.util.find_spec("kernels"), "origin", None),
    "bare_vllm_adapter": getattr(importlib.util.find_spec("vllm_adapter"), "origin", None),
}))
"""


def _not_ours(origin: str | None) -> bool:
    """A bare `kernels` may be PyPI's (transformers >= 5.25 installs it); it must not be our folder."""
    return origin is None or Path(origin) != REPO / "kernels" / "__init__.py"


def _probe(python: str) -> dict:
    # Run outside the repository so the source folders are not on sys.path by accident.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-P", "-c", PROBE], cwd="/", env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_import_tierstore_loads_no_heavy_or_optional_packages():
    code = (
        "import sys, tierstore, tierstore.cli\n"
        "heavy = [m for m in ('vllm', 'triton', 'transformers', 'tierstore.kernels', 'tierstore.vllm_adapter')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_editable_install_maps_folders_under_tierstore():
    found = _probe(sys.executable)
    assert Path(found["kernels_file"]) == REPO / "kernels" / "__init__.py"
    assert Path(found["adapter_file"]) == REPO / "vllm_adapter" / "__init__.py"
    assert _not_ours(found["bare_kernels"])
    assert found["bare_vllm_adapter"] is None


@pytest.mark.slow
def test_wheel_installs_kernels_and_adapter_under_tierstore(tmp_path):
    source = tmp_path / "src"  # a copy, so the build leaves nothing behind in the repository
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("tierstore", "kernels", "vllm_adapter"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-P", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True,
    )
    (wheel,) = tmp_path.glob("tierstore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"tierstore"}
    assert "tierstore/kernels/__init__.py" in names
    assert "tierstore/vllm_adapter/__init__.py" in names

    scratch = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(scratch)
    python = str(scratch / "bin" / "python")
    subprocess.run([python, "-P", "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # torch and friends come from the test environment, appended after the wheel's own site-packages
    (scratch_site,) = scratch.glob("lib/python*/site-packages")
    (scratch_site / "test-deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    found = _probe(python)
    assert Path(found["tierstore_file"]).is_relative_to(scratch_site)
    assert Path(found["kernels_file"]).is_relative_to(scratch_site)
    assert Path(found["kernels_file"]).parent.name == "kernels"
    assert Path(found["adapter_file"]).parent.parent.name == "tierstore"
    assert _not_ours(found["bare_kernels"])
    assert found["bare_vllm_adapter"] is None
