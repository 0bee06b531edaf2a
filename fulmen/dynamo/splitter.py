"""Finding the nodes of a Dynamo graph fulmen cannot acquire, and splitting the graph around them.

A node is refused when it is a higher-order op (a nested graph such as Dynamo's `autograd_function_apply`) or a read
of tensor values, or when acquiring it fails: the whole graph is acquired once, node by node, with fulmen's own
interpreter on proxies of the first call's inputs. A node that fails is given stand-ins for its outputs (from the
example values Dynamo recorded) so the nodes after it are still tried, and every refusal keeps its reason. The graph
is then split into runs of consecutive nodes fulmen takes and runs of nodes it refuses (`split_module`).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from fulmen.acquisition.acquire import DATA_DEPENDENT, Interpreter
from fulmen.acquisition.autograd_functions import function_apply_recorded
from fulmen.acquisition.replacements import call_table
from fulmen.core.errors import FulmenError
from fulmen.core.source import SourceLocation, stack_trace_location
from fulmen.core.symbolic import optimization_hint
from fulmen.core.trace import TraceBuilder
from fulmen.dynamo.func_regions import func_regions
from fulmen.dynamo.hops import CONTEXT_CALLS, checkpoint_reason
from fulmen.observation.frame_tap import CallTap
from fulmen.transforms.distribution import logical_meta

CALLS = ("call_function", "call_method", "call_module")
_UNKNOWN_SIZE = 2  # the probe's stand-in for a size only tensor values decide (0 and 1 would be special-cased)


def _target_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return torch.overrides.resolve_name(node.target) or getattr(node.target, "__name__", str(node.target))


# Higher-order ops fulmen acquires: Dynamo's form of a `torch.autograd.Function` call runs the Function it was made
# from (its forward and backward graphs), which fulmen records as an autograd_function region.
ACQUIRED_HIGHER_ORDER = frozenset({"autograd_function_apply"})


def static_reason(node: torch.fx.Node) -> str | None:
    """Why fulmen refuses `node` without trying it, or None."""
    if (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
            and node.target.name() not in ACQUIRED_HIGHER_ORDER):
        return f"{node.target.name()} is a higher-order op (a nested graph); fulmen acquires plain torch calls"
    if (reason := checkpoint_reason(node)) is not None:
        return reason
    target = getattr(torch.Tensor, node.target, None) if node.op == "call_method" else node.target
    if node.op in ("call_function", "call_method") and target in DATA_DEPENDENT:
        return f"{_target_name(node)} reads tensor values"
    return None


def static_refusals(module: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The nodes of `module` fulmen refuses without trying them, each with its reason (a torch.func transform's
    region whole, see fulmen.dynamo.func_regions)."""
    reasons = func_regions(module)
    reasons.update({node: _with_line(reason, node) for node in module.graph.nodes
                    if node not in reasons and (reason := static_reason(node)) is not None})
    return reasons


def first_line(error: BaseException) -> str:
    """The error's first line, with the user's line it names (for a node of a Dynamo graph, the line it came from)."""
    return _at(str(error).split("\n", 1)[0], getattr(error, "location", None))


def _at(reason: str, location: SourceLocation | None) -> str:
    return f"{reason} (at {location.short()})" if isinstance(location, SourceLocation) else reason


def _with_line(reason: str, node: torch.fx.Node) -> str:
    """`reason` with the user's line `node` came from: the probe runs the graph through torch.fx's interpreter, so the
    locations fulmen's errors find there are Dynamo's frame (the user's `def` line), never the node's."""
    return _at(reason, stack_trace_location(node.meta.get("stack_trace")))


@contextlib.contextmanager
def _global_state_kept() -> Iterator[None]:
    """Grad mode as it was, whichever node the probe stopped at."""
    grad = torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_grad_enabled(grad)


class _Probe(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, builder: TraceBuilder, reasons: dict[torch.fx.Node, str]):
        super().__init__(module)
        self.builder = builder
        self.reasons = reasons

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return super().call_function(CONTEXT_CALLS.get(target, target), args, kwargs)

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op in CALLS:
            reason = self.reasons.get(node)
            if reason is None:
                try:
                    return super().run_node(node)
                except FulmenError as error:
                    message = str(error).split("\n", 1)[0]
                    self.reasons[node] = _with_line(f"{_target_name(node)}: {message}", node)
            return self._stand_in(node.meta.get("example_value"))
        return super().run_node(node)

    def _stand_in(self, value: Any) -> Any:
        """A proxy (or plain value) shaped like Dynamo's example value of a refused node."""
        if isinstance(value, torch.Tensor):
            shape = [_concrete(s) for s in value.shape]
            stride = [_concrete(s) for s in value.stride()]
            # outside the acquisition's mode, as the inputs' proxies are made: under inference mode the meta tensor
            # is an inference tensor, which make_proxy reads the storage of (a value read the mode refused)
            with torch._C.DisableTorchFunction():
                meta = torch.empty_strided(shape, stride, dtype=value.dtype, device="meta")
                return self.builder.make_proxy(meta, value.device, value.requires_grad)
        if isinstance(value, (tuple, list)):
            return type(value)(self._stand_in(item) for item in value)
        return _concrete(value)


