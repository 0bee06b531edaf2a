"""What a jitted program reads about autograd (`is_leaf`, `grad_fn`, `.grad`, ...) against eager.

Oracle: eager PyTorch running the same program: the same branch taken (so the same values and grads), or a
TraceError naming the user's line where fulmen cannot know eager's answer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import fulmen
from fulmen.core.errors import TraceError
from fulmen.jit.jitted_module import core


def _leaf() -> torch.Tensor:
    return torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _computed_is_leaf(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    return y * 3 if y.is_leaf else y * 5


def _computed_grad_fn(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    return y * 3 if y.grad_fn is None else y * 5


def _computed_grad_fn_truth(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    return y * 3 if not y.grad_fn else y * 5


def _argument_is_leaf(a: torch.Tensor) -> torch.Tensor:
    return a * 3 if a.is_leaf else a * 5


def _argument_grad_fn(a: torch.Tensor) -> torch.Tensor:
    return a * 3 if a.grad_fn is None else a * 5


def _detached_and_no_grad(x: torch.Tensor) -> torch.Tensor:
    d = x.detach()
    with torch.no_grad():
        n = x * 2
    return x * (1 if d.is_leaf else 2) * (3 if n.grad_fn is None else 4)


def _view_of_argument(x: torch.Tensor) -> torch.Tensor:
    v = x[:2]
    return v * (3 if v.is_leaf else 5)


def _updated_with_grad(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a.mul_(w)
    return a * (3 if a.is_leaf else 5)


def _run(fn: Callable[..., torch.Tensor], make: Callable[[torch.Tensor], tuple]) -> tuple:
    x = _leaf()
    out = fn(*make(x))
    if out.requires_grad:
        out.sum().backward()
    return out.detach(), x.grad


PROGRAMS = {
    "computed is_leaf": (_computed_is_leaf, lambda x: (x,)),
    "computed grad_fn is None": (_computed_grad_fn, lambda x: (x,)),
    "computed grad_fn truth": (_computed_grad_fn_truth, lambda x: (x,)),
    "non-leaf argument is_leaf": (_argument_is_leaf, lambda x: (x * 1,)),
    "non-leaf argument grad_fn": (_argument_grad_fn, lambda x: (x * 1,)),
    "leaf argument is_leaf": (_argument_is_leaf, lambda x: (x,)),
    "argument without grad": (_argument_is_leaf, lambda x: (x.detach() * 1,)),
    "detached and no_grad": (_detached_and_no_grad, lambda x: (x,)),
    "view of an argument": (_view_of_argument, lambda x: (x,)),
    "argument updated with grad": (_updated_with_grad, lambda x: (torch.ones(3, dtype=torch.float64), x)),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_reading_is_leaf_or_grad_fn_takes_eagers_branch(name):
    fn, make = PROGRAMS[name]
    want_out, want_grad = _run(fn, make)
    got_out, got_grad = _run(fulmen.jit(fn), make)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


def test_a_trace_that_read_is_leaf_of_an_argument_holds_only_for_that_answer():
    jitted = fulmen.jit(_argument_is_leaf)
    x = _leaf()
    for a in (x, x * 1, x, x * 1):
        torch.testing.assert_close(jitted(a), _argument_is_leaf(a), rtol=0, atol=0)
    stats = core(jitted).stats
    assert (stats.misses, stats.hits) == (2, 2)


def test_a_trace_that_does_not_read_is_leaf_serves_leaves_and_non_leaves():
    jitted = fulmen.jit(lambda a: a * 2)
    x = _leaf()
    for a in (x, x * 1):
        torch.testing.assert_close(jitted(a), a * 2, rtol=0, atol=0)
    assert core(jitted).stats.misses == 1


def test_a_miss_for_is_leaf_says_so():
    jitted = fulmen.jit(_argument_is_leaf)
    x = _leaf()
    jitted(x)
    jitted(x * 1)
    assert "tensor a is not a leaf (it has a grad_fn); the program read is_leaf or grad_fn" in \
        core(jitted).last_miss_reasons[0]


class _ClampedInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.5, 0.5)  # an update autograd does not see: still a leaf
        w = self.lin.weight
        return self.lin(x) * (2 if w.is_leaf and w.grad_fn is None else 7)


def test_a_parameter_updated_under_no_grad_is_still_a_leaf():
    torch.manual_seed(0)
    eager = _ClampedInPlace()
    jitted = fulmen.jit(_ClampedInPlace())
    jitted.load_state_dict(eager.state_dict())
    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(jitted(x), eager(x), rtol=0, atol=0)


def _node_name(a: torch.Tensor) -> tuple:
    return a * 2, a.grad_fn.name()


def _node_next(a: torch.Tensor) -> tuple:
    y = a * 2
    return y, len(y.grad_fn.next_functions)


def _node_returned(a: torch.Tensor) -> tuple:
    y = a * 2
    return y, y.grad_fn


@pytest.mark.parametrize(
    ("fn", "line"),
    [(_node_name, r"a\.grad_fn\.name\(\)"), (_node_next, r"y\.grad_fn\.next_functions"),
     (_node_returned, r"return y, y\.grad_fn")],
    ids=["name", "next_functions", "returned"],
)
def test_using_a_grad_fn_beyond_its_presence_is_refused_naming_the_line(fn, line):
    a = _leaf() * 1
    eager = fn(a)
    assert eager[1] is not None  # eager gives a node (or what it says), which a trace cannot
    with pytest.raises(TraceError, match=rf"(?s)grad_fn of tensor .*test_autograd_metadata\.py.*{line}"):
        fulmen.jit(fn)(a)


def _reads_parameter_grad(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    g = lin.weight.grad
    return lin(x) + (0 if g is None else g.sum())


def _reads_version(a: torch.Tensor) -> torch.Tensor:
    return a * (1 if a._version == 0 else 2)


def _reads_retains_grad(a: torch.Tensor) -> torch.Tensor:
    return a * (1 if a.retains_grad else 2)


@pytest.mark.parametrize(
    ("fn", "what", "line"),
    [(_reads_version, "Tensor._version", r"a\._version == 0"),
     (_reads_retains_grad, "Tensor.retains_grad", r"a\.retains_grad")],
    ids=["_version", "retains_grad"],
)
def test_reading_autograd_state_of_one_call_is_refused_naming_the_line(fn, what, line):
    args = (_leaf(),)
    fn(*args)
    with pytest.raises(TraceError, match=rf"(?s)reading {what} .*test_autograd_metadata\.py.*{line}"):
        fulmen.jit(fn)(*args)


def test_reading_a_parameter_grad_follows_each_call():
    """The `.grad` of a captured parameter is read as each call finds it (a whole training step reads it: issue 50;
    it was refused as a constant of the trace): None, or the tensor there, under a guard."""
    lin = nn.Linear(3, 3, dtype=torch.float64)
    x = _leaf()
    jitted = fulmen.jit(_reads_parameter_grad)
    for grad in (None, torch.ones_like(lin.weight), torch.full_like(lin.weight, 2.0), None):
        lin.weight.grad = grad
        assert torch.equal(jitted(lin, x), _reads_parameter_grad(lin, x))


# --- is_inference: a fact of the tensor (made under inference mode or not), not of the mode it is read in ---------


def _argument_is_inference(t: torch.Tensor) -> torch.Tensor:
    return t * 2 if t.is_inference() else t * 3


def _view_is_inference(t: torch.Tensor) -> torch.Tensor:
    v = t.detach()[:2]
    return v * 2 if torch.is_inference(v) else v * 3


def _computed_is_inference(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        made = t * 1  # an inference tensor, and so is its view taken outside inference mode
        viewed = t[:1]  # a view of a normal tensor stays normal; of an inference tensor, stays one
    later = made[:1]
    return (later * 2 if later.is_inference() else later * 3), (viewed * 2 if viewed.is_inference() else viewed * 3)


@pytest.mark.parametrize("fn", [_argument_is_inference, _view_is_inference, _computed_is_inference])
def test_reading_is_inference_answers_as_eager_in_every_mode(fn):
    normal = torch.arange(3.0)
    with torch.inference_mode():
        inference = torch.arange(3.0)
    jitted = fulmen.jit(fn)
    for x, mode in [(normal, False), (inference, False), (normal, True), (inference, True), (normal, False)]:
        with torch.inference_mode(mode):
            got, want = jitted(x), fn(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_miss_for_is_inference_says_so():
    jitted = fulmen.jit(_argument_is_inference)
    jitted(torch.ones(3))
    with torch.inference_mode():
        inference = torch.ones(3)
    torch.testing.assert_close(jitted(inference), inference * 2, rtol=0, atol=0)
    assert "tensor t is an inference tensor; the program read is_inference() of it" in core(jitted).last_miss_reasons[0]


def test_an_inference_tensor_the_backward_needs_is_refused_as_in_eager():
    with torch.inference_mode():
        w = torch.randn(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    fn = lambda x, w: (x @ w).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        fn(x, w)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward: .* needs w, a tensor "
                                           r"created under torch\.inference_mode\(\)"):
        fulmen.jit(fn)(x, w)
