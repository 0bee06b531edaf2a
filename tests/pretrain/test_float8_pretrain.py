"""`float8: <recipe>` in a pretrain config (or `--float8`) trains forward_and_loss with fulmen's float8 matmuls, and
its misuses are refused before anything is written."""

from __future__ import annotations

import pytest
from litgpt.args import EvalArgs, TrainArgs

import fulmen
from fulmen.pretrain import cli, run
from fulmen.transforms.float8 import notes_of

SHORT = TrainArgs(
    save_interval=None,
    log_interval=1,
    global_batch_size=4,
    micro_batch_size=4,
    max_steps=3,
    max_seq_length=64,
    lr_warmup_steps=0,
    max_norm=1.0,
    min_lr=1e-4,
)
NO_EVAL = EvalArgs(interval=0, final_validation=False)


def test_float8_key_trains_with_float8_matmuls(tmp_path, monkeypatch):
    jitted = []
    compile_loss = run.compile_loss
    monkeypatch.setattr(run, "compile_loss", lambda settings: jitted.append(compile_loss(settings)) or jitted[-1])
    result = cli.setup(out_dir=tmp_path / "f8", train=SHORT, eval=NO_EVAL, float8="rowwise")
    plain = cli.setup(out_dir=tmp_path / "plain", train=SHORT, eval=NO_EVAL)
    notes = notes_of(fulmen.last_traces(jitted[0]))
    # the embedded tiny model: 2 layers of qkv, proj, fc_1, fc_2, mlp.proj; the head fused with its loss
    assert sum(note.startswith("converted transformer.h.") for note in notes) == 10
    forward = str(fulmen.last_traces(jitted[0])[-1])
    assert "float8.scaled_mm" in forward and "power_of_2=True" in forward  # rowwise's scales
    losses, reference = result["losses"], plain["losses"]
    assert losses != reference and abs(losses[0] - reference[0]) < 0.01 * reference[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--float8", "tensorwise", "--compiler", "torch"],
            "float8 is fulmen's and needs compiler: fulmen, got compiler: torch",
        ),
        (
            ["--float8", "rowwise", "--fsdp.float8_all_gather", "true", "--strategy", "fsdp"],
            "fsdp.float8_all_gather needs strategy: fsdp and float8: tensorwise, got strategy: fsdp, float8: rowwise",
        ),
        (
            ["--float8", "tensorwise", "--fsdp.float8_all_gather", "true"],
            "fsdp.float8_all_gather needs strategy: fsdp and float8: tensorwise, got strategy: auto",
        ),
    ],
)
def test_float8_misuse_is_refused_before_anything_is_written(tmp_path, argv, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError) as error:
        cli.parse_and_run(["--out_dir", str(out), *argv])
    assert message in str(error.value)
    assert not out.exists()
