"""How fast the miss path's row copies can go: pinned arena rows to scattered pool slots, as `DevicePool` issues
them (one `cuMemcpyHtoDAsync` per row), beside the driver's batched copy (`cuMemcpyBatchAsync`, CUDA >= 12.8:
one call for many copies), per layer (an event after each layer's rows, as `layer_waits` needs) or whole, and
beside one contiguous copy of the same bytes (what the replay floor's pinned bandwidth measures). Rows of
ds-v2-lite's W2 slot size by default, 24 rows per fetch over 8 layers (the 25% step's size). Checks the bytes
of every variant against the source first (the pool poisoned before each variant), then times each variant
by device events (and the host time to issue it), interleaved round by round.

    python3 benchmarks/h2d_batch.py [--row-bytes N] [--rows 24] [--layers 8] [--rounds 60] [--json PATH]
"""
import argparse
import ctypes
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from h2d_rounds import check_rows, print_table, timed_rounds  # noqa: E402
from replay import provenance  # noqa: E402

from tierstore.kernels.cuda.loader import driver  # noqa: E402
from tierstore.kernels.layout import w2_slot_layout  # noqa: E402


class MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes_v1
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int), ("src_loc_id", ctypes.c_int),
                ("dst_loc_type", ctypes.c_int), ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-bytes", type=int, default=w2_slot_layout(2048, 1408).slot_bytes)
    parser.add_argument("--rows", type=int, default=24, help="rows per fetch")
    parser.add_argument("--layers", type=int, default=8, help="layers the rows spread over (an event after each)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lib = driver().lib
    driver().ensure_context(torch.cuda.current_device())
    memcpy = lib.cuMemcpyHtoDAsync_v2
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    batch = getattr(lib, "cuMemcpyBatchAsync_v2", None)  # CUDA 13: no failIdx
    if batch is not None:
        batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.POINTER(MemcpyAttributes), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    nbytes, rows = args.row_bytes, args.rows
    arena_rows, pool_slots = 4 * rows, 4 * rows
    arena = torch.randint(0, 256, (arena_rows, nbytes), dtype=torch.uint8).pin_memory()  # [A, B]
    pool = torch.empty(pool_slots, nbytes, dtype=torch.uint8, device="cuda")  # [S, B]
    contiguous = torch.empty(rows * nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(0)
    events = [torch.cuda.Event() for _ in range(args.layers)]
    attrs = MemcpyAttributes(ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)

    def layer_groups(n):
        bounds = [round(i * n / args.layers) for i in range(args.layers + 1)]
        return [range(bounds[i], bounds[i + 1]) for i in range(args.layers)]

    def plan():  # distinct scattered sources and destinations, as a fetch's arena hits and victims
        src = torch.randperm(arena_rows, generator=gen)[:rows].tolist()
        dst = torch.randperm(pool_slots, generator=gen)[:rows].tolist()
        return src, dst

    def per_row(src, dst):
        for group, event in zip(layer_groups(rows), events):
            for i in group:
                memcpy(pool[dst[i]].data_ptr(), arena[src[i]].data_ptr(), nbytes, stream.cuda_stream)
            event.record(stream)

    def batched(src, dst, per_layer=True):
        groups = layer_groups(rows) if per_layer else [range(rows)]
        for group, event in zip(groups, events):
            n = len(group)
            dsts = (ctypes.c_uint64 * n)(*[pool[dst[i]].data_ptr() for i in group])
            srcs = (ctypes.c_uint64 * n)(*[arena[src[i]].data_ptr() for i in group])
            sizes = (ctypes.c_size_t * n)(*([nbytes] * n))
            index = (ctypes.c_size_t * 1)(0)
            status = batch(dsts, srcs, sizes, n, ctypes.byref(attrs), index, 1, stream.cuda_stream)
            if status:
                raise RuntimeError(f"cuMemcpyBatchAsync_v2 failed: {status}")
            event.record(stream)

    def one_copy(src, dst):
        memcpy(contiguous.data_ptr(), arena[0].data_ptr(), rows * nbytes, stream.cuda_stream)

    variants = {"per_row": per_row, "one_copy": one_copy}
    if batch is not None:
        variants["batch_per_layer"] = batched
        variants["batch_whole"] = lambda s, d: batched(s, d, per_layer=False)
    # correctness: every scattered variant lands the right bytes in the right slots
    for name, fn in variants.items():
        if name == "one_copy":
            continue
        src, dst = plan()
        pool.fill_(0xA5)
        fn(src, dst)
        stream.synchronize()
        check_rows(name, pool, arena, src, dst)
    results = timed_rounds(variants, plan, stream, args.rounds, rows * nbytes)
    print_table(results, rows, nbytes, args.layers, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(args.commit),
                           method=dict(row_bytes=nbytes, rows=rows, layers=args.layers, rounds=args.rounds,
                                       statistic="median after 5", batch_api=batch is not None),
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
