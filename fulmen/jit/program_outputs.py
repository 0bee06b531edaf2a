"""What a jitted program gives back, as its trace's outputs (fulmen.jit.jitted's acquisition): returned values,
assigned module tensors, the grads a backward inside the program left, views taken again, updated inputs."""

from __future__ import annotations

from typing import Any

import torch

from fulmen.acquisition.acquire import Interpreter
from fulmen.core import pytree
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.jit.buffer_registrations import Registered
from fulmen.jit.module_inputs import ShadowTree
from fulmen.jit.trace_cache import ReturnedInput
from fulmen.ops import prims
from fulmen.runtime.output_grads import Retained
from fulmen.runtime.view_outputs import view_outputs


def program_outputs(result: Any, proxies: list[TensorProxy], tree: ShadowTree | None, interpreter: Interpreter,
                    inputs: list[TensorProxy], given: frozenset[int], registered: list[Registered]) -> tuple:
    """The trace's outputs from what the program gave back: the values it returned (an input returned as itself or
    a view of one is taken from the call's input: ReturnedInput), the module tensors it assigned and the buffers it
    registered (rebinds), the .grad a backward inside it left, the bases of returned views it computed, then the
    write-backs of the inputs it updated; with the grads it retained."""
    functional = interpreter.functional
    leaves: list[torch.Tensor] = []
    out_objects: dict[int, Any] = {}
    try:
        # an object the program was given (a KV cache it updated in place) comes back as itself: every call
        # that reuses this trace was given the same object (the cache key holds it by identity)
        out_spec = pytree.flatten(result, leaves, out_objects, objects=True, given=given)
    except TypeError as error:
        raise TraceError(str(error), None) from None
    input_index = {id(p): i for i, p in enumerate(proxies)}
    values: list[Any] = []
    returns_input: list[ReturnedInput | None] = []
    retained = interpreter.retained
    kept = [i for i, leaf in enumerate(leaves) if id(leaf) in retained]
    objects: dict[int, int] = {}  # id(a tensor the program returned or assigned) -> its position in `values`
    for leaf in leaves:
        objects.setdefault(id(leaf), len(values))
        returned = None
        if type(leaf) is TensorProxy:
            values.append(functional.resolve(leaf))
            path = functional.view_path(leaf, input_index)
            if path is not None:
                position, views = path
                history = values[-1].requires_grad and any(v.detached for v in views)
                if history and any(v.hidden for v in views):
                    _refuse_data_alias_history(functional, leaf, proxies[position])
                returned = ReturnedInput(position, tuple((v.sym.impl, v.args, v.kwargs, v.index) for v in views),
                                         values[-1].requires_grad or not proxies[position].requires_grad, history)
        else:  # a captured tensor, returned itself
            values.append(interpreter._constant(leaf))
            captured = next((i for i, (_, p) in enumerate(interpreter.constants) if p is values[-1]), None)
            returned = ReturnedInput(len(proxies) + captured) if captured is not None else None
        returns_input.append(returned)
    rebinds = []
    # then the buffers the program registered in modules that are not shadows (buffer_registrations.py)
    found = [(r.module, "_buffers", r.name, None, r.value) for r in registered]
    if tree is not None or found:
        for module, container, name, given, now in [*(tree.rebinds() if tree is not None else ()), *found]:
            value = functional.resolve(now)
            # a value with an autograd history is the module's new tensor, as eager's assignment makes it; a
            # buffer the program registered (given None) has no tensor to copy into
            same = given is not None and (value.shape, value.dtype, value.device) == (given.shape, given.dtype,
                                                                                      given.device)
            if same and not value.requires_grad:
                prims.copy_(value, given)
            else:
                if id(now) in retained:
                    kept.append(len(values))
                objects.setdefault(id(now), len(values))
                values.append(value)
                rebinds.append((module, container, name))
    for write, value in interpreter.grad_slots.outputs():  # the .grad a backward inside the program left
        objects.setdefault(id(value), len(values))
        values.append(functional.resolve(value))
        rebinds.append(write)
    # views of tensors the program computed, taken again by the call (view_outputs.py): after the returned and
    # assigned tensors, the trace returns the bases that are neither
    views = view_outputs(functional, [leaf if r is None else None for leaf, r in zip(leaves, returns_input)],
                         values, objects)
    dirty = functional.write_back(inputs)
    held = tuple(i for i, p in enumerate(proxies) if id(p) in retained)
    kept_grads = Retained(tuple(kept), held) if kept or held else None
    return values, out_spec, out_objects, tuple(returns_input), rebinds, dirty, kept_grads, views


def _refuse_data_alias_history(functional: Any, output: TensorProxy, given: TensorProxy) -> None:
    """An output that is a `.data` alias of an input (or a view of one), given an autograd history by an in-place
    update with a value that has one (`t = x.data; t.mul_(w)`): eager's alias shares the input's memory but has a
    version counter of its own, which counts the updates through it; the alias fulmen takes from the input after
    the call starts a new one. (A `.detach()` alias shares the input's counter, and gets the history:
    trace_cache.py.)"""
    raise TraceError(
        f"the program returns a .data alias of its input {given.pname} that an in-place update gave an autograd "
        "history (a value that requires grad): fulmen cannot give it eager's version counter; return a .detach() "
        "alias or a clone of it, or update it under torch.no_grad()",
        functional.written_at(output) or functional.written_at(functional.root(output)))
