"""fulmen.grad, vjp, jvp and vmap against torch.func: signatures, semantics, composition, errors and traces."""

from __future__ import annotations

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import fulmen

D = torch.float64


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-9)


def mlp_and_data(batch: int = 6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(D)
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = torch.randn(batch, 8, dtype=D), torch.randint(0, 4, (batch,))

    def loss(params, x, y):
        logits = tf.functional_call(model, params, (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    return params, x, y, loss


# --- the composites the issue names -------------------------------------------------------------------------------
def test_per_sample_gradients_of_an_mlp_equal_torch_funcs():
    params, x, y, loss = mlp_and_data()
    per_sample = fulmen.vmap(fulmen.grad(loss), in_dims=(None, 0, 0))
    got = per_sample(params, x, y)
    want = tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == (6, *params[name].shape)
        close(got[name], want[name])
    # the mean of the per-sample gradients is the batch gradient
    batch_grad = tf.grad(lambda p: torch.stack([loss(p, x[i], y[i]) for i in range(6)]).mean())(params)
    for name in want:
        close(got[name].mean(0), batch_grad[name])
    final = fulmen.last_traces(per_sample)[-1]
    assert "impls.batch_loop" not in str(final)  # every op of the MLP and its backward has a batching rule
    # the printed trace runs as it stands
    namespace: dict = {}
    exec(final.python(), namespace)
    flat = [*params.values(), x, y]
    for name, value in zip(want, namespace["computation"](*flat)):
        close(value, want[name])


def test_hessian_vector_products_equal_torch_funcs():
    params, x, y, loss = mlp_and_data()
    tangents = {name: torch.randn_like(p) for name, p in params.items()}

    def batch_loss(p):
        return sum(loss(p, x[i], y[i]) for i in range(3))

    got_grad, got_hvp = fulmen.jvp(fulmen.grad(batch_loss), (params,), (tangents,))
    want_grad, want_hvp = tf.jvp(tf.grad(batch_loss), (params,), (tangents,))
    for name in params:
        close(got_grad[name], want_grad[name])
        close(got_hvp[name], want_hvp[name])


@pytest.mark.parametrize(("padding_idx", "scale_grad_by_freq"), [(None, False), (2, False), (2, True)])
def test_per_sample_and_hessian_vector_products_through_an_embedding(padding_idx, scale_grad_by_freq):
    """The embedding's weight gradient is one kernel call in the backward (eager's); vmap and jvp see its
    decomposition, a scatter-add, and agree with torch.func's."""
    torch.manual_seed(0)
    weight = torch.randn(7, 3, dtype=D)
    index = torch.tensor([[2, 5, 2, 0], [1, 2, 2, 6], [3, 3, 3, 3]])

    def loss(weight, index):
        return F.embedding(index, weight, padding_idx, scale_grad_by_freq=scale_grad_by_freq).tanh().pow(2).sum()

    per_sample = fulmen.vmap(fulmen.grad(loss), in_dims=(None, 0))
    close(per_sample(weight, index), tf.vmap(tf.grad(loss), in_dims=(None, 0))(weight, index))
    assert "impls.batch_loop" not in str(fulmen.last_traces(per_sample)[-1])  # batched by rules, not a loop
    tangent = torch.randn_like(weight)
    for got, want in zip(fulmen.jvp(lambda w: fulmen.grad(loss)(w, index), (weight,), (tangent,)),
                         tf.jvp(lambda w: tf.grad(loss)(w, index), (weight,), (tangent,))):
        close(got, want)


def test_second_derivative_by_grad_of_grad():
    x = torch.randn(5, dtype=D)
    second = fulmen.grad(lambda x: fulmen.grad(lambda x: (x.sin() * x).sum())(x).sum())
    close(second(x), tf.grad(lambda x: tf.grad(lambda x: (x.sin() * x).sum())(x).sum())(x))


# --- grad ---------------------------------------------------------------------------------------------------------
def f2(x, w, scale=1.0):
    return (torch.tanh(x @ w) * scale).sum()


@pytest.mark.parametrize("argnums", [0, 1, -1, (0, 1), (1, 0)])
def test_grad_argnums(argnums):
    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 2, dtype=D)
    got = fulmen.grad(f2, argnums=argnums)(x, w, scale=2.0)
    want = tf.grad(f2, argnums=argnums)(x, w, scale=2.0)
    if isinstance(argnums, int):
        close(got, want)
    else:
        assert isinstance(got, tuple) and len(got) == 2
        for g, h in zip(got, want):
            close(g, h)


def test_grad_has_aux_pytrees_and_unused_inputs():
    params = {"a": torch.randn(3, dtype=D), "b": [torch.randn(2, dtype=D), torch.randn(2, dtype=D)]}

    def f(p):
        out = (p["a"].exp().sum() + p["b"][0].pow(2).sum())
        return out, {"out": out}

    (got, aux), (want, want_aux) = fulmen.grad(f, has_aux=True)(params), tf.grad(f, has_aux=True)(params)
    close(got["a"], want["a"])
    close(got["b"][0], want["b"][0])
    close(got["b"][1], torch.zeros(2, dtype=D))  # unused: zeros, as torch.func
    close(aux["out"], want_aux["out"])


def test_grad_ignores_an_outer_no_grad_and_composes_with_autograd():
    x = torch.randn(4, dtype=D)
    with torch.no_grad():
        close(fulmen.grad(lambda x: x.sin().sum())(x), x.cos())
    x.requires_grad_(True)
    g = fulmen.grad(lambda x: (x ** 3).sum())(x)  # 3 x^2, still a function of x for torch autograd
    g.sum().backward()
    close(x.grad, 6 * x.detach())


def test_grad_errors():
    x = torch.randn(3, dtype=D)
    with pytest.raises(fulmen.TraceError, match="expected f\\(\\*args\\) to return a scalar Tensor, got tensor with 1"):
        fulmen.grad(lambda x: x * 2)(x)
    with pytest.raises(fulmen.TraceError, match="only Tensors of floating point dtype can require gradients"):
        fulmen.grad(lambda x: x.sum())(torch.arange(3))
    with pytest.raises(ValueError, match="argnums=2, but the function was called with 1 positional"):
        fulmen.grad(lambda x: x.sum(), argnums=2)(x)
    with pytest.raises(fulmen.TraceError, match="updates its input .* in place"):
        fulmen.grad(lambda x: x.add_(1).sum())(x)
    with pytest.raises(TypeError, match="expects a function"):
        fulmen.grad(3)


def test_grad_inside_jit_with_the_jits_executors():
    x = torch.randn(4, 3, dtype=D)
    jitted = fulmen.jit(lambda x: fulmen.grad(lambda x: F.softmax(x, -1)[:, 0].sum())(x) * 2)
    close(jitted(x), 2 * tf.grad(lambda x: F.softmax(x, -1)[:, 0].sum())(x))
    again = fulmen.jit(fulmen.grad(lambda x: x.exp().sum()), executors=["torch"])
    close(again(x), x.exp())
    assert fulmen.last_traces(again)[-1].provenance == "Delete Last Used"


# --- vjp ----------------------------------------------------------------------------------------------------------
def test_vjp_outputs_cotangents_and_repeated_calls():
    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 2, dtype=D)

    def f(x, w):
        h = x @ w
        return h.sin(), (h.cos().sum(), h.exp())

    out, vjp_fn = fulmen.vjp(f, x, w)
    want_out, want_fn = tf.vjp(f, x, w)
    close(out[0], want_out[0])
    close(out[1][1], want_out[1][1])
    cotangents = (torch.randn(3, 2, dtype=D), (torch.tensor(2.0, dtype=D), torch.randn(3, 2, dtype=D)))
    for _ in range(2):  # the backward runs as often as vjp_fn is called
        got = vjp_fn(cotangents)
        want = want_fn(cotangents)
        assert isinstance(got, tuple) and len(got) == 2
        for g, h in zip(got, want):
            close(g, h)
    with pytest.raises(fulmen.TraceError, match="the cotangents' structure"):
        vjp_fn(torch.ones(3, 2, dtype=D))


def test_vjp_of_dropout_uses_the_forwards_mask():
    x = torch.randn(200, dtype=D)
    out, vjp_fn, aux = fulmen.vjp(lambda x: (F.dropout(x, 0.5), 7), x, has_aux=True)
    (grad,) = vjp_fn(torch.ones(200, dtype=D))
    kept = out != 0
    assert 0 < kept.sum() < 200 and aux == 7
    close(grad, kept.to(D) * 2.0)


def test_vjp_inside_jit():
    x = torch.randn(5, dtype=D)
    jitted = fulmen.jit(lambda x, v: fulmen.vjp(torch.tanh, x)[1](v)[0])
    v = torch.randn(5, dtype=D)
    close(jitted(x, v), tf.vjp(torch.tanh, x)[1](v)[0])


# --- jvp ----------------------------------------------------------------------------------------------------------
def test_jvp_pytrees_aux_integer_outputs_and_repeated_primals():
    a, b = torch.randn(3, 3, dtype=D), torch.randn(3, dtype=D)
    ta, tb = torch.randn(3, 3, dtype=D), torch.randn(3, dtype=D)

    def f(p):
        y = p["a"] @ p["b"]
        return (y.exp(), y.argmax()), y.sum()

    (out, tangent, aux) = fulmen.jvp(f, ({"a": a, "b": b},), ({"a": ta, "b": tb},), has_aux=True)
    want_out, want_tangent, want_aux = tf.jvp(f, ({"a": a, "b": b},), ({"a": ta, "b": tb},), has_aux=True)
    close(out[0], want_out[0])
    close(tangent[0], want_tangent[0])
    assert torch.equal(tangent[1], want_tangent[1]) and tangent[1].dtype == torch.long  # zeros, as torch.func
    close(aux, want_aux)
    # the same tensor twice keeps both tangents
    got = fulmen.jvp(torch.mul, (b, b), (tb, 2 * tb))
    want = tf.jvp(torch.mul, (b, b), (tb, 2 * tb))
    close(got[1], want[1])


def test_jvp_errors():
    x = torch.randn(3, dtype=D)
    with pytest.raises(ValueError, match="must have the same shape and dtype"):
        fulmen.jvp(torch.sin, (x,), (torch.ones(4, dtype=D),))
    with pytest.raises(TypeError, match="must be tuples"):
        fulmen.jvp(torch.sin, x, x)


def test_jvp_trace_uses_rules_and_prints():
    x, t = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    jitted = fulmen.jit(lambda x, t: fulmen.jvp(lambda x: F.gelu(x).sum(), (x,), (t,)))
    out, tangent = jitted(x, t)
    close(tangent, tf.jvp(lambda x: F.gelu(x).sum(), (x,), (t,))[1])
    final = str(fulmen.last_traces(jitted)[-1])
    assert "impls.torch_jvp" not in final and "prims.erf" in final


# --- vmap ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("x_shape", "w_shape", "in_dims", "out_dims"), [
    ((4, 5, 3), (3, 2), (0, None), 0),
    ((5, 4, 3), (3, 2), (1, None), 0),
    ((5, 3, 4), (3, 2), (-1, None), 1),
    ((4, 5, 3), (4, 3, 2), (0, 0), -1),
    ((5, 4, 3), (3, 2, 4), (1, 2), 2),
])
def test_vmap_in_and_out_dims(x_shape, w_shape, in_dims, out_dims):
    x, w = torch.randn(x_shape, dtype=D), torch.randn(w_shape, dtype=D)

    def f(x, w):
        return torch.tanh(x @ w)

    got = fulmen.vmap(f, in_dims=in_dims, out_dims=out_dims)(x, w)
    close(got, tf.vmap(f, in_dims=in_dims, out_dims=out_dims)(x, w))


