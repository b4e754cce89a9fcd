"""`python -m tierstore`: the CLI.

Started in a checkout's root, Python puts that root first on sys.path, where the source folder
`kernels/` (installed as `tierstore.kernels`) shadows PyPI's `kernels`, which transformers imports
when it is installed (`from kernels import CUDAProperties` then fails); the root comes off first.
"""

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def is_checkout(folder: Path) -> bool:
    """A source checkout (pyproject.toml beside `kernels/`), not the site-packages of an install, where a
    `kernels/` is PyPI's own and that folder must stay on the path."""
    return (folder / "pyproject.toml").is_file() and (folder / "kernels" / "__init__.py").is_file()


def without_checkout_root(path: list[str], cwd: Path, root: Path = CHECKOUT) -> list[str]:
    """sys.path less `root` ('' and '.' mean cwd) when it is a checkout."""
    if not is_checkout(root):
        return path
    return [entry for entry in path if (cwd / entry).resolve() != root]


if __name__ == "__main__":
    sys.path[:] = without_checkout_root(sys.path, Path.cwd())
    from tierstore.cli import main

    sys.exit(main())
