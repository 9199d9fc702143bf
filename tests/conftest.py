"""Test-session set-up: without a CUDA GPU, Triton kernels run in Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before any kernel module is imported (``triton.jit`` reads it when a kernel is
defined), so it is set here, before the test modules load, unless the caller chose a value.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
