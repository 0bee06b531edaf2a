"""The autograd contexts and hooks users wrap around a jitted call, against eager PyTorch on the same inputs and seed.

Saved-tensor hooks (`saved_tensors_hooks`, `save_on_cpu`) run on each tensor fulmen's backward saves: that is not
eager's list (fulmen saves fewer and recomputes cheap values), but every saved tensor goes through pack and the
backward uses what unpack gives back, so offloading, quantizing or checkpointing through them works (counting them
counts fulmen's). Activation checkpointing, gradient hooks, anomaly mode, grad and inference modes, `retain_graph`
and cotangents of any layout behave as eager's. Where fulmen saves an input eager does not, an in-place update of it
after the call fails the backward naming it (never a wrong grad).
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils.checkpoint import checkpoint

import fulmen
from fulmen.core.errors import TraceError


class _Block(torch.nn.Module):
    """Linear, BatchNorm (running statistics updated in place), tanh, dropout (the global generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.drop = torch.nn.Dropout(0.5)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.linear(x)).tanh())


def _block_and_input() -> tuple[_Block, torch.Tensor]:
    torch.manual_seed(0)
    return _Block(), torch.randn(5, 3, requires_grad=True)


def _both(run):
    """`run(module, fn, x)` for eager and for fulmen.jit, each on a fresh block and input."""
    results = []
    for jit in (False, True):
        block, x = _block_and_input()
        results.append(run(block, fulmen.jit(block) if jit else block, x))
    return results


def _grads(block: torch.nn.Module, x: torch.Tensor) -> list:
    return [x.grad, *(p.grad for p in block.parameters())]


def _mul_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum()


def _leaves() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)


def test_saved_tensor_hooks_pack_every_saved_tensor_and_the_backward_uses_what_unpack_returns():
    results = []
    for fn in (_mul_sum, fulmen.jit(_mul_sum)):
        x, w = _leaves()
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor, packed: list = packed) -> int:
            packed.append(t)
            return len(packed) - 1

        # unpack hands back zeros: eager's grads are zeros, and so must fulmen's be (not the values it kept)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda i, packed=packed: torch.zeros_like(packed[i])):
            y = fn(x, w)
        y.backward()
        results.append((x.grad, w.grad, sorted(t.data_ptr() for t in packed)))
    (x_eager, w_eager, ptrs_eager), (x_grad, w_grad, ptrs) = results
    torch.testing.assert_close(x_grad, x_eager, rtol=0, atol=0)
    torch.testing.assert_close(w_grad, w_eager, rtol=0, atol=0)
    assert len(ptrs) == len(ptrs_eager) == 2


def _read_then_update(buf: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = (buf * w).sum()  # saves buf for w's grad
    buf.add_(1)  # then updates it in place
    return out


@pytest.mark.parametrize("pack", [lambda t: t, torch.clone], ids=["keeps_the_tensor", "copies_it"])
def test_saved_tensor_hooks_pack_an_input_before_the_program_updates_it_as_eager(pack):
    """Eager packs buf when the mul runs, before the update, and checks no version of what hooks packed: a hook that
    keeps the tensor sees the update, one that copies it keeps the old value. fulmen packs such an input before its
    forward runs (it used to pack the updated input after it, and refuse the backward on the version)."""
    results = []
    for fn in (_read_then_update, fulmen.jit(_read_then_update)):
        (buf, w), retains = _leaves(), []
        buf = buf.detach()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(buf, w)
        y.backward(retain_graph=True)
        retains.append(w.grad.clone())
        y.backward()
        results.append([*retains, w.grad, buf])
    torch.testing.assert_close(results[1], results[0])


def test_save_on_cpu_gives_eagers_grads():
    def run(block, fn, x):
        with torch.autograd.graph.save_on_cpu():
            fn(x).sum().backward()
        return _grads(block, x)

    want, got = _both(run)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_recomputes_with_the_same_dropout_mask_and_updates_batchnorm_stats_twice(reentrant):
    def run(block, fn, x):
        torch.manual_seed(1)
        y = checkpoint(fn, x, use_reentrant=reentrant)
        (y * torch.arange(4.0)).sum().backward()
        return [y.detach(), *_grads(block, x), block.norm.running_mean, block.norm.running_var,
                block.norm.num_batches_tracked, torch.rand(2)]  # the generator state after it all

    want, got = _both(run)
    assert want[-2] == 2  # eager's recompute ran BatchNorm again
    torch.testing.assert_close(got, want)


def test_post_accumulate_grad_hooks_step_the_optimizer_in_backward_as_eager():
    def run(block, fn, x):
        optimizers = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in block.parameters()}

        def step(p: torch.Tensor) -> None:
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in block.parameters():
            p.register_post_accumulate_grad_hook(step)
        for _ in range(2):
            fn(x).sum().backward()
        return [*block.parameters(), *(p.grad for p in block.parameters())]

    want, got = _both(run)
    torch.testing.assert_close(got, want)


