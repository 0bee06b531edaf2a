"""Checkpoints across world sizes (2 -> 1 -> 2), meta-device initialisation, and a rank that fails."""

from __future__ import annotations

import pytest
import torch

from fulmen.distributed import checkpoint
from fulmen.distributed.specs import local_shard
from tests.distributed import workers
from tests.distributed.launch import run_ranks, values

FULL = checkpoint.StateDictOptions(full_state_dict=True)


def test_checkpoints_round_trip_from_two_ranks_to_one_and_back(tmp_path):
    saved = values(run_ranks(workers.save_checkpoints, 2, str(tmp_path)))[0]["full"]
    original = workers.make_model().state_dict()
    assert set(saved) == set(original)
    for name, value in original.items():
        assert torch.equal(saved[name], value), name
    # world size 1: a plain, undistributed model loads both kinds and saves them again
    for name, options in (("full", FULL), ("sharded", checkpoint.StateDictOptions())):
        source = tmp_path / ("full.pt" if name == "full" else "sharded")
        model = workers.make_model(seed=99)
        checkpoint.load(model, source)
        for key, value in original.items():
            assert torch.equal(model.state_dict()[key], value), (name, key)
        checkpoint.save(model, tmp_path / f"world1_{name}", options)
    assert (tmp_path / "world1_sharded" / ".metadata").exists() and (tmp_path / "world1_full").is_file()
    # and back to 2 ranks, into models initialised with other values
    reloaded = values(run_ranks(workers.load_checkpoints, 2, str(tmp_path)))
    for name in ("full", "sharded"):
        for key, value in original.items():
            assert torch.equal(reloaded[0][name]["full"][key], value), (name, key)
        for rank, result in enumerate(reloaded):  # each rank holds exactly its rows, zero padding included
            for key, shard in result[name]["shards"].items():
                assert torch.equal(shard, local_shard(original[key], rank, 2)), (name, rank, key)


def test_saving_keeps_the_previous_checkpoint_until_the_new_one_is_complete(tmp_path, monkeypatch):
    model = workers.make_model()
    path = tmp_path / "ckpt.pt"
    checkpoint.save(model, path, FULL)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(workers.make_model(seed=5), path, FULL)
    assert path.read_bytes() == before
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(model, tmp_path / "missing")


def test_meta_model_is_materialised_shard_by_shard():
    results = values(run_ranks(workers.materialize_from_meta, 2))
    want = workers.eager_from_meta()
    full_bytes = sum(v.numel() * v.element_size() for k, v in want.items() if k not in ("cos", "sin"))
    for key, value in want.items():
        assert torch.equal(results[0]["full"][key], value), key
    largest = max(v.numel() * v.element_size() for v in want.values())
    for result in results:
        # never more than the shards so far plus one module's full parameters: far from the whole model
        assert result["peak_bytes"] <= full_bytes / 2 + 2 * largest < full_bytes


@pytest.mark.parametrize("how", ["raises", "stalls"])
def test_a_failing_rank_makes_the_other_stop_with_an_error(how):
    pg_timeout = 3
    results = run_ranks(workers.one_rank_fails, 2, how, 5 * pg_timeout, timeout=120, pg_timeout=pg_timeout)
    survivor = results[0]
    assert not survivor.hung and survivor.error is not None, survivor
    assert "dist.wait" in survivor.traceback or "backward" in survivor.traceback
    if how == "raises":  # the peer's closed connection ends the collective at once
        assert results[1].error == "RuntimeError: rank 1 fails on purpose"
        assert survivor.seconds < pg_timeout + 30
    else:  # a stalled peer: the collective times out after the process group's timeout, well before the stall ends
        assert results[1].error is None
        assert survivor.seconds < results[1].seconds
