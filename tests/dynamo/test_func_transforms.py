"""torch.func transforms under the `fulmen.dynamo` backend: Dynamo inlines vmap / grad / vjp / jvp as functorch levels
around the function's torch calls; the fallback runs each level's region whole and fulmen the rest. Oracle: eager
on the same inputs (values and grads of the outer backward)."""

from __future__ import annotations

import pytest
import torch

import fulmen


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _assert_as_eager(fn, backend):
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    results = []
    for run in (fn, torch.compile(fn, backend=backend)):
        leaf = w.clone().requires_grad_()
        out = run(x, leaf)
        out.sum().backward()
        results.append((out, leaf.grad))
    (want, want_grad), (got, got_grad) = results
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def vmapped(x, w):
    scale = torch.arange(3.0)  # a torch call inside the level on a tensor that is not batched
    return torch.vmap(lambda row: (row * scale) @ w)(x.cos()).sin().sum(0)


def grad_of(x, w):
    return torch.func.grad(lambda a: (a @ w).sin().sum())(x.cos()) * 2


def jvp_of(x, w):
    y, tangent = torch.func.jvp(lambda a: (a @ w).sin(), (x.cos(),), (torch.ones_like(x),))
    return y * 2 + tangent


@pytest.mark.parametrize(("fn", "transform"), [(vmapped, "torch.vmap"), (grad_of, "torch.func.grad"),
                                               (jvp_of, "torch.func.jvp")])
def test_a_transforms_region_runs_whole_by_the_fallback(fn, transform):
    # split node by node, a batched tensor reached fulmen (Cannot access storage of BatchedTensorImpl), or the
    # probe ran the transform's own autograd call on its stand-ins (RuntimeError)
    backend = fulmen.dynamo.backend(fallback="eager")
    _assert_as_eager(fn, backend)
    pieces = backend.pieces
    refused = [piece for piece in pieces if not piece.by_fulmen]
    assert len(refused) == 1 and len(refused[0].reasons) == 1
    assert refused[0].reasons[0].startswith(f"inside {transform}") and "torch.func transform" in refused[0].reasons[0]
    assert any(piece.by_fulmen for piece in pieces)


def test_a_vmap_region_compiles_with_inductor():
    _assert_as_eager(vmapped, fulmen.dynamo.backend(fallback="inductor"))


def vjp_called_later(x, w):
    y, pullback = torch.func.vjp(lambda a: (a @ w).sin(), x.cos())
    return pullback(torch.ones_like(y) * 3)[0] + y.sum()  # pullback runs after the level has ended


def test_a_value_used_after_its_transform_makes_the_graph_fall_back_whole():
    backend = fulmen.dynamo.backend(fallback="eager")
    _assert_as_eager(vjp_called_later, backend)
    (piece,) = backend.pieces
    assert not piece.by_fulmen and "is used after the transform" in piece.reasons[0]


def relative_attention(q, k, v):
    # flex_attention's block mask vmaps its mask function; the op itself is a higher-order op fulmen refuses
    from torch.nn.attention.flex_attention import flex_attention  # a torch submodule only this case needs

    return flex_attention(q, k, v, score_mod=lambda score, b, h, i, j: score + (i - j) * 0.1).sum(1)


def test_flex_attention_runs_by_the_fallback():
    # a batched tensor reached fulmen. And the op's results went as a tuple to the next piece, which took its item:
    # the Inductor fallback compiled such a piece item by item from Dynamo's example values, more items than
    # Inductor's own graph of the op gives (IndexError); now the item is taken in the op's piece
    backend = fulmen.dynamo.backend(fallback="eager")  # Inductor compiles flex_attention in ~7 s on CPU: too slow
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)  # forward only: flex_attention has no backward on CPU
    torch.testing.assert_close(torch.compile(relative_attention, backend=backend)(q, k, v),
                               relative_attention(q, k, v))
    refused = [piece for piece in backend.pieces if not piece.by_fulmen]
    assert [piece.reasons[0].split(" (", 1)[0] for piece in refused] == [
        "inside torch.vmap", "flex_attention is a higher-order op"]
    results = torch.utils._pytree.tree_leaves(refused[1].runner.module.graph.output_node().args)
    assert all(isinstance(result.meta["example_value"], torch.Tensor) for result in results)
