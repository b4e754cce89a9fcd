"""Build a .cu file with nvcc into a fatbin and launch its kernels through the CUDA driver API (ctypes).

No torch CUDA extension build: `nvcc -fatbin` (seconds), `cuModuleLoadData` on the context torch already
made current, `cuLaunchKernel` on the caller's stream (capture-safe: a launch on a capturing stream is
recorded into the graph like any other). The fatbin holds sm_90a SASS and compute_90a PTX, so a driver
that cannot load the SASS can still JIT the PTX. Host code that needs the CUDA runtime (the conditional graph nodes of
`graph_if.cu`) is built as a shared library instead (`build_library`, `nvcc -shared`) and called through ctypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ARCH = "90a"
_CU_FUNC_ATTRIBUTE = {"max_threads": 0, "shared_bytes": 1, "local_bytes": 3, "num_regs": 4}
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED = 8
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_CARVEOUT = 9


INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread yet


class CudaError(RuntimeError):
    """A failed driver call or nvcc run (message carries the driver's error name or nvcc's output)."""


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def nvcc_version() -> str | None:
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    lines = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    release = [line for line in lines if "release" in line]
    return (release or lines or [None])[-1]


def nvcc_command(source: Path, output: Path, fmt: str = "fatbin", defines: dict | None = None,
                 arch: str = ARCH) -> list[str]:
    """fmt: fatbin (SASS + PTX, what `build` loads), cubin (SASS only, for cuobjdump) or so (a shared library of
    host code and its kernels, SASS + PTX, for ctypes: `build_library`); defines: -DNAME=value. The source's folder
    is on the include path (its .cuh headers)."""
    targets = f"[sm_{arch},compute_{arch}]" if fmt in ("fatbin", "so") else f"sm_{arch}"
    flags = [f"-D{name}={value}" for name, value in sorted((defines or {}).items())]
    kind = ["-shared", "-Xcompiler", "-fPIC"] if fmt == "so" else [f"-{fmt}"]
    return [nvcc_path() or "nvcc", *kind, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code={targets}",
            f"-I{Path(source).parent}", *flags, "-o", str(output), str(source)]


def source_bytes(source: Path) -> bytes:
    """What a build depends on besides the command: the source's bytes and every .cuh header beside it (name and
    bytes, sorted by name), so an edited header rebuilds."""
    source = Path(source)
    headers = sorted(source.parent.glob("*.cuh"))
    return source.read_bytes() + b"".join(b"\0" + h.name.encode() + b"\0" + h.read_bytes() for h in headers)


def build(source: Path, defines: dict | None = None, fmt: str = "fatbin", cache_dir: Path | None = None) -> bytes:
    """Compile `source` (cached by its bytes, its folder's headers' and the command) and return the image."""
    return build_path(source, defines, fmt, cache_dir).read_bytes()


def build_library(source: Path, cache_dir: Path | None = None) -> ctypes.CDLL:
    """`source` built as a shared library (cached like `build`) and loaded."""
    return ctypes.CDLL(str(build_path(source, fmt="so", cache_dir=cache_dir)))


def build_path(source: Path, defines: dict | None = None, fmt: str = "fatbin",
               cache_dir: Path | None = None) -> Path:
    """`build`'s cached image, compiled first when it is not there."""
    text = source_bytes(source)
    cache_dir = Path(cache_dir or os.environ.get("TIERSTORE_CUDA_CACHE", Path(tempfile.gettempdir()) / "tierstore-cuda"))
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(text + " ".join(nvcc_command(Path("s"), Path("o"), fmt, defines)).encode()).hexdigest()[:16]
    image = cache_dir / f"{Path(source).stem}-{key}.{fmt}"
    if not image.exists():
        if nvcc_path() is None:
            raise CudaError("nvcc not found (PATH or /usr/local/cuda/bin)")
        tmp = image.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run(nvcc_command(Path(source), tmp, fmt, defines), capture_output=True, text=True)
        if proc.returncode != 0:
            raise CudaError(f"nvcc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, image)
    return image


# Argument kinds of `pack_args`: pointer (uint64), int32, int64, float32.
_ARG_TYPES = {"p": ctypes.c_uint64, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float}


def pack_args(kinds: str, values) -> tuple[ctypes.Array, list]:
    """Kernel arguments -> (void*[n] for cuLaunchKernel, the ctypes objects it points to: keep them alive)."""
    if len(kinds) != len(values):
        raise ValueError(f"{len(kinds)} argument kinds for {len(values)} values")
    held = []
    for kind, value in zip(kinds, values):
        if kind not in _ARG_TYPES:
            raise ValueError(f"unknown argument kind {kind!r} (one of {''.join(_ARG_TYPES)})")
        if kind in "piq" and not isinstance(value, int):
            raise TypeError(f"argument kind {kind!r} needs an int, got {type(value).__name__}")
        held.append(_ARG_TYPES[kind](value))
    array = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
    return array, held


class _Driver:
    """The few libcuda entry points used here; every call is checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", 0)

    def check(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise CudaError(f"{name} failed: {self.error_name(status)}")

    def error_name(self, status: int) -> str:
        """The driver's name of a CUresult (the number itself where it has none)."""
        text = ctypes.c_char_p()
        self.lib.cuGetErrorName(status, ctypes.byref(text))
        return text.value.decode() if text.value else str(status)

    def retry_in_context(self, status: int, device: int, what: str, function, *args) -> None:
        """After `function(*args)` (a driver call) returned a nonzero `status`: where the thread had no current
        context (one that has not touched CUDA through torch yet), make the device's current and call once more;
        raise RuntimeError naming `what` if that fails too, or at once for any other status."""
        if status == INVALID_CONTEXT:
            self.ensure_context(device)
            status = function(*args)
        if status:
            raise RuntimeError(f"{what} failed: {self.error_name(status)}")

    def ensure_context(self, device: int) -> None:
        """Make the device's primary context (torch's) current on this thread if none is."""
        ctx = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", ctypes.byref(ctx))
        if not ctx.value:
            dev = ctypes.c_int()
            self.check("cuDeviceGet", ctypes.byref(dev), device)
            self.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            self.check("cuCtxSetCurrent", ctx)


_DRIVER: _Driver | None = None


def driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


@dataclass
class Kernel:
    """One loaded kernel: `launch(grid, block, shared_bytes, stream, kinds, values)`."""

    module: ctypes.c_void_p
    function: ctypes.c_void_p
    name: str

    def attribute(self, name: str) -> int:
        value = ctypes.c_int()
        driver().check("cuFuncGetAttribute", ctypes.byref(value), _CU_FUNC_ATTRIBUTE[name], self.function)
        return value.value

    def allow_shared(self, nbytes: int) -> None:
        if nbytes > 48 * 1024:
            driver().check("cuFuncSetAttribute", self.function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED, nbytes)

    def prefer_max_shared(self) -> None:
        """Ask for the largest shared-memory carveout (a hint; the driver's default may size the carveout for
        fewer resident blocks than a kernel with large dynamic shared memory could have)."""
        self.prefer_carveout(100)

    def prefer_carveout(self, percent: int) -> None:
        """Ask for a shared-memory carveout of `percent` of the largest capacity (a hint; the rest stays L1)."""
        driver().check("cuFuncSetAttribute", self.function, _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_CARVEOUT, percent)

    def blocks_per_sm(self, threads: int, shared_bytes: int) -> int:
        """The driver's occupancy: resident blocks per SM at this block size and dynamic shared memory."""
        value = ctypes.c_int()
        driver().check("cuOccupancyMaxActiveBlocksPerMultiprocessor", ctypes.byref(value), self.function, threads,
                       ctypes.c_size_t(shared_bytes))
        return value.value

    def launch(self, grid, block, shared_bytes: int, stream: int, kinds: str, values) -> None:
        params, _held = pack_args(kinds, values)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        driver().check("cuLaunchKernel", self.function, gx, gy, gz, bx, by, bz, shared_bytes,
                       ctypes.c_void_p(stream), params, None)


def load(image: bytes, name: str, device: int = 0) -> Kernel:
    drv = driver()
    drv.ensure_context(device)
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    drv.check("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(image))
    drv.check("cuModuleGetFunction", ctypes.byref(function), module, name.encode())
    return Kernel(module, function, name)
