"""Pretraining with the whole step (issue 50, `whole_step: true`, the default): each step's last micro-batch, its
clipping and the optimizer's step are one jitted program, the earlier micro-batches a jitted forward and backward.
With gradient accumulation, clipping and the warm-up + cosine learning rate, in one trace per program, the losses
are bit for bit those of `whole_step: false` (the loop of forward_and_loss, backward and optimizer.step, which the
settings the whole step does not apply to also take) and eager's (compiler: null) to the fused loss's rounding."""

from __future__ import annotations

import pytest
from litgpt.args import EvalArgs, TrainArgs

import fulmen
from fulmen.pretrain import cli
from fulmen.pretrain import run as pretrain_run

NO_EVAL = EvalArgs(interval=0, final_validation=False)


def _train(**overrides) -> TrainArgs:
    args = dict(save_interval=None, log_interval=5, global_batch_size=8, micro_batch_size=4, max_steps=4,
                max_seq_length=32, lr_warmup_steps=2, max_norm=1.0, min_lr=1e-4)
    return TrainArgs(**{**args, **overrides})


@pytest.fixture
def programs(monkeypatch):
    made = []

    def compile_step(settings):
        made.append(original(settings))
        return made[-1]

    original = pretrain_run.compile_step
    monkeypatch.setattr(pretrain_run, "compile_step", compile_step)
    return made


def test_whole_step_trains_as_eager_with_accumulation_and_clipping(tmp_path, programs):
    whole = cli.setup(out_dir=tmp_path / "whole", train=_train(), eval=NO_EVAL)
    (accumulate_fn, step_fn), = programs
    split = cli.setup(out_dir=tmp_path / "split", train=_train(), eval=NO_EVAL, whole_step=False)
    eager = cli.setup(out_dir=tmp_path / "eager", train=_train(), eval=NO_EVAL, compiler=None)
    # bit for bit (float equality of every step's loss) with the jitted forward's loop, which fuses the head and
    # loss the same way; eager's to the fused loss's rounding
    assert whole["losses"] == split["losses"]
    assert whole["losses"] != eager["losses"] and pytest.approx(eager["losses"], rel=1e-5) == whole["losses"]
    # 2 micro-batches a step: the first of each step through one trace, the last with the step through another
    assert (fulmen.cache_misses(accumulate_fn), fulmen.cache_hits(accumulate_fn)) == (1, 3)
    assert (fulmen.cache_misses(step_fn), fulmen.cache_hits(step_fn)) == (1, 3)
    step = str(fulmen.last_traces(step_fn)[-1])
    assert step.count("optim.adam_update_(") > 0 and "optim.adam_update(" not in step


def test_whole_step_off_takes_the_loop(tmp_path, programs, capsys):
    cli.setup(out_dir=tmp_path / "off", train=_train(max_steps=2), eval=NO_EVAL, whole_step=False)
    cli.setup(out_dir=tmp_path / "budget", train=_train(max_steps=2), eval=NO_EVAL, activation_memory_budget=0.5)
    assert programs == []
    assert "whole_step: each step runs as forward_and_loss, backward and optimizer.step (activation_memory_budget " \
           "below 1)" in capsys.readouterr().out
