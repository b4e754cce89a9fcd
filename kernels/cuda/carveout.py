"""The shared-memory carveout a kernel asks the driver for: the smallest Hopper capacity that holds a launch's
resident blocks ("fit"), the rest of the SM's 256 KB left to L1."""

from __future__ import annotations

# Hopper SM shared-memory capacities (KB) a carveout can select, and the driver's reserve per resident block.
CARVEOUT_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
RESERVED_PER_BLOCK = 1024


def fit_carveout(smem: int, blocks: int) -> int:
    """The carveout preference (percent of the largest capacity) of the smallest capacity that holds `blocks` blocks
    of `smem` dynamic bytes plus the driver's reserve each; the rest of the SM's 256 KB stays L1."""
    need = blocks * (smem + RESERVED_PER_BLOCK)
    kb = next((kb for kb in CARVEOUT_KB if kb * 1024 >= need), None)
    if kb is None:
        raise ValueError(f"{blocks} blocks of {smem} shared bytes do not fit an SM ({CARVEOUT_KB[-1]} KB)")
    return -(-100 * kb // CARVEOUT_KB[-1])


class FitCarveout:
    """Asks a loaded kernel's `fit_carveout` for `blocks` resident blocks whenever a launch's dynamic shared memory
    differs from the one it last asked for (a launch calls `launch(smem)` before it starts)."""

    def __init__(self, kernel, blocks: int) -> None:
        self.kernel, self.blocks, self._smem = kernel, blocks, None

    def launch(self, smem: int) -> None:
        if smem != self._smem:
            self.kernel.prefer_carveout(fit_carveout(smem, self.blocks))
            self._smem = smem