def test_vmap_nested_structures_kwargs_and_unbatched_outputs():
    xs = {"a": torch.randn(3, 4, dtype=D), "b": (torch.randn(4, dtype=D), torch.randn(3, 2, dtype=D))}

    def f(p, scale=1.0):
        return {"sum": (p["a"] * p["b"][0]).sum() * scale, "const": p["b"][0] * 2, "pair": p["b"][1].flip((0,))}

    in_dims = ({"a": 0, "b": (None, 0)},)
    got = fulmen.vmap(f, in_dims=in_dims, out_dims={"sum": 0, "const": 0, "pair": 1})(xs, scale=3.0)
    want = tf.vmap(f, in_dims=in_dims, out_dims={"sum": 0, "const": 0, "pair": 1})(xs, scale=3.0)
    for key in want:
        close(got[key], want[key])
    assert got["const"].shape == (3, 4)  # an unbatched output is broadcast over the batch


def test_nested_vmap_and_chunks():
    x, y = torch.randn(3, 4, 5, dtype=D), torch.randn(4, 5, dtype=D)
    f = lambda a, b: (a * b).sum(-1)  # noqa: E731
    got = fulmen.vmap(fulmen.vmap(f, in_dims=(0, 0)), in_dims=(0, None))(x, y)
    close(got, tf.vmap(tf.vmap(f, in_dims=(0, 0)), in_dims=(0, None))(x, y))
    chunked = fulmen.vmap(torch.outer, chunk_size=2)
    a, b = torch.randn(5, 3, dtype=D), torch.randn(5, 4, dtype=D)
    close(chunked(a, b), tf.vmap(torch.outer)(a, b))
    assert str(fulmen.last_traces(chunked)[-1]).count("prims.cat") == 1  # three chunks joined once


