"""The precision-tier part of `tierstore generate`: FP4 pool size and gate knobs from the flags,
and `--verify-fp4` (the same tokens through an all-FP4 runtime, logits compared bit for bit on
every step the gate fired)."""

from __future__ import annotations

import torch

from tierstore.errors import ConfigError
from tierstore.geometry import MoEGeometry
from tierstore.kernels.layout import fp4_slot_layout
from tierstore.runtime.engine import slots_for


def wants_fp4(args) -> bool:
    return args.fp4_pool_gb is not None or args.fp4_pool_frac is not None


def fp4_slots(args, geometry: MoEGeometry) -> int:
    """FP4 pool slots from --fp4-pool-gb / --fp4-pool-frac (0 without either)."""
    if not wants_fp4(args):
        if args.gate or args.verify_fp4:
            raise ConfigError("--gate and --verify-fp4 need an FP4 pool: give --fp4-pool-gb or --fp4-pool-frac")
        return 0
    slot_bytes = fp4_slot_layout(geometry.hidden, geometry.expert_inter).slot_bytes
    return slots_for(geometry, slot_bytes, gib=args.fp4_pool_gb, fraction=args.fp4_pool_frac)


def fp4_config(args) -> dict:
    """RuntimeConfig fields of the precision tier."""
    return dict(fp4_policy=args.fp4_policy, gate=args.gate, gate_tau=args.gate_tau, gate_signal=args.gate_signal,
                gate_dump=args.gate_dump or "", force_fp4_pool=args.force_pool)


def fired_steps_match(result, reference) -> tuple[bool, int, list[int]]:
    """(ok, fired steps, steps that differ): every fired step's logits must equal the reference's;
    when every decode step fired, every step (the FP4 prefill too) must."""
    fired = [step for step, hit in enumerate(result.fired) if hit]
    every = len(result.fired) > 1 and all(result.fired[1:])
    checked = range(len(result.step_logits)) if every else fired
    differ = [s for s in checked if s >= len(reference.step_logits)
              or not torch.equal(result.step_logits[s], reference.step_logits[s])]
    return not differ, len(fired), differ


def report_fp4_verification(result, reference, out) -> int:
    ok, fired, differ = fired_steps_match(result, reference)
    if ok:
        print(f"bit-identical to all-FP4: yes ({fired} fired steps)", file=out)
        return 0
    print(f"bit-identical to all-FP4: NO: steps {differ[:8]} differ ({fired} fired steps)", file=out)
    return 1
