"""What a program reads about the autograd state of its tensors (`is_leaf`, `grad_fn`, `is_inference`), answered as
eager would.

A trace's proxies are stand-ins without a graph, so their own answers (always a leaf) are wrong. Most answers are
known while tracing: a value that does not require grad is a leaf without a grad_fn, and a value the program computed
that requires grad is not a leaf. What is left is an input that requires grad (an argument or a module tensor): eager's
answer is the real tensor's, which can differ from call to call (an argument `a * 1` or a leaf), so the answer seen
while tracing becomes a condition of the trace (`CacheEntry.facts`), checked only for traces that read it.

`requires_grad_()` on a value the program computed makes it a leaf, as in eager (`impls.autograd_leaf`, whose grad
goes no further); such a leaf cannot leave the program, nor be the only source of outputs that require grad.

A grad_fn that exists in eager is never a node fulmen can give (the program's values have none while tracing, and an
input's node is the node of one call): it stands as `TracedNode`, which answers `is None` and truth tests, and refuses
anything else naming the user's line.
"""

from __future__ import annotations

from typing import Any, NamedTuple, NoReturn

import torch

from fulmen.acquisition.functionalize import Functionalizer
from fulmen.core import pytree
from fulmen.core.errors import TraceError
from fulmen.core.proxies import TensorProxy
from fulmen.core.source import SourceLocation, user_location
from fulmen.core.trace import Trace
from fulmen.ops import shape


def leaf_flag_error(requires_grad: bool) -> str:
    """Eager's error for changing the requires_grad flag of a tensor that is not a leaf of autograd."""
    hint = ("" if requires_grad else " If you want to use a computed variable in a subgraph that doesn't require "
            "differentiation use var_no_grad = var.detach().")
    return "you can only change requires_grad flags of leaf variables." + hint


class TracedNode:
    """The grad_fn of a tensor that has one in eager, while tracing: it is not None and is true, nothing more."""

    __slots__ = ("tensor", "read_at")

    def __init__(self, tensor: str, read_at: SourceLocation | None) -> None:
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "read_at", read_at)  # where the program read the grad_fn

    def _refuse(self, use: str) -> NoReturn:
        raise TraceError(f"fulmen cannot trace {use} of the grad_fn of {self.tensor}: inside a jitted function a "
                         "tensor has no autograd node to give (only `grad_fn is None` / `is not None` can be "
                         "answered); use it outside the jitted function", user_location() or self.read_at)

    def __bool__(self) -> bool:
        return True  # a node is always true in eager

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # a generic probe (copy, pickle, pytrees): not a use
            raise AttributeError(name)
        self._refuse(f"reading .{name}")

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        self._refuse(f"setting .{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a call")

    def __eq__(self, other: object) -> bool:
        if other is None:
            return False
        self._refuse("a comparison")

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        self._refuse("hashing")

    def __repr__(self) -> str:
        return f"<grad_fn of {self.tensor}, unknown while tracing (fulmen)>"


class _InputFacts(NamedTuple):
    """What an input tensor answers, read when the trace starts (a program cannot change them: it sees a proxy)."""

    requires_grad: bool
    is_leaf: bool
    is_inference: bool


