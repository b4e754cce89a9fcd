"""CUDA C++ kernels built with nvcc at run time and launched through the driver API (issue #9 section 4).

`loader`: nvcc -> fatbin -> cuModuleLoadData / cuLaunchKernel via ctypes. `w2_gate_up` and `w2_down`: the W2
gate_up and down stages for decode on tensor cores, each with its plain-torch reference. `w2_moe.W2MoeCuda`:
both stages as the opt-in `moe_mm(..., cuda_w2=...)` (default off). Not imported by `tierstore.kernels`.
"""
