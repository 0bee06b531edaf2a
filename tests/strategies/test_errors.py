"""Every misuse of the strategies gets a named error: at construction (no process needed), and at setup, in
gradient accumulation and in checkpointing (on 2 launched ranks)."""

from __future__ import annotations

import datetime
import re

import pytest
import torch

from fulmen.distributed import FSDPBucketingStrategy, FSDPType
from fulmen.distributed.specs import spec_of
from fulmen.strategies import ThunderDDPStrategy, ThunderFSDPStrategy
from tests.distributed.launch import run_ranks, values
from tests.distributed.workers import make_model
from tests.strategies import workers


@pytest.mark.parametrize(("make", "match"), [
    (lambda: ThunderDDPStrategy(jit=False, executors=["sdpa"]), r"executors=.*needs jit=True"),
    (lambda: ThunderFSDPStrategy(jit=False, executors=["torch"]), r"executors=.*needs jit=True"),
    (lambda: ThunderDDPStrategy(executors=["sdpa", "no-such-executor"]), r"unknown executor 'no-such-executor'"),
    (lambda: ThunderFSDPStrategy(executors=["nvfuser"]), r"unknown executor 'nvfuser'"),
    (lambda: ThunderDDPStrategy(jit="yes"), r"jit=.*must be True or False"),
    (lambda: ThunderDDPStrategy(timeout=30), r"timeout=.*timedelta"),
    (lambda: ThunderDDPStrategy(bucket_size=25), r"unknown argument\(s\) \['bucket_size'\].*bucket_size_in_mb"),
    (lambda: ThunderDDPStrategy(process_group=None), r"unknown argument\(s\) \['process_group'\]"),
    (lambda: ThunderFSDPStrategy(device="cpu"), r"unknown argument\(s\) \['device'\].*max_in_flight"),
    (lambda: ThunderFSDPStrategy(sharding_strategy="ZERO1"), r"sharding_strategy must be one of ZERO2, ZERO3"),
    (lambda: ThunderFSDPStrategy(bucketing_strategy="blocks"), r"bucketing_strategy must be one of NONE, LAYER"),
    (lambda: ThunderFSDPStrategy(state_dict_type="FULL_STATE_DICT"), r"state_dict_type must be one of full, sharded"),
], ids=lambda value: "" if callable(value) else value.split("[")[0].split(".")[0][:40])
def test_invalid_construction_raises_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_construction_accepts_what_users_write():
    strategy = ThunderFSDPStrategy(sharding_strategy="zero2", bucketing_strategy=FSDPBucketingStrategy.BLOCK,
                                   executors=("sdpa", "torch"), state_dict_type="FULL", max_in_flight=3,
                                   timeout=datetime.timedelta(minutes=5))
    assert strategy.sharding_strategy is FSDPType.ZERO2 and strategy.bucketing_strategy is FSDPBucketingStrategy.BLOCK
    assert [ex.name for ex in strategy.executors] == ["sdpa", "torch"] and strategy.state_dict_type == "full"
    assert dict(strategy.transform_options) == {"max_in_flight": 3}
    assert ThunderFSDPStrategy().sharding_strategy is FSDPType.ZERO3
    assert ThunderDDPStrategy(jit=False).executors is None


def test_no_backward_sync_needs_a_module_the_strategy_set_up():
    control = ThunderDDPStrategy()._backward_sync_control
    with pytest.raises(TypeError, match="no_backward_sync needs a module set up by the ThunderDDPStrategy"):
        control.no_backward_sync(make_model(), enabled=True)
    with control.no_backward_sync(make_model(), enabled=False):  # disabled: nothing to check
        pass


