"""Set-up shared by the CUDA kernel tests (test_cuda_w2.py, test_cuda_w2_multi.py, test_cuda_fp4.py): random slot
bytes and the GPU cases' pools, byte comparison, the kernels' signature kinds and ptxas reports, a slot's words as
the numpy models read them, plain-torch stand-in stages, the whole op on fresh NaN-poisoned buffers and its
CUDA-graph capture."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_mm, route_blocks, w2_tier
from tierstore.kernels.cuda import loader
from tierstore.kernels.layout import unpack_matrix_ref

M32 = 0xFFFFFFFF
needs_nvcc = pytest.mark.skipif(loader.nvcc_path() is None, reason="needs nvcc")


# ---- pools -----------------------------------------------------------------------------------------------

def random_slots(slots: torch.Tensor, layout, gen: torch.Generator, lo: int, hi: int) -> torch.Tensor:
    """Fills `slots` [N, slot_bytes] in place: random code words, scale bytes in [lo, hi) (w13's, then w2's)."""
    slots.copy_(torch.randint(0, 256, slots.shape, generator=gen, dtype=torch.uint8))
    for offset, m in ((layout.w13_scales_offset, layout.w13), (layout.w2_scales_offset, layout.w2)):
        part = torch.randint(lo, hi, (slots.shape[0], m.scale_bytes), generator=gen, dtype=torch.uint8)
        slots[:, offset: offset + m.scale_bytes] = part
    return slots


def random_pool(pool, gen: torch.Generator, lo: int = 110, hi: int = 131) -> None:
    """Random code words, scale bytes in [lo, hi), in every slot of `pool`."""
    random_slots(pool.slots, pool.layout, gen, lo, hi)


def w2_pool(hidden: int, inter: int, experts: int, gen: torch.Generator, scales=(110, 131), missing=None):
    """A CPU W2 pool of one layer with a random slot per expert, expert e in slot e; `missing` has no slot."""
    w2 = w2_tier(hidden, inter, experts, 1, experts, "cpu")
    random_pool(w2, gen, *scales)
    w2.table[0] = torch.arange(experts, dtype=torch.int32)
    if missing is not None:
        w2.table[0, missing] = -1
    return w2


def fp4_pool(hidden: int, inter: int, experts: int, resident=None):
    """A CPU FP4 pool of one (zero) slot and one layer; expert `resident` (None: none) maps to that slot."""
    f4 = fp4_tier(hidden, inter, 1, 1, experts, "cpu")
    if resident is not None:
        f4.table[0, resident] = 0
    return f4


def launched_twice(kernels: dict, like: torch.Tensor, fill: float, launch) -> dict:
    """{key: [first, second]}: each of `kernels` launched by `launch(kernel, out)` into two outputs shaped as `like`
    and filled with `fill` (NaN, or a value no kernel writes), kernel by kernel in order."""
    outs = {}
    for key, kernel in kernels.items():
        outs[key] = [torch.full_like(like, fill) for _ in range(2)]
        for out in outs[key]:
            launch(kernel, out)
    return outs


def to_cuda(pool):
    return type(pool)(pool.slots.cuda(), pool.table.cuda(), pool.layout)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(view), b.view(view))  # NaN rows compare too


# ---- host side: signatures, builds, the models' reads --------------------------------------------------------

def signature_kinds(source: str, kernel: str = "w2_gate_up_mma") -> str:
    """The launch argument kinds of `kernel`'s parameters in `source`: p pointer, q long long, f float, i int."""
    params = re.search(kernel + r"\((.*?)\)\s*\{", source, re.S).group(1)
    kinds = ""
    for p in re.sub(r"//[^\n]*", "", params).split(","):
        p = p.strip()
        kinds += "p" if "*" in p else "q" if p.startswith("long long") else "f" if p.startswith("float") else "i"
    return kinds


