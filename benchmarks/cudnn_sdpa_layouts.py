"""Why fulmen's cuDNN attention gradients disagreed with eager's: PyTorch's cached cuDNN backward graphs.

    python benchmarks/cudnn_sdpa_layouts.py [--out benchmarks/cudnn_sdpa_layouts.json]

PyTorch caches one built cuDNN SDPA backward graph per thread, keyed by the shapes and strides of q, k and v
(aten/src/ATen/native/cudnn/MHA.cpp, `mhagraphbackwardcache`); the graph also bakes in the strides of the output's
cotangent dO. This script runs eager's own cuDNN attention (no fulmen) on one q, k, v and two cotangents holding the
same values in two layouts: contiguous (B, H, T, D), as fulmen used to pass it, and (B, T, H, D) transposed, as
autograd delivers it behind LitGPT's `y.transpose(1, 2).reshape(B, T, C)`. Each scenario runs in a fresh shape (so
a fresh cache entry) and compares the gradients with float64 math attention: the layout that comes second reuses
the graph built for the first.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _grads(q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.autograd.grad(out, (q, k, v), grad_out)


def _reference(q, k, v, grad_out):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.autograd.grad(out, (q, k, v), grad_out.double())


def _error(grads, want) -> float:
    return max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(grads, want))


def scenario(order: tuple[str, ...], seq: int) -> dict[str, float]:
    B, H, D = 2, 8, 64
    q, k, v = (torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    values = torch.randn(B, seq, H, D, device="cuda", dtype=torch.bfloat16)
    layouts = {"transposed": values.transpose(1, 2), "contiguous": values.transpose(1, 2).contiguous()}
    want = _reference(q, k, v, layouts["contiguous"])
    return {f"{i + 1}. dO {name}": _error(_grads(q, k, v, layouts[name]), want) for i, name in enumerate(order)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/cudnn_sdpa_layouts.json")
    args = parser.parse_args()
    scenarios = {
        "transposed then contiguous": scenario(("transposed", "contiguous"), 256),
        "contiguous then transposed": scenario(("contiguous", "transposed"), 384),
        "transposed alone": scenario(("transposed",), 512),
        "contiguous alone": scenario(("contiguous",), 640),
    }
    for name, errors in scenarios.items():
        print(f"{name:30}" + "  ".join(f"{k}: max rel. error {e:.2e}" for k, e in errors.items()))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "max_relative_error_vs_float64": scenarios}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
