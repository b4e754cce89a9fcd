"""scripts/main.sh picks its model: the quality lab's checkpoint when it is committed, else the demo.

The script is copied into a scratch repository layout and run with TIERSTORE_MAIN_DRY_RUN=1, so
the real choosing code runs without installing or generating anything."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "main.sh"


def _command(root: Path, *extra: str) -> list[str]:
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPT, root / "scripts" / "main.sh")
    done = subprocess.run(["bash", str(root / "scripts" / "main.sh"), *extra], capture_output=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "TIERSTORE_MAIN_DRY_RUN": "1"})
    assert done.returncode == 0, done.stderr
    fields = done.stdout.decode().split("\0")
    assert fields[-1] == ""
    return fields[:-1]


def _after(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    return root.resolve()


def test_uses_the_quality_checkpoint_when_its_config_exists(repo):
    checkpoint = repo / "benchmarks" / "quality" / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    command = _command(repo, "--device", "cpu")
    assert command[:3] == [str(repo / ".venv" / "bin" / "tierstore"), "generate", str(checkpoint)]
    assert "--demo" not in command
    assert _after(command, "--prompt") == "def read_config(path):\n"
    assert _after(command, "--gpu-pool-frac") == "0.25"
    assert "--verify-resident" in command
    assert command[-2:] == ["--device", "cpu"]  # extra arguments come last, so they win


def test_falls_back_to_the_demo_without_the_checkpoint(repo):
    (repo / "benchmarks" / "quality" / "checkpoint").mkdir(parents=True)  # a folder without config.json
    command = _command(repo)
    assert command[1:3] == ["generate", "--demo"]
    assert _after(command, "--prompt") == "The quick brown fox"
    assert "--verify-resident" in command and _after(command, "--gpu-pool-frac") == "0.25"
