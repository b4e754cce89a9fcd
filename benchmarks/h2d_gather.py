"""The miss path's row copies issued by the host one per row (`cuMemcpyHtoDAsync`, what `DevicePool` does) against one
kernel launch per layer that reads the pinned rows over the bus itself (`gather_rows` in kernels/cuda/pass_gather.cu;
`benchmarks/row_gather.cu` until the runtime's own row kernel shared its copy loop), and the pass pair's own copy
(`gather_pass_rows`: a fixed grid of G blocks sharing every row of a layer, the count and descriptors in device
memory as its plan leaves them; built with U loads in flight per thread): the host's time to issue a fetch's
copies and the device's time to land them. Rows of ds-v2-lite's W2 slot size by default, 24
rows per fetch over 8 layers (the 25% step's size), scattered arena rows to scattered pool slots, an event after
each layer's rows as `layer_waits` records. Every variant's bytes are checked against the source first (the pool
poisoned before each), then the variants are timed interleaved, round by round; pointers are computed before the
clock starts, so the host time is the issuing alone.

    python3 benchmarks/h2d_gather.py [--rows 24] [--layers 8] [--blocks 8,32] [--pass-grids 4,16]
        [--unrolls 8,16] [--rounds 60] [--json PATH]
"""
import argparse
import ctypes
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from h2d_rounds import check_rows, print_table, timed_rounds  # noqa: E402
from replay import provenance  # noqa: E402

from tierstore.kernels.cuda import loader, pass_gather  # noqa: E402
from tierstore.kernels.layout import w2_slot_layout  # noqa: E402

THREADS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-bytes", type=int, default=w2_slot_layout(2048, 1408).slot_bytes)
    parser.add_argument("--rows", type=int, default=24, help="rows per fetch")
    parser.add_argument("--layers", type=int, default=8, help="layers the rows spread over (an event after each)")
    parser.add_argument("--blocks", default="8,32", help="gather kernel blocks per row, one variant each")
    parser.add_argument("--pass-grids", default="4,16", help="the pair's copy kernel: blocks per layer, a variant each")
    parser.add_argument("--unrolls", default="8", help="the pair's copy kernel: loads in flight per thread (builds)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.cuda.current_device()
    drv = loader.driver()
    drv.ensure_context(device)
    memcpy = drv.lib.cuMemcpyHtoDAsync_v2
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    kernel = loader.load(loader.build(pass_gather.SOURCE), "gather_rows", device)
    unrolls = [int(u) for u in args.unrolls.split(",")]
    pass_kernels = {u: loader.load(loader.build(pass_gather.SOURCE, defines={"TS_COPY_UNROLL": u}),
                                   "gather_pass_rows", device) for u in unrolls}
    nbytes, rows = args.row_bytes, args.rows
    if nbytes % 16:
        raise SystemExit("--row-bytes must be a multiple of 16")
    arena = torch.randint(0, 256, (4 * rows, nbytes), dtype=torch.uint8).pin_memory()  # [A, B] pinned
    pool = torch.empty(4 * rows, nbytes, dtype=torch.uint8, device="cuda")  # [S, B]
    desc = torch.zeros(args.layers + 1, 3 * rows, dtype=torch.int64).pin_memory()  # per launch: (src, dst, bytes) x n
    desc_np = desc.numpy()
    stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(0)
    events = [torch.cuda.Event() for _ in range(args.layers)]
    bounds = [round(i * rows / args.layers) for i in range(args.layers + 1)]
    groups = [range(bounds[i], bounds[i + 1]) for i in range(args.layers)]
    pass_desc = torch.zeros(args.layers, rows, 2, dtype=torch.int64, device="cuda")  # [L, R, (src, dst)]
    pass_counts = torch.zeros(args.layers, dtype=torch.int32, device="cuda")  # [L] rows of each layer's plan

    def plan():  # distinct scattered sources and destinations (a fetch's arena hits and victims), as addresses
        src = torch.randperm(arena.shape[0], generator=gen)[:rows].tolist()
        dst = torch.randperm(pool.shape[0], generator=gen)[:rows].tolist()
        a, p = arena.data_ptr(), pool.data_ptr()
        return [a + s * nbytes for s in src], [p + d * nbytes for d in dst], src, dst

    def per_row(srcs, dsts):
        for group, event in zip(groups, events):
            for i in group:
                memcpy(dsts[i], srcs[i], nbytes, stream.cuda_stream)
            event.record(stream)

    def gather(srcs, dsts, blocks, per_layer=True):
        parts = groups if per_layer else [range(rows)]
        for slot, group in enumerate(parts):
            n = len(group)
            if n == 0:
                if per_layer:
                    events[slot].record(stream)
                continue
            row = desc_np[slot]
            row[0:3 * n:3] = [srcs[i] for i in group]
            row[1:3 * n:3] = [dsts[i] for i in group]
            row[2:3 * n:3] = nbytes
            kernel.launch((blocks, n), (THREADS,), 0, stream.cuda_stream, "p", [desc.data_ptr() + slot * desc.stride(0) * 8])
            if per_layer:
                events[slot].record(stream)

    def fresh_plan():  # a plan, also written where the pair's plan kernel leaves it (device memory), before the clock
        srcs, dsts, src, dst = plan()
        desc_host = torch.zeros(args.layers, rows, 2, dtype=torch.int64)
        for layer, group in enumerate(groups):
            for k, i in enumerate(group):
                desc_host[layer, k] = torch.tensor([srcs[i], dsts[i]])
        pass_desc.copy_(desc_host)
        pass_counts.copy_(torch.tensor([len(g) for g in groups], dtype=torch.int32))
        torch.cuda.synchronize()
        return srcs, dsts, src, dst

    def pass_rows(blocks, unroll):  # the pair's side-stream copy: one launch per layer, the grid fixed
        for layer, event in enumerate(events):
            pass_kernels[unroll].launch((blocks,), (THREADS,), 0, stream.cuda_stream, "ppqp",
                                        [pass_counts[layer:].data_ptr(), pass_desc[layer].data_ptr(), nbytes, 0])
            event.record(stream)

    variants = {"per_row": per_row}
    for blocks in (int(b) for b in args.blocks.split(",")):
        variants[f"gather_layer_b{blocks}"] = lambda s, d, b=blocks: gather(s, d, b)
        variants[f"gather_whole_b{blocks}"] = lambda s, d, b=blocks: gather(s, d, b, per_layer=False)
    for grid in (int(g) for g in args.pass_grids.split(",")):
        for unroll in unrolls:
            variants[f"pass_g{grid}_u{unroll}"] = lambda s, d, g=grid, u=unroll: pass_rows(g, u)
    for name, fn in variants.items():  # correctness: the right bytes in the right slots
        srcs, dsts, src, dst = fresh_plan()
        pool.fill_(0xA5)
        torch.cuda.synchronize()
        fn(srcs, dsts)
        stream.synchronize()
        check_rows(name, pool, arena, src, dst)
    results = timed_rounds(variants, lambda: fresh_plan()[:2], stream, args.rounds, rows * nbytes)
    print_table(results, rows, nbytes, args.layers, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(args.commit),
                           method=dict(row_bytes=nbytes, rows=rows, layers=args.layers, rounds=args.rounds,
                                       threads=THREADS, pass_grids=args.pass_grids, unrolls=unrolls,
                                       statistic="median after 5"),
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
