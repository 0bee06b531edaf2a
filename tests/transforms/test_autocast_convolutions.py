"""Every convolution under CPU autocast gives eager's dtypes and bits, forward and backward. conv3d and the transposed
convolutions were refused under autocast (eager-backward ops, which fulmen refuses there) while conv1d and conv2d
ran. (The other autocast tests: tests/training/test_autocast.py, tests/ops/test_op_db_autocast.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen

# (op, input shape, weight shape, keyword arguments): strides, padding, dilation and groups where the op takes them
CASES = {
    "conv1d": (F.conv1d, (2, 4, 9), (6, 2, 3), {"stride": 2, "padding": 1, "groups": 2}),
    "conv2d": (F.conv2d, (2, 4, 7, 6), (6, 4, 3, 3), {"padding": "same", "dilation": 2}),
    "conv3d": (F.conv3d, (2, 4, 5, 6, 7), (6, 2, 3, 3, 2), {"stride": (1, 2, 1), "padding": 1, "groups": 2}),
    "conv_transpose1d": (F.conv_transpose1d, (2, 4, 9), (4, 3, 3), {"stride": 2, "output_padding": 1}),
    "conv_transpose2d": (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 2), {"stride": 2, "padding": 1}),
    "conv_transpose3d": (F.conv_transpose3d, (2, 4, 3, 4, 5), (4, 2, 2, 3, 3),
                         {"stride": (2, 1, 2), "groups": 2, "dilation": (1, 2, 1)}),
}


def _output_and_grads(fn, x, w, b, dtype):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cpu", dtype=dtype):
        out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return out, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_convolutions_under_cpu_autocast_match_eager(name, dtype):
    op, x_shape, w_shape, kwargs = CASES[name]
    torch.manual_seed(0)
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    out_channels = w_shape[1] * kwargs.get("groups", 1) if "transpose" in name else w_shape[0]
    b = torch.randn(out_channels)

    def conv(x, w, b):
        return op(x, w, b, **kwargs)

    jitted = fulmen.jit(conv)
    ours, our_grads = _output_and_grads(jitted, x, w, b, dtype)
    eager, eager_grads = _output_and_grads(conv, x, w, b, dtype)
    assert ours.dtype == eager.dtype == dtype
    assert torch.equal(ours, eager)
    for got, want in zip(our_grads, eager_grads):
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want)
    # autocast's conversions of the input, the weight and the bias are stated in front of the convolution
    assert str(fulmen.last_traces(jitted)[0]).count(f"dtype={dtype}") == 3


def test_a_conv3d_autoencoder_trains_under_autocast_as_eager():
    """A video-style autoencoder (Conv3d down, ConvTranspose3d up) trained for three SGD steps under bf16 autocast:
    losses, grads and parameters bitwise eager's."""

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv3d(2, 4, 3, stride=2, padding=1), torch.nn.ReLU(),
                                   torch.nn.ConvTranspose3d(4, 2, 4, stride=2, padding=1))

    torch.manual_seed(1)
    batches = [torch.randn(2, 2, 4, 6, 6) for _ in range(3)]
    runs = []
    for jit in (True, False):
        net = model()
        step = fulmen.jit(net) if jit else net
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        losses, grads = [], []
        for x in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(step(x).float(), x)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in net.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        runs.append((losses, grads, [p.detach().clone() for p in net.parameters()]))
    (our_losses, our_grads, our_params), (losses, grads, params) = runs
    assert all(torch.equal(a, b) for a, b in zip(our_losses, losses))
    assert all(torch.equal(a, b) for step_a, step_b in zip(our_grads, grads) for a, b in zip(step_a, step_b))
    assert all(torch.equal(a, b) for a, b in zip(our_params, params))
