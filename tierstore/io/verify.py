"""Checking a pack directory: every sidecar against its pack file, every written row against its
checksum. Reads sidecars as untrusted input and never touches a file outside the directory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tierstore.errors import PackFormatError, ReadError
from tierstore.io.checksum import row_checksum
from tierstore.io.pack import PackPaths, check_pack_file, locked
from tierstore.io.readers.preadv_pool import PreadvPoolReader
from tierstore.io.readers.base import ReadOp
from tierstore.io.sidecar import read_sidecar

ROWS_PER_BATCH = 16


@dataclass
class PackReport:
    sidecar: Path
    layers: int = 0
    rows_checked: int = 0
    bad_rows: list[tuple[int, int]] = field(default_factory=list)
    problem: str | None = None

    @property
    def sound(self) -> bool:
        return self.problem is None and not self.bad_rows


def verify_pack(sidecar_path: Path) -> PackReport:
    report = PackReport(sidecar_path)
    stem = sidecar_path.name[:-len(".json")]
    paths = PackPaths(sidecar_path.parent, stem)
    try:
        claimed = read_sidecar(sidecar_path)  # parsed before any lock file is created for it
        if claimed.spec.file_stem() != stem:
            raise PackFormatError(f"{sidecar_path.name} describes pack {claimed.spec.file_stem()}, not {stem}")
        with locked(paths, exclusive=False):
            sidecar = read_sidecar(sidecar_path)
            if sidecar.spec != claimed.spec:
                raise PackFormatError(f"{sidecar_path.name} changed during verification; rerun")
            check_pack_file(paths, sidecar.spec)
            reader = PreadvPoolReader(paths.pack, threads=4)
    except (PackFormatError, ReadError) as exc:
        report.problem = str(exc)
        return report
    spec = sidecar.spec
    report.layers = len(sidecar.layers)
    keys = [(layer, expert) for layer in sorted(sidecar.layers) for expert in range(spec.num_experts)]
    buffer = bytearray(ROWS_PER_BATCH * spec.row_bytes)
    view = memoryview(buffer)
    with reader:
        for start in range(0, len(keys), ROWS_PER_BATCH):
            batch = keys[start:start + ROWS_PER_BATCH]
            dests = [view[i * spec.row_bytes:(i + 1) * spec.row_bytes] for i in range(len(batch))]
            try:
                reader.read([ReadOp(spec.row_offset(*key), dest) for key, dest in zip(batch, dests)])
            except OSError as exc:
                report.problem = f"read failed: {exc}"
                return report
            for key, dest in zip(batch, dests):
                if row_checksum(dest) != sidecar.checksums[key[0]][key[1]]:
                    report.bad_rows.append(key)
            report.rows_checked += len(batch)
    return report


def verify_directory(directory: Path | str) -> list[PackReport]:
    """A report per sidecar (`*.json` other than heat files) in `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PackFormatError(f"{directory} is not a directory")
    sidecars = sorted(p for p in directory.glob("*.json") if not p.name.endswith(".heat.json") and p.is_file())
    return [verify_pack(path) for path in sidecars]
