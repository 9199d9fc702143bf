"""Test-session set-up: without a CUDA GPU, Triton kernels run in Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before any kernel module is imported (``triton.jit`` reads it when a kernel is
defined), so it is set here, before the test modules load, unless the caller chose a value.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Each test starts with the thread count the session had: the CLI's and the benches' ``--threads N`` set
    torch's process-wide count, which would otherwise hold for every later test."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
