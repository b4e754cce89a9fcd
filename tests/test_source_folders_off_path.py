"""The repository's `kernels/` folder never answers to the bare name `kernels` while the tests run
(it would shadow PyPI's `kernels`, which transformers imports when it is installed), in the test
process and in a Python the tests start in the repository root; `benchmarks` still imports."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ROOT / "kernels" / "__init__.py"

PROBE = """
import importlib.util, json, sys
spec = importlib.util.find_spec("kernels")
print(json.dumps({"origin": spec.origin if spec else None, "path": sys.path}))
"""


def test_bare_kernels_is_not_the_source_folder_in_the_test_process():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin) != OURS
    assert str(ROOT) not in sys.path


def test_bare_kernels_is_not_the_source_folder_in_a_child_started_in_the_root():
    assert (ROOT / "kernels" / "__init__.py").is_file()  # what would shadow, were the root on the path
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=dict(os.environ), capture_output=True,
                         text=True, check=True)
    found = json.loads(out.stdout)
    assert found["origin"] is None or Path(found["origin"]) != OURS
    assert "" not in found["path"] and str(ROOT) not in found["path"]


def test_benchmarks_imports_from_its_folder():
    from benchmarks.quality import presets

    assert Path(presets.__file__).resolve().parent == ROOT / "benchmarks" / "quality"


def test_python_m_tierstore_takes_the_checkout_root_off_its_path():
    from tierstore.__main__ import CHECKOUT, without_checkout_root

    assert CHECKOUT == ROOT
    elsewhere = str(ROOT.parent / "elsewhere")
    path = ["", str(ROOT), str(ROOT / "benchmarks"), elsewhere, "/usr/lib/python3.11"]
    assert without_checkout_root(path, ROOT) == [str(ROOT / "benchmarks"), elsewhere, "/usr/lib/python3.11"]
    assert without_checkout_root(["", "."], ROOT.parent) == ["", "."]  # cwd is elsewhere: nothing to take off


def test_python_m_tierstore_runs_from_the_checkout_root():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run([sys.executable, "-m", "tierstore", "--help"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    assert "generate" in out.stdout
