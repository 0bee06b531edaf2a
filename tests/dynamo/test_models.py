"""Models Dynamo inlines, trained through the `fulmen.dynamo` backend for a few AdamW steps: losses, grads and
parameters against eager on the same batches (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

import fulmen

litgpt = pytest.importorskip("litgpt")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_litgpt_trains_as_eager_with_dynamic_sequence_lengths():
    # dynamic=True makes RMSNorm's eps and the attention scale tensor inputs read back with .item(): each read cut
    # the graph (17 pieces for two layers), and the default Inductor fallback failed on them
    config = litgpt.Config(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, padded_vocab_size=32,
                           bias=False, n_query_groups=1, rotary_percentage=1.0, mlp_class_name="LLaMAMLP",
                           intermediate_size=24, norm_class_name="RMSNorm")
    torch.manual_seed(0)
    model = litgpt.GPT(config)
    eager = copy.deepcopy(model)
    backend = fulmen.dynamo.backend(fallback="eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    for length in (6, 4, 7):
        idx = torch.randint(0, 32, (2, length), generator=torch.Generator().manual_seed(length))
        losses = []
        for run in (eager, compiled):
            loss = torch.nn.functional.cross_entropy(run(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
        for theirs, mine in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for theirs, mine in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    assert [piece.runs_by for piece in backend.pieces] == ["eager", "fulmen"]
