"""Triton device code: the @triton.jit functions of each op, one module per kernels/<op>.py.

These are the only modules of the package that import Triton. A host module (kernels/<op>.py:
launchers, autograd Functions, custom ops, dispatch, torch references) imports its device code
inside the launchers, i.e. on the first launch, which happens only after
`posttrain.kernels.dispatch.use_triton` chose the kernel (so Triton is installed). Everything else, and
every torch path, imports and runs without Triton.
"""
