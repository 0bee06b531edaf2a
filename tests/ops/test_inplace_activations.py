"""Every activation in torch.nn, in place and not, as a module, a functional call and an in-place builtin, against
eager: outputs, grads, updated inputs and errors, bit for bit (eager's kernels are deterministic on CPU).

In-place activations (`nn.Hardswish(inplace=True)`, `F.elu_`) used to be recorded with their flag set: the trace
updated a value other calls still read, and autodiff's eager-backward fallback re-ran the update on a leaf ("a leaf
Variable that requires grad is being used in an in-place operation"), which broke torchvision's MobileNetV2/V3 and
GAN code; on a program input the update was dropped. Now they are functionalised as `x.relu_()` is, and the
activations have grad rules calling eager's backward kernels (ELU, CELU, SELU and leaky ReLU in place from their
result, as eager's elu_ / leaky_relu_ backward do).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.core.errors import TraceError
from fulmen.ops.registry import lookup

DTYPES = [torch.float32, torch.bfloat16]
# the kinks of every activation here (hardswish's and hardsigmoid's ±3, relu6's 6, the thresholds), then values
# spread over [-8, 8]
KINKS = [-6.0, -3.0, -2.5, -2.0, -1.0, -0.5, -0.4, -0.3, 0.0, 0.1, 0.3, 0.4, 0.5, 1.0, 2.0, 2.5, 3.0, 5.0, 6.0, 20.0]


def sample(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A (2, 4, 8) input (GLU halves its last dim; Softmax2d reads (C, H, W)) holding the kinks."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(seed)) * 4
    x[: len(KINKS)] = torch.tensor(KINKS)
    return x.reshape(2, 4, 8).to(dtype)


# (module factory with inplace as its argument, takes inplace): every activation in torch.nn.modules.activation
MODULES: dict[str, tuple[Callable[[bool], nn.Module], bool]] = {
    "Threshold": (lambda inplace: nn.Threshold(0.1, 20.0, inplace=inplace), True),
    "ReLU": (lambda inplace: nn.ReLU(inplace=inplace), True),
    "RReLU": (lambda inplace: nn.RReLU(0.1, 0.3, inplace=inplace).eval(), True),
    "Hardtanh": (lambda inplace: nn.Hardtanh(-2.0, 2.5, inplace=inplace), True),
    "ReLU6": (lambda inplace: nn.ReLU6(inplace=inplace), True),
    "Sigmoid": (lambda inplace: nn.Sigmoid(), False),
    "Hardsigmoid": (lambda inplace: nn.Hardsigmoid(inplace=inplace), True),
    "Tanh": (lambda inplace: nn.Tanh(), False),
    "SiLU": (lambda inplace: nn.SiLU(inplace=inplace), True),
    "Mish": (lambda inplace: nn.Mish(inplace=inplace), True),
    "Hardswish": (lambda inplace: nn.Hardswish(inplace=inplace), True),
    "ELU": (lambda inplace: nn.ELU(0.7, inplace=inplace), True),
    "CELU": (lambda inplace: nn.CELU(0.3, inplace=inplace), True),
    "SELU": (lambda inplace: nn.SELU(inplace=inplace), True),
    "GLU": (lambda inplace: nn.GLU(-1), False),
    "GELU": (lambda inplace: nn.GELU(), False),
    "GELU_tanh": (lambda inplace: nn.GELU("tanh"), False),
    "Hardshrink": (lambda inplace: nn.Hardshrink(0.4), False),
    "LeakyReLU": (lambda inplace: nn.LeakyReLU(0.2, inplace=inplace), True),
    "LogSigmoid": (lambda inplace: nn.LogSigmoid(), False),
    "Softplus": (lambda inplace: nn.Softplus(2.0, 5.0), False),
    "Softshrink": (lambda inplace: nn.Softshrink(0.3), False),
    "PReLU": (lambda inplace: nn.PReLU(4, init=0.3), False),
    "Softsign": (lambda inplace: nn.Softsign(), False),
    "Tanhshrink": (lambda inplace: nn.Tanhshrink(), False),
    "Softmin": (lambda inplace: nn.Softmin(-1), False),
    "Softmax": (lambda inplace: nn.Softmax(-1), False),
    "Softmax2d": (lambda inplace: nn.Softmax2d(), False),
    "LogSoftmax": (lambda inplace: nn.LogSoftmax(-1), False),
}


def test_every_activation_in_torch_nn_is_covered():
    names = {name for name in nn.modules.activation.__all__ if name != "MultiheadAttention"}
    assert names <= {name.split("_")[0] for name in MODULES}, names - set(MODULES)


MODULE_CASES = [(name, inplace) for name, (_, takes) in MODULES.items() for inplace in ((False, True) if takes
                                                                                       else (False,))]


def _cotangents(outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(o.shape, generator=generator).to(o.dtype) for o in outputs]


def _run(fn: Callable[..., tuple[torch.Tensor, ...]], x: torch.Tensor, params: list[torch.Tensor]):
    """fn's outputs on a leaf copy of x, and the grads of that leaf and of `params` for fixed cotangents."""
    x = x.detach().clone().requires_grad_()
    outputs = fn(x)
    grads = torch.autograd.grad(outputs, [x, *params], _cotangents(outputs))
    return [o.detach() for o in outputs], grads


