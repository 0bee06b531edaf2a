"""fulmen.core.pytree: the one container rule (which objects are containers, their keys, how they are rebuilt) and
the walks over it, checked against torch's pytree and against what a jitted program and a checkpoint give back."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils import _pytree

import fulmen
from fulmen.core import pytree

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float = 2.0
    tags: list = dataclasses.field(default_factory=list)


class Settings(dict):
    """A dict subclass no one registered: not a container."""


class Shape(tuple):
    """A tuple subclass no one registered: walked as a plain tuple."""


def _is_tensor(obj):
    return isinstance(obj, torch.Tensor)


def test_keys_and_rebuilt_types_of_every_container_kind():
    t = [torch.full((1,), float(i)) for i in range(10)]
    tree = {
        "tuple": (t[0], 1),
        "list": [t[1]],
        "ordered": collections.OrderedDict(b=t[2], a=t[3]),
        "default": collections.defaultdict(list, k=t[4]),
        "pair": Pair(t[5], "s"),
        "max": torch.return_types.max((t[6], t[7])),
        "deque": collections.deque([t[8]], maxlen=3),
        "batch": Batch(t[9], tags=[None]),
        "size": torch.Size([2, 3]),
        "settings": Settings(k=1),
        3: "int key",
    }
    paths = [path for path, _ in pytree.leaves_with_paths(tree, _is_tensor)]
    assert paths == [("tuple", 0), ("list", 0), ("ordered", "b"), ("ordered", "a"), ("default", "k"), ("pair", 0),
                     ("max", 0), ("max", 1), ("deque", 0), ("batch", "x")]
    # the same leaves, in the same order, as torch's pytree (plus the dataclass, which torch does not open)
    assert [id(leaf) for _, leaf in pytree.leaves_with_paths(tree, _is_tensor)] == list(map(id, t))
    torch_leaves = [leaf for leaf in _pytree.tree_leaves(tree) if _is_tensor(leaf) or isinstance(leaf, Batch)]
    assert list(map(id, torch_leaves)) == [*map(id, t[:-1]), id(tree["batch"])]

    doubled = pytree.tree_map(lambda x: x * 2, tree, _is_tensor)
    for key in ("tuple", "list", "ordered", "default", "pair", "max", "deque", "batch", "settings"):
        assert type(doubled[key]) is type(tree[key]), key
    assert doubled["default"].default_factory is list and doubled["deque"].maxlen == 3
    assert doubled["batch"].scale == 2.0 and doubled["batch"].tags == [None]
    assert torch.equal(doubled["batch"].x, t[9] * 2) and torch.equal(doubled["max"].indices, t[7] * 2)
    assert type(doubled["size"]) is tuple  # torch's pytree rebuilds torch.Size as a plain tuple
    assert doubled["settings"] is tree["settings"]  # a value, not looked into


def test_a_dataclass_keeps_its_identity_unless_a_field_changes():
    batch = Batch(torch.ones(1))
    assert pytree.tree_map(lambda x: x, batch, _is_tensor) is batch
    changed = pytree.tree_map(lambda x: x + 1, batch, _is_tensor)
    assert type(changed) is Batch and changed is not batch and torch.equal(changed.x, torch.full((1,), 2.0))


def test_dict_subclasses_are_values_and_other_sequences_plain():
    assert pytree.is_leaf(Settings(a=torch.ones(1))) and pytree.kept_whole(Settings())
    assert pytree.keyed_children(Shape((4, 5))) == [(0, 4), (1, 5)]
    assert type(pytree.tree_map(lambda x: x, Shape((4,)), _is_tensor)) is tuple
    assert pytree.kept_whole(Shape(())) and pytree.kept_whole(torch.Size([1]))
    assert not any(map(pytree.kept_whole, ((), [], {}, collections.OrderedDict(), Pair(1, 2), collections.deque())))
    assert not pytree.kept_whole(Batch(torch.ones(1)))


def test_a_type_registered_later_is_a_container_with_torchs_keys():
    class Box:
        def __init__(self, inner):
            self.inner = inner

    assert pytree.is_leaf(Box(1))  # asked before the registration: the answer is asked again after it
    _pytree.register_pytree_node(
        Box, lambda box: ([box.inner], None), lambda items, _: Box(items[0]),
        flatten_with_keys_fn=lambda box: ([(_pytree.GetAttrKey("inner"), box.inner)], None))
    tree = [Box(torch.ones(1))]
    assert [path for path, _ in pytree.leaves_with_paths(tree, _is_tensor)] == [(0, "inner")]
    rebuilt = pytree.unflatten(pytree.flatten(tree, leaves := []), [torch.zeros(1)])
    assert len(leaves) == 1 and type(rebuilt[0]) is Box and torch.equal(rebuilt[0].inner, torch.zeros(1))


def test_flatten_specialises_on_values_and_keeps_unhashable_ones_by_identity():
    class Options(list):  # unhashable and kept whole: specialised on its identity
        pass

    options = Options([1])
    kept: dict[int, object] = {}
    leaves: list[torch.Tensor] = []
    given = (torch.Size([2, 3]), options, Batch(torch.ones(1), 0.5), {"k": -0.0})
    spec = pytree.flatten(given, leaves, kept)
    assert kept == {id(options): options} and len(leaves) == 1
    again = pytree.unflatten(spec, [torch.zeros(1)], kept)
    assert type(again[0]) is torch.Size and again[0] == (2, 3) and again[1] is options
    assert type(again[2]) is Batch and again[2].scale == 0.5 and torch.equal(again[2].x, torch.zeros(1))
    other = pytree.flatten((torch.Size([2, 3]), options, Batch(torch.ones(1), 0.5), {"k": 0.0}), [])
    assert spec != other  # -0.0 and 0.0 are different keys


def test_jit_inputs_follow_the_rule():
    """Names are the keys from the argument to each tensor; torch.Size reaches the program as itself; tensors inside a
    container the rule keeps whole are refused (they would be captured as constants); an unhashable container the
    rule keeps whole is specialised on its identity."""

    def f(batch, pair, maps, shape, *rest, **kw):
        assert type(shape) is torch.Size
        return (batch.x * batch.scale + pair[0] + maps["w"] + maps["o"]["z"] + rest[0] + kw["extra"]).reshape(shape)

    jitted = fulmen.jit(f)
    t = torch.ones(6)
    args = (Batch(t), Pair(t, 1), {"w": t, "o": collections.OrderedDict(z=t)}, torch.Size([2, 3]), t)
    torch.testing.assert_close(jitted(*args, extra=t), f(*args, extra=t))
    names = [p.pname for p in fulmen.last_traces(jitted)[0].inputs]
    assert names == ["batch_x", "pair_0", "maps_w", "maps_o_z", "rest_0", "kw_extra"]

    with pytest.raises(TypeError, match=r"not inside a .*Shape; pass tuple\(value\)"):
        fulmen.jit(lambda s: s[0] * 2)(Shape((torch.ones(1),)))

    class Scales(list):
        pass

    scale = fulmen.jit(lambda x, s: x * s[0])
    first, second = Scales([2.0]), Scales([3.0])
    torch.testing.assert_close(scale(torch.ones(1), first), torch.full((1,), 2.0))
    torch.testing.assert_close(scale(torch.ones(1), second), torch.full((1,), 3.0))
    torch.testing.assert_close(scale(torch.ones(1), first), torch.full((1,), 2.0))
    assert (fulmen.cache_misses(scale), fulmen.cache_hits(scale)) == (2, 1)


def test_jit_outputs_come_back_as_their_types():
    def f(x):
        return {"pair": Pair(x + 1, "s"), "batch": Batch(x * 2, tags=["a"]), "ordered": collections.OrderedDict(y=x),
                "deque": collections.deque([x - 1], maxlen=2), "size": x.shape}

    x = torch.ones(2)
    out, ref = fulmen.jit(f)(x), f(x)
    for key in ref:
        assert type(out[key]) is type(ref[key]), key
    assert out["deque"].maxlen == 2 and out["batch"].tags == ["a"] and out["size"] == ref["size"]
    torch.testing.assert_close(out["batch"].x, ref["batch"].x)
    torch.testing.assert_close(out["deque"][0], ref["deque"][0])


def test_a_registered_dataclass_is_opened_by_its_fields():
    """transformers registers its ModelOutput dataclasses with torch's pytree (as dicts of the fields that are set);
    the rule opens them by field, so a program's input names are the field names."""
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    output = modeling_outputs.CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(2))
    assert type(output) in _pytree.SUPPORTED_NODES
    assert [key for key, _ in pytree.keyed_children(output)][:3] == ["loss", "logits", "past_key_values"]
    jitted = fulmen.jit(lambda out: out.logits * out["loss"])
    torch.testing.assert_close(jitted(output), torch.ones(2))
    assert [p.pname for p in fulmen.last_traces(jitted)[0].inputs] == ["out_loss", "out_logits"]
