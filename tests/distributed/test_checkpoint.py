"""Checkpoints across world sizes (2 -> 1 -> 2), meta-device initialisation, and a rank that fails."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fulmen.distributed import checkpoint, manifest
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


Point = collections.namedtuple("Point", "x y")


def test_either_kind_replaces_the_other_and_nested_state_round_trips(tmp_path):
    path = tmp_path / "ckpt"
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "extra": [Point(torch.ones(2), 3), (torch.zeros(1),)],
             "step": 7}
    checkpoint.write_full({"old": torch.ones(1)}, path)
    checkpoint.write_sharded(state, path)  # a directory where a file was
    assert path.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.manifest.json"]
    loaded = checkpoint.read_sharded(path, {}, weights_only=False)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], state["model"]["w"])
    point = loaded["extra"][0]
    assert type(point) is Point and torch.equal(point.x, torch.ones(2)) and point.y == 3
    assert isinstance(loaded["extra"][1], tuple) and torch.equal(loaded["extra"][1][0], torch.zeros(1))
    checkpoint.write_full(state, path)  # and a file where a directory was
    assert path.is_file() and torch.load(path, weights_only=False)["step"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.manifest.json"]


@dataclasses.dataclass
class Progress:
    step: int
    best: torch.Tensor


class Settings(dict):
    pass


def test_sharded_checkpoint_paths_and_types_follow_the_container_rule(tmp_path):
    """Tensors are stored under their keys from the root (fulmen.core.pytree: positions, mapping keys, dataclass
    fields); what comes back has the types saved; a dict subclass holding tensors is refused before anything is
    written (kept whole, its tensors would be pickled rather than stored)."""
    t = [torch.full((2,), float(i)) for i in range(5)]
    state = {"model": collections.OrderedDict(w=t[0], b=t[1]), "progress": Progress(3, t[2]), "extra": [Point(t[3], 3)],
             "shape": torch.Size([2, 3]), "counts": collections.defaultdict(int, a=t[4]), "note": Settings(k=1)}
    path = tmp_path / "ckpt"
    checkpoint.write_sharded(state, path)
    places = [("model", "w"), ("model", "b"), ("progress", "best"), ("extra", 0, 0), ("counts", "a")]
    assert torch.load(path / checkpoint.META_FILE, weights_only=False)["tensors"] == places
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert sorted(stored) == sorted(["model/w", "model/b", "progress/best", "extra/0/0", "counts/a"])
    loaded = checkpoint.read_sharded(path, {}, weights_only=False)
    for key, value in state.items():
        assert type(loaded[key]) is type(value), key
    assert loaded["progress"].step == 3 and loaded["extra"][0].y == 3 and loaded["counts"].default_factory is int
    assert loaded["shape"] == (2, 3) and loaded["note"] == {"k": 1}
    got = [loaded["model"]["w"], loaded["model"]["b"], loaded["progress"].best, loaded["extra"][0].x,
           loaded["counts"]["a"]]
    for want, value in zip(t, got, strict=True):
        assert torch.equal(value, want)

    with pytest.raises(TypeError, match=r"not inside a .*Settings; pass dict\(value\)"):
        checkpoint.write_sharded({"note": Settings(k=torch.ones(1))}, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.manifest.json"]


def test_what_an_interrupted_save_leaves_is_named_and_cleaned_by_the_next(tmp_path):
    partial = tmp_path / f"ckpt{manifest.PARTIAL_MARK}123-abcdef"  # what a kill mid-save leaves
    partial.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint at .*ckpt, only what an interrupted save left "
                                                rf"\(ckpt{manifest.PARTIAL_MARK}123-abcdef\)"):
        checkpoint.load(workers.make_model(), tmp_path / "ckpt")
    checkpoint.save(workers.make_model(), tmp_path / "ckpt")  # the next save of that path clears it away
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.manifest.json"]


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_loading_checks_the_manifest(tmp_path, kind):
    model, path = workers.make_model(), tmp_path / "ckpt"
    checkpoint.save(model, path, FULL if kind == "full" else checkpoint.StateDictOptions())
    data = path if kind == "full" else max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    original = data.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 1
    data.write_bytes(bytes(flipped))
    fresh = workers.make_model(seed=3)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError, match=f"bytes 0-{len(original)} of {data} do not match"):
        checkpoint.load(fresh, path)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing was read
    data.write_bytes(original[:-1])
    with pytest.raises(checkpoint.CheckpointError, match=f"{data} has {len(original) - 1} bytes, its manifest says "
                                                         f"{len(original)} \\(truncated\\)"):
        checkpoint.load(fresh, path)
    data.write_bytes(original)
    checkpoint.load(fresh, path)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    manifest.manifest_path(path).unlink()  # written by another tool: loads, unverified
    assert not checkpoint.verify(path)
    checkpoint.load(workers.make_model(seed=4), path)


def _load_into_another_config(rank: int, world: int, directory: str) -> dict[str, str]:
    """Sharded and full checkpoints of the test model loaded into one with another vocabulary size."""
    model = workers.distribute(workers.make_model(), "zero3-none")
    checkpoint.save(model, f"{directory}/sharded")
    checkpoint.save(model, f"{directory}/full.pt", checkpoint.StateDictOptions(full_state_dict=True))
    errors = {}
    for name in ("sharded", "full.pt"):
        torch.manual_seed(1)
        other = workers.distribute(workers.GPT(workers.Config(**{**workers.CONFIG, "padded_vocab_size": 71})),
                                   "zero3-none")
        before = {key: p.detach().clone() for key, p in other.named_parameters()}
        try:
            checkpoint.load(other, f"{directory}/{name}")
        except ValueError as error:  # a ValueError, not DCP's CheckpointException (a BaseException)
            errors[name] = str(error)
        assert all(torch.equal(p, before[key]) for key, p in other.named_parameters())  # nothing was loaded
    return errors


def test_a_checkpoint_of_another_configuration_is_refused_by_name(tmp_path):
    for errors in values(run_ranks(_load_into_another_config, 2, str(tmp_path))):
        assert errors["sharded"] == (f"the checkpoint {tmp_path}/sharded holds 'lm_head.weight' of shape "
                                     "(67, 32), the live GPT's has (71, 32): it was saved from another model "
                                     "configuration")
        assert errors["full.pt"] == ("state dict entry 'lm_head.weight' has shape (67, 32), the model's parameter "
                                     "'lm_head.weight' has (71, 32)")
