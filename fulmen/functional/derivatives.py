"""torch.func's functional transforms on traces: `fulmen.grad`, `vjp`, `jvp`, `vmap`, with torch.func's signatures.

Each acquires the function it transforms into a trace of its own (on fresh proxies: per-example shapes under vmap,
tensors requiring grad under grad and vjp), transforms that trace with its rule table (the grad rules with the
forward/backward split of `fulmen.jit`, `fulmen.functional.forward_mode`, `fulmen.functional.batching`) and writes the
result
into the trace being acquired around it. So transforms compose (`vmap(grad(f))`, `jvp(grad(f))`, `vmap(vmap(f))`)
and compose with `fulmen.jit`. Called on tensors outside any fulmen trace, a transformed function runs through
`fulmen.jit` itself: it is cached behind guards, and `fulmen.last_traces(fulmen.vmap(f))` prints what ran.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.apis
from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from fulmen.acquisition.acquire import Interpreter, current_interpreter
from fulmen.acquisition.torch_func_calls import made_as
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import user_location
from fulmen.core.trace import Trace
from fulmen.executors.registry import resolve
from fulmen.functional.forward_mode import JvpTransform
from fulmen.jit.jitted import JittedFunction
from fulmen.ops import prims
from fulmen.options import JitOptions
from fulmen.transforms.forward_backward import GradPlan, plan_grad
from fulmen.transforms.inline import Emitter


class FunctionalTransform(JittedFunction):
    """A function transformed by `fulmen.grad` or `fulmen.vmap`. Inside a fulmen acquisition it records its
    transformed calls in place; called on tensors it runs them through `fulmen.jit` (with the default executors)."""

    def __init__(self, inline: Callable[..., Any], name: str) -> None:
        super().__init__(inline, JitOptions(), executors=resolve(None))
        self.inline = inline
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if current_interpreter() is not None:
            return self.inline(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<fulmen {self.__name__}>"


@contextlib.contextmanager
def transforming(interpreter: Interpreter) -> Iterator[None]:
    """Where a transform runs its rules: off the acquisition's mode (the rules push it again themselves, and its
    handler must not see the torch calls of another handler running below it), and off the program's modes above it
    (transformers' TransformGetItemToIndex around its mask vmap): those saw the transformed function's own calls as
    it was acquired, as eager's run it, and fulmen's rules are none of the program's calls."""
    stack = _get_current_function_mode_stack()
    if interpreter not in stack:
        raise TraceError("fulmen's functional transforms run inside the acquisition's torch-function mode only",
                         user_location())
    with contextlib.ExitStack() as popped:
        for _ in range(len(stack) - stack.index(interpreter)):
            popped.enter_context(_pop_mode_temporarily())
        yield


def name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


# --- acquiring the transformed function -----------------------------------------------------------------------------
@dataclass
class Acquired:
    trace: Trace  # inputs: the fresh proxies, then values captured from outside; outputs: the tensor results
    fresh: list[Any]  # per flat argument leaf: its fresh proxy (non-tensors as they are)
    outer: list[Any]  # per flat argument leaf: its value in the trace around
    arg_spec: Any  # the structure of (args, kwargs)
    results: list[Any]  # the flat results: proxies of `trace`, other objects as they are
    result_spec: Any


def acquire(interpreter: Interpreter, fn: Callable[..., Any], args: tuple, kwargs: dict,
            make: Callable[[int, TensorProxy], TensorProxy], what: str) -> Acquired:
    """Runs `fn` on fresh proxies (`make(leaf index, outer value)`) into a trace of its own."""
    builder = interpreter.builder
    leaves, spec = tree_flatten((args, kwargs))
    outer = [interpreter._values(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    fresh = [make(i, x) if type(x) is TensorProxy else x for i, x in enumerate(outer)]
    inputs = [p for p in fresh if type(p) is TensorProxy]
    sub_args, sub_kwargs = tree_unflatten(fresh, spec)
    decompose, builder.decompose = builder.decompose, True  # the transforms' rules are per prim
    builder.scopes.append([])
    try:
        results, result_spec = tree_flatten(fn(*sub_args, **sub_kwargs))
        names = {p.pname for p in inputs}
        results = [_result(interpreter, x, names) for x in results]
    finally:
        bsyms = builder.scopes.pop()
        builder.decompose = decompose
    for proxy in inputs:
        if interpreter.functional.was_written(proxy):
            raise TraceError(f"{what}: the function updates its input {proxy.pname} in place, which {what} does not "
                             "support; work on a copy (x = x.clone())", user_location())
    produced = {p.pname for p in inputs}
    free: dict[str, TensorProxy] = {}
    for bsym in bsyms:
        free.update((p.pname, p) for p in bsym.proxy_args() if p.pname not in produced)
        produced.update(bsym.output_names())
    # A tensor from outside updated with a value of this trace: the transforms write its trace elsewhere, under
    # other names, so the update's write-back would read a value the program never computes.
    updated = interpreter.functional.updated_within(produced)
    if updated:
        obj = updated[0]
        raise TraceError(f"{what}: the function updates in place a tensor from outside it ({obj.type_string()}), as "
                         f"F.batch_norm in training mode does its running statistics, which {what} does not "
                         "support; return the new value from the function instead (for batch_norm: running_mean="
                         "None and running_var=None, or eval mode)", interpreter.functional.written_at(obj))
    free.update((p.pname, p) for p in results if type(p) is TensorProxy and p.pname not in produced)
    outputs = tuple(p for p in results if type(p) is TensorProxy)
    trace = Trace(what.replace(".", "_"), inputs + list(free.values()), bsyms, outputs, what, builder.namespace)
    return Acquired(trace, fresh, outer, spec, results, result_spec)


def _result(interpreter: Interpreter, x: Any, inputs: set[str]) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    value = interpreter.functional.resolve(x) if type(x) is TensorProxy else interpreter._values(x)
    return prims.alias(value) if value.pname in inputs else value  # a result is never an input itself


def fresh_proxy(interpreter: Interpreter, like: TensorProxy, requires_grad: bool,
                shape: Sequence[int] | None = None) -> TensorProxy:
    with torch._C.DisableTorchFunction():  # a meta tensor, not a call of the program
        meta = like.meta if shape is None else torch.empty(tuple(shape), dtype=like.dtype, device="meta")
    return interpreter.builder.make_proxy(meta, like.device, requires_grad, name=f"{like.pname}_")


def zeros(x: TensorProxy) -> TensorProxy:
    return prims.full(tuple(x.shape), 0, dtype=x.dtype, device=x.device)


# --- grad and vjp ---------------------------------------------------------------------------------------------------
class VjpProgram:
    """A function's forward and backward (fulmen's grad transform) written into the trace being acquired."""

    def __init__(self, interpreter: Interpreter, acquired: Acquired, present: tuple[bool, ...]) -> None:
        self.acquired = acquired
        with transforming(interpreter):
            self.plan: GradPlan = plan_grad(acquired.trace, Interpreter)
        self.present = tuple(p and d for p, d in zip(present, self.plan.differentiable))

    def forward(self, emitter: Emitter) -> None:
        emitter.env.update((f.pname, o) for f, o in zip(self.acquired.fresh, self.acquired.outer)
                           if type(f) is TensorProxy)
        for bsym in self.plan.forward.bound_symbols:
            emitter.emit(bsym)

    def backward(self, emitter: Emitter, cotangents: list[TensorProxy | None]) -> list[TensorProxy | None]:
        """The grads of the fresh inputs, given a cotangent per trace output (None: none); `emitter.env` holds the
        saved values."""
        present = tuple(p and c is not None for p, c in zip(self.present, cotangents))
        if not any(present):
            return [None] * len(self.acquired.trace.inputs)
        backward = self.plan.backward(present)
        given = [c for c, p in zip(cotangents, present) if p]
        emitter.env.update((p.pname, c) for p, c in zip(backward.inputs[len(self.plan.saved):], given))
        for bsym in backward.bound_symbols:
            emitter.emit(bsym)
        return [None if g is None else emitter.read(g) for g in backward.output]


def _wrt_leaves(args: tuple, kwargs: dict, positions: tuple[int, ...]) -> list[bool]:
    flags = []
    for i, arg in enumerate(args):
        flags += [i in positions] * len(tree_leaves(arg))
    return flags + [False] * len(tree_leaves(kwargs))


def _requires_grad_maker(interpreter: Interpreter, wrt: list[bool], what: str):
    def make(i: int, outer: TensorProxy) -> TensorProxy:
        if wrt[i] and not (outer.dtype.is_floating_point or outer.dtype.is_complex):
            raise TraceError(f"{what}: only Tensors of floating point dtype can require gradients, got "
                             f"{outer.type_string()}", user_location())
        return fresh_proxy(interpreter, outer, wrt[i])

    return make


def _split_aux(result: Any, has_aux: bool, what: str) -> tuple[Any, Any]:
    if not has_aux:
        return result, None
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TraceError(f"{what}(f, has_aux=True): f must return a pair (output, aux), got {type(result).__name__}",
                         user_location())
    return result[0], result[1]


def _argnums(argnums: int | tuple[int, ...], n_args: int, what: str) -> tuple[int, ...]:
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not positions or not all(isinstance(p, int) and not isinstance(p, bool) for p in positions):
        raise TypeError(f"{what}: argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    for p in positions:
        if not -n_args <= p < n_args:
            raise ValueError(f"{what}: got argnums={argnums!r}, but the function was called with {n_args} "
                             "positional arguments")
    return tuple(p % n_args for p in positions)


def _grad_inline(fn: Callable[..., Any], argnums: int | tuple[int, ...], has_aux: bool, args: tuple,
                 kwargs: dict) -> Any:
    interpreter = current_interpreter()
    positions = _argnums(argnums, len(args), "fulmen.grad")
    wrt = _wrt_leaves(args, kwargs, positions)

    def scalar_and_aux(*a: Any, **k: Any) -> tuple[Any, Any]:
        out, aux = _split_aux(fn(*a, **k), has_aux, "fulmen.grad")
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            got = f"tensor with {out.dim()} dims" if isinstance(out, torch.Tensor) else type(out).__name__
            raise TraceError(f"fulmen.grad(f)(*args): expected f(*args) to return a scalar Tensor, got {got}; "
                             "use fulmen.vjp for other outputs", user_location())
        return out, aux

    make = _requires_grad_maker(interpreter, wrt, "fulmen.grad")
    with torch.enable_grad():  # as torch.func.grad: an outer no_grad does not stop it
        acquired = acquire(interpreter, scalar_and_aux, args, kwargs, make, "fulmen.grad")
        n_outputs = len(acquired.trace.output)
        program = VjpProgram(interpreter, acquired, (True,) + (False,) * (n_outputs - 1))
    emitter = Emitter(interpreter.builder)
    program.forward(emitter)
    out = emitter.read(acquired.trace.output[0])
    one = prims.full((), 1, dtype=out.dtype, device=out.device)
    grads = program.backward(emitter, [one] + [None] * (n_outputs - 1))
    by_input = dict(zip((p.pname for p in acquired.trace.inputs), grads))
    leaf_grads = [by_input.get(f.pname) if type(f) is TensorProxy else None for f in acquired.fresh]
    results = []
    offset = 0
    for i, arg in enumerate(args):
        leaves, spec = tree_flatten(arg)
        if i in positions:
            outers = acquired.outer[offset : offset + len(leaves)]
            grads_of = [g if g is not None else zeros(o) for g, o in zip(leaf_grads[offset:], outers)]
            results.append(tree_unflatten(grads_of, spec))
        offset += len(leaves)
    ordered = [results[sorted(positions).index(p)] for p in positions]
    value = ordered[0] if isinstance(argnums, int) else tuple(ordered)
    if not has_aux:
        return value
    values = [emitter.read(x) for x in acquired.results]
    return value, tree_unflatten(values, acquired.result_spec)[1]


def grad(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> FunctionalTransform:
    """torch.func.grad: a function returning the gradient of `fn`'s scalar output with respect to its positional
    arguments `argnums` (each may be a pytree of tensors; the gradient has its structure). With `has_aux`, `fn`
    returns `(output, aux)` and the function returns `(gradient, aux)`."""
    if not callable(fn):
        raise TypeError(f"fulmen.grad expects a function, got {type(fn).__name__}")
    inline = functools.partial(_grad_inline, fn, argnums, has_aux)
    return FunctionalTransform(lambda *args, **kwargs: inline(args, kwargs), f"grad({name_of(fn)})")


def _vjp_forward(interpreter: Interpreter, fn: Callable[..., Any], primals: tuple, has_aux: bool
                 ) -> tuple[VjpProgram, Emitter, Any, Any]:
    if not primals:
        raise TypeError("fulmen.vjp(fn, *primals): give at least one primal")
    wrt = [True] * len(tree_leaves(primals))
    with torch.enable_grad():
        acquired = acquire(interpreter, lambda *p: _split_aux(fn(*p), has_aux, "fulmen.vjp"), primals, {},
                           _requires_grad_maker(interpreter, wrt, "fulmen.vjp"), "fulmen.vjp")
        output_spec = tree_flatten(tree_unflatten(acquired.results, acquired.result_spec)[0])[1]
        n_out = output_spec.num_leaves
        present = tuple(i < n_out for i in range(len(acquired.trace.output)))
        program = VjpProgram(interpreter, acquired, present)
    emitter = Emitter(interpreter.builder)
    program.forward(emitter)
    out, aux = tree_unflatten([emitter.read(x) for x in acquired.results], acquired.result_spec)
    return program, emitter, out, aux


def _vjp_backward(program: VjpProgram, emitter: Emitter, out: Any, cotangents: Any) -> tuple:
    leaves, spec = tree_flatten(cotangents)
    out_leaves, out_spec = tree_flatten(out)
    if spec != out_spec:
        raise TraceError(f"fulmen.vjp's vjp_fn: the cotangents' structure {spec} is not the outputs' {out_spec}",
                         user_location())
    interpreter = current_interpreter()
    given = []
    for c, o in zip(leaves, out_leaves):
        c = interpreter._values(c) if isinstance(c, torch.Tensor) else c
        if type(o) is TensorProxy and (type(c) is not TensorProxy or tuple(c.shape) != tuple(o.shape)):
            raise TraceError(f"fulmen.vjp's vjp_fn: a cotangent must be a tensor of its output's shape "
                             f"{tuple(o.shape)}, got {c.type_string() if type(c) is TensorProxy else c!r}",
                             user_location())
        given.append(c if type(o) is TensorProxy else None)
    n_out = len(program.acquired.trace.output)
    grads = program.backward(emitter, given + [None] * (n_out - len(given)))
    by_input = dict(zip((p.pname for p in program.acquired.trace.inputs), grads))
    flat = [(by_input.get(f.pname) if by_input.get(f.pname) is not None else zeros(o))
            if type(f) is TensorProxy else None for f, o in zip(program.acquired.fresh, program.acquired.outer)]
    primals, _ = tree_unflatten(flat, program.acquired.arg_spec)
    return tuple(primals)


def vjp(fn: Callable[..., Any], *primals: Any, has_aux: bool = False) -> tuple:
    """torch.func.vjp: `(fn(*primals), vjp_fn)`, where `vjp_fn(cotangents)` (one cotangent per output, in the
    outputs' structure) returns the vector-Jacobian products, a tuple with one entry per primal. With `has_aux`,
    `fn` returns `(output, aux)` and vjp returns `(output, vjp_fn, aux)`.

    On tensors the forward runs at once and keeps what the backward needs (chosen as fulmen.jit chooses what to
    save), and each `vjp_fn` call runs the backward: both are traces that run like any other."""
    interpreter = current_interpreter()
    if interpreter is not None:
        program, emitter, out, aux = _vjp_forward(interpreter, fn, primals, has_aux)
        vjp_fn = functools.partial(_vjp_backward, program, emitter, out)
        return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)
    state: dict[str, Any] = {}

    def forward(*p: Any) -> tuple:
        program, emitter, out, aux = _vjp_forward(current_interpreter(), fn, p, has_aux)
        state.update(program=program, out=out)
        return out, aux, [emitter.read(s) for s in program.plan.saved]

    def backward(saved: list, cotangents: Any) -> tuple:
        program = state["program"]
        emitter = Emitter(current_interpreter().builder, {s.pname: v for s, v in zip(program.plan.saved, saved)})
        return _vjp_backward(program, emitter, state["out"], cotangents)

    out, aux, saved = JittedFunction(forward, JitOptions(), executors=resolve(None))(*primals)
    backward_jitted = JittedFunction(backward, JitOptions(), executors=resolve(None))

    def vjp_fn(cotangents: Any) -> tuple:
        return backward_jitted(saved, cotangents)

    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


# torch.func.grad made inside a program fulmen acquires is this grad (torch_func_calls.py)
made_as(torch._functorch.apis.grad, "wrapper", lambda local: grad(local["func"], local["argnums"], local["has_aux"]))


# --- jvp ------------------------------------------------------------------------------------------------------------
def _jvp_inline(fn: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool) -> tuple:
    interpreter = current_interpreter()
    if not isinstance(primals, (tuple, list)) or not isinstance(tangents, (tuple, list)):
        raise TypeError("fulmen.jvp(f, primals, tangents): primals and tangents must be tuples")
    primal_leaves, primal_spec = tree_flatten(tuple(primals))
    tangent_leaves, tangent_spec = tree_flatten(tuple(tangents))
    if primal_spec != tangent_spec:
        raise ValueError(f"fulmen.jvp: tangents have the structure {tangent_spec}, primals {primal_spec}")
    outer, dots = [], []
    for p, t in zip(primal_leaves, tangent_leaves):
        if not isinstance(p, torch.Tensor) or not isinstance(t, torch.Tensor):
            raise TypeError(f"fulmen.jvp: primals and tangents must be tensors, got {type(p).__name__} and "
                            f"{type(t).__name__}")
        p, t = interpreter._values(p), interpreter._values(t)
        if (tuple(p.shape), p.dtype) != (tuple(t.shape), t.dtype):
            raise ValueError(f"fulmen.jvp: a tangent of {t.type_string()} for a primal of {p.type_string()}; they "
                             "must have the same shape and dtype")
        outer.append(prims.alias(p))  # one value per primal: a tensor given twice keeps both tangents
        dots.append(t)
    acquired = acquire(interpreter, lambda *p: _split_aux(fn(*p), has_aux, "fulmen.jvp"),
                       tree_unflatten(outer, primal_spec), {},
                       lambda i, o: fresh_proxy(interpreter, o, o.requires_grad), "fulmen.jvp")
    env = {f.pname: o for f, o in zip(acquired.fresh, acquired.outer) if type(f) is TensorProxy}
    transform = JvpTransform(interpreter.builder, interpreter, env, {o.pname: t for o, t in zip(outer, dots)})
    with transforming(interpreter):
        transform.run(acquired.trace.bound_symbols)
    out, aux = tree_unflatten([transform.emitter.read(x) for x in acquired.results], acquired.result_spec)
    out_leaves, out_spec = tree_flatten(out)
    tangent_outs = []
    for o in out_leaves:
        if type(o) is not TensorProxy:
            raise TraceError(f"fulmen.jvp: f must return tensors, got {type(o).__name__}", user_location())
        tangent = transform.tangents.get(o.pname)
        tangent_outs.append(tangent if tangent is not None else zeros(o))
    result = (out, tree_unflatten(tangent_outs, out_spec))
    return (*result, aux) if has_aux else result


def jvp(fn: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool = False) -> tuple:
    """torch.func.jvp: `(fn(*primals), jvp_out)`, the Jacobian of `fn` at `primals` times `tangents` (tuples of
    tensors, or pytrees of them, of the same structure), computed forward with fulmen's JVP rules. With `has_aux`,
    `fn` returns `(output, aux)` and jvp returns `(output, jvp_out, aux)`."""
    if current_interpreter() is not None:
        return _jvp_inline(fn, primals, tangents, has_aux)
    jitted = JittedFunction(lambda p, t: _jvp_inline(fn, p, t, has_aux), JitOptions(), executors=resolve(None))
    return jitted(tuple(primals) if isinstance(primals, list) else primals,
                  tuple(tangents) if isinstance(tangents, list) else tangents)
