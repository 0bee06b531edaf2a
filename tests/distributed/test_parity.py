"""DDP and FSDP (ZeRO-2/3, each bucketing) on 2 gloo ranks against single-process eager training.

One launch runs every setup (5 AdamW steps on a small LitGPT model whose vocab and MLP sizes do not divide by the
world size) plainly, with 2-step accumulation under no_sync, and with clipping; each test then compares one setup
with eager on the same global batch, or checks the collectives in its traces against the bucketing plan.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

import fulmen
from tests.distributed import workers
from tests.distributed.launch import run_ranks, values
from tests.distributed.workers import Setup

MODES = ["ddp"] + [f"{sharding}-{bucketing}" for sharding in ("zero2", "zero3") for bucketing in ("none", "layer",
                                                                                                   "block")]
SETUPS = [setup for mode in MODES for setup in (Setup(mode), Setup(mode, accumulate=2), Setup(mode, clip=True))]
PARAM_NAMES = [name for name, _ in workers.make_model().named_parameters()]


@pytest.fixture(scope="module")
def suite() -> dict:
    return values(run_ranks(workers.parity_suite, 2, SETUPS, timeout=1200))[0]


@functools.cache
def eager(accumulate: int, clip: bool) -> dict:
    return workers.eager_training(Setup("eager", accumulate, clip))


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_training_matches_single_process_eager(suite, setup):
    got, want = suite[setup.name], eager(setup.accumulate, setup.clip)
    workers.assert_matches_eager(got, want)
    assert bool(want["norms"]) == setup.clip


def _buckets(names: list[str], bucketing: str) -> set[str]:
    """The bucketing plan, written independently of fulmen's: one bucket per parameter, per owning module, or per
    transformer block (modules outside the blocks keep one bucket each)."""
    if bucketing == "none":
        return set(names)
    owners = {name.rsplit(".", 1)[0] for name in names}
    if bucketing == "layer":
        return owners
    return {".".join(o.split(".")[:3]) if o.startswith("transformer.h.") else o for o in owners}


@functools.cache
def _params_read_by_backward() -> list[str]:
    """The parameters the backward of the undistributed program reads (what ZeRO-3 must gather again)."""
    jitted = fulmen.jit(workers.make_model())
    x, y = workers.global_batches(1, 1)[0]
    workers.loss_fn(jitted, x, y).backward()
    backward = fulmen.last_backward_traces(jitted)[-1]
    read = {p.pname for p in backward.inputs}
    return [name for name in PARAM_NAMES if "t_" + name.replace(".", "_") in read]


@pytest.mark.parametrize("mode", MODES[1:])
def test_fsdp_collectives_follow_the_bucketing_plan(suite, mode):
    sharding, bucketing = mode.split("-")
    facts = suite[f"{mode}-plain"]["traces"]
    n_buckets = len(_buckets(PARAM_NAMES, bucketing))
    assert facts["forward"] == {"all_gather": n_buckets, "reduce_scatter": 0, "all_reduce": 0}
    regathered = len(_buckets(_params_read_by_backward(), bucketing)) if sharding == "zero3" else 0
    assert facts["backward"] == {"all_gather": regathered, "reduce_scatter": n_buckets, "all_reduce": 0}
    # under no_sync the backward communicates nothing but ZeRO-3's gathers
    assert suite[f"{mode}-accumulate"]["traces"]["local_backward"] == {
        "all_gather": regathered, "reduce_scatter": 0, "all_reduce": 0}
    assert "dist.all_gather(" in facts["forward_source"] and "dist.reduce_scatter(" in facts["backward_source"]
    full_params = {"t_" + name.replace(".", "_") for name in PARAM_NAMES}
    saved_full = full_params & set(facts["saved"])
    if sharding == "zero3":  # the forward saves shards, never a gathered parameter
        assert not saved_full
        assert all(p + "_shard" in facts["saved"] for p in ("t_" + n.replace(".", "_") for n in
                                                            _params_read_by_backward()))
    else:  # ZeRO-2 keeps the gathered parameters the backward reads
        assert saved_full == {"t_" + n.replace(".", "_") for n in _params_read_by_backward()}


def test_ddp_buckets_by_size(suite):
    n_params = len(PARAM_NAMES)
    per_param = suite["ddp-bucket-0.0"]["traces"]
    assert per_param["backward"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": n_params}
    assert suite["ddp-plain"]["traces"]["backward"]["all_reduce"] == 1  # 25 MB holds the whole model
    assert suite["ddp-accumulate"]["traces"]["local_backward"] == {"all_gather": 0, "reduce_scatter": 0,
                                                                   "all_reduce": 0}
    cap = int(0.01 * 2**20)
    sizes = suite["ddp-bucket-0.01"]["traces"]["all_reduce_bytes"]
    model_bytes = sum(p.numel() * p.element_size() for p in workers.make_model().parameters())
    assert sum(sizes) == model_bytes and len(sizes) > 2
    assert all(size >= cap for size in sizes[:-1])  # a bucket is sent once it reaches the cap, not before
    assert all(size < cap + 4 * 67 * 32 for size in sizes)  # ... and holds at most one gradient past it


def test_ddp_starts_reductions_before_the_backward_ends(suite):
    source = suite["ddp-bucket-0.01"]["traces"]["backward_source"].splitlines()
    starts = [i for i, line in enumerate(source) if "dist.all_reduce(" in line]
    waits = [i for i, line in enumerate(source) if "dist.wait(" in line]
    matmuls = [i for i, line in enumerate(source) if "torch.matmul(" in line or "linear(" in line]
    assert starts[0] < matmuls[-1]  # the first bucket is in flight while the backward still computes
    assert min(waits) > max(starts) and min(waits) > matmuls[-1]  # every wait comes after all the compute


def _max_gathers_in_flight(source: str) -> int:
    started: set[str] = set()
    most = 0
    for line in source.splitlines():
        gather = re.match(r"\s*(\w+) = dist\.all_gather\(", line)
        if gather:
            started.add(gather.group(1))
            most = max(most, len(started))
        waited = re.search(r"dist\.wait\((\w+)\)", line)
        if waited:
            started.discard(waited.group(1))
    return most


@pytest.mark.parametrize(("name", "bound"), [("zero3-block-plain", 2), ("zero3-block-inflight1", 1)])
def test_all_gathers_in_flight_are_bounded(suite, name, bound):
    facts = suite[name]["traces"]
    assert _max_gathers_in_flight(facts["forward_source"]) == bound  # prefetched up to the bound, never past it
    assert _max_gathers_in_flight(facts["backward_source"]) == bound
    assert suite[name]["losses"] == pytest.approx(eager(1, False)["losses"], rel=1e-5)


def test_a_process_group_can_be_passed_in(suite):
    got = suite["zero3-block-group"]
    assert got["losses"] == pytest.approx(eager(1, False)["losses"], rel=1e-5)
    assert "'pg1'" in got["traces"]["forward_source"] and "'pg0'" not in got["traces"]["forward_source"]


def test_zero3_holds_half_the_parameter_bytes(suite):
    full = suite["ddp-plain"]["param_bytes"]
    assert full == sum(p.numel() * p.element_size() for p in workers.make_model().parameters())
    for mode in MODES[1:]:
        ratio = suite[f"{mode}-plain"]["param_bytes"] / full
        assert 0.5 <= ratio < 0.51, (mode, ratio)  # 1/world_size, plus the padding rows of the odd sizes


# DDP under no_sync accumulation; ZeRO-3 with clipping and an activation memory budget (remat decided once)
LENGTH_SETUPS = [(Setup("ddp", accumulate=2), {}),
                 (Setup("zero3-block", clip=True), {"activation_memory_budget": 0.5})]


def test_symbolic_lengths_train_as_static_traces_in_two_traces():
    """Over 4 (rows, length) shapes, on each rank: losses, norms and parameters of the symbolic trace torch.equal the
    static traces' (one per shape), close to single-process eager's, in 2 traces (static, then symbolic)."""
    ranks = values(run_ranks(workers.train_over_lengths, 2, LENGTH_SETUPS, timeout=600))
    for setup, _ in LENGTH_SETUPS:
        want = workers.eager_training(setup, lengths=True)
        for rank, results in enumerate(ranks):
            static, symbolic = results[setup.name, False], results[setup.name, None]
            assert static["misses"] == len(workers.LENGTH_SHAPES)
            assert symbolic["misses"] == 2, (rank, symbolic["reasons"])
            assert '# idx: "cpu i64[s0, s1]"' in symbolic["forward"], symbolic["forward"][:3000]
            assert static["losses"] == symbolic["losses"] and static["norms"] == symbolic["norms"]
            for name, value in static["shards"].items():
                assert torch.equal(symbolic["shards"][name], value), (setup.name, rank, name)
        workers.assert_matches_eager(ranks[0][setup.name, None], want)