def test_tensor_hooks_on_parameters_and_inputs_see_and_change_eagers_grads():
    def run(block, fn, x):
        seen = []
        block.linear.weight.register_hook(lambda g: seen.append(g.clone()) or g * 2)
        x.register_hook(lambda g: seen.append(g.clone()) or g * 3)
        fn(x).sum().backward()
        return [*seen, *_grads(block, x)]

    want, got = _both(run)
    assert len(got) == len(want)
    torch.testing.assert_close(got, want)


def test_anomaly_mode_raises_for_nan_in_the_backward_as_eager():
    def f(x):
        return (x.sqrt() * 0).sum()  # sqrt's grad at 0 is inf, times 0: nan

    for fn in (f, fulmen.jit(f)):
        x = torch.tensor([0.0, 1.0], requires_grad=True)
        with torch.autograd.set_detect_anomaly(True), pytest.warns(UserWarning, match="Error detected"):
            with pytest.raises(RuntimeError, match="returned nan values"):
                fn(x).backward()


@pytest.mark.parametrize("inference_first", [True, False], ids=["inference_first", "grad_first"])
def test_enable_grad_inside_inference_mode_records_no_history_as_eager(inference_first):
    """Either call may trace: one traced under inference mode must still differentiate for the other, and one traced
    outside it must run without saving for a backward (its intermediates are inference tensors)."""

    def run(block, fn, x):
        block.eval()  # no running statistics updated: the calls see the same module
        results = []
        for inference in (inference_first, not inference_first):
            with torch.inference_mode(inference), torch.enable_grad():
                y = fn(x)
            results += [y.detach().clone(), y.requires_grad, y.is_inference()]
            if not inference:
                y.sum().backward()
        return [*results, *_grads(block, x)]

    want, got = _both(run)
    assert [want[k] for k in (1, 2, 4, 5)] == ([False, True, True, False] if inference_first
                                               else [True, False, False, True])
    torch.testing.assert_close(got, want)


def test_a_program_enabling_grad_traced_first_under_inference_mode_differentiates_under_no_grad():
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(3).eval()

    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return norm((x * w).exp())

    results = []
    for fn in (program, fulmen.jit(program)):
        x, w = _leaves()
        with torch.inference_mode():
            inferred = fn(x.detach(), w)
        with torch.no_grad():
            y = fn(x.detach(), w)  # the same cache entry: grad mode is off for both calls
        y.sum().backward()
        results.append([inferred, inferred.requires_grad, y, y.requires_grad, w.grad])
    want, got = results
    assert want[1] is False and want[3] is True
    torch.testing.assert_close(got, want)


def test_enable_grad_inside_no_grad_gives_eagers_grads():
    def run(block, fn, x):
        with torch.no_grad(), torch.enable_grad():
            y = fn(x)
        y.sum().backward()
        return [y.requires_grad, *_grads(block, x)]

    want, got = _both(run)
    torch.testing.assert_close(got, want)


def test_autograd_grad_of_some_parameters_allows_unused_ones_as_eager():
    def run(block, fn, x):
        y = fn(x).sum()
        return list(torch.autograd.grad(y, [block.unused.weight, block.linear.weight, x], allow_unused=True))

    want, got = _both(run)
    assert want[0] is None and got[0] is None
    torch.testing.assert_close(got[1:], want[1:])


