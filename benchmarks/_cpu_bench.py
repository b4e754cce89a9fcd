"""What the CPU old-tree-vs-new-tree benchmarks (fetch_overhead.py, step_overhead.py, gate_step_cpu.py) share:
the baseline checked out as a git worktree, rounds of one fresh worker subprocess per tree, a method wrapped
to time its calls, and the printed summary beside the written report.

A module beside the scripts, not in the tierstore package: a worker runs with the old tree's tierstore on
PYTHONPATH (which lacks anything added since), while the script's own folder is on sys.path in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path


def git_out(repo: Path, *args: str) -> str:
    """stdout of `git ARGS` run in repo (raises on failure)."""
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


@contextmanager
def baseline_worktree(repo: Path, baseline: str) -> Iterator[Path]:
    """The revision baseline checked out (detached) in a temporary git worktree, removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), baseline], cwd=repo, check=True,
                       capture_output=True)
        try:
            yield old
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=repo, check=True)


def add_tree_options(parser: argparse.ArgumentParser, baseline: str) -> None:
    """The old tree's options: `--baseline REV` (checked out as a git worktree) or `--baseline-tree DIR`."""
    parser.add_argument("--baseline", default=baseline, help="git revision of the old tree")
    parser.add_argument("--baseline-tree", type=Path,
                        help="the old tree's files instead (a folder holding its tierstore/: where .git lacks it)")


def old_tree(repo: Path, args: argparse.Namespace) -> AbstractContextManager[Path]:
    """The old tree that `add_tree_options` named: its worktree (removed on exit) or the folder given."""
    if args.baseline_tree is not None:
        return nullcontext(args.baseline_tree.resolve())
    return baseline_worktree(repo, args.baseline)


def run_rounds(script: str | Path, trees: Mapping[str, Path], rounds: int, args: Sequence[str]) -> dict[str, list]:
    """rounds x each tree in turn: `script --worker ARGS` in a fresh subprocess importing that tree's tierstore
    (PYTHONPATH and cwd the tree); the JSON of each run's last stdout line, listed per tree name."""
    results: dict[str, list] = {name: [] for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree))
            cmd = [sys.executable, str(script), "--worker", *args]
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
            if done.returncode:
                tail = "\n".join(done.stderr.strip().splitlines()[-12:])
                raise SystemExit(f"the {name} tree's worker ({tree}) exited {done.returncode}:\n{tail}")
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def wrap_timed(owner, name: str, record: Callable[[float], None]) -> None:
    """Replace owner.name by a wrapper that, as each call ends (returns or raises), calls record(started):
    started is time.perf_counter() taken just before the call."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            record(started)

    setattr(owner, name, wrapper)


def emit(summary: dict, report: dict, out: Path | None) -> None:
    """Print summary as indented JSON; with out, write the whole report there too."""
    print(json.dumps(summary, indent=1))
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n")