class AutogradFacts:
    """Answers `is_leaf`, `grad_fn` and `is_inference` of the program's tensors, and records what the answers assumed
    of the inputs."""

    def __init__(self, functional: Functionalizer) -> None:
        self._functional = functional
        # id(what the program sees) -> (it, the trace input it stands for, what the real tensor answers); never the
        # tensor itself: the interpreter holding this lives in reference cycles, which would keep every traced call's
        # inputs alive until the cyclic garbage collector runs
        self._inputs: dict[int, tuple[TensorProxy, TensorProxy, _InputFacts]] = {}
        # (id(trace input), fact) -> (it, the fact: "is_leaf" or "is_inference", its value as traced)
        self.read: dict[tuple[int, str], tuple[TensorProxy, str, bool]] = {}

    def add_input(self, visible: TensorProxy, proxy: TensorProxy, tensor: torch.Tensor) -> None:
        """The program sees the input `tensor` (the trace's `proxy`) as `visible`."""
        with torch._C.DisableTorchFunction():
            facts = _InputFacts(tensor.requires_grad, tensor.is_leaf, tensor.is_inference())
        self._inputs[id(visible)] = (visible, proxy, facts)

    def is_leaf(self, x: torch.Tensor) -> bool:
        if type(x) is not TensorProxy:  # a captured tensor: its guard holds its identity and requires_grad
            with torch._C.DisableTorchFunction():
                return x.is_leaf
        value = self._functional.resolve(x)
        if self._functional.made_leaf(value) is not False:
            return True
        if not self._functional.keeps_history(x, value):  # updated in place: the new value's history
            return not value.requires_grad
        known = self._inputs.get(id(x))
        if known is None or not known[2].requires_grad:  # computed by the program, or a leaf without grad
            return not x.requires_grad
        _, proxy, facts = known
        leaf = facts.is_leaf
        self.read[id(proxy), "is_leaf"] = (proxy, "is_leaf", leaf)
        return leaf

    def set_requires_grad(self, x: torch.Tensor, requires_grad: bool) -> bool:
        """`x.requires_grad_(requires_grad)` where the flag changes, as eager does it: a value the program computed,
        or a view of one or of an input, becomes a leaf of autograd that requires grad (Hugging Face's
        `enable_input_require_grads` hook does it to frozen embeddings' output, Wav2Vec2's feature encoder to a view
        of its input), and a leaf it made stops requiring grad. False, and nothing done, for an input (the flag is
        the caller's) or a tensor views were taken from (which keep the flag they had)."""
        if type(x) is not TensorProxy or id(x) in self._inputs:
            return False
        if not requires_grad and not self.is_leaf(x):
            raise RuntimeError(leaf_flag_error(False))  # eager's
        if not x.dtype.is_floating_point and not x.dtype.is_complex:
            raise RuntimeError("only Tensors of floating point dtype can require gradients")  # eager's
        return self._functional.set_leaf(x, requires_grad)

    def refuse_returned_leaves(self, result: Any, values: list[TensorProxy]) -> None:
        """A leaf the program made is refused where it leaves the program (returned, or stored in a module): eager's
        leaf gets the whole grad in `.grad`, fulmen's output only the grad that reaches it directly (output_grads.py)
        and is no leaf."""
        made = self._functional.made_leaf
        returned = next((v for v in values if made(v) is not False), None)
        if returned is None:
            return
        where = pytree.find(result, lambda obj: type(obj) is TensorProxy
                            and made(self._functional.resolve(obj)) is not False, "the output", modules=False)
        raise TraceError(
            f"the program returns a tensor it made a leaf of autograd with requires_grad_() ("
            f"{where or 'stored in a module'}, shape {tuple(returned.shape)}): eager accumulates its grad in its "
            ".grad, which a jitted call cannot give. Return a value computed from it, or make it require grad "
            "outside the jitted function", made(returned))

    def is_inference(self, x: torch.Tensor) -> bool:
        root = self._functional.root(x) if type(x) is TensorProxy else x
        known = self._inputs.get(id(root))
        with torch._C.DisableTorchFunction():
            if known is None:  # a captured tensor, or a value the program computed
                return torch.Tensor.is_inference(root)
            _, proxy, facts = known
        inference = facts.is_inference
        self.read[id(proxy), "is_inference"] = (proxy, "is_inference", inference)
        return inference

    def grad_fn(self, x: torch.Tensor) -> TracedNode | None:
        if self.is_leaf(x):
            return None
        return TracedNode(f"tensor {x.pname}" if type(x) is TensorProxy else "a captured tensor", user_location())


def refuse_returned_nodes(result: Any) -> None:
    """A grad_fn the program returns would be eager's node: fulmen has none to give."""
    found: list[TracedNode] = []
    where = pytree.find(result, lambda obj: type(obj) is TracedNode and not found.append(obj), "the output",
                        modules=False)
    if where is not None:
        node = found[0]
        raise TraceError(f"the program returns the grad_fn of {node.tensor} ({where}): inside a jitted function a "
                         "tensor has no autograd node to give; return the tensor and read its grad_fn outside",
                         node.read_at)


def refuse_leaf_without_grads(trace: Trace) -> None:
    """Outputs that require grad where no input gets a grad: only a leaf the program made (requires_grad_()) gives
    them that, and eager's outputs then require grad, where fulmen's call, with no input to differentiate, runs
    outside autograd. Refused, naming the requires_grad_() line; nothing is done without such a leaf."""
    leaf = next((b for b in trace.bound_symbols if b.sym is shape.autograd_leaf), None)
    if leaf is not None:
        raise TraceError(
            "the program makes a leaf of autograd with requires_grad_() and returns tensors computed from it, which "
            "require grad in eager, while no input (argument, parameter) gets a grad (all frozen?): fulmen runs such "
            "a call outside autograd. Leave a parameter it uses trainable, or call requires_grad_() outside the "
            "jitted function", leaf.source)
