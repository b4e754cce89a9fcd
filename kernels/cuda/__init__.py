"""CUDA C++ kernels built with nvcc at run time and launched through the driver API (issue #9 section 4).

`loader`: nvcc -> fatbin -> cuModuleLoadData / cuLaunchKernel via ctypes. `w2_gate_up`: the W2 gate_up
stage for decode on tensor cores, with its plain-torch reference. Not imported by `tierstore.kernels`.
"""
