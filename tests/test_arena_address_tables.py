"""The arena's row addresses as one array (`Arena.address_array`) and the stream table built from it
(`StreamRows.refresh`): equal to the list `locate` reads after every fetch, eviction and refresh, on fresh
random traffic."""

import random

import numpy as np
import pytest
import torch

from tierstore.cache.arena import Arena
from tierstore.errors import ConfigError
from tierstore.runtime.rows import MemoryRowSource
from tierstore.runtime.stream_rows import StreamRows

LAYERS, EXPERTS, ROW_BYTES = 3, 10, 96


def _source(seed: int) -> MemoryRowSource:
    generator = torch.Generator().manual_seed(seed)
    return MemoryRowSource(torch.randint(0, 256, (LAYERS, EXPERTS, ROW_BYTES), dtype=torch.uint8,
                                         generator=generator))


def _expected(arena: Arena) -> np.ndarray:
    return np.array([address or 0 for address in arena.address_table()], dtype=np.int64)


@pytest.mark.parametrize("num_slots", [LAYERS * EXPERTS, 12, 1])
def test_the_address_array_follows_every_publish_and_eviction(num_slots):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    arena = Arena(_source(seed), num_slots, pin=False)
    assert not arena.address_array().any()
    for _ in range(60):
        keys = [(rng.randrange(LAYERS), rng.randrange(EXPERTS)) for _ in range(rng.randint(1, num_slots))]
        arena.fetch(keys, scan=rng.random() < 0.2)
        assert np.array_equal(arena.address_array(), _expected(arena)), f"seed {seed}"
    with pytest.raises(ValueError):
        arena.address_array()[0] = 1  # a view the caller cannot write
    arena.close()


def test_stream_rows_publish_what_the_arena_holds_as_it_fills_and_evicts():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    source = _source(seed)
    arena = Arena(source, 12, pin=False)
    pool_slots = torch.empty(4, arena.stride, dtype=torch.uint8)  # only its address matters on a CPU
    table = StreamRows(pool_slots, LAYERS, EXPERTS)
    table.at.fill_(-7)  # poisoned: refresh must write every entry
    for _ in range(40):
        arena.fetch([(rng.randrange(LAYERS), rng.randrange(EXPERTS)) for _ in range(rng.randint(1, 6))])
        table.refresh(arena)
        addresses = _expected(arena)
        assert torch.equal(table.at, torch.from_numpy(np.where(addresses != 0, addresses - pool_slots.data_ptr(), 0)))
        for key_id in range(LAYERS * EXPERTS):
            row = table.row(key_id)
            if addresses[key_id]:
                layer, expert = divmod(key_id, EXPERTS)
                assert row.data_ptr() == addresses[key_id] and torch.equal(row, source.rows[layer, expert])
            else:
                assert row is None, f"seed {seed}: id {key_id} has a row the arena lost"
        assert table.complete == bool(addresses.all())
    arena.close()


def test_stream_rows_complete_once_the_arena_holds_every_row():
    arena = Arena(_source(0), LAYERS * EXPERTS, pin=False)
    table = StreamRows(torch.empty(1, arena.stride, dtype=torch.uint8), LAYERS, EXPERTS)
    keys = [(layer, expert) for layer in range(LAYERS) for expert in range(EXPERTS)]
    arena.fetch(keys[:-1], scan=True)
    table.refresh(arena)
    assert not table.complete and table.row(len(keys) - 1) is None
    arena.fetch(keys[-1:], scan=True)
    table.refresh(arena)
    assert table.complete and table.row(len(keys) - 1) is not None
    arena.close()


class _MisalignedArena:
    version = 1

    def address_array(self):
        return np.array([0, 4096 + 8, 0], dtype=np.int64)


def test_a_misaligned_row_is_refused_naming_its_address():
    table = StreamRows(torch.empty(1, 64, dtype=torch.uint8), 1, 3)
    with pytest.raises(ConfigError, match=r"0x1008 is not 16-byte aligned"):
        table.refresh(_MisalignedArena())
