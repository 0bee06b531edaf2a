"""Host overhead on small CPU tensors, where the host is all there is to time.

    python benchmarks/overhead.py [--out benchmarks/overhead.json]

* A cache hit: a jitted `a + b` against eager and torch.compile (Lightning Thunder too when it imports).
* A fusion region's call: what a trace's `TorchCompileN` region costs per call when Inductor's compiled graph is
  called directly (`fulmen.core.inductor.Variant.direct`), through AOTAutograd's runtime wrappers, and as a
  `torch.compile`d function (Dynamo's guards on top).

Reports per-call microseconds (median of repeated timing runs) and what each adds over eager.
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
from fulmen.core.inductor import InductorFunction


def add(a, b):
    return a + b


REGION = "a fusion region's call, (tanh(x) * w + b).softmax(-1) and .sum(0) on 8x16 CPU tensors"


def region(x, w, b):
    y = torch.tanh(x) * w + b
    return y.softmax(-1), y.sum(0)


def per_call_us(fn: Callable, *args: torch.Tensor, number: int = 20000, repeat: int = 7) -> float:
    for _ in range(100):
        fn(*args)
    runs = timeit.repeat(lambda: fn(*args), number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def region_calls() -> dict[str, Callable]:
    """The ways a fusion region can be called; the two `InductorFunction` rows share one compiled variant."""
    compiled = InductorFunction(region)
    x, w, b = region_inputs()
    compiled(x, w, b)
    (variant,) = compiled.variants.values()
    if variant.direct is None:
        raise RuntimeError(f"the region was expected to be called directly: {variant.why_wrapped}")
    return {"eager": region, "torch.compile": torch.compile(region, dynamic=False),
            "inductor, AOTAutograd wrappers": variant.wrapped, "inductor, direct (fulmen)": variant}


def region_inputs() -> tuple[torch.Tensor, ...]:
    return torch.randn(8, 16), torch.randn(16), torch.randn(8, 1)


def measure(candidates: dict[str, Callable], *args: torch.Tensor) -> dict[str, float]:
    results = {}
    for name, fn in candidates.items():
        try:
            results[name] = per_call_us(fn, *args)
        except Exception as error:  # noqa: BLE001
            print(f"{name} failed: {type(error).__name__}: {error}")
    eager = results["eager"]
    print(f"{'':32}{'us/call':>10}{'added us':>10}{'x eager':>9}")
    for name, us in results.items():
        print(f"{name:32}{us:10.2f}{us - eager:10.2f}{us / eager:9.2f}")
    return results


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
    results = measure(candidates, a, b)
    eager = results["eager"]
    print(f"{REGION}:")
    regions = measure(region_calls(), *region_inputs())
    report = {
        "benchmark": "host overhead of a cache hit, a + b on 4-element CPU tensors",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "us_per_call": results,
        "added_us_over_eager": {k: v - eager for k, v in results.items()},
        "region_call": {
            "benchmark": REGION,
            "us_per_call": regions,
            "added_us_over_eager": {k: v - regions["eager"] for k, v in regions.items()},
        },
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
