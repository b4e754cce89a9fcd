"""The repository's `kernels/` folder never answers to the bare name `kernels` while the tests run
(it would shadow PyPI's `kernels`, which transformers imports when it is installed): not in the test
process, not in the Pythons the tests start, not under `python -m tierstore`; `tests` and
`benchmarks` still import from their folders."""

import importlib.util
import os
import re
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ROOT / "kernels" / "__init__.py"


def test_bare_kernels_is_not_the_source_folder_in_the_test_process():
    """Checked after every test module was imported (some put benchmarks/ on sys.path)."""
    assert OURS.is_file()  # what would shadow, were the root on the path
    spec = importlib.util.find_spec("kernels")
    assert spec is None or "site-packages" in Path(spec.origin).parts, spec.origin
    assert str(ROOT) not in sys.path
    assert not (Path.cwd() == ROOT and "" in sys.path)


def test_no_benchmark_module_shares_a_name_with_an_installed_or_standard_module():
    """benchmarks/ is the first folder on a benchmark script's path (and tests put it on theirs): a script named
    like a package would shadow it for everything imported after (`kernels.py` shadowed PyPI's `kernels`)."""
    installed = {entry.name.removesuffix(".py") for folder in site.getsitepackages() for entry in Path(folder).iterdir()}
    names = {path.stem for path in (ROOT / "benchmarks").glob("*.py")}
    assert "replay" in names
    assert names & (installed | set(sys.stdlib_module_names)) == set()


def test_every_python_the_tests_start_with_c_or_m_keeps_the_cwd_off_its_path():
    """`python -c` / `-m` put the cwd (the root, under pytest) first on sys.path; `-P` leaves it off."""
    unsafe = []
    for path in sorted(ROOT.glob("tests/**/*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r'\b(sys\.executable|python), "-[cm]"', line) and "no -P:" not in line:
                unsafe.append(f"{path.relative_to(ROOT)}:{number}")
    assert unsafe == []


def test_tests_and_benchmarks_import_from_their_folders():
    from benchmarks.quality import presets
    from tests import kernel_fixtures

    assert Path(presets.__file__).resolve().parent == ROOT / "benchmarks" / "quality"
    assert Path(kernel_fixtures.__file__).resolve().parent == ROOT / "tests"


def test_python_m_tierstore_takes_the_checkout_root_off_its_path():
    from tierstore.__main__ import CHECKOUT, without_checkout_root

    assert CHECKOUT == ROOT
    elsewhere = str(ROOT.parent / "elsewhere")
    path = ["", str(ROOT), str(ROOT / "benchmarks"), elsewhere, "/usr/lib/python3.11"]
    assert without_checkout_root(path, ROOT) == [str(ROOT / "benchmarks"), elsewhere, "/usr/lib/python3.11"]
    assert without_checkout_root(["", "."], ROOT.parent) == ["", "."]  # cwd is elsewhere: nothing to take off


def test_python_m_tierstore_installed_keeps_site_packages_beside_pypis_kernels(tmp_path):
    """Installed, tierstore's parent is site-packages, which may hold PyPI's `kernels/`: it stays on the path."""
    from tierstore.__main__ import is_checkout, without_checkout_root

    site_packages = tmp_path / "site-packages"
    (site_packages / "kernels").mkdir(parents=True)
    (site_packages / "kernels" / "__init__.py").write_text("")
    path = [str(site_packages), "/usr/lib/python3.11"]
    assert not is_checkout(site_packages) and is_checkout(ROOT)
    assert without_checkout_root(path, tmp_path, root=site_packages) == path


def test_python_m_tierstore_runs_from_the_checkout_root():
    command = [sys.executable, "-m", "tierstore", "--help"]  # no -P: the module itself takes the root off
    out = subprocess.run(command, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, check=True)
    assert "generate" in out.stdout
