"""Fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    yield
    torch.set_num_threads(threads)
