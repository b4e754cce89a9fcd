"""The precision-tier part of `tierstore generate`: FP4 pool size and gate knobs from the flags,
and `--verify-fp4` (the same tokens through an all-FP4 runtime, logits compared bit for bit on
every fired step whose context is all-FP4, see `fired_steps_match`)."""

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


def fired_steps_match(result, reference) -> tuple[bool, int, list[int], list[int]]:
    """(ok, fired steps, steps compared, steps that differ).

    A step's logits depend on its own pass and on the KV cache every earlier step wrote, so a fired
    step is comparable with the all-FP4 run only when it and every step before it (the prefill
    included) ran only FP4 experts (`result.all_fp4`). When every decode step fired, every step
    (the FP4 prefill too) must match, comparable or not: the FP4 pool then holds each step's
    routed set, so anything else is a failure."""
    fired = [step for step, hit in enumerate(result.fired) if hit]
    every = len(result.fired) > 1 and all(result.fired[1:])
    if every:
        compared = list(range(len(result.step_logits)))
    else:
        history_fp4 = [all(result.all_fp4[:step + 1]) for step in range(len(result.all_fp4))]
        compared = [step for step in fired if step < len(history_fp4) and history_fp4[step]]
    differ = [s for s in compared if s >= len(reference.step_logits)
              or not torch.equal(result.step_logits[s], reference.step_logits[s])]
    return not differ, len(fired), compared, differ


def report_fp4_verification(result, reference, out) -> int:
    ok, fired, compared, differ = fired_steps_match(result, reference)
    fired_compared = sum(result.fired[s] for s in compared)
    skipped = fired - fired_compared
    note = (f"; {skipped} fired after a step that used W2 experts, so their context differs from the "
            "all-FP4 run's and they are not compared" if skipped else "")
    if ok:
        print(f"bit-identical to all-FP4: yes ({fired_compared} of {fired} fired steps compared{note})", file=out)
        return 0
    print(f"bit-identical to all-FP4: NO: steps {differ[:8]} differ ({fired_compared} of {fired} fired steps "
          f"compared{note})", file=out)
    return 1
