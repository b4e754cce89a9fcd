"""Iterating a checkpoint larger than the memory bound keeps peak RSS near one layer's worth."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from checkpoint_fixtures import write_large_checkpoint

MiB = 1024 * 1024
DIMS = dict(num_layers=8, num_experts=32, hidden=768, inter=512)  # 576 MiB of bf16 experts, 72 MiB per layer

CHILD = textwrap.dedent("""
    import json, sys
    from tierstore.checkpoint import open_checkpoint
    sys.path.insert(0, sys.argv[2])
    from checkpoint_fixtures import large_expert_value

    def high_water_mark():  # this process's own peak RSS; ru_maxrss would carry the parent's over exec
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    ckpt = open_checkpoint(sys.argv[1])
    baseline = high_water_mark()
    checked = 0
    for layer in ckpt.iter_layers():
        for weights in layer.experts:
            value = large_expert_value(layer.index, weights.expert)
            for matrix in (weights.w13, weights.w2):
                dense = matrix.dequantize()  # float64
                assert dense.shape == matrix.shape and bool((dense == value).all()), (layer.index, weights.expert)
                checked += dense.numel()
                del dense
    peak = high_water_mark()
    print(json.dumps({"baseline": baseline, "peak": peak, "checked": checked}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux /proc")
def test_peak_rss_stays_near_one_layer_on_a_large_checkpoint(tmp_path):
    path = tmp_path / "large"
    expert_bytes = write_large_checkpoint(path, **DIMS)
    layer_bytes = expert_bytes // DIMS["num_layers"]
    out = subprocess.run([sys.executable, "-P", "-c", CHILD, str(path), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["checked"] * 2 == expert_bytes  # every bf16 weight was read and compared
    grown = report["peak"] - report["baseline"]
    expert_f64 = 3 * DIMS["hidden"] * DIMS["inter"] * 8
    # one layer's pages mapped at a time, plus per-expert float64 work and allocator slack
    bound = layer_bytes + 12 * expert_f64
    print(f"peak RSS grew {grown / MiB:.0f} MiB over {report['baseline'] / MiB:.0f} MiB; "
          f"bound {bound / MiB:.0f} MiB; checkpoint experts {expert_bytes / MiB:.0f} MiB")
    assert grown < bound < expert_bytes / 2
