"""Running PyTorch's own OpInfo samples (torch.testing._internal op_db) through fulmen.jit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.testing._internal.common_methods_invocations import op_db

import fulmen
from fulmen.core.symbol import Tag
from fulmen.ops import lookup

SAMPLES_PER_OP = 64
UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided"}

# Known limitations (never wrong results: fulmen raises a clear error for each), by sample id, and by OpInfo name
# for the samples that pass a tensor where the op reads its value to decide the output shape.
XFAIL: dict[str, str] = {
    "__getitem__-14": "indexing with a boolean mask is data-dependent (fulmen raises DataDependentError)",
}
XFAIL_TENSOR_ARGUMENT: dict[str, str] = {
    "narrow": "a start given as a tensor is data-dependent (its value sets the output shape)",
    "repeat_interleave": "tensor repeats without output_size are data-dependent",
    "tensor_split": "split indices given as a tensor are data-dependent",
}


@dataclass(frozen=True)
class Case:
    op_name: str  # OpInfo name, with its variant test name
    opinfo: object
    index: int
    sample: object

    @property
    def id(self) -> str:
        return f"{self.op_name}-{self.index}"

    @property
    def xfail_reason(self) -> str | None:
        if self.id in XFAIL:
            return XFAIL[self.id]
        values = (*self.sample.args, *self.sample.kwargs.values())
        if self.op_name in XFAIL_TENSOR_ARGUMENT and "output_size" not in self.sample.kwargs and any(
            isinstance(v, torch.Tensor) for v in values
        ):
            return XFAIL_TENSOR_ARGUMENT[self.op_name]
        return None


def supported_opinfos() -> list:
    chosen = []
    for opinfo in op_db:
        binding = lookup(opinfo.op)
        if binding is None or binding.symbol.tags & Tag.RANDOM:
            continue
        if torch.float32 not in opinfo.supported_dtypes("cpu"):
            continue
        chosen.append(opinfo)
    return chosen


def cases() -> Iterator[Case]:
    for opinfo in supported_opinfos():
        name = opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")
        samples = opinfo.sample_inputs("cpu", torch.float32, requires_grad=False)
        for index, sample in enumerate(samples):
            if index >= SAMPLES_PER_OP:
                break
            yield Case(name, opinfo, index, sample)


def run_case(case: Case) -> None:
    op, sample = case.opinfo.op, case.sample

    def program(inp, args, kwargs):
        return op(inp, *args, **kwargs)

    expected = program(sample.input, sample.args, sample.kwargs)
    actual = fulmen.jit(program)(sample.input, sample.args, sample.kwargs)
    if case.opinfo.name in UNINITIALIZED:  # values are undefined: compare what is defined
        assert (actual.shape, actual.dtype, actual.device) == (expected.shape, expected.dtype, expected.device)
        return
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=1e-5, atol=1e-5)
