"""Attention layers and the regions around them (issue 51, the masked Hugging Face Llama step): a boolean padding
mask every layer shares is converted to the kernel's additive bias once, not once per layer, and the attention
output's gradient reaches the attention's backward as a view of the projection's gradient (as eager hands it), not
as a copy a region writes out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.executors.torch_compile import torchcompile


class Layer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & keep[:, None, None, :]  # padding mask, built once, read by every layer
        for layer in self.layers:
            x = layer(x, mask)
        return x


def _inputs() -> tuple[Model, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[0, :3] = False  # the first sequence left-padded
    return model, x, keep


def _calls(trace, name: str) -> list:
    return [b for b in trace.bound_symbols if b.sym.name == name]


def test_a_shared_boolean_mask_is_converted_once():
    model, x, keep = _inputs()
    jitted = fulmen.jit(model, executors=["sdpa"])
    got = jitted(x, keep)
    forward = fulmen.last_traces(jitted)[-1]
    attention = [b for b in forward.bound_symbols if b.sym.name.startswith("sdpa_cpu_flash_forward")]
    assert len(attention) == 3
    assert len({b.args[3].pname for b in attention}) == 1  # every layer reads the one additive mask
    assert len(_calls(forward, "where")) == 1  # the sdpa executor's conversion, once
    want = model(x, keep)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    v = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, [x, *model.parameters()], v),
                    torch.autograd.grad(want, [x, *model.parameters()], v)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_attention_backward_takes_the_output_gradient_as_a_view():
    model, x, keep = _inputs()
    jitted = fulmen.jit(model, executors=["sdpa", torchcompile])
    got = jitted(x, keep)
    backward = fulmen.last_backward_traces(jitted)[-1]
    producers = {p.pname: b for b in backward.bound_symbols for p in b.proxy_outputs()}
    backwards = [b for b in backward.bound_symbols if b.sym.name == "sdpa_cpu_flash_backward"]
    assert len(backwards) == 3
    for call in backwards:  # its first argument: a permute of a matmul's output, outside any region
        grad = producers[call.args[0].pname]
        assert grad.sym.executor is not torchcompile and grad.sym.name in ("permute", "transpose"), str(grad)
    want = model(x, keep)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    v = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, [x, *model.parameters()], v),
                    torch.autograd.grad(want, [x, *model.parameters()], v)):
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=2e-2)


def test_cudnn_output_strides_take_symbolic_sizes():
    """cuDNN's backward re-lays the forward's output by the strides its forward allocates for q's layout; in a
    symbolic trace's meta run of the backward those are SymInts, which do not hash (the cached path raised
    'unhashable type: non-nested SymInt' on CUDA, and the trace fell back to static shapes)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from fulmen.executors.sdpa import forward_output_strides

    env = ShapeEnv()
    t = env.create_symintnode(env.create_symbol(24, ConstantSource("T"), dynamic_dim=DimDynamic.DYNAMIC), hint=24)
    shape, transposed = (2, 4, t, 8), (32 * t, 8, 32, 1)  # q as a (B, T, H, D) tensor transposed to (B, H, T, D)
    strides = forward_output_strides(shape, transposed, shape)
    assert [int(s.node.hint) if isinstance(s, torch.SymInt) else s for s in strides] == \
        list(forward_output_strides((2, 4, 24, 8), (768, 8, 32, 1), (2, 4, 24, 8)))
