"""examples/padded_batches.py: LitGPT finetuning on padded batches of 13 shapes in two fulmen traces, losses and
weights against the same steps run eagerly."""

from __future__ import annotations

from examples import padded_batches


def test_padded_batches_of_every_length_train_in_two_traces_as_eager():
    result = padded_batches.main(["--batches", "6", "--n_layer", "1"])
    assert len(result["shapes"]) >= 4 and len({batch for batch, _ in result["shapes"]}) == 2
    assert result["traces"] == 2
    assert result["losses_close_to_eager"] and result["weights_close_to_eager"]
