"""Train the reference GPT-2 eagerly and under fulmen with the llm.c executor, and compare.

    python -m examples.llmc.train                 # from the repository root, on a CUDA GPU
    python -m examples.llmc.train --steps 20 --n-layer 4

Both models start from the same random initialisation and overfit the same random batch with Adam; the losses
should agree step by step. It then lists which llm.c kernel operators the final forward and backward traces call,
and times a training step (forward, backward, Adam) eagerly, under fulmen with llm.c, and under fulmen's default
executors.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Sequence

import torch

import fulmen
from examples.llmc.model import GPT, GPTConfig

StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def build_model(config: GPTConfig, seed: int, device: torch.device | str) -> GPT:
    """A randomly initialised GPT; the same seed gives the same weights."""
    torch.manual_seed(seed)
    return GPT(config).to(device).train()


def random_batch(
    vocab_size: int, B: int, T: int, seed: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets cut from one random token stream, like a language-modelling batch."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (B, T + 1), generator=generator)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def train_losses(
    step_fn: StepFn, params: Iterable[torch.nn.Parameter], x: torch.Tensor, y: torch.Tensor, steps: int, lr: float
) -> list[float]:
    """Runs `steps` Adam steps on one batch and returns the loss of each."""
    optimizer = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        _, loss = step_fn(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def ms_per_step(
    step_fn: StepFn,
    params: Iterable[torch.nn.Parameter],
    x: torch.Tensor,
    y: torch.Tensor,
    warmup: int,
    iters: int,
    lr: float,
) -> float:
    """Mean wall time of a training step (forward, backward, Adam), after `warmup` untimed steps."""
    optimizer = torch.optim.Adam(params, lr=lr)

    def step() -> None:
        _, loss = step_fn(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    _synchronize(x.device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _synchronize(x.device)
    return (time.perf_counter() - start) * 1000 / max(iters, 1)


def symbol_names(jitted: fulmen.JittedModule) -> set[str]:
    """Names of the symbols the last call's final forward and backward traces call."""
    traces = [fulmen.last_traces(jitted)[-1]]
    backward = fulmen.last_backward_traces(jitted)
    if backward:
        traces.append(backward[-1])
    return {bsym.sym.name for trace in traces for bsym in trace.bound_symbols}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-B", "--batch-size", type=int, default=4)
    parser.add_argument("-T", "--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="Adam steps of the eager/llm.c comparison")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--timing-iters", type=int, default=20, help="timed steps per variant (0 skips timing)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (default); cpu runs everything through torch: the llm.c checkers decline")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the llm.c kernels need one (pass --device cpu to see the fallback)")
    # Imported here, after the device check: registering the executor needs fulmen's extend API, not a GPU.
    from examples.llmc.executor import LLMC_SYMBOLS, llmc_executor

    config = GPTConfig(block_size=args.seq_len, vocab_size=args.vocab_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    print(f"GPT {config}, B={args.batch_size}, T={args.seq_len}, device={device}")
    x, y = random_batch(config.vocab_size, args.batch_size, args.seq_len, args.seed, device)

    eager = build_model(config, args.seed, device)
    llmc_model = build_model(config, args.seed, device)
    llmc_jitted = fulmen.jit(llmc_model, executors=[llmc_executor])

    eager_losses = train_losses(eager, eager.parameters(), x, y, args.steps, args.lr)
    llmc_losses = train_losses(llmc_jitted, llmc_model.parameters(), x, y, args.steps, args.lr)
    print(f"\n{'step':>4}  {'eager':>12}  {'fulmen+llm.c':>12}  {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(eager_losses, llmc_losses)):
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>9.2e}")
    print(f"max |diff| {max(abs(a - b) for a, b in zip(eager_losses, llmc_losses)):.2e}")

    seen = symbol_names(llmc_jitted) & LLMC_SYMBOLS
    listed = ", ".join(sorted(seen)) or "none"
    print(f"\nllm.c kernel operators in the final traces ({len(seen)}/{len(LLMC_SYMBOLS)}): {listed}")
    missing = LLMC_SYMBOLS - seen
    if missing:
        print(f"not used: {', '.join(sorted(missing))}")

    if args.timing_iters > 0:
        default_model = build_model(config, args.seed, device)
        default_jitted = fulmen.jit(default_model)
        variants = [
            ("eager", eager, eager.parameters()),
            ("fulmen + llm.c", llmc_jitted, llmc_model.parameters()),
            ("fulmen default", default_jitted, default_model.parameters()),
        ]
        print(f"\nms per training step (forward, backward, Adam), mean of {args.timing_iters}:")
        for name, step_fn, params in variants:
            ms = ms_per_step(step_fn, params, x, y, args.warmup, args.timing_iters, args.lr)
            print(f"  {name:<16} {ms:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
