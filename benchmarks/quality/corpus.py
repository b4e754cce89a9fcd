"""The text corpus: the CPython standard library's own `.py` files (PSF licence), read offline.

The file list is sorted, every file is identified by its SHA-256, and the split is decided per
file from a hash of its relative path (5% validation), so it does not depend on the order or the
number of files. The corpus hash names exactly what a model was trained and evaluated on; two
machines with different Python versions have different corpora, and results must not be compared
across hashes (`require_same_corpus`).

    python -m benchmarks.quality.corpus [--root DIR] [--out manifest.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

LICENCE = "PSF-2.0 (Python Software Foundation License Version 2; CPython standard library sources)"
VALIDATION_PERCENT = 5
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
SPLITS = ("train", "validation")


class CorpusMismatchError(RuntimeError):
    """Two artefacts name different corpora (or tokenizers): their numbers are not comparable."""


@dataclass(frozen=True)
class CorpusFile:
    relpath: str  # POSIX path relative to the corpus root
    num_bytes: int
    sha256: str
    split: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """`validation` for about VALIDATION_PERCENT% of paths, decided by SHA-256 of the path alone."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def source_paths(root: Path) -> list[Path]:
    """Every `*.py` under `root` outside installed-package folders, sorted by relative POSIX path."""
    found = [p for p in root.rglob("*.py")
             if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


class Corpus:
    """The corpus under `root`: files that decode as UTF-8 (others are listed in `skipped`)."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else stdlib_root()
        if not self.root.is_dir():
            raise FileNotFoundError(f"corpus root {self.root} is not a directory")
        self.files: list[CorpusFile] = []
        self.skipped: list[str] = []
        for path in source_paths(self.root):
            relpath = path.relative_to(self.root).as_posix()
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                self.skipped.append(relpath)
                continue
            self.files.append(CorpusFile(relpath, len(data), hashlib.sha256(data).hexdigest(), split_of(relpath)))
        if not self.files:
            raise FileNotFoundError(f"no UTF-8 .py files under {self.root}")

    @property
    def corpus_hash(self) -> str:
        """SHA-256 over "relpath<TAB>sha256<TAB>split" lines of every file, in order."""
        lines = "".join(f"{f.relpath}\t{f.sha256}\t{f.split}\n" for f in self.files)
        return hashlib.sha256(lines.encode("utf-8")).hexdigest()

    def texts(self, split: str) -> list[str]:
        """Contents of the split's files in corpus order; each file is read and checked against its hash."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        out = []
        for f in self.files:
            if f.split != split:
                continue
            data = (self.root / f.relpath).read_bytes()
            if hashlib.sha256(data).hexdigest() != f.sha256:
                raise CorpusMismatchError(f"{self.root / f.relpath} changed while the corpus was in use")
            out.append(data.decode("utf-8"))
        return out

    def manifest(self) -> dict:
        """JSON-ready identity: hash, source, licence, Python version, byte and file counts, file list."""
        counts = {s: {"files": sum(f.split == s for f in self.files),
                      "bytes": sum(f.num_bytes for f in self.files if f.split == s)} for s in SPLITS}
        return {
            "corpus_hash": self.corpus_hash,
            "source": "CPython standard library *.py (sysconfig stdlib path)",
            "root": str(self.root),
            "licence": LICENCE,
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "validation_percent": VALIDATION_PERCENT,
            "splits": counts,
            "skipped_not_utf8": self.skipped,
            "files": [[f.relpath, f.num_bytes, f.sha256, f.split] for f in self.files],
        }


def require_same_corpus(expected: str, found: str, what: str) -> None:
    """Raise CorpusMismatchError unless the two corpus hashes are equal."""
    if expected != found:
        raise CorpusMismatchError(f"{what}: corpus hash {found[:16]}... differs from {expected[:16]}...; "
                                  "results on different corpora (e.g. another Python version's stdlib) "
                                  "are not comparable")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="corpus root (default: this Python's stdlib)")
    parser.add_argument("--out", type=Path, default=None, help="write the manifest JSON here")
    args = parser.parse_args(argv)
    corpus = Corpus(args.root)
    manifest = corpus.manifest()
    summary = {k: v for k, v in manifest.items() if k != "files"}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
