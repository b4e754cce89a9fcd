"""`tierstore generate CHECKPOINT --prompt TEXT`: greedy generation with the tiered runtime (packs
built or reused, a small device pool, KPIs printed); `--verify-resident` checks every step's
logits bit for bit against an all-resident run; `--fp4-pool-*`, `--gate*` add the precision tier,
`--verify-fp4` checks fired steps against an all-FP4 run."""

from __future__ import annotations

import argparse
import sys

from tierstore.cache.slots import ARENA_POLICIES
from tierstore.commands.flags import add_cuda_w2_flag


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text with the tiered runtime and print its KPIs")
    parser.add_argument("checkpoint", nargs="?", help="HF checkpoint directory (bf16/fp16/fp32 non-expert weights)")
    parser.add_argument("--demo", action="store_true", help="use the built-in tiny demo model (built on first use)")
    parser.add_argument("--prompt", default="The quick brown fox", help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--gpu-pool-gb", type=float, help="device pool size in GiB")
    pool.add_argument("--gpu-pool-frac", type=float, help="device pool as a fraction of the routed experts (default 0.25)")
    parser.add_argument("--arena-gb", default="auto",
                        help="host arena in GiB, or auto (the whole pack when it takes at most half of the host's "
                        "available memory, else a quarter of it)")
    parser.add_argument("--pack-dir", help="pack directory (default $TIERSTORE_CACHE_DIR/packs)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--policy", default="freq-dense",
                        help="eviction policy of the device pool (default freq-dense, the runtime's default)")
    parser.add_argument("--arena-policy", choices=ARENA_POLICIES, default="lru",
                        help="what a full host arena evicts: the least recently used row (default) or the row asked "
                             "for least (freq-dense)")
    parser.add_argument("--replay-mode", choices=("strict", "approximate"), default="strict")
    parser.add_argument("--miss-tol", type=int, default=0, help="missing pairs a step may keep without a replay (degraded)")
    parser.add_argument("--fp-max", type=int, default=32, help="replays per step before strict mode gives up")
    parser.add_argument("--force-pool", action="store_true", help="start even below the per-step working set")
    parser.add_argument("--no-cuda-graph", action="store_true", help="run the decode step eagerly on cuda")
    parser.add_argument("--early-fetch", action="store_true",
                        help="fetch each finished MoE layer's misses while the decode pass still runs (config early_fetch)")
    parser.add_argument("--gather-in-pass", action="store_true",
                        help="each decode pass maps and copies its own missing arena rows (config gather_in_pass)")
    parser.add_argument("--pass-pair", action=argparse.BooleanOptionalAction, default="auto",
                        help="a decode step likely to miss launches its pass and the replay together, the first "
                             "pass copying its missing arena rows while it runs (config pass_pair; default: auto, "
                             "on CUDA where it can run, off on a CPU)")
    add_cuda_w2_flag(parser, "the model's")
    parser.add_argument("--verify-resident", action="store_true",
                        help="rerun all-resident and compare every step's logits bit for bit")
    parser.add_argument("--record-trace", help="save the decode steps' routing as a tierstore trace (.npz)")
    fp4 = parser.add_mutually_exclusive_group()
    fp4.add_argument("--fp4-pool-gb", type=float, help="FP4 precision pool size in GiB (builds the fp4 pack)")
    fp4.add_argument("--fp4-pool-frac", type=float, help="FP4 pool as a fraction of the routed experts")
    parser.add_argument("--fp4-policy", default="freq", help="FP4 pool policy: freq (default), need, lru, ...")
    parser.add_argument("--gate", action="store_true", help="arm the confidence gate (needs an FP4 pool)")
    parser.add_argument("--gate-tau", type=float, help="fire when the signal is <= tau (default 0.60 max_prob, 1.5 margin)")
    parser.add_argument("--gate-signal", choices=("max_prob", "margin"), default="max_prob")
    parser.add_argument("--gate-dump", help="append one JSON line per gate fire to this file")
    parser.add_argument("--verify-fp4", action="store_true",
                        help="rerun the same tokens all-FP4; every fired step's logits must be bit-identical")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierstore.errors import ConfigError
    from tierstore.runtime.cli_generate import generate_command

    if args.demo == (args.checkpoint is not None):
        raise ConfigError("give either a checkpoint directory or --demo")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return generate_command(args, out=sys.stdout)
