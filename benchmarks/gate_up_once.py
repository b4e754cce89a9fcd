"""One W2 (or with --fp4 FP4) gate_up build launched a few times on DeepSeek-V3's shapes at T = 1 (8 routed experts,
random codes, scale bytes 110-130), for a profiler to pick a launch (`ncu --kernel-name w2_gate_up_mma` or
`fp4_gate_up_mma`, `--launch-skip 2 --launch-count 1`; cuda-w2-notes.md "v4", cuda-fp4-notes.md "v2"). Not a timing:
the benchmarks are benchmarks/cuda_w2.py and cuda_fp4.py.

    python3 benchmarks/gate_up_once.py [--stages N] [--v3] [--mad] [--fp4]
"""
import argparse

import torch

from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_route, w2_tier
from tierstore.kernels.cuda.fp4_stages import Fp4GateUpCuda
from tierstore.kernels.cuda.w2_gate_up import W2GateUpCuda


def random_pool(pool) -> None:
    """Random code words and scale bytes 110-130 in every slot; expert e in slot e."""
    lay = pool.layout
    pool.slots.copy_(torch.randint(0, 256, pool.slots.shape, dtype=torch.uint8, device="cuda"))
    for offset, m in ((lay.w13_scales_offset, lay.w13), (lay.w2_scales_offset, lay.w2)):
        pool.slots[:, offset:offset + m.scale_bytes] = torch.randint(110, 131, (pool.slots.shape[0], m.scale_bytes),
                                                                     dtype=torch.uint8, device="cuda")
    pool.table[0] = torch.arange(pool.slots.shape[0], dtype=torch.int32, device="cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--stages", type=int, default=0)
    parser.add_argument("--v3", action="store_true", help="the early prologue and the pairs grid (the adopted build)")
    parser.add_argument("--mad", action="store_true",
                        help="W2: slot pairs 0..4 decoded by a multiply-add (W2_DECODE_MAD); FP4: FP4_DECODE_MAD")
    parser.add_argument("--fp4", action="store_true", help="the single-token FP4 gate_up (FP4_AHEAD 2), every expert FP4")
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    experts, top_k = 8, 8
    w2 = w2_tier(args.hidden, args.inter, experts, 1, experts, "cuda")
    f4 = fp4_tier(args.hidden, args.inter, experts if args.fp4 else 1, 1, experts, "cuda")
    random_pool(f4 if args.fp4 else w2)
    ids = torch.arange(experts, dtype=torch.int32, device="cuda").view(1, top_k)
    ws = MoeWorkspace.allocate(1, top_k, experts, args.hidden, args.inter, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, w2, f4, 0, MissLog.allocate(4, "cuda"), ws)
    x = torch.randn(1, args.hidden, device="cuda").to(torch.bfloat16)
    if args.fp4:
        kernel = Fp4GateUpCuda(ahead=2, mad=args.mad)
        launch = lambda: kernel(x, top_k, f4, 0, ws)
    else:
        options = dict(early=True, pairs_grid=True) if args.v3 else {}
        kernel = W2GateUpCuda(ahead=2, stages=args.stages, mad=args.mad, **options)
        launch = lambda: kernel(x, top_k, w2, f4, 0, ws)
    for _ in range(args.launches):
        launch()
    torch.cuda.synchronize()
    print("act finite:", bool(ws.act.isfinite().all()), tuple(ws.act.shape))


if __name__ == "__main__":
    main()
