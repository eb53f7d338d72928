"""Runtime test setup.

Without CUDA the Triton kernels run in the interpreter: TRITON_INTERPRET=1 must be set before
triton (and quantkit.runtime, which defines the kernels) is imported, hence here, before any test
module loads. With CUDA and TRITON_INTERPRET unset the same tests run the compiled kernels on the GPU
(helpers.DEVICE). Triton tests carry helpers.needs_triton and skip only when triton is not importable.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
