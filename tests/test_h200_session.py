"""benchmarks/h200_session.sh names files and options that exist (it runs where nothing can be fixed)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "benchmarks" / "h200_session.sh").read_text()


def _commands() -> list[list[str]]:
    """Each `python3 ...` command of a stage, continuation lines joined, split into words."""
    joined = SCRIPT.replace("\\\n", " ")
    return [line.split()[line.split().index("python3"):] for line in joined.splitlines()
            if line.strip().startswith("stage ") and "python3" in line]


def test_every_stage_names_an_existing_file():
    commands = _commands()
    assert len(commands) >= 7
    for words in commands:
        for word in words:
            if word.startswith(("benchmarks/", "tests/")):
                assert (ROOT / word).is_file(), word


@pytest.mark.parametrize("script", sorted({w[1] for w in _commands() if w[1].startswith("benchmarks/")}))
def test_every_option_is_one_the_benchmark_accepts(script):
    help_text = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                               cwd=ROOT, timeout=300).stdout
    used = {w for words in _commands() if words[1] == script for w in words if w.startswith("--")}
    assert used
    for option in used:
        assert re.search(rf"(^|\s|\[){re.escape(option)}\b", help_text), f"{script} has no {option}"
