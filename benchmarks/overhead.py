"""Host overhead on small CPU tensors, where the host is all there is to time.

    python benchmarks/overhead.py [--rows all|small|deep] [--out benchmarks/overhead.json]
    python benchmarks/overhead.py --rows deep --out benchmarks/overhead_cpu.json   # the deep thin model alone

* A cache hit: a jitted `a + b` against eager and torch.compile (Lightning Thunder too when it imports).
* A fusion region's call: what a trace's `TorchCompileN` region costs per call when Inductor's compiled graph is
  called directly (`fulmen.core.inductor.Variant.direct`), through AOTAutograd's runtime wrappers, and as a
  `torch.compile`d function (Dynamo's guards on top).
* A deep, thin LitGPT model (issue 50; TinyLlama's architecture, 22 layers of width 64, B=2, T=32, float32, one
  intra-op thread), where a step's host work grows with the number of ops and little else happens: eager,
  torch.compile and fulmen (`fulmen.jit(model)`), the forward alone (grad recorded, as in training) and the
  forward + backward; then where fulmen's host time goes in one forward + backward (cProfile, its time split by
  where each call is made from: guard check and cache lookup, input flattening and module tensor fetch, the
  generated forward, the autograd.Function bridge, the generated backward, per-op Python wrappers), and the exact
  number of Python-level calls (sys.setprofile: Python frames and C functions called from Python) of one forward
  and one backward.

Reports per-call microseconds (median of repeated timing runs) and what each adds over eager. The deep rows give
milliseconds per call as the median and the minimum over `--repeats` runs of `--number` calls, the candidates
interleaved run by run, by the wall clock and by the thread's CPU time: on a machine whose cores are shared the
minimum and the CPU time are the steadier readings. cProfile slows Python frames more than C calls, so the
breakdown's shares overstate the Python parts; the call counts are exact.
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

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


# --- the deep, thin model (issue 50) --------------------------------------------------------------------------------
DEEP = "a deep, thin LitGPT model: tiny-llama-1.1b's architecture, {layers} layers of width 64, B=2, T=32, float32"
DEEP_COMPILERS = ("eager", "torch.compile", "fulmen")
# Where fulmen's host time goes, by where the time is spent; a C function's time goes to what called it (a torch op
# called by the generated backward is the backward's)
BREAKDOWN = ("guard check and cache lookup", "input flattening and module tensors", "generated forward",
             "autograd.Function bridge", "generated backward", "per-op Python wrappers", "other")


def deep_model(layers: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from litgpt import GPT, Config  # only these rows need LitGPT

    config = Config.from_name("tiny-llama-1.1b", n_layer=layers, n_embd=64, n_head=4, n_query_groups=2,
                              head_size=16, intermediate_size=176, padded_vocab_size=256, vocab_size=256,
                              block_size=64)
    torch.manual_seed(0)
    return GPT(config), torch.randint(0, 256, (2, 32))


def clocked_ms(candidates: dict[str, Callable[[], Any]], number: int, repeats: int) -> dict[str, dict[str, float]]:
    """Milliseconds per call of each candidate: median and minimum over `repeats` runs of `number` calls, the
    candidates taking turns run by run, by the wall clock and by this thread's CPU time."""
    wall: dict[str, list[float]] = {name: [] for name in candidates}
    cpu: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(number):
                fn()
            cpu[name].append((time.thread_time() - start_cpu) / number * 1e3)
            wall[name].append((time.perf_counter() - start_wall) / number * 1e3)
    return {name: {"median_ms": statistics.median(wall[name]), "min_ms": min(wall[name]),
                   "cpu_median_ms": statistics.median(cpu[name]), "cpu_min_ms": min(cpu[name])}
            for name in candidates}


def _category(code: tuple[str, int, str]) -> str | None:
    """The breakdown's part for the time spent in a Python function's own frame; None for a C function, whose time
    goes to its caller's part."""
    filename, _, name = code
    if filename == "~":
        return None
    path = filename.replace("\\", "/")
    if filename.startswith("<fulmen trace"):
        return "generated backward" if name == "backward" else "generated forward"
    if filename.startswith("<fulmen guards") or any(part in path for part in (
            "fulmen/observation/", "fulmen/jit/trace_cache.py", "fulmen/jit/dynamic_shapes.py")):
        return "guard check and cache lookup"
    if "fulmen/jit/" in path or "fulmen/core/pytree.py" in path:
        return "input flattening and module tensors"
    if "fulmen/runtime/" in path or "torch/autograd/" in path or path.endswith("torch/_tensor.py") and \
            name == "backward":
        return "autograd.Function bridge"
    if any(part in path for part in ("fulmen/ops/", "fulmen/executors/", "fulmen/core/symbol.py", "torch/_ops.py",
                                     "torch/nn/functional.py", "torch/functional.py", "torch/_tensor.py",
                                     "torch/_VF.py", "torch/overrides.py")):
        return "per-op Python wrappers"
    return "other"


