"""Until the pretraining CLI lands: jit a tiny LitGPT model, check it against eager and print its trace."""

from __future__ import annotations

import argparse

import torch
from litgpt.config import Config
from litgpt.model import GPT

import fulmen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model_name", default="pythia-14m", help="a LitGPT config name")
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--print_depth", type=int, default=0, help="how many levels of prims to print as comments")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = Config.from_name(args.model_name, n_layer=args.n_layer)
    model = GPT(config).to(device).eval()
    jitted = fulmen.jit(model)
    idx = torch.randint(0, config.padded_vocab_size, (2, 16), device=device)
    with torch.no_grad():
        expected, actual = model(idx), jitted(idx)
    print(fulmen.last_traces(jitted)[-1].python(print_depth=args.print_depth))
    error = (actual - expected).abs().max().item()
    print(f"{args.model_name} ({args.n_layer} layers, {device}): max |fulmen - eager| = {error:.3g}")
    if error > 1e-4:
        raise SystemExit("fulmen's result differs from eager")


if __name__ == "__main__":
    main()
