"""The `fulmen.dynamo` torch.compile backend: Dynamo splits where it cannot capture, fulmen runs each captured graph
with its autodiff; what fulmen refuses runs by the fallback. Oracle: eager on the same inputs (values and grads)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch import nn

import fulmen


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compare(fn, backend, *inputs, calls=1):
    compiled = torch.compile(fn, backend=backend)
    for _ in range(calls):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        want = fn(*leaves)
        want.sum().backward()
        want_grads = [t.grad for t in leaves]
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        got = compiled(*leaves)
        got.sum().backward()
        torch.testing.assert_close(got, want)
        for g, w in zip((t.grad for t in leaves), want_grads):
            assert (g is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(g, w)


def data_dependent(x, w):
    y = torch.tanh(x @ w)
    if y.sum() > 0:  # a branch on a value: Dynamo breaks the graph here
        y = y * 2
    n = int((y > 0.5).sum().item())  # .item(): another break
    picked = y[torch.nonzero(y > 0)[:, 0]]  # data-dependent shape: another
    return y.sum(-1) * n + picked.sum()


def test_graph_breaks_run_every_captured_graph_through_fulmen():
    backend = fulmen.dynamo.backend(fallback="eager")
    _compare(data_dependent, backend, torch.randn(4, 3), torch.randn(3, 5, requires_grad=True))
    assert len(backend.graphs) >= 3 and backend.pieces and all(piece.by_fulmen for piece in backend.pieces)
    report = backend.report()
    assert "Dynamo graph break: Unsupported Tensor.item()" in report and "fulmen" in report
    traces = fulmen.last_traces(backend)
    assert len(traces) == len(backend.pieces) and "torch.tanh" in str(traces[0])
    assert "backward" in str(fulmen.last_backward_traces(backend)[0])


def with_cond(x, w):
    h = torch.relu(x @ w)
    h = torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t - 1, (h,))  # a higher-order op: a nested graph
    return h.sum(0) + h.mean(0)


@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_refused_nodes_are_split_out_and_run_by_the_fallback(fallback):
    backend = fulmen.dynamo.backend(fallback=fallback)
    _compare(with_cond, backend, torch.randn(4, 3), torch.randn(3, 5, requires_grad=True), calls=2)
    (record,) = backend.graphs
    kinds = [(piece.by_fulmen, bool(piece.reasons)) for piece in record.pieces]
    assert kinds == [(True, False), (False, True), (True, False)]
    assert "cond is a higher-order op" in backend.report()
    assert f"{fallback:<8}" in backend.report()


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3.5 * x * x * g  # not the true derivative: the Function's own backward must be what runs


def test_an_autograd_function_in_a_graph_runs_through_fulmen_with_its_backward():
    backend = fulmen.dynamo.backend(fallback="eager")
    _compare(lambda x, w: Cube.apply(torch.relu(x @ w)).sum(0), backend, torch.randn(4, 3),
             torch.randn(3, 5, requires_grad=True))
    (piece,) = backend.pieces
    assert piece.by_fulmen
    assert "3.5" in str(fulmen.last_backward_traces(backend)[0])


def test_a_graph_fulmen_refuses_after_acquiring_it_falls_back_whole():
    def scale_in_place(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y.as_strided((2,), (2,)) + 1  # differentiating through storage offsets is refused

    backend = fulmen.dynamo.backend(fallback="eager")
    _compare(scale_in_place, backend, torch.randn(5, requires_grad=True))
    first, second = backend.pieces
    assert first.by_fulmen and not first.reasons
    assert not second.by_fulmen and "addresses storage" in second.reasons[0]


def test_a_graph_updating_its_non_leaf_input_in_place_runs_through_fulmen():
    def scale_in_place(x, w):
        y = x * 2
        torch._dynamo.graph_break()
        y.mul_(w)  # an in-place update of the second graph's input, which requires grad: its history grows
        return y + 1

    backend = fulmen.dynamo.backend(fallback="eager")
    _compare(scale_in_place, backend, torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True))
    assert all(piece.by_fulmen for piece in backend.pieces)


def test_new_shapes_are_traced_anew():
    backend = fulmen.dynamo.backend(fallback="eager")
    w = torch.randn(3, 5, requires_grad=True)
    for rows in (2, 4, 6):
        _compare(lambda x, w: torch.relu(x @ w) * x.shape[0], backend, torch.randn(rows, 3), w)
    assert all(piece.by_fulmen for piece in backend.pieces)


def test_bad_arguments_are_refused_up_front():
    with pytest.raises(ValueError, match="fallback must be one of"):
        fulmen.dynamo.backend(fallback="aot")
    with pytest.raises(TypeError, match="JitOptions"):
        fulmen.dynamo.backend(options={"cse": False})
    with pytest.raises(ValueError, match="unknown executor"):
        fulmen.dynamo.backend(executors=["no_such_executor"])


def mixed_precision(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.relu(x @ w)
        with torch.autocast("cpu", enabled=False):
            z = y.float() @ w.T  # float32 again
        z = z @ w
    h = torch.cond(z.sum() > 0, lambda t: t * 2, lambda t: t - 1, (z,))
    return y.float().sum(0) + h.float().sum(0)


def test_autocast_regions_run_through_fulmen():
    # Dynamo's _enter_autocast / _exit_autocast nodes were refused: the region ran by the fallback, in pieces
    backend = fulmen.dynamo.backend(fallback="eager")
    _compare(mixed_precision, backend, torch.randn(4, 3), torch.randn(3, 5, requires_grad=True), calls=2)
    assert [(piece.by_fulmen, bool(piece.reasons)) for piece in backend.pieces] == [(True, False), (False, True),
                                                                                   (True, False)]
    assert "bfloat16" in str(fulmen.last_traces(backend)[0])


def weight_on_both_sides_of_a_cond(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x @ w,))
        return (h @ w).float()  # eager casts w to bfloat16 once for the region, and sums its grad in bfloat16


def test_a_node_refused_inside_an_autocast_region_makes_the_graph_fall_back_whole():
    # split there, w was cast once per piece and its grad differed from eager's
    backend = fulmen.dynamo.backend(fallback="eager")
    _compare(weight_on_both_sides_of_a_cond, backend, torch.randn(16, 16), torch.randn(16, 16, requires_grad=True))
    (piece,) = backend.pieces
    assert not piece.by_fulmen and "inside torch.autocast" in piece.reasons[0]


@pytest.mark.parametrize("dynamic", [True, None])  # None: Dynamo makes the size dynamic once it changes
def test_inductor_compiles_refused_pieces_with_dynamic_shapes(dynamic):
    # Inductor was handed the concrete inputs of a graph whose metadata holds Dynamo's symbolic sizes: it failed
    backend = fulmen.dynamo.backend(fallback="inductor")
    compiled = torch.compile(lambda x, w: with_cond(x, w) * x.shape[0], backend=backend, dynamic=dynamic)
    w = torch.randn(3, 5, requires_grad=True)
    for rows in (2, 4, 6):
        x = torch.randn(rows, 3)
        got = compiled(x, w)
        (got_grad,) = torch.autograd.grad(got.sum(), w)
        want = with_cond(x, w) * rows
        (want_grad,) = torch.autograd.grad(want.sum(), w)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    assert [piece.by_fulmen for piece in backend.graphs[-1].pieces] == [True, False, True]


def gather_positive(x, w):
    idx = torch.nonzero(x > 0)[:, 0]  # captured under capture_dynamic_output_shape_ops: a size only values decide
    picked = w[idx]
    return (picked * torch.arange(picked.shape[0])).sum() + idx.shape[0], idx


def test_sizes_known_only_from_values_are_bound_before_the_pieces_using_them():
    # the probe's stand-in for nonzero's output had no size (TypeError), and split_module found a cycle between the
    # pieces: the size was bound by a read in the piece after nonzero's, which used it (the Inductor fallback, which
    # compiles the piece from example values holding that size, was checked by hand: 3.5 s more)
    backend = fulmen.dynamo.backend(fallback="eager")
    compiled = torch.compile(gather_positive, backend=backend)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _compare_gather_positive_over_three_sizes(compiled)
    assert [(piece.by_fulmen, piece.reasons) for piece in backend.graphs[0].pieces] == [
        (True, []), (False, [f"torch.nonzero reads tensor values (at {_line(gather_positive, 'nonzero')})"]),
        (True, [])]


def _compare_gather_positive_over_three_sizes(compiled):
    for x in (torch.tensor([1.0, -1, 2, 3]), torch.tensor([-1.0, 2, -3, -4]), torch.tensor([1.0, 1, 1, 1])):
        w = torch.randn(4)
        grads = []
        for fn in (gather_positive, compiled):
            leaf = w.clone().requires_grad_()
            out, idx = fn(x, leaf)
            out.backward()
            grads.append((out, idx, leaf.grad))
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want)


def _line(fn, text):
    """`file:line in fn` of the line of `fn` holding `text`, as fulmen names a location."""
    lines, first = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"test_backend.py:{first + offset} in {fn.__name__}"


def normed(x, w, bn):
    h = torch.nn.functional.batch_norm(x @ w, *bn, training=True)
    return torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t - 1, (h,)).sum(0)


def test_traces_and_refusals_name_the_users_lines_and_dynamos_names_for_values():
    # named the graph's generated code (<eval_with_key>.4:5 in forward) and its inputs args_0, args_1, ...
    backend = fulmen.dynamo.backend(fallback="eager")
    w = torch.randn(3, 4, requires_grad=True)
    bn = [torch.zeros(4), torch.ones(4), torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)]
    x = torch.randn(5, 3)
    want = normed(x, w, [t.clone() for t in bn])
    torch.testing.assert_close(torch.compile(normed, backend=backend)(x, w, bn), want)
    taken, refused, _ = backend.pieces
    assert taken.by_fulmen and refused.reasons == [
        f"cond is a higher-order op (a nested graph); fulmen acquires plain torch calls (at {_line(normed, 'cond')})"]
    trace = fulmen.last_traces(backend)[0]
    assert f"{_line(normed, 'batch_norm')}: h = torch.nn.functional.batch_norm" in str(trace)
    assert "eval_with_key" not in str(trace)
    whole = fulmen.dynamo.backend(fallback="eager")
    torch.compile(lambda x, w: torch.relu(x @ w), backend=whole)(x, w)
    assert "def computation(L_x_, L_w_)" in str(fulmen.last_traces(whole)[0])


@torch.no_grad()
def _unit_phases(n):
    return torch.special.bessel_j0(torch.arange(float(n)))  # fulmen refuses torch.special.bessel_j0


def rotated(x, w):
    return ((x @ w) * _unit_phases(5)).sum(0)  # Dynamo: _set_grad_enabled(False) ... bessel_j0 ... (True) nodes


def test_a_refusal_inside_a_no_grad_region_leaves_grad_on_for_the_split_graph():
    # the whole graph's acquisition entered the region, was refused at bessel_j0 and left grad off: the pieces ran
    # without grad and w got none (deepseek_v2 and llama4_text lost the embeddings' grads so)
    backend = fulmen.dynamo.backend(fallback="eager")
    _compare(rotated, backend, torch.randn(4, 3), torch.randn(3, 5, requires_grad=True))
    assert [piece.by_fulmen for piece in backend.pieces] == [True, False, True]


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.scale = 0.5  # under dynamic=True Dynamo makes it a tensor input and reads it back with .item()

    def forward(self, x):
        return (self.linear(x) * self.scale).relu()


def test_a_piece_inductor_cannot_compile_after_dynamos_analysis_runs_eagerly():
    # Inductor raised TensorifyScalarRestartAnalysis (to restart an analysis long over) on the .item() piece, and
    # InductorError on every later call; LitGPT's float attributes (RMSNorm's eps) under dynamic=True failed so
    backend = fulmen.dynamo.backend(fallback="inductor")
    model = Scaled()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for rows in (2, 3):
        x = torch.randn(rows, 3)
        want = model(x)
        (want_grad,) = torch.autograd.grad(want.sum(), model.linear.weight)
        got = compiled(x)
        (got_grad,) = torch.autograd.grad(got.sum(), model.linear.weight)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    refused = [piece for piece in backend.pieces if not piece.by_fulmen]
    assert [piece.runs_by for piece in refused] == ["eager"]
    assert "Inductor cannot compile the piece here" in refused[0].reasons[-1] and "  submod_0   eager" in str(backend)


def test_a_graph_split_under_inference_mode_runs_as_eager():
    # the probe's stand-in for the refused cond was an inference tensor, whose storage fulmen's mode refused to read
    # (DataDependentError: torch.Tensor.untyped_storage): nn.TransformerEncoder's fast path under inference_mode
    backend = fulmen.dynamo.backend(fallback="eager")
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    with torch.inference_mode():
        got, want = torch.compile(with_cond, backend=backend)(x, w), with_cond(x, w)
    torch.testing.assert_close(got, want)
    assert got.is_inference() and [piece.by_fulmen for piece in backend.pieces] == [True, False, True]


class TwoScales(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
        self.scale, self.eps = 0.5, 1e-3  # under dynamic=True: tensor inputs read back with .item() where used

    def forward(self, x):
        return self.second((self.first(x) * self.scale).relu()) + self.eps


def test_reads_of_floats_dynamo_made_inputs_are_one_piece_before_fulmens():
    # each read was a piece of its own between fulmen's: LitGPT (two layers) ran as 17 pieces under dynamic=True
    backend = fulmen.dynamo.backend(fallback="eager")
    model = TwoScales()
    x = torch.randn(2, 3)
    torch.testing.assert_close(torch.compile(model, backend=backend, dynamic=True)(x), model(x))
    assert [piece.by_fulmen for piece in backend.pieces] == [False, True]


def read_after_update_of(x, view, w):
    x.add_(1)  # view is an input of its own, a view of x: its read must stay after this update
    return w * view.item()


def test_a_read_of_an_input_is_not_moved_before_an_update():
    backend = fulmen.dynamo.backend(fallback="eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(lambda x, view, w: read_after_update_of(x, view, w), backend=backend)
        base, want_base = torch.zeros(3), torch.zeros(3)
        got = compiled(base, base[0], torch.ones(2))
    want = read_after_update_of(want_base, want_base[0], torch.ones(2))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(base, want_base)


def counted_sin(x, w, calls):
    calls.add_(1)  # an update the graph makes once per call
    return (x * w).sin()


def test_forward_mode_tangents_are_refused_before_the_piece_runs():
    # fulmen refused the tangent only after its forward ran (in FulmenFunction.jvp), with the update made: the
    # fallback then ran the graph again, and the count went up by two
    import torch.autograd.forward_ad as forward_ad  # only this case uses forward-mode AD

    backend = fulmen.dynamo.backend(fallback="eager")
    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    results = []
    for fn in (counted_sin, torch.compile(counted_sin, backend=backend)):
        calls = torch.zeros(())
        with forward_ad.dual_level():
            out = forward_ad.unpack_dual(fn(forward_ad.make_dual(x, torch.ones(3)), w, calls))
        results.append((out.primal, out.tangent, calls))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)
    (piece,) = backend.pieces
    assert piece.runs_by == "eager" and "forward-mode tangents" in piece.reasons[0]


def compute_mask_indices(shape: tuple[int, int], mask_prob: float, mask_length: int, seed: int) -> np.ndarray:
    """Spans of frames to mask, drawn in numpy as transformers' `_compute_mask_indices` draws them (Dynamo breaks
    the graph there)."""
    rng = np.random.default_rng(seed)
    batch, frames = shape
    mask = np.zeros(shape, dtype=bool)
    spans = max(1, int(mask_prob * frames / mask_length))
    for row in range(batch):
        for start in rng.choice(frames - mask_length, spans, replace=False):
            mask[row, start : start + mask_length] = True
    return mask


class SpecAugmentLike(nn.Module):
    """Wav2Vec2's feature encoder, feature projection and time masking (`_mask_hidden_states`): the frames of a mask
    drawn in numpy take a learned embedding, written through a boolean mask into a view the graph before the break
    returned: the transposed convolution's features (a view of a tensor the graph computed), or the projection's
    result (a linear of a 3-d input, a view of its 2-d result)."""

    def __init__(self, masked: str) -> None:
        super().__init__()
        self.masked = masked
        self.conv = nn.Conv1d(3, 6, 3)
        self.layer_norm = nn.LayerNorm(6)
        self.projection = nn.Linear(6, 6)
        self.masked_spec_embed = nn.Parameter(torch.linspace(-1.0, 1.0, 6))
        self.head = nn.Linear(6, 2)

    def _mask(self, hidden_states: torch.Tensor, seed: int) -> torch.Tensor:
        mask_time_indices = compute_mask_indices(tuple(hidden_states.shape[:2]), 0.3, 2, seed)
        mask_time_indices = torch.tensor(mask_time_indices, device=hidden_states.device, dtype=torch.bool)
        hidden_states[mask_time_indices] = self.masked_spec_embed.to(hidden_states.dtype)
        return hidden_states

    def forward(self, input_values: torch.Tensor, seed: int) -> torch.Tensor:
        features = self.conv(input_values).transpose(1, 2)
        if self.masked == "features":
            features = self._mask(features, seed)
        hidden_states = self.projection(self.layer_norm(features))
        if self.masked == "hidden_states":
            hidden_states = self._mask(hidden_states, seed)
        return self.head(hidden_states.tanh()).sum()


@pytest.mark.parametrize("masked", ["features", "hidden_states"])
def test_a_view_a_graph_returned_is_updated_through_a_boolean_mask_after_a_break(masked):
    # fulmen's view outputs were views made inside its autograd Function: the graph after the break failed in
    # Dynamo's fake-tensor run of the setitem ('Output 0 of AsStrided is a view ... created inside a custom Function')
    torch.manual_seed(0)
    model = SpecAugmentLike(masked)
    backend = fulmen.dynamo.backend(fallback="eager")
    compiled = torch.compile(model, backend=backend)
    input_values = torch.randn(2, 3, 12)
    for seed in range(3):
        results = []
        for run in (model, compiled):
            model.zero_grad()
            loss = run(input_values, seed)
            loss.backward()
            results.append((loss.detach(), *(p.grad.clone() for p in model.parameters())))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want)
    assert len(backend.graphs) >= 2 and all(piece.by_fulmen for piece in backend.pieces)
