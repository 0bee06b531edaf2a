"""The pipeline is data: every pass fulmen.jit runs is a `fulmen.Transform` in one ordered list
(`fulmen.pipeline(jitted)`), the options choose fulmen's own, the user's land at the stages whose hooks they override,
and `last_traces` / `last_backward_traces` show one trace per pass that changed something, in the list's order, each
stamped with its pass's name."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.jit.pipeline import Step
from fulmen.transforms.cudagraphs import CUDAGraphs
from tests.transforms.test_cudagraphs import simulated_graphs  # noqa: F401  (a fixture)

A, G, E, F_, C = (fulmen.Stage.ACQUIRED, fulmen.Stage.GRAD, fulmen.Stage.EXECUTION, fulmen.Stage.FINAL,
                  fulmen.Stage.CODEGEN)
CLEANUP = [(A, "DeadCodeElimination"), (A, "CommonSubexpressionElimination"), (A, "DeadCodeElimination")]
BACKWARD_CLEANUP = [(G, "DeadCodeElimination"), (G, "CommonSubexpressionElimination"), (G, "DeadCodeElimination")]
LOSS_AND_ATTENTION = [(A, "FuseLinearCrossEntropy"), (A, "GroupQueryAttention")]
CLAIM, DEL = [(E, "ClaimExecution")], [(C, "DeleteLastUsed")]


def _listed(jitted) -> list[tuple[fulmen.Stage, str]]:
    return [(step.stage, type(step.transform).__name__) for step in fulmen.pipeline(jitted).steps]


@pytest.mark.parametrize(("options", "expected"), [
    (fulmen.JitOptions(), CLEANUP + LOSS_AND_ATTENTION + BACKWARD_CLEANUP + CLAIM + DEL),
    # the backward's cleanup does not depend on JitOptions.cse (as before the pipeline was a list)
    (fulmen.JitOptions(cse=False, fuse_linear_cross_entropy=False, grouped_query_attention=False),
     CLEANUP[:1] + BACKWARD_CLEANUP + CLAIM + DEL),
    (fulmen.JitOptions(grouped_query_attention=False, cuda_graphs=True, offload=fulmen.OffloadOptions()),
     CLEANUP + LOSS_AND_ATTENTION[:1] + BACKWARD_CLEANUP + [(G, "OffloadTransform")] + CLAIM + DEL
     + [(C, "CUDAGraphs"), (C, "DeleteLastUsed")]),
], ids=["default", "cleanup_only", "graphs_and_offload"])
def test_the_default_list_names_every_builtin_pass_in_order(options, expected):
    jitted = fulmen.jit(torch.sin, options=options)
    assert _listed(jitted) == expected
    described = str(fulmen.pipeline(jitted)).splitlines()
    # one line per pass, and one for each stage's machinery (autodiff, the DDP / FSDP collectives)
    assert len(described) == len(expected) + 2
    assert [line.split()[0] for line in described if "stage machinery" not in line] == [s.value for s, _ in expected]
    assert all(cls in line for (_, cls), line in zip(expected, (d for d in described if "machinery" not in d)))


class Mark(fulmen.Transform):
    """Changes nothing but the provenance, at the stages it overrides (so that each shows in last_traces)."""

    def __init__(self, label: str, stages: tuple[str, ...]):
        self.label = label
        for stage in stages:
            setattr(self, f"transform_{stage}", getattr(self, f"_{stage}"))

    @property
    def name(self) -> str:
        return self.label

    def _acquired(self, trace):
        return trace.from_trace(f"{self.label}: acquired")

    def _forward(self, traces):
        return traces.forward.from_trace(f"{self.label}: forward")

    def _backward(self, traces):
        return traces.backward.from_trace(f"{self.label}: backward")

    def _final(self, trace, kind):
        return trace.from_trace(f"{self.label}: final {kind.value}")


def _attention_and_loss(q, k, v, w, target):
    """Attention over repeated key/value heads (the grouping pass declines on CPU, with its reason), and a
    cross-entropy of a linear (the fused loss)."""
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(0, 1).flatten(1)
    return F.cross_entropy(F.linear(h, w), target)


def _made_by(traces, steps: tuple[Step, ...]) -> list[int]:
    """For each trace but the first, the position in `steps` of the pass that made it (its provenance begins with the
    pass's name), each after the one before; autodiff's traces (`... (fulmen grad transform)`) map to -1."""
    positions, at = [], 0
    for trace in traces[1:]:
        if trace.provenance.endswith("(fulmen grad transform)"):
            positions.append(-1)
            continue
        while not trace.provenance.startswith(steps[at].transform.name):
            at += 1  # a pass that changed nothing; IndexError: the trace was made by no pass left in the list
        positions.append(at)
        at += 1
    return positions


def test_a_users_transforms_land_at_their_stages_among_the_builtin_passes():
    both = Mark("Both", ("acquired", "final"))
    grad = Mark("Grad", ("forward", "backward"))
    jitted = fulmen.jit(_attention_and_loss, executors=["torch"], transforms=[both, grad])
    steps = fulmen.pipeline(jitted).steps
    assert [(s.stage, s.transform.name) for s in steps if s.user] == [(A, "Both"), (G, "Grad"), (F_, "Both")]
    names = [(s.stage, type(s.transform).__name__) for s in steps]
    assert names == (CLEANUP + LOSS_AND_ATTENTION + [(A, "Mark")] + BACKWARD_CLEANUP + [(G, "Mark")] + CLAIM
                     + [(F_, "Mark")] + DEL)
    assert next(s for s in steps if s.transform is grad).hooks == ("transform_forward", "transform_backward")

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 6), torch.randn(2, 2, 8, 6), torch.randn(2, 2, 8, 6)
    w, target = torch.randn(10, 24, requires_grad=True), torch.randint(0, 10, (16,))
    loss = jitted(q, k, v, w, target)
    loss.backward()
    expected = _attention_and_loss(q, k, v, w, target)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(w.grad, torch.autograd.grad(expected, w)[0])

    forward = fulmen.last_traces(jitted)
    assert [t.provenance.split(":")[0] for t in forward] == [
        "Acquisition (fulmen.jit)", "Dead Code Elimination", "Common Subexpression Elimination",
        "Dead Code Elimination", "Fused linear + cross-entropy", "Grouped-query attention", "Both",
        "Forward (fulmen grad transform)", "Grad", "Transform for execution (torch)", "Both", "Delete Last Used"]
    assert "declined" in forward[5].provenance and "fused" in forward[4].provenance
    # steps: 0-2 the acquired cleanup, 3 the fused loss, 4 grouped attention, 5 Both, 6-8 the backward's cleanup,
    # 9 Grad, 10 the executors' claim, 11 Both, 12 `del` after last use
    assert _made_by(forward, steps) == [0, 1, 2, 3, 4, 5, -1, 9, 10, 11, 12]
    backward = fulmen.last_backward_traces(jitted)
    assert [t.provenance.split(":")[0] for t in backward] == [
        "Backward (fulmen grad transform)", "Dead Code Elimination", "Common Subexpression Elimination",
        "Dead Code Elimination", "Grad", "Transform for execution (torch)", "Both", "Delete Last Used"]
    assert _made_by(backward, steps[6:]) == [0, 1, 2, 3, 4, 5, 6]


def test_a_transform_of_fulmens_own_stages_is_refused_naming_it():
    class Late(fulmen.Transform):
        def transform_codegen(self, trace, kind, returned):
            return trace

    with pytest.raises(fulmen.TransformError, match=r"transform Late overrides transform_codegen: stage codegen is "
                                                    r"fulmen's own .* in transform_final instead"):
        fulmen.jit(torch.sin, transforms=[Late()])


def test_cuda_graphs_are_the_codegen_stages_last_passes(simulated_graphs):  # noqa: F811
    def f(x, w):
        return torch.tanh(x @ w).sum()

    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    graphed = fulmen.jit(f, executors=["torch"], options=fulmen.JitOptions(cuda_graphs=True))
    plain = fulmen.jit(f, executors=["torch"])
    for _ in range(3):
        graphed(x, w).backward()
    plain(x, w).backward()
    for graphed_traces, plain_traces in ((fulmen.last_traces(graphed), fulmen.last_traces(plain)),
                                         (fulmen.last_backward_traces(graphed), fulmen.last_backward_traces(plain))):
        # the same passes as without graphs, then CUDA graphs and `del` after last use again
        assert [t.provenance for t in graphed_traces] == [t.provenance for t in plain_traces] + [
            "CUDA graphs (1 regions)", "Delete Last Used"]
        assert str(graphed_traces[-3]) == str(plain_traces[-1])  # what runs while a graph's values are in use
    # each program gets a pool of its own; the jitted callable's list holds the pass without one
    assert isinstance(fulmen.pipeline(graphed).steps[-2].transform, CUDAGraphs)
    assert fulmen.pipeline(graphed).steps[-2].transform.pool is None
    pool = fulmen.last_traces(graphed)[-1].bound_symbols[0].sym.impl.pool
    assert [g.replays for g in simulated_graphs] == [2, 2] and pool.disabled is None


def test_a_program_that_cannot_have_graphs_runs_the_list_without_them():
    graphed = fulmen.jit(torch.sin, options=fulmen.JitOptions(cuda_graphs=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed(torch.randn(3))
    assert any("runs without CUDA graphs" in str(w.message) for w in caught)
    assert [t.provenance for t in fulmen.last_traces(graphed)][-2:] == ["Transform for execution (sdpa, torch)",
                                                                        "Delete Last Used"]
