"""Clear errors that name the user's line: data-dependent control flow, value reads, unsupported ops."""

from __future__ import annotations

import random
import time

import pytest
import torch

import fulmen


def branch_on_values(x):
    if x.sum() > 0:  # the line the error must name
        return x
    return -x


def reads_item(x):
    scale = x.max().item()
    return x / scale


def reads_list(x):
    return x * len(x.tolist())


def calls_unsupported(x):
    return torch.special.airy_ai(x)


@pytest.mark.parametrize(
    ("fn", "line", "what"),
    [
        (branch_on_values, "if x.sum() > 0:", "__bool__"),
        (reads_item, "scale = x.max().item()", "item"),
        (reads_list, "return x * len(x.tolist())", "tolist"),
    ],
)
def test_data_dependent_errors_name_the_line(fn, line, what):
    with pytest.raises(fulmen.DataDependentError) as info:
        fulmen.jit(fn)(torch.randn(4))
    message = str(info.value)
    assert what in message and "tensor values" in message
    assert __file__ in message and line in message
    assert "read in" not in message  # the read is the user's own line, named once


def test_a_read_inside_torch_nn_names_torchs_line_and_the_users():
    # AdaptiveLogSoftmaxWithLoss picks each cluster's rows with nonzero(): a value read inside torch.nn
    model = torch.nn.AdaptiveLogSoftmaxWithLoss(8, 10, [4])
    with pytest.raises(fulmen.DataDependentError) as info:
        fulmen.jit(model)(torch.randn(3, 8), torch.tensor([1, 5, 9]))  # the user's line
    message = str(info.value)
    assert "adaptive.py" in message and "target_mask.nonzero()" in message
    assert __file__ in message and "# the user's line" in message


def test_unsupported_op_names_op_and_line():
    with pytest.raises(fulmen.UnsupportedOpError) as info:
        fulmen.jit(calls_unsupported)(torch.randn(4))
    message = str(info.value)
    assert "torch.special.airy_ai" in message and "return torch.special.airy_ai(x)" in message and __file__ in message


def _sets_storage(x, z):
    y = x * 1
    y.set_(z)  # the user's line
    return y + 1


def test_a_method_torch_runs_without_a_torch_function_call_is_refused_naming_it_and_the_line():
    # Tensor.set_ reaches the dispatcher directly: it was reported as an internal error of fulmen's
    with pytest.raises(fulmen.UnsupportedOpError, match=r"(?s)aten\.set_.*test_errors\.py.*# the user's line"):
        fulmen.jit(_sets_storage)(torch.randn(2, 3), torch.randn(4))


def test_examine_lists_ops_and_support():
    report = fulmen.examine(calls_unsupported, torch.randn(4))
    assert report.unsupported == ["torch.special.airy_ai"]
    assert report.error is not None and "torch.special.airy_ai" in report.error

    def fine(x):
        return torch.nn.functional.gelu(x) * 2

    report = fulmen.examine(fine, torch.randn(4))
    assert report.unsupported == [] and report.error is None
    assert report.ops["torch.nn.functional.gelu"] == (1, True)
    assert "2 ops, 0 unsupported" in str(report)

    def validates(m, s, v):
        return torch.distributions.Normal(m, s).log_prob(v)  # checks its arguments with torch._is_all_true

    report = fulmen.examine(validates, torch.randn(4), torch.rand(4) + 0.5, torch.randn(4))
    assert report.ops["torch._is_all_true"] == (3, True) and report.error is None


class _KeepsHistory(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", None)

    def forward(self, x):
        self.history = [x.shape[0]]  # the line the error must name
        return x


class _BuildsTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", None)

    def forward(self, x):
        self.table = x.cos()  # the line the error must name
        return x * self.table


@pytest.mark.parametrize(("module", "line", "what"), [
    (_KeepsHistory, "self.history = [x.shape[0]]", "attribute `history` of the _KeepsHistory module"),
    (_BuildsTable, "self.table = x.cos()", "attribute `table` of the _BuildsTable module"),
])
def test_a_module_attribute_write_that_cannot_be_stored_again_is_refused(module, line, what):
    with pytest.raises(fulmen.TraceError) as info:
        fulmen.jit(module())(torch.randn(4))
    message = str(info.value)
    assert f"fulmen cannot compile a program that writes Python {what} (test_errors.py:" in message
    assert line in message


class _LayerDrop(torch.nn.Module):
    def forward(self, x):
        if self.training and random.random() < 0.5:  # the line the error must name
            return x
        return x + 1


def _timed(x):
    start = time.perf_counter()  # the line the error must name
    return x * (1 if time.perf_counter() - start < 1 else 2)


def test_python_random_draws_and_clocks_are_refused():
    """A trace would repeat the value the draw or the clock gave while tracing on every call."""
    model = _LayerDrop()
    with pytest.raises(fulmen.TraceError) as info:
        fulmen.jit(model)(torch.zeros(1))
    assert "calls random.random (test_errors.py:" in str(info.value)
    assert "if self.training and random.random() < 0.5:" in str(info.value)
    model.eval()  # no draw: traced as usual
    torch.testing.assert_close(fulmen.jit(model)(torch.zeros(1)), torch.ones(1))
    with pytest.raises(fulmen.TraceError, match=r"calls time\.perf_counter \(test_errors\.py:\d+ in _timed\)"):
        fulmen.jit(_timed)(torch.zeros(1))


def makes_a_leaf(x):
    leaf = x.detach().requires_grad_()
    return leaf * 3


def sets_the_flag(x):
    y = x * 2
    y.requires_grad = True
    return y


def creates_a_leaf(x):
    w = torch.ones(3, requires_grad=True)
    return x * w


@pytest.mark.parametrize(
    ("fn", "line"),
    [
        (makes_a_leaf, "leaf = x.detach().requires_grad_()"),
        (sets_the_flag, "y.requires_grad = True"),
        (creates_a_leaf, "w = torch.ones(3, requires_grad=True)"),
    ],
)
def test_a_leaf_of_autograd_made_inside_the_program_is_refused_naming_the_line(fn, line):
    # sets_the_flag's leaf is a value the program made, traced as eager makes it, but returned: refused too
    with pytest.raises(fulmen.TraceError, match="leaf of autograd") as error:
        fulmen.jit(fn)(torch.ones(3))
    assert error.value.location.line == line