def _concrete(value: Any) -> Any:
    """A size for the probe: a dynamic size's value at this call, or a guess for a size known only from tensor
    values (nonzero's, under capture_dynamic_output_shape_ops). The guess only steers the probe; each piece fulmen
    takes is traced on its real inputs, and one it then refuses falls back."""
    if isinstance(value, torch.SymInt):
        return optimization_hint(value, fallback=_UNKNOWN_SIZE)
    return value


def refused_nodes(module: torch.fx.GraphModule, args: tuple, decompose: bool,
                  executors: tuple[Any, ...]) -> dict[torch.fx.Node, str]:
    """The nodes of `module` fulmen refuses for these inputs, each with its reason (acquired as the pieces will be:
    a symbol fulmen records may still fail in its decomposition)."""
    reasons = static_refusals(module)
    builder = TraceBuilder(decompose=decompose)
    interpreter = Interpreter(builder)
    inputs = [builder.make_proxy(logical_meta(a), a.device, a.requires_grad) if isinstance(a, torch.Tensor) else a
              for a in args]
    with (_global_state_kept(), builder, interpreter, function_apply_recorded(interpreter),
          CallTap(call_table(executors, interpreter).watches)):
        _Probe(module, builder, reasons).run(*inputs)
    return reasons


_OPERATOR_WRITES = frozenset({
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.iconcat})


def _may_write(node: torch.fx.Node) -> bool:
    """Whether `node` may update a tensor in place (judged widely: an in-place method or function, `out=`, setitem,
    a mutable operator, a nested graph, a module call)."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    target = node.target
    if getattr(target, "__module__", None) in ("_operator", "operator"):  # operator.not_ only reads
        return target in _OPERATOR_WRITES
    if "out" in node.kwargs or isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        schemas = [target._schema] if isinstance(target, torch._ops.OpOverload) else [
            getattr(target, overload)._schema for overload in target.overloads()]
        return any(schema.is_mutable for schema in schemas)
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def input_reads_first(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`module` (in place) with each read of an input's value (`.item()`) moved up, past nothing that may update a
    tensor, where the input is only read so (a float Dynamo made a tensor input of under dynamic=True: RMSNorm's eps,
    a scale). fulmen refuses each read, and where they stood they cut the graph into many pieces (LitGPT: 17 for two
    layers); moved up, they make few pieces the fallback runs between fulmen's."""
    anchor = None
    for node in list(module.graph.nodes):
        source = node.args[0] if node.op == "call_method" and node.target == "item" else None
        if (isinstance(source, torch.fx.Node) and source.op == "placeholder" and anchor is not None
                and all(user.op == "call_method" and user.target == "item" for user in source.users)):
            if anchor.next is not node:
                anchor.append(node)
            anchor = node
        elif node.op == "placeholder" or _may_write(node):
            anchor = node
    module.recompile()
    return module


def refused_under_autocast(module: torch.fx.GraphModule, refused: dict[torch.fx.Node, str]) -> str | None:
    """The reason of the first refused node inside a `torch.autocast` region, or None. Split there, the region
    becomes one per piece, and autocast's cache of cast weights (one bf16 copy of a weight per region in eager)
    ends with each: a weight used on both sides is cast twice and its grad sums differently."""
    depth = 0
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is torch.amp._enter_autocast:
            depth += 1
        elif node.op == "call_function" and node.target is torch.amp._exit_autocast:
            depth -= 1
        elif depth and node in refused:
            return f"{refused[node]} (inside torch.autocast, which a split would cut)"
    return None


_SIZE_READS = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
                         torch.ops.aten.sym_storage_offset.default})


def _stays_with_its_source(node: torch.fx.Node, assignment: dict[torch.fx.Node, int], piece: int) -> bool:
    """Whether `node` reads a size of, or an item of, a value the current piece makes, and so belongs to that piece.
    split_module binds a size known only from values (nonzero's, under capture_dynamic_output_shape_ops) at its
    first read, and a piece using a tensor of that size needs it bound in an earlier piece: a read left to the next
    piece made the pieces depend on each other. An item left to the next piece made the whole tuple (a higher-order
    op's results, flex_attention's) an output of its piece, which Inductor compiled item by item from Dynamo's
    example values, more items than its own graph of the op gives (IndexError)."""
    return (node.op == "call_function" and node.target in (*_SIZE_READS, operator.getitem)
            and isinstance(node.args[0], torch.fx.Node) and assignment.get(node.args[0]) == piece)


def split(module: torch.fx.GraphModule, refused: dict[torch.fx.Node, str]) -> tuple[torch.fx.GraphModule, dict]:
    """`module` as consecutive pieces (`submod_0`, `submod_1`, ...), each all taken or all refused by fulmen;
    returns it with, per piece name, the reasons of its refused nodes (an empty list for a piece fulmen takes)."""
    piece, taken, pieces = 0, None, {}
    assignment: dict[torch.fx.Node, int] = {}
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _stays_with_its_source(node, assignment, piece):
            assignment[node] = piece
            continue
        ok = node not in refused
        if taken is not None and ok != taken and node.op in CALLS:
            piece += 1
        if node.op in CALLS:
            taken = ok
        assignment[node] = piece
        pieces.setdefault(f"submod_{piece}", [])
        if not ok and refused[node] not in pieces[f"submod_{piece}"]:
            pieces[f"submod_{piece}"].append(refused[node])
    result = split_module(module, None, lambda node: assignment[node], keep_original_order=True)
    return result, pieces