def test_vmap_randomness():
    x = torch.randn(4, 3, dtype=D)
    with pytest.raises(fulmen.TraceError, match="draws random numbers; pass randomness='same' or 'different'"):
        fulmen.vmap(lambda x: x + torch.rand(3, dtype=D))(x)
    same = fulmen.vmap(lambda x: x + torch.rand(3, dtype=D), randomness="same")(x)
    noise = same - x
    assert torch.allclose(noise, noise[0].expand_as(noise))  # one draw for the batch
    different = fulmen.vmap(lambda x: x + torch.rand(3, dtype=D), randomness="different")(x)
    noise = different - x
    assert not torch.allclose(noise[0], noise[1]) and ((noise >= 0) & (noise < 1)).all()
    with pytest.raises(ValueError, match="randomness must be"):
        fulmen.vmap(torch.sin, randomness="sometimes")


# Draws over a batched argument (a batch of 4 examples of shape (3, 5), values in [0.1, 0.9))
SAME_DRAWS = {
    "dropout": lambda x: F.dropout(x, 0.5),
    "torch_dropout": lambda x: torch.dropout(x, 0.3, True),
    "randn_like": lambda x: torch.randn_like(x),
    "rand_like": lambda x: torch.rand_like(x),
    "randint_like": lambda x: torch.randint_like(x, 9),
    "randn": lambda x: x * 0 + torch.randn(3, 5, dtype=D),  # exactly the draw: x is finite
}


