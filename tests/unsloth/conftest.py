import importlib
import os

import pytest
import torch

KERNEL_MODULES = ("cross_entropy", "swiglu", "rope")


@pytest.fixture
def interpreted():
    """The unsloth kernel modules, run by Triton's interpreter on CPU tensors (with TRITON_INTERPRET=1, which the
    root conftest sets before triton is imported, the executor's checkers accept CPU tensors too). On a GPU
    machine the kernels are compiled instead: the tests marked cuda."""
    if torch.cuda.is_available():
        pytest.skip("Triton's CPU interpreter is for machines without a GPU; -m cuda tests the compiled kernels")
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    return {name: importlib.import_module(f"fulmen.unsloth.{name}") for name in KERNEL_MODULES}
