"""Recurrent layers (`nn.RNN`, `nn.LSTM`, `nn.GRU` and their cells) with eager's grads (`eager_grads`), and the
packing of padded sequences they take (`pack_padded_sequence`, `pad_packed_sequence`).

A whole-sequence op with dropout between layers draws masks in training: recomputing it for the backward would
draw others, so such calls are refused (the cells and the layers without dropout are deterministic).

Packing reads the lengths' values (the packed data has one row per step of each sequence): acquisition answers
`torch._pack_padded_sequence` and `torch._pad_packed_sequence` with `pack_padded` and `pad_packed` below where they are
known while tracing (lengths given as a Python list, so the trace holds for those lengths), as gathers and scatters of
those rows; the packed `batch_sizes` are then known too, so the layer's reads of them (`int(batch_sizes[0])`) are
answered as eager answers them.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.errors import UnsupportedOpError
from fulmen.core.source import user_location
from fulmen.ops.rules.eager import eager_op


def _dropout_refusal(name: str) -> Any:
    def refuse(*args: Any) -> str | None:
        # (input, hx, params, has_biases, num_layers, dropout, train, ...), or for a PackedSequence (data,
        # batch_sizes, hx, ...): batch_sizes is the only int64 tensor in second place
        packed = isinstance(args[1], torch.Tensor) and args[1].dtype == torch.int64
        dropout, train = args[5 + packed], args[6 + packed]
        if train and dropout > 0:
            return (f"fulmen cannot trace torch.{name} with dropout={dropout} in training: its backward recomputes "
                    "the layer, which would draw other dropout masks than the forward's; set dropout=0 (or put "
                    "nn.Dropout between single-layer modules), or keep the module outside the jitted function")
        return None

    return refuse


def _recurrent_like(fn: Any) -> Any:
    """The outputs of a whole-sequence op on meta tensors: the op itself, but for a PackedSequence (data, batch_sizes,
    hx, ...), whose kernels read batch_sizes: its output has a row per packed row, its states the shapes of hx."""

    def like(*args: Any) -> Any:
        packed = isinstance(args[1], torch.Tensor) and args[1].dtype == torch.int64
        if not packed:
            return fn(*args)
        data, _, hx, bidirectional = args[0], args[1], args[2], args[8]
        states = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
        output = data.new_empty((data.shape[0], states[0].shape[-1] * (2 if bidirectional else 1)))
        return (output, *(torch.empty_like(state) for state in states))

    return like


for _name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
    eager_op(getattr(torch, _name), refuse=_dropout_refusal(_name), like=_recurrent_like(getattr(torch, _name)))
for _fn in (torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell):
    eager_op(_fn)


def _rows(batch_sizes: list[int], batch: int) -> list[int]:
    """The packed rows' positions among the (time, batch) rows of the padded sequences: time step by time step."""
    return [step * batch + row for step, size in enumerate(batch_sizes) for row in range(size)]


def pack_padded(input: torch.Tensor, lengths: list[int], batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
    """`torch._pack_padded_sequence(input, lengths, batch_first)` for known `lengths`: the steps of each sequence,
    time step by time step (eager's order), gathered from the padded input, and how many sequences each step has.
    Eager's errors for lengths it refuses; lengths past the input's steps (eager packs rows of no sequence there)
    are refused."""
    steps = input.transpose(0, 1) if batch_first else input
    time, batch = steps.shape[0], steps.shape[1]
    if input.numel() == 0:
        raise RuntimeError("Cannot pack empty tensors.")
    if len(lengths) != batch:
        raise RuntimeError(f"Expected `len(lengths)` to be equal to batch_size, but got {len(lengths)} (batch_size="
                           f"{batch})")
    if lengths[-1] <= 0:
        raise RuntimeError("Length of all samples has to be greater than 0, but found an element in 'lengths' that is "
                           "<= 0")
    if any(later > earlier for earlier, later in zip(lengths, lengths[1:])):
        raise RuntimeError("`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. You can "
                           "pass `enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to sidestep this "
                           "requirement if you do not need ONNX exportability.")
    if lengths[0] > time:
        raise UnsupportedOpError(f"fulmen cannot trace pack_padded_sequence with a length ({lengths[0]}) past the "
                                 f"sequences' {time} steps: eager packs rows of no sequence there", user_location())
    batch_sizes = [sum(1 for length in lengths if length > step) for step in range(lengths[0])]
    index = torch.tensor(_rows(batch_sizes, batch), device=input.device)
    data = steps.reshape(time * batch, *steps.shape[2:]).index_select(0, index)
    return data, torch.tensor(batch_sizes)


def pad_packed(data: torch.Tensor, batch_sizes: list[int], batch_first: bool, padding_value: float,
               total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch._pad_packed_sequence` for known `batch_sizes`: eager's padded (time, batch, ...) tensor filled with
    `padding_value` and the packed rows scattered in (transposed for `batch_first`, a view as eager's), and each
    sequence's length."""
    time, batch = len(batch_sizes), batch_sizes[0]
    if total_length > 0:
        if total_length < time:
            raise RuntimeError(f"Expected total_length to be at least the length of the longest sequence in input, "
                               f"but got total_length={total_length} and max sequence length being {time}")
        time = total_length
    index = torch.tensor(_rows(batch_sizes, batch), device=data.device)
    padded = torch.full((time * batch, *data.shape[1:]), padding_value, dtype=data.dtype, device=data.device)
    padded = padded.index_copy(0, index, data).reshape(time, batch, *data.shape[1:])
    lengths = torch.tensor([sum(1 for size in batch_sizes if size > row) for row in range(batch)])
    return padded.transpose(0, 1) if batch_first else padded, lengths
