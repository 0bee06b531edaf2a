"""Printed traces: valid Python with type comments, prims at a chosen depth, provenance, exec round trip."""

from __future__ import annotations

import torch
from litgpt.config import Config
from litgpt.model import GPT

import fulmen
from fulmen.executors.sdpa import sdpa


def _llama():
    torch.manual_seed(0)
    config = Config.from_name("Llama-3.1-8B", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                              intermediate_size=96, padded_vocab_size=96, vocab_size=96, block_size=32)
    return GPT(config).eval()


def test_printed_trace_round_trips_through_exec():
    model = _llama()
    jitted = fulmen.jit(model)
    idx = torch.randint(0, 96, (2, 7))
    expected = jitted(idx)
    trace = fulmen.last_traces(jitted)[-1]
    namespace: dict = dict(sdpa.operators)  # the executor's operators the trace names (its attention kernels)
    exec(trace.python(), namespace)  # noqa: S102 - the point of the test
    inputs = [idx] + [source.fetch() for source in jitted._jit._module_inputs]
    # With parameters that require grad this is the forward trace: the output, then what it saves for backward.
    result, *saved = namespace["computation"](*inputs)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert len(saved) == len(fulmen.last_traces(jitted)[-1].output) - 1 > 0


def test_trace_text_has_type_comments_sources_and_provenance():
    model = _llama()
    jitted = fulmen.jit(model)
    jitted(torch.randint(0, 96, (2, 7)))
    traces = fulmen.last_traces(jitted)
    provenances = [t.python().splitlines()[0] for t in traces]
    assert provenances[0] == "# Constructed by Acquisition (fulmen.jit)"
    assert provenances[-1] == "# Constructed by Delete Last Used"
    final = traces[-1].python()
    assert "sdpa_cpu_flash_forward(" in final  # attention by the kernel eager runs, claimed by the sdpa executor
    assert "# sdpa_cpu_flash_forward: from executor 'sdpa'" in final
    assert '# t_transformer_wte_weight: "cpu f32[96, 64]"' in final
    assert "model.py:" in final  # the user's source lines head each group of statements
    assert "del " in final
    compile(final, "<trace>", "exec")


def test_prims_print_as_comments_at_depth():
    def f(x, w):
        return torch.nn.functional.linear(x, w).softmax(-1)

    jitted = fulmen.jit(f)
    jitted(torch.randn(2, 3), torch.randn(4, 3))
    acquired = fulmen.last_traces(jitted)[0]
    shallow, deep = acquired.python(print_depth=0), acquired.python(print_depth=2)
    assert "prims." not in shallow
    assert "# t" in deep and "prims.matmul(" in deep and "prims.exp(" in deep and "prims.amax(" in deep


def test_prim_level_execution_matches_eager():
    """Flattening every symbol to its prims gives the same values: the decompositions are right."""
    from fulmen.core.trace import Trace

    model = _llama()
    jitted = fulmen.jit(model)
    idx = torch.randint(0, 96, (2, 7))
    expected = model(idx)
    jitted(idx)
    acquired = fulmen.last_traces(jitted)[0]

    def flatten(bsyms):
        for bsym in bsyms:
            if bsym.subsymbols:
                yield from flatten(bsym.subsymbols)
            else:
                yield bsym

    flat = acquired.from_trace("prims only", bound_symbols=list(flatten(acquired.bound_symbols)))
    assert isinstance(flat, Trace)
    inputs = [idx] + [source.fetch() for source in jitted._jit._module_inputs]
    (result,) = flat.python_callable()(*inputs)
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)


def test_dce_and_cse_apply():
    def f(x):
        unused = x.exp()  # noqa: F841
        return x.sin() + x.sin()

    jitted = fulmen.jit(f)
    jitted(torch.randn(3))
    final = fulmen.last_traces(jitted)[-1].python()
    assert "exp" not in final
    assert final.count("torch.sin(") == 1


def test_the_ir_modules_import_by_their_dotted_names():
    import types

    import fulmen.core.codegen as codegen

    assert isinstance(fulmen.core, types.ModuleType) and fulmen.core.codegen is codegen
