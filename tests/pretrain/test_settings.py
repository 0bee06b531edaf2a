"""`python -m fulmen.pretrain` accepts nothing silently: every bad setting is refused before anything is written,
naming the key, the value and what is allowed; the optimizer's arguments change from the command line as in
LitGPT; a `--config` after a flag it would override is refused; `--model_config.<key>` changes the model the run
would otherwise train; an unwritable out_dir is refused up front."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fulmen.pretrain import cli

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = str(ROOT / "configs" / "tiny.yaml")
ONE_STEP = ["--compiler", "null", "--train.max_steps", "1", "--train.save_interval", "0", "--train.global_batch_size",
            "4", "--train.micro_batch_size", "4", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "0",
            "--train.min_lr", "0", "--eval.interval", "0", "--eval.final_validation", "false"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--train.max_norm", "-1"], "train.max_norm must be a positive number, or null (no clipping), got -1.0"),
    (["--train.max_norm", "0"], "train.max_norm must be a positive number, or null (no clipping), got 0.0"),
    (["--train.global_batch_size", "0"], "train.global_batch_size must be a positive integer, got 0"),
    (["--eval.max_iters", "0"], "eval.max_iters must be a positive integer, got 0"),
    (["--train.max_seq_length", "0"], "train.max_seq_length must be a positive integer, or null (the model's "
                                      "block_size), got 0"),
    (["--train.max_seq_length", "-5"], "train.max_seq_length must be a positive integer, or null (the model's "
                                       "block_size), got -5"),
    (["--train.save_interval", "-1"], "train.save_interval must be a positive number of steps, or 0 / null (only "
                                      "the final checkpoint), got -1"),
    (["--train.micro_batch_size", "0"], "train.micro_batch_size must be a positive integer, got 0"),
    (["--devices", "0"], "devices must be a positive integer or 'auto', got 0"),
    (["--num_nodes", "0"], "num_nodes must be a positive integer, got 0"),
    (["--train.log_interval", "0"], "train.log_interval must be a positive number of steps, got 0"),
    (["--seed", "-1"], "seed must be an integer in [0, 2**32 - 1] (Lightning seeds 0 instead of one outside), got -1"),
    (["--train.lr_warmup_steps", "-1"], "train.lr_warmup_steps must be an integer >= 0, or null, got -1"),
    (["--train.lr_warmup_steps", "null", "--train.lr_warmup_fraction", "0.1"],
     "train.lr_warmup_fraction must be null: fulmen.pretrain warms up over train.lr_warmup_steps, got 0.1"),
    (["--train.epochs", "2"], "train.epochs must be null: fulmen.pretrain stops after train.max_steps or "
                              "train.max_tokens, got 2"),
    (["--train.max_time", "60"], "train.max_time must be null"),
    (["--train.tie_embeddings", "true"], "train.tie_embeddings must be null or false"),
    (["--eval.max_new_tokens", "5"], "eval.max_new_tokens must be null: LitGPT's finetuning generates text"),
    (["--train.min_lr", "0.1"], "train.min_lr (0.1) must be at most the optimizer's lr (0.003)"),
    (["--optimizer.lr", "-1"], "optimizer: torch.optim.adamw.AdamW refuses its arguments: ValueError: Invalid "
                               "learning rate: -1.0"),
    (["--optimizer", "SGD", "--optimizer.momentum", "-0.5"], "optimizer: torch.optim.sgd.SGD refuses its "
                                                             "arguments: ValueError: Invalid momentum value: -0.5"),
    (["--model_config.n_layer", "0"], "model_config.n_layer must be a positive integer, got 0"),
    (["--model_config.rotary_percentage", "0"], "model_config.rotary_percentage must be a number in (0, 1], got 0.0"),
    (["--model_config.n_query_groups", "3"], "model_config.n_query_groups (3) must divide model_config.n_head (4)"),
])
def test_bad_settings_are_named_before_anything_is_written(tmp_path, argv, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError) as error:
        cli.parse_and_run(["--out_dir", str(out), *argv])
    assert message in str(error.value)
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["--optimizer.init_args.lr", "0.5"],
    ["--optimizer.lr", "0.5"],
    ["--optimizer", "AdamW", "--optimizer.lr", "0.5"],
    ["--optimizer", "SGD", "--optimizer.lr", "0.5", "--optimizer.momentum", "0.9"],
], ids=["init_args.lr", "lr", "AdamW-lr", "SGD-lr-momentum"])
def test_optimizer_arguments_from_the_command_line_train(tmp_path, argv):
    out = tmp_path / "run"
    cli.main(["--out_dir", str(out), *ONE_STEP, *argv])
    groups = torch.load(out / "final" / "lit_model.pth", weights_only=True)["optimizer"]["param_groups"]
    assert groups[0]["lr"] == 0.5  # the lr of the step trained (no warmup, a 1-step cosine starts at the peak)
    if "SGD" in argv:
        assert groups[0]["momentum"] == 0.9 and "betas" not in groups[0]
    else:
        assert tuple(groups[0]["betas"]) == (0.9, 0.95) and groups[0]["weight_decay"] == 0.1  # the defaults kept


def test_an_unknown_optimizer_argument_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--out_dir", str(tmp_path / "run"), "--optimizer.lrr", "0.5"])
    assert "lrr" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_python_api_names_a_dict_without_class_path(tmp_path):
    with pytest.raises(ValueError, match=r"optimizer must be a torch.optim class name or \{class_path, init_args\}, "
                                         r"got \{'lr': 0.5\}"):
        cli.setup(out_dir=tmp_path / "run", optimizer={"lr": 0.5})
    assert not (tmp_path / "run").exists()


def printed_config(capsys, argv: list[str]) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_a_config_file_after_a_flag_it_overrides_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tiny.yaml's out_dir is relative
    with pytest.raises(ValueError, match="a --config file given after other flags overrides them: out_dir, "
                                         "train.max_steps. The later argument wins .* put --config first"):
        cli.parse_and_run(["--out_dir", "mine", "--train.max_steps", "3", "--config", TINY_YAML])
    assert list(tmp_path.iterdir()) == []
    # flags after the file override it; a flag before it that the file does not set stays
    printed = printed_config(capsys, ["--precision", "32-true", "--config", TINY_YAML, "--out_dir", "mine"])
    assert printed["out_dir"] == "mine" and printed["precision"] == "32-true" and printed["train"]["max_steps"] == 400


def test_model_config_keys_change_the_model_the_run_would_train(tmp_path, capsys):
    printed = printed_config(capsys, ["--model_config.parallel_residual", "true"])["model_config"]
    assert (printed["name"], printed["n_layer"], printed["n_embd"], printed["parallel_residual"]) == \
        ("fulmen-tiny", 2, 64, True)  # the embedded tiny model, not LitGPT's 16-layer default
    printed = printed_config(capsys, ["--model_name", "pythia-14m", "--model_config.n_layer", "1"])
    assert printed["model_name"] is None
    assert (printed["model_config"]["name"], printed["model_config"]["n_layer"], printed["model_config"]["n_embd"]) \
        == ("pythia-14m", 1, 128)
    printed = printed_config(capsys, ["--config", TINY_YAML, "--model_config.n_layer", "3"])["model_config"]
    assert (printed["n_layer"], printed["n_embd"]) == (3, 64)
    with pytest.raises(SystemExit):  # --print_config anywhere
        cli.main(["--print_config", "--model_config.n_layer", "3"])
    assert yaml.safe_load(capsys.readouterr().out)["model_config"]["n_embd"] == 64
    # and the run trains that model
    out = tmp_path / "run"
    cli.main(["--out_dir", str(out), *ONE_STEP, "--model_config.rotary_percentage", "0.5"])
    saved = yaml.safe_load((out / "final" / "model_config.yaml").read_text())
    assert (saved["n_layer"], saved["n_embd"], saved["rotary_percentage"]) == (2, 64, 0.5)
    # from Python, a name and a config are still one too many
    with pytest.raises(ValueError, match=r"model_name \(pythia-14m\) and model_config are mutually exclusive"):
        cli.setup(out_dir=tmp_path / "both", model_name="pythia-14m", model_config=cli.TINY)


def test_an_unwritable_out_dir_is_refused_up_front(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"out_dir {blocker}/run cannot be made: {blocker} is a file"):
        cli.parse_and_run(["--out_dir", str(blocker / "run")])
    with pytest.raises(ValueError, match=f"out_dir {blocker} is a file, not a directory"):
        cli.parse_and_run(["--out_dir", str(blocker)])
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match=f"out_dir {locked}/run: no permission to write in {locked}"):
            cli.parse_and_run(["--out_dir", str(locked / "run")])
        assert list(locked.iterdir()) == []


@pytest.mark.parametrize(("argv", "line"), [
    (["--train.micro_batch_size", "0"], "error: train.micro_batch_size must be a positive integer, got 0"),
    (["--devices", "0"], "error: devices must be a positive integer or 'auto', got 0"),
    (["--resume", "/no/such/checkpoint"], "error: resume: no checkpoint at /no/such/checkpoint"),
    (["--model_config.n_head", "3"], "error: model_config.n_query_groups (2) must divide model_config.n_head (3)"),
    (["--executors", "[nope]"], "error: unknown executor 'nope'"),
    (["--activation_memory_budget", "2"], "error: JitOptions.activation_memory_budget"),
    (["--offload", "2"], "error: OffloadOptions.fraction"),
])
def test_the_command_line_prints_a_refused_setting_as_one_error_line(tmp_path, capsys, argv, line):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--out_dir", str(out), *argv])
    assert exit_info.value.code == 2
    (printed,) = capsys.readouterr().err.splitlines()  # no traceback before it
    assert printed.startswith(line), printed
    assert not out.exists()


def test_an_out_dir_the_file_system_cannot_hold_is_one_error_line(tmp_path):
    # /proc admits root's write permission but makes no folders: found by making one, not by reading permissions
    done = subprocess.run([sys.executable, "-m", "fulmen.pretrain", "--out_dir", "/proc/fulmen/run"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()  # no traceback
    assert line.startswith("error: out_dir /proc/fulmen/run "), line
    assert list(tmp_path.iterdir()) == []
