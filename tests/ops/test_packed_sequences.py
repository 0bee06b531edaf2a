"""pack_padded_sequence into a recurrent layer and pad_packed_sequence back, against eager: outputs (and their
strides), final states, the lengths, and the grads of the input and every weight, bit for bit; lengths given as a
Python list (the trace holds for those lengths); lengths given as a tensor refused, naming the line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fulmen


def _packed(rnn: nn.Module, enforce_sorted: bool, with_state: bool = False):
    def program(x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
        if with_state:  # a state given in the padded batch's order: permuted into the packed order, and back
            state = torch.ones(rnn.num_layers, x.shape[0], rnn.hidden_size)
            out, last = rnn(packed, (state, state * 2))
        else:
            out, last = rnn(packed)
        padded, lengths_out = pad_packed_sequence(out, batch_first=True, padding_value=-1.0, total_length=7)
        return padded, last[0] if isinstance(last, tuple) else last, lengths_out

    return program


LAYERS = {
    "lstm": lambda: nn.LSTM(4, 5, batch_first=True),
    "lstm_projections": lambda: nn.LSTM(4, 5, batch_first=True, proj_size=3),
    "gru_bidirectional_2_layers": lambda: nn.GRU(4, 5, num_layers=2, bidirectional=True, batch_first=True),
    "rnn": lambda: nn.RNN(4, 5, batch_first=True),
}


@pytest.mark.parametrize("enforce_sorted", [True, False])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_packed_batch_gives_eagers_outputs_states_and_grads(name, enforce_sorted):
    torch.manual_seed(0)
    eager = LAYERS[name]()
    ours = copy.deepcopy(eager)
    jitted = fulmen.jit(_packed(ours, enforce_sorted))
    for lengths in ([6, 3, 2], [6, 3, 2], [5, 5, 1]) if enforce_sorted else ([2, 6, 3], [4, 1, 6]):
        x = torch.randn(3, 6, 4)
        want_in, got_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = _packed(eager, enforce_sorted)(want_in, lengths), jitted(got_in, lengths)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.stride() == w.stride() and torch.equal(g, w)
        (want[0].square().sum() + want[1].sum()).backward()
        (got[0].square().sum() + got[1].sum()).backward()
        assert torch.equal(got_in.grad, want_in.grad)
        for p, q in zip(eager.parameters(), ours.parameters()):
            assert torch.equal(q.grad, p.grad)
    assert fulmen.cache_misses(jitted) == 2  # a trace per list of lengths


def test_an_initial_state_is_permuted_as_eager_does():
    torch.manual_seed(0)
    eager = nn.LSTM(4, 5, batch_first=True)
    ours = copy.deepcopy(eager)
    x, lengths = torch.randn(3, 6, 4), [2, 6, 3]
    want = _packed(eager, False, with_state=True)(x, lengths)
    got = fulmen.jit(_packed(ours, False, with_state=True))(x, lengths)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_lengths_given_as_a_tensor_are_refused_naming_the_line():
    rnn = nn.LSTM(4, 5, batch_first=True)
    x, lengths = torch.randn(3, 6, 4), torch.tensor([6, 3, 2])
    _packed(rnn, True)(x, lengths)  # eager reads them
    with pytest.raises(
        fulmen.DataDependentError,
        match=r"(?s)pack_padded_sequence.*lengths' values.*Python list.*"
        r"test_packed_sequences\.py",
    ):
        fulmen.jit(_packed(rnn, True))(x, lengths)


def test_eagers_error_for_unsorted_lengths():
    rnn = nn.LSTM(4, 5, batch_first=True)
    x = torch.randn(3, 6, 4)
    with pytest.raises(RuntimeError, match="must be sorted in decreasing order") as eager:
        _packed(rnn, True)(x, [2, 6, 3])
    with pytest.raises(RuntimeError) as ours:
        fulmen.jit(_packed(rnn, True))(x, [2, 6, 3])
    assert str(ours.value).splitlines()[0] == str(eager.value)
