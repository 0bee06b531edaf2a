"""Misuse of fulmen.distributed gets an error that says what is wrong and how to fix it."""

from __future__ import annotations

import pytest
import torch

import fulmen
import fulmen.distributed as fd
from tests.distributed import workers
from tests.distributed.launch import run_ranks, values


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        fd.fsdp(workers.make_model())
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        fd.ddp(workers.make_model())


def test_no_sync_needs_a_distributed_module():
    with pytest.raises(ValueError, match="not set up with fulmen.distributed.ddp or fulmen.distributed.fsdp"):
        with fd.no_sync(workers.make_model()):
            pass


def _misuse(rank: int, world: int) -> dict[str, str]:
    errors = {}

    def record(name, fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - the message is what the test checks
            errors[name] = f"{type(error).__name__}: {error}"

    model = workers.make_model()
    record("sharding", lambda: fd.fsdp(model, sharding_strategy="ZERO4"))
    record("bucketing", lambda: fd.fsdp(model, bucketing_strategy="blocks"))
    record("in_flight", lambda: fd.fsdp(model, max_in_flight=0))
    record("bucket_size", lambda: fd.ddp(model, bucket_size_in_mb=-1))
    record("not_module", lambda: fd.ddp(torch.ones(2)))
    fd.fsdp(model, sharding_strategy="zero3")  # names are accepted in any case
    record("twice", lambda: fd.ddp(model))
    jitted = fulmen.jit(workers.make_model())
    x, y = workers.global_batches(1, 1)[0]
    workers.loss_fn(jitted, x, y)
    record("after_run", lambda: fd.ddp(jitted))
    scalar = torch.nn.Module()
    scalar.w = torch.nn.Parameter(torch.tensor(1.0))
    record("scalar", lambda: fd.fsdp(scalar))
    return errors


def test_bad_arguments_are_named():
    errors = values(run_ranks(_misuse, 1))[0]
    assert errors["sharding"] == "ValueError: sharding_strategy must be one of ZERO2, ZERO3, got 'ZERO4'"
    assert errors["bucketing"] == "ValueError: bucketing_strategy must be one of NONE, LAYER, BLOCK, got 'blocks'"
    assert errors["in_flight"] == "ValueError: max_in_flight must be >= 1, got 0"
    assert errors["bucket_size"] == "ValueError: bucket_size_in_mb must be >= 0, got -1"
    assert errors["not_module"] == "TypeError: fulmen.distributed.ddp expects an nn.Module, got Tensor"
    assert errors["twice"] == "RuntimeError: this module is already distributed with fulmen.distributed.fsdp"
    assert errors["after_run"].startswith("RuntimeError: fulmen.distributed.ddp must be applied before the jitted "
                                          "module first runs")
    assert errors["scalar"] == "ValueError: fsdp cannot shard the 0-dimensional parameter 'w'"
