"""`python -m tierstore`: the CLI.

Started in a checkout's root, Python puts that root first on sys.path, where the source folder
`kernels/` (installed as `tierstore.kernels`) shadows PyPI's `kernels`, which transformers imports
when it is installed (`from kernels import CUDAProperties` then fails); the root comes off first.
"""

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def without_checkout_root(path: list[str], cwd: Path) -> list[str]:
    """sys.path less the checkout's root ('' and '.' mean cwd), when the root holds `kernels/`."""
    if not (CHECKOUT / "kernels" / "__init__.py").is_file():
        return path
    return [entry for entry in path if (cwd / entry).resolve() != CHECKOUT]


if __name__ == "__main__":
    sys.path[:] = without_checkout_root(sys.path, Path.cwd())
    from tierstore.cli import main

    sys.exit(main())
