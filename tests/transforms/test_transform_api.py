"""The public transform API: hooks at the pipeline's stages, their checks, provenance, and the docs' example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import TraceBuilder
from fulmen.ops import prims

DOCS = Path(__file__).resolve().parents[2] / "docs" / "transforms.md"


def test_docs_example_runs():
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S))
    assert "class TanhGelu(fulmen.Transform)" in code
    namespace: dict = {}
    exec(compile(code, str(DOCS), "exec"), namespace)  # the example asserts its own results
    transform, jitted = namespace["transform"], namespace["jitted"]
    assert transform.counts["forward"]["gelu"] == 1
    provenances = [t.provenance for t in fulmen.last_traces(jitted)]
    assert provenances.index("TanhGelu: exact GELU -> tanh GELU") < provenances.index("Forward (fulmen grad transform)")


class Recorder(fulmen.Transform):
    """Records every hook call and changes nothing."""

    def __init__(self):
        self.calls = []

    def transform_acquired(self, trace):
        self.calls.append(("acquired", trace.provenance))
        return trace

    def transform_forward(self, traces):
        self.calls.append(("forward", traces.forward.provenance, traces.n_saved,
                           tuple(p.pname for p in traces.saved_in_backward)))
        return traces.forward

    def transform_backward(self, traces):
        self.calls.append(("backward", traces.forward.provenance, len(traces.backward.inputs)))
        return traces.backward

    def transform_final(self, trace, kind):
        self.calls.append(("final", kind.value))
        return trace


def two_outputs(x, w):
    h = torch.tanh(x @ w)
    return h.sum(), h * 2


def test_hooks_run_at_their_stages_in_order():
    recorder = Recorder()
    x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    jitted = fulmen.jit(two_outputs, transforms=[recorder])
    total, doubled = jitted(x, w)
    kinds = [call[0] for call in recorder.calls]
    assert kinds == ["acquired", "forward", "backward", "final", "backward", "final"]
    assert recorder.calls[0][1] == "Dead Code Elimination"  # after the acquired stage's cleanup
    _, provenance, n_saved, saved = recorder.calls[1]
    assert provenance == "Forward (fulmen grad transform)" and n_saved == len(saved) > 0
    # the forward's final stage comes before the backward's (built when the program is compiled)
    assert recorder.calls[3] == ("final", "forward") and recorder.calls[5] == ("final", "backward")
    # a backward for another pattern of cotangents: the backward hook again, with the same forward
    total.backward()
    assert [call[0] for call in recorder.calls[6:]] == ["backward", "final"]
    assert recorder.calls[6][1] == provenance
    expected = torch.func.grad(lambda w: two_outputs(x, w)[0])(w)
    torch.testing.assert_close(w.grad, expected)
    # without grad: one final call, of the whole computation
    recorder.calls.clear()
    with torch.no_grad():
        jitted(x, w)
    assert recorder.calls == [("acquired", "Dead Code Elimination"), ("final", "computation")]


class DoubleGrads(fulmen.Transform):
    """Multiplies every grad the backward returns by two (a visible change of the backward)."""

    def transform_backward(self, traces):
        backward = traces.backward
        with TraceBuilder(backward.namespace) as builder:
            grads = tuple(None if g is None else prims.mul(g, 2.0) for g in backward.output)
        return backward.from_trace("grads doubled", bound_symbols=backward.bound_symbols + builder.bound_symbols,
                                   output=grads)


def test_a_backward_hook_changes_the_grads_and_names_itself():
    x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    jitted = fulmen.jit(lambda x, w: (x @ w).sin().sum(), transforms=[DoubleGrads()])
    jitted(x, w).backward()
    expected = torch.func.grad(lambda w: (x @ w).sin().sum())(w)
    torch.testing.assert_close(w.grad, 2 * expected)
    provenances = [t.provenance for t in fulmen.last_backward_traces(jitted)]
    assert "DoubleGrads: grads doubled" in provenances
    assert "# Constructed by DoubleGrads: grads doubled" in str(fulmen.last_backward_traces(jitted)[
        provenances.index("DoubleGrads: grads doubled")])


class Negate(fulmen.Transform):
    """Negates the program's result at the acquired stage; the provenance is the transform's own default."""

    def transform_acquired(self, trace):
        with TraceBuilder(trace.namespace) as builder:
            negated = prims.neg(trace.output[0])
        return trace.from_trace(trace.provenance, bound_symbols=trace.bound_symbols + builder.bound_symbols,
                                output=(negated,))


def test_transforms_compose_in_order_and_are_differentiated():
    x = torch.randn(5, requires_grad=True)
    jitted = fulmen.jit(lambda x: x.exp(), transforms=[Negate(), Negate(), Negate()])
    out = jitted(x)
    torch.testing.assert_close(out, -x.exp())
    out.sum().backward()
    torch.testing.assert_close(x.grad, -x.exp())
    stamped = [t.provenance for t in fulmen.last_traces(jitted) if t.provenance.startswith("Negate")]
    assert stamped == ["Negate (stage acquired)"] * 3


class FinalPrims(fulmen.Transform):
    """Swaps each torch.exp of the trace that runs for prims.exp (same values)."""

    def transform_final(self, trace, kind):
        return fulmen.rewrite(trace, "exp as a prim",
                              lambda bsym: prims.exp(bsym.args[0]) if bsym.sym is fulmen.torch.exp else None)


def test_final_stage_rewrite_runs():
    x = torch.randn(6)
    jitted = fulmen.jit(lambda x: x.exp() + 1, transforms=[FinalPrims()])
    torch.testing.assert_close(jitted(x), x.exp() + 1)
    final = fulmen.last_traces(jitted)[-1]
    assert "prims.exp(x)" in str(final) and "torch.exp" not in str(final)
    assert fulmen.last_traces(jitted)[-2].provenance == "FinalPrims: exp as a prim"


class Returns(fulmen.Transform):
    def __init__(self, stage, make):
        self.stage, self.make = stage, make

    def transform_acquired(self, trace):
        return self.make(trace) if self.stage == "acquired" else trace

    def transform_forward(self, traces):
        return self.make(traces) if self.stage == "forward" else traces.forward

    def transform_backward(self, traces):
        return self.make(traces) if self.stage == "backward" else traces.backward


def _extra_output(trace):
    return trace.from_trace("extra", output=trace.output + trace.output)


def _reads_undefined(trace):
    with TraceBuilder(trace.namespace) as builder:
        ghost = builder.make_proxy(torch.empty(3, device="meta"), torch.device("cpu"))
    bad = BoundSymbol(prims.neg, (ghost,), {}, trace.output[0])
    return trace.from_trace("reads a ghost", bound_symbols=[bad])


def _new_input(trace):
    return trace.from_trace("new input", inputs=trace.inputs[::-1])


def _other_shape(trace):
    with TraceBuilder(trace.namespace) as builder:
        out = prims.reshape(trace.output[0], (3, 1))
    return trace.from_trace("reshaped", bound_symbols=trace.bound_symbols + builder.bound_symbols, output=(out,))


def _drops_saved(traces):
    return traces.forward.from_trace("no saved", output=traces.forward.output[: len(traces.forward.output) - 1])


def _saved_to_double(traces):
    backward = traces.backward
    first = backward.inputs[0]
    saved = fulmen.TensorProxy(first.pname, torch.empty(first.shape, dtype=torch.float64, device="meta"), first.device)
    inputs = [saved] + list(backward.inputs[1:])
    return backward.from_trace("saved as float64", inputs=inputs)


@pytest.mark.parametrize(("stage", "make", "message"), [
    ("acquired", lambda t: "not a trace", "returned str, not a Trace"),
    ("acquired", _extra_output, "changed the number of outputs from 1 to 2"),
    ("acquired", _reads_undefined, "which is not defined before it"),
    ("acquired", _new_input, "changed the trace's inputs"),
    ("acquired", _other_shape, "changed outputs 0 from cpu f32[3] to cpu f32[3, 1]"),
    ("forward", _drops_saved, "saved tensors; the backward takes"),
    ("backward", _saved_to_double, "saved tensors (the forward's saved outputs against the backward's inputs)"),
])
def test_what_a_hook_returns_is_checked(stage, make, message):
    x, y = torch.randn(3, requires_grad=True), torch.randn(3)
    jitted = fulmen.jit(lambda x, y: (x * y).sin(), transforms=[Returns(stage, make)])
    with pytest.raises(fulmen.TransformError, match=re.escape(message)) as error:
        jitted(x, y)
    assert "Returns (stage " in str(error.value)


def test_options_are_typed_and_given_once():
    with pytest.raises(TypeError, match="not a fulmen.Transform"):
        fulmen.JitOptions(transforms=[lambda trace: trace])
    with pytest.raises(TypeError, match="must be a list of fulmen.Transform"):
        fulmen.jit(torch.sin, transforms=Recorder())
    with pytest.raises(ValueError, match="not both"):
        fulmen.jit(torch.sin, options=fulmen.JitOptions(transforms=[Recorder()]), transforms=[Recorder()])
    with pytest.raises(ValueError, match="not both"):
        fulmen.jit(torch.sin, options=fulmen.JitOptions(offload=fulmen.OffloadOptions()),
                   offload=fulmen.OffloadOptions())
    assert fulmen.JitOptions(transforms=[Negate()]).transforms[0].name == "Negate"


def test_pipeline_is_listed_as_data():
    jitted = fulmen.jit(torch.sin, transforms=[Recorder()], options=fulmen.JitOptions(cse=False))
    described = fulmen.pipeline(jitted).describe().splitlines()
    assert [line.split(None, 1)[0] for line in described] == [
        "acquired", "acquired", "acquired", "acquired", "grad", "grad", "grad", "grad", "grad", "distributed",
        "execution", "final", "codegen"]
    assert described[3].split() == ["acquired", "Recorder", "Recorder", "(yours)"]
    assert described[4].split()[1] == "autodiff" and "Recorder (yours), on the forward and the backward" in described[8]
    assert "Dead Code Elimination" in described[5] and "Common Subexpression Elimination" in described[6]
    x = torch.randn(3)
    jitted(x)
    assert [t.provenance for t in fulmen.last_traces(jitted)] == [
        "Acquisition (fulmen.jit)", "Dead Code Elimination", "Transform for execution (sdpa, torch)",
        "Delete Last Used"]
    with_cse = fulmen.jit(torch.sin)
    with_cse(x)
    assert [t.provenance for t in fulmen.last_traces(with_cse)][1:4] == [
        "Dead Code Elimination", "Common Subexpression Elimination", "Dead Code Elimination"]
    assert [step.transform.name for step in fulmen.pipeline(with_cse).at(fulmen.Stage.ACQUIRED)][:3] == [
        "Dead Code Elimination", "Common Subexpression Elimination", "Dead Code Elimination"]


def test_module_with_transform():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    recorder = Recorder()
    jitted = fulmen.jit(model, transforms=[recorder])
    x = torch.randn(3, 4)
    torch.testing.assert_close(jitted(x), model(x))
    assert ("final", "forward") in recorder.calls
    assert F.gelu  # the module's GELU goes through the same hooks as a function's
