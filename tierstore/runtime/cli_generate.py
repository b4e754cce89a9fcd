"""What `tierstore generate` does: build or reuse the pack, open a tiered model, generate, print
the text and the KPIs, and optionally verify against an all-resident run."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tierstore.atomic_files import cache_dir
from tierstore.cache.arena import arena_slots, available_host_bytes
from tierstore.checkpoint import open_checkpoint
from tierstore.kernels.layout import w2_slot_layout
from tierstore.runtime.cli_fp4 import fp4_config, fp4_slots, report_fp4_verification, wants_fp4
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.demo import demo_checkpoint
from tierstore.runtime.engine import TieredRuntime, slots_for
from tierstore.runtime.generation import TieredGenerator
from tierstore.runtime.hf import install_tiered_experts, load_model, load_tokenizer
from tierstore.runtime.packs import ensure_base_pack, open_base_rows


def first_differing_step(got: list[torch.Tensor], want: list[torch.Tensor]) -> int | None:
    """Index of the first step whose logits are not bit-identical (or whose count differs), else None."""
    for step, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            return step
    return None if len(got) == len(want) else min(len(got), len(want))


def _runtime(checkpoint, pack_dir, geometry, pool_slots, arena, device, config, record, fp4=0) -> TieredRuntime:
    rows = open_base_rows(checkpoint, pack_dir)
    available = available_host_bytes() if arena == "auto" else None  # auto: the FP4 arena sized after the base one's
    slots = arena_slots(arena, rows.stride, rows.stride * geometry.total_routed_experts, available)
    fp4_rows = open_base_rows(checkpoint, pack_dir, tag="fp4") if fp4 else None
    fp4_arena = arena_slots(arena, fp4_rows.stride, fp4_rows.stride * geometry.total_routed_experts,
                            available - slots * rows.stride if available is not None else None) if fp4 else 0
    # the token is folded into the pass-log read, except in a pool that reads no pass once every expert is installed:
    # the generator then reads it itself
    unread = (pool_slots >= geometry.total_routed_experts
              and not config.full_pool_reads_passes(fp4=bool(fp4), records=bool(record)))
    return TieredRuntime(geometry, rows, pool_slots=pool_slots, arena_slots=slots, device=device, config=config,
                         heat_path=rows.pack.paths.heat, record_tokens=1 if record else 0,
                         output_words=0 if unread else 1, fp4_source=fp4_rows, fp4_slots=fp4 or None,
                         fp4_arena_slots=fp4_arena)


def generate_command(args, out) -> int:
    checkpoint = Path(demo_checkpoint(progress=True) if args.demo else args.checkpoint)
    pack_dir = Path(args.pack_dir) if args.pack_dir else cache_dir() / "packs"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    started = time.perf_counter()
    with open_checkpoint(checkpoint) as ckpt:
        geometry = ckpt.geometry
    fp4 = fp4_slots(args, geometry)
    tags = ("base", "fp4") if wants_fp4(args) else ("base",)
    report = ensure_base_pack(checkpoint, pack_dir, device=device.type, tags=tags)
    for tag in tags:
        print(f"pack: {report.packs[tag]} (built {len(report.written[tag])} layers, reused "
              f"{len(report.skipped[tag])}) in {time.perf_counter() - started:.1f} s", file=out)
    config = RuntimeConfig(replay_mode=args.replay_mode, miss_tolerance=args.miss_tol, fp_max=args.fp_max,
                           policy=args.policy, arena_policy=args.arena_policy, force_pool=args.force_pool,
                           early_fetch=args.early_fetch,
                           gather_in_pass=args.gather_in_pass, pass_pair=args.pass_pair, cuda_w2=args.cuda_w2, kpi_every=0,
                           **fp4_config(args))
    slot_bytes = w2_slot_layout(geometry.hidden, geometry.expert_inter).slot_bytes
    fraction = args.gpu_pool_frac if args.gpu_pool_frac is not None else (None if args.gpu_pool_gb else 0.25)
    pool_slots = slots_for(geometry, slot_bytes, gib=args.gpu_pool_gb, fraction=fraction)
    model = load_model(checkpoint, dtype, device)
    tokenizer = load_tokenizer(checkpoint, model.config.vocab_size)
    prompt = tokenizer.encode(args.prompt)
    max_length = len(prompt) + args.max_new_tokens + 1
    use_graph = device.type == "cuda" and not args.no_cuda_graph

    runtime = _runtime(checkpoint, pack_dir, geometry, pool_slots, args.arena_gb, device, config, args.record_trace, fp4)
    with runtime:
        if runtime.pool.num_slots >= geometry.total_routed_experts:  # a pool of every expert starts with them all
            loading = time.perf_counter()
            runtime.preload()
            print(f"pool: every expert installed ({geometry.total_routed_experts}) in "
                  f"{time.perf_counter() - loading:.1f} s", file=out)
        install_tiered_experts(model, runtime)
        result = TieredGenerator(model, runtime, max_length, use_graph).generate(
            prompt, args.max_new_tokens, keep_logits=args.verify_resident or args.verify_fp4,
            record_routing=bool(args.record_trace))
        stats = runtime.stats()
        kpi = runtime.kpi_line()
    decode_steps = max(len(result.new_ids) - 1, 0)
    chunked = (f"; prefill in steps of {result.prefill_chunk} tokens (a layer's routed experts for the whole prompt "
               f"would not fit the pool)" if result.prefill_chunk < len(prompt) else "")
    print(f"prompt: {args.prompt!r} ({len(prompt)} tokens, {type(tokenizer).__name__}){chunked}", file=out)
    print(f"output: {tokenizer.decode(result.new_ids)!r}", file=out)
    print(f"tokens: {len(result.new_ids)} new in {result.seconds:.2f} s "
          f"({decode_steps / result.decode_seconds if result.decode_seconds else 0:.1f} decode steps/s); device {device}, "
          f"{geometry.num_moe_layers} MoE layers x {geometry.num_experts} experts, pool {stats.pool_slots} slots "
          f"({100 * stats.pool_coverage:.0f}%), cuda graph: {'yes' if result.cuda_graph else 'no'}", file=out)
    print(kpi, file=out)
    if args.record_trace:
        _save_trace(args.record_trace, geometry, result, out)
    status = 0
    if args.verify_fp4:
        everything = geometry.total_routed_experts
        reference_config = RuntimeConfig(replay_mode=args.replay_mode, fp_max=args.fp_max, policy=args.policy,
                                         force_pool=args.force_pool, kpi_every=0, fp4_policy="need",
                                         cuda_w2=args.cuda_w2)  # the same kernels as the compared run
        all_fp4 = _runtime(checkpoint, pack_dir, geometry, pool_slots, args.arena_gb, device, reference_config, False,
                           everything)
        with all_fp4:
            all_fp4.preload_fp4()
            install_tiered_experts(model, all_fp4)
            reference = TieredGenerator(model, all_fp4, max_length, use_graph).generate(
                prompt, args.max_new_tokens, keep_logits=True, forced_ids=result.new_ids,
                prefill_chunk=result.prefill_chunk)
        status = report_fp4_verification(result, reference, out)
    if not args.verify_resident:
        return status

    everything = geometry.total_routed_experts
    resident = _runtime(checkpoint, pack_dir, geometry, everything, args.arena_gb, device, config, False)
    with resident:
        resident.preload()
        install_tiered_experts(model, resident)
        reference = TieredGenerator(model, resident, max_length, use_graph).generate(
            prompt, args.max_new_tokens, keep_logits=True, prefill_chunk=result.prefill_chunk)
    differs = first_differing_step(result.step_logits, reference.step_logits)
    if differs is None:
        print(f"bit-identical: yes ({len(result.step_logits)} steps)", file=out)
        return status
    print(f"bit-identical: NO: step {differs} differs from the all-resident run "
          f"({len(result.step_logits)} vs {len(reference.step_logits)} steps)", file=out)
    return 1


def _save_trace(path, geometry, result, out) -> None:
    from tierstore.sim.recorder import TraceRecorder

    recorder = TraceRecorder(geometry.num_moe_layers, geometry.top_k, geometry.num_experts, source="tierstore generate")
    for routing in result.routing:
        recorder.record_step(routing)
    if result.routing:
        print(f"trace: {recorder.save(path)} ({len(result.routing)} decode steps)", file=out)
