"""numba CPU kernels for the requantization hot path (W2 nibbles + scales, zero counts; the slot
word packing is `tierstore.kernels._cpu_pack`).

They compute exactly what the torch path in `w2.py` computes, with the same float64 operations
(an IEEE division by an exact power of two, comparisons against the e2m1 midpoints), one fused
pass per 32-block instead of a dozen whole-tensor passes and `torch.bucketize`. Tests compare the
two byte for byte. numba is imported on first use only; `cache=True` keeps the compiled code.

The kernels are serial and release the GIL; large inputs run in row chunks on several threads
(`tierstore.kernels._cpu_pack.by_rows`; numba's own `parallel=True` launches a thread pool whose
size then may not change, which clashes with `tierstore bench sim` setting NUMBA_NUM_THREADS=1 in
the same process).
"""

from __future__ import annotations

import numpy as np

from tierstore.kernels._cpu_pack import by_rows, pack_words_cpu

_KERNELS = None


def _compile(threshold: float):
    import math

    from numba import njit

    @njit(cache=True, nogil=True)
    def quantize_rows(x, alt, nibbles, scale_bytes, bad_rows):
        """x float64 or float32 [N, K] (K % 32 == 0) -> nibbles uint8 [N, K], scale bytes uint8
        [N, K/32]; bad_rows[i] = 1 where row i holds a NaN/Inf (outputs then undefined)."""
        n, k = x.shape
        for i in range(n):
            for b in range(k // 32):
                base = 32 * b
                amax = 0.0
                finite = True
                for j in range(32):
                    v = abs(np.float64(x[i, base + j]))
                    if not (v <= 1.7976931348623157e308):  # NaN or Inf
                        finite = False
                    if v > amax:
                        amax = v
                if not finite:
                    bad_rows[i] = 1
                    break
                # w2_block_exponents: lower = floor(log2(amax)) - 3 clamped to [-128, 127]
                # (zero and float64 subnormals give -128), + 1 when amax >= threshold * 2^lower.
                if amax < 2.2250738585072014e-308:
                    lower = -128
                else:
                    lower = math.frexp(amax)[1] - 1 - 3
                    if lower < -128:
                        lower = -128
                    elif lower > 127:
                        lower = 127
                e = lower
                if amax >= threshold * math.ldexp(1.0, lower):
                    e += 1
                if e < -127:
                    e = -127
                elif e > 127:
                    e = 127
                scale_bytes[i, b] = e + 127
                scale = math.ldexp(1.0, e)
                for j in range(32):
                    w = np.float64(x[i, base + j])
                    u = w / scale
                    a = abs(u)
                    # bucketize(a, midpoints, right=False): how many midpoints lie strictly below a
                    m = ((a > 0.25) + (a > 0.75) + (a > 1.25) + (a > 1.75)
                         + (a > 2.5) + (a > 3.5) + (a > 5.0))
                    if math.copysign(1.0, u) < 0.0:
                        m += 8
                    if alt and w == 0.0:
                        m = 8 * ((base + j) % 2)
                    nibbles[i, base + j] = m

    @njit(cache=True, nogil=True)
    def zero_counts(flat):
        """(exact zeros, negative zeros) of a float64 or float32 1-D array."""
        zeros = 0
        negative = 0
        for idx in range(flat.shape[0]):
            v = flat[idx]
            if v == 0.0:
                zeros += 1
                if math.copysign(1.0, v) < 0.0:
                    negative += 1
        return zeros, negative

    return quantize_rows, zero_counts


def kernels():
    global _KERNELS
    if _KERNELS is None:
        from tierstore.formats.w2 import _ROUNDING_THRESHOLD

        _KERNELS = _compile(_ROUNDING_THRESHOLD)
    return _KERNELS


def quantize_w2_cpu(x: np.ndarray, alt: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(nibbles, scale bytes) of a C-contiguous float64/float32 [N, K], or None if it holds NaN/Inf."""
    n, k = x.shape
    nibbles = np.empty((n, k), dtype=np.uint8)
    scale_bytes = np.empty((n, k // 32), dtype=np.uint8)
    bad_rows = np.zeros(n, dtype=np.uint8)
    quantize_rows = kernels()[0]
    by_rows(lambda xs, nib, sb, bad: quantize_rows(xs, alt, nib, sb, bad), n, n * k,
            (x, nibbles, scale_bytes, bad_rows))
    if bad_rows.any():
        return None
    return nibbles, scale_bytes


def zero_counts_cpu(x: np.ndarray) -> tuple[int, int]:
    zeros, negative = kernels()[1](x.reshape(-1))
    return int(zeros), int(negative)


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels for the pack path's types (float64 weights,
    uint8 values), so a pack build pays for it before its first row rather than inside it."""
    x = np.zeros((1, 32), dtype=np.float64)
    quantize_w2_cpu(x, False)
    zero_counts_cpu(x)
    pack_words_cpu(np.zeros((1, 32), dtype=np.uint8), 32, 8, 4, np.zeros((8, 256), dtype=np.uint32))