def ptxas_report(source, out, defines: dict) -> str:
    """nvcc's stderr with `-Xptxas -v` for a cubin of `source` built into `out`; the build must succeed."""
    cmd = loader.nvcc_command(source, out, "cubin", defines) + ["-Xptxas", "-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def registers(report: str) -> int:
    """The first `Used N registers` of a ptxas report."""
    return int(re.search(r"Used (\d+) registers", report).group(1))


def slot_rows(slot: torch.Tensor, layout, which: str) -> tuple[list[list[int]], list[list[int]]]:
    """A matrix's words [N][words_per_row] and scale words [N][blocks_per_row / 4] as unsigned ints."""
    m = getattr(layout, which)
    w_off, s_off = getattr(layout, f"{which}_words_offset"), getattr(layout, f"{which}_scales_offset")
    words = (slot[w_off: w_off + m.word_bytes].view(torch.int32).to(torch.int64) & M32).view(m.n, m.words_per_row)
    scales = (slot[s_off: s_off + m.scale_bytes].view(torch.int32).to(torch.int64) & M32).view(m.n, -1)
    return words.tolist(), scales.tolist()


def bf16_bits(v: torch.Tensor) -> list[int]:
    """The bf16 bit patterns of `v` as unsigned ints."""
    return (v.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()


def bench_module(name: str):
    """benchmarks/<name>.py as a module (by path: `benchmarks` is no package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_on_cpu(monkeypatch, bench, kb, build, geometry: tuple) -> None:
    """A benchmark script (`bench`, with benchmarks/moe_kernels.py as `kb`) set up for its CPU test: DEVICE "cpu", `build`
    as its `_build`, the preset "tiny" of one layer with `geometry` = (experts, top_k, hidden, inter), every variant
    launched once and timed 10 us, the streaming ceiling 5 us, bf16 50 us."""
    import tierstore.geometry
    from tierstore.geometry import _preset

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "_build", build)
    monkeypatch.setattr(tierstore.geometry, "get_preset", lambda name: _preset("tiny", 1, *geometry))
    monkeypatch.setattr(kb, "_graph_time_us", lambda fns, reps: (fns[0](), 10.0)[1])  # one launch of each variant
    monkeypatch.setattr(kb, "_stream_us", lambda nbytes, copies, reps, device: 5.0)
    monkeypatch.setattr(kb, "_bf16_case", lambda geo, w13, w2d, routings, reps: 50.0)


# ---- plain-torch stand-ins for the CUDA stages (CPU) -------------------------------------------------------

def placed(ws):
    """(expert, pair) of every routed pair of a workspace's route output, any block size."""
    for expert, pairs in route_blocks(ws):
        for pair in pairs:
            yield expert, pair


def gate_up_ref(slot: torch.Tensor, layout, x: torch.Tensor, limit=None) -> torch.Tensor:
    """float32 silu(gate) * up of one pair from the slot's unpacked w13, gate and up clamped by `limit`."""
    gate, up = (unpack_matrix_ref(slot, layout, "w13") @ x.float()).chunk(2)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def down_ref(slot: torch.Tensor, layout, act: torch.Tensor) -> torch.Tensor:
    """float32 y of one pair from the slot's unpacked w2."""
    return unpack_matrix_ref(slot, layout, "w2") @ act.float()


# ---- the whole op on a GPU ---------------------------------------------------------------------------------

def run_whole(x, ids, weights, w2, f4, cuda_w2, inter: int, experts: int, miss_rows: int, block_tokens: int = 1,
              limit=None, out=None):
    """moe_mm with `cuda_w2` on a fresh workspace (act and y NaN-poisoned) and miss log, into `out` (default a
    NaN-poisoned one): (out, miss counts, miss entries) after a synchronize."""
    ws = MoeWorkspace.allocate(ids.shape[0], ids.shape[1], experts, x.shape[1], inter, torch.bfloat16, "cuda",
                               block_tokens=block_tokens)
    ws.act.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    misses = MissLog.allocate(miss_rows, "cuda")
    out = torch.full_like(x, float("nan")) if out is None else out
    moe_mm(x, ids, weights, w2, f4, 0, misses, ws, out=out, swiglu_limit=limit, cuda_w2=cuda_w2)
    torch.cuda.synchronize()
    return out, misses.counts.tolist(), misses.entries.tolist()


def side_stream():
    """A new stream that waits for the current one (captures run on it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def warm_up(call, stream) -> None:
    """`call()` once on `stream` (Triton compiles outside capture), then the current stream waits; synchronized."""
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def captured(call, stream):
    """A CUDA graph of `call()` captured on `stream`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    return graph


def replayed_once(call, misses, out):
    """The whole op's graph test: `call()` warmed up on a side stream, `misses` reset and `out` NaN-filled, captured,
    replayed once and synchronized; returns the graph."""
    stream = side_stream()
    warm_up(call, stream)
    misses.reset()
    out.fill_(float("nan"))
    graph = captured(call, stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph


# ---- builds without nvcc or a GPU ---------------------------------------------------------------------------

def stub_builds(monkeypatch) -> tuple[list, list]:
    """Kernel wrappers built without nvcc or a device: loader.build records (source file name, defines), loader.load
    returns a stand-in that records its carveout requests (True for prefer_max_shared, the percent for
    prefer_carveout). Returns (builds, carveout requests)."""
    built, carveouts = [], []

    class Loaded:
        def prefer_max_shared(self):
            carveouts.append(True)

        def prefer_carveout(self, percent):
            carveouts.append(percent)

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(loader, "build", lambda source, defines=None, **kw: built.append((source.name, defines)) or b"")
    monkeypatch.setattr(loader, "load", lambda image, name, device: Loaded())
    return built, carveouts


def gate_up_into_nan(kernel, x, top_k: int, w2, fp4, ws, limit=None) -> torch.Tensor:
    """A gate_up kernel's output for ws's route into a fresh NaN-poisoned [P, I] tensor, after a synchronize."""
    out = torch.full_like(ws.act, float("nan"))
    kernel(x, top_k, w2, fp4, 0, ws, out=out, swiglu_limit=limit)
    torch.cuda.synchronize()
    return out

