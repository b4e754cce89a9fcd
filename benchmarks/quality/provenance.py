"""Where and with what a result was produced: device, library versions, commit, date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """HEAD of the repository, else $TIERSTORE_COMMIT (the GPU machine gets the tree without .git), else 'unknown'."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip()
    return os.environ.get("TIERSTORE_COMMIT", "unknown")


def provenance(device: torch.device | str) -> dict:
    import transformers

    device = torch.device(device)
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info
