"""CUDA C++ kernels built with nvcc at run time and launched through the driver API (issue #9 section 4).

`loader`: nvcc -> fatbin -> cuModuleLoadData / cuLaunchKernel via ctypes. `w2_gate_up` and `w2_down`: the W2
gate_up and down stages for decode on tensor cores, each with its plain-torch reference (one routed pair per
block); `w2_multi`: the same stages with one expert's weights decoded once for up to 8 of its pairs (block_tokens 16).
`w2_moe.W2MoeCuda`: both stages as `moe_mm(..., cuda_w2=...)` (opt-in there; the runtime passes it by its config
cuda_w2, auto by default), single- or multi-token by the workspace's block size; `w2_half_tiles.cuh` /
`fp4_half_tiles.cuh`: the down kernels' builds for 16-word tiles (inter not a multiple of 512 / 256). Not imported by
`tierstore.kernels`. `pass_gather`: the pass's own fetch (config gather_in_pass), a plan and a row copy per layer,
with their torch references.
"""