def host_breakdown(step: Callable[[], Any], calls: int) -> dict[str, float]:
    """Milliseconds per call of `step` in each part of `BREAKDOWN`, from cProfile's time per function and caller."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        step()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    parts = dict.fromkeys(BREAKDOWN, 0.0)
    for code, (_, _, own, _, callers) in stats.items():
        category = _category(code)
        if category is not None:
            parts[category] += own
            continue
        if not callers:  # the profiler's own switch
            parts["other"] += own
        for caller, (_, _, from_caller, _) in callers.items():
            parts[_category(caller) or "other"] += from_caller
    return {part: seconds / calls * 1e3 for part, seconds in parts.items()}


def python_calls(fn: Callable[[], Any]) -> dict[str, int]:
    """The Python-level calls `fn()` makes, counted by sys.setprofile: Python frames and C functions."""
    events: collections.Counter = collections.Counter()

    def count(frame: Any, event: str, arg: Any) -> None:
        events[event] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"python_frames": events["call"], "c_functions": events["c_call"]}


def _trace_calls(jitted: Callable) -> dict[str, int]:
    """The calls (statements other than `del`) of the forward and backward traces fulmen runs."""
    def calls(trace: Any) -> int:
        return sum(1 for bsym in trace.bound_symbols if bsym.sym.name != "del")

    return {"forward": calls(fulmen.last_traces(jitted)[-1]),
            "backward": calls(fulmen.last_backward_traces(jitted)[-1])}


def deep_rows(layers: int, compilers: tuple[str, ...], number: int, repeats: int, profiled: int) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host's work per step, not how it spreads over shared cores
    try:
        return _deep_rows(layers, compilers, number, repeats, profiled)
    finally:
        torch.set_num_threads(threads)


def _deep_rows(layers: int, compilers: tuple[str, ...], number: int, repeats: int, profiled: int) -> dict[str, Any]:
    model, x = deep_model(layers)
    cotangent = torch.randn(2, 32, 256, generator=torch.Generator().manual_seed(1))
    expected = model(x)
    expected.backward(cotangent)
    grads = [p.grad.clone() for p in model.parameters()]
    models: dict[str, Callable] = {}
    agreement: dict[str, Any] = {}
    for name in compilers:
        if name == "eager":
            models[name] = model
            continue
        try:
            copied = copy.deepcopy(model)
            copied.zero_grad(set_to_none=True)
            compiled = torch.compile(copied) if name == "torch.compile" else fulmen.jit(copied)
            out = compiled(x)  # compiled here, before any timing
            out.backward(cotangent)
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            print(f"{name} failed: {type(error).__name__}: {error}")
            continue
        models[name] = compiled
        agreement[name] = {"output_equal": torch.equal(out, expected), "grads_equal": all(
            torch.equal(p.grad, g) for p, g in zip(copied.parameters(), grads))}
    for fn in models.values():
        for _ in range(3):
            fn(x).backward(cotangent)
    timed = {
        "forward": clocked_ms({name: (lambda fn=fn: fn(x)) for name, fn in models.items()}, number, repeats),
        "forward+backward": clocked_ms({name: (lambda fn=fn: fn(x).backward(cotangent)) for name, fn in models.items()},
                                       number, repeats),
    }
    print(f"{DEEP.format(layers=layers)}, ms per call (wall median / min, thread CPU min):")
    for row, results in timed.items():
        for name, r in results.items():
            print(f"  {row:18}{name:15}{r['median_ms']:9.2f}{r['min_ms']:9.2f}{r['cpu_min_ms']:9.2f}")
    report: dict[str, Any] = {
        "benchmark": DEEP.format(layers=layers) + ", one intra-op thread",
        "timing": f"{repeats} runs of {number} calls per candidate, taking turns; median and min per call",
        "ms_per_call": timed,
        "agrees_with_eager": agreement,
    }
    if "fulmen" in models and "eager" in models:
        report["fulmen_over_eager"] = {row: {clock: results["fulmen"][clock] / results["eager"][clock]
                                             for clock in ("median_ms", "min_ms", "cpu_min_ms")}
                                       for row, results in timed.items()}
    if "fulmen" in models:
        jitted = models["fulmen"]
        breakdown = host_breakdown(lambda: jitted(x).backward(cotangent), profiled)
        out = jitted(x)
        report["fulmen_host_breakdown_ms"] = breakdown
        report["python_calls"] = {"fulmen forward": python_calls(lambda: jitted(x)),
                                  "fulmen backward": python_calls(lambda: out.backward(cotangent))}
        eager_out = model(x)
        report["python_calls"]["eager forward"] = python_calls(lambda: model(x))
        report["python_calls"]["eager backward"] = python_calls(lambda: eager_out.backward(cotangent))
        report["fulmen_trace_calls"] = _trace_calls(jitted)
        print("  fulmen's host time in one forward + backward (cProfile, ms):")
        for part, ms in breakdown.items():
            print(f"    {part:38}{ms:8.2f}")
        print(f"  Python-level calls: {report['python_calls']}; trace calls: {report['fulmen_trace_calls']}")
    return report


def small_rows() -> dict[str, Any]:
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
    return {
        "benchmark": "host overhead of a cache hit, a + b on 4-element CPU tensors",
        "us_per_call": results,
        "added_us_over_eager": {k: v - eager for k, v in results.items()},
        "region_call": {
            "benchmark": REGION,
            "us_per_call": regions,
            "added_us_over_eager": {k: v - regions["eager"] for k, v in regions.items()},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/overhead.json")
    parser.add_argument("--rows", choices=("all", "small", "deep"), default="all")
    parser.add_argument("--deep_layers", type=int, default=22)
    parser.add_argument("--deep_compilers", default=",".join(DEEP_COMPILERS))
    parser.add_argument("--number", type=int, default=10, help="calls per timed run of the deep rows")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per deep candidate")
    parser.add_argument("--profiled", type=int, default=20, help="forward + backward calls the breakdown profiles")
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                              "cores": _cores()}
    if args.rows in ("all", "small"):
        report.update(small_rows())
    if args.rows in ("all", "deep"):
        report["deep_thin"] = deep_rows(args.deep_layers, tuple(args.deep_compilers.split(",")), args.number,
                                        args.repeats, args.profiled)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


def _cores() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

if __name__ == "__main__":
    main()
