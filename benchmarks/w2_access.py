"""What the single-token W2 gate_up's reads alone cost (benchmarks/w2_access.cu; cuda-w2-notes.md "v4"): a kernel
that reads, warp by warp and K tile by K tile, the bytes the gate_up reads at T = 1 on DeepSeek-V3's shapes (8
routed experts, 64 row tiles each) and only XORs them, at several depths of loads in flight (PROBE_AHEAD) and in two
patterns: the pool's row layout (the gate_up's own addresses) and the same bytes per warp and tile contiguous (a
layout that does not exist, as a comparison). One slot set per launch out of `--sets` (L2 defeated as in
benchmarks/moe_kernels.py), a CUDA graph of back-to-back launches replayed between two events, variants interleaved round by round, the median
per variant. The probe's output is checked against a torch XOR of the same bytes first (the row pattern at one depth
and the contiguous one), so the reads are the ones described.

More patterns (`--patterns`): `paired`, the row layout read with each load instruction covering one row's whole
128-byte K tile (a shuffle then gives every lane the row pattern's registers), and `*_prefetch`, the block's rows
first asked into L2 by bulk prefetches. `--memory host` puts the slots in pinned host memory, so the probe reads over
the bus as a streamed expert's arena row is read (`stream_arena`), and adds the copy engine's H2D copy of the same
bytes (`copy_engine`, one copy per expert) as the baseline a streamed read is charged against.

    python3 benchmarks/w2_access.py [--ahead 1,2,4,6] [--rounds 7] [--json PATH]
    python3 benchmarks/w2_access.py --memory host --hidden 2048 --inter 1408 --experts 1,4 \
        --patterns rows,paired,rows_prefetch,paired_prefetch,contiguous --ahead 1,2
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


PATTERNS = {  # name -> build defines (PROBE_AHEAD added per variant)
    "rows": {"PROBE_TILED": 0},
    "contiguous": {"PROBE_TILED": 1},
    "paired": {"PROBE_TILED": 0, "PROBE_PAIRED": 1},
    "rows_prefetch": {"PROBE_TILED": 0, "PROBE_PREFETCH": 1},
    "paired_prefetch": {"PROBE_TILED": 0, "PROBE_PAIRED": 1, "PROBE_PREFETCH": 1},
}


def _slots(count: int, slot_bytes: int, memory: str) -> torch.Tensor:
    """[count, slot_bytes] uint8 random bytes in device memory or in pinned host memory (read over the bus)."""
    if memory == "device":
        return torch.randint(-128, 128, (count, slot_bytes), dtype=torch.int8, device="cuda").view(torch.uint8)
    host = torch.randint(-128, 128, (count, slot_bytes), dtype=torch.int8).view(torch.uint8)
    return host.pin_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--experts", default="8", help="routed experts per launch (T = 1), one variant each: 1,2,4,8")
    parser.add_argument("--sets", type=int, default=8, help="slot sets of the largest --experts rotated across launches")
    parser.add_argument("--ahead", default="1,2,4,6", help="PROBE_AHEAD values, one variant per pattern each")
    parser.add_argument("--patterns", default="rows,contiguous", help=f"of {','.join(PATTERNS)}")
    parser.add_argument("--memory", choices=("device", "host"), default="device",
                        help="host: the slots in pinned host memory, read over the bus (as a streamed expert's arena "
                             "row), with the copy engine's H2D copy of the same bytes as a further variant")
    parser.add_argument("--launches", type=int, default=64, help="launches per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    patterns = args.patterns.split(",")
    unknown = [name for name in patterns if name not in PATTERNS]
    if unknown:
        raise SystemExit(f"unknown pattern(s) {unknown}: choose from {list(PATTERNS)}")
    expert_counts = [int(e) for e in args.experts.split(",")]
    device = torch.cuda.current_device()
    lay = w2_slot_layout(args.hidden, args.inter)
    m = lay.w13
    count = max(expert_counts) * args.sets
    slots = _slots(count, lay.slot_bytes, args.memory)
    tiles = m.words_per_row // 32
    per_expert = 2 * args.inter * tiles * (128 + 16)  # each row's words and scales, read once per launch
    if (args.inter // ROWS_PER_BLOCK) * 4 * tiles * CHUNK_BYTES > lay.slot_bytes - lay.w13_words_offset:
        raise SystemExit("the contiguous pattern would read past the slot")
    if lay.w13_scales_offset != lay.w13_words_offset + 2 * args.inter * tiles * 128:
        raise SystemExit("the w13 scales do not follow its words: the copy variant would copy other bytes")
    # launch i of `e` experts reads slot group i % (count // e): every launch of a replay reads slots the last
    # count // e - 1 launches did not
    groups = {e: [torch.arange(i * e, (i + 1) * e, dtype=torch.int32, device="cuda") for i in range(count // e)]
              for e in expert_counts}
    out = torch.empty((args.inter // ROWS_PER_BLOCK) * max(expert_counts) * THREADS, dtype=torch.int32, device="cuda")
    landing = torch.empty(max(expert_counts), per_expert, dtype=torch.uint8, device="cuda")

    kernels = {}
    for name in patterns:
        for ahead in (int(a) for a in args.ahead.split(",")):
            kernels[f"{name}_ahead{ahead}"] = (loader.load(loader.build(SOURCE, {**PATTERNS[name], "PROBE_AHEAD": ahead}),
                                                           "w2_access_probe", device), name, ahead)

    def launch(kernel, e, i):
        kernel.launch((e, args.inter // ROWS_PER_BLOCK), (THREADS,), 0, torch.cuda.current_stream().cuda_stream,
                      "pqqqiiipp", [slots.data_ptr(), lay.slot_bytes, lay.w13_words_offset, lay.w13_scales_offset,
                                    m.words_per_row, m.blocks_per_row, args.inter,
                                    groups[e][i % len(groups[e])].data_ptr(), out.data_ptr()])

    def copy(e, i):  # the copy engine: one H2D copy per expert of the bytes the probe reads (as an install's rows)
        group = i % len(groups[e])
        for j in range(e):
            s = group * e + j
            landing[j].copy_(slots[s, lay.w13_words_offset:lay.w13_words_offset + per_expert], non_blocking=True)

    checks = {}
    e0 = expert_counts[0]
    first = groups[e0][0].tolist()
    want = _xor_rows(slots, first, lay).reshape(-1).to("cuda")
    want_contiguous = _xor_contiguous(slots, first, lay).reshape(-1).to("cuda")
    for name, (kernel, pattern, _) in kernels.items():
        size = (args.inter // ROWS_PER_BLOCK) * e0 * THREADS
        out.fill_(0x7FC00000)  # poison
        launch(kernel, e0, 0)
        torch.cuda.synchronize()
        checks[name] = bool(torch.equal(out[:size], want_contiguous if pattern == "contiguous" else want))
    if args.memory == "host":
        landing.fill_(0)
        copy(e0, 0)
        torch.cuda.synchronize()
        checks["copy_engine"] = all(
            torch.equal(landing[j].cpu(), slots[s, lay.w13_words_offset:lay.w13_words_offset + per_expert])
            for j, s in enumerate(first))
    print("checks:", checks)

    variants = {}  # (name, experts) -> a callable issuing launch i
    for e in expert_counts:
        for name, (kernel, _, _) in kernels.items():
            variants[(name, e)] = (lambda i, kernel=kernel, e=e: launch(kernel, e, i))
        if args.memory == "host":
            variants[("copy_engine", e)] = (lambda i, e=e: copy(e, i))

    # Each variant's launches captured in one CUDA graph (a launch from Python takes longer than the kernel runs:
    # timed eagerly, the host's issue rate would be measured), replayed between two events.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = {}
    with torch.cuda.stream(stream):
        for key, issue in variants.items():
            for i in range(len(groups[key[1]])):  # warm-up outside the capture
                issue(i)
            graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[key], stream=stream):
                for i in range(args.launches):
                    issue(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {key: [] for key in variants}
    for key in variants:
        graphs[key].replay()
    for _ in range(args.rounds):
        for key in variants:
            torch.cuda.synchronize()
            start.record()
            graphs[key].replay()
            end.record()
            end.synchronize()
            times[key].append(1000 * start.elapsed_time(end) / args.launches)
    rows = []
    for (name, e), rounds_us in times.items():
        us = statistics.median(rounds_us)
        nbytes = e * per_expert
        kernel = kernels[name][0] if name in kernels else None
        rows.append(dict(variant=name, experts=e, pattern=kernels[name][1] if kernel else name,
                         ahead=kernels[name][2] if kernel else None, us=us, rounds_us=rounds_us,
                         gbs=nbytes / us / 1e3, pct_hbm=100 * nbytes / us / 1e6 / HBM_TBS,
                         registers=kernel.attribute("num_regs") if kernel else None,
                         local_bytes=kernel.attribute("local_bytes") if kernel else None,
                         check=checks[name]))
    print(f"{'variant':<22} {'experts':>7} {'us':>8} {'GB/s':>7} {'%HBM':>6} {'regs':>5} check")
    for r in rows:
        regs = "" if r["registers"] is None else r["registers"]
        print(f"{r['variant']:<22} {r['experts']:7d} {r['us']:8.2f} {r['gbs']:7.1f} {r['pct_hbm']:6.1f} {regs:>5} "
              f"{r['check']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(args.commit), memory=args.memory, bytes_per_expert=per_expert,
                           hidden=args.hidden, inter=args.inter, experts=expert_counts, sets=args.sets,
                           launches=args.launches, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
