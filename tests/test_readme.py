"""The README stays true: its first lines are the two commands, and its knob table is the config's."""

import re
from dataclasses import fields
from pathlib import Path

from tierstore.runtime.config import RuntimeConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def test_first_lines_are_the_main_job_and_the_tests():
    commands = [line.split("#")[0].strip() for line in README.splitlines()[1:3]]
    assert commands == ["bash scripts/main.sh", "bash scripts/test.sh"]
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in ci


def test_knob_table_lists_every_runtime_knob_with_its_default():
    table = dict(re.findall(r"^\| `TIERSTORE_([A-Z0-9_]+)` \| `([^`]*)` \|", README, flags=re.MULTILINE))
    expected = {}
    for field in fields(RuntimeConfig):
        default = field.default
        if default is None:
            shown = "unset"
        elif default == "":
            shown = "(empty)"
        elif isinstance(default, bool):
            shown = str(default).lower()
        else:
            shown = str(default)
        expected[field.name.upper()] = shown
    assert table == expected
