"""`python -m fulmen.pretrain`: every shipped config parses, the default run trains (its loss falls), resuming
from a mid-run checkpoint reproduces the uninterrupted run's later losses exactly, bad configurations fail before
anything is written, and a 2-process CPU run with FSDP and fulmen trains and checkpoints."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from litgpt.args import EvalArgs, TrainArgs

from fulmen.pretrain import cli

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def short(**overrides) -> TrainArgs:
    args = dict(save_interval=10, log_interval=5, global_batch_size=8, micro_batch_size=4, max_steps=20,
                max_seq_length=64, lr_warmup_steps=3, max_norm=1.0, min_lr=1e-4)
    return TrainArgs(**{**args, **overrides})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    source = yaml.safe_load(path.read_text())
    for key, value in source.items():  # what the file sets is what the CLI resolved
        if not isinstance(value, dict):
            assert printed[key] == value, key
    assert len(CONFIGS) >= 6


def test_default_pretraining_trains_logs_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    result = cli.setup(out_dir=out, train=short(max_steps=40), eval=EvalArgs(interval=20, max_iters=2))
    losses = result["losses"]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.5  # from ~5.5 (256 byte ids) well down
    assert set(result["val_losses"]) == {20, 40} and result["val_losses"][40] < 3.5
    assert sorted(p.name for p in out.glob("step-*")) == ["step-00000010", "step-00000020", "step-00000030",
                                                          "step-00000040"]
    saved = torch.load(out / "final" / "lit_model.pth", weights_only=True)
    assert saved["step_count"] == 40 and saved["iter_num"] == 80 and "state" in saved["optimizer"]
    assert (out / "final" / "model_config.yaml").is_file()
    rows = list(csv.DictReader(next(out.glob("logs/**/metrics.csv")).open()))
    logged = [float(r["loss"]) for r in rows if r.get("loss")]
    assert len(logged) == 8 and logged[-1] < logged[0]
    assert any(r.get("summary/median_ms_per_iter") for r in rows)
    summary = result["summary"]
    assert summary["steps"] == 40 and summary["median_ms_per_iter"] > 0 and summary["tokens_per_s"] > 0


def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
    no_eval = EvalArgs(interval=0, final_validation=False)
    whole = cli.setup(out_dir=tmp_path / "whole", train=short(), eval=no_eval)
    # a run that starts from the uninterrupted one's mid-run checkpoint: model, optimizer, step and data position
    resumed = cli.setup(out_dir=tmp_path / "resumed", train=short(), eval=no_eval,
                        resume=tmp_path / "whole" / "step-00000010")
    assert resumed["step_count"] == 20
    assert resumed["losses"] == whole["losses"][10:]
    # resume: auto picks the latest step-* of out_dir (here the run is complete: nothing left to train)
    again = cli.setup(out_dir=tmp_path / "whole", train=short(), eval=no_eval, resume="auto")
    assert again["losses"] == [] and again["step_count"] == 20


@pytest.mark.parametrize(("argv", "match"), [
    (["--model_name", "no-such-model"], "model_name 'no-such-model' is not a LitGPT config name"),
    (["--model_name", "pythia-14m", "--model_config", '{"n_layer": 1}'], "mutually exclusive"),
    (["--train.global_batch_size", "10", "--train.micro_batch_size", "4"], "must be a multiple of"),
    (["--compiler", "torch", "--executors", "[sdpa]"], "executors are fulmen's and need compiler: fulmen"),
    (["--compiler", "null", "--cuda_graphs", "true"], "cuda_graphs is fulmen's and needs compiler: fulmen"),
    (["--compiler", "null", "--strategy", "fsdp"], "strategy fsdp is fulmen's ThunderFSDPStrategy"),
    (["--executors", "[sdpa, nvfuser]"], "unknown executor 'nvfuser'"),
    (["--compiler", "torch", "--offload", "0.5"], "offload is fulmen's and needs compiler: fulmen"),
    (["--offload", "1.5"], r"OffloadOptions.fraction must be a number in \(0, 1\]"),
    (["--compiler", "torch", "--activation_memory_budget", "0.5"], "activation_memory_budget is fulmen's"),
    (["--activation_memory_budget", "1.5"], r"activation_memory_budget must be a number in \[0, 1\]"),
    (["--resume", "true"], "resume: True, but .* holds no complete step-\\*/lit_model.pth"),
    (["--train.max_seq_length", "4096"], "exceeds the model's block_size"),
    (["--train.max_steps", "0"], "train.max_steps must be a positive integer or null, got 0"),
    (["--train.max_tokens", "1000"], "give exactly one of train.max_steps and train.max_tokens"),
    (["--tokenizer_dir", "/no/such/dir"], "tokenizer_dir: no directory"),
    (["--model_name", "pythia-14m", "--data", "TinyStories"], "needs a tokenizer"),
])
def test_bad_configurations_fail_before_writing(tmp_path, argv, match):
    out = tmp_path / "run"
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        cli.parse_and_run(["--out_dir", str(out), *argv])
    assert not out.exists()


@pytest.mark.parametrize("key", ["--train.micro_batch", "--train.no_such_field", "--no_such_option"])
def test_unknown_keys_are_named(tmp_path, capsys, key):
    with pytest.raises(SystemExit):  # an abbreviation of a key is unknown too, not a guess
        cli.main(["--out_dir", str(tmp_path / "run"), key, "4"])
    assert key.lstrip("-").split(".")[-1] in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_two_process_fsdp_pretraining(tmp_path):
    out = tmp_path / "fsdp"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    command = [sys.executable, "-m", "fulmen.pretrain", "--devices", "2", "--strategy", "fsdp",
               "--fsdp.state_dict_type", "sharded", "--out_dir", str(out), "--train.max_steps", "8",
               "--train.save_interval", "4", "--train.log_interval", "4", "--train.global_batch_size", "8",
               "--train.micro_batch_size", "2", "--train.max_seq_length", "64", "--eval.interval", "0"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = [line for line in done.stdout.splitlines() if line.startswith("iter ")]
    losses = [float(line.split("| loss ")[1].split(" ")[0]) for line in logged]
    assert len(losses) == 2 and losses[1] < losses[0]
    for step in ("step-00000004", "step-00000008", "final"):
        assert (out / step / "lit_model.pth" / ".metadata").is_file(), step  # sharded: DCP directories


@pytest.mark.skipif(any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")),
                    reason="tensorboard is installed")
def test_tensorboard_logger_without_tensorboard_says_how_to_fix(tmp_path):
    with pytest.raises(ValueError, match=r"needs the tensorboard package \(pip install tensorboard\)"):
        cli.parse_and_run(["--out_dir", str(tmp_path / "run"), "--logger_name", "tensorboard"])
    assert not (tmp_path / "run").exists()


def test_root_script_is_the_same_cli(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--config", str(ROOT / "configs/tiny.yaml"),
                           "--print_config"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert yaml.safe_load(done.stdout)["model_config"]["name"] == "fulmen-tiny"


def test_clipping_happens(tmp_path):
    no_eval = EvalArgs(interval=0, final_validation=False)
    runs = {norm: cli.setup(out_dir=tmp_path / str(norm), train=short(max_steps=4, save_interval=None, max_norm=norm),
                            eval=no_eval)["losses"] for norm in (None, 1e-3)}
    assert runs[None][0] == runs[1e-3][0]  # the same first forward
    assert runs[None][1:] != runs[1e-3][1:]  # but a tiny max_norm scales every update down
    assert runs[1e-3][-1] > runs[None][-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason fulmen gives without CUDA")
def test_cuda_graphs_key_reaches_fulmen(tmp_path):
    # on a machine without CUDA fulmen declines the graphs with its reason, and the run trains as without them
    no_eval = EvalArgs(interval=0, final_validation=False)
    with pytest.warns(UserWarning, match="forward_and_loss runs without CUDA graphs"):
        graphed = cli.setup(out_dir=tmp_path / "graphs", train=short(max_steps=3), eval=no_eval, cuda_graphs=True)
    # (cuda_graphs keeps the whole step off: the plain run takes the same path)
    plain = cli.setup(out_dir=tmp_path / "plain", train=short(max_steps=3), eval=no_eval, whole_step=False)
    assert graphed["losses"] == plain["losses"]
