"""numba kernels for the default single-pool semantics (LRU and Belady MIN).

They replay the same hook sequence as `engine.TierEngine` with `lru` / `belady` policy objects
(hits accessed in routed order, then misses inserted in routed order, victims never keys of the
current step, overflow when nothing else is left) and must give identical counts; tests check it.
numba is imported on first use only.
"""

from __future__ import annotations

import numpy as np

_KERNELS = None


def _compile():
    import numba
    from numba import njit

    @njit(cache=True, nogil=True)
    def lru(keys, counts, offsets, num_keys, capacity):
        nsteps = len(offsets) - 1
        prev = np.full(num_keys, -1, np.int64)  # toward the LRU end
        nxt = np.full(num_keys, -1, np.int64)  # toward the MRU end
        resident = np.zeros(num_keys, np.bool_)
        stamp = np.full(num_keys, -1, np.int64)  # step that last routed the key
        hit_pairs = np.zeros(nsteps, np.int64)
        miss_keys = np.zeros(nsteps, np.int64)
        mru = -1
        lru_end = -1
        size = 0
        for s in range(nsteps):
            lo, hi = offsets[s], offsets[s + 1]
            for i in range(lo, hi):
                stamp[keys[i]] = s
            for i in range(lo, hi):  # hits: move to the MRU end
                k = keys[i]
                if resident[k]:
                    hit_pairs[s] += counts[i]
                    if k != mru:
                        p, n = prev[k], nxt[k]
                        if p >= 0:
                            nxt[p] = n
                        else:
                            lru_end = n
                        prev[n] = p
                        prev[k] = mru
                        nxt[k] = -1
                        nxt[mru] = k
                        mru = k
            for i in range(lo, hi):  # misses: insert at the MRU end
                k = keys[i]
                if resident[k]:
                    continue
                miss_keys[s] += 1
                while size >= capacity and lru_end >= 0 and stamp[lru_end] != s:
                    v = lru_end
                    lru_end = nxt[v]
                    if lru_end >= 0:
                        prev[lru_end] = -1
                    else:
                        mru = -1
                    resident[v] = False
                    size -= 1
                resident[k] = True
                size += 1
                prev[k] = mru
                nxt[k] = -1
                if mru >= 0:
                    nxt[mru] = k
                else:
                    lru_end = k
                mru = k
        return hit_pairs, miss_keys

    @njit(cache=True, nogil=True)
    def next_uses(keys, offsets, num_keys):
        """For each (step, key) entry, the next step routing the key (nsteps if never)."""
        nsteps = len(offsets) - 1
        out = np.empty(len(keys), np.int64)
        last = np.full(num_keys, nsteps, np.int64)
        for s in range(nsteps - 1, -1, -1):
            for i in range(offsets[s], offsets[s + 1]):
                out[i] = last[keys[i]]
            for i in range(offsets[s], offsets[s + 1]):
                last[keys[i]] = s
        return out

    @njit(cache=True, nogil=True)
    def heap_push(heap, n, value):
        i = n
        heap[i] = value
        while i > 0:
            parent = (i - 1) >> 1
            if heap[parent] >= heap[i]:
                break
            heap[parent], heap[i] = heap[i], heap[parent]
            i = parent
        return n + 1

    @njit(cache=True, nogil=True)
    def heap_pop(heap, n):
        top = heap[0]
        n -= 1
        heap[0] = heap[n]
        i = 0
        while True:
            left = 2 * i + 1
            if left >= n:
                break
            child = left
            if left + 1 < n and heap[left + 1] > heap[left]:
                child = left + 1
            if heap[i] >= heap[child]:
                break
            heap[i], heap[child] = heap[child], heap[i]
            i = child
        return top, n

    @njit(cache=True, nogil=True)
    def belady(keys, counts, offsets, num_keys, capacity, next_use):
        nsteps = len(offsets) - 1
        resident = np.zeros(num_keys, np.bool_)
        current = np.full(num_keys, -1, np.int64)  # heap entry that is valid for a resident key
        heap = np.empty(len(keys) + 1, np.int64)  # one push per entry: never overflows
        n = 0
        hit_pairs = np.zeros(nsteps, np.int64)
        miss_keys = np.zeros(nsteps, np.int64)
        size = 0
        for s in range(nsteps):
            lo, hi = offsets[s], offsets[s + 1]
            for i in range(lo, hi):  # hits; step keys stay out of the heap until the step ends
                k = keys[i]
                if resident[k]:
                    hit_pairs[s] += counts[i]
                current[k] = -1
            for i in range(lo, hi):
                k = keys[i]
                if resident[k]:
                    continue
                miss_keys[s] += 1
                while size >= capacity and n > 0:
                    top, n = heap_pop(heap, n)
                    v = top % num_keys
                    if resident[v] and current[v] == top:
                        resident[v] = False
                        current[v] = -1
                        size -= 1
                resident[k] = True
                size += 1
            for i in range(lo, hi):
                k = keys[i]
                current[k] = next_use[i] * num_keys + k
                n = heap_push(heap, n, current[k])
        return hit_pairs, miss_keys

    del numba
    return {"lru": lru, "belady": belady, "next_uses": next_uses}


def kernels():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _compile()
    return _KERNELS


FAST_POLICIES = ("lru", "belady")


def run_fast(policy: str, keys: np.ndarray, counts: np.ndarray, offsets: np.ndarray, num_keys: int,
             capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step (hit pairs, missed keys) for one global pool of `capacity` slots."""
    k = kernels()
    keys = np.ascontiguousarray(keys, np.int64)
    counts = np.ascontiguousarray(counts, np.int64)
    offsets = np.ascontiguousarray(offsets, np.int64)
    if policy == "lru":
        return k["lru"](keys, counts, offsets, num_keys, capacity)
    if policy == "belady":
        return k["belady"](keys, counts, offsets, num_keys, capacity, k["next_uses"](keys, offsets, num_keys))
    raise ValueError(f"no fast path for policy {policy!r}; fast policies: {', '.join(FAST_POLICIES)}")
