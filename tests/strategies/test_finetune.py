"""LoRA finetuning (frozen base weights) under ThunderDDPStrategy and ThunderFSDPStrategy on 2 CPU ranks (gloo)
against single-process eager finetuning on the same global batches (tiny LitGPT LoRA model, fp32, AdamW).

One launch runs every case: DDP with trainable biases and a freeze schedule (a frozen weight made trainable after
the first step, a LoRA matrix frozen), ZeRO-2 with LAYER buckets holding frozen weights beside trainable biases,
ZeRO-3 with BLOCK buckets and the freeze schedule, and ZeRO-3 as `litgpt finetune lora` runs it: the model on the
meta device, the base model's checkpoint (its own names) loaded non-strictly, the LoRA weights saved alone and
resumed. Gradient accumulation runs through `fabric.no_backward_sync`; the freeze-schedule cases clip by norm.
Checked on every rank: the losses, the first step's gradients (exactly the trainable parameters have one), the
parameters after the steps (frozen ones unchanged), and that only trainable parameters' gradients are communicated.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.launch import run_ranks, values
from tests.strategies import finetune_workers as workers
from tests.strategies.finetune_workers import REFROZEN, UNFROZEN, Case

CASES = [
    Case("ddp-bias-unfreeze", "ddp", bias="all", unfreeze=True, clip=True),
    Case("zero2-layer-bias", "fsdp", (("sharding_strategy", "ZERO2"), ("bucketing_strategy", "LAYER")), bias="all"),
    Case("zero3-block-unfreeze", "fsdp", (("sharding_strategy", "ZERO3"), ("bucketing_strategy", "BLOCK")),
         unfreeze=True, clip=True),
    Case("zero3-loaded", "fsdp", (("sharding_strategy", "ZERO3"), ("state_dict_type", "full")), loaded=True),
]
TRAINED = [case for case in CASES if not case.loaded]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("finetune"))
    return values(run_ranks(workers.finetune_suite, 2, CASES, directory, backend=None, timeout=600))


@functools.cache
def eager(bias: str, unfreezing: bool, clip: bool) -> dict:
    return workers.eager_finetuning(bias, unfreezing, clip)


def _assert_trained_as_eager(got: dict, want: dict, steps: slice = slice(None)) -> None:
    torch.testing.assert_close(got["losses"], want["losses"][steps], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["norms"], want["norms"][steps], rtol=1e-5, atol=0)
    assert set(got["params"]) == set(want["params"])
    for name, value in want["params"].items():
        # atol: AdamW divides by sqrt(v), so float32 summation-order noise on a near-zero gradient becomes ~1e-6
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert got["frozen_with_grads"] == []


def _assert_only_trainable_communicated(got: dict, strategy: str) -> None:
    communicated = got["communicated"]
    assert sorted(communicated["reduce"]) == got["trainable"]  # frozen weights are never reduced, nor packed
    if strategy == "ddp":
        assert communicated["forward_gather"] == communicated["backward_gather"] == []
    else:  # the forward gathers every weight, frozen ones too (it reads them)
        assert len(communicated["forward_gather"]) == len(got["params"])
        # ZeRO-3 gathers again what the backward reads: not the frozen embedding, whose gradient nobody needs
        assert "transformer.wte.weight" not in communicated["backward_gather"]


@pytest.mark.parametrize("case", TRAINED, ids=lambda c: c.name)
def test_finetuning_matches_single_process_eager(ranks, case):
    want = eager(case.bias, case.unfreeze, case.clip)
    assert bool(want["norms"]) == case.clip and all(norm > workers.MAX_NORM for norm in want["norms"])
    initial = workers.make_lora(bias=case.bias).state_dict()
    frozen = [n for n, g in want["grads"].items() if g is None]
    assert frozen and all(torch.equal(want["params"][n], initial[n]) for n in frozen if n != UNFROZEN)
    for rank, results in enumerate(ranks):
        got = results[case.name]
        _assert_trained_as_eager(got, want)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():  # the first step's, reduced: exactly the trainable ones have one
            assert (got["grads"][name] is None) == (grad is None), (rank, name)
            if grad is not None:
                torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
        _assert_only_trainable_communicated(got, case.strategy)
        # under no_backward_sync: DDP's trainable .grad hold local gradients, FSDP's are held back, frozen get none
        assert got["local_grads_as_torch"] == [True] * workers.STEPS
        if case.unfreeze:
            assert UNFROZEN in got["trainable"] and REFROZEN not in got["trainable"]
        # the trained entries saved after RESUME_AT steps (DDP: full, FSDP: sharded), loaded back: the same steps again
        assert got["resumed"] == got["losses"][workers.RESUME_AT:]


@pytest.mark.parametrize("case", TRAINED, ids=lambda c: c.name)
def test_loading_that_replaces_parameters_is_refused_by_name(ranks, case):
    kind = "fsdp" if case.strategy == "fsdp" else "ddp"
    for results in ranks:
        assigning, swapping, kept = results[case.name]["assign"]
        assert assigning == (f"RuntimeError: load_state_dict(..., assign=True) would replace the parameter "
                             f"'lm_head.lora_A', distributed by fulmen.distributed.{kind}, with a new one that is not "
                             "(nor in the optimizer): load without assign=True, which copies the values into the "
                             "distributed parameters (a full tensor into this rank's rows)")
        assert swapping.startswith("RuntimeError: load_state_dict would swap a new tensor into the parameter "
                                   f"'lm_head.lora_A', distributed by fulmen.distributed.{kind}, taking its "
                                   "distribution away (torch.__future__.set_swap_module_params_on_conversion(True)")
        assert kept  # nothing was replaced before the refusal


@pytest.mark.parametrize("case", [c for c in TRAINED if c.unfreeze], ids=lambda c: c.name)
def test_freezing_between_micro_batches_is_refused_by_name(ranks, case):
    for results in ranks:
        error = results[case.name]["frozen_between_micro_batches"]
        assert error.startswith("RuntimeError: the gradients of transformer.h.1.attn.proj.lora_B were accumulated "
                                "under no_sync, then the parameter was frozen (requires_grad=False) before the "
                                "synced micro-batch"), error


def test_base_checkpoint_loaded_and_lora_resumed_as_eager(ranks):
    """The base model's checkpoint (its names, not the LoRA model's) loads into the sharded LoRA model from a sharded
    checkpoint and by `model.load_state_dict`; resuming from the LoRA weights saved after 2 steps continues as the
    uninterrupted run, bitwise, and as eager."""
    want = eager("none", False, False)
    for results in ranks:
        got = results["zero3-loaded"]
        _assert_trained_as_eager(got["first"], want)
        _assert_trained_as_eager(got["resumed"], want, slice(workers.RESUME_AT, None))
        assert got["resumed"]["losses"] == got["first"]["losses"][workers.RESUME_AT:]
        for name, value in got["first"]["params"].items():
            assert torch.equal(got["resumed"]["params"][name], value), name
        assert got["step"] == workers.RESUME_AT
        _assert_only_trainable_communicated(got["first"], "fsdp")
