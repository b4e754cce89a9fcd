"""Capacity planner: what fits where, recommended pool sizes, and the working-set check.

The per-step working set is ``layers x top_k x tokens_per_step`` expert slots; a GPU pool below
1.15x of it is refused (it would thrash within one step), below 1.40x it works but is tight (the
reference system's factors).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.errors import CapacityError
from tierstore.geometry import MoEGeometry
from tierstore.sim.simulation import GIB

REFUSE_FACTOR = 1.15
COMFORT_FACTOR = 1.40


@dataclass(frozen=True)
class Plan:
    geometry: MoEGeometry
    w2_store_gib: float
    fp4_store_gib: float
    gpu_pool_slots: int
    gpu_pool_gib: float
    fp4_pool_slots: int
    fp4_pool_gib: float
    arena_slots: int | None  # None: the whole 2-bit store stays in pinned RAM
    arena_gib: float
    disk_gib: float
    working_set_slots: int
    verdict: str  # "resident", "comfortable", "tight" or "refused"
    notes: tuple[str, ...]

    @property
    def coverage(self) -> float:
        return self.gpu_pool_slots / self.geometry.total_routed_experts


def plan(geometry: MoEGeometry, gpu_gb: float, ram_gb: float, disk_gb: float | None = None,
         tokens_per_step: int = 1, gpu_reserve_gb: float = 4.0, ram_reserve_gb: float = 8.0) -> Plan:
    """Size the tiers for `geometry` on a GPU of `gpu_gb` and a host of `ram_gb` (GiB).

    `gpu_reserve_gb` stays free for everything but routed experts (dense weights, KV cache,
    activations); `ram_reserve_gb` for the OS and the process.
    """
    if gpu_gb <= 0 or ram_gb <= 0 or tokens_per_step < 1:
        raise CapacityError(f"need positive --gpu-gb, --ram-gb and tokens per step (got {gpu_gb}, {ram_gb}, {tokens_per_step})")
    g = geometry
    w2, fp4 = g.w2_expert_bytes, g.fp4_expert_bytes
    n = g.total_routed_experts
    w2_store, fp4_store = n * w2, n * fp4
    gpu_budget = max(0.0, gpu_gb - gpu_reserve_gb) * GIB
    ram_budget = max(0.0, ram_gb - ram_reserve_gb) * GIB
    working_set = g.num_moe_layers * g.top_k * tokens_per_step
    notes = []
    if w2_store <= gpu_budget:
        gpu_slots = n
        fp4_slots = int(min(gpu_budget - w2_store, fp4_store) // fp4)
        verdict = "resident"
        notes.append("the whole 2-bit base fits on the GPU: no fetches, no replays")
        if fp4_slots:
            notes.append(f"the remaining {fp4_slots * fp4 / GIB:.1f} GiB hold {fp4_slots} FP4 experts "
                         f"({100 * fp4_slots / n:.1f}%), policy freq")
    else:
        gpu_slots = int(gpu_budget // w2)
        fp4_slots = 0
        notes.append("the 2-bit base does not fit on the GPU: every GiB goes to the base pool (misses cost more "
                     "than FP4 quality); give the gate a small `need` FP4 pool only if replays are rare")
        ratio = gpu_slots / working_set
        verdict = "refused" if ratio < REFUSE_FACTOR else "tight" if ratio < COMFORT_FACTOR else "comfortable"
        if verdict == "refused":
            need_gib = REFUSE_FACTOR * working_set * w2 / GIB + gpu_reserve_gb
            notes.append(f"GPU pool of {gpu_slots} slots is below {REFUSE_FACTOR}x the per-step working set "
                         f"({working_set} slots): refused; a GPU with >= {need_gib:.1f} GiB would start")
        elif verdict == "tight":
            notes.append(f"GPU pool is {ratio:.2f}x the working set, below the {COMFORT_FACTOR}x comfort factor")
    missing_on_gpu = (n - gpu_slots) * w2
    if missing_on_gpu <= 0:
        arena_slots, arena_bytes = 0, 0.0
    elif w2_store <= ram_budget:
        arena_slots, arena_bytes = None, w2_store
        notes.append("the whole 2-bit store fits in pinned RAM: misses never touch the disk")
    else:
        arena_slots = int(ram_budget // w2)
        arena_bytes = arena_slots * w2
        notes.append(f"pinned arena of {arena_slots} rows ({100 * arena_slots / n:.1f}% of experts) over the pack on disk")
    disk_bytes = w2_store if missing_on_gpu > 0 else 0.0  # the pack backs every non-resident row
    if disk_gb is not None and disk_bytes / GIB > disk_gb:
        notes.append(f"the pack needs {disk_bytes / GIB:.1f} GiB but --disk-gb is {disk_gb}: does not fit")
        verdict = "refused"
    return Plan(geometry=g, w2_store_gib=w2_store / GIB, fp4_store_gib=fp4_store / GIB, gpu_pool_slots=gpu_slots,
                gpu_pool_gib=gpu_slots * w2 / GIB, fp4_pool_slots=fp4_slots, fp4_pool_gib=fp4_slots * fp4 / GIB,
                arena_slots=arena_slots, arena_gib=arena_bytes / GIB, disk_gib=disk_bytes / GIB,
                working_set_slots=working_set, verdict=verdict, notes=tuple(notes))
