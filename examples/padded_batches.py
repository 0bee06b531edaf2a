"""Finetuning on padded batches of every length, in one fulmen trace (symbolic sizes, issue 48).

    python -m examples.padded_batches [--model_name pythia-14m] [--n_layer 2] [--batches 16] [--device cpu]

Each batch holds sequences of random lengths padded to the batch's longest, as LitGPT's finetuning collate does:
the inputs padded with token 0, the labels with `ignore_index` (-100) so that the padding adds nothing to the loss.
So every batch has another length, and the last one is smaller. `fulmen.jit`'s default (`JitOptions(dynamic=None)`)
traces the first batch with static sizes, sees the length change on the second and traces once more with a
symbolic length that every later batch reuses; the batch size, known to change at the end of an epoch, is marked
dynamic on the first batch (`fulmen.mark_dynamic(input_ids, 0)`), so the smaller last batch needs no third trace:
two traces in all, where a compiler of one shape at a time makes one per length. The same steps run eagerly on a
copy of the model; the losses and final weights agree with eager's to float32 rounding (the jitted loss is fulmen's
fused linear + cross-entropy, which sums its chunks in another order).
"""

from __future__ import annotations

import argparse
import copy
import random

import torch
import torch.nn.functional as F
from litgpt import GPT, Config

import fulmen

IGNORE_INDEX = -100  # what LitGPT's finetuning puts on the labels of padding and prompt tokens


def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def padded_batch(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token labels of `sequences`, right-padded to the longest (inputs with 0, labels with
    IGNORE_INDEX)."""
    longest = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(sequences), longest, dtype=torch.long)
    labels = torch.full((len(sequences), longest), IGNORE_INDEX, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        inputs[row, : len(sequence) - 1] = sequence[:-1]
        labels[row, : len(sequence) - 1] = sequence[1:]
    return inputs, labels


def batches(config: Config, count: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` padded batches of sequences between 8 and the block size long; the last one is half as large."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        size = batch_size if index < count - 1 else max(1, batch_size // 2)
        sequences = [torch.randint(0, config.vocab_size, (rng.randint(8, config.block_size) + 1,), generator=generator)
                     for _ in range(size)]
        out.append(padded_batch(sequences))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name", default="pythia-14m")
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = Config.from_name(args.model_name, n_layer=args.n_layer, block_size=args.block_size)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = GPT(config).to(device)
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(loss_fn)
    # SGD keeps the two runs' weights as close as their grads are: Adam's first steps move a weight by about the
    # learning rate whatever the size of its grad, so a near-zero grad rounded apart would move it apart
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    losses: list[tuple[float, float]] = []
    data = batches(config, args.batches, args.batch_size, args.seed)
    for index, (input_ids, labels) in enumerate(data):
        input_ids, labels = input_ids.to(device), labels.to(device)
        if index == 0:
            fulmen.mark_dynamic(input_ids, 0)
            fulmen.mark_dynamic(labels, 0)
        step_losses = []
        for fn, m, optimizer in ((jitted, model, optimizers[0]), (loss_fn, reference, optimizers[1])):
            loss = fn(m, input_ids, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_losses.append(loss.item())
        losses.append((step_losses[0], step_losses[1]))
    same_weights = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                       for a, b in zip(model.parameters(), reference.parameters()))
    shapes = sorted({tuple(input_ids.shape) for input_ids, _ in data})
    result = {"traces": fulmen.cache_misses(jitted), "shapes": shapes, "losses": losses,
              "losses_close_to_eager": all(abs(a - b) <= 1e-5 * abs(b) for a, b in losses),
              "weights_close_to_eager": same_weights}
    print(f"{len(data)} padded batches of {len(shapes)} shapes: {result['traces']} traces; losses close to eager's: "
          f"{result['losses_close_to_eager']}; final weights close to eager's: {same_weights}")
    header = [line for line in str(fulmen.last_traces(jitted)[-1]).splitlines() if "input_ids" in line][:2]
    print("\n".join(header))
    return result


if __name__ == "__main__":
    main()
