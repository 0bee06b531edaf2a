import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels (fulmen.unsloth) run under Triton's CPU interpreter: it is chosen when triton is
# imported, so before any test imports it.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--hf-all", action="store_true", default=False,
                     help="tests/models/test_hf.py: run every transformers family through the Dynamo backend too")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device machine with -m cuda)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
