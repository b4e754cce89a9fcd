"""Maps `kernels/` and `vllm_adapter/` under the `tierstore` distribution.

PyPI already has a top-level `kernels` package, so our folders install as
`tierstore.kernels` and `tierstore.vllm_adapter`; everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

SOURCE_ROOTS = {
    "tierstore": "tierstore",
    "tierstore.kernels": "kernels",
    "tierstore.vllm_adapter": "vllm_adapter",
}


def _packages_under(import_name: str, folder: str) -> list[str]:
    return [import_name] + [f"{import_name}.{sub}" for sub in find_packages(folder)]


setup(
    packages=[p for name, folder in SOURCE_ROOTS.items() for p in _packages_under(name, folder)],
    package_dir=SOURCE_ROOTS,
    package_data={"tierstore.kernels.cuda": ["*.cu", "*.cuh"]},  # the CUDA C++ sources and header nvcc builds at run time
)