def _assert_same(ours, eager):
    (out, grads), (want_out, want_grads) = ours, eager
    assert len(out) == len(want_out)
    for got, want in zip(out, want_out):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    for got, want in zip(grads, want_grads):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def _on_an_intermediate(act: Callable[[torch.Tensor], torch.Tensor], read_after: bool = True
                        ) -> Callable[[torch.Tensor], tuple]:
    def program(x):
        y = x * 1.5
        z = act(y)
        # y read after the activation: its updated value where the activation is in place. (Not after Softsign and
        # Tanhshrink: torch's Python composites, whose several reads of y eager's autograd sums in another order.)
        return (z, y * 2) if read_after else (z,)

    return program


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "inplace"), MODULE_CASES)
def test_module_on_an_intermediate(name, inplace, dtype):
    factory, _ = MODULES[name]
    module = factory(inplace).to(dtype)
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    read_after = name not in ("Softsign", "Tanhshrink")
    ours = _run(fulmen.jit(_on_an_intermediate(module, read_after)), sample(dtype), params)
    eager = _run(_on_an_intermediate(reference, read_after), sample(dtype), list(reference.parameters()))
    _assert_same(ours, eager)


@pytest.mark.parametrize(("name", "inplace"), MODULE_CASES)
def test_module_on_an_input_that_requires_grad(name, inplace):
    """Out of place: eager's output and grads. In place on a leaf that requires grad: eager refuses the update, and
    so does fulmen. In float32 only: what differs from the intermediate's case (the input a leaf of autograd) does not
    depend on the dtype, and test_module_on_an_intermediate checks each activation's bfloat16 kernels."""
    dtype = torch.float32
    factory, _ = MODULES[name]
    module = factory(inplace).to(dtype)
    reference = copy.deepcopy(module)
    if inplace:
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            reference(sample(dtype).requires_grad_())
        with pytest.raises((RuntimeError, TraceError), match="leaf"):
            fulmen.jit(module)(sample(dtype).requires_grad_())
        return
    ours = _run(lambda x: (fulmen.jit(module)(x),), sample(dtype), list(module.parameters()))
    eager = _run(lambda x: (reference(x),), sample(dtype), list(reference.parameters()))
    _assert_same(ours, eager)


