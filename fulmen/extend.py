"""The extend API: executors of custom operators and fusion regions.

    ex = fulmen.extend.OperatorExecutor("mykernels")
    fulmen.extend.register_executor(ex)
    my_gelu = ex.register_operator("my_gelu", like=lambda x: fulmen.TensorProxy(like=x), fn=gelu_kernel)
    ex.register_implementation(fulmen.torch.gelu, checker=..., execution_transform=..., grad_transform=...)
    jitted = fulmen.jit(model, executors=[ex, *fulmen.get_default_executors()])

`fused_loss` holds fulmen's own symbols an executor may implement too: the chunked linear + cross-entropy
(`fused_loss.LINEAR_CROSS_ENTROPY`, `LINEAR_CROSS_ENTROPY_FORWARD`, ...; fulmen.transforms.fused_loss).
"""

from __future__ import annotations

from fulmen.executors.base import Executor, FusionExecutor, Implementation, OperatorExecutor
from fulmen.executors.registry import (
    get_all_executors,
    get_default_executors,
    get_executor,
    register_executor,
    set_default_executors,
)
from fulmen.executors.sdpa import sdpa
from fulmen.executors.torch_compile import TorchCompileExecutor, torchcompile
from fulmen.executors.torch_eager import torch_executor
from fulmen.ops import fused_loss

__all__ = [
    "Executor", "FusionExecutor", "Implementation", "OperatorExecutor", "TorchCompileExecutor", "fused_loss",
    "get_all_executors", "get_default_executors", "get_executor", "register_executor", "sdpa", "set_default_executors",
    "torch_executor", "torchcompile",
]
