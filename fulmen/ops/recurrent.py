"""Recurrent layers (`nn.RNN`, `nn.LSTM`, `nn.GRU` and their cells) with eager's grads (`eager_grads`).

A whole-sequence op with dropout between layers draws masks in training: recomputing it for the backward would
draw others, so such calls are refused (the cells and the layers without dropout are deterministic).
"""

from __future__ import annotations

from typing import Any

import torch

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


for _name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
    eager_op(getattr(torch, _name), refuse=_dropout_refusal(_name))
for _fn in (torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell):
    eager_op(_fn)