def _noise(name: str, y: torch.Tensor) -> torch.Tensor:
    """What each example drew: the dropout mask, or the draw itself."""
    return y != 0 if "dropout" in name else y


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("name", sorted(SAME_DRAWS))
def test_vmap_randomness_same_shares_one_draw_over_batched_arguments(name, chunk_size):
    """torch.func.vmap(randomness='same') gives every example the same draw (also across chunks: it restores the
    RNG state before each); fulmen refused the ones over batched arguments, and drew anew in each chunk."""
    fn, x = SAME_DRAWS[name], torch.rand(4, 3, 5, dtype=D) * 0.8 + 0.1
    torch.manual_seed(0)
    ours = fulmen.vmap(fn, randomness="same", chunk_size=chunk_size)(x)
    torch.manual_seed(0)
    theirs = tf.vmap(fn, randomness="same", chunk_size=chunk_size)(x)
    assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
    noise = _noise(name, ours)
    for i in range(1, len(x)):
        assert torch.equal(noise[i], noise[0]), f"example {i} drew otherwise than example 0"
    if "dropout" in name:
        p = 0.5 if name == "dropout" else 0.3
        assert torch.allclose(ours, x * noise / (1 - p))
    torch.manual_seed(0)
    different = _noise(name, fulmen.vmap(fn, randomness="different", chunk_size=chunk_size)(x))
    assert any(not torch.equal(different[i], different[0]) for i in range(1, len(x)))


@pytest.mark.parametrize("draw", [lambda x: torch.bernoulli(x), lambda x: torch.normal(x, 1.0),
                                  lambda x: torch.multinomial(x, 2)], ids=["bernoulli", "normal", "multinomial"])
def test_vmap_randomness_same_refuses_draws_that_read_batched_values(draw):
    """They draw from each example's values, which one shared draw cannot: torch.func refuses them too."""
    x = torch.rand(4, 3, 5, dtype=D)
    with pytest.raises(RuntimeError, match="same randomness with a batched tensor input"):
        tf.vmap(draw, randomness="same")(x)
    with pytest.raises(fulmen.TraceError, match="randomness='same'\\) cannot batch.*torch.func.vmap refuses"):
        fulmen.vmap(draw, randomness="same")(x)


