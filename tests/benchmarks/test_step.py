"""benchmarks/step.py on CPU with a one-layer pythia-14m: eager and fulmen both run and reach the same loss."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

STEP = Path(__file__).resolve().parents[2] / "benchmarks" / "step.py"


def _load_step():
    spec = importlib.util.spec_from_file_location("benchmarks_step", STEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_benchmark_smoke(tmp_path):
    out = tmp_path / "step.json"
    argv = "--device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 32 --micro_batch_size 2"
    argv += f" --iters 2 --warmup 1 --compilers eager,fulmen,fulmen+unsloth,fulmen-whole-step --out {out}"
    _load_step().main(argv.split())
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"eager", "fulmen", "fulmen+unsloth", "fulmen-whole-step"}
    for name, result in results.items():
        assert result["status"] == "ok", (name, result)
        assert result["ms_per_iter"] > 0 and len(result["iter_ms"]) == 2
        assert result["peak_gb"] is None and result["mfu"] is None  # CPU
        assert result["params_with_grad"][0] == result["params_with_grad"][1]
    assert results["fulmen"]["mode"] == "function"  # the cross-entropy was in fulmen's trace
    # same init, same batch, same optimizer: the losses after four AdamW steps agree
    # the unsloth kernels run under Triton's interpreter without a GPU; the whole step jits the optimizer's step too
    for name in ("fulmen", "fulmen+unsloth", "fulmen-whole-step"):
        assert math.isclose(results[name]["final_loss"], results["eager"]["final_loss"], rel_tol=1e-4), name
    assert results["eager"]["final_loss"] < results["eager"]["first_loss"]  # the steps trained
    ratios = report["ratios_vs_eager"]
    assert set(ratios) == set(results) and ratios["eager"]["ms_per_iter"] == 1.0
    for name, ratio in ratios.items():  # each row's time over the baseline's
        assert ratio["ms_per_iter"] == results[name]["ms_per_iter"] / results["eager"]["ms_per_iter"] > 0


def test_rounds_reverse_the_order_and_pool_the_timed_steps(tmp_path):
    out = tmp_path / "step.json"
    argv = "--device cpu --dtype fp32 --model_name pythia-14m --n_layer 1 --seq_len 16 --micro_batch_size 1"
    argv += f" --iters 2 --warmup 0 --compilers eager,fulmen --rounds 3 --out {out}"
    _load_step().main(argv.split())
    results = json.loads(out.read_text())["results"]
    assert [r["position"] for r in results["eager"]["rounds"]] == [0, 1, 0]
    assert [r["position"] for r in results["fulmen"]["rounds"]] == [1, 0, 1]
    for result in results.values():
        assert len(result["iter_ms"]) == 6
        assert result["ms_per_iter"] == statistics.median(result["iter_ms"])
        assert result["first_step_s"] == result["rounds"][0]["first_step_s"]
    assert math.isclose(results["fulmen"]["final_loss"], results["eager"]["final_loss"], rel_tol=1e-4)


def test_seed_002_preset_and_kernel_families():
    step = _load_step()
    args = step.parse_args(["--preset", "seed-002", "--micro_batch_size", "8"])  # flags override the preset
    assert (args.model_name, args.micro_batch_size, args.seq_len, args.dtype) == ("llmc-gpt2", 8, 64, "fp32")
    assert args.optimizer == "adam" and args.tf32 is False
    assert step.parse_args([]).model_name == "tiny-llama-1.1b"
    model = step.build_model(step.parse_args(["--preset", "seed-002", "--n_layer", "1"]), "meta", step.DTYPES["fp32"])
    assert step.loss_function(model) is step.forward_and_own_loss
    # names of kernels an H200 profile showed (benchmarks/step_tinyllama_h200.json)
    families = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0":
            "attention",
        "triton_per_fused__to_copy_add_div_expand_mul_sum_view_0": "triton",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor": "adam",
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>": "other",
        "Memset (Device)": "other",
    }
    for name, family in families.items():
        assert step.kernel_family(name) == family, name
