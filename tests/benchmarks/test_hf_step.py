"""benchmarks/hf_step.py on CPU with tiny Hugging Face models: every row of every family trains to eager's loss."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

HF_STEP = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_step.py"


def test_hf_step_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmarks_hf_step", HF_STEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "hf_step.json"
    argv = "--device cpu --dtype fp32 --tiny --seq_len 16 --micro_batch_size 2 --iters 2 --warmup 1"
    module.main([*argv.split(), "--families", "llama,gemma3", "--compilers", "eager,fulmen,fulmen.dynamo",
                 "--out", str(out)])
    families = json.loads(out.read_text())["families"]
    assert list(families) == ["llama", "gemma3"]
    for family, report in families.items():
        results = report["results"]
        for name, result in results.items():
            assert result["status"] == "ok" and result["mode"] == "function", (family, name, result)
            assert result["params_with_grad"][0] == result["params_with_grad"][1]
            assert math.isclose(result["final_loss"], results["eager"]["final_loss"], rel_tol=1e-4), (family, name)
        assert results["eager"]["final_loss"] < results["eager"]["first_loss"]
        assert "fulmen" in results["fulmen.dynamo"]["dynamo_report"]
        assert report["config"]["model_type"] == {"llama": "llama", "gemma3": "gemma3_text"}[family]