@pytest.mark.parametrize("fn", [lambda x: F.dropout(x, 0.5, training=False), lambda x: F.dropout(x, 0.0),
                                lambda x: F.dropout(x, 1.0), lambda x: torch.dropout(x, 0.5, False)],
                         ids=["eval", "p0", "p1", "torch_dropout_eval"])
@pytest.mark.parametrize("randomness", ["error", "same", "different"])
def test_vmap_dropout_that_draws_nothing_runs_in_every_randomness_mode(fn, randomness):
    x = torch.randn(4, 3, 5, dtype=D)
    assert torch.equal(fulmen.vmap(fn, randomness=randomness)(x), tf.vmap(fn, randomness=randomness)(x))


def test_vmap_errors_match_torch_funcs():
    x = torch.randn(3, dtype=D)
    with pytest.raises(ValueError, match="same size in the mapped dimension, got sizes \\[3, 4\\]"):
        fulmen.vmap(torch.add)(x, torch.randn(4, dtype=D))
    with pytest.raises(ValueError, match="got in_dim=1 for an input of 1 dims"):
        fulmen.vmap(torch.sin, in_dims=1)(x)
    with pytest.raises(ValueError, match="at least one input must be a tensor mapped over"):
        fulmen.vmap(torch.sin, in_dims=None)(x)
    with pytest.raises(ValueError, match="must only return Tensors, got int"):
        fulmen.vmap(lambda x: 1)(x)
    with pytest.raises(fulmen.TraceError, match="updates its input .* in place"):
        fulmen.vmap(lambda x: x.mul_(2))(x)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        fulmen.vmap(torch.sin, chunk_size=0)
    # an in-place update of an intermediate value is fine
    close(fulmen.vmap(lambda x: x.clone().mul_(2))(x), 2 * x)


def test_vmap_of_jvp_and_jvp_of_vmap():
    x, t = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)

    def f(x):
        return torch.sigmoid(x).sum()

    got = fulmen.vmap(lambda x, t: fulmen.jvp(f, (x,), (t,))[1])(x, t)
    close(got, tf.vmap(lambda x, t: tf.jvp(f, (x,), (t,))[1])(x, t))
    got = fulmen.jvp(fulmen.vmap(f), (x,), (t,))[1]
    close(got, tf.jvp(tf.vmap(f), (x,), (t,))[1])


def _detached_updates(x, w):
    y = x * 2
    y.detach().mul_(w)  # invisible to autograd: y keeps its tangent and its grad
    with torch.no_grad():
        y[0] = 5.0
    return (y * x.detach() * x).sum()


def test_updates_autograd_does_not_see_keep_tangents_and_grads_as_torch_func():
    x, w = torch.arange(1.0, 3.0, dtype=D), torch.tensor([2.0, 3.0], dtype=D)
    ones = torch.ones(2, dtype=D)
    close(fulmen.jvp(_detached_updates, (x, w), (ones, ones)), tf.jvp(_detached_updates, (x, w), (ones, ones)))
    close(fulmen.grad(_detached_updates)(x, w), tf.grad(_detached_updates)(x, w))
    xs = torch.arange(6.0, dtype=D).reshape(3, 2)
    close(fulmen.vmap(_detached_updates, in_dims=(0, None))(xs, w),
          tf.vmap(_detached_updates, in_dims=(0, None))(xs, w))


def _empty_batch_programs(grad):
    return [
        lambda x, w: torch.tanh(x @ w),
        lambda x, w: (x.sum(), F.softmax(x, 0)),
        lambda x, w: grad(lambda a: (a @ w).exp().sum())(x),
        lambda x, w: w[x.long().clamp(0, 2)],  # indexing by a batched index: once per example (a batch loop)
    ]


@pytest.mark.parametrize("index", range(4))
def test_vmap_of_an_empty_batch_equals_torch_funcs(index):
    """torch.func maps over 0 examples; fulmen raised an internal error (a chunk size of 0, a loop with no example
    to stack)."""
    x, w = torch.randn(0, 3, dtype=D), torch.randn(3, 5, dtype=D)
    ours, theirs = _empty_batch_programs(fulmen.grad)[index], _empty_batch_programs(tf.grad)[index]
    got, want = fulmen.vmap(ours, in_dims=(0, None))(x, w), tf.vmap(theirs, in_dims=(0, None))(x, w)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, h in zip(got, want, strict=True):
        assert g.shape == h.shape and g.dtype == h.dtype