# functional calls, in place by flag (keyword and positional) and by the in-place builtins
FUNCTIONAL: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F.threshold": lambda x: F.threshold(x, 0.1, 20.0),
    "F.threshold(inplace=True)": lambda x: F.threshold(x, 0.1, 20.0, inplace=True),
    "F.threshold_": lambda x: F.threshold_(x, 0.1, 20.0),
    "torch.threshold_": lambda x: torch.threshold_(x, -0.5, -3.0),
    "F.relu(inplace=True)": lambda x: F.relu(x, inplace=True),
    "F.relu_": lambda x: F.relu_(x),
    "torch.relu_": lambda x: torch.relu_(x),
    "Tensor.relu_": lambda x: x.relu_(),
    "F.hardtanh": lambda x: F.hardtanh(x, -2.0, 2.5),
    "F.hardtanh(..., True)": lambda x: F.hardtanh(x, -2.0, 2.5, True),
    "F.hardtanh_": lambda x: F.hardtanh_(x, -2.0, 2.5),
    "F.relu6": lambda x: F.relu6(x),
    "F.relu6(inplace=True)": lambda x: F.relu6(x, inplace=True),
    "F.elu": lambda x: F.elu(x, 0.7),
    "F.elu(inplace=True)": lambda x: F.elu(x, 0.7, inplace=True),
    "F.elu(..., True)": lambda x: F.elu(x, 1.0, True),
    "F.elu_": lambda x: F.elu_(x, 0.7),
    "F.selu": lambda x: F.selu(x),
    "F.selu(inplace=True)": lambda x: F.selu(x, inplace=True),
    "torch.selu_": lambda x: torch.selu_(x),
    "F.celu": lambda x: F.celu(x, 0.3),
    "F.celu(inplace=True)": lambda x: F.celu(x, 0.3, inplace=True),
    "torch.celu_": lambda x: torch.celu_(x, 1.7),
    "F.leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "F.leaky_relu(..., True)": lambda x: F.leaky_relu(x, 0.2, True),
    "F.leaky_relu_": lambda x: F.leaky_relu_(x),
    "F.rrelu (eval)": lambda x: F.rrelu(x, 0.1, 0.3, training=False),
    "F.rrelu(inplace=True) (eval)": lambda x: F.rrelu(x, 0.1, 0.3, training=False, inplace=True),
    "F.rrelu_ (eval)": lambda x: F.rrelu_(x, 0.1, 0.3, training=False),
    "F.hardsigmoid(inplace=True)": lambda x: F.hardsigmoid(x, inplace=True),
    "F.hardswish(inplace=True)": lambda x: F.hardswish(x, inplace=True),
    "F.silu(inplace=True)": lambda x: F.silu(x, inplace=True),
    "F.mish(inplace=True)": lambda x: F.mish(x, inplace=True),
    "Tensor.sigmoid_": lambda x: x.sigmoid_(),
    "Tensor.tanh_": lambda x: x.tanh_(),
    "F.dropout(inplace=True) (eval)": lambda x: F.dropout(x, 0.5, training=False, inplace=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_functional_on_an_intermediate(name, dtype):
    act = FUNCTIONAL[name]
    jitted = fulmen.jit(_on_an_intermediate(act))
    _assert_same(_run(jitted, sample(dtype), []), _run(_on_an_intermediate(act), sample(dtype), []))
    # no call of the trace updates a value in place: none is given an `inplace` argument
    for b in fulmen.last_traces(jitted)[0].bound_symbols:
        binding = lookup(b.sym.impl)
        if binding is not None and binding.flag is not None:
            assert "inplace" not in b.kwargs and len(b.args) <= binding.flag.position, b


@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_functional_updates_a_program_input(name):
    """In place on an input without grad, the input is updated as eager updates it (the update was dropped)."""
    act = FUNCTIONAL[name]

    def program(x):
        act(x)
        return x + 1

    ours, eager = sample(torch.float32), sample(torch.float32)
    out = fulmen.jit(program)(ours)
    assert torch.equal(out, program(eager))
    assert torch.equal(ours, eager)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["F.hardswish(inplace=True)", "F.elu_", "F.leaky_relu(..., True)", "torch.selu_",
                                  "F.hardtanh_", "F.relu6(inplace=True)"])
def test_in_place_on_a_view_of_an_intermediate(name, dtype):
    act = FUNCTIONAL[name]

    def program(x):
        y = x * 1.5
        act(y[:, 1:, ::2])
        return (y,)

    _assert_same(_run(fulmen.jit(program), sample(dtype), []), _run(program, sample(dtype), []))


def test_in_place_leaky_relu_with_a_negative_slope_is_not_differentiated():
    """Eager's backward of the update cannot tell its input from its result and raises; fulmen refuses to
    differentiate it, naming the line, and runs it where nothing is differentiated."""

    def program(x):
        y = x * 1.5
        return F.leaky_relu(y, -0.2, inplace=True)

    x = sample(torch.float32).requires_grad_()
    with pytest.raises(RuntimeError, match="negative slope"):
        program(x).sum().backward()
    with pytest.raises(TraceError, match=r"negative slope[\s\S]*F.leaky_relu\(y, -0.2, inplace=True\)"):
        fulmen.jit(program)(x)
    assert torch.equal(fulmen.jit(program)(x.detach()), program(x.detach()))


class InvertedResidual(nn.Module):
    """A MobileNetV2/V3 block: expand (1x1 conv, BatchNorm, ReLU6 in place), depthwise 3x3 conv, BatchNorm,
    Hardswish in place, squeeze-excite gated by Hardsigmoid, project (1x1 conv, BatchNorm), residual."""

    def __init__(self, channels: int = 8, expand: int = 4) -> None:
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                                    nn.ReLU6(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), nn.Hardswish(inplace=True))
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden, hidden // 4, 1), nn.ReLU(inplace=True),
                                     nn.Conv2d(hidden // 4, hidden, 1), nn.Hardsigmoid(inplace=True))
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.depthwise(self.expand(x))
        h = h * self.squeeze(h)
        return x + self.project(h)


def test_a_mobilenet_block_trains_as_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish(inplace=True), InvertedResidual(),
                          InvertedResidual(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, target = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 5, (4,), generator=generator)
        losses = []
        for net in (jitted, reference):
            loss = F.cross_entropy(net(x), target)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_dropout_in_place_in_training_draws_and_differentiates_as_eager():
    """nn.Dropout(inplace=True) on an intermediate read again afterwards: the same draw (same seed), output and
    grads bitwise eager's."""

    def program(x):
        y = x * 2
        F.dropout(y, 0.3, True, inplace=True)
        return (y * 3,)

    runs = []
    for fn in (fulmen.jit(program), program):
        torch.manual_seed(5)
        runs.append(_run(fn, sample(torch.float32), []))
    _assert_same(*runs)
