"""A tiny synthetic Python corpus and a tiny NVFP4 checkpoint made the way the quality lab makes
its real one (benchmarks/quality: train.py preset `tiny`, then export.py). CPU only."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_corpus(root: Path) -> Path:
    """40 small Python files; names chosen so that the hash split puts some in validation."""
    for i in range(40):
        body = "".join(f"def func_{i}_{j}(x, y={j}):\n    \"\"\"Return x plus {j}.\"\"\"\n    return x + y * {i}\n\n\n"
                       for j in range(12))
        path = root / f"pkg{i % 3}" / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    return root


def train_and_export_tiny(base: Path, max_steps: int = 12, num_shards: int = 2) -> tuple[Path, dict, dict]:
    """(corpus root, training record, export summary); the run is base/run, the checkpoint base/ckpt."""
    import torch

    from benchmarks.quality.export import export
    from benchmarks.quality.presets import PRESETS
    from benchmarks.quality.train import train

    corpus_root = write_corpus(base / "corpus")
    record = train(PRESETS["tiny"], base / "run", budget_s=120, seed=0, device=torch.device("cpu"),
                   corpus_root=corpus_root, max_steps=max_steps, log=lambda line: None)
    summary = export(base / "run", base / "ckpt", num_shards=num_shards, corpus_root=corpus_root)
    return corpus_root, record, summary
