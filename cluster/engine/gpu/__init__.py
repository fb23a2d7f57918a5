"""The GPU path: Triton paged attention, captured decode steps and sampling on the device.

Every module here imports without a GPU and without Triton: ``triton_attention`` imports Triton
on a kernel's first use; ``graphs.StepGraphs`` captures CUDA graphs on CUDA and runs the same
bucket / padding / static-buffer logic eagerly elsewhere (its CPU twin, which the unit tests
check); ``device_sampler`` is plain tensor code that runs on any device.
"""
