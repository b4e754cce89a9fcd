"""Quality lab (issue 8): a small MoE language model trained on the CPython standard library,
exported as a modelopt NVFP4 checkpoint, and the measurements of what W2, FP4 and the gate do to it.

Run the modules from the repository root, e.g. `python -m benchmarks.quality.train --help`.
"""
