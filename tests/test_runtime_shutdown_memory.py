"""Issue 5 §5: shutdown releases pinned memory. After `close()`, while the caller still holds the
runtime, the arena's host allocation and the other page-locked host buffers (on CUDA) are freed;
reopening on the same pack works. On the CPU device these buffers are ordinary memory, the release
path is the same."""

import gc
import weakref

import torch
from test_runtime_fixtures import ToyMoE
from test_runtime_reliability import hostile_tokens, packed  # noqa: F401 (module fixture)

from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.packs import open_base_rows


def allocation(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns `tensor`'s memory (a view keeps it alive)."""
    return tensor if tensor._base is None else tensor._base


def host_buffers(runtime) -> dict[str, weakref.ref]:
    """Weak references to the runtime's host allocations (pinned on CUDA) and the arena itself."""
    staged = {f"pool staged table {i}.{j}": weakref.ref(allocation(table))
              for i, buffers in enumerate(runtime.pool._installs) for j, table in enumerate(buffers.staged)}
    return {
        "arena": weakref.ref(runtime.arena),
        "arena slot memory": weakref.ref(allocation(runtime.arena.memory)),
        "arena staging": weakref.ref(allocation(runtime.arena._staging)),
        **staged,
        "pass log host copy": weakref.ref(allocation(runtime.log._host)),
    }


def test_close_releases_the_host_buffers_and_reopening_works(packed):  # noqa: F811
    """Each run's host buffers are gone after close() + gc while `runtime` is still referenced, and a
    second runtime on the same pack returns the same logits."""
    ckpt, packs, g = packed
    model = ToyMoE(g, seed=3)
    runs = []
    for _ in range(2):
        runtime = TieredRuntime(g, open_base_rows(ckpt, packs, direct=False), pool_slots=12, arena_slots=16,
                                config=RuntimeConfig(kpi_every=0))
        with runtime:
            logits = []
            for step in range(6):
                x = hostile_tokens(g, step, 1)  # [1, H]
                logits.append(runtime.step(lambda: model.forward(runtime, x), lambda: None)[0])
            buffers = host_buffers(runtime)
            assert all(ref() is not None for ref in buffers.values())
        gc.collect()
        assert runtime.closed
        assert [name for name, ref in buffers.items() if ref() is not None] == []
        runs.append(torch.cat(logits))  # [6, H]
    assert torch.equal(runs[0], runs[1])