@pytest.mark.parametrize(("make", "match"), [
    (lambda params: torch.optim.LBFGS(params), r"LBFGS cannot step parameter shards: its directions and line search "
                                               r"take dot products over all parameters.*'lm_head.weight'"),
    (lambda params: torch.optim.Muon([p for p in params if p.dim() == 2]),
     r"Muon cannot step parameter shards: it orthogonalizes each whole matrix.*'lm_head.weight'"),
], ids=["lbfgs", "muon"])
def test_fsdp_refuses_optimizers_that_are_not_elementwise(make, match):
    # refused before setup shards anything (no process group needed); before, they trained silently otherwise than
    # on one process (LBFGS: losses 4.355, 8.100 against eager's 4.355, 8.055 after 2 steps on 2 ranks)
    model = make_model()
    with pytest.raises(ValueError, match=match):
        ThunderFSDPStrategy().setup_module_and_optimizers(model, [make(list(model.parameters()))])
    assert all(spec_of(p) is None for p in model.parameters())  # nothing was sharded


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict:
    directory = str(tmp_path_factory.mktemp("errors"))
    return values(run_ranks(workers.error_paths, 2, directory, backend=None, timeout=600))[0]


@pytest.mark.parametrize(("name", "expected"), [
    ("setup_after_run", r"RuntimeError: fulmen.distributed.fsdp must be applied before the jitted module first runs"),
    ("prejit_with_executors", r"ValueError: the module is already jitted with its own executors"),
    ("meta_optimizer", r"RuntimeError: the optimizer holds meta-device parameters.*fabric.setup_module"),
    ("stepped_optimizer", r"RuntimeError: the optimizer has already stepped"),
    ("adafactor_on_shards", r"ValueError: Adafactor cannot step parameter shards: its factored second moments .* "
                            r"on ThunderFSDPStrategy's shard of 'lm_head.weight' .* Use an elementwise optimizer"),
    ("full_strict_missing_key", r"KeyError: .*'missing' that does not exist in the loaded checkpoint"),
    ("sharded_strict_missing_key", r"KeyError: .*'missing' that does not exist in the loaded checkpoint"),
    ("missing_path", r"FileNotFoundError: no checkpoint at .*nothing"),
    ("load_raw_directory", r"ValueError: .*sharded is a sharded checkpoint \(a directory\); fabric.load_raw"),
    ("storage_options_sharded", r"TypeError: ThunderFSDPStrategy writes sharded checkpoints .* storage_options"),
    ("load_raw_optimizer_too_few_params", r"ValueError: the optimizer state dict has state for parameter 3, the "
                                          r"optimizer has 3 parameters"),
    ("optimizer_state_wrong_shape", r"ValueError: optimizer state 'exp_avg' of parameter 0 has shape \(3,\); the "
                                    r"state of the sharded parameter 'lm_head.weight' must be a scalar"),
    ("full_state_dict_wrong_shape", r"ValueError: state dict entry 'lm_head.weight' has shape \(3,\), the "
                                    r"model's parameter 'lm_head.weight' has \(67, 32\)"),
])
def test_misuse_on_launched_ranks(errors, name, expected):
    assert errors[name] is not None, f"{name} raised nothing"
    assert re.search(expected, errors[name], flags=re.S), errors[name]


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_flipped_bit_is_refused_on_every_rank(errors, kind):
    for error in errors[f"{kind}_bit_flip"]:  # each rank checksums its share of the chunks, all of them raise
        assert re.search(rf"CheckpointError: the checkpoint .*damaged-{kind} is damaged: bytes 0-\d+ of .*damaged-"
                         rf"{kind}.* do not match the checksum saved with them", error or ""), error


def test_non_strict_loading_skips_what_the_checkpoint_lacks(errors):
    for kind in ("full", "sharded"):
        assert errors[f"{kind}_non_strict_missing_key"] is None
        assert errors[f"{kind}_non_strict_restored"] is True  # into a model with other weights
    # a checkpoint of lm_head alone: strict loading names the missing entries; non-strict loads lm_head only
    assert re.search(r"Missing key\(s\) in state_dict: .*transformer.wte.weight", errors["partial_model_strict"])
    assert errors["partial_model_non_strict"] == (True, True)


def test_fsdp_refuses_a_gradient_scaler():
    from lightning.fabric.plugins.precision import MixedPrecision

    strategy = ThunderFSDPStrategy()
    strategy.precision = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", enabled=False))
    with pytest.raises(ValueError, match=r"does not support precision='16-mixed'.*use 'bf16-mixed' or 'bf16-true'"):
        strategy.setup_environment()
