"""Host overhead of a cache hit: a jitted `a + b` on small CPU tensors against eager and torch.compile.

    python benchmarks/overhead.py [--out benchmarks/overhead.json]

Reports per-call microseconds (median of repeated timing runs) and the overhead fulmen adds over eager.
Lightning Thunder is measured too when it imports.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import timeit
from collections.abc import Callable

import torch

import fulmen


def add(a, b):
    return a + b


def per_call_us(fn: Callable, a: torch.Tensor, b: torch.Tensor, number: int = 20000, repeat: int = 7) -> float:
    for _ in range(100):
        fn(a, b)
    runs = timeit.repeat(lambda: fn(a, b), number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/overhead.json")
    args = parser.parse_args()
    a, b = torch.randn(4), torch.randn(4)
    candidates: dict[str, Callable] = {"eager": add, "fulmen": fulmen.jit(add)}
    try:
        candidates["torch.compile"] = torch.compile(add)
    except Exception as error:  # noqa: BLE001 - reported, not fatal
        print(f"torch.compile unavailable: {error}")
    try:
        import thunder  # optional

        candidates["thunder"] = thunder.jit(add)
    except Exception as error:  # noqa: BLE001 - Thunder is optional and often fails to import
        print(f"Lightning Thunder unavailable: {type(error).__name__}: {error}")
    results = {}
    for name, fn in candidates.items():
        try:
            results[name] = per_call_us(fn, a, b)
        except Exception as error:  # noqa: BLE001
            print(f"{name} failed: {type(error).__name__}: {error}")
    eager = results["eager"]
    print(f"{'':16}{'us/call':>10}{'added us':>10}{'x eager':>9}")
    for name, us in results.items():
        print(f"{name:16}{us:10.2f}{us - eager:10.2f}{us / eager:9.2f}")
    report = {
        "benchmark": "host overhead of a cache hit, a + b on 4-element CPU tensors",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "us_per_call": results,
        "added_us_over_eager": {k: v - eager for k, v in results.items()},
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