def test_retain_graph_then_a_second_backward_accumulates_twice_as_eager():
    def run(block, fn, x):
        y = fn(x).sum()
        grads = torch.autograd.grad(y, [x], retain_graph=True)
        y.backward(retain_graph=True)
        y.backward()
        return [*grads, *_grads(block, x)]

    want, got = _both(run)
    torch.testing.assert_close(got, want)


def test_retain_graph_under_saved_tensor_hooks_accumulates_twice_as_eager():
    def run(block, fn, x):
        with torch.autograd.graph.save_on_cpu():
            y = fn(x).sum()
        y.backward(retain_graph=True)
        y.backward()
        return _grads(block, x)

    want, got = _both(run)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["transposed", "expanded"])
def test_backward_with_a_gradient_of_any_layout_gives_eagers_grads(layout):
    def run(block, fn, x):
        y = fn(x)
        gradient = torch.randn(4, 5).t() if layout == "transposed" else torch.randn(1, 4).expand(5, 4)
        y.backward(gradient)
        return _grads(block, x)

    want, got = _both(run)
    torch.testing.assert_close(got, want)


def _views(x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.t(), x[0], (x * a).sum()  # x is not saved (a needs no grad): its views may be updated in place


def test_outputs_that_are_views_of_inputs_share_their_memory_and_history_as_eager():
    results = []
    for fn in (_views, fulmen.jit(_views)):
        leaf, a = _leaves()
        x = leaf * 1  # not a leaf, so its views may be updated in place
        t, row, total = fn(x, a.detach())
        assert t._base is x and row._base is x and t.data_ptr() == x.data_ptr()
        row.mul_(2)  # an in-place update of a view rebases the history of x, as eager's
        (t.sum() * t.sum() + total).backward()
        results.append((x.detach().clone(), leaf.grad))
    torch.testing.assert_close(results[1], results[0])


def _exp_of_product(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return (x * a).exp().sum()  # eager saves the exp; fulmen saves x (and a) and recomputes it


def test_an_input_fulmen_saves_where_eager_does_not_updated_after_the_call_is_refused_naming_it():
    x, a = _leaves()
    x = x * 1
    y = _exp_of_product(x, a.detach())
    x.mul_(2)
    y.backward()  # eager's backward does not read x

    x, a = _leaves()
    x = x * 1
    y = fulmen.jit(_exp_of_product)(x, a.detach())
    x.mul_(2)
    with pytest.raises(RuntimeError, match=r"x \(saved by a fulmen-jitted function\).*update a clone of it"):
        y.backward()


def test_allow_mutation_on_saved_tensors_lets_an_input_be_updated_after_the_call_as_eager():
    results = []
    for fn in (_exp_of_product, fulmen.jit(_exp_of_product)):
        leaf, a = _leaves()
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            x = leaf * 1
            y = fn(x, a)
            x.mul_(2)  # the saved x is cloned before the update
            y.backward()
        results.append((leaf.grad, a.grad))
    torch.testing.assert_close(results[1], results[0])


def _sin_of_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sin()


def test_forward_mode_tangents_through_a_call_that_computes_grads_are_refused_naming_the_input_and_line():
    x, w = _leaves()
    x = x.detach()
    with fwAD.dual_level():
        want = fwAD.unpack_dual(_sin_of_product(fwAD.make_dual(x, torch.ones_like(x)), w))
        assert want.tangent is not None and want.primal.requires_grad  # eager carries both
        jitted = fulmen.jit(_sin_of_product)
        with pytest.raises(TraceError, match=r"(?s)forward-mode tangents.*here x carries one.*test_autograd_contexts"):
            jitted(fwAD.make_dual(x, torch.ones_like(x)), w)
        with torch.no_grad():  # no backward to build: the tangent flows through the trace's ops
            got = fwAD.unpack_dual(jitted(fwAD.make_dual(x, torch.ones_like(x)), w))
    torch.testing.assert_close(got.tangent, want.tangent)
    torch.testing.assert_close(got.primal, want.primal.detach())
