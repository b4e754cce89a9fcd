"""numba CPU kernel for the kernel slot layout's word packing (`layout.pack_w2_words` /
`pack_fp4_words` on CPU tensors), and the row-chunk threading the CPU requantization kernels share.

Serial kernels that release the GIL; large inputs are split into row chunks run on
`torch.get_num_threads()` Python threads (numba's own `parallel=True` would launch a thread pool
whose size may not change afterwards). numba is imported on first use only; `cache=True` keeps
the compiled code.
"""

from __future__ import annotations

import numpy as np

_PACK_WORDS = None


def _compile_pack_words():
    from numba import njit

    @njit(cache=True, nogil=True)
    def pack_words(values, k_pad, vpw, wps, bits, out):
        """Kernel slot words (as uint32) of values uint8 [N, K]: word t * wps + u ORs bits[j, v] of
        the value v at k = t * vpw * wps + j * wps + u (v = 0 past K, as the torch path pads)."""
        n, k = values.shape
        tile = vpw * wps
        for i in range(n):
            for t in range(k_pad // tile):
                for u in range(wps):
                    word = np.uint32(0)
                    for j in range(vpw):
                        kk = t * tile + j * wps + u
                        word |= bits[j, values[i, kk] if kk < k else 0]
                    out[i, t * wps + u] = word

    return pack_words


_MIN_CHUNK_VALUES = 1 << 20  # below this per thread, one call
_POOL = None  # (workers, ThreadPoolExecutor), grown on demand


def by_rows(kernel, rows: int, values: int, split) -> None:
    """kernel(*split arrays cut to a row chunk) over all rows, on several threads when large."""
    import torch

    workers = max(1, min(torch.get_num_threads(), rows, values // _MIN_CHUNK_VALUES))
    if workers == 1:
        kernel(*split)
        return
    global _POOL
    if _POOL is None or _POOL[0] < workers:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = (workers, ThreadPoolExecutor(workers, thread_name_prefix="tierstore-requant"))
    bounds = [rows * w // workers for w in range(workers + 1)]
    jobs = [_POOL[1].submit(kernel, *(a[lo:hi] for a in split)) for lo, hi in zip(bounds, bounds[1:])]
    for job in jobs:
        job.result()


def pack_words_cpu(values: np.ndarray, k_pad: int, vpw: int, wps: int, bits: np.ndarray) -> np.ndarray:
    """int32 [N, k_pad / vpw] slot words of uint8 values [N, K]; bits: uint32 [vpw, 256], the word
    bits value v sets in bit slot j (see `pack_words`)."""
    global _PACK_WORDS
    if _PACK_WORDS is None:
        _PACK_WORDS = _compile_pack_words()
    pack_words = _PACK_WORDS
    out = np.empty((values.shape[0], k_pad // vpw), dtype=np.uint32)
    by_rows(lambda vals, words: pack_words(vals, k_pad, vpw, wps, bits, words), values.shape[0], values.size,
            (values, out))
    return out.view(np.int32)
