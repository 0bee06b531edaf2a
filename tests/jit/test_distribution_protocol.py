"""fulmen.jit meets a distribution only through fulmen.transforms.distribution's protocols: a tensor's
`DistributedInput` gives acquisition its logical shape and builds the program's `DistributionTransform`, whose
passes the pipeline runs per `GradSync` and which keeps the gradients of no-sync backwards itself. Here a toy
distribution written in the test (not fulmen.distributed) stands in for ddp / fsdp."""

from __future__ import annotations

import subprocess
import sys

import torch

import fulmen
from fulmen.transforms.distribution import DISTRIBUTED_INPUT, GradSync, logical_meta


class ToyProgram:
    """Leaves the traces as they are and records what jit asks of it."""

    def __init__(self, owners: list[int]):
        self.owners = owners
        self.sync = True
        self.calls: list[tuple] = []
        self.held: dict[int, torch.Tensor] = {}

    def forward(self, trace, n_outputs):
        self.calls.append(("forward", n_outputs))
        return trace

    def backward(self, trace, mode):
        self.calls.append(("backward", mode))
        return trace

    def deliver(self, grads):
        self.calls.append(("deliver",))
        return grads

    def hold_back(self, grads):
        self.calls.append(("hold_back",))
        grads = list(grads)
        for i in self.owners:
            self.held[i] = grads[i]
            grads[i] = None
        return tuple(grads)

    def take_pending(self):
        self.calls.append(("take_pending",))
        return None


class ToyInput:
    def __init__(self, full_shape=None):
        self.full_shape = full_shape
        self.made: ToyProgram | None = None

    def program(self, trace, tensors):
        self.made = ToyProgram([i for i, t in enumerate(tensors) if getattr(t, DISTRIBUTED_INPUT, None) is self])
        return self.made


def test_jit_runs_the_distribution_passes_and_lets_it_hold_back_no_sync_gradients():
    x = torch.randn(3)
    w = torch.randn(3, requires_grad=True)
    spec = ToyInput()
    setattr(w, DISTRIBUTED_INPUT, spec)
    jitted = fulmen.jit(lambda x, w: (x * w.sin()).sum())

    jitted(x, w).backward()
    program = spec.made
    assert program is not None
    want = x * w.detach().cos()
    torch.testing.assert_close(w.grad, want)
    assert program.calls == [("forward", 1), ("backward", GradSync.SYNC), ("take_pending",), ("deliver",)]

    w.grad = None
    program.calls.clear()
    program.sync = False  # decided when the forward runs
    loss = jitted(x, w)
    program.sync = True
    loss.backward()
    assert w.grad is None  # held back by the distribution, not accumulated into .grad
    assert list(program.held) == program.owners
    torch.testing.assert_close(program.held[program.owners[0]], want)
    assert program.calls == [("backward", GradSync.LOCAL), ("hold_back",)]


def test_acquisition_sees_a_sharded_tensor_in_its_full_shape():
    shard = torch.randn(2, 3)
    setattr(shard, DISTRIBUTED_INPUT, ToyInput(torch.Size((4, 3))))
    assert logical_meta(shard).shape == (4, 3)
    assert logical_meta(torch.randn(2, 3)).shape == (2, 3)


def test_jitting_does_not_import_fulmen_distributed():
    code = ("import sys, torch, fulmen\n"
            "fulmen.jit(lambda x: (x * 2).sum())(torch.ones(2, requires_grad=True)).backward()\n"
            "assert 'fulmen.distributed' not in sys.modules, 'fulmen.jit imported fulmen.distributed'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
