"""What the single-token W2 gate_up's reads alone cost (benchmarks/w2_access.cu; cuda-w2-notes.md "v4"): a kernel
that reads, warp by warp and K tile by K tile, the bytes the gate_up reads at T = 1 on DeepSeek-V3's shapes (8
routed experts, 64 row tiles each) and only XORs them, at several depths of loads in flight (PROBE_AHEAD) and in two
patterns: the pool's row layout (the gate_up's own addresses) and the same bytes per warp and tile contiguous (a
layout that does not exist, as a comparison). One slot set per launch out of `--sets` (L2 defeated as in
benchmarks/moe_kernels.py), a CUDA graph of back-to-back launches replayed between two events, variants interleaved round by round, the median
per variant. The probe's output is checked against a torch XOR of the same bytes first (the row pattern at one depth
and the contiguous one), so the reads are the ones described.

    python3 benchmarks/w2_access.py [--ahead 1,2,4,6] [--rounds 7] [--json PATH]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
from replay import provenance  # noqa: E402

from tierstore.kernels.cuda import loader  # noqa: E402
from tierstore.kernels.layout import w2_slot_layout  # noqa: E402

SOURCE = Path(__file__).resolve().with_name("w2_access.cu")  # the benchmark's own kernel: the library does not use it
THREADS, ROWS_PER_BLOCK, CHUNK_BYTES = 128, 32, 2304
HBM_TBS = 4.8


def _xor_rows(slots, slot_ids, lay) -> torch.Tensor:
    """The probe's per-thread XOR for the row pattern, in torch: [blocks_y, blocks_x, 128] int32 (thread w * 32 +
    g * 4 + c of block (x, y) reads gate row n = 32y + 8w + g and up row n + inter: uint4 8t + c and 8t + 4 + c of
    each row's words and uint4 t of each row's scales, for every K tile t)."""
    m = lay.w13
    row_vecs, scale_vecs, inter = m.words_per_row // 4, m.blocks_per_row // 16, lay.inter
    tiles = m.words_per_row // 32
    out = []
    for s in slot_ids:
        slot = slots[s]
        words = slot[lay.w13_words_offset:lay.w13_words_offset + 2 * inter * row_vecs * 16].view(torch.int32)
        words = words.view(2 * inter, tiles, 2, 4, 4)  # [rows, tile, half, c, word]
        scales = slot[lay.w13_scales_offset:lay.w13_scales_offset + 2 * inter * scale_vecs * 16].view(torch.int32)
        scales = scales.view(2 * inter, scale_vecs, 4)[:, :tiles]  # [rows, tile, word]
        w = words[..., 0] ^ words[..., 1] ^ words[..., 2] ^ words[..., 3]  # [rows, tile, half, c]
        w = w[:, :, 0] ^ w[:, :, 1]  # [rows, tile, c]
        sc = scales[..., 0] ^ scales[..., 1] ^ scales[..., 2] ^ scales[..., 3]  # [rows, tile]
        per_tile = w ^ sc[..., None]  # [rows, tile, c]
        acc = per_tile[:, 0]
        for t in range(1, tiles):
            acc = acc ^ per_tile[:, t]
        lane = acc[:inter] ^ acc[inter:]  # gate row n with up row n: [inter, c]
        out.append(lane.view(inter // ROWS_PER_BLOCK, 128))  # [y, w * 32 + g * 4 + c]
    return torch.stack(out, dim=1)  # [blocks_y, blocks_x, 128]


def _xor_contiguous(slots, slot_ids, lay) -> torch.Tensor:
    """The same for the contiguous pattern: warp w of block (x, y) reads chunk (4y + w) * tiles + t of 2304 bytes
    from the slot's w13 words on: uint4 32j + lane for j < 4, and the scale pair 128 + 2g, 129 + 2g."""
    tiles, blocks_y = lay.w13.words_per_row // 32, lay.inter // ROWS_PER_BLOCK
    base, ints = lay.w13_words_offset, CHUNK_BYTES // 4
    out = []
    for s in slot_ids:
        region = slots[s, base:base + blocks_y * 4 * tiles * CHUNK_BYTES].view(torch.int32)
        region = region.view(blocks_y, 4, tiles, ints)  # [y, warp, t, int]
        words = region[..., :512].reshape(blocks_y, 4, tiles, 4, 32, 4)  # [y, warp, t, j, lane, word]
        w = words[..., 0] ^ words[..., 1] ^ words[..., 2] ^ words[..., 3]
        w = w[:, :, :, 0] ^ w[:, :, :, 1] ^ w[:, :, :, 2] ^ w[:, :, :, 3]  # [y, warp, t, lane]
        sc = region[..., 512:].reshape(blocks_y, 4, tiles, 8, 2, 4)  # [y, warp, t, g, gate / up, word]
        sc = sc[..., 0] ^ sc[..., 1] ^ sc[..., 2] ^ sc[..., 3]
        sc = (sc[..., 0] ^ sc[..., 1]).repeat_interleave(4, dim=-1)  # [y, warp, t, lane]
        acc = w ^ sc
        lane = acc[:, :, 0]
        for t in range(1, tiles):
            lane = lane ^ acc[:, :, t]
        out.append(lane.reshape(blocks_y, 128))
    return torch.stack(out, dim=1)  # [blocks_y, blocks_x, 128]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8, help="routed experts per launch (T = 1, top-8)")
    parser.add_argument("--sets", type=int, default=8, help="slot sets rotated across launches")
    parser.add_argument("--ahead", default="1,2,4,6", help="PROBE_AHEAD values, one variant per pattern each")
    parser.add_argument("--launches", type=int, default=64, help="launches per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.cuda.current_device()
    lay = w2_slot_layout(args.hidden, args.inter)
    m = lay.w13
    count = args.experts * args.sets
    slots = torch.randint(-128, 128, (count, lay.slot_bytes), dtype=torch.int8, device="cuda").view(torch.uint8)
    slot_of = [torch.arange(i * args.experts, (i + 1) * args.experts, dtype=torch.int32, device="cuda")
               for i in range(args.sets)]
    grid = (args.experts, args.inter // ROWS_PER_BLOCK)
    out = torch.empty(grid[1] * grid[0] * THREADS, dtype=torch.int32, device="cuda")
    tiles = m.words_per_row // 32
    nbytes = args.experts * 2 * args.inter * tiles * (128 + 16)  # per launch: each row's words and scales read once
    if (args.inter // ROWS_PER_BLOCK) * 4 * tiles * CHUNK_BYTES > lay.slot_bytes - lay.w13_words_offset:
        raise SystemExit("the contiguous pattern would read past the slot")

    variants = {}
    for tiled in (0, 1):
        for ahead in (int(a) for a in args.ahead.split(",")):
            kernel = loader.load(loader.build(SOURCE, {"PROBE_AHEAD": ahead, "PROBE_TILED": tiled}),
                                 "w2_access_probe", device)
            variants[f"{'contiguous' if tiled else 'rows'}_ahead{ahead}"] = (kernel, tiled, ahead)

    def launch(kernel, s):
        kernel.launch(grid, (THREADS,), 0, torch.cuda.current_stream().cuda_stream, "pqqqiiipp",
                      [slots.data_ptr(), lay.slot_bytes, lay.w13_words_offset, lay.w13_scales_offset,
                       m.words_per_row, m.blocks_per_row, args.inter, slot_of[s].data_ptr(), out.data_ptr()])

    checks = {}
    want = _xor_rows(slots, slot_of[0].tolist(), lay).reshape(-1)
    want_contiguous = _xor_contiguous(slots, slot_of[0].tolist(), lay).reshape(-1)
    for name, (kernel, tiled, _) in variants.items():
        out.fill_(0x7FC00000)  # poison
        launch(kernel, 0)
        torch.cuda.synchronize()
        if tiled:
            checks[name] = bool(torch.equal(out, want_contiguous))
        else:
            checks[name] = bool(torch.equal(out, want))
    print("checks:", checks)

    # Each variant's launches captured in one CUDA graph (a launch from Python takes longer than the kernel runs:
    # timed eagerly, the host's issue rate would be measured), replayed between two events.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = {}
    with torch.cuda.stream(stream):
        for name, (kernel, _, _) in variants.items():
            for s in range(args.sets):  # warm-up outside the capture
                launch(kernel, s)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name], stream=stream):
                for i in range(args.launches):
                    launch(kernel, i % args.sets)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in variants}
    for name in variants:
        graphs[name].replay()
    for _ in range(args.rounds):
        for name in variants:
            torch.cuda.synchronize()
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(1000 * start.elapsed_time(end) / args.launches)
    rows = []
    for name, (kernel, tiled, ahead) in variants.items():
        us = statistics.median(times[name])
        rows.append(dict(variant=name, pattern="contiguous" if tiled else "rows", ahead=ahead, us=us,
                         rounds_us=times[name], gbs=nbytes / us / 1e3, pct_hbm=100 * nbytes / us / 1e6 / HBM_TBS,
                         registers=kernel.attribute("num_regs"), local_bytes=kernel.attribute("local_bytes"),
                         check=checks[name]))
    print(f"{'variant':<20} {'us':>7} {'GB/s':>7} {'%HBM':>6} {'regs':>5} check")
    for r in rows:
        print(f"{r['variant']:<20} {r['us']:7.2f} {r['gbs']:7.0f} {r['pct_hbm']:6.1f} {r['registers']:5d} {r['check']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(args.commit), bytes_per_launch=nbytes, hidden=args.hidden,
                           inter=args.inter, experts=args.experts, sets=args.sets, launches=args.launches,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
