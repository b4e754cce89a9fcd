"""Which tensor-parallel rank a pack serves, and what to tell a user whose rank has no pack.

A pack's spec carries `rank` and `world` (tensor parallelism), so each rank's pack has its own key
and file name (`...rank<r>of<w>`). A reader for rank r of W only ever opens that file; these
helpers turn "missing" or "holds another rank" into an error that names what the folder holds
and the exact `tierstore pack` command that builds the pack the reader needs.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from tierstore.errors import PackFormatError
from tierstore.io.layout import PackSpec
from tierstore.io.pack import PackPaths
from tierstore.io.sidecar import read_sidecar


def rank_label(rank: int, world: int) -> str:
    """'whole experts (rank 0 of 1)' or 'rank r of W'."""
    return "whole experts (rank 0 of 1)" if world == 1 else f"rank {rank} of {world}"


def pack_command(checkpoint: Path | str, pack_dir: Path | str, tag: str, zero_mode: str, rank: int,
                 world: int) -> str:
    """The `tierstore pack` command line that builds the kernel-layout `tag` pack of rank `rank`
    of `world` (the single-GPU pack when world is 1)."""
    words = ["tierstore", "pack", str(checkpoint), "--out", str(pack_dir)]
    if tag != "base":
        words += ["--tier", tag]
    if zero_mode != "auto":
        words += ["--zero-mode", zero_mode]
    if world > 1:
        words += ["--tp-size", str(world), "--tp-rank", str(rank)]
    return shlex.join(words)


def same_pack_set(found: PackSpec, wanted: PackSpec) -> bool:
    """True when `found` is a pack of the same checkpoint, tier, layout and zero mode as `wanted`,
    whatever its rank geometry."""
    keys = ("tag", "num_layers", "num_experts", "checkpoint_id", "abi_tag", "zero_mode")
    return all(getattr(found, key) == getattr(wanted, key) for key in keys)


def ranks_present(pack_dir: Path | str, wanted: PackSpec) -> list[tuple[int, int]]:
    """(rank, world) of every pack in `pack_dir` of the same set as `wanted` (any rank geometry),
    sorted by world then rank. Unreadable sidecars are skipped."""
    found = set()
    for path in Path(pack_dir).glob(f"{wanted.tag}.v1.*.json"):
        try:
            spec = read_sidecar(path).spec
        except PackFormatError:
            continue
        if same_pack_set(spec, wanted):
            found.add((spec.rank, spec.world))
    return sorted(found, key=lambda rank_world: (rank_world[1], rank_world[0]))


def no_rank_pack(pack_dir: Path | str, wanted: PackSpec, reason: PackFormatError, checkpoint: Path | str,
                 zero_mode: str) -> PackFormatError:
    """The error for a reader of `wanted`'s rank that found no valid pack under its name: what is
    there instead (another rank's sidecar under this name, or the folder's other ranks) and the
    command that builds the right pack."""
    paths = PackPaths.for_spec(pack_dir, wanted)
    holds = ""
    try:
        under_name = read_sidecar(paths.sidecar).spec
    except PackFormatError:
        under_name = None
    if under_name is not None and (under_name.rank, under_name.world) != (wanted.rank, wanted.world):
        holds = f"; {paths.sidecar.name} holds {rank_label(under_name.rank, under_name.world)}"
    others = [rank_label(r, w) for r, w in ranks_present(pack_dir, wanted) if (r, w) != (wanted.rank, wanted.world)]
    if others:
        holds += f"; {pack_dir} has this checkpoint's {wanted.tag} packs of: {', '.join(others)}"
    command = pack_command(checkpoint, pack_dir, wanted.tag, zero_mode, wanted.rank, wanted.world)
    return PackFormatError(f"no valid {wanted.tag} pack of {rank_label(wanted.rank, wanted.world)} for {checkpoint} "
                           f"in {pack_dir} ({reason}){holds}; build it with: {command}")


def check_pack_rank(spec: PackSpec, rank: int, world: int, checkpoint: Path | str, pack_dir: Path | str,
                    zero_mode: str) -> None:
    """Refuse to serve a pack of another rank geometry to rank `rank` of `world`."""
    if (spec.rank, spec.world) != (rank, world):
        command = pack_command(checkpoint, pack_dir, spec.tag, zero_mode, rank, world)
        raise PackFormatError(f"the {spec.tag} pack holds {rank_label(spec.rank, spec.world)}, but this process is "
                              f"{rank_label(rank, world)} and needs its own pack: build it with: {command}")
