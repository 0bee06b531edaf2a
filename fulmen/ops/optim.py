"""torch.optim's per-parameter updates as trace symbols (issue 50: the whole training step in one trace).

One call updates one parameter and its optimizer state: `optim.adam_update(param, grad, exp_avg, exp_avg_sq, None,
step, lr=..., ...)` returns the new parameter, moments and step count. Its implementation is eager's own kernel
(torch.optim.adam's `_single_tensor_adam`, `_multi_tensor_adam` for foreach=True, `_fused_adam` for fused=True: the
`kernel` torch's step chose) run on that one parameter, so
the arithmetic is eager's to the bit, in eager's precisions: the step count is read from the step tensor when the
call runs (`_get_value`, `.item()` of a CPU tensor: no device sync) and the bias corrections are Python doubles, as
eager computes them. A float learning rate is an input of the trace (a 0-dim float64 tensor each call makes from the
param group, read back exactly), so a scheduler stepping between calls reuses the trace; the other hyperparameters
(betas, momentum, weight decay, ...) are the call's constants, guarded. The call is functional, as every trace
symbol: it works on copies and the acquisition writes the results back into the parameter and the state tensors,
like any in-place update of a captured tensor; where nothing else reads the results, fulmen.transforms.update_order
makes that one in-place call (`adam_update_`). Updating one parameter at a time lets the trace run each update right
after its gradient is complete (fulmen.transforms.update_order orders them so), freeing the gradient early.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import adam as torch_adam
from torch.optim import sgd as torch_sgd

from fulmen.core.symbol import Symbol, Tag
from fulmen.core.trace import TraceBuilder
from fulmen.ops.registry import add_symbol
from fulmen.ops.rules.grad import not_differentiable


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                max_exp_avg_sq: torch.Tensor | None, step: torch.Tensor, *, lr: float | torch.Tensor, beta1: float,
                beta2: float, weight_decay: float, eps: float, amsgrad: bool, maximize: bool,
                decoupled_weight_decay: bool, kernel: str) -> tuple[torch.Tensor, ...]:
    """Adam / AdamW on one parameter: (param, exp_avg, exp_avg_sq, [max_exp_avg_sq,] step), updated. `lr` may be
    a 0-dim float64 tensor holding the Python float eager reads (an input of the trace), read back exactly."""
    param, exp_avg, exp_avg_sq, step = param.clone(), exp_avg.clone(), exp_avg_sq.clone(), step.clone()
    maxima = [max_exp_avg_sq.clone()] if amsgrad else []
    _adam([param], [grad], [exp_avg], [exp_avg_sq], maxima, [step], lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
          decoupled_weight_decay=decoupled_weight_decay, kernel=kernel)
    return (param, exp_avg, exp_avg_sq, *maxima, step)


def sgd_update(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, *,
               lr: float | torch.Tensor, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
               maximize: bool, kernel: str) -> tuple[torch.Tensor, ...]:
    """SGD on one parameter: (param,) or, with momentum, (param, momentum_buffer), updated (a first step makes the
    buffer, as eager's: a copy of the grad). `lr` as adam_update's."""
    param = param.clone()
    buffers = [momentum_buffer.clone() if momentum_buffer is not None else None]
    _sgd([param], [grad], buffers, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
         nesterov=nesterov, maximize=maximize, kernel=kernel)
    return (param, buffers[0]) if momentum != 0 else (param,)


def adam_update_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *,
                 lr: float | torch.Tensor, beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool,
                 maximize: bool, decoupled_weight_decay: bool, kernel: str) -> None:
    """adam_update in place, on one or several parameters of one param group: eager's kernel on the tensors
    themselves, over the lists as eager's step calls it over a group's (the trace's write-backs of adam_update's
    results into them, made one call by fulmen.transforms.update_order: no copies). The kernels' arithmetic is per
    tensor, so a list gives each tensor what a call of its own would."""
    _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
          decoupled_weight_decay=decoupled_weight_decay, kernel=kernel)


def sgd_update_(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor | None],
                *, lr: float | torch.Tensor, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                maximize: bool, kernel: str) -> None:
    """sgd_update in place, with buffers there are already (None without momentum), on one or several parameters
    (as adam_update_)."""
    _sgd(params, grads, list(momentum_buffers), lr=lr, momentum=momentum, dampening=dampening,
         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, kernel=kernel)


def _adam(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list, steps: list, *,
          lr: float | torch.Tensor, kernel: str, amsgrad: bool, **hyperparameters: Any) -> None:
    with torch.no_grad():
        getattr(torch_adam, f"_{kernel}_adam")(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps, None, None,
            amsgrad=amsgrad, has_complex=False, lr=_number(lr), capturable=False, differentiable=False,
            **hyperparameters)


def _sgd(params: list, grads: list, buffers: list, *, lr: float | torch.Tensor, kernel: str,
         **hyperparameters: Any) -> None:
    with torch.no_grad():
        getattr(torch_sgd, f"_{kernel}_sgd")(params, grads, buffers, None, None, lr=_number(lr),
                                            has_sparse_grad=False, **hyperparameters)


# torch.optim's kernels, by the name torch gives each (`_{kernel}_adam`, `_{kernel}_sgd`): the per-parameter loop
# (foreach=False), the foreach one (foreach=True) and the fused one (fused=True)
KERNELS = ("single_tensor", "multi_tensor", "fused")


def _no_outputs(builder: TraceBuilder, *args: Any, **kwargs: Any) -> None:
    return None


def _number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def _like(builder: TraceBuilder, *tensors: Any) -> tuple:
    """Outputs laid out as the tensors they update (clone keeps the layout), never requiring grad."""
    with torch._C.DisableTorchFunction():
        metas = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in tensors)
    return tuple(builder.make_proxy(m, t.device) for m, t in zip(metas, tensors))


def _adam_meta(builder: TraceBuilder, param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, max_exp_avg_sq: Any,
               step: Any, **options: Any) -> tuple:
    maxima = (max_exp_avg_sq,) if options["amsgrad"] else ()
    return _like(builder, param, exp_avg, exp_avg_sq, *maxima, step)


def _sgd_meta(builder: TraceBuilder, param: Any, grad: Any, momentum_buffer: Any, **options: Any) -> tuple:
    if options["momentum"] == 0:
        return _like(builder, param)
    return _like(builder, param, momentum_buffer if momentum_buffer is not None else grad)


def _symbol(fn: Any, meta: Any, tags: Tag = Tag.NO_GRAD) -> Symbol:
    return add_symbol(Symbol(name=fn.__name__, printed=f"optim.{fn.__name__}", impl=fn, meta=meta, tags=tags))


ADAM_UPDATE = _symbol(adam_update, _adam_meta)
SGD_UPDATE = _symbol(sgd_update, _sgd_meta)
# IMPURE: they write their arguments; never removed, merged or moved
ADAM_UPDATE_ = _symbol(adam_update_, _no_outputs, Tag.IMPURE | Tag.NO_GRAD)
SGD_UPDATE_ = _symbol(sgd_update_, _no_outputs, Tag.IMPURE | Tag.NO_GRAD)
IN_PLACE = {ADAM_UPDATE: ADAM_UPDATE_, SGD_UPDATE: SGD_UPDATE_}
not_differentiable(ADAM_UPDATE, SGD_UPDATE, ADAM_UPDATE_, SGD_UPDATE_)
