"""The text corpus: the CPython standard library's own `.py` files, plus optionally the sources of
named, permissively licensed packages installed beside it, read offline.

The file list is sorted, every file is identified by its SHA-256, and the split is decided per
file from a hash of its relative path (5% validation), so it does not depend on the order or the
number of files. The corpus hash names exactly what a model was trained and evaluated on; two
machines with different Python versions have different corpora, and results must not be compared
across hashes (`require_same_corpus`).

Package files are named `site-packages/<package>/<path inside the package>`; stdlib files keep
their path relative to the stdlib folder.

    python -m benchmarks.quality.corpus [--root DIR] [--packages numpy,sympy] [--out manifest.json]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

LICENCE = "PSF-2.0 (Python Software Foundation License Version 2; CPython standard library sources)"
# The packages a corpus may draw on, with their licences (as their own distributions declare them).
PACKAGE_LICENCES = {
    "numpy": "BSD-3-Clause", "scipy": "BSD-3-Clause", "sympy": "BSD-3-Clause", "pandas": "BSD-3-Clause",
    "sklearn": "BSD-3-Clause (scikit-learn)", "networkx": "BSD-3-Clause", "torch": "BSD-3-Clause (PyTorch)",
}
PACKAGE_PREFIX = "site-packages"
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


def package_root(name: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    if name not in PACKAGE_LICENCES:
        raise ValueError(f"package {name!r} is not one the corpus may use; choose from {sorted(PACKAGE_LICENCES)}")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"corpus package {name!r} is not installed in this Python")
    return Path(list(spec.submodule_search_locations)[0])


def source_paths(root: Path) -> list[Path]:
    """Every `*.py` under `root` outside installed-package folders, sorted by relative POSIX path."""
    found = [p for p in root.rglob("*.py")
             if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


class Corpus:
    """The corpus under `root` and the named packages: files that decode as UTF-8 (others are listed in
    `skipped`)."""

    def __init__(self, root: Path | str | None = None, packages: tuple[str, ...] | list[str] = ()):
        self.root = Path(root) if root is not None else stdlib_root()
        if not self.root.is_dir():
            raise FileNotFoundError(f"corpus root {self.root} is not a directory")
        self.packages = tuple(sorted(set(packages)))
        self._folders = {"": self.root}  # name prefix -> folder on this machine
        for name in self.packages:
            self._folders[f"{PACKAGE_PREFIX}/{name}/"] = package_root(name)
        self.files: list[CorpusFile] = []
        self.skipped: list[str] = []
        for prefix, folder in self._folders.items():
            self._read_folder(prefix, folder)
        if not self.files:
            raise FileNotFoundError(f"no UTF-8 .py files under {self.root}")

    def _read_folder(self, prefix: str, folder: Path) -> None:
        for path in source_paths(folder):
            relpath = prefix + path.relative_to(folder).as_posix()
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                self.skipped.append(relpath)
                continue
            self.files.append(CorpusFile(relpath, len(data), hashlib.sha256(data).hexdigest(), split_of(relpath)))

    def path_of(self, relpath: str) -> Path:
        for prefix, folder in self._folders.items():
            if prefix and relpath.startswith(prefix):
                return folder / relpath[len(prefix):]
        return self.root / relpath

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
            data = self.path_of(f.relpath).read_bytes()
            if hashlib.sha256(data).hexdigest() != f.sha256:
                raise CorpusMismatchError(f"{self.path_of(f.relpath)} changed while the corpus was in use")
            out.append(data.decode("utf-8"))
        return out

    def manifest(self) -> dict:
        """JSON-ready identity: hash, source, licence, Python version, byte and file counts, file list."""
        counts = {s: {"files": sum(f.split == s for f in self.files),
                      "bytes": sum(f.num_bytes for f in self.files if f.split == s)} for s in SPLITS}
        return {
            "corpus_hash": self.corpus_hash,
            "source": "CPython standard library *.py (sysconfig stdlib path)"
                      + (f" + *.py of the installed packages {', '.join(self.packages)}" if self.packages else ""),
            "root": str(self.root),
            "licence": LICENCE,
            "packages": {name: {"folder": str(self._folders[f"{PACKAGE_PREFIX}/{name}/"]),
                                "licence": PACKAGE_LICENCES[name], "files": self._count(f"{PACKAGE_PREFIX}/{name}/")}
                         for name in self.packages},
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "validation_percent": VALIDATION_PERCENT,
            "splits": counts,
            "skipped_not_utf8": self.skipped,
            "files": [[f.relpath, f.num_bytes, f.sha256, f.split] for f in self.files],
        }


    def _count(self, prefix: str) -> int:
        return sum(f.relpath.startswith(prefix) for f in self.files)


def require_same_corpus(expected: str, found: str, what: str) -> None:
    """Raise CorpusMismatchError unless the two corpus hashes are equal."""
    if expected != found:
        raise CorpusMismatchError(f"{what}: corpus hash {found[:16]}... differs from {expected[:16]}...; "
                                  "results on different corpora (e.g. another Python version's stdlib) "
                                  "are not comparable")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="corpus root (default: this Python's stdlib)")
    parser.add_argument("--packages", default="", help="comma-separated packages to add, from: "
                        + ", ".join(sorted(PACKAGE_LICENCES)))
    parser.add_argument("--out", type=Path, default=None, help="write the manifest JSON here")
    args = parser.parse_args(argv)
    corpus = Corpus(args.root, [name for name in args.packages.split(",") if name])
    manifest = corpus.manifest()
    summary = {k: v for k, v in manifest.items() if k != "files"}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
