"""Misuse of fulmen.distributed gets an error that says what is wrong and how to fix it."""

from __future__ import annotations

import pytest
import torch

import fulmen
import fulmen.distributed as fd
from fulmen.distributed import prims as dist_prims
from fulmen.distributed.specs import spec_of
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
    record("bucket_nan", lambda: fd.ddp(model, bucket_size_in_mb=float("nan")))
    record("bucket_str", lambda: fd.ddp(model, bucket_size_in_mb="25"))
    record("in_flight_float", lambda: fd.fsdp(model, max_in_flight=1.5))
    record("broadcast_rank", lambda: fd.ddp(model, broadcast_from=1))
    record("broadcast_str", lambda: fd.fsdp(model, broadcast_from="0"))
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
    for kind in ("ddp", "fsdp"):  # a parameter shared with a module distributed earlier
        first = torch.nn.Linear(4, 4)
        fd.ddp(first)
        second = torch.nn.Module()
        second.own = torch.nn.Linear(4, 4)
        second.tied = first.weight
        before = second.own.weight.detach().clone()
        record(f"shared_{kind}", lambda second=second, kind=kind: getattr(fd, kind)(second))
        errors[f"shared_{kind} unchanged"] = (torch.equal(second.own.weight, before)
                                              and spec_of(second.own.weight) is None)
    return errors


def test_bad_arguments_are_named():
    errors = values(run_ranks(_misuse, 1))[0]
    assert errors["sharding"] == "ValueError: sharding_strategy must be one of ZERO2, ZERO3, got 'ZERO4'"
    assert errors["bucketing"] == "ValueError: bucketing_strategy must be one of NONE, LAYER, BLOCK, got 'blocks'"
    assert errors["in_flight"] == "ValueError: max_in_flight must be an integer >= 1, got 0"
    assert errors["in_flight_float"] == "ValueError: max_in_flight must be an integer >= 1, got 1.5"
    assert errors["bucket_size"] == "ValueError: bucket_size_in_mb must be a number >= 0, got -1"
    assert errors["bucket_nan"] == "ValueError: bucket_size_in_mb must be a number >= 0, got nan"
    assert errors["bucket_str"] == "ValueError: bucket_size_in_mb must be a number >= 0, got '25'"
    for name, value in (("broadcast_rank", "1"), ("broadcast_str", "'0'")):
        assert errors[name] == ("ValueError: broadcast_from must be None or a rank of the process group (0 to 0), "
                                f"got {value}")
    assert errors["not_module"] == "TypeError: fulmen.distributed.ddp expects an nn.Module, got Tensor"
    assert errors["twice"] == "RuntimeError: this module is already distributed with fulmen.distributed.fsdp"
    assert errors["after_run"].startswith("RuntimeError: fulmen.distributed.ddp must be applied before the jitted "
                                          "module first runs")
    assert errors["scalar"] == "ValueError: fsdp cannot shard the 0-dimensional parameter 'w'"
    for kind in ("ddp", "fsdp"):
        assert errors[f"shared_{kind}"] == (
            f"RuntimeError: fulmen.distributed.{kind}: parameter 'tied' is already distributed with "
            f"fulmen.distributed.ddp (shared with another module, as 'weight'); apply {kind} once, to a module that "
            "holds every module sharing it")
        assert errors[f"shared_{kind} unchanged"] is True


class _Branchy(torch.nn.Module):
    """Two alternative layers of the same shape: a rank-dependent branch pairs one rank's collective for `a` with
    the other's for `b`, which gloo runs without complaint."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(5, 4)
        self.c = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.c(torch.tanh(self.b(x) if use_b else self.a(x))).sum()


def _diverging_branches(rank: int, world: int, mode: str, host_group: bool = False) -> dict[str, object]:
    torch.manual_seed(0)
    model = fd.ddp(_Branchy()) if mode == "ddp" else fd.fsdp(_Branchy(), sharding_strategy=mode)
    if host_group:  # the gloo group of its own that a group of another backend (NCCL) checks on
        state = fd.distributed_state(model)
        state.checker = dist_prims.make_checker(state, state.group, host=True)
    jitted = fulmen.jit(model)
    x = torch.randn(3, 5)
    jitted(x, False).backward()  # the same branch everywhere: runs
    try:
        jitted(x, rank == 1).backward()
    except RuntimeError as error:
        return {"error": str(error), "grads": {n: p.grad is not None for n, p in model.named_parameters()}}
    return {"error": None}


@pytest.mark.parametrize("mode, host_group", [("ddp", False), ("zero2", False), ("zero3", False), ("ddp", True),
                                              ("zero3", True)])
def test_ranks_running_different_programs_are_refused(mode, host_group):
    results = values(run_ranks(_diverging_branches, 2, mode, host_group))
    if mode == "ddp":  # the forward has no collective: the backward's gradient reduction is refused
        expected = ("the ranks ran different programs, so their backward collectives do not match: collective 0: "
                    "rank 0 all_reduce c.weight,c.bias,a.weight,a.bias, rank 1 all_reduce c.weight,c.bias,b.weight,"
                    "b.bias")
    else:  # before the forward gathers a's shards on one rank and b's on the other
        expected = ("the ranks ran different programs, so their forward collectives do not match: collective 0: "
                    "rank 0 all_gather a.weight, rank 1 all_gather b.weight")
    for result in results:
        assert result["error"] is not None and result["error"].startswith(expected), result["error"]
        assert "every rank must read the same distributed parameters" in result["error"]


def _mismatched_models(rank: int, world: int, kind: str) -> str:
    model = torch.nn.Linear(4, 3 + rank)  # a config value that differs between ranks
    before = model.weight.detach().clone()
    try:
        fd.ddp(model) if kind == "ddp" else fd.fsdp(model)
    except ValueError as error:
        assert torch.equal(model.weight, before)  # refused before anything was broadcast or sharded
        return str(error)
    return "no error"


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ranks_with_different_models_are_refused_before_any_change(kind):
    for message in values(run_ranks(_mismatched_models, 2, kind)):
        assert message == (f"fulmen.distributed.{kind}: the ranks' models differ, rank 0 has 'weight' of shape (3, 4) "
                           "and dtype float32 where rank 1 has 'weight' of shape (4, 4) and dtype float32; every rank "
                           "must build the same model")
