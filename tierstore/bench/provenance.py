"""Where and with what a benchmark ran: commit (in a git checkout), versions, CPU, GPU, disk."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when tierstore runs from one


def source_checkout() -> Path | None:
    """The source checkout tierstore is imported from, or None (an installed wheel)."""
    if (SOURCE_ROOT / ".git").exists() and (SOURCE_ROOT / "pyproject.toml").is_file() \
            and (SOURCE_ROOT / "benchmarks").is_dir():
        return SOURCE_ROOT
    return None


def git_commit(root: Path | None = None) -> dict:
    """{"commit": HEAD or None, "commit_dirty": tracked files changed?}; None outside a checkout."""
    root = root or source_checkout()
    if root is None:
        return {"commit": None, "commit_dirty": None}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "commit_dirty": None}
    commit = head.stdout.strip() or None
    return {"commit": commit, "commit_dirty": bool(status.stdout.strip()) if commit else None}


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpu_info() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "memory_bytes": props.total_memory, "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda}


def filesystem_of(path: Path | str) -> dict:
    """The mount holding `path` (from /proc/mounts): mount point, device, filesystem type."""
    target = os.path.realpath(path)
    best = {"mount": None, "device": None, "fstype": None}
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        device, mount, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and (best["mount"] is None or len(mount) >= len(best["mount"])):
            best = {"mount": mount, "device": device, "fstype": fstype}
    return best


def disk_info(path: Path | str) -> dict:
    """Filesystem, device, free space and (where sysfs says) whether the device is rotational."""
    info = {"path": str(path), **filesystem_of(path)}
    try:
        info["free_bytes"] = shutil.disk_usage(path).free
    except OSError:
        info["free_bytes"] = None
    device = info.get("device") or ""
    if device.startswith("/dev/"):
        name = Path(os.path.realpath(device)).name
        block = Path("/sys/class/block") / name
        if (block / "partition").exists():
            block = block.resolve().parent
        for key, file in (("rotational", "queue/rotational"), ("model", "device/model")):
            try:
                text = (block / file).read_text().strip()
                info[key] = bool(int(text)) if key == "rotational" else text
            except (OSError, ValueError):
                pass
    return info


def provenance(disk: Path | str | None = None, commit: str | None = None) -> dict:
    """Provenance of a run. `disk`: the directory measured; `commit` overrides git (a tree that
    runs without its .git)."""
    import numpy
    import torch

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **git_commit()}
    if commit:
        info["commit"], info["commit_dirty"] = commit, None
    info.update({
        "tierstore": _package_version("tierstore") or __import__("tierstore").__version__,
        "host": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
        "cpu": cpu_model(), "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
        "numba": _package_version("numba"), "liburing": _package_version("liburing"),
        "xxhash": _package_version("xxhash"),
    })
    gpu = gpu_info()
    info["gpu"] = gpu["name"] if gpu else None
    info["gpu_detail"] = gpu
    if disk is not None:
        info["disk"] = disk_info(disk)
    return info
